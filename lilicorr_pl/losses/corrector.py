"""The base-anchored curriculum loss of the corrector heads Domino and DSpark (DESIGN §4.3, §5.5)."""

from __future__ import annotations

import torch

from lilicorr_pl.heads.lattice import candidate_log_probs
from lilicorr_pl.losses.base import LossComponent, LossInputs, LossOutput, check_gamma, decay_weights, weighted_mean


class CorrectorCE(LossComponent):
    """``(1 − λ)·CE(final) + λ·CE(base)`` with λ annealed linearly from 1 to 0.

    ``CE(final)`` is the decayed per-slot cross-entropy of the corrector head's teacher-forced logits
    (``LossInputs.corrected_logits``), ``CE(base)`` that of the drafter's own logits, both normalised
    like :class:`~lilicorr_pl.losses.DFlashCE`. ``λ = max(0, 1 − step / anneal_steps)``, with ``step``
    the optimizer steps taken (``LossInputs.step``): training starts anchored on the drafter and hands
    over to the corrected logits. Logs ``lambda``, ``ce_final``, ``ce_base`` and ``top1_acc_final``.

    ``CE(base)`` repeats :class:`DFlashCE`; with both configured the drafter's CE is counted twice.
    """

    name = "corrector_ce"
    requires_corrector: bool = True

    def __init__(
        self, weight: float = 1.0, gamma: float = 7.0, anneal_steps: int = 1000, name: str | None = None
    ) -> None:
        """
        Args:
            weight: multiplier in the total loss.
            gamma: position-decay constant γ (7 for block 16, 5 for block 10, 4 for block 8).
            anneal_steps: optimizer steps over which λ falls from 1 to 0 (0 = train on the corrected
                logits alone from the start).
            name: log name; defaults to ``corrector_ce``.
        """
        super().__init__(weight=weight, name=name)
        self.gamma = check_gamma(type(self).__name__, gamma)
        if isinstance(anneal_steps, bool) or int(anneal_steps) != anneal_steps or anneal_steps < 0:
            raise ValueError(f"CorrectorCE anneal_steps must be an integer >= 0, got {anneal_steps!r}")
        self.anneal_steps = int(anneal_steps)

    def curriculum_lambda(self, step: int) -> float:
        """Weight λ of the base CE after ``step`` optimizer steps: 1 at step 0, 0 from ``anneal_steps`` on."""
        if self.anneal_steps == 0:
            return 0.0
        return max(0.0, 1.0 - float(step) / self.anneal_steps)

    def check_inputs(self, inputs: LossInputs) -> None:
        super().check_inputs(inputs)
        corrected = getattr(inputs, "corrected_logits", None)
        if corrected is None:
            raise ValueError(
                f"CorrectorCE ({self.name}) needs a corrector head such as DominoHead or DSparkHead as "
                f"model.head (LossInputs.corrected_logits is None); set model.head to "
                f"lilicorr_pl.heads.DominoHead or lilicorr_pl.heads.DSparkHead, or remove this loss"
            )
        if corrected.shape != inputs.drafter_logits.shape:
            raise ValueError(
                f"corrected_logits {tuple(corrected.shape)} and drafter_logits "
                f"{tuple(inputs.drafter_logits.shape)} must both be [M, S, V]"
            )

    def forward(self, inputs: LossInputs) -> LossOutput:
        self.check_inputs(inputs)
        corrected, base, mask = inputs.corrected_logits, inputs.drafter_logits, inputs.label_mask.bool()
        labels = torch.where(mask, inputs.labels, torch.zeros_like(inputs.labels)).unsqueeze(-1)  # safe ids
        slot_weights = decay_weights(base.shape[1], self.gamma, base.device)  # [S]
        lam = self.curriculum_lambda(int(getattr(inputs, "step", 0)))
        ce_final = weighted_mean(-candidate_log_probs(corrected, labels).squeeze(-1), mask, slot_weights)
        # With λ = 0 the base term is only logged: skip its V-wide backward.
        with torch.set_grad_enabled(torch.is_grad_enabled() and lam > 0):
            ce_base = weighted_mean(-candidate_log_probs(base, labels).squeeze(-1), mask, slot_weights)
        loss = (1.0 - lam) * ce_final + lam * ce_base if lam > 0 else ce_final
        with torch.no_grad():
            correct = (corrected.argmax(dim=-1) == labels.squeeze(-1)) & mask
            top1_acc_final = correct.sum() / mask.sum().clamp_min(1)
        logs = {
            "lambda": torch.tensor(lam, device=base.device),
            "ce_final": ce_final.detach(),
            "ce_base": ce_base.detach(),
            "top1_acc_final": top1_acc_final.float(),
        }
        return LossOutput(loss=self.weight * loss, logs=logs)
