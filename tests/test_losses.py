"""Loss components, lattice diagnostics and LatticeMetrics on hand-computed examples."""

from __future__ import annotations

import math

import pytest
import torch

from lilicorr_pl.heads import Lattice, greedy_walk
from lilicorr_pl.losses import (
    DFlashCE,
    DistractorPenalty,
    LossInputs,
    MarginHinge,
    OraclePrefixCE,
    decay_weights,
    forced_slots,
    lattice_diagnostics,
)
from lilicorr_pl.metrics import LatticeMetrics

LN2, LN3, LN4 = math.log(2), math.log(3), math.log(4)
E1 = math.exp(-1)  # decay weight of slot 2 with gamma = 1


# ---------------------------------------------------------------------------- DFlash CE


def _dflash_inputs(mask=(True, True)) -> LossInputs:
    logits = torch.tensor([[[0.0, 0.0], [LN3, 0.0]]], requires_grad=True)  # p(slot 2) = [3/4, 1/4]
    labels = torch.tensor([[0, 1]])  # CE = ln 2 and ln 4
    return LossInputs(logits, labels, torch.tensor([mask]))


def test_decay_weights():
    torch.testing.assert_close(decay_weights(3, 7.0), torch.tensor([1.0, math.exp(-1 / 7), math.exp(-2 / 7)]))
    torch.testing.assert_close(decay_weights(3, None), torch.ones(3))


def test_dflash_ce_hand_computed():
    inputs = _dflash_inputs()
    out = DFlashCE(weight=2.0, gamma=1.0)(inputs)
    expected = (LN2 + E1 * LN4) / (1 + E1)
    assert out.loss.item() == pytest.approx(2.0 * expected, rel=1e-6)
    assert out.logs["ce"].item() == pytest.approx(expected, rel=1e-6)
    assert out.logs["top1_acc"].item() == pytest.approx(0.5)  # slot 1 ties -> argmax 0 is right
    out.loss.backward()  # d CE / d logits = softmax - onehot, times 2 · w_k / (w_1 + w_2)
    expected_grad = torch.tensor([[[-0.5, 0.5], [0.75 * E1, -0.75 * E1]]]) * 2.0 / (1 + E1)
    torch.testing.assert_close(inputs.drafter_logits.grad, expected_grad)


def test_dflash_ce_ignores_unsupervised_slots_and_their_labels():
    inputs = _dflash_inputs(mask=(True, False))
    inputs.labels[0, 1] = -100  # arbitrary label where unsupervised must not crash
    assert DFlashCE(gamma=1.0)(inputs).loss.item() == pytest.approx(LN2, rel=1e-6)
    none = DFlashCE()(_dflash_inputs(mask=(False, False)))
    assert none.loss.item() == 0.0
    none.loss.backward()  # still differentiable


# ---------------------------------------------------------------------------- lattice losses


def _hand_lattice() -> tuple[Lattice, torch.Tensor]:
    """M=1, S=3, K=2. True tokens at ranks 1, 0, absent -> forced slots 0 and 1.

    slot 0 softmax(start) = softmax([0, ln 3]) = [1/4, 3/4], true rank 1 -> CE ln(4/3)
    slot 1 row leaving the TRUE slot-0 candidate (rank 1) = [0, 0], true rank 0 -> CE ln 2
    The row leaving rank 0 strongly prefers rank 0 and must be ignored (teacher forcing);
    pair[1] is past the oracle prefix and must be ignored as well.
    """
    start = torch.tensor([[0.0, LN3]], requires_grad=True)
    pair = torch.tensor([[[[10.0, -10.0], [0.0, 0.0]], [[50.0, -50.0], [-50.0, 50.0]]]], requires_grad=True)
    candidates = torch.tensor([[[5, 6], [7, 8], [9, 10]]])
    lattice = Lattice(candidates=candidates, start=start, pair=pair, candidate_logprobs=torch.zeros(1, 3, 2))
    labels = torch.tensor([[6, 7, 11]])
    return lattice, labels


def _lattice_inputs(target_logits=None) -> LossInputs:
    lattice, labels = _hand_lattice()
    logits = torch.zeros(1, 3, 12)
    return LossInputs(logits, labels, torch.ones(1, 3, dtype=torch.bool), lattice, target_logits)


def test_forced_slots_rows_and_memo():
    inputs = _lattice_inputs()
    forced = forced_slots(inputs)
    assert forced.mask.tolist() == [[True, True, False]]
    assert forced.true_rank.tolist() == [[1, 0, -1]]
    torch.testing.assert_close(forced.scores[0, 0], torch.tensor([0.0, LN3]))
    torch.testing.assert_close(forced.scores[0, 1], torch.tensor([0.0, 0.0]))  # row leaving rank 1
    assert forced_slots(inputs) is forced  # computed once per step, shared by the components


def test_oracle_prefix_ce_hand_computed():
    ce0, ce1 = math.log(4 / 3), LN2
    plain = OraclePrefixCE(weight=1.0)(_lattice_inputs())  # the reference: a plain mean over forced slots
    assert plain.loss.item() == pytest.approx((ce0 + ce1) / 2, rel=1e-6)
    assert plain.logs["forced_len"].item() == 2
    assert plain.logs["forced_acc"].item() == pytest.approx(1.0)  # slot 0 right, slot 1 tie -> rank 0 right
    decayed_inputs = _lattice_inputs()
    decayed = OraclePrefixCE(weight=0.25, gamma=1.0)(decayed_inputs)
    assert decayed.loss.item() == pytest.approx(0.25 * (ce0 + E1 * ce1) / (1 + E1), rel=1e-6)
    decayed.loss.backward()
    lattice = decayed_inputs.lattice
    assert lattice.pair.grad[0, 0, 0].abs().sum() == 0  # row leaving the wrong candidate: unused
    assert lattice.pair.grad[0, 1].abs().sum() == 0  # past the oracle prefix: unsupervised
    # d CE / d start = softmax - onehot, scaled by 0.25 * w_1 / (w_1 + w_2)
    torch.testing.assert_close(lattice.start.grad[0], 0.25 / (1 + E1) * torch.tensor([0.25, -0.25]))


def test_margin_hinge_hand_computed():
    out = MarginHinge(weight=1.0, margin=2.0)(_lattice_inputs())
    # slot 0: margin ln 3 -> 2 - ln 3; slot 1: margin 0 -> 2 (plain mean by default)
    assert out.loss.item() == pytest.approx(((2 - LN3) + 2) / 2, rel=1e-6)
    assert out.logs["violation_rate"].item() == 1.0
    assert MarginHinge(weight=1.0, margin=0.5)(_lattice_inputs()).loss.item() == pytest.approx(0.25)
    decayed = MarginHinge(weight=1.0, margin=2.0, gamma=1.0)(_lattice_inputs())
    assert decayed.loss.item() == pytest.approx(((2 - LN3) + E1 * 2) / (1 + E1), rel=1e-6)
    # K = 1: no competitor, no hinge
    one = Lattice(torch.tensor([[[3]]]), torch.zeros(1, 1), torch.zeros(1, 0, 1, 1), torch.zeros(1, 1, 1))
    inputs = LossInputs(torch.zeros(1, 1, 4), torch.tensor([[3]]), torch.ones(1, 1, dtype=torch.bool), one)
    assert MarginHinge(weight=1.0)(inputs).loss.item() == 0.0


def test_distractor_penalty_hand_computed():
    z = torch.zeros(12)
    z[5], z[6] = 1.0, 3.0  # slot 0: distractor 5 costs relu(3 - 1) = 2, true 6 costs 0
    z[7], z[8] = 2.0, 0.5  # slot 1: true 7 costs 0, distractor 8 costs 1.5
    z[9], z[10], z[11] = 100.0, -100.0, 7.0  # slot 2 is past the oracle prefix
    calls = []

    def target_logits(ids: torch.Tensor) -> torch.Tensor:
        calls.append(ids.clone())
        return z[ids]

    out = DistractorPenalty(weight=1.0)(_lattice_inputs(target_logits))  # plain mean by default
    # slot 0: (1/4)·2 + (3/4)·0 = 0.5; slot 1: (1/2)·0 + (1/2)·1.5 = 0.75
    assert out.loss.item() == pytest.approx((0.5 + 0.75) / 2, rel=1e-6)
    assert len(calls) == 1 and calls[0].tolist() == [[[5, 6, 6], [7, 8, 7], [9, 10, 11]]]
    decayed = DistractorPenalty(weight=0.25, gamma=1.0)(_lattice_inputs(target_logits))
    assert decayed.loss.item() == pytest.approx(0.25 * (0.5 + E1 * 0.75) / (1 + E1), rel=1e-6)


def _two_blocks(second_mask=(True, True, False)) -> LossInputs:
    """The hand lattice twice: block 0 fully supervised, block 1 with ``second_mask``.

    Block 1's forced slots would be slots 0 and 1 (its last slot is outside the lattice anyway), so
    truncating it at its first unsupervised slot would change nothing about its forced slots: only
    skipping the whole block, as the reference does, removes it from the losses.
    """
    lattice, labels = _hand_lattice()
    start = lattice.start.detach().repeat(2, 1) * torch.tensor([[1.0], [3.0]])  # block 1 scores differently
    lattice = Lattice(lattice.candidates.repeat(2, 1, 1), start, lattice.pair.detach().repeat(2, 1, 1, 1),
                      torch.zeros(2, 3, 2))
    mask = torch.tensor([[True, True, True], list(second_mask)])
    return LossInputs(torch.zeros(2, 3, 12), labels.repeat(2, 1), mask, lattice, lambda ids: ids.float())


def test_blocks_with_an_unsupervised_slot_are_skipped_whole():
    one = _lattice_inputs(lambda ids: ids.float())
    both = _two_blocks()
    forced = forced_slots(both)
    assert forced.valid_block.tolist() == [True, False]
    assert forced.mask.tolist() == [[True, True, False], [False, False, False]]
    for loss in (OraclePrefixCE(weight=1.0), MarginHinge(weight=1.0), DistractorPenalty(weight=1.0)):
        assert loss(both).loss.item() == pytest.approx(loss(one).loss.item(), rel=1e-6), loss.name
    # The same second block, fully supervised, does count (its start scores differ from block 0's).
    full = _two_blocks(second_mask=(True, True, True))
    assert OraclePrefixCE(weight=1.0)(full).loss.item() != pytest.approx(OraclePrefixCE(weight=1.0)(one).loss.item())
    assert OraclePrefixCE(weight=1.0)(both).logs["forced_len"].item() == 2  # mean over valid blocks only


def test_distractor_penalty_queries_valid_ids_where_labels_are_unsupervised():
    inputs = _lattice_inputs()
    inputs.labels[0, 2] = -100
    inputs.label_mask[0, 2] = False
    seen = []
    inputs.target_logits = lambda ids: seen.append(ids) or ids.float()
    DistractorPenalty()(inputs)
    assert (seen[0] >= 0).all()


def test_lattice_losses_explain_missing_inputs():
    no_lattice = LossInputs(torch.zeros(1, 2, 4), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool))
    for loss in (OraclePrefixCE(), MarginHinge(), DistractorPenalty()):
        with pytest.raises(ValueError, match="needs a lattice head such as LiLiCorrHead; remove it from model.losses"):
            loss(no_lattice)
    with pytest.raises(ValueError, match="needs target logits"):
        DistractorPenalty()(_lattice_inputs(target_logits=None))
    with pytest.raises(ValueError, match="weight must be a finite number >= 0, got -1"):
        DFlashCE(weight=-1)
    with pytest.raises(ValueError, match="gamma must be positive"):
        OraclePrefixCE(gamma=0.0)


# ---------------------------------------------------------------------------- diagnostics and metrics


def _diag_case():
    """M=3, S=3, K=2 lattice; greedy walk picks ranks [1, 0, 0] in every block.

    Block 2 runs off the supervision at its last slot: it is skipped whole (its slot 0 would
    otherwise count a selected prefix of 1).
    """
    candidates = torch.tensor([[[1, 2], [3, 4], [5, 6]]]).repeat(3, 1, 1)
    start = torch.tensor([[0.0, 2.0]]).repeat(3, 1)  # std 1
    pair = torch.zeros(3, 2, 2, 2)  # flat rows, std 0
    lattice = Lattice(candidates, start, pair, torch.zeros(3, 3, 2))
    logits = torch.zeros(3, 3, 8)
    logits[:, 0, 1], logits[:, 0, 2] = 2.0, 1.0  # top-1 / top-2 per slot follow the candidates
    logits[:, 1, 3], logits[:, 1, 4] = 2.0, 1.0
    logits[:, 2, 5], logits[:, 2, 6] = 2.0, 1.0
    labels = torch.tensor([[2, 3, 5], [1, 3, 6], [2, 4, 7]])
    mask = torch.tensor([[True, True, True], [True, True, True], [True, True, False]])
    return lattice, logits, labels, mask


def test_lattice_diagnostics_hand_computed():
    lattice, logits, labels, mask = _diag_case()
    d = lattice_diagnostics(lattice, logits, labels, mask)  # selected = greedy walk = tokens [2, 3, 5]
    assert d["valid_block"].tolist() == [True, True, False]
    assert d["top1_prefix"].tolist() == [0, 2, 0]
    assert d["selected_prefix"].tolist() == [3, 0, 0]  # block 2 skipped, not truncated to 1
    assert d["oracle_prefix"].tolist() == [3, 3, 0]
    assert d["oracle_gap"].tolist() == [0, 3, 0]
    assert d["sim_tau_selected"].tolist() == [4, 1, 1]
    assert d["exact_block"].tolist() == [True, False, False]
    assert d["supervised"].tolist() == [[True] * 3, [True] * 3, [False] * 3]
    assert d["covered"].tolist() == [[True] * 3, [True] * 3, [False] * 3]
    assert d["off_top1"].tolist() == [[True, False, False]] * 2 + [[False] * 3]  # rank 1 at slot 0; block 2 skipped
    torch.testing.assert_close(d["logfactor_row_spread"], torch.tensor([1 / 5, 1 / 5, 0.0]))  # (1 + 0·4) / 5 rows
    # The reference's form: (std of the start row, Bessel-corrected: √2; + the pair matrices' mean std: 0) / 2.
    torch.testing.assert_close(d["logfactor_spread"], torch.tensor([2 ** 0.5 / 2, 2 ** 0.5 / 2, 0.0]))
    flat = Lattice(lattice.candidates, torch.zeros(3, 2), lattice.pair, lattice.candidate_logprobs)
    for key in ("logfactor_spread", "logfactor_row_spread"):
        assert lattice_diagnostics(flat, logits, labels, mask)[key].abs().max() == 0


def test_logfactor_spread_is_the_references_and_the_row_spread_sees_rows_that_cannot_choose():
    """logfactor_spread took the std of every K-wide row and called it by the reference's name; the reference
    (Model-Optimizer's lilicorr_logfactor_spread) takes the start row's std and each whole K x K pair matrix's, half
    and half. Pair rows that each hold one value but differ from each other: the walk cannot choose in any of them
    (row spread 0), while the reference's form reads them as spread."""
    from lilicorr_pl.losses import logfactor_row_spread, logfactor_spread

    start = torch.tensor([[1.0, 3.0, 5.0]])  # std (Bessel) 2
    rows = torch.tensor([0.0, 3.0, 6.0]).view(3, 1).expand(3, 3)  # each row one value; the matrix's std: √(54/8)
    pair = torch.stack([rows, 2 * rows]).unsqueeze(0)  # [M=1, S-1=2, K, K]: stds √6.75 and 2·√6.75
    lattice = Lattice(torch.zeros(1, 3, 3, dtype=torch.long), start, pair, torch.zeros(1, 3, 3))
    expected = (2 + 1.5 * 6.75 ** 0.5) / 2
    torch.testing.assert_close(logfactor_spread(lattice), torch.tensor([expected]))
    torch.testing.assert_close(logfactor_row_spread(lattice), torch.tensor([(8 / 3) ** 0.5 / 7]))  # flat pair rows
    one_candidate = Lattice(torch.zeros(2, 3, 1, dtype=torch.long), torch.ones(2, 1), torch.ones(2, 2, 1, 1),
                            torch.zeros(2, 3, 1))
    assert logfactor_spread(one_candidate).tolist() == [0.0, 0.0]  # (the reference: 0, not NaN)
    no_pair = Lattice(torch.zeros(1, 1, 3, dtype=torch.long), start, torch.zeros(1, 0, 3, 3), torch.zeros(1, 1, 3))
    torch.testing.assert_close(logfactor_spread(no_pair), torch.tensor([1.0]))  # block 2: the start half alone


def test_lattice_metrics_compute_and_no_lattice_mode():
    lattice, logits, labels, mask = _diag_case()
    metric = LatticeMetrics(num_slots=3, top_k=2)
    metric.update(lattice, logits, labels, mask)
    out = metric.compute()  # over the two valid blocks
    assert out["selected_prefix"].item() == pytest.approx(3 / 2)
    assert out["top1_prefix"].item() == pytest.approx(1.0)
    assert out["sim_tau_top1"].item() == pytest.approx(2.0)
    assert out["oracle_gap"].item() == pytest.approx(3 / 2)
    assert out["exact_block_rate"].item() == pytest.approx(1 / 2)
    torch.testing.assert_close(out["slot_coverage"], torch.tensor([1.0, 1.0, 1.0]))
    torch.testing.assert_close(out["slot_accuracy"], torch.tensor([1 / 2, 1.0, 1 / 2]))
    torch.testing.assert_close(out["slot_accuracy_top1"], torch.tensor([1 / 2, 1.0, 1 / 2]))
    assert out["logfactor_row_spread"].item() == pytest.approx(0.2)
    assert out["logfactor_spread"].item() == pytest.approx(2 ** 0.5 / 2)
    assert out["off_top1_rate"].item() == pytest.approx(2 / 6)  # one slot of three left top-1, in each valid block

    plain = LatticeMetrics(num_slots=3, top_k=2)
    plain.update(None, logits, labels, mask)  # selected = top-1, oracle from the drafter's own top-2
    p = plain.compute()
    assert p["selected_prefix"] == p["top1_prefix"] and p["oracle_prefix"].item() == pytest.approx(3.0)
    assert "logfactor_spread" not in p and "logfactor_row_spread" not in p
    assert p["off_top1_rate"].item() == 0.0
    with pytest.raises(ValueError, match="built for 4 slots"):
        LatticeMetrics(num_slots=4).update(lattice, logits, labels, mask)


def test_lattice_metrics_merge_state_equals_one_update():
    g = torch.Generator().manual_seed(0)
    m, s, k, v = 10, 4, 3, 6

    def batch():
        logits = torch.randn(m, s, v, generator=g)
        candidates = logits.topk(k, dim=-1).indices
        lattice = Lattice(candidates, torch.randn(m, k, generator=g), torch.randn(m, s - 1, k, k, generator=g),
                          torch.zeros(m, s, k))
        labels = torch.randint(0, v, (m, s), generator=g)
        mask = torch.rand(m, s, generator=g) > 0.2
        return lattice, logits, labels, mask

    (l1, z1, y1, k1), (l2, z2, y2, k2) = batch(), batch()
    a, b, both = LatticeMetrics(s, k), LatticeMetrics(s, k), LatticeMetrics(s, k)
    a.update(l1, z1, y1, k1)
    b.update(l2, z2, y2, k2)
    a.merge_state(b)
    cat = Lattice(*(torch.cat([getattr(l1, f), getattr(l2, f)]) for f in ("candidates", "start", "pair", "candidate_logprobs")))
    both.update(cat, torch.cat([z1, z2]), torch.cat([y1, y2]), torch.cat([k1, k2]))
    merged, single = a.compute(), both.compute()
    assert merged.keys() == single.keys()
    for key in merged:
        torch.testing.assert_close(merged[key], single[key])
    # selected defaults to the greedy walk over the lattice
    idx = greedy_walk(cat.start, cat.pair)
    explicit = LatticeMetrics(s, k)
    explicit.update(cat, torch.cat([z1, z2]), torch.cat([y1, y2]), torch.cat([k1, k2]),
                    cat.candidates.gather(-1, idx[..., None]).squeeze(-1))
    torch.testing.assert_close(explicit.compute()["selected_prefix"], single["selected_prefix"])


def test_a_margin_that_is_not_a_finite_number_is_refused():
    """A nan margin made the hinge, and so the run's loss, nan: the run went on and exited 0."""
    from lilicorr_pl.losses import MarginHinge

    for margin in (math.nan, math.inf):
        with pytest.raises(ValueError, match="MarginHinge margin must be a finite number, got"):
            MarginHinge(weight=0.125, margin=margin)
    assert MarginHinge(margin=-1.0).margin == -1.0
