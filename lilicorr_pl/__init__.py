"""lilicorr_pl: train and evaluate DFlash drafters with the LiLiCorr lattice-correction head."""

__version__ = "0.1.0"
