"""Data formats, loss masks, clear errors, and the data module end to end on a tiny real target."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from conftest import user_error
from helpers import make_tiny_target_dir
from transformers import AutoTokenizer

from lilicorr_pl.data import CacheError, cached_candidate_logits, formats
from lilicorr_pl.checkpoint import UserInputError
from lilicorr_pl.data.datamodule import DraftDataModule, copy_groups
from lilicorr_pl.data.precompute import precompute_throughput
from lilicorr_pl.data.sampling import epoch_order, train_sampler
from lilicorr_pl.data.formats import DataFormatError, load_examples, pack_examples, tokenize_chat
from lilicorr_pl.target import FrozenTarget, TargetSpec

@pytest.fixture(autouse=True)
def _single_torch_thread():
    """Tiny models run far faster on one thread (and do not fight other processes for the cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Two plus two is four."},
    {"role": "user", "content": "And the capital of France?"},
    {"role": "assistant", "content": "<think>\nrecall it\n</think>\n\nThe capital of France is Paris."},
]


def write_jsonl(path: Path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def masked_runs(tokenizer, ids, mask) -> list[str]:
    """Decoded text of each maximal run of supervised tokens."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tokenizer.decode(cur))
            cur = []
    if cur:
        runs.append(tokenizer.decode(cur))
    return runs


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> str:
    return make_tiny_target_dir(tmp_path_factory.mktemp("data_target"))


@pytest.fixture(scope="module")
def tok(target_dir):
    return AutoTokenizer.from_pretrained(target_dir)


# ---------------------------------------------------------------------- formats and masks
def test_helper_target_has_padded_vocab_mask_row_and_chat_template(target_dir, tok):
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    assert cfg["vocab_size"] % 64 == 0 and cfg["vocab_size"] > len(tok)
    assert cfg["mask_token_id"] == len(tok) < cfg["vocab_size"]
    assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2
    assert tok.eos_token == "<|endoftext|>" and tok.chat_template
    prompt = tok.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    prompt = tok.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_each_format_parses_with_its_loss_mask(tmp_path, tok):
    text = "The quick brown fox jumps over the lazy dog."
    path = write_jsonl(
        tmp_path / "mix.jsonl",
        [
            {"text": text, "id": "extra keys are ignored"},
            {"prompt": "def add(a, b):\n", "completion": "    return a + b\n"},
            {"messages": CHAT[:3]},
            {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hello!"}, {"from": "gpt", "value": "I am fine."}]},
        ],
    )
    stats = formats.LoadStats()
    ex = load_examples([path], tok, max_length=512, stats=stats)
    assert stats.formats == {"text": 1, "prompt_completion": 1, "messages": 1, "sharegpt": 1}
    assert [e.source for e in ex] == ["mix.jsonl:1", "mix.jsonl:2", "mix.jsonl:3", "mix.jsonl:4"]
    # text: every token, exactly the tokenizer's ids
    assert ex[0].input_ids == tok(text)["input_ids"] and all(ex[0].loss_mask)
    # prompt/completion: completion only
    assert tok.decode(ex[1].input_ids) == "def add(a, b):\n    return a + b\n"
    assert masked_runs(tok, ex[1].input_ids, ex[1].loss_mask) == ["    return a + b\n"]
    # chat formats: assistant content + end of turn only; ShareGPT speakers mapped
    assert masked_runs(tok, ex[2].input_ids, ex[2].loss_mask) == ["Two plus two is four.<|im_end|>"]
    assert masked_runs(tok, ex[3].input_ids, ex[3].loss_mask) == ["I am fine.<|im_end|>"]
    assert tok.decode(ex[3].input_ids).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello!")


def test_chat_mask_covers_exactly_each_assistant_turn(tok):
    ids, mask = tokenize_chat(tok, CHAT)
    rendered = tok.apply_chat_template(CHAT, tokenize=False)
    assert tok.decode(ids) == rendered
    # Qwen-style templates render old turns without their reasoning and the last one with it; the mask
    # follows what the template actually wrote, never its scaffolding (headers, empty think blocks).
    assert masked_runs(tok, ids, mask) == [
        "Two plus two is four.<|im_end|>",
        "recall it\n</think>\n\nThe capital of France is Paris.<|im_end|>",
    ]
    single, single_mask = tokenize_chat(tok, CHAT[:3])
    assert "<think>\n\n</think>\n\n" in tok.decode(single)  # the empty think block is present ...
    assert masked_runs(tok, single, single_mask) == ["Two plus two is four.<|im_end|>"]  # ... and unsupervised
    # Nothing of the user/system side is ever supervised.
    unsupervised = tok.decode([i for i, m in zip(ids, mask) if not m])
    for m in CHAT:
        if m["role"] != "assistant":
            assert m["content"] in unsupervised


def test_content_starting_like_the_template_is_masked_exactly(tok):
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<|im_end|> is how a turn ends\n"}]
    ids, mask = tokenize_chat(tok, chat)
    assert masked_runs(tok, ids, mask) == ["<|im_end|> is how a turn ends\n<|im_end|>"]


def random_chat(rng, bits: list[str], max_pairs: int) -> list[dict[str, str]]:
    """A conversation of 1..``max_pairs`` user/assistant turn pairs (a system turn half the time), each turn's content
    0-2 (user) or 0-3 (assistant) of ``bits``, drawn from ``rng``."""
    messages = [{"role": "system", "content": "Be brief."}] if rng.random() < 0.5 else []
    for _ in range(rng.randrange(1, max_pairs + 1)):
        messages.append({"role": "user", "content": "".join(rng.choice(bits) for _ in range(rng.randrange(0, 3)))})
        messages.append({"role": "assistant", "content": "".join(rng.choice(bits) for _ in range(rng.randrange(0, 4)))})
    return messages


GLM_LIKE = ("{% for m in messages %}{% if m.role == 'assistant' %}<|assistant|>{% set c = m.content %}"
            "{% if '</think>' in c %}\n<think>{{ c.split('</think>')[0].split('<think>')[-1] }}</think>"
            "{% set c = c.split('</think>')[-1] %}{% else %}\n<think></think>{% endif %}"
            "{% if c.strip() %}{{ '\\n' + c.strip() }}{% endif %}{% else %}<|{{ m.role }}|>\n{{ m.content }}{% endif %}"
            "{% endfor %}")  # GLM-4.5's shape: a "\n" before an answer only where the answer is not empty


@pytest.mark.parametrize("template", ["qwen", "chatml", "trimmed", "glm"])
def test_the_one_rendering_with_markers_finds_the_spans_two_renderings_per_turn_find(tok, template):
    """Masking rendered the whole conversation twice per assistant turn (quadratic in the turns). One rendering with
    every turn a marker now decides the spans where it can: on random conversations, with content that looks like the
    template's scaffolding, reasoning, empty turns and repeats, it finds what the placeholders find, or leaves them to
    find it."""
    import random

    from lilicorr_pl.data.formats import _spans_from_markers, _spans_from_placeholders, render_chat

    chat_template = {
        "qwen": None,  # the tokenizer's own, modelled on Qwen3's (the last turn's think block)
        "chatml": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
        "trimmed": "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}"
                   "<|eot_id|>{% endfor %}",
        "glm": GLM_LIKE,
    }[template]
    bits = ["Paris.", "four", "\n", " ", "<|im_end|>\n<|im_start|>user\n", "<|im_start|>assistant\n", "<think>\n",
            "\n</think>\n\n", "\u2603", "<|eot_id|>", "assistant", "user\n", "x" * 5]
    rng = random.Random(0)
    decided = 0
    for _ in range(150):
        messages = random_chat(rng, bits, max_pairs=5)
        if rng.random() < 0.3:
            messages.pop()  # ends on a user turn
        kwargs = {"enable_thinking": False, "chat_template": chat_template}
        rendered = render_chat(tok, messages, **kwargs)
        fast = _spans_from_markers(tok, messages, rendered, **kwargs)
        if fast is not None:
            decided += 1
            assert fast == _spans_from_placeholders(tok, messages, rendered, **kwargs), messages
    assert decided >= 30  # a good share of them by one rendering (75 or more but for GLM's, 40): not vacuous


# The masks a FORMAT_VERSION stands for: a digest of what the chat masks supervise on seeded random conversations.
MASKS_OF_FORMAT_VERSION = {4: "81bdc35390be549d830e1edb6524758fab62523a1068d516a006f5a15a0431fc"}


def test_the_masks_change_only_with_the_format_version(tok):
    """Token stores are keyed by FORMAT_VERSION, not by the masking code: cd4243d changed what some templates' turns
    supervise and left it at 3, so a store built at 1e2c796 was reused with its old masks. The masks of seeded
    conversations on four templates are pinned to the version (as decoded text, not token ids: the test tokenizer's
    merges are its own)."""
    import hashlib
    import random

    from lilicorr_pl.data.formats import FORMAT_VERSION

    bits = ["Paris.", "four", "\n", " ", "<|im_end|>\n<|im_start|>user\n", "<|im_start|>assistant\n", "<think>\n",
            "\n</think>\n\n", "x" * 5, "<think>a</think>b"]
    templates = [None, "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
                 "{% for m in messages|reverse %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
                 GLM_LIKE]
    rng = random.Random(4)
    digest = hashlib.sha256()
    for _ in range(40):
        messages = random_chat(rng, bits, max_pairs=3)
        for template in templates:
            ids, mask = tokenize_chat(tok, messages, chat_template=template)
            digest.update(json.dumps([tok.decode(ids), masked_runs(tok, ids, mask)]).encode())
    assert FORMAT_VERSION in MASKS_OF_FORMAT_VERSION, f"record the masks of FORMAT_VERSION {FORMAT_VERSION} here"
    assert digest.hexdigest() == MASKS_OF_FORMAT_VERSION[FORMAT_VERSION], (
        f"the masks changed (now {digest.hexdigest()}): raise FORMAT_VERSION, or stores tokenized with the old masks "
        "are reused, and record the new digest here")


def test_a_turn_is_masked_alike_whichever_way_its_conversation_is_masked(tok):
    """With an empty placeholder, a template writing a "\\n" only before an answer that is not empty (GLM-4.5's)
    had it supervised by the two renderings per turn and not by the markers: the same answer "4" masked two ways, by
    whether the conversation's last turn held reasoning (which takes the two renderings per turn)."""
    plain = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
             {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6"}]
    reasoning = plain[:3] + [{"role": "assistant", "content": "<think>3+3=6</think>6"}]
    runs = [masked_runs(tok, *tokenize_chat(tok, chat, chat_template=GLM_LIKE)) for chat in (plain, reasoning)]
    assert runs == [["4", "6"], ["4", "3+3=6</think>\n6"]]


def test_a_template_writing_the_turns_in_another_order_has_every_turn_masked(tok):
    """The spans came in the messages' order, and the mask walks the rendering once: a template writing the turns
    newest first had every turn but the first written dropped from the mask."""
    newest_first = "{% for m in messages|reverse %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "x"}, {"role": "assistant", "content": "zz"}]
    ids, mask = tokenize_chat(tok, chat, chat_template=newest_first)
    assert masked_runs(tok, ids, mask) == ["zz<|im_end|>", "yo<|im_end|>"]


def test_a_long_conversation_is_masked_with_two_renderings_not_two_per_turn(tok, monkeypatch):
    """A 32-turn conversation took 65 renderings to mask (one, then two per assistant turn); now two, with the same
    mask; a last turn with reasoning (Qwen's think block is written from it) takes the two per turn, as before."""
    import lilicorr_pl.data.formats as formats

    chat = [m for n in range(32) for m in ({"role": "user", "content": f"question {n}"},
                                          {"role": "assistant", "content": f"answer {n}."})]
    calls = []
    real = formats.render_chat
    monkeypatch.setattr(formats, "render_chat", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids, mask = tokenize_chat(tok, chat)
    assert len(calls) == 2
    assert masked_runs(tok, ids, mask) == [f"answer {n}.<|im_end|>" for n in range(32)]
    calls.clear()
    reasoning = chat[:-1] + [{"role": "assistant", "content": "<think>\nrecall it\n</think>\n\nanswer 31."}]
    ids, mask = tokenize_chat(tok, reasoning)
    assert len(calls) == 2 + 2 * 32
    assert masked_runs(tok, ids, mask)[-1] == "recall it\n</think>\n\nanswer 31.<|im_end|>"


def test_content_beginning_like_the_scaffolding_after_it_supervises_none_of_the_next_turn(tok):
    """A turn whose content begins like the scaffolding after it: the empty placeholder's common prefix ran into the
    content, bounded its common suffix short, and the span ran on over the next user turn's header (masked by the two
    renderings per turn, which the last turn's reasoning makes the way here)."""
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<|im_end|>\n<|im_start|>user\n"},
            {"role": "user", "content": "more"}, {"role": "assistant", "content": "<think>\nr\n</think>\n\nok"}]
    ids, mask = tokenize_chat(tok, chat)
    assert masked_runs(tok, ids, mask) == ["<|im_end|>\n<|im_start|>user\n<|im_end|>", "r\n</think>\n\nok<|im_end|>"]


def test_the_masks_common_prefix_and_suffix_agree_with_a_character_walk():
    """The assistant mask's diffs compare strings by halving (a character at a time took most of a long
    conversation's mask): checked against the character walk on random strings, near-equal ones and limits."""
    import random

    from lilicorr_pl.data.formats import _common_prefix, _common_suffix

    def walk_prefix(a, b):
        i = 0
        while i < min(len(a), len(b)) and a[i] == b[i]:
            i += 1
        return i

    def walk_suffix(a, b, limit):
        i = 0
        while i < min(len(a), len(b), limit) and a[-1 - i] == b[-1 - i]:
            i += 1
        return i

    rng = random.Random(0)
    for _ in range(3000):
        base = "".join(rng.choice("ab\u2603<|>\n") for _ in range(rng.randrange(0, 60)))
        other = list(base)
        for _ in range(rng.randrange(0, 3)):  # a few edits: replace, insert or delete a character
            at, op = rng.randrange(0, len(other) + 1), rng.randrange(3)
            if op == 0 and at < len(other):
                other[at] = rng.choice("ab\u2603")
            elif op == 1:
                other.insert(at, rng.choice("ab\u2603"))
            elif at < len(other):
                del other[at]
        a, b = (base, "".join(other)) if rng.random() < 0.5 else ("".join(other), base)
        assert _common_prefix(a, b) == walk_prefix(a, b), (a, b)
        for limit in (0, 1, rng.randrange(0, 70), 10**6):
            assert _common_suffix(a, b, limit) == walk_suffix(a, b, limit), (a, b, limit)
    assert _common_suffix("abc", "abc", -3) == 0  # a limit below zero, as a rendering shorter than its prefix gives


def test_thinking_flag_reaches_the_template(tmp_path, tok):
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if enable_thinking %}[thinking on]{% else %}[thinking off]{% endif %}"
    )
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT[:3]}])
    on = load_examples([path], tok, chat_template=template, enable_thinking=True)[0]
    off = load_examples([path], tok, chat_template=template, enable_thinking=False)[0]
    assert tok.decode(on.input_ids).endswith("[thinking on]")
    assert tok.decode(off.input_ids).endswith("[thinking off]")
    # A template given as a file works the same way.
    tpl_file = tmp_path / "t.jinja"
    tpl_file.write_text(template)
    again = load_examples([path], tok, chat_template=str(tpl_file), enable_thinking=True)[0]
    assert again.input_ids == on.input_ids
    # Regenerated with thinking on (the record says so) and trained with it off: the answers would be rendered unlike
    # the target wrote them, silently. Refused, naming the record and the setting; the matching setting reads it.
    regenerated = write_jsonl(tmp_path / "r.jsonl", [{"messages": CHAT[:3], "generation": {"enable_thinking": True}}])
    with pytest.raises(DataFormatError, match=r"r.jsonl line 1: regenerated with enable_thinking true \(its "
                                              r"\"generation\" entry\), but data.enable_thinking is false.*set "
                                              r"data.enable_thinking: true"):
        load_examples([regenerated], tok, chat_template=template, enable_thinking=False)
    assert load_examples([regenerated], tok, chat_template=template, enable_thinking=True)[0].input_ids == on.input_ids
    # Regenerated with one chat template and trained with another: the same, by the template's recorded digest.
    digest = hashlib.sha256(template.encode()).hexdigest()
    written = write_jsonl(tmp_path / "w.jsonl", [{"messages": CHAT[:3], "generation": {
        "enable_thinking": True, "chat_template_sha256": digest}}])
    other = template.replace("[thinking on]", "[on]")
    with pytest.raises(DataFormatError, match=r"w.jsonl line 1: regenerated with another chat template \(its "
                                              rf"\"generation\" entry's chat_template_sha256 {digest[:12]}\.\.\., "
                                              r"this run's [0-9a-f]{12}\.\.\.\).*set data.chat_template"):
        load_examples([written], tok, chat_template=other, enable_thinking=True)
    assert load_examples([written], tok, chat_template=str(tpl_file), enable_thinking=True)[0].input_ids == on.input_ids


def test_truncation_and_packing_preserve_masks(tmp_path, tok):
    recs = [{"prompt": "Question: " + "very " * i + "long?", "completion": f" It is {2 * i}."} for i in range(6)]
    path = write_jsonl(tmp_path / "pc.jsonl", recs)
    full = load_examples([path], tok, max_length=4096)
    prompt_lens = [e.loss_mask.index(True) for e in full]
    assert prompt_lens == sorted(prompt_lens) and prompt_lens[0] < prompt_lens[-1]
    cut_len = prompt_lens[-1] + 2
    stats = formats.LoadStats()
    cut = load_examples([path], tok, max_length=cut_len, stats=stats)
    assert len(cut) == len(recs) and stats.truncated == sum(len(e) > cut_len for e in full) > 0
    for a, b in zip(full, cut):
        assert b.input_ids == a.input_ids[:cut_len] and b.loss_mask == a.loss_mask[:cut_len]
    # Records whose supervised part falls entirely past max_length are dropped (and counted).
    stats = formats.LoadStats()
    some = load_examples([path], tok, max_length=prompt_lens[-1], stats=stats)
    kept = sum(p < prompt_lens[-1] for p in prompt_lens)
    assert len(some) == kept < len(recs) and stats.dropped_unsupervised == len(recs) - kept

    max_len = 40
    packed = pack_examples(full, max_len)
    assert len(packed) < len(full) and all(len(p) <= max_len for p in packed)
    assert [t for p in packed for t in p.input_ids] == [t for e in full for t in e.input_ids]
    # Masks kept, except the first token of every packed example after the first in its sequence.
    expected = []
    for p in packed:
        first = True
        for src in p.source.split("+"):
            e = full[int(src.split(":")[1]) - 1]
            expected += ([e.loss_mask[0] if first else False] + e.loss_mask[1:])
            first = False
    assert [m for p in packed for m in p.loss_mask] == expected
    assert load_examples([path], tok, max_length=max_len, pack=True) == packed


# ---------------------------------------------------------------------- errors
def test_missing_file_names_the_file_and_setting(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl.*does not exist.*data\.val_files"):
        load_examples([str(tmp_path / "nope.jsonl")], tok, setting="data.val_files")
    bad = tmp_path / "data.csv"
    bad.write_text("a,b\n")
    with pytest.raises(DataFormatError, match=r"data\.csv.*\.csv.*\.jsonl"):
        load_examples([str(bad)], tok)


def test_malformed_jsonl_names_file_and_line(tmp_path, tok):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "fine"}\n\n{"text": "oops"\n')
    with pytest.raises(DataFormatError, match=r"broken\.jsonl line 3: malformed JSON"):
        load_examples([str(path)], tok)
    path.write_text('["a list"]\n')
    with pytest.raises(DataFormatError, match=r"broken\.jsonl line 1: expected a JSON object"):
        load_examples([str(path)], tok)
    path.write_bytes('{"text": "fine"}\n\n{"text": "caf'.encode() + b"\xe9" + b'"}\n')  # Latin-1, not UTF-8
    with pytest.raises(DataFormatError, match=r"broken\.jsonl line 3: not UTF-8 text \(byte 0xe9 at column 14\); "
                                              r"save the file as UTF-8"):  # it was a traceback
        load_examples([str(path)], tok)
    # Lines end at \n, \r\n or a lone \r, as a file read as text splits them; a raw U+2028 in a string is no end.
    from lilicorr_pl.data.formats import text_lines

    path.write_bytes(b'{"text": "a"}\r\r{"text": "b\xe2\x80\xa8c"}\r\n{"text": "d"}\n\r{oops\r')
    assert [(i, line.strip()) for i, line in text_lines(path)] == [
        (1, '{"text": "a"}'), (3, '{"text": "b\u2028c"}'), (4, '{"text": "d"}'), (6, "{oops")]
    with pytest.raises(DataFormatError, match=r"broken\.jsonl line 6: malformed JSON"):
        load_examples([str(path)], tok)
    # A UTF-8 byte order mark first (some Windows editors write one) is not part of line 1: it was "malformed JSON
    # (Unexpected UTF-8 BOM (decode using utf-8-sig))", a fix in Python's terms; regenerate reads the same lines.
    from lilicorr_pl.data.regenerate import _iter_input

    path.write_bytes(b'\xef\xbb\xbf{"text": "a"}\r\n{"text": "b"}\r{"text": "\xef\xbb\xbfc"}\n')
    assert [(i, line.strip()) for i, line in text_lines(path)] == [
        (1, '{"text": "a"}'), (2, '{"text": "b"}'), (3, '{"text": "\ufeffc"}')]  # inside a value: the value's own
    assert [ex.input_ids for ex in load_examples([str(path)], tok)] == [
        ex.input_ids for ex in load_examples([write_jsonl(tmp_path / "plain.jsonl", [
            {"text": "a"}, {"text": "b"}, {"text": "\ufeffc"}])], tok)]
    assert [(i, where, record) for i, where, record in _iter_input(path)] == [
        (0, "broken.jsonl line 1", {"text": "a"}), (1, "broken.jsonl line 2", {"text": "b"}),
        (2, "broken.jsonl line 3", {"text": "\ufeffc"})]


def test_empty_conversation_and_unknown_format(tmp_path, tok):
    path = write_jsonl(tmp_path / "e.jsonl", [{"text": "ok"}, {"messages": []}])
    with pytest.raises(DataFormatError, match=r"e\.jsonl line 2: empty conversation"):
        load_examples([path], tok)
    path = write_jsonl(tmp_path / "u.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(DataFormatError) as err:
        load_examples([path], tok)
    msg = str(err.value)
    assert "u.jsonl line 1" in msg and "['answer', 'question']" in msg
    for accepted in ('"text"', '"prompt"', '"messages"', '"conversations"'):
        assert accepted in msg
    path = write_jsonl(tmp_path / "s.jsonl", [{"conversations": [{"from": "robot", "value": "x"}]}])
    with pytest.raises(DataFormatError, match=r"speaker 'robot'.*\['assistant', 'gpt', 'human'"):
        load_examples([path], tok)


def test_chat_data_without_a_chat_template(tmp_path, tok):
    plain = AutoTokenizer.from_pretrained(tok.name_or_path)
    plain.chat_template = None
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT[:3]}])
    with pytest.raises(DataFormatError, match=r"c\.jsonl line 1: .*no chat template.*chat_template"):
        load_examples([path], plain)


def test_no_supervised_tokens_at_all(tmp_path, tok):
    path = write_jsonl(tmp_path / "n.jsonl", [{"messages": [{"role": "user", "content": "only a question"}]}, {"prompt": "p", "completion": ""}])
    with pytest.raises(DataFormatError, match=r"no supervised tokens in n\.jsonl \(2 records"):
        load_examples([path], tok)


def test_parquet_needs_pyarrow(tmp_path, tok):
    path = tmp_path / "d.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        path.write_bytes(b"PAR1")
        # A ValueError (a DataFormatError), which every command turns into its one-line error before any work:
        # an ImportError was a traceback from fit, prepare and regenerate.
        with pytest.raises(DataFormatError, match="pip install pyarrow"):
            load_examples([str(path)], tok)
        return
    pq.write_table(pa.Table.from_pylist([{"text": "hello there"}]), path)
    assert load_examples([str(path)], tok)[0].input_ids == tok("hello there")["input_ids"]


def test_datamodule_errors_come_before_any_model_work(tmp_path, target_dir, monkeypatch):
    def no_model(*a, **k):
        raise AssertionError("the target must not be loaded before the data is validated")

    monkeypatch.setattr(FrozenTarget, "from_spec", no_model)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n{nope\n')
    dm = DraftDataModule([str(bad)], target={"name_or_path": target_dir}, cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataFormatError, match=r"bad\.jsonl line 2"):
        dm.prepare_data()
    dm = DraftDataModule([str(tmp_path / "missing.jsonl")], target={"name_or_path": "/nonexistent/model"})
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl.*data\.train_files"):
        dm.prepare_data()
    with pytest.raises(ValueError, match="set data.target"):
        DraftDataModule([str(bad)]).prepare_data()
    with pytest.raises(ValueError, match="val_fraction"):
        DraftDataModule([str(bad)], val_fraction=1.5)
    assert not (tmp_path / "c").exists() or not any(p.name.startswith(("logits", "features")) for p in (tmp_path / "c").iterdir())


# ---------------------------------------------------------------------- the data module
@pytest.fixture(scope="module")
def train_file(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("dm_data")
    recs = []
    for i in range(10):
        recs.append({"messages": [{"role": "user", "content": f"What is {i} plus {i}?"}, {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]})
        recs.append({"text": f"Once upon a time there was a small model number {i}."})
    return write_jsonl(d / "train.jsonl", recs)


class CountingForward:
    """Counts FrozenTarget forward passes (monkeypatched onto the class)."""

    def __init__(self, monkeypatch, fail_on: int | None = None) -> None:
        self.calls = 0
        self.fail_on = fail_on
        original = FrozenTarget.forward

        def forward(target_self, *a, **k):
            self.calls += 1
            if self.fail_on is not None and self.calls == self.fail_on:
                raise RuntimeError("simulated crash mid-precompute")
            return original(target_self, *a, **k)

        monkeypatch.setattr(FrozenTarget, "forward", forward)


def make_dm(train_file, target_dir, cache_dir, **kw) -> DraftDataModule:
    args = dict(
        target=TargetSpec(target_dir, layer_ids=[1, 4]),
        cache_dir=str(cache_dir),
        batch_size=3,
        logit_top_m=8,
        precompute_batch_size=4,
        max_length=64,
        val_fraction=0.2,
        progress=False,
        shard_tokens=200,  # several shards
    )
    args.update(kw)
    return DraftDataModule([train_file], **args)


def _example_tokens(dataset) -> list[tuple[int, ...]]:
    return [tuple(dataset[k]["input_ids"].tolist()) for k in range(len(dataset))]


def test_the_validation_split_keeps_repeated_examples_on_one_side(tmp_path, train_file, target_dir):
    """A dataset with exact repeats (chat datasets have many) put copies on both sides of val_fraction's split, so
    val/* scored examples the drafter trained on. Each set of copies now sits on one side, with a warning; data
    without repeats split exactly as before (the seeded permutation's cut)."""
    dm = make_dm(train_file, target_dir, tmp_path / "plain", logit_cache=False)
    dm.prepare_data()
    dm.setup("fit")
    perm = np.random.default_rng(dm.seed).permutation(20)
    assert dm.val_dataset.indices.tolist() == sorted(perm[:4].tolist())  # unchanged where nothing repeats
    assert dm.train_dataset.indices.tolist() == sorted(perm[4:].tolist())
    assert "copies_kept_together" not in dm.train_dataloader().order  # earlier checkpoints resume exactly

    records = [json.loads(line) for line in Path(train_file).read_text().splitlines()]
    repeated = write_jsonl(tmp_path / "repeated.jsonl", records + records[:6] + records[:6])  # 6 records 3 times
    dm = make_dm(repeated, target_dir, tmp_path / "repeated", logit_cache=False, val_fraction=0.25)
    dm.prepare_data()
    with pytest.warns(UserWarning, match=r"data: 12 of the 32 training examples repeat another's tokens exactly; each "
                                         r"set of copies is kept on one side of the validation split \("):
        dm.setup("fit")
    train, val = _example_tokens(dm.train_dataset), _example_tokens(dm.val_dataset)
    assert len(train) + len(val) == 32 and val
    assert not set(train) & set(val)
    # the plain cut of this permutation puts copies on both sides, so the test reads the case it is for
    plain = set(np.random.default_rng(dm.seed).permutation(32)[:8].tolist())
    groups = copy_groups(dm.train_dataset.stores["tokens"])
    assert {int(groups[i]) for i in plain} & {int(groups[i]) for i in range(32) if i not in plain}
    # A checkpoint of the earlier rule (its loader state records no moved copies): said, and its position not taken
    loader = dm.train_dataloader()
    assert loader.order["copies_kept_together"] > 0
    earlier = {**loader.state_dict(), "order": {k: v for k, v in loader.order.items() if k != "copies_kept_together"}}
    earlier["loader"]["_num_yielded"] = 2
    with pytest.warns(UserWarning, match="the checkpoint's run split its validation examples off the training files "
                                         "before copies were kept on one side: this run's split moves"):
        dm.load_state_dict(earlier)
    assert loader.resumed_at_epoch is None
    # The way a resume takes it (Lightning sets the data up, loads the checkpoint's state, then asks for the loader):
    # the earlier rule's position is not taken, this rule's is.
    now = {**loader.state_dict(), "loader": {**loader.state_dict()["loader"], "_num_yielded": 2}}
    for state, taken in ((earlier, None), (now, 0)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dm.setup("fit")
            dm.load_state_dict(state)
            assert dm.train_dataloader().resumed_at_epoch == taken
        said = [str(w.message) for w in caught if "before copies were kept on one side" in str(w.message)]
        assert len(said) == (taken is None), said

    # Every example one copy: its set trains, or validates (nothing left to train on: refused in one line)
    same = write_jsonl(tmp_path / "same.jsonl", [records[1]] * 5)
    seeds = [s for s in range(50) if np.random.default_rng(s).permutation(5)[0] == 0]
    dm = make_dm(same, target_dir, tmp_path / "same", logit_cache=False, seed=seeds[0])
    dm.prepare_data()
    with pytest.raises(UserInputError, match="every one of the 5 training examples is a copy of one the validation "
                                             "split holds"):
        dm.setup("fit")
    dm = make_dm(same, target_dir, tmp_path / "same", logit_cache=False, seed=seeds[0] + 1)
    with pytest.warns(UserWarning, match="data: no validation split: each of the 1 examples val_fraction draws is a "
                                         "copy of an earlier example, which trains"):
        dm.setup("fit")
    assert dm.val_dataset is None and len(dm.train_dataset) == 5


_STORE_NUMBERS = itertools.count()  # copy_groups memoises by path: one per store


class _TokenStore:
    """A token store's reading side over in-memory examples (shards of ``per_shard``)."""

    def __init__(self, examples: list[list[int]], per_shard: int = 7) -> None:
        self.examples, self.path = examples, f"memory-{next(_STORE_NUMBERS)}"
        self.fingerprint, self.num_examples = "f", len(examples)
        self.shard_examples = [(a, min(a + per_shard, len(examples))) for a in range(0, len(examples), per_shard)]

    def get(self, shard: int, name: str) -> torch.Tensor:
        a, b = self.shard_examples[shard]
        part = self.examples[a:b]
        if name == "offsets":
            return torch.tensor([0, *np.cumsum([len(e) for e in part]).tolist()])
        return torch.tensor([t for e in part for t in e], dtype=torch.int32)


def test_copy_groups_finds_exact_repeats_across_shards_and_nothing_else():
    rng = np.random.default_rng(0)
    distinct = [rng.integers(0, 4000, size=int(rng.integers(1, 30))).tolist() for _ in range(40)]
    examples = [*distinct, distinct[3], [], distinct[3][:-1], distinct[39], [], distinct[3] + [7]]
    groups = copy_groups(_TokenStore(examples))
    assert groups.tolist() == [*range(40), 3, 41, 42, 39, 41, 45]  # a prefix or an extension is not a copy
    # empty examples opening a shard, a shard of nothing but them (shards of 7)
    examples = [*distinct[:7], [], [], [], [], [], [], [], [], *distinct[:3]]
    assert copy_groups(_TokenStore(examples)).tolist() == [*range(7), *[7] * 8, 0, 1, 2]


def test_a_large_set_of_copies_is_no_likelier_to_validate_than_one_example(tmp_path, train_file, target_dir):
    """Placed by its earliest copy in the permutation, a set of m copies validated with chance 1 - (1 - f)^m (30 copies
    at val_fraction 0.1: 96 %), draining the repeats out of training; placed by its first example, with chance f."""
    examples = [[i, i + 1, i + 2] for i in range(70)] + [[9, 9, 9]] * 30
    store = _TokenStore(examples)
    dm = make_dm(train_file, target_dir, tmp_path / "cache", val_fraction=0.1)
    validated = 0
    for seed in range(60):
        dm.seed = seed
        val, train, message, _ = dm._validation_split(store)
        assert not set(val) & set(train) and len(val) + len(train) == 100 and "29 of the 100" in message
        in_val = 70 in set(val.tolist())
        assert all((i in set(val.tolist())) == in_val for i in range(70, 100))  # the set on one side
        validated += in_val
    assert validated <= 15, validated  # about 6 of 60 expected; the earliest-copy rule gave about 58


def test_prepare_data_refuses_a_training_split_left_empty_by_copies_before_the_targets_pass(
        tmp_path, train_file, target_dir, monkeypatch):
    records = [json.loads(line) for line in Path(train_file).read_text().splitlines()]
    same = write_jsonl(tmp_path / "same.jsonl", [records[1]] * 5)
    seed = next(s for s in range(50) if np.random.default_rng(s).permutation(5)[0] == 0)
    dm = make_dm(same, target_dir, tmp_path / "cache", seed=seed)  # with the logit store: a pass of the target
    dm.trainer = SimpleNamespace(state=SimpleNamespace(fn="fit"), world_size=1)  # a one-process fit's
    forward = CountingForward(monkeypatch)
    with pytest.raises(UserInputError, match="every one of the 5 training examples is a copy"):
        dm.prepare_data()
    assert forward.calls == 0


def test_datamodule_batches_keys_shapes_and_logit_alignment(tmp_path, train_file, target_dir):
    dm = make_dm(train_file, target_dir, tmp_path / "cache", feature_cache=True)
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.train_dataset) == 16 and len(dm.val_dataset) == 4
    assert not set(dm.train_dataset.indices) & set(dm.val_dataset.indices)
    target = FrozenTarget.from_spec(dm.target)
    h = target.hidden_size
    seen = 0
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        for batch in loader:
            b, t = batch["input_ids"].shape
            expected = {
                "input_ids": ((b, t), torch.long),
                "attention_mask": ((b, t), torch.long),
                "loss_mask": ((b, t), torch.bool),
                "index": ((b,), torch.long),
                "topm_ids": ((b, t, 8), torch.long),
                "topm_logits": ((b, t, 8), torch.float32),
                "floor_logit": ((b, t), torch.float32),
                "true_logit": ((b, t), torch.float32),
                "logit_valid": ((b, t), torch.bool),
                "features": ((b, t, 2 * h), torch.bfloat16),
            }
            assert {k: (tuple(v.shape), v.dtype) for k, v in batch.items()} == expected
            pad = batch["attention_mask"] == 0
            assert torch.all(batch["input_ids"][pad] == dm.tokenizer.pad_token_id)
            assert not batch["loss_mask"][pad].any() and not batch["logit_valid"][pad].any()
            valid_expected = batch["loss_mask"].clone()
            valid_expected[:, 0] = False
            assert torch.equal(batch["logit_valid"], valid_expected)
            out = target(batch["input_ids"], attention_mask=batch["attention_mask"], return_logits=True)
            for r in range(b):
                for pos in batch["logit_valid"][r].nonzero()[:, 0].tolist():
                    row = out.logits[r, pos - 1]  # the distribution predicting token `pos`
                    x = batch["input_ids"][r, pos]
                    torch.testing.assert_close(batch["true_logit"][r, pos], row[x], atol=1e-4, rtol=1e-4)
                    torch.testing.assert_close(batch["topm_logits"][r, pos], row.topk(8).values, atol=2e-2, rtol=2e-3)
                    torch.testing.assert_close(row[batch["topm_ids"][r, pos]], batch["topm_logits"][r, pos], atol=2e-2, rtol=2e-3)
                    assert batch["floor_logit"][r, pos] == batch["topm_logits"][r, pos, -1]
                    seen += 1
                n = int(batch["attention_mask"][r].sum())
                torch.testing.assert_close(
                    batch["features"][r, :n].float(), out.features[r, :n], atol=1e-2, rtol=8e-3
                )
            # The cache plugs straight into the lookup used by the distractor penalty.
            cands = batch["topm_ids"][..., :3]
            approx = cached_candidate_logits(
                batch["topm_ids"], batch["topm_logits"], batch["floor_logit"], batch["input_ids"], batch["true_logit"], cands
            )
            assert approx.shape == (b, t, 3)
    assert seen > 50


def test_cache_reuse_new_fingerprints_and_interrupted_precompute(tmp_path, train_file, target_dir, monkeypatch):
    cache_dir = tmp_path / "cache"
    # 1. A crash mid-precompute leaves no logit cache under its real name (only the finished tokens cache) ...
    crash = CountingForward(monkeypatch, fail_on=4)
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_dm(train_file, target_dir, cache_dir).prepare_data()
    assert [p.name.split("-")[0] for p in cache_dir.iterdir() if not p.name.startswith(".")] == ["tokens"]
    assert crash.calls == 4
    # ... but keeps the shards it finished: the next run computes only the others' batches.
    tokens = make_dm(train_file, target_dir, cache_dir).precompute_job().splits[0].tokens
    batches = [math.ceil((b - a) / 4) for a, b in tokens.shard_examples]  # precompute_batch_size 4, per shard
    partial = next(cache_dir.glob(".logits-*.partial"))
    finished = [int(p.name[6:11]) for p in partial.glob("shard-*.safetensors")]
    assert len(batches) >= 3 and finished and sum(batches[s] for s in finished) < 4
    counter = CountingForward(monkeypatch)
    make_dm(train_file, target_dir, cache_dir).prepare_data()
    assert counter.calls == sum(batches) - sum(batches[s] for s in finished)
    first = sorted(p.name for p in cache_dir.iterdir())
    assert [n.split("-")[0] for n in first] == ["logits", "tokens"]
    # 3. Identical inputs reuse the cache: no forward pass, no model load, same directories.
    counter.calls = 0
    loads = []
    original = FrozenTarget.from_spec
    monkeypatch.setattr(FrozenTarget, "from_spec", lambda *a, **k: loads.append(1) or original(*a, **k))
    dm = make_dm(train_file, target_dir, cache_dir)
    dm.prepare_data()
    dm.setup("fit")
    assert counter.calls == 0 and loads == [] and sorted(p.name for p in cache_dir.iterdir()) == first
    # 4. Settings that do not change the content (batch size) reuse; those that do get a new dir.
    base = make_dm(train_file, target_dir, cache_dir).cache_paths()
    assert make_dm(train_file, target_dir, cache_dir, batch_size=7).cache_paths() == base
    thinking = make_dm(train_file, target_dir, cache_dir, enable_thinking=True).cache_paths()
    assert thinking["tokens"] != base["tokens"] and thinking["logits"] != base["logits"]
    assert make_dm(train_file, target_dir, cache_dir, logit_top_m=4).cache_paths()["logits"] != base["logits"]
    # A from_pretrained argument that changes the model (a config override) is another target's stores; one that
    # only says how the model is read is not.
    spec = dict(name_or_path=target_dir, layer_ids=[1, 4])
    roped = make_dm(train_file, target_dir, cache_dir, target=TargetSpec(
        **spec, load_kwargs={"rope_scaling": {"rope_type": "linear", "factor": 4.0}})).cache_paths()
    assert roped["logits"] != base["logits"] and roped["tokens"] == base["tokens"]
    assert make_dm(train_file, target_dir, cache_dir, target=TargetSpec(
        **spec, load_kwargs={"attn_implementation": "eager", "low_cpu_mem_usage": True})).cache_paths() == base
    other_target = make_tiny_target_dir(tmp_path, seed=3, name="other")
    moved = make_dm(train_file, other_target, cache_dir).cache_paths()
    assert moved["logits"] != base["logits"]
    changed = tmp_path / "changed.jsonl"
    changed.write_text(Path(train_file).read_text() + json.dumps({"text": "one more line"}) + "\n")
    assert make_dm(str(changed), target_dir, cache_dir).cache_paths()["tokens"] != base["tokens"]
    # 5. A corrupt cache is refused by prepare_data and setup, never silently used or rebuilt.
    shard = base["logits"] / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CacheError, match=r"shard-00001\.safetensors .*truncated.*delete"):
        make_dm(train_file, target_dir, cache_dir).prepare_data()
    with pytest.raises(CacheError, match=r"shard-00001\.safetensors"):
        make_dm(train_file, target_dir, cache_dir).setup("fit")
    assert counter.calls == 0


def test_logit_cache_can_be_switched_off(tmp_path, train_file, target_dir, monkeypatch):
    counter = CountingForward(monkeypatch)
    dm = make_dm(train_file, target_dir, tmp_path / "cache")
    dm.require_logit_cache(False)
    dm.prepare_data()
    dm.setup("fit")
    assert counter.calls == 0
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "loss_mask", "index"}
    dm.require_logit_cache(True)
    with pytest.raises(CacheError, match="call prepare_data"):
        dm.setup("fit")


def test_val_files_and_no_validation(tmp_path, train_file, target_dir):
    val = write_jsonl(tmp_path / "val.jsonl", [{"text": "a held out sentence."}, {"text": "and another."}])
    dm = make_dm(train_file, target_dir, tmp_path / "cache", val_files=[val], logit_cache=False)
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.train_dataset) == 20 and len(dm.val_dataset) == 2
    dm = make_dm(train_file, target_dir, tmp_path / "cache", val_fraction=0.0, logit_cache=False)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.val_dataset is None and dm.val_dataloader() == []


def test_training_order_is_seeded_per_epoch():
    s = train_sampler(10, seed=3)
    e0 = list(s)
    s.set_epoch(1)
    e1 = list(s)
    assert sorted(e0) == sorted(e1) == list(range(10)) and e0 != e1
    assert epoch_order(10, 3, 1) == e1 and epoch_order(10, 4, 1) != e1
    assert list(train_sampler(10, seed=3)) == e0  # the same seed gives the same order in a new process


def test_datamodule_state_dict_resumes_by_hand_and_dataset_pickles_small(tmp_path, train_file, target_dir):
    import pickle

    def fresh():
        dm = make_dm(train_file, target_dir, tmp_path / "cache", batch_size=2)
        dm.prepare_data()
        dm.setup("fit")
        return dm

    dm = fresh()
    order = [i for batch in dm.train_dataloader() for i in batch["index"].tolist()]
    it = iter(dm.train_dataloader())
    head = [i for _ in range(3) for i in next(it)["index"].tolist()]
    state = dm.state_dict()
    assert state["order"] == {"seed": 0, "examples": 16, "replicas": 1, "batch_size": 2}
    other = fresh()
    other.load_state_dict(state)
    tail = [i for batch in other.train_dataloader() for i in batch["index"].tolist()]
    assert head + tail == order
    # The state of another data order is refused with a warning: the epoch starts from its beginning.
    changed = make_dm(train_file, target_dir, tmp_path / "cache", batch_size=2, seed=1)
    changed.prepare_data()
    changed.setup("fit")
    changed.load_state_dict(state)
    with pytest.warns(UserWarning, match="does not match"):
        loader = changed.train_dataloader()
    assert len([i for batch in loader for i in batch["index"].tolist()]) == 16
    # The data's epoch numbering, fixed at a resume (Lightning's count can run ahead of the data), goes on in a loader
    # made again (reload_dataloaders_every_n_epochs): a fresh sampler numbered epochs by Lightning's count again.
    third = fresh()
    third.load_state_dict(state)
    resumed = third.train_dataloader()
    assert third.resumed_mid_epoch == 0 and third.data_epoch == 0
    resumed.sampler.set_epoch(1)  # Lightning's number for the epoch the data go on with
    assert (resumed.sampler.epoch, resumed.sampler.offset) == (0, 1)
    again = third.train_dataloader()
    again.sampler.set_epoch(2)
    assert again.sampler.epoch == 1 and list(again.sampler) == list(epoch_order(16, 0, 1))
    # ... within one fit: the same data module set up for another fit starts its numbering afresh.
    third.setup("fit")
    afresh = third.train_dataloader()
    afresh.sampler.set_epoch(0)
    assert afresh.sampler.epoch == 0 and afresh.sampler.offset == 0
    # Workers get paths, not copies of the memory-mapped caches.
    blob = pickle.dumps(dm.train_dataset)
    assert len(blob) < 4096
    clone = pickle.loads(blob)
    np.testing.assert_array_equal(clone[0]["topm_logits"], dm.train_dataset[0]["topm_logits"])


class _IndexRecorder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        self.seen.extend(batch["index"].tolist())
        return (self.w - 1.0) ** 2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_trainer_resume_mid_epoch_continues_the_same_order(tmp_path, train_file, target_dir):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def trainer(ckpt_dir=None, **kw):
        callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1)] if ckpt_dir else []
        return L.Trainer(
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=bool(ckpt_dir),
            callbacks=callbacks,
            default_root_dir=tmp_path,
            **kw,
        )

    def dm():
        return make_dm(train_file, target_dir, tmp_path / "cache", batch_size=2, logit_cache=False, val_fraction=0.0)

    full = _IndexRecorder()
    trainer(max_epochs=2).fit(full, datamodule=dm())  # 20 examples, batch 2 -> 10 batches per epoch
    assert len(full.seen) == 40 and full.seen[:20] != full.seen[20:]
    assert sorted(full.seen[:20]) == sorted(full.seen[20:]) == list(range(20))

    first = _IndexRecorder()
    trainer(tmp_path / "ckpt", max_steps=14).fit(first, datamodule=dm())
    assert first.seen == full.seen[:28]
    resumed = _IndexRecorder()  # resume mid-epoch 1 after 12 steps = 24 examples
    trainer(tmp_path / "ckpt2", max_epochs=2).fit(resumed, datamodule=dm(), ckpt_path=str(tmp_path / "ckpt" / "epoch=1-step=12.ckpt"))
    assert resumed.seen == full.seen[24:]



@pytest.mark.parametrize("kind", ["plain", "workers", "limited"])
def test_trainer_resume_from_an_epochs_last_step_goes_on_with_the_next_epoch(tmp_path, train_file, target_dir, kind):
    """A checkpoint of an epoch's last step goes on with the next epoch from its first batch, in that epoch's order.
    It once replayed an empty epoch and went on with the one after (one epoch's data skipped): with a worker
    process the loader's state holds no batch count, and with limit_train_batches the epoch ends before the loader."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    per_epoch = 6 if kind == "limited" else 10  # 20 examples, batch 2; limit_train_batches=6 ends epochs early

    def trainer(ckpt_dir=None, **kw):
        callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=per_epoch, save_top_k=-1)] if ckpt_dir else []
        return L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=bool(ckpt_dir), callbacks=callbacks, default_root_dir=tmp_path,
                         limit_train_batches=per_epoch if kind == "limited" else 1.0, **kw)

    def dm():
        return make_dm(train_file, target_dir, tmp_path / "cache", batch_size=2, logit_cache=False, val_fraction=0.0,
                       num_workers=1 if kind == "workers" else 0)

    full = _IndexRecorder()
    trainer(max_epochs=2).fit(full, datamodule=dm())
    assert len(full.seen) == 4 * per_epoch
    trainer(tmp_path / "ckpt", max_steps=per_epoch).fit(_IndexRecorder(), datamodule=dm())  # saved at the epoch's end
    resumed = _IndexRecorder()
    trainer(tmp_path / "ckpt", max_epochs=2).fit(resumed, datamodule=dm(),
                                                  ckpt_path=str(tmp_path / "ckpt" / f"epoch=0-step={per_epoch}.ckpt"))
    assert resumed.seen == full.seen[2 * per_epoch:]


def test_precompute_throughput_measures_both_paths(tmp_path, train_file, target_dir):
    dm = make_dm(train_file, target_dir, tmp_path / "cache", feature_cache=True)
    dm.prepare_data()
    before = sorted(p.name for p in (tmp_path / "cache").iterdir())
    res = precompute_throughput(dm.precompute_job(only_missing=False), dm.load_target())
    assert res["forward_s"] > 0 and res["precompute_s"] > 0 and res["tokens"] > 0
    assert res["ratio"] == pytest.approx(res["forward_s"] / res["precompute_s"])
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == before  # measured in a temp dir


def test_batches_pad_to_the_longest_or_to_fixed_lengths(tmp_path, train_file, target_dir):
    from lilicorr_pl.data import pad_length

    assert pad_length(13, None) == 13 and pad_length(13, [16, 32]) == 16 and pad_length(16, [16, 32]) == 16
    with pytest.raises(ValueError, match="exceeds the largest length bucket 32"):
        pad_length(33, [16, 32])
    lengths = {}
    for pad_to in ("longest", "buckets", "max_length"):
        dm = make_dm(train_file, target_dir, tmp_path / "cache", pad_to=pad_to)
        dm.prepare_data()
        dm.setup("fit")
        batches = list(dm.train_dataloader()) + list(dm.val_dataloader())
        for b in batches:  # padding is never supervised and never has target-logit rows
            pad = b["attention_mask"] == 0
            assert not b["loss_mask"][pad].any() and not b["logit_valid"][pad].any()
            assert b["topm_ids"].shape[1] == b["input_ids"].shape[1]
            longest = int(b["attention_mask"].sum(1).max())
            lengths.setdefault(pad_to, []).append((longest, b["input_ids"].shape[1]))
    assert all(width == longest for longest, width in lengths["longest"])
    assert all(width == min(n for n in (16, 32, 48, 64) if n >= longest) for longest, width in lengths["buckets"])
    assert dm.buckets() == [64] and {width for _, width in lengths["max_length"]} == {64}
    with pytest.raises(ValueError, match=r"length_buckets must be ascending .* >= data.max_length 64"):
        make_dm(train_file, target_dir, tmp_path / "cache", pad_to="buckets", length_buckets=[16, 32])
    with pytest.raises(ValueError, match="only read with data.pad_to: buckets"):
        make_dm(train_file, target_dir, tmp_path / "cache", length_buckets=[64])


def test_a_fit_loads_the_target_weights_once(tmp_path, train_file, target_dir, monkeypatch):
    """The data module's precompute and the system's configure_model share one loaded target."""
    import transformers

    from lilicorr_pl.losses import DFlashCE, DistractorPenalty, OraclePrefixCE
    from lilicorr_pl.heads import LiLiCorrHead
    from lilicorr_pl.models import DFlashDrafter
    from lilicorr_pl.system import DraftSystem

    import lilicorr_pl.target

    monkeypatch.setattr(lilicorr_pl.target, "_SHARED", {})  # a fresh process: nothing loaded yet
    loads = []
    original = transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: loads.append(a[0]) or original(*a, **k))
    spec = TargetSpec(target_dir, layer_ids=[1, 4])
    system = DraftSystem(spec, DFlashDrafter(num_layers=1, block_size=4), head=LiLiCorrHead(top_k=4, hidden_size=32, num_layers=1, num_heads=4),
                         losses=[DFlashCE(), OraclePrefixCE(), DistractorPenalty()], num_anchors=8, target_logits="cache",
                         lr_scheduler=None)
    dm = make_dm(train_file, target_dir, tmp_path / "cache", val_fraction=0.0)
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(system, datamodule=dm)
    assert any(p.name.startswith("logits-") for p in (tmp_path / "cache").iterdir())  # the precompute ran the target
    assert loads == [target_dir] and system.target is not None


def test_lilicorr_prepare_writes_the_stores_fit_reads(tmp_path, monkeypatch, capsys):
    """`lilicorr prepare -c CONFIG` builds the stores a `lilicorr fit` of the same config then only opens."""
    import lilicorr_pl.data.datamodule as datamodule_module
    from lilicorr_pl.cli import main

    root = Path(__file__).resolve().parents[1]
    args = ["-c", str(root / "configs" / "tiny.yaml"), f"--data.cache_dir={tmp_path / 'cache'}",
            "--trainer.accelerator=cpu", "--data.progress=false"]
    with pytest.raises(SystemExit) as exit_:
        main(["prepare", "--help"])
    assert exit_.value.code == 0 and "lilicorr prepare" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["prepare", *args, "--data.pad_to=sideways"])
    assert exit_.value.code == 2  # rejected while parsing, before any work
    capsys.readouterr()
    paths = main(["prepare", *args])["train"]
    assert sorted(paths) == ["logits", "tokens"] and all(p.is_dir() for p in paths.values())  # tiny.yaml reads the cache
    said = capsys.readouterr().out  # which stores a fit reads, and that this run wrote them (it said nothing)
    assert f"[lilicorr] prepare: train tokens store {paths['tokens']} (written)" in said

    def no_precompute(*a, **k):
        raise AssertionError("fit recomputed a store that `lilicorr prepare` wrote")

    monkeypatch.setattr(datamodule_module, "run_in_process", no_precompute)
    monkeypatch.chdir(tmp_path)
    cli = main(["fit", *args, "--trainer.max_steps=1", "--trainer.limit_val_batches=0", "--trainer.logger=false",
                "--trainer.callbacks=[]", "--trainer.enable_checkpointing=false"])
    assert cli.trainer.global_step == 1 and sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(
        p.name for p in paths.values())
    # The config.yaml that fit saved in its run folder (fit's own ckpt_path and weights_only included) names the
    # same stores: prepare reads it as it is, and finds them done.
    saved = tmp_path / "runs" / "tiny" / "config.yaml"
    assert "ckpt_path" in saved.read_text()
    capsys.readouterr()
    from lilicorr_pl.target import FrozenTarget

    monkeypatch.setattr(FrozenTarget, "from_spec", lambda *a, **k: pytest.fail("the target loaded with nothing to do"))
    assert main(["prepare", "-c", str(saved)])["train"] == paths
    assert f"[lilicorr] prepare: train logits store {paths['logits']} (reused)" in capsys.readouterr().out


def test_lilicorr_prepare_says_what_fit_says_in_one_line(tmp_path, capsys):
    """prepare's data, store and device errors were tracebacks (its precompute ran outside the command's error
    handling); a run folder or data store under a file was a traceback once the target was loaded, in every command."""
    root = Path(__file__).resolve().parents[1]
    args = ["-c", str(root / "configs" / "tiny.yaml"), f"--data.cache_dir={tmp_path / 'cache'}", "--data.progress=false"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "def f():\\n    return 1\\n"}\n{"text": \n')
    err = user_error(capsys, ["prepare", *args, f"--data.train_files=[{bad}]", f"--data.val_files=[{bad}]"])
    assert "bad.jsonl line 2" in err
    if not torch.cuda.is_available():  # on a GPU machine it runs
        err = user_error(capsys, ["prepare", *args, "--trainer.accelerator=gpu"])
        assert "(trainer.accelerator gpu, trainer.devices " in err and "--trainer.accelerator=cpu" in err
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    for command, setting in (("prepare", "data.cache_dir"), ("fit", "trainer.default_root_dir"),
                             ("validate", "data.cache_dir")):
        err = user_error(capsys, [command, "-c", str(root / "configs" / "tiny.yaml"), f"--{setting}={a_file / 'sub'}",
                                  *(["--ckpt_path=x.ckpt"] if command == "validate" else [])])
        assert f"{setting} {a_file / 'sub'}: {a_file} is a file, so the directory cannot be created" in err, err
    assert a_file.read_text() == "mine"


def test_a_folder_that_cannot_be_made_is_one_line_before_work(tmp_path, capsys, monkeypatch):
    """A cache or run folder whose parent takes no new folder (a read-only mount, /proc, another user's folder when the
    mode bits do not tell: root) failed with a FileNotFoundError traceback once the target was loaded and the data
    tokenized. The check tries to make one, and leaves nothing behind."""
    import errno
    import tempfile

    from lilicorr_pl import files

    root = Path(__file__).resolve().parents[1]
    locked = tmp_path / "locked"
    locked.mkdir()
    real = tempfile.mkdtemp

    def mkdtemp(*args, dir=None, **kwargs):  # noqa: A002 -- tempfile's own name
        if Path(dir) == locked:
            raise OSError(errno.EROFS, "Read-only file system")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(files.tempfile, "mkdtemp", mkdtemp)
    for command, setting in (("prepare", "data.cache_dir"), ("fit", "trainer.default_root_dir"),
                             ("fit", "data.cache_dir")):
        err = user_error(capsys, [command, "-c", str(root / "configs" / "tiny.yaml"), f"--{setting}={locked / 'sub'}"])
        assert f"{setting} {locked / 'sub'}: no folder can be created in {locked} (Read-only file system)" in err, err
    assert list(locked.iterdir()) == []
    files.check_writable_dir(tmp_path / "free" / "sub", "x")  # a folder that can be made passes, and is not made
    assert not (tmp_path / "free").exists() and [p.name for p in tmp_path.iterdir()] == ["locked"]


class _FakeStore:
    """The three things the alignment check reads from an opened store."""

    def __init__(self, path: str, shard_examples: list[int], shapes: dict[str, tuple[int, ...]]) -> None:
        self.path, self.shard_examples, self._shapes = path, shard_examples, shapes

    def shape(self, shard: int, name: str) -> tuple[int, ...]:
        return self._shapes[name]


@pytest.mark.parametrize("broken, what", [
    ("logit_shards", r"logits cache logits-x is not sharded like token cache tokens-x; delete logits-x"),
    ("logit_m", r"logit cache logits-x holds M=4 where its manifest says M=8; delete it"),
    ("feature_rows", r"feature cache features-x shard 0 does not line up with token cache tokens-x; delete it"),
])
def test_misaligned_stores_are_refused_naming_the_store_and_the_rebuild(tmp_path, train_file, target_dir, broken,
                                                                        what):
    dm = make_dm(train_file, target_dir, tmp_path / "cache")  # logit_top_m=8
    tokens = _FakeStore("tokens-x", [3, 2], {"input_ids": (3, 64)})
    logits = _FakeStore("logits-x", [3] if broken == "logit_shards" else [3, 2],
                        {"topm_ids": (3, 4 if broken == "logit_m" else 8)})
    features = _FakeStore("features-x", [3, 2], {"features": (2 if broken == "feature_rows" else 3, 64)})
    with pytest.raises(CacheError, match=what + r" and rerun prepare_data \(`lilicorr fit` or `lilicorr prepare`\) "
                                              r"to rebuild it$"):
        dm._check_alignment({"tokens": tokens, "logits": logits, "features": features})


def test_aligned_stores_pass_the_alignment_check(tmp_path, train_file, target_dir):
    dm = make_dm(train_file, target_dir, tmp_path / "cache")
    tokens = _FakeStore("tokens-x", [3, 2], {"input_ids": (3, 64)})
    dm._check_alignment({"tokens": tokens, "logits": _FakeStore("logits-x", [3, 2], {"topm_ids": (3, 8)}),
                         "features": _FakeStore("features-x", [3, 2], {"features": (3, 64)})})


def _tokenizer_with_bos():
    """The helpers' tokenizer with a BOS token its post-processor adds to plain text (as Llama's and Gemma's do)."""
    from helpers import EOS, make_tiny_tokenizer
    from tokenizers import processors

    tokenizer = make_tiny_tokenizer()
    bos = tokenizer.convert_tokens_to_ids(EOS)
    tokenizer.backend_tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{EOS} $A", pair=f"{EOS} $A $B", special_tokens=[(EOS, bos)]),
    ])
    tokenizer.bos_token = EOS
    assert tokenizer("x")["input_ids"][0] == bos != tokenizer("x", add_special_tokens=False)["input_ids"][0]
    return tokenizer


@pytest.mark.parametrize("thinking", [False, True])
def test_one_record_tokenizes_alike_in_regeneration_training_and_evaluation(tmp_path, thinking):
    """DESIGN §9.7 in one test: the same prompt, rendered by `regenerate` (what the target answers), by the data
    module (the training sequence, whose prompt part it must start with) and by the benchmark loader (`bench`,
    AcceptanceEval), gives the same token ids, for a chat record under either thinking flag and for a text
    prompt. With a tokenizer that adds a BOS token a text prompt had it in regeneration and training and not in
    evaluation: the drafter was measured on contexts it never saw."""
    from lilicorr_pl.data.regenerate import _make_job
    from lilicorr_pl.decoding.benchmarks import load_prompts

    tokenizer = _tokenizer_with_bos()
    chat = {"messages": [{"role": "user", "content": "Sort a list of numbers."},
                         {"role": "assistant", "content": "Use sorted(numbers)."}]}
    text = {"prompt": "def square(x):", "completion": "\n    return x * x\n"}
    for record, answer_free, as_chat in ((chat, {"messages": chat["messages"][:1]}, True),
                                         (text, {"prompt": text["prompt"]}, False)):
        trained, mask, _ = formats.tokenize_record(record, tokenizer, enable_thinking=thinking)
        answered = _make_job(0, answer_free, tokenizer, enable_thinking=thinking, chat_template=None,
                             prefix_chars=None).prompt_ids
        prompts = tmp_path / f"{as_chat}.jsonl"
        prompts.write_text(json.dumps(record) + "\n")
        evaluated = load_prompts(str(prompts), tokenizer, chat_template=as_chat, enable_thinking=thinking).input_ids[0]
        assert list(evaluated) == answered, record
        assert trained[: len(answered)] == answered and not any(mask[: len(answered)]) and any(mask[len(answered):])
    assert answered[0] == tokenizer.bos_token_id  # the text prompt, as the tokenizer encodes text


def test_an_empty_or_tool_calling_assistant_turn_supervises_only_assistant_text():
    """An assistant turn with empty (or null) content rendered like the empty placeholder, so its span ran to the end
    of the conversation: the tool's output, the next user turn and the role headers were supervised. Such a turn
    supervises nothing of its own now; the tool call reaches the template (it was dropped) and is the assistant's."""
    from helpers import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer()

    def supervised(messages):
        ids, mask, _ = formats.tokenize_record({"messages": messages}, tokenizer)
        return "".join(tokenizer.decode([i]) for i, m in zip(ids, mask) if m), tokenizer.decode(ids)

    text, _ = supervised([{"role": "user", "content": "first question"}, {"role": "assistant", "content": ""},
                          {"role": "user", "content": "second question"}, {"role": "assistant", "content": "ok then"}])
    assert text == "ok then<|im_end|>", text
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
    text, whole = supervised([
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "SECRET_TOOL_OUTPUT", "tool_call_id": "1"},
        {"role": "assistant", "content": "sunny"}])
    assert "SECRET_TOOL_OUTPUT" in whole and "SECRET" not in text and "user" not in text and "tool" not in text
    assert text.endswith("sunny<|im_end|>"), text
    # A template that renders tool calls (the helpers' ignores them): the call reaches it and is the turn's own text.
    tools = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}{% for c in m.tool_calls or [] %}"
             "<tool>{{ c.function.name }}</tool>{% endfor %}<|im_end|>\n{% endfor %}")
    ids, mask, _ = formats.tokenize_record({"messages": [
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "SECRET_TOOL_OUTPUT", "tool_call_id": "1"}]}, tokenizer, chat_template=tools)
    called = "".join(tokenizer.decode([i]) for i, m in zip(ids, mask) if m)
    assert "<tool>weather</tool>" in tokenizer.decode(ids) and "weather</tool>" in called and "SECRET" not in called


def test_a_template_that_refuses_a_conversation_is_one_line_naming_the_record(tmp_path):
    """Tool calls reach the template now, and a template that refuses their shape (Llama 3.1's raise_exception on
    parallel calls) was Jinja's traceback naming no record; a template that does not parse was one too."""
    from helpers import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer()
    single = ("{% for m in messages %}{% if m.tool_calls and m.tool_calls | length > 1 %}{{ raise_exception("
              "'This model only supports single tool-calls at once!') }}{% endif %}<|im_start|>{{ m.role }}\n"
              "{{ m.content or '' }}<|im_end|>\n{% endfor %}")
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
    record = {"messages": [{"role": "user", "content": "weather in Oslo and Bergen?"},
                           {"role": "assistant", "content": None, "tool_calls": [call, call]},
                           {"role": "assistant", "content": "both sunny"}]}
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"messages": record["messages"][:1] + record["messages"][2:]}) + "\n"
                     + json.dumps(record) + "\n")
    with pytest.raises(formats.DataFormatError) as err:
        list(formats.iter_examples([train], tokenizer, chat_template=single))
    assert str(err.value).startswith("train.jsonl line 2: the chat template cannot render it (This model only "
                                     "supports single tool-calls at once!); fix the record's turns"), err.value
    assert "\n" not in str(err.value)
    broken = "{% for m in messages %}{{ m.role }"
    # Not a record's fault (a regeneration would have said "fix it in --input"): the setting that chose it, named.
    with pytest.raises(formats.ChatTemplateError, match=r"^the chat template does not parse \(template line 1: .*fix "
                                                        r"data.chat_template") as err:
        formats.tokenize_record(record, tokenizer, chat_template=broken)
    assert not isinstance(err.value, formats.DataFormatError)
    # Checked once before any model loads, by the option's name; a template that parses passes, whatever it refuses.
    with pytest.raises(formats.ChatTemplateError, match=r"does not parse .*; fix --chat-template$"):
        formats.check_chat_template(tokenizer, broken, "--chat-template")
    formats.check_chat_template(tokenizer, single, "--chat-template")
    formats.check_chat_template(tokenizer, "{{ raise_exception('system turn first') }}", "--chat-template")


def test_a_template_file_is_read_once_and_its_text_is_what_the_run_records(tmp_path, target_dir):
    """data.chat_template given as a file: checkpoints recorded the path, which `bench` read again from its own
    folder later (an edited file, another one, or none). The data module keeps the text it rendered with."""
    from helpers import CHAT_TEMPLATE

    template = tmp_path / "my.jinja"
    template.write_text(CHAT_TEMPLATE)
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"text": "def f(x):\n    return x\n"}) + "\n")
    dm = make_dm(train, target_dir, tmp_path / "cache", chat_template=str(template))
    dm._check_inputs()
    template.write_text("{{ 'edited later' }}")  # changes nothing this run rendered or records
    assert dm.chat_template == CHAT_TEMPLATE
    dm._check_inputs()  # the text again: idempotent
    assert dm.chat_template == CHAT_TEMPLATE
