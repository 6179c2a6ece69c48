"""Flash attention (FlashAttention-2's algorithm): forward, backward, and a split-key decode.

Scores are kept in the log2 domain (``scale * log2(e)`` folded into one multiply) so the
online softmax uses ``exp2``. Causal masks are aligned to the bottom right: query ``i``
sees key ``j`` when ``j <= i + Skv - Sq``. Grouped-query attention indexes KV head
``h // group`` and never materialises repeated K/V; the dK/dV kernel walks the group's
query heads itself, so dK and dV are written once, without atomics.

Every loop over tiles is cut into a range whose tiles need no mask at all (fully visible,
fully in bounds) and the few tiles that do (the causal diagonal, ragged tails): masking
every tile costs the forward ~15%.

Any head dim up to 256: a row of Q, K, V, O is covered by two power-of-two column chunks,
``D0`` and ``D1`` (``head_split``; ``D1 = 0`` when one chunk does, and then the second chunk's
code is not compiled). Products over the head dim (Q K^T, dO V^T) are two dots summed into one
accumulator; products into it (P V, dS K, ...) keep one accumulator per chunk. Columns past the
head dim load as zeros and are never stored. docs/backends/triton.md has the argument.

Every tensor is addressed through its strides, outputs included (``layout.empty_like``), so
nothing is copied on the way in or out unless its last dim is strided.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from portable_ops import layout
from portable_ops.backends.pending import dense_feature_reasons, refuse_features

from . import attention_sm90
from .autotune import Tuner, bucket
from .interpreter import INTERPRETED, to_dtype
from .launch import Launch

LOG2E = tl.constexpr(1.4426950408889634)  # kernels may read only constexpr globals
LN2 = tl.constexpr(0.6931471805599453)
MAX_HEAD_DIM = 256


def head_split(d: int) -> tuple[int, int]:
    """The column chunks ``(D0, D1)`` that cover head dim ``d``: the largest power of two <= d (at
    least 16, tl.dot's smallest), then the smallest power of two >= 16 covering the rest; one chunk
    of the next power of two when the second would be as wide as the first. 80 -> (64, 16),
    96 -> (64, 32), 192 -> (128, 64), 40 -> (32, 16), 56 -> (64, 0), 128 -> (128, 0)."""
    d0 = max(16, 1 << (d.bit_length() - 1))
    rest = d - d0
    if rest <= 0:
        return d0, 0
    d1 = max(16, triton.next_power_of_2(rest))
    return (2 * d0, 0) if d1 >= d0 else (d0, d1)


# ----------------------------------------------------------------------------- tiles

@triton.jit
def _load(base, row_offs, row_ok, START: tl.constexpr, WIDTH: tl.constexpr, D: tl.constexpr,
          MASK_ROWS: tl.constexpr, TRANSPOSE: tl.constexpr, UPCAST: tl.constexpr):
    """Columns [START, START + WIDTH) of the rows at ``base + row_offs``, as a [rows, WIDTH] tile
    ([WIDTH, rows] when TRANSPOSE); zeros for columns past D and, under MASK_ROWS, rows not ``row_ok``."""
    cols = START + tl.arange(0, WIDTH)
    if TRANSPOSE:
        ptrs = base + row_offs[None, :] + cols[:, None]
        rows_in, cols_in = row_ok[None, :], cols[:, None] < D
    else:
        ptrs = base + row_offs[:, None] + cols[None, :]
        rows_in, cols_in = row_ok[:, None], cols[None, :] < D
    if START + WIDTH > D:
        if MASK_ROWS:
            x = tl.load(ptrs, mask=rows_in & cols_in, other=0.0)
        else:
            x = tl.load(ptrs, mask=cols_in, other=0.0)
    elif MASK_ROWS:
        x = tl.load(ptrs, mask=rows_in, other=0.0)
    else:
        x = tl.load(ptrs)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _load2(base, row_offs, row_ok, D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
           MASK_ROWS: tl.constexpr, TRANSPOSE: tl.constexpr, UPCAST: tl.constexpr):
    """Both column chunks of a tile; the second is the first again (unused) when D1 == 0."""
    first = _load(base, row_offs, row_ok, 0, D0, D, MASK_ROWS, TRANSPOSE, UPCAST)
    second = first
    if D1 > 0:
        second = _load(base, row_offs, row_ok, D0, D1, D, MASK_ROWS, TRANSPOSE, UPCAST)
    return first, second


@triton.jit
def _dot2(a0, a1, b0, b1, acc, D1: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + a @ b`` where the inner dim is the head dim, split in two chunks."""
    acc = tl.dot(a0, b0, acc, input_precision=PRECISION)
    if D1 > 0:
        acc = tl.dot(a1, b1, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _store(base, row_offs, row_ok, value, START: tl.constexpr, D: tl.constexpr):
    cols = START + tl.arange(0, value.shape[1])
    mask = row_ok[:, None]
    if START + value.shape[1] > D:
        mask = mask & (cols[None, :] < D)
    tl.store(base + row_offs[:, None] + cols[None, :], to_dtype(value, base.dtype.element_ty), mask=mask)


@triton.jit
def _store2(base, row_offs, row_ok, first, second, D: tl.constexpr, D1: tl.constexpr):
    _store(base, row_offs, row_ok, first, 0, D)
    if D1 > 0:
        _store(base, row_offs, row_ok, second, first.shape[1], D)


# ----------------------------------------------------------------------------- forward

@triton.jit
def _fwd_tiles(acc0, acc1, l_i, m_i, q0, q1, k_base, v_base, sk_n, sv_n, pos, offs_n, lo, hi, SKV, diagonal,
               scale_log2, D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, MASK: tl.constexpr,
               CAUSAL: tl.constexpr, UPCAST: tl.constexpr, NEGATIVE_SCALE: tl.constexpr, PRECISION: tl.constexpr):
    for start_n in tl.range(lo, hi, offs_n.shape[0]):
        cols = start_n + offs_n
        in_bounds = cols < SKV
        k0, k1 = _load2(k_base, cols * sk_n, in_bounds, D, D0, D1, MASK, True, UPCAST)
        s = _dot2(q0, q1, k0, k1, tl.zeros([q0.shape[0], offs_n.shape[0]], dtype=tl.float32), D1, PRECISION)
        if MASK:
            visible = in_bounds[None, :]
            if CAUSAL:
                visible = visible & (cols[None, :] <= pos[:, None] + diagonal)
            # scaled before masking: -inf times a zero scale would be NaN
            s = tl.where(visible, s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_exp = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
            p = tl.exp2(s - m_exp[:, None])
        else:
            # the row maximum of the scaled scores, from the unscaled ones: the FMA below stays one instruction
            if NEGATIVE_SCALE:
                m_new = tl.maximum(m_i, tl.min(s, axis=1) * scale_log2)
            else:
                m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
            m_exp = m_new
            p = tl.exp2(s * scale_log2 - m_exp[:, None])
        alpha = tl.exp2(m_i - m_exp)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v0, v1 = _load2(v_base, cols * sv_n, in_bounds, D, D0, D1, MASK, False, UPCAST)
        acc0 = tl.dot(p.to(v0.dtype), v0, acc0 * alpha[:, None], input_precision=PRECISION)
        if D1 > 0:
            acc1 = tl.dot(p.to(v1.dtype), v1, acc1 * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc0, acc1, l_i, m_i


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_split, so_b, so_h, so_m,
                H, GROUP, SQ, SKV, scale_log2, KEYS_PER_SPLIT,
                CAUSAL: tl.constexpr, D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PACK_GROUP: tl.constexpr, NEGATIVE_SCALE: tl.constexpr,
                UNIT: tl.constexpr, PRECISION: tl.constexpr):
    # Strides arrive divided by UNIT (see _stride_unit): multiplied back, the compiler knows rows start aligned.
    sq_b, sq_h, sq_m, sk_b, sk_h, sk_n = sq_b * UNIT, sq_h * UNIT, sq_m * UNIT, sk_b * UNIT, sk_h * UNIT, sk_n * UNIT
    sv_b, sv_h, sv_n = sv_b * UNIT, sv_h * UNIT, sv_n * UNIT
    so_split, so_b, so_h, so_m = so_split * UNIT, so_b * UNIT, so_h * UNIT, so_m * UNIT
    start_m = tl.program_id(0)
    if CAUSAL:  # the last query blocks see the most keys: start them first, so the tail of the grid is light
        start_m = tl.num_programs(0) - 1 - start_m
    split = tl.program_id(2)  # which range of keys, when decode splits them across programs
    r = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if PACK_GROUP:
        # Decode under GQA: one program takes every query head of a KV head's group as its rows
        # (head-major, then position), so each K/V tile is read once for the whole group.
        b, hk = tl.program_id(1) // (H // GROUP), tl.program_id(1) % (H // GROUP)
        h = hk * GROUP + r // SQ
        pos = r % SQ
        valid = r < GROUP * SQ
        pos_lo, pos_hi = 0, SQ - 1
        n_bh = tl.num_programs(1) * GROUP
    else:
        b, h = tl.program_id(1) // H, tl.program_id(1) % H
        hk = h // GROUP
        pos = r
        valid = r < SQ
        pos_lo, pos_hi = start_m * BLOCK_M, start_m * BLOCK_M + BLOCK_M - 1
        n_bh = tl.num_programs(1)
    offs_n = tl.arange(0, BLOCK_N)
    q0, q1 = _load2(Q + b.to(tl.int64) * sq_b, h * sq_h + pos * sq_m, valid, D, D0, D1, True, False, UPCAST)
    k_base = K + b.to(tl.int64) * sk_b + hk * sk_h
    v_base = V + b.to(tl.int64) * sv_b + hk * sv_h

    # m_i is already in the log2 domain (scaled); -inf until the row sees a key
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_M, D0], dtype=tl.float32)
    acc1 = acc0  # stands in for the second chunk's accumulator when there is none
    if D1 > 0:
        acc1 = tl.zeros([BLOCK_M, D1], dtype=tl.float32)
    diagonal = SKV - SQ
    lo = split * KEYS_PER_SPLIT
    hi = tl.minimum(SKV, lo + KEYS_PER_SPLIT)
    # keys [lo, full) are visible to every row of the block and in bounds: no mask needed
    full = SKV // BLOCK_N * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(hi, pos_hi + 1 + diagonal)
        full = tl.minimum(full, tl.maximum(pos_lo + diagonal + 1, 0) // BLOCK_N * BLOCK_N)
    full = tl.maximum(tl.minimum(full, hi), lo)
    acc0, acc1, l_i, m_i = _fwd_tiles(acc0, acc1, l_i, m_i, q0, q1, k_base, v_base, sk_n, sv_n, pos, offs_n, lo,
                                      full, SKV, diagonal, scale_log2, D, D0, D1, False, CAUSAL, UPCAST,
                                      NEGATIVE_SCALE, PRECISION)
    acc0, acc1, l_i, m_i = _fwd_tiles(acc0, acc1, l_i, m_i, q0, q1, k_base, v_base, sk_n, sv_n, pos, offs_n, full,
                                      hi, SKV, diagonal, scale_log2, D, D0, D1, True, CAUSAL, UPCAST,
                                      NEGATIVE_SCALE, PRECISION)
    seen = l_i > 0
    norm = 1.0 / tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    o_base = O + split.to(tl.int64) * so_split + b.to(tl.int64) * so_b
    _store2(o_base, h * so_h + pos * so_m, valid, acc0 * norm[:, None], acc1 * norm[:, None], D, D1)
    tl.store(LSE + (split * n_bh + b * H + h).to(tl.int64) * SQ + pos, lse, mask=valid)  # [splits, B, H, SQ]


@triton.jit
def _combine_kernel(O_PART, LSE_PART, O, LSE, SPLITS, H, SQ, so_b, so_h, so_m,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Merge split-key partial results of one query row: weights exp(lse_i - lse_total).
    Partials are [splits, B * H * SQ, D] float32; the output is written through its strides."""
    row = tl.program_id(0).to(tl.int64)
    rows = tl.num_programs(0)
    splits = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    lse = tl.load(LSE_PART + splits * rows + row, mask=splits < SPLITS, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)
    total = tl.sum(w, axis=0)
    parts = tl.load(O_PART + (splits[:, None] * rows + row) * D + offs_d[None, :],
                    mask=(splits[:, None] < SPLITS) & (offs_d[None, :] < D), other=0.0)
    out = tl.sum(parts * (w / tl.where(total > 0, total, 1.0))[:, None], axis=0)
    b, h, pos = row // (H * SQ), row // SQ % H, row % SQ
    tl.store(O + b * so_b + h * so_h + pos * so_m + offs_d, to_dtype(out, O.dtype.element_ty), mask=offs_d < D)
    tl.store(LSE + row, tl.where(total > 0, m_safe + tl.log(total), float("-inf")))


# ----------------------------------------------------------------------------- backward

@triton.jit
def _delta_kernel(O, DO, DELTA, so_b, so_h, so_m, sdo_b, sdo_h, sdo_m, H, SQ,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr):
    """rowsum(dO * O): the softmax-gradient correction, one float32 per query row."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < SQ) & (cols[None, :] < D)
    o = tl.load(O + b.to(tl.int64) * so_b + h * so_h + rows[:, None] * so_m + cols[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b.to(tl.int64) * sdo_b + h * sdo_h + rows[:, None] * sdo_m + cols[None, :], mask=mask,
                 other=0.0)
    tl.store(DELTA + bh.to(tl.int64) * SQ + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1),
             mask=rows < SQ)


@triton.jit
def _dkdv_tiles(dk0, dk1, dv0, dv1, k0, k1, v0, v1, q_base, do_base, lse_base, delta_base, sq_m, sdo_m, cols,
                offs_m, lo, hi, SQ, SKV, scale_log2, D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
                MASK: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # Works on transposed tiles (keys x queries) so P^T and dS^T come out of tl.dot in the
    # layout the dV and dK products want, with no register transposes.
    for start_m in tl.range(lo, hi, offs_m.shape[0]):
        rows = start_m + offs_m
        in_bounds = rows < SQ
        q0_t, q1_t = _load2(q_base, rows * sq_m, in_bounds, D, D0, D1, MASK, True, UPCAST)
        do0, do1 = _load2(do_base, rows * sdo_m, in_bounds, D, D0, D1, MASK, False, UPCAST)
        # rows past SQ and rows that see no key read lse = -inf: their P is 0
        lse = tl.load(lse_base + rows, mask=in_bounds, other=float("-inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
        delta = tl.load(delta_base + rows, mask=in_bounds, other=0.0)
        zeros = tl.zeros([cols.shape[0], offs_m.shape[0]], dtype=tl.float32)
        p_t = tl.exp2(_dot2(k0, k1, q0_t, q1_t, zeros, D1, PRECISION) * scale_log2 - lse[None, :])
        if MASK:
            visible = cols[:, None] < SKV
            if CAUSAL:
                visible = visible & (cols[:, None] <= rows[None, :] + (SKV - SQ))
            p_t = tl.where(visible, p_t, 0.0)
        dv0 = tl.dot(p_t.to(do0.dtype), do0, dv0, input_precision=PRECISION)
        if D1 > 0:
            dv1 = tl.dot(p_t.to(do1.dtype), do1, dv1, input_precision=PRECISION)
        dp_t = _dot2(v0, v1, tl.trans(do0), tl.trans(do1), zeros, D1, PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk0 = tl.dot(ds_t.to(q0_t.dtype), tl.trans(q0_t), dk0, input_precision=PRECISION)
        if D1 > 0:
            dk1 = tl.dot(ds_t.to(q1_t.dtype), tl.trans(q1_t), dk1, input_precision=PRECISION)
    return dk0, dk1, dv0, dv1


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                     sdo_b, sdo_h, sdo_m, sdk_b, sdk_h, sdk_n, sdv_b, sdv_h, sdv_n,
                     HKV, GROUP, SQ, SKV, scale, scale_log2,
                     CAUSAL: tl.constexpr, D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, UNIT: tl.constexpr,
                     PRECISION: tl.constexpr):
    # Strides arrive divided by UNIT (see _stride_unit): multiplied back, the compiler knows rows start aligned.
    sq_b, sq_h, sq_m, sk_b, sk_h, sk_n = sq_b * UNIT, sq_h * UNIT, sq_m * UNIT, sk_b * UNIT, sk_h * UNIT, sk_n * UNIT
    sv_b, sv_h, sv_n = sv_b * UNIT, sv_h * UNIT, sv_n * UNIT
    sdo_b, sdo_h, sdo_m = sdo_b * UNIT, sdo_h * UNIT, sdo_m * UNIT
    sdk_b, sdk_h, sdk_n = sdk_b * UNIT, sdk_h * UNIT, sdk_n * UNIT
    sdv_b, sdv_h, sdv_n = sdv_b * UNIT, sdv_h * UNIT, sdv_n * UNIT
    start_n = tl.program_id(0)
    bh = tl.program_id(1)
    b, hk = bh // HKV, bh % HKV
    n0 = start_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    in_bounds = cols < SKV
    offs_m = tl.arange(0, BLOCK_M)
    k0, k1 = _load2(K + b.to(tl.int64) * sk_b + hk * sk_h, cols * sk_n, in_bounds, D, D0, D1, True, False, UPCAST)
    v0, v1 = _load2(V + b.to(tl.int64) * sv_b + hk * sv_h, cols * sv_n, in_bounds, D, D0, D1, True, False, UPCAST)
    dk0 = tl.zeros([BLOCK_N, D0], dtype=tl.float32)
    dk1, dv1 = dk0, dk0  # stand in for the second chunk's accumulators when there is none
    if D1 > 0:
        dk1 = tl.zeros([BLOCK_N, D1], dtype=tl.float32)
        dv1 = tl.zeros([BLOCK_N, D1], dtype=tl.float32)
    dv0 = tl.zeros([BLOCK_N, D0], dtype=tl.float32)
    diagonal = SKV - SQ
    lo = 0
    full = 0  # query blocks [full, even) see every key of this block and are in bounds
    even = SQ // BLOCK_M * BLOCK_M
    if CAUSAL:  # queries before this one cannot see the block's first key
        lo = tl.maximum(0, n0 - diagonal) // BLOCK_M * BLOCK_M
        full = tl.cdiv(tl.maximum(0, n0 + BLOCK_N - 1 - diagonal), BLOCK_M) * BLOCK_M
    if n0 + BLOCK_N > SKV:  # a ragged key block masks everywhere
        even = lo
    full = tl.maximum(lo, tl.minimum(full, even))
    even = tl.maximum(full, even)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_base = Q + b.to(tl.int64) * sq_b + h * sq_h
        do_base = DO + b.to(tl.int64) * sdo_b + h * sdo_h
        row0 = (b * HKV * GROUP + h).to(tl.int64) * SQ  # lse and delta are [B, H, SQ]
        dk0, dk1, dv0, dv1 = _dkdv_tiles(dk0, dk1, dv0, dv1, k0, k1, v0, v1, q_base, do_base, LSE + row0,
                                         DELTA + row0, sq_m, sdo_m, cols, offs_m, lo, full, SQ, SKV, scale_log2,
                                         D, D0, D1, True, CAUSAL, UPCAST, PRECISION)
        dk0, dk1, dv0, dv1 = _dkdv_tiles(dk0, dk1, dv0, dv1, k0, k1, v0, v1, q_base, do_base, LSE + row0,
                                         DELTA + row0, sq_m, sdo_m, cols, offs_m, full, even, SQ, SKV, scale_log2,
                                         D, D0, D1, False, CAUSAL, UPCAST, PRECISION)
        dk0, dk1, dv0, dv1 = _dkdv_tiles(dk0, dk1, dv0, dv1, k0, k1, v0, v1, q_base, do_base, LSE + row0,
                                         DELTA + row0, sq_m, sdo_m, cols, offs_m, even, SQ, SQ, SKV, scale_log2,
                                         D, D0, D1, True, CAUSAL, UPCAST, PRECISION)
    _store2(DK + b.to(tl.int64) * sdk_b + hk * sdk_h, cols * sdk_n, in_bounds, dk0 * scale, dk1 * scale, D, D1)
    _store2(DV + b.to(tl.int64) * sdv_b + hk * sdv_h, cols * sdv_n, in_bounds, dv0, dv1, D, D1)


@triton.jit
def _dq_tiles(dq0, dq1, q0, q1, do0, do1, lse, delta, k_base, v_base, sk_n, sv_n, rows, offs_n, lo, hi, SQ, SKV,
              scale_log2, D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, MASK: tl.constexpr,
              CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    for start_n in tl.range(lo, hi, offs_n.shape[0]):
        cols = start_n + offs_n
        in_bounds = cols < SKV
        k0_t, k1_t = _load2(k_base, cols * sk_n, in_bounds, D, D0, D1, MASK, True, UPCAST)
        v0_t, v1_t = _load2(v_base, cols * sv_n, in_bounds, D, D0, D1, MASK, True, UPCAST)
        zeros = tl.zeros([rows.shape[0], offs_n.shape[0]], dtype=tl.float32)
        p = tl.exp2(_dot2(q0, q1, k0_t, k1_t, zeros, D1, PRECISION) * scale_log2 - lse[:, None])
        if MASK:
            visible = in_bounds[None, :]
            if CAUSAL:
                visible = visible & (cols[None, :] <= rows[:, None] + (SKV - SQ))
            p = tl.where(visible, p, 0.0)
        dp = _dot2(do0, do1, v0_t, v1_t, zeros, D1, PRECISION)
        ds = p * (dp - delta[:, None])
        dq0 = tl.dot(ds.to(k0_t.dtype), tl.trans(k0_t), dq0, input_precision=PRECISION)
        if D1 > 0:
            dq1 = tl.dot(ds.to(k1_t.dtype), tl.trans(k1_t), dq1, input_precision=PRECISION)
    return dq0, dq1


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                   sdo_b, sdo_h, sdo_m, sdq_b, sdq_h, sdq_m, H, GROUP, SQ, SKV, scale, scale_log2,
                   CAUSAL: tl.constexpr, D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, UNIT: tl.constexpr,
                   PRECISION: tl.constexpr):
    # Strides arrive divided by UNIT (see _stride_unit): multiplied back, the compiler knows rows start aligned.
    sq_b, sq_h, sq_m, sk_b, sk_h, sk_n = sq_b * UNIT, sq_h * UNIT, sq_m * UNIT, sk_b * UNIT, sk_h * UNIT, sk_n * UNIT
    sv_b, sv_h, sv_n = sv_b * UNIT, sv_h * UNIT, sv_n * UNIT
    sdo_b, sdo_h, sdo_m = sdo_b * UNIT, sdo_h * UNIT, sdo_m * UNIT
    sdq_b, sdq_h, sdq_m = sdq_b * UNIT, sdq_h * UNIT, sdq_m * UNIT
    start_m = tl.program_id(0)
    if CAUSAL:  # heaviest query blocks first, as in the forward
        start_m = tl.num_programs(0) - 1 - start_m
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    in_bounds = rows < SQ
    offs_n = tl.arange(0, BLOCK_N)
    q0, q1 = _load2(Q + b.to(tl.int64) * sq_b + h * sq_h, rows * sq_m, in_bounds, D, D0, D1, True, False, UPCAST)
    do0, do1 = _load2(DO + b.to(tl.int64) * sdo_b + h * sdo_h, rows * sdo_m, in_bounds, D, D0, D1, True, False,
                      UPCAST)
    lse = tl.load(LSE + bh.to(tl.int64) * SQ + rows, mask=in_bounds, other=float("-inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)  # P = 0 on rows that see no key
    delta = tl.load(DELTA + bh.to(tl.int64) * SQ + rows, mask=in_bounds, other=0.0)
    k_base = K + b.to(tl.int64) * sk_b + (h // GROUP) * sk_h
    v_base = V + b.to(tl.int64) * sv_b + (h // GROUP) * sv_h
    dq0 = tl.zeros([BLOCK_M, D0], dtype=tl.float32)
    dq1 = dq0  # stands in for the second chunk's accumulator when there is none
    if D1 > 0:
        dq1 = tl.zeros([BLOCK_M, D1], dtype=tl.float32)
    hi = SKV
    full = SKV // BLOCK_N * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(SKV, (start_m + 1) * BLOCK_M + SKV - SQ)
        full = tl.minimum(full, tl.maximum(start_m * BLOCK_M + SKV - SQ + 1, 0) // BLOCK_N * BLOCK_N)
    full = tl.maximum(tl.minimum(full, hi), 0)
    dq0, dq1 = _dq_tiles(dq0, dq1, q0, q1, do0, do1, lse, delta, k_base, v_base, sk_n, sv_n, rows, offs_n, 0, full,
                         SQ, SKV, scale_log2, D, D0, D1, False, CAUSAL, UPCAST, PRECISION)
    dq0, dq1 = _dq_tiles(dq0, dq1, q0, q1, do0, do1, lse, delta, k_base, v_base, sk_n, sv_n, rows, offs_n, full, hi,
                         SQ, SKV, scale_log2, D, D0, D1, True, CAUSAL, UPCAST, PRECISION)
    _store2(DQ + b.to(tl.int64) * sdq_b + h * sdq_h, rows * sdq_m, in_bounds, dq0 * scale, dq1 * scale, D, D1)


# ----------------------------------------------------------------------------- tile choices

# (BLOCK_M, BLOCK_N, num_warps, num_stages) candidates per kernel and tile width (D0 + D1 of
# head_split: the columns a tile really holds), timed per shape bucket on first use (autotune.py).
# Powers of two: the first of each list is the best at D=128 / D=64, S=4096 in the H100 sweep
# (docs/performance.md); the others are the sweep's runners-up that give more programs on short
# sequences or fewer registers. Split widths (48, 80, 96, 144, 160, 192): chosen from the
# registers, spills and shared memory of their sm_90 compilation (docs/backends/triton.md).
# Mutable, for the sweep (portable_ops.bench.sweep).
CONFIGS = {
    "fwd": {16: [(128, 64, 4, 3), (64, 64, 4, 3)],
            32: [(128, 64, 4, 3), (64, 64, 4, 3)],
            48: [(128, 64, 8, 3), (64, 64, 4, 3)],
            64: [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 4)],
            80: [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 3)],
            96: [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 3)],
            128: [(128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3)],
            144: [(128, 64, 8, 3), (64, 64, 4, 3)],
            160: [(128, 64, 8, 3), (64, 64, 4, 3)],
            192: [(128, 64, 8, 2), (64, 64, 4, 2), (64, 64, 8, 2)],
            256: [(64, 64, 8, 2), (64, 32, 4, 2)]},
    "dkdv": {16: [(32, 128, 4, 3), (32, 64, 4, 3)],
             32: [(32, 128, 4, 3), (32, 64, 4, 3)],
             48: [(32, 128, 4, 3), (32, 64, 4, 3)],
             64: [(32, 128, 4, 3), (64, 128, 8, 3), (32, 64, 4, 3)],
             80: [(64, 128, 8, 3), (32, 64, 4, 3)],
             96: [(64, 128, 8, 3), (32, 64, 4, 3)],
             128: [(64, 128, 8, 3), (32, 64, 4, 3), (64, 128, 8, 2)],
             144: [(32, 64, 4, 2), (64, 64, 8, 2)],
             160: [(32, 64, 4, 2), (64, 64, 8, 2)],
             192: [(32, 64, 4, 2), (32, 32, 4, 2)],
             256: [(32, 32, 4, 2)]},
    "dq": {16: [(128, 64, 8, 3), (64, 64, 4, 3)],
           32: [(128, 64, 8, 3), (64, 64, 4, 3)],
           48: [(128, 64, 8, 3), (64, 64, 4, 3)],
           64: [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3)],
           80: [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3)],
           96: [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3)],
           128: [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3)],
           144: [(64, 64, 8, 2), (64, 32, 4, 2)],
           160: [(64, 64, 8, 2), (64, 32, 4, 2)],
           192: [(64, 64, 8, 2), (64, 32, 4, 2)],
           256: [(64, 32, 8, 2), (32, 32, 4, 2)]},
}
_INTERPRETER_CONFIG = (32, 32, 4, 1)  # one small tile: every tile costs real time there
_DECODE_CONFIG = {False: (16, 64, 4, 3), True: (16, 32, 4, 3)}  # by width > 128: a tall query tile would be padding
_KERNELS = (_load, _load2, _dot2, _store, _store2, _fwd_tiles, _fwd_kernel, _combine_kernel, _delta_kernel,
            _dkdv_tiles, _bwd_dkdv_kernel, _dq_tiles, _bwd_dq_kernel, to_dtype)
_tuner = Tuner(name="attention", sources=_KERNELS)


def _config(kernel: str, q, k, causal, precision, launch) -> tuple:
    if INTERPRETED:
        return _INTERPRETER_CONFIG
    b, h, sq, d = q.shape
    width = sum(head_split(d))
    if kernel == "fwd" and sq <= 16:
        return _DECODE_CONFIG[width > 128]
    key = (kernel, d, q.dtype, precision, causal, bucket(sq), bucket(k.shape[2]), bucket(b * h),
           h // max(k.shape[1], 1))
    return _tuner.pick(key, CONFIGS[kernel][width], launch)


def _upcast(dtype) -> bool:
    # The interpreter computes bf16 dot products wrongly (seen with triton 3.9): upcast there.
    return INTERPRETED and dtype == torch.bfloat16


def _dot_precision(dtype) -> str:
    """How tl.dot multiplies float32 tiles: as torch's own float32 matmuls on CUDA do, so a float32
    model means the same thing on every backend. TF32 only where the user allowed it
    (``torch.set_float32_matmul_precision("high")`` or ``torch.backends.cuda.matmul.fp32_precision``);
    torch's default, "highest", is IEEE float32. The kernels pass it to every ``tl.dot`` as
    ``input_precision`` (Triton 3.6 decides a dot's default in ``tl.dot`` itself, from
    ``TRITON_F32_DEFAULT``, before its ``default_dot_input_precision`` option is read: the H100
    showed that option ignored). Half-precision tiles are exact products either way and pass
    "ieee", which every target accepts (AMD's only take "ieee" and the bf16x3/x6 emulations)."""
    if dtype != torch.float32 or torch.version.hip is not None:
        return "ieee"
    for read in (lambda: torch.backends.cuda.matmul.fp32_precision == "tf32",
                 lambda: torch.backends.cuda.matmul.allow_tf32):
        try:  # torch raises when the legacy and the new TF32 switches were both set: try the other one
            return "tf32" if read() else "ieee"
        except (AttributeError, RuntimeError):
            continue
    return "ieee"


KERNELS = "triton kernels"


def attention_supports(call) -> list[str]:
    q = call["q"]
    reasons = dense_feature_reasons(call, KERNELS)
    if q.shape[1] > MAX_GRID_Y:
        reasons.append(f"{q.shape[1]} heads: a launch takes at most {MAX_GRID_Y} (CUDA's limit on a grid's second "
                       f"dimension, which holds batch x heads)")
    if q.shape[-1] > MAX_HEAD_DIM:
        reasons.append(f"head_dim {q.shape[-1]} is over {MAX_HEAD_DIM} (a tile row must fit the registers)")
    if q.dtype == torch.float64:
        reasons.append("float64 is not supported (fp16, bf16 and fp32 are)")
    return reasons


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


MAX_SPLITS = 64


def _splits(b, h, sq, skv, block_m, block_n, device=None) -> int:
    """How many key ranges to split a forward into: decode (one query block) over a long cache
    leaves most of the GPU idle unless the keys are shared out too. Chosen from H100 sweeps of
    one-token decode under graph replay (docs/performance.md, "Decode"): a few programs get ranges
    down to two key blocks; a batch that fills the GPU splits only long caches, in two, so that its
    last wave of programs is short."""
    if sq > block_m or b * h == 0:  # prefill, or no programs at all
        return 1
    programs = b * h
    # the interpreter, as if on four SMs: small test shapes still take the split path
    sms = 4 if INTERPRETED else _multiprocessors(device.index if device is not None and device.index is not None
                                                 else torch.cuda.current_device())
    if programs >= sms:
        want, min_blocks = (2 if skv >= 16384 and programs < 4 * sms else 1), 8
    else:
        want, min_blocks = triton.cdiv(2 * sms, programs), (2 if 4 * programs <= sms else 8)
    # at most MAX_SPLITS: the merge holds a [splits, D] float32 tile per row in registers
    return max(1, min(skv // (min_blocks * block_n), want, MAX_SPLITS))


# ----------------------------------------------------------------------------- host path
#
# Everything a launch needs that depends only on the layout of the call (shapes, strides, dtypes,
# device, causal) is built once into a plan, kept by that layout; a call then costs one key, one
# dict lookup, its allocations and its launches.

_PLANS_SIZE = 4096  # a decode loop meets a new cache length every token: bounded, cleared when full
# CUDA's limit on a grid's second dimension, where every kernel here puts (batch, head): a call with
# more batch x heads than that runs as slices of its batch (_by_batch_slices).
MAX_GRID_Y = 65535
_fwd_plans: dict = {}
_bwd_plans: dict = {}


def _remember(plans: dict, key, plan):
    if len(plans) >= _PLANS_SIZE:
        plans.clear()
    plans[key] = plan
    return plan


def _row_major(t):
    """``t`` as the kernels address it: rows of unit-stride columns (a copy only when the last dim is strided)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _strides(shape, stride):
    """The batch, head and row strides the kernels take; 0 for a dim of size one (never stepped)."""
    return tuple(st if n > 1 else 0 for n, st in zip(shape[:3], stride[:3]))


def _stride_unit(strides) -> int:
    """The largest power of two up to 16 that divides every stride. The kernels take the strides divided
    by it and multiply them back: the compiler then knows each row's alignment, and loads 16 bytes at
    a time. Without it, a stride Triton did not see as a multiple of 16 (40 for D = 40) makes every
    load a 2-byte one (sm_90 PTX: ld.global.b16 only)."""
    g = math.gcd(*strides)
    return min(16, g & -g) if g else 16


def _divided(strides, unit):
    return tuple(st // unit for st in strides)


class _FwdPlan:
    __slots__ = ("out_stride", "hopper", "splits", "args", "keys_per_split", "fwd", "combine")


def _fwd_plan(key, q, k, v, causal, scale, precision, out_stride):
    b, h, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    d0, d1 = head_split(d)
    plan = _FwdPlan()
    plan.out_stride = out_stride
    # the Gluon kernel on sm_90 where it takes the call (attention_sm90.supports says when)
    plan.hopper = None
    if not INTERPRETED and not attention_sm90.supports(q, k, v, causal, out_stride):
        plan.hopper = attention_sm90.Plan(q, k, v, out_stride, causal, scale)
        return _remember(_fwd_plans, key, plan)

    def configure(config):
        block_m, block_n, warps, stages = config
        group = h // max(hkv, 1)  # no heads at all: no programs either
        pack = group > 1 and group * sq <= block_m  # decode under GQA: the group's heads share one program
        heads, rows = (hkv, group * sq) if pack else (h, sq)
        splits = _splits(b, heads, rows, skv, block_m, block_n, q.device)
        plan.keys_per_split = max(triton.cdiv(triton.cdiv(skv, splits), block_n), 1) * block_n
        plan.splits = max(triton.cdiv(skv, plan.keys_per_split), 1)  # no keys: one range, seeing none
        if plan.splits == 1:  # out, through its own strides
            so = (0, *_strides(q.shape, out_stride))
        else:  # contiguous float32 partials [splits, B, H, SQ, D]
            so = (b * h * sq * d, *_strides(q.shape, (h * sq * d, sq * d, d)))
        strides = (*_strides(q.shape, q.stride()), *_strides(k.shape, k.stride()), *_strides(v.shape, v.stride()),
                   *so)
        unit = _stride_unit(strides)
        plan.args = (*_divided(strides, unit), h, group, sq, skv)
        plan.fwd = Launch(_fwd_kernel, (triton.cdiv(rows, block_m), b * heads, plan.splits), 5, CAUSAL=causal, D=d,
                          D0=d0, D1=d1, BLOCK_M=block_m, BLOCK_N=block_n, UPCAST=_upcast(q.dtype), PACK_GROUP=pack,
                          NEGATIVE_SCALE=scale < 0, UNIT=unit, PRECISION=precision, num_warps=warps,
                          num_stages=stages)
        plan.combine = Launch(_combine_kernel, (b * h * sq,), 4, D=d, BLOCK_D=triton.next_power_of_2(d),
                              BLOCK_S=triton.next_power_of_2(plan.splits), num_warps=4)
        return plan

    config = _config("fwd", q, k, causal, precision, lambda c: _forward(configure(c), q, k, v, scale))
    return _remember(_fwd_plans, key, configure(config))


def _aligned(*tensors) -> bool:
    """Whether every base is 16-byte aligned: what TMA (the Hopper kernels) needs and a stride check
    can't see, so a plan's key holds it."""
    return not any(t.data_ptr() % 16 for t in tensors)


def _batch_slices(q):
    """Slices of the batch that each fit one launch, or None where the whole batch does."""
    b, h = q.shape[:2]
    if b * h <= MAX_GRID_Y:
        return None
    step = MAX_GRID_Y // h
    return [slice(start, start + step) for start in range(0, b, step)]


def _by_batch_slices(run, slices, inputs, outputs):
    """``outputs``, filled slice by slice from ``run`` over the same slices of ``inputs``."""
    for part in slices:
        for out, got in zip(outputs, run(*(t[part] for t in inputs))):
            out[part].copy_(got)
    return outputs


def attention_fwd(q, k, v, *, causal, scale, window=None, softcap=None):
    if window is not None or softcap is not None:  # tested here, not in the call: host-time critical
        refuse_features(window, softcap, KERNELS)
    slices = _batch_slices(q)
    if slices is not None:
        return _by_batch_slices(lambda *t: attention_fwd(*t, causal=causal, scale=scale), slices, (q, k, v),
                                (layout.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)))
    scale = float(scale)  # a plan's launches take floats: an int would be specialised on its value
    precision = _dot_precision(q.dtype)
    rq, rk, rv = _row_major(q), _row_major(k), _row_major(v)
    key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, k.dtype, v.dtype, q.device, causal,
           scale < 0, precision, _aligned(rq, rk, rv))
    plan = _fwd_plans.get(key)
    if plan is None:
        plan = _fwd_plan(key, rq, rk, rv, causal, scale, precision, layout.strides_like(q))
    return _forward(plan, rq, rk, rv, scale)


def _forward(plan, q, k, v, scale):
    b, h, sq, d = q.shape
    out = torch.empty_strided(q.shape, plan.out_stride, dtype=q.dtype, device=q.device)
    if plan.hopper is not None:
        return attention_sm90.forward(plan.hopper, q, k, v, out, scale)
    if plan.splits == 1:
        lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
        plan.fwd(q, k, v, out, lse, *plan.args, scale * LOG2E.value, plan.keys_per_split)
        return out, lse
    # Split partial results stay in float32 until they are merged.
    parts = torch.empty((plan.splits, b, h, sq, d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((plan.splits, b, h, sq), dtype=torch.float32, device=q.device)
    plan.fwd(q, k, v, parts, part_lse, *plan.args, scale * LOG2E.value, plan.keys_per_split)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    plan.combine(parts, part_lse, out, lse, plan.splits, h, sq, *plan.out_stride[:3])
    return out, lse


class _BwdPlan:
    __slots__ = ("dq_stride", "dk_stride", "dv_stride", "delta", "delta_args", "hopper", "dkdv", "dkdv_args", "dq",
                 "dq_args")


def _bwd_plan(key, q, k, v, out, lse, dout, causal, scale, precision, out_strides):
    b, h, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    d0, d1 = head_split(d)
    plan = _BwdPlan()
    plan.dq_stride, plan.dk_stride, plan.dv_stride = out_strides
    block = 64 if d <= 128 else 32
    plan.delta = Launch(_delta_kernel, (triton.cdiv(sq, block), b * h), 3, D=d, BLOCK_D=triton.next_power_of_2(d),
                        BLOCK=block)
    plan.delta_args = (*out.stride()[:3], *dout.stride()[:3], h, sq)
    plan.hopper = None
    if not INTERPRETED and not attention_sm90.supports_backward(q, k, v, dout, causal, out_strides):
        plan.hopper = attention_sm90.BwdPlan(q, k, v, dout, plan.dk_stride, plan.dv_stride, causal)
        return _remember(_bwd_plans, key, plan)
    inputs = (*_strides(q.shape, q.stride()), *_strides(k.shape, k.stride()), *_strides(v.shape, v.stride()),
              *_strides(q.shape, dout.stride()))
    dkdv_strides = (*inputs, *_strides(k.shape, plan.dk_stride), *_strides(v.shape, plan.dv_stride))
    dq_strides = (*inputs, *_strides(q.shape, plan.dq_stride))
    dkdv_unit, dq_unit = _stride_unit(dkdv_strides), _stride_unit(dq_strides)
    common = dict(CAUSAL=causal, D=d, D0=d0, D1=d1, UPCAST=_upcast(q.dtype), PRECISION=precision)
    group = h // max(hkv, 1)

    def configure_dkdv(config):
        block_m, block_n, warps, stages = config
        plan.dkdv = Launch(_bwd_dkdv_kernel, (triton.cdiv(skv, block_n), b * hkv), 8, **common, BLOCK_M=block_m,
                           BLOCK_N=block_n, UNIT=dkdv_unit, num_warps=warps, num_stages=stages)
        plan.dkdv_args = (*_divided(dkdv_strides, dkdv_unit), hkv, group, sq, skv)
        return plan

    def configure_dq(config):
        block_m, block_n, warps, stages = config
        plan.dq = Launch(_bwd_dq_kernel, (triton.cdiv(sq, block_m), b * h), 7, **common, BLOCK_M=block_m,
                         BLOCK_N=block_n, UNIT=dq_unit, num_warps=warps, num_stages=stages)
        plan.dq_args = (*_divided(dq_strides, dq_unit), h, group, sq, skv)
        return plan

    # A candidate is timed on its own kernel, over real buffers: each kernel overwrites its outputs,
    # so nothing is left to undo.
    delta, dq, dk, dv = _bwd_buffers(plan, q, k, v)
    plan.delta(out, dout, delta, *plan.delta_args)
    configure_dkdv(_config("dkdv", q, k, causal, precision,
                           lambda c: _dkdv(configure_dkdv(c), q, k, v, dout, lse, delta, dk, dv, scale)))
    configure_dq(_config("dq", q, k, causal, precision,
                         lambda c: _dq(configure_dq(c), q, k, v, dout, lse, delta, dq, scale)))
    return _remember(_bwd_plans, key, plan)


def attention_bwd(q, k, v, out, lse, dout, *, causal, scale, window=None, softcap=None):
    if window is not None or softcap is not None:
        refuse_features(window, softcap, KERNELS)
    slices = _batch_slices(q)
    if slices is not None:
        return _by_batch_slices(lambda *t: attention_bwd(*t, causal=causal, scale=scale), slices,
                                (q, k, v, out, lse, dout), tuple(layout.empty_like(t) for t in (q, k, v)))
    scale = float(scale)
    precision = _dot_precision(q.dtype)
    rq, rk, rv, out, dout = _row_major(q), _row_major(k), _row_major(v), _row_major(out), _row_major(dout)
    lse = lse.contiguous()  # ours: already contiguous, so no copy
    key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), out.stride(), dout.stride(), q.dtype, k.dtype,
           v.dtype, out.dtype, dout.dtype, lse.dtype, q.device, causal, precision,
           torch.are_deterministic_algorithms_enabled(), _aligned(rq, rk, rv, dout))
    plan = _bwd_plans.get(key)
    if plan is None:
        strides = (layout.strides_like(q), layout.strides_like(k), layout.strides_like(v))
        plan = _bwd_plan(key, rq, rk, rv, out, lse, dout, causal, scale, precision, strides)
    delta, dq, dk, dv = _bwd_buffers(plan, rq, rk, rv)
    plan.delta(out, dout, delta, *plan.delta_args)
    if plan.hopper is not None:
        return attention_sm90.backward(plan.hopper, rq, rk, rv, dout, lse, delta, dq, dk, dv, scale)
    _dkdv(plan, rq, rk, rv, dout, lse, delta, dk, dv, scale)
    _dq(plan, rq, rk, rv, dout, lse, delta, dq, scale)
    return dq, dk, dv


def _bwd_buffers(plan, q, k, v):
    delta = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    dq = torch.empty_strided(q.shape, plan.dq_stride, dtype=q.dtype, device=q.device)
    dk = torch.empty_strided(k.shape, plan.dk_stride, dtype=k.dtype, device=k.device)
    dv = torch.empty_strided(v.shape, plan.dv_stride, dtype=v.dtype, device=v.device)
    return delta, dq, dk, dv


def _dkdv(plan, q, k, v, dout, lse, delta, dk, dv, scale):
    plan.dkdv(q, k, v, dout, lse, delta, dk, dv, *plan.dkdv_args, scale, scale * LOG2E.value)


def _dq(plan, q, k, v, dout, lse, delta, dq, scale):
    plan.dq(q, k, v, dout, lse, delta, dq, *plan.dq_args, scale, scale * LOG2E.value)
