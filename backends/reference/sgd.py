"""SGD through torch's multi-tensor kernels: its fused kernel (what ``torch.optim.SGD(fused=True)`` runs,
``torch._fused_sgd_``) on the devices torch has it for, else its foreach kernels (``foreach=True``, torch's
default on CUDA) for float32/float64, else the definition. The foreach kernels round every intermediate of
a float16/bfloat16 step to 16 bits (the definition and the fused kernel compute in float32 and round once),
so half-precision calls they would take run the definition; so do those on the CPU, where torch's fused kernel
(2.13) computes wrong values for float16/bfloat16 tensors of 16 elements or more (its vectorised loop;
``tests/test_sgd_kernels.py`` shows it).

The fused kernel's ``is_first_step`` (set the momentum buffer to the
grad) is one flag per launch, so a call whose new and old buffers are mixed (params that got their first grad
later) is two launches. A call with a ``grad_scale`` or a clip hands the fused kernel a divisor, which it
applies to the grads in place (``kernel_scalars.py``); the foreach path clips the grads in place first. The
foreach path has no ``grad_scale`` or ``found_inf`` and reads a tensor ``lr`` on the host: such calls off the
fused kernel's devices run the definition, as do calls whose tensors aren't contiguous.
"""

from __future__ import annotations

import operator

import torch
from torch.optim.sgd import sgd as torch_sgd
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from portable_ops.definitions.sgd import sgd as definition
from portable_ops.sgd_checks import check_no_internal_overlap

from .kernel_scalars import grad_multiplier, kernel_grad_scale, kernel_scalars

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
FUSED_DEVICE_TYPES = tuple(_get_fused_kernels_supported_devices())
HALF_DTYPES = (torch.float16, torch.bfloat16)

_dtype = operator.attrgetter("dtype")
_device = operator.attrgetter("device")


def _kernels_take(params, grads, momentum_buffers) -> bool:
    """Whether torch's kernels take the call's tensors; C-level passes, as this runs every step."""
    dtypes = list(map(_dtype, params))
    if not set(dtypes) <= set(KERNEL_DTYPES):
        return False
    tensors = [*params, *grads, *momentum_buffers]
    # the fused kernel walks each tensor's memory as if dense: a strided view would be misread or overwritten
    return len(set(map(_device, tensors))) == 1 and all(map(torch.Tensor.is_contiguous, tensors))


def _groups(params, first_steps):
    """Positions by (dtype, first step): one fused launch each, as torch groups by dtype."""
    groups: dict = {}
    for i, p in enumerate(params):
        groups.setdefault((p.dtype, bool(first_steps[i]) if first_steps else False), []).append(i)
    return groups.items()


def sgd(params, grads, momentum_buffers, first_steps, *, lr, momentum, dampening, weight_decay, nesterov, maximize,
        grad_scale=None, found_inf=None, clip_coef=None):
    options = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                   maximize=maximize)
    take = bool(params) and _kernels_take(params, grads, momentum_buffers)
    device_type = params[0].device.type if params else None
    half = take and not set(map(_dtype, params)).isdisjoint(HALF_DTYPES)
    fused = take and device_type in FUSED_DEVICE_TYPES and not (half and device_type == "cpu")
    foreach = (take and not fused and not half and grad_scale is None and found_inf is None
               and not isinstance(lr, torch.Tensor))
    if not (fused or foreach):
        # the definition writes tensor after tensor: one whose elements share memory (a param's .data swapped for
        # an expanded view since the optimizer checked it) would fail after those before it were written
        check_no_internal_overlap("params", params)
        check_no_internal_overlap("momentum_buffers", momentum_buffers)
        if grad_scale is not None or clip_coef is not None:
            check_no_internal_overlap("grads", grads)
        definition(params, grads, momentum_buffers, first_steps, grad_scale=grad_scale, found_inf=found_inf,
                   clip_coef=clip_coef, **options)
        return
    if foreach:
        _foreach(params, grads, momentum_buffers, first_steps, clip_coef, options)
    else:
        _fused(params, grads, momentum_buffers, first_steps, grad_scale, found_inf, clip_coef, options)
    # the fused kernel writes without bumping version counters; autograd must see a saved tensor change
    scaled = grad_scale is not None or clip_coef is not None
    torch.autograd.graph.increment_version([*params, *momentum_buffers, *(grads if scaled else ())])


def _fused(params, grads, momentum_buffers, first_steps, grad_scale, found_inf, clip_coef, options):
    device = params[0].device
    lr, found_inf = kernel_scalars(options["lr"], found_inf, device)
    multiplier = grad_multiplier(grad_scale, clip_coef, device)
    for (_, first), idx in _groups(params, first_steps):
        g = [grads[i] for i in idx]
        torch._fused_sgd_([params[i] for i in idx], g, [momentum_buffers[i] for i in idx] if momentum_buffers else [],
                          weight_decay=options["weight_decay"], momentum=options["momentum"], lr=lr,
                          dampening=options["dampening"], nesterov=options["nesterov"], maximize=options["maximize"],
                          is_first_step=first, grad_scale=kernel_grad_scale(g, multiplier, found_inf),
                          found_inf=found_inf)


def _foreach(params, grads, momentum_buffers, first_steps, clip_coef, options):
    if clip_coef is not None:  # the foreach kernels take no grad scale
        torch._foreach_mul_(grads, clip_coef.to(params[0].device))
    if options["nesterov"] and not options["maximize"] and not options["weight_decay"]:
        grads = [g.clone() for g in grads]  # torch's foreach Nesterov adds the buffer to the grads it was handed
    # torch clones the grad into a None buffer: hand it Nones there, and keep its clones in the call's buffers
    buffers = [None if first else b for b, first in zip(momentum_buffers, first_steps)]
    torch_sgd(params, grads, buffers, foreach=True, **options)
    made = [i for i, first in enumerate(first_steps) if first]
    if made:
        torch._foreach_copy_([momentum_buffers[i] for i in made], [buffers[i] for i in made])
