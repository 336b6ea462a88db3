"""Host memory reused across steps: glibc's malloc told to keep what a step frees for the next step.

A training step allocates and frees the same large tensors every step (in the demo's head stage, the lattice's
``[blocks, heads, nodes, nodes]`` attention scores: 30 MB each, several a step). glibc's malloc gives freed memory
at the top of its heap back to the system once more than its trim threshold is free there: 128 KiB, raised by its
own adjustment to at most 64 MiB. A step frees more than that at its end, so the next step writes to fresh pages
again and the kernel zero-fills each on its first touch: about 19,000 page faults a step in the demo's head stage.
With the trim threshold at 1 GiB (and the mmap threshold at 32 MiB, its largest on a 64-bit system, which fixing
the trim threshold requires: it turns glibc's adjustment of both off), a step's memory stays in the heap and is
reused: the same numbers, with 60 % fewer page faults and half the system time (README, "Training step").

``lilicorr`` sets this at its start, on Linux with glibc, and exports it to the processes it starts (the demo's
background stages, Lightning's launched ranks, data-loader workers); it leaves malloc alone where the user tuned it
(``MALLOC_*_`` variables or ``glibc.malloc`` tunables) or opted out (``LILICORR_MALLOC=default``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from collections.abc import Callable, MutableMapping
from typing import Any

from lilicorr_pl.checkpoint import UserInputError

MMAP_THRESHOLD = 32 * 2**20
"""Blocks below this come from the heap and are reused; glibc's largest allowed value on a 64-bit system."""
TRIM_THRESHOLD = 2**30
"""Free memory at the heap's top kept for reuse before it goes back to the system."""
OPT_OUT = "LILICORR_MALLOC"
"""``LILICORR_MALLOC=default``: leave glibc's malloc as it is."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_USER_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold", "glibc.malloc.top_pad",
                  "glibc.malloc.mmap_max")  # the same four settings under their other spelling
_EXPORTED = {"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD, "MALLOC_TRIM_THRESHOLD_": TRIM_THRESHOLD}

_applied: dict[str, Any] | None = None  # what reuse_freed_memory decided in this process


def _glibc_malloc() -> tuple[Callable[[int, int], int] | None, str | None]:
    """glibc's ``mallopt``, or None and why: no glibc, or another malloc in use (``LD_PRELOAD`` of jemalloc,
    tcmalloc or mimalloc: glibc's thresholds would then tune an allocator that serves nothing)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None, "no glibc"
    try:
        process, libc = ctypes.CDLL(None), ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if _malloc_interposed(process, libc):
            return None, "another malloc is in use (LD_PRELOAD)"
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None, "no glibc"
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt, None


def _malloc_interposed(process: ctypes.CDLL, libc: ctypes.CDLL) -> bool:
    """Whether the process's ``malloc`` is not the C library's own (a preloaded allocator interposes it)."""
    return ctypes.cast(process.malloc, ctypes.c_void_p).value != ctypes.cast(libc.malloc, ctypes.c_void_p).value


def _user_tuned(environ: MutableMapping[str, str]) -> dict[str, str]:
    tuned = {name: environ[name] for name in _USER_SETTINGS if environ.get(name)}
    if any(name in environ.get("GLIBC_TUNABLES", "") for name in _USER_TUNABLES):
        tuned["GLIBC_TUNABLES"] = environ["GLIBC_TUNABLES"]
    return tuned


def _opted_out(environ: MutableMapping[str, str]) -> bool:
    value = environ.get(OPT_OUT, "").strip()
    if value not in ("", "default"):
        raise UserInputError(f"{OPT_OUT}={value!r} is not a setting; set {OPT_OUT}=default to leave glibc's malloc as it "
                         "is, or unset it")
    return value == "default"


def _standing(environ: MutableMapping[str, str], mallopt: Callable[[int, int], int] | None,
              why: str | None) -> dict[str, Any] | None:
    """What holds without lilicorr's setting: no usable glibc malloc, the user's own tuning (applied by glibc at this
    process's start, and left as it is), or None: glibc's defaults, which :func:`reuse_freed_memory` replaces."""
    if mallopt is None:
        return {"policy": "unavailable", "why": why}
    tuned = _user_tuned(environ)
    return {"policy": "environment", "settings": tuned} if tuned else None


def policy(environ: MutableMapping[str, str] | None = None) -> dict[str, Any]:
    """What this process's malloc does with freed blocks, for a results file: ``{"policy": ..., ...}``.

    ``policy`` is ``lilicorr`` (:func:`reuse_freed_memory` set it here), ``environment`` (the variables or tunables
    this process started with: the user's, or the ones a ``lilicorr`` parent exported), ``default`` (glibc's own)
    or ``unavailable`` (no glibc, or another malloc), with why.
    """
    if _applied is not None:
        return dict(_applied)
    return _standing(os.environ if environ is None else environ, *_glibc_malloc()) or {"policy": "default"}


def reuse_freed_memory(environ: MutableMapping[str, str] | None = None,
                       mallopt: Callable[[int, int], int] | None = None) -> dict[str, Any]:
    """Keep freed blocks of up to 32 MiB in the heap for reuse, in this process and the ones it starts.

    Does nothing where the user tuned malloc themselves or set ``LILICORR_MALLOC=default``, without glibc, or under
    another malloc. Returns what it decided, which :func:`policy` reports from then on. ``environ`` and ``mallopt``
    are for tests (default: ``os.environ`` and glibc's). Raises ``UserInputError`` for another ``LILICORR_MALLOC``.
    """
    global _applied
    environ = os.environ if environ is None else environ
    if _opted_out(environ):
        decided: dict[str, Any] | None = {"policy": "default", "opted_out": f"{OPT_OUT}=default"}
    else:
        why = None
        if mallopt is None:
            mallopt, why = _glibc_malloc()
        decided = _standing(environ, mallopt, why)
    if decided is None:
        # Threshold first: setting either turns off glibc's own adjustment of both.
        if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
            decided = {"policy": "unavailable", "why": "glibc refused the thresholds"}
        else:
            for name, value in _EXPORTED.items():  # processes started from here begin with the same policy
                environ[name] = str(value)
            decided = {"policy": "lilicorr", "mmap_threshold": MMAP_THRESHOLD, "trim_threshold": TRIM_THRESHOLD}
    _applied = decided
    return dict(decided)
