"""The training losses of the corrector heads (DESIGN §4.3, §5.5).

:class:`CorrectorCE` is Domino's base-anchored curriculum; :class:`DSparkLoss` is DSpark's
CE + distribution-distance objective as DeepSpec trains it. Both read the head's teacher-forced
corrected logits (``LossInputs.corrected_logits``).
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from lilicorr_pl.heads.lattice import candidate_log_probs
from lilicorr_pl.losses.base import LossComponent, LossInputs, LossOutput, check_gamma, decay_weights, weighted_mean


def _check_corrected(component: LossComponent, inputs: LossInputs) -> None:
    corrected = inputs.corrected_logits
    if corrected is None:
        raise ValueError(
            f"{type(component).__name__} ({component.name}) needs a corrector head such as DominoHead or "
            f"DSparkHead as model.head (LossInputs.corrected_logits is None); set model.head to "
            f"lilicorr_pl.heads.DominoHead or lilicorr_pl.heads.DSparkHead, or remove this loss"
        )
    if corrected.shape != inputs.drafter_logits.shape:
        raise ValueError(
            f"corrected_logits {tuple(corrected.shape)} and drafter_logits "
            f"{tuple(inputs.drafter_logits.shape)} must both be [M, S, V]"
        )


class CorrectorCE(LossComponent):
    """Domino's base-anchored curriculum: ``(1 − λ)·CE(final) + λ·CE(base)``, λ annealed linearly from 1 to 0.

    ``CE(final)`` is the decayed per-slot cross-entropy of the corrector head's teacher-forced logits
    (``LossInputs.corrected_logits``), ``CE(base)`` that of the drafter's own logits, both normalised
    like :class:`~lilicorr_pl.losses.DFlashCE`. ``λ = max(0, 1 − step / L)`` with ``step`` the optimizer
    steps taken (``LossInputs.step``) and ``L`` the anneal length: by default the whole run
    (``anneal_fraction`` × ``trainer.estimated_stepping_batches``, passed as ``LossInputs.total_steps``),
    as the reference anneals it, so a longer run keeps the anchor longer. Training starts anchored on
    the drafter and hands over to the corrected logits. Logs ``lambda``, ``ce_final``, ``ce_base`` and
    ``top1_acc_final``.

    ``CE(base)`` repeats :class:`DFlashCE`; with both configured the drafter's CE is counted twice.
    """

    name = "corrector_ce"
    requires_corrector: bool = True

    def __init__(
        self,
        weight: float = 1.0,
        gamma: float = 7.0,
        anneal_fraction: float = 1.0,
        anneal_steps: int | None = None,
        name: str | None = None,
    ) -> None:
        """
        Args:
            weight: multiplier in the total loss.
            gamma: position-decay constant γ (7 for block 16, 5 for block 10, 4 for block 8).
            anneal_fraction: fraction of the run's optimizer steps over which λ falls from 1 to 0
                (1.0 = the whole run, the reference's default).
            anneal_steps: a fixed anneal length in optimizer steps instead of a fraction of the run
                (0 = train on the corrected logits alone from the start); for use outside a Trainer.
            name: log name; defaults to ``corrector_ce``.
        """
        super().__init__(weight=weight, name=name)
        self.gamma = check_gamma(type(self).__name__, gamma)
        if not (isinstance(anneal_fraction, (int, float)) and 0 < anneal_fraction <= 1):
            raise ValueError(
                f"CorrectorCE anneal_fraction must be in (0, 1] (1 = the whole run), got {anneal_fraction!r}"
            )
        if anneal_steps is not None and (
            isinstance(anneal_steps, bool) or int(anneal_steps) != anneal_steps or anneal_steps < 0
        ):
            raise ValueError(f"CorrectorCE anneal_steps must be an integer >= 0 or None, got {anneal_steps!r}")
        self.anneal_fraction = float(anneal_fraction)
        self.anneal_steps = None if anneal_steps is None else int(anneal_steps)

    def anneal_length(self, total_steps: int | None) -> int:
        """Optimizer steps over which λ falls to 0: ``anneal_steps``, else ``anneal_fraction`` of the run."""
        if self.anneal_steps is not None:
            return self.anneal_steps
        if total_steps is None:
            raise ValueError(
                f"CorrectorCE ({self.name}) anneals λ over the whole run, but the run's length is unknown "
                f"(LossInputs.total_steps is None: outside a Trainer, or a run with neither trainer.max_steps "
                f"nor a sized dataset); set trainer.max_steps, or give the loss a fixed anneal_steps"
            )
        return max(1, int(total_steps * self.anneal_fraction))

    def curriculum_lambda(self, step: int, total_steps: int | None = None) -> float:
        """Weight λ of the base CE after ``step`` optimizer steps: 1 at step 0, 0 from the anneal length on."""
        if step <= 0 and self.anneal_steps != 0:
            return 1.0  # the start of any anneal, whatever its length
        length = self.anneal_length(total_steps)
        if length == 0:
            return 0.0
        return max(0.0, 1.0 - float(step) / length)

    def check_inputs(self, inputs: LossInputs) -> None:
        super().check_inputs(inputs)
        _check_corrected(self, inputs)

    def forward(self, inputs: LossInputs) -> LossOutput:
        self.check_inputs(inputs)
        corrected, base, mask = inputs.corrected_logits, inputs.drafter_logits, inputs.label_mask.bool()
        labels = torch.where(mask, inputs.labels, torch.zeros_like(inputs.labels)).unsqueeze(-1)  # safe ids
        slot_weights = decay_weights(base.shape[1], self.gamma, base.device)  # [S]
        lam = self.curriculum_lambda(int(inputs.step), inputs.total_steps)
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


def _l1_rows(corrected: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``Σ_v |softmax(corrected) − softmax(target)|`` per row (fp32)."""
    return (corrected.float().softmax(dim=-1) - target.float().softmax(dim=-1)).abs().sum(dim=-1)


class DSparkLoss(LossComponent):
    """DSpark's objective as DeepSpec trains it: ``ce_weight·CE + l1_weight·L1`` on the corrected logits.

    ``CE`` is the decayed per-slot cross-entropy of the head's corrected logits against the true tokens;
    ``L1 = Σ_v |softmax(corrected) − softmax(z_t)|`` the distance between the corrected distribution and
    the target's own teacher-forced distribution at the same position (twice the total-variation
    distance: DeepSpec's ``l1_loss``, the paper's TVD term). Both use the position decay
    ``w_k = exp(-(k-1)/γ)`` and are normalised by the summed weights of the supervised slots, as
    DeepSpec's are. Defaults are DeepSpec's recipe (0.1 / 0.9). The target distribution comes from the
    online target, V-wide, chunk by chunk with recomputation in backward so no ``[M, S, V]`` fp32
    softmax is kept. Logs ``ce``, ``l1``, ``top1_acc_final`` and ``top1_acc_base``.

    The drafter is trained through the corrected logits only (DeepSpec has no separate backbone CE).
    """

    name = "dspark"
    requires_corrector: bool = True
    requires_target_distribution = True

    def __init__(
        self,
        weight: float = 1.0,
        ce_weight: float = 0.1,
        l1_weight: float = 0.9,
        gamma: float | None = 7.0,
        chunk_blocks: int = 64,
        name: str | None = None,
    ) -> None:
        """
        Args:
            weight: multiplier of the whole objective in the total loss.
            ce_weight: weight of the cross-entropy term (DeepSpec: 0.1).
            l1_weight: weight of the distribution-distance term (DeepSpec: 0.9).
            gamma: position-decay constant γ (7 for block 16, 5 for block 10, 4 for block 8); None for
                a plain mean.
            chunk_blocks: blocks per chunk of the V-wide distance (memory: ``chunk_blocks·S·V`` floats).
            name: log name; defaults to ``dspark``.
        """
        super().__init__(weight=weight, name=name)
        for label, value in (("ce_weight", ce_weight), ("l1_weight", l1_weight)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"DSparkLoss {label} must be a finite number >= 0, got {value}")
        if ce_weight == 0 and l1_weight == 0:
            raise ValueError("DSparkLoss ce_weight and l1_weight are both 0; DeepSpec uses 0.1 and 0.9")
        if chunk_blocks < 1:
            raise ValueError(f"DSparkLoss chunk_blocks must be >= 1, got {chunk_blocks}")
        self.ce_weight, self.l1_weight = float(ce_weight), float(l1_weight)
        self.gamma = check_gamma(type(self).__name__, gamma)
        self.chunk_blocks = int(chunk_blocks)
        if self.l1_weight == 0:
            self.requires_target_distribution = False  # CE alone needs no target distribution

    def check_inputs(self, inputs: LossInputs) -> None:
        super().check_inputs(inputs)
        _check_corrected(self, inputs)

    def distance(self, inputs: LossInputs) -> torch.Tensor:
        """``[M, S]`` L1 distance of the corrected and target distributions at every slot."""
        corrected = inputs.corrected_logits
        assert corrected is not None and inputs.target_distribution is not None  # check_inputs
        parts = []
        for start in range(0, corrected.shape[0], self.chunk_blocks):
            rows = slice(start, start + self.chunk_blocks)
            with torch.no_grad():
                target = inputs.target_distribution(rows)  # [m, S, V]
            if target.shape != corrected[rows].shape:
                raise ValueError(
                    f"target_distribution returned {tuple(target.shape)} for corrected logits "
                    f"{tuple(corrected[rows].shape)}; it must return [m, S, V] logits"
                )
            chunk = corrected[rows]
            if torch.is_grad_enabled() and chunk.requires_grad:  # recompute the fp32 softmaxes in backward
                parts.append(checkpoint(_l1_rows, chunk, target, use_reentrant=False))
            else:
                parts.append(_l1_rows(chunk, target))
        if not parts:  # no block
            return corrected.new_zeros(corrected.shape[:2], dtype=torch.float32)
        return torch.cat(parts, dim=0)

    def forward(self, inputs: LossInputs) -> LossOutput:
        self.check_inputs(inputs)
        corrected, base, mask = inputs.corrected_logits, inputs.drafter_logits, inputs.label_mask.bool()
        labels = torch.where(mask, inputs.labels, torch.zeros_like(inputs.labels))  # safe ids
        slot_weights = decay_weights(corrected.shape[1], self.gamma, corrected.device)  # [S]
        ce = weighted_mean(-candidate_log_probs(corrected, labels.unsqueeze(-1)).squeeze(-1), mask, slot_weights)
        loss = self.ce_weight * ce
        logs = {"ce": ce.detach()}
        if self.l1_weight > 0:
            l1 = weighted_mean(self.distance(inputs), mask, slot_weights)
            loss = loss + self.l1_weight * l1
            logs["l1"] = l1.detach()
        with torch.no_grad():
            count = mask.sum().clamp_min(1)
            logs["top1_acc_final"] = (((corrected.argmax(-1) == labels) & mask).sum() / count).float()
            logs["top1_acc_base"] = (((base.argmax(-1) == labels) & mask).sum() / count).float()
        return LossOutput(loss=self.weight * loss, logs=logs)
