"""The loss-component interface (DESIGN §5): every loss is a small module summed with a weight.

The system builds one :class:`LossInputs` per step, calls every configured component on it and sums
``LossOutput.loss``. Components never import Lightning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from lilicorr_pl.heads.base import Lattice


@dataclass
class LossInputs:
    """Everything a loss component may read, for ``M`` blocks of ``S`` speculative slots."""

    drafter_logits: torch.Tensor
    """``[M, S, V]`` live drafter logits; slot ``k`` predicts the token at ``anchor_pos + k``."""
    labels: torch.Tensor
    """``[M, S]`` long: true tokens (arbitrary where ``label_mask`` is False)."""
    label_mask: torch.Tensor
    """``[M, S]`` bool: supervised slots (inside the sequence and the loss mask)."""
    lattice: Lattice | None = None
    """The head's scored lattice; None when the system has no lattice head."""
    target_logits: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Token ids ``[M, S, J]`` -> teacher-forced target logits ``z_t(v | x_<t)`` ``[M, S, J]`` at each
    slot's position (exact from the target, or from the precomputed top-M cache)."""
    corrected_logits: torch.Tensor | None = None
    """``[M, S, V]`` teacher-forced logits of a corrector head (Domino, DSpark); None otherwise."""
    target_distribution: Callable[[slice], torch.Tensor] | None = None
    """A slice of the ``M`` blocks -> the target's full teacher-forced logits ``[m, S, V]`` at each slot's
    position (V-wide: computed on demand, chunk by chunk, from the online target); None without one."""
    step: int = 0
    """Optimizer steps taken so far (for curricula)."""
    total_steps: int | None = None
    """Optimizer steps of the whole run (``trainer.estimated_stepping_batches``), for curricula that span
    the run; None outside a Trainer."""
    _forced: Any = field(default=None, init=False, repr=False, compare=False)
    # Memo for :func:`lilicorr_pl.losses.forced.forced_slots`, shared by the lattice components.


@dataclass
class LossOutput:
    """One component's contribution."""

    loss: torch.Tensor
    """Scalar, already multiplied by the component's weight."""
    logs: dict[str, torch.Tensor]
    """Unweighted diagnostics with short keys; the system prefixes them with the component name."""


class LossComponent(nn.Module):
    """Base class of the pluggable loss components.

    Subclasses set the class-level ``name`` (the default log prefix) and the ``requires_*`` flags and
    implement :meth:`forward`.
    """

    name: str = "loss"
    requires_lattice: bool = False
    requires_target_logits: bool = False
    requires_corrector: bool = False  # reads LossInputs.corrected_logits (a head with uses_corrector)
    requires_target_distribution: bool = False
    """Reads the target's full distribution (``LossInputs.target_distribution``): needs the online target."""

    def __init__(self, weight: float = 1.0, name: str | None = None) -> None:
        """
        Args:
            weight: multiplier of this component in the total loss (0 keeps it as a logged diagnostic).
            name: log name; defaults to the class's name (e.g. ``oracle_prefix_ce``).
        """
        super().__init__()
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"{type(self).__name__} weight must be a finite number >= 0, got {weight}")
        self.weight = float(weight)
        if name is not None:
            if not name:
                raise ValueError(f"{type(self).__name__} name must be a non-empty string; omit it for the default")
            self.name = name

    def forward(self, inputs: LossInputs) -> LossOutput:
        raise NotImplementedError(f"{type(self).__name__} must implement forward()")

    def has_inputs(self, inputs: LossInputs) -> bool:
        """Whether ``inputs`` holds everything the ``requires_*`` flags declare (the system skips a weight-0
        component without them: only active components decide what is built)."""
        return not ((self.requires_lattice and inputs.lattice is None)
                    or (self.requires_target_logits and inputs.target_logits is None)
                    or (self.requires_corrector and inputs.corrected_logits is None)
                    or (self.requires_target_distribution and inputs.target_distribution is None))

    def check_inputs(self, inputs: LossInputs) -> None:
        """Raise a clear error when a required input is missing."""
        if self.requires_lattice and inputs.lattice is None:
            raise ValueError(
                f"{type(self).__name__} ({self.name}) needs a lattice head such as LiLiCorrHead; "
                f"remove it from model.losses or add model.head"
            )
        if self.requires_target_logits and inputs.target_logits is None:
            raise ValueError(
                f"{type(self).__name__} ({self.name}) needs target logits, but LossInputs.target_logits is "
                f"None; enable the target-logit cache in the data module (or exact target logits in the "
                f"system), or remove this component from model.losses / set its weight to 0"
            )
        if self.requires_target_distribution and inputs.target_distribution is None:
            raise ValueError(
                f"{type(self).__name__} ({self.name}) needs the target's full distribution at every slot, "
                f"which only the online target gives (LossInputs.target_distribution is None); disable "
                f"data.feature_cache so the target runs in training"
            )


def decay_weights(num_slots: int, gamma: float | None, device: torch.device | None = None) -> torch.Tensor:
    """DFlash position decay ``w_k = exp(-(k-1)/γ)`` for slots ``k = 1..S``; ones when ``γ`` is None.

    Returns:
        ``[S]`` float32.
    """
    slots = torch.arange(num_slots, device=device, dtype=torch.float32)
    if gamma is None:
        return torch.ones_like(slots)
    return torch.exp(-slots / gamma)


def check_gamma(owner: str, gamma: float | None) -> float | None:
    """Validate a decay constant (None disables the decay)."""
    if gamma is None:
        return None
    if not math.isfinite(gamma) or gamma <= 0:
        raise ValueError(
            f"{owner} gamma must be positive (7 for block 16, 5 for block 10, 4 for block 8), got {gamma}"
        )
    return float(gamma)


def weighted_mean(values: torch.Tensor, mask: torch.Tensor, slot_weights: torch.Tensor) -> torch.Tensor:
    """``Σ w·x / Σ w`` over the masked entries of ``values [M, S]``; 0 (with a graph) when none are masked."""
    w = slot_weights.to(values.dtype) * mask.to(values.dtype)  # [M, S]
    numerator = torch.where(mask, values, torch.zeros_like(values)) * w
    return numerator.sum() / w.sum().clamp_min(torch.finfo(values.dtype).tiny)
