"""Selectors: how each arm chooses a drafted block from the drafter's slot outputs (DESIGN §4)."""

from lilicorr_pl.heads.base import EmbedFn, Lattice, Selection, Selector
from lilicorr_pl.heads.lattice import (
    candidate_log_probs,
    forced_prefix_mask,
    greedy_walk,
    oracle_prefix,
    path_score,
    prefix_length,
    viterbi,
)
from lilicorr_pl.heads.lilicorr import LiLiCorrHead
from lilicorr_pl.heads.top1 import Top1Selector

__all__ = [
    "EmbedFn",
    "Lattice",
    "LiLiCorrHead",
    "Selection",
    "Selector",
    "Top1Selector",
    "candidate_log_probs",
    "forced_prefix_mask",
    "greedy_walk",
    "oracle_prefix",
    "path_score",
    "prefix_length",
    "viterbi",
]

from lilicorr_pl.heads.corrector import CorrectorHead
from lilicorr_pl.heads.domino import DominoHead
from lilicorr_pl.heads.dspark import DSparkHead

__all__ += ["CorrectorHead", "DSparkHead", "DominoHead"]
