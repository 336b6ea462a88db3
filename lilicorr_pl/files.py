"""Writing results safely: output paths checked before any work, JSON written atomically.

Shared by every command that writes results (``bench``, ``export``, ``demo``, ``regenerate``), so each
refuses an unwritable destination the same way, before heavy work, and never leaves a half-written file.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import glob as _glob
import hashlib
import json
import math
import os
import re
import shutil
import socket
import tempfile
import uuid
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator


def cache_root() -> Path:
    """``$LILICORR_CACHE``, else ``$XDG_CACHE_HOME/lilicorr_pl``, else ``~/.cache/lilicorr_pl``: built targets,
    built-in data files, file digests. Absolute, a relative setting taken from the working folder: a path into it is
    handed to processes that run elsewhere (the demo's stages, each in its run folder) and recorded in checkpoints."""
    if os.environ.get("LILICORR_CACHE"):
        root = Path(os.environ["LILICORR_CACHE"]).expanduser()
    elif os.environ.get("XDG_CACHE_HOME"):
        root = Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "lilicorr_pl"
    else:
        root = Path.home() / ".cache" / "lilicorr_pl"
    return Path(os.path.abspath(root))


def file_state(path: str | os.PathLike) -> tuple[int, int, int, int]:
    """What changes whenever a file's bytes may have: its inode, size, modification and status-change times
    (``ctime`` moves on every write and cannot be set back by the writer). Not the device number, which each client
    of a network file system numbers its own way."""
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


WHERE_LOAD_KWARGS = ("revision", "subfolder", "token", "cache_dir", "local_files_only")
"""The ``from_pretrained`` arguments that say which files a model name reads: passed on wherever a name is
resolved before its model loads (its ``config.json`` read for the layer check, a hub name's commit for a store key),
so that read sees the files the load will."""


def where_load_kwargs(load_kwargs: Any) -> dict[str, Any]:
    """The :data:`WHERE_LOAD_KWARGS` that ``load_kwargs`` sets (to a value: a None is not passed on)."""
    return {k: v for k, v in (load_kwargs or {}).items() if k in WHERE_LOAD_KWARGS and v is not None}


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
                       plot_fix: str = "pass a directory for the PNGs", command: str | None = None,
                       output_fix: str = "choose another file name") -> None:
    """Raise ``ValueError`` when results could not be written, before any benchmark work starts, or would replace a
    file that is not a results file of this tool (:func:`written_by_lilicorr`): a rerun may replace its own results,
    never a user's file, nor (given ``command``) another command's results (``output_flag`` / ``plot_flag``: what
    named ``output`` / ``plot``, and ``output_fix`` / ``plot_fix`` the fixes, for the messages)."""
    if output:
        out = Path(output)
        if out.is_symlink():  # the rename into place would replace the link itself (the user's), not what it names
            raise ValueError(f"{output_flag} {out} is a symbolic link (to {os.readlink(out)}), which a run's atomic write "
                             f"would replace; pass the path it points to, or another file name")
        if out.is_dir():
            raise ValueError(f"{output_flag} {out} is a directory; " + (
                f"pass a file name such as {out / 'results.json'}" if output_fix == "choose another file name"
                else output_fix))
        if out.exists() and not written_by_lilicorr(out, command):  # its own results: read once; else say whose
            if not written_by_lilicorr(out):
                raise ValueError(f"{output_flag} {out} exists and is not a results file lilicorr wrote, so it is not "
                                 f"overwritten; {output_fix}")
            raise ValueError(f"{output_flag} {out} holds the results of another lilicorr command "
                             f"({_writer(out)}), which a `lilicorr {command}` run does not replace; {output_fix}")
        check_writable_dir(out.parent, f"{output_flag} {out}")
    if plot:
        directory = Path(plot)
        if directory.exists() and not directory.is_dir():
            raise ValueError(f"{plot_flag} {directory} is a file; {plot_fix}")
        check_writable_dir(directory, f"{plot_flag} {directory}")


_PROBE = ".lilicorr-probe-"
"""The name's start of the empty folder :func:`check_writable_dir` makes and removes to learn a folder is writable."""


def check_writable_dir(directory: Path, what: str, writable: bool = True) -> None:
    """Raise ``ValueError`` unless ``directory`` exists or can be created, and is writable (``what`` names it;
    ``writable=False``: a folder that may already hold everything a command reads, write access left to its writer)."""
    probe = directory
    while not probe.exists():
        if probe.is_symlink():  # a link to nothing: creating the folder failed with FileExistsError, at the end
            raise ValueError(f"{what}: {probe} is a broken symbolic link (to {os.readlink(probe)}); choose another "
                             "path, or create what it points to")
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"{what}: {probe} is a file, so the directory cannot be created; choose another path")
    if writable and not os.access(probe, os.W_OK):
        raise ValueError(f"{what}: {probe} is not writable; choose another path")
    if writable or probe != directory:  # tried, not read from the mode bits: root, read-only mounts, /proc
        # A probe killed before its removal left its empty folder, named by its writer: the next probe here removes it.
        remove_gone_writers(probe, f"{_PROBE}*.tmp", empty_folders=True)
        try:  # a folder still to be made needs one made in its nearest existing parent
            made = tempfile.mkdtemp(prefix=_PROBE, suffix=f".{writer_tag()}.tmp", dir=probe)
        except OSError as err:
            raise ValueError(f"{what}: no folder can be created in {probe} ({err.strerror or type(err).__name__}); "
                             "choose another path") from None
        with contextlib.suppress(OSError):  # an empty folder of its own; left behind only if it cannot go
            os.rmdir(made)


WRITTEN_BY = "written_by"
"""The key of a results file that names the command and version that wrote it (:func:`write_results_json`)."""
def _read_results(path: Path) -> dict[str, Any] | None:
    """A results file's JSON object, or None (unreadable, not JSON, not an object, over 1 GiB)."""
    try:
        if path.stat().st_size > 1 << 30:
            return None
        with open(path, encoding="utf-8") as fh:
            payload = json.load(fh)
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return payload if isinstance(payload, dict) else None


def _writer(path: Path) -> str:
    """What wrote a results file, for a message: its ``written_by``."""
    payload = _read_results(path) or {}
    return str(payload.get(WRITTEN_BY))


def written_by_lilicorr(path: Path, command: str | None = None) -> bool:
    """Whether ``path`` may be replaced as this tool's results: an empty file, or a JSON results file naming
    ``lilicorr`` under :data:`WRITTEN_BY`. Given ``command`` (``bench``, ``demo``, ``perf``), only that command's: a
    benchmark's results are not replaced by a timing run. A file without that key is never guessed to be one (the
    keys results of versions before it held are keys a user's own JSON may hold too)."""
    return _replaceable(path, command, lambda: str((_read_results(path) or {}).get(WRITTEN_BY, "")))


def _replaceable(path: Path, command: str | None, writer: Callable[[], str]) -> bool:
    """The rule every ``*_written_by_lilicorr`` applies: an empty file (nothing to lose: ``mktemp``), or one whose
    ``writer()`` (what it says wrote it; "" when it says nothing, or cannot be read) names ``lilicorr`` and, given
    ``command``, that command."""
    try:
        if path.stat().st_size == 0:
            return True
    except OSError:
        return False
    said = writer()
    return said.startswith("lilicorr ") and (command is None or said.split(" ")[1:2] == [command])


def refuse_foreign(path: Path, flag: str, what: str, command: str, ours: bool, fix: str) -> None:
    """Raise ``ValueError`` for a ``path`` where ``what`` (a plot, a report) of ``lilicorr <command>`` would be written
    that is a symbolic link, a directory, or exists and is not ``ours`` (``fix``: the way out, after "move it or")."""
    if path.is_symlink():  # the rename into place would replace the link itself (the user's), not what it names
        raise ValueError(f"{flag}: {path} is a symbolic link (to {os.readlink(path)}) where {what} would be written; "
                         f"move it or {fix}")
    if path.is_dir():
        raise ValueError(f"{flag}: {path} is a directory where {what} would be written; move it or {fix}")
    if path.exists() and not ours:
        raise ValueError(f"{flag}: {path} exists and is not {what} `lilicorr {command}` wrote, so it is not "
                         f"overwritten; move it or {fix}")


def write_results_json(path: Path, payload: dict[str, Any], command: str) -> None:
    """A command's results (``bench --output``, ``demo --output``, ``perf --json``), atomically, saying what wrote
    them (``"written_by": "lilicorr <command> <version>"``) so a rerun may replace them and nothing else."""
    from lilicorr_pl import __version__

    write_json_atomic(path, {WRITTEN_BY: f"lilicorr {command} {__version__}", **jsonable(payload)})


def _markdown_marker(command: str) -> str:
    from lilicorr_pl import __version__

    return f"<!-- {WRITTEN_BY}: lilicorr {command} {__version__} -->"


def markdown_written_by_lilicorr(path: Path, command: str | None = None) -> bool:
    """Whether ``path`` may be replaced as a Markdown report of this tool: an empty file, or one whose first line is
    the comment :func:`write_markdown` puts there, naming ``lilicorr`` (and ``command``, given one)."""
    def writer() -> str:
        try:
            with open(path, encoding="utf-8") as fh:
                first = fh.readline(4096).rstrip("\n")
        except (OSError, UnicodeDecodeError):
            return ""
        found = re.fullmatch(f"<!-- {WRITTEN_BY}: (.*) -->", first)
        return found.group(1) if found else ""

    return _replaceable(path, command, writer)


def check_markdown_file(path: Path, command: str, flag: str) -> None:
    """Raise ``ValueError`` when ``path`` holds something ``lilicorr <command>`` did not write (``flag`` names what
    chose the path, for the message), before any work starts: a rerun replaces its own report, nothing else."""
    refuse_foreign(path, flag, "a report", command, markdown_written_by_lilicorr(path, command),
                   "choose another --output")


def write_markdown(path: Path, text: str, command: str) -> None:
    """A command's Markdown report, atomically, its first line a comment saying what wrote it (so a rerun may replace
    it and nothing else)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, "wb") as fh:
        fh.write(f"{_markdown_marker(command)}\n{text.rstrip()}\n".encode("utf-8"))


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_text(path: Path, limit: int = 1 << 20) -> dict[str, str] | None:
    """The text entries of a PNG file (``tEXt``, and ``iTXt``, where a writer puts what latin-1 cannot hold), read
    from its first ``limit`` bytes, or None if it is not a PNG."""
    import zlib

    try:
        with open(path, "rb") as fh:
            data = fh.read(limit)
    except OSError:
        return None
    if not data.startswith(_PNG_SIGNATURE):
        return None
    entries, at = {}, len(_PNG_SIGNATURE)
    while at + 8 <= len(data):
        length, kind = int.from_bytes(data[at : at + 4], "big"), data[at + 4 : at + 8]
        body = data[at + 8 : at + 8 + length]
        if kind == b"tEXt" and b"\0" in body:
            key, _, value = body.partition(b"\0")
            entries[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"iTXt" and b"\0" in body:  # key, compressed?, method, language, translated key, UTF-8 text
            key, _, rest = body.partition(b"\0")
            compressed, rest = rest[:1] == b"\1", rest[2:]
            value = rest.split(b"\0", 2)[-1] if rest.count(b"\0") >= 2 else b""
            try:
                entries[key.decode("latin-1")] = (zlib.decompress(value) if compressed else value).decode("utf-8")
            except (zlib.error, UnicodeDecodeError):  # a damaged entry: left out, as an unreadable file would be
                pass
        if kind in (b"IDAT", b"IEND"):  # matplotlib writes its text before the image data
            break
        at += 12 + length
    return entries


def png_written_by_lilicorr(path: Path, command: str | None = None) -> bool:
    """Whether ``path`` may be replaced as a plot of this tool: an empty file, or a PNG whose ``written_by`` text
    names ``lilicorr`` (and ``command``, given one)."""
    return _replaceable(path, command, lambda: (png_text(path) or {}).get(WRITTEN_BY, ""))


def check_plot_files(paths: Iterable[Path], command: str, flag: str = "--plot") -> None:
    """Raise ``ValueError`` for a plot path that holds something ``lilicorr <command>`` did not write (a user's file
    of that name, or another command's plot), before any work starts: a rerun replaces its own plots, nothing else."""
    for path in paths:
        refuse_foreign(path, flag, "a plot", command, png_written_by_lilicorr(path, command),
                       "choose another plot directory")


def save_figure(fig: Any, path: Path, command: str, about: dict[str, str] | None = None, dpi: int = 120) -> Path:
    """Save a matplotlib figure as PNG atomically (a reader sees the previous file or the new one, whole), with
    ``written_by`` (``lilicorr <command> <version>``) and ``about`` (what produced it) as PNG text, so a rerun may
    replace it and a reader can tell which run drew it."""
    from lilicorr_pl import __version__

    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"Software": f"lilicorr {__version__}", WRITTEN_BY: f"lilicorr {command} {__version__}",
                **{k: str(v) for k, v in (about or {}).items()}}
    with atomic_file(path, "wb") as fh:
        fig.savefig(fh, format="png", dpi=dpi, metadata=metadata)
    return path


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write JSON under a temporary name beside ``path`` and rename it into place; never leave the temp file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, "w") as fh:
        json.dump(payload, fh, indent=2)


@contextlib.contextmanager
def atomic_file(path: Path, mode: str, sync: bool = False) -> Iterator[IO[Any]]:
    """``with atomic_file(path, "w") as fh``: written to :func:`create_temporary`'s file beside ``path`` (flushed to
    disk first with ``sync``), renamed over ``path`` when the block ends, and removed if it fails: a reader sees the
    previous file or the new one, whole. What a killed writer of ``path`` left (a SIGKILL skips that removal) is
    removed first (:func:`remove_gone_writers`, once per destination in a process: a folder may be large, and a writer
    killed while this process runs is the next one's to clear)."""
    _remove_gone_writers_once(os.path.abspath(path.parent), f".{_glob.escape(path.name)}.*.tmp")
    fd, tmp = create_temporary(path)
    try:
        with os.fdopen(fd, mode) as fh:
            yield fh
            if sync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def temporary_name(path: Path) -> Path:
    """``.<name>.<random>.<writer_tag()>.tmp`` beside ``path``: where something is made before it is renamed over
    ``path`` (one atomic step on one file system), named so a clean-up knows whether its writer still runs."""
    return path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}.{writer_tag()}.tmp"


def create_temporary(path: Path) -> tuple[int, Path]:
    """A new file at :func:`temporary_name` of ``path``, open for writing (its descriptor, and its path).

    Created with the mode any new file gets (0666 less the umask, as ``open`` would give ``path`` itself), not
    ``tempfile``'s 0600, since the renamed file is what others read; and exclusively, so two writers never share one."""
    while True:
        tmp = temporary_name(path)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        except FileExistsError:  # pragma: no cover - 48 random bits
            continue
        return fd, tmp


def new_file_mode(folder: Path) -> int:
    """The permission bits a new file gets in ``folder`` (0666 less the umask, or what the folder's default ACL
    says), read from a probe file: for files that a library writes with a mode of its own (safetensors: 0600), set
    before they are published. Reading the umask itself (``os.umask``) would change it for a moment in every thread."""
    _remove_gone_writers_once(os.path.abspath(folder), ".mode-probe.*.tmp")
    fd, probe = create_temporary(folder / "mode-probe")
    try:
        return os.fstat(fd).st_mode & 0o777
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def writer_tag() -> str:
    """``w@<host>@<pid>@m<machine>-<rand>``: put in a temporary file's or directory's name, it says which process is
    writing it, so a clean-up of killed writers' leftovers (:func:`writer_is_gone`) never removes a live writer's.
    ``@`` is in no host name, so the host is read whole (host names hold dots and hyphens, and one host's name can end
    another's). ``<machine>`` tells apart what the host name does not: a container with the host's name (host
    networking) and its own pid numbers, or another machine of the same name sharing the cache (:func:`_pid_space`)."""
    space = _pid_space()
    return f"w@{socket.gethostname()}@{os.getpid()}@{f'm{space}-' if space else ''}{uuid.uuid4().hex[:8]}"


@functools.cache
def _pid_space() -> str | None:
    """Which pid numbers this process's pids are: a digest of the machine's boot id and this process's pid namespace
    (equal for two processes exactly when ``os.kill`` in one reaches the other's pids); ``None`` where the system does
    not say (not Linux), and pids are then read as this host's, as before."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    return hashlib.sha256(f"{boot}:{namespace}".encode()).hexdigest()[:12]


_WRITER = re.compile(r"w@([^@/]+)@(\d+)@(?:m([0-9a-f]+)-)?[^@/]+\.tmp$")


def writer_is_gone(tmp: Path) -> bool:
    """Whether the process that named ``tmp`` (``….<writer_tag()>.tmp``) has exited.

    A writer of this host and pid space is checked by its pid; one of another host (a cache on a shared file system)
    or of another pid space (a container with this host's name, another machine of the same name) counts as gone
    after a day untouched, and so does every writer on Windows, where ``os.kill`` cannot ask whether a pid runs. A name
    without a writer tag was not written this way, and counts as gone."""
    tag = _WRITER.search(tmp.name)
    try:
        if tag is None:
            return True
        space = tag.group(3)
        if tag.group(1) == socket.gethostname() and (space is None or space == _pid_space()) and os.name != "nt":
            os.kill(int(tag.group(2)), 0)  # (on Windows, signal 0 is CTRL_C_EVENT: sent, not a check; the day rule)
            return False
        return (_dt.datetime.now().timestamp() - tmp.lstat().st_mtime) > 86400  # a link's own age
    except (ValueError, OverflowError, ProcessLookupError, FileNotFoundError):  # Overflow: no pid is that large
        return True
    except PermissionError:  # alive, owned by someone else
        return False


def remove_gone_writers(folder: Path, pattern: str, untagged: bool = False, empty_folders: bool = False) -> None:
    """Remove what killed writers left in ``folder``: the files and folders matching the glob ``pattern`` whose writer
    tag (:func:`writer_tag`) names a process that is gone (:func:`writer_is_gone`). A name without a writer tag was not
    made that way and is kept, unless ``untagged`` (a folder only this tool writes into); ``empty_folders``: what the
    writer made is an empty folder, and only an empty folder is removed (one with anything in it is not its). Best
    effort: what cannot be removed (another user's, in a shared folder) stays, and the write that asked goes on."""
    for path in sorted(Path(folder).glob(pattern)):
        if (_WRITER.search(path.name) is None and not untagged) or not writer_is_gone(path):
            continue
        try:
            if path.is_dir() and not path.is_symlink():
                (os.rmdir if empty_folders else shutil.rmtree)(path)  # rmdir fails on a folder that holds anything
            elif not empty_folders:
                path.unlink(missing_ok=True)
        except OSError:
            continue


@functools.cache
def _remove_gone_writers_once(folder: str, pattern: str) -> None:
    remove_gone_writers(Path(folder), pattern)


class InUseError(ValueError):
    """Another process holds what this one would write (:func:`hold_alone`)."""


MKDIR_TRIES = 5
"""How many times :func:`folders_made` makes the missing levels again after one above was removed meanwhile."""


@contextlib.contextmanager
def folders_made(folder: Path, what: str, command: str,
                 error: type[ValueError] = ValueError) -> Iterator[dict[Path, tuple[int, int]]]:
    """``folder`` and its missing parents made one level at a time, each level made held open while the block runs.
    Yields the levels made (and still the folders made) with their identity (device and inode), for
    :func:`remove_made_folders` after a failure: a level another process made, or removed and made again, is not
    ours and is never removed, and a level held open keeps its inode number to itself, so one removed and made again
    at its path (which a file system may give a freed number) is never taken for it. ``what`` names the path in a
    refusal (``--output X``), ``command`` the command that makes it, ``error`` the refusal's type. A failure part of
    the way down removes the levels made."""
    opened: list[int] = []
    try:
        yield _make_folders(folder, what, command, error, opened)
    finally:
        for fd in opened:
            os.close(fd)


def _make_folders(folder: Path, what: str, command: str, error: type[ValueError],
                  opened: list[int]) -> dict[Path, tuple[int, int]]:
    made: dict[Path, tuple[int, int]] = {}
    try:
        for _ in range(MKDIR_TRIES):
            try:
                for level in reversed([f for f in (folder, *folder.parents) if not os.path.lexists(f)]):
                    try:
                        level.mkdir()
                    except FileExistsError:
                        if not level.is_dir():
                            raise error(f"{what}: {level} is a file, so the folder cannot be made; choose another "
                                        "path") from None
                        continue  # made by another process since we looked
                    made[level] = folder_identity(level)
                    _hold_open(level, opened)
                return {level: made[level] for level in _still_ours(made)}
            except FileNotFoundError:  # a level above was removed since we looked (another run's clean-up): again
                broken = next((f for f in folder.parents if f.is_symlink() and not f.exists()), None)
                if broken is not None:
                    raise error(f"{what}: {broken} is a broken symbolic link (to {os.readlink(broken)}); choose "
                                "another path, or create what it points to") from None
        raise error(f"{what}: its parent folders kept being removed while this {command} made them (another "
                    f"process cleaning up); run the {command} again")
    except BaseException:
        remove_made_folders(made)
        raise


def _hold_open(folder: Path, opened: list[int]) -> None:
    """A descriptor of ``folder`` added to ``opened`` (nothing where the system cannot open a folder)."""
    try:
        opened.append(os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)))
    except OSError:
        pass


def folder_identity(folder: Path) -> tuple[int, int] | None:
    """``folder``'s device and inode (None where it cannot be read)."""
    try:
        st = folder.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _still_ours(made: dict[Path, tuple[int, int]]) -> list[Path]:
    """The folders in ``made`` still the ones made (the same device and inode), the deepest first."""
    return sorted((f for f, ident in made.items() if ident is not None and folder_identity(f) == ident),
                  key=lambda f: len(f.parts), reverse=True)


def remove_made_folders(made: dict[Path, tuple[int, int]]) -> None:
    """Remove the folders a command made (``made``, from :func:`folders_made`: each with the identity it had when
    made), the deepest first, while empty and still the folder made (a level another process removed and made again
    since, even while the command wrote, is not ours): nothing else. Called on a failure: a folder that cannot be read
    or removed stops it, and the failure that called it is the one raised."""
    try:
        for folder in _still_ours(made):
            if folder.is_symlink() or not folder.is_dir() or any(folder.iterdir()):
                break
            folder.rmdir()
    except OSError:
        pass


@contextlib.contextmanager
def folder_held_alone(folder: Path, busy: str) -> Iterator[os.stat_result | None]:
    """Hold ``folder`` for this process alone while the block runs (:func:`hold_alone` on the folder itself: nothing
    is created in it), or raise ``InUseError(busy)`` at once when another process holds it. Where a folder cannot be
    opened (Windows, an unreadable folder) or locked (NFS, whose emulated locks need a file open for writing) nothing
    is locked. Another open of the folder conflicts even in this process (a lock belongs to its open file). Yields the
    held folder's ``stat`` (None where nothing is held), so a caller can tell it is still the one at ``folder``."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # Windows opens no folder; an unreadable folder, one removed meanwhile: nothing to lock
        fd = None
    if fd is None:
        yield None
        return
    try:
        hold_alone(fd, busy)
        yield os.fstat(fd)
    finally:
        os.close(fd)


def hold_alone(fh: IO[Any] | int, busy: str) -> None:
    """Take an exclusive advisory lock on the open file ``fh`` (or file descriptor), held until it is closed (or its
    process ends, however it ends), or raise ``InUseError(busy)`` at once when another process holds it: two runs
    appending to one output would write every record twice and one would cut the other's half-written line. Where the
    system or the file system has no ``flock`` (Windows, some network mounts) nothing is locked."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        return
    try:
        fcntl.flock(fh if isinstance(fh, int) else fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise InUseError(busy) from None
    except OSError:  # a file system without locks (ENOLCK on some network mounts): unlocked, as before
        return
