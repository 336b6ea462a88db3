"""Lightning callbacks for lilicorr_pl runs (this package imports from ``lilicorr_pl``, never the reverse)."""

from callbacks.acceptance import AcceptanceEval

__all__ = ["AcceptanceEval"]
