"""The LiLiCorr lattice-correction head (DESIGN §4.2).

It keeps the drafter's top-K candidates per slot, encodes all ``S·K`` nodes with a light
bidirectional transformer, scores every adjacent candidate pair in one batched matmul of unit
vectors, and walks the lattice greedily. Its only sequential part is a K-wide argmax per slot.

The modules are the reference head's, one for one, under the names the serving engines load
(``LiLiCorrDraftModel``: SGLang, vLLM, TensorRT-LLM; written by Model-Optimizer's ``LiLiCorrExporter``):
``state_dict()`` keys are the exported ``lilicorr.*`` tensor names without the prefix, and every
shape is the exported shape, so export is a renaming and never an approximation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lilicorr_pl.heads.base import EmbedFn, HeadOutput, Lattice, Selection, SelectContext, Selector, TeacherForcing
from lilicorr_pl.heads.lattice import DECODERS, Decode, candidate_log_probs, sample_walk
from lilicorr_pl.models.dflash import DraftOutput
from lilicorr_pl.models.norm import RMSNorm

NUM_CONFIDENCE_FEATURES = 5
"""Per-candidate features, in the order the first feature Linear reads them: log-prob (full-vocabulary
log-softmax), prob, log-prob gap to the slot's best candidate, rank fraction ``r/(k-1)``, is-top-1."""
_INIT_STD = 0.02  # the reference's initializer_range for every Linear of the head


class _LatticeAttention(nn.Module):
    """Multi-head self-attention with ``nn.MultiheadAttention``'s parameters (packed ``in_proj``).

    Same tensors as ``nn.MultiheadAttention(width, heads, batch_first=True)`` — ``in_proj_weight``
    ``[3D, D]`` (q, k, v stacked), ``in_proj_bias [3D]``, ``out_proj`` — run through SDPA with an
    additive per-head bias, as the serving engines run it.
    """

    def __init__(self, width: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.dropout = dropout
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * width))
        self.out_proj = nn.Linear(width, width)
        nn.init.xavier_uniform_(self.in_proj_weight)  # nn.MultiheadAttention's own init

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        m, n, d = x.shape
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)  # [M, N, 3D]
        q, k, v = (t.view(m, n, self.num_heads, d // self.num_heads).transpose(1, 2) for t in qkv.chunk(3, -1))
        dropout = self.dropout if self.training else 0.0
        bias = bias.to(q.dtype)
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            # Training: the same function written out. With a bias that takes gradient, SDPA runs its math
            # fallback plus a fully-masked-row check over every [M, heads, N, N] score: about twice as slow.
            # q is scaled before the product and the bias added in place: two passes fewer over the scores
            # (exact when the scale is a power of two, as at a head width of 16).
            scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-1, -2)).add_(bias)
            attn = torch.matmul(F.dropout(scores.softmax(dim=-1), dropout), v)
        else:
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout)
        return self.out_proj(attn.transpose(1, 2).reshape(m, n, d))  # attn: [M, heads, N, d_head]


class _MLP(nn.Module):
    """``down_proj(SiLU(up_proj(x)))`` with biases: the named MLP form the engines load."""

    def __init__(self, width_in: int, width_mid: int, width_out: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(width_in, width_mid)
        self.down_proj = nn.Linear(width_mid, width_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.up_proj(x)))


class _LatticeLayer(nn.Module):
    """Pre-RMSNorm transformer layer; every node attends to every node, with an additive bias."""

    def __init__(self, width: int, num_heads: int, mlp_ratio: float, rms_norm_eps: float, dropout: float) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(width, eps=rms_norm_eps)
        self.attn = _LatticeAttention(width, num_heads, dropout)
        self.mlp_norm = RMSNorm(width, eps=rms_norm_eps)
        self.mlp = _MLP(width, int(width * mlp_ratio), width)  # int(): the engines' rounding
        # No dropout module at all when p = 0 (the recipe): one op less per residual in every decoding round.
        self.resid_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.resid_dropout(self.attn(self.attn_norm(x), bias))
        return x + self.resid_dropout(self.mlp(self.mlp_norm(x)))


class LiLiCorrHead(Selector):
    """LiLiCorr: rerank the drafter's top-K lattice with pairwise factors and a greedy walk.

    The reference head, module for module (SGLang / vLLM / TensorRT-LLM ``LiLiCorrDraftModel``).
    Defaults are the published recipe for an 8B target; scale ``hidden_size`` and ``factor_dim`` down
    for small targets. Parameters are created by :meth:`build` once the target's hidden and vocabulary
    sizes and the drafter's block size are known.
    """

    name = "lilicorr"
    uses_lattice = True

    def __init__(
        self,
        top_k: int = 8,
        hidden_size: int = 1024,
        num_layers: int = 2,
        num_heads: int = 8,
        mlp_ratio: float = 2.0,
        factor_dim: int = 1024,
        vector_eps: float = 1e-4,
        logit_scale: float = 8.0,
        decode: Decode = "greedy",
        serve_top_k: int | None = None,
        block_size: int | None = None,
        rms_norm_eps: float | None = None,
        dropout: float = 0.0,
    ) -> None:
        """
        Args:
            top_k: lattice width K, candidates kept per slot during training
                (``lilicorr_candidate_topk``). Serving may use any ``k <= top_k`` (rank-ordered
                features); vLLM serves only K in {1, 2, 4, 8, 16}.
            hidden_size: width of the lattice transformer (``lilicorr_hidden_size``), not the
                target's size; the candidate embeddings get a ``token_proj`` only when it differs.
            num_layers: lattice transformer layers.
            num_heads: attention heads per layer; must divide ``hidden_size``.
            mlp_ratio: transformer MLP width as a multiple of ``hidden_size`` (truncated to an int).
            factor_dim: width of the unit in/out/anchor factor vectors (``lilicorr_factor_dim``).
            vector_eps: epsilon of the factor vectors' L2 normalisation (``lilicorr_vector_eps``);
                it changes the scores without changing any shape, so it travels in the export.
            logit_scale: fixed score scale σ (``lilicorr_logit_scale``); scores are ``σ·cosine`` so
                they stay within ``[-σ, σ]``. Not learned: bounded scores stabilise joint training of
                the shared backbone.
            decode: the T = 0 walk, ``"greedy"`` (the method) or ``"viterbi"`` (max-sum ablation);
                sampled drafts (T > 0) always follow the sampled left-to-right walk.
            serve_top_k: lattice width when decoding (:meth:`select`), ``1 <= serve_top_k <= top_k``; training
                always keeps ``top_k``. None: ``top_k``. A serving-time choice, as in the engines
                (``lilicorr bench --lattice_k``).
            block_size: the drafter's block size B; sizes the slot embedding (``B - 1`` slots) and the
                relative-slot bias (``2B - 1`` offsets). None: follow the drafter (the system passes it
                to :meth:`build`). A head built for B also scores shorter blocks (the learned prefix).
            rms_norm_eps: epsilon of the head's RMSNorms. None: the drafter's (the engines build the
                head's norms with the checkpoint's ``rms_norm_eps``; 1e-6 when built standalone).
            dropout: dropout in the lattice transformer (0 in the recipe; no parameters).
        """
        super().__init__()
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}; the recipe uses 8")
        if hidden_size < 1 or num_layers < 1 or factor_dim < 1 or num_heads < 1:
            raise ValueError(
                f"hidden_size, num_layers, num_heads and factor_dim must be positive, got {hidden_size}, "
                f"{num_layers}, {num_heads}, {factor_dim}"
            )
        if hidden_size % num_heads != 0:
            raise ValueError(
                f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}; "
                f"choose e.g. num_heads={_largest_divisor(hidden_size, num_heads)}"
            )
        if int(hidden_size * mlp_ratio) < 1:
            raise ValueError(f"mlp_ratio {mlp_ratio} gives an empty MLP at hidden_size {hidden_size}")
        if not 0.0 < vector_eps < 0.5:
            raise ValueError(f"vector_eps must be in (0, 0.5), got {vector_eps}; the recipe uses 1e-4")
        if decode not in DECODERS:
            raise ValueError(f"decode must be one of {DECODERS}, got {decode!r}")
        if logit_scale <= 0:
            raise ValueError(f"logit_scale (σ) must be positive, got {logit_scale}; the recipe uses 8.0")
        if serve_top_k is not None and not 1 <= serve_top_k <= top_k:
            raise ValueError(f"serve_top_k {serve_top_k} is outside 1..{top_k}: a head trained with K={top_k} can "
                             f"serve any k <= {top_k}")
        if block_size is not None and block_size < 2:
            raise ValueError(f"block_size must be >= 2 (one speculative slot), got {block_size}")
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.mlp_ratio = float(mlp_ratio)
        self.factor_dim = factor_dim
        self.vector_eps = float(vector_eps)
        self.logit_scale = float(logit_scale)
        self.decode = decode
        self.serve_top_k = serve_top_k
        self.block_size = block_size
        self.rms_norm_eps = None if rms_norm_eps is None else float(rms_norm_eps)
        self.dropout = dropout

    @property
    def scale(self) -> float:
        """σ, the fixed score scale (alias of :attr:`logit_scale`)."""
        return self.logit_scale

    # ------------------------------------------------------------------ construction

    def build(
        self,
        hidden_size: int,
        vocab_size: int,
        *,
        block_size: int | None = None,
        rms_norm_eps: float | None = None,
    ) -> "LiLiCorrHead":
        """Create the layers for a target with hidden size ``hidden_size`` and ``vocab_size`` rows.

        ``block_size`` and ``rms_norm_eps`` are the drafter's; they fill the init args left at None
        and must agree with the ones set. Idempotent for the same sizes; a different size after
        building is an error (the parameters would not fit the checkpoint).
        """
        if self.top_k > vocab_size:
            raise ValueError(
                f"LiLiCorrHead top_k {self.top_k} is larger than the target vocabulary ({vocab_size} "
                f"rows); set model.head.init_args.top_k <= {vocab_size}"
            )
        if block_size is not None and self.block_size is not None and block_size != self.block_size:
            raise ValueError(
                f"LiLiCorrHead block_size {self.block_size} differs from the drafter's block size {block_size}; "
                "leave model.head.init_args.block_size unset (it follows the drafter) or make them equal"
            )
        if self.block_size is None:
            if block_size is None:
                raise ValueError(
                    "LiLiCorrHead needs the drafter's block size: pass build(..., block_size=B) or "
                    "LiLiCorrHead(block_size=B) (the system passes the drafter's)"
                )
            if block_size < 2:
                raise ValueError(f"block_size must be >= 2 (one speculative slot), got {block_size}")
            self.block_size = int(block_size)
        if rms_norm_eps is not None and self.rms_norm_eps is not None and rms_norm_eps != self.rms_norm_eps:
            raise ValueError(
                f"LiLiCorrHead rms_norm_eps {self.rms_norm_eps} differs from the drafter's {rms_norm_eps}; the "
                "serving engines build the head's norms with the drafter's, so leave it unset"
            )
        if self.rms_norm_eps is None:
            self.rms_norm_eps = float(rms_norm_eps) if rms_norm_eps is not None else 1e-6
        return super().build(hidden_size, vocab_size)

    def _build_layers(self, hidden_size: int, vocab_size: int) -> None:
        d, slots = self.hidden_size, self.block_size - 1
        # Node inputs. Candidate embeddings are used as-is when the head is as wide as the drafter.
        self.token_proj = nn.Identity() if hidden_size == d else nn.Linear(hidden_size, d)
        self.pass_hidden_proj = nn.Linear(hidden_size, d)  # drafter hidden state of the slot
        self.context_proj = nn.Linear(hidden_size, d)  # the anchor (fused context feature)
        self.feature_norm = nn.LayerNorm(NUM_CONFIDENCE_FEATURES)
        self.feature_mlp = _MLP(NUM_CONFIDENCE_FEATURES, d, d)
        # Stored in the serving layout's broadcast shapes: [1, 1, slots, 1, D] and [1, 1, 1, K, D].
        self.slot_embedding = nn.Parameter(torch.zeros(1, 1, slots, 1, d))
        self.rank_embedding = nn.Parameter(torch.zeros(1, 1, 1, self.top_k, d))
        # Per-head relative-slot bias b_h[s_i - s_j] (column offset block_size - 1) and a same-slot
        # bias for the candidates of a node's own slot, the node itself included.
        self.relative_slot_bias = nn.Parameter(torch.zeros(self.num_heads, 2 * self.block_size - 1))
        self.same_slot_bias = nn.Parameter(torch.zeros(self.num_heads))
        self.layers = nn.ModuleList(
            _LatticeLayer(d, self.num_heads, self.mlp_ratio, self.rms_norm_eps, self.dropout)
            for _ in range(self.num_layers)
        )
        self.output_norm = RMSNorm(d, eps=self.rms_norm_eps)
        self.anchor_norm = RMSNorm(d, eps=self.rms_norm_eps)
        # Factor heads: z = SiLU(factor_input_proj([h, a, h ⊙ a])), then unit out/in/anchor vectors.
        self.factor_input_proj = nn.Linear(3 * d, d)
        self.out_head = nn.Linear(d, self.factor_dim)
        self.in_head = nn.Linear(d, self.factor_dim)
        self.anchor_out_head = nn.Linear(d, self.factor_dim)
        for module in self.modules():  # the reference's init: N(0, 0.02) weights, zero biases
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=_INIT_STD)
                nn.init.zeros_(module.bias)

    # ------------------------------------------------------------------ scoring

    def confidence_features(self, candidate_logprobs: torch.Tensor) -> torch.Tensor:
        """The five per-candidate features ``[..., K, 5]`` (fp32) from the candidates' log-probs.

        ``candidate_logprobs [..., K]`` come from the full-vocabulary log-softmax, rank-ordered. The
        rank fraction is ``r / (k - 1)`` over the lattice width in use (0 when ``k = 1``), as the
        reference computes it: 0 for the top-1, 1 for the last candidate. (DESIGN §4.2 writes rank/K;
        the reference's ``k - 1`` is what the engines feed a served head, so it is the one used.)
        """
        lp = candidate_logprobs.float()
        k = lp.shape[-1]
        rank = torch.arange(k, device=lp.device, dtype=lp.dtype)
        return torch.stack(
            [
                lp,
                lp.exp(),
                lp - lp.amax(dim=-1, keepdim=True),
                (rank / max(k - 1, 1)).expand_as(lp),
                (rank == 0).to(lp.dtype).expand_as(lp),
            ],
            dim=-1,
        )

    def score_lattice(
        self,
        slot_hidden: torch.Tensor,
        slot_logits: torch.Tensor,
        anchor_feature: torch.Tensor,
        anchor_valid: torch.Tensor,
        embed: EmbedFn,
        top_k: int | None = None,
    ) -> Lattice:
        """Build the top-K lattice and score it (training and inference).

        Args:
            slot_hidden: ``[M, S, H]`` drafter hidden states of the speculative slots.
            slot_logits: ``[M, S, V]`` live drafter logits; the confidence features keep their
                gradient so lattice losses also train the drafter.
            anchor_feature: ``[M, H]`` fused context feature at ``anchor_pos - 1``.
            anchor_valid: ``[M]`` bool; the projected anchor is zeroed where False.
            embed: token ids -> frozen target input embeddings (always detached here).
            top_k: lattice width to use, ``<= self.top_k`` (default: ``self.top_k``).

        Returns:
            The :class:`Lattice` with ``start`` and ``pair`` scores in ``[-σ, σ]``.
        """
        k = self._check_inputs(slot_hidden, slot_logits, anchor_feature, anchor_valid, top_k)
        m, s, _ = slot_hidden.shape
        d = self.hidden_size
        dtype = self.pass_hidden_proj.weight.dtype
        device = slot_hidden.device

        # 1. Lattice: indices from detached logits; confidence features from live logits.
        candidates = slot_logits.detach().topk(k, dim=-1).indices  # [M, S, K]
        candidate_logprobs = candidate_log_probs(slot_logits, candidates)  # [M, S, K] fp32, live
        features = self.confidence_features(candidate_logprobs)  # [M, S, K, 5]

        # 2. Node vectors.
        with torch.no_grad():
            token_embeddings = embed(candidates)  # [M, S, K, H]
        nodes = (
            self.token_proj(token_embeddings.detach().to(dtype))  # [M, S, K, D]
            + self.pass_hidden_proj(slot_hidden.to(dtype)).unsqueeze(2)  # [M, S, 1, D], shared by the slot
            + self.feature_mlp(self.feature_norm(features.to(dtype)))  # [M, S, K, D]
            + self.slot_embedding[0, 0, :s]  # [S, 1, D]
            + self.rank_embedding[0, 0, 0, :k]  # [K, D]
        )

        # 3. Lattice transformer over all S·K nodes.
        h = nodes.reshape(m, s * k, d)  # [M, N=S·K, D]
        bias = self._bias_for(s, k).unsqueeze(0)  # [1, heads, N, N]
        for layer in self.layers:
            h = layer(h, bias)
        h = self.output_norm(h).view(m, s, k, d)  # [M, S, K, D]

        # 4. The anchor conditions the factor heads only; zero where there is none.
        a = self.context_proj(anchor_feature.to(dtype)) * anchor_valid.to(dtype).unsqueeze(-1)  # [M, D]
        a = self.anchor_norm(a)
        # 5. z = SiLU(W [h, a, h ⊙ a] + b), with W split by input block so neither the concatenation
        #    nor the anchor's copy per node is materialised (same function, less memory).
        w_node, w_anchor, w_cross = self.factor_input_proj.weight.split(d, dim=1)
        a_row = a[:, None, None, :]  # [M, 1, 1, D]
        z = F.silu(
            F.linear(h, w_node, self.factor_input_proj.bias) + F.linear(a_row, w_anchor) + F.linear(h * a_row, w_cross)
        )  # [M, S, K, D]
        out_vec, in_vec, u = self.out_head(z), self.in_head(z), self.anchor_out_head(a)

        # 6. Scores as σ·cosine, in fp32 even under autocast so the bound |score| <= σ holds.
        with torch.autocast(device_type=device.type, enabled=False):
            eps = self.vector_eps
            out_vec = F.normalize(out_vec.float(), dim=-1, eps=eps)  # [M, S, K, F]
            in_vec = F.normalize(in_vec.float(), dim=-1, eps=eps)  # [M, S, K, F]
            u = F.normalize(u.float(), dim=-1, eps=eps)  # [M, F]
            start = self.logit_scale * (u[:, None, :] * in_vec[:, 0]).sum(-1)  # [M, K]
            pair = self.logit_scale * (out_vec[:, :-1] @ in_vec[:, 1:].transpose(-1, -2))  # [M, S-1, K, K]
        return Lattice(candidates=candidates, start=start, pair=pair, candidate_logprobs=candidate_logprobs)

    def forward(self, draft: DraftOutput, context: TeacherForcing) -> HeadOutput:
        """Training call: the scored lattice (live, for the lattice losses) and the walk's tokens."""
        lattice = self.score_lattice(
            draft.slot_hidden, draft.slot_logits, draft.anchor_feature, draft.anchor_feature_valid, context.embed
        )
        with torch.no_grad():
            selected = lattice.tokens_at(lattice.walk(self.decode))  # [M, S]
        return HeadOutput(selected=selected, lattice=lattice)

    def select(self, draft: DraftOutput, context: SelectContext, top_k: int | None = None) -> Selection:
        """Score the lattice and walk it.

        Deterministic (``context.sampling`` is None): the greedy walk, or Viterbi when
        ``decode="viterbi"``. Sampled: :func:`~lilicorr_pl.heads.lattice.sample_walk` — at every slot
        a draw from ``softmax(ψ / T)`` over the ``K`` candidates, ψ the start row at the first slot and
        otherwise the pair row leaving the candidate drawn at the previous slot, with no drafter
        log-prob prior (SGLang's LiLiCorr sampling mode; ``decode`` only chooses the T = 0 walk). The
        proposal ``q`` is that distribution placed on the candidates' token ids (zero elsewhere).

        Args:
            top_k: serve with a narrower lattice ``k <= self.top_k`` (rank-ordered features); default
                ``serve_top_k``.
        """
        lattice = self.score_lattice(
            draft.slot_hidden, draft.slot_logits, draft.anchor_feature, draft.anchor_feature_valid,
            context.embed, self.serve_top_k if top_k is None else top_k,
        )
        if context.sampling is None:
            index = lattice.walk(self.decode)  # [b, S]
            return Selection(tokens=lattice.tokens_at(index), lattice_index=index, lattice=lattice)
        index, q_candidates = sample_walk(lattice.start, lattice.pair, context.sampling)  # [b, S], [b, S, K]
        q = q_candidates.new_zeros(*index.shape, draft.slot_logits.shape[-1])  # [b, S, V]
        q.scatter_(-1, lattice.candidates, q_candidates)  # top-K ids are distinct within a slot
        return Selection(tokens=lattice.tokens_at(index), q=q, lattice_index=index, lattice=lattice)

    # ------------------------------------------------------------------ helpers

    def _bias_for(self, num_slots: int, k: int) -> torch.Tensor:
        """:meth:`attention_bias`, built once per shape when no gradient is recorded (decoding calls the head
        every round with the same ``S`` and ``k``). The cache is keyed by the bias parameters' in-place version
        counters, so an optimizer step or ``load_state_dict`` is never answered with a stale bias."""
        if torch.is_grad_enabled() and (self.relative_slot_bias.requires_grad or self.same_slot_bias.requires_grad):
            return self.attention_bias(num_slots, k)
        if torch.compiler.is_compiling():  # traced (CompiledSelector): the bias becomes part of the fused graph
            return self.attention_bias(num_slots, k)
        params = (self.relative_slot_bias, self.same_slot_bias)
        key = (num_slots, k, params[0].device, params[0].dtype, torch.is_inference_mode_enabled(),
               *(p._version for p in params))
        cached = self.__dict__.get("_bias_cache")  # (key, the parameters it was built from, bias)
        if cached is None or cached[0] != key or any(a is not b for a, b in zip(cached[1], params)):
            with torch.no_grad():
                cached = (key, params, self.attention_bias(num_slots, k))
            self.__dict__["_bias_cache"] = cached
        return cached[2]

    def attention_bias(self, num_slots: int, k: int) -> torch.Tensor:
        """``[heads, N, N]`` additive attention bias over the ``N = S·k`` nodes (slot-major).

        ``relative_slot_bias[h, s_i - s_j + B - 1] + same_slot_bias[h]·[s_i = s_j]``; the same-slot
        term covers every candidate of the node's slot, the node itself included.
        """
        device = self.relative_slot_bias.device
        slot_of_node = torch.arange(num_slots, device=device).repeat_interleave(k)  # [N]
        offset = slot_of_node[:, None] - slot_of_node[None, :]  # [N, N]
        bias = self.relative_slot_bias[:, offset + self.block_size - 1]  # [heads, N, N]
        return bias + self.same_slot_bias[:, None, None] * (offset == 0)

    def _check_inputs(
        self,
        slot_hidden: torch.Tensor,
        slot_logits: torch.Tensor,
        anchor_feature: torch.Tensor,
        anchor_valid: torch.Tensor,
        top_k: int | None,
    ) -> int:
        if not self.is_built:
            raise RuntimeError(
                "LiLiCorrHead has no parameters yet; call head.build(target_hidden_size, vocab_size, "
                "block_size=B) first (the system does this when it constructs the model)"
            )
        if slot_hidden.dim() != 3 or slot_logits.dim() != 3:
            raise ValueError(
                f"expected slot_hidden [M, S, H] and slot_logits [M, S, V], got "
                f"{tuple(slot_hidden.shape)} and {tuple(slot_logits.shape)}"
            )
        m, s, h = slot_hidden.shape
        if h != self.target_hidden_size:
            raise ValueError(
                f"slot_hidden has hidden size {h} but the head was built for {self.target_hidden_size}; "
                f"build the head with the target's hidden_size"
            )
        if slot_logits.shape[:2] != (m, s):
            raise ValueError(
                f"slot_logits {tuple(slot_logits.shape)} and slot_hidden {tuple(slot_hidden.shape)} "
                f"disagree on [M, S]"
            )
        if anchor_feature.shape != (m, h) or anchor_valid.shape != (m,):
            raise ValueError(
                f"expected anchor_feature [{m}, {h}] and anchor_valid [{m}], got "
                f"{tuple(anchor_feature.shape)} and {tuple(anchor_valid.shape)}"
            )
        if not 1 <= s <= self.block_size - 1:
            raise ValueError(
                f"block has {s} speculative slots but this LiLiCorrHead was built for block_size "
                f"{self.block_size} (at most {self.block_size - 1} slots); build it for the drafter's block size"
            )
        k = self.top_k if top_k is None else top_k
        if not 1 <= k <= self.top_k:
            raise ValueError(
                f"top_k {k} is outside 1..{self.top_k}: a head trained with K={self.top_k} can serve "
                f"any k <= {self.top_k}; pass a smaller top_k"
            )
        if k > slot_logits.shape[-1]:
            raise ValueError(
                f"top_k {k} exceeds the {slot_logits.shape[-1]} vocabulary rows of slot_logits; "
                f"use top_k <= {slot_logits.shape[-1]}"
            )
        return k


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, at_most + 1) if n % d == 0)
