"""Progress on a terminal and in a log file: bars redraw in place on a terminal and write plain lines in a file."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch

from lilicorr_pl import progress
from lilicorr_pl.progress import progress_bar

ROOT = Path(__file__).resolve().parents[1]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_in_a_log_a_bar_writes_whole_lines_at_most_every_interval_and_always_the_last():
    log = io.StringIO()
    for _ in progress_bar(range(500), desc="   lilicorr", position=1, file=log, mininterval=1.0):
        pass
    text = log.getvalue()
    assert "\r" not in text and "\x1b" not in text  # no redraws, no cursor moves
    lines = text.splitlines()
    assert 1 <= len(lines) <= 3 and all(line.startswith("   lilicorr:") for line in lines)  # not one per item
    assert "500/500" in lines[-1]


def test_in_a_log_a_bar_writes_again_once_the_interval_has_passed(monkeypatch):
    monkeypatch.setattr(progress, "LOG_INTERVAL", 0.0)
    log = io.StringIO()
    bar = progress_bar(total=3, desc="regenerate", file=log, mininterval=0.0)
    for _ in range(3):
        bar.update(1)
    bar.close()
    assert [re.search(r"(\d)/3", line).group(1) for line in log.getvalue().splitlines()] == ["0", "1", "2", "3"]


def test_in_a_log_the_closing_redraw_of_the_same_count_is_not_written_twice_whatever_its_rate():
    """close() redraws the last state; its rate (so the drawn bar's width, at a fixed ncols) may differ from the
    update's: the same count is still one line (two lines came out when the rate's digits changed)."""
    from lilicorr_pl.progress import _LogLines

    log = io.StringIO()
    lines = _LogLines(log)
    lines.write("\rregenerate: 100%|##########| 3/3 [00:00<00:00, 1234.56it/s]")
    lines.write("\rregenerate: 100%|############| 3/3 [00:00<00:00, 12.3it/s]")
    lines.write("\rregenerate:  67%|######    | 2/3 [00:01<00:00, 12.3it/s]")
    assert [re.search(r"(\d)/3", line).group(1) for line in log.getvalue().splitlines()] == ["3", "2"]


def test_on_a_terminal_the_bar_redraws_in_place():
    screen = _Terminal()
    for _ in progress_bar(range(3), desc="x", file=screen):
        pass
    assert "\r" in screen.getvalue()


def test_a_jupyter_kernels_output_counts_as_live():
    """In a notebook stderr is the kernel's stream, not a TTY: its bars stay tqdm's (a widget), not 30-s log lines."""
    from lilicorr_pl.progress import is_terminal

    kernel_stream = type("OutStream", (io.StringIO,), {"__module__": "ipykernel.iostream"})()
    assert is_terminal(kernel_stream) and not is_terminal(io.StringIO())


def test_a_disabled_bar_writes_nothing_anywhere():
    log = io.StringIO()
    for _ in progress_bar(range(3), file=log, disable=True):
        pass
    assert log.getvalue() == ""


def test_a_fit_logged_to_a_file_gets_progress_lines_with_steps_rate_time_left_and_loss():
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lilicorr_pl.lightning_cli import LogProgressBar

    class Model(BoringModel):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.log("train/loss", out["loss"], prog_bar=True)
            return out

    log = io.StringIO()
    torch.manual_seed(0)
    trainer = Trainer(max_steps=4, callbacks=[LogProgressBar(interval=0.0, stream=log)], logger=False,
                      enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(Model())
    lines = log.getvalue().splitlines()
    assert [re.search(r"step (\d)/4", line).group(1) for line in lines] == ["1", "2", "3", "4", "4"]  # + the end
    assert re.match(r"epoch \d step 4/4 \(100%\) \| [\d.]+ it/s \| elapsed 0:\d\d \| ", lines[-1])
    assert "| left 0:00" in lines[-1] and re.search(r"\| train/loss -?\d", lines[-1])


def test_lilicorr_fit_uses_the_log_bar_when_its_output_is_not_a_terminal_and_the_rich_bar_on_one(
        monkeypatch, tmp_path):
    from lilicorr_pl.lightning_cli import LogProgressBar, StepProgressBar, run_lightning

    monkeypatch.chdir(tmp_path)
    args = ["-c", str(ROOT / "configs" / "tiny.yaml"), "--trainer.logger=false"]
    monkeypatch.setattr("sys.stdout", io.StringIO())  # a log file
    assert isinstance(run_lightning(args, run=False).trainer.progress_bar_callback, LogProgressBar)
    monkeypatch.setattr("sys.stdout", _Terminal())
    pytest.importorskip("rich")
    assert isinstance(run_lightning(args, run=False).trainer.progress_bar_callback, StepProgressBar)


def test_a_fit_without_max_steps_counts_batches_per_epoch_at_a_steady_rate(monkeypatch):
    """Epoch-limited runs: the count restarts each epoch, the rate does not decay with it, time left spans every
    epoch still to run (the count was one batch low and the rate fell 40 -> 14 -> 8 it/s over three epochs)."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lilicorr_pl.lightning_cli import LogProgressBar

    clock = iter(range(10_000))  # one second per call: a constant speed
    log = io.StringIO()
    bar = LogProgressBar(interval=0.0, stream=log)
    monkeypatch.setattr(bar, "clock", lambda: float(next(clock)))  # this bar's clock only: other threads keep theirs
    trainer = Trainer(max_epochs=3, limit_train_batches=4, callbacks=[bar],
                      logger=False, enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(BoringModel())
    lines = log.getvalue().splitlines()[:-1]  # the last: the end of training
    assert [re.match(r"epoch (\d)/3 batch (\d)/4", line).groups() for line in lines] == [
        (str(e), str(b)) for e in range(3) for b in range(1, 5)]
    rates = [float(re.search(r"\| ([\d.]+) it/s", line).group(1)) for line in lines]
    assert max(rates) - min(rates) < 0.05  # steady, at one batch per clock second
    assert lines[-1].endswith("| left 0:00") and "| left 0:11" in lines[0]  # 11 batches to go after the first


def test_a_progress_file_that_cannot_be_written_at_the_end_loses_no_checkpoint(tmp_path, monkeypatch):
    """The last write's OSError (a full disk, a reader holding the file on Windows) raised out of on_train_end,
    before the ModelCheckpoint after it saved the run's last steps: the fit failed and last.ckpt stayed steps behind."""
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    import callbacks.progress as progress_callback
    from callbacks import ModelCheckpoint, ProgressFile

    real = progress_callback.write_results_json

    def held_at_the_end(path, payload, command):
        if payload["finished"]:
            raise PermissionError(13, "The process cannot access the file because it is being used by another process")
        real(path, payload, command)

    monkeypatch.setattr(progress_callback, "write_results_json", held_at_the_end)
    ckpt = ModelCheckpoint(every_n_train_steps=25, save_top_k=0, save_last=True)
    trainer = L.Trainer(default_root_dir=tmp_path, max_steps=30, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, accelerator="cpu",
                        callbacks=[ProgressFile(str(tmp_path / "progress.json")), ckpt])
    with pytest.warns(UserWarning, match=r"ProgressFile could not write .*progress.json at the end of training"):
        trainer.fit(BoringModel())
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == trainer.global_step == 30
