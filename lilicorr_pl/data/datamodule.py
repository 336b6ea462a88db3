"""``DraftDataModule``: tokenized data, the target-logit and context-feature caches, resumable batches.

``prepare_data`` (one process per node) tokenizes the files and runs the frozen target once to build
the caches; ``setup`` (every process) only opens and validates them, memory-mapped. Each cache lives
in ``cache_dir/<kind>-<fingerprint>/`` (kinds ``tokens``, ``logits``, ``features``) and is reused as long
as nothing it depends on changed; a cache that fails validation is refused, never silently used.

Batch layout (right-padded to the longest sequence in the batch):

==================  ===================  ======================================================
key                 shape / dtype        meaning
==================  ===================  ======================================================
``input_ids``       ``[b, T]`` long      token ids, padded with the tokenizer's pad id
``attention_mask``  ``[b, T]`` long      1 on real tokens
``loss_mask``       ``[b, T]`` bool      supervised (response) tokens
``index``           ``[b]`` long         example index in its split's token cache
``topm_ids``        ``[b, T, M]`` long   with the logit cache: row ``t`` is the target's top-M
``topm_logits``     ``[b, T, M]`` f32    for predicting token ``t`` from ``x_<t`` (descending)
``floor_logit``     ``[b, T]`` f32       M-th value: stands in for tokens not in the top-M
``true_logit``      ``[b, T]`` f32       exact target logit of ``input_ids[:, t]`` at row ``t``
``logit_valid``     ``[b, T]`` bool      rows that hold data (``t >= 1`` and ``loss_mask[t]``)
``features``        ``[b, T, n·H]`` bf16 with the feature cache: concatenated target features
==================  ===================  ======================================================

Use ``lilicorr_pl.data.cache.cached_candidate_logits`` to read target logits of arbitrary candidate
ids out of a batch.
"""

from __future__ import annotations

import math
from array import array
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, is_dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from lilicorr_pl.data import cache as cache_mod
from lilicorr_pl.data.cache import CacheError, CacheWriter, cache_path, open_cache
from lilicorr_pl.data.formats import (
    FORMAT_VERSION,
    LoadStats,
    check_data_files,
    effective_chat_template,
    iter_examples,
    resolve_chat_template,
)
from lilicorr_pl.target import FrozenTarget, TargetSpec

# ---------------------------------------------------------------------- dataset and batches


class CachedDraftDataset(Dataset):
    """Examples of one split, read from the memory-mapped caches.

    Holds only paths; each process (including DataLoader workers) opens the memmaps lazily, so the
    dataset pickles cheaply and never copies a cache.
    """

    def __init__(
        self,
        tokens_path: Path,
        indices: np.ndarray,
        logits_path: Path | None = None,
        features_path: Path | None = None,
    ) -> None:
        self.tokens_path = Path(tokens_path)
        self.logits_path = Path(logits_path) if logits_path is not None else None
        self.features_path = Path(features_path) if features_path is not None else None
        self.indices = np.asarray(indices, dtype=np.int64)
        self._caches: dict[str, cache_mod.Cache] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_caches"] = None
        return state

    @property
    def caches(self) -> dict[str, cache_mod.Cache]:
        if self._caches is None:
            # Already fully validated in setup(); workers only re-check headers and sizes.
            caches = {"tokens": open_cache(self.tokens_path, verify="size")}
            if self.logits_path is not None:
                caches["logits"] = open_cache(self.logits_path, verify="size")
            if self.features_path is not None:
                caches["features"] = open_cache(self.features_path, verify="size")
            self._caches = caches
        return self._caches

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, j: int) -> dict[str, Any]:
        i = int(self.indices[j])
        tokens = self.caches["tokens"]
        a, b = int(tokens["offsets"][i]), int(tokens["offsets"][i + 1])
        n = b - a
        item: dict[str, Any] = {
            "index": i,
            "input_ids": np.array(tokens["input_ids"][a:b], dtype=np.int64),
            "loss_mask": np.array(tokens["loss_mask"][a:b], dtype=bool),
        }
        if "logits" in self.caches:
            lc = self.caches["logits"]
            r0, r1 = int(lc["offsets"][i]), int(lc["offsets"][i + 1])
            m = lc["topm_ids"].shape[1]
            pos = np.array(lc["positions"][r0:r1], dtype=np.int64)
            topm_ids = np.zeros((n, m), dtype=np.int64)
            topm_logits = np.zeros((n, m), dtype=np.float32)
            true_logit = np.zeros(n, dtype=np.float32)
            valid = np.zeros(n, dtype=bool)
            topm_ids[pos] = lc["topm_ids"][r0:r1]
            topm_logits[pos] = lc["topm_logits"][r0:r1]
            true_logit[pos] = lc["true_logit"][r0:r1]
            valid[pos] = True
            item.update(topm_ids=topm_ids, topm_logits=topm_logits, true_logit=true_logit, logit_valid=valid)
        if "features" in self.caches:
            fc = self.caches["features"]
            fa = int(fc["offsets"][i])
            item["features"] = np.array(fc["features"][fa : fa + n])
        return item


def collate_draft_batch(items: Sequence[dict[str, Any]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad a list of dataset items to the longest and stack them (see the module table)."""
    b = len(items)
    t = max(len(it["input_ids"]) for it in items)
    batch: dict[str, torch.Tensor] = {
        "input_ids": torch.full((b, t), int(pad_id), dtype=torch.long),
        "attention_mask": torch.zeros((b, t), dtype=torch.long),
        "loss_mask": torch.zeros((b, t), dtype=torch.bool),
        "index": torch.tensor([int(it["index"]) for it in items], dtype=torch.long),
    }
    has_logits = "topm_ids" in items[0]
    if has_logits:
        m = items[0]["topm_ids"].shape[1]
        batch["topm_ids"] = torch.zeros((b, t, m), dtype=torch.long)
        batch["topm_logits"] = torch.zeros((b, t, m), dtype=torch.float32)
        batch["true_logit"] = torch.zeros((b, t), dtype=torch.float32)
        batch["logit_valid"] = torch.zeros((b, t), dtype=torch.bool)
    if "features" in items[0]:
        batch["features"] = torch.zeros((b, t, items[0]["features"].shape[1]), dtype=torch.bfloat16)
    for r, it in enumerate(items):
        n = len(it["input_ids"])
        batch["input_ids"][r, :n] = torch.from_numpy(it["input_ids"])
        batch["attention_mask"][r, :n] = 1
        batch["loss_mask"][r, :n] = torch.from_numpy(it["loss_mask"])
        if has_logits:
            batch["topm_ids"][r, :n] = torch.from_numpy(it["topm_ids"])
            batch["topm_logits"][r, :n] = torch.from_numpy(it["topm_logits"])
            batch["true_logit"][r, :n] = torch.from_numpy(it["true_logit"])
            batch["logit_valid"][r, :n] = torch.from_numpy(it["logit_valid"])
        if "features" in it:
            batch["features"][r, :n] = cache_mod.features_from_numpy(it["features"])
    if has_logits:
        batch["floor_logit"] = batch["topm_logits"][..., -1].clone()
    return batch


class ResumableShuffleSampler(DistributedSampler):
    """A seeded per-epoch permutation, sharded over data-parallel ranks, that can resume mid-epoch.

    Epoch ``e`` visits the global order ``randperm(n, generator=seed + e)``. Rank ``r`` of ``W`` takes every
    ``W``-th sample of it starting at ``r``, so one step of ``W`` ranks × ``b`` samples consumes the next
    ``W·b`` samples of the global order: the samples one process with batch ``W·b`` would see. ``skip`` drops
    the first samples of the current epoch's *global* order once (set when resuming; the data module's
    state counts global samples, so exact resume needs the same ``W`` and batch size). When the rest of the
    epoch does not divide by ``W``, the shards are padded with its first samples (as ``DistributedSampler``
    does) so every rank runs the same number of steps. ``__len__`` is this rank's share of a whole epoch,
    so Lightning's batch counters, which already include the consumed batches, stay consistent.

    It subclasses ``DistributedSampler`` only so that Lightning keeps it instead of wrapping it in one.
    """

    def __init__(
        self, num_samples: int, seed: int = 0, shuffle: bool = True, num_replicas: int = 1, rank: int = 0
    ) -> None:
        # Explicit replicas/rank: DistributedSampler would otherwise query torch.distributed.
        super().__init__(range(int(num_samples)), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.dataset_size = int(num_samples)
        self.skip = 0
        self.yielded = 0  # global position reached in the current epoch (exact when iterated by hand)

    def set_epoch(self, epoch: int) -> None:
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self.skip = 0

    def order(self, epoch: int) -> list[int]:
        """The global visiting order of ``epoch`` (all ranks together)."""
        if not self.shuffle:
            return list(range(self.dataset_size))
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.dataset_size, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        start, self.skip = self.skip, 0
        rest = self.order(self.epoch)[start:]
        world = self.num_replicas
        if rest and len(rest) % world:
            pad = world - len(rest) % world
            rest += (rest * math.ceil(pad / len(rest)))[:pad]
        self.yielded = start
        for i in rest[self.rank :: world]:
            self.yielded += world
            yield i

    def __len__(self) -> int:
        return self.num_samples


class ShardedEvalSampler(DistributedSampler):
    """Rank ``r`` of ``W`` evaluates examples ``r, r+W, r+2W, …``: every example exactly once.

    ``DistributedSampler``, which Lightning would add otherwise, pads the shards with repeated examples,
    which the sum-reduced validation metrics would then count twice. Shards may differ by one example.
    """

    def __init__(self, num_samples: int, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(range(int(num_samples)), num_replicas=num_replicas, rank=rank, shuffle=False)
        self.dataset_size = int(num_samples)
        self.num_samples = len(range(rank, self.dataset_size, num_replicas))

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.dataset_size, self.num_replicas))

    def __len__(self) -> int:
        return self.num_samples


class ResumableDataLoader(DataLoader):
    """The training DataLoader; stateful for Lightning (its state is the data module's shuffle position).

    Lightning saves and restores a loader that has ``state_dict``/``load_state_dict`` by itself, and
    then knows the loader resumes mid-epoch (no "dataloader is not resumable" warning).
    """

    def __init__(self, *args: Any, state_owner: DraftDataModule, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._state_owner = state_owner

    def state_dict(self) -> dict[str, Any]:
        return self._state_owner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._state_owner.load_state_dict(state_dict)


# ---------------------------------------------------------------------- the data module


def _as_spec(target: TargetSpec | dict[str, Any] | None) -> TargetSpec | None:
    if target is None or isinstance(target, TargetSpec):
        return target
    if isinstance(target, dict):
        return TargetSpec(**target)
    if is_dataclass(target):
        return TargetSpec(**asdict(target))
    raise TypeError(f"data.target must be a TargetSpec or a dict, got {type(target).__name__}")


class DraftDataModule(L.LightningDataModule):
    """Training data for a DFlash drafter: tokenized chats/text plus the frozen target's caches.

    Args:
        train_files: ``.jsonl``/``.parquet`` files of text, prompt/completion, OpenAI messages or
            ShareGPT records (see ``lilicorr_pl.data.formats``).
        val_files: held-out files; when None, ``val_fraction`` of the training examples is split off.
        val_fraction: share of training examples used for validation when ``val_files`` is None
            (seeded by ``seed``; 0 disables validation).
        max_length: tokens per sequence; longer examples keep their first ``max_length`` tokens.
        batch_size: sequences per batch.
        num_workers: DataLoader worker processes.
        seed: seeds the train/val split and the per-epoch shuffle.
        enable_thinking: value of the chat template's ``enable_thinking`` flag (must match
            regeneration and evaluation).
        chat_template: Jinja chat template (text or a path to a file) overriding the tokenizer's.
        pack: concatenate consecutive short examples into sequences of up to ``max_length`` tokens.
        logit_cache: precompute the target-logit cache (top-M logits per supervised token) needed by
            the distractor penalty. The training system turns it off when no loss needs it
            (``require_logit_cache``).
        logit_top_m: M, target logits kept per supervised token in the logit cache.
        feature_cache: also cache the target's context features (bf16) so training can run without
            the full target (offline mode). Large: about ``n·H·2`` bytes per token.
        cache_dir: root directory of the caches (``<cache_dir>/<kind>-<fingerprint>/``).
        target: the frozen target (linked from ``model.target`` by the CLI); its tokenizer is used
            for tokenization and its weights for the caches. A plain dict is accepted.
        precompute_batch_size: sequences per target forward while building the caches.
        max_examples: read at most this many records per split (quick experiments).
        cache_verify: ``"full"`` checks every cache file's sha256 when opening it, ``"size"`` only its
            header and size (faster for very large feature caches).
        precompute_device: device for the cache precompute; None = CUDA when available, else CPU.
        progress: show a progress bar while precomputing.
        shard_precompute: under a multi-process strategy, compute the target caches on every rank (each
            a share of the batches, merged by rank 0 into the same cache format) instead of on one.
    """

    def __init__(
        self,
        train_files: list[str],
        val_files: list[str] | None = None,
        val_fraction: float = 0.05,
        max_length: int = 3072,
        batch_size: int = 1,
        num_workers: int = 0,
        seed: int = 0,
        enable_thinking: bool = False,
        chat_template: str | None = None,
        pack: bool = False,
        logit_cache: bool = True,
        logit_top_m: int = 64,
        feature_cache: bool = False,
        cache_dir: str = "cache",
        target: TargetSpec | dict[str, Any] | None = None,
        precompute_batch_size: int = 8,
        max_examples: int | None = None,
        cache_verify: Literal["full", "size"] = "full",
        precompute_device: str | None = None,
        progress: bool = True,
        shard_precompute: bool = False,
    ) -> None:
        super().__init__()
        # The spec is stored as a plain dict: checkpoints then load with torch.load(weights_only=True).
        self.save_hyperparameters(ignore=["target"])
        if isinstance(train_files, str):
            train_files = [train_files]
        if isinstance(val_files, str):
            val_files = [val_files]
        if not train_files:
            raise ValueError("data.train_files is empty; give one or more .jsonl/.parquet files")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
        if max_length < 2:
            raise ValueError(f"data.max_length must be >= 2, got {max_length}")
        if batch_size < 1 or precompute_batch_size < 1:
            raise ValueError(
                f"data.batch_size ({batch_size}) and data.precompute_batch_size ({precompute_batch_size}) must be >= 1"
            )
        if logit_top_m < 1:
            raise ValueError(f"data.logit_top_m must be >= 1, got {logit_top_m}")
        if cache_verify not in ("full", "size"):
            raise ValueError(f"data.cache_verify must be 'full' or 'size', got {cache_verify!r}")
        if max_examples is not None and max_examples < 1:
            raise ValueError(f"data.max_examples must be >= 1 or None, got {max_examples}")
        # ``builtin:stdlib-train[:N]`` names are resolved to files by the `lilicorr` command (lilicorr_pl.builtin).
        self.train_files = list(train_files)
        self.val_files = list(val_files) if val_files else None
        self.val_fraction = float(val_fraction)
        self.max_length = int(max_length)
        self.batch_size = int(batch_size)
        self.num_workers = int(num_workers)
        self.seed = int(seed)
        self.enable_thinking = bool(enable_thinking)
        self.chat_template = chat_template
        self.pack = bool(pack)
        self.logit_cache = bool(logit_cache)
        self.logit_top_m = int(logit_top_m)
        self.feature_cache = bool(feature_cache)
        self.shard_precompute = bool(shard_precompute)
        self.cache_dir = str(cache_dir)
        self.target = _as_spec(target)
        self.hparams["target"] = asdict(self.target) if self.target is not None else None
        self.precompute_batch_size = int(precompute_batch_size)
        self.max_examples = max_examples
        self.cache_verify = cache_verify
        self.precompute_device = precompute_device
        self.progress = bool(progress)

        self._tokenizer: Any = None
        self._parts: dict[str, dict[str, Any]] = {}  # memoised fingerprint parts per (split, kind)
        self.load_stats: dict[str, LoadStats] = {}
        self.train_dataset: CachedDraftDataset | None = None
        self.val_dataset: CachedDraftDataset | None = None
        self.pad_id = 0
        self._sampler: ResumableShuffleSampler | None = None
        self._pending_state: dict[str, Any] | None = None

    # ------------------------------------------------------------------ configuration
    def require_logit_cache(self, flag: bool) -> None:
        """Called by the training system: build/read the target-logit cache only if a loss needs it."""
        self.logit_cache = bool(flag)

    def _spec(self) -> TargetSpec:
        if self.target is None:
            raise ValueError(
                "DraftDataModule needs the target (its tokenizer tokenizes the data, its weights build the "
                "caches); set data.target, or use `lilicorr fit`, which links it from model.target"
            )
        return self.target

    @property
    def tokenizer(self) -> Any:
        """The target's tokenizer (loaded from ``target.name_or_path``)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            spec = self._spec()
            self._tokenizer = AutoTokenizer.from_pretrained(
                spec.name_or_path, trust_remote_code=spec.trust_remote_code
            )
        return self._tokenizer

    def _splits(self) -> dict[str, tuple[list[str], str]]:
        splits = {"train": (self.train_files, "data.train_files")}
        if self.val_files:
            splits["val"] = (self.val_files, "data.val_files")
        return splits

    def _check_inputs(self) -> None:
        """Cheap checks that must fail before any tokenizer or model work."""
        self._spec()
        for files, setting in self._splits().values():
            check_data_files(files, setting)
        resolve_chat_template(self.chat_template)

    # ------------------------------------------------------------------ fingerprints
    def _tokens_parts(self, split: str) -> dict[str, Any]:
        key = f"{split}/tokens"
        if key not in self._parts:
            files, setting = self._splits()[split]
            template = effective_chat_template(self.tokenizer, self.chat_template)
            self._parts[key] = {
                "kind": "tokens",
                "schema": cache_mod.SCHEMA_VERSION,
                "format_version": FORMAT_VERSION,
                "files": cache_mod.fingerprint_files(check_data_files(files, setting)),
                "tokenizer": cache_mod.fingerprint_tokenizer(self.tokenizer, template),
                "enable_thinking": self.enable_thinking,
                "max_length": self.max_length,
                "pack": self.pack,
                "max_examples": self.max_examples,
            }
        return self._parts[key]

    def _target_parts(self, include_layers: bool) -> dict[str, Any]:
        key = f"target/{include_layers}"
        if key not in self._parts:  # reads a few MiB of each weight file: once per process
            self._parts[key] = cache_mod.fingerprint_target(self._spec(), include_layers=include_layers)
        return self._parts[key]

    def _logits_parts(self, split: str) -> dict[str, Any]:
        return {
            "kind": "logits",
            "schema": cache_mod.SCHEMA_VERSION,
            "tokens": cache_mod.fingerprint(self._tokens_parts(split)),
            "target": self._target_parts(include_layers=False),
            "top_m": self.logit_top_m,
        }

    def _features_parts(self, split: str) -> dict[str, Any]:
        return {
            "kind": "features",
            "schema": cache_mod.SCHEMA_VERSION,
            "tokens": cache_mod.fingerprint(self._tokens_parts(split)),
            "target": self._target_parts(include_layers=True),
            "storage": "bfloat16-bits-int16",
        }

    def cache_paths(self, split: str = "train") -> dict[str, Path]:
        """Where this configuration's caches for ``split`` live (whether or not they exist yet)."""
        paths = {"tokens": cache_path(self.cache_dir, "tokens", self._tokens_parts(split))}
        if self.logit_cache:
            paths["logits"] = cache_path(self.cache_dir, "logits", self._logits_parts(split))
        if self.feature_cache:
            paths["features"] = cache_path(self.cache_dir, "features", self._features_parts(split))
        return paths

    def _parts_for(self, split: str, kind: str) -> dict[str, Any]:
        build = {"tokens": self._tokens_parts, "logits": self._logits_parts, "features": self._features_parts}
        return build[kind](split)

    def _open(self, split: str, kind: str, path: Path) -> cache_mod.Cache:
        expected = cache_mod.fingerprint(self._parts_for(split, kind))
        return open_cache(path, expected_fingerprint=expected, kind=kind, verify=self.cache_verify)

    # ------------------------------------------------------------------ prepare_data: writes
    def _sharded(self) -> bool:
        trainer = getattr(self, "trainer", None)
        return self.shard_precompute and trainer is not None and trainer.world_size > 1

    def prepare_data(self) -> None:
        """Tokenize the data and build the target caches that are missing (reusing valid ones).

        With ``shard_precompute`` under a multi-process strategy, only the token caches are written
        here; every rank then computes its share of the target caches in ``setup``.
        """
        if self._sharded():
            from lilicorr_pl.data.sharded import _token_caches_only

            with _token_caches_only(self):
                self._prepare_caches()
            return
        self._prepare_caches()

    def _prepare_caches(self) -> None:
        self._check_inputs()
        todo: list[tuple[str, dict[str, Path]]] = []
        for split in self._splits():
            paths = self.cache_paths(split)
            if paths["tokens"].exists():
                tokens = self._open(split, "tokens", paths["tokens"])
            else:
                tokens = self._write_tokens(split, paths["tokens"])
            missing = {}
            for kind in ("logits", "features"):
                if kind in paths:
                    if paths[kind].exists():
                        self._open(split, kind, paths[kind])  # refuse a corrupt cache loudly
                    else:
                        missing[kind] = paths[kind]
            if missing:
                todo.append((split, {"tokens": tokens, **missing}))
        if not todo:
            return
        target = self._load_target()
        for split, job in todo:
            tokens = job["tokens"]
            cache_mod.precompute_target_caches(
                target, tokens["input_ids"], tokens["loss_mask"], tokens["offsets"],
                **self._precompute_kwargs(split, tokens, job),
            )
        del target
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _precompute_kwargs(self, split: str, tokens: cache_mod.Cache, dests: dict[str, Any]) -> dict[str, Any]:
        """Keyword arguments of a target-cache precompute for ``split`` writing the caches in ``dests``
        (shared by the single-process and the sharded path, so both write the same format)."""
        kwargs: dict[str, Any] = dict(
            batch_size=self.precompute_batch_size,
            pad_id=int(tokens.meta.get("pad_id", 0)),
            progress=self.progress,
            meta={"split": split, "target": self._spec().name_or_path},
        )
        if "logits" in dests:
            kwargs.update(logit_dest=dests["logits"], logit_parts=self._logits_parts(split), top_m=self.logit_top_m)
        if "features" in dests:
            kwargs.update(feature_dest=dests["features"], feature_parts=self._features_parts(split))
        return kwargs

    def _load_target(self) -> FrozenTarget:
        device = self.precompute_device or ("cuda" if torch.cuda.is_available() else "cpu")
        return FrozenTarget.from_spec(self._spec(), device=device)

    def _write_tokens(self, split: str, dest: Path) -> cache_mod.Cache:
        files, setting = self._splits()[split]
        stats = LoadStats()
        input_ids, loss_mask, lengths = array("i"), bytearray(), array("q")  # compact, streamed
        for ex in iter_examples(
            files,
            self.tokenizer,
            max_length=self.max_length,
            enable_thinking=self.enable_thinking,
            chat_template=self.chat_template,
            pack=self.pack,
            max_examples=self.max_examples,
            setting=setting,
            stats=stats,
        ):
            input_ids.extend(ex.input_ids)
            loss_mask.extend(bytes(ex.loss_mask))
            lengths.append(len(ex))
        self.load_stats[split] = stats
        if stats.dropped_unsupervised:
            warnings.warn(
                f"{split}: dropped {stats.dropped_unsupervised} of {stats.records} records with no supervised "
                f"token within max_length={self.max_length}",
                stacklevel=2,
            )
        offsets = np.concatenate([[0], np.cumsum(np.frombuffer(lengths, dtype=np.int64))]).astype(np.int64)
        pad_id = self.tokenizer.pad_token_id
        if pad_id is None:
            pad_id = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        meta = {
            "split": split,
            "examples": stats.examples,
            "tokens": int(offsets[-1]),
            "supervised_tokens": stats.supervised_tokens,
            "records": stats.records,
            "truncated": stats.truncated,
            "dropped_unsupervised": stats.dropped_unsupervised,
            "formats": stats.formats,
            "pad_id": int(pad_id),
            "enable_thinking": self.enable_thinking,
            "chat_template": effective_chat_template(self.tokenizer, self.chat_template),
        }
        with CacheWriter(dest, "tokens", self._tokens_parts(split), meta) as w:
            w.save("input_ids", np.frombuffer(input_ids, dtype=f"i{input_ids.itemsize}").astype(np.int32, copy=False))
            w.save("loss_mask", np.frombuffer(bytes(loss_mask), dtype=np.bool_))
            w.save("offsets", offsets)
        return open_cache(dest, verify="size")

    # ------------------------------------------------------------------ setup: reads
    def setup(self, stage: str | None = None) -> None:
        """Open the caches built by ``prepare_data`` (memory-mapped, validated) and split train/val."""
        if self._sharded():
            from lilicorr_pl.data.sharded import prepare_data_sharded, strategy_kwargs

            prepare_data_sharded(self, **strategy_kwargs(self.trainer.strategy))
        self._check_inputs()
        datasets = {}
        for split in self._splits():
            paths = self.cache_paths(split)
            opened = {}
            for kind, path in paths.items():
                if not path.exists():
                    raise CacheError(
                        f"the {kind} cache for {split} ({path}) does not exist; call prepare_data() first "
                        "(the Trainer does this automatically)"
                    )
                opened[kind] = self._open(split, kind, path)
            self._check_alignment(opened)
            self.pad_id = int(opened["tokens"].meta.get("pad_id", 0))
            n = len(opened["tokens"]["offsets"]) - 1
            datasets[split] = (paths, n)

        train_paths, n_train = datasets["train"]
        indices = np.arange(n_train)
        val_indices = None
        if "val" not in datasets and self.val_fraction > 0:
            k = int(math.ceil(n_train * self.val_fraction)) if n_train > 1 else 0
            perm = np.random.default_rng(self.seed).permutation(n_train)
            val_indices, indices = np.sort(perm[:k]), np.sort(perm[k:])
            if k == 0:
                warnings.warn("only one training example: no validation split", stacklevel=2)
                val_indices = None
        self.train_dataset = self._dataset(train_paths, indices)
        if "val" in datasets:
            val_paths, n_val = datasets["val"]
            self.val_dataset = self._dataset(val_paths, np.arange(n_val))
        elif val_indices is not None:
            self.val_dataset = self._dataset(train_paths, val_indices)
        else:
            self.val_dataset = None

    @staticmethod
    def _dataset(paths: dict[str, Path], indices: np.ndarray) -> CachedDraftDataset:
        return CachedDraftDataset(paths["tokens"], indices, paths.get("logits"), paths.get("features"))

    def _check_alignment(self, opened: dict[str, cache_mod.Cache]) -> None:
        tokens = opened["tokens"]
        offsets = np.asarray(tokens["offsets"])
        if "logits" in opened:
            lc = opened["logits"]
            _, positions, row_offsets = cache_mod.supervised_rows(np.asarray(tokens["loss_mask"]), offsets)
            if not (np.array_equal(lc["offsets"], row_offsets) and np.array_equal(lc["positions"], positions)):
                raise CacheError(
                    f"logit cache {lc.path} rows do not line up with token cache {tokens.path}; delete "
                    f"{lc.path} and rerun prepare_data"
                )
            if lc["topm_ids"].shape[1] != self.logit_top_m:
                raise CacheError(f"logit cache {lc.path} has M={lc['topm_ids'].shape[1]}, expected {self.logit_top_m}")
        if "features" in opened and not np.array_equal(opened["features"]["offsets"], offsets):
            raise CacheError(
                f"feature cache {opened['features'].path} does not line up with token cache {tokens.path}; delete it "
                "and rerun prepare_data"
            )

    # ------------------------------------------------------------------ loaders
    def _collate(self) -> Any:
        return partial(collate_draft_batch, pad_id=self.pad_id)

    def _replicas(self) -> tuple[int, int]:
        """(data-parallel replicas, this rank) from the attached Trainer's strategy; (1, 0) without one."""
        trainer = getattr(self, "trainer", None)
        kwargs = getattr(getattr(trainer, "strategy", None), "distributed_sampler_kwargs", None) or {}
        return int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))

    def train_dataloader(self) -> ResumableDataLoader:
        if self.train_dataset is None:
            raise RuntimeError("call setup('fit') before train_dataloader()")
        replicas, rank = self._replicas()
        self._sampler = ResumableShuffleSampler(
            len(self.train_dataset), seed=self.seed, num_replicas=replicas, rank=rank
        )
        if self._pending_state is not None:
            self._apply_state(self._pending_state)
            self._pending_state = None
        return ResumableDataLoader(
            self.train_dataset,
            state_owner=self,
            batch_size=self.batch_size,
            sampler=self._sampler,
            collate_fn=self._collate(),
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
            # Its own generator: creating an iterator must not draw from the global RNG (exact resume).
            generator=torch.Generator().manual_seed(self.seed),
        )

    def predict_dataloader(self) -> DataLoader:
        """The validation split, for ``lilicorr predict`` (per-block diagnostics)."""
        if self.val_dataset is None:
            raise ValueError("lilicorr predict reads the validation split; set data.val_files or data.val_fraction > 0")
        return self.val_dataloader()

    def val_dataloader(self) -> DataLoader | list:
        if self.val_dataset is None:
            return []
        replicas, rank = self._replicas()
        if len(self.val_dataset) < replicas:
            raise ValueError(
                f"the validation set has {len(self.val_dataset)} examples, fewer than the {replicas} data-parallel "
                "processes (each evaluates its own share); add validation data, raise data.val_fraction, or set "
                "data.val_fraction: 0"
            )
        return DataLoader(
            self.val_dataset,
            batch_size=self.batch_size,
            sampler=ShardedEvalSampler(len(self.val_dataset), num_replicas=replicas, rank=rank),
            collate_fn=self._collate(),
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            generator=torch.Generator().manual_seed(self.seed),
        )

    # ------------------------------------------------------------------ exact resume
    def _consumed(self) -> int:
        """Samples of the current epoch's global order used so far (all ranks together)."""
        sampler = self._sampler
        assert sampler is not None
        trainer = getattr(self, "trainer", None)
        try:
            # Batches whose training step finished in this epoch (Lightning's own resume counter), per rank.
            batches = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # type: ignore[union-attr]
            consumed = int(batches) * self.batch_size * sampler.num_replicas
        except AttributeError:
            consumed = sampler.yielded
        return min(consumed, sampler.dataset_size)

    def state_dict(self) -> dict[str, Any]:
        """Shuffle position for exact mid-epoch resume: epoch, samples consumed, seed."""
        if self._sampler is None:
            return dict(self._pending_state or {})
        return {
            "epoch": self._sampler.epoch,
            "consumed": self._consumed(),
            "seed": self.seed,
            "num_samples": self._sampler.dataset_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self._sampler is None:
            self._pending_state = dict(state_dict)
        else:
            self._apply_state(state_dict)

    def _apply_state(self, state: dict[str, Any]) -> None:
        sampler = self._sampler
        assert sampler is not None
        if state.get("num_samples") not in (None, sampler.dataset_size) or state.get("seed", self.seed) != self.seed:
            warnings.warn(
                f"the checkpoint's data order (seed {state.get('seed')}, {state.get('num_samples')} examples) does not "
                f"match this data module (seed {self.seed}, {sampler.dataset_size}); starting the epoch from the beginning",
                stacklevel=2,
            )
            sampler.epoch = int(state.get("epoch", 0))
            return
        epoch, consumed = int(state.get("epoch", 0)), int(state.get("consumed", 0))
        if consumed >= sampler.dataset_size:
            epoch, consumed = epoch + 1, 0
        sampler.epoch, sampler.skip = epoch, consumed


# ---------------------------------------------------------------------- throughput
def precompute_throughput(datamodule: DraftDataModule, split: str = "train", repeats: int = 1) -> dict[str, float]:
    """Time the raw target forward over the data against the full logit(/feature) cache precompute.

    "Raw forward" is the plain ``FrozenTarget`` forward with full logits over the same right-padded,
    length-sorted batches, nothing stored. "Precompute" is ``precompute_target_caches`` writing the
    caches to a temporary directory (forward, top-M on the supervised rows, copies, checksums,
    manifest). Returns seconds for both and ``ratio = forward / precompute`` (goal >= 0.9).
    """
    import tempfile

    datamodule._check_inputs()
    tokens = datamodule._open(split, "tokens", datamodule.cache_paths(split)["tokens"])
    target = datamodule._load_target()
    offsets = np.asarray(tokens["offsets"])
    lengths = np.diff(offsets)
    pad_id = int(tokens.meta.get("pad_id", 0))
    batches = cache_mod._batches_by_length(lengths, datamodule.precompute_batch_size)
    device = target.device

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def raw_forward() -> None:
        with torch.no_grad():
            for idx in batches:
                ids, attn = cache_mod._pad_batch(tokens["input_ids"], offsets, idx, pad_id)
                target(ids.to(device), attention_mask=attn.to(device), return_logits=True)
        sync()

    raw_forward()  # warm-up
    forward_s, precompute_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        raw_forward()
        forward_s.append(time.perf_counter() - t0)
        with tempfile.TemporaryDirectory(dir=datamodule.cache_dir) as tmp:
            t0 = time.perf_counter()
            kwargs: dict[str, Any] = {}
            if datamodule.logit_cache:
                kwargs.update(logit_dest=Path(tmp) / "logits", logit_parts={}, top_m=datamodule.logit_top_m)
            if datamodule.feature_cache:
                kwargs.update(feature_dest=Path(tmp) / "features", feature_parts={})
            cache_mod.precompute_target_caches(
                target,
                tokens["input_ids"],
                tokens["loss_mask"],
                offsets,
                batch_size=datamodule.precompute_batch_size,
                pad_id=pad_id,
                progress=False,
                **kwargs,
            )
            sync()
            precompute_s.append(time.perf_counter() - t0)
    fwd, pre = min(forward_s), min(precompute_s)
    result = {"forward_s": fwd, "precompute_s": pre, "ratio": fwd / pre, "tokens": float(offsets[-1])}
    print(
        f"[lilicorr] precompute throughput: raw forward {fwd:.3f}s, precompute {pre:.3f}s, ratio {fwd / pre:.2f} "
        f"over {int(offsets[-1]):,} tokens",
        file=sys.stderr,
    )
    return result
