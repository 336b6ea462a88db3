"""`callbacks.ModelCheckpoint`: last.ckpt always holds the final weights (issue 11.6)."""

from __future__ import annotations

import os
import signal

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning.pytorch.utilities.exceptions import SIGTERMException

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


# --- saves: written beside the checkpoint, renamed into place ------------------------------------------------------

class _Killed(Exception):
    """Stands for the job being killed at that point."""


def _two_file_systems(monkeypatch, tmp_path):
    """The system's temporary folder and the checkpoints on two file systems (a node-local /tmp and a shared
    checkpoint folder): a rename between folders fails with EXDEV, as the kernel's does between file systems, and a
    move falls back to copying onto the destination, which the job is killed in the middle of."""
    import errno
    import shutil
    import tempfile

    node_local = tmp_path / "node-local-tmp"
    node_local.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(node_local))
    for name in ("rename", "replace"):
        real = getattr(os, name)

        def cross_device(src, dst, *args, _real=real, **kwargs):
            if os.path.dirname(os.path.abspath(src)) != os.path.dirname(os.path.abspath(dst)):
                raise OSError(errno.EXDEV, "Invalid cross-device link")
            return _real(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, name, cross_device)

    copies = []

    def killed_halfway_through_the_second_copy(fsrc, fdst, *args, **kwargs):
        copies.append(fdst.name)
        data = fsrc.read()
        fdst.write(data if len(copies) == 1 else data[: len(data) // 2])
        fdst.flush()
        if len(copies) > 1:
            raise _Killed

    monkeypatch.setattr(shutil, "_fastcopy_sendfile", killed_halfway_through_the_second_copy)
    monkeypatch.setattr(shutil, "copyfileobj", killed_halfway_through_the_second_copy)


def test_a_checkpoint_folder_on_another_file_system_than_the_temporary_folder_never_gets_a_torn_file(
        tmp_path, monkeypatch):
    # Lightning's own save writes into the system's temporary folder and moves the file over last.ckpt: between file
    # systems that move is a copy onto last.ckpt, and a kill during it left a torn file where step 5's had been. Here
    # nothing is copied: each save is written in the checkpoint folder and renamed there, so the run ends at step 7.
    _two_file_systems(monkeypatch, tmp_path)
    cb = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=0, save_last=True, every_n_train_steps=5)
    try:
        _fit(tmp_path, cb, 7)
    except _Killed:
        pass
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True, map_location="cpu")
    assert last["global_step"] == 7
    assert [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".")] == []


def test_a_save_that_fails_midway_keeps_the_previous_checkpoint_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    import errno

    import callbacks.checkpoint as module

    real_save, calls = torch.save, []

    def disk_full_on_the_second_save(obj, fh, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            fh.write(b"PK\x03\x04 partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, fh, *args, **kwargs)

    monkeypatch.setattr(module.torch, "save", disk_full_on_the_second_save)
    cb = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=0, save_last=True, every_n_train_steps=5)
    with pytest.raises(OSError, match="No space left"):
        _fit(tmp_path, cb, 7)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["last.ckpt"]
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True, map_location="cpu")["global_step"] == 5


def test_a_killed_writers_temporary_file_is_removed_and_nothing_else(tmp_path):
    from lilicorr_pl.files import writer_tag

    folder = tmp_path / "ckpt"
    folder.mkdir()
    dead = folder / ".last.ckpt.x1y2.w@{}@{}@deadbeef.tmp".format(*writer_tag().split("@")[1:2], 2 ** 22 + 12345)
    live = folder / f".last.ckpt.a1b2.{writer_tag()}.tmp"  # this process: a writer still at work
    users = [folder / ".notes.tmp", folder / "mine.ckpt.tmp"]
    for p in (dead, live, *users):
        p.write_bytes(b"x")
    cb = ModelCheckpoint(dirpath=folder, save_last=True)
    _fit(tmp_path, cb, 2)
    assert not dead.exists()
    assert live.exists() and all(p.exists() for p in users)


def test_a_checkpoint_io_given_to_the_trainer_is_kept(tmp_path):
    from lightning.fabric.plugins import TorchCheckpointIO

    from callbacks.checkpoint import AtomicCheckpointIO

    class Mine(TorchCheckpointIO):
        pass

    mine = Mine()
    cb = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = L.Trainer(default_root_dir=tmp_path, max_steps=2, callbacks=[cb], logger=False, plugins=[mine],
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        accelerator="cpu", devices=1)
    trainer.fit(BoringModel())
    assert trainer.strategy.checkpoint_io is mine
    default = L.Trainer(default_root_dir=tmp_path / "d", max_steps=1, callbacks=[ModelCheckpoint(save_last=True)],
                        logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        accelerator="cpu", devices=1)
    umask = os.umask(0o027)  # a group-readable setup: the checkpoint gets the mode any new file gets there
    try:
        default.fit(BoringModel())
    finally:
        os.umask(umask)
    assert type(default.strategy.checkpoint_io) is AtomicCheckpointIO
    assert (tmp_path / "d" / "checkpoints" / "last.ckpt").stat().st_mode & 0o777 == 0o640


# --- save_top_k=0: only last.ckpt, written at every save trigger ---------------------------------------------------

def test_with_save_top_k_0_last_is_written_at_each_validation_once(tmp_path, monkeypatch):
    # The demo's arms keep only last.ckpt (`save_top_k: 0`): Lightning wrote it at training's end alone, so a run
    # killed at step 6 had no checkpoint at all.
    saves = []
    save = L.Trainer.save_checkpoint

    def spy(trainer, filepath, *args, **kwargs):
        saves.append((trainer.global_step, os.path.basename(filepath)))
        return save(trainer, filepath, *args, **kwargs)

    monkeypatch.setattr(L.Trainer, "save_checkpoint", spy)
    on_disk = {}

    class Peek(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            last = tmp_path / "ckpt" / "last.ckpt"
            on_disk[trainer.global_step] = (torch.load(last, weights_only=True, map_location="cpu")["global_step"]
                                            if last.exists() else None)

    cb = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0)
    trainer = L.Trainer(default_root_dir=tmp_path, max_steps=7, val_check_interval=3, limit_val_batches=1,
                        callbacks=[cb, Peek()], logger=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, accelerator="cpu", devices=1)
    trainer.fit(BoringModel())
    assert saves == [(3, "last.ckpt"), (6, "last.ckpt"), (7, "last.ckpt")]
    assert on_disk[3] == 3 and on_disk[6] == 6
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["last.ckpt"]
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True, map_location="cpu")["global_step"] == 7


def test_with_save_top_k_0_every_n_train_steps_writes_last_once_per_trigger(tmp_path, monkeypatch):
    saves = []
    save = L.Trainer.save_checkpoint
    monkeypatch.setattr(L.Trainer, "save_checkpoint", lambda trainer, filepath, *a, **k: (
        saves.append(trainer.global_step), save(trainer, filepath, *a, **k)))
    cb = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0, every_n_train_steps=2)
    _fit(tmp_path, cb, 5)
    assert saves == [2, 4, 5]


def test_with_save_top_k_0_a_sigterm_at_a_validation_step_writes_last_once(tmp_path, monkeypatch):
    saves = []
    save = L.Trainer.save_checkpoint
    monkeypatch.setattr(L.Trainer, "save_checkpoint", lambda trainer, filepath, *a, **k: (
        saves.append(trainer.global_step), save(trainer, filepath, *a, **k)))

    class Term(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # Lightning's handler notes it; the fit stops after the step

    cb = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0)
    trainer = L.Trainer(default_root_dir=tmp_path, max_steps=7, val_check_interval=3, limit_val_batches=1,
                        callbacks=[Term(), cb], logger=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, accelerator="cpu", devices=1)
    with pytest.raises(SIGTERMException):
        trainer.fit(BoringModel())
    assert saves == [3]


def test_a_sigterm_in_the_epochs_end_hooks_saves_that_step_and_the_resume_starts_the_next_epoch(tmp_path):
    """The stop comes in the epoch's end hooks, after its last step (step 4, not a scheduled save: every 5 steps):
    Lightning raises once the epoch is counted done. Nothing saved step 4 before; now the stop does, and the resume
    trains the next epoch (an epoch boundary, so even this model's plain loader resumes exactly)."""

    class Term(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            if trainer.current_epoch == 0:
                os.kill(os.getpid(), signal.SIGTERM)

    class Steps(L.Callback):
        def __init__(self):
            self.steps = []

        def on_train_batch_end(self, trainer, *args):
            self.steps.append(trainer.global_step)

    def fit(*extra, ckpt_path=None):
        L.seed_everything(0)
        steps, model = Steps(), BoringModel()
        trainer = L.Trainer(default_root_dir=tmp_path, max_epochs=3, limit_train_batches=4, limit_val_batches=0,
                            callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", save_last=True,
                                                       every_n_train_steps=5), steps, *extra],
                            logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                            devices=1)
        try:
            trainer.fit(model, ckpt_path=ckpt_path)
        except SIGTERMException:
            pass
        return model, steps.steps

    reference, _ = fit()
    for p in (tmp_path / "ckpt").iterdir():
        p.unlink()
    fit(Term())
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["last.ckpt"]
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True, map_location="cpu")["global_step"] == 4
    resumed, steps = fit(ckpt_path="last")
    assert steps == list(range(5, 13))
    assert all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), resumed.state_dict().values()))


def _kill_at_the_second_link(monkeypatch) -> None:
    """The job is killed when it makes its second symbolic link (to last.ckpt)."""
    real, links = os.symlink, []

    def killed_at_the_second_link(src, dst, *args, **kwargs):
        links.append(src)
        if len(links) == 2:
            raise _Killed("killed while linking last.ckpt")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "symlink", killed_at_the_second_link)


def test_save_last_link_killed_while_linking_keeps_the_previous_last(tmp_path, monkeypatch):
    """`save_last="link"`: Lightning removed last.ckpt and then made the link, so a job killed in between had no
    last.ckpt and `--ckpt_path=last` started from step 0. Now the link is made aside and renamed over it: killed
    at the second link, last.ckpt still names step 2's checkpoint; otherwise it names the newest."""
    folder = tmp_path / "ckpt"
    cb = ModelCheckpoint(dirpath=folder, filename="{step}", save_last="link", save_top_k=-1, every_n_train_steps=2)
    _fit(tmp_path, cb, 4)
    assert os.path.islink(folder / "last.ckpt") and os.readlink(folder / "last.ckpt") == "step=4.ckpt"
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step=2.ckpt", "step=4.ckpt"]

    _kill_at_the_second_link(monkeypatch)
    again = tmp_path / "again"
    cb = ModelCheckpoint(dirpath=again, filename="{step}", save_last="link", save_top_k=-1, every_n_train_steps=2)
    with pytest.raises(_Killed):
        _fit(tmp_path, cb, 4)
    monkeypatch.undo()
    assert os.readlink(again / "last.ckpt") == "step=2.ckpt"
    assert torch.load(again / "last.ckpt", weights_only=True, map_location="cpu")["global_step"] == 2
    assert sorted(p.name for p in again.iterdir()) == ["last.ckpt", "step=2.ckpt", "step=4.ckpt"]  # no temporary


def test_save_last_link_with_a_top_k_never_dangles_and_training_end_writes_its_step(tmp_path, monkeypatch):
    """`save_last="link"`, `save_top_k=1`: Lightning removed step 2's checkpoint, which last.ckpt linked to, before it
    linked step 4's, so a job killed in between had a dangling last.ckpt (and `--ckpt_path=last` found nothing). Now
    last is linked to the new checkpoint first. And at training's end between saves (7 steps, a save every 5), last
    linked to step 5's checkpoint: it is now written whole at step 7."""
    _kill_at_the_second_link(monkeypatch)
    folder = tmp_path / "ckpt"
    cb = ModelCheckpoint(dirpath=folder, filename="{step}", save_last="link", save_top_k=1, every_n_train_steps=2)
    with pytest.raises(_Killed):
        _fit(tmp_path, cb, 4)
    monkeypatch.undo()
    assert torch.load(folder / "last.ckpt", weights_only=True, map_location="cpu")["global_step"] == 2

    cb = ModelCheckpoint(dirpath=tmp_path / "end", filename="{step}", save_last="link", save_top_k=1,
                         every_n_train_steps=5)
    _fit(tmp_path, cb, 7)
    assert torch.load(tmp_path / "end" / "last.ckpt", weights_only=True, map_location="cpu")["global_step"] == 7
    assert sorted(p.name for p in (tmp_path / "end").iterdir()) == ["last.ckpt", "step=5.ckpt"]
