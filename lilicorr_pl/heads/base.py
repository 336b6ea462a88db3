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

    def build(self, hidden_size: int, vocab_size: int) -> "Selector":
        """Create parameters once the target's sizes are known. Idempotent; returns ``self``.

        Args:
            hidden_size: hidden size ``H`` of the frozen target (= drafter width).
            vocab_size: number of rows ``V`` of the target's LM head.
        """
        return self

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
