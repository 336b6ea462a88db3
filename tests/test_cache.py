"""Stores: safetensors shards with a manifest, written atomically, refused when truncated or altered;
fingerprints; the target-logit and feature precompute against the exact target."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_tiny_target_dir

from lilicorr_pl.data.fingerprint import content_sha256, fingerprint, fingerprint_target, sampled_sha256, store_path
from lilicorr_pl.data.precompute import (
    PrecomputeJob,
    SplitJob,
    cached_candidate_logits,
    feature_cache_bytes,
    full_logit_bytes_per_token,
    human_bytes,
    logit_cache_bytes_per_token,
    logit_cache_report,
    run_in_process,
    supervised_rows,
)
from lilicorr_pl.data.store import CacheError, StoreWriter, open_store, shard_name
from lilicorr_pl.target import FrozenTarget, TargetSpec

fingerprint_module = sys.modules["lilicorr_pl.data.fingerprint"]  # the package exports a function of its name


@pytest.fixture(autouse=True)
def _single_torch_thread():
    """Tiny models run far faster on one thread (and do not fight other processes for the cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


FEATURES = torch.randn(7, 12, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)


def _write(dest: Path, parts=None) -> Path:
    """A two-shard features store: examples [0, 2) and [2, 3)."""
    w = StoreWriter(dest, "features", parts or {"a": 1})
    w.write(0, (0, 2), {"features": FEATURES[:5]})
    w.write(1, (2, 3), {"features": FEATURES[5:]})
    w.finalize(2, meta={"note": "x"}, provenance={"by": "test"})
    return dest


# ---------------------------------------------------------------------- fingerprints
def test_fingerprint_is_canonical_and_sensitive():
    a = fingerprint({"x": 1, "y": [1, 2], "z": {"b": 2, "a": 1}})
    b = fingerprint({"z": {"a": 1, "b": 2}, "y": [1, 2], "x": 1})
    assert a == b and len(a) == 64
    assert fingerprint({"x": 2, "y": [1, 2], "z": {"a": 1, "b": 2}}) != a
    assert fingerprint({"x": 1, "y": [2, 1], "z": {"a": 1, "b": 2}}) != a
    assert store_path("root", "logits", {"x": 1}).name == f"logits-{fingerprint({'x': 1})[:16]}"


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


def test_a_remote_code_targets_key_reads_its_code(tmp_path):
    """With trust_remote_code the model's own .py files compute its logits and features: an edit there kept the key,
    and the stores of the old code were reused. A target without it keeps the key it had (no store is rebuilt)."""
    a = Path(make_tiny_target_dir(tmp_path, name="a"))
    plain = fingerprint_target(TargetSpec(str(a)))
    (a / "modeling_custom.py").write_text("SCALE = 1.0\n")
    assert fingerprint_target(TargetSpec(str(a))) == plain and "code" not in plain
    remote = fingerprint_target(TargetSpec(str(a), trust_remote_code=True))
    assert [name for name, _ in remote["code"]] == ["modeling_custom.py"]
    (a / "modeling_custom.py").write_text("SCALE = 2.0\n")
    edited = fingerprint_target(TargetSpec(str(a), trust_remote_code=True))
    assert fingerprint(edited) != fingerprint(remote)
    (a / "custom").mkdir()
    (a / "custom" / "layers.py").write_text("X = 1\n")  # a package of its own
    assert fingerprint(fingerprint_target(TargetSpec(str(a), trust_remote_code=True))) != fingerprint(edited)


def test_target_key_reads_a_subfolder_and_the_load_kwargs_that_change_the_model(tmp_path):
    a = make_tiny_target_dir(tmp_path, seed=0, name="a")
    plain = fingerprint_target(TargetSpec(a))
    assert "load_kwargs" not in plain  # a target loaded without any keeps the key it always had
    assert fingerprint_target(TargetSpec(a, load_kwargs={"attn_implementation": "eager", "device_map": "cpu"})) == plain
    override = {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    roped = fingerprint_target(TargetSpec(a, load_kwargs=override))
    assert roped["load_kwargs"] == override and fingerprint(roped) != fingerprint(plain)
    # A model read from a subfolder: that folder's weights, which the top-level listing never saw.
    outer = tmp_path / "outer"
    outer.mkdir()
    shutil.copytree(a, outer / "sub")
    nested = fingerprint_target(TargetSpec(str(outer), load_kwargs={"subfolder": "sub"}))
    assert nested["subfolder"] == "sub"
    assert nested["weights"] == plain["weights"] and nested["config"] == plain["config"]
    shutil.rmtree(outer / "sub")
    shutil.copytree(make_tiny_target_dir(tmp_path, seed=1, name="b"), outer / "sub")
    assert fingerprint_target(TargetSpec(str(outer), load_kwargs={"subfolder": "sub"}))["weights"] != nested["weights"]


def _hub_snapshot(cache: Path, commit: str, target: Path, weights: bool) -> Path:
    """``org/tiny`` at ``commit`` in a hub cache laid out as huggingface_hub writes it (refs/main names the commit)."""
    repo = cache / "models--org--tiny"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copy(target / "config.json", snapshot / "config.json")
    if weights:
        shutil.copy(target / "model.safetensors", snapshot / "model.safetensors")
    return snapshot


def test_a_hub_targets_store_key_is_its_commit_not_what_has_been_downloaded_yet(tmp_path):
    """The data stores are keyed before the target loads: a hub model's key must not change when its weights
    finish downloading (that rebuilt the target's whole pass over the data on the second run), and must change with
    the commit the name resolves to."""
    cache = tmp_path / "hub"
    target = Path(make_tiny_target_dir(tmp_path, seed=0, name="a"))
    spec = TargetSpec("org/tiny", load_kwargs={"cache_dir": str(cache), "local_files_only": True})
    first = "a" * 40
    _hub_snapshot(cache, first, target, weights=False)
    before = fingerprint_target(spec, hub="commit")
    assert before["commit"] == first and before["config"] == json.loads((target / "config.json").read_text())
    _hub_snapshot(cache, first, target, weights=True)
    assert fingerprint_target(spec, hub="commit") == before
    assert fingerprint_target(spec)["weights"]  # what a loaded target is compared by: its files
    _hub_snapshot(cache, "b" * 40, Path(make_tiny_target_dir(tmp_path, seed=1, name="b")), weights=False)
    assert fingerprint_target(spec, hub="commit")["commit"] == "b" * 40
    assert fingerprint(fingerprint_target(spec, hub="commit")) != fingerprint(before)


@pytest.fixture
def new_process(monkeypatch):
    """Digests as a new process finds them: none kept in memory (call it again to forget them again); files written
    by a test count as settled (a file changed within RACY_SECONDS of its read is otherwise not remembered)."""
    monkeypatch.setattr(fingerprint_module, "RACY_SECONDS", 0.0)

    def forget() -> None:
        monkeypatch.setattr(fingerprint_module, "_digests", {})

    forget()
    return forget


def test_target_fingerprint_sees_a_same_size_edit_anywhere_in_a_weight_file(tmp_path, monkeypatch, new_process):
    """The three-window sampled hash kept the old identity (and so the old logit store) for a same-size edit
    between its windows; the whole-content digest does not, and reads each version of the file once."""
    monkeypatch.setenv("LILICORR_CACHE", str(tmp_path / "cache"))
    target = Path(make_tiny_target_dir(tmp_path, seed=0, name="a"))
    extra = target / "extra.bin"
    extra.write_bytes(np.random.default_rng(0).bytes(8 << 20))
    before_sampled, before = sampled_sha256(extra), fingerprint(fingerprint_target(TargetSpec(str(target))))
    with open(extra, "r+b") as fh:  # 2 MiB in: between the sampled windows at 0, 3.5 and 7 MiB
        fh.seek(2 << 20)
        fh.write(b"\x00" if fh.read(1) != b"\x00" else b"\x01")
    assert sampled_sha256(extra) == before_sampled  # what the old identity could not see
    assert fingerprint(fingerprint_target(TargetSpec(str(target)))) != before

    reads = []
    real = fingerprint_module.file_sha256
    monkeypatch.setattr(fingerprint_module, "file_sha256", lambda p, *a: reads.append(Path(p).name) or real(p, *a))
    new_process()
    digest = content_sha256(extra)
    assert reads == [] and digest == real(extra)  # remembered from the fingerprint above, on disk
    memos = {json.loads(m.read_text())["version"]["path"]: m for m in (tmp_path / "cache" / "file-sha256").glob("*")}
    assert set(memos) == {str(extra.resolve()), str((target / "model.safetensors").resolve())}
    memo = memos[str(extra.resolve())]
    recorded = json.loads(memo.read_text())
    recorded["sha256"] = "0" * 64  # a memo is trusted only for the version it names ...
    recorded["version"]["mtime_ns"] += 1
    memo.write_text(json.dumps(recorded))
    new_process()
    assert content_sha256(extra) == digest and reads == ["extra.bin"]
    memo.write_text("{not json")  # ... and one that does not parse is read past
    new_process()
    assert content_sha256(extra) == digest and reads == ["extra.bin"] * 2
    new_process()
    assert content_sha256(extra) == digest and reads == ["extra.bin"] * 2  # and written again
    extra.write_bytes(b"other")  # replaced: a new version, read again
    assert content_sha256(extra) == real(extra) and reads == ["extra.bin"] * 3


def test_a_file_changed_just_before_its_read_is_not_remembered(tmp_path, monkeypatch):
    """Timestamps move in ticks: a same-size write in the tick of the read would keep the version the memo names."""
    monkeypatch.setattr(fingerprint_module, "_digests", {})
    fresh = tmp_path / "fresh.bin"
    fresh.write_bytes(b"weights")
    digest = content_sha256(fresh, tmp_path / "memo")
    assert digest == fingerprint_module.file_sha256(fresh)
    assert not list((tmp_path / "memo").glob("*.json")) and fingerprint_module._digests == {}


def test_without_a_cache_folder_a_process_reads_each_file_once(tmp_path, monkeypatch, new_process):
    """No home folder (no $HOME, no passwd entry) or an unwritable cache: the digest is kept in the process (one
    fit fingerprints the target for its logit store, its feature store and its checkpoint)."""
    import lilicorr_pl.files as files_module

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(files_module, "cache_root", no_home)
    reads = []
    real = fingerprint_module.file_sha256
    monkeypatch.setattr(fingerprint_module, "file_sha256", lambda p, *a: reads.append(1) or real(p, *a))
    weights = tmp_path / "w.bin"
    weights.write_bytes(b"weights")
    assert content_sha256(weights) == content_sha256(weights) == real(weights) and reads == [1]


def test_memos_of_files_that_are_gone_are_pruned_and_nothing_else(tmp_path, monkeypatch, new_process):
    monkeypatch.setattr(fingerprint_module, "MEMO_PRUNE_ABOVE", 3)
    memo_dir = tmp_path / "memo"
    files = [tmp_path / f"f{i}" for i in range(4)]
    for i, f in enumerate(files):
        f.write_bytes(bytes([i]))
    for f in files[:3]:
        content_sha256(f, memo_dir)
    files[0].unlink()
    (memo_dir / "users-note.json").write_text('{"mine": true}')  # not a memo: never removed
    content_sha256(files[3], memo_dir)  # past the limit: the gone file's memo goes
    kept = {json.loads(m.read_text()).get("version", {}).get("path") for m in memo_dir.glob("*.json")}
    assert kept == {str(f.resolve()) for f in files[1:]} | {None}


# ---------------------------------------------------------------------- writer / reader
def test_round_trip_is_native_bf16_safetensors_with_a_manifest(tmp_path):
    dest = _write(tmp_path / "c")
    store = open_store(dest, expected_fingerprint=fingerprint({"a": 1}), kind="features")
    assert store.num_examples == 3 and store.shard_examples == [(0, 2), (2, 3)]
    assert store.locate(0) == (0, 0) and store.locate(1) == (0, 1) and store.locate(2) == (1, 0)
    got = torch.cat([store.get(0, "features"), store.get(1, "features")])
    assert got.dtype == torch.bfloat16 and torch.equal(got, FEATURES)  # exact, no int16 detour
    assert torch.equal(store.slice(1, "features", 1, 2), FEATURES[6:7])  # a memory-mapped partial read
    from safetensors import safe_open

    with safe_open(str(dest / shard_name(0)), framework="pt") as f:  # a standard file any tool can read
        assert f.get_slice("features").get_dtype() == "BF16" and f.get_slice("features").get_shape() == [5, 12]
        assert json.loads(f.metadata()["lilicorr"]) == {"fingerprint": fingerprint({"a": 1}), "kind": "features",
                                                        "shard": "0", "examples": "0:2"}
    manifest = json.loads((dest / "manifest.json").read_text())
    assert manifest["schema_version"] == 2 and manifest["meta"] == {"note": "x"} and manifest["provenance"] == {"by": "test"}
    assert [s["examples"] for s in manifest["shards"]] == [[0, 2], [2, 3]] and len(manifest["shards"][0]["sha256"]) == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # the partial directory was renamed into place


def test_interrupted_write_leaves_nothing_under_the_real_name_and_keeps_finished_shards(tmp_path):
    dest = tmp_path / "c"
    w = StoreWriter(dest, "features", {"a": 1})
    w.write(0, (0, 2), {"features": FEATURES[:5]})
    (w.partial / f".{shard_name(1)}.w@{socket.gethostname()}@999999@dead.tmp").write_bytes(b"half a shard")  # a killed write
    with pytest.raises(CacheError, match=r"shard-00001.*missing"):
        w.finalize(2)
    assert not dest.exists()
    again = StoreWriter(dest, "features", {"a": 1})
    assert again.done(0) and not again.done(1)  # a rerun computes only the missing shard
    assert not StoreWriter(dest, "features", {"a": 2}).done(0)  # a shard written for other inputs is never reused
    again.write(1, (2, 3), {"features": FEATURES[5:]})
    again.finalize(2)
    assert sorted(p.name for p in dest.iterdir()) == ["manifest.json", shard_name(0), shard_name(1)]  # temp files gone
    assert torch.equal(open_store(dest).get(1, "features"), FEATURES[5:])


@pytest.mark.parametrize("host", ["node1.cluster.example", "gpu-07.dc-2"])
def test_leftovers_are_judged_by_the_whole_host_name_even_with_dots_and_hyphens(tmp_path, monkeypatch, host):
    """A dotted (or hyphenated) host name is this host's: a killed writer's temp file is removed at once and a live
    one's kept; a host whose name merely ends with this one's is another host. Split at dots, ``node1.cluster.example``
    read as host ``example``, another host's, so a killed writer's file stayed for a day."""
    monkeypatch.setattr(socket, "gethostname", lambda: host)
    w = StoreWriter(tmp_path / "c", "features", {"a": 1})
    w.write(0, (0, 2), {"features": FEATURES[:5]})
    w.write(1, (2, 3), {"features": FEATURES[5:]})
    dead = w.partial / f".{shard_name(1)}.w@{host}@999999@dead.tmp"
    live = w.partial / f".{shard_name(1)}.w@{host}@{os.getpid()}@live.tmp"
    other = w.partial / f".{shard_name(1)}.w@node1.{host}@999999@fresh.tmp"  # another host, whose name ends with this one's
    for path in (dead, live, other):
        path.write_bytes(b"partial")
    w.finalize(2)
    names = {p.name for p in (tmp_path / "c").iterdir()}
    assert dead.name not in names and live.name in names and other.name in names


def test_two_independent_runs_sharing_a_cache_both_finish_with_one_valid_store(tmp_path):
    """Two runs (not cooperating) compute the same store at once: the first to finish publishes it, the
    other's later writes and its finalize stand down without error, and a live writer's temp file is
    never deleted by the other's finalize."""
    dest = tmp_path / "c"
    a, b = StoreWriter(dest, "features", {"a": 1}), StoreWriter(dest, "features", {"a": 1})
    a.write(0, (0, 2), {"features": FEATURES[:5]})
    b.write(0, (0, 2), {"features": FEATURES[:5]})
    live = b.partial / f".{shard_name(1)}.w@{socket.gethostname()}@{os.getpid()}@live.tmp"
    live.write_bytes(b"b is writing")  # b's write in flight while a finalizes
    a.write(1, (2, 3), {"features": FEATURES[5:]})
    a.finalize(2)
    assert (dest / live.name).is_file()  # moved with the directory, not deleted under b
    assert b.done(1)  # b sees the finished store ...
    b.write(1, (2, 3), {"features": FEATURES[5:]})  # ... and its remaining writes and finalize stand down
    assert b.finalize(2) == dest and not b.partial.exists()
    assert torch.equal(open_store(dest).get(1, "features"), FEATURES[5:])


def test_a_finalize_racing_another_finalize_stands_down_without_error(tmp_path, monkeypatch):
    """Two runs sharing a cache finalize the same store at once (CI saw it with two `lilicorr fit` processes): while
    one writes its manifest, the other finishes and renames the directory into place. The first must neither lose
    its manifest's temporary file to the other's clean-up of killed writers' files nor fail when the directory
    moves: it stands down, and one valid store remains, with no temporary file in it."""
    import lilicorr_pl.data.store as store_module

    dest = tmp_path / "c"
    a, b = StoreWriter(dest, "features", {"a": 1}), StoreWriter(dest, "features", {"a": 1})
    a.write(0, (0, 2), {"features": FEATURES[:5]})
    a.write(1, (2, 3), {"features": FEATURES[5:]})
    real_replace, raced = os.replace, []

    def b_finishes_first(src, dst):  # a's manifest is written, not yet renamed: b finalizes now (once)
        if Path(dst).name == "manifest.json" and not raced:
            raced.append(None)
            raced[0] = b.finalize(2)
        return real_replace(src, dst)

    monkeypatch.setattr(store_module.os, "replace", b_finishes_first)
    assert a.finalize(2) == dest and raced == [dest]
    assert sorted(p.name for p in dest.iterdir()) == ["manifest.json", shard_name(0), shard_name(1)]
    assert not a.partial.exists()
    assert torch.equal(open_store(dest).get(1, "features"), FEATURES[5:])


def test_a_finalize_that_loses_its_shards_to_another_mid_hash_stands_down(tmp_path, monkeypatch):
    """A finalize hashes every shard (minutes for a feature store): another run sharing the cache that finished
    meanwhile renamed the partial directory into place, and the next shard read was a FileNotFoundError traceback
    beside a valid store."""
    import lilicorr_pl.data.store as store_module

    dest = tmp_path / "c"
    a, b = StoreWriter(dest, "features", {"a": 1}), StoreWriter(dest, "features", {"a": 1})
    a.write(0, (0, 2), {"features": FEATURES[:5]})
    a.write(1, (2, 3), {"features": FEATURES[5:]})
    real_sha, raced = store_module.file_sha256, []

    def a_finishes_while_b_hashes(path):
        digest = real_sha(path)
        if not raced:  # (once: a's own finalize hashes through here too)
            raced.append(None)
            raced[0] = a.finalize(2)
        return digest

    monkeypatch.setattr(store_module, "file_sha256", a_finishes_while_b_hashes)
    assert b.finalize(2) == dest and raced == [dest]
    assert torch.equal(open_store(dest).get(1, "features"), FEATURES[5:])


def test_a_shard_written_as_another_run_finalizes_leaves_no_partial_directory(tmp_path, monkeypatch):
    """A writer looked (not finished), the other run then renamed the partial directory into place, and the writer's
    mkdir made it anew for its shard: a partial directory (a feature shard: gigabytes) that nothing removed."""
    dest = tmp_path / "c"
    a, b = StoreWriter(dest, "features", {"a": 1}), StoreWriter(dest, "features", {"a": 1})
    a.write(0, (0, 2), {"features": FEATURES[:5]})
    a.write(1, (2, 3), {"features": FEATURES[5:]})
    real = StoreWriter.finished_elsewhere

    def finalized_right_after_the_look(self):
        answer = real(self)
        if self is b and not answer and not dest.exists():
            a.finalize(2)
        return answer

    monkeypatch.setattr(StoreWriter, "finished_elsewhere", finalized_right_after_the_look)
    b.write(1, (2, 3), {"features": FEATURES[5:]})
    assert b.finalize(2) == dest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no .c.partial
    assert torch.equal(open_store(dest).get(1, "features"), FEATURES[5:])


def test_truncated_shard_is_refused_with_one_line(tmp_path):
    dest = _write(tmp_path / "c")
    shard = dest / shard_name(1)
    shard.write_bytes(shard.read_bytes()[:-4])
    for verify in ("full", "size"):
        with pytest.raises(CacheError, match=r"shard-00001\.safetensors has \d+ bytes.*truncated") as err:
            open_store(dest, verify=verify)
        assert "\n" not in str(err.value) and f"delete {dest}" in str(err.value)
    # Even with the manifest edited to the new size, safetensors' own header check refuses it.
    mpath = dest / "manifest.json"
    m = json.loads(mpath.read_text())
    m["shards"][1]["bytes"] = shard.stat().st_size
    mpath.write_text(json.dumps(m))
    with pytest.raises(CacheError, match=r"shard-00001\.safetensors is not a readable safetensors file"):
        open_store(dest, verify="size")


def test_a_shard_whose_reader_fails_without_a_message_is_still_one_line(tmp_path, monkeypatch):
    """An unreadable shard's error quotes the reader's first line; a bare exception (no message) was an IndexError
    raised inside that handler, a traceback instead of the store's one line."""
    from lilicorr_pl.data import store

    dest = _write(tmp_path / "c")

    def bare(_path):
        raise OSError()

    monkeypatch.setattr(store, "_header", bare)
    with pytest.raises(CacheError, match=r"shard-00000\.safetensors is not a readable safetensors file \(OSError\)"):
        open_store(dest, verify="size")


def test_altered_shard_is_refused(tmp_path):
    dest = _write(tmp_path / "c")
    shard = dest / shard_name(0)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, different content
    shard.write_bytes(bytes(data))
    with pytest.raises(CacheError, match=r"shard-00000\.safetensors does not match its sha256.*altered"):
        open_store(dest)
    open_store(dest, verify="size")  # the cheap mode only checks sizes and headers: documented
    # A valid shard of another store swapped in is refused too.
    other = _write(tmp_path / "other", parts={"a": 2})
    (dest / shard_name(0)).write_bytes((other / shard_name(0)).read_bytes())
    with pytest.raises(CacheError, match="belongs to another store"):
        open_store(dest, verify="size")


def test_edited_or_missing_manifest_is_refused(tmp_path):
    dest = _write(tmp_path / "c")
    mpath = dest / "manifest.json"
    original = json.loads(mpath.read_text())

    m = json.loads(json.dumps(original))
    m["parts"]["a"] = 2
    mpath.write_text(json.dumps(m))
    with pytest.raises(CacheError, match="manifest was edited"):
        open_store(dest)

    m = json.loads(json.dumps(original))
    m["shards"][0]["sha256"] = "0" * 64
    mpath.write_text(json.dumps(m))
    with pytest.raises(CacheError, match="sha256"):
        open_store(dest)

    mpath.write_text(json.dumps(original))
    with pytest.raises(CacheError, match="different inputs"):
        open_store(dest, expected_fingerprint=fingerprint({"a": 2}))
    with pytest.raises(CacheError, match="kind is 'features', expected 'logits'"):
        open_store(dest, kind="logits")

    (dest / shard_name(1)).unlink()
    with pytest.raises(CacheError, match=r"shard-00001\.safetensors listed in the manifest is missing"):
        open_store(dest)
    mpath.unlink()
    with pytest.raises(CacheError, match="manifest.json is missing"):
        open_store(dest)
    with pytest.raises(CacheError, match="does not exist"):
        open_store(tmp_path / "nope")


# ---------------------------------------------------------------------- sizes
def test_bytes_per_token_report_for_qwen3_vocab():
    assert logit_cache_bytes_per_token(64) == 64 * 4 + 64 * 2 + 4 + 4 == 392
    assert full_logit_bytes_per_token(151_936) == 303_872
    report = logit_cache_report(151_936, 64)
    assert "392 B" in report and "296.8 KiB" in report and "775x" in report
    # DESIGN §8: ≈40 KiB/token of features for Qwen3-8B with 5 layers (H = 4096).
    assert feature_cache_bytes(1, 5 * 4096) == 40 * 1024
    assert human_bytes(1536) == "1.5 KiB" and human_bytes(10) == "10 B"


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


def _token_store(dest: Path, ids: list[torch.Tensor], masks: list[torch.Tensor], shards: list[tuple[int, int]]):
    w = StoreWriter(dest, "tokens", {"t": 1})
    for s, (a, b) in enumerate(shards):
        lengths = [len(x) for x in ids[a:b]]
        w.write(s, (a, b), {"input_ids": torch.cat(ids[a:b]).int(), "loss_mask": torch.cat(masks[a:b]),
                            "offsets": torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64)})
    w.finalize(len(shards), meta={"pad_id": 0, "tokens": sum(len(x) for x in ids)})
    return open_store(dest)


def test_precomputed_stores_match_the_exact_target(tiny_dir, tmp_path):
    target = FrozenTarget.from_pretrained(tiny_dir, layer_ids=[1, 5])
    g = torch.Generator().manual_seed(0)
    lengths = [9, 14, 5]
    ids = [torch.randint(0, 300, (n,), generator=g) for n in lengths]
    masks = [torch.rand(n, generator=g) < 0.7 for n in lengths]
    tokens = _token_store(tmp_path / "tokens", ids, masks, [(0, 2), (2, 3)])
    m = 16
    writers = {k: StoreWriter(tmp_path / k, k, {"t": 1}) for k in ("logits", "features")}
    job = PrecomputeJob([SplitJob("train", tokens, writers, {"logits": {}, "features": {}})], top_m=m, batch_size=2,
                        head_chunk=3)  # exercise chunking of the LM head
    paths = run_in_process(job, target, progress=False)["train"]
    lc, fc = open_store(paths["logits"]), open_store(paths["features"])
    checked_in = checked_out = 0
    for i, n in enumerate(lengths):
        shard, j = tokens.locate(i)
        out = target(ids[i][None], return_logits=True)
        # Features: the bf16 rounding of the target's features (batched/padded vs alone: ~1 bf16 ulp).
        a, b = (int(x) for x in tokens.get(shard, "offsets")[j : j + 2])
        got = fc.slice(shard, "features", a, b)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), out.features[0], atol=1e-2, rtol=8e-3)
        r0, r1 = (int(x) for x in lc.get(shard, "offsets")[j : j + 2])
        positions, _ = supervised_rows(masks[i].numpy(), np.array([0, n]))
        assert lc.slice(shard, "positions", r0, r1).tolist() == positions.tolist()
        for r in range(r0, r1):
            t = int(lc.get(shard, "positions")[r])
            assert t >= 1 and masks[i][t]
            normed = out.normed_hidden[0, t - 1]
            topm_ids = lc.get(shard, "topm_ids")[r].long()
            topm_logits = lc.get(shard, "topm_logits")[r].float()
            floor = topm_logits[-1]
            true_id = ids[i][t]
            outside = torch.tensor([v for v in range(target.output_rows) if v not in set(topm_ids.tolist())][:5])
            cands = torch.cat([topm_ids[torch.randperm(m, generator=g)[:6]], outside, true_id[None]])
            approx = cached_candidate_logits(topm_ids, topm_logits, floor, true_id, lc.get(shard, "true_logit")[r], cands)
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


def test_top_m_larger_than_vocab_is_refused_before_any_forward(tiny_dir, tmp_path, monkeypatch):
    """top_m must fit the vocabulary: a clear error before any forward pass, nothing written."""
    target = FrozenTarget.from_pretrained(tiny_dir, layer_ids=[1])
    monkeypatch.setattr(FrozenTarget, "forward", lambda *a, **k: pytest.fail("no forward before the check"))
    tokens = _token_store(tmp_path / "tokens", [torch.arange(4)], [torch.ones(4, dtype=torch.bool)], [(0, 1)])
    job = PrecomputeJob([SplitJob("train", tokens, {"logits": StoreWriter(tmp_path / "l", "logits", {})}, {})],
                        top_m=10_000, batch_size=1)
    with pytest.raises(ValueError, match=r"logit_top_m must be in 1\.\.384"):
        run_in_process(job, target, progress=False)
    assert not os.path.exists(tmp_path / "l") and not os.path.exists(tmp_path / ".l.partial")


@pytest.mark.parametrize("edit, problem", [
    (lambda m: [s.pop("file") for s in m["shards"]], r"shard entry 0 names file None, expected 'shard-00000"),
    (lambda m: [s.pop("examples") for s in m["shards"]], r"shard entry 0 has examples None, expected a range"),
    (lambda m: m.update(shards={}), r"shards is a JSON dict, not a list"),
    (lambda m: m.update(shards=["shard-00000.safetensors"]), r"shard entry 0 is a JSON str, not an object"),
    (lambda m: m["shards"][1].update(file="../c/shard-00001.safetensors"), r"shard entry 1 names file '\.\./c/"),
    (lambda m: m["shards"][0].update(examples=[0]), r"shard entry 0 has examples \[0\], expected a range"),
    (lambda m: m.update(examples="3"), r"examples is a JSON str, not a count"),
    (lambda m: m.update(meta=[]), r"meta is a JSON list, not an object"),
    (lambda m: m.update(kind=["features"]), r"unknown kind \['features'\]"),
    (lambda m: m.update(shards=[], examples=0), r"shard shard-00000\.safetensors is in the store but not in its"),
    (lambda m: m.update(shards=m["shards"][:1], examples=2), r"shard-00001\.safetensors is in the store but not in"),
], ids=["no-file", "no-examples", "shards-object", "entry-string", "file-outside", "short-range", "examples-string",
        "meta-list", "kind-list", "no-shards", "one-shard-dropped"])
def test_a_manifest_with_an_intact_fingerprint_and_a_malformed_or_emptied_shard_list_is_one_line(tmp_path, edit,
                                                                                                  problem):
    """The manifest's fingerprint covers its parts, not its shard list: entries without "file" or "examples" were a
    KeyError, "shards": {} a TypeError, and a list emptied (or cut) to match "examples" opened as a store without (or
    with fewer) examples. Each is now the store's one-line CacheError, before any shard is read."""
    dest = _write(tmp_path / "c")
    mpath = dest / "manifest.json"
    m = json.loads(mpath.read_text())
    edit(m)
    mpath.write_text(json.dumps(m))
    for verify in ("full", "size"):
        with pytest.raises(CacheError, match=problem) as err:
            open_store(dest, expected_fingerprint=fingerprint({"a": 1}), verify=verify)
        assert "\n" not in str(err.value) and f"delete {dest}" in str(err.value)


def test_a_token_stores_example_count_is_checked_against_the_one_its_writer_recorded(tmp_path):
    """Shard files and manifest entries both gone leave no unlisted file behind: the count the token writer also keeps
    in meta (as the logit writer does) still tells. A store written as the writers write it opens as before."""
    w = StoreWriter(tmp_path / "t", "tokens", {"a": 1})
    for index, (examples, offsets) in enumerate([((0, 2), [0, 2, 5]), ((2, 3), [0, 5])]):
        w.write(index, examples, {"input_ids": torch.arange(5, dtype=torch.int32),
                                  "loss_mask": torch.ones(5, dtype=torch.bool), "offsets": torch.tensor(offsets)})
    dest = w.finalize(2, meta={"examples": 3, "tokens": 10})  # what DraftDataModule._write_tokens records
    assert open_store(dest, kind="tokens").num_examples == 3
    mpath = dest / "manifest.json"
    m = json.loads(mpath.read_text())
    m["shards"], m["examples"] = m["shards"][:1], 2
    mpath.write_text(json.dumps(m))
    (dest / shard_name(1)).unlink()
    with pytest.raises(CacheError, match=r"the manifest says 2 examples, its meta 3 \(the manifest was edited\)"):
        open_store(dest, kind="tokens")
