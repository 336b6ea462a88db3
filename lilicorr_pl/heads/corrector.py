"""The corrector-head interface shared by the baseline heads Domino and DSpark (DESIGN §4.3).

A corrector head adds a correction to the drafter's slot logits that depends on the block's previous
token(s). Training is teacher-forced and fully parallel over the slots
(:meth:`CorrectorHead.corrected_logits`); inference runs ``S`` sequential **V-wide** steps, each
conditioned on the head's own previous pick (:meth:`CorrectorHead.select`). Both paths share one
recurrence, :meth:`CorrectorHead.step`, so their agreement is testable slot by slot.

The first slot is conditioned on the anchor token ``x_0`` (the last committed token, the one the
drafter's block starts from): ``SelectContext.anchor_tokens`` at inference, ``TeacherForcing`` in
training.
"""

from __future__ import annotations

from typing import Any

import torch

from lilicorr_pl.heads.base import EmbedFn, HeadOutput, Selection, SelectContext, Selector, TeacherForcing
from lilicorr_pl.models.dflash import DraftOutput


class CorrectorHead(Selector):
    """Base class of heads that correct the slot logits conditioned on the previous tokens.

    Subclasses implement :meth:`_build_layers`, :meth:`initial_state`, :meth:`step` and
    :meth:`corrected_logits`; this class supplies the size bookkeeping, input checks, the training
    call and the sequential decode (greedy, or sampled from the corrected distributions).
    """

    uses_corrector: bool = True
    """Trained on :meth:`corrected_logits`: :class:`~lilicorr_pl.losses.CorrectorCE` (Domino),
    :class:`~lilicorr_pl.losses.DSparkLoss` (DSpark)."""

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
        slot: int,
    ) -> tuple[torch.Tensor, Any]:
        """One slot of the recurrence (inference path, and the reference for the training path).

        Args:
            slot_hidden: ``[b, H]`` drafter hidden state of this slot.
            slot_logits: ``[b, V]`` drafter logits of this slot.
            prev_tokens: ``[b]`` long: the token before this slot (the anchor token for slot 1).
            state: the state returned by the previous step (or :meth:`initial_state`).
            embed: token ids -> frozen target input embeddings.
            slot: this slot's index, 0 for slot 1 (a head may leave leading slots uncorrected).

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

    # ------------------------------------------------------------------ the interface

    def forward(self, draft: DraftOutput, context: TeacherForcing) -> HeadOutput:
        """Training call: teacher-forced corrected logits (slot ``k`` reads the true token of slot
        ``k - 1``, the anchor for the first slot) and their argmax."""
        corrected = self.corrected_logits(draft.slot_hidden, draft.slot_logits, context.previous_tokens, context.embed)
        return HeadOutput(selected=corrected.detach().argmax(dim=-1), corrected_logits=corrected)

    def select(self, draft: DraftOutput, context: SelectContext) -> Selection:
        """``S`` sequential V-wide steps, each conditioned on the head's own previous pick.

        Deterministic: the argmax of each slot's corrected logits. Sampled (``context.sampling``): a
        draw from each slot's warped corrected distribution, which is that slot's proposal ``q`` (it
        depends on the tokens drawn before it, as the recurrence does).
        """
        slot_hidden, slot_logits = draft.slot_hidden, draft.slot_logits
        self._check_inputs(slot_hidden, slot_logits)
        b, s, _ = slot_hidden.shape
        anchor_tokens = context.anchor_tokens
        if anchor_tokens.numel() != b:
            raise ValueError(
                f"SelectContext.anchor_tokens has {anchor_tokens.numel()} entries (shape "
                f"{tuple(anchor_tokens.shape)}) but there are {b} blocks; pass one anchor token per block"
            )
        prev = anchor_tokens.reshape(b).to(device=slot_logits.device, dtype=torch.long)  # [b]
        state = self.initial_state(b, slot_logits.device)
        picks, proposals = [], []
        for k in range(s):
            logits, state = self.step(slot_hidden[:, k], slot_logits[:, k], prev, state, context.embed, k)  # [b, V]
            if context.sampling is None:
                prev = logits.argmax(dim=-1)  # [b]
            else:
                prev, q = context.sampling.sample(logits)  # [b], [b, V]
                proposals.append(q)
            picks.append(prev)
        q = torch.stack(proposals, dim=1) if proposals else None  # [b, S, V]
        return Selection(tokens=torch.stack(picks, dim=1), q=q)  # [b, S]

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
