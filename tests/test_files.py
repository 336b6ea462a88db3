"""Results files: written atomically, saying what wrote them, and never written over a file the tool did not write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lilicorr_pl.files import check_output_paths, write_results_json, written_by_lilicorr


def test_a_rerun_may_replace_its_own_results_and_never_a_users_file(tmp_path):
    out = tmp_path / "results.json"
    check_output_paths(str(out), None)  # nothing there yet
    write_results_json(out, {"tau": float("nan"), "rows": [1]}, "bench")
    payload = json.loads(out.read_text())
    assert payload == {"written_by": payload["written_by"], "tau": None, "rows": [1]}  # NaN as null, marker first
    assert payload["written_by"].startswith("lilicorr bench ") and list(payload)[0] == "written_by"
    check_output_paths(str(out), None)  # its own results: a rerun replaces them
    for name, text in [("notes.txt", "my notes"), ("config.json", '{"architectures": ["Qwen3ForCausalLM"]}'),
                       ("list.json", "[1, 2]"), ("spoof.json", '{"written_by": "someone else"}')]:
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=rf"--json .*{name} exists and is not a results file lilicorr wrote"):
            check_output_paths(str(tmp_path / name), None, "--json")
        assert (tmp_path / name).read_text() == text


def test_a_json_without_written_by_is_never_guessed_to_be_the_tools(tmp_path):
    """Files written before `written_by` existed were recognised by keys (`step_total`, `{ops, device, settings}`,
    `tau_includes_bonus_token`, ...), which a user's own JSON may hold too: `perf --json plan.json` replaced a serving
    plan. Now only a file that says `written_by: lilicorr ...` (or an empty one, mktemp's) is replaced."""
    users = {"plan.json": {"device": "cuda:0", "settings": {}, "ops": [], "note": "my serving plan"},
             "perf.json": {"step_total": 12.5, "note": "my measurement"},
             "demo.json": {"mode": "full", "tau_includes_bonus_token": True, "results": []},
             "timing.json": {"settings": {}, "plain_step_ms": 5.0, "arms": {}}}
    for name, payload in users.items():
        (tmp_path / name).write_text(json.dumps(payload))
        assert not written_by_lilicorr(tmp_path / name), name
        for command in ("bench", "demo", "perf"):
            assert not written_by_lilicorr(tmp_path / name, command), (name, command)
            with pytest.raises(ValueError, match=rf"{name} exists and is not a results file lilicorr wrote"):
                check_output_paths(str(tmp_path / name), None, "--json", command=command)
        assert json.loads((tmp_path / name).read_text()) == payload
    (tmp_path / "empty.json").write_text("")  # mktemp's: nothing to lose
    assert written_by_lilicorr(tmp_path / "empty.json") and written_by_lilicorr(tmp_path / "empty.json", "perf")


def test_results_and_data_files_get_the_mode_any_new_file_gets(tmp_path, monkeypatch):
    """Under a group-readable umask (027) a results file is 0640 and the built-in data file too; they were a fixed
    0644 (the umask ignored) and tempfile's 0600 (unreadable to the group that shares the cache)."""
    import os

    from lilicorr_pl import builtin

    monkeypatch.setenv("LILICORR_CACHE", str(tmp_path / "cache"))
    umask = os.umask(0o027)
    try:
        write_results_json(tmp_path / "results.json", {"tau": 1.0}, "bench")
        data = builtin.resolve_data_file("builtin:stdlib-train:2")
    finally:
        os.umask(umask)
    assert (tmp_path / "results.json").stat().st_mode & 0o777 == 0o640
    assert os.stat(data).st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_a_writer_of_this_host_name_in_another_pid_space_is_not_taken_for_gone(tmp_path, monkeypatch):
    """A container with this host's name (host networking) and its own pid numbers, or another machine of the same
    name sharing the cache: its writer's pid means nothing here, so its fresh temporary file is kept (it counted as
    gone when no local process had that pid, and a live writer's file was deleted) and is removed after a day; a
    writer of this pid space is still judged by its pid, as are names written before the tag said the pid space."""
    import os
    import socket
    import time

    from lilicorr_pl import files

    if files._pid_space() is None:
        pytest.skip("the system does not say which pid space a process is in (not Linux)")
    host, dead_pid = socket.gethostname(), 2 ** 22 + 12345  # above Linux's pid_max: no process has it
    here = tmp_path / f".x.{files.writer_tag()}.tmp"
    assert f"@m{files._pid_space()}-" in here.name
    mine_dead = tmp_path / f".x.w@{host}@{dead_pid}@m{files._pid_space()}-1a2b3c4d.tmp"
    other_space = tmp_path / f".x.w@{host}@{dead_pid}@m0123456789ab-1a2b3c4d.tmp"
    legacy_dead = tmp_path / f".x.w@{host}@{dead_pid}@1a2b3c4d.tmp"
    for path in (here, mine_dead, other_space, legacy_dead):
        path.write_bytes(b"x")
    assert not files.writer_is_gone(here)
    assert files.writer_is_gone(mine_dead) and files.writer_is_gone(legacy_dead)
    assert not files.writer_is_gone(other_space)
    a_day_ago = time.time() - 86400 - 60
    os.utime(other_space, (a_day_ago, a_day_ago))
    assert files.writer_is_gone(other_space)


def test_a_killed_writers_temporary_file_is_removed_when_its_destination_is_written_again(tmp_path, monkeypatch):
    """A SIGKILL inside ``atomic_file`` (a results JSON, the built-in data file, a checkpoint save) skips its clean-up
    and left ``.<name>.<random>.<writer>.tmp`` beside the destination for good; the next write of that destination
    removes it. A live writer's file, another destination's (``[1]`` is not a pattern), a file without a writer tag
    (the user's) stay, and one that cannot be removed (another user's, in a shared folder) does not stop the write."""
    import pathlib
    import signal
    import socket
    import subprocess
    import sys

    from lilicorr_pl import files

    out = tmp_path / "res[1].json"
    killed_here = ("import os, signal, sys\nfrom pathlib import Path\nfrom lilicorr_pl.files import atomic_file\n"
                   "with atomic_file(Path(sys.argv[1]), 'w') as fh:\n"
                   "    fh.write('half'); fh.flush(); os.kill(os.getpid(), signal.SIGKILL)\n")
    run = subprocess.run([sys.executable, "-c", killed_here, str(out)], capture_output=True, text=True)
    assert run.returncode == -signal.SIGKILL, run.stderr
    (killed,) = tmp_path.iterdir()
    assert killed.name.startswith(".res[1].json.") and killed.read_text() == "half" and files.writer_is_gone(killed)
    dead_tag = f"w@{socket.gethostname()}@{2 ** 22 + 12345}@1a2b3c4d.tmp"  # a pid above Linux's pid_max
    live = tmp_path / f".res[1].json.0123456789ab.{files.writer_tag()}.tmp"
    other = tmp_path / f".res1.json.0123456789ab.{dead_tag}"
    users = tmp_path / ".res[1].json.backup.tmp"
    for path in (live, other, users):
        path.write_text("x")
    write_results_json(out, {"tau": 1.0}, "bench")
    assert json.loads(out.read_text())["tau"] == 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, live.name, other.name, users.name])

    stuck = tmp_path / f".stuck.json.0123456789ab.{dead_tag}"
    stuck.write_text("x")
    unlink = pathlib.Path.unlink

    def refused(self, missing_ok=False):
        if self.name == stuck.name:
            raise PermissionError(1, "Operation not permitted", str(self))
        return unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(pathlib.Path, "unlink", refused)
    write_results_json(tmp_path / "stuck.json", {"tau": 2.0}, "bench")
    assert json.loads((tmp_path / "stuck.json").read_text())["tau"] == 2.0 and stuck.exists()


def test_on_windows_a_writers_pid_is_never_signalled(tmp_path, monkeypatch):
    """``os.kill(pid, 0)`` on Windows sends CTRL_C_EVENT to that pid's process group instead of asking whether it runs:
    writers there fall under the day rule, and nothing is sent."""
    import os
    import socket
    import time

    from lilicorr_pl import files

    fresh = tmp_path / f".x.w@{socket.gethostname()}@{2 ** 22 + 12345}@1a2b3c4d.tmp"
    fresh.write_bytes(b"x")
    monkeypatch.setattr(files.os, "kill", lambda *a: pytest.fail(f"os.kill{a} called"))
    monkeypatch.setattr(files.os, "name", "nt")
    assert not files.writer_is_gone(fresh)
    a_day_ago = time.time() - 86400 - 60
    os.utime(fresh, (a_day_ago, a_day_ago))
    assert files.writer_is_gone(fresh)


def test_hold_alone_refuses_a_held_file_and_goes_on_where_locks_do_not_exist(tmp_path, monkeypatch):
    """A second holder gets the one line at once (no wait); a file system that refuses locks (ENOLCK) runs unlocked,
    as before, rather than failing a run that worked."""
    import errno
    import fcntl

    from lilicorr_pl.files import hold_alone

    path = tmp_path / "out.jsonl"
    with open(path, "a") as first, open(path, "a") as second:
        hold_alone(first, "busy")
        with pytest.raises(ValueError, match="^busy$"):
            hold_alone(second, "busy")
    with open(path, "a") as again:
        hold_alone(again, "busy")  # released when the first was closed

    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with open(path, "a") as unlocked:
        hold_alone(unlocked, "busy")


def test_one_commands_results_are_not_replaced_by_another_command(tmp_path):
    """`perf --json` (or `demo --output`) onto a benchmark's results replaced them: any lilicorr results file counted
    as replaceable. Only the command that wrote it may now."""
    bench = tmp_path / "results.json"
    write_results_json(bench, {"runs": []}, "bench")
    check_output_paths(str(bench), None, command="bench")  # bench's rerun
    for command, flag in (("perf", "--json"), ("demo", "--output")):
        with pytest.raises(ValueError, match=rf"{flag} .*results.json holds the results of another lilicorr command "
                                             rf"\(lilicorr bench .*\), which a `lilicorr {command}` run does not"):
            check_output_paths(str(bench), None, flag, command=command)
    assert json.loads(bench.read_text())["written_by"].startswith("lilicorr bench ")


def test_plots_say_what_drew_them_and_only_lilicorr_plots_are_replaced(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lilicorr_pl.files import check_plot_files, png_text, png_written_by_lilicorr, save_figure

    fig, ax = plt.subplots()
    ax.plot([1, 2], [0.5, 0.7])
    ours = save_figure(fig, tmp_path / "plots" / "ours.png", "bench", {"checkpoint": "runs/a/last.ckpt", "seed": 3,
                                                                       "benchmark": "données/中文.jsonl"})
    theirs = tmp_path / "plots" / "theirs.png"
    fig.savefig(theirs)  # matplotlib's own PNG: a user's figure
    plt.close(fig)
    text = png_text(ours)
    assert text["written_by"].startswith("lilicorr bench ") and text["checkpoint"] == "runs/a/last.ckpt"
    assert text["seed"] == "3" and text["benchmark"] == "données/中文.jsonl"  # beyond latin-1: an iTXt entry
    assert png_written_by_lilicorr(ours) and png_written_by_lilicorr(ours, "bench")
    assert not png_written_by_lilicorr(ours, "demo")  # another command's plot
    assert png_text(theirs) is not None and not png_written_by_lilicorr(theirs)
    (tmp_path / "notes.png").write_text("not a PNG at all")
    assert png_text(tmp_path / "notes.png") is None and not png_written_by_lilicorr(tmp_path / "notes.png")
    assert not png_written_by_lilicorr(tmp_path / "missing.png")
    (tmp_path / "empty.png").touch()
    assert png_written_by_lilicorr(tmp_path / "empty.png")  # nothing to lose
    check_plot_files([ours, tmp_path / "missing.png"], "bench")  # its own plot, or a new name: fine
    with pytest.raises(ValueError, match=r"theirs\.png exists and is not a plot `lilicorr bench` wrote, so it is not "
                                         r"overwritten; move it or choose another plot directory"):
        check_plot_files([ours, theirs], "bench")
    with pytest.raises(ValueError, match=r"ours\.png exists and is not a plot `lilicorr demo` wrote"):
        check_plot_files([ours], "demo")  # another command's plot is not taken either
    with pytest.raises(ValueError, match=r"is a directory where a plot would be written"):
        check_plot_files([tmp_path / "plots"], "bench")
    (tmp_path / "link.png").symlink_to(ours)  # even to its own plot: the rename would replace the user's link
    (tmp_path / "dangling.png").symlink_to(tmp_path / "nowhere.png")
    for link, to in (("link.png", ours), ("dangling.png", tmp_path / "nowhere.png")):
        with pytest.raises(ValueError, match=f"{link} is a symbolic link \\(to {to}\\) where a plot would be written; "
                                             "move it or choose another plot directory"):
            check_plot_files([tmp_path / link], "bench")
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["ours.png", "theirs.png"]  # no temp file left


def test_markdown_reports_say_what_wrote_them_and_only_those_are_replaced(tmp_path):
    from lilicorr_pl.files import check_markdown_file, markdown_written_by_lilicorr, write_markdown

    ours = tmp_path / "results.md"
    write_markdown(ours, "| a | b |\n|---|---|\n| τ | 1.0× |", "demo")
    first, *rest = ours.read_text(encoding="utf-8").splitlines()
    assert first.startswith("<!-- written_by: lilicorr demo ") and rest == ["| a | b |", "|---|---|", "| τ | 1.0× |"]
    assert markdown_written_by_lilicorr(ours, "demo") and markdown_written_by_lilicorr(ours)
    assert not markdown_written_by_lilicorr(ours, "bench")  # another command's report is not taken
    (tmp_path / "empty.md").touch()
    assert markdown_written_by_lilicorr(tmp_path / "empty.md")  # nothing to lose
    for name, content in (("notes.md", "# my notes\n".encode()), ("latin.md", b"\xe9t\xe9\n"),
                          ("quoted.md", b"see <!-- written_by: lilicorr demo 1 -->\n")):
        (tmp_path / name).write_bytes(content)
        assert not markdown_written_by_lilicorr(tmp_path / name)
        with pytest.raises(ValueError, match=f"{name} exists and is not a report `lilicorr demo` wrote, so it is not "
                                             "overwritten; move it or choose another --output"):
            check_markdown_file(tmp_path / name, "demo", "the table")
    assert not markdown_written_by_lilicorr(tmp_path / "missing.md")
    check_markdown_file(ours, "demo", "the table")  # its own, or a new name: fine
    check_markdown_file(tmp_path / "missing.md", "demo", "the table")
    (tmp_path / "folder.md").mkdir()
    with pytest.raises(ValueError, match="folder.md is a directory where a report would be written; move it or"):
        check_markdown_file(tmp_path / "folder.md", "demo", "the table")
    (tmp_path / "link.md").symlink_to(ours)
    with pytest.raises(ValueError, match=f"link.md is a symbolic link \\(to {ours}\\) where a report would be written; "
                                         "move it or choose another --output"):
        check_markdown_file(tmp_path / "link.md", "demo", "the table")


def test_the_test_session_keeps_its_cache_out_of_the_users():
    """The suite builds targets, data files and digest memos into a cache folder of its own (conftest), removed when
    the session ends: the developer's ~/.cache/lilicorr_pl (or $LILICORR_CACHE) gained a memo per file hashed and
    the test-size target."""
    import os
    from pathlib import Path

    from conftest import SESSION_CACHE, USER_CACHE

    from lilicorr_pl import builtin
    from lilicorr_pl.files import cache_root

    assert cache_root() == Path(SESSION_CACHE) and os.environ["LILICORR_CACHE"] == SESSION_CACHE
    assert USER_CACHE is None or Path(USER_CACHE).resolve() != Path(SESSION_CACHE).resolve()
    data = Path(builtin.resolve_data_file("builtin:stdlib-train:2"))
    assert data.parent.parent == Path(SESSION_CACHE)


def test_first_line_of_an_exception_never_fails_on_an_empty_message():
    """The one-line errors quote a library's message by its first line; an exception without one (a bare
    ``OSError()``) is named by its type. The data store's shard check indexed ``splitlines()[0]`` directly, so such
    an error became an IndexError inside the handler."""
    from lilicorr_pl.checkpoint import first_line

    assert first_line(OSError("  no such file\n  at line 3\n")) == "no such file"
    assert first_line(OSError()) == "OSError" and first_line(ValueError("\n \n")) == "ValueError"
    assert first_line(OSError("gone\nmore"), with_type=True) == "OSError: gone"
    assert first_line(KeyError(), with_type=True) == "KeyError"



def test_links_in_an_output_path_are_named_before_any_work(tmp_path):
    """A link to nothing on the way to --output or --plot passed the check and failed with FileExistsError when the
    results were written, after the whole run; a link as --output was replaced by a plain file, the user's link gone."""
    (tmp_path / "dout").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"--output .*dout/r.json: .*dout is a broken symbolic link \(to .*nowhere\); "
                                         r"choose another path"):
        check_output_paths(str(tmp_path / "dout" / "r.json"), None)
    with pytest.raises(ValueError, match=r"--plot .*dout: .*dout is a broken symbolic link"):
        check_output_paths(None, str(tmp_path / "dout"))
    mine = tmp_path / "mine.json"
    write_results_json(mine, {"rows": []}, "bench")
    (tmp_path / "link.json").symlink_to(mine)
    with pytest.raises(ValueError, match=r"--output .*link.json is a symbolic link \(to .*mine.json\), which a run's "
                                         r"atomic write would replace; pass the path it points to"):
        check_output_paths(str(tmp_path / "link.json"), None)
    assert (tmp_path / "link.json").is_symlink()


def test_a_killed_probes_folder_is_removed_by_the_next_probe_and_nothing_else_is(tmp_path, monkeypatch):
    """check_writable_dir learns that a folder is writable by making an empty folder in it and removing it: a process
    killed between the two left ``.lilicorr-probe-…`` in the user's folder for good. Its name now says which process
    made it, and the next probe there removes it once that process is gone; a live process's probe, a fresh one of
    another pid space, a name without a writer, a folder with something in it, and the user's own files stay."""
    import os
    import socket

    from lilicorr_pl import files

    host, dead_pid = socket.gethostname(), 2 ** 22 + 12345  # above Linux's pid_max: no process has it
    space = files._pid_space()
    tag = f"w@{host}@{dead_pid}@{f'm{space}-' if space else ''}1a2b3c4d"
    killed = tmp_path / f".lilicorr-probe-x1y2.{tag}.tmp"
    live = tmp_path / f".lilicorr-probe-z3w4.{files.writer_tag()}.tmp"
    untagged = tmp_path / ".lilicorr-probe-q8r9"
    mine = tmp_path / f"notes.{tag}.tmp"  # the user's (or another tool's) file with a dead writer's name: not a probe
    held = tmp_path / f".lilicorr-probe-h5j6.{tag}.tmp"  # a dead writer's name, but something is in it: not a probe's
    no_pid = tmp_path / f".lilicorr-probe-k7l8.w@{host}@{10 ** 30}@1a2b3c4d.tmp"  # no process has it (os.kill overflows)
    elsewhere = tmp_path / f".lilicorr-probe-m9n0.w@{host}@{dead_pid}@m0123456789ab-1a2b3c4d.tmp"  # another pid space
    for folder in (killed, live, untagged, held, no_pid, elsewhere):
        folder.mkdir()
    (held / "data.txt").write_text("keep")
    mine.write_text("keep")
    files.check_writable_dir(tmp_path / "runs" / "a", "--output")  # a folder still to be made: probed in tmp_path
    assert not killed.exists() and not no_pid.exists()
    assert live.is_dir() and untagged.is_dir() and mine.read_text() == "keep" and (held / "data.txt").is_file()
    kept = [live, untagged, mine, held, elsewhere]  # another pid space's: gone only after a day untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in kept)

    # A probe that cannot be removed stays behind under its writer's name, so a later probe can tell whose it is.
    monkeypatch.setattr(os, "rmdir", lambda path: (_ for _ in ()).throw(PermissionError(13, "denied")))
    files.check_writable_dir(tmp_path, "--output")
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".lilicorr-probe-") and p not in kept]
    assert len(left) == 1 and files._WRITER.search(left[0].name) and f"@{os.getpid()}@" in left[0].name
    assert not files.writer_is_gone(left[0])


def test_a_damaged_builtin_data_file_is_written_again_not_trained_on(tmp_path, monkeypatch, capsys):
    """A cached ``builtin:stdlib-*`` file was used as it stood: cut to 25 whole records, a fit trained on 25 under the
    built-in name; cut mid-line, it failed naming a line of a file the user never wrote. It is compared with the
    records it caches, and written again with a note; a link in its place is the user's, and refused."""
    from lilicorr_pl import builtin
    from lilicorr_pl.checkpoint import UserInputError

    monkeypatch.setenv("LILICORR_CACHE", str(tmp_path / "cache"))
    data = Path(builtin.resolve_data_file("builtin:stdlib-train:40"))
    whole = data.read_bytes()
    assert len(whole.splitlines()) == 40 and capsys.readouterr().err == ""
    assert builtin.resolve_data_file("builtin:stdlib-train:40") == str(data) and capsys.readouterr().err == ""
    for damaged in (b"".join(whole.splitlines(keepends=True)[:25]), whole[:5000], whole.replace(b"def", b"fed", 1)):
        data.write_bytes(damaged)
        assert builtin.resolve_data_file("builtin:stdlib-train:40") == str(data)
        assert data.read_bytes() == whole
        assert capsys.readouterr().err == (f"lilicorr: {data} does not hold the records of builtin:stdlib-train:40 "
                                           "(damaged or edited); it is written again\n")
    shared = tmp_path / "shared.jsonl"  # a link to a shared copy of the same records is used as it is
    shared.write_bytes(whole)
    data.unlink()
    data.symlink_to(shared)
    assert builtin.resolve_data_file("builtin:stdlib-train:40") == str(data) and data.is_symlink()
    shared.write_text('{"text": "my own"}\n')  # a link to other records is the user's: refused, never replaced
    with pytest.raises(UserInputError, match=f"{data} is a symbolic link that does not hold the records of "
                                             r"builtin:stdlib-train:40; move it out of the cache folder"):
        builtin.resolve_data_file("builtin:stdlib-train:40")
    assert shared.read_text() == '{"text": "my own"}\n' and data.is_symlink()


def test_a_relative_cache_setting_is_taken_from_the_working_folder_once(tmp_path, monkeypatch):
    """A relative LILICORR_CACHE gave relative target paths, which the demo's stages (each run in its run folder) and
    the checkpoints recording them read elsewhere: every --jobs 2 stage failed."""
    from lilicorr_pl.files import cache_root

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LILICORR_CACHE", "cache")
    assert cache_root() == tmp_path / "cache" and cache_root().is_absolute()
    monkeypatch.delenv("LILICORR_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", "xdg")
    assert cache_root() == tmp_path / "xdg" / "lilicorr_pl"
