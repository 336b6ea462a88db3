"""Writing results safely: output paths checked before any work, JSON written atomically.

Shared by every command that writes results (``bench``, ``export``, ``demo``, ``regenerate``), so each
refuses an unwritable destination the same way, before heavy work, and never leaves a half-written file.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
import socket
import tempfile
import uuid
from pathlib import Path
from typing import Any


def jsonable(value: Any) -> Any:
    """NaN/inf (undefined statistics, e.g. a position no round reached) become JSON ``null``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def check_output_paths(output: str | None, plot: str | None, output_flag: str = "--output", plot_flag: str = "--plot",
                       plot_fix: str = "pass a directory for the PNGs") -> None:
    """Raise ``ValueError`` when results could not be written, before any benchmark work starts, or would replace a
    file that is not a results file of this tool (:func:`written_by_lilicorr`): a rerun may replace its own results,
    never a user's file (``output_flag`` / ``plot_flag``: what named ``output`` / ``plot``, and ``plot_fix`` the fix,
    for the messages)."""
    if output:
        out = Path(output)
        if out.is_dir():
            raise ValueError(f"{output_flag} {out} is a directory; pass a file name such as {out / 'results.json'}")
        if out.exists() and not written_by_lilicorr(out):
            raise ValueError(f"{output_flag} {out} exists and is not a results file lilicorr wrote, so it is not "
                             "overwritten; choose another file name")
        check_writable_dir(out.parent, f"{output_flag} {out}")
    if plot:
        directory = Path(plot)
        if directory.exists() and not directory.is_dir():
            raise ValueError(f"{plot_flag} {directory} is a file; {plot_fix}")
        check_writable_dir(directory, f"{plot_flag} {directory}")


def check_writable_dir(directory: Path, what: str) -> None:
    """Raise ``ValueError`` unless ``directory`` exists or can be created, and is writable (``what`` names it)."""
    probe = directory
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"{what}: {probe} is a file, so the directory cannot be created; choose another path")
    if not os.access(probe, os.W_OK):
        raise ValueError(f"{what}: {probe} is not writable; choose another path")


WRITTEN_BY = "written_by"
"""The key of a results file that names the command and version that wrote it (:func:`write_results_json`)."""
# What every results file of an earlier version (before WRITTEN_BY) holds: bench and demo say whether τ includes the
# bonus token; perf's step timing, penalty check, round timing and cost model their own totals.
_LEGACY_RESULTS_KEYS = ({"tau_includes_bonus_token"}, {"step_total"}, {"penalty_exact", "penalty_cache"},
                        {"plain_step_ms", "arms"}, {"ops", "device", "settings"})


def written_by_lilicorr(path: Path) -> bool:
    """Whether ``path`` may be replaced as this tool's results: an empty file, a JSON results file naming ``lilicorr``
    under :data:`WRITTEN_BY`, or a bench, demo or perf results file of an earlier version."""
    try:
        size = path.stat().st_size
        if size == 0:  # nothing to lose (``mktemp``)
            return True
        if size > 1 << 30:
            return False
        with open(path, encoding="utf-8") as fh:
            payload = json.load(fh)
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    if not isinstance(payload, dict):
        return False
    if str(payload.get(WRITTEN_BY, "")).startswith("lilicorr "):
        return True
    runs = payload.get("runs") if isinstance(payload.get("runs"), list) else [payload]
    return bool(runs) and all(isinstance(run, dict) and any(keys <= run.keys() for keys in _LEGACY_RESULTS_KEYS)
                              for run in runs)


def write_results_json(path: Path, payload: dict[str, Any], command: str) -> None:
    """A command's results (``bench --output``, ``demo --output``, ``perf --json``), atomically, saying what wrote
    them (``"written_by": "lilicorr <command> <version>"``) so a rerun may replace them and nothing else."""
    from lilicorr_pl import __version__

    write_json_atomic(path, {WRITTEN_BY: f"lilicorr {command} {__version__}", **jsonable(payload)})


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write JSON under a temporary name beside ``path`` and rename it into place; never leave the temp file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(payload, fh, indent=2)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def writer_tag() -> str:
    """``w@<host>@<pid>@<rand>``: put in a temporary file's or directory's name, it says which process is writing it,
    so a clean-up of killed writers' leftovers (:func:`writer_is_gone`) never removes a live writer's. ``@`` is in no
    host name, so the host is read whole (host names hold dots and hyphens, and one host's name can end another's)."""
    return f"w@{socket.gethostname()}@{os.getpid()}@{uuid.uuid4().hex[:8]}"


_WRITER = re.compile(r"w@([^@/]+)@(\d+)@[^@/]+\.tmp$")


def writer_is_gone(tmp: Path) -> bool:
    """Whether the process that named ``tmp`` (``….<writer_tag()>.tmp``) has exited.

    A writer on this host is checked by its pid; one on another host (a cache on a shared file system) counts as gone
    after a day. A name without a writer tag was not written this way, and counts as gone."""
    tag = _WRITER.search(tmp.name)
    try:
        if tag is None:
            return True
        if tag.group(1) == socket.gethostname():
            os.kill(int(tag.group(2)), 0)
            return False
        return (_dt.datetime.now().timestamp() - tmp.stat().st_mtime) > 86400
    except (ValueError, ProcessLookupError, FileNotFoundError):
        return True
    except PermissionError:  # alive, owned by someone else
        return False
