"""AcceptanceEval: real speculative decoding inside a Trainer run, logged for loggers and monitors."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import Mock

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from callbacks import AcceptanceEval
from lilicorr_pl.data.datamodule import DraftDataModule
from lilicorr_pl.decoding.evaluate import summarize
from lilicorr_pl.decoding.speculative import speculative_generate
from lilicorr_pl.heads import LiLiCorrHead, Top1Selector
from lilicorr_pl.models import DFlashDrafter
from lilicorr_pl.system import DraftSystem
from lilicorr_pl.builtin import resolve_data_file, resolve_target_path
from lilicorr_pl.target import TargetSpec

BLOCK = 4
# Outside the `lilicorr` command, `builtin:` names are resolved explicitly (the core never builds a target).
SPEC = TargetSpec(name_or_path=resolve_target_path("builtin:tiny"), layer_ids=[1, 2])
DATA = resolve_data_file("builtin:stdlib-train:16")


def make_system(head=None) -> DraftSystem:
    return DraftSystem(SPEC, DFlashDrafter(num_layers=1, block_size=BLOCK), head=head, num_anchors=8, max_length=48)


def make_callback(**kw) -> AcceptanceEval:
    args = dict(every_n_train_steps=2, benchmark="stdlib-heldout", num_prompts=3, max_new_tokens=12, prompt_tokens=32)
    return AcceptanceEval(**{**args, **kw})


class SanityRecorder(L.Callback):
    """Records whether each validation epoch end was a sanity check."""

    def __init__(self) -> None:
        self.sanity_flags: list[bool] = []

    def on_validation_epoch_end(self, trainer, pl_module):
        self.sanity_flags.append(trainer.sanity_checking)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Four steps with validation (and the callback) every two, a sanity check, and a tau monitor."""
    root = tmp_path_factory.mktemp("acceptance")
    system = make_system(LiLiCorrHead(top_k=4, hidden_size=32, num_layers=1, num_heads=4))
    data = DraftDataModule([DATA], max_length=48, batch_size=4, logit_cache=False,
                           cache_dir=str(root / "cache"), target=SPEC, progress=False)
    callback = make_callback()
    checkpoint = ModelCheckpoint(dirpath=root / "ckpt", monitor="eval/tau", mode="max", save_top_k=1)
    recorder = SanityRecorder()
    trainer = L.Trainer(
        max_steps=4, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=1, accelerator="cpu",
        logger=CSVLogger(root / "csv"), callbacks=[callback, checkpoint, recorder],
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(system, data)
    return SimpleNamespace(trainer=trainer, system=system, callback=callback, checkpoint=checkpoint,
                           recorder=recorder, root=root)


def test_logs_eval_tau_to_callback_metrics_and_loggers(run):
    metrics = run.trainer.callback_metrics
    for key in ("eval/tau", "eval/tau_top1", "eval/stdlib-heldout/tau", "eval/acceptance/pos01"):
        assert key in metrics, key
    tau = metrics["eval/tau"].item()
    assert tau == pytest.approx(run.callback.history[-1][1]["eval/tau"])
    # Steps and validation ends coincide: one evaluation per step, logged at that step.
    assert [step for step, _ in run.callback.history] == [2, 4]
    rows = list(csv.DictReader(open(next(Path(run.trainer.logger.log_dir).glob("metrics.csv")))))
    logged = {int(r["step"]): float(r["eval/tau"]) for r in rows if r.get("eval/tau")}
    assert logged == {step: pytest.approx(s["eval/tau"]) for step, s in run.callback.history}


def test_skips_the_sanity_check(run):
    assert run.recorder.sanity_flags[0] is True  # the sanity check did run through the hook
    assert all(step > 0 for step, _ in run.callback.history)


def test_model_checkpoint_monitoring_eval_tau_keeps_the_best(run):
    best = Path(run.checkpoint.best_model_path)
    assert best.is_file()
    taus = [s["eval/tau"] for _, s in run.callback.history]
    assert run.checkpoint.best_model_score.item() == pytest.approx(max(taus))
    state = torch.load(best, map_location="cpu", weights_only=False)
    assert state["global_step"] in [step for step, s in run.callback.history if s["eval/tau"] == max(taus)]
    # What evaluation of this checkpoint must agree with: the data's thinking flag and stop ids, the run length.
    meta = state["lilicorr"]
    assert meta["enable_thinking"] is False and meta["total_steps"] == 4
    assert meta["stop_token_ids"] == run.system.target.stop_token_ids()


def test_tau_equals_direct_speculative_decoding_and_slices_sum_exactly(run):
    system, callback = run.system, run.callback
    target = system.target
    prompts = callback.prompt_set(system)
    direct = [speculative_generate(target, system.drafter, system.head, ids, callback.max_new_tokens).accepted_lengths
              for ids in prompts.input_ids]
    rounds = [a for lengths in direct for a in lengths]
    whole = callback.decode(system)
    assert whole["head"].tau == pytest.approx(1 + sum(rounds) / len(rounds))  # bonus token included
    assert whole["head"].histogram == torch.bincount(torch.tensor(rounds), minlength=BLOCK).tolist()
    # Two "ranks" decode disjoint slices; their summed histograms give exactly the pooled statistics.
    parts = [callback.decode(system, rank, 2)["head"] for rank in range(2)]
    summed = [a + b for a, b in zip(parts[0].histogram, parts[1].histogram)]
    pooled = summarize(summed)
    assert pooled["histogram"] == whole["head"].histogram
    assert pooled["tau"] == pytest.approx(whole["head"].tau)
    assert pooled["per_position_acceptance"] == pytest.approx(whole["head"].per_position_acceptance, nan_ok=True)


def test_at_t1_each_prompt_samples_the_same_however_the_prompts_are_split_across_ranks(run):
    """A rank seeded its prompts by their place in its own slice, so sampled τ depended on the number of ranks."""
    system, callback = run.system, run.callback
    temperature, callback.temperature = callback.temperature, 1.0
    try:
        whole = callback.decode(system)["head"]
        parts = [callback.decode(system, rank, 2)["head"] for rank in range(2)]
    finally:
        callback.temperature = temperature
    assert [a + b for a, b in zip(parts[0].histogram, parts[1].histogram)] == whole.histogram
    assert sorted(parts[0].per_prompt_tau + parts[1].per_prompt_tau) == sorted(whole.per_prompt_tau)


@pytest.mark.slow
def test_ddp_ranks_decode_slices_and_log_the_pooled_tau(tmp_path, monkeypatch):
    """Two CPU processes (gloo): both log the tau of all prompts, pooled from their own slices."""
    from lilicorr_pl.losses import DFlashCE, OraclePrefixCE

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # read by the spawned workers
    head = LiLiCorrHead(top_k=4, hidden_size=32, num_layers=1, num_heads=4)
    # OraclePrefixCE trains the head too: DDP insists that every parameter gets a gradient.
    system = DraftSystem(SPEC, DFlashDrafter(num_layers=1, block_size=BLOCK), head=head,
                         losses=[DFlashCE(), OraclePrefixCE()], num_anchors=8, max_length=48)
    data = DraftDataModule([DATA], max_length=48, batch_size=2, val_fraction=0.2,
                           logit_cache=False, cache_dir=str(tmp_path / "cache"), target=SPEC, progress=False)
    trainer = L.Trainer(
        max_steps=2, strategy="ddp_spawn", devices=2, accelerator="cpu", val_check_interval=2, limit_val_batches=1,
        num_sanity_val_steps=0, callbacks=[make_callback()], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )
    trainer.fit(system, data)
    # Rank 0's callback metrics come back to this process together with rank 0's final weights.
    metrics = trainer.callback_metrics
    system.configure_model()
    whole = make_callback().decode(system)  # one process, all three prompts (raw code prefixes: no thinking flag needed)
    assert metrics["eval/rounds"].item() == whole["head"].rounds  # each prompt decoded exactly once
    assert metrics["eval/tau"].item() == pytest.approx(whole["head"].tau)
    assert metrics["eval/tau_top1"].item() == pytest.approx(whole["top1"].tau)


def fake_trainer(step: int, loggers: list, enable_thinking: bool = False) -> SimpleNamespace:
    """The parts of a Trainer the callback touches, for a single process."""
    return SimpleNamespace(
        sanity_checking=False, global_step=step, global_rank=0, world_size=1, loggers=loggers,
        callback_metrics={}, strategy=SimpleNamespace(reduce=lambda t, reduce_op: t),
        datamodule=SimpleNamespace(enable_thinking=enable_thinking),
    )


def test_wandb_media_table_histogram_and_plot(run):
    import wandb

    callback, system = run.callback, run.system
    logger = Mock(spec=WandbLogger)
    trainer = fake_trainer(7, [logger])
    results = callback.decode(system)  # rank 0 records the table rows
    pooled = {name: summarize(r.histogram, r.num_tokens, r.seconds) for name, r in results.items()}
    callback._log_media(trainer, results, pooled)

    logger.log_table.assert_called_once()
    table = logger.log_table.call_args.kwargs
    assert table["key"] == "eval/drafts" and table["step"] == 7
    assert table["columns"] == ["prompt", "round", "anchor", "drafted", "target", "accepted", "acc"]
    assert table["data"], "the first prompts' rounds are shown"
    for _, _, _, drafted, choices, accepted, acc in table["data"]:
        drafted, choices = json.loads(drafted), json.loads(choices)  # one decoded string per token
        assert len(drafted) == BLOCK - 1 and len(choices) == BLOCK and 0 <= acc < BLOCK
        assert json.loads(accepted) == drafted[:acc]  # the accepted drafts are the drafted prefix ...
        assert drafted[:acc] == choices[:acc]  # ... that agrees with the target's own choices
    (media,), _ = logger.experiment.log.call_args
    assert set(media) == {"eval/accepted_length_hist", "eval/per_position_acceptance", "trainer/global_step"}
    assert media["trainer/global_step"] == 7
    hist = media["eval/accepted_length_hist"]
    assert isinstance(hist, wandb.Histogram)
    assert list(hist.histogram) == pooled["head"]["histogram"]


def test_evaluate_logs_scalars_to_every_logger_and_skips_repeats(run):
    callback = make_callback(num_prompts=2)
    wandb_logger, csv_logger = Mock(spec=WandbLogger), Mock()
    trainer = fake_trainer(10, [wandb_logger, csv_logger])
    scalars = callback.evaluate(trainer, run.system)
    for lg in (wandb_logger, csv_logger):
        lg.log_metrics.assert_called_once_with(scalars, step=10)
    assert trainer.callback_metrics["eval/tau"].item() == pytest.approx(scalars["eval/tau"])
    assert trainer.callback_metrics["eval/tau_top1"].item() == pytest.approx(scalars["eval/tau_top1"])
    callback.evaluate(trainer, run.system)  # validation end at the same step as the step hook
    assert csv_logger.log_metrics.call_count == 1
    trainer.sanity_checking, trainer.global_step = True, 11
    callback.evaluate(trainer, run.system)
    assert csv_logger.log_metrics.call_count == 1 and len(callback.history) == 1


def test_a_validate_after_a_fit_at_its_last_step_evaluates_again(run):
    """The once-per-step guard outlived the run: a trainer.validate after the fit, at the fit's last step, logged no
    eval/tau (nothing for a monitor), and so did one after loading other weights at that step."""
    callback = make_callback(num_prompts=1)
    trainer = fake_trainer(4, [])
    callback.evaluate(trainer, run.system)
    trainer.callback_metrics.clear()
    callback.setup(trainer, run.system, "validate")  # Lightning calls it as each run starts
    callback.evaluate(trainer, run.system)
    assert "eval/tau" in trainer.callback_metrics and len(callback.history) == 2


def test_a_position_no_round_reached_keeps_no_earlier_rate(run):
    """A per-position rate is left out when no round reached the position, and the one an earlier evaluation set
    stayed in trainer.callback_metrics, for monitors and the final printout, as if measured now."""
    callback = make_callback(num_prompts=1)
    trainer = fake_trainer(6, [])
    trainer.callback_metrics["eval/acceptance/pos09"] = torch.tensor(0.5)  # an earlier evaluation's, past BLOCK
    scalars = callback.evaluate(trainer, run.system)
    assert "eval/acceptance/pos09" not in trainer.callback_metrics and "eval/acceptance/pos09" not in scalars
    assert "eval/acceptance/pos01" in trainer.callback_metrics


def test_top1_head_logs_tau_top1_without_a_second_decode():
    system = make_system(head=None)  # vanilla DFlash: the head is per-slot top-1
    system.configure_model()
    callback = make_callback(num_prompts=1)
    scalars = callback.evaluate(fake_trainer(2, []), system)
    assert isinstance(system.head, Top1Selector)
    assert scalars["eval/tau_top1"] == scalars["eval/tau"]
    ids = callback.prompt_set(system).input_ids[0]
    direct = speculative_generate(system.target, system.drafter, system.head, ids, callback.max_new_tokens,
                                  stop_token_ids=system.target.stop_token_ids())
    assert scalars["eval/tau"] == pytest.approx(direct.tau) and scalars["eval/rounds"] == direct.num_rounds


# ---------------------------------------------------------------------------- train/serve agreement


@pytest.fixture(scope="module")
def chat_system(tmp_path_factory):
    """A target whose chat template renders the thinking flag (an empty think block when it is False)."""
    from helpers import make_tiny_target_dir

    root = tmp_path_factory.mktemp("chat")
    target = make_tiny_target_dir(root)
    system = DraftSystem({"name_or_path": target, "layer_ids": [1, 2]}, DFlashDrafter(num_layers=1, block_size=BLOCK),
                         num_anchors=4, max_length=48)
    system.configure_model()
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"prompt": "What is two plus two?"}\n{"prompt": "Hello! How are you?"}\n')
    return system, str(prompts)


def _chat_callback(prompts: str, **kw) -> AcceptanceEval:
    return make_callback(benchmark=prompts, chat_template=True, num_prompts=2, max_new_tokens=6, **kw)


@pytest.mark.parametrize("flag", [False, True])
def test_thinking_flag_comes_from_the_data_module(chat_system, flag):
    system, prompts = chat_system
    tokenizer = system.target.tokenizer
    think = tokenizer.convert_tokens_to_ids("<think>")
    callback = _chat_callback(prompts)
    prompt_set = callback.prompt_set(system, fake_trainer(1, [], enable_thinking=flag))
    assert prompt_set.enable_thinking is flag
    # The template adds the empty think block exactly when thinking is off, as the training data had it.
    assert all((think in ids) is (not flag) for ids in prompt_set.input_ids)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "What is two plus two?"}],
                                             tokenize=False, add_generation_prompt=True, enable_thinking=flag)
    assert prompt_set.input_ids[0] == tokenizer(rendered, add_special_tokens=False)["input_ids"]


def test_thinking_flag_without_a_data_module_comes_from_the_checkpoint(chat_system):
    system, prompts = chat_system
    no_data = SimpleNamespace(datamodule=None)
    with pytest.raises(ValueError, match="cannot tell the training data's thinking flag"):
        _chat_callback(prompts).prompt_set(system, no_data)
    system.checkpoint_meta = {"enable_thinking": True}
    try:
        assert _chat_callback(prompts).prompt_set(system, no_data).enable_thinking is True
        with pytest.raises(ValueError, match="contradicts the checkpoint's enable_thinking=True"):
            _chat_callback(prompts, enable_thinking=False).prompt_set(system, no_data)
    finally:
        system.checkpoint_meta = {}
    with pytest.raises(ValueError, match="contradicts data.enable_thinking=False"):
        _chat_callback(prompts, enable_thinking=True).prompt_set(system, fake_trainer(1, []))


def test_chat_prompts_are_rendered_with_the_training_datas_template(chat_system):
    """The in-loop evaluation rendered chat prompts with the tokenizer's own template whatever data.chat_template the
    run trained with, so eval/tau measured prompts unlike the training data's (and unlike what bench measures)."""
    system, prompts = chat_system
    tokenizer = system.target.tokenizer
    custom = ("{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
              "{% if add_generation_prompt %}### assistant:{% endif %}")
    trainer = SimpleNamespace(datamodule=SimpleNamespace(enable_thinking=False, chat_template=custom))
    ids = _chat_callback(prompts).prompt_set(system, trainer).input_ids[0]
    assert tokenizer.decode(ids) == "### user: What is two plus two?\n### assistant:"
    system.checkpoint_meta = {"enable_thinking": False, "chat_template": custom}  # outside a fit: the checkpoint's
    try:
        ids = _chat_callback(prompts).prompt_set(system, SimpleNamespace(datamodule=None)).input_ids[0]
        assert tokenizer.decode(ids) == "### user: What is two plus two?\n### assistant:"
    finally:
        system.checkpoint_meta = {}
    default = _chat_callback(prompts).prompt_set(system, fake_trainer(1, [])).input_ids[0]  # no template set
    assert tokenizer.decode(default).startswith("<|im_start|>user\nWhat is two plus two?")


def test_raw_code_prompts_need_no_thinking_flag(chat_system):
    """Code prefixes never go through the chat template: no data module and no checkpoint flag is fine."""
    system, _ = chat_system
    callback = make_callback(benchmark="stdlib-heldout")
    assert callback.prompt_set(system, SimpleNamespace(datamodule=None)).chat_template is False


def test_stop_tokens_are_the_training_datas(chat_system):
    """Regeneration and evaluation take stop ids from one place; a checkpoint's recorded ids win."""
    from transformers import AutoConfig

    from lilicorr_pl.data.regenerate import _generation_config
    from lilicorr_pl.target import stop_token_ids

    system, prompts = chat_system
    target = system.target
    im_end = target.tokenizer.convert_tokens_to_ids("<|im_end|>")
    stops = target.stop_token_ids()
    assert im_end in stops and target.tokenizer.eos_token_id in stops
    # What regeneration stops its data at, read before it loads the model: the loaded model's.
    config = AutoConfig.from_pretrained(system.target_path)
    assert stop_token_ids(target.tokenizer, config, _generation_config(system.target_path, config)) == stops
    callback = _chat_callback(prompts)
    assert callback.stop_token_ids(system) == stops
    # Recorded in the checkpoint: evaluation of that model stops where its training data stopped.
    first = [speculative_generate(target, system.drafter, system.head, ids, 1, stop_token_ids=[]).tokens[0]
             for ids in callback.prompt_set(system, fake_trainer(1, [])).input_ids]
    system.checkpoint_meta = {"stop_token_ids": sorted(set(first))}
    try:
        recorded = _chat_callback(prompts)
        assert recorded.stop_token_ids(system) == sorted(set(first))
        scalars = recorded.evaluate(fake_trainer(3, []), system)
    finally:
        system.checkpoint_meta = {}
    assert scalars["eval/rounds"] == 0  # every prompt stopped at its first token: no verify round ran


@pytest.mark.parametrize("rule", ["proposal", "point_mass"])
def test_sampled_evaluation_uses_the_configured_draft_rule(rule):
    """At T = 1 the head's drafts are sampled and verified with min(1, p/q), or kept deterministic and
    accepted iff they equal the target's sample (the recorded rounds show the target's row only then)."""
    system = make_system(LiLiCorrHead(top_k=4, hidden_size=32, num_layers=1, num_heads=4))
    system.configure_model()
    callback = make_callback(num_prompts=1, temperature=1.0, draft_sampling=rule)
    results = callback.decode(system)
    assert {r.draft_sampling for r in results.values()} == {rule}
    rounds = results["head"].examples[0]["rounds"]
    assert rounds and all((rnd["target"] is None) == (rule == "proposal") for rnd in rounds)
    assert 1.0 <= results["head"].tau <= BLOCK


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_prompts": 0}, "num_prompts >= 1"),
        ({"max_new_tokens": 0}, "max_new_tokens >= 2"),
        ({"max_new_tokens": 1}, r"max_new_tokens >= 2 \(the token after the prompt is the target's own"),  # τ NaN
        ({"every_n_train_steps": None, "on_validation_end": False}, "never run"),
        ({"temperature": -1.0}, "temperature"),
        ({"draft_sampling": "sampled"}, "draft_sampling must be one of"),
        ({"table_rows": -1}, "table_rows must be >= 0"),
        # Read at the first evaluation: a traceback after training, before the first checkpoint.
        ({"prompt_tokens": 4}, r"AcceptanceEval prompt_tokens must be >= 8 \(a code prefix"),
        ({"prompt_tokens": 0}, "prompt_tokens must be >= 8"),
    ],
)
def test_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_callback(**kwargs)


def test_a_misspelt_benchmark_is_refused_when_built_and_a_missing_prompt_file_before_a_run_that_evaluates():
    """Both were found at the first evaluation: a traceback after hours of training, before the first checkpoint. A
    missing file is refused by check_run (fit and validate call it before preparing data), not when built: perf and
    predict build a run's callbacks too and never read the prompts."""
    with pytest.raises(ValueError, match=r"AcceptanceEval benchmark: unknown benchmark 'humaneavl'; use one of \["):
        make_callback(benchmark="humaneavl")
    callback = make_callback(benchmark="nope.jsonl")
    with pytest.raises(FileNotFoundError, match=r"AcceptanceEval benchmark: prompt file nope.jsonl does not exist"):
        callback.check_run(make_system())


def test_prompts_the_context_cannot_hold_are_cut_and_counted_and_a_budget_it_cannot_hold_is_refused():
    """Decoding ran past the target's positions without a word (bench refuses such prompts, the demo cuts them)."""
    system = make_system()
    context = system.drafter.target_config.max_position_embeddings
    with pytest.raises(ValueError, match=f"max_new_tokens {context} leaves no room for a prompt in the target's "
                                         f"context of {context} positions"):
        make_callback(max_new_tokens=context).check_run(system)  # before the data are prepared (fit, validate)
    system.configure_model()
    roomy = make_callback(num_prompts=2, max_new_tokens=4, prompt_tokens=16)
    roomy.check_run(system)
    assert "eval/prompts_cut_to_context" not in roomy.evaluate(fake_trainer(2, []), system)
    callback = make_callback(num_prompts=2, max_new_tokens=context - 8, prompt_tokens=16)
    with pytest.warns(UserWarning, match=f"2 of 2 stdlib-heldout prompts leave fewer than max_new_tokens {context - 8} "
                                         f"of the target's {context} positions; each is cut to its last 8 tokens"):
        prompts = callback.prompt_set(system)
    assert [len(ids) for ids in prompts.input_ids] == [8, 8] and callback.prompts_cut_to_context == 2
    assert callback.evaluate(fake_trainer(2, []), system)["eval/prompts_cut_to_context"] == 2.0


def test_a_prompts_file_it_cannot_read_and_a_nan_temperature_are_refused_before_training(tmp_path):
    """A prompts file that exists but holds malformed JSON, records without a prompt, or bytes that are not UTF-8, and a
    nan temperature, were tracebacks at the first evaluation: after training, and before the first checkpoint."""
    from callbacks import AcceptanceEval

    for text, said in ((b"not json\n", r"bad.jsonl:1: malformed JSON"),
                       (b'{"x": 1}\n', r"bad.jsonl:1: expected a non-empty string 'prompt' or 'text' field"),
                       (b"\xff\xfe bad\n", r"bad.jsonl line 1: not UTF-8 text")):
        (tmp_path / "bad.jsonl").write_bytes(text)
        with pytest.raises(ValueError, match=rf"^AcceptanceEval benchmark: .*{said}"):
            AcceptanceEval(benchmark=str(tmp_path / "bad.jsonl")).check_run(None)
    (tmp_path / "good.jsonl").write_text('{"prompt": "def f(x):"}\n')
    AcceptanceEval(benchmark=str(tmp_path / "good.jsonl")).check_run(None)
    for temperature in (math.nan, math.inf, -1.0):
        with pytest.raises(ValueError, match="AcceptanceEval temperature must be a finite number >= 0, got"):
            AcceptanceEval(temperature=temperature)
