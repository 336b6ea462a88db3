"""``last.ckpt`` that always holds the final weights (or those of the step a SIGTERM stopped at), under the run's
root folder."""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info


class ModelCheckpoint(LightningModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` (same arguments) whose ``last.ckpt`` always holds the final weights.

    Lightning skips its end-of-training save of ``last`` once any ``last`` was written earlier in the run,
    so ``max_steps=30`` with ``every_n_train_steps=25`` left ``last.ckpt`` at step 25 and lost 5 steps of
    training. Here the end of training writes ``last`` whenever the latest save was at an earlier step, and so
    does a single-process fit stopped by SIGTERM, at the step it stopped at.

    Without ``dirpath`` the checkpoints go to ``<trainer.default_root_dir>/checkpoints`` (Lightning's own
    default is a folder named after the logger's project and run id), so one setting places a run's outputs
    and a recipe overlay moves them by setting ``trainer.default_root_dir`` alone.
    """

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._place(trainer)
        super().setup(trainer, pl_module, stage)

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        # `fit(ckpt_path="last")` looks for them before `setup`: without this, Lightning would look in the logger's
        # folder, find nothing and train from step 0 with only a warning.
        self._place(trainer)
        return super()._find_last_checkpoints(trainer)

    def _place(self, trainer: Any) -> None:
        if self.dirpath is None:
            self.dirpath = os.path.realpath(os.path.join(trainer.default_root_dir, "checkpoints"))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        # A SIGTERM (a cancelled or preempted job) stops a single-process fit after this step: `last` is written here,
        # where a scheduled save would be, so `--ckpt_path=last` goes on from this step, not from the latest scheduled
        # save. (Saved from `on_exception` instead, a stop at an epoch's end would be resumed an epoch too far.) Not in
        # the middle of an accumulation window, whose gradients a checkpoint does not hold. Not with several
        # processes: the save is collective and the ranks' flags need not agree at this point (Lightning stops them
        # all together at the next step's start, after a broadcast of its own, which a per-step collective here
        # could be paired with); those resume from the latest scheduled save.
        if (not self.save_last or not trainer.received_sigterm or trainer.world_size > 1
                or trainer.global_step == self._last_global_step_saved
                or trainer.fit_loop.epoch_loop._should_accumulate()):
            return
        scheduled = self._last_global_step_saved
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        # A validation due at this step that still runs to its end saves what it would (its step's checkpoint,
        # `last` after it): this save is not that one.
        self._last_global_step_saved = scheduled
        rank_zero_info(f"Stopped by SIGTERM at step {trainer.global_step}: saved {self.last_model_path}")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.save_last and trainer.global_step != self._last_global_step_saved:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
            return
        super().on_train_end(trainer, pl_module)
