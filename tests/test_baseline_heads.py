"""The corrector baselines Domino and DSpark (DESIGN §4.3) and their losses CorrectorCE and DSparkLoss.

The properties that matter: the parallel teacher-forced training path equals the sequential inference
recurrence fed the same previous tokens; inference feeds the head its own picks; each head starts as
its reference starts it; each is trained as its reference trains it (Domino's curriculum over the
whole run, DeepSpec's CE + L1 objective for DSpark); trained on a collision task the heads become
coherent where per-slot top-1 cannot.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from helpers import save_edited
from lilicorr_pl.heads import (
    CorrectorHead,
    DominoHead,
    DraftSampling,
    DSparkHead,
    HeadOutput,
    SelectContext,
    TeacherForcing,
    Top1Selector,
)
from lilicorr_pl.losses import CorrectorCE, DSparkLoss, LossInputs
from lilicorr_pl.models.dflash import DraftOutput

H, V, S, M = 8, 11, 5, 4

HEADS = {
    "domino": lambda gated=False: DominoHead(gru_hidden=6, rank=4, gated=gated),
    "dspark": lambda gated=False: DSparkHead(rank=4, gated=gated),
}
VARIANTS = [(name, gated) for name in HEADS for gated in (False, True)]
VARIANT_IDS = [f"{name}{'-gated' if gated else ''}" for name, gated in VARIANTS]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny ops are ~10x faster on one thread than on two busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _embedding(vocab: int = V, hidden: int = H) -> nn.Embedding:
    """The frozen "target" embedding; left trainable here so a leak of gradient into it would show."""
    return nn.Embedding(vocab, hidden)


def _trained_like(head: CorrectorHead, seed: int = 0) -> CorrectorHead:
    """Random non-zero weights everywhere (a fresh head's zero last layer would make every test trivial)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.7)
    return head


def _select(head, slot_hidden, slot_logits, embedding, anchor_tokens, sampling=None):
    """``head.select`` on raw tensors (the anchor feature is unused by corrector heads)."""
    b, _, h = slot_hidden.shape
    draft = DraftOutput(slot_hidden, slot_logits, torch.zeros(b, h), torch.ones(b, dtype=torch.bool))
    context = SelectContext(anchor_tokens, torch.zeros(b, dtype=torch.long), embedding, sampling)
    return head.select(draft, context)


def _inputs(seed: int = 0, m: int = M):
    g = torch.Generator().manual_seed(seed)
    slot_hidden = torch.randn(m, S, H, generator=g)
    slot_logits = torch.randn(m, S, V, generator=g)
    prev = torch.randint(0, V, (m, S), generator=g)
    return slot_hidden, slot_logits, prev


@pytest.mark.parametrize("name,gated", VARIANTS, ids=VARIANT_IDS)
def test_teacher_forced_logits_equal_the_sequential_recurrence(name, gated):
    head = _trained_like(HEADS[name](gated).build(H, V))
    embedding = _embedding()
    slot_hidden, slot_logits, prev = _inputs()
    parallel = head.corrected_logits(slot_hidden, slot_logits, prev, embedding)  # [M, S, V]
    state = head.initial_state(M, slot_logits.device)
    for k in range(S):  # the inference recurrence, forced to read the true previous tokens
        step_logits, state = head.step(slot_hidden[:, k], slot_logits[:, k], prev[:, k], state, embedding, k)
        torch.testing.assert_close(parallel[:, k], step_logits, atol=1e-5, rtol=1e-5)
    assert (parallel - slot_logits).abs().amax() > 0.1  # the correction is not trivially zero


@pytest.mark.parametrize("name", HEADS)
def test_slot_k_reads_only_tokens_up_to_k_minus_1(name):
    head = _trained_like(HEADS[name]().build(H, V))
    embedding = _embedding()
    slot_hidden, slot_logits, prev = _inputs()
    before = head.corrected_logits(slot_hidden, slot_logits, prev, embedding)
    changed = prev.clone()
    changed[:, 2] = (changed[:, 2] + 1) % V
    after = head.corrected_logits(slot_hidden, slot_logits, changed, embedding)
    torch.testing.assert_close(after[:, :2], before[:, :2])  # earlier slots untouched
    assert (after[:, 2] - before[:, 2]).abs().amax() > 1e-3  # the slot it conditions changes
    if name == "dspark":  # first order: later slots do not remember it
        torch.testing.assert_close(after[:, 3:], before[:, 3:])
    else:  # the GRU carries it forward
        assert (after[:, 3:] - before[:, 3:]).abs().amax() > 1e-3


@pytest.mark.parametrize("name,gated", VARIANTS, ids=VARIANT_IDS)
def test_select_feeds_its_own_picks_back(name, gated):
    head = _trained_like(HEADS[name](gated).build(H, V), seed=1).eval()
    embedding = _embedding()
    slot_hidden, slot_logits, _ = _inputs(seed=2, m=16)
    anchor = torch.randint(0, V, (16,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        tokens = _select(head, slot_hidden, slot_logits, embedding, anchor).tokens
        # Independent reference through the parallel path: slot k only reads prev[:, :k+1], so fill the
        # previous-token row with the picks so far and read off slot k.
        prev = anchor.unsqueeze(1).repeat(1, S)
        picks = []
        for k in range(S):
            logits = head.corrected_logits(slot_hidden, slot_logits, prev, embedding)[:, k]
            picks.append(logits.argmax(-1))
            if k + 1 < S:
                prev[:, k + 1] = picks[-1]
        # [b, 1]-shaped anchors behave the same.
        again = _select(head, slot_hidden, slot_logits, embedding, anchor.view(16, 1)).tokens
    assert tokens.shape == (16, S) and tokens.dtype == torch.long
    torch.testing.assert_close(tokens, torch.stack(picks, dim=1))
    torch.testing.assert_close(again, tokens)
    assert (tokens != slot_logits.argmax(-1)).any()  # the head really overrides the drafter somewhere


@pytest.mark.parametrize("gated", [False, True])
def test_untrained_domino_is_exactly_top1(gated):
    torch.manual_seed(0)
    head = HEADS["domino"](gated).build(H, V)
    embedding = _embedding()
    slot_hidden, slot_logits, prev = _inputs()
    torch.testing.assert_close(head.corrected_logits(slot_hidden, slot_logits, prev, embedding), slot_logits)
    with torch.no_grad():
        tokens = _select(head, slot_hidden, slot_logits, embedding, prev[:, 0]).tokens
    top1 = _select(Top1Selector(), slot_hidden, slot_logits, embedding, prev[:, 0]).tokens
    torch.testing.assert_close(tokens, top1)


def test_domino_is_the_reference_form_by_default():
    """As vLLM speculators' DFlash with Domino (and vLLM's proposer): the first slot keeps the drafter's logits
    (domino_pure_draft_prefix_len 1) while the GRU still reads its token, the correction MLP has no biases, and the GRU
    reads the embeddings as they are. The first version corrected slot 1 too, had biases and layer-normed the GRU's
    input."""
    head = _trained_like(DominoHead(gru_hidden=6, rank=4).build(H, V))
    assert head.uncorrected_slots == 1 and not head.input_norm
    assert [n for n, _ in head.named_parameters() if n.endswith("bias")] == []
    embedding = _embedding()
    slot_hidden, slot_logits, prev = _inputs()
    parallel = head.corrected_logits(slot_hidden, slot_logits, prev, embedding)
    assert torch.equal(parallel[:, 0], slot_logits[:, 0])  # slot 1: DFlash's own draft
    assert (parallel[:, 1:] - slot_logits[:, 1:]).abs().amax() > 0.1
    state = head.initial_state(M, slot_logits.device)
    first, state = head.step(slot_hidden[:, 0], slot_logits[:, 0], prev[:, 0], state, embedding, 0)
    assert torch.equal(first, slot_logits[:, 0]) and state.abs().amax() > 0  # the GRU read the anchor all the same
    changed = prev.clone()
    changed[:, 0] = (changed[:, 0] + 1) % V  # the anchor still conditions slot 2 onwards
    assert (head.corrected_logits(slot_hidden, slot_logits, changed, embedding)[:, 1] - parallel[:, 1]).abs().amax() > 0
    with torch.no_grad():  # raw embeddings: their scale reaches the GRU (a LayerNorm would remove it)
        scaled = nn.Embedding.from_pretrained(embedding.weight * 3.0)
        normed = _trained_like(DominoHead(gru_hidden=6, rank=4, input_norm=True).build(H, V))
    assert (head.corrected_logits(slot_hidden, slot_logits, prev, scaled) - parallel)[:, 1:].abs().amax() > 1e-3
    torch.testing.assert_close(normed.corrected_logits(slot_hidden, slot_logits, prev, scaled),
                               normed.corrected_logits(slot_hidden, slot_logits, prev, embedding), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("uncorrected", [0, 2, S + 3])
def test_domino_variants_correct_the_slots_they_say_on_both_paths(uncorrected):
    head = _trained_like(DominoHead(gru_hidden=6, rank=4, uncorrected_slots=uncorrected, bias=True).build(H, V))
    assert {n for n, _ in head.named_parameters() if n.endswith("bias")} == {"correction.0.bias", "correction.2.bias"}
    embedding = _embedding()
    slot_hidden, slot_logits, prev = _inputs()
    parallel = head.corrected_logits(slot_hidden, slot_logits, prev, embedding)
    kept = min(uncorrected, S)
    assert torch.equal(parallel[:, :kept], slot_logits[:, :kept])
    if kept < S:
        assert (parallel[:, kept] - slot_logits[:, kept]).abs().amin() > 0  # the first corrected slot
    state = head.initial_state(M, slot_logits.device)
    for k in range(S):
        step_logits, state = head.step(slot_hidden[:, k], slot_logits[:, k], prev[:, k], state, embedding, k)
        torch.testing.assert_close(parallel[:, k], step_logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="uncorrected_slots must be >= 0"):
        DominoHead(uncorrected_slots=-1)


def test_a_domino_head_that_corrects_no_slot_of_its_block_is_refused_when_built():
    """uncorrected_slots >= block_size - 1 left every draft slot the drafter's: an untrained head (and DDP stopping on
    its unused parameters). The block is known when the system builds the head."""
    with pytest.raises(ValueError, match=r"uncorrected_slots 3 leaves none of the 3 draft slots of block_size 4 "
                                         r"corrected, so the head would never train; lower it"):
        DominoHead(gru_hidden=6, rank=4, uncorrected_slots=3).build(H, V, block_size=4)
    assert DominoHead(gru_hidden=6, rank=4, uncorrected_slots=3).build(H, V, block_size=5).is_built


def test_dspark_starts_as_deepspec_starts_it():
    """W1, W2 and the per-dimension gate ~ N(0, 0.02) (DeepSpec's HF init), gate bias 0: a tiny bias at first."""
    torch.manual_seed(0)
    head = DSparkHead(rank=64, gated=True).build(96, 3000)
    for name in ("prev_token_factor", "bias_out", "gate"):
        weight = getattr(head, name).weight
        assert abs(weight.std().item() - 0.02) < 0.002 and abs(weight.mean().item()) < 0.002, name
    assert head.gate.weight.shape == (64, 96 + 64)  # one gate per low-rank dimension
    assert head.gate.bias.abs().max() == 0
    slot_hidden, slot_logits = torch.randn(4, 3, 96), torch.randn(4, 3, 3000)
    delta = head.corrected_logits(slot_hidden, slot_logits, torch.randint(0, 3000, (4, 3)), None) - slot_logits
    assert 0 < delta.abs().max() < 0.05  # ≈ r·0.02² per logit


def test_dspark_gate_scales_each_low_rank_dimension():
    head = _trained_like(DSparkHead(rank=4, gated=True).build(H, V))
    slot_hidden, slot_logits, prev = _inputs()
    factor = head.prev_token_factor(prev)  # [M, S, r]
    gate = torch.sigmoid(torch.cat([slot_hidden, factor], -1) @ head.gate.weight.T + head.gate.bias)  # [M, S, r]
    expected = slot_logits + (gate * factor) @ head.bias_out.weight.T
    torch.testing.assert_close(head.corrected_logits(slot_hidden, slot_logits, prev, None), expected)


def _losses_for(name: str):
    """Each head with its reference's loss; DSpark's reads a target distribution (random logits here)."""
    if name == "domino":
        return CorrectorCE(anneal_steps=0), None
    table = torch.randn(M, S, V, generator=torch.Generator().manual_seed(9))
    return DSparkLoss(), lambda rows: table[rows]


@pytest.mark.parametrize("name,gated", VARIANTS, ids=VARIANT_IDS)
def test_gradients_reach_drafter_outputs_and_head_but_never_the_embedding(name, gated):
    head = _trained_like(HEADS[name](gated).build(H, V))
    embedding = _embedding()
    slot_hidden, slot_logits, prev = _inputs()
    slot_hidden.requires_grad_(True)
    slot_logits.requires_grad_(True)
    corrected = head.corrected_logits(slot_hidden, slot_logits, prev, embedding)
    loss, distribution = _losses_for(name)
    inputs = LossInputs(slot_logits, prev, torch.ones(M, S, dtype=torch.bool), corrected_logits=corrected,
                        target_distribution=distribution)
    loss(inputs).loss.backward()
    assert slot_logits.grad is not None and slot_logits.grad.abs().sum() > 0
    # The ungated DSpark bias reads only the previous token; every other variant reads h_k too.
    if name == "dspark" and not gated:
        assert slot_hidden.grad is None
    else:
        assert slot_hidden.grad is not None and slot_hidden.grad.abs().sum() > 0
    for pname, p in head.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, pname
    assert embedding.weight.grad is None


@pytest.mark.parametrize("name", HEADS)
def test_fresh_head_learns_from_the_first_step(name):
    """Domino's zero last layer still gets gradient; every DSpark table (W1 too) gets gradient at once."""
    head = HEADS[name]().build(H, V)
    slot_hidden, slot_logits, prev = _inputs()
    corrected = head.corrected_logits(slot_hidden, slot_logits, prev, _embedding())
    loss, distribution = _losses_for(name)
    inputs = LossInputs(slot_logits, prev, torch.ones(M, S, dtype=torch.bool), corrected_logits=corrected,
                        target_distribution=distribution)
    loss(inputs).loss.backward()
    tables = [head.correction[2].weight] if name == "domino" else [head.prev_token_factor.weight, head.bias_out.weight]
    assert all(t.grad.abs().sum() > 0 for t in tables)


# ---------------------------------------------------------------------------- collision task

GROUPS, C_HIDDEN = 4, 16
C_VOCAB = 4 * GROUPS + 4  # A, B, C, D per group plus four unrelated tokens (distractors)


def _collision(n: int, g: torch.Generator):
    """Two equally likely continuations ``A_g B_g`` / ``C_g D_g``; the drafter knows only the marginals.

    Slot hidden states and the anchor token are noise and the label is a fresh coin flip, so the only
    way to be coherent is to condition slot 2 on the token picked at slot 1.
    """
    group = torch.randint(0, GROUPS, (n,), generator=g)
    a, b, c, d = 4 * group, 4 * group + 1, 4 * group + 2, 4 * group + 3
    rows = torch.arange(n)
    logits = torch.randn(n, 2, C_VOCAB, generator=g)
    logits[rows, 0, a] = 6.0
    logits[rows, 0, c] = 6.0
    logits[rows, 1, b] = 6.0
    logits[rows, 1, d] = 6.0
    logits = logits + 0.05 * torch.randn(n, 2, C_VOCAB, generator=g)  # ties broken at random
    first = torch.randint(0, 2, (n,), generator=g).bool()
    labels = torch.stack([torch.where(first, a, c), torch.where(first, b, d)], dim=1)  # [n, 2]
    slot_hidden = torch.randn(n, 2, C_HIDDEN, generator=g)
    anchor = torch.randint(0, C_VOCAB, (n,), generator=g)
    return slot_hidden, logits, anchor, labels


def _coherent(tokens: torch.Tensor) -> torch.Tensor:
    first, second = tokens[:, 0], tokens[:, 1]
    return (first % 2 == 0) & (first < 4 * GROUPS) & (second == first + 1)


COLLISION_HEADS = {
    "domino": lambda gated: DominoHead(gru_hidden=16, rank=16, gated=gated),
    "dspark": lambda gated: DSparkHead(rank=8, gated=gated),
}


def _collision_target(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The target's teacher-forced logits on the collision task: 50/50 at slot 1, sure of slot 2 given slot 1."""
    target = torch.full_like(logits, -4.0)
    target[:, 0] = logits[:, 0]  # A_g and C_g equally likely
    target[torch.arange(len(labels)), 1, labels[:, 1]] = 8.0  # B_g after A_g, D_g after C_g
    return target


@pytest.mark.parametrize("name,gated", VARIANTS, ids=VARIANT_IDS)
def test_corrector_learns_coherent_pairs_that_top1_cannot_produce(name, gated):
    torch.manual_seed(0)
    embedding = nn.Embedding(C_VOCAB, C_HIDDEN).requires_grad_(False)
    head = COLLISION_HEADS[name](gated).build(C_HIDDEN, C_VOCAB)
    loss_fn = CorrectorCE(gamma=None) if name == "domino" else DSparkLoss(gamma=None)  # each as its reference
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    head.train()
    for step in range(150):
        slot_hidden, logits, anchor, labels = _collision(64, g)
        prev = torch.cat([anchor.unsqueeze(1), labels[:, :-1]], dim=1)  # teacher forcing
        corrected = head.corrected_logits(slot_hidden, logits, prev, embedding)
        target = _collision_target(logits, labels)
        inputs = LossInputs(logits, labels, torch.ones_like(labels, dtype=torch.bool), corrected_logits=corrected,
                            target_distribution=lambda rows, t=target: t[rows], step=step, total_steps=40)
        loss = loss_fn(inputs).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    head.eval()
    slot_hidden, logits, anchor, labels = _collision(2000, torch.Generator().manual_seed(2))
    with torch.no_grad():
        chosen = _select(head, slot_hidden, logits, embedding, anchor).tokens
    top1_rate = _coherent(logits.argmax(-1)).float().mean().item()
    head_rate = _coherent(chosen).float().mean().item()
    assert 0.4 < top1_rate < 0.6, top1_rate
    assert head_rate >= 0.95, head_rate
    # Coherence, not label copying: slot 1 matches the coin flip only by chance.
    assert 0.4 < (chosen[:, 0] == labels[:, 0]).float().mean().item() < 0.6


# ---------------------------------------------------------------------------- CorrectorCE


def test_curriculum_lambda_spans_the_whole_run():
    loss = CorrectorCE()  # the reference: λ 1 -> 0 over all of the run's optimizer steps
    assert [loss.curriculum_lambda(t, total_steps=1000) for t in (0, 250, 500, 1000, 5000)] == pytest.approx(
        [1.0, 0.75, 0.5, 0.0, 0.0])
    assert loss.curriculum_lambda(250, total_steps=4000) == pytest.approx(0.9375)  # a longer run anchors longer
    assert CorrectorCE(anneal_fraction=0.5).curriculum_lambda(250, total_steps=1000) == pytest.approx(0.5)
    assert loss.curriculum_lambda(0) == 1.0  # step 0 needs no run length
    with pytest.raises(ValueError, match="run's length is unknown"):
        loss.curriculum_lambda(10)
    fixed = CorrectorCE(anneal_steps=100)  # an explicit length wins over the run's
    assert fixed.curriculum_lambda(50, total_steps=1000) == pytest.approx(0.5)
    assert CorrectorCE(anneal_steps=0).curriculum_lambda(0) == 0.0


def test_corrector_ce_matches_a_hand_computed_value():
    ln2, ln3 = math.log(2), math.log(3)
    # Two blocks of two slots over three tokens; the second block's slot 2 is unsupervised.
    corrected = torch.tensor([[[ln2, 0.0, 0.0], [0.0, 0.0, 0.0]],
                              [[0.0, ln3, 0.0], [9.0, -9.0, 0.0]]])
    base = torch.tensor([[[0.0, 0.0, 0.0], [0.0, 0.0, ln2]],
                         [[0.0, 0.0, 0.0], [-9.0, 9.0, 0.0]]])
    labels = torch.tensor([[0, 2], [1, -100]])  # -100: arbitrary id where unsupervised
    mask = torch.tensor([[True, True], [True, False]])
    w = math.exp(-1.0)  # gamma = 1: slot weights 1, e^-1
    # CE(final): ln 2 (p=2/4), ln 3 (uniform), ln 5/3 (p=3/5); CE(base): ln 3, ln 2 (p=2/4), ln 3.
    ce_final = (ln2 + w * ln3 + math.log(5 / 3)) / (1 + w + 1)
    ce_base = (ln3 + w * ln2 + ln3) / (1 + w + 1)
    lam = 0.75  # step 250 of a 1000-step run
    inputs = LossInputs(base, labels, mask, corrected_logits=corrected, step=250, total_steps=1000)
    out = CorrectorCE(weight=2.0, gamma=1.0)(inputs)
    assert out.loss.item() == pytest.approx(2.0 * ((1 - lam) * ce_final + lam * ce_base), rel=1e-6)
    assert out.logs["lambda"].item() == pytest.approx(lam)
    assert out.logs["ce_final"].item() == pytest.approx(ce_final, rel=1e-6)
    assert out.logs["ce_base"].item() == pytest.approx(ce_base, rel=1e-6)
    assert out.logs["top1_acc_final"].item() == pytest.approx(2 / 3)  # slots 1 of both blocks


def test_curriculum_moves_the_gradient_from_drafter_to_head():
    head = _trained_like(DominoHead(gru_hidden=6, rank=4).build(H, V))
    slot_hidden, slot_logits, prev = _inputs()
    mask = torch.ones(M, S, dtype=torch.bool)
    grads = {}
    for step in (0, 1000):
        head.zero_grad()
        base = slot_logits.clone().requires_grad_(True)
        corrected = head.corrected_logits(slot_hidden, base, prev, _embedding())
        inputs = LossInputs(base, prev, mask, corrected_logits=corrected, step=step, total_steps=1000)
        CorrectorCE()(inputs).loss.backward()
        grads[step] = (base.grad.clone(), head.correction[2].weight.grad.clone())
    # Step 0 (λ = 1): only CE(base) counts, so the head gets no gradient at all.
    assert grads[0][1].abs().sum() == 0
    # End of the run (λ = 0): only CE(final) counts; the drafter still learns through it.
    assert grads[1000][1].abs().sum() > 0 and grads[1000][0].abs().sum() > 0
    assert not torch.allclose(grads[0][0], grads[1000][0])


# ---------------------------------------------------------------------------- DSparkLoss


def test_dspark_loss_matches_a_hand_computed_value():
    ln2, ln3 = math.log(2), math.log(3)
    corrected = torch.tensor([[[ln2, 0.0, 0.0], [0.0, 0.0, 0.0]],
                              [[0.0, ln3, 0.0], [9.0, -9.0, 0.0]]], requires_grad=True)
    target = torch.tensor([[[0.0, 0.0, 0.0], [ln3, 0.0, 0.0]],
                           [[0.0, ln3, 0.0], [0.0, 5.0, 0.0]]])
    base = torch.zeros(2, 2, 3)
    labels = torch.tensor([[0, 2], [1, -100]])
    mask = torch.tensor([[True, True], [True, False]])
    w = math.exp(-1.0)  # gamma = 1
    ce = (ln2 + w * ln3 + math.log(5 / 3)) / (1 + w + 1)
    # Σ|p − q| per slot: [1/2,1/4,1/4] vs uniform -> 1/3; uniform vs [3/5,1/5,1/5] -> 8/15; equal -> 0.
    l1 = (1 / 3 + w * 8 / 15 + 0.0) / (1 + w + 1)
    seen = []

    def distribution(rows: slice) -> torch.Tensor:
        seen.append(rows)
        return target[rows]

    inputs = LossInputs(base, labels, mask, corrected_logits=corrected, target_distribution=distribution)
    out = DSparkLoss(weight=2.0, gamma=1.0, chunk_blocks=1)(inputs)  # two chunks of one block
    assert out.loss.item() == pytest.approx(2.0 * (0.1 * ce + 0.9 * l1), rel=1e-6)
    assert out.logs["ce"].item() == pytest.approx(ce, rel=1e-6)
    assert out.logs["l1"].item() == pytest.approx(l1, rel=1e-6)
    assert seen == [slice(0, 1), slice(1, 2)]
    out.loss.backward()  # through the recomputed (checkpointed) chunks
    reference = corrected.detach().clone().requires_grad_(True)
    p, q = reference.softmax(-1), target.softmax(-1)
    weights = torch.tensor([[1.0, w], [1.0, 0.0]])
    ce_ref = -(reference.log_softmax(-1).gather(-1, labels.clamp_min(0)[..., None]).squeeze(-1) * weights).sum()
    l1_ref = ((p - q).abs().sum(-1) * weights).sum()
    (2.0 * (0.1 * ce_ref + 0.9 * l1_ref) / weights.sum()).backward()
    torch.testing.assert_close(corrected.grad, reference.grad)


def test_dspark_loss_needs_the_target_distribution():
    _, slot_logits, prev = _inputs()
    inputs = LossInputs(slot_logits, prev, torch.ones(M, S, dtype=torch.bool), corrected_logits=slot_logits)
    with pytest.raises(ValueError, match="needs the target's full distribution"):
        DSparkLoss()(inputs)
    assert DSparkLoss(l1_weight=0.0)(inputs).loss.item() > 0  # CE alone reads no target
    with pytest.raises(ValueError, match="both 0"):
        DSparkLoss(ce_weight=0.0, l1_weight=0.0)


# ---------------------------------------------------------------------------- errors


def test_select_with_a_wrong_number_of_anchor_tokens_is_a_clear_error():
    head = DominoHead(gru_hidden=6, rank=4).build(H, V)
    slot_hidden, slot_logits, _ = _inputs()
    assert head.uses_corrector and not head.uses_lattice and not head.parameter_free
    with pytest.raises(ValueError, match="one anchor token per block"):
        _select(head, slot_hidden, slot_logits, _embedding(), torch.zeros(M + 1, dtype=torch.long))


@pytest.mark.parametrize("name,gated", VARIANTS, ids=VARIANT_IDS)
def test_training_call_returns_the_teacher_forced_corrected_logits(name, gated):
    head = _trained_like(HEADS[name](gated).build(H, V))
    embedding = _embedding()
    slot_hidden, slot_logits, prev = _inputs()
    labels = torch.randint(0, V, (M, S), generator=torch.Generator().manual_seed(9))
    draft = DraftOutput(slot_hidden, slot_logits, torch.zeros(M, H), torch.ones(M, dtype=torch.bool))
    out = head(draft, TeacherForcing(prev[:, 0], labels, embedding))
    assert isinstance(out, HeadOutput) and out.lattice is None
    teacher = torch.cat([prev[:, :1], labels[:, :-1]], dim=1)  # the anchor, then the true tokens
    expected = head.corrected_logits(slot_hidden, slot_logits, teacher, embedding)
    torch.testing.assert_close(out.corrected_logits, expected)
    assert torch.equal(out.selected, out.corrected_logits.argmax(-1)) and out.corrected_logits.requires_grad


@pytest.mark.parametrize("name", HEADS)
def test_sampled_selection_draws_each_slot_from_its_corrected_distribution(name):
    """At T > 0 slot k is drawn from warp(corrected logits of slot k given the tokens drawn before it)."""
    head = _trained_like(HEADS[name]().build(H, V), seed=2).eval()
    embedding = _embedding()
    slot_hidden, slot_logits, _ = _inputs(seed=3, m=32)
    anchor = torch.randint(0, V, (32,), generator=torch.Generator().manual_seed(4))
    sampling = DraftSampling(0.9, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        sel = _select(head, slot_hidden, slot_logits, embedding, anchor, sampling)
        teacher = torch.cat([anchor[:, None], sel.tokens[:, :-1]], dim=1)  # the drawn tokens, teacher-forced
        corrected = head.corrected_logits(slot_hidden, slot_logits, teacher, embedding)
    assert sel.q.shape == (32, S, V)
    torch.testing.assert_close(sel.q, torch.softmax(corrected / 0.9, -1))
    assert (sel.tokens != corrected.argmax(-1)).any()  # it samples, not argmax


def test_corrector_ce_without_corrected_logits_is_a_clear_error():
    _, slot_logits, prev = _inputs()
    assert CorrectorCE.requires_corrector
    inputs = LossInputs(slot_logits, prev, torch.ones(M, S, dtype=torch.bool))
    with pytest.raises(ValueError, match="needs a corrector head such as DominoHead or DSparkHead"):
        CorrectorCE()(inputs)


def test_bad_configuration_and_sizes_are_clear_errors():
    with pytest.raises(ValueError, match="anneal_steps"):
        CorrectorCE(anneal_steps=-1)
    with pytest.raises(ValueError, match="anneal_fraction"):
        CorrectorCE(anneal_fraction=0.0)
    with pytest.raises(ValueError, match="rank"):
        DSparkHead(rank=0)
    with pytest.raises(ValueError, match="gru_hidden"):
        DominoHead(gru_hidden=0)
    slot_hidden, slot_logits, prev = _inputs()
    with pytest.raises(RuntimeError, match="build"):
        DominoHead().corrected_logits(slot_hidden, slot_logits, prev, _embedding())
    head = DSparkHead(rank=4).build(H, V)
    weight = head.prev_token_factor.weight
    assert head.build(H, V) is head and head.prev_token_factor.weight is weight  # idempotent, no re-init
    with pytest.raises(ValueError, match="was built for hidden_size"):
        head.build(H, V + 1)
    with pytest.raises(ValueError, match="prev_tokens"):
        head.corrected_logits(slot_hidden, slot_logits, prev[:, :-1], None)


# ---------------------------------------------------------------------------- inside the system


def test_system_teacher_forces_the_anchor_then_the_true_tokens(tmp_path):
    from helpers import make_tiny_target_dir

    from lilicorr_pl.models import DFlashDrafter
    from lilicorr_pl.system import DraftSystem

    system = DraftSystem(
        target={"name_or_path": make_tiny_target_dir(tmp_path), "dtype": "float32"},
        drafter=DFlashDrafter(num_layers=1, block_size=4),
        head=DominoHead(gru_hidden=8, rank=4),
        losses=[CorrectorCE(anneal_steps=0)],
        num_anchors=4,
        lr_scheduler=None,
    )
    seen = {}
    original = system.head.corrected_logits

    def recording(slot_hidden, slot_logits, prev_tokens, embed):
        seen["prev"] = prev_tokens
        return original(slot_hidden, slot_logits, prev_tokens, embed)

    system.head.corrected_logits = recording
    # Consecutive ids: each token names its position, so the anchor token is the slot-1 label minus 1.
    ids = torch.arange(10, 34).repeat(2, 1)  # [2, 24]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    step = system.compute_step(batch, generator=torch.Generator().manual_seed(1))
    prev, labels, mask = seen["prev"], step["labels"], step["label_mask"]
    assert mask[:, 0].all()
    torch.testing.assert_close(prev[:, 0], labels[:, 0] - 1)
    torch.testing.assert_close(prev[:, 1:], labels[:, :-1])
    for key in ("corrector_ce/lambda", "corrector_ce/ce_final", "corrector_ce/ce_base"):
        assert key in step["logs"], key
    step["loss"].backward()
    assert system.head.correction[2].weight.grad.abs().sum() > 0  # joint training: head ...
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in system.drafter.parameters())  # ... and drafter
    assert all(p.grad is None for p in system.target.parameters())


@pytest.mark.parametrize("name", HEADS)
def test_speculative_decoding_feeds_the_anchor_and_stays_lossless(name, tmp_path):
    from conftest import save_tiny_target

    from lilicorr_pl.decoding import speculative_generate, target_generate
    from lilicorr_pl.models import DFlashDrafter
    from lilicorr_pl.target import FrozenTarget

    target = FrozenTarget.from_pretrained(save_tiny_target(tmp_path / "t", layers=3), load_tokenizer=False,
                                          layer_ids=[0, 1])
    torch.manual_seed(0)
    drafter = DFlashDrafter(num_layers=1, block_size=4).build(target.config, target.layer_ids)
    head = _trained_like(HEADS[name]().build(target.hidden_size, target.output_rows), seed=4)
    anchors, positions = [], []
    original = head.select

    def recording(draft, context):
        anchors.append(int(context.anchor_tokens.reshape(-1)[0]))
        positions.append(int(context.anchor_positions.reshape(-1)[0]))
        return original(draft, context)

    head.select = recording
    prompt = [5, 17, 9, 33, 2]
    got = speculative_generate(target, drafter, head, prompt, 15, stop_token_ids=[])
    assert got.tokens == target_generate(target, prompt, 15, stop_token_ids=[]).tokens
    # Round r starts from the token committed last: the first token, then each round's bonus token.
    assert got.num_rounds > 1
    starts = [sum(a + 1 for a in got.accepted_lengths[:r]) for r in range(got.num_rounds)]
    assert anchors == [got.tokens[i] for i in starts]
    assert positions == [len(prompt) + i for i in starts]  # the anchor's absolute position in the sequence


def test_domino_curriculum_spans_the_whole_run_of_a_trainer(tmp_path):
    """λ falls from 1 to 0 over trainer.estimated_stepping_batches (here: 2 epochs of 3 batches), not a fixed count."""
    import lightning as L
    from helpers import make_tiny_target_dir
    from torch.utils.data import DataLoader

    from lilicorr_pl.models import DFlashDrafter
    from lilicorr_pl.system import DraftSystem

    system = DraftSystem(
        target={"name_or_path": make_tiny_target_dir(tmp_path, layers=4, hidden=32), "layer_ids": [0, 2]},
        drafter=DFlashDrafter(num_layers=1, block_size=4), head=DominoHead(gru_hidden=8, rank=4),
        losses=[CorrectorCE()], num_anchors=4, lr_scheduler=None,
    )
    ids = torch.randint(3, 300, (6, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "attention_mask": torch.ones_like(x), "loss_mask": torch.ones_like(x)} for x in ids]

    class Lambdas(L.Callback):
        seen: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.seen.append(trainer.callback_metrics["train/corrector_ce/lambda"].item())

    recorder = Lambdas()
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder],
                        log_every_n_steps=1, limit_val_batches=0)
    trainer.fit(system, DataLoader(data, batch_size=2))
    assert trainer.estimated_stepping_batches == 6
    assert recorder.seen == pytest.approx([1 - t / 6 for t in range(6)])


def test_a_domino_checkpoint_of_the_first_form_is_rebuilt_as_it_was_trained(tmp_path, capsys, monkeypatch):
    """A Domino checkpoint written before the reference's form became the default records no uncorrected_slots; it is
    rebuilt as trained (every slot corrected, biases, layer-normed GRU input) and drafts what it drafted. Rebuilt
    with the new defaults it was refused (its bias tensors unexpected), or would have drafted something else."""
    import yaml

    from conftest import ROOT
    from lilicorr_pl.cli import main as cli_main
    from lilicorr_pl.heads.domino import FIRST_FORM, as_trained
    from lilicorr_pl.system import DraftSystem

    overlay = tmp_path / "domino.yaml"
    overlay.write_text(yaml.safe_dump({"model": {
        "head": {"class_path": "lilicorr_pl.heads.DominoHead",
                 "init_args": {"gru_hidden": 8, "rank": 4, "gated": False, **FIRST_FORM}},
        "losses": [{"class_path": "lilicorr_pl.losses.CorrectorCE", "init_args": {"weight": 1.0}}]}}))
    root = tmp_path / "run"
    cli_main(["fit", "-c", str(ROOT / "configs" / "tiny.yaml"), "-c", str(overlay), f"--trainer.default_root_dir={root}",
              "--trainer.max_steps=1", "--trainer.val_check_interval=1", "--trainer.limit_val_batches=1",
              "--trainer.enable_progress_bar=false"])
    ckpt = root / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True)
    init_args = checkpoint["hyper_parameters"]["head"]["init_args"]
    assert init_args["uncorrected_slots"] == 0  # this version records the options
    for key in FIRST_FORM:  # what the first version recorded: gru_hidden, rank, gated
        del init_args[key]
    old = tmp_path / "old.ckpt"
    save_edited(checkpoint, old)
    assert as_trained({"class_path": "lilicorr_pl.heads.DominoHead", "init_args": {"gru_hidden": 8}})["init_args"] == {
        "gru_hidden": 8, **FIRST_FORM}
    assert as_trained({"class_path": "x.LiLiCorrHead", "init_args": {}}) == {"class_path": "x.LiLiCorrHead",
                                                                             "init_args": {}}
    head = DraftSystem.from_checkpoint(old, load_target=False).head
    assert (head.uncorrected_slots, head.bias, head.input_norm) == (0, True, True)
    new = DraftSystem.from_checkpoint(ckpt, load_target=False).head
    for (name, a), (_, b) in zip(head.state_dict().items(), new.state_dict().items()):
        assert torch.equal(a, b), name
    # Loaded into a system its config builds (validate --ckpt_path, perf --ckpt): that config builds the reference's
    # form now, and the advice to pass the run's own -c files could not help; the message names the options.
    from conftest import user_error

    now = tmp_path / "domino-now.yaml"
    now.write_text(yaml.safe_dump({"model": {
        "head": {"class_path": "lilicorr_pl.heads.DominoHead", "init_args": {"gru_hidden": 8, "rank": 4}},
        "losses": [{"class_path": "lilicorr_pl.losses.CorrectorCE", "init_args": {"weight": 1.0}}]}}))
    common = ["-c", str(ROOT / "configs" / "tiny.yaml"), "-c", str(now)]
    flags = ("add --model.head.init_args.uncorrected_slots=0 --model.head.init_args.bias=true "
             "--model.head.init_args.input_norm=true")
    # Before the data are prepared and the target loaded (Lightning's load hook runs after both), by every command
    # that loads a checkpoint into this config's system (`test` has no split to measure: refused before it).
    from lilicorr_pl.data.datamodule import DraftDataModule

    monkeypatch.setattr(DraftDataModule, "prepare_data", lambda self: pytest.fail("the data were prepared first"))
    for command in ("validate", "predict", "fit"):
        err = user_error(capsys, [command, *common, f"--trainer.default_root_dir={root}", f"--ckpt_path={old}",
                                  "--trainer.enable_progress_bar=false"])
        assert f"--ckpt_path {old} holds a Domino head of its first form" in err and flags in err, (command, err)
    monkeypatch.undo()
    # Loaded outside the CLI (Lightning's load_from_checkpoint), the load hook says the same before any weight loads.
    from lilicorr_pl.system import StateMismatchError

    with pytest.raises(StateMismatchError, match="the checkpoint holds a Domino head of its first form"):
        DraftSystem.load_from_checkpoint(old, weights_only=True)
    err = user_error(capsys, ["perf", *common, f"--trainer.default_root_dir={root}", "--ckpt", str(old),
                              "--steps", "1", "--warmup", "0"])
    assert f"--ckpt {old} holds a Domino head of its first form" in err and flags in err, err
    cli_main(["validate", *common, f"--trainer.default_root_dir={root}", f"--ckpt_path={old}", *flags[4:].split(),
              "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=1"])


def test_a_first_form_domino_run_resumes_with_its_form_named():
    """Resuming a Domino run trained before the reference's form became the default: its recorded head lacks the new
    options, so every comparison differed and no command line could resume it. It is read as the form it trained in:
    the defaults are refused naming the option to set, and the first form's options resume."""
    from lilicorr_pl.checkpoint import CheckpointError
    from lilicorr_pl.heads.domino import FIRST_FORM
    from lilicorr_pl.system import check_resume_settings

    recorded = {"head": {"class_path": "lilicorr_pl.heads.DominoHead", "init_args": {"gru_hidden": 8, "rank": 4,
                                                                                     "gated": False}}}
    defaults = {"head": {"class_path": "lilicorr_pl.heads.DominoHead", "init_args": {
        "gru_hidden": 8, "rank": 4, "gated": False, "uncorrected_slots": 1, "bias": False, "input_norm": False}}}
    with pytest.raises(CheckpointError, match=r"model.head.init_args.\w+: checkpoint (0|True) vs now (1|False)"):
        check_resume_settings(recorded, defaults)
    first = {"head": {**defaults["head"], "init_args": {**defaults["head"]["init_args"], **FIRST_FORM}}}
    assert check_resume_settings(recorded, first) == []
