"""Temperature / nucleus warping and drawing, shared by the target's sampling and the selectors' drafts.

One implementation for both sides matters for losslessness: the speculative-sampling rule
``min(1, p/q)`` is exact only when ``q`` is the very distribution a draft was drawn from, and ``p`` the
very distribution plain decoding samples. Both come from :func:`warp_probs`; draws go through
:func:`draw`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def warp_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Sampling distribution ``softmax(logits / T)`` with optional nucleus (top-p) truncation.

    ``logits [..., N]`` -> float32 probabilities ``[..., N]`` over the last dim (the vocabulary, or a
    lattice slot's ``K`` candidates). Requires ``temperature > 0``.
    """
    if temperature <= 0:
        raise ValueError(f"warp_probs needs temperature > 0, got {temperature}; T = 0 is greedy")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}; 1.0 disables nucleus sampling")
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the top-1 token is always kept).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of ``probs [..., N]`` -> ``[...]`` long."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


@dataclass(frozen=True)
class DraftSampling:
    """How a selector samples its draft at ``T > 0``: the target's own temperature and top-p.

    The serving references draft with the request's sampling parameters (SGLang's
    ``DraftSamplingParams`` defaults to them), so the proposal ``q`` is as close to the target's
    warped ``p`` as the drafter allows.
    """

    temperature: float
    """``T > 0``; the selector samples ``warp_probs(scores, T, top_p)``."""
    top_p: float = 1.0
    """Nucleus truncation of the proposal (1.0 = none)."""
    generator: torch.Generator | None = None
    """RNG for the draws (on the drafter's device)."""

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature <= 0:
            raise ValueError(
                f"DraftSampling needs temperature > 0, got {self.temperature}; greedy drafts pass sampling=None"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"DraftSampling top_p must be in (0, 1], got {self.top_p}")

    def probs(self, scores: torch.Tensor) -> torch.Tensor:
        """The proposal over the last dim of ``scores`` (logits or lattice log-potentials), float32."""
        return warp_probs(scores, self.temperature, self.top_p)

    def sample(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(drawn index [...], proposal [..., N])`` from ``scores [..., N]``."""
        q = self.probs(scores)
        return draw(q, self.generator), q
