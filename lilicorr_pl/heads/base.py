"""The selector interface shared by every arm (DESIGN §4).

Every arm runs the same DFlash backbone and differs only in how the drafted block is chosen from the
drafter's slot outputs. The speculative-decoding loop, the metrics and the benchmark only ever call
:meth:`Selector.select`, so adding an arm means adding a :class:`Selector` subclass.

Notation: ``M`` blocks (batch × anchors, flattened), ``S = B − 1`` speculative slots, ``K`` lattice
width, ``V`` vocabulary rows, ``H`` target hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

EmbedFn = Callable[[torch.Tensor], torch.Tensor]
"""Token ids ``[...]`` -> frozen target input embeddings ``[..., H]``."""


@dataclass
class Lattice:
    """The top-K candidate lattice of a batch of blocks and its log-potential scores.

    A path picks one candidate per slot; its score is ``start[j_1] + Σ_s pair[s, j_s, j_{s+1}]``.
    """

    candidates: torch.Tensor
    """``[M, S, K]`` long: rank-ordered top-K token ids of the drafter logits (rank 0 = top-1)."""
    start: torch.Tensor
    """``[M, K]``: start scores of the candidates at the first speculative slot (index 0)."""
    pair: torch.Tensor
    """``[M, S-1, K, K]``: ``pair[m, s, i, j]`` scores candidate ``i`` at slot ``s`` -> ``j`` at ``s+1``."""
    candidate_logprobs: torch.Tensor
    """``[M, S, K]``: drafter log-probabilities of the candidates (live: carries gradient)."""

    @property
    def num_slots(self) -> int:
        """``S``, the number of speculative slots."""
        return self.candidates.shape[1]

    @property
    def top_k(self) -> int:
        """``K``, the number of candidates per slot."""
        return self.candidates.shape[2]


@dataclass
class Selection:
    """A drafted block chosen by a :class:`Selector`."""

    tokens: torch.Tensor
    """``[b, S]`` long: the chosen draft tokens."""
    lattice_index: torch.Tensor | None = None
    """``[b, S]`` long: the chosen candidate rank per slot, when a lattice was used."""
    lattice: Lattice | None = None
    """The lattice the tokens were chosen from, when one was used."""


class Selector(nn.Module):
    """Base class: chooses a drafted block from the drafter's slot outputs (one interface for every arm).

    Subclasses create their parameters in :meth:`build`, once the frozen target's sizes are known,
    and choose tokens in :meth:`select`.
    """

    uses_lattice: bool = False
    """True for heads trained with lattice losses (they expose ``score_lattice``)."""

    def __init__(self) -> None:
        super().__init__()
        self.target_hidden_size: int | None = None
        self.vocab_size: int | None = None

    @property
    def is_built(self) -> bool:
        """Whether :meth:`build` has run (and created any parameters)."""
        return self.target_hidden_size is not None

    def build(
        self,
        hidden_size: int,
        vocab_size: int,
        *,
        block_size: int | None = None,
        rms_norm_eps: float | None = None,
    ) -> "Selector":
        """Create parameters once the target's sizes are known. Idempotent; returns ``self``.

        A different size after building is an error (the parameters would not fit the checkpoint).
        Subclasses create their layers in :meth:`_build_layers`.

        Args:
            hidden_size: hidden size ``H`` of the frozen target (= drafter width).
            vocab_size: number of rows ``V`` of the target's LM head.
            block_size: the drafter's block size ``B``, for heads whose parameters depend on it (the
                LiLiCorr head's slot tables); ignored by the others.
            rms_norm_eps: the drafter's RMSNorm epsilon, for heads that share the drafter's norms in
                the serving layout (LiLiCorr); ignored by the others.
        """
        name = type(self).__name__
        if hidden_size < 1 or vocab_size < 1:
            raise ValueError(f"{name} needs positive sizes, got hidden_size {hidden_size}, vocab_size {vocab_size}")
        if self.is_built:
            if (self.target_hidden_size, self.vocab_size) != (hidden_size, vocab_size):
                raise ValueError(
                    f"{name} was built for hidden_size {self.target_hidden_size} and vocab_size "
                    f"{self.vocab_size}, now asked for {hidden_size} and {vocab_size}; create a new head "
                    f"for a different target"
                )
            return self
        self.target_hidden_size, self.vocab_size = hidden_size, vocab_size
        self._build_layers(hidden_size, vocab_size)
        return self

    def _build_layers(self, hidden_size: int, vocab_size: int) -> None:
        """Create the selector's parameters (none by default)."""

    def select(
        self,
        slot_hidden: torch.Tensor,
        slot_logits: torch.Tensor,
        anchor_feature: torch.Tensor,
        embed: EmbedFn,
    ) -> Selection:
        """Choose the draft tokens of each block (inference path; the caller wraps it in ``no_grad``).

        Args:
            slot_hidden: ``[b, S, H]`` drafter hidden states of the speculative slots.
            slot_logits: ``[b, S, V]`` drafter logits of the speculative slots.
            anchor_feature: ``[b, H]`` fused context feature before the block; zeros when there is
                no valid anchor feature.
            embed: token ids -> frozen target input embeddings.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement select()")

    def forward(
        self,
        slot_hidden: torch.Tensor,
        slot_logits: torch.Tensor,
        anchor_feature: torch.Tensor,
        embed: EmbedFn,
    ) -> Selection:
        """Alias of :meth:`select`, so a selector can be called like any module."""
        return self.select(slot_hidden, slot_logits, anchor_feature, embed)
