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
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .adam import _TL_DTYPE
from . import multi_tensor as mt
from .launch import Launch
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
def _final_kernel(partials, out, n, BLOCK: tl.constexpr, INF: tl.constexpr):
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


class _Plan(NamedTuple):
    """A plan for one list of grads: per dtype (launch shape, tables, its partials' offset), the partials'
    count, and the launches by norm (True: the inf-norm), made at their first call."""

    groups: list[tuple[torch.dtype, mt.Launch, mt.Tables, int]]
    total: int
    launches: dict


def _plan(grads) -> _Plan:
    """Built for grads :data:`_plans` has no plan of yet."""
    groups, offset = [], 0
    for (dtype,), idx in by_dtype(grads).items():
        launch = mt.launch_for(LAUNCH, dtype.itemsize)
        t = tables([[grads[i] for i in idx]], launch.chunk)
        groups.append((dtype, launch, t, offset))
        offset += t.chunks
    return _Plan(groups, offset, {})


def _launches_of(plan: _Plan, inf: bool) -> tuple[list, Launch]:
    """The plan's launches for this norm: phase 1's per dtype that has chunks, then phase 2's."""
    found = plan.launches.get(inf)
    if found is None:
        partials = [(Launch(_partials_kernel, (t.chunks,), 5, DTYPE=_TL_DTYPE[dtype], CHUNK=launch.chunk,
                            BLOCK=launch.block, INF=inf, ALIGNED=t.aligned, num_warps=launch.num_warps), t, offset)
                    for dtype, launch, t, offset in plan.groups if t.chunks]
        found = plan.launches[inf] = (partials, Launch(_final_kernel, (1,), 2, BLOCK=FINAL_BLOCK, INF=inf,
                                                       num_warps=4))
    return found


def grad_norm(grads, norm_type):
    inf = math.isinf(norm_type)
    key = _plans.key(grads)
    plan = _plans.get(key)
    written = None  # what this call cached: only a first call with these grads caches anything
    if plan is None:
        plan, written = mt.built(_plans, key, lambda: _plan(grads))
    try:
        partials = torch.empty(max(plan.total, 1), dtype=torch.float32, device=grads[0].device)
        phase1, phase2 = _launches_of(plan, inf)
        for launch, t, offset in phase1:
            launch(t.addresses, t.chunk_tensor, t.chunk_start, t.numels, partials, offset)
        out = torch.empty((), dtype=torch.float32, device=grads[0].device)
        phase2(partials, out, plan.total)
    except BaseException:
        if written is not None:
            mt.forget(written)
        raise
    return out
