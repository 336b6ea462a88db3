"""The cost model of one speculative round (``lilicorr_pl.perf``): hand counts, torch's FLOP counter, Qwen3-8B."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from conftest import save_tiny_target, user_error
from lilicorr_pl.checkpoint import UserInputError
from lilicorr_pl.cli import main as cli_main
from lilicorr_pl.heads.base import SelectContext
from lilicorr_pl.heads.lilicorr import LiLiCorrHead
from lilicorr_pl.models.dflash import DFlashDrafter, DraftOutput
from lilicorr_pl.perf import (
    ROOFLINES,
    drafter_round_ops,
    head_round_ops,
    load_round_modules,
    round_cost,
    target_round_ops,
)
from lilicorr_pl.target import FrozenTarget, default_layer_ids

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "configs" / "qwen3-8b"  # base.yaml plus one overlay per arm
QWEN3_8B = RECIPES / "Qwen3-8B.config.json"

# The tiny shapes of the hand computation: target H 32, 4 layers, 4 query heads / 2 KV heads of 8, MLP 64, V 96.
H, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 32, 4, 4, 2, 8, 64, 96
BLOCK, CONTEXT, TAU = 4, 10, 3
SLOTS = BLOCK - 1


def flops(ops) -> float:
    return sum(op.count * op.flops for op in ops)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny_target(tmp_path_factory.mktemp("cost") / "target", tie=False, layers=LAYERS, vocab=VOCAB, hidden=H)
    target = FrozenTarget.from_pretrained(path, load_tokenizer=False, layer_ids=[1, 2, 3])
    torch.manual_seed(0)
    drafter = DFlashDrafter(num_layers=2, block_size=BLOCK).build(target.config, target.layer_ids)
    head = LiLiCorrHead(top_k=3, hidden_size=16, num_layers=1, num_heads=2, factor_dim=8).build(
        H, VOCAB, block_size=BLOCK)
    return target, drafter, head


# ------------------------------------------------------------------------------------- by hand
def test_counts_of_a_tiny_round_match_a_hand_computation(tiny):
    target, drafter, head = tiny
    # Target: every linear weight is used once per block token (2 FLOPs per weight per token), the LM head too;
    # attention is Q·Kᵀ + P·V over 14 keys.
    per_layer = H * HEADS * HEAD_DIM + 2 * H * KV_HEADS * HEAD_DIM + HEADS * HEAD_DIM * H + 3 * H * INTER  # 9,216
    target_flops = 2 * BLOCK * (LAYERS * per_layer + H * VOCAB) + LAYERS * 4 * HEADS * HEAD_DIM * BLOCK * (CONTEXT + BLOCK)
    assert target_flops == 348_160
    ops = target_round_ops(target.config, BLOCK, CONTEXT)
    assert flops(ops) == target_flops
    # Bytes (bf16): weights once + the 4 embedding rows; activations in and out of every matmul, attention reads
    # Q and 14 keys' K/V and writes O and 4 new K/V rows.
    weights = LAYERS * per_layer + H * VOCAB + BLOCK * H
    activations = (LAYERS * BLOCK * (2 * (H + HEADS * HEAD_DIM) + 2 * (H + KV_HEADS * HEAD_DIM) + 3 * (H + INTER))
                   + BLOCK * (H + VOCAB) + BLOCK * H
                   + LAYERS * HEAD_DIM * (2 * HEADS * BLOCK + 2 * KV_HEADS * (CONTEXT + BLOCK) + 2 * KV_HEADS * BLOCK))
    assert sum(op.count * op.weight_bytes for op in ops) == 2 * weights
    assert sum(op.count * op.other_bytes for op in ops) == 2 * activations

    # Drafter (2 layers, 3 features): the block through every layer, the 3 new context tokens through fc
    # (3H -> H) and every layer's k/v projections, the LM head over the 3 slots, attention over 14 keys.
    drafter_flops = (2 * (BLOCK * 2 * per_layer + TAU * 2 * 2 * H * KV_HEADS * HEAD_DIM + TAU * 3 * H * H
                          + SLOTS * H * VOCAB)
                     + 2 * 4 * HEADS * HEAD_DIM * BLOCK * (CONTEXT + BLOCK))
    assert drafter_flops == 210_944
    assert flops(drafter_round_ops(drafter, CONTEXT, TAU)) == drafter_flops

    # Head (K 3 x S 3 = 9 nodes, width 16, 1 layer, MLP 32, factors 8), multiply-adds per product:
    nodes, d, mlp, f = 9, 16, 32, 8
    macs = (nodes * H * d            # token_proj (32 -> 16)
            + SLOTS * H * d          # pass_hidden_proj
            + nodes * 5 * d + nodes * d * d  # confidence-feature MLP
            + nodes * d * 3 * d + nodes * d * d + 2 * nodes * d * mlp  # in_proj, out_proj, MLP
            + H * d                  # context_proj
            + 2 * nodes * d * d + d * d  # factor_input_proj: node, node ⊙ anchor, anchor
            + 2 * nodes * d * f + d * f)  # out/in heads, anchor head
    head_flops = 2 * macs + 4 * nodes * nodes * d + 2 * (SLOTS - 1) * 3 * 3 * f  # + attention + pair scores
    assert head_flops == 76_288
    assert flops(head_round_ops(head)) == head_flops


# ------------------------------------------------------------------------------ torch's counter
def counted(fn) -> int:
    """FLOPs torch's counter sees; the math SDPA backend so attention is counted on CPU (as its two products).

    The model leaves element-wise work out; transformers 4.x computes RoPE angles as a tiny matmul (``d·T``
    FLOPs, ~1e-4 of these passes), hence the comparisons below allow a relative 1e-3.
    """
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        fn()
    return counter.get_total_flops()


def test_target_verify_flops_equal_torch_flop_counter(tiny):
    target = tiny[0]
    for batch, context in ((1, CONTEXT), (2, 23)):
        ids = torch.randint(0, VOCAB - 1, (batch, context + BLOCK))
        positions = torch.arange(context + BLOCK).expand(batch, -1)
        prefill = target(ids[:, :context], position_ids=positions[:, :context], use_cache=True)

        def verify():
            target(ids[:, context:], attention_mask=target.block_mask(context, BLOCK),
                   position_ids=positions[:, context:], cache=prefill.cache, use_cache=True, return_logits=True)

        assert counted(verify) == pytest.approx(flops(target_round_ops(target.config, BLOCK, context, batch)), rel=1e-3)


def test_drafter_draft_flops_equal_torch_flop_counter(tiny):
    target, drafter, _ = tiny
    ids = torch.randint(0, VOCAB - 1, (1, 40))
    feats = target(ids).features  # [1, 40, 3H]
    for start, new in ((CONTEXT - TAU, TAU), (17, 1), (20, 15)):
        cache = drafter.new_cache()
        drafter.draft(cache, feats[:, :start], ids[:, start], target.embed, target.lm_head)
        n = counted(lambda: drafter.draft(cache, feats[:, start : start + new], ids[:, start + new],
                                          target.embed, target.lm_head))
        assert cache.length == start + new
        assert n == pytest.approx(flops(drafter_round_ops(drafter, start + new, new)), rel=1e-3)


@pytest.mark.parametrize("width, batch, top_k", [(16, 1, 3), (H, 2, 2)], ids=["token_proj", "same-width-batch2-k2"])
def test_head_select_flops_equal_torch_flop_counter(tiny, width, batch, top_k):
    target = tiny[0]
    torch.manual_seed(1)
    head = LiLiCorrHead(top_k=3, hidden_size=width, num_layers=2, num_heads=4, factor_dim=8).build(
        H, VOCAB, block_size=BLOCK)
    assert isinstance(head.token_proj, torch.nn.Identity) == (width == H)
    hidden, logits = torch.randn(batch, SLOTS, H), torch.randn(batch, SLOTS, VOCAB)
    draft = DraftOutput(hidden, logits, torch.randn(batch, H), torch.ones(batch, dtype=torch.bool))
    context = SelectContext(torch.zeros(batch, dtype=torch.long), torch.full((batch,), 20), target.embed)
    n = counted(lambda: head.select(draft, context, top_k=top_k))
    assert n == pytest.approx(flops(head_round_ops(head, SLOTS, top_k, batch)), rel=1e-3)


# ---------------------------------------------------------------------------------- Qwen3-8B
@pytest.fixture(scope="module")
def qwen3_8b():
    return load_round_modules([str(RECIPES / "base.yaml"), str(RECIPES / "lilicorr.yaml")], str(QWEN3_8B))


def test_qwen3_8b_shapes_come_from_the_configs(qwen3_8b):
    config, drafter, head = qwen3_8b
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.intermediate_size, config.vocab_size) == (4096, 36, 32, 8, 128, 12288, 151936)
    assert drafter.num_layers == 5 and drafter.block_size == 16 and drafter.fc.in_features == 5 * 4096
    assert (head.top_k, head.hidden_size, head.num_layers, head.factor_dim) == (8, 1024, 2, 1024)
    assert drafter.fc.weight.is_meta and head.out_head.weight.is_meta  # shapes only, nothing allocated


def test_qwen3_8b_weight_bytes_match_the_published_parameter_count(qwen3_8b):
    config, drafter, head = qwen3_8b
    cost = round_cost(config, drafter, head, context=2048, tau=6.0)
    # Qwen3-8B's model card: 6.95 B non-embedding parameters; the verify pass reads them and the untied LM head
    # (4096 x 151,936) once, plus 16 embedding rows.
    target_weights = sum(op.count * op.weight_bytes for op in cost.target)
    assert target_weights == pytest.approx(2 * (6.95e9 + 4096 * 151936), rel=1e-3)
    # The head reads each of its parameters once (norm weights and the small tables are element-wise reads,
    # not counted: well under 1 %), plus the 120 gathered candidate embeddings.
    head_params = sum(p.numel() for p in head.parameters())
    head_weights = sum(op.count * op.weight_bytes for op in cost.head) - 2 * 120 * 4096
    assert head_weights == pytest.approx(2 * head_params, rel=1e-2)


def test_batch_scales_flops_but_weights_are_read_once(qwen3_8b):
    config, drafter, head = qwen3_8b
    one, four = (round_cost(config, drafter, head, context=1024, tau=4.0, batch=b) for b in (1, 4))
    for part in ("target", "drafter", "head"):
        a, b = one.parts()[part], four.parts()[part]
        assert flops(b) == pytest.approx(4 * flops(a), rel=1e-12), part
        gathers = [op for op in a if "gather" in op.name]  # embedding rows are per token: they scale
        fixed = sum(op.count * op.weight_bytes for op in a if op not in gathers)
        scaled = sum(op.count * op.weight_bytes for op in gathers)
        assert sum(op.count * op.weight_bytes for op in b) == pytest.approx(fixed + 4 * scaled, rel=1e-12), part


def test_cost_model_command_prints_the_qwen3_8b_round(tmp_path, capsys):
    out = tmp_path / "cost.json"
    result = cli_main(["perf", "--cost-model", "-c", str(RECIPES / "base.yaml"), "-c", str(RECIPES / "lilicorr.yaml"),
                       "--target-config", str(QWEN3_8B), "--context", "4096", "--gpu", "h200", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "head share of the round" in printed and "H200" in printed
    saved = json.loads(out.read_text())
    assert saved["head_share"] == pytest.approx(result["head_share"])
    parts = [saved[p]["seconds"] for p in ("target", "drafter", "head")]
    assert saved["round"]["seconds"] == pytest.approx(sum(parts))
    assert saved["head_share"] == pytest.approx(parts[2] / sum(parts))
    # At batch 1 the whole round is memory-bound on an H200: its roofline time is its bytes over the bandwidth.
    h200 = ROOFLINES["h200"]
    assert saved["round"]["seconds"] == pytest.approx(saved["round"]["bytes"] / h200.bandwidth, rel=1e-9)
    assert saved["settings"]["head"] == {"top_k": 8, "slots": 15, "nodes": 120, "hidden_size": 1024,
                                         "num_layers": 2, "factor_dim": 1024}
    assert 0 < saved["head_share"] < saved["head_share_of_drafting"] < 1


def test_cost_model_refuses_a_config_without_a_lilicorr_head(tmp_path, capsys):
    assert "needs model.head = LiLiCorrHead" in user_error(capsys, [
        "perf", "--cost-model", "-c", str(RECIPES / "base.yaml"), "-c", str(RECIPES / "dflash.yaml"), "--target-config",
        str(QWEN3_8B)])
    assert "could not read the target config" in user_error(capsys, [
        "perf", "--cost-model", "-c", str(RECIPES / "base.yaml"), "-c", str(RECIPES / "lilicorr.yaml"), "--target-config",
        str(tmp_path / "missing")])
    # A drafter's config (an export's) costed as the target: its own sizes, or a mask token "outside the vocabulary".
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    cfg = json.loads(QWEN3_8B.read_text())
    (drafter / "config.json").write_text(json.dumps({**cfg, "architectures": ["LiLiCorrDraftModel"],
                                                      "dflash_config": {"mask_token_id": 151669}}))
    err = user_error(capsys, ["perf", "--cost-model", "-c", str(RECIPES / "base.yaml"), "-c", str(RECIPES / "lilicorr.yaml"),
                              "--target-config", str(drafter)])
    assert f"--target_config {drafter} is a drafter (LiLiCorrDraftModel), not a target model" in err


def test_cost_model_applies_the_command_lines_model_overrides(capsys):
    """The shapes came from the -c files alone: a --model.* override printed the unchanged shapes without a word."""
    base = ["perf", "--cost-model", "-c", str(RECIPES / "base.yaml"), "-c", str(RECIPES / "lilicorr.yaml"),
            "--target-config", str(QWEN3_8B)]
    plain = cli_main(base)
    pinned = cli_main([*base, "--model.drafter.init_args.block_size=8", "--model.head.init_args.top_k=4"])
    assert plain["settings"]["block_size"] == 16 and plain["settings"]["head"]["top_k"] == 8
    assert pinned["settings"]["block_size"] == 8 and pinned["settings"]["head"]["top_k"] == 4
    assert pinned["settings"]["head"]["nodes"] == 7 * 4


def _timing_config(tmp_path: Path, target: str, layer_ids: list[int] | None = None) -> Path:
    config = tmp_path / ("timing.yaml" if layer_ids else "timing-default-ids.yaml")
    ids = {"layer_ids": layer_ids} if layer_ids else {"num_features": 3}
    config.write_text(json.dumps({"data": {"train_files": ["never-read.jsonl"]}, "model": {
        "target": {"name_or_path": target, "dtype": "float32", **ids},
        "drafter": {"class_path": "lilicorr_pl.models.DFlashDrafter", "init_args": {"num_layers": 1, "block_size": 4}},
        "head": {"class_path": "lilicorr_pl.heads.LiLiCorrHead",
                 "init_args": {"top_k": 4, "hidden_size": 16, "num_layers": 1, "num_heads": 2, "factor_dim": 16}},
    }}))
    return config


def test_round_timing_measures_a_round_against_a_plain_step_at_the_configs_shapes(tmp_path, capsys):
    config = _timing_config(tmp_path, save_tiny_target(tmp_path / "target", layers=4), [1, 3])
    out = tmp_path / "rounds.json"
    result = cli_main(["perf", "--round-timing", "-c", str(config), "--context", "12", "--new-tokens", "6",
                       "--prompts", "2", "--tau", "3", "--json", str(out)])
    assert "plain decoding step" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["settings"]["weights"] == "random" and saved["settings"]["block_size"] == 4
    step = saved["plain_step_ms"]
    assert step > 0 and set(saved["arms"]) == {"top1", "lilicorr"}
    for arm in saved["arms"].values():  # every ratio is computed from the measured times of this run
        parts = arm["draft_ms"] + arm["head_ms"] + arm["verify_ms"] + arm["bookkeeping_ms"]
        assert arm["round_ms"] == pytest.approx(parts) and min(arm["draft_ms"], arm["verify_ms"]) > 0
        assert arm["round_cost_ratio"] == pytest.approx(arm["round_ms"] / step)
        assert arm["verify_cost_ratio"] == pytest.approx(arm["verify_ms"] / step)
        assert arm["speedup_at_tau"] == pytest.approx(3 / arm["round_cost_ratio"])
    assert result["plain_step_ms"] == pytest.approx(step)


def test_round_timing_takes_a_shape_that_does_not_exist_yet_and_refuses_bad_ones(tmp_path, capsys):
    target = save_tiny_target(tmp_path / "target", layers=4)
    config = _timing_config(tmp_path, target, [1, 3])
    base = ["perf", "--round-timing", "-c", str(config), "--new-tokens", "4", "--prompts", "1", "--context", "8"]
    result = cli_main([*base, "--target-overrides", '{"num_hidden_layers": 7, "hidden_size": 48, "head_dim": 12, '
                                                    '"intermediate_size": 96}', "--model.target.dtype", "bf16"])
    assert result["settings"]["target"].startswith("Qwen3 (7 layers, hidden 48, intermediate 96")
    assert result["settings"]["target_layer_ids"] == [2, 6]  # layers 1 and 3 of 4, scaled: the last stays the last
    assert result["settings"]["dtype"] == "bfloat16"  # the command line's --model.* overrides count
    # Without explicit ids, the default rule at the new depth (what a run on that target would read).
    deep, drafter, _ = load_round_modules([str(_timing_config(tmp_path, target))], None, {"num_hidden_layers": 36})
    assert drafter.target_layer_ids == default_layer_ids(36, 3)
    assert deep.layer_types == ["full_attention"] * 36  # the attention pattern, repeated to the new depth
    with pytest.raises(ValueError, match=r"do not stay 2 distinct layers at 1 \(\[0\]\); set model.target.layer_ids"):
        load_round_modules([str(config)], None, {"num_hidden_layers": 1})
    # A count beside the list that disagrees with it: refused as fit refuses it (it was ignored without a word).
    counted = json.loads(config.read_text())
    counted["model"]["target"]["num_features"] = 3
    (tmp_path / "counted.yaml").write_text(json.dumps(counted))
    with pytest.raises(UserInputError, match=r"model.target.num_features 3 disagrees with model.target.layer_ids"):
        load_round_modules([str(tmp_path / "counted.yaml")], None, {})
    assert "time at least 2" in user_error(capsys, [*base[:4], "--new-tokens", "1"])
    # tau is an acceptance length: 1 to the block size (4 here), the bonus included; the default 6 becomes the block.
    assert result["settings"]["tau"] == 4.0
    for command in (base, ["perf", "--cost-model", "-c", str(config)]):
        assert user_error(capsys, [*command, "--tau", "100"]).strip().endswith(
            "--tau 100 is not a possible acceptance length for a block of 4: a round commits 1 to 4 tokens (the bonus "
            "token included); use 1 <= --tau <= 4")
        assert "--tau 0.5 is not a possible acceptance length" in user_error(capsys, [*command, "--tau", "0.5"])
    assert "runs past the target's 512 positions; lower --context" in user_error(
        capsys, ["perf", "--cost-model", "-c", str(config), "--context", "510"])
    capsys.readouterr()
    assert cli_main(["perf", "--cost-model", "-c", str(config)])["settings"]["context"] == 508  # 512 - a block of 4
    # Round timing's default context (64) shrinks the same way: it refused the tiny config's 64-position target with
    # its own defaults, naming a --context the user never set.
    small = cli_main([*base[:4], "--new-tokens", "4", "--prompts", "1", "--target-overrides",
                      '{"max_position_embeddings": 40}'])
    assert small["settings"]["context"] == 40 - 4 - 4
    assert "no field 'hidden_sizes'" in user_error(capsys, [*base, "--target-overrides", '{"hidden_sizes": 8}'])
    for bad in ('{"num_hidden_layers": 0}', '{"hidden_size": -4}', '{"num_hidden_layers": 2.5}'):  # an IndexError / a
        err = user_error(capsys, [*base, "--target-overrides", bad])  # shape error deep in the cost model
        assert "--target_overrides: " in err and "must be a positive integer" in err, (bad, err)
    # A head count its key-value heads do not divide: the drafter's refusal said to fix model.drafter.init_args.
    err = user_error(capsys, [*base, "--target-overrides", '{"num_attention_heads": 3, "num_key_value_heads": 2}'])
    assert err.strip().endswith("--target_overrides: the target's num_attention_heads 3 is not a multiple of its "
                                "num_key_value_heads 2; override both to a shape a model can have"), err
    import lilicorr_pl.perf as perf

    built_on, real = [], perf.load_round_modules
    perf.load_round_modules = lambda *a, device="meta", **k: built_on.append(device) or real(*a, device=device, **k)
    try:
        assert "runs past the target's 512 positions; lower --context" in user_error(capsys, [*base[:-1], "510"])
    finally:
        perf.load_round_modules = real
    assert built_on == ["meta"]  # refused from the shapes alone, before anything was built where it runs
    assert ("--compile_mode reduce-overhead captures the heads in CUDA graphs, which need a CUDA device (--device "
            "cuda); on cpu use --compile_mode default") in user_error(
        capsys, [*base, "--compile", "true", "--compile-mode", "reduce-overhead"])
    assert "--compile and --compile_mode set how --round_timing runs the head; add --round_timing true" in user_error(
        capsys, ["perf", "--cost-model", "-c", str(config), "--compile", "true"])
    import lilicorr_pl.decoding.compiled as compiled

    modes, real_compile = [], compiled.compile_selectors
    compiled.compile_selectors = lambda selectors, mode=None: modes.append(mode) or selectors
    try:  # the mode asked for reaches the head's compilation
        result = cli_main([*base, "--compile", "true", "--compile-mode", "max-autotune-no-cudagraphs"])
    finally:
        compiled.compile_selectors = real_compile
    assert modes == ["max-autotune-no-cudagraphs"] and result["settings"]["compile_mode"] == modes[0]
    assert result["settings"]["compile_wrapper"] is None  # the stand-in compiled nothing: no wrapper is claimed
    assert "ask for one per run" in user_error(capsys, [*base, "--cost-model"])
    # --json is written at the end of every mode: a directory there is refused before anything is built.
    assert f"--json {tmp_path} is a directory; pass a file name" in user_error(capsys, [*base, "--json", str(tmp_path)])


def test_round_timing_builds_the_random_target_where_it_runs_in_the_runs_dtype(tmp_path, monkeypatch):
    """No float32 copy first: at 8B shapes that was 32 GB of host memory and minutes before a GPU timed anything."""
    from transformers import AutoModelForCausalLM

    built = []
    original = AutoModelForCausalLM.from_config

    def spy(config, **kwargs):
        model = original(config, **kwargs)
        built.append((kwargs.get("dtype"), {p.dtype for p in model.parameters()}))
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", spy)
    config = _timing_config(tmp_path, save_tiny_target(tmp_path / "target", layers=4), [1, 3])
    cli_main(["perf", "--round-timing", "-c", str(config), "--new-tokens", "2", "--prompts", "1", "--context", "8",
              "--model.target.dtype", "bf16"])
    assert built == [(torch.bfloat16, {torch.bfloat16})]
