"""Training examples read from the stores, and how they are padded into batches.

Batch layout (right-padded to the longest sequence, or to a fixed length bucket, see ``pad_length``):

==================  ===================  ======================================================
key                 shape / dtype        meaning
==================  ===================  ======================================================
``input_ids``       ``[b, T]`` long      token ids, padded with the tokenizer's pad id
``attention_mask``  ``[b, T]`` long      1 on real tokens
``loss_mask``       ``[b, T]`` bool      supervised (response) tokens
``index``           ``[b]`` long         example index in its split's token store
``topm_ids``        ``[b, T, M]`` long   with the logit cache: row ``t`` is the target's top-M
``topm_logits``     ``[b, T, M]`` f32    for predicting token ``t`` from ``x_<t`` (descending)
``floor_logit``     ``[b, T]`` f32       M-th value: stands in for tokens not in the top-M
``true_logit``      ``[b, T]`` f32       exact target logit of ``input_ids[:, t]`` at row ``t``
``logit_valid``     ``[b, T]`` bool      rows that hold data (``t >= 1`` and ``loss_mask[t]``)
``features``        ``[b, T, n·H]`` bf16 with the feature cache: concatenated target features
==================  ===================  ======================================================

Use ``lilicorr_pl.data.cached_candidate_logits`` to read target logits of arbitrary candidate ids out
of a batch.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lilicorr_pl.data.store import Store, open_store


def pad_length(longest: int, buckets: Sequence[int] | None) -> int:
    """The padded length of a batch whose longest sequence has ``longest`` tokens: itself without
    buckets, else the smallest bucket that fits (so a compiled attention kernel sees few shapes)."""
    if not buckets:
        return longest
    i = bisect.bisect_left(buckets, longest)
    if i == len(buckets):
        raise ValueError(f"a batch of {longest} tokens exceeds the largest length bucket {buckets[-1]}; "
                         "the last of data.length_buckets must be at least data.max_length")
    return int(buckets[i])


def default_buckets(max_length: int, count: int = 4, multiple: int = 8) -> list[int]:
    """``count`` evenly spaced lengths up to ``max_length``, rounded up to a multiple of ``multiple``."""
    lengths = (math.ceil(max_length * (i + 1) / count / multiple) * multiple for i in range(count))
    return sorted({min(max_length, n) for n in lengths})


class CachedDraftDataset(Dataset):
    """Examples of one split, read from the stores (memory-mapped safetensors shards).

    Holds only paths and indices; each process (including DataLoader workers) opens the stores lazily,
    so the dataset pickles cheaply and never copies a cache.
    """

    def __init__(self, tokens_path: Path, indices: np.ndarray, logits_path: Path | None = None,
                 features_path: Path | None = None) -> None:
        self.paths = {"tokens": Path(tokens_path)}
        if logits_path is not None:
            self.paths["logits"] = Path(logits_path)
        if features_path is not None:
            self.paths["features"] = Path(features_path)
        self.indices = np.asarray(indices, dtype=np.int64)
        self._stores: dict[str, Store] | None = None
        self._offsets: dict[tuple[str, int], np.ndarray] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_stores": None, "_offsets": {}}

    @property
    def stores(self) -> dict[str, Store]:
        if self._stores is None:
            # Fully validated in setup(); workers only re-check sizes and headers.
            self._stores = {kind: open_store(path, verify="size") for kind, path in self.paths.items()}
        return self._stores

    def _span(self, kind: str, shard: int, j: int) -> tuple[int, int]:
        offsets = self._offsets.get((kind, shard))
        if offsets is None:
            offsets = self._offsets[(kind, shard)] = self.stores[kind].get(shard, "offsets").numpy()
        return int(offsets[j]), int(offsets[j + 1])

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k: int) -> dict[str, Any]:
        i = int(self.indices[k])
        tokens = self.stores["tokens"]
        shard, j = tokens.locate(i)
        a, b = self._span("tokens", shard, j)
        n = b - a
        item: dict[str, Any] = {
            "index": i,
            "input_ids": tokens.slice(shard, "input_ids", a, b).long(),
            "loss_mask": tokens.slice(shard, "loss_mask", a, b),
        }
        if "logits" in self.stores:
            lc = self.stores["logits"]  # same shards as the tokens (checked in setup)
            r0, r1 = self._span("logits", shard, j)
            pos = lc.slice(shard, "positions", r0, r1).long()
            m = lc.shape(shard, "topm_ids")[1]
            item["topm_ids"] = torch.zeros(n, m, dtype=torch.long).index_copy_(0, pos, lc.slice(shard, "topm_ids", r0, r1).long())
            item["topm_logits"] = torch.zeros(n, m).index_copy_(0, pos, lc.slice(shard, "topm_logits", r0, r1).float())
            item["true_logit"] = torch.zeros(n).index_copy_(0, pos, lc.slice(shard, "true_logit", r0, r1))
            item["logit_valid"] = torch.zeros(n, dtype=torch.bool).index_fill_(0, pos, True)
        if "features" in self.stores:
            item["features"] = self.stores["features"].slice(shard, "features", a, b)
        return item


def collate_draft_batch(items: Sequence[dict[str, Any]], pad_id: int = 0,
                        buckets: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """Right-pad dataset items to one length (the longest, or its bucket) and stack them (module table)."""
    b = len(items)
    t = pad_length(max(len(it["input_ids"]) for it in items), buckets)
    batch: dict[str, torch.Tensor] = {
        "input_ids": torch.full((b, t), int(pad_id), dtype=torch.long),
        "attention_mask": torch.zeros((b, t), dtype=torch.long),
        "loss_mask": torch.zeros((b, t), dtype=torch.bool),
        "index": torch.tensor([int(it["index"]) for it in items], dtype=torch.long),
    }
    first = items[0]
    if "topm_ids" in first:
        m = first["topm_ids"].shape[1]
        batch["topm_ids"] = torch.zeros((b, t, m), dtype=torch.long)
        batch["topm_logits"] = torch.zeros((b, t, m), dtype=torch.float32)
        batch["true_logit"] = torch.zeros((b, t), dtype=torch.float32)
        batch["logit_valid"] = torch.zeros((b, t), dtype=torch.bool)
    if "features" in first:
        batch["features"] = torch.zeros((b, t, first["features"].shape[1]), dtype=torch.bfloat16)
    for r, it in enumerate(items):
        n = len(it["input_ids"])
        batch["attention_mask"][r, :n] = 1
        for key in ("input_ids", "loss_mask", "topm_ids", "topm_logits", "true_logit", "logit_valid", "features"):
            if key in it:
                batch[key][r, :n] = it[key]
    if "topm_ids" in first:
        batch["floor_logit"] = batch["topm_logits"][..., -1].clone()
    return batch
