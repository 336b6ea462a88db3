"""The Lightning system: wires the frozen target, the DFlash drafter, a selector/head and losses.

The system computes nothing of its own: the drafter, head and losses are plain modules injected by
``class_path``; this module runs them in order, sums the weighted losses, updates metrics and logs.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import json
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.profilers import Profiler
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch.nn.parameter import is_lazy

# LightningCLI's record of the parsed config of the object being built (class_path/init_args of each injected
# part); private to Lightning, but the mechanism its CLI uses; from_checkpoint sets it the same way.
from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters, _given_hyperparameters_context

from lilicorr_pl.checkpoint import (
    CHECKSUM_KEY,
    RECORD_CHECKSUM_KEY,
    TRAINING_CHECKSUM_KEY,
    TRAINING_KEYS_KEY,
    CheckpointError,
    UserInputError,
    check_class_paths,
    check_remote_code,
    first_line,
    read_verified,
    record_checksum,
    state_checksum,
    training_state_checksum,
    training_state_keys,
    verified_first,
    verify_checksum,
)
from lilicorr_pl.heads.base import HeadOutput, Selector, TeacherForcing
from lilicorr_pl.heads.domino import as_trained, first_form_refusal
from lilicorr_pl.heads.top1 import Top1Selector
from lilicorr_pl.losses.base import LossComponent, LossInputs
from lilicorr_pl.losses.dflash import DFlashCE
from lilicorr_pl.losses.diagnostics import lattice_diagnostics, valid_block_mean
from lilicorr_pl.metrics import LatticeMetrics
from lilicorr_pl.models.dflash import ContextMemo, DFlashDrafter, DraftOutput, block_labels, sample_anchors
from lilicorr_pl.optim import WarmupCosine
from lilicorr_pl.target import (
    FrozenTarget,
    TargetSpec,
    builtin_artifact,
    builtin_copy_here,
    check_layer_ids,
    default_layer_ids,
    local_target_path,
    portable,
    refuse_builtin_name,
    refuse_drafter,
    unreadable_target,
)

if TYPE_CHECKING:
    from lilicorr_pl.heads.lilicorr import LiLiCorrHead

TARGET_PREFIX = "target."
# Profiler action names of the step's phases: "[DraftSystem]target", "[DraftSystem]drafter", "[DraftSystem]head",
# "[DraftSystem]losses" (next to Lightning's own "[LightningModule]DraftSystem.training_step").
PHASE_PREFIX = "[DraftSystem]"
STEP_PHASES = ("target", "drafter", "head", "losses")


def plain_data(value: Any) -> Any:
    """Hyperparameters as plain JSON-like data (jsonargparse Namespaces and tuples unwrapped), for comparison."""
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    if isinstance(value, Mapping):
        return {str(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_data(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain_data(dataclasses.asdict(value))
    if (inspect.isfunction(value) or isinstance(value, type)) and getattr(value, "__module__", None):
        # A default factory (model.optimizer's) is the function itself in a run and its import path in the checkpoint's
        # config record: compared as the path, or a resume of a run that left it at its default is refused.
        return f"{value.__module__}.{value.__qualname__}"
    return value


def _target_identity(spec: Any) -> tuple[Any, ...]:
    spec = spec or {}
    # The feature count picks the layers only without a list (a run before lilicorr refused a disagreeing one
    # recorded both, and is resumed with the count dropped).
    count = spec.get("num_features") if spec.get("layer_ids") is None else None
    # A built-in target by its build's key-bearing name: the same build in another machine's cache folder.
    return (portable(spec.get("name_or_path")), spec.get("dtype"), spec.get("layer_ids"), count)


# Decoder-only causal LMs with the Llama/Qwen layout (model.layers, model.norm, RoPE) that the drafter reads.
SUPPORTED_TARGET_TYPES = ("qwen3", "qwen3_moe", "qwen2", "qwen2_moe", "llama", "mistral", "mixtral")

# Settings that define what the weights (and the restored optimizer state) mean: resuming with other values
# would train a different model on top of these weights, or fail on shapes. Other settings are applied.
# Constructor arguments that are modules: recorded as their configs, never as objects.
INJECTED_MODULES = ("drafter", "head", "losses")
RESUME_FIXED_KEYS = ("target", "drafter", "head", "optimizer", "lr_scheduler",
                     "freeze_drafter")  # which parameters train: the optimizer state holds exactly those
_RESUME_IGNORED_KEYS = ("_instantiator", "init_drafter_from", "init_head_from", "init_drafter_layers_from_target",
                        "context_memo_mb")  # a speed setting: the same numbers either way


def _without_kernel(spec: Any) -> Any:
    """A module's recorded config without its attention kernel (``init_args.attention``)."""
    if isinstance(spec, dict) and isinstance(spec.get("init_args"), dict) and "attention" in spec["init_args"]:
        return {**spec, "init_args": {k: v for k, v in spec["init_args"].items() if k != "attention"}}
    return spec


def check_resume_settings(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Compare a checkpoint's model settings with this run's: raise on fixed keys, return the applied changes."""
    saved, current = plain_data(dict(saved)), plain_data(dict(current))
    if "head" in saved:  # a Domino head of the first form records none of the options that now say so
        saved["head"] = as_trained(saved["head"])
    differing = sorted(k for k in set(current) | set(saved)
                       if k not in _RESUME_IGNORED_KEYS and current.get(k) != saved.get(k))
    if "target" in differing and _target_identity(current.get("target")) == _target_identity(saved.get("target")):
        differing.remove("target")  # only how it is loaded changed (e.g. load_kwargs), not which target
    # The attention kernel of the drafter or head (auto, sdpa, flex, ...) is how it computes, not what: the same weights
    # go on training (a run pinned to flex resumes on a machine without it); applied and listed, as validate takes it.
    refused = [k for k in differing if k in RESUME_FIXED_KEYS
               and not (k in INJECTED_MODULES and _without_kernel(saved.get(k)) == _without_kernel(current.get(k)))]
    if refused:
        detail = "; ".join(f"model.{path}: checkpoint {_short(was)} vs now {_short(now)}"
                           for k in refused for path, was, now in _differences(saved.get(k), current.get(k), k)[:3])
        raise CheckpointError(
            f"cannot resume: the checkpoint was trained with other {', '.join(refused)} settings ({detail}); "
            "resume with the checkpoint's settings, or start a new run (to start from its weights: `lilicorr export` "
            "it, then model.init_drafter_from / model.init_head_from the exported directory)"
        )
    return [f"model.{k}: {_short(saved.get(k))} -> {_short(current.get(k))}" for k in differing]


# What the validation split is drawn from when no data.val_files are given (DraftDataModule.setup): other values
# draw another split from the same examples, part of which the checkpoint trained on (max_length: records left without
# a supervised token are dropped, and packing follows it; the chat template and its thinking flag render the records
# into other token counts, so other records are dropped). A smaller val_fraction alone keeps a subset of the split.
SPLIT_KEYS = ("val_fraction", "seed", "pack", "max_examples", "max_length", "enable_thinking", "chat_template")
# How a module computes, not what: the same numbers (the attention kernel; dropout, off in evaluation).
_COMPUTE_ONLY = ("attention", "dropout")


def edited_files(recorded: Sequence[Mapping[str, Any]] | None, now: Sequence[Mapping[str, Any]] | None) -> list[str]:
    """The names of the files, of the same list, whose content (bytes, sha256) is not the recorded one
    (:func:`~lilicorr_pl.data.fingerprint.fingerprint_files`; nothing where either side is unknown or the lists
    differ in length)."""
    if not recorded or not now or len(recorded) != len(now):
        return []
    return [str(n.get("name")) for r, n in zip(recorded, now)
            if (r.get("bytes"), r.get("sha256")) != (n.get("bytes"), n.get("sha256"))]


def _split_changes(saved_data: Mapping[str, Any], current_data: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """The :data:`SPLIT_KEYS` whose values draw another validation split from the same files; a smaller
    ``val_fraction`` alone keeps the same permutation's first examples, a part of the same split."""
    if not saved_data.get("val_fraction") and not current_data.get("val_fraction"):
        return []  # no share of the training files validates, before or now: there is no split to redraw
    split = [(k, saved_data.get(k), current_data.get(k)) for k in SPLIT_KEYS
             if k in saved_data and saved_data.get(k) != current_data.get(k)
             and not (k == "chat_template" and _same_template(saved_data.get(k), current_data.get(k)))]
    if [k for k, *_ in split] == ["val_fraction"] and (current_data.get("val_fraction") or 0) <= (
            saved_data.get("val_fraction") or 0):
        return []
    return split


def _same_template(was: Any, now: Any) -> bool:
    """Whether two ``data.chat_template`` settings give the same template: the same text, inline or in a file under
    any path (a file no longer there: compared as given)."""
    from lilicorr_pl.data.formats import resolve_chat_template

    try:
        return was is not None and now is not None and resolve_chat_template(was) == resolve_chat_template(now)
    except (OSError, ValueError):
        return False


def _same_training_files(saved_data: Mapping[str, Any], current_data: Mapping[str, Any],
                         same_files: bool | None) -> bool:
    """Whether this run's training files are the checkpoint's: ``same_files`` where the caller compared their content
    with the checkpoint's record, else by their paths (built-in data by their key-bearing names)."""
    if same_files is not None:
        return same_files
    return saved_data.get("train_files") == current_data.get("train_files")


def check_resume_split(saved_data: Mapping[str, Any], current_data: Mapping[str, Any], ckpt: Any,
                       edited: Sequence[str] = (), same_files: bool | None = None) -> None:
    """A resumed fit validates on the split its steps so far were validated on: raise (one line) where this run splits
    its validation examples off the training files in another way (other files, other split settings, training files
    ``edited`` in place since, held-out files dropped): that split may validate on examples those steps trained on.
    ``same_files``: whether the training files hold the content the checkpoint recorded (None: compared by path).
    Held-out files (``data.val_files``) now: any split is the run's own choice."""
    saved_data, current_data = portable(plain_data(dict(saved_data))), portable(plain_data(dict(current_data)))
    if not saved_data or current_data.get("val_files"):
        return
    was, now = saved_data.get("train_files"), current_data.get("train_files")
    if saved_data.get("val_files"):
        changes = [f"data.val_files: checkpoint {_short(saved_data.get('val_files'), 80)} vs now none"]
    elif edited:
        changes = [f"data.train_files: {name} edited since the checkpoint" for name in edited]
    elif not _same_training_files(saved_data, current_data, same_files):
        changes = [f"data.train_files: checkpoint {_short(was, 80)} vs now {_short(now, 80)}"]
    else:
        changes = [f"data.{k}: checkpoint {_short(a)} vs now {_short(b)}" for k, a, b in _split_changes(saved_data,
                                                                                                     current_data)]
    if changes:
        raise CheckpointError(
            f"cannot resume --ckpt_path {ckpt} with another validation split ({'; '.join(changes[:3])}): it may "
            "validate on examples the steps so far trained on; resume with the checkpoint's data settings and files, "
            "or validate on held-out files (data.val_files)"
        )


def check_evaluation_settings(saved: Mapping[str, Any], current: Mapping[str, Any], saved_data: Mapping[str, Any],
                              current_data: Mapping[str, Any], ckpt: Any, subcommand: str,
                              edited: Sequence[str] = (), same_files: bool | None = None) -> None:
    """``validate``/``predict`` measure a checkpoint as it was trained: raise (one line) where this run's drafter or
    head settings, the target layers the drafter reads, or the validation split differ from the checkpoint's. The
    losses, the target's place and dtype and other data files are the measurement's own choice (recorded in its
    ``<subcommand>-config.yaml``). Only values both sides state are compared: an option the checkpoint predates, or
    one left to be derived (None), is not a difference; a shape that still differs is named when the weights load.
    ``edited``: the training files, under the paths the checkpoint trained on, whose content is not what it recorded
    (:func:`edited_files`); ``same_files``: whether the training files hold the content it recorded (None: compared by
    path)."""
    saved, current = plain_data(dict(saved)), plain_data(dict(current))
    if "head" in saved:
        saved["head"] = as_trained(saved["head"])
    found: list[tuple[str, Any, Any]] = []
    for key in ("drafter", "head"):
        if key in saved and saved.get(key) != current.get(key):
            found += [(path, was, now) for path, was, now in _differences(saved.get(key), current.get(key), key)
                      if was is not None and now is not None and path.rsplit(".", 1)[-1] not in _COMPUTE_ONLY]
    target_was, target_now = saved.get("target") or {}, current.get("target") or {}
    listed = (target_was.get("layer_ids") is not None, target_now.get("layer_ids") is not None)
    # Both listed: the lists; neither: how many the default rule reads; one listed: known only once the target loads.
    key = {(True, True): "layer_ids", (False, False): "num_features"}.get(listed)
    if key is not None:
        was, now = target_was.get(key), target_now.get(key)
        if was is not None and now is not None and was != now:
            found.append((f"target.{key}", was, now))
    if found:
        detail = "; ".join(f"model.{path}: checkpoint {_short(was)} vs now {_short(now)}" for path, was, now in found[:3])
        raise CheckpointError(
            f"--ckpt_path {ckpt} was trained with other settings ({detail}); lilicorr {subcommand} measures a checkpoint "
            "as it was trained: pass its run's settings (-c <its run>/config.yaml), or measure decoding options with "
            "lilicorr bench (--walk, --lattice_k)"
        )
    # Built-in data files by their key-bearing names: the same files in another machine's cache folder are the same
    # training data (compared by path, a split off them was taken for other data, and measured examples it trained on).
    saved_data, current_data = portable(plain_data(dict(saved_data))), portable(plain_data(dict(current_data)))
    if not saved_data or current_data.get("val_files"):
        return  # held-out files: the measurement's own data
    if edited:  # the same paths, other contents: a split of them is not the checkpoint's
        raise CheckpointError(
            f"--ckpt_path {ckpt} trained on data.train_files whose content has changed since ({', '.join(edited[:3])} "
            f"edited), so this {subcommand} would measure a split of them that may hold examples it trained on; "
            "restore the files it trained on, or measure held-out files with data.val_files"
        )
    if not _same_training_files(saved_data, current_data, same_files):
        return  # other training files: the measurement's own data
    if saved_data.get("val_files"):  # it held out files; now a share of the files it trained on is split off
        raise CheckpointError(
            f"--ckpt_path {ckpt} was validated on data.val_files {_short(saved_data.get('val_files'), 80)} and trained on "
            f"every example of data.train_files, so this {subcommand} would measure it on examples it trained on; pass "
            "the same data.val_files (or other held-out files)"
        )
    split = _split_changes(saved_data, current_data)
    if split:
        detail = "; ".join(f"data.{k}: checkpoint {_short(was)} vs now {_short(now)}" for k, was, now in split)
        raise CheckpointError(
            f"--ckpt_path {ckpt} trained beside another validation split of the same data.train_files ({detail}), so "
            f"this {subcommand} would measure it on examples it trained on; use the checkpoint's values, or measure "
            "other data with data.val_files"
        )


def _same_target_here(recorded: str, builtin_name: Callable[[str], str | None] | None) -> str:
    """How to name a recorded target that is not on this machine: the ``builtin:`` name whose build here has the
    recorded build's key, where it is one (``builtin_name``: the command's rule, builtin.builtin_name_of)."""
    name = builtin_name(recorded) if builtin_name is not None else None
    return (f"pass --target {name}, which builds a target of the same build key here" if name else
            "pass the same target model's directory or hub name (--target)")


def _differences(saved: Any, current: Any, path: str) -> list[tuple[str, Any, Any]]:
    """The leaves where two settings differ, as ``(dotted path, saved, current)``: a whole head config printed to 160
    characters could end before the field that differs."""
    if isinstance(saved, Mapping) and isinstance(current, Mapping) and \
            saved.get("class_path", None) == current.get("class_path", None):
        found = []
        for key in sorted(set(saved) | set(current), key=str):
            if saved.get(key) != current.get(key):
                found += _differences(saved.get(key), current.get(key), f"{path}.{key}")
        return found or [(path, saved, current)]
    return [(path, saved, current)]


def _short(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_EXTRA_STATE_SUFFIX = "_extra_state"  # nn.Module's key for a module's get_extra_state(): not a tensor to shape-check


class StateMismatchError(RuntimeError):
    """A state dict whose keys or tensor shapes are not this system's (another drafter/head config, or another
    target's sizes); a ``RuntimeError``, as ``nn.Module.load_state_dict`` raises for the same problems. ``keys``:
    whether tensor names differ (a config's doing; a target changes only shapes)."""

    def __init__(self, message: str, keys: bool = False) -> None:
        super().__init__(message)
        self.keys = keys


# Set by DraftSystem.from_checkpoint(load_target=False): Lightning's load_from_checkpoint calls configure_model, which
# then leaves the target for DraftSystem.load_target.
_target_deferred: contextvars.ContextVar[bool] = contextvars.ContextVar("lilicorr_target_deferred", default=False)


@contextlib.contextmanager
def _rebuild_errors(path: Path, named: str) -> Iterator[None]:
    """A target that cannot be loaded, or does not fit the checkpoint's weights: one line naming both."""
    try:
        yield
    except (ValueError, RuntimeError, OSError) as err:
        if isinstance(err, UserInputError):  # already one line, naming its fix
            raise
        if isinstance(err, RuntimeError) and not isinstance(err, StateMismatchError):
            raise  # not about the target (out of memory, a bug): as it is
        first = first_line(err)
        if isinstance(err, StateMismatchError) and err.keys:  # names, not sizes: no target makes them match
            raise CheckpointError(
                f"checkpoint {path} holds tensors that the drafter/head config it records does not build "
                f"({first.removeprefix('checkpoint does not match the system: ').split('; was it')[0]}); it was "
                "edited, or written by another version of lilicorr_pl: use a checkpoint `lilicorr fit` wrote with "
                "this version") from err
        raise CheckpointError(f"checkpoint {path} cannot be rebuilt with {named} ({first}); pass the target "
                              "model it was trained with (--target)") from err


def _default_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=6e-4, weight_decay=0.0)


def update_weighted(mean: Any, value: torch.Tensor, weight: int) -> None:
    """``mean.update(value, weight)`` as it reads, for a ``MeanMetric(nan_strategy="disable")``: torchmetrics 1.9
    replaces the weights by ones in that mode (torchmetrics#3434), so the value is given once per example instead (a
    NaN still shows in the mean)."""
    mean.update(value.detach().float().reshape(1).expand(int(weight)))


class DraftSystem(L.LightningModule):
    """Trains a DFlash drafter (and optionally a lattice head) against a frozen target.

    Args:
        target: how to load the frozen target (path, dtype, layer ids). Its weights are loaded in
            ``configure_model`` and never saved in checkpoints.
        drafter: the DFlash drafter; sizes left unset are derived from the target config.
        head: the selector used at inference and, for lattice heads, trained with the lattice losses.
            None = vanilla DFlash (per-slot top-1).
        losses: loss components summed with their weights. Default: ``DFlashCE`` only.
        num_anchors: blocks drawn per sequence and step (512 in the published recipe).
        response_start_anchors: in training, the probability per sequence and step that one of its anchors is a
            response's first token: the block every generation drafts first, right after the prompt, which uniform
            draws (the published recipe, 0) reach once per response length. Validation keeps uniform draws.
        optimizer: optimizer factory over the trainable parameters.
        lr_scheduler: scheduler factory; ``WarmupCosine`` gets its length from the Trainer.
        target_logits: where the distractor penalty reads target logits: ``"cache"`` (the data
            module's precomputed top-M cache), ``"exact"`` (candidate-restricted logits from the online
            target: ``K + 1`` dot products per slot, no approximation) or ``"auto"`` (exact when the
            target runs online this step, the cache in offline mode, i.e. with the feature cache).
        max_length: longest training sequence (linked from ``data.max_length``); checked against the
            target's ``max_position_embeddings``.
        disabled_losses: names of loss components to drop (ablation flags, e.g.
            ``[distractor_penalty]``); an unknown name is an error.
        loss_weights: per-name weight overrides (e.g. ``{margin_hinge: 0.125}`` for the margin variant).
        init_drafter_from: warm start the drafter from a checkpoint directory in the serving layout:
            a z-lab ``DFlashDraftModel`` (ours or released) or a ``LiLiCorrDraftModel`` (what
            ``lilicorr export`` writes). Only the drafter's weights load; a head in the same
            directory is left alone unless ``init_head_from`` names it too.
        init_head_from: warm start the LiLiCorr head from a ``LiLiCorrDraftModel`` directory (its
            ``lilicorr.*`` tensors). ``model.head`` must be a ``LiLiCorrHead`` with the directory's
            geometry (``dflash_config.lilicorr_*``). Set both to the same directory to continue a
            served checkpoint; set only ``init_drafter_from`` (with ``freeze_drafter``) to train a
            fresh head on a fixed drafter; set only this one to reuse a head on another drafter.
        freeze_drafter: keep the drafter fixed and train only the head.
        init_drafter_layers_from_target: start drafter layer ``i`` (and its final norm) from the target's
            decoder layer ``L − n + i`` (its top ``n`` layers), read from the target's safetensors; the context
            projection stays random. Needs the drafter at the target's sizes. Applied before
            ``init_drafter_from`` (which then wins) and only when the system is built, so a checkpoint's
            trained weights always replace it.
        context_memo_mb: with ``freeze_drafter``, keep the frozen drafter's per-example context work (fused
            features, every layer's context K/V) in memory up to this many MiB and reuse it whenever the example
            comes back (:class:`~lilicorr_pl.models.dflash.ContextMemo`): the same numbers, computed once per
            example instead of once per visit. Features from the store or from the online target alike (a frozen
            target's features depend only on the sequence; the online target itself still runs every step, for
            ``target_logits: exact``). 0 = off.
    """

    def __init__(
        self,
        target: TargetSpec,
        drafter: DFlashDrafter,
        head: Selector | None = None,
        losses: list[LossComponent] | None = None,
        num_anchors: int = 512,
        response_start_anchors: float = 0.0,
        optimizer: OptimizerCallable = _default_optimizer,
        lr_scheduler: LRSchedulerCallable | None = WarmupCosine,
        target_logits: Literal["auto", "cache", "exact"] = "auto",
        max_length: int | None = None,
        disabled_losses: list[str] | None = None,
        loss_weights: dict[str, float] | None = None,
        init_drafter_from: str | None = None,
        init_head_from: str | None = None,
        freeze_drafter: bool = False,
        init_drafter_layers_from_target: bool = False,
        context_memo_mb: float = 0.0,
    ) -> None:
        super().__init__()
        if isinstance(target, TargetSpec):
            # Stored as a plain dict: checkpoints then load with torch.load(weights_only=True).
            target = dataclasses.asdict(target)
        spec = TargetSpec(**target)
        if target_logits not in ("auto", "cache", "exact"):
            raise ValueError(f"target_logits must be 'auto', 'cache' or 'exact', got {target_logits!r}")
        if num_anchors < 1:
            raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
        if not 0.0 <= response_start_anchors <= 1.0:
            raise ValueError(f"model.response_start_anchors is a probability in [0, 1], got {response_start_anchors}")
        if context_memo_mb < 0:
            raise ValueError(f"model.context_memo_mb must be >= 0 (0 = off), got {context_memo_mb}")
        if context_memo_mb > 0 and not freeze_drafter:
            raise ValueError("model.context_memo_mb reuses a frozen drafter's context work; it needs "
                             "model.freeze_drafter: true (or set context_memo_mb: 0)")
        if max_length is not None and drafter.block_size > max_length:
            raise ValueError(
                f"model.drafter.block_size {drafter.block_size} exceeds data.max_length {max_length}: no block fits in "
                "a training sequence; lower the block size or raise data.max_length"
            )
        # Hyperparameters are plain data, never the injected modules (their weights are in the state dict).
        # Built by jsonargparse (LightningCLI, from_checkpoint) they are the parsed class_path/init_args configs,
        # which load_from_checkpoint rebuilds; built in Python, the modules are left out (pass them to
        # load_from_checkpoint).
        self.save_hyperparameters(ignore=[] if _given_hyperparameters.get() is not None else list(INJECTED_MODULES))
        self.target_spec = spec
        target = spec
        self.num_anchors = num_anchors
        self.response_start_anchors = response_start_anchors
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        self.target_logits_mode = target_logits
        self.losses = torch.nn.ModuleList(
            self._apply_loss_flags(losses if losses is not None else [DFlashCE()], disabled_losses, loss_weights)
        )
        self._check_losses(head, disabled_losses)

        from transformers import AutoConfig

        # `builtin:` names are resolved by the `lilicorr` command before anything is built: a constructor never
        # starts the built-in target's build.
        refuse_builtin_name(target.name_or_path, "model.target.name_or_path")
        path = target.name_or_path
        self.target_path = path
        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=target.trust_remote_code)
        except (OSError, ValueError) as err:
            raise ValueError(unreadable_target(target.name_or_path, "model.target.name_or_path", err)) from None
        refuse_drafter(config, target.name_or_path, "model.target.name_or_path")
        if getattr(config, "model_type", None) not in SUPPORTED_TARGET_TYPES:
            raise ValueError(
                f"model.target {target.name_or_path!r} is a {getattr(config, 'model_type', '?')!r} model; lilicorr_pl "
                f"supports decoder-only Llama/Qwen-style targets ({', '.join(SUPPORTED_TARGET_TYPES)})"
            )
        n_layers = config.num_hidden_layers
        layer_ids = (check_layer_ids(target.layer_ids, n_layers, target.num_features) if target.layer_ids is not None
                     else default_layer_ids(n_layers, min(target.num_features, n_layers)))
        if max_length is not None and max_length > getattr(config, "max_position_embeddings", max_length):
            raise ValueError(
                f"data.max_length {max_length} exceeds the target's max_position_embeddings "
                f"{config.max_position_embeddings}; lower data.max_length (or extend RoPE, e.g. YaRN)"
            )
        self.drafter = drafter.build(config, layer_ids)
        self.head = (head or Top1Selector()).build(
            config.hidden_size, config.vocab_size,
            block_size=self.drafter.block_size, rms_norm_eps=self.drafter.dims.rms_norm_eps,
        )
        if init_drafter_layers_from_target:
            from lilicorr_pl.models.target_init import init_drafter_from_target_layers

            init_drafter_from_target_layers(self.drafter, path)
        if init_drafter_from:
            self._warm_start(init_drafter_from, config)
        if init_head_from:
            self._warm_start_head(init_head_from)
        if freeze_drafter:
            if not any(p.requires_grad for p in self.head.parameters()):
                raise ValueError("freeze_drafter=True with a parameter-free head leaves nothing to train")
            self.drafter.requires_grad_(False)
        self.target: FrozenTarget | None = None
        self.context_memo = ContextMemo(int(context_memo_mb * 2**20)) if context_memo_mb > 0 else None
        self.train_metrics = LatticeMetrics(num_slots=drafter.num_slots, top_k=self._top_k())
        self.val_metrics = LatticeMetrics(num_slots=drafter.num_slots, top_k=self._top_k())
        # Times the step's phases when no Trainer is attached (lilicorr perf); under a Trainer, trainer.profiler does.
        self.profiler: Profiler | None = None
        self.checkpoint_meta: dict[str, Any] = {}
        self.checkpoint_step: int | None = None  # from_checkpoint: the global step it was written at
        # from_checkpoint / from_export: the file or directory rebuilt, and how its target was named (for messages)
        self._checkpoint_origin: tuple[Path | None, str | None] = (None, None)
        self._run_total_steps: int | None = None  # trainer.estimated_stepping_batches of the fit (curricula)
        self.checked_target: dict[str, Any] | None = None  # validate/test/predict: the target compared with the ckpt's
        self._trained_against: list[dict[str, Any]] | None = None  # a resumed fit: the targets its steps trained against
        # A resumed fit: the training metrics of the checkpoint's epoch so far (restored where the data go on inside
        # that epoch), and whether the first epoch after the resume has them (else its epoch means are not logged).
        self._resumed_train_metrics: dict[str, Any] | None | bool = False
        self._partial_data_epoch: int | None = None  # the data's epoch that resumed without its earlier sums
        self._ended_epoch_record: dict[str, Any] | None = None  # the sums of the epoch that ended last

    @staticmethod
    def _apply_loss_flags(
        losses: list[LossComponent], disabled: list[str] | None, weights: dict[str, float] | None
    ) -> list[LossComponent]:
        names = [loss.name for loss in losses]
        for flag, requested in (("disabled_losses", disabled or []), ("loss_weights", list(weights or {}))):
            unknown = sorted(set(requested) - set(names))
            if unknown:
                raise ValueError(f"model.{flag} names {unknown}, but the configured losses are {names}")
        for loss in losses:
            if weights and loss.name in weights:
                w = float(weights[loss.name])
                if not (math.isfinite(w) and w >= 0):  # nan or inf: the loss was nan or inf, and the run exited 0
                    raise ValueError(f"model.loss_weights[{loss.name}] must be a finite number >= 0, got {w}")
                loss.weight = w
        return [loss for loss in losses if loss.name not in set(disabled or [])]

    def _warm_start(self, directory: str, config: Any, loaded: DFlashDrafter | None = None) -> None:
        """The drafter's weights from a serving directory (``loaded``: its drafter, already read)."""
        from lilicorr_pl.interop import check_compatible, load_drafter

        loaded = load_drafter(directory) if loaded is None else loaded
        check_compatible(loaded, config)
        ours, theirs = self.drafter.state_dict(), loaded.state_dict()
        bad = sorted(k for k in set(ours) | set(theirs) if k not in theirs or k not in ours
                     or theirs[k].shape != ours[k].shape)
        differ = [f"{name} {mine} vs the directory's {its}" for name, mine, its in (
            ("num_layers", self.drafter.num_layers, loaded.num_layers),
            ("block_size", self.drafter.block_size, loaded.block_size),
            ("target layer ids", list(self.drafter.target_layer_ids), list(loaded.target_layer_ids)),
            # The MASK row the slots were trained to read (no tensor shows it: another id trained on silently).
            ("mask_token_id", self.drafter.mask_token_id, loaded.mask_token_id),
        ) if mine != its]
        if bad and not differ:
            differ = [f"tensors {bad[:4]}"]
        if differ:
            raise ValueError(
                f"model.init_drafter_from={directory} does not match model.drafter ({'; '.join(differ)}); set "
                "num_layers, block_size, target layer ids and mask_token_id to the released drafter's config.json"
            )
        self.drafter.load_state_dict({k: v.to(ours[k].dtype) for k, v in theirs.items()})

    def _warm_start_head(self, directory: str, loaded: LiLiCorrHead | None = None) -> None:
        """The LiLiCorr head's weights from a serving directory (``loaded``: its head, already read)."""
        from lilicorr_pl.heads.lilicorr import LiLiCorrHead
        from lilicorr_pl.interop import head_geometry, load_head

        if not isinstance(self.head, LiLiCorrHead):
            raise ValueError(
                f"model.init_head_from={directory} loads a LiLiCorr head, but model.head is "
                f"{type(self.head).__name__}; set model.head to lilicorr_pl.heads.LiLiCorrHead"
            )
        loaded = load_head(directory) if loaded is None else loaded
        if loaded is None:
            raise ValueError(
                f"model.init_head_from={directory} holds no LiLiCorr head (its config.json is not a "
                "LiLiCorrDraftModel); use model.init_drafter_from for a DFlash-only directory"
            )
        ours, theirs = head_geometry(self.head), head_geometry(loaded)
        theirs["target_hidden_size"], ours["target_hidden_size"] = loaded.target_hidden_size, self.head.target_hidden_size
        diff = [f"{k}: {ours[k]} here vs {theirs[k]} there" for k in ours if ours[k] != theirs[k]]
        if diff:
            raise ValueError(
                f"model.init_head_from={directory} does not match model.head ({'; '.join(diff)}); set "
                "model.head.init_args to the directory's dflash_config.lilicorr_* values"
            )
        mine = self.head.state_dict()
        self.head.load_state_dict({k: v.to(mine[k].dtype) for k, v in loaded.state_dict().items()})

    def _top_k(self) -> int:
        return int(self.head.top_k)

    def _check_losses(self, head: Selector | None, disabled: list[str] | None = None) -> None:
        names = [loss.name for loss in self.losses]
        dupes = {n for n in names if names.count(n) > 1}
        if dupes:
            raise ValueError(f"two loss components share the log name(s) {sorted(dupes)}; pass name=... to one")
        if not self.losses:
            raise ValueError("model.losses is empty; add at least lilicorr_pl.losses.DFlashCE")
        lattice_needed = [l.name for l in self.losses if l.requires_lattice]
        # Two overlays that each disable losses: the later list replaces the earlier (dflash_only, then no_distractor).
        replaced = (f"; model.disabled_losses is {list(disabled)}: a list set again by a later -c file or option "
                    "replaces the earlier one, so name every loss to disable in the last") if disabled else ""
        if lattice_needed and (head is None or not head.uses_lattice):
            raise ValueError(
                f"loss components {lattice_needed} need a lattice head, but model.head is "
                f"{type(head).__name__ if head else None}; set model.head to lilicorr_pl.heads.LiLiCorrHead "
                f"or drop those losses (see configs/ablations/dflash_only.yaml){replaced}"
            )

        corrector_needed = [l.name for l in self.losses if l.requires_corrector]
        if corrector_needed and (head is None or not head.uses_corrector):
            raise ValueError(
                f"loss components {corrector_needed} need a corrector head, but model.head is "
                f"{type(head).__name__ if head else None}; set model.head to lilicorr_pl.heads.DominoHead or DSparkHead"
            )

    def untrained_part(self, resuming: bool) -> str | None:
        """What a fit would leave at its random initialisation, as a one-line refusal naming the fix (None: nothing).
        A head with weights that no active loss trains (its losses disabled or weighted 0) stayed random, and bench
        then measured it; a frozen drafter with no warm start stayed random under the head trained on it. A resume
        (``resuming``) or a warm start brings those weights from elsewhere."""
        hp = self.hparams
        if resuming:
            return None
        trains = "requires_lattice" if self.head.uses_lattice else "requires_corrector" if self.head.uses_corrector \
            else None
        if trains and any(p.requires_grad for p in self.head.parameters()) and not hp.get("init_head_from") and not any(
                getattr(loss, trains) and loss.weight > 0 for loss in self.losses):
            kind = "lattice" if trains == "requires_lattice" else "corrector"
            return (f"model.head {type(self.head).__name__} has weights that no active loss trains (no {kind} loss in "
                    f"model.losses is enabled with a weight > 0): it would stay at its random initialisation; enable "
                    "one (model.disabled_losses, model.loss_weights), warm-start it (model.init_head_from), or drop "
                    "the head (model.head: null, as configs/ablations/dflash_only.yaml)")
        if hp.get("freeze_drafter") and not hp.get("init_drafter_from") and not hp.get(
                "init_drafter_layers_from_target"):
            return ("model.freeze_drafter: true with no warm start keeps the drafter at its random initialisation, and "
                    "the head would learn to correct a random drafter; set model.init_drafter_from=<a served drafter "
                    "directory> (`lilicorr export` of a trained checkpoint), or model.freeze_drafter: false")
        return None

    @property
    def needs_target_logits(self) -> bool:
        """True when some active loss reads the target's logits."""
        return any(l.requires_target_logits and l.weight > 0 for l in self.losses)

    def check_offline_features(self, offline_features: bool) -> None:
        """Refuse offline features (no target in training) when an active loss reads the target's full distribution."""
        if offline_features and self.needs_target_logits and self.target_logits_mode == "exact":
            raise ValueError(
                "model.target_logits: exact reads logits from the online target, but data.feature_cache: true "
                "trains without it; set model.target_logits: auto (the store) or data.feature_cache: false"
            )
        needing = [l.name for l in self.losses if l.requires_target_distribution and l.weight > 0]
        if offline_features and needing:
            raise ValueError(
                f"loss components {needing} read the target's full distribution at every slot, which only the "
                "online target gives; set data.feature_cache: false"
            )

    def needs_logit_cache(self, offline_features: bool) -> bool:
        """Whether the data module must precompute the top-M target-logit cache."""
        if not self.needs_target_logits:
            return False
        return self.target_logits_mode == "cache" or (self.target_logits_mode == "auto" and offline_features)

    def logit_cache_reason(self, offline_features: bool) -> str:
        """The settings behind :meth:`needs_logit_cache`, for messages that name both sides of a conflict."""
        if not self.needs_target_logits:
            return "no active loss in model.losses reads target logits"
        mode = self.target_logits_mode
        if mode == "auto":
            where = "the target-logit store" if offline_features else "exact logits from the online target"
            return f"model.target_logits: auto with data.feature_cache: {str(offline_features).lower()} reads {where}"
        return f"model.target_logits: {mode} reads " + ("the target-logit store" if mode == "cache" else
                                                         "exact logits from the online target")

    # ------------------------------------------------------------------ target lifecycle
    def configure_model(self) -> None:
        """Load the frozen target once (idempotent); the strategy has set the device by now."""
        if self.target is not None or _target_deferred.get():
            return
        spec = self.target_spec
        target = FrozenTarget.from_pretrained(
            self.target_path,
            dtype=spec.dtype,
            layer_ids=self.drafter.target_layer_ids,
            trust_remote_code=spec.trust_remote_code,
            shared=True,  # the data module's precompute in this process loaded the same weights: reuse them
            **spec.load_kwargs,
        )
        if target.tokenizer is not None:
            target.check_tokenizer(target.tokenizer)
        target.check_token_id(self.drafter.mask_token_id, setting="model.drafter.init_args.mask_token_id")
        self.target = target.to(self.device)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        state = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", "")
        return {k: v for k, v in state.items() if not k.startswith(prefix + TARGET_PREFIX)}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        # The target never travels in checkpoints: ignore its keys on both sides, stay strict otherwise.
        own_state = {k: v for k, v in super().state_dict().items() if not k.startswith(TARGET_PREFIX)}
        own, given = set(own_state), {k for k in state_dict if not k.startswith(TARGET_PREFIX)}
        if strict and own != given:
            missing, unexpected = sorted(own - given), sorted(given - own)
            raise StateMismatchError(
                f"checkpoint does not match the system: missing {missing[:8]}, unexpected {unexpected[:8]}; "
                "was it trained with a different drafter/head config?", keys=True
            )
        # Shapes too, here rather than in nn.Module's message (which callers would have to parse): a tensor built
        # from another target's sizes (vocabulary rows, hidden size) is named with both shapes.
        # As nn.Module checks: not extra state (its own format), not lazy tensors, and a 1-element 1-D tensor may fill
        # a 0-D one (checkpoints of older torch releases).
        resized = [(k, tuple(given_v.shape), tuple(v.shape)) for k, v in own_state.items()
                   if isinstance(given_v := state_dict.get(k), torch.Tensor) and not k.endswith(_EXTRA_STATE_SUFFIX)
                   and not is_lazy(v) and not is_lazy(given_v) and given_v.shape != v.shape
                   and not (v.dim() == 0 and given_v.shape == (1,))]
        if resized:
            key, saved_shape, shape = resized[0]
            raise StateMismatchError(
                f"checkpoint does not match the system: {key} is {list(saved_shape)} in the checkpoint and "
                f"{list(shape)} here ({len(resized)} tensor(s) of other shapes); was it trained with another target "
                "or drafter/head config?"
            )
        filtered = {k: v for k, v in state_dict.items() if not k.startswith(TARGET_PREFIX)}
        return super().load_state_dict(filtered, strict=False, assign=assign)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Strategies such as FSDP gather the state dict themselves, bypassing our state_dict(): drop the
        # frozen target here too, so no checkpoint ever carries it.
        if "state_dict" in checkpoint:
            checkpoint["state_dict"] = {
                k: v for k, v in checkpoint["state_dict"].items() if k.split(".", 1)[0] != TARGET_PREFIX[:-1]
            }
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        checkpoint["lilicorr"] = {
            "target": {"name_or_path": self.target_spec.name_or_path, "resolved_path": self.target_path,
                       "dtype": self.target_spec.dtype, "layer_ids": self.drafter.target_layer_ids},
            "block_size": self.drafter.block_size,
            "mask_token_id": self.drafter.mask_token_id,
            "enable_thinking": getattr(dm, "enable_thinking", None),
            "chat_template": getattr(dm, "chat_template", None),
            # The data files' content (name, bytes, sha256): a split of files edited in place since is not this one.
            "data_files": dm.files_identity() if callable(getattr(dm, "files_identity", None)) else None,
            "stop_token_ids": self.target.stop_token_ids() if self.target is not None else None,
            "version": __import__("lilicorr_pl").__version__,
            "target_weights": self.target_weights_fingerprint(),  # which weights, wherever they are read from
            "target_weights_hash": "content",  # whole-file digests (absent: the sampled digests of older versions)
            # Every target the steps trained against, from the step each began at: a resume against other weights
            # (another build under the same path) adds one, so no later comparison reads the checkpoint as trained
            # against the last alone.
            "target_weights_history": self._target_history(),
            "total_steps": self._run_total_steps,  # the run length curricula anneal over
            # The running epoch's training metrics so far, for a resume inside the epoch (one process: under several,
            # each holds its own share, so none is saved and such an epoch's means are not logged).
            "train_epoch_metrics": self._train_metrics_record(),
            # Verified whenever the checkpoint is opened (bench, export, resume, load_from_checkpoint).
            CHECKSUM_KEY: state_checksum(checkpoint.get("state_dict", {})),
        }
        if self._trainer is None or self.trainer.is_global_zero:  # (the file's writer: Adam's state hashed once)
            # Verified when a fit resumes from it: what it restores besides the weights (Adam's moments, the loops',
            # callbacks' and loader's positions, the random streams; every callback wrote its entry before this hook).
            keys = training_state_keys(checkpoint)
            checkpoint["lilicorr"][TRAINING_KEYS_KEY] = keys
            checkpoint["lilicorr"][TRAINING_CHECKSUM_KEY] = training_state_checksum(checkpoint, keys)
        # The records too, last (Lightning calls this hook after writing the others): verified when a command reads
        # the file (a changed byte there changed the layer ids an export wrote for an engine).
        checkpoint["lilicorr"][RECORD_CHECKSUM_KEY] = record_checksum(checkpoint)
        # The global random streams travel with callbacks.RandomStateCheckpoint (in every shipped fit config).

    def target_weights_fingerprint(self, sampled: bool = False) -> str | None:
        """A short hash of the target's config and weight files (sizes and whole-content digests, or with ``sampled``
        the three-window digests older checkpoints recorded; not their names or folder, so a moved copy matches), or
        None where no local file can be read (a hub name not cached here)."""
        memo = self.__dict__.setdefault("_target_weights", {})
        if sampled not in memo:
            from lilicorr_pl.data.fingerprint import content_sha256, fingerprint, fingerprint_target, sampled_sha256

            parts = fingerprint_target({"name_or_path": str(self.target_path),
                                        "load_kwargs": dict(self.target_spec.load_kwargs or {})}, include_layers=False,
                                       file_hash=sampled_sha256 if sampled else content_sha256)
            weights = parts.get("weights")
            memo[sampled] = fingerprint({"config": parts.get("config"), "weights": [
                [size, digest] for _, size, digest in weights]})[:16] if weights else None
        return memo[sampled]

    def _target_history(self) -> list[dict[str, Any]]:
        """The ``target_weights_history`` a checkpoint written now records: a resumed fit's (:meth:`on_load_checkpoint`),
        else this run's target from step 0 (empty where its weights cannot be hashed)."""
        if self._trained_against is not None:
            return [dict(entry) for entry in self._trained_against]
        weights = self.target_weights_fingerprint()
        return [{"target_weights": weights, "target_weights_hash": "content", "from_step": 0}] if weights else []

    @staticmethod
    def trained_targets(meta: Mapping[str, Any] | None) -> list[dict[str, Any]]:
        """The targets a checkpoint with lilicorr record ``meta`` trained against, oldest first, each as
        ``{"target_weights", "target_weights_hash", "from_step"}``; one for a checkpoint written before the history
        was recorded, none where its target is unknown."""
        meta = meta or {}
        history = meta.get("target_weights_history")
        if isinstance(history, list) and history and all(isinstance(e, Mapping) for e in history):
            return [dict(entry) for entry in history]
        if not meta.get("target_weights"):
            return []
        rule = "content" if meta.get("target_weights_hash") == "content" else "sampled"
        return [{"target_weights": meta["target_weights"], "target_weights_hash": rule, "from_step": 0}]

    def _record_resumed_target(self, checkpoint: Mapping[str, Any]) -> None:
        """A resumed fit's target history: the checkpoint's, and the target read now from the step it resumes at
        where that is another (its weights hashed by each entry's rule)."""
        history = self.trained_targets(checkpoint.get("lilicorr"))
        now = self.target_weights_fingerprint()
        if history and now:
            last = history[-1]
            if last["target_weights"] != self.target_weights_fingerprint(
                    sampled=last.get("target_weights_hash") != "content"):
                history.append({"target_weights": now, "target_weights_hash": "content",
                                "from_step": int(checkpoint.get("global_step") or 0)})
        self._trained_against = history if history else None

    def trained_target_weights(self, meta: Mapping[str, Any] | None) -> tuple[str | None, str | None]:
        """(the target the checkpoint with lilicorr record ``meta`` trained against, the target read now), both as
        :meth:`target_weights_fingerprint` hashes them for that checkpoint (sampled for one written before whole-file
        digests); either None where unknown."""
        meta = meta or {}
        recorded = meta.get("target_weights")
        if not recorded:
            return None, self.target_weights_fingerprint()
        return recorded, self.target_weights_fingerprint(sampled=meta.get("target_weights_hash") != "content")

    def compared_target(self, meta: Mapping[str, Any] | None) -> dict[str, Any]:
        """The target read now against the one the checkpoint with lilicorr record ``meta`` trained against, as the
        results record it: ``target``, ``target_weights``, ``target_weights_trained`` (both by the rule the checkpoint
        was hashed with) and ``same_target_as_training`` (None where either hash is unknown)."""
        recorded, now = self.trained_target_weights(meta)
        history = self.trained_targets(meta)
        compared = {"target": str(self.target_path), "target_weights": now, "target_weights_trained": recorded,
                    "same_target_as_training": (recorded == now) if recorded and now else None}
        if len({entry["target_weights"] for entry in history}) > 1:  # trained against more than one: not this alone
            compared.update(same_target_as_training=False, target_weights_trained_history=history)
        return compared

    def warn_if_other_target(self, checkpoint: Mapping[str, Any], what: str) -> dict[str, Any]:
        """Say so when the target read now is not the one ``checkpoint`` trained against (another model under the
        same name or path): ``what`` the checkpoint is used for. A warning, not a refusal: a re-saved copy of the
        same model (other shards) also reads as another. Returns the comparison (:meth:`compared_target`)."""
        compared = self.compared_target(checkpoint.get("lilicorr"))
        history = compared.get("target_weights_trained_history")
        if history:
            steps = ", ".join(f"{entry['target_weights']} from step {entry['from_step']}" for entry in history)
            warnings.warn(f"this checkpoint trained against more than one target (a resume changed its weights: "
                          f"{steps}); the target at {self.target_path} hashes to {compared['target_weights']}; {what} "
                          "this drafter against one of them at most", stacklevel=2)
        elif compared["same_target_as_training"] is False:
            warnings.warn(f"the target at {self.target_path} is not the one this checkpoint trained against (its "
                          f"config and weight files hash to {compared['target_weights']}, the checkpoint's target to "
                          f"{compared['target_weights_trained']}); {what} this drafter against another model",
                          stacklevel=2)
        return compared

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Runs before any weight is loaded, for resume and load_from_checkpoint alike.
        fitting = self._trainer is not None and self.trainer.state.fn == "fit"
        verify_checksum(checkpoint, training=fitting)
        refusal = first_form_refusal((checkpoint.get("hyper_parameters") or {}).get("head"), self.head, "the checkpoint")
        if refusal:  # its tensors are not this head's, and the config that trained it names no other form
            raise StateMismatchError(refusal, keys=True)
        if fitting:
            self._check_resume_settings(checkpoint.get("hyper_parameters") or {})
            self.warn_if_other_target(checkpoint, "resuming trains")
            self._record_resumed_target(checkpoint)
            self._resumed_train_metrics = (checkpoint.get("lilicorr") or {}).get("train_epoch_metrics")
            return
        if self._trainer is not None:  # validate/test/predict measure the drafter against the target read now
            fn = self.trainer.state.fn
            self.checked_target = self.warn_if_other_target(checkpoint, f"{getattr(fn, 'value', fn)} measures")
            self.checkpoint_meta = dict(checkpoint.get("lilicorr") or {})
            self.checkpoint_step = checkpoint.get("global_step")
        if self._run_total_steps is None:  # validate/test/predict: anneal over the length the run had
            self._run_total_steps = (checkpoint.get("lilicorr") or {}).get("total_steps")

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        map_location: Any = "cpu",
        trust_remote_code: bool = False,
        allow_modules: Sequence[str] = (),
        target_path: str | None = None,
        load_target: bool = True,
        target_dtype: str | None = None,
        builtin_name: Callable[[str], str | None] | None = None,
    ) -> DraftSystem:
        """Rebuild a trained system from a ``lilicorr fit`` checkpoint that may come from anyone.

        Weights-only load (a pickled object is refused before it is built), checksum verified, components
        limited to trusted packages (plus ``allow_modules``), and ``trust_remote_code`` only from the
        caller: a checkpoint trained with it is refused unless ``trust_remote_code=True`` is passed here.
        ``target_path``: the same target model from another place (a checkpoint trained elsewhere records that
        machine's directory); a recorded local directory missing here is refused with one line naming it.
        ``load_target=False``: the drafter and head only (what an export needs); :meth:`load_target` loads the target
        later, so a caller can check its options against the trained head before the target's weights are read.
        ``target_dtype``: load the target in this dtype instead of the recorded ``model.target.dtype``.
        A built-in target's build that another machine's run recorded is this machine's build of the same key where
        its cache holds one; where not, the refusal names the ``builtin:`` name ``builtin_name`` gives for it (the
        command's: :func:`lilicorr_pl.builtin.builtin_name_of`).
        """
        # Verified now: Lightning loads the target (configure_model) before on_load_checkpoint sees the weights.
        checkpoint, first = read_verified(path)
        verified = verified_first(first)
        hparams = checkpoint.get("hyper_parameters") or {}
        check_class_paths(hparams, path, allow_modules)
        target = dict(hparams.get("target") or {})
        # A count beside a list never picked a layer; a run from before a disagreeing one was refused recorded both.
        if target.get("layer_ids") is not None:
            target["num_features"] = len(target["layer_ids"])
        if target_path is not None:  # `builtin:` names are resolved at the command edge (bench, export), as in fit
            target["name_or_path"] = str(target_path)
        if target_dtype is not None:
            target["dtype"] = str(target_dtype)
        name = str(target.get("name_or_path") or "")
        # A built-in target's build, recorded in another machine's cache folder (relative there, as a relative
        # LILICORR_CACHE makes it, it reads as a hub id): a folder of that name is a build of the same key.
        if builtin_artifact(name) is not None and not Path(os.path.expanduser(name)).is_dir():
            here = builtin_copy_here(name) if target_path is None else None
            if here is None:
                where = f"--target {target_path}" if target_path is not None else \
                    f"checkpoint {path} loads its target from {name}, which"
                raise CheckpointError(f"{where} is not a directory on this machine; "
                                      f"{_same_target_here(name, builtin_name)}")
            print(f"lilicorr: checkpoint {path}'s target {name} is not on this machine; a build of the same key is in "
                  f"this machine's cache, and is used: {here}", file=sys.stderr)
            target["name_or_path"] = here
        where = local_target_path(str(target.get("name_or_path") or ""))
        if where is not None:
            target["name_or_path"] = where
            if not Path(where).is_dir():
                raise CheckpointError(
                    f"--target {target_path} is not a directory on this machine; pass the target model's directory "
                    "or hub name" if target_path is not None else
                    f"checkpoint {path} loads its target from {where}, which is not a directory on this machine; "
                    "pass the same target model's directory or hub name (--target)"
                )
        check_remote_code(target, trust_remote_code, path, "--trust-remote-code")
        target["trust_remote_code"] = bool(trust_remote_code)
        named = f"--target {target_path}" if target_path is not None else f"its target {target.get('name_or_path')}"
        fc = (checkpoint.get("state_dict") or {}).get("drafter.fc.weight")  # [H, n·H]: the target's hidden size
        # A drafter named as the target, an unreachable hub id, another width: said with the option that named it,
        # before anything is built (the constructor's own checks name the training setting, model.target.name_or_path).
        given_by, option = ("--target", "") if target_path is not None else (f"checkpoint {path}'s target", "--target")
        shown = str(target_path) if target_path is not None else str(target.get("name_or_path"))
        config = _target_config(where, target, shown, given_by, option)
        if config is not None:
            refuse_drafter(config, shown, given_by, option)
            hidden = getattr(config, "hidden_size", None)
            if fc is not None and isinstance(hidden, int) and hidden != fc.shape[0]:
                raise CheckpointError(
                    f"checkpoint {path} was trained on a target of hidden size {fc.shape[0]}, and {named} has "
                    f"hidden size {hidden}; pass the target model it was trained with (--target)")
        meta = dict(checkpoint.get("lilicorr") or {})
        step = checkpoint.get("global_step")
        del checkpoint
        # The weights come from the checkpoint: a warm-start directory named at training time is not re-read.
        overrides = dict(target=target, init_drafter_from=None, init_head_from=None,
                         init_drafter_layers_from_target=False)
        if as_trained(hparams.get("head")) is not hparams.get("head"):  # a Domino head of the first form: rebuilt so
            overrides["head"] = as_trained(hparams["head"])
        instantiator = hparams.get("_instantiator")
        if instantiator is not None and instantiator != "lightning.pytorch.cli.instantiate_module":
            # Lightning imports the named instantiator (older releases without an allow-list): only its own.
            raise CheckpointError(f"checkpoint {path} names an unknown instantiator {instantiator!r}; importing it "
                                  "would run its code, so it is refused")
        if instantiator is None:
            raise CheckpointError(
                f"checkpoint {path} does not record how to rebuild its drafter and head (it was not trained with "
                "`lilicorr fit`); build the DraftSystem in Python and call DraftSystem.load_from_checkpoint"
            )
        # Lightning rebuilds the system with jsonargparse from the recorded configs; this context makes the rebuilt
        # system record those configs again (as LightningCLI does), not the module objects it was given.
        given = {k: v for k, v in {**hparams, **overrides}.items() if k != "_instantiator"}
        token = _target_deferred.set(not load_target)
        try:
            with _rebuild_errors(path, named), verified, _given_hyperparameters_context(hparams=given,
                                                                                         instantiator=instantiator):
                system = cls.load_from_checkpoint(str(path), map_location=map_location, weights_only=True,
                                                  **overrides)
        finally:
            _target_deferred.reset(token)
        system._checkpoint_origin = (path, named)
        system.checkpoint_meta = meta  # how it was trained: thinking flag, chat template, block size
        system.checkpoint_step = step  # the optimizer steps behind its weights
        if load_target:  # else in load_target, or by the caller: the check reads the weight files
            system.warn_if_other_target({"lilicorr": meta}, "using it measures or serves")
        return system

    @classmethod
    def from_export(cls, directory: str | Path, target_path: str, dtype: str | None = None,
                    trust_remote_code: bool = False) -> DraftSystem:
        """A system that measures a serving directory — a ``DFlashDraftModel`` or ``LiLiCorrDraftModel``, ours
        (``lilicorr export``) or a released one — against ``target_path``: its drafter and head with their weights
        (checked against the directory's config and the target's sizes, as a warm start is), the target not loaded
        yet (:meth:`load_target`). ``dtype``: the target's; default the dtype the directory's weights are stored in
        (an export's is the dtype its target trained in; a config's ``torch_dtype`` is not read), float32 for any
        other. A serving directory records no training: no thinking flag (the benchmark's default, off, applies) and
        no target to compare with."""
        from lilicorr_pl.interop import load_drafter, load_head, read_weights, served_head

        weights = read_weights(directory)  # read once: the drafter and the head are both in it
        served = load_drafter(directory, weights=weights)  # the directory's own geometry and dtype, read and checked
        trained = load_head(directory, weights=weights)
        if dtype is None:
            stored = str(next(served.parameters()).dtype).removeprefix("torch.")
            dtype = stored if stored in ("bfloat16", "float16", "float32") else "float32"
        dims = served.dims  # its own widths and heads, which need not be the target's
        head = served_head(directory)
        if head is not None:  # built with the drafter's epsilon; the directory's is checked against the target's below
            head.rms_norm_eps = None
        system = cls(
            target={"name_or_path": str(target_path), "dtype": dtype, "layer_ids": list(served.target_layer_ids),
                    "trust_remote_code": trust_remote_code},
            drafter=DFlashDrafter(num_layers=served.num_layers, block_size=served.block_size,
                                  mask_token_id=served.mask_token_id, intermediate_size=dims.intermediate_size,
                                  num_attention_heads=dims.num_attention_heads,
                                  num_key_value_heads=dims.num_key_value_heads, head_dim=dims.head_dim),
            head=head, lr_scheduler=None,
        )
        system._warm_start(str(directory), system.drafter.target_config, loaded=served)  # checked against the target
        if trained is not None:
            system._warm_start_head(str(directory), loaded=trained)
        system._checkpoint_origin = (Path(directory), f"--target {target_path}")
        return system

    def load_target(self) -> None:
        """Load the target of a system rebuilt with ``from_checkpoint(load_target=False)``; a target that cannot be
        loaded is one line naming the checkpoint, as it is when ``from_checkpoint`` loads it."""
        path, named = self._checkpoint_origin
        self.warn_if_other_target({"lilicorr": self.checkpoint_meta}, "using it measures or serves")
        with _rebuild_errors(path, named) if path is not None else contextlib.nullcontext():
            self.configure_model()

    def _check_resume_settings(self, saved: Mapping[str, Any]) -> None:
        changed = check_resume_settings(saved, dict(self.hparams))
        if changed:
            self.print("lilicorr: resuming with changed settings (applied from this run's config): " + "; ".join(changed))

    # ------------------------------------------------------------------ forward pieces
    def _require_target(self) -> FrozenTarget:
        if self.target is None:
            self.configure_model()
        assert self.target is not None
        return self.target

    def _profile(self, phase: str) -> Any:
        """Time one phase of the step with the Trainer's profiler (``--trainer.profiler=simple``; a no-op by
        default), or outside a Trainer with ``self.profiler`` (``lilicorr perf``)."""
        profiler = self._trainer.profiler if self._trainer is not None else self.profiler
        return profiler.profile(PHASE_PREFIX + phase) if profiler is not None else contextlib.nullcontext()

    def compute_step(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None,
                     memo: ContextMemo | None = None) -> dict[str, Any]:
        """One teacher-forced pass: features, drafter blocks, head lattice, losses and diagnostics.

        ``memo``: the frozen drafter's context work per example of this batch's split (training batches only:
        example indices are per split).
        """
        target = self._require_target()
        ids = batch["input_ids"]
        attn = batch.get("attention_mask")
        loss_mask = batch["loss_mask"].bool()
        if attn is not None:
            loss_mask = loss_mask & attn.bool()
        normed = None
        with self._profile("target"):
            if "features" in batch:
                feats = batch["features"]
            else:
                out = target(ids, attention_mask=attn)
                feats, normed = out.features, out.normed_hidden
        anchors, valid = sample_anchors(loss_mask, self.num_anchors, generator=generator,
                                        response_start_prob=self.response_start_anchors if self.training else 0.0)
        with self._profile("drafter"):
            context = None
            if memo is not None:  # store or online features alike: a frozen target's depend only on the sequence
                if "index" not in batch:
                    raise ValueError("model.context_memo_mb keys the drafter's context by each example's 'index' in its "
                                     "dataset, and this batch has none; use the data module's batches or set it to 0")
                lengths = attn.sum(1) if attn is not None else torch.full_like(batch["index"], ids.shape[1])
                context = memo.context(self.drafter, feats, batch["index"], lengths)
            draft: DraftOutput = self.drafter(feats, ids, anchors, target.embed, target.lm_head, context=context)
        labels, label_mask, label_pos = block_labels(ids, loss_mask, anchors, valid, self.drafter.block_size)
        # Keep only blocks with at least one supervised slot: padding anchors cost nothing further.
        keep = label_mask.any(-1)  # [b, N]
        b_idx = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1).expand_as(keep)[keep]  # [M]
        slot_hidden, slot_logits = draft.slot_hidden[keep], draft.slot_logits[keep]  # [M, S, H], [M, S, V]
        labels, label_mask, label_pos = labels[keep], label_mask[keep], label_pos[keep]
        with self._profile("head"):
            # Training call of the head: teacher forcing, slot k conditioned on the true token of slot k-1.
            anchor_ids = ids.gather(1, anchors.clamp(0, ids.shape[1] - 1))[keep]  # [M]
            blocks = DraftOutput(slot_hidden, slot_logits, draft.anchor_feature[keep], draft.anchor_feature_valid[keep])
            head_out: HeadOutput = self.head(blocks, TeacherForcing(anchor_ids, labels, target.embed))
        lattice = head_out.lattice
        provider = self._target_logit_provider(batch, b_idx, label_pos, labels, normed)
        inputs = LossInputs(slot_logits, labels, label_mask, lattice, provider,
                            corrected_logits=head_out.corrected_logits,
                            target_distribution=self._target_distribution(b_idx, label_pos, normed),
                            step=self.global_step if self._trainer is not None else 0,
                            total_steps=self._total_steps())
        total = slot_logits.new_zeros(())
        logs: dict[str, torch.Tensor] = {}
        with self._profile("losses"):
            for component in self.losses:
                if component.weight == 0 and not component.has_inputs(inputs):
                    continue  # a logged-only loss whose inputs no active loss asked for (needs_target_logits)
                out = component(inputs)
                total = total + out.loss
                logs[component.name] = out.loss.detach()
                for key, value in out.logs.items():
                    logs[f"{component.name}/{key}"] = value.detach()
        return {
            "loss": total,
            "logs": logs,
            "slot_logits": slot_logits.detach(),
            "labels": labels,
            "label_mask": label_mask,
            "label_pos": label_pos,  # [M, S] position of each slot's token in its sequence
            "block_seq": b_idx,  # [M] sequence of each block
            "lattice": lattice,
            "selected": head_out.selected,
            "num_blocks": int(keep.sum()),
        }

    def _target_logit_provider(
        self,
        batch: dict[str, torch.Tensor],
        b_idx: torch.Tensor,  # [M] sequence of each block
        label_pos: torch.Tensor,  # [M, S] position of each slot's token
        labels: torch.Tensor,  # [M, S]
        normed: torch.Tensor | None,  # [b, T, H] final-normed target hidden (online mode)
    ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if not self.needs_target_logits:
            return None  # no active loss reads target logits (e.g. the DFlash-only ablation)
        mode = self.target_logits_mode
        has_cache = "topm_ids" in batch
        if mode == "cache" or (mode == "auto" and normed is None and has_cache):
            if not has_cache:
                raise RuntimeError(
                    "model.target_logits='cache' but the batch has no target-logit cache; set "
                    "data.logit_cache: true or model.target_logits: exact"
                )
            from lilicorr_pl.data import cached_candidate_logits

            rows = (b_idx.unsqueeze(1).expand_as(label_pos), label_pos)
            topm_ids, topm_logits = batch["topm_ids"][rows], batch["topm_logits"][rows]  # [M, S, Mtop]
            floor, true_logit = batch["floor_logit"][rows], batch["true_logit"][rows]  # [M, S]

            def from_cache(token_ids: torch.Tensor) -> torch.Tensor:
                return cached_candidate_logits(topm_ids, topm_logits, floor, labels, true_logit, token_ids)

            return from_cache
        if normed is None:
            raise RuntimeError(
                "exact target logits need the online target, but features came from the offline cache; "
                "enable data.logit_cache or disable data.feature_cache"
            )
        target = self._require_target()
        # Row t of the teacher-forced distribution comes from the hidden state at t - 1.
        hidden = normed[b_idx.unsqueeze(1), (label_pos - 1).clamp(min=0)]  # [M, S, H]

        @torch.no_grad()
        def exact(token_ids: torch.Tensor) -> torch.Tensor:
            return target.candidate_logits(hidden, token_ids).float()

        return exact

    def _total_steps(self) -> int | None:
        """The run's optimizer steps, for curricula: set when a fit starts, restored from a checkpoint otherwise."""
        return self._run_total_steps if self._trainer is not None else None

    def _target_distribution(
        self,
        b_idx: torch.Tensor,  # [M] sequence of each block
        label_pos: torch.Tensor,  # [M, S] position of each slot's token
        normed: torch.Tensor | None,  # [b, T, H] final-normed target hidden (online mode)
    ) -> Callable[[slice], torch.Tensor] | None:
        """Full teacher-forced target logits per block chunk, for losses that read the whole distribution."""
        if normed is None or not any(l.requires_target_distribution and l.weight > 0 for l in self.losses):
            return None
        target = self._require_target()
        # The logits predicting the token at position t come from the hidden state at t - 1.
        hidden = normed[b_idx.unsqueeze(1), (label_pos - 1).clamp(min=0)]  # [M, S, H]

        @torch.no_grad()
        def distribution(rows: slice) -> torch.Tensor:
            return target.lm_head(hidden[rows]).float()  # [m, S, V]

        return distribution

    # ------------------------------------------------------------------ Lightning hooks
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        step = self.compute_step(batch, memo=self.context_memo)
        self._log_step(step, "train", self.train_metrics, batch["input_ids"].shape[0])
        if self.context_memo is not None:  # examples served from the memo since fit start, and its size
            self.log("train/context_memo_hit_rate", self.context_memo.hit_rate, on_step=True, on_epoch=False)
            self.log("train/context_memo_mib", self.context_memo.bytes / 2**20, on_step=True, on_epoch=False)
        return step["loss"]

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        # Fixed anchors per validation batch, so val curves compare like with like.
        g = torch.Generator().manual_seed(1_000_003 * (batch_idx + 1))
        step = self.compute_step(batch, generator=g)
        self._log_step(step, "val", self.val_metrics, batch["input_ids"].shape[0])

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        """Per-block teacher-forced diagnostics (``lilicorr predict``): prefixes, oracle gap, coverage."""
        g = torch.Generator().manual_seed(1_000_003 * (batch_idx + 1))
        step = self.compute_step(batch, generator=g)
        diag = lattice_diagnostics(step["lattice"], step["slot_logits"], step["labels"], step["label_mask"],
                                   step["selected"], top_k=self._top_k())
        return {k: v.detach().cpu() for k, v in diag.items() if torch.is_tensor(v)}

    def _log_step(self, step: dict[str, Any], stage: str, metrics: LatticeMetrics, batch_size: int) -> None:
        # A step with no block measured nothing (its losses are 0): no value is logged or averaged, but the epoch's
        # metrics are still made and updated (with nothing), so that every rank syncs the same ones at its end.
        measured = step["num_blocks"] > 0
        on_step = stage == "train"
        scalars = {"loss": step["loss"].detach(), **{k: v for k, v in step["logs"].items() if v.numel() == 1}}
        for key, value in scalars.items():
            name = f"{stage}/{key}"
            if on_step:
                if measured:
                    self.log(name, value, on_step=True, on_epoch=False, prog_bar=key == "loss", batch_size=batch_size)
                continue
            # Epoch means are sum-reduced torchmetrics, not sync_dist=True: Lightning's mean-sync floors the example
            # count when ranks evaluated different numbers of examples (pytorch-lightning#21859).
            mean = self._epoch_mean(name)
            if measured:
                update_weighted(mean, value, batch_size)
            self.log(name, mean, on_step=False, on_epoch=True, prog_bar=key == "loss", batch_size=batch_size,
                     metric_attribute=f"epoch_means.{name}")
        # The diagnostics are computed once per step: the metric accumulates them, the step logs their means.
        diag = lattice_diagnostics(step["lattice"], step["slot_logits"], step["labels"], step["label_mask"],
                                   step["selected"], top_k=metrics.top_k)
        metrics.update(step["lattice"], step["slot_logits"], step["labels"], step["label_mask"], step["selected"],
                       diagnostics=diag)
        if on_step and measured:
            valid = diag["valid_block"]  # means over valid blocks only, as the lattice losses read them
            for key in ("top1_prefix", "selected_prefix", "oracle_prefix", "oracle_gap", "logfactor_spread",
                        "logfactor_row_spread"):
                if key in diag:
                    self.log(f"{stage}/{key}", valid_block_mean(diag[key], valid), on_step=True, batch_size=batch_size)
            for key, prefix in (("sim_tau_top1", "top1_prefix"), ("sim_tau_selected", "selected_prefix")):
                self.log(f"{stage}/{key}", 1 + valid_block_mean(diag[prefix], valid), on_step=True,
                         batch_size=batch_size)

    def _epoch_mean(self, name: str) -> Any:
        """The batch-size-weighted epoch mean of one logged scalar (created on first use, never checkpointed)."""
        from torchmetrics.aggregation import MeanMetric

        if "epoch_means" not in self._modules:
            self.epoch_means = torch.nn.ModuleDict()
        if name not in self.epoch_means:
            self.epoch_means[name] = MeanMetric(nan_strategy="disable").to(self.device)
        return self.epoch_means[name]

    def _train_metrics_record(self) -> dict[str, Any] | None:
        """The running epoch's training metric sums (plain floats, float64: exact) — or, before the next epoch's first
        step, those of the epoch that ended last (a stop inside an epoch ends it, and the checkpoint written at the
        stop is resumed inside it) — or None where there are none, they are one process's share of several, or they
        cover only the steps since a resume."""
        metrics = self.train_metrics
        if self._trainer is None or self.trainer.world_size > 1 or self._partial_data_epoch is not None:
            return None
        if not metrics.update_called:
            return self._ended_epoch_record
        # The data's epoch, as the loader's state records it (Lightning's count runs ahead of it after a stop by
        # max_steps inside an epoch, and a resumed run's loader goes on with the data's).
        epoch = getattr(getattr(self.trainer, "datamodule", None), "data_epoch", None)
        return {"epoch": int(self.current_epoch if epoch is None else epoch), "updates": int(metrics._update_count),
                "states": {name: value.detach().cpu().tolist() for name, value in metrics.metric_state.items()}}

    def on_train_start(self) -> None:
        """After a resume inside an epoch (Lightning goes on with that epoch without starting it again), the epoch's
        metrics start from the checkpoint's sums (its earlier steps'), so ``train/epoch_*`` is the whole epoch's, as an
        uninterrupted run logs it; they covered only the steps since the resume, under the whole epoch's name. Where
        the checkpoint has none (several processes, an older checkpoint), the epoch's means are not logged
        (:meth:`on_train_epoch_end`)."""
        record, self._resumed_train_metrics = self._resumed_train_metrics, False
        if record is False:
            return
        at = getattr(getattr(self.trainer, "datamodule", None), "resumed_mid_epoch", None)
        if at is None:  # the data start the epoch at its first batch (a finished epoch, another order)
            return
        metrics = self.train_metrics
        # The data's epoch (Lightning may count the resumed epoch as the next one when the stop came mid-epoch).
        states = record.get("states") if isinstance(record, dict) and record.get("epoch") == at else None
        current = metrics.metric_state
        if not isinstance(states, dict) or set(states) != set(current) or any(
                torch.tensor(states[k]).shape != current[k].shape for k in current):
            self._partial_data_epoch = at
            return
        for name, value in current.items():
            setattr(metrics, name, torch.tensor(states[name], dtype=value.dtype, device=value.device))
        metrics._update_count = int(record.get("updates") or 0)

    def on_train_epoch_end(self) -> None:
        self._ended_epoch_record = self._train_metrics_record()  # read by a save after this end (a stop's)
        if self._partial_data_epoch is not None:
            epoch, self._partial_data_epoch = self._partial_data_epoch, None
            self.train_metrics.reset()
            rank_zero_warn(f"train/epoch_* of the epoch this fit resumed inside (the data's epoch {epoch}) are not "
                           "logged: the checkpoint holds none of that epoch's earlier metrics (several processes, or "
                           "an older lilicorr_pl), so they would cover only the steps since the resume")
            return
        self._log_metrics("train", self.train_metrics)

    def on_validation_epoch_end(self) -> None:
        self._log_metrics("val", self.val_metrics)

    def on_test_epoch_end(self) -> None:
        self._log_metrics("test", self.val_metrics)

    def _log_metrics(self, stage: str, metrics: LatticeMetrics) -> None:
        if not metrics.update_called:
            return
        values = metrics.compute()
        for key, value in values.items():
            if torch.is_tensor(value) and value.numel() == 1:
                self.log(f"{stage}/epoch_{key}" if stage == "train" else f"{stage}/{key}", value.float())
        metrics.reset()

    # ------------------------------------------------------------------ optimisation
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for n, p in self.named_parameters() if p.requires_grad and not n.startswith(TARGET_PREFIX)]

    def configure_optimizers(self) -> Any:
        params = self.trainable_parameters()
        n = sum(p.numel() for p in params)
        self.print(f"lilicorr: optimising {n:,} trainable parameters (target frozen, not in checkpoints)")
        optimizer = self.optimizer_factory(params)
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        if isinstance(scheduler, WarmupCosine) and scheduler.total_steps is None:
            scheduler.total_steps = int(self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_fit_end(self) -> None:
        if self.context_memo is not None:
            self.context_memo.clear()  # its memory goes back once training ends

    def on_fit_start(self) -> None:
        # Lightning warns when training starts with modules in eval mode (counted as below); the frozen target's are
        # by design (its train() keeps them there). Silenced for exactly that count, only when they are all the target's.
        in_eval = [module for _, module in self.named_modules() if not module.training]
        if in_eval and self.target is not None and set(in_eval) <= set(self.target.modules()):
            warnings.filterwarnings("ignore", message=rf"Found {len(in_eval)} module\(s\) in eval mode ",
                                    category=PossibleUserWarning)
        if self.context_memo is not None:
            self.context_memo.clear(counts=True)  # examples are indices into this fit's stores
        total = self.trainer.estimated_stepping_batches  # before the sanity check, so validation sees it too
        self._run_total_steps = int(total) if math.isfinite(total) else None
        n = sum(p.numel() for p in self.trainable_parameters())
        for logger in self.loggers:
            logger.log_hyperparams({"trainable_parameters": n})


def _target_config(where: str | None, target: Mapping[str, Any], shown: str, given_by: str, option: str) -> Any:
    """The config of the target a checkpoint is loaded with, read before the system is built so that a refusal names
    what gave the target (``given_by``, ``option``): a local folder's ``config.json`` as it is written (None when
    there is none, or it does not parse: loading it says why), a hub id's through ``AutoConfig`` (refused in one line
    when it cannot be read: offline, no such model)."""
    if where is not None:
        config_file = Path(where) / "config.json"
        if not config_file.is_file():
            return None
        try:
            config = json.loads(config_file.read_text())
        except (ValueError, UnicodeDecodeError):
            return None
        return SimpleNamespace(**config) if isinstance(config, dict) else SimpleNamespace()
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(target["name_or_path"], trust_remote_code=bool(target["trust_remote_code"]))
    except (OSError, ValueError) as err:
        raise CheckpointError(unreadable_target(shown, given_by, err, option)) from None
