"""A compiled attention kernel sees few shapes: batches padded to fixed length buckets.

``torch.compile(flex_attention, dynamic=False)`` (the CUDA training path) compiles once per new input
shape. Here the same compiled call runs on the CPU with a counting backend (Dynamo's guards and
recompilations do not depend on the backend) inside the forward of 30 training steps of the DFlash
system (``compute_step``: target, drafter with FlexAttention, head, losses; FlexAttention has no CPU
backward, so the steps stop before it) on data of varying lengths: padded to ``data.pad_to: buckets``
it compiles at most once per bucket, padded to each batch's longest sequence again and again.
"""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
from helpers import make_tiny_target_dir
from torch._dynamo.testing import CompileCounter
from torch.nn.attention.flex_attention import flex_attention

from lilicorr_pl.data import DraftDataModule
from lilicorr_pl.models import DFlashDrafter, dflash
from lilicorr_pl.system import DraftSystem

STEPS = 30


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("recompile")
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while drafts are verified by the target model".split()
    # 40 records of 2..24 words (up to ~50 tokens): batch lengths vary from step to step.
    lines = [json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(2, 24)))}) for _ in range(40)]
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    return root, make_tiny_target_dir(root)


def _thirty_steps(root, target_dir, pad_to: str, monkeypatch) -> tuple[int, set, list[int] | None]:
    counter = CompileCounter()
    compiled = torch.compile(flex_attention, dynamic=False, backend=counter)
    shapes: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()

    def compiled_flex(q, k, v, block_mask):
        shapes.add((tuple(q.shape), tuple(k.shape)))
        return compiled(q, k, v, block_mask=block_mask, enable_gqa=True)

    monkeypatch.setattr(dflash, "_flex_attention", compiled_flex)
    torch._dynamo.reset()
    data = DraftDataModule([str(root / "train.jsonl")], target={"name_or_path": target_dir}, max_length=64,
                           batch_size=2, val_fraction=0.0, logit_cache=False, pad_to=pad_to,
                           cache_dir=str(root / "cache"), progress=False)
    data.prepare_data()
    data.setup("fit")
    system = DraftSystem(target={"name_or_path": target_dir}, drafter=DFlashDrafter(num_layers=1, block_size=4, attention="flex"),
                         num_anchors=8, lr_scheduler=None)
    system.configure_model()
    batches = itertools.islice(itertools.cycle(data.train_dataloader()), STEPS)  # 20 batches per epoch
    with torch._dynamo.config.patch(recompile_limit=64), torch.no_grad():  # count every compilation, no eager fallback
        losses = [system.compute_step(batch)["loss"] for batch in batches]
    assert len(losses) == STEPS and all(torch.isfinite(x) for x in losses)
    return counter.frame_count, shapes, data.buckets()


@pytest.mark.slow
def test_bucketed_padding_bounds_flex_recompiles_over_30_training_steps(setup, monkeypatch):
    root, target_dir = setup
    compiles, shapes, buckets = _thirty_steps(root, target_dir, "buckets", monkeypatch)
    assert buckets == [16, 32, 48, 64]
    # Every kernel call: keys = T context tokens + N anchors × B block tokens, with T a bucket and N = min(8, T).
    lengths = {k[2] - q[2] for q, k in shapes}
    assert lengths <= set(buckets) and all(q[0] == 2 for q, _ in shapes)  # 40 examples, batch 2: always full
    assert 1 <= compiles <= len(buckets) and compiles == len(shapes)

    unpadded, unpadded_shapes, _ = _thirty_steps(root, target_dir, "longest", monkeypatch)
    assert unpadded == len(unpadded_shapes) > len(buckets)  # one compilation per new batch length
