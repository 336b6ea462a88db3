"""`callbacks.ModelCheckpoint`: last.ckpt always holds the final weights (issue 11.6)."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from callbacks import ModelCheckpoint


def _fit(tmp_path, callback, max_steps: int) -> None:
    trainer = L.Trainer(default_root_dir=tmp_path, max_steps=max_steps, callbacks=[callback], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        accelerator="cpu", devices=1)
    trainer.fit(BoringModel())


def test_last_checkpoint_is_at_the_final_step_between_periodic_saves(tmp_path):
    # max_steps=7 with a save every 5 steps: Lightning's own callback leaves last.ckpt at step 5.
    cb = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", save_last=True, every_n_train_steps=5)
    _fit(tmp_path, cb, 7)
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True, map_location="cpu")
    assert last["global_step"] == 7
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["last.ckpt", "step=5.ckpt"]


def test_no_extra_save_when_the_final_step_was_saved(tmp_path):
    cb = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", save_last=True, every_n_train_steps=5)
    _fit(tmp_path, cb, 10)
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True, map_location="cpu")
    assert last["global_step"] == 10


def test_checkpoints_default_to_the_runs_root_folder(tmp_path):
    """Issue 12.5: a recipe overlay moves a run's outputs by setting trainer.default_root_dir alone."""
    from lightning.pytorch.loggers import CSVLogger

    cb = ModelCheckpoint(filename="{step}", save_last=True, every_n_train_steps=2)
    trainer = L.Trainer(default_root_dir=tmp_path / "run", max_steps=2, callbacks=[cb],
                        logger=CSVLogger(tmp_path / "logs", name="elsewhere"), enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, accelerator="cpu", devices=1)
    trainer.fit(BoringModel())
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["last.ckpt", "step=2.ckpt"]
