"""Training-data formats: read records, render chats, tokenize, mask the loss, truncate, pack.

Accepted record formats, one JSON object per line of a ``.jsonl`` file (or one row of a ``.parquet``
file, with ``pip install pyarrow``). Extra keys (``id``, metadata) are ignored.

=====================  ==============================================  ===========================
format                 record                                          supervised (loss) tokens
=====================  ==============================================  ===========================
plain text             ``{"text": str}``                               all tokens
prompt / completion    ``{"prompt": str, "completion": str}``          completion tokens only
OpenAI messages        ``{"messages": [{"role", "content"}, ...]}``    assistant tokens only
ShareGPT               ``{"conversations": [{"from", "value"}, ...]}`` assistant tokens only
=====================  ==============================================  ===========================

ShareGPT speakers map ``human``/``user`` → user, ``gpt``/``assistant`` → assistant, ``system`` → system.

Chat records are rendered with the tokenizer's chat template (or ``chat_template``), passing the
recorded ``enable_thinking`` as a template variable, then tokenized with ``add_special_tokens=False``
(the template writes any BOS itself). Text and prompts are tokenized with the tokenizer's default
special tokens (a BOS for Llama-style tokenizers, nothing for Qwen); completions without.

**Assistant loss mask.** Qwen's template has no ``{% generation %}`` markers and does not even render
a conversation's prefixes consistently (the last assistant turn gets a think block, earlier ones do
not), so rendering prefixes and diffing is fragile. Instead, for each assistant turn we render the
whole conversation twice more with that turn replaced by a bare assistant message holding one of two
different placeholders; the characters where the real rendering differs from both are exactly where the
template placed that turn's content, tool calls and reasoning (whatever it did to them: stripping, moving
the reasoning into a think block, dropping the reasoning of old turns). An empty turn supervises nothing (it
supervised everything after it: the tool's output, the next role headers), and a placeholder that renders the same
text as the turn itself tells nothing and is left out.
Tokens that *start* inside that span are supervised, plus the special token the template closes the turn
with (``<|im_end|>``, ``<|eot_id|>``): the drafter must learn to predict the end of a turn. The template's
own scaffolding (role headers, the empty think block) is never supervised.

Two renderings per assistant turn are quadratic in the turns (a 64-turn conversation of 33 k tokens took 0.3 s to
mask). So first every assistant turn is replaced at once by a bare message holding a marker of its own, and the
conversation rendered once: where the template writes each marker once, in order, the text between the markers is its
scaffolding, and where the real rendering splits into that scaffolding and one stretch per turn in exactly one way,
those stretches are the turns' spans (one rendering in all, linear in the turns: a 64-turn conversation of 35 k tokens
masks in 0.036 s against 0.27 s). Where the template writes each turn on its own, these are the spans the two
placeholders find (neither placeholder is empty, as no marker is, so scaffolding written only around content that is
not empty is scaffolding to both). Where what it writes for one turn hangs on another (a banner before the first
tool call only, a prefix from the turn before), the placeholders' spans run on across the turns between, the user's
included, and the markers' do not. A template that writes a turn's scaffolding by what its content holds (Qwen's think
block for the last turn's reasoning), or writes a turn twice, or no split or more than one: the two renderings per
turn.

An OpenAI message's ``tool_calls``, ``tool_call_id``, ``name`` and ``reasoning_content`` reach the template
with its role and content (they were dropped, so a tool-calling conversation trained on a text the target
never sees).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Bump when tokenization or masking changes, so fingerprinted caches are rebuilt.
FORMAT_VERSION = 4  # 2: empty assistant turns mask nothing; tool-call fields reach the template; 3: a turn whose
# content begins like the scaffolding after it no longer supervises that scaffolding; 4: a template writing text only
# around an answer that is not empty (GLM-4.5's "\n"), or writing the turns in another order, masks every turn as
# rendered (tests/test_data.py pins each version's masks)

FORMATS = ("text", "prompt_completion", "messages", "sharegpt")
ACCEPTED_FORMATS_HELP = (
    '{"text": ...}, {"prompt": ..., "completion": ...}, {"messages": [{"role", "content"}, ...]}, '
    '{"conversations": [{"from", "value"}, ...]}'
)
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
#: Other names datasets give the assistant's and the user's turns in ``messages``. A chat template renders a role as
#: written, and only ``assistant`` turns are supervised, so such a record trained nothing, or the wrong turns: refused.
#: Any other role (``tool``, ``developer``, ``ipython``, ``observation``, a custom template's own) is passed on.
MISNAMED_ROLES = {"gpt": "assistant", "bot": "assistant", "chatbot": "assistant", "model": "assistant",
                  "human": "user", "assistant": "assistant", "user": "user", "system": "system"}
SUPPORTED_SUFFIXES = (".jsonl", ".parquet")


class DataFormatError(ValueError):
    """A training file or record that cannot be used; the message names the file and line."""


@dataclass
class TokenizedExample:
    """One training sequence."""

    input_ids: list[int]
    loss_mask: list[bool]  # True where the token is supervised (predicted from the tokens before it)
    source: str = ""  # "file.jsonl:12", or "a:1+a:2" after packing

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError(
                f"input_ids ({len(self.input_ids)}) and loss_mask ({len(self.loss_mask)}) differ in length"
            )

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_supervised(self) -> int:
        return sum(self.loss_mask)


@dataclass
class LoadStats:
    """What ``load_examples`` read and what it had to drop."""

    records: int = 0
    examples: int = 0
    truncated: int = 0
    dropped_unsupervised: int = 0  # records whose supervised tokens all fell past max_length (or none)
    no_block: int = 0  # records kept with one supervised token after the first: no anchor with a label
    supervised_tokens: int = 0
    tokens: int = 0
    formats: dict[str, int] = field(default_factory=dict)


# ---------------------------------------------------------------------- reading
def check_data_files(paths: Sequence[str | os.PathLike], setting: str = "data.train_files") -> list[Path]:
    """Resolve and check the files exist and have a supported suffix; raise before any heavy work."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise DataFormatError(f"no data files given; set {setting} to one or more .jsonl/.parquet files")
    out = []
    for p in paths:
        path = Path(p).expanduser()
        if path.is_dir():
            raise DataFormatError(f"data file {str(p)!r} is a directory; list its .jsonl/.parquet files in {setting}")
        if not path.is_file():
            raise FileNotFoundError(
                f"data file {str(p)!r} does not exist (resolved to {path.resolve()}); fix {setting}"
            )
        if path.suffix.lower() not in SUPPORTED_SUFFIXES:
            raise DataFormatError(
                f"data file {str(p)!r} has suffix {path.suffix!r}; supported: {', '.join(SUPPORTED_SUFFIXES)} "
                f"(convert it or fix {setting})"
            )
        if path.suffix.lower() == ".parquet":
            _require_pyarrow(path)
        out.append(path)
    return out


def _require_pyarrow(path: Path) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:  # an input the user can fix before anything runs: a one-line error, as the other refusals
        raise DataFormatError(
            f"reading {path.name} needs pyarrow, which is not installed; run `pip install pyarrow` "
            "(or `pip install lilicorr_pl[parquet]`), or convert the file to .jsonl"
        ) from None
    return pq


def json_error(err: json.JSONDecodeError) -> str:
    """``Expecting value at column 7``; json's own messages may end in "at" ("Invalid control character at")."""
    return f"{err.msg.removesuffix(' at')} at column {err.colno}"


UTF8_BOM = b"\xef\xbb\xbf"


def raw_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(line number from 1, bytes)`` of every line of a file, blank ones included (with its \n or \r\n). Lines end
    at \n, \r\n or a lone \r, as a file opened as text splits them (not at \u2028, which JSON strings may hold as
    is); a UTF-8 byte order mark (what some Windows editors put first) is not part of the first line. The one rule for
    every reader of a .jsonl file: the same file reads the same in fit, bench and regenerate."""
    i = 0
    with open(path, "rb") as f:
        for raw in f:
            if i == 0:
                raw = raw.removeprefix(UTF8_BOM)
            parts = re.split(rb"\r(?!\n)", raw)
            for part in parts[:-1] if not parts[-1] else parts:  # nothing after a line's final lone \r
                i += 1
                yield i, part


def text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number from 1, line)`` for each non-blank line of a UTF-8 text file (:func:`raw_lines`); a line that is
    not UTF-8 raises ``DataFormatError`` naming the file, the line and the byte (it was a traceback, or a message with
    neither)."""
    for i, part in raw_lines(path):
        try:
            line = part.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DataFormatError(
                f"{path.name} line {i}: not UTF-8 text (byte 0x{part[err.start]:02x} at column "
                f"{err.start + 1}); save the file as UTF-8 ({path})"
            ) from None
        if line.strip():
            yield i, line


def read_records(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_or_row_number, record)``; jsonl lines are numbered from 1, parquet rows from 1.

    Blank jsonl lines are skipped. A line that is not a JSON object raises ``DataFormatError`` naming
    the file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist")
    if path.suffix.lower() == ".parquet":
        pq = _require_pyarrow(path)
        table = pq.read_table(path)
        for i, row in enumerate(table.to_pylist(), start=1):
            yield i, row
        return
    for i, line in text_lines(path):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataFormatError(
                f"{path.name} line {i}: malformed JSON ({json_error(err)}); "
                f"each line of a .jsonl file must be one JSON object ({path})"
            ) from None
        if not isinstance(record, dict):
            raise DataFormatError(
                f"{path.name} line {i}: expected a JSON object, got {type(record).__name__}; "
                f"each line must look like one of {ACCEPTED_FORMATS_HELP}"
            )
        yield i, record


def detect_format(record: dict[str, Any], where: str = "record") -> str:
    """Which of ``FORMATS`` a record is, from its keys (extra keys are ignored)."""
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    if "text" in record:
        return "text"
    raise DataFormatError(
        f"{where}: unknown record format; keys seen: {sorted(record)}; accepted formats: {ACCEPTED_FORMATS_HELP}"
    )


def _text_of(content: Any, where: str) -> str:
    """Message content as a string (OpenAI multi-part content: the text parts joined)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and "text" in part:
                parts.append(str(part["text"]))
            else:
                raise DataFormatError(f"{where}: unsupported message content part {part!r}; only text parts")
        return "".join(parts)
    raise DataFormatError(f"{where}: message content must be a string, got {type(content).__name__}")


#: OpenAI message fields passed to the chat template besides role and content (tool use, reasoning).
PASSED_MESSAGE_FIELDS = ("tool_calls", "tool_call_id", "name", "reasoning_content")


def record_messages(record: dict[str, Any], fmt: str, where: str = "record") -> list[dict[str, Any]]:
    """Normalise a chat record (``messages`` or ShareGPT) into ``[{"role", "content", ...}, ...]`` (an OpenAI
    message keeps its :data:`PASSED_MESSAGE_FIELDS`)."""
    if fmt == "messages":
        raw = record["messages"]
        key, role_key, content_key = "messages", "role", "content"
    elif fmt == "sharegpt":
        raw = record["conversations"]
        key, role_key, content_key = "conversations", "from", "value"
    else:
        raise ValueError(f"{fmt!r} is not a chat format")
    if not isinstance(raw, list):
        raise DataFormatError(f"{where}: {key!r} must be a list of turns, got {type(raw).__name__}")
    if not raw:
        raise DataFormatError(f"{where}: empty conversation ({key!r} is []); remove the record or fill it")
    out = []
    for j, turn in enumerate(raw):
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            seen = sorted(turn) if isinstance(turn, dict) else type(turn).__name__
            raise DataFormatError(
                f"{where}: turn {j} of {key!r} needs keys {role_key!r} and {content_key!r}, saw {seen}"
            )
        role = turn[role_key]
        if fmt == "sharegpt":
            if role not in SHAREGPT_ROLES:
                raise DataFormatError(
                    f"{where}: turn {j} has speaker {role!r}; ShareGPT speakers must be one of "
                    f"{sorted(SHAREGPT_ROLES)}"
                )
            role = SHAREGPT_ROLES[role]
        elif not isinstance(role, str):
            raise DataFormatError(f"{where}: turn {j} role must be a string, got {role!r}")
        elif role != MISNAMED_ROLES.get(role.lower(), role):  # 'gpt', 'Assistant': no loss mask, silently dropped
            raise DataFormatError(
                f"{where}: turn {j} has role {role!r}; name it {MISNAMED_ROLES[role.lower()]!r} (only 'assistant' "
                "turns are supervised; ShareGPT 'human'/'gpt' turns go in \"conversations\" as \"from\"/\"value\")"
            )
        message = {"role": role, "content": _text_of(turn[content_key], f"{where} turn {j}")}
        if fmt == "messages":
            message.update({k: turn[k] for k in PASSED_MESSAGE_FIELDS if turn.get(k) is not None})
        out.append(message)
    return out


# ---------------------------------------------------------------------- chat templates
def resolve_chat_template(chat_template: str | None, option: str = "data.chat_template") -> str | None:
    """``chat_template`` may be a Jinja string or the path of a file holding one (``option``: where the user set it,
    for the message)."""
    if chat_template is None:
        return None
    if "{" not in chat_template and len(chat_template) < 4096:
        path = Path(chat_template).expanduser()
        if path.is_file():
            return path.read_text(encoding="utf-8")
        raise FileNotFoundError(
            f"chat_template {chat_template!r} is neither a Jinja template nor an existing file; "
            f"pass the template text or a path to a .jinja file ({option})"
        )
    return chat_template


@functools.lru_cache(maxsize=8)
def _template_digest(template: str) -> str:
    """sha256 of a template's text, as ``lilicorr regenerate`` records it (``fingerprint.text_sha256``); memoised:
    every chat record of a file compares against it."""
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


def effective_chat_template(tokenizer: Any, chat_template: str | None = None) -> str | None:
    """The template text that will be used: the override, else the tokenizer's own (None if neither)."""
    template = resolve_chat_template(chat_template)
    if template is not None:
        return template
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # several named templates: the default one
        own = own.get("default")
    return own


class ChatTemplateError(ValueError):
    """A chat template that does not parse: the setting that chose it is to fix, not a record."""


def _does_not_parse(err: Any, option: str) -> ChatTemplateError:
    return ChatTemplateError(f"the chat template does not parse (template line {err.lineno}: {err.message}); fix "
                             f"{option}")


def check_chat_template(tokenizer: Any, chat_template: str | None, option: str) -> None:
    """Refuse a chat template that does not parse (the override, else the tokenizer's own), naming ``option``, the
    setting that chose it: before a model loads, not once per record. Rendering one user turn compiles it; what a
    template that parses refuses is a record's to answer (:func:`render_chat`)."""
    from jinja2 import TemplateError, TemplateSyntaxError

    if effective_chat_template(tokenizer, chat_template) is None:
        return
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True,
                                      chat_template=chat_template)
    except TemplateSyntaxError as err:
        raise _does_not_parse(err, option) from None
    except TemplateError:  # it parses; this turn is not one it renders, which says nothing of the records
        pass


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, str]],
    *,
    enable_thinking: bool = False,
    chat_template: str | None = None,
    add_generation_prompt: bool = False,
    where: str = "a conversation",
    option: str = "data.chat_template, or the tokenizer's chat_template",
) -> str:
    """Render messages to text with the chat template, passing ``enable_thinking`` to the template.

    A template that refuses the conversation (its ``raise_exception``, e.g. Llama 3.1's on parallel tool calls, or an
    undefined field) is a :class:`DataFormatError` naming ``where`` (the record), not Jinja's traceback; one that does
    not parse is a :class:`ChatTemplateError` naming ``option``, the setting that chose the template."""
    from jinja2 import TemplateError, TemplateSyntaxError

    try:
        return tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            enable_thinking=enable_thinking,
        )
    except TemplateSyntaxError as err:
        raise _does_not_parse(err, option) from None
    except TemplateError as err:
        from lilicorr_pl.checkpoint import first_line

        reason = first_line(err)
        raise DataFormatError(
            f"{where}: the chat template cannot render it ({reason}); fix the record's turns (roles, tool_calls "
            f"shape) or pass a template that renders them ({option})"
        ) from None


def _common_prefix(a: str, b: str) -> int:
    """The length of ``a`` and ``b``'s common prefix, by halving: string comparisons in C over O(n) characters in all
    (a character at a time in Python took most of a long conversation's mask, twice per assistant turn)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo]; a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _common_suffix(a: str, b: str, limit: int) -> int:
    """The length of ``a`` and ``b``'s common suffix, at most ``limit``, by halving as :func:`_common_prefix`."""
    n, la, lb = max(0, min(len(a), len(b), limit)), len(a), len(b)
    if a[la - n:] == b[lb - n:]:
        return n
    lo, hi = 0, n  # the last lo characters agree; the last hi do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[la - mid:la - lo] == b[lb - mid:lb - lo]:
            lo = mid
        else:
            hi = mid
    return lo


# Differ from each other at their first and last characters. Neither is empty: a template that writes scaffolding only
# around content that is not empty (GLM's "\n" before an answer) wrote it for neither, as for a marker (the same
# answer masked alike by either way here).
_PLACEHOLDERS = ("\u2603\u2603", "\ue002\ue002")


#: Each assistant turn's marker in the one rendering of them all: private-use characters around its index.
_MARK = "\ue000{}\ue001"


def _spans_from_markers(tokenizer: Any, messages: list[dict[str, str]], rendered: str,
                        **render_kwargs: Any) -> list[tuple[int, int]] | None:
    """The assistant turns' character spans in ``rendered`` from one rendering with every assistant turn a marker
    (module doc), or None where that rendering does not decide them: a marker written other than once and in order, or
    ``rendered`` not split into the markers' scaffolding and one stretch per turn in exactly one way."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    marks = [_MARK.format(n) for n in range(len(turns))]
    if not turns or _MARK[0] in rendered:
        return None
    marked = [dict(m) for m in messages]
    for n, i in enumerate(turns):
        marked[i] = {"role": "assistant", "content": marks[n]}  # tool calls and reasoning go too, as with placeholders
    text = render_chat(tokenizer, marked, **render_kwargs)
    if text.count(_MARK[0]) != len(marks):
        return None
    pieces, at = [], 0
    for mark in marks:
        found = text.find(mark, at)
        if found < 0:
            return None
        pieces.append(text[at:found])
        at = found + len(mark)
    pieces.append(text[at:])
    head, tail, middle = pieces[0], pieces[-1], pieces[1:-1]
    if not (rendered.startswith(head) and rendered.endswith(tail) and len(head) + len(tail) <= len(rendered)):
        return None
    # The earliest split (each piece at its first place after the last) and the latest (each at its last place before
    # the next): every split lies between them, so where they agree the split is the only one.
    end = len(rendered) - len(tail)
    early, at = [], len(head)
    for piece in middle:
        found = rendered.find(piece, at, end)
        if found < 0:
            return None
        early.append((at, found))
        at = found + len(piece)
    early.append((at, end))
    late, at = [], end
    for piece in reversed(middle):
        found = rendered.rfind(piece, len(head), at)
        if found < 0:
            return None
        late.append((found + len(piece), at))
        at = found
    late.append((len(head), at))
    if early != late[::-1] or any(a > b for a, b in early):
        return None
    return [(a, b) for a, b in early if b > a]


def assistant_char_spans(
    tokenizer: Any, messages: list[dict[str, str]], rendered: str, **render_kwargs: Any
) -> list[tuple[int, int]]:  # render_kwargs: render_chat's
    """Character spans of ``rendered`` where each assistant turn's content was placed (see module doc): from one
    rendering with markers where it decides them, else from two renderings per turn."""
    spans = _spans_from_markers(tokenizer, messages, rendered, **render_kwargs)
    return spans if spans is not None else _spans_from_placeholders(tokenizer, messages, rendered, **render_kwargs)


def _spans_from_placeholders(tokenizer: Any, messages: list[dict[str, str]], rendered: str,
                             **render_kwargs: Any) -> list[tuple[int, int]]:
    """The assistant turns' character spans in ``rendered`` from two renderings per turn, that turn a placeholder in
    each (module doc)."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        alts = []
        for placeholder in _PLACEHOLDERS:
            other = [dict(m) for m in messages]
            other[i] = {"role": "assistant", "content": placeholder}  # tool calls and reasoning go too
            alt = render_chat(tokenizer, other, **render_kwargs)
            if alt != rendered:  # the same: the turn renders as this placeholder does (an empty turn), no information
                alts.append(alt)
        if not alts:
            continue
        # Each placeholder's common prefix can only run past the turn's start (into content that begins like what
        # follows the placeholder), never stop short of it: the earliest is the start. The common suffixes are then
        # bounded by that start; bounded by a prefix that ran past it, a suffix stopped short and the span ran on into
        # the scaffolding after the turn (a turn's "<|im_end|>..." content supervised the next user turn's header).
        start = min(_common_prefix(rendered, alt) for alt in alts)
        end = max(len(rendered) - _common_suffix(rendered, alt, limit=min(len(rendered), len(alt)) - start)
                  for alt in alts)
        if end > start:
            spans.append((start, end))
    return sorted(spans)  # in the rendering's order: a template may write the turns in another (tokenize_chat walks it)


def _special_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(i for i, tok in decoder.items() if getattr(tok, "special", False))
    return ids


def tokenize_chat(
    tokenizer: Any,
    messages: list[dict[str, str]],
    *,
    enable_thinking: bool = False,
    chat_template: str | None = None,
    where: str = "a conversation",
) -> tuple[list[int], list[bool]]:
    """Render and tokenize a conversation; the mask covers assistant content plus its end-of-turn token
    (``where``: the record, for a template's refusal)."""
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(
            f"chat loss masks need a fast tokenizer (character offsets); {type(tokenizer).__name__} is not one. "
            "Load the target's tokenizer with AutoTokenizer.from_pretrained(..., use_fast=True)"
        )
    kwargs = {"enable_thinking": enable_thinking, "chat_template": chat_template, "where": where}
    rendered = render_chat(tokenizer, messages, **kwargs)
    spans = assistant_char_spans(tokenizer, messages, rendered, **kwargs)
    enc = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ids = list(enc["input_ids"])
    offsets = enc["offset_mapping"]
    special = _special_ids(tokenizer)
    mask = [False] * len(ids)
    j = 0
    for start, end in spans:
        while j < len(ids) and offsets[j][0] < start:
            j += 1
        while j < len(ids) and offsets[j][0] < end:
            mask[j] = True
            j += 1
        # The special token that closes the turn (e.g. <|im_end|>) right after the content.
        if j < len(ids) and ids[j] in special and offsets[j][0] >= end:
            mask[j] = True
            j += 1
    return ids, mask


# ---------------------------------------------------------------------- one record
def tokenize_record(
    record: dict[str, Any],
    tokenizer: Any,
    *,
    enable_thinking: bool = False,
    chat_template: str | None = None,
    where: str = "record",
    fmt: str | None = None,
) -> tuple[list[int], list[bool], str]:
    """Tokenize one record (any of ``FORMATS``) → ``(input_ids, loss_mask, format)``, untruncated."""
    fmt = fmt or detect_format(record, where)
    if fmt == "text":
        text = record["text"]
        if not isinstance(text, str):
            raise DataFormatError(f"{where}: 'text' must be a string, got {type(text).__name__}")
        ids = list(tokenizer(text, verbose=False)["input_ids"])
        return ids, [True] * len(ids), fmt
    if fmt == "prompt_completion":
        prompt, completion = record["prompt"], record["completion"]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise DataFormatError(f"{where}: 'prompt' and 'completion' must be strings")
        p = list(tokenizer(prompt, verbose=False)["input_ids"])
        c = list(tokenizer(completion, add_special_tokens=False, verbose=False)["input_ids"])
        return p + c, [False] * len(p) + [True] * len(c), fmt
    messages = record_messages(record, fmt, where)
    generation = record.get("generation")
    recorded = generation.get("enable_thinking") if isinstance(generation, dict) else None
    if isinstance(recorded, bool) and recorded != enable_thinking:  # `lilicorr regenerate` wrote how it rendered them
        raise DataFormatError(
            f"{where}: regenerated with enable_thinking {str(recorded).lower()} (its \"generation\" entry), but "
            f"data.enable_thinking is {str(enable_thinking).lower()}, so the chat template would render the target's "
            f"answers unlike it wrote them; set data.enable_thinking: {str(recorded).lower()}"
        )
    template = resolve_chat_template(chat_template)
    written_with = generation.get("chat_template_sha256") if isinstance(generation, dict) else None
    if isinstance(written_with, str):
        used = effective_chat_template(tokenizer, template)
        if used is None or _template_digest(used) != written_with:
            raise DataFormatError(
                f"{where}: regenerated with another chat template (its \"generation\" entry's chat_template_sha256 "
                f"{written_with[:12]}..., this run's {_template_digest(used)[:12] + '...' if used else 'none'}), so the "
                "target's answers would be rendered unlike it wrote them; set data.chat_template to the template "
                "`lilicorr regenerate` used (its --chat-template, else the target tokenizer's own)"
            )
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise DataFormatError(
            f"{where}: chat data ({fmt}) but the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no "
            "chat template; pass data.chat_template (a Jinja template or a .jinja file) or use a chat "
            "model's tokenizer"
        )
    ids, mask = tokenize_chat(tokenizer, messages, enable_thinking=enable_thinking, chat_template=template,
                              where=where)
    return ids, mask, fmt


# ---------------------------------------------------------------------- many records
def iter_examples(
    paths: Sequence[str | os.PathLike],
    tokenizer: Any,
    *,
    max_length: int = 3072,
    enable_thinking: bool = False,
    chat_template: str | None = None,
    pack: bool = False,
    max_examples: int | None = None,
    setting: str = "data.train_files",
    stats: LoadStats | None = None,
) -> Iterator[TokenizedExample]:
    """Stream the examples of ``paths`` (in order): read, tokenize, mask, truncate, optionally pack.

    Records longer than ``max_length`` keep their first ``max_length`` tokens. Records left without a
    supervised token (e.g. the assistant turn fell past ``max_length``, or a chat with no assistant
    turn) are dropped and counted in ``stats.dropped_unsupervised``; those with a single supervised
    token after the first (no draft block: its anchor needs a supervised token after it) are kept and
    counted in ``stats.no_block``. ``max_examples`` caps the number of records read (before packing).
    Raises ``DataFormatError`` at the end if nothing at all was supervised, or (unpacked) no record can
    hold a block. Streaming keeps memory flat for large datasets (the data module writes straight into
    its token cache).
    """
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2 to have anything to predict, got {max_length}")
    files = check_data_files(paths, setting)
    template = resolve_chat_template(chat_template)
    stats = stats if stats is not None else LoadStats()

    def unpacked() -> Iterator[TokenizedExample]:
        for path in files:
            if max_examples is not None and stats.records >= max_examples:
                return
            for line, record in read_records(path):
                if max_examples is not None and stats.records >= max_examples:
                    return
                where = f"{path.name} line {line}"
                stats.records += 1
                ids, mask, fmt = tokenize_record(
                    record, tokenizer, enable_thinking=enable_thinking, chat_template=template, where=where
                )
                stats.formats[fmt] = stats.formats.get(fmt, 0) + 1
                if len(ids) > max_length:
                    ids, mask = ids[:max_length], mask[:max_length]
                    stats.truncated += 1
                # Position 0 has no prefix to predict it from: it is never a target.
                supervised = sum(mask[1:])
                if not supervised:
                    stats.dropped_unsupervised += 1
                    continue
                # A block needs a supervised anchor past position 0 and a supervised token after it (sample_anchors,
                # block_labels). Counted, not dropped: the stores keep what they held (packed, such a record can
                # still hold a label of the record before it), and a step without a block trains nothing.
                stats.no_block += supervised < 2
                yield TokenizedExample(ids, mask, f"{path.name}:{line}")

    stream = iter_packed(unpacked(), max_length) if pack else unpacked()
    for ex in stream:
        stats.examples += 1
        stats.tokens += len(ex)
        stats.supervised_tokens += ex.num_supervised
        yield ex
    names = ", ".join(p.name for p in files)
    if stats.examples and not pack and stats.no_block == stats.examples:
        raise DataFormatError(
            f"no record of {names} can hold a draft block ({stats.records} records: {stats.dropped_unsupervised} "
            f"without any supervised token inside max_length, {stats.no_block} with only one supervised token after "
            "the first; a block needs a supervised anchor and one after it): add longer records or raise "
            "data.max_length"
        )
    if stats.examples == 0:
        raise DataFormatError(
            f"no supervised tokens in {names} ({stats.records} records, {stats.dropped_unsupervised} without "
            "any supervised token inside max_length): chat data needs assistant turns, prompt/completion "
            "needs a non-empty completion; check the files or raise data.max_length"
        )


def load_examples(
    paths: Sequence[str | os.PathLike],
    tokenizer: Any,
    *,
    max_length: int = 3072,
    enable_thinking: bool = False,
    chat_template: str | None = None,
    pack: bool = False,
    max_examples: int | None = None,
    setting: str = "data.train_files",
    stats: LoadStats | None = None,
) -> list[TokenizedExample]:
    """``iter_examples`` as a list (see there)."""
    return list(
        iter_examples(
            paths,
            tokenizer,
            max_length=max_length,
            enable_thinking=enable_thinking,
            chat_template=chat_template,
            pack=pack,
            max_examples=max_examples,
            setting=setting,
            stats=stats,
        )
    )


def iter_packed(examples: Iterable[TokenizedExample], max_length: int) -> Iterator[TokenizedExample]:
    """Greedily concatenate consecutive examples into sequences of at most ``max_length`` tokens.

    Order is kept (first-fit on the running sequence); each example's loss mask is kept as is, except
    that the first token of every packed example after the first is not supervised (it has no prefix
    of its own). Packed examples attend to each other (plain causal attention, no document masking):
    cheap, and harmless for chat data whose supervised tokens always follow their own prompt.
    """
    ids: list[int] = []
    mask: list[bool] = []
    sources: list[str] = []
    for ex in examples:
        if ids and len(ids) + len(ex) > max_length:
            yield TokenizedExample(ids, mask, "+".join(sources))
            ids, mask, sources = [], [], []
        ex_mask = list(ex.loss_mask)
        if ids:
            ex_mask[0] = False
        ids = ids + list(ex.input_ids[:max_length])
        mask = mask + ex_mask[:max_length]
        sources.append(ex.source)
    if ids:
        yield TokenizedExample(ids, mask, "+".join(sources))


def pack_examples(examples: Iterable[TokenizedExample], max_length: int) -> list[TokenizedExample]:
    """``iter_packed`` as a list (see there)."""
    return list(iter_packed(examples, max_length))
