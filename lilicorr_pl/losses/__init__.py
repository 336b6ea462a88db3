"""Pluggable loss components (DESIGN §5), summed with weights by the system."""

from lilicorr_pl.losses.base import LossComponent, LossInputs, LossOutput, decay_weights
from lilicorr_pl.losses.dflash import DFlashCE
from lilicorr_pl.losses.diagnostics import lattice_diagnostics, logfactor_row_spread, logfactor_spread
from lilicorr_pl.losses.forced import ForcedSlots, forced_slots
from lilicorr_pl.losses.lattice import DistractorPenalty, MarginHinge, OraclePrefixCE

__all__ = [
    "DFlashCE",
    "DistractorPenalty",
    "ForcedSlots",
    "LossComponent",
    "LossInputs",
    "LossOutput",
    "MarginHinge",
    "OraclePrefixCE",
    "decay_weights",
    "forced_slots",
    "lattice_diagnostics",
    "logfactor_row_spread",
    "logfactor_spread",
]

from lilicorr_pl.losses.corrector import CorrectorCE, DSparkLoss

__all__ += ["CorrectorCE", "DSparkLoss"]
