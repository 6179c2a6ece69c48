"""Fused Adam / AdamW / AMSGrad over many tensors: one launch per (param dtype, state dtype).

Every hyperparameter that changes between steps (step count, lr as a tensor, grad_scale,
found_inf, clip coefficient) is read from device memory inside the kernel, so a step
never synchronises, never recompiles as training advances, and can be captured in a CUDA
graph. Arithmetic is float32 whatever the storage dtype; the result is rounded on the store.
The moments may be float32 under half-precision params (``state_dtype=torch.float32``): they
are then read and stored through float32 pointers, so only the param is rounded to 16 bits.
"""

from __future__ import annotations

import math
import operator
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import multi_tensor as mt
from .launch import Launch
from .multi_tensor import (PlanCache, address, block_offsets, by_dtype, dtype_of, load_f32, not_contiguous,
                           step_inputs, store_as, tables, this_chunk)

_plans = PlanCache()
# By (param, state) element sizes in bytes: blocks of 2048 give each thread 16-byte accesses; chunks, the sweep's best.
LAUNCH = {(4, 4): mt.Launch(2048, 2048, 8), (2, 2): mt.Launch(4096, 2048, 8),
          (2, 4): mt.Launch(8192, 2048, 8)}


@triton.jit
def _adam_block(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, offs, mask, store,
                lr, step_size, grad_factor, bias_correction2_sqrt, beta1, beta2, eps, weight_decay,
                FULL: tl.constexpr, STORE_MASKED: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
                WEIGHT_DECAY: tl.constexpr, DECOUPLED: tl.constexpr, SCALE_GRAD: tl.constexpr):
    g = load_f32(grad, offs, mask, FULL)
    if SCALE_GRAD:  # written back unscaled and clipped, as torch's fused kernels unscale their grads in place
        g = g * grad_factor
        store_as(grad, offs, g, store, STORE_MASKED)
    if MAXIMIZE:
        g = -g
    p = load_f32(param, offs, mask, FULL)
    if WEIGHT_DECAY:  # skipped when zero, as in torch: 0 * a NaN param would poison the grad
        if DECOUPLED:
            p = p * (1.0 - lr * weight_decay)
        else:
            g = g + weight_decay * p
    m = load_f32(exp_avg, offs, mask, FULL)
    # torch.lerp's two formulas, so that the moments round as torch's do
    w = 1.0 - beta1
    m = tl.where(w < 0.5, m + w * (g - m), g - (g - m) * (1.0 - w))
    v = load_f32(exp_avg_sq, offs, mask, FULL)
    v = v * beta2 + (1.0 - beta2) * g * g
    second = v
    if AMSGRAD:
        # keeping a NaN, as torch.maximum does (tl.maximum's default returns the other operand)
        second = tl.maximum(load_f32(max_exp_avg_sq, offs, mask, FULL), v, propagate_nan=tl.PropagateNan.ALL)
        store_as(max_exp_avg_sq, offs, second, store, STORE_MASKED)
    denom = tl.sqrt(second) / bias_correction2_sqrt + eps
    p = p - step_size * m / denom
    store_as(param, offs, p, store, STORE_MASKED)
    store_as(exp_avg, offs, m, store, STORE_MASKED)
    store_as(exp_avg_sq, offs, v, store, STORE_MASKED)


@triton.jit
def _adam_kernel(addresses, chunk_tensor, chunk_start, numels, step_addresses,
                 lr_ptr, grad_scale_ptr, found_inf_ptr, clip_coef_ptr, n_tensors, lr_value,
                 beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay,
                 DTYPE: tl.constexpr, STATE_DTYPE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                 AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr, WEIGHT_DECAY: tl.constexpr, DECOUPLED: tl.constexpr,
                 LR_IS_TENSOR: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
                 HAS_CLIP: tl.constexpr, ALIGNED: tl.constexpr):
    t, start, numel = this_chunk(chunk_tensor, chunk_start, numels)
    param = address(addresses, 0, n_tensors, t, DTYPE, ALIGNED)
    grad = address(addresses, 1, n_tensors, t, DTYPE, ALIGNED)
    exp_avg = address(addresses, 2, n_tensors, t, STATE_DTYPE, ALIGNED)
    exp_avg_sq = address(addresses, 3, n_tensors, t, STATE_DTYPE, ALIGNED)
    max_exp_avg_sq = exp_avg_sq
    if AMSGRAD:
        max_exp_avg_sq = address(addresses, 4, n_tensors, t, STATE_DTYPE, ALIGNED)

    step = tl.load(address(step_addresses, 0, 0, t, tl.float32, False))  # already incremented
    lr, grad_factor, keep = step_inputs(lr_ptr, lr_value, grad_scale_ptr, found_inf_ptr, clip_coef_ptr, BLOCK,
                                        LR_IS_TENSOR, HAS_GRAD_SCALE, HAS_FOUND_INF, HAS_CLIP)
    bias_correction1 = 1.0 - tl.exp2(step * log2_beta1)
    bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
    step_size = lr / bias_correction1

    for block in tl.range(0, CHUNK, BLOCK):
        offs = block_offsets(start, block, BLOCK, ALIGNED)
        mask = offs < numel
        if start + block + BLOCK <= numel:
            _adam_block(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, offs, mask, keep,
                        lr, step_size, grad_factor, bias_correction2_sqrt, beta1, beta2, eps, weight_decay,
                        True, HAS_FOUND_INF, AMSGRAD, MAXIMIZE, WEIGHT_DECAY, DECOUPLED, HAS_GRAD_SCALE or HAS_CLIP)
        else:
            _adam_block(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, offs, mask, mask & keep,
                        lr, step_size, grad_factor, bias_correction2_sqrt, beta1, beta2, eps, weight_decay,
                        False, True, AMSGRAD, MAXIMIZE, WEIGHT_DECAY, DECOUPLED, HAS_GRAD_SCALE or HAS_CLIP)


_TL_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _log2(beta: float) -> float:
    return math.log2(beta) if beta > 0 else -math.inf


_device_and_dtype = operator.attrgetter("device", "dtype")


def adam_supports(call) -> list[str]:
    lists = {k: call[k] for k in ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs")}
    reasons = not_contiguous(lists)
    steps = call["state_steps"]
    if call["params"] and set(map(_device_and_dtype, steps)) != {(call["params"][0].device, torch.float32)}:
        for i, s in enumerate(steps):  # name the first culprit (params share one device: functional checks)
            if s.device != call["params"][i].device:
                reasons.append(f"state_steps[{i}] is on {s.device}, not with its param on {call['params'][i].device}")
                break
            if s.dtype != torch.float32:
                reasons.append(f"state_steps[{i}] is {s.dtype}; the kernel reads float32 steps")
                break
    return reasons


class _Group(NamedTuple):
    """One (param dtype, state dtype) group of a plan: its launch shape, tables, step address table, tensor
    count, and its kernel's launches by the call's flags (:func:`_flags`), made at their first call."""

    dtypes: tuple[torch.dtype, torch.dtype]
    launch: mt.Launch
    tables: mt.Tables
    steps: torch.Tensor
    count: int
    launches: dict


def _flags(amsgrad, maximize, weight_decay, decoupled, lr_is_tensor, grad_scale, found_inf, clip_coef) -> tuple:
    return (amsgrad, maximize, weight_decay != 0, decoupled, lr_is_tensor, grad_scale is not None,
            found_inf is not None, clip_coef is not None)


def _launch_of(group: _Group, flags: tuple) -> Launch:
    """The group's launch for calls with these flags: its grid, constexprs and tensor count are fixed."""
    found = group.launches.get(flags)
    if found is None:
        amsgrad, maximize, weight_decay, decoupled, lr_is_tensor, grad_scale, found_inf, clip = flags
        dtype, state_dtype = group.dtypes
        found = group.launches[flags] = Launch(
            _adam_kernel, (group.tables.chunks,), 9, DTYPE=_TL_DTYPE[dtype], STATE_DTYPE=_TL_DTYPE[state_dtype],
            CHUNK=group.launch.chunk, BLOCK=group.launch.block, AMSGRAD=amsgrad, MAXIMIZE=maximize,
            WEIGHT_DECAY=weight_decay, DECOUPLED=decoupled, LR_IS_TENSOR=lr_is_tensor, HAS_GRAD_SCALE=grad_scale,
            HAS_FOUND_INF=found_inf, HAS_CLIP=clip, ALIGNED=group.tables.aligned, num_warps=group.launch.num_warps)
    return found


def _plan(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, amsgrad):
    """Per (param dtype, state dtype): a :class:`_Group`, built for tensors :data:`_plans` has no plan of yet.

    The public API gives a param's moments one dtype, so ``exp_avgs`` stands for all three. Their
    dtypes are in the plan's key: a float32 moment may be allocated where a bfloat16 one was freed.
    """
    plan = []
    for dtypes, idx in by_dtype(params, exp_avgs).items():
        lists = [[params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
                 [exp_avg_sqs[i] for i in idx]]
        if amsgrad:
            lists.append([max_exp_avg_sqs[i] for i in idx])
        launch = mt.launch_for(LAUNCH, tuple(d.itemsize for d in dtypes))
        t = tables(lists, launch.chunk)
        if t.chunks:
            plan.append(_Group(dtypes, launch, t, tables([[state_steps[i] for i in idx]], chunk=1).addresses,
                               len(idx), {}))
    return plan


def adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, amsgrad, beta1, beta2, lr,
         weight_decay, eps, maximize, decoupled_weight_decay, grad_scale=None, found_inf=None, clip_coef=None):
    if not params:
        return
    key = _plans.key(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                     extra=(amsgrad, tuple(map(dtype_of, exp_avgs))))
    plan = _plans.get(key)
    written = None  # what this call cached: only a first call with these tensors caches anything
    if plan is None:
        plan, written = mt.built(_plans, key, lambda: _plan(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                                                            state_steps, amsgrad))
    # a skipped step keeps its count: add 1 - (found_inf != 0)
    counted = 1.0 if found_inf is None else (found_inf == 0).to(torch.float32)
    torch._foreach_add_(state_steps, counted)
    launched = 0
    try:
        dummy = state_steps[0]
        lr_is_tensor = isinstance(lr, torch.Tensor)
        flags = _flags(amsgrad, maximize, weight_decay, decoupled_weight_decay, lr_is_tensor, grad_scale, found_inf,
                       clip_coef)
        for group in plan:
            t = group.tables
            _launch_of(group, flags)(
                t.addresses, t.chunk_tensor, t.chunk_start, t.numels, group.steps, lr if lr_is_tensor else dummy,
                grad_scale if grad_scale is not None else dummy, found_inf if found_inf is not None else dummy,
                clip_coef if clip_coef is not None else dummy, group.count, 0.0 if lr_is_tensor else float(lr),
                float(beta1), float(beta2), _log2(beta1), _log2(beta2), float(eps), float(weight_decay))
            launched += 1
    except BaseException:
        if not launched:  # nothing written yet: the counts go back too (a later launch's failure can't be undone)
            torch._foreach_add_(state_steps, -counted)
        if written is not None:
            mt.forget(written)
        raise
    # the kernel writes through raw pointers: tell autograd, as torch's in-place ops would
    scaled_grads = grads if grad_scale is not None or clip_coef is not None else []
    torch.autograd.graph.increment_version([*params, *scaled_grads, *exp_avgs, *exp_avg_sqs, *max_exp_avg_sqs])
