"""``lilicorr bench``: real speculative-decoding benchmark of a trained checkpoint.

Every selector runs on the same drafter, prompts and temperature, and is compared with plain target
decoding measured in the same process. τ always includes the target's bonus token.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch
from jsonargparse.typing import NonNegativeFloat, PositiveInt

from lilicorr_pl.checkpoint import (CHECKSUM_KEY, UserInputError, check_checkpoint_file, first_line, read_verified,
                                    verified_first)
from lilicorr_pl.data.corpus import MIN_PREFIX_TOKENS
from lilicorr_pl.files import check_output_paths, write_results_json
from lilicorr_pl.target import CompileModeName, DeviceName, check_device, resolve_dtype, tokenizer_of

SELECTOR_NAMES = ("top1", "lilicorr", "domino", "dspark")  # lilicorr_pl.heads.SELECTORS (a test keeps them equal)
DRAFT_SAMPLING_CHOICES = ("both", "proposal", "point_mass")


def parse_selectors(spec: str | Sequence[str]) -> list[str]:
    """``"top1,lilicorr"`` or ``["top1", "lilicorr"]`` -> ``["top1", "lilicorr"]``: registry names or class paths;
    unknown or repeated ones are errors."""
    from lilicorr_pl.heads.registry import selector_class

    items = spec.split(",") if isinstance(spec, str) else list(spec)
    names = [s.strip() for s in items if s.strip()]
    names = [n if "." in n else n.lower() for n in names]
    if not names:
        raise ValueError(f"--selectors is empty; choose from {', '.join(SELECTOR_NAMES)}")
    unknown, classes = [], {}
    for name in names:
        try:
            cls = selector_class(name)
        except ValueError:
            unknown.append(name)
            continue
        if cls in classes:  # by name or by class path (top1 and lilicorr_pl.heads.top1.Top1Selector): measured twice
            raise ValueError(f"--selectors {spec!r} names a selector twice ({classes[cls]} and {name}); name it once")
        classes[cls] = name
    if unknown:
        raise ValueError(
            f"unknown selector(s) {unknown} in --selectors {spec!r}; choose from {', '.join(SELECTOR_NAMES)} "
            "or give a Selector class path"
        )
    return names


def refuse_one_head_twice(names: Sequence[str], chosen: Sequence[Any]) -> None:
    """Two ``--selectors`` (``names``) that serve the checkpoint's one head (``chosen``: what each serves; its class
    and a class it belongs to, such as ``domino`` and ``lilicorr_pl.heads.corrector.CorrectorHead``): one line before
    any target is built or loaded (the head was measured twice, as two selectors)."""
    served: dict[int, str] = {}
    for name, selector in zip(names, chosen):
        if id(selector) in served:
            raise UserInputError(f"--selectors {served[id(selector)]} and {name} are the checkpoint's one head "
                                 f"({type(selector).__name__}); name it once")
        served[id(selector)] = name


def selector_for(name: str, system: Any) -> Any:
    """The selector registered as ``name`` (or at that class path): the checkpoint's own head when it is
    one, a fresh instance of a parameter-free selector (``top1``), else an error."""
    from lilicorr_pl.heads.registry import selector_class

    cls = selector_class(name)
    head = system.head
    if isinstance(head, cls):
        return head
    if cls.parameter_free:
        return cls()
    raise ValueError(
        f"selector {name!r} is not available in this checkpoint (its head is {type(head).__name__}, "
        f"registered as {head.name!r}); use --selectors "
        + (f"top1 or top1,{head.name}" if head.name and head.name != "top1" else "top1 (it has no trained head)")
    )


def _lattice_settings(head: Any) -> dict[str, Any] | None:
    from lilicorr_pl.heads.lilicorr import LiLiCorrHead

    if not isinstance(head, LiLiCorrHead):
        return None
    return {"top_k": head.serve_top_k or head.top_k, "trained_top_k": head.top_k, "walk": head.decode}


def serve_lattice(head: Any, lattice_k: int | None, walk: str | None) -> None:
    """Sets a trained LiLiCorr head's serving-time lattice width and T = 0 walk (None: keep the head's own)."""
    from lilicorr_pl.heads.lilicorr import DECODERS, LiLiCorrHead

    if lattice_k is None and walk is None:
        return
    if not isinstance(head, LiLiCorrHead):
        raise ValueError(f"--lattice_k and --walk set a LiLiCorr head's decoding, and this checkpoint's head is "
                         f"{type(head).__name__ if head is not None else 'none'}; drop them")
    if lattice_k is not None:
        if not 1 <= lattice_k <= head.top_k:
            raise ValueError(f"--lattice_k {lattice_k} is outside 1..{head.top_k}: the head was trained with "
                             f"K={head.top_k} and can serve any k <= {head.top_k}")
        head.serve_top_k = lattice_k
    if walk is not None:
        if walk not in DECODERS:
            raise ValueError(f"--walk must be one of {DECODERS}, got {walk!r}")
        head.decode = walk


def run_bench(
    system: Any,
    benchmark: str,
    selectors: list[str],
    temperatures: list[float],
    num_prompts: int,
    max_new_tokens: int,
    chat_template: bool | None = None,
    enable_thinking: bool = False,
    seed: int = 0,
    timing: bool = False,
    draft_sampling: str = "both",
    compile: bool = False,
    template: str | None = None,
    compile_mode: str = "default",
    prompt_tokens: int = 64,
    prompts: Any = None,
    on_run: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Benchmark several selectors on one loaded system; one result dict per temperature.

    ``template``: the chat template the run was trained with (``data.chat_template``, Jinja text), None for the
    tokenizer's.

    ``timing``: on CUDA, time the draft / head / verify split (and the head's share) with CUDA events, so it is
    device time rather than launch time; the events are read once per generation, so timing adds no
    synchronisation to plain decoding or to any arm (``phase_timing`` in the JSON).
    ``compile_mode``: ``torch.compile``'s mode for the compiled heads (``"reduce-overhead"``: in CUDA graphs).
    ``prompt_tokens``: the token budget of each standard-library prefix (the ``stdlib-*`` benchmarks).
    ``prompts``: the benchmark's prompts already read with the target's tokenizer and these settings (None: read here).
    ``on_run``: called with each temperature's result as it is finished (before the next temperature decodes).
    ``draft_sampling`` sets the T > 0 rule (``"proposal"``, ``"point_mass"``, or ``"both"``: τ under
    the proposal rule, and under the point-mass rule in each selector's ``"point_mass"`` entry).
    """
    if draft_sampling not in DRAFT_SAMPLING_CHOICES:
        raise ValueError(f"draft_sampling must be one of {DRAFT_SAMPLING_CHOICES}, got {draft_sampling!r}")
    from lilicorr_pl.decoding.benchmarks import load_prompts
    from lilicorr_pl.decoding.compiled import compiled_wrappers
    from lilicorr_pl.decoding.evaluate import ArmSpec, evaluate_arms

    system.eval()
    target = system._require_target()
    arms = {name: selector_for(name, system) for name in selectors}
    if compile:  # every head with weights: compiling one arm's head alone would favour it
        from lilicorr_pl.decoding.compiled import compile_selectors

        arms = compile_selectors(arms, compile_mode)
    if target.tokenizer is None:  # transformers made an empty one: every prompt would tokenize to nothing
        raise UserInputError(f"the target {target.name_or_path} holds no tokenizer (transformers made an empty one from "
                             "its config); save the target's tokenizer beside its weights (tokenizer.save_pretrained "
                             "into that directory), or pass --target")
    if prompts is None:
        prompts = load_prompts(benchmark, target.tokenizer, num_prompts, chat_template=chat_template,
                               enable_thinking=enable_thinking, seed=seed, template=template, prefix_tokens=prompt_tokens)
    check_context(prompts, max_new_tokens, target)
    if num_prompts is not None and len(prompts.input_ids) < num_prompts:  # said, and recorded beside the count
        print(f"[lilicorr] bench: {benchmark} holds {len(prompts.input_ids)} prompts, fewer than --num_prompts "
              f"{num_prompts}: every result is over those {len(prompts.input_ids)}", file=sys.stderr)
    runs = []
    for temp in temperatures:
        rules = [] if temp == 0 else ["proposal", "point_mass"] if draft_sampling == "both" else [draft_sampling]
        # Plain decoding and every selector (under each rule) interleaved prompt by prompt: drift slows them alike.
        specs = {name: ArmSpec(system.drafter, selector, rules[0] if rules else "proposal")
                 for name, selector in arms.items()}
        specs.update({f"{name}@{rule}": ArmSpec(system.drafter, selector, rule)
                      for rule in rules[1:] for name, selector in arms.items()})
        reference, results = evaluate_arms(target, specs, prompts, max_new_tokens, temp, seed=seed, timing=timing)
        plain_seconds = sum(r.total for r in reference)
        target_tps = sum(len(r.tokens) for r in reference) / plain_seconds if plain_seconds > 0 else math.nan
        out: dict[str, Any] = {
            "benchmark": benchmark,
            "temperature": temp,
            "max_new_tokens": max_new_tokens,
            "num_prompts": len(prompts.input_ids),
            "num_prompts_requested": num_prompts,
            "prompt_tokens": prompt_tokens if benchmark.startswith("stdlib-") else None,  # a stdlib prefix's budget
            "chat_template": prompts.chat_template,
            "enable_thinking": prompts.enable_thinking,
            "seed": seed,
            # A local directory by its absolute path (a relative one says nothing once the JSON is moved).
            "target": os.path.abspath(name) if os.path.isdir(name := str(system.target_spec.name_or_path)) else name,
            # Which target weights were measured, against the ones the checkpoint trained with (a hash of the config
            # and weight files; None where unreadable): a false match says the drafter ran against another model.
            "target_weights": None,
            "target_weights_trained": None,
            "block_size": system.drafter.block_size,
            # Where every arm and plain decoding stopped a generation before the token budget (the target's own stop
            # tokens): another set of stops gives other outputs and another τ.
            "stop_token_ids": sorted(int(t) for t in target.stop_token_ids()),
            "tau_includes_bonus_token": True,
            # How the draft / head / verify split was timed: CUDA events (device time, no synchronisation added) or
            # the host clock (a CPU's exact times; on CUDA untimed, launch times).
            "phase_timing": "cuda_events" if timing and target.device.type == "cuda" else "host_clock",
            "interleaved": True,
            "compiled_selectors": compile,
            "compile_mode": compile_mode if compile else None,
            # Inductor's wrapper around the compiled heads' kernels (cpp on a CPU that can build it; same drafts), where
            # a compiled graph chose drafts in this run: T = 0, or the point-mass rule (sampled drafts run eagerly).
            "compile_wrapper": compiled_wrappers(arms.values()) if temp == 0 or "point_mass" in rules else None,
            # The trained LiLiCorr head's decoding: lattice width served and T = 0 walk (None without one).
            "lattice": _lattice_settings(system.head),
            "target_tokens_per_s": target_tps,
            # The selector every other one's ratios and intervals are taken against: the first named.
            "reference_selector": next(iter(arms)),
            "selectors": {},
        }
        # Compared under the checkpoint's own digest rule (sampled windows for one written before whole-file digests).
        meta = system.checkpoint_meta
        compared = system.compared_target(meta)
        trained = compared["target_weights_trained"]
        out["target_weights"], out["target_weights_trained"] = compared["target_weights"], trained  # by the same rule
        out["target_weights_hash"] = "content" if meta.get("target_weights_hash") == "content" or not trained \
            else "sampled"
        out["same_target_as_training"] = compared["same_target_as_training"]
        if "target_weights_trained_history" in compared:  # a resume changed its target: every one, from its step
            out["target_weights_trained_history"] = compared["target_weights_trained_history"]
        out["draft_sampling"] = rules[0] if rules else None  # the rule behind each selector's main entry
        for name in arms:
            r = results[name]
            out["selectors"][name] = {
                "tau": r.tau,
                "tokens_per_s": r.tokens_per_s,
                "speedup_vs_target": r.tokens_per_s / target_tps if target_tps > 0 else math.nan,
                "lossless": r.lossless,
                "per_position_acceptance": r.per_position_acceptance,
                "histogram": r.histogram,
                # Slot 1 of the round drafted right after the prompt, and of every later round.
                "slot1_first_round": r.slot1_first_round,
                "slot1_later_rounds": r.slot1_later_rounds,
                # Each prompt's first-round accepted length (-1: the prompt had no round), for a bootstrap of the split.
                "per_prompt_first_round": r.per_prompt_first_round,
                "head_time_fraction": r.head_time_fraction,
                "draft_time_fraction": r.draft_time_fraction,
                "round_ms": r.round_ms,
                "draft_ms": r.draft_ms,
                "head_ms": r.head_ms,
                "verify_ms": r.verify_ms,
                "bookkeeping_ms": r.bookkeeping_ms,
                "plain_step_ms": r.plain_step_ms,
                "round_cost_ratio": r.round_cost_ratio,
                "rounds": r.rounds,
                "num_tokens": r.num_tokens,
                "emitted_per_round": r.emitted_per_round,  # ≤ τ: the last round's tokens past the budget not emitted
                # Per prompt, in the benchmark's order: any subset's pooled τ and tokens/s (the bootstrap below).
                "per_prompt_tau": r.per_prompt_tau,
                "per_prompt_rounds": r.per_prompt_rounds,
                "per_prompt_tokens": r.per_prompt_tokens,
                "per_prompt_seconds": r.per_prompt_seconds,
            }
            for rule in rules[1:]:  # the other rule, same prompts and seeds
                o = results[f"{name}@{rule}"]
                out["selectors"][name][rule] = {
                    "tau": o.tau,
                    "per_position_acceptance": o.per_position_acceptance,
                    "histogram": o.histogram,
                    "tokens_per_s": o.tokens_per_s,
                    "speedup_vs_target": o.tokens_per_s / target_tps if target_tps > 0 else math.nan,
                    "rounds": o.rounds,
                }
        out["plain_per_prompt_tokens"] = [len(r.tokens) for r in reference]
        out["plain_per_prompt_seconds"] = [float(r.total) for r in reference]
        add_intervals(out, seed=seed)
        runs.append(out)
        if on_run is not None:
            on_run(out)
    return runs


def add_intervals(run: dict[str, Any], seed: int = 0) -> None:
    """Paired bootstrap 95 % intervals over the run's prompts (:func:`~lilicorr_pl.decoding.stats.paired_intervals`).

    Every selector gets ``speedup_ci_low``/``speedup_ci_high`` around ``speedup_vs_target``; every selector but the
    reference (``run["reference_selector"]``, the first named) gets its τ and tokens/s ratios to it, named
    ``…_to_reference`` (``ratio_to_reference``, ``tokens_per_s_ratio_to_reference`` and its ``_robust`` reading).
    Prompts are resampled in pairs because every arm decoded the same prompts, interleaved prompt by prompt.
    """
    from lilicorr_pl.decoding.stats import paired_intervals

    selectors, reference = run["selectors"], run["reference_selector"]
    plain = (run["plain_per_prompt_tokens"], run["plain_per_prompt_seconds"])
    for name, r in selectors.items():
        r.update(paired_intervals(r, None if name == reference else selectors[reference], "reference", plain=plain,
                                  seed=seed))


def format_table(run: dict[str, Any]) -> str:
    from lilicorr_pl.decoding.stats import interval_text, rounds_note

    rule = run.get("draft_sampling")
    lines = [
        f"benchmark={run['benchmark']} T={run['temperature']} max_new_tokens={run['max_new_tokens']} "
        f"prompts={run['num_prompts']} chat_template={run['chat_template']} thinking={run['enable_thinking']}"
        + (f" draft_sampling={rule}" if rule else "")
        + (f" compiled_heads={run.get('compile_mode') or 'default'}" if run.get("compiled_selectors") else "")
        + (f" ({run['compile_wrapper']} wrapper)" if run.get("compile_wrapper") else ""),
        f"target: {run['target_tokens_per_s']:.1f} tok/s   (tau includes the bonus token)",
        f"{'selector':<10} {'tau':>6} {'tok/s':>8} {'speedup':>8} {'head%':>6} {'lossless':>8}  acceptance by position",
    ]
    for name, r in run["selectors"].items():
        acc = " ".join(f"{a:.2f}" for a in r["per_position_acceptance"][:8])
        lines.append(
            f"{name:<10} {r['tau']:>6.2f} {r['tokens_per_s']:>8.1f} {r['speedup_vs_target']:>7.2f}x "
            f"{100 * r['head_time_fraction']:>5.1f} {str(r['lossless']):>8}  {acc}"
        )
        if "point_mass" in r:
            lines.append(f"{'':<10} {r['point_mass']['tau']:>6.2f} (tau with the point-mass rule)")
    dtype = run.get("target_dtype")
    if dtype not in (None, "float32", "float64") and any(r["lossless"] is False for r in run["selectors"].values()):
        lines.append(f"lossless False in {dtype}: a verify of several tokens rounds differently from a one-token step, "
                     "so an output can part from plain decoding's at a near-tie; --dtype float32 checks the decoding "
                     "itself")
    ref = run.get("reference_selector")
    for name, r in run["selectors"].items():  # the paired bootstrap intervals (95 %, over prompts)
        parts = []
        if "speedup_ci_low" in r:
            parts.append(f"speedup {r['speedup_vs_target']:.2f}x "
                         + interval_text(r["speedup_ci_low"], r["speedup_ci_high"], ".2f"))
        if "ratio_to_reference" in r:
            parts.append(f"tau / {ref} {r['ratio_to_reference']:.3f} "
                         + interval_text(r["ci_low"], r["ci_high"], ".3f"))
        if "tokens_per_s_ratio_to_reference" in r:
            parts.append(f"tok/s / {ref} {r['tokens_per_s_ratio_to_reference']:.3f} "
                         + interval_text(r["tps_ci_low"], r["tps_ci_high"], ".3f"))
        if "tokens_per_s_ratio_to_reference_robust" in r:
            parts.append(f"by the median round {r['tokens_per_s_ratio_to_reference_robust']:.3f} "
                         + interval_text(r["tps_robust_ci_low"], r["tps_robust_ci_high"], ".3f"))
        if parts:
            lines.append(f"{name:<10} " + ", ".join(parts))
    note = rounds_note([r.get("per_prompt_rounds") for r in run["selectors"].values()], int(run["num_prompts"]))
    if note:
        lines.append(note)
    return "\n".join(lines)


def decoding_tag(lattice_k: int | None, walk: str | None) -> str:
    """The part of a plot's name for ``--lattice_k`` / ``--walk`` (empty without them): a sweep keeps one plot each."""
    return (f"_k{lattice_k}" if lattice_k is not None else "") + (f"_{walk}" if walk is not None else "")


def plot_path(directory: str | Path, ckpt: str | Path, benchmark: str, temperature: float, decoding: str = "") -> Path:
    """Where ``bench --plot`` draws one temperature of one checkpoint's benchmark: the file name is keyed by the
    checkpoint (its name and a hash of its absolute path, links not followed: two runs' ``last.ckpt`` never share a plot), the benchmark,
    the temperature and the head's serving options (:func:`decoding_tag`), so a rerun replaces its own plot and another
    checkpoint's, or the same checkpoint's at another lattice width, is never taken for it."""
    ckpt = Path(ckpt)
    # The absolute path, links not followed: a `last.ckpt` link moved to each newer checkpoint keeps its plot.
    key = hashlib.sha256(os.path.abspath(ckpt).encode()).hexdigest()[:8]
    name = str(benchmark)
    if name.endswith(".jsonl"):  # a prompts file by its name and a hash of its absolute path, as the checkpoint: two
        # folders' test.jsonl, or a humaneval.jsonl of the user's and the built-in humaneval, never share a plot
        name = f"{Path(name).stem}-{hashlib.sha256(os.path.abspath(name).encode()).hexdigest()[:8]}"
    return Path(directory) / f"acceptance_{ckpt.stem}-{key}_{name}_T{temperature}{decoding}.png"


def plot_acceptance(run: dict[str, Any], directory: str | Path, ckpt: str | Path) -> Path:
    """Per-position conditional acceptance of every selector in one PNG (:func:`plot_path`; the checkpoint, prompt
    count and budget in its title and PNG text); returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lilicorr_pl.files import save_figure

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, r in run["selectors"].items():
        acc = r["per_position_acceptance"]  # NaN where no round reached the position: a gap in the line
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{name} (τ={r['tau']:.2f})")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(accept k | accepted < k)")
    ax.set_ylim(0, 1.02)
    ckpt = Path(ckpt)
    ax.set_title(f"{Path(str(run['benchmark'])).name}, T={run['temperature']}: {ckpt.parent.name}/{ckpt.name}, "
                 f"{run['num_prompts']} prompts x {run['max_new_tokens']} tokens", fontsize=8)
    ax.legend()
    fig.tight_layout()
    options = run.get("serve_options") or {}
    about = {"checkpoint": str(ckpt), **{k: run[k] for k in ("benchmark", "temperature", "num_prompts",
                                                               "max_new_tokens", "seed", "draft_sampling")},
             "selectors": ",".join(run["selectors"]), **{k: v for k, v in options.items() if v is not None}}
    tag = decoding_tag(options.get("lattice_k"), options.get("walk"))
    try:
        return save_figure(fig, plot_path(directory, ckpt, run["benchmark"], run["temperature"], tag), "bench", about)
    finally:
        plt.close(fig)


def check_context(prompts: Any, max_new_tokens: int, target: Any) -> None:
    """Raise when a prompt plus the generation budget runs past the target's trained positions."""
    limit = getattr(target.config, "max_position_embeddings", None)
    if limit is None:
        return
    longest = max(len(ids) for ids in prompts.input_ids)
    if longest >= limit:  # no --max_new_tokens fits: the prompts are the problem
        raise ValueError(
            f"prompts of up to {longest} tokens leave no room in the target's max_position_embeddings {limit}; use "
            "shorter prompts (a .jsonl of your own, or --chat_template no to drop the template's tokens)"
        )
    if longest + max_new_tokens > limit:
        raise ValueError(
            f"--max_new_tokens {max_new_tokens} with prompts of up to {longest} tokens exceeds the target's "
            f"max_position_embeddings {limit}; lower --max_new_tokens to at most {limit - longest}"
        )


def _checked_system(path: Path, target: str | None, served: bool, first: Any, device: str, dtype: str,
                    trust_remote_code: bool, allow_module: Sequence[str], names: list[str], lattice_k: int | None,
                    walk: str | None) -> tuple[Any, Any]:
    """The checkpoint's system (its target not loaded) for ``target``'s config, with the selectors and the head's
    serving options checked against it and the run's chat template read: one line for anything refused."""
    from lilicorr_pl.builtin import builtin_name_of
    from lilicorr_pl.system import DraftSystem

    if served:
        try:  # the directory's config and weights against the target's sizes: one line, before the target loads
            system = DraftSystem.from_export(path, target, dtype=None if dtype == "auto" else dtype,
                                             trust_remote_code=trust_remote_code)
        except (ValueError, FileNotFoundError, OSError) as err:
            raise UserInputError(f"--ckpt {path}: {first_line(err)}") from None
    else:
        with verified_first(first):  # not hashed a second time
            system = DraftSystem.from_checkpoint(path, map_location=device, trust_remote_code=trust_remote_code,
                                                 allow_modules=list(allow_module),  # CheckpointError: one line
                                                 target_path=target, load_target=False,  # after the checks below
                                                 target_dtype=None if dtype == "auto" else dtype,
                                                 builtin_name=builtin_name_of)
    try:
        chosen = [selector_for(name, system) for name in names]
        refuse_one_head_twice(names, chosen)
        serve_lattice(system.head, lattice_k, walk)  # first: a head that is not LiLiCorr has no lattice to serve
        if (lattice_k is not None or walk is not None) and not any(c is system.head for c in chosen):
            raise ValueError(f"--lattice_k and --walk set the checkpoint's trained head's decoding, and --selectors "
                             f"{','.join(names)} does not decode with it; add {system.head.name} "
                             "to --selectors or drop them")
        from lilicorr_pl.data.formats import resolve_chat_template

        # The run's own template, as its data was rendered (a template file recorded on another machine: one line).
        template = resolve_chat_template(system.checkpoint_meta.get("chat_template"),
                                         option="the checkpoint's data.chat_template")
    except (ValueError, FileNotFoundError) as err:
        raise UserInputError(str(err)) from None
    return system, template


def _exported_for(path: Path) -> str | None:
    """The target a served directory written by ``lilicorr export`` names (None: another writer's, or unreadable)."""
    import json

    from lilicorr_pl.interop import EXPORT_MARKER

    try:
        marker = json.loads((path / "config.json").read_text(encoding="utf-8")).get(EXPORT_MARKER)
    except (OSError, ValueError, AttributeError):
        return None
    target = marker.get("target") if isinstance(marker, dict) else None
    return str(target) if target else None


def bench(
    ckpt: str,
    benchmark: str = "humaneval",
    num_prompts: PositiveInt = 16,
    max_new_tokens: PositiveInt = 128,
    temperature: Sequence[NonNegativeFloat] | NonNegativeFloat = (0.0,),
    selectors: Sequence[str] | str = ("top1", "lilicorr"),
    draft_sampling: Literal["both", "proposal", "point_mass"] = "both",
    chat_template: Literal["auto", "yes", "no"] = "auto",
    device: DeviceName | None = None,
    trust_remote_code: bool = False,
    allow_module: Sequence[str] = (),
    seed: int = 0,
    output: str | None = None,
    plot: str | None = None,
    compile: bool = False,
    compile_mode: CompileModeName = "default",
    lattice_k: PositiveInt | None = None,
    walk: Literal["greedy", "viterbi", "top1_start"] | None = None,
    target: str | None = None,
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto",
    prompt_tokens: PositiveInt = 64,
) -> list[dict[str, Any]]:
    """Real speculative-decoding benchmark of a trained checkpoint.

    Every selector runs on the same drafter, prompts and temperature, and is compared with plain target
    decoding measured in the same process; tau always includes the target's bonus token. Everything that
    can be checked (checkpoint, selectors, benchmark, output paths, device, temperatures) is checked before
    the target is loaded. Returns one result dict per temperature.

    Args:
        ckpt: checkpoint written by `lilicorr fit`, or a served drafter directory (`lilicorr export`'s, or a released
            DFlashDraftModel / LiLiCorrDraftModel) with --target.
        benchmark: humaneval, stdlib-heldout, a paper benchmark name, or a prompts .jsonl.
        num_prompts: prompts decoded (the first N of the benchmark).
        max_new_tokens: generation budget per prompt.
        temperature: one or more sampling temperatures (0 = greedy), e.g. 0,1.
        selectors: registered selector names (top1, lilicorr, domino, dspark; top1 or the trained head's) or
            Selector class paths, e.g. top1,lilicorr.
        draft_sampling: T > 0 rule: sampled drafts verified with min(1, p/q) (proposal), deterministic drafts
            accepted iff equal to the target's sample (point_mass), or both (tau reported both ways).
        chat_template: wrap prompts as one user message; auto = chat/math/code benchmarks when the tokenizer
            has a template.
        device: cpu, cuda, cuda:N or mps; default CUDA when available.
        trust_remote_code: allow the target's own code (never taken from the checkpoint).
        allow_module: also trust components from these packages when the checkpoint names them.
        seed: sampling and prompt-selection seed.
        output: write results JSON here (one temperature: the run; several: {"runs": [...]}).
        plot: directory for per-position acceptance PNGs.
        compile: run every selector with weights through torch.compile for deterministic drafts (T = 0 and
            the point-mass rule; sampled drafts and the parameter-free top1 stay eager), as the serving engines
            run heads inside CUDA graphs; needs a C++ compiler on CPU, Triton on GPU.
        compile_mode: torch.compile's mode for those heads; reduce-overhead (CUDA only) also captures each in a CUDA
            graph, one replay per round instead of a launch per kernel, as the engines serve them.
        lattice_k: serve the checkpoint's LiLiCorr head with a narrower lattice, k <= the K it was trained with
            (its rank-ordered candidates; the engines choose k at serving time). Default: the head's own.
        walk: the LiLiCorr head's T = 0 walk: greedy (the method), viterbi (the max-sum ablation) or top1_start (the
            greedy walk from the drafter's top-1 at the first slot: an ablation of the start scores). Default: the
            head's own.
        target: load the target from this directory or hub name instead of the one the checkpoint recorded (the
            same model, moved or cached elsewhere, e.g. a checkpoint trained on another machine).
        dtype: the target's dtype here; auto: a checkpoint's model.target.dtype, the dtype a served directory's
            weights are stored in (an export's is its target's). E.g. float32 to measure a bfloat16-trained drafter on
            a CPU without bf16 matmuls.
        prompt_tokens: the token budget of each standard-library prefix (stdlib-heldout, stdlib-train,
            stdlib-train-docstring), as AcceptanceEval's prompt_tokens sets it for the same prompts.
    """
    from lilicorr_pl.decoding.benchmarks import check_benchmark, read_prompt_file, refuse_chat_records

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    # One value, or a list: in a -c file as on the command line (`temperature: 0.7`, `selectors: top1,lilicorr`).
    temperature = [temperature] if isinstance(temperature, (int, float)) else temperature
    temperatures = [float(t) for t in temperature]
    # Everything checkable is checked before the target (possibly billions of parameters) is loaded.
    path = Path(ckpt)
    if path.suffix == ".safetensors" and path.is_file() and (path.parent / "config.json").is_file():
        raise UserInputError(f"--ckpt {path} is the weights file of the served drafter directory {path.parent}; pass "
                             f"the folder instead: --ckpt {path.parent}" + (" with --target" if target is None else ""))
    for flag, value, fix in (("--output", output, "pass the file to write the results JSON into, or drop --output"),
                             ("--plot", plot, "pass the directory for the plots, or drop --plot")):
        if value is not None and not value.strip():  # an unset shell variable: nothing would be written
            raise UserInputError(f"{flag} is empty; {fix}")
    if not temperatures:
        raise UserInputError("--temperature is empty; give one or more sampling temperatures, e.g. 0 or 0,1")
    if len(set(temperatures)) != len(temperatures):  # each would be measured again, the results file holding both
        raise UserInputError(f"--temperature {','.join(f'{t:g}' for t in temperature)} names a temperature twice; give "
                             "each once")
    served = path.is_dir() and (path / "config.json").is_file()  # a serving directory: ours or a released drafter
    if served and target is None:
        named = _exported_for(path)  # an export names the target it was trained for, as that machine named it
        raise UserInputError(f"--ckpt {path} is a served drafter directory, which does not load its target; pass the "
                             "target model it drafts for with --target (a directory or hub name"
                             + (f"; it was exported for {named}" if named else "") + ")")
    if not served:
        check_checkpoint_file(path)
    try:
        names = parse_selectors(selectors)
        check_benchmark(benchmark, "--benchmark")
        if prompt_tokens < MIN_PREFIX_TOKENS:  # as AcceptanceEval refuses it: a prefix with context before its header
            raise ValueError(f"--prompt_tokens must be >= {MIN_PREFIX_TOKENS} (a code prefix with context before its "
                             f"header), got {prompt_tokens}")
        if benchmark.endswith(".jsonl"):
            prompts = read_prompt_file(benchmark, num_prompts)
            if chat_template == "no":
                refuse_chat_records(benchmark, prompts)
        check_output_paths(output, plot, command="bench")
        if plot:  # a file of a plot's name that this tool did not write (a user's) is never replaced
            from lilicorr_pl.files import check_plot_files

            check_plot_files((plot_path(plot, path, benchmark, t, decoding_tag(lattice_k, walk)) for t in temperatures),
                             "bench")
        check_device(device)
        if compile or compile_mode != "default":
            from lilicorr_pl.decoding.compiled import check_compile_available, check_compile_mode

            check_compile_mode(compile_mode, compile, device)
            if compile:
                check_compile_available(device)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        raise UserInputError(str(err)) from None
    if any(not math.isfinite(t) or t < 0 for t in temperatures):
        raise UserInputError(f"--temperature values must be finite and >= 0, got {temperatures}")
    if num_prompts < 1 or max_new_tokens < 2:  # 1: the prefill's token fills it, no round is drafted (every τ NaN)
        raise UserInputError(f"--num_prompts must be >= 1 and --max_new_tokens >= 2 (the token after the prompt is the "
                             f"target's own; drafting starts at the second), got {num_prompts} and {max_new_tokens}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    first = None
    if target is not None:
        from lilicorr_pl.builtin import is_builtin, resolve_target_option, unbuilt_target_config

        if is_builtin(target) and not served:  # its build may take minutes: a damaged checkpoint is named first
            first = read_verified(path)[1]
        try:
            preview = unbuilt_target_config(target) if is_builtin(target) else None
        except ValueError as err:  # an unknown preset
            raise UserInputError(f"--target: {err}") from None
        if preview is not None:  # not built yet: the drafter and the options are checked against the config the build
            import tempfile  # will have, so a bad one is refused before a build of minutes

            with tempfile.TemporaryDirectory(prefix="lilicorr-target-config-") as folder:
                preview.save_pretrained(folder)
                try:
                    _checked_system(path, folder, served, first, device, dtype, trust_remote_code, allow_module,
                                    names, lattice_k, walk)
                except UserInputError as err:  # named as the user gave it, not by the folder that stood in for it
                    raise type(err)(str(err).replace(folder, target)) from None
        target = resolve_target_option(target)
    system, template = _checked_system(path, target, served, first, device, dtype, trust_remote_code, allow_module,
                                       names, lattice_k, walk)
    meta = system.checkpoint_meta
    weights_digest = None
    if served:
        from lilicorr_pl.data.fingerprint import content_sha256

        weights_digest = content_sha256(path / "model.safetensors")
    chat = {"auto": None, "yes": True, "no": False}[chat_template]
    thinking = bool(meta.get("enable_thinking") or False)
    # The prompts against the target's context before its weights load (minutes for a large model): they need only
    # its tokenizer (the one the target loads with) and config. A too-long budget or prompt, or a prompts file that
    # cannot be read, was said after. They are read once: the benchmark decodes these.
    from lilicorr_pl.decoding.benchmarks import load_prompts

    prompts = None
    try:
        tokenizer = tokenizer_of(str(system.target_path), "--target", system.target_spec.trust_remote_code,
                                 required=False, load_kwargs=system.target_spec.load_kwargs)
    except Exception:  # noqa: BLE001 - a hub name not on this machine, a package it needs: the load says so below
        tokenizer = None
    if tokenizer is not None:
        try:
            prompts = load_prompts(benchmark, tokenizer, num_prompts, chat_template=chat, enable_thinking=thinking,
                                   seed=seed, template=template, prefix_tokens=prompt_tokens)
            check_context(prompts, max_new_tokens, SimpleNamespace(config=system.drafter.target_config))
        except (ValueError, ImportError) as err:
            raise UserInputError(str(err)) from None
    system.load_target()
    system.to(device)

    finished: list[dict[str, Any]] = []
    written = 0  # of them in --output

    def finish(run: dict[str, Any]) -> None:
        """One temperature's result as it ends: printed, and ``--output`` written with every temperature finished so
        far (a failure or Ctrl-C at a later temperature lost the finished ones; before the plots, so a plotting
        failure loses nothing either)."""
        nonlocal written
        # What produced the numbers: the file, its weights' checksum and step, the head's serving options.
        run["checkpoint"] = {"path": os.path.abspath(path), "state_sha256": meta.get(CHECKSUM_KEY),
                             "global_step": system.checkpoint_step}
        if served:  # no training checksum: which weights, by their file's digest (a later --overwrite is told apart)
            run["checkpoint"]["weights_sha256"] = weights_digest
        run["serve_options"] = {"lattice_k": lattice_k, "walk": walk}
        run["target_dtype"] = str(resolve_dtype(system.target_spec.dtype)).removeprefix("torch.")  # bf16: bfloat16
        print(format_table(run))
        finished.append(run)
        if output:
            write_results_json(Path(output), finished[0] if len(temperatures) == 1 else {"runs": finished}, "bench")
            written = len(finished)

    try:
        runs = run_bench(
            system, benchmark, names, temperatures, num_prompts, max_new_tokens,
            chat_template=chat, enable_thinking=thinking, seed=seed,
            timing=torch.device(device).type == "cuda",  # without it, CUDA phase times are launch times
            draft_sampling=draft_sampling, compile=compile, compile_mode=compile_mode,
            template=template, prompt_tokens=prompt_tokens, prompts=prompts, on_run=finish,
        )
    except (ValueError, ImportError) as err:  # prompt loading: bad file, template, missing package
        raise UserInputError(str(err)) from None
    except BaseException:
        if written and written < len(temperatures):
            print(f"[lilicorr] bench: stopped at T = {temperatures[written]}; the finished temperatures "
                  f"({', '.join(str(r['temperature']) for r in finished[:written])}) are in {output}", file=sys.stderr)
        raise
    if output:
        print(f"results: {output}")
    if plot:
        for run in runs:
            print(f"plot: {plot_acceptance(run, plot, path)}")
    return runs
