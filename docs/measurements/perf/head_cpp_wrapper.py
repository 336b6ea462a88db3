"""The demo-sized LiLiCorr head compiled with Inductor's Python wrapper and with its C++ wrapper, side by side.

Usage: ``python docs/measurements/perf/head_cpp_wrapper.py 12 > OUT.json`` (12 repetitions of 200 calls per wrapper,
orders alternated; ``head-cpp-wrapper-machine9.json`` is one such run). Random weights: a call costs the same whatever
the weights, and both wrappers' drafts are checked against eager mode's.
"""

import json
import statistics
import sys
import time

import torch

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
print(json.dumps(out, indent=1))
