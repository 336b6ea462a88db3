"""The frozen Hugging Face target model: context features, embedding, LM head, verification.

The target is configuration, not a trainable part: it is loaded through the ordinary
``AutoModelForCausalLM.from_pretrained`` path, frozen, put in eval mode and only ever run under
``torch.no_grad``. Everything the drafter and the losses need from it goes through this wrapper.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Turn a user-facing dtype name into a ``torch.dtype`` with a helpful error."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(
            f"unknown dtype {dtype!r}; use one of {sorted(set(_DTYPES))} (model.target.dtype)"
        ) from None


def default_layer_ids(num_layers: int, num_features: int) -> list[int]:
    """The published DFlash rule for which target decoder layers feed the drafter.

    One feature: the middle layer. Otherwise ``round(1 + i * (L - 4) / (n - 1))`` for
    ``i = 0..n-1``, e.g. ``[1, 9, 17, 25, 33]`` for ``L = 36, n = 5``.
    """
    if num_features < 1:
        raise ValueError(f"num_target_features must be >= 1, got {num_features}")
    if num_features == 1:
        return [num_layers // 2]
    if num_layers < 4:
        raise ValueError(
            f"the default layer rule needs a target with >= 4 layers for {num_features} features "
            f"(target has {num_layers}); set model.target.layer_ids explicitly"
        )
    ids = [int(round(1 + i * (num_layers - 4) / (num_features - 1))) for i in range(num_features)]
    if len(set(ids)) != len(ids):
        raise ValueError(
            f"default layer ids {ids} repeat a layer for a {num_layers}-layer target with "
            f"{num_features} features; use fewer features or set model.target.layer_ids"
        )
    return ids


@dataclass
class TargetSpec:
    """How to load the frozen target. Stored in hyperparameters; the weights never enter checkpoints."""

    name_or_path: str
    """Hugging Face hub name or local directory of the target causal LM."""
    dtype: str = "float32"
    """Weights dtype of the frozen target: float32, bfloat16 or float16."""
    layer_ids: list[int] | None = None
    """0-based decoder layers whose outputs feed the drafter; None = DFlash default rule."""
    num_features: int = 5
    """How many target layers to read when ``layer_ids`` is None (clipped to the layer count)."""
    trust_remote_code: bool = False
    """Passed to ``from_pretrained`` for custom architectures."""
    load_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for ``AutoModelForCausalLM.from_pretrained`` (e.g. attn_implementation)."""


@dataclass
class TargetOutput:
    """What one target pass returns."""

    features: torch.Tensor  # [b, T, n*H] concatenated raw layer outputs, in layer-id order
    normed_hidden: torch.Tensor  # [b, T, H] final-norm output (input of the LM head)
    logits: torch.Tensor | None = None  # [b, T, V] when asked for
    cache: Any = None  # the target KV cache when use_cache=True


class FrozenTarget(nn.Module):
    """A frozen causal LM plus the pieces of it that a DFlash drafter reads.

    Args:
        model: a Hugging Face ``*ForCausalLM`` (decoder-only, Llama/Qwen-style ``model.model.layers``).
        layer_ids: decoder layers whose outputs are the drafter's context features.
        num_features: used with ``layer_ids=None`` to apply the default rule.
        tokenizer: optional tokenizer; checked against the model's vocabulary.
        name_or_path: recorded for checkpoints and reports.
    """

    def __init__(
        self,
        model: nn.Module,
        layer_ids: Sequence[int] | None = None,
        num_features: int = 5,
        tokenizer: Any = None,
        name_or_path: str | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.model.requires_grad_(False)
        self.model.eval()
        self.name_or_path = name_or_path or getattr(model.config, "_name_or_path", "")
        self.tokenizer = tokenizer
        decoder = self.decoder
        if not hasattr(decoder, "layers") or not hasattr(decoder, "norm"):
            raise TypeError(
                f"{type(model).__name__} has no `model.layers`/`model.norm`; lilicorr_pl supports "
                "decoder-only Llama/Qwen-style causal LMs"
            )
        n_layers = len(decoder.layers)
        if layer_ids is None:
            layer_ids = default_layer_ids(n_layers, min(num_features, n_layers))
        layer_ids = [int(i) for i in layer_ids]
        bad = [i for i in layer_ids if not 0 <= i < n_layers]
        if bad:
            raise ValueError(
                f"target layer ids {bad} are out of range for a target with {n_layers} decoder layers "
                f"(valid: 0..{n_layers - 1}); fix model.target.layer_ids"
            )
        if sorted(set(layer_ids)) != layer_ids:
            raise ValueError(
                f"target layer ids must be strictly increasing without repeats, got {layer_ids}; "
                "fix model.target.layer_ids"
            )
        self.layer_ids = layer_ids
        # Registered once: hooks and the cache keyword are decided here, not on every call (a decoding
        # round calls the target once; per-call Python overhead is a visible share of a small target's step).
        self._tap = _FeatureTap()
        self._tap_handles = [decoder.layers[i].register_forward_hook(self._tap.hook(i)) for i in layer_ids]
        params = inspect.signature(decoder.forward).parameters
        # transformers 5 renamed `past_key_values` to `cache`; support both.
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        if tokenizer is not None:
            self.check_tokenizer(tokenizer)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_spec(cls, spec: TargetSpec, device: str | torch.device | None = None, shared: bool = False) -> FrozenTarget:
        return cls.from_pretrained(
            spec.name_or_path,
            dtype=spec.dtype,
            layer_ids=spec.layer_ids,
            num_features=spec.num_features,
            trust_remote_code=spec.trust_remote_code,
            device=device,
            shared=shared,
            **spec.load_kwargs,
        )

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        dtype: str | torch.dtype = "float32",
        layer_ids: Sequence[int] | None = None,
        num_features: int = 5,
        trust_remote_code: bool = False,
        device: str | torch.device | None = None,
        load_tokenizer: bool = True,
        shared: bool = False,
        **load_kwargs: Any,
    ) -> FrozenTarget:
        """Load a target by hub name or local path through ``AutoModelForCausalLM.from_pretrained``.

        ``shared=True`` loads the weights once per process: later shared loads of the same files with the
        same settings wrap the same model (the data module's precompute and the training system's
        ``configure_model`` use it, so a fit reads the target once).
        """
        from lilicorr_pl.builtin import resolve_target_path

        name_or_path = resolve_target_path(name_or_path)
        key = _shared_key(name_or_path, resolve_dtype(dtype), trust_remote_code, load_tokenizer, load_kwargs) if shared else None
        if key in _SHARED:
            model, tokenizer = _SHARED[key]
        else:
            model, tokenizer = cls._load(name_or_path, dtype, trust_remote_code, load_tokenizer, load_kwargs)
            if key is not None:
                _SHARED[key] = (model, tokenizer)
        if device is not None:
            model.to(device)
        return cls(model, layer_ids, num_features, tokenizer=tokenizer, name_or_path=str(name_or_path))

    @staticmethod
    def _load(name_or_path: str, dtype: str | torch.dtype, trust_remote_code: bool, load_tokenizer: bool,
              load_kwargs: dict[str, Any]) -> tuple[nn.Module, Any]:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch_dtype = resolve_dtype(dtype)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                name_or_path, dtype=torch_dtype, trust_remote_code=trust_remote_code, **load_kwargs
            )
        except OSError as err:
            raise OSError(
                f"could not load the target model {name_or_path!r}: {err}\n"
                "Pass a local directory saved with save_pretrained, or a hub name on a machine with "
                "network access (model.target.name_or_path)."
            ) from err
        tokenizer = None
        if load_tokenizer:
            tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        return model, tokenizer

    # ------------------------------------------------------------------ structure
    @property
    def decoder(self) -> nn.Module:
        return self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def num_layers(self) -> int:
        return len(self.decoder.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def num_features(self) -> int:
        return len(self.layer_ids)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head_module(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding table (may exceed the tokenizer: padded vocabulary)."""
        return int(self.embed_tokens.weight.shape[0])

    @property
    def output_rows(self) -> int:
        return int(self.lm_head_module.weight.shape[0])

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def train(self, mode: bool = True) -> FrozenTarget:
        # The target stays in eval mode whatever the enclosing module does.
        super().train(False)
        return self

    # ------------------------------------------------------------------ checks
    def check_token_id(self, token_id: int, what: str = "mask_token_id", setting: str = "") -> None:
        """Raise if ``token_id`` is not a real row of the target embedding table."""
        if not 0 <= int(token_id) < self.vocab_rows:
            where = f"; set {setting}" if setting else ""
            raise ValueError(
                f"{what} {token_id} is outside the target vocabulary ({self.vocab_rows} rows){where}"
            )

    def check_tokenizer(self, tokenizer: Any) -> None:
        """Raise if the tokenizer can produce ids the model has no row for."""
        n = len(tokenizer)
        if n > self.vocab_rows or n > self.output_rows:
            raise ValueError(
                f"tokenizer has {n} tokens but the target embedding has {self.vocab_rows} rows and the "
                f"LM head {self.output_rows}; the tokenizer does not belong to this model "
                "(use the tokenizer saved with the target)"
            )

    # ------------------------------------------------------------------ pieces
    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Frozen input embeddings ``[..., H]`` (never trained, never given gradient)."""
        return self.embed_tokens(input_ids)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.decoder.norm(hidden)

    def lm_head(self, normed_hidden: torch.Tensor) -> torch.Tensor:
        """Full logits ``[..., V]`` from final-normed hidden states (gradient flows to the input only)."""
        return self.lm_head_module(normed_hidden.to(self.dtype))

    def candidate_logits(self, normed_hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits of chosen tokens only: ``normed_hidden [..., H]``, ``token_ids [..., J]`` -> ``[..., J]``.

        Costs ``J`` dot products per position instead of ``V``.
        """
        head = self.lm_head_module
        rows = head.weight[token_ids]  # [..., J, H]
        out = torch.einsum("...h,...jh->...j", normed_hidden.to(rows.dtype), rows)
        if getattr(head, "bias", None) is not None:
            out = out + head.bias[token_ids]
        return out

    def block_mask(self, past: int, length: int) -> torch.Tensor | None:
        """A ready causal mask for ``length`` new tokens after ``past`` cached ones: ``[1, 1, length, past+length]``.

        Additive (0 / -inf) in the target's dtype, which SDPA and eager attention read as is; Hugging Face
        would otherwise build a boolean mask per call that SDPA converts in every layer (measured ≈ 3 % of
        an 8-token verify pass of the 16 x 160 demo target, identical logits). None for other attention
        implementations (they build their own).
        """
        if getattr(self.config, "_attn_implementation", None) not in ("sdpa", "eager"):
            return None
        query = torch.arange(past, past + length, device=self.device).view(length, 1)
        key = torch.arange(past + length, device=self.device).view(1, -1)
        mask = torch.zeros(1, 1, length, past + length, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(key > query, float("-inf"))

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        use_cache: bool = False,
        return_logits: bool = False,
    ) -> TargetOutput:
        """One frozen pass: context features (raw outputs of ``layer_ids``), final-normed hidden, logits.

        The features are the decoder layers' raw residual-stream outputs, captured with forward hooks
        registered once at construction (only the ``layer_ids`` layers, never all hidden states):
        layer ``i``'s output equals ``outputs.hidden_states[i + 1]`` for every ``i < L - 1`` (Hugging Face
        replaces the last entry by the final-norm output, which is never a drafter feature).
        """
        kwargs: dict[str, Any] = {"use_cache": use_cache}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        if cache is not None:
            kwargs[self._cache_kwarg] = cache
        captured = self._tap.start()
        try:
            out = self.decoder(input_ids=input_ids, **kwargs)
        finally:
            self._tap.stop()
        features = torch.cat([captured[i] for i in self.layer_ids], dim=-1)
        normed = out.last_hidden_state
        logits = self.lm_head(normed) if return_logits else None
        fields = set(out.keys())
        new_cache = out["cache"] if "cache" in fields else out["past_key_values"] if "past_key_values" in fields else None
        return TargetOutput(features, normed, logits, new_cache)

    @staticmethod
    def crop_cache(cache: Any, length: int) -> None:
        """Crop a Hugging Face KV cache to its first ``length`` positions (any transformers version)."""
        current = cache.get_seq_length()
        if length > current:
            raise ValueError(f"cannot crop a target cache of length {current} to {length}")
        if length == current:
            return
        # A negative argument means "drop this many tokens" in every transformers version (4.x also
        # accepts a positive length; 5.x reads crop(0) as "drop nothing").
        cache.crop(length - current)


#: Targets loaded with ``shared=True``: (model, tokenizer) by ``_shared_key``, for the life of the process.
_SHARED: dict[str, tuple[nn.Module, Any]] = {}


def _shared_key(path: str, dtype: Any, trust_remote_code: bool, load_tokenizer: bool, load_kwargs: dict[str, Any]) -> str:
    """Same files (names, sizes, modification times) and same load settings -> same key."""
    import json
    from pathlib import Path

    local = Path(path)
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in local.iterdir() if p.is_file()) \
        if local.is_dir() else None
    return json.dumps([path, files, str(dtype), trust_remote_code, load_tokenizer, load_kwargs], sort_keys=True, default=str)


class _FeatureTap:
    """Forward hooks that keep the outputs of chosen decoder layers while a target pass runs.

    A module-level class (not a closure) so a :class:`FrozenTarget` stays picklable and deep-copyable;
    outside :meth:`start`/:meth:`stop` the hooks store nothing, so other callers of the Hugging Face
    model (e.g. ``generate``) keep no references to their activations.
    """

    def __init__(self) -> None:
        self.captured: dict[int, torch.Tensor] | None = None

    def hook(self, layer: int) -> Any:
        return functools.partial(self._store, layer)

    def _store(self, layer: int, _mod: nn.Module, _inp: Any, out: Any) -> None:
        if self.captured is not None:
            self.captured[layer] = out[0] if isinstance(out, tuple) else out

    def start(self) -> dict[int, torch.Tensor]:
        self.captured = {}
        return self.captured

    def stop(self) -> None:
        self.captured = None
