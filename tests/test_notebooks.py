"""The lattice walkthrough notebook runs end to end on a tiny checkpoint, and its committed source cannot drift."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from test_cli import fit_tiny  # noqa: E402  (tests/ is on sys.path, as for helpers)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "lattice_walkthrough.ipynb"
GENERATOR = ROOT / "notebooks" / "make_lattice_walkthrough.py"


def load_generator():
    spec = importlib.util.spec_from_file_location("make_lattice_walkthrough", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cell_text(nb, tag: str) -> str:
    """All stream and text/plain output of the code cell tagged ``tag``."""
    cells = [c for c in nb.cells if tag in c.metadata.get("tags", [])]
    assert len(cells) == 1, f"expected one cell tagged {tag!r}, found {len(cells)}"
    parts = []
    for out in cells[0].outputs:
        parts.append(out.get("text", "") if out.output_type == "stream" else out.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def cell_has_png(nb, tag: str) -> bool:
    cell = next(c for c in nb.cells if tag in c.metadata.get("tags", []))
    return any("image/png" in out.get("data", {}) for out in cell.outputs)


def test_committed_notebook_has_no_outputs_and_matches_its_generator(tmp_path):
    text = NOTEBOOK.read_text(encoding="utf-8")
    nb = nbformat.reads(text, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)
    assert code[0].metadata.get("tags") == ["parameters"]
    assert 'os.environ.get("LILICORR_NOTEBOOK_CKPT"' in code[0].source
    assert str(ROOT) not in text and str(Path.home()) not in text

    regenerated = tmp_path / "lattice_walkthrough.ipynb"
    assert load_generator().main(["--output", str(regenerated)]) == 0
    assert json.loads(regenerated.read_text(encoding="utf-8")) == json.loads(text), (
        "notebooks/lattice_walkthrough.ipynb drifted from its generator; run "
        "python notebooks/make_lattice_walkthrough.py"
    )
    assert regenerated.read_text(encoding="utf-8") == text


def execute_notebook(tmp_path: Path, monkeypatch, ckpt: Path | None, results: Path | None):
    """Run the committed notebook in a fresh kernel, from ``tmp_path``, on ``ckpt`` and ``results`` (None: the
    notebook's defaults, what `lilicorr demo` writes under ``runs/demo``)."""
    # A kernelspec for this interpreter, first on JUPYTER_PATH: a user-level "python3" that points at
    # another Python (without lilicorr_pl) must not be picked up.
    from ipykernel.kernelspec import write_kernel_spec

    jupyter_path = tmp_path / "jupyter"
    write_kernel_spec(jupyter_path / "kernels" / "python3")
    spec = json.loads((jupyter_path / "kernels" / "python3" / "kernel.json").read_text())
    assert spec["argv"][0] == sys.executable
    monkeypatch.setenv("JUPYTER_PATH", str(jupyter_path))
    for name, path in (("LILICORR_NOTEBOOK_CKPT", ckpt), ("LILICORR_NOTEBOOK_RESULTS", results)):
        if path is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(path))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny models: one thread beats two on a shared machine

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError if any cell fails (the verify cell asserts agreement)
    assert not [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    return nb


def check_verify_cell(verify: str, arms: list[str]) -> None:
    assert "accepted" in verify and "bonus token" in verify
    assert [line.strip("─ ") for line in verify.splitlines() if line.startswith("──")] == arms
    assert "it agrees with this walkthrough" in verify
    tau_lines = [line for line in verify.splitlines() if "-> τ =" in line]
    assert len(tau_lines) == len(arms)
    for line in tau_lines:  # τ = accepted + 1: the bonus token is counted
        accepted = int(line.split("accepted ")[1].split(" of")[0])
        assert 0 <= accepted <= 7
        assert line.split("-> τ = ")[1].startswith(f"{accepted} + 1 = {accepted + 1} ")


def test_notebook_walks_the_lattice_of_a_tiny_lilicorr_checkpoint(tmp_path, monkeypatch):
    fit_tiny(tmp_path / "fit", steps=2)
    ckpt = tmp_path / "fit" / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    assert ckpt.is_file()
    # Where `lilicorr demo` writes them, read by the notebook's defaults: the newest results file (a quick run's, after
    # a full run's) and the LiLiCorr checkpoint it names, not the newest checkpoint (another run's, here unreadable),
    # in a checkout whose name would be a glob pattern. The workdir was moved since: the recorded path is gone and
    # the checkpoint is found beside the results file.
    work = tmp_path / "proj[v2]"
    demo_dir = work / "runs" / "demo"
    (demo_dir / "checkpoints").mkdir(parents=True)
    shutil.copyfile(ckpt, demo_dir / "checkpoints" / "lilicorr-ba9876543210.ckpt")
    newer = demo_dir / "checkpoints" / "lilicorr-0123456789ab.ckpt"
    newer.write_bytes(b"another run's checkpoint")
    (demo_dir / "results.json").write_text(json.dumps({"results": []}))
    for path in (demo_dir / "checkpoints" / "lilicorr-ba9876543210.ckpt", demo_dir / "results.json"):
        os.utime(path, (time.time() - 3600,) * 2)
    curve = [0.9, 0.7, 0.5, 0.4, 0.3, 0.2, 0.1]
    results = demo_dir / "results-quick.json"
    moved_from = tmp_path / "elsewhere" / "runs" / "demo" / "checkpoints"
    results.write_text(json.dumps({"tau_includes_bonus_token": True, "checkpoints": {
        "dflash": str(moved_from / "dflash-00aa00aa00aa.ckpt"),
        "lilicorr": str(moved_from / "lilicorr-ba9876543210.ckpt"),
    }, "results": [
        {"benchmark": "stdlib-heldout", "temperature": 0.0, "arm": "dflash", "tau": 2.25,
         "per_position_acceptance": [x * 0.8 for x in curve]},
        {"benchmark": "stdlib-heldout", "temperature": 0.0, "arm": "lilicorr", "tau": 2.75,
         "per_position_acceptance": curve},
        {"benchmark": "humaneval", "temperature": 1.0, "arm": "lilicorr", "tau": 1.5,
         "per_position_acceptance": [x / 2 for x in curve]},
    ]}))
    nb = execute_notebook(work, monkeypatch, None, None)

    load = cell_text(nb, "load")
    assert "checkpoint: lilicorr-ba9876543210.ckpt  (results: results-quick.json)" in load
    assert "LiLiCorrHead" in load and "lattice width K = 4" in load and "block 8" in load

    table = cell_text(nb, "lattice-table")
    slot_rows = [line for line in table.splitlines() if line[:4].strip().isdigit()]
    assert len(slot_rows) == 7  # S = block 8 - 1 speculative slots
    assert all(row.count("*") == 1 for row in slot_rows)  # exactly one walk pick per slot
    assert "greedy walk" in table and "start scores" in table
    assert cell_has_png(nb, "scores")

    check_verify_cell(cell_text(nb, "verify"), ["top-1", "LiLiCorr walk"])

    summary = cell_text(nb, "results")
    assert cell_has_png(nb, "results")
    assert "bonus token included" in summary
    assert "2.25" in summary and "2.75" in summary and "1.50" in summary
    header = next(line for line in summary.splitlines() if line.startswith("benchmark"))
    assert header.split()[-2:] == ["dflash", "lilicorr"]


def test_notebook_shows_only_top1_for_a_checkpoint_without_a_lattice_head(tmp_path, monkeypatch):
    fit_tiny(tmp_path / "fit", "-c", str(ROOT / "configs" / "ablations" / "dflash_only.yaml"), steps=1)
    ckpt = tmp_path / "fit" / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    nb = execute_notebook(tmp_path, monkeypatch, ckpt, tmp_path / "no_results.json")

    assert "Top1Selector builds no lattice" in cell_text(nb, "load")
    assert "top-1 token" in cell_text(nb, "lattice-table")
    assert not cell_has_png(nb, "scores")
    check_verify_cell(cell_text(nb, "verify"), ["top-1"])
    assert "lilicorr demo" in cell_text(nb, "results") and not cell_has_png(nb, "results")

    # On its defaults beside a results file of an older version, which names no checkpoint: the newest demo
    # checkpoint, with a note that it may come from another run.
    demo_dir = tmp_path / "work" / "runs" / "demo"
    (demo_dir / "checkpoints").mkdir(parents=True)
    shutil.copyfile(ckpt, demo_dir / "checkpoints" / "lilicorr-a1b2c3d4e5f6.ckpt")
    (demo_dir / "results.json").write_text(json.dumps({"results": [
        {"benchmark": "humaneval", "temperature": 0.0, "arm": "dflash", "tau": 1.75,
         "per_position_acceptance": [0.5, 0.25]}]}))
    nb = execute_notebook(tmp_path / "work", monkeypatch, None, None)
    load = cell_text(nb, "load")
    assert "note: results.json names no checkpoint that is still there; using the newest demo checkpoint, " \
           "lilicorr-a1b2c3d4e5f6.ckpt, which may come from another run" in load
    assert "Top1Selector builds no lattice" in load and cell_has_png(nb, "results")
