"""`lilicorr fit -c configs/...`: every shipped config parses; the tiny run trains end to end."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from helpers import save_edited
from lilicorr_pl.cli import main

ROOT = Path(__file__).resolve().parents[1]
# Overlays (ablations, demo arms, recipe arms) are parsed on top of their base, below.
ABLATIONS = sorted((ROOT / "configs" / "ablations").glob("*.yaml"))
DEMO_ARMS = sorted((ROOT / "configs" / "demo" / "arms").glob("*.yaml"))
RECIPE_BASES = sorted((ROOT / "configs").glob("qwen3-*/base.yaml"))
RECIPE_ARMS = sorted(p for base in RECIPE_BASES for p in base.parent.glob("*.yaml") if p != base)
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml")
                 if not {"ablations", "arms"} & set(p.parts) and p not in RECIPE_ARMS)
TINY = str(ROOT / "configs" / "tiny.yaml")


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


@pytest.mark.parametrize("overlay", RECIPE_ARMS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_recipe_base_with_each_arm_overlay_parses_into_its_own_run_folder(overlay):
    cfg = print_config(overlay.parent / "base.yaml", overlay)
    head = cfg["model"]["head"]
    assert (head is None) == (overlay.stem == "dflash")
    if head is not None:
        assert overlay.stem in head["class_path"].lower()
    trainer = cfg["trainer"]
    root = f"runs/{overlay.parent.name}-{overlay.stem}"  # one root per arm: checkpoints go to <root>/checkpoints
    assert trainer["default_root_dir"] == root
    assert trainer["logger"]["init_args"]["save_dir"] in (None, ".")  # W&B follows the root (next test)
    assert trainer["logger"]["init_args"]["project"] == "lilicorr"  # the rest of the base's logger is kept
    names = [c["class_path"] for c in trainer["callbacks"]]
    assert "callbacks.RandomStateCheckpoint" in names and "callbacks.ModelCheckpoint" in names


@pytest.mark.parametrize("overlay", RECIPE_ARMS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_recipe_arm_moves_whole_with_one_root_setting(overlay):
    """README's "another root: --trainer.default_root_dir": the checkpoints and the W&B files (where config.yaml is
    recorded) both move. A recipe that fixed the logger's save_dir split a second run across two folders, and the
    arm's own run was then refused over the record the second run had written into its folder."""
    from jsonargparse import dict_to_namespace

    from lilicorr_pl.lightning_cli import LilicorrCLI

    for extra, root in (([], f"runs/{overlay.parent.name}-{overlay.stem}"), (["--trainer.default_root_dir=elsewhere"],
                                                                            "elsewhere")):
        config = dict_to_namespace(print_config(overlay.parent / "base.yaml", overlay, extra=extra))
        LilicorrCLI._place_outputs_under_the_root(config)
        assert config.trainer.default_root_dir == root
        assert config.trainer.logger.init_args.save_dir == root
        assert config.data.cache_dir == f"cache/{overlay.parent.name}"  # the stores stay shared by the arms


@pytest.mark.parametrize("config", [*CONFIGS, *RECIPE_BASES], ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_shipped_fit_config_restores_the_random_streams_on_resume(config):
    """A resume is bit-exact only with callbacks.RandomStateCheckpoint: every shipped fit config carries it."""
    cfg = yaml.safe_load(config.read_text())
    assert any(c["class_path"] == "callbacks.RandomStateCheckpoint" for c in cfg["trainer"]["callbacks"]), config


@pytest.mark.parametrize("overlay", ABLATIONS, ids=lambda p: p.stem)
def test_tiny_config_with_each_ablation_overlay_parses(overlay):
    cfg = print_config(ROOT / "configs" / "tiny.yaml", overlay)
    model = cfg["model"]
    if overlay.stem == "no_distractor":
        assert model["disabled_losses"] == ["distractor_penalty"]
    if overlay.stem == "dflash_only":
        assert model["head"] is None
    if overlay.stem == "penalty_heavy":  # the demo's head stage: penalty 1.0 against the oracle-prefix CE's 0.25
        assert model["loss_weights"] == {"distractor_penalty": 1.0}
    if overlay.stem == "margin":
        assert model["loss_weights"] == {"oracle_prefix_ce": 0.125, "margin_hinge": 0.125}
    if overlay.stem == "head_stage":  # frozen drafter, blocks across many sequences, from the data module's stores
        assert model["freeze_drafter"] is True and model["num_anchors"] == 2 and model["target_logits"] == "cache"
        assert model["context_memo_mb"] == 1024  # the frozen drafter's context work, once per example
        assert cfg["data"]["batch_size"] == 64 and cfg["data"]["feature_cache"] and cfg["data"]["logit_cache"]


def fit_tiny(tmp_path: Path, *extra: str, steps: int = 6) -> object:
    """Run the tiny config with every output under ``tmp_path/runs/tiny`` (its root; no chdir)."""
    return main([
        "fit", "-c", str(ROOT / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={tmp_path / 'runs' / 'tiny'}",
        *extra, f"--trainer.max_steps={steps}", "--trainer.val_check_interval=3", "--trainer.limit_val_batches=1",
        "--trainer.enable_progress_bar=false",
    ])


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

    out = main(["export", "--ckpt", str(ckpt), "--output", str(tmp_path / "served")])
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LiLiCorrDraftModel"]
    head, drafter = load_head(out), load_drafter(out)
    for ours, theirs in ((loaded.head, head), (loaded.drafter, drafter)):
        assert ours.state_dict().keys() == theirs.state_dict().keys()
        assert all(torch.equal(v, theirs.state_dict()[k]) for k, v in ours.state_dict().items())
    # In another dtype and in Model-Optimizer's indexed MLP names: every tensor in that dtype, the config saying
    # so, and the same head read back.
    from safetensors.torch import load_file

    half = main(["export", "--ckpt", str(ckpt), "--output", str(tmp_path / "served-bf16"), "--dtype", "bfloat16",
                 "--head_mlp_names", "sequential"])
    assert json.loads((half / "config.json").read_text())["torch_dtype"] == "bfloat16"
    tensors = load_file(str(half / "model.safetensors"))
    assert {v.dtype for v in tensors.values()} == {torch.bfloat16}
    assert "lilicorr.feature_mlp.1.weight" in tensors and "lilicorr.layers.0.mlp.2.bias" in tensors
    assert not any("up_proj" in k or "feature_norm" in k for k in tensors if k.startswith("lilicorr."))
    head16 = load_head(half)
    assert all(torch.equal(v.to(torch.bfloat16), head16.state_dict()[k]) for k, v in loaded.head.state_dict().items())


def test_export_writes_the_targets_dtype_by_default(tmp_path):
    # A run whose target is bf16 (as the Qwen3 recipes'): its drafter trained in fp32, exported in bf16.
    fit_tiny(tmp_path, "--model.target.dtype=bfloat16", steps=1)
    ckpt = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    out = main(["export", "--ckpt", str(ckpt), "--output", str(tmp_path / "served")])
    from safetensors.torch import load_file

    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert {v.dtype for v in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}
    kept = main(["export", "--ckpt", str(ckpt), "--output", str(tmp_path / "fp32"), "--dtype", "float32"])
    assert {v.dtype for v in load_file(str(kept / "model.safetensors")).values()} == {torch.float32}


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


def test_a_new_fit_is_refused_over_another_runs_record_and_the_same_run_again_is_not(tmp_path, capsys):
    """A fresh fit into a folder holding an earlier run's config.yaml replaced that record (which prepare, perf and
    bench read as how the run's checkpoints were trained). The same command again (a retry, a requeued job that
    Lightning resumes by itself) writes the same record, and a resume rewrites its own: both run."""
    fit_tiny(tmp_path, steps=1)
    root = tmp_path / "runs" / "tiny"
    record = (root / "config.yaml").read_text()
    ablated = ["fit", "-c", str(ROOT / "configs" / "tiny.yaml"), "-c", str(ROOT / "configs" / "ablations" /
               "no_distractor.yaml"), f"--trainer.default_root_dir={root}", "--trainer.max_steps=1",
               "--trainer.val_check_interval=3", "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false"]
    err = user_error(capsys, ablated)
    assert err.strip().endswith(
        f"error: {root / 'config.yaml'} records another run (its model.disabled_losses: None, this run's: "
        "['distractor_penalty']); resume that run with --ckpt_path=last, or write this one elsewhere with another "
        "--trainer.default_root_dir"), err
    assert (root / "config.yaml").read_text() == record and not (root / "checkpoints" / "last-v1.ckpt").exists()
    # Relaunched from its saved config with another root: the saved logger still writes to the old folder, so the
    # fix names that setting too.
    err = user_error(capsys, ["fit", "-c", str(root / "config.yaml"), f"--trainer.default_root_dir={tmp_path / 'b'}"])
    assert err.strip().endswith(f"another --trainer.default_root_dir and --trainer.logger.init_args.save_dir (the "
                                f"logger writes the record to {root})"), err
    assert (root / "config.yaml").read_text() == record
    with pytest.warns(UserWarning, match=r"this run's final weights are in .*last-v1.ckpt; last.ckpt beside it holds "
                                         r"an earlier run's .*pass .*last-v1.ckpt to bench and export"):
        fit_tiny(tmp_path, steps=1)  # the same run again: Lightning numbers its last checkpoint
    before = (root / "config.yaml").read_bytes()
    capsys.readouterr()
    cli = fit_tiny(tmp_path, "--ckpt_path=last", "--trainer.gradient_clip_val=100", steps=2)  # its record rewritten
    assert cli.trainer.global_step == 2 and "ckpt_path: last" in (root / "config.yaml").read_text()
    # ... with every changed setting listed (a trainer's or the data's were applied silently), and the record of how
    # the steps before were trained kept beside it (it was replaced by this resume's).
    err = capsys.readouterr().err
    assert ("lilicorr: resuming with changed settings (applied from this run's config): trainer.gradient_clip_val: "
            "1.0 -> 100; trainer.max_steps: 1 -> 2") in err
    kept = root / "config-until-step1.yaml"
    assert kept.read_bytes() == before and f"the record the steps up to step 1 trained with is kept as {kept}" in err
    assert yaml.safe_load((root / "config.yaml").read_text())["trainer"]["gradient_clip_val"] == 100.0
    # ... from the run's own newest last checkpoint (the run again wrote last-v1.ckpt beside the first run's
    # last.ckpt); Lightning alone looked in the logger's folder, found none and started over at step 0.
    assert Path(cli.trainer.ckpt_path).resolve() == (root / "checkpoints" / "last-v1.ckpt").resolve()


def test_the_same_run_with_its_folder_spelt_otherwise_is_the_same_run(tmp_path, capsys, monkeypatch):
    """A retry of the same command with the root given relative where the first was absolute (or the reverse) was
    refused as "another run (its data.cache_dir: '/…/run/cache', this run's: 'run/cache')": the same folders."""
    import warnings

    from lilicorr_pl.lightning_cli import _recorded_base, _same_place

    monkeypatch.chdir(tmp_path)
    fit = ["fit", "-c", str(ROOT / "configs" / "tiny.yaml"), "--trainer.max_steps=1", "--trainer.limit_val_batches=0",
           "--trainer.enable_progress_bar=false"]
    main([*fit, "--trainer.default_root_dir=run"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "last-v1.ckpt beside last.ckpt": the same run again, as any retry
        cli = main([*fit, f"--trainer.default_root_dir={tmp_path / 'run'}"])
    assert cli.trainer.global_step == 1
    # Another setting is still another run, whatever the spelling.
    err = user_error(capsys, [*fit, "--trainer.default_root_dir=./run", "--model.num_anchors=8"])
    assert "records another run (its model.num_anchors: 32, this run's: 8)" in err, err
    # The rule: recorded paths resolve against the folder the recorded root was relative to.
    assert _recorded_base("run", tmp_path / "run") == Path(os.path.realpath(tmp_path))
    assert _recorded_base("a/run", tmp_path / "run") is None and _recorded_base(str(tmp_path), tmp_path) is None
    assert _same_place("run/cache", str(tmp_path / "run" / "cache"), tmp_path)
    assert _same_place(["d.jsonl"], [str(tmp_path / "d.jsonl")], tmp_path)
    assert not _same_place("run/cache", str(tmp_path / "other"), tmp_path)
    assert not _same_place("run/cache", str(tmp_path / "run" / "cache"), None)  # relative to an unknown folder


def test_resume_with_nothing_to_resume_is_a_new_run_and_guarded_like_one(tmp_path, capsys):
    """--ckpt_path=last where no checkpoint is (a batch script's first submission) starts a new run, as Lightning does;
    it skipped the guard and replaced the config.yaml another run (or the user) had left in the folder."""
    root = tmp_path / "runs" / "tiny"
    root.mkdir(parents=True)
    record = "# lightning.pytorch==2.6.0\nmodel:\n  num_anchors: 64\ntrainer:\n  max_steps: 5\n"  # another run's
    (root / "config.yaml").write_text(record)
    err = user_error(capsys, ["fit", "-c", str(ROOT / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={root}",
                              "--trainer.max_steps=1", "--ckpt_path=last"])
    assert f"{root / 'config.yaml'} records another run" in err, err
    assert "--ckpt_path=last found no checkpoint of it to resume, so this would be a new run over its record" in err
    assert (root / "config.yaml").read_text() == record
    assert not (root / "checkpoints").exists()
    (root / "config.yaml").unlink()
    cli = fit_tiny(tmp_path, "--ckpt_path=last", steps=1)  # nothing there: a new run, which writes its record
    assert cli.trainer.global_step == 1 and (root / "config.yaml").is_file()


def test_a_fit_resumed_from_another_folders_checkpoint_is_guarded_like_a_new_run(tmp_path, capsys):
    """Resuming another run's checkpoint into a folder holding a different run's record replaced that record, and
    the folder's next --ckpt_path=last resumed the intruder's checkpoint, abandoning the folder's own run."""
    fit_tiny(tmp_path / "a", steps=1)
    other = tmp_path / "a" / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    fit_tiny(tmp_path / "b", "--trainer.max_steps=3", steps=3)
    root = tmp_path / "b" / "runs" / "tiny"
    record = (root / "config.yaml").read_text()
    argv = ["fit", "-c", str(ROOT / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={root}",
            "--trainer.max_steps=2", "--trainer.enable_progress_bar=false", f"--ckpt_path={other}"]
    err = user_error(capsys, argv)
    assert f"{root / 'config.yaml'} records another run (its trainer." in err
    assert err.strip().endswith(
        f"--ckpt_path {other} is another folder's checkpoint, so this would be another run over its record; write it "
        "elsewhere with another --trainer.default_root_dir"), err
    assert (root / "config.yaml").read_text() == record
    fresh = tmp_path / "c" / "runs" / "tiny"  # into a folder of its own it runs, as before
    cli = main([*argv[:3], f"--trainer.default_root_dir={fresh}", *argv[4:]])
    assert cli.trainer.global_step == 2 and (fresh / "config.yaml").is_file()


def test_a_config_record_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    """config.yaml went through jsonargparse's `parser.save`, written in place: a run killed while writing it left a
    torn record, and the retry refused it as another run's. Written beside it and renamed into place, a write that
    stops halfway leaves the previous record whole and no temporary file; the text is what `parser.save` writes."""
    import builtins

    from lilicorr_pl.lightning_cli import LoggerSaveConfigCallback

    cli = fit_tiny(tmp_path, steps=1)
    root = tmp_path / "runs" / "tiny"
    record = (root / "config.yaml").read_bytes()
    callback = next(c for c in cli.trainer.callbacks if isinstance(c, LoggerSaveConfigCallback))
    callback.parser.save(callback.config, str(tmp_path / "saved.yaml"), skip_none=False, multifile=False)
    assert (tmp_path / "saved.yaml").read_bytes() == record  # the text Lightning's own save writes

    class Killed(BaseException):
        """The process stopping in the middle of a write."""

    class Torn:
        """A file that takes half of what it is given, then the writer is killed."""

        def __init__(self, fh):
            self.fh = fh

        def write(self, text):
            self.fh.write(text[: len(text) // 2])
            self.fh.flush()
            raise Killed

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def __getattr__(self, name):
            return getattr(self.fh, name)

    real_open, real_fdopen = builtins.open, os.fdopen

    def torn_open(file, mode="r", *args, **kwargs):  # a write in place (jsonargparse's save)
        fh = real_open(file, mode, *args, **kwargs)
        return Torn(fh) if "w" in mode and str(file).endswith("config.yaml") else fh

    def torn_fdopen(fd, mode="r", *args, **kwargs):  # a write to a temporary file (lilicorr_pl.files.atomic_file)
        fh = real_fdopen(fd, mode, *args, **kwargs)
        return Torn(fh) if "w" in mode else fh

    monkeypatch.setattr(builtins, "open", torn_open)
    monkeypatch.setattr(os, "fdopen", torn_fdopen)
    callback.already_saved = False  # the record written again, as by a retry of the same run
    with pytest.raises(Killed):
        callback.setup(cli.trainer, cli.model, "fit")
    monkeypatch.undo()
    assert (root / "config.yaml").read_bytes() == record
    assert not [p.name for p in root.iterdir() if p.name.startswith(".config.yaml")]
    shutil.rmtree(root / "checkpoints")  # the retry is the same run, and runs
    assert fit_tiny(tmp_path, steps=1).trainer.global_step == 1
    assert (root / "config.yaml").read_bytes() == record


def test_an_unreadable_config_record_is_called_damaged_not_another_runs(tmp_path, capsys):
    """A config.yaml that is not YAML settings was refused as "another run (its data.batch_size: None, ...)"; it is
    refused as what it is, and left as it was."""
    root = tmp_path / "runs" / "tiny"
    root.mkdir(parents=True)
    for text in ("trainer:\n  max_steps: [1,\n", "notes\n"):
        (root / "config.yaml").write_text(text)
        err = user_error(capsys, ["fit", "-c", str(ROOT / "configs" / "tiny.yaml"),
                                  f"--trainer.default_root_dir={root}", "--trainer.max_steps=1"])
        assert err.strip().endswith(
            f"error: {root / 'config.yaml'} is not a config record that can be read (damaged, or not YAML settings), "
            "so it is not replaced; move it, or write this run elsewhere with another --trainer.default_root_dir"), err
        assert (root / "config.yaml").read_text() == text and not (root / "checkpoints").exists()
    # YAML settings of the user's own under that name (no run wrote them): "records another run (its data.batch_size:
    # None, …)" misled; said as what it is, and kept.
    text = "model:\n  notes: my settings\ntrainer: {}\n"
    (root / "config.yaml").write_text(text)
    err = user_error(capsys, ["fit", "-c", str(ROOT / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={root}",
                              "--trainer.max_steps=1"])
    assert err.strip().endswith(
        f"error: {root / 'config.yaml'} is not a config record a run wrote (a file of yours named like one), so it is "
        "not replaced; move it, or write this run elsewhere with another --trainer.default_root_dir"), err
    assert (root / "config.yaml").read_text() == text and not (root / "checkpoints").exists()
    # A run's record is read whole (the first 4 MiB of a long file list did not parse, and read as a file of yours).
    from lilicorr_pl.lightning_cli import _written_by_the_config_callback

    files = [f"/data/shard-{i:06d}.jsonl" for i in range(200_000)]
    large = root / "large.yaml"
    large.write_text("# lightning.pytorch==2.6.0\n" + yaml.safe_dump({"model": {}, "trainer": {}, "data": {
        "train_files": files}}))
    assert large.stat().st_size > 1 << 22 and _written_by_the_config_callback(large)


# Features from the data module's store (the overlay as shipped), or from the online target with the exact penalty.
ONLINE_FEATURES = ["--data.feature_cache=false", "--data.logit_cache=false", "--model.target_logits=exact"]
# The head stage freezes the drafter: a drafter that is not random (a frozen random one is refused).
FROZEN_FROM_TARGET = ["--model.init_drafter_layers_from_target=true"]


@pytest.mark.parametrize("features", ["store", "online"])
def test_head_stage_fit_serves_revisited_examples_from_the_context_memo_and_validation_never_touches_it(
        tmp_path, features):
    """`fit` with the head-stage overlay: every training example's drafter context is computed once and served from
    the memo on every later visit, validation batches never enter it, the hit rate is logged, the memo is emptied
    when the fit ends, and the trained head is the one a fit without the memo trains -- with the features read
    from the store or computed by the online target."""
    stage = ["-c", str(ROOT / "configs" / "ablations" / "head_stage.yaml"), "--data.batch_size=16", *FROZEN_FROM_TARGET,
             *(ONLINE_FEATURES if features == "online" else [])]
    cli = fit_tiny(tmp_path / "memo", *stage, steps=8)  # 57 training examples: the fit revisits them
    memo = cli.model.context_memo
    loader = cli.datamodule.train_dataloader()
    sizes = [len(b["index"]) for b in loader]
    served = sum(sizes[i % len(sizes)] for i in range(8))
    distinct = len(loader.dataset)
    assert served > distinct  # the test's premise
    # Validation ran twice (steps 3 and 6) through the same compute_step; none of its examples were counted.
    assert memo.misses == distinct and memo.hits == served - distinct
    logged = cli.trainer.callback_metrics["train/context_memo_hit_rate"]
    assert float(logged) == pytest.approx(memo.hits / served)
    assert "val/context_memo_hit_rate" not in cli.trainer.callback_metrics
    assert len(memo) == 0 and memo.bytes == 0  # its memory went back at fit end
    assert ("features" in next(iter(loader))) == (features == "store")  # the parametrisation's premise

    plain = fit_tiny(tmp_path / "plain", *stage, "--model.context_memo_mb=0", steps=8)
    assert plain.model.context_memo is None
    trained = {k: v for k, v in cli.model.state_dict().items() if k.startswith("head.")}
    assert trained
    for key, value in plain.model.state_dict().items():
        if key.startswith("head."):
            torch.testing.assert_close(trained[key], value)


def test_context_memo_of_online_features_matches_the_padded_forward(tmp_path):
    """The online target's features are not zero at padded positions, where the memo stores zeros: no valid block
    reads them, so a ragged batch gives the same drafter logits and loss with the memo (part hits, then all) as
    without it."""
    cli = fit_tiny(tmp_path, "-c", str(ROOT / "configs" / "ablations" / "head_stage.yaml"), "--data.batch_size=8",
                   *FROZEN_FROM_TARGET, *ONLINE_FEATURES, steps=1)
    system, memo = cli.model, cli.model.context_memo
    batch = {k: v.clone() for k, v in next(iter(cli.datamodule.train_dataloader())).items()}
    for row, n in enumerate([64, 50, 40, 33, 64, 20, 57, 45][: len(batch["index"])]):
        batch["attention_mask"][row, n:] = 0
        batch["loss_mask"][row, n:] = False
    pad = batch["attention_mask"] == 0
    assert system.target(batch["input_ids"], attention_mask=batch["attention_mask"]).features[pad].abs().max() > 0.01
    memo.clear(counts=True)
    system.train()
    system.compute_step({k: v[:4] for k, v in batch.items()}, memo=memo)  # half the rows stored first
    for served in ("part from the memo", "all from the memo"):
        with_memo = system.compute_step(batch, generator=torch.Generator().manual_seed(7), memo=memo)
        plain = system.compute_step(batch, generator=torch.Generator().manual_seed(7))
        torch.testing.assert_close(with_memo["slot_logits"], plain["slot_logits"], msg=served)
        torch.testing.assert_close(with_memo["loss"], plain["loss"], msg=served)
    assert memo.misses == len(batch["index"]) and memo.hits == len(batch["index"]) + 4


def test_tiny_loss_falls_over_fifty_steps(tmp_path):
    import csv

    fit_tiny(tmp_path, "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.save_dir={tmp_path / 'csv'}",
             "--trainer.log_every_n_steps=1", "--trainer.val_check_interval=50", steps=50)
    rows = list(csv.DictReader(open(next((tmp_path / "csv").rglob("metrics.csv")))))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) >= 45
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.95 * first, (first, last)  # measured: 6.37 -> 5.71


def test_validate_and_predict_subcommands_run_on_a_trained_checkpoint(tmp_path, capsys):
    fit_tiny(tmp_path, steps=2)
    ckpt = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    saved = tmp_path / "runs" / "tiny" / "config.yaml"
    trained_with = saved.read_bytes()
    root = f"--trainer.default_root_dir={tmp_path / 'runs' / 'tiny'}"  # reads the stores fit wrote there
    cli = main(["validate", "-c", str(ROOT / "configs" / "tiny.yaml"), root, f"--ckpt_path={ckpt}",
                "--trainer.enable_progress_bar=false"])
    assert "val/loss" in cli.trainer.callback_metrics
    # The config's AcceptanceEval measured τ: printed too, not only sent to W&B (Lightning's table leaves it out).
    tau = float(cli.trainer.callback_metrics["eval/tau"])
    out = capsys.readouterr().out
    assert "acceptance (AcceptanceEval): eval/rounds " in out and f", eval/tau {tau:.4g}," in out and tau >= 1.0
    cli = main(["predict", "-c", str(ROOT / "configs" / "tiny.yaml"), root, f"--ckpt_path={ckpt}",
                "--trainer.enable_progress_bar=false", "--trainer.limit_predict_batches=1"])
    out = cli.trainer.predict_loop.predictions
    assert out and {"top1_prefix", "oracle_prefix"} <= set(out[0])
    assert (out[0]["oracle_prefix"] >= out[0]["top1_prefix"]).all()  # the lattice contains top-1
    # ... which Lightning returned and the CLI dropped: now printed (means) and written, every block's values.
    written = json.loads((saved.parent / "predict.json").read_text())
    assert written["written_by"].startswith("lilicorr predict ") and written["ckpt_path"] == str(ckpt)
    # ... saying which weights it measured (a `--ckpt_path last` said only "last"): the file, checksum and step.
    from lilicorr_pl.checkpoint import CHECKSUM_KEY

    saved_ckpt = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert written["checkpoint"] == {"path": str(ckpt), "state_sha256": saved_ckpt["lilicorr"][CHECKSUM_KEY],
                                     "global_step": saved_ckpt["global_step"]}
    valid = torch.tensor(written["per_block"]["valid_block"], dtype=torch.bool)
    assert written["blocks"] == len(out[0]["top1_prefix"]) and written["valid_blocks"] == int(valid.sum()) > 0
    assert written["summary"]["oracle_prefix"] == pytest.approx(out[0]["oracle_prefix"][valid].float().mean().item())
    assert written["summary"]["covered_rate"] >= written["summary"]["top1_correct_rate"]
    assert f"wrote {saved.parent / 'predict.json'}" in capsys.readouterr().out
    # ... with the target it measured against, compared with the checkpoint's as bench compares it.
    assert written["same_target_as_training"] is True and written["target_weights"] == written["target_weights_trained"]
    # No batch run (limit 0): said, and the earlier predict.json is left as it was (it was silent, the old file current).
    before = (saved.parent / "predict.json").read_bytes()
    main(["predict", "-c", str(ROOT / "configs" / "tiny.yaml"), root, f"--ckpt_path={ckpt}",
          "--trainer.enable_progress_bar=false", "--trainer.limit_predict_batches=0"])
    assert "predict: no batch ran (trainer.limit_predict_batches 0" in capsys.readouterr().err
    assert (saved.parent / "predict.json").read_bytes() == before
    # A file of that name the command did not write is never replaced: refused before anything is built.
    (saved.parent / "predict.json").write_text("my notes")
    err = user_error(capsys, ["predict", "-c", str(ROOT / "configs" / "tiny.yaml"), root, f"--ckpt_path={ckpt}"])
    assert "predict.json exists and is not a results file lilicorr wrote" in err
    # The fix it names is one predict has: its file name is fixed (it said "choose another file name").
    assert err.strip().endswith("so it is not overwritten; it writes <trainer.default_root_dir>/predict.json: set "
                                "--trainer.default_root_dir to another folder, or move that file")
    assert (saved.parent / "predict.json").read_text() == "my notes"
    # Evaluating the run kept fit's record of how it was trained; each subcommand wrote its own config beside it.
    assert saved.read_bytes() == trained_with
    # A --ckpt_path trained with another head config: one line naming the checkpoint and the setting, before the data
    # and the target (it was a traceback, then a line about missing tensors once both were ready).
    err = user_error(capsys, ["validate", "-c", str(ROOT / "configs" / "tiny.yaml"), root, f"--ckpt_path={ckpt}",
                              "--model.head.init_args.num_layers=2", "--trainer.enable_progress_bar=false"])
    assert (f"--ckpt_path {ckpt} was trained with other settings (model.head.init_args.num_layers: checkpoint 1 vs now "
            "2); lilicorr validate measures a checkpoint as it was trained") in err and "Traceback" not in err
    # A decode-time head option, or another validation split of the same examples, measured silently and wrote a
    # predict.json under the checkpoint's name: refused the same way.
    scale = yaml.safe_load(trained_with)["model"]["head"]["init_args"]["logit_scale"]
    (saved.parent / "predict.json").write_bytes(before)  # predict's own results again
    err = user_error(capsys, ["predict", "-c", str(ROOT / "configs" / "tiny.yaml"), root, f"--ckpt_path={ckpt}",
                              f"--model.head.init_args.logit_scale={scale / 2}"])
    assert f"(model.head.init_args.logit_scale: checkpoint {scale!r} vs now {scale / 2!r})" in err
    assert "lilicorr predict measures a checkpoint as it was trained" in err
    seed = yaml.safe_load(trained_with)["data"]["seed"]
    err = user_error(capsys, ["validate", "-c", str(ROOT / "configs" / "tiny.yaml"), root, f"--ckpt_path={ckpt}",
                              f"--data.seed={seed + 7}"])
    assert (f"trained beside another validation split of the same data.train_files (data.seed: checkpoint {seed} vs now "
            f"{seed + 7}), so this validate would measure it on examples it trained on") in err
    # Measuring other data is the user's choice: held-out files are read with any seed.
    # A user's own file where validate and predict write their record of the run is never replaced.
    for stage in ("validate", "predict"):
        record = saved.parent / f"{stage}-config.yaml"
        kept = record.read_bytes()
        record.write_text("my notes on this run\n")
        err = user_error(capsys, [stage, "-c", str(ROOT / "configs" / "tiny.yaml"), root, f"--ckpt_path={ckpt}"])
        assert f"{record} exists and is not a record lilicorr {stage} wrote, so it is not replaced" in err
        assert record.read_text() == "my notes on this run\n"
        record.write_bytes(kept)
    # A data store damaged after fit built it, found while the subcommand runs: one line naming it and the fix.
    shard = sorted((tmp_path / "runs" / "tiny" / "cache").rglob("shard-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-16])
    err = user_error(capsys, ["validate", "-c", str(ROOT / "configs" / "tiny.yaml"), root, f"--ckpt_path={ckpt}",
                              "--trainer.enable_progress_bar=false"])
    assert "is invalid" in err and "delete" in err and "rerun prepare_data" in err and shard.name in err
    for stage in ("validate", "predict"):
        assert yaml.safe_load((saved.parent / f"{stage}-config.yaml").read_text())["ckpt_path"] == str(ckpt), stage
    # Another model under the checkpoint's target: validate and predict said nothing (bench, export and a resumed
    # fit warn), and predict.json did not record which target it measured. (Another root: its own data stores.)
    from transformers import AutoModelForCausalLM

    trained_target = yaml.safe_load(trained_with)["model"]["target"]["name_or_path"]
    other = tmp_path / "other_target"
    shutil.copytree(trained_target, other)
    model = AutoModelForCausalLM.from_pretrained(trained_target)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
    model.save_pretrained(other)
    elsewhere = tmp_path / "elsewhere"
    for command, extra in (("validate", []), ("predict", ["--trainer.limit_predict_batches=1"])):
        with pytest.warns(UserWarning, match=f"not the one this checkpoint trained against .*; {command} measures "
                                             "this drafter against another model"):
            main([command, "-c", str(ROOT / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={elsewhere}",
                  f"--ckpt_path={ckpt}", f"--model.target.name_or_path={other}",
                  "--trainer.enable_progress_bar=false", *extra])
    written = json.loads((elsewhere / "predict.json").read_text())
    assert written["target"] == str(other) and written["same_target_as_training"] is False


def test_each_subcommand_saves_its_config_under_its_own_name_of_the_given_file(tmp_path, monkeypatch):
    """A config_filename given through save_config_kwargs stays fit's; the evaluations prefix it."""
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import TrainerFn

    from lilicorr_pl.lightning_cli import LoggerSaveConfigCallback

    written = []
    monkeypatch.setattr(LoggerSaveConfigCallback, "save_record", lambda self, path: written.append(path))
    trainer = SimpleNamespace(log_dir=str(tmp_path), is_global_zero=True, loggers=[],
                              strategy=SimpleNamespace(broadcast=lambda value: value))
    callback = LoggerSaveConfigCallback(None, None, config_filename="run.yaml")
    for stage in (TrainerFn.VALIDATING, TrainerFn.FITTING, TrainerFn.PREDICTING, TrainerFn.TESTING):
        callback.already_saved = False  # each stage of its own command
        callback.setup(trainer, None, stage)
    assert written == [tmp_path / name for name in ("validate-run.yaml", "run.yaml", "predict-run.yaml",
                                                    "test-run.yaml")]

# ---------------------------------------------------------------------------- one typed command line (issue 12.3)
from conftest import user_error  # noqa: E402

from lilicorr_pl.cli import LIGHTNING, OWN_PARSER, TOOLS  # noqa: E402

SUBCOMMANDS = [*LIGHTNING, *TOOLS]


def test_top_level_help_lists_every_subcommand_with_a_plain_description(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    usage = out.split("\n\n")[0]
    assert "{" + ",".join(SUBCOMMANDS) + "}" in usage.replace("\n", "").replace(" ", "")
    for name in SUBCOMMANDS:
        line = next(line for line in out.splitlines() if line.strip().startswith(name + " "))
        assert len(line.split(None, 1)[1]) > 10 and "``" not in line, line  # plain text, not reST
    assert user_error(capsys, ["frobnicate"])  # an unknown subcommand: usage and exit status 2


@pytest.mark.parametrize("argv, line", [
    (["fit", "-c", str(ROOT / "configs" / "tiny.yaml"), "--model.head=lilicor"],
     "error: model.head: lilicor is not a class name or import path"),
    (["demo", "--steps", "x"], "error: steps: x is not a positive integer (1 or more)"),
])
def test_a_value_refused_when_parsed_is_not_buried_under_the_usage(argv, line, capsys):
    """fit's usage was 90 lines above the error (every Trainer, model and data option); it is cut to its first line,
    and --help still lists every option. The error is one line: it was jsonargparse's account of every type of the
    union it tried (``Subtypes: [<class 'lilicorr_pl.heads.base.Selector'>, <class 'NoneType'>]``, eight lines)."""
    err = user_error(capsys, argv)
    lines = err.splitlines()
    assert lines[0].startswith(f"usage: lilicorr ") and lines[0].endswith(" …"), lines[0]
    assert lines[1] == f"tip: For details of accepted options run: lilicorr {argv[0]} --help"
    assert lines[2:] == [line], err
    with pytest.raises(SystemExit):
        main([argv[0], "--help"])
    assert capsys.readouterr().out.count("\n  --") > 12  # every option, each on its own line


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_subcommand_has_help_from_its_signature_and_accepts_a_config(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: lilicorr") and name in out.split("\n")[0]
    assert "-c CONFIG, --config CONFIG" in out and "--print_config" in out
    if name in TOOLS and name not in OWN_PARSER:
        # Every parameter of the function is an option whose help is its docstring line, with its type.
        from lilicorr_pl.cli import tool_function

        import inspect

        for param in inspect.signature(tool_function(name)).parameters:
            assert f"--{param} " in out, param
        assert "(type: " in out and "default: " in out


@pytest.mark.parametrize("argv, line", [
    (["fit", "-c", TINY, "--model.target_logits=exacct"],
     "model.target_logits: exacct is not one of auto, cache, exact"),
    (["fit", "-c", TINY, "--model.target.dtype=float8"],
     "model.target.dtype: float8 is not one of float32, fp32, bfloat16, bf16, float16, fp16"),
    # A class's own option: its full key and the class (they were the class's key and the option's, apart).
    (["fit", "-c", TINY, "--model.drafter.init_args.attention=flexx"],
     "model.drafter.init_args.attention (DFlashDrafter): flexx is not one of auto, sdpa, flex"),
    (["fit", "-c", TINY, "--model.head.init_args.decode=beam"],
     "model.head.init_args.decode (LiLiCorrHead): beam is not one of greedy, viterbi, top1_start"),
    # Reported once per union member that tried it: the key once (it was offline.init_args.offline).
    (["fit", "-c", TINY, "--trainer.logger.init_args.offline=maybe"],
     "trainer.logger.init_args.offline (WandbLogger): maybe is not true/false"),
    # Callable-typed options (the optimizer, the schedule): the reason after jsonargparse's type prefix, the value
    # without the Namespace it was read into.
    (["fit", "-c", TINY, "--model.optimizer.init_args.lr=abc"],
     "model.optimizer.init_args.lr: abc is not a number or a class name or import path"),
    (["fit", "-c", TINY, "--model.optimizer.init_args.weight_decay=abc"],
     "model.optimizer.init_args.weight_decay: abc is not a number"),
    (["fit", "-c", TINY, "--model.lr_scheduler.init_args.warmup_fraction=abc"],
     "model.lr_scheduler.init_args.warmup_fraction: abc is not a number"),
    (["fit", "-c", TINY, "--model.optimizer.init_args.bogus=1"], "model.optimizer: Option 'bogus' is not accepted"),
    (["fit", "-c", TINY, "--model.optimizer=torch.optim.Nope"],
     "model.optimizer: torch.optim.Nope: module 'torch.optim' has no attribute 'Nope'"),
    (["fit", "-c", TINY, "--model.losses=[foo]"], "model.losses: foo is not a class name or import path"),
    (["fit", "-c", TINY, "--model.loss_weights=3"], "model.loss_weights: 3 is not a mapping"),
    (["fit", "-c", TINY, "--model.target=abc"], "model.target: abc is not a config file or a mapping of its keys"),
    (["fit", "-c", TINY, "--model.head=[1,2]"], "model.head: [1, 2] is not a class name or import path"),
    # A mapping typed for a dataclass option: its own key (it was model.target.init_args.model.target.dtype).
    (["fit", "-c", TINY, "--model.target={name_or_path: x, dtype: fp8}"],
     "model.target.dtype: fp8 is not one of float32, fp32, bfloat16, bf16, float16, fp16"),
    # A linked option is refused under the key it is copied to (data.target); named by the one the user gave.
    (["fit", "-c", TINY, "--model.target={name_or_path: x, bogus: 1}"],
     "model.target (TargetSpec): Option 'bogus' is not accepted"),
    # A class inside a class: every level of the key.
    (["fit", "-c", TINY, "--trainer.strategy=lightning.pytorch.strategies.DDPStrategy",
      "--trainer.strategy.init_args.cluster_environment=lightning.pytorch.plugins.environments.SLURMEnvironment",
      "--trainer.strategy.init_args.cluster_environment.init_args.auto_requeue=maybe"],
     "trainer.strategy.init_args.cluster_environment.init_args.auto_requeue (SLURMEnvironment): maybe is not "
     "true/false"),
    # A class missing a required argument: the class, not every callback's Namespace (2,000 characters).
    (["fit", "-c", TINY, "--trainer.callbacks+=lightning.pytorch.callbacks.EarlyStopping"],
     "trainer.callbacks (EarlyStopping): the following arguments are required: monitor"),
    (["fit", "-c", TINY, "--model.optimizer={class_path: torch.optim.AdamW, init_args: {lr: x}}"],
     "model.optimizer.init_args.lr: x is not a number or a class name or import path"),
    # Unions: every member is named, a union of Literals by all their choices.
    (["fit", "-c", TINY, "--trainer.precision=bf17"], "trainer.precision: bf17 is not one of 64, 32, 16, "
     "transformer-engine, transformer-engine-float16, 16-true, 16-mixed, bf16-true, bf16-mixed, 32-true, 64-true, "
     "bf16"),
    (["fit", "-c", TINY, "--trainer.logger=Nope"],
     "trainer.logger: Nope is not a class name or import path, a list or true/false"),
    (["fit", "-c", TINY, "--trainer.logger=[Nope]"], "trainer.logger: Nope is not a class name or import path or "
     "true/false"),
    (["fit", "-c", TINY, "--seed_everything=abc"], "seed_everything: abc is not true/false or an integer"),
    (["fit", "-c", TINY, "--trainer.gradient_clip_val=abc"], "trainer.gradient_clip_val: abc is not a number"),
    (["bench", "--ckpt", "x.ckpt", "--device", "gpu"], "device: gpu is not a device: cpu, cuda, cuda:N or mps"),
    (["bench", "--ckpt", "x.ckpt", "--draft_sampling", "greedy"],
     "draft_sampling: greedy is not one of both, proposal, point_mass"),
    # A value that is no number at all, for options that take no None (there was no "Given value" line to read).
    (["bench", "--ckpt", "x.ckpt", "--temperature", "abc"], "temperature: abc is not a number >= 0 (not nan)"),
    (["bench", "--ckpt", "x.ckpt", "--max_new_tokens", "1.5"],
     "max_new_tokens: 1.5 is not a positive integer (1 or more)"),
    (["bench", "--ckpt", "x.ckpt", "--num_prompts", ""], "num_prompts: '' is not a positive integer (1 or more)"),
    # An empty value, or one with spaces, quoted (an empty one was left out).
    (["bench", "--ckpt", "x.ckpt", "--draft_sampling", ""], "draft_sampling: '' is not one of both, proposal, "
     "point_mass"),
    (["bench", "--ckpt", "x.ckpt", "--device", ""], "device: '' is not a device: cpu, cuda, cuda:N or mps"),
    (["fit", "-c", TINY, "--model.num_anchors=x is y"], "model.num_anchors: 'x is y' is not an integer"),
    (["perf", "-c", TINY, "--device", "gpu"], "device: gpu is not a device: cpu, cuda, cuda:N or mps"),
    (["export", "--ckpt", "x.ckpt", "--output", "out", "--overwrite=maybe"], "overwrite: maybe is not true/false"),
    (["export", "--ckpt", "x.ckpt", "--output", "out", "--dtype", "fp8"],
     "dtype: fp8 is not one of auto, bfloat16, float16, float32"),
    (["export", "--ckpt", "x.ckpt", "--output", "out", "--head_mlp_names", "indexed"],
     "head_mlp_names: indexed is not one of named, sequential"),
    (["regenerate", "--target", "t", "--input", "i.jsonl", "--output", "o.jsonl", "--dtype", "fp8"],
     "dtype: fp8 is not one of auto, float32, fp32, bfloat16, bf16, float16, fp16"),
    (["regenerate", "--target", "t", "--input", "i.jsonl", "--output", "o.jsonl", "--limit", "-1"],
     "limit: -1 is not a positive integer (1 or more)"),
    (["demo", "--arms", "dflash,unknown_arm"],
     "arms: unknown_arm is not one of dflash, lilicorr, lilicorr_no_distractor, domino, dspark, lilicorr_joint"),
    (["demo", "--temperatures", "0", "nan"], "temperatures: nan is not a number >= 0 (not nan)"),
    (["build-target", "--preset", "huge"], "preset: huge is not one of quick, full, test"),
    (["perf", "-c", TINY, "--steps", "0"], "steps: 0 is not a positive integer (1 or more)"),
])
def test_a_bad_value_is_rejected_when_parsed(argv, line, capsys, tmp_path, monkeypatch):
    """One line: the option's key, the value and what the option takes. It was jsonargparse's account of every union
    member it tried, up to ten lines of Python types."""
    monkeypatch.chdir(tmp_path)
    err = user_error(capsys, argv)
    assert err.splitlines()[-1] == "error: " + line, err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("subcommand, text, line", [
    ("fit", "model: {num_anchors: abc}", "model.num_anchors: abc is not an integer"),
    # A linked pair: each value under the key the file gives it (model.max_length's was named data.max_length, the
    # key jsonargparse's refusal is renamed to where the link copied the value from data.max_length).
    ("fit", "model: {max_length: abc}", "model.max_length: abc is not an integer"),
    ("fit", "data: {max_length: abc}", "data.max_length: abc is not an integer"),
    ("fit", "trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.LearningRateMonitor\n"
            "      init_args: {logging_interval: hour}",
     "trainer.callbacks.init_args.logging_interval (LearningRateMonitor): hour is not one of step, epoch"),
    ("fit", "model:\n  losses:\n    - {class_path: lilicorr_pl.losses.DFlashCE, init_args: {weight: abc}}",
     "model.losses.init_args.weight (DFlashCE): abc is not a number"),
    ("bench", "ckpt: x.ckpt\nnum_prompts: 0", "num_prompts: 0 is not a positive integer (1 or more)"),
    # The second item of a list: its class (the list was printed as jsonargparse had read it, Namespaces and all).
    ("fit", "trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.LearningRateMonitor\n"
            "    - class_path: lightning.pytorch.callbacks.Nope",
     "trainer.callbacks (Nope): module 'lightning.pytorch.callbacks' has no attribute 'Nope'"),
    ("fit", "trainer:\n  strategy:\n    class_path: lightning.pytorch.strategies.DDPStrategy\n    init_args:\n"
            "      cluster_environment:\n        class_path: lightning.pytorch.plugins.environments.SLURMEnvironment\n"
            "        init_args: {auto_requeue: maybe}",
     "trainer.strategy.init_args.cluster_environment.init_args.auto_requeue (SLURMEnvironment): maybe is not "
     "true/false"),
    ("perf", "device: gpu", "device: gpu is not a device: cpu, cuda, cuda:N or mps"),
    ("export", "ckpt: x.ckpt\noutput: out\ndtype: fp8", "dtype: fp8 is not one of auto, bfloat16, float16, float32"),
])
def test_a_bad_value_in_a_config_file_is_named_by_its_key(subcommand, text, line, capsys, tmp_path, monkeypatch):
    """The key the value has in the file (the same as the option's on the command line, without the dashes), and the
    class of the list item it is in."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_text(text + "\n")
    argv = [subcommand, *(["-c", TINY] if subcommand in ("fit", "perf") else []), "-c", "bad.yaml"]
    assert user_error(capsys, argv).splitlines()[-1] == "error: " + line


@pytest.mark.parametrize("option, refusal", [
    ("--data.batch_size=-1", "data.batch_size (-1) and data.precompute_batch_size (8) must be >= 1"),
    ("--model.num_anchors=0", "num_anchors must be >= 1, got 0"),
    # Against the config the build will have: 64 positions.
    ("--data.max_length=100", "data.max_length 100 exceeds the target's max_position_embeddings 64; lower "
                              "data.max_length (or extend RoPE, e.g. YaRN)"),
    ("--data.logit_top_m=600", "data.logit_top_m 600 is more than the target's 576 output rows; keep the top M <= 576 "
                               "logits (the demo keeps 32, the Qwen3 recipes 64)"),
    # The demo's base config initialises the drafter from the target's top layers: what the config shows of that.
    ("--model.init_drafter_layers_from_target=true --model.drafter.init_args.num_layers=5",
     "the drafter has 5 layers but the target only 4; use fewer drafter layers"),
    ("--model.init_drafter_layers_from_target=true --model.drafter.init_args.intermediate_size=100",
     "target tensor model.layers.2.mlp.gate_proj.weight has shape (128, 64) but drafter layers.0.mlp.gate_proj.weight "
     "has (100, 64); initialising from the target needs the drafter at the target's sizes (leave the sizes unset)"),
])
def test_a_setting_is_refused_before_a_builtin_target_is_built(tmp_path, monkeypatch, capsys, option, refusal):
    # The data module and the system refused these only once the target was built: after up to half an hour.
    from lilicorr_pl.builtin import unbuilt_target_config

    monkeypatch.setenv("LILICORR_CACHE", str(tmp_path / "cache"))
    assert unbuilt_target_config("builtin:tiny").num_hidden_layers == 4
    err = user_error(capsys, ["fit", "-c", TINY, *option.split(), f"--trainer.default_root_dir={tmp_path / 'run'}"])
    assert err.splitlines()[-1] == f"lilicorr fit: error: {refusal}"
    assert not list((tmp_path / "cache").glob("tiny-target-*")), "the target was built before the refusal"


@pytest.mark.parametrize("command, option, refusal", [
    ("fit", "--trainer.accelerator=gpu", "No supported gpu backend found! (trainer.accelerator gpu, trainer.devices "
                                         "1); set them to what this machine has, e.g. --trainer.accelerator=cpu"),
    ("fit", "--trainer.devices=0", "`Trainer(devices='0')` value is not a valid input using cpu accelerator. "
                                   "(trainer.accelerator auto, trainer.devices 0); set them to what this machine has, "
                                   "e.g. --trainer.accelerator=cpu"),
    ("fit", "--trainer.strategy=fsdp", "The strategy `fsdp` requires a GPU accelerator, but received "
                                       "`accelerator='cpu'`. Please set `accelerator='cuda'`, `accelerator='gpu'`, or "
                                       "pass a `CUDAAccelerator()` instance to use FSDP."),
    ("fit", '--trainer.strategy={"class_path": "lightning.pytorch.strategies.FSDPStrategy"}',  # instantiated
     "The strategy `fsdp` requires a GPU accelerator, but received `accelerator='cpu'`. Please set "
     "`accelerator='cuda'`, `accelerator='gpu'`, or pass a `CUDAAccelerator()` instance to use FSDP."),
    ("fit", "--trainer.val_check_interval=-1", "You have passed invalid value -1 for val_check_interval, it has to be "
                                               "in [0.0, 1.0] or an int."),
    # The constructors' own reasons, not jsonargparse's account of the union it tried (a dump of every setting).
    ("fit", "--trainer.callbacks.every_n_train_steps=-5", "AcceptanceEval every_n_train_steps must be >= 0 or None, "
                                                          "got -5"),
    ("fit", '--trainer.strategy={"class_path": "lightning.pytorch.strategies.DeepSpeedStrategy"}',
     "To use the `DeepSpeedStrategy`, you must have DeepSpeed installed. Install it by running `pip install -U "
     "deepspeed`."),
    ("fit", "--trainer.profiler=bogus", "When passing string value for the `profiler` parameter of `Trainer`, it can "
                                        "only be one of ['simple', 'advanced', 'pytorch', 'xla']"),
    ("fit", "--trainer.logger=lightning.pytorch.loggers.MLFlowLogger",
     "Requirement 'mlflow>=1.0.0' not met. HINT: Try running `pip install -U 'mlflow>=1.0.0'`"),
    ("fit", "--trainer.num_nodes=0", "`num_nodes` must be a positive integer, but got 0."),
    ("prepare", "--trainer.accelerator=gpu", "No supported gpu backend found! (trainer.accelerator gpu, "
                                             "trainer.devices 1); set them to what this machine has, e.g. "
                                             "--trainer.accelerator=cpu"),
])
def test_a_trainer_setting_is_refused_before_a_builtin_target_is_built(tmp_path, monkeypatch, capsys, command, option,
                                                                        refusal):
    # The Trainer refused these only once the target was built, up to half an hour later; the run's own Trainer, with a
    # built target, says the same (the last test of this group).
    monkeypatch.setenv("LILICORR_CACHE", str(tmp_path / "cache"))
    err = user_error(capsys, [command, "-c", TINY, option, f"--trainer.default_root_dir={tmp_path / 'run'}"])
    assert err.splitlines()[-1] == f"lilicorr {command}: error: {refusal}"
    assert not list((tmp_path / "cache").glob("tiny-target-*")), "the target was built before the refusal"
    assert not (tmp_path / "run").exists() and not (tmp_path / "wandb").exists()


@pytest.mark.parametrize("command, option", [
    ("fit", "--trainer.accelerator=cpu --trainer.devices=2 --trainer.strategy=ddp"),
    ("fit", "--trainer.precision=16-mixed --trainer.deterministic=true"),  # Lightning warns and runs bf16 on a CPU
    # prepare reads only where its stores are made (a GPU run's config passes), and no warm start (not in its stores)
    ("prepare", "--trainer.strategy=fsdp --model.init_drafter_from=/not/here"),
    # ... nor builds what it does not read: a GPU run's strategy, a callback's setting.
    ("prepare", '--trainer.strategy={"class_path":"lightning.pytorch.strategies.DeepSpeedStrategy"} '
                "--trainer.callbacks.every_n_train_steps=-5"),
    # A callback whose argument is a class: built with it, as the run builds it (it was passed a dict).
    ("fit", "--trainer.callbacks+=test_cli.ModuleCallback --trainer.callbacks.module=torch.nn.Identity"),
])
def test_trainer_settings_this_machine_runs_pass_the_check_before_a_build(tmp_path, monkeypatch, command, option):
    from lilicorr_pl import lightning_cli
    from lilicorr_pl.data.datamodule import DraftDataModule
    from lilicorr_pl.system import DraftSystem

    class Reached(Exception):
        pass

    def build(*args, **kwargs):
        raise Reached

    monkeypatch.setenv("LILICORR_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(lightning_cli.builtin, "resolve_target_path", build)
    cli_class = lightning_cli.PrepareCLI if command == "prepare" else lightning_cli.LilicorrCLI
    args = ([] if command == "prepare" else [command]) + ["-c", TINY, *option.split(),
                                                          f"--trainer.default_root_dir={tmp_path / 'run'}"]
    flags = (torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    with pytest.raises(Reached):  # checked, and on to the build, with nothing written by the check
        cli_class(DraftSystem, DraftDataModule, args=args, **({"run": False} if command == "prepare" else {}))
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob("lightning_logs"))
    # The Trainer built to check sets process-wide flags (deterministic=true): put back, for the run's own to set.
    assert (torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG")) == flags


def test_a_reporting_callback_given_as_a_mapping_is_checked_before_a_build(tmp_path, monkeypatch):
    # lilicorr demo hands its stages a ProgressFile as {"class_path", "init_args"}: built and checked like a config's.
    from lilicorr_pl import lightning_cli
    from lilicorr_pl.data.datamodule import DraftDataModule
    from lilicorr_pl.system import DraftSystem

    monkeypatch.setenv("LILICORR_CACHE", str(tmp_path / "cache"))
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}\n')
    reporting = {"callbacks": [{"class_path": "callbacks.ProgressFile", "init_args": {"path": str(notes)}}]}
    with pytest.raises(lightning_cli.UserInputError, match="notes.json exists and is not a progress record"):
        lightning_cli.LilicorrCLI(DraftSystem, DraftDataModule, reporting=reporting,
                                  args=["fit", "-c", TINY, f"--trainer.default_root_dir={tmp_path / 'run'}"])
    _no_build(tmp_path)
    assert notes.read_text() == '{"mine": true}\n'


class ModuleCallback(__import__("lightning").pytorch.Callback):
    """A callback with a class as its argument (jsonargparse builds it from its class_path)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.parameters = sum(1 for _ in module.parameters())


def test_the_trainers_refusal_after_a_build_is_the_same_line(tmp_path, capsys):
    # With the target already built the run's own Trainer refuses (no check before), in the same words as the check.
    from lilicorr_pl import builtin

    builtin.resolve_target_path("builtin:tiny")  # built once per machine, as the tiny runs of these tests build it
    assert builtin.unbuilt_target_config("builtin:tiny") is None
    err = user_error(capsys, ["fit", "-c", TINY, "--trainer.accelerator=gpu",
                              f"--trainer.default_root_dir={tmp_path / 'run'}"])
    assert err.splitlines()[-1] == ("lilicorr fit: error: No supported gpu backend found! (trainer.accelerator gpu, "
                                    "trainer.devices 1); set them to what this machine has, e.g. "
                                    "--trainer.accelerator=cpu")


def _no_build(tmp_path):
    assert not list((tmp_path / "cache").glob("tiny-target-*")), "the target was built before the refusal"


@pytest.mark.parametrize("command, extra, refusal", [
    ("validate", ["--ckpt_path=nope.ckpt"], "checkpoint nope.ckpt does not exist; pass a .ckpt written by `lilicorr "
                                            "fit`"),
    ("fit", ["--ckpt_path=nope.ckpt"], "checkpoint nope.ckpt does not exist; pass a .ckpt written by `lilicorr fit`"),
    ("validate", ["--ckpt_path=best"], "--ckpt_path best names the best checkpoint of a fit run in the same process"),
    ("fit", ["--model.init_drafter_from=no/such/dir"], "no/such/dir is not a DFlash drafter directory (needs "
                                                       "config.json and model.safetensors)"),
    ("fit", ["--model.init_head_from=no/such/dir"], "no/such/dir is not a DFlash drafter directory (needs config.json "
                                                    "and model.safetensors)"),
    ("fit", ["--trainer.callbacks+=callbacks.ProgressFile", "--trainer.callbacks.path=notes.txt"],
     "ProgressFile path: notes.txt exists and is not a progress record `lilicorr fit` wrote, so it is not overwritten; "
     "move it or choose another ProgressFile path"),
    ("fit", ["--trainer.callbacks+=callbacks.AcceptanceEval", "--trainer.callbacks.max_new_tokens=5000"],
     "AcceptanceEval max_new_tokens 5000 leaves no room for a prompt in the target's context of 64 positions; lower "
     "it below 64"),
])
def test_checkpoint_warm_start_and_callback_checks_come_before_a_builtin_target_build(tmp_path, monkeypatch, capsys,
                                                                                    command, extra, refusal):
    # They came after the build (up to half an hour): --ckpt_path's checks in Lightning's own order, the warm starts in
    # the system's constructor, the callbacks' once the Trainer was built.
    monkeypatch.setenv("LILICORR_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("my notes\n")
    err = user_error(capsys, [command, "-c", TINY, *extra, f"--trainer.default_root_dir={tmp_path / 'run'}"])
    assert err.splitlines()[-1].startswith(f"lilicorr {command}: error: {refusal}"), err
    _no_build(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "my notes\n"


def _tiny_run(root):
    """The tiny config's options for a quiet run in ``root`` that validates after every step."""
    return ["-c", TINY, f"--trainer.default_root_dir={root}", "--trainer.enable_progress_bar=false",
            "--trainer.limit_val_batches=1", "--trainer.val_check_interval=1"]


@pytest.mark.parametrize("built", [True, False])
def test_a_fit_that_would_leave_a_trained_part_at_its_random_initialisation_is_refused(tmp_path, monkeypatch, capsys,
                                                                                        built):
    """A LiLiCorr head with its lattice losses off, a Domino head with its curriculum loss left out, and the head
    stage's frozen drafter with no warm start trained without a word (the head, or the drafter under it, stayed
    random, exit 0). Refused before the data are prepared, and before a built-in target's build; the same settings
    with a warm start, or resumed, run."""
    from lilicorr_pl import builtin

    monkeypatch.setenv("LILICORR_CACHE", str(tmp_path / "cache"))
    if built:
        builtin.resolve_target_path("builtin:tiny")
    root = tmp_path / "run"
    fit = ["fit", "-c", TINY, f"--trainer.default_root_dir={root}", "--trainer.max_steps=1"]
    domino = ["--model.head=lilicorr_pl.heads.DominoHead", "--model.head.init_args.gru_hidden=8",
              "--model.head.init_args.rank=4", "--model.losses=[{class_path: lilicorr_pl.losses.DFlashCE}]"]
    for flags, said in (
            (["--model.disabled_losses=[oracle_prefix_ce, distractor_penalty]"],
             "model.head LiLiCorrHead has weights that no active loss trains (no lattice loss in model.losses is "
             "enabled with a weight > 0): it would stay at its random initialisation; enable one "
             "(model.disabled_losses, model.loss_weights), warm-start it (model.init_head_from), or drop the head "
             "(model.head: null, as configs/ablations/dflash_only.yaml)"),
            (["--model.loss_weights={oracle_prefix_ce: 0, distractor_penalty: 0}"],
             "model.head LiLiCorrHead has weights that no active loss trains (no lattice loss"),
            (domino, "model.head DominoHead has weights that no active loss trains (no corrector loss"),
            (["-c", str(ROOT / "configs" / "ablations" / "head_stage.yaml")],
             "model.freeze_drafter: true with no warm start keeps the drafter at its random initialisation, and the "
             "head would learn to correct a random drafter; set model.init_drafter_from=<a served drafter directory> "
             "(`lilicorr export` of a trained checkpoint), or model.freeze_drafter: false"),
            # --ckpt_path=last with nothing to resume yet (a batch job's first submission) is a new run.
            (["-c", str(ROOT / "configs" / "ablations" / "head_stage.yaml"), "--ckpt_path=last"],
             "model.freeze_drafter: true with no warm start keeps the drafter at its random initialisation"),
            # No FlexAttention backward on a CPU: a traceback at the first step, once the data were made.
            *([(["--model.drafter.init_args.attention=flex"], "model.drafter.init_args.attention 'flex' cannot train "
                                                              "on a CPU (FlexAttention has no backward there)")]
              if not torch.cuda.is_available() else [])):
        err = user_error(capsys, [*fit, *flags])
        assert err.splitlines()[-1].startswith(f"lilicorr fit: error: {said}"), err
        assert not (root / "cache").exists()
        if not built:
            _no_build(tmp_path)
    main([*fit, *_tiny_run(root)[2:]])  # a trained checkpoint, then the head stage warm-started from its drafter
    stage = main([*fit, "-c", str(ROOT / "configs" / "ablations" / "head_stage.yaml"), *FROZEN_FROM_TARGET,
                  f"--trainer.default_root_dir={tmp_path / 'stage'}", "--trainer.enable_progress_bar=false"])
    assert stage.trainer.global_step == 1
    # Resumed from its last checkpoint, the frozen drafter is the checkpoint's: no warm start needed. A run recorded
    # with load_kwargs torch_dtype (accepted before; ignored beside dtype) resumes too: only a new run is refused.
    resumed = main([*fit, "-c", str(ROOT / "configs" / "ablations" / "head_stage.yaml"), "--ckpt_path=last",
                    f"--trainer.default_root_dir={tmp_path / 'stage'}", "--trainer.enable_progress_bar=false",
                    "--trainer.max_steps=2", "--model.target.load_kwargs={torch_dtype: float32}"])
    assert resumed.trainer.global_step == 2


def test_a_run_folders_records_are_checked_before_a_builtin_target_build(tmp_path, monkeypatch, capsys):
    # A fit over another run's config.yaml, and a validate over a user's validate-config.yaml, were refused only once
    # the Trainer was built: after a built-in target's build (up to half an hour). Now before it; the same command
    # again and a resume with changed settings still run, and build the target.
    from lilicorr_pl import builtin

    monkeypatch.setenv("LILICORR_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "run"
    common = _tiny_run(root)
    main(["fit", *common, "--trainer.max_steps=1"])
    record = (root / "config.yaml").read_text()
    shutil.rmtree(builtin.target_folder("builtin:tiny"))
    err = user_error(capsys, ["fit", *common, "--trainer.max_steps=2"])
    assert err.splitlines()[-1] == (
        f"lilicorr fit: error: {root / 'config.yaml'} records another run (its trainer.max_steps: 1, this run's: 2); "
        "resume that run with --ckpt_path=last, or write this one elsewhere with another --trainer.default_root_dir")
    _no_build(tmp_path)
    (root / "validate-config.yaml").write_text("mine: true\n")
    err = user_error(capsys, ["validate", *common, "--ckpt_path=last"])
    assert err.splitlines()[-1] == (
        f"lilicorr validate: error: {root / 'validate-config.yaml'} exists and is not a record lilicorr validate "
        "wrote, so it is not replaced; move that file, or write this validate elsewhere with another "
        "--trainer.default_root_dir")
    _no_build(tmp_path)
    assert (root / "config.yaml").read_text() == record
    assert (root / "validate-config.yaml").read_text() == "mine: true\n"
    assert main(["fit", *common, "--trainer.max_steps=1"]).trainer.global_step == 1  # a retry: built, and run
    shutil.rmtree(builtin.target_folder("builtin:tiny"))
    cli = main(["fit", *common, "--trainer.max_steps=2", "--ckpt_path=last"])  # a resume with a changed setting
    assert cli.trainer.global_step == 2 and os.path.isdir(builtin.target_folder("builtin:tiny"))
    assert (root / "config-until-step1.yaml").read_text() == record


def test_a_resume_checks_its_checkpoint_against_the_folder_a_build_will_have(tmp_path, monkeypatch, capsys):
    # A run's checkpoint records its built target's folder; resumed where that target is not built (another machine,
    # a cleared cache), the settings are compared with the folder the build will have, then the target is built and
    # the run resumes. A checkpoint whose target was another is refused before the build.
    from lilicorr_pl import builtin

    monkeypatch.setenv("LILICORR_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "run"
    common = _tiny_run(root)
    main(["fit", *common, "--trainer.max_steps=1"])
    folder = builtin.target_folder("builtin:tiny")
    assert os.path.isdir(folder) and folder.startswith(str(tmp_path / "cache"))
    shutil.rmtree(folder)
    err = user_error(capsys, ["fit", *common, "--trainer.max_steps=2", "--ckpt_path=last",
                              "--model.target.name_or_path=builtin:quick"])
    assert err.splitlines()[-1].startswith(
        f"lilicorr fit: error: cannot resume: the checkpoint was trained with other target settings "
        f"(model.target.name_or_path: checkpoint '{folder}' vs now '{builtin.target_folder('builtin:quick')}')"), err
    _no_build(tmp_path)
    cli = main(["fit", *common, "--trainer.max_steps=2", "--ckpt_path=last"])
    assert cli.trainer.global_step == 2 and os.path.isdir(folder)
    assert cli.model.target_spec.name_or_path == folder


def test_a_run_resumes_and_is_measured_where_the_cache_folder_is_another(tmp_path, monkeypatch, capsys):
    # A run records its built-in target's folder and data files in the cache folder of the node it ran on. On a node
    # with another $LILICORR_CACHE (or $HOME) the same builds were refused: the resume as another target, a retry of
    # the same command as another run, the run's own config.yaml and bench/export as naming a missing path.
    from lilicorr_pl import builtin
    from lilicorr_pl.checkpoint import CheckpointError
    from lilicorr_pl.system import DraftSystem

    root = tmp_path / "run"
    common = _tiny_run(root)
    monkeypatch.setenv("LILICORR_CACHE", str(tmp_path / "a"))
    main(["fit", *common, "--trainer.max_steps=1"])
    first = builtin.target_folder("builtin:tiny")
    (tmp_path / "a").rename(tmp_path / "elsewhere")  # the first node's cache folder is not on this one
    monkeypatch.setenv("LILICORR_CACHE", str(tmp_path / "b"))
    cli = main(["fit", *common, "--trainer.max_steps=2", "--ckpt_path=last"])
    here = builtin.target_folder("builtin:tiny")
    assert here != first and Path(here).name == Path(first).name
    assert cli.trainer.global_step == 2 and cli.model.target_spec.name_or_path == here
    assert main(["fit", *common, "--trainer.max_steps=2"]).trainer.global_step == 2  # the same settings: a retry
    record = yaml.safe_load((root / "config.yaml").read_text())
    assert record["model"]["target"]["name_or_path"] == here
    assert record["data"]["train_files"][0].startswith(str(tmp_path / "b"))
    # The run's data stores are found again: keyed by the build's name and weights, not its folder (one per folder).
    assert len(list((root / "cache").glob("logits-*"))) == 1

    (tmp_path / "b").rename(tmp_path / "b-gone")
    monkeypatch.setenv("LILICORR_CACHE", str(tmp_path / "empty"))
    ckpt = root / "checkpoints" / "last.ckpt"
    for command in (["bench", "--benchmark", "stdlib-heldout"], ["export", "--output", str(tmp_path / "served")]):
        err = user_error(capsys, [*command, "--ckpt", str(ckpt)])
        assert err.splitlines()[-1] == (
            f"lilicorr {command[0]}: error: checkpoint {ckpt} loads its target from {here}, which is not a directory "
            "on this machine; pass --target builtin:tiny, which builds a target of the same build key here"), err
    assert not (tmp_path / "served").exists()
    monkeypatch.setenv("LILICORR_CACHE", str(tmp_path / "elsewhere"))  # a cache holding the same build: used
    capsys.readouterr()
    system = DraftSystem.from_checkpoint(ckpt, load_target=False)
    assert system.target_spec.name_or_path == str(tmp_path / "elsewhere" / Path(here).name)
    err = capsys.readouterr().err
    assert "is not on this machine; a build of the same key is in this machine's cache, and is used" in err
    # Recorded relative (a relative LILICORR_CACHE), it read as a hub id; named with --target, it had no hint.
    relative = tmp_path / "relative.ckpt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    saved["hyper_parameters"]["target"]["name_or_path"] = f"relcache/{Path(here).name}"
    save_edited(saved, relative)
    assert DraftSystem.from_checkpoint(relative, load_target=False).target_spec.name_or_path == \
        system.target_spec.name_or_path
    monkeypatch.setenv("LILICORR_CACHE", str(tmp_path / "empty"))
    with pytest.raises(CheckpointError, match=f"loads its target from relcache/{Path(here).name}, which is not a "
                                              "directory on this machine; pass --target builtin:tiny"):
        DraftSystem.from_checkpoint(relative, load_target=False, builtin_name=builtin.builtin_name_of)
    with pytest.raises(CheckpointError, match=f"--target {here} is not a directory on this machine; pass --target "
                                              "builtin:tiny, which builds"):
        DraftSystem.from_checkpoint(ckpt, load_target=False, target_path=here, builtin_name=builtin.builtin_name_of)
    with pytest.raises(CheckpointError, match="which is not a directory on this machine; pass the same target model's "
                                              r"directory or hub name \(--target\)"):  # the core names no command
        DraftSystem.from_checkpoint(relative, load_target=False)
    monkeypatch.setenv("LILICORR_CACHE", str(tmp_path / "elsewhere"))

    # The run's own record, read back here: its built-in paths are this machine's builds of the same keys; and the
    # training files are the same data, so another validation split of them is refused (it read as other data).
    evaluate = ["validate", "-c", str(root / "config.yaml"), f"--ckpt_path={ckpt}",
                f"--trainer.default_root_dir={tmp_path / 'measured'}"]
    with pytest.raises(SystemExit) as exit_info:
        main([*evaluate, "--data.seed=7"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    assert "lilicorr: model.target.name_or_path " + here + " is not on this machine; builtin:tiny has the same" in err
    assert "data.train_files " in err and "builtin:stdlib-train:64 has the same build key" in err
    assert err.splitlines()[-1].startswith(f"lilicorr validate: error: --ckpt_path {ckpt} trained beside another "
                                           "validation split of the same data.train_files (data.seed: checkpoint 0 vs "
                                           "now 7)"), err
    cli = main([*evaluate, "--trainer.enable_progress_bar=false"])
    assert "val/loss" in cli.trainer.callback_metrics
    assert cli.model.target_spec.name_or_path == system.target_spec.name_or_path


def test_a_recorded_builtin_path_is_named_once_per_machine(tmp_path, monkeypatch, capsys):
    # The model's and the data's target (linked) once; and on one process of a machine: each of DDP's ranks parses.
    from jsonargparse import Namespace

    from lilicorr_pl import builtin
    from lilicorr_pl.lightning_cli import adopt_recorded_builtins

    gone = str(tmp_path / "gone" / Path(builtin.target_folder("builtin:tiny")).name)
    data = str(tmp_path / "gone" / "data" / Path(builtin.resolve_data_file("builtin:stdlib-train:8")).name)
    mine = str(tmp_path / "gone" / "data" / "stdlib-train-8-2000-000000000000.jsonl")  # another standard library's

    def config() -> Namespace:
        return Namespace(model=Namespace(target=Namespace(name_or_path=gone)),
                         data=Namespace(target=Namespace(name_or_path=gone), train_files=[data], val_files=mine))

    for rank, said in (("0", 2), ("1", 0)):
        monkeypatch.setenv("LOCAL_RANK", rank)
        adopted = config()
        adopt_recorded_builtins(adopted)
        assert adopted.model.target.name_or_path == adopted.data.target.name_or_path == "builtin:tiny"
        assert adopted.data.train_files == ["builtin:stdlib-train:8"] and adopted.data.val_files == mine
        assert capsys.readouterr().err.count("is not on this machine") == said


def test_perf_reads_an_unbuilt_builtin_targets_shapes_without_building_it(tmp_path, monkeypatch, capsys):
    # --cost_model and --round_timing read shapes only: the config the build will have (it was a build of minutes).
    monkeypatch.setenv("LILICORR_CACHE", str(tmp_path / "cache"))
    err = user_error(capsys, ["perf", "--cost_model", "true", "-c", TINY, "--tau", "100"])
    assert err.splitlines()[-1].startswith("lilicorr perf: error: --tau 100 is not a possible acceptance length")
    result = main(["perf", "--cost_model", "true", "-c", TINY])
    _no_build(tmp_path)
    from lilicorr_pl.builtin import unbuilt_target_config

    preview = unbuilt_target_config("builtin:tiny")
    assert result["settings"]["target"] == (f"Qwen3 ({preview.num_hidden_layers} layers, hidden {preview.hidden_size}, "
                                            f"vocab {preview.vocab_size})")


def test_a_run_records_lilicorrs_own_commit_apart_from_the_working_directorys(tmp_path, monkeypatch):
    from lilicorr_pl import __version__, lightning_cli
    from lilicorr_pl.lightning_cli import git_commit, lilicorr_commit

    class Logger:  # stands for a WandbLogger: what the callback hands to the run's config
        def __init__(self):
            self.experiment = type("Run", (), {"config": type("Config", (), {"update": self.update})()})()
            self.recorded = {}

        def update(self, values, allow_val_change):
            self.recorded.update(values)

    logger = Logger()
    monkeypatch.setattr(lightning_cli, "WandbLogger", Logger)
    callback = lightning_cli.LoggerSaveConfigCallback.__new__(lightning_cli.LoggerSaveConfigCallback)
    callback.parser = type("Parser", (), {"dump": staticmethod(lambda *a, **k: "model: {}\n")})()
    callback.config = None
    callback.save_config(type("Trainer", (), {"loggers": [logger]})(), None, "fit")
    assert logger.recorded["lilicorr_version"] == __version__ and logger.recorded["stage"] == "fit"
    assert logger.recorded["lilicorr_commit"] == lilicorr_commit() and "git_commit" in logger.recorded

    if (ROOT / ".git").exists():  # a checkout (CI clones one): its HEAD
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        assert lilicorr_commit() == head and len(head) == 40
    monkeypatch.chdir(tmp_path)
    assert git_commit() is None  # not a repository
    # An installed copy inside a user's project (a virtual environment there): not the project's commit.
    project = tmp_path / "project"
    site = project / ".venv" / "site-packages"
    (site / "lilicorr_pl").mkdir(parents=True)
    env = {**os.environ, "GIT_AUTHOR_NAME": "u", "GIT_AUTHOR_EMAIL": "u@x", "GIT_COMMITTER_NAME": "u",
           "GIT_COMMITTER_EMAIL": "u@x"}
    for args in (["init", "-q"], ["commit", "-q", "--allow-empty", "-m", "theirs"]):
        subprocess.run(["git", *args], cwd=project, env=env, check=True, capture_output=True)
    assert git_commit(project) is not None and lilicorr_commit(site) is None
    assert lilicorr_commit(project) == git_commit(project)  # a checkout whose top is the package's folder


@pytest.mark.parametrize("options, refusal", [
    (["--lattice_k", "9"], "--lattice_k 9 is outside 1..4: the head was trained with K=4 and can serve any k <= 4"),
    (["--selectors", "top1,domino"], "selector 'domino' is not available in this checkpoint (its head is "
                                     "LiLiCorrHead, registered as 'lilicorr'); use --selectors top1 or top1,lilicorr"),
    (["--temperature", "0,0"], "--temperature 0,0 names a temperature twice; give each once"),
    # Named as the user gave it, not by the folder that stood in for the build.
    (["--target", "builtin:quick"], "checkpoint {ckpt} was trained on a target of hidden size 64, and --target "
                                    "builtin:quick has hidden size 192; pass the target model it was trained with "
                                    "(--target)"),
    (["--target", "builtin:nope"], "--target: unknown built-in target 'builtin:nope'; use one of ['builtin:tiny', "
                                   "'builtin:quick', 'builtin:full'] or a hub name / local path"),
])
def test_bench_checks_its_drafter_and_options_before_a_builtin_target_is_built(tiny_run, tmp_path, monkeypatch, capsys,
                                                                              options, refusal):
    # Against the config the build will have; they were refused after the build (minutes for builtin:full).
    _, ckpt = tiny_run
    monkeypatch.setenv("LILICORR_CACHE", str(tmp_path / "cache"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):\n"}) + "\n")
    target = ["--target", "builtin:tiny"] if "--target" not in options else []
    err = user_error(capsys, ["bench", "--ckpt", str(ckpt), *target, "--benchmark", str(prompts),
                              "--num_prompts", "1", "--max_new_tokens", "4", *options])
    assert err.splitlines()[-1] == f"lilicorr bench: error: {refusal.format(ckpt=ckpt)}"
    _no_build(tmp_path)


def test_a_damaged_or_mismatched_warm_start_is_refused_before_a_builtin_target_is_built(tiny_run, tmp_path,
                                                                                       monkeypatch, capsys):
    _, ckpt = tiny_run
    main(["export", "--ckpt", str(ckpt), "--output", str(tmp_path / "exp")])
    monkeypatch.setenv("LILICORR_CACHE", str(tmp_path / "cache"))
    shutil.copytree(tmp_path / "exp", tmp_path / "cut")
    weights = tmp_path / "cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    base = ["fit", "-c", TINY, f"--trainer.default_root_dir={tmp_path / 'run'}"]
    err = user_error(capsys, [*base, f"--model.init_drafter_from={tmp_path / 'cut'}"])
    assert err.splitlines()[-1].startswith(f"lilicorr fit: error: {weights} cannot be read as safetensors"), err
    err = user_error(capsys, [*base, f"--model.init_drafter_from={tmp_path / 'exp'}",
                              "--model.drafter.init_args.num_layers=3"])
    assert err.splitlines()[-1] == (f"lilicorr fit: error: model.init_drafter_from={tmp_path / 'exp'} does not match "
                                    "model.drafter (num_layers 3 vs the directory's 2); set num_layers, block_size, "
                                    "target layer ids and mask_token_id to the released drafter's config.json")
    # The Trainer's own check of its callbacks: the shipped ModelCheckpoint with checkpointing off.
    err = user_error(capsys, [*base, "--trainer.enable_checkpointing=false"])
    assert err.splitlines()[-1] == ("lilicorr fit: error: Trainer was configured with `enable_checkpointing=False` but "
                                    "found `ModelCheckpoint` in callbacks list.")
    _no_build(tmp_path)


def test_a_file_where_the_run_writes_a_folder_is_refused_before_any_work(tmp_path, capsys):
    # A file named checkpoints: training ran, then the first save failed with a traceback, nothing saved. A folder named
    # config.yaml: a traceback once the data stores were written.
    root = tmp_path / "run"
    root.mkdir()
    (root / "checkpoints").write_text("my notes\n")
    err = user_error(capsys, ["fit", "-c", TINY, f"--trainer.default_root_dir={root}"])
    assert err.splitlines()[-1] == (f"lilicorr fit: error: the checkpoints' folder {root / 'checkpoints'}: "
                                    f"{root / 'checkpoints'} is a file, so the directory cannot be created; choose "
                                    "another path")
    assert (root / "checkpoints").read_text() == "my notes\n"
    (root / "checkpoints").unlink()
    (root / "config.yaml").mkdir()
    err = user_error(capsys, ["fit", "-c", TINY, f"--trainer.default_root_dir={root}"])
    assert err.splitlines()[-1] == (f"lilicorr fit: error: {root / 'config.yaml'} is a folder, where the run writes "
                                    "its config record; move it, or choose another --trainer.default_root_dir")
    assert sorted(p.name for p in root.iterdir()) == ["config.yaml"]


def test_resuming_last_where_only_other_checkpoints_are_left_names_the_newest(tiny_run, tmp_path, capsys):
    # Lightning warned "no last checkpoint available ... set save_last=True" (it is set) and trained from step 0.
    _, ckpt = tiny_run
    root = tmp_path / "run"
    (root / "checkpoints").mkdir(parents=True)
    for name in ("step=1.ckpt", "step=2.ckpt"):
        shutil.copy(ckpt, root / "checkpoints" / name)
    newest = root / "checkpoints" / "step=2.ckpt"
    os.utime(root / "checkpoints" / "step=1.ckpt", (1, 1))
    err = user_error(capsys, ["fit", "-c", TINY, f"--trainer.default_root_dir={root}", "--ckpt_path=last"])
    assert err.splitlines()[-1] == (f"lilicorr fit: error: --ckpt_path=last: there is no last checkpoint in "
                                    f"{root / 'checkpoints'}, but there are others; resume from the newest with "
                                    f"--ckpt_path {newest}, or start over without --ckpt_path")
    # validate does not resume: its own refusal, which says to pass the file to evaluate.
    err = user_error(capsys, ["validate", "-c", TINY, f"--trainer.default_root_dir={root}", "--ckpt_path=last"])
    assert "there is no last checkpoint under this run's root" in err and "pass the .ckpt to evaluate" in err, err


def test_a_data_section_file_is_checked_before_a_builtin_target_is_built(tmp_path, monkeypatch, capsys):
    # --data FILE: jsonargparse's __path__ beside the settings was passed to the data module's constructor.
    monkeypatch.setenv("LILICORR_CACHE", str(tmp_path / "cache"))
    (tmp_path / "data.yaml").write_text("train_files: ['builtin:stdlib-train:64']\nmax_length: 64\nbatch_size: -1\n")
    err = user_error(capsys, ["fit", "-c", TINY, "--data", str(tmp_path / "data.yaml")])
    assert err.splitlines()[-1] == ("lilicorr fit: error: data.batch_size (-1) and data.precompute_batch_size (8) must "
                                    "be >= 1")


def test_the_check_before_a_target_build_uses_the_clis_own_classes(tmp_path, monkeypatch):
    # A user's data module with a setting of its own was refused by DraftDataModule's constructor.
    from lilicorr_pl import lightning_cli
    from lilicorr_pl.data.datamodule import DraftDataModule
    from lilicorr_pl.system import DraftSystem

    class ShuffledData(DraftDataModule):
        def __init__(self, *args, shuffle_seed: int = 0, **kwargs):
            super().__init__(*args, **kwargs)
            if shuffle_seed < 0:
                raise ValueError(f"data.shuffle_seed must be >= 0, got {shuffle_seed}")

    class Reached(Exception):
        pass

    def build(*args, **kwargs):
        raise Reached

    monkeypatch.setenv("LILICORR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(lightning_cli.builtin, "resolve_target_path", build)
    args = ["fit", "-c", TINY, f"--trainer.default_root_dir={tmp_path / 'run'}"]
    with pytest.raises(Reached):  # checked, and on to the build
        lightning_cli.LilicorrCLI(DraftSystem, ShuffledData, args=[*args, "--data.shuffle_seed=5"])
    with pytest.raises(lightning_cli.UserInputError, match="data.shuffle_seed must be >= 0, got -1"):
        lightning_cli.LilicorrCLI(DraftSystem, ShuffledData, args=[*args, "--data.shuffle_seed=-1"])


def test_a_parse_error_other_than_a_refused_value_is_left_as_it_is(capsys):
    from lilicorr_pl.command import plain_parse_error

    for message in ("unrecognized arguments: --nope 3", "the following arguments are required: ckpt"):
        assert plain_parse_error(message) == message
    # A refusal that is not of a value's type keeps its reason, on one line.
    err = user_error(capsys, ["fit", "-c", TINY, "--model.lr_scheduler=torch.optim.lr_scheduler.StepLR"])
    assert err.splitlines()[-1] == "error: model.lr_scheduler: the following arguments are required: step_size", err
    # A nested parser's refusal reaches the parser above it as jsonargparse wrote it, so the key is spelled in full.
    err = user_error(capsys, ["fit", "-c", TINY, "--model.drafter.init_args.num_layers=two"])
    assert err.splitlines()[-1] == "error: model.drafter.init_args.num_layers (DFlashDrafter): two is not an integer"
    assert user_error(capsys, ["bench", "--nope", "3"]).splitlines()[-1] == "error: unrecognized arguments: --nope 3"
    # A word after a flag is the flag's value, refused as its (it was "unrecognized arguments: maybe").
    err = user_error(capsys, ["bench", "--compile", "maybe"])
    assert err.splitlines()[-1] == "error: compile: maybe is not true/false"


@pytest.mark.parametrize("option, fix", [
    ("--model.max_length=5", "--model.max_length is set from --data.max_length, which it always equals; set "
                             "--data.max_length instead"),
    ("--data.target={name_or_path: x}", "--data.target is set from --model.target, which it always equals; set "
                                        "--model.target instead"),
    ("--data.target.name_or_path=x", "--data.target.name_or_path is set from --model.target, which it always equals; "
                                     "set --model.target.name_or_path instead"),
])
def test_an_option_a_link_sets_is_refused_on_the_command_line(capsys, option, fix):
    # It was jsonargparse's "argument data.max_length --> model.max_length: int | None is not callable", or
    # "unrecognized arguments".
    assert user_error(capsys, ["fit", "-c", TINY, option]).splitlines()[-1] == f"lilicorr fit: error: {fix}"
    # A key the source has not: no option to point to (it said "set --model.target.nme instead", itself refused).
    for command in ("fit", "prepare"):
        err = user_error(capsys, [command, "-c", TINY, "--data.target.nme=3"])
        assert err.splitlines()[-1] == (f"lilicorr {command}: error: --data.target.nme is not an option: data.target "
                                        "is set from --model.target, which has no nme; drop it")


def _configs(tmp_path, texts):
    """Each text written as a config file; ``-c`` before each."""
    args = []
    for i, text in enumerate(texts):
        (tmp_path / f"c{i}.yaml").write_text(text)
        args += ["-c", str(tmp_path / f"c{i}.yaml")]
    return args


def test_a_config_files_value_for_an_option_a_link_sets_is_refused_unless_it_agrees(tmp_path, capsys):
    # The link overwrote it without a word: model.max_length 5 trained at data.max_length's 64.
    err = user_error(capsys, ["fit", "-c", TINY, *_configs(tmp_path, ["model:\n  max_length: 5\n"])])
    assert err.splitlines()[-1] == (
        f"lilicorr fit: error: model.max_length 5 in config file {tmp_path / 'c0.yaml'} would be overwritten by "
        "data.max_length (64), which sets it; drop model.max_length from that config, or set data.max_length instead")
    # A mapping's keys one by one; an inline config is named as one.
    err = user_error(capsys, ["fit", "-c", TINY, "-c", "{data: {target: {dtype: float16}}}"])
    assert err.splitlines()[-1] == (
        "lilicorr fit: error: data.target.dtype float16 in the inline -c config would be overwritten by "
        "model.target.dtype (float32), which sets it; drop data.target.dtype from that config, or set "
        "model.target.dtype instead")
    # A section's own file (--model FILE) too, and -cFILE.
    (tmp_path / "model.yaml").write_text("max_length: 5\n")
    err = user_error(capsys, ["fit", "-c", TINY, "--model", str(tmp_path / "model.yaml")])
    assert err.splitlines()[-1].startswith(f"lilicorr fit: error: model.max_length 5 in config file {tmp_path}"), err
    err = user_error(capsys, ["fit", "-c", TINY, f"-c{tmp_path / 'c0.yaml'}"])
    assert err.splitlines()[-1].startswith(f"lilicorr fit: error: model.max_length 5 in config file {tmp_path}"), err
    # A key the source has not (a typo, dropped with the rest without a word); a YAML date shown as written.
    err = user_error(capsys, ["fit", "-c", TINY, "-c", "{data: {target: {nme: x}}}"])
    assert err.splitlines()[-1] == ("lilicorr fit: error: data.target.nme in the inline -c config is not an option: "
                                    "data.target is set from model.target, which has no nme; drop it from that config")
    err = user_error(capsys, ["fit", "-c", TINY, "-c", "{data: {target: {name_or_path: 2024-01-01}}}"])
    assert err.splitlines()[-1].startswith('lilicorr fit: error: data.target.name_or_path "2024-01-01" in the '
                                           'inline'), err


def test_a_mapping_two_configs_set_is_their_merge_as_the_command_line_merges(tmp_path, capsys, monkeypatch):
    """``-c margin.yaml -c penalty_heavy.yaml`` (README: penalty_heavy applies after a LiLiCorr overlay): the later
    file's ``loss_weights`` replaced the earlier one's whole, so the run trained the base weights under the margin
    variant's name, while the same weight on the command line was merged in. Configs now overlay a mapping key by key;
    what --print_config prints is what the run records and trains."""
    import yaml

    monkeypatch.chdir(tmp_path)
    ablations = ROOT / "configs" / "ablations"

    def printed(*argv: str) -> dict:
        with pytest.raises(SystemExit):
            main(["fit", "-c", TINY, *argv, "--print_config"])
        return yaml.safe_load(capsys.readouterr().out)

    both = [f"-c={ablations / 'margin.yaml'}", "-c", str(ablations / "penalty_heavy.yaml")]
    assert printed(*both)["model"]["loss_weights"] == {"oracle_prefix_ce": 0.125, "margin_hinge": 0.125,
                                                       "distractor_penalty": 1.0}
    assert printed(*both, "--model.loss_weights.margin_hinge=0.5")["model"]["loss_weights"] == {
        "oracle_prefix_ce": 0.125, "margin_hinge": 0.5, "distractor_penalty": 1.0}
    # A key the command line sets between two configs stays (jsonargparse dropped it with the earlier mapping).
    assert printed(both[0], "--model.loss_weights.margin_hinge=0.5", *both[1:])["model"]["loss_weights"] == {
        "oracle_prefix_ce": 0.125, "margin_hinge": 0.5, "distractor_penalty": 1.0}
    # A whole mapping on the command line replaces, as it always did; a later config overlays it.
    replaced = printed(both[0], "--model.loss_weights={margin_hinge: 0.5}")["model"]["loss_weights"]
    assert replaced == {"margin_hinge": 0.5}
    assert printed(both[0], "--model.loss_weights={margin_hinge: 0.5}", *both[1:])["model"]["loss_weights"] == {
        "margin_hinge": 0.5, "distractor_penalty": 1.0}
    (tmp_path / "reset.yaml").write_text("model:\n  loss_weights: null\n")
    assert printed(both[0], "-c", "reset.yaml", *both[1:])["model"]["loss_weights"] == {"distractor_penalty": 1.0}
    # The target's load options too (a recipe's attn_implementation was dropped by an overlay's revision), in the
    # data module's linked copy as well: the data are tokenized and their logits computed by the same load.
    (tmp_path / "a.yaml").write_text("model:\n  target:\n    load_kwargs: {attn_implementation: sdpa}\n")
    (tmp_path / "b.yaml").write_text("model:\n  target:\n    load_kwargs: {low_cpu_mem_usage: true}\n")
    config = printed("-c", "a.yaml", "-c", "b.yaml")
    assert config["model"]["target"]["load_kwargs"] == {"attn_implementation": "sdpa", "low_cpu_mem_usage": True}
    from lilicorr_pl.lightning_cli import LilicorrCLI, merged_mapping_args

    args = merged_mapping_args(["fit", "-c", TINY, "-c", "a.yaml", "-c", "b.yaml"])
    assert args[-1] == '--model.target.load_kwargs={"attn_implementation":"sdpa","low_cpu_mem_usage":true}'
    # Under a mapping set in a way not followed here (an option for the whole target): left to jsonargparse.
    unfollowed = ["fit", "-c", "a.yaml", "--model.target={load_kwargs: {x: 1}}", "-c", "b.yaml"]
    assert merged_mapping_args(unfollowed) == unfollowed
    from lilicorr_pl.system import DraftSystem
    from lilicorr_pl.data import DraftDataModule

    cli = LilicorrCLI(DraftSystem, DraftDataModule, run=False, args=["-c", TINY, "-c", "a.yaml", "-c", "b.yaml"],
                      save_config_callback=None)
    assert cli.datamodule.target.load_kwargs == cli.model.target_spec.load_kwargs == {
        "attn_implementation": "sdpa", "low_cpu_mem_usage": True}


def test_a_sections_file_named_inside_a_config_is_read_by_the_link_check(tmp_path, capsys, monkeypatch):
    """``model: model.yaml`` in a config (jsonargparse reads that file, relative to the config's folder, as the
    section): its model.max_length was overwritten by the link without a word, as the same key in the config itself is
    refused; a file that is not there was "model: model.yaml is not a config file or a mapping of its keys"."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "model.yaml").write_text("max_length: 5\n")
    (tmp_path / "cfg" / "run.yaml").write_text("model: model.yaml\n")
    err = user_error(capsys, ["fit", "-c", TINY, "-c", str(tmp_path / "cfg" / "run.yaml")])
    assert err.splitlines()[-1] == (
        f"lilicorr fit: error: model.max_length 5 in config file {tmp_path / 'cfg' / 'model.yaml'} would be "
        "overwritten by data.max_length (64), which sets it; drop model.max_length from that config, or set "
        "data.max_length instead")
    # The file agreeing with its source passes to the next check; so does data.target in a data section's file.
    (tmp_path / "cfg" / "model.yaml").write_text("max_length: 64\nnum_anchors: 8\n")
    (tmp_path / "cfg" / "data.yaml").write_text("max_length: 64\ntarget: {dtype: float16}\n")
    (tmp_path / "cfg" / "run.yaml").write_text("model: model.yaml\n")
    err = user_error(capsys, ["fit", "-c", TINY, "-c", "cfg/run.yaml", "--trainer.max_steps=0"])
    assert "lilicorr fit: error: trainer.max_steps 0 trains nothing" in err, err
    (tmp_path / "cfg" / "run.yaml").write_text("data: data.yaml\n")
    err = user_error(capsys, ["fit", "-c", TINY, "-c", "cfg/run.yaml"])
    assert err.splitlines()[-1].startswith(
        f"lilicorr fit: error: data.target.dtype float16 in config file {Path('cfg') / 'data.yaml'} would be "
        "overwritten by model.target.dtype (float32)"), err
    # Looked for beside the config, not in the working folder (where jsonargparse does not look either).
    (tmp_path / "model.yaml").write_text("max_length: 64\n")
    (tmp_path / "cfg" / "run.yaml").write_text("model: other.yaml\n")
    for command in ("fit", "prepare"):
        err = user_error(capsys, [command, "-c", TINY, "-c", "cfg/run.yaml"])
        assert err.splitlines()[-1] == (
            f"lilicorr {command}: error: model: other.yaml in config file cfg/run.yaml names no file: a section's "
            f"file is read relative to its config's folder, and {Path('cfg') / 'other.yaml'} is not one; fix the "
            "name, or write the model options there as a mapping"), err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("texts, before, after, refused_at", [
    # Disagreeing with the source as it stood where the file was read, set before it on the command line ...
    (["model:\n  max_length: 128\n"], ["--data.max_length=32"], [], 32),
    # ... or in the same file, whatever sets the source to the same value later.
    (["model:\n  max_length: 128\ndata:\n  max_length: 64\n", "data:\n  max_length: 64\n"], [], [], 64),
    # Passed: the value the link sets (an older saved config), the same written otherwise (a quoted number, a dtype's
    # other name), null, an interpolation, and a value equal to its source where it was read, which a later argument
    # (a file or the command line) changes: the link carries it along, as a later argument wins anywhere.
    (["model:\n  max_length: 64\ndata:\n  target: {name_or_path: 'builtin:tiny', dtype: float32}\n"], [], [], None),
    (["model:\n  max_length: '64'\ndata:\n  target: {dtype: fp32}\n"], [], [], None),
    (["model:\n  max_length: null\ndata:\n  target: null\n"], [], [], None),
    (["data:\n  max_length: 64\nmodel:\n  max_length: ${data.max_length}\n"], [], [], None),
    (["model:\n  max_length: 64\n"], [], ["--data.max_length=32"], None),
    (["model:\n  max_length: 64\n", "data:\n  max_length: 32\n"], [], [], None),
    # Set in a way not followed (a file's name for the source, an option inside it, an append): nothing said, rather
    # than a guess.
    (["data:\n  target: {dtype: bfloat16}\n"], ["--model.target", "{tgt}"], ["--model.target.dtype=float16"], None),
    (["data:\n  target: {load_kwargs: {attn_implementation: sdpa}}\n"],
     ["--model.target.load_kwargs.attn_implementation=sdpa"], ["--model.target.load_kwargs.attn_implementation=eager"],
     None),
    (["data:\n  target: {layer_ids: [1, 2, 3]}\n"], ["--model.target.layer_ids+=3"], ["--model.target.layer_ids=[1]"],
     None),
])
def test_a_linked_option_in_a_config_is_read_where_the_config_stands(tmp_path, capsys, texts, before, after,
                                                                     refused_at):
    configs = _configs(tmp_path, texts)
    (tmp_path / "target.yaml").write_text("name_or_path: 'builtin:tiny'\ndtype: bfloat16\nlayer_ids: [1, 2]\n")
    before = [str(tmp_path / "target.yaml") if a == "{tgt}" else a for a in before]
    err = user_error(capsys, ["fit", "-c", TINY, *before, *configs, *after, "--trainer.max_steps=0"])
    if refused_at is None:  # to the next check, the one that refuses
        assert "lilicorr fit: error: trainer.max_steps 0 trains nothing" in err, err
    else:
        assert err.splitlines()[-1] == (
            f"lilicorr fit: error: model.max_length 128 in config file {tmp_path / 'c0.yaml'} would be overwritten by "
            f"data.max_length ({refused_at}), which sets it; drop model.max_length from that config, or set "
            "data.max_length instead")


def test_a_parse_reads_each_config_once_for_the_aliases_the_merge_and_the_link_check(tmp_path, capsys, monkeypatch):
    """The link check read every config again itself, a third read after jsonargparse's and the aliases' one."""
    import lilicorr_pl.lightning_cli as lcli

    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("model:\n  max_length: 128\n")  # not the value the link sets: the check reads the configs
    reads, real = [], lcli._config_sources
    monkeypatch.setattr(lcli, "_config_sources", lambda args: reads.append(list(args)) or real(args))
    err = user_error(capsys, ["fit", "-c", TINY, "-c", str(overlay)])
    assert f"model.max_length 128 in config file {overlay} would be overwritten by data.max_length" in err, err
    assert len(reads) == 1, reads


@pytest.mark.parametrize("value, refusal", [
    ("${data.max_length}", "Interpolation key 'data.max_length' not found; omegaconf resolves ${...} within each file: "
                           "name a key of the same file, or write the value"),
    ("${data.max_length", "no viable alternative at input '${data.max_length'; fix the ${...} or write the value"),
])
def test_an_interpolation_omegaconf_cannot_resolve_is_one_line(tmp_path, capsys, value, refusal):
    # It was omegaconf's traceback, out of jsonargparse's parser.
    config = tmp_path / "overlay.yaml"
    config.write_text(f"model:\n  num_anchors: {value}\n")
    err = user_error(capsys, ["fit", "-c", TINY, "-c", str(config)])
    assert err.splitlines()[-1] == f"lilicorr fit: error: model.num_anchors in config file {config}: {refusal}"
    # A section's file (its keys are the section's) and a list's item, by their full keys.
    config.write_text(f"num_anchors: {value}\n")
    err = user_error(capsys, ["fit", "-c", TINY, "--model", str(config)])
    assert err.splitlines()[-1] == f"lilicorr fit: error: model.num_anchors in config file {config}: {refusal}"
    config.write_text("model:\n  losses:\n    - class_path: lilicorr_pl.losses.DFlashCE\n"
                      f"      init_args:\n        weight: {value}\n")
    err = user_error(capsys, ["fit", "-c", TINY, "-c", str(config)])
    assert err.splitlines()[-1].startswith(f"lilicorr fit: error: model.losses[0].init_args.weight in config file "
                                           f"{config}: "), err
    if refusal.startswith("Interpolation key"):  # the config whose ${...} failed, not the first that has one
        valid = tmp_path / "valid.yaml"
        valid.write_text("model:\n  num_anchors: ${data.batch_size}\ndata:\n  batch_size: 1\n")
        config.write_text(f"model:\n  num_anchors: {value}\n")
        err = user_error(capsys, ["fit", "-c", TINY, "-c", str(valid), "-c", str(config)])
        assert err.splitlines()[-1] == f"lilicorr fit: error: model.num_anchors in config file {config}: {refusal}"


def test_a_value_omegaconf_cannot_hold_is_named_in_the_config_that_has_it(tmp_path, capsys):
    # A YAML set under a key an earlier config also sets (configs/tiny.yaml's data.batch_size) was named in that one.
    config = tmp_path / "overlay.yaml"
    config.write_text("data:\n  batch_size: !!set {a, b}\n")
    err = user_error(capsys, ["fit", "-c", TINY, "-c", str(config)])
    assert err.splitlines()[-1] == (f"lilicorr fit: error: data.batch_size in config file {config}: Value 'set' is not "
                                    "a supported primitive type; write a plain value (a number, a string, a list or a "
                                    "mapping)")


def test_argparse_spellings_still_work():
    from lilicorr_pl.bench import bench
    from lilicorr_pl.command import argparse_spellings, type_hints

    argv = ["--ckpt", "a.ckpt", "--num-prompts", "3", "--temperature", "0", "1.5", "--selectors", "top1,lilicorr",
            "--allow-module", "mypkg", "--allow-module", "other", "--trust-remote-code", "--seed", "-1", "--", "--plot=p"]
    assert argparse_spellings(argv, type_hints(bench)) == [
        "--ckpt=a.ckpt", "--num_prompts=3", "--temperature=[0, 1.5]", "--selectors=[top1, lilicorr]",
        "--allow_module=[mypkg, other]", "--trust_remote_code=true", "--seed=-1", "--plot=p",
    ]
    from lilicorr_pl.data.regenerate import regenerate_command

    assert argparse_spellings(["--no-progress", "--enable-thinking", "false"], type_hints(regenerate_command)) == [
        "--progress=false", "--enable_thinking=false"]
    # A flag's value in a word it does not know is still its value (jsonargparse refuses it, naming the flag).
    assert argparse_spellings(["--compile", "maybe", "--trust-remote-code", "yes", "--compile", "--seed", "1"],
                              type_hints(bench)) == ["--compile=maybe", "--trust_remote_code=yes", "--compile=true",
                                                     "--seed=1"]


def test_a_tool_reads_its_options_from_a_config_file(tmp_path, capsys):
    config = tmp_path / "bench.yaml"
    config.write_text("ckpt: some.ckpt\nnum_prompts: 3\ntemperature: [0, 1]\nselectors: [lilicorr]\n")
    with pytest.raises(SystemExit):
        main(["bench", "--config", str(config), "--num-prompts", "5", "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["ckpt"] == "some.ckpt" and printed["num_prompts"] == 5  # the command line wins
    assert printed["temperature"] == [0.0, 1.0] and printed["selectors"] == ["lilicorr"]


def test_shipped_configs_are_found_from_any_directory(tmp_path, monkeypatch, capsys):
    """`-c configs/tiny.yaml` names the shipped config when no such file exists here (an installed wheel)."""
    from lilicorr_pl.command import shipped_configs

    assert (shipped_configs() / "tiny.yaml").read_text() == (ROOT / "configs" / "tiny.yaml").read_text()
    monkeypatch.chdir(tmp_path)
    cfg = print_config(Path("configs/tiny.yaml"))
    assert cfg["model"]["target"]["name_or_path"] == "builtin:tiny"
    (tmp_path / "configs").mkdir()  # a file of that name here wins
    (tmp_path / "configs" / "tiny.yaml").write_text((ROOT / "configs" / "tiny.yaml").read_text()
                                                    .replace("max_steps: 50", "max_steps: 7"))
    assert print_config(Path("configs/tiny.yaml"))["trainer"]["max_steps"] == 7


# ---------------------------------------------------------------------------- bad input at the command edge (11.8/9)
def test_a_yaml_error_names_the_file(tmp_path, capsys):
    bad = tmp_path / "broken.yaml"
    bad.write_text("trainer:\n  max_steps: [1\n")
    for argv in (["fit", "-c", str(ROOT / "configs" / "tiny.yaml"), "-c", str(bad)], ["bench", "--config", str(bad)]):
        err = user_error(capsys, argv)
        assert f"config file {bad} is not valid YAML" in err and "line 3" in err, err
    err = user_error(capsys, ["fit", "-c", str(tmp_path / "missing.yaml")])
    assert f"config file {tmp_path / 'missing.yaml'} does not exist" in err
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    (tmp_path / "list.yaml").write_text("- trainer\n")
    for path, said in ((tmp_path / "empty.yaml", "is empty"), (tmp_path / "list.yaml", "is a YAML list, not a mapping"),
                       (tmp_path, "is a directory"), (Path(os.devnull), "is not a regular file")):
        err = user_error(capsys, ["fit", "-c", str(path)])  # "does not exist", or jsonargparse's "Unexpected config"
        assert f"config file {path} {said}" in err, err


@pytest.mark.parametrize("argv, message", [
    (["test"], "`lilicorr test` needs a test split"),
    (["validate", "--data.val_fraction=0"], "`lilicorr validate` reads the validation split, and there is none"),
    (["predict", "--data.val_fraction=0"], "`lilicorr predict` reads the validation split, and there is none"),
    # Neither a checkpoint nor a warm start: Lightning would evaluate a freshly built drafter as the run's result.
    (["validate"], "lilicorr validate without --ckpt_path would evaluate an untrained drafter; pass --ckpt_path="),
    (["predict"], "lilicorr predict without --ckpt_path would evaluate an untrained drafter"),
    (["validate", "--ckpt_path=last"], "lilicorr validate --ckpt_path=last: there is no last checkpoint under this "
                                       "run's root"),
    (["validate", "--model.init_drafter_from=served"], "would evaluate the warm-started drafter with an untrained "
                                                       "LiLiCorrHead; pass --ckpt_path"),
    (["fit", "--data.train_files=[nope.jsonl]"], "data file 'nope.jsonl' does not exist"),
    # The Trainer refuses its own settings: one line too, not Lightning's traceback.
    (["fit", "--trainer.enable_progress_bar=false", "--trainer.callbacks+=lightning.pytorch.callbacks.TQDMProgressBar"],
     "enable_progress_bar=False"),
    # A warm start from a folder that is not there, or not a drafter: the path's problem in one line, no traceback.
    (["fit", "--model.init_drafter_from=no/such/dir"], "no/such/dir"),
    (["fit", "--model.init_head_from=."], "is not a"),
    # A folder where a file belongs: said so, not "does not exist".
    (["fit", "--data.train_files=[.]"], "data file '.' is a directory; list its .jsonl/.parquet files in "
                                        "data.train_files"),
])
def test_a_run_without_its_data_or_with_bad_settings_is_one_line_before_anything_starts(argv, message, tmp_path,
                                                                                          monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    name, *rest = argv
    err = user_error(capsys, [name, "-c", str(ROOT / "configs" / "tiny.yaml"), *rest])
    assert message in err, err
    if name != "fit" or "train_files" in rest[0]:
        assert not (tmp_path / "runs").exists()  # no W&B run, no cache, no checkpoint folder


def test_a_device_name_is_always_checked_and_its_presence_only_where_asked():
    """`validate -c` a GPU run's config (precompute_device cuda) on a CPU machine reads the stores it finds: only the
    name is checked there; fit and prepare make stores, so the device must be present."""
    from lilicorr_pl.target import check_device

    with pytest.raises(ValueError, match=r"--data.precompute_device 'gpu' is not a device; use cpu, cuda or cuda:N"):
        check_device("gpu", "--data.precompute_device", here=False)
    check_device("cuda:0", "--data.precompute_device", here=False)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available on this machine"):
            check_device("cuda:0", "--data.precompute_device")
    # torch names cpu:1, and bench's checkpoint restore to it was a traceback; a CUDA index past the devices here too.
    with pytest.raises(ValueError, match=r"^--device cpu:1: the CPU has no device 1; use --device cpu$"):
        check_device("cpu:1", here=False)
    check_device("cpu:0")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=rf"this machine has {torch.cuda.device_count()} CUDA device\(s\)"):
            check_device(f"cuda:{torch.cuda.device_count()}")


def test_a_training_checkpoint_as_warm_start_and_a_missing_accelerator_name_their_fix(tmp_path, monkeypatch, capsys):
    """A .ckpt for --model.init_drafter_from was "not a DFlash drafter directory"; fit's missing GPU was Lightning's
    bare "No supported gpu backend found!" (prepare named the settings and the fix already)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.ckpt").write_bytes(b"not read")
    err = user_error(capsys, ["fit", "-c", str(ROOT / "configs" / "tiny.yaml"), "--model.init_drafter_from=run.ckpt"])
    assert "run.ckpt is a training checkpoint, not a DFlash drafter directory; export it first (lilicorr export " \
           "--ckpt run.ckpt --output DIR) and pass DIR" in err, err
    if not torch.cuda.is_available():
        err = user_error(capsys, ["fit", "-c", str(ROOT / "configs" / "tiny.yaml"), "--trainer.accelerator=gpu"])
        assert err.strip().endswith("(trainer.accelerator gpu, trainer.devices 1); set them to what this machine has, "
                                    "e.g. --trainer.accelerator=cpu"), err



def test_builtin_target_resolves_at_the_command_edge_with_progress(monkeypatch, tmp_path):
    """A constructor never builds the built-in target; `lilicorr` does, before building anything, with progress."""
    import lilicorr_pl.demo.tiny_target as tiny_target
    from lilicorr_pl.lightning_cli import run_lightning
    from lilicorr_pl.models import DFlashDrafter
    from lilicorr_pl.system import DraftSystem
    from lilicorr_pl.target import TargetSpec

    built = str(tiny_target.build_tiny_target("test", progress=False))  # cached: what builtin:tiny resolves to
    calls = []

    def fake_build(preset, cache_dir=None, force=False, progress=True):
        calls.append((preset, progress))
        return Path(built)

    monkeypatch.setattr(tiny_target, "build_tiny_target", fake_build)
    with pytest.raises(ValueError, match="built-in name, which the `lilicorr` command resolves"):
        DraftSystem(TargetSpec(name_or_path="builtin:full"), DFlashDrafter(num_layers=1, block_size=4))
    assert not calls
    monkeypatch.chdir(tmp_path)
    cli = run_lightning(["-c", str(ROOT / "configs" / "tiny.yaml"), "--model.target.name_or_path=builtin:full",
                         "--trainer.logger=false"], run=False)
    assert calls == [("full", True)]  # the 20-minute build shows its progress
    assert cli.model.target_path == built and cli.datamodule.target.name_or_path == built
    assert all(not f.startswith("builtin:") for f in cli.datamodule.train_files)


def test_a_data_setting_the_system_would_override_is_an_error_or_a_warning_naming_both(monkeypatch, tmp_path):
    """Issue 12.5: the system decides whether the logit store is read; an explicit data.logit_cache the other way
    used to be switched silently."""
    from lilicorr_pl.checkpoint import UserInputError
    from lilicorr_pl.lightning_cli import run_lightning

    monkeypatch.chdir(tmp_path)
    tiny = ["-c", str(ROOT / "configs" / "tiny.yaml"), "--trainer.logger=false"]
    # Exact online logits: a store asked for explicitly is not built, with a warning naming both settings.
    cli = run_lightning([*tiny, "--model.target_logits=exact", "--data.logit_cache=true"], run=False)
    with pytest.warns(UserWarning, match=r"data\.logit_cache: true is ignored.*model\.target_logits: exact"):
        cli._wire_data()
    assert cli.datamodule.logit_cache is False
    # tiny.yaml trains on the store (model.target_logits: cache): switching it off is refused, naming both.
    cli = run_lightning([*tiny, "--data.logit_cache=false"], run=False)
    with pytest.raises(UserInputError, match=r"data\.logit_cache: false, but model\.target_logits: cache reads the "
                       r"target-logit store; remove data\.logit_cache \(or set it true\), or change the model setting$"):
        cli._wire_data()
    # Left unset, the system decides without a word.
    cli = run_lightning([*tiny, "--model.target_logits=exact"], run=False)
    cli._wire_data()
    assert cli.datamodule.logit_cache is False
    # Exact logits need the online target: the offline feature store is refused at the same point.
    cli = run_lightning([*tiny, "--model.target_logits=exact", "--data.feature_cache=true"], run=False)
    with pytest.raises(UserInputError, match=r"model\.target_logits: exact .*data\.feature_cache: true"):
        cli._wire_data()


# ---------------------------------------------------------------------------- progress bar (issue 11.9)
def _bar_states(tmp_path: Path, max_steps: int, ckpt: Path | None = None, save: Path | None = None) -> list:
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
    from torch.utils.data import DataLoader

    from lilicorr_pl.lightning_cli import StepProgressBar

    class Model(BoringModel):
        def train_dataloader(self):
            return DataLoader(RandomDataset(32, 15), batch_size=1)

        def val_dataloader(self):
            return DataLoader(RandomDataset(32, 2), batch_size=1)

    states = []

    class Spy(L.Callback):
        def on_train_batch_start(self, trainer, *args):
            bar = trainer.progress_bar_callback
            task = bar.progress.tasks[bar.train_progress_bar_id]
            states.append((task.description.strip(), int(task.completed), task.total))

        def on_train_end(self, trainer, *args):
            self.on_train_batch_start(trainer)

    trainer = L.Trainer(max_steps=max_steps, val_check_interval=5, limit_val_batches=1, logger=False,
                        enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[StepProgressBar(), Spy()])
    trainer.fit(Model(), ckpt_path=ckpt)
    if save is not None:
        trainer.save_checkpoint(save)
    return states


def test_progress_bar_reads_right_for_step_limited_and_resumed_runs(tmp_path):
    """Lightning's bar showed `Epoch 0/-2` (max_epochs -1) and, resumed mid-epoch, `15/9`."""
    states = _bar_states(tmp_path, max_steps=6, save=tmp_path / "step6.ckpt")
    states += _bar_states(tmp_path, max_steps=20, ckpt=tmp_path / "step6.ckpt")
    assert states and all("/-" not in description and description.startswith("Epoch") for description, *_ in states)
    assert all(completed <= total for _, completed, total in states), states
    assert states[-1][1] == states[-1][2]  # the last epoch ends full: 5 of 5 batches


@pytest.mark.parametrize("name, after", [
    ("fit", "; resume with the same command and --ckpt_path=last"),
    ("demo", "; rerun the same command: every finished stage is reused"),
    ("validate", ""),
])
def test_a_command_stopped_by_sigterm_says_what_stopped_and_exits_143(name, after, monkeypatch, capsys):
    """The one line and exit status of a SIGTERM stop, whichever command it stopped (a fit's whole path, Lightning's
    stop included, is tests/test_resume.py)."""
    import lilicorr_pl.cli as cli
    from lilicorr_pl.checkpoint import StoppedBySignal

    def stopped(argv):
        raise StoppedBySignal("training stopped by SIGTERM at step 2 of 5")

    monkeypatch.setattr(cli, "run", stopped)
    with pytest.raises(SystemExit) as exit_:
        main([name])
    assert exit_.value.code == 143
    assert capsys.readouterr().err == (f"lilicorr {name}: training stopped by SIGTERM at step 2 of 5{after} "
                                       "(exit status 143)\n")


@pytest.mark.parametrize("name, after", [
    ("regenerate", "; rerun the same command: it goes on after the records already written"),
    ("bench", ""),
])
def test_ctrl_c_outside_a_fit_is_one_line_and_exit_status_130(name, after, monkeypatch, capsys):
    """Ctrl-C on regenerate or bench printed some 30 frames of traceback."""
    import lilicorr_pl.cli as cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run", interrupted)
    with pytest.raises(SystemExit) as exit_:
        main([name])
    assert exit_.value.code == 130
    assert capsys.readouterr().err == f"\nlilicorr {name}: interrupted (Ctrl-C){after} (exit status 130)\n"


def test_a_folder_given_as_a_checkpoint_is_named_as_a_folder(tmp_path, capsys):
    """bench / export --ckpt <a run's folder> or <a served export> said "does not exist" of a folder that exists."""
    run = tmp_path / "runs" / "x"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    served = tmp_path / "served"
    served.mkdir()
    (served / "config.json").write_text("{}")
    for command in (["bench", "--ckpt", str(run)], ["export", "--output", str(tmp_path / "out"), "--ckpt", str(run)]):
        err = user_error(capsys, command)
        assert f"checkpoint {run} is a directory; pass a .ckpt file written by `lilicorr fit` (such as " \
               f"{run / 'checkpoints' / 'last.ckpt'})" in err, err
    err = user_error(capsys, ["export", "--output", str(tmp_path / "out"), "--ckpt", str(served)])
    assert f"checkpoint {served} is a served drafter directory, not a training checkpoint" in err, err
    # bench measures a served directory against the target it names (test_bench), and needs it named.
    err = user_error(capsys, ["bench", "--ckpt", str(served)])
    assert err.strip().endswith(f"--ckpt {served} is a served drafter directory, which does not load its target; pass "
                                "the target model it drafts for with --target (a directory or hub name)"), err
    # An export names the target it was trained for (it said "records no target"): named as the hint it is.
    (served / "config.json").write_text(json.dumps({"lilicorr_pl": {"version": "0", "target": "/runs/qwen3-8b"}}))
    err = user_error(capsys, ["bench", "--ckpt", str(served)])
    assert err.strip().endswith("--target (a directory or hub name; it was exported for /runs/qwen3-8b)"), err


def test_a_resume_keeps_the_validation_split_and_an_edited_training_file_is_told_apart(tmp_path, capsys):
    """A resume with another split of the training files (--data.seed=7) was applied, and val/* then measured examples
    the steps before trained on; a training file edited in place under the same path was validated as the trained
    one. The checkpoint records its data files' content, and both are refused before anything is built."""
    from lilicorr_pl import builtin
    from lilicorr_pl.data.fingerprint import file_sha256

    records = Path(builtin.resolve_data_file("builtin:stdlib-train:64")).read_text().splitlines(keepends=True)
    mine = tmp_path / "train.jsonl"
    mine.write_text("".join(records[:60]))
    fit_tiny(tmp_path, f"--data.train_files=[{mine}]", steps=3)
    ckpt = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    recorded = torch.load(ckpt, map_location="cpu", weights_only=True)["lilicorr"]["data_files"]
    assert recorded == {"train_files": [{"name": "train.jsonl", "bytes": mine.stat().st_size,
                                         "sha256": file_sha256(mine)}], "val_files": None}
    err = user_error(capsys, ["fit", "-c", str(ROOT / "configs" / "tiny.yaml"), f"--data.train_files=[{mine}]",
                              f"--trainer.default_root_dir={tmp_path / 'runs' / 'tiny'}", "--trainer.max_steps=6",
                              "--data.seed=7", "--ckpt_path=last"])
    assert err.splitlines()[-1] == (
        f"lilicorr fit: error: cannot resume --ckpt_path {ckpt} with another validation split (data.seed: checkpoint 0 "
        "vs now 7): it may validate on examples the steps so far trained on; resume with the checkpoint's data "
        "settings and files, or validate on held-out files (data.val_files)")
    mine.write_text("".join(reversed(records[:60])))  # the same records, in place: another split of them
    run = ["-c", str(tmp_path / "runs" / "tiny" / "config.yaml"), "--ckpt_path=last"]
    err = user_error(capsys, ["validate", *run])
    assert err.splitlines()[-1] == (
        f"lilicorr validate: error: --ckpt_path {ckpt} trained on data.train_files whose content has changed since "
        "(train.jsonl edited), so this validate would measure a split of them that may hold examples it trained on; "
        "restore the files it trained on, or measure held-out files with data.val_files")
    err = user_error(capsys, ["fit", *run, "--trainer.max_steps=6"])
    assert "with another validation split (data.train_files: train.jsonl edited since the checkpoint)" in err
    assert main(["validate", *run, f"--data.val_files=[{mine}]", "--trainer.enable_progress_bar=false"])
    mine.write_text("".join(records[:60]))  # restored: the same bytes, so the same split
    assert main(["fit", *run, "--trainer.max_steps=4", "--trainer.enable_progress_bar=false"]).trainer.global_step == 4
    # The same bytes under another path (a moved run folder, a job's local copy) are the same data: they resume and
    # validate, where the path alone read as other files.
    copy = tmp_path / "local" / "train.jsonl"
    copy.parent.mkdir()
    copy.write_bytes(mine.read_bytes())
    moved = main(["fit", *run, "--trainer.max_steps=5", f"--data.train_files=[{copy}]",
                  "--trainer.enable_progress_bar=false"])
    assert moved.trainer.global_step == 5
    err = user_error(capsys, ["validate", *run, f"--data.train_files=[{copy}]", "--data.seed=7"])
    assert "trained beside another validation split of the same data.train_files (data.seed: checkpoint 0" in err
    # A file deleted after the data were read: a checkpoint records the content as it was read (each save read the
    # files again: a deleted one failed every save, and one edited during the run was recorded as edited).
    identity = [{"name": "train.jsonl", "bytes": copy.stat().st_size, "sha256": file_sha256(copy)}]
    copy.unlink()
    moved.trainer.save_checkpoint(tmp_path / "after.ckpt")
    saved = torch.load(tmp_path / "after.ckpt", map_location="cpu", weights_only=True)["lilicorr"]["data_files"]
    assert saved == {"train_files": identity, "val_files": None}


def test_another_model_under_the_targets_path_is_said_on_resume_and_on_export(tmp_path):
    """A checkpoint names its target by path: other weights copied there resumed and exported without a word. The
    checkpoint now records a hash of the target's config and weight files, and a target that differs is said."""
    import shutil

    import warnings

    from helpers import make_tiny_target_dir

    target = Path(make_tiny_target_dir(tmp_path, seed=0, name="target"))
    fit_tiny(tmp_path, f"--model.target.name_or_path={target}", steps=1)
    ckpt = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    recorded = torch.load(ckpt, map_location="cpu", weights_only=True)["lilicorr"]["target_weights"]
    assert isinstance(recorded, str) and len(recorded) == 16
    with warnings.catch_warnings():  # the same model, moved: no word
        warnings.simplefilter("error", UserWarning)
        moved = tmp_path / "moved"
        shutil.copytree(target, moved)
        main(["export", "--ckpt", str(ckpt), "--output", str(tmp_path / "same"), "--target", str(moved)])
    shutil.rmtree(target)
    shutil.copytree(make_tiny_target_dir(tmp_path, seed=1, name="other"), target)  # same config, other weights
    with pytest.warns(UserWarning, match=rf"the target at {target} is not the one this checkpoint trained against "
                                         rf".*the checkpoint's target to {recorded}\); using it measures or serves"):
        main(["export", "--ckpt", str(ckpt), "--output", str(tmp_path / "other-export")])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n")
    with pytest.warns(UserWarning, match=r"is not the one this checkpoint trained against .*using it measures"):
        (run,) = main(["bench", "--ckpt", str(ckpt), "--benchmark", str(prompts), "--num_prompts", "1",
                       "--max_new_tokens", "2", "--selectors", "top1", "--chat_template", "no"])
    # The results say it too: the weights measured, and the ones the drafter trained against.
    assert run["target_weights_trained"] == recorded and run["target_weights"] not in (None, recorded)
    assert run["same_target_as_training"] is False
    # One prompt: no interval (it was a zero-width one), said so in the printed table
    from lilicorr_pl.bench import format_table

    assert math.isnan(run["selectors"]["top1"]["speedup_ci_low"])
    assert "speedup" in format_table(run) and "[no interval]" in format_table(run)
    assert "one prompt with rounds: no interval" in format_table(run)
    with pytest.warns(UserWarning, match=r"is not the one this checkpoint trained against .*resuming trains this "
                                         r"drafter against another model"):
        fit_tiny(tmp_path, f"--model.target.name_or_path={target}", "--ckpt_path=last", steps=2)
    # The resumed checkpoint recorded only the new weights, and bench then read it as trained against them alone
    # (same_target_as_training: true after one step of two against the first model). It keeps both, from their steps.
    other = run["target_weights"]
    history = torch.load(ckpt, map_location="cpu", weights_only=True)["lilicorr"]["target_weights_history"]
    assert history == [{"target_weights": recorded, "target_weights_hash": "content", "from_step": 0},
                       {"target_weights": other, "target_weights_hash": "content", "from_step": 1}]
    with pytest.warns(UserWarning, match=rf"this checkpoint trained against more than one target \(a resume changed "
                                         rf"its weights: {recorded} from step 0, {other} from step 1\); the target at "
                                         rf"{target} hashes to {other}; using it measures"):
        (run,) = main(["bench", "--ckpt", str(ckpt), "--benchmark", str(prompts), "--num_prompts", "1",
                       "--max_new_tokens", "2", "--selectors", "top1", "--chat_template", "no"])
    assert run["same_target_as_training"] is False and run["target_weights_trained"] == other
    assert run["target_weights_trained_history"] == history
    with warnings.catch_warnings():  # the same target again: the history is carried, not added to
        warnings.simplefilter("ignore", UserWarning)
        fit_tiny(tmp_path, f"--model.target.name_or_path={target}", "--ckpt_path=last", steps=3)
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["lilicorr"]["target_weights_history"] == history


def test_a_checkpoint_from_before_whole_file_digests_still_matches_its_target(tmp_path):
    """Checkpoints written before whole-file digests recorded the sampled ones: they are compared as they were
    written (no false 'another model' warning), and a new checkpoint says which rule it used."""
    import warnings

    from helpers import make_tiny_target_dir

    from lilicorr_pl.checkpoint import CHECKSUM_KEY
    from lilicorr_pl.system import DraftSystem

    target = Path(make_tiny_target_dir(tmp_path, seed=0, name="target"))
    fit_tiny(tmp_path, f"--model.target.name_or_path={target}", steps=1)
    ckpt = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert state["lilicorr"]["target_weights_hash"] == "content"
    system = DraftSystem.load_from_checkpoint(ckpt, map_location="cpu")
    sampled = system.target_weights_fingerprint(sampled=True)
    assert sampled != system.target_weights_fingerprint() == state["lilicorr"]["target_weights"]
    old = tmp_path / "old.ckpt"
    del state["lilicorr"]["target_weights_hash"]
    state["lilicorr"]["target_weights"] = sampled
    assert CHECKSUM_KEY in state["lilicorr"]  # the checksum covers the weights, not this record
    save_edited(state, old)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n")
    bench = ["bench", "--benchmark", str(prompts), "--num_prompts", "1", "--max_new_tokens", "2", "--selectors", "top1",
             "--chat_template", "no"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        (run,) = main([*bench, "--ckpt", str(old)])
    assert run["target_weights_trained"] == sampled and run["same_target_as_training"] is True
    assert run["target_weights"] == sampled and run["target_weights_hash"] == "sampled"  # both by the rule compared
    state["lilicorr"]["target_weights_hash"] = "content"  # the same record read by the new rule: another target
    save_edited(state, old)
    with pytest.warns(UserWarning, match="is not the one this checkpoint trained against"):
        (run,) = main([*bench, "--ckpt", str(old)])
    assert run["same_target_as_training"] is False


def test_chat_records_with_the_template_turned_off_are_refused_before_the_checkpoint_is_opened(tmp_path, capsys):
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    ckpt = tmp_path / "never-opened.ckpt"
    ckpt.write_bytes(b"not a checkpoint: the prompts are refused first")
    err = user_error(capsys, ["bench", "--ckpt", str(ckpt), "--benchmark", str(prompts), "--chat_template", "no"])
    assert "its chat records (prompt 1 is one) are rendered with the chat template, which --chat_template no turns off" in err, err


def test_trainer_counts_stay_counts_whatever_order_typing_cached_the_union_in(monkeypatch, tmp_path):
    """`--trainer.limit_val_batches=1` is one batch, not 1.0 (every batch): with transformers 5.0-5.17 imported first,
    typing's cache gave Lightning's `Optional[Union[int, float]]` the float-first order and the parser read 1 as 1.0
    (simulated here with a float-first annotation on the Trainer)."""
    from lightning.pytorch import Trainer

    from lilicorr_pl.lightning_cli import run_lightning

    for name in ("limit_val_batches", "limit_train_batches", "val_check_interval"):
        monkeypatch.setitem(Trainer.__init__.__annotations__, name, float | int | None)
    monkeypatch.chdir(tmp_path)
    cli = run_lightning(["-c", str(ROOT / "configs" / "tiny.yaml"), "--trainer.logger=false",
                         "--trainer.limit_val_batches=1", "--trainer.limit_train_batches=0.5",
                         "--trainer.val_check_interval=2"], run=False)
    assert cli.trainer.limit_val_batches == 1 and type(cli.trainer.limit_val_batches) is int
    assert cli.trainer.limit_train_batches == 0.5 and cli.trainer.val_check_interval == 2
    assert Trainer.__init__.__annotations__["limit_val_batches"] == int | float | None


def test_a_leading_tilde_in_a_tools_path_is_the_home_folder(tmp_path, monkeypatch):
    """`--output '~/x.json'` (quoted, or `output: ~/x.json` in a -c file) made a folder named `~` in the working
    directory; path parameters now expand it as a shell would, and leave other values and names alone."""
    from lilicorr_pl.command import run_function

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    seen = {}

    def tool(output: str = "", plot: str | None = None, benchmark: str = "humaneval", note: str = "") -> None:
        """A tool.

        Args:
            output: a file.
            plot: a folder.
            benchmark: a name or a file.
            note: not a path.
        """
        seen.update(output=output, plot=plot, benchmark=benchmark, note=note)

    run_function(tool, ["--output", "~/x.json", "--plot", "~/plots", "--note", "~/y"], prog="lilicorr tool")
    assert seen == {"output": str(tmp_path / "home" / "x.json"), "plot": str(tmp_path / "home" / "plots"),
                    "benchmark": "humaneval", "note": "~/y"}
    config = tmp_path / "c.yaml"
    config.write_text("output: ~/from-config.json\n")
    run_function(tool, ["-c", str(config)], prog="lilicorr tool")
    assert seen["output"] == str(tmp_path / "home" / "from-config.json")



def test_perf_json_under_a_tilde_is_checked_where_it_will_be_written(tmp_path, monkeypatch, capsys):
    """perf expanded `--json '~/plan.json'` only after its overwrite check had looked at `./~/plan.json`: a user's
    file in the home folder was replaced. Expanded first now, so the check sees the file that would be written."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    plan = tmp_path / "home" / "plan.json"
    plan.write_text('{"note": "my serving plan"}')
    err = user_error(capsys, ["perf", "--cost-model", "true", "-c", str(ROOT / "configs" / "tiny.yaml"),
                              "--json", "~/plan.json"])
    assert f"--json {plan} exists and is not a results file lilicorr wrote" in err
    assert plan.read_text() == '{"note": "my serving plan"}'
    main(["perf", "--cost-model", "true", "-c", str(ROOT / "configs" / "tiny.yaml"), "--json", "~/cost.json"])
    assert json.loads((tmp_path / "home" / "cost.json").read_text())["written_by"].startswith("lilicorr perf ")


@pytest.mark.parametrize("argv, unknown", [
    (["fit", "-c", str(ROOT / "configs" / "tiny.yaml"), "--model.num_anchor=7", "--print_config"],
     "--model.num_anchor=7"),
    (["bench", "--ckpt", "x.ckpt", "--max_new", "2"], "--max_new 2"),
    (["demo", "--quick", "--bench-prompt", "2"], "--bench-prompt 2"),
])
def test_options_are_named_in_full_never_by_a_prefix(argv, unknown, capsys):
    """argparse's prefix matching took `--model.num_anchor=7` for num_anchors (and `--max_new` for
    --max_new_tokens): a typo applied silently, and a prefix that changes meaning when a longer option is added."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert f"unrecognized arguments: {unknown}" in capsys.readouterr().err


def test_an_acceptance_eval_the_context_cannot_hold_is_refused_before_the_data_are_prepared(tmp_path, capsys):
    extra = tmp_path / "eval.yaml"
    extra.write_text("trainer:\n  callbacks+:\n    - class_path: callbacks.AcceptanceEval\n"
                     "      init_args: {every_n_train_steps: 2, benchmark: stdlib-heldout, max_new_tokens: 64}\n")
    root = tmp_path / "runs" / "tiny"
    err = user_error(capsys, ["fit", "-c", str(ROOT / "configs" / "tiny.yaml"), "-c", str(extra),
                              f"--trainer.default_root_dir={root}", "--trainer.max_steps=1"])
    assert "AcceptanceEval max_new_tokens 64 leaves no room for a prompt in the target's context of 64 positions" in err
    assert not (root / "cache").exists()  # nothing prepared
    # A prompts file that is not there: one line too (it was a FileNotFoundError traceback, exit status 1).
    extra.write_text("trainer:\n  callbacks+:\n    - class_path: callbacks.AcceptanceEval\n"
                     f"      init_args: {{every_n_train_steps: 2, benchmark: {tmp_path / 'nope.jsonl'}}}\n")
    err = user_error(capsys, ["fit", "-c", str(ROOT / "configs" / "tiny.yaml"), "-c", str(extra),
                              f"--trainer.default_root_dir={root}", "--trainer.max_steps=1"])
    assert err.strip().endswith(f"AcceptanceEval benchmark: prompt file {tmp_path / 'nope.jsonl'} does not exist; pass "
                                "a .jsonl with a 'prompt' or 'text' field per line")
    assert not (root / "cache").exists()


@pytest.mark.skipif(os.environ.get("WANDB_MODE") != "disabled", reason="the suite runs with WANDB_MODE=disabled")
def test_wandb_disabled_in_the_environment_wins_over_a_configs_offline_logger(tiny_run):
    """configs/tiny.yaml logs offline; Lightning's offline switch set WANDB_MODE=dryrun over a user's "disabled" (for
    the rest of the process, too) and wrote an offline run anyway."""
    _, ckpt = tiny_run
    assert "offline: true" in (ROOT / "configs" / "tiny.yaml").read_text()
    assert os.environ["WANDB_MODE"] == "disabled"  # still
    assert not (ckpt.parents[1] / "wandb").exists()


def test_online_wandb_without_credentials_is_one_line_before_the_target_is_built(tmp_path):
    """It was wandb's traceback once the target's logits had been computed (hours, on a real target); then one line
    once the target was built or loaded (a ``builtin:`` target's build, a hub target's download: minutes to an hour).
    Now one line before either: here a cache without the built-in target stays without it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    cache = tmp_path / "cache"
    # A home without W&B settings or .netrc, no terminal, and a cache where the built-in target is not built yet.
    env.update(HOME=str(tmp_path), WANDB_DIR=str(tmp_path), HF_HUB_OFFLINE="1", LILICORR_CACHE=str(cache))
    root = tmp_path / "runs" / "tiny"
    done = subprocess.run(
        [sys.executable, "-m", "lilicorr_pl", "fit", "-c", str(ROOT / "configs" / "tiny.yaml"),
         f"--trainer.default_root_dir={root}", "--trainer.max_steps=1", "--trainer.logger.init_args.offline=false"],
        env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert ("lilicorr fit: error: W&B has no credentials for the online run of lightning.pytorch.loggers.WandbLogger "
            "(no API key configured and no terminal to ask for one); run `wandb login` or set WANDB_API_KEY, or log "
            "offline") in done.stderr
    assert "Traceback" not in done.stderr and not (root / "cache").exists()
    assert not list(cache.glob("tiny-target-*")), "the target was built before the refusal"


_CREDENTIALS_CHECK = """
from jsonargparse import Namespace
from lilicorr_pl.checkpoint import UserInputError
from lilicorr_pl.lightning_cli import refuse_online_wandb_without_credentials
try:
    refuse_online_wandb_without_credentials(Namespace(logger=Namespace(
        class_path="lightning.pytorch.loggers.WandbLogger", init_args=Namespace(offline=False))))
    print("PASSED")
except UserInputError as err:
    print("REFUSED", err)
"""


@pytest.mark.parametrize("case, expected", [
    ("none", "REFUSED W&B has no credentials for the online run of lightning.pytorch.loggers.WandbLogger"),
    ("environment offline", "PASSED"),
    ("settings file offline", "PASSED"),  # `wandb offline`: the run logs offline without credentials
    ("key in the environment", "PASSED"),
    ("key in .netrc", "PASSED"),
    ("malformed key", "REFUSED W&B could not start an online run (WANDB_API_KEY invalid: "),  # was a traceback
    ("mode of the wrong form", "REFUSED W&B's settings are not valid (1 validation error for Settings mode "),
])
def test_the_wandb_credentials_check_reads_what_wandb_reads(case, expected, tmp_path):
    """Each case in a process of its own (wandb's settings are read once per process), with no terminal, a home of its
    own, and nothing written there or sent: the check asks, changes and sends nothing."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    config = tmp_path / "wandb-config"
    config.mkdir()
    (tmp_path / "matplotlib").mkdir()  # its font cache, written at import
    env.update(HOME=str(tmp_path), WANDB_DIR=str(tmp_path), WANDB_CONFIG_DIR=str(config),
               NETRC=str(tmp_path / ".netrc"), MPLCONFIGDIR=str(tmp_path / "matplotlib"))
    if case == "environment offline":
        env["WANDB_MODE"] = "offline"
    elif case == "settings file offline":
        (config / "settings").write_text("[default]\nmode = offline\n")
    elif case == "key in the environment":
        env["WANDB_API_KEY"] = "a" * 40
    elif case == "key in .netrc":
        (tmp_path / ".netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {'b' * 40}\n")
        (tmp_path / ".netrc").chmod(0o600)
    elif case == "malformed key":
        env["WANDB_API_KEY"] = "not a key"
    elif case == "mode of the wrong form":
        env["WANDB_MODE"] = "bogus"
    before = sorted(p for p in tmp_path.rglob("*"))
    done = subprocess.run([sys.executable, "-c", _CREDENTIALS_CHECK], env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(expected), done.stdout + done.stderr[-2000:]
    written = [p for p in tmp_path.rglob("*") if p not in before and "matplotlib" not in p.parts]
    assert not written, written  # no wandb logs, settings or .netrc


def test_online_wandb_loggers_reads_the_parsed_logger_settings(monkeypatch):
    from jsonargparse import Namespace

    from lilicorr_pl.lightning_cli import online_wandb_loggers

    wandb_path = "lightning.pytorch.loggers.WandbLogger"
    online = Namespace(class_path=wandb_path, init_args=Namespace(project="p", offline=False))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert online_wandb_loggers(Namespace(logger=online)) == [wandb_path]
    assert online_wandb_loggers(Namespace(logger=[Namespace(class_path="lightning.pytorch.loggers.CSVLogger"),
                                                  online])) == [wandb_path]
    assert online_wandb_loggers(Namespace(logger=Namespace(class_path=wandb_path,
                                                           init_args=Namespace(offline=True)))) == []
    assert online_wandb_loggers(Namespace(logger=Namespace(class_path=wandb_path, init_args=Namespace(),
                                                           dict_kwargs={"mode": "disabled"}))) == []
    assert online_wandb_loggers(Namespace(logger=Namespace(class_path=wandb_path, init_args=Namespace(),
                                                           dict_kwargs={"settings": {"api_key": "c" * 40}}))) == []
    assert online_wandb_loggers(Namespace(logger=True)) == []  # Lightning's default logger
    from lightning.pytorch.loggers import WandbLogger

    instance = "lightning.pytorch.loggers.wandb.WandbLogger"  # a logger a caller built: judged by what it will start
    assert online_wandb_loggers(Namespace(logger=WandbLogger(project="p"))) == [instance]
    assert online_wandb_loggers(Namespace(logger=[WandbLogger(project="p", mode="disabled"),
                                                  WandbLogger(project="p", settings={"api_key": "c" * 40})])) == []
    assert "WANDB_MODE" not in os.environ  # not judged by the environment so far
    assert online_wandb_loggers(Namespace(logger=WandbLogger(project="p", offline=True))) == []
    monkeypatch.delenv("WANDB_MODE", raising=False)  # Lightning's offline switch sets it
    assert online_wandb_loggers(Namespace(logger=None)) == []
    assert online_wandb_loggers(None) == []
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert online_wandb_loggers(Namespace(logger=online)) == []


@pytest.mark.parametrize("flag, message", [
    ("--data.num_workers=-1", "data.num_workers must be >= 0 (0 loads in the main process), got -1"),
    ("--data.logit_top_m=100000", "data.logit_top_m 100000 is more than the target's"),
])
def test_data_settings_the_target_cannot_meet_are_one_line_before_preparation(flag, message, capsys, tmp_path):
    """Both were tracebacks after the data had been tokenized and the target loaded (torch's DataLoader error, the
    precompute's own check)."""
    root = tmp_path / "runs" / "tiny"
    err = user_error(capsys, ["fit", "-c", str(ROOT / "configs" / "tiny.yaml"), flag,
                              f"--trainer.default_root_dir={root}"])
    assert message in err, err
    assert not (root / "cache").exists()


def test_a_validation_share_that_leaves_nothing_to_train_on_is_an_error_not_a_silent_success(capsys, tmp_path):
    """data.val_fraction 0.99 of a small file: Lightning stopped at once ('No training batches'), exited 0 and wrote
    no checkpoint. Told once the data are tokenized, before the target's pass over them (the logit store)."""
    root = tmp_path / "runs" / "tiny"
    err = user_error(capsys, ["fit", "-c", str(ROOT / "configs" / "tiny.yaml"), "--data.val_fraction=0.99",
                              "--data.train_files=[builtin:stdlib-train:8]", f"--trainer.default_root_dir={root}"])
    assert "data.val_fraction 0.99 leaves none of the 8 training examples to train on" in err, err
    assert not (root / "checkpoints").exists()
    assert [p.name.split("-")[0] for p in (root / "cache").iterdir()] == ["tokens"]


@pytest.mark.parametrize("command, configs", [
    ("fit", ["configs/tiny.yaml"]), ("validate", ["configs/tiny.yaml"]),
    # A monitored ModelCheckpoint (eval/tau) does not help: a new process has no best path yet.
    ("validate", ["configs/qwen3-8b/base.yaml", "configs/qwen3-8b/lilicorr.yaml"]),
])
def test_ckpt_path_best_is_one_line_in_a_new_process(command, configs, capsys, tmp_path):
    """`--ckpt_path best` was Lightning's ValueError traceback, with or without a monitored ModelCheckpoint."""
    flags = [arg for c in configs for arg in ("-c", str(ROOT / c))]
    err = user_error(capsys, [command, *flags, "--ckpt_path=best", f"--trainer.default_root_dir={tmp_path / 'run'}",
                              "--data.train_files=[builtin:stdlib-train:8]"])
    assert "--ckpt_path best names the best checkpoint of a fit run in the same process" in err, err
    assert "pass --ckpt_path last or the checkpoint file" in err


@pytest.mark.parametrize("flag, message", [
    ("--trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches must be >= 1, got 0"),
    ("--model.optimizer.init_args.lr=-1", "model.optimizer.init_args.lr must be a finite number >= 0, got -1"),
    # Not refused: a nan or inf loss, or gradient ascent (a negative clip scaled every gradient by -1), exit 0.
    ("--model.optimizer.init_args.lr=.inf", "model.optimizer.init_args.lr must be a finite number >= 0, got inf"),
    ("--trainer.gradient_clip_val=-1", "trainer.gradient_clip_val must be a finite number >= 0 (0 or null: no "
                                       "clipping), got -1"),
    ("--trainer.gradient_clip_val=.nan", "trainer.gradient_clip_val must be a finite number >= 0"),
    ("--model.loss_weights={margin_hinge: .nan}", "model.loss_weights[margin_hinge] must be a finite number >= 0, got "
                                                  "nan"),
    ("--model.loss_weights={oracle_prefix_ce: .inf}", "model.loss_weights[oracle_prefix_ce] must be a finite number"),
    # A traceback at the first step, once the data were made (RoPE; FlexAttention's missing CPU backward), or 0 read
    # as unset (the target's size).
    ("--model.target.load_kwargs={torch_dtype: bfloat16}", "model.target.load_kwargs torch_dtype is ignored beside "
                                                           "the dtype lilicorr passes to from_pretrained; drop it "
                                                           "from model.target.load_kwargs (model.target.dtype sets "
                                                           "the target's dtype)"),
    ("--model.drafter.init_args.head_dim=3", "model.drafter.init_args.head_dim must be even (RoPE rotates its two "
                                             "halves), got 3"),
    ("--model.drafter.init_args.head_dim=0", "model.drafter.init_args.head_dim must be >= 1 (or null: the target's), "
                                             "got 0"),
    ("--model.drafter.init_args.intermediate_size=0", "model.drafter.init_args.intermediate_size must be >= 1"),
    *([("--model.drafter.init_args.attention=flex", "model.drafter.init_args.attention 'flex' cannot train on a CPU "
                                                    "(FlexAttention has no backward there); set it to 'auto' or "
                                                    "'sdpa', or train on a GPU")]
      if not torch.cuda.is_available() else []),
    # Not refused late: it exited 0 as a finished run, with the data prepared and no checkpoint.
    ("--trainer.max_steps=0", "trainer.max_steps 0 trains nothing (the run would prepare the data, save no checkpoint "
                              "and exit as finished); set trainer.max_steps >= 1, or -1 for no limit"),
    ("--trainer.limit_train_batches=0", "trainer.limit_train_batches 0 trains nothing"),
    ("--trainer.limit_train_batches=0.0", "trainer.limit_train_batches 0.0 trains nothing"),
    ("--model.lr_scheduler.init_args.warmup_fraction=2.0",
     "model.lr_scheduler.init_args.warmup_fraction must be in [0, 1), got 2.0"),
    ("--data.chat_template=no_such_template.jinja", "chat_template 'no_such_template.jinja' is neither a Jinja template "
                                                    "nor an existing file"),
    ("--data.precompute_device=gpu", "--data.precompute_device 'gpu' is not a device; use cpu, cuda or cuda:N"),
    *([("--data.precompute_device=cuda:0", "--data.precompute_device cuda:0: CUDA is not available on this machine; "
                                           "use --data.precompute_device cpu")] if not torch.cuda.is_available() else []),
])
def test_training_settings_torch_refuses_late_are_one_line_up_front(flag, message, capsys, tmp_path):
    """A ZeroDivisionError and the optimizer's ValueError, each after the data were prepared and the target loaded;
    a chat template or precompute device that cannot be used, a traceback once the Trainer was built; no training
    batch, an exit 0 with nothing trained."""
    root = tmp_path / "run"
    err = user_error(capsys, ["fit", "-c", str(ROOT / "configs" / "tiny.yaml"), flag, f"--trainer.default_root_dir={root}"])
    assert message in err, err
    assert not (root / "cache").exists()


def test_a_full_disk_is_one_line_naming_where(monkeypatch, capsys):
    """A full disk during an export or at the end of a benchmark was a traceback (OSError, or safetensors' own error
    type); other errors keep theirs."""
    import errno

    from lilicorr_pl import cli as cli_module

    class SafetensorError(Exception):  # safetensors' type, by name: its message carries the errno
        pass

    for raised, where in ((OSError(errno.ENOSPC, "No space left on device", "/full/b.json"), " writing /full/b.json"),
                          (SafetensorError("Error while serializing: IoError(No space left on device (os error 28))"),
                           "")):
        monkeypatch.setattr(cli_module, "run", lambda argv, e=raised: (_ for _ in ()).throw(e))
        with pytest.raises(SystemExit) as stop:
            cli_module.main(["export", "--ckpt", "x.ckpt", "--output", "out"])
        err = capsys.readouterr().err
        assert stop.value.code == 1 and err == (f"lilicorr export: error: no space left on the device{where}; free space "
                                                "there, or write elsewhere (--output, trainer.default_root_dir, "
                                                "data.cache_dir, LILICORR_CACHE)\n")
    monkeypatch.setattr(cli_module, "run", lambda argv: (_ for _ in ()).throw(OSError(errno.EACCES, "denied")))
    with pytest.raises(PermissionError):
        cli_module.main(["export"])


def test_a_copied_run_folder_resumes_into_its_own_last_checkpoint(tmp_path, recwarn):
    """Resumed in a copy of its folder (a run moved to other storage), a run wrote `last-v1.ckpt` beside the file it
    resumed from, and at its end called that file "an earlier run's (a run started over in the same folder)"."""
    fit_tiny(tmp_path / "a", steps=2)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    root = tmp_path / "b" / "runs" / "tiny"
    cli = fit_tiny(tmp_path / "b", "--ckpt_path=last", steps=3)
    assert cli.trainer.global_step == 3
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["last.ckpt"]
    assert torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 3
    assert not [w for w in recwarn if "holds an earlier run's" in str(w.message)]
    # The original folder is untouched.
    original = tmp_path / "a" / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    assert torch.load(original, map_location="cpu", weights_only=True)["global_step"] == 2


def test_a_chat_template_that_does_not_parse_is_one_line_in_fit(tmp_path, capsys):
    """bench and regenerate said it in one line; fit gave ChatTemplateError's traceback, met at the first chat record
    while the data were tokenized."""
    records = tmp_path / "chat.jsonl"
    turn = {"messages": [{"role": "user", "content": "add one"}, {"role": "assistant", "content": "def f(x):\n"
                                                                                               "    return x + 1"}]}
    records.write_text((json.dumps(turn) + "\n") * 20)
    root = tmp_path / "run"
    err = user_error(capsys, ["fit", "-c", TINY, f"--trainer.default_root_dir={root}", "--trainer.max_steps=1",
                              f"--data.train_files=[{records}]", "--data.chat_template={{ bogus"])
    assert err.splitlines()[-1] == (
        "lilicorr fit: error: the chat template does not parse (template line 1: unexpected end of template, expected "
        "'end of print statement'.); fix data.chat_template, or the tokenizer's chat_template"), err


@pytest.mark.parametrize("option, refusal", [
    ("--model.head.init_args.num_heads=3", "hidden_size 64 is not divisible by num_heads 3; choose e.g. num_heads=2"),
    ("--model.head.init_args.top_k=0", "top_k must be >= 1, got 0; the recipe uses 8"),
])
def test_prepare_names_a_constructors_refusal_not_the_settings_it_was_given(tmp_path, capsys, option, refusal):
    """`lilicorr prepare` printed jsonargparse's `Given value: Namespace(class_path=…, init_args=…)`, which names neither
    the problem nor the fix; fit gave the constructor's reason. Now prepare does too."""
    err = user_error(capsys, ["prepare", "-c", TINY, option, f"--trainer.default_root_dir={tmp_path / 'run'}"])
    assert err.splitlines()[-1] == f"lilicorr prepare: error: {refusal}", err


def test_two_overlays_that_disable_losses_are_told_the_later_list_replaces_the_earlier(tmp_path, capsys):
    """`-c dflash_only.yaml -c no_distractor.yaml` left the lattice losses on beside no head: the refusal blamed the
    losses and said nothing of why they were back (the later overlay's disabled_losses replaced the earlier list)."""
    ablations = ROOT / "configs" / "ablations"
    err = user_error(capsys, ["fit", "-c", TINY, "-c", str(ablations / "dflash_only.yaml"), "-c",
                              str(ablations / "no_distractor.yaml"), f"--trainer.default_root_dir={tmp_path / 'run'}"])
    assert err.splitlines()[-1] == (
        "lilicorr fit: error: loss components ['oracle_prefix_ce', 'margin_hinge'] need a lattice head, but model.head "
        "is None; set model.head to lilicorr_pl.heads.LiLiCorrHead or drop those losses (see "
        "configs/ablations/dflash_only.yaml); model.disabled_losses is ['distractor_penalty']: a list set again by a "
        "later -c file or option replaces the earlier one, so name every loss to disable in the last"), err
    err = user_error(capsys, ["fit", "-c", TINY, "--model.head=null", f"--trainer.default_root_dir={tmp_path / 'run'}"])
    assert err.splitlines()[-1].endswith("drop those losses (see configs/ablations/dflash_only.yaml)"), err


@pytest.mark.parametrize("rank", [0, 1])
def test_a_sigterm_under_several_processes_is_said_once_naming_what_resumes(rank, monkeypatch):
    """Under DDP every rank printed `training stopped by SIGTERM at step 32 …; resume with … --ckpt_path=last`, which
    the stop-time save does not back there (one process's: last.ckpt held step 25). Rank 0 says it, once, naming that
    the steps after the latest scheduled save are trained again; the others exit with the same status, silent."""
    from types import SimpleNamespace

    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lilicorr_pl import lightning_cli
    from lilicorr_pl.checkpoint import StoppedBySignal

    def stop(self, subcommand):
        raise SIGTERMException

    monkeypatch.setattr(LightningCLI, "_run_subcommand", stop)
    cli = object.__new__(lightning_cli.LilicorrCLI)
    cli._verified_first = None
    cli.trainer = SimpleNamespace(is_global_zero=rank == 0, global_step=32, max_steps=50, world_size=2)
    monkeypatch.setattr(cli, "_stop_fit_on_ctrl_c", lambda pressed: None)
    with pytest.raises(SystemExit) as stopped:
        cli._run_subcommand("fit")
    assert stopped.value.code == 143
    if rank:
        assert not isinstance(stopped.value, StoppedBySignal)  # nothing said: the cli prints only this class
    else:
        assert stopped.value.what == ("training stopped by SIGTERM at step 32 of 50 on 2 processes, where the stop "
                                      "saves nothing: the steps after the latest scheduled save are trained again")


def test_a_fit_with_the_default_optimizer_and_scheduler_resumes(tmp_path):
    """A config that leaves model.optimizer and model.lr_scheduler at their defaults could not be resumed: the
    checkpoint records the default factory by its import path and the resumed run held the function itself, so the two
    read as other optimizer settings and the same config with --ckpt_path=last was refused."""
    text = (ROOT / "configs" / "tiny.yaml").read_text()
    start, end = text.index("  optimizer:\n"), text.index("data:\n")
    assert "lr_scheduler:" in text[start:end]
    config = tmp_path / "defaults.yaml"
    config.write_text(text[:start] + text[end:])
    run = ["fit", "-c", str(config), f"--trainer.default_root_dir={tmp_path / 'runs' / 'defaults'}",
           "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false"]
    assert main([*run, "--trainer.max_steps=2"]).trainer.global_step == 2
    assert main([*run, "--trainer.max_steps=3", "--ckpt_path=last"]).trainer.global_step == 3


def test_a_chat_template_file_edited_since_the_checkpoint_is_another_split(tmp_path, capsys):
    """The checkpoint's data settings name the template's path; compared by that path read again, a file edited in
    place since passed as the same template, and a resume or validate took the split it renders for the old one."""
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    fit_tiny(tmp_path, f"--data.chat_template={template}", steps=1)
    root = tmp_path / "runs" / "tiny"
    argv = ["-c", str(ROOT / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={root}",
            f"--data.chat_template={template}", "--trainer.enable_progress_bar=false"]
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% endfor %}")  # edited in place
    err = user_error(capsys, ["fit", *argv, "--ckpt_path=last", "--trainer.max_steps=2"])
    said = f"(data.chat_template: checkpoint '{template} as the checkpoint read it (edited since)' vs now '{template}')"
    assert "cannot resume --ckpt_path" in err and f"with another validation split {said}" in err
    err = user_error(capsys, ["validate", *argv, f"--ckpt_path={root / 'checkpoints' / 'last.ckpt'}"])
    assert f"trained beside another validation split of the same data.train_files {said}" in err
    # The same text under another path (a job's local copy): the same template
    copy = tmp_path / "copy.jinja"
    copy.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    fit_tiny(tmp_path, f"--data.chat_template={copy}", "--ckpt_path=last", steps=2)
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")  # restored: the same split again
    fit_tiny(tmp_path, f"--data.chat_template={template}", "--ckpt_path=last", steps=3)
