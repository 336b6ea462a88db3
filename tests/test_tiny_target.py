"""The tiny stdlib-trained Qwen3 target: corpus splits, build, cache behaviour and loadability."""

from __future__ import annotations

import json

import math
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch

from lilicorr_pl.data import corpus
from lilicorr_pl.demo import tiny_target
from lilicorr_pl.demo.tiny_target import TinyTargetConfig, build_tiny_target, load_build_report

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One test-size build shared by the tests that only read it: (cache root, build directory)."""
    root = tmp_path_factory.mktemp("tiny_target_cache")
    umask = os.umask(0o022)  # a known mode for new files (0644), whatever the test run's umask
    try:
        return root, build_tiny_target("test", cache_dir=root, progress=False)
    finally:
        os.umask(umask)


def test_splits_are_disjoint_whole_modules() -> None:
    root = corpus.stdlib_root()
    train = {corpus.module_name(p.relative_to(root)) for p in corpus.stdlib_files("train")}
    heldout = {corpus.module_name(p.relative_to(root)) for p in corpus.stdlib_files("heldout")}
    assert train and heldout
    assert not train & heldout
    assert 0.03 <= len(heldout) / (len(train) + len(heldout)) <= 0.2
    files = corpus.stdlib_files("train") + corpus.stdlib_files("heldout")
    assert all(not {"test", "tests", "site-packages", "__pycache__"} & set(p.relative_to(root).parts) for p in files)
    assert all(p.stat().st_size <= corpus.MAX_FILE_BYTES for p in files)
    train_files = corpus.stdlib_files("train")
    assert train_files == sorted(train_files, key=lambda p: p.relative_to(root).as_posix())


def test_empty_stdlib_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpus, "stdlib_root", lambda: tmp_path)
    with pytest.raises(FileNotFoundError, match="No Python sources"):
        corpus.stdlib_files("train")
    with pytest.raises(ValueError, match="Unknown corpus split"):
        corpus.stdlib_files("validation")  # type: ignore[arg-type]


def test_the_corpus_key_follows_the_files_bytes_not_only_their_sizes(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A stdlib file edited in place at the same size (a distribution's patch, a one-character fix) is other corpus
    text: the key that names the target's build and the demo's data must change with it (it hashed names and
    sizes, so the stale build and data were reused)."""
    monkeypatch.setattr(corpus, "stdlib_root", lambda: tmp_path)
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "decoder.py").write_text("def loads(s):\n    return s\n")
    (tmp_path / "heapq.py").write_text("def push(h, x):\n    h.append(x)\n")
    before = corpus.corpus_fingerprint()
    assert corpus.corpus_fingerprint() == before  # deterministic
    (tmp_path / "heapq.py").write_text("def push(h, y):\n    h.append(y)\n")  # the same size
    assert corpus.corpus_fingerprint() != before


def test_loads_with_auto_classes_and_padded_vocab(built: tuple[Path, Path]) -> None:
    _, directory = built
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    rows = model.get_input_embeddings().weight.shape[0]
    assert model.get_output_embeddings().weight.shape[0] == rows
    assert rows > len(tokenizer) and rows % 64 == 0
    assert model.config.mask_token_id == len(tokenizer) < rows
    assert load_build_report(directory)["mask_token_id"] == len(tokenizer)
    assert model.config.model_type == "qwen3"
    assert model.config.num_hidden_layers == TinyTargetConfig.test().num_hidden_layers
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.pad_token_id == tokenizer.eos_token_id
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in model.generation_config.eos_token_id
    # The padded rows are real rows: the mask embedding is finite and not all zeros.
    mask_row = model.get_input_embeddings().weight[model.config.mask_token_id]
    assert torch.isfinite(mask_row).all() and mask_row.abs().sum() > 0
    code = "def add(a, b):\n    return a + b\n"
    assert tokenizer.decode(tokenizer.encode(code, add_special_tokens=False)) == code
    with torch.no_grad():
        logits = model(**tokenizer(code, return_tensors="pt")).logits
    assert logits.shape[-1] == rows


def test_the_config_a_build_will_have_is_known_before_it_and_none_after(built: tuple[Path, Path],
                                                                          tmp_path: Path) -> None:
    """What a command checks its settings against before it starts a build: the build's own config.json, to the key."""
    root, directory = built
    assert tiny_target.unbuilt_model_config("test", cache_dir=root) is None  # built: the run reads the real one
    preview = tiny_target.unbuilt_model_config("test", cache_dir=tmp_path)
    assert preview is not None
    preview.save_pretrained(tmp_path / "preview")
    assert (tmp_path / "preview" / "config.json").read_text() == (directory / "config.json").read_text()


def test_config_json_carries_a_top_level_rope_theta(built: tuple[Path, Path]) -> None:
    """transformers 4.x (which serving engines pin) reads a top-level rope_theta and else uses 10000."""
    import json

    config = json.loads((built[1] / "config.json").read_text())
    theta = TinyTargetConfig.test().rope_theta
    assert theta != 10000.0  # the silent default would show
    assert config["rope_theta"] == theta
    assert config.get("rope_parameters", {}).get("rope_theta", theta) == theta  # and transformers 5.x agrees
    assert transformers.AutoConfig.from_pretrained(built[1]).rope_parameters["rope_theta"] == theta


def test_chat_template(built: tuple[Path, Path]) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(built[1])
    messages = [{"role": "user", "content": "def f(x):\n"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\ndef f(x):\n<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=False) == prompt
    answer = {"role": "assistant", "content": "    return x\n"}
    full = tokenizer.apply_chat_template(messages + [answer], tokenize=False)
    assert full.endswith("<|im_start|>assistant\n    return x\n<|im_end|>\n")
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_report_has_metrics_and_training_helped(built: tuple[Path, Path]) -> None:
    _, directory = built
    report = load_build_report(directory)
    for key in ("fingerprint", "config", "num_params", "train_seconds", "heldout_loss", "heldout_top1",
                "repetition_rate_t0", "repetition_rate_t1", "mask_token_id"):
        assert key in report, key
    assert 0.0 <= report["heldout_top1"] <= 1.0
    assert 0.0 <= report["repetition_rate_t0"] <= 1.0 and 0.0 <= report["repetition_rate_t1"] <= 1.0
    assert report["heldout_loss"] < math.log(report["vocab_size"])
    # Against the same architecture and seed, untrained, on the same held-out tokens.
    config = TinyTargetConfig.test()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    stream = tiny_target._token_stream(list(corpus.read_corpus("heldout")), tokenizer)
    untrained = tiny_target.heldout_metrics(tiny_target.make_model(config, tokenizer), stream, config)
    assert report["heldout_loss"] < untrained["heldout_loss"] - 0.5


def test_second_call_reuses_cache(built: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    root, directory = built

    def must_not_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("a valid cached build was rebuilt")

    monkeypatch.setattr(tiny_target, "_build_into", must_not_build)
    assert build_tiny_target(TinyTargetConfig.test(), cache_dir=root, progress=False) == directory


def test_corrupted_cache_is_rebuilt(
    built: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / built[1].name
    shutil.copytree(built[1], directory)
    (directory / tiny_target.WEIGHTS_NAME).unlink()
    calls = []
    real_build = tiny_target._build_into
    monkeypatch.setattr(tiny_target, "_build_into", lambda *a, **k: calls.append(1) or real_build(*a, **k))
    torch.manual_seed(1234)
    stream, threads = torch.get_rng_state(), torch.get_num_threads()
    gpu_seeds: list[int] = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", gpu_seeds.append)  # what torch.manual_seed seeds beside the CPU
    assert build_tiny_target("test", cache_dir=tmp_path, progress=False) == directory
    assert calls == [1]
    # The caller's random streams and threads are as before the build: a fit seeded before its target was built drew
    # another drafter initialisation and other anchors than the same fit with the target cached. A GPU's generators
    # are not seeded (the build runs on the CPU): that replaced the seed seed_everything queued for a GPU.
    assert torch.equal(torch.get_rng_state(), stream) and torch.get_num_threads() == threads and gpu_seeds == []
    assert (directory / tiny_target.WEIGHTS_NAME).is_file()
    assert tiny_target._cache_problem(directory, load_build_report(directory)["fingerprint"]) is None
    assert [p.name for p in tmp_path.iterdir()] == [directory.name]  # no temp or old dirs left behind


def test_a_damaged_build_report_is_a_reason_to_rebuild_not_a_traceback(built: tuple[Path, Path], tmp_path: Path) -> None:
    """A report that is not UTF-8 was a UnicodeDecodeError traceback (build-target, even with --force) or a line
    naming neither the file nor the fix (fit, bench, export); a file list of the wrong shape a TypeError."""
    directory = tmp_path / built[1].name
    shutil.copytree(built[1], directory)
    report = directory / tiny_target.REPORT_NAME
    fingerprint = load_build_report(directory)["fingerprint"]
    report.write_bytes(b"\xff\xfe\x00garbage")
    assert tiny_target._cache_problem(directory, fingerprint) == "unreadable build report (UnicodeDecodeError)"
    assert tiny_target._foreign_entries(directory) == []
    report.write_text(json.dumps({"fingerprint": fingerprint, "files": {tiny_target.WEIGHTS_NAME: 1}}))
    assert tiny_target._cache_problem(directory, fingerprint) == "the build report's file list is not the one a build writes"


def test_interrupted_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny_target, "train_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_tiny_target("test", cache_dir=tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_a_build_clears_killed_builds_temporaries_and_never_a_live_one(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Before building, leftovers of this build's killed runs are removed; a live build's temporary directory, on this
    host or on another sharing the cache, is not (its pid means nothing here: before the host was in the name, a
    build on another node lost its directory to this clean-up)."""
    monkeypatch.setattr(socket, "gethostname", lambda: "node1.cluster")
    monkeypatch.setattr(tiny_target, "train_model", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    name = f"tiny-target-test-{tiny_target.build_fingerprint(TinyTargetConfig.preset('test'))}"
    dead, live, remote = (tmp_path / f".{name}.{tag}.tmp" for tag in
                          ("w@node1.cluster@999999@dead", f"w@node1.cluster@{os.getpid()}@live", "w@node2.cluster@1@busy"))
    for path in (dead, live, remote):
        path.mkdir()
    with pytest.raises(KeyboardInterrupt):
        build_tiny_target("test", cache_dir=tmp_path, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, remote.name])


def test_a_builds_files_get_the_mode_any_new_file_gets(built: tuple[Path, Path]) -> None:
    """safetensors writes its file 0600, so a target cache shared by a group (``LILICORR_CACHE``) held weights the
    others could not read beside JSON they could; every file of a build now gets the mode a new file gets there."""
    modes = {path.name: path.stat().st_mode & 0o777 for path in built[1].iterdir()}
    assert tiny_target.WEIGHTS_NAME in modes and set(modes.values()) == {0o644}, modes  # built under umask 022


def test_heldout_prefixes_are_deterministic_and_fit(built: tuple[Path, Path]) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(built[1])
    prefixes = corpus.heldout_prefixes(tokenizer, num=4, prefix_tokens=48, seed=3)
    assert prefixes == corpus.heldout_prefixes(tokenizer, num=4, prefix_tokens=48, seed=3)
    assert prefixes != corpus.heldout_prefixes(tokenizer, num=4, prefix_tokens=48, seed=4)
    heldout_text = "\n".join(corpus.read_corpus("heldout"))
    for prefix in prefixes:
        assert 24 <= len(tokenizer.encode(prefix, add_special_tokens=False)) <= 48
        assert prefix.endswith(":\n") or "#" in prefix.splitlines()[-1]  # cut right after a def/class header
        assert prefix in heldout_text
    # The training split serves the demo's regeneration prompts; those never come from held-out code.
    train_prefixes = corpus.code_prefixes(tokenizer, num=4, prefix_tokens=48, seed=3, split="train")
    train_text = "\n".join(corpus.read_corpus("train"))
    assert all(prefix in train_text and prefix not in heldout_text for prefix in train_prefixes)


def test_repetition_rate() -> None:
    assert tiny_target.repetition_rate([[1, 2, 3, 4, 1, 2, 3, 4]]) == pytest.approx(1 / 5)
    assert tiny_target.repetition_rate([[7, 7, 7, 7, 7, 7]]) == pytest.approx(2 / 3)
    assert tiny_target.repetition_rate([[1, 2, 3], []]) == 0.0


def test_config_validation_and_padding() -> None:
    assert TinyTargetConfig(vocab_size=4096).embedding_rows == 4160
    assert TinyTargetConfig(vocab_size=4095).embedding_rows == 4096
    with pytest.raises(ValueError, match="num_key_value_heads"):
        build_tiny_target(TinyTargetConfig(num_attention_heads=4, num_key_value_heads=3), progress=False)
    with pytest.raises(ValueError, match="max_seq_len"):
        TinyTargetConfig(max_seq_len=64).validate()
    with pytest.raises(ValueError, match="Unknown tiny-target preset"):
        TinyTargetConfig.preset("huge")
    for name in ("full", "quick", "test"):
        TinyTargetConfig.preset(name).validate()
    assert TinyTargetConfig.full().num_hidden_layers >= 6 and not TinyTargetConfig.full().tie_word_embeddings


def test_fp32_muon_takes_torch_muons_step():
    """The fp32 Newton-Schulz Muon used where bf16 is emulated makes torch.optim.Muon's update (up to the
    bf16 rounding of torch's iteration), for wide and tall matrices alike."""
    import torch

    from lilicorr_pl.demo.tiny_target import Fp32Muon

    torch.manual_seed(0)
    for shape in ((16, 40), (40, 16)):
        ours = torch.nn.Parameter(torch.randn(*shape))
        ref = torch.nn.Parameter(ours.detach().clone())
        start = ours.detach().clone()
        opt_ours = Fp32Muon([ours], lr=0.02)
        opt_ref = torch.optim.Muon([ref], lr=0.02, weight_decay=0.0, momentum=0.95, adjust_lr_fn="original")
        for _ in range(3):
            g = torch.randn(*shape)
            ours.grad, ref.grad = g.clone(), g.clone()
            opt_ours.step()
            opt_ref.step()
        moved = (ref.detach() - start).abs().max()
        assert moved > 0.01  # the optimiser really moved the weights
        assert torch.allclose(ours.detach(), ref.detach(), atol=2e-3)  # observed: 3.5e-4


def test_docstring_prefixes_end_after_a_function_docstring(built: tuple[Path, Path]) -> None:
    """cut="docstring": HumanEval's prompt shape (a def, its docstring, then the code is the continuation)."""
    import re

    from lilicorr_pl.decoding.benchmarks import load_prompts

    tokenizer = transformers.AutoTokenizer.from_pretrained(built[1])
    prefixes = corpus.code_prefixes(tokenizer, num=6, prefix_tokens=96, seed=3, split="train", cut="docstring")
    assert prefixes == corpus.code_prefixes(tokenizer, num=6, prefix_tokens=96, seed=3, split="train", cut="docstring")
    texts = list(corpus.read_corpus("train"))
    for prefix in prefixes:
        assert 48 <= len(tokenizer.encode(prefix, add_special_tokens=False)) <= 96
        # Each prefix is a run of whole lines of one file that ends where the parser says a docstring ends.
        text = next(t for t in texts if prefix in t)
        lines = corpus._SOURCE_LINE_RE.findall(text)
        ends = {"".join(lines[:end]) for end, _ in corpus._docstring_cuts(text)}
        assert any(end.endswith(prefix) for end in ends)
        assert re.search(r"^\s*(async\s+)?def\s", prefix, re.MULTILINE)  # the function's header is in it
    # The default cut is still the header one, and the benchmark name serves the docstring cut.
    headers = corpus.code_prefixes(tokenizer, num=3, prefix_tokens=48, seed=3, split="train")
    assert all(p.endswith(":\n") or "#" in p.splitlines()[-1] for p in headers)
    loaded = load_prompts("stdlib-train-docstring", tokenizer, 3, prefix_tokens=96, seed=5)
    assert loaded.texts == corpus.code_prefixes(tokenizer, 3, 96, seed=5 + 7919, split="train", cut="docstring")
    with pytest.raises(ValueError, match="Unknown prefix cut 'body'"):
        corpus.code_prefixes(tokenizer, 1, 48, cut="body")  # type: ignore[arg-type]


def test_docstring_cuts_come_from_the_parser_not_from_quote_guessing() -> None:
    source = (
        "import os\n\n"
        "@decorator\n"
        "def spread(a,\n"
        "           b):\n"
        '    """Quotes \'\'\' inside, and\n'
        '    a second line."""\n'
        "    return a\n\n"
        "def bare():\n"
        "    return 1\n\n"
        "def stub():\n"
        '    """Only a docstring: what follows is another function, not its code."""\n\n'
        'def one_line(): "on the header\'s line"; return 2\n\n'
        "class C:\n"
        "    async def method(self):  # comment\n"
        "        \'\'\'One line with \"\"\" in it.\'\'\'\n"
        "        def inner():\n"
        "            'a plain string'\n"
        "            pass\n"
    )
    lines = corpus._SOURCE_LINE_RE.findall(source)
    cuts = corpus._docstring_cuts(source)
    assert [(lines[header].strip(), lines[end - 1].strip()) for end, header in cuts] == [
        ("def spread(a,", 'a second line."""'),  # a header over two lines; a docstring quoting the other quotes
        ("async def method(self):  # comment", "\'\'\'One line with \"\"\" in it.\'\'\'"),
        ("def inner():", "'a plain string'"),
    ]  # bare() has no docstring, stub() no code after it, one_line()'s shares the header's line
    assert corpus._docstring_cuts("def broken(:\n") == []  # a file that does not parse has no cuts
    # Line numbers are the parser's: a form feed is no line break to it, so it is none here either.
    assert corpus._SOURCE_LINE_RE.findall("a\fb\nc\r\nd\re") == ["a\fb\n", "c\r\n", "d\r", "e"]


def test_a_rebuild_never_replaces_a_folder_holding_files_no_build_wrote(
    built: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rebuild (forced, or of a damaged build) replaced the folder whole: a user's notes in it were deleted."""
    assert set(load_build_report(built[1])["files"]) | {tiny_target.REPORT_NAME} == tiny_target.BUILD_FILES
    directory = tmp_path / built[1].name
    shutil.copytree(built[1], directory)
    (directory / "NOTES.md").write_text("my notes")

    def must_not_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("built before refusing")

    monkeypatch.setattr(tiny_target, "_build_into", must_not_build)
    assert build_tiny_target("test", cache_dir=tmp_path, progress=False) == directory  # valid: reused, notes and all
    for damage in (None, "config.json", tiny_target.REPORT_NAME):
        if damage:
            (directory / damage).write_text("{edited")
        with pytest.raises(ValueError, match=r"holds NOTES.md, which no build wrote, and a rebuild \((rebuild forced|"
                                             r".*)\) replaces that folder; move those out of it, then rerun"):
            build_tiny_target("test", cache_dir=tmp_path, progress=False, force=damage is None)
        assert (directory / "NOTES.md").read_text() == "my notes"


def test_a_cache_folder_that_is_a_file_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from lilicorr_pl.builtin import resolve_data_file

    afile = tmp_path / "afile"
    afile.write_text("mine")
    with pytest.raises(ValueError, match=rf"--cache_dir {afile}: {afile} is a file, so the directory cannot be "
                                         "created; choose another path"):
        build_tiny_target("test", cache_dir=afile, progress=True)
    assert "building" not in capsys.readouterr().err  # announced only where it can be built
    monkeypatch.setenv("LILICORR_CACHE", str(afile))
    with pytest.raises(ValueError, match=rf"the cache folder \(LILICORR_CACHE\) {afile / 'data'}: {afile} is a file"):
        resolve_data_file("builtin:stdlib-train:4")
    assert afile.read_text() == "mine"


def _copy_build(build: Path):
    """A stand-in for ``_build_into`` that copies a finished build instead of training one (same fingerprint)."""

    def copy_into(directory: Path, *args: object, **kwargs: object) -> dict:
        for path in build.iterdir():
            shutil.copy2(path, directory / path.name)
        return load_build_report(directory)

    return copy_into


def _snapshot(directory: Path) -> dict[str, tuple[int, bytes]]:
    return {path.name: (path.stat().st_ino, path.read_bytes()) for path in directory.iterdir()}


@pytest.mark.parametrize("force", [False, True])
def test_a_build_finishing_second_keeps_the_valid_build_that_finished_first(
    built: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, force: bool
) -> None:
    """Two builds of one target started together both saw it missing (or, forced, both replaced the same old one);
    the one finishing second renamed the first one's valid folder aside and deleted it, under whoever used it."""
    final = tmp_path / built[1].name
    if force:
        shutil.copytree(built[1], final)
    copy_into = _copy_build(built[1])

    def another_build_publishes_meanwhile(directory: Path, *args: object, **kwargs: object) -> dict:
        shutil.copytree(built[1], tmp_path / "other")
        if final.exists():  # (forced) the other build replaced the folder both saw at the start
            final.rename(tmp_path / "old")
        (tmp_path / "other").rename(final)
        shutil.rmtree(tmp_path / "old", ignore_errors=True)
        published.update(_snapshot(final), inode=(final.stat().st_ino, b""))
        return copy_into(directory)

    published: dict[str, tuple[int, bytes]] = {}
    monkeypatch.setattr(tiny_target, "_build_into", another_build_publishes_meanwhile)
    assert build_tiny_target("test", cache_dir=tmp_path, progress=False, force=force) == final
    assert {**_snapshot(final), "inode": (final.stat().st_ino, b"")} == published  # the very same folder and files
    assert [p.name for p in tmp_path.iterdir()] == [final.name]  # this build's temporary is gone, nothing else


def test_a_valid_build_published_between_the_last_check_and_the_rename_is_put_back(
    built: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The re-check before publishing found the path empty (or invalid); another build published a valid folder just
    after it: renamed aside as the old build, it was deleted under whoever used it."""
    final = tmp_path / built[1].name
    monkeypatch.setattr(tiny_target, "_build_into", _copy_build(built[1]))
    real_problem = tiny_target._cache_problem
    checks = []

    def another_build_publishes_after_the_last_check(path: Path, fingerprint: str) -> str | None:
        problem = real_problem(path, fingerprint)
        checks.append(problem)
        if len(checks) == 2:  # the re-check just before publishing: another build publishes right after it
            shutil.copytree(built[1], tmp_path / "other")
            (tmp_path / "other").rename(final)
            published.update(_snapshot(final), inode=(final.stat().st_ino, b""))
        return problem

    published: dict[str, tuple[int, bytes]] = {}
    monkeypatch.setattr(tiny_target, "_cache_problem", another_build_publishes_after_the_last_check)
    assert build_tiny_target("test", cache_dir=tmp_path, progress=False) == final
    assert checks[:2] == ["not built yet", "not built yet"] and published
    assert {**_snapshot(final), "inode": (final.stat().st_ino, b"")} == published
    assert [p.name for p in tmp_path.iterdir()] == [final.name]


def test_a_forced_rebuild_removes_the_old_build_only_once_the_new_one_is_in_place(
    built: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old build was deleted before the new one was renamed in: for that long the path was missing, and another
    process checking then started a build of its own."""
    final = tmp_path / built[1].name
    shutil.copytree(built[1], final)
    old = _snapshot(final)
    monkeypatch.setattr(tiny_target, "_build_into", _copy_build(built[1]))
    fingerprint = load_build_report(built[1])["fingerprint"]
    real_rmtree = shutil.rmtree
    removed = []

    def rmtree(path: str | os.PathLike, *args: object, **kwargs: object) -> None:
        if Path(path).exists() and Path(path).name != final.name:
            removed.append(Path(path).name)
            assert tiny_target._cache_problem(final, fingerprint) is None, "removed the old build before the new was in"
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    assert build_tiny_target("test", cache_dir=tmp_path, progress=False, force=True) == final
    assert removed and tiny_target._cache_problem(final, fingerprint) is None
    assert {name: ino for name, (ino, _) in _snapshot(final).items()}.keys() == old.keys()
    assert all(_snapshot(final)[name][0] != ino for name, (ino, _) in old.items())  # the new build replaced the old
    assert [p.name for p in tmp_path.iterdir()] == [final.name]


@pytest.mark.parametrize("kind", ["file", "link"])
def test_a_file_or_link_at_the_builds_path_is_refused_and_left_alone(
    built: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A file at the build's path was renamed aside as the old build, to a temporary's name that a later build's
    clean-up deleted: ``build-target`` then ``build-target --force`` lost the user's file."""
    final = tmp_path / "cache" / built[1].name
    final.parent.mkdir()
    elsewhere = tmp_path / "mine"
    if kind == "file":
        final.write_text("user data")
    else:  # a link to a valid build is that build (used as it is); a link to anything else is not replaced
        shutil.copytree(built[1], elsewhere)
        final.symlink_to(elsewhere, target_is_directory=True)
        assert build_tiny_target("test", cache_dir=final.parent, progress=False) == final
        (elsewhere / "build_report.json").unlink()

    def must_not_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("built before refusing")

    monkeypatch.setattr(tiny_target, "_build_into", must_not_build)
    refused = (rf"^{final} is a file, which no build wrote, and a build writes its folder at that path; move it "
               r"away, then rerun$" if kind == "file" else
               rf"^{final} is a symbolic link \(to {elsewhere}\), and a rebuild \(.*\) would replace it with a "
               r"folder; move it away, then rerun$")
    for force in (False, True):
        with pytest.raises(ValueError, match=refused):
            build_tiny_target("test", cache_dir=final.parent, progress=False, force=force)
        assert [p.name for p in final.parent.iterdir()] == [final.name]
        if kind == "file":
            assert final.read_text() == "user data"
        else:
            assert final.is_symlink() and os.readlink(final) == str(elsewhere)
            assert sorted(p.name for p in elsewhere.iterdir()) == sorted(
                p.name for p in built[1].iterdir() if p.name != "build_report.json")
