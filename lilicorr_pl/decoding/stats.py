"""Error bars for arm comparisons: paired bootstrap over prompts of a ratio of pooled τ (or tokens/s).

τ of an arm on a prompt set is pooled (committed tokens over verify rounds, bonus token included), so
a prompt with many rounds weighs more than one with few. Two arms decode the same prompts, so the
bootstrap resamples prompt indices once per replicate and recomputes both arms' pooled τ on that
resample (paired): prompt difficulty, shared by both arms, cancels in the ratio.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch


# Fewer prompts than this: a percentile bootstrap over them reads narrower than the truth (few distinct resamples), and
# over one prompt it has none: every resample is that prompt, a zero-width interval that looked certain.
FEW_PROMPTS = 10


def interval_text(low: float | None, high: float | None, spec: str) -> str:
    """``[low, high]`` in ``spec``, or ``[no interval]`` where there is none (NaN, null in a JSON: one prompt with
    rounds; or a row without the fields)."""
    if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)):
        return "[no interval]"
    return f"[{low:{spec}}, {high:{spec}}]"


def prompts_counted(per_prompt_rounds: Sequence[Sequence[float]]) -> int | None:
    """The fewest prompts with a round among arms' per-prompt rounds (what their intervals resample; None: none
    given)."""
    counts = [sum(1 for r in rounds if r and r > 0) for rounds in per_prompt_rounds if rounds is not None]
    return min(counts) if counts else None


def rounds_note(per_prompt_rounds: Sequence[Sequence[float] | None], otherwise: int) -> str:
    """The line under a table of arms (each arm's per-prompt rounds, None where a row has none): by the fewest prompts
    with a round (:func:`few_prompts_note`), or by ``otherwise`` where no arm says (the prompts decoded; rows of an
    older JSON)."""
    counted = prompts_counted(per_prompt_rounds)
    return few_prompts_note(otherwise if counted is None else counted)


def few_prompts_note(num_prompts: int) -> str:
    """A line under results whose intervals are over few prompts ("" from :data:`FEW_PROMPTS` on)."""
    if num_prompts >= FEW_PROMPTS:
        return ""
    if num_prompts == 0:
        return ("no prompt had a verify round (each output ended at its prefill token): no τ or τ interval to read; "
                "raise the token budget")
    if num_prompts < 2:
        return ("one prompt with rounds: no interval (a bootstrap over one prompt resamples only it); decode 20 or "
                "more for intervals")
    return (f"intervals over {num_prompts} prompts with rounds: a bootstrap over so few reads narrower than the "
            "truth; decode 20 or more for intervals to lean on")


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
    if int(((da > 0) | (db > 0)).sum()) < 2:  # every resample is the one prompt that counts: no interval (NaN)
        return float(ratio), math.nan, math.nan
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(na), (num_resamples, len(na)), generator=g)  # [R, n] prompt indices
    samples = (na[idx].sum(1) / da[idx].sum(1)) / (nb[idx].sum(1) / db[idx].sum(1))  # [R]
    alpha = (1 - confidence) / 2
    # A replicate whose denominator is 0 (only prompts without a round) has no ratio: it is left out.
    low, high = torch.nanquantile(samples, torch.tensor([alpha, 1 - alpha], dtype=torch.float64)).tolist()
    return float(ratio), float(low), float(high)


def bootstrap_tau_over_median_round_time(
    tau_a: Sequence[float],
    rounds_a: Sequence[int],
    seconds_a: Sequence[float],
    tau_b: Sequence[float],
    rounds_b: Sequence[int],
    seconds_b: Sequence[float],
    num_resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float, float]:
    """A tokens/s ratio of arm a to arm b that a few slow prompts do not move, with its paired bootstrap interval.

    Tokens/s is τ per round over time per round. The pooled τ ratio (:func:`bootstrap_ratio`) is divided by the
    **median over prompts** of a's time per round over b's on the same prompt (a prompt's seconds, its prefill
    included, over its rounds; prompts where either arm had no round are left out of the median). The pooled
    tokens/s ratio (:func:`bootstrap_ratio_of_sums`) weighs every second alike, so a spell in which the machine ran
    slow during one arm's prompts moves it; the median does not follow a minority of such prompts. The two readings
    differ a little even with no slow prompt: a prompt's tokens also count the prefill's first token and a last round
    cut at the token budget, which τ per round leaves out.

    Returns ``(ratio, median_round_time_ratio, low, high)``; each replicate resamples the prompts once for both parts.
    """
    n = len(tau_a)
    if not (n == len(rounds_a) == len(seconds_a) == len(tau_b) == len(rounds_b) == len(seconds_b)) or not n:
        raise ValueError("a paired bootstrap needs both arms' per-prompt values on the same, non-empty prompt set")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    ca, cb = _committed(tau_a, rounds_a), _committed(tau_b, rounds_b)
    ra, rb = (torch.as_tensor(x, dtype=torch.float64) for x in (rounds_a, rounds_b))
    sa, sb = (torch.as_tensor(x, dtype=torch.float64) for x in (seconds_a, seconds_b))
    valid = (ra > 0) & (rb > 0) & (sa > 0) & (sb > 0)
    if not bool(valid.any()):
        raise ValueError("no prompt has rounds and time in both arms: no round-time ratio to take a median of")
    per_prompt = torch.where(valid, (sa / ra.clamp_min(1)) / (sb / rb.clamp_min(1)).clamp_min(1e-300),
                             torch.full_like(sa, float("nan")))  # [n] a's time per round over b's; NaN: left out
    half = torch.tensor(0.5, dtype=torch.float64)
    median = torch.nanquantile(per_prompt, half)
    ratio = (ca.sum() / ra.sum()) / (cb.sum() / rb.sum()) / median
    if int(((ra > 0) | (rb > 0)).sum()) < 2:  # every resample is the one prompt that counts: no interval (NaN)
        return float(ratio), float(median), math.nan, math.nan
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n, (num_resamples, n), generator=g)  # [R, n] prompt indices
    tau_ratio = (ca[idx].sum(1) / ra[idx].sum(1)) / (cb[idx].sum(1) / rb[idx].sum(1))  # [R]
    samples = tau_ratio / torch.nanquantile(per_prompt[idx], half, dim=1)  # [R]; NaN where a resample has none
    alpha = (1 - confidence) / 2
    low, high = torch.nanquantile(samples, torch.tensor([alpha, 1 - alpha], dtype=torch.float64)).tolist()
    return float(ratio), float(median), float(low), float(high)


def paired_intervals(
    arm: Mapping[str, Any],
    reference: Mapping[str, Any] | None,
    against: str,
    plain: tuple[Sequence[float], Sequence[float]] | None = None,
    num_resamples: int = 2000,
    seed: int = 0,
) -> dict[str, float]:
    """Every paired interval of one arm, as the fields a results row carries (``bench`` and ``demo`` alike).

    ``arm`` and ``reference`` hold per-prompt lists over the same prompts (``per_prompt_tau``,
    ``per_prompt_rounds``, ``per_prompt_tokens``, ``per_prompt_seconds``); ``against`` names the reference in the
    field names; ``plain`` is ``(tokens, seconds)`` of plain decoding of those prompts. Returns, where the data allow:

    - ``ratio_to_<against>`` with ``ci_low``/``ci_high``: pooled τ;
    - ``tokens_per_s_ratio_to_<against>`` with ``tps_ci_low``/``tps_ci_high``: pooled tokens/s;
    - ``tokens_per_s_ratio_to_<against>_robust`` with ``tps_robust_ci_low``/``tps_robust_ci_high`` and
      ``round_time_ratio_to_<against>_median`` (:func:`bootstrap_tau_over_median_round_time`);
    - ``speedup_ci_low``/``speedup_ci_high``: tokens/s against plain decoding.

    Nothing is compared where a side has no round (τ) or no time (tokens/s): no field rather than a ratio of zeros.
    """
    out: dict[str, float] = {}
    rounds, seconds = sum(arm.get("per_prompt_rounds") or ()), sum(arm.get("per_prompt_seconds") or ())
    if plain is not None and seconds > 0 and sum(plain[1]) > 0:
        _, low, high = bootstrap_ratio_of_sums(arm["per_prompt_tokens"], arm["per_prompt_seconds"], plain[0], plain[1],
                                               num_resamples=num_resamples, seed=seed)
        out.update(speedup_ci_low=low, speedup_ci_high=high)
    if reference is None:
        return out
    tau_a, rounds_a, tau_b = arm.get("per_prompt_tau"), arm.get("per_prompt_rounds"), reference.get("per_prompt_tau")
    rounds_b = reference.get("per_prompt_rounds")
    if rounds > 0 and sum(rounds_b or ()) > 0:
        ratio, low, high = bootstrap_ratio(tau_a, rounds_a, tau_b, rounds_b, num_resamples=num_resamples, seed=seed)
        out.update({f"ratio_to_{against}": ratio, "ci_low": low, "ci_high": high})
    if seconds > 0 and sum(reference.get("per_prompt_seconds") or ()) > 0:
        ratio, low, high = bootstrap_ratio_of_sums(arm["per_prompt_tokens"], arm["per_prompt_seconds"],
                                                   reference["per_prompt_tokens"], reference["per_prompt_seconds"],
                                                   num_resamples=num_resamples, seed=seed)
        out.update({f"tokens_per_s_ratio_to_{against}": ratio, "tps_ci_low": low, "tps_ci_high": high})
        timed_rounds = zip(rounds_a or (), rounds_b or (), arm["per_prompt_seconds"], reference["per_prompt_seconds"])
        if any(a > 0 and b > 0 and x > 0 and y > 0 for a, b, x, y in timed_rounds):  # a prompt the median can use
            ratio, median, low, high = bootstrap_tau_over_median_round_time(
                tau_a, rounds_a, arm["per_prompt_seconds"], tau_b, rounds_b, reference["per_prompt_seconds"],
                num_resamples=num_resamples, seed=seed)
            out.update({f"round_time_ratio_to_{against}_median": median,
                        f"tokens_per_s_ratio_to_{against}_robust": ratio, "tps_robust_ci_low": low,
                        "tps_robust_ci_high": high})
    return out
