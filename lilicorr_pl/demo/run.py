"""``lilicorr demo``: the paper's comparison, measured here on a laptop-sized real target.

1. Build (or reuse) a small Qwen3-architecture target trained on the Python standard library.
2. Regenerate: the target's own greedy continuations of training-split code prefixes become the
   drafter's training data (the same ``regenerate`` users run on chat prompts).
3. Train every arm with ``lilicorr fit -c configs/demo/<arm>.yaml`` — same data, steps and seed:
   vanilla DFlash, DFlash + LiLiCorr, LiLiCorr without the distractor penalty (and, with
   ``--baselines``, Domino and DSpark).
4. Benchmark with real speculative decoding on HumanEval prompts and held-out stdlib prefixes,
   at T = 0 and T = 1, against plain target decoding in the same process, plus the top-K lattice
   oracle (T = 0). τ includes the target's bonus token.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
ARMS = {
    # arm -> (config, overlays, selector used at inference)
    "dflash": ("demo/dflash.yaml", [], "top1"),
    "lilicorr": ("demo/lilicorr.yaml", [], "lilicorr"),
    "lilicorr_no_distractor": ("demo/lilicorr.yaml", ["ablations/no_distractor.yaml"], "lilicorr"),
    "domino": ("demo/domino.yaml", [], "domino"),
    "dspark": ("demo/dspark.yaml", [], "dspark"),
}
SETTINGS = {
    # quick: minutes on 2 CPU cores; full: about half an hour once the target is cached.
    "quick": dict(target="quick", prompts=160, prefix_tokens=48, new_tokens=64, steps=120, bench_prompts=6,
                  bench_new_tokens=48),
    "full": dict(target="full", prompts=600, prefix_tokens=64, new_tokens=96, steps=300, bench_prompts=10,
                 bench_new_tokens=64),
}


def log(msg: str) -> None:
    print(f"[lilicorr demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lilicorr demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small target and budget (about 5 minutes)")
    p.add_argument("--workdir", default="runs/demo", help="where data, caches, runs and plots go")
    p.add_argument("--output", help="write the comparison JSON here (default: <workdir>/results.json)")
    p.add_argument("--steps", type=int, help="training steps per arm (default by mode)")
    p.add_argument("--baselines", action="store_true", help="also train and measure Domino and DSpark")
    p.add_argument("--arms", help="comma list of arms to run (overrides --baselines)")
    p.add_argument("--bench-prompts", type=int, help="prompts per benchmark (default by mode)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--target-preset", choices=["test", "quick", "full"], help="override the mode's target build")
    p.add_argument("--prompts", type=int, help="regeneration prompts (default by mode)")
    p.add_argument("--regen-tokens", type=int, help="tokens regenerated per prompt (default by mode)")
    p.add_argument("--prefix-tokens", type=int, help="prompt prefix length in tokens (default by mode)")
    p.add_argument("--bench-new-tokens", type=int, help="tokens generated per benchmark prompt (default by mode)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def write_prompts(tokenizer: Any, path: Path, num: int, prefix_tokens: int, seed: int) -> None:
    from lilicorr_pl.demo.corpus import code_prefixes

    path.parent.mkdir(parents=True, exist_ok=True)
    prefixes = code_prefixes(tokenizer, num, prefix_tokens, seed=seed, split="train")
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as fh:
        for i, text in enumerate(prefixes):
            fh.write(json.dumps({"id": f"train-{i}", "text": text}) + "\n")
    os.replace(tmp, path)


def target_overrides(target_dir: str) -> list[str]:
    """Config overrides for targets smaller than the demo config assumes (the seconds-long test preset):
    explicit layer ids where the default rule would repeat a layer, and a max_length within RoPE range."""
    from transformers import AutoConfig

    from lilicorr_pl.target import default_layer_ids

    config = AutoConfig.from_pretrained(target_dir)
    out = []
    try:
        default_layer_ids(config.num_hidden_layers, 3)
    except ValueError:
        ids = ", ".join(str(i) for i in range(1, max(2, config.num_hidden_layers - 1)))
        out.append(f"--model.target.layer_ids=[{ids}]")
    if config.max_position_embeddings < 256:
        out.append(f"--data.max_length={config.max_position_embeddings}")
    return out


def train_arm(arm: str, workdir: Path, target_dir: str, data_file: Path, steps: int, seed: int) -> Path:
    """``lilicorr fit`` for one arm, run from ``workdir`` so the configs' relative paths land there."""
    from lilicorr_pl.cli import main as cli_main

    config, overlays, _ = ARMS[arm]
    ckpt = workdir / "checkpoints" / f"{arm}.ckpt"
    if ckpt.is_file():
        log(f"{arm}: reusing {ckpt}")
        return ckpt
    args = ["fit", "-c", str(CONFIG_DIR / config)]
    for o in overlays:
        args += ["-c", str(CONFIG_DIR / o)]
    args += [
        f"--seed_everything={seed}",
        f"--model.target.name_or_path={target_dir}",
        f"--data.train_files=[{data_file}]",
        f"--trainer.max_steps={steps}",
        f"--trainer.val_check_interval={max(1, steps // 2)}",
        f"--trainer.default_root_dir=runs/demo/{arm}",
        f"--trainer.logger.init_args.save_dir=runs/demo/{arm}",
        f"--trainer.logger.init_args.name={arm}",
        "--data.cache_dir=runs/demo/cache",
        *target_overrides(target_dir),
    ]
    log(f"{arm}: lilicorr {' '.join(args)}")
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        cli = cli_main(args)
        produced = Path(cli.trainer.checkpoint_callback.last_model_path).resolve()
    finally:
        os.chdir(cwd)
        try:
            import wandb

            wandb.finish()
        except Exception:  # noqa: BLE001 - a logger teardown problem must not lose the results
            pass
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    tmp = ckpt.with_suffix(".tmp")
    shutil.copyfile(produced, tmp)
    os.replace(tmp, ckpt)  # atomic: a half-copied checkpoint is never reused
    return ckpt


def evaluate_oracle(system: Any, prompts: Any, reference: list[Any], max_new_tokens: int, top_k: int) -> dict[str, Any]:
    """Real τ of the top-K lattice oracle on the same drafter (T = 0 only)."""
    from lilicorr_pl.decoding.metrics import AcceptanceMetrics
    from lilicorr_pl.decoding.oracle import AnchorTracker, OracleSelector
    from lilicorr_pl.decoding.speculative import speculative_generate

    metric = AcceptanceMetrics(num_slots=system.drafter.num_slots)
    for ids, ref in zip(prompts.input_ids, reference):
        tracker = AnchorTracker(system.drafter)
        selector = OracleSelector(top_k, ref.tokens, len(ids), tracker)
        r = speculative_generate(system.target, tracker, selector, ids, max_new_tokens)
        if r.tokens != ref.tokens:
            raise AssertionError("oracle decoding diverged from greedy decoding: speculative decoding is not lossless")
        metric.update(r.accepted_lengths, num_tokens=len(r.tokens))
    out = metric.compute()
    return {"tau": float(out["tau"]), "per_position_acceptance": [float(x) for x in out["per_position_acceptance"]]}


def plot_curves(rows: list[dict[str, Any]], directory: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    keys = sorted({(r["benchmark"], r["temperature"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
    for ax, (bench, temp) in zip(axes[0], keys):
        for r in rows:
            if (r["benchmark"], r["temperature"]) != (bench, temp):
                continue
            acc = r["per_position_acceptance"]
            style = "--" if r["arm"] == "oracle" else "-"
            ax.plot(range(1, len(acc) + 1), acc, style, marker="o", ms=3, label=f"{r['arm']} τ={r['tau']:.2f}")
        ax.set_title(f"{bench}, T={temp:g}")
        ax.set_xlim(0.5, len(rows[0]["per_position_acceptance"]) + 0.5)
        ax.set_xlabel("draft position k")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("P(accept k | reached k)")
    fig.tight_layout()
    path = directory / "acceptance_curves.png"
    fig.savefig(path, dpi=130)
    plt.close(fig)
    paths.append(path)
    return paths


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'benchmark':<15} {'T':>3} {'arm':<24} {'tau':>6} {'tok/s':>8} {'speedup':>8} {'head%':>6}"]
    for r in rows:
        tps = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.1f}"
        sp = "-" if r["speedup_vs_target"] is None else f"{r['speedup_vs_target']:.2f}x"
        hf = "-" if r.get("head_time_fraction") is None else f"{100 * r['head_time_fraction']:.1f}"
        lines.append(f"{r['benchmark']:<15} {r['temperature']:>3g} {r['arm']:<24} {r['tau']:>6.2f} {tps:>8} {sp:>8} {hf:>6}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    mode = "quick" if args.quick else "full"
    cfg = dict(SETTINGS[mode])
    for key, value in (("target", args.target_preset), ("prompts", args.prompts), ("new_tokens", args.regen_tokens),
                       ("prefix_tokens", args.prefix_tokens), ("bench_new_tokens", args.bench_new_tokens)):
        if value is not None:
            cfg[key] = value
    steps = args.steps or cfg["steps"]
    bench_prompts = args.bench_prompts or cfg["bench_prompts"]
    arms = [a.strip() for a in args.arms.split(",")] if args.arms else (
        list(ARMS) if args.baselines else ["dflash", "lilicorr", "lilicorr_no_distractor"]
    )
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"lilicorr demo: unknown arm(s) {unknown}; choose from {list(ARMS)}")
    if steps < 1 or bench_prompts < 1:
        raise SystemExit("lilicorr demo: --steps and --bench-prompts must be >= 1")
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    from transformers import AutoTokenizer

    from lilicorr_pl.data.regenerate import regenerate
    from lilicorr_pl.demo.tiny_target import build_tiny_target, load_build_report

    log(f"1/4 target: building or reusing the {cfg['target']} stdlib target")
    target_dir = str(build_tiny_target(cfg["target"]))
    report = load_build_report(target_dir)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)

    log("2/4 regenerating training data with the target (resumable)")
    data_dir = workdir / "data"
    prompts_file, data_file = data_dir / "prompts.jsonl", data_dir / "regenerated.jsonl"
    if not prompts_file.exists():
        write_prompts(tokenizer, prompts_file, cfg["prompts"], cfg["prefix_tokens"], args.seed)
    stats = regenerate(target_dir, prompts_file, data_file, max_new_tokens=cfg["new_tokens"], temperature=0.0,
                       batch_size=16, seed=args.seed)
    log(f"   regeneration: {stats.succeeded} new, {stats.skipped} already done, {stats.failed} failed")

    log(f"3/4 training {len(arms)} arms x {steps} steps (same data, steps, seed)")
    ckpts = {arm: train_arm(arm, workdir, target_dir, data_file, steps, args.seed) for arm in arms}

    log("4/4 benchmarking with real speculative decoding")
    rows = run_comparison(ckpts, args.temperatures, bench_prompts, cfg["bench_new_tokens"], cfg["prefix_tokens"], args.seed)
    result = {
        "mode": mode,
        "tau_includes_bonus_token": True,
        "steps_per_arm": steps,
        "seed": args.seed,
        "target": {
            "path_name": Path(target_dir).name,
            "num_params": report.get("num_params"),
            "heldout_loss": report.get("heldout_loss"),
            "heldout_top1": report.get("heldout_top1"),
            "repetition_rate_greedy": report.get("repetition_rate_greedy", report.get("repetition_rate_t0")),
            "repetition_rate_t1": report.get("repetition_rate_t1"),
        },
        "results": rows,
        "wall_seconds": round(time.time() - t_start, 1),
    }
    plots = plot_curves(rows, workdir / "plots")
    result["plots"] = [str(p) for p in plots]
    out = Path(args.output) if args.output else workdir / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, out)
    print(format_table(rows))
    print(f"target: held-out loss {result['target']['heldout_loss']}, top-1 {result['target']['heldout_top1']}, "
          f"greedy repetition {result['target']['repetition_rate_greedy']}  (tau includes the bonus token)")
    log(f"wrote {out} and {', '.join(str(p) for p in plots)} in {result['wall_seconds']} s")
    return result


def arm_row(bench: str, temp: float, arm: str, r: Any, target_tps: float) -> dict[str, Any]:
    """One row of the comparison JSON for a measured arm."""
    return {
        "benchmark": bench, "temperature": temp, "arm": arm, "tau": r.tau,
        "tokens_per_s": r.tokens_per_s, "speedup_vs_target": r.tokens_per_s / max(target_tps, 1e-9),
        "per_position_acceptance": r.per_position_acceptance, "head_time_fraction": r.head_time_fraction,
        "lossless": r.lossless, "target_tokens_per_s": target_tps,
    }


def run_comparison(ckpts: dict[str, Path], temperatures: list[float], num_prompts: int, max_new_tokens: int,
                   prefix_tokens: int, seed: int) -> list[dict[str, Any]]:
    """Every arm on HumanEval and held-out stdlib prefixes, each temperature, plus the oracle at T=0."""
    from lilicorr_pl.bench import selector_for
    from lilicorr_pl.decoding.benchmarks import load_prompts
    from lilicorr_pl.decoding.evaluate import evaluate_arm, run_target_baseline
    from lilicorr_pl.system import DraftSystem

    systems = {}
    for arm, path in ckpts.items():
        system = DraftSystem.from_checkpoint(path, map_location="cpu")
        system.configure_model()
        systems[arm] = system.eval()
    any_system = next(iter(systems.values()))
    tokenizer = any_system.target.tokenizer
    rows: list[dict[str, Any]] = []
    for bench in ("humaneval", "stdlib-heldout"):
        # The target is a code LM, not a chat model: prompts stay raw code.
        prompts = load_prompts(bench, tokenizer, num_prompts, chat_template=False, seed=seed + 1, prefix_tokens=prefix_tokens)
        for temp in temperatures:
            reference, target_tps = run_target_baseline(any_system.target, prompts, max_new_tokens, temp, seed=seed)
            for arm, system in systems.items():
                selector = selector_for(ARMS[arm][2], system)
                r = evaluate_arm(system.target, system.drafter, selector, prompts, max_new_tokens, temp,
                                 seed=seed, reference=reference)
                rows.append(arm_row(bench, temp, arm, r, target_tps))
                log(f"   {bench} T={temp:g} {arm}: tau {r.tau:.2f}, {r.tokens_per_s:.1f} tok/s "
                    f"(target {target_tps:.1f}), lossless={r.lossless}")
            if "lilicorr" in systems:
                # Same drafter, per-slot top-1: separates the head's effect from joint training's.
                from lilicorr_pl.heads.top1 import Top1Selector

                lil = systems["lilicorr"]
                r = evaluate_arm(lil.target, lil.drafter, Top1Selector(), prompts, max_new_tokens, temp,
                                 seed=seed, reference=reference)
                rows.append(arm_row(bench, temp, "lilicorr_drafter_top1", r, target_tps))
            if temp == 0 and "lilicorr" in systems:
                lil = systems["lilicorr"]
                o = evaluate_oracle(lil, prompts, reference, max_new_tokens, int(getattr(lil.head, "top_k", 8)))
                rows.append({"benchmark": bench, "temperature": temp, "arm": "oracle", "tau": o["tau"],
                             "tokens_per_s": None, "speedup_vs_target": None,
                             "per_position_acceptance": o["per_position_acceptance"]})
                log(f"   {bench} T=0 oracle (top-{lil.head.top_k} lattice bound, lilicorr drafter): tau {o['tau']:.2f}")
    return rows
