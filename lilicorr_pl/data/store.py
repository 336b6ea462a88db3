"""Caches on disk: safetensors shards plus one small manifest, written atomically, validated on read.

A store is a directory ``<cache_dir>/<kind>-<fingerprint[:16]>/`` holding ``shard-00000.safetensors``,
``shard-00001.safetensors``, … (each a contiguous range of examples; dtypes and shapes in the
safetensors header, bf16 stored natively, reads memory-mapped) and ``manifest.json``: the schema,
the kind, the fingerprint and the parts it was computed from, each shard's example range, size and
sha256, a few counts (``meta``) and how it was produced (``provenance``: tool version, host, time,
processes). Shard files carry the store's fingerprint and their example range in their header too.

Writing (``StoreWriter``): shards go into a hidden ``.<name>.partial/`` directory beside the
destination, each written under a temporary name and renamed into place, so a killed precompute
keeps its finished shards and the next run only computes the rest (any number of processes may
write different shards of the same store). ``finalize`` checks that every shard is there, writes
the manifest and renames the directory into place: a store under its real name is always complete.

Reading (``open_store``): the manifest is checked against itself (fingerprint of its parts; the shape of
its shard list; its example count against its ``meta``'s, where recorded), against the fingerprint the
caller expects, and against the files (every shard file listed, each one's presence, size, sha256 unless
``verify="size"``, a readable safetensors header with the expected tensors). Any mismatch raises a
one-line ``CacheError`` naming the file and the fix: a cache is never used silently.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import shutil
import socket
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from lilicorr_pl.checkpoint import first_line
from lilicorr_pl.data.fingerprint import _json_default, canonical_json, file_sha256, fingerprint
from lilicorr_pl.files import remove_gone_writers, writer_tag

SCHEMA_VERSION = 2
MANIFEST_NAME = "manifest.json"
# One metadata entry holding canonical JSON: safetensors writes several entries in a per-process hash order,
# which would make the same shard's bytes depend on the process that wrote it.
METADATA_KEY = "lilicorr"
Verify = Literal["full", "size"]

#: The tensors every shard of a store kind holds (per-shard ``offsets`` are local, starting at 0).
TENSORS = {
    "tokens": ("input_ids", "loss_mask", "offsets"),  # int32 [T], bool [T], int64 [n+1]
    "logits": ("offsets", "positions", "topm_ids", "topm_logits", "true_logit"),  # rows: [n+1], [R], [R, M] ×2, [R]
    "features": ("features",),  # bf16 [T, n·H]
}


class CacheError(RuntimeError):
    """A cache that is missing, incomplete, altered or built from other inputs than expected."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def _fail(path: Path, problem: str) -> CacheError:
    return CacheError(
        f"cache {path} is invalid: {problem}; it will not be used: delete {path} and rerun prepare_data "
        "(`lilicorr fit` or `lilicorr prepare`) to rebuild it"
    )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shard_entry_problem(index: int, entry: Any) -> str | None:
    """What is wrong with entry ``index`` of a manifest's shard list (None: the shape the writer writes)."""
    if not isinstance(entry, dict):
        return f"is a JSON {type(entry).__name__}, not an object"
    if entry.get("file") != shard_name(index):
        return f"names file {entry.get('file')!r}, expected {shard_name(index)!r}"
    examples = entry.get("examples")
    if not (isinstance(examples, list) and len(examples) == 2 and all(_is_count(x) for x in examples)
            and examples[0] <= examples[1]):
        return f"has examples {examples!r}, expected a range [start, stop]"
    return None


def _header(path: Path) -> tuple[dict[str, str], dict[str, tuple[str, list[int]]]]:
    """A shard's metadata and ``{tensor: (dtype, shape)}``, reading only its header."""
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get(METADATA_KEY, "{}"))
        return meta, {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}


def provenance(**extra: Any) -> dict[str, Any]:
    """Who wrote a store, when, with which version (never part of the fingerprint)."""
    import lilicorr_pl

    return {
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "lilicorr_pl": lilicorr_pl.__version__,
        "torch": torch.__version__,
        **extra,
    }


class StoreWriter:
    """Writes the shards of one store into ``.<name>.partial/`` and finalizes it (see the module docstring)."""

    def __init__(self, dest: str | os.PathLike, kind: str, parts: Mapping[str, Any]) -> None:
        if kind not in TENSORS:
            raise ValueError(f"unknown store kind {kind!r}; expected one of {sorted(TENSORS)}")
        self.dest = Path(dest)
        self.kind = kind
        self.parts = dict(parts)
        self.fingerprint = fingerprint(self.parts)
        self.partial = self.dest.parent / f".{self.dest.name}.partial"

    def finished_elsewhere(self) -> bool:
        """Whether another, independent process already completed this store (its manifest is in place)."""
        return (self.dest / MANIFEST_NAME).is_file()

    def done(self, index: int) -> bool:
        """Whether shard ``index`` was already written (by this or an interrupted earlier run)."""
        if self.finished_elsewhere():
            return True
        path = self.partial / shard_name(index)
        if not path.is_file():
            return False
        try:
            meta, _ = _header(path)
        except Exception:  # noqa: BLE001 - unreadable: it is rewritten
            return False
        return meta.get("fingerprint") == self.fingerprint

    def write(self, index: int, examples: tuple[int, int], tensors: Mapping[str, torch.Tensor]) -> Path:
        """Write shard ``index`` (examples ``[a, b)``) atomically: a temporary name, then a rename."""
        missing = set(TENSORS[self.kind]) - set(tensors)
        if missing:
            raise ValueError(f"a {self.kind} shard needs tensors {sorted(missing)}")
        meta = {"fingerprint": self.fingerprint, "kind": self.kind, "shard": str(index),
                "examples": f"{int(examples[0])}:{int(examples[1])}"}
        data = safetensors_bytes({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                                 metadata={METADATA_KEY: canonical_json(meta)})
        if self.finished_elsewhere() or not self._write_into_partial(shard_name(index), data):
            return self.dest / shard_name(index)
        return self.partial / shard_name(index)

    def _write_into_partial(self, name: str, data: bytes) -> bool:
        """Write file ``name`` of the partial directory atomically: a temporary name that says which writer made it
        (``.<name>.<writer_tag()>.tmp``, so another writer's ``finalize`` never removes it while this one lives),
        then a rename. ``False`` if another process finalized the same store meanwhile: theirs stands, and this
        writer's temporary file, moved along with their directory, is removed from it."""
        self.partial.mkdir(parents=True, exist_ok=True)
        tmp = self.partial / f".{name}.{writer_tag()}.tmp"
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.partial / name)
        except FileNotFoundError:
            if self.finished_elsewhere():
                (self.dest / tmp.name).unlink(missing_ok=True)
                return False
            raise
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if self.finished_elsewhere():  # finalized between the look and the mkdir: this made a partial directory anew
            (self.partial / name).unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # (while empty: another live writer's file keeps it for its own check)
                self.partial.rmdir()
            return False
        return True

    def finalize(self, num_shards: int, meta: Mapping[str, Any] | None = None,
                 provenance: Mapping[str, Any] | None = None) -> Path:
        """Check that shards ``0..num_shards-1`` are all there, write the manifest, rename into place."""
        if self.finished_elsewhere():  # an independent run sharing this cache completed it first
            open_store(self.dest, expected_fingerprint=self.fingerprint, kind=self.kind, verify="size")
            return self.dest
        try:
            shards, end = self._shard_list(num_shards)
        except (FileNotFoundError, CacheError):  # another process finalized the store (its shards moved with it)
            if not self.finished_elsewhere():  # while this one hashed them (minutes)
                raise
            open_store(self.dest, expected_fingerprint=self.fingerprint, kind=self.kind, verify="size")
            return self.dest
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "kind": self.kind,
            "fingerprint": self.fingerprint,
            "parts": self.parts,
            "examples": end,
            "shards": shards,
            "meta": dict(meta or {}),
            "provenance": dict(provenance or {}),
        }
        if not self._write_into_partial(MANIFEST_NAME, json.dumps(manifest, default=_json_default, indent=2).encode()):
            open_store(self.dest, expected_fingerprint=self.fingerprint, kind=self.kind, verify="size")
            return self.dest
        remove_gone_writers(self.partial, ".*.tmp", untagged=True)  # temp files of killed writers (never a live one's)
        try:
            os.replace(self.partial, self.dest)
        except OSError:
            if not self.dest.is_dir():
                raise
            # Another process finished the same store first: keep theirs if it is valid.
            shutil.rmtree(self.partial, ignore_errors=True)
            open_store(self.dest, expected_fingerprint=self.fingerprint, kind=self.kind, verify="size")
        return self.dest

    def _shard_list(self, num_shards: int) -> tuple[list[dict[str, Any]], int]:
        """The manifest's entry of each of shards ``0..num_shards-1`` (checked: there, written for these inputs, the
        examples in sequence), and the number of examples they hold."""
        shards, end = [], 0
        for index in range(num_shards):
            path = self.partial / shard_name(index)
            if not self.done(index):
                raise CacheError(f"shard {path} is missing or was written for other inputs; rerun the precompute")
            header, _ = _header(path)
            a, b = (int(x) for x in header["examples"].split(":"))
            if a != end:
                raise CacheError(f"shard {path} covers examples {a}:{b}, expected to start at {end}")
            end = b
            shards.append({"file": path.name, "examples": [a, b], "bytes": path.stat().st_size,
                           "sha256": file_sha256(path)})
        return shards, end


class Store:
    """An opened, validated store. Shards are opened lazily (memory-mapped) in each process that reads them,
    so a ``Store`` pickles as its manifest and path (cheap for DataLoader workers)."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest
        self._handles: dict[int, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_handles"] = {}
        state.pop("starts", None)
        return state

    @property
    def kind(self) -> str:
        return self.manifest["kind"]

    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest.get("meta", {})

    @property
    def num_examples(self) -> int:
        return int(self.manifest["examples"])

    @property
    def shard_examples(self) -> list[tuple[int, int]]:
        return [tuple(s["examples"]) for s in self.manifest["shards"]]

    @cached_property
    def starts(self) -> np.ndarray:
        return np.array([a for a, _ in self.shard_examples], dtype=np.int64)

    def locate(self, example: int) -> tuple[int, int]:
        """(shard, index inside the shard) of a global example index."""
        shard = int(np.searchsorted(self.starts, example, side="right")) - 1
        return shard, example - int(self.starts[shard])

    def _handle(self, shard: int) -> Any:
        handle = self._handles.get(shard)
        if handle is None:
            handle = self._handles[shard] = safe_open(str(self.path / self.manifest["shards"][shard]["file"]),
                                                     framework="pt")
        return handle

    def get(self, shard: int, name: str) -> torch.Tensor:
        """A whole tensor of one shard."""
        return self._handle(shard).get_tensor(name)

    def slice(self, shard: int, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of a tensor of one shard (only those bytes are read)."""
        return self._handle(shard).get_slice(name)[start:stop]

    def shape(self, shard: int, name: str) -> list[int]:
        return self._handle(shard).get_slice(name).get_shape()

    def __repr__(self) -> str:
        return f"Store({self.kind!r}, {self.path}, {len(self.manifest['shards'])} shards)"


def open_store(path: str | os.PathLike, expected_fingerprint: str | None = None, kind: str | None = None,
               verify: Verify = "full") -> Store:
    """Open a store after validating it against its manifest.

    Args:
        path: the store directory.
        expected_fingerprint: if given, the manifest's fingerprint must equal it.
        kind: if given, the manifest's kind must equal it.
        verify: ``"full"`` checks every shard's sha256 (reads everything once); ``"size"`` checks
            presence, sizes and the safetensors headers only.
    """
    path = Path(path)
    if verify not in ("full", "size"):
        raise ValueError(f"verify must be 'full' or 'size', got {verify!r}")
    if not path.is_dir():
        raise CacheError(f"cache {path} does not exist; run prepare_data (or `lilicorr prepare`) first to build it")
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
    for key in ("kind", "fingerprint", "parts", "shards", "examples"):
        if key not in manifest:
            raise _fail(path, f"manifest has no {key!r}")
    if fingerprint(manifest["parts"]) != manifest["fingerprint"]:
        raise _fail(path, "the manifest's fingerprint does not match its own parts (the manifest was edited)")
    if expected_fingerprint is not None and manifest["fingerprint"] != expected_fingerprint:
        raise _fail(path, f"fingerprint {manifest['fingerprint'][:16]}… differs from the expected "
                          f"{expected_fingerprint[:16]}… (it was built from different inputs)")
    if kind is not None and manifest["kind"] != kind:
        raise _fail(path, f"kind is {manifest['kind']!r}, expected {kind!r}")
    if not isinstance(manifest["kind"], str) or manifest["kind"] not in TENSORS:
        raise _fail(path, f"unknown kind {manifest['kind']!r}")
    # The fingerprint covers the parts only: the shard list is checked for shape, against the shard files in the
    # directory and against the example count the writer recorded in meta, before any shard is read.
    shards, meta = manifest["shards"], manifest.get("meta", {})
    for key, value, fits, wanted in (("shards", shards, isinstance(shards, list), "a list"),
                                     ("examples", manifest["examples"], _is_count(manifest["examples"]), "a count"),
                                     ("meta", meta, isinstance(meta, dict), "an object")):
        if not fits:
            raise _fail(path, f"the manifest's {key} is a JSON {type(value).__name__}, not {wanted} (the manifest was "
                              "edited)")
    for index, entry in enumerate(shards):
        problem = _shard_entry_problem(index, entry)
        if problem:
            raise _fail(path, f"the manifest's shard entry {index} {problem} (the manifest was edited)")
    unlisted = sorted({p.name for p in path.glob("shard-*.safetensors")} - {entry["file"] for entry in shards})
    if unlisted:
        raise _fail(path, f"shard {unlisted[0]} is in the store but not in its manifest "
                          f"({len(unlisted)} unlisted; the manifest was edited)")
    recorded = meta.get("examples")
    if _is_count(recorded) and recorded != manifest["examples"]:
        raise _fail(path, f"the manifest says {manifest['examples']} examples, its meta {recorded} (the manifest was "
                          "edited)")
    end = 0
    for entry in shards:
        fpath = path / entry["file"]
        if not fpath.is_file():
            raise _fail(path, f"shard {entry['file']} listed in the manifest is missing")
        size = fpath.stat().st_size
        if size != entry.get("bytes"):
            raise _fail(path, f"shard {entry['file']} has {size} bytes, the manifest says {entry.get('bytes')} (truncated?)")
        if verify == "full" and file_sha256(fpath) != entry.get("sha256"):
            raise _fail(path, f"shard {entry['file']} does not match its sha256 in the manifest (altered)")
        try:
            meta, tensors = _header(fpath)
        except Exception as err:  # noqa: BLE001 - any unreadable header is a corrupt shard
            raise _fail(path, f"shard {entry['file']} is not a readable safetensors file ({first_line(err)})") from None
        missing = set(TENSORS[manifest["kind"]]) - set(tensors)
        if missing:
            raise _fail(path, f"shard {entry['file']} lacks tensors {sorted(missing)}")
        if meta.get("fingerprint") != manifest["fingerprint"] or meta.get("examples") != "{}:{}".format(*entry["examples"]):
            raise _fail(path, f"shard {entry['file']} belongs to another store or example range")
        if entry["examples"][0] != end:
            raise _fail(path, f"shard {entry['file']} starts at example {entry['examples'][0]}, expected {end}")
        end = entry["examples"][1]
    if end != manifest["examples"]:
        raise _fail(path, f"the shards cover {end} examples, the manifest says {manifest['examples']}")
    return Store(path, manifest)
