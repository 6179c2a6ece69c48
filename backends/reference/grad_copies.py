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


def fused_inputs(grads, grad_scale, found_inf, clip_coef, device) -> tuple:
    """``(grads, grad_scale, found_inf, copies)`` as torch's fused optimizer kernels take them on ``device``: the
    clip folded into the grad scale, and with a scale the kernel gets :func:`copies_of` the grads (``copies``,
    for :func:`keep` once it has run; None without a scale)."""
    if grad_scale is not None:
        grad_scale = grad_scale.to(device, torch.float32)
    if clip_coef is not None:
        clip_coef = clip_coef.to(device, torch.float32)
        grad_scale = clip_coef.reciprocal() if grad_scale is None else grad_scale / clip_coef
    copies = None
    if grad_scale is not None:
        copies = copies_of(grads)
        grads = copies[1]
    if found_inf is not None:
        found_inf = found_inf.to(device, torch.float32)
    return grads, grad_scale, found_inf, copies
