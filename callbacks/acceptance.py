"""In-loop real acceptance: speculative decoding against the target while training runs."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only

from lilicorr_pl.decoding.benchmarks import PromptSet, load_prompts
from lilicorr_pl.decoding.evaluate import evaluate_arm
from lilicorr_pl.heads.top1 import Top1Selector


class AcceptanceEval(L.Callback):
    """Runs real speculative decoding on a fixed prompt set and logs ``eval/tau`` (with bonus token).

    Logs ``eval/tau`` (the system's own head), ``eval/<benchmark>/tau``, ``eval/tau_top1`` (the same
    drafter with per-slot top-1, for comparison), per-position acceptance and, with W&B, a histogram,
    an acceptance plot and a table of drafted versus accepted tokens. Works on whatever device the
    model is on, skips sanity checks, and can be the ``ModelCheckpoint`` monitor (``eval/tau``, max).
    Every rank decodes its own slice of the prompts and the metrics are summed across ranks.

    Args:
        every_n_train_steps: run every N optimizer steps (None/0 = never on steps).
        on_validation_end: also run at the end of each validation loop.
        benchmark: ``humaneval``, ``stdlib-heldout``, a paper benchmark name, or a prompts ``.jsonl``.
        num_prompts: prompts decoded per evaluation.
        max_new_tokens: tokens generated per prompt.
        temperature: 0 = greedy (lossless against greedy decoding), > 0 samples.
        chat_template: wrap prompts in the tokenizer's chat template (None = by benchmark kind).
        compare_top1: also decode with per-slot top-1 and log ``eval/tau_top1``.
        table_rows: prompts shown in the W&B table of drafted/accepted tokens.
        seed: sampling seed (T > 0).
    """

    def __init__(
        self,
        every_n_train_steps: int | None = 200,
        on_validation_end: bool = True,
        benchmark: str = "humaneval",
        num_prompts: int = 16,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        chat_template: bool | None = None,
        compare_top1: bool = True,
        table_rows: int = 3,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if num_prompts < 1 or max_new_tokens < 1:
            raise ValueError("AcceptanceEval needs num_prompts >= 1 and max_new_tokens >= 1")
        self.every_n_train_steps = every_n_train_steps or 0
        self.run_on_validation_end = on_validation_end
        self.benchmark = benchmark
        self.num_prompts = num_prompts
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.chat_template = chat_template
        self.compare_top1 = compare_top1
        self.table_rows = table_rows
        self.seed = seed
        self._prompts: PromptSet | None = None
        self._last_step = -1
        self.last_results: dict[str, Any] = {}

    # ------------------------------------------------------------------ hooks
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        step = trainer.global_step
        if self.every_n_train_steps and step > 0 and step % self.every_n_train_steps == 0:
            self.evaluate(trainer, pl_module)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        if self.run_on_validation_end and not trainer.sanity_checking:
            self.evaluate(trainer, pl_module)

    # ------------------------------------------------------------------ work
    def _prompt_set(self, pl_module: Any) -> PromptSet:
        if self._prompts is None:
            tokenizer = pl_module.target.tokenizer
            if tokenizer is None:
                raise RuntimeError("AcceptanceEval needs the target's tokenizer; load the target with its tokenizer")
            self._prompts = load_prompts(
                self.benchmark, tokenizer, self.num_prompts, chat_template=self.chat_template, seed=self.seed
            )
        return self._prompts

    def evaluate(self, trainer: L.Trainer, pl_module: Any) -> dict[str, Any]:
        if trainer.sanity_checking or trainer.global_step == self._last_step:
            return self.last_results
        self._last_step = trainer.global_step
        target = pl_module._require_target()
        prompts = self._prompt_set(pl_module)
        # Each rank decodes a slice; sums are reduced across ranks below.
        rank, world = trainer.global_rank, trainer.world_size
        mine = PromptSet(prompts.name, prompts.input_ids[rank::world], prompts.texts[rank::world],
                         prompts.chat_template, prompts.enable_thinking, prompts.meta)
        arms = {"head": pl_module.head}
        if self.compare_top1 and not isinstance(pl_module.head, Top1Selector):
            arms["top1"] = Top1Selector()
        was_training = pl_module.training
        pl_module.eval()
        results = {}
        try:
            with torch.no_grad():
                for name, selector in arms.items():
                    results[name] = evaluate_arm(
                        target, pl_module.drafter, selector, mine, self.max_new_tokens, self.temperature,
                        seed=self.seed, record_examples=self.table_rows if rank == 0 else 0,
                    )
        finally:
            pl_module.train(was_training)
        logged = self._log(trainer, pl_module, results)
        self.last_results = logged
        return logged

    def _log(self, trainer: L.Trainer, pl_module: Any, results: dict[str, Any]) -> dict[str, Any]:
        # Reduce rank-local sums: tau is a ratio of sums, so reduce numerators and denominators.
        logged: dict[str, Any] = {}
        for name, r in results.items():
            rounds = torch.tensor(float(sum(r.histogram)), device=pl_module.device)
            tau_sum = torch.tensor(r.tau * float(sum(r.histogram)), device=pl_module.device)
            if trainer.world_size > 1:
                rounds = pl_module.all_gather(rounds).sum()
                tau_sum = pl_module.all_gather(tau_sum).sum()
            tau = float(tau_sum / rounds.clamp_min(1))
            suffix = "" if name == "head" else f"_{name}"
            logged[f"eval/tau{suffix}"] = tau
            logged[f"eval/{self.benchmark_key}/tau{suffix}"] = tau
            for k, p in enumerate(r.per_position_acceptance, start=1):
                logged[f"eval/acceptance{suffix}/pos{k:02d}"] = p
        for key, value in logged.items():
            # Logged through the LightningModule so ModelCheckpoint can monitor eval/tau.
            pl_module.log(key, value, rank_zero_only=True, sync_dist=False)
        self._log_media(trainer, results)
        return logged

    @property
    def benchmark_key(self) -> str:
        return self.benchmark.rsplit("/", 1)[-1].removesuffix(".jsonl")

    @rank_zero_only
    def _log_media(self, trainer: L.Trainer, results: dict[str, Any]) -> None:
        loggers = [lg for lg in trainer.loggers if isinstance(lg, WandbLogger)]
        if not loggers:
            return
        import wandb

        head = results["head"]
        rows = []
        for ex in head.examples:
            for rnd in ex["rounds"]:
                rows.append([ex["prompt"][-80:], str(rnd.get("drafted")), str(rnd.get("accepted")), rnd.get("acc")])
        xs = list(range(1, len(head.per_position_acceptance) + 1))
        series = [head.per_position_acceptance] + (
            [results["top1"].per_position_acceptance] if "top1" in results else []
        )
        keys = ["head"] + (["top1"] if "top1" in results else [])
        for lg in loggers:
            lg.log_table(key="eval/drafts", columns=["prompt", "drafted", "accepted", "acc"], data=rows,
                         step=trainer.global_step)
            lg.experiment.log(
                {
                    "eval/accepted_length_hist": wandb.Histogram(np_histogram=(head.histogram, list(range(len(head.histogram) + 1)))),
                    "eval/per_position_acceptance": wandb.plot.line_series(
                        xs=xs, ys=series, keys=keys, title="per-position conditional acceptance", xname="position"
                    ),
                },
                step=trainer.global_step,
            )
