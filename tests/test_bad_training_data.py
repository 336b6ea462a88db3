"""Bad training data and settings that crashed or misled a run: records too short for a block, a step with no
block, a weight-0 loss whose inputs are not built, unknown chat roles, overlapping data files."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import make_tiny_target_dir
from torch.utils.data import DataLoader

from lilicorr_pl.data.datamodule import DraftDataModule
from lilicorr_pl.data.formats import DataFormatError, LoadStats, load_examples
from lilicorr_pl.heads import LiLiCorrHead
from lilicorr_pl.losses import DFlashCE, DistractorPenalty, MarginHinge, OraclePrefixCE, lattice_diagnostics
from lilicorr_pl.models import DFlashDrafter
from lilicorr_pl.system import DraftSystem
from lilicorr_pl.target import TargetSpec

CODE = "def f(x):\n    return x + 1\n" * 3


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> str:
    return make_tiny_target_dir(tmp_path_factory.mktemp("bad_data_target"), layers=4, hidden=32)


def write_jsonl(path: Path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def data_module(target_dir: str, cache: Path, train: list[str], **kw) -> DraftDataModule:
    args = dict(target=TargetSpec(target_dir, layer_ids=[1, 2]), cache_dir=str(cache), max_length=64, batch_size=1,
                logit_cache=False, val_fraction=0.0, progress=False)
    args.update(kw)
    return DraftDataModule(train, **args)


def system(target_dir: str, losses=None, **kw) -> DraftSystem:
    return DraftSystem(
        {"name_or_path": target_dir, "layer_ids": [1, 2], "dtype": "float32"},
        DFlashDrafter(num_layers=1, block_size=4),
        head=LiLiCorrHead(top_k=4, hidden_size=32, num_layers=1, num_heads=4, factor_dim=32),
        losses=losses or [DFlashCE(gamma=4.0), OraclePrefixCE(), MarginHinge(weight=0.0), DistractorPenalty()],
        num_anchors=8, target_logits="exact", lr_scheduler=None, **kw,
    )


def batch(ids: list[int]) -> dict[str, torch.Tensor]:
    t = torch.tensor([ids])
    return {"input_ids": t, "attention_mask": torch.ones_like(t), "loss_mask": torch.ones_like(t)}


# ---------------------------------------------------------------------- 1. records and steps with no block
def test_records_too_short_for_a_block_are_counted_and_kept_and_all_of_them_refused(tmp_path, target_dir):
    """A record with one supervised token after the first holds no block: in a batch of 1 its step crashed the run.
    Such records are kept (a store holds what it held before, and packed they may hold a label of the record before
    them), counted in a warning, and a file of nothing else is refused by what it lacks (it was "needs assistant
    turns")."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    assert len(tok("xy")["input_ids"]) == 2  # one supervised token after the first: no anchor with a label
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"text": CODE}] * 3 + [{"text": "xy"}]
                       + [{"messages": [{"role": "user", "content": "only a question"}]}])
    stats = LoadStats()
    kept = load_examples([path], tok, max_length=64, stats=stats)
    assert [e.input_ids for e in kept] == [tok(CODE)["input_ids"]] * 3 + [tok("xy")["input_ids"]]
    assert stats.records == 5 and stats.dropped_unsupervised == 1 and stats.no_block == 1
    dm = data_module(target_dir, tmp_path / "cache", [path])
    with pytest.warns(UserWarning) as caught:
        dm.prepare_tokens()
    said = [str(w.message) for w in caught]
    assert "train: dropped 1 of 5 records with no supervised token within max_length=64" in said, said
    assert ("train: 1 of 5 records hold one supervised token after the first, too few for a draft block (an anchor "
            "and a token after it): they train nothing") in said, said
    dm.setup("fit")
    assert len(dm.train_dataset) == 4
    short = write_jsonl(tmp_path / "short.jsonl", [{"text": "xy"}] * 2)
    with pytest.raises(DataFormatError, match=r"no record of short\.jsonl can hold a draft block \(2 records: 0 "
                                              r"without any supervised token inside max_length, 2 with only one"):
        load_examples([short], tok, max_length=64)
    assert len(load_examples([short, path], tok, max_length=64, pack=True)) >= 1  # packed: not refused


def test_a_step_with_no_block_gives_zero_losses_and_empty_diagnostics(target_dir):
    s = system(target_dir)
    s.configure_model()
    step = s.compute_step(batch([5, 6]), generator=torch.Generator().manual_seed(0))
    assert step["num_blocks"] == 0 and step["loss"].item() == 0.0 and step["loss"].requires_grad
    assert all(torch.isfinite(v).all() for v in step["logs"].values()), step["logs"]
    step["loss"].backward()  # gradient-compatible zeros
    diag = lattice_diagnostics(step["lattice"], step["slot_logits"], step["labels"], step["label_mask"],
                               step["selected"], top_k=4)
    assert diag["logfactor_spread"].shape == (0,) and diag["valid_block"].shape == (0,)


def test_every_loss_component_gives_a_differentiable_zero_for_no_block():
    from lilicorr_pl.heads.base import Lattice
    from lilicorr_pl.losses import CorrectorCE, DSparkLoss, LossInputs

    m, s, k, v = 0, 3, 4, 11
    logits = torch.randn(m, s, v, requires_grad=True)
    lattice = Lattice(torch.zeros(m, s, k, dtype=torch.long), torch.randn(m, k, requires_grad=True),
                      torch.randn(m, s - 1, k, k, requires_grad=True), torch.randn(m, s, k))
    inputs = LossInputs(logits, torch.zeros(m, s, dtype=torch.long), torch.zeros(m, s, dtype=torch.bool), lattice,
                        target_logits=lambda ids: torch.zeros(ids.shape), corrected_logits=logits * 2,
                        target_distribution=lambda rows: torch.zeros(m, s, v)[rows], total_steps=10)
    total = 0
    for loss in (DFlashCE(), OraclePrefixCE(), MarginHinge(weight=1.0), DistractorPenalty(), CorrectorCE(),
                 DSparkLoss()):
        out = loss(inputs)
        assert out.loss.item() == 0.0 and out.loss.requires_grad, type(loss).__name__
        assert all(torch.isfinite(x).all() for x in out.logs.values()), type(loss).__name__
        total = total + out.loss
    total.backward()


def test_a_validation_step_with_no_block_makes_the_epoch_means_and_averages_nothing(target_dir, monkeypatch):
    """Every rank must sync the same epoch metrics (torchmetrics syncs inside compute): a rank whose validation steps
    held no block made none of them and left the others waiting. Such a step adds nothing to the means; the others
    are weighted by their batch size (update_weighted: torchmetrics 1.9's MeanMetric(nan_strategy="disable")
    ignored the weights, so a 2-example batch counted as much as a 1-example one)."""
    s = system(target_dir)
    s.configure_model()
    monkeypatch.setattr(s, "log", lambda *args, **kwargs: None)  # outside a Trainer
    empty = s.compute_step(batch([5, 6]), generator=torch.Generator().manual_seed(0))
    full = s.compute_step(batch(list(range(10, 30))), generator=torch.Generator().manual_seed(0))
    s._log_step(empty, "val", s.val_metrics, batch_size=1)
    assert "val/loss" in s.epoch_means and s.epoch_means["val/loss"].update_count == 0
    s._log_step(full, "val", s.val_metrics, batch_size=2)
    assert s.epoch_means["val/loss"].compute().item() == pytest.approx(full["loss"].item())


def test_epoch_means_are_weighted_by_batch_size_and_show_a_nan():
    from torchmetrics.aggregation import MeanMetric

    from lilicorr_pl.system import update_weighted

    mean = MeanMetric(nan_strategy="disable")
    update_weighted(mean, torch.tensor(1.0), 2)
    update_weighted(mean, torch.tensor(4.0), 1)
    assert mean.compute().item() == pytest.approx(2.0)
    update_weighted(mean, torch.tensor(float("nan")), 1)
    assert mean.compute().isnan()


def test_training_and_validation_go_through_batches_with_no_block(target_dir):
    s = system(target_dir)
    normal = batch(list(range(10, 30)))
    loader = DataLoader([normal, batch([5, 6]), normal], batch_size=None)
    trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        val_check_interval=3, log_every_n_steps=1)
    trainer.fit(s, train_dataloaders=loader, val_dataloaders=DataLoader([batch([5, 6]), normal], batch_size=None))
    assert trainer.global_step == 3
    assert all(torch.isfinite(v).all() for v in trainer.callback_metrics.values())


# ---------------------------------------------------------------------- 2. weight-0 components
@pytest.mark.parametrize("how", ["init_args", "loss_weights"])
def test_a_weight_0_loss_whose_inputs_are_not_built_is_skipped(target_dir, how):
    if how == "init_args":
        s = system(target_dir, losses=[DFlashCE(), OraclePrefixCE(), DistractorPenalty(weight=0.0)])
    else:
        s = system(target_dir, losses=[DFlashCE(), OraclePrefixCE(), DistractorPenalty()],
                   loss_weights={"distractor_penalty": 0})
    assert not s.needs_target_logits
    s.configure_model()
    step = s.compute_step(batch(list(range(10, 30))), generator=torch.Generator().manual_seed(0))
    assert "distractor_penalty" not in step["logs"] and "oracle_prefix_ce" in step["logs"]
    step["loss"].backward()


def test_a_weight_0_loss_with_its_inputs_is_still_logged(target_dir):
    s = system(target_dir, losses=[DFlashCE(), MarginHinge(weight=0.0)])
    s.configure_model()
    step = s.compute_step(batch(list(range(10, 30))), generator=torch.Generator().manual_seed(0))
    assert "margin_hinge" in step["logs"]


# ---------------------------------------------------------------------- 3. chat roles
@pytest.mark.parametrize("role", ["gpt", "Assistant", "human"])
def test_a_messages_record_with_an_unknown_role_is_refused_naming_line_and_role(tmp_path, target_dir, role):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    good = {"messages": [{"role": "user", "content": "write f"}, {"role": "assistant", "content": CODE}]}
    bad = {"messages": [{"role": "user", "content": "write f"}, {"role": role, "content": CODE}]}
    path = write_jsonl(tmp_path / "roles.jsonl", [good, bad, good])
    with pytest.raises(DataFormatError) as err:
        load_examples([path], tok, max_length=64)
    message = str(err.value)
    assert "\n" not in message and "roles.jsonl line 2" in message and repr(role) in message
    assert f"has role {role!r}; name it {'user' if role == 'human' else 'assistant'!r} (only 'assistant' turns" \
        in message


@pytest.mark.parametrize("role", ["tool", "developer", "ipython", "observation"])
def test_a_messages_role_a_template_may_render_is_passed_on(tmp_path, target_dir, role):
    """Only other names of the assistant and the user are refused: tool output and a custom template's roles train as
    unsupervised context, as before."""
    from lilicorr_pl.data.formats import record_messages

    record = {"messages": [{"role": "user", "content": "q"}, {"role": role, "content": "x"},
                           {"role": "assistant", "content": CODE}]}
    assert [m["role"] for m in record_messages(record, "messages")] == ["user", role, "assistant"]


# ---------------------------------------------------------------------- 4. overlapping data files
def test_val_files_in_train_files_and_repeated_train_files_warn(tmp_path, target_dir, monkeypatch):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": CODE}] * 3)
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": CODE}] * 3)
    monkeypatch.chdir(tmp_path)
    with pytest.warns(UserWarning) as caught:
        data_module(target_dir, tmp_path / "cache", [a, "./b.jsonl"], val_files=["b.jsonl"])
    said = [str(w.message) for w in caught]
    assert any("data.val_files b.jsonl is also in data.train_files" in m and "training examples" in m for m in said)
    with pytest.warns(UserWarning, match=r"data.train_files lists .*a\.jsonl 2 times"):
        data_module(target_dir, tmp_path / "cache", [a, str(tmp_path / "." / "a.jsonl")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data_module(target_dir, tmp_path / "cache", [a], val_files=[b])
