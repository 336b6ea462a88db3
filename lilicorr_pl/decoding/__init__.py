"""Speculative decoding against the frozen target, the plain-decoding baseline, and acceptance metrics.

τ (acceptance length) always counts the target's bonus token: ``τ_round = accepted drafts + 1``.
"""

from lilicorr_pl.decoding.metrics import AcceptanceMetrics
from lilicorr_pl.decoding.speculative import (
    DRAFT_SAMPLING_RULES,
    DraftSamplingRule,
    GenerationResult,
    default_stop_token_ids,
    draft_sampling_for,
    greedy_accept,
    sample_tokens,
    speculative_generate,
    speculative_sampling_accept,
    target_generate,
    verify_block,
    warp_probs,
)

__all__ = [
    "DRAFT_SAMPLING_RULES",
    "AcceptanceMetrics",
    "DraftSamplingRule",
    "GenerationResult",
    "default_stop_token_ids",
    "draft_sampling_for",
    "greedy_accept",
    "sample_tokens",
    "speculative_generate",
    "speculative_sampling_accept",
    "target_generate",
    "verify_block",
    "warp_probs",
]
