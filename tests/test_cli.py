"""`lilicorr fit -c configs/...`: every shipped config parses; the tiny run trains end to end."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from lilicorr_pl.cli import main

ROOT = Path(__file__).resolve().parents[1]
# Overlays (ablations, demo arms) are parsed on top of their base, below.
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if not {"ablations", "arms"} & set(p.parts))
ABLATIONS = sorted((ROOT / "configs" / "ablations").glob("*.yaml"))
DEMO_ARMS = sorted((ROOT / "configs" / "demo" / "arms").glob("*.yaml"))


def print_config(*configs: Path, extra: list[str] | None = None) -> dict:
    args = ["fit"]
    for c in configs:
        args += ["-c", str(c)]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit) as exit_info:
        main([*args, *(extra or []), "--print_config"])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(buf.getvalue())


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_shipped_config_parses(config):
    cfg = print_config(config)
    assert cfg["model"]["target"]["name_or_path"]
    # Linked values are set once (model.target -> data.target, data.max_length -> model.max_length).
    assert "target" not in cfg["data"] and "max_length" not in cfg["model"]


@pytest.mark.parametrize("overlay", DEMO_ARMS, ids=lambda p: p.stem)
def test_demo_base_with_each_arm_overlay_parses(overlay):
    cfg = print_config(ROOT / "configs" / "demo" / "base.yaml", overlay)
    head = cfg["model"]["head"]
    assert (head is None) == (overlay.stem == "dflash")
    if head is not None:
        assert overlay.stem in head["class_path"].lower()
    assert cfg["model"]["init_drafter_layers_from_target"] is True
    assert any("AcceptanceEval" in c["class_path"] for c in cfg["trainer"]["callbacks"])


@pytest.mark.parametrize("overlay", ABLATIONS, ids=lambda p: p.stem)
def test_tiny_config_with_each_ablation_overlay_parses(overlay):
    cfg = print_config(ROOT / "configs" / "tiny.yaml", overlay)
    model = cfg["model"]
    if overlay.stem == "no_distractor":
        assert model["disabled_losses"] == ["distractor_penalty"]
    if overlay.stem == "dflash_only":
        assert model["head"] is None
    if overlay.stem == "margin":
        assert model["loss_weights"] == {"oracle_prefix_ce": 0.125, "margin_hinge": 0.125}


def fit_tiny(tmp_path: Path, *extra: str, steps: int = 6) -> object:
    """Run the tiny config from inside ``tmp_path`` (its output paths are relative)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        return main([
            "fit", "-c", str(ROOT / "configs" / "tiny.yaml"), *extra,
            f"--trainer.max_steps={steps}", "--trainer.val_check_interval=3", "--trainer.limit_val_batches=1",
            "--trainer.enable_progress_bar=false",
        ])
    finally:
        os.chdir(cwd)


def test_tiny_fit_end_to_end_writes_a_checkpoint_without_the_target(tmp_path):
    cli = fit_tiny(tmp_path)
    ckpt = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    assert ckpt.is_file()
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert not any(k.startswith("target.") for k in state["state_dict"])
    assert any(k.startswith("drafter.layers.0.") for k in state["state_dict"])
    assert any(k.startswith("head.") for k in state["state_dict"])
    assert state["lilicorr"]["block_size"] == 8
    metrics = cli.trainer.callback_metrics
    for key in ("train/loss", "train/dflash_ce", "train/oracle_prefix_ce", "train/distractor_penalty", "val/loss"):
        assert key in metrics, key
    # The frozen target never trains.
    system = cli.model
    assert all(not p.requires_grad for p in system.target.parameters())
    assert all(p.grad is None for p in system.target.parameters())

    from lilicorr_pl.system import DraftSystem

    loaded = DraftSystem.load_from_checkpoint(ckpt, map_location="cpu")
    for key, value in system.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value)
    assert type(loaded.head).__name__ == "LiLiCorrHead"
    assert [l.name for l in loaded.losses] == [l.name for l in system.losses]

    # `lilicorr export` of the trained run: one LiLiCorrDraftModel directory that loads back identically.
    from lilicorr_pl.interop import load_drafter, load_head
    from lilicorr_pl.interop import main as export_main

    out = export_main(["--ckpt", str(ckpt), "--output", str(tmp_path / "served")])
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LiLiCorrDraftModel"]
    head, drafter = load_head(out), load_drafter(out)
    for ours, theirs in ((loaded.head, head), (loaded.drafter, drafter)):
        assert ours.state_dict().keys() == theirs.state_dict().keys()
        assert all(torch.equal(v, theirs.state_dict()[k]) for k, v in ours.state_dict().items())


def test_no_distractor_overlay_removes_the_term(tmp_path):
    from lilicorr_pl.system import DraftSystem

    cli = fit_tiny(tmp_path / "a", steps=1)
    base: DraftSystem = cli.model
    cli2 = fit_tiny(tmp_path / "b", "-c", str(ROOT / "configs" / "ablations" / "no_distractor.yaml"), steps=1)
    ablated: DraftSystem = cli2.model
    assert "train/distractor_penalty" in cli.trainer.callback_metrics
    assert "train/distractor_penalty" not in cli2.trainer.callback_metrics
    assert [l.name for l in ablated.losses] == [l.name for l in base.losses if l.name != "distractor_penalty"]
    assert not ablated.needs_target_logits and base.needs_target_logits  # nor is its logit cache computed


def test_tiny_loss_falls_over_fifty_steps(tmp_path):
    import csv

    fit_tiny(tmp_path, "--trainer.logger=lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir=csv",
             "--trainer.log_every_n_steps=1", "--trainer.val_check_interval=50", steps=50)
    rows = list(csv.DictReader(open(next((tmp_path / "csv").rglob("metrics.csv")))))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) >= 45
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.95 * first, (first, last)  # measured: 6.37 -> 5.71


def test_validate_and_predict_subcommands_run_on_a_trained_checkpoint(tmp_path):
    fit_tiny(tmp_path, steps=2)
    ckpt = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        cli = main(["validate", "-c", str(ROOT / "configs" / "tiny.yaml"), f"--ckpt_path={ckpt}",
                    "--trainer.enable_progress_bar=false"])
        assert "val/loss" in cli.trainer.callback_metrics
        cli = main(["predict", "-c", str(ROOT / "configs" / "tiny.yaml"), f"--ckpt_path={ckpt}",
                    "--trainer.enable_progress_bar=false", "--trainer.limit_predict_batches=1"])
    finally:
        os.chdir(cwd)
    out = cli.trainer.predict_loop.predictions
    assert out and {"top1_prefix", "oracle_prefix"} <= set(out[0])
    assert (out[0]["oracle_prefix"] >= out[0]["top1_prefix"]).all()  # the lattice contains top-1
