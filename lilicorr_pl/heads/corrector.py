"""The corrector-head interface shared by the baseline heads Domino and DSpark (DESIGN §4.3).

A corrector head adds a correction to the drafter's slot logits that depends on the block's previous
token(s). Training is teacher-forced and fully parallel over the slots
(:meth:`CorrectorHead.corrected_logits`); inference runs ``S`` sequential **V-wide** steps, each
conditioned on the head's own previous pick (:meth:`CorrectorHead.select`). Both paths share one
recurrence, :meth:`CorrectorHead.step`, so their agreement is testable slot by slot.

The first slot is conditioned on the anchor token ``x_0`` (the last committed token, the one the
drafter's block starts from), which :meth:`Selector.select` does not receive; corrector heads set
``needs_anchor_token = True`` and take it as the keyword ``anchor_tokens``.
"""

from __future__ import annotations

from typing import Any

import torch

from lilicorr_pl.heads.base import EmbedFn, Selection, Selector


class CorrectorHead(Selector):
    """Base class of heads that correct the slot logits conditioned on the previous tokens.

    Subclasses implement :meth:`_build_layers`, :meth:`initial_state`, :meth:`step` and
    :meth:`corrected_logits`; this class supplies the size bookkeeping, input checks and the greedy
    sequential decode.
    """

    uses_corrector: bool = True
    """Trained on :meth:`corrected_logits`: :class:`~lilicorr_pl.losses.CorrectorCE` (Domino),
    :class:`~lilicorr_pl.losses.DSparkLoss` (DSpark)."""
    needs_anchor_token: bool = True
    """:meth:`select` needs ``anchor_tokens=`` (the token ``x_0`` the block starts from)."""

    def _build_layers(self, hidden_size: int, vocab_size: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _build_layers()")

    # ------------------------------------------------------------------ the recurrence

    def initial_state(self, batch_size: int, device: torch.device) -> Any:
        """Recurrent state before slot 1 (None for a stateless head)."""
        return None

    def step(
        self,
        slot_hidden: torch.Tensor,
        slot_logits: torch.Tensor,
        prev_tokens: torch.Tensor,
        state: Any,
        embed: EmbedFn,
    ) -> tuple[torch.Tensor, Any]:
        """One slot of the recurrence (inference path, and the reference for the training path).

        Args:
            slot_hidden: ``[b, H]`` drafter hidden state of this slot.
            slot_logits: ``[b, V]`` drafter logits of this slot.
            prev_tokens: ``[b]`` long: the token before this slot (the anchor token for slot 1).
            state: the state returned by the previous step (or :meth:`initial_state`).
            embed: token ids -> frozen target input embeddings.

        Returns:
            ``(corrected logits [b, V], new state)``.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement step()")

    def corrected_logits(
        self,
        slot_hidden: torch.Tensor,
        slot_logits: torch.Tensor,
        prev_tokens: torch.Tensor,
        embed: EmbedFn,
    ) -> torch.Tensor:
        """Teacher-forced corrected logits of every slot at once (training path, with gradient).

        Args:
            slot_hidden: ``[M, S, H]`` drafter hidden states (live: the loss also trains the drafter).
            slot_logits: ``[M, S, V]`` live drafter logits.
            prev_tokens: ``[M, S]`` long: ``prev_tokens[:, 0]`` is the anchor token ``x_0`` and
                ``prev_tokens[:, k]`` the true token of slot ``k - 1``.
            embed: token ids -> frozen target input embeddings (always detached).

        Returns:
            ``[M, S, V]`` corrected logits; slot ``k`` equals :meth:`step` fed the same previous tokens.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement corrected_logits()")

    # ------------------------------------------------------------------ inference

    def select(
        self,
        slot_hidden: torch.Tensor,
        slot_logits: torch.Tensor,
        anchor_feature: torch.Tensor,
        embed: EmbedFn,
        anchor_tokens: torch.Tensor | None = None,
    ) -> Selection:
        """Greedy decode: ``S`` sequential V-wide steps, each conditioned on the head's own previous pick.

        Args:
            slot_hidden: ``[b, S, H]`` drafter hidden states of the speculative slots.
            slot_logits: ``[b, S, V]`` drafter logits of the speculative slots.
            anchor_feature: ``[b, H]`` fused context feature (unused by corrector heads).
            embed: token ids -> frozen target input embeddings.
            anchor_tokens: ``[b]`` long: the anchor token ``x_0`` each block starts from. Required.
        """
        if anchor_tokens is None:
            raise ValueError(
                f"{type(self).__name__}.select needs anchor_tokens= (the [b] last committed token each block "
                f"starts from): its first slot is conditioned on it. Heads with needs_anchor_token=True must be "
                f"called as select(..., anchor_tokens=anchor)"
            )
        self._check_inputs(slot_hidden, slot_logits)
        b, s, _ = slot_hidden.shape
        if anchor_tokens.numel() != b:
            raise ValueError(
                f"anchor_tokens has {anchor_tokens.numel()} entries (shape {tuple(anchor_tokens.shape)}) but "
                f"there are {b} blocks; pass one anchor token per block"
            )
        prev = anchor_tokens.reshape(b).to(device=slot_logits.device, dtype=torch.long)  # [b]
        state = self.initial_state(b, slot_logits.device)
        picks = []
        for k in range(s):
            logits, state = self.step(slot_hidden[:, k], slot_logits[:, k], prev, state, embed)  # [b, V]
            prev = logits.argmax(dim=-1)  # [b]
            picks.append(prev)
        return Selection(tokens=torch.stack(picks, dim=1))  # [b, S]

    def forward(
        self,
        slot_hidden: torch.Tensor,
        slot_logits: torch.Tensor,
        anchor_feature: torch.Tensor,
        embed: EmbedFn,
        anchor_tokens: torch.Tensor | None = None,
    ) -> Selection:
        """Alias of :meth:`select`."""
        return self.select(slot_hidden, slot_logits, anchor_feature, embed, anchor_tokens=anchor_tokens)

    # ------------------------------------------------------------------ helpers

    def _check_inputs(
        self, slot_hidden: torch.Tensor, slot_logits: torch.Tensor, prev_tokens: torch.Tensor | None = None
    ) -> None:
        name = type(self).__name__
        if not self.is_built:
            raise RuntimeError(
                f"{name} has no parameters yet; call head.build(target_hidden_size, vocab_size) first "
                f"(the system does this when it constructs the model)"
            )
        if slot_hidden.dim() != 3 or slot_logits.dim() != 3:
            raise ValueError(
                f"expected slot_hidden [M, S, H] and slot_logits [M, S, V], got "
                f"{tuple(slot_hidden.shape)} and {tuple(slot_logits.shape)}"
            )
        m, s, h = slot_hidden.shape
        if h != self.target_hidden_size or slot_logits.shape[-1] != self.vocab_size:
            raise ValueError(
                f"{name} was built for hidden_size {self.target_hidden_size} and vocab_size {self.vocab_size}, "
                f"got slot_hidden {tuple(slot_hidden.shape)} and slot_logits {tuple(slot_logits.shape)}; "
                f"build the head with the target's sizes"
            )
        if slot_logits.shape[:2] != (m, s):
            raise ValueError(
                f"slot_logits {tuple(slot_logits.shape)} and slot_hidden {tuple(slot_hidden.shape)} disagree on [M, S]"
            )
        if prev_tokens is not None and (prev_tokens.shape != (m, s) or prev_tokens.is_floating_point()):
            raise ValueError(
                f"expected prev_tokens [M={m}, S={s}] of token ids (anchor token, then the true tokens of "
                f"slots 1..S-1), got {tuple(prev_tokens.shape)} {prev_tokens.dtype}"
            )
