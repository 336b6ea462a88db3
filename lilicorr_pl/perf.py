"""Where the time goes: ``lilicorr perf -c configs/tiny.yaml [--steps N]``.

Builds the system and data exactly as ``lilicorr fit`` would (same config files), then times the
pieces of ``steps`` real optimisation steps: target features, drafter, head, losses, backward and
optimizer. Prints a table (and ``--json``); the first ``--warmup`` steps are not counted. The command line
is ``fit``'s (same ``-c`` files, same ``--model.*``/``--data.*`` overrides) plus :func:`perf_options`.

``--cost_model`` instead prints the analytical cost of one speculative-decoding round (FLOPs and bytes
moved by the target's verify pass, the drafter and the LiLiCorr head, and a roofline time for a given
device) at the shapes of a config, without loading any weights: :func:`cost_report`. ``--round_timing`` measures
that round on this machine instead, with random weights at the same shapes: :func:`round_timing`.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from jsonargparse.typing import NonNegativeInt, PositiveFloat, PositiveInt
from torch import nn

from lilicorr_pl.allocator import policy as malloc_policy
from lilicorr_pl.checkpoint import CHECKSUM_KEY, first_line
from lilicorr_pl.command import argparse_spellings, type_hints
from lilicorr_pl.decoding.evaluate import plain_step_ms
from lilicorr_pl.files import write_results_json
from lilicorr_pl.heads.lilicorr import LiLiCorrHead
from lilicorr_pl.lightning_cli import (LilicorrCLI, add_saved_fit_arguments, deep_merge, run_lightning,
                                       wire_logit_cache)
from lilicorr_pl.models.dflash import DFlashDrafter
from lilicorr_pl.target import CompileModeName, DeviceName


TIMED_PRECISIONS = ("32-true", "bf16-mixed")
"""The ``trainer.precision`` values a timed step runs as ``fit`` runs them (Lightning's spelling; ``bf16`` and 32 are
the same). The step is timed on the CPU, where Lightning refuses ``16-mixed`` too."""


def step_precision(precision: Any) -> str:
    """``trainer.precision`` in Lightning's spelling, refused (ValueError) where :func:`profile_steps` cannot run a
    step as ``fit`` would (it timed every step in float32, whatever the config said)."""
    import warnings

    from lightning.fabric.connector import _convert_precision_to_unified_args

    with warnings.catch_warnings():  # "bf16 is supported for historical reasons": the same setting, no news here
        warnings.simplefilter("ignore")
        try:
            unified = str(_convert_precision_to_unified_args(32 if precision is None else precision))
        except ValueError:
            unified = str(precision)
    if unified not in TIMED_PRECISIONS:
        raise ValueError(f"trainer.precision {precision} is not one lilicorr perf times a step in (it times "
                         f"{' and '.join(TIMED_PRECISIONS)}, on the CPU); time the step with "
                         "--trainer.precision=bf16-mixed or 32-true")
    return unified


def profile_steps(system: Any, batches: list[dict[str, torch.Tensor]], steps: int, warmup: int = 2,
                  precision: str = "32-true", gradient_clip_val: float | None = None,
                  gradient_clip_algorithm: str | None = None) -> dict[str, float]:
    """Mean seconds per step for each phase over ``steps`` steps after ``warmup`` untimed ones.

    Timed with Lightning's ``SimpleProfiler``, through the same profiler actions the system reports under a
    Trainer (``lilicorr fit --trainer.profiler=simple``): the phases of ``compute_step``, then backward and
    optimizer. The step is the one ``fit`` takes: the system's own optimizer (``model.optimizer``; it was AdamW
    whatever the config named), the forward under bfloat16 autocast for ``precision`` ``bf16-mixed``, and the
    gradients clipped as the Trainer clips them (``gradient_clip_val``, by norm unless ``gradient_clip_algorithm`` is
    ``value``), in the optimizer phase.

    With the system's context memo on (``model.context_memo_mb``), the steps run with it as ``fit``'s do, timed in
    its steady state: a fit revisits every example many times (the demo's head stage about 140), so the memo is
    first filled from ``batches`` untimed and the timed steps are served from it (``context_memo_hit_rate`` in
    the result: the share of the timed steps' examples served from the memo).
    """
    from lightning.pytorch.profilers import PassThroughProfiler, SimpleProfiler

    from lilicorr_pl.system import PHASE_PREFIX, STEP_PHASES

    system.configure_model()
    system.train()
    params = system.trainable_parameters()
    opt = system.optimizer_factory(params)
    device = next(iter(params)).device
    half = torch.bfloat16 if step_precision(precision) == "bf16-mixed" else None

    def autocast() -> Any:
        return torch.autocast(device.type, dtype=half) if half is not None else contextlib.nullcontext()

    def clip() -> None:
        if gradient_clip_val:
            if gradient_clip_algorithm == "value":
                torch.nn.utils.clip_grad_value_(params, gradient_clip_val)
            else:
                torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)

    profiler, untimed = SimpleProfiler(), PassThroughProfiler()
    memo, hit_rate = system.context_memo, None
    try:
        if memo is not None:
            memo.clear(counts=True)
            with torch.no_grad(), autocast():
                for batch in batches:
                    system.compute_step(batch, memo=memo)
        for i in range(warmup + steps):
            batch = batches[i % len(batches)]
            active = profiler if i >= warmup else untimed
            if memo is not None and i == warmup:
                before = (memo.hits, memo.misses)
            system.profiler = active
            with active.profile("step_total"):
                with active.profile("forward"), autocast():
                    out = system.compute_step(batch, memo=memo)
                opt.zero_grad(set_to_none=True)
                with active.profile("backward"):
                    out["loss"].backward()
                with active.profile("optimizer"):
                    clip()
                    opt.step()
        if memo is not None:
            hits, misses = memo.hits - before[0], memo.misses - before[1]
            hit_rate = hits / (hits + misses)
    finally:
        system.profiler = None
        if memo is not None:
            memo.clear(counts=True)  # its memory goes back, as at the end of a fit
    durations = {name.removeprefix(PHASE_PREFIX): sum(times) / steps
                 for name, times in profiler.recorded_durations.items()}
    forward = durations.pop("forward")
    timed = {phase: durations.pop(phase) for phase in STEP_PHASES if phase in durations}
    timed["other_forward"] = forward - sum(timed.values())
    if hit_rate is not None:
        durations["context_memo_hit_rate"] = hit_rate
    return {**timed, **durations}


def penalty_cache_error(system: Any, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Distractor penalty from the top-M cache versus exact candidate logits, on the same blocks."""
    names = [l.name for l in system.losses if l.requires_target_logits]
    if not names:
        raise ValueError("no loss component reads target logits (add DistractorPenalty)")
    if "topm_ids" not in batches[0]:
        raise ValueError("the batches carry no target-logit store (topm_ids); build them with the data module's "
                         "logit_cache on (`lilicorr perf --penalty_error` does)")
    system.configure_model()
    system.eval()
    cached, exact = [], []
    mode = system.target_logits_mode
    try:
        with torch.no_grad():
            for i, batch in enumerate(batches):
                for which, sink in (("cache", cached), ("exact", exact)):
                    system.target_logits_mode = which
                    out = system.compute_step(batch, generator=torch.Generator().manual_seed(i))
                    sink.append(float(out["logs"][f"{names[0]}/penalty"]))
    finally:
        system.target_logits_mode = mode
    abs_err = [abs(a - b) for a, b in zip(cached, exact)]
    mean_exact = sum(exact) / len(exact)
    return {"penalty_exact": mean_exact, "penalty_cache": sum(cached) / len(cached),
            "mean_abs_error": sum(abs_err) / len(abs_err),
            "relative_error": (sum(abs_err) / len(abs_err)) / max(abs(mean_exact), 1e-12), "batches": len(batches)}


# ------------------------------------------------------------------------------------------ cost model
# One speculative round (DESIGN §7): the drafter appends the features of the tokens committed by the last round
# and drafts one block, the selector picks the block's tokens, the target verifies the block over its KV cache.
#
# FLOPs are those of matrix products and attention, 2 per multiply-add: what torch's FlopCounterMode counts
# (tests/test_perf_cost.py checks every formula against it on real forward passes). Element-wise work (norms,
# RoPE angles and rotation, softmax, SiLU, the head's start-score dot product) is left out: far below 1 % here.
# Bytes follow the usual per-kernel roofline accounting: a matmul reads its input and its weights once and
# writes its output once; attention reads Q and the K/V of every key and writes O and the new K/V into the
# cache in place (flash-style: scores never reach memory); a gather reads and writes its rows; a pass over
# logits (top-K, log-softmax) reads them once. Serving dtypes: ``bytes_per_element`` (2 = bf16) everywhere
# except the head's pair scores, which the code computes in fp32.


@dataclass(frozen=True)
class Roofline:
    """A device as a roofline: dense bf16 tensor-core throughput and memory bandwidth."""

    name: str
    peak_flops: float
    """FLOP/s (dense, no sparsity)."""
    bandwidth: float
    """Memory bandwidth in byte/s."""


ROOFLINES: dict[str, Roofline] = {
    "h100": Roofline("H100 SXM", 989e12, 3.35e12),
    "h200": Roofline("H200 SXM", 989e12, 4.8e12),
}
"""Data-sheet numbers (dense BF16 tensor FLOP/s, HBM bandwidth)."""


@dataclass(frozen=True)
class Op:
    """One kernel of a round, executed ``count`` times (e.g. once per decoder layer)."""

    name: str
    flops: float
    """Matmul / attention FLOPs of one execution."""
    weight_bytes: float
    """Parameter bytes one execution reads (embedding rows included)."""
    other_bytes: float
    """Activation, logit and KV-cache bytes one execution reads and writes."""
    count: int = 1

    @property
    def bytes(self) -> float:
        """Bytes moved by one execution."""
        return self.weight_bytes + self.other_bytes

    def seconds(self, device: Roofline) -> float:
        """Roofline time of all executions: each bound by compute or by memory, whichever is slower."""
        return self.count * max(self.flops / device.peak_flops, self.bytes / device.bandwidth)


def _linear(name: str, rows: float, d_in: int, d_out: int, bias: bool, e: int, count: int = 1) -> Op:
    """``[rows, d_in] @ [d_in, d_out]`` (+ bias)."""
    return Op(name, 2.0 * rows * d_in * d_out, e * (d_in * d_out + (d_out if bias else 0)), e * rows * (d_in + d_out),
              count)


def _module_linear(name: str, module: nn.Linear, rows: float, e: int, count: int = 1) -> Op:
    return _linear(name, rows, module.in_features, module.out_features, module.bias is not None, e, count)


def _attention(name: str, batch: int, heads: int, kv_heads: int, head_dim: int, queries: int, keys: float,
               new_keys: float, e: int, count: int = 1) -> Op:
    """``queries`` attending to ``keys`` per sequence over all heads (Q·Kᵀ and P·V); ``new_keys`` K/V rows written."""
    flops = 4.0 * batch * heads * queries * keys * head_dim
    moved = e * batch * head_dim * (2 * heads * queries + 2 * kv_heads * keys + 2 * kv_heads * new_keys)
    return Op(name, flops, 0.0, moved, count)


def _gather(name: str, rows: float, width: int, e: int) -> Op:
    """Embedding rows looked up: read from the table (weights) and written out."""
    return Op(name, 0.0, e * rows * width, e * rows * width)


def _attention_shape(config: Any) -> tuple[int, int, int]:
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return heads, kv_heads, head_dim


def _target_modules(config: Any) -> tuple[nn.Module, nn.Module]:
    """One decoder layer and the LM head of the target, built on the meta device (shapes only, no memory)."""
    from transformers import AutoModelForCausalLM

    if getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None):
        raise ValueError(
            f"the cost model covers dense targets; {getattr(config, 'model_type', '?')} routes tokens to experts, "
            "so its per-token weights differ from its parameter count"
        )
    one = copy.deepcopy(config)
    one.num_hidden_layers = 1  # dense decoder layers are identical: build one, count it L times
    if isinstance(getattr(one, "layer_types", None), list):
        one.layer_types = one.layer_types[:1]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(one)
    return model.get_decoder().layers[0], model.get_output_embeddings()


def target_round_ops(
    config: Any, block_size: int, context: int, batch: int = 1, bytes_per_element: int = 2
) -> list[Op]:
    """The target's verify pass of one round, as :func:`~lilicorr_pl.decoding.speculative.speculative_generate` runs it.

    Args:
        config: the target's Hugging Face config (a dense Llama/Qwen-style causal LM).
        block_size: tokens verified per sequence, ``B`` (the anchor and ``B - 1`` drafts).
        context: tokens already in the KV cache, ``L``; the block attends to ``L + B`` keys.
        batch: sequences verified together (weights are read once for all of them).
        bytes_per_element: 2 for bf16 weights, activations and cache.

    Every linear layer of every decoder layer sees the ``batch · B`` block tokens; the LM head produces
    logits at every block position (they pick the target's choices ``y_0..y_S``).
    """
    layer, lm_head = _target_modules(config)
    heads, kv_heads, head_dim = _attention_shape(config)
    n_layers, e, rows = int(config.num_hidden_layers), bytes_per_element, batch * block_size
    ops = [_gather("embedding gather", rows, int(config.hidden_size), e)]
    ops += [_module_linear(f"layer.{name}", m, rows, e, n_layers) for name, m in layer.named_modules()
            if isinstance(m, nn.Linear)]
    ops.append(_attention("layer.attention (KV cache)", batch, heads, kv_heads, head_dim, block_size, context + block_size,
                          block_size, e, n_layers))
    ops.append(_module_linear("lm_head (B positions)", lm_head, rows, e))
    return ops


def drafter_round_ops(
    drafter: DFlashDrafter, context: int, new_tokens: float, batch: int = 1, bytes_per_element: int = 2
) -> list[Op]:
    """The drafter's part of one round, as :meth:`~lilicorr_pl.models.dflash.DFlashDrafter.draft` computes it.

    Args:
        drafter: a built drafter (``build`` on the meta device is enough: only shapes are read).
        context: context positions in the draft cache once the new ones are appended, ``L``.
        new_tokens: context positions appended this round (the tokens the last round committed, τ on average).
        batch: sequences drafted together.
        bytes_per_element: 2 for bf16.

    The new context goes through ``fc`` once and through every layer's ``k_proj``/``v_proj``; the block
    ``[anchor, MASK × S]`` through every layer, attending to ``L + B`` keys; the target's LM head then gives
    logits for the ``S = B - 1`` slots (its weights are read again: a separate matmul from the target's).
    """
    dims = drafter._require_built()
    e, b, bs, n = bytes_per_element, batch, drafter.block_size, drafter.num_layers
    attn = drafter.layers[0].self_attn
    ctx_rows, rows = batch * new_tokens, batch * bs
    ops = [
        _gather("block embedding gather", rows, dims.hidden_size, e),
        _module_linear("fc (context fusion)", drafter.fc, ctx_rows, e),
        _module_linear("layer.self_attn.k_proj (new context)", attn.k_proj, ctx_rows, e, n),
        _module_linear("layer.self_attn.v_proj (new context)", attn.v_proj, ctx_rows, e, n),
    ]
    ops += [_module_linear(f"layer.{name}", m, rows, e, n) for name, m in drafter.layers[0].named_modules()
            if isinstance(m, nn.Linear)]
    ops.append(_attention("layer.attention (KV cache)", b, dims.num_attention_heads, dims.num_key_value_heads,
                          dims.head_dim, bs, context + bs, new_tokens + bs, e, n))
    ops.append(_linear("lm_head (S slots, target's weights)", b * (bs - 1), dims.hidden_size,
                       int(drafter.target_config.vocab_size), False, e))
    return ops


def head_round_ops(
    head: LiLiCorrHead, num_slots: int | None = None, top_k: int | None = None, batch: int = 1,
    bytes_per_element: int = 2,
) -> list[Op]:
    """The LiLiCorr head's part of one round, as :meth:`~lilicorr_pl.heads.lilicorr.LiLiCorrHead.select` computes it.

    Args:
        head: a built head (``build`` on the meta device is enough).
        num_slots: drafted slots ``S`` (default ``block_size - 1``).
        top_k: lattice width ``K`` (default the head's).
        batch: blocks scored together.
        bytes_per_element: 2 for bf16.

    Top-K and the log-softmax read the slot logits; the ``S·K`` candidates' embeddings are gathered; node
    vectors, the lattice transformer over ``N = S·K`` nodes, the factor heads, and the pair scores
    ``out[s] @ in[s+1]ᵀ`` (``S - 1`` products of ``K × F`` by ``F × K``, fp32) follow.
    """
    if not head.is_built:
        raise ValueError("head_round_ops needs a built head: call head.build(hidden_size, vocab_size, block_size=B)")
    e, m = bytes_per_element, batch
    s = head.block_size - 1 if num_slots is None else num_slots
    k = head.top_k if top_k is None else top_k
    nodes, hidden, vocab, d = s * k, int(head.target_hidden_size), int(head.vocab_size), head.hidden_size
    heads, n_layers, layer = head.num_heads, head.num_layers, head.layers[0]
    ops = [
        Op("top-K of slot logits", 0.0, 0.0, e * m * s * vocab),
        Op("log-softmax normaliser of slot logits", 0.0, 0.0, e * m * s * vocab),
        _gather("candidate embedding gather", m * nodes, hidden, e),
    ]
    if isinstance(head.token_proj, nn.Linear):
        ops.append(_module_linear("token_proj", head.token_proj, m * nodes, e))
    ops += [
        _module_linear("pass_hidden_proj", head.pass_hidden_proj, m * s, e),
        _module_linear("feature_mlp.up_proj", head.feature_mlp.up_proj, m * nodes, e),
        _module_linear("feature_mlp.down_proj", head.feature_mlp.down_proj, m * nodes, e),
        Op("attention bias (built once, read per layer)", 0.0, 0.0, e * heads * nodes * nodes * (1 + n_layers)),
        _linear("layer.attn.in_proj (q, k, v)", m * nodes, d, 3 * d, True, e, n_layers),
        _attention("layer.attention", m, heads, heads, d // heads, nodes, nodes, 0, e, n_layers),
        _module_linear("layer.attn.out_proj", layer.attn.out_proj, m * nodes, e, n_layers),
        _module_linear("layer.mlp.up_proj", layer.mlp.up_proj, m * nodes, e, n_layers),
        _module_linear("layer.mlp.down_proj", layer.mlp.down_proj, m * nodes, e, n_layers),
        _module_linear("context_proj", head.context_proj, m, e),
        # factor_input_proj over [h, a, h ⊙ a], run as three products (the anchor's once per block).
        _linear("factor_input_proj (node)", m * nodes, d, d, True, e),
        _linear("factor_input_proj (anchor)", m, d, d, False, e),
        _linear("factor_input_proj (node ⊙ anchor)", m * nodes, d, d, False, e),
        _module_linear("out_head", head.out_head, m * nodes, e),
        _module_linear("in_head", head.in_head, m * nodes, e),
        _module_linear("anchor_out_head", head.anchor_out_head, m, e),
        Op("pair scores out[s] @ in[s+1]ᵀ (fp32)", 2.0 * m * (s - 1) * k * k * head.factor_dim, 0.0,
           4.0 * m * (s - 1) * (2 * k * head.factor_dim + k * k)),
    ]
    return ops


@dataclass
class RoundCost:
    """The kernels of one speculative round, by part."""

    target: list[Op]
    drafter: list[Op]
    head: list[Op]

    def parts(self) -> dict[str, list[Op]]:
        return {"target": self.target, "drafter": self.drafter, "head": self.head}

    def summary(self, device: Roofline) -> dict[str, Any]:
        """FLOPs, bytes and roofline seconds per part and for the round; ``head_share`` of the round's time."""
        out: dict[str, Any] = {}
        for name, ops in [*self.parts().items(), ("round", self.target + self.drafter + self.head)]:
            out[name] = {
                "flops": sum(op.count * op.flops for op in ops),
                "weight_bytes": sum(op.count * op.weight_bytes for op in ops),
                "other_bytes": sum(op.count * op.other_bytes for op in ops),
                "bytes": sum(op.count * op.bytes for op in ops),
                "seconds": sum(op.seconds(device) for op in ops),
            }
        out["head_share"] = out["head"]["seconds"] / out["round"]["seconds"]
        out["head_share_of_drafting"] = out["head"]["seconds"] / (out["head"]["seconds"] + out["drafter"]["seconds"])
        return out


def round_cost(
    target_config: Any,
    drafter: DFlashDrafter,
    head: LiLiCorrHead,
    context: int = 2048,
    tau: float = 6.0,
    batch: int = 1,
    bytes_per_element: int = 2,
) -> RoundCost:
    """All kernels of one round at these shapes; see :func:`target_round_ops` and its siblings."""
    if context < 0 or tau < 1 or batch < 1 or bytes_per_element < 1:
        raise ValueError(
            f"need context >= 0, tau >= 1 (tokens committed per round), batch >= 1 and bytes_per_element >= 1; got "
            f"{context}, {tau}, {batch}, {bytes_per_element}"
        )
    bs = drafter.block_size
    return RoundCost(
        target=target_round_ops(target_config, bs, context, batch, bytes_per_element),
        drafter=drafter_round_ops(drafter, context, tau, batch, bytes_per_element),
        head=head_round_ops(head, bs - 1, None, batch, bytes_per_element),
    )


def _merged_yaml(paths: Sequence[str]) -> dict[str, Any]:
    import yaml

    merged: dict[str, Any] = {}
    for path in paths:
        with open(path) as fh:
            merged = deep_merge(merged, yaml.safe_load(fh) or {})
    return merged


def _model_section(configs: Sequence[str] | Mapping[str, Any]) -> dict[str, Any]:
    """``model`` of ``lilicorr fit`` config files merged in order, or of an already parsed config (``{"model": …}``:
    the command's own, with its ``--model.*`` overrides applied)."""
    merged = dict(configs) if isinstance(configs, Mapping) else _merged_yaml(configs)
    return dict(merged.get("model") or {})


def _component(spec: Any, expected: type, key: str) -> Any:
    if not isinstance(spec, dict) or str(spec.get("class_path", "")).rsplit(".", 1)[-1] != expected.__name__:
        found = spec.get("class_path") if isinstance(spec, dict) else spec
        raise ValueError(f"the cost model needs {key} = {expected.__name__}, the config gives {found!r}")
    return expected(**(spec.get("init_args") or {}))


_POSITIVE_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings")
"""Target shape fields a ``--target_overrides`` must keep positive integers (0 layers was an IndexError)."""


def load_round_modules(
    configs: Sequence[str] | Mapping[str, Any], target_config: str | None = None,
    target_overrides: dict[str, Any] | None = None, device: str | torch.device = "meta",
) -> tuple[Any, DFlashDrafter, LiLiCorrHead]:
    """Target config, drafter and LiLiCorr head of ``lilicorr fit`` config files (or a parsed config, see
    :func:`_model_section`), built on ``device`` (default: the meta device, shapes only; elsewhere with fresh random
    weights).

    ``target_config``: a ``config.json`` (or a directory holding one) to read the target's shapes from;
    default: ``model.target.name_or_path`` (a local directory, or a hub name already in the local cache).
    ``target_overrides``: config fields to change first (e.g. ``{"num_hidden_layers": 32, "hidden_size": 96}``),
    to cost a target shape that does not exist yet. At another depth explicit ``model.target.layer_ids`` are scaled
    to the same relative layers (the last stays the last) and the attention pattern (``layer_types``) is repeated;
    without explicit ids the default rule picks them at the new depth.
    """
    from transformers import AutoConfig

    from lilicorr_pl.builtin import is_builtin, resolve_target_path, unbuilt_target_config
    from lilicorr_pl.target import check_feature_count, default_layer_ids, refuse_drafter

    model = _model_section(configs)
    target = model.get("target") or {}
    source = target_config or target.get("name_or_path")
    if not source:
        raise ValueError("no target to read shapes from: set model.target.name_or_path in a -c file or pass --target-config")
    try:
        # A builtin: target not built yet: the config its build will have (shapes are all this reads), not a build.
        config = unbuilt_target_config(str(source)) if is_builtin(str(source)) else None
        if config is None:
            config = AutoConfig.from_pretrained(resolve_target_path(str(source)))
    except (OSError, ValueError) as err:
        raise ValueError(
            f"could not read the target config {source!r} ({first_line(err, with_type=True)}); pass --target-config "
            "with a config.json, e.g. configs/qwen3-8b/Qwen3-8B.config.json"
        ) from None
    # A drafter's config here was costed as a target with the drafter's sizes (or refused for its mask token).
    refuse_drafter(config, str(source), "--target_config" if target_config else "model.target.name_or_path")
    layers = int(config.num_hidden_layers)
    overrides = dict(target_overrides or {})
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise ValueError(f"--target_overrides: the target config has no field {key!r}")
        if key in _POSITIVE_FIELDS and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"--target_overrides: {key} must be a positive integer, got {value!r}")
        setattr(config, key, value)
    heads, kv_heads = int(config.num_attention_heads), int(getattr(config, "num_key_value_heads", None) or 0)
    if overrides and kv_heads and heads % kv_heads:  # the drafter's refusal named its own settings, not these
        raise ValueError(f"--target_overrides: the target's num_attention_heads {heads} is not a multiple of its "
                         f"num_key_value_heads {kv_heads}; override both to a shape a model can have")
    depth = int(config.num_hidden_layers)
    if depth != layers and getattr(config, "layer_types", None) and "layer_types" not in overrides:
        pattern = list(config.layer_types)  # the same attention pattern, repeated to the new depth
        config.layer_types = [pattern[i % len(pattern)] for i in range(depth)]
    layer_ids = target.get("layer_ids")
    if layer_ids:  # as fit refuses it: a count beside the list that disagrees with it
        check_feature_count(layer_ids, target.get("num_features"))
    if not layer_ids:  # the default rule, at the depth being costed
        layer_ids = default_layer_ids(depth, min(int(target.get("num_features", 5)), depth))
    elif depth != layers:  # explicit ids at another depth: the same relative layers (the last stays the last)
        scale = (depth - 1) / max(layers - 1, 1)
        scaled = sorted({round(i * scale) for i in layer_ids})
        if len(scaled) != len(layer_ids):
            raise ValueError(
                f"model.target.layer_ids {list(layer_ids)} of {layers} layers do not stay {len(layer_ids)} distinct "
                f"layers at {depth} ({scaled}); set model.target.layer_ids for that depth"
            )
        layer_ids = scaled
    drafter = _component(model.get("drafter"), DFlashDrafter, "model.drafter")
    head = _component(model.get("head"), LiLiCorrHead, "model.head")
    with torch.device(device):
        drafter.build(config, layer_ids)
        head.build(config.hidden_size, config.vocab_size, block_size=drafter.block_size,
                   rms_norm_eps=drafter.dims.rms_norm_eps)
    return config, drafter, head


def check_tau(tau: float | None, block_size: int) -> float:
    """τ counts a round's committed tokens, the bonus included: between 1 and the block size (None: 6, or the block
    size when that is smaller)."""
    if tau is None:
        return float(min(6, block_size))
    if not 1.0 <= tau <= block_size:
        raise ValueError(f"--tau {tau:g} is not a possible acceptance length for a block of {block_size}: a round "
                         f"commits 1 to {block_size} tokens (the bonus token included); use 1 <= --tau <= {block_size}")
    return float(tau)


def round_timing(
    config: Sequence[str] | Mapping[str, Any],
    target_config: str | None = None,
    target_overrides: dict[str, Any] | None = None,
    context: int | None = None,
    new_tokens: int = 32,
    prompts: int = 12,
    tau: float | None = None,
    device: str = "cpu",
    compile: bool = False,
    seed: int = 0,
    json_path: str | None = None,
    dtype: str | torch.dtype | None = None,
    compile_mode: str = "default",
) -> dict[str, Any]:
    """Measure one speculative round on this machine at a config's shapes, against one plain decoding step.

    The measured counterpart of :func:`cost_report`, answering before any training whether speculative decoding
    can pay here: the target (from its config, with ``target_overrides``), the config's DFlash drafter and LiLiCorr
    head, all with **random weights** (the time of a pass does not depend on them; no weights are downloaded),
    decode ``prompts`` random prompts of ``context`` tokens with the project's own ``target_generate`` and
    ``speculative_generate`` (top-1 and the LiLiCorr head), interleaved prompt by prompt
    (:func:`~lilicorr_pl.decoding.evaluate.evaluate_arms`, T = 0). Random drafts are rejected, so every round
    commits one token and the drafter appends one feature per round where a trained one appends τ.

    ``dtype``: of the target, drafter and head (default: ``model.target.dtype`` of the -c files).
    ``compile_mode``: ``torch.compile``'s mode for the head with ``compile`` (``"reduce-overhead"``: CUDA graphs).

    Returns:
        ``{"settings", "plain_step_ms", "arms": {"top1"|"lilicorr": {"tau", "round_ms", "draft_ms", "head_ms",
        "verify_ms", "bookkeeping_ms", "round_cost_ratio", "break_even_tau", "speedup_at_tau"}}}``:
        ``round_cost_ratio`` = round / plain step, the τ at which speculative decoding breaks even;
        ``speedup_at_tau`` = ``tau / round_cost_ratio``, the decode-loop speedup a drafter accepted at ``tau``
        would give (prefill excluded).
    """
    from transformers import AutoModelForCausalLM

    from lilicorr_pl.decoding.benchmarks import PromptSet
    from lilicorr_pl.decoding.evaluate import ArmSpec, evaluate_arms
    from lilicorr_pl.heads.top1 import Top1Selector
    from lilicorr_pl.target import FrozenTarget, check_device, resolve_dtype

    check_device(device)
    if new_tokens < 2:
        raise ValueError(f"--new_tokens {new_tokens}: the first token comes from the prefill, so time at least 2")
    from lilicorr_pl.decoding.compiled import check_compile_available, check_compile_mode, compiled_wrappers

    check_compile_mode(compile_mode, compile, device)
    if compile:
        check_compile_available(device, fix="run without --compile")
    # The shapes first, on the meta device (nothing allocated), so a context past the target's positions is refused
    # before anything is built.
    target_cfg, drafter, _ = load_round_modules(config, target_config, target_overrides)
    tau = check_tau(tau, drafter.block_size)
    limit = int(getattr(target_cfg, "max_position_embeddings", 0) or 0)
    if context is None:  # 64 tokens, or as many as the target's positions leave room for (the tiny config's 64)
        context = max(1, min(64, limit - new_tokens - drafter.block_size)) if limit else 64
    if limit and context + new_tokens + drafter.block_size > limit:
        raise ValueError(
            f"--context {context} + --new_tokens {new_tokens} + a block of {drafter.block_size} runs past the target's "
            f"{limit} positions; lower --context or --new_tokens"
        )
    # Built where they run, in the run's dtype: an 8B-shaped target initialised on the CPU in float32 first would
    # take minutes and 32 GB of host memory before a GPU timed anything.
    target_cfg, drafter, head = load_round_modules(config, target_config, target_overrides, device=device)
    if dtype is None:
        dtype = (_model_section(config).get("target") or {}).get("dtype", "float32")
    dtype = resolve_dtype(dtype)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(target_cfg, dtype=dtype)  # random weights
    target = FrozenTarget(model.eval(), layer_ids=drafter.target_layer_ids)
    drafter, head = drafter.to(device=device, dtype=dtype).eval(), head.to(device=device, dtype=dtype).eval()
    generator = torch.Generator().manual_seed(seed)
    vocab = min(int(target_cfg.vocab_size), int(getattr(target_cfg, "mask_token_id", None) or target_cfg.vocab_size))
    ids = [torch.randint(0, vocab, (context,), generator=generator).tolist() for _ in range(prompts)]
    prompt_set = PromptSet("random", ids, [""] * prompts, chat_template=False, enable_thinking=False)
    selectors: dict[str, Any] = {"top1": Top1Selector(), "lilicorr": head}
    if compile:
        from lilicorr_pl.decoding.compiled import compile_selectors

        selectors = compile_selectors(selectors, compile_mode)
    arms = {name: ArmSpec(drafter, selector) for name, selector in selectors.items()}
    reference, results = evaluate_arms(target, arms, prompt_set, new_tokens, 0.0, seed=seed, stop_token_ids=[],
                                       timing=torch.device(device).type == "cuda")
    step = plain_step_ms(reference)
    out: dict[str, Any] = {
        "settings": {
            "target": f"{type(target_cfg).__name__.removesuffix('Config')} ({target_cfg.num_hidden_layers} layers, "
                      f"hidden {target_cfg.hidden_size}, intermediate {target_cfg.intermediate_size}, vocab "
                      f"{target_cfg.vocab_size})",
            "target_layer_ids": list(drafter.target_layer_ids), "drafter_layers": drafter.num_layers,
            "block_size": drafter.block_size, "head_top_k": head.top_k, "context": context, "new_tokens": new_tokens,
            "prompts": prompts, "tau": tau, "device": device, "dtype": str(dtype).removeprefix("torch."),
            "compiled_head": compile, "compile_mode": compile_mode if compile else None,
            "compile_wrapper": compiled_wrappers(selectors.values()), "threads": torch.get_num_threads(),
            "weights": "random",
        },
        "plain_step_ms": step,
        "arms": {},
    }
    for name, r in results.items():
        out["arms"][name] = {
            "tau": r.tau, "round_ms": r.round_ms, "draft_ms": r.draft_ms, "head_ms": r.head_ms, "verify_ms": r.verify_ms,
            "bookkeeping_ms": r.bookkeeping_ms, "round_cost_ratio": r.round_cost_ratio,
            "verify_cost_ratio": r.verify_ms / step, "break_even_tau": r.round_cost_ratio,
            "speedup_at_tau": tau / r.round_cost_ratio,
        }
    print(format_round_timing(out))
    if json_path:
        write_results_json(Path(json_path), out, "perf")
    return out


def format_round_timing(result: dict[str, Any]) -> str:
    """The table :func:`round_timing` prints."""
    st = result["settings"]
    lines = [
        f"one speculative round, measured ({st['device']}, {st['dtype']}, {st['threads']} threads, random weights): "
        f"target {st['target']}, layers {st['target_layer_ids']} read by a {st['drafter_layers']}-layer DFlash "
        f"drafter, block {st['block_size']}; context {st['context']}, {st['prompts']} prompts x {st['new_tokens']} "
        f"tokens; head " + (f"compiled ({st.get('compile_mode') or 'default'}"
                            + (f", {st['compile_wrapper']} wrapper" if st.get("compile_wrapper") else "") + ")"
                            if st.get("compiled_head") else "eager"),
        f"plain decoding step: {result['plain_step_ms']:.2f} ms",
        f"{'selector':<10} {'draft':>7} {'head':>7} {'verify':>7} {'other':>7} {'round ms':>9} "
        f"{'verify/step':>11} {'round/step':>10} {'speedup at tau ' + format(st['tau'], 'g'):>18}",
    ]
    for name, a in result["arms"].items():
        lines.append(
            f"{name:<10} {a['draft_ms']:>7.2f} {a['head_ms']:>7.2f} {a['verify_ms']:>7.2f} {a['bookkeeping_ms']:>7.2f} "
            f"{a['round_ms']:>9.2f} {a['verify_cost_ratio']:>11.2f} {a['round_cost_ratio']:>10.2f} "
            f"{a['speedup_at_tau']:>17.2f}x"
        )
    lines.append("round/step is the tau (bonus token included) at which speculative decoding breaks even")
    accepted = {name: a["tau"] for name, a in result["arms"].items() if a["tau"] > 1.2}
    if accepted:  # random drafts are meant to be rejected: one token, one appended feature per round
        lines.append(f"note: random drafts were accepted (tau {accepted}); rounds appended more than one feature")
    return "\n".join(lines)


def cost_report(
    config: Sequence[str] | Mapping[str, Any],
    target_config: str | None = None,
    context: int | None = None,
    tau: float | None = None,
    batch: int = 1,
    gpu: str = "h100",
    peak_tflops: float | None = None,
    bandwidth_tbs: float | None = None,
    bytes_per_element: int = 2,
    json_path: str | None = None,
    target_overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Print FLOPs, bytes and roofline time of one speculative round of target, drafter and LiLiCorr head.

    Args:
        config: ``lilicorr fit`` config file(s), later ones overriding earlier ones; the drafter and the head
            are built from ``model.drafter`` and ``model.head`` on the meta device (no weights, no memory).
        target_config: the target's ``config.json`` (file or directory); default ``model.target.name_or_path``.
        context: tokens in the KV caches when the round starts (prompt + generated so far); default 2,048, or as
            many as the target's positions leave room for beside a block.
        tau: tokens committed per round, 1 to the block size (the drafter appends their features next round;
            default 6, or the block size when that is smaller).
        batch: sequences decoded together.
        gpu: roofline preset, ``h100`` or ``h200``.
        peak_tflops: override the preset's dense bf16 TFLOP/s.
        bandwidth_tbs: override the preset's memory bandwidth in TB/s.
        bytes_per_element: 2 = bf16 serving.
        json_path: also write the numbers (and every kernel) here.
        target_overrides: target config fields to change first (see :func:`load_round_modules`).

    Returns:
        ``{"settings", "device", "target"/"drafter"/"head"/"round": totals, "head_share", "ops"}``.
    """
    if gpu not in ROOFLINES:
        raise ValueError(f"unknown gpu {gpu!r}; choose from {sorted(ROOFLINES)} or set peak_tflops and bandwidth_tbs")
    preset = ROOFLINES[gpu]
    device = Roofline(
        preset.name if peak_tflops is None and bandwidth_tbs is None else f"{preset.name} (overridden)",
        preset.peak_flops if peak_tflops is None else peak_tflops * 1e12,
        preset.bandwidth if bandwidth_tbs is None else bandwidth_tbs * 1e12,
    )
    target_cfg, drafter, head = load_round_modules(config, target_config, target_overrides)
    tau = check_tau(tau, drafter.block_size)
    limit = int(getattr(target_cfg, "max_position_embeddings", 0) or 0)
    if limit and limit <= drafter.block_size:
        raise ValueError(f"the target's {limit} positions do not hold a context and a block of {drafter.block_size}; "
                         "lower model.drafter.init_args.block_size")
    if context is None:  # 2,048 tokens, or as many as the target's positions leave room for
        context = min(2048, limit - drafter.block_size) if limit else 2048
    if limit and context + drafter.block_size > limit:
        raise ValueError(f"--context {context} + a block of {drafter.block_size} runs past the target's {limit} "
                         "positions; lower --context")
    cost = round_cost(target_cfg, drafter, head, context, tau, batch, bytes_per_element)
    summary = cost.summary(device)
    s, k = drafter.block_size - 1, head.top_k
    result: dict[str, Any] = {
        "settings": {
            "target": f"{type(target_cfg).__name__.removesuffix('Config')} ({target_cfg.num_hidden_layers} layers, "
                      f"hidden {target_cfg.hidden_size}, vocab {target_cfg.vocab_size})",
            "drafter_layers": drafter.num_layers, "block_size": drafter.block_size,
            "head": {"top_k": k, "slots": s, "nodes": s * k, "hidden_size": head.hidden_size,
                     "num_layers": head.num_layers, "factor_dim": head.factor_dim},
            "context": context, "tau": tau, "batch": batch, "bytes_per_element": bytes_per_element,
        },
        "device": {"name": device.name, "peak_flops": device.peak_flops, "bandwidth": device.bandwidth},
        **summary,
        "ops": {part: [{"name": op.name, "count": op.count, "flops": op.flops, "bytes": op.bytes,
                        "seconds": op.seconds(device)} for op in ops] for part, ops in cost.parts().items()},
    }
    print(format_cost(result))
    if json_path:
        write_results_json(Path(json_path), result, "perf")
    return result


def format_cost(result: dict[str, Any]) -> str:
    """The table :func:`cost_report` prints."""
    st, dev = result["settings"], result["device"]
    head = st["head"]
    lines = [
        f"one speculative round: target {st['target']}, DFlash drafter {st['drafter_layers']} layers, block "
        f"{st['block_size']}, LiLiCorr head K {head['top_k']} x S {head['slots']} = {head['nodes']} nodes, "
        f"{head['num_layers']} layers of width {head['hidden_size']}",
        f"context {st['context']} tokens, tau {st['tau']:g}, batch {st['batch']}, {st['bytes_per_element']} bytes/element; "
        f"roofline {dev['name']}: {dev['peak_flops'] / 1e12:g} TFLOP/s, {dev['bandwidth'] / 1e12:g} TB/s",
        f"{'part':<10} {'GFLOP':>9} {'MB moved':>10} {'of which weights':>16} {'FLOP/byte':>10} {'roofline us':>12} {'share':>7}",
    ]
    total = result["round"]["seconds"]
    for part in ("target", "drafter", "head", "round"):
        r = result[part]
        lines.append(
            f"{part:<10} {r['flops'] / 1e9:>9.2f} {r['bytes'] / 1e6:>10.1f} {r['weight_bytes'] / 1e6:>16.1f} "
            f"{r['flops'] / max(r['bytes'], 1.0):>10.1f} {r['seconds'] * 1e6:>12.1f} {100 * r['seconds'] / total:>6.2f}%"
        )
    lines.append(
        f"head share of the round: {100 * result['head_share']:.2f} % (of drafter + head: "
        f"{100 * result['head_share_of_drafting']:.2f} %); the paper measured ~2.8 % of block latency"
    )
    return "\n".join(lines)


def perf_options(
    steps: PositiveInt = 10,
    warmup: NonNegativeInt = 2,
    threads: PositiveInt | None = None,
    json: str | None = None,  # noqa: A002 - the command line's --json
    ckpt: str | None = None,
    penalty_error: bool = False,
    cost_model: bool = False,
    round_timing: bool = False,
    target_config: str | None = None,
    target_overrides: dict[str, Any] | None = None,
    context: PositiveInt | None = None,
    tau: PositiveFloat | None = None,
    batch: PositiveInt = 1,
    gpu: Literal["h100", "h200"] = "h100",
    peak_tflops: PositiveFloat | None = None,
    bandwidth_tbs: PositiveFloat | None = None,
    new_tokens: PositiveInt = 32,
    prompts: PositiveInt = 12,
    device: DeviceName = "cpu",
    compile: bool = False,
    compile_mode: CompileModeName = "default",
    allow_module: Sequence[str] = (),
) -> None:
    """Where the time goes: the options ``lilicorr perf`` adds to ``fit``'s parser.

    Args:
        steps: timed optimisation steps (batches for penalty_error).
        warmup: untimed steps first.
        threads: torch threads (default: torch's choice).
        json: also write the numbers to this JSON file.
        ckpt: load trained drafter/head weights from this checkpoint first (opened weights-only, checksum verified).
        penalty_error: instead of timing, compare the distractor penalty from the cache with exact logits.
        cost_model: instead of timing, print FLOPs, bytes and roofline time of one speculative round (no weights are
            loaded; the shapes come from the -c files, see cost_report).
        round_timing: instead of training steps, measure one speculative round against one plain decoding step on
            this machine at the -c files' shapes, with random weights (see round_timing).
        target_config: cost model / round timing: the target's config.json (default: model.target.name_or_path).
        target_overrides: cost model / round timing: target config fields to change, e.g.
            '{"num_hidden_layers": 32, "hidden_size": 96, "intermediate_size": 288}' (a shape that does not exist yet).
        context: cost model / round timing: tokens in the KV caches (default 2048 / 64, capped by what the
            target's positions leave room for).
        tau: cost model: tokens committed per round; round timing: the τ its predicted speedup assumes (1 to the
            block size, the bonus token included; default 6, or the block size when that is smaller).
        batch: cost model: sequences decoded together.
        gpu: cost model: roofline preset.
        peak_tflops: cost model: override the preset's dense bf16 TFLOP/s.
        bandwidth_tbs: cost model: override the preset's memory bandwidth (TB/s).
        new_tokens: round timing: tokens generated per prompt.
        prompts: round timing: random prompts, each decoded plainly and with each selector, interleaved (12:
            two whole cycles of the balanced orders of plain decoding, top-1 and the head).
        device: round timing: where to run (cpu, cuda, cuda:1, mps).
        compile: round timing: run the LiLiCorr head through torch.compile (as the demo's benchmark does).
        compile_mode: round timing: torch.compile's mode for the head; reduce-overhead (CUDA only) also captures it
            in a CUDA graph, as the engines serve it.
        allow_module: also trust components from these packages when the --ckpt checkpoint names them (as for
            ``bench`` and ``export``).
    """


class PerfCLI(LilicorrCLI):
    """``fit``'s parser (model, data, trainer from the same config files) plus :func:`perf_options` at the top level."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        super().add_arguments_to_parser(parser)
        parser.add_function_arguments(perf_options, nested_key=None, as_group=True)
        # perf loads weights with --ckpt only: a resumed fit's ckpt_path is named in the printout, never loaded.
        add_saved_fit_arguments(parser, "perf (weights come from --ckpt)")

    def check_before_building(self, config: Any, subcommand: str | None) -> None:
        # perf's own files first: fit's checks end by resolving a `builtin:` target, which may build it (minutes).
        self._check_perf_files(config)
        if not (config.get("cost_model") or config.get("round_timing")):  # shapes only: no data is built
            super().check_before_building(config, subcommand)

    def _check_perf_files(self, config: Any) -> None:
        """``--json`` and ``--ckpt``, before anything is built or a target resolved."""
        from lilicorr_pl.checkpoint import UserInputError
        from lilicorr_pl.command import expand_home, shipped_config_path
        from lilicorr_pl.files import check_output_paths

        for name in ("json", "ckpt", "target_config"):  # a leading ~ is the user's home, as in a shell: expanded
            config[name] = expand_home(name, config.get(name))  # before the output check below
        if config.get("target_config"):  # configs/qwen3-8b/Qwen3-8B.config.json: shipped, as -c files are found
            config["target_config"] = shipped_config_path(str(config.target_config))
        if config.get("json") is not None and not str(config.json).strip():  # an unset shell variable: no file
            raise UserInputError("--json is empty; pass the file to write the numbers into, or drop --json")
        try:  # every mode writes --json at its end: an unwritable one is refused before anything is built
            check_output_paths(config.get("json"), None, "--json", command="perf")
        except ValueError as err:
            raise UserInputError(str(err)) from None
        # Checked before anything is built: weights-only, checksum verified, trusted components only.
        self.checkpoint = None
        if config.get("ckpt") and (config.get("cost_model") or config.get("round_timing")):
            raise UserInputError(f"--ckpt is not read by --{'cost_model' if config.get('cost_model') else 'round_timing'}"
                                 ", which times the config's shapes with fresh weights; drop --ckpt (it is read by the "
                                 "training-step timing and --penalty_error)")
        if config.get("ckpt"):
            from lilicorr_pl.checkpoint import check_class_paths, config_modules, read_checkpoint
            from lilicorr_pl.system import plain_data

            self.checkpoint = read_checkpoint(config.ckpt)
            # perf builds from the -c files: the modules they name are trusted, as in fit; others need --allow-module.
            allowed = [*(config.get("allow_module") or ()), *config_modules(plain_data(config.get("model")))]
            check_class_paths(self.checkpoint.get("hyper_parameters") or {}, config.ckpt, allowed)

    def before_instantiate_classes(self) -> None:
        super().before_instantiate_classes()  # a builtin: target not built yet
        if self.config.get("threads"):
            torch.set_num_threads(self.config.threads)
        if self.config.get("ckpt_path"):
            print(f"lilicorr perf: ckpt_path {self.config.ckpt_path} (fit's resume checkpoint) is not loaded; "
                  + ("weights come from --ckpt" if self.config.get("ckpt") else "pass --ckpt to time or check trained weights"))

    def instantiate_classes(self) -> None:
        if not (self.config.get("cost_model") or self.config.get("round_timing")):  # they build their own modules
            super().instantiate_classes()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``lilicorr perf -c CONFIG [-c OVERLAY] [--steps N] [--ckpt CKPT] [--penalty_error] [--model.x=...]``.

    Builds the system and data exactly as ``lilicorr fit`` would from the same config files and overrides,
    then times (or, with ``--penalty_error``, compares) real steps; ``--cost_model`` prints the analytical cost
    of one round instead. Returns the numbers it prints.
    """
    from lilicorr_pl.checkpoint import UserInputError

    os.environ.setdefault("WANDB_MODE", "disabled")
    args = argparse_spellings(sys.argv[1:] if argv is None else argv, type_hints(perf_options))
    if not any(a in ("-c", "--config") or a.startswith("--config=") for a in args) and "--help" not in args:
        raise UserInputError("-c/--config is required: the config file(s) of the run to measure, as for `lilicorr fit`")
    cli = run_lightning(args, description=__doc__ or "", cli_class=PerfCLI, prog="lilicorr perf", run=False,
                        save_config_callback=None)
    options = cli.config
    if options.cost_model and options.round_timing:
        raise UserInputError("--cost_model and --round_timing are two reports; ask for one per run")
    if (options.compile or options.compile_mode != "default") and not options.round_timing:
        raise UserInputError("--compile and --compile_mode set how --round_timing runs the head; add --round_timing "
                             "true or drop them")
    if options.cost_model or options.round_timing:
        from lilicorr_pl.system import plain_data

        configs = {"model": plain_data(options.model)}  # the -c files with the command line's --model.* applied
        overrides = dict(options.target_overrides or {})
        try:
            if options.cost_model:
                return cost_report(configs, options.target_config, options.context, options.tau,
                                   options.batch, options.gpu, options.peak_tflops, options.bandwidth_tbs,
                                   json_path=options.json, target_overrides=overrides)
            return round_timing(configs, options.target_config, overrides, options.context, options.new_tokens,
                                options.prompts, options.tau, options.device, options.compile, json_path=options.json,
                                dtype=options.model.target.dtype, compile_mode=options.compile_mode)
        except (ValueError, OSError) as err:
            raise UserInputError(str(err)) from None
    system, dm = cli.model, cli.datamodule
    trainer = options.get("trainer") or {}
    try:
        # How a step runs, as fit's Trainer runs it, where a step is timed (--penalty_error times none).
        step = {} if options.penalty_error else {
            "precision": step_precision(trainer.get("precision")),
            "gradient_clip_val": trainer.get("gradient_clip_val"),
            "gradient_clip_algorithm": trainer.get("gradient_clip_algorithm")}
        if options.penalty_error:
            if dm.feature_cache:  # exact candidate logits come from the online target, which offline features replace
                raise UserInputError("--penalty_error compares the logit store with exact logits from the online "
                                     "target, but data.feature_cache: true runs without it; add "
                                     "--data.feature_cache=false")
            if not system.needs_target_logits:
                raise UserInputError("--penalty_error measures the distractor penalty, and no active loss in "
                                     "model.losses reads target logits; pass the config of a run that trains with "
                                     "DistractorPenalty (weight > 0)")
            if dm.logit_cache_setting is False:
                raise UserInputError("--penalty_error compares the logit store with exact logits, and "
                                     "data.logit_cache: false turns the store off; add --data.logit_cache=true")
            # The check compares the store with exact logits, whatever the training run would read.
            dm.require_logit_cache(True, "lilicorr perf --penalty_error reads the target-logit store "
                                         "(to compare it with exact logits)")
        else:  # timing: the data exactly as `lilicorr fit` builds it for this config
            system.check_offline_features(dm.feature_cache)
            wire_logit_cache(system, dm)
    except ValueError as err:  # model and data settings that contradict each other: one line, before any work
        raise UserInputError(str(err)) from None
    if cli.checkpoint is not None:  # before the data stores are built: weights that do not fit are one line
        from lilicorr_pl.heads.domino import first_form_refusal
        from lilicorr_pl.system import StateMismatchError

        refusal = first_form_refusal((cli.checkpoint.get("hyper_parameters") or {}).get("head"), system.head,
                                     f"--ckpt {options.ckpt}")
        if refusal:
            raise UserInputError(refusal)

        try:
            system.load_state_dict(cli.checkpoint["state_dict"])
        except StateMismatchError as err:
            raise UserInputError(f"--ckpt {options.ckpt} does not fit the system the -c files build ({first_line(err)}); pass "
                                 "the -c files of the run that trained it") from None
    dm.prepare_data()
    dm.setup("fit")
    batches = [b for _, b in zip(range(max(4, options.steps)), dm.train_dataloader())]
    # What the JSON's numbers were measured with (it held the numbers alone): the weights, steps and threads, and the
    # settings timed (the -c files with the command line applied: shapes, batch, anchors, the target; two files of
    # other configs could not be told apart) on which device.
    from lilicorr_pl.system import plain_data

    measured_with = {"ckpt": os.path.abspath(options.ckpt) if options.ckpt else None,
                     "state_sha256": (cli.checkpoint.get("lilicorr") or {}).get(CHECKSUM_KEY) if cli.checkpoint else None,
                     "threads": torch.get_num_threads(), "malloc": malloc_policy(),
                     "device": str(next(system.drafter.parameters()).device),
                     "config": {key: plain_data(options.get(key)) for key in ("model", "data")}}
    if options.penalty_error:
        result = penalty_cache_error(system, batches[: options.steps])
        for k, v in result.items():
            print(f"{k:<16} {v:.6g}")
        if options.json:
            # It compares batches (at most --steps, at most an epoch's): the record names what was read, no steps.
            measured_with.update(max_batches=options.steps, batches=result["batches"])
            write_results_json(Path(options.json), {**result, "measured_with": measured_with}, "perf")
        return result
    measured_with.update(steps=options.steps, **step)
    result = profile_steps(system, batches, options.steps, options.warmup, **step)
    total = result["step_total"]
    print(f"{'phase':<16} {'ms/step':>10} {'share':>7}   (threads={torch.get_num_threads()}, steps={options.steps})")
    for k in ("target", "drafter", "head", "losses", "other_forward", "backward", "optimizer", "step_total"):
        if k in result:
            print(f"{k:<16} {1000 * result[k]:>10.1f} {100 * result[k] / total:>6.1f}%")
    if "context_memo_hit_rate" in result:
        print(f"context memo: on, timed in its steady state ({100 * result['context_memo_hit_rate']:.0f} % of the "
              "timed steps' examples served from it; model.context_memo_mb=0 times the plain drafter forward)")
    if options.json:
        write_results_json(Path(options.json), {**result, "measured_with": {**measured_with, "warmup": options.warmup}},
                           "perf")
    return result
