"""Opening checkpoints written by ``lilicorr fit``: weights-only, integrity-checked, never running code.

Checkpoints travel (people share and download drafters), so every load of a user-supplied ``.ckpt``
goes through :func:`read_checkpoint`:

- ``torch.load(weights_only=True)``: tensors and plain containers only; a pickled object (whose
  ``__reduce__`` could run anything) is refused before it is built;
- a SHA-256 of the trainable state recorded at save time is checked, and another of the records (hyper-parameters,
  data settings, the training record), so a flipped byte is refused instead of being benchmarked, exported or
  trained on; a resumed fit also checks a third, of the training state it restores (the optimizer's moments, the
  loops', callbacks' and data loader's positions, the random streams);
- every name a checkpoint gives that jsonargparse would import (``class_path`` of drafter, head, losses, optimizer,
  scheduler, and any other dotted name in their options) must live in trusted packages: naming a module makes
  jsonargparse import it, which runs its code;
- ``trust_remote_code`` is never taken from a checkpoint, nor are target load options that fetch code (hub
  kernels): only the user's own flag for this run enables them, and a checkpoint trained with them is refused until
  the user passes that flag.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import pickle
import re
import signal
import threading
import warnings
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from lilicorr_pl.files import file_state

CHECKSUM_KEY = "state_sha256"
# Packages whose classes a checkpoint may name; anything else needs the user's explicit allowance.
TRUSTED_MODULES = ("lilicorr_pl.", "callbacks.", "torch.optim.", "lightning.pytorch.")


def first_line(err: BaseException, with_type: bool = False) -> str:
    """The first line of an exception's message, for a one-line error that quotes a library's; the exception type's
    name where the message is empty (``with_type``: ``"OSError: <line>"``, the name alone without a line)."""
    line = (str(err).strip().splitlines() or [""])[0]
    if with_type:
        return f"{type(err).__name__}: {line}" if line else type(err).__name__
    return line or type(err).__name__


class UserInputError(ValueError):
    """A setting, file or checkpoint given by the user that cannot be used; the message names the fix.

    Commands print it as one line (exit status 2) instead of a traceback."""


class StoppedBySignal(SystemExit):
    """A run stopped by SIGTERM before its end (a cancelled or preempted job): exit status 128 + 15 = 143, what a
    shell reports for a process ended by that signal, so no scheduler or script reads the stop as a finished run.

    A ``SystemExit`` like Lightning's own ``SIGTERMException``, which it replaces: Lightning raises that one without
    a status, i.e. exit status 0 (Lightning issue #19916)."""

    def __init__(self, what: str, signum: int = signal.SIGTERM) -> None:
        super().__init__(128 + signum)  # 143; 130 for a fit stopped by Ctrl-C (SIGINT), which saves the same way
        self.what = what  # what stopped, for the command's one line ("training at step 4 of 8")


@contextlib.contextmanager
def stop_on_sigterm(what: str = "stopped by SIGTERM") -> Iterator[None]:
    """Inside the block SIGTERM raises :class:`StoppedBySignal` (``what``), so a cancelled job unwinds like Ctrl-C:
    every ``finally`` runs and the command says in one line how to go on (Python's default ends the process without a
    word). A no-op outside the main thread, where no handler can be set; the previous handler is restored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise StoppedBySignal(what)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:  # None: a handler set from C, which Python cannot put back; the default is the closest
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


class CheckpointError(UserInputError):
    """A checkpoint that cannot be used safely: unreadable, corrupted, or asking for code to run."""


def state_checksum(state_dict: Mapping[str, Any]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in key order."""
    digest = hashlib.sha256()
    for key in sorted(state_dict):
        value = state_dict[key]
        if not torch.is_tensor(value):
            continue
        t = value.detach().cpu().contiguous()
        digest.update(f"{key}|{t.dtype}|{tuple(t.shape)}\n".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


RECORD_CHECKSUM_KEY = "record_sha256"
# What a checkpoint records besides its weights, and what commands read from it: how to rebuild the system, the data
# settings, and the training record (target layers, block size, mask token, thinking flag, data files, ...).
_RECORDS = ("hyper_parameters", "datamodule_hyper_parameters", "lilicorr")


def _plain_record(value: Any) -> Any:
    """``value`` as JSON takes it, the same for the same record before a save and after a weights-only load: mappings
    with their keys as text, tuples as lists, anything else (a dtype) by its ``repr``."""
    if isinstance(value, Mapping):
        return {str(k): _plain_record(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_record(v) for v in value]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    return repr(value)


def record_checksum(checkpoint: Mapping[str, Any]) -> str:
    """SHA-256 over a checkpoint's records (:data:`_RECORDS`, this checksum itself left out), as canonical JSON: what
    :func:`state_checksum` is for the weights, for the settings an export hands to an engine and a resume compares."""
    parts = {key: checkpoint.get(key) for key in _RECORDS}
    parts["lilicorr"] = {k: v for k, v in (parts["lilicorr"] or {}).items() if k != RECORD_CHECKSUM_KEY}
    text = json.dumps(_plain_record(parts), sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


TRAINING_CHECKSUM_KEY = "training_state_sha256"
TRAINING_KEYS_KEY = "training_state_keys"
"""The record's list of the checkpoint entries :data:`TRAINING_CHECKSUM_KEY` covers."""
# Besides the weights and records: the Lightning version that wrote the file, which Lightning's migration of an older
# checkpoint rewrites in memory (noting the old one under the legacy key).
_LEGACY_VERSION = "legacy_pytorch-lightning_version"
_NOT_TRAINING_STATE = frozenset({"state_dict", *_RECORDS, "pytorch-lightning_version", _LEGACY_VERSION})


def training_state_keys(checkpoint: Mapping[str, Any]) -> list[str]:
    """The entries of ``checkpoint`` that hold what a resumed fit restores besides the weights and the records."""
    return sorted((k for k in checkpoint if k not in _NOT_TRAINING_STATE), key=repr)


def training_state_checksum(checkpoint: Mapping[str, Any], keys: Iterable[str] | None = None) -> str:
    """SHA-256 over what a resumed fit restores besides the weights and the records: the entries ``keys`` (default:
    :func:`training_state_keys`: the loops' and callbacks' states, the optimizers' and schedulers', the data module's
    loader position, the random streams, the epoch and step), in a canonical form that reads the same before a save
    and after a weights-only load, in any process (tensors by dtype, shape and bytes; mappings by their items, keys
    sorted; sets by their items' sorted digests; other plain values by their ``repr``)."""
    digest = hashlib.sha256()
    for key in training_state_keys(checkpoint) if keys is None else keys:
        _feed(digest, key)
        _feed(digest, checkpoint[key])
    return digest.hexdigest()


def _feed(digest: Any, value: Any) -> None:
    if torch.is_tensor(value):
        t = value.detach().cpu().contiguous()
        digest.update(f"T{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            digest.update(t.reshape(-1).view(torch.uint8).numpy())  # (its buffer: no copy)
    elif isinstance(value, Mapping):
        digest.update(f"{{{len(value)}|".encode())
        for key in sorted(value, key=repr):
            _feed(digest, key)
            _feed(digest, value[key])
    elif isinstance(value, (list, tuple)):  # (one form: a container's kind is not state)
        digest.update(f"[{len(value)}|".encode())
        for item in value:
            _feed(digest, item)
    elif isinstance(value, (set, frozenset)):  # its repr's order is the process's string hashing's
        parts = []
        for item in value:
            part = hashlib.sha256()
            _feed(part, item)
            parts.append(part.hexdigest())
        digest.update(f"<{len(parts)}|{''.join(sorted(parts))}".encode())
    else:
        text = repr(value).encode("utf-8", "surrogatepass")
        digest.update(f"r{len(text)}|".encode() + text)


def verify_training_state(checkpoint: Mapping[str, Any], path: str | Path | None = None) -> None:
    """Raise when the training state a resumed fit restores differs from the checksum recorded at save time
    (:func:`training_state_checksum`). Not checked: a checkpoint written before it was recorded, one Lightning has
    migrated from an older version's form in memory (the file itself is checked, before Lightning reads it), and one
    whose strategy keeps entries the checksum covered outside the file (a sharded optimizer state)."""
    record = _lilicorr_record(checkpoint, path)
    recorded, keys = record.get(TRAINING_CHECKSUM_KEY), record.get(TRAINING_KEYS_KEY)
    if recorded is None or _LEGACY_VERSION in checkpoint:
        return
    if keys is not None and (not isinstance(keys, list) or any(k not in checkpoint for k in keys)):
        return
    if training_state_checksum(checkpoint, keys) == recorded:
        return
    raise CheckpointError(
        f"{_where(path)} is corrupted: its training state (the optimizer's moments, the loops', callbacks' and data "
        "loader's positions, the random streams) does not match the checksum recorded when it was saved; resume from "
        "another checkpoint, or export its weights (lilicorr export, which checks them) and start a new run from them "
        "(--model.init_drafter_from)"
    )


def _where(path: str | Path | None) -> str:
    """How a refusal names the checkpoint: by its path where it has one."""
    return f"checkpoint {path}" if path is not None else "the checkpoint"


def _lilicorr_record(checkpoint: Mapping[str, Any], path: str | Path | None) -> Mapping[str, Any]:
    """The checkpoint's ``lilicorr`` record (empty where it has none), or one line naming a record of another form."""
    record = checkpoint.get("lilicorr")
    if record is None:
        return {}
    if not isinstance(record, Mapping):
        raise CheckpointError(f"{_where(path)} is not a lilicorr fit checkpoint: its lilicorr record is a "
                              f"{type(record).__name__}, not a mapping; pass a .ckpt that lilicorr fit wrote")
    return record


def not_a_checkpoint_file(path: Path) -> str:
    """The message for a ``--ckpt`` that exists and is no file: a run's folder, a served export, or anything else."""
    if (path / "config.json").is_file():
        return (f"checkpoint {path} is a served drafter directory, not a training checkpoint; pass a .ckpt written by "
                "`lilicorr fit` (a served drafter warm-starts a fit: --model.init_drafter_from)")
    found = sorted([*path.glob("last*.ckpt"), *path.glob("checkpoints/last*.ckpt")])[:1] if path.is_dir() else []
    example = f" (such as {found[0]})" if found else ""
    return f"checkpoint {path} is a directory; pass a .ckpt file written by `lilicorr fit`{example}"


def check_checkpoint_file(path: Path) -> None:
    """Raise ``CheckpointError`` (one line) for a ``--ckpt`` that is missing, no file, or empty."""
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist; pass a .ckpt written by `lilicorr fit`")
    if not path.is_file():
        raise CheckpointError(not_a_checkpoint_file(path))
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes); it was not written completely")


def _unpickler_reason(err: Exception) -> str:
    """What torch's weights-only unpickler refused (``Unsupported global: GLOBAL …``, ``Trying to load unsupported
    GLOBAL posix.system whose module posix is blocked``, ``Unsupported operand 130``), from its long message, which
    wraps the reason in advice to load the file unsafely (in terminal bold codes): that advice is never quoted."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err))
    advice = ("weights_only", "two options", "Please file an issue", "Check the documentation")
    for line in text.splitlines():
        line = line.replace("Weights only load failed.", "").replace("WeightsUnpickler error:", "").strip()
        if line and not any(a in line for a in advice):
            return line.split(" Please use")[0][:200]
    return "an object torch's weights-only loader does not allow"


def read_checkpoint(path: str | Path, verify: bool = True) -> dict[str, Any]:
    """Load a checkpoint weights-only (memory-mapped) and, with ``verify``, check its recorded checksum."""
    path = Path(path)
    check_checkpoint_file(path)
    try:
        checkpoint = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"checkpoint {path} holds pickled objects that are not plain data and was refused (opening it "
            f"could run code): {_unpickler_reason(err)}"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as err:
        raise CheckpointError(
            f"checkpoint {path} is truncated or not a torch checkpoint ({type(err).__name__}); "
            "re-save it or use another checkpoint"
        ) from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(f"checkpoint {path} has no state_dict; is it a `lilicorr fit` checkpoint?")
    if verify:
        verify_checksum(checkpoint, path, records=True)
    return checkpoint


# The checkpoint file a command verified when it first opened it (before anything was built: Lightning loads the
# target in configure_model before on_load_checkpoint sees the checkpoint), so that second look at the same file,
# unchanged since, does not hash the weights again: (recorded checksum, path, the file's stat at the first read).
_verified_first: contextvars.ContextVar[tuple[Any, str, tuple[int, ...]] | None] = contextvars.ContextVar(
    "lilicorr_verified_first", default=None)


def read_verified(path: str | Path) -> tuple[dict[str, Any], tuple[Any, str, tuple[int, ...]]]:
    """:func:`read_checkpoint` with its checksum verified, and what :func:`verified_first` needs to spare the same
    file, unchanged since it was stat'ed before this read, a second hash."""
    check_checkpoint_file(Path(path))
    state = file_state(path)
    checkpoint = read_checkpoint(path)
    return checkpoint, ((checkpoint.get("lilicorr") or {}).get(CHECKSUM_KEY), str(path), state)


@contextlib.contextmanager
def verified_first(first: tuple[Any, str, tuple[int, ...]] | None) -> Iterator[None]:
    """Within the block, a checkpoint recording the checksum of ``first`` (from :func:`read_verified`) is not hashed
    again by :func:`verify_checksum` while that file is unchanged. None: the block changes nothing."""
    token = _verified_first.set(first)
    try:
        yield
    finally:
        _verified_first.reset(token)


def _verified_already(expected: Any) -> bool:
    first = _verified_first.get()
    if first is None or first[0] != expected:
        return False
    try:
        return file_state(first[1]) == first[2]
    except OSError:
        return False


def verify_checksum(checkpoint: Mapping[str, Any], path: str | Path | None = None, records: bool = False,
                    training: bool = False) -> None:
    """Raise when the state dict differs from the checksum recorded at save time (unless it is the file a command
    verified when it first opened it, unchanged since: :func:`verified_first`); with ``records``, also when the
    checkpoint's records do (:func:`record_checksum`; a checkpoint as read from its file: Lightning's
    ``load_from_checkpoint`` writes its keyword arguments into the hyper-parameters before the hooks see them); with
    ``training``, also when the training state a resumed fit restores does (:func:`verify_training_state`)."""
    record = _lilicorr_record(checkpoint, path)
    expected = record.get(CHECKSUM_KEY)
    if _verified_already(expected):
        return
    where = _where(path)
    recorded = record.get(RECORD_CHECKSUM_KEY)  # absent: written before it was recorded
    if training:
        verify_training_state(checkpoint, path)
    if records and recorded is not None and record_checksum(checkpoint) != recorded:
        raise CheckpointError(
            f"{where} is corrupted: its recorded settings (hyper-parameters, data settings or training record: the "
            "target's layers, the block size, the mask token, ...) do not match the checksum recorded when it was "
            "saved; use another checkpoint (nothing was loaded)"
        )
    if expected is None:
        warnings.warn(f"{where} records no checksum (written by an older lilicorr_pl); its integrity is not verified",
                      stacklevel=3)
        return
    if state_checksum(checkpoint["state_dict"]) != expected:
        raise CheckpointError(
            f"{where} is corrupted: its weights do not match the checksum recorded when it was saved; "
            "use another checkpoint (nothing was loaded)"
        )


# A string jsonargparse may import: a dotted Python name (``pkg.mod.obj``; it imports no name without a dot).
_IMPORTABLE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
# The system's options that hold plain data, never a name jsonargparse imports: the target (a model's name or folder,
# its dtype, layer ids), the warm starts' folders and the instantiator (checked on its own).
_PLAIN_DATA_KEYS = frozenset({"target", "init_drafter_from", "init_head_from", "_instantiator", "target_logits",
                              "disabled_losses"})  # loss names: text (``ce.v2``)


def _class_paths(value: Any, top: bool = True) -> Iterable[str]:
    """Every name in ``value`` that jsonargparse may import when it rebuilds the system: each ``class_path``, and any
    other string that reads as a Python name (a callable's or a class's argument given by its import path,
    ``lr_lambda: pkg.f``, or a component given as a bare class path, ``head: pkg.Head``: jsonargparse imports those
    too). The system's plain-data options (:data:`_PLAIN_DATA_KEYS`) are not read."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            if (top and key in _PLAIN_DATA_KEYS) or (key == "name" and isinstance(item, str)):  # a log name: text
                continue
            if key in ("class_path", "_class_path") and isinstance(item, str):
                yield item
            else:
                yield from _class_paths(item, top=False)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _class_paths(item, top=False)
    elif isinstance(value, str) and not top and _IMPORTABLE.match(value):
        yield value


def config_modules(config: Any) -> list[str]:
    """The modules of every component a run's own config names (its ``class_path`` values). The user chose them and
    the run imports them anyway; trusting a module also trusts its submodules (prefix match), as ``--allow-module``
    trusts a package."""
    return sorted({p.rpartition(".")[0] for p in _class_paths(config) if "." in p})


def check_class_paths(hparams: Mapping[str, Any], path: str | Path, allow: Iterable[str] = (),
                      fix: str = "allow the package explicitly (--allow-module NAME)") -> None:
    """Refuse components outside the trusted packages (plus the ``allow``-ed modules): importing a named module runs
    its code. ``fix`` is the command's way to allow one."""
    trusted = tuple(TRUSTED_MODULES) + tuple(f"{a.rstrip('.')}." for a in allow)
    bad = sorted({p for p in _class_paths(hparams) if not p.startswith(trusted)})
    if bad:
        raise CheckpointError(
            f"checkpoint {path} names components outside the trusted packages: {bad}; importing them would run "
            f"their code. If you trust this checkpoint, {fix}"
        )


# from_pretrained options that fetch or run code from elsewhere: the ``kernels`` hub (compiled kernels of any repo).
_CODE_LOAD_KWARGS = ("use_kernels", "kernel_config", "allow_all_kernels", "code_revision")


def code_load_kwargs(load_kwargs: Mapping[str, Any] | None) -> list[str]:
    """The options of ``model.target.load_kwargs`` that load code from elsewhere: the kernels options, and an
    ``attn_implementation`` naming a hub repository (``org/name``: transformers downloads and loads its kernel)."""
    load_kwargs = load_kwargs if isinstance(load_kwargs, Mapping) else {}
    found = [k for k in _CODE_LOAD_KWARGS if load_kwargs.get(k) not in (None, False)]
    attention = load_kwargs.get("attn_implementation")
    if isinstance(attention, str) and "/" in attention:
        found.append(f"attn_implementation: {attention}")
    return found


def check_remote_code(target_hparams: Mapping[str, Any] | None, allowed: bool, path: str | Path, flag: str) -> None:
    """A checkpoint trained with ``trust_remote_code``, or with target load options that load code from elsewhere
    (:func:`code_load_kwargs`), is refused until the user passes ``flag`` for this run."""
    if target_hparams and target_hparams.get("trust_remote_code") and not allowed:
        raise CheckpointError(
            f"checkpoint {path} was trained with a target that needs trust_remote_code "
            f"({target_hparams.get('name_or_path')!r}); remote code is never enabled from a checkpoint: "
            f"pass {flag} if you trust that target's code"
        )
    fetched = code_load_kwargs((target_hparams or {}).get("load_kwargs"))
    if fetched and not allowed:
        raise CheckpointError(
            f"checkpoint {path} loads its target with options that fetch and run code from elsewhere "
            f"(model.target.load_kwargs: {', '.join(fetched)}); code is never loaded on a checkpoint's word: pass "
            f"{flag} if you trust it"
        )
