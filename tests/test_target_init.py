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


def test_what_the_targets_config_shows_is_checked_with_no_weight_read(tmp_path):
    """``check_target_layer_init``: the refusals above, from the config alone (a built-in target not yet built), and a
    target with a model class of its own read with its trust_remote_code."""
    import json

    from transformers import AutoConfig

    from lilicorr_pl.models.target_init import check_target_layer_init

    from pathlib import Path

    path = Path(save_tiny_target(tmp_path / "target", layers=6))
    (path / "model.safetensors").unlink()  # nothing but the config is read
    config = AutoConfig.from_pretrained(path)
    check_target_layer_init(DFlashDrafter(num_layers=2, block_size=4).build(config, [1, 3]))
    with pytest.raises(ValueError, match="drafter at the target's sizes"):
        check_target_layer_init(DFlashDrafter(num_layers=1, block_size=4, intermediate_size=16).build(config, [1, 3]))
    with pytest.raises(ValueError, match="only 6"):
        check_target_layer_init(DFlashDrafter(num_layers=7, block_size=4).build(config, [1]))
    # A model class of the target's own (auto_map), as --model.target.trust_remote_code lets the run load it.
    (path / "configuration_own.py").write_text("from transformers import Qwen3Config\n\n\n"
                                               "class OwnConfig(Qwen3Config):\n    model_type = 'qwen3'\n")
    (path / "modeling_own.py").write_text("from transformers import Qwen3ForCausalLM\n\nfrom .configuration_own import "
                                          "OwnConfig\n\n\nclass OwnForCausalLM(Qwen3ForCausalLM):\n"
                                          "    config_class = OwnConfig\n")
    saved = json.loads((path / "config.json").read_text())
    saved["auto_map"] = {"AutoConfig": "configuration_own.OwnConfig",
                         "AutoModelForCausalLM": "modeling_own.OwnForCausalLM"}
    (path / "config.json").write_text(json.dumps(saved))
    own = AutoConfig.from_pretrained(path, trust_remote_code=True)
    check_target_layer_init(DFlashDrafter(num_layers=2, block_size=4).build(own, [1, 3]), trust_remote_code=True)
