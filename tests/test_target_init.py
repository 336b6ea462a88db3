"""Drafter layers initialised from the target's top decoder layers (issue 9 lever)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lilicorr_pl.models.dflash import DFlashDrafter
from lilicorr_pl.models.target_init import init_drafter_from_target_layers
from conftest import save_tiny_target


def test_drafter_layer_i_starts_as_target_layer_L_minus_n_plus_i(tmp_path):
    path = save_tiny_target(tmp_path / "target", tie=False, layers=6)
    model = AutoModelForCausalLM.from_pretrained(path)
    drafter = DFlashDrafter(num_layers=2, block_size=4).build(model.config, [1, 3, 5])
    fc_before = drafter.fc.weight.clone()
    mapping = init_drafter_from_target_layers(drafter, path)
    assert mapping == {0: 4, 1: 5}
    target = model.state_dict()
    for i, j in mapping.items():
        for name, value in drafter.layers[i].state_dict().items():
            assert torch.equal(value, target[f"model.layers.{j}.{name}"]), (i, name)
    assert torch.equal(drafter.norm.weight, target["model.norm.weight"])
    assert torch.equal(drafter.fc.weight, fc_before)  # no counterpart in the target: untouched


def test_init_from_target_refuses_mismatched_sizes(tmp_path):
    path = save_tiny_target(tmp_path / "target", layers=6)
    model = AutoModelForCausalLM.from_pretrained(path)
    drafter = DFlashDrafter(num_layers=1, block_size=4, intermediate_size=16).build(model.config, [1, 3])
    with pytest.raises(ValueError, match="drafter at the target's sizes"):
        init_drafter_from_target_layers(drafter, path)
    with pytest.raises(ValueError, match="only 6"):
        init_drafter_from_target_layers(DFlashDrafter(num_layers=7, block_size=4).build(model.config, [1]), path)
