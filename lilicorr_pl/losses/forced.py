"""Forced (oracle-prefix) slots and their teacher-forced score rows, shared by the lattice losses.

For each block, the forced slots are the oracle prefix (DESIGN §5.2): the leading slots whose true
token is among the lattice's candidates. A block with any unsupervised slot (off the sequence end or
outside the loss mask) has no forced slot at all: it is skipped whole, as the reference skips it
(``valid_block = slot_mask.all(-1)``), never truncated at its first unsupervised slot. The score row
of a forced slot is what the greedy walk would compare there under teacher forcing: the start scores
for the first slot, else the pair row leaving the *true* candidate of the previous slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lilicorr_pl.heads.lattice import forced_prefix_mask, oracle_prefix
from lilicorr_pl.losses.base import LossInputs


@dataclass
class ForcedSlots:
    """Oracle-prefix supervision for ``M`` blocks of ``S`` slots over a ``K``-wide lattice."""

    length: torch.Tensor
    """``[M]`` long: oracle prefix length (0 in a block that is not valid)."""
    true_rank: torch.Tensor
    """``[M, S]`` long: rank of the true token among the candidates, -1 where absent/unsupervised."""
    valid_block: torch.Tensor
    """``[M]`` bool: every slot of the block is supervised (the only blocks the lattice losses read)."""
    mask: torch.Tensor
    """``[M, S]`` bool: forced slots (inside the oracle prefix of a valid block)."""
    target: torch.Tensor
    """``[M, S]`` long: ``true_rank`` clamped to 0, safe for indexing (read it only where ``mask``)."""
    scores: torch.Tensor
    """``[M, S, K]``: teacher-forced score rows (start row at slot 0, else ``pair[s-1, true_rank[s-1]]``)."""


def forced_slots(inputs: LossInputs) -> ForcedSlots:
    """Compute the forced slots and score rows of ``inputs.lattice``, memoised on ``inputs``.

    The lattice components (:class:`OraclePrefixCE`, :class:`MarginHinge`, :class:`DistractorPenalty`)
    all call this, so it is computed once per step.
    """
    lattice = inputs.lattice
    if inputs._forced is not None and inputs._forced[0] is lattice:
        return inputs._forced[1]
    if lattice is None:
        raise ValueError(
            "forced slots need a lattice; add a lattice head such as LiLiCorrHead (model.head)"
        )
    length, true_rank = oracle_prefix(lattice.candidates, inputs.labels, inputs.label_mask)
    valid_block = inputs.label_mask.bool().all(dim=-1)  # [M]
    length = torch.where(valid_block, length, torch.zeros_like(length))
    num_slots = lattice.num_slots
    target = true_rank.clamp_min(0)  # [M, S]
    rows = [lattice.start.unsqueeze(1)]  # [M, 1, K]
    if num_slots > 1:
        leaving = target[:, :-1, None, None].expand(-1, -1, 1, lattice.top_k)  # [M, S-1, 1, K]
        rows.append(lattice.pair.gather(2, leaving).squeeze(2))  # [M, S-1, K]
    forced = ForcedSlots(
        length=length,
        true_rank=true_rank,
        valid_block=valid_block,
        mask=forced_prefix_mask(length, num_slots),
        target=target,
        scores=torch.cat(rows, dim=1),  # [M, S, K]
    )
    inputs._forced = (lattice, forced)
    return forced
