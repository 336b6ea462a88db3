"""DFlash drafter: the exact formulas of DESIGN §3, block isolation, train == inference, masks."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from lilicorr_pl.models.dflash import DFlashDrafter, block_labels, sample_anchors


def make_drafter(target, block_size=4, layers=2, seed=0):
    torch.manual_seed(seed)
    drafter = DFlashDrafter(num_layers=layers, block_size=block_size).build(target.config, target.layer_ids)
    with torch.no_grad():  # non-trivial norms so a skipped/misplaced norm changes the result
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.uniform_(0.5, 1.5)
    return drafter


def run(drafter, target, x, anchors, **kw):
    feats = target(x).features
    return drafter(feats, x, anchors, target.embed, target.lm_head, **kw)


# ---------------------------------------------------------------- an independent reference
def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta, d):
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos.float()[:, None] * inv[None]  # [t, d/2]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_block(drafter, target, feats, ids, p):
    """DESIGN §3.1 written out by hand for one block anchored at p (single sequence)."""
    cfg = target.config
    eps, theta = cfg.rms_norm_eps, cfg.rope_parameters["rope_theta"]
    ctx = _rms(feats[0, :p] @ drafter.fc.weight.T, drafter.hidden_norm.weight, eps)  # [p, H]
    block_ids = torch.tensor([ids[0, p].item()] + [drafter.mask_token_id] * (drafter.block_size - 1))
    h = target.embed_tokens.weight[block_ids]
    pos_c, pos_b = torch.arange(p), p + torch.arange(drafter.block_size)
    for layer in drafter.layers:
        a = layer.self_attn
        nh, nkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        x = _rms(h, layer.input_layernorm.weight, eps)
        q = (x @ a.q_proj.weight.T).view(-1, nh, d)
        q = _rope(_rms(q, a.q_norm.weight, eps).transpose(0, 1), pos_b, theta, d)
        kc = _rms((ctx @ a.k_proj.weight.T).view(-1, nkv, d), a.k_norm.weight, eps).transpose(0, 1)
        kb = _rms((x @ a.k_proj.weight.T).view(-1, nkv, d), a.k_norm.weight, eps).transpose(0, 1)
        k = torch.cat([_rope(kc, pos_c, theta, d), _rope(kb, pos_b, theta, d)], 1)
        v = torch.cat([(ctx @ a.v_proj.weight.T), (x @ a.v_proj.weight.T)], 0).view(-1, nkv, d).transpose(0, 1)
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(d), -1) @ v  # [nh, B, d]
        h = h + att.transpose(0, 1).reshape(len(block_ids), -1) @ a.o_proj.weight.T
        m = layer.mlp
        y = _rms(h, layer.post_attention_layernorm.weight, eps)
        h = h + (F.silu(y @ m.gate_proj.weight.T) * (y @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    out = _rms(h, drafter.norm.weight, eps)[1:]
    return out @ target.lm_head_module.weight.T


def test_forward_matches_hand_written_reference(tiny_target):
    drafter = make_drafter(tiny_target)
    x = torch.randint(0, 90, (1, 14))
    anchors = torch.tensor([[1, 6, 11]])
    out = run(drafter, tiny_target, x, anchors)
    feats = tiny_target(x).features
    for n, p in enumerate(anchors[0].tolist()):
        ref = reference_block(drafter, tiny_target, feats, x, p)
        torch.testing.assert_close(out.slot_logits[0, n], ref, atol=1e-4, rtol=1e-4)


def test_uses_target_lm_head_not_embedding_when_untied(tiny_target):
    drafter = make_drafter(tiny_target)
    x = torch.randint(0, 90, (1, 10))
    out = run(drafter, tiny_target, x, torch.tensor([[4]]))
    expect = out.slot_hidden @ tiny_target.lm_head_module.weight.T
    torch.testing.assert_close(out.slot_logits, expect)
    if not tiny_target.config.tie_word_embeddings:
        assert not torch.allclose(out.slot_logits, out.slot_hidden @ tiny_target.embed_tokens.weight.T)
    names = [n for n, _ in drafter.named_parameters()]
    assert not any("embed" in n or "lm_head" in n for n in names)


def test_block_isolation_context_strictly_before_anchor(tiny_target):
    drafter = make_drafter(tiny_target, block_size=5)
    torch.manual_seed(1)
    x = torch.randint(0, 90, (1, 20))
    anchors = torch.tensor([[8, 3, 14]])
    base = run(drafter, tiny_target, x, anchors).slot_logits[0, 0]
    for pos in (9, 12, 19):  # tokens after the anchor: the block must not see them
        y = x.clone()
        y[0, pos] = (y[0, pos] + 7) % 90
        torch.testing.assert_close(run(drafter, tiny_target, y, anchors).slot_logits[0, 0], base)
    feats = tiny_target(x).features

    def with_feature_noise(pos):
        f = feats.clone()
        f[0, pos] += torch.randn_like(f[0, pos])
        return drafter(f, x, anchors, tiny_target.embed, tiny_target.lm_head).slot_logits[0, 0]

    for pos in (8, 9, 15):  # the anchor's own target feature does not exist yet at inference
        torch.testing.assert_close(with_feature_noise(pos), base)
    for pos in (0, 5, 7):  # strictly before the anchor: the block must see it
        assert not torch.allclose(with_feature_noise(pos), base, atol=1e-6)
        y = x.clone()
        y[0, pos] = (y[0, pos] + 7) % 90
        assert not torch.allclose(run(drafter, tiny_target, y, anchors).slot_logits[0, 0], base, atol=1e-6)
    # Another block (different anchor / overlapping span) never leaks into this one.
    other = run(drafter, tiny_target, x, torch.tensor([[8, 10, 5]])).slot_logits[0, 0]
    torch.testing.assert_close(other, base)


def test_training_path_equals_inference_path_with_cache(tiny_target):
    drafter = make_drafter(tiny_target, block_size=6)
    x = torch.randint(0, 90, (2, 24))
    anchors = torch.tensor([[2, 9, 17], [5, 12, 23]])
    train = run(drafter, tiny_target, x, anchors)
    feats = tiny_target(x).features
    for b in range(2):
        for n, p in enumerate(anchors[b].tolist()):
            cache = drafter.new_cache()
            split = p // 2  # append context in two calls, as the decoding loop does
            drafter.draft(cache, feats[b : b + 1, :split], x[b : b + 1, split], tiny_target.embed, tiny_target.lm_head)
            out = drafter.draft(cache, feats[b : b + 1, split:p], x[b : b + 1, p], tiny_target.embed, tiny_target.lm_head)
            assert cache.length == p  # the block itself never stays in the cache
            torch.testing.assert_close(out.slot_logits[0], train.slot_logits[b, n], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out.anchor_feature[0], train.anchor_feature[b, n], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_flex_attention_agrees_with_dense_mask(tiny_target):
    drafter = make_drafter(tiny_target, block_size=4)
    x = torch.randint(0, 90, (2, 30))
    anchors = torch.tensor([[3, 8, 20, 27], [1, 2, 15, 16]])
    dense = run(drafter, tiny_target, x, anchors, attention="sdpa").slot_logits
    flex = run(drafter, tiny_target, x, anchors, attention="flex").slot_logits
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


def test_rope_positions_follow_the_anchor(tiny_target):
    # A block's output depends on its absolute position: the same tokens/context shifted by one
    # position (with a dummy token prepended) must give the same output only if positions shift too.
    drafter = make_drafter(tiny_target)
    x = torch.randint(0, 90, (1, 12))
    feats = tiny_target(x).features
    cache = drafter.new_cache()
    a = drafter.draft(cache, feats[:, :6], x[:, 6], tiny_target.embed, tiny_target.lm_head).slot_logits
    train = drafter(feats, x, torch.tensor([[6]]), tiny_target.embed, tiny_target.lm_head).slot_logits[:, 0]
    torch.testing.assert_close(a, train, atol=1e-5, rtol=1e-5)
    wrong = drafter(feats, x, torch.tensor([[7]]), tiny_target.embed, tiny_target.lm_head).slot_logits[:, 0]
    assert not torch.allclose(a, wrong, atol=1e-4)


def test_sample_anchors_respects_loss_mask_and_is_distinct():
    mask = torch.zeros(3, 40, dtype=torch.bool)
    mask[0, 10:30] = True
    mask[1, 35:] = True  # only 4 eligible (39 is the last position: nothing to predict)
    g = torch.Generator().manual_seed(0)
    pos, valid = sample_anchors(mask, 8, generator=g)
    assert pos.shape == (3, 8)
    assert valid[0].all() and valid[1].sum() == 4 and not valid[2].any()
    for b in range(3):
        chosen = pos[b][valid[b]]
        assert mask[b, chosen].all() and len(set(chosen.tolist())) == len(chosen)
        assert (chosen < 39).all() and (chosen >= 1).all()
        assert torch.equal(chosen, chosen.sort().values)
    pos2, _ = sample_anchors(mask, 8, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(pos, pos2)  # redrawn with the generator


def test_sample_anchors_response_start_prob():
    mask = torch.zeros(4, 60, dtype=torch.bool)
    mask[0, 20:59] = True  # one response
    mask[1, 5:15] = True  # two responses (a second turn): either start may be the one
    mask[1, 30:50] = True
    mask[2, 0:30] = True  # starts at 0, which has no context (min_position): never an anchor
    mask[3, 40:] = True
    uniform = sample_anchors(mask, 3, generator=torch.Generator().manual_seed(0))
    same = sample_anchors(mask, 3, generator=torch.Generator().manual_seed(0), response_start_prob=0.0)
    assert all(torch.equal(a, b) for a, b in zip(uniform, same))  # off draws exactly as before
    seen_second_turn = set()
    for seed in range(40):
        pos, valid = sample_anchors(mask, 3, generator=torch.Generator().manual_seed(seed), response_start_prob=1.0)
        assert valid.all()
        assert 20 in pos[0].tolist() and 40 in pos[3].tolist()
        starts = {5, 30} & set(pos[1].tolist())
        assert starts
        seen_second_turn |= starts
        assert 0 not in pos[2].tolist() and mask[2, pos[2]].all()
    assert seen_second_turn == {5, 30}
    # A probability per sequence and draw: about half of many sequences at 0.5 (uniform alone: 3 in 39).
    many = torch.zeros(2000, 60, dtype=torch.bool)
    many[:, 20:59] = True
    pos, _ = sample_anchors(many, 3, generator=torch.Generator().manual_seed(0), response_start_prob=0.5)
    rate = (pos == 20).any(1).float().mean().item()
    assert 0.5 < rate < 0.6  # 0.5 + 0.5 * 3/39 = 0.54
    with pytest.raises(ValueError, match="response_start_prob"):
        sample_anchors(mask, 3, response_start_prob=1.5)


def test_response_start_anchors_draw_the_boundary_block_in_training_only(tmp_path):
    from helpers import make_tiny_target_dir

    from lilicorr_pl.models import DFlashDrafter
    from lilicorr_pl.system import DraftSystem

    def system(p):
        return DraftSystem(target={"name_or_path": make_tiny_target_dir(tmp_path), "dtype": "float32"},
                           drafter=DFlashDrafter(num_layers=1, block_size=4), num_anchors=1, lr_scheduler=None,
                           response_start_anchors=p)

    with pytest.raises(ValueError, match="response_start_anchors is a probability"):
        system(1.5)
    s = system(1.0)
    ids = torch.arange(10, 42).repeat(8, 1)  # [8, 32]: each token names its position (id - 10)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 12:] = 1  # the response starts at position 12
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}

    def anchor_positions(training):
        s.train(training)
        step = s.compute_step(batch, generator=torch.Generator().manual_seed(3))
        return (step["labels"][..., 0] - 1 - 10).flatten()  # slot 1 is labelled by the token after the anchor

    assert (anchor_positions(True) == 12).all()  # every sequence's one anchor: the response's first token
    assert (anchor_positions(False) != 12).any()  # validation draws uniformly


def test_block_labels_are_same_position_and_masked():
    ids = torch.arange(100, 110).unsqueeze(0)  # token at position t is 100 + t
    loss = torch.ones(1, 10, dtype=torch.bool)
    loss[0, 7] = False
    labels, lmask, lpos = block_labels(ids, loss, torch.tensor([[2, 6, 8]]), torch.tensor([[True, True, False]]), 4)
    assert labels[0, 0].tolist() == [103, 104, 105]  # slot k of anchor p is token p + k
    assert lmask[0, 0].tolist() == [True, True, True]
    assert lmask[0, 1].tolist() == [False, True, True]  # position 7 is outside the loss mask
    assert lmask[0, 2].tolist() == [False, False, False]  # invalid block
    assert lpos[0, 0].tolist() == [3, 4, 5]
    labels, lmask, _ = block_labels(ids, loss, torch.tensor([[8]]), torch.tensor([[True]]), 4)
    assert lmask[0, 0].tolist() == [True, False, False]  # runs off the sequence end


def test_clear_errors_for_block_size_and_mask_token(tiny_target):
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        DFlashDrafter(block_size=1)
    with pytest.raises(ValueError, match=r"mask_token_id 151669 is outside the target vocabulary \(96 rows\)"):
        DFlashDrafter(block_size=4, mask_token_id=151669).build(tiny_target.config, tiny_target.layer_ids)
    with pytest.raises(RuntimeError, match="build"):
        DFlashDrafter(block_size=4).fuse(torch.zeros(1, 2, 3))


def test_mask_embedding_is_the_frozen_target_row(tiny_target):
    drafter = make_drafter(tiny_target)
    emb = drafter._block_embeddings(torch.tensor([5]), tiny_target.embed)
    torch.testing.assert_close(emb[0, 1:], tiny_target.embed_tokens.weight[drafter.mask_token_id].expand(3, -1))
    torch.testing.assert_close(emb[0, 0], tiny_target.embed_tokens.weight[5])
    assert drafter.mask_token_id == tiny_target.config.mask_token_id


def test_a_target_mask_token_id_of_zero_is_that_row(tiny_target):
    """Row 0 is a real MASK row: not read as missing and replaced by Qwen3's 151669 (which a target this wide would
    accept, and train on the wrong row without a word)."""
    config = copy.deepcopy(tiny_target.config)
    config.mask_token_id = 0
    config.vocab_size = 151680
    drafter = DFlashDrafter(block_size=4).build(config, tiny_target.layer_ids)
    assert drafter.mask_token_id == 0
    del config.mask_token_id  # none recorded: Qwen3's
    assert DFlashDrafter(block_size=4).build(config, tiny_target.layer_ids).mask_token_id == 151669


def test_preallocated_draft_cache_equals_drafting_from_scratch_every_round(tiny_target):
    """A real multi-round generation (rejections, crops, buffer growth past the first 64 positions):
    every round's cached draft equals a draft of the whole context from scratch and the training path."""
    from lilicorr_pl.decoding import speculative_generate
    from lilicorr_pl.heads import Top1Selector

    drafter = make_drafter(tiny_target, block_size=5)
    target = tiny_target
    seen: dict = {"features": [], "tokens": [], "rounds": 0}
    real_draft = drafter.draft

    def checked_draft(cache, new_features, anchor_ids, embed, lm_head):
        out = real_draft(cache, new_features, anchor_ids, embed, lm_head)
        seen["features"].append(new_features)
        history = torch.cat(seen["features"], dim=1)  # [1, P, n*H] every committed position so far
        p = history.shape[1]
        assert cache.length == p and cache.capacity >= p + drafter.block_size
        fresh = drafter.new_cache()
        scratch = real_draft(fresh, history, anchor_ids, embed, lm_head)
        torch.testing.assert_close(out.slot_logits, scratch.slot_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.anchor_feature, scratch.anchor_feature)
        # The training path (concatenated keys, dense mask) on the same context is the reference too.
        feats = torch.cat([history, history.new_zeros(1, 1, history.shape[-1])], dim=1)
        ids = torch.zeros(1, p + 1, dtype=torch.long)
        ids[0, p] = anchor_ids[0]
        train = drafter(feats, ids, torch.tensor([[p]]), embed, lm_head)
        torch.testing.assert_close(out.slot_logits, train.slot_logits[:, 0], atol=1e-5, rtol=1e-5)
        seen["rounds"] += 1
        return out

    drafter.draft = checked_draft
    prompt = torch.randint(2, 90, (40,)).tolist()
    out = speculative_generate(target, drafter, Top1Selector(), prompt, 48, stop_token_ids=[])
    assert seen["rounds"] == out.num_rounds > 1
    assert sum(f.shape[1] for f in seen["features"]) > 64  # the buffers had to grow at least once


def test_draft_cache_crop_keeps_context_and_drops_the_block(tiny_target):
    drafter = make_drafter(tiny_target, block_size=4)
    x = torch.randint(0, 90, (1, 20))
    feats = tiny_target(x).features
    e, h = tiny_target.embed, tiny_target.lm_head
    cache = drafter.new_cache()
    drafter.draft(cache, feats[:, :12], x[:, 12], e, h)
    assert cache.length == 12  # the block was written after the context but never committed
    cache.crop(7)  # roll back a rejected suffix, then append different context on top of it
    again = drafter.draft(cache, feats[:, 7:15], x[:, 15], e, h)
    scratch = drafter.draft(drafter.new_cache(), feats[:, :15], x[:, 15], e, h)
    torch.testing.assert_close(again.slot_logits, scratch.slot_logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(16)


# ---------------------------------------------------------------- a frozen drafter's context memo
def _padded_batch(target, seqs, width):
    """Right-padded ids and features as the data module's collate builds them (zeros past each length)."""
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = s
    feats = target(ids).features.clone()
    lengths = torch.tensor([len(s) for s in seqs])
    feats[torch.arange(width).unsqueeze(0) >= lengths.unsqueeze(1)] = 0
    return ids, feats, lengths


def test_context_memo_gives_the_forward_its_own_numbers_and_forgets_on_a_weight_change(tiny_target):
    from lilicorr_pl.models.dflash import ContextMemo

    drafter = make_drafter(tiny_target, block_size=4).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    seqs = {i: torch.randint(0, 90, (n,), generator=g) for i, n in ((10, 20), (11, 14), (12, 17), (13, 9))}
    memo = ContextMemo(max_bytes=1 << 30)

    def check(order, width, expect_hits):
        ids, feats, lengths = _padded_batch(tiny_target, [seqs[i] for i in order], width)
        anchors = torch.stack([torch.tensor([1, int(n) - 2]) for n in lengths])
        hits = memo.hits
        context = memo.context(drafter, feats, torch.tensor(order), lengths)
        assert memo.hits - hits == expect_hits
        plain = drafter(feats, ids, anchors, tiny_target.embed, tiny_target.lm_head)
        reused = drafter(feats, ids, anchors, tiny_target.embed, tiny_target.lm_head, context=context)
        for got, want in ((reused.slot_logits, plain.slot_logits), (reused.slot_hidden, plain.slot_hidden),
                          (reused.anchor_feature, plain.anchor_feature)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # Past each example's length the memo's rows are zeros, as the padded forward's are.
        pad = torch.arange(width).unsqueeze(0) >= lengths.unsqueeze(1)
        assert context.fused[pad].abs().max() == 0 and all(k.transpose(1, 2)[pad].abs().max() == 0 for k in context.keys)

    check([10, 11, 12], 20, expect_hits=0)  # first visit: computed, and kept
    assert len(memo) == 3 and memo.bytes > 0
    check([12, 13, 10], 20, expect_hits=2)  # another batch: two reused (padded to this batch), one new
    check([13, 11], 16, expect_hits=2)  # a narrower batch: rows fit its own padding
    assert memo.misses == 4 and memo.hit_rate == 4 / 8
    with torch.no_grad():
        drafter.fc.weight.mul_(1.5)  # the weights changed (e.g. a load_state_dict): nothing is stale
    check([10, 11], 20, expect_hits=0)
    assert len(memo) == 2 and memo.hits == 4  # the counts run on across a weight change
    memo.clear(counts=True)  # a new fit: nothing stored, nothing counted
    assert len(memo) == 0 and memo.bytes == 0 and math.isnan(memo.hit_rate)


def test_context_memo_keeps_within_its_budget_and_needs_a_frozen_drafter(tiny_target):
    from lilicorr_pl.models.dflash import ContextMemo

    drafter = make_drafter(tiny_target, block_size=4)
    ids, feats, lengths = _padded_batch(tiny_target, [torch.arange(12), torch.arange(8)], 12)
    with pytest.raises(RuntimeError, match="frozen drafter"):
        ContextMemo(1 << 20).context(drafter, feats, torch.tensor([0, 1]), lengths)
    drafter.requires_grad_(False)
    small = ContextMemo(max_bytes=1)  # nothing fits: every batch is computed, and still right
    for _ in range(2):
        context = small.context(drafter, feats, torch.tensor([0, 1]), lengths)
        torch.testing.assert_close(context.fused, drafter.encode_context(feats).fused)
    assert len(small) == 0 and small.bytes == 0 and small.misses == 4

    memo = ContextMemo(max_bytes=1 << 30)
    memo.context(drafter, feats, torch.tensor([5, 5]), lengths)  # one example twice in a batch: kept once
    assert len(memo) == 1 and memo.bytes == sum(x.numel() * x.element_size() for x in memo._rows[5])
    drafter.to(torch.float64)  # a move keeps each weight's version counter: the key must still change
    moved = memo.context(drafter, feats.double(), torch.tensor([5, 1]), lengths)
    assert memo.hits == 0 and moved.fused.dtype == torch.float64 and memo._rows[5][0].dtype == torch.float64
