"""Sharded target-cache precompute: every data-parallel rank runs the frozen target on its share.

``DraftDataModule.prepare_data`` runs the frozen target over the whole data set in one process per
node while the other ranks wait. With ``W`` devices this splits the work ``W`` ways and writes the
same cache (byte-identical arrays, same fingerprint and manifest apart from its creation time):

1. rank 0 builds the token caches (the tokenizer is cheap next to the target), then all ranks meet;
2. the single-process path's length-sorted batches (``cache._batches_by_length``) are dealt round-robin
   to the ranks, batch ``j`` to rank ``j mod W``, so every example is computed in exactly the batch (same
   neighbours, same padded length) it would have had in one process: the numbers do not depend on ``W``;
3. each rank writes its examples as an ordinary cache (``precompute_target_caches`` on the subset) in
   ``<cache_dir>/.<name>.shards-of-W/rank<r>/``; a shard that is already there and valid (a previous
   attempt was killed) is reused;
4. after a barrier rank 0 scatters the shards' rows into the final cache through ``CacheWriter`` (temp dir,
   manifest, atomic rename) and removes the shards; a last barrier releases the other ranks.

The ranks must share the cache directory (one node, or a shared file system). Entry points:
``prepare_data_sharded(datamodule, ...)`` called by every rank (with ``strategy_kwargs(trainer.strategy)``
inside Lightning), and ``precompute_target_caches_sharded`` for raw token arrays.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lilicorr_pl.data import cache as cache_mod
from lilicorr_pl.data.cache import CacheError, CacheWriter, open_cache

__all__ = ["precompute_target_caches_sharded", "prepare_data_sharded", "shard_examples", "strategy_kwargs"]

Barrier = Callable[[], None]


def _torch_barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def strategy_kwargs(strategy: Any) -> dict[str, Any]:
    """``rank``, ``world_size``, ``barrier`` and ``device`` for ``prepare_data_sharded`` from a Lightning strategy."""
    return {
        "rank": strategy.global_rank,
        "world_size": strategy.world_size,
        "barrier": strategy.barrier,
        "device": strategy.root_device,
    }


def shard_examples(lengths: np.ndarray, batch_size: int, rank: int, world_size: int) -> np.ndarray:
    """Examples (ascending) of ``rank``'s batches: the single-process batches ``rank, rank + W, …``.

    In ascending index order they are re-batched by ``precompute_target_caches`` into exactly those
    batches: its stable length sort keeps ties in index order, like the global sort, and only the
    global last batch can be short.
    """
    batches = cache_mod._batches_by_length(np.asarray(lengths), batch_size)[rank::world_size]
    return np.sort(np.concatenate(batches)) if batches else np.zeros(0, dtype=np.int64)


def _subset(input_ids: np.ndarray, loss_mask: np.ndarray, offsets: np.ndarray, examples: np.ndarray):
    starts, ends = offsets[examples], offsets[examples + 1]
    lengths = ends - starts
    flat = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths) + np.arange(int(lengths.sum()))
    sub_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return np.asarray(input_ids)[flat], np.asarray(loss_mask)[flat], sub_offsets


def _chunks(n: int, size: int) -> Iterator[slice]:
    for a in range(0, n, size):
        yield slice(a, min(n, a + size))


def _merge(dest: Path, kind: str, parts: Mapping[str, Any], n: int, shards: list[tuple[np.ndarray, cache_mod.Cache]],
           chunk_examples: int = 4096) -> None:
    """Scatter the shards' per-example row spans into one cache, in example order (rank 0 only)."""
    counts = np.zeros(n, dtype=np.int64)
    for examples, shard in shards:
        counts[examples] = np.diff(np.asarray(shard["offsets"]))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    first = shards[0][1]
    meta = dict(first.meta)
    for key, value in (("rows", int(offsets[-1])), ("examples", n)):
        if key in meta:  # the counts are those of the whole data set, not of one shard
            meta[key] = value
    with CacheWriter(dest, kind, parts, meta) as writer:
        writer.save("offsets", offsets)
        for name, entry in first.manifest["files"].items():
            if name == "offsets":
                continue
            out = writer.create(name, [int(offsets[-1]), *entry["shape"][1:]], np.dtype(entry["dtype"]))
            for examples, shard in shards:
                local = np.asarray(shard["offsets"])
                for sl in _chunks(len(examples), chunk_examples):
                    ex, lo = examples[sl], local[sl.start : sl.stop + 1]
                    rows = lo[1:] - lo[:-1]
                    # Local row j of an example goes to that example's global start + (j - its local start).
                    target_rows = np.repeat(offsets[ex] - lo[:-1], rows) + np.arange(lo[0], lo[-1])
                    out[target_rows] = shard[name][lo[0] : lo[-1]]


def precompute_target_caches_sharded(
    target: Any,
    input_ids: np.ndarray,  # [T_total] flat
    loss_mask: np.ndarray,  # [T_total] flat bool
    offsets: np.ndarray,  # [n+1]
    *,
    rank: int | None = None,
    world_size: int | None = None,
    barrier: Barrier | None = None,
    logit_dest: str | os.PathLike | None = None,
    logit_parts: Mapping[str, Any] | None = None,
    top_m: int = 64,
    feature_dest: str | os.PathLike | None = None,
    feature_parts: Mapping[str, Any] | None = None,
    batch_size: int = 8,
    pad_id: int = 0,
    progress: bool = True,
    meta: Mapping[str, Any] | None = None,
) -> dict[str, Path]:
    """``cache.precompute_target_caches`` split over ``world_size`` ranks; every rank must call it.

    ``rank``/``world_size`` default to ``torch.distributed``'s (0 and 1 when it is not initialised),
    ``barrier`` to ``torch.distributed.barrier``. Returns the committed cache paths by kind on every rank.
    """
    if rank is None or world_size is None:
        rank, world_size = _world()
    barrier = barrier or _torch_barrier
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    dests = {kind: (Path(d), dict(p or {})) for kind, d, p in
             (("logits", logit_dest, logit_parts), ("features", feature_dest, feature_parts)) if d is not None}
    if not dests:
        return {}
    offsets = np.asarray(offsets, dtype=np.int64)
    n = len(offsets) - 1
    first_dest = next(iter(dests.values()))[0]
    work = first_dest.parent / f".{first_dest.name}.shards-of-{world_size}"

    def shard_parts(kind: str, r: int) -> dict[str, Any]:
        # Ties a shard to its final cache and to this split of the work: a stale shard is never merged.
        return {"shard_of": cache_mod.fingerprint(dests[kind][1]), "rank": r, "world_size": world_size,
                "batch_size": batch_size}

    def open_shard(kind: str, r: int) -> cache_mod.Cache | None:
        path = work / f"rank{r}" / kind
        expected = cache_mod.fingerprint(shard_parts(kind, r))
        with contextlib.suppress(CacheError):
            return open_cache(path, expected_fingerprint=expected, kind=kind, verify="size")
        return None

    examples = shard_examples(np.diff(offsets), batch_size, rank, world_size)
    todo = {kind: work / f"rank{rank}" / kind for kind in dests if open_shard(kind, rank) is None}
    if len(examples) and todo:
        for path in todo.values():
            shutil.rmtree(path, ignore_errors=True)  # an invalid leftover of a killed attempt
        sub_ids, sub_mask, sub_offsets = _subset(input_ids, loss_mask, offsets, examples)
        kwargs: dict[str, Any] = {}
        if "logits" in todo:
            kwargs.update(logit_dest=todo["logits"], logit_parts=shard_parts("logits", rank), top_m=top_m)
        if "features" in todo:
            kwargs.update(feature_dest=todo["features"], feature_parts=shard_parts("features", rank))
        cache_mod.precompute_target_caches(
            target, sub_ids, sub_mask, sub_offsets, batch_size=batch_size, pad_id=pad_id,
            progress=progress and rank == 0, meta=meta, **kwargs,
        )
    barrier()
    if rank == 0:
        for kind, (dest, parts) in dests.items():
            shards = []
            for r in range(world_size):
                ex = shard_examples(np.diff(offsets), batch_size, r, world_size)
                if len(ex) == 0:
                    continue
                shard = open_shard(kind, r)
                if shard is None:
                    raise CacheError(f"rank {r}'s {kind} shard under {work} is missing or invalid after the precompute")
                shards.append((ex, shard))
            _merge(dest, kind, parts, n, shards)
        shutil.rmtree(work, ignore_errors=True)
    barrier()
    return {kind: dest for kind, (dest, _) in dests.items()}


@contextlib.contextmanager
def _token_caches_only(datamodule: Any) -> Iterator[None]:
    saved = datamodule.logit_cache, datamodule.feature_cache
    datamodule.logit_cache = datamodule.feature_cache = False
    try:
        yield
    finally:
        datamodule.logit_cache, datamodule.feature_cache = saved


def prepare_data_sharded(
    datamodule: Any,
    rank: int | None = None,
    world_size: int | None = None,
    barrier: Barrier | None = None,
    device: str | torch.device | None = None,
) -> None:
    """``DraftDataModule.prepare_data`` with the target caches computed by all ranks; every rank calls it.

    Rank 0 writes the token caches; then the missing logit/feature caches of each split are computed
    sharded (see the module docstring). ``device``: where this rank runs the target (default: the data
    module's ``precompute_device``, else the current CUDA device, else CPU). Afterwards ``setup`` finds
    every cache in place, exactly as after ``prepare_data``.
    """
    from lilicorr_pl.target import FrozenTarget

    if rank is None or world_size is None:
        rank, world_size = _world()
    barrier = barrier or _torch_barrier
    datamodule._check_inputs()
    if rank == 0:
        with _token_caches_only(datamodule):
            datamodule.prepare_data()
    barrier()
    if device is None:
        device = datamodule.precompute_device or (
            f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        )
    target = None
    for split in datamodule._splits():
        paths = datamodule.cache_paths(split)
        # Checked by every rank between barriers, before anyone writes this split's caches: all agree.
        missing = {kind: path for kind, path in paths.items() if kind != "tokens" and not path.exists()}
        if not missing:
            continue
        tokens = datamodule._open(split, "tokens", paths["tokens"])
        if target is None:
            target = FrozenTarget.from_spec(datamodule._spec(), device=device)
        precompute_target_caches_sharded(
            target, tokens["input_ids"], tokens["loss_mask"], tokens["offsets"],
            rank=rank, world_size=world_size, barrier=barrier,
            **datamodule._precompute_kwargs(split, tokens, missing),
        )
    del target
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
