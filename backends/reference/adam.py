"""Adam / AdamW / AMSGrad through torch's fused multi-tensor kernel for the device (what
``torch.optim.AdamW(fused=True)`` runs).

The kernel divides the grads by ``grad_scale`` in float32 and writes them back unscaled; the op
leaves the caller's grads as they were. So with a grad scale or a clip (folded into the scale),
float32 and float64 grads are scaled into new tensors first (one ``_foreach_mul``, the pass
``clip_grad_norm_`` makes in place), and half-precision ones are copied for the kernel to unscale.
"""

from __future__ import annotations

import itertools
import operator

import torch
from torch.optim.adam import adam as torch_adam

from portable_ops.definitions.adam import adam as definition

FUSED_DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


_dtype = operator.attrgetter("dtype")
_device = operator.attrgetter("device")


def _fused_takes(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, amsgrad):
    """Whether the kernel takes the call; C-level passes over the lists, as this runs on every step."""
    device = params[0].device
    if device.type not in FUSED_DEVICE_TYPES:
        return False
    dtypes = list(map(_dtype, params))
    if not set(dtypes) <= set(FUSED_DTYPES) or set(map(_dtype, state_steps)) != {torch.float32}:
        return False
    moments = (grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs) if amsgrad else (grads, exp_avgs, exp_avg_sqs)
    if any(list(map(_dtype, m)) != dtypes for m in moments):
        return False
    return {device} == set(map(_device, itertools.chain(params, state_steps, *moments)))


def adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, amsgrad, beta1, beta2,
         lr, weight_decay, eps, maximize, decoupled_weight_decay, grad_scale=None, found_inf=None,
         clip_coef=None):
    options = dict(amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps,
                   maximize=maximize, decoupled_weight_decay=decoupled_weight_decay)
    if not params or not _fused_takes(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, amsgrad):
        definition(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, grad_scale=grad_scale,
                   found_inf=found_inf, clip_coef=clip_coef, **options)
        return
    device = params[0].device
    if grad_scale is not None:
        grad_scale = grad_scale.to(device, torch.float32)
    if clip_coef is not None:
        clip_coef = clip_coef.to(device, torch.float32)
        grad_scale = clip_coef.reciprocal() if grad_scale is None else grad_scale / clip_coef
    if grad_scale is not None and set(map(_dtype, params)) <= {torch.float32, torch.float64}:
        grads, grad_scale = torch._foreach_mul(grads, grad_scale.reciprocal()), None
    elif grad_scale is not None:
        grads = [g.clone() for g in grads]  # a half grad is unscaled in the kernel's float32, not rounded first
    if found_inf is not None:
        found_inf = found_inf.to(device, torch.float32)
    max_exp_avg_sqs = max_exp_avg_sqs if amsgrad else []
    torch_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, fused=True, grad_scale=grad_scale,
               found_inf=found_inf, **options)
    # the fused kernel writes without bumping version counters; autograd must see a saved param change
    torch.autograd.graph.increment_version([*params, *exp_avgs, *exp_avg_sqs, *max_exp_avg_sqs])
