"""A finished demo's T = 0 comparison on more prompts than its benchmark had: the same checkpoints, code and settings.

    python docs/measurements/demo/more_prompts.py OUT.json BENCHMARK NUM_PROMPTS <workdir>/runs/demo/results.json

BENCHMARK is ``humaneval`` (164 prompts in all) or ``stdlib-heldout``. The demo's results file names its checkpoints
and settings (new tokens, prefix length, seed, compiled heads); every arm runs interleaved with plain decoding prompt
by prompt, as the demo's benchmark does (:func:`lilicorr_pl.demo.run.measure`, one thread), and the ratios get the
demo's paired bootstrap intervals. A diagnostic: nothing the demo chooses is chosen from it. The demo's own prompts
come first, so their per-prompt τ equal its results' (``first_prompts_equal_demo``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import time
from pathlib import Path
from typing import Any

import torch

from lilicorr_pl.demo.run import add_ratio_intervals, measure
from lilicorr_pl.files import check_output_paths, write_results_json

COMMAND = "demo more-prompts"


def read_demo(path: str) -> tuple[dict[str, Any], dict[str, Path]]:
    """A finished demo's results and its checkpoints, each looked for beside the results file where the workdir was
    moved since; one line naming the problem when the file is not that, or a checkpoint is gone."""
    try:
        demo = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise SystemExit(f"more_prompts: {path} cannot be read as JSON ({err}); pass the results.json of a finished "
                         "demo") from None
    settings = demo.get("settings") if isinstance(demo, dict) else None
    needed = ("bench_new_tokens", "prefix_tokens", "compile", "bench_prompts")
    if not isinstance(settings, dict) or not all(k in settings for k in needed) or not isinstance(
            demo.get("checkpoints"), dict) or "seed" not in demo or not isinstance(demo.get("results"), list):
        raise SystemExit(f"more_prompts: {path} is not the results.json of a finished demo (its settings, seed, "
                         "checkpoints and results); pass that file")
    ckpts = {arm: Path(p) if Path(p).is_file() else Path(path).parent / "checkpoints" / Path(p).name
             for arm, p in demo["checkpoints"].items()}
    gone = [arm for arm, p in ckpts.items() if not p.is_file()]
    if gone:
        raise SystemExit(f"more_prompts: the {gone[0]} checkpoint {demo['checkpoints'][gone[0]]} is gone (not beside "
                         f"{path} either); run the demo again, or pass a demo's results whose checkpoints are here")
    return demo, ckpts


def check_prompt_count(ckpts: dict[str, Path], benchmark: str, num_prompts: int, prefix_tokens: int, seed: int) -> None:
    """Before minutes of decoding: the benchmark holds ``num_prompts`` prompts, read as the demo's benchmark reads
    them (HumanEval has 164; the held-out cuts as many as their modules hold); one line otherwise."""
    from lilicorr_pl.decoding.benchmarks import load_prompts
    from lilicorr_pl.system import DraftSystem
    from lilicorr_pl.target import tokenizer_of

    system = DraftSystem.from_checkpoint(next(iter(ckpts.values())), map_location="cpu", load_target=False)
    tokenizer = tokenizer_of(str(system.target_path), "the demo's target")
    try:
        got = len(load_prompts(benchmark, tokenizer, num_prompts, chat_template=False, seed=seed + 1,
                               prefix_tokens=prefix_tokens).input_ids)
    except ValueError as err:
        raise SystemExit(f"more_prompts: the {benchmark} benchmark: {str(err).rstrip('.')}") from None  # names the fix
    if got < num_prompts:
        raise SystemExit(f"more_prompts: the {benchmark} benchmark has {got} prompts, fewer than {num_prompts}; ask "
                         f"for at most {got}")


def same_tau(measured: list[float], demo: list[float | None]) -> bool:
    """Whether the first prompts' τ are the demo's, as many as both measured (a prompt with no round: NaN here, null in
    the demo's JSON)."""
    n = min(len(measured), len(demo))

    def plain(value: float | None) -> float | None:
        return None if value is None or math.isnan(value) else value

    return [plain(v) for v in measured[:n]] == [plain(v) for v in demo[:n]]


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a count of prompts; pass 1 or more")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output")
    parser.add_argument("benchmark", choices=("humaneval", "stdlib-heldout"))
    parser.add_argument("num_prompts", type=positive)
    parser.add_argument("results", help="<workdir>/runs/demo/results.json of a finished demo")
    args = parser.parse_args()
    # Before minutes of decoding: a place the results can be written, never over a file lilicorr did not write.
    try:
        check_output_paths(args.output, None, command=COMMAND)
    except ValueError as err:
        raise SystemExit(f"more_prompts: {err}") from None
    demo, ckpts = read_demo(args.results)
    settings = demo["settings"]
    torch.set_num_threads(1)
    check_prompt_count(ckpts, args.benchmark, args.num_prompts, settings["prefix_tokens"], demo["seed"])
    start = time.time()
    rows, plain = measure(ckpts, [args.benchmark], [0.0], args.num_prompts, settings["bench_new_tokens"],
                          settings["prefix_tokens"], demo["seed"], compile=settings["compile"])
    measured = {len(r["per_prompt_tau"]) for r in rows}
    if measured != {args.num_prompts}:  # never a file that says more than was measured
        raise SystemExit(f"more_prompts: the {args.benchmark} benchmark gave {min(measured)} prompts, not "
                         f"{args.num_prompts}")
    add_ratio_intervals(rows, plain, seed=demo["seed"])
    shown = {r["arm"]: r for r in demo["results"] if r["benchmark"] == args.benchmark and r["temperature"] == 0}
    result = {
        "what": f"the demo's T = 0 comparison on {args.num_prompts} {args.benchmark} prompts (its settings: "
                f"{settings['bench_new_tokens']} new tokens, {settings['prefix_tokens']}-token stdlib prefixes, seed "
                f"{demo['seed']}, compiled heads {settings['compile']}; one thread)",
        "checkpoints": {arm: {"file": Path(path).name, "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest()}
                        for arm, path in ckpts.items()},
        "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__},
        "seconds": round(time.time() - start, 1),
        "demo_prompts": settings["bench_prompts"],
        "first_prompts_equal_demo": {r["arm"]: same_tau(r["per_prompt_tau"], shown[r["arm"]]["per_prompt_tau"])
                                     for r in rows if r["arm"] in shown and "per_prompt_tau" in r},
        "rows": rows,
    }
    write_results_json(Path(args.output), result, COMMAND)
    for r in rows:
        interval = f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}]" if "ci_low" in r else ""
        print(f"{r['arm']:24s} tau {r['tau']:.3f}  vs dflash {r.get('ratio_to_dflash', float('nan')):.3f} {interval}")


if __name__ == "__main__":
    main()
