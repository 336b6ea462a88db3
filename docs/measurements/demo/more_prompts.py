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
import platform
import time
from pathlib import Path

import torch

from lilicorr_pl.demo.run import add_ratio_intervals, measure
from lilicorr_pl.files import check_output_paths, write_results_json

COMMAND = "demo more-prompts"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output")
    parser.add_argument("benchmark", choices=("humaneval", "stdlib-heldout"))
    parser.add_argument("num_prompts", type=int)
    parser.add_argument("results", help="<workdir>/runs/demo/results.json of a finished demo")
    args = parser.parse_args()
    # Before minutes of decoding: a place the results can be written, never over a file lilicorr did not write.
    try:
        check_output_paths(args.output, None, command=COMMAND)
    except ValueError as err:
        raise SystemExit(f"more_prompts: {err}") from None
    demo = json.loads(Path(args.results).read_text())
    settings = demo["settings"]
    # Where the workdir was moved since, each checkpoint is looked for beside the results file.
    ckpts = {arm: path if Path(path).is_file() else Path(args.results).parent / "checkpoints" / Path(path).name
             for arm, path in demo["checkpoints"].items()}
    torch.set_num_threads(1)
    start = time.time()
    rows, plain = measure(ckpts, [args.benchmark], [0.0], args.num_prompts, settings["bench_new_tokens"],
                          settings["prefix_tokens"], demo["seed"], compile=settings["compile"])
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
        "first_prompts_equal_demo": {
            r["arm"]: r["per_prompt_tau"][:settings["bench_prompts"]] == shown[r["arm"]]["per_prompt_tau"]
            for r in rows if r["arm"] in shown and "per_prompt_tau" in r},
        "rows": rows,
    }
    write_results_json(Path(args.output), result, COMMAND)
    for r in rows:
        interval = f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}]" if "ci_low" in r else ""
        print(f"{r['arm']:24s} tau {r['tau']:.3f}  vs dflash {r.get('ratio_to_dflash', float('nan')):.3f} {interval}")


if __name__ == "__main__":
    main()
