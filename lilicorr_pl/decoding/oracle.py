"""The lattice oracle: the best any chain reranker over the drafter's top-K could do (greedy, T = 0).

At T = 0 the target's output is known in advance (speculative decoding is lossless), so an oracle
selector can pick, at every slot, the target's own token whenever it is among the slot's top-K
candidates. Its real τ is the ceiling for LiLiCorr (and any top-K reranker) on the same drafter.
"""

from __future__ import annotations

from collections.abc import Sequence

from lilicorr_pl.heads.base import Selection, SelectContext, Selector
from lilicorr_pl.models.dflash import DraftOutput


class OracleSelector(Selector):
    """Picks the target's greedy token at each slot when it is in the drafter's top-K, else top-1.

    Deterministic at any temperature (it never returns a proposal ``q``); meaningful at T = 0 only,
    where the reference is the output.

    Args:
        top_k: lattice width ``K`` of the bound.
        reference: the target's greedy continuation of the prompt (generated tokens only).
        prompt_length: prompt tokens before the first generated token.
    """

    parameter_free = True

    def __init__(self, top_k: int, reference: Sequence[int], prompt_length: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.reference = list(reference)
        self.prompt_length = prompt_length

    def select(self, draft: DraftOutput, context: SelectContext) -> Selection:
        slot_logits = draft.slot_logits
        s = slot_logits.shape[1]
        top = slot_logits[0].topk(min(self.top_k, slot_logits.shape[-1]), dim=-1).indices  # [S, K]
        g = int(context.anchor_positions[0]) - self.prompt_length  # index of the anchor among generated tokens
        tokens = top[:, 0].clone()
        for k in range(s):  # S <= 15 scalar checks per round: evaluation only, never in training
            i = g + 1 + k
            if i < len(self.reference) and (top[k] == self.reference[i]).any():
                tokens[k] = self.reference[i]
        return Selection(tokens.unsqueeze(0))
