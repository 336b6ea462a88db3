"""What a cache is keyed by: a sha256 over a canonical JSON of everything its content depends on.

A cache lives in ``<cache_dir>/<kind>-<fingerprint[:16]>``, so a changed input (data file content,
tokenizer, chat template, thinking flag, target weights, settings, schema) lands in a new directory
instead of being confused with an old one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from lilicorr_pl.files import where_load_kwargs

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


def _json_default(obj: Any) -> Any:
    if is_dataclass(obj):
        return asdict(obj)
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
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


def store_path(root: str | os.PathLike, kind: str, parts: Mapping[str, Any]) -> Path:
    """``<root>/<kind>-<first 16 hex of the fingerprint>``."""
    return Path(root) / f"{kind}-{fingerprint(parts)[:16]}"


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

    The target identity of checkpoints written before :func:`content_sha256` replaced it; kept to read their
    record. It misses an in-place edit outside those windows, so nothing new is keyed by it.
    """
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for start in sorted({0, max(0, size // 2 - window // 2), max(0, size - window)}):
            f.seek(start)
            h.update(f.read(window))
    return h.hexdigest()


def _file_version(path: Path) -> dict[str, Any]:
    """Where a file is and :func:`lilicorr_pl.files.file_state` (inode, size, mtime, ctime), as a memo records them."""
    from lilicorr_pl.files import file_state

    ino, size, mtime_ns, ctime_ns = file_state(path)
    return {"path": str(path.resolve()), "ino": ino, "bytes": size, "mtime_ns": mtime_ns, "ctime_ns": ctime_ns}


RACY_SECONDS = 2.0  # a file changed this close to its read may change again within one timestamp tick: not memoised
_digests: dict[str, str] = {}  # this process's digests by file version, whether or not the memo could be written


def content_sha256(path: str | os.PathLike, memo_dir: str | os.PathLike | None = None) -> str:
    """sha256 of a file's whole content, read once per version of the file.

    Weights run to tens of GB, so the digest is remembered in ``memo_dir`` (default
    ``<cache_root>/file-sha256``, one small JSON per file path) with the file's version (:func:`_file_version`:
    path, inode, size, mtime and ctime): any write to the file, in place or by replacement, gives a new version and
    a new read. A memo that does not parse or names another version is read past; where none can be written (no
    cache folder, a read-only one) the digest is kept for this process. A file changed within
    :data:`RACY_SECONDS` of its read is not remembered (a same-size write in the same timestamp tick would leave
    its version unchanged).
    """
    path = Path(path)
    version = _file_version(path)
    key = fingerprint(version)
    if key in _digests:
        return _digests[key]
    memo: Path | None = None
    try:
        if memo_dir is None:
            from lilicorr_pl.files import cache_root

            memo_dir = cache_root() / "file-sha256"
        memo = Path(memo_dir) / f"{text_sha256(version['path'])[:32]}.json"
    except (OSError, RuntimeError, KeyError):  # no home folder to find a cache in: read, and keep it here
        pass
    recorded = _read_memo(memo) if memo is not None else None
    if recorded is not None and recorded["version"] == version:
        _digests[key] = recorded["sha256"]
        return recorded["sha256"]
    started = time.time()
    digest = file_sha256(path)
    if _file_version(path) != version:  # written to while it was read: a digest of no version, matched by no key
        return digest
    if started - version["ctime_ns"] / 1e9 < RACY_SECONDS:
        return digest
    _digests[key] = digest
    if memo is not None:
        try:
            from lilicorr_pl.files import write_json_atomic

            write_json_atomic(memo, {"version": version, "sha256": digest})
            _prune_memos(memo.parent)
        except OSError:
            pass
    return digest


MEMO_PRUNE_ABOVE = 256  # memos kept before those of files that no longer exist are removed


def _read_memo(memo: Path) -> dict[str, Any] | None:
    """A :func:`content_sha256` memo, or None where ``memo`` is missing or is not one."""
    try:
        recorded = json.loads(memo.read_text())
    except (OSError, ValueError):
        return None
    if (isinstance(recorded, dict) and isinstance(recorded.get("version"), dict)
            and isinstance(recorded["version"].get("path"), str)
            and re.fullmatch("[0-9a-f]{64}", str(recorded.get("sha256")))):
        return recorded
    return None


def _prune_memos(memo_dir: Path) -> None:
    """Past :data:`MEMO_PRUNE_ABOVE` memos, remove those whose file is gone (test runs and temporary copies
    leave one per path); only files that read as memos."""
    memos = list(memo_dir.glob("*.json"))
    if len(memos) <= MEMO_PRUNE_ABOVE:
        return
    for memo in memos:
        recorded = _read_memo(memo)
        if recorded is not None and not os.path.exists(recorded["version"]["path"]):
            memo.unlink(missing_ok=True)


def fingerprint_files(paths: Sequence[str | os.PathLike]) -> list[dict[str, Any]]:
    """Content identity of data files (name, size, sha256), in the given order; paths do not matter. Each file is
    read once per version (:func:`content_sha256`): a checkpoint records these, and a resume compares them."""
    return [{"name": Path(p).name, "bytes": Path(p).stat().st_size, "sha256": content_sha256(p)} for p in paths]


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


# ``from_pretrained`` arguments that say where or how a model is read, not what it computes: left out of a target's key
# (revision and subfolder are keyed by what they select). Any other argument (a config override such as
# ``rope_scaling``, ``num_hidden_layers``, ``quantization_config``, ``variant``) changes the model, so it is keyed.
READING_ONLY_LOAD_KWARGS = frozenset({
    "revision", "subfolder", "token", "use_auth_token", "cache_dir", "local_files_only", "force_download",
    "resume_download", "proxies", "use_safetensors", "low_cpu_mem_usage", "device_map", "max_memory",
    "offload_folder", "offload_state_dict", "offload_buffers", "attn_implementation", "output_loading_info",
    "key_mapping", "tp_plan", "tp_size",
})


def local_model_dir(name_or_path: str, revision: str | None = None, subfolder: str | None = None,
                    cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The local directory of a target: the path itself, or a hub name already in the local HF cache (its
    ``subfolder`` when the model is read from one)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path / subfolder if subfolder else path
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name_or_path, f"{subfolder}/config.json" if subfolder else "config.json",
                                       revision=revision, cache_dir=cache_dir)
        if isinstance(found, str):
            return Path(found).parent
    except Exception:  # noqa: BLE001 - best effort only; the name still identifies the target
        pass
    return None


def hub_commit(name: str, load_kwargs: Mapping[str, Any] | None = None) -> tuple[str, Path] | None:
    """(the commit a hub name resolves to, the folder its ``config.json`` is in), read with the ``load_kwargs`` that
    say where from (revision, subfolder, cache_dir, token, local_files_only): the hub's answer with a network, the
    cache's ``refs`` offline; None when it cannot be resolved (no network and not cached, no such model) or the
    files are not a hub snapshot. Reads ``config.json`` (a download of a few kB), never the weights."""
    from transformers.utils import cached_file

    where = where_load_kwargs(load_kwargs)
    subfolder = where.pop("subfolder", None) or None
    try:
        found = cached_file(name, "config.json", subfolder=subfolder or "", **where)
    except (OSError, ValueError):
        return None
    if not found:
        return None
    folder = Path(found).parent
    snapshot = folder.parents[len(Path(subfolder).parts) - 1] if subfolder else folder
    return (snapshot.name, folder) if snapshot.parent.name == "snapshots" else None


def fingerprint_target(spec: Any, include_layers: bool = True, file_hash: Any = content_sha256,
                       hub: Literal["files", "commit"] = "files", name: str | None = None) -> dict[str, Any]:
    """Target identity from a ``TargetSpec`` (or dict): config.json content, weight file names, sizes and
    content hashes (``file_hash``: :func:`content_sha256`, or :func:`sampled_sha256` to read an old
    checkpoint's record), the name or path, dtype, the ``load_kwargs`` that change the model (all but
    :data:`READING_ONLY_LOAD_KWARGS`; none: the key of a target loaded without any), a local model's own code (its
    ``.py`` files, with ``trust_remote_code``: an edit there changes the logits and features; a hub commit covers
    them) and (if ``include_layers``) the feature layer ids.

    The logit cache does not depend on which layers feed the drafter, so it passes
    ``include_layers=False`` and survives a change of ``layer_ids``.

    ``hub``: how a hub name (not a local directory) is identified. ``"files"``: by the config and weight files the
    local HF cache holds now (what a loaded target is compared by). ``"commit"``: by the commit the name resolves
    to and its config, whatever has been downloaded yet, so a key taken before the weights download is the key taken
    after (the data stores: their keys are computed before the target is loaded).

    ``name``: what the key records as the target's name (default: its ``name_or_path``, also where its files are read).
    """
    if isinstance(spec, Mapping):
        spec_d = dict(spec)
    elif is_dataclass(spec):
        spec_d = asdict(spec)
    else:
        raise TypeError(f"expected a TargetSpec or dict, got {type(spec).__name__}")
    if hub not in ("files", "commit"):
        raise ValueError(f"hub must be 'files' or 'commit', not {hub!r}")
    recorded, name = name, str(spec_d["name_or_path"])
    load_kwargs = dict(spec_d.get("load_kwargs") or {})
    revision, subfolder = load_kwargs.get("revision"), load_kwargs.get("subfolder") or None
    parts: dict[str, Any] = {"name_or_path": name if recorded is None else recorded,
                             "dtype": str(spec_d.get("dtype", "float32"))}
    if revision is not None:
        parts["revision"] = revision
    if subfolder is not None:
        parts["subfolder"] = str(subfolder)
    changes_model = {k: v for k, v in load_kwargs.items() if k not in READING_ONLY_LOAD_KWARGS}
    if changes_model:
        parts["load_kwargs"] = json.loads(canonical_json(changes_model))
    if hub == "commit" and not Path(name).expanduser().is_dir():
        resolved = hub_commit(name, load_kwargs)
        if resolved is not None:
            commit, folder = resolved
            parts["commit"] = commit  # a hub commit names its files' content: the weights need no hashing
            cfg = folder / "config.json"
            parts["config"] = json.loads(cfg.read_text()) if cfg.is_file() else None
    else:
        local = local_model_dir(name, revision, subfolder, load_kwargs.get("cache_dir"))
        if local is not None:
            cfg = local / "config.json"
            parts["config"] = json.loads(cfg.read_text()) if cfg.is_file() else None
            parts["weights"] = sorted(
                (p.name, p.stat().st_size, file_hash(p))
                for p in local.iterdir()
                if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)
            ) if local.is_dir() else []
            if spec_d.get("trust_remote_code") and local.is_dir():  # the model's own code computes its logits
                parts["code"] = sorted((p.relative_to(local).as_posix(), file_sha256(p)) for p in local.rglob("*.py")
                                       if p.is_file())
    if include_layers:
        parts["layer_ids"] = spec_d.get("layer_ids")
        if spec_d.get("layer_ids") is None:
            parts["num_features"] = spec_d.get("num_features")
    return parts
