"""Where a training step's time goes: ``python -m lilicorr_pl.perf -c configs/tiny.yaml [--steps N]``.

Builds the system and data exactly as ``lilicorr fit`` would (same config files), then times the
pieces of ``steps`` real optimisation steps: target features, drafter, head, losses, backward and
optimizer. Prints a table (and ``--json``); the first ``--warmup`` steps are not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch


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


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(prog="python -m lilicorr_pl.perf", description=__doc__)
    p.add_argument("-c", "--config", action="append", required=True, help="config file(s), as for `lilicorr fit`")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--json", help="also write the numbers here")
    p.add_argument("--ckpt", help="load trained drafter/head weights from this checkpoint first")
    p.add_argument("--penalty-error", action="store_true",
                   help="instead of timing, compare the distractor penalty from the cache with exact logits")
    p.add_argument("overrides", nargs="*", help="extra `--key=value` overrides passed to the config parser")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("WANDB_MODE", "disabled")
    checkpoint = None
    if args.ckpt:
        # Checked before anything is built: weights-only, checksum verified, trusted components only.
        from lilicorr_pl.checkpoint import CheckpointError, check_class_paths, read_checkpoint

        try:
            checkpoint = read_checkpoint(args.ckpt)
            check_class_paths(checkpoint.get("hyper_parameters") or {}, args.ckpt)
        except CheckpointError as err:
            sys.exit(f"lilicorr perf: {err}")
    from lilicorr_pl.cli import LilicorrCLI
    from lilicorr_pl.data.datamodule import DraftDataModule
    from lilicorr_pl.system import DraftSystem

    cli_args = [x for c in args.config for x in ("-c", c)] + list(args.overrides)
    cli = LilicorrCLI(DraftSystem, DraftDataModule, args=cli_args, run=False,
                      parser_kwargs={"parser_mode": "omegaconf"}, save_config_callback=None)
    system, dm = cli.model, cli.datamodule
    dm.require_logit_cache(system.needs_target_logits)  # the penalty check compares cache and exact
    dm.prepare_data()
    dm.setup("fit")
    if checkpoint is not None:
        system.load_state_dict(checkpoint["state_dict"])
    batches = [b for _, b in zip(range(max(4, args.steps)), dm.train_dataloader())]
    if args.penalty_error:
        result = penalty_cache_error(system, batches[: args.steps])
        for k, v in result.items():
            print(f"{k:<16} {v:.6g}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=2)
        return result
    result = profile_steps(system, batches, args.steps, args.warmup)
    total = result["step_total"]
    print(f"{'phase':<16} {'ms/step':>10} {'share':>7}   (threads={torch.get_num_threads()}, steps={args.steps})")
    for k in ("target", "drafter", "head", "losses", "other_forward", "backward", "optimizer", "step_total"):
        if k in result:
            print(f"{k:<16} {1000 * result[k]:>10.1f} {100 * result[k] / total:>6.1f}%")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return result


if __name__ == "__main__":
    main()
