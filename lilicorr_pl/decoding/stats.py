"""Error bars for arm comparisons: paired bootstrap over prompts of a ratio of pooled τ (or tokens/s).

τ of an arm on a prompt set is pooled (committed tokens over verify rounds, bonus token included), so
a prompt with many rounds weighs more than one with few. Two arms decode the same prompts, so the
bootstrap resamples prompt indices once per replicate and recomputes both arms' pooled τ on that
resample (paired): prompt difficulty, shared by both arms, cancels in the ratio.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _committed(per_prompt_tau: Sequence[float], per_prompt_rounds: Sequence[int]) -> torch.Tensor:
    """Tokens each prompt committed, ``τ_i · rounds_i``; a prompt with no round (τ undefined) committed none."""
    tau = torch.as_tensor(per_prompt_tau, dtype=torch.float64)
    rounds = torch.as_tensor(per_prompt_rounds, dtype=torch.float64)
    return torch.where(rounds > 0, tau * rounds, torch.zeros_like(rounds))


def pooled_tau(per_prompt_tau: Sequence[float], per_prompt_rounds: Sequence[int]) -> float:
    """Σ τ_i · rounds_i / Σ rounds_i: the τ of all rounds of all prompts together."""
    return float(_committed(per_prompt_tau, per_prompt_rounds).sum() / sum(per_prompt_rounds))


def bootstrap_ratio(
    tau_a: Sequence[float],
    rounds_a: Sequence[int],
    tau_b: Sequence[float],
    rounds_b: Sequence[int],
    num_resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float]:
    """Pooled τ(a) / pooled τ(b) and its percentile bootstrap interval, resampling prompts in pairs.

    Returns ``(ratio, low, high)``. Both arms must be measured on the same prompts, in the same order.
    """
    if not (len(tau_a) == len(rounds_a) == len(tau_b) == len(rounds_b)) or not len(tau_a):
        raise ValueError("bootstrap_ratio needs per-prompt τ and rounds of both arms on the same, non-empty prompt set")
    return bootstrap_ratio_of_sums(_committed(tau_a, rounds_a), rounds_a, _committed(tau_b, rounds_b), rounds_b,
                                   num_resamples=num_resamples, confidence=confidence, seed=seed)


def bootstrap_ratio_of_sums(
    num_a: Sequence[float],
    den_a: Sequence[float],
    num_b: Sequence[float],
    den_b: Sequence[float],
    num_resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float]:
    """``(Σ num_a / Σ den_a) / (Σ num_b / Σ den_b)`` and its paired percentile bootstrap interval.

    The pooled quantity of each arm is a ratio of sums over prompts -- τ (committed tokens / rounds), tokens/s
    (tokens / seconds) -- so a prompt weighs by its denominator. Each replicate resamples prompt indices once and
    recomputes both arms on that resample (paired). Returns ``(ratio, low, high)``.
    """
    if not (len(num_a) == len(den_a) == len(num_b) == len(den_b)) or not len(num_a):
        raise ValueError("a paired bootstrap needs both arms' per-prompt values on the same, non-empty prompt set")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    na, da, nb, db = (torch.as_tensor(x, dtype=torch.float64) for x in (num_a, den_a, num_b, den_b))
    ratio = (na.sum() / da.sum()) / (nb.sum() / db.sum())
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(na), (num_resamples, len(na)), generator=g)  # [R, n] prompt indices
    samples = (na[idx].sum(1) / da[idx].sum(1)) / (nb[idx].sum(1) / db[idx].sum(1))  # [R]
    alpha = (1 - confidence) / 2
    # A replicate whose denominator is 0 (only prompts without a round) has no ratio: it is left out.
    low, high = torch.nanquantile(samples, torch.tensor([alpha, 1 - alpha], dtype=torch.float64)).tolist()
    return float(ratio), float(low), float(high)
