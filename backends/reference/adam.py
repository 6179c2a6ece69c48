"""Adam / AdamW / AMSGrad through torch's multi-tensor kernels: its fused kernel (what
``torch.optim.AdamW(fused=True)`` runs), except for float32 and float64 off the CPU, where its
foreach kernels run (``foreach=True``). torch's fused CUDA kernel writes NaN to ``exp_avg`` where a
grad is infinite and the definition keeps the infinity; its foreach kernels compute the
definition's values, but half-precision ones in half precision, where the definition and the fused
kernel compute in float32.

The kernels take a call whose tensors agree, index by index, in device and dtype (the optimizer's
state in the param's dtype), all contiguous, with float32 step counts beside the params. They leave
the caller's grads as they were: the kernels scale copies of them instead (``grad_copies.py``), a clip
folded into the grad scale. A call the kernels don't take (a ``state_dtype`` unlike the param's, say) runs the
definition; so does a float32 call off the CPU with a ``found_inf`` or a tensor ``lr``, which the
foreach kernels don't take."""

from __future__ import annotations

import itertools
import operator

import torch
from torch.optim.adam import adam as torch_adam

from portable_ops.definitions.adam import adam as definition

from .grad_copies import copies_of, keep

KERNEL_DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
WIDE = {torch.float32, torch.float64}

_dtype = operator.attrgetter("dtype")
_device = operator.attrgetter("device")


def _kernels_take(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, amsgrad):
    """Whether the kernels take the call's tensors; C-level passes over the lists, as this runs every step."""
    device = params[0].device
    if device.type not in KERNEL_DEVICE_TYPES:
        return False
    dtypes = list(map(_dtype, params))
    if not set(dtypes) <= set(KERNEL_DTYPES) or set(map(_dtype, state_steps)) != {torch.float32}:
        return False
    moments = (grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs) if amsgrad else (grads, exp_avgs, exp_avg_sqs)
    if any(list(map(_dtype, m)) != dtypes for m in moments):
        return False
    tensors = list(itertools.chain(params, *moments))
    # the fused kernel walks each tensor's memory as if dense: a strided view would be misread or overwritten
    return {device} == set(map(_device, tensors + state_steps)) and all(map(torch.Tensor.is_contiguous, tensors))


def adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, amsgrad, beta1, beta2,
         lr, weight_decay, eps, maximize, decoupled_weight_decay, grad_scale=None, found_inf=None,
         clip_coef=None):
    options = dict(amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps,
                   maximize=maximize, decoupled_weight_decay=decoupled_weight_decay)
    take = bool(params) and _kernels_take(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, amsgrad)
    wide = take and set(map(_dtype, params)) <= WIDE
    fused = take and (params[0].device.type == "cpu" or not wide)
    if not fused and not (take and found_inf is None and not isinstance(lr, torch.Tensor)):
        definition(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, grad_scale=grad_scale,
                   found_inf=found_inf, clip_coef=clip_coef, **options)
        return
    device = params[0].device
    if grad_scale is not None:
        grad_scale = grad_scale.to(device, torch.float32)
    if clip_coef is not None:
        clip_coef = clip_coef.to(device, torch.float32)
        grad_scale = clip_coef.reciprocal() if grad_scale is None else grad_scale / clip_coef
    copies = None
    if grad_scale is not None:
        copies = copies_of(grads)
        grads = copies[1]
        if not fused:  # foreach takes no grad_scale, and runs only wide dtypes here
            torch._foreach_mul_(grads, grad_scale.reciprocal())
            grad_scale = None
    if found_inf is not None:
        found_inf = found_inf.to(device, torch.float32)
    max_exp_avg_sqs = max_exp_avg_sqs if amsgrad else []
    torch_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, fused=fused, foreach=not fused,
               grad_scale=grad_scale, found_inf=found_inf, **options)
    # the fused kernel writes without bumping version counters; autograd must see a saved param change
    torch.autograd.graph.increment_version([*params, *exp_avgs, *exp_avg_sqs, *max_exp_avg_sqs])
    if copies is not None:
        keep(copies)
