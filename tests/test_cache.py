"""Fingerprinted caches: atomic writes, validation that refuses corrupt caches, cached target logits."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_tiny_target_dir

from lilicorr_pl.data.cache import (
    CacheError,
    CacheWriter,
    cache_path,
    cached_candidate_logits,
    clean_stale_temps,
    feature_cache_bytes,
    features_from_numpy,
    features_to_numpy,
    fingerprint,
    fingerprint_target,
    full_logit_bytes_per_token,
    human_bytes,
    logit_cache_bytes_per_token,
    logit_cache_report,
    open_cache,
    precompute_target_caches,
    supervised_rows,
)
from lilicorr_pl.target import FrozenTarget, TargetSpec


@pytest.fixture(autouse=True)
def _single_torch_thread():
    """Tiny models run far faster on one thread (and do not fight other processes for the cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _write(dest: Path, parts=None) -> Path:
    with CacheWriter(dest, "demo", parts or {"a": 1}, meta={"note": "x"}) as w:
        arr = w.create("big", (5, 3), np.float16)
        arr[:] = np.arange(15, dtype=np.float16).reshape(5, 3)
        w.save("offsets", np.array([0, 2, 5], dtype=np.int64))
    return dest


# ---------------------------------------------------------------------- fingerprints
def test_fingerprint_is_canonical_and_sensitive():
    a = fingerprint({"x": 1, "y": [1, 2], "z": {"b": 2, "a": 1}})
    b = fingerprint({"z": {"a": 1, "b": 2}, "y": [1, 2], "x": 1})
    assert a == b and len(a) == 64
    assert fingerprint({"x": 2, "y": [1, 2], "z": {"a": 1, "b": 2}}) != a
    assert fingerprint({"x": 1, "y": [2, 1], "z": {"a": 1, "b": 2}}) != a
    assert cache_path("root", "logits", {"x": 1}).name == f"logits-{fingerprint({'x': 1})[:16]}"


def test_target_fingerprint_sees_new_weights_with_same_names_and_sizes(tmp_path):
    a = make_tiny_target_dir(tmp_path, seed=0, name="a")
    b = make_tiny_target_dir(tmp_path, seed=1, name="b")
    fa, fb = fingerprint_target(TargetSpec(a)), fingerprint_target(TargetSpec(b))
    assert [w[:2] for w in fa["weights"]] == [w[:2] for w in fb["weights"]]  # same names and sizes
    assert fa["config"] == fb["config"]
    fa["name_or_path"] = fb["name_or_path"]
    assert fingerprint(fa) != fingerprint(fb)  # the sampled content hash differs
    # Layer ids matter for features but not for logits.
    f1 = fingerprint_target(TargetSpec(a, layer_ids=[1, 2]), include_layers=False)
    f2 = fingerprint_target(TargetSpec(a, layer_ids=[3, 4]), include_layers=False)
    assert f1 == f2
    assert fingerprint_target(TargetSpec(a, layer_ids=[1, 2])) != fingerprint_target(TargetSpec(a, layer_ids=[3, 4]))
    assert fingerprint_target(TargetSpec(a, dtype="bfloat16")) != fingerprint_target(TargetSpec(a))


# ---------------------------------------------------------------------- writer / reader
def test_round_trip_is_memmapped_with_manifest(tmp_path):
    dest = _write(tmp_path / "c")
    cache = open_cache(dest, expected_fingerprint=fingerprint({"a": 1}), kind="demo")
    assert isinstance(cache["big"], np.memmap) and not cache["big"].flags.writeable
    np.testing.assert_array_equal(cache["big"], np.arange(15).reshape(5, 3))
    manifest = json.loads((dest / "manifest.json").read_text())
    assert manifest["schema_version"] == 1 and manifest["meta"] == {"note": "x"}
    assert manifest["files"]["big"]["shape"] == [5, 3] and manifest["files"]["big"]["dtype"] == "<f2"
    assert len(manifest["files"]["big"]["sha256"]) == 64 and manifest["created"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no temp dir left behind


def test_interrupted_write_leaves_nothing_in_place(tmp_path):
    dest = tmp_path / "c"
    with pytest.raises(RuntimeError, match="boom"):
        with CacheWriter(dest, "demo", {"a": 1}) as w:
            w.create("big", (100, 4), np.float32)[:50] = 1.0
            raise RuntimeError("boom")
    assert not dest.exists()
    assert list(tmp_path.iterdir()) == []


def test_stale_temp_dir_of_a_dead_writer_is_cleaned(tmp_path):
    import socket

    dest = tmp_path / "c"
    host = socket.gethostname().replace("-", "_")
    stale = tmp_path / f".c.tmp-{host}-999999999-deadbeef"
    stale.mkdir()
    (stale / "x.npy").write_bytes(b"partial")
    assert clean_stale_temps(dest) == [stale]
    assert not stale.exists()


def test_truncated_npy_is_refused(tmp_path):
    dest = _write(tmp_path / "c")
    f = dest / "big.npy"
    f.write_bytes(f.read_bytes()[:-4])
    for verify in ("full", "size"):
        with pytest.raises(CacheError, match=r"big\.npy.*(truncated|bytes)") as err:
            open_cache(dest, verify=verify)
        assert "delete the directory" in str(err.value) and "prepare_data" in str(err.value)


def test_checksum_mismatch_is_refused(tmp_path):
    dest = _write(tmp_path / "c")
    f = dest / "big.npy"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF  # same size, different content
    f.write_bytes(bytes(data))
    with pytest.raises(CacheError, match=r"big\.npy sha256"):
        open_cache(dest)
    open_cache(dest, verify="size")  # the cheap mode only checks headers and sizes: documented


def test_edited_manifest_is_refused(tmp_path):
    dest = _write(tmp_path / "c")
    mpath = dest / "manifest.json"
    original = json.loads(mpath.read_text())

    m = json.loads(json.dumps(original))
    m["files"]["big"]["shape"] = [3, 5]
    mpath.write_text(json.dumps(m))
    with pytest.raises(CacheError, match=r"big\.npy holds shape \[5, 3\]"):
        open_cache(dest)

    m = json.loads(json.dumps(original))
    m["files"]["big"]["sha256"] = "0" * 64
    mpath.write_text(json.dumps(m))
    with pytest.raises(CacheError, match="checksum"):
        open_cache(dest)

    m = json.loads(json.dumps(original))
    m["parts"]["a"] = 2
    mpath.write_text(json.dumps(m))
    with pytest.raises(CacheError, match="manifest was edited"):
        open_cache(dest)

    mpath.write_text(json.dumps(original))
    with pytest.raises(CacheError, match="different inputs"):
        open_cache(dest, expected_fingerprint=fingerprint({"a": 2}))

    (dest / "offsets.npy").unlink()
    with pytest.raises(CacheError, match=r"offsets\.npy .*missing"):
        open_cache(dest)
    mpath.unlink()
    with pytest.raises(CacheError, match="manifest.json is missing"):
        open_cache(dest)
    with pytest.raises(CacheError, match="does not exist"):
        open_cache(tmp_path / "nope")


# ---------------------------------------------------------------------- sizes
def test_bytes_per_token_report_for_qwen3_vocab():
    assert logit_cache_bytes_per_token(64) == 64 * 4 + 64 * 2 + 4 + 4 == 392
    assert full_logit_bytes_per_token(151_936) == 303_872
    report = logit_cache_report(151_936, 64)
    assert "392 B" in report and "296.8 KiB" in report and "775x" in report
    # DESIGN §8: ≈40 KiB/token of features for Qwen3-8B with 5 layers (H = 4096).
    assert feature_cache_bytes(1, 5 * 4096) == 40 * 1024
    assert human_bytes(1536) == "1.5 KiB" and human_bytes(10) == "10 B"


def test_bf16_features_round_trip_exactly():
    x = torch.randn(7, 12)
    stored = features_to_numpy(x)
    assert stored.dtype == np.int16 and stored.nbytes == 7 * 12 * 2
    assert torch.equal(features_from_numpy(stored), x.to(torch.bfloat16))


# ---------------------------------------------------------------------- cached target logits
def test_cached_candidate_logits_lookup_rules():
    topm_ids = torch.tensor([[5, 2, 9]])
    topm_logits = torch.tensor([[3.0, 2.0, 1.0]], dtype=torch.float16)
    floor = topm_logits[..., -1]
    true_ids = torch.tensor([7])
    true_logit = torch.tensor([0.25])
    ids = torch.tensor([[2, 7, 0, 5, 9]])
    out = cached_candidate_logits(topm_ids, topm_logits, floor, true_ids, true_logit, ids)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([[2.0, 0.25, 1.0, 3.0, 1.0]]))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_target_dir(tmp_path_factory.mktemp("cache_target"))


def test_precomputed_cache_matches_exact_target_candidate_logits(tiny_dir, tmp_path):
    target = FrozenTarget.from_pretrained(tiny_dir, layer_ids=[1, 5])
    g = torch.Generator().manual_seed(0)
    lengths = [9, 14, 5]
    ids = [torch.randint(0, 300, (n,), generator=g) for n in lengths]
    masks = [torch.rand(n, generator=g) < 0.7 for n in lengths]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    flat_ids = torch.cat(ids).numpy().astype(np.int32)
    flat_mask = torch.cat(masks).numpy()
    m = 16
    paths = precompute_target_caches(
        target,
        flat_ids,
        flat_mask,
        offsets,
        logit_dest=tmp_path / "logits",
        logit_parts={"t": 1},
        feature_dest=tmp_path / "features",
        feature_parts={"t": 1},
        top_m=m,
        batch_size=2,
        progress=False,
        head_chunk=3,  # exercise chunking of the LM head
    )
    lc, fc = open_cache(paths["logits"]), open_cache(paths["features"])
    _, positions, row_offsets = supervised_rows(flat_mask, offsets)
    np.testing.assert_array_equal(lc["positions"], positions)
    np.testing.assert_array_equal(lc["offsets"], row_offsets)
    checked_in = checked_out = 0
    for i, n in enumerate(lengths):
        out = target(ids[i][None], return_logits=True)
        # Features: the bf16 rounding of the target's features (batched/padded vs alone: ~1 bf16 ulp).
        got = features_from_numpy(fc["features"][offsets[i] : offsets[i + 1]])
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), out.features[0], atol=1e-2, rtol=8e-3)
        for r in range(int(row_offsets[i]), int(row_offsets[i + 1])):
            t = int(lc["positions"][r])
            assert t >= 1 and masks[i][t]
            normed = out.normed_hidden[0, t - 1]
            topm_ids = torch.from_numpy(lc["topm_ids"][r].astype(np.int64))
            topm_logits = torch.from_numpy(lc["topm_logits"][r].astype(np.float32))
            floor = topm_logits[-1]
            true_id = ids[i][t]
            outside = torch.tensor([v for v in range(target.output_rows) if v not in set(topm_ids.tolist())][:5])
            cands = torch.cat([topm_ids[torch.randperm(m, generator=g)[:6]], outside, true_id[None]])
            approx = cached_candidate_logits(
                topm_ids, topm_logits, floor, true_id, torch.tensor(float(lc["true_logit"][r])), cands
            )
            exact = target.candidate_logits(normed, cands)
            inside = torch.isin(cands, topm_ids)
            is_true = cands == true_id
            torch.testing.assert_close(approx[inside & ~is_true], exact[inside & ~is_true], atol=2e-2, rtol=2e-3)
            torch.testing.assert_close(approx[is_true], exact[is_true], atol=1e-5, rtol=1e-5)
            assert torch.all(approx[~inside & ~is_true] == floor)
            # The floor is an upper bound for unlisted tokens, and the list is the true top-M.
            assert torch.all(exact[~inside] <= floor + 1e-2)
            checked_in += int(inside.sum())
            checked_out += int((~inside & ~is_true).sum())
    assert checked_in > 50 and checked_out > 50


def test_top_m_larger_than_vocab_is_refused_before_any_forward(tiny_dir, tmp_path):
    """top_m must fit the vocabulary: a clear error before any forward pass."""
    target = FrozenTarget.from_pretrained(tiny_dir, layer_ids=[1])
    with pytest.raises(ValueError, match=r"logit_top_m must be in 1\.\.384"):
        precompute_target_caches(
            target,
            np.zeros(4, np.int32),
            np.ones(4, bool),
            np.array([0, 4]),
            logit_dest=tmp_path / "l",
            top_m=10_000,
            progress=False,
        )
    assert not os.path.exists(tmp_path / "l")
