"""An offline code corpus: the Python standard library's own source.

The built-in target, the ``stdlib-heldout`` benchmark and the ``builtin:stdlib-*`` data need real text
that every machine already has, without a network: the ``.py`` files of the running interpreter's
standard library (``sysconfig.get_paths()["stdlib"]``, about 8 MB after filtering). The corpus is split
by whole top-level module (``asyncio``, ``json``, ``argparse.py`` …) so that held-out code is genuinely
unseen: a module lands in the held-out split when a stable (salted sha1) hash of its name falls in the
lowest ~10 %, independent of which other modules exist.

Everything here is deterministic (sorted paths, hashlib rather than ``hash()``, seeded sampling), so
two machines with the same Python version see the same splits and the same benchmark prefixes.
"""

from __future__ import annotations

import hashlib
import random
import re
import sys
import sysconfig
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

Split = Literal["train", "heldout"]

#: Directory names skipped anywhere under the stdlib. ``test``/``tests`` hold the CPython test
#: suite (huge, repetitive, and often intentionally odd code); ``idlelib``, ``lib2to3`` and
#: ``turtledemo`` are applications rather than library code; ``encodings`` is ~100 machine-generated
#: codec tables (about 14 % of the bytes) whose row-after-row patterns teach a small model to loop.
EXCLUDED_DIRS: frozenset[str] = frozenset(
    {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "turtledemo", "encodings"}
)

#: Files larger than this are skipped (``pydoc_data/topics.py`` is one giant string literal,
#: ``_pydecimal.py`` a near-duplicate of ``decimal``).
MAX_FILE_BYTES: int = 200 * 1024

#: A module is held out when ``sha1(HELDOUT_SALT + name) mod HELDOUT_MODULUS < HELDOUT_BUCKETS``:
#: ~10 % of modules. The salt was chosen once so that the split (21 of 196 modules, ~6 % of bytes)
#: leaves the three largest packages (distutils, asyncio, tkinter) to training; unsalted, they all
#: land in held-out and take ~19 % of the scarce training bytes with them.
HELDOUT_SALT: str = "demo:"
HELDOUT_MODULUS: int = 100
HELDOUT_BUCKETS: int = 10

# A complete one-line ``def``/``class`` header: the next line starts its body, a natural point at
# which to ask a model to continue.
MIN_PREFIX_TOKENS = 8  # a shorter prefix holds no header with context before it
_HEADER_RE = re.compile(r"^\s*(?:async\s+def|def|class)\s+\w+.*:\s*(?:#.*)?$")

_SOURCE_LINE_RE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")

Cut = Literal["header", "docstring"]


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def module_name(relative_path: Path) -> str:
    """The top-level module a stdlib file belongs to (``asyncio/tasks.py`` → ``asyncio``)."""
    first = relative_path.parts[0]
    return first[:-3] if first.endswith(".py") else first


def is_heldout_module(name: str) -> bool:
    """Whether the top-level module ``name`` belongs to the held-out split (stable across runs)."""
    bucket = int(hashlib.sha1((HELDOUT_SALT + name).encode("utf-8")).hexdigest(), 16) % HELDOUT_MODULUS
    return bucket < HELDOUT_BUCKETS


@lru_cache(maxsize=4)
def _all_files(root: Path) -> tuple[Path, ...]:
    files = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in relative.parts[:-1]):
            continue
        try:
            if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
                continue
        except OSError:  # a dangling symlink or unreadable entry is simply not corpus material
            continue
        files.append(path)
    # Sort on the relative POSIX path so the order does not depend on the install prefix or the OS.
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise FileNotFoundError(
            f"No Python sources found under the standard-library path {root} "
            "(sysconfig.get_paths()['stdlib']). The stdlib corpus needs an interpreter installed with "
            "its .py sources; install the full Python distribution (e.g. the python3.X package "
            "rather than a sources-stripped runtime image)."
        )
    return tuple(files)


def stdlib_files(split: Split) -> list[Path]:
    """All corpus files of one split, sorted by path relative to the stdlib root.

    Args:
        split: ``"train"`` or ``"heldout"``. The two are disjoint by top-level module.
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"Unknown corpus split {split!r}; use 'train' or 'heldout'.")
    root = stdlib_root()
    want_heldout = split == "heldout"
    return [p for p in _all_files(root) if is_heldout_module(module_name(p.relative_to(root))) == want_heldout]


def _read_text(path: Path) -> str:
    # errors="ignore": a stray latin-1 byte in one file must not stop a build.
    return path.read_text(encoding="utf-8", errors="ignore")


def read_corpus(split: Split) -> Iterator[str]:
    """The texts of all files in ``split``, one string per file, in :func:`stdlib_files` order."""
    for path in stdlib_files(split):
        yield _read_text(path)


def corpus_fingerprint() -> str:
    """A hash of everything the corpus content depends on: the filtering rules, the Python version, and each file's
    relative name and bytes (a sha256 of each; about 8 MB, tens of milliseconds).

    Caches built from the corpus include it in their key, so they rebuild after a Python upgrade, and after a
    distribution's patched stdlib or a file edited in place, at any size.
    """
    root = stdlib_root()
    digest = hashlib.sha256()
    digest.update(f"python={sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}\n".encode())
    rules = f"excluded={sorted(EXCLUDED_DIRS)};max={MAX_FILE_BYTES};"
    rules += f"heldout={HELDOUT_SALT}{HELDOUT_BUCKETS}/{HELDOUT_MODULUS}"
    digest.update(f"{rules}\n".encode())
    for path in _all_files(root):
        content = hashlib.sha256(path.read_bytes()).hexdigest()
        digest.update(f"{path.relative_to(root).as_posix()}:{content}\n".encode())
    return digest.hexdigest()[:16]


def _token_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens, for a ``transformers`` or ``tokenizers`` tokenizer."""
    try:  # transformers' PreTrainedTokenizerBase
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:  # tokenizers.Tokenizer.encode has no add_special_tokens keyword
        return list(tokenizer.encode(text).ids)


def heldout_prefixes(tokenizer: Any, num: int, prefix_tokens: int, seed: int = 0) -> list[str]:
    """Deterministic code prefixes from held-out modules, for benchmarking on never-seen code."""
    return code_prefixes(tokenizer, num, prefix_tokens, seed=seed, split="heldout")


def _docstring_cuts(text: str) -> list[tuple[int, int]]:
    """``(cut line, def line)`` (0-based) of every function whose body opens with a docstring and goes on with code:
    the cut is the line after the docstring's closing quotes, wherever they are (a docstring quoting other quotes, a
    ``def`` header over several lines, a decorator above). From the parsed source, never from a guess at quotes; a
    file that does not parse (the stdlib ships a few on purpose, as test data) has none."""
    import ast
    import warnings

    try:
        with warnings.catch_warnings():  # invalid escape sequences in old test data are not our concern
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    cuts = []
    for node in ast.walk(tree):
        # Code after the docstring (a stub whose body is its docstring would continue into the next function), and
        # a docstring on a line of its own, after the header's first line.
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and len(node.body) > 1:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str) and first.end_lineno is not None
                    and first.lineno > node.lineno and node.body[1].lineno > first.end_lineno):
                cuts.append((first.end_lineno, node.lineno - 1))  # 1-based end line = 0-based next line
    return sorted(cuts)


def code_prefixes(
    tokenizer: Any, num: int, prefix_tokens: int, seed: int = 0, split: Split = "heldout", cut: Cut = "header"
) -> list[str]:
    """Deterministic code prefixes from one split (``train`` prefixes become regeneration prompts).

    Each prefix is a run of whole lines from one file of the split that ends right after a one-line
    ``def``/``class`` header (``cut="header"``: the natural continuation is that body) or right after the
    docstring that opens a function (``cut="docstring"``: HumanEval's prompt shape, the continuation is its
    code), and holds at most ``prefix_tokens`` tokens (at least half of that). Prefixes come from distinct
    cut points, drawn with ``random.Random(seed)``; files are visited in sorted order, so the result depends
    only on the corpus, the tokenizer and the arguments.

    Args:
        tokenizer: a ``transformers`` tokenizer or a ``tokenizers.Tokenizer``, used to count tokens.
        num: how many prefixes to return.
        prefix_tokens: the token budget of each prefix.
        seed: selects which cut points are used.
        cut: where a prefix ends: after a header, or after a function's docstring.
    """
    if cut not in ("header", "docstring"):
        raise ValueError(f"Unknown prefix cut {cut!r}; use 'header' or 'docstring'.")
    if num <= 0:
        return []
    if prefix_tokens < MIN_PREFIX_TOKENS:
        raise ValueError(
            f"prefix_tokens={prefix_tokens} is too short for a code prefix; use at least {MIN_PREFIX_TOKENS}.")
    # Candidate cut points: (file index, line index after a header) with a body of ≥ 3 lines
    # following and at least a few lines of context before it.
    files = stdlib_files(split)
    texts = [_read_text(p) for p in files]
    # Header cuts split as they always did; docstring cuts at the parser's own line breaks (\n, \r\n, \r: a
    # form feed, which ``splitlines`` also breaks at, is no line to the parser, whose line numbers they index).
    file_lines = [text.splitlines(keepends=True) if cut == "header" else _SOURCE_LINE_RE.findall(text)
                  for text in texts]
    candidates: list[tuple[int, int, int]] = []  # (file, cut line, the header line the prefix must include)
    for file_index, lines in enumerate(file_lines):
        if cut == "header":
            candidates.extend((file_index, i + 1, i) for i, line in enumerate(lines)
                              if i >= 3 and i + 3 < len(lines) and _HEADER_RE.match(line))
        else:  # >= 4 lines after the docstring (its body), a few lines of context before the def
            candidates.extend((file_index, end, header) for end, header in _docstring_cuts(texts[file_index])
                              if header >= 3 and end + 3 < len(lines))
    random.Random(seed).shuffle(candidates)

    prefixes: list[str] = []
    for file_index, cut_line, header in candidates:
        lines = file_lines[file_index]
        # Grow backwards from the cut line by line while the (re-tokenized) prefix fits the budget;
        # re-tokenizing the joined text keeps the count exact across line boundaries.
        start = cut_line - 1
        while start > 0 and len(_token_ids(tokenizer, "".join(lines[start - 1 : cut_line]))) <= prefix_tokens:
            start -= 1
        text = "".join(lines[start:cut_line])
        count = len(_token_ids(tokenizer, text))
        # A docstring cut keeps its function's header: a prefix that starts inside the docstring is not one.
        if prefix_tokens // 2 <= count <= prefix_tokens and start <= header:
            prefixes.append(text)
            if len(prefixes) == num:
                return prefixes
    raise ValueError(
        f"Only {len(prefixes)} of the requested {num} {split} prefixes of {prefix_tokens // 2}.."
        f"{prefix_tokens} tokens (cut after each {cut}) could be cut from {len(files)} {split} files; request fewer or "
        "shorter prefixes."
    )
