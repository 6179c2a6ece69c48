"""Linear cross-entropy's rows step: the chunks and their matmuls are torch's (cuBLAS on the GPU;
``portable_ops/lm_head.py``), and one kernel takes each row of a chunk's logits in place.

One program per row, the row read in blocks of ``BLOCK_V`` columns through its strides (the row's offset in 64
bits): a first pass keeps the capped logits' running max and sum of exponentials (and their sum, for label
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

MAX_BLOCK_V = 4096  # columns a program holds per step: wider vocabularies loop


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
def _rows_kernel(LOGITS, TARGET, SCALE, LOSS, stride_row, stride_col, stride_target, stride_scale, V, ignore_index,
                 smoothing, softcap, inv_softcap, SOFTCAP: tl.constexpr, SMOOTHING: tl.constexpr, GRAD: tl.constexpr,
                 DTYPE: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    logits = LOGITS + row * stride_row
    target = tl.load(TARGET + row * stride_target)
    cols = tl.arange(0, BLOCK_V)
    if target == ignore_index:
        tl.store(LOSS + row, 0.0)
        if GRAD:
            for start in range(0, V, BLOCK_V):
                tl.store(logits + (start + cols) * stride_col, tl.zeros([BLOCK_V], DTYPE), mask=start + cols < V)
        return
    top = float("-inf")
    total = 0.0
    capped_sum = 0.0
    for start in range(0, V, BLOCK_V):
        mask = start + cols < V
        x = tl.load(logits + (start + cols) * stride_col, mask=mask, other=0.0).to(tl.float32)
        z, _ = _capped(x, softcap, inv_softcap, SOFTCAP)
        z = tl.where(mask, z, float("-inf"))
        new_top = tl.maximum(top, tl.max(z, 0))
        total = total * tl.exp(top - new_top) + tl.sum(tl.exp(z - new_top), 0)
        top = new_top
        if SMOOTHING:
            capped_sum += tl.sum(tl.where(mask, z, 0.0), 0)
    lse = top + tl.log(total)
    picked, _ = _capped(tl.load(logits + target * stride_col).to(tl.float32), softcap, inv_softcap, SOFTCAP)
    loss = lse - picked
    if SMOOTHING:
        loss = (1.0 - smoothing) * loss + smoothing * (lse - capped_sum / V)
    tl.store(LOSS + row, loss)
    if GRAD:
        scale = tl.load(SCALE + row * stride_scale)
        for start in range(0, V, BLOCK_V):
            mask = start + cols < V
            x = tl.load(logits + (start + cols) * stride_col, mask=mask, other=0.0).to(tl.float32)
            z, slope = _capped(x, softcap, inv_softcap, SOFTCAP)
            grad = tl.exp(z - lse)
            if SMOOTHING:
                grad -= smoothing / V
            grad = tl.where(start + cols == target, grad - (1.0 - smoothing), grad)
            tl.store(logits + (start + cols) * stride_col, to_dtype(grad * slope * scale, DTYPE), mask=mask)


def _rows(logits, target, row_scale, ignore_index, label_smoothing, softcap, grad):
    c, v = logits.shape
    loss = torch.empty(c, dtype=torch.float32, device=logits.device)
    block = min(triton.next_power_of_2(v), MAX_BLOCK_V)
    in_compile_env(_rows_kernel[(c,)], logits, target, row_scale, loss, logits.stride(0), logits.stride(1),
                   target.stride(0), 0 if row_scale.dim() == 0 else row_scale.stride(0), v, ignore_index,
                   label_smoothing, softcap or 1.0, 1.0 / (softcap or 1.0), SOFTCAP=softcap is not None,
                   SMOOTHING=label_smoothing > 0, GRAD=grad, DTYPE=_TL_DTYPE[logits.dtype], BLOCK_V=block,
                   num_warps=8 if block >= 2048 else 4)
    return loss, logits if grad else None


linear_cross_entropy_fwd = partial(lm_head.forward, _rows)
linear_cross_entropy_bwd = partial(lm_head.backward, _rows)
