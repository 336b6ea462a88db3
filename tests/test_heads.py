"""Selectors, lattice decoding and the LiLiCorr head."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from lilicorr_pl.heads import (
    SELECTORS,
    DraftSampling,
    HeadOutput,
    Lattice,
    LiLiCorrHead,
    Selection,
    SelectContext,
    Selector,
    TeacherForcing,
    Top1Selector,
    forced_prefix_mask,
    greedy_walk,
    oracle_prefix,
    path_score,
    prefix_length,
    sample_walk,
    selector_class,
    viterbi,
)
from lilicorr_pl.losses import DistractorPenalty, LossInputs, OraclePrefixCE
from lilicorr_pl.models.dflash import DraftOutput

H, V = 12, 40


def _draft(slot_hidden, slot_logits, anchor, valid=None) -> DraftOutput:
    valid = torch.ones(slot_hidden.shape[0], dtype=torch.bool) if valid is None else valid
    return DraftOutput(slot_hidden, slot_logits, anchor, valid)


def _context(b: int, embed, sampling: DraftSampling | None = None) -> SelectContext:
    return SelectContext(torch.zeros(b, dtype=torch.long), torch.full((b,), 7), embed, sampling)


def _select(head, slot_hidden, slot_logits, anchor, embed, valid=None, sampling=None, **kwargs) -> Selection:
    """``head.select`` on raw tensors: a ``DraftOutput`` and a ``SelectContext`` around them."""
    draft = _draft(slot_hidden, slot_logits, anchor, valid)
    return head.select(draft, _context(slot_hidden.shape[0], embed, sampling), **kwargs)


def _random_scores(m: int, s: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(m, s - 1, k, k, generator=g)


def _manual_score(start: torch.Tensor, pair: torch.Tensor, path: tuple[int, ...]) -> float:
    total = start[path[0]].item()
    for s in range(len(path) - 1):
        total += pair[s, path[s], path[s + 1]].item()
    return total


# ---------------------------------------------------------------------------- lattice decoding


@pytest.mark.parametrize("m,s,k", [(5, 1, 3), (6, 2, 2), (7, 4, 3), (3, 6, 5)])
def test_greedy_walk_follows_the_rule(m, s, k):
    start, pair = _random_scores(m, s, k, seed=m * 100 + s * 10 + k)
    path = greedy_walk(start, pair)
    assert path.shape == (m, s) and path.dtype == torch.long
    for b in range(m):
        expected = [max(range(k), key=lambda j: start[b, j].item())]
        for t in range(s - 1):
            expected.append(max(range(k), key=lambda j: pair[b, t, expected[-1], j].item()))
        assert path[b].tolist() == expected


@pytest.mark.parametrize("s", [2, 3, 8, 9, 15, 16, 17, 33])
@pytest.mark.parametrize("ties", [False, True])
def test_the_vectorised_greedy_walk_picks_what_the_slot_by_slot_walk_picks(s, ties):
    """The walk reads its path from the successor table by pointer jumping (log2 rounds of gathers); every pick,
    ties included (the first maximum, as argmax), must be the slot-by-slot rule's, at every block length."""
    from lilicorr_pl.heads.lattice import _walk

    start, pair = _random_scores(4, s, 5, seed=s)
    if ties:  # many equal scores in a row
        start, pair = (start * 0.6).round(), (pair * 0.6).round()
    path = greedy_walk(start, pair)
    assert torch.equal(path, _walk(start, pair, lambda row: row.argmax(dim=-1)))
    for b in range(4):
        expected = [max(range(5), key=lambda j: start[b, j].item())]
        for t in range(s - 1):
            expected.append(max(range(5), key=lambda j: pair[b, t, expected[-1], j].item()))
        assert path[b].tolist() == expected
    first_top1 = greedy_walk(start, pair, first_top1=True)
    assert first_top1[:, 0].eq(0).all() and torch.equal(first_top1, _walk(
        torch.where(torch.arange(5) == 0, 1.0, 0.0).expand(4, 5), pair, lambda row: row.argmax(dim=-1)))


@pytest.mark.parametrize("m,s,k", [(4, 1, 4), (5, 2, 3), (4, 3, 3), (3, 5, 2), (2, 4, 4)])
def test_viterbi_equals_brute_force_and_path_score_agrees(m, s, k):
    start, pair = _random_scores(m, s, k, seed=7 + m + s + k)
    path = viterbi(start, pair)
    scores = path_score(start, pair, path)
    for b in range(m):
        best = max(itertools.product(range(k), repeat=s), key=lambda p: _manual_score(start[b], pair[b], p))
        assert tuple(path[b].tolist()) == best
        assert scores[b].item() == pytest.approx(_manual_score(start[b], pair[b], best), abs=1e-5)
    # Greedy never beats the best path on path score.
    assert (path_score(start, pair, greedy_walk(start, pair)) <= scores + 1e-5).all()


def test_greedy_keeps_the_early_slot_where_viterbi_sacrifices_it():
    start = torch.tensor([[1.0, 0.0]])
    pair = torch.tensor([[[[0.0, 0.0], [5.0, 5.0]]]])  # leaving rank 1 is worth much more
    assert greedy_walk(start, pair).tolist() == [[0, 0]]
    assert viterbi(start, pair).tolist() == [[1, 0]]


def test_top1_start_walk_leaves_the_first_slot_to_the_drafter():
    from lilicorr_pl.heads.lattice import walk

    start = torch.tensor([[1.0, 3.0, 0.0], [5.0, 0.0, 0.0]])  # block 0's start prefers rank 1, block 1's rank 0
    pair = torch.zeros(2, 2, 3, 3)
    pair[:, 0, 0, 2] = 4.0  # leaving rank 0: rank 2; leaving rank 1: rank 1
    pair[:, 0, 1, 1] = 4.0
    pair[:, 1, 2, 1] = 4.0  # then rank 1 after rank 2, rank 0 after rank 1
    pair[:, 1, 1, 0] = 4.0
    assert walk(start, pair, "greedy").tolist() == [[1, 1, 0], [0, 2, 1]]
    assert walk(start, pair, "top1_start").tolist() == [[0, 2, 1], [0, 2, 1]]  # only the first pick differs


def test_prefix_length_counts_leading_trues():
    correct = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    assert prefix_length(correct).tolist() == [2, 0, 4, 1]


def test_oracle_prefix_on_hand_built_blocks():
    candidates = torch.tensor(
        [
            [[1, 2], [3, 4], [5, 6], [7, 8]],  # true tokens at ranks 1, 0, absent, 0 -> prefix 2
            [[1, 2], [3, 4], [5, 6], [7, 8]],  # all present, runs off the sequence after slot 1
            [[1, 2], [3, 4], [5, 6], [7, 8]],  # first slot outside the loss mask -> prefix 0
            [[1, 2], [3, 4], [5, 6], [7, 8]],  # every slot present and supervised -> prefix 4
        ]
    )
    labels = torch.tensor([[2, 3, 9, 7], [1, 4, 6, 8], [2, 3, 5, 7], [1, 3, 5, 7]])
    label_mask = torch.tensor(
        [[1, 1, 1, 1], [1, 1, 0, 0], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool
    )
    length, true_rank = oracle_prefix(candidates, labels, label_mask)
    assert length.tolist() == [2, 2, 0, 4]
    # -1 where the token is absent *or* the slot is unsupervised (even if the label happens to match)
    assert true_rank.tolist() == [[1, 0, -1, 0], [0, 1, -1, -1], [-1, 0, 0, 0], [0, 0, 0, 0]]
    assert forced_prefix_mask(length, 4).tolist() == [
        [True, True, False, False],
        [True, True, False, False],
        [False, False, False, False],
        [True, True, True, True],
    ]


def test_oracle_prefix_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"must share \[M, S\]"):
        oracle_prefix(torch.zeros(2, 3, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long),
                      torch.ones(2, 4, dtype=torch.bool))


# ---------------------------------------------------------------------------- top-1


def test_top1_selector_is_per_slot_argmax():
    logits = torch.randn(3, 5, V)
    sel = _select(Top1Selector().build(H, V), torch.randn(3, 5, H), logits, torch.zeros(3, H), lambda ids: ids)
    assert isinstance(sel, Selection) and sel.lattice is None and sel.q is None
    assert torch.equal(sel.tokens, logits.argmax(-1))
    assert list(Top1Selector().parameters()) == []


def test_top1_samples_each_slot_from_its_warped_softmax():
    logits = 2 * torch.randn(2, 3, V, generator=torch.Generator().manual_seed(0))
    sampling = DraftSampling(0.7, top_p=0.9, generator=torch.Generator().manual_seed(1))
    n = 4000
    sel = _select(Top1Selector(), torch.zeros(n, 3, H), logits.repeat(n // 2, 1, 1), torch.zeros(n, H),
                  lambda ids: ids, sampling=sampling)
    q = sel.q.view(n // 2, 2, 3, V)
    expected = torch.softmax(logits / 0.7, -1)
    assert (q == q[:1]).all()  # the same proposal for identical blocks
    for row, probs in zip(q[0].view(-1, V), expected.view(-1, V)):  # nucleus, by hand: smallest top set >= 0.9
        order = probs.argsort(descending=True).tolist()
        kept, mass = [], 0.0
        for i in order:
            if mass >= 0.9:
                break
            kept.append(i)
            mass += probs[i].item()
        reference = torch.zeros(V)
        reference[kept] = probs[kept] / probs[kept].sum()
        torch.testing.assert_close(row, reference)
    # the tokens really are draws from q: empirical frequencies of block 0, slot 0
    tokens = sel.tokens.view(n // 2, 2, 3)[:, 0, 0]
    freq = torch.bincount(tokens, minlength=V).float() / tokens.numel()
    assert (freq - q[0, 0, 0]).abs().max() < 0.05
    assert (q.view(n, 3, V).gather(-1, sel.tokens.unsqueeze(-1)) > 0).all()  # never outside the support


# ---------------------------------------------------------------------------- LiLiCorr head


def _head(top_k: int = 4, **kwargs) -> LiLiCorrHead:
    torch.manual_seed(0)
    cfg = dict(top_k=top_k, hidden_size=16, num_layers=2, num_heads=4, mlp_ratio=2.0, factor_dim=8, block_size=9)
    cfg.update(kwargs)
    return _randomize(LiLiCorrHead(**cfg).build(H, V)).eval()


def _randomize(head: LiLiCorrHead, seed: int = 0) -> LiLiCorrHead:
    """Random values in every parameter, as after training (the init zeroes biases and embeddings)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if name.endswith("norm.weight")
                    else 0.3 * torch.randn(p.shape, generator=g))
    return head


def _inputs(m: int = 5, s: int = 4, seed: int = 1, requires_grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    slot_hidden = torch.randn(m, s, H, generator=g).requires_grad_(requires_grad)
    slot_logits = (3 * torch.randn(m, s, V, generator=g)).requires_grad_(requires_grad)
    anchor = torch.randn(m, H, generator=g)
    return slot_hidden, slot_logits, anchor, torch.ones(m, dtype=torch.bool)


@pytest.fixture
def embedding() -> nn.Embedding:
    torch.manual_seed(3)
    return nn.Embedding(V, H)  # trainable on purpose: the head must still not send it gradient


def test_lattice_shapes_candidates_and_logprobs(embedding):
    head = _head(top_k=4)
    sh, sl, a, valid = _inputs()
    lat = head.score_lattice(sh, sl, a, valid, embedding)
    assert isinstance(lat, Lattice)
    assert lat.candidates.shape == (5, 4, 4) and lat.candidates.dtype == torch.long
    assert lat.start.shape == (5, 4) and lat.pair.shape == (5, 3, 4, 4)
    assert lat.candidate_logprobs.shape == (5, 4, 4)
    # rank-ordered top-K of the drafter logits, rank 0 = top-1
    assert torch.equal(lat.candidates[..., 0], sl.argmax(-1))
    assert torch.equal(lat.candidates, sl.topk(4, dim=-1).indices)
    expected_lp = sl.log_softmax(-1).gather(-1, lat.candidates)
    torch.testing.assert_close(lat.candidate_logprobs, expected_lp)
    assert (lat.candidate_logprobs[..., :-1] >= lat.candidate_logprobs[..., 1:]).all()


def test_scores_are_bounded_by_sigma(embedding):
    head = _head(logit_scale=3.0)
    sh, sl, a, valid = _inputs(m=16, s=6, seed=5)
    with torch.no_grad():
        lat = head.score_lattice(100 * sh, 100 * sl, 100 * a, valid, embedding)
    assert lat.start.abs().max() <= 3.0 + 1e-5 and lat.pair.abs().max() <= 3.0 + 1e-5
    assert lat.pair.abs().max() > 0.1  # not trivially zero
    # σ is a fixed constant, not a parameter
    assert all(p.numel() != 1 for p in head.parameters()) and head.scale == head.logit_scale == 3.0


def test_scores_stay_fp32_and_bounded_under_bf16_autocast(embedding):
    head = _head(logit_scale=8.0)
    sh, sl, a, valid = _inputs(m=8, s=5, seed=4)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        lat = head.score_lattice(sh.bfloat16(), sl.bfloat16(), a.bfloat16(), valid, embedding)
    assert lat.start.dtype == lat.pair.dtype == lat.candidate_logprobs.dtype == torch.float32
    assert lat.start.abs().max() <= 8.0 + 1e-5 and lat.pair.abs().max() <= 8.0 + 1e-5


def test_single_slot_block_has_empty_pair(embedding):
    head = _head()
    sh, sl, a, valid = _inputs(s=1)
    sel = _select(head, sh, sl, a, embedding)
    assert sel.lattice.pair.shape == (5, 0, 4, 4) and sel.tokens.shape == (5, 1)


@pytest.mark.parametrize("loss", [OraclePrefixCE(weight=1.0), DistractorPenalty(weight=1.0)])
def test_lattice_losses_train_drafter_and_head_but_not_the_embedding(embedding, loss):
    head = _head().train()
    sh, sl, a, valid = _inputs(requires_grad=True)
    lat = head.score_lattice(sh, sl, a, valid, embedding)
    labels = lat.candidates[..., 2].detach()  # rank 2 of every slot: a full oracle prefix
    table = torch.randn(V)
    inputs = LossInputs(sl, labels, torch.ones_like(labels, dtype=torch.bool), lat, lambda ids: table[ids])
    loss(inputs).loss.backward()
    assert sh.grad is not None and sh.grad.abs().sum() > 0
    assert sl.grad is not None and sl.grad.abs().sum() > 0  # joint training via confidence features
    assert embedding.weight.grad is None  # frozen target embedding is detached
    trained = [p for p in head.parameters() if p.grad is not None and p.grad.abs().sum() > 0]
    assert len(trained) > 10


def test_invalid_anchor_is_ignored(embedding):
    """As the reference: the projected anchor is zeroed where invalid (context_proj has a bias)."""
    head = _head()
    sh, sl, a, _ = _inputs()
    valid = torch.tensor([False, True, False, True, True])
    with torch.no_grad():
        lat1 = head.score_lattice(sh, sl, a, valid, embedding)
        lat2 = head.score_lattice(sh, sl, torch.randn_like(a), valid, embedding)
    invalid = ~valid
    torch.testing.assert_close(lat1.start[invalid], lat2.start[invalid])  # anchor ignored where invalid
    torch.testing.assert_close(lat1.pair[invalid], lat2.pair[invalid])
    assert not torch.allclose(lat1.pair[valid], lat2.pair[valid])  # a valid anchor conditions pairs
    assert not torch.allclose(lat1.start[valid], lat2.start[valid])
    # select() reads the drafter's anchor validity (the anchor feature itself is then ignored)
    with torch.no_grad():
        sel = _select(head, sh, sl, torch.randn_like(a), embedding, valid=valid)
    torch.testing.assert_close(sel.lattice.start[invalid], lat1.start[invalid])
    # A fresh head (zero biases) scores no start preference without an anchor: slot 1 is the top-1.
    fresh = LiLiCorrHead(top_k=4, hidden_size=16, num_layers=1, num_heads=4, factor_dim=8).build(H, V, block_size=9)
    with torch.no_grad():
        lat = fresh.score_lattice(sh, sl, a, valid, embedding)
    assert lat.start[invalid].abs().max() == 0


@pytest.mark.parametrize("decode", ["greedy", "viterbi", "top1_start"])
def test_training_and_decoding_walk_the_same_path(embedding, decode):
    """The tokens the training call reports for the diagnostics are the tokens decoding drafts."""
    sh, sl, a, valid = _inputs(m=8, s=5, seed=9)
    head = _head(decode=decode)
    with torch.no_grad():
        sel = _select(head, sh, sl, a, embedding, valid=valid)
        out = head(_draft(sh, sl, a, valid), TeacherForcing(torch.zeros(8, dtype=torch.long), sel.tokens, embedding))
    assert isinstance(out, HeadOutput) and out.corrected_logits is None
    assert torch.equal(out.selected, sel.tokens)
    torch.testing.assert_close(out.lattice.pair, sel.lattice.pair)
    assert torch.equal(sel.tokens, sel.lattice.candidates.gather(-1, sel.lattice_index[..., None]).squeeze(-1))
    best = path_score(sel.lattice.start, sel.lattice.pair, viterbi(sel.lattice.start, sel.lattice.pair))
    score = path_score(sel.lattice.start, sel.lattice.pair, sel.lattice_index)
    if decode == "viterbi":
        torch.testing.assert_close(score, best)
    elif decode == "top1_start":
        assert (sel.lattice_index[:, 0] == 0).all()  # the drafter's top-1: rank 0 of the rank-ordered lattice
        assert torch.equal(sel.tokens[:, 0], sl.argmax(-1)[:, 0])
    else:
        assert (score <= best + 1e-5).all()
        first = sel.lattice.start.argmax(-1)  # greedy keeps the best first slot, whatever the tail
        assert torch.equal(sel.lattice_index[:, 0], first)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _reference_scores(head: LiLiCorrHead, slot_hidden, slot_logits, anchor, valid, embedding):
    """DESIGN §4.2 written out by hand from the head's parameters (by their served names), block by block.

    Shares no code with the head: node vector = token_proj(E[c]) + pass_hidden_proj(h_s) +
    feature MLP (LayerNorm(5) -> Linear -> SiLU -> Linear) of the five confidence features + slot and
    rank embeddings; pre-RMSNorm transformer layers with per-head softmax(QKᵀ/√d + b_h[s_i - s_j] +
    same_slot_h·[s_i = s_j]) attention over all S·K nodes; output RMSNorm; anchor a = RMSNorm(valid ·
    context_proj(anchor)); z = SiLU(W [h, a, h ⊙ a] + b); start_j = σ·cos(W_anchor a, W_in z_{1,j}),
    pair_{s,i,j} = σ·cos(W_out z_{s,i}, W_in z_{s+1,j}).
    """
    w = {k: v.double() for k, v in head.state_dict().items()}
    eps, sigma, heads, k = head.rms_norm_eps, head.logit_scale, head.num_heads, head.top_k
    m, s, _ = slot_hidden.shape
    lin = lambda x, name: x @ w[f"{name}.weight"].T + w[f"{name}.bias"]  # noqa: E731
    starts, pairs = [], []
    for b in range(m):
        logp = slot_logits[b].double().log_softmax(-1)  # [S, V]
        cand = slot_logits[b].topk(k, dim=-1).indices  # [S, K]
        nodes, slot_of = [], []
        for t in range(s):
            lp = logp[t, cand[t]]  # [K]
            for r in range(k):
                feats = torch.tensor([lp[r], lp[r].exp(), lp[r] - lp[0], r / (k - 1), float(r == 0)],
                                     dtype=torch.float64)
                feats = torch.nn.functional.layer_norm(feats, (5,), w["feature_norm.weight"], w["feature_norm.bias"])
                f = lin(torch.nn.functional.silu(lin(feats, "feature_mlp.up_proj")), "feature_mlp.down_proj")
                e = embedding.weight[cand[t, r]].detach().double()
                e = lin(e, "token_proj") if "token_proj.weight" in w else e
                node = (e + lin(slot_hidden[b, t].double(), "pass_hidden_proj") + f
                        + w["slot_embedding"][0, 0, t, 0] + w["rank_embedding"][0, 0, 0, r])
                nodes.append(node)
                slot_of.append(t)
        x = torch.stack(nodes)  # [N, D]
        n, d = x.shape
        bias = torch.zeros(heads, n, n, dtype=torch.float64)
        for i in range(n):
            for j in range(n):
                off = slot_of[i] - slot_of[j]
                bias[:, i, j] = w["relative_slot_bias"][:, off + head.block_size - 1] + (
                    w["same_slot_bias"] if off == 0 else 0.0)
        for layer in range(head.num_layers):
            p = f"layers.{layer}."
            y = _rms(x, w[p + "attn_norm.weight"], eps)
            q, kk, v = (y @ w[p + "attn.in_proj_weight"].T + w[p + "attn.in_proj_bias"]).chunk(3, dim=-1)
            dh = d // heads
            out = []
            for h in range(heads):
                qs, ks, vs = (t[:, h * dh:(h + 1) * dh] for t in (q, kk, v))
                att = (qs @ ks.T / math.sqrt(dh) + bias[h]).softmax(-1)
                out.append(att @ vs)
            x = x + lin(torch.cat(out, dim=-1), p + "attn.out_proj")
            y = _rms(x, w[p + "mlp_norm.weight"], eps)
            x = x + lin(torch.nn.functional.silu(lin(y, p + "mlp.up_proj")), p + "mlp.down_proj")
        x = _rms(x, w["output_norm.weight"], eps)
        a = lin(anchor[b].double(), "context_proj") * float(valid[b])
        a = _rms(a, w["anchor_norm.weight"], eps)
        z = torch.nn.functional.silu(lin(torch.cat([x, a.expand_as(x), x * a], dim=-1), "factor_input_proj"))
        unit = lambda t: t / t.norm(dim=-1, keepdim=True).clamp_min(head.vector_eps)  # noqa: E731
        o, i_, u = unit(lin(z, "out_head")), unit(lin(z, "in_head")), unit(lin(a, "anchor_out_head"))
        o, i_ = o.view(s, k, -1), i_.view(s, k, -1)
        starts.append(sigma * (i_[0] @ u))
        pairs.append(torch.stack([sigma * o[t] @ i_[t + 1].T for t in range(s - 1)]) if s > 1
                     else torch.zeros(0, k, k, dtype=torch.float64))
    return torch.stack(starts), torch.stack(pairs)


def test_factor_and_start_scores_equal_a_hand_written_reference(embedding):
    """Every score of the lattice against DESIGN §4.2 written out by hand, on random weights (not just bounds)."""
    for kwargs in ({}, {"hidden_size": H, "num_layers": 1, "top_k": 3}):  # with and without token_proj
        head = _head(**kwargs).double()
        sh, sl, a, _ = _inputs(m=4, s=4, seed=21)
        valid = torch.tensor([True, False, True, True])
        with torch.no_grad():
            lat = head.score_lattice(sh.double(), sl.double(), a.double(), valid, embedding.double())
            start, pair = _reference_scores(head, sh, sl, a, valid, embedding.double())
        torch.testing.assert_close(lat.start, start.to(lat.start.dtype), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lat.pair, pair.to(lat.pair.dtype), atol=1e-5, rtol=1e-5)
        assert start.abs().max() > 0.5 and pair.abs().max() > 0.5  # real scores, not a collapsed lattice
    # select(): the greedy rule of DESIGN §4.2 step 7 applied by hand to the reference scores.
    head = _head()
    sh, sl, a, _ = _inputs(m=6, s=5, seed=22)
    with torch.no_grad():
        sel = _select(head, sh, sl, a, embedding)
        start, pair = _reference_scores(head.double(), sh, sl, a, torch.ones(6, dtype=torch.bool), embedding.double())
    cand = sl.topk(head.top_k, dim=-1).indices
    for b in range(6):
        j = int(start[b].argmax())
        expected = [int(cand[b, 0, j])]
        for t in range(4):
            j = int(pair[b, t, j].argmax())
            expected.append(int(cand[b, t + 1, j]))
        assert sel.tokens[b].tolist() == expected


def test_viterbi_option_decodes_the_best_path(embedding):
    sh, sl, a, _ = _inputs(m=8, s=4, seed=9)
    with torch.no_grad():
        sel = _select(_head(decode="viterbi"), sh, sl, a, embedding)
    lat = sel.lattice
    for b in range(8):
        paths = itertools.product(range(lat.top_k), repeat=4)
        best = max(paths, key=lambda p: _manual_score(lat.start[b], lat.pair[b], p))
        assert tuple(sel.lattice_index[b].tolist()) == best
    assert torch.equal(sel.tokens, lat.candidates.gather(-1, sel.lattice_index[..., None]).squeeze(-1))


def test_serving_with_smaller_top_k(embedding):
    head = _head(top_k=4)
    sh, sl, a, valid = _inputs()
    with torch.no_grad():
        full = head.score_lattice(sh, sl, a, valid, embedding)
        small = head.score_lattice(sh, sl, a, valid, embedding, top_k=2)
        one = _select(head, sh, sl, a, embedding, top_k=1)
    assert small.candidates.shape == (5, 4, 2) and small.pair.shape == (5, 3, 2, 2)
    assert torch.equal(small.candidates, full.candidates[..., :2])
    assert torch.equal(one.tokens, sl.argmax(-1))  # a 1-wide lattice is the top-1 selector
    with pytest.raises(ValueError, match="can serve any k <= 4"):
        head.score_lattice(sh, sl, a, valid, embedding, top_k=5)
    # serve_top_k: the width select() decodes with by default (training keeps top_k); an explicit top_k wins.
    head.serve_top_k = 2
    with torch.no_grad():
        served = _select(head, sh, sl, a, embedding)
        explicit = _select(head, sh, sl, a, embedding, top_k=4)
    assert served.lattice.candidates.shape == (5, 4, 2) and torch.equal(served.lattice.pair, small.pair)
    assert explicit.lattice.candidates.shape == (5, 4, 4)
    with pytest.raises(ValueError, match="serve_top_k 5 is outside 1..4"):
        LiLiCorrHead(top_k=4, hidden_size=16, num_heads=4, factor_dim=8, serve_top_k=5)


def test_blocks_are_independent_and_batch_order_does_not_matter(embedding):
    head = _head()
    sh, sl, a, valid = _inputs(m=6, s=4, seed=11)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    with torch.no_grad():
        lat = head.score_lattice(sh, sl, a, valid, embedding)
        lat_p = head.score_lattice(sh[perm], sl[perm], a[perm], valid[perm], embedding)
        sel, sel_p = _select(head, sh, sl, a, embedding), _select(head, sh[perm], sl[perm], a[perm], embedding)
        sh2, sl2 = sh.clone(), sl.clone()
        sh2[0], sl2[0] = torch.randn_like(sh2[0]), torch.randn_like(sl2[0])
        lat_changed = head.score_lattice(sh2, sl2, a, valid, embedding)
    assert torch.equal(lat_p.candidates, lat.candidates[perm])
    torch.testing.assert_close(lat_p.start, lat.start[perm], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lat_p.pair, lat.pair[perm], atol=1e-5, rtol=1e-5)
    assert torch.equal(sel_p.tokens, sel.tokens[perm])
    torch.testing.assert_close(lat_changed.pair[1:], lat.pair[1:], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(lat_changed.pair[0], lat.pair[0])


def test_nodes_see_the_other_slots(embedding):
    """The lattice transformer is bidirectional: a later slot changes earlier slots' factors."""
    head = _head()
    sh, sl, a, valid = _inputs()
    sh2 = sh.clone()
    sh2[:, -1] = torch.randn_like(sh2[:, -1])
    with torch.no_grad():
        lat, lat2 = (head.score_lattice(x, sl, a, valid, embedding) for x in (sh, sh2))
    assert not torch.allclose(lat.start, lat2.start)


def test_residual_dropout_acts_only_in_training_and_costs_nothing_at_zero(embedding):
    """With dropout the lattice transformer's residual branches are masked in training and not in eval; at the
    recipe's p = 0 the head holds no dropout module at all (one op less per residual in every decoding round)."""
    sh, sl, a, valid = _inputs()
    dropped = _head(dropout=0.5)
    assert sum(isinstance(m, nn.Dropout) for m in dropped.modules()) == 2
    with torch.no_grad():
        eval_scores = [dropped.score_lattice(sh, sl, a, valid, embedding).pair for _ in range(2)]
        dropped.train()
        torch.manual_seed(1)
        train_scores = [dropped.score_lattice(sh, sl, a, valid, embedding).pair for _ in range(2)]
    assert torch.equal(*eval_scores) and not torch.allclose(*train_scores)
    plain = _head()
    assert not any(isinstance(m, nn.Dropout) for m in plain.modules())
    with torch.no_grad():
        before = plain.score_lattice(sh, sl, a, valid, embedding).pair
        after = plain.train().score_lattice(sh, sl, a, valid, embedding).pair
    assert torch.equal(before, after)


def test_build_validates_sizes_and_is_idempotent():
    head = LiLiCorrHead(top_k=8, hidden_size=16, num_heads=4, factor_dim=8)
    with pytest.raises(ValueError, match=r"top_k 8 is larger than the target vocabulary \(5 rows\)"):
        head.build(H, 5, block_size=5)
    with pytest.raises(ValueError, match="needs the drafter's block size"):
        head.build(H, V)
    head.build(H, V, block_size=5)
    params = [id(p) for p in head.parameters()]
    assert head.build(H, V) is head and [id(p) for p in head.parameters()] == params
    assert head.build(H, V, block_size=5) is head
    with pytest.raises(ValueError, match="differs from the drafter's block size 6"):
        head.build(H, V, block_size=6)
    with pytest.raises(ValueError, match="create a new head"):
        head.build(H + 1, V)
    # The tables follow the drafter's block: B - 1 slots, 2B - 1 relative offsets.
    assert head.slot_embedding.shape == (1, 1, 4, 1, 16) and head.relative_slot_bias.shape == (4, 9)
    assert head.rms_norm_eps == 1e-6 and head.output_norm.variance_epsilon == 1e-6
    # token_proj only when the head is narrower or wider than the drafter
    same = LiLiCorrHead(top_k=2, hidden_size=H, num_heads=4, factor_dim=8).build(H, V, block_size=3, rms_norm_eps=1e-5)
    assert isinstance(same.token_proj, nn.Identity) and same.anchor_norm.variance_epsilon == 1e-5


def test_clear_errors_for_bad_configuration(embedding):
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        LiLiCorrHead(hidden_size=10, num_heads=4)
    with pytest.raises(ValueError, match="decode must be one of"):
        LiLiCorrHead(decode="beam")
    sh, sl, a, valid = _inputs()
    with pytest.raises(ValueError, match="vector_eps must be in"):
        LiLiCorrHead(vector_eps=0.0)
    with pytest.raises(RuntimeError, match="call head.build"):
        LiLiCorrHead(hidden_size=16, num_heads=4).score_lattice(sh, sl, a, valid, embedding)
    with pytest.raises(ValueError, match="at most 3 slots"):
        _head(block_size=4).score_lattice(sh, sl, a, valid, embedding)


def test_confidence_features_are_the_references_five():
    """log-prob, prob, gap to the slot's best, rank / (k - 1), is-top-1 (the reference's k - 1 scaling)."""
    head = _head(top_k=4)
    lp = torch.tensor([[-0.5, -1.0, -2.0, -4.0]])
    feats = head.confidence_features(lp)
    e = math.exp
    expected = torch.tensor([[[-0.5, e(-0.5), 0.0, 0.0, 1.0],
                              [-1.0, e(-1.0), -0.5, 1 / 3, 0.0],
                              [-2.0, e(-2.0), -1.5, 2 / 3, 0.0],
                              [-4.0, e(-4.0), -3.5, 1.0, 0.0]]])
    torch.testing.assert_close(feats, expected)
    assert head.confidence_features(lp[:, :1])[..., 3].item() == 0.0  # k = 1: no range to normalise over


def test_same_slot_bias_covers_the_node_itself():
    head = _head()
    with torch.no_grad():
        head.relative_slot_bias.zero_()
        head.same_slot_bias.fill_(1.0)
        head.relative_slot_bias[:, head.block_size - 1 + 1] = 5.0  # offset s_i - s_j = +1
    bias = head.attention_bias(num_slots=3, k=2)  # nodes (slot, rank): 00 01 10 11 20 21
    slot = torch.tensor([0, 0, 1, 1, 2, 2])
    expected = (slot[:, None] == slot[None, :]).float() + 5.0 * (slot[:, None] - slot[None, :] == 1).float()
    assert bias.shape == (head.num_heads, 6, 6)
    torch.testing.assert_close(bias, expected.expand(head.num_heads, 6, 6))
    assert (bias.diagonal(dim1=-2, dim2=-1) == 1).all()  # the node itself gets the same-slot bias


@pytest.mark.parametrize("width", [16, 24])  # head widths 4 and 6: a scale of 1/2, and one that is no power of two
def test_training_attention_equals_sdpa_in_value_and_gradient(width):
    """Training writes attention out (SDPA's math fallback is slow with a bias that takes gradient); decoding
    keeps SDPA. Both must be the same function, gradients of q, k, v and the learned bias included."""
    from lilicorr_pl.heads.lilicorr import _LatticeAttention

    torch.manual_seed(0)
    attn = _LatticeAttention(width=width, num_heads=4, dropout=0.0)
    x = torch.randn(3, 10, width, requires_grad=True)
    bias = torch.randn(4, 10, 10, requires_grad=True)
    out = attn(x, bias.unsqueeze(0))  # grad enabled: the written-out path
    grads = torch.autograd.grad(out.square().sum(), (x, bias, attn.in_proj_weight))
    # SDPA, with gradient through the same inputs: the reference the written-out path must equal.
    qkv = torch.nn.functional.linear(x, attn.in_proj_weight, attn.in_proj_bias)
    q, k, v = (t.view(3, 10, 4, width // 4).transpose(1, 2) for t in qkv.chunk(3, -1))
    ref = attn.out_proj(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias.unsqueeze(0))
                        .transpose(1, 2).reshape(3, 10, width))
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, torch.autograd.grad(ref.square().sum(), (x, bias, attn.in_proj_weight))):
        torch.testing.assert_close(g, r)
    with torch.no_grad():  # decoding: SDPA itself
        torch.testing.assert_close(attn(x, bias.unsqueeze(0)), ref.detach())


def test_decoding_reuses_the_attention_bias_until_a_parameter_changes(embedding):
    head = _head()
    with torch.no_grad():
        first = head._bias_for(3, 2)
        assert head._bias_for(3, 2) is first  # decoding: built once per shape
        assert head._bias_for(2, 2).shape[-1] == 4  # another shape: built for it
        head.same_slot_bias.add_(1.0)  # an in-place update (an optimizer step) bumps the version
        torch.testing.assert_close(head._bias_for(3, 2), head.attention_bias(3, 2))
        assert not torch.equal(head._bias_for(3, 2), first)
        state = {k: v.clone() for k, v in head.state_dict().items()}
        state["relative_slot_bias"] += 2.0
        head.load_state_dict(state)
        torch.testing.assert_close(head._bias_for(3, 2), head.attention_bias(3, 2))
    # With gradient recorded the bias is built live, so training sends gradient into its parameters.
    head.train()
    slot_hidden, slot_logits, anchor, valid = _inputs(m=2, s=3)
    lattice = head.score_lattice(slot_hidden, slot_logits, anchor, valid, embedding)
    (lattice.start.sum() + lattice.pair.sum()).backward()
    assert head.relative_slot_bias.grad is not None and head.relative_slot_bias.grad.abs().sum() > 0


@pytest.mark.parametrize("chunked", [False, True])
def test_candidate_log_probs_matches_log_softmax_and_its_gradient(chunked, monkeypatch):
    from lilicorr_pl.heads import candidate_log_probs, lattice as lattice_module

    if chunked:  # one row per chunk, as for a huge vocabulary
        monkeypatch.setattr(lattice_module, "_row_chunks", lambda t: [slice(i, i + 1) for i in range(len(t))])
    x = torch.randn(3, 4, 7, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[[1, 1, 3]]]).expand(3, 4, 3)  # repeated ids accumulate gradient
    torch.testing.assert_close(candidate_log_probs(x, ids), x.log_softmax(-1).gather(-1, ids))
    assert torch.autograd.gradcheck(lambda t: candidate_log_probs(t, ids), (x,))
    half = torch.randn(5, 2, 9).to(torch.bfloat16)
    out = candidate_log_probs(half, half.topk(2, dim=-1).indices)
    assert out.dtype == torch.float32  # at least fp32 even for bf16 logits
    torch.testing.assert_close(out, half.float().log_softmax(-1).gather(-1, half.topk(2, dim=-1).indices))
    # Without gradient (a decoding round) a small block takes one fused log_softmax; a large one still streams.
    with torch.no_grad():
        direct = candidate_log_probs(x, ids)
        monkeypatch.setattr(lattice_module, "_DIRECT_MAX_ELEMENTS", 0)
        streamed = candidate_log_probs(x, ids)
    torch.testing.assert_close(direct, streamed, rtol=0, atol=1e-12)
    assert direct.dtype == streamed.dtype == torch.float64


def test_rms_norm_is_qwen3s_bit_for_bit():
    """The fused RMSNorm of the drafter and the head: Qwen3RMSNorm's parameter and output, bit for bit, with gradient."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from lilicorr_pl.models.norm import RMSNorm

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        ours, ref = RMSNorm(48, eps=1e-6).to(dtype), Qwen3RMSNorm(48, eps=1e-6).to(dtype)
        with torch.no_grad():
            ours.weight.copy_(torch.randn(48))
        ref.load_state_dict(ours.state_dict())
        x = (torch.randn(5, 7, 48) * torch.rand(5, 7, 1) * 10).to(dtype).requires_grad_(True)
        out, expected = ours(x), ref(x)
        assert torch.equal(out, expected) and out.dtype == expected.dtype
        g_ours = torch.autograd.grad(out.float().square().sum(), (x, ours.weight))
        g_ref = torch.autograd.grad(expected.float().square().sum(), (x, ref.weight))
        for a, b in zip(g_ours, g_ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- sampled drafts (T > 0)


def test_sample_walk_draws_from_the_row_leaving_the_drawn_candidate():
    """SGLang's LiLiCorr proposal: softmax(ψ/T), ψ = start row, then the pair row of the *drawn* predecessor."""
    start, pair = _random_scores(64, 4, 5, seed=3)
    start, pair = 3 * start, 3 * pair
    path, q = sample_walk(start, pair, DraftSampling(0.8, generator=torch.Generator().manual_seed(0)))
    assert path.shape == (64, 4) and q.shape == (64, 4, 5)
    torch.testing.assert_close(q[:, 0], torch.softmax(start / 0.8, -1))
    for s in range(1, 4):
        rows = pair[torch.arange(64), s - 1, path[:, s - 1]]  # leaving the candidate drawn at slot s-1
        torch.testing.assert_close(q[:, s], torch.softmax(rows / 0.8, -1))
    assert (path != greedy_walk(start, pair)).any()  # it samples ...
    cold, _ = sample_walk(start, pair, DraftSampling(1e-4, generator=torch.Generator().manual_seed(0)))
    assert torch.equal(cold, greedy_walk(start, pair))  # ... and becomes the greedy walk as T -> 0
    # The request's top-p does not truncate the candidates (SGLang's lilicorr_sample_path: temperature alone); it
    # truncated them, so at top_p < 1 the proposal differed from the engine's.
    _, nucleus = sample_walk(start, pair, DraftSampling(0.8, top_p=0.3, generator=torch.Generator().manual_seed(0)))
    torch.testing.assert_close(nucleus[:, 0], torch.softmax(start / 0.8, -1))
    assert (nucleus > 0).all()


def test_lilicorr_sampled_selection_puts_q_on_the_candidates(embedding):
    head = _head(top_k=4)
    sh, sl, a, valid = _inputs(m=6, s=4, seed=2)
    sampling = DraftSampling(1.0, top_p=0.8, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        sel = _select(head, sh, sl, a, embedding, valid=valid, sampling=sampling)
    lat = sel.lattice
    assert sel.q.shape == (6, 4, V)
    on_candidates = sel.q.gather(-1, lat.candidates)  # [b, S, K]
    torch.testing.assert_close(on_candidates.sum(-1), torch.ones(6, 4))  # no mass off the K candidates
    assert torch.equal(sel.tokens, lat.candidates.gather(-1, sel.lattice_index[..., None]).squeeze(-1))
    assert (sel.q.gather(-1, sel.tokens[..., None]) > 0).all()
    # slot 1's proposal is softmax(start / T) over the candidates: no drafter log-prob prior, and the request's
    # top-p (0.8 here) not applied to them, as SGLang's lilicorr_sample_path draws (it was the nucleus)
    torch.testing.assert_close(on_candidates[:, 0], torch.softmax(lat.start, -1))


def test_draft_sampling_rejects_bad_settings():
    with pytest.raises(ValueError, match="temperature > 0"):
        DraftSampling(0.0)
    with pytest.raises(ValueError, match="top_p"):
        DraftSampling(1.0, top_p=0.0)


# ---------------------------------------------------------------------------- one declared interface


def test_registered_selectors_declare_what_their_training_call_returns(embedding):
    """``uses_lattice`` / ``uses_corrector`` are declared on the class and match what forward() returns."""
    m, s = 5, 4
    sh, sl, a, valid = _inputs(m=m, s=s, seed=4)
    context = TeacherForcing(torch.zeros(m, dtype=torch.long), sl.argmax(-1), embedding)
    built = {
        "top1": Top1Selector(),
        "lilicorr": _head(),
        "domino": SELECTORS["domino"](gru_hidden=4, rank=3).build(H, V),
        "dspark": SELECTORS["dspark"](rank=3).build(H, V),
    }
    assert set(built) == set(SELECTORS)
    for name, head in built.items():
        assert type(head).name == name and selector_class(name) is type(head)
        for flag in ("uses_lattice", "uses_corrector", "parameter_free"):
            assert isinstance(getattr(type(head), flag), bool) and hasattr(Selector, flag)
        out = head(_draft(sh, sl, a, valid), context)
        assert isinstance(out, HeadOutput) and out.selected.shape == (m, s) and not out.selected.requires_grad
        assert (out.lattice is not None) == head.uses_lattice, name
        assert (out.corrected_logits is not None) == head.uses_corrector, name
        assert head.parameter_free == (not list(head.parameters())), name


def test_selectors_are_chosen_by_registry_name_or_class_path():
    assert selector_class("lilicorr") is LiLiCorrHead
    assert selector_class("lilicorr_pl.heads.LiLiCorrHead") is LiLiCorrHead
    with pytest.raises(ValueError, match="unknown selector 'lili'"):
        selector_class("lili")  # no substring matching
    with pytest.raises(ValueError, match="does not import"):
        selector_class("lilicorr_pl.heads.NoSuchHead")
    with pytest.raises(ValueError, match="not a Selector subclass"):
        selector_class("torch.nn.Linear")
    from lilicorr_pl.bench import SELECTOR_NAMES

    assert SELECTOR_NAMES == tuple(SELECTORS)
