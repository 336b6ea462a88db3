"""Shared fixtures: tiny random Qwen3 targets saved with ``save_pretrained`` and loaded back through
the real ``from_pretrained`` path (no hub, no downloads)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Built targets, built-in data files and file-digest memos go to a cache of this session's own (subprocesses inherit
# it), never to the user's ($LILICORR_CACHE or ~/.cache/lilicorr_pl): a test run leaves nothing there. Building the
# test-size target into it costs about two seconds once per session.
USER_CACHE = os.environ.get("LILICORR_CACHE")
SESSION_CACHE = tempfile.mkdtemp(prefix="lilicorr-test-cache-")
os.environ["LILICORR_CACHE"] = SESSION_CACHE

import lightning.pytorch  # noqa: F401 - its log handler binds to the session's stderr, not to one test's capsys
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from lilicorr_pl.cli import main as cli_main
from lilicorr_pl.target import FrozenTarget

# Tiny models: one thread is ~100x faster than two on a loaded 2-core machine (no contention).
torch.set_num_threads(1)


def pytest_unconfigure(config) -> None:
    shutil.rmtree(SESSION_CACHE, ignore_errors=True)
    if USER_CACHE is None:
        os.environ.pop("LILICORR_CACHE", None)
    else:
        os.environ["LILICORR_CACHE"] = USER_CACHE


def tiny_qwen3_config(tie: bool = True, layers: int = 6, vocab: int = 96, hidden: int = 32) -> Qwen3Config:
    """A tiny GQA Qwen3 config (4 query heads, 2 KV heads) with a padded row for MASK."""
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
        mask_token_id=vocab - 1,
        eos_token_id=1,
        bos_token_id=0,
        pad_token_id=0,
    )


def save_tiny_target(path, tie: bool = True, seed: int = 0, **kw) -> str:
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(tiny_qwen3_config(tie=tie, **kw))
    # Random init with std 0.02 gives near-uniform logits; widen it so greedy paths are distinct.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(params=[True, False], ids=["tied", "untied"])
def tiny_target(request, tmp_path) -> FrozenTarget:
    path = save_tiny_target(tmp_path / "target", tie=request.param)
    return FrozenTarget.from_pretrained(path, load_tokenizer=False, num_features=3)


ROOT = Path(__file__).resolve().parents[1]


def user_error(capsys, argv: list[str]) -> str:
    """Run ``lilicorr argv`` expecting a user error: exit status 2, no traceback; returns stderr.

    A value refused when parsed gets the usage's first line, a tip and one ``error:`` line, the last; a refusal after
    parsing is the single line ``lilicorr <subcommand>: error: ...``.
    """
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli_main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("lilicorr")]
    if lines:  # refused after parsing: exactly one line, and it names the subcommand
        assert len(lines) == 1 and lines[0].startswith(f"lilicorr {argv[0]}: error: "), err
    parsed = [line for line in err.splitlines() if line.startswith("error: ")]
    if parsed:  # refused when parsed: one line, the last, not jsonargparse's account of the types it tried
        assert len(parsed) == 1 and err.endswith(parsed[0] + "\n"), err
        for internal in ("<class", "Namespace(", "NestedArg(", "Got value", "Given value", "Subtypes"):
            assert internal not in err, err
        assert not parsed[0].endswith(": refused"), err
    return err


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """Two steps of configs/tiny.yaml with every output under a temp root (trainer.default_root_dir; no chdir)."""
    root = tmp_path_factory.mktemp("tiny") / "runs" / "tiny"
    cli = cli_main([
        "fit", "-c", str(ROOT / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={root}", "--trainer.max_steps=2",
        "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
    ])
    ckpt = root / "checkpoints" / "last.ckpt"
    assert ckpt.is_file() and (root / "cache").is_dir() and (root / "config.yaml").is_file()
    return cli, ckpt
