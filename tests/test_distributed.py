"""Data parallelism on CPU (gloo): two processes compute what one process computes.

- ``lilicorr fit`` with ``strategy=ddp, devices=2``: each rank trains on its own stride of the epoch's
  shuffled order (together exactly the samples one process would take) and the ranks keep identical
  weights. Resumed from its step-2 checkpoint, a second DDP run ends bit-identical to the first: the
  checkpoint carries every rank's random state (here consumed by dropout, differently on each rank)
  and the global data position.
- The validation metrics of the DDP run (2 ranks, 4 + 3 examples: uneven shards, nothing repeated)
  equal a one-process ``lilicorr validate`` of its checkpoint on the same data.
- The sharded target-logit/feature cache precompute (2 gloo processes) writes arrays byte-identical to
  the single-process precompute.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from lilicorr_pl.cli import main
from lilicorr_pl.data.datamodule import ResumableShuffleSampler, ShardedEvalSampler

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4

# Batch 1 and every position an anchor (num_anchors >= max_length): each example's validation loss and
# lattice statistics are then independent of how examples are grouped into batches and ranks. Dropout in
# the head keeps the global RNG in play during training (validation runs in eval mode).
OVERRIDES = f"""
trainer:
  accelerator: cpu
  enable_progress_bar: false
  enable_model_summary: false
  max_steps: {STEPS}
  val_check_interval: 2
  limit_val_batches: null
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args: {{save_dir: csv, name: run, version: 0}}
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{dirpath: ckpt, filename: "{{step}}", save_last: true, every_n_train_steps: 2, save_top_k: -1}}
model:
  num_anchors: 64
  head:
    class_path: lilicorr_pl.heads.LiLiCorrHead
    init_args: {{top_k: 4, hidden_size: 64, num_layers: 1, num_heads: 4, dropout: 0.2}}
data:
  batch_size: 1
"""


class RecordRank(L.Callback):
    """Test-only: each rank writes the example indices of its training batches and a hash of its final weights."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append(batch["index"].tolist())
        # Rank-dependent use of the global RNG, as batches of different shapes on each rank would cause (these
        # are all 64 tokens long): from here on the ranks' dropout masks differ.
        torch.rand(1 + trainer.global_rank)

    def on_train_end(self, trainer, pl_module) -> None:
        digest = hashlib.sha256()
        for p in pl_module.trainable_parameters():
            digest.update(p.detach().cpu().numpy().tobytes())
        record = {"seen": self.seen, "weights": digest.hexdigest(),
                  "train_indices": trainer.datamodule.train_dataset.indices.tolist()}
        Path(f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def test_samplers_shard_the_global_order_and_skip_a_global_prefix():
    n, seed = 11, 5
    order = ResumableShuffleSampler(n, seed=seed).order(0)
    ranks = [list(ResumableShuffleSampler(n, seed=seed, num_replicas=3, rank=r)) for r in range(3)]
    assert all(len(r) == 4 for r in ranks)  # 11 -> 12: padded with the epoch's first sample
    steps = [x for step in zip(*ranks) for x in step]
    assert steps == order + order[:1]
    # Resume after 6 samples of the global order on 2 processes: they continue with the rest of it.
    resumed = []
    for r in range(2):
        s = ResumableShuffleSampler(n, seed=seed, num_replicas=2, rank=r)
        s.skip = 6
        resumed.append(list(s))
    assert [x for step in zip(*resumed) for x in step][:5] == order[6:]
    # Validation: every example exactly once over the ranks, none repeated.
    shards = [list(ShardedEvalSampler(7, num_replicas=2, rank=r)) for r in range(2)]
    assert shards == [[0, 2, 4, 6], [1, 3, 5]] and [len(ShardedEvalSampler(7, 2, r)) for r in range(2)] == [4, 3]


def _val_metrics_from_csv(path: Path) -> dict[str, float]:
    rows = [r for r in csv.DictReader(path.open()) if r.get("val/loss")]
    assert len(rows) == 2, rows  # validations after steps 2 and 4
    return {k: float(v) for k, v in rows[0].items() if k.startswith("val/") and v}


def _ddp_fit(work: Path, cache: Path, *extra: str) -> list[dict]:
    work.mkdir(parents=True)
    (work / "overrides.yaml").write_text(OVERRIDES)
    env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "lilicorr_pl", "fit", "-c", str(ROOT / "configs" / "tiny.yaml"),
           "-c", "overrides.yaml", "--trainer.devices=2", "--trainer.strategy=ddp", f"--data.cache_dir={cache}",
           "--trainer.callbacks+=test_distributed.RecordRank", *extra]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return [json.loads((work / f"rank{r}.json").read_text()) for r in range(2)]


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith(("drafter.", "head."))}


def test_ddp_two_processes_train_on_strides_resume_exactly_and_validate_like_one(tmp_path):
    cache = tmp_path / "cache"
    full = tmp_path / "full"
    records = _ddp_fit(full, cache)

    # Training data: step s of rank r is sample 2s + r of the epoch's global order; the ranks stay in sync.
    assert records[0]["weights"] == records[1]["weights"]
    train_indices = records[0]["train_indices"]
    order = [train_indices[j] for j in ResumableShuffleSampler(len(train_indices), seed=0).order(0)]
    assert [records[r]["seen"][s] for s in range(STEPS) for r in range(2)] == [[i] for i in order[: 2 * STEPS]]
    mid = torch.load(full / "ckpt" / "step=2.ckpt", map_location="cpu", weights_only=True)
    assert len(mid["rng_states"]) == 2  # one random state per rank
    assert not torch.equal(mid["rng_states"][0]["torch"], mid["rng_states"][1]["torch"])  # the streams differ
    assert mid["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["consumed"] == 4  # global samples

    # Resume from step 2 in a fresh DDP run: the same samples, the same dropout masks, the same weights.
    resumed = _ddp_fit(tmp_path / "resumed", cache, f"--ckpt_path={full / 'ckpt' / 'step=2.ckpt'}")
    assert [resumed[r]["seen"][s] for s in range(STEPS - 2) for r in range(2)] == [[i] for i in order[4 : 2 * STEPS]]
    a = _weights(tmp_path / "resumed" / "ckpt" / f"step={STEPS}.ckpt")
    b = _weights(full / "ckpt" / f"step={STEPS}.ckpt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # Validation after step 2 on 2 ranks equals one process validating the step-2 checkpoint.
    ddp = _val_metrics_from_csv(full / "csv" / "run" / "version_0" / "metrics.csv")
    single_dir = tmp_path / "single"
    single_dir.mkdir()
    (single_dir / "overrides.yaml").write_text(OVERRIDES)
    cwd = os.getcwd()
    os.chdir(single_dir)
    try:
        cli = main(["validate", "-c", str(ROOT / "configs" / "tiny.yaml"), "-c", "overrides.yaml",
                    "--trainer.devices=1", "--trainer.logger=false", f"--data.cache_dir={cache}",
                    f"--ckpt_path={full / 'ckpt' / 'step=2.ckpt'}"])
    finally:
        os.chdir(cwd)
    assert len(cli.datamodule.val_dataset) == 7  # odd: the two ranks evaluated 4 and 3 examples
    single = {k: float(v) for k, v in cli.trainer.callback_metrics.items() if k.startswith("val/")}
    assert {"val/loss", "val/distractor_penalty", "val/oracle_prefix", "val/sim_tau_selected"} <= ddp.keys()
    assert set(ddp) == set(single)
    for key in ddp:
        assert ddp[key] == pytest.approx(single[key], rel=1e-5, abs=1e-7), key


# ---------------------------------------------------------------------- sharded cache precompute
def _datamodule(cache_dir: Path):
    from lilicorr_pl.builtin import resolve_data_file, resolve_target_path
    from lilicorr_pl.data.datamodule import DraftDataModule

    target = {"name_or_path": resolve_target_path("builtin:tiny"), "dtype": "float32", "layer_ids": [1, 2]}
    # 64 examples in batches of 6: 11 batches, the last one short, dealt 6 + 5 to two ranks.
    return DraftDataModule(train_files=[resolve_data_file("builtin:stdlib-train:64")], max_length=64, logit_top_m=16,
                           feature_cache=True, precompute_batch_size=6, cache_dir=str(cache_dir), target=target,
                           progress=False)


def _sharded_worker(rank: int, world_size: int, rendezvous: str, cache_dir: str, errors: str) -> None:
    import traceback

    try:
        torch.set_num_threads(1)
        torch.distributed.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                                             world_size=world_size)
        from lilicorr_pl.data.sharded import prepare_data_sharded

        prepare_data_sharded(_datamodule(Path(cache_dir)))  # rank, world size and barrier from torch.distributed
        torch.distributed.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report anything to the parent, then fail the process
        Path(errors, f"rank{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def test_sharded_precompute_over_two_gloo_processes_equals_the_single_process_cache(tmp_path):
    import multiprocessing

    from lilicorr_pl.data.cache import _batches_by_length, open_cache
    from lilicorr_pl.data.sharded import shard_examples

    single = _datamodule(tmp_path / "single")
    single.prepare_data()
    # Fork: the children reuse this process's imports (spawning would re-import torch and transformers).
    ctx = multiprocessing.get_context("fork")
    args = (2, str(tmp_path / "rdzv"), str(tmp_path / "sharded"), str(tmp_path))
    procs = [ctx.Process(target=_sharded_worker, args=(r, *args)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    errors = "".join(p.read_text() for p in tmp_path.glob("rank*.txt"))
    assert [p.exitcode for p in procs] == [0, 0], errors

    names = sorted(p.name for p in (tmp_path / "single").iterdir())
    assert [n.split("-")[0] for n in names] == ["features", "logits", "tokens"]
    assert sorted(p.name for p in (tmp_path / "sharded").iterdir()) == names  # same fingerprints, no shards left
    for name in names:
        a, b = open_cache(tmp_path / "single" / name), open_cache(tmp_path / "sharded" / name)
        assert a.fingerprint == b.fingerprint and a.meta == b.meta
        assert a.manifest["files"] == b.manifest["files"]  # shapes, dtypes, sizes and sha256 of every array
        for array in a.manifest["files"]:
            npy = f"{array}.npy"
            assert (tmp_path / "single" / name / npy).read_bytes() == (tmp_path / "sharded" / name / npy).read_bytes()
    # Both ranks did real work, and each re-batched its share into exactly the single-process batches (on
    # GPUs the numbers can depend on a batch's shape and neighbours; these tiny CPU runs would not show it).
    lengths = np.diff(np.asarray(open_cache(tmp_path / "single" / names[2])["offsets"]))
    batches = [b.tolist() for b in _batches_by_length(lengths, 6)]
    shares = [shard_examples(lengths, 6, r, 2) for r in range(2)]
    assert sorted(np.concatenate(shares).tolist()) == list(range(64)) and min(len(s) for s in shares) >= 24
    for r, share in enumerate(shares):
        assert [share[b].tolist() for b in _batches_by_length(lengths[share], 6)] == batches[r::2]
