"""AcceptanceMetrics: hand-computed values, τ including the bonus token, and exactness under merging."""

from __future__ import annotations

import math

import pytest
import torch

from lilicorr_pl.decoding import AcceptanceMetrics, GenerationResult


def test_values_on_hand_built_rounds():
    metric = AcceptanceMetrics(num_slots=3)
    metric.update([0, 3, 1], num_tokens=9, seconds=1.5)
    metric.update(torch.tensor([3, 2]), num_tokens=5, seconds=0.5)
    out = metric.compute()
    # acc = [0, 3, 1, 3, 2] -> τ = acc + 1 = [1, 4, 2, 4, 3] (bonus token included)
    assert out["tau"].item() == pytest.approx(14 / 5)
    assert out["rounds"].item() == 5
    assert out["histogram"].tolist() == [1, 1, 1, 2]
    # position k is reached when the first k-1 drafts were accepted: acc >= k-1; accepted when acc >= k
    assert out["reached"].tolist() == [5, 4, 3]
    assert out["accepted"].tolist() == [4, 3, 2]
    torch.testing.assert_close(
        out["per_position_acceptance"], torch.tensor([4 / 5, 3 / 4, 2 / 3], dtype=torch.float64)
    )
    assert out["num_tokens"].item() == 14
    assert out["tokens_per_s"].item() == pytest.approx(7.0)


def test_extremes_tau_one_and_tau_block_size():
    never = AcceptanceMetrics(num_slots=7)
    never.update([0] * 10)
    out = never.compute()
    assert out["tau"].item() == 1.0
    assert out["per_position_acceptance"][0].item() == 0.0
    assert torch.isnan(out["per_position_acceptance"][1:]).all()  # never reached
    always = AcceptanceMetrics(num_slots=7)
    always.update([7] * 4)
    out = always.compute()
    assert out["tau"].item() == 8.0  # τ = B
    assert out["histogram"].tolist() == [0] * 7 + [4]
    assert out["per_position_acceptance"].tolist() == [1.0] * 7


@pytest.mark.filterwarnings("ignore:The ``compute`` method of metric AcceptanceMetrics was called before")
def test_empty_metric_and_plain_decoding_updates():
    metric = AcceptanceMetrics(num_slots=3)
    out = metric.compute()
    assert math.isnan(out["tau"].item()) and math.isnan(out["tokens_per_s"].item())
    assert out["rounds"].item() == 0
    metric.update([], num_tokens=12, seconds=3.0)  # plain decoding: tokens and time only
    out = metric.compute()
    assert out["rounds"].item() == 0 and out["tokens_per_s"].item() == pytest.approx(4.0)


def test_rejects_out_of_range_lengths():
    metric = AcceptanceMetrics(num_slots=3)
    with pytest.raises(ValueError, match="0..3"):
        metric.update([1, 4])  # 4 is a τ, not an accepted count
    with pytest.raises(ValueError, match="0..3"):
        metric.update([-1])
    with pytest.raises(ValueError, match="num_slots"):
        AcceptanceMetrics(num_slots=0)


def test_merge_state_equals_one_update_on_everything():
    g = torch.Generator().manual_seed(0)
    s = 15
    lengths = torch.randint(0, s + 1, (200,), generator=g)
    tokens = torch.randint(1, 50, (10,), generator=g).tolist()
    seconds = torch.rand(10, generator=g).tolist()
    chunks = lengths.chunk(10)

    whole = AcceptanceMetrics(num_slots=s)
    left, right = AcceptanceMetrics(num_slots=s), AcceptanceMetrics(num_slots=s)
    for i, chunk in enumerate(chunks):
        whole.update(chunk, tokens[i], seconds[i])
        (left if i % 2 else right).update(chunk.tolist(), tokens[i], seconds[i])
    left.merge_state(right)
    a, b = whole.compute(), left.compute()
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], equal_nan=True)
    # All states are sum-reduced, so DDP sync is exact.
    assert all(fx is not None for fx in whole._reductions.values())
    assert a["histogram"].sum().item() == 200


@pytest.mark.filterwarnings("ignore:The ``compute`` method of metric AcceptanceMetrics was called before")
def test_accepts_generation_results():
    results = [
        GenerationResult(tokens=list(range(9)), accepted_lengths=[3, 3, 0], total=2.0),
        GenerationResult(tokens=list(range(4)), accepted_lengths=[1, 0], total=1.0),
    ]
    metric = AcceptanceMetrics(num_slots=3)
    for r in results:
        metric.update(r.accepted_lengths, num_tokens=r.num_tokens, seconds=r.total)
    out = metric.compute()
    assert out["tau"].item() == pytest.approx((4 + 4 + 1 + 2 + 1) / 5)
    assert out["tokens_per_s"].item() == pytest.approx(13 / 3)
    metric.reset()
    assert metric.compute()["rounds"].item() == 0


def test_arm_result_splits_slot1_by_first_round():
    """Slot-1 acceptance of each prompt's first round (drafted right after the prompt) and of the later rounds,
    from hand-made rounds; a prompt without a round counts in neither."""
    from lilicorr_pl.decoding.benchmarks import PromptSet
    from lilicorr_pl.decoding.evaluate import _arm_result

    results = [
        GenerationResult(tokens=list(range(9)), accepted_lengths=[0, 3, 0], num_rounds=3, total=2.0),
        GenerationResult(tokens=list(range(4)), accepted_lengths=[2, 0, 1, 1], num_rounds=4, total=1.0),
        GenerationResult(tokens=[5], total=0.5),  # stopped at the prefill's token: no round
    ]
    prompts = PromptSet("hand", [[1], [2], [3]], ["a", "b", "c"], False, False)
    r = _arm_result(results, prompts, num_slots=3, temperature=0.0, draft_sampling="proposal", reference=None)
    assert r.per_prompt_first_round == [0, 2, -1]
    assert r.slot1_first_round == pytest.approx(1 / 2)
    assert r.slot1_later_rounds == pytest.approx(3 / 5)  # 3, 0 | 0, 1, 1
    # Together they are the pooled slot-1 acceptance.
    assert r.per_position_acceptance[0] == pytest.approx((1 + 3) / (2 + 5))
    empty = _arm_result(results[2:], prompts, num_slots=3, temperature=0.0, draft_sampling="proposal", reference=None)
    assert math.isnan(empty.slot1_first_round) and math.isnan(empty.slot1_later_rounds)
