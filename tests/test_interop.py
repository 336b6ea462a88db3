"""z-lab DFlash layout: exact keys, shapes and config fields; export -> import gives identical logits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lilicorr_pl.heads import LiLiCorrHead
from lilicorr_pl.interop import export_drafter, load_drafter, load_head
from lilicorr_pl.models.dflash import DFlashDrafter


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
    assert cfg["dflash_config"] == {"mask_token_id": 95, "target_layer_ids": [1, 2, 3]}
    for key, value in {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 512, "vocab_size": 96,
        "tie_word_embeddings": tiny_target.config.tie_word_embeddings,
    }.items():
        assert cfg[key] == value, key


def test_export_then_import_gives_identical_logits(tiny_target, tmp_path):
    torch.manual_seed(0)
    drafter = DFlashDrafter(num_layers=2, block_size=4).build(tiny_target.config, tiny_target.layer_ids)
    head = LiLiCorrHead(top_k=3, hidden_size=16, num_layers=1, num_heads=2).build(32, 96)
    out = export_drafter(drafter, tmp_path / "export", head=head,
                         head_init={"top_k": 3, "hidden_size": 16, "num_layers": 1, "num_heads": 2})
    loaded = load_drafter(out)
    x = torch.randint(0, 90, (1, 16))
    feats = tiny_target(x).features
    anchors = torch.tensor([[3, 9]])
    a = drafter(feats, x, anchors, tiny_target.embed, tiny_target.lm_head)
    b = loaded(feats, x, anchors, tiny_target.embed, tiny_target.lm_head)
    assert torch.equal(a.slot_logits, b.slot_logits)
    head2 = load_head(out)
    emb = tiny_target.embed
    sa = head.select(a.slot_hidden[:, 0], a.slot_logits[:, 0], a.anchor_feature[:, 0], emb)
    sb = head2.select(b.slot_hidden[:, 0], b.slot_logits[:, 0], b.anchor_feature[:, 0], emb)
    assert torch.equal(sa.tokens, sb.tokens)
    assert torch.equal(sa.lattice.pair, sb.lattice.pair)


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
    (out / "config.json").write_text("{}")  # a stale file of a previous export: replaced, not merged
    export_drafter(drafter, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "last.ckpt", "model.safetensors", "notes.txt"]
    assert (out / "notes.txt").read_text() == "keep me" and (out / "last.ckpt").read_bytes() == b"precious"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    # Exported files are readable like any model directory (temporary files start 0600).
    assert (out / "model.safetensors").stat().st_mode & 0o044 == 0o044
    with pytest.raises(ExportError, match="is a file"):
        export_drafter(drafter, out / "notes.txt")


def test_export_cli_refuses_the_checkpoint_folder_before_loading(tmp_path, capsys):
    from lilicorr_pl.interop import main

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    ckpt = folder / "last.ckpt"
    ckpt.write_bytes(b"not read: the destination is refused first")
    with pytest.raises(SystemExit, match="not empty"):
        main(["--ckpt", str(ckpt), "--output", str(folder)])
    assert ckpt.read_bytes().startswith(b"not read")
