"""Checkpoint layout the serving engines load: export what we train, import released drafters (DESIGN §3.4).

A drafter alone is the z-lab ``DFlashDraftModel`` directory: ``config.json``
(``architectures: ["DFlashDraftModel"]``, Qwen3 fields, ``block_size``, ``num_target_layers``,
``dflash_config``) and one ``model.safetensors`` with un-prefixed keys and no embedding or LM head.

A drafter with a LiLiCorr head is the same directory as a ``LiLiCorrDraftModel`` (what SGLang, vLLM and
TensorRT-LLM serve, and the layout of NVIDIA Model-Optimizer's ``LiLiCorrExporter``): ``dflash_config``
adds ``projector_type: "lilicorr"``, ``lilicorr_enabled: true`` and the head's geometry
``lilicorr_{candidate_topk, hidden_size, num_layers, num_heads, mlp_ratio, factor_dim, vector_eps,
logit_scale}``, and the head's tensors sit in the same ``model.safetensors`` under ``lilicorr.``.
:class:`~lilicorr_pl.heads.LiLiCorrHead`'s ``state_dict`` already uses the served names and shapes, so the
export only adds the prefix. No companion files.

The head's two MLPs have two spellings in the wild. Model-Optimizer's training module builds them as
``nn.Sequential`` (``feature_mlp.{0,1,3}``, ``layers.<i>.mlp.{0,2}``), and its exporter writes those indices;
vLLM's current loader names them (``feature_norm``, ``feature_mlp.{up,down}_proj``,
``layers.<i>.mlp.{up,down}_proj``) and an earlier one read only the indices; SGLang and TensorRT-LLM rename
the indices to the names, so they read both. The export writes the named form by default and the indexed form
on request (``head_mlp_names="sequential"``); the import reads both.

Both layouts carry ``dflash_config.causal: false`` (vLLM reads it as every layer's attention) and
``torch_dtype``, the dtype every tensor is written in: by default the drafter's own; ``lilicorr export``
passes the target's (a ``bf16-mixed`` run keeps fp32 master weights, which an engine would load at twice the
size).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from lilicorr_pl.checkpoint import first_line, state_checksum
from lilicorr_pl.files import (
    InUseError,
    check_writable_dir,
    folder_held_alone,
    folder_identity,
    folders_made,
    new_file_mode,
    remove_gone_writers,
    remove_made_folders,
    writer_tag,
)
from lilicorr_pl.heads.lilicorr import LiLiCorrHead
from lilicorr_pl.models.dflash import DFlashDrafter

EXPORT_MARKER = "lilicorr_pl"
"""The ``config.json`` key every ``lilicorr export`` writes (the package version, the target's name)."""
EXPORT_ID = "export_id"
"""The key of the id one export writes into its ``config.json`` (under :data:`EXPORT_MARKER`) and its
``model.safetensors`` metadata (``lilicorr_pl.export_id``): a digest of what it exported."""
HEAD_PREFIX = "lilicorr."
"""Key prefix of the LiLiCorr head's tensors inside ``model.safetensors``."""
LILICORR_ARCHITECTURE = "LiLiCorrDraftModel"
DFLASH_ARCHITECTURE = "DFlashDraftModel"
OLD_COMPANION_FILES = ("lilicorr_head.json", "lilicorr_head.safetensors")
HEAD_CONFIG_FIELDS = (
    "candidate_topk", "hidden_size", "num_layers", "num_heads", "mlp_ratio", "factor_dim", "vector_eps", "logit_scale",
)
"""``dflash_config.lilicorr_<field>`` keys every engine requires to rebuild the head."""
# Model-Optimizer's exports index the MLPs as nn.Sequential (see the module docstring): read in both forms,
# written in the named form unless asked for the indexed one.
_SEQUENTIAL_NAMES = (
    ("feature_mlp.0.", "feature_norm."), ("feature_mlp.1.", "feature_mlp.up_proj."),
    ("feature_mlp.3.", "feature_mlp.down_proj."), (".mlp.0.", ".mlp.up_proj."), (".mlp.2.", ".mlp.down_proj."),
)
QWEN3_FIELDS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "rms_norm_eps", "max_position_embeddings", "vocab_size", "tie_word_embeddings", "hidden_act",
    "initializer_range",
)


def _rope_theta(config: Any) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _rope_scaling(config: Any) -> dict[str, Any] | None:
    """A config's RoPE scaling (YaRN, linear, llama3, ...), None for plain RoPE."""
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type", params.get("type", "default")) == "default":
        return None
    # "type": the older spelling transformers keeps beside rope_type when a config gives it.
    return {k: v for k, v in params.items() if k not in ("rope_theta", "type")}


def head_geometry(head: LiLiCorrHead) -> dict[str, Any]:
    """The init args that define a built LiLiCorr head's function (what the export records)."""
    return {
        "top_k": head.top_k, "hidden_size": head.hidden_size, "num_layers": head.num_layers,
        "num_heads": head.num_heads, "mlp_ratio": head.mlp_ratio, "factor_dim": head.factor_dim,
        "vector_eps": head.vector_eps, "logit_scale": head.logit_scale, "block_size": head.block_size,
        "rms_norm_eps": head.rms_norm_eps,
    }


def lilicorr_config_fields(head: LiLiCorrHead) -> dict[str, Any]:
    """The ``dflash_config`` entries a ``LiLiCorrDraftModel`` adds for ``head`` (``causal: false`` is every export's)."""
    return {
        "projector_type": "lilicorr",
        "lilicorr_enabled": True,
        "lilicorr_candidate_topk": head.top_k,
        "lilicorr_hidden_size": head.hidden_size,
        "lilicorr_num_layers": head.num_layers,
        "lilicorr_num_heads": head.num_heads,
        "lilicorr_mlp_ratio": head.mlp_ratio,
        "lilicorr_factor_dim": head.factor_dim,
        "lilicorr_vector_eps": head.vector_eps,
        "lilicorr_logit_scale": head.logit_scale,
    }


def _check_head_fits(head: LiLiCorrHead, drafter: DFlashDrafter) -> None:
    if not head.is_built:
        raise ExportError("export needs a built LiLiCorrHead (head.build)")
    d = drafter.dims
    problems = [
        f"{name} {ours} vs the drafter's {theirs}"
        for name, ours, theirs in (
            ("block_size", head.block_size, drafter.block_size),
            ("hidden size", head.target_hidden_size, d.hidden_size),
            ("vocab_size", head.vocab_size, int(drafter.target_config.vocab_size)),
            ("rms_norm_eps", head.rms_norm_eps, d.rms_norm_eps),
        )
        if ours != theirs
    ]
    if problems:
        raise ExportError(
            "the LiLiCorr head does not fit the drafter it is exported with (" + "; ".join(problems) + "); the "
            "engines build the head from the drafter's config, so both must come from the same run"
        )
    k = head.top_k
    if k > 16 or k & (k - 1):
        warnings.warn(
            f"LiLiCorr top_k {k} is not a power of two <= 16: SGLang and TensorRT-LLM serve it, vLLM refuses it",
            stacklevel=3,
        )


HEAD_MLP_NAMES = ("named", "sequential")
"""How the head's MLP tensors are spelled in an export (see the module docstring)."""


def _check_head_mlp_names(value: str) -> None:
    if value not in HEAD_MLP_NAMES:
        raise ExportError(f"head_mlp_names {value!r}: use one of {', '.join(HEAD_MLP_NAMES)}")


def drafter_config(drafter: DFlashDrafter, head: LiLiCorrHead | None = None,
                   dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The ``config.json`` of a built drafter: ``DFlashDraftModel``, or ``LiLiCorrDraftModel`` with ``head``;
    ``torch_dtype`` is ``dtype`` (default: the drafter's parameters')."""
    if not drafter.built:
        raise RuntimeError("export needs a built drafter (DFlashDrafter.build)")
    tc, d = drafter.target_config, drafter.dims
    cfg: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": drafter.block_size,
        "num_target_layers": int(tc.num_hidden_layers),
        "dflash_config": {"mask_token_id": int(drafter.mask_token_id), "target_layer_ids": list(drafter.target_layer_ids),
                          "causal": False},
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
        "initializer_range": float(getattr(tc, "initializer_range", 0.02)),
        "attention_bias": False,  # the drafter's projections have none
        "attention_dropout": 0.0,
        "layer_types": ["full_attention"] * drafter.num_layers,
        "torch_dtype": str(dtype or next(drafter.parameters()).dtype).removeprefix("torch."),
    }
    params = getattr(tc, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    if head is not None:
        cfg["architectures"] = [LILICORR_ARCHITECTURE]
        cfg["dflash_config"].update(lilicorr_config_fields(head))
    return cfg


def _indexed_name(key: str) -> str:
    """A head tensor's name in Model-Optimizer's ``nn.Sequential`` form (the inverse of the import's renaming)."""
    for indexed, named in _SEQUENTIAL_NAMES:
        key = key.replace(named, indexed)  # "feature_mlp.up_proj." never contains ".mlp.up_proj.": no collision
    return key


def export_state(drafter: DFlashDrafter, head: LiLiCorrHead | None = None, dtype: torch.dtype | None = None,
                 head_mlp_names: str = "named") -> dict[str, torch.Tensor]:
    """The tensors of ``model.safetensors``: the drafter's keys, plus the head's under ``lilicorr.``.

    Every tensor in one dtype, the config's ``torch_dtype``: ``dtype``, by default the drafter's. The head's MLPs
    spelled as ``head_mlp_names`` says (``named`` or ``sequential``).
    """
    _check_head_mlp_names(head_mlp_names)
    dtype = dtype or next(drafter.parameters()).dtype
    trained = {k: v.detach() for k, v in drafter.state_dict().items()}
    if head is not None:
        rename = _indexed_name if head_mlp_names == "sequential" else (lambda key: key)
        trained.update({HEAD_PREFIX + rename(k): v.detach() for k, v in head.state_dict().items()})
    broken = [k for k, v in trained.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if broken:  # not the export's dtype: the weights were never finite (a diverged run)
        raise ExportError(f"{len(broken)} tensor(s) of the trained weights hold NaN or inf (e.g. {broken[0]}): the "
                          "run diverged before this checkpoint; export an earlier checkpoint of it")
    state = {k: v.to(dtype).contiguous().cpu() for k, v in trained.items()}
    overflowed = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if overflowed:
        raise ExportError(f"{len(overflowed)} tensor(s) are not finite in {str(dtype).removeprefix('torch.')} (e.g. "
                          f"{overflowed[0]}: values past that type's range); export in bfloat16 or float32 (--dtype)")
    return state


class ExportError(ValueError):
    """An export destination that would lose or mix a user's files."""


_EXPORT_TMP = ".lilicorr-export."  # an export's temporary folder inside its destination: ``<this><random>.<writer>.tmp``


def check_output_dir(output: str | Path, overwrite: bool = False) -> Path:
    """Refuse a destination that is a file or a non-empty directory (unless ``overwrite``), before any work.

    Nothing the exporter did not write is ever deleted: with ``overwrite`` only the files it writes are
    replaced; everything else in the directory stays.
    """
    if not str(output).strip():
        raise ExportError("--output is empty; pass the directory to write the export into")
    output = Path(output)
    if output.exists() and not output.is_dir():
        raise ExportError(f"--output {output} is a file, not a directory; choose a new directory name")
    if output.is_dir():  # said first: another export's temporary files would read as "not empty"
        with _held_alone(output):
            pass
    _check_contents(output, overwrite)
    try:
        check_writable_dir(output, f"--output {output}")
    except ValueError as err:
        raise ExportError(str(err)) from None
    return output


def _check_contents(output: Path, overwrite: bool) -> None:
    """What :func:`check_output_dir` refuses in the folder itself: anything in it without ``overwrite``; with it, a
    link or a folder under an exported file's name, and another model's files. Checked again while the export holds
    the folder: another export may have finished into it since."""
    if output.is_dir():  # an export killed here left its temporary folder: not the user's, and in the way of a retry
        remove_gone_writers(output, f"{_EXPORT_TMP}*.tmp")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise ExportError(
            f"--output {output} is not empty; choose a new or empty directory, or pass --overwrite to replace "
            "only the files the export writes (config.json, model.safetensors) and keep everything else"
        )
    if output.is_dir() and overwrite:
        _refuse_links_and_folders(output)  # first: the marker check below reads through a link
        _refuse_another_model(output)


def _refuse_links_and_folders(output: Path) -> None:
    """The renames into place replace a symbolic link itself (the user's link, not what it names) and fail on a
    directory (after the other file was already replaced): either, under an exported file's name, is refused."""
    for path in (output / "config.json", output / "model.safetensors"):
        if path.is_symlink():
            raise ExportError(f"--output {output}: {path} is a symbolic link (to {os.readlink(path)}), which the "
                              "export would replace with a file; move it away, or choose another directory")
        if path.is_dir():
            raise ExportError(f"--output {output}: {path} is a directory, not a file the export can replace; move it "
                              "away, or choose another directory")


def _refuse_another_model(output: Path) -> None:
    """``--overwrite`` replaces an earlier export's ``config.json`` and ``model.safetensors``, never another model's
    (a target's, a released drafter's): those files are refused unless the config carries this tool's marker."""
    config, weights = output / "config.json", output / "model.safetensors"
    if not config.exists() and not weights.exists():
        return
    try:
        payload = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        payload = None
    if isinstance(payload, dict) and isinstance(payload.get(EXPORT_MARKER), dict):
        return
    architectures = payload.get("architectures") if isinstance(payload, dict) else None
    held = f"a model of architectures {architectures}" if architectures else "files no export wrote"
    raise ExportError(
        f"--output {output} holds {held} (config.json / model.safetensors, not written by lilicorr export); "
        "--overwrite replaces only an earlier lilicorr export's, so choose another directory"
    )


def _order_metadata(path: Path) -> None:
    """Write a safetensors file's ``__metadata__`` keys in sorted order, in place: safetensors writes them in a hash
    map's order, which changes from one save to the next, so the same export came out as other bytes (and a demo stage
    keyed by its drafter's checksum was trained again). The header keeps its length (the same JSON reordered, padded
    with the spaces safetensors pads it with)."""
    with open(path, "r+b") as fh:
        size = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(size))
        if len(header.get("__metadata__") or {}) < 2:
            return
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        if len(text) > size:  # never: the same keys and values (a header it cannot rewrite is left as written)
            return
        fh.seek(8)
        fh.write(text.ljust(size, b" "))


def _publish(files: dict[str, Path], output: Path) -> None:
    """Move each finished file into ``output`` with one atomic rename per file; touch nothing else."""
    _refuse_links_and_folders(output)  # again, before the first rename: one made while the export ran
    mode = new_file_mode(output)
    for name, path in files.items():
        os.chmod(path, mode)  # readable like any model directory (safetensors writes its files 0600)
        os.replace(path, output / name)


def export_drafter(drafter: DFlashDrafter, output: str | Path, head: torch.nn.Module | None = None,
                   extra: dict[str, Any] | None = None, overwrite: bool = False, dtype: torch.dtype | None = None,
                   head_mlp_names: str = "named") -> Path:
    """Write ``drafter`` (and its LiLiCorr ``head``, if given) as one serving checkpoint directory.

    Without a head (or with a parameter-free selector) the directory is a ``DFlashDraftModel``; with a
    :class:`LiLiCorrHead` it is a ``LiLiCorrDraftModel``. Other heads have no serving layout here and
    are refused. Every file is written under a temporary name inside the destination and renamed
    into place, so a reader never sees a half-written export. A non-empty ``output`` is refused unless
    ``overwrite``; even then only the files written here are replaced. ``dtype``: every tensor's (default: the
    drafter's); ``head_mlp_names``: ``named`` or ``sequential`` (Model-Optimizer's indices).
    """
    _check_head_mlp_names(head_mlp_names)
    if head is not None and not any(True for _ in head.parameters()):
        head = None  # top-1: nothing to serve beyond the drafter
    if head is not None and not isinstance(head, LiLiCorrHead):
        raise ExportError(
            f"{type(head).__name__} has no serving checkpoint layout here; only LiLiCorrHead exports "
            "(as LiLiCorrDraftModel). Export the drafter alone with head=None"
        )
    if head is not None:
        _check_head_fits(head, drafter)
    output = check_output_dir(output, overwrite)
    # What is written, and its checks (weights that are not finite), before any folder is made.
    cfg, state = drafter_config(drafter, head, dtype), export_state(drafter, head, dtype, head_mlp_names)
    # One export at a time into a folder: two at once would each publish their two files, and the folder could end
    # with one's config and the other's weights (a reader refuses that pair, but the folder holds neither).
    with (folders_made(output, f"--output {output}", "export", ExportError) as created,
          _held_alone(output) as held):  # refused: the folder is another export's
        if not _still_at(output, held):  # another export that failed into it removed it, as one it had made
            remove_made_folders({f: i for f, i in created.items() if f != output})  # what is there now is not ours
            raise ExportError(f"--output {output}: the folder was removed as this export began (another export into "
                              "it failed and removed the folder it had made); run the export again")
        try:
            _check_contents(output, overwrite)  # again, held: another export may have finished into it since
            _export_into(cfg, state, output, extra)
        except BaseException:
            remove_made_folders(created)
            raise
    return output


def _still_at(output: Path, held: os.stat_result | None) -> bool:
    """Whether the folder held (``held``: its stat; None, nothing held) is still the one at ``output``."""
    now = folder_identity(output)
    return now is not None and (held is None or now == (held.st_dev, held.st_ino))


@contextlib.contextmanager
def _held_alone(output: Path) -> Iterator[os.stat_result | None]:
    """``output`` held by this export alone while the block runs (yields its stat, None where it cannot be held), or
    one line saying another export holds it."""
    try:
        with folder_held_alone(output, f"--output {output}: another lilicorr export is writing into it; wait for it "
                                       "to finish, or choose another directory") as held:
            yield held
    except InUseError as err:
        raise ExportError(str(err)) from None


def _export_into(cfg: dict[str, Any], state: dict[str, torch.Tensor], output: Path,
                 extra: dict[str, Any] | None) -> None:
    """:func:`export_drafter`'s writing of ``cfg`` and ``state``, with ``output`` made and held: the files under
    temporary names inside it, then renamed into place."""
    # The temporary files live inside the destination (same filesystem: each rename is atomic).
    tmp = Path(tempfile.mkdtemp(prefix=_EXPORT_TMP, suffix=f".{writer_tag()}.tmp", dir=output))
    try:
        # Every export says it is one (what --overwrite may replace; a released drafter has no such key).
        # One id in both files: the two renames into place are two steps, and a reader holding the config of one
        # export and the weights of another (an --overwrite killed between them) is told so (read_weights). The id is
        # a digest of what is exported, so the same weights and config export to the same bytes.
        cfg[EXPORT_MARKER] = {"version": __import__("lilicorr_pl").__version__, **(extra or {})}
        content = json.dumps(cfg, sort_keys=True).encode() + state_checksum(state).encode()
        cfg[EXPORT_MARKER][EXPORT_ID] = export_id = hashlib.sha256(content).hexdigest()[:32]
        files = {"config.json": tmp / "config.json", "model.safetensors": tmp / "model.safetensors"}
        files["config.json"].write_text(json.dumps(cfg, indent=2))
        save_file(state, str(files["model.safetensors"]), metadata={"format": "pt",
                                                                    f"{EXPORT_MARKER}.{EXPORT_ID}": export_id})
        _order_metadata(files["model.safetensors"])
        _publish(files, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(tmp, ignore_errors=True)  # our own temporary directory, empty by now


def read_config(directory: str | Path) -> dict[str, Any]:
    """``config.json`` of a serving checkpoint directory, refusing the old companion layout."""
    directory = Path(directory)
    old = [name for name in OLD_COMPANION_FILES if (directory / name).exists()]
    if old:
        raise ValueError(
            f"{directory} is an old lilicorr export ({' / '.join(old)} beside the drafter), which is no longer "
            "supported; re-export the training checkpoint: lilicorr export --ckpt RUN.ckpt --output NEW_DIR"
        )
    cfg_path, weights = directory / "config.json", directory / "model.safetensors"
    if directory.is_file() and directory.suffix == ".ckpt":  # a training checkpoint where a served drafter goes
        raise FileNotFoundError(
            f"{directory} is a training checkpoint, not a DFlash drafter directory; export it first (lilicorr export "
            f"--ckpt {directory} --output DIR) and pass DIR (to go on training that run: fit --ckpt_path)"
        )
    if not cfg_path.is_file() or not weights.is_file():
        raise FileNotFoundError(
            f"{directory} is not a DFlash drafter directory (needs config.json and model.safetensors)"
        )
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{cfg_path} is not valid JSON ({type(err).__name__}); is it a damaged export? re-export "
                         "it") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path} holds a JSON {type(cfg).__name__}, not a model config; re-export it")
    problem = _dflash_config_problem(cfg.get("dflash_config"))
    if problem:
        raise ValueError(f"{cfg_path}: dflash_config {problem}; is it a damaged export? re-export it")
    return cfg


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _dflash_config_problem(dflash: Any) -> str | None:
    """What is wrong with a serving config's ``dflash_config`` for the loaders that read it (None: nothing): a
    mapping, its layer ids a non-empty list of integers, its mask token an integer (they were tracebacks: ``'list'
    object has no attribute 'get'``, ``int() argument must be … not 'NoneType'``, ``max() arg is an empty
    sequence``)."""
    if dflash is None:
        return None
    if not isinstance(dflash, dict):
        return f"is a JSON {type(dflash).__name__}, not an object"
    layer_ids = dflash.get("target_layer_ids")
    if layer_ids is not None and not (isinstance(layer_ids, list) and layer_ids and all(map(_is_int, layer_ids))):
        return f"target_layer_ids is {json.dumps(layer_ids)}, not a non-empty list of integers"
    if "mask_token_id" in dflash and not _is_int(dflash["mask_token_id"]):
        return f"mask_token_id is {json.dumps(dflash['mask_token_id'])}, not an integer"
    if dflash.get("block_size") is not None and not _is_int(dflash["block_size"]):
        return f"block_size is {json.dumps(dflash['block_size'])}, not an integer"
    return None


def _require_sizes(cfg: dict[str, Any], cfg_path: Path) -> None:
    """A serving config's sizes, read by every loader: lacking, they were a KeyError or Qwen3Config's 4096-wide
    defaults filled in silently."""
    lacking = [key for key in ("num_hidden_layers", "hidden_size", "vocab_size") if not isinstance(cfg.get(key), int)]
    if lacking:
        raise ValueError(f"{cfg_path} lacks {lacking} (or they are not integers); is it a DFlash drafter config?")


def _block_size(cfg: dict[str, Any]) -> int | None:
    block_size = cfg.get("block_size", (cfg.get("dflash_config") or {}).get("block_size"))
    return None if block_size is None else int(block_size)


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a serving directory's ``model.safetensors``, read once for :func:`load_drafter` and
    :func:`load_head` (each reads the file itself when not given it). A file that is not safetensors, and weights of
    another export than the config's (the id both files of one export carry), are one line each."""
    directory = Path(directory)
    marker = read_config(directory).get(EXPORT_MARKER)  # first: a folder without the two files is said so
    path = directory / "model.safetensors"
    try:
        with safe_open(str(path), framework="pt") as fh:  # what load_file does, with the metadata read in passing
            metadata = fh.metadata() or {}
            tensors = {key: fh.get_tensor(key) for key in fh.keys()}  # noqa: SIM118 - safe_open has no __iter__
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path} cannot be read as safetensors ({first_line(err)}); is it truncated? re-export "
                         "it") from None
    expected = marker.get(EXPORT_ID) if isinstance(marker, dict) else None
    found = metadata.get(f"{EXPORT_MARKER}.{EXPORT_ID}")
    # Weights re-saved by another tool (a cast, a save_pretrained) carry no id: nothing to compare them with.
    if expected is not None and found is not None and found != expected:
        raise ValueError(
            f"{directory}: config.json and model.safetensors come from two different exports (ids {expected} and "
            f"{found}: an export --overwrite stopped between its two renames?); export it again"
        )
    return tensors


def load_drafter(directory: str | Path, attention: str = "auto",
                 weights: Mapping[str, torch.Tensor] | None = None) -> DFlashDrafter:
    """Load the drafter of a ``DFlashDraftModel`` or ``LiLiCorrDraftModel`` directory (ours or released).

    Returns a built ``DFlashDrafter``; a LiLiCorr head in the same file is left out (see :func:`load_head`).
    ``weights``: the directory's tensors, already read (:func:`read_weights`).
    """
    from transformers import Qwen3Config

    directory = Path(directory)
    cfg = read_config(directory)
    cfg_path, weights_path = directory / "config.json", directory / "model.safetensors"
    dflash = cfg.get("dflash_config") or {}
    block_size = _block_size(cfg)
    layer_ids = dflash.get("target_layer_ids")
    _require_sizes(cfg, cfg_path)
    if block_size is None or layer_ids is None:
        raise ValueError(
            f"{cfg_path} lacks block_size or dflash_config.target_layer_ids; is it a DFlash drafter config?"
        )
    if cfg.get("num_target_layers") is not None and not _is_int(cfg["num_target_layers"]):
        raise ValueError(f"{cfg_path}: num_target_layers is {json.dumps(cfg['num_target_layers'])}, not an integer; "
                         "is it a damaged export? re-export it")
    # RoPE as the config states it: transformers 5 writes rope_parameters (theta and scaling in one), 4 rope_theta and
    # rope_scaling (rope_parameters was not read: such a drafter was built with theta 10000); given every key stated,
    # transformers resolves them as it does reading the config.
    rope = {k: cfg[k] for k in ("rope_theta", "rope_scaling", "rope_parameters") if cfg.get(k) is not None}
    rope = rope or {"rope_theta": 10000.0}
    target_like = Qwen3Config(
        **{k: cfg[k] for k in QWEN3_FIELDS if k in cfg},
        num_hidden_layers=int(cfg.get("num_target_layers", max(layer_ids) + 1)),
        **rope,
    )
    drafter = DFlashDrafter(
        num_layers=int(cfg["num_hidden_layers"]),
        block_size=block_size,
        mask_token_id=int(dflash.get("mask_token_id", 151669)),
        attention=attention,
    ).build(target_like, layer_ids)
    tensors = read_weights(directory) if weights is None else weights
    state = {k: v for k, v in tensors.items() if not k.startswith(HEAD_PREFIX)}
    built = drafter.state_dict()
    other = [k for k, v in state.items() if k in built and tuple(v.shape) != tuple(built[k].shape)]
    if other:  # torch's load raised a RuntimeError listing every tensor: one line, the first named with both shapes
        key = other[0]
        raise ValueError(f"{weights_path}: {len(other)} tensors do not have the shapes its config.json describes "
                         f"({key}: {list(state[key].shape)} in the file, {list(built[key].shape)} from the config); "
                         "check config.json's sizes (hidden_size, head_dim, num_attention_heads, intermediate_size, "
                         "...) against the weights, or re-export it")
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{weights_path}: keys do not match a DFlash drafter: missing {missing[:6]}, unexpected {unexpected[:6]}")
    dtype = next(iter(state.values())).dtype
    drafter = drafter.to(dtype)
    # What the config states of its target (compared with the target by check_compatible; defaults filled in here
    # are not the directory's word).
    drafter.served_config_keys = frozenset(cfg)
    return drafter


def _served_name(key: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """A ``lilicorr.*`` tensor (prefix stripped) in the named form and 5-d embedding shapes we build."""
    for old, new in _SEQUENTIAL_NAMES:
        key = key.replace(old, new)  # "feature_mlp.0." never contains ".mlp.0.": the forms cannot collide
    if key in ("slot_embedding", "rank_embedding") and tensor.dim() == 4:
        tensor = tensor.unsqueeze(1)  # TensorRT-LLM's squeezed [1, S, 1, D] / [1, 1, K, D]
    return key, tensor


def served_head(directory: str | Path) -> LiLiCorrHead | None:
    """The LiLiCorr head a ``LiLiCorrDraftModel`` directory's config describes, not built (no weights yet); None for
    a DFlash-only one. Rebuilt from ``dflash_config.lilicorr_*`` alone (none is defaulted: ``vector_eps`` and
    ``logit_scale`` change the scores without changing a shape)."""
    directory = Path(directory)
    cfg = read_config(directory)
    if LILICORR_ARCHITECTURE not in (cfg.get("architectures") or []):
        return None
    _require_sizes(cfg, directory / "config.json")
    dflash = cfg.get("dflash_config") or {}
    if dflash.get("lilicorr_enabled") is False:
        raise ValueError(f"{directory}/config.json declares {LILICORR_ARCHITECTURE} with lilicorr_enabled false")
    missing = [f"lilicorr_{f}" for f in HEAD_CONFIG_FIELDS if dflash.get(f"lilicorr_{f}") is None and f != "hidden_size"]
    if missing or _block_size(cfg) is None:
        raise ValueError(
            f"{directory}/config.json declares {LILICORR_ARCHITECTURE} but dflash_config lacks {missing or ['block_size']}; "
            "the head cannot be rebuilt without its geometry"
        )
    return LiLiCorrHead(
        top_k=int(dflash["lilicorr_candidate_topk"]),
        hidden_size=int(dflash.get("lilicorr_hidden_size") or cfg["hidden_size"]),  # 0/absent: the drafter's width
        num_layers=int(dflash["lilicorr_num_layers"]),
        num_heads=int(dflash["lilicorr_num_heads"]),
        mlp_ratio=float(dflash["lilicorr_mlp_ratio"]),
        factor_dim=int(dflash["lilicorr_factor_dim"]),
        vector_eps=float(dflash["lilicorr_vector_eps"]),
        logit_scale=float(dflash["lilicorr_logit_scale"]),
        block_size=_block_size(cfg),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
    )


def load_head(directory: str | Path, weights: Mapping[str, torch.Tensor] | None = None) -> LiLiCorrHead | None:
    """The LiLiCorr head of a ``LiLiCorrDraftModel`` directory, built and loaded; None for a DFlash-only one.

    The head is :func:`served_head`, and every ``lilicorr.*`` tensor must match it, in either MLP naming form.
    ``weights``: the directory's tensors, already read (:func:`read_weights`).
    """
    directory = Path(directory)
    head = served_head(directory)
    if head is None:
        return None
    cfg = read_config(directory)
    head = head.build(int(cfg["hidden_size"]), int(cfg["vocab_size"]))
    tensors = read_weights(directory) if weights is None else weights
    state = dict(_served_name(k[len(HEAD_PREFIX):], v) for k, v in tensors.items() if k.startswith(HEAD_PREFIX))
    weights_path = directory / "model.safetensors"
    expected = head.state_dict()
    missing_keys = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(state) & set(expected) if state[k].shape != expected[k].shape)
    if missing_keys or unexpected or wrong:
        raise ValueError(
            f"{weights_path}: the lilicorr.* tensors do not match the head its config.json describes (missing "
            f"{missing_keys[:4]}, unexpected {unexpected[:4]}, wrong shape {wrong[:4]}); check dflash_config.lilicorr_*"
        )
    head.load_state_dict(state)
    return head.to(next(iter(state.values())).dtype)


def check_compatible(drafter: DFlashDrafter, target_config: Any) -> None:
    """Raise when an imported drafter does not fit the target it is paired with."""
    problems = []
    if drafter.dims.hidden_size != target_config.hidden_size:
        problems.append(f"hidden_size {drafter.dims.hidden_size} vs target {target_config.hidden_size}")
    if max(drafter.target_layer_ids) >= target_config.num_hidden_layers:
        problems.append(f"target_layer_ids {drafter.target_layer_ids} vs {target_config.num_hidden_layers} target layers")
    if drafter.mask_token_id >= target_config.vocab_size:
        problems.append(f"mask_token_id {drafter.mask_token_id} vs {target_config.vocab_size} vocabulary rows")
    # What the directory says of its target, which an engine builds the drafter with (its RoPE, from its config.json)
    # and which the drafter here takes from the target: another value was measured or trained on without a word.
    served, stated = getattr(drafter, "target_config", None), getattr(drafter, "served_config_keys", frozenset())
    if served is not None:
        rope = bool(stated & {"rope_theta", "rope_parameters", "rope_scaling"})
        for name, said, mine, theirs in (
                ("vocab_size", "vocab_size" in stated, served.vocab_size, target_config.vocab_size),
                ("num_target_layers", "num_target_layers" in stated, served.num_hidden_layers,
                 target_config.num_hidden_layers),
                ("rope_theta", rope, _rope_theta(served), _rope_theta(target_config)),
                ("rope_scaling", rope, _rope_scaling(served), _rope_scaling(target_config)),
                # An engine builds the drafter's and the head's norms with it; here the drafter takes the target's.
                ("rms_norm_eps", "rms_norm_eps" in stated, served.rms_norm_eps,
                 getattr(target_config, "rms_norm_eps", 1e-6))):
            if said and mine != theirs:
                problems.append(f"its config.json's {name} {mine} vs the target's {theirs}")
    if problems:
        raise ValueError("the imported drafter does not match the target: " + "; ".join(problems))
