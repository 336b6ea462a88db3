"""`lilicorr demo` end to end on the seconds-long test target: every stage runs and the JSON is complete."""

from __future__ import annotations

import json
import math

from lilicorr_pl.cli import main

ARMS = ("dflash", "lilicorr", "lilicorr_no_distractor")


def test_demo_runs_every_stage_and_reports_each_arm(tmp_path):
    out = tmp_path / "results.json"
    main(["demo", "--quick", "--target-preset", "test", "--workdir", str(tmp_path / "demo"), "--output", str(out),
          "--prompts", "12", "--regen-tokens", "12", "--prefix-tokens", "16", "--steps", "2",
          "--bench-prompts", "1", "--bench-new-tokens", "8", "--temperatures", "0", "1"])
    result = json.loads(out.read_text())
    assert result["tau_includes_bonus_token"] is True
    for key in ("heldout_loss", "heldout_top1", "repetition_rate_greedy"):
        assert result["target"][key] is not None
    rows = result["results"]
    seen = {(r["benchmark"], r["temperature"], r["arm"]) for r in rows}
    for bench in ("humaneval", "stdlib-heldout"):
        for arm in (*ARMS, "lilicorr_drafter_top1"):
            assert (bench, 0.0, arm) in seen and (bench, 1.0, arm) in seen
        assert (bench, 0.0, "oracle") in seen
    for r in rows:
        assert set(r) >= {"benchmark", "temperature", "arm", "tau", "tokens_per_s", "speedup_vs_target",
                          "per_position_acceptance"}
        assert 1.0 <= r["tau"] <= 8.0
        if r["arm"] != "oracle" and r["temperature"] == 0.0:
            assert r["lossless"] is True  # speculative output == plain greedy output
    # The oracle bound is at least what the same drafter's lattice head achieved.
    for bench in ("humaneval", "stdlib-heldout"):
        tau = {r["arm"]: r["tau"] for r in rows if r["benchmark"] == bench and r["temperature"] == 0.0}
        assert tau["oracle"] + 1e-9 >= tau["lilicorr"] or math.isclose(tau["oracle"], tau["lilicorr"])
    assert (tmp_path / "demo" / "plots" / "acceptance_curves.png").stat().st_size > 1000
    # A rerun reuses regeneration and checkpoints (resumable).
    main(["demo", "--quick", "--target-preset", "test", "--workdir", str(tmp_path / "demo"), "--output", str(out),
          "--prompts", "12", "--regen-tokens", "12", "--prefix-tokens", "16", "--steps", "2",
          "--bench-prompts", "1", "--bench-new-tokens", "8", "--temperatures", "0"])
