"""A synthetic collision task: the head must learn the coupling that per-slot marginals cannot encode.

Each block belongs to one of ``G`` collision groups with two equally likely continuations,
``A_g B_g`` and ``C_g D_g``. The drafter is an oracle of the *marginals*: at slot 1 it gives ``A_g``
and ``C_g`` the same logit (plus tiny noise), at slot 2 the same for ``B_g`` and ``D_g``, plus a
lower-ranked distractor, so per-slot argmax emits the incoherent ``A_g D_g`` / ``C_g B_g`` about half
the time. The slot hidden states are pure noise and the label of each block is a fresh coin flip, so
nothing can be copied: the only way to be coherent is to learn from the candidate tokens themselves
that ``B_g`` follows ``A_g`` and ``D_g`` follows ``C_g``, and to couple the slot-2 choice to the slot-1
choice through the pair scores.

With a noise anchor feature no input reveals the coin flip, so slot 1 stays a guess. With an
informative one (the fused context feature says which branch the text took, as a real anchor does)
the start scores must read it: the head then gets whole blocks right, and loses slot 1 again when the
anchor is withheld. Both variants train with the full loss set of the recipe (oracle-prefix CE, margin
hinge, distractor penalty on the target's logits).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lilicorr_pl.heads import LiLiCorrHead, SelectContext, Top1Selector
from lilicorr_pl.losses import DistractorPenalty, LossInputs, MarginHinge, OraclePrefixCE
from lilicorr_pl.models.dflash import DraftOutput

GROUPS, HIDDEN, K = 4, 16, 3
VOCAB = 4 * GROUPS + 4  # four tokens per group plus a few unrelated ones (distractors)


def _tokens(group: torch.Tensor) -> tuple[torch.Tensor, ...]:
    a = 4 * group
    return a, a + 1, a + 2, a + 3  # A, B, C, D


BRANCH = torch.nn.functional.normalize(torch.randn(HIDDEN, generator=torch.Generator().manual_seed(7)), dim=0)


def _sample(n: int, g: torch.Generator, informative_anchor: bool):
    """Slot outputs for ``n`` blocks, their true continuations and the target's logits ``[n, 2, V]``."""
    group = torch.randint(0, GROUPS, (n,), generator=g)
    a, b, c, d = _tokens(group)
    rows = torch.arange(n)
    logits = torch.randn(n, 2, VOCAB, generator=g)  # background, well below the top candidates
    logits[rows, 0, a] = 6.0
    logits[rows, 0, c] = 6.0
    logits[rows, 1, b] = 6.0
    logits[rows, 1, d] = 6.0
    distractor = 4 * GROUPS + torch.randint(0, 4, (n, 2), generator=g)
    logits[rows[:, None], torch.arange(2)[None, :], distractor] = 4.5  # third candidate of each slot
    logits = logits + 0.05 * torch.randn(n, 2, VOCAB, generator=g)  # ties broken at random
    first = torch.randint(0, 2, (n,), generator=g).bool()  # the coin flip: A B or C D
    labels = torch.stack([torch.where(first, a, c), torch.where(first, b, d)], dim=1)  # [n, 2]
    slot_hidden = torch.randn(n, 2, HIDDEN, generator=g)  # carries no information
    anchor = torch.randn(n, HIDDEN, generator=g)
    if informative_anchor:  # the context says which branch: ± a fixed direction, plus noise
        anchor = 0.5 * anchor + 3.0 * torch.where(first, 1.0, -1.0)[:, None] * BRANCH
    # The target, teacher-forced: sure of slot 2 given the true slot 1; at slot 1 sure only when the
    # context tells the branch (else both branches are equally plausible, not distractors).
    target = torch.zeros(n, 2, VOCAB)
    target[rows, 0, a] = target[rows, 0, c] = 6.0
    if informative_anchor:
        target[rows, 0, labels[:, 0]] = 9.0
    target[rows, 1, labels[:, 1]] = 9.0
    return slot_hidden, logits, anchor, labels, target


def _coherent(tokens: torch.Tensor) -> torch.Tensor:
    """A block is coherent when it is ``A_g B_g`` or ``C_g D_g`` for some group ``g``."""
    first, second = tokens[:, 0], tokens[:, 1]
    starts_a_or_c = (first % 2 == 0) & (first < 4 * GROUPS)
    return starts_a_or_c & (second == first + 1)


@pytest.fixture
def one_thread():
    """Tiny ops are ~10x faster on one thread than on two busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


LOSSES = (OraclePrefixCE(weight=0.125), MarginHinge(weight=0.125, margin=2.0), DistractorPenalty(weight=0.25))


def _train(informative_anchor: bool) -> tuple[LiLiCorrHead, nn.Embedding]:
    torch.manual_seed(0)
    embedding = nn.Embedding(VOCAB, HIDDEN).requires_grad_(False)  # the frozen "target" embedding
    head = LiLiCorrHead(top_k=K, hidden_size=32, num_layers=1, num_heads=4, factor_dim=32).build(
        HIDDEN, VOCAB, block_size=3
    )
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    head.train()
    for _ in range(150):
        slot_hidden, logits, anchor, labels, target = _sample(64, g, informative_anchor)
        lattice = head.score_lattice(slot_hidden, logits, anchor, torch.ones(64, dtype=torch.bool), embedding)
        inputs = LossInputs(logits, labels, torch.ones_like(labels, dtype=torch.bool), lattice,
                            lambda ids, t=target: t.gather(-1, ids))
        loss = sum(component(inputs).loss for component in LOSSES)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval(), embedding


def test_lilicorr_learns_coherent_pairs_that_top1_cannot_produce(one_thread):
    head, embedding = _train(informative_anchor=False)
    slot_hidden, logits, anchor, labels, _ = _sample(2000, torch.Generator().manual_seed(2), False)
    with torch.no_grad():
        draft = DraftOutput(slot_hidden, logits, anchor, torch.ones(2000, dtype=torch.bool))
        context = SelectContext(torch.zeros(2000, dtype=torch.long), torch.zeros(2000, dtype=torch.long), embedding)
        lilicorr = head.select(draft, context).tokens
        top1 = Top1Selector().select(draft, context).tokens
    top1_rate = _coherent(top1).float().mean().item()
    head_rate = _coherent(lilicorr).float().mean().item()
    assert 0.4 < top1_rate < 0.6, top1_rate  # the marginals cannot encode the coupling
    assert head_rate >= 0.95, head_rate
    # It is coherence, not label copying: the head matches the coin flip only by chance at slot 1.
    slot1_match = (lilicorr[:, 0] == labels[:, 0]).float().mean().item()
    assert 0.4 < slot1_match < 0.6, slot1_match


def test_lilicorr_reads_the_anchor_feature_for_the_first_slot(one_thread):
    head, embedding = _train(informative_anchor=True)
    slot_hidden, logits, anchor, labels, _ = _sample(2000, torch.Generator().manual_seed(2), True)
    with torch.no_grad():
        n = slot_hidden.shape[0]
        context = SelectContext(torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long), embedding)
        tokens = head.select(DraftOutput(slot_hidden, logits, anchor, torch.ones(n, dtype=torch.bool)), context).tokens
        no_anchor = DraftOutput(slot_hidden, logits, torch.zeros_like(anchor), torch.zeros(n, dtype=torch.bool))
        blind = head.select(no_anchor, context).tokens  # no anchor
    exact = (tokens == labels).all(-1).float().mean().item()
    assert exact >= 0.95, exact  # the anchor picks the branch, the pair scores the continuation
    blind_slot1 = (blind[:, 0] == labels[:, 0]).float().mean().item()
    assert 0.35 < blind_slot1 < 0.65, blind_slot1  # without it slot 1 is a guess again
    assert _coherent(blind).float().mean().item() >= 0.9  # the coupling does not need the anchor
