"""The target logits that the losses read sit at ``label_pos − 1``: checked against a hand computation.

The distractor penalty (exact online logits) and DSpark's L1 term both compare with the target's
teacher-forced distribution of the token at ``label_pos``, which the target computes at position
``label_pos − 1``. Here the system's values are recomputed by hand, block by block and slot by slot,
from the target's full logits; the same hand computation at another offset gives other numbers, so an
off-by-one in the system fails the tests.
"""

from __future__ import annotations

import pytest
import torch

from helpers import make_tiny_target_dir
from lilicorr_pl.heads import DSparkHead, LiLiCorrHead
from lilicorr_pl.losses import DFlashCE, DistractorPenalty, DSparkLoss
from lilicorr_pl.models import DFlashDrafter
from lilicorr_pl.system import DraftSystem

BLOCK = 4


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> str:
    return make_tiny_target_dir(tmp_path_factory.mktemp("alignment"), layers=4)


def _batch(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab - 1, (2, 20), generator=g)
    loss_mask = torch.ones_like(ids)
    loss_mask[1, 15:] = 0  # some blocks run out of the loss mask: they must be skipped whole
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}


def _full_logits(system: DraftSystem, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return system.target.model(input_ids=ids).logits.double()  # [b, T, V]


def _hand_penalty(step: dict, logits: torch.Tensor, offset: int) -> float:
    lattice = step["lattice"]
    total, count = 0.0, 0
    for m in range(lattice.candidates.shape[0]):
        if not bool(step["label_mask"][m].all()):
            continue  # a block with any unsupervised slot is skipped whole
        b = int(step["block_seq"][m])
        prev_rank = None
        for s in range(lattice.num_slots):
            label = int(step["labels"][m, s])
            cands = lattice.candidates[m, s].tolist()
            if label not in cands:
                break  # end of the oracle prefix
            row = lattice.start[m] if s == 0 else lattice.pair[m, s - 1, prev_rank]
            probs = row.detach().double().softmax(-1)
            z = logits[b, int(step["label_pos"][m, s]) + offset]
            cost = sum(float(probs[j]) * max(0.0, float(z[label] - z[c])) for j, c in enumerate(cands))
            total, count = total + cost, count + 1
            prev_rank = cands.index(label)
    assert count >= 3, "too few forced slots to test anything"
    return total / count


def test_distractor_penalty_reads_the_target_at_label_pos_minus_one(target_dir):
    torch.manual_seed(0)
    system = DraftSystem(
        target={"name_or_path": target_dir, "dtype": "float32", "layer_ids": [0, 2]},
        drafter=DFlashDrafter(num_layers=1, block_size=BLOCK),
        head=LiLiCorrHead(top_k=128, hidden_size=32, num_layers=1, num_heads=4, factor_dim=16),
        losses=[DFlashCE(), DistractorPenalty(weight=1.0)],
        num_anchors=12, target_logits="exact", lr_scheduler=None,
    )
    system.configure_model()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # trained-like head: peaked score rows, so every slot's cost weighting matters
        for name, p in system.head.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    batch = _batch(system.target.output_rows)
    step = system.compute_step(batch, generator=torch.Generator().manual_seed(1))
    ids = batch["input_ids"]
    pos, seq, mask = step["label_pos"], step["block_seq"], step["label_mask"]
    # label_pos names the labelled token itself ...
    assert torch.equal(step["labels"][mask], ids[seq.unsqueeze(1).expand_as(pos)[mask], pos[mask]])
    assert not mask.all(-1).all(), "the batch should hold blocks that run off the loss mask"
    logits = _full_logits(system, ids)
    got = step["logs"]["distractor_penalty/penalty"].item()
    # ... and the penalty reads the target's logits one position earlier.
    assert got == pytest.approx(_hand_penalty(step, logits, offset=-1), rel=1e-6)
    for wrong in (0, -2, 1):
        assert got != pytest.approx(_hand_penalty(step, logits, offset=wrong), rel=1e-3), wrong


def test_dspark_l1_reads_the_target_distribution_at_label_pos_minus_one(target_dir):
    torch.manual_seed(0)
    loss = DSparkLoss(weight=1.0, gamma=None, chunk_blocks=3)
    system = DraftSystem(
        target={"name_or_path": target_dir, "dtype": "float32", "layer_ids": [0, 2]},
        drafter=DFlashDrafter(num_layers=1, block_size=BLOCK),
        head=DSparkHead(rank=8), losses=[loss], num_anchors=12, lr_scheduler=None,
    )
    system.configure_model()
    assert not system.needs_target_logits  # no top-M logit cache: DSpark reads the online distribution
    seen = {}
    original = system.head.corrected_logits

    def recording(*args, **kwargs):
        seen["corrected"] = original(*args, **kwargs)
        return seen["corrected"]

    system.head.corrected_logits = recording
    batch = _batch(system.target.output_rows, seed=3)
    step = system.compute_step(batch, generator=torch.Generator().manual_seed(2))
    logits = _full_logits(system, batch["input_ids"])
    q = seen["corrected"].detach().double().softmax(-1)  # [M, S, V]
    mask, pos, seq = step["label_mask"], step["label_pos"], step["block_seq"]

    def hand(offset: int) -> float:
        total, count = 0.0, 0
        for m, s in mask.nonzero().tolist():
            p = logits[int(seq[m]), int(pos[m, s]) + offset].softmax(-1)
            total, count = total + float((q[m, s] - p).abs().sum()), count + 1
        return total / count

    got = step["logs"]["dspark/l1"].item()
    assert got == pytest.approx(hand(-1), rel=1e-4)
    assert abs(got - hand(0)) > 1e-3
    with pytest.raises(ValueError, match="data.feature_cache: false"):
        system.check_offline_features(True)
