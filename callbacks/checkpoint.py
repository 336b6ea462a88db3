"""``last.ckpt`` that always holds the final weights (or those of the step a SIGTERM stopped at), under the run's
root folder, written so that a stop during a save never leaves a torn file in place of the previous one."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lilicorr_pl.files import atomic_file, remove_gone_writers, temporary_name


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` whose local saves are written beside their destination and renamed into place.

    Lightning's own save serialises the checkpoint into memory (a second copy of it), writes that to a file in the
    system's temporary folder and moves it over the destination: where that folder is another file system than the
    checkpoints' (a node-local ``/tmp`` and a shared checkpoint folder, the usual cluster layout) the move is a copy
    onto the destination, so a job killed during it leaves a torn ``last.ckpt`` in place of the previous good one, and
    nothing is flushed to disk before the old file is gone. Here the checkpoint is written straight to
    ``.<name>.<writer>.tmp`` in the destination's folder, flushed and synced, then renamed over the destination (one
    atomic step on one file system), and the folder is synced so the rename survives a crash: a reader sees the
    previous checkpoint or the new one, whole. A killed writer's temporary file is removed by the next run's
    :class:`ModelCheckpoint` (its name says which process wrote it). Remote paths (``s3://`` …) keep Lightning's
    object-store upload, which is atomic on those stores.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        if storage_options is not None:
            raise TypeError(f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by "
                            f"{type(self).__name__}; save without storage_options")
        path = Path(os.fspath(path)).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path, "wb", sync=True) as fh:  # the mode any new file gets here, as Lightning's own save
            torch.save(checkpoint, fh)
        _sync_dir(path.parent)


def _sync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform without directory handles (Windows): the rename itself is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _use_atomic_saves(strategy: Any) -> None:
    """Put :class:`AtomicCheckpointIO` where the strategy would use Lightning's default ``TorchCheckpointIO``; a
    checkpoint IO given to the Trainer (``AsyncCheckpointIO`` included) is left as it is."""
    if type(strategy.checkpoint_io) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()


class ModelCheckpoint(LightningModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` (same arguments) whose ``last.ckpt`` always holds the final weights.

    Lightning skips its end-of-training save of ``last`` once any ``last`` was written earlier in the run,
    so ``max_steps=30`` with ``every_n_train_steps=25`` left ``last.ckpt`` at step 25 and lost 5 steps of
    training. Here the end of training writes ``last`` whenever the latest save was at an earlier step, and so
    does a single-process fit stopped by SIGTERM, at the step it stopped at (after a step, in the validation or
    epoch-end hooks that follow it, or after the last step; a resume goes on with the next step, and a validation
    the stop cut short is not run again, as Lightning resumes). With ``save_top_k=0`` (keep only ``last.ckpt``)
    every save trigger writes ``last``, once: Lightning wrote it at training's end alone.

    Without ``dirpath`` the checkpoints go to ``<trainer.default_root_dir>/checkpoints`` (Lightning's own
    default is a folder named after the logger's project and run id), so one setting places a run's outputs
    and a recipe overlay moves them by setting ``trainer.default_root_dir`` alone.

    Saves go through :class:`AtomicCheckpointIO` unless the Trainer was given a checkpoint IO of its own, and the
    temporary files of a save that was killed (by a writer that is gone) are removed from ``dirpath`` at setup. With
    ``save_last="link"`` the link replaces ``last.ckpt`` in one rename and moves before the checkpoint it names is
    removed, so ``last.ckpt`` is never missing or dangling, and a step no scheduled save wrote is saved whole.
    """

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._stop_saved_at: int | None = None  # the step a SIGTERM save of this fit wrote
        self._place(trainer)
        _use_atomic_saves(trainer.strategy)
        if trainer.is_global_zero:
            remove_gone_writers(Path(self.dirpath), ".*.tmp")
        super().setup(trainer, pl_module, stage)

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(trainer, pl_module, checkpoint)
        self._resumed_from = getattr(trainer, "ckpt_path", None)  # read by load_state_dict, which Lightning calls next

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        recorded = state_dict.get("dirpath", self.dirpath)
        super().load_state_dict(state_dict)
        # A run folder copied or moved, resumed from its own `last` in the new place: Lightning forgets `last` when
        # the folder's path changed, so the resume wrote `last-v1.ckpt` beside the file it resumed from (and the run's
        # end called that one "an earlier run's"). Only the very file resumed from is taken as the run's `last` again.
        last, resumed = state_dict.get("last_model_path"), getattr(self, "_resumed_from", None)
        if self.dirpath is None or recorded == self.dirpath or not last or not resumed:
            return
        here = Path(self.dirpath) / Path(last).name
        if here.exists() and os.path.realpath(resumed) in (os.path.realpath(here), str(here.absolute())):
            self.last_model_path = str(here)

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
        self._save_last_at_this_step(trainer)
        # A validation due at this step that still runs to its end saves what it would (its step's checkpoint,
        # `last` after it): this save is not that one. With `save_top_k=0` it would only write `last` again.
        if self.save_top_k != 0:
            self._last_global_step_saved = scheduled
        self._stop_saved_at = trainer.global_step
        rank_zero_info(f"Stopped at step {trainer.global_step}: saved {self.last_model_path}")

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)
        # A SIGTERM that arrives after a step's end (the save above has passed) stops a fit in the validation that
        # follows the step (Lightning leaves it at its next batch, or after it; the demo's real speculative decoding
        # takes seconds there), in the epoch's end hooks, or after the last step: `last` is written here, so that step
        # is not lost. The resume goes on with the next step: Lightning counts that validation as run and does not
        # repeat it (its metrics and any save it would have ended with are not made; `last` holds its weights).
        # Single-process only, as above.
        if (not isinstance(exception, SIGTERMException) or not self.save_last or trainer.world_size > 1
                or trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking
                or trainer.global_step in (self._last_global_step_saved, self._stop_saved_at)
                or trainer.fit_loop.epoch_loop._should_accumulate()):
            return
        self._save_last_at_this_step(trainer)
        rank_zero_info(f"Stopped at step {trainer.global_step}: saved {self.last_model_path}")

    def _save_last_at_this_step(self, trainer: Any) -> None:
        # A step no scheduled save wrote (training's end, a SIGTERM): with `save_last="link"` Lightning would link `last`
        # to the newest checkpoint, of an earlier step; here `last` is then written whole.
        if self.save_last == "link":
            self._last_checkpoint_saved = ""
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def _save_topk_checkpoint(self, trainer: Any, monitor_candidates: dict[str, Any]) -> None:
        # With `save_top_k=0` (keep only last.ckpt) Lightning writes nothing here, and writes `last` only after a
        # top-k save, so last.ckpt was written at training's end alone and a killed run lost every step. Here each
        # save trigger (a validation's end, every_n_train_steps, an epoch's end) writes `last`; the `last` save that
        # Lightning makes right after this call, at the same step, is then not written twice.
        if self.save_top_k == 0 and self.save_last:
            self._save_last_checkpoint(trainer, monitor_candidates)
            self._written_at = trainer.global_step
            return
        super()._save_topk_checkpoint(trainer, monitor_candidates)

    def _save_last_checkpoint(self, trainer: Any, monitor_candidates: dict[str, Any]) -> None:
        if getattr(self, "_written_at", None) == trainer.global_step:
            self._written_at = None
            return
        super()._save_last_checkpoint(trainer, monitor_candidates)

    def _remove_checkpoint(self, trainer: Any, filepath: str) -> None:
        # `save_last="link"` with a top k: Lightning removes the checkpoint `last` links to before it links the new
        # one, so a job killed in between had a dangling `last.ckpt`. `last` is linked to the new one first.
        if (self.save_last == "link" and self.save_top_k != 0 and self._last_checkpoint_saved and self.last_model_path
                and os.path.abspath(filepath) not in (os.path.abspath(self._last_checkpoint_saved),
                                                      os.path.abspath(self.last_model_path))):
            self._link_checkpoint(trainer, self._last_checkpoint_saved, self.last_model_path)
        super()._remove_checkpoint(trainer, filepath)

    @staticmethod
    def _link_checkpoint(trainer: Any, filepath: str, linkpath: str) -> None:
        # `save_last="link"`: Lightning removes `last.ckpt`, then links it to the newest checkpoint, so a job killed
        # between the two had no `last.ckpt` and `--ckpt_path=last` trained again from step 0. Here the link (or, where
        # the system refuses links, the copy) is made under a temporary name and renamed over `last.ckpt`: it names
        # the previous checkpoint or the new one. A sharded checkpoint's folder keeps Lightning's way.
        if (not trainer.is_global_zero or os.path.abspath(filepath) == os.path.abspath(linkpath)
                or (os.path.isdir(linkpath) and not os.path.islink(linkpath)) or os.path.isdir(filepath)):
            LightningModelCheckpoint._link_checkpoint(trainer, filepath, linkpath)
            return
        link = Path(linkpath)
        tmp = temporary_name(link)
        try:
            try:
                os.symlink(os.path.relpath(filepath, link.parent), tmp)
            except OSError:  # Windows without the right to make links: a copy, as Lightning, synced before the rename
                shutil.copyfile(filepath, tmp)
                with open(tmp, "rb+") as fh:
                    os.fsync(fh.fileno())
            os.replace(tmp, link)
        except BaseException:
            if os.path.lexists(tmp):
                os.unlink(tmp)
            raise
        _sync_dir(link.parent)
        trainer.strategy.barrier()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.save_last and trainer.global_step != self._last_global_step_saved:
            self._save_last_at_this_step(trainer)
        else:
            super().on_train_end(trainer, pl_module)
        self._say_where_the_last_is()

    def _say_where_the_last_is(self) -> None:
        # A run started over in a root that holds an earlier run's `last.ckpt` writes `last-v1.ckpt` (Lightning numbers
        # it): commands pointed at `checkpoints/last.ckpt` would read the earlier run's weights without a word.
        last = Path(self.last_model_path) if self.last_model_path else None
        plain = last.with_name(self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION) if last is not None else None
        if last is not None and last.name != plain.name and plain.exists():
            rank_zero_warn(f"this run's final weights are in {last}; {plain.name} beside it holds an earlier run's "
                           f"(a run started over in the same folder): pass {last} to bench and export")
