"""Fused SGD (momentum, dampening, Nesterov, L2 weight decay, maximize) over many tensors: one launch per
(dtype, first step) group, through the multi-tensor machinery Adam uses (``multi_tensor.py``).

A momentum buffer has its param's dtype, as torch's. Every hyperparameter that changes between steps (lr as
a tensor, grad_scale, found_inf, the clip coefficient) is read from device memory inside the kernel, so a step
never synchronises and can be captured in a CUDA graph. Arithmetic is float32 whatever the storage dtype; each
result is rounded once, on the store. A new buffer (``first_steps``) is set to the grad instead of being
decayed: its launch is compiled with ``FIRST`` and never reads the buffer, so one whose params mix new and old
buffers (params that got their first grad later) is two launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import multi_tensor as mt
from .launch import in_compile_env
from .multi_tensor import PlanCache, address, block_offsets, load_f32, not_contiguous, step_inputs, store_as, this_chunk

_plans = PlanCache()
# By element size in bytes: Adam's launch shapes for the same sizes (not swept for SGD).
LAUNCH = {(4,): mt.Launch(2048, 2048, 8), (2,): mt.Launch(4096, 2048, 8)}
_TL_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _sgd_block(param, grad, buf, offs, mask, store, lr, grad_factor, momentum, dampening_keep, weight_decay,
               FULL: tl.constexpr, STORE_MASKED: tl.constexpr, MOMENTUM: tl.constexpr, FIRST: tl.constexpr,
               NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr, WEIGHT_DECAY: tl.constexpr,
               SCALE_GRAD: tl.constexpr):
    g = load_f32(grad, offs, mask, FULL)
    if SCALE_GRAD:  # written back unscaled and clipped, as torch's fused kernel unscales its grads in place
        g = g * grad_factor
        store_as(grad, offs, g, store, STORE_MASKED)
    if MAXIMIZE:
        g = -g
    p = load_f32(param, offs, mask, FULL)
    if WEIGHT_DECAY:  # skipped when zero, as in torch: 0 * a NaN param would poison the grad
        g = g + weight_decay * p
    if MOMENTUM:
        if FIRST:  # torch clones the grad into a new buffer
            b = g
        else:
            b = momentum * load_f32(buf, offs, mask, FULL) + dampening_keep * g
        store_as(buf, offs, b, store, STORE_MASKED)
        if NESTEROV:
            g = g + momentum * b
        else:
            g = b
    store_as(param, offs, p - lr * g, store, STORE_MASKED)


@triton.jit
def _sgd_kernel(addresses, chunk_tensor, chunk_start, numels, n_tensors, lr_ptr, lr_value, grad_scale_ptr,
                found_inf_ptr, clip_coef_ptr, momentum, dampening_keep, weight_decay,
                DTYPE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, MOMENTUM: tl.constexpr,
                FIRST: tl.constexpr, NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr, WEIGHT_DECAY: tl.constexpr,
                LR_IS_TENSOR: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
                HAS_CLIP: tl.constexpr, ALIGNED: tl.constexpr):
    t, start, numel = this_chunk(chunk_tensor, chunk_start, numels)
    param = address(addresses, 0, n_tensors, t, DTYPE, ALIGNED)
    grad = address(addresses, 1, n_tensors, t, DTYPE, ALIGNED)
    buf = param
    if MOMENTUM:
        buf = address(addresses, 2, n_tensors, t, DTYPE, ALIGNED)
    lr, grad_factor, keep = step_inputs(lr_ptr, lr_value, grad_scale_ptr, found_inf_ptr, clip_coef_ptr, BLOCK,
                                        LR_IS_TENSOR, HAS_GRAD_SCALE, HAS_FOUND_INF, HAS_CLIP)

    for block in tl.range(0, CHUNK, BLOCK):
        offs = block_offsets(start, block, BLOCK, ALIGNED)
        mask = offs < numel
        if start + block + BLOCK <= numel:
            _sgd_block(param, grad, buf, offs, mask, keep, lr, grad_factor, momentum, dampening_keep, weight_decay,
                       True, HAS_FOUND_INF, MOMENTUM, FIRST, NESTEROV, MAXIMIZE, WEIGHT_DECAY,
                       HAS_GRAD_SCALE or HAS_CLIP)
        else:
            _sgd_block(param, grad, buf, offs, mask, mask & keep, lr, grad_factor, momentum, dampening_keep,
                       weight_decay, False, True, MOMENTUM, FIRST, NESTEROV, MAXIMIZE, WEIGHT_DECAY,
                       HAS_GRAD_SCALE or HAS_CLIP)


def sgd_supports(call) -> list[str]:
    return not_contiguous({k: call[k] for k in ("params", "grads", "momentum_buffers")})


def _plan(params, grads, momentum_buffers, first_steps):
    """Per (dtype, first step): (dtype, first, launch shape, tables, tensor count), built for tensors
    :data:`_plans` has no plan of yet."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.dtype, bool(first_steps[i]) if first_steps else False), []).append(i)
    plan = []
    for (dtype, first), idx in groups.items():
        lists = [[params[i] for i in idx], [grads[i] for i in idx]]
        if momentum_buffers:
            lists.append([momentum_buffers[i] for i in idx])
        launch = mt.launch_for(LAUNCH, (dtype.itemsize,))
        t = mt.tables(lists, launch.chunk)
        if t.chunks:
            plan.append((dtype, first, launch, t, len(idx)))
    return plan


def sgd(params, grads, momentum_buffers, first_steps, *, lr, momentum, dampening, weight_decay, nesterov, maximize,
        grad_scale=None, found_inf=None, clip_coef=None):
    if not params:
        return
    key = _plans.key(params, grads, momentum_buffers, extra=(first_steps, bool(momentum_buffers)))
    plan = _plans.get(key)
    written = None  # what this call cached: only a first call with these tensors caches anything
    if plan is None:
        plan, written = mt.built(_plans, key, lambda: _plan(params, grads, momentum_buffers, first_steps))
    try:
        dummy = params[0]  # stands for the pointers a launch does not read
        lr_is_tensor = isinstance(lr, torch.Tensor)
        for dtype, first, launch, t, n in plan:
            in_compile_env(
                _sgd_kernel[(t.chunks,)], t.addresses, t.chunk_tensor, t.chunk_start, t.numels, n,
                lr if lr_is_tensor else dummy, 0.0 if lr_is_tensor else float(lr),
                grad_scale if grad_scale is not None else dummy, found_inf if found_inf is not None else dummy,
                clip_coef if clip_coef is not None else dummy, momentum, 1.0 - dampening, weight_decay,
                DTYPE=_TL_DTYPE[dtype], CHUNK=launch.chunk, BLOCK=launch.block, MOMENTUM=bool(momentum_buffers),
                FIRST=first, NESTEROV=nesterov, MAXIMIZE=maximize, WEIGHT_DECAY=weight_decay != 0,
                LR_IS_TENSOR=lr_is_tensor, HAS_GRAD_SCALE=grad_scale is not None,
                HAS_FOUND_INF=found_inf is not None, HAS_CLIP=clip_coef is not None, ALIGNED=t.aligned,
                num_warps=launch.num_warps)
    except BaseException:
        if written is not None:
            mt.forget(written)
        raise
    # the kernel writes through raw pointers: tell autograd, as torch's in-place ops would
    scaled_grads = grads if grad_scale is not None or clip_coef is not None else []
    torch.autograd.graph.increment_version([*params, *scaled_grads, *momentum_buffers])
