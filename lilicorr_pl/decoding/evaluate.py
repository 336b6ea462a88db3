"""Real speculative acceptance on a prompt set: one code path for the callback, ``bench`` and the demo."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lilicorr_pl.decoding.benchmarks import PromptSet
from lilicorr_pl.decoding.metrics import AcceptanceMetrics
from lilicorr_pl.decoding.speculative import GenerationResult, speculative_generate, target_generate


@dataclass
class ArmResult:
    """What one selector achieved on one prompt set at one temperature."""

    tau: float  # mean tokens committed per verify round, INCLUDING the target's bonus token
    per_position_acceptance: list[float]
    histogram: list[int]
    tokens_per_s: float
    num_tokens: int
    seconds: float
    head_time_fraction: float  # selector time / (draft + head + verify)
    draft_time_fraction: float
    lossless: bool | None = None  # T = 0 only: identical to plain greedy target decoding
    per_prompt_tau: list[float] = field(default_factory=list)
    examples: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def run_target_baseline(
    target: Any, prompts: PromptSet, max_new_tokens: int, temperature: float = 0.0, seed: int = 0
) -> tuple[list[GenerationResult], float]:
    """Plain target decoding on every prompt; returns results and tokens/s."""
    results, tokens, seconds = [], 0, 0.0
    for i, ids in enumerate(prompts.input_ids):
        g = torch.Generator(device="cpu").manual_seed(seed + i)
        t0 = time.perf_counter()
        r = target_generate(target, ids, max_new_tokens, temperature=temperature, generator=g)
        seconds += time.perf_counter() - t0
        tokens += len(r.tokens)
        results.append(r)
    return results, tokens / max(seconds, 1e-9)


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
) -> ArmResult:
    """Speculative decoding over a prompt set with one selector; compares with ``reference`` at T = 0."""
    metric = AcceptanceMetrics(num_slots=drafter.num_slots)
    draft = head = verify = 0.0
    per_prompt, examples = [], []
    lossless = True if (reference is not None and temperature == 0) else None
    for i, ids in enumerate(prompts.input_ids):
        g = torch.Generator(device="cpu").manual_seed(seed + i)
        t0 = time.perf_counter()
        r = speculative_generate(
            target, drafter, selector, ids, max_new_tokens, temperature=temperature, generator=g,
            record_rounds=4 if i < record_examples else 0,
        )
        seconds = time.perf_counter() - t0
        metric.update(r.accepted_lengths, num_tokens=len(r.tokens), seconds=seconds)
        draft, head, verify = draft + r.draft, head + r.head, verify + r.verify
        per_prompt.append(r.tau)
        if lossless is not None and r.tokens != reference[i].tokens:
            lossless = False
        if i < record_examples:
            examples.append({"prompt": prompts.texts[i][-200:], "rounds": r.rounds})
    out = metric.compute()
    busy = max(draft + head + verify, 1e-9)
    return ArmResult(
        tau=float(out["tau"]),
        per_position_acceptance=[float(x) for x in out["per_position_acceptance"]],
        histogram=[int(x) for x in out["histogram"]],
        tokens_per_s=float(out["tokens_per_s"]),
        num_tokens=int(metric.tokens.item()) if hasattr(metric, "tokens") else 0,
        seconds=float(metric.seconds.item()) if hasattr(metric, "seconds") else 0.0,
        head_time_fraction=head / busy,
        draft_time_fraction=(draft + head) / busy,
        lossless=lossless,
        per_prompt_tau=per_prompt,
        examples=examples,
    )
