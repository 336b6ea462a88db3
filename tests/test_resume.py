"""Exact resume: a run SIGKILLed mid-training and resumed from its last checkpoint ends with the same weights;
a run stopped by SIGTERM says so (exit status 143), saves the step it stopped at and resumes from there.

Each run is a fresh ``python -m lilicorr_pl fit`` process of the tiny config (one torch thread each, so all compute
alike): an uninterrupted 8-step run, shared by the tests; a run that checkpoints every step and is SIGKILLed in the
middle of step 5 (after step 4's checkpoint is on disk), or one that checkpoints only at validation and gets a
SIGTERM during step 4; and ``--ckpt_path last`` resuming it. Validation runs at steps 3 and 6, on both sides of the
stop, so it must not disturb the random streams either. The final drafter and head weights must be bit-identical,
which needs the data order (mid-epoch sampler position) and the global RNG (anchor sampling) restored exactly.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
KILL_AT_STEP = 4
EPOCH_STEPS = 5
STEPS = 8

OVERRIDES = f"""
data:
  batch_size: 12  # an epoch of 5 steps: a stop can fall mid-epoch (step 4) or on an epoch's last step (5)
trainer:
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  max_steps: {STEPS}
  val_check_interval: 3
  limit_val_batches: 1
  callbacks:
    - class_path: callbacks.RandomStateCheckpoint
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{dirpath: ckpt, filename: "{{step}}", save_last: true, every_n_train_steps: 1, save_top_k: -1}}
    - class_path: test_resume.FirstStep
"""
# The SIGTERM run as the shipped configs set it up: the W&B logger (disabled by the environment) and the project's
# ModelCheckpoint without a dirpath, saving only at validation (steps 3 and 6) and at a stop into
# <default_root_dir>/checkpoints, where `--ckpt_path=last` must find them.
TERM_OVERRIDES = f"""
data:
  batch_size: 12
trainer:
  default_root_dir: run
  enable_progress_bar: false
  enable_model_summary: false
  max_steps: {STEPS}
  val_check_interval: 3
  limit_val_batches: 1
  callbacks:
    - class_path: callbacks.RandomStateCheckpoint
    - class_path: callbacks.ModelCheckpoint
      init_args: {{filename: "{{step}}", save_last: true, save_top_k: -1}}
    - class_path: test_resume.FirstStep
"""


class FirstStep(L.Callback):
    """Test-only: writes the step this process trains first to ``first_step.txt``: 0, or where a resume took over
    (a resume that finds no checkpoint trains from 0 and, deterministic, ends with the same weights)."""

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        if not hasattr(self, "written"):
            Path("first_step.txt").write_text(str(trainer.global_step))
            self.written = True


class TermAtStep(L.Callback):
    """Test-only: a SIGTERM to this process as step ``at_step`` ends, as a scheduler cancelling the job would send."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step == self.at_step:
            os.kill(os.getpid(), signal.SIGTERM)


class CtrlCAtStep(L.Callback):
    """Test-only: a SIGINT (Ctrl-C in a terminal) to this process as step ``at_step`` ends; ``twice``: two of them."""

    def __init__(self, at_step: int, twice: bool = False) -> None:
        self.at_step, self.twice = at_step, twice

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step == self.at_step:
            for _ in range(1 + self.twice):
                os.kill(os.getpid(), signal.SIGINT)


class CtrlCAtSetup(L.Callback):
    """Test-only: a SIGINT while the fit is being set up (as during a long target load), before its loop runs."""

    def setup(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        os.kill(os.getpid(), signal.SIGINT)


class TermDuringValidation(L.Callback):
    """Test-only: a SIGTERM during the validation after step ``at_step``, at the end of its batch ``batch`` (of two):
    after the first, Lightning leaves the validation at its next batch; after the last, it ends the validation and
    stops before the next step. Either way after that step's end has passed."""

    def __init__(self, at_step: int, batch: int = 0) -> None:
        self.at_step, self.batch = at_step, batch

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        if trainer.global_step == self.at_step and not trainer.sanity_checking and batch_idx == self.batch:
            os.kill(os.getpid(), signal.SIGTERM)


class KillMidStep(L.Callback):
    """Test-only: SIGKILL this process in the middle of the step after ``after_step`` (forward and backward
    done, optimizer step not), i.e. once ``after_step``'s checkpoint is on disk. No cleanup runs."""

    def __init__(self, after_step: int) -> None:
        self.after_step = after_step

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        if trainer.global_step == self.after_step:
            os.kill(os.getpid(), signal.SIGKILL)


def _launch(workdir: Path, cache_dir: Path, *extra: str, overrides: str = OVERRIDES) -> subprocess.Popen:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "overrides.yaml").write_text(overrides)
    # The module's own target cache: its first run (the uninterrupted one) builds the target, as a first run on a new
    # machine does, and the runs it is compared with find it built.
    env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               LILICORR_CACHE=str(cache_dir.parent / "target-cache"),
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "lilicorr_pl", "fit", "-c", str(ROOT / "configs" / "tiny.yaml"),
           "-c", "overrides.yaml", f"--data.cache_dir={cache_dir}", *extra]
    return subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, expect: int = 0) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == expect, f"expected exit status {expect}, got {proc.returncode}:\n{out[-3000:]}"
    return out


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    # weights_only=True: what Trainer.fit(ckpt_path=...) uses with torch >= 2.6, so resume needs it to work.
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    weights = {k: v for k, v in state.items() if k.startswith(("drafter.", "head."))}
    assert any(k.startswith("drafter.") for k in weights) and any(k.startswith("head.") for k in weights)
    return weights


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, Path]:
    """The uninterrupted run's checkpoint folder, and the data cache the other runs share with it."""
    root = tmp_path_factory.mktemp("resume")
    _finish(_launch(root / "full", root / "cache"))
    return root / "full" / "ckpt", root / "cache"


def test_sigkill_then_resume_from_last_matches_an_uninterrupted_run(tmp_path, uninterrupted):
    full_ckpts, cache = uninterrupted
    killed = _launch(tmp_path / "killed", cache, "--trainer.callbacks+=test_resume.KillMidStep",
                     f"--trainer.callbacks.after_step={KILL_AT_STEP}")
    _finish(killed, expect=-signal.SIGKILL)

    ckpts = tmp_path / "killed" / "ckpt"
    last = ckpts / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=True)
    assert saved["global_step"] == KILL_AT_STEP and not (ckpts / f"step={KILL_AT_STEP + 1}.ckpt").exists()
    # The random streams travel in the checkpoint (one entry per rank) ...
    assert len(saved["rng_states"]) == 1 and saved["rng_states"][0]["torch"].dtype == torch.uint8
    # ... and so does the mid-epoch data position (the data module's loader state): 4 batches of the epoch's order.
    assert saved["DraftDataModule"]["loader"]["_num_yielded"] == 4 and saved["DraftDataModule"]["epoch"] == 0
    # Up to the kill both runs computed the same thing (same process setup, same numbers).
    step_ckpt = f"step={KILL_AT_STEP}.ckpt"
    _assert_same(_weights(ckpts / step_ckpt), _weights(full_ckpts / step_ckpt))

    _finish(_launch(tmp_path / "killed", cache, "--ckpt_path=last"))
    assert (tmp_path / "killed" / "first_step.txt").read_text() == str(KILL_AT_STEP)  # it did resume
    resumed = torch.load(last, map_location="cpu", weights_only=True)
    assert resumed["global_step"] == STEPS
    reference = full_ckpts / "last.ckpt"
    _assert_same(_weights(last), _weights(reference))
    # Same optimizer moments too, so the runs would stay identical past this point.
    a = resumed["optimizer_states"][0]["state"]
    b = torch.load(reference, weights_only=True)["optimizer_states"][0]["state"]
    assert all(torch.equal(a[i]["exp_avg_sq"], b[i]["exp_avg_sq"]) for i in a)


# Step 3 is also a validation step: its validation still runs to its end and saves what it would (step=3.ckpt).
@pytest.mark.parametrize("stop", [KILL_AT_STEP, EPOCH_STEPS, 3], ids=["mid-epoch", "epoch-end", "validation-step"])
def test_sigterm_stops_with_status_143_saves_its_step_and_resumes_from_it(tmp_path, uninterrupted, stop):
    full_ckpts, cache = uninterrupted
    out = _finish(_launch(tmp_path, cache, "--trainer.callbacks+=test_resume.TermAtStep",
                          f"--trainer.callbacks.at_step={stop}", overrides=TERM_OVERRIDES),
                  expect=128 + signal.SIGTERM)  # Lightning alone exits 0 here: the stop would read as a finished run
    assert (f"lilicorr fit: training stopped by SIGTERM at step {stop} of {STEPS}; resume with the same "
            "command and --ckpt_path=last (exit status 143)") in out
    ckpts = tmp_path / "run" / "checkpoints"
    # Only step 3 (validation) was scheduled; the stop saved its own step, so no step is trained twice or lost.
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "step=3.ckpt"]
    saved = torch.load(ckpts / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == stop and saved["DraftDataModule"]["loader"]["_num_yielded"] == stop
    assert torch.load(full_ckpts / f"step={EPOCH_STEPS + 1}.ckpt", weights_only=True)["epoch"] == 1  # 5 = epoch end
    _assert_same(_weights(ckpts / "last.ckpt"), _weights(full_ckpts / f"step={stop}.ckpt"))

    _finish(_launch(tmp_path, cache, "--ckpt_path=last", overrides=TERM_OVERRIDES))
    assert (tmp_path / "first_step.txt").read_text() == str(stop)  # found in the run's folder, resumed
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "step=3.ckpt", "step=6.ckpt"]
    resumed = torch.load(ckpts / "last.ckpt", map_location="cpu", weights_only=True)
    assert resumed["global_step"] == STEPS
    _assert_same(_weights(ckpts / "last.ckpt"), _weights(full_ckpts / "last.ckpt"))


def test_ctrl_c_stops_a_fit_after_its_step_and_saves_it_and_a_second_stops_at_once(tmp_path, uninterrupted):
    """Lightning stopped at once on Ctrl-C and saved nothing (exit status 1): a resume started over at step 0."""
    full_ckpts, cache = uninterrupted
    out = _finish(_launch(tmp_path / "once", cache, "--trainer.callbacks+=test_resume.CtrlCAtStep",
                          f"--trainer.callbacks.at_step={KILL_AT_STEP}", overrides=TERM_OVERRIDES),
                  expect=128 + signal.SIGINT)
    assert "Ctrl-C: stopping after this step, which is saved" in out
    assert (f"lilicorr fit: training stopped by Ctrl-C at step {KILL_AT_STEP} of {STEPS}; resume with the same "
            "command and --ckpt_path=last (exit status 130)") in out
    last = tmp_path / "once" / "run" / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == KILL_AT_STEP
    _assert_same(_weights(last), _weights(full_ckpts / f"step={KILL_AT_STEP}.ckpt"))
    # Pressed twice: at once, as Lightning's own Ctrl-C, with nothing saved at that step.
    _finish(_launch(tmp_path / "twice", cache, "--trainer.callbacks+=test_resume.CtrlCAtStep",
                    f"--trainer.callbacks.at_step={KILL_AT_STEP}", "--trainer.callbacks.twice=true",
                    overrides=TERM_OVERRIDES), expect=1)
    last = tmp_path / "twice" / "run" / "checkpoints" / "last.ckpt"  # step 3's validation's save, not this step's
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] < KILL_AT_STEP
    # Before the loop runs (Lightning clears its stop flag when the loop starts, so the stop was lost and the fit
    # trained to its end): at once, nothing trained.
    out = _finish(_launch(tmp_path / "setup", cache, "--trainer.callbacks+=test_resume.CtrlCAtSetup",
                          overrides=TERM_OVERRIDES), expect=1)
    assert not (tmp_path / "setup" / "first_step.txt").exists(), out[-2000:]


# Two validation batches (a larger validation split than the other tests'), so the stop can come in the middle of one.
VAL_OVERRIDES = (TERM_OVERRIDES.replace("limit_val_batches: 1", "limit_val_batches: 2")
                 .replace("batch_size: 12", "batch_size: 12\n  val_fraction: 0.4"))


@pytest.fixture(scope="module")
def uninterrupted_two_batch_validation(uninterrupted, tmp_path_factory) -> Path:
    """The checkpoints, one per step, of an uninterrupted run with VAL_OVERRIDES's validation split."""
    _, cache = uninterrupted
    root = tmp_path_factory.mktemp("resume-val")
    _finish(_launch(root, cache, overrides=VAL_OVERRIDES.replace("save_top_k: -1", "save_top_k: -1, "
                                                                  "every_n_train_steps: 1")))
    return root / "run" / "checkpoints"


# first-batch: the validation is a save trigger (as in the demo's arms) and Lightning leaves it at its second batch,
# so the validation's own save (step=3.ckpt) is never reached. last-batch: the validation is not a save trigger (saves
# every 100 steps, as the shipped fit configs save by steps) and the stop comes once it has run. Neither had saved
# step 3 before the stop saved it here: each resumed from step 0.
@pytest.mark.parametrize("batch, every, after_stop, after_resume", [
    (0, None, ["last.ckpt"], ["last.ckpt", "step=6.ckpt"]),
    (1, 100, ["last.ckpt"], ["last.ckpt"]),
], ids=["first-batch", "last-batch"])
def test_a_sigterm_during_the_validation_after_a_step_saves_that_step_and_the_resume_goes_on_from_it(
        tmp_path, uninterrupted, uninterrupted_two_batch_validation, batch, every, after_stop, after_resume):
    _, cache = uninterrupted
    full_ckpts = uninterrupted_two_batch_validation
    overrides = VAL_OVERRIDES if every is None else VAL_OVERRIDES.replace(
        "save_top_k: -1", f"save_top_k: -1, every_n_train_steps: {every}")
    out = _finish(_launch(tmp_path, cache, "--trainer.callbacks+=test_resume.TermDuringValidation",
                          "--trainer.callbacks.at_step=3", f"--trainer.callbacks.batch={batch}", overrides=overrides),
                  expect=128 + signal.SIGTERM)
    assert "training stopped by SIGTERM at step 3 of 8" in out
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == after_stop
    saved = torch.load(ckpts / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == 3
    _assert_same(_weights(ckpts / "last.ckpt"), _weights(full_ckpts / "step=3.ckpt"))

    _finish(_launch(tmp_path, cache, "--ckpt_path=last", overrides=overrides))
    # The resume trains on from step 3; Lightning counts step 3's validation as run and does not repeat it.
    assert (tmp_path / "first_step.txt").read_text() == "3"
    assert sorted(p.name for p in ckpts.iterdir()) == after_resume
    assert torch.load(ckpts / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == STEPS
    _assert_same(_weights(ckpts / "last.ckpt"), _weights(full_ckpts / "last.ckpt"))


def test_a_schedule_resumed_at_another_length_goes_on_from_its_step():
    """A fit resumed with a larger max_steps: the saved schedule length came back with the scheduler's state, so every
    later step ran at the final learning rate (0 in the recipes) and the fit exited 0. The schedule keeps this run's
    length, goes on from the saved step, and the restored optimizer gets that step's learning rate; said once."""
    from lilicorr_pl.optim import WarmupCosine

    def pair(total):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
        return opt, WarmupCosine(opt, total_steps=total, warmup_fraction=0.0)

    opt, sched = pair(4)
    for _ in range(4):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0)
    opt_state, sched_state = opt.state_dict(), sched.state_dict()
    same_opt, same = pair(4)  # the same length: restored as it was, without a word
    same_opt.load_state_dict(opt_state)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_state_dict(sched_state)
    assert same.last_epoch == 4 and same_opt.param_groups[0]["lr"] == pytest.approx(0.0)
    longer_opt, longer = pair(8)
    longer_opt.load_state_dict(opt_state)  # lr 0, from the 4-step schedule
    with pytest.warns(UserWarning, match=r"another learning-rate schedule \(total_steps 4 -> 8\): it goes on from step 4"):
        longer.load_state_dict(sched_state)
    assert longer.total_steps == 8 and longer.last_epoch == 4
    assert longer_opt.param_groups[0]["lr"] == pytest.approx(0.5) == longer.get_last_lr()[0]  # cos at 4 of 8
    longer_opt.step()
    longer.step()
    assert longer_opt.param_groups[0]["lr"] == pytest.approx(0.5 * (1 + math.cos(math.pi * 5 / 8)))


def test_a_finished_fit_resumed_with_more_steps_trains_them(tmp_path):
    from lilicorr_pl.cli import main as cli_main

    root = tmp_path / "run"
    common = ["-c", str(ROOT / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={root}",
              "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false"]
    cli_main(["fit", *common, "--trainer.max_steps=2"])
    ckpt = root / "checkpoints" / "last.ckpt"
    first = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert first["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.0)
    with pytest.warns(UserWarning, match="total_steps 2 -> 4"):
        cli_main(["fit", *common, "--trainer.max_steps=4", "--ckpt_path=last"])
    second = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert second["global_step"] == 4 and second["lr_schedulers"][0]["total_steps"] == 4
    moved = max((second["state_dict"][k] - v).abs().max().item() for k, v in first["state_dict"].items()
                if k.startswith("head.") and v.is_floating_point())
    assert moved > 0  # steps 3 and 4 trained (at lr 0 nothing moved)


def test_a_resume_that_changes_which_parameters_train_is_refused_up_front():
    """model.freeze_drafter on resume was announced as applied, then failed after data preparation and the target's
    load (the optimizer state holds the parameter groups of the other setting): refused in one line now."""
    from lilicorr_pl.checkpoint import CheckpointError
    from lilicorr_pl.system import check_resume_settings

    for saved, now in ((True, False), (False, True)):
        with pytest.raises(CheckpointError, match=r"cannot resume: .*freeze_drafter settings \(model.freeze_drafter: "
                                                  rf"checkpoint {saved} vs now {now}\)"):
            check_resume_settings({"freeze_drafter": saved}, {"freeze_drafter": now})
    assert check_resume_settings({"freeze_drafter": True}, {"freeze_drafter": True}) == []


def _epoch_rows(root: Path) -> list[tuple[int, dict[str, float]]]:
    """(step, train/epoch_* values) of every epoch row the CSV logger wrote under ``root``, in order."""
    import csv

    rows = []
    for path in sorted(root.glob("csv/version_*/metrics.csv")):
        for row in csv.DictReader(path.open()):
            values = {k: float(v) for k, v in row.items() if k.startswith("train/epoch_") and v}
            if values:
                rows.append((int(row["step"]), values))
    return rows


def test_a_fit_extended_from_a_stop_inside_an_epoch_logs_and_trains_as_an_uninterrupted_one(tmp_path, monkeypatch):
    """The training metrics' epoch means were not checkpointed: a fit stopped inside an epoch and resumed logged that
    epoch's train/epoch_* over the steps since the resume alone, under the whole epoch's name (top1_prefix 0.065 for an
    uninterrupted run's 0.034). They now go on from the checkpoint's sums, to the same numbers; a checkpoint without
    them (several processes, an older one) leaves that epoch's means unlogged, with a warning."""
    from lilicorr_pl.cli import main as cli_main

    monkeypatch.chdir(tmp_path)

    def fit(name: str, steps: int, *extra: str) -> None:
        cli_main(["fit", "-c", str(ROOT / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={name}",
                  "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.init_args.save_dir={name}",
                  "--trainer.logger.init_args.name=csv", "--trainer.log_every_n_steps=1", "--model.lr_scheduler=null",
                  "--trainer.enable_progress_bar=false", f"--trainer.max_steps={steps}", *extra])

    fit("whole", 16)  # an epoch is 15 steps: its means at step 14, then one step of the next
    fit("resumed", 8)
    shutil.copy(tmp_path / "resumed" / "checkpoints" / "last.ckpt", tmp_path / "first.ckpt")
    fit("resumed", 12, "--ckpt_path=last")  # a second stop inside the same epoch: Lightning's count runs ahead
    fit("resumed", 16, "--ckpt_path=last")
    whole, resumed = _epoch_rows(tmp_path / "whole"), _epoch_rows(tmp_path / "resumed")
    assert [step for step, _ in whole] == [14, 15]
    # Each stop at max_steps ends its run's epoch there (as it ends the whole run's at 15); the last resumed run logs
    # the epoch it went on with over all of it: the same numbers as the whole run's, bit for bit (a second resume
    # inside the epoch lost them: the checkpoint named the epoch by Lightning's count, the loader by the data's).
    assert [step for step, _ in resumed] == [7, 11, 14, 15] and resumed[2:] == whole
    # ... and trains the next epoch on the same data (Lightning counted the stopped epoch as done, and the resumed run
    # read every later epoch in the order of the one after it): the same weights as the whole run's.
    ends = [torch.load(tmp_path / run / "checkpoints" / "last.ckpt", map_location="cpu",
                       weights_only=True)["state_dict"] for run in ("whole", "resumed")]
    assert ends[0].keys() == ends[1].keys() and all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])
    # A checkpoint without the epoch's sums: that epoch is not logged under its name.
    from helpers import save_edited

    state = torch.load(tmp_path / "first.ckpt", map_location="cpu", weights_only=True)
    state["lilicorr"]["train_epoch_metrics"] = None
    save_edited(state, tmp_path / "older.ckpt")
    with pytest.warns(UserWarning, match=r"train/epoch_\* of the epoch this fit resumed inside \(the data's epoch 0\) "
                                         r"are not logged"):
        fit("older", 16, f"--ckpt_path={tmp_path / 'older.ckpt'}")
    assert [step for step, _ in _epoch_rows(tmp_path / "older")] == [15]
