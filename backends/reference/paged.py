"""Paged attention: the definition's gather of each sequence's pages, run by this backend's dense attention.
Appending to the cache is the definition's one indexed write."""

from __future__ import annotations

import functools

from portable_ops.definitions import paged as definition

from .attention import attention_fwd

paged_attention = functools.partial(definition.paged_attention, dense_fwd=attention_fwd)
paged_kv_append = definition.paged_kv_append
