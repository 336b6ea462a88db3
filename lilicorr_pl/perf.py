"""Where a training step's time goes: ``lilicorr perf -c configs/tiny.yaml [--steps N]``.

Builds the system and data exactly as ``lilicorr fit`` would (same config files), then times the
pieces of ``steps`` real optimisation steps: target features, drafter, head, losses, backward and
optimizer. Prints a table (and ``--json``); the first ``--warmup`` steps are not counted. The command line
is ``fit``'s (same ``-c`` files, same ``--model.*``/``--data.*`` overrides) plus :func:`perf_options`.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from jsonargparse.typing import NonNegativeInt, PositiveInt

from lilicorr_pl.command import argparse_spellings, type_hints
from lilicorr_pl.files import write_json_atomic
from lilicorr_pl.lightning_cli import LilicorrCLI, run_lightning


def profile_steps(system: Any, batches: list[dict[str, torch.Tensor]], steps: int, warmup: int = 2) -> dict[str, float]:
    """Mean seconds per step for each phase over ``steps`` steps after ``warmup`` untimed ones."""
    system.configure_model()
    system.train()
    opt = torch.optim.AdamW(system.trainable_parameters(), lr=1e-4)
    totals: dict[str, float] = {}
    for i in range(warmup + steps):
        batch = batches[i % len(batches)]
        system._timings = {}
        system.record_timings = i >= warmup
        t0 = time.perf_counter()
        out = system.compute_step(batch)
        t1 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if i < warmup:
            continue
        timed = dict(system._timings)
        timed["other_forward"] = (t1 - t0) - sum(timed.values())
        timed["backward"] = t2 - t1
        timed["optimizer"] = t3 - t2
        timed["step_total"] = t3 - t0
        for k, v in timed.items():
            totals[k] = totals.get(k, 0.0) + v
    system.record_timings = False
    return {k: v / steps for k, v in totals.items()}


def penalty_cache_error(system: Any, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Distractor penalty from the top-M cache versus exact candidate logits, on the same blocks."""
    if "topm_ids" not in batches[0]:
        raise ValueError("the batches carry no target-logit cache; enable data.logit_cache")
    system.configure_model()
    system.eval()
    names = [l.name for l in system.losses if l.requires_target_logits]
    if not names:
        raise ValueError("no loss component reads target logits (add DistractorPenalty)")
    cached, exact = [], []
    mode = system.target_logits_mode
    try:
        with torch.no_grad():
            for i, batch in enumerate(batches):
                for which, sink in (("cache", cached), ("exact", exact)):
                    system.target_logits_mode = which
                    out = system.compute_step(batch, generator=torch.Generator().manual_seed(i))
                    sink.append(float(out["logs"][f"{names[0]}/penalty"]))
    finally:
        system.target_logits_mode = mode
    abs_err = [abs(a - b) for a, b in zip(cached, exact)]
    mean_exact = sum(exact) / len(exact)
    return {"penalty_exact": mean_exact, "penalty_cache": sum(cached) / len(cached),
            "mean_abs_error": sum(abs_err) / len(abs_err),
            "relative_error": (sum(abs_err) / len(abs_err)) / max(abs(mean_exact), 1e-12), "batches": len(batches)}


def perf_options(
    steps: PositiveInt = 10,
    warmup: NonNegativeInt = 2,
    threads: PositiveInt | None = None,
    json: str | None = None,  # noqa: A002 - the command line's --json
    ckpt: str | None = None,
    penalty_error: bool = False,
) -> None:
    """Where a training step's time goes: the options ``lilicorr perf`` adds to ``fit``'s parser.

    Args:
        steps: timed optimisation steps (batches for penalty_error).
        warmup: untimed steps first.
        threads: torch threads (default: torch's choice).
        json: also write the numbers to this JSON file.
        ckpt: load trained drafter/head weights from this checkpoint first (opened weights-only, checksum verified).
        penalty_error: instead of timing, compare the distractor penalty from the cache with exact logits.
    """


class PerfCLI(LilicorrCLI):
    """``fit``'s parser (model, data, trainer from the same config files) plus :func:`perf_options` at the top level."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        super().add_arguments_to_parser(parser)
        parser.add_function_arguments(perf_options, nested_key=None, as_group=True)

    def before_instantiate_classes(self) -> None:
        # Checked before anything is built: weights-only, checksum verified, trusted components only.
        self.checkpoint = None
        if self.config.get("ckpt"):
            from lilicorr_pl.checkpoint import check_class_paths, read_checkpoint

            self.checkpoint = read_checkpoint(self.config.ckpt)
            check_class_paths(self.checkpoint.get("hyper_parameters") or {}, self.config.ckpt)
        if self.config.get("threads"):
            torch.set_num_threads(self.config.threads)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """``lilicorr perf -c CONFIG [-c OVERLAY] [--steps N] [--ckpt CKPT] [--penalty_error] [--model.x=...]``.

    Builds the system and data exactly as ``lilicorr fit`` would from the same config files and overrides,
    then times (or, with ``--penalty_error``, compares) real steps. Returns the numbers it prints.
    """
    os.environ.setdefault("WANDB_MODE", "disabled")
    args = argparse_spellings(sys.argv[1:] if argv is None else argv, type_hints(perf_options))
    cli = run_lightning(args, description=__doc__ or "", cli_class=PerfCLI, prog="lilicorr perf", run=False,
                        save_config_callback=None)
    options = cli.config
    system, dm = cli.model, cli.datamodule
    dm.require_logit_cache(system.needs_target_logits)  # the penalty check compares cache and exact
    dm.prepare_data()
    dm.setup("fit")
    if cli.checkpoint is not None:
        system.load_state_dict(cli.checkpoint["state_dict"])
    batches = [b for _, b in zip(range(max(4, options.steps)), dm.train_dataloader())]
    if options.penalty_error:
        result = penalty_cache_error(system, batches[: options.steps])
        for k, v in result.items():
            print(f"{k:<16} {v:.6g}")
        if options.json:
            write_json_atomic(Path(options.json), result)
        return result
    result = profile_steps(system, batches, options.steps, options.warmup)
    total = result["step_total"]
    print(f"{'phase':<16} {'ms/step':>10} {'share':>7}   (threads={torch.get_num_threads()}, steps={options.steps})")
    for k in ("target", "drafter", "head", "losses", "other_forward", "backward", "optimizer", "step_total"):
        if k in result:
            print(f"{k:<16} {1000 * result[k]:>10.1f} {100 * result[k] / total:>6.1f}%")
    if options.json:
        write_json_atomic(Path(options.json), result)
    return result
