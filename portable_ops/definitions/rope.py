"""Rotary position embeddings (RoPE), forward and backward, in plain PyTorch.

``x`` is q ``[B, Hq, S, D]`` or k ``[B, Hk, S, D]``; ``cos`` and ``sin`` are ``[Bc, S, R]`` (``Bc`` 1 or B), R even
and at most D. The first R dims of each head are rotated, the other ``D - R`` pass through unchanged (partial
rotary). The rotation is transformers' formula, element by element, on the cos and sin it is given:

    out[..., :R] = x[..., :R] * cos + rotate(x[..., :R]) * sin

* half-split (``interleaved=False``; Llama, transformers' ``rotate_half``): ``rotate(x) = cat(-x2, x1)``, x1 and
  x2 the two halves of the R dims; dims ``i`` and ``i + R/2`` are a pair, and cos/sin hold each pair's angle
  twice, as halves (``cat(freqs, freqs)``, what transformers' rotary modules return);
* interleaved (GPT-J, the original RoFormer): ``rotate(x)[2i] = -x[2i+1]``, ``rotate(x)[2i+1] = x[2i]``; dims
  ``2i`` and ``2i + 1`` are a pair, and cos/sin hold each pair's angle twice, side by side
  (``freqs.repeat_interleave(2, -1)``).

With cos/sin of that form this rotates each pair by its angle. The backward is the transpose,
``dx = dout * cos - rotate(dout * sin)``: with that form, the rotation by the opposite angle.

Computed in float32 (float64 for float64 x) from cos and sin as given, rounded once to x's dtype.
"""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The pairs' partner, with the sign of the rotation: ``cat(-x2, x1)`` (half-split), or ``(-x[2i+1], x[2i])``
    per pair (interleaved)."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _tables(cos, sin, dtype):
    """cos and sin ``[Bc, S, R]`` in the compute dtype, as ``[Bc, 1, S, R]``: broadcast over the heads."""
    return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def rotated(x, cos, sin, interleaved: bool, inverse: bool = False) -> torch.Tensor:
    """The first R dims of ``x`` rotated (``inverse``: the backward's transpose), in the compute dtype."""
    dtype = compute_dtype(x.dtype)
    c, s = _tables(cos, sin, dtype)
    xr = x[..., :cos.shape[-1]].to(dtype)
    if inverse:
        return xr * c - rotate(xr * s, interleaved)
    return xr * c + rotate(xr, interleaved) * s


def rope_one(x, cos, sin, interleaved: bool, inverse: bool = False) -> torch.Tensor:
    """``x`` with its first R dims rotated and the rest unchanged, in x's dtype; differentiable in x (what double
    backward and the torch.func transforms differentiate)."""
    r = cos.shape[-1]
    y = rotated(x, cos, sin, interleaved, inverse).to(x.dtype)
    return y if r == x.shape[-1] else torch.cat((y, x[..., r:]), dim=-1)


def rope(q, k, cos, sin, interleaved: bool = False):
    """``(q_out, k_out)``: q and k rotated by the same tables."""
    return rope_one(q, cos, sin, interleaved), rope_one(k, cos, sin, interleaved)


def rope_bwd(dq, dk, cos, sin, interleaved: bool = False):
    """``(dq_in, dk_in)`` from the outputs' gradients (either may be None: no gradient reached that output)."""
    return tuple(None if g is None else rope_one(g, cos, sin, interleaved, inverse=True) for g in (dq, dk))
