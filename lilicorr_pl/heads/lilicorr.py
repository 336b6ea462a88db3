"""The LiLiCorr lattice-correction head (DESIGN §4.2).

It keeps the drafter's top-K candidates per slot, encodes all ``S·K`` nodes with a light
bidirectional transformer, scores every adjacent candidate pair in one batched matmul of unit
vectors, and walks the lattice greedily. Its only sequential part is a K-wide argmax per slot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lilicorr_pl.heads.base import EmbedFn, Lattice, Selection, Selector
from lilicorr_pl.heads.lattice import candidate_log_probs, greedy_walk, viterbi

_DECODERS = ("greedy", "viterbi")
_NUM_CONFIDENCE_FEATURES = 5  # log-prob, prob, log-prob gap to top-1, rank/K, is-top-1
_CONFIDENCE_MLP_WIDTH = 64


class _LatticeBlock(nn.Module):
    """Pre-norm transformer block; every node attends to every node, with an additive bias."""

    def __init__(self, width: int, num_heads: int, mlp_ratio: float, dropout: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.dropout = dropout
        self.attn_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.attn_out = nn.Linear(width, width)
        self.mlp_norm = nn.LayerNorm(width)
        mlp_width = max(1, round(width * mlp_ratio))
        self.mlp = nn.Sequential(
            nn.Linear(width, mlp_width), nn.GELU(), nn.Linear(mlp_width, width), nn.Dropout(dropout)
        )
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        m, n, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(m, n, 3, self.num_heads, d // self.num_heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [M, heads, N, d_head]
        attn = F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias.to(q.dtype), dropout_p=self.dropout if self.training else 0.0
        )  # [M, heads, N, d_head]
        x = x + self.resid_dropout(self.attn_out(attn.transpose(1, 2).reshape(m, n, d)))
        return x + self.mlp(self.mlp_norm(x))


class LiLiCorrHead(Selector):
    """LiLiCorr: rerank the drafter's top-K lattice with pairwise factors and a greedy walk.

    Defaults are the published recipe for an 8B target; scale ``hidden_size`` down for small targets.
    Parameters are created by :meth:`build` once the target's hidden and vocabulary sizes are known.
    """

    uses_lattice = True

    def __init__(
        self,
        top_k: int = 8,
        hidden_size: int = 1024,
        num_layers: int = 2,
        num_heads: int = 8,
        mlp_ratio: float = 2.0,
        scale: float = 8.0,
        decode: str = "greedy",
        max_slots: int = 32,
        dropout: float = 0.0,
    ) -> None:
        """
        Args:
            top_k: lattice width K, candidates kept per slot during training. Serving may use any
                ``k <= top_k`` (the node features are rank-ordered).
            hidden_size: width of the lattice transformer and factor vectors (not the target's size).
            num_layers: lattice transformer layers.
            num_heads: attention heads per layer; must divide ``hidden_size``.
            mlp_ratio: transformer MLP width as a multiple of ``hidden_size``.
            scale: fixed score scale σ; scores are ``σ·cosine`` so they stay within ``[-σ, σ]``.
                Not learned: bounded scores stabilise joint training of the shared backbone.
            decode: ``"greedy"`` (the method) or ``"viterbi"`` (max-sum ablation).
            max_slots: size of the slot-embedding and relative-slot-bias tables; must be at least the
                number of speculative slots ``S = block_size - 1``.
            dropout: dropout in the lattice transformer (0 in the recipe).
        """
        super().__init__()
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}; the recipe uses 8")
        if hidden_size % num_heads != 0:
            raise ValueError(
                f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}; "
                f"choose e.g. num_heads={_largest_divisor(hidden_size, num_heads)}"
            )
        if decode not in _DECODERS:
            raise ValueError(f"decode must be one of {_DECODERS}, got {decode!r}")
        if scale <= 0:
            raise ValueError(f"scale (σ) must be positive, got {scale}; the recipe uses 8.0")
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}; use at least block_size - 1")
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.mlp_ratio = mlp_ratio
        self.scale = float(scale)
        self.decode = decode
        self.max_slots = max_slots
        self.dropout = dropout

    # ------------------------------------------------------------------ construction

    def build(self, hidden_size: int, vocab_size: int) -> "LiLiCorrHead":
        """Create the layers for a target with hidden size ``hidden_size`` and ``vocab_size`` rows.

        Idempotent for the same sizes; a different size after building is an error (the parameters
        would not fit the checkpoint).
        """
        if self.top_k > vocab_size:
            raise ValueError(
                f"LiLiCorrHead top_k {self.top_k} is larger than the target vocabulary ({vocab_size} "
                f"rows); set model.head.init_args.top_k <= {vocab_size}"
            )
        return super().build(hidden_size, vocab_size)

    def _build_layers(self, hidden_size: int, vocab_size: int) -> None:
        d = self.hidden_size
        # Node inputs. LayerNorms put the frozen embeddings (small scale) and drafter states (large
        # scale) on a common footing before projection.
        self.token_proj = nn.Sequential(nn.LayerNorm(hidden_size), nn.Linear(hidden_size, d, bias=False))
        self.slot_proj = nn.Sequential(nn.LayerNorm(hidden_size), nn.Linear(hidden_size, d, bias=False))
        self.confidence_mlp = nn.Sequential(
            nn.Linear(_NUM_CONFIDENCE_FEATURES, _CONFIDENCE_MLP_WIDTH),
            nn.SiLU(),
            nn.Linear(_CONFIDENCE_MLP_WIDTH, d),
        )
        self.slot_embedding = nn.Embedding(self.max_slots, d)
        self.rank_embedding = nn.Embedding(self.top_k, d)
        nn.init.normal_(self.slot_embedding.weight, std=0.02)
        nn.init.normal_(self.rank_embedding.weight, std=0.02)
        # Lattice transformer with per-head relative-slot bias b_h[s_i - s_j] (index offset by
        # max_slots - 1) and a sibling bias for the other candidates of the node's own slot.
        self.layers = nn.ModuleList(
            _LatticeBlock(d, self.num_heads, self.mlp_ratio, self.dropout) for _ in range(self.num_layers)
        )
        self.relative_slot_bias = nn.Parameter(torch.zeros(self.num_heads, 2 * self.max_slots - 1))
        self.same_slot_bias = nn.Parameter(torch.zeros(self.num_heads))
        self.final_norm = nn.LayerNorm(d)
        # Anchor and factor heads.
        self.anchor_proj = nn.Sequential(nn.LayerNorm(hidden_size), nn.Linear(hidden_size, d, bias=False))
        self.factor_mix = nn.Linear(3 * d, d)
        self.out_proj = nn.Linear(d, d, bias=False)
        self.in_proj = nn.Linear(d, d, bias=False)
        self.anchor_factor = nn.Linear(d, d, bias=False)

    # ------------------------------------------------------------------ scoring

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
            anchor_valid: ``[M]`` bool; the anchor vector is zeroed where False.
            embed: token ids -> frozen target input embeddings (always detached here).
            top_k: lattice width to use, ``<= self.top_k`` (default: ``self.top_k``).

        Returns:
            The :class:`Lattice` with ``start`` and ``pair`` scores in ``[-σ, σ]``.
        """
        k = self._check_inputs(slot_hidden, slot_logits, anchor_feature, anchor_valid, top_k)
        m, s, _ = slot_hidden.shape
        dtype = self.token_proj[1].weight.dtype
        device = slot_hidden.device

        # 1. Lattice: indices from detached logits; confidence features from live logits.
        candidates = slot_logits.detach().topk(k, dim=-1).indices  # [M, S, K]
        candidate_logprobs = candidate_log_probs(slot_logits, candidates)  # [M, S, K] fp32, live
        rank = torch.arange(k, device=device)  # [K]
        confidence = torch.stack(
            [
                candidate_logprobs,
                candidate_logprobs.exp(),
                candidate_logprobs - candidate_logprobs[..., :1],
                (rank.float() / self.top_k).expand(m, s, k),
                (rank == 0).float().expand(m, s, k),
            ],
            dim=-1,
        )  # [M, S, K, 5]

        # 2. Node vectors.
        with torch.no_grad():
            token_embeddings = embed(candidates)  # [M, S, K, H]
        nodes = (
            self.token_proj(token_embeddings.detach().to(dtype))  # [M, S, K, D]
            + self.slot_proj(slot_hidden.to(dtype)).unsqueeze(2)  # [M, S, 1, D], shared by the slot
            + self.confidence_mlp(confidence.to(dtype))  # [M, S, K, D]
            + self.slot_embedding.weight[:s, None, :]  # [S, 1, D]
            + self.rank_embedding.weight[:k]  # [K, D]
        )

        # 3. Lattice transformer over all S·K nodes.
        h = nodes.reshape(m, s * k, self.hidden_size)  # [M, N=S·K, D]
        bias = self._attention_bias(s, k, device)  # [1, heads, N, N]
        for layer in self.layers:
            h = layer(h, bias)
        h = self.final_norm(h).view(m, s, k, self.hidden_size)  # [M, S, K, D]

        # 4.-5. Anchor conditions the factor heads only.
        a = self.anchor_proj(anchor_feature.to(dtype)) * anchor_valid.to(dtype).unsqueeze(-1)  # [M, D]
        a_nodes = a[:, None, None, :].expand_as(h)  # [M, S, K, D]
        z = F.silu(self.factor_mix(torch.cat([h, a_nodes, h * a_nodes], dim=-1)))  # [M, S, K, D]
        out_vec, in_vec, u = self.out_proj(z), self.in_proj(z), self.anchor_factor(a)

        # 6. Scores as σ·cosine, in fp32 even under autocast so the bound |score| <= σ holds.
        with torch.autocast(device_type=device.type, enabled=False):
            out_vec = F.normalize(out_vec.float(), dim=-1)  # [M, S, K, D]
            in_vec = F.normalize(in_vec.float(), dim=-1)  # [M, S, K, D]
            u = F.normalize(u.float(), dim=-1)  # [M, D]; zero vector (scores 0) for invalid anchors
            start = self.scale * torch.einsum("md,mkd->mk", u, in_vec[:, 0])  # [M, K]
            pair = self.scale * (out_vec[:, :-1] @ in_vec[:, 1:].transpose(-1, -2))  # [M, S-1, K, K]
        return Lattice(candidates=candidates, start=start, pair=pair, candidate_logprobs=candidate_logprobs)

    def select(
        self,
        slot_hidden: torch.Tensor,
        slot_logits: torch.Tensor,
        anchor_feature: torch.Tensor,
        embed: EmbedFn,
        top_k: int | None = None,
    ) -> Selection:
        """Score the lattice and walk it (greedy, or Viterbi when ``decode="viterbi"``).

        An anchor feature that is all zeros counts as invalid (the interface's convention), which
        makes the start scores all zero so slot 1 falls back to the drafter's top-1.
        """
        anchor_valid = anchor_feature.ne(0).any(dim=-1)  # [b]
        lattice = self.score_lattice(slot_hidden, slot_logits, anchor_feature, anchor_valid, embed, top_k)
        decoder = greedy_walk if self.decode == "greedy" else viterbi
        index = decoder(lattice.start, lattice.pair)  # [b, S]
        tokens = lattice.candidates.gather(-1, index.unsqueeze(-1)).squeeze(-1)  # [b, S]
        return Selection(tokens=tokens, lattice_index=index, lattice=lattice)

    # ------------------------------------------------------------------ helpers

    def _attention_bias(self, num_slots: int, k: int, device: torch.device) -> torch.Tensor:
        """``[1, heads, N, N]`` additive attention bias: ``b_h[s_i - s_j]`` plus the sibling bias."""
        slot_of_node = torch.arange(num_slots, device=device).repeat_interleave(k)  # [N]
        offset = slot_of_node[:, None] - slot_of_node[None, :]  # [N, N]
        bias = self.relative_slot_bias[:, offset + self.max_slots - 1]  # [heads, N, N]
        node = torch.arange(num_slots * k, device=device)
        siblings = (offset == 0) & (node[:, None] != node[None, :])  # same slot, other candidate
        bias = bias + self.same_slot_bias[:, None, None] * siblings
        return bias.unsqueeze(0)

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
                "LiLiCorrHead has no parameters yet; call head.build(target_hidden_size, vocab_size) "
                "first (the system does this when it constructs the model)"
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
        if s > self.max_slots:
            raise ValueError(
                f"block has {s} speculative slots but LiLiCorrHead max_slots is {self.max_slots}; "
                f"set model.head.init_args.max_slots >= {s}"
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
