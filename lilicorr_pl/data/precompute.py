"""The frozen target's pass over the data: the target-logit and context-feature stores.

**Target logits** (kind ``logits``, for the distractor penalty): for every example and every supervised
position ``t >= 1`` (``loss_mask[t]``), the target's teacher-forced distribution predicting token ``t``
from ``x_<t`` (the target logits at position ``t - 1``), compressed to the top-M ids (int32) and values
(fp16, descending), the exact logit of the true token (fp32) and the position ``t`` (int32). The M-th
value is the floor for tokens not listed (an upper bound on their logits). ``6·M + 8`` bytes per
supervised token (392 B at M = 64) against ``2·V`` for full fp16 logits (303,872 B for Qwen3).

**Context features** (kind ``features``, offline mode): the concatenated target features
``[T, n·H]`` of every token, bf16 (``T × n·H × 2`` bytes, printed before writing).

Both stores are sharded like the token store they extend (shard ``s`` covers the same examples), and a
shard is computed in the same batches whoever computes it: the shard's examples, longest first, in
groups of ``precompute_batch_size``. ``PrecomputeJob`` holds one pass's work; ``DraftDataModule.
prepare_data`` runs it in one process (``run_in_process``) and ``lilicorr prepare`` spreads the
shards over devices with ``Trainer.predict`` (``lilicorr_pl.data.prepare``). Both call
``compute_batch`` and ``PrecomputeJob.add``, so both write the same bytes.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lilicorr_pl.data.store import Store, StoreWriter, provenance
from lilicorr_pl.progress import progress_bar

# ---------------------------------------------------------------------- sizes


def human_bytes(n: float) -> str:
    """``1536`` → ``'1.5 KiB'``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def logit_cache_bytes_per_token(top_m: int) -> int:
    """Bytes stored per supervised token: M int32 ids + M fp16 values + fp32 true logit + int32 position."""
    return top_m * (4 + 2) + 4 + 4


def full_logit_bytes_per_token(vocab_size: int) -> int:
    """Bytes per token of full fp16 logits (``V * 2``)."""
    return vocab_size * 2


def logit_cache_report(vocab_size: int, top_m: int) -> str:
    """One line comparing the compressed logit cache with full fp16 logits, per supervised token."""
    c, f = logit_cache_bytes_per_token(top_m), full_logit_bytes_per_token(vocab_size)
    return (
        f"target-logit cache: {c} B per supervised token (top-{top_m}) vs {human_bytes(f)} for full fp16 "
        f"logits over V={vocab_size:,} ({f / c:.0f}x smaller)"
    )


def feature_cache_bytes(total_tokens: int, feature_dim: int) -> int:
    """Bytes of a bf16 feature cache: ``T_total × n·H × 2``."""
    return int(total_tokens) * int(feature_dim) * 2


# ---------------------------------------------------------------------- reading target logits


def cached_candidate_logits(
    topm_ids: torch.Tensor,  # [..., M] long/int
    topm_logits: torch.Tensor,  # [..., M]
    floor: torch.Tensor,  # [...]
    true_ids: torch.Tensor,  # [...]
    true_logit: torch.Tensor,  # [...]
    ids: torch.Tensor,  # [..., J]
) -> torch.Tensor:
    """Approximate target logits of arbitrary candidate ids from the cached top-M (→ ``[..., J]`` float32).

    A candidate equal to the true token gets the exact stored true logit; a candidate listed in the
    top-M gets its stored (fp16) value; anything else gets the floor (the M-th value, an upper bound on
    its real logit).
    """
    topm_logits = topm_logits.float()
    match = ids.unsqueeze(-1) == topm_ids.unsqueeze(-2)  # [..., J, M]
    listed = torch.where(match, topm_logits.unsqueeze(-2), torch.zeros((), dtype=torch.float32, device=ids.device))
    out = torch.where(match.any(-1), listed.sum(-1), floor.float().unsqueeze(-1))
    return torch.where(ids == true_ids.unsqueeze(-1), true_logit.float().unsqueeze(-1), out)


def supervised_rows(loss_mask: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of a logit shard: local positions ``t >= 1`` with ``loss_mask[t]``, in example order, and the
    per-example row offsets. Returns ``(positions [R] int32, row_offsets [n+1] int64)``."""
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    local = np.arange(int(offsets[-1]), dtype=np.int64) - np.repeat(offsets[:-1], lengths)
    flat = np.nonzero(np.asarray(loss_mask, dtype=bool) & (local >= 1))[0]
    counts = np.bincount(np.repeat(np.arange(len(lengths)), lengths)[flat], minlength=len(lengths))
    return local[flat].astype(np.int32), np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def count_rows(tokens: Store) -> int:
    """Rows of the logit store that extends ``tokens``: its supervised positions ``t >= 1``."""
    return sum(len(supervised_rows(tokens.get(s, "loss_mask").numpy(), tokens.get(s, "offsets").numpy())[0])
               for s in range(len(tokens.shard_examples)))


# ---------------------------------------------------------------------- one target batch


@torch.no_grad()
def compute_batch(target: Any, batch: Mapping[str, Any], top_m: int | None, features: bool,
                  head_chunk: int = 1024) -> dict[str, torch.Tensor]:
    """One frozen target pass over a precompute batch (see ``PrecomputeBatches``), results on the CPU.

    The LM head runs only on the rows that are needed (``t - 1`` for supervised ``t``), ``head_chunk`` rows
    at a time, so a 151k-word vocabulary never materialises ``[b, T, V]``.
    """
    ids = batch["input_ids"]
    res = target(ids, attention_mask=batch["attention_mask"])
    out: dict[str, torch.Tensor] = {}
    if features:
        out["features"] = res.features.to(torch.bfloat16).cpu()  # [b, T, n·H]
    if top_m is not None:
        rows, pos = batch["row_batch"], batch["row_pos"]  # [R] each: supervised (batch row, position t)
        true_ids = ids[rows, pos]
        parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for c in range(0, max(1, len(rows)), head_chunk):
            sl = slice(c, c + head_chunk)
            # Row t holds the distribution predicting token t: the logits at t - 1.
            logits = target.lm_head(res.normed_hidden[rows[sl], pos[sl] - 1]).float()  # [rows, V]
            vals, top = logits.topk(top_m, dim=-1)
            parts.append((top.to(torch.int32), vals.to(torch.float16), logits.gather(-1, true_ids[sl, None])[:, 0]))
        for name, values in zip(("topm_ids", "topm_logits", "true_logit"), zip(*parts)):
            out[name] = torch.cat(values).cpu()
    return out


# ---------------------------------------------------------------------- the job


@dataclass
class SplitJob:
    """The stores one split still needs, and the token store they extend."""

    split: str
    tokens: Store
    writers: dict[str, StoreWriter]  # kind -> writer, for "logits" and/or "features"
    meta: dict[str, dict[str, Any]] = field(default_factory=dict)  # kind -> manifest meta


class PrecomputeJob:
    """One target pass: for each split, the missing logit/feature stores, shard by shard.

    Shard ``s`` of every split is assigned to process ``s mod world_size``; a process skips its shards
    that an interrupted earlier run already wrote. ``add`` places a batch's results in its shard and
    writes the shard once its last batch is in; ``finalize`` (one process, after all have finished)
    writes the manifests.
    """

    def __init__(self, splits: list[SplitJob], top_m: int, batch_size: int, head_chunk: int = 1024) -> None:
        self.splits = splits
        self.top_m = top_m
        self.batch_size = batch_size
        self.head_chunk = head_chunk
        self._open: dict[tuple[int, int], _ShardBuffer] = {}

    @property
    def wants_logits(self) -> bool:
        return any("logits" in j.writers for j in self.splits)

    @property
    def wants_features(self) -> bool:
        return any("features" in j.writers for j in self.splits)

    def todo(self, rank: int = 0, world_size: int = 1) -> list[tuple[int, int]]:
        """(split job, shard) pairs this process computes."""
        return [(j, s) for j, job in enumerate(self.splits) for s in range(rank, len(job.tokens.shard_examples), world_size)
                if not all(w.done(s) for w in job.writers.values())]

    def batches(self, rank: int = 0, world_size: int = 1) -> PrecomputeBatches:
        return PrecomputeBatches(self, self.todo(rank, world_size))

    def report(self, feature_dim: int) -> str:
        """What will be written and how big it is (printed before the first forward)."""
        lines = []
        for job in self.splits:
            if "logits" in job.writers:
                rows = count_rows(job.tokens)
                lines.append(f"[lilicorr] {job.split}: target-logit cache, {rows:,} supervised tokens × "
                             f"{logit_cache_bytes_per_token(self.top_m)} B ≈ "
                             f"{human_bytes(rows * logit_cache_bytes_per_token(self.top_m))} -> {job.writers['logits'].dest}")
            if "features" in job.writers:
                tokens = job.tokens.meta["tokens"]
                lines.append(f"[lilicorr] {job.split}: context-feature cache, {tokens:,} tokens × {feature_dim} "
                             f"features × 2 B (bf16) ≈ {human_bytes(feature_cache_bytes(tokens, feature_dim))} "
                             f"-> {job.writers['features'].dest}")
        return "\n".join(lines)

    def check(self, target: Any) -> None:
        """Settings that must fit the target, and disk space for the features: before the first forward."""
        if self.wants_logits:
            vocab = int(target.output_rows)
            if not 1 <= self.top_m <= vocab:
                raise ValueError(f"logit_top_m must be in 1..{vocab} (target output rows), got {self.top_m}; "
                                 "fix data.logit_top_m")
        feature_dim = target.hidden_size * target.num_features
        for job in self.splits:
            if "features" in job.writers:
                need = feature_cache_bytes(job.tokens.meta["tokens"], feature_dim)
                parent = job.writers["features"].dest.parent
                free = shutil.disk_usage(parent).free
                if need > free:
                    raise OSError(
                        f"the feature cache needs about {human_bytes(need)} but only {human_bytes(free)} is free under "
                        f"{parent}; free space, set data.cache_dir elsewhere, or turn off data.feature_cache"
                    )

    def compute(self, target: Any, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return compute_batch(target, batch, self.top_m if self.wants_logits else None, self.wants_features,
                             self.head_chunk)

    def add(self, batch: Mapping[str, Any], output: Mapping[str, torch.Tensor]) -> None:
        key = (int(batch["job"]), int(batch["shard"]))
        buf = self._open.get(key)
        if buf is None:
            buf = self._open[key] = _ShardBuffer(self, *key)
        buf.add(batch, output)
        if buf.complete:
            buf.write()
            del self._open[key]

    def finalize(self, **extra: Any) -> dict[str, dict[str, Path]]:
        """Write every store's manifest and move it into place (after all processes wrote their shards)."""
        done: dict[str, dict[str, Path]] = {}
        for job in self.splits:
            for kind, writer in job.writers.items():
                done.setdefault(job.split, {})[kind] = writer.finalize(
                    len(job.tokens.shard_examples), job.meta[kind], provenance(**extra))
        return done


class _ShardBuffer:
    """One shard's results, filled batch by batch (preallocated: its rows and tokens are known)."""

    def __init__(self, job: PrecomputeJob, j: int, shard: int) -> None:
        self.job, self.split, self.shard = job, job.splits[j], shard
        tokens = self.split.tokens
        self.offsets = tokens.get(shard, "offsets").numpy()
        self.missing = set(range(len(self.offsets) - 1))
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}
        if "logits" in self.split.writers:
            positions, row_offsets = supervised_rows(tokens.get(shard, "loss_mask").numpy(), self.offsets)
            rows, m = len(positions), job.top_m
            self.row_offsets = row_offsets
            self.tensors["logits"] = {
                "offsets": torch.from_numpy(row_offsets), "positions": torch.from_numpy(positions),
                "topm_ids": torch.zeros(rows, m, dtype=torch.int32), "topm_logits": torch.zeros(rows, m, dtype=torch.float16),
                "true_logit": torch.zeros(rows, dtype=torch.float32),
            }

    @property
    def complete(self) -> bool:
        return not self.missing

    def add(self, batch: Mapping[str, Any], output: Mapping[str, torch.Tensor]) -> None:
        examples = batch["examples"].cpu().tolist()
        if "features" in self.split.writers:
            if "features" not in self.tensors:  # allocated once the feature width is known
                width = output["features"].shape[-1]
                self.tensors["features"] = {"features": torch.zeros(int(self.offsets[-1]), width, dtype=torch.bfloat16)}
            feats = self.tensors["features"]["features"]
            for r, i in enumerate(examples):
                a, b = int(self.offsets[i]), int(self.offsets[i + 1])
                feats[a:b] = output["features"][r, : b - a]
        if "logits" in self.tensors:
            # The batch's rows are its examples' supervised positions, example by example, ascending.
            dest = torch.from_numpy(np.concatenate(
                [np.arange(self.row_offsets[i], self.row_offsets[i + 1]) for i in examples]).astype(np.int64))
            for name in ("topm_ids", "topm_logits", "true_logit"):
                self.tensors["logits"][name][dest] = output[name]
        self.missing -= set(examples)

    def write(self) -> None:
        span = self.split.tokens.shard_examples[self.shard]
        for kind, tensors in self.tensors.items():
            self.split.writers[kind].write(self.shard, span, tensors)


class PrecomputeBatches(Dataset):
    """The padded target batches of some shards: each shard's examples, longest first, ``batch_size`` at a time.

    An item is a dict: ``job``/``shard`` (ints), ``examples`` (indices inside the shard), ``input_ids`` and
    ``attention_mask`` ``[b, T]`` (right-padded), and ``row_batch``/``row_pos`` ``[R]``: the supervised
    positions ``t >= 1`` whose target logits are kept, example by example in ascending order.
    """

    def __init__(self, job: PrecomputeJob, shards: list[tuple[int, int]]) -> None:
        self.job = job
        self.items: list[tuple[int, int, np.ndarray]] = []
        for j, s in shards:
            offsets = job.splits[j].tokens.get(s, "offsets").numpy()
            # Stable sort, longest first: the first batch hits peak memory at once (fail fast), little padding.
            order = np.argsort(-np.diff(offsets), kind="stable")
            self.items += [(j, s, order[i : i + job.batch_size]) for i in range(0, len(order), job.batch_size)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Any]:
        j, s, examples = self.items[index]
        tokens = self.job.splits[j].tokens
        offsets = tokens.get(s, "offsets")
        spans = [(int(offsets[i]), int(offsets[i + 1])) for i in examples]
        t = max(b - a for a, b in spans)
        pad_id = int(tokens.meta.get("pad_id", 0))
        ids = torch.full((len(examples), t), pad_id, dtype=torch.long)
        attn = torch.zeros((len(examples), t), dtype=torch.long)
        mask = torch.zeros((len(examples), t), dtype=torch.bool)
        for r, (a, b) in enumerate(spans):
            ids[r, : b - a] = tokens.slice(s, "input_ids", a, b).long()
            mask[r, : b - a] = tokens.slice(s, "loss_mask", a, b)
            attn[r, : b - a] = 1
        mask[:, 0] = False  # position 0 predicts nothing
        row_batch, row_pos = mask.nonzero(as_tuple=True)  # row-major: example by example, ascending
        return {"job": j, "shard": s, "examples": torch.from_numpy(examples.astype(np.int64)), "input_ids": ids,
                "attention_mask": attn, "row_batch": row_batch, "row_pos": row_pos}


def _to(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def run_in_process(job: PrecomputeJob, target: Any, progress: bool = True, **provenance_extra: Any) -> dict[str, dict[str, Path]]:
    """The whole job in this process (``prepare_data``): every shard, then the manifests."""
    job.check(target)
    print(job.report(target.hidden_size * target.num_features), file=sys.stderr)
    for batch in progress_bar(job.batches(), desc="target precompute", unit="batch", disable=not progress, dynamic_ncols=True):
        job.add(batch, job.compute(target, _to(batch, target.device)))
    return job.finalize(processes=1, **provenance_extra)


# ---------------------------------------------------------------------- throughput


def precompute_throughput(job: PrecomputeJob, target: Any, repeats: int = 1) -> dict[str, float]:
    """Time the raw target forward over the job's batches against the full precompute (forward, top-M on the
    supervised rows, copies, shard writes). Returns seconds for both and ``ratio = forward / precompute``
    (goal >= 0.9). Writes nothing outside a temporary directory."""
    import tempfile

    device = target.device
    every_shard = [(j, s) for j, split in enumerate(job.splits) for s in range(len(split.tokens.shard_examples))]
    batches = [_to(b, device) for b in PrecomputeBatches(job, every_shard)]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def raw_forward() -> None:
        with torch.no_grad():
            for b in batches:
                target(b["input_ids"], attention_mask=b["attention_mask"], return_logits=True)
        sync()

    raw_forward()  # warm-up
    forward_s, precompute_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        raw_forward()
        forward_s.append(time.perf_counter() - t0)
        with tempfile.TemporaryDirectory() as tmp:
            scratch = PrecomputeJob(
                [SplitJob(j.split, j.tokens, {k: StoreWriter(Path(tmp) / f"{j.split}-{k}", k, {}) for k in j.writers},
                          j.meta) for j in job.splits],
                job.top_m, job.batch_size, job.head_chunk)
            t0 = time.perf_counter()
            for b in batches:
                scratch.add(b, scratch.compute(target, b))
            sync()
            precompute_s.append(time.perf_counter() - t0)
    fwd, pre = min(forward_s), min(precompute_s)
    tokens = float(sum(j.tokens.meta["tokens"] for j in job.splits))
    print(f"[lilicorr] precompute throughput: raw forward {fwd:.3f}s, precompute {pre:.3f}s, ratio {fwd / pre:.2f} "
          f"over {int(tokens):,} tokens", file=sys.stderr)
    return {"forward_s": fwd, "precompute_s": pre, "ratio": fwd / pre, "tokens": tokens}
