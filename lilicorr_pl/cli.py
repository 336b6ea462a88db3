"""The ``lilicorr`` command: one typed command line (jsonargparse) for every subcommand.

``fit``/``validate``/``test``/``predict`` are LightningCLI (:mod:`lilicorr_pl.lightning_cli`); ``prepare`` and
``perf`` use the same parser (``perf`` adds its own options); the other tools are typed functions whose
signatures and docstrings are their command lines (:mod:`lilicorr_pl.command`). Every subcommand has ``--help``, accepts ``-c/--config``, and rejects a
malformed value when it is parsed. A mistake in what the user gave (a setting, a file, a checkpoint) is one
line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import errno
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lilicorr_pl.checkpoint import StoppedBySignal, UserInputError, first_line
from lilicorr_pl.command import config_arguments, is_inline_config, run_function, shipped_config_path

LIGHTNING = {
    "fit": "train a drafter (and head) against the frozen target",
    "validate": "held-out losses and acceptance diagnostics of a checkpoint",
    "test": "LightningCLI's test loop (DraftDataModule has no test split: use validate)",
    "predict": "per-block teacher-forced diagnostics of the validation split",
}
# subcommand -> (module, function, one line for `lilicorr --help`). The function's signature and docstring are the
# subcommand's command line. To add one (e.g. `prepare`), add a line here: nothing else needs to change.
TOOLS: dict[str, tuple[str, str, str]] = {
    "prepare": ("lilicorr_pl.lightning_cli", "prepare_command",
                "precompute the data module's stores on every device (fit's parser)"),
    "perf": ("lilicorr_pl.perf", "main", "where the time goes: a training step, or the cost model of one round"),
    "bench": ("lilicorr_pl.bench", "bench", "real speculative-decoding benchmark of a trained checkpoint"),
    "export": ("lilicorr_pl.export", "export", "export a drafter (and LiLiCorr head) in the serving layout"),
    "regenerate": ("lilicorr_pl.data.regenerate", "regenerate_command",
                   "regenerate responses with the target as training data (resumable)"),
    "demo": ("lilicorr_pl.demo.run", "demo", "build a small target, train every arm, compare them with real decoding"),
    "build-target": ("lilicorr_pl.demo.tiny_target", "build_target", "build (or reuse) the built-in stdlib target"),
}
# How to go on after a command was stopped by SIGTERM (a cancelled or preempted job).
AFTER_A_STOP = {
    "fit": "; resume with the same command and --ckpt_path=last",
    "demo": "; rerun the same command: every finished stage is reused",
    "regenerate": "; rerun the same command: it goes on after the records already written",
}
# Tools whose function parses its own argv (a LightningCLI parser extended with its options) instead of run_function.
OWN_PARSER = ("prepare", "perf")
DESCRIPTION = (
    "Train and evaluate DFlash drafters with the LiLiCorr lattice-correction head. Every subcommand has its own "
    "--help, accepts -c/--config FILE.yaml, and checks its values before any work starts."
)


def tool_function(name: str) -> Callable[..., Any]:
    module, function, _ = TOOLS[name]
    return getattr(importlib.import_module(module), function)


def top_parser() -> Any:
    """``lilicorr --help``: every subcommand in the usage line, each with one plain line of description."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(prog="lilicorr", description=DESCRIPTION)
    subcommands = parser.add_subcommands(title="subcommands", dest="subcommand", metavar="{" + ",".join(
        [*LIGHTNING, *TOOLS]) + "}")
    for name, text in [*LIGHTNING.items(), *((n, t[2]) for n, t in TOOLS.items())]:
        subcommands.add_subcommand(name, ArgumentParser(description=text), help=text)
    return parser


def config_files(argv: Sequence[str]) -> list[str]:
    """``-c/--config`` values, with ``configs/...`` mapped to the shipped configs when no such file is here."""
    out = list(argv)
    for i, value in config_arguments(argv):
        out[i] = out[i][:len(out[i]) - len(value)] + shipped_config_path(value)  # the flag kept where the token has it
    return out


def check_config_files(argv: Sequence[str], sections: Sequence[str] = ()) -> None:
    """A missing or malformed YAML config is one line naming the file (jsonargparse would say ``<unicode string>``).
    ``sections``: keys whose text in a config names a file of that section's options (``model: model.yaml``, read
    relative to the config's folder): one that is not there is named with where it was looked for."""
    import yaml

    for _, text in config_arguments(argv):
        if is_inline_config(text):
            continue  # an inline YAML/JSON config, not a file
        path = Path(text)
        if not path.exists():
            raise UserInputError(f"config file {path} does not exist (-c/--config)")
        if not path.is_file():
            kind = "a directory" if path.is_dir() else "not a regular file"
            raise UserInputError(f"config file {path} is {kind}; pass a YAML file (-c/--config)")
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or first_line(err)
            raise UserInputError(f"config file {path} is not valid YAML: {problem}{where}") from None
        except UnicodeDecodeError as err:
            raise UserInputError(f"config file {path} is not UTF-8 text (byte {err.start})") from None
        if not isinstance(loaded, dict):  # jsonargparse: "Unexpected config: " and the whole usage
            what = "empty" if loaded is None else f"a YAML {type(loaded).__name__}, not a mapping of options"
            raise UserInputError(f"config file {path} is {what}; write its options as \"name: value\" lines "
                                 "(see the subcommand's --print_config), or drop -c/--config")
        for section in sections:
            value = loaded.get(section)
            if isinstance(value, str) and not is_inline_config(value) and not (path.parent / value).is_file():
                raise UserInputError(f"{section}: {value} in config file {path} names no file: a section's file is "
                                     f"read relative to its config's folder, and {path.parent / value} is not one; "
                                     f"fix the name, or write the {section} options there as a mapping")


def run(argv: Sequence[str]) -> Any:
    """Run one subcommand; a user's mistake raises ``UserInputError``."""
    name = argv[0] if argv else None
    if name in LIGHTNING or name in TOOLS:
        argv = config_files(argv)
        check_config_files(argv, ("model", "data") if name in LIGHTNING or name in OWN_PARSER else ())
    if name in LIGHTNING:
        from lilicorr_pl.lightning_cli import run_lightning

        return run_lightning(argv, description=f"lilicorr {name}: {LIGHTNING[name]}")
    if name in OWN_PARSER:
        return tool_function(name)(argv[1:])
    if name in TOOLS:
        return run_function(tool_function(name), argv[1:], prog=f"lilicorr {name}")
    top_parser().parse_args(list(argv))  # --help, or an unknown/missing subcommand: usage and exit status 2
    return None


def _out_of_space(err: BaseException) -> str | None:
    """`` writing PATH`` (or ``""``) when ``err``, or what caused it, is a full disk or quota; else None. safetensors
    reports one as its own error type, ``... (os error 28)``."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return f" writing {err.filename}" if err.filename else ""
        if type(err).__name__ == "SafetensorError" and f"(os error {errno.ENOSPC})" in str(err):
            return ""
        err = err.__cause__  # what raised it on purpose, not an error met while handling another
    return None


def main(args: Sequence[str] | None = None) -> Any:
    """Entry point of ``lilicorr`` and ``python -m lilicorr_pl``; tests call it with an argument list.

    Called with ``args`` it returns what the subcommand returned (the LightningCLI, a tool's results); from the
    console, an ``int`` a tool returns is the exit status.
    """
    argv = list(sys.argv[1:] if args is None else args)
    name = argv[0] if argv and not argv[0].startswith("-") else None
    try:
        if args is None:  # a command run from the shell (tests' in-process calls leave their process's malloc alone)
            from lilicorr_pl.allocator import reuse_freed_memory

            reuse_freed_memory()  # an unknown LILICORR_MALLOC is the user's error, answered below in one line
        result = run(argv)
    except UserInputError as err:
        # A user's mistake or an unsafe file: one line naming the problem and the fix, not a traceback.
        print(f"lilicorr{' ' + name if name else ''}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except StoppedBySignal as err:  # a cancelled or preempted run: say so, and how to go on (exit status 143; 130 Ctrl-C)
        print(f"lilicorr{' ' + name if name else ''}: {err.what}{AFTER_A_STOP.get(name or '', '')} (exit status "
              f"{err.code})", file=sys.stderr)
        raise SystemExit(err.code) from None
    except Exception as err:  # noqa: BLE001 - only a full disk is answered here; everything else is re-raised
        full = _out_of_space(err)
        if full is None:
            raise
        # A full disk is the machine's, not a bug: one line, naming where (what was being written was removed by its
        # atomic writer, and nothing of the user's was touched).
        print(f"lilicorr{' ' + name if name else ''}: error: no space left on the device{full}; free space there, or "
              "write elsewhere (--output, trainer.default_root_dir, data.cache_dir, LILICORR_CACHE)", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:  # Ctrl-C outside a fit's loop (which stops at a step's end): one line, not a traceback
        after = AFTER_A_STOP.get(name or "", "") if name != "fit" else ""
        print(f"\nlilicorr{' ' + name if name else ''}: interrupted (Ctrl-C){after} (exit status 130)", file=sys.stderr)
        raise SystemExit(130) from None
    if args is not None:
        return result
    return result if isinstance(result, int) else None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
