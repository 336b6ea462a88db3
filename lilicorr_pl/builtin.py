"""Built-in targets and data that need no download (``builtin:`` names in configs).

- ``builtin:tiny`` / ``builtin:quick`` / ``builtin:full``: a small Qwen3-architecture target trained on
  the Python standard library (see :mod:`lilicorr_pl.demo.tiny_target`), built once and cached.
- ``builtin:stdlib-train[:N]`` / ``builtin:stdlib-heldout[:N]`` as a data file: ``N`` text records cut
  from the standard library's own source (train or held-out modules), written once as jsonl.

Everything resolves to ordinary local paths, so the rest of the code only sees ``from_pretrained``
directories and jsonl files. This is a command-line-edge module: the ``lilicorr`` command resolves the
names here, after parsing and before any object is built (a build can take 20 minutes, and shows its
progress); the core (system, target, data module) refuses a ``builtin:`` name instead of building it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from lilicorr_pl.checkpoint import UserInputError
from lilicorr_pl.files import atomic_file, cache_root, check_writable_dir
from lilicorr_pl.target import BUILTIN_PREFIX as PREFIX
from lilicorr_pl.target import builtin_artifact

# builtin name -> tiny-target preset (tiny: seconds, quick: minutes, full: the demo's ~25-minute build)
TARGET_PRESETS = {"tiny": "test", "quick": "quick", "full": "full"}
DATA_CHARS = 2000  # characters per record of a built-in data file


def is_builtin(name: str) -> bool:
    return str(name).startswith(PREFIX)


def resolve_target_path(name_or_path: str, progress: bool = False) -> str:
    """Map ``builtin:<preset>`` to a built (cached) local target directory; pass anything else through.

    ``progress`` prints the build's stages and a training bar to stderr (a cached build prints one line).
    """
    if not str(name_or_path).startswith(PREFIX):
        return str(name_or_path)
    from lilicorr_pl.demo.tiny_target import build_tiny_target

    return str(build_tiny_target(_preset(name_or_path), progress=progress))


def _preset(name: str) -> str:
    preset = str(name)[len(PREFIX):]
    if preset not in TARGET_PRESETS:
        raise ValueError(
            f"unknown built-in target {name!r}; use one of {[PREFIX + p for p in TARGET_PRESETS]} or a hub name / "
            "local path"
        )
    return TARGET_PRESETS[preset]


def unbuilt_target_config(name: str) -> Any:
    """The model config (``Qwen3Config``) a ``builtin:`` target will have, while it is not built: ``None`` once it is,
    and for any other name. A command checks its settings against it before starting a build of minutes."""
    if not is_builtin(name):
        return None
    from lilicorr_pl.demo.tiny_target import unbuilt_model_config

    return unbuilt_model_config(_preset(name))


def target_folder(name: str) -> str:
    """The folder a ``builtin:`` target's build is (or will be) published at, without building it."""
    from lilicorr_pl.demo.tiny_target import build_folder

    return str(build_folder(_preset(name)))


def resolve_target_option(target: str, flag: str = "--target") -> str:
    """A command's target option (bench, export): ``builtin:<preset>`` built or found cached, as ``fit`` resolves it;
    an unknown preset is the user's error, in one line naming ``flag``."""
    from lilicorr_pl.checkpoint import UserInputError

    try:
        return resolve_target_path(target, progress=True)
    except ValueError as err:
        raise UserInputError(f"{flag}: {err}") from None


_SPLITS = {"stdlib-train": "train", "stdlib-heldout": "heldout"}


def _data_place(path: str, chars_per_record: int) -> tuple[str, int, Path]:
    """A ``builtin:stdlib-<split>[:N]`` name's split, record count and cached file (built or not)."""
    spec = str(path)[len(PREFIX):]
    name, _, count = spec.partition(":")
    if name not in _SPLITS:
        raise ValueError(f"unknown built-in data {path!r}; use builtin:stdlib-train[:N] or builtin:stdlib-heldout[:N]")
    if count and not (count.isdigit() and int(count) > 0):
        raise ValueError(f"built-in data {path!r}: the record count after ':' must be a positive integer")
    n = int(count) if count else 256
    from lilicorr_pl.data.corpus import corpus_fingerprint

    return _SPLITS[name], n, cache_root() / "data" / f"{name}-{n}-{chars_per_record}-{corpus_fingerprint()[:12]}.jsonl"


def builtin_name_of(path: str) -> str | None:
    """The ``builtin:`` name whose build on this machine has the key-bearing name of ``path`` (a built-in target's
    folder or data file, as another machine's run recorded it), or ``None``: naming it builds the same artifact here.
    A build key this version would not make (another torch, another standard library) has none."""
    name = builtin_artifact(path)
    if name is None:
        return None
    if name.endswith(".jsonl"):
        split, count, chars = name.split("-")[1:4]
        candidate = f"{PREFIX}stdlib-{split}:{count}"
        return candidate if chars == str(DATA_CHARS) and _data_place(candidate, DATA_CHARS)[2].name == name else None
    for short, preset in TARGET_PRESETS.items():
        if name.startswith(f"tiny-target-{preset}-") and Path(target_folder(PREFIX + short)).name == name:
            return PREFIX + short
    return None


def resolve_data_file(path: str, chars_per_record: int = DATA_CHARS) -> str:
    """Map ``builtin:stdlib-<split>[:N]`` to a cached jsonl of ``{"text": ...}`` records. The cached file is compared
    with the records it caches (cut from the corpus in milliseconds): a damaged or edited copy is written again, with
    a note, where it was used as it stood (a truncated one trained on fewer records under the built-in name)."""
    if not str(path).startswith(PREFIX):
        return str(path)
    split, n, out = _data_place(path, chars_per_record)
    expected = _data_bytes(split, n, chars_per_record)
    if out.is_file() and out.read_bytes() == expected:  # a link to a shared copy that holds them too
        return str(out)
    if out.is_symlink() or out.exists() and not out.is_file():  # the user's: never replaced
        what = (f"a symbolic link that does not hold the records of {path}" if out.is_symlink() else
                f"not a file, where lilicorr caches {path}")
        raise UserInputError(f"{out} is {what}; move it out of the cache folder (LILICORR_CACHE), then rerun")
    if out.is_file():
        print(f"lilicorr: {out} does not hold the records of {path} (damaged or edited); it is written again",
              file=sys.stderr)
    try:  # a cache folder that is a file (or not writable) was a traceback at the mkdir
        check_writable_dir(out.parent, f"the cache folder (LILICORR_CACHE) {out.parent}")
    except ValueError as err:
        raise UserInputError(str(err)) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out, "wb") as fh:  # a concurrent reader never sees half a file
        fh.write(expected)
    return str(out)


def _data_bytes(split: str, n: int, chars_per_record: int) -> bytes:
    """The jsonl a built-in data file holds: up to ``n`` records of ``chars_per_record`` characters cut from the
    split's files in order (a chunk of mostly whitespace skipped)."""
    from lilicorr_pl.data.corpus import read_corpus

    records: list[str] = []
    for text in read_corpus(split):  # type: ignore[arg-type]
        for start in range(0, len(text), chars_per_record):
            chunk = text[start : start + chars_per_record]
            if len(chunk.strip()) > chars_per_record // 4:
                records.append(json.dumps({"text": chunk}) + "\n")
            if len(records) >= n:
                break
        if len(records) >= n:
            break
    return "".join(records).encode()
