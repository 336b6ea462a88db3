"""The shipped Qwen3 recipes are the published LiLiCorr recipe (DESIGN §5), setting for setting.

Read from the YAML files users pass to ``lilicorr fit``; the optimizer's betas are checked against Hugging Face
``TrainingArguments``' defaults, which the reference trainer (Model-Optimizer) uses because its recipe sets none.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RECIPES = [ROOT / "configs" / name for name in ("qwen3-8b", "qwen3-4b")]


def merged(*files: Path) -> dict:
    """Base plus overlays as ``lilicorr fit -c a -c b`` reads them: later mappings update earlier ones."""
    def update(into: dict, other: dict) -> dict:
        for key, value in other.items():
            into[key] = update(dict(into.get(key) or {}), value) if isinstance(value, dict) and \
                not {"class_path"} & set(value) else value
        return into

    out: dict = {}
    for f in files:
        update(out, yaml.safe_load(f.read_text()))
    return out


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_the_shared_training_contract_is_the_published_recipe(recipe):
    from transformers import TrainingArguments

    cfg = merged(recipe / "base.yaml")
    trainer, model, data = cfg["trainer"], cfg["model"], cfg["data"]
    assert trainer["precision"] == "bf16-mixed" and trainer["max_epochs"] == 6 and trainer["gradient_clip_val"] == 1.0
    assert model["drafter"]["init_args"]["block_size"] == 16 and model["num_anchors"] == 512
    assert data["max_length"] == 3072
    assert model["losses"] == [{"class_path": "lilicorr_pl.losses.DFlashCE", "init_args": {"weight": 1.0, "gamma": 7.0}}]
    optimizer = model["optimizer"]
    assert optimizer["class_path"] == "torch.optim.AdamW"
    args = optimizer["init_args"]
    assert args["lr"] == 6.0e-4 and args["weight_decay"] == 0.0
    defaults = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    assert tuple(args.get("betas", (0.9, 0.999))) == (defaults["adam_beta1"], defaults["adam_beta2"]) == (0.9, 0.999)
    assert args.get("eps", 1e-8) == defaults["adam_epsilon"]
    schedule = model["lr_scheduler"]
    assert schedule["class_path"] == "lilicorr_pl.optim.WarmupCosine"
    assert schedule["init_args"]["warmup_fraction"] == 0.04


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_the_lilicorr_arm_is_the_published_head_and_losses(recipe):
    cfg = merged(recipe / "base.yaml", recipe / "lilicorr.yaml")
    head = cfg["model"]["head"]
    assert head["class_path"] == "lilicorr_pl.heads.LiLiCorrHead"
    assert head["init_args"]["top_k"] == 8 and head["init_args"]["num_layers"] == 2
    assert head["init_args"]["logit_scale"] == 8.0 and head["init_args"]["decode"] == "greedy"
    weights = {loss["class_path"].rsplit(".", 1)[1]: loss["init_args"]["weight"] for loss in cfg["model"]["losses"]}
    assert weights == {"DFlashCE": 1.0, "OraclePrefixCE": 0.25, "MarginHinge": 0.0, "DistractorPenalty": 0.25}
