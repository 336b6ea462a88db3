"""Training steps with and without lilicorr's malloc policy (lilicorr_pl/allocator.py), alternated.

    python docs/measurements/perf/malloc_reuse.py OUT.json CONFIG [CONFIG ...] [--pairs N] [--steps N]

Each CONFIG (a run's recorded config.yaml, e.g. a demo stage's runs/<stage>/config.yaml) is timed by
`lilicorr perf -c CONFIG --threads 1 --steps N --json ...` in a fresh process, N pairs, the two settings in
alternating order within each pair (the machine's drift over minutes falls on both alike): once as `lilicorr` runs
by default, once with LILICORR_MALLOC=default (glibc's own malloc behaviour). Each process's minor page faults,
user / system CPU seconds and peak resident memory come from wait4 (series measured before 54e58c1 read
getrusage's children totals: no peak there); they include building the system and data, which both settings share.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run_once(config: str, steps: int, opt_out: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("LILICORR_MALLOC", None)
    if opt_out:
        env["LILICORR_MALLOC"] = "default"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "perf.json")
        process = subprocess.Popen(["lilicorr", "perf", "-c", config, "--threads", "1", "--steps", str(steps),
                                    "--json", out], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(process.pid, 0)  # this process's own resource use
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode:
            raise SystemExit(f"lilicorr perf -c {config} failed (exit status {process.returncode})")
        with open(out) as f:
            result = json.load(f)
    return {"step_ms": 1000 * result["step_total"], "head_ms": 1000 * result.get("head", 0.0),
            "backward_ms": 1000 * result["backward"], "malloc": result["measured_with"]["malloc"]["policy"],
            "minor_faults": usage.ru_minflt, "max_rss_mib": round(usage.ru_maxrss / 1024, 1),
            "user_s": round(usage.ru_utime, 2), "system_s": round(usage.ru_stime, 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    report = {"what": __doc__.strip().splitlines()[0], "steps": args.steps, "configs": {}}
    for config in args.configs:
        runs = {"lilicorr": [], "default": []}
        for i in range(args.pairs):
            order = (False, True) if i % 2 == 0 else (True, False)
            for opt_out in order:
                r = run_once(config, args.steps, opt_out)
                runs["default" if opt_out else "lilicorr"].append(r)
                print(config, "default" if opt_out else "lilicorr", r, flush=True)
        med = {k: statistics.median(r["step_ms"] for r in v) for k, v in runs.items()}
        report["configs"][os.path.basename(os.path.dirname(config)) or config] = {
            "runs": runs, "median_step_ms": med, "ratio_median": med["lilicorr"] / med["default"],
            "ratios_per_pair": [a["step_ms"] / b["step_ms"] for a, b in zip(runs["lilicorr"], runs["default"])]}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: (v["median_step_ms"], v["ratio_median"]) for k, v in report["configs"].items()}))


if __name__ == "__main__":
    main()
