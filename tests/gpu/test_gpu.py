"""CUDA checks, skipped without a GPU: ``python -m pytest tests/gpu -q`` on a GPU machine.

What runs only on a GPU and nowhere else in the suite: the drafter's compiled FlexAttention (training's
attention path on CUDA) against the dense SDPA masks, forward and backward; a ``bf16-mixed`` Trainer run;
``AcceptanceEval`` decoding on the device; and ``lilicorr bench --device cuda``. The target is a tiny random
Qwen3 with a real tokenizer, saved with ``save_pretrained`` and loaded through ``from_pretrained``
(``tests/helpers.py``); head_dim 16, the smallest FlexAttention's CUDA kernel takes.

``LILICORR_TEST_DEVICE=cpu`` runs the same checks on the CPU (eager FlexAttention, CPU autocast), to check the
tests themselves on a machine without a GPU; it proves nothing about CUDA.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

DEVICE = os.environ.get("LILICORR_TEST_DEVICE", "cuda")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: run `python -m pytest tests/gpu -q` on a GPU machine", allow_module_level=True)

import lilicorr_pl.models.dflash as dflash  # noqa: E402
from callbacks import AcceptanceEval  # noqa: E402
from helpers import TRAINING_TEXT, make_tiny_target_dir  # noqa: E402
from lilicorr_pl.cli import main as cli_main  # noqa: E402
from lilicorr_pl.data.datamodule import DraftDataModule  # noqa: E402
from lilicorr_pl.decoding.speculative import speculative_generate, target_generate  # noqa: E402
from lilicorr_pl.models import DFlashDrafter  # noqa: E402
from lilicorr_pl.system import DraftSystem  # noqa: E402
from lilicorr_pl.target import FrozenTarget  # noqa: E402

CUDA = DEVICE == "cuda"
BLOCK = 4
LAYER_IDS = [1, 3, 5]
MAX_NEW = 12


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|``: masking or position bugs give O(1), kernel rounding 1e-6 (fp32) to 1e-2 (bf16)."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> str:
    return make_tiny_target_dir(tmp_path_factory.mktemp("gpu"), tie=False, hidden=64)


@pytest.fixture(scope="module")
def target(target_dir) -> FrozenTarget:
    return FrozenTarget.from_pretrained(target_dir, layer_ids=LAYER_IDS, device=DEVICE)


def drafter_for(target: FrozenTarget, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    drafter = DFlashDrafter(num_layers=2, block_size=BLOCK).build(target.config, target.layer_ids)
    with torch.no_grad():  # non-trivial norms, so a norm applied in the wrong place changes the result
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return drafter.to(DEVICE)


# Two sequence lengths (two compiled shapes); padding anchors (position 0, no context) and adjacent blocks included.
CASES = [
    (30, [[3, 8, 20, 27], [1, 2, 15, 16]]),
    (45, [[0, 5, 40, 41], [7, 12, 13, 44]]),
]


@pytest.mark.parametrize("length, anchors", CASES, ids=["T30", "T45"])
def test_compiled_flex_attention_equals_dense_masks(target, length, anchors, monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setattr(dflash, "_compiled_flex", None)  # set again below only if this test compiled it
    drafter = drafter_for(target)
    assert drafter.dims.head_dim >= 16 and drafter.attention == "auto"
    x = torch.randint(0, len(target.tokenizer), (2, length), device=DEVICE)
    anchors = torch.tensor(anchors, device=DEVICE)
    feats = target(x).features

    def run(mode: str):
        drafter.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(CUDA):  # FlexAttention has no backward on the CPU
            out = drafter(feats, x, anchors, target.embed, target.lm_head, attention=mode)
        grads = {}
        if CUDA:
            out.slot_logits.float().logsumexp(-1).mean().backward()  # through the attention's backward too
            grads = {n: p.grad.clone() for n, p in drafter.named_parameters()}
        return out.slot_logits.detach(), out.slot_hidden.detach(), grads

    dense_logits, dense_hidden, dense_grads = run("sdpa")
    flex_logits, flex_hidden, flex_grads = run("flex")
    if CUDA:
        assert dflash._compiled_flex is not None  # the compiled kernel ran, not eager FlexAttention
    assert relative_error(flex_hidden, dense_hidden) < 1e-3
    assert relative_error(flex_logits, dense_logits) < 1e-3
    assert len(flex_grads) == len(dense_grads) == (len(list(drafter.parameters())) if CUDA else 0)
    for name, grad in dense_grads.items():
        assert relative_error(flex_grads[name], grad) < 5e-3, name
    # "auto" is the compiled flex path on CUDA.
    with torch.no_grad():
        auto = drafter(feats, x, anchors, target.embed, target.lm_head).slot_logits
    assert relative_error(auto, flex_logits if CUDA else dense_logits) < 1e-5

    # Under bf16 autocast (as in bf16-mixed training) both paths get bf16 q/k/v and still agree.
    with torch.autocast(DEVICE, dtype=torch.bfloat16), torch.no_grad():
        dense16 = drafter(feats, x, anchors, target.embed, target.lm_head, attention="sdpa").slot_logits
        flex16 = drafter(feats, x, anchors, target.embed, target.lm_head, attention="flex").slot_logits
    assert flex16.dtype == dense16.dtype == torch.bfloat16
    assert relative_error(flex16, dense16) < 3e-2
    assert relative_error(flex16, dense_logits) < 5e-2


# ------------------------------------------------------------------------------ one bf16-mixed run
def write_prompts(path: Path) -> str:
    lines = ["def add(a, b):\n", "The quick brown fox", "class Block:\n    def __init__(self"]
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in lines))
    return str(path)


@pytest.fixture(scope="module")
def run(tmp_path_factory, target_dir):
    """``lilicorr fit`` of four bf16-mixed steps on the device, AcceptanceEval every two steps, a last checkpoint."""
    torch._dynamo.reset()
    root = tmp_path_factory.mktemp("bf16")
    # Every record is longer than max_length (truncated to 64 tokens): one training shape, one compilation.
    records = [{"text": TRAINING_TEXT[i : i + 400]} for i in range(0, len(TRAINING_TEXT) - 400, 100)]
    data_file = root / "train.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in records))
    prompts = write_prompts(root / "prompts.jsonl")
    lattice_loss = {"weight": 0.25, "gamma": 4.0}
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "gpu" if CUDA else "cpu", "devices": 1, "precision": "bf16-mixed", "max_steps": 4,
            "val_check_interval": 2, "check_val_every_n_epoch": None, "limit_val_batches": 1,
            "num_sanity_val_steps": 0, "log_every_n_steps": 1, "enable_progress_bar": False,
            "enable_model_summary": False, "default_root_dir": str(root),
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(root / "csv")}},
            "callbacks": [
                {"class_path": "callbacks.ModelCheckpoint", "init_args": {"dirpath": str(root / "ckpt"), "save_last": True}},
                {"class_path": "callbacks.AcceptanceEval", "init_args": {
                    "every_n_train_steps": 2, "on_validation_end": False, "benchmark": prompts, "num_prompts": 2,
                    "max_new_tokens": MAX_NEW, "chat_template": False}},
            ],
        },
        "model": {
            "target": {"name_or_path": target_dir, "dtype": "float32", "layer_ids": LAYER_IDS},
            "drafter": {"class_path": "lilicorr_pl.models.DFlashDrafter",
                        "init_args": {"num_layers": 2, "block_size": BLOCK, "attention": "auto"}},
            # K = 64 of ~384 rows: the true token is in a random drafter's lattice often enough for the lattice
            # losses (hence the head) to get gradient from the first steps.
            "head": {"class_path": "lilicorr_pl.heads.LiLiCorrHead",
                     "init_args": {"top_k": 64, "hidden_size": 32, "num_layers": 1, "num_heads": 2, "factor_dim": 32}},
            "losses": [
                {"class_path": "lilicorr_pl.losses.DFlashCE", "init_args": {"weight": 1.0, "gamma": 4.0}},
                {"class_path": "lilicorr_pl.losses.OraclePrefixCE", "init_args": lattice_loss},
                {"class_path": "lilicorr_pl.losses.MarginHinge", "init_args": lattice_loss},
                {"class_path": "lilicorr_pl.losses.DistractorPenalty", "init_args": lattice_loss},
            ],
            "num_anchors": 8,
            "target_logits": "exact",  # candidate logits from the online target, on the device
        },
        "data": {"train_files": [str(data_file)], "val_fraction": 0.2, "max_length": 64, "batch_size": 2,
                 "logit_cache": False, "cache_dir": str(root / "cache"), "progress": False},
    }
    config_file = root / "config.yaml"
    config_file.write_text(json.dumps(config, indent=1))  # JSON is YAML

    # Seen while fitting: the weights at the start, and (device, autocast on?) of every drafter attention call
    # and of every FlexAttention call (training's attention path on CUDA).
    seen: dict[str, list] = {"start": [], "attention": [], "flex": []}
    flex, attention_forward, on_fit_start = dflash._flex_attention, dflash.DFlashAttention.forward, DraftSystem.on_fit_start

    def recording_flex(q, k, v, block_mask):
        seen["flex"].append((q.device.type, torch.is_autocast_enabled(q.device.type)))
        return flex(q, k, v, block_mask)

    def recording_attention(self, x, *args, **kwargs):
        seen["attention"].append((x.device.type, torch.is_autocast_enabled(x.device.type)))
        return attention_forward(self, x, *args, **kwargs)

    def recording_start(self):
        seen["start"].append({k: v.detach().cpu().clone() for k, v in self.state_dict().items()})
        return on_fit_start(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dflash, "_flex_attention", recording_flex)
        patch.setattr(dflash.DFlashAttention, "forward", recording_attention)
        patch.setattr(DraftSystem, "on_fit_start", recording_start)
        cli = cli_main(["fit", "-c", str(config_file)])
    system, trainer = cli.model, cli.trainer
    system.to(DEVICE)  # Lightning moves the module back to the CPU when fit ends
    (callback,) = [c for c in trainer.callbacks if isinstance(c, AcceptanceEval)]
    (before,) = seen["start"]
    data = DraftDataModule([str(data_file)], val_fraction=0.2, max_length=64, batch_size=2, logit_cache=False,
                           cache_dir=str(root / "cache"), target=system.target_spec, progress=False)
    data.prepare_data()
    data.setup("fit")
    return SimpleNamespace(system=system, trainer=trainer, callback=callback, data=data, before=before, seen=seen,
                           prompts=prompts, ckpt=root / "ckpt" / "last.ckpt")


def test_bf16_mixed_training_steps_on_the_device(run):
    system, trainer = run.system, run.trainer
    assert trainer.global_step == 4
    assert trainer.precision == "bf16-mixed" and trainer.strategy.root_device.type == DEVICE
    # Every drafter pass ran on the device: training's under bf16 autocast, AcceptanceEval's decoding without.
    assert set(run.seen["attention"]) == {(DEVICE, True), (DEVICE, False)}
    if CUDA:  # training's attention went through FlexAttention (compiled on CUDA), under autocast
        assert run.seen["flex"] and set(run.seen["flex"]) == {("cuda", True)}
    else:
        assert not run.seen["flex"]  # "auto" is dense SDPA off CUDA
    for key in ("train/loss", "train/dflash_ce", "train/oracle_prefix_ce", "train/distractor_penalty", "val/loss"):
        assert math.isfinite(trainer.callback_metrics[key].item()), key
    after = system.state_dict()
    assert set(after) == set(run.before)  # the target stays out of the state dict
    changed = [k for k in after if not torch.equal(after[k].cpu(), run.before[k])]
    # Mixed precision keeps fp32 master weights, and both drafter and head are trained.
    assert all(after[k].dtype == torch.float32 for k in after if after[k].is_floating_point())
    assert any(k.startswith("drafter.layers.") for k in changed) and any(k.startswith("head.") for k in changed)
    assert not any(p.requires_grad for p in system.target.parameters())


def test_bf16_autocast_step_agrees_with_fp32(run):
    """One teacher-forced step under bf16 autocast gives the fp32 loss to bf16 accuracy, with finite gradients."""
    system = run.system
    batch = next(iter(run.data.val_dataloader()))
    batch = {k: v.to(system.device) if torch.is_tensor(v) else v for k, v in batch.items()}
    system.train()
    outs = {}
    for name, autocast in (("fp32", False), ("bf16", True)):
        system.zero_grad(set_to_none=True)
        with pytest.MonkeyPatch.context() as patch, torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            patch.setattr(system, "num_anchors", 48)  # 96 blocks: some true tokens are surely in the lattice
            out = system.compute_step(batch, generator=torch.Generator().manual_seed(3))
        out["loss"].backward()
        outs[name] = out
        grads = {n: p.grad for n, p in system.named_parameters() if p.requires_grad and p.grad is not None}
        assert all(torch.isfinite(g).all() for g in grads.values()), name
        assert any(n.startswith("drafter.") for n in grads) and any(n.startswith("head.") for n in grads), name
    fp32, bf16 = outs["fp32"], outs["bf16"]
    assert bf16["slot_logits"].dtype == torch.bfloat16 and fp32["slot_logits"].dtype == torch.float32
    assert bf16["loss"].item() == pytest.approx(fp32["loss"].item(), rel=5e-2)
    for key in ("dflash_ce", "oracle_prefix_ce", "distractor_penalty"):
        assert bf16["logs"][key].item() == pytest.approx(fp32["logs"][key].item(), rel=5e-2, abs=1e-3), key
    # Lattice scores are computed in fp32 even under autocast (|score| <= σ = 8); the same candidates are kept.
    a, b = fp32["lattice"], bf16["lattice"]
    assert b.pair.dtype == torch.float32 and b.pair.abs().max() <= 8.0
    # Compare the scores of candidate pairs that are the same token pair at the same ranks in both runs.
    same = ((a.candidates[:, :-1, :, None] == b.candidates[:, :-1, :, None])
            & (a.candidates[:, 1:, None, :] == b.candidates[:, 1:, None, :]))  # [M, S-1, K, K]
    # (CPU bf16: 62 % of pairs shared, mean |difference| 0.03, max 0.2, against a mean |score| of 0.95.)
    diff = (a.pair - b.pair)[same].abs()
    assert same.float().mean() > 0.3 and diff.mean() < 0.1 and diff.max() < 1.0


def test_acceptance_eval_decodes_on_the_device(run):
    system, callback = run.system, run.callback
    assert [step for step, _ in callback.history] == [2, 4]
    tau = run.trainer.callback_metrics["eval/tau"].item()
    assert 1.0 <= tau <= BLOCK and tau == pytest.approx(callback.history[-1][1]["eval/tau"])
    target = system.target
    prompts = callback.prompt_set(system)
    results = callback.decode(system)
    rounds = []
    for ids in prompts.input_ids:
        spec = speculative_generate(target, system.drafter, system.head, ids, MAX_NEW)
        plain = target_generate(target, ids, MAX_NEW)
        assert spec.tokens == plain.tokens  # lossless at T = 0 on the device
        rounds += spec.accepted_lengths
    assert results["head"].tau == pytest.approx(1 + sum(rounds) / len(rounds))
    assert results["head"].histogram == torch.bincount(torch.tensor(rounds), minlength=BLOCK).tolist()


def test_lilicorr_bench_on_the_device(run, tmp_path):
    out = tmp_path / "bench.json"
    cli_main(["bench", "--ckpt", str(run.ckpt), "--benchmark", run.prompts, "--num-prompts", "2",
              "--max-new-tokens", "16", "--temperature", "0", "1", "--selectors", "top1,lilicorr",
              "--chat-template", "no", "--device", DEVICE, "--output", str(out)])
    runs = json.loads(out.read_text())["runs"]
    assert [r["temperature"] for r in runs] == [0.0, 1.0]
    for r in runs:
        assert r["phase_timing"] == ("cuda_events" if CUDA else "host_clock")  # device times, not launch times
        assert r["target_tokens_per_s"] > 0
        for name, s in r["selectors"].items():
            assert 1.0 <= s["tau"] <= BLOCK, name
            assert s["lossless"] is (True if r["temperature"] == 0 else None), name
            split = [s[k] for k in ("draft_ms", "head_ms", "verify_ms", "bookkeeping_ms")]
            assert all(x > 0 for x in split) and sum(split) == pytest.approx(s["round_ms"], rel=1e-9), name
            assert 0.0 < s["head_time_fraction"] < 1.0


# ------------------------------------------------------------------------------ the head inside CUDA graphs
@pytest.mark.skipif(not CUDA, reason="CUDA graphs are a CUDA feature")
def test_cuda_graph_head_drafts_as_eager_mode_and_keeps_every_rounds_selection(run):
    """``CompiledSelector(mode="reduce-overhead")``: Inductor's graph captured in a CUDA graph (no skip), the same
    drafts as eager mode round after round, and a selection kept from an earlier round unchanged by later replays
    (they write the graph's memory pool again)."""
    from lilicorr_pl.decoding.compiled import CompiledSelector
    from lilicorr_pl.heads.base import SelectContext
    from lilicorr_pl.models.dflash import DraftOutput

    system = run.system.eval()
    target, head = system.target, system.head
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    graphs = CompiledSelector(head, "reduce-overhead")
    hidden, vocab, slots = target.config.hidden_size, target.config.vocab_size, BLOCK - 1
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def draft() -> DraftOutput:
        return DraftOutput(slot_hidden=torch.randn(1, slots, hidden, device=DEVICE, generator=g),
                           slot_logits=4 * torch.randn(1, slots, vocab, device=DEVICE, generator=g),
                           anchor_feature=torch.randn(1, hidden, device=DEVICE, generator=g),
                           anchor_feature_valid=torch.ones(1, dtype=torch.bool, device=DEVICE))

    kept = []
    with torch.no_grad():
        for r in range(6):  # warm-up, recording, then replays
            out = draft()
            context = SelectContext(torch.tensor([r + 3], device=DEVICE), torch.tensor([9 + r], device=DEVICE),
                                    target.embed)
            eager, captured = head.select(out, context), graphs.select(out, context)
            assert torch.equal(eager.tokens, captured.tokens)
            assert torch.equal(eager.lattice.candidates, captured.lattice.candidates)
            assert torch.allclose(eager.lattice.pair, captured.lattice.pair, rtol=1e-4, atol=1e-4)  # fused rounding
            kept.append((captured, captured.tokens.clone(), captured.lattice.pair.clone()))
        for captured, tokens, pair in kept:  # every earlier round's selection survived the later replays
            assert torch.equal(captured.tokens, tokens) and torch.equal(captured.lattice.pair, pair)
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0
    # Whole generations: the same tokens and accepted lengths as the eager head (lossless, T = 0).
    prompts = run.callback.prompt_set(system)
    for ids in prompts.input_ids:
        with torch.no_grad():
            a = speculative_generate(target, system.drafter, head, ids, MAX_NEW)
            b = speculative_generate(target, system.drafter, graphs, ids, MAX_NEW)
        assert a.tokens == b.tokens and a.accepted_lengths == b.accepted_lengths
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0


@pytest.mark.skipif(not CUDA, reason="CUDA graphs are a CUDA feature")
def test_bench_with_heads_in_cuda_graphs_decodes_what_eager_mode_decodes(run, tmp_path):
    args = ["bench", "--ckpt", str(run.ckpt), "--benchmark", run.prompts, "--num-prompts", "2",
            "--max-new-tokens", "16", "--temperature", "0", "--selectors", "top1,lilicorr", "--chat-template", "no", "--device", DEVICE]
    (eager,) = cli_main(args)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    (graphs,) = cli_main([*args, "--compile", "true", "--compile-mode", "reduce-overhead"])
    assert graphs["compile_mode"] == "reduce-overhead" and eager["compile_mode"] is None
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0
    for name in ("top1", "lilicorr"):
        assert graphs["selectors"][name]["lossless"] is True
        assert graphs["selectors"][name]["histogram"] == eager["selectors"][name]["histogram"], name
