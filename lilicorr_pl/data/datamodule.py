"""``DraftDataModule``: tokenized data plus the frozen target's precomputed stores, as Lightning expects.

``prepare_data`` (one process per node) tokenizes the files into a token store and runs the frozen
target once over them to write the target-logit store (and, in offline mode, the feature store);
``setup`` (every process) only opens and validates them. Every store lives in
``cache_dir/<kind>-<fingerprint>/`` (see ``lilicorr_pl.data.store``) and is reused as long as nothing it
depends on changed; a store that fails validation is refused, never silently used or rebuilt.
``lilicorr prepare`` runs the same precompute spread over all devices (``lilicorr_pl.data.prepare``).
"""

from __future__ import annotations

import math
import warnings
from array import array
from dataclasses import asdict, is_dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader

from lilicorr_pl.data.dataset import CachedDraftDataset, collate_draft_batch, default_buckets
from lilicorr_pl.data.fingerprint import (
    fingerprint,
    fingerprint_files,
    fingerprint_target,
    fingerprint_tokenizer,
    store_path,
)
from lilicorr_pl.checkpoint import UserInputError
from lilicorr_pl.data.formats import (
    FORMAT_VERSION,
    LoadStats,
    check_data_files,
    effective_chat_template,
    iter_examples,
    resolve_chat_template,
)
from lilicorr_pl.data.precompute import PrecomputeJob, SplitJob, count_rows, run_in_process
from lilicorr_pl.data.sampling import ResumableLoader, ShardedEvalSampler, train_sampler
from lilicorr_pl.data.store import SCHEMA_VERSION, CacheError, Store, StoreWriter, Verify, open_store, provenance
from lilicorr_pl.target import FrozenTarget, TargetSpec, portable

def _as_spec(target: TargetSpec | dict[str, Any] | None) -> TargetSpec | None:
    if target is None or isinstance(target, TargetSpec):
        return target
    if isinstance(target, dict):
        return TargetSpec(**target)
    if is_dataclass(target):
        return TargetSpec(**asdict(target))
    raise TypeError(f"data.target must be a TargetSpec or a dict, got {type(target).__name__}")


def _warn_overlapping_files(train_files: list[str], val_files: list[str]) -> None:
    """Warn on a file listed twice in a split (its examples count twice) or in both (validation on training examples);
    paths are compared resolved. Not an error: either may be meant."""

    def listed(files: list[str]) -> dict[Path, list[Any]]:  # resolved path -> [its first spelling, times listed]
        seen: dict[Path, list[Any]] = {}
        for f in files:
            seen.setdefault(Path(f).expanduser().resolve(), [f, 0])[1] += 1
        return seen

    train, val = listed(train_files), listed(val_files)
    for setting, seen in (("data.train_files", train), ("data.val_files", val)):
        for f, n in seen.values():
            if n > 1:
                warnings.warn(f"{setting} lists {f} {n} times: its examples count {n} times; list it once",
                              stacklevel=3)
    for path, (f, _) in val.items():
        if path in train:
            warnings.warn(f"data.val_files {f} is also in data.train_files: validation measures training examples; "
                          "remove it from one of them", stacklevel=3)


#: How a store that fails its checks is rebuilt, in every message that asks for it.
_REBUILD = "rerun prepare_data (`lilicorr fit` or `lilicorr prepare`) to rebuild it"


_COPY_GROUPS: dict[tuple[str, str], np.ndarray] = {}  # a store's groups, by its path and fingerprint: read once


def copy_groups(tokens: Store) -> np.ndarray:
    """For each example of a token store, the index of the first example with the same token ids (its own where none
    comes before it): exact repeats of a whole example, such as a chat dataset's duplicated conversations (with
    ``data.pack``, whole packs). Vectorised: an example's key is its length and two independent position-weighted sums
    of its ids modulo 2^64 (random odd weights), so two different examples are taken for copies only where both sums
    collide."""
    cached = _COPY_GROUPS.get((str(tokens.path), tokens.fingerprint))
    if cached is not None:
        return cached
    offsets = [tokens.get(shard, "offsets").numpy().astype(np.int64) for shard in range(len(tokens.shard_examples))]
    longest = max((int(np.diff(o).max()) for o in offsets if o.size > 1), default=0)
    # Odd weights, one per position, in two independent rows: the same for every shard
    weights = np.random.default_rng(0x11C0).integers(0, 2**62, size=(2, longest), dtype=np.uint64) * np.uint64(2) + 1
    keys = np.zeros((tokens.num_examples, 3), dtype=np.uint64)
    for shard, (start, stop) in enumerate(tokens.shard_examples):
        ids = tokens.get(shard, "input_ids").numpy().astype(np.uint64) + np.uint64(1)
        lengths = np.diff(offsets[shard])
        position = np.arange(ids.size, dtype=np.int64) - np.repeat(offsets[shard][:-1], lengths)
        filled = lengths > 0  # reduceat reads an empty span as its next element: such spans keep 0
        with np.errstate(over="ignore"):  # sums modulo 2^64
            for row in range(2):
                sums = np.add.reduceat(ids * weights[row][position], offsets[shard][:-1][filled]) if ids.size else ids
                keys[start:stop, row][filled] = sums
        keys[start:stop, 2] = lengths.astype(np.uint64)
    _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    group = first[inverse.reshape(-1)].astype(np.int64)
    group.flags.writeable = False  # shared by every reader of the store in this process
    _COPY_GROUPS[(str(tokens.path), tokens.fingerprint)] = group
    return group


class DraftDataModule(L.LightningDataModule):
    """Training data for a DFlash drafter: tokenized chats/text plus the frozen target's stores.

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
        pad_to: length every batch is padded to: ``"longest"`` (its longest sequence), ``"buckets"``
            (the smallest of ``length_buckets`` that fits) or ``"max_length"``. A compiled attention
            kernel (FlexAttention on CUDA) recompiles for every new length, so fixed lengths keep it to
            a few compilations.
        length_buckets: ascending lengths for ``pad_to: buckets``, the last at least ``max_length``;
            None = four evenly spaced lengths up to ``max_length`` (multiples of 8).
        logit_cache: precompute the target-logit store (top-M logits per supervised token) read by
            the distractor penalty. None (default) = exactly when the training system reads it
            (``require_logit_cache``; standalone: yes). ``false`` while the system needs it is an error;
            ``true`` while nothing reads it is skipped with a warning naming the model setting.
        logit_top_m: M, target logits kept per supervised token.
        feature_cache: also store the target's context features (bf16) so training can run without
            the full target (offline mode). Large: about ``n·H·2`` bytes per token.
        cache_dir: root directory of the stores (``<cache_dir>/<kind>-<fingerprint>/``). None: under
            ``lilicorr`` commands ``<trainer.default_root_dir>/cache`` (the run's root), else ``cache``.
        shard_tokens: tokens per shard (the unit of work of ``lilicorr prepare`` and of an
            interrupted precompute's reuse); a shard never splits an example.
        target: the frozen target (linked from ``model.target`` by the CLI); its tokenizer is used
            for tokenization and its weights for the stores. A plain dict is accepted.
        precompute_batch_size: sequences per target forward while precomputing.
        max_examples: read at most this many records per split (quick experiments).
        cache_verify: ``"full"`` checks every shard's sha256 when opening a store, ``"size"`` only its
            size and header (faster for very large feature stores).
        precompute_device: device for the precompute in ``prepare_data``; None = CUDA when available.
        progress: show a progress bar while precomputing.
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
        pad_to: Literal["longest", "buckets", "max_length"] = "longest",
        length_buckets: list[int] | None = None,
        logit_cache: bool | None = None,
        logit_top_m: int = 64,
        feature_cache: bool = False,
        cache_dir: str | None = None,
        shard_tokens: int = 1 << 16,
        target: TargetSpec | dict[str, Any] | None = None,
        precompute_batch_size: int = 8,
        max_examples: int | None = None,
        cache_verify: Literal["full", "size"] = "full",
        precompute_device: str | None = None,
        progress: bool = True,
    ) -> None:
        super().__init__()
        # The spec is stored as a plain dict: checkpoints then load with torch.load(weights_only=True).
        self.save_hyperparameters(ignore=["target"])
        if isinstance(train_files, str):
            train_files = [train_files]
        if isinstance(val_files, str):
            val_files = [val_files]
        if num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0 (0 loads in the main process), got {num_workers}")
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
        if shard_tokens < 1:
            raise ValueError(f"data.shard_tokens must be >= 1, got {shard_tokens}")
        if pad_to not in ("longest", "buckets", "max_length"):
            raise ValueError(f"data.pad_to must be 'longest', 'buckets' or 'max_length', got {pad_to!r}")
        if length_buckets is not None:
            if pad_to != "buckets":
                raise ValueError(f"data.length_buckets is only read with data.pad_to: buckets (pad_to is {pad_to!r}); "
                                 "set pad_to: buckets or drop length_buckets")
            if list(length_buckets) != sorted(set(length_buckets)) or length_buckets[0] < 1 or length_buckets[-1] < max_length:
                raise ValueError(f"data.length_buckets must be ascending positive lengths ending at >= data.max_length "
                                 f"{max_length}, got {length_buckets}")
        # ``builtin:stdlib-train[:N]`` names are resolved to files by the `lilicorr` command (lilicorr_pl.builtin).
        self.train_files = list(train_files)
        self.val_files = list(val_files) if val_files else None
        _warn_overlapping_files(self.train_files, self.val_files or [])
        self.val_fraction = float(val_fraction)
        self.max_length = int(max_length)
        self.batch_size = int(batch_size)
        self.num_workers = int(num_workers)
        self.seed = int(seed)
        self.enable_thinking = bool(enable_thinking)
        self.chat_template = chat_template
        self.pack = bool(pack)
        self.pad_to = pad_to
        self.length_buckets = [int(n) for n in length_buckets] if length_buckets is not None else None
        self.logit_cache_setting = logit_cache  # what the user asked for; None = whatever the system reads
        self.logit_cache = True if logit_cache is None else bool(logit_cache)
        self.logit_top_m = int(logit_top_m)
        self.feature_cache = bool(feature_cache)
        self.cache_dir = str(cache_dir) if cache_dir is not None else "cache"
        self.shard_tokens = int(shard_tokens)
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
        self._train_loader: ResumableLoader | None = None
        self._pending_state: dict[str, Any] | None = None
        # Examples the validation split moved off the permutation's plain cut to keep copies on one side (setup; None
        # before it): a checkpoint whose loader state does not record them was split by the earlier rule.
        self._copies_moved: int | None = None

    # ------------------------------------------------------------------ configuration
    def require_logit_cache(self, flag: bool, reason: str = "the training system reads the target-logit store") -> None:
        """Called by the training system: build/read the target-logit store only if a loss reads it.

        ``reason`` is the clause naming the setting that decided and what it reads (for the messages,
        ``"model.target_logits: cache reads the target-logit store"``): a ``data.logit_cache`` set
        explicitly the other way is an error (off, but read) or a warning (on, but unused), never overridden
        silently.
        """
        if self.logit_cache_setting is False and flag:
            raise ValueError(
                f"data.logit_cache: false, but {reason}; remove data.logit_cache "
                "(or set it true), or change the model setting"
            )
        if self.logit_cache_setting is True and not flag:
            warnings.warn(
                f"data.logit_cache: true is ignored (no store is built): {reason}; remove data.logit_cache to "
                "silence this, or set model.target_logits: cache to train on the store",
                stacklevel=2,
            )
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
            from lilicorr_pl.target import tokenizer_of

            spec = self._spec()
            self._tokenizer = tokenizer_of(spec.name_or_path, "model.target.name_or_path", spec.trust_remote_code,
                                           load_kwargs=spec.load_kwargs)
        return self._tokenizer

    def _splits(self) -> dict[str, tuple[list[str], str]]:
        splits = {"train": (self.train_files, "data.train_files")}
        if self.val_files:
            splits["val"] = (self.val_files, "data.val_files")
        return splits

    def files_identity(self) -> dict[str, list[dict[str, Any]] | None]:
        """The content identity of ``train_files`` and ``val_files`` as they were read (:func:`fingerprint_files`,
        taken when their token stores were keyed; None: not read in this process, or no held-out files): what a
        checkpoint records of the data it trained beside, so a file edited in place under the same path is told from
        the one it trained on. Nothing is read again (a file deleted or edited since does not change it)."""
        return {key: (self._parts.get(f"{split}/tokens") or {}).get("files")
                for key, split in (("train_files", "train"), ("val_files", "val"))}

    def _check_inputs(self) -> None:
        """Cheap checks that must fail before any tokenizer or model work."""
        self._spec()
        for files, setting in self._splits().values():
            check_data_files(files, setting)
        # The template's text from here on (a file's, read once): checkpoints record the text the data was rendered
        # with, where they recorded the path, which `bench` read again later from its own folder (another file, an
        # edited one, or none).
        self.chat_template = resolve_chat_template(self.chat_template)

    def load_target(self, device: str | torch.device | None = None) -> FrozenTarget:
        """The frozen target for the precompute, shared with the training system in this process (loaded once)."""
        device = device or self.precompute_device or ("cuda" if torch.cuda.is_available() else "cpu")
        return FrozenTarget.from_spec(self._spec(), device=device, shared=True)

    # ------------------------------------------------------------------ fingerprints
    def _parts_for(self, split: str, kind: str) -> dict[str, Any]:
        key = f"{split}/{kind}"
        if key in self._parts:
            return self._parts[key]
        if kind == "tokens":
            files, setting = self._splits()[split]
            parts = {
                "kind": "tokens",
                "schema": SCHEMA_VERSION,
                "format_version": FORMAT_VERSION,
                "files": fingerprint_files(check_data_files(files, setting)),
                "tokenizer": fingerprint_tokenizer(self.tokenizer, effective_chat_template(self.tokenizer, self.chat_template)),
                "enable_thinking": self.enable_thinking,
                "max_length": self.max_length,
                "pack": self.pack,
                "max_examples": self.max_examples,
                "shard_tokens": self.shard_tokens,
            }
        else:
            target_key = f"target/{kind}"
            if target_key not in self._parts:  # each weight file read whole once per file version (a memo), then not
                # The logits do not depend on which layers feed the drafter; the features do. A hub name by the commit
                # it resolves to: the key is taken before the target loads, when its weights may not be downloaded yet.
                # A built-in target's build by its key-bearing name: the same run on a node whose cache folder is
                # another finds its stores (its weights are hashed all the same).
                spec = self._spec()
                self._parts[target_key] = fingerprint_target(spec, include_layers=kind == "features", hub="commit",
                                                             name=portable(spec.name_or_path))
            parts = {"kind": kind, "schema": SCHEMA_VERSION, "tokens": fingerprint(self._parts_for(split, "tokens")),
                     "target": self._parts[target_key]}
            if kind == "logits":
                parts["top_m"] = self.logit_top_m
        self._parts[key] = parts
        return parts

    def cache_paths(self, split: str = "train") -> dict[str, Path]:
        """Where this configuration's stores for ``split`` live (whether or not they exist yet)."""
        kinds = ["tokens"] + ["logits"] * self.logit_cache + ["features"] * self.feature_cache
        return {kind: store_path(self.cache_dir, kind, self._parts_for(split, kind)) for kind in kinds}

    def _open(self, split: str, kind: str, path: Path, verify: Verify | None = None) -> Store:
        expected = fingerprint(self._parts_for(split, kind))
        return open_store(path, expected_fingerprint=expected, kind=kind, verify=verify or self.cache_verify)

    # ------------------------------------------------------------------ prepare_data: writes
    def prepare_data(self) -> None:
        """Tokenize the data and run the target for the stores that are missing (reusing valid ones)."""
        self.prepare_tokens()
        trainer = getattr(self, "trainer", None)
        # Told now, from the token store, not after the target's pass over the data (hours on a real target); on one
        # process only: this runs on local rank 0 alone, and the others would wait for it at the barrier (setup tells
        # every rank, later).
        if (trainer is not None and trainer.state.fn == "fit" and trainer.world_size == 1
                and "val" not in self._splits() and self.val_fraction > 0):
            tokens = self._open("train", "tokens", self.cache_paths("train")["tokens"], verify="size")  # setup: sha256
            _, left, _, _ = self._validation_split(tokens)
            self._refuse_an_empty_training_split(tokens.num_examples, len(left))
        job = self.precompute_job()
        if job is not None:
            run_in_process(job, self.load_target(), progress=self.progress, written_by="prepare_data")

    def prepare_tokens(self) -> None:
        """Write the missing token stores; refuse any existing store that fails validation."""
        self._check_inputs()
        for split in self._splits():
            for kind, path in self.cache_paths(split).items():
                if path.exists():
                    self._open(split, kind, path)  # refuse a corrupt store loudly
                elif kind == "tokens":
                    self._write_tokens(split, path)

    def precompute_job(self, only_missing: bool = True) -> PrecomputeJob | None:
        """The target stores still missing (after ``prepare_tokens``), as one job; None when all exist.
        ``only_missing=False``: all configured target stores (to measure the precompute, never to write)."""
        splits = []
        for split in self._splits():
            paths = self.cache_paths(split)
            missing = {kind: path for kind, path in paths.items()
                       if kind != "tokens" and not (only_missing and path.exists())}
            if not missing:
                continue
            tokens = self._open(split, "tokens", paths["tokens"])
            meta: dict[str, dict[str, Any]] = {}
            spec = self._spec()
            if "logits" in missing:
                meta["logits"] = {"split": split, "target": spec.name_or_path, "top_m": self.logit_top_m,
                                  "rows": count_rows(tokens), "examples": tokens.num_examples}
            if "features" in missing:
                meta["features"] = {"split": split, "target": spec.name_or_path, "layer_ids": spec.layer_ids,
                                    "num_features": spec.num_features, "tokens": tokens.meta["tokens"]}
            writers = {kind: StoreWriter(path, kind, self._parts_for(split, kind)) for kind, path in missing.items()}
            splits.append(SplitJob(split, tokens, writers, meta))
        return PrecomputeJob(splits, self.logit_top_m, self.precompute_batch_size) if splits else None

    def _write_tokens(self, split: str, dest: Path) -> None:
        files, setting = self._splits()[split]
        stats = LoadStats()
        writer = StoreWriter(dest, "tokens", self._parts_for(split, "tokens"))
        ids, mask, lengths = array("i"), bytearray(), array("q")  # the current shard, compact
        shards, first = 0, 0

        def flush() -> None:
            nonlocal shards, first
            offsets = np.concatenate([[0], np.cumsum(np.frombuffer(lengths, dtype=np.int64))]).astype(np.int64)
            writer.write(shards, (first, first + len(lengths)), {
                "input_ids": torch.from_numpy(np.frombuffer(ids, dtype=f"i{ids.itemsize}").astype(np.int32)),
                "loss_mask": torch.from_numpy(np.frombuffer(bytes(mask), dtype=np.bool_).copy()),
                "offsets": torch.from_numpy(offsets),
            })
            shards, first = shards + 1, first + len(lengths)
            del ids[:], mask[:], lengths[:]

        for ex in iter_examples(files, self.tokenizer, max_length=self.max_length, enable_thinking=self.enable_thinking,
                                chat_template=self.chat_template, pack=self.pack, max_examples=self.max_examples,
                                setting=setting, stats=stats):
            if lengths and len(ids) + len(ex) > self.shard_tokens:
                flush()
            ids.extend(ex.input_ids)
            mask.extend(bytes(ex.loss_mask))
            lengths.append(len(ex))
        if lengths:
            flush()
        self.load_stats[split] = stats
        if stats.dropped_unsupervised:
            warnings.warn(
                f"{split}: dropped {stats.dropped_unsupervised} of {stats.records} records with no supervised "
                f"token within max_length={self.max_length}",
                stacklevel=2,
            )
        if stats.no_block and not self.pack:
            warnings.warn(f"{split}: {stats.no_block} of {stats.records} records hold one supervised token after the "
                          "first, too few for a draft block (an anchor and a token after it): they train nothing",
                          stacklevel=2)
        pad_id = self.tokenizer.pad_token_id
        if pad_id is None:
            pad_id = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        meta = {
            "split": split, "examples": stats.examples, "tokens": stats.tokens, "supervised_tokens": stats.supervised_tokens,
            "records": stats.records, "truncated": stats.truncated, "dropped_unsupervised": stats.dropped_unsupervised,
            "formats": stats.formats, "pad_id": int(pad_id), "enable_thinking": self.enable_thinking,
            "chat_template": effective_chat_template(self.tokenizer, self.chat_template),
        }
        writer.finalize(shards, meta, provenance(written_by="tokenize", processes=1))

    # ------------------------------------------------------------------ setup: reads
    def setup(self, stage: str | None = None) -> None:
        """Open the stores built by ``prepare_data`` (validated, memory-mapped) and split train/val."""
        self._check_inputs()
        if stage in ("fit", None):  # a fit's training loader is its own: no epoch numbering carried from another fit
            self._train_loader = None
        datasets = {}
        for split in self._splits():
            paths = self.cache_paths(split)
            opened = {}
            for kind, path in paths.items():
                if not path.exists():
                    raise CacheError(
                        f"the {kind} cache for {split} ({path}) does not exist; call prepare_data() first "
                        "(the Trainer does this automatically) or run `lilicorr prepare`"
                    )
                opened[kind] = self._open(split, kind, path)
            self._check_alignment(opened)
            self.pad_id = int(opened["tokens"].meta.get("pad_id", 0))
            datasets[split] = (paths, opened["tokens"].num_examples)
            if split == "train":
                train_tokens = opened["tokens"]

        train_paths, n_train = datasets["train"]
        indices = np.arange(n_train)
        val_indices = None
        self._copies_moved = 0
        if "val" not in datasets and self.val_fraction > 0:
            val_indices, indices, copies, self._copies_moved = self._validation_split(train_tokens)
            if copies and len(val_indices):
                rank_zero_warn(copies)
            if len(val_indices) == 0:
                rank_zero_warn("only one training example: no validation split" if n_train == 1 else
                               f"data: no validation split: each of the {self._validation_count(n_train)} examples "
                               "val_fraction draws is a copy of an earlier example, which trains (exact repeats are "
                               "kept on one side); drop the repeats, raise val_fraction, or give data.val_files")
                val_indices = None
        if stage in (None, "fit"):
            self._refuse_an_empty_training_split(n_train, len(indices))
        self.train_dataset = self._dataset(train_paths, indices)
        if "val" in datasets:
            val_paths, n_val = datasets["val"]
            self.val_dataset = self._dataset(val_paths, np.arange(n_val))
        elif val_indices is not None:
            self.val_dataset = self._dataset(train_paths, val_indices)
        else:
            self.val_dataset = None

    def _validation_count(self, n_train: int) -> int:
        """How many of ``n_train`` training examples ``val_fraction`` sets aside (none of a single one)."""
        return int(math.ceil(n_train * self.val_fraction)) if n_train > 1 else 0

    def _validation_split(self, tokens: Store) -> tuple[np.ndarray, np.ndarray, str, int]:
        """``val_fraction`` of the training examples set aside (sorted validation and training indices), a warning
        where some examples repeat another's tokens ("" where none does), and how many examples that moved off the
        permutation's plain cut.

        A seeded permutation of the examples, its first ``ceil(n * val_fraction)`` for validation, with each set of
        exact copies (:func:`copy_groups`) on the side of its first example in the data: a copy on each side would
        have ``val/*`` score examples the drafter trained on. Every set goes to validation with the same chance, however
        many copies it holds. Where no example repeats another, this is the permutation's plain cut; a smaller
        ``val_fraction`` keeps a part of the same split."""
        n = tokens.num_examples
        k = self._validation_count(n)
        perm = np.random.default_rng(self.seed).permutation(n)
        place = np.empty(n, dtype=np.int64)
        place[perm] = np.arange(n)
        group = copy_groups(tokens)
        in_val = place[group] < k
        repeats = int((group != np.arange(n)).sum())
        message, crossed = "", int((in_val != (place < k)).sum())
        if repeats:
            message = (f"data: {repeats} of the {n} training examples repeat another's tokens exactly; each set of "
                       f"copies is kept on one side of the validation split ({crossed} moved from the plain cut; "
                       f"validation holds {int(in_val.sum())} examples where the cut held {k}), so no example "
                       "validates beside a copy of itself that trains; drop the repeats to train on each once")
        return np.flatnonzero(in_val), np.flatnonzero(~in_val), message, crossed

    def _refuse_an_empty_training_split(self, n_train: int, left: int) -> None:
        """A validation share that leaves none (``left``) of ``n_train`` training examples: Lightning would stop at once
        and exit 0 with no checkpoint. Where the share's own cut leaves some, the copies kept with the validation
        examples took them."""
        if left == 0:
            if n_train - self._validation_count(n_train) > 0:
                raise UserInputError(f"data: every one of the {n_train} training examples is a copy of one the "
                                     "validation split holds (copies are kept on one side); drop the repeats from the "
                                     "data, or give data.val_files")
            raise UserInputError(f"data.val_fraction {self.val_fraction} leaves none of the {n_train} training examples "
                                 "to train on; lower it, or give data.val_files")

    @staticmethod
    def _dataset(paths: dict[str, Path], indices: np.ndarray) -> CachedDraftDataset:
        return CachedDraftDataset(paths["tokens"], indices, paths.get("logits"), paths.get("features"))

    def _check_alignment(self, opened: dict[str, Store]) -> None:
        tokens = opened["tokens"]
        for kind in ("logits", "features"):
            if kind in opened and opened[kind].shard_examples != tokens.shard_examples:
                raise CacheError(f"{kind} cache {opened[kind].path} is not sharded like token cache {tokens.path}; "
                                 f"delete {opened[kind].path} and {_REBUILD}")
        if "logits" in opened:
            m = opened["logits"].shape(0, "topm_ids")[1]
            if m != self.logit_top_m:
                raise CacheError(f"logit cache {opened['logits'].path} holds M={m} where its manifest says "
                                 f"M={self.logit_top_m}; delete it and {_REBUILD}")
        if "features" in opened:
            for s in range(len(tokens.shard_examples)):
                if opened["features"].shape(s, "features")[0] != tokens.shape(s, "input_ids")[0]:
                    raise CacheError(f"feature cache {opened['features'].path} shard {s} does not line up with token "
                                     f"cache {tokens.path}; delete it and {_REBUILD}")

    # ------------------------------------------------------------------ loaders
    def buckets(self) -> list[int] | None:
        """The lengths batches are padded to (None: each batch to its longest sequence)."""
        if self.pad_to == "max_length":
            return [self.max_length]
        if self.pad_to == "buckets":
            return self.length_buckets or default_buckets(self.max_length)
        return None

    def _collate(self) -> Any:
        return partial(collate_draft_batch, pad_id=self.pad_id, buckets=self.buckets())

    def _replicas(self) -> tuple[int, int]:
        """(data-parallel replicas, this rank) from the attached Trainer's strategy; (1, 0) without one."""
        trainer = getattr(self, "trainer", None)
        kwargs = getattr(getattr(trainer, "strategy", None), "distributed_sampler_kwargs", None) or {}
        return int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))

    @property
    def data_epoch(self) -> int | None:
        """The epoch of the training data being read (the loader's sampler's, as its state records it), None before a
        training loader exists."""
        return int(self._train_loader.sampler.epoch) if self._train_loader is not None else None

    @property
    def resumed_mid_epoch(self) -> int | None:
        """The epoch the training loader went on with from a checkpoint's position inside it (None: it starts its
        epoch at the first batch)."""
        return self._train_loader.resumed_at_epoch if self._train_loader is not None else None

    def train_dataloader(self) -> ResumableLoader:
        if self.train_dataset is None:
            raise RuntimeError("call setup('fit') before train_dataloader()")
        replicas, rank = self._replicas()
        n = len(self.train_dataset)
        previous = self._train_loader
        order = {"seed": self.seed, "examples": n, "replicas": replicas, "batch_size": self.batch_size}
        if self._copies_moved:  # recorded only where the rule moved any: other checkpoints resume as they did
            order["copies_kept_together"] = self._copies_moved
        self._train_loader = ResumableLoader(
            self.train_dataset,
            order=order,
            batch_size=self.batch_size,
            sampler=train_sampler(n, self.seed, replicas, rank),
            collate_fn=self._collate(),
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
            # Its own generator: creating an iterator must not draw from the global RNG (exact resume).
            generator=torch.Generator().manual_seed(self.seed),
        )
        self._train_loader.epoch_finished = self._epoch_finished
        if previous is not None:  # a reload in this fit (reload_dataloaders_every_n_epochs): the numbering goes on
            self._train_loader.sampler.offset = getattr(previous.sampler, "offset", 0)
        if self._pending_state is not None:
            if not self._split_by_the_earlier_rule(self._pending_state):
                self._train_loader.load_state_dict(self._pending_state)
            self._pending_state = None
        return self._train_loader

    def _epoch_finished(self) -> bool | None:
        """Whether the attached Trainer's running epoch has had its last batch (Lightning's own test: its batch count
        reached, ``limit_train_batches`` included, or the loader exhausted); None without one."""
        trainer = getattr(self, "trainer", None)
        progress = getattr(getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None), "batch_progress", None)
        if progress is None:
            return None
        return bool(progress.is_last_batch or progress.current.ready >= trainer.num_training_batches)

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
                "processes (each evaluates its own share); add validation data ("
                + ("data.val_files" if self.val_files else "data.val_files, or a larger data.val_fraction")
                + ") or use fewer devices"
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
    def state_dict(self) -> dict[str, Any]:
        """The training loader's position (``ResumableLoader``), saved in every checkpoint.

        Lightning also saves a stateful loader's state with its loops, but drops it on resume when
        ``configure_optimizers`` reads ``trainer.estimated_stepping_batches`` (as the schedulers here
        do; Lightning issue #20550); the data module's own state is always restored.
        """
        if self._train_loader is None:
            return dict(self._pending_state or {})
        return self._train_loader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self._train_loader is None:
            self._pending_state = dict(state_dict)
        elif not self._split_by_the_earlier_rule(state_dict):
            self._train_loader.load_state_dict(state_dict)

    def _split_by_the_earlier_rule(self, state_dict: dict[str, Any]) -> bool:
        """Whether a checkpoint's loader state is of a run whose validation split left copies on both sides (before
        copies were kept together, which moved examples here): said once, and its position is not taken (the epoch
        starts from its first batch, as for another data order)."""
        order = state_dict.get("order")
        if not self._copies_moved or not isinstance(order, dict) or "copies_kept_together" in order:
            return False
        rank_zero_warn(f"the checkpoint's run split its validation examples off the training files before copies were "
                       f"kept on one side: this run's split moves {self._copies_moved} examples, so val/* from here "
                       "on reads another split than the steps before, still holding examples the checkpoint trained on "
                       "(copies of them; a val/* of none needs a fresh fit), and this epoch starts from its first "
                       "batch")
        return True
