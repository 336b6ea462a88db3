"""Data parallelism on CPU (gloo): two processes compute what one process computes.

- ``lilicorr fit`` with ``strategy=ddp, devices=2``: each rank trains on its own stride of the epoch's
  shuffled order (together exactly the samples one process would take) and the ranks keep identical
  weights. Resumed from its step-2 checkpoint, a second DDP run ends bit-identical to the first: the
  checkpoint carries every rank's random state (here consumed by dropout, differently on each rank)
  and the global data position.
- The validation metrics of the DDP run (2 ranks, 4 + 3 examples: uneven shards, nothing repeated)
  equal a one-process ``lilicorr validate`` of its checkpoint on the same data.
- ``lilicorr prepare``'s precompute over 2 gloo processes (``Trainer.predict``) writes shards
  byte-identical to the single-process ``prepare_data``.
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
import pytest
import torch

from lilicorr_pl.cli import main
from lilicorr_pl.data.sampling import ResumableLoader, ShardedEvalSampler, epoch_order, train_sampler

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
    - class_path: callbacks.RandomStateCheckpoint
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


def test_samplers_shard_the_global_order_and_resume_each_rank_where_it_stopped():
    n, seed = 11, 5
    order = epoch_order(n, seed, 0)
    ranks = [list(train_sampler(n, seed, num_replicas=3, rank=r)) for r in range(3)]
    assert all(len(r) == 4 for r in ranks)  # 11 -> 12: padded with the epoch's first sample
    steps = [x for step in zip(*ranks) for x in step]
    assert steps == order + order[:1]

    # Resume after 3 steps of 2 processes: each rank continues its own stride of the global order.
    def loader(r):
        return ResumableLoader(list(range(n)), order={"seed": seed}, batch_size=1,
                               sampler=train_sampler(n, seed, num_replicas=2, rank=r))

    states = []
    for r in range(2):
        dl = loader(r)
        it = iter(dl)
        [next(it) for _ in range(3)]
        states.append(dl.state_dict())
    resumed = []
    for r in range(2):
        dl = loader(r)
        dl.load_state_dict(states[r])
        resumed.append([int(x) for x in dl])
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
    order = [train_indices[j] for j in epoch_order(len(train_indices), 0, 0)]
    assert [records[r]["seen"][s] for s in range(STEPS) for r in range(2)] == [[i] for i in order[: 2 * STEPS]]
    mid = torch.load(full / "ckpt" / "step=2.ckpt", map_location="cpu", weights_only=True)
    assert len(mid["rng_states"]) == 2  # one random state per rank
    assert not torch.equal(mid["rng_states"][0]["torch"], mid["rng_states"][1]["torch"])  # the streams differ
    assert mid["DraftDataModule"]["loader"]["_num_yielded"] == 2  # the loader position: 2 batches on each rank

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


# ---------------------------------------------------------------------- lilicorr prepare over two processes
def _datamodule(cache_dir: Path, shard_tokens: int = 512):
    from lilicorr_pl.builtin import resolve_data_file, resolve_target_path
    from lilicorr_pl.data.datamodule import DraftDataModule

    # Outside the `lilicorr` command, `builtin:` names are resolved explicitly (the core never builds a target).
    target = {"name_or_path": resolve_target_path("builtin:tiny"), "dtype": "float32", "layer_ids": [1, 2]}
    # 64 examples of 64 tokens in shards of 512 tokens: 8 shards, 4 per process.
    return DraftDataModule(train_files=[resolve_data_file("builtin:stdlib-train:64")], max_length=64, logit_top_m=16,
                           feature_cache=True, precompute_batch_size=3, shard_tokens=shard_tokens, cache_dir=str(cache_dir),
                           target=target, progress=False)


def test_prepare_over_two_processes_writes_the_bytes_of_prepare_data(tmp_path, monkeypatch):
    from lilicorr_pl.data.precompute import PrecomputeJob
    from lilicorr_pl.data.prepare import prepare

    _datamodule(tmp_path / "single").prepare_data()

    log = tmp_path / "shards.log"
    add = PrecomputeJob.add

    def logged_add(self, batch, output):  # which process computed which shard (inherited by the forked ranks)
        with log.open("a") as fh:
            fh.write(f"{os.getpid()} {int(batch['shard'])}\n")
        return add(self, batch, output)

    monkeypatch.setattr(PrecomputeJob, "add", logged_add)
    # Forked ranks (gloo): the children reuse this process's imports, as `lilicorr prepare` on N GPUs runs N ranks.
    paths = prepare(_datamodule(tmp_path / "prepared"), accelerator="cpu", devices=2, strategy="ddp_fork")["train"]

    by_rank: dict[str, set[int]] = {}
    for pid, shard in (line.split() for line in log.read_text().splitlines()):
        by_rank.setdefault(pid, set()).add(int(shard))
    shares = sorted(by_rank.values(), key=min)
    assert shares == [set(range(0, 8, 2)), set(range(1, 8, 2))]  # two processes, shard s on process s mod 2

    names = sorted(p.name for p in (tmp_path / "single").iterdir())
    assert [n.split("-")[0] for n in names] == ["features", "logits", "tokens"]
    assert sorted(p.name for p in (tmp_path / "prepared").iterdir()) == names == sorted(p.name for p in paths.values())
    for name in names:
        a, b = tmp_path / "single" / name, tmp_path / "prepared" / name
        files = sorted(p.name for p in a.iterdir())
        assert sorted(p.name for p in b.iterdir()) == files and len(files) == 9  # 8 shards + manifest, nothing else
        for f in files:
            if f.endswith(".safetensors"):
                assert (a / f).read_bytes() == (b / f).read_bytes(), f"{name}/{f}"
        ma, mb = (json.loads((d / "manifest.json").read_text()) for d in (a, b))
        assert ma.pop("provenance")["processes"] == 1 and mb.pop("provenance")["processes"] == (1 if name.startswith("tokens") else 2)
        assert ma == mb  # fingerprint, parts, shards with sizes and sha256, meta


def test_prepare_with_more_processes_than_shards_leaves_the_idle_one_waiting(tmp_path):
    """One shard for two processes (a small store, or a resumed prepare with one shard left): the process without a
    shard failed ("DataLoader within local rank has zero length"), leaving a partial store behind."""
    from lilicorr_pl.data.prepare import prepare

    _datamodule(tmp_path / "single", shard_tokens=1 << 16).prepare_data()
    paths = prepare(_datamodule(tmp_path / "prepared", shard_tokens=1 << 16), accelerator="cpu", devices=2,
                    strategy="ddp_fork")["train"]
    names = sorted(p.name for p in (tmp_path / "single").iterdir())
    assert sorted(p.name for p in (tmp_path / "prepared").iterdir()) == names == sorted(p.name for p in paths.values())
    for name in names:
        a, b = tmp_path / "single" / name, tmp_path / "prepared" / name
        files = sorted(p.name for p in a.iterdir())
        assert sorted(p.name for p in b.iterdir()) == files and len(files) == 2  # 1 shard + manifest
        shard = next(f for f in files if f.endswith(".safetensors"))
        assert (a / shard).read_bytes() == (b / shard).read_bytes(), name


def test_a_validation_share_that_leaves_nothing_to_train_on_is_one_line_on_every_rank(tmp_path):
    """Refused on one process once the data are tokenized; over two it is setup's refusal, on each rank (refused in
    prepare_data, which local rank 0 runs alone, the other rank died at the barrier with a gloo traceback)."""
    env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "lilicorr_pl", "fit", "-c", str(ROOT / "configs" / "tiny.yaml"),
           "--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.accelerator=cpu", "--data.val_fraction=0.99",
           "--data.train_files=[builtin:stdlib-train:8]", f"--trainer.default_root_dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert proc.stderr.count("data.val_fraction 0.99 leaves none of the 8 training examples to train on") >= 1
