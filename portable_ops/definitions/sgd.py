"""SGD with momentum, dampening, Nesterov, L2 weight decay and maximize, one tensor at a time, in plain PyTorch.

``torch.optim.SGD``'s semantics, written to be read (run in float64 it is the conformance oracle).
Arithmetic is done in float32 for half-precision tensors, as torch's fused kernel does, and each
result is rounded once, on the store. ``first_steps[i]`` says that ``momentum_buffers[i]`` is new
(torch's ``momentum_buffer`` was None): it is then set to the grad, as torch's clone of the grad does,
instead of being decayed. A step that scales its grads (``grad_scale``, ``clip_coef``) writes them back
scaled, as torch's fused kernel does. ``found_inf`` selects the old values with ``torch.where`` instead of
branching on the host.
"""

from __future__ import annotations

import torch

from .adam import opmath, scaled_grad


def sgd(params, grads, momentum_buffers, first_steps, *, lr, momentum, dampening, weight_decay, nesterov, maximize,
        grad_scale=None, found_inf=None, clip_coef=None):
    for i, param in enumerate(params):
        dtype = opmath(param.dtype)
        skip = None if found_inf is None else _scalar(found_inf, param.device, torch.bool)
        grad = scaled_grad(grads[i], grad_scale, clip_coef, dtype)
        updates = [] if grad_scale is None and clip_coef is None else [(grads[i], grad)]
        if maximize:
            grad = -grad
        p = param.to(dtype)
        if weight_decay != 0:  # skipped when zero, as in torch: 0 * a NaN param would poison the grad
            grad = grad + weight_decay * p
        if momentum != 0:
            if first_steps[i]:  # torch clones the grad into a new buffer
                buf = grad
            else:
                buf = momentum * momentum_buffers[i].to(dtype) + (1 - dampening) * grad
            updates.append((momentum_buffers[i], buf))
            grad = grad + momentum * buf if nesterov else buf
        lr_t = _scalar(lr, p.device, dtype) if isinstance(lr, torch.Tensor) else lr
        updates.append((param, p - lr_t * grad))
        for dst, new in updates:
            new = new.to(dst.device, dst.dtype)
            dst.copy_(new if skip is None else torch.where(skip, dst, new))


def _scalar(t, device, dtype):
    """A one-element tensor (lr, grad_scale, found_inf, clip_coef: ``[1]`` as well as 0-d) as a 0-d one, so it
    broadcasts to a 0-d param's shape, not ``[1]``."""
    return t.to(device, dtype).reshape(())
