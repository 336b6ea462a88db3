"""Real speculative acceptance as a sum-reduced ``torchmetrics.Metric`` (DESIGN §6).

Every state is a count or a sum with ``dist_reduce_fx="sum"``, so the means are exact under DDP and
``merge_state`` of metrics updated on parts equals one metric updated on everything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torchmetrics import Metric

__all__ = ["AcceptanceMetrics"]


class AcceptanceMetrics(Metric):
    """Acceptance statistics of speculative decoding over verify rounds.

    Feed it the per-round accepted draft counts ``acc`` (``0..S``) of :class:`GenerationResult` s:
    ``metric.update(result.accepted_lengths, num_tokens=len(result.tokens), seconds=result.total)``.

    ``compute()`` returns a dict:

    - ``tau``: mean acceptance length over rounds, ``acc + 1``, **including the target's bonus token**
      (``1 <= τ <= S + 1``; NaN before any round);
    - ``rounds``: number of verify rounds;
    - ``histogram`` ``[S+1]``: rounds with ``acc = 0..S`` (counts);
    - ``reached`` ``[S]`` / ``accepted`` ``[S]``: for draft position ``k = 1..S``, rounds whose first
      ``k − 1`` drafts were accepted, and of those the rounds that also accepted draft ``k``;
    - ``per_position_acceptance`` ``[S]``: ``accepted / reached``, the conditional acceptance rate of
      position ``k`` (NaN where no round reached it);
    - ``num_tokens``, ``seconds``, ``tokens_per_s`` (NaN when no time was recorded).

    Args:
        num_slots: speculative slots per block ``S = block_size − 1``.
    """

    full_state_update = False
    higher_is_better = True
    is_differentiable = False

    rounds: torch.Tensor
    tau_sum: torch.Tensor
    histogram: torch.Tensor
    reached: torch.Tensor
    accepted: torch.Tensor
    num_tokens: torch.Tensor
    seconds: torch.Tensor

    def __init__(self, num_slots: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1 (block_size - 1), got {num_slots}")
        self.num_slots = int(num_slots)
        s = self.num_slots
        self.add_state("rounds", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("tau_sum", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("histogram", default=torch.zeros(s + 1, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("reached", default=torch.zeros(s, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("accepted", default=torch.zeros(s, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("num_tokens", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("seconds", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(
        self,
        accepted_lengths: Sequence[int] | torch.Tensor,
        num_tokens: int = 0,
        seconds: float = 0.0,
    ) -> None:
        """Add verify rounds (accepted draft counts ``0..S``, any shape), generated tokens and time."""
        device = self.histogram.device
        acc = torch.as_tensor(accepted_lengths, dtype=torch.long, device=device).reshape(-1)  # [R]
        if acc.numel():
            lo, hi = int(acc.min()), int(acc.max())
            if lo < 0 or hi > self.num_slots:
                raise ValueError(
                    f"accepted lengths must lie in 0..{self.num_slots} (num_slots = block_size - 1), "
                    f"got values in {lo}..{hi}; pass accepted draft counts, not τ (= acc + 1)"
                )
        self.rounds += acc.numel()
        self.tau_sum += (acc + 1).sum()
        self.histogram += torch.bincount(acc, minlength=self.num_slots + 1)
        k = torch.arange(1, self.num_slots + 1, device=device)  # draft positions 1..S
        self.reached += (acc.unsqueeze(1) >= k - 1).sum(0)
        self.accepted += (acc.unsqueeze(1) >= k).sum(0)
        self.num_tokens += int(num_tokens)
        self.seconds += float(seconds)

    def compute(self) -> dict[str, torch.Tensor]:
        nan = torch.tensor(float("nan"), dtype=torch.float64, device=self.seconds.device)
        rounds = self.rounds.double()
        reached = self.reached.double()
        return {
            "tau": self.tau_sum.double() / rounds if self.rounds > 0 else nan,
            "rounds": self.rounds.clone(),
            "histogram": self.histogram.clone(),
            "reached": self.reached.clone(),
            "accepted": self.accepted.clone(),
            "per_position_acceptance": torch.where(
                reached > 0, self.accepted.double() / reached.clamp(min=1), nan
            ),
            "num_tokens": self.num_tokens.clone(),
            "seconds": self.seconds.clone(),
            "tokens_per_s": self.num_tokens.double() / self.seconds if self.seconds > 0 else nan,
        }
