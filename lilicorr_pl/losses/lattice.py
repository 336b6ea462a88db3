"""LiLiCorr lattice losses (DESIGN §5.2-5.4), all on the forced (oracle-prefix) slots.

Shared conventions:

* Supervised slots are the forced slots of :func:`~lilicorr_pl.losses.forced.forced_slots`: the
  oracle prefix, ended by the first slot whose true token is outside the lattice. Later slots are not
  supervised, and a block with any slot off the sequence end or outside the loss mask is skipped
  whole (the reference's ``valid_block = slot_mask.all(-1)``), not truncated.
* Each forced slot's scores are its teacher-forced row: start scores for the first slot, else the
  pair row leaving the true candidate of the previous slot.
* Normalisation: by default a plain mean over the forced slots of the batch, as the reference
  averages its lattice terms (DESIGN §5.2). ``gamma`` switches on the DFlash position decay,
  ``Σ w_k·ℓ_{m,k} / Σ w_k`` with ``w_k = exp(-(k-1)/γ)``, as an option. A batch with no forced slot
  gives 0 (with a graph).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lilicorr_pl.losses.base import LossComponent, LossInputs, LossOutput, check_gamma, decay_weights, weighted_mean
from lilicorr_pl.losses.forced import forced_slots


class _ForcedSlotLoss(LossComponent):
    requires_lattice = True

    def __init__(self, weight: float, gamma: float | None, name: str | None) -> None:
        super().__init__(weight=weight, name=name)
        self.gamma = check_gamma(type(self).__name__, gamma)

    def _reduce(self, per_slot: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return weighted_mean(per_slot, mask, decay_weights(per_slot.shape[1], self.gamma, per_slot.device))


class OraclePrefixCE(_ForcedSlotLoss):
    """Cross-entropy of the true candidate under a softmax over each forced slot's K scores.

    Logs ``ce`` (unweighted), ``forced_len`` (mean oracle prefix length per valid block) and
    ``forced_acc`` (fraction of forced slots whose teacher-forced argmax is the true candidate).
    """

    name = "oracle_prefix_ce"

    def __init__(self, weight: float = 0.25, gamma: float | None = None, name: str | None = None) -> None:
        """
        Args:
            weight: multiplier in the total loss (0.25 in the recipe; 0.125 in the "margin" variant).
            gamma: optional position-decay constant γ of the per-slot weights; None (the reference) for
                a plain mean over forced slots.
            name: log name; defaults to ``oracle_prefix_ce``.
        """
        super().__init__(weight=weight, gamma=gamma, name=name)

    def forward(self, inputs: LossInputs) -> LossOutput:
        self.check_inputs(inputs)
        forced = forced_slots(inputs)
        scores = forced.scores.float()  # [M, S, K]
        m, s, k = scores.shape
        ce = F.cross_entropy(scores.reshape(m * s, k), forced.target.reshape(m * s), reduction="none")
        loss = self._reduce(ce.view(m, s), forced.mask)
        with torch.no_grad():
            hits = (scores.argmax(dim=-1) == forced.target) & forced.mask
            logs = {
                "ce": loss.detach(),
                "forced_len": forced.length.sum() / forced.valid_block.sum().clamp_min(1),
                "forced_acc": hits.sum() / forced.mask.sum().clamp_min(1),
            }
        return LossOutput(loss=self.weight * loss, logs=logs)


class MarginHinge(_ForcedSlotLoss):
    """``relu(m - (score_true - max_{j≠true} score_j))`` on each forced slot.

    With ``K = 1`` there is no competitor and the hinge is 0. Logs ``hinge`` (unweighted) and
    ``violation_rate`` (fraction of forced slots with a positive hinge).
    """

    name = "margin_hinge"

    def __init__(
        self, weight: float = 0.0, margin: float = 2.0, gamma: float | None = None, name: str | None = None
    ) -> None:
        """
        Args:
            weight: multiplier in the total loss (0 in the "base" variant, 0.125 in "margin").
            margin: required score margin ``m`` of the true candidate over the best other one.
            gamma: optional position-decay constant γ of the per-slot weights; None (the reference) for
                a plain mean over forced slots.
            name: log name; defaults to ``margin_hinge``.
        """
        super().__init__(weight=weight, gamma=gamma, name=name)
        if not math.isfinite(margin):  # a nan margin made the loss nan, silently
            raise ValueError(f"MarginHinge margin must be a finite number, got {margin}")
        self.margin = float(margin)

    def forward(self, inputs: LossInputs) -> LossOutput:
        self.check_inputs(inputs)
        forced = forced_slots(inputs)
        scores = forced.scores.float()  # [M, S, K]
        true_score = scores.gather(-1, forced.target.unsqueeze(-1)).squeeze(-1)  # [M, S]
        is_true = F.one_hot(forced.target, scores.shape[-1]).bool()  # [M, S, K]
        best_other = scores.masked_fill(is_true, float("-inf")).max(dim=-1).values  # [M, S]
        hinge = F.relu(self.margin - (true_score - best_other))  # [M, S]; 0 when K == 1 (-inf)
        loss = self._reduce(hinge, forced.mask)
        with torch.no_grad():
            violations = (hinge > 0) & forced.mask
            logs = {"hinge": loss.detach(), "violation_rate": violations.sum() / forced.mask.sum().clamp_min(1)}
        return LossOutput(loss=self.weight * loss, logs=logs)


class DistractorPenalty(_ForcedSlotLoss):
    """Expected target cost of the head's choice: ``E_{j~softmax(scores)} relu(z_t(true) - z_t(c_j))``.

    ``z_t`` are the target's teacher-forced logits at the slot's position, read through
    ``inputs.target_logits`` in one call for the K candidates plus the true token. The costs are
    constants (the target is frozen); the gradient flows through the softmax into the head and the
    drafter. It suppresses confusers the target would reject. Logs ``penalty`` (unweighted).
    Turn it off with ``weight: 0`` or by removing it from ``model.losses``.
    """

    name = "distractor_penalty"
    requires_target_logits = True

    def __init__(self, weight: float = 0.25, gamma: float | None = None, name: str | None = None) -> None:
        """
        Args:
            weight: multiplier in the total loss (0.25 in the recipe).
            gamma: optional position-decay constant γ of the per-slot weights; None (the reference) for
                a plain mean over forced slots.
            name: log name; defaults to ``distractor_penalty``.
        """
        super().__init__(weight=weight, gamma=gamma, name=name)

    def forward(self, inputs: LossInputs) -> LossOutput:
        self.check_inputs(inputs)
        forced = forced_slots(inputs)
        lattice = inputs.lattice
        assert lattice is not None  # check_inputs
        mask = inputs.label_mask.bool()
        # Unsupervised labels may be arbitrary (e.g. -100); query a real id there instead.
        safe_labels = torch.where(mask, inputs.labels, lattice.candidates[..., 0])  # [M, S]
        ids = torch.cat([lattice.candidates, safe_labels.unsqueeze(-1)], dim=-1)  # [M, S, K+1]
        with torch.no_grad():
            z = inputs.target_logits(ids).float()  # [M, S, K+1]
        if z.shape != ids.shape:
            raise ValueError(
                f"target_logits returned shape {tuple(z.shape)} for ids of shape {tuple(ids.shape)}; "
                f"it must return one logit per id"
            )
        cost = F.relu(z[..., -1:] - z[..., :-1])  # [M, S, K]; 0 for the true candidate
        probs = forced.scores.float().softmax(dim=-1)  # [M, S, K]
        penalty = (probs * cost).sum(dim=-1)  # [M, S]
        loss = self._reduce(penalty, forced.mask)
        return LossOutput(loss=self.weight * loss, logs={"penalty": loss.detach()})
