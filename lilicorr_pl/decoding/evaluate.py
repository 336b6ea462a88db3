"""Real speculative acceptance on a prompt set: one code path for the callback, ``bench`` and the demo.

Every arm (a drafter and a selector) decodes the same prompts, one arm at a time (:func:`evaluate_arm`) or
interleaved with plain decoding prompt by prompt (:func:`evaluate_arms`); τ always includes the target's
bonus token. The raw counts (accepted-length histogram, generated tokens, seconds) are kept in the
result so callers can sum them across processes and recompute every statistic exactly with
:func:`summarize`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lilicorr_pl.decoding.benchmarks import PromptSet
from lilicorr_pl.decoding.metrics import AcceptanceMetrics
from lilicorr_pl.decoding.speculative import (
    DraftSamplingRule,
    GenerationResult,
    speculative_generate,
    target_generate,
)

__all__ = ["ArmResult", "ArmSpec", "evaluate_arm", "evaluate_arms", "plain_step_ms", "run_target_baseline", "summarize", "warmup"]


@dataclass
class ArmResult:
    """What one selector achieved on one prompt set at one temperature."""

    tau: float
    """Mean tokens committed per verify round, **including** the target's bonus token (NaN: no round)."""
    per_position_acceptance: list[float]
    """``P(draft k accepted | drafts < k accepted)`` for ``k = 1..S`` (NaN where no round reached k)."""
    histogram: list[int]
    """Verify rounds with ``0..S`` accepted drafts."""
    tokens_per_s: float
    """Generated tokens per second of end-to-end generation time (prefill included)."""
    num_tokens: int
    seconds: float
    head_time_fraction: float
    """Selector time / round time (draft + selector + verify + bookkeeping, i.e. the decode loop)."""
    draft_time_fraction: float
    """Drafter forward time / round time (draft + selector + verify + bookkeeping)."""
    lossless: bool | None = None
    """T = 0 with a reference only: every output equals plain greedy target decoding."""
    draft_sampling: str | None = None
    """The T > 0 acceptance rule used (``"proposal"`` or ``"point_mass"``); None at T = 0 (greedy)."""
    per_prompt_tau: list[float] = field(default_factory=list)
    per_prompt_rounds: list[int] = field(default_factory=list)
    """Verify rounds of each prompt: with ``per_prompt_tau`` it gives pooled τ on any subset (bootstrap)."""
    emitted_per_round: float = math.nan
    """Tokens the rounds emitted, per round: over the prompts with a round, ``Σ (output tokens − 1) / Σ rounds`` (the
    prefill's token is no round's). τ counts every round's ``acc + 1`` as verified, also the last round's tokens
    past the budget or a stop token, which are not emitted; so this is ≤ τ, and the ratio of two arms' values is the
    ratio of the rounds they needed for the same output (at T = 0, where the outputs are equal)."""
    per_prompt_first_round: list[int] = field(default_factory=list)
    """Accepted drafts of each prompt's first verify round (-1: no round). The first round drafts right after the
    prompt, where a prompt unlike the training data hurts most."""
    slot1_first_round: float = math.nan
    """Share of first rounds (one per prompt with a round) that accepted their first draft (NaN: none)."""
    slot1_later_rounds: float = math.nan
    """Share of every later round that accepted its first draft (NaN: none). With :attr:`slot1_first_round` it
    splits ``per_position_acceptance[0]`` by whether the block starts at the prompt's boundary."""
    per_prompt_tokens: list[int] = field(default_factory=list)
    per_prompt_seconds: list[float] = field(default_factory=list)
    """Generated tokens and end-to-end seconds of each prompt: pooled tokens/s on any subset (bootstrap)."""
    examples: list[dict[str, Any]] = field(default_factory=list)
    """``{"prompt": text tail, "prompt_index": i, "rounds": [...]}`` for the first recorded prompts;
    each round as :attr:`GenerationResult.rounds` (token ids)."""
    round_ms: float = math.nan
    """Measured wall time of one speculative round, mean over all rounds of all prompts (ms).
    Equals ``draft_ms + head_ms + verify_ms + bookkeeping_ms``."""
    draft_ms: float = math.nan
    """Drafter forward per round (ms, mean)."""
    head_ms: float = math.nan
    """Selector (top-1, LiLiCorr, …) per round (ms, mean)."""
    verify_ms: float = math.nan
    """Target verify pass over ``[anchor, d_1..d_S]`` per round (ms, mean)."""
    bookkeeping_ms: float = math.nan
    """The rest of a round (ms, mean): acceptance / sampling, the host transfer, cache crops, commits."""
    plain_step_ms: float = math.nan
    """One plain decoding step of the same target, measured on the reference run (ms, mean over
    decode steps; NaN without a reference)."""
    round_cost_ratio: float = math.nan
    """``round_ms / plain_step_ms``: what a round costs in plain decoding steps. Speculative decoding
    beats plain decoding when τ exceeds it."""

    @property
    def rounds(self) -> int:
        return int(sum(self.histogram))

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def summarize(histogram: Sequence[int] | torch.Tensor, num_tokens: int = 0, seconds: float = 0.0) -> dict[str, Any]:
    """τ, per-position acceptance and tokens/s from an accepted-length histogram ``[S+1]`` and totals.

    The histogram determines every acceptance statistic, so histograms summed over prompts or ranks
    give exact pooled values (τ is a ratio of sums, not a mean of means).
    """
    hist = torch.as_tensor(histogram, dtype=torch.long).reshape(-1).cpu()  # [S+1]
    if hist.numel() < 2:
        raise ValueError(f"an accepted-length histogram has S + 1 >= 2 bins, got {hist.numel()}")
    metric = AcceptanceMetrics(num_slots=hist.numel() - 1, sync_on_compute=False)
    # One update with every round expanded from its bin reproduces the metric's own definitions.
    metric.update(torch.repeat_interleave(torch.arange(hist.numel()), hist), num_tokens, seconds)
    out = metric.compute()
    return {
        "tau": float(out["tau"]),
        "per_position_acceptance": [float(x) for x in out["per_position_acceptance"]],
        "histogram": [int(x) for x in out["histogram"]],
        "tokens_per_s": float(out["tokens_per_s"]),
        "num_tokens": int(out["num_tokens"]),
        "seconds": float(out["seconds"]),
    }


def _generator(target: Any, seed: int) -> torch.Generator:
    # Sampling draws on the target's device, so the generator must live there too.
    return torch.Generator(device=target.device).manual_seed(seed)


def plain_step_ms(results: Sequence[GenerationResult]) -> float:
    """Measured milliseconds per decode step of plain decoding results (mean over all steps; NaN if none)."""
    steps = sum(r.num_steps for r in results)
    return 1e3 * sum(r.step_seconds for r in results) / steps if steps else math.nan


def run_target_baseline(
    target: Any,
    prompts: PromptSet,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    timing: bool = False,
    stop_token_ids: Sequence[int] | None = None,
) -> tuple[list[GenerationResult], float]:
    """Plain target decoding on every prompt; returns the results and tokens/s (prefill included).

    :func:`plain_step_ms` of the results is the per-step cost that :func:`evaluate_arm` compares a
    round with. ``timing``: see :func:`~lilicorr_pl.decoding.speculative.speculative_generate`.
    ``stop_token_ids``: as :func:`evaluate_arm`'s (the same stops on both sides, or ``lossless`` compares outputs
    cut at different places); None = the target's own.
    """
    results, tokens, seconds = [], 0, 0.0
    for i, ids in enumerate(prompts.input_ids):
        g = _generator(target, seed + i)
        r = target_generate(target, ids, max_new_tokens, temperature=temperature, generator=g, timing=timing,
                            stop_token_ids=stop_token_ids)
        tokens += len(r.tokens)
        seconds += r.total
        results.append(r)
    return results, tokens / seconds if seconds > 0 else math.nan


@dataclass(frozen=True)
class ArmSpec:
    """One arm of :func:`evaluate_arms`: the drafter, the selector and (T > 0) the acceptance rule it decodes with."""

    drafter: Any
    selector: Any
    draft_sampling: DraftSamplingRule = "proposal"


def evaluate_arm(
    target: Any,
    drafter: Any,
    selector: Any,
    prompts: PromptSet,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    reference: Sequence[GenerationResult] | None = None,
    record_examples: int = 0,
    record_rounds: int = 4,
    timing: bool = False,
    draft_sampling: DraftSamplingRule = "proposal",
    stop_token_ids: Sequence[int] | None = None,
    prompt_indices: Sequence[int] | None = None,
) -> ArmResult:
    """Speculative decoding over a prompt set with one selector.

    Args:
        draft_sampling: the T > 0 rule: ``"proposal"`` (sampled drafts verified with
            ``min(1, p/q)``) or ``"point_mass"`` (deterministic drafts accepted iff equal to the
            target's sample); see :func:`~lilicorr_pl.decoding.speculative.speculative_generate`.
        reference: plain-decoding results of the same prompts (:func:`run_target_baseline`, with the same
            ``stop_token_ids``); at T = 0
            ``lossless`` says whether every output matched them token for token, and their measured
            step time gives ``plain_step_ms`` and ``round_cost_ratio``.
        record_examples: keep the first ``record_rounds`` rounds of this many leading prompts.
        timing: on CUDA, time the round's phases with CUDA events (device time; no synchronisation added).
        stop_token_ids: where generation stops; None = the target's own (``default_stop_token_ids``).
        prompt_indices: each prompt's index in the whole set when ``prompts`` is a slice of it (one rank's share):
            prompt ``j`` samples with seed ``seed + j`` however the set is split. None: ``0, 1, …``.
    """
    if reference is not None and len(reference) != len(prompts.input_ids):
        raise ValueError(f"reference has {len(reference)} results for {len(prompts.input_ids)} prompts")
    indices = list(range(len(prompts.input_ids))) if prompt_indices is None else list(prompt_indices)
    if len(indices) != len(prompts.input_ids):
        raise ValueError(f"prompt_indices has {len(indices)} entries for {len(prompts.input_ids)} prompts")
    results = [
        speculative_generate(
            target, drafter, selector, ids, max_new_tokens, temperature=temperature,
            generator=_generator(target, seed + j), record_rounds=record_rounds if i < record_examples else 0,
            timing=timing, draft_sampling=draft_sampling, stop_token_ids=stop_token_ids,
        )
        for i, (ids, j) in enumerate(zip(prompts.input_ids, indices))
    ]
    return _arm_result(results, prompts, drafter.num_slots, temperature, draft_sampling, reference, record_examples,
                       indices)


def evaluate_arms(
    target: Any,
    arms: Mapping[str, ArmSpec],
    prompts: PromptSet,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    timing: bool = False,
    stop_token_ids: Sequence[int] | None = None,
    warmup_tokens: int = 4,
    on_prompt: Callable[[], None] | None = None,
) -> tuple[list[GenerationResult], dict[str, ArmResult]]:
    """Plain decoding and every arm, **interleaved**: all of them decode prompt ``i`` before any decodes
    prompt ``i + 1``, in the orders of :func:`balanced_orders` taken in turn (each variant runs right after each
    other one equally often: rotating one order would put the same variant after plain decoding on most prompts,
    and whatever a run leaves behind -- warm caches, an allocator's pool -- would favour or burden one arm).

    A machine whose speed drifts over minutes (shared cores, thermal limits) then slows every arm alike, so
    tokens/s ratios between arms, and to plain decoding, measure the arms rather than the moment each ran;
    the per-prompt times (``per_prompt_seconds``) are paired across arms for a bootstrap interval. Every
    arm and the plain run of prompt ``i`` draw from the same seed ``seed + i``, as in :func:`evaluate_arm`.

    Before the timed loop every variant generates ``warmup_tokens`` untimed tokens of the first prompt at this
    temperature and rule, so lazy initialisation (a compiled selector's tracing, a sampling path's first use)
    is billed to no prompt. ``on_prompt`` is called once each prompt is done by every variant (progress).

    Returns:
        The plain-decoding results (the reference: ``lossless`` and ``plain_step_ms`` of every arm come from
        them) and one :class:`ArmResult` per arm, in ``arms``' order.
    """
    warmup(target, arms, prompts, warmup_tokens, temperature, seed)
    plain: list[GenerationResult] = []
    results: dict[str, list[GenerationResult]] = {name: [] for name in arms}
    variants: list[str | None] = [None, *arms]  # None: plain decoding (an arm may be called anything)
    orders = balanced_orders(len(variants))
    for i, ids in enumerate(prompts.input_ids):
        for name in (variants[v] for v in orders[i % len(orders)]):
            generator = _generator(target, seed + i)
            if name is None:
                plain.append(target_generate(target, ids, max_new_tokens, temperature=temperature,
                                             stop_token_ids=stop_token_ids, generator=generator, timing=timing))
                continue
            spec = arms[name]
            results[name].append(speculative_generate(
                target, spec.drafter, spec.selector, ids, max_new_tokens, temperature=temperature,
                generator=generator, timing=timing, draft_sampling=spec.draft_sampling, stop_token_ids=stop_token_ids,
            ))
        if on_prompt is not None:
            on_prompt()
    return plain, {
        name: _arm_result(results[name], prompts, spec.drafter.num_slots, temperature, spec.draft_sampling, plain)
        for name, spec in arms.items()
    }


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` variants in which each variant immediately follows every other one equally often
    (a Williams design, balanced for first-order carry-over): ``n`` orders for even ``n``, ``2n`` for odd ``n``
    (each order and its reverse). The first is ``0, 1, n-1, 2, n-2, …``; the others add ``r`` modulo ``n``."""
    if n < 1:
        raise ValueError(f"balanced_orders needs at least one variant, got {n}")
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    orders = [[(v + r) % n for v in first] for r in range(n)]
    return orders if n % 2 == 0 else orders + [order[::-1] for order in orders]


def warmup(target: Any, arms: Mapping[str, ArmSpec], prompts: PromptSet, max_new_tokens: int = 4,
           temperature: float = 0.0, seed: int = 0) -> None:
    """A few untimed tokens of the first prompt through plain decoding and every arm, at ``temperature`` and
    under each arm's rule, so lazy initialisation (a compiled selector's tracing, a sampling path's first use)
    is billed to no timed prompt."""
    if max_new_tokens <= 0 or not prompts.input_ids:
        return
    ids = prompts.input_ids[0]
    target_generate(target, ids, max_new_tokens, temperature=temperature, stop_token_ids=[],
                    generator=_generator(target, seed))
    for spec in arms.values():
        speculative_generate(target, spec.drafter, spec.selector, ids, max_new_tokens, temperature=temperature,
                             generator=_generator(target, seed), draft_sampling=spec.draft_sampling,
                             stop_token_ids=[])


def _arm_result(
    results: Sequence[GenerationResult],
    prompts: PromptSet,
    num_slots: int,
    temperature: float,
    draft_sampling: DraftSamplingRule,
    reference: Sequence[GenerationResult] | None,
    record_examples: int = 0,
    prompt_indices: Sequence[int] | None = None,
) -> ArmResult:
    """Pool one arm's per-prompt results (in prompt order) into its :class:`ArmResult` (``prompt_indices``: each
    prompt's index in the whole set, where ``prompts`` is one rank's share; its examples are named by it)."""
    # Process-local: callers that shard prompts over ranks sum the histograms themselves.
    metric = AcceptanceMetrics(num_slots=num_slots, sync_on_compute=False)
    metric.update([], 0, 0.0)  # defined (NaN) statistics even for an empty prompt slice
    lossless = True if (reference is not None and temperature == 0) else None
    for i, r in enumerate(results):
        metric.update(r.accepted_lengths, num_tokens=len(r.tokens), seconds=r.total)
        if lossless and r.tokens != reference[i].tokens:  # type: ignore[index]
            lossless = False
    out = metric.compute()
    draft, head = sum(r.draft for r in results), sum(r.head for r in results)
    verify, bookkeeping = sum(r.verify for r in results), sum(r.bookkeeping for r in results)
    rounds = sum(r.num_rounds for r in results)
    busy = draft + head + verify + bookkeeping

    def per_round_ms(seconds: float) -> float:
        return 1e3 * seconds / rounds if rounds else math.nan

    plain_ms = plain_step_ms(reference) if reference is not None else math.nan
    round_ms = per_round_ms(busy)
    first = [r.accepted_lengths[0] for r in results if r.accepted_lengths]
    later = [acc for r in results for acc in r.accepted_lengths[1:]]
    return ArmResult(
        tau=float(out["tau"]),
        per_position_acceptance=[float(x) for x in out["per_position_acceptance"]],
        histogram=[int(x) for x in out["histogram"]],
        tokens_per_s=float(out["tokens_per_s"]),
        num_tokens=int(out["num_tokens"]),
        seconds=float(out["seconds"]),
        head_time_fraction=head / busy if busy > 0 else math.nan,
        draft_time_fraction=draft / busy if busy > 0 else math.nan,
        lossless=lossless,
        draft_sampling=draft_sampling if temperature > 0 else None,
        per_prompt_tau=[r.tau if r.num_rounds else math.nan for r in results],
        per_prompt_rounds=[int(r.num_rounds) for r in results],
        emitted_per_round=(sum(max(len(r.tokens) - 1, 0) for r in results if r.num_rounds) / rounds
                           if rounds else math.nan),
        per_prompt_first_round=[int(r.accepted_lengths[0]) if r.accepted_lengths else -1 for r in results],
        slot1_first_round=sum(acc > 0 for acc in first) / len(first) if first else math.nan,
        slot1_later_rounds=sum(acc > 0 for acc in later) / len(later) if later else math.nan,
        per_prompt_tokens=[len(r.tokens) for r in results],
        per_prompt_seconds=[float(r.total) for r in results],
        examples=[{"prompt": prompts.texts[i][-200:], "prompt_index": i if prompt_indices is None else prompt_indices[i],
                   "rounds": r.rounds} for i, r in enumerate(results[:max(record_examples, 0)])],
        round_ms=round_ms,
        draft_ms=per_round_ms(draft),
        head_ms=per_round_ms(head),
        verify_ms=per_round_ms(verify),
        bookkeeping_ms=per_round_ms(bookkeeping),
        plain_step_ms=plain_ms,
        round_cost_ratio=round_ms / plain_ms if plain_ms > 0 else math.nan,
    )
