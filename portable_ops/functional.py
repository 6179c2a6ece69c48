"""Stateless multi-tensor optimizer steps: the functions the optimizer classes call."""

from __future__ import annotations

import torch

from . import checks, sgd_checks
from .dispatch import dispatch


def check_written_grads(grads, name=None) -> None:
    """Grads a step writes back (scaled): none sharing an element with another or among its own (an expanded
    view), refused before anything is written. ``name(i)``: how a message names ``grads[i]``."""
    checks.check_distinct("grads", grads, name)
    sgd_checks.check_no_internal_overlap("grads", grads, name)


def adam_call(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, amsgrad=False, beta1=0.9,
              beta2=0.999, lr=1e-3, weight_decay=0.0, eps=1e-8, maximize=False, decoupled_weight_decay=False,
              grad_scale=None, found_inf=None, clip_coef=None, state_dtype=None, checked_layouts=None):
    """Check every argument of an Adam step; return the call as the backends take it.

    Backends read the state's dtype from the tensors, so ``state_dtype`` is checked, not passed on.
    Hyperparameters reach them as Python floats (``lr`` may stay a tensor), complex tensors as their
    (real, imaginary) pairs.

    ``checked_layouts``: ``checks.layouts(params)``, taken by the caller on this step and equal to
    the layouts the moment and step lists were checked against on an earlier one, which have not
    changed since (the optimizer classes know); only the grads are checked, against these.
    """
    checks.check_adam_hyperparameters(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    checks.check_state_dtype(state_dtype)
    lists = {"params": params, "grads": grads}
    if checked_layouts is None:
        lists.update(exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs)
        if amsgrad:
            lists["max_exp_avg_sqs"] = max_exp_avg_sqs
        checks.check_steps(state_steps, params)
        checks.check_distinct("params", params)
        checks.check_distinct("state_steps", state_steps)
    dtypes = checks.check_tensor_lists(lists, like="params", state=("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"),
                                       state_dtype=state_dtype, like_layouts=checked_layouts)
    if checked_layouts is None:  # the tensors the step writes: none with elements sharing memory (expanded)
        for arg, tensors in lists.items():
            if arg != "grads":
                sgd_checks.check_no_internal_overlap(arg, tensors)
    device = params[0].device if params else None
    scalars = (("grad_scale", grad_scale), ("found_inf", found_inf), ("clip_coef", clip_coef))
    grad_scale, found_inf, clip_coef = (checks.check_scalar_tensor(arg, t, device) for arg, t in scalars)
    if grad_scale is not None or clip_coef is not None:  # the step writes the scaled grads back
        check_written_grads(grads)
    if isinstance(lr, torch.Tensor):
        lr = checks.check_scalar_tensor("lr", lr, device)
    max_exp_avg_sqs = max_exp_avg_sqs if amsgrad else []
    tensors = [params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs]
    if any(dtype.is_complex for dtype in dtypes):  # checked above: each tensor is complex where its param is
        tensors = [checks.as_real(ts) for ts in tensors]
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs = map(list, tensors)
    return dict(params=params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
                max_exp_avg_sqs=max_exp_avg_sqs, state_steps=list(state_steps), amsgrad=bool(amsgrad),
                beta1=float(beta1), beta2=float(beta2), lr=lr if isinstance(lr, torch.Tensor) else float(lr),
                weight_decay=float(weight_decay), eps=float(eps), maximize=bool(maximize),
                decoupled_weight_decay=bool(decoupled_weight_decay), grad_scale=grad_scale,
                found_inf=found_inf, clip_coef=clip_coef)


def adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, foreach=None, capturable=False,
         differentiable=False, fused=None, grad_scale=None, found_inf=None, has_complex=False,
         decoupled_weight_decay=False, *, amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-3, weight_decay=0.0,
         eps=1e-8, maximize=False, clip_coef=None, state_dtype=None):
    """One Adam (``decoupled_weight_decay=False``) or AdamW step over lists of tensors, in place.

    ``torch.optim.adam.adam``'s signature, positionally and by keyword, and its meaning:
    ``state_steps`` are one-element float tensors incremented here; ``grad_scale`` divides every
    grad first (AMP), and the grads are left so divided, as torch's fused kernel leaves them; a non-zero
    ``found_inf`` makes the step change nothing, grads included; complex tensors are
    stepped as (real, imaginary) pairs. ``foreach``, ``fused`` and ``capturable`` are accepted and
    change nothing (the step is always the fused multi-tensor path, with ``state_steps`` on the
    params' device); ``has_complex`` is accepted and not needed (complex tensors are found by their
    dtype); ``differentiable=True`` is refused: the fused step is not differentiable.

    Beyond torch's, keyword-only: ``clip_coef`` (a device scalar, from global-norm clipping)
    multiplies every grad, so clipping fuses into the step: the grads are left clipped, as
    ``clip_grad_norm_`` leaves them, read once and written once.
    ``state_dtype`` says what the caller's moment tensors hold: None, the param's dtype (as
    torch); ``torch.float32``, float32 for float16/bfloat16 params (and the param's dtype for
    float32/float64 ones). The step is then computed in float32 from the float32 state and the
    param is rounded once, to its dtype.
    """
    if differentiable:
        raise ValueError("differentiable=True is not supported: the fused step is not differentiable")
    call = adam_call(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, amsgrad=amsgrad,
                     beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, maximize=maximize,
                     decoupled_weight_decay=decoupled_weight_decay, grad_scale=grad_scale, found_inf=found_inf,
                     clip_coef=clip_coef, state_dtype=state_dtype)
    if not call["params"]:
        return
    dispatch("adam", call, call["params"][0].device).run(**call)


def sgd_call(params, grads, momentum_buffer_list, *, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
             nesterov=False, maximize=False, grad_scale=None, found_inf=None, clip_coef=None, checked_layouts=None):
    """Check every argument of an SGD step; return the call as the backends take it.

    Under momentum, each None of ``momentum_buffer_list`` gets a new buffer (uninitialised: the step sets it
    to the grad, as torch's clone does) and ``first_steps`` marks it; without momentum the list is not read,
    as in torch. ``checked_layouts``: as :func:`adam_call`'s, the buffers' layouts checked on an earlier step.
    """
    sgd_checks.check_sgd_hyperparameters(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                         nesterov=nesterov)
    with_momentum = float(momentum) != 0
    if checked_layouts is None:
        checks.check_distinct("params", params)
    checks.check_tensor_lists({"params": params, "grads": grads}, like="params", like_layouts=checked_layouts)
    if checked_layouts is None:
        sgd_checks.check_no_internal_overlap("params", params)
    new = []
    if with_momentum:
        new = sgd_checks.check_momentum_buffers(momentum_buffer_list, params, checked=checked_layouts is not None)
    device = params[0].device if params else None
    scalars = (("grad_scale", grad_scale), ("found_inf", found_inf), ("clip_coef", clip_coef))
    grad_scale, found_inf, clip_coef = (checks.check_scalar_tensor(arg, t, device) for arg, t in scalars)
    if grad_scale is not None or clip_coef is not None:  # the step writes the scaled grads back
        check_written_grads(grads)
    if isinstance(lr, torch.Tensor):
        lr = checks.check_scalar_tensor("lr", lr, device)
    buffers, first_steps = [], ()
    if with_momentum:
        buffers = list(momentum_buffer_list)
        for i in new:
            buffers[i] = torch.empty_like(params[i], memory_format=torch.contiguous_format)
        first_steps = tuple(b is None for b in momentum_buffer_list)
    params, grads, buffers = (list(checks.as_real(ts)) for ts in (params, grads, buffers))
    return dict(params=params, grads=grads, momentum_buffers=buffers, first_steps=first_steps,
                lr=lr if isinstance(lr, torch.Tensor) else float(lr), momentum=float(momentum),
                dampening=float(dampening), weight_decay=float(weight_decay), nesterov=bool(nesterov),
                maximize=bool(maximize), grad_scale=grad_scale, found_inf=found_inf, clip_coef=clip_coef)


def skipped_before_buffers_exist(call) -> bool:
    """Whether ``found_inf`` skips a step that would create momentum buffers: the step is then not taken and the
    buffers stay unmade (torch's SGD, whose GradScaler skips the whole step), which takes reading ``found_inf``
    on the host, on such steps only (a later step's skip is done on the device)."""
    return call["found_inf"] is not None and any(call["first_steps"]) and bool(call["found_inf"].item() != 0)


def sgd(params, d_p_list, momentum_buffer_list, has_sparse_grad=False, foreach=None, fused=None, grad_scale=None,
        found_inf=None, *, weight_decay=0.0, momentum=0.0, lr=1e-3, dampening=0.0, nesterov=False, maximize=False,
        clip_coef=None):
    """One SGD step over lists of tensors, in place.

    ``torch.optim.sgd.sgd``'s signature, positionally and by keyword, and its meaning: under momentum, each
    None of ``momentum_buffer_list`` is replaced, in the list, by a new buffer holding the grad (after weight
    decay), as torch's clone; ``grad_scale`` divides every grad first (AMP), and the grads are left so divided,
    as torch's fused kernel leaves them; a non-zero ``found_inf`` makes the step change nothing, grads included.
    ``foreach``, ``fused`` and ``has_sparse_grad`` are accepted and change nothing (the step is always the fused
    multi-tensor path; sparse grads are refused).

    Beyond torch's, keyword-only: ``clip_coef`` (a device scalar, from global-norm clipping) multiplies every
    grad, so clipping fuses into the step: the grads are left clipped, as ``clip_grad_norm_`` leaves them.
    """
    call = sgd_call(params, d_p_list, momentum_buffer_list, lr=lr, momentum=momentum, dampening=dampening,
                    weight_decay=weight_decay, nesterov=nesterov, maximize=maximize, grad_scale=grad_scale,
                    found_inf=found_inf, clip_coef=clip_coef)
    if not call["params"]:
        return
    kernel = dispatch("sgd", call, call["params"][0].device)
    if skipped_before_buffers_exist(call):
        return
    kernel.run(**call)
    for i, first in enumerate(call["first_steps"]):
        if first:
            buffer = call["momentum_buffers"][i]
            momentum_buffer_list[i] = torch.view_as_complex(buffer) if params[i].is_complex() else buffer
