"""Lightning callbacks for lilicorr_pl runs (this package imports from ``lilicorr_pl``, never the reverse)."""

from callbacks.acceptance import AcceptanceEval
from callbacks.checkpoint import ModelCheckpoint

__all__ = ["AcceptanceEval", "ModelCheckpoint"]
