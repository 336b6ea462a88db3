"""Speculative decoding against the frozen target, the plain-decoding baseline, and acceptance metrics.

τ (acceptance length) always counts the target's bonus token: ``τ_round = accepted drafts + 1``.
"""

from lilicorr_pl.decoding.metrics import AcceptanceMetrics
from lilicorr_pl.decoding.speculative import (
    GenerationResult,
    default_stop_token_ids,
    greedy_accept,
    sample_tokens,
    speculative_generate,
    speculative_sampling_accept,
    target_generate,
    warp_probs,
)

__all__ = [
    "AcceptanceMetrics",
    "GenerationResult",
    "default_stop_token_ids",
    "greedy_accept",
    "sample_tokens",
    "speculative_generate",
    "speculative_sampling_accept",
    "target_generate",
    "warp_probs",
]
