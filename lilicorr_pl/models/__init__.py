"""Plain PyTorch models: the DFlash block-diffusion drafter."""

from lilicorr_pl.models.dflash import (
    DFlashDrafter,
    DraftCache,
    DraftOutput,
    block_labels,
    sample_anchors,
)

__all__ = ["DFlashDrafter", "DraftCache", "DraftOutput", "block_labels", "sample_anchors"]
