"""In-loop real acceptance: speculative decoding against the target while training runs."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn

from lilicorr_pl.checkpoint import first_line
from lilicorr_pl.data.corpus import MIN_PREFIX_TOKENS
from lilicorr_pl.data.formats import resolve_chat_template
from lilicorr_pl.decoding.benchmarks import (
    PromptSet,
    ThinkingFlagUnknown,
    check_benchmark,
    keep_within_context,
    load_prompts,
    read_prompt_file,
)
from lilicorr_pl.decoding.evaluate import ArmResult, evaluate_arm, summarize
from lilicorr_pl.decoding.speculative import DRAFT_SAMPLING_RULES, DraftSamplingRule
from lilicorr_pl.heads.top1 import Top1Selector

TABLE_COLUMNS = ["prompt", "round", "anchor", "drafted", "target", "accepted", "acc"]


class AcceptanceEval(L.Callback):
    """Runs real speculative decoding on a fixed prompt set and logs ``eval/tau`` (with bonus token).

    Logs ``eval/tau`` (the system's own head), ``eval/<benchmark>/tau``, ``eval/tau_top1`` (the same
    drafter with per-slot top-1, for comparison), per-position acceptance
    ``eval/acceptance[_top1]/posKK``, ``eval/rounds`` (verify rounds behind ``eval/tau``),
    ``eval/tokens_per_s`` and, with W&B, a table of drafted versus accepted tokens, an
    accepted-length histogram and a per-position acceptance plot. Works on whatever device the model
    is on, skips sanity checks, and can be the ``ModelCheckpoint`` monitor (``eval/tau``, mode max).
    Every rank decodes its own slice of the prompts; the accepted-length histograms are summed across
    ranks, so every rank logs the same pooled values.

    Generation stops where the training data's did: at the stop ids recorded in the checkpoint the
    model was loaded from, else at the target's (:func:`lilicorr_pl.target.stop_token_ids`, the one
    place regeneration takes them from too), never at a list of its own.

    Scalars go straight to ``trainer.loggers`` at ``global_step`` and into ``trainer.callback_metrics``
    (for monitors) rather than through ``LightningModule.log``: they come from both a train-batch hook
    and a validation hook, at steps unrelated to ``log_every_n_steps``, and must not be averaged.

    Args:
        every_n_train_steps: run every N optimizer steps (None/0 = never on steps).
        on_validation_end: also run at the end of each validation loop (once per step at most).
        benchmark: ``humaneval``, ``stdlib-heldout``, a paper benchmark name, or a prompts ``.jsonl``.
        num_prompts: prompts decoded per evaluation (split across ranks).
        max_new_tokens: tokens generated per prompt.
        temperature: 0 = greedy (lossless against greedy decoding), > 0 samples.
        draft_sampling: the T > 0 rule: ``"proposal"`` (selectors sample their drafts and return
            ``q``; ``min(1, p/q)`` acceptance, as the serving engines do) or ``"point_mass"``
            (deterministic drafts accepted iff equal to the target's sample).
        chat_template: wrap prompts in the tokenizer's chat template (None = by benchmark kind).
        enable_thinking: the chat template's thinking flag. None (the default): the training data's, read
            from the data module (``data.enable_thinking``) or, outside a fit, from the checkpoint the
            model was loaded from; a value that contradicts the data module's is an error (DESIGN §9.7).
        prompt_tokens: token budget of each ``stdlib-heldout`` prefix.
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
        draft_sampling: DraftSamplingRule = "proposal",
        chat_template: bool | None = None,
        enable_thinking: bool | None = None,
        prompt_tokens: int = 64,
        compare_top1: bool = True,
        table_rows: int = 3,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if num_prompts < 1 or max_new_tokens < 2:  # 1: the prefill's token fills it, no round is drafted (τ NaN)
            raise ValueError(
                f"AcceptanceEval needs num_prompts >= 1 and max_new_tokens >= 2 (the token after the prompt is the "
                f"target's own; drafting starts at the second), got {num_prompts} and {max_new_tokens}"
            )
        if every_n_train_steps is not None and every_n_train_steps < 0:
            raise ValueError(f"AcceptanceEval every_n_train_steps must be >= 0 or None, got {every_n_train_steps}")
        if not (math.isfinite(temperature) and temperature >= 0):  # nan: a traceback at the first evaluation
            raise ValueError(f"AcceptanceEval temperature must be a finite number >= 0, got {temperature}")
        if table_rows < 0:
            raise ValueError(f"AcceptanceEval table_rows must be >= 0 (0: no table), got {table_rows}")
        if prompt_tokens < MIN_PREFIX_TOKENS:  # read only at the first evaluation, after training and before a save
            raise ValueError(f"AcceptanceEval prompt_tokens must be >= {MIN_PREFIX_TOKENS} (a code prefix with context "
                             f"before its header), got {prompt_tokens}")
        if draft_sampling not in DRAFT_SAMPLING_RULES:
            raise ValueError(
                f"AcceptanceEval draft_sampling must be one of {DRAFT_SAMPLING_RULES}, got {draft_sampling!r}"
            )
        if not every_n_train_steps and not on_validation_end:
            raise ValueError("AcceptanceEval would never run: set every_n_train_steps or on_validation_end=True")
        # A misspelt name: refused when the callback is built, not at its first evaluation, after hours of training
        # and before the first checkpoint is saved (a missing file or package: by check_run, when it will evaluate;
        # perf and predict build the callbacks of a run's config too, and never read its prompts).
        check_benchmark(benchmark, "AcceptanceEval benchmark", files=False)
        self.every_n_train_steps = every_n_train_steps or 0
        self.run_on_validation_end = on_validation_end
        self.benchmark = benchmark
        self.num_prompts = num_prompts
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.draft_sampling = draft_sampling
        self.chat_template = chat_template
        self.enable_thinking = enable_thinking
        self.prompt_tokens = prompt_tokens
        self.compare_top1 = compare_top1
        self.table_rows = table_rows
        self.seed = seed
        self._prompts: PromptSet | None = None
        self._tokenizer: Any = None
        self._stop_token_ids: list[int] | None = None
        self.prompts_cut_to_context = 0
        self._last_step = -1
        self.last_results: dict[str, float] = {}
        self.history: list[tuple[int, dict[str, float]]] = []
        """``(global_step, logged scalars)`` of every evaluation, in order."""

    # ------------------------------------------------------------------ hooks
    def check_run(self, pl_module: Any) -> None:
        """Before the data are prepared (``lilicorr fit``/``validate`` call it): the prompts file (or the package of the
        benchmark's prompts) is there, and ``max_new_tokens`` leaves room for a prompt in the target's context; longer
        prompts are cut to fit when they are loaded (:meth:`prompt_set`)."""
        check_benchmark(self.benchmark, "AcceptanceEval benchmark")
        if self.benchmark.endswith(".jsonl"):  # a malformed line: a traceback at the first evaluation, after training
            try:
                read_prompt_file(self.benchmark, self.num_prompts)
            except ValueError as err:
                raise ValueError(f"AcceptanceEval benchmark: {first_line(err)}") from None
        context = self._context(pl_module)
        if context is not None and self.max_new_tokens >= context:
            raise ValueError(f"AcceptanceEval max_new_tokens {self.max_new_tokens} leaves no room for a prompt in the "
                             f"target's context of {context} positions; lower it below {context}")

    @staticmethod
    def _context(pl_module: Any) -> int | None:
        config = getattr(getattr(pl_module, "drafter", None), "target_config", None)
        return getattr(config, "max_position_embeddings", None)

    def setup(self, trainer: L.Trainer, pl_module: Any, stage: str) -> None:
        self._last_step = -1  # once per step within a run: a validate after a fit, at its last step, evaluates too

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        step = trainer.global_step
        if self.every_n_train_steps and step > 0 and step % self.every_n_train_steps == 0:
            self.evaluate(trainer, pl_module)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        if self.run_on_validation_end:
            self.evaluate(trainer, pl_module)

    # ------------------------------------------------------------------ work
    @property
    def benchmark_key(self) -> str:
        """The benchmark's short name in metric keys: a prompts file by its stem."""
        return self.benchmark.replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".jsonl")

    def thinking_flag(self, trainer: Any, pl_module: Any) -> bool | None:
        """The chat template's thinking flag of the training data: the data module's, else the checkpoint's."""
        datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
        data_flag = getattr(datamodule, "enable_thinking", None)
        saved = (getattr(pl_module, "checkpoint_meta", None) or {}).get("enable_thinking")
        trained = data_flag if data_flag is not None else saved
        if trained is None:  # unknown: an error only if the prompts go through the chat template (prompt_set)
            return None if self.enable_thinking is None else bool(self.enable_thinking)
        if self.enable_thinking is not None and bool(self.enable_thinking) != bool(trained):
            source = "data.enable_thinking" if data_flag is not None else "the checkpoint's enable_thinking"
            raise ValueError(
                f"AcceptanceEval enable_thinking={self.enable_thinking} contradicts {source}={trained}: the drafter "
                "would be measured on prompts rendered unlike its training data; leave enable_thinking unset"
            )
        return bool(trained)

    @staticmethod
    def data_template(trainer: Any, pl_module: Any) -> str | None:
        """The chat template the training data was rendered with: the data module's ``data.chat_template`` (None: the
        tokenizer's), else, outside a fit, the one the checkpoint records; prompts through the chat template are
        rendered with it, as ``lilicorr bench`` renders them (they were rendered with the tokenizer's own)."""
        datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
        if datamodule is not None and hasattr(datamodule, "chat_template"):
            template = datamodule.chat_template
        else:
            template = (getattr(pl_module, "checkpoint_meta", None) or {}).get("chat_template")
        return resolve_chat_template(template, option="data.chat_template")

    def stop_token_ids(self, pl_module: Any) -> list[int]:
        """Where generation stops: the checkpoint's recorded stop ids, else the target's (one place for both)."""
        if self._stop_token_ids is None:
            saved = (getattr(pl_module, "checkpoint_meta", None) or {}).get("stop_token_ids")
            stops = saved if saved is not None else pl_module._require_target().stop_token_ids()
            self._stop_token_ids = [int(t) for t in stops]
        return self._stop_token_ids

    def prompt_set(self, pl_module: Any, trainer: Any = None) -> PromptSet:
        """The fixed prompts (loaded and tokenized once, with the training data's thinking flag)."""
        if self._prompts is None:
            tokenizer = pl_module._require_target().tokenizer
            if tokenizer is None:
                raise RuntimeError("AcceptanceEval needs the target's tokenizer, and the target's folder holds none; "
                                   "save the target's tokenizer beside its weights (tokenizer.save_pretrained)")
            trainer = trainer if trainer is not None else pl_module._trainer
            thinking = self.thinking_flag(trainer, pl_module)
            self._tokenizer = tokenizer
            try:
                prompts = load_prompts(
                    self.benchmark, tokenizer, self.num_prompts, chat_template=self.chat_template,
                    enable_thinking=thinking, seed=self.seed, prefix_tokens=self.prompt_tokens,
                    template=self.data_template(trainer, pl_module),
                )
            except ThinkingFlagUnknown:
                raise ValueError(
                    "AcceptanceEval cannot tell the training data's thinking flag for its chat-template prompts: "
                    "there is no data module with enable_thinking and the model was not loaded from a checkpoint "
                    "that records it; set AcceptanceEval(enable_thinking=...) to the flag the data was rendered with"
                ) from None
            # Decoding past the positions the target was trained on measures nothing: a prompt that leaves too few
            # for max_new_tokens is cut to its last tokens (as the demo's benchmark does), said once, and counted.
            context = self._context(pl_module)
            self._prompts, self.prompts_cut_to_context = keep_within_context(prompts, context, self.max_new_tokens)
            if self.prompts_cut_to_context:
                rank_zero_warn(
                    f"AcceptanceEval: {self.prompts_cut_to_context} of {len(prompts.input_ids)} {self.benchmark_key} "
                    f"prompts leave fewer than max_new_tokens {self.max_new_tokens} of the target's {context} "
                    f"positions; each is cut to its last {context - self.max_new_tokens} tokens "
                    "(eval/prompts_cut_to_context)"
                )
        return self._prompts

    def decode(self, pl_module: Any, rank: int = 0, world_size: int = 1, trainer: Any = None) -> dict[str, ArmResult]:
        """Speculative decoding of this rank's prompt slice with the head (``"head"``) and top-1."""
        target = pl_module._require_target()
        prompts = self.prompt_set(pl_module, trainer)
        stops = self.stop_token_ids(pl_module)
        mine = PromptSet(prompts.name, prompts.input_ids[rank::world_size], prompts.texts[rank::world_size],
                         prompts.chat_template, prompts.enable_thinking, prompts.meta)
        arms: dict[str, Any] = {"head": pl_module.head}
        if self.compare_top1 and not isinstance(pl_module.head, Top1Selector):
            arms["top1"] = Top1Selector()
        # speculative_generate puts drafter and selector in eval mode and restores each flag after.
        return {
            name: evaluate_arm(
                target, pl_module.drafter, selector, mine, self.max_new_tokens, self.temperature, seed=self.seed,
                record_examples=self.table_rows if rank == 0 else 0, draft_sampling=self.draft_sampling,
                stop_token_ids=stops, prompt_indices=range(rank, len(prompts.input_ids), world_size),
            )
            for name, selector in arms.items()
        }

    def evaluate(self, trainer: L.Trainer, pl_module: Any) -> dict[str, float]:
        """Decode, reduce across ranks and log; at most once per global step, never in sanity checks."""
        if trainer.sanity_checking or trainer.global_step == self._last_step:
            return self.last_results
        self._last_step = trainer.global_step
        with _full_parameters(trainer), torch.no_grad():
            results = self.decode(pl_module, trainer.global_rank, trainer.world_size, trainer)
        pooled = {name: self._reduce(trainer, pl_module, r) for name, r in results.items()}
        if "top1" not in pooled and isinstance(pl_module.head, Top1Selector) and self.compare_top1:
            pooled["top1"] = pooled["head"]  # the head is top-1: same numbers, keeps dashboards comparable
        scalars = self._scalars(pooled)
        for key in [k for k in trainer.callback_metrics if k.startswith("eval/acceptance") and k not in scalars]:
            del trainer.callback_metrics[key]  # a position no round reached this time: not an earlier evaluation's rate
        for key, value in scalars.items():
            # Every rank holds the same pooled value, so ModelCheckpoint/EarlyStopping agree across ranks.
            trainer.callback_metrics[key] = torch.tensor(value, dtype=torch.float32)
        for logger in trainer.loggers:  # loggers write on rank 0 only
            logger.log_metrics(scalars, step=trainer.global_step)
        self._log_media(trainer, results, pooled)
        self.last_results = scalars
        self.history.append((trainer.global_step, scalars))
        return scalars

    @staticmethod
    def _reduce(trainer: L.Trainer, pl_module: Any, r: ArmResult) -> dict[str, Any]:
        # The histogram determines τ and per-position acceptance: sum it (and the totals) over ranks.
        # float32 (MPS has no float64) counts exactly up to 2**24 rounds per evaluation.
        packed = torch.tensor([*r.histogram, r.num_tokens, r.seconds], dtype=torch.float32, device=pl_module.device)
        packed = trainer.strategy.reduce(packed, reduce_op="sum").double().cpu()
        hist = packed[:-2].round().long()
        return summarize(hist, int(packed[-2].round()), float(packed[-1]))

    def _scalars(self, pooled: dict[str, dict[str, Any]]) -> dict[str, float]:
        scalars: dict[str, float] = {}
        for name, stats in pooled.items():
            suffix = "" if name == "head" else f"_{name}"
            scalars[f"eval/tau{suffix}"] = stats["tau"]
            scalars[f"eval/{self.benchmark_key}/tau{suffix}"] = stats["tau"]
            for k, p in enumerate(stats["per_position_acceptance"], start=1):
                if not math.isnan(p):  # positions no round reached have no conditional rate
                    scalars[f"eval/acceptance{suffix}/pos{k:02d}"] = p
        scalars["eval/rounds"] = float(sum(pooled["head"]["histogram"]))  # verify rounds behind eval/tau
        if self.prompts_cut_to_context:
            scalars["eval/prompts_cut_to_context"] = float(self.prompts_cut_to_context)
        scalars["eval/tokens_per_s"] = pooled["head"]["tokens_per_s"]
        return scalars

    # ------------------------------------------------------------------ W&B media
    def _token_text(self, ids: list[int]) -> str:
        # A JSON list of per-token strings: token boundaries and whitespace stay visible.
        pieces = [self._tokenizer.decode([i]) if self._tokenizer is not None else str(i) for i in ids]
        return json.dumps(pieces, ensure_ascii=False)

    def table_rows_for(self, result: ArmResult) -> list[list[Any]]:
        """Rows of :data:`TABLE_COLUMNS` for the recorded rounds of the first prompts.

        ``drafted`` is ``d_1..d_S``, ``target`` the target's own choices ``y_0..y_S`` (empty under the
        stochastic-draft rule), ``accepted`` the accepted prefix of the drafts, ``acc`` its length.
        """
        rows = []
        for ex in result.examples:
            prompt = ex["prompt"][-80:]
            for i, rnd in enumerate(ex["rounds"]):
                drafted, acc = rnd["drafted"], int(rnd["accepted"])
                choices = self._token_text(rnd["target"]) if rnd.get("target") is not None else ""
                rows.append([prompt, i, self._token_text([rnd["anchor"]]), self._token_text(drafted), choices,
                             self._token_text(drafted[:acc]), acc])
        return rows

    @rank_zero_only
    def _log_media(self, trainer: L.Trainer, results: dict[str, ArmResult], pooled: dict[str, dict[str, Any]]) -> None:
        loggers = [lg for lg in trainer.loggers if isinstance(lg, WandbLogger)]
        if not loggers:
            return
        import wandb

        step = trainer.global_step
        rows = self.table_rows_for(results["head"])
        hist = pooled["head"]["histogram"]
        names = list(pooled)
        xs = list(range(1, len(pooled["head"]["per_position_acceptance"]) + 1))
        ys = [[None if math.isnan(p) else p for p in pooled[n]["per_position_acceptance"]] for n in names]
        media = {
            # np_histogram = (counts per bin, bin edges): one bin per accepted length 0..S.
            "eval/accepted_length_hist": wandb.Histogram(np_histogram=(hist, list(range(len(hist) + 1)))),
            "eval/per_position_acceptance": wandb.plot.line_series(
                xs=xs, ys=ys, keys=names, title=f"per-position acceptance ({self.benchmark_key})",
                xname="draft position",
            ),
            # WandbLogger logs against trainer/global_step; passing wandb's own step= could be rejected.
            "trainer/global_step": step,
        }
        for lg in loggers:
            if rows:
                lg.log_table(key="eval/drafts", columns=TABLE_COLUMNS, data=rows, step=step)
            lg.experiment.log(media)


@contextlib.contextmanager
def _full_parameters(trainer: L.Trainer) -> Iterator[None]:
    """Under FSDP, gather full parameters (read-only) so drafter and head can run outside ``forward``."""
    from lightning.pytorch.strategies import FSDPStrategy

    if isinstance(trainer.strategy, FSDPStrategy):
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(trainer.strategy.model, writeback=False):
            yield
    else:
        yield
