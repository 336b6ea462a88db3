"""``lilicorr export``: a trained checkpoint as the serving directory the engines load (layout: :mod:`.interop`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from lilicorr_pl.checkpoint import UserInputError, check_checkpoint_file, read_verified, verified_first
from lilicorr_pl.interop import (
    DFLASH_ARCHITECTURE,
    LILICORR_ARCHITECTURE,
    ExportError,
    check_output_dir,
    export_drafter,
)


def export(
    ckpt: str,
    output: str,
    trust_remote_code: bool = False,
    allow_module: Sequence[str] = (),
    overwrite: bool = False,
    target: str | None = None,
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto",
    head_mlp_names: Literal["named", "sequential"] = "named",
) -> Path:
    """Export a trained drafter as a serving checkpoint directory.

    DFlashDraftModel, or LiLiCorrDraftModel (drafter + LiLiCorr head in one model.safetensors) for SGLang,
    vLLM and TensorRT-LLM. The destination is checked before the checkpoint is opened; nothing the exporter
    did not write is ever deleted. Returns the directory.

    Args:
        ckpt: checkpoint written by `lilicorr fit`.
        output: output directory: new or empty (see overwrite).
        trust_remote_code: allow the target's own code (never taken from the checkpoint).
        allow_module: also trust components from these packages when the checkpoint names them.
        overwrite: allow a non-empty output; only the exported files are replaced, nothing else is touched.
        target: read the target from this directory or hub name instead of the one the checkpoint recorded (the
            same model, moved or cached elsewhere).
        dtype: every exported tensor's dtype, the config's torch_dtype; auto: the target's (model.target.dtype:
            bfloat16 for the Qwen3 recipes, whose bf16-mixed runs keep fp32 master weights).
        head_mlp_names: how the LiLiCorr head's MLP tensors are spelled: named (feature_norm,
            feature_mlp.up_proj, layers.<i>.mlp.up_proj, ...: what vLLM's current loader reads; SGLang and
            TensorRT-LLM read both) or sequential (Model-Optimizer's nn.Sequential indices, feature_mlp.1,
            layers.<i>.mlp.0, ...: for a loader that reads only those).
    """
    check_checkpoint_file(Path(ckpt))
    try:
        check_output_dir(output, overwrite)
    except ExportError as err:
        raise UserInputError(str(err)) from None
    from lilicorr_pl.builtin import builtin_name_of
    from lilicorr_pl.heads.lilicorr import LiLiCorrHead
    from lilicorr_pl.system import DraftSystem

    first = None
    if target is not None:
        from lilicorr_pl.builtin import is_builtin, resolve_target_option

        if is_builtin(target):  # its build may take minutes: a damaged checkpoint is named first
            first = read_verified(ckpt)[1]
        target = resolve_target_option(target)
    with verified_first(first):  # not hashed a second time
        system = DraftSystem.from_checkpoint(ckpt, map_location="cpu", trust_remote_code=trust_remote_code,
                                             allow_modules=list(allow_module),  # CheckpointError: one line
                                             target_path=target, load_target=False,  # the drafter and head only
                                             builtin_name=builtin_name_of)
    head = system.head if isinstance(system.head, LiLiCorrHead) else None
    if head is None and any(True for _ in system.head.parameters()):
        print(f"lilicorr export: note: {type(system.head).__name__} has no serving layout here; "
              "exporting the DFlash drafter alone", file=sys.stderr)
    from lilicorr_pl.target import last_layer_serving_note

    last = last_layer_serving_note(system.drafter.target_layer_ids, system.drafter.target_config.num_hidden_layers)
    if last:
        print(f"lilicorr export: note: {last}", file=sys.stderr)
    # Decoding options the layout has no field for: the engines, and bench --ckpt DIR, walk greedily over every
    # candidate.
    chosen = []
    if head is not None and head.decode != "greedy":
        chosen.append(f"decode: {head.decode}")
    if head is not None and head.serve_top_k not in (None, head.top_k):
        chosen.append(f"serve_top_k: {head.serve_top_k}")
    if chosen:
        print(f"lilicorr export: note: this checkpoint's head decodes with {', '.join(chosen)}, which the serving "
              f"layout does not record; the export is served (and measured by bench --ckpt DIR) with the greedy walk "
              f"over all {head.top_k} candidates", file=sys.stderr)
    from lilicorr_pl.target import resolve_dtype

    weights_dtype = resolve_dtype(system.target_spec.dtype if dtype == "auto" else dtype)
    try:
        out = export_drafter(system.drafter, output, head=head, extra={"target": system.target_spec.name_or_path},
                             overwrite=overwrite, dtype=weights_dtype, head_mlp_names=head_mlp_names)
    except ExportError as err:
        raise UserInputError(str(err)) from None
    kind = LILICORR_ARCHITECTURE if head is not None else DFLASH_ARCHITECTURE
    print(f"exported {kind} to {out} ({str(weights_dtype).removeprefix('torch.')})")
    # Not loaded, but its weight files are read (once per version: a memo) to say whether they are the ones the drafter
    # trained against, as an engine will serve it with them: after the export, whose own checks (weights that are not
    # finite) come first.
    system.warn_if_other_target({"lilicorr": system.checkpoint_meta}, "using it measures or serves")
    return out
