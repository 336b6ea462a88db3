"""The demo-sized LiLiCorr head compiled with Inductor's Python wrapper and with its C++ wrapper, side by side.

Usage: ``python docs/measurements/perf/head_cpp_wrapper.py 12 > OUT.json`` (12 repetitions of 200 calls per wrapper,
orders alternated; ``head-cpp-wrapper-machine9.json`` is one such run, ``head-arithmetic-machine9.json`` one with the
arithmetic and profile below). Random weights: a call costs the same whatever
the weights, and both wrappers' drafts are checked against eager mode's.

It also says how much of a call is arithmetic: the FLOPs of one call (torch's FlopCounterMode, attention counted
through its math kernel), the rate a call reaches at each wrapper's median, and the rate this core reaches on a
matrix product of the head's own largest shape and on a large one (one thread, float32); and where a call's time goes,
by ``torch.profiler`` (Inductor's kernels named, so through the Python wrapper): microseconds a call, by self time.
"""

import json
import statistics
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

from lilicorr_pl.heads.base import SelectContext
from lilicorr_pl.heads.lilicorr import LiLiCorrHead
from lilicorr_pl.models.dflash import DraftOutput

torch.manual_seed(0)
torch.set_num_threads(1)
H, V, B = 160, 4096, 16  # the demo's target width and vocabulary, block 16
head = LiLiCorrHead(top_k=8, hidden_size=64, num_layers=2, num_heads=4, mlp_ratio=2.0, factor_dim=64)
head.build(H, V, block_size=B)
head.eval()
emb = torch.nn.Embedding(V, H).requires_grad_(False)
drafts = [DraftOutput(slot_hidden=torch.randn(1, B - 1, H), slot_logits=torch.randn(1, B - 1, V) * 3,
                      anchor_feature=torch.randn(1, H), anchor_feature_valid=torch.ones(1, dtype=torch.bool))
          for _ in range(20)]
ctx = SelectContext(anchor_tokens=torch.zeros(1, dtype=torch.long), anchor_positions=torch.zeros(1, dtype=torch.long),
                    embed=lambda ids: emb(ids))
fns = {}
with torch.inference_mode():
    for name, opts in (("python_wrapper", None), ("cpp_wrapper", {"cpp_wrapper": True})):
        f = torch.compile(head.select, dynamic=False, options=opts)
        for _ in range(3):
            for d in drafts:
                f(d, ctx)
        fns[name] = f
    ref = [head.select(d, ctx).tokens for d in drafts]
    same = {k: all(torch.equal(f(d, ctx).tokens, r) for d, r in zip(drafts, ref)) for k, f in fns.items()}
    ms = {k: [] for k in fns}
    for rep in range(int(sys.argv[1])):
        for k, f in (fns.items() if rep % 2 == 0 else reversed(fns.items())):
            t = time.perf_counter()
            for i in range(200):
                f(drafts[i % 20], ctx)
            ms[k].append((time.perf_counter() - t) / 200 * 1e3)
out = {"what": "LiLiCorr head select() at the demo's sizes (H 160, V 4096, block 16, K 8, width 64, 2 layers), "
               "compiled (torch.compile, default mode), 1 thread, 200 calls per rep, orders alternated",
       "torch": torch.__version__, "same_tokens_as_eager": same,
       "ms_per_call": ms, "median_ms": {k: statistics.median(v) for k, v in ms.items()}}
out["ratio_median"] = out["median_ms"]["cpp_wrapper"] / out["median_ms"]["python_wrapper"]
with torch.inference_mode():
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        head.select(drafts[0], ctx)
    flops = counter.get_total_flops()


def gemm_gflops(m: int, k: int, n: int, calls: int) -> float:
    """Median GFLOP/s of ``calls`` float32 products [m, k] @ [k, n] on this thread, over 5 repetitions."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    for _ in range(10):
        a @ b
    rates = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            a @ b
        rates.append(2 * m * k * n * calls / (time.perf_counter() - t) / 1e9)
    return statistics.median(rates)


nodes = (B - 1) * 8
out["arithmetic"] = {
    "mflop_per_call": flops / 1e6,
    "gflops_at_median": {k: flops / (v * 1e-3) / 1e9 for k, v in out["median_ms"].items()},
    # The head's largest product (its MLP's up projection over every node) and a large one: what this core can do.
    f"gemm_gflops_{nodes}x64x128": gemm_gflops(nodes, 64, 128, 2000),
    "gemm_gflops_1024x1024x1024": gemm_gflops(1024, 1024, 1024, 3),
}
# A third compilation for the profile, each Inductor kernel its own profiler event (which slows it: not timed above).
profiled = torch.compile(head.select, dynamic=False, options={"cpp.enable_kernel_profile": True})
with torch.inference_mode():
    for d in drafts:
        profiled(d, ctx)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(200):
            profiled(drafts[i % 20], ctx)
events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
out["profile_python_wrapper_us_per_call"] = {e.key[:80]: e.self_cpu_time_total / 200 for e in events[:10]}
print(json.dumps(out, indent=1))
