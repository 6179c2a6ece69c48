"""Adam / AdamW / AMSGrad through torch's fused multi-tensor kernel for the device (what
``torch.optim.AdamW(fused=True)`` runs).

The kernel divides the grads by ``grad_scale`` in float32 and writes them back unscaled; the op
leaves the caller's grads as they were, so a call with a grad scale or a clip hands the kernel
copies, the clip folded into the scale.
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam as torch_adam

from portable_ops.definitions.adam import adam as definition

FUSED_DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fused_takes(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, amsgrad):
    device = params[0].device
    if device.type not in FUSED_DEVICE_TYPES:
        return False
    moments = (grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs) if amsgrad else (grads, exp_avgs, exp_avg_sqs)
    for i, p in enumerate(params):
        if p.dtype not in FUSED_DTYPES or p.device != device:
            return False
        if any(m[i].dtype != p.dtype or m[i].device != device for m in moments):
            return False
        if state_steps[i].dtype != torch.float32 or state_steps[i].device != device:
            return False
    return True


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
    if grad_scale is not None:
        grads = [g.clone() for g in grads]
    if found_inf is not None:
        found_inf = found_inf.to(device, torch.float32)
    max_exp_avg_sqs = max_exp_avg_sqs if amsgrad else []
    torch_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, fused=True, grad_scale=grad_scale,
               found_inf=found_inf, **options)
    # the fused kernel writes without bumping version counters; autograd must see a saved param change
    torch.autograd.graph.increment_version([*params, *exp_avgs, *exp_avg_sqs, *max_exp_avg_sqs])
