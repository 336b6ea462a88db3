"""Training-time lattice metrics as a sum-reduced ``torchmetrics.Metric`` (DESIGN §6).

Every state is a count or a sum with ``dist_reduce_fx="sum"``, so the means are exact under DDP and
``merge_state`` equals one update on the concatenated data.
"""

from __future__ import annotations

import torch
from torchmetrics import Metric

from lilicorr_pl.heads.base import Lattice
from lilicorr_pl.losses.diagnostics import lattice_diagnostics

__all__ = ["LatticeMetrics", "lattice_diagnostics"]

_BLOCK_SUMS = ("top1_prefix", "selected_prefix", "oracle_prefix")
_SLOT_SUMS = ("slot_supervised", "slot_covered", "slot_correct_top1", "slot_correct_selected", "slot_off_top1")


class LatticeMetrics(Metric):
    """Teacher-forced prefix, coverage and accuracy statistics of a drafter and its selector.

    Only valid blocks count (every slot supervised; a block that runs off the sequence or the loss
    mask is skipped whole, as the lattice losses skip it). ``compute()`` returns the means over the
    valid blocks seen of ``top1_prefix``, ``selected_prefix``, ``oracle_prefix``, ``oracle_gap``,
    ``sim_tau_top1``, ``sim_tau_selected``, ``sim_tau_oracle`` (τ = 1 + prefix, bonus token
    included) and ``exact_block_rate``; per-slot ``slot_coverage``, ``slot_accuracy`` (selected) and
    ``slot_accuracy_top1`` ``[S]``; ``off_top1_rate``, the share of supervised slots where the selector left the
    drafter's top-1 (0 for top-1; near 0 for a head that has collapsed onto the drafter's ranking); and
    ``logfactor_spread`` (the reference's collapse signal) and ``logfactor_row_spread`` (the walk's) when any update
    carried a lattice.
    """

    full_state_update = False

    def __init__(self, num_slots: int, top_k: int = 8, **kwargs) -> None:
        """
        Args:
            num_slots: speculative slots per block, ``S = block_size - 1`` (sizes the per-slot states).
            top_k: lattice width for the oracle when an update has no lattice (drafter's own top-K).
            **kwargs: passed to ``torchmetrics.Metric``.
        """
        super().__init__(**kwargs)
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1 (block_size - 1), got {num_slots}")
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.num_slots = num_slots
        self.top_k = top_k
        self.add_state("blocks", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        for key in _BLOCK_SUMS:
            self.add_state(key, torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("exact_blocks", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        for key in _SLOT_SUMS:
            self.add_state(key, torch.zeros(num_slots, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("spread_sum", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("row_spread_sum", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("spread_blocks", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(
        self,
        lattice: Lattice | None,
        drafter_logits: torch.Tensor,
        labels: torch.Tensor,
        label_mask: torch.Tensor,
        selected_tokens: torch.Tensor | None = None,
        diagnostics: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Accumulate one batch; same inputs as :func:`lattice_diagnostics`.

        ``diagnostics``: that function's result on these inputs with this metric's ``top_k``, when the caller
        has computed it already (the system logs per-step values from it too: one computation per step).
        """
        if labels.dim() != 2 or labels.shape[1] != self.num_slots:
            raise ValueError(
                f"LatticeMetrics was built for {self.num_slots} slots but labels have shape "
                f"{tuple(labels.shape)}; construct it with num_slots = block_size - 1 = {labels.shape[-1]}"
            )
        d = diagnostics
        if d is None:
            d = lattice_diagnostics(lattice, drafter_logits, labels, label_mask, selected_tokens, top_k=self.top_k)
        f64 = torch.float64
        valid = d["valid_block"]  # [M]; invalid blocks carry zeros everywhere below
        self.blocks += valid.sum().to(f64)
        for key in _BLOCK_SUMS:
            setattr(self, key, getattr(self, key) + d[key].sum().to(f64))
        self.exact_blocks += d["exact_block"].sum().to(f64)
        self.slot_supervised += d["supervised"].sum(dim=0).to(f64)
        self.slot_covered += (d["covered"] & d["supervised"]).sum(dim=0).to(f64)
        self.slot_correct_top1 += d["top1_correct"].sum(dim=0).to(f64)
        self.slot_correct_selected += d["selected_correct"].sum(dim=0).to(f64)
        self.slot_off_top1 += d["off_top1"].sum(dim=0).to(f64)
        if "logfactor_spread" in d:
            self.spread_sum += d["logfactor_spread"].sum().to(f64)
            self.row_spread_sum += d["logfactor_row_spread"].sum().to(f64)
            self.spread_blocks += valid.sum().to(f64)

    def compute(self) -> dict[str, torch.Tensor]:
        blocks = self.blocks.clamp_min(1)
        top1, selected, oracle = (getattr(self, key) / blocks for key in _BLOCK_SUMS)
        supervised = self.slot_supervised.clamp_min(1)
        out = {
            "top1_prefix": top1,
            "selected_prefix": selected,
            "oracle_prefix": oracle,
            "oracle_gap": oracle - selected,
            "sim_tau_top1": 1 + top1,
            "sim_tau_selected": 1 + selected,
            "sim_tau_oracle": 1 + oracle,
            "exact_block_rate": self.exact_blocks / blocks,
            "slot_coverage": self.slot_covered / supervised,
            "slot_accuracy": self.slot_correct_selected / supervised,
            "slot_accuracy_top1": self.slot_correct_top1 / supervised,
            "off_top1_rate": self.slot_off_top1.sum() / self.slot_supervised.sum().clamp_min(1),
        }
        if self.spread_blocks > 0:
            out["logfactor_spread"] = self.spread_sum / self.spread_blocks
            out["logfactor_row_spread"] = self.row_spread_sum / self.spread_blocks
        return {key: value.float() for key, value in out.items()}
