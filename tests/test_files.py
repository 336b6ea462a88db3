"""Results files: written atomically, saying what wrote them, and never written over a file the tool did not write."""

from __future__ import annotations

import json

import pytest

from lilicorr_pl.files import check_output_paths, write_results_json, written_by_lilicorr


def test_a_rerun_may_replace_its_own_results_and_never_a_users_file(tmp_path):
    out = tmp_path / "results.json"
    check_output_paths(str(out), None)  # nothing there yet
    write_results_json(out, {"tau": float("nan"), "rows": [1]}, "bench")
    payload = json.loads(out.read_text())
    assert payload == {"written_by": payload["written_by"], "tau": None, "rows": [1]}  # NaN as null, marker first
    assert payload["written_by"].startswith("lilicorr bench ") and list(payload)[0] == "written_by"
    check_output_paths(str(out), None)  # its own results: a rerun replaces them
    for name, text in [("notes.txt", "my notes"), ("config.json", '{"architectures": ["Qwen3ForCausalLM"]}'),
                       ("list.json", "[1, 2]"), ("spoof.json", '{"written_by": "someone else"}')]:
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=rf"--json .*{name} exists and is not a results file lilicorr wrote"):
            check_output_paths(str(tmp_path / name), None, "--json")
        assert (tmp_path / name).read_text() == text


def test_results_of_earlier_versions_count_as_the_tools_own(tmp_path):
    """Every bench and demo results file written before the marker says whether τ includes the bonus token; perf's
    have their own totals."""
    (tmp_path / "demo.json").write_text(json.dumps({"mode": "full", "tau_includes_bonus_token": True, "results": []}))
    (tmp_path / "bench.json").write_text(json.dumps({"runs": [{"tau_includes_bonus_token": True}] * 2}))
    (tmp_path / "half.json").write_text(json.dumps({"runs": [{"tau_includes_bonus_token": True}, {"other": 1}]}))
    (tmp_path / "none.json").write_text(json.dumps({"runs": []}))
    (tmp_path / "perf.json").write_text(json.dumps({"step_total": 0.3, "target": 0.1}))
    (tmp_path / "timing.json").write_text(json.dumps({"settings": {}, "plain_step_ms": 5.0, "arms": {}}))
    (tmp_path / "empty.json").write_text("")  # mktemp's: nothing to lose
    for name in ("demo", "bench", "perf", "timing", "empty"):
        assert written_by_lilicorr(tmp_path / f"{name}.json"), name
    assert not written_by_lilicorr(tmp_path / "half.json") and not written_by_lilicorr(tmp_path / "none.json")
