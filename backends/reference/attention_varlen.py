"""Packed attention: the definition's walk over the sequences, each run by this backend's dense attention."""

from __future__ import annotations

import functools

from portable_ops.definitions import attention_varlen as definition

from .attention import attention_bwd, attention_fwd

attention_varlen_fwd = functools.partial(definition.attention_varlen_fwd, dense_fwd=attention_fwd)
attention_varlen_bwd = functools.partial(definition.attention_varlen_bwd, dense_bwd=attention_bwd)
