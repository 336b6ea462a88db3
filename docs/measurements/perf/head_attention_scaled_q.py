"""The head's training attention before and after 54e58c1 (q scaled before the product, the bias added in place).

    python docs/measurements/perf/head_attention_scaled_q.py OUT.json [--rounds N]

Run from a git checkout: the code before the change is read with `git show 6ac3d4c:lilicorr_pl/heads/lilicorr.py`.
Trains two LiLiCorr heads at the demo's head-stage sizes (128 blocks, 15 slots, K 8, width 64, 2 layers, 4 heads;
H 160, V 4096) on the same random inputs, one with each version, on 1 thread: their weights after 4 AdamW steps
must be bit-identical (the scale, 1/4, is a power of two), and the median step (forward, backward, optimizer) of
each version is timed, the versions alternated round by round.
"""

import argparse
import importlib.util
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from lilicorr_pl.heads import lilicorr as after

M, S, H, V = 128, 15, 160, 4096


def load_before():
    source = subprocess.run(["git", "show", "6ac3d4c:lilicorr_pl/heads/lilicorr.py"], check=True, capture_output=True,
                            text=True).stdout
    path = Path(tempfile.mkdtemp()) / "lilicorr_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("lilicorr_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train(module, steps: int):
    torch.manual_seed(0)
    head = module.LiLiCorrHead(top_k=8, hidden_size=64, num_layers=2, num_heads=4, mlp_ratio=2.0, factor_dim=64)
    head.build(H, V, block_size=16)
    embedding = torch.nn.Embedding(V, H).requires_grad_(False)
    opt = torch.optim.AdamW(head.parameters(), 2e-3)
    g = torch.Generator().manual_seed(1)
    times = []
    for _ in range(steps):
        hidden, logits, anchor = torch.randn(M, S, H, generator=g), torch.randn(M, S, V, generator=g) * 3, \
            torch.randn(M, H, generator=g)
        t0 = time.perf_counter()
        lattice = head.score_lattice(hidden, logits, anchor, torch.ones(M, dtype=torch.bool), embedding)
        loss = lattice.pair.logsumexp(-1).mean() + lattice.start.logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return head.state_dict(), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    before = load_before()
    a, _ = train(before, 4)
    b, _ = train(after, 4)
    identical = all(torch.equal(a[k], b[k]) for k in a)
    rounds = []
    for i in range(args.rounds):
        order = (before, after) if i % 2 == 0 else (after, before)
        ms = {}
        for module in order:
            ms["before" if module is before else "after"] = 1000 * train(module, 8)[1]
        rounds.append(ms)
    ratios = [r["after"] / r["before"] for r in rounds]
    report = {"what": __doc__.strip().splitlines()[0], "bit_identical_after_4_steps": identical,
              "torch": torch.__version__, "rounds_ms": rounds, "ratios_after_over_before": ratios,
              "median_ratio": statistics.median(ratios)}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("bit_identical_after_4_steps", "median_ratio")}), ratios)


if __name__ == "__main__":
    main()
