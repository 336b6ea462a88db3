"""lilicorr's malloc policy (lilicorr_pl/allocator.py): freed blocks kept for reuse, the user's own tuning respected."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lilicorr_pl import allocator
from lilicorr_pl.cli import main


@pytest.fixture(autouse=True)
def _fresh_policy(monkeypatch):
    monkeypatch.setattr(allocator, "_applied", None)  # what an earlier call in this process applied


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any malloc setting of the user's (or an opt-out, or a preloaded malloc)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD", allocator.OPT_OUT)}
    return {**env, **extra}


class FakeMallopt:
    def __init__(self, returns: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []
        self.returns = returns

    def __call__(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.returns


def test_sets_glibc_thresholds_and_exports_them_to_child_processes():
    environ, mallopt = {"PATH": "/bin"}, FakeMallopt()
    got = allocator.reuse_freed_memory(environ, mallopt)
    # M_MMAP_THRESHOLD (-3) at glibc's 64-bit maximum, then M_TRIM_THRESHOLD (-1).
    assert mallopt.calls == [(-3, 32 * 2**20), (-1, 2**30)]
    assert got == {"policy": "lilicorr", "mmap_threshold": 32 * 2**20, "trim_threshold": 2**30}
    assert environ == {"PATH": "/bin", "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**30)}
    assert allocator.policy() == got  # what the demo's and perf's JSON record


@pytest.mark.parametrize("environ", [
    {"MALLOC_TRIM_THRESHOLD_": "0"},
    {"MALLOC_MMAP_THRESHOLD_": "131072"},
    {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
])
def test_the_users_own_malloc_tuning_is_left_alone(environ):
    before, mallopt = dict(environ), FakeMallopt()
    got = allocator.reuse_freed_memory(environ, mallopt)
    assert mallopt.calls == [] and environ == before
    assert got == {"policy": "environment", "settings": before}
    assert allocator.policy(environ) == got


def test_opt_out_a_failed_mallopt_and_an_unknown_setting():
    environ, mallopt = {"LILICORR_MALLOC": "default"}, FakeMallopt()
    assert allocator.reuse_freed_memory(environ, mallopt) == {"policy": "default", "opted_out": "LILICORR_MALLOC=default"}
    assert mallopt.calls == [] and environ == {"LILICORR_MALLOC": "default"}
    assert allocator.policy()["opted_out"] == "LILICORR_MALLOC=default"  # what the JSON records, the opt-out named
    environ, mallopt = {}, FakeMallopt(returns=0)  # glibc refused the value: nothing exported, nothing claimed
    assert allocator.reuse_freed_memory(environ, mallopt) == {"policy": "unavailable",
                                                              "why": "glibc refused the thresholds"}
    assert environ == {} and allocator.policy()["policy"] == "unavailable"
    with pytest.raises(ValueError, match=r"LILICORR_MALLOC='off' is not a setting; set LILICORR_MALLOC=default"):
        allocator.reuse_freed_memory({"LILICORR_MALLOC": "off"}, FakeMallopt())


@pytest.mark.skipif(allocator._glibc_malloc()[0] is None, reason="glibc's own malloc only")
def test_a_preloaded_malloc_is_left_alone(monkeypatch):
    """Under jemalloc or tcmalloc (LD_PRELOAD) glibc's thresholds would tune an allocator that serves nothing, and the
    JSON would claim a policy that is not in effect."""
    assert allocator._glibc_malloc()[0] is not None  # this process: glibc's own malloc, found as such
    monkeypatch.setattr(allocator, "_malloc_interposed", lambda process, libc: True)
    environ = {}
    expected = {"policy": "unavailable", "why": "another malloc is in use (LD_PRELOAD)"}
    assert allocator.policy(environ) == expected
    assert allocator.reuse_freed_memory(environ) == expected and environ == {}


def test_other_malloc_tunables_are_not_the_users_thresholds():
    environ, mallopt = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, FakeMallopt()
    assert allocator.reuse_freed_memory(environ, mallopt)["policy"] == "lilicorr" and len(mallopt.calls) == 2


def test_the_shell_command_applies_it_and_in_process_calls_do_not(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(allocator, "reuse_freed_memory", lambda: calls.append(1))
    monkeypatch.setattr(sys, "argv", ["lilicorr", "--help"])
    with pytest.raises(SystemExit):
        main()  # as the console script calls it
    assert calls == [1]
    with pytest.raises(SystemExit):
        main(["--help"])  # a test's (or a notebook's) call leaves its process's malloc alone
    assert calls == [1]


@pytest.mark.skipif(allocator._glibc_malloc()[0] is None, reason="glibc's own malloc only")
def test_the_console_command_sets_it_for_itself_and_the_processes_it_starts():
    """End to end, glibc's real mallopt: ``lilicorr`` from a shell applies the policy and exports it; a process it
    starts begins with it (and says where it came from); ``LILICORR_MALLOC=default`` leaves everything alone."""
    code = textwrap.dedent("""
        import json, os, subprocess, sys
        from lilicorr_pl.allocator import policy
        from lilicorr_pl.cli import main
        sys.argv = ["lilicorr", "--help"]
        try:
            main()
        except SystemExit:
            pass
        child = subprocess.run([sys.executable, "-c", "import json; from lilicorr_pl.allocator import policy; "
                                "print(json.dumps(policy()))"], check=True, capture_output=True, text=True).stdout
        print(json.dumps({"parent": policy(), "trim": os.environ.get("MALLOC_TRIM_THRESHOLD_"),
                          "child": json.loads(child)}))
    """)

    def console(**extra: str) -> dict:
        out = subprocess.run([sys.executable, "-c", code], env=_clean_env(**extra), check=True, capture_output=True,
                             text=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    on = console()
    assert on["parent"] == {"policy": "lilicorr", "mmap_threshold": 32 * 2**20, "trim_threshold": 2**30}
    assert on["trim"] == str(2**30)
    assert on["child"] == {"policy": "environment", "settings": {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),
                                                                 "MALLOC_TRIM_THRESHOLD_": str(2**30)}}
    off = console(LILICORR_MALLOC="default")
    assert off == {"parent": {"policy": "default", "opted_out": "LILICORR_MALLOC=default"}, "trim": None,
                   "child": {"policy": "default"}}


def test_an_unknown_opt_out_value_is_one_line_before_any_work(monkeypatch, capsys):
    monkeypatch.setenv("LILICORR_MALLOC", "off")
    monkeypatch.setattr(sys, "argv", ["lilicorr", "--help"])
    with pytest.raises(SystemExit) as stop:
        main()
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.strip() == ("lilicorr: error: LILICORR_MALLOC='off' is not a setting; set LILICORR_MALLOC=default to "
                           "leave glibc's malloc as it is, or unset it")


def _huge_pages_always() -> bool:
    try:
        return "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


@pytest.mark.skipif(allocator._glibc_malloc()[0] is None, reason="glibc's own malloc only")
@pytest.mark.skipif(resource.getpagesize() != 4096 or _huge_pages_always(),
                    reason="counts 4 KiB page faults: huge pages or larger pages fault far fewer times")
def test_a_steps_freed_blocks_are_reused_instead_of_faulted_in_again():
    """The behaviour it is for: a step that allocates four 30 MB blocks (the head stage's attention scores, aligned as
    torch's CPU allocator asks for them), writes them and frees them, 30 times, through the C library itself (torch's
    own small allocations between them would make glibc's trimming depend on the heap's layout). Under glibc's defaults
    the 120 MB freed at the heap's top is more than its trim threshold (at most 64 MiB), so it goes back to the system
    and every step faults all of its pages in again (about 28,800 minor page faults); with the policy it stays in the
    heap and later steps fault none."""
    code = textwrap.dedent("""
        import ctypes, ctypes.util, resource, sys
        from lilicorr_pl.allocator import reuse_freed_memory
        if sys.argv[1] == "on":
            assert reuse_freed_memory()["policy"] == "lilicorr"
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.free.argtypes = (ctypes.c_void_p,)
        size = 128 * 4 * 120 * 120 * 4
        faults = []
        for _ in range(30):
            start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            blocks = [ctypes.c_void_p() for _ in range(4)]
            for block in blocks:
                assert libc.posix_memalign(ctypes.byref(block), 64, ctypes.c_size_t(size)) == 0
                ctypes.memset(block, 1, size)
            for block in blocks:
                libc.free(block)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
        print(sum(faults[10:]))  # the last 20 steps
    """)
    env = _clean_env()
    faults = {mode: int(subprocess.run([sys.executable, "-c", code, mode], env=env, check=True, capture_output=True,
                                       text=True).stdout.split()[-1]) for mode in ("off", "on")}
    assert faults["off"] > 20 * 20_000, faults  # every step faulted its 120 MB in again
    assert faults["on"] < 1_000, faults
