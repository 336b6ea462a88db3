"""Training data: formats, the data module and its stores (tokens, target logits, context features as
safetensors shards), the sharded precompute, and regeneration of responses with the target."""

from lilicorr_pl.data.datamodule import DraftDataModule
from lilicorr_pl.data.dataset import CachedDraftDataset, collate_draft_batch, pad_length
from lilicorr_pl.data.fingerprint import file_sha256, fingerprint
from lilicorr_pl.data.formats import DataFormatError, TokenizedExample, load_examples
from lilicorr_pl.data.precompute import cached_candidate_logits, logit_cache_bytes_per_token, logit_cache_report
from lilicorr_pl.data.regenerate import RegenerationStats, regenerate
from lilicorr_pl.data.store import CacheError, Store, open_store

__all__ = [
    "CacheError",
    "CachedDraftDataset",
    "DataFormatError",
    "DraftDataModule",
    "RegenerationStats",
    "Store",
    "TokenizedExample",
    "cached_candidate_logits",
    "collate_draft_batch",
    "file_sha256",
    "fingerprint",
    "load_examples",
    "logit_cache_bytes_per_token",
    "logit_cache_report",
    "open_store",
    "pad_length",
    "regenerate",
]
