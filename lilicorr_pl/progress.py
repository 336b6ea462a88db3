"""Progress that reads well on a terminal and in a log file.

On a terminal the bars are tqdm's and Lightning's rich bar, redrawn in place. Written to a file (``nohup``, a batch
job's log, a pipe), a redrawn bar is useless: tqdm's carriage returns and cursor moves pile up into one unreadable
line, and Lightning's rich bar shows nothing until the stage ends. There, :func:`progress_bar` writes one plain line
per update at most every :data:`LOG_INTERVAL` seconds, and ``lilicorr fit``'s bar
(:class:`lilicorr_pl.lightning_cli.LogProgressBar`) does the same for a Lightning fit.
"""

from __future__ import annotations

import re
import sys
from typing import IO, Any

LOG_INTERVAL = 30.0
"""Seconds between two progress lines in a log (the last update is always written)."""
_CONTROL = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # cursor moves and colours
_BAR = re.compile(r"\|[^|]*\|")  # the drawn bar of a tqdm line


def is_terminal(stream: IO[str] | None = None) -> bool:
    """Whether ``stream`` (stderr by default) is shown live: a terminal, or a Jupyter kernel's output (not a TTY, but
    tqdm draws a widget there)."""
    stream = sys.stderr if stream is None else stream
    if type(stream).__module__.startswith("ipykernel."):
        return True
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


class _LogLines:
    """A file for tqdm that turns each redraw into one line: carriage returns and cursor moves dropped, and a line
    that counts as far as the one before (``close`` redraws the last state) not written twice."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self._last = ""

    def write(self, text: str) -> None:
        for line in _CONTROL.sub("", text).replace("\r", "\n").split("\n"):
            line = line.rstrip()
            # The count without its times and rate, nor the bar drawn between "|"s, whose width follows theirs.
            count = _BAR.sub("|", line.rsplit(" [", 1)[0])
            if line.strip() and count != self._last:
                self.stream.write(line + "\n")
                self._last = count

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(*args: Any, file: IO[str] | None = None, **kwargs: Any) -> Any:
    """``tqdm(*args, **kwargs)`` on a terminal; in a log, one line per update every :data:`LOG_INTERVAL` s at most.

    ``file``: where it writes (stderr by default, as tqdm)."""
    from tqdm.auto import tqdm

    stream = sys.stderr if file is None else file
    if is_terminal(stream):
        return tqdm(*args, file=stream, **kwargs)
    kwargs.pop("position", None)  # nothing to position in a file: every bar writes whole lines
    kwargs.pop("dynamic_ncols", None)
    kwargs["mininterval"] = max(float(kwargs.get("mininterval", 0.1)), LOG_INTERVAL)
    kwargs.setdefault("ncols", 100)
    return tqdm(*args, file=_LogLines(stream), ascii=True, **kwargs)
