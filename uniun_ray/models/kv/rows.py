"""The KV rows of a batch: which models' caches can hold several sequences as rows of one batch."""
from __future__ import annotations

from typing import Any

from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def batchable(model: Any) -> bool:
    """Whether every layer of the cache the model builds is a plain full-attention DynamicLayer,
    which can be left-padded, stacked and cut out again."""
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)
