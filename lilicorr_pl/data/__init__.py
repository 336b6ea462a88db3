"""Training data: formats, fingerprinted caches (target logits, context features), the data module,
and regeneration of responses with the target."""

from lilicorr_pl.data.cache import (
    Cache,
    CacheError,
    CacheWriter,
    cached_candidate_logits,
    fingerprint,
    logit_cache_bytes_per_token,
    logit_cache_report,
    open_cache,
)
from lilicorr_pl.data.datamodule import DraftDataModule, collate_draft_batch, precompute_throughput
from lilicorr_pl.data.formats import DataFormatError, TokenizedExample, load_examples
from lilicorr_pl.data.regenerate import RegenerationStats, regenerate

__all__ = [
    "Cache",
    "CacheError",
    "CacheWriter",
    "DataFormatError",
    "DraftDataModule",
    "RegenerationStats",
    "TokenizedExample",
    "cached_candidate_logits",
    "collate_draft_batch",
    "fingerprint",
    "load_examples",
    "logit_cache_bytes_per_token",
    "logit_cache_report",
    "open_cache",
    "precompute_throughput",
    "regenerate",
]
