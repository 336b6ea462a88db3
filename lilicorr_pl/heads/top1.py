"""Vanilla DFlash selection: per-slot argmax (DESIGN §4.1), the control arm."""

from __future__ import annotations

from lilicorr_pl.heads.base import Selection, SelectContext, Selector
from lilicorr_pl.models.dflash import DraftOutput


class Top1Selector(Selector):
    """Per-slot argmax of the drafter logits. No parameters; this is the vanilla DFlash control.

    With sampled drafts (``context.sampling``) every slot is drawn independently from its own warped
    softmax ``warp(z_k / T, top_p)`` over the vocabulary, and that distribution is the proposal ``q``
    (what the serving engines do for DFlash at T > 0).
    """

    name = "top1"
    parameter_free = True

    def select(self, draft: DraftOutput, context: SelectContext) -> Selection:
        """The drafter's top-1 token at every slot, or a draw from each slot's warped softmax."""
        if context.sampling is None:
            return Selection(tokens=draft.slot_logits.argmax(dim=-1))  # [b, S]
        tokens, q = context.sampling.sample(draft.slot_logits)  # [b, S], [b, S, V]
        return Selection(tokens=tokens, q=q)
