"""A tiny but real Qwen3 target model, trained offline on the Python standard library.

The embedded demo must run without a model hub, yet a drafter only learns something meaningful from a
target that has learned something. :func:`build_tiny_target` trains one from scratch on CPU:

1. a byte-level BPE (Qwen's pre-tokenizer regex) on the training split of :mod:`lilicorr_pl.data.corpus`, with
   ``<|endoftext|>`` (eos and pad), ``<|im_start|>`` and ``<|im_end|>`` appended after the learned
   vocabulary, as in Qwen;
2. a ``Qwen3ForCausalLM`` whose embedding has more rows than the tokenizer has tokens (rounded up to
   a multiple of 64), like Qwen3's 151,936 rows for 151,669 tokens; the first padded row,
   ``len(tokenizer)``, is recorded as ``mask_token_id`` (Qwen3's 151669) for DFlash drafters;
3. plain-PyTorch pre-training on a packed token stream: raw files plus a share of ChatML samples
   ("user: code ending in a ``def``/``class`` header" → "assistant: its body"), so that the chat
   template is something the model has actually seen;
4. an evaluation on held-out modules (loss, top-1 accuracy, repetition of generated text).

The result is a directory that ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` load,
cached under a fingerprint of everything it depends on and written atomically, with a
``build_report.json`` that doubles as its manifest.

Chat template: Qwen-style ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``, no default system
message). ``add_generation_prompt`` appends ``<|im_start|>assistant\\n``. ``enable_thinking`` is
accepted so that Qwen3 callers work unchanged, but it changes nothing: the tiny target has no thinking
mode and never emits a think block.

Run ``lilicorr build-target --preset quick`` to build one and print its report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import math
import os
import random
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from lilicorr_pl.checkpoint import UserInputError
from lilicorr_pl.data import corpus
from lilicorr_pl.files import check_writable_dir, new_file_mode, remove_gone_writers, temporary_name, writer_tag
from lilicorr_pl.progress import progress_bar

#: Bump whenever a change here changes what gets built; old caches are then rebuilt, not reused.
BUILDER_VERSION = 1

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)

#: Qwen2/Qwen3's pre-tokenizer split: words, single digits, punctuation runs, and whitespace runs
#: that keep indentation together (important for Python).
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{#- ChatML as in Qwen3, without a default system message. `enable_thinking` is accepted for "
    "compatibility with Qwen3 callers and ignored: this model has no thinking mode. -#}\n"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

REPORT_NAME = "build_report.json"
WEIGHTS_NAME = "model.safetensors"
BUILD_FILES = frozenset({REPORT_NAME, WEIGHTS_NAME, "config.json", "generation_config.json", "tokenizer.json",
                         "tokenizer_config.json", "chat_template.jinja"})
"""Every file a build writes (its manifest lists them all but the report): what a rebuild may replace."""

# A one-line def/class header, and the indentation that opens it (to find where its body ends).
_HEADER_RE = re.compile(r"^(\s*)(?:async\s+def|def|class)\s+\w+.*:\s*(?:#.*)?$")


@dataclass(frozen=True)
class TinyTargetConfig:
    """Everything that determines a tiny target build; every field enters the cache fingerprint."""

    name: str = "custom"
    """Human-readable preset name, used in the cache directory name."""
    vocab_size: int = 4096
    """Tokenizer size: learned BPE tokens plus the 3 special tokens. The model's embedding has more
    rows (see ``vocab_pad_multiple``)."""
    vocab_pad_multiple: int = 64
    """Embedding rows = the smallest multiple of this strictly larger than ``vocab_size``, so padded
    rows exist (the first one is the DFlash ``mask_token_id``), as in Qwen3."""
    hidden_size: int = 160
    """Residual-stream width."""
    num_hidden_layers: int = 16
    """Decoder layers. Deep and narrow on purpose: a 2-layer drafter then costs a small fraction of a
    target step (as 5 drafter layers do against Qwen3-8B's 36), and verifying a block of 8 tokens costs
    about what one decoding step does, because per-layer overhead, not arithmetic, dominates at this width."""
    num_attention_heads: int = 2
    """Query heads."""
    num_key_value_heads: int = 1
    """Key/value heads (grouped-query attention, as in Qwen3); must divide ``num_attention_heads``."""
    head_dim: int = 80
    """Width of each attention head."""
    intermediate_size: int = 480
    """SwiGLU MLP width."""
    max_seq_len: int = 512
    """Training window and ``max_position_embeddings``; keep prompt + generation within it."""
    rope_theta: float = 1_000_000.0
    """RoPE base, Qwen3's value."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon, Qwen3's value."""
    tie_word_embeddings: bool = False
    """Share embedding and LM head. Qwen3-8B does not (small Qwen3 models do)."""
    train_steps: int = 450
    """Optimizer steps (450 × 4 × 512 ≈ 0.9 M tokens: about 15 minutes on 2 cores without native bf16)."""
    batch_size: int = 4
    """Windows of ``max_seq_len + 1`` tokens per step, sampled at random from the packed stream."""
    lr: float = 6e-3
    """Peak AdamW learning rate (for embeddings, LM head and norms when ``optimizer="muon"``)."""
    min_lr_ratio: float = 0.1
    """The cosine schedule decays to ``lr * min_lr_ratio``."""
    warmup_steps: int = 50
    """Linear warmup steps."""
    optimizer: str = "muon"
    """``"muon"``: Muon for the decoder's weight matrices, AdamW (``lr``) for embeddings, LM head and
    norms (measured: held-out loss 5.54 vs 6.27 for AdamW after the same 200 steps); or ``"adamw"``
    for everything (then use ``lr`` ≈ 3e-3). Torch without ``torch.optim.Muon`` falls back to AdamW."""
    muon_lr: float = 0.015
    """Muon's peak learning rate (Keller Jordan's shape adjustment)."""
    weight_decay: float = 0.1
    """AdamW decay on weight matrices. Embeddings and norms are not decayed, so padded embedding rows
    (the mask row among them) keep their random initialisation instead of shrinking to zero."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    chat_fraction: float = 0.15
    """Share of training characters drawn from ChatML "complete this def/class body" samples."""
    corpus_max_bytes: int | None = None
    """Use only the first this-many bytes of training files (whole files), for fast test builds;
    ``None`` uses the whole training split."""
    eval_tokens: int = 32768
    """Held-out tokens scored for loss and top-1 accuracy."""
    eval_prefixes: int = 16
    """Held-out prompts continued to measure repetition."""
    eval_prefix_tokens: int = 64
    """Token budget of each held-out prompt."""
    eval_new_tokens: int = 128
    """Tokens generated per prompt (greedy and at temperature 1)."""
    seed: int = 0
    """Seeds data sampling, initialisation and evaluation sampling."""

    @classmethod
    def full(cls) -> TinyTargetConfig:
        """The demo target: the best quality a one-time build of about 25 minutes on 2 CPU cores allows.

        The field defaults are this preset (16 layers of width 160, ~6.3 M parameters, ~0.9 M training
        tokens ≈ 0.35 epochs of the training split, about 15 minutes on 2 cores).
        """
        return cls(name="full")

    @classmethod
    def quick(cls) -> TinyTargetConfig:
        """A smaller build of about 2-3 minutes on 2 CPU cores, for trying the demo quickly."""
        return cls(
            name="quick", hidden_size=192, num_hidden_layers=6, num_attention_heads=3, num_key_value_heads=1,
            intermediate_size=576, max_seq_len=256, train_steps=250, batch_size=4, warmup_steps=30,
            eval_tokens=16384,
        )

    @classmethod
    def test(cls) -> TinyTargetConfig:
        """A seconds-long build for unit tests: tiny everything, still a real trained Qwen3."""
        return cls(
            name="test", vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=128, max_seq_len=64, train_steps=40,
            batch_size=8, warmup_steps=5, corpus_max_bytes=300_000, eval_tokens=2048,
            eval_prefixes=2, eval_prefix_tokens=24, eval_new_tokens=16,
        )

    @classmethod
    def preset(cls, name: str) -> TinyTargetConfig:
        """The preset called ``name`` (``full``, ``quick`` or ``test``)."""
        presets: dict[str, Callable[[], TinyTargetConfig]] = {
            "full": cls.full, "quick": cls.quick, "test": cls.test,
        }
        if name not in presets:
            raise ValueError(f"Unknown tiny-target preset {name!r}; choose one of {sorted(presets)} "
                             "or pass a TinyTargetConfig.")
        return presets[name]()

    @property
    def embedding_rows(self) -> int:
        """Rows of the model's embedding and LM head: padded past the tokenizer, like Qwen3."""
        return (self.vocab_size // self.vocab_pad_multiple + 1) * self.vocab_pad_multiple

    @property
    def mask_token_id(self) -> int:
        """The first padded embedding row, used as the DFlash MASK token (Qwen3: 151669)."""
        return self.vocab_size

    def validate(self) -> None:
        """Raise ``ValueError`` on settings that cannot build, before any heavy work starts."""
        if self.vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
            raise ValueError(f"vocab_size={self.vocab_size} leaves no room for merges beyond the 256 byte tokens "
                             f"and {len(SPECIAL_TOKENS)} special tokens; use at least 512.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}; pick kv heads that divide it.")
        if self.eval_prefix_tokens + self.eval_new_tokens > self.max_seq_len:
            total = self.eval_prefix_tokens + self.eval_new_tokens
            raise ValueError(f"eval_prefix_tokens + eval_new_tokens = {total} "
                             f"exceeds max_seq_len={self.max_seq_len}, where RoPE positions were never trained; "
                             "shorten the evaluation or raise max_seq_len.")
        if self.optimizer not in ("muon", "adamw"):
            raise ValueError(f"optimizer={self.optimizer!r} is not supported; use 'muon' or 'adamw'.")
        if not 0.0 <= self.chat_fraction < 1.0:
            raise ValueError(f"chat_fraction={self.chat_fraction} must lie in [0, 1).")
        if self.train_steps < 1 or self.batch_size < 1 or self.warmup_steps < 0:
            raise ValueError(f"train_steps={self.train_steps}, batch_size={self.batch_size} and "
                             f"warmup_steps={self.warmup_steps} must be positive (warmup may be 0).")


# --------------------------------------------------------------------------------------------------
# Cache location and fingerprint


def default_cache_root() -> Path:
    """The project's cache folder (:func:`lilicorr_pl.files.cache_root`)."""
    from lilicorr_pl.files import cache_root

    return cache_root()


def build_fingerprint(config: TinyTargetConfig) -> str:
    """A hash of the builder version, the config, the corpus and the torch/transformers major versions."""
    import transformers

    key = {
        "builder_version": BUILDER_VERSION,
        "config": dataclasses.asdict(config),
        "corpus": corpus.corpus_fingerprint(),
        "chat_template": CHAT_TEMPLATE,
        "pretokenizer": PRETOKENIZE_REGEX,
        "torch_major": torch.__version__.split(".")[0],
        "transformers_major": transformers.__version__.split(".")[0],
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_build_report(directory: str | Path) -> dict[str, Any]:
    """The ``build_report.json`` of a built tiny target (config, metrics, manifest)."""
    path = Path(directory) / REPORT_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: {directory} is not a finished tiny-target build. "
                                "Build one with lilicorr_pl.demo.tiny_target.build_tiny_target().")
    return json.loads(path.read_text())


def _cache_problem(directory: Path, fingerprint: str) -> str | None:
    """Why a cached build cannot be used, or ``None`` if its report and every listed file check out."""
    if not directory.exists():
        return "not built yet"
    try:
        report = load_build_report(directory)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:  # a damaged report: the build is redone
        return f"unreadable build report ({type(error).__name__})"
    if not isinstance(report, dict):
        return "build report is not a JSON object"
    if report.get("fingerprint") != fingerprint:
        return f"fingerprint {report.get('fingerprint')} != expected {fingerprint}"
    manifest: dict[str, dict[str, Any]] = report.get("files", {})
    if not isinstance(manifest, dict) or not all(isinstance(e, dict) for e in manifest.values()):
        return "the build report's file list is not the one a build writes"
    if WEIGHTS_NAME not in manifest or "config.json" not in manifest or "tokenizer.json" not in manifest:
        return "manifest lacks weights, config or tokenizer"
    for name, entry in manifest.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry.get("bytes") or _sha256(path) != entry.get("sha256"):
            return f"{name} does not match its manifest checksum"
    return None


def _foreign_entries(directory: Path) -> list[str]:
    """What a build's folder holds that no build wrote (a user's notes): everything but :data:`BUILD_FILES` and the
    files its manifest lists."""
    if not directory.is_dir():
        return []
    written = set(BUILD_FILES)
    with contextlib.suppress(UnicodeDecodeError, json.JSONDecodeError, OSError, AttributeError, TypeError):
        written |= set(load_build_report(directory).get("files", {}))
    return sorted(entry.name for entry in directory.iterdir() if entry.name not in written)


def _refuse_what_no_build_wrote(final: Path, problem: str | None) -> None:
    """Raise when a build at ``final`` would replace what no build wrote: a file or anything else but a folder or a
    link there (renamed aside, it was later removed as a killed build's leftover), or, for a rebuild (``problem``:
    why), a symbolic link (a valid build it names is used, never replaced by a folder) or files in the build's
    folder that no build wrote (a user's notes)."""
    if os.path.lexists(final) and not final.is_symlink() and not final.is_dir():
        kind = "a file" if final.is_file() else "not a folder"
        raise UserInputError(f"{final} is {kind}, which no build wrote, and a build writes its folder at that path; "
                             "move it away, then rerun")
    if problem is None:
        return
    if final.is_symlink():
        raise UserInputError(f"{final} is a symbolic link (to {os.readlink(final)}), and a rebuild ({problem}) would "
                             "replace it with a folder; move it away, then rerun")
    foreign = _foreign_entries(final)
    if foreign:  # a rebuild replaces the folder whole: never with what no build wrote in it
        raise UserInputError(
            f"{final} holds {', '.join(foreign[:3])}{' and more' if len(foreign) > 3 else ''}, which no build wrote, "
            f"and a rebuild ({problem}) replaces that folder; move those out of it, then rerun")


def _identity(path: Path) -> tuple[int, int] | None:
    """Which build folder is at ``path`` (its inode and status-change time, which a rename moves on: an inode number
    alone is reused once the folder it named is deleted), or ``None`` when nothing is there."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns


def _publish(temporary: Path, final: Path, fingerprint: str, seen: tuple[int, int] | None) -> bool:
    """Rename the finished build ``temporary`` to ``final``; False when a valid build is kept there instead. What is
    there (an invalid build, or ``seen``, the folder a forced rebuild replaces) is renamed aside just before and
    removed only after, so ``final`` is missing for one rename, not for a deletion. A valid build another process
    published since it was last looked at stands: moved aside, it is put back and this build is discarded."""
    trash = None
    if os.path.lexists(final):
        # Named like a temporary: a kill before it is removed leaves nothing the next build's clean-up does not find.
        trash = temporary_name(final)
        os.rename(final, trash)
        moved = os.lstat(trash).st_ino  # a rename keeps the inode (its status-change time moves on)
        if (seen is None or moved != seen[0]) and _cache_problem(trash, fingerprint) is None:
            try:
                os.rename(trash, final)
            except OSError:  # yet another build published meanwhile: that one stands, the one aside is removed
                shutil.rmtree(trash, ignore_errors=True)
            return False
    try:
        os.rename(temporary, final)
    except OSError:
        if _cache_problem(final, fingerprint) is not None:
            if trash is not None:  # put back what was there rather than leave the path empty
                with contextlib.suppress(OSError):
                    os.rename(trash, final)
            raise
        published = False
    else:
        published = True
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    return published


# --------------------------------------------------------------------------------------------------
# Tokenizer and data


def _log(progress: bool, message: str) -> None:
    if progress:
        print(f"[tiny_target] {message}", file=sys.stderr, flush=True)


def _training_texts(config: TinyTargetConfig) -> list[str]:
    texts = []
    total = 0
    for text in corpus.read_corpus("train"):
        if config.corpus_max_bytes is not None and total >= config.corpus_max_bytes:
            break
        texts.append(text)
        total += len(text.encode("utf-8"))
    return texts


def train_tokenizer(texts: Sequence[str], config: TinyTargetConfig) -> Any:
    """A byte-level BPE of ``config.vocab_size`` tokens, wrapped as a ``transformers`` fast tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size - len(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    # Special tokens go after the learned vocabulary, as in Qwen (<|endoftext|> = 151643 there).
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        extra_special_tokens=[IM_START, IM_END],
        model_max_length=config.max_seq_len,
        chat_template=CHAT_TEMPLATE,
    )
    if len(tokenizer) != config.vocab_size:
        # Too small a corpus cannot supply enough merges; a shorter vocabulary would silently move
        # the mask row, so refuse instead.
        raise ValueError(f"The BPE learned only {len(tokenizer)} of vocab_size={config.vocab_size} tokens from "
                         f"{sum(map(len, texts))} characters; lower vocab_size or raise corpus_max_bytes.")
    return tokenizer


def _leading_space(line: str) -> int:
    return len(line) - len(line.lstrip())


def chat_samples(texts: Sequence[str], tokenizer: Any, target_chars: int, seed: int) -> list[str]:
    """ChatML samples: the user sends code ending in a ``def``/``class`` header, the assistant its body.

    Candidates are one-line headers whose body (the following lines indented deeper, 2-48 lines) is
    complete; the user's context is 4-40 lines ending at the header. Samples are drawn with
    ``random.Random(seed)`` until their rendered length reaches ``target_chars``.
    """
    rng = random.Random(seed)
    candidates: list[tuple[int, int, int]] = []  # (text index, header line, body end line)
    split_texts = [text.splitlines(keepends=True) for text in texts]
    for text_index, lines in enumerate(split_texts):
        for line_index, line in enumerate(lines):
            match = _HEADER_RE.match(line)
            if not match:
                continue
            indent = len(match.group(1).expandtabs())
            end = line_index + 1
            while end < len(lines) and (not lines[end].strip() or _leading_space(lines[end]) > indent):
                end += 1
            while end > line_index + 1 and not lines[end - 1].strip():  # trailing blank lines are not body
                end -= 1
            if 2 <= end - line_index - 1 <= 48:
                candidates.append((text_index, line_index, end))
    rng.shuffle(candidates)
    samples: list[str] = []
    chars = 0
    for text_index, header, end in candidates:
        if chars >= target_chars:
            break
        lines = split_texts[text_index]
        start = max(0, header - rng.randint(3, 39))
        messages = [
            {"role": "user", "content": "".join(lines[start : header + 1])},
            {"role": "assistant", "content": "".join(lines[header + 1 : end])},
        ]
        sample = tokenizer.apply_chat_template(messages, tokenize=False)
        samples.append(sample)
        chars += len(sample)
    return samples


def _token_stream(documents: Sequence[str], tokenizer: Any) -> torch.Tensor:
    """All documents tokenized and packed into one stream, each followed by ``<|endoftext|>``."""
    encodings = tokenizer.backend_tokenizer.encode_batch(list(documents), add_special_tokens=False)
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for encoding in encodings:
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


# --------------------------------------------------------------------------------------------------
# Model, training, evaluation


def special_token_id(config: TinyTargetConfig, token: str) -> int:
    """A special token's id: :func:`train_tokenizer` adds them, in order, after the learned vocabulary."""
    return config.vocab_size - len(SPECIAL_TOKENS) + SPECIAL_TOKENS.index(token)


def model_config(config: TinyTargetConfig) -> Any:
    """The ``Qwen3Config`` of a build of ``config``: a padded vocabulary, the tokenizer's special ids, the MASK row."""
    from transformers import Qwen3Config

    eos_id = special_token_id(config, EOS_TOKEN)
    model_config = Qwen3Config(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=config.embedding_rows,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=eos_id,  # Qwen3 also uses <|endoftext|> as bos
        eos_token_id=eos_id,
        pad_token_id=eos_id,  # the tokenizer pads with <|endoftext|>
        dtype="float32",
    )
    # transformers 4.x (which serving engines pin) reads a top-level rope_theta; without it it silently uses 10000.
    model_config.rope_theta = config.rope_theta
    # Not a Qwen3Config field: the DFlash MASK row, saved with the config for drafters to read.
    model_config.mask_token_id = config.mask_token_id
    return model_config


def make_model(config: TinyTargetConfig, tokenizer: Any) -> Any:
    """An untrained ``Qwen3ForCausalLM`` of :func:`model_config`, whose ids are ``tokenizer``'s."""
    from transformers import GenerationConfig, Qwen3ForCausalLM

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    if ids != {token: special_token_id(config, token) for token in SPECIAL_TOKENS} or tokenizer.pad_token != EOS_TOKEN:
        raise ValueError(f"the tokenizer's special ids {ids} are not the ones the model config names")
    torch.default_generator.manual_seed(config.seed)  # the CPU's alone: a GPU's generators are the caller's
    model = Qwen3ForCausalLM(model_config(config))
    # Stop at <|endoftext|> (raw code) and at <|im_end|> (chat), as Qwen3's generation config does.
    eos_id = ids[EOS_TOKEN]
    model.generation_config = GenerationConfig(bos_token_id=eos_id, eos_token_id=[eos_id, ids[IM_END]],
                                               pad_token_id=eos_id)
    return model


def _lr_lambda(config: TinyTargetConfig) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, config.train_steps - config.warmup_steps)
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _make_optimizers(model: Any, config: TinyTargetConfig) -> list[torch.optim.Optimizer]:
    """AdamW for everything, or Muon for the decoder's weight matrices plus AdamW for the rest.

    Embeddings and norms are never decayed: padded embedding rows (the mask row among them) get no
    gradient and should keep their random initialisation rather than shrink to zero.
    """
    named = list(model.named_parameters())
    is_embedding = lambda name: "embed_tokens" in name or "lm_head" in name  # noqa: E731
    if config.optimizer == "muon":
        matrices = [p for n, p in named if p.ndim == 2 and not is_embedding(n)]
        rest = [(n, p) for n, p in named if not (p.ndim == 2 and not is_embedding(n))]
        # No decay: Muon's decoupled decay scales with its ~10x larger lr, and these runs are far
        # too short to need regularising.
        if bf16_matmul_is_faster(min(config.hidden_size, config.intermediate_size)):
            muon = torch.optim.Muon(matrices, lr=config.muon_lr, weight_decay=0.0, momentum=0.95,
                                    adjust_lr_fn="original")
        else:
            # torch's Muon runs Newton-Schulz in bf16, which CPUs without native bf16 emulate: measured
            # 6 s per step here against 0.02 s in fp32. Same update, fp32 iteration.
            muon = Fp32Muon(matrices, lr=config.muon_lr, momentum=0.95)
    else:
        muon, rest = None, named
    decay = [p for n, p in rest if p.ndim >= 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in rest if not (p.ndim >= 2 and "embed_tokens" not in n)]
    adamw = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    return [adamw] if muon is None else [muon, adamw]


class Fp32Muon(torch.optim.Optimizer):
    """Muon (Nesterov momentum, then a quintic Newton-Schulz orthogonalisation of each 2-D update)
    with the iteration in fp32: ``torch.optim.Muon``'s update and "original" learning-rate adjustment
    (``lr * sqrt(max(1, rows / cols))``), for CPUs where bf16 matmuls are emulated."""

    def __init__(self, params: Any, lr: float, momentum: float = 0.95, ns_steps: int = 5,
                 ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315), eps: float = 1e-7) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, ns_steps=ns_steps,
                                      ns_coefficients=ns_coefficients, eps=eps))

    @staticmethod
    def orthogonalize(grad: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                      eps: float) -> torch.Tensor:
        a, b, c = coefficients
        x = grad.float()
        wide = x.shape[0] <= x.shape[1]
        x = x if wide else x.T
        x = x / x.norm().clamp(min=eps)  # spectral norm <= 1
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x if wide else x.T

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                buf = state.setdefault("momentum_buffer", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"])  # Nesterov
                update = self.orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
                scale = math.sqrt(max(1.0, p.shape[0] / p.shape[1]))
                p.add_(update.to(p.dtype), alpha=-group["lr"] * scale)
        return None


class ThreadTuner:
    """Re-picks torch's intra-op thread count while training, by timing real steps.

    On a machine whose cores are shared with other jobs, an OpenMP barrier waits for the thread
    whose core is busy, and a 2-thread step measured several times slower than a 1-thread one. Every
    ``period`` steps the first ``trials`` steps run with each candidate count; the rest of the period
    uses the fastest. Results do not depend on the choice beyond float summation order.
    """

    def __init__(self, max_threads: int, period: int = 100, trials: int = 2) -> None:
        self.candidates = sorted({max_threads, max(1, max_threads // 2)}, reverse=True)
        self.period, self.trials = period, trials
        self.best = self.candidates[0]
        self._times: dict[int, list[float]] = {}

    def threads_for(self, step: int) -> int:
        """The thread count to use for ``step`` (also applied with ``torch.set_num_threads``)."""
        phase = step % self.period
        exploring = len(self.candidates) > 1 and phase < len(self.candidates) * self.trials
        threads = self.candidates[phase // self.trials] if exploring else self.best
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return threads

    def record(self, step: int, threads: int, seconds: float) -> None:
        """Report how long ``step`` took; closes an exploration phase by choosing the fastest count."""
        phase = step % self.period
        if phase >= len(self.candidates) * self.trials or len(self.candidates) == 1:
            return
        self._times.setdefault(threads, []).append(seconds)
        if phase == len(self.candidates) * self.trials - 1:
            # Skip the first trial of each count: it pays for resizing the thread pool.
            self.best = min(self._times, key=lambda t: sum(self._times[t][1:] or self._times[t]))
            self._times.clear()


def bf16_matmul_is_faster(hidden_size: int, threads: int | None = None) -> bool:
    """Whether bf16 matmuls beat fp32 by ≥ 1.3x on this CPU (native AVX512-BF16/AMX do; emulation doesn't)."""
    a32, b32 = torch.randn(2048, hidden_size), torch.randn(hidden_size, 4 * hidden_size)
    a16, b16 = a32.bfloat16(), b32.bfloat16()

    def best_of(a: torch.Tensor, b: torch.Tensor) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        return min(times)  # the minimum is the least disturbed by other jobs on the machine

    best_of(a16, b16)  # warm up the bf16 kernels
    return best_of(a32, b32) / best_of(a16, b16) >= 1.3


def train_model(model: Any, stream: torch.Tensor, config: TinyTargetConfig, progress: bool = True) -> dict[str, Any]:
    """Pre-train ``model`` in place on random windows of ``stream``; returns timing and the loss curve.

    The forward runs under bf16 autocast when this CPU multiplies bf16 natively (about 2x faster on
    AVX512-BF16; weights, optimizer and loss stay fp32), else in fp32.
    """
    window = config.max_seq_len + 1
    if stream.numel() <= window:
        raise ValueError(f"The training stream has {stream.numel()} tokens, fewer than one window of {window}; "
                         "raise corpus_max_bytes or lower max_seq_len.")
    optimizers = _make_optimizers(model, config)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, _lr_lambda(config)) for o in optimizers]
    generator = torch.Generator().manual_seed(config.seed)
    offsets = torch.arange(window)
    tuner = ThreadTuner(_training_threads(config))
    use_bf16 = bf16_matmul_is_faster(config.hidden_size)
    model.train()
    curve: list[tuple[int, float]] = []
    running, running_steps, skipped = 0.0, 0, 0
    log_every = max(1, config.train_steps // 50)
    tokens_per_step = config.batch_size * config.max_seq_len
    start = time.perf_counter()
    bar = progress_bar(range(config.train_steps), desc="tiny target", disable=not progress, mininterval=2.0)
    for step in bar:
        threads = tuner.threads_for(step)
        step_start = time.perf_counter()
        starts = torch.randint(0, stream.numel() - window, (config.batch_size,), generator=generator)
        batch = stream[starts[:, None] + offsets].long()  # [batch, T + 1]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
            logits = model(input_ids=batch[:, :-1]).logits  # [batch, T, rows]
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        finite = bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm))
        for optimizer, scheduler in zip(optimizers, schedulers):
            if finite:  # a non-finite step is skipped, not applied: one bad batch must not poison every weight
                optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        if not finite:
            skipped += 1
            if skipped > max(5, config.train_steps // 20):
                raise RuntimeError(f"{skipped} non-finite training steps by step {step + 1}; lower lr/muon_lr")
            continue
        running += loss.item()
        running_steps += 1
        tuner.record(step, threads, time.perf_counter() - step_start)
        if (step + 1) % log_every == 0 or step + 1 == config.train_steps:
            curve.append((step + 1, round(running / running_steps, 4)))
            elapsed = time.perf_counter() - start
            bar.set_postfix(loss=f"{running / running_steps:.3f}",
                            tok_s=f"{(step + 1) * tokens_per_step / elapsed:.0f}", threads=threads)
            running, running_steps = 0.0, 0
    bar.close()
    seconds = time.perf_counter() - start
    model.eval()
    torch.set_num_threads(tuner.best)  # evaluation runs under the same conditions
    return {
        "train_seconds": round(seconds, 1),
        "train_tokens": config.train_steps * tokens_per_step,
        "train_tokens_per_second": round(config.train_steps * tokens_per_step / seconds, 1),
        "train_bf16_autocast": use_bf16,
        "train_skipped_nonfinite_steps": skipped,
        "train_loss_curve": curve,
    }


@torch.no_grad()
def heldout_metrics(model: Any, stream: torch.Tensor, config: TinyTargetConfig) -> dict[str, float]:
    """Mean next-token loss and top-1 accuracy over ``config.eval_tokens`` held-out tokens.

    The tokens are scored in windows of ``max_seq_len`` spread evenly over the held-out stream (so
    every held-out module contributes), each window predicting its own tokens 2..T+1.
    """
    window = config.max_seq_len + 1
    num_windows = max(1, config.eval_tokens // config.max_seq_len)
    if stream.numel() < window:
        raise ValueError(f"The held-out stream has only {stream.numel()} tokens; it needs at least {window}.")
    starts = torch.linspace(0, stream.numel() - window, num_windows).long()
    total_loss, total_correct, total = 0.0, 0, 0
    for chunk in starts.split(16):
        batch = stream[chunk[:, None] + torch.arange(window)].long()
        logits = model(input_ids=batch[:, :-1]).logits.float()
        labels = batch[:, 1:]
        flat_logits = logits.reshape(-1, logits.shape[-1])  # [windows * T, rows]
        total_loss += F.cross_entropy(flat_logits, labels.reshape(-1), reduction="sum").item()
        total_correct += (logits.argmax(-1) == labels).sum().item()
        total += labels.numel()
    return {"heldout_loss": round(total_loss / total, 4), "heldout_top1": round(total_correct / total, 4),
            "heldout_tokens": total}


def repetition_rate(sequences: Sequence[Sequence[int]], n: int = 4) -> float:
    """Fraction of the n-grams in each sequence that already occurred earlier in the same sequence.

    Pooled over all sequences (repeated n-grams / all n-grams); 0.0 when there are no n-grams.
    """
    repeated, total = 0, 0
    for sequence in sequences:
        seen: set[tuple[int, ...]] = set()
        for i in range(len(sequence) - n + 1):
            gram = tuple(sequence[i : i + n])
            repeated += gram in seen
            total += 1
            seen.add(gram)
    return repeated / total if total else 0.0


@torch.no_grad()
def generate_continuations(model: Any, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int,
                           temperature: float, seed: int) -> list[list[int]]:
    """Continue each prompt (batched, left-padded); each result is cut before its first stop token."""
    encoded = [tokenizer.encode(prompt, add_special_tokens=False) for prompt in prompts]
    width = max(map(len, encoded))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded])
    sampling: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        # top_k=0 / top_p=1: sample from the full distribution, not generate()'s default top-50.
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    device = next(model.parameters()).device  # the generator that samples, alone (a build's: the CPU's)
    (torch.default_generator if device.type == "cpu" else torch).manual_seed(seed)
    output = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                            **sampling)
    stops = set(model.generation_config.eos_token_id)
    continuations = []
    for row in output[:, width:].tolist():
        cut = next((i for i, token in enumerate(row) if token in stops), len(row))
        continuations.append(row[:cut])
    return continuations


def evaluate(model: Any, tokenizer: Any, heldout_stream: torch.Tensor, config: TinyTargetConfig) -> dict[str, Any]:
    """Held-out loss/top-1 and the 4-gram repetition rate of greedy and T=1 continuations."""
    metrics: dict[str, Any] = dict(heldout_metrics(model, heldout_stream, config))
    prompts = corpus.heldout_prefixes(tokenizer, config.eval_prefixes, config.eval_prefix_tokens, seed=config.seed)
    for name, temperature in (("t0", 0.0), ("t1", 1.0)):
        continuations = generate_continuations(model, tokenizer, prompts, config.eval_new_tokens, temperature,
                                               config.seed)
        metrics[f"repetition_rate_{name}"] = round(repetition_rate(continuations), 4)
        metrics[f"mean_new_tokens_{name}"] = round(sum(map(len, continuations)) / len(continuations), 1)
        metrics[f"sample_{name}"] = {"prompt": prompts[0], "continuation": tokenizer.decode(continuations[0])}
    # The same statistic on real held-out code of the same length, to read the numbers above against.
    length = config.eval_new_tokens
    chunks = heldout_stream[: (heldout_stream.numel() // length) * length].view(-1, length)  # [chunks, length]
    chosen = torch.linspace(0, chunks.shape[0] - 1, min(64, chunks.shape[0])).long()
    metrics["repetition_rate_reference"] = round(repetition_rate(chunks[chosen].tolist()), 4)
    return metrics


# --------------------------------------------------------------------------------------------------
# Build orchestration


def _build_into(directory: Path, config: TinyTargetConfig, fingerprint: str, progress: bool) -> dict[str, Any]:
    """Train tokenizer and model, evaluate, and save everything (report last) into ``directory``."""
    import transformers

    started = time.perf_counter()
    texts = _training_texts(config)
    _log(progress, f"training a {config.vocab_size}-token BPE on {len(texts)} stdlib files")
    tokenizer = train_tokenizer(texts, config)

    raw_chars = sum(map(len, texts))
    chat_target = int(raw_chars * config.chat_fraction / (1 - config.chat_fraction))
    documents = texts + chat_samples(texts, tokenizer, chat_target, config.seed)
    random.Random(config.seed).shuffle(documents)
    train_stream = _token_stream(documents, tokenizer)
    heldout_stream = _token_stream(list(corpus.read_corpus("heldout")), tokenizer)
    _log(progress, f"{train_stream.numel():,} training tokens ({len(documents) - len(texts)} chat samples), "
                   f"{heldout_stream.numel():,} held-out tokens")

    model = make_model(config, tokenizer)
    num_params = sum(p.numel() for p in model.parameters())
    _log(progress, f"training Qwen3 with {num_params / 1e6:.2f} M parameters for {config.train_steps} steps "
                   f"of {config.batch_size}x{config.max_seq_len} tokens on {torch.get_num_threads()} threads")
    training = train_model(model, train_stream, config, progress=progress)
    _log(progress, "evaluating on held-out modules")
    metrics = evaluate(model, tokenizer, heldout_stream, config)

    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    files = {
        path.name: {"bytes": path.stat().st_size, "sha256": _sha256(path)}
        for path in sorted(directory.iterdir()) if path.is_file()
    }
    report = {
        "fingerprint": fingerprint,
        "builder_version": BUILDER_VERSION,
        "config": dataclasses.asdict(config),
        "num_params": num_params,
        "vocab_size": len(tokenizer),
        "embedding_rows": config.embedding_rows,
        "mask_token_id": config.mask_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "im_end_token_id": tokenizer.convert_tokens_to_ids(IM_END),
        "uniform_loss": round(math.log(len(tokenizer)), 4),
        "train_stream_tokens": train_stream.numel(),
        "train_epochs": round(training["train_tokens"] / train_stream.numel(), 2),
        **training,
        **metrics,
        "build_seconds": round(time.perf_counter() - started, 1),
        "num_threads": torch.get_num_threads(),
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "corpus_fingerprint": corpus.corpus_fingerprint(),
        "files": files,
    }
    # Written last: its presence (with a matching manifest) is what marks a build as complete.
    (directory / REPORT_NAME).write_text(json.dumps(report, indent=2))
    return report


def _training_threads(config: TinyTargetConfig) -> int:
    """All cores, except one for test-size models: their matmuls are too small to split, and the
    OpenMP barriers of a 2-thread step stall for whole scheduler slices when the cores are shared."""
    if config.hidden_size * config.num_hidden_layers < 1024:
        return 1
    return os.cpu_count() or 1


def _build_place(preset: str | TinyTargetConfig, cache_dir: str | Path | None,
                 progress: bool) -> tuple[TinyTargetConfig, Path, str, Path]:
    """The config a build of ``preset`` trains, its cache root, fingerprint and folder."""
    config = TinyTargetConfig.preset(preset) if isinstance(preset, str) else preset
    config.validate()
    if config.optimizer == "muon" and not hasattr(torch.optim, "Muon"):
        # Resolved before fingerprinting, so the cache key names the optimizer actually used.
        _log(progress, f"torch {torch.__version__} has no torch.optim.Muon; training with AdamW (lr 3e-3) instead")
        config = dataclasses.replace(config, optimizer="adamw", lr=3e-3)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    fingerprint = build_fingerprint(config)
    return config, root, fingerprint, root / f"tiny-target-{config.name}-{fingerprint}"


def build_folder(preset: str | TinyTargetConfig, cache_dir: str | Path | None = None) -> Path:
    """The folder a build of ``preset`` is published at (:func:`build_tiny_target` returns it), built or not."""
    return _build_place(preset, cache_dir, progress=False)[3]


def unbuilt_model_config(preset: str | TinyTargetConfig, cache_dir: str | Path | None = None) -> Any:
    """The ``Qwen3Config`` a build of ``preset`` will have, when no valid build is cached (``None`` when one is): what
    a command checks its settings against before it starts a build of minutes."""
    config, _, fingerprint, final = _build_place(preset, cache_dir, progress=False)
    return None if _cache_problem(final, fingerprint) is None else model_config(config)


def build_tiny_target(
    preset: str | TinyTargetConfig = "full",
    cache_dir: str | Path | None = None,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Build (or reuse from cache) a tiny Qwen3 target trained on the stdlib; returns its directory.

    The directory loads with ``AutoModelForCausalLM.from_pretrained`` and
    ``AutoTokenizer.from_pretrained`` and holds ``build_report.json`` (see :func:`load_build_report`).

    Args:
        preset: ``"full"`` (≈25 min on 2 CPU cores), ``"quick"`` (≈2-3 min), ``"test"`` (seconds), or a
            :class:`TinyTargetConfig`.
        cache_dir: where builds live; defaults to :func:`default_cache_root`. Each build is a
            subdirectory named by its fingerprint, reused only if its report and checksums match.
        force: rebuild even if a valid cached build exists.
        progress: print stages and a training progress bar to stderr.
    """
    config, root, fingerprint, final = _build_place(preset, cache_dir, progress)
    name = final.name
    _refuse_what_no_build_wrote(final, None)
    seen = _identity(final)
    problem = "rebuild forced" if force else _cache_problem(final, fingerprint)
    if problem is None:
        _log(progress, f"using cached build {final}")
        return final
    _refuse_what_no_build_wrote(final, problem)
    try:  # a cache folder that is a file (or not writable) was a traceback at the mkdir
        check_writable_dir(root, f"{'--cache_dir' if cache_dir is not None else 'the cache folder (LILICORR_CACHE)'} "
                                 f"{root}")
    except ValueError as err:
        raise UserInputError(str(err)) from None
    _log(progress, f"building {final} ({problem})")  # once it can be built there
    root.mkdir(parents=True, exist_ok=True)
    # Temporary folders of this build's killed runs (one on another host sharing the cache is left alone for a day).
    remove_gone_writers(root, f".{glob.escape(name)}.*.tmp", untagged=True)
    temporary = root / f".{name}.{writer_tag()}.tmp"
    temporary.mkdir()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(_training_threads(config))
    try:
        # The build seeds torch's CPU generator (its init, its batches): the caller's stream goes on as if no build
        # had run. A fit seeded by seed_everything builds its target afterwards, and drew another drafter
        # initialisation and other anchors than the same fit with the target cached. (It runs on the CPU and seeds no
        # GPU generator: that would replace the seed seed_everything queued for a GPU not yet initialised.)
        with torch.random.fork_rng(devices=[]):
            report = _build_into(temporary, config, fingerprint, progress)
        mode = new_file_mode(root)  # safetensors writes 0600: a cache a group shares must be readable like its JSON
        for path in temporary.iterdir():
            if path.is_file():
                with contextlib.suppress(OSError):  # a file system without modes: the build stands as written
                    os.chmod(path, mode)
        # Checked again now: a concurrent build of the same target may have published a valid folder while this one
        # trained, and others may already use it. It is kept (this build is discarded); only the folder seen at the
        # start is what --force replaces.
        problem = "rebuild forced" if force and _identity(final) == seen else _cache_problem(final, fingerprint)
        if problem is not None:
            _refuse_what_no_build_wrote(final, problem)
            if not _publish(temporary, final, fingerprint, seen):
                problem = None
    finally:
        torch.set_num_threads(previous_threads)
        shutil.rmtree(temporary, ignore_errors=True)
    if problem is None:
        _log(progress, f"another build of {final} finished first; using it")
    else:
        _log(progress, f"built {final} in {report['build_seconds']} s: held-out loss {report['heldout_loss']}, "
                       f"top-1 {report['heldout_top1']}")
    return final


def build_target(
    preset: Literal["quick", "full", "test"] = "quick",
    cache_dir: str | None = None,
    force: bool = False,
    quiet: bool = False,
) -> Path:
    """Build (or reuse) the built-in stdlib target and print its directory and build report.

    The ``builtin:tiny``/``builtin:quick``/``builtin:full`` names in configs are these builds (tiny = the test
    preset); ``lilicorr fit`` builds a missing one itself, showing the same progress. Returns the directory.

    Args:
        preset: test (seconds), quick (2-3 minutes) or full (~20 minutes on 2 CPU cores).
        cache_dir: cache root (default: $LILICORR_CACHE, $XDG_CACHE_HOME/lilicorr_pl or ~/.cache/lilicorr_pl).
        force: rebuild even if a valid cached build exists.
        quiet: no progress output.
    """
    directory = build_tiny_target(preset, cache_dir=cache_dir, force=force, progress=not quiet)
    report = load_build_report(directory)
    report.pop("files", None)
    report.pop("train_loss_curve", None)
    print(json.dumps(report, indent=2))
    print(f"\ntiny target: {directory}")
    return directory
