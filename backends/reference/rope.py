"""Rotary position embeddings as torch runs transformers' formula: torch has no fused kernel for them, so the
definition's element-wise ops (``portable_ops/definitions/rope.py``), in float32, written once into the output
(the layout ``torch.empty_like`` gives each input: ``portable_ops/rope.py``) or, in place, into q and k."""

from __future__ import annotations

import torch

from portable_ops.definitions.rope import rotated


def rotate_into(out, x, cos, sin, interleaved, inverse=False):
    """``out`` (x itself, in place) holding x with its first R dims rotated; the rest copied unless in place."""
    r = cos.shape[-1]
    out[..., :r].copy_(rotated(x, cos, sin, interleaved, inverse))  # computed whole before it is written
    if r < x.shape[-1] and out is not x:
        out[..., r:].copy_(x[..., r:])
    return out


def _rotate(x, cos, sin, interleaved, inverse):
    return None if x is None else rotate_into(torch.empty_like(x), x, cos, sin, interleaved, inverse)


def rope_fwd(q, k, cos, sin, interleaved):
    return _rotate(q, cos, sin, interleaved, False), _rotate(k, cos, sin, interleaved, False)


def rope_bwd(dq, dk, cos, sin, interleaved):
    return _rotate(dq, cos, sin, interleaved, True), _rotate(dk, cos, sin, interleaved, True)


def rope_inplace(q, k, cos, sin, interleaved):
    rotate_into(q, q, cos, sin, interleaved)
    rotate_into(k, k, cos, sin, interleaved)
