"""The end-to-end overfit gate (DESIGN §9.8): a drafter + LiLiCorr head trained on one short sequence
reaches τ = B in real speculative decoding of that sequence.

Everything is real: a saved Qwen3 target loaded through ``from_pretrained``, the system's own training
step (target features, drafter blocks, the head's lattice, DFlash CE + oracle-prefix CE + distractor
penalty on exact target logits), then speculative decoding with the target's KV cache and verify
passes. A bug anywhere on the path (feature offsets, positions, masks, the anchor, the walk, the
acceptance rule) keeps τ below B. τ counts the bonus token, so τ = B means every draft was accepted.
"""

from __future__ import annotations

import pytest
import torch

from helpers import make_tiny_target_dir
from lilicorr_pl.decoding import speculative_generate, target_generate
from lilicorr_pl.heads import LiLiCorrHead, Top1Selector
from lilicorr_pl.losses import DFlashCE, DistractorPenalty, OraclePrefixCE
from lilicorr_pl.models import DFlashDrafter
from lilicorr_pl.system import DraftSystem

BLOCK = 4
PROMPT = 6
ROUNDS = 5
NEW = 1 + ROUNDS * BLOCK  # the first token from prefill, then ROUNDS full blocks (anchor + S drafts + bonus)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_overfit_gate_trained_drafter_and_head_reach_tau_equal_block_size(tmp_path, one_thread):
    torch.manual_seed(0)
    system = DraftSystem(
        target={"name_or_path": make_tiny_target_dir(tmp_path, layers=4, hidden=32), "layer_ids": [0, 2]},
        drafter=DFlashDrafter(num_layers=1, block_size=BLOCK),
        head=LiLiCorrHead(top_k=4, hidden_size=32, num_layers=1, num_heads=4, factor_dim=32),
        losses=[DFlashCE(gamma=4.0), OraclePrefixCE(weight=0.25), DistractorPenalty(weight=0.25)],
        num_anchors=NEW + BLOCK, target_logits="exact", lr_scheduler=None,
    )
    system.configure_model()
    target = system.target
    # The sequence is the target's own greedy continuation of a prompt: the data a drafter is trained on.
    prompt = torch.randint(3, len(target.tokenizer) - 1, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    reference = target_generate(target, prompt, NEW + BLOCK, stop_token_ids=[])
    ids = torch.tensor([prompt + reference.tokens])
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, PROMPT:] = 1  # anchors and labels on the response, as in training data
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}

    before = speculative_generate(target, system.drafter, system.head, prompt, NEW, stop_token_ids=[])
    optimizer = torch.optim.AdamW(system.trainable_parameters(), lr=1e-2)
    system.train()
    for _ in range(120):
        step = system.compute_step(batch)
        optimizer.zero_grad()
        step["loss"].backward()
        optimizer.step()
    logs = step["logs"]
    assert logs["oracle_prefix_ce/forced_acc"] == 1.0 and logs["distractor_penalty"] < 0.05 * 0.25

    for selector in (system.head, Top1Selector()):
        got = speculative_generate(target, system.drafter, selector, prompt, NEW, stop_token_ids=[])
        assert got.tokens == reference.tokens[:NEW]  # lossless, with drafts accepted
        assert got.accepted_lengths == [BLOCK - 1] * ROUNDS, type(selector).__name__
        assert got.tau == BLOCK  # bonus token included
    assert before.tau < 2  # untrained, the drafts were (nearly) all rejected: the gate measures training
