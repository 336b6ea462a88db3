"""Exact resume of the global random streams (anchor sampling, dropout), which Lightning does not save."""

from __future__ import annotations

import random
import warnings
from typing import Any

import lightning as L
import numpy as np
import torch

CHECKPOINT_KEY = "rng_states"


def capture() -> dict[str, Any]:
    """This process's torch, CUDA, NumPy and Python random states, as tensors, ints and floats only.

    So the checkpoint still loads with ``torch.load(weights_only=True)``, as ``Trainer.fit(ckpt_path=)`` does.
    """
    _, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "torch.cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_gauss)},
        "python": {"version": int(py_version), "state": torch.tensor(py_state, dtype=torch.int64),
                   "gauss_next": py_gauss},
    }


def restore(state: dict[str, Any]) -> None:
    """Set this process's random states from :func:`capture`'s record."""
    torch.set_rng_state(state["torch"].cpu())
    if state["torch.cuda"] and torch.cuda.is_available() and len(state["torch.cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["torch.cuda"]])
    np_state = state["numpy"]
    np.random.set_state(("MT19937", np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))


class RandomStateCheckpoint(L.Callback):
    """Saves every rank's global random streams in each checkpoint and restores them when a fit resumes.

    A resumed run then draws what the uninterrupted one would have (anchors, dropout masks): with the data
    module's loader position, resuming is bit-exact. The states go under the checkpoint's ``rng_states`` key
    (one entry per rank, written by rank 0), as earlier lilicorr_pl versions wrote them, so their checkpoints
    restore too. Only a resumed fit restores them: validate, test and predict leave the caller's streams alone.
    """

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        states = [capture()]
        dist = torch.distributed
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            # Every rank runs this hook (Trainer.save_checkpoint is collective); rank 0 writes all ranks' states.
            states = [None] * dist.get_world_size()
            dist.all_gather_object(states, capture())
        checkpoint[CHECKPOINT_KEY] = states

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get(CHECKPOINT_KEY)
        if not states or trainer.state.fn != "fit":
            return
        rank, world = trainer.global_rank, trainer.world_size
        if len(states) != world:
            warnings.warn(
                f"the checkpoint holds the random states of {len(states)} process(es), this run has {world}; "
                "anchor sampling continues from the saved streams but is not bit-exact with an uninterrupted run",
                stacklevel=2,
            )
        restore(states[rank % len(states)])
