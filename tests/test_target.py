"""The frozen target wrapper: layer offsets, LM head, candidate logits, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import save_tiny_target, tiny_qwen3_config
from helpers import save_edited
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM
from tokenizers import Tokenizer, models

from lilicorr_pl.target import FrozenTarget, default_layer_ids, is_local_path, local_target_path, tokenizer_of


def test_default_layer_ids_match_published_rule():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(36, 1) == [18]
    assert default_layer_ids(6, 3) == [1, 2, 3]
    with pytest.raises(ValueError, match="layer_ids"):
        default_layer_ids(3, 2)
    # The count is the capped one (5 features asked of a 4-layer target): the message names the setting and what the
    # rule can spread.
    with pytest.raises(ValueError, match=r"with 4 features: the rule spreads them over layers 1..1, so "
                                         r"model.target.num_features can be only 1"):
        default_layer_ids(4, 4)


@pytest.mark.parametrize("name, local", [
    ("/models/qwen", True), ("./qwen", True), ("../qwen", True), ("~/qwen", True), (".cache/qwen", True),
    ("C:\\models\\qwen", True), ("C:/models/qwen", True), ("models\\qwen", True),
    ("runs/x/target", True), ("org/name/", True), ("my model", True),
    ("Qwen/Qwen3-8B", False), ("gpt2", False), ("org/name.v2", False), ("models/qwen", False), ("", False),
])
def test_is_local_path_tells_paths_from_hub_ids(name, local):
    """One rule for every command that checks a target directory (regenerate, bench/export via from_checkpoint):
    a name that can only be a path here, including one written on Windows; a hub id ``org/name`` is not one."""
    assert is_local_path(name) is local


def test_local_target_path_expands_home_and_leaves_hub_ids(monkeypatch, tmp_path):
    """The one expansion regenerate and from_checkpoint share: ``~`` becomes the home directory (transformers would
    read ``~/qwen`` as a malformed repo id); a hub id stays a hub id (``None``)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert local_target_path("~/qwen") == str(tmp_path / "qwen")
    assert local_target_path("./qwen") == "./qwen"
    assert local_target_path("Qwen/Qwen3-8B") is None
    assert local_target_path("") is None
    # A name of the hub's form that is a directory here is that directory, as transformers loads it.
    monkeypatch.chdir(tmp_path)
    assert local_target_path("models/qwen") is None
    (tmp_path / "models" / "qwen").mkdir(parents=True)
    assert local_target_path("models/qwen") == "models/qwen"


def test_target_is_frozen_and_stays_in_eval(tiny_target):
    assert not any(p.requires_grad for p in tiny_target.parameters())
    tiny_target.train()
    assert not tiny_target.model.training


def test_features_equal_hf_hidden_states_with_layer_offset(tiny_target):
    x = torch.randint(0, 90, (2, 11))
    hf = tiny_target.model(x, output_hidden_states=True)
    out = tiny_target(x, return_logits=True)
    h = tiny_target.hidden_size
    for j, i in enumerate(tiny_target.layer_ids):
        torch.testing.assert_close(out.features[..., j * h : (j + 1) * h], hf.hidden_states[i + 1])
        # The classic silent bug: hidden_states[i] is the *input* of layer i.
        assert not torch.allclose(out.features[..., j * h : (j + 1) * h], hf.hidden_states[i])
    torch.testing.assert_close(out.logits, hf.logits)
    torch.testing.assert_close(out.normed_hidden, hf.hidden_states[-1])


def test_last_layer_feature_is_raw_not_final_normed(tmp_path):
    path = save_tiny_target(tmp_path / "t", layers=4)
    target = FrozenTarget.from_pretrained(path, layer_ids=[1, 3], load_tokenizer=False)
    x = torch.randint(0, 90, (1, 9))
    out = target(x)
    last = out.features[..., target.hidden_size :]
    hf = target.model(x, output_hidden_states=True)
    # Hugging Face stores the final-norm output as hidden_states[L]; the feature must be the raw state.
    assert not torch.allclose(last, hf.hidden_states[4])
    torch.testing.assert_close(target.final_norm(last), hf.hidden_states[4])


def test_lm_head_respects_tied_and_untied_embeddings(tiny_target):
    tied = tiny_target.config.tie_word_embeddings
    same = tiny_target.lm_head_module.weight.data_ptr() == tiny_target.embed_tokens.weight.data_ptr()
    assert same == tied
    h = torch.randn(3, tiny_target.hidden_size)
    torch.testing.assert_close(tiny_target.lm_head(h), h @ tiny_target.lm_head_module.weight.T)


def test_candidate_logits_equal_full_logits(tiny_target):
    x = torch.randint(0, 90, (2, 7))
    out = tiny_target(x, return_logits=True)
    ids = torch.randint(0, tiny_target.vocab_rows, (2, 7, 5))
    got = tiny_target.candidate_logits(out.normed_hidden, ids)
    torch.testing.assert_close(got, out.logits.gather(-1, ids))


def test_kv_cache_and_crop_reproduce_full_pass(tiny_target):
    x = torch.randint(0, 90, (1, 12))
    full = tiny_target(x, return_logits=True)
    first = tiny_target(x[:, :8], use_cache=True)
    FrozenTarget.crop_cache(first.cache, 6)
    assert first.cache.get_seq_length() == 6
    rest = tiny_target(x[:, 6:], cache=first.cache, use_cache=True, return_logits=True)
    torch.testing.assert_close(rest.logits, full.logits[:, 6:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rest.features, full.features[:, 6:], atol=1e-5, rtol=1e-5)


def test_bad_layer_ids_are_the_users_one_line_from_the_config_before_the_weights_load(tmp_path, monkeypatch):
    """A fit with model.target.layer_ids out of range or out of order raised a ValueError traceback after the target
    had loaded; now a UserInputError (the CLI's one line) from the model's config.json, before any weight is read."""
    from lilicorr_pl.checkpoint import UserInputError

    path = save_tiny_target(tmp_path / "t")

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the layer ids were checked")

    monkeypatch.setattr(FrozenTarget, "_load", staticmethod(no_load))
    for ids, match in (([1, 6], r"\[6\] are out of range for a target with 6 decoder layers \(valid: 0\.\.5\)"),
                       ([-1, 2], r"\[-1\] are out of range"),
                       ([3, 1], r"strictly increasing without repeats, got \[3, 1\]"),
                       ([2, 2], r"strictly increasing without repeats, got \[2, 2\]")):
        with pytest.raises(UserInputError, match=match + r".*fix model\.target\.layer_ids"):
            FrozenTarget.from_pretrained(path, layer_ids=ids, load_tokenizer=False)
    # An empty list: the system fell back to the default rule, unsaid (and a message about "default layer ids").
    with pytest.raises(UserInputError, match=r"model.target.layer_ids is empty; list the target layers the drafter "
                                             r"reads \(e.g. \[1, 8, 15\]\), or leave it unset for the default rule"):
        FrozenTarget.from_pretrained(path, layer_ids=[], load_tokenizer=False)
    from lilicorr_pl.models.dflash import DFlashDrafter
    from lilicorr_pl.system import DraftSystem

    with pytest.raises(UserInputError, match=r"model.target.layer_ids is empty"):
        DraftSystem({"name_or_path": str(path), "layer_ids": []}, DFlashDrafter(num_layers=1, block_size=4))
    # A feature count beside a list that disagrees with it was ignored without a word: the list won.
    count = (r"model.target.num_features 3 disagrees with model.target.layer_ids \[1, 4\] \(2 layers\): the count "
             r"applies only without a list; drop num_features, or drop layer_ids for the default rule")
    with pytest.raises(UserInputError, match=count):
        DraftSystem({"name_or_path": str(path), "layer_ids": [1, 4], "num_features": 3},
                    DFlashDrafter(num_layers=1, block_size=4))
    with pytest.raises(UserInputError, match=count):
        FrozenTarget.from_pretrained(path, layer_ids=[1, 4], num_features=3, load_tokenizer=False)
    # The count that matches the list, and the default (which cannot be told from unset), are fine.
    for features in (2, 5):
        system = DraftSystem({"name_or_path": str(path), "layer_ids": [1, 4], "num_features": features},
                             DFlashDrafter(num_layers=1, block_size=4))
        assert system.drafter.target_layer_ids == [1, 4]


def test_clear_errors_for_bad_layer_ids_mask_id_and_tokenizer(tmp_path):
    path = save_tiny_target(tmp_path / "t")
    with pytest.raises(ValueError, match=r"out of range.*6 decoder layers.*layer_ids"):
        FrozenTarget.from_pretrained(path, layer_ids=[1, 6], load_tokenizer=False)
    target = FrozenTarget.from_pretrained(path, load_tokenizer=False, num_features=2)
    with pytest.raises(ValueError, match=r"mask_token_id 151669 is outside the target vocabulary \(96 rows\)"):
        target.check_token_id(151669, setting="model.drafter.init_args.mask_token_id")
    vocab = {f"t{i}": i for i in range(200)}
    big = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")))
    with pytest.raises(ValueError, match=r"tokenizer has 200 tokens but the target embedding has 96 rows"):
        target.check_tokenizer(big)
    with pytest.raises(OSError, match="could not load the target model .*; pass a local directory") as err:
        FrozenTarget.from_pretrained(str(tmp_path / "missing"), load_tokenizer=False)
    assert "\n" not in str(err.value)  # one line, whatever transformers' own message spans


def test_padded_vocabulary_rows_are_valid_mask_rows(tmp_path):
    model = Qwen3ForCausalLM(tiny_qwen3_config(vocab=128))
    target = FrozenTarget(model, num_features=2)
    target.check_token_id(127)  # a padded row beyond any tokenizer id is a legal MASK
    assert target.vocab_rows == 128


def test_crop_cache_to_zero_really_empties_it(tiny_target):
    out = tiny_target(torch.randint(0, 90, (1, 5)), use_cache=True)
    FrozenTarget.crop_cache(out.cache, 0)
    assert out.cache.get_seq_length() == 0


def test_feature_hooks_are_registered_once_not_per_call(tiny_target, monkeypatch):
    layers = tiny_target.decoder.layers
    before = [len(layer._forward_hooks) for layer in layers]
    assert [before[i] for i in tiny_target.layer_ids] == [1] * tiny_target.num_features
    registrations = []
    real = torch.nn.Module.register_forward_hook

    def counting(self, *args, **kwargs):
        registrations.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "register_forward_hook", counting)
    x = torch.randint(0, 90, (1, 6))
    first = tiny_target(x, use_cache=True)
    for _ in range(3):
        out = tiny_target(x[:, -1:], position_ids=torch.tensor([[6]]), cache=first.cache, use_cache=True)
        FrozenTarget.crop_cache(first.cache, 6)
    assert registrations == []
    assert [len(layer._forward_hooks) for layer in layers] == before
    assert out.features.shape == (1, 1, tiny_target.num_features * tiny_target.hidden_size)
    # Outside a FrozenTarget call the hooks keep nothing (no activations pinned by other callers).
    tiny_target.model(x)
    assert tiny_target._tap.captured is None


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_ready_block_mask_equals_the_mask_hugging_face_builds(tmp_path, attn):
    path = save_tiny_target(tmp_path / "t")
    target = FrozenTarget.from_pretrained(path, load_tokenizer=False, num_features=3, attn_implementation=attn)
    x = torch.randint(0, 90, (1, 13))
    full = target(x, return_logits=True)
    first = target(x[:, :7], use_cache=True)
    mask = target.block_mask(7, 6)
    assert mask.shape == (1, 1, 6, 13) and mask.dtype == target.dtype
    with_mask = target(x[:, 7:], attention_mask=mask, position_ids=torch.arange(7, 13)[None],
                       cache=first.cache, use_cache=True, return_logits=True)
    FrozenTarget.crop_cache(first.cache, 7)
    built = target(x[:, 7:], position_ids=torch.arange(7, 13)[None], cache=first.cache, use_cache=True,
                   return_logits=True)
    torch.testing.assert_close(with_mask.logits, built.logits, atol=0, rtol=0)
    torch.testing.assert_close(with_mask.logits, full.logits[:, 7:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("drafter_layer_in_eval", [False, True])
def test_fit_does_not_warn_about_the_frozen_targets_eval_mode_only(tmp_path, drafter_layer_in_eval):
    """Lightning warns when training starts with modules in eval mode. The frozen target's are by design and no
    longer warn; a drafter module left in eval still does, with its count."""
    import warnings

    import lightning as L

    from lilicorr_pl.builtin import resolve_data_file, resolve_target_path
    from lilicorr_pl.data.datamodule import DraftDataModule
    from lilicorr_pl.models import DFlashDrafter
    from lilicorr_pl.system import DraftSystem
    from lilicorr_pl.target import TargetSpec

    spec = TargetSpec(name_or_path=resolve_target_path("builtin:tiny"), layer_ids=[1, 2])
    system = DraftSystem(spec, DFlashDrafter(num_layers=1, block_size=4), num_anchors=4, max_length=48)
    data = DraftDataModule([resolve_data_file("builtin:stdlib-train:16")], max_length=48, batch_size=4,
                           logit_cache=False, cache_dir=str(tmp_path / "cache"), target=spec, progress=False)
    if drafter_layer_in_eval:
        system.drafter.layers[0].eval()
    trainer = L.Trainer(max_steps=1, limit_val_batches=0, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(system, data)
    eval_warnings = [str(w.message) for w in caught if "in eval mode at the start of training" in str(w.message)]
    if drafter_layer_in_eval:
        in_eval = sum(1 for _, module in system.named_modules() if not module.training)  # as Lightning counts
        assert [m.split(" module(s)")[0] for m in eval_warnings] == [f"Found {in_eval}"]
    else:
        assert eval_warnings == []


def test_a_drafter_a_model_missing_weights_or_no_tokenizer_is_refused_not_loaded_at_random(tmp_path, capsys, tiny_run,
                                                                                         monkeypatch):
    """A drafter export declares ``model_type: qwen3``: transformers loaded it as a target with random embeddings and
    LM head (and any model missing tensors with those at random), and built an empty tokenizer from a directory
    that has none; each is one line naming the fix."""
    import json

    from conftest import ROOT, user_error
    from safetensors.torch import load_file, save_file


    path = tmp_path / "target"
    save_tiny_target(path)
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({**json.loads((path / "config.json").read_text()),
                                                     "architectures": ["DFlashDraftModel"]}))
    save_file({k: v for k, v in load_file(path / "model.safetensors").items() if "embed_tokens" not in k},
              drafter / "model.safetensors")
    with pytest.raises(ValueError, match=r"the target .*drafter is a drafter \(DFlashDraftModel\), not a target "
                                         r"model: loaded as one its embeddings and LM head would be random"):
        FrozenTarget.from_pretrained(str(drafter), load_tokenizer=False)
    err = user_error(capsys, ["fit", "-c", str(ROOT / "configs" / "tiny.yaml"), f"--model.target.name_or_path={drafter}",
                              f"--trainer.default_root_dir={tmp_path / 'runs'}", "--trainer.max_steps=1"])
    assert f"model.target.name_or_path {drafter} is a drafter (DFlashDraftModel), not a target model" in err, err
    assert not (tmp_path / "runs").exists()
    # bench and export name it by their own option, --target (not the training setting it fills).
    _, ckpt = tiny_run
    for command in (["bench", "--num_prompts", "1"], ["export", "--output", str(tmp_path / "out")]):
        err = user_error(capsys, [*command, "--ckpt", str(ckpt), "--target", str(drafter)])
        assert f"--target {drafter} is a drafter (DFlashDraftModel), not a target model" in err, err
    assert not (tmp_path / "out").exists()
    # A checkpoint whose recorded target is a drafter's folder: named as its, with the option that gives another.
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    state["hyper_parameters"]["target"]["name_or_path"] = str(drafter)
    save_edited(state, tmp_path / "moved.ckpt")
    err = user_error(capsys, ["bench", "--num_prompts", "1", "--ckpt", str(tmp_path / "moved.ckpt")])
    assert err.strip().endswith(f"checkpoint {tmp_path / 'moved.ckpt'}'s target {drafter} is a drafter "
                                "(DFlashDraftModel), not a target model: loaded as one its embeddings and LM head "
                                "would be random; pass the target model's directory or hub name (--target)"), err
    # The same for a hub id (HF_HUB_OFFLINE here: the hub's answer stood in for), named as the option that gave it,
    # and a hub id that cannot be read: not as the training setting the checkpoint's target fills.
    from transformers import AutoConfig

    def hub(name, **kwargs):
        if name == "org/drafter":
            return read_config(drafter)
        raise OSError(f"{name} is not a local folder and is not a valid model identifier")

    read_config = AutoConfig.from_pretrained
    monkeypatch.setattr(AutoConfig, "from_pretrained", hub)
    err = user_error(capsys, ["bench", "--num_prompts", "1", "--ckpt", str(ckpt), "--target", "org/drafter"])
    assert err.strip().endswith("--target org/drafter is a drafter (DFlashDraftModel), not a target model: loaded as "
                                "one its embeddings and LM head would be random; pass the target model's directory or "
                                "hub name"), err
    err = user_error(capsys, ["export", "--output", str(tmp_path / "out"), "--ckpt", str(ckpt), "--target", "org/none"])
    assert err.strip().endswith("--target 'org/none' is neither a local model directory nor a reachable hub model "
                                "(OSError); pass the target model's directory or hub name"), err
    state["hyper_parameters"]["target"]["name_or_path"] = "org/none"
    save_edited(state, tmp_path / "hub.ckpt")
    err = user_error(capsys, ["bench", "--num_prompts", "1", "--ckpt", str(tmp_path / "hub.ckpt")])
    assert err.strip().endswith(f"checkpoint {tmp_path / 'hub.ckpt'}'s target 'org/none' is neither a local model "
                                "directory nor a reachable hub model (OSError); pass the target model's directory or "
                                "hub name (--target)"), err
    monkeypatch.undo()
    assert not (tmp_path / "out").exists()

    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text((path / "config.json").read_text())
    save_file({k: v for k, v in load_file(path / "model.safetensors").items() if "layers.3.mlp.up_proj" not in k},
              partial / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks 1 weight tensor\(s\) of its architecture "
                                         r"\(model.layers.3.mlp.up_proj.weight\), which transformers would initialise"):
        FrozenTarget.from_pretrained(str(partial), load_tokenizer=False)

    # save_tiny_target saves no tokenizer: the target alone tokenizes nothing and holds none; whatever tokenizes
    # (the data module, regenerate, bench) asks for one and is refused.
    assert FrozenTarget.from_pretrained(str(path), num_features=2).tokenizer is None
    with pytest.raises(ValueError, match=r"data.target.name_or_path .*target holds no tokenizer \(transformers made "
                                         r"an empty one from its config\); save the target's tokenizer"):
        tokenizer_of(str(path), "data.target.name_or_path")


@pytest.mark.parametrize("layers, features, allowed", [(4, 2, "only 1"), (8, 6, "1 or at most 5")])
def test_the_default_layer_rule_names_the_feature_counts_it_can_spread(layers, features, allowed):
    """It said "at most the target's layer count": 2 features on 4 layers is that, and still repeats a layer."""
    with pytest.raises(ValueError, match=f"model.target.num_features can be {allowed}; set it, or model.target.layer_ids"):
        default_layer_ids(layers, features)
    if layers > 4:
        assert len(set(default_layer_ids(layers, layers - 3))) == layers - 3


def test_a_llama_directory_without_tokenizer_files_is_one_line(tmp_path):
    """A Llama or Mistral directory without tokenizer files was transformers' `Couldn't instantiate the backend
    tokenizer` traceback (a Qwen one already made the empty tokenizer refused here)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match=rf"model.target.name_or_path {tmp_path / 'llama'} holds no tokenizer "
                                         r"transformers can load \(Couldn't instantiate the backend tokenizer.*\); save "
                                         r"the target's tokenizer beside its weights"):
        tokenizer_of(str(tmp_path / "llama"), "model.target.name_or_path")
    assert tokenizer_of(str(tmp_path / "llama"), "model.target.name_or_path", required=False) is None


def test_the_tokenizer_is_read_where_the_weights_are(tmp_path, monkeypatch):
    """The target's weights took model.target.load_kwargs (a pinned revision, a token, a subfolder) and its tokenizer
    did not: beside a pinned revision's weights, the hub's newest tokenizer tokenized the data (keyed by the pin), and
    a gated model's tokenizer was refused for want of the token. Now the tokenizer is read with them; a subfolder
    without a tokenizer falls back to the model's top folder."""
    import shutil

    import transformers

    from helpers import make_tiny_target_dir
    from lilicorr_pl.data.datamodule import DraftDataModule
    from lilicorr_pl.target import TargetSpec

    path = Path(make_tiny_target_dir(tmp_path))
    seen = []
    real = transformers.AutoTokenizer.from_pretrained

    def recording(name, *args, **kwargs):  # (a local folder has no revisions: the options are recorded, then dropped)
        seen.append(kwargs)
        return real(name, *args, **{k: v for k, v in kwargs.items() if k not in ("revision", "token")})

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", recording)
    pinned = {"revision": "0123abc", "token": "hf_secret", "device_map": "cpu", "cache_dir": None}
    assert len(tokenizer_of(str(path), "x", load_kwargs=pinned)) > 2
    assert seen[-1] == {"trust_remote_code": False, "revision": "0123abc", "token": "hf_secret"}
    dm = DraftDataModule(target=TargetSpec(str(path), layer_ids=[1, 2], load_kwargs={"revision": "0123abc"}),
                         train_files=["unused.jsonl"])
    assert len(dm.tokenizer) > 2 and seen[-1]["revision"] == "0123abc"
    FrozenTarget.from_pretrained(str(path), num_features=2, revision="0123abc")  # its tokenizer too
    assert seen[-1]["revision"] == "0123abc"
    # The weights in a subfolder, the tokenizer in the top folder.
    nested = tmp_path / "nested"
    (nested / "weights").mkdir(parents=True)
    for f in path.iterdir():
        shutil.copy(f, nested / ("weights" if f.name in ("config.json", "model.safetensors") else "") / f.name)
    assert len(tokenizer_of(str(nested), "x", load_kwargs={"subfolder": "weights"})) == len(tokenizer_of(str(path), "x"))
    assert "subfolder" not in seen[-2]  # none in the weights' subfolder: the top folder's, in one load
    for f in path.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, nested / "weights" / f.name)
    tokenizer_of(str(nested), "x", load_kwargs={"subfolder": "weights"})
    assert seen[-1]["subfolder"] == "weights"  # one there: the subfolder's


def test_load_kwargs_the_load_cannot_take_are_one_line(tmp_path):
    """model.target.load_kwargs the load passes itself (dtype) were a TypeError once the data were tokenized; ones
    from_pretrained or the model does not take, or that need a package not installed, a traceback there."""
    from lilicorr_pl.target import TargetSpec

    with pytest.raises(ValueError, match=r"model.target.load_kwargs sets dtype, which lilicorr passes to from_pretrained "
                                         r"itself; set model.target.dtype instead"):
        TargetSpec(name_or_path="t", load_kwargs={"dtype": "bfloat16"})
    with pytest.raises(ValueError, match=r"sets dtype, trust_remote_code, which lilicorr passes to from_pretrained "
                                         r"itself; set model.target.dtype instead and set "
                                         r"model.target.trust_remote_code instead$"):
        TargetSpec(name_or_path="t", load_kwargs={"dtype": "bfloat16", "trust_remote_code": True})
    # transformers' old name, ignored beside dtype: checkpoints trained with it still rebuild (a new fit refuses it).
    assert TargetSpec(name_or_path="t", load_kwargs={"torch_dtype": "float32"}).load_kwargs == {"torch_dtype": "float32"}
    path = save_tiny_target(tmp_path)
    with pytest.raises(ValueError, match=rf"the target {path} did not load with model.target.load_kwargs \{{'bogus_kw': "
                                         r"1\} \(TypeError: .*unexpected keyword argument 'bogus_kw'\); fix what it "
                                         r"names"):
        FrozenTarget.from_pretrained(str(path), load_tokenizer=False, bogus_kw=1)
