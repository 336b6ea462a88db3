"""Exact resume: a run SIGKILLed mid-training and resumed from its last checkpoint ends with the same weights.

Three runs of the tiny config, each a fresh ``python -m lilicorr_pl fit`` process (one torch thread each,
so all three compute alike): an uninterrupted 8-step run; a run that checkpoints every step and is
SIGKILLed in the middle of step 5 (after step 4's checkpoint is on disk); and ``--ckpt_path last``
resuming it. Validation runs at steps 3 and 6, on both sides of the kill, so it must not disturb the
random streams either. The final drafter and head weights must be bit-identical, which needs the data
order (mid-epoch sampler position) and the global RNG (anchor sampling) restored exactly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[1]
KILL_AT_STEP = 4
STEPS = 8

OVERRIDES = f"""
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
"""


class KillMidStep(L.Callback):
    """Test-only: SIGKILL this process in the middle of the step after ``after_step`` (forward and backward
    done, optimizer step not), i.e. once ``after_step``'s checkpoint is on disk. No cleanup runs."""

    def __init__(self, after_step: int) -> None:
        self.after_step = after_step

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        if trainer.global_step == self.after_step:
            os.kill(os.getpid(), signal.SIGKILL)


def _launch(workdir: Path, cache_dir: Path, *extra: str) -> subprocess.Popen:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "overrides.yaml").write_text(OVERRIDES)
    env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "lilicorr_pl", "fit", "-c", str(ROOT / "configs" / "tiny.yaml"),
           "-c", "overrides.yaml", f"--data.cache_dir={cache_dir}", *extra]
    return subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, expect_kill: bool = False) -> None:
    out, _ = proc.communicate(timeout=300)
    if expect_kill:
        assert proc.returncode == -signal.SIGKILL, f"expected a SIGKILL, got rc {proc.returncode}:\n{out[-3000:]}"
    else:
        assert proc.returncode == 0, out[-3000:]


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


def test_sigkill_then_resume_from_last_matches_an_uninterrupted_run(tmp_path):
    cache = tmp_path / "cache"
    full = _launch(tmp_path / "full", cache)
    killed = _launch(tmp_path / "killed", cache, "--trainer.callbacks+=test_resume.KillMidStep",
                     f"--trainer.callbacks.after_step={KILL_AT_STEP}")
    _finish(full)
    _finish(killed, expect_kill=True)

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
    _assert_same(_weights(ckpts / step_ckpt), _weights(tmp_path / "full" / "ckpt" / step_ckpt))

    _finish(_launch(tmp_path / "killed", cache, "--ckpt_path=last"))
    resumed = torch.load(last, map_location="cpu", weights_only=True)
    assert resumed["global_step"] == STEPS
    reference = tmp_path / "full" / "ckpt" / "last.ckpt"
    _assert_same(_weights(last), _weights(reference))
    # Same optimizer moments too, so the runs would stay identical past this point.
    a = resumed["optimizer_states"][0]["state"]
    b = torch.load(reference, weights_only=True)["optimizer_states"][0]["state"]
    assert all(torch.equal(a[i]["exp_avg_sq"], b[i]["exp_avg_sq"]) for i in a)
