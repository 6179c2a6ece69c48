"""Adam / AdamW / AMSGrad through torch's fused multi-tensor kernel, what ``torch.optim.AdamW(fused=True)``
runs. Where a grad is non-finite, its kernel may leave NaN in a moment where the definition has an
infinity (torch's CUDA kernel does): the param is NaN either way, and the kind of a non-finite moment
is not part of the contract (docs/api.md).

The kernel takes a call whose tensors agree, index by index, in device and dtype (the optimizer's
state in the param's dtype), all contiguous, with float32 step counts beside the params; the steps are
counted here, as torch's ``adam`` does around it. A call that scales the grads (a clip, a GradScaler's
scale) hands the kernel a divisor, which it applies to the grads in place (``kernel_scalars.py``). A call the
kernel doesn't take (a ``state_dtype`` unlike the param's, say) runs the definition."""

from __future__ import annotations

import itertools
import operator

import torch

from portable_ops.definitions.adam import adam as definition
from portable_ops.sgd_checks import check_no_internal_overlap

from .kernel_scalars import by_dtype, grad_multiplier, kernel_grad_scale, kernel_scalars

KERNEL_DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")
KERNEL_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64}

_dtype = operator.attrgetter("dtype")
_dtype_and_device = operator.attrgetter("dtype", "device")


def _kernels_take(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, amsgrad):
    """Whether the kernels take the call's tensors; C-level passes over the lists, as this runs every step.

    The call is checked: grads and moments are shaped and placed like their params, on one device,
    and the moments are of one dtype per index."""
    device = params[0].device
    if device.type not in KERNEL_DEVICE_TYPES:
        return False
    dtypes = list(map(_dtype, params))
    if not set(dtypes) <= KERNEL_DTYPES or list(map(_dtype, exp_avgs)) != dtypes:
        return False
    if set(map(_dtype_and_device, state_steps)) != {(torch.float32, device)}:
        return False
    # the fused kernel walks each tensor's memory as if dense: a strided view would be misread or overwritten
    moments = (exp_avgs, exp_avg_sqs, max_exp_avg_sqs) if amsgrad else (exp_avgs, exp_avg_sqs)
    return all(map(torch.Tensor.is_contiguous, itertools.chain(params, grads, *moments)))


def adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, amsgrad, beta1, beta2,
         lr, weight_decay, eps, maximize, decoupled_weight_decay, grad_scale=None, found_inf=None,
         clip_coef=None):
    options = dict(amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps,
                   maximize=maximize, decoupled_weight_decay=decoupled_weight_decay)
    if not (params and _kernels_take(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, amsgrad)):
        # one-element tensors as 0-d ones: a [1] lr or grad_scale (GradScaler's are [1]) would broadcast a 0-d
        # param's update to [1], which can't be written back (after the params before it were)
        grad_scale, found_inf, clip_coef, options["lr"] = map(_as_0d, (grad_scale, found_inf, clip_coef, lr))
        # the definition writes tensor after tensor: one whose elements share memory (a param's .data swapped for
        # an expanded view since the optimizer checked it; the kernel takes contiguous tensors only) is refused first
        for arg, tensors in (("params", params), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs),
                             ("max_exp_avg_sqs", max_exp_avg_sqs if amsgrad else []),
                             ("grads", grads if grad_scale is not None or clip_coef is not None else [])):
            check_no_internal_overlap(arg, tensors)
        definition(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, grad_scale=grad_scale,
                   found_inf=found_inf, clip_coef=clip_coef, **options)
        return
    device = params[0].device
    lr, found_inf = kernel_scalars(lr, found_inf, device)
    multiplier = grad_multiplier(grad_scale, clip_coef, device)
    kernel = torch._fused_adamw_ if decoupled_weight_decay else torch._fused_adam_
    max_exp_avg_sqs = max_exp_avg_sqs if amsgrad else []
    torch._foreach_add_(state_steps, 1 if found_inf is None else 1 - found_inf)  # a skipped step is not counted
    for g, (p, m, v, vmax, steps) in by_dtype(grads, (params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)):
        kernel(p, g, m, v, vmax, steps, amsgrad=amsgrad, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
               eps=eps, maximize=maximize, grad_scale=kernel_grad_scale(g, multiplier, found_inf),
               found_inf=found_inf)
    # the fused kernel writes without bumping version counters; autograd must see a saved tensor change
    torch.autograd.graph.increment_version([*params, *exp_avgs, *exp_avg_sqs, *max_exp_avg_sqs,
                                            *(grads if multiplier is not None else ())])


def _as_0d(t):
    return t.reshape(()) if isinstance(t, torch.Tensor) and t.dim() else t
