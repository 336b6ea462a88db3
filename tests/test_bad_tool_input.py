"""Bad values given to the tools (``bench``, ``demo``, ``perf``): each refused in one line naming the problem and the
fix, before any model loads. ``bench`` is given a ``--ckpt`` that is no checkpoint at all, so a refusal that came
only after the checkpoint (and the target) were read would name that instead."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import user_error

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "configs" / "qwen3-8b"
QWEN3_8B = RECIPES / "Qwen3-8B.config.json"


def bench_error(capsys, tmp_path: Path, *args: str) -> str:
    """``lilicorr bench`` with a placeholder checkpoint and one prompt file, plus ``args``; its one-line refusal."""
    ckpt = tmp_path / "last.ckpt"
    ckpt.write_bytes(b"not a checkpoint: reading it would be refused with another message")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n")
    options = dict(zip(args[::2], args[1::2]))
    argv = ["bench", "--ckpt", options.pop("--ckpt", str(ckpt)),
            "--benchmark", options.pop("--benchmark", str(prompts)),
            "--selectors", "top1", *(x for kv in options.items() for x in kv)]
    return user_error(capsys, argv)


@pytest.mark.parametrize("text", ["", "\n  \n\t\n"], ids=["no_bytes", "blank_lines"])
def test_bench_refuses_an_empty_prompt_file_before_the_checkpoint_is_read(capsys, tmp_path, text):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(text)
    err = bench_error(capsys, tmp_path, "--benchmark", str(empty))
    assert re.search(r"--benchmark: prompt file .*empty\.jsonl is empty; .*one JSON object per line", err), err


def test_bench_calls_an_existing_file_that_is_not_jsonl_by_what_it_is(capsys, tmp_path):
    array = tmp_path / "prompts.json"
    array.write_text(json.dumps([{"prompt": "def add(a, b):"}]))
    err = bench_error(capsys, tmp_path, "--benchmark", str(array))
    assert "unknown benchmark" not in err, err
    assert re.search(r"--benchmark .*prompts\.json is a file but not a \.jsonl one; pass a \.jsonl file with one JSON "
                     r"object per line", err), err


def test_bench_points_from_a_served_directorys_weights_file_to_the_folder(capsys, tmp_path):
    served = tmp_path / "drafter"
    served.mkdir()
    (served / "config.json").write_text(json.dumps({"architectures": ["LiLiCorrDraftModel"]}))
    (served / "model.safetensors").write_bytes(b"weights")
    weights = served / "model.safetensors"
    err = bench_error(capsys, tmp_path, "--ckpt", str(weights), "--target", str(tmp_path / "target"))
    assert f"--ckpt {weights} is the weights file of the served drafter directory {served}; pass the folder instead: " \
           f"--ckpt {served}" in err, err
    err = bench_error(capsys, tmp_path, "--ckpt", str(weights))  # no --target: the folder needs one too
    assert f"pass the folder instead: --ckpt {served} with --target" in err, err


def test_bench_calls_an_empty_temperature_list_empty(capsys, tmp_path):
    err = bench_error(capsys, tmp_path, "--temperature", "[]")
    assert "--temperature is empty; give one or more sampling temperatures, e.g. 0 or 0,1" in err, err


def test_demo_calls_an_empty_temperature_list_empty(capsys, tmp_path):
    err = user_error(capsys, ["demo", "--temperatures=[]", "--workdir", str(tmp_path / "demo")])
    assert "--temperatures is empty; give one or more sampling temperatures, e.g. 0 or 0,1" in err, err
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize("flag, fix", [("--output", "pass the file to write the results JSON into, or drop --output"),
                                       ("--plot", "pass the directory for the plots, or drop --plot")])
@pytest.mark.parametrize("value", ["", " "])
def test_bench_refuses_an_empty_output_path(capsys, tmp_path, flag, fix, value):
    err = bench_error(capsys, tmp_path, flag, value)
    assert f"{flag} is empty; {fix}" in err, err


def test_perf_refuses_an_empty_json_path(capsys, tmp_path):
    err = user_error(capsys, ["perf", "--cost-model", "-c", str(RECIPES / "base.yaml"), "-c",
                              str(RECIPES / "lilicorr.yaml"), "--target-config", str(QWEN3_8B), "--json", ""])
    assert "--json is empty; pass the file to write the numbers into, or drop --json" in err, err


def test_perf_says_why_a_target_config_could_not_be_read(capsys, tmp_path):
    config = tmp_path / "tc.json"
    config.write_text(json.dumps({"hidden_size": 4096}))  # no model_type
    err = user_error(capsys, ["perf", "--cost-model", "-c", str(RECIPES / "base.yaml"), "-c",
                              str(RECIPES / "lilicorr.yaml"), "--target-config", str(config)])
    assert f"could not read the target config {str(config)!r} (ValueError: Unrecognized model in {config}. Should " \
           "have a `model_type` key in its config.json.); pass --target-config with a config.json" in err, err
