"""Regeneration: the target's own answers become training data; resumable; failures are counted."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import make_tiny_target_dir
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM

from lilicorr_pl.cli import main as cli_main
from lilicorr_pl.data.formats import load_examples
from lilicorr_pl.data.fingerprint import file_sha256
from lilicorr_pl.data.regenerate import regenerate


@pytest.fixture(autouse=True)
def _single_torch_thread():
    """Tiny models run far faster on one thread (and do not fight other processes for the cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


RECORDS = [
    {"id": "a", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "old answer"}, {"role": "user", "content": "later turn"}]},
    {"conversations": [{"from": "human", "value": "Hello! How are you?"}, {"from": "gpt", "value": "old"}]},
    {"text": "Once upon a time there was a small model that wanted to be fast."},
    {"prompt": "def add(a, b):\n", "completion": "old completion"},
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> str:
    return make_tiny_target_dir(tmp_path_factory.mktemp("regen_target"))


@pytest.fixture
def input_file(tmp_path) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(target_dir, input_file, output, **kw):
    args = dict(max_new_tokens=6, batch_size=2, progress=False)
    args.update(kw)
    return regenerate(target_dir, input_file, output, **args)


def test_regenerates_every_format_and_the_output_is_training_data(target_dir, input_file, tmp_path):
    out = tmp_path / "out.jsonl"
    stats = run(target_dir, input_file, out, prefix_chars=20)
    assert (stats.succeeded, stats.failed, stats.skipped) == (5, 0, 0)
    recs = {r["source_index"]: r for r in read(out)}
    assert sorted(recs) == [0, 1, 2, 3, 4]
    # Chat: the prompt is everything before the first assistant turn; the answer is new.
    chat = recs[0]
    assert chat["id"] == "a"
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant"]
    assert chat["messages"][-1]["content"] != "old answer"
    assert [m["role"] for m in recs[1]["messages"]] == ["user", "assistant"]
    assert recs[4]["messages"][0]["content"] == "What is the capital of France?"
    # Text: the (prefix of the) text is the prompt; prompt/completion keeps its prompt.
    assert recs[2]["prompt"] == RECORDS[2]["text"][:20] and "completion" in recs[2]
    assert recs[3]["prompt"] == "def add(a, b):\n" and recs[3]["completion"] != "old completion"
    for r in recs.values():
        g = r["generation"]
        assert g["enable_thinking"] is False and g["temperature"] == 0.0 and g["max_new_tokens"] == 6
        assert g["finish"] in ("stop", "length") and 0 <= g["new_tokens"] <= 6
    # The output loads as training data; the supervised tokens are exactly the generated ones.
    tok = AutoTokenizer.from_pretrained(target_dir)
    examples = load_examples([str(out)], tok, max_length=512)
    for ex, r in zip(examples, read(out)):
        supervised = tok.decode([i for i, m in zip(ex.input_ids, ex.loss_mask) if m])
        if "completion" in r:
            assert supervised == r["completion"]  # prompt and completion are tokenized separately
        else:
            # The token holding the template's "\n\n" may absorb leading spaces of the answer.
            answer = r["messages"][-1]["content"] + "<|im_end|>"
            assert answer.endswith(supervised) and supervised.lstrip() == answer.lstrip()


def test_greedy_matches_plain_generate_and_is_deterministic(target_dir, input_file, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    run(target_dir, input_file, a, batch_size=3)
    run(target_dir, input_file, b, batch_size=1)  # left padding must not change greedy outputs
    assert read(a) == read(b)
    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    stops = [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    ids = tok(RECORDS[3]["prompt"], return_tensors="pt")["input_ids"]
    ref = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=stops, pad_token_id=stops[0])
    ref = ref[0, ids.shape[1] :].tolist()
    ref = ref[: min([ref.index(t) for t in stops if t in ref] or [len(ref)])]
    assert read(a)[3]["completion"] == tok.decode(ref, skip_special_tokens=True)


def test_second_run_skips_everything(target_dir, input_file, tmp_path):
    out = tmp_path / "out.jsonl"
    run(target_dir, input_file, out)
    before = out.read_text()
    stats = run(target_dir, input_file, out)
    assert (stats.succeeded, stats.failed, stats.skipped) == (0, 0, 5)
    assert out.read_text() == before


def test_a_failing_record_is_counted_and_the_run_continues(target_dir, input_file, tmp_path, monkeypatch):
    original = Qwen3ForCausalLM.generate
    tok = AutoTokenizer.from_pretrained(target_dir)
    poison = tok(RECORDS[2]["text"])["input_ids"]

    def flaky(self, input_ids=None, attention_mask=None, **kw):
        for row, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            if [t for t, m in zip(row, mask) if m] == poison:
                raise RuntimeError("CUDA out of memory (simulated)")
        return original(self, input_ids=input_ids, attention_mask=attention_mask, **kw)

    monkeypatch.setattr(Qwen3ForCausalLM, "generate", flaky)
    out = tmp_path / "out.jsonl"
    stats = run(target_dir, input_file, out, batch_size=2)
    assert (stats.succeeded, stats.failed, stats.skipped) == (4, 1, 0)
    assert stats.errors[0][0] == 2 and "out of memory" in stats.errors[0][1]
    assert sorted(r["source_index"] for r in read(out)) == [0, 1, 3, 4]
    monkeypatch.setattr(Qwen3ForCausalLM, "generate", original)
    stats = run(target_dir, input_file, out)  # the rerun retries only the failed record
    assert (stats.succeeded, stats.failed, stats.skipped) == (1, 0, 4)


def test_bad_records_fail_alone_and_a_partial_last_line_is_redone(target_dir, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(
        json.dumps({"text": "fine prompt"}) + "\n"
        + "{not json\n"
        + json.dumps({"messages": [{"role": "assistant", "content": "no user turn"}]}) + "\n"
        + json.dumps({"unknown": 1}) + "\n"
        + json.dumps({"text": "another fine prompt"}) + "\n"
    )
    out = tmp_path / "out.jsonl"
    stats = run(target_dir, inp, out)
    assert (stats.succeeded, stats.failed, stats.skipped) == (2, 3, 0)
    messages = " | ".join(m for _, m in stats.errors)
    assert "line 2: malformed JSON" in messages and "no user message" in messages and "unknown record format" in messages
    # A kill mid-write leaves a partial line: it is cut off and that record regenerated.
    lines = out.read_text().splitlines(keepends=True)
    out.write_text(lines[0] + lines[1][: len(lines[1]) // 2])
    stats = run(target_dir, inp, out)
    assert (stats.succeeded, stats.skipped) == (1, 1)
    assert sorted(r["source_index"] for r in read(out)) == [0, 4]


def test_thinking_flag_reaches_the_generation_prompt(target_dir, tmp_path, monkeypatch):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    tok = AutoTokenizer.from_pretrained(target_dir)
    seen = []
    original = Qwen3ForCausalLM.generate

    def spy(self, input_ids=None, attention_mask=None, **kw):
        seen.append(tok.decode(input_ids[0][attention_mask[0].bool()]))
        return original(self, input_ids=input_ids, attention_mask=attention_mask, **kw)

    monkeypatch.setattr(Qwen3ForCausalLM, "generate", spy)
    run(target_dir, inp, tmp_path / "off.jsonl", enable_thinking=False)
    run(target_dir, inp, tmp_path / "on.jsonl", enable_thinking=True)
    assert seen[0].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert seen[1].endswith("<|im_start|>assistant\n")
    assert read(tmp_path / "on.jsonl")[0]["generation"]["enable_thinking"] is True


def test_sampling_is_seeded(target_dir, input_file, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    run(target_dir, input_file, a, temperature=1.0, seed=5)
    run(target_dir, input_file, b, temperature=1.0, seed=5)
    assert read(a) == read(b)


def test_cli_main_and_argument_errors(target_dir, input_file, tmp_path, capsys):
    out = tmp_path / "cli.jsonl"
    rc = cli_main(["regenerate", "--target", target_dir, "--input", str(input_file), "--output", str(out),
                   "--max-new-tokens", "3", "--limit", "2", "--no-progress"])
    assert rc == 0 and len(read(out)) == 2
    said = capsys.readouterr()  # the summary once, on stdout, naming the output (it was on stderr too)
    assert f"regenerate: succeeded 2, failed 0, skipped 0 -> {out}" in said.out and "succeeded" not in said.err
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl.*--input"):
        regenerate(target_dir, tmp_path / "missing.jsonl", out)
    with pytest.raises(ValueError, match="--output must differ"):
        regenerate(target_dir, input_file, input_file)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["regenerate", "--input", "x"])  # --target is required: refused when parsed
    assert exit_info.value.code == 2 and "required: target, output" in capsys.readouterr().err
    torch.manual_seed(0)  # keep global RNG use by other tests unaffected


def test_an_output_that_is_a_directory_is_one_line(target_dir, input_file, tmp_path):
    with pytest.raises(ValueError, match=rf"--output {tmp_path} is a directory; pass a .jsonl file name such as "
                                         rf"{tmp_path / 'train.jsonl'}"):
        run(target_dir, input_file, tmp_path)
    # An input of another kind (plain text) was read line by line, every line failing as malformed JSON.
    text = tmp_path / "prompts.txt"
    text.write_text("def f():\n")
    with pytest.raises(ValueError, match=r"--input .*prompts.txt has suffix '.txt'; pass a .jsonl/.parquet file"):
        run(target_dir, text, tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()


def test_resume_from_another_source_is_refused_before_any_generation(target_dir, input_file, tmp_path, monkeypatch):
    """Issue 11.4: appending to an output made from another input, target or temperature mixed sources."""
    out = tmp_path / "out.jsonl"
    run(target_dir, input_file, out)
    before = out.read_text()
    other_input = tmp_path / "other.jsonl"
    other_input.write_text(json.dumps({"text": "import os\n"}) + "\n")
    with pytest.raises(ValueError, match="other settings.*input_sha256"):
        run(target_dir, other_input, out)
    with pytest.raises(ValueError, match="temperature: 0.0 -> 0.7"):
        run(target_dir, input_file, out, temperature=0.7)
    other_target = make_tiny_target_dir(tmp_path, seed=3, name="other-target")
    with pytest.raises(ValueError, match="target"):
        run(other_target, input_file, out)
    # The same config with other weights under the same path, or the same weights in another precision: their
    # greedy answers differ, so neither resumes (the key held the config's hash and no dtype).
    with pytest.raises(ValueError, match=r"dtype: 'float32' -> 'bfloat16'"):
        run(target_dir, input_file, out, dtype="bfloat16")
    moved = tmp_path / "same-path"
    shutil.copytree(target_dir, moved)
    run(str(moved), input_file, tmp_path / "out2.jsonl")
    shutil.rmtree(moved)
    shutil.copytree(make_tiny_target_dir(tmp_path, seed=4, name="retrained"), moved)  # same config, other weights
    with pytest.raises(ValueError, match=r"other settings \(target_fingerprint: "):
        run(str(moved), input_file, tmp_path / "out2.jsonl")
    assert out.read_text() == before
    # The same through a relative name of the hub's form ("models/tgt"), which transformers loads as the directory
    # it names: it was keyed as a hub name (no weights), so other weights there resumed and mixed two models.
    monkeypatch.chdir(tmp_path)
    shutil.copytree(target_dir, tmp_path / "models" / "tgt")
    run("models/tgt", input_file, tmp_path / "out3.jsonl", limit=2)
    shutil.rmtree(tmp_path / "models" / "tgt")
    shutil.copytree(make_tiny_target_dir(tmp_path, seed=4, name="retrained2"), tmp_path / "models" / "tgt")
    with pytest.raises(ValueError, match=r"other settings \(target_fingerprint: "):
        run("models/tgt", input_file, tmp_path / "out3.jsonl")
    # An output begun by an earlier version, which recorded that name as a hub name: said why it cannot resume.
    from lilicorr_pl.data.regenerate import provenance_path

    record = provenance_path(tmp_path / "out3.jsonl")
    old = json.loads(record.read_text()) | {"target_fingerprint": None, "target_revision": None}
    record.write_text(json.dumps(old))
    with pytest.raises(ValueError, match=r"an earlier version read --target models/tgt as a hub name and recorded no "
                                         r"weights"):
        run("models/tgt", input_file, tmp_path / "out3.jsonl")
    # A record from before the weights, dtype and device were keyed: not resumable, and the message says why.
    from lilicorr_pl.data.regenerate import provenance_path

    old = {k: v for k, v in json.loads(provenance_path(out).read_text()).items()
           if k not in ("target_fingerprint", "dtype", "device_type")}
    provenance_path(out).write_text(json.dumps(old))
    with pytest.raises(ValueError, match=r"written by an earlier lilicorr version, whose record lacks device_type, "
                                         r"dtype, target_fingerprint, so resuming cannot be checked; choose a new"):
        run(target_dir, input_file, out)
    assert out.read_text() == before
    # A file this command did not write (no provenance record) is never appended to.
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"mine": 1}\n')
    with pytest.raises(ValueError, match="no .*provenance.json"):
        run(target_dir, input_file, foreign)
    assert foreign.read_text() == '{"mine": 1}\n'


def test_an_output_resumes_on_the_same_builtin_build_in_another_cache_folder(target_dir, input_file, tmp_path):
    """A built-in target's build is named by its key (the demo regenerates with it): in another cache folder (another
    LILICORR_CACHE, another node), the same files resume its output, which was refused as another target; other
    weights under that name, or another name, are still another target."""
    key = "tiny-target-test-837e6e19f26f5277"
    shutil.copytree(target_dir, tmp_path / "a" / key)
    out = tmp_path / "out.jsonl"
    run(str(tmp_path / "a" / key), input_file, out, limit=2)
    shutil.copytree(tmp_path / "a" / key, tmp_path / "b" / key)
    shutil.rmtree(tmp_path / "a")
    run(str(tmp_path / "b" / key), input_file, out)  # resumed: the rest answered
    assert len(read(out)) == len(RECORDS)
    shutil.copytree(tmp_path / "b" / key, tmp_path / "c" / "tiny-target-test-0123456789abcdef")
    with pytest.raises(ValueError, match=r"other settings \(target: "):
        run(str(tmp_path / "c" / "tiny-target-test-0123456789abcdef"), input_file, out)
    shutil.copytree(make_tiny_target_dir(tmp_path, seed=4, name="retrained"), tmp_path / "d" / key)
    with pytest.raises(ValueError, match=r"other settings \(target: .*target_fingerprint: "):
        run(str(tmp_path / "d" / key), input_file, out)


def test_an_output_recorded_before_whole_content_digests_resumes_on_its_own_target(target_dir, input_file, tmp_path):
    """An output begun before the target's weights were keyed by whole-content digests records the sampled rule's
    fingerprint: the same target resumes it (it was refused as "other settings", advising the original settings),
    other weights still do not."""
    import shutil

    from lilicorr_pl.data.fingerprint import fingerprint, fingerprint_target, sampled_sha256
    from lilicorr_pl.data.regenerate import provenance_path

    target = tmp_path / "target"
    shutil.copytree(target_dir, target)
    out = tmp_path / "out.jsonl"
    run(str(target), input_file, out, limit=2)
    record = json.loads(provenance_path(out).read_text())
    assert record.pop("target_hash") == "content"
    record["target_fingerprint"] = fingerprint(fingerprint_target({"name_or_path": str(target), "dtype": "torch.float32"},
                                                                  include_layers=False, file_hash=sampled_sha256))
    provenance_path(out).write_text(json.dumps(record))  # as an earlier version wrote it
    stats = run(str(target), input_file, out)
    assert stats.skipped == 2 and stats.succeeded > 0
    shutil.rmtree(target)
    shutil.copytree(make_tiny_target_dir(tmp_path, seed=5, name="other"), target)
    with pytest.raises(ValueError, match=r"other settings \(target_fingerprint: "):
        run(str(target), input_file, out)


def test_an_output_recorded_before_prompt_format_resumes_only_where_its_prompts_render_alike(target_dir, tmp_path):
    """Prompt format 2 passes a message's tool-call and name fields to the template; an output begun by format 1
    (recorded as nothing) resumed with no check, so a prompt whose user turn has a name would render otherwise than
    its first half did. It resumes where no prompt carries such a field, and is one line where one does."""
    from lilicorr_pl.data.regenerate import PROMPT_FORMAT, prompt_passes_fields, provenance_path

    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    out = tmp_path / "out.jsonl"
    run(target_dir, plain, out, limit=2)
    record = json.loads(provenance_path(out).read_text())
    assert record.pop("prompt_format") == PROMPT_FORMAT == 2
    provenance_path(out).write_text(json.dumps(record))  # as format 1 wrote it
    assert run(target_dir, plain, out, limit=3).skipped == 2
    named = [{"messages": [{"role": "user", "content": "Hi, who am I?", "name": "ada"}]}, *RECORDS]
    assert prompt_passes_fields(named[0]) and not any(prompt_passes_fields(r) for r in RECORDS)
    assert prompt_passes_fields({"prompt": named[0]["messages"]})  # a prompt-only chat record (TRL's)
    assert not prompt_passes_fields({"messages": [{"role": "user", "content": "q"},
                                                  {"role": "assistant", "content": None, "tool_calls": []},
                                                  {"role": "user", "content": "r", "name": "ada"}]})  # after the answer
    # The turns _make_job renders: a record's messages over a list prompt beside them; a list prompt with a
    # completion is never rendered.
    assert prompt_passes_fields({"prompt": [{"role": "user", "content": "q"}], **named[0]})
    assert not prompt_passes_fields({"prompt": named[0]["messages"], "completion": "a"})
    (tmp_path / "named.jsonl").write_text("".join(json.dumps(r) + "\n" for r in named))
    other = tmp_path / "other.jsonl"
    shutil.copy(out, other)
    json_record = json.loads(provenance_path(out).read_text()) | {"input_sha256": file_sha256(tmp_path / "named.jsonl")}
    provenance_path(other).write_text(json.dumps(json_record))
    before = other.read_text()
    with pytest.raises(ValueError, match=r"written by an earlier lilicorr version, whose prompts left the messages' "
                                         r"tool_calls, tool_call_id, name, reasoning_content out of the chat template, "
                                         r"and --input's prompts carry them; resuming would mix two renderings"):
        run(target_dir, tmp_path / "named.jsonl", other)
    assert other.read_text() == before
    # Another input is named as such (the cheaper check first), not as a rendering the input carries.
    with pytest.raises(ValueError, match=r"other settings \(input_sha256: "):
        run(target_dir, tmp_path / "named.jsonl", out)


def test_a_run_that_wrote_nothing_leaves_no_settings_behind_for_the_next(target_dir, input_file, tmp_path,
                                                                          monkeypatch):
    """A first run killed before its first line (here: every record failed) left its settings as the output's; a
    second run with other input was accepted onto the empty output and its answers were kept under the first run's
    settings, so a third run with those settings resumed onto the second run's answers."""
    from lilicorr_pl.data.regenerate import provenance_path

    def out_of_memory(self, *args, **kwargs):
        raise RuntimeError("CUDA out of memory (simulated)")

    out = tmp_path / "out.jsonl"
    monkeypatch.setattr(Qwen3ForCausalLM, "generate", out_of_memory)
    stats = run(target_dir, input_file, out)
    assert stats.succeeded == 0 and stats.failed == len(RECORDS) and out.read_text() == ""
    monkeypatch.undo()
    other_input = tmp_path / "other.jsonl"
    other_input.write_text(json.dumps({"text": "import os\n"}) + "\n")
    run(target_dir, other_input, out)
    assert len(read(out)) == 1
    saved = json.loads(provenance_path(out).read_text())
    assert saved["input_sha256"] == file_sha256(other_input)  # the settings of what the file holds
    with pytest.raises(ValueError, match="other settings.*input_sha256"):
        run(target_dir, input_file, out)


def test_non_utf8_line_is_a_failed_record_with_its_line_number(target_dir, tmp_path, capsys):
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b'{"text": "def f():\\n"}\n{"text": "caf\xe9"}\n{"text": "class A:\\n"}\n')
    stats = run(target_dir, path, tmp_path / "out.jsonl")
    assert (stats.succeeded, stats.failed) == (2, 1)
    assert "line 2: not valid UTF-8" in stats.errors[0][1]


def test_every_failure_names_its_record_by_file_and_1_based_line(target_dir, tmp_path, capsys):
    """Issue 11.9: "record 5" (0-based) next to "line 4" (1-based) in the same run; and "at at column"."""
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"text": "def f():\\n"}\n\n{"text": "class A:\\n"}\n{"text": ""}\n{"text": "a\tb"}\n'
                    '{"text": "unterminated}')  # no newline: the string just ends
    stats = run(target_dir, path, tmp_path / "out.jsonl")
    assert (stats.succeeded, stats.failed) == (2, 3)
    assert [message.split(":")[0] for _, message in stats.errors] == [
        "mixed.jsonl line 4", "mixed.jsonl line 5", "mixed.jsonl line 6"]
    assert "empty or non-string prompt" in stats.errors[0][1]
    assert "Invalid control character at column 12" in stats.errors[1][1]  # not "... at at column"
    assert "Unterminated string starting at column 10" in stats.errors[2][1]
    err = capsys.readouterr().err
    assert "record" not in err.replace("records", "") and " at at " not in err, err
    # The training-data reader words its errors the same way.
    from lilicorr_pl.data.formats import DataFormatError, read_records

    with pytest.raises(DataFormatError, match=r"mixed.jsonl line 5: malformed JSON \(Invalid control character at "
                                              r"column 12\)"):
        list(read_records(path))


def test_a_second_run_onto_a_live_runs_output_is_refused_before_its_model_loads(target_dir, input_file, tmp_path,
                                                                                 monkeypatch):
    """Two runs appending to one output (a second regenerate or demo started by mistake, a job array's twins) wrote
    every record twice, and the second cut the first's half-written last line as if a killed run had left it. The
    second is refused at once, and the live run's output is left as it is."""
    import fcntl

    out = tmp_path / "out.jsonl"
    run(target_dir, input_file, out, limit=2)
    before = out.read_text()
    with open(out, "a") as live:
        fcntl.flock(live.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a running regeneration holds
        live.write('{"source_index": 2, "compl')  # its next line, half written
        live.flush()
        monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("model loaded"))
        with pytest.raises(ValueError, match=r"another run is writing .*out.jsonl .*write to another file \(regenerate's --output\)"):
            run(target_dir, input_file, out)
        assert out.read_text() == before + '{"source_index": 2, "compl'
    monkeypatch.undo()
    stats = run(target_dir, input_file, out)  # once it has stopped, the next run resumes as from a killed one
    assert (stats.succeeded, stats.skipped) == (3, 2) and sorted(r["source_index"] for r in read(out)) == [0, 1, 2, 3, 4]


def test_a_refused_run_removes_nothing_and_a_file_removed_under_a_run_is_opened_again(target_dir, input_file,
                                                                                      tmp_path, monkeypatch):
    """Twins started at once both see no output: the one refused by the lock must not remove the file the other made
    and holds (it did: it had made "an empty file" too, and the live run wrote into a removed file). And a run that
    locks a file a failed run has just removed opens the path again instead of writing into the removed file."""
    import fcntl
    import importlib

    module = importlib.import_module("lilicorr_pl.data.regenerate")  # (the package exports the function by that name)
    real = module.hold_alone
    out = tmp_path / "new" / "out.jsonl"
    holder = []

    def the_twin_wins(fh, busy):  # between this run's look at the path and its lock, the other run takes it
        holder.append(open(out, "a"))
        fcntl.flock(holder[0].fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        return real(fh, busy)

    monkeypatch.setattr(module, "hold_alone", the_twin_wins)
    with pytest.raises(ValueError, match=r"another run is writing .*out.jsonl"):
        run(target_dir, input_file, out)
    assert out.exists() and os.path.samestat(os.fstat(holder[0].fileno()), os.stat(out))
    holder[0].close()
    out.unlink()

    calls = []

    def removed_first(fh, busy):  # a failed run removes the file this one has just opened and the folder it made
        calls.append(1)
        if len(calls) == 1:
            out.unlink()
            out.parent.rmdir()
        return real(fh, busy)

    monkeypatch.setattr(module, "hold_alone", removed_first)
    stats = run(target_dir, input_file, out)
    assert len(calls) == 2 and stats.succeeded == len(RECORDS) and len(read(out)) == len(RECORDS)


def test_a_sigterm_stops_regenerate_in_one_line_keeping_every_record_written(target_dir, input_file, tmp_path,
                                                                            monkeypatch, capsys):
    """A cancelled job (SIGTERM after the first batch) says what stopped and how to go on, exit status 143 (the
    default ended the process without a word); the rerun goes on after the records written, and the handler the
    command replaced is back."""
    import signal

    out = tmp_path / "out.jsonl"
    generate = Qwen3ForCausalLM.generate
    calls = []

    def cancelled_after_one_batch(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(Qwen3ForCausalLM, "generate", cancelled_after_one_batch)

    def outside(signum, frame):  # what a SIGTERM the command did not handle would reach (not the test run's end)
        raise RuntimeError("SIGTERM reached the handler the command should have replaced")

    before = signal.signal(signal.SIGTERM, outside)
    argv = ["regenerate", "--target", target_dir, "--input", str(input_file), "--output", str(out),
            "--max-new-tokens", "3", "--batch-size", "2", "--no-progress"]
    try:
        with pytest.raises(SystemExit) as exit_:
            cli_main(argv)
        assert exit_.value.code == 143 and signal.getsignal(signal.SIGTERM) is outside
    finally:
        signal.signal(signal.SIGTERM, before)
    assert capsys.readouterr().err.endswith("lilicorr regenerate: stopped by SIGTERM; rerun the same command: it goes "
                                            "on after the records already written (exit status 143)\n")
    assert len(read(out)) == 2  # the first batch, whole
    monkeypatch.setattr(Qwen3ForCausalLM, "generate", generate)
    assert cli_main(argv) == 0
    assert "succeeded 3, failed 0, skipped 2" in capsys.readouterr().out and len(read(out)) == 5


def test_a_refused_or_stopped_new_output_leaves_neither_file_nor_folders(target_dir, input_file, tmp_path,
                                                                         monkeypatch):
    with pytest.raises(ValueError, match="does not fit the target's context"):
        run(target_dir, input_file, tmp_path / "a" / "b" / "out.jsonl", max_new_tokens=10_000)
    assert list(tmp_path.iterdir()) == [tmp_path / "in.jsonl"]
    (tmp_path / "y").mkdir()  # a folder of the user's, named through a folder that does not exist
    with pytest.raises(ValueError, match="does not fit the target's context"):
        run(target_dir, input_file, tmp_path / "x" / ".." / "y" / "out.jsonl", max_new_tokens=10_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "y"]
    (tmp_path / "y").rmdir()

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Qwen3ForCausalLM, "generate", interrupted)  # Ctrl-C before the first record is written
    with pytest.raises(KeyboardInterrupt):
        run(target_dir, input_file, tmp_path / "a" / "b" / "out.jsonl")
    assert list(tmp_path.iterdir()) == [tmp_path / "in.jsonl"]


def test_a_stopped_run_leaves_folders_another_process_replaced_meanwhile(target_dir, input_file, tmp_path,
                                                                         monkeypatch):
    """A run stopped before its first record removed its empty output and the folders it had made by path: when
    another process had moved them away and made its own at the same paths meanwhile, the other process's file and
    folders went as the run's own."""
    a = tmp_path / "a"
    out = a / "b" / "out.jsonl"

    def replaced_then_interrupted(self, *args, **kwargs):
        a.rename(tmp_path / "moved")  # another process moves this run's levels away, its empty output and all
        out.parent.mkdir(parents=True)  # and makes its own at the same paths
        out.touch()
        raise KeyboardInterrupt

    monkeypatch.setattr(Qwen3ForCausalLM, "generate", replaced_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(target_dir, input_file, out)
    assert out.is_file()  # the other process's file and folders, kept
    assert (tmp_path / "moved" / "b" / "out.jsonl").is_file()  # the run's own, moved away: not touched


def test_a_stopped_run_whose_folder_became_a_file_raises_what_stopped_it(target_dir, input_file, tmp_path,
                                                                          monkeypatch):
    """The clean-up's look at the output path raised NotADirectoryError when a level of it had become a file, and
    that error replaced the Ctrl-C that stopped the run."""
    out = tmp_path / "c" / "out.jsonl"

    def replaced_by_a_file_then_interrupted(self, *args, **kwargs):
        (tmp_path / "c").rename(tmp_path / "moved")
        (tmp_path / "c").write_text("a file now")
        raise KeyboardInterrupt

    monkeypatch.setattr(Qwen3ForCausalLM, "generate", replaced_by_a_file_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(target_dir, input_file, out)
    assert (tmp_path / "c").read_text() == "a file now"


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": float("nan")}, "finite number >= 0"),
    ({"limit": -1}, "limit must be >= 1"),
    ({"max_new_tokens": 10_000}, "does not fit the target's context"),
])
def test_bad_settings_fail_before_the_model_loads(target_dir, input_file, tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        run(target_dir, input_file, tmp_path / "out.jsonl", **kwargs)
    assert not (tmp_path / "out.jsonl").exists()


def test_a_missing_chat_template_file_names_regenerates_own_option(target_dir, input_file, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"neither a Jinja template nor an existing file; .*\(--chat-template\)"):
        run(target_dir, input_file, tmp_path / "out.jsonl", chat_template="no_such_template.jinja")
    assert not (tmp_path / "out.jsonl").exists()


def test_builtin_and_missing_targets_get_one_clear_line(input_file, tmp_path):
    with pytest.raises(ValueError, match="lilicorr build-target"):
        regenerate("builtin:full", input_file, tmp_path / "out.jsonl")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        regenerate(str(tmp_path / "nope"), input_file, tmp_path / "out.jsonl")
    with pytest.raises(FileNotFoundError, match="does not exist"):  # a path written on Windows is a path too
        regenerate("C:\\models\\target", input_file, tmp_path / "out.jsonl")
    with pytest.raises(FileNotFoundError, match="does not exist"):  # no hub id has two slashes
        regenerate("runs/x/target", input_file, tmp_path / "out.jsonl")


def test_a_target_under_home_is_found_with_tilde(target_dir, input_file, tmp_path, monkeypatch):
    """``~`` is expanded for the load too, not just for the existence check (transformers does not expand it)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "target").symlink_to(target_dir)
    out = tmp_path / "out.jsonl"
    stats = run("~/models/target", input_file, out)
    assert stats.succeeded == 5 and stats.failed == 0
    assert len(read(out)) == 5


def test_a_hub_target_is_keyed_by_the_commit_it_resolves_to(target_dir, input_file, tmp_path, monkeypatch):
    """A hub name's new revision must not be appended to the old one's answers (the name alone was the key)."""
    import huggingface_hub.constants

    from lilicorr_pl.data.regenerate import provenance_path

    repo = tmp_path / "hub" / "models--org--tiny"  # the HF cache's layout, as a download leaves it
    shutil.copytree(target_dir, repo / "snapshots" / "rev1")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("rev1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    out = tmp_path / "out.jsonl"
    run("org/tiny", input_file, out, limit=2)
    assert json.loads(provenance_path(out).read_text())["target_revision"] == "rev1"
    run("org/tiny", input_file, out)  # the same revision resumes
    before = out.read_text()
    assert len(read(out)) == len(RECORDS)
    shutil.copytree(target_dir, repo / "snapshots" / "rev2")  # the hub moved on
    (repo / "refs" / "main").write_text("rev2")
    with pytest.raises(ValueError, match=r"other settings \(target_revision: 'rev1' -> 'rev2'\)"):
        run("org/tiny", input_file, out)
    record = json.loads(provenance_path(out).read_text())
    del record["target_revision"]  # a hub target's record from before the revision was keyed
    provenance_path(out).write_text(json.dumps(record))
    with pytest.raises(ValueError, match="earlier lilicorr version, whose record lacks target_revision"):
        run("org/tiny", input_file, out)
    assert out.read_text() == before
    # A local directory is keyed by its weights instead: no revision in its record.
    local = tmp_path / "local.jsonl"
    run(target_dir, input_file, local, limit=1)
    assert "target_revision" not in json.loads(provenance_path(local).read_text())


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_output_that_cannot_be_created_is_one_line_not_a_loop_for_ever(target_dir, input_file):
    """A folder that exists and takes no new file (/proc) made the open-and-retry loop spin at 100 % CPU for ever."""
    with pytest.raises(ValueError, match=r"--output /proc/r\.jsonl cannot be created \(No such file or directory\); "
                                         r"write to another file"):
        run(target_dir, input_file, Path("/proc/r.jsonl"))


def test_prompt_only_records_are_answered_as_prompt_and_completion(target_dir, tmp_path):
    """``{"prompt": ...}`` is what bench reads and what a user would regenerate from; it was an unknown format."""
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": 7, "prompt": "def add(a, b):\n"}) + "\n")
    out = tmp_path / "out.jsonl"
    stats = run(target_dir, inp, out)
    assert (stats.succeeded, stats.failed) == (1, 0)
    (rec,) = read(out)
    assert rec["id"] == 7 and rec["prompt"] == "def add(a, b):\n" and isinstance(rec["completion"], str)
    assert load_examples([str(out)], AutoTokenizer.from_pretrained(target_dir), max_length=512)  # training data


def test_an_input_none_of_whose_records_can_be_answered_is_one_line_before_the_model_loads(target_dir, tmp_path,
                                                                                          monkeypatch):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"question": "a"}) + "\n" + "{not json\n")

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_load)
    out = tmp_path / "sub" / "out.jsonl"
    with pytest.raises(ValueError, match=r"none of the 2 record\(s\) .* the first: in.jsonl line 1: unknown record "
                                         r"format; keys seen: \['question'\]"):
        run(target_dir, inp, out)
    assert not out.exists() and not out.parent.exists()  # nothing left behind
    # An empty or blank input: the model loaded, wrote an empty output and its record, and said it succeeded.
    inp.write_text("\n  \n")
    with pytest.raises(ValueError, match=r"--input .*in.jsonl holds no records \(it is empty or blank\); nothing to "
                                         r"regenerate"):
        run(target_dir, inp, out)
    assert not out.exists() and not out.parent.exists()
    # A folder as --input and a training checkpoint as --target: named as what they are (both "did not exist").
    (tmp_path / "sub").mkdir()
    with pytest.raises(FileNotFoundError, match=r"regeneration input .*/sub' is a directory; pass the .jsonl file in it"):
        run(target_dir, tmp_path / "sub", out)
    (tmp_path / "sub").rmdir()
    ckpt = tmp_path / "last.ckpt"
    ckpt.write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match=r"--target .*last.ckpt is a file, not a model directory; a training "
                                                r"checkpoint drafts, it does not generate; pass the target model's "
                                                r"directory or hub name$"):  # the advice once (it was given twice)
        run(str(ckpt), inp, out)
    # ... and so is one named without a folder (`--target last.ckpt` in its folder), not read as a hub name
    # (transformers then read the checkpoint as a config file).
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"--target last.ckpt is a file, not a model directory; a training "):
        run("last.ckpt", inp, out)


def test_an_output_that_is_not_jsonl_is_refused(target_dir, input_file, tmp_path):
    with pytest.raises(ValueError, match=r"must be a \.jsonl file .* pass e\.g\. .*out\.jsonl"):
        run(target_dir, input_file, tmp_path / "out.txt")
    assert not (tmp_path / "out.txt").exists()


def test_a_drafter_or_a_folder_without_a_model_as_target_is_one_line(target_dir, input_file, tmp_path):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps({**cfg, "architectures": ["DFlashDraftModel"],
                                                     "dflash_config": {"mask_token_id": 0}}))
    for target, message in ((drafter, r"is a drafter \(DFlashDraftModel\), not a target model"),
                            (tmp_path / "in_empty", r"is not a model directory or reachable hub model")):
        Path(target).mkdir(exist_ok=True)
        with pytest.raises(ValueError, match=message):
            run(str(target), input_file, tmp_path / "out.jsonl")
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(target_dir) / name, no_tokenizer / name)
    with pytest.raises(ValueError, match=r"holds no tokenizer \(transformers made an empty one"):
        run(str(no_tokenizer), input_file, tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()


def test_before_the_model_loads_records_are_tokenized_only_until_one_can_be_answered(target_dir, input_file, tmp_path,
                                                                                  monkeypatch):
    """A million-record input is not held as token ids at once: its records become jobs batch by batch."""
    import sys

    regen = sys.modules[regenerate.__module__]  # the module (the package exports its function under its name)
    made: list[int] = []
    seen_at_load: list[int] = []
    original_make, original_load = regen._make_job, AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(regen, "_make_job", lambda index, *a, **k: made.append(index) or original_make(index, *a, **k))

    def load(*a, **k):
        seen_at_load.append(len(made))
        return original_load(*a, **k)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", load)
    stats = run(target_dir, input_file, tmp_path / "out.jsonl")
    assert stats.succeeded == len(RECORDS) and seen_at_load == [1] and sorted(made) == list(range(len(RECORDS)))


def test_a_resume_with_only_unanswerable_records_left_counts_them_as_the_first_run_did(target_dir, tmp_path, capsys):
    """The refusal is for an input none of whose records can be answered; on a resume they are counted, and a record's
    format error says it is the input's to fix (it said "retried by the next run")."""
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"text": "def f(x):"}) + "\n" + json.dumps({"question": "?"}) + "\n")
    out = tmp_path / "out.jsonl"
    first = run(target_dir, inp, out)
    assert (first.succeeded, first.failed) == (1, 1)
    assert "failed, fix it in --input and regenerate into a new --output: in.jsonl line 2: unknown record format" in \
        capsys.readouterr().err
    again = run(target_dir, inp, out)
    assert (again.succeeded, again.failed, again.skipped) == (0, 1, 1)
    # The advice holds: the fixed input is another input, refused onto this output (it said "a rerun answers it
    # then", and the rerun was refused) and answered whole into a new one.
    inp.write_text(json.dumps({"text": "def f(x):"}) + "\n" + json.dumps({"text": "def g(y):"}) + "\n")
    with pytest.raises(ValueError, match=r"was produced with other settings \(input_sha256: "):
        run(target_dir, inp, out)
    fixed = run(target_dir, inp, tmp_path / "fixed.jsonl")
    assert (fixed.succeeded, fixed.failed) == (2, 0)
    # A record of what produced the output that is not the object regenerate writes: one line naming it (a damaged
    # one was a bare JSON error, a list an AttributeError).
    record = tmp_path / "fixed.jsonl.provenance.json"
    for damaged in (record.read_text()[:50], "[1, 2]"):
        record.write_text(damaged)
        with pytest.raises(ValueError, match=rf"--output .*fixed.jsonl: .*{record.name} is not the JSON object "
                                             r"lilicorr regenerate writes there \(damaged or replaced\)"):
            run(target_dir, inp, tmp_path / "fixed.jsonl")


def test_a_prompt_beside_text_stays_a_text_record_and_a_list_prompt_is_a_chat_prompt(target_dir, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt": "ignored", "text": "import os\nimport sys\n"}) + "\n"
                   + json.dumps({"prompt": [{"role": "user", "content": "What is two plus two?"}]}) + "\n")
    out = tmp_path / "out.jsonl"
    stats = run(target_dir, inp, out, prefix_chars=9)
    assert (stats.succeeded, stats.failed) == (2, 0)
    text, chat = sorted(read(out), key=lambda r: r["source_index"])
    assert text["prompt"] == "import os"  # the text record, cut by --prefix_chars as fit's loader reads it
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant"]
    assert chat["messages"][0]["content"] == "What is two plus two?"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_device_the_machine_lacks_is_refused_before_the_model_loads(target_dir, input_file, tmp_path, monkeypatch):
    """`regenerate --device cuda` on a CPU machine was torch's AssertionError after the model had loaded (bench and
    perf refused it up front)."""
    import sys

    monkeypatch.setattr(sys.modules["lilicorr_pl.data.regenerate"], "load_causal_lm", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(ValueError, match="--device cuda: CUDA is not available on this machine; use --device cpu"):
        run(target_dir, input_file, tmp_path / "out.jsonl", device="cuda")
    assert not (tmp_path / "out.jsonl").exists()


def test_a_chat_template_that_does_not_parse_is_one_line_before_the_model_loads(target_dir, input_file, tmp_path,
                                                                              monkeypatch):
    """With a text record to answer (so not "none can be answered"), it was a failure per chat record after the
    model loaded, each advised "fix it in --input; a rerun answers it then" (the input was fine), and naming
    data.chat_template, an option regenerate does not have."""
    import importlib

    regen = importlib.import_module("lilicorr_pl.data.regenerate")  # the package's name for the function shadows it
    monkeypatch.setattr(regen, "load_causal_lm", lambda *a, **k: pytest.fail("the model loaded first"))
    broken = "{% for m in messages %}{{ m.content }"
    with pytest.raises(ValueError, match=r"^the chat template does not parse \(template line 1: .*; fix "
                                         r"--chat-template, or the target tokenizer's chat_template$"):
        run(target_dir, input_file, tmp_path / "out.jsonl", chat_template=broken)
    assert not (tmp_path / "out.jsonl").exists()
    text_only = tmp_path / "text.jsonl"  # prompts the template never renders: not refused for it
    text_only.write_text(json.dumps(RECORDS[2]) + "\n")
    with pytest.raises(pytest.fail.Exception, match="the model loaded first"):
        run(target_dir, text_only, tmp_path / "text-out.jsonl", chat_template=broken)


def test_a_resume_with_other_stop_ids_or_another_tokenizer_is_refused_before_the_model_loads(target_dir, input_file,
                                                                                            tmp_path, monkeypatch):
    """The target's fingerprint reads config.json and the weights; where answers stop (generation_config.json) and
    how prompts become ids (the tokenizer's files) were not in the record, so a resume mixed two stop rules."""
    from lilicorr_pl.data.regenerate import provenance_path

    target = tmp_path / "target"
    shutil.copytree(target_dir, target)
    out = tmp_path / "out.jsonl"
    run(str(target), input_file, out, limit=2)
    before = out.read_text()
    recorded = json.loads(provenance_path(out).read_text())
    model = AutoModelForCausalLM.from_pretrained(target)
    assert recorded["stop_token_ids"] == sorted(set(recorded["stop_token_ids"]))
    from lilicorr_pl.target import stop_token_ids

    assert recorded["stop_token_ids"] == stop_token_ids(AutoTokenizer.from_pretrained(target), model.config,
                                                        model.generation_config)  # what the loaded model stops at
    loads = []
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loads.append(1))
    generation = json.loads((target / "generation_config.json").read_text())
    eos = generation.get("eos_token_id")
    generation["eos_token_id"] = [*(eos if isinstance(eos, list) else [eos] if eos is not None else []), 7]
    (target / "generation_config.json").write_text(json.dumps(generation))
    with pytest.raises(ValueError, match=r"other settings \(stop_token_ids: \["):
        run(str(target), input_file, out)
    shutil.copy(Path(target_dir) / "generation_config.json", target / "generation_config.json")
    tokenizer = AutoTokenizer.from_pretrained(target)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    tokenizer.save_pretrained(target)
    with pytest.raises(ValueError, match=r"other settings \(tokenizer_sha256: "):
        run(str(target), input_file, out)
    assert loads == [] and out.read_text() == before
    # A record written before these were kept resumes as it did (on the target it was made with).
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(target_dir) / name).exists():
            shutil.copy(Path(target_dir) / name, target / name)
    monkeypatch.undo()
    old = {k: v for k, v in recorded.items() if k not in ("stop_token_ids", "tokenizer_sha256")}
    provenance_path(out).write_text(json.dumps(old))
    stats = run(str(target), input_file, out)
    assert stats.skipped == 2 and stats.succeeded == len(RECORDS) - 2


def test_a_target_without_a_generation_config_stops_where_its_model_does(tmp_path):
    from transformers import AutoConfig

    from lilicorr_pl.data.regenerate import _generation_config
    from lilicorr_pl.target import stop_token_ids

    target = Path(make_tiny_target_dir(tmp_path, name="bare"))
    (target / "generation_config.json").unlink(missing_ok=True)
    model = AutoModelForCausalLM.from_pretrained(target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    config = AutoConfig.from_pretrained(target)
    assert stop_token_ids(tokenizer, config, _generation_config(str(target), config)) == stop_token_ids(
        tokenizer, model.config, model.generation_config)


def test_a_settings_record_regenerate_did_not_write_is_neither_replaced_nor_removed(target_dir, input_file, tmp_path):
    """Beside a missing output, a file at the settings record's name was removed by a run that failed (it had never
    written one) and replaced by a run that succeeded."""
    from lilicorr_pl.data.regenerate import provenance_path

    out = tmp_path / "out.jsonl"
    record = provenance_path(out)
    record.write_text('{"note": "my record"}')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for source in (empty, input_file):
        with pytest.raises(ValueError, match=r"out\.jsonl\.provenance\.json exists and is not a settings record "
                                             r"lilicorr regenerate wrote.*move it away"):
            run(target_dir, source, out)
        assert record.read_text() == '{"note": "my record"}' and not out.exists()
    # An earlier run's own record beside an empty output (it wrote no line) is this command's to replace, and a run
    # that fails before writing a line keeps the record it found.
    record.unlink()
    run(target_dir, input_file, out, limit=1)
    mine = record.read_text()
    out.write_text("")
    with pytest.raises(ValueError, match="holds no records"):
        run(target_dir, empty, out)
    assert record.read_text() == mine


def test_a_damaged_line_in_the_output_is_refused_by_number_not_skipped_and_appended_again(target_dir, input_file,
                                                                                        tmp_path):
    out = tmp_path / "out.jsonl"
    run(target_dir, input_file, out, limit=3)
    lines = out.read_bytes().split(b"\n")
    cases = ((lines[1][: len(lines[1]) // 2], "JSONDecodeError"), (b'{"x": "caf\xe9"}', "UnicodeDecodeError"),
             (b'{"no_index": 1}', "KeyError"))
    for damaged, why in cases:
        out.write_bytes(b"\n".join([lines[0], damaged, *lines[2:]]))
        with pytest.raises(ValueError, match=rf"out\.jsonl line 2 is not a record lilicorr regenerate wrote "
                                             rf"\({why}.*remove or repair that line"):
            run(target_dir, input_file, out)
    out.write_bytes(b"\n".join(lines))
    assert run(target_dir, input_file, out).skipped == 3


def test_a_builtin_target_is_refused_naming_the_preset_that_builds_it(tmp_path):
    """regenerate --target builtin:tiny told the user to build `--preset full` (another target): each built-in name is
    refused naming the preset `lilicorr build-target` builds it with."""
    from lilicorr_pl.builtin import TARGET_PRESETS
    from lilicorr_pl.data.regenerate import regenerate

    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "def f(x):"}\n')
    presets = ", ".join(f"builtin:{name}: --preset {preset}" for name, preset in TARGET_PRESETS.items())
    for name in (*TARGET_PRESETS, "nonesuch"):
        with pytest.raises(ValueError, match=re.escape(
                f"--target builtin:{name}: regenerate needs a model directory or hub name; pass the directory `lilicorr "
                f"build-target` prints for the preset of the built-in target ({presets})")):
            regenerate(f"builtin:{name}", str(source), str(tmp_path / "out.jsonl"))
    assert not (tmp_path / "out.jsonl").exists()


def test_sampled_answers_resume_as_an_uninterrupted_run_and_no_batch_repeats_anothers(target_dir, tmp_path):
    """At T > 0 the run seeded one stream from --seed: a resume restarted it, so the records after a stop drew the draws
    the first records had drawn (record 8 came out as record 0), and a resumed output was not the uninterrupted one.
    Each batch now draws from a stream of its first record; an output of the earlier rule is refused as such."""
    texts = [{"text": "def f(x):\n    return x + 1\n"} for _ in range(8)]  # the same prompt: the draws tell them apart
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in texts))
    settings = {"temperature": 1.0, "batch_size": 2, "max_new_tokens": 12, "seed": 5}
    whole = tmp_path / "whole.jsonl"
    run(target_dir, source, whole, **settings)
    resumed = tmp_path / "resumed.jsonl"
    run(target_dir, source, resumed, limit=4, **settings)  # stopped after 4 records: resumed by the next run
    run(target_dir, source, resumed, **settings)
    # Stopped inside a batch (3 of 8): that batch (records 2 and 3, each drawn alone) differs; the later batches keep
    # to their multiples of the batch size and draw what the uninterrupted run drew.
    inside = tmp_path / "inside.jsonl"
    run(target_dir, source, inside, limit=3, **settings)
    run(target_dir, source, inside, **settings)
    lines, expected = inside.read_text().splitlines(), whole.read_text().splitlines()
    assert lines[:2] == expected[:2] and lines[4:] == expected[4:] and lines[2:4] != expected[2:4]
    answers = [json.loads(line)["completion"] for line in resumed.read_text().splitlines()]
    assert len(set(answers[:4]) & set(answers[4:])) < 2  # the resumed half did not draw the first half's draws again
    assert resumed.read_text() == whole.read_text()
    from lilicorr_pl.data.regenerate import provenance_path

    record = json.loads(provenance_path(whole).read_text())
    assert record["sampling_streams"] == {"rule": 2, "batch_size": 2}
    del record["sampling_streams"]  # as an earlier version recorded it
    provenance_path(whole).write_text(json.dumps(record))
    with pytest.raises(ValueError, match="written by an earlier lilicorr version, whose record lacks sampling_streams"):
        run(target_dir, source, whole, **settings)


def test_answers_regenerated_by_another_target_are_told_apart_from_this_targets(target_dir, input_file, tmp_path):
    """fit read only the thinking flag and the template from a regenerated file's records: training on answers another
    model (or other weights under the same path) wrote was silent. The settings record beside the file names the
    target by its files' digests: the same files anywhere are the same target, other weights are said."""
    from lilicorr_pl.data.regenerate import answered_by_another_target

    out = tmp_path / "out.jsonl"
    run(target_dir, input_file, out)
    assert answered_by_another_target(out, target_dir) is None
    moved = shutil.copytree(target_dir, tmp_path / "elsewhere")  # the same files in another folder
    assert answered_by_another_target(out, moved) is None
    other = tmp_path / "other"
    model = Qwen3ForCausalLM.from_pretrained(target_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    model.save_pretrained(other)
    AutoTokenizer.from_pretrained(target_dir).save_pretrained(other)
    said = answered_by_another_target(out, other)
    assert said == (f"out.jsonl holds answers lilicorr regenerate wrote with the target {target_dir} (its "
                    f"out.jsonl.provenance.json), whose config and weight files are not those of model.target {other}: "
                    "the drafter learns another model's continuations; regenerate the data with this target, or train "
                    "against that one")
    # Nothing to compare: a file without a settings record, a hub name, no target.
    assert answered_by_another_target(input_file, other) is None
    assert answered_by_another_target(out, "Qwen/Qwen3-8B") is None and answered_by_another_target(out, None) is None
