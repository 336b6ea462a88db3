"""Learning-rate schedules used by the shipped recipes."""

from __future__ import annotations

import math
import warnings

import torch
from torch.optim.lr_scheduler import LambdaLR


class WarmupCosine(LambdaLR):
    """Linear warmup then cosine decay to ``min_lr_ratio × lr``, stepped every optimizer step.

    Args:
        optimizer: the wrapped optimizer.
        total_steps: schedule length in optimizer steps; None = filled in by the system from
            ``trainer.estimated_stepping_batches`` before training starts.
        warmup_fraction: share of ``total_steps`` spent warming up (0.04 in the LiLiCorr recipe).
        min_lr_ratio: final learning rate as a fraction of the peak.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int | None = None,
        warmup_fraction: float = 0.04,
        min_lr_ratio: float = 0.0,
    ) -> None:
        if not 0.0 <= warmup_fraction < 1.0:
            raise ValueError(f"warmup_fraction must be in [0, 1), got {warmup_fraction}")
        self.total_steps = total_steps
        self.warmup_fraction = warmup_fraction
        self.min_lr_ratio = min_lr_ratio
        super().__init__(optimizer, self._factor)

    def _factor(self, step: int) -> float:
        total = self.total_steps
        if not total or total <= 0:
            return 1.0
        warmup = int(self.warmup_fraction * total)
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.pop("lr_lambdas", None)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the schedule's position (a resumed fit); its shape — ``total_steps``, ``warmup_fraction``,
        ``min_lr_ratio`` — stays this run's. A fit resumed with a larger ``max_steps`` follows the longer schedule
        from the step it stopped at (the saved length came back with the state: every step past it ran at the
        final learning rate, 0 in the recipes, and the fit reported success), and the optimizer's learning rate,
        restored from the old schedule, is set to the one this schedule gives at that step."""
        own = {key: getattr(self, key) for key in ("total_steps", "warmup_fraction", "min_lr_ratio")}
        # The schedule is a bound method, rebuilt by __init__; LambdaLR still expects the key it saves.
        super().load_state_dict({**state_dict, "lr_lambdas": [None] * len(self.lr_lambdas)})
        saved = {key: getattr(self, key) for key in own}
        self.__dict__.update(own)
        if saved == own:
            return
        factor = self._factor(self.last_epoch)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * factor
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        changed = ", ".join(f"{key} {saved[key]} -> {own[key]}" for key in own if saved[key] != own[key])
        warnings.warn(f"resuming with another learning-rate schedule ({changed}): it goes on from step "
                      f"{self.last_epoch} of this run's schedule, at lr factor {factor:.3g}", stacklevel=2)
