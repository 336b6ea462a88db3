"""What a cache is keyed by: a sha256 over a canonical JSON of everything its content depends on.

A cache lives in ``<cache_dir>/<kind>-<fingerprint[:16]>``, so a changed input (data file content,
tokenizer, chat template, thinking flag, target weights, settings, schema) lands in a new directory
instead of being confused with an old one.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

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
    return [{"name": Path(p).name, "bytes": Path(p).stat().st_size, "sha256": file_sha256(p)} for p in paths]


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


def local_model_dir(name_or_path: str, revision: str | None = None) -> Path | None:
    """The local directory of a target: the path itself, or a hub name already in the local HF cache."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    try:
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
    local = local_model_dir(name, revision)
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
