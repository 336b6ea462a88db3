"""DFlash cross-entropy (DESIGN §5.1)."""

from __future__ import annotations

import torch

from lilicorr_pl.heads.lattice import candidate_log_probs
from lilicorr_pl.losses.base import LossComponent, LossInputs, LossOutput, check_gamma, decay_weights, weighted_mean


class DFlashCE(LossComponent):
    """Per-slot cross-entropy of the drafter logits against the true tokens, with position decay.

    ``loss = Σ_{m,k supervised} w_k · CE_{m,k} / Σ_{m,k supervised} w_k`` with ``w_k = exp(-(k-1)/γ)``.
    Logs ``ce`` (the unweighted loss) and ``top1_acc`` (mean top-1 accuracy over supervised slots).
    """

    name = "dflash_ce"

    def __init__(self, weight: float = 1.0, gamma: float = 7.0, name: str | None = None) -> None:
        """
        Args:
            weight: multiplier in the total loss (1.0 in the recipe).
            gamma: position-decay constant γ (7 for block 16, 5 for block 10, 4 for block 8).
            name: log name; defaults to ``dflash_ce``.
        """
        super().__init__(weight=weight, name=name)
        self.gamma = check_gamma(type(self).__name__, gamma)

    def forward(self, inputs: LossInputs) -> LossOutput:
        logits, mask = inputs.drafter_logits, inputs.label_mask.bool()
        labels = torch.where(mask, inputs.labels, torch.zeros_like(inputs.labels))  # safe ids
        # Cross-entropy without a full fp32 copy of the [M, S, V] logits (the step's largest tensor).
        ce = -candidate_log_probs(logits, labels.unsqueeze(-1)).squeeze(-1)  # [M, S]
        loss = weighted_mean(ce, mask, decay_weights(logits.shape[1], self.gamma, logits.device))
        with torch.no_grad():
            correct = (logits.argmax(dim=-1) == labels) & mask
            top1_acc = correct.sum() / mask.sum().clamp_min(1)
        return LossOutput(loss=self.weight * loss, logs={"ce": loss.detach(), "top1_acc": top1_acc.float()})
