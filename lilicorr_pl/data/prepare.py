"""``lilicorr prepare``: the data module's target precompute spread over every device by ``Trainer.predict``.

The work is ``DraftDataModule.precompute_job()``, the same job ``prepare_data`` runs in one process:
shard ``s`` goes to process ``s mod world_size``, each process runs the frozen target over its shards'
batches in ``predict_step`` and a prediction writer places the results and writes each shard once it is
complete. After the last process has finished, rank 0 writes the manifests. Shards are computed in the
same batches whoever computes them, so the stores are the bytes ``prepare_data`` would write; a
killed run keeps its finished shards and the next one computes the rest. All processes must see the
same ``data.cache_dir`` (one node, or a shared file system).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import BasePredictionWriter
from torch.utils.data import DataLoader

from lilicorr_pl.data.datamodule import DraftDataModule
from lilicorr_pl.data.precompute import PrecomputeJob
from lilicorr_pl.target import FrozenTarget, TargetSpec


class _PrecomputeData(L.LightningDataModule):
    """Token stores in ``prepare_data`` (one process per node), this rank's target batches in ``setup``."""

    def __init__(self, datamodule: DraftDataModule) -> None:
        super().__init__()
        self.datamodule = datamodule
        self.job: PrecomputeJob | None = None
        # More processes than shards left to compute (a small store, or a resumed run with its last few to do): the
        # processes without one run no batch and wait at the barrier, where Lightning would raise on them.
        self.allow_zero_length_dataloader_with_multiple_devices = True

    def prepare_data(self) -> None:
        self.datamodule.prepare_tokens()

    def setup(self, stage: str) -> None:
        self.job = self.datamodule.precompute_job()

    def predict_dataloader(self) -> DataLoader:
        batches = self.job.batches(self.trainer.global_rank, self.trainer.world_size) if self.job else []
        return DataLoader(batches, batch_size=None, shuffle=False)


class _TargetPass(L.LightningModule):
    """The frozen target; ``predict_step`` is one precompute batch (results on the CPU)."""

    def __init__(self, spec: TargetSpec, data: _PrecomputeData) -> None:
        super().__init__()
        self.spec = spec
        self.data = data
        self.target: FrozenTarget | None = None

    def configure_model(self) -> None:
        # Nothing left to compute (every store exists): the target is not loaded at all.
        if self.target is None and self.data.job is not None:  # on the CPU; the strategy moves it to its device
            self.target = FrozenTarget.from_spec(self.spec, shared=True)

    def on_predict_start(self) -> None:
        if self.data.job is not None:
            self.data.job.check(self.target)
            if self.trainer.is_global_zero:
                self.print(self.data.job.report(self.target.hidden_size * self.target.num_features))

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        return self.data.job.compute(self.target, batch)


class _ShardWriter(BasePredictionWriter):
    """Places each batch's results in its shard and writes the shard when its last batch is in."""

    def __init__(self, data: _PrecomputeData) -> None:
        super().__init__(write_interval="batch")
        self.data = data

    def write_on_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, prediction: Any,
                           batch_indices: Any, batch: Any, batch_idx: int, dataloader_idx: int) -> None:
        self.data.job.add(batch, prediction)


def prepare(
    datamodule: DraftDataModule,
    accelerator: str = "auto",
    devices: int | str | list[int] = "auto",
    num_nodes: int = 1,
    strategy: str = "auto",
) -> dict[str, dict[str, Path]]:
    """Precompute the data module's stores (tokens, target logits, features) with every device.

    Runs the same precompute as ``prepare_data``, sharded over ``devices × num_nodes`` processes
    through ``Trainer.predict``, and writes the same files; stores that already exist are reused.
    Returns, on rank 0, the store directories of each split (``{split: {kind: path}}``), ``{}`` on
    the other ranks.

    Args:
        datamodule: the data module of the training config (its target, files and settings).
        accelerator: Lightning accelerator (``auto``, ``gpu``, ``cpu``, ...).
        devices: devices per node (``auto``, a count, or a list of ids).
        num_nodes: machines; they must share ``data.cache_dir``.
        strategy: Lightning strategy (``auto`` picks DDP for several devices).
    """
    datamodule._check_inputs()  # bad files or settings: one line, before any process starts
    existed = {split: {kind: path.is_dir() for kind, path in datamodule.cache_paths(split).items()}
               for split in datamodule._splits()}
    data = _PrecomputeData(datamodule)
    trainer = L.Trainer(
        accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy=strategy, logger=False,
        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=datamodule.progress,
        use_distributed_sampler=False, callbacks=[_ShardWriter(data)],
    )
    with warnings.catch_warnings():  # the writer needs no batch indices: each batch names its shard and examples
        warnings.filterwarnings("ignore", message="Couldn't infer the batch indices")
        trainer.predict(_TargetPass(datamodule._spec(), data), datamodule=data, return_predictions=False)
    trainer.strategy.barrier("lilicorr-prepare")  # every shard is on disk past this point
    if not trainer.is_global_zero:
        return {}
    job = datamodule.precompute_job()  # rebuilt here: under ddp_spawn this process ran no setup
    if job is not None:
        job.finalize(processes=trainer.world_size, written_by="lilicorr prepare")
    stores = {split: datamodule.cache_paths(split) for split in datamodule._splits()}
    for split, paths in stores.items():  # which stores a fit will read, and whether this run wrote them
        for kind, path in paths.items():
            print(f"[lilicorr] prepare: {split} {kind} store {path} "
                  f"({'reused' if existed.get(split, {}).get(kind) else 'written'})")
    return stores
