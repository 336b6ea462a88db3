"""Error bars for acceptance comparisons: paired bootstrap over prompts of a ratio of pooled τ.

τ of an arm on a prompt set is pooled (committed tokens over verify rounds, bonus token included), so
a prompt with many rounds weighs more than one with few. Two arms decode the same prompts, so the
bootstrap resamples prompt indices once per replicate and recomputes both arms' pooled τ on that
resample (paired): prompt difficulty, shared by both arms, cancels in the ratio.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pooled_tau(per_prompt_tau: Sequence[float], per_prompt_rounds: Sequence[int]) -> float:
    """Σ τ_i · rounds_i / Σ rounds_i: the τ of all rounds of all prompts together."""
    tau = torch.as_tensor(per_prompt_tau, dtype=torch.float64)
    rounds = torch.as_tensor(per_prompt_rounds, dtype=torch.float64)
    return float((tau * rounds).sum() / rounds.sum())


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
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    ta, ra = torch.as_tensor(tau_a, dtype=torch.float64), torch.as_tensor(rounds_a, dtype=torch.float64)
    tb, rb = torch.as_tensor(tau_b, dtype=torch.float64), torch.as_tensor(rounds_b, dtype=torch.float64)
    ratio = pooled_tau(ta, ra) / pooled_tau(tb, rb)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(ta), (num_resamples, len(ta)), generator=g)  # [R, n] prompt indices
    num_a, den_a = (ta * ra)[idx].sum(1), ra[idx].sum(1)
    num_b, den_b = (tb * rb)[idx].sum(1), rb[idx].sum(1)
    samples = (num_a / den_a) / (num_b / den_b)  # [R]
    alpha = (1 - confidence) / 2
    low, high = torch.quantile(samples, torch.tensor([alpha, 1 - alpha], dtype=torch.float64)).tolist()
    return float(ratio), float(low), float(high)
