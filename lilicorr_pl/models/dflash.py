"""DFlash block-diffusion drafter (DESIGN.md section 3).

A stack of Qwen3-style decoder layers at the target's width. The target's context features are
fused once (``hidden_norm(fc(concat))``) and injected into *every* layer as extra keys/values
through that layer's own ``k_proj``/``k_norm``/RoPE and ``v_proj``. A block ``[anchor, MASK x S]``
attends bidirectionally to itself and to context strictly before its anchor; the output at slot
``k >= 1`` predicts the token at ``anchor_pos + k`` through the target's LM head.

Plain PyTorch: no Lightning imports. The target's embedding and LM head are passed in at call time
(``embed``/``lm_head`` callables) so they are never registered here and never saved with the drafter.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RotaryEmbedding

from lilicorr_pl.models.norm import RMSNorm

EmbedFn = Callable[[torch.Tensor], torch.Tensor]
LMHeadFn = Callable[[torch.Tensor], torch.Tensor]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x [b, heads, T, d]`` with ``cos``/``sin [b, T, d]`` (Qwen3/Llama half-rotation)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


@dataclass
class DrafterDims:
    """Sizes of a drafter, derived from the target config unless overridden."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    num_features: int


class DFlashAttention(nn.Module):
    """Self-attention of one draft layer with context KV injection."""

    def __init__(self, dims: DrafterDims) -> None:
        super().__init__()
        h, d = dims.hidden_size, dims.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = dims.num_attention_heads, dims.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        # Qwen3 order: per-head RMSNorm on q and k, *before* RoPE; V is never normed.
        self.q_norm = RMSNorm(d, eps=dims.rms_norm_eps)
        self.k_norm = RMSNorm(d, eps=dims.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim).transpose(1, 2)  # [b, n, t, d]

    def project_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k_norm then RoPE) and values for ``x [b, t, H]`` -> ``[b, kv_heads, t, d]`` each."""
        k = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), cos, sin)
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        return k, v

    def forward(
        self,
        x: torch.Tensor,  # [b, Tq, H] input-normed block tokens
        cos_q: torch.Tensor,
        sin_q: torch.Tensor,
        ctx_k: torch.Tensor,  # [b, kv, Tc, d] keys of the context (already normed + roped)
        ctx_v: torch.Tensor,
        mask: Any = None,  # bool [b, 1, Tq, Tc+Tq] (SDPA) or a FlexAttention BlockMask or None
        cache: tuple[DraftCache, int] | None = None,
    ) -> torch.Tensor:
        """``cache = (draft_cache, layer)`` at inference: the context K/V are read from the cache and the
        block's are written after it in place (``ctx_k``/``ctx_v`` are then ignored)."""
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), cos_q, sin_q)
        k_blk, v_blk = self.project_kv(x, cos_q, sin_q)
        if cache is not None:
            draft_cache, layer = cache
            k, v = draft_cache.write(layer, draft_cache.length, k_blk, v_blk)
        else:
            k = torch.cat([ctx_k, k_blk], dim=2)
            v = torch.cat([ctx_v, v_blk], dim=2)
        if mask is not None and not isinstance(mask, torch.Tensor):
            out = _flex_attention(q, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


_compiled_flex: Any = None


def _flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    kind = q.device.type
    if torch.is_autocast_enabled(kind):
        # Under bf16-mixed, q/k leave the fp32 RMSNorm weights in fp32 while v is bf16. SDPA casts all three to
        # the autocast dtype; FlexAttention does so only in recent torch, so cast here for both paths to agree.
        dtype = torch.get_autocast_dtype(kind)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=True)
    # Eager flex materialises the scores; only used on CPU to check it agrees with the dense path.
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)


class DFlashLayer(nn.Module):
    """One Qwen3-style draft decoder layer; the context enters only as keys/values."""

    def __init__(self, dims: DrafterDims, mlp_config: Any) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(dims.hidden_size, eps=dims.rms_norm_eps)
        self.self_attn = DFlashAttention(dims)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, eps=dims.rms_norm_eps)
        self.mlp = Qwen3MLP(mlp_config)

    def forward(self, h, cos_q, sin_q, ctx_k, ctx_v, mask=None, cache=None) -> torch.Tensor:  # noqa: ANN001
        h = h + self.self_attn(self.input_layernorm(h), cos_q, sin_q, ctx_k, ctx_v, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


def _slot_logits(slots: torch.Tensor, lm_head: LMHeadFn) -> torch.Tensor:
    """The LM head over slot states ``[..., S, H]`` as one matrix product -> ``[..., S, V]``.

    Slots are a strided view of the blocks (slot 0 dropped). Handed to ``matmul`` as is, such a view
    is not folded into a matrix and the product runs as a batched matmul with the ``[V, H]`` weight
    expanded per block. Measured on CPU at H 160, V 4160: training-size input (4 x 32 blocks of 8)
    forward + backward 94 -> 50 ms; one block at inference: no measurable difference, same values.
    """
    flat = slots.reshape(-1, slots.shape[-1])  # a view for one block; a small copy for many
    return lm_head(flat).view(*slots.shape[:-1], -1)


@dataclass
class DraftContext:
    """A training forward's per-context-token work (:meth:`DFlashDrafter.encode_context`)."""

    fused: torch.Tensor  # [b, T, H] hidden_norm(fc(features))
    keys: list[torch.Tensor]  # per layer [b, kv, T, d]: k_norm, RoPE at positions 0..T-1
    values: list[torch.Tensor]  # per layer [b, kv, T, d]


class ContextMemo:
    """A frozen drafter's :class:`DraftContext` per training example, kept in memory up to ``max_bytes``.

    A head trained on a frozen drafter sees every sequence many times (the demo's head stage: each about 140
    times), and the context half of the drafter's forward -- ``fc`` over the
    concatenated features and every layer's context K/V, most of its FLOPs at a block of 8 -- depends only on
    the sequence and the weights. The memo computes it once per example (its first batch) and then assembles
    batches from it; rows are zero past each example's length (as the padded forward computes them from stored
    features; the online target's features there are not zero, but no block attends past its anchor). Keyed
    by the drafter's parameters (identity, storage, device, dtype, in-place version): a weight change or a move
    empties it.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self.bytes = 0
        self._rows: dict[int, tuple[torch.Tensor, ...]] = {}  # example -> (fused [n, H], k_0, v_0, k_1, ...)
        self._key: tuple[Any, ...] | None = None
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._rows)

    def clear(self, counts: bool = False) -> None:
        """Drop every stored context (and, with ``counts``, the hit and miss counts too)."""
        self._rows.clear()
        self.bytes = 0
        if counts:
            self.hits = self.misses = 0

    @property
    def hit_rate(self) -> float:
        """The share of examples served from the memo since the counts were last reset (nan before any)."""
        seen = self.hits + self.misses
        return self.hits / seen if seen else float("nan")

    def context(self, drafter: DFlashDrafter, features: torch.Tensor, index: torch.Tensor,
                lengths: torch.Tensor) -> DraftContext:
        """The batch's context: ``features [b, T, n*H]`` of examples ``index [b]`` with ``lengths [b]`` real tokens."""
        if any(p.requires_grad for p in drafter.parameters()):
            raise RuntimeError("ContextMemo needs a frozen drafter (its context would be trained, not reused)")
        # Identity, storage, device, dtype and in-place version of every weight: a load, an optimizer step or a move
        # (``.to``) is never answered with another drafter's context.
        key = tuple((id(p), p.data_ptr(), p.device, p.dtype, p._version) for p in drafter.parameters())
        if key != self._key:
            self.clear()
            self._key = key
        b, t, _ = features.shape
        ids, sizes = index.tolist(), lengths.tolist()
        missing = [r for r, i in enumerate(ids) if i not in self._rows]
        self.hits += b - len(missing)
        self.misses += len(missing)
        with torch.no_grad():
            if missing:
                computed = drafter.encode_context(features if len(missing) == b else features[missing])
            fresh: dict[int, tuple[torch.Tensor, ...]] = {}
            for j, r in enumerate(missing):
                n = int(sizes[r])
                row = (computed.fused[j, :n].clone(), *(x[j, :, :n].clone()
                                                        for kv in zip(computed.keys, computed.values) for x in kv))
                fresh[r] = row
                size = sum(x.numel() * x.element_size() for x in row)
                if ids[r] not in self._rows and self.bytes + size <= self.max_bytes:
                    self._rows[ids[r]] = row
                    self.bytes += size
            if len(missing) == b:
                return computed
            rows = [fresh[r] if r in fresh else self._rows[ids[r]] for r in range(b)]
            fused = rows[0][0].new_zeros(b, t, rows[0][0].shape[-1])  # zeros past each length
            kv = [x.new_zeros(b, x.shape[0], t, x.shape[-1]) for x in rows[0][1:]]
            for r, row in enumerate(rows):
                n = int(sizes[r])
                fused[r, :n] = row[0]
                for buf, x in zip(kv, row[1:]):
                    buf[r, :, :n] = x
        return DraftContext(fused, kv[0::2], kv[1::2])


@dataclass
class DraftOutput:
    """Drafter outputs for a set of blocks."""

    slot_hidden: torch.Tensor  # [..., S, H] final-normed hidden states of slots 1..S
    slot_logits: torch.Tensor  # [..., S, V] target-LM-head logits of slots 1..S
    anchor_feature: torch.Tensor  # [..., H] fused context feature at anchor_pos - 1 (zeros if none)
    anchor_feature_valid: torch.Tensor  # [...] bool


class DraftCache:
    """Per-layer context keys/values of one drafting session (inference, DESIGN §3.3).

    Only context persists between calls: each draft appends the new context, runs the block, and the
    block's keys/values are never committed (equivalent to cropping back to the context length).

    Storage is preallocated per layer (``keys[i]``/``values[i]``: ``[b, kv_heads, capacity, d]``, valid
    up to ``length``) and grows geometrically, so appending is an in-place write rather than a
    concatenation of the whole context every round (quadratic over a generation). The block is written
    as scratch right after the context and simply overwritten by the next append.
    """

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0
        self.last_ctx: torch.Tensor | None = None  # [b, H] fused feature of the last context position

    @property
    def capacity(self) -> int:
        """Positions the buffers hold before they must grow (0 before the first write)."""
        return 0 if self.keys[0] is None else int(self.keys[0].shape[2])

    def write(
        self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v [b, kv, t, d]`` at positions ``start..start+t-1`` of ``layer``; views of ``< start+t``.

        Does not move ``length``: the caller commits context by setting it (the block never is).
        """
        end = start + k.shape[2]
        buf_k, buf_v = self.keys[layer], self.values[layer]
        if buf_k is None or buf_k.shape[2] < end:
            old = 0 if buf_k is None else buf_k.shape[2]
            cap = max(end, 2 * old, 64)  # geometric growth: O(total length) copying over a generation
            new_k = k.new_empty(k.shape[0], k.shape[1], cap, k.shape[3])
            new_v = v.new_empty(v.shape[0], v.shape[1], cap, v.shape[3])
            if buf_k is not None and start > 0:
                new_k[:, :, :start] = buf_k[:, :, :start]
                new_v[:, :, :start] = buf_v[:, :, :start]
            self.keys[layer], self.values[layer] = buf_k, buf_v = new_k, new_v
        buf_k[:, :, start:end] = k
        buf_v[:, :, start:end] = v
        return buf_k[:, :, :end], buf_v[:, :, :end]

    def crop(self, length: int) -> None:
        """Drop context positions ``>= length`` (e.g. to roll back a rejected suffix)."""
        if length > self.length:
            raise ValueError(f"cannot crop a draft cache of length {self.length} to {length}")
        if length == self.length:
            return
        self.length = length  # the buffers keep their storage; the next write overwrites the tail
        self.last_ctx = None  # unknown after a crop; the next append supplies it


class DFlashDrafter(nn.Module):
    """DFlash block-diffusion drafter.

    Sizes not given are taken from the target config in :meth:`build`, as the published drafters do.

    Args:
        num_layers: draft decoder layers (5 for the published Qwen3-4B/8B drafters).
        block_size: block length ``B`` including the anchor slot (16 published; 8 also common).
        mask_token_id: target embedding row used as MASK; None = the target config's ``mask_token_id``
            attribute, else Qwen3's 151669.
        intermediate_size: MLP width; None = the target's.
        num_attention_heads: None = the target's.
        num_key_value_heads: None = the target's.
        head_dim: None = the target's.
        attention: ``"auto"`` (compiled FlexAttention on CUDA when ``head_dim >= 16``, dense SDPA otherwise),
            ``"sdpa"`` or ``"flex"`` (on CPU: eager FlexAttention, slow, for checking only).
    """

    def __init__(
        self,
        num_layers: int = 5,
        block_size: int = 16,
        mask_token_id: int | None = None,
        intermediate_size: int | None = None,
        num_attention_heads: int | None = None,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        attention: Literal["auto", "sdpa", "flex"] = "auto",
    ) -> None:
        super().__init__()
        if block_size < 2:
            raise ValueError(
                f"block_size must be >= 2 (one anchor slot plus at least one drafted slot), got "
                f"{block_size}; set model.drafter.init_args.block_size"
            )
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if attention not in ("auto", "sdpa", "flex"):
            raise ValueError(f"attention must be 'auto', 'sdpa' or 'flex', got {attention!r}")
        for key, size in (("intermediate_size", intermediate_size), ("num_attention_heads", num_attention_heads),
                          ("num_key_value_heads", num_key_value_heads), ("head_dim", head_dim)):
            if size is not None and size < 1:  # 0 was read as unset: the target's size, without a word
                raise ValueError(f"model.drafter.init_args.{key} must be >= 1 (or null: the target's), got {size}")
        if head_dim is not None and head_dim % 2:  # a traceback in RoPE at the first step, after the data were made
            raise ValueError(f"model.drafter.init_args.head_dim must be even (RoPE rotates its two halves), got "
                             f"{head_dim}")
        self.num_layers = num_layers
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.attention = attention
        self._overrides = dict(
            intermediate_size=intermediate_size,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            head_dim=head_dim,
        )
        self.dims: DrafterDims | None = None
        self.target_layer_ids: list[int] = []
        self.layers = nn.ModuleList()

    # ------------------------------------------------------------------ construction
    @property
    def num_slots(self) -> int:
        return self.block_size - 1

    @property
    def built(self) -> bool:
        return self.dims is not None

    def build(self, target_config: Any, target_layer_ids: Sequence[int]) -> DFlashDrafter:
        """Create the parameters for a target (idempotent). Uses only the config, never weights."""
        if self.built:
            return self
        tc = target_config
        ov = self._overrides
        n_heads = ov["num_attention_heads"] or tc.num_attention_heads
        dims = DrafterDims(
            hidden_size=tc.hidden_size,
            intermediate_size=ov["intermediate_size"] or tc.intermediate_size,
            num_attention_heads=n_heads,
            num_key_value_heads=ov["num_key_value_heads"] or getattr(tc, "num_key_value_heads", n_heads),
            head_dim=ov["head_dim"] or getattr(tc, "head_dim", None) or tc.hidden_size // n_heads,
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            num_features=len(target_layer_ids),
        )
        if dims.num_attention_heads % dims.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {dims.num_attention_heads} is not a multiple of num_key_value_heads "
                f"{dims.num_key_value_heads}; fix model.drafter.init_args"
            )
        if self.mask_token_id is None:
            recorded = getattr(tc, "mask_token_id", None)  # an id of 0 is a real row, not a missing one
            self.mask_token_id = 151669 if recorded is None else int(recorded)
        rows = int(tc.vocab_size)
        if not 0 <= self.mask_token_id < rows:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the target vocabulary ({rows} rows); "
                "set model.drafter.init_args.mask_token_id to a real (e.g. padded) embedding row"
            )
        self.dims = dims
        self.target_layer_ids = [int(i) for i in target_layer_ids]
        self.target_config = copy.deepcopy(tc)  # kept for RoPE and export; not a parameter
        mlp_config = copy.deepcopy(tc)
        mlp_config.intermediate_size = dims.intermediate_size
        mlp_config.hidden_act = getattr(tc, "hidden_act", "silu")
        h = dims.hidden_size
        self.fc = nn.Linear(dims.num_features * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, eps=dims.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(dims, mlp_config) for _ in range(self.num_layers))
        self.norm = RMSNorm(h, eps=dims.rms_norm_eps)
        rope_config = copy.deepcopy(tc)
        rope_config.head_dim = dims.head_dim
        self.rotary_emb = Qwen3RotaryEmbedding(rope_config)  # the target's θ / scaling; buffer not saved
        self.reset_parameters()
        return self

    def reset_parameters(self) -> None:
        std = getattr(self.target_config, "initializer_range", 0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)

    def _require_built(self) -> DrafterDims:
        if self.dims is None:
            raise RuntimeError("DFlashDrafter.build(target_config, layer_ids) must be called before use")
        return self.dims

    # ------------------------------------------------------------------ pieces
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(concat_features))``: computed once per context token, shared by all layers."""
        self._require_built()
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def _rope(self, ref: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary_emb(ref, positions)

    def _block_embeddings(self, anchor_ids: torch.Tensor, embed: EmbedFn) -> torch.Tensor:
        """``[anchor, MASK x S]`` embeddings from the frozen target table: ``anchor_ids [...]`` -> ``[..., B, H]``."""
        ids = anchor_ids.unsqueeze(-1).expand(*anchor_ids.shape, self.block_size).clone()
        ids[..., 1:] = self.mask_token_id
        return embed(ids).to(self.fc.weight.dtype)

    def encode_context(self, features: torch.Tensor) -> DraftContext:
        """The per-context-token work of a training forward (``features [b, T, n*H]``, positions ``0..T-1``):
        the fused features and every layer's context keys/values. It depends only on the sequence and the
        weights, so a frozen drafter can reuse it (:class:`ContextMemo`)."""
        self._require_built()
        b, t, _ = features.shape
        fused = self.fuse(features)  # [b, T, H]
        # RoPE tables in the dtype of the block tokens (the fc weights'), as for the block's own positions.
        ref = torch.empty(0, dtype=self.fc.weight.dtype, device=features.device)
        cos_c, sin_c = self._rope(ref, torch.arange(t, device=features.device).expand(b, t))
        kv = [layer.self_attn.project_kv(fused, cos_c, sin_c) for layer in self.layers]
        return DraftContext(fused, [k for k, _ in kv], [v for _, v in kv])

    def _run_layers(self, h, cos_q, sin_q, context, mask):  # noqa: ANN001
        for layer, ctx_k, ctx_v in zip(self.layers, context.keys, context.values):
            h = layer(h, cos_q, sin_q, ctx_k, ctx_v, mask)
        return self.norm(h)

    # ------------------------------------------------------------------ training forward
    def forward(
        self,
        features: torch.Tensor,  # [b, T, n*H] target features of the whole sequence
        input_ids: torch.Tensor,  # [b, T]
        anchor_positions: torch.Tensor,  # [b, N] long, positions of the anchors (0 <= p < T)
        embed: EmbedFn,
        lm_head: LMHeadFn,
        attention: str | None = None,
        context: DraftContext | None = None,
    ) -> DraftOutput:
        """Many blocks per sequence in one pass (DESIGN §3.2).

        Keys are ``[T context | N*B block tokens]``; block ``n`` sees context positions
        ``< anchor_positions[n]`` and its own ``B`` tokens, nothing else.
        Returns slot outputs shaped ``[b, N, S, ...]``. ``context``: :meth:`encode_context` of ``features``
        computed earlier (a frozen drafter's memo); ``features`` are then not read.
        """
        self._require_built()
        b, t = input_ids.shape
        n = anchor_positions.shape[1]
        bs = self.block_size
        if context is None:
            context = self.encode_context(features)
        ctx = context.fused  # [b, T, H]
        anchors = anchor_positions.clamp(0, t - 1)
        anchor_ids = input_ids.gather(1, anchors)  # [b, N]
        h = self._block_embeddings(anchor_ids, embed).reshape(b, n * bs, -1)  # [b, N*B, H]
        offsets = torch.arange(bs, device=input_ids.device)
        pos_blk = (anchors.unsqueeze(-1) + offsets).reshape(b, n * bs)  # [b, N*B]
        cos_q, sin_q = self._rope(h, pos_blk)
        mode = attention or self.attention
        flex_ok = self.dims.head_dim >= 16  # FlexAttention's CUDA (Triton) kernel needs head_dim >= 16
        if mode == "auto":
            mode = "flex" if input_ids.is_cuda and flex_ok else "sdpa"
        elif mode == "flex" and input_ids.is_cuda and not flex_ok:
            raise ValueError(
                f"attention='flex' on CUDA needs head_dim >= 16 (FlexAttention's kernel), this drafter has "
                f"{self.dims.head_dim}; set model.drafter.init_args.attention to 'auto' or 'sdpa'"
            )
        mask = (
            self._flex_block_mask(anchors, t, n)
            if mode == "flex"
            else self._dense_mask(anchors, t, n)
        )
        h = self._run_layers(h, cos_q, sin_q, context, mask)
        slots = h.view(b, n, bs, -1)[:, :, 1:]  # slot 0 (the anchor) is discarded
        logits = _slot_logits(slots, lm_head)
        prev = (anchors - 1).clamp(min=0)
        anchor_feature = ctx.gather(1, prev.unsqueeze(-1).expand(b, n, ctx.shape[-1]))
        valid = anchors > 0
        anchor_feature = anchor_feature * valid.unsqueeze(-1).to(anchor_feature.dtype)
        return DraftOutput(slots, logits, anchor_feature, valid)

    def _dense_mask(self, anchors: torch.Tensor, t: int, n: int) -> torch.Tensor:
        bs = self.block_size
        dev = anchors.device
        q_block = torch.arange(n * bs, device=dev) // bs  # [NB]
        ctx_ok = torch.arange(t, device=dev).view(1, 1, t) < anchors.gather(
            1, q_block.expand(anchors.shape[0], -1)
        ).unsqueeze(-1)  # [b, NB, T]
        blk_ok = (q_block.view(-1, 1) == q_block.view(1, -1)).expand(anchors.shape[0], -1, -1)
        return torch.cat([ctx_ok, blk_ok], dim=-1).unsqueeze(1)  # [b, 1, NB, T+NB]

    def _flex_block_mask(self, anchors: torch.Tensor, t: int, n: int) -> Any:
        from torch.nn.attention.flex_attention import create_block_mask

        bs = self.block_size

        def mask_mod(b, h, q_idx, kv_idx):  # noqa: ANN001, ARG001
            q_blk = q_idx // bs
            in_ctx = (kv_idx < t) & (kv_idx < anchors[b, q_blk])
            same_blk = (kv_idx >= t) & ((kv_idx - t) // bs == q_blk)
            return in_ctx | same_blk

        return create_block_mask(
            mask_mod, anchors.shape[0], None, n * bs, t + n * bs, device=str(anchors.device)
        )

    # ------------------------------------------------------------------ inference forward
    def new_cache(self) -> DraftCache:
        return DraftCache(self.num_layers)

    def draft(
        self,
        cache: DraftCache,
        new_features: torch.Tensor | None,  # [b, t, n*H] features of positions cache.length .. +t-1
        anchor_ids: torch.Tensor,  # [b] the anchor token, at position cache.length + t
        embed: EmbedFn,
        lm_head: LMHeadFn,
    ) -> DraftOutput:
        """Append context, draft one block at the next position, keep only the context (DESIGN §3.3)."""
        self._require_built()
        b = anchor_ids.shape[0]
        start = cache.length
        t_new = 0 if new_features is None else new_features.shape[1]
        anchor_pos = start + t_new
        h = self._block_embeddings(anchor_ids, embed)  # [b, B, H]
        # One RoPE call for the new context and the block (positions start .. anchor_pos + B - 1).
        positions = torch.arange(start, anchor_pos + self.block_size, device=anchor_ids.device).expand(b, -1)
        cos, sin = self._rope(h, positions)
        cos_q, sin_q = cos[:, t_new:], sin[:, t_new:]
        if t_new > 0:
            ctx = self.fuse(new_features)  # [b, t, H]
            cos_c, sin_c = cos[:, :t_new], sin[:, :t_new]
            for i, layer in enumerate(self.layers):
                ctx_k, ctx_v = layer.self_attn.project_kv(ctx, cos_c, sin_c)
                cache.write(i, start, ctx_k, ctx_v)
            cache.last_ctx = ctx[:, -1]
        cache.length = anchor_pos  # the context is committed; the block below is scratch only
        # One block: bidirectional over itself and all cached context, so no mask is needed.
        for i, layer in enumerate(self.layers):
            h = layer(h, cos_q, sin_q, None, None, None, (cache, i))
        h = self.norm(h)
        slots = h[:, 1:]
        valid = torch.full((b,), anchor_pos > 0 and cache.last_ctx is not None, device=anchor_ids.device)
        anchor_feature = cache.last_ctx if cache.last_ctx is not None else h.new_zeros(b, h.shape[-1])
        return DraftOutput(slots, _slot_logits(slots, lm_head), anchor_feature, valid)


# ---------------------------------------------------------------------- anchors and labels
def sample_anchors(
    loss_mask: torch.Tensor,  # [b, T] bool, supervised (response) tokens
    num_anchors: int,
    generator: torch.Generator | None = None,
    min_position: int = 1,
    response_start_prob: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw up to ``num_anchors`` distinct anchors per sequence among supervised positions.

    An anchor must itself be a supervised token at position ``>= min_position`` (so it has context)
    and must have at least one position after it. Sequences with fewer eligible positions get
    padding anchors marked invalid. Returns ``(anchor_positions [b, N] long, anchor_valid [b, N])``,
    sorted by position. Vectorised: random keys + top-k, no Python loop over sequences.

    ``response_start_prob``: with this probability per sequence, one of its anchors is the first token of a
    supervised span (a response's first token: the anchor of the block every generation drafts first, right
    after the prompt; with several spans, one of their starts at random). Uniform draws give that block one
    chance in a response's length. 0 (the default) draws exactly as before: the same random numbers.
    """
    if not 0.0 <= response_start_prob <= 1.0:
        raise ValueError(f"response_start_prob must be in [0, 1], got {response_start_prob}")
    b, t = loss_mask.shape
    eligible = loss_mask.bool().clone()
    eligible[:, :min_position] = False
    eligible[:, t - 1 :] = False
    keys = torch.rand(b, t, generator=generator, device="cpu").to(loss_mask.device)
    keys = torch.where(eligible, keys, torch.full_like(keys, -1.0))
    if response_start_prob > 0:
        mask = loss_mask.bool()
        starts = mask & ~F.pad(mask[:, :-1], (1, 0), value=False) & eligible  # [b, t]
        start_keys = torch.rand(b, t, generator=generator, device="cpu").to(loss_mask.device)
        pick = torch.where(starts, start_keys, torch.full_like(start_keys, -1.0)).argmax(1)  # [b]
        coin = torch.rand(b, generator=generator, device="cpu").to(loss_mask.device) < response_start_prob
        chosen = coin & starts.any(1)
        # A key above every uniform one: the chosen start is always among the top-k.
        rows = torch.arange(b, device=keys.device)
        keys[rows[chosen], pick[chosen]] = 2.0
    n = min(num_anchors, t)
    top, idx = keys.topk(n, dim=1)
    valid = top >= 0
    pos = torch.where(valid, idx, torch.zeros_like(idx))
    # Sort valid anchors by position, invalid ones last.
    order_key = torch.where(valid, pos, torch.full_like(pos, t + 1))
    order = order_key.argsort(dim=1)
    return pos.gather(1, order), valid.gather(1, order)


def block_labels(
    input_ids: torch.Tensor,  # [b, T]
    loss_mask: torch.Tensor,  # [b, T]
    anchor_positions: torch.Tensor,  # [b, N]
    anchor_valid: torch.Tensor,  # [b, N]
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same-position labels: slot ``k`` of the block at ``p`` is labelled by ``input_ids[p + k]``.

    Returns ``(labels [b, N, S], label_mask [b, N, S], label_positions [b, N, S])``; slots past the
    sequence end, outside the loss mask, or in invalid blocks are masked out.
    """
    b, t = input_ids.shape
    k = torch.arange(1, block_size, device=input_ids.device)
    pos = anchor_positions.unsqueeze(-1) + k  # [b, N, S]
    inside = pos < t
    safe = pos.clamp(max=t - 1)
    flat = safe.reshape(b, -1)
    labels = input_ids.gather(1, flat).view_as(pos)
    supervised = loss_mask.bool().gather(1, flat).view_as(pos)
    mask = inside & supervised & anchor_valid.unsqueeze(-1)
    return labels, mask, safe
