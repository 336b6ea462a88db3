"""Speculative decoding (DESIGN §7): lossless at T = 0 (token for token) and at T > 0 (in distribution),
stops, truncation, and τ (which always includes the target's bonus token) on stub drafters."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from lilicorr_pl.decoding import (
    GenerationResult,
    default_stop_token_ids,
    draft_sampling_for,
    greedy_accept,
    sample_tokens,
    speculative_generate,
    speculative_sampling_accept,
    target_generate,
    verify_block,
    warp_probs,
)
from lilicorr_pl.decoding.oracle import OracleSelector
from lilicorr_pl.heads import DominoHead, DSparkHead, LiLiCorrHead, SelectContext, Top1Selector
from lilicorr_pl.models.dflash import DFlashDrafter, DraftOutput
from lilicorr_pl.target import FrozenTarget


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Tiny models are dominated by thread synchronisation on a shared 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_target(path, vocab=64, tie=True, kv_heads=2, layers=3, hidden=32, std=0.3, seed=0) -> FrozenTarget:
    """A random tiny Qwen3 saved with ``save_pretrained`` and loaded through ``FrozenTarget``."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=hidden // 4,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        mask_token_id=vocab - 1,
        eos_token_id=1,
        bos_token_id=0,
        pad_token_id=0,
    )
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # wider than the default 0.02 init so greedy paths are distinct, not near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
    model.save_pretrained(path)
    return FrozenTarget.from_pretrained(str(path), load_tokenizer=False, layer_ids=list(range(layers - 1)))


TARGETS = {
    "tied-gqa": dict(vocab=64, tie=True, kv_heads=2, seed=1),
    "untied-mha": dict(vocab=80, tie=False, kv_heads=4, seed=2),
    "untied-mqa": dict(vocab=48, tie=False, kv_heads=1, seed=3),
}


@pytest.fixture(scope="module", params=list(TARGETS), ids=list(TARGETS))
def target(request, tmp_path_factory) -> FrozenTarget:
    return make_target(tmp_path_factory.mktemp(request.param), **TARGETS[request.param])


def random_prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 12, (n,), generator=g).tolist()
    return [torch.randint(2, vocab - 1, (length,), generator=g).tolist() for length in lengths]


def real_drafter(target: FrozenTarget, block_size: int, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    return DFlashDrafter(num_layers=2, block_size=block_size).build(target.config, target.layer_ids)


# ------------------------------------------------------------------------------------------ stubs
class OracleDrafter:
    """Drafts the target's own greedy continuation, with slots optionally made wrong.

    It rebuilds the committed token history from what the decoder feeds it (the prompt, then each
    round's anchor plus as many of its own drafts as new features arrive) and checks on every call
    that the features it was fed are exactly the target's features of those tokens, and that the
    anchor sits right after them.
    """

    def __init__(self, target, prompt, block_size, wrong_prob=0.0, seed=0):
        self.target, self.prompt = target, list(prompt)
        self.block_size, self.num_slots = block_size, block_size - 1
        self.wrong_prob = wrong_prob
        self.rng = torch.Generator().manual_seed(seed)
        self.vocab = target.output_rows

    def new_cache(self):
        return SimpleNamespace(length=0, history=[], features=None, last=None)

    def continuation(self, history, anchor):
        return target_generate(self.target, history + [anchor], self.num_slots, stop_token_ids=[]).tokens

    def draft(self, cache, new_features, anchor_ids, embed, lm_head):
        t = new_features.shape[1]
        if cache.last is None:
            committed = self.prompt
        else:
            prev_anchor, prev_drafts = cache.last
            assert 1 <= t <= self.block_size
            committed = [prev_anchor] + prev_drafts[: t - 1]
        assert len(committed) == t
        cache.history += committed
        fed = [new_features] if cache.features is None else [cache.features, new_features]
        cache.features = torch.cat(fed, dim=1)
        cache.length += t
        reference = self.target(torch.tensor([cache.history])).features
        torch.testing.assert_close(cache.features, reference, atol=1e-4, rtol=1e-4)
        anchor = int(anchor_ids[0])
        drafts = self.continuation(cache.history, anchor)
        wrong = torch.rand(self.num_slots, generator=self.rng) < self.wrong_prob
        drafts = [(d + 1) % self.vocab if w else d for d, w in zip(drafts, wrong.tolist())]
        cache.last = (anchor, drafts)
        logits = torch.full((1, self.num_slots, self.vocab), -10.0)
        logits[0, torch.arange(self.num_slots), torch.tensor(drafts)] = 10.0
        h = self.target.hidden_size
        return _draft_output(logits, h)


def _draft_output(logits: torch.Tensor, hidden: int) -> DraftOutput:
    s = logits.shape[1]
    valid = torch.ones(1, dtype=torch.bool)
    return DraftOutput(torch.zeros(1, s, hidden), logits, torch.zeros(1, hidden), valid)


class TableDrafter:
    """Cheap stub: drafts a fixed block per anchor token (e.g. precomputed greedy continuations)."""

    def __init__(self, table: torch.Tensor, vocab: int, hidden: int, sharpness: float = 10.0):
        self.table = table  # [vocab, S]
        self.num_slots = table.shape[1]
        self.block_size = self.num_slots + 1
        self.vocab, self.hidden, self.sharpness = vocab, hidden, sharpness

    def new_cache(self):
        return SimpleNamespace(length=0)

    def draft(self, cache, new_features, anchor_ids, embed, lm_head):
        cache.length += new_features.shape[1]
        drafts = self.table[anchor_ids]  # [1, S]
        logits = torch.nn.functional.one_hot(drafts, self.vocab).float() * self.sharpness
        h = self.hidden
        return _draft_output(logits, h)


# ------------------------------------------------------------------------------------------ helpers
def check_round_bookkeeping(result: GenerationResult, num_slots: int) -> None:
    acc = result.accepted_lengths
    assert result.num_rounds == len(acc)
    assert all(0 <= a <= num_slots for a in acc)
    if acc:
        assert result.tau == pytest.approx(sum(a + 1 for a in acc) / len(acc))
        # τ includes the bonus: the first token plus Σ τ covers the output, and the last round was needed.
        assert 1 + sum(a + 1 for a in acc) >= len(result.tokens) > 1 + sum(a + 1 for a in acc[:-1])
    else:
        assert result.tau == 1.0 and len(result.tokens) <= 1
    assert result.target_calls == 1 + result.num_rounds
    for name in ("prefill", "draft", "head", "verify", "bookkeeping", "total"):
        assert getattr(result, name) >= 0.0
    assert result.total >= result.prefill + result.step_seconds - 1e-3


def greedy(target, prompt, n, stops=()):
    return target_generate(target, prompt, n, stop_token_ids=list(stops))


# ------------------------------------------------------------------------------------------ T = 0
@pytest.mark.parametrize("selector_name", ["top1", "lilicorr"])
def test_greedy_speculative_equals_greedy_target_with_a_real_drafter(target, selector_name):
    vocab, hidden = target.output_rows, target.hidden_size
    for block_size, seed in [(4, 0), (6, 1)]:
        drafter = real_drafter(target, block_size, seed=seed)
        selector = (
            Top1Selector()
            if selector_name == "top1"
            else LiLiCorrHead(top_k=4, hidden_size=16, num_layers=1, num_heads=2).build(hidden, vocab, block_size=block_size)
        )
        for prompt in random_prompts(vocab, 3, seed=10 + seed):
            expected = greedy(target, prompt, 17)
            got = speculative_generate(target, drafter, selector, prompt, 17, stop_token_ids=[])
            assert got.tokens == expected.tokens
            assert got.stopped_on == expected.stopped_on == "max_new_tokens"
            check_round_bookkeeping(got, block_size - 1)


def test_greedy_speculative_equals_greedy_target_with_partial_acceptance(target):
    """A drafter that is right most of the time exercises every acceptance length and the cache crops."""
    vocab = target.output_rows
    seen_lengths = set()
    for i, prompt in enumerate(random_prompts(vocab, 4, seed=20)):
        for block_size, n in [(4, 19), (5, 22)]:  # budgets that end mid-block
            drafter = OracleDrafter(target, prompt, block_size, wrong_prob=0.25, seed=i)
            expected = greedy(target, prompt, n)
            got = speculative_generate(target, drafter, Top1Selector(), prompt, n, stop_token_ids=[])
            assert got.tokens == expected.tokens
            assert len(got.tokens) == n and got.stopped_on == "max_new_tokens"
            check_round_bookkeeping(got, block_size - 1)
            seen_lengths.update(got.accepted_lengths)
    assert {0, 1, 2, 3} <= seen_lengths


def test_oracle_drafter_reaches_tau_equal_block_size(target):
    block_size, rounds = 5, 3
    prompt = random_prompts(target.output_rows, 1, seed=30)[0]
    drafter = OracleDrafter(target, prompt, block_size)
    n = 1 + rounds * block_size  # the prefill token, then full blocks
    got = speculative_generate(target, drafter, Top1Selector(), prompt, n, stop_token_ids=[], record_rounds=2)
    assert got.tokens == greedy(target, prompt, n).tokens
    assert got.accepted_lengths == [block_size - 1] * rounds
    assert got.tau == block_size  # τ = B: every draft accepted plus the bonus token
    assert len(got.rounds) == 2
    first = got.rounds[0]
    assert first["anchor"] == got.tokens[0] and first["accepted"] == block_size - 1
    assert first["committed"] == got.tokens[1 : 1 + block_size]
    assert first["drafted"] == first["target"][:-1] == got.tokens[1:block_size]


def test_oracle_drafter_truncates_the_last_block_at_max_new_tokens(target):
    block_size = 4
    prompt = random_prompts(target.output_rows, 1, seed=31)[0]
    n = 1 + block_size + 2  # the second round commits 4 tokens but only 2 fit
    drafter = OracleDrafter(target, prompt, block_size)
    got = speculative_generate(target, drafter, Top1Selector(), prompt, n, stop_token_ids=[])
    assert got.tokens == greedy(target, prompt, n).tokens and len(got.tokens) == n
    assert got.accepted_lengths == [3, 3] and got.stopped_on == "max_new_tokens"


def test_always_wrong_drafter_gives_tau_one(target):
    prompt = random_prompts(target.output_rows, 1, seed=32)[0]
    drafter = OracleDrafter(target, prompt, 4, wrong_prob=1.0)
    got = speculative_generate(target, drafter, Top1Selector(), prompt, 9, stop_token_ids=[])
    assert got.tokens == greedy(target, prompt, 9).tokens
    assert got.accepted_lengths == [0] * 8 and got.tau == 1.0


@pytest.mark.parametrize("drafter_kind", ["real", "oracle"])
def test_stops_after_the_first_stop_token(target, drafter_kind):
    vocab = target.output_rows
    checked = 0
    for i, prompt in enumerate(random_prompts(vocab, 6, seed=40)):
        free = greedy(target, prompt, 24).tokens
        # A stop id the target really emits, first seen after a few tokens (inside a block).
        candidates = [tok for j, tok in enumerate(free) if j >= 3 and tok not in free[:j]]
        if not candidates:
            continue
        stop = candidates[0]
        cut = free.index(stop) + 1
        if drafter_kind == "real":
            drafter = real_drafter(target, 4)
        else:
            drafter = OracleDrafter(target, prompt, 4, seed=i)
        stops = [stop, vocab + 7]  # an id that never occurs does no harm
        expected = greedy(target, prompt, 24, stops=stops)
        got = speculative_generate(target, drafter, Top1Selector(), prompt, 24, stop_token_ids=stops)
        assert expected.tokens == free[:cut] and expected.stopped_on == "eos"
        assert got.tokens == free[:cut] and got.stopped_on == "eos"
        check_round_bookkeeping(got, 3)
        checked += 1
    assert checked >= 3


def test_default_stop_ids_come_from_the_config(target):
    prompt = random_prompts(target.output_rows, 1, seed=50)[0]
    free = greedy(target, prompt, 12).tokens
    stop = free[5]
    cut = free.index(stop) + 1
    old = target.config.eos_token_id, target.model.generation_config.eos_token_id
    try:
        target.config.eos_token_id = stop
        target.model.generation_config.eos_token_id = [stop]
        assert default_stop_token_ids(target) == [stop]
        got = speculative_generate(target, OracleDrafter(target, prompt, 4), Top1Selector(), prompt, 12)
        assert got.tokens == free[:cut] and got.stopped_on == "eos"
    finally:
        target.config.eos_token_id, target.model.generation_config.eos_token_id = old


def test_first_token_stop_ends_before_any_round(target):
    prompt = random_prompts(target.output_rows, 1, seed=51)[0]
    first = greedy(target, prompt, 1).tokens[0]
    drafter = real_drafter(target, 4)
    got = speculative_generate(target, drafter, Top1Selector(), prompt, 10, stop_token_ids=[first])
    assert got.tokens == [first] and got.stopped_on == "eos"
    assert got.num_rounds == 0 and got.accepted_lengths == [] and got.tau == 1.0


def test_plain_decoding_result_and_input_checks(target):
    prompt = random_prompts(target.output_rows, 1, seed=52)[0]
    plain = target_generate(target, torch.tensor([prompt]), 6, stop_token_ids=[])
    assert len(plain.tokens) == 6 and plain.accepted_lengths == [] and plain.tau == 1.0
    assert plain.target_calls == 6 and plain.prompt_length == len(prompt) and plain.num_rounds == 0
    assert target_generate(target, prompt, 0).tokens == []
    with pytest.raises(ValueError, match="batch size 1"):
        batch = torch.ones(2, 3, dtype=torch.long)
        speculative_generate(target, real_drafter(target, 4), Top1Selector(), batch, 4)
    with pytest.raises(ValueError, match="empty"):
        target_generate(target, [], 4)


def test_drafter_and_selector_run_in_eval_mode_and_are_restored(target):
    drafter = real_drafter(target, 4)
    head = LiLiCorrHead(top_k=4, hidden_size=16, num_layers=1, num_heads=2, dropout=0.5).build(
        target.hidden_size, target.output_rows, block_size=4
    )
    drafter.train(), head.train()
    prompt = random_prompts(target.output_rows, 1, seed=53)[0]
    got = speculative_generate(target, drafter, head, prompt, 8, stop_token_ids=[])
    assert got.tokens == greedy(target, prompt, 8).tokens
    assert drafter.training and head.training and all(m.training for m in head.modules())


# ------------------------------------------------------------------------------------------ T > 0
def _chi_square_ok(counts: torch.Tensor, probs: torch.Tensor, alpha_z: float = 4.0) -> tuple[bool, str]:
    """Pearson χ² goodness of fit, cells with expected count < 5 pooled; Wilson–Hilferty bound at z."""
    n = counts.sum().item()
    assert counts[probs == 0].sum() == 0, "a token sequence with probability zero was generated"
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)]).double()
    exp = torch.cat([expected[~small], expected[small].sum().view(1)]).double()
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    chi2 = ((obs - exp) ** 2 / exp).sum().item()
    df = obs.numel() - 1
    bound = df * (1 - 2 / (9 * df) + alpha_z * math.sqrt(2 / (9 * df))) ** 3
    return chi2 <= bound, f"chi2 {chi2:.1f} > bound {bound:.1f} (df {df})"


def _exact_joint(target, prompt, length, temperature, top_p) -> torch.Tensor:
    """Exact probability of every ``length``-token continuation, by enumeration: ``[V] * length``."""
    v = target.output_rows
    seqs = torch.cartesian_prod(*[torch.arange(v)] * (length - 1)).view(-1, length - 1)  # [V^(L-1), L-1]
    ids = torch.cat([torch.tensor(prompt).expand(seqs.shape[0], -1), seqs], dim=1)
    out = target(ids, return_logits=True)
    p = warp_probs(out.logits[:, len(prompt) - 1 :], temperature, top_p).double()  # [n, length, V]
    joint = p[0, 0]  # first token
    for k in range(1, length):
        # conditionals at step k depend on the first k tokens: pick rows whose first k tokens index them
        cond = p[:, k].reshape(*[v] * (length - 1), v)  # indexed by all length-1 prefix tokens
        cond = cond[(slice(None),) * k + (0,) * (length - 1 - k)]  # later tokens do not matter
        joint = joint.unsqueeze(-1) * cond
    return joint


def _sample_counts(generate, v, length, n):
    counts = torch.zeros([v] * length, dtype=torch.long)
    for _ in range(n):
        tokens = generate()
        assert len(tokens) == length
        counts[tuple(tokens)] += 1
    return counts


@pytest.fixture(scope="module")
def small_vocab_target(tmp_path_factory) -> FrozenTarget:
    path = tmp_path_factory.mktemp("v8")
    return make_target(path, vocab=8, tie=False, layers=2, hidden=16, std=0.6, seed=5)


def test_exact_joint_enumeration_is_a_distribution(small_vocab_target):
    joint = _exact_joint(small_vocab_target, [2, 5, 3], 3, 1.0, 1.0)
    assert joint.shape == (8, 8, 8) and joint.sum().item() == pytest.approx(1.0, abs=1e-6)
    # Spot check one conditional against a direct forward pass.
    logits = small_vocab_target(torch.tensor([[2, 5, 3, 4, 6]]), return_logits=True).logits[0, -1]
    cond = joint[4, 6] / joint[4, 6].sum()
    torch.testing.assert_close(cond, torch.softmax(logits.double(), -1), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "mode,temperature,top_p,n",
    [("point_mass", 0.8, 0.95, 1500), ("proposal", 1.0, 1.0, 1200)],
)
def test_sampling_is_lossless_in_distribution(small_vocab_target, mode, temperature, top_p, n):
    """End to end through ``speculative_generate``: at T > 0 the output is distributed as the target's own
    samples (exact enumeration), with deterministic drafts (point-mass rule) and with sampled drafts
    verified against their proposal ``q`` (``min(1, p/q)``)."""
    target, prompt, length, v = small_vocab_target, [2, 5, 3], 3, 8
    # Drafts: the greedy continuation after each possible anchor, so blocks are often (not always) accepted.
    table = torch.tensor([greedy(target, prompt + [a], 2).tokens for a in range(v)])  # [V, S=2]
    drafter = TableDrafter(table, v, target.hidden_size, sharpness=10.0 if mode == "point_mass" else 1.5)
    g = torch.Generator().manual_seed(123)
    lengths: list[int] = []

    def generate():
        r = speculative_generate(target, drafter, Top1Selector(), prompt, length, temperature, top_p, [], g,
                                 draft_sampling=mode)
        lengths.extend(r.accepted_lengths)
        return r.tokens

    counts = _sample_counts(generate, v, length, n)
    exact = _exact_joint(target, prompt, length, temperature, top_p)
    ok, msg = _chi_square_ok(counts.flatten(), exact.flatten().float())
    assert ok, msg
    assert {0, 1, 2} <= set(lengths)  # rejections, partial and full acceptance all occurred
    # The baseline samples the same distribution through the same sampling code.
    if mode == "point_mass":

        def plain():
            return target_generate(target, prompt, length, temperature, top_p, [], g).tokens

        counts = _sample_counts(plain, v, length, n // 2)
        ok, msg = _chi_square_ok(counts.flatten(), exact.flatten().float())
        assert ok, msg


# ---------------------------------------------------------------------------- every selector, lossless at T = 1
def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson χ² goodness-of-fit p-value; cells with expected count < 5 are pooled."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    assert counts[probs == 0].sum() == 0, "a token sequence with probability zero was generated"
    expected = probs / probs.sum() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    chi2 = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), chi2 / 2))


SELECTOR_CASES = ["top1", "lilicorr", "domino", "dspark"]


def _randomised(module: torch.nn.Module, seed: int, std: float) -> torch.nn.Module:
    """Random values in every parameter, as after training (fresh heads start at the drafter's top-1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else std * noise)
    return module.eval()


def _selector(name: str, target: FrozenTarget, block_size: int):
    h, v = target.hidden_size, target.output_rows
    if name == "top1":
        return Top1Selector()
    if name == "lilicorr":  # K = 4 of 8 tokens: q has zero mass off the candidates
        head = LiLiCorrHead(top_k=4, hidden_size=16, num_layers=1, num_heads=2, factor_dim=8)
        head = _randomised(head.build(h, v, block_size=block_size), seed=1, std=0.5)
        with torch.no_grad():  # candidates far apart, so a pair row depends on its predecessor as after training
            head.rank_embedding.mul_(5.0)
        return head
    if name == "domino":
        return _randomised(DominoHead(gru_hidden=8, rank=4).build(h, v), seed=2, std=0.3)
    return _randomised(DSparkHead(rank=4).build(h, v), seed=3, std=0.3)


def _wrong_q(name: str, selection, draft: DraftOutput) -> torch.Tensor:
    """A plausible bug in each selector's proposal: the test must catch it."""
    q = selection.q
    if name == "top1":  # q reported at half the temperature the draft was drawn at
        return q**2 / (q**2).sum(-1, keepdim=True)
    if name == "lilicorr":  # TensorRT-LLM's rows (along the greedy path) reported for SGLang's sampled walk
        lat = selection.lattice
        rows = [lat.start]
        index = lat.start.argmax(-1)
        for s in range(lat.pair.shape[1]):
            rows.append(lat.pair[torch.arange(index.shape[0]), s, index])
            index = rows[-1].argmax(-1)
        wrong = torch.zeros_like(q)
        return wrong.scatter_(-1, lat.candidates, torch.softmax(torch.stack(rows, 1), -1))
    # corrector heads: the drafter's own (uncorrected) distribution instead of the corrected one
    return torch.softmax(draft.slot_logits.float(), -1)


def _target_like_draft(target: FrozenTarget, prefix: list[int], num_slots: int, seed: int) -> DraftOutput:
    """One block's drafter outputs that roughly know the target: its logits along the greedy continuation
    plus noise (so drafts are often, not always, accepted and a wrong ``q`` shows), random slot states
    and no valid anchor feature."""
    g = torch.Generator().manual_seed(seed)
    greedy_path = greedy(target, prefix, num_slots - 1).tokens if num_slots > 1 else []
    with torch.no_grad():
        logits = target(torch.tensor([prefix + greedy_path]), return_logits=True).logits[:, len(prefix) - 1 :]
    slot_logits = logits + torch.randn(logits.shape, generator=g)  # [1, S, V]
    h = target.hidden_size
    return DraftOutput(torch.randn(1, num_slots, h, generator=g), slot_logits, torch.zeros(1, h),
                       torch.zeros(1, dtype=torch.bool))


def _one_round_completed(target, one: DraftOutput, selector, prompt, anchor, n, temperature, seed, corrupt=None):
    """``n`` independent speculative rounds from the same prefix and drafter outputs, batched through the
    decoding loop's own pieces (``Selector.select`` with a ``SelectContext``, then ``verify_block``); each
    round's committed tokens are completed to ``S + 1`` tokens by exact target sampling, so for a lossless
    round the ``S + 1`` tokens after the anchor are distributed exactly as target sampling."""
    g = torch.Generator().manual_seed(seed)
    p_len, s = len(prompt), one.slot_logits.shape[1]
    with torch.no_grad():
        draft = DraftOutput(*(t.expand(n, *t.shape[1:]).contiguous() for t in
                              (one.slot_hidden, one.slot_logits, one.anchor_feature, one.anchor_feature_valid)))
        context = SelectContext(torch.full((n,), anchor), torch.full((n,), p_len), target.embed,
                                draft_sampling_for("proposal", temperature, 1.0, g))
        selection = selector.select(draft, context)
        assert selection.q is not None and selection.q.shape == (n, s, target.output_rows)
        if corrupt is not None:
            selection.q = corrupt(selection, draft)
        drafts = selection.tokens
        unique, inverse = torch.unique(drafts, dim=0, return_inverse=True)  # few distinct blocks: one pass each
        ids = torch.cat([torch.tensor(prompt + [anchor]).expand(unique.shape[0], -1), unique], dim=1)
        logits = target(ids, return_logits=True).logits[:, p_len:][inverse]  # [n, S+1, V]
        acc, bonus, choices = verify_block(drafts, selection, logits, temperature, 1.0, g)
    assert choices is None  # the proposal rule ran, not the point-mass one
    joint = _exact_joint(target, prompt + [anchor], s + 1, temperature, 1.0)  # [V] * (S+1)
    seq = torch.cat([drafts, torch.zeros(n, 1, dtype=torch.long)], dim=1)
    seq[torch.arange(n), acc] = bonus
    v = target.output_rows
    for k in range(1, s + 1):  # complete position k from p(. | the k tokens before it) where the round ended
        short = acc < k
        cond = joint[tuple(seq[short, :k].t())].reshape(int(short.sum()), v, -1).sum(-1)  # [m, V]: next token
        seq[short, k] = torch.multinomial(cond / cond.sum(-1, keepdim=True), 1, generator=g).squeeze(1)
    flat = sum(seq[:, k] * v ** (s - k) for k in range(s + 1))
    return torch.bincount(flat, minlength=v ** (s + 1)), joint, acc


@pytest.mark.parametrize("name", SELECTOR_CASES)
def test_every_selector_is_lossless_with_its_proposal_at_t1(small_vocab_target, name):
    """χ² at T = 1 for every selector: sampled drafts verified with min(1, p/q) and the max(p − q, 0)
    residual give the target's own distribution over the first S + 1 = 3 tokens (20 000 batched rounds,
    p > 1e-3), and a deliberately wrong q for the same drafts is rejected (p < 1e-6): the test can fail."""
    target, prompt, anchor, block_size, n = small_vocab_target, [2, 5, 3], 4, 3, 20000
    one = _target_like_draft(target, prompt + [anchor], block_size - 1, seed=0)
    selector = _selector(name, target, block_size)
    counts, joint, acc = _one_round_completed(target, one, selector, prompt, anchor, n, 1.0, seed=11)
    assert {0, 1, 2} <= set(acc.tolist())  # rejections, partial and full acceptance all occurred
    assert _chi_square_p_value(counts, joint) > 1e-3
    wrong, _, _ = _one_round_completed(target, one, selector, prompt, anchor, n, 1.0, seed=11,
                                       corrupt=lambda sel, draft: _wrong_q(name, sel, draft))
    assert _chi_square_p_value(wrong, joint) < 1e-6


def test_point_mass_rule_keeps_deterministic_drafts_and_rejects_bad_rules(small_vocab_target):
    assert draft_sampling_for("point_mass", 1.0) is None and draft_sampling_for("proposal", 0.0) is None
    assert draft_sampling_for("proposal", 0.7, 0.9).temperature == 0.7
    with pytest.raises(ValueError, match="draft_sampling must be one of"):
        draft_sampling_for("sampled", 1.0)
    target, prompt = small_vocab_target, [2, 5, 3]
    drafter = DFlashDrafter(num_layers=1, block_size=3).build(target.config, target.layer_ids)
    seen = []

    class Recording(Top1Selector):
        def select(self, draft, context):
            seen.append(context.sampling)
            return super().select(draft, context)

    g = torch.Generator().manual_seed(0)
    r = speculative_generate(target, drafter, Recording(), prompt, 6, 1.0, 1.0, [], g, record_rounds=1,
                             draft_sampling="point_mass")
    assert seen and all(sampling is None for sampling in seen)
    assert r.rounds[0]["target"] is not None  # the target's own samples decide acceptance
    seen.clear()
    r = speculative_generate(target, drafter, Recording(), prompt, 6, 1.0, 1.0, [], g, record_rounds=1)
    assert seen and all(sampling.temperature == 1.0 for sampling in seen)
    assert r.rounds[0]["target"] is None  # the proposal rule draws no row of target choices
    with pytest.raises(ValueError, match="draft_sampling must be one of"):
        speculative_generate(target, drafter, Top1Selector(), prompt, 4, draft_sampling="sampled")


def test_oracle_selector_reads_the_anchor_position_from_the_context(target):
    """The top-K oracle knows where the block starts from ``SelectContext.anchor_positions`` alone."""
    drafter = real_drafter(target, block_size=5, seed=2)
    for prompt in random_prompts(target.output_rows, 2, seed=60):
        reference = greedy(target, prompt, 20).tokens
        oracle = OracleSelector(top_k=target.output_rows, reference=reference, prompt_length=len(prompt))
        got = speculative_generate(target, drafter, oracle, prompt, 20, stop_token_ids=[])
        assert got.tokens == reference
        assert got.tau == pytest.approx(5.0, abs=0.5)  # K = V: the target's token is always a candidate
        top1 = speculative_generate(target, drafter, Top1Selector(), prompt, 20, stop_token_ids=[])
        assert got.tau > top1.tau


# ------------------------------------------------------------------------------------------ acceptance rules
@pytest.mark.parametrize("rule", ["point-mass", "sampled-q"])
def test_acceptance_rules_are_lossless(rule):
    """The acceptance rules alone, vectorised over many blocks: the emitted tokens, completed by plain
    autoregressive sampling, must be distributed exactly as sampling from ``p`` (V = 3, S = 2)."""
    v, n = 3, 40000
    g = torch.Generator().manual_seed(0)

    def normalised(x):
        return x / x.sum(-1, keepdim=True)

    # Target conditionals p(. | prefix) for prefixes of 0, 1, 2 tokens; draft conditionals q likewise.
    p0 = normalised(torch.rand(v, generator=g) + 0.05)
    p1 = normalised(torch.rand(v, v, generator=g) ** 3 + 0.01)  # peaky: some drafts are often right
    p2 = normalised(torch.rand(v, v, v, generator=g) + 0.01)
    q0, q1 = normalised(torch.rand(v, generator=g) + 0.05), normalised(torch.rand(v, v, generator=g) + 0.05)
    rows = torch.arange(n)
    if rule == "point-mass":  # any draft chosen independently of the target's samples
        d1 = torch.ones(n, dtype=torch.long)
        d2 = torch.where(torch.rand(n, generator=g) < 0.5, 0, 2)
    else:
        d1 = torch.multinomial(q0, n, replacement=True, generator=g)
        d2 = torch.multinomial(q1[d1], 1, generator=g).squeeze(1)
    drafts = torch.stack([d1, d2], 1)  # [n, S]
    p = torch.stack([p0.expand(n, v), p1[d1], p2[d1, d2]], 1)  # [n, S+1, V] along each draft path
    if rule == "point-mass":
        acc, nxt = greedy_accept(drafts, sample_tokens(p.log(), 1.0, 1.0, g))
    else:
        q = torch.stack([q0.expand(n, v), q1[d1]], 1)  # [n, S, V]
        acc, nxt = speculative_sampling_accept(drafts, q, p, g)
    assert set(acc.tolist()) == {0, 1, 2}
    # Emitted: accepted drafts then the bonus; complete to 3 tokens with plain sampling from p.
    seq = torch.cat([drafts, torch.zeros(n, 1, dtype=torch.long)], 1)
    seq[rows, acc] = nxt
    short = acc == 0
    seq[short, 1] = torch.multinomial(p1[seq[short, 0]], 1, generator=g).squeeze(1)
    short = acc <= 1
    seq[short, 2] = torch.multinomial(p2[seq[short, 0], seq[short, 1]], 1, generator=g).squeeze(1)
    counts = torch.bincount(seq[:, 0] * v * v + seq[:, 1] * v + seq[:, 2], minlength=v**3)
    exact = (p0[:, None, None] * p1[:, :, None] * p2).flatten()
    ok, msg = _chi_square_ok(counts, exact)
    assert ok, msg


def test_greedy_accept_takes_the_longest_matching_prefix():
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [1, 6, 7]])
    choices = torch.tensor([[5, 6, 7, 9], [5, 0, 7, 9], [5, 6, 3, 9], [5, 6, 7, 9]])
    acc, nxt = greedy_accept(drafts, choices)
    assert acc.tolist() == [3, 1, 2, 0] and nxt.tolist() == [9, 0, 3, 5]


def test_warp_probs_nucleus_and_temperature():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    torch.testing.assert_close(warp_probs(logits, 1.0), torch.tensor([0.5, 0.3, 0.15, 0.05]))
    torch.testing.assert_close(warp_probs(logits, 1.0, top_p=0.8), torch.tensor([0.625, 0.375, 0.0, 0.0]))
    expected = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    torch.testing.assert_close(warp_probs(logits, 1.0, top_p=0.81), expected)
    assert warp_probs(logits, 1.0, top_p=0.1).tolist() == [1.0, 0.0, 0.0, 0.0]
    sharp = warp_probs(logits, 0.5)
    torch.testing.assert_close(sharp, torch.tensor([0.25, 0.09, 0.0225, 0.0025]) / 0.365)
    assert sample_tokens(logits.view(1, 1, 4), 0.0).tolist() == [[0]]


# ------------------------------------------------------------------------------------------ round cost
class FakeClock:
    """A clock that only moves when the code under test is charged a known cost."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def charge(self, fn, seconds):
        def wrapped(*args, **kwargs):
            self.now += seconds
            return fn(*args, **kwargs)

        return wrapped


def charged_phases(clock: FakeClock, target, monkeypatch):
    """A drafter and a top-1 selector, each phase charged a known time on ``clock`` (the host's clock too):
    drafter 2 ms, selector 0.5 ms, target forward 3 ms, sampling 0.25 ms."""
    import lilicorr_pl.decoding.speculative as spec

    monkeypatch.setattr(spec.time, "perf_counter", clock)
    monkeypatch.setattr(spec, "sample_tokens", clock.charge(spec.sample_tokens, 0.25e-3))
    monkeypatch.setattr(target, "forward", clock.charge(target.forward, 3e-3))
    drafter = real_drafter(target, block_size=4)
    monkeypatch.setattr(drafter, "draft", clock.charge(drafter.draft, 2e-3))
    selector = Top1Selector()
    monkeypatch.setattr(selector, "select", clock.charge(selector.select, 0.5e-3))
    return drafter, selector


def test_round_cost_split_is_computed_from_the_measured_phases(target, monkeypatch):
    """Charge each phase a known time on a fake clock: the fields must report exactly those times."""
    from lilicorr_pl.decoding.benchmarks import PromptSet
    from lilicorr_pl.decoding.evaluate import evaluate_arm, run_target_baseline

    clock = FakeClock()
    drafter, selector = charged_phases(clock, target, monkeypatch)
    ids = random_prompts(target.output_rows, 2, seed=5)
    prompts = PromptSet("random", ids, [""] * len(ids), False, False)

    reference, _ = run_target_baseline(target, prompts, 9)
    r = evaluate_arm(target, drafter, selector, prompts, 9, reference=reference)
    assert r.lossless is True and r.rounds > 0
    assert r.draft_ms == pytest.approx(2.0)
    assert r.head_ms == pytest.approx(0.5)
    assert r.verify_ms == pytest.approx(3.0)
    assert r.bookkeeping_ms == pytest.approx(0.25)  # one sample_tokens (argmax) per round at T = 0
    assert r.round_ms == pytest.approx(5.75)
    assert r.plain_step_ms == pytest.approx(3.25)  # target forward + sampling per plain step
    assert r.round_cost_ratio == pytest.approx(5.75 / 3.25)
    assert r.head_time_fraction == pytest.approx(0.5 / 5.75)
    assert r.draft_time_fraction == pytest.approx(2.0 / 5.75)


class FakeCudaEvent:
    """A CUDA event on the fake clock: ``record`` reads the clock, ``elapsed_time`` is in milliseconds as CUDA's."""

    made: list["FakeCudaEvent"] = []

    def __init__(self, enable_timing=False):
        assert enable_timing, "phase events must be made with enable_timing=True"
        self.at, self.stream, self.waits = None, None, 0
        FakeCudaEvent.made.append(self)

    def record(self, stream=None):
        self.at, self.stream = FakeCudaEvent.clock(), stream

    def synchronize(self):
        self.waits += 1
        FakeCudaEvent.clock.now += 1.0  # a long wait for the device, on the host clock

    def elapsed_time(self, end):
        assert self.at is not None and end.at is not None, "an event read before it was recorded"
        return (end.at - self.at) * 1000.0


def test_timed_cuda_phases_come_from_events_read_once_with_no_synchronisation(target, monkeypatch):
    """Timed on CUDA the phase split is summed from CUDA events read once per generation: the clock synchronised the
    device at every phase boundary (three waits a round, slowing the tokens/s measured beside the split)."""
    import lilicorr_pl.decoding.speculative as spec

    clock = FakeClock()
    monkeypatch.setattr(FakeCudaEvent, "clock", clock, raising=False)
    monkeypatch.setattr(FakeCudaEvent, "made", [])
    syncs = []
    monkeypatch.setattr(spec.torch.cuda, "Event", FakeCudaEvent)
    monkeypatch.setattr(spec.torch.cuda, "current_stream", lambda device=None: ("stream", str(device)))
    monkeypatch.setattr(spec.torch.cuda, "synchronize", lambda device=None: syncs.append(device))

    class OnCuda(spec._Clock):  # the target is on the CPU here; its clock is told it is on CUDA
        def __init__(self, device, timed=False):
            super().__init__(torch.device("cuda", 0), timed)

    monkeypatch.setattr(spec, "_Clock", OnCuda)
    drafter, selector = charged_phases(clock, target, monkeypatch)  # host time: the same fake clock
    prompt = random_prompts(target.output_rows, 1, seed=5)[0]

    got = speculative_generate(target, drafter, selector, prompt, 9, stop_token_ids=[], timing=True)
    assert got.num_rounds > 0 and syncs == []
    assert [e.waits for e in FakeCudaEvent.made] == [0] * (len(FakeCudaEvent.made) - 1) + [1]  # the last, once
    assert {e.stream for e in FakeCudaEvent.made} == {("stream", "cuda:0")}
    assert len(FakeCudaEvent.made) == 2 + 4 * got.num_rounds + 1  # start, prefill, 4 a round (with the loop's start)
    assert got.prefill == pytest.approx(3.25e-3)  # the prefill's forward and first sample
    assert got.draft == pytest.approx(2e-3 * got.num_rounds)
    assert got.head == pytest.approx(0.5e-3 * got.num_rounds)
    assert got.verify == pytest.approx(3e-3 * got.num_rounds)
    assert got.bookkeeping == pytest.approx(0.25e-3 * got.num_rounds)
    phases = got.prefill + got.draft + got.head + got.verify + got.bookkeeping
    assert got.total == pytest.approx(phases)  # host time, taken before the wait for the events (1 s here)

    monkeypatch.setattr(FakeCudaEvent, "made", [])
    plain = target_generate(target, prompt, 9, stop_token_ids=[], timing=True)
    assert syncs == [] and sum(e.waits for e in FakeCudaEvent.made) == 1
    assert plain.verify == pytest.approx(3e-3 * plain.num_steps)
    assert plain.bookkeeping == pytest.approx(0.25e-3 * plain.num_steps)

    monkeypatch.setattr(FakeCudaEvent, "made", [])  # untimed: launch times on the host clock, no events
    untimed = speculative_generate(target, drafter, selector, prompt, 9, stop_token_ids=[])
    assert FakeCudaEvent.made == [] and untimed.tokens == got.tokens
    assert untimed.draft == pytest.approx(2e-3 * untimed.num_rounds)  # the host clock's launch times


@pytest.mark.parametrize("selector_name", ["top1", "lilicorr"])
def test_round_cost_fields_are_present_positive_and_consistent(target, selector_name):
    from lilicorr_pl.decoding.benchmarks import PromptSet
    from lilicorr_pl.decoding.evaluate import evaluate_arm, plain_step_ms, run_target_baseline

    vocab, hidden = target.output_rows, target.hidden_size
    drafter = real_drafter(target, block_size=5)
    selector = (
        Top1Selector()
        if selector_name == "top1"
        else LiLiCorrHead(top_k=4, hidden_size=16, num_layers=1, num_heads=2).build(hidden, vocab, block_size=5)
    )
    ids = random_prompts(vocab, 2, seed=6)
    prompts = PromptSet("random", ids, [""] * len(ids), False, False)
    reference, _ = run_target_baseline(target, prompts, 12)
    for g in reference:
        assert g.num_steps == g.target_calls - 1 == len(g.tokens) - 1
        assert g.verify > 0 and g.bookkeeping > 0 and g.draft == g.head == 0.0
    r = evaluate_arm(target, drafter, selector, prompts, 12, reference=reference)
    split = [r.draft_ms, r.head_ms, r.verify_ms, r.bookkeeping_ms]
    assert all(x > 0 for x in split) and r.round_ms > 0 and r.plain_step_ms > 0
    assert sum(split) == pytest.approx(r.round_ms, rel=1e-9)
    assert r.plain_step_ms == pytest.approx(plain_step_ms(reference))
    assert r.round_cost_ratio == pytest.approx(r.round_ms / r.plain_step_ms, rel=1e-9)
    # Without a reference there is no plain step to compare with.
    alone = evaluate_arm(target, drafter, selector, prompts, 12)
    assert math.isnan(alone.plain_step_ms) and math.isnan(alone.round_cost_ratio) and alone.round_ms > 0


def test_one_device_to_host_transfer_per_round(target, monkeypatch):
    """The loop reads acc, the bonus token and the drafts in one ``tolist`` per round, nothing else."""
    counts = {"tolist": 0, "item": 0}
    real_tolist, real_item = torch.Tensor.tolist, torch.Tensor.item

    def tolist(self):
        counts["tolist"] += 1
        return real_tolist(self)

    def item(self):
        counts["item"] += 1
        return real_item(self)

    drafter = real_drafter(target, block_size=4)
    prompt = random_prompts(target.output_rows, 1, seed=7)[0]
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    monkeypatch.setattr(torch.Tensor, "item", item)
    got = speculative_generate(target, drafter, Top1Selector(), prompt, 15, stop_token_ids=[])
    # One per round, plus the prefill's first token (an int() -> item()).
    assert counts["tolist"] == got.num_rounds
    assert counts["item"] <= 1
    monkeypatch.undo()
    assert got.tokens == greedy(target, prompt, 15).tokens


def test_a_reference_made_with_the_arms_stops_keeps_custom_stops_lossless(target):
    """run_target_baseline had no stop_token_ids: with custom stops the reference stopped elsewhere than the arm and
    the token-for-token check reported lossless False for lossless decoding."""
    from lilicorr_pl.decoding.benchmarks import PromptSet
    from lilicorr_pl.decoding.evaluate import evaluate_arm, run_target_baseline
    from lilicorr_pl.decoding.speculative import target_generate

    ids = random_prompts(target.output_rows, 2, seed=7)
    prompts = PromptSet("random", ids, [""] * len(ids), False, False)
    free = target_generate(target, ids[0], 12, stop_token_ids=[]).tokens
    stop = [free[3]]  # a token plain decoding emits: the first prompt stops early
    drafter = real_drafter(target, block_size=4)
    reference, _ = run_target_baseline(target, prompts, 12, stop_token_ids=stop)
    assert len(reference[0].tokens) <= 4 < len(free)
    r = evaluate_arm(target, drafter, Top1Selector(), prompts, 12, reference=reference, stop_token_ids=stop)
    assert r.lossless is True


def test_the_lattice_oracle_knows_the_targets_tokens_past_the_budget_and_a_stop(target):
    """The demo's oracle row: its reference was the greedy output itself, cut at the budget (and at a stop), so in the
    last round the oracle fell back to top-1 on the slots past it, whose accepted drafts τ counts for every arm: arms
    beat the "bound" on some prompts. With K = V every slot holds the target's token, so every round of the oracle
    accepts its whole block, the last one too."""
    from types import SimpleNamespace

    from lilicorr_pl.demo.run import evaluate_oracle

    drafter = real_drafter(target, block_size=5, seed=2)
    prompts = random_prompts(target.output_rows, 3, seed=61)
    reference = [target_generate(target, p, 18) for p in prompts]  # the target's own stops, as the demo decodes
    out = evaluate_oracle(SimpleNamespace(target=target, drafter=drafter), SimpleNamespace(input_ids=prompts),
                          reference, 18, target.output_rows)
    assert out["per_prompt_tau"] == [5.0, 5.0, 5.0] and out["tau"] == 5.0


def test_a_ranks_recorded_examples_are_named_by_their_index_in_the_whole_set(target):
    """With the prompts split over ranks (AcceptanceEval gives rank r the prompts r, r + W, …), each recorded
    example's prompt_index was its place in the rank's share: rank 1's prompts 1 and 3 were named 0 and 1."""
    from lilicorr_pl.decoding.benchmarks import PromptSet
    from lilicorr_pl.decoding.evaluate import evaluate_arm

    ids = random_prompts(target.output_rows, 4, seed=3)
    texts = [f"prompt {i}" for i in range(4)]
    world, rank = 2, 1
    share = PromptSet("random", ids[rank::world], texts[rank::world], False, False)
    r = evaluate_arm(target, real_drafter(target, block_size=4), Top1Selector(), share, 6, record_examples=2,
                     stop_token_ids=[], prompt_indices=range(rank, 4, world))
    assert [(ex["prompt"], ex["prompt_index"]) for ex in r.examples] == [("prompt 1", 1), ("prompt 3", 3)]
