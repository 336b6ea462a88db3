"""LightningCLI for ``lilicorr fit/validate/test/predict`` (and the parser ``lilicorr perf`` extends).

``lilicorr fit -c configs/tiny.yaml`` trains; ``lilicorr fit -c base.yaml -c configs/ablations/no_distractor.yaml``
ablates by overlay; ``lilicorr fit -c base.yaml --print_config`` shows the resolved config.

This is the command-line edge of training, where what the user typed is checked before anything is built:
``builtin:`` names become local paths here (building the built-in target with visible progress if it is
missing), data files and the subcommand's data are checked, a resume checkpoint is opened safely and compared,
and a setting that a constructor or the Trainer rejects becomes one line (``UserInputError``, exit status 2).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, NamedTuple

from jsonargparse import Namespace
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback, instantiate_class
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lilicorr_pl import __version__, builtin
from lilicorr_pl.checkpoint import (CHECKSUM_KEY, CheckpointError, StoppedBySignal, UserInputError, check_class_paths,
                                    config_modules, first_line, read_verified, verified_first, verify_training_state)
from lilicorr_pl.command import ShortUsage, config_arguments, constructor_reason, is_inline_config
from lilicorr_pl.data.datamodule import DraftDataModule
from lilicorr_pl.data.fingerprint import fingerprint_files
from lilicorr_pl.data.formats import ChatTemplateError, DataFormatError, check_data_files, resolve_chat_template
from lilicorr_pl.data.store import CacheError
from lilicorr_pl.files import atomic_file, check_output_paths, check_writable_dir, write_results_json
from lilicorr_pl.heads.domino import first_form_refusal
from lilicorr_pl.interop import read_config
from lilicorr_pl.progress import LOG_INTERVAL, is_terminal
from lilicorr_pl.system import (DraftSystem, StateMismatchError, _short, check_evaluation_settings, check_resume_settings,
                                check_resume_split, edited_files, plain_data)
from lilicorr_pl.target import check_device, portable

# Lightning's ckpt_path keywords (not files).
CKPT_SHORTCUTS = ("last", "best", "hpc", "registry")
# Subcommands that read the validation split (predict: per-block diagnostics of it).
VALIDATION_STAGES = ("validate", "predict")


def git_commit(folder: str | Path | None = None) -> str | None:
    """The git commit checked out in ``folder`` (default: the working directory), if any (recorded with every run)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False,
                             cwd=folder)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def lilicorr_commit(source: Path | None = None) -> str | None:
    """The commit of lilicorr's own code when it runs from a git checkout of it (an editable install), else None: an
    installed copy inside another repository (a virtual environment in a user's project) is not given that project's
    commit. ``source``: the folder holding the package (default: this one's)."""
    source = (source or Path(__file__).parents[1]).resolve()
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, timeout=5,
                             check=False, cwd=source)
    except (OSError, subprocess.SubprocessError):
        return None
    top = out.stdout.strip()
    if out.returncode != 0 or not top or Path(top).resolve() != source:
        return None
    return git_commit(source)


class LoggerSaveConfigCallback(SaveConfigCallback):
    """Writes the run's config into its folder and records the resolved config and git commit in W&B.

    ``fit`` writes ``config.yaml`` (or the ``config_filename`` given; a resumed fit rewrites it: the same run);
    ``validate``, ``test`` and ``predict`` write ``<subcommand>-<that name>`` beside it, so evaluating a run never
    replaces the record of how it was trained.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fit_config_filename = self.config_filename

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Lightning's ``setup``, with the record written atomically (:meth:`save_record`): its ``parser.save`` writes
        in place, so a run killed mid-write left a torn record, which the retry then refused as another run's."""
        name = str(getattr(stage, "value", stage))  # a TrainerFn: "fit", "validate", "test", "predict"
        base = self.fit_config_filename
        self.config_filename = base if name == "fit" else f"{name}-{base}"
        if self.already_saved:
            return
        if self.save_to_log_dir and not _is_local_file_protocol(str(trainer.log_dir)):  # s3://, gs://: no rename
            super().setup(trainer, pl_module, stage)  # into place there; Lightning's own write through fsspec
            return
        if self.save_to_log_dir:
            log_dir = trainer.log_dir  # this broadcasts the directory: every rank calls it
            assert log_dir is not None
            config_path = os.path.join(log_dir, self.config_filename)
            if not self.overwrite:  # asked on rank 0, the answer broadcast so that every rank stops
                exists = trainer.strategy.broadcast(os.path.isfile(config_path) if trainer.is_global_zero else False)
                if exists:
                    raise RuntimeError(f"{type(self).__name__} expected {config_path} to NOT exist. Aborting to avoid "
                                       "overwriting results of a previous run. You can delete the previous config "
                                       "file, set `LightningCLI(save_config_callback=None)` to disable config saving, "
                                       'or set `LightningCLI(save_config_kwargs={"overwrite": True})` to overwrite '
                                       "the config file.")
            if trainer.is_global_zero:  # one writer
                os.makedirs(log_dir, exist_ok=True)
                self.save_record(Path(config_path))
        if trainer.is_global_zero:
            self.save_config(trainer, pl_module, stage)
            self.already_saved = True
        self.already_saved = trainer.strategy.broadcast(self.already_saved)  # every rank skips later setups alike

    def save_record(self, path: Path) -> None:
        """The config, as Lightning's ``parser.save`` writes it (the same text), renamed into place whole: a reader
        sees the previous record or this one."""
        if self.multifile:  # several files, written by jsonargparse (no lilicorr command asks for them)
            self.parser.save(self.config, str(path), skip_none=False, overwrite=self.overwrite, multifile=True)
            return
        text = self.parser.dump(self.config, skip_none=False)
        with atomic_file(path, "w") as fh:
            fh.write(text)

    def save_config(self, trainer: Any, pl_module: Any, stage: str) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                config = self.parser.dump(self.config, skip_none=False, format="yaml")
                import yaml

                logger.experiment.config.update(
                    {"lilicorr_config": yaml.safe_load(config), "git_commit": git_commit(),
                     "lilicorr_version": __version__, "lilicorr_commit": lilicorr_commit(), "stage": stage},
                    allow_val_change=True,
                )


def _train_total(trainer: Trainer, batch_idx: int) -> int | float:
    """Batches this epoch will run, counted from its first batch: ``batch_idx`` is where it (re)started."""
    total = trainer.num_training_batches
    if trainer.max_steps is not None and trainer.max_steps > 0 and math.isfinite(total):
        remaining = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
        total = min(total, batch_idx + remaining)
    return total


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar, right for step-limited runs.

    ``max_steps`` runs have ``max_epochs = -1``, which the stock bar prints as ``Epoch 3/-2``; here it is
    ``Epoch 3``. An epoch resumed mid-way starts at its saved batch, and the stock total (the remaining steps)
    then ends below the count (``15/9``); here the total counts from the epoch's first batch (``15/15``).
    """

    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is not None and self.trainer.max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        description = f"Epoch {current_epoch}"
        return f"{description:{len(self.validation_description)}}"  # same width as the validation bar's

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.progress is None or self.train_progress_bar_id is None:
            return
        total = _train_total(trainer, batch_idx)
        if self.progress.tasks[self.train_progress_bar_id].total != total:
            self.progress.update(self.train_progress_bar_id, total=total)


class StepTQDMProgressBar(TQDMProgressBar):
    """The tqdm bar (used without ``rich``) with the same resumed-epoch total as :class:`StepProgressBar`."""

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        bar = self._train_progress_bar
        total = _train_total(trainer, batch_idx)
        if bar is not None and math.isfinite(total) and bar.total != total:
            bar.total = total


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class LogProgressBar(ProgressBar):
    """Lightning progress for a log file: a line every ``interval`` seconds of training, and one when training ends.

    ``epoch 3 step 400/2000 (20%) | 1.93 it/s | elapsed 3:27 | left 13:49 | train/loss 0.512``: optimizer steps against
    ``max_steps`` (or batches of the epoch without it), with the bar's metrics (what a rich bar would show beside it).
    """

    clock = staticmethod(time.monotonic)
    """Seconds, for the rate and times (an attribute, so a test replaces this bar's clock, not the process's)."""

    def __init__(self, interval: float = LOG_INTERVAL, stream: IO[str] | None = None) -> None:
        super().__init__()
        self.interval = float(interval)
        self.stream = stream
        self._enabled = True
        self._started = 0.0
        self._first_step = 0
        self._batches = 0
        self._last_line = -math.inf

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def is_disabled(self) -> bool:
        return not self._enabled

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._started = self.clock()
        self._first_step = trainer.global_step  # a resumed run's rate counts only the steps it ran
        self._batches = 0
        self._last_line = self._started

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._batches += 1
        now = self.clock()
        if now - self._last_line >= self.interval:
            self._last_line = now
            self._write(self.line(trainer, pl_module, now, batch_idx + 1))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        done = trainer.fit_loop.epoch_loop.batch_progress.current.completed
        self._write(self.line(trainer, pl_module, self.clock(), done))

    def line(self, trainer: Any, pl_module: Any, now: float, batch: int) -> str:
        """The progress line at time ``now`` (:attr:`clock`), ``batch`` batches into the epoch."""
        elapsed = now - self._started
        epoch = f"epoch {trainer.current_epoch}"
        if trainer.max_steps is not None and trainer.max_steps > 0:  # optimizer steps of the whole run
            done, total, unit, ran = trainer.global_step, trainer.max_steps, "step", trainer.global_step - self._first_step
            left = total - done
        else:  # batches of this epoch; time left over every epoch still to run
            done, total, unit, ran = batch, self.total_train_batches, "batch", self._batches
            left = total - done
            if trainer.max_epochs is not None and trainer.max_epochs > 0:
                left += max(trainer.max_epochs - trainer.current_epoch - 1, 0) * total
                epoch += f"/{trainer.max_epochs}"
        rate = ran / elapsed if elapsed > 0 else 0.0
        parts = [f"{epoch} {unit} {done}/{total if math.isfinite(total) else '?'}"
                 + (f" ({100 * done / total:.0f}%)" if math.isfinite(total) and total > 0 else ""),
                 f"{rate:.2f} it/s", f"elapsed {_duration(elapsed)}"]
        if math.isfinite(total) and rate > 0:
            parts.append(f"left {_duration(left / rate)}")
        for name, value in self.get_metrics(trainer, pl_module).items():
            if name == "v_num":
                continue
            parts.append(f"{name} {value:.4g}" if isinstance(value, float) else f"{name} {value}")
        return " | ".join(parts)

    def _write(self, line: str) -> None:
        if not self._enabled:
            return
        stream = sys.stdout if self.stream is None else self.stream
        stream.write(line + "\n")
        stream.flush()


def adopt_recorded_builtins(config: Any) -> None:
    """A built-in target's folder or data file that a run on another machine recorded (its ``config.yaml`` read back
    with ``-c``), and that is not on this machine, is named by the ``builtin:`` name whose build here has the same key:
    found or built here as that name is (a path to another machine's cache folder was refused as missing)."""
    model, data = config.get("model"), config.get("data")
    places = [(f"{name}.target", section.get("target"), "name_or_path") for name, section in (("model", model),
              ("data", data)) if section is not None and isinstance(section.get("target"), Namespace)]
    places += [("data", data, key) for key in ("train_files", "val_files") if data is not None]
    named: dict[str, str] = {}  # the target's path is set twice (model.target, and data.target linked to it)
    for where, section, key in places:
        value = section.get(key)
        values = [value] if isinstance(value, str) else value if isinstance(value, list) else []
        adopted = [_builtin_here(v, f"{where}.{key}", named) if isinstance(v, str) else v for v in values]
        if adopted != values:
            section[key] = adopted[0] if isinstance(value, str) else adopted


def _builtin_here(value: str, setting: str, named: dict[str, str]) -> str:
    if value in named:
        return named[value]
    if builtin.is_builtin(value) or builtin.builtin_artifact(value) is None or \
            os.path.exists(os.path.expanduser(value)):
        return value
    name = builtin.builtin_name_of(value)
    if name is None:
        return value
    if os.environ.get("LOCAL_RANK", "0") == "0":  # once per machine, not per process
        print(f"lilicorr: {setting} {value} is not on this machine; {name} has the same build key, so it is used "
              "in its place (found or built in this machine's cache)", file=sys.stderr)
    named[value] = name
    return name


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{"trainer.max_steps": 2000, …}`` (lists kept whole)."""
    if not isinstance(value, dict):
        return {prefix: value} if prefix else {}
    out: dict[str, Any] = {}
    for key, item in value.items():
        out.update(_flat(item, f"{prefix}.{key}" if prefix else str(key)) if isinstance(item, dict)
                   else {f"{prefix}.{key}" if prefix else str(key): item})
    return out


def _recorded_base(recorded_root: Any, root_now: Any) -> Path | None:
    """The folder a recorded run's relative paths were relative to (its working folder), where its record names its
    root relatively and that root is this run's (``run`` recorded, ``/d/run`` now: ``/d``); None where unknown."""
    if not isinstance(recorded_root, str) or not recorded_root or os.path.isabs(os.path.expanduser(recorded_root)):
        return None
    parts = Path(os.path.normpath(recorded_root)).parts
    here = Path(os.path.realpath(str(root_now)))
    if ".." in parts or len(parts) >= len(here.parts) or here.parts[-len(parts):] != parts:
        return None
    return here.parents[len(parts) - 1]


def _same_place(recorded: Any, now: Any, base: Path | None) -> bool:
    """Whether two settings name the same files or folders: paths (or lists of them) that resolve to the same place,
    the recorded ones relative to ``base`` (the recorded run's working folder), this run's to the working folder."""
    if isinstance(recorded, (list, tuple)) and isinstance(now, (list, tuple)):
        return len(recorded) == len(now) and bool(recorded) and all(
            a == b or _same_place(a, b, base) for a, b in zip(recorded, now))
    if not (isinstance(recorded, str) and isinstance(now, str) and recorded and now):
        return False
    was = os.path.expanduser(recorded)
    if not os.path.isabs(was):
        if base is None:
            return False
        was = str(base / was)
    return os.path.realpath(was) == os.path.realpath(os.path.expanduser(now))


def _callback_list(given: Any) -> list[Any]:
    """``trainer.callbacks`` as a list: a config (or ``reporting``) may give none, one callback, or a list of them."""
    if not given:
        return []
    return list(given) if isinstance(given, (list, tuple)) else [given]


class _LoopStarted(Callback):
    """Notes when the fit loop starts: a Ctrl-C before it (data, target load) stops at once, with nothing to save."""

    def __init__(self) -> None:
        self.started = False

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.started = True


def counts_before_fractions(trainer_class: type) -> None:
    """Type the Trainer's ``int | float`` arguments int first, so ``--trainer.limit_val_batches=1`` is one batch.

    ``limit_*_batches``, ``val_check_interval`` and ``overfit_batches`` mean a count of batches when an int and a
    fraction when a float, and the parser tries a union's types in order. ``typing`` caches ``Union[int, float]``
    and ``Union[float, int]`` as one object (they compare equal), so the order in the Trainer's signature is whichever
    a module imported earlier wrote: with transformers 5.0–5.17 (imported by Lightning) it was float first, and
    ``--trainer.limit_predict_batches=1`` meant 1.0, every batch. Rewritten as ``int | float`` (``types.UnionType``
    keeps its order) on the class the CLI builds; any other annotation is left as it is.
    """
    import types
    import typing

    annotations = getattr(trainer_class.__init__, "__annotations__", {})
    for name, annotation in list(annotations.items()):
        if isinstance(annotation, str) or typing.get_origin(annotation) not in (typing.Union, types.UnionType):
            continue
        members = typing.get_args(annotation)
        if set(members) - {type(None)} == {int, float}:
            annotations[name] = (int | float | None) if type(None) in members else (int | float)


def _honour_wandb_disabled(trainer: Trainer | None) -> None:
    """``WANDB_MODE=disabled`` turns W&B off for a run whose config logs offline too: Lightning's ``offline=True`` sets
    ``WANDB_MODE=dryrun`` over it when the run starts, and an offline run was written anyway."""
    if trainer is None or os.environ.get("WANDB_MODE", "").lower() != "disabled":
        return
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger) and getattr(logger, "_offline", False):
            logger._offline = False  # the mode is wandb's to read: the environment's "disabled"


LINKS = (("model.target", "data.target"), ("data.max_length", "model.max_length"))
"""The options one sets for two (source, target): the data module tokenizes with, and precomputes logits from, the
model's target; the model's context length is the data's."""


_UNSET = object()
_FILE = object()


def _yaml_at(mapping: Any, dotted: str, files: bool = False) -> Any:
    """The value at a key of loaded YAML (``model.losses[0].init_args``; ``_UNSET`` when it is not there; with
    ``files``, ``_FILE`` where a file's name stands for a mapping on the way, which jsonargparse reads)."""
    for name, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", dotted):
        if name and isinstance(mapping, dict) and name in mapping:
            mapping = mapping[name]
        elif index and isinstance(mapping, list) and int(index) < len(mapping):
            mapping = mapping[int(index)]
        else:
            return _FILE if files and isinstance(mapping, str) else _UNSET
    return mapping


def _option_name(token: str) -> str:
    """The key a command-line token sets (``--data.max_length=64`` -> ``data.max_length``; "" for a value)."""
    return token[2:].partition("=")[0] if token.startswith("--") else ""


class _Config(NamedTuple):
    position: int  # in the arguments
    where: str  # how to name it
    section: str  # "model" / "data" for --model / --data FILE, "" for -c
    loaded: Any  # its YAML, as written

    @property
    def options(self) -> Any:
        """Its options under their full keys."""
        return {self.section: self.loaded} if self.section else self.loaded


def _config_sources(args: Sequence[str]) -> list[_Config]:
    """Each config ``args`` give: ``-c/--config``, and ``--model`` / ``--data`` naming a section's file or inline
    YAML."""
    import yaml

    given = [(i, "-c", text) for i, text in config_arguments(args)]
    for i, token in enumerate(args):
        flag, eq, value = token.partition("=")
        if flag in ("--model", "--data") and (eq or i + 1 < len(args)):
            given.append((i if eq else i + 1, flag, value if eq else args[i + 1]))
    out = []
    for i, flag, text in sorted(given):
        inline = is_inline_config(text)
        try:
            loaded = yaml.safe_load(text if inline else Path(text).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue  # the -c files were checked before parsing; jsonargparse has read what it could
        where = f"the inline {flag} config" if inline else f"config file {text}"
        section = flag.lstrip("-") if flag != "-c" else ""
        files = _section_files(loaded, Path(text).parent) if not inline and not section else {}
        if files:  # ``model: model.yaml``: that file stands for the section, read where jsonargparse reads it
            loaded = {k: v for k, v in loaded.items() if k not in files}
        out.append(_Config(i, where, section, loaded))
        out += [_Config(i, f"config file {path}", name, content) for name, (path, content) in files.items()]
    return out


def _section_files(loaded: Any, folder: Path) -> dict[str, tuple[Path, Any]]:
    """The ``model``/``data`` sections a config names by a file (``model: model.yaml``, relative to the config's
    folder, as jsonargparse reads it): ``{section: (path, its YAML)}``; one that cannot be read is left out, for
    jsonargparse to name."""
    import yaml

    found = {}
    for name in ("model", "data"):
        value = loaded.get(name) if isinstance(loaded, dict) else None
        if not isinstance(value, str) or is_inline_config(value):
            continue
        path = folder / value
        try:
            found[name] = (path, yaml.safe_load(path.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
    return found


def _assignments(args: Sequence[str], sources: list[_Config], key: str) -> list[tuple[int, Any]] | None:
    """``(position, value)`` of every argument that sets ``key``, in order: configs, and options typed for the key or
    for a mapping that holds it (``--model.target={dtype: bf16}``). None where one sets it in a way not followed here
    (a file's name for a mapping, an option for a key inside it, an append ``+=``): the check then says nothing."""
    import yaml

    found = []
    for config in sources:
        value = _yaml_at(config.options, key, files=True)
        if value is _FILE:
            return None
        if value is not _UNSET:
            found.append((config.position, value))
    for i, token in enumerate(args):
        name, text = _option_name(token), token.partition("=")[2]
        base = name.removesuffix("+")
        if not base or base in ("model", "data") or not (key == base or key.startswith(base + ".")
                                                         or base.startswith(key + ".")):
            continue
        if base != name or base.startswith(key + "."):
            return None
        if "=" not in token:
            if i + 1 >= len(args):
                continue
            text = args[i + 1]
        try:
            value = _yaml_at({"v": yaml.safe_load(text)}, "v" + key[len(name):], files=True)
        except yaml.YAMLError:
            continue
        if value is _FILE:
            return None
        if value is not _UNSET:
            found.append((i, value))
    return sorted(found, key=lambda pair: pair[0])


def refuse_linked_options(args: Sequence[str], default: Callable[[str], Any] | None = None) -> None:
    """An option a link sets (:data:`LINKS`), typed on the command line: one line naming the option to set (jsonargparse
    said ``argument data.max_length --> model.max_length: int | None is not callable``). ``default(key)``: the key's
    default in the parser, ``_UNSET`` for a key it has not (``--data.target.nme`` has no option to point to)."""
    for name in map(_option_name, args):
        for source, target in LINKS:
            if name == target or name.startswith(target + "."):
                suffix = name[len(target):]
                if suffix and default is not None and default(source + suffix) is _UNSET:
                    raise UserInputError(f"--{name} is not an option: {target} is set from --{source}, which has no "
                                         f"{suffix[1:]}; drop it")
                raise UserInputError(f"--{name} is set from --{source}, which it always equals; set "
                                     f"--{source}{suffix} instead")


def _same_setting(key: str, a: Any, b: Any) -> bool:
    """Whether two values of ``key`` set the same (a quoted ``"64"`` and 64; ``bf16`` and ``bfloat16``)."""
    if a == b or (isinstance(a, (str, int, float)) and isinstance(b, (str, int, float)) and str(a) == str(b)):
        return True
    if key.endswith(".dtype"):
        from lilicorr_pl.target import resolve_dtype

        try:
            return resolve_dtype(a) == resolve_dtype(b)
        except ValueError:
            return False
    return False


def check_linked_options(args: Sequence[str], config: Any, subcommand: str | None,
                         default: Callable[[str], Any], sources: list[_Config] | None = None) -> None:
    """A config's value for an option a link sets (:data:`LINKS`) is refused where the link overwrote it without a word
    (``model.max_length: 5`` trained at ``data.max_length``). Passed: the value the link sets; null (unset); an
    interpolation (``${data.max_length}``); and a value equal to its source as that stood where the config was read (the
    source's last setting up to it, else its ``default(key)``): a later argument that changes the source carries the
    linked option along, as a later argument wins anywhere. ``sources``: ``args``' configs, already read."""
    section = config.get(subcommand) if subcommand else config
    sources = _config_sources(args) if sources is None else sources
    for where in sources:
        for source, target in LINKS:
            given, final = _yaml_at(where.options, target), plain_data(section.get(source))
            if given is _UNSET or isinstance(given, dict) != isinstance(final, dict):
                continue  # (a mapping's file name: jsonargparse reads it)
            items = [(f".{k}", v) for k, v in given.items()] if isinstance(given, dict) else [("", given)]
            for suffix, value in items:
                if suffix and suffix[1:] not in final:  # a key the source has not (a typo): dropped with the rest
                    raise UserInputError(f"{target}{suffix} in {where.where} is not an option: {target} is set from "
                                         f"{source}, which has no {suffix[1:]}; drop it from that config")
                its = final.get(suffix[1:]) if suffix else final
                if value is None or isinstance(value, str) and "${" in value or _same_setting(suffix, value, its):
                    continue
                assigned = _assignments(args, sources, source + suffix)
                if assigned is None:
                    continue
                before = [v for at, v in assigned if at <= where.position]
                stood = before[-1] if before else default(source + suffix)
                if stood is not _UNSET and _same_setting(suffix, value, stood):
                    continue
                raise UserInputError(
                    f"{target}{suffix} {_yaml_text(value)} in {where.where} would be overwritten by {source}{suffix} "
                    f"({_yaml_text(its)}), which sets it; drop {target}{suffix} from that config, or set "
                    f"{source}{suffix} instead")


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` laid on ``base`` key by key, mappings inside merged the same way (as configs overlay each other)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


MERGED_MAPPINGS = ("model.loss_weights", "model.target.load_kwargs")
"""The plain mapping options: given by more than one config, they merge (:func:`merged_mapping_args`)."""


def merged_mapping_args(args: Sequence[str], sources: list[_Config] | None = None) -> list[str]:
    """``args`` with, after each config that sets a :data:`MERGED_MAPPINGS` option something earlier set too, the
    option that sets it to their merge (``--model.loss_weights={...}``): a config overlays the mapping key by key, as
    the command line's ``--model.loss_weights.k=v`` does. jsonargparse let a later file's mapping replace an earlier
    one's whole (``-c margin.yaml -c penalty_heavy.yaml`` trained without the margin variant's weights, under its
    name), with any key the command line had set before it; as an option, the merge is what ``--print_config`` prints
    and the run records. A whole mapping given on the command line (``--model.loss_weights={...}``) replaces, and a
    ``null`` empties it, as before; a mapping holding an interpolation (``${...}``), or one under a mapping set by a
    file's name or an option, is left to jsonargparse, as it was. ``sources``: ``args``' configs, already read."""
    import yaml

    sources = _config_sources(args) if sources is None else sources
    after: dict[int, list[str]] = {}
    for path in MERGED_MAPPINGS:
        # Set in a way not followed here (a file's name for a mapping on the way, ``model.target: t.yaml``, or an
        # option for one, ``--model.target={...}``): left to jsonargparse, as it was.
        if any(_yaml_at(c.options, path, files=True) is _FILE for c in sources) or any(
                path.startswith(_option_name(t).removesuffix("+") + ".") for t in args if _option_name(t)):
            continue
        settings = [(c.position, "config", _yaml_at(c.options, path)) for c in sources]
        settings = [s for s in settings if s[2] is not _UNSET]
        for i, token in enumerate(args):
            name = _option_name(token)
            if name != path and not name.startswith(path + "."):
                continue
            at, text = (i, token.partition("=")[2]) if "=" in token else (i + 1, args[i + 1] if i + 1 < len(args)
                                                                         else None)
            try:
                value = yaml.safe_load(text) if text is not None else _UNSET
            except yaml.YAMLError:
                continue
            for key in reversed(name[len(path) + 1:].split(".") if name != path else []):
                value = {key: value}  # a key set on the command line: a mapping of one key
            if value is not _UNSET:
                settings.append((at, "option" if name == path else "key", value))
        merged: Any = _UNSET
        for at, kind, value in sorted(settings, key=lambda s: s[0]):  # stable: one position's configs in order
            if isinstance(value, dict) and isinstance(merged, dict) and kind != "option":
                combined = deep_merge(merged, value)
                text = json.dumps(combined, separators=(",", ":"), default=str)
                if kind == "config" and combined != value and "${" not in text:  # jsonargparse would replace
                    after.setdefault(at, []).append(f"--{path}={text}")
                merged = combined
            else:  # a whole mapping given on the command line replaces, as it always did; null empties
                merged = value
    out: list[str] = []
    for i, token in enumerate(args):
        out += [token, *after.get(i, [])]
    return out


def interpolation_refusal(err: Exception, args: Sequence[str]) -> str:
    """omegaconf's refusal of a config's ``${...}``, in one line naming the key, its config and the fix."""
    from omegaconf.errors import InterpolationKeyError

    key = str(getattr(err, "full_key", "") or "")  # relative to the file omegaconf read
    reason = first_line(err)
    named = re.search(r"Interpolation key '([^']+)'", reason)
    holding = [c for c in _config_sources(args) if _yaml_at(c.loaded, key) is not _UNSET]
    plain = (str, int, float, bool, type(None), list, dict)  # a YAML !!set or a date is none of them
    found = next((c for c in holding if named and "${" + named.group(1) in str(_yaml_at(c.loaded, key))),
                 next((c for c in holding if "${" in str(_yaml_at(c.loaded, key))),
                      next((c for c in holding if not isinstance(_yaml_at(c.loaded, key), plain)),
                           holding[0] if holding else None)))
    where = f"{found.section}.{key}" if found is not None and found.section else key
    value = str(_yaml_at(found.loaded, key)) if found is not None else ""
    fix = ("omegaconf resolves ${...} within each file: name a key of the same file, or write the value"
           if isinstance(err, InterpolationKeyError) else "fix the ${...} or write the value" if "${" in value
           else "write a plain value (a number, a string, a list or a mapping)")
    return f"{where or 'a value'} in {found.where if found is not None else 'a config'}: {reason}; {fix}"


def _yaml_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)  # YAML's dates too


class ShortUsageParser(ShortUsage, LightningArgumentParser):
    """LightningCLI's parser with :class:`~lilicorr_pl.command.ShortUsage`."""

    # jsonargparse refuses a linked value under the key it is copied to: name the one the user gave.
    parse_aliases = {target: source for source, target in LINKS}


class LilicorrCLI(LightningCLI):
    """LightningCLI with the links that keep model and data consistent and the edge checks above.

    ``reporting``: how this one process reports its progress, not what it trains — ``callbacks`` (instances, or
    ``{"class_path", "init_args"}`` as in a config) and ``enable_progress_bar`` — added when the Trainer is built
    and kept out of the ``config.yaml`` the run saves, so that record reruns with ``lilicorr fit -c`` as the run
    itself would from a terminal (``lilicorr demo`` trains stages in background processes that report through
    :class:`callbacks.ProgressFile`; their recorded configs name neither the file nor the hidden bar).
    """

    def __init__(self, *args: Any, reporting: dict[str, Any] | None = None, **kwargs: Any) -> None:
        unknown = sorted(set(reporting or {}) - {"callbacks", "enable_progress_bar"})
        if unknown:
            raise TypeError(f"reporting takes callbacks and enable_progress_bar, not {', '.join(unknown)}")
        self.reporting = dict(reporting or {})
        self._verified_first: Any = None  # --ckpt_path's first read (hashed once), for Lightning's restore
        self._loop_started: _LoopStarted | None = None  # set when the Trainer is built
        self._resumed_step: int | None = None  # --ckpt_path's global step, read when it is checked
        self._target_to_build: tuple[str, Any] | None = None  # a builtin: target's name and config, built after checks
        if "callbacks" in self.reporting:
            self.reporting["callbacks"] = _callback_list(self.reporting["callbacks"])
        counts_before_fractions(kwargs.get("trainer_class", Trainer))
        kwargs.setdefault("parser_class", ShortUsageParser)
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        for source, target in LINKS:
            parser.link_arguments(source, target, apply_on="parse")

    # ------------------------------------------------------------------ before anything is built
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        # `lilicorr` hands over the argv it has already checked (config files found, YAML readable), so LightningCLI's
        # warning about passing args while sys.argv also has some does not apply.
        if isinstance(args, (dict, Namespace)):
            self.config = parser.parse_object(args)
        else:
            from omegaconf.errors import OmegaConfBaseException

            args = list(args or [])
            parsers = getattr(self, "_subcommand_parsers", None)  # fit, validate, ...; none for prepare and perf
            named = next((a for a in args if a in parsers), None) if parsers else None
            refuse_linked_options(args, self._default_of(named) if named or not parsers else None)
            # A linked option is refused under the key it is copied to, and named by its source, unless a config sets
            # that key itself (``model: {max_length: abc}`` was refused as data.max_length's value).
            sources = _config_sources(args)  # each config read once here, for the aliases and the merge
            aliases = {t: s for t, s in ShortUsageParser.parse_aliases.items()
                       if all(_yaml_at(c.options, t) is _UNSET for c in sources)}
            for each in [parser, *(parsers or {}).values()]:
                each.parse_aliases = aliases
            try:
                self.config = parser.parse_args(merged_mapping_args(args, sources))
            except OmegaConfBaseException as err:  # a config's ${...} omegaconf cannot resolve: it was a traceback
                raise UserInputError(interpolation_refusal(err, args)) from None
            check_linked_options(args, self.config, self.config.get("subcommand"),
                                 self._default_of(self.config.get("subcommand")), sources)
        subcommand = self.config.get("subcommand")
        config = self.config.get(subcommand) if subcommand else self.config
        try:
            adopt_recorded_builtins(config)
        except (ValueError, FileNotFoundError) as err:
            raise UserInputError(str(err)) from None
        self.check_before_building(config, subcommand)

    def _default_of(self, subcommand: str | None) -> Callable[[str], Any]:
        """A key's default in the subcommand's parser (``_UNSET``: none)."""
        parser = self._parser(subcommand)

        def default(key: str) -> Any:
            try:
                return plain_data(parser.get_default(key))
            except (KeyError, ValueError):
                return _UNSET

        return default

    def check_before_building(self, config: Any, subcommand: str | None) -> None:
        """Resolve ``builtin:`` names and check the data, on the parsed config, before anything is built."""
        try:
            self._place_outputs_under_the_root(config)
            self._check_output_folders(config, subcommand)
            self._resolve_builtin_data(config)
            self._check_data(config, subcommand)
            self._check_training(config, subcommand)
            self._refuse_an_untrained_evaluation(config, subcommand)
            if subcommand == "predict":  # written at its end: a file it may not replace is refused before anything
                check_output_paths(str(_predict_output(config)), None, "lilicorr predict's output", command="predict",
                                   output_fix="it writes <trainer.default_root_dir>/predict.json: set "
                                              "--trainer.default_root_dir to another folder, or move that file")
            for key in ("init_drafter_from", "init_head_from") if subcommand is not None else ():  # not prepare's
                warm = config.get("model").get(key) if config.get("model") is not None else None
                if warm:  # read only once the system is built
                    read_config(os.path.expanduser(str(warm)))
            unbuilt, dry = self._check_before_a_target_build(config, subcommand)
            self._resolve_builtin_target(config, unbuilt)  # last: it may find the target built
            if dry is not None:  # the run folder's records, against the config as the build will leave it
                self._refuse_replacing_a_record(subcommand, dry)
        except (ValueError, FileNotFoundError) as err:
            raise UserInputError(str(err)) from None
        if subcommand is not None:  # not prepare's: it logs nothing
            refuse_online_wandb_without_credentials(config.get("trainer"))

    @staticmethod
    def _place_outputs_under_the_root(config: Any) -> None:
        """Outputs not placed explicitly go under ``trainer.default_root_dir``, so one setting moves a whole run:
        the data stores to ``<root>/cache`` and a logger left at its default ``save_dir`` to ``<root>``
        (checkpoints: ``callbacks.ModelCheckpoint`` writes ``<root>/checkpoints``)."""
        trainer, data = config.get("trainer"), config.get("data")
        root = trainer.get("default_root_dir") if trainer is not None else None
        if not root:
            return
        if data is not None and data.get("cache_dir") is None:
            data["cache_dir"] = os.path.join(str(root), "cache")
        loggers = trainer.get("logger")
        for logger in loggers if isinstance(loggers, list) else [loggers]:
            init = logger.get("init_args") if isinstance(logger, Namespace) else None
            if init is not None and "save_dir" in init and init.get("save_dir") in (None, "."):
                init["save_dir"] = str(root)

    @staticmethod
    def _check_output_folders(config: Any, subcommand: str | None) -> None:
        """The run's folder can be made and written, and its data stores' folder made: a path under a file failed with
        a traceback once the target was loaded, when the first store was written. (The stores' folder may be another
        run's, read-only and complete: write access is its writer's to check, for a store still missing.)"""
        trainer, data = config.get("trainer"), config.get("data")
        for setting, section, key, writable in (("trainer.default_root_dir", trainer, "default_root_dir", True),
                                                ("data.cache_dir", data, "cache_dir", False)):
            folder = section.get(key) if section is not None else None
            if folder:
                check_writable_dir(Path(os.path.expanduser(str(folder))), f"{setting} {folder}", writable)
        if subcommand != "fit":
            return
        # Where a fit's checkpoints and config record go: a file named checkpoints there failed at the first save
        # (a traceback after training, nothing saved), a folder named config.yaml once the data were prepared.
        root = Path(os.path.expanduser(str((trainer.get("default_root_dir") if trainer is not None else None) or ".")))
        for folder in _checkpoint_folders(trainer, root):
            check_writable_dir(folder, f"the checkpoints' folder {folder}")
        record = root / "config.yaml"
        if record.is_dir():
            raise ValueError(f"{record} is a folder, where the run writes its config record; move it, or choose "
                             "another --trainer.default_root_dir")

    @staticmethod
    def _resolve_builtin_data(config: Any) -> None:
        """``builtin:stdlib-*`` data become local jsonl files: the core only ever sees files."""
        data = config.get("data")
        for key in ("train_files", "val_files"):
            files = data.get(key) if data is not None else None
            if isinstance(files, str):
                files = [files]
            if files:
                data[key] = [builtin.resolve_data_file(str(f)) for f in files]

    @staticmethod
    def _target(config: Any) -> tuple[Any, str | None]:
        """``model.target`` of a parsed config, and its ``name_or_path``."""
        model = config.get("model")
        target = model.get("target") if model is not None else None
        return target, target.get("name_or_path") if target is not None else None

    def _check_before_a_target_build(self, config: Any, subcommand: str | None) -> tuple[bool, Trainer | None]:
        """A ``builtin:`` target not built yet: the data module and the system are built on the meta device against
        the config the build will have, and the Trainer's settings checked as its constructor checks them, so a
        setting they refuse is refused now, not after a build of up to half an hour (``--data.batch_size=-1`` and
        ``--trainer.accelerator=gpu`` on a CPU were). A built one is loaded in seconds: the run's own constructors
        check. Returns whether such a target is not built yet, and the Trainer built for the check (with the run's
        loggers and its config record's callback, where a record is written; None where none was built)."""
        _, name = self._target(config)
        preview = builtin.unbuilt_target_config(name) if name is not None and config.get("data") is not None else None
        if preview is None:
            return False, None
        dry: Trainer | None = None
        with tempfile.TemporaryDirectory(prefix="lilicorr-target-config-") as folder, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the run's own constructors warn, once
            preview.save_pretrained(folder)
            # A built-in target's drafters are small: their warm starts are read in full, and checked, before the build
            _, system = dry_build(config, self.datamodule_class, self.model_class, folder,
                                  warm_starts=subcommand is not None)
            trainer = config.get("trainer")
            if trainer is not None:
                if subcommand is None:  # prepare reads only where its stores are made: the rest is not built
                    built = {k: instantiate_class((), plain_data(trainer[k])) if isinstance(trainer[k], Namespace)
                             else trainer[k] for k in PREPARE_TRAINER_KEYS if k in trainer}
                else:
                    built = built_trainer_settings(trainer, self.trainer_class)
                    added = [instantiate_class((), c) if isinstance(c, Mapping) else c  # as instantiate_trainer
                             for c in self.reporting.get("callbacks", ())]
                    if subcommand in ("fit", *VALIDATION_STAGES) and self.save_config_callback is not None:
                        added.append(self.save_config_callback(self._parser(subcommand), config,
                                                               **self.save_config_kwargs))  # as instantiate_trainer
                    built["callbacks"] = [*(built.get("callbacks") or []), *added]
                    if "enable_progress_bar" in self.reporting:
                        built["enable_progress_bar"] = self.reporting["enable_progress_bar"]
                dry = dry_trainer(built, trainer, self.trainer_class, loggers=subcommand is not None)
                if subcommand == "fit":
                    self._refuse_an_untrainable_fit(system, dry)
                for callback in built.get("callbacks") or () if subcommand in ("fit", "validate") else ():
                    check = getattr(callback, "check_run", None)  # as _check_callbacks does, later
                    if callable(check):
                        check(system)  # a ProgressFile path holding a user's file, AcceptanceEval's budget
        return True, dry

    def _refuse_an_untrainable_fit(self, system: DraftSystem, trainer: Trainer) -> None:
        """A fit that would leave a trained part at its random initialisation (:meth:`DraftSystem.untrained_part`:
        unless it resumes from a checkpoint there is), or train a FlexAttention drafter on a CPU (no backward there:
        NotImplementedError at the first step, after the data were made): one line, before the data (and, with the
        Trainer built for the checks, before a ``builtin:`` target's build)."""
        ckpt = self.config["fit"].get("ckpt_path")
        # last with none yet (a batch job's first submission) is a new run; found as Lightning's own callbacks find it
        resuming = bool(ckpt) and not (ckpt == "last" and not self._last_checkpoints(trainer))
        untrained = system.untrained_part(resuming=resuming)
        if untrained:
            raise UserInputError(untrained)
        if system.drafter.attention == "flex" and trainer.strategy.root_device.type == "cpu":
            raise UserInputError("model.drafter.init_args.attention 'flex' cannot train on a CPU (FlexAttention has no "
                                 "backward there); set it to 'auto' or 'sdpa', or train on a GPU")

    def _refuse_replacing_a_record(self, subcommand: str | None, dry: Trainer) -> None:
        """Before a ``builtin:`` target's build (``dry``: the Trainer :meth:`_check_before_a_target_build` built), what
        the run's hooks check once its Trainer is built: a fit's ``config.yaml`` against another run's record, and
        ``validate``/``predict``'s ``<stage>-config.yaml`` against a user's file. Those hooks check again after the
        build (a resume's changed settings are recorded there)."""
        if subcommand == "fit":
            self._refuse_a_fresh_run_over_another(dry)
        elif subcommand in ("validate", "predict"):
            self._refuse_replacing_a_foreign_record(subcommand, dry)

    def _resolve_builtin_target(self, config: Any, unbuilt: bool) -> None:
        """A ``builtin:`` target becomes its build's directory. Built: found now. Not built yet (``unbuilt``): named
        by the folder its build will have, and built (with progress) in :meth:`before_instantiate_classes`, after
        ``--ckpt_path``'s checks, which compare that folder with the one the checkpoint's run recorded."""
        _, name = self._target(config)
        if name is None or not builtin.is_builtin(name):
            return
        if unbuilt:
            self._target_to_build = (name, config)
            self._set_target_path(config, builtin.target_folder(name))
        else:
            self._set_target_path(config, builtin.resolve_target_path(name, progress=True))

    def _set_target_path(self, config: Any, path: str) -> None:
        target, _ = self._target(config)
        target["name_or_path"] = path
        data = config.get("data")
        if data is not None and data.get("target") is not None:
            data["target"]["name_or_path"] = path

    def before_instantiate_classes(self) -> None:
        """A ``builtin:`` target not built yet is built here (minutes): after every check that needs no system."""
        pending, self._target_to_build = self._target_to_build, None
        if pending is not None:
            name, config = pending
            self._set_target_path(config, builtin.resolve_target_path(name, progress=True))

    @staticmethod
    def _check_training(config: Any, subcommand: str | None) -> None:
        """Training settings torch or Lightning would refuse only once the data are prepared and the target loaded
        (a traceback: a ZeroDivisionError, the optimizer's ValueError): one line before anything is built."""
        if subcommand != "fit":
            return
        trainer, model = config.get("trainer"), config.get("model")
        max_steps = trainer.get("max_steps") if trainer is not None else None
        if max_steps == 0 or trainer is not None and trainer.get("max_epochs") == 0:  # it exited 0, nothing saved
            which = "max_steps" if max_steps == 0 else "max_epochs"
            raise ValueError(f"trainer.{which} 0 trains nothing (the run would prepare the data, save no checkpoint and "
                             f"exit as finished); set trainer.{which} >= 1, or -1 for no limit")
        accumulate = trainer.get("accumulate_grad_batches") if trainer is not None else None
        if isinstance(accumulate, int) and accumulate < 1:
            raise ValueError(f"trainer.accumulate_grad_batches must be >= 1, got {accumulate}")
        limit = trainer.get("limit_train_batches") if trainer is not None else None
        if isinstance(limit, (int, float)) and not isinstance(limit, bool) and limit == 0:  # the same silent exit
            raise ValueError(f"trainer.limit_train_batches {limit} trains nothing (the run would prepare the data, save "
                             "no checkpoint and exit as finished); set it > 0, or leave it unset for every batch")
        target = plain_data(model.get("target")) if model is not None else None
        if "torch_dtype" in ((target or {}).get("load_kwargs") or {}) and not config.get("ckpt_path"):
            # A new run only: runs recorded with it resume, and their checkpoints load (it never changed the dtype).
            raise ValueError("model.target.load_kwargs torch_dtype is ignored beside the dtype lilicorr passes to "
                             "from_pretrained; drop it from model.target.load_kwargs (model.target.dtype sets the "
                             "target's dtype)")
        optimizer = plain_data(model.get("optimizer")) if model is not None else None
        lr = (optimizer.get("init_args") or {}).get("lr") if isinstance(optimizer, dict) else None
        if isinstance(lr, (int, float)) and not isinstance(lr, bool) and not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"model.optimizer.init_args.lr must be a finite number >= 0, got {lr}")  # inf: nan loss
        clip = trainer.get("gradient_clip_val") if trainer is not None else None
        if isinstance(clip, (int, float)) and not isinstance(clip, bool) and not (math.isfinite(clip) and clip >= 0):
            # A negative norm bound scaled every gradient by a negative factor: the run climbed its loss, exit 0.
            raise ValueError(f"trainer.gradient_clip_val must be a finite number >= 0 (0 or null: no clipping), got "
                             f"{clip}")
        scheduler = plain_data(model.get("lr_scheduler")) if model is not None else None
        warmup = (scheduler.get("init_args") or {}).get("warmup_fraction") if isinstance(scheduler, dict) else None
        if isinstance(warmup, (int, float)) and not isinstance(warmup, bool) and not 0 <= warmup < 1:
            # WarmupCosine refuses it too, but only in configure_optimizers: after the data and the target
            raise ValueError(f"model.lr_scheduler.init_args.warmup_fraction must be in [0, 1), got {warmup}")

    def _check_data(self, config: Any, subcommand: str | None) -> None:
        """Data files exist, and the subcommand has the data it reads: one line before any model or run starts."""
        data = config.get("data")
        if data is None:
            return
        check_data_files(data.get("train_files") or [], "data.train_files")
        if data.get("val_files"):
            check_data_files(data["val_files"], "data.val_files")
        resolve_chat_template(data.get("chat_template"))  # a path to no file: read only once the Trainer is built
        device = data.get("precompute_device")
        if device:  # present where stores are made (fit; None: prepare), not to validate a GPU run's config on a CPU
            check_device(str(device), "--data.precompute_device", here=subcommand in (None, "fit"))
        if subcommand == "test":
            raise ValueError(
                "`lilicorr test` needs a test split, and DraftDataModule has none (it reads training and validation "
                "files); measure held-out data with `lilicorr validate --data.val_files=[FILE]`"
            )
        if subcommand in VALIDATION_STAGES and not (data.get("val_files") or (data.get("val_fraction") or 0) > 0):
            raise ValueError(
                f"`lilicorr {subcommand}` reads the validation split, and there is none; set data.val_files or "
                "data.val_fraction > 0"
            )

    def _parse_ckpt_path(self) -> None:
        """Check a ``ckpt_path`` before anything is built, without letting it override the command line.

        LightningCLI's own version loads the checkpoint's hyperparameters over the user's config, so a resume
        with another head, target or ``num_anchors`` silently ran with the checkpoint's. Here the checkpoint is
        opened weights-only (a pickled payload, a truncated file or untrusted components get one line), and its
        settings are compared with this run's: weights-defining keys must agree, the rest is applied and shown.
        """
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        ckpt = self.config[subcommand].get("ckpt_path")
        if ckpt == "best" and not os.path.exists(ckpt):
            # Lightning resolves "best" from a ModelCheckpoint of this process, which in a new command has none yet, with
            # or without a monitor: its traceback, once the run is built.
            raise UserInputError("--ckpt_path best names the best checkpoint of a fit run in the same process, and each "
                                 "lilicorr command starts a new one; pass --ckpt_path last or the checkpoint file (a "
                                 "monitored ModelCheckpoint writes it under <trainer.default_root_dir>/checkpoints)")
        if ckpt == "last" and not os.path.exists(ckpt):
            ckpt = self._last_checkpoint(subcommand)  # the file Lightning will resume from: checked like any other
        if not ckpt or (str(ckpt) in CKPT_SHORTCUTS and not os.path.exists(str(ckpt))):
            return
        # Verified now, before anything is built (Lightning would see it only after loading the target), and not
        # hashed again when Lightning restores it (_run_subcommand).
        checkpoint, self._verified_first = read_verified(ckpt)
        if subcommand == "fit":  # what a resume restores besides the weights (not hashed again when Lightning reads it)
            verify_training_state(checkpoint, ckpt)
        missing = [k for k in ("state_dict", "hyper_parameters", "pytorch-lightning_version") if k not in checkpoint]
        if missing:  # a bare state dict, or another tool's file: Lightning failed on it once the target was loaded
            raise UserInputError(
                f"--ckpt_path {ckpt} is not a checkpoint of lilicorr fit (it has no {', '.join(missing)}); pass a .ckpt "
                "that lilicorr fit wrote (a served drafter directory is read with --model.init_drafter_from)")
        saved = checkpoint.get("hyper_parameters") or {}
        current = plain_data(self.config[subcommand].get("model"))
        # The model is built from this run's config, whose components are the user's choice: their modules are trusted.
        check_class_paths(saved, ckpt, config_modules(current),
                          fix="name the same components in this run's config (-c or --model.*): the modules a run's "
                              "own config names are trusted")
        saved_data = checkpoint.get("datamodule_hyper_parameters") or {}
        data = plain_data(self.config[subcommand].get("data") or {})
        if "chat_template" in saved_data:
            saved_data = {**saved_data, "chat_template": _template_as_trained(
                saved_data["chat_template"], (checkpoint.get("lilicorr") or {}).get("chat_template"),
                data.get("chat_template"))}
        trained_on = ((checkpoint.get("lilicorr") or {}).get("data_files") or {}).get("train_files")
        self._resumed_step = checkpoint.get("global_step")
        del checkpoint
        # A first-form Domino head: named now, not after the data and the target (its tensors are not this head's).
        refusal = first_form_refusal(saved.get("head"), current.get("head"), f"--ckpt_path {ckpt}")
        if refusal:
            raise UserInputError(refusal)
        if subcommand == "fit":
            # The comparison runs again in DraftSystem.on_load_checkpoint (there the changes are printed).
            check_resume_settings(saved, current)
            check_resume_split(saved_data, data, ckpt, **_training_files_against(trained_on, saved_data, data))
        elif subcommand in VALIDATION_STAGES:
            check_evaluation_settings(saved, current, saved_data, data, ckpt, subcommand,
                                      **_training_files_against(trained_on, saved_data, data))

    def _last_checkpoint(self, subcommand: str) -> str | None:
        """The checkpoint ``ckpt_path="last"`` will resume from, found before anything is built: as Lightning finds
        it, the newest of the ``last*.ckpt`` in the folders of the run's ``ModelCheckpoint`` callbacks (the project's
        ``callbacks.ModelCheckpoint`` without ``dirpath`` keeps them in ``<default_root_dir>/checkpoints``; Lightning's
        own without ``dirpath`` keeps them in the logger's folder, known only once the logger is built, and is left to
        Lightning) and the files of its ``OnExceptionCheckpoint`` callbacks. None when there is none yet (Lightning
        then trains from step 0, so a job can be launched with ``--ckpt_path=last`` from its first attempt on), or
        when the newest is a folder (a sharded checkpoint, read by its strategy: left to Lightning)."""
        trainer = self.config[subcommand].get("trainer") or {}
        root = trainer.get("default_root_dir") or os.getcwd()
        found: list[Path] = []
        others: list[Path] = []  # the folders' other checkpoints (step=N.ckpt), which "last" never resumes
        for callback in _callback_list(trainer.get("callbacks")):
            class_path = str(getattr(callback, "class_path", None) or "")
            init_args = getattr(callback, "init_args", None) or {}
            name = class_path.rsplit(".", 1)[-1]
            if name == "OnExceptionCheckpoint" and init_args.get("dirpath") is not None:
                filename = f"{init_args.get('filename') or 'on_exception'}.ckpt"
                path = Path(os.path.expanduser(str(init_args["dirpath"]))) / filename
                found += [path] if path.exists() else []
        for folder in _checkpoint_folders(trainer, Path(root)):
            if folder.is_dir():
                ckpts = [p for p in folder.iterdir() if p.name.endswith(".ckpt") and p.exists()]  # not a broken link
                found += [p for p in ckpts if p.name.startswith("last")]
                others += [p for p in ckpts if not p.name.startswith("last") and p.is_file()]
        if not found and others and subcommand == "fit":  # validate/predict: their own refusal, which names the fix
            # Lightning would warn and train from step 0 beside them, with a hint to set save_last (already set).
            newest = max(others, key=lambda p: p.stat().st_mtime)
            raise UserInputError(f"--ckpt_path=last: there is no last checkpoint in {newest.parent}, but there are "
                                 f"others; resume from the newest with --ckpt_path {newest}, or start over without "
                                 "--ckpt_path")
        newest = max(found, key=lambda p: p.stat().st_mtime) if found else None
        if newest is not None and newest.is_dir() and not any(newest.iterdir()):
            raise UserInputError(f"--ckpt_path=last: the newest last checkpoint, {newest}, is an empty folder; remove "
                                 "it, or pass the checkpoint file to resume from")
        return str(newest) if newest is not None and newest.is_file() else None

    # ------------------------------------------------------------------ building
    def instantiate_classes(self) -> None:
        # Constructors (and the Trainer) validate their settings before any heavy work; a bad value is the user's to
        # fix, so it becomes one line, not a 70-line traceback. Errors after this point keep their tracebacks.
        try:
            super().instantiate_classes()
        except (ValueError, TypeError, OSError, MisconfigurationException) as err:  # OSError: a path setting
            about_trainer = isinstance(err, MisconfigurationException)
            while err.__cause__ is not None and isinstance(err.__cause__, (ValueError, TypeError)):
                err = err.__cause__
            message = str(err).strip().splitlines()[-1] if str(err).strip() else repr(err)
            if about_trainer:  # "No supported gpu backend found!": which setting asked, and the fix
                message = with_device_advice(message, self._get(self.config, "trainer", default={}))
            raise UserInputError(message) from None
        _honour_wandb_disabled(getattr(self, "trainer", None))

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The Trainer as configured, with :class:`StepProgressBar` (:class:`LogProgressBar` when
        the output is not a terminal) unless the config names a bar or disables it."""
        config = self._get(self.config_init, "trainer", default={})
        callbacks = _callback_list(config.get("callbacks"))
        added = [instantiate_class((), c) if isinstance(c, Mapping) else c for c in self.reporting.get("callbacks", ())]
        show_bar = self.reporting.get("enable_progress_bar", config.get("enable_progress_bar")) is not False
        if show_bar and not any(isinstance(c, ProgressBar) for c in [*callbacks, *added]):
            if not is_terminal(sys.stdout):  # a log file: plain lines, where a redrawn bar shows nothing or a mess
                added.append(LogProgressBar())
            else:
                added.append(StepProgressBar() if _RICH_AVAILABLE else StepTQDMProgressBar())
        self._loop_started = _LoopStarted()
        added.append(self._loop_started)
        kwargs.setdefault("callbacks", [*callbacks, *added])
        if "enable_progress_bar" in self.reporting:
            kwargs.setdefault("enable_progress_bar", show_bar)
        return super().instantiate_trainer(**kwargs)

    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict[str, Any]:
        kwargs = super()._prepare_subcommand_kwargs(subcommand)
        if "weights_only" in self._subcommand_method_arguments[subcommand]:
            if kwargs.get("weights_only") is False:
                raise CheckpointError("--weights_only=false is refused: checkpoints are always opened weights-only")
            kwargs["weights_only"] = True  # never unpickle objects from a checkpoint, whatever torch's env flag says
        return kwargs

    # ------------------------------------------------------------------ running
    def _run_subcommand(self, subcommand: str) -> None:
        ctrl_c: list[bool] = []
        previous = self._stop_fit_on_ctrl_c(ctrl_c) if subcommand == "fit" else None
        try:
            with verified_first(self._verified_first):
                super()._run_subcommand(subcommand)
        except (CacheError, StateMismatchError, ChatTemplateError, DataFormatError) as err:
            # A data store that fails its checks, a --ckpt_path whose tensors are not this config's, a chat template
            # that does not parse or a record it cannot render (met at the first chat record, while the data are
            # tokenized): the message names the file or setting and the fix, so it is one line, as fit's own checks
            # before the run are.
            message = first_line(err)
            ckpt = None
            if isinstance(err, StateMismatchError):  # the file itself, also for --ckpt_path=last
                ckpt = getattr(self.trainer, "ckpt_path", None) or self.config.get(subcommand, {}).get("ckpt_path")
            raise UserInputError(f"--ckpt_path {ckpt}: {message}" if ckpt else message) from None
        except SIGTERMException:
            # Lightning stops its loops at the next batch after a SIGTERM by raising a SystemExit with no status,
            # which exits 0: a cancelled or preempted run would read as a finished one.
            signum = signal.SIGINT if ctrl_c else signal.SIGTERM
            if not self.trainer.is_global_zero:  # rank 0 says it, once (every rank said it)
                raise SystemExit(128 + signum) from None
            step, total = self.trainer.global_step, self.trainer.max_steps
            where = f"at step {step}{f' of {total}' * (total is not None and total > 0)}"
            if self.trainer.world_size > 1:  # the stop-time save is one process's: none was written at this step
                where += (f" on {self.trainer.world_size} processes, where the stop saves nothing: the steps after the "
                          "latest scheduled save are trained again")
            by = "Ctrl-C" if ctrl_c else "SIGTERM"
            raise StoppedBySignal(f"training stopped by {by} {where}" if subcommand == "fit"
                                  else f"{subcommand} stopped by {by} before its end", signum) from None
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)

    def _stop_fit_on_ctrl_c(self, pressed: list[bool]) -> Any:
        """Ctrl-C stops a fit as a SIGTERM does: after the step it is in, with that step saved as ``last`` (Lightning
        would stop at once and save nothing, so a resume started over). A second Ctrl-C stops at once, unsaved.
        Returns the handler it replaced (None off the main thread, where no handler can be set)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        installer = os.getpid()

        def on_ctrl_c(signum: int, frame: Any) -> None:
            if os.getpid() != installer:  # a forked DataLoader worker: its process stops with the fit's
                return
            loop = self._loop_started
            if pressed or (loop is not None and not loop.started):  # again, or before the loop runs (data, target
                raise KeyboardInterrupt  # load): at once, nothing trained yet (Lightning clears the flag at its start)
            pressed.append(True)
            self.trainer._signal_connector.received_sigterm = True  # Lightning's own stop, at the step's end
            saved = ("which is saved" if self.trainer.world_size == 1 else
                     "and resume from the latest scheduled save (several processes)")
            print(f"\nlilicorr fit: Ctrl-C: stopping after this step, {saved} (Ctrl-C again: stop at once, "
                  "unsaved)", file=sys.stderr, flush=True)

        return signal.signal(signal.SIGINT, on_ctrl_c)

    def before_fit(self) -> None:
        self._refuse_an_untrainable_fit(self.model, self.trainer)
        self._refuse_a_fresh_run_over_another()
        self._check_callbacks()
        self._wire_data()
        self._warn_answers_of_another_target()
        self._warn_unservable_layers()
        self._start_online_wandb()

    def _warn_unservable_layers(self) -> None:
        """Say so where the drafter reads the target's last layer, which no engine feeds it as it trains."""
        from lilicorr_pl.target import last_layer_serving_note

        drafter = getattr(self.model, "drafter", None)
        if getattr(drafter, "built", False):
            note = last_layer_serving_note(drafter.target_layer_ids, drafter.target_config.num_hidden_layers)
            if note:
                rank_zero_warn(note)

    def _warn_answers_of_another_target(self) -> None:
        """Say so where a training file's answers were regenerated by another target than this run's (its settings
        record names other weights): the drafter would learn another model's continuations. A warning, not a refusal."""
        from lilicorr_pl.data.regenerate import answered_by_another_target

        target = getattr(self.model, "target_path", None)
        for path in getattr(self.datamodule, "train_files", None) or []:
            reason = answered_by_another_target(path, target)
            if reason:
                rank_zero_warn(reason)

    def _start_online_wandb(self) -> None:
        """An online W&B run is started once every check has passed, before the data are prepared (Lightning starts it
        after: a machine without credentials failed with wandb's traceback once the target's logits were computed,
        which can take hours). The run's clock then includes that preparation."""
        if os.environ.get("WANDB_MODE", "").lower() in WANDB_OFFLINE_MODES:
            return
        for logger in self.trainer.loggers:
            if isinstance(logger, WandbLogger) and not getattr(logger, "_offline", False):
                try:
                    logger.experiment  # noqa: B018 - starts the run (rank zero only; a stub on the others)
                except Exception as err:  # noqa: BLE001 - wandb's own errors: credentials, a refused project
                    if not type(err).__module__.startswith("wandb"):
                        raise
                    first = first_line(err)
                    raise UserInputError(f"W&B could not start an online run ({first}); {WANDB_LOGIN_FIX}") from None

    def _check_callbacks(self) -> None:
        """A callback's checks that need the built system (``check_run``: the in-loop acceptance evaluation's budget
        against the target's context), before the data are prepared: one line, not a traceback at its first use."""
        for callback in self.trainer.callbacks:
            check = getattr(callback, "check_run", None)
            if callable(check):
                try:
                    check(self.model)
                except (ValueError, FileNotFoundError) as err:  # a bad setting, or a prompts file that is not there
                    raise UserInputError(str(err)) from None

    def _config_record(self, trainer: Trainer | None = None) -> tuple[LoggerSaveConfigCallback | None, str]:
        """The callback that writes the run's config records and the folder it writes them to; None when there is none
        or it writes none there. ``trainer``: the run's (default) or the one built for the checks before a build."""
        trainer = trainer or self.trainer
        callback = next((c for c in trainer.callbacks if isinstance(c, LoggerSaveConfigCallback)), None)
        if callback is None or not callback.save_to_log_dir:
            return None, ""
        return callback, str(trainer.log_dir or trainer.default_root_dir)

    def _refuse_a_fresh_run_over_another(self, dry: Trainer | None = None) -> None:
        """A new fit (no ``ckpt_path``) whose ``config.yaml`` would replace another run's record is refused before the
        data are prepared: that record is how the folder's checkpoints were trained (``prepare``, ``perf`` and
        ``bench`` read it). The same command again — a retry, a requeued batch job that Lightning resumes by itself
        (SLURM's ``hpc_ckpt``, ``OnExceptionCheckpoint``) — writes the same record, and runs. A resumed fit rewrites
        its own. (Lightning's own check refuses all of these, which is why it is replaced by this one.) ``dry``: the
        Trainer built for the checks before a ``builtin:`` target's build, where a resume's changes are left for the
        run's own check."""
        trainer = dry or self.trainer
        ckpt_path = self.config["fit"].get("ckpt_path")
        # --ckpt_path=last with nothing to resume (a batch script's first submission) starts a new run: guarded too.
        nothing_to_resume = ckpt_path == "last" and not self._last_checkpoints(trainer)
        callback, log_dir = self._config_record(trainer)
        if callback is None:
            return
        # A resume of this folder's own run rewrites its own record; a checkpoint from elsewhere (another run's) does
        # not make this folder's record its own: that one replaced the record and moved later --ckpt_path=last here.
        from_elsewhere = bool(ckpt_path) and str(ckpt_path) not in CKPT_SHORTCUTS and not any(
            _inside(str(ckpt_path), folder) for folder in {str(log_dir), str(trainer.default_root_dir)})
        resuming = bool(ckpt_path) and not nothing_to_resume and not from_elsewhere
        record = os.path.join(log_dir, callback.fit_config_filename)
        if not os.path.isfile(record):
            return
        import yaml

        try:
            with open(record, encoding="utf-8") as fh:
                loaded = yaml.safe_load(fh)
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            loaded = None
        saved = _flat(loaded)
        current = _flat(yaml.safe_load(callback.parser.dump(callback.config, skip_none=False)))
        # A built-in target or data file by its build's key-bearing name: the same run on a machine whose cache folder
        # is another (another node, another $LILICORR_CACHE) writes the same record.
        differing = sorted(k for k in set(saved) | set(current)
                           if k != "ckpt_path" and portable(saved.get(k)) != portable(current.get(k)))
        # The same folders and files spelt otherwise (relative here, absolute there): the same command again.
        base = _recorded_base(saved.get("trainer.default_root_dir"), trainer.default_root_dir)
        differing = [k for k in differing if not _same_place(saved.get(k), current.get(k), base)]
        if not differing:
            return
        if resuming:
            if dry is None:
                self._keep_the_record_of_the_steps_before(record, saved, current, differing)
            return
        elsewhere = "another --trainer.default_root_dir"
        if os.path.normpath(str(log_dir)) != os.path.normpath(str(trainer.default_root_dir)):
            elsewhere += f" and --trainer.logger.init_args.save_dir (the logger writes the record to {log_dir})"
        if not isinstance(loaded, dict):  # no settings to compare: "another run (its …: None)" would mislead
            raise UserInputError(f"{record} is not a config record that can be read (damaged, or not YAML settings), "
                                 f"so it is not replaced; move it, or write this run elsewhere with {elsewhere}")
        if not _written_by_the_config_callback(Path(record)):  # a file of the user's own, not a run's record
            raise UserInputError(f"{record} is not a config record a run wrote (a file of yours named like one), so "
                                 f"it is not replaced; move it, or write this run elsewhere with {elsewhere}")
        key = differing[0]
        fix = ("--ckpt_path=last found no checkpoint of it to resume, so this would be a new run over its record; "
               "write it elsewhere with" if nothing_to_resume else
               f"--ckpt_path {ckpt_path} is another folder's checkpoint, so this would be another run over its "
               "record; write it elsewhere with" if from_elsewhere else
               "resume that run with --ckpt_path=last, or write this one elsewhere with")
        raise UserInputError(
            f"{record} records another run (its {key}: {_short(saved.get(key), 80)}, this run's: "
            f"{_short(current.get(key), 80)}); {fix} {elsewhere}"
        )

    def _keep_the_record_of_the_steps_before(self, record: str, saved: dict[str, Any], current: dict[str, Any],
                                             differing: list[str]) -> None:
        """A resume with changed settings: the changes are listed (those of ``model.*`` the system lists itself, as it
        applies them), and the record of how the steps before were trained is kept beside the one this resume writes,
        as ``<name>-until-step<N>.<ext>`` (N: the checkpoint's step), never over an earlier such file."""
        if not self.trainer.is_global_zero:
            return
        others = [k for k in differing if not k.startswith("model.")]
        if others:
            print("lilicorr: resuming with changed settings (applied from this run's config): " + "; ".join(
                f"{k}: {_short(saved.get(k), 60)} -> {_short(current.get(k), 60)}" for k in others), file=sys.stderr)
        stem, ext = os.path.splitext(record)
        tag = f"until-step{self._resumed_step}" if self._resumed_step is not None else "before-resume"
        with open(record, "rb") as fh:
            before = fh.read()
        kept, n = f"{stem}-{tag}{ext}", 0
        while os.path.lexists(kept):
            if os.path.isfile(kept) and Path(kept).read_bytes() == before:  # a retry of this resume: kept already
                break
            n += 1
            kept = f"{stem}-{tag}-v{n}{ext}"
        else:
            with atomic_file(Path(kept), "wb") as out:
                out.write(before)
        upto = f" up to step {self._resumed_step}" if self._resumed_step is not None else ""
        print(f"lilicorr: the record the steps{upto} trained with is kept as {kept}; {record} records this resume's "
              "settings", file=sys.stderr)

    def _last_checkpoints(self, trainer: Trainer | None = None) -> set[Any]:
        """What ``--ckpt_path=last`` can resume from, found as Lightning finds it once the Trainer is built: the
        ``last*`` checkpoints of the run's ``ModelCheckpoint`` callbacks and the files of its ``OnExceptionCheckpoint``
        callbacks, those that exist."""
        from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

        trainer = trainer or self.trainer
        found: set[Any] = set()
        for callback in trainer.callbacks:
            if isinstance(callback, OnExceptionCheckpoint):
                found.add(callback.ckpt_path)
            elif isinstance(callback, ModelCheckpoint):
                found |= set(callback._find_last_checkpoints(trainer))
        return {path for path in found if path and os.path.exists(path)}

    def _refuse_an_untrained_evaluation(self, config: Any, subcommand: str | None) -> None:
        """``validate``/``predict`` with neither a checkpoint nor a warm start of what it evaluates would evaluate a
        freshly initialised drafter (or head) and log it as the run's result (Lightning evaluates the model as built,
        and ``--ckpt_path=last`` with nothing to resume only warns)."""
        if subcommand not in VALIDATION_STAGES:
            return
        ckpt = config.get("ckpt_path")
        if ckpt == "last" and not os.path.exists("last") and self._last_checkpoint(subcommand) is None:
            raise ValueError(f"lilicorr {subcommand} --ckpt_path=last: there is no last checkpoint under this run's "
                             "root (trainer.default_root_dir); pass the .ckpt to evaluate")
        model = config.get("model") or {}
        head_class = str((model.get("head") or {}).get("class_path") or "")
        untrained_head = bool(head_class) and not head_class.endswith("Top1Selector") and not model.get("init_head_from")
        if ckpt or (model.get("init_drafter_from") and not untrained_head):
            return
        if model.get("init_drafter_from"):
            raise ValueError(
                f"lilicorr {subcommand} without --ckpt_path would evaluate the warm-started drafter with an untrained "
                f"{head_class.rsplit('.', 1)[-1]}; pass --ckpt_path=<a checkpoint of lilicorr fit>, or also "
                "--model.init_head_from=<the served LiLiCorr directory>"
            )
        raise ValueError(
            f"lilicorr {subcommand} without --ckpt_path would evaluate an untrained drafter; pass --ckpt_path=<a "
            f"checkpoint of lilicorr fit> (or last: the newest in this run's root), or "
            f"--model.init_drafter_from=<a served drafter directory>"
        )

    def before_validate(self) -> None:
        self._refuse_replacing_a_foreign_record("validate")
        self._check_callbacks()
        self._wire_data()

    def before_predict(self) -> None:
        self._refuse_replacing_a_foreign_record("predict")

    def _refuse_replacing_a_foreign_record(self, stage: str, dry: Trainer | None = None) -> None:
        """``validate``/``test``/``predict`` rewrite their own ``<stage>-config.yaml`` on every run (the record of the
        latest evaluation); a file of that name that no lilicorr command wrote (one without the header the config
        callback writes, or not a config) is the user's, and is refused before the data are prepared (and before a
        ``builtin:`` target's build: ``dry``, the Trainer built for those checks)."""
        callback, log_dir = self._config_record(dry)
        if callback is None:
            return
        record = Path(log_dir) / f"{stage}-{callback.fit_config_filename}"
        if not os.path.lexists(record) or _written_by_the_config_callback(record):
            return
        raise UserInputError(
            f"{record} exists and is not a record lilicorr {stage} wrote, so it is not replaced; move that file, or "
            f"write this {stage} elsewhere with another --trainer.default_root_dir"
        )

    def after_validate(self) -> None:
        """The in-loop acceptance evaluation's τ printed too: it goes to the loggers and the monitors, and Lightning's
        table shows only what the validation loop logged (a run without W&B saw no acceptance figure)."""
        measured = {k: float(v) for k, v in self.trainer.callback_metrics.items()
                    if k.startswith("eval/") and "/pos" not in k and "/" not in k.removeprefix("eval/")}
        if measured and self.trainer.is_global_zero:
            print("acceptance (AcceptanceEval): " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(measured.items())))

    def after_predict(self) -> None:
        """``predict``'s per-block diagnostics, which Lightning returns and LightningCLI drops: their means printed
        and every block's values written to ``<default_root_dir>/predict.json``."""
        if not self.trainer.is_global_zero:
            return
        batches = [b for b in (self.trainer.predict_loop.predictions or []) if isinstance(b, Mapping)]
        if not batches:  # said, so an earlier predict.json beside the run is not taken for this one's
            print(f"predict: no batch ran (trainer.limit_predict_batches {self.trainer.limit_predict_batches}, or an "
                  f"empty validation split): nothing measured, {_predict_output(self.config['predict'])} not written",
                  file=sys.stderr)
            return
        import torch

        merged = {key: torch.cat([b[key] for b in batches]) for key in batches[0]}
        valid = merged["valid_block"].bool()
        supervised = merged["supervised"].bool()
        summary: dict[str, float] = {}
        for key, values in merged.items():
            if key in ("valid_block", "supervised"):
                continue
            if values.dim() == 1:  # per block: the mean over the blocks every value is read on
                summary[key] = float(values[valid].float().mean()) if valid.any() else float("nan")
            else:  # per slot: the rate over supervised slots
                summary[f"{key}_rate"] = float(values[supervised].float().mean()) if supervised.any() else float("nan")
        path = _predict_output(self.config["predict"])
        checked = self.model.checked_target or {"target": str(self.model.target_path)}
        resolved = getattr(self.trainer, "ckpt_path", None)  # --ckpt_path=last resolved to the file it read
        write_results_json(path, {
            "ckpt_path": self.config["predict"].get("ckpt_path"),
            "checkpoint": {"path": str(resolved) if resolved else None,
                           "state_sha256": self.model.checkpoint_meta.get(CHECKSUM_KEY),
                           "global_step": self.model.checkpoint_step},
            **checked, "processes": self.trainer.world_size,
            "blocks": int(valid.numel()), "valid_blocks": int(valid.sum()), "summary": summary,
            "per_block": {k: v.tolist() for k, v in merged.items() if v.dim() == 1},
        }, "predict")
        print(f"predict: {int(valid.sum())} valid blocks of {valid.numel()}"
              + (f" (rank 0's share of {self.trainer.world_size} processes)" if self.trainer.world_size > 1 else ""))
        for key, value in summary.items():
            print(f"  {key:<22} {value:.4f}")
        print(f"wrote {path}")

    def before_test(self) -> None:
        self._refuse_replacing_a_foreign_record("test")
        self._wire_data()

    def _wire_data(self) -> None:
        dm = self.datamodule
        if isinstance(dm, DraftDataModule) and isinstance(self.model, DraftSystem):
            try:
                self.model.check_offline_features(dm.feature_cache)
                wire_logit_cache(self.model, dm)
            except ValueError as err:  # model and data settings that contradict each other: one line
                raise UserInputError(str(err)) from None


def _written_by_the_config_callback(path: Path) -> bool:
    """Whether ``path`` is a config record as :class:`LoggerSaveConfigCallback` writes them: a plain file whose first
    line is Lightning's version header and whose YAML is a mapping with the run's sections."""
    import yaml

    if path.is_symlink() or not path.is_file():
        return False
    try:
        with open(path, encoding="utf-8") as fh:
            if not fh.readline().startswith("# lightning.pytorch=="):  # its header, before reading all of it
                return False
            fh.seek(0)
            saved = yaml.safe_load(fh.read())  # whole: a record of a long file list or an inline template is large
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return isinstance(saved, dict) and {"model", "trainer"} <= set(saved)


def _checkpoint_folders(trainer: Any, root: Path) -> list[Path]:
    """The folders the run's ``ModelCheckpoint`` callbacks write (the project's without ``dirpath``:
    ``<root>/checkpoints``; Lightning's own without one writes in the logger's folder, known once it is built)."""
    folders = []
    for callback in _callback_list(trainer.get("callbacks") if trainer is not None else None):
        class_path = str(getattr(callback, "class_path", None) or "")
        init_args = getattr(callback, "init_args", None) or {}
        if class_path.rsplit(".", 1)[-1] != "ModelCheckpoint":
            continue
        dirpath = init_args.get("dirpath")
        if dirpath is None and class_path != "callbacks.ModelCheckpoint":
            continue
        folders.append(Path(os.path.expanduser(str(dirpath or root / "checkpoints"))))
    return folders


def _inside(path: str, folder: str) -> bool:
    """Whether ``path`` lies under ``folder`` (both resolved: links and ``..`` followed)."""
    try:
        return Path(path).expanduser().resolve().is_relative_to(Path(folder).expanduser().resolve())
    except (OSError, RuntimeError):
        return False


def _predict_output(config: Any) -> Path:
    """Where ``lilicorr predict`` writes its diagnostics: ``<trainer.default_root_dir>/predict.json``."""
    trainer = config.get("trainer")
    return Path(str((trainer.get("default_root_dir") if trainer is not None else None) or ".")) / "predict.json"


def wire_logit_cache(system: DraftSystem, dm: DraftDataModule) -> None:
    """The logit store is worth computing only when an active loss reads it; a ``data.logit_cache`` set the other
    way is refused or warned about, naming the model setting that decided."""
    offline = dm.feature_cache
    dm.require_logit_cache(system.needs_logit_cache(offline_features=offline), system.logit_cache_reason(offline))
    rows = system.drafter.target_config.vocab_size  # its output rows, from the target's config
    if dm.logit_cache and dm.logit_top_m > rows:  # was found after tokenizing and loading
        raise ValueError(f"data.logit_top_m {dm.logit_top_m} is more than the target's {rows} output rows; keep the top "
                         f"M <= {rows} logits (the demo keeps 32, the Qwen3 recipes 64)")


def add_saved_fit_arguments(parser: Any, command: str) -> None:
    """Accept the arguments of ``fit`` itself that the ``config.yaml`` a fit saves in its run folder carries
    (``ckpt_path``, ``weights_only``), so a command with ``fit``'s parser reads that file as it is. ``command``
    never reads them: it names itself in their help."""
    parser.add_argument("--ckpt_path", type=str | None, default=None,
                        help=f"fit's resume checkpoint, as a saved config.yaml has it; {command} does not read it")
    parser.add_argument("--weights_only", type=bool | None, default=None,
                        help=f"fit's checkpoint-loading flag, as a saved config.yaml has it; {command} does not read it")


class PrepareCLI(LilicorrCLI):
    """``fit``'s parser; builds the data module, and the system on the meta device only to ask which stores a fit
    will read (no weights, no warm starts, no trainer or logger)."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        super().add_arguments_to_parser(parser)
        add_saved_fit_arguments(parser, "prepare")  # the stores depend on the data and the target, not on weights

    def instantiate_classes(self) -> None:
        self.datamodule, _ = dry_build(self.config, self.datamodule_class, self.model_class)


def _training_files_against(trained_on: Any, saved_data: Mapping[str, Any],
                            data: Mapping[str, Any]) -> dict[str, Any]:
    """This run's training files against those the checkpoint trained beside (``trained_on``: its recorded
    ``data_files.train_files``), as :func:`check_resume_split` / :func:`check_evaluation_settings` take them:
    ``same_files``, whether they hold the recorded content (another path to the same bytes is the same data: a moved
    run folder, a job's local copy; where the checkpoint recorded none, by the places they name), and ``edited``,
    those under the paths it named whose content changed. Nothing is read where held-out files are given."""
    if data.get("val_files"):
        return {}
    same_paths = _resolved(saved_data.get("train_files")) == _resolved(data.get("train_files"))
    if not trained_on:  # a checkpoint of an earlier version
        return {"same_files": same_paths}
    try:
        now = fingerprint_files(check_data_files(data["train_files"], "data.train_files"))
    except (ValueError, OSError):  # unreadable files: the data module's checks say so, in their words
        return {}
    changed = edited_files(trained_on, now)  # position by position: [] also where the lists differ in length
    return {"same_files": len(trained_on) == len(now) and not changed, "edited": changed if same_paths else []}


def _template_as_trained(setting: Any, recorded: Any, now: Any) -> Any:
    """The checkpoint's ``data.chat_template`` as its data was rendered with it, for the split comparison: the text it
    recorded (``recorded``; older checkpoints record the setting) in place of the path it was read from (``setting``),
    so a file edited in place since is another template; where this run names the same file, which no longer holds
    that text, a value that says so (compared, it differs from every template)."""
    if not isinstance(recorded, str) or setting is None:
        return setting
    named_again = isinstance(setting, str) and isinstance(now, str) and _resolved(setting) == _resolved(now)
    if named_again and setting != recorded:
        try:
            same = resolve_chat_template(now) == recorded
        except (OSError, ValueError):
            same = False
        if not same:
            return f"{setting} as the checkpoint read it (edited since)"
    return recorded


def _resolved(files: Any) -> Any:
    """Data file settings compared as places: built-in data by their key-bearing names, other paths resolved (a
    relative path and an absolute one to the same file are one place)."""
    names = portable([files] if isinstance(files, str) else files)
    if not isinstance(names, list):
        return names
    return [name if str(name).startswith("<") else os.path.realpath(os.path.expanduser(str(name))) for name in names]


def dry_build(config: Any, datamodule_class: type[DraftDataModule] = DraftDataModule,
              model_class: type[DraftSystem] = DraftSystem,
              target_path: str | None = None, warm_starts: bool = False) -> tuple[DraftDataModule, DraftSystem]:
    """A run's data module, and its system on the meta device (no weights): every setting their constructors check,
    for the price of reading the target's config; with ``init_drafter_layers_from_target``, what the target's config
    shows of it (enough layers, the same sizes). ``target_path``: a folder holding the target's ``config.json`` in
    place of the configured target (a built-in one not built yet). ``warm_starts``: the ``init_drafter_from`` /
    ``init_head_from`` directories read and checked against the system too (their files are read in full). A refusal
    is one line."""
    import torch
    from jsonargparse import namespace_to_dict

    from lilicorr_pl.models.target_init import check_target_layer_init

    model = config["model"].clone()
    from_target_layers = bool(model.get("init_drafter_layers_from_target"))
    if not warm_starts:
        model.init_drafter_from = model.init_head_from = None
    model.init_drafter_layers_from_target = False
    data = {k: v for k, v in namespace_to_dict(config["data"]).items() if not k.startswith("__")}  # __path__: a file's
    if target_path is not None:
        model.target.name_or_path = target_path
        if data.get("target") is not None:
            data["target"]["name_or_path"] = target_path
    parser = LightningArgumentParser(parser_mode="omegaconf")
    parser.add_lightning_class_args(model_class, "model", subclass_mode=False)
    try:
        datamodule = datamodule_class(**data)
        with torch.device("meta"):
            system = parser.instantiate_classes(Namespace(model=model)).model
            if from_target_layers:
                check_target_layer_init(system.drafter, system.target_spec.trust_remote_code)
                system.hparams["init_drafter_layers_from_target"] = True  # as configured: checked, not read (meta)
        wire_logit_cache(system, datamodule)
    except (ValueError, TypeError) as err:  # a constructor's reason, not jsonargparse's "Given value: Namespace(…)"
        raise UserInputError(constructor_reason(str(err)) if str(err).strip() else repr(err)) from None
    return datamodule, system


@contextlib.contextmanager
def _torch_flags_kept() -> Iterator[None]:
    """The process-wide settings a Trainer's constructor changes (``deterministic``, ``benchmark``), restored after
    it: the run's own Trainer sets them again, after the build."""
    import torch

    kept = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
            os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(kept[0], warn_only=kept[1])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = kept[2], kept[3]
        if kept[4] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = kept[4]


PREPARE_TRAINER_KEYS = ("accelerator", "devices", "num_nodes")  # the Trainer settings `lilicorr prepare` reads


def built_trainer_settings(trainer: Any, trainer_class: type[Trainer] = Trainer) -> dict[str, Any]:
    """The Trainer's settings of a parsed config, with their classes built as the run builds them (loggers, callbacks,
    strategy, plugins, profiler, with nested ``class_path`` arguments): constructors only, which write or start
    nothing (a logger's run starts at its first use). A refusal is one line: the constructor's own reason, not
    jsonargparse's account of the union it tried."""
    parser = LightningArgumentParser(parser_mode="omegaconf")
    parser.add_lightning_class_args(trainer_class, "trainer")
    try:
        built = parser.instantiate_classes(Namespace(trainer=trainer.clone())).trainer
    except (ValueError, TypeError, ImportError, MisconfigurationException) as err:  # a constructor's, maybe wrapped
        raise UserInputError(constructor_reason(str(err)) if str(err).strip() else repr(err)) from None
    return {k: built[k] for k in built.keys() if "." not in k and not k.startswith("__")}


WANDB_OFFLINE_MODES = ("offline", "disabled", "dryrun")
WANDB_LOGIN_FIX = ("run `wandb login` or set WANDB_API_KEY, or log offline (trainer.logger.init_args.offline: true, "
                   "or WANDB_MODE=offline) and `wandb sync` later")


def online_wandb_loggers(trainer: Any) -> list[str]:
    """The class paths of ``trainer.logger``'s W&B loggers that would log online (a parsed config's; neither
    ``offline`` nor an offline ``mode`` set, and no offline ``WANDB_MODE`` in the environment)."""
    if trainer is None or os.environ.get("WANDB_MODE", "").lower() in WANDB_OFFLINE_MODES:
        return []
    def logs_online(offline: Any, mode: Any, settings: Any) -> bool:
        # wandb.Settings of its own (a key, a host, a mode): the run's start reads them, not this check
        return not offline and not settings and str(mode or "").lower() not in WANDB_OFFLINE_MODES

    loggers = trainer.get("logger")
    online = []
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        if isinstance(logger, WandbLogger):  # an instance, given by a caller of the CLI
            init = getattr(logger, "_wandb_init", None) or {}  # what its run will start with
            if logs_online(getattr(logger, "_offline", False), init.get("mode"), init.get("settings")):
                online.append(f"{type(logger).__module__}.{type(logger).__name__}")
            continue
        if not isinstance(logger, (Namespace, Mapping)) or not logger.get("class_path"):
            continue
        module, _, name = str(logger["class_path"]).rpartition(".")
        try:  # imported now as the Trainer's instantiation would import it
            cls = getattr(importlib.import_module(module), name) if module else None
        except (ImportError, AttributeError, ValueError):
            continue  # not ours to judge: its instantiation says what is wrong
        if not (isinstance(cls, type) and issubclass(cls, WandbLogger)):
            continue
        init = plain_data(logger.get("init_args") or {})
        extra = plain_data(logger.get("dict_kwargs") or {})
        if logs_online(init.get("offline", False), extra.get("mode", init.get("mode")),
                       init.get("settings") or extra.get("settings")):
            online.append(str(logger["class_path"]))
    return online


def refuse_online_wandb_without_credentials(trainer: Any) -> None:
    """An online W&B logger on a machine with no W&B credentials and no terminal to ask for them: one line before
    anything is built. Found only when the run started, it came after a ``builtin:`` target's build or a hub target's
    download and load (minutes to an hour), where wandb then failed. In a terminal wandb asks for a key when the run
    starts, as it always has; the process that starts the run checks (rank zero of node zero). wandb's settings that
    log offline or not at all (``wandb offline``) are wandb's to apply: nothing to check."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    online = online_wandb_loggers(trainer)
    node = os.environ.get("NODE_RANK", "0")
    if (not online or getattr(rank_zero_only, "rank", 0) != 0 or (node.isdigit() and int(node) != 0)
            or _wandb_can_ask()):
        return
    import wandb

    if wandb.run is not None:  # a run of this process's own (a caller's): the logger joins it, no login needed
        return
    try:
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth

        settings = wandb_setup.singleton().settings  # the environment's and the settings files' (no service started)
        if settings._noop or settings._offline:
            return
        # wandb's own lookup (WANDB_API_KEY, an identity token file, its settings files, .netrc), as a run's start
        # makes it: nothing asked (prompt=False), nothing sent to the server, the session left as it was.
        found = wbauth.authenticate_session(host=wbauth.HostUrl(settings.base_url, app_url=settings.app_url),
                                            source="lilicorr", prompt=False, update_session=False)
    except (ImportError, AttributeError, TypeError):  # a wandb without these (older): the run's start checks
        return
    except Exception as err:  # noqa: BLE001 - wandb's own: a key of the wrong form, a token file it cannot read
        if type(err).__module__.startswith("pydantic"):  # a setting of the wrong form (WANDB_MODE=bogus)
            raise UserInputError(f"W&B's settings are not valid ({' '.join(str(err).split())[:300]}); fix the "
                                 "WANDB_* variable or wandb settings file it names") from None
        if not type(err).__module__.startswith("wandb"):
            raise
        raise UserInputError(f"W&B could not start an online run ({first_line(err)}); {WANDB_LOGIN_FIX}") from None
    if found is None:
        raise UserInputError(f"W&B has no credentials for the online run of {online[0]} (no API key configured and no "
                             f"terminal to ask for one); {WANDB_LOGIN_FIX}")


def _wandb_can_ask() -> bool:
    """Whether wandb would ask for a key when a run starts (its own test where it has one: a terminal on stdin and
    stderr, or Jupyter)."""
    try:
        from wandb.errors import term

        return bool(term.can_use_terminput())
    except (ImportError, AttributeError):
        return is_terminal(sys.stdin) and is_terminal(sys.stderr)


def dry_trainer(settings: dict[str, Any], trainer: Any, trainer_class: type[Trainer] = Trainer,
                loggers: bool = False) -> Trainer:
    """The checks the Trainer's constructor makes of ``settings`` (:func:`built_trainer_settings`; those left out at
    the Trainer's defaults): an accelerator or device count this machine lacks, a strategy it cannot run, a limit out
    of range, ``enable_checkpointing=false`` beside a ``ModelCheckpoint``. The process-wide flags it sets are put back.
    A refusal is one line, as the Trainer's own is after the build (``trainer``: the parsed settings, named in it).
    Returns that Trainer; ``loggers``: with the settings' loggers (constructors only: a logger's run starts at its first
    use), so its ``log_dir`` and checkpoint folders are the run's; else with none."""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")  # "GPU available: ...", said by the run
    level = logger.level
    try:
        logger.setLevel(logging.WARNING)
        with warnings.catch_warnings(), _torch_flags_kept():
            warnings.simplefilter("ignore")  # the run's own Trainer warns, once
            return trainer_class(**settings if loggers else {**settings, "logger": False})
    except (ValueError, TypeError, MisconfigurationException) as err:
        message = str(err).strip().splitlines()[-1] if str(err).strip() else repr(err)
        if isinstance(err, MisconfigurationException):
            message = with_device_advice(message, trainer)
        raise UserInputError(message) from None
    finally:
        logger.setLevel(level)


def prepare_command(argv: Sequence[str]) -> Any:
    """``lilicorr prepare -c CONFIG [--trainer.devices=N]``: the config's data stores on every device.

    The training config's data module, precomputed with the devices of its ``trainer`` section by
    :func:`lilicorr_pl.data.prepare.prepare`: the files ``fit``'s ``prepare_data`` would write.
    """
    from lilicorr_pl.data.prepare import prepare

    cli = run_lightning(argv, description=prepare_command.__doc__ or "", cli_class=PrepareCLI, prog="lilicorr prepare",
                        run=False, save_config_callback=None)
    trainer = cli.config["trainer"]
    try:
        return prepare(cli.datamodule, accelerator=trainer["accelerator"], devices=trainer["devices"],
                       num_nodes=trainer["num_nodes"])
    except (DataFormatError, CacheError) as err:  # what fit says in one line, too
        raise UserInputError(first_line(err)) from None
    except MisconfigurationException as err:  # e.g. no such accelerator here
        raise UserInputError(with_device_advice(first_line(err), trainer)) from None


def with_device_advice(message: str, trainer: Any) -> str:
    """Lightning's refusal of an accelerator or device count this machine lacks, with the settings that asked for it
    and the fix (other messages unchanged)."""
    if not any(w in message.lower() for w in ("accelerator", "gpu", "cuda", "device", "backend", "tpu")):
        return message
    return (f"{message} (trainer.accelerator {trainer.get('accelerator')}, trainer.devices {trainer.get('devices')}); "
            "set them to what this machine has, e.g. --trainer.accelerator=cpu")


CLI_KWARGS: dict[str, Any] = {
    "save_config_callback": LoggerSaveConfigCallback,
    "save_config_kwargs": {"overwrite": True},
    "auto_configure_optimizers": False,
}


def run_lightning(args: Sequence[str] | None, description: str = "", cli_class: type[LilicorrCLI] = LilicorrCLI,
                  prog: str = "lilicorr", **kwargs: Any) -> LilicorrCLI:
    """``lilicorr fit|validate|test|predict ...``: parse, check, build and run; user errors raise ``UserInputError``."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # allow_abbrev off: `--model.num_anchor=7` set num_anchors by prefix, and any prefix stops working (or means
    # another option) the day a longer name is added; an option is named in full.
    parser_kwargs = {"parser_mode": "omegaconf", "prog": prog, "description": description or __doc__,
                     "allow_abbrev": False}
    try:
        return cli_class(DraftSystem, DraftDataModule, args=None if args is None else list(args),
                         parser_kwargs=parser_kwargs, **{**CLI_KWARGS, **kwargs})
    except DataFormatError as err:  # a data file that cannot be read: what is wrong and where, in one line
        raise UserInputError(str(err)) from None
