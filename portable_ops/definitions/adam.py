"""Adam / AdamW / AMSGrad, one tensor at a time, in plain PyTorch.

This is the definition every other backend is checked against (run in float64
it is the conformance oracle). Arithmetic is done in float32 for half-precision
tensors, as torch's fused kernels do, and the results are rounded once, on the
store. A step that scales its grads (``grad_scale``, ``clip_coef``) writes them
back scaled, before ``maximize``'s negation, as torch's fused kernels do.
``found_inf`` selects the old values with ``torch.where`` instead of branching
on the host, so this path never synchronises either.
"""

from __future__ import annotations

import torch


def opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def scaled_grad(grad, grad_scale, clip_coef, dtype):
    """``grad / grad_scale * clip_coef`` in ``dtype``: the grad a step reads and, where either is set, writes back
    to the caller's grad (as torch's fused kernels unscale theirs in place)."""
    grad = grad.to(dtype)
    if grad_scale is not None:
        grad = grad / grad_scale.to(grad.device, dtype).reshape(())
    if clip_coef is not None:
        grad = grad * clip_coef.to(grad.device, dtype).reshape(())
    return grad


def adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, amsgrad, beta1, beta2,
         lr, weight_decay, eps, maximize, decoupled_weight_decay, grad_scale=None, found_inf=None,
         clip_coef=None):
    for i, param in enumerate(params):
        dtype = opmath(param.dtype)
        step_t = state_steps[i]
        skip = None if found_inf is None else found_inf.to(step_t.device, torch.bool)
        step = step_t.to(dtype) + 1

        grad = scaled_grad(grads[i], grad_scale, clip_coef, dtype)
        updates = [] if grad_scale is None and clip_coef is None else [(grads[i], grad)]
        if maximize:
            grad = -grad
        p = param.to(dtype)
        lr_t = lr.to(p.device, dtype) if isinstance(lr, torch.Tensor) else lr
        if weight_decay != 0:
            if decoupled_weight_decay:
                p = p * (1 - lr_t * weight_decay)
            else:
                grad = grad + weight_decay * p

        exp_avg = exp_avgs[i].to(dtype).lerp(grad, 1 - beta1)
        exp_avg_sq = exp_avg_sqs[i].to(dtype) * beta2 + (1 - beta2) * grad * grad
        step_d = step.to(p.device)
        bias_correction1 = 1 - beta1 ** step_d
        bias_correction2_sqrt = (1 - beta2 ** step_d).sqrt()
        second_moment = exp_avg_sq
        if amsgrad:
            second_moment = torch.maximum(max_exp_avg_sqs[i].to(dtype), exp_avg_sq)
        denom = second_moment.sqrt() / bias_correction2_sqrt + eps
        p = p - (lr_t / bias_correction1) * exp_avg / denom

        updates += [(param, p), (exp_avgs[i], exp_avg), (exp_avg_sqs[i], exp_avg_sq), (step_t, step)]
        if amsgrad:
            updates.append((max_exp_avg_sqs[i], second_moment))
        for dst, new in updates:
            new = new.to(dst.device, dst.dtype)
            dst.copy_(new if skip is None else torch.where(skip.to(dst.device), dst, new))
