"""Scratch copies of the grads for torch's fused optimizer kernels, which unscale their grads in place: the
caller's grads must stay as they were. The buffers are kept for the next call with grads of the same layout,
as allocating them every step costs more (page faults) than the step."""

from __future__ import annotations

import torch

_copies: dict = {}  # the last scaled call's grad copies, by layout


def copies_of(grads) -> tuple:
    """``(layout, copies of grads)``, into the last scaled call's buffers where the layout is the same."""
    layout = tuple((g.shape, g.dtype, g.device) for g in grads)
    buffers = _copies.get(layout) or [torch.empty_like(g, memory_format=torch.contiguous_format) for g in grads]
    torch._foreach_copy_(buffers, grads)
    return layout, buffers


def keep(copies: tuple) -> None:
    """Keep ``copies`` (from :func:`copies_of`) for the next call, once the kernel that used them has run."""
    _copies.clear()
    _copies[copies[0]] = copies[1]
