"""The demo's T = 0 comparison on more prompts than its 40: the same checkpoints, code path and seed.

    python docs/measurements/demo/more_prompts.py OUT.json BENCHMARK NUM_PROMPTS <workdir>/runs/demo/checkpoints

BENCHMARK is ``humaneval`` (164 prompts in all) or ``stdlib-heldout``. Every arm of a finished ``lilicorr demo``
(its five checkpoints, one per arm, found in the folder) runs interleaved with plain decoding prompt by prompt, as
the demo's benchmark does (:func:`lilicorr_pl.demo.run.measure`, one thread, the head compiled), and the ratios get
the demo's paired bootstrap intervals. A diagnostic: nothing the demo chooses is chosen from it. The first 40
prompts are the demo's own, so their per-prompt τ equal its results' (``first_40_equal_demo`` when ``--demo
results.json`` is given).
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

ARMS = ("dflash", "lilicorr", "lilicorr_no_distractor", "domino", "dspark")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output")
    parser.add_argument("benchmark", choices=("humaneval", "stdlib-heldout"))
    parser.add_argument("num_prompts", type=int)
    parser.add_argument("checkpoints", help="<workdir>/runs/demo/checkpoints of a finished demo")
    parser.add_argument("--demo", help="that demo's results.json, to check the first 40 prompts against")
    args = parser.parse_args()
    folder = Path(args.checkpoints)
    ckpts = {}
    for arm in ARMS:
        found = sorted(folder.glob(f"{arm}-*.ckpt"))
        if len(found) != 1:
            raise SystemExit(f"{folder}: {len(found)} checkpoints of the {arm} arm, need exactly one; pass a demo's "
                             "checkpoints folder holding one run")
        ckpts[arm] = found[0]
    torch.set_num_threads(1)
    start = time.time()
    rows, plain = measure(ckpts, [args.benchmark], [0.0], args.num_prompts, 32, 64, 0, compile=True)
    add_ratio_intervals(rows, plain, seed=0)
    result = {
        "what": f"the demo's T = 0 comparison on {args.num_prompts} {args.benchmark} prompts (32 new tokens, "
                "64-token stdlib prefixes, seed 0, heads compiled, one thread)",
        "checkpoints": {arm: {"file": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
                        for arm, path in ckpts.items()},
        "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__},
        "seconds": round(time.time() - start, 1),
        "rows": rows,
    }
    if args.demo:
        demo = {r["arm"]: r for r in json.loads(Path(args.demo).read_text())["results"]
                if r["benchmark"] == args.benchmark and r["temperature"] == 0}
        result["first_40_equal_demo"] = {r["arm"]: r["per_prompt_tau"][:40] == demo[r["arm"]]["per_prompt_tau"]
                                         for r in rows if r["arm"] in demo and "per_prompt_tau" in r}
    Path(args.output).write_text(json.dumps(result, indent=1))
    for r in rows:
        interval = f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}]" if "ci_low" in r else ""
        print(f"{r['arm']:24s} tau {r['tau']:.3f}  vs dflash {r.get('ratio_to_dflash', float('nan')):.3f} {interval}")


if __name__ == "__main__":
    main()
