"""Teacher-forced lattice diagnostics per block (DESIGN §6); aggregated by ``LatticeMetrics``.

Like the lattice losses, the diagnostics read only *valid* blocks, whose every slot is supervised (the
reference's ``valid_block = slot_mask.all(-1)``): a block that runs off the sequence or the loss mask
is skipped whole, never scored on a truncated prefix. Per-block values of an invalid block are 0 and
its slots count as unsupervised; aggregate with ``valid_block`` as the weight. Simulated
τ = 1 + prefix (the bonus token counts).
"""

from __future__ import annotations

import torch

from lilicorr_pl.heads.base import Lattice
from lilicorr_pl.heads.lattice import oracle_prefix, prefix_length


def logfactor_spread(lattice: Lattice) -> torch.Tensor:
    """Collapse signal, as the reference's training code reads it (Model-Optimizer's ``lilicorr_logfactor_spread``):
    half the std of the block's start row plus half the mean, over its slot pairs, of the std over each whole
    ``K × K`` pair matrix (stds with Bessel's correction, on the log-potentials σ·cos; 0 where K is 1, and the pair
    half 0 where the block has one slot). It goes to 0 when the chain degenerates to equal factors. The reference
    averages it over every block; :func:`lattice_diagnostics` reads it on the valid blocks, as every diagnostic here.

    A pair matrix whose rows each hold one value, but differ from each other, keeps this high while the walk cannot
    tell a row's candidates apart: :func:`logfactor_row_spread` reads that.

    Returns:
        ``[M]``.
    """
    start, pair = lattice.start.detach().float(), lattice.pair.detach().float()
    m, k = start.shape
    if m == 0 or k < 2:  # a step with no block; one candidate per slot, which cannot spread
        return start.new_zeros(m)
    pairs = pair.reshape(m, -1, k * k)
    pair_std = pairs.std(dim=-1).mean(dim=-1) if pairs.shape[1] else start.new_zeros(m)
    return (start.std(dim=-1) + pair_std) / 2


def logfactor_row_spread(lattice: Lattice) -> torch.Tensor:
    """The walk's collapse signal: the mean, over every K-wide score row of a block, of the row's std.

    The rows are the start row and every pair row ``pair[s, i, :]``; the std is the population std
    over the row's K entries. It is 0 exactly when every row is flat (the head cannot tell candidates
    apart, so the walk degenerates to rank order) and is at most σ. (Logged as ``logfactor_spread`` before
    the reference's form took that name.)

    Returns:
        ``[M]``.
    """
    start, pair = lattice.start.detach().float(), lattice.pair.detach().float()
    m, k = start.shape
    if m == 0:  # a step with no block
        return start.new_zeros(0)
    rows = torch.cat([start.unsqueeze(1), pair.reshape(m, -1, k)], dim=1)  # [M, 1 + (S-1)·K, K]
    return rows.std(dim=-1, correction=0).mean(dim=-1)


@torch.no_grad()
def lattice_diagnostics(
    lattice: Lattice | None,
    drafter_logits: torch.Tensor,
    labels: torch.Tensor,
    label_mask: torch.Tensor,
    selected_tokens: torch.Tensor | None = None,
    top_k: int = 8,
) -> dict[str, torch.Tensor]:
    """Per-block and per-slot diagnostics of the drafter, the selector and the lattice.

    Args:
        lattice: the head's lattice, or None for heads without one.
        drafter_logits: ``[M, S, V]`` drafter logits.
        labels: ``[M, S]`` true tokens (arbitrary where ``label_mask`` is False).
        label_mask: ``[M, S]`` bool, supervised slots.
        selected_tokens: ``[M, S]`` tokens chosen by the selector (the system passes
            ``HeadOutput.selected``). Default: the greedy walk over ``lattice`` when given, else the
            drafter's top-1.
        top_k: lattice width for the oracle when ``lattice`` is None (the drafter's own top-K).

    Returns:
        Per block ``[M]``: ``valid_block`` (every slot supervised: the blocks the other values are
        read on), ``top1_prefix``, ``selected_prefix``, ``oracle_prefix``, ``oracle_gap``
        (oracle − selected), ``sim_tau_top1``, ``sim_tau_selected``, ``sim_tau_oracle``,
        ``exact_block`` (valid block, every selected token right), and ``logfactor_spread`` and
        ``logfactor_row_spread`` when a lattice is given. Per block and slot ``[M, S]`` bool: ``supervised`` (slots of valid blocks),
        ``covered`` (true token among the candidates), ``top1_correct``, ``selected_correct``, and
        ``off_top1`` (the selector chose something other than the drafter's top-1: a head that never
        does so is a per-slot argmax, whatever its score spread says).
    """
    valid_block = label_mask.bool().all(dim=-1)  # [M]
    mask = label_mask.bool() & valid_block.unsqueeze(-1)  # [M, S]: invalid blocks are skipped whole
    top1 = drafter_logits.argmax(dim=-1)  # [M, S]
    if lattice is not None:
        candidates = lattice.candidates  # [M, S, K]
    else:
        k = min(top_k, drafter_logits.shape[-1])
        candidates = drafter_logits.topk(k, dim=-1).indices  # [M, S, K]
    if selected_tokens is None:
        if lattice is not None:
            selected_tokens = lattice.tokens_at(lattice.walk("greedy"))  # [M, S]
        else:
            selected_tokens = top1
    if selected_tokens.shape != labels.shape:
        raise ValueError(
            f"selected_tokens has shape {tuple(selected_tokens.shape)}, labels {tuple(labels.shape)}; "
            f"pass one token per block and slot"
        )
    top1_correct = (top1 == labels) & mask
    selected_correct = (selected_tokens == labels) & mask
    oracle_len, true_rank = oracle_prefix(candidates, labels, mask)
    top1_len, selected_len = prefix_length(top1_correct), prefix_length(selected_correct)
    out = {
        "valid_block": valid_block,
        "top1_prefix": top1_len,
        "selected_prefix": selected_len,
        "oracle_prefix": oracle_len,
        "oracle_gap": oracle_len - selected_len,
        "sim_tau_top1": 1 + top1_len,
        "sim_tau_selected": 1 + selected_len,
        "sim_tau_oracle": 1 + oracle_len,
        "exact_block": valid_block & selected_correct.all(dim=-1),
        "supervised": mask,
        "covered": true_rank >= 0,
        "top1_correct": top1_correct,
        "selected_correct": selected_correct,
        "off_top1": (selected_tokens != top1) & mask,
    }
    if lattice is not None:
        for key, spread in (("logfactor_spread", logfactor_spread(lattice)),
                            ("logfactor_row_spread", logfactor_row_spread(lattice))):
            out[key] = torch.where(valid_block, spread, torch.zeros_like(spread))
    return out


def valid_block_mean(values: torch.Tensor, valid_block: torch.Tensor) -> torch.Tensor:
    """Mean of per-block ``values [M]`` over the valid blocks (0 when there are none)."""
    weight = valid_block.to(torch.float32)
    return (values.float() * weight).sum() / weight.sum().clamp_min(1)
