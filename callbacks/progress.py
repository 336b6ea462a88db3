"""A fit's progress as a small JSON file, for whoever watches it from outside the process."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn

from lilicorr_pl.checkpoint import first_line
from lilicorr_pl.files import check_writable_dir, refuse_foreign, write_results_json, written_by_lilicorr

COMMAND = "fit"
"""The command its records name as their writer (``written_by``): what a rerun may replace, and nothing else."""


EARLIER_FIELDS = {"step", "max_steps", "seconds", "finished"}
"""What a record held before it was marked ``written_by``: exactly these keys."""


def _earlier_record(path: Path) -> bool:
    """Whether ``path`` holds a record an earlier version of this callback wrote (unmarked): a fit rerun after an
    upgrade replaces its own progress file, as before."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(record, dict) and set(record) == EARLIER_FIELDS


class ProgressFile(L.Callback):
    """Writes ``{"written_by", "step", "max_steps", "seconds", "finished"}`` to ``path`` at most every
    ``every_n_seconds`` during training and once at its end, atomically (a reader never sees half a file).

    What a job scheduler, a dashboard or ``lilicorr demo --jobs 2`` (which trains stages in background
    processes and draws their bars from these files) reads instead of a terminal's progress bar.
    ``seconds`` counts from the start of training. Rank 0 writes. ``path`` is checked before the data are prepared
    (:meth:`check_run`): a rerun replaces its own record (``written_by``: ``lilicorr fit <version>``), never a
    user's file, a symbolic link or a folder.
    """

    def __init__(self, path: str, every_n_seconds: float = 1.0) -> None:
        if every_n_seconds < 0:
            raise ValueError(f"ProgressFile(every_n_seconds={every_n_seconds}): must be >= 0")
        self.path = Path(path)
        self.every_n_seconds = float(every_n_seconds)
        self._started = self._written = 0.0

    def check_run(self, pl_module: Any) -> None:
        """Before the data are prepared (``lilicorr fit`` calls it): ``path`` is this callback's to write. Unchecked, a
        user's file there would be replaced at the first step, a link by a file, and a folder would fail with a
        traceback once the target is loaded."""
        ours = written_by_lilicorr(self.path, COMMAND) or _earlier_record(self.path)
        refuse_foreign(self.path, "ProgressFile path", "a progress record", COMMAND, ours,
                       "choose another ProgressFile path")
        check_writable_dir(self.path.parent, f"ProgressFile path {self.path}")

    def _write(self, trainer: L.Trainer, finished: bool) -> None:
        if trainer.is_global_zero:
            now = time.monotonic()
            write_results_json(self.path, {"step": int(trainer.global_step), "max_steps": int(trainer.max_steps),
                                           "seconds": round(now - self._started, 2), "finished": finished}, COMMAND)
            self._written = now

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self._started = time.monotonic()
        self._write(trainer, finished=False)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        if time.monotonic() - self._written >= self.every_n_seconds:
            try:
                self._write(trainer, finished=False)
            except OSError:  # a full disk or a reader holding the file (Windows) must not stop training: next time
                pass

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        try:
            self._write(trainer, finished=True)
        except OSError as err:  # it raised past the ModelCheckpoint after it, whose end-of-training save was lost
            rank_zero_warn(f"ProgressFile could not write {self.path} at the end of training ({first_line(err)}); "
                           "the run's checkpoints are saved all the same")
