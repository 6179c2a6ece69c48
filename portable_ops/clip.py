"""Global-norm gradient clipping."""

from __future__ import annotations

import math
import operator

import torch

from . import checks
from .dispatch import dispatch
from .distributed import global_norm, locals_of


_dtype, _device = operator.attrgetter("dtype"), operator.attrgetter("device")


def grads_of(parameters) -> list[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    return [p.grad for p in parameters if p.grad is not None]


def grad_norm_call(grads, norm_type):
    checks.check_tensor_lists({"grads": grads}, like="grads", one_device=False)
    return dict(grads=list(grads), norm_type=checked_norm_type(norm_type))


def checked_norm_type(norm_type) -> float:
    """``norm_type`` as a float: any number torch takes (``'inf'`` too; 0 counts, negative orders and
    ``-inf`` are torch's), except NaN."""
    try:
        value = float(checks.as_number(norm_type))
    except (TypeError, ValueError):
        raise TypeError(f"norm_type must be a number or 'inf', got {norm_type!r}") from None
    if math.isnan(value):
        raise ValueError("norm_type must be a number or +-inf, got nan")
    return value


def total_norm(grads, norm_type=2.0) -> torch.Tensor:
    """The global norm of ``grads`` as a device scalar, without a host synchronisation."""
    call = grad_norm_call(grads, norm_type)
    return checked_total_norm(call["grads"], call["norm_type"])


def checked_total_norm(grads, norm_type: float) -> torch.Tensor:
    """:func:`total_norm` of grads already checked (the optimizer checks them with its step)."""
    if not grads:
        return torch.zeros(())
    if any(dtype.is_complex for dtype in set(map(_dtype, grads))):  # C-level: runs on every clipped step
        grads = [_real_for_norm(g, norm_type) for g in grads]
    call = dict(grads=grads, norm_type=norm_type)
    return dispatch("grad_norm", call, grads[0].device).run(**call)


def _real_for_norm(grad, norm_type):
    """A real tensor with ``grad``'s norm, as torch measures a complex one (by ``|z|``): its (real, imaginary)
    pairs for the 2-norm (no copy), else the magnitudes."""
    if not grad.is_complex():
        return grad
    return torch.view_as_real(grad) if norm_type == 2.0 else grad.abs()


def clip_coefficient(norm: torch.Tensor, max_norm) -> torch.Tensor:
    """min(1, max_norm / (norm + 1e-6)) as a device scalar: torch's clip_grad_norm_ factor (1 for an
    infinite ``max_norm`` and a finite norm, NaN for a NaN norm or both infinite). A one-element tensor
    ``max_norm`` is the number it holds, as torch's ``float(max_norm)`` reads it, in the norm's dtype and place (no
    host synchronisation)."""
    max_norm = checks.as_number(max_norm)
    if isinstance(max_norm, torch.Tensor):
        max_norm = max_norm.to(norm.device, norm.dtype).reshape(())
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """Scale the grads of ``parameters`` in place so their global norm is at most ``max_norm``.

    Same meaning as ``torch.nn.utils.clip_grad_norm_``; returns the total norm
    (before clipping) as a tensor. Only ``error_if_nonfinite=True`` reads the
    norm on the host; otherwise nothing waits for the device. ``foreach`` is
    accepted for drop-in compatibility and ignored: the scaling is always one
    multi-tensor ``_foreach_mul_``. DTensor grads (FSDP2) are reduced across
    the ranks that hold their shards, so every rank clips by the same factor.
    """
    checks.check_number("max_norm", max_norm, low=0.0, finite=False)  # inf: measure, never clip
    grads = grads_of(parameters)
    call = grad_norm_call(locals_of(grads), norm_type)
    if not grads:
        return torch.zeros(())
    norm = global_norm(grads, call["norm_type"], checked_total_norm)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"The total norm of order {call['norm_type']} for gradients from `parameters` is "
                           "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
                           "by the non-finite norm anyway, set `error_if_nonfinite=False`")
    coef = clip_coefficient(norm, max_norm)
    for same_device in _by_device_and_dtype(call["grads"]):
        torch._foreach_mul_(same_device, _factor_for(coef, same_device[0]))
    return norm


def _factor_for(coef, grad):
    """``coef`` where ``grad``'s group is multiplied: in bfloat16 for bfloat16 grads, as torch's clip has it (the
    product rounds to bfloat16 either way, and the CUDA foreach kernel's fast path takes a factor of the grads'
    dtype only); float32 otherwise (a float16 factor would flush a tiny one to zero)."""
    dtype = torch.bfloat16 if grad.dtype == torch.bfloat16 else None
    return coef.to(grad.device, dtype)


def _by_device_and_dtype(tensors):
    if len(set(map(_dtype, tensors))) == 1 and len(set(map(_device, tensors))) == 1:  # C-level: the common call
        return [tensors]
    groups: dict[tuple, list] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups.values()
