"""Opening a checkpoint never runs code and never uses corrupted weights (issues 14 and 11.7).

A crafted ``.ckpt`` whose metadata holds a pickled object with a ``__reduce__`` payload must be refused
by every command that opens checkpoints, and the payload must never run (its marker file must not
exist). ``trust_remote_code`` is never taken from a checkpoint. A checkpoint whose bytes were flipped is
refused, not benchmarked.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import user_error
from helpers import make_tiny_target_dir, save_edited
from lilicorr_pl.allocator import policy as malloc_policy
from lilicorr_pl.checkpoint import CheckpointError, UserInputError, read_checkpoint, state_checksum
from lilicorr_pl.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]


class Payload:
    """Pickles to a call that creates ``marker``: what an attacker would put in a checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


@pytest.fixture()
def evil(tmp_path, tiny_run) -> tuple[Path, Path]:
    """A real checkpoint of the tiny run whose metadata also holds the payload."""
    _, good = tiny_run
    marker = tmp_path / "PWNED"
    state = torch.load(good, map_location="cpu", weights_only=True)
    state["lilicorr"]["note"] = Payload(marker)
    path = tmp_path / "evil.ckpt"
    torch.save(state, path)
    # The payload is real: a pickle-trusting load runs it (we check this on a throwaway copy).
    probe = tmp_path / "probe"
    probe.mkdir()
    torch.save({"x": Payload(probe / "ran")}, probe / "p.pt")
    torch.load(probe / "p.pt", weights_only=False)
    assert (probe / "ran").exists()
    return path, marker


def _resume_argv(tmp_path: Path, ckpt: Path | str, *extra: str) -> list[str]:
    return ["fit", "-c", str(ROOT / "configs" / "tiny.yaml"), f"--ckpt_path={ckpt}", *extra,
            f"--trainer.default_root_dir={tmp_path / 'runs' / 'tiny'}", "--trainer.max_steps=3",
            "--trainer.enable_progress_bar=false", "--trainer.val_check_interval=3", "--trainer.limit_val_batches=1"]


def _resume(tmp_path: Path, ckpt: Path | str, *extra: str) -> object:
    return cli_main(_resume_argv(tmp_path, ckpt, *extra))


class SystemPayload:
    def __reduce__(self):
        return (os.system, ("true",))


def test_reader_refuses_a_pickle_payload_with_one_line(evil, tmp_path):
    path, marker = evil
    with pytest.raises(CheckpointError, match="pickled objects that are not plain data") as err:
        read_checkpoint(path)
    assert "\n" not in str(err.value)
    # What was refused, named; not torch's advice to load it unsafely ("two options", in terminal bold codes).
    assert "could run code): Unsupported global: GLOBAL getattr was not an allowed global" in str(err.value)
    assert "\x1b" not in str(err.value) and "two options" not in str(err.value)
    # A blocked module (the usual payload, os.system): named the same way, without torch's weights_only advice.
    bad = tmp_path / "system.ckpt"
    torch.save({"state_dict": {}, "x": SystemPayload()}, bad)
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(bad)
    assert "could run code): Trying to load unsupported GLOBAL " in str(err.value) and "blocked" in str(err.value)
    assert "weights_only" not in str(err.value)
    # An opcode the loader does not run (torch puts the reason on a line of its own): named, never left blank.
    torch.save({"a": 1}, tmp_path / "plain.pt")
    with zipfile.ZipFile(tmp_path / "plain.pt") as zin, zipfile.ZipFile(tmp_path / "opcode.ckpt", "w") as zout:
        for item in zin.infolist():
            zout.writestr(item, b"\x80\x02\x82\x01." if item.filename.endswith("data.pkl") else zin.read(item.filename))
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(tmp_path / "opcode.ckpt")
    assert str(err.value).endswith("could run code): Unsupported operand 130")
    assert not marker.exists()


def test_bench_refuses_the_payload_before_it_runs(evil, capsys):
    path, marker = evil
    err = user_error(capsys, ["bench", "--ckpt", str(path), "--benchmark", "humaneval", "--num-prompts", "1",
                              "--max-new-tokens", "2"])
    assert "pickled objects" in err
    assert not marker.exists()


def test_export_refuses_the_payload_before_it_runs(evil, tmp_path, capsys):
    path, marker = evil
    assert "pickled objects" in user_error(capsys, ["export", "--ckpt", str(path), "--output", str(tmp_path / "out")])
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_perf_refuses_the_payload_before_building_anything(evil, capsys):
    path, marker = evil
    err = user_error(capsys, ["perf", "-c", str(ROOT / "configs" / "tiny.yaml"), "--ckpt", str(path), "--steps", "1"])
    assert "pickled objects" in err
    assert not marker.exists()


def test_fit_resume_refuses_the_payload(evil, tmp_path, capsys):
    path, marker = evil
    with pytest.raises(SystemExit) as exit_info:
        _resume(tmp_path, path)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "pickled objects" in err and "Traceback" not in err
    assert not marker.exists()


def test_warm_start_reads_only_safetensors(tmp_path):
    """A drafter directory whose weights come as a pickle (``pytorch_model.bin``) is refused unread."""
    from lilicorr_pl.interop import load_drafter

    marker = tmp_path / "PWNED"
    directory = tmp_path / "drafter"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"block_size": 4, "dflash_config": {"target_layer_ids": [1]}}))
    torch.save({"fc.weight": Payload(marker)}, directory / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_drafter(directory)
    assert not marker.exists()


def _with_target(tmp_path: Path, good: Path, **changes) -> Path:
    state = torch.load(good, map_location="cpu", weights_only=True)
    state["hyper_parameters"]["target"].update(changes)
    path = tmp_path / "remote.ckpt"
    save_edited(state, path)
    return path


def test_trust_remote_code_is_never_taken_from_a_checkpoint(tiny_run, tmp_path, capsys):
    from lilicorr_pl.system import DraftSystem

    _, good = tiny_run
    path = _with_target(tmp_path, good, trust_remote_code=True)
    with pytest.raises(CheckpointError, match="trust_remote_code.*--trust-remote-code"):
        DraftSystem.from_checkpoint(path)
    assert "--trust-remote-code" in user_error(capsys, ["bench", "--ckpt", str(path), "--num-prompts", "1",
                                                        "--max-new-tokens", "2"])
    assert "--trust-remote-code" in user_error(capsys, ["export", "--ckpt", str(path),
                                                        "--output", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
    # The user's own flag enables it, for this run only; a checkpoint without it never turns it on.
    assert DraftSystem.from_checkpoint(path, trust_remote_code=True).target_spec.trust_remote_code is True
    assert DraftSystem.from_checkpoint(good).target_spec.trust_remote_code is False


def test_target_load_options_that_fetch_code_are_never_taken_from_a_checkpoint(tiny_run, tmp_path, capsys):
    """``model.target.load_kwargs`` went from a checkpoint to ``from_pretrained`` unread: an ``attn_implementation``
    naming a hub repository (with ``allow_all_kernels``) has transformers download and load that repository's compiled
    kernel, a second way to run a stranger's code beside trust_remote_code, refused the same way."""
    from lilicorr_pl.system import DraftSystem

    _, good = tiny_run
    path = _with_target(tmp_path, good, load_kwargs={"attn_implementation": "attacker-org/evil-kernel",
                                                     "allow_all_kernels": True})
    line = ("loads its target with options that fetch and run code from elsewhere (model.target.load_kwargs: "
            "allow_all_kernels, attn_implementation: attacker-org/evil-kernel); code is never loaded on a checkpoint's "
            "word: pass --trust-remote-code if you trust it")
    with pytest.raises(CheckpointError, match=re.escape(line)):
        DraftSystem.from_checkpoint(path, load_target=False)
    err = user_error(capsys, ["bench", "--ckpt", str(path), "--num-prompts", "1", "--max-new-tokens", "2"])
    assert line in err and "not available in the local cache" not in err, err
    # The user's own flag takes them; the options transformers implements itself are data.
    assert DraftSystem.from_checkpoint(path, trust_remote_code=True, load_target=False) is not None
    for options in ({"attn_implementation": "sdpa"}, {"use_kernels": False, "low_cpu_mem_usage": True}):
        plain = _with_target(tmp_path, good, load_kwargs=options)
        assert DraftSystem.from_checkpoint(plain, load_target=False).target_spec.load_kwargs == options


def test_components_outside_trusted_packages_are_not_imported(tiny_run, tmp_path):
    """Naming a module in class_path makes jsonargparse import it (running its code): refused."""
    from lilicorr_pl.system import DraftSystem

    _, good = tiny_run
    state = torch.load(good, map_location="cpu", weights_only=True)
    state["hyper_parameters"]["head"]["class_path"] = "antigravity.Head"
    path = tmp_path / "foreign.ckpt"
    save_edited(state, path)
    with pytest.raises(CheckpointError, match="outside the trusted packages.*antigravity"):
        DraftSystem.from_checkpoint(path)


@pytest.mark.parametrize("edit, named", [
    # A string under a callable's argument: jsonargparse imports it (the module `this` printed the Zen of Python).
    (lambda h: h.update(lr_scheduler={"class_path": "torch.optim.lr_scheduler.LambdaLR",
                                      "init_args": {"lr_lambda": "antigravity.fly"}}), "antigravity.fly"),
    # A component given as a bare class path, without class_path: imported the same way.
    (lambda h: h.update(head="antigravity.Head"), "antigravity.Head"),
])
def test_every_name_jsonargparse_would_import_is_checked_not_only_class_paths(tiny_run, tmp_path, capsys, edit,
                                                                              named):
    """Only ``class_path`` values were checked: a checkpoint naming a module anywhere else had it imported (its code
    run) by export, bench and ``from_checkpoint``, under a trusted class."""
    import sys

    from lilicorr_pl.system import DraftSystem

    _, good = tiny_run
    state = torch.load(good, map_location="cpu", weights_only=True)
    edit(state["hyper_parameters"])
    path = tmp_path / "foreign.ckpt"
    save_edited(state, path)
    sys.modules.pop("antigravity", None)
    with pytest.raises(CheckpointError, match=f"outside the trusted packages: \\['{named}'\\]"):
        DraftSystem.from_checkpoint(path, load_target=False)
    err = user_error(capsys, ["export", "--ckpt", str(path), "--output", str(tmp_path / "out")])
    assert f"outside the trusted packages: ['{named}']" in err, err
    assert "antigravity" not in sys.modules and not (tmp_path / "out").exists()
    # Plain data with dots is not a name: the target's folder, a model's hub id.
    from lilicorr_pl.checkpoint import check_class_paths

    check_class_paths({"target": {"name_or_path": "models.v2"}, "head": {"class_path": "lilicorr_pl.heads.Top1Selector",
                                                                        "init_args": {"decode": "greedy"}}}, path)
    # ... nor is a loss's log name, free text (``ce.v2``), named there or in disabled_losses.
    check_class_paths({"losses": [{"class_path": "lilicorr_pl.losses.DFlashCE", "init_args": {"name": "ce.v2"}}],
                       "disabled_losses": ["ce.v2"]}, path)
    with pytest.raises(CheckpointError, match="antigravity"):  # a component under a key called name is still one
        check_class_paths({"head": {"init_args": {"name": {"class_path": "antigravity.Fly"}}}}, path)


def test_a_changed_byte_in_a_checkpoints_records_is_refused_like_one_in_its_weights(tiny_run, tmp_path, capsys):
    """The checksum covered the weights alone: a byte flipped in the records (the target's layer ids) passed, and the
    export told an engine to feed the drafter other layers ([1, 3] for the [1, 2] it trained on)."""
    _, good = tiny_run
    data = bytearray(good.read_bytes())
    at = data.find(b"layer_ids")
    second = data.find(b"K\x02", at)  # pickle's BININT1 2: the second layer id
    assert at > 0 and 0 < second - at < 30
    data[second + 1] = 3
    flipped = tmp_path / "flipped.ckpt"
    flipped.write_bytes(bytes(data))
    recorded = torch.load(flipped, map_location="cpu", weights_only=True)["hyper_parameters"]["target"]["layer_ids"]
    assert recorded == [1, 3]
    message = "its recorded settings (hyper-parameters, data settings or training record"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        read_checkpoint(flipped)
    for argv in (["export", "--ckpt", str(flipped), "--output", str(tmp_path / "out")],
                 ["bench", "--ckpt", str(flipped), "--num-prompts", "1", "--max-new-tokens", "2"]):
        err = user_error(capsys, argv)
        assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit):
        _resume(tmp_path, flipped)
    assert message in capsys.readouterr().err
    # An edit through torch (the checksum left as it was) is refused the same way; the record as written is read.
    state = torch.load(good, map_location="cpu", weights_only=True)
    state["lilicorr"]["block_size"] = 4
    torch.save(state, tmp_path / "edited.ckpt")
    with pytest.raises(CheckpointError, match=re.escape(message)):
        read_checkpoint(tmp_path / "edited.ckpt")
    assert read_checkpoint(good)["lilicorr"]["block_size"] == 8


def test_a_changed_training_state_is_refused_by_a_resume_and_left_to_what_reads_only_weights(tiny_run, tmp_path,
                                                                                            capsys):
    """The checksums covered the weights and the records: Adam's moments, the loops' and the loader's positions and
    the random streams were not, and a resume went on from a changed optimizer state without a word. A resume now
    checks them; bench and export, which read the weights and records alone, still take the file."""
    from lilicorr_pl.checkpoint import TRAINING_CHECKSUM_KEY, training_state_checksum

    _, good = tiny_run
    state = torch.load(good, map_location="cpu", weights_only=True)
    recorded = state["lilicorr"][TRAINING_CHECKSUM_KEY]
    assert training_state_checksum(state) == recorded  # the same before the save and after a weights-only load
    assert {"optimizer_states", "loops", "callbacks", "rng_states"} <= set(state)
    moments = state["optimizer_states"][0]["state"][0]["exp_avg"]
    moments.view(-1)[0] = moments.view(-1)[0] * 4 + 1  # a changed moment, every recorded checksum kept
    bad = tmp_path / "moments.ckpt"
    torch.save(state, bad)
    assert training_state_checksum(torch.load(bad, weights_only=True)) != recorded
    read_checkpoint(bad)  # the weights and records: as saved
    message = (f"checkpoint {bad} is corrupted: its training state (the optimizer's moments, the loops', callbacks' "
               "and data loader's positions, the random streams) does not match the checksum recorded when it was "
               "saved; resume from another checkpoint, or export its weights")
    with pytest.raises(SystemExit) as exit_info:
        _resume(tmp_path, bad)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and "Traceback" not in err
    cli_main(["export", "--ckpt", str(bad), "--output", str(tmp_path / "exported")])  # the weights: still good
    assert (tmp_path / "exported" / "model.safetensors").is_file()
    for key, edit in (("global_step", lambda st: st.update(global_step=st["global_step"] + 1)),
                      ("rng_states", lambda st: st["rng_states"][0]["python"].update(gauss_next=0.5))):
        state = torch.load(good, map_location="cpu", weights_only=True)
        edit(state)
        torch.save(state, tmp_path / f"{key}.ckpt")
        with pytest.raises(SystemExit):
            _resume(tmp_path, tmp_path / f"{key}.ckpt")
        assert message.replace(str(bad), str(tmp_path / f"{key}.ckpt")) in capsys.readouterr().err, key
    # A strategy that keeps the optimizer's state outside the file (FSDP's sharded form) leaves it unchecked: its
    # entries are not in the file, which is not corrupted for that (it was called so).
    from lilicorr_pl.checkpoint import verify_training_state

    state = torch.load(good, map_location="cpu", weights_only=True)
    assert "optimizer_states" in state["lilicorr"]["training_state_keys"]
    del state["optimizer_states"]
    verify_training_state(state)
    # A lilicorr record of another form: one line, where it was an AttributeError.
    state = torch.load(good, map_location="cpu", weights_only=True)
    state["lilicorr"] = [state["lilicorr"]]
    torch.save(state, tmp_path / "listed.ckpt")
    with pytest.raises(CheckpointError, match=r"listed.ckpt is not a lilicorr fit checkpoint: its lilicorr record is a "
                                              r"list, not a mapping; pass a .ckpt that lilicorr fit wrote$"):
        read_checkpoint(tmp_path / "listed.ckpt")


def test_the_training_state_checksum_reads_a_set_alike_in_every_process():
    """A set's repr orders its strings by the process's string hashing (PYTHONHASHSEED): a callback state holding one
    would have read as corrupted when another process resumed it."""
    import subprocess
    import sys

    code = ("from lilicorr_pl.checkpoint import training_state_checksum as c; "
            "print(c({'callbacks': {'Cb': {'seen': {'alpha', 'beta', 'gamma', 'delta', 'epsilon'}}}, 'epoch': 1}))")
    sums = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                           capture_output=True, text=True, check=True).stdout for seed in ("1", "2", "3")}
    assert len(sums) == 1


def test_an_instantiator_other_than_lightnings_is_refused_unimported(tiny_run, tmp_path):
    """The checkpoint's ``_instantiator`` is imported by Lightning when it rebuilds the system: only its own."""
    from lilicorr_pl.system import DraftSystem

    _, good = tiny_run
    state = torch.load(good, map_location="cpu", weights_only=True)
    state["hyper_parameters"]["_instantiator"] = "antigravity.fly"
    path = tmp_path / "instantiator.ckpt"
    save_edited(state, path)
    with pytest.raises(CheckpointError, match="unknown instantiator 'antigravity.fly'"):
        DraftSystem.from_checkpoint(path)


def test_perf_takes_foreign_component_names_only_when_allowed(tiny_run, tmp_path, capsys):
    """``perf --ckpt`` refuses a checkpoint naming a package outside the trusted ones, as bench and export do, and
    takes it with the user's ``--allow_module`` (perf builds from the -c files: the named module is never imported)."""
    _, good = tiny_run
    state = torch.load(good, map_location="cpu", weights_only=True)
    state["hyper_parameters"]["head"]["class_path"] = "no_such_heads_pkg.Head"
    path = tmp_path / "foreign.ckpt"
    save_edited(state, path)
    args = ["perf", "-c", str(ROOT / "configs" / "tiny.yaml"), "--ckpt", str(path), "--steps", "1", "--warmup", "0"]
    err = user_error(capsys, args)
    assert "outside the trusted packages" in err and "no_such_heads_pkg" in err and "--allow-module" in err
    out = tmp_path / "perf.json"
    numbers = cli_main([*args, "--allow-module", "no_such_heads_pkg", "--json", str(out), "--threads", "1"])
    assert numbers["step_total"] > 0  # timed a real step with the checkpoint's weights
    # ... and the JSON says with what (it held the phase times alone).
    measured_with = json.loads(out.read_text())["measured_with"]
    config = measured_with.pop("config")
    assert measured_with == {
        "ckpt": str(path), "state_sha256": state["lilicorr"]["state_sha256"], "steps": 1, "threads": 1, "warmup": 0,
        "malloc": malloc_policy(), "device": "cpu", "precision": "32-true", "gradient_clip_val": 1.0,
        "gradient_clip_algorithm": None}
    # ... and with which settings: two files of other configs could not be told apart.
    assert config["model"]["num_anchors"] == 32 and config["data"]["max_length"] == 64
    assert config["model"]["drafter"]["init_args"]["block_size"] == 8 and config["model"]["target"]["name_or_path"]
    # --ckpt beside the round reports, which time fresh weights, was ignored without a word.
    err = user_error(capsys, ["perf", "-c", str(ROOT / "configs" / "tiny.yaml"), "--cost_model", "true", "--ckpt",
                              str(path)])
    assert "--ckpt is not read by --cost_model, which times the config's shapes with fresh weights; drop --ckpt" in err


def test_perf_refuses_a_checkpoint_of_another_config_before_building_any_data(tiny_run, tmp_path, capsys,
                                                                              monkeypatch):
    """A LiLiCorr checkpoint timed under a config without the head failed with a traceback after the data stores were
    built (`load_state_dict`: unexpected keys)."""
    import lilicorr_pl.data.datamodule as datamodule

    _, good = tiny_run
    built = []
    monkeypatch.setattr(datamodule.DraftDataModule, "prepare_data", lambda self: built.append(1))
    err = user_error(capsys, ["perf", "-c", str(ROOT / "configs" / "tiny.yaml"), "-c",
                              str(ROOT / "configs" / "ablations" / "dflash_only.yaml"), "--ckpt", str(good), "--steps", "1"])
    assert f"--ckpt {good} does not fit the system the -c files build (" in err and "unexpected" in err
    assert err.strip().endswith("pass the -c files of the run that trained it") and not built


def test_validate_and_resume_trust_the_components_their_own_config_names(tiny_run, tmp_path, capsys):
    """A run trained with the user's own head (a module outside the trusted packages) can be validated and resumed:
    the run's own config names that module, which the run imports anyway. A config that does not name it gets the
    fix these commands have (no --allow-module)."""
    from helpers import RenamedLiLiCorrHead

    _, good = tiny_run
    state = torch.load(good, map_location="cpu", weights_only=True)
    state["hyper_parameters"]["head"]["class_path"] = "helpers.RenamedLiLiCorrHead"
    path = tmp_path / "custom.ckpt"
    save_edited(state, path)
    base = ["validate", "-c", str(ROOT / "configs" / "tiny.yaml"), f"--ckpt_path={path}",
            f"--trainer.default_root_dir={tmp_path / 'runs'}", "--trainer.enable_progress_bar=false",
            "--trainer.limit_val_batches=1"]
    err = user_error(capsys, base)
    assert "helpers.RenamedLiLiCorrHead" in err and "this run's config" in err and "--allow-module" not in err
    cli = cli_main([*base, "--model.head.class_path=helpers.RenamedLiLiCorrHead"])
    assert type(cli.model.head) is RenamedLiLiCorrHead and "val/loss" in cli.trainer.callback_metrics
    # fit --ckpt_path runs the same check, with the same fix.
    assert "this run's config" in user_error(capsys, ["fit", *base[1:]])


def test_bench_and_export_take_the_target_from_where_it_is_on_this_machine(tiny_run, tmp_path, capsys, monkeypatch):
    """A checkpoint trained elsewhere records that machine's target directory: bench and export refuse it with one
    line naming --target (before loading anything), and run with the same model from where it is here."""
    _, good = tiny_run
    state = torch.load(good, map_location="cpu", weights_only=True)
    here = state["hyper_parameters"]["target"]["name_or_path"]
    state["hyper_parameters"]["target"]["name_or_path"] = str(tmp_path / "elsewhere" / "target")
    moved = tmp_path / "moved.ckpt"
    save_edited(state, moved)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):\n"}) + "\n")
    bench = ["bench", "--ckpt", str(moved), "--benchmark", str(prompts), "--num-prompts", "1", "--max-new-tokens", "3",
             "--selectors", "top1", "--temperature", "0", "--chat-template", "no"]
    err = user_error(capsys, bench)
    assert "elsewhere" in err and "--target" in err
    # A --target that is not there either names --target, not the checkpoint.
    err = user_error(capsys, [*bench, "--target", str(tmp_path / "typo")])
    assert f"--target {tmp_path / 'typo'} is not a directory" in err
    assert "--target: unknown built-in target 'builtin:nope'" in user_error(capsys, [*bench, "--target", "builtin:nope"])
    # Another model, or a folder that is no model: one line naming --target, not a traceback about the head's config.
    other = Path(make_tiny_target_dir(tmp_path, hidden=32, name="other-model"))
    hidden = json.loads((Path(here) / "config.json").read_text())["hidden_size"]
    err = user_error(capsys, [*bench, "--target", str(other)])
    assert (f"was trained on a target of hidden size {hidden}, and --target {other} has hidden size 32; pass the target "
            "model it was trained with (--target)") in err
    (tmp_path / "empty").mkdir()
    for command in (bench, ["export", "--ckpt", str(moved), "--output", str(tmp_path / "never")]):
        err = user_error(capsys, [*command, "--target", str(tmp_path / "empty")])
        assert f"cannot be rebuilt with --target {tmp_path / 'empty'} (" in err and "(--target)" in err
    assert not (tmp_path / "never").exists()
    monkeypatch.setenv("HOME", str(tmp_path))  # "~" is expanded here: transformers would not
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "target").symlink_to(here)
    runs = cli_main([*bench, "--target", "~/models/target"])
    assert runs[0]["selectors"]["top1"]["lossless"] is True
    # A checkpoint trained on Windows records a path that is not a hub id either: refused with the same line.
    state["hyper_parameters"]["target"]["name_or_path"] = "C:\\Users\\me\\target"
    save_edited(state, tmp_path / "windows.ckpt")
    err = user_error(capsys, [*bench[:2], str(tmp_path / "windows.ckpt"), *bench[3:]])
    assert "C:\\Users\\me\\target" in err and "--target" in err
    out = tmp_path / "exported"
    assert "--target" in user_error(capsys, ["export", "--ckpt", str(moved), "--output", str(out)])
    assert not out.exists()
    cli_main(["export", "--ckpt", str(moved), "--output", str(out), "--target", "builtin:tiny"])  # as fit named it
    assert (out / "model.safetensors").is_file()


def _flip_bytes_in_largest_tensor(src: Path, dst: Path, count: int = 400) -> None:
    shutil.copyfile(src, dst)
    with zipfile.ZipFile(dst) as zf:
        info = max((i for i in zf.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
        with open(dst, "rb") as fh:
            fh.seek(info.header_offset + 26)
            name_len, extra_len = int.from_bytes(fh.read(2), "little"), int.from_bytes(fh.read(2), "little")
    start = info.header_offset + 30 + name_len + extra_len + info.file_size // 3
    with open(dst, "r+b") as fh:
        fh.seek(start)
        data = bytearray(fh.read(count))
        fh.seek(start)
        fh.write(bytes(b ^ 0x5A for b in data))


def test_flipped_bytes_are_refused_by_bench_export_and_resume(tiny_run, tmp_path, capsys):
    import re

    _, good = tiny_run
    bad = tmp_path / "flipped.ckpt"
    _flip_bytes_in_largest_tensor(good, bad)
    with pytest.raises(CheckpointError, match="corrupted|truncated"):
        read_checkpoint(bad)
    assert re.search("corrupted|truncated",
                     user_error(capsys, ["bench", "--ckpt", str(bad), "--num-prompts", "1", "--max-new-tokens", "2"]))
    assert re.search("corrupted|truncated",
                     user_error(capsys, ["export", "--ckpt", str(bad), "--output", str(tmp_path / "out")]))
    with pytest.raises(SystemExit) as exit_info:
        _resume(tmp_path, bad)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert ("corrupted" in err or "truncated" in err) and "Traceback" not in err


def test_changed_weights_are_refused_before_the_target_loads_and_good_ones_hashed_once(tiny_run, tmp_path, capsys,
                                                                                       monkeypatch):
    """Lightning builds the model (configure_model: the target's weights) before on_load_checkpoint sees the
    checkpoint, so changed weights were refused only after the target had loaded, with "nothing was loaded". Each
    command now verifies the file when it first opens it, and the second look does not hash the weights again;
    export, which writes the drafter and head, does not load the target at all."""
    import lilicorr_pl.checkpoint as checkpoint_module
    from lilicorr_pl.target import FrozenTarget

    cli, good = tiny_run
    state = torch.load(good, map_location="cpu", weights_only=True)
    key = next(k for k, v in state["state_dict"].items() if k.startswith("drafter.") and v.is_floating_point())
    state["state_dict"][key] = state["state_dict"][key] + 1.0  # the recorded checksum kept: changed weights
    bad = tmp_path / "changed.ckpt"
    save_edited(state, bad)
    loads = []
    real_load = FrozenTarget.from_pretrained.__func__
    monkeypatch.setattr(FrozenTarget, "from_pretrained",
                        classmethod(lambda cls, *a, **k: loads.append(a) or real_load(cls, *a, **k)))
    corrupted = f"checkpoint {bad} is corrupted: its weights do not match the checksum recorded when it was saved"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):"}) + "\n")
    bench = ["bench", "--benchmark", str(prompts), "--num-prompts", "1", "--max-new-tokens", "2", "--selectors",
             "top1", "--chat-template", "no"]
    for argv in ([*bench, "--ckpt", str(bad)], ["export", "--ckpt", str(bad), "--output", str(tmp_path / "out")],
                 _resume_argv(tmp_path, bad)):
        assert corrupted in user_error(capsys, argv), argv[0]
    assert loads == []
    hashed = []
    real_checksum = checkpoint_module.state_checksum
    monkeypatch.setattr(checkpoint_module, "state_checksum", lambda sd: hashed.append(1) or real_checksum(sd))
    cli_main([*bench, "--ckpt", str(good)])
    assert len(loads) == 1 and len(hashed) == 1
    cli_main(["export", "--ckpt", str(good), "--output", str(tmp_path / "exported")])  # the drafter and head only:
    assert len(loads) == 1 and len(hashed) == 2  # the target's weights are not read
    with pytest.raises(CheckpointError, match="corrupted"):  # outside a command's first look: verified as before
        type(cli.model).load_from_checkpoint(bad, map_location="cpu")


def test_the_second_look_is_spared_only_for_the_file_verified_and_unchanged_since(tiny_run, tmp_path):
    from lilicorr_pl.checkpoint import read_verified, verified_first, verify_checksum

    _, good = tiny_run
    copy = tmp_path / "copy.ckpt"
    shutil.copy(good, copy)
    checkpoint, first = read_verified(copy)
    changed = {**checkpoint, "state_dict": {k: v + 1 if v.is_floating_point() else v
                                            for k, v in checkpoint["state_dict"].items()}}
    with pytest.raises(CheckpointError, match="corrupted"):
        verify_checksum(changed)  # outside the block: hashed
    with verified_first(first):
        verify_checksum(changed)  # the file verified, unchanged: not hashed again (this dict stands in for its read)
        os.utime(copy, ns=(0, 0))  # the file changed since it was verified: hashed again
        with pytest.raises(CheckpointError, match="corrupted"):
            verify_checksum(changed)


def test_bench_refuses_options_before_reading_the_targets_weight_files(tiny_run, tmp_path, capsys, monkeypatch):
    """The check that the target is the one the drafter trained against reads every weight file whole (tens of GB)
    the first time: it ran before --selectors was checked, and for export, which does not load the target."""
    import sys

    fingerprint_module = sys.modules["lilicorr_pl.data.fingerprint"]
    monkeypatch.setenv("LILICORR_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(fingerprint_module, "_digests", {})
    reads = []
    real = fingerprint_module.file_sha256
    monkeypatch.setattr(fingerprint_module, "file_sha256", lambda p, *a: reads.append(Path(p).name) or real(p, *a))
    _, good = tiny_run
    err = user_error(capsys, ["bench", "--ckpt", str(good), "--selectors", "top1,domino", "--num-prompts", "1"])
    assert "selector 'domino' is not available in this checkpoint" in err and reads == []


def test_tensors_its_own_config_does_not_build_are_not_blamed_on_the_target(tiny_run, tmp_path, capsys):
    """A checkpoint whose tensor names are not those of the config it records (edited, another version) was told to
    pass its target with --target, which no target can fix (a target changes sizes, not names)."""
    _, good = tiny_run
    state = torch.load(good, map_location="cpu", weights_only=True)
    key = next(k for k in state["state_dict"] if k.startswith("drafter."))
    state["state_dict"][key.replace("drafter.", "drafter.renamed_", 1)] = state["state_dict"].pop(key)
    state["lilicorr"]["state_sha256"] = state_checksum(state["state_dict"])  # intact, as written
    odd = tmp_path / "odd.ckpt"
    save_edited(state, odd)
    err = user_error(capsys, ["export", "--ckpt", str(odd), "--output", str(tmp_path / "out")])
    assert f"checkpoint {odd} holds tensors that the drafter/head config it records does not build (missing " in err
    assert err.strip().endswith("it was edited, or written by another version of lilicorr_pl: use a checkpoint "
                                "`lilicorr fit` wrote with this version")
    assert "--target" not in err


def test_truncated_and_empty_checkpoints_get_one_line(tiny_run, tmp_path):
    _, good = tiny_run
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty"):
        read_checkpoint(empty)
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated") as err:
        read_checkpoint(cut)
    assert "\n" not in str(err.value)


def test_the_recorded_checksum_covers_the_saved_weights(tiny_run):
    _, good = tiny_run
    state = read_checkpoint(good)  # verifies
    assert state["lilicorr"]["state_sha256"] == state_checksum(state["state_dict"])
    changed = dict(state["state_dict"])
    key = next(k for k, v in changed.items() if v.is_floating_point() and v.numel() > 1)
    changed[key] = changed[key].clone()
    changed[key].view(-1)[0] += 1.0
    assert state_checksum(changed) != state["lilicorr"]["state_sha256"]


def test_resume_never_silently_takes_the_checkpoints_settings(tiny_run, tmp_path, capsys):
    """Issue 11.3: LightningCLI loaded the checkpoint's hyperparameters over the command line."""
    _, good = tiny_run
    # A different head: the weights would mean something else -> refused, naming the key, before any work.
    with pytest.raises(SystemExit) as exit_info:
        _resume(tmp_path, good, "--model.head.init_args.top_k=3")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "cannot resume" in err and "model.head" in err and "Traceback" not in err
    # The field that differs, not the head's whole config cut at 160 characters (which could end before it).
    assert "model.head.init_args.top_k: checkpoint 4 vs now 3" in err, err
    # An invalid value is rejected with one line.
    with pytest.raises(SystemExit):
        _resume(tmp_path, good, "--model.num_anchors=0")
    assert "num_anchors must be >= 1, got 0" in capsys.readouterr().err
    # A training setting: applied (not the checkpoint's 32) and announced.
    cli = _resume(tmp_path, good, "--model.num_anchors=16")
    assert cli.model.num_anchors == 16 and cli.trainer.global_step == 3
    assert "model.num_anchors: 32 -> 16" in capsys.readouterr().out
    # The drafter's attention kernel is how it computes, not what (validate already took it): applied and listed,
    # where it was refused as "other drafter settings" (a run pinned to flex could not move to a machine without it).
    shutil.rmtree(tmp_path / "runs")
    cli = _resume(tmp_path, good, "--model.drafter.init_args.attention=sdpa")
    assert cli.model.drafter.attention == "sdpa" and cli.trainer.global_step == 3
    assert "model.drafter: " in capsys.readouterr().out


def test_a_resume_refuses_a_drafter_or_head_of_other_settings_not_another_attention_kernel():
    from lilicorr_pl.system import check_resume_settings

    drafter = {"class_path": "lilicorr_pl.models.DFlashDrafter", "init_args": {"num_layers": 2, "attention": "auto"}}
    saved = {"drafter": drafter, "num_anchors": 32}
    other_kernel = {"drafter": {**drafter, "init_args": {"num_layers": 2, "attention": "flex"}}, "num_anchors": 32}
    changes = check_resume_settings(saved, other_kernel)  # applied, and listed
    assert len(changes) == 1 and changes[0].startswith("model.drafter: ") and "flex" in changes[0], changes
    with pytest.raises(CheckpointError, match="model.drafter.init_args.num_layers: checkpoint 2 vs now 3"):
        check_resume_settings(saved, {"drafter": {**drafter, "init_args": {"num_layers": 3, "attention": "flex"}}})


@pytest.mark.parametrize("case, message", [
    ("missing_target", "neither a local model directory nor a reachable hub model"),
    ("gpt2_target", "supports decoder-only Llama/Qwen-style targets"),
    ("block_over_length", "block_size 80 exceeds data.max_length 64"),
])
def test_bad_settings_get_one_line_before_any_cache_is_built(tmp_path, capsys, case, message):
    """Issue 11.8: validation errors while objects are built print one line (rc 2), not a traceback."""
    extra = {"missing_target": [f"--model.target.name_or_path={tmp_path / 'nope'}"],
             "block_over_length": ["--model.drafter.init_args.block_size=80"]}.get(case, [])
    if case == "gpt2_target":
        from transformers import GPT2Config, GPT2LMHeadModel

        GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(tmp_path / "gpt2")
        extra = [f"--model.target.name_or_path={tmp_path / 'gpt2'}"]
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "-c", str(ROOT / "configs" / "tiny.yaml"), *extra, "--trainer.max_steps=1",
                  f"--trainer.default_root_dir={tmp_path / 'runs' / 'tiny'}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "runs" / "tiny" / "cache").exists()


def _modules_in(value) -> list[str]:
    """Paths of nn.Module objects inside a (nested) hyperparameter value."""
    if isinstance(value, torch.nn.Module):
        return [type(value).__name__]
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    return [f"{k}.{m}" for k, v in items for m in _modules_in(v)]


def test_hyperparameters_hold_configs_never_the_injected_modules(tiny_run, tmp_path):
    """Issue 12.5: every load warned that `drafter` and `head` were saved twice (as hparams and as weights)."""
    import warnings

    from conftest import save_tiny_target
    from lilicorr_pl.heads import LiLiCorrHead
    from lilicorr_pl.models import DFlashDrafter
    from lilicorr_pl.system import DraftSystem

    _, good = tiny_run
    saved = read_checkpoint(good)["hyper_parameters"]
    assert saved["drafter"]["class_path"] == "lilicorr_pl.models.DFlashDrafter"
    assert saved["head"]["init_args"]["top_k"] == 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = DraftSystem.from_checkpoint(good)
    assert not [str(w.message) for w in caught if "nn.Module" in str(w.message)]
    hparams = dict(loaded.hparams)
    assert not _modules_in(hparams)
    # The loaded system records the same rebuildable configs, so a checkpoint it writes loads the same way.
    for key in ("drafter", "head", "losses", "optimizer"):
        assert hparams[key] == saved[key], key
    assert hparams["init_drafter_from"] is None and "_instantiator" in hparams
    # Built in Python: the modules stay out of the hyperparameters (Lightning's advice), with no warning.
    target = save_tiny_target(tmp_path / "target", layers=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        system = DraftSystem({"name_or_path": target, "layer_ids": [1, 2]}, DFlashDrafter(num_layers=1, block_size=4),
                             head=LiLiCorrHead(top_k=2, hidden_size=16, num_layers=1, num_heads=2, factor_dim=16))
    assert not [str(w.message) for w in caught if "nn.Module" in str(w.message)]
    assert not _modules_in(dict(system.hparams)) and "drafter" not in system.hparams


def test_a_tensor_of_another_shape_is_named_with_both_shapes_not_matched_by_torchs_message(tiny_run, tmp_path):
    """The state dict's shapes are compared before nn.Module loads it, so a checkpoint rebuilt with another target's
    sizes is refused by the error's type (StateMismatchError), whatever words torch's own message uses."""
    from lilicorr_pl.system import DraftSystem, StateMismatchError

    _, good = tiny_run
    state = torch.load(good, map_location="cpu", weights_only=True)
    key = next(k for k, v in state["state_dict"].items() if k.startswith("head.") and v.dim() == 2)
    original = tuple(state["state_dict"][key].shape)
    state["state_dict"][key] = state["state_dict"][key][:-1].clone()  # one row fewer
    state["lilicorr"]["state_sha256"] = state_checksum(state["state_dict"])  # a consistent file, of other shapes
    resized = tmp_path / "resized.ckpt"
    save_edited(state, resized)
    with pytest.raises(CheckpointError) as err:
        DraftSystem.from_checkpoint(resized)
    expected = f"{key} is {[original[0] - 1, original[1]]} in the checkpoint and {list(original)} here"
    assert expected in str(err.value) and "cannot be rebuilt" in str(err.value)
    assert isinstance(err.value.__cause__, StateMismatchError) and isinstance(err.value.__cause__, RuntimeError)
    system = DraftSystem.from_checkpoint(good)
    with pytest.raises(StateMismatchError, match="missing"):
        system.load_state_dict({k: v for k, v in state["state_dict"].items() if k != key})


def test_a_resume_from_last_is_checked_before_any_work_like_a_named_checkpoint(tiny_run, tmp_path, capsys, monkeypatch):
    """`--ckpt_path=last` (the resume every stop message names) is resolved to the file Lightning will resume from and
    checked like a named checkpoint before anything is built: a truncated file or another head used to be found only
    once the data were prepared and the target loaded, the truncated one as a traceback."""
    from lilicorr_pl.data.datamodule import DraftDataModule

    _, good = tiny_run
    root = tmp_path / "runs" / "tiny"
    (root / "checkpoints").mkdir(parents=True)
    last = root / "checkpoints" / "last.ckpt"
    shutil.copy(good, last)
    cut = root / "checkpoints" / "last-v1.ckpt"  # the newest: Lightning would resume from it
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])

    def no_work_yet(self):
        raise AssertionError("the data were prepared before the checkpoint was checked")

    with monkeypatch.context() as patched:
        patched.setattr(DraftDataModule, "prepare_data", no_work_yet)
        err = user_error(capsys, _resume_argv(tmp_path, "last"))
        assert "truncated" in err and str(cut) in err and "Traceback" not in err, err
        cut.unlink()
        err = user_error(capsys, _resume_argv(tmp_path, "last", "--model.head.init_args.top_k=3"))
        assert "cannot resume" in err and "model.head" in err and "Traceback" not in err, err
    cli = _resume(tmp_path, "last")
    assert Path(cli.trainer.ckpt_path).resolve() == last.resolve() and cli.trainer.global_step == 3



def test_a_file_without_lightnings_records_is_named_before_any_work(tiny_run, tmp_path, capsys):
    """A bare state dict (or another tool's file) as --ckpt_path: validate failed with Lightning's KeyError traceback
    once the target was loaded, and fit with a 1,300-character line blaming the drafter settings."""
    _, good = tiny_run
    bare = tmp_path / "bare.ckpt"
    torch.save({"state_dict": torch.load(good, map_location="cpu", weights_only=True)["state_dict"]}, bare)
    for argv in (_resume_argv(tmp_path, bare), ["validate", "-c", str(ROOT / "configs" / "tiny.yaml"),
                                                f"--ckpt_path={bare}", f"--trainer.default_root_dir={tmp_path / 'v'}"]):
        err = user_error(capsys, argv)
        assert (f"--ckpt_path {bare} is not a checkpoint of lilicorr fit (it has no hyper_parameters, "
                "pytorch-lightning_version); pass a .ckpt that lilicorr fit wrote") in err, err


def test_the_early_check_finds_what_lightning_resumes_from_on_exception_files_and_sharded_folders(tmp_path):
    """`--ckpt_path=last` is resolved as Lightning resolves it: the newest of the ModelCheckpoint folders' last*.ckpt
    and the OnExceptionCheckpoint files; when that newest is a folder (a sharded checkpoint) nothing older is checked
    in its place."""
    from types import SimpleNamespace

    from jsonargparse import Namespace

    from lilicorr_pl.lightning_cli import LilicorrCLI

    ckpts, crashes = tmp_path / "run" / "checkpoints", tmp_path / "crashes"
    callbacks = [Namespace(class_path="callbacks.ModelCheckpoint", init_args=Namespace(dirpath=None)),
                 Namespace(class_path="lightning.pytorch.callbacks.OnExceptionCheckpoint",
                           init_args=Namespace(dirpath=str(crashes), filename="crash"))]
    cli = SimpleNamespace(config={"fit": {"trainer": {"default_root_dir": str(tmp_path / "run"),
                                                      "callbacks": callbacks}}})
    last = LilicorrCLI._last_checkpoint
    assert last(cli, "fit") is None
    ckpts.mkdir(parents=True)
    crashes.mkdir()
    for age, path in enumerate([ckpts / "last.ckpt", ckpts / "step=3.ckpt", crashes / "crash.ckpt"]):
        path.write_bytes(b"x")
        os.utime(path, (1000 + age, 1000 + age))
    assert last(cli, "fit") == str(crashes / "crash.ckpt")
    (ckpts / "last-v1.ckpt").mkdir()
    os.utime(ckpts / "last-v1.ckpt", (2000, 2000))
    # An empty folder is no sharded checkpoint: Lightning's IsADirectoryError once the data were prepared.
    with pytest.raises(UserInputError, match=r"--ckpt_path=last: the newest last checkpoint, .*last-v1.ckpt, is an empty "
                                             r"folder; remove it, or pass the checkpoint file to resume from"):
        last(cli, "fit")
    (ckpts / "last-v1.ckpt" / "checkpoint").mkdir()  # a sharded checkpoint's layout: left to its strategy
    os.utime(ckpts / "last-v1.ckpt", (2000, 2000))
    assert last(cli, "fit") is None


def test_a_damaged_checkpoint_is_named_before_a_builtin_target_is_built(tiny_run, tmp_path, capsys, monkeypatch):
    """export/bench --target builtin:... and perf with a builtin target in its config built the target (minutes; about
    20 for builtin:full) before they read the checkpoint they would then refuse."""
    from lilicorr_pl import builtin

    _, good = tiny_run
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])

    def no_build(*a, **k):
        raise AssertionError("the target was resolved before the checkpoint was read")

    monkeypatch.setattr(builtin, "resolve_target_path", no_build)
    for argv in (["export", "--ckpt", str(cut), "--output", str(tmp_path / "ex"), "--target", "builtin:quick"],
                 ["bench", "--ckpt", str(cut), "--target", "builtin:quick", "--benchmark", "stdlib-heldout",
                  "--num_prompts", "1", "--max_new_tokens", "2"],
                 ["perf", "-c", str(ROOT / "configs" / "tiny.yaml"), "--ckpt", str(cut)],
                 ["perf", "-c", str(ROOT / "configs" / "tiny.yaml"), "--ckpt", str(tmp_path / "nope.ckpt")]):
        err = user_error(capsys, argv)
        assert ("truncated" in err and str(cut) in err) or "does not exist" in err, err
    assert not (tmp_path / "ex").exists()


def test_the_evaluation_check_refuses_what_changes_the_measurement_and_only_that():
    """validate/predict refuse another drafter/head setting or another split of the data the checkpoint trained on;
    how a module computes (attention kernel, dropout), an option the checkpoint predates or leaves derived (None), a
    smaller share of the same split, or other held-out files are not refused."""
    from lilicorr_pl.system import check_evaluation_settings

    head = {"class_path": "lilicorr_pl.heads.LiLiCorrHead", "init_args": {"top_k": 4, "logit_scale": 8.0,
                                                                         "dropout": 0.0, "block_size": None}}
    drafter = {"class_path": "lilicorr_pl.models.DFlashDrafter", "init_args": {"num_layers": 1, "attention": "flex"}}
    model = {"drafter": drafter, "head": head, "target": {"name_or_path": "t", "layer_ids": None, "num_features": 3}}
    data = {"train_files": ["a.jsonl"], "val_files": None, "val_fraction": 0.1, "seed": 0, "pack": False,
            "max_examples": None, "max_length": 64, "enable_thinking": False, "chat_template": None}

    def check(model_now=None, data_now=None, saved_data=None):
        check_evaluation_settings(model, model_now or model, saved_data or data, data_now or data, "c.ckpt", "validate")

    def changed(section, key, value, base=None):
        base = json.loads(json.dumps(base or model))
        base[section]["init_args"][key] = value
        return base

    check()
    check(changed("drafter", "attention", "sdpa"))
    check(changed("head", "dropout", 0.1))
    check(changed("head", "block_size", 8))  # derived when None: a shape that differs is named when it loads
    newer = changed("head", "a_later_option", 1.0)
    check(newer)  # an option the checkpoint predates
    with pytest.raises(CheckpointError, match=r"model.head.init_args.logit_scale: checkpoint 8.0 vs now 4.0"):
        check(changed("head", "logit_scale", 4.0))
    with pytest.raises(CheckpointError, match=r"model.drafter.init_args.num_layers: checkpoint 1 vs now 2"):
        check(changed("drafter", "num_layers", 2))
    with pytest.raises(CheckpointError, match=r"model.target.num_features: checkpoint 3 vs now 5"):
        check({**model, "target": {**model["target"], "num_features": 5}})
    check({**model, "target": {**model["target"], "layer_ids": [0, 1, 2]}})  # None: derived, compared when it loads
    check(data_now={**data, "val_fraction": 0.05})  # part of the same held-out split
    check(data_now={**data, "seed": 7, "val_files": ["held.jsonl"]})  # other held-out files: any seed
    check(data_now={**data, "seed": 7, "train_files": ["b.jsonl"]})  # other data
    for key, value in (("seed", 7), ("val_fraction", 0.2), ("pack", True), ("max_length", 128)):
        with pytest.raises(CheckpointError, match=rf"another validation split .*data.{key}: checkpoint"):
            check(data_now={**data, key: value})
    with pytest.raises(CheckpointError, match=r"was validated on data.val_files \['held.jsonl'\] and trained on every "
                                              r"example of data.train_files"):
        check(saved_data={**data, "val_files": ["held.jsonl"]})


def test_a_resume_keeps_its_validation_split_and_an_edited_training_file_is_not_the_trained_one(tmp_path):
    """A resume that split its validation examples off the training files in another way (another seed, a larger
    share, other files, an edited file, the held-out files dropped) was applied: val/* then measured examples the
    steps before trained on, and validate refused the checkpoint's own first split. validate/predict of files edited
    in place under the same path were measured as the trained ones."""
    from lilicorr_pl.system import check_evaluation_settings, check_resume_split, edited_files

    data = {"train_files": ["a.jsonl"], "val_files": None, "val_fraction": 0.1, "seed": 0, "pack": False,
            "max_examples": None, "max_length": 64, "enable_thinking": False, "chat_template": None}
    check_resume_split(data, data, "c.ckpt")
    check_resume_split(data, {**data, "val_fraction": 0.05}, "c.ckpt")  # part of the same split
    check_resume_split(data, {**data, "seed": 7, "train_files": ["b.jsonl"], "val_files": ["held.jsonl"]}, "c.ckpt")
    check_resume_split({**data, "val_files": ["held.jsonl"]}, {**data, "val_files": ["other.jsonl"]}, "c.ckpt")
    check_resume_split({}, data, "c.ckpt")  # a checkpoint with no data settings: nothing to compare
    for now, said in (({**data, "seed": 7}, "data.seed: checkpoint 0 vs now 7"),
                      ({**data, "val_fraction": 0.3}, "data.val_fraction: checkpoint 0.1 vs now 0.3"),
                      ({**data, "max_length": 128}, "data.max_length: checkpoint 64 vs now 128"),
                      # rendered into other token counts, other records are dropped at max_length: another split
                      ({**data, "enable_thinking": True}, "data.enable_thinking: checkpoint False vs now True"),
                      ({**data, "chat_template": "t.jinja"}, "data.chat_template: checkpoint None vs now 't.jinja'"),
                      ({**data, "train_files": ["a.jsonl", "b.jsonl"]},
                       "data.train_files: checkpoint ['a.jsonl'] vs now ['a.jsonl', 'b.jsonl']")):
        with pytest.raises(CheckpointError, match=re.escape(
                f"cannot resume --ckpt_path c.ckpt with another validation split ({said}): it may validate on "
                "examples the steps so far trained on; resume with the checkpoint's data settings and files, or "
                "validate on held-out files (data.val_files)")):
            check_resume_split(data, now, "c.ckpt")
    # The same template given another way (a relative and an absolute path, inline text) is the same rendering; no
    # share of the files validating, before or now, is no split to redraw.
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    for was, now in ((str(template), str(template.parent / "." / "t.jinja")), (str(template), template.read_text())):
        check_resume_split({**data, "chat_template": was}, {**data, "chat_template": now}, "c.ckpt")
    with pytest.raises(CheckpointError, match="data.chat_template: checkpoint"):
        check_resume_split({**data, "chat_template": str(template)}, {**data, "chat_template": "{{ 'x' }}"}, "c.ckpt")
    unsplit = {**data, "val_fraction": 0.0}
    check_resume_split(unsplit, {**unsplit, "seed": 7, "enable_thinking": True}, "c.ckpt")
    # The same bytes under another path (a moved run folder, a job's local copy), as the caller compared them.
    check_resume_split(data, {**data, "train_files": ["/elsewhere/a.jsonl"]}, "c.ckpt", same_files=True)
    with pytest.raises(CheckpointError, match=r"\(data.train_files: checkpoint \['a.jsonl'\] vs now \['a.jsonl'\]\)"):
        check_resume_split(data, data, "c.ckpt", same_files=False)
    with pytest.raises(CheckpointError, match=r"\(data.val_files: checkpoint \['held.jsonl'\] vs now none\)"):
        check_resume_split({**data, "val_files": ["held.jsonl"]}, data, "c.ckpt")
    with pytest.raises(CheckpointError, match=r"\(data.train_files: a.jsonl edited since the checkpoint\)"):
        check_resume_split(data, data, "c.ckpt", edited=["a.jsonl"])

    trained = [{"name": "a.jsonl", "bytes": 10, "sha256": "1" * 64}, {"name": "b.jsonl", "bytes": 5, "sha256": "2" * 64}]
    assert edited_files(trained, trained) == [] and edited_files(None, trained) == [] and edited_files(trained, []) == []
    assert edited_files(trained, [trained[0], {**trained[1], "sha256": "3" * 64}]) == ["b.jsonl"]
    assert edited_files(trained, [{**trained[0], "bytes": 11}, trained[1]]) == ["a.jsonl"]
    assert edited_files(trained, trained[:1]) == []  # another list: other files, compared by their names elsewhere
    model = {"drafter": {"class_path": "d", "init_args": {}}}
    check_evaluation_settings(model, model, data, data, "c.ckpt", "validate")
    with pytest.raises(CheckpointError, match=r"--ckpt_path c.ckpt trained on data.train_files whose content has "
                                              r"changed since \(a.jsonl edited\), so this validate would measure"):
        check_evaluation_settings(model, model, data, data, "c.ckpt", "validate", edited=["a.jsonl"])
    check_evaluation_settings(model, model, data, {**data, "val_files": ["held.jsonl"]}, "c.ckpt", "validate",
                              edited=["a.jsonl"])  # held-out files: the edit does not matter


def test_a_builtin_artifact_in_another_machines_cache_folder_is_the_same_one(tmp_path, monkeypatch):
    """A built-in target's folder and data file are named by their build keys: the same name in another cache folder is
    the same build (not another target to resume on, not other training data); another key, or a user's own folder in
    another place, is compared by its path as before."""
    from lilicorr_pl import builtin
    from lilicorr_pl.system import check_evaluation_settings, check_resume_settings
    from lilicorr_pl.target import builtin_artifact, builtin_copy_here, portable

    build = Path(builtin.target_folder("builtin:tiny")).name
    here, there = f"/cache/a/{build}", f"/scratch/b/lilicorr/{build}"
    other = "/cache/a/tiny-target-test-0123456789abcdef"
    target = {"name_or_path": here, "dtype": "float32", "layer_ids": [1, 2], "num_features": 2}
    assert check_resume_settings({"target": target}, {"target": {**target, "name_or_path": there}}) == []
    for now in (other, "/models/qwen3"):
        with pytest.raises(CheckpointError, match=f"model.target.name_or_path: checkpoint '{here}' vs now '{now}'"):
            check_resume_settings({"target": target}, {"target": {**target, "name_or_path": now}})
    with pytest.raises(CheckpointError, match="model.target.name_or_path: checkpoint '/m/qwen3' vs now '/n/qwen3'"):
        check_resume_settings({"target": {**target, "name_or_path": "/m/qwen3"}},
                              {"target": {**target, "name_or_path": "/n/qwen3"}})

    data_name = Path(builtin.resolve_data_file("builtin:stdlib-train:8")).name
    assert builtin_artifact(f"/x/data/{data_name}") == data_name and builtin_artifact(f"{there}/") == build
    assert builtin_artifact(f"C:\\Users\\me\\.cache\\lilicorr_pl\\{build}") == build  # recorded on Windows
    assert builtin_artifact("/x/my-stdlib-train-8-2000-aaaaaaaaaaaa.jsonl") is None and builtin_artifact(3) is None
    assert portable({"files": [f"/x/data/{data_name}", "mine.jsonl"]}) == {
        "files": [f"<lilicorr cache>/{data_name}", "mine.jsonl"]}
    # The builtin: name that builds it here: only for a key this version makes.
    assert builtin.builtin_name_of(there) == "builtin:tiny" and builtin.builtin_name_of(other) is None
    assert builtin.builtin_name_of(f"/x/{data_name}") == "builtin:stdlib-train:8"
    assert builtin.builtin_name_of(f"/x/{data_name.replace('-2000-', '-1000-')}") is None
    assert builtin.builtin_name_of(f"/x/{data_name[:-18]}000000000000.jsonl") is None  # another standard library
    assert builtin.builtin_name_of("/models/qwen3") is None
    # This machine's copy: the same name in its cache folder, a folder for a target and a file for data.
    monkeypatch.setenv("LILICORR_CACHE", str(tmp_path))
    assert builtin_copy_here(there) is None and builtin_copy_here(f"/x/data/{data_name}") is None
    (tmp_path / build).mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / data_name).write_text("{}\n")
    assert builtin_copy_here(there) == str(tmp_path / build)
    assert builtin_copy_here(f"/x/data/{data_name}") == str(tmp_path / "data" / data_name)

    # validate: the same training files in another cache folder are the same data: another split of them is refused.
    model = {"target": target}
    data = {"train_files": [f"/cache/a/data/{data_name}"], "val_files": None, "val_fraction": 0.1, "seed": 0}
    moved = {**data, "train_files": [f"/scratch/b/data/{data_name}"]}
    check_evaluation_settings(model, model, data, moved, "c.ckpt", "validate")
    with pytest.raises(CheckpointError, match=r"another validation split .*data.seed: checkpoint 0 vs now 7"):
        check_evaluation_settings(model, model, data, {**moved, "seed": 7}, "c.ckpt", "validate")


def test_a_checkpoint_recording_a_count_beside_its_layer_list_still_loads_and_resumes(tiny_run, tmp_path):
    """A run from before a num_features that disagrees with layer_ids was refused recorded both (the list won): its
    checkpoint still loads for bench/export, and a resume with the count dropped, as the refusal says, is not refused
    as another target."""
    from lilicorr_pl.system import DraftSystem, check_resume_settings

    _, good = tiny_run
    checkpoint = torch.load(good, map_location="cpu", weights_only=True)
    target = checkpoint["hyper_parameters"]["target"]
    assert target["layer_ids"] == [1, 2]
    target["num_features"] = 4
    old = tmp_path / "old.ckpt"
    save_edited(checkpoint, old)
    system = DraftSystem.from_checkpoint(old, map_location="cpu", load_target=False)
    assert system.drafter.target_layer_ids == [1, 2]
    now = {"target": {**target, "num_features": 5}}
    assert check_resume_settings({"target": target}, now) == []
    # Without a list the count picks the layers: another count is another target, refused as before.
    with pytest.raises(CheckpointError, match=r"model.target.num_features: checkpoint 4 vs now 5"):
        check_resume_settings({"target": {**target, "layer_ids": None}},
                              {"target": {**now["target"], "layer_ids": None}})
