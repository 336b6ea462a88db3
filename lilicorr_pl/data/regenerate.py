"""Regenerate training responses with the target itself (DESIGN §8).

Drafters learn to predict *the target's* continuations, so the published DFlash drafters are trained
on the target's own answers to the dataset's prompts rather than on the dataset's answers. This
module turns a dataset of prompts into such training data:

- chat records (``messages`` / ShareGPT): everything from the first assistant turn on is dropped; the
  leading system/user messages are rendered with the chat template (``add_generation_prompt=True`` and
  the recorded ``enable_thinking``), the target answers, and the output is
  ``{"messages": [...prompt messages, {"role": "assistant", "content": answer}]}``;
- text records: the text (or its first ``prefix_chars`` characters) is the prompt and the output is
  ``{"prompt": prompt, "completion": continuation}``; prompt/completion records keep their prompt and
  get a new completion.

Every output line also carries ``source_index`` (0-based record index in the input), the input's
``id`` if it had one, and ``generation`` settings (target, template hash, thinking flag, temperature,
max tokens, finish reason), so the thinking flag and template travel with the data.

The run is resumable: records whose ``source_index`` is already in the output are skipped; each line
is appended and flushed as soon as it is generated, so a kill loses at most the batch in flight (a
partial last line is cut off on the next run). A record that raises (bad format, generation error)
counts as failed, is reported, and the run goes on; rerunning retries it.

Generation is plain ``AutoModelForCausalLM.generate``: greedy at ``temperature=0``, sampling otherwise,
left-padded batches.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

import torch
from jsonargparse.typing import NonNegativeFloat, PositiveInt

from lilicorr_pl.checkpoint import UserInputError, first_line
from lilicorr_pl.data.fingerprint import (
    file_sha256,
    fingerprint,
    fingerprint_target,
    fingerprint_tokenizer,
    hub_commit,
    sampled_sha256,
    text_sha256,
)
from lilicorr_pl.files import folders_made, hold_alone, remove_made_folders, write_json_atomic
from lilicorr_pl.progress import progress_bar
from lilicorr_pl.target import (
    DeviceName,
    DTypeName,
    check_device,
    load_causal_lm,
    local_target_path,
    portable,
    refuse_drafter,
    stop_token_ids,
    tokenizer_of,
)
from lilicorr_pl.data.formats import (
    PASSED_MESSAGE_FIELDS,
    SUPPORTED_SUFFIXES,
    DataFormatError,
    check_chat_template,
    _require_pyarrow,
    detect_format,
    effective_chat_template,
    json_error,
    raw_lines,
    record_messages,
    render_chat,
    resolve_chat_template,
)


PROMPT_FORMAT = 2
"""How prompts are rendered, recorded with an output so a resume renders the rest alike (2: a chat prompt's
:data:`PASSED_MESSAGE_FIELDS` reach the template; 1, recorded as nothing, left them out). Raise it when that changes."""


@dataclass
class RegenerationStats:
    """Outcome of one ``regenerate`` run."""

    succeeded: int = 0  # written in this run
    failed: int = 0  # raised; not written: retried by the next run (a record's format: once it is fixed)
    skipped: int = 0  # already in the output file
    errors: list[tuple[int, str]] = field(default_factory=list)  # (source_index, message), first 50

    def __str__(self) -> str:
        return f"succeeded {self.succeeded}, failed {self.failed}, skipped {self.skipped}"


@dataclass
class _Job:
    index: int
    record: dict[str, Any]
    kind: str  # "chat" or "text"
    prompt_ids: list[int]
    prompt_messages: list[dict[str, str]] | None = None
    prompt_text: str | None = None


# ---------------------------------------------------------------------- input / output files
def _iter_input(path: Path) -> Iterator[tuple[int, str, dict[str, Any] | Exception]]:
    """``(source_index, where, record or the parse error)`` for every non-blank jsonl line / parquet row.

    ``source_index`` (0-based, stored in the output) identifies a record for resuming; ``where`` names it for
    people, 1-based like every other message (``data.jsonl line 4``, ``data.parquet row 4``).
    """
    if path.suffix.lower() == ".parquet":
        pq = _require_pyarrow(path)
        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield i, f"{path.name} row {i + 1}", row
        return
    index = 0
    for line_no, raw in raw_lines(path):  # the lines fit reads (a lone \r ends one; a byte order mark is not one)
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            # One bad line is a failed record (counted, reported with its line number), not an abort.
            where = f"{path.name} line {line_no}"
            yield index, where, DataFormatError(
                f"{where}: not valid UTF-8 (byte {err.start}); re-encode the file as UTF-8")
            index += 1
            continue
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise DataFormatError(f"{path.name} line {line_no}: expected a JSON object")
            yield index, f"{path.name} line {line_no}", record
        except json.JSONDecodeError as err:
            yield index, f"{path.name} line {line_no}", DataFormatError(
                f"{path.name} line {line_no}: malformed JSON ({json_error(err)})")
        except DataFormatError as err:
            yield index, f"{path.name} line {line_no}", err
        index += 1


PROVENANCE_SUFFIX = ".provenance.json"


def provenance_path(output: Path) -> Path:
    """The record of what produced ``output`` (input, target, sampling settings), written beside it."""
    return output.with_name(output.name + PROVENANCE_SUFFIX)


def hub_revision(name: str) -> str | None:
    """The commit a hub name resolves to now: the snapshot folder its ``config.json`` comes from (the hub's latest
    with a network, the cache's ``refs`` offline). None when the files are not a hub snapshot."""
    resolved = hub_commit(name)
    return resolved[0] if resolved is not None else None


def _names(path: Path, fh: IO[Any]) -> bool:
    """Whether ``path`` still names the file open as ``fh``."""
    try:
        return os.path.samestat(os.fstat(fh.fileno()), os.stat(path))
    except OSError:  # removed, or a level of it replaced by a file
        return False


@contextlib.contextmanager
def _appending_alone(output: Path, written: list[Path]) -> Iterator[IO[str]]:
    """``output`` open for appending and locked for this run alone (:func:`hold_alone`). The empty file, its settings
    record and the folders a run made are removed again when it stops before writing a record (a refused setting, a
    failed load, Ctrl-C), while it still holds the lock: a run refused by the lock removes nothing, and a folder
    another process made, or removed and made again, is never taken for this run's (:func:`folders_made`)."""
    output = output.resolve()  # a `..` in it names the folders that are made and removed
    busy = (f"another run is writing {output} (a lilicorr regenerate or demo); wait for it to finish, or write to "
            "another file (regenerate's --output)")
    with contextlib.ExitStack() as holding:
        made_folders: dict[Path, tuple[int, int]] = {}
        for attempt in itertools.count():
            made_folders |= holding.enter_context(folders_made(output.parent, f"--output {output}", "regeneration"))
            created = not output.exists()
            try:
                out = open(output, "a", encoding="utf-8")  # noqa: SIM115 - closed below, once its lock is known
            except FileNotFoundError as err:  # its folder removed meanwhile by a run that failed: make it again, once
                if attempt < 3:
                    continue
                # A folder that exists and takes no new file (/proc, a mount that refuses it): it looped for ever.
                raise ValueError(f"--output {output} cannot be created ({err.strerror}); write to another file"
                                 ) from None
            try:
                hold_alone(out, busy)
                if _names(output, out):
                    break
            except BaseException:
                out.close()
                raise
            out.close()  # locked a file a failed run had just removed: open the path again
        with out:
            try:
                yield out
            except BaseException:
                if created and out.tell() == 0 and os.fstat(out.fileno()).st_size == 0:
                    if _names(output, out):  # a file another process put at the path since is not this run's
                        with contextlib.suppress(OSError):  # (Windows removes no open file: an empty one is fresh)
                            output.unlink()
                            for path in written:  # this run's settings record, if it got that far; never an earlier
                                path.unlink(missing_ok=True)
                    remove_made_folders(made_folders)
                raise

TEMPLATE_OPTION = "--chat-template, or the target tokenizer's chat_template"


def _as_chat_prompt(record: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """A record as regeneration reads it, and whether it is a text prompt with no completion yet. A list of messages
    as the prompt, with nothing else to answer from (TRL's conversational prompt-only record), is a chat prompt: the
    record is returned with those turns as its ``messages``."""
    answered = ("messages", "conversations", "completion", "text")
    prompt_only = "prompt" in record and not any(k in record for k in answered)
    if prompt_only and isinstance(record["prompt"], list):
        return {**{k: v for k, v in record.items() if k != "prompt"}, "messages": record["prompt"]}, False
    return record, prompt_only


def prompt_passes_fields(record: Any) -> bool:
    """Whether a chat record's prompt turns (those before its first answer) carry a field the chat template has been
    given since prompt format 2 (:data:`PASSED_MESSAGE_FIELDS`, e.g. a user's ``name``): only such a prompt renders
    otherwise than format 1 rendered it."""
    if not isinstance(record, dict):
        return False
    turns = _as_chat_prompt(record)[0].get("messages")  # the turns _make_job renders
    for turn in turns if isinstance(turns, list) else ():  # ShareGPT turns and text prompts pass no fields
        if not isinstance(turn, dict) or turn.get("role") == "assistant":
            return False
        if any(turn.get(k) is not None for k in PASSED_MESSAGE_FIELDS):
            return True
    return False


LATER_FIELDS = ("stop_token_ids", "tokenizer_sha256")
"""Settings an output's record holds since they were added to it (a record written before lacks them)."""
SAMPLING_STREAMS = 2
"""How sampled answers draw their randomness: 2, batches aligned on multiples of the batch size in the input's
order, each sampling from a stream seeded by its first record (:func:`batch_seed`); before, one stream for the whole
run from ``--seed``, which a resume restarted, so the records after a stop drew the draws the first records had
drawn."""


def batch_seed(seed: int, first_index: int) -> int:
    """The seed of the batch whose first record is ``first_index``: distinct for every batch and every ``--seed``."""
    digest = hashlib.sha256(f"lilicorr regenerate {int(seed)} {int(first_index)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def answered_by_another_target(data_file: str | os.PathLike, target: str | os.PathLike | None) -> str | None:
    """Why the answers in a file ``lilicorr regenerate`` wrote are not ``target``'s own: the settings record beside it
    names a target whose config and weight files hash otherwise (another model, or other weights under the same path).
    None where they are the target's, where the file has no such record, or where the two cannot be compared (a hub
    name, a record of sampled-window digests). The weight files are hashed once per file version (a memo)."""
    record = provenance_path(Path(data_file))
    if target is None or not _is_settings_record(record) or not Path(target).is_dir():
        return None
    saved = json.loads(record.read_text(encoding="utf-8"))
    recorded, dtype = saved.get("target_fingerprint"), saved.get("dtype")
    if saved.get("target_hash") != "content" or not isinstance(recorded, str) or not isinstance(dtype, str):
        return None
    # As regenerate keyed it (its target's torch dtype, and its name as recorded): the files alone are compared.
    now = fingerprint(fingerprint_target({"name_or_path": str(target), "dtype": f"torch.{dtype}"}, include_layers=False,
                                         name=str(saved.get("target"))))
    if now == recorded:
        return None
    return (f"{Path(data_file).name} holds answers lilicorr regenerate wrote with the target {saved.get('target')} (its "
            f"{record.name}), whose config and weight files are not those of model.target {target}: the drafter "
            "learns another model's continuations; regenerate the data with this target, or train against that one")


def _is_settings_record(record: Path) -> bool:
    """Whether ``record`` reads as the settings record :func:`regenerate` writes beside its output."""
    try:
        saved = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(saved, dict) and {"input_sha256", "target", "max_new_tokens"} <= set(saved)


def check_provenance(output: Path, provenance: dict[str, Any], sampled_target: Callable[[], str] | None = None,
                     renders_as_before: Callable[[], bool] | None = None,
                     target_named: Callable[[str], str] | None = None) -> None:
    """Refuse to append to an output produced from another input, target or sampling settings. ``sampled_target``:
    the target's fingerprint by the sampled-window rule, for an output recorded before whole-content digests.
    ``renders_as_before``: whether the input's prompts render as prompt format 1 rendered them, for an output recorded
    before ``prompt_format``. ``target_named``: the target's fingerprint as if it stood at the recorded path, for a
    built-in target's build recorded in another cache folder (the same key-bearing name): the same target where its
    files hash the same."""
    record = provenance_path(output)
    if not output.exists() or output.stat().st_size == 0:
        if record.is_symlink() or (record.exists() and not _is_settings_record(record)):
            raise ValueError(f"--output {output}: {record} exists and is not a settings record lilicorr regenerate "
                             "wrote, and this run would replace it; move it away, or choose another --output")
        return
    if not record.is_file():
        raise ValueError(
            f"--output {output} exists but has no {record.name} saying what produced it; resuming onto it could "
            "mix sources: choose a new --output (or move the file away)"
        )
    try:
        saved = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        saved = None
    if not isinstance(saved, dict):
        raise ValueError(
            f"--output {output}: {record} is not the JSON object lilicorr regenerate writes there (damaged or replaced), "
            "so resuming cannot be checked; choose a new --output (or move both files away)"
        )
    if "target_hash" in provenance and "target_hash" not in saved:
        # Recorded before whole-content digests: its target compared by the sampled rule it was recorded with.
        provenance = {k: v for k, v in provenance.items() if k != "target_hash"}
        if sampled_target is not None and saved.get("target_fingerprint") is not None:
            provenance["target_fingerprint"] = sampled_target()
    # Recorded since the stop ids and the tokenizer were found to change the answers unseen: an output recorded
    # before is compared without them, as it was then.
    provenance = {k: v for k, v in provenance.items() if k not in LATER_FIELDS or k in saved}
    format_1 = "prompt_format" in provenance and "prompt_format" not in saved  # checked last: it reads the input
    if format_1:
        provenance = {k: v for k, v in provenance.items() if k != "prompt_format"}
    if "sampling_streams" not in saved and not (saved.get("temperature") or 0) > 0:  # a greedy output resumed with
        provenance = {k: v for k, v in provenance.items() if k != "sampling_streams"}  # sampling: said as that, below
    unrecorded = sorted(set(provenance) - set(saved))
    if unrecorded:
        raise ValueError(
            f"--output {output} was written by an earlier lilicorr version, whose record lacks {', '.join(unrecorded)}, "
            "so resuming cannot be checked; choose a new --output (the finished lines stay usable as training data)"
        )
    # Another path, the same key-bearing name: a built-in target's build in another cache folder (a moved build).
    moved = saved.get("target") != provenance.get("target") and \
        portable(saved.get("target")) == portable(provenance.get("target"))
    if moved and target_named is not None and "target_hash" in saved \
            and target_named(str(saved["target"])) == saved.get("target_fingerprint"):
        provenance = {**provenance, "target": saved["target"], "target_fingerprint": saved["target_fingerprint"]}
    differing = sorted(k for k in set(saved) | set(provenance) if saved.get(k) != provenance.get(k))
    if differing:
        detail = "; ".join(f"{k}: {saved.get(k)!r} -> {provenance.get(k)!r}" for k in differing)
        why = ""
        if saved.get("target_fingerprint") is None and provenance.get("target_fingerprint") is not None \
                and saved.get("target") == provenance.get("target"):
            why = (f" (an earlier version read --target {provenance.get('target')} as a hub name and recorded no "
                   "weights, so this output cannot be checked against the directory's)")
        raise ValueError(
            f"--output {output} was produced with other settings ({detail}){why}; resuming would mix sources: "
            "choose a new --output, or rerun with the original settings"
        )
    if format_1 and (renders_as_before is None or not renders_as_before()):
        raise ValueError(
            f"--output {output} was written by an earlier lilicorr version, whose prompts left the messages' "
            f"{', '.join(PASSED_MESSAGE_FIELDS)} out of the chat template, and --input's prompts carry them; "
            "resuming would mix two renderings: choose a new --output (the finished lines stay usable as training "
            "data)"
        )


def _done_indices(output: Path) -> set[int]:
    """Source indices already written; cuts off a partial last line left by a killed run. Any other line that is
    not a record this command wrote (damaged, edited) is refused, naming it: resuming would skip its record silently
    and append that record again."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        with open(output, "rb+") as f:
            f.truncate(keep)
        print(f"[lilicorr] regenerate: removed a partial last line from {output}", file=sys.stderr)
        data = data[:keep]
    done = set()
    for number, line in enumerate(data.split(b"\n")[:-1], start=1):
        try:
            rec = json.loads(line.decode("utf-8"))
            done.add(int(rec["source_index"]))
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise ValueError(
                f"--output {output} line {number} is not a record lilicorr regenerate wrote "
                f"({first_line(err, with_type=True)}); remove or repair that line, then resume"
            ) from None
    return done


# ---------------------------------------------------------------------- prompts
def prompt_messages(messages: list[dict[str, str]], where: str = "record") -> list[dict[str, str]]:
    """The leading messages before the first assistant turn (must include a user message)."""
    head = []
    for m in messages:
        if m["role"] == "assistant":
            break
        head.append(m)
    if not any(m["role"] == "user" for m in head):
        raise DataFormatError(f"{where}: no user message before the first assistant turn; nothing to answer")
    return head


def _make_job(
    index: int,
    record: dict[str, Any],
    tokenizer: Any,
    *,
    enable_thinking: bool,
    chat_template: str | None,
    prefix_chars: int | None,
    where: str | None = None,
) -> _Job:
    where = where or f"record {index + 1}"
    # A prompt with no completion yet is what regeneration answers (bench reads the same records).
    record, prompt_only = _as_chat_prompt(record)
    fmt = "prompt_completion" if prompt_only else detect_format(record, where)
    if fmt in ("messages", "sharegpt"):
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise DataFormatError(
                f"{where}: chat record but the target's tokenizer has no chat template; pass --chat-template "
                "or use a chat model"
            )
        head = prompt_messages(record_messages(record, fmt, where), where)
        text = render_chat(
            tokenizer, head, enable_thinking=enable_thinking, chat_template=chat_template, add_generation_prompt=True,
            where=where, option=TEMPLATE_OPTION,
        )
        ids = list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
        return _Job(index, record, "chat", ids, prompt_messages=head)
    prompt = record["text"] if fmt == "text" else record["prompt"]
    if not isinstance(prompt, str) or not prompt:
        raise DataFormatError(f"{where}: empty or non-string prompt")
    if fmt == "text" and prefix_chars is not None:
        prompt = prompt[:prefix_chars]
    ids = list(tokenizer(prompt, verbose=False)["input_ids"])
    if not ids:
        raise DataFormatError(f"{where}: prompt tokenizes to nothing")
    return _Job(index, record, "text", ids, prompt_text=prompt)


def _generation_config(target: str, config: Any) -> Any:
    """The generation config the model will load with: its ``generation_config.json``, else the one transformers
    derives from the model config. Read before the model loads, so the stop ids are in the output's record."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(target)
    except OSError:  # none saved: what from_pretrained gives the model
        return GenerationConfig.from_model_config(config)


def _generate(
    model: Any,
    jobs: Sequence[_Job],
    *,
    pad_id: int,
    stop_ids: list[int],
    max_new_tokens: int,
    temperature: float,
) -> list[tuple[list[int], str]]:
    """Left-padded batched generation → per job (new token ids up to the first stop, finish reason)."""
    device = next(model.parameters()).device
    width = max(len(j.prompt_ids) for j in jobs)
    ids = torch.full((len(jobs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(jobs), width), dtype=torch.long)
    for r, job in enumerate(jobs):
        n = len(job.prompt_ids)
        ids[r, width - n :] = torch.tensor(job.prompt_ids, dtype=torch.long)
        attn[r, width - n :] = 1
    kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "eos_token_id": stop_ids, "pad_token_id": pad_id}
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False)
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), **kwargs)
    results = []
    for r in range(len(jobs)):
        new = out[r, width:].tolist()
        finish = "length"
        for k, t in enumerate(new):
            if t in stop_ids:
                new, finish = new[:k], "stop"
                break
        results.append((new, finish))
    return results


# ---------------------------------------------------------------------- the command
def regenerate(
    target: str,
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    max_new_tokens: int = 1024,
    temperature: float = 0.0,
    batch_size: int = 8,
    enable_thinking: bool = False,
    limit: int | None = None,
    seed: int = 0,
    progress: bool = True,
    prefix_chars: int | None = None,
    chat_template: str | None = None,
    dtype: str = "auto",
    device: str | None = None,
) -> RegenerationStats:
    """Answer every prompt of ``input_path`` with the target and append the results to ``output_path``.

    Args:
        target: hub name or local directory of the target (model and tokenizer).
        input_path: ``.jsonl``/``.parquet`` of chat, text or prompt/completion records.
        output_path: ``.jsonl`` to append to; existing lines are kept and their records skipped.
        max_new_tokens: generation budget per record.
        temperature: 0 = greedy; > 0 samples with that temperature (no top-k/top-p).
        batch_size: records per ``generate`` call (left-padded).
        enable_thinking: the chat template's thinking flag (record it: training and evaluation must use
            the same value).
        limit: only consider the first ``limit`` input records.
        seed: torch seed for sampling.
        progress: show a progress bar.
        prefix_chars: for text records, use only the first ``prefix_chars`` characters as the prompt.
        chat_template: Jinja template (text or file) overriding the tokenizer's.
        dtype: target weights dtype; ``auto`` = bfloat16 on CUDA, float32 on CPU.
        device: where to run; None = CUDA when available.
    """
    from transformers import AutoConfig

    from lilicorr_pl.target import resolve_dtype

    input_path, output_path = Path(input_path), Path(output_path)
    if not input_path.is_file():
        why = "is a directory; pass the .jsonl file in it" if input_path.is_dir() else "does not exist"
        raise FileNotFoundError(f"regeneration input {str(input_path)!r} {why} (--input)")
    if input_path.suffix.lower() not in SUPPORTED_SUFFIXES:  # every line would fail as malformed JSON, one by one
        raise ValueError(f"--input {input_path} has suffix {input_path.suffix!r}; pass a "
                         f"{'/'.join(SUPPORTED_SUFFIXES)} file of chat, text or prompt/completion records")
    if output_path.is_dir():
        raise ValueError(f"--output {output_path} is a directory; pass a .jsonl file name such as "
                         f"{output_path / 'train.jsonl'}")
    if output_path.suffix.lower() != ".jsonl":  # what it writes, and what fit and resume read back
        raise ValueError(f"--output {output_path} must be a .jsonl file (regeneration writes JSON lines); "
                         f"pass e.g. {output_path.with_suffix('.jsonl')}")
    if input_path.resolve() == output_path.resolve():
        raise ValueError(f"--output must differ from --input ({input_path}); regeneration appends to the output")
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens ({max_new_tokens}) and batch_size ({batch_size}) must be >= 1")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 (or unset for every record), got {limit}")
    if str(target).startswith("builtin:"):
        # builtin.TARGET_PRESETS, spelled out: an edge module, not imported here (a test holds the two together)
        raise ValueError(f"--target {target}: regenerate needs a model directory or hub name; pass the directory "
                         "`lilicorr build-target` prints for the preset of the built-in target (builtin:tiny: --preset "
                         "test, builtin:quick: --preset quick, builtin:full: --preset full)")
    # A hub name is "org/name"; anything path-like must exist here (not transformers' "Repo id must be..." error).
    where = local_target_path(target)
    if where is not None:
        if not Path(where).is_dir():
            why = "is a file, not a model directory" if Path(where).exists() else "does not exist"
            if Path(where).suffix == ".ckpt" and Path(where).exists():
                why += "; a training checkpoint drafts, it does not generate"
            raise FileNotFoundError(f"--target {target} {why}; pass the target model's directory or hub name")
        target = where
    template = resolve_chat_template(chat_template, option="--chat-template")

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_device(device)  # before the model loads (it was an AssertionError from torch after the load)
    torch_dtype = (torch.bfloat16 if str(device).startswith("cuda") else torch.float32) if dtype == "auto" else resolve_dtype(dtype)
    try:  # the config and tokenizer first, each named in one line: not a transformers message after the lock
        config = AutoConfig.from_pretrained(target)
    except (OSError, ValueError) as err:
        raise ValueError(f"--target {target} is not a model directory or reachable hub model "
                         f"({first_line(err, with_type=True)}); pass the target model's directory "
                         "(saved with save_pretrained) or hub name") from None
    refuse_drafter(config, target, "--target")
    try:
        tokenizer = tokenizer_of(target, "--target")
    except UserInputError:
        raise
    except (OSError, ValueError) as err:
        raise ValueError(f"--target {target}: its tokenizer does not load "
                         f"({first_line(err, with_type=True)}); save the target's tokenizer beside its "
                         "weights (tokenizer.save_pretrained into that directory)") from None
    stop_ids = stop_token_ids(tokenizer, config, _generation_config(target, config))

    def target_fingerprint(**how: Any) -> str:
        """The target's key (``how``: fingerprint_target's file_hash or recorded name)."""
        return fingerprint(fingerprint_target({"name_or_path": str(target), "dtype": str(torch_dtype)},
                                              include_layers=False, **how))

    provenance = {
        "input_sha256": file_sha256(input_path),
        "target": str(target),
        # A local model's weights as well as its config (whole-content digests of the weight files, read once per
        # file version), and the precision and device kind they run in: each changes the greedy answers. A hub name
        # is keyed by its name and the commit it resolves to (target_revision, below): its cached files change as
        # they download, so hashing them would refuse its own resume.
        "target_fingerprint": target_fingerprint() if where is not None else None,
        "dtype": str(torch_dtype).removeprefix("torch."),
        "device_type": torch.device(device).type,
        "temperature": float(temperature),
        "max_new_tokens": int(max_new_tokens),
        "enable_thinking": bool(enable_thinking),
        "chat_template_sha256": text_sha256(effective_chat_template(tokenizer, template)),
        "prefix_chars": prefix_chars,
        "seed": int(seed) if temperature > 0 else None,
        "prompt_format": PROMPT_FORMAT,
        # Where answers stop and how prompts become ids: the tokenizer's files and generation_config.json, which the
        # target's fingerprint (config and weights) does not read.
        "stop_token_ids": stop_ids,
        "tokenizer_sha256": fingerprint(fingerprint_tokenizer(tokenizer)),
    }
    if temperature > 0:
        # Sampled answers draw from a stream seeded per batch by its first record (SAMPLING_STREAMS): a resume goes on
        # with the draws an uninterrupted run makes, and no batch repeats another's. The batch size shapes the draws.
        # An output recorded before (one stream for the whole run, restarted by every resume) is refused as such.
        provenance["sampling_streams"] = {"rule": SAMPLING_STREAMS, "batch_size": int(batch_size)}
    if where is None:  # a hub name: the commit it resolves to, so a new revision on the hub is not appended to an old one's
        provenance["target_revision"] = hub_revision(str(target))
    else:
        provenance["target_hash"] = "content"  # whole-file digests (an output recorded before: sampled windows)

    written: list[Path] = []  # what this run wrote beside the output: removed with it when the run writes no record
    with _appending_alone(output_path, written) as out:  # locked before the model is loaded, and for the whole run
        check_provenance(output_path, provenance,  # before the model is loaded
                         lambda: target_fingerprint(file_hash=sampled_sha256),
                         lambda: not any(prompt_passes_fields(r) for _, _, r in _iter_input(input_path)),
                         lambda recorded: target_fingerprint(name=recorded))
        context = getattr(config, "max_position_embeddings", None)
        if context is not None and max_new_tokens >= context:
            raise ValueError(f"max_new_tokens {max_new_tokens} does not fit the target's context of {context} "
                             "positions; lower --max-new-tokens")
        stats = RegenerationStats()
        done = _done_indices(output_path)
        where_of: dict[int, str] = {}  # source_index -> "data.jsonl line 4": every message names records 1-based

        def describe(index: int, err: BaseException) -> str:
            where, text = where_of[index], str(err)
            return text if text.startswith(where) else f"{where}: {type(err).__name__}: {text}"

        def attempt(index: int, record: dict[str, Any]) -> _Job | Exception:
            """The record's job, or why it cannot be answered (a bad record fails alone)."""
            try:
                return _make_job(index, record, tokenizer, enable_thinking=enable_thinking, chat_template=template,
                                 prefix_chars=prefix_chars, where=where_of[index])
            except Exception as err:  # noqa: BLE001
                return err

        # None: already in the output; a parse error; the record (made into a job, its prompt tokenized, as its
        # batch comes: a million prompts' ids are not held at once).
        entries: list[tuple[int, Any]] = []
        for index, where, record in _iter_input(input_path):
            if limit is not None and index >= limit:
                break
            where_of[index] = where
            entries.append((index, None if index in done else record))
        # A template that does not parse is this run's setting to fix, said once before the model loads (not once per
        # chat record after it, as if each were the input's to fix).
        chat_keys = {"messages", "conversations"}
        if any(isinstance(e, dict) and chat_keys & _as_chat_prompt(e)[0].keys() for _, e in entries):
            check_chat_template(tokenizer, template, TEMPLATE_OPTION)
        # Before the model loads, records are made into jobs until one can be answered: a file none of whose records
        # can be is one line now, not a failure per record after the load.
        answerable = False
        for n, (index, entry) in enumerate(entries):
            if isinstance(entry, dict):
                entries[n] = (index, attempt(index, entry))
                if isinstance(entries[n][1], _Job):
                    answerable = True
                    break
        if not entries and not done:  # it loaded the model and wrote an empty output, exit status 0
            raise ValueError(f"--input {input_path} holds no records (it is empty or blank); nothing to regenerate")
        problems = [(i, e) for i, e in entries if isinstance(e, BaseException)]
        if problems and not answerable and not done:  # a resume counts them, as the first run did
            raise ValueError(f"none of the {len(problems)} record(s) of --input {input_path} left to answer can be "
                             f"answered; the first: {describe(*problems[0])}")

        model = load_causal_lm(target, "--target", dtype=torch_dtype).to(device).eval()
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad_id is None:
            pad_id = 0
        generation_meta = {
            "target": str(target),
            "enable_thinking": bool(enable_thinking),
            "temperature": float(temperature),
            "max_new_tokens": int(max_new_tokens),
            "chat_template_sha256": text_sha256(effective_chat_template(tokenizer, template)),
        }

        if not done:  # nothing written yet: this run's settings are the output's (an earlier run's record only:
            # check_provenance refused any other file there)
            write_json_atomic(provenance_path(output_path), provenance)
            written.append(provenance_path(output_path))

        def fail(index: int, err: BaseException) -> None:
            stats.failed += 1
            msg = describe(index, err)
            if len(stats.errors) < 50:
                stats.errors.append((index, msg))
            # A record that cannot be read or answered fails the same way every time: it is the input's to fix.
            # Fixing it changes --input, which this output's record names by its hash: a run on the fixed input
            # writes a new --output (resuming this one would mix two inputs, and is refused).
            retry = ("fix it in --input and regenerate into a new --output" if isinstance(err, DataFormatError)
                     else "retried by the next run")
            print(f"[lilicorr] regenerate: failed, {retry}: {msg}", file=sys.stderr)

        bar = progress_bar(total=len(entries), unit="rec", desc="regenerate", disable=not progress, dynamic_ncols=True)

        def write(job: _Job, new_ids: list[int], finish: str) -> None:
            text = tokenizer.decode(new_ids, skip_special_tokens=True)
            line: dict[str, Any] = {"source_index": job.index}
            if "id" in job.record:
                line["id"] = job.record["id"]
            if job.kind == "chat":
                line["messages"] = [*job.prompt_messages, {"role": "assistant", "content": text}]
            else:
                line["prompt"] = job.prompt_text
                line["completion"] = text
            line["generation"] = {**generation_meta, "finish": finish, "new_tokens": len(new_ids)}
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
            out.flush()
            stats.succeeded += 1

        def run(batch: list[_Job]) -> None:
            if temperature > 0:  # this batch's own stream (SAMPLING_STREAMS)
                torch.manual_seed(batch_seed(seed, batch[0].index))
            try:
                results = _generate(model, batch, pad_id=pad_id, stop_ids=stop_ids, max_new_tokens=max_new_tokens,
                                    temperature=temperature)
            except Exception as err:  # noqa: BLE001 - isolate the failing record, keep going
                if len(batch) == 1:
                    fail(batch[0].index, err)
                    return
                for job in batch:
                    run([job])
                return
            for job, (new_ids, finish) in zip(batch, results):
                try:
                    write(job, new_ids, finish)
                except Exception as err:  # noqa: BLE001
                    fail(job.index, err)

        pending: list[_Job] = []
        for index, entry in entries:
            if entry is None:
                stats.skipped += 1
                bar.update(1)
                continue
            if isinstance(entry, dict):
                entry = attempt(index, entry)
            if isinstance(entry, BaseException):
                fail(index, entry)
                bar.update(1)
                continue
            if temperature > 0 and pending and entry.index // batch_size != pending[0].index // batch_size:
                run(pending)  # sampled batches keep to their multiples of the batch size (SAMPLING_STREAMS): a
                bar.update(len(pending))  # resume after a stop between them draws what an uninterrupted run draws
                pending = []
            pending.append(entry)
            if len(pending) >= batch_size:
                run(pending)
                bar.update(len(pending))
                pending = []
        if pending:
            run(pending)
            bar.update(len(pending))
        bar.close()
        return stats  # reported by its callers: the command on stdout, the demo in its log


def regenerate_command(
    target: str,
    input: str,  # noqa: A002 - the command line's --input
    output: str,
    max_new_tokens: PositiveInt = 1024,
    temperature: NonNegativeFloat = 0.0,
    batch_size: PositiveInt = 8,
    limit: PositiveInt | None = None,
    enable_thinking: bool = False,
    prefix_chars: PositiveInt | None = None,
    chat_template: str | None = None,
    seed: int = 0,
    dtype: Literal["auto"] | DTypeName = "auto",
    device: DeviceName | None = None,
    progress: bool = True,
) -> int:
    """Answer a dataset's prompts with the target model to make drafter training data (resumable).

    Appends to the output and skips the records it already holds; refuses an output produced from another
    input, target or sampling settings. Exit status 1 when some records failed (rerun to retry them).

    Args:
        target: hub name or local directory of the target model.
        input: .jsonl/.parquet of chat, text or prompt/completion records.
        output: .jsonl to append to (existing records are skipped).
        max_new_tokens: generation budget per record.
        temperature: 0 = greedy, > 0 = sampling with that temperature.
        batch_size: records per generate call.
        limit: only the first N input records.
        enable_thinking: pass enable_thinking=True to the chat template.
        prefix_chars: text records: the prompt is the first N characters.
        chat_template: Jinja chat template (text or file) overriding the tokenizer's.
        seed: sampling seed.
        dtype: auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16 or float16.
        device: cuda, cuda:1 or cpu; default CUDA when available.
        progress: show a progress bar.
    """
    from lilicorr_pl.checkpoint import stop_on_sigterm

    try:
        with stop_on_sigterm():  # a cancelled job: one line and exit status 143; every record written stays
            stats = regenerate(
                target, input, output, max_new_tokens=max_new_tokens, temperature=temperature, batch_size=batch_size,
                enable_thinking=enable_thinking, limit=limit, seed=seed, progress=progress, prefix_chars=prefix_chars,
                chat_template=chat_template, dtype=dtype, device=device,
            )
    except (ValueError, FileNotFoundError) as err:  # settings, checked before the model loads
        raise UserInputError(str(err)) from None
    print(f"regenerate: {stats} -> {output}")
    return 1 if stats.failed else 0
