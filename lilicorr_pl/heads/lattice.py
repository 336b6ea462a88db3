"""Lattice decoding and oracle-prefix utilities (DESIGN §4.2 step 7, §5.2, §6).

All functions are batched over blocks ``M``; the only Python loops run over slots, never over
candidates or blocks. Shapes: ``start [M, K]``, ``pair [M, S-1, K, K]``, paths ``[M, S]`` of
candidate ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal, get_args

import torch

from lilicorr_pl.heads.sampling import DraftSampling


def _check_scores(start: torch.Tensor, pair: torch.Tensor) -> None:
    if start.dim() != 2 or pair.dim() != 4:
        raise ValueError(
            f"expected start [M, K] and pair [M, S-1, K, K], got start {tuple(start.shape)} and "
            f"pair {tuple(pair.shape)}; pass the fields of a Lattice"
        )
    m, k = start.shape
    if pair.shape[0] != m or pair.shape[2] != k or pair.shape[3] != k:
        raise ValueError(
            f"start {tuple(start.shape)} and pair {tuple(pair.shape)} disagree on M or K; "
            f"pair must be [M, S-1, K, K] with the start's M={m} and K={k}"
        )


Decode = Literal["greedy", "viterbi", "top1_start"]
"""How a lattice head walks its lattice at T = 0: the greedy walk (the method), Viterbi (ablation), or the greedy
walk from the drafter's top-1 at the first slot (ablation: the start scores unused)."""
DECODERS: tuple[str, ...] = get_args(Decode)


def _walk(start: torch.Tensor, pair: torch.Tensor, choose: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Left-to-right walk: ``choose`` picks a candidate from the start row, then from the pair row leaving the
    previous pick. Returns the path ``[M, S]``. Only this ``K``-wide step is sequential over slots (a draw
    depends on the previous one: :func:`sample_walk`)."""
    _check_scores(start, pair)
    blocks = torch.arange(start.shape[0], device=start.device)
    index = choose(start)  # [M]
    path = [index]
    for s in range(pair.shape[1]):
        index = choose(pair[blocks, s, index])  # from the row leaving the current pick: [M, K]
        path.append(index)
    return torch.stack(path, dim=1)


def follow(first: torch.Tensor, successor: torch.Tensor) -> torch.Tensor:
    """The path from ``first [M]`` through ``successor [M, S-1, K]`` (the pick at slot ``s + 1`` after pick ``i`` at
    slot ``s``) in ``ceil(log2(S-1))`` batched gathers instead of ``S - 1`` sequential steps.

    Pointer jumping: ``comp[:, s]`` holds the composed map from slot ``0``'s pick to slot ``s + 1``'s, built by
    doubling (each round composes every map with the one ``d`` slots before it), then read at ``first``. The same
    picks as following the successors one slot at a time, every argmax already taken over the same rows.
    """
    n = successor.shape[1]
    comp, d = successor, 1
    while d < n:
        comp = torch.cat([comp[:, :d], comp[:, d:].gather(2, comp[:, :-d])], dim=1)
        d *= 2
    rest = comp.gather(2, first[:, None, None].expand(-1, n, 1)).squeeze(2)  # [M, S-1]
    return torch.cat([first[:, None], rest], dim=1)


def greedy_walk(start: torch.Tensor, pair: torch.Tensor, first_top1: bool = False) -> torch.Tensor:
    """Greedy walk through the lattice: ``j_1 = argmax start``, ``j_{s+1} = argmax pair[s, j_s, :]``.

    Greedy on purpose (DESIGN §4.2): under prefix acceptance an early slot must never be sacrificed
    for a better tail. A greedy step depends only on the previous pick, so every row's argmax is taken in
    one op and the path is read from that successor table by :func:`follow` (about 16 operators per call
    instead of 32: launches on a GPU, dispatch on a CPU); the picks are the one-slot-at-a-time walk's.

    Args:
        start: ``[M, K]`` start scores.
        pair: ``[M, S-1, K, K]`` pair scores.
        first_top1: start from rank 0 (the drafter's top-1) instead of ``argmax start`` (an ablation).

    Returns:
        ``[M, S]`` long: the chosen candidate rank at every slot.
    """
    _check_scores(start, pair)
    first = start.new_zeros(start.shape[0], dtype=torch.long) if first_top1 else start.argmax(dim=-1)  # [M]
    return follow(first, pair.argmax(dim=-1))


def sample_walk(start: torch.Tensor, pair: torch.Tensor, sampling: DraftSampling) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy walk with each argmax replaced by a draw: LiLiCorr's proposal at T > 0.

    At every slot the proposal over the ``K`` candidates is ``softmax(ψ / T)``, where ψ is the start row
    at the first slot and otherwise the pair row leaving the candidate actually **drawn** at the
    previous slot; there is no drafter log-probability prior (the head was trained without one), and
    no nucleus truncation: the request's top-p shapes the target's ``p`` only. This is SGLang's LiLiCorr
    sampling mode (``lilicorr_sample_path``: ``softmax(psi_s / T)``, temperature alone). TensorRT-LLM's
    ``lilicorr_proposal_logits`` differs: it takes every slot's row along the *greedy* path and
    samples the slots from those fixed rows. Both are lossless when verified with the ``q`` they drew
    from; SGLang's keeps the sampled block coherent, so it is the one followed here. As ``T → 0`` the
    walk becomes :func:`greedy_walk`.

    Args:
        start: ``[M, K]`` start scores (log-potentials, ``σ·cos``).
        pair: ``[M, S-1, K, K]`` pair scores.
        sampling: temperature and RNG of the draws (its top-p is not applied to the candidates).

    Returns:
        ``(path [M, S] long, q [M, S, K] float32)``: the drawn candidate ranks and the proposal each
        slot was drawn from.
    """
    drawn: list[torch.Tensor] = []
    sampling = dataclasses.replace(sampling, top_p=1.0)  # softmax(ψ/T) over the K candidates, as SGLang draws

    def choose(row: torch.Tensor) -> torch.Tensor:
        index, q = sampling.sample(row)
        drawn.append(q)
        return index

    path = _walk(start, pair, choose)
    return path, torch.stack(drawn, dim=1)


def walk(start: torch.Tensor, pair: torch.Tensor, decode: Decode = "greedy") -> torch.Tensor:
    """The T = 0 walk a lattice head uses: :func:`greedy_walk` or :func:`viterbi` (``[M, S]`` ranks)."""
    if decode == "greedy":
        return greedy_walk(start, pair)
    if decode == "viterbi":
        return viterbi(start, pair)
    if decode == "top1_start":
        return greedy_walk(start, pair, first_top1=True)
    raise ValueError(f"decode must be one of {DECODERS}, got {decode!r}")


def viterbi(start: torch.Tensor, pair: torch.Tensor) -> torch.Tensor:
    """Max-sum best path through the lattice (the ablation to :func:`greedy_walk`).

    Args:
        start: ``[M, K]`` start scores.
        pair: ``[M, S-1, K, K]`` pair scores.

    Returns:
        ``[M, S]`` long: the candidate ranks of the path maximising :func:`path_score`.
    """
    _check_scores(start, pair)
    best = start  # [M, K]: best score of a path ending in each candidate of the current slot
    backpointers = []
    for s in range(pair.shape[1]):
        best, back = (best.unsqueeze(-1) + pair[:, s]).max(dim=1)  # [M, K, K] -> [M, K]
        backpointers.append(back)
    index = best.argmax(dim=-1)  # [M]
    path = [index]
    for back in reversed(backpointers):
        index = back.gather(1, index.unsqueeze(1)).squeeze(1)
        path.append(index)
    return torch.stack(path[::-1], dim=1)  # [M, S]


def path_score(start: torch.Tensor, pair: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Score of a path: ``start[j_1] + Σ_s pair[s, j_s, j_{s+1}]``.

    Args:
        start: ``[M, K]`` start scores.
        pair: ``[M, S-1, K, K]`` pair scores.
        index: ``[M, S]`` candidate rank per slot.

    Returns:
        ``[M]`` path scores.
    """
    _check_scores(start, pair)
    m, transitions = start.shape[0], pair.shape[1]
    if index.shape != (m, transitions + 1):
        raise ValueError(
            f"path index has shape {tuple(index.shape)} but the lattice needs [M, S] = "
            f"[{m}, {transitions + 1}]; pass one candidate rank per slot"
        )
    score = start.gather(1, index[:, :1]).squeeze(1)  # [M]
    if transitions:
        rows = torch.arange(m, device=start.device).unsqueeze(1)
        slots = torch.arange(transitions, device=start.device).unsqueeze(0)
        score = score + pair[rows, slots, index[:, :-1], index[:, 1:]].sum(dim=1)  # [M, S-1] -> [M]
    return score


def prefix_length(correct: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of ``True`` in each row.

    Args:
        correct: ``[M, S]`` bool.

    Returns:
        ``[M]`` long.
    """
    return correct.long().cumprod(dim=-1).sum(dim=-1)


def oracle_prefix(
    candidates: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Oracle (forced) prefix of each block: the best any chain reranker over this lattice can do.

    The oracle prefix is the longest run of leading slots whose true token is among the slot's
    candidates *and* whose label is supervised. An unsupervised slot (past the sequence end or
    outside the loss mask) ends the run, so no loss or metric ever reads an unsupervised label.

    Args:
        candidates: ``[M, S, K]`` candidate token ids.
        labels: ``[M, S]`` true tokens (arbitrary where ``label_mask`` is False).
        label_mask: ``[M, S]`` bool, supervised slots.

    Returns:
        ``(length, true_rank)``: ``length [M]`` long, the oracle prefix length; ``true_rank [M, S]``
        long, the rank of the true token among the slot's candidates, ``-1`` where it is absent or the
        slot is unsupervised.
    """
    if candidates.shape[:2] != labels.shape or labels.shape != label_mask.shape:
        raise ValueError(
            f"candidates {tuple(candidates.shape)}, labels {tuple(labels.shape)} and label_mask "
            f"{tuple(label_mask.shape)} must share [M, S]"
        )
    match = candidates == labels.unsqueeze(-1)  # [M, S, K]
    present = match.any(dim=-1) & label_mask.bool()  # [M, S]
    true_rank = torch.where(present, match.long().argmax(dim=-1), torch.full_like(labels, -1))
    return prefix_length(present), true_rank.long()


def forced_prefix_mask(length: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Slots inside each block's oracle prefix.

    Args:
        length: ``[M]`` oracle prefix lengths (from :func:`oracle_prefix`).
        num_slots: ``S``.

    Returns:
        ``[M, S]`` bool, True for slot ``s < length``.
    """
    return torch.arange(num_slots, device=length.device).unsqueeze(0) < length.unsqueeze(1)


class _CandidateLogProbs(torch.autograd.Function):
    """``log_softmax(logits)`` gathered at a few ids, without a full-vocabulary fp32 copy.

    The logits ``[M, S, V]`` are the largest tensor of a training step. Autograd through
    ``log_softmax(logits.float())`` would keep an fp32 copy (and its output) alive until backward;
    here only the per-row log-normaliser is kept and the softmax is recomputed, chunk by chunk.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(logits.dtype, torch.float32)  # fp32 at least
        log_norm = torch.empty(logits.shape[:-1], dtype=dtype, device=logits.device)  # [M, S]
        for rows in _row_chunks(logits):
            log_norm[rows] = torch.logsumexp(logits[rows].to(dtype), dim=-1)
        ctx.save_for_backward(logits, ids, log_norm)
        return logits.gather(-1, ids).to(dtype) - log_norm.unsqueeze(-1)  # [M, S, J]

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, ids, log_norm = ctx.saved_tensors
        # d/dx_v of Σ_j g_j·(x_{id_j} − lse(x)) = Σ_j g_j·[v = id_j] − softmax(x)_v · Σ_j g_j
        grad = torch.empty_like(logits)
        total = grad_out.sum(dim=-1, keepdim=True)  # [M, S, 1]
        for rows in _row_chunks(logits):
            softmax = (logits[rows].to(log_norm.dtype) - log_norm[rows].unsqueeze(-1)).exp_()
            grad[rows] = (-softmax * total[rows]).to(grad.dtype)
        grad.scatter_add_(-1, ids, grad_out.to(grad.dtype))
        return grad, None


def _row_chunks(logits: torch.Tensor, max_elements: int = 1 << 26) -> list[slice]:
    """Slices over the first dim keeping each chunk at most ``max_elements`` (≈256 MiB in fp32)."""
    per_row = max(1, logits[0].numel()) if logits.shape[0] else 1
    step = max(1, max_elements // per_row)
    return [slice(i, i + step) for i in range(0, logits.shape[0], step)]


_DIRECT_MAX_ELEMENTS = 1 << 22  # 16 MiB of fp32: a decoding round's [1, S, V] logits, even at V = 152k


def candidate_log_probs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Drafter log-probabilities of ``ids`` ``[M, S, J]`` under ``logits`` ``[M, S, V]`` (fp32 or wider), with gradient.

    Equals ``logits.float().log_softmax(-1).gather(-1, ids)``. With gradient, or for more than
    ``_DIRECT_MAX_ELEMENTS`` logits, it never materialises a full fp32 copy of them; a small block without
    gradient (a decoding round) takes that one fused op.
    """
    if not (torch.is_grad_enabled() and logits.requires_grad) and logits.numel() <= _DIRECT_MAX_ELEMENTS:
        # Nothing to save for backward and a small block (a decoding round): one fused op, no chunk loop.
        dtype = torch.promote_types(logits.dtype, torch.float32)
        return logits.to(dtype).log_softmax(dim=-1).gather(-1, ids)
    return _CandidateLogProbs.apply(logits, ids)
