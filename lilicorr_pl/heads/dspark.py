"""The DSpark baseline head (DESIGN §4.3): a low-rank first-order Markov bias on the slot logits.

``logits_k += W1[x_{k-1}] · W2`` with ``W1: V×r`` (an embedding of the previous token) and
``W2: r×V``, optionally gated per low-rank dimension: ``(σ(Linear([h_k ; W1[x_{k-1}]])) ⊙ W1[x_{k-1}]) · W2``
(DeepSpec's ``gated`` head). Teacher-forced in training (all slots at once); at inference ``S``
sequential V-wide steps on the head's own picks. Trained with :class:`~lilicorr_pl.losses.DSparkLoss`.
"""

from __future__ import annotations

import torch
from torch import nn

from lilicorr_pl.heads.base import EmbedFn
from lilicorr_pl.heads.corrector import CorrectorHead

_INIT_STD = 0.02  # DeepSpec's initializer_range for W1, W2 and the gate


class DSparkHead(CorrectorHead):
    """DSpark: previous-token bigram bias of rank ``r`` added to the slot logits.

    Initialised as DeepSpec's head (the Hugging Face init of its draft model): ``W1``, ``W2`` and the
    gate's weight ~ N(0, 0.02), the gate's bias 0, so the initial bias is tiny (≈ r·0.02² per logit)
    and all three get gradient from the first step. It reads no frozen target embedding: ``W1`` is its
    own table. Defaults are sized for an 8B target; parameters are created by :meth:`build` once the
    target's sizes are known.
    """

    name = "dspark"

    def __init__(self, rank: int = 256, gated: bool = False) -> None:
        """
        Args:
            rank: rank ``r`` of the Markov bias (``W1: V×r``, ``W2: r×V``; 256 in the paper).
            gated: gate each of the ``r`` low-rank dimensions of ``W1[x_{k-1}]`` by
                ``σ(Linear(H + r -> r))`` of ``[h_k ; W1[x_{k-1}]]`` before ``W2``.
        """
        super().__init__()
        if rank < 1:
            raise ValueError(f"DSparkHead rank must be >= 1, got {rank}; the paper uses 256")
        self.rank = rank
        self.gated = gated

    def _build_layers(self, hidden_size: int, vocab_size: int) -> None:
        self.prev_token_factor = nn.Embedding(vocab_size, self.rank)  # W1 [V, r]
        self.bias_out = nn.Linear(self.rank, vocab_size, bias=False)  # W2 [r, V] (stored as [V, r])
        self.gate = nn.Linear(hidden_size + self.rank, self.rank) if self.gated else None  # one gate per dimension
        for module in (self.prev_token_factor, self.bias_out, self.gate):
            if module is not None:
                nn.init.normal_(module.weight, mean=0.0, std=_INIT_STD)
        if self.gate is not None:
            nn.init.zeros_(self.gate.bias)

    def _correct(self, slot_hidden: torch.Tensor, slot_logits: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        factor = self.prev_token_factor(prev_tokens)  # [..., r]
        if self.gate is not None:
            features = torch.cat([slot_hidden.to(factor.dtype), factor], dim=-1)  # [..., H + r]
            factor = torch.sigmoid(self.gate(features)) * factor  # [..., r]: gated per low-rank dimension
        return slot_logits + self.bias_out(factor)  # [..., V]

    def step(
        self,
        slot_hidden: torch.Tensor,
        slot_logits: torch.Tensor,
        prev_tokens: torch.Tensor,
        state: None,
        embed: EmbedFn,
        slot: int,
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
