"""The lattice oracle: the best any chain reranker over the drafter's top-K could do (greedy, T = 0).

At T = 0 the target's output is known in advance (speculative decoding is lossless), so an oracle
selector can pick, at every slot, the target's own token whenever it is among the slot's top-K
candidates. Its real τ is the ceiling for LiLiCorr (and any top-K reranker) on the same drafter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lilicorr_pl.heads.base import Selection, Selector


class AnchorTracker:
    """Wraps a drafter and remembers the absolute position of the last drafted block's anchor."""

    def __init__(self, drafter: Any) -> None:
        self.drafter = drafter
        self.anchor_position = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.drafter, name)

    def draft(self, cache: Any, new_features: Any, *args: Any, **kwargs: Any) -> Any:
        out = self.drafter.draft(cache, new_features, *args, **kwargs)
        self.anchor_position = cache.length  # the anchor sits right after the context
        return out


class OracleSelector(Selector):
    """Picks the target's greedy token at each slot when it is in the drafter's top-K, else top-1.

    Args:
        top_k: lattice width ``K`` of the bound.
        reference: the target's greedy continuation of the prompt (generated tokens only).
        prompt_length: prompt tokens before the first generated token.
        tracker: the :class:`AnchorTracker` wrapping the drafter used in the same decoding run.
    """

    def __init__(self, top_k: int, reference: Sequence[int], prompt_length: int, tracker: AnchorTracker) -> None:
        super().__init__()
        self.top_k = top_k
        self.reference = list(reference)
        self.prompt_length = prompt_length
        self.tracker = tracker

    def select(self, slot_hidden: torch.Tensor, slot_logits: torch.Tensor, anchor_feature: torch.Tensor,
               embed: Any, **_: Any) -> Selection:
        s = slot_logits.shape[1]
        top = slot_logits[0].topk(min(self.top_k, slot_logits.shape[-1]), dim=-1).indices  # [S, K]
        g = self.tracker.anchor_position - self.prompt_length  # index of the anchor among generated tokens
        tokens = top[:, 0].clone()
        for k in range(s):  # S <= 15 scalar checks per round: evaluation only, never in training
            i = g + 1 + k
            if i < len(self.reference) and (top[k] == self.reference[i]).any():
                tokens[k] = self.reference[i]
        return Selection(tokens.unsqueeze(0))
