"""``last.ckpt`` that always holds the final weights, under the run's root folder."""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint


class ModelCheckpoint(LightningModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` (same arguments) whose ``last.ckpt`` always holds the final weights.

    Lightning skips its end-of-training save of ``last`` once any ``last`` was written earlier in the run,
    so ``max_steps=30`` with ``every_n_train_steps=25`` left ``last.ckpt`` at step 25 and lost 5 steps of
    training. Here the end of training writes ``last`` whenever the latest save was at an earlier step.

    Without ``dirpath`` the checkpoints go to ``<trainer.default_root_dir>/checkpoints`` (Lightning's own
    default is a folder named after the logger's project and run id), so one setting places a run's outputs
    and a recipe overlay moves them by setting ``trainer.default_root_dir`` alone.
    """

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = os.path.realpath(os.path.join(trainer.default_root_dir, "checkpoints"))
        super().setup(trainer, pl_module, stage)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.save_last and trainer.global_step != self._last_global_step_saved:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
            return
        super().on_train_end(trainer, pl_module)
