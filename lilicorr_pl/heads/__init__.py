"""Selectors: how each arm chooses a drafted block from the drafter's slot outputs (DESIGN §4)."""

from lilicorr_pl.heads.base import (
    EmbedFn,
    HeadOutput,
    Lattice,
    Selection,
    SelectContext,
    Selector,
    TeacherForcing,
)
from lilicorr_pl.heads.lattice import (
    candidate_log_probs,
    forced_prefix_mask,
    greedy_walk,
    oracle_prefix,
    path_score,
    prefix_length,
    sample_walk,
    viterbi,
    walk,
)
from lilicorr_pl.heads.lilicorr import LiLiCorrHead
from lilicorr_pl.heads.sampling import DraftSampling, draw, warp_probs
from lilicorr_pl.heads.top1 import Top1Selector

__all__ = [
    "DraftSampling",
    "EmbedFn",
    "HeadOutput",
    "Lattice",
    "LiLiCorrHead",
    "Selection",
    "SelectContext",
    "Selector",
    "TeacherForcing",
    "Top1Selector",
    "candidate_log_probs",
    "draw",
    "forced_prefix_mask",
    "greedy_walk",
    "oracle_prefix",
    "path_score",
    "prefix_length",
    "sample_walk",
    "viterbi",
    "walk",
    "warp_probs",
]

from lilicorr_pl.heads.corrector import CorrectorHead
from lilicorr_pl.heads.domino import DominoHead
from lilicorr_pl.heads.dspark import DSparkHead
from lilicorr_pl.heads.registry import SELECTORS, selector_class

__all__ += ["SELECTORS", "CorrectorHead", "DSparkHead", "DominoHead", "selector_class"]
