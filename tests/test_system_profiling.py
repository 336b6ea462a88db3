"""Issue 12.5: the step's phases are timed by Lightning's profiler (the same actions for `lilicorr fit` and
`lilicorr perf`), and the lattice diagnostics are computed once per training step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import lilicorr_pl.metrics
import lilicorr_pl.system
from lilicorr_pl.cli import main

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("target", "drafter", "head", "losses")


def test_fit_profiles_each_phase_and_computes_diagnostics_once_per_step(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    calls = []
    original = lilicorr_pl.system.lattice_diagnostics

    def counting(*args, **kwargs):
        calls.append(kwargs.get("top_k"))
        return original(*args, **kwargs)

    monkeypatch.setattr(lilicorr_pl.system, "lattice_diagnostics", counting)
    monkeypatch.setattr(lilicorr_pl.metrics, "lattice_diagnostics", counting)
    cli = main(["fit", "-c", str(ROOT / "configs" / "tiny.yaml"), "--trainer.max_steps=2",
                "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
                "--trainer.profiler=simple"])
    assert len(calls) == 2 and set(calls) == {4}  # one per step, at the head's lattice width (top_k 4)
    durations = cli.trainer.profiler.recorded_durations
    for phase in PHASES:
        assert len(durations[f"[DraftSystem]{phase}"]) == 2, phase  # one per training step
    assert "train/oracle_prefix" in cli.trainer.callback_metrics  # the per-step diagnostics are still logged

    # `lilicorr perf` reads the same profiler actions.
    result = main(["perf", "-c", str(ROOT / "configs" / "tiny.yaml"), "--steps", "2", "--warmup", "1"])
    assert set(PHASES) <= set(result) and result["step_total"] > 0
    parts = sum(result[k] for k in (*PHASES, "other_forward", "backward", "optimizer"))
    assert parts == pytest.approx(result["step_total"], rel=0.2)

    # ... and the config.yaml that fit saved in its run folder, fit's own keys (ckpt_path, weights_only) included;
    # a resume checkpoint named there is said to be left unloaded.
    saved = tmp_path / "runs" / "tiny" / "config.yaml"
    assert {"ckpt_path", "weights_only"} <= set(yaml.safe_load(saved.read_text()))
    result = main(["perf", "-c", str(saved), "--ckpt_path", "resume.ckpt", "--steps", "1", "--warmup", "0"])
    assert set(PHASES) <= set(result)
    assert "ckpt_path resume.ckpt (fit's resume checkpoint) is not loaded; pass --ckpt" in capsys.readouterr().out


def test_perf_times_the_head_stage_with_its_context_memo_served_as_in_a_fit(capsys):
    """A fit revisits every example many times, so `perf` times the memo's steady state: every timed example is
    served from it; with the memo off the key is absent (and the drafter runs its plain forward)."""
    stage = ["-c", str(ROOT / "configs" / "tiny.yaml"), "-c", str(ROOT / "configs" / "ablations" / "head_stage.yaml"),
             "--data.batch_size=8", "--steps", "3", "--warmup", "1"]
    result = main(["perf", *stage])
    assert result["context_memo_hit_rate"] == 1.0
    assert "steady state (100 %" in capsys.readouterr().out
    assert result["drafter"] > 0 and result["step_total"] > 0
    plain = main(["perf", *stage, "--model.context_memo_mb=0"])
    assert "context_memo_hit_rate" not in plain and plain["drafter"] > 0


def test_perf_times_the_step_fit_takes_its_optimizer_precision_and_clipping(tmp_path, capsys, monkeypatch):
    """perf timed AdamW in float32 whatever the config named (``model.optimizer: SGD``, ``trainer.precision:
    bf16-mixed``), and its JSON recorded the optimizer it had not run; the Trainer's gradient clipping was left out."""
    import json

    import torch

    from conftest import user_error

    seen: dict = {}
    real_autocast, real_clip = torch.autocast, torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.optim.SGD, "step", lambda self, *a, **k: seen.setdefault("sgd", True) and None)

    def autocast(device_type, dtype=None, **kwargs):
        seen.setdefault("autocast", dtype)
        return real_autocast(device_type, dtype=dtype, **kwargs)

    def clip(params, max_norm, *args, **kwargs):
        seen["clip"] = max_norm
        return real_clip(params, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch, "autocast", autocast)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    out = tmp_path / "perf.json"
    main(["perf", "-c", str(ROOT / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={tmp_path / 'run'}",
          "--model.optimizer=torch.optim.SGD", "--model.optimizer.init_args.lr=0.1", "--trainer.precision=bf16",
          "--trainer.gradient_clip_val=0.5", "--steps", "1", "--warmup", "0", "--json", str(out)])
    assert seen == {"sgd": True, "autocast": torch.bfloat16, "clip": 0.5}
    measured_with = json.loads(out.read_text())["measured_with"]
    assert (measured_with["precision"], measured_with["gradient_clip_val"]) == ("bf16-mixed", 0.5)
    assert measured_with["config"]["model"]["optimizer"]["class_path"] == "torch.optim.SGD"
    # A precision perf does not run a step in: one line, before the data are built.
    err = user_error(capsys, ["perf", "-c", str(ROOT / "configs" / "tiny.yaml"), "--trainer.precision=bf16-true",
                              f"--trainer.default_root_dir={tmp_path / 'other'}", "--steps", "1"])
    assert err.strip().endswith("error: trainer.precision bf16-true is not one lilicorr perf times a step in (it "
                                "times 32-true and bf16-mixed, on the CPU); time the step with "
                                "--trainer.precision=bf16-mixed or 32-true"), err
    assert not (tmp_path / "other" / "cache").exists()


def test_perf_penalty_error_refuses_offline_features_before_any_work(capsys):
    """Exact logits need the online target: with the feature store on, the check stops in one line, up front."""
    from conftest import user_error

    err = user_error(capsys, ["perf", "-c", str(ROOT / "configs" / "tiny.yaml"), "--penalty_error", "true",
                              "--data.feature_cache=true", "--steps", "1"])
    assert "data.feature_cache: true" in err and "--data.feature_cache=false" in err


def test_perf_penalty_error_records_the_batches_it_compared_not_steps(tmp_path):
    """--penalty_error compares at most an epoch's batches: asked for more, its JSON records the batches it read and
    the limit asked for, never a step count it did not run."""
    out = tmp_path / "penalty.json"
    result = main(["perf", "-c", str(ROOT / "configs" / "tiny.yaml"), "--penalty_error", "true",
                   "--data.feature_cache=false", "--steps", "500", "--json", str(out),
                   f"--trainer.default_root_dir={tmp_path / 'run'}"])
    record = json.loads(out.read_text())
    assert 0 < result["batches"] < 500
    assert record["batches"] == result["batches"]
    assert record["measured_with"]["batches"] == result["batches"]
    assert record["measured_with"]["max_batches"] == 500
    assert "steps" not in record["measured_with"]


def test_perf_builds_the_data_as_fit_does_and_penalty_error_needs_a_penalty(capsys):
    """Timing: the logit store exactly as `lilicorr fit` decides it (a config that reads exact logits online and turns
    the store off runs, as it trains). --penalty_error without a loss that reads target logits: one line, up front."""
    from conftest import user_error

    tiny = ["-c", str(ROOT / "configs" / "tiny.yaml")]
    result = main(["perf", *tiny, "--model.target_logits=exact", "--data.logit_cache=false",
                   "--data.feature_cache=false", "--steps", "1", "--warmup", "0"])
    assert result["step_total"] > 0
    err = user_error(capsys, ["perf", *tiny, "-c", str(ROOT / "configs" / "ablations" / "no_distractor.yaml"),
                              "--penalty_error", "true", "--data.feature_cache=false", "--steps", "1"])
    assert "no active loss in model.losses reads target logits" in err and "DistractorPenalty" in err
    err = user_error(capsys, ["perf", *tiny, "--penalty_error", "true", "--data.feature_cache=false",
                              "--data.logit_cache=false", "--steps", "1"])
    assert err.strip().endswith("data.logit_cache: false turns the store off; add --data.logit_cache=true")


def test_the_readmes_training_step_table_and_penalty_error_are_the_jsons_they_cite():
    """README.md's training-step table, row by row, against the `lilicorr perf --json` file its last cell links (the step
    in ms, each phase in ms with its share of the step), and the penalty-error row's numbers against its JSON: changing
    one digit, or a row without its source, fails."""
    import json
    import re

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("### Training step: where the time goes"):]
    table = next(block for block in section.split("\n\n") if block.startswith("| config | step ms"))
    rows = table.splitlines()[2:]
    assert len(rows) >= 3
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        source = re.fullmatch(r"\[[0-9a-f]{7}\]\((docs/measurements/perf/[\w.-]+\.json)\)", cells[-1])
        assert source, line
        result = json.loads((ROOT / source.group(1)).read_text(encoding="utf-8"))
        assert result["written_by"].startswith("lilicorr perf ") and result["measured_with"]["threads"] == 1
        step = result["step_total"] * 1000
        assert cells[1] == f"{step:.1f}", cells[0]
        for cell, phase in zip(cells[2:8], ("target", "drafter", "head", "losses", "backward", "optimizer")):
            ms = result[phase] * 1000
            assert cell == f"{ms:.1f} ({round(100 * ms / step)} %)", (cells[0], phase)

    row = next(line for line in readme.splitlines() if line.startswith("| penalty from the cache vs exact"))
    source = re.search(r"\[its JSON\]\((docs/measurements/perf/penalty-error-[0-9a-f]{7}\.json)\)", row)
    assert source, row
    result = json.loads((ROOT / source.group(1)).read_text(encoding="utf-8"))
    assert result["written_by"].startswith("lilicorr perf ") and result["batches"] == 8
    said = re.search(r"relative error \*\*([\d.]+) %\*\* at M = 32 \(exact ([\d.]+), cache ([\d.]+),", row)
    assert said.groups() == (f"{100 * result['relative_error']:.1f}", f"{result['penalty_exact']:.3f}",
                             f"{result['penalty_cache']:.3f}")
