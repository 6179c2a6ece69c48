"""Fused SGD (momentum, dampening, Nesterov, L2 weight decay, maximize): one NKI kernel launch updates every
tensor of a step, in place.

The kernel walks the step's tensors as a table (``tensor_table``, as ``adam.py``'s does; its module docstring says
why): each tensor's flat HBM view as a ``[128, F]`` body in ``[128, 2048]`` tiles, the ``n % 128`` left over one
row of a tail tile shared by tensors of the same dtypes. A momentum buffer has its param's dtype, as torch's.

Everything that changes from step to step is data: a ``[128, 6]`` float32 HBM tensor of hyperparameters
(:data:`COLUMNS`) computed on the device with a few torch ops (no host synchronisation), so one compiled
kernel serves every step and every learning-rate schedule. Only structural flags select a variant: momentum
or not, whether the buffers are new (set to the grad instead of decayed: a step whose params mix new and old
buffers is two launches), dampening, Nesterov, weight decay, scaled grads, maximize, a found_inf gate.

Semantics are the definition's (``portable_ops/definitions/sgd.py``): tiles are loaded in their tensors' dtypes
(DMAs do not convert), the engines read them and compute in float32, and each new value is rounded once to its
tensor's dtype on an engine before the DMA stores it. With ``grad_scale`` or ``clip_coef`` set, each grad is stored
back as ``grad / grad_scale * clip_coef`` (before maximize's negation and the weight decay), rounded once to its
dtype, as torch's fused kernels unscale grads in place; otherwise grads are only read. A non-zero ``found_inf`` keeps
every old value, grads included (predicated copies of the new values onto the old tiles). The work is spread over
the engines (docs/backends/nki.md, cost model): the Scalar Engine does every product by a hyperparameter and a
16-bit buffer's rounding, the Vector Engine the weight decay and the buffer's update (``scalar_tensor_tensor``, a
product and a sum in one pass), GpSimd the Nesterov and param sums and the stored grad's rounding.
"""

from __future__ import annotations

import torch

from . import tensor_table
from .compat import nki, nisa, nl
from .runtime import kernel_op, launch, no_outputs

PMAX = 128
F_TILE = 2048  # elements per partition per tile: 4 KiB DMA payloads for 16-bit tensors; ~10 live fp32 tiles = 80 KiB
MAX_TENSORS = 1024  # per launch: the table is unrolled at specialization time
# the grad multiplier (1 / grad_scale * clip_coef, negated under maximize), weight decay, momentum,
# 1 - dampening, -lr, and the found_inf gate (1.0 = apply the step)
COLUMNS = (MULT, WEIGHT_DECAY, MOMENTUM, DAMPENING_KEEP, NEG_LR, APPLY) = tuple(range(6))


def _update(p, g, buf, hp, shape, param_dtype, flags):
    """New ``(p, g, buf)`` SBUF tiles from the loaded ones (each in its tensor's dtype): p in ``param_dtype``, g (the
    scaled grad to store; None when grads are only read) in the grad's, buf float32 (None without momentum; ``buf``
    is not read when the buffers are new)."""
    momentum, first, dampened, nesterov, weight_decay, scale_grads, maximize = flags
    rows = shape[0]

    def col(i):
        return hp[0:rows, i:i + 1]

    def tile(dtype=nl.float32):
        return nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf)

    grad = g
    if scale_grads or maximize:  # g / grad_scale * clip_coef, negated under maximize
        grad = tile()
        nisa.activation(grad, op=nl.copy, data=g, scale=col(MULT))
    # the grad to store, maximize's negation undone, on GpSimd: ScalarE scales it, VectorE takes the gate's copies
    g_new = tensor_table.as_dtype(grad, g.dtype, negate=maximize, engine=nisa.engine.gpsimd) if scale_grads else None
    if weight_decay:  # + wd * p
        with_decay = tile()
        nisa.scalar_tensor_tensor(with_decay, data=p, op0=nl.multiply, operand0=col(WEIGHT_DECAY), op1=nl.add,
                                  operand1=grad)
        grad = with_decay
    buf_new = None
    direction = grad
    if momentum:
        if first:  # torch clones the grad into a new buffer
            buf_new = grad
        else:  # momentum * buf + (1 - dampening) * grad
            kept = grad
            if dampened:
                kept = tile()
                nisa.activation(kept, op=nl.copy, data=grad, scale=col(DAMPENING_KEEP))
            buf_new = tile()
            nisa.scalar_tensor_tensor(buf_new, data=buf, op0=nl.multiply, operand0=col(MOMENTUM), op1=nl.add,
                                      operand1=kept)
        direction = buf_new
        if nesterov:  # grad + momentum * buf: the product on the Scalar Engine, the sum on GpSimd
            direction = tile()
            nisa.activation(direction, op=nl.copy, data=buf_new, scale=col(MOMENTUM))
            nisa.tensor_tensor(direction, direction, grad, op=nl.add, engine=nisa.engine.gpsimd)
    # p - lr * direction, rounded once to the param's dtype: as above, so that VectorE carries only the weight
    # decay and the buffer
    step, p_new = tile(), tile(param_dtype)
    nisa.activation(step, op=nl.copy, data=direction, scale=col(NEG_LR))
    nisa.tensor_tensor(p_new, p, step, op=nl.add, engine=nisa.engine.gpsimd)
    return p_new, g_new, buf_new


def _step_tiles(views, dtypes, hp, pred, shape, flags, gated):
    """Load, update and store one tile's worth. ``views[k]`` / ``dtypes[k]`` (k: 0 param, 1 grad, 2 momentum
    buffer): where the HBM views land in the tile (tensor_table) and their dtype."""
    momentum, first = flags[0], flags[1]
    loaded = [tensor_table.load(views[k], dtypes[k], shape) for k in range(3 if momentum and not first else 2)]
    p, g = loaded[:2]
    buf = loaded[2] if len(loaded) > 2 else None
    for k, fresh in enumerate(_update(p, g, buf, hp, shape, dtypes[0], flags)):
        if fresh is None:
            continue
        fresh = tensor_table.as_dtype(fresh, dtypes[k])
        if gated and k < len(loaded):  # keep the old values where found_inf is set (a new buffer has none)
            nisa.tensor_copy_predicated(dst=loaded[k], src=fresh, predicate=pred[0:shape[0], 0:shape[1]])
            fresh = loaded[k]
        tensor_table.store(fresh, views[k])


@nki.jit
def sgd_kernel(params, grads, momentum_buffers, hyper, momentum=False, first=False, dampened=False,
               nesterov=False, weight_decay=False, gated=False, scale_grads=False, maximize=False):
    """One SGD step, in place, over lists of 1-D HBM tensors (the flat views of each parameter, its grad and
    momentum buffer; ``momentum_buffers`` is read only under ``momentum`` and not ``first``, written only
    under ``momentum``; ``grads`` written only under ``scale_grads``: grad_scale or clip_coef set). Under ``first``
    the new buffers are written ungated: the public API takes no first step under a set found_inf (it reads
    found_inf on the host for such a step)."""
    n = len(params)
    state = (params, grads, momentum_buffers)
    flags = (momentum, first, dampened, nesterov, weight_decay, scale_grads, maximize)
    hp = nl.ndarray((PMAX, hyper.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=hp, src=hyper)
    pred = None
    if gated:  # uint8 predicate: 1 where the step applies (found_inf == 0)
        ones = nl.ndarray((PMAX, F_TILE), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=ones, value=1.0)
        pred = nl.ndarray((PMAX, F_TILE), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=pred, data=ones, op0=nl.multiply, operand0=hp[0:PMAX, APPLY:APPLY + 1])

    def dtypes(i):
        return [t[i].dtype for t in state]

    for i in range(n):
        for views, shape in tensor_table.body_tiles(state, i, F_TILE):
            _step_tiles(views, dtypes(i), hp, pred, shape, flags, gated)
    for block in tensor_table.tail_blocks([t.shape[0] for t in params], [tuple(dtypes(i)) for i in range(n)]):
        views, shape = tensor_table.tail_tile(state, block)
        _step_tiles(views, dtypes(block[0]), hp, pred, shape, flags, gated)


# grads are declared written, scaled or not, as torch's _fused_sgd_ declares its grads (a schema is per op)
@kernel_op("sgd", no_outputs, mutates_args=("params", "grads", "momentum_buffers"))
def sgd_step(params: list[torch.Tensor], grads: list[torch.Tensor], momentum_buffers: list[torch.Tensor],
             hyper: torch.Tensor, momentum: bool, first: bool, dampened: bool, nesterov: bool, weight_decay: bool,
             gated: bool, scale_grads: bool, maximize: bool) -> None:
    """The kernel's launch as the op ``portable_ops_nki::sgd``: writes params, under ``momentum`` the buffers (empty
    otherwise, as the op's arguments may not alias one another), and under ``scale_grads`` the grads."""
    launch(sgd_kernel, params, grads, momentum_buffers if momentum else params, hyper, momentum=momentum, first=first,
           dampened=dampened, nesterov=nesterov, weight_decay=weight_decay, gated=gated, scale_grads=scale_grads,
           maximize=maximize)


# ----------------------------------------------------------------------------- host side
def hyperparameters(*, device, lr, momentum, dampening, weight_decay, maximize, grad_scale, found_inf,
                    clip_coef) -> torch.Tensor:
    """The ``[128, 6]`` float32 tensor the kernel reads, computed on ``device`` (no sync)."""
    f32 = torch.float32
    lr_t = (lr.to(device, f32).reshape(()) if isinstance(lr, torch.Tensor)
            else torch.tensor(lr, dtype=f32, device=device))
    one = torch.ones((), dtype=f32, device=device)
    mult = one
    if grad_scale is not None:
        mult = mult / grad_scale.to(device, f32).reshape(())
    if clip_coef is not None:
        mult = mult * clip_coef.to(device, f32).reshape(())
    if maximize:
        mult = -mult
    apply = one if found_inf is None else (found_inf.to(device).reshape(()) == 0).to(f32)
    row = torch.stack([mult, one * weight_decay, one * momentum, one * (1 - dampening), -lr_t, apply])
    return row.reshape(1, -1).expand(PMAX, -1).contiguous()


def sgd_supports(call) -> list[str]:
    """Dtypes are declared (``BACKEND``); the kernel updates flat views of the params, buffers (and scaled grads)
    in place."""
    noncontiguous = tensor_table.first_noncontiguous(call, ("params", "momentum_buffers"))
    if noncontiguous:
        return [f"{noncontiguous} is not contiguous (the NKI SGD kernel updates flat views in place)"]
    return []


def sgd(params, grads, momentum_buffers, first_steps, *, lr, momentum, dampening, weight_decay, nesterov, maximize,
        grad_scale=None, found_inf=None, clip_coef=None):
    live = [i for i, p in enumerate(params) if p.numel()]
    if not live:
        return
    device = params[live[0]].device
    hyper = hyperparameters(device=device, lr=lr, momentum=momentum, dampening=dampening,
                            weight_decay=weight_decay, maximize=maximize, grad_scale=grad_scale,
                            found_inf=found_inf, clip_coef=clip_coef)
    with_momentum = bool(momentum_buffers)
    flags = dict(momentum=with_momentum, dampened=dampening != 0, nesterov=nesterov, weight_decay=weight_decay != 0,
                 gated=found_inf is not None, scale_grads=grad_scale is not None or clip_coef is not None,
                 maximize=maximize)
    for first in (False, True) if with_momentum else (False,):
        chosen = [i for i in live if not with_momentum or bool(first_steps[i]) == first]
        for start in range(0, len(chosen), MAX_TENSORS):
            part = chosen[start:start + MAX_TENSORS]
            lists = (params, grads, momentum_buffers)
            flat = [[tensor_table.flat(lst[i]) for i in part] if lst else [] for lst in lists]
            sgd_step(*flat, hyper, first=first, **flags)  # flat views: the kernel writes through them
