"""How a tool subcommand is parsed: its typed function *is* its command line (jsonargparse).

``lilicorr bench``, ``export``, ``regenerate``, ``demo`` and ``build-target`` are plain functions; their
signatures and docstrings are the interface. jsonargparse builds ``--help`` from them, adds ``-c/--config``
(a YAML file with any of the same keys) and ``--print_config``, and rejects a value of the wrong type
(a ``Literal`` choice, a negative count, a malformed device) before the function runs.
``lilicorr prepare`` and ``lilicorr perf`` parse with ``fit``'s parser instead (``perf`` adds typed options of
its own, :mod:`lilicorr_pl.perf`).

Options are spelled as in the signature: ``--num_prompts 3``, ``--temperature [0,1]``, ``--overwrite true``.
The argparse spellings of earlier versions keep working; :func:`argparse_spellings` rewrites them before
jsonargparse parses (and validates) the result: ``--num-prompts 3``, ``--temperature 0 1``,
``--selectors top1,lilicorr``, ``--allow-module A --allow-module B``, a bare ``--overwrite``, ``--no-progress``.
"""

from __future__ import annotations

import importlib.resources
import inspect
import itertools
import json
import os
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jsonargparse import ActionConfigFile, ArgumentParser

CONFIG_FLAGS = ("-c", "--config")


def config_arguments(argv: Sequence[str]) -> list[tuple[int, str]]:
    """The ``-c/--config`` values in ``argv`` (``-c X``, ``-c=X``, ``-cX``, ``--config X``, ``--config=X``): (the index
    of the token that holds it, the value, which ends that token)."""
    out = []
    for i, token in enumerate(argv):
        flag, eq, value = token.partition("=")
        if flag in CONFIG_FLAGS and eq:
            out.append((i, value))
        elif token in CONFIG_FLAGS and i + 1 < len(argv):
            out.append((i + 1, argv[i + 1]))
        elif token.startswith("-c") and len(token) > 2 and token[2] != "=":  # argparse's -cFILE
            out.append((i, token[2:]))
    return out


def is_inline_config(text: str) -> bool:
    """A ``-c`` value that is YAML/JSON itself, not a file's name."""
    return text.lstrip().startswith(("{", "[")) or "\n" in text


CONFIG_HELP = "a YAML file with any of the options below (later options override it)"
_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|nan)$", re.IGNORECASE)
_PLAIN_SCALAR = re.compile(r"^[\w./-][\w.+\-/:@~]*$")
_YAML_WORDS = {"null", "~", "true", "false", "yes", "no", "on", "off", "y", "n"}


def _strip_optional(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _is_bool(hint: Any) -> bool:
    return _strip_optional(hint) is bool


def _is_list(hint: Any) -> bool:
    """A list option; or one value or a list (``Sequence[float] | float``), spelt as a list on the command line."""
    hint = _strip_optional(hint)
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return any(typing.get_origin(option) in (list, Sequence, typing.Sequence) for option in options)


def _is_value(token: str) -> bool:
    """A command-line token that is a value, not an option (``-0.5`` is a value)."""
    return not token.startswith("-") or bool(_NUMBER.match(token))


def _yaml_item(token: str) -> str:
    plain = _PLAIN_SCALAR.match(token) and token.lower() not in _YAML_WORDS
    return token if plain else json.dumps(token)  # a JSON string is valid YAML


def argparse_spellings(argv: Sequence[str], hints: Mapping[str, Any]) -> list[str]:
    """Rewrite argparse-style spellings of the options in ``hints`` into the jsonargparse ones.

    ``--a-b`` -> ``--a_b``; a bool option without a value -> ``--flag=true`` (with one, ``--flag=VALUE``);
    ``--no-flag`` -> ``--flag=false``;
    a list option followed by several values, given several times, or as ``a,b`` -> one ``--opt=[a, b]``. Anything else
    (including a lone ``--``, dropped) is passed through unchanged for jsonargparse to parse and validate.
    """
    out: list[str | None] = []
    lists: dict[str, tuple[int, list[str]]] = {}  # list option -> (its slot in `out`, collected values)
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token == "--":
            continue
        if not token.startswith("--"):
            out.append(token)
            continue
        name, eq, value = token[2:].partition("=")
        key = name.replace("-", "_")
        if key not in hints and key.startswith("no_") and _is_bool(hints.get(key[3:])) and not eq:
            out.append(f"--{key[3:]}=false")
            continue
        if key not in hints:
            out.append(token)
            continue
        hint = hints[key]
        if eq:
            values = [value]
        elif _is_bool(hint):
            # A value after the flag is its value, a word it does not know too: refused as the flag's
            # (`--compile maybe` was "unrecognized arguments: maybe"; no command takes a positional argument).
            if i < len(argv) and _is_value(argv[i]):
                values, i = [argv[i]], i + 1
            else:
                values = ["true"]
        else:
            values = []
            while i < len(argv) and _is_value(argv[i]) and (_is_list(hint) or not values):
                values.append(argv[i])
                i += 1
        if _is_list(hint) and not (len(values) == 1 and values[0].lstrip().startswith("[")):
            if key not in lists:
                lists[key] = (len(out), [])
                out.append(None)
            lists[key][1].extend(part for v in values for part in v.split(",") if part.strip())  # a,b = [a, b]
            continue
        out.append(f"--{key}" if not values else f"--{key}={values[0]}")
    for key, (slot, values) in lists.items():
        out[slot] = f"--{key}=[{', '.join(_yaml_item(v) for v in values)}]"
    return [t for t in out if t is not None]


def type_hints(function: Callable[..., Any]) -> dict[str, Any]:
    hints = typing.get_type_hints(function)
    return {name: hints.get(name, Any) for name in inspect.signature(function).parameters}


def description(function: Callable[..., Any]) -> str:
    """The docstring without its ``Args:`` section (that section becomes each option's help)."""
    import docstring_parser

    doc = docstring_parser.parse(inspect.getdoc(function) or "")
    return "\n\n".join(p for p in (doc.short_description, doc.long_description) if p)


# What jsonargparse writes around the reasons a value was refused: the union it tried and each member's type, the
# value's Python type, its try of the value as a config file's path, a union's None member, and the forms a class
# may be given in. None of it is a reason.
_PARSE_NOISE = re.compile(r"^(Does not validate against any of the Union subtypes|Subtypes: |Errors:$"
                          r"|Given value type: |Given value: |Expected a <class 'NoneType'>"
                          r"|Expected a path but .* either not accessible or invalid$|Problem with given class_path "
                          r"|Subclass types expect one of:$|a class path \(str\)$|a dict with (class_path|init_args) "
                          r"|a dict without class_path |a dict with parameters accepted by the base class )")
_CALLABLE = re.compile(r"^Type .* expects a function or a callable class: ")  # a prefix before the reason
_SCOPE = re.compile(r"""(?:Parser key "([^"]+)"|Problem with given class_path '([^']+)'):$""")
_KINDS = {"PositiveInt": "a positive integer (1 or more)", "NonNegativeInt": "an integer >= 0",
          "PositiveFloat": "a number > 0", "NonNegativeFloat": "a number >= 0 (not nan)",
          "ClosedUnitInterval": "a number from 0 to 1", "OpenUnitInterval": "a number between 0 and 1",
          "DeviceName": "a device: cpu, cuda, cuda:N or mps", "int": "an integer", "float": "a number",
          "bool": "true/false", "str": "a string", "dict": "a mapping", "list": "a list", "Iterable": "a list",
          "tuple": "a list of fixed length", "class": "a class name or import path",
          "config": "a config file or a mapping of its keys"}
_PY_CLASS = r"Expected a?\s?<class '(?:[\w.]+\.)?(\w+)'>"  # a Python type, named by its last part
_KIND = re.compile(rf"^(?:Not of type (\w+)|{_PY_CLASS}|Expected a?\s?dot import path string|Not a valid subclass of "
                   r"\w+$|(Unable to load config) '.*'$)")
# The value a reason names (the one item of a list that was refused), most specific first.
_VALUE = re.compile(r"Got value: (.*?)(?:\. Got value: .*)?$|Not of type \w+: (.*?) does not (?:conform|match)"
                    r"|could not convert string to float: '(.*)'$|invalid literal for int\(\) with base 10: '(.*)'$"
                    r"|dot import path string: (.*)$|^Import path (\S+) does not correspond"
                    r"|^Unable to load config '(.*)'$")


def _literal_choices(text: str) -> list[str]:
    """The choices of every ``typing.Literal[...]`` named in ``text``, in order, without quotes or repeats."""
    found: list[str] = []
    for inner in re.findall(r"typing\.Literal\[(.*?)\]", text):
        for choice in (c.strip().strip("'\"") for c in inner.split(",")):
            if choice and choice not in found:
                found.append(choice)
    return found


def _spaces(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _shown(value: str | None) -> str | None:
    """The value as the line shows it: quoted when empty or with spaces or a colon; None for a whole Namespace."""
    if value is None or "Namespace(" in value:
        return None
    if value == "" or (re.search(r"\s|: ", value) and value[:1] not in "[{'\""):
        return f"'{value}'"
    return value


def constructor_reason(message: str) -> str:
    """The reason a constructor gave, out of jsonargparse's account of a union it tried while building a class
    ("Does not validate against any of the Union subtypes ... Errors: - Expected a <class 'str'> - <the reason> ...
    Given value: <every setting>"): its first line that is not about a type it tried; a message of another shape, its
    last line."""
    for line in message.splitlines():
        line = line.strip().removeprefix("- ").strip()
        if line and not _PARSE_NOISE.match(line) and not _KIND.match(line) and not line.startswith("Expected a "):
            return line
    lines = message.strip().splitlines()
    return lines[-1] if lines else message


def plain_parse_error(message: str, aliases: Mapping[str, str] | None = None) -> str:
    """jsonargparse's refusal of a value, as one line: the option's key, the value and what the option takes.

    ``Parser key "num_prompts":\n  Not of type PositiveInt: 0 does not conform to restriction v>0`` becomes
    ``num_prompts: 0 is not a positive integer (1 or more)`` (the key, as ``--num_prompts`` on the command line or
    ``num_prompts:`` in a ``-c`` file). A value inside a class's ``init_args`` (at any depth) is named by its full key
    and its class; a union's members are all named. A message of any other shape keeps every reason it gives, on one
    line. Any other parse error (an unknown option, a missing one) is returned as it is. ``aliases``: keys to report
    as others (a linked option, which jsonargparse names by the key it is copied to).
    """
    if not message.startswith('Parser key "'):
        return message
    # An empty value ends its line: "Got value: " (stripped to "Got value:" below) is written as ''.
    lines = [re.sub(r"((?:Got|Given) value|dot import path string):\s*$", r"\1: ''", x.rstrip()) for x in
             message.splitlines()]
    outer = re.match(r'Parser key "([^"]+)"', lines[0]).group(1)  # type: ignore[union-attr]
    # The deepest scope with lines of its own (an option inside a class, a class inside a list), and its ancestors.
    scopes = [i for i, x in enumerate(lines[1:], 1) if _SCOPE.search(x)
              and _spaces(next((y for y in lines[i + 1:] if y.strip()), "")) > _spaces(x)]
    deepest = max(scopes, key=lambda i: (_spaces(lines[i]), -i), default=0)  # the most nested; the first of equals
    chain, depth = [], _spaces(lines[deepest]) + 1
    for x in reversed(lines[1:deepest + 1]):
        if (found := _SCOPE.search(x)) and _spaces(x) < depth:
            chain.append(found.groups())
            depth = _spaces(x)
    key, cls = outer, None
    for option, class_path in reversed(chain):
        if class_path:
            cls = class_path.rsplit(".", 1)[-1]
        elif option.startswith(key + "."):  # a dataclass's own key: written in full
            key = option
        elif option != key:
            key = f"{key}.init_args.{option}"
    key = (aliases or {}).get(key, key) + (f" ({cls})" if cls else "")
    top = _spaces(lines[deepest])
    focus = list(itertools.takewhile(lambda x: not x.strip() or _spaces(x) > top, lines[deepest + 1:])) if deepest \
        else lines[1:]
    reasons: list[str] = []
    for line in focus:
        line = re.sub(r'^Parser key "[^"]+": ?', "", _CALLABLE.sub("", line.strip().removeprefix("- ").strip()))
        seen = {r.replace('"', "'") for r in reasons}  # one reason per union member that gave it, quoted either way
        if line and not _PARSE_NOISE.match(line) and line.replace('"', "'") not in seen:
            reasons.append(line)
    named = next((m for m in map(_VALUE.search, reasons) if m), None)
    given = re.search(r"^\s*Given value: (.*)$", "\n".join(focus if deepest else lines), re.MULTILINE)
    nested = re.fullmatch(r"NestedArg\(key='.*', val='(.*)'\)", given.group(1)) if given else None
    value = _shown(next(g for g in named.groups() if g is not None) if named else
                   nested.group(1) if nested else given.group(1).removesuffix(".") if given else None)
    # A union of Literals (and None) takes all their choices, whatever each member's error said (an int Literal's is
    # "Expected a <class 'int'>").
    members = next((x.strip()[len("Subtypes: "):] for x in focus if x.strip().startswith("Subtypes: ")), None)
    literals_only = members is not None and not re.sub(r"typing\.Literal\[.*?\]|<class 'NoneType'>|[\[\], ]", "",
                                                       members)
    text = "\n".join(reasons)
    choices = _literal_choices(members if literals_only else text)
    literal_reasons = [r for r in reasons if r.startswith("Expected a typing.Literal")]
    kinds = [m.group(1) or m.group(2) or ("config" if m.group(3) else "class")
             for r in reasons if r not in literal_reasons and (m := _KIND.match(r))]
    kinds = list(dict.fromkeys("float" if k == "int" and "float" in kinds else k for k in kinds))
    if choices and (literals_only or len(literal_reasons) == len(reasons)):
        what = "not one of " + ", ".join(choices)
    elif kinds and all(k in _KINDS for k in kinds) and all(_KIND.match(r) or r in literal_reasons for r in reasons):
        named_kinds = list(dict.fromkeys(_KINDS[k] for k in kinds))
        if choices:
            named_kinds.insert(0, "one of " + ", ".join(choices))
        what = "not " + (", ".join(named_kinds[:-1]) + " or " if len(named_kinds) > 1 else "") + named_kinds[-1]
    else:  # a shape not known here: every reason it gives, on one line, Python's type names in words
        reasons = [re.sub(_PY_CLASS, lambda m: "expected " + _KINDS.get(m.group(1), m.group(1)), r) for r in reasons]
        what = " ".join(r + ("" if r.endswith(":") else ";") for r in reasons).removesuffix(";") or "refused"
        what = re.sub(r"\. Got value: .*?(;|$)", r"\1", what)
        shown = value is not None and value not in what
        return f"{key}: {value}: {what}" if shown else f"{key}: {what}"
    return f"{key}: {value} is {what}" if value is not None else f"{key}: {what}"


class ShortUsage:
    """A parser whose error is not buried under its usage (mixed in before the parser class): ``fit`` has hundreds of
    options, and a mistyped value printed ninety lines of them above the one error line. The usage printed before an
    error is cut to its first line and an ellipsis when it is longer than a few lines; ``--help`` prints every option,
    as before. A refused value's error is one line (:func:`plain_parse_error`), not jsonargparse's account of every
    type it tried."""

    def format_usage(self) -> str:
        usage = super().format_usage()  # type: ignore[misc]
        lines = usage.splitlines()
        return usage if len(lines) <= 4 else f"{lines[0]} …\n"

    parse_aliases: typing.ClassVar[dict[str, str]] = {}
    """Keys that a refusal names by another: a linked option is refused under the key it is copied to."""

    def error(self, message: str, ex: Exception | None = None) -> typing.NoReturn:
        # A nested parser (a class's init_args) raises to the parser above it, which reads its message: only the
        # error that is printed is rewritten.
        printed = getattr(self, "exit_on_error", True)
        super().error(plain_parse_error(message, self.parse_aliases) if printed else message, ex)  # type: ignore[misc]


class ToolParser(ShortUsage, ArgumentParser):
    """The tools' parser (``bench``, ``export``, ``demo``, …): jsonargparse's, with :class:`ShortUsage`."""


def function_parser(function: Callable[..., Any], prog: str) -> ArgumentParser:
    """``--help`` from the signature and docstring, ``-c/--config``, ``--print_config``, typed options."""
    # Options are named in full (allow_abbrev off): `--max_new 2` was taken for --max_new_tokens.
    parser = ToolParser(prog=prog, description=description(function), allow_abbrev=False)
    parser.add_argument("-c", "--config", action=ActionConfigFile, help=CONFIG_HELP)
    parser.add_function_arguments(function, as_group=False, fail_untyped=True, sub_configs=True)
    return parser


PATH_PARAMETERS = frozenset({"ckpt", "output", "plot", "workdir", "input", "benchmark", "target", "json",
                             "target_config"})
"""The commands' parameters that name files or folders: a value starting with ``~`` is the user's home there, as in a
shell (a quoted ``'~/x'`` or a ``-c`` file's ``output: ~/x`` would otherwise make a folder named ``~``). The tools
expand them in :func:`run_function`; ``perf``, which has its own parser, with :func:`expand_home` too."""


def expand_home(name: str, value: Any) -> Any:
    """``value`` with a leading ``~`` expanded when ``name`` is a path parameter; anything else as it is."""
    if name in PATH_PARAMETERS and isinstance(value, str) and value.startswith("~"):
        return os.path.expanduser(value)
    return value


def run_function(function: Callable[..., Any], argv: Sequence[str], prog: str) -> Any:
    """Parse ``argv`` for ``function`` (exit status 2 on a bad value) and call it with the parsed values."""
    parser = function_parser(function, prog)
    config = parser.parse_args(argparse_spellings(argv, type_hints(function)))
    values = parser.instantiate_classes(config)
    return function(**{name: expand_home(name, values[name])
                       for name in inspect.signature(function).parameters if name in values})


def shipped_configs() -> Path:
    """The ``configs/`` shipped inside the package: found through ``importlib.resources``, in a checkout (where
    ``lilicorr_pl/configs`` links to the repository's ``configs/``) and in an installed wheel alike."""
    path = Path(str(importlib.resources.files("lilicorr_pl").joinpath("configs")))
    if not path.is_dir():
        raise FileNotFoundError(f"the shipped configs are missing ({path}); reinstall lilicorr_pl")
    return path


def shipped_config_path(name: str) -> str:
    """``configs/tiny.yaml`` -> that file in the shipped configs when no such file exists here; else ``name``.

    So ``lilicorr fit -c configs/tiny.yaml`` works from a checkout and from any directory with an installed wheel;
    a ``configs/...`` file of your own in the working directory always wins.
    """
    parts = Path(name).parts
    if Path(name).exists() or len(parts) < 2 or parts[0] != "configs":
        return name
    candidate = shipped_configs().joinpath(*parts[1:])
    return str(candidate) if candidate.is_file() else name
