"""The scalars torch's fused optimizer kernels read, made from a call's: ``lr`` and ``found_inf`` as the kernels
take them, and how each dtype's grads are scaled. The kernels divide the grads they are handed by their
``grad_scale`` and write them back so, which is the contract (a scaled step leaves ``grad / grad_scale *
clip_coef`` in the grads, docs/adding-a-backend.md): float32 and half-precision grads go to the kernel with the
divisor ``grad_scale / clip_coef`` (float32, which the kernels take); float64 grads are multiplied in place by the
float64 ``clip_coef / grad_scale`` (a float64 norm's coefficient may be past float32's range, as torch's clip
has it), a skipped step multiplying by 1."""

from __future__ import annotations

import operator

import torch

_dtype = operator.attrgetter("dtype")


def kernel_scalars(lr, found_inf, device):
    """``lr`` (a float, or as a float32 scalar on ``device``) and ``found_inf`` (None, or 1.0 where it is non-zero,
    else 0.0, a float32 scalar on ``device``) as the kernels take them: they skip a step on exactly 1.0, and the
    caller's count is ``step - found_inf``, where any non-zero value skips one (docs/api.md)."""
    if isinstance(lr, torch.Tensor):
        lr = lr.to(device, torch.float32).reshape(())
    if found_inf is not None:
        found_inf = (found_inf.to(device).reshape(()) != 0).to(torch.float32)
    return lr, found_inf


def grad_multiplier(grad_scale, clip_coef, device):
    """``clip_coef / grad_scale`` as a 0-d tensor on ``device``, float32 or the clip's float64; None when the call
    scales nothing, so that the grads are only read."""
    if grad_scale is None and clip_coef is None:
        return None
    clip = (torch.ones((), device=device) if clip_coef is None
            else clip_coef.to(device, torch.promote_types(clip_coef.dtype, torch.float32)).reshape(()))
    multiplier = clip if grad_scale is None else clip / grad_scale.to(device, torch.float32).reshape(())
    # reading it costs the CPU nothing (no stream to wait for), and a step that scales by 1 writes nothing
    if device.type == "cpu" and bool(multiplier == 1):
        return None
    return multiplier


def kernel_grad_scale(grads, multiplier, found_inf):
    """The ``grad_scale`` to hand the kernel for ``grads`` (one dtype), scaling float64 grads here first."""
    if multiplier is None:
        return None
    if grads[0].dtype == torch.float64:
        torch._foreach_mul_(grads, multiplier if found_inf is None else multiplier.masked_fill(found_inf != 0, 1))
        return None
    return multiplier.reciprocal().float()


def by_dtype(grads, columns):
    """``(grads, columns)`` of each dtype's indices (columns: lists shaped like ``grads``; an empty one stays empty);
    the lists themselves when there is one dtype."""
    if len(set(map(_dtype, grads))) == 1:  # C-level: the common call
        yield grads, columns
        return
    groups: dict = {}
    for i, g in enumerate(grads):
        groups.setdefault(g.dtype, []).append(i)
    for idx in groups.values():
        yield [grads[i] for i in idx], [[c[i] for i in idx] if c else c for c in columns]
