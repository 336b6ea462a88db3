"""``lilicorr bench``: real speculative-decoding benchmark of a trained checkpoint.

Every selector runs on the same drafter, prompts and temperature, and is compared with plain target
decoding measured in the same process. τ always includes the target's bonus token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

SELECTOR_NAMES = ("top1", "lilicorr", "domino", "dspark")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lilicorr bench", description=__doc__)
    p.add_argument("--ckpt", required=True, help="checkpoint written by `lilicorr fit`")
    p.add_argument("--benchmark", default="humaneval", help="humaneval, stdlib-heldout, a paper benchmark name, or prompts .jsonl")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0], help="one or more temperatures")
    p.add_argument("--selectors", default="top1,lilicorr", help=f"comma list from {SELECTOR_NAMES}")
    p.add_argument("--chat-template", choices=["auto", "yes", "no"], default="auto")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", help="write results JSON here")
    p.add_argument("--plot", help="directory for per-position acceptance PNGs")
    return p.parse_args(argv)


def selector_for(name: str, system: Any) -> Any:
    """Map a selector name to a module: ``top1`` always; the others must be the checkpoint's head."""
    from lilicorr_pl.heads.top1 import Top1Selector

    if name == "top1":
        return Top1Selector()
    head = system.head
    kind = type(head).__name__.lower()
    if name in kind:
        return head
    raise ValueError(
        f"selector {name!r} is not available in this checkpoint (its head is {type(head).__name__}); "
        f"use --selectors top1 or one matching the trained head"
    )


def run_bench(
    system: Any,
    benchmark: str,
    selectors: list[str],
    temperatures: list[float],
    num_prompts: int,
    max_new_tokens: int,
    chat_template: bool | None = None,
    enable_thinking: bool = False,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Benchmark several selectors on one loaded system; one result dict per temperature."""
    from lilicorr_pl.decoding.benchmarks import load_prompts
    from lilicorr_pl.decoding.evaluate import evaluate_arm, run_target_baseline

    system.eval()
    target = system._require_target()
    prompts = load_prompts(benchmark, target.tokenizer, num_prompts, chat_template=chat_template,
                           enable_thinking=enable_thinking, seed=seed)
    arms = {name: selector_for(name, system) for name in selectors}
    runs = []
    for temp in temperatures:
        reference, target_tps = run_target_baseline(target, prompts, max_new_tokens, temp, seed=seed)
        out: dict[str, Any] = {
            "benchmark": benchmark,
            "temperature": temp,
            "max_new_tokens": max_new_tokens,
            "num_prompts": len(prompts.input_ids),
            "chat_template": prompts.chat_template,
            "enable_thinking": prompts.enable_thinking,
            "tau_includes_bonus_token": True,
            "target_tokens_per_s": target_tps,
            "selectors": {},
        }
        for name, selector in arms.items():
            r = evaluate_arm(target, system.drafter, selector, prompts, max_new_tokens, temp, seed=seed,
                             reference=reference)
            out["selectors"][name] = {
                "tau": r.tau,
                "tokens_per_s": r.tokens_per_s,
                "speedup_vs_target": r.tokens_per_s / max(target_tps, 1e-9),
                "lossless": r.lossless,
                "per_position_acceptance": r.per_position_acceptance,
                "histogram": r.histogram,
                "head_time_fraction": r.head_time_fraction,
                "draft_time_fraction": r.draft_time_fraction,
            }
        runs.append(out)
    return runs


def format_table(run: dict[str, Any]) -> str:
    lines = [
        f"benchmark={run['benchmark']} T={run['temperature']} max_new_tokens={run['max_new_tokens']} "
        f"prompts={run['num_prompts']} chat_template={run['chat_template']} thinking={run['enable_thinking']}",
        f"target: {run['target_tokens_per_s']:.1f} tok/s   (tau includes the bonus token)",
        f"{'selector':<10} {'tau':>6} {'tok/s':>8} {'speedup':>8} {'head%':>6} {'lossless':>8}  acceptance by position",
    ]
    for name, r in run["selectors"].items():
        acc = " ".join(f"{a:.2f}" for a in r["per_position_acceptance"][:8])
        lines.append(
            f"{name:<10} {r['tau']:>6.2f} {r['tokens_per_s']:>8.1f} {r['speedup_vs_target']:>7.2f}x "
            f"{100 * r['head_time_fraction']:>5.1f} {str(r['lossless']):>8}  {acc}"
        )
    return "\n".join(lines)


def plot_acceptance(run: dict[str, Any], directory: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, r in run["selectors"].items():
        acc = r["per_position_acceptance"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{name} (τ={r['tau']:.2f})")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(accept k | accepted < k)")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{run['benchmark']}, T={run['temperature']}")
    ax.legend()
    fig.tight_layout()
    path = directory / f"acceptance_{Path(str(run['benchmark'])).stem}_T{run['temperature']}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    ckpt = Path(args.ckpt)
    if not ckpt.is_file():
        sys.exit(f"lilicorr bench: checkpoint {ckpt} does not exist; pass a .ckpt written by `lilicorr fit`")
    selectors = [s.strip() for s in args.selectors.split(",") if s.strip()]
    bad = [s for s in selectors if s not in SELECTOR_NAMES]
    if bad:
        sys.exit(f"lilicorr bench: unknown selector(s) {bad}; choose from {SELECTOR_NAMES}")
    if any(t < 0 for t in args.temperature):
        sys.exit("lilicorr bench: temperatures must be >= 0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from lilicorr_pl.system import DraftSystem

    system = DraftSystem.load_from_checkpoint(str(ckpt), map_location=args.device)
    system.configure_model()
    system.to(args.device)
    meta = torch.load(str(ckpt), map_location="cpu", weights_only=False).get("lilicorr", {})
    chat = {"auto": None, "yes": True, "no": False}[args.chat_template]
    runs = run_bench(
        system, args.benchmark, selectors, args.temperature, args.num_prompts, args.max_new_tokens,
        chat_template=chat, enable_thinking=bool(meta.get("enable_thinking") or False), seed=args.seed,
    )
    for run in runs:
        print(format_table(run))
        if args.plot:
            print(f"plot: {plot_acceptance(run, args.plot)}")
    if args.output:
        payload = runs[0] if len(runs) == 1 else {"runs": runs}
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(str(args.output) + ".tmp")
        tmp.write_text(json.dumps(payload, indent=2))
        os.replace(tmp, args.output)
    return runs
