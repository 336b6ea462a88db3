"""The bootstrap interval on τ ratios, checked on hand-made examples (issue 9)."""

from __future__ import annotations

import itertools
import math

import pytest
from lilicorr_pl.decoding.stats import bootstrap_ratio, pooled_tau


def test_pooled_tau_weighs_prompts_by_rounds():
    # 10 rounds at τ 2 and 30 rounds at τ 4: 140 tokens over 40 rounds.
    assert pooled_tau([2.0, 4.0], [10, 30]) == pytest.approx(3.5)


def test_identical_and_proportional_arms_have_degenerate_intervals():
    tau, rounds = [1.5, 2.5, 3.0, 1.2], [10, 4, 7, 9]
    assert bootstrap_ratio(tau, rounds, tau, rounds) == pytest.approx((1.0, 1.0, 1.0))
    doubled = [2 * t for t in tau]
    assert bootstrap_ratio(doubled, rounds, tau, rounds) == pytest.approx((2.0, 2.0, 2.0))


def test_interval_matches_the_exact_resampling_distribution():
    """Two prompts: the resamples are {00, 01, 10, 11} with probabilities 1/4, 1/2, 1/4, so the 95 %
    percentile interval is [ratio on 00 or 11, the other one] -- computed by hand here."""
    tau_a, rounds_a = [2.0, 4.0], [10, 10]
    tau_b, rounds_b = [2.0, 2.0], [10, 10]
    ratio, low, high = bootstrap_ratio(tau_a, rounds_a, tau_b, rounds_b, num_resamples=20000, seed=1)
    assert ratio == pytest.approx(1.5)  # (2 + 4) / (2 + 2)
    # Resample 00 -> 2/2 = 1.0; 11 -> 4/2 = 2.0; 01/10 -> 1.5.
    assert low == pytest.approx(1.0) and high == pytest.approx(2.0)
    # With 3 prompts, the 2.5 % / 97.5 % quantiles of the exact distribution over all 27 resamples.
    tau_a, tau_b, rounds = [1.0, 2.0, 6.0], [1.0, 1.0, 2.0], [5, 5, 5]
    exact = sorted(sum(tau_a[i] for i in c) / sum(tau_b[i] for i in c) for c in itertools.product(range(3), repeat=3))
    ratio, low, high = bootstrap_ratio(tau_a, rounds, tau_b, rounds, num_resamples=50000, seed=0)
    assert ratio == pytest.approx(9.0 / 4.0)
    # Inverse CDF of the exact distribution (each of the 27 ordered resamples has probability 1/27).
    lo_exact, hi_exact = exact[math.ceil(0.025 * 27) - 1], exact[math.ceil(0.975 * 27) - 1]
    assert low == pytest.approx(lo_exact) and high == pytest.approx(hi_exact)
    assert low <= ratio <= high


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="same, non-empty prompt set"):
        bootstrap_ratio([1.0], [1], [1.0, 2.0], [1, 1])
