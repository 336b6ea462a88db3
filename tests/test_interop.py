"""Serving checkpoint layouts: z-lab ``DFlashDraftModel`` and ``LiLiCorrDraftModel`` (drafter + head).

Exact keys, shapes and config fields against hand-written fixtures; export -> import gives identical
logits, lattice scores and speculative drafts; a loader written here from the layout alone (plain torch
and safetensors) rebuilds the head's scores, so the export is self-sufficient.
"""

from __future__ import annotations

import contextlib

import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import save_tiny_target
from lilicorr_pl.decoding import speculative_generate
from lilicorr_pl.heads import LiLiCorrHead
from lilicorr_pl.interop import export_drafter, load_drafter, load_head
from lilicorr_pl.models.dflash import DFlashDrafter


ROOT = Path(__file__).resolve().parents[1]


def expected_layout(layers: int, h: int, ffn: int, q_heads: int, kv_heads: int, d: int, n_feat: int) -> dict:
    """The public DFlash checkpoint layout, written out by hand (DESIGN §3.4)."""
    keys = {
        "fc.weight": (h, n_feat * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(layers):
        p = f"layers.{i}."
        keys.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_heads * d, h),
            p + "self_attn.k_proj.weight": (kv_heads * d, h),
            p + "self_attn.v_proj.weight": (kv_heads * d, h),
            p + "self_attn.o_proj.weight": (h, q_heads * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (ffn, h),
            p + "mlp.up_proj.weight": (ffn, h),
            p + "mlp.down_proj.weight": (h, ffn),
        })
    return keys


def test_export_matches_the_zlab_layout(tiny_target, tmp_path):
    drafter = DFlashDrafter(num_layers=2, block_size=4).build(tiny_target.config, tiny_target.layer_ids)
    out = export_drafter(drafter, tmp_path / "export")
    files = sorted(p.name for p in out.iterdir())
    assert files == ["config.json", "model.safetensors"]
    state = load_file(str(out / "model.safetensors"))
    expect = expected_layout(2, 32, 64, 4, 2, 8, 3)
    assert {k: tuple(v.shape) for k, v in state.items()} == expect
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 4 and cfg["num_target_layers"] == 6
    # causal: false as Model-Optimizer's exporter writes it (vLLM reads it as every layer's attention).
    assert cfg["dflash_config"] == {"mask_token_id": 95, "target_layer_ids": [1, 2, 3], "causal": False}
    for key, value in {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 512, "vocab_size": 96,
        "tie_word_embeddings": tiny_target.config.tie_word_embeddings,
        "attention_bias": False, "attention_dropout": 0.0, "layer_types": ["full_attention"] * 2,
        "initializer_range": tiny_target.config.initializer_range, "torch_dtype": "float32",
    }.items():
        assert cfg[key] == value, key


def expected_lilicorr_layout(model_h: int, h: int, layers: int, heads: int, mlp: int, factor: int, block: int,
                             k: int) -> dict:
    """The head's tensors in a ``LiLiCorrDraftModel`` ``model.safetensors``, written out by hand from the
    engines' loaders (SGLang / vLLM / TensorRT-LLM ``lilicorr``): named MLP form, packed attention."""
    keys: dict = {}

    def linear(name, n_in, n_out):
        keys[f"lilicorr.{name}.weight"] = (n_out, n_in)
        keys[f"lilicorr.{name}.bias"] = (n_out,)

    if h != model_h:
        linear("token_proj", model_h, h)
    linear("pass_hidden_proj", model_h, h)
    linear("context_proj", model_h, h)
    keys["lilicorr.feature_norm.weight"] = keys["lilicorr.feature_norm.bias"] = (5,)
    linear("feature_mlp.up_proj", 5, h)
    linear("feature_mlp.down_proj", h, h)
    keys["lilicorr.slot_embedding"] = (1, 1, block - 1, 1, h)
    keys["lilicorr.rank_embedding"] = (1, 1, 1, k, h)
    keys["lilicorr.relative_slot_bias"] = (heads, 2 * block - 1)
    keys["lilicorr.same_slot_bias"] = (heads,)
    for i in range(layers):
        p = f"layers.{i}."
        keys[f"lilicorr.{p}attn_norm.weight"] = keys[f"lilicorr.{p}mlp_norm.weight"] = (h,)
        keys[f"lilicorr.{p}attn.in_proj_weight"] = (3 * h, h)
        keys[f"lilicorr.{p}attn.in_proj_bias"] = (3 * h,)
        linear(p + "attn.out_proj", h, h)
        linear(p + "mlp.up_proj", h, mlp)
        linear(p + "mlp.down_proj", mlp, h)
    keys["lilicorr.output_norm.weight"] = keys["lilicorr.anchor_norm.weight"] = (h,)
    linear("factor_input_proj", 3 * h, h)
    for name in ("out_head", "in_head", "anchor_out_head"):
        linear(name, h, factor)
    return keys


def trained_like(head: LiLiCorrHead, seed: int = 0) -> LiLiCorrHead:
    """Random values in every parameter (the init zeroes biases and embeddings), as after training."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.3 * noise)
    return head


def make_pair(target, head_width: int = 16, block_size: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    drafter = DFlashDrafter(num_layers=2, block_size=block_size).build(target.config, target.layer_ids)
    head = LiLiCorrHead(top_k=4, hidden_size=head_width, num_layers=2, num_heads=2, mlp_ratio=1.5, factor_dim=6,
                        vector_eps=1e-5, logit_scale=5.0)
    head.build(target.hidden_size, target.output_rows, block_size=block_size, rms_norm_eps=drafter.dims.rms_norm_eps)
    return drafter, trained_like(head, seed).eval()


@pytest.mark.parametrize("head_width", [16, 32], ids=["narrow-head", "drafter-width-head"])
def test_lilicorr_export_is_the_served_layout(tiny_target, tmp_path, head_width):
    drafter, head = make_pair(tiny_target, head_width)
    out = export_drafter(drafter, tmp_path / "export", head=head)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]  # no companion files
    state = load_file(str(out / "model.safetensors"))
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    head_keys = {k: v for k, v in shapes.items() if k.startswith("lilicorr.")}
    assert {k: v for k, v in shapes.items() if k not in head_keys} == expected_layout(2, 32, 64, 4, 2, 8, 3)
    mlp = int(head_width * 1.5)
    assert head_keys == expected_lilicorr_layout(32, head_width, 2, 2, mlp, 6, 4, 4)
    assert ("lilicorr.token_proj.weight" in head_keys) == (head_width != 32)
    assert {v.dtype for v in state.values()} == {torch.float32}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LiLiCorrDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 4 and cfg["hidden_size"] == 32 and cfg["rms_norm_eps"] == 1e-6
    assert cfg["dflash_config"] == {
        "mask_token_id": 95, "target_layer_ids": [1, 2, 3], "causal": False, "projector_type": "lilicorr",
        "lilicorr_enabled": True, "lilicorr_candidate_topk": 4, "lilicorr_hidden_size": head_width,
        "lilicorr_num_layers": 2, "lilicorr_num_heads": 2, "lilicorr_mlp_ratio": 1.5, "lilicorr_factor_dim": 6,
        "lilicorr_vector_eps": 1e-5, "lilicorr_logit_scale": 5.0,
    }


def test_export_in_model_optimizers_indexed_mlp_names_and_another_dtype(tiny_target, tmp_path):
    drafter, head = make_pair(tiny_target, 16)
    named = load_file(str(export_drafter(drafter, tmp_path / "named", head=head) / "model.safetensors"))
    out = export_drafter(drafter, tmp_path / "indexed", head=head, dtype=torch.bfloat16, head_mlp_names="sequential")
    indexed = load_file(str(out / "model.safetensors"))
    # Model-Optimizer's nn.Sequential spelling, written out by hand: the LayerNorm is feature_mlp.0, the linears
    # feature_mlp.1 / .3 and layers.<i>.mlp.0 / .2; every other tensor keeps its name.
    spelled = {"lilicorr.feature_norm.": "lilicorr.feature_mlp.0.", "lilicorr.feature_mlp.up_proj.": "lilicorr.feature_mlp.1.",
               "lilicorr.feature_mlp.down_proj.": "lilicorr.feature_mlp.3."}
    for i in range(2):
        spelled.update({f"lilicorr.layers.{i}.mlp.up_proj.": f"lilicorr.layers.{i}.mlp.0.",
                        f"lilicorr.layers.{i}.mlp.down_proj.": f"lilicorr.layers.{i}.mlp.2."})

    def by_hand(key: str) -> str:
        for named_prefix, indexed_prefix in spelled.items():
            if key.startswith(named_prefix):
                return indexed_prefix + key[len(named_prefix):]
        return key

    assert set(indexed) == {by_hand(k) for k in named} and set(indexed) != set(named)
    assert all(torch.equal(named[k].to(torch.bfloat16), indexed[by_hand(k)]) for k in named)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    # Read back (the import takes both spellings): the same head, in bf16.
    back = load_head(out)
    assert all(torch.equal(v.to(torch.bfloat16), back.state_dict()[k]) for k, v in head.state_dict().items())
    assert load_drafter(out).fc.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="head_mlp_names 'indexed'"):
        export_drafter(drafter, tmp_path / "never", head=head, head_mlp_names="indexed")
    assert not (tmp_path / "never").exists()


def test_export_refuses_a_head_that_does_not_fit_the_drafter(tiny_target, tmp_path):
    from lilicorr_pl.heads import DominoHead
    from lilicorr_pl.interop import ExportError

    drafter, _ = make_pair(tiny_target, block_size=4)
    _, other = make_pair(tiny_target, block_size=5)
    with pytest.raises(ExportError, match="block_size 5 vs the drafter's 4"):
        export_drafter(drafter, tmp_path / "a", head=other)
    with pytest.raises(ExportError, match="DominoHead has no serving checkpoint layout"):
        export_drafter(drafter, tmp_path / "b", head=DominoHead(gru_hidden=4, rank=4).build(32, 96))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before writing


def test_export_then_import_gives_identical_logits_scores_and_drafts(tiny_target, tmp_path):
    drafter, head = make_pair(tiny_target)
    out = export_drafter(drafter, tmp_path / "export", head=head)
    loaded, head2 = load_drafter(out), load_head(out)
    assert isinstance(head2, LiLiCorrHead)
    x = torch.randint(0, 90, (1, 16))
    feats = tiny_target(x).features
    anchors = torch.tensor([[3, 9]])
    a = drafter(feats, x, anchors, tiny_target.embed, tiny_target.lm_head)
    b = loaded(feats, x, anchors, tiny_target.embed, tiny_target.lm_head)
    assert torch.equal(a.slot_logits, b.slot_logits)
    emb = tiny_target.embed
    with torch.no_grad():
        la = head.score_lattice(a.slot_hidden[0], a.slot_logits[0], a.anchor_feature[0], a.anchor_feature_valid[0], emb)
        lb = head2.score_lattice(b.slot_hidden[0], b.slot_logits[0], b.anchor_feature[0], b.anchor_feature_valid[0], emb)
    assert torch.equal(la.candidates, lb.candidates)
    assert torch.equal(la.start, lb.start) and torch.equal(la.pair, lb.pair)
    # Real speculative decoding: the same drafts, round by round, and the same output.
    g = torch.Generator().manual_seed(5)
    for prompt in (torch.randint(2, 90, (n,), generator=g).tolist() for n in (3, 9)):
        ours = speculative_generate(tiny_target, drafter, head, prompt, 14, stop_token_ids=[], record_rounds=99)
        served = speculative_generate(tiny_target, loaded, head2, prompt, 14, stop_token_ids=[], record_rounds=99)
        assert served.tokens == ours.tokens and served.accepted_lengths == ours.accepted_lengths
        assert [r["drafted"] for r in served.rounds] == [r["drafted"] for r in ours.rounds]


def served_scores(directory, slot_hidden, slot_logits, anchor, anchor_valid, embedding_table):
    """Start and pair scores of one block from ``config.json`` + ``model.safetensors`` alone.

    Written from the layout, with plain torch (float64) and no project code: what a serving engine does.
    """
    cfg = json.loads((directory / "config.json").read_text())
    dc = cfg["dflash_config"]
    w = {k[len("lilicorr."):]: v.double() for k, v in load_file(str(directory / "model.safetensors")).items()
         if k.startswith("lilicorr.")}
    block, k_top, heads = cfg["block_size"], dc["lilicorr_candidate_topk"], dc["lilicorr_num_heads"]
    rms_eps, vec_eps, sigma = cfg["rms_norm_eps"], dc["lilicorr_vector_eps"], dc["lilicorr_logit_scale"]

    def lin(name, x):
        return x @ w[name + ".weight"].T + w[name + ".bias"]

    def rms(name, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + rms_eps) * w[name + ".weight"]

    def unit(v):
        return v / v.norm(dim=-1, keepdim=True).clamp_min(vec_eps)

    slot_hidden, anchor = slot_hidden.double(), anchor.double()
    log_probs = slot_logits.double().log_softmax(-1)  # full vocabulary
    lp, cand = log_probs.topk(k_top, dim=-1)  # [S, K]
    n_slots = lp.shape[0]
    rank = torch.arange(k_top, dtype=torch.float64)
    feats = torch.stack([lp, lp.exp(), lp - lp.max(-1, keepdim=True).values,
                         (rank / (k_top - 1)).expand_as(lp), (rank == 0).double().expand_as(lp)], -1)
    feats = F.layer_norm(feats, (5,), w["feature_norm.weight"], w["feature_norm.bias"], eps=1e-5)
    emb = embedding_table.double()[cand]  # [S, K, H]
    x = lin("token_proj", emb) if "token_proj.weight" in w else emb
    x = x + lin("pass_hidden_proj", slot_hidden)[:, None]
    x = x + lin("feature_mlp.down_proj", F.silu(lin("feature_mlp.up_proj", feats)))
    x = x + w["slot_embedding"][0, 0, :n_slots] + w["rank_embedding"][0, 0, 0]
    width = x.shape[-1]
    x = x.reshape(n_slots * k_top, width)
    slot = torch.arange(n_slots).repeat_interleave(k_top)
    rel = slot[:, None] - slot[None, :]
    bias = w["relative_slot_bias"][:, rel + block - 1] + w["same_slot_bias"][:, None, None] * (rel == 0)
    d_head = width // heads
    for i in range(dc["lilicorr_num_layers"]):
        p = f"layers.{i}."
        qkv = rms(p + "attn_norm", x) @ w[p + "attn.in_proj_weight"].T + w[p + "attn.in_proj_bias"]
        q, kk, v = (t.reshape(-1, heads, d_head).transpose(0, 1) for t in qkv.chunk(3, -1))
        attn = torch.softmax(q @ kk.transpose(-1, -2) / math.sqrt(d_head) + bias, -1) @ v
        x = x + lin(p + "attn.out_proj", attn.transpose(0, 1).reshape(-1, width))
        x = x + lin(p + "mlp.down_proj", F.silu(lin(p + "mlp.up_proj", rms(p + "mlp_norm", x))))
    h = rms("output_norm", x).reshape(n_slots, k_top, width)
    a = rms("anchor_norm", lin("context_proj", anchor) * float(anchor_valid))
    z = F.silu(lin("factor_input_proj", torch.cat([h, a.expand_as(h), h * a], -1)))
    out_vec, in_vec, u = unit(lin("out_head", z)), unit(lin("in_head", z)), unit(lin("anchor_out_head", a))
    return cand, sigma * in_vec[0] @ u, sigma * out_vec[:-1] @ in_vec[1:].transpose(-1, -2)


@pytest.mark.parametrize("head_width", [16, 32], ids=["narrow-head", "drafter-width-head"])
def test_a_loader_written_from_the_layout_alone_rebuilds_the_scores(tiny_target, tmp_path, head_width):
    drafter, head = make_pair(tiny_target, head_width, block_size=5, seed=3)
    out = export_drafter(drafter, tmp_path / "export", head=head)
    x = torch.randint(0, 90, (1, 20), generator=torch.Generator().manual_seed(1))
    anchors = torch.tensor([[0, 7]])  # block 0 has no anchor feature, block 1 has one
    with torch.no_grad():
        d = drafter(tiny_target(x).features, x, anchors, tiny_target.embed, tiny_target.lm_head)
        lattice = head.score_lattice(d.slot_hidden[0], d.slot_logits[0], d.anchor_feature[0],
                                     d.anchor_feature_valid[0], tiny_target.embed)
    table = tiny_target.embed(torch.arange(tiny_target.output_rows))  # the target's own embedding table
    assert d.anchor_feature_valid[0].tolist() == [False, True]
    for block in range(2):
        cand, start, pair = served_scores(out, d.slot_hidden[0, block], d.slot_logits[0, block],
                                          d.anchor_feature[0, block], d.anchor_feature_valid[0, block], table)
        assert torch.equal(cand, lattice.candidates[block])
        torch.testing.assert_close(lattice.start[block].double(), start, atol=1e-5, rtol=0)
        torch.testing.assert_close(lattice.pair[block].double(), pair, atol=1e-5, rtol=0)
        assert pair.abs().max() > 0.5  # a real function of the weights, not a trivial zero


def test_a_dflash_only_directory_has_no_head(tiny_target, tmp_path):
    drafter = DFlashDrafter(num_layers=1, block_size=4).build(tiny_target.config, tiny_target.layer_ids)
    assert load_head(export_drafter(drafter, tmp_path / "export")) is None


def test_old_companion_exports_get_a_clear_error(tiny_target, tmp_path):
    drafter, head = make_pair(tiny_target)
    out = export_drafter(drafter, tmp_path / "old")
    (out / "lilicorr_head.json").write_text("{}")
    (out / "lilicorr_head.safetensors").write_bytes(b"")
    for load in (load_drafter, load_head):
        with pytest.raises(ValueError, match="no longer supported; re-export the training checkpoint") as err:
            load(out)
        assert "\n" not in str(err.value) and "lilicorr export --ckpt" in str(err.value)


def test_import_accepts_block_size_inside_dflash_config(tiny_target, tmp_path):
    drafter = DFlashDrafter(num_layers=1, block_size=6).build(tiny_target.config, tiny_target.layer_ids)
    out = export_drafter(drafter, tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    cfg["dflash_config"]["block_size"] = cfg.pop("block_size")
    (out / "config.json").write_text(json.dumps(cfg))
    assert load_drafter(out).block_size == 6
    with pytest.raises(FileNotFoundError, match="not a DFlash drafter directory"):
        load_drafter(tmp_path / "nothing")


def test_export_never_deletes_what_it_did_not_write(tiny_target, tmp_path):
    """Issue 11.1: `export --output DIR` used to rmtree DIR. A non-empty DIR is refused; --overwrite
    replaces only the exported files and keeps everything else (a checkpoint, a user's notes)."""
    from lilicorr_pl.interop import ExportError

    drafter = DFlashDrafter(num_layers=1, block_size=4).build(tiny_target.config, tiny_target.layer_ids)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    (out / "last.ckpt").write_bytes(b"precious")
    with pytest.raises(ExportError, match="not empty.*--overwrite"):
        export_drafter(drafter, out)
    assert sorted(p.name for p in out.iterdir()) == ["last.ckpt", "notes.txt"]
    # Another model's files are never replaced: a target's folder (its config and weights), or files of unknown origin.
    (out / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    with pytest.raises(ExportError, match=r"holds a model of architectures \['Qwen3ForCausalLM'\].*--overwrite "
                                          "replaces only an earlier lilicorr export's"):
        export_drafter(drafter, out, overwrite=True)
    # ... nor a released drafter's (the same architecture, no export's marker).
    (out / "config.json").write_text('{"architectures": ["DFlashDraftModel"], "block_size": 16}')
    with pytest.raises(ExportError, match=r"holds a model of architectures \['DFlashDraftModel'\]"):
        export_drafter(drafter, out, overwrite=True)
    (out / "config.json").unlink()
    (out / "model.safetensors").write_bytes(b"someone's weights")
    with pytest.raises(ExportError, match="holds files no export wrote"):
        export_drafter(drafter, out, overwrite=True)
    assert (out / "model.safetensors").read_bytes() == b"someone's weights"
    (out / "model.safetensors").unlink()
    # A stale config of a previous export: replaced, not merged.
    (out / "config.json").write_text('{"architectures": ["LiLiCorrDraftModel"], "block_size": 99, '
                                     '"lilicorr_pl": {"version": "0.1.0"}}')
    export_drafter(drafter, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "last.ckpt", "model.safetensors", "notes.txt"]
    assert (out / "notes.txt").read_text() == "keep me" and (out / "last.ckpt").read_bytes() == b"precious"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    # Exported files get the mode any new file gets there, like any model directory (safetensors writes 0600).
    assert (out / "model.safetensors").stat().st_mode & 0o044 == 0o044
    umask = os.umask(0o027)
    try:
        export_drafter(drafter, out, overwrite=True)
    finally:
        os.umask(umask)
    assert [(out / n).stat().st_mode & 0o777 for n in ("config.json", "model.safetensors")] == [0o640, 0o640]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "last.ckpt", "model.safetensors", "notes.txt"]
    with pytest.raises(ExportError, match="is a file"):
        export_drafter(drafter, out / "notes.txt")


def test_a_killed_exports_folder_is_removed_and_does_not_block_its_retry(tiny_target, tmp_path, monkeypatch):
    """A SIGKILL during an export left its temporary folder in the destination for good, and the retry into that new
    folder was refused as "not empty"; a killed writer's folder is now removed first. A live export's folder (tagged
    with its writer, so a concurrent export never takes it for a killed one's) still makes the folder busy."""
    import socket
    from pathlib import Path

    from lilicorr_pl import files, interop
    from lilicorr_pl.interop import ExportError

    drafter = DFlashDrafter(num_layers=1, block_size=4).build(tiny_target.config, tiny_target.layer_ids)
    out = tmp_path / "new"
    killed = out / f".lilicorr-export.ab12cd34.w@{socket.gethostname()}@{2 ** 22 + 12345}@1a2b3c4d.tmp"
    killed.mkdir(parents=True)
    (killed / "model.safetensors").write_bytes(b"half")
    during = []
    save_file = interop.save_file

    def watched(state, path, **kwargs):
        folder = Path(path).parent
        during.append((folder.name, files.writer_is_gone(folder), sorted(p.name for p in out.iterdir())))
        return save_file(state, path, **kwargs)

    monkeypatch.setattr(interop, "save_file", watched)
    export_drafter(drafter, out)  # no --overwrite: nothing of the user's is there
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    ((name, gone, listing),) = during
    assert name.startswith(".lilicorr-export.") and not gone and listing == [name]
    live = tmp_path / "busy" / f".lilicorr-export.ef56gh78.{files.writer_tag()}.tmp"
    live.mkdir(parents=True)
    with pytest.raises(ExportError, match="not empty"):
        export_drafter(drafter, live.parent)
    assert live.is_dir()


def test_an_overwrite_stopped_between_its_renames_or_a_damaged_export_is_refused_by_the_loaders(tiny_target, tmp_path,
                                                                                                 monkeypatch):
    """An export renames config.json, then model.safetensors, into place: a kill between the two left the new config
    beside the old weights (another dtype here), which bench then measured without a word. Both files now carry one
    export's id. A truncated weights file or a config that is not an object: one line, not a traceback."""
    import os

    from lilicorr_pl import interop
    from lilicorr_pl.interop import read_weights

    drafter = DFlashDrafter(num_layers=1, block_size=4).build(tiny_target.config, tiny_target.layer_ids)
    out = export_drafter(drafter, tmp_path / "mix", dtype=torch.bfloat16)
    assert load_drafter(out).fc.weight.dtype == torch.bfloat16
    replace = os.replace

    def killed_after_the_config(src, dst):
        replace(src, dst)
        if str(dst).endswith("config.json"):
            raise KeyboardInterrupt  # stands in for the SIGKILL: the second rename never happens

    monkeypatch.setattr(interop.os, "replace", killed_after_the_config)
    with pytest.raises(KeyboardInterrupt):
        export_drafter(drafter, out, overwrite=True, dtype=torch.float32)
    monkeypatch.setattr(interop.os, "replace", replace)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"  # the new config, old weights
    with pytest.raises(ValueError, match=r"mix: config.json and model.safetensors come from two different exports "
                                         r"\(ids [0-9a-f]{32} and [0-9a-f]{32}: .*export it again"):
        load_drafter(out)
    export_drafter(drafter, out, overwrite=True, dtype=torch.float32)  # the export again: whole, and read
    assert load_drafter(out).fc.weight.dtype == torch.float32 and read_weights(out)
    # Weights re-saved by another tool (a cast, a save_pretrained) carry no id: read as they are, not refused.
    from safetensors.torch import save_file

    recast = {k: v.to(torch.float16) for k, v in load_file(str(out / "model.safetensors")).items()}
    save_file(recast, str(out / "model.safetensors"), metadata={"format": "pt"})
    assert load_drafter(out).fc.weight.dtype == torch.float16
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"model.safetensors cannot be read as safetensors \(.*\); is it truncated\? "
                                         r"re-export it"):
        load_drafter(out)
    (out / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json holds a JSON list, not a model config; re-export it"):
        load_drafter(out)


def test_export_cli_refuses_the_checkpoint_folder_before_loading(tmp_path, capsys):
    from lilicorr_pl.cli import main

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    ckpt = folder / "last.ckpt"
    ckpt.write_bytes(b"not read: the destination is refused first")
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--ckpt", str(ckpt), "--output", str(folder)])
    assert exit_info.value.code == 2 and "not empty" in capsys.readouterr().err
    assert ckpt.read_bytes().startswith(b"not read")


# ---------------------------------------------------------------------------- warm start in the system


def _system(target_dir, head=True, **kw):
    from lilicorr_pl.system import DraftSystem
    from lilicorr_pl.target import TargetSpec

    torch.manual_seed(kw.pop("seed", 7))
    head = (LiLiCorrHead(top_k=4, hidden_size=16, num_layers=2, num_heads=2, mlp_ratio=1.5, factor_dim=6,
                         vector_eps=1e-5, logit_scale=5.0) if head else None)
    return DraftSystem(TargetSpec(name_or_path=str(target_dir), layer_ids=[1, 2, 3]),
                       DFlashDrafter(num_layers=2, block_size=4), head=head, **kw)


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_warm_start_drafter_and_head_drafter_only_or_head_only(tmp_path):
    target_dir = save_tiny_target(tmp_path / "target")
    trained = _system(target_dir, seed=1)
    trained_like(trained.head, seed=2)
    out = export_drafter(trained.drafter, tmp_path / "export", head=trained.head)

    both = _system(target_dir, init_drafter_from=str(out), init_head_from=str(out))
    assert _same(both.drafter, trained.drafter) and _same(both.head, trained.head)

    drafter_only = _system(target_dir, init_drafter_from=str(out), freeze_drafter=True)  # train a fresh head
    assert _same(drafter_only.drafter, trained.drafter) and not _same(drafter_only.head, trained.head)
    trainable = {n.split(".")[0] for n, p in drafter_only.named_parameters() if p.requires_grad}
    assert trainable == {"head"}

    # The frozen drafter's context memo (the head stage's): a training step reads the same numbers through it.
    memo_system = _system(target_dir, init_drafter_from=str(out), freeze_drafter=True, context_memo_mb=1)
    memo_system.configure_model()
    ids = torch.randint(0, 90, (3, 12), generator=torch.Generator().manual_seed(3))
    attention = torch.ones_like(ids)
    attention[2, 9:] = 0
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": attention.bool(), "index": torch.tensor([4, 7, 9]),
             "features": memo_system.target(ids, attention_mask=attention).features * attention.unsqueeze(-1)}
    plain = memo_system.compute_step(batch, generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # computed and kept, then reused
        reused = memo_system.compute_step(batch, generator=torch.Generator().manual_seed(0), memo=memo_system.context_memo)
        torch.testing.assert_close(reused["loss"], plain["loss"])
        torch.testing.assert_close(reused["slot_logits"], plain["slot_logits"])
    assert memo_system.context_memo.hits == 3 and len(memo_system.context_memo) == 3
    with pytest.raises(ValueError, match="has none; use the data module's batches"):  # nothing to key the memo by
        memo_system.compute_step({k: v for k, v in batch.items() if k != "index"}, memo=memo_system.context_memo)
    from lilicorr_pl.system import check_resume_settings

    assert check_resume_settings({"context_memo_mb": 0.0}, {"context_memo_mb": 1024.0}) == []  # speed only
    with pytest.raises(ValueError, match="needs model.freeze_drafter: true"):
        _system(target_dir, init_drafter_from=str(out), context_memo_mb=1)

    head_only = _system(target_dir, init_head_from=str(out))
    assert _same(head_only.head, trained.head) and not _same(head_only.drafter, trained.drafter)

    with pytest.raises(ValueError, match="factor_dim: 6 here vs 4 there"):
        other = _system(target_dir, head=False)
        other.head = LiLiCorrHead(top_k=4, hidden_size=16, num_layers=2, num_heads=2, mlp_ratio=1.5, factor_dim=4,
                                  vector_eps=1e-5, logit_scale=5.0)
        export_drafter(trained.drafter, tmp_path / "narrow",
                       head=other.head.build(32, 96, block_size=4, rms_norm_eps=1e-6))
        _system(target_dir, init_head_from=str(tmp_path / "narrow"))
    with pytest.raises(ValueError, match="model.head is Top1Selector"):
        _system(target_dir, head=False, init_head_from=str(out))
    dflash_only = export_drafter(trained.drafter, tmp_path / "dflash")
    with pytest.raises(ValueError, match="holds no LiLiCorr head"):
        _system(target_dir, init_head_from=str(dflash_only))
    (out / "lilicorr_head.json").write_text("{}")
    with pytest.raises(ValueError, match="no longer supported"):
        _system(target_dir, init_drafter_from=str(out))


def test_a_warm_start_from_another_shape_of_drafter_is_one_line_naming_what_differs(tmp_path):
    """A deeper released drafter raised a KeyError from load_state_dict (only our keys missing from theirs were
    checked), and another block size loaded silently."""
    target_dir = save_tiny_target(tmp_path / "target")
    base = _system(target_dir)
    deeper = DFlashDrafter(num_layers=3, block_size=4).build(base.drafter.target_config, [1, 2, 3])
    longer = DFlashDrafter(num_layers=2, block_size=6).build(base.drafter.target_config, [1, 2, 3])
    masked = DFlashDrafter(num_layers=2, block_size=4, mask_token_id=3).build(base.drafter.target_config, [1, 2, 3])
    assert base.drafter.mask_token_id != 3
    for drafter, message in ((deeper, "num_layers 2 vs the directory's 3"), (longer, "block_size 4 vs the directory's 6"),
                             (masked, f"mask_token_id {base.drafter.mask_token_id} vs the directory's 3")):
        out = export_drafter(drafter, tmp_path / f"export-{drafter.num_layers}-{drafter.block_size}-{drafter.mask_token_id}")
        with pytest.raises(ValueError, match=rf"init_drafter_from=.* does not match model.drafter \({message}\); set"):
            _system(target_dir, init_drafter_from=str(out))


def test_an_export_that_overflows_its_dtype_is_refused(tiny_target, tmp_path):
    from lilicorr_pl.interop import ExportError

    drafter = DFlashDrafter(num_layers=1, block_size=4).build(tiny_target.config, tiny_target.layer_ids)
    with torch.no_grad():
        drafter.fc.weight[0, 0] = 1e6  # past float16's 65504
    with pytest.raises(ExportError, match=r"1 tensor\(s\) are not finite in float16 \(e.g. fc.weight: .*export in "
                                          r"bfloat16 or float32"):
        export_drafter(drafter, tmp_path / "half", dtype=torch.float16)
    assert not (tmp_path / "half").exists()
    assert export_drafter(drafter, tmp_path / "bf16", dtype=torch.bfloat16).is_dir()
    # Weights that were never finite (a diverged run) are not blamed on the dtype, in any dtype.
    with torch.no_grad():
        drafter.fc.weight[0, 1] = float("nan")
    for dtype in (torch.float32, torch.float16):
        with pytest.raises(ExportError, match=r"1 tensor\(s\) of the trained weights hold NaN or inf \(e.g. fc.weight\): "
                                              r"the run diverged before this checkpoint; export an earlier checkpoint"):
            export_drafter(drafter, tmp_path / "nan", dtype=dtype)
    assert not (tmp_path / "nan").exists()
    # Refused before any folder is made (the folders above --output were left behind, empty), and a failure while
    # writing removes the empty folders the export made, none it did not.
    with pytest.raises(ExportError, match="hold NaN or inf"):
        export_drafter(drafter, tmp_path / "a" / "b" / "c")
    assert not (tmp_path / "a").exists()


def test_a_failed_export_removes_the_empty_folders_it_made_and_only_those(tiny_target, tmp_path, monkeypatch):
    import lilicorr_pl.interop as interop

    drafter = DFlashDrafter(num_layers=1, block_size=4).build(tiny_target.config, tiny_target.layer_ids)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(interop, "save_file", full_disk)
    for output in (tmp_path / "mine" / "x" / "y", tmp_path / "new" / "z"):
        with pytest.raises(OSError, match="No space left"):
            export_drafter(drafter, output)
    assert not (tmp_path / "new").exists() and not (tmp_path / "mine" / "x").exists()
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]
    (tmp_path / "empty").mkdir()  # a folder of the user's, empty: not this export's to remove
    with pytest.raises(OSError, match="No space left"):
        export_drafter(drafter, tmp_path / "empty")
    assert (tmp_path / "empty").is_dir()


def test_an_export_whose_mkdir_fails_part_of_the_way_down_removes_the_levels_it_made(tiny_target, tmp_path,
                                                                                     monkeypatch):
    """``mkdir(parents=True)`` failing at a deeper level (a quota, a race) left the levels above it behind, empty."""
    from pathlib import Path as _Path

    drafter = DFlashDrafter(num_layers=1, block_size=4).build(tiny_target.config, tiny_target.layer_ids)
    (tmp_path / "mine").mkdir()
    out, real_mkdir = tmp_path / "mine" / "a" / "b" / "c", _Path.mkdir

    def fails_at_c(self, *args, **kwargs):
        if self.name == "c" and self.parent.is_dir():  # "a" and "b" made, "c" refused
            raise OSError(122, "Disk quota exceeded", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(_Path, "mkdir", fails_at_c)
    with pytest.raises(OSError, match="quota"):
        export_drafter(drafter, out)
    assert list((tmp_path / "mine").iterdir()) == []  # "a" and "b", made before "c" failed, are gone; "mine" stays


@pytest.mark.parametrize("made_again", [False, True], ids=["removed", "removed-and-made-again"])
def test_an_export_whose_new_folder_another_export_removed_says_so_in_one_line(tiny_target, tmp_path, monkeypatch,
                                                                              made_again):
    """Two exports into one new folder: the other one, failing, removed the folder it made (both saw it missing) before
    this one could hold it: a FileNotFoundError deep in the export. Or after this one opened it, and a third export
    made the folder again: this one held a removed folder and wrote into the third one's."""
    import lilicorr_pl.interop as interop
    from lilicorr_pl.interop import ExportError

    drafter = DFlashDrafter(num_layers=1, block_size=4).build(tiny_target.config, tiny_target.layer_ids)
    out, real_held = tmp_path / "parent" / "new", interop._held_alone

    @contextlib.contextmanager
    def removed_meanwhile(output):
        if not made_again:
            output.rmdir()  # the other export's clean-up, between this export's mkdir and its hold
        with real_held(output) as held:
            if made_again:  # the held folder goes (kept aside, so its inode is not reused) and another is made there
                output.rename(tmp_path / "held")
                output.mkdir()
            yield held

    monkeypatch.setattr(interop, "_held_alone", removed_meanwhile)
    with pytest.raises(ExportError, match=r"the folder was removed as this export began .*; run the export again$"):
        export_drafter(drafter, out)
    if made_again:  # the third export's folder, untouched, and so the parent this export made, which holds it
        assert list(out.iterdir()) == []
    else:  # the parent this export made, empty, goes too
        assert not out.parent.exists()
    monkeypatch.undo()
    shutil.rmtree(out, ignore_errors=True)
    assert (export_drafter(drafter, out) / "config.json").is_file()  # run again: it exports


def test_an_export_whose_parent_is_removed_while_it_makes_the_folders_makes_them_again(tiny_target, tmp_path,
                                                                                      monkeypatch):
    """A level above removed between the look and the mkdir (another export's clean-up) was a FileNotFoundError
    traceback; the export makes the levels again, and after a few such tries says so in one line."""
    from pathlib import Path as _Path

    import lilicorr_pl.files as files
    from lilicorr_pl.interop import ExportError

    drafter = DFlashDrafter(num_layers=1, block_size=4).build(tiny_target.config, tiny_target.layer_ids)
    real_mkdir, removals = _Path.mkdir, {"out": tmp_path / "a" / "b", "left": 1}

    def parent_removed(self, *args, **kwargs):
        if self == removals["out"] and removals["left"]:
            removals["left"] -= 1
            self.parent.rmdir()  # made by this export a moment ago, removed by someone else
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(_Path, "mkdir", parent_removed)
    assert (export_drafter(drafter, tmp_path / "a" / "b") / "config.json").is_file()
    removals.update(out=tmp_path / "x" / "c", left=files.MKDIR_TRIES)
    with pytest.raises(ExportError, match=r"its parent folders kept being removed .*; run the export again$"):
        export_drafter(drafter, tmp_path / "x" / "c")
    assert not (tmp_path / "x").exists()  # nothing of the failed export is left


def export_failing_on_a_full_disk(monkeypatch, drafter, out, mkdir) -> None:
    """Export ``drafter`` to ``out`` with ``mkdir`` in place of ``Path.mkdir`` and a disk that fills on the weights."""
    from pathlib import Path as _Path

    import lilicorr_pl.interop as interop

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_Path, "mkdir", mkdir)
    monkeypatch.setattr(interop, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        export_drafter(drafter, out)


@pytest.mark.parametrize("case", ["theirs-again", "ours-deeper"])
def test_after_a_retry_an_export_removes_only_the_levels_still_its_own_deepest_first(tiny_target, tmp_path,
                                                                                     monkeypatch, case):
    """The levels made on one try stayed "ours" after another process removed them and made them again (a clean-up
    then removed a folder it had not made), and a retry listed them out of depth order (the clean-up stopped early)."""
    from pathlib import Path as _Path

    drafter = DFlashDrafter(num_layers=1, block_size=4).build(tiny_target.config, tiny_target.layer_ids)
    a = tmp_path / "a"
    out = a / "b" if case == "theirs-again" else a / "b" / "c"
    if case == "ours-deeper":
        a.mkdir()  # the user's, removed by another process below: whatever this export makes there later is its own
    real_mkdir, state = _Path.mkdir, {"step": 0}

    def racing(self, *args, **kwargs):
        if case == "theirs-again":
            if self == out and state["step"] == 0:  # this export made "a"; another process moves it away
                state["step"] = 1
                a.rename(tmp_path / "gone")
            elif self == a and state["step"] == 1:  # and makes "a" again (a new folder) just before the retry's mkdir
                state["step"] = 2
                real_mkdir(a)
        elif self == out and state["step"] == 0:  # "a/b" made by this export; "a/b" and "a" moved away by another
            state["step"] = 1
            a.rename(tmp_path / "gone")
        return real_mkdir(self, *args, **kwargs)

    export_failing_on_a_full_disk(monkeypatch, drafter, out, racing)
    assert (tmp_path / "gone").is_dir()  # moved away by the other process, never touched
    if case == "theirs-again":
        assert a.is_dir() and list(a.iterdir()) == []  # the other process's "a" kept; this export's "a/b" gone
    else:
        assert not a.exists()  # "a", "a/b" and "a/b/c" all made by this export's retry: all gone, deepest first


def test_a_level_turned_into_a_file_or_a_broken_link_while_the_export_makes_it_is_one_line(tiny_target, tmp_path,
                                                                                           monkeypatch):
    """A file put where a level goes was a FileExistsError traceback; a parent link whose target went away meanwhile,
    five pointless tries and a message blaming a clean-up."""
    from pathlib import Path as _Path

    from lilicorr_pl.interop import ExportError

    drafter = DFlashDrafter(num_layers=1, block_size=4).build(tiny_target.config, tiny_target.layer_ids)
    real_mkdir = _Path.mkdir
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")

    def meanwhile(self, *args, **kwargs):
        if self == tmp_path / "f" and not (tmp_path / "f").exists():
            (tmp_path / "f").write_text("a user's file")  # put there after the look, before this mkdir
        if self == tmp_path / "link" / "y" and (tmp_path / "real").exists():
            (tmp_path / "real").rmdir()  # the link's target goes away after the look
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(_Path, "mkdir", meanwhile)
    with pytest.raises(ExportError, match=r"f/x/out: .*/f is a file, so the folder cannot be made; choose another path$"):
        export_drafter(drafter, tmp_path / "f" / "x" / "out")
    assert (tmp_path / "f").read_text() == "a user's file"
    with pytest.raises(ExportError, match=r"/link is a broken symbolic link \(to .*/real\); choose another path, or "
                                          r"create what it points to$"):
        export_drafter(drafter, tmp_path / "link" / "y" / "z")
    assert (tmp_path / "link").is_symlink()


def test_an_export_never_removes_a_level_another_process_made_after_it_looked(tiny_target, tmp_path, monkeypatch):
    """The levels an export removes on failure were those missing when it looked, before its mkdir: one another
    process made in between (the user, a sibling export) went with them, if still empty."""
    from pathlib import Path as _Path

    drafter = DFlashDrafter(num_layers=1, block_size=4).build(tiny_target.config, tiny_target.layer_ids)
    theirs, out, real_mkdir = tmp_path / "theirs", tmp_path / "theirs" / "mine", _Path.mkdir

    def another_process_first(self, *args, **kwargs):
        if self == theirs and not theirs.exists():
            real_mkdir(self)  # made by someone else, just before this export's mkdir of the same level
        return real_mkdir(self, *args, **kwargs)

    export_failing_on_a_full_disk(monkeypatch, drafter, out, another_process_first)
    assert theirs.is_dir() and list(theirs.iterdir()) == []  # "mine" (this export's) gone; "theirs" kept


def test_a_failing_export_leaves_levels_replaced_after_it_held_the_folder(tiny_target, tmp_path, monkeypatch):
    """The clean-up after a failure while writing removed the levels made, by path: levels another process moved away
    and made again meanwhile (new, empty folders at the same paths) were removed as this export's own."""
    import lilicorr_pl.interop as interop

    drafter = DFlashDrafter(num_layers=1, block_size=4).build(tiny_target.config, tiny_target.layer_ids)
    a = tmp_path / "a"
    out = a / "b"

    def replaced_then_full(*args, **kwargs):
        a.rename(tmp_path / "gone")  # another process moves this export's levels away, writing and all
        out.mkdir(parents=True)  # and makes its own at the same paths
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(interop, "save_file", replaced_then_full)
    with pytest.raises(OSError, match="No space left"):
        export_drafter(drafter, out)
    assert out.is_dir() and list(out.iterdir()) == []  # the other process's folders, kept
    assert (tmp_path / "gone" / "b").is_dir()  # this export's, moved away: not touched


def test_levels_removed_and_made_again_under_their_old_inode_numbers_are_not_the_exports(tmp_path):
    """A folder removed frees its inode number, which a file system (ext4) gives the next folder made: levels another
    process removed and made again at the same paths had the identities the export recorded, and its clean-up removed
    them as its own. Held open while the export runs, the removed levels keep their numbers."""
    import shutil

    from lilicorr_pl.files import folders_made, remove_made_folders

    a = tmp_path / "a"
    out = a / "b"
    with folders_made(out, f"--output {out}", "export") as made:
        assert set(made) == {a, out}
        shutil.rmtree(a)  # another process removes the levels
        out.mkdir(parents=True)  # and makes its own at the same paths
        remove_made_folders(made)  # the export's clean-up after a failure
    assert out.is_dir()  # the other process's folders, kept


def test_a_served_directory_is_rebuilt_with_its_own_widths_and_a_config_lacking_sizes_is_one_line(tmp_path, monkeypatch):
    """DraftSystem.from_export (bench --ckpt DIR) built the drafter with the target's MLP width and heads, so a drafter
    exported with its own was refused, naming settings the user never set; a config.json without its sizes was a
    KeyError, or Qwen3Config's 4096-wide defaults filled in."""
    from lilicorr_pl.system import DraftSystem

    target_dir = save_tiny_target(tmp_path / "target")
    base = _system(target_dir, head=False)
    narrow = DFlashDrafter(num_layers=2, block_size=4, intermediate_size=24, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=8).build(base.drafter.target_config, [1, 2, 3])
    torch.manual_seed(5)
    for p in narrow.parameters():
        torch.nn.init.normal_(p, std=0.3)
    out = export_drafter(narrow, tmp_path / "narrow")
    served = DraftSystem.from_export(out, target_dir)
    assert served.drafter.dims == narrow.dims
    for name, value in narrow.state_dict().items():
        assert torch.equal(served.drafter.state_dict()[name], value), name
    # The target's dtype: the directory's torch_dtype unless given (it was float32 whatever the export's), and the
    # weights file read once (it was read three times: the drafter, its warm start, the head).
    import lilicorr_pl.interop as interop

    reads = []
    real = interop.safe_open  # every read of a weights file opens it (read_weights: metadata and tensors, one open)
    monkeypatch.setattr(interop, "safe_open", lambda *a, **k: reads.append(a) or real(*a, **k))
    half = export_drafter(narrow, tmp_path / "half", dtype=torch.bfloat16)
    assert DraftSystem.from_export(half, target_dir).target_spec.dtype == "bfloat16" and len(reads) == 1
    assert DraftSystem.from_export(half, target_dir, dtype="float32").target_spec.dtype == "float32"
    assert served.target_spec.dtype == "float32"
    trained = _system(target_dir, seed=1)  # a LiLiCorr export: the head is read from the same tensors, not the file
    trained_like(trained.head, seed=2)
    both = export_drafter(trained.drafter, tmp_path / "both", head=trained.head)
    reads.clear()
    served_both = DraftSystem.from_export(both, target_dir)
    assert len(reads) == 1 and _same(served_both.drafter, trained.drafter) and _same(served_both.head, trained.head)
    config = json.loads((out / "config.json").read_text())
    del config["num_hidden_layers"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"lacks \['num_hidden_layers'\]"):
        DraftSystem.from_export(out, target_dir)
    # The head's loader too (a warm start's init_head_from reads it alone): its sizes were indexed, a KeyError.
    from lilicorr_pl.interop import served_head

    config["num_hidden_layers"] = 2
    del config["hidden_size"]
    config["architectures"] = ["LiLiCorrDraftModel"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"lacks \['hidden_size'\]"):
        served_head(out)


@pytest.mark.parametrize("edit, line", [
    (lambda c: c.__setitem__("head_dim", 2 * c["head_dim"]), "tensors do not have the shapes its config.json "
     "describes (layers.0.self_attn."),
    (lambda c: c["dflash_config"].__setitem__("mask_token_id", None), "dflash_config mask_token_id is null, not an "
     "integer"),
    (lambda c: c.__setitem__("dflash_config", [1]), "dflash_config is a JSON list, not an object"),
    (lambda c: c["dflash_config"].__setitem__("target_layer_ids", 2), "dflash_config target_layer_ids is 2, not a "
     "non-empty list of integers"),
    (lambda c: c["dflash_config"].__setitem__("target_layer_ids", []), "dflash_config target_layer_ids is [], not a "
     "non-empty list of integers"),
    (lambda c: c.__setitem__("num_target_layers", "4"), 'num_target_layers is "4", not an integer'),
])
def test_a_served_config_that_disagrees_with_its_weights_or_is_malformed_is_one_line(tmp_path, edit, line):
    """bench --ckpt DIR and the warm starts read a served directory's config.json: a size that disagrees with the
    weights was torch's RuntimeError listing every tensor, and a field of the wrong type a TypeError or AttributeError
    (``'list' object has no attribute 'get'``), or ``max() arg is an empty sequence``."""
    from lilicorr_pl.system import DraftSystem

    target_dir = save_tiny_target(tmp_path / "target")
    out = export_drafter(_system(target_dir, head=False).drafter, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        DraftSystem.from_export(out, target_dir)
    assert line in str(err.value) and "\n" not in str(err.value), err.value
    with pytest.raises(ValueError) as again:  # the warm start's loader, the same line
        load_drafter(out)
    assert str(again.value) == str(err.value)


def test_the_same_export_is_the_same_bytes(tiny_target, tmp_path):
    """safetensors writes its metadata in a hash map's order: with the export id beside "format", the same weights
    came out as other bytes on some saves (a demo stage keyed by its drafter's checksum then trained again)."""
    from safetensors import safe_open

    drafter = DFlashDrafter(num_layers=1, block_size=4).build(tiny_target.config, tiny_target.layer_ids)
    outs = [export_drafter(drafter, tmp_path / f"e{i}") for i in range(6)]
    first = (outs[0] / "model.safetensors").read_bytes()
    assert all((o / "model.safetensors").read_bytes() == first for o in outs[1:])
    assert all((o / "config.json").read_bytes() == (outs[0] / "config.json").read_bytes() for o in outs[1:])
    with safe_open(str(outs[0] / "model.safetensors"), framework="pt") as fh:  # the id is there, and read
        assert fh.metadata()["lilicorr_pl.export_id"] == json.loads((outs[0] / "config.json").read_text())[
            "lilicorr_pl"]["export_id"]
    assert torch.equal(load_drafter(outs[0]).fc.weight, drafter.fc.weight)


def test_overwrite_refuses_a_link_or_a_folder_under_an_exported_files_name_before_writing(tiny_target, tmp_path):
    """`export --overwrite` renamed its files over a symbolic link to an earlier export's config.json (the user's link
    became a plain file, "exported"), and over a folder named model.safetensors it did all its work, replaced
    config.json, then died with IsADirectoryError. Either is now one line naming the path, before anything is
    written."""
    from lilicorr_pl.interop import ExportError

    drafter = DFlashDrafter(num_layers=1, block_size=4).build(tiny_target.config, tiny_target.layer_ids)
    export_drafter(drafter, tmp_path / "exA")
    b = tmp_path / "exB"
    b.mkdir()
    (b / "config.json").symlink_to("../exA/config.json")
    with pytest.raises(ExportError, match=r"exB/config\.json is a symbolic link \(to \.\./exA/config\.json\).*move it "
                                          "away") as err:
        export_drafter(drafter, b, overwrite=True)
    assert "\n" not in str(err.value)
    assert (b / "config.json").is_symlink() and sorted(p.name for p in b.iterdir()) == ["config.json"]
    (b / "config.json").unlink()
    (b / "model.safetensors").symlink_to(tmp_path / "nowhere")  # a broken link: the same
    with pytest.raises(ExportError, match=r"model\.safetensors is a symbolic link"):
        export_drafter(drafter, b, overwrite=True)
    assert (b / "model.safetensors").is_symlink()
    c = tmp_path / "exC"
    c.mkdir()
    config = b'{"architectures": ["DFlashDraftModel"], "block_size": 8, "lilicorr_pl": {"version": "0.1.0"}}'
    (c / "config.json").write_bytes(config)  # an earlier export's config: --overwrite may replace it ...
    (c / "model.safetensors").mkdir()  # ... but not a folder under the weights' name
    with pytest.raises(ExportError, match=r"exC/model\.safetensors is a directory.*move it away"):
        export_drafter(drafter, c, overwrite=True)
    assert (c / "config.json").read_bytes() == config and (c / "model.safetensors").is_dir()
    assert sorted(p.name for p in c.iterdir()) == ["config.json", "model.safetensors"]  # no temporary folder left
    (c / "model.safetensors").rmdir()
    (c / "config.json").unlink()
    (c / "config.json").mkdir()
    with pytest.raises(ExportError, match=r"exC/config\.json is a directory"):
        export_drafter(drafter, c, overwrite=True)


@pytest.mark.parametrize("key, value, line", [
    ("rope_theta", 10.0, "its config.json's rope_theta 10.0 vs the target's 10000.0"),
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0}, "its config.json's rope_scaling {'rope_type': 'linear', "
     "'factor': 2.0} vs the target's None"),
    ("vocab_size", 600, "its config.json's vocab_size 600 vs the target's"),
    ("num_target_layers", 3, "its config.json's num_target_layers 3 vs the target's 6"),
    ("rms_norm_eps", 1e-5, "its config.json's rms_norm_eps 1e-05 vs the target's 1e-06"),
])
def test_a_served_directory_made_for_another_target_is_refused_against_this_one(tmp_path, key, value, line):
    """An engine builds the drafter with its config.json's RoPE, vocabulary and target depth; bench --ckpt DIR and the
    warm start built it with the target's and measured (or trained) another drafter than the one served, silently."""
    from lilicorr_pl.system import DraftSystem

    target_dir = save_tiny_target(tmp_path / "target")
    out = export_drafter(_system(target_dir, head=False).drafter, tmp_path / "out")
    assert DraftSystem.from_export(out, target_dir) is not None  # as exported: its own target
    config = json.loads((out / "config.json").read_text())
    config[key] = value
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape(f"the imported drafter does not match the target: {line}")):
        DraftSystem.from_export(out, target_dir)


def test_a_served_lilicorr_directory_with_another_norm_epsilon_is_refused_in_the_served_wording(tmp_path):
    """An engine builds the drafter's and the head's norms with config.json's rms_norm_eps. A LiLiCorr directory stating
    another than the target's was refused by the head's training-side check ("leave it unset", which no user of a
    served directory can do); it is the directory's target that differs, and the line says so. As exported it loads,
    the head's norms at the drafter's epsilon."""
    from lilicorr_pl.system import DraftSystem

    target_dir = save_tiny_target(tmp_path / "target")
    trained = _system(target_dir)
    out = export_drafter(trained.drafter, tmp_path / "out", head=trained.head)
    system = DraftSystem.from_export(out, target_dir)
    assert system.head.rms_norm_eps == system.drafter.dims.rms_norm_eps == 1e-6
    config = json.loads((out / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape("the imported drafter does not match the target: its config.json's "
                                                   "rms_norm_eps 1e-05 vs the target's 1e-06")):
        DraftSystem.from_export(out, target_dir)


def test_a_served_config_is_compared_with_the_target_on_what_it_states_in_either_spelling(tmp_path):
    """Only what config.json states is the directory's word: a config without num_target_layers, or with RoPE as
    transformers 5 writes it (rope_parameters; it was read as theta 10000 and the drafter built with it), or a target
    whose scaling keeps the older "type" key, is the same target."""
    from transformers import Qwen3Config

    from lilicorr_pl.interop import check_compatible
    from lilicorr_pl.system import DraftSystem

    target_dir = save_tiny_target(tmp_path / "target")
    out = export_drafter(_system(target_dir, head=False).drafter, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    theta = config.pop("rope_theta")
    del config["num_target_layers"]
    config["rope_parameters"] = {"rope_theta": theta, "rope_type": "default"}
    (out / "config.json").write_text(json.dumps(config))
    served = DraftSystem.from_export(out, target_dir)
    assert load_drafter(out).target_config.rope_parameters["rope_theta"] == theta  # read, not defaulted
    assert served.drafter.target_layer_ids == config["dflash_config"]["target_layer_ids"]
    # Both spellings at once, theta beside a rope_parameters without it: transformers reads the theta beside it.
    config["rope_theta"], config["rope_parameters"] = theta, {"rope_type": "default"}
    (out / "config.json").write_text(json.dumps(config))
    assert load_drafter(out).target_config.rope_parameters["rope_theta"] == theta
    config.pop("rope_theta")
    config["rope_parameters"] = {"rope_theta": theta, "rope_type": "default"}
    config["rope_parameters"]["rope_theta"] = theta / 2  # stated otherwise in the new spelling: refused
    (out / "config.json").write_text(json.dumps(config))
    line = f"its config.json's rope_theta {theta / 2} vs the target's {theta}"
    with pytest.raises(ValueError, match=re.escape(line)):
        DraftSystem.from_export(out, target_dir)
    yarn = {"factor": 4.0, "original_max_position_embeddings": 32768}
    kwargs = dict(rope_theta=1e6, max_position_embeddings=131072)
    drafter = DFlashDrafter(num_layers=1, block_size=4, mask_token_id=1).build(
        Qwen3Config(rope_scaling={"rope_type": "yarn", **yarn}, **kwargs), [1])
    drafter.served_config_keys = frozenset({"rope_theta", "rope_scaling"})
    check_compatible(drafter, Qwen3Config(rope_scaling={"type": "yarn", **yarn}, **kwargs))


def test_an_export_refused_by_another_export_holding_the_new_folder_leaves_that_folder(tiny_target, tmp_path,
                                                                                        monkeypatch):
    """Two exports into one new folder: the one that made and holds it writes; the other, refused, removed the folder
    as one it had made itself (both saw it missing), under the first one's feet."""
    import fcntl
    from pathlib import Path as _Path

    from lilicorr_pl.interop import ExportError

    drafter = DFlashDrafter(num_layers=1, block_size=4).build(tiny_target.config, tiny_target.layer_ids)
    out, real_mkdir, held = tmp_path / "out", _Path.mkdir, {}

    def another_export_first(self, *args, **kwargs):
        if self == out and "fd" not in held:  # the other export makes the folder and holds it, just before this mkdir
            real_mkdir(self)
            held["fd"] = os.open(self, os.O_RDONLY)
            fcntl.flock(held["fd"], fcntl.LOCK_EX | fcntl.LOCK_NB)
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(_Path, "mkdir", another_export_first)
    try:
        with pytest.raises(ExportError, match="another lilicorr export is writing into it"):
            export_drafter(drafter, out)
        assert out.is_dir()
    finally:
        os.close(held["fd"])


def test_a_drafter_reading_the_targets_last_layer_is_said_not_to_serve_as_it_trains(tmp_path, capsys):
    """The drafter reads a layer's raw output (DESIGN §2); for the target's last layer the reference DFlash code reads
    hidden_states[L], after the final norm, and SGLang and vLLM capture nothing after the last layer. fit warns, and
    export says so in a note (the demo's drafters read layer 15 of 16 until 31413d2: nothing said it)."""
    import warnings

    from lilicorr_pl.cli import main
    from lilicorr_pl.target import last_layer_serving_note

    assert last_layer_serving_note([1, 2], 4) is None
    note = last_layer_serving_note([1, 3], 4)
    assert note.startswith("target layer 3 is the target's last: the drafter reads its raw output, before the final "
                           "norm, while the reference DFlash code reads hidden_states[4]")
    assert note.endswith("so for one to serve choose target layer ids below 3")
    root = tmp_path / "run"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        main(["fit", "-c", str(ROOT / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={root}",
              "--model.target.layer_ids=[1, 3]", "--trainer.max_steps=1", "--trainer.limit_val_batches=0",
              "--trainer.enable_progress_bar=false"])
    assert any(str(w.message) == note for w in seen), [str(w.message) for w in seen]
    capsys.readouterr()
    main(["export", "--ckpt", str(root / "checkpoints" / "last.ckpt"), "--output", str(tmp_path / "out")])
    assert f"lilicorr export: note: {note}" in capsys.readouterr().err


def test_export_says_when_the_heads_decoding_options_do_not_travel(tiny_run, tmp_path, capsys):
    """A head decoded with Viterbi or a narrower lattice (``serve_top_k``) exported without a word, and the served
    directory decodes greedily over every candidate (README said it decodes exactly as the checkpoint)."""
    from helpers import save_edited
    from lilicorr_pl.cli import main
    from lilicorr_pl.system import DraftSystem

    _, good = tiny_run
    state = torch.load(good, map_location="cpu", weights_only=True)
    state["hyper_parameters"]["head"]["init_args"].update(decode="viterbi", serve_top_k=2)
    edited = tmp_path / "viterbi.ckpt"
    save_edited(state, edited)
    capsys.readouterr()
    out = main(["export", "--ckpt", str(edited), "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert ("lilicorr export: note: this checkpoint's head decodes with decode: viterbi, serve_top_k: 2, which the "
            "serving layout does not record; the export is served (and measured by bench --ckpt DIR) with the greedy "
            "walk over all 4 candidates") in err, err
    served = DraftSystem.from_export(out, state["hyper_parameters"]["target"]["name_or_path"])
    assert (served.head.decode, served.head.serve_top_k) == ("greedy", None)
    main(["export", "--ckpt", str(good), "--output", str(tmp_path / "plain")])
    assert "decodes with" not in capsys.readouterr().err


def test_export_cli_refuses_a_linked_config_in_the_output_before_loading(tmp_path, capsys):
    from conftest import user_error

    ckpt = tmp_path / "last.ckpt"
    ckpt.write_bytes(b"not read: the destination is refused first")
    (tmp_path / "exA").mkdir()
    (tmp_path / "exA" / "config.json").write_text('{"lilicorr_pl": {"version": "0.1.0"}}')
    out = tmp_path / "exB"
    out.mkdir()
    (out / "config.json").symlink_to("../exA/config.json")
    err = user_error(capsys, ["export", "--ckpt", str(ckpt), "--output", str(out), "--overwrite"])
    assert "exB/config.json is a symbolic link" in err and "move it away" in err
    assert (out / "config.json").is_symlink()


def test_a_second_export_into_a_folder_another_export_is_writing_is_refused_and_touches_nothing(tiny_target, tmp_path,
                                                                                                  monkeypatch):
    """Two exports into one folder at once each published their two files by two renames, so the folder could end with
    one's config.json and the other's model.safetensors: neither export. The folder is now held by one export at a
    time (a lock on the folder itself, no file made for it); the second is one line naming the first, said before the
    first's temporary files could be read as "not empty", and leaves everything as it was. Once released, it exports."""
    fcntl = pytest.importorskip("fcntl")
    from lilicorr_pl import interop
    from lilicorr_pl.files import writer_tag
    from lilicorr_pl.interop import ExportError

    busy = r"export: another lilicorr export is writing into it; wait for it to finish, or choose another directory"

    drafter = DFlashDrafter(num_layers=1, block_size=4).build(tiny_target.config, tiny_target.layer_ids)
    out = tmp_path / "export"
    out.mkdir()
    in_flight = out / f".lilicorr-export.x1y2.{writer_tag()}.tmp"  # the first export's temporary folder
    in_flight.mkdir()
    (in_flight / "config.json").write_text("{}")
    fd = os.open(out, os.O_RDONLY)  # what the first export holds while it writes
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for overwrite in (False, True):
            with pytest.raises(ExportError, match=busy):
                export_drafter(drafter, out, overwrite=overwrite)
            with pytest.raises(ExportError, match=busy):  # what `lilicorr export` checks before loading the checkpoint
                interop.check_output_dir(out, overwrite)
        assert [p.name for p in out.iterdir()] == [in_flight.name] and (in_flight / "config.json").read_text() == "{}"
    finally:
        os.close(fd)
    shutil.rmtree(in_flight)  # the first export finished

    # The folder stays held through the whole write: an export started while another publishes is refused.
    publish, refused = interop._publish, []

    def publish_while_another_starts(files, output):
        with pytest.raises(ExportError, match=busy) as err:
            export_drafter(drafter, output, overwrite=True)
        refused.append(str(err.value))
        publish(files, output)

    monkeypatch.setattr(interop, "_publish", publish_while_another_starts)
    export_drafter(drafter, out)
    monkeypatch.setattr(interop, "_publish", publish)
    assert len(refused) == 1 and sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert load_drafter(out).block_size == 4

    # Another export finishing into a new folder between this one's checks and its hold: checked again, held.
    fresh, check, first = tmp_path / "fresh", interop.check_output_dir, []

    def check_then_another_finishes(output, overwrite=False):
        checked = check(output, overwrite)
        if not first:
            first.append(None)
            first[0] = export_drafter(drafter, output)  # the other export, done before this one holds the folder
        return checked

    monkeypatch.setattr(interop, "check_output_dir", check_then_another_finishes)
    with pytest.raises(ExportError, match="is not empty"):
        export_drafter(drafter, fresh)
    monkeypatch.setattr(interop, "check_output_dir", check)
    assert first == [fresh] and sorted(p.name for p in fresh.iterdir()) == ["config.json", "model.safetensors"]
    assert load_drafter(fresh).block_size == 4
