"""Vanilla DFlash selection: per-slot argmax (DESIGN §4.1), the control arm."""

from __future__ import annotations

import torch

from lilicorr_pl.heads.base import EmbedFn, Selection, Selector


class Top1Selector(Selector):
    """Per-slot argmax of the drafter logits. No parameters; this is the vanilla DFlash control."""

    def select(
        self,
        slot_hidden: torch.Tensor,
        slot_logits: torch.Tensor,
        anchor_feature: torch.Tensor,
        embed: EmbedFn,
    ) -> Selection:
        """Return the drafter's top-1 token at every slot (the other inputs are ignored)."""
        return Selection(tokens=slot_logits.argmax(dim=-1))  # [b, S]
