"""The grads torch's fused optimizer kernels step on, one launch per dtype. The kernels unscale the grads they
are handed in place, and the caller's grads must stay as they were, so a call that scales them (a GradScaler's
scale, a clip) hands the kernels scaled copies: ``grad * clip_coef / grad_scale`` in the grads' dtype, except
for float16, where that product would flush tiny grads to zero (what a GradScaler is for): float16 copies
keep the grads' values and the kernel divides by the scale in float32.

On the CPU such a call goes in batches of at most ``CPU_BATCH`` elements, so that each batch's copies are
still in cache when the kernel reads them; a whole model's copies at once would be one more pass through
memory (and page faults) than torch's in-place clip."""

from __future__ import annotations

import torch

CPU_BATCH = 1 << 20


def batches(grads, grad_scale, clip_coef, columns, per_tensor=()):
    """Yields ``(columns, per_tensor, grads, grad_scale)`` for each kernel launch: pieces of ``columns`` (lists of
    tensors shaped like ``grads``: params, moments; an empty list stays empty), ``per_tensor`` lists' entries
    (step counts) repeated for each piece of their tensor, the grads to step on and the scale the kernel divides
    them by (a float32 device scalar, or None)."""
    device = grads[0].device
    multiplier = _multiplier(grad_scale, clip_coef, device)
    for idx in _by_dtype(grads).values():
        group_grads = [grads[i] for i in idx]
        group_columns = [[c[i] for i in idx] if c else c for c in columns]
        group_per_tensor = [[p[i] for i in idx] for p in per_tensor]
        if multiplier is None:
            yield group_columns, group_per_tensor, group_grads, None
            continue
        half = group_grads[0].dtype == torch.float16
        kernel_scale = multiplier.reciprocal() if half else None
        limit = CPU_BATCH if device.type == "cpu" else None
        for piece_columns, piece_per_tensor, piece_grads in _pieces(group_grads, group_columns, group_per_tensor,
                                                                    limit):
            copies = [g.clone() for g in piece_grads] if half else torch._foreach_mul(piece_grads, multiplier)
            yield piece_columns, piece_per_tensor, copies, kernel_scale


def _multiplier(grad_scale, clip_coef, device):
    """``clip_coef / grad_scale`` as a float32 scalar on ``device``; None when the call scales nothing."""
    if grad_scale is None and clip_coef is None:
        return None
    clip = torch.ones((), device=device) if clip_coef is None else clip_coef.to(device, torch.float32)
    return clip if grad_scale is None else clip / grad_scale.to(device, torch.float32)


def _by_dtype(tensors) -> dict:
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


def _pieces(grads, columns, per_tensor, limit):
    """Batches of flat pieces of at most ``limit`` elements in all (None: one batch of the whole tensors)."""
    if limit is None:
        yield columns, per_tensor, grads
        return
    batch: list[tuple] = []  # (index, start, end)
    size = 0
    for i, g in enumerate(grads):
        for start in range(0, max(g.numel(), 1), limit):
            end = min(start + limit, g.numel())
            if batch and size + end - start > limit:
                yield _cut(batch, grads, columns, per_tensor)
                batch, size = [], 0
            batch.append((i, start, end))
            size += end - start
    if batch:
        yield _cut(batch, grads, columns, per_tensor)


def _cut(batch, grads, columns, per_tensor):
    def flat(t, start, end):
        return t.view(-1)[start:end]
    return ([[flat(c[i], s, e) for i, s, e in batch] if c else c for c in columns],
            [[p[i] for i, _, _ in batch] for p in per_tensor],
            [flat(grads[i], s, e) for i, s, e in batch])
