"""Test helper: a tiny, real, *saved* Qwen3 target with a small real tokenizer and chat template.

``make_tiny_target_dir(tmp_path)`` writes a directory that loads through the ordinary
``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained`` path, exactly like a hub
checkpoint, without any network:

- a byte-level BPE tokenizer trained (deterministically, in ~10 ms) with the ``tokenizers`` library on
  the few KB of text in ``TRAINING_TEXT``, wrapped as ``PreTrainedTokenizerFast``;
- special tokens as in Qwen3: ``<|endoftext|>`` (eos and pad), ``<|im_start|>``, ``<|im_end|>``, plus the
  non-special added tokens ``<think>`` / ``</think>``;
- a ChatML chat template modelled on Qwen3's (``add_generation_prompt``, ``enable_thinking=False`` adds
  the empty ``<think>\\n\\n</think>\\n\\n`` block to the generation prompt, and assistant turns after the
  last user message are rendered with a think block, as Qwen3 does);
- a **padded** vocabulary: the embedding has ``len(tokenizer)`` rounded up to a multiple of 64 rows,
  always strictly more than ``len(tokenizer)``, and ``config.mask_token_id = len(tokenizer)`` (an
  existing padded row, like Qwen3's 151669);
- a random GQA Qwen3 (4 query heads, 2 KV heads), weights drawn with std 0.2 (not 0.02) so greedy
  paths and top-M lists are distinct rather than near-uniform.

Everything is deterministic for a given ``seed``. Typical use::

    from helpers import make_tiny_target_dir
    path = make_tiny_target_dir(tmp_path)                 # str, a directory
    target = FrozenTarget.from_pretrained(path)           # tokenizer loaded from the same dir

With the default 8 layers the DFlash default layer rule works for 5 features (``[1, 2, 3, 4, 5]``).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_TOKENS = ["<think>", "</think>"]

#: Modelled on Qwen3's template (no tools): the thinking flag only changes the generation prompt;
#: assistant turns after the last user query get a (possibly empty) think block.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_query_index=messages|length - 1, found=false) %}"
    "{%- for message in messages[::-1] %}"
    "{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if not ns.found and message.role == 'user' %}"
    "{%- set ns.found = true %}{%- set ns.last_query_index = index %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

#: A few KB of mixed prose, chat and code so the BPE learns some real merges.
TRAINING_TEXT = """
The quick brown fox jumps over the lazy dog. A speculative decoder drafts a block of tokens and the
target model verifies them in one pass. When the draft agrees with the target, several tokens are
committed at once; when it disagrees, the target's own token is kept and drafting starts again.
Hello! How are you today? I am fine, thank you. What is the capital of France? The capital of
France is Paris. What is two plus two? Two plus two is four. Please reason step by step, and put
your final answer within a box. Let me think about this carefully before answering the question.
The assistant answers the user's question in a short and helpful way. The user asks a question.
def add(a, b):
    return a + b

def main(argv=None):
    parser = argparse.ArgumentParser(description="train a drafter")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    for step in range(args.steps):
        loss = model(batch)
        loss.backward()
        optimizer.step()
    return 0

class Block:
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

for i in range(10):
    print(i, i * i, "even" if i % 2 == 0 else "odd")
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 100 1000 3.14 2.71 42.
Once upon a time there was a small model that wanted to be fast. It learned from a larger model and
guessed what the larger model would say next. Most of the time the guesses were right, and the
larger model could skip ahead. The end.
"""


@lru_cache(maxsize=8)
def _tokenizer_json(vocab: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=[EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the text so merge counts are far from ties; the result is deterministic.
    tok.train_from_iterator([TRAINING_TEXT] * 4, trainer=trainer)
    return tok.to_str()


def make_tiny_tokenizer(vocab: int = 320):
    """The helper's tokenizer alone (``PreTrainedTokenizerFast``), ``len() == vocab + 2`` or so."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab)),
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=[IM_START, IM_END],
    )
    tokenizer.add_tokens(THINK_TOKENS)  # added but not special, as in Qwen3
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def padded_rows(n_tokens: int, multiple: int = 64) -> int:
    """``n_tokens`` rounded up to a multiple of ``multiple``, always strictly larger (room for MASK)."""
    return (n_tokens // multiple + 1) * multiple


def make_tiny_target_dir(
    tmp_path,
    tie: bool = True,
    vocab: int = 320,
    layers: int = 8,
    seed: int = 0,
    hidden: int = 64,
    name: str = "tiny-target",
) -> str:
    """Write a tiny random Qwen3 + tokenizer to ``tmp_path / name`` and return the directory as str.

    Args:
        tmp_path: parent directory (pytest's ``tmp_path``).
        tie: ``tie_word_embeddings`` (small Qwen3 models tie, Qwen3-8B does not).
        vocab: BPE vocabulary size to train (byte alphabet 256 + merges + specials); the model's
            embedding gets ``padded_rows(len(tokenizer))`` rows.
        layers: decoder layers (8 lets the default 5-feature layer rule work: ``[1, 2, 3, 4, 5]``).
        seed: seeds the weights (the tokenizer does not depend on it).
        hidden: hidden size; 4 query heads and 2 KV heads of ``hidden // 4``.
        name: sub-directory name, so one test can make several targets.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(tmp_path) / name
    tokenizer = make_tiny_tokenizer(vocab)
    n_tokens = len(tokenizer)
    rows = padded_rows(n_tokens)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
    config = Qwen3Config(
        vocab_size=rows,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        bos_token_id=None,
    )
    config.mask_token_id = n_tokens
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    model.generation_config.eos_token_id = [eos_id, im_end_id]  # Qwen3 stops on both
    model.generation_config.pad_token_id = eos_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # Make sure the saved config really carries the MASK id (some versions drop unknown attrs).
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("mask_token_id") != n_tokens:
        cfg["mask_token_id"] = n_tokens
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return str(out)


def _renamed_head() -> type:
    from lilicorr_pl.heads import LiLiCorrHead

    class RenamedLiLiCorrHead(LiLiCorrHead):
        """A user's own head: the reference head, from a module outside the trusted packages (checkpoint trust)."""

    RenamedLiLiCorrHead.__module__, RenamedLiLiCorrHead.__qualname__ = __name__, "RenamedLiLiCorrHead"
    return RenamedLiLiCorrHead


RenamedLiLiCorrHead = _renamed_head()


def save_edited(state: dict, path) -> None:
    """Save a checkpoint whose records or training state a test edited as ``lilicorr fit`` would have written them: its
    record and training-state checksums (where it has them) computed again, so what is tested is the edited setting,
    not the checksum that would refuse a changed byte."""
    import torch

    from lilicorr_pl.checkpoint import (RECORD_CHECKSUM_KEY, TRAINING_CHECKSUM_KEY, record_checksum,
                                        training_state_checksum)

    record = state.get("lilicorr")
    if isinstance(record, dict) and TRAINING_CHECKSUM_KEY in record:  # first: the record checksum covers it
        record[TRAINING_CHECKSUM_KEY] = training_state_checksum(state, record.get("training_state_keys"))
    if isinstance(record, dict) and RECORD_CHECKSUM_KEY in record:
        record[RECORD_CHECKSUM_KEY] = record_checksum(state)
    torch.save(state, path)
