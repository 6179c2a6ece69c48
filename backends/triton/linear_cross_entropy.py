"""Linear cross-entropy's rows step: the chunks and their matmuls are torch's (cuBLAS on the GPU;
``portable_ops/lm_head.py``), and one kernel takes the rows of a chunk's logits in place.

A program takes ``BLOCK_R`` rows, read through their strides in blocks of ``BLOCK_V`` columns (``BLOCK_R * BLOCK_V
= TILE``: one row a program from 4096 columns up, several for a narrower vocab; row offsets in 64 bits). A first
pass keeps each row's running max and sum of exponentials of the capped logits (and their sum, for label
smoothing), giving the row's logsumexp and its loss, stored in float32; with gradients, a second pass overwrites
each logit with ``(softmax - (1 - eps) * onehot - eps / V) * slope * scale``: the softcap's slope ``1 - tanh^2``,
the token's scale (its share of a mean, or its loss gradient). An ignored token's loss and row are zeros.
"""

from __future__ import annotations

from functools import partial

import torch
import triton
import triton.language as tl

from portable_ops import lm_head

from .adam import _TL_DTYPE
from .attention_tiles import tanh
from .interpreter import to_dtype
from .launch import in_compile_env

TILE = 4096  # logits a program holds per step: BLOCK_R rows of BLOCK_V columns


@triton.jit
def _capped(x, softcap, inv_softcap, SOFTCAP: tl.constexpr):
    """``(z, slope)``: the capped logits ``softcap * tanh(x / softcap)`` and dz/dx (x and 1 without a cap)."""
    # one return statement: a compiled function's returns must agree in type, constexpr branches included
    if SOFTCAP:
        t = tanh(x * inv_softcap)
        z = t * softcap
        slope = 1.0 - t * t
    else:
        z = x
        slope = 1.0
    return z, slope


@triton.jit
def _rows_kernel(LOGITS, TARGET, SCALE, LOSS, C, stride_row, stride_col, stride_target, stride_scale, V,
                 ignore_index, smoothing, softcap, inv_softcap, SOFTCAP: tl.constexpr, SMOOTHING: tl.constexpr,
                 GRAD: tl.constexpr, DTYPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_chunk = rows < C
    target = tl.load(TARGET + rows * stride_target, mask=in_chunk, other=ignore_index)
    valid = in_chunk & (target != ignore_index)
    logits = LOGITS + rows[:, None] * stride_row
    cols = tl.arange(0, BLOCK_V)[None, :]
    top = tl.full([BLOCK_R], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_R], tl.float32)
    capped_sum = tl.zeros([BLOCK_R], tl.float32)
    for start in range(0, V, BLOCK_V):
        mask = in_chunk[:, None] & (start + cols < V)
        x = tl.load(logits + (start + cols) * stride_col, mask=mask, other=0.0).to(tl.float32)
        z, _ = _capped(x, softcap, inv_softcap, SOFTCAP)
        z = tl.where(start + cols < V, z, float("-inf"))  # a row past the chunk's stays finite: no -inf - -inf
        new_top = tl.maximum(top, tl.max(z, 1))
        total = total * tl.exp(top - new_top) + tl.sum(tl.exp(z - new_top[:, None]), 1)
        top = new_top
        if SMOOTHING:
            capped_sum += tl.sum(tl.where(mask, z, 0.0), 1)
    lse = top + tl.log(total)
    at_target = tl.load(LOGITS + rows * stride_row + target * stride_col, mask=valid, other=0.0).to(tl.float32)
    picked, _ = _capped(at_target, softcap, inv_softcap, SOFTCAP)
    loss = lse - picked
    if SMOOTHING:
        loss = (1.0 - smoothing) * loss + smoothing * (lse - capped_sum / V)
    tl.store(LOSS + rows, tl.where(valid, loss, 0.0), mask=in_chunk)
    if GRAD:
        scale = tl.where(valid, tl.load(SCALE + rows * stride_scale, mask=in_chunk, other=0.0), 0.0)[:, None]
        for start in range(0, V, BLOCK_V):
            mask = in_chunk[:, None] & (start + cols < V)
            x = tl.load(logits + (start + cols) * stride_col, mask=mask, other=0.0).to(tl.float32)
            z, slope = _capped(x, softcap, inv_softcap, SOFTCAP)
            grad = tl.exp(z - lse[:, None])
            if SMOOTHING:
                grad -= smoothing / V
            grad = tl.where(start + cols == target[:, None], grad - (1.0 - smoothing), grad)
            tl.store(logits + (start + cols) * stride_col, to_dtype(grad * slope * scale, DTYPE), mask=mask)


def _rows(logits, target, row_scale, ignore_index, label_smoothing, softcap, grad):
    c, v = logits.shape
    loss = torch.empty(c, dtype=torch.float32, device=logits.device)
    block_v = min(triton.next_power_of_2(v), TILE)
    block_r = TILE // block_v
    in_compile_env(_rows_kernel[(triton.cdiv(c, block_r),)], logits, target, row_scale, loss, c, logits.stride(0),
                   logits.stride(1), target.stride(0), 0 if row_scale.dim() == 0 else row_scale.stride(0), v,
                   ignore_index, label_smoothing, softcap or 1.0, 1.0 / (softcap or 1.0), SOFTCAP=softcap is not None,
                   SMOOTHING=label_smoothing > 0, GRAD=grad, DTYPE=_TL_DTYPE[logits.dtype], BLOCK_R=block_r,
                   BLOCK_V=block_v, num_warps=8)
    return loss, logits if grad else None


linear_cross_entropy_fwd = partial(lm_head.forward, _rows)
linear_cross_entropy_bwd = partial(lm_head.backward, _rows)
