"""Lightning callbacks for lilicorr_pl runs (this package imports from ``lilicorr_pl``, never the reverse)."""

from callbacks.acceptance import AcceptanceEval
from callbacks.checkpoint import ModelCheckpoint
from callbacks.progress import ProgressFile
from callbacks.random_state import RandomStateCheckpoint

__all__ = ["AcceptanceEval", "ModelCheckpoint", "ProgressFile", "RandomStateCheckpoint"]
