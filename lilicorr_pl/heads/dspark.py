"""The DSpark baseline head (DESIGN §4.3): a low-rank first-order Markov bias on the slot logits.

``logits_k += W1[x_{k-1}] · W2`` with ``W1: V×r`` (an embedding of the previous token) and
``W2: r×V``, optionally gated per slot by ``σ(Linear([h_k ; W1[x_{k-1}]]))``. Teacher-forced in
training (all slots at once); at inference ``S`` sequential V-wide steps on the head's own picks.
"""

from __future__ import annotations

import torch
from torch import nn

from lilicorr_pl.heads.base import EmbedFn
from lilicorr_pl.heads.corrector import CorrectorHead


class DSparkHead(CorrectorHead):
    """DSpark: previous-token bigram bias of rank ``r`` added to the slot logits.

    ``W2`` starts at zero, so an untrained head picks exactly the drafter's top-1. It reads no frozen
    target embedding: ``W1`` is its own table. Defaults are sized for an 8B target; parameters are
    created by :meth:`build` once the target's sizes are known.
    """

    name = "dspark"

    def __init__(self, rank: int = 256, gated: bool = False) -> None:
        """
        Args:
            rank: rank ``r`` of the Markov bias (``W1: V×r``, ``W2: r×V``; 256 in the paper).
            gated: multiply the bias by a per-slot sigmoid gate ``σ(Linear(H + r -> 1))`` on
                ``[h_k ; W1[x_{k-1}]]``.
        """
        super().__init__()
        if rank < 1:
            raise ValueError(f"DSparkHead rank must be >= 1, got {rank}; the paper uses 256")
        self.rank = rank
        self.gated = gated

    def _build_layers(self, hidden_size: int, vocab_size: int) -> None:
        self.prev_token_factor = nn.Embedding(vocab_size, self.rank)  # W1 [V, r]
        self.bias_out = nn.Linear(self.rank, vocab_size, bias=False)  # W2 [r, V] (stored as [V, r])
        # Zero W2: the untrained head is the drafter (top-1); W2 still gets gradient through W1.
        nn.init.zeros_(self.bias_out.weight)
        self.gate = nn.Linear(hidden_size + self.rank, 1) if self.gated else None

    def _correct(self, slot_hidden: torch.Tensor, slot_logits: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        factor = self.prev_token_factor(prev_tokens)  # [..., r]
        bias = self.bias_out(factor)  # [..., V]
        if self.gate is not None:
            features = torch.cat([slot_hidden.to(factor.dtype), factor], dim=-1)  # [..., H + r]
            bias = torch.sigmoid(self.gate(features)) * bias
        return slot_logits + bias

    def step(
        self,
        slot_hidden: torch.Tensor,
        slot_logits: torch.Tensor,
        prev_tokens: torch.Tensor,
        state: None,
        embed: EmbedFn,
    ) -> tuple[torch.Tensor, None]:
        """One V-wide slot (stateless: only the previous token matters)."""
        return self._correct(slot_hidden, slot_logits, prev_tokens), None

    def corrected_logits(
        self,
        slot_hidden: torch.Tensor,
        slot_logits: torch.Tensor,
        prev_tokens: torch.Tensor,
        embed: EmbedFn,
    ) -> torch.Tensor:
        """Teacher-forced corrected logits ``[M, S, V]`` (``embed`` is unused)."""
        self._check_inputs(slot_hidden, slot_logits, prev_tokens)
        return self._correct(slot_hidden, slot_logits, prev_tokens)
