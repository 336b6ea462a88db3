"""The bootstrap interval on τ ratios, checked on hand-made examples (issue 9)."""

from __future__ import annotations

import itertools
import math

import pytest
from lilicorr_pl.decoding.stats import (
    bootstrap_ratio,
    bootstrap_ratio_of_sums,
    bootstrap_tau_over_median_round_time,
    paired_intervals,
    pooled_tau,
)


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


def test_tokens_per_second_ratio_pools_by_seconds_and_pairs_prompts():
    """tokens/s of an arm is Σ tokens / Σ seconds: a slow prompt weighs by its time, not as one of n rates."""
    from lilicorr_pl.decoding.stats import bootstrap_ratio_of_sums

    # Arm a: 10 tokens in 1 s, 10 tokens in 4 s -> 20 / 5 = 4 tok/s (the mean of rates would say 6.25).
    # Arm b: 10 tokens in 2 s on both prompts -> 5 tok/s. Ratio 0.8.
    tokens, a_sec, b_sec = [10, 10], [1.0, 4.0], [2.0, 2.0]
    ratio, low, high = bootstrap_ratio_of_sums(tokens, a_sec, tokens, b_sec, num_resamples=20000, seed=3)
    assert ratio == pytest.approx(0.8)
    # Resample 00 -> (20/2)/(20/4) = 2.0; 11 -> (20/8)/(20/4) = 0.5; 01/10 -> 0.8: the interval is [0.5, 2.0].
    assert low == pytest.approx(0.5) and high == pytest.approx(2.0)
    # A prompt that is uniformly 3x faster in arm a on every prompt: the interval collapses onto 3.
    assert bootstrap_ratio_of_sums([8, 30, 12], [1, 2, 3], [8, 30, 12], [3, 6, 9]) == pytest.approx((3.0, 3.0, 3.0))
    with pytest.raises(ValueError, match="same, non-empty prompt set"):
        bootstrap_ratio_of_sums([1], [1.0], [1, 2], [1.0, 1.0])


def test_a_prompt_without_rounds_commits_nothing_instead_of_poisoning_the_pool():
    # τ is undefined (NaN) on a prompt with no verify round: it counts as 0 tokens over 0 rounds, and a
    # resample made only of such prompts (no round at all: no τ) is left out of the interval.
    ratio, low, high = bootstrap_ratio([2.0, math.nan], [10, 0], [1.0, 1.0], [10, 10], num_resamples=500)
    assert ratio == pytest.approx(2.0)  # (20 / 10) / (20 / 20)
    assert (low, high) == pytest.approx((2.0, 2.0))  # 00, 01, 10 all give 2; 11 has no round in a


def test_a_few_slow_prompts_move_the_pooled_tokens_per_s_ratio_and_not_the_median_round_reading():
    """Arm a accepts 1.5x the tokens per round of arm b and its rounds take 1.1x as long, on every prompt but one,
    on which the machine ran 5x slow during a's turn. The pooled tokens/s ratio follows that one prompt's seconds;
    τ ratio / median round-time ratio = 1.5 / 1.1 does not, and neither does its interval (at most 4 of 10
    resampled prompts are the slow one in 97.5 % of replicates)."""
    n = 10
    tau_a, tau_b, rounds = [3.0] * n, [2.0] * n, [10] * n
    seconds_a, seconds_b = [11.0 * 5] + [11.0] * (n - 1), [10.0] * n
    tokens_a, tokens_b = [30] * n, [20] * n
    pooled, _, _ = bootstrap_ratio_of_sums(tokens_a, seconds_a, tokens_b, seconds_b)
    assert pooled == pytest.approx((300 / 154) / 2.0)  # 0.97: the slow prompt's 44 extra seconds sink a
    ratio, median, low, high = bootstrap_tau_over_median_round_time(tau_a, rounds, seconds_a, tau_b, rounds, seconds_b)
    assert median == pytest.approx(1.1) and (ratio, low, high) == pytest.approx((1.5 / 1.1,) * 3)
    # A prompt without a round, or without time, in either arm is left out of the median: the two others' round-time
    # ratios are 1.1 and 1.3, so the median stays 1.2 only if the third (which would give 0.2, 0 or 10) is left out.
    for third_a, third_b in [((math.nan, 0, 0.2), (2.0, 3, 3.0)), ((2.0, 3, 3.0), (math.nan, 0, 0.3)),
                             ((2.0, 3, 0.0), (2.0, 3, 3.0))]:
        (ta, ra, sa), (tb, rb, sb) = third_a, third_b
        _, median, _, _ = bootstrap_tau_over_median_round_time(
            [3.0, 3.0, ta], [10, 10, ra], [11.0, 13.0, sa], [2.0, 2.0, tb], [10, 10, rb], [10.0, 10.0, sb])
        assert median == pytest.approx(1.2), (third_a, third_b)
    with pytest.raises(ValueError, match="same, non-empty prompt set"):
        bootstrap_tau_over_median_round_time([2.0], [1], [1.0], [2.0, 2.0], [1, 1], [1.0, 1.0])
    with pytest.raises(ValueError, match="no prompt has rounds and time in both arms"):
        bootstrap_tau_over_median_round_time([math.nan], [0], [0.0], [2.0], [1], [1.0])


def test_paired_intervals_names_the_reference_and_leaves_out_what_the_data_cannot_give():
    """bench and demo name the same intervals after their reference; an arm without rounds gets no τ ratio, one
    without time no tokens/s ratio, and the reference itself (None) only its speedup over plain decoding."""
    ref = {"per_prompt_tau": [2.0, 2.0], "per_prompt_rounds": [10, 10], "per_prompt_tokens": [20, 20],
           "per_prompt_seconds": [1.0, 1.0]}
    arm = {"per_prompt_tau": [3.0, 3.0], "per_prompt_rounds": [10, 10], "per_prompt_tokens": [30, 30],
           "per_prompt_seconds": [1.0, 1.0]}
    out = paired_intervals(arm, ref, "dflash", plain=([10, 10], [1.0, 1.0]), num_resamples=200)
    assert set(out) == {"ratio_to_dflash", "ci_low", "ci_high", "tokens_per_s_ratio_to_dflash", "tps_ci_low",
                        "tps_ci_high", "round_time_ratio_to_dflash_median", "tokens_per_s_ratio_to_dflash_robust",
                        "tps_robust_ci_low", "tps_robust_ci_high", "speedup_ci_low", "speedup_ci_high"}
    assert out["ratio_to_dflash"] == pytest.approx(1.5) and out["tokens_per_s_ratio_to_dflash"] == pytest.approx(1.5)
    assert out["tokens_per_s_ratio_to_dflash_robust"] == pytest.approx(1.5)
    assert (out["speedup_ci_low"], out["speedup_ci_high"]) == pytest.approx((3.0, 3.0))
    assert set(paired_intervals(arm, None, "reference", plain=([10, 10], [1.0, 1.0]))) == {
        "speedup_ci_low", "speedup_ci_high"}
    untimed = dict(arm, per_prompt_seconds=[0.0, 0.0])
    assert set(paired_intervals(untimed, ref, "reference")) == {"ratio_to_reference", "ci_low", "ci_high"}
    # No prompt with rounds and time in both arms (each arm's timed prompt is the other's untimed one): the median
    # reading is left out rather than raised after a benchmark's decoding.
    crossed = paired_intervals(dict(arm, per_prompt_seconds=[1.0, 0.0]), dict(ref, per_prompt_seconds=[0.0, 1.0]),
                               "reference")
    assert "tokens_per_s_ratio_to_reference" in crossed and "tokens_per_s_ratio_to_reference_robust" not in crossed
    no_rounds = dict(arm, per_prompt_tau=[math.nan, math.nan], per_prompt_rounds=[0, 0])
    assert "ratio_to_reference" not in paired_intervals(no_rounds, ref, "reference")
    assert "tokens_per_s_ratio_to_reference_robust" not in paired_intervals(no_rounds, ref, "reference")


def test_one_prompt_gives_no_interval_rather_than_a_zero_width_one():
    """Over one prompt every resample is that prompt: the interval was [r, r], which read as certainty."""
    from lilicorr_pl.decoding.stats import few_prompts_note, interval_text

    ratio, low, high = bootstrap_ratio([3.0], [4], [2.0], [4])
    assert ratio == pytest.approx(1.5) and math.isnan(low) and math.isnan(high)
    ratio, low, high = bootstrap_ratio_of_sums([6], [1.0], [3], [1.0])
    assert ratio == pytest.approx(2.0) and math.isnan(low) and math.isnan(high)
    ratio, median, low, high = bootstrap_tau_over_median_round_time([3.0], [4], [2.0], [2.0], [4], [1.0])
    assert ratio == pytest.approx(0.75) and median == pytest.approx(2.0) and math.isnan(low) and math.isnan(high)
    low, high = bootstrap_ratio([3.0, 2.0], [4, 4], [2.0, 2.0], [4, 4])[1:]  # two prompts: an interval
    assert low == pytest.approx(1.0) and high == pytest.approx(1.5)
    assert interval_text(math.nan, math.nan, ".3f") == interval_text(None, None, ".3f") == "[no interval]"
    assert interval_text(0.91, 1.2, ".2f") == "[0.91, 1.20]"
    assert few_prompts_note(1).startswith("one prompt with rounds: no interval")
    assert few_prompts_note(4).startswith("intervals over 4 prompts with rounds: a bootstrap over so few reads")
    assert few_prompts_note(10) == ""


def test_no_prompt_with_a_round_is_said_so_not_called_one_prompt():
    """With no verify round on any prompt (a budget of one token), bench's table said "one prompt with rounds: ...
    decode 20 or more" under 20 prompts decoded; the demo's said nothing. Both read the rounds through one helper."""
    from lilicorr_pl.decoding.stats import FEW_PROMPTS, rounds_note

    assert rounds_note([[0] * 20, [0] * 20], 20).startswith("no prompt had a verify round")
    assert rounds_note([[0] * 20, None], FEW_PROMPTS).startswith("no prompt had a verify round")
    assert rounds_note([[1] * 20, [2, 0, 0, 0] * 5], 20).startswith("intervals over 5 prompts")  # the fewest that count
    assert rounds_note([[1] * 20], 20) == ""
    assert rounds_note([None], 3).startswith("intervals over 3 prompts") and rounds_note([], FEW_PROMPTS) == ""


def test_one_prompt_that_counts_gives_no_interval_either_and_the_demo_shows_the_value_without_one(tmp_path):
    """Prompts with no round in either arm add nothing to a resample: over one prompt that counts the interval was
    zero-width too. The demo's Markdown table and ratio plot show such a ratio without an interval (they blanked it)."""
    from lilicorr_pl.demo.run import format_table, markdown_table, plot_ratios

    ratio, low, high = bootstrap_ratio([3.0, math.nan, math.nan], [4, 0, 0], [2.0, math.nan, math.nan], [6, 0, 0])
    assert ratio == pytest.approx(1.5) and math.isnan(low) and math.isnan(high)
    row = {"benchmark": "stdlib-heldout", "temperature": 0.0, "arm": "lilicorr", "tau": 3.0, "ratio_to_dflash": 1.5,
           "ci_low": math.nan, "ci_high": math.nan, "per_position_acceptance": [0.5], "per_prompt_tau": [3.0],
           "per_prompt_rounds": [2]}
    table = markdown_table([row])
    assert "| 1.500 [no interval] |" in table
    assert table.endswith("One prompt with rounds: no interval (a bootstrap over one prompt resamples only it); "
                          "decode 20 or more for intervals.")
    assert format_table([row]).splitlines()[-1].startswith("one prompt with rounds: no interval")
    png = plot_ratios([row], tmp_path / "ratios.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
