"""Fingerprinted, atomic, validated on-disk caches, and the two target caches built on them.

A cache is a directory ``<root>/<kind>-<fingerprint[:16]>/`` holding ``.npy`` arrays (memory-mappable
with ``np.load(mmap_mode="r")``) and a ``manifest.json``. The fingerprint is the sha256 of a canonical
JSON of everything the content depends on (target identity, tokenizer, data file hashes, settings,
schema version), so a changed input lands in a new directory instead of being confused with an old
one.

Writing (``CacheWriter``) happens in a hidden temporary directory beside the destination; the manifest
(schema, fingerprint parts, shapes, dtypes, sizes, per-file sha256, creation time) is written last and
the directory is renamed into place with one atomic ``os.replace``. An exception (or a kill) during
the write therefore never leaves a half-written cache under the real name. Reading (``open_cache``)
checks the manifest against the files (presence, ``.npy`` headers, sizes and, by default, sha256) and
raises ``CacheError`` on any mismatch: a cache is never used silently.

**Target-logit cache** (``kind="logits"``): for every example and every supervised position ``t >= 1``
(``loss_mask[t]``), the target's teacher-forced distribution predicting token ``t`` from ``x_<t`` (the
target logits at position ``t - 1``), compressed to the top-M ids (int32) and values (fp16, sorted
descending), the exact logit of the true token ``x_t`` (fp32), and the position ``t`` (int32). The M-th
value is the floor for tokens not listed (a true upper bound: an unlisted token's logit is at most
that). Rows are flat, in example order then ascending position, with per-example ``offsets``.
Bytes per supervised token: ``6·M + 8`` (392 B at M = 64) versus ``2·V`` for full fp16 logits
(303,872 B for Qwen3's V = 151,936): about 775× smaller.

**Context-feature cache** (``kind="features"``): the concatenated target features ``[T, n·H]`` of every
token of every example, stored as the raw bits of bfloat16 in an ``int16`` array (numpy has no
bfloat16; ``torch.from_numpy(a).view(torch.bfloat16)`` recovers the values exactly, see
``features_from_numpy``). The size (``T_total × n·H × 2`` bytes) is printed before writing.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import shutil
import socket
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
Verify = Literal["full", "size"]


class CacheError(RuntimeError):
    """A cache directory that does not match its manifest (or its expected fingerprint)."""


# ---------------------------------------------------------------------- fingerprints
def _json_default(obj: Any) -> Any:
    if is_dataclass(obj):
        return asdict(obj)
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if isinstance(obj, torch.dtype):
        return str(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"cannot fingerprint a {type(obj).__name__}: {obj!r}")


def canonical_json(obj: Any) -> str:
    """Key-sorted, whitespace-free JSON: the same parts always give the same string."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=_json_default)


def fingerprint(parts: Mapping[str, Any]) -> str:
    """Stable sha256 (hex) of a canonical JSON of ``parts``."""
    return hashlib.sha256(canonical_json(dict(parts)).encode("utf-8")).hexdigest()


def text_sha256(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode("utf-8")).hexdigest()


def file_sha256(path: str | os.PathLike, chunk_size: int = 1 << 22) -> str:
    """sha256 of a file's content, streamed."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(chunk_size), b""):
            h.update(chunk)
    return h.hexdigest()


def sampled_sha256(path: str | os.PathLike, window: int = 1 << 20) -> str:
    """sha256 of a file's size and three 1 MiB windows (start, middle, end).

    Cheap even for 16 GB of weights, and any retrained or re-initialised checkpoint differs in those
    bytes, so a changed target is not mistaken for the old one even when names and sizes match.
    """
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for start in sorted({0, max(0, size // 2 - window // 2), max(0, size - window)}):
            f.seek(start)
            h.update(f.read(window))
    return h.hexdigest()


def fingerprint_files(paths: Sequence[str | os.PathLike]) -> list[dict[str, Any]]:
    """Content identity of data files (name, size, sha256), in the given order; paths do not matter."""
    return [
        {"name": Path(p).name, "bytes": Path(p).stat().st_size, "sha256": file_sha256(p)} for p in paths
    ]


def fingerprint_tokenizer(tokenizer: Any, chat_template: str | None = None) -> dict[str, Any]:
    """Tokenizer identity: its full serialised vocabulary/merges/normaliser, special tokens, chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        vocab_text = backend.to_str()
    else:  # slow tokenizers: the vocabulary mapping is what defines the ids
        vocab_text = canonical_json(sorted(tokenizer.get_vocab().items()))
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = canonical_json(template)
    return {
        "class": type(tokenizer).__name__,
        "len": len(tokenizer),
        "vocab_sha256": text_sha256(vocab_text),
        "special_tokens": {k: str(v) for k, v in sorted(getattr(tokenizer, "special_tokens_map", {}).items())},
        "added_tokens": sorted(str(t) for t in getattr(tokenizer, "get_added_vocab", dict)()),
        "chat_template_sha256": text_sha256(template),
    }


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


def _local_model_dir(name_or_path: str, revision: str | None = None) -> Path | None:
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    try:  # a hub name already in the local Hugging Face cache
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name_or_path, "config.json", revision=revision)
        if isinstance(found, str):
            return Path(found).parent
    except Exception:  # noqa: BLE001 - best effort only; the name still identifies the target
        pass
    return None


def fingerprint_target(spec: Any, include_layers: bool = True) -> dict[str, Any]:
    """Target identity from a ``TargetSpec`` (or dict): config.json content, weight file names, sizes and
    sampled content hashes (``sampled_sha256``), the name or path, dtype and (if ``include_layers``) the
    feature layer ids.

    The logit cache does not depend on which layers feed the drafter, so it passes
    ``include_layers=False`` and survives a change of ``layer_ids``.
    """
    if isinstance(spec, Mapping):
        spec_d = dict(spec)
    elif is_dataclass(spec):
        spec_d = asdict(spec)
    else:
        raise TypeError(f"expected a TargetSpec or dict, got {type(spec).__name__}")
    name = str(spec_d["name_or_path"])
    revision = (spec_d.get("load_kwargs") or {}).get("revision")
    parts: dict[str, Any] = {"name_or_path": name, "dtype": str(spec_d.get("dtype", "float32"))}
    if revision is not None:
        parts["revision"] = revision
    local = _local_model_dir(name, revision)
    if local is not None:
        cfg = local / "config.json"
        parts["config"] = json.loads(cfg.read_text()) if cfg.is_file() else None
        parts["weights"] = sorted(
            (p.name, p.stat().st_size, sampled_sha256(p))
            for p in local.iterdir()
            if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)
        )
    if include_layers:
        parts["layer_ids"] = spec_d.get("layer_ids")
        if spec_d.get("layer_ids") is None:
            parts["num_features"] = spec_d.get("num_features")
    return parts


def cache_path(root: str | os.PathLike, kind: str, parts: Mapping[str, Any]) -> Path:
    """``<root>/<kind>-<first 16 hex of the fingerprint>``."""
    return Path(root) / f"{kind}-{fingerprint(parts)[:16]}"


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


def features_to_numpy(features: torch.Tensor) -> np.ndarray:
    """bf16 bit pattern as int16 (numpy has no bfloat16): exact, 2 bytes per value."""
    return features.detach().to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy()


def features_from_numpy(array: np.ndarray) -> torch.Tensor:
    """Inverse of ``features_to_numpy``: a bfloat16 tensor (copies out of a memmap)."""
    return torch.from_numpy(np.array(array, dtype=np.int16, copy=True)).view(torch.bfloat16)


# ---------------------------------------------------------------------- writing
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _temp_prefix(dest: Path) -> str:
    return f".{dest.name}.tmp-"


def clean_stale_temps(dest: Path) -> list[Path]:
    """Remove temp dirs of ``dest`` left by killed writers of this host (their pid is gone)."""
    removed = []
    if not dest.parent.is_dir():
        return removed
    host = socket.gethostname().replace("-", "_")
    for p in dest.parent.glob(_temp_prefix(dest) + "*"):
        try:
            t_host, t_pid, _ = p.name[len(_temp_prefix(dest)) :].split("-")
            if t_host == host and not _pid_alive(int(t_pid)):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
        except ValueError:
            continue
    return removed


class CacheWriter:
    """Write a cache atomically: arrays into a temp dir beside ``dest``, manifest last, then rename.

    Use as a context manager; leaving the block normally commits, an exception removes the temp dir::

        with CacheWriter(dest, "logits", parts) as w:
            ids = w.create("topm_ids", (rows, m), np.int32)   # writable np.memmap
            ids[:10] = ...
            w.save("offsets", offsets)                         # a whole array at once
        cache = open_cache(dest)
    """

    def __init__(
        self, dest: str | os.PathLike, kind: str, parts: Mapping[str, Any], meta: Mapping[str, Any] | None = None
    ) -> None:
        self.dest = Path(dest)
        self.kind = kind
        self.parts = dict(parts)
        self.meta = dict(meta or {})
        self.tmp: Path | None = None
        self._arrays: dict[str, np.ndarray] = {}
        self.committed = False

    def __enter__(self) -> CacheWriter:
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        clean_stale_temps(self.dest)
        host = socket.gethostname().replace("-", "_")
        self.tmp = self.dest.parent / f"{_temp_prefix(self.dest)}{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def create(self, name: str, shape: Sequence[int], dtype: Any) -> np.ndarray:
        """A writable ``.npy`` memmap of the given shape and dtype (zero-filled)."""
        assert self.tmp is not None, "use CacheWriter as a context manager"
        arr = np.lib.format.open_memmap(self.tmp / f"{name}.npy", mode="w+", dtype=dtype, shape=tuple(shape))
        self._arrays[name] = arr
        return arr

    def save(self, name: str, array: np.ndarray) -> None:
        """Write a whole in-memory array."""
        assert self.tmp is not None, "use CacheWriter as a context manager"
        np.save(self.tmp / f"{name}.npy", np.ascontiguousarray(array))
        self._arrays[name] = np.asarray(array)

    def abort(self) -> None:
        self._arrays.clear()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def commit(self) -> Path:
        assert self.tmp is not None
        files = {}
        for name, arr in self._arrays.items():
            if isinstance(arr, np.memmap):
                arr.flush()
            shape, dtype = list(arr.shape), np.dtype(arr.dtype).str
            files[name] = {"file": f"{name}.npy", "shape": shape, "dtype": dtype}
        self._arrays.clear()  # drop memmaps before hashing/renaming
        for entry in files.values():
            path = self.tmp / entry["file"]
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
            entry["bytes"] = path.stat().st_size
            entry["sha256"] = file_sha256(path)
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "kind": self.kind,
            "fingerprint": fingerprint(self.parts),
            "parts": self.parts,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "files": files,
            "meta": self.meta,
        }
        manifest_path = self.tmp / MANIFEST_NAME
        manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True, default=_json_default) + "\n")
        with open(manifest_path, "rb+") as f:
            os.fsync(f.fileno())
        try:
            os.replace(self.tmp, self.dest)
        except OSError:
            # Someone else finished the same cache first: keep theirs if it is valid.
            shutil.rmtree(self.tmp, ignore_errors=True)
            open_cache(self.dest, expected_fingerprint=manifest["fingerprint"], verify="size")
        self.committed = True
        return self.dest


# ---------------------------------------------------------------------- reading
class Cache:
    """An opened, validated cache: ``cache["name"]`` is a read-only memmap."""

    def __init__(self, path: Path, manifest: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        self.path = path
        self.manifest = manifest
        self.arrays = arrays

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest.get("meta", {})

    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]

    def __contains__(self, name: str) -> bool:
        return name in self.arrays

    def nbytes(self) -> int:
        return sum(int(f["bytes"]) for f in self.manifest["files"].values())

    def __repr__(self) -> str:
        return f"Cache({self.manifest['kind']!r}, {self.path}, {human_bytes(self.nbytes())})"


def _fail(path: Path, problem: str) -> CacheError:
    return CacheError(
        f"cache {path} is invalid: {problem}. It will not be used; delete the directory ({path}) and rerun "
        "prepare_data (e.g. `lilicorr fit ...` again) to rebuild it"
    )


def open_cache(
    path: str | os.PathLike,
    expected_fingerprint: str | None = None,
    kind: str | None = None,
    verify: Verify = "full",
) -> Cache:
    """Open a cache directory after validating it against its manifest.

    Args:
        path: the cache directory.
        expected_fingerprint: if given, the manifest's fingerprint must equal it.
        kind: if given, the manifest's kind must equal it.
        verify: ``"full"`` checks every file's sha256 (reads everything once); ``"size"`` checks
            presence, ``.npy`` headers (shape, dtype) and byte sizes only.
    """
    path = Path(path)
    if not path.is_dir():
        raise CacheError(f"cache directory {path} does not exist; run prepare_data first to build it")
    if verify not in ("full", "size"):
        raise ValueError(f"verify must be 'full' or 'size', got {verify!r}")
    mpath = path / MANIFEST_NAME
    if not mpath.is_file():
        raise _fail(path, f"{MANIFEST_NAME} is missing (an interrupted or foreign write)")
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise _fail(path, f"{MANIFEST_NAME} is not valid JSON ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("schema_version") != SCHEMA_VERSION:
        seen = manifest.get("schema_version") if isinstance(manifest, dict) else None
        raise _fail(path, f"manifest schema_version is {seen!r}, this version of lilicorr_pl reads {SCHEMA_VERSION}")
    for key in ("kind", "fingerprint", "parts", "files"):
        if key not in manifest:
            raise _fail(path, f"manifest has no {key!r}")
    if fingerprint(manifest["parts"]) != manifest["fingerprint"]:
        raise _fail(path, "manifest fingerprint does not match its own fingerprint parts (the manifest was edited)")
    if expected_fingerprint is not None and manifest["fingerprint"] != expected_fingerprint:
        raise _fail(
            path,
            f"fingerprint {manifest['fingerprint'][:16]}… differs from the expected {expected_fingerprint[:16]}… "
            "(it was built from different inputs)",
        )
    if kind is not None and manifest["kind"] != kind:
        raise _fail(path, f"kind is {manifest['kind']!r}, expected {kind!r}")
    arrays: dict[str, np.ndarray] = {}
    for name, entry in manifest["files"].items():
        fpath = path / entry.get("file", f"{name}.npy")
        if not fpath.is_file():
            raise _fail(path, f"file {fpath.name} listed in the manifest is missing")
        size = fpath.stat().st_size
        if size != entry.get("bytes"):
            raise _fail(path, f"file {fpath.name} has {size} bytes, the manifest says {entry.get('bytes')} (truncated?)")
        try:
            arr = np.load(fpath, mmap_mode="r", allow_pickle=False)
        except Exception as err:  # noqa: BLE001 - any unreadable header is a corrupt cache
            raise _fail(path, f"file {fpath.name} is not a readable .npy ({err})") from None
        if list(arr.shape) != list(entry.get("shape", [])) or arr.dtype.str != entry.get("dtype"):
            raise _fail(
                path,
                f"file {fpath.name} holds shape {list(arr.shape)} {arr.dtype.str}, the manifest says "
                f"{entry.get('shape')} {entry.get('dtype')}",
            )
        if verify == "full":
            digest = file_sha256(fpath)
            if digest != entry.get("sha256"):
                raise _fail(path, f"file {fpath.name} sha256 {digest[:12]}… does not match the manifest checksum")
        arrays[name] = arr
    return Cache(path, manifest, arrays)


# ---------------------------------------------------------------------- target logits
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


def supervised_rows(loss_mask: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of the logit cache: flat token indices and local positions ``t >= 1`` with ``loss_mask[t]``.

    Returns ``(flat_index [R], position [R] int32, row_offsets [n+1] int64)`` in example order.
    """
    lengths = np.diff(offsets)
    starts = np.repeat(offsets[:-1], lengths)
    local = np.arange(int(offsets[-1]), dtype=np.int64) - starts
    sel = np.asarray(loss_mask, dtype=bool) & (local >= 1)
    flat = np.nonzero(sel)[0]
    example_of = np.repeat(np.arange(len(lengths)), lengths)[flat]
    counts = np.bincount(example_of, minlength=len(lengths))
    row_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return flat, local[flat].astype(np.int32), row_offsets


def _batches_by_length(lengths: np.ndarray, batch_size: int) -> list[np.ndarray]:
    # Longest first: the first batch hits peak memory immediately (fail fast), padding stays small.
    order = np.argsort(-lengths, kind="stable")
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def _pad_batch(input_ids: np.ndarray, offsets: np.ndarray, idx: np.ndarray, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = [int(offsets[i + 1] - offsets[i]) for i in idx]
    t = max(lengths)
    ids = torch.full((len(idx), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(idx), t), dtype=torch.long)
    for r, (i, n) in enumerate(zip(idx, lengths)):
        ids[r, :n] = torch.from_numpy(np.asarray(input_ids[offsets[i] : offsets[i] + n], dtype=np.int64))
        mask[r, :n] = 1
    return ids, mask


def precompute_target_caches(
    target: Any,
    input_ids: np.ndarray,  # [T_total] flat
    loss_mask: np.ndarray,  # [T_total] flat bool
    offsets: np.ndarray,  # [n+1]
    *,
    logit_dest: str | os.PathLike | None = None,
    logit_parts: Mapping[str, Any] | None = None,
    top_m: int = 64,
    feature_dest: str | os.PathLike | None = None,
    feature_parts: Mapping[str, Any] | None = None,
    batch_size: int = 8,
    pad_id: int = 0,
    progress: bool = True,
    head_chunk: int = 1024,
    meta: Mapping[str, Any] | None = None,
) -> dict[str, Path]:
    """Run the frozen target once over all examples and write the logit and/or feature cache.

    Batches are right-padded, longest first, under ``torch.no_grad``. The LM head runs only on the
    positions that are needed (``t - 1`` for supervised ``t``), ``head_chunk`` rows at a time, so a
    151k-word vocabulary never materialises ``[b, T, V]``. Returns the committed cache paths by kind.
    """
    from tqdm.auto import tqdm

    if logit_dest is None and feature_dest is None:
        return {}
    offsets = np.asarray(offsets, dtype=np.int64)
    n = len(offsets) - 1
    lengths = np.diff(offsets)
    total = int(offsets[-1])
    flat, positions, row_offsets = supervised_rows(loss_mask, offsets)
    rows = len(flat)
    vocab = int(target.output_rows)
    if logit_dest is not None and not 1 <= top_m <= vocab:
        raise ValueError(f"logit_top_m must be in 1..{vocab} (target output rows), got {top_m}; fix data.logit_top_m")
    feat_dim = target.hidden_size * target.num_features
    meta = dict(meta or {})
    device = target.device

    with contextlib.ExitStack() as stack:
        out: dict[str, Path] = {}
        lw = fw = None
        if logit_dest is not None:
            est = rows * logit_cache_bytes_per_token(top_m)
            print(
                f"[lilicorr] writing target-logit cache: {rows:,} supervised tokens × "
                f"{logit_cache_bytes_per_token(top_m)} B ≈ {human_bytes(est)} -> {logit_dest}\n"
                f"[lilicorr] {logit_cache_report(vocab, top_m)}",
                file=sys.stderr,
            )
            lw = stack.enter_context(
                CacheWriter(logit_dest, "logits", logit_parts or {}, {**meta, "top_m": top_m, "vocab_rows": vocab, "rows": rows, "examples": n})
            )
            lw.save("offsets", row_offsets)
            lw.save("positions", positions)
            w_ids = lw.create("topm_ids", (rows, top_m), np.int32)
            w_vals = lw.create("topm_logits", (rows, top_m), np.float16)
            w_true = lw.create("true_logit", (rows,), np.float32)
        if feature_dest is not None:
            est = feature_cache_bytes(total, feat_dim)
            print(
                f"[lilicorr] writing context-feature cache: {total:,} tokens × {feat_dim} features × 2 B (bf16) "
                f"≈ {human_bytes(est)} -> {feature_dest}",
                file=sys.stderr,
            )
            free = shutil.disk_usage(Path(feature_dest).parent if Path(feature_dest).parent.exists() else ".").free
            if est > free:
                raise OSError(
                    f"the feature cache needs about {human_bytes(est)} but only {human_bytes(free)} is free under "
                    f"{Path(feature_dest).parent}; free space, set data.cache_dir elsewhere, or turn off data.feature_cache"
                )
            fw = stack.enter_context(
                CacheWriter(
                    feature_dest,
                    "features",
                    feature_parts or {},
                    {**meta, "feature_dim": feat_dim, "layer_ids": list(target.layer_ids), "storage": "bfloat16 bits in int16"},
                )
            )
            fw.save("offsets", offsets)
            w_feat = fw.create("features", (total, feat_dim), np.int16)

        batches = _batches_by_length(lengths, batch_size)
        bar = tqdm(total=total, unit="tok", desc="target precompute", disable=not progress, dynamic_ncols=True)
        with torch.no_grad():
            for idx in batches:
                ids, attn = _pad_batch(input_ids, offsets, idx, pad_id)
                ids = ids.to(device)
                res = target(ids, attention_mask=attn.to(device))
                if fw is not None:
                    for r, i in enumerate(idx):
                        n_i = int(lengths[i])
                        w_feat[offsets[i] : offsets[i] + n_i] = features_to_numpy(res.features[r, :n_i])
                if lw is not None:
                    # All supervised rows of the batch at once: (batch row, position, destination row).
                    spans = [(r, int(row_offsets[i]), int(row_offsets[i + 1])) for r, i in enumerate(idx)]
                    b_row = np.concatenate([np.full(b - a, r, dtype=np.int64) for r, a, b in spans])
                    b_pos = np.concatenate([positions[a:b] for _, a, b in spans]).astype(np.int64)
                    dest = np.concatenate([np.arange(a, b, dtype=np.int64) for _, a, b in spans])
                    t_row = torch.from_numpy(b_row).to(device)
                    t_pos = torch.from_numpy(b_pos).to(device)
                    true_ids = ids[t_row, t_pos]
                    for c in range(0, len(dest), head_chunk):
                        sl = slice(c, c + head_chunk)
                        # Row t holds the distribution predicting token t: the logits at t - 1.
                        logits = target.lm_head(res.normed_hidden[t_row[sl], t_pos[sl] - 1]).float()  # [rows, V]
                        vals, top = logits.topk(top_m, dim=-1)
                        true = logits.gather(-1, true_ids[sl, None])[:, 0]
                        d = dest[sl]
                        w_ids[d] = top.to(torch.int32).cpu().numpy()
                        w_vals[d] = vals.to(torch.float16).cpu().numpy()
                        w_true[d] = true.cpu().numpy()
                bar.update(int(lengths[idx].sum()))
        bar.close()
        if lw is not None:
            out["logits"] = Path(logit_dest)
        if fw is not None:
            out["features"] = Path(feature_dest)
    return out

