"""The memory layout of attention's outputs, one rule for every backend and for torch.compile.

An attention output (``out``, or a gradient ``dq`` / ``dk`` / ``dv``) is dense, in one of two
layouts chosen from the input it mirrors:

* ``[B, S, H, D]`` in memory, seen as ``[B, H, S, D]``, when the input's heads are inner to its
  sequence (``t.stride(1) < t.stride(2)``): q, k and v transposed out of ``[B, S, H, D]``, or
  sliced from a fused qkv projection, as transformers make them. The caller's
  ``out.transpose(1, 2).reshape(B, S, H * D)`` is then a view, not a copy, and the gradient
  that comes back through it needs no copy either;
* contiguous ``[B, H, S, D]`` otherwise.

Every backend allocates its outputs with :func:`empty_like` (or copies into it), and the fake
(meta) implementations that torch.compile traces use the same function, so the strides a
compiled graph expects are the strides it gets.

Element-wise ops (``rope``) keep their input's layout instead, as torch's element-wise ops do:
:func:`same_layout`, ``torch.empty_like``'s rule. For a ``[B, H, S, D]`` input transposed out of
``[B, S, H, D]`` or sliced from a fused projection that is the heads-inner layout above; a
contiguous input stays contiguous.
"""

from __future__ import annotations

import torch
from torch.autograd import forward_ad


def heads_inner(t: torch.Tensor) -> bool:
    """Whether ``t [B, H, S, D]`` steps through heads faster than through positions."""
    return t.stride(1) < t.stride(2)


def strides_like(t: torch.Tensor, head_dim: int | None = None) -> tuple[int, int, int, int]:
    """The strides of :func:`empty_like` (``t``, ``head_dim``) without allocating it."""
    b, h, s, d = t.shape
    d = d if head_dim is None else head_dim
    if heads_inner(t):
        return (s * h * d, d, h * d, 1)
    return (h * s * d, s * d, d, 1)


def empty_like(t: torch.Tensor, dtype: torch.dtype | None = None, head_dim: int | None = None) -> torch.Tensor:
    """An uninitialised tensor of ``t``'s shape (``[B, H, S, D]``; its last dim ``head_dim`` where given: an
    output of v's head dim, mirroring q) in the layout the rule above picks."""
    # not new_empty(...).transpose(1, 2): that is a view, and a view made under no_grad can't be modified in
    # place once grad mode is back on (SDPA's output can)
    shape = t.shape if head_dim is None else (*t.shape[:3], head_dim)
    return torch.empty_strided(shape, strides_like(t, head_dim), dtype=dtype or t.dtype, device=t.device)


def same_layout(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised tensor of ``t``'s shape laid out as ``t``: ``t``'s strides where ``t`` is dense
    (non-overlapping, no gaps), else dense with its dims in the order of ``t``'s strides (a slice of a
    fused projection loses the other slices' gaps). ``torch.empty_like``'s rule, which fake tensors follow too."""
    return torch.empty_like(t, dtype=dtype)


def as_layout_of(result: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``result`` (shaped like ``t`` but perhaps in its last dim) in ``t``'s output layout: itself when its
    strides already are, else a copy (strides are compared exactly, size-one dimensions included: a compiled
    graph checks them so). Never a view (:func:`unviewed`)."""
    head_dim = result.shape[-1]
    if result.stride() == strides_like(t, head_dim):
        return unviewed(result)
    return empty_like(t, dtype=result.dtype, head_dim=head_dim).copy_(result)


def unviewed(result: torch.Tensor) -> torch.Tensor:
    """``result``, or, where it is a view (of a temporary, or of a kernel's buffer seen another way), the
    same memory as a tensor of its own (no copy): an output must be one, as SDPA's is, or an in-place op
    on one made under ``no_grad`` is refused once grad mode is back on. A view autograd tracks (the
    definition differentiated twice, or forward-mode under ``torch.func.jvp``) is kept."""
    if result._is_view() and not result.requires_grad and forward_ad.unpack_dual(result).tangent is None:
        return result.detach()
    return result
