"""z-lab DFlash Hugging Face layout: export what we train, import released drafters (DESIGN §3.4).

The drafter directory holds ``config.json`` (``architectures: ["DFlashDraftModel"]``, Qwen3 fields,
``block_size``, ``num_target_layers``, ``dflash_config``) and one ``model.safetensors`` with un-prefixed
keys and no embedding or LM head, so serving engines that load DFlash drafters load ours. A trained
head goes beside it in a companion pair: ``lilicorr_head.json`` (class path and init args, sizes) and
``lilicorr_head.safetensors`` (its state dict).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from lilicorr_pl.models.dflash import DFlashDrafter

HEAD_CONFIG = "lilicorr_head.json"
HEAD_WEIGHTS = "lilicorr_head.safetensors"
QWEN3_FIELDS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "rms_norm_eps", "max_position_embeddings", "vocab_size", "tie_word_embeddings", "hidden_act",
    "initializer_range",
)


def _rope_theta(config: Any) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def drafter_config(drafter: DFlashDrafter) -> dict[str, Any]:
    """The ``config.json`` of a built drafter in the z-lab layout."""
    if not drafter.built:
        raise RuntimeError("export needs a built drafter (DFlashDrafter.build)")
    tc, d = drafter.target_config, drafter.dims
    cfg: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": drafter.block_size,
        "num_target_layers": int(tc.num_hidden_layers),
        "dflash_config": {"mask_token_id": int(drafter.mask_token_id), "target_layer_ids": list(drafter.target_layer_ids)},
        "num_hidden_layers": drafter.num_layers,
        "hidden_size": d.hidden_size,
        "intermediate_size": d.intermediate_size,
        "num_attention_heads": d.num_attention_heads,
        "num_key_value_heads": d.num_key_value_heads,
        "head_dim": d.head_dim,
        "rms_norm_eps": d.rms_norm_eps,
        "rope_theta": _rope_theta(tc),
        "max_position_embeddings": int(getattr(tc, "max_position_embeddings", 40960)),
        "vocab_size": int(tc.vocab_size),
        "tie_word_embeddings": bool(getattr(tc, "tie_word_embeddings", False)),
        "hidden_act": getattr(tc, "hidden_act", "silu"),
        "torch_dtype": str(next(drafter.parameters()).dtype).removeprefix("torch."),
    }
    params = getattr(tc, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    return cfg


class ExportError(ValueError):
    """An export destination that would lose or mix a user's files."""


def check_output_dir(output: str | Path, overwrite: bool = False) -> Path:
    """Refuse a destination that is a file or a non-empty directory (unless ``overwrite``), before any work.

    Nothing the exporter did not write is ever deleted: with ``overwrite`` only the files it writes are
    replaced; everything else in the directory stays.
    """
    output = Path(output)
    if output.exists() and not output.is_dir():
        raise ExportError(f"--output {output} is a file, not a directory; choose a new directory name")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise ExportError(
            f"--output {output} is not empty; choose a new or empty directory, or pass --overwrite to replace "
            "only the files the export writes (config.json, model.safetensors) and keep everything else"
        )
    probe = output
    while not probe.exists():
        probe = probe.parent
    if not os.access(probe, os.W_OK):
        raise ExportError(f"--output {output}: {probe} is not writable")
    return output


def _publish(files: dict[str, Path], output: Path) -> None:
    """Move each finished file into ``output`` with one atomic rename per file; touch nothing else."""
    mode = 0o666 & ~_umask()
    for name, path in files.items():
        os.chmod(path, mode)  # readable like any model directory (temp files start 0600)
        os.replace(path, output / name)


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def export_drafter(drafter: DFlashDrafter, output: str | Path, head: torch.nn.Module | None = None,
                   head_init: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
                   overwrite: bool = False) -> Path:
    """Write ``drafter`` (and optionally its head) in the z-lab DFlash layout.

    Every file is written under a temporary name inside the destination and renamed into place, so a reader
    never sees a half-written export. A non-empty ``output`` is refused unless ``overwrite``; even then
    only the files written here are replaced.
    """
    output = check_output_dir(output, overwrite)
    created = not output.exists()
    output.mkdir(parents=True, exist_ok=True)
    # The temporary files live inside the destination (same filesystem: each rename is atomic).
    tmp = Path(tempfile.mkdtemp(prefix=".lilicorr-export-", dir=output))
    try:
        cfg = drafter_config(drafter)
        if extra:
            cfg["lilicorr"] = extra
        files = {"config.json": tmp / "config.json", "model.safetensors": tmp / "model.safetensors"}
        files["config.json"].write_text(json.dumps(cfg, indent=2))
        state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
        save_file(state, str(files["model.safetensors"]), metadata={"format": "pt"})
        if head is not None and any(True for _ in head.parameters()):
            cls = type(head)
            files[HEAD_CONFIG] = tmp / HEAD_CONFIG
            files[HEAD_CONFIG].write_text(json.dumps({
                "class_path": f"{cls.__module__}.{cls.__qualname__}",
                "init_args": head_init or {},
                "hidden_size": drafter.dims.hidden_size,
                "vocab_size": int(drafter.target_config.vocab_size),
                "block_size": drafter.block_size,
            }, indent=2))
            files[HEAD_WEIGHTS] = tmp / HEAD_WEIGHTS
            save_file({k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()},
                      str(files[HEAD_WEIGHTS]), metadata={"format": "pt"})
        _publish(files, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created and not any(output.iterdir()):
            output.rmdir()  # the empty directory this call made, nothing else
        raise
    shutil.rmtree(tmp, ignore_errors=True)  # our own temporary directory, empty by now
    return output


def load_drafter(directory: str | Path, attention: str = "auto") -> DFlashDrafter:
    """Load a z-lab-format DFlash drafter (ours or a released one) as a built ``DFlashDrafter``."""
    from transformers import Qwen3Config

    directory = Path(directory)
    cfg_path, weights = directory / "config.json", directory / "model.safetensors"
    if not cfg_path.is_file() or not weights.is_file():
        raise FileNotFoundError(
            f"{directory} is not a DFlash drafter directory (needs config.json and model.safetensors)"
        )
    cfg = json.loads(cfg_path.read_text())
    dflash = cfg.get("dflash_config") or {}
    block_size = cfg.get("block_size", dflash.get("block_size"))
    layer_ids = dflash.get("target_layer_ids")
    if block_size is None or layer_ids is None:
        raise ValueError(
            f"{cfg_path} lacks block_size or dflash_config.target_layer_ids; is it a DFlash drafter config?"
        )
    target_like = Qwen3Config(
        **{k: cfg[k] for k in QWEN3_FIELDS if k in cfg},
        num_hidden_layers=int(cfg.get("num_target_layers", max(layer_ids) + 1)),
        rope_theta=cfg.get("rope_theta", 10000.0),
        **({"rope_scaling": cfg["rope_scaling"]} if cfg.get("rope_scaling") else {}),
    )
    drafter = DFlashDrafter(
        num_layers=int(cfg["num_hidden_layers"]),
        block_size=int(block_size),
        mask_token_id=int(dflash.get("mask_token_id", 151669)),
        attention=attention,
    ).build(target_like, layer_ids)
    state = load_file(str(weights))
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{weights}: keys do not match a DFlash drafter: missing {missing[:6]}, unexpected {unexpected[:6]}")
    dtype = next(iter(state.values())).dtype
    return drafter.to(dtype)


def load_head(directory: str | Path) -> torch.nn.Module | None:
    """Load the companion head, if the directory has one."""
    directory = Path(directory)
    if not (directory / HEAD_CONFIG).is_file():
        return None
    meta = json.loads((directory / HEAD_CONFIG).read_text())
    module_name, _, cls_name = meta["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module_name), cls_name)
    head = cls(**meta["init_args"]).build(meta["hidden_size"], meta["vocab_size"])
    head.load_state_dict(load_file(str(directory / HEAD_WEIGHTS)))
    return head


def check_compatible(drafter: DFlashDrafter, target_config: Any) -> None:
    """Raise when an imported drafter does not fit the target it is paired with."""
    problems = []
    if drafter.dims.hidden_size != target_config.hidden_size:
        problems.append(f"hidden_size {drafter.dims.hidden_size} vs target {target_config.hidden_size}")
    if max(drafter.target_layer_ids) >= target_config.num_hidden_layers:
        problems.append(f"target_layer_ids {drafter.target_layer_ids} vs {target_config.num_hidden_layers} target layers")
    if drafter.mask_token_id >= target_config.vocab_size:
        problems.append(f"mask_token_id {drafter.mask_token_id} vs {target_config.vocab_size} vocabulary rows")
    if problems:
        raise ValueError("the imported drafter does not match the target: " + "; ".join(problems))


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(prog="lilicorr export", description="Export a trained drafter in the z-lab DFlash layout.")
    p.add_argument("--ckpt", required=True, help="checkpoint written by `lilicorr fit`")
    p.add_argument("--output", required=True, help="output directory: new or empty (see --overwrite)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow the target's own code (never taken from the checkpoint)")
    p.add_argument("--allow-module", action="append", default=[], metavar="NAME",
                   help="also trust components from this package when the checkpoint names them")
    p.add_argument("--overwrite", action="store_true",
                   help="allow a non-empty --output; only the exported files are replaced, nothing else is touched")
    args = p.parse_args(argv)
    if not Path(args.ckpt).is_file():
        sys.exit(f"lilicorr export: checkpoint {args.ckpt} does not exist")
    try:
        check_output_dir(args.output, args.overwrite)
    except ExportError as err:
        sys.exit(f"lilicorr export: {err}")
    from lilicorr_pl.checkpoint import CheckpointError
    from lilicorr_pl.system import DraftSystem

    try:
        system = DraftSystem.from_checkpoint(args.ckpt, map_location="cpu", trust_remote_code=args.trust_remote_code,
                                             allow_modules=args.allow_module)
    except CheckpointError as err:
        sys.exit(f"lilicorr export: {err}")
    head_cfg = system.hparams.get("head")
    init = dict(head_cfg.get("init_args", {})) if isinstance(head_cfg, dict) else {}
    out = export_drafter(system.drafter, args.output, head=system.head, head_init=init,
                         extra={"target": system.target_spec.name_or_path}, overwrite=args.overwrite)
    print(f"exported drafter to {out}")
    return out
