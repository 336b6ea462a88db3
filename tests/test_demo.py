"""`lilicorr demo` end to end on the seconds-long test target: every stage runs, the JSON is complete,
and a rerun reuses exactly the stages whose settings are unchanged (issues 9 and 11.2)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import user_error
from lilicorr_pl.cli import main

ARMS = ("dflash", "lilicorr", "lilicorr_no_distractor", "domino", "dspark")


def demo(tmp_path, *extra: str) -> dict:
    out = tmp_path / "results.json"
    main(["demo", "--quick", "--target-preset", "test", "--workdir", str(tmp_path / "demo"), "--output", str(out),
          "--prompts", "12", "--docstring-prompts", "4", "--regen-tokens", "12", "--prefix-tokens", "16",
          "--base-steps", "2", "--steps", "2", "--head-steps", "2",
          "--bench-prompts", "2", "--bench-new-tokens", "8", *extra])
    return json.loads(out.read_text())


def test_demo_runs_every_stage_reports_each_arm_and_reuses_only_matching_stages(tmp_path, capsys):
    result = demo(tmp_path, "--temperatures", "0", "1")
    assert result["tau_includes_bonus_token"] is True
    # The heads were benchmarked through torch.compile where this machine can compile (a C++ compiler), and the
    # JSON says which; the comparison is keyed by it.
    from lilicorr_pl.decoding.compiled import check_compile_available

    try:
        check_compile_available()
        can_compile = True
    except RuntimeError:
        can_compile = False
    assert result["settings"]["compile"] is can_compile
    for r in result["results"]:  # compiled: heads with weights (not top-1), deterministic drafts (T = 0)
        if r["arm"] != "oracle":
            expected = can_compile and r["temperature"] == 0 and r["arm"] != "dflash" and "drafter_top1" not in r["arm"]
            assert r["compiled_head"] is expected, r["arm"]
    for key in ("heldout_loss", "heldout_top1", "repetition_rate_greedy"):
        assert result["target"][key] is not None
    # The regeneration prompts: 12 cut after a header, then 4 cut right after a function's docstring.
    prompts = [json.loads(line) for line in
               (tmp_path / "demo" / "data" / result["stages"]["data"] / "prompts.jsonl").read_text().splitlines()]
    assert [p["id"] for p in prompts] == [f"train-{i}" for i in range(12)] + [f"train-docstring-{i}" for i in range(4)]
    assert all(p["text"].rstrip().endswith(('"""', "'''")) for p in prompts[12:])
    assert not any(p["text"].rstrip().endswith(('"""', "'''")) for p in prompts[:12])
    rows = result["results"]
    seen = {(r["benchmark"], r["temperature"], r["arm"]) for r in rows}
    for bench in ("humaneval", "stdlib-heldout"):
        for arm in ARMS:
            assert (bench, 0.0, arm) in seen and (bench, 1.0, arm) in seen
        assert (bench, 0.0, "oracle") in seen
        # Heads trained with their own drafter are also measured on that drafter's top-1; the LiLiCorr arms'
        # drafter is the dflash arm's, whose row that is.
        assert {(bench, 0.0, "domino_drafter_top1"), (bench, 0.0, "dspark_drafter_top1")} <= seen
        assert (bench, 0.0, "lilicorr_drafter_top1") not in seen and (bench, 1.0, "domino_drafter_top1") not in seen
    for r in rows:
        assert set(r) >= {"benchmark", "temperature", "arm", "tau", "tokens_per_s", "speedup_vs_target",
                          "per_position_acceptance", "per_prompt_tau", "per_prompt_rounds"}
        assert 1.0 <= r["tau"] <= 8.0
        if r["arm"] not in ("oracle",) and r["temperature"] == 0.0:
            assert r["lossless"] is True  # speculative output == plain greedy output
            assert r["draft_sampling"] is None
        if r["temperature"] > 0:  # τ both ways: sampled drafts with min(1, p/q), and the point-mass rule
            assert r["draft_sampling"] == "proposal" and 1.0 <= r["tau_point_mass"] <= 8.0
            assert len(r["per_position_acceptance_point_mass"]) == len(r["per_position_acceptance"])
        # Every row has a τ ratio to DFlash on the same prompts with a 95 % interval around it.
        assert r["ci_low"] <= r["ratio_to_dflash"] <= r["ci_high"]
        if r["arm"] == "dflash":
            assert r["ratio_to_dflash"] == pytest.approx(1.0) and r["ci_low"] == pytest.approx(1.0)
        if r["tokens_per_s"] is not None:
            assert r["speedup_vs_target"] == pytest.approx(r["tokens_per_s"] / r["target_tokens_per_s"])
            # Timed interleaved with plain decoding: per-prompt times give intervals on the tokens/s ratios,
            # computed from those times (the pooled value, then a paired bootstrap around it).
            assert len(r["per_prompt_seconds"]) == len(r["per_prompt_tokens"]) == len(r["per_prompt_rounds"])
            assert r["tokens_per_s"] == pytest.approx(sum(r["per_prompt_tokens"]) / sum(r["per_prompt_seconds"]))
            ref = next(x for x in rows if x["arm"] == "dflash" and x["benchmark"] == r["benchmark"]
                       and x["temperature"] == r["temperature"])
            assert r["tokens_per_s_ratio_to_dflash"] == pytest.approx(r["tokens_per_s"] / ref["tokens_per_s"])
            assert r["tps_ci_low"] <= r["tps_ci_high"] and r["speedup_ci_low"] <= r["speedup_ci_high"]
            if r["temperature"] == 0.0:  # same tokens on every prompt (lossless): the pooled ratio is a mediant
                assert r["tps_ci_low"] <= r["tokens_per_s_ratio_to_dflash"] <= r["tps_ci_high"]
                assert r["speedup_ci_low"] <= r["speedup_vs_target"] <= r["speedup_ci_high"]
            if r["arm"] == "dflash":
                assert (r["tps_ci_low"], r["tps_ci_high"]) == pytest.approx((1.0, 1.0))
            else:
                assert r["tps_ci_low"] < r["tps_ci_high"]  # measured times differ: never a constant
    for bench in ("humaneval", "stdlib-heldout"):
        tau = {r["arm"]: r["tau"] for r in rows if r["benchmark"] == bench and r["temperature"] == 0.0}
        assert tau["oracle"] + 1e-9 >= tau["lilicorr"] or math.isclose(tau["oracle"], tau["lilicorr"])
    plot = tmp_path / "demo" / "plots" / result["stages"]["bench"] / "acceptance_curves.png"
    assert result["plots"] == [str(plot)] and plot.stat().st_size > 1000
    # One folder per demo: every run's W&B files and checkpoints under <workdir>/runs/<stage>.
    runs = sorted(p.name.rsplit("-", 1)[0] for p in (tmp_path / "demo" / "runs").iterdir())
    assert runs == sorted(["base", *ARMS])
    assert set(result["training"]) == set(ARMS)
    # Why a head leads or trails: how often its selection left the drafter's top-1 (0 for the dflash arm).
    assert result["training"]["dflash"]["diagnostics"]["val/off_top1_rate"] == 0.0
    assert 0.0 <= result["training"]["lilicorr"]["diagnostics"]["val/off_top1_rate"] <= 1.0
    # The LiLiCorr arms train their head alone on the dflash arm's drafter: both arms decode with the same drafter.
    for arm in ("lilicorr", "lilicorr_no_distractor"):
        assert result["training"][arm]["head_stage_of"] == "dflash" and result["training"][arm]["steps"] == 2
        assert_same_drafter(tmp_path / "demo", result["stages"]["arms"]["dflash"], arm, result["stages"]["arms"][arm])
    assert result["training"]["domino"]["head_stage_of"] is None and result["head_steps"] == 2

    # A rerun with the same settings reuses every stage, the measured comparison included.
    capsys.readouterr()
    again = demo(tmp_path, "--temperatures", "0", "1")
    log = capsys.readouterr().out
    assert log.count(": reusing") == 1 + len(ARMS)  # the shared stage and every arm
    assert "reusing the measured comparison" in log
    assert again["stages"] == result["stages"]
    # Other steps: the arms retrain under a new key (the shared stage and data are reused); old files stay.
    third = demo(tmp_path, "--temperatures", "0", "--steps", "3", "--arms", "dflash,lilicorr_joint")
    log = capsys.readouterr().out
    assert "shared DFlash stage: reusing" in log and "dflash: reusing" not in log
    assert third["stages"]["base"] == result["stages"]["base"]
    assert third["stages"]["arms"]["dflash"] != result["stages"]["arms"]["dflash"]
    assert third["steps_per_arm"] == 5 and third["settings"]["steps"] == 3
    # The opt-in joint arm (the reference's recipe): its own drafter, so its top-1 is measured beside it.
    arms3 = {r["arm"] for r in third["results"]}
    assert {"lilicorr_joint", "lilicorr_joint_drafter_top1", "oracle"} <= arms3 and "lilicorr" not in arms3
    assert "val/off_top1_rate" in third["training"]["lilicorr_joint"]["diagnostics"]
    assert Path(third["plots"][0]).parent != plot.parent and plot.is_file()  # the first run's plot stands
    ckpts = sorted(p.name for p in (tmp_path / "demo" / "checkpoints").glob("dflash-*.ckpt"))
    assert len(ckpts) == 2
    # A head-stage arm asked for alone: its source arm is trained (here reused) but not compared.
    capsys.readouterr()
    fourth = demo(tmp_path, "--temperatures", "0", "--head-steps", "3", "--arms", "lilicorr")
    log = capsys.readouterr().out
    assert "dflash: reusing" in log and "lilicorr: reusing" not in log
    assert {r["arm"] for r in fourth["results"]} == {"lilicorr", "oracle"} and set(fourth["training"]) == {"lilicorr"}
    assert fourth["stages"]["arms"]["lilicorr"] != result["stages"]["arms"]["lilicorr"]


def assert_same_drafter(workdir: Path, source_key: str, arm: str, arm_key: str) -> None:
    from safetensors.torch import load_file

    source = load_file(workdir / "stages" / f"dflash-{source_key}" / "drafter" / "model.safetensors")
    frozen = load_file(workdir / "stages" / f"{arm}-{arm_key}" / "drafter" / "model.safetensors")
    assert source.keys() == frozen.keys() and all(torch.equal(source[k], frozen[k]) for k in source)


def test_stage_keys_carry_the_code(monkeypatch):
    """A changed default changes no config file: the code is part of every stage's key."""
    from lilicorr_pl.demo import run

    key = run.stage_key(stage="arm", steps=3)
    assert run.stage_key(stage="arm", steps=3) == key and run.stage_key(stage="arm", steps=4) != key
    assert run.code_fingerprint.__wrapped__() == run.code_fingerprint()  # recomputed: same sources, same hash
    monkeypatch.setattr(run, "code_fingerprint", lambda: "an-edited-checkout")
    assert run.stage_key(stage="arm", steps=3) != key


def test_demo_rejects_zero_steps_before_any_work(tmp_path, capsys):
    err = user_error(capsys, ["demo", "--quick", "--steps", "0", "--workdir", str(tmp_path / "demo")])
    assert 'Parser key "steps"' in err and "does not conform to restriction v>0" in err  # refused when parsed
    assert "unknown_arm" in user_error(capsys, ["demo", "--quick", "--arms", "dflash,unknown_arm",
                                                "--workdir", str(tmp_path / "demo")])
    err = user_error(capsys, ["demo", "--quick", "--prefix-tokens", "4", "--workdir", str(tmp_path / "demo")])
    assert err.strip().endswith("--prefix-tokens 4 is too short for a code prefix; use at least 8")
    assert not (tmp_path / "demo").exists()


def test_demo_asking_more_prompts_than_the_corpus_has_is_one_line(tmp_path, capsys):
    """More regeneration prompts than the training split has cut points: one line naming the flags, no prompt file."""
    err = user_error(capsys, ["demo", "--quick", "--target-preset", "test", "--workdir", str(tmp_path / "demo"),
                              "--prompts", "4", "--docstring-prompts", "1000000", "--prefix-tokens", "16"])
    assert "requested 1000000 train prefixes" in err and "cut after each docstring" in err
    assert err.strip().endswith("(the demo's --prompts 4, --docstring-prompts 1000000: lower them)")
    assert not list((tmp_path / "demo" / "data").rglob("prompts.jsonl"))


def test_demo_compile_on_a_machine_that_cannot_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    """--compile true needs a working torch.compile; without it the demo stops with the fix, before building
    anything; the default (unset) benchmarks eager heads instead and says why."""
    import torch

    def broken(*args, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    monkeypatch.setattr(torch, "compile", broken)
    err = user_error(capsys, ["demo", "--quick", "--compile", "true", "--workdir", str(tmp_path / "demo")])
    assert "torch.compile does not work on this machine (InvalidCxxCompiler" in err
    assert err.strip().endswith("or pass --compile false")
    assert not (tmp_path / "demo").exists()
