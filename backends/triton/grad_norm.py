"""Global gradient norm in two launches and no host synchronisation.

Phase 1 (one launch per dtype): each program reduces one chunk of one grad to a float32
partial: its sum of squares, or its largest magnitude for the inf-norm. Phase 2 (one
program): reduces the partials to the norm. The result stays on the device, ready to be
turned into a clip coefficient that the optimizer kernel reads.

A NaN anywhere makes the norm NaN, as torch's: a sum carries it, but Triton's ``tl.maximum`` and
``tl.max`` return the other operand (maxnum), so the inf-norm takes its maxima through
``_max_keeping_nan`` (``maximumf``: ``max.NaN`` on the GPU, ``np.maximum`` in the interpreter).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .adam import _TL_DTYPE
from . import multi_tensor as mt
from .launch import in_compile_env
from .multi_tensor import PlanCache, address, block_offsets, by_dtype, load_f32, not_contiguous, tables, this_chunk

FINAL_BLOCK = 1024
_plans = PlanCache()
# By the grads' element size in bytes: a read-only stream prefers longer chunks than the Adam step (the sweep's best).
LAUNCH = {4: mt.Launch(8192, 2048, 8), 2: mt.Launch(16384, 2048, 8)}


@triton.jit
def _max_keeping_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _partials_kernel(addresses, chunk_tensor, chunk_start, numels, partials, offset,
                     DTYPE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, INF: tl.constexpr,
                     ALIGNED: tl.constexpr):
    t, start, numel = this_chunk(chunk_tensor, chunk_start, numels)
    grad = address(addresses, 0, 0, t, DTYPE, ALIGNED)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for block in tl.range(0, CHUNK, BLOCK):
        offs = block_offsets(start, block, BLOCK, ALIGNED)
        if start + block + BLOCK <= numel:
            g = load_f32(grad, offs, None, True)
        else:
            g = load_f32(grad, offs, offs < numel, False)
        if INF:
            acc = _max_keeping_nan(acc, tl.abs(g))
        else:
            acc += g * g
    if INF:
        tl.store(partials + offset + tl.program_id(0), tl.reduce(acc, 0, _max_keeping_nan))
    else:
        tl.store(partials + offset + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit
def _final_kernel(partials, n, out, BLOCK: tl.constexpr, INF: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in tl.range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(partials + offs, mask=offs < n, other=0.0)
        if INF:
            acc = _max_keeping_nan(acc, x)
        else:
            acc += x
    if INF:
        tl.store(out, tl.reduce(acc, 0, _max_keeping_nan))
    else:
        tl.store(out, tl.sqrt(tl.sum(acc, axis=0)))


def grad_norm_supports(call) -> list[str]:
    reasons = []
    if len({g.device for g in call["grads"]}) > 1:
        reasons.append("grads on several devices: one launch reads one device")
    return reasons + not_contiguous({"grads": call["grads"]})


def _groups(grads) -> list:
    """Per dtype: (dtype, launch shape, tables), built for grads :data:`_plans` has no plan of yet."""
    groups = []
    for (dtype,), idx in by_dtype(grads).items():
        launch = mt.launch_for(LAUNCH, dtype.itemsize)
        groups.append((dtype, launch, tables([[grads[i] for i in idx]], launch.chunk)))
    return groups


def grad_norm(grads, norm_type):
    inf = math.isinf(norm_type)
    key = _plans.key(grads)
    groups = _plans.get(key)
    written = None  # what this call cached: only a first call with these grads caches anything
    if groups is None:
        groups, written = mt.built(_plans, key, lambda: _groups(grads))
    try:
        total = sum(t.chunks for _, _, t in groups)
        partials = torch.empty(max(total, 1), dtype=torch.float32, device=grads[0].device)
        offset = 0
        for dtype, launch, t in groups:
            if t.chunks:
                in_compile_env(_partials_kernel[(t.chunks,)], t.addresses, t.chunk_tensor, t.chunk_start, t.numels,
                               partials, offset, DTYPE=_TL_DTYPE[dtype], CHUNK=launch.chunk, BLOCK=launch.block,
                               INF=inf, ALIGNED=t.aligned, num_warps=launch.num_warps)
            offset += t.chunks
        out = torch.empty((), dtype=torch.float32, device=grads[0].device)
        in_compile_env(_final_kernel[(1,)], partials, total, out, BLOCK=FINAL_BLOCK, INF=inf, num_warps=4)
    except BaseException:
        if written is not None:
            mt.forget(written)
        raise
    return out
