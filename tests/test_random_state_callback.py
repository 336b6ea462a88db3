"""`callbacks.RandomStateCheckpoint`: a resumed fit draws the random numbers the uninterrupted one drew.

The end-to-end proof (a SIGKILLed tiny run resumed bit-exactly) is tests/test_resume.py; here the callback is
checked alone on Lightning's BoringModel, whose steps draw from torch, NumPy and Python's random streams.
"""

from __future__ import annotations

import random

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.utils.data import DataLoader

from callbacks import RandomStateCheckpoint


class NoisyModel(BoringModel):
    """Every step's loss depends on fresh draws from all three global streams."""

    def training_step(self, batch, batch_idx):
        noise = torch.randn_like(batch) + float(np.random.rand()) + random.random()
        return super().training_step(batch + noise, batch_idx)

    def train_dataloader(self):
        # Identical batches, and the loader's own generator (a new iterator draws its seed from it, not from the
        # global stream): only the steps' draws vary.
        return DataLoader(torch.ones(64, 32), batch_size=2, generator=torch.Generator().manual_seed(0))


def _fit(root, max_steps: int, callbacks: list, ckpt_path=None) -> dict[str, torch.Tensor]:
    torch.manual_seed(ckpt_path is not None)  # a resumed run starts from other streams unless they are restored
    model = NoisyModel()
    trainer = L.Trainer(default_root_dir=root, max_steps=max_steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, accelerator="cpu", devices=1,
                        callbacks=[*callbacks, ModelCheckpoint(dirpath=root / "ckpt", filename="{step}",
                                                               every_n_train_steps=1, save_top_k=-1)])
    trainer.fit(model, ckpt_path=ckpt_path)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_resumed_fit_matches_the_uninterrupted_one_only_with_the_callback(tmp_path):
    np.random.seed(0)
    random.seed(0)
    full = _fit(tmp_path / "full", 6, [RandomStateCheckpoint()])
    mid = tmp_path / "full" / "ckpt" / "step=3.ckpt"
    saved = torch.load(mid, map_location="cpu", weights_only=True)  # plain data: loads weights-only
    assert len(saved["rng_states"]) == 1 and saved["rng_states"][0]["torch"].dtype == torch.uint8

    resumed = _fit(tmp_path / "resumed", 6, [RandomStateCheckpoint()], ckpt_path=mid)
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    # Without the callback the resumed run draws other numbers: the check above can fail.
    plain = _fit(tmp_path / "plain", 6, [], ckpt_path=mid)
    assert not all(torch.equal(full[k], plain[k]) for k in full)

