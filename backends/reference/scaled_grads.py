"""The grads torch's fused optimizer kernels step on, one launch per dtype, and the scalars they read. The
kernels unscale the grads they are handed in place, and the caller's grads must stay as they were, so a call that
scales them (a GradScaler's scale, a clip) hands the kernels scaled copies: ``grad * clip_coef / grad_scale`` for
float32 and float64 grads (one rounding, as the kernel's own division has). float16 and bfloat16 copies keep the
grads' values and the kernel divides them by the scale in float32: that product rounded to 16 bits would flush tiny
float16 grads to zero (what a GradScaler is for), and wherever the step nearly cancels a scaled grad (L2 weight
decay, the first moment's decay, eps beside a grad of its size) its rounding error is a large part of the step.
Those copies cost the kernel a write of each unscaled grad.

On the CPU such a call goes in batches of at most ``CPU_BATCH`` elements, so that each batch's copies are
still in cache when the kernel reads them; a whole model's copies at once would be one more pass through
memory (and page faults) than torch's in-place clip."""

from __future__ import annotations

import operator

import torch

CPU_BATCH = 1 << 20

_dtype = operator.attrgetter("dtype")


def batches(grads, grad_scale, clip_coef, columns, per_tensor=()):
    """Yields ``(columns, per_tensor, grads, grad_scale)`` for each kernel launch: pieces of ``columns`` (lists of
    tensors shaped like ``grads``: params, moments; an empty list stays empty), ``per_tensor`` lists' entries
    (step counts) repeated for each piece of their tensor, the grads to step on and the scale the kernel divides
    them by (a float32 device scalar, or None)."""
    device = grads[0].device
    multiplier = _multiplier(grad_scale, clip_coef, device)
    for group_grads, group_columns, group_per_tensor in _by_dtype(grads, columns, per_tensor):
        if multiplier is None:
            yield group_columns, group_per_tensor, group_grads, None
            continue
        half = group_grads[0].dtype in (torch.float16, torch.bfloat16)
        kernel_scale = multiplier.reciprocal().float() if half else None
        limit = CPU_BATCH if device.type == "cpu" else None
        for piece_columns, piece_per_tensor, piece_grads in _pieces(group_grads, group_columns, group_per_tensor,
                                                                    limit):
            copies = torch._foreach_mul(piece_grads, 1) if half else torch._foreach_mul(piece_grads, multiplier)
            yield piece_columns, piece_per_tensor, copies, kernel_scale


def kernel_scalars(lr, found_inf, device):
    """``lr`` (a float, or as a float32 scalar on ``device``) and ``found_inf`` (None, or 1.0 where it is non-zero,
    else 0.0, a float32 scalar on ``device``) as the kernels take them: they skip a step on exactly 1.0, and the
    caller's count is ``step - found_inf``, where any non-zero value skips one (docs/api.md)."""
    if isinstance(lr, torch.Tensor):
        lr = lr.to(device, torch.float32).reshape(())
    if found_inf is not None:
        found_inf = (found_inf.to(device).reshape(()) != 0).to(torch.float32)
    return lr, found_inf


def _multiplier(grad_scale, clip_coef, device):
    """``clip_coef / grad_scale`` as a scalar on ``device``, float32 or the clip's float64 (a float64 norm's
    coefficient may be past float32's range, as torch's clip has it); None when the call scales nothing."""
    if grad_scale is None and clip_coef is None:
        return None
    clip = (torch.ones((), device=device) if clip_coef is None
            else clip_coef.to(device, torch.promote_types(clip_coef.dtype, torch.float32)))
    multiplier = clip if grad_scale is None else clip / grad_scale.to(device, torch.float32)
    # reading it costs the CPU nothing (no stream to wait for), and an unclipped, unscaled step needs no copies
    if device.type == "cpu" and bool(multiplier == 1):
        return None
    return multiplier


def _by_dtype(grads, columns, per_tensor):
    """``(grads, columns, per_tensor)`` of each dtype's indices; the lists themselves when there is one dtype."""
    if len(set(map(_dtype, grads))) == 1:  # C-level: the common call
        yield grads, columns, per_tensor
        return
    groups: dict = {}
    for i, g in enumerate(grads):
        groups.setdefault(g.dtype, []).append(i)
    for idx in groups.values():
        yield ([grads[i] for i in idx], [[c[i] for i in idx] if c else c for c in columns],
               [[p[i] for i in idx] for p in per_tensor])


def _pieces(grads, columns, per_tensor, limit):
    """Batches of at most ``limit`` elements in all (None: one batch of the whole tensors): tensors within the
    limit whole, larger ones as flat pieces of at most ``limit`` elements."""
    if limit is None:
        if all(map(torch.Tensor.dim, grads)):  # C-level: no 0-d grad to view as [1]
            yield columns, per_tensor, grads
        else:
            yield _cut([(i, None) for i in range(len(grads))], grads, columns, per_tensor)
        return
    batch: list[tuple] = []  # (index, a slice of its flat elements, or None for the whole tensor)
    size = 0
    for i, g in enumerate(grads):
        n = g.numel()
        for part in [None] if n <= limit else [slice(start, start + limit) for start in range(0, n, limit)]:
            length = n if part is None else min(part.stop, n) - part.start
            if batch and size + length > limit:
                yield _cut(batch, grads, columns, per_tensor)
                batch, size = [], 0
            batch.append((i, part))
            size += length
    if batch:
        yield _cut(batch, grads, columns, per_tensor)


def _cut(batch, grads, columns, per_tensor):
    def piece(t, part):
        if part is None:  # a 0-d grad times the 0-d multiplier would take its dtype (a float32 grad a float64 clip's)
            return t if t.dim() else t.view(1)
        return t.view(-1)[part]
    return ([[piece(c[i], part) for i, part in batch] if c else c for c in columns],
            [[p[i] for i, _ in batch] for p in per_tensor],
            [piece(grads[i], part) for i, part in batch])
