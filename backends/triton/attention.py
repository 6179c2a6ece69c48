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
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from portable_ops import layout

from . import attention_sm90
from .autotune import Tuner, bucket
from .interpreter import INTERPRETED, to_dtype
from .launch import Launch

LOG2E = tl.constexpr(1.4426950408889634)  # kernels may read only constexpr globals
LN2 = tl.constexpr(0.6931471805599453)
MAX_HEAD_DIM = 256  # a tile row of the head dim must fit the registers


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


# ----------------------------------------------------------------------------- masks
#
# Every mask is a band around the diagonal: query row ``i`` sits at key position ``i + SKV - SQ``
# and sees keys from ``lo_off`` to ``hi_off`` past its row, bounded on a side only under
# BOUND_LEFT / BOUND_RIGHT (causal is ``hi_off = SKV - SQ``). A loop over tiles runs in three
# ranges: tiles that some rows see only partly (masked), tiles every row sees in full (no mask),
# then partly seen tiles again; tiles no row sees are never visited, so a sliding window costs
# time in proportion to its width, not to the sequence.

@triton.jit
def _visible(pos, cols, in_bounds, lo_off, hi_off, BOUND_LEFT: tl.constexpr, BOUND_RIGHT: tl.constexpr):
    """Which (row at key position ``pos``, key ``cols``) pairs are seen; broadcasting operands."""
    seen = in_bounds
    if BOUND_RIGHT:
        seen = seen & (cols <= pos + hi_off)
    if BOUND_LEFT:
        seen = seen & (cols >= pos + lo_off)
    return seen


@triton.jit
def _key_ranges(pos_lo, pos_hi, lo, hi, SKV, lo_off, hi_off, BLOCK_N: tl.constexpr, BOUND_LEFT: tl.constexpr,
                BOUND_RIGHT: tl.constexpr):
    """For rows ``pos_lo..pos_hi`` and keys ``[lo, hi)`` (``lo`` a multiple of BLOCK_N): ``(lo, full_lo,
    full_hi, hi)``, where keys ``[full_lo, full_hi)`` are whole tiles every row sees and keys outside
    ``[lo, hi)`` no row sees."""
    full_lo = lo
    full_hi = SKV // BLOCK_N * BLOCK_N
    if BOUND_RIGHT:
        hi = tl.minimum(hi, pos_hi + hi_off + 1)
        full_hi = tl.minimum(full_hi, tl.maximum(pos_lo + hi_off + 1, 0) // BLOCK_N * BLOCK_N)
    if BOUND_LEFT:
        lo = tl.maximum(lo, tl.maximum(pos_lo + lo_off, 0) // BLOCK_N * BLOCK_N)
        full_lo = tl.cdiv(tl.maximum(pos_hi + lo_off, 0), BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_ranges(n0, SQ, SKV, lo_off, hi_off, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BOUND_LEFT: tl.constexpr, BOUND_RIGHT: tl.constexpr):
    """The transpose of :func:`_key_ranges` for keys ``n0..n0 + BLOCK_N - 1``: ``(lo, full_lo, full_hi,
    hi)`` over query rows, ``[full_lo, full_hi)`` whole tiles of rows that see every key of the block."""
    lo = 0
    hi = SQ
    full_lo = 0
    full_hi = SQ // BLOCK_M * BLOCK_M
    if BOUND_RIGHT:
        lo = tl.maximum(n0 - hi_off, 0) // BLOCK_M * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - hi_off, 0), BLOCK_M) * BLOCK_M
    if BOUND_LEFT:
        hi = tl.minimum(hi, n0 + BLOCK_N - lo_off)
        full_hi = tl.minimum(full_hi, tl.maximum(n0 - lo_off + 1, 0) // BLOCK_M * BLOCK_M)
    if n0 + BLOCK_N > SKV:  # a ragged key block masks everywhere
        full_hi = 0
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _tanh(x):
    # from exp2 (one MUFU op): libdevice's tanh is not in every Triton's interpreter. Near 0, where
    # 1 - 2 / (e^2x + 1) cancels (a large cap makes every x small), its series: exact to float32 there.
    x2 = x * x
    series = x * (1.0 - x2 * (1.0 / 3.0 - x2 * (2.0 / 15.0)))
    return tl.where(x2 < 0.015625, series, 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0))


@triton.jit
def _logits(s, scale_log2, squash, cap_log2, SOFTCAP: tl.constexpr):
    """Scores ``q . k`` -> scaled (and soft-capped: ``cap * tanh(scale * s / cap)``) scores, in the log2 domain."""
    if SOFTCAP:
        s = _tanh(s * squash) * cap_log2
    else:
        s = s * scale_log2
    return s


@triton.jit
def _probs(s, lse_log2, scale_log2, squash, cap_log2, SOFTCAP: tl.constexpr):
    """``(P, slope)`` from scores and the rows' log2-domain lse (broadcast): the probabilities, and
    d(capped score) / d(scaled score), which the score gradient takes (1 without a softcap)."""
    # one return statement: a compiled function's returns must agree in type, constexpr branches included
    if SOFTCAP:
        t = _tanh(s * squash)
        p = tl.exp2(t * cap_log2 - lse_log2)
        slope = 1.0 - t * t
    else:
        p = tl.exp2(s * scale_log2 - lse_log2)
        slope = 1.0
    return p, slope


@triton.jit
def _kv_rows(cols, readable, table, sk_page, sk_n, sv_page, sv_n, PAGED: tl.constexpr, PAGE: tl.constexpr):
    """Row offsets of keys ``cols`` in K and V: ``cols * stride``, or, from a paged cache, through the
    sequence's row of the page table (pages of unreadable keys are not looked up)."""
    if PAGED:
        page = tl.load(table + cols // PAGE, mask=readable, other=0).to(tl.int64)
        slot = cols % PAGE
        k_rows = page * sk_page + slot * sk_n
        v_rows = page * sv_page + slot * sv_n
    else:
        k_rows = cols * sk_n
        v_rows = cols * sv_n
    return k_rows, v_rows


@triton.jit
def _sequence(CU_Q, CU_K, b):
    """``(q_start, SQ, k_start, SKV)`` of packed sequence ``b``: where its rows start, and how many."""
    q_start = tl.load(CU_Q + b)
    k_start = tl.load(CU_K + b)
    return q_start, tl.load(CU_Q + b + 1) - q_start, k_start, tl.load(CU_K + b + 1) - k_start


@triton.jit
def _unit_strides(batch, head, row, UNIT: tl.constexpr, OFFSETS_64: tl.constexpr):
    """A tensor's (batch, head, row) strides multiplied back by UNIT (see _stride_unit): the batch's in int64, as
    a batch's offset may pass 2^31 elements, and the others too under OFFSETS_64 (see _offsets_64)."""
    batch = tl.cast(batch, tl.int64) * UNIT
    if OFFSETS_64:
        head = tl.cast(head, tl.int64)
        row = tl.cast(row, tl.int64)
    return batch, head * UNIT, row * UNIT


# ----------------------------------------------------------------------------- forward

@triton.jit
def _fwd_tiles(acc0, acc1, l_i, m_i, q0, q1, k_base, v_base, table, sk_page, sk_n, sv_page, sv_n, pos, offs_n, lo,
               hi, SKV, first_key, lo_off, hi_off, scale_log2, squash, cap_log2, D: tl.constexpr,
               D0: tl.constexpr, D1: tl.constexpr, MASK: tl.constexpr, BOUND_LEFT: tl.constexpr,
               BOUND_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
               UPCAST: tl.constexpr, NEGATIVE_SCALE: tl.constexpr, PRECISION: tl.constexpr):
    for start_n in tl.range(lo, hi, offs_n.shape[0]):
        cols = start_n + offs_n
        in_bounds = cols < SKV
        readable = in_bounds
        if PAGED:  # pages before the window may be released: not even their page numbers are read
            readable = in_bounds & (cols >= first_key)
        k_rows, v_rows = _kv_rows(cols, readable, table, sk_page, sk_n, sv_page, sv_n, PAGED, PAGE)
        k0, k1 = _load2(k_base, k_rows, readable, D, D0, D1, MASK, True, UPCAST)
        s = _dot2(q0, q1, k0, k1, tl.zeros([q0.shape[0], offs_n.shape[0]], dtype=tl.float32), D1, PRECISION)
        if MASK or SOFTCAP:
            # scaled before masking: -inf times a zero scale would be NaN
            s = _logits(s, scale_log2, squash, cap_log2, SOFTCAP)
            if MASK:
                s = tl.where(_visible(pos[:, None], cols[None, :], in_bounds[None, :], lo_off, hi_off, BOUND_LEFT,
                                      BOUND_RIGHT), s, float("-inf"))
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
        v0, v1 = _load2(v_base, v_rows, readable, D, D0, D1, MASK, False, UPCAST)
        acc0 = tl.dot(p.to(v0.dtype), v0, acc0 * alpha[:, None], input_precision=PRECISION)
        if D1 > 0:
            acc1 = tl.dot(p.to(v1.dtype), v1, acc1 * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc0, acc1, l_i, m_i


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, CU_Q, CU_K, CACHE_LENS, TABLE,
                sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_split, so_b, so_h, so_m,
                slse_split, slse_b, slse_h, stable_b, H, GROUP, SQ, SKV, LEFT, RIGHT,
                scale_log2, squash, cap_log2, KEYS_PER_SPLIT,
                BOUND_LEFT: tl.constexpr, BOUND_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr,
                PAGED: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PACK_GROUP: tl.constexpr,
                NEGATIVE_SCALE: tl.constexpr, UNIT: tl.constexpr, OFFSETS_64: tl.constexpr,
                PRECISION: tl.constexpr):
    sq_b, sq_h, sq_m = _unit_strides(sq_b, sq_h, sq_m, UNIT, OFFSETS_64)
    sk_b, sk_h, sk_n = _unit_strides(sk_b, sk_h, sk_n, UNIT, OFFSETS_64)
    sv_b, sv_h, sv_n = _unit_strides(sv_b, sv_h, sv_n, UNIT, OFFSETS_64)
    so_b, so_h, so_m = _unit_strides(so_b, so_h, so_m, UNIT, OFFSETS_64)
    so_split = tl.cast(so_split, tl.int64) * UNIT
    start_m = tl.program_id(0)
    if BOUND_RIGHT:  # the last query blocks see the most keys: start them first, so the tail of the grid is light
        start_m = tl.num_programs(0) - 1 - start_m
    split = tl.program_id(2)  # which range of keys, when decode splits them across programs
    r = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if PACK_GROUP:
        # Decode under GQA: one program takes every query head of a KV head's group as its rows
        # (head-major, then position), so each K/V tile is read once for the whole group.
        b, hk = tl.program_id(1) // (H // GROUP), tl.program_id(1) % (H // GROUP)
    else:
        b, h = tl.program_id(1) // H, tl.program_id(1) % H
        hk = h // GROUP
    # a sequence's rows: packed sequences (VARLEN) start at rows q_start, k_start of one [1, H, T, D]
    # tensor, whose batch strides are 0; a paged cache's batch strides are its pages'
    q_base = Q + b * sq_b
    k_base = K + b * sk_b + hk * sk_h
    v_base = V + b * sv_b + hk * sv_h
    o_base = O + split * so_split + b * so_b
    lse_base = LSE + split.to(tl.int64) * slse_split + b.to(tl.int64) * slse_b
    if VARLEN:
        q_start, SQ, k_start, SKV = _sequence(CU_Q, CU_K, b)
        if start_m * BLOCK_M >= SQ:
            return
        q_base += q_start.to(tl.int64) * sq_m
        k_base += k_start.to(tl.int64) * sk_n
        v_base += k_start.to(tl.int64) * sv_n
        o_base += q_start.to(tl.int64) * so_m
        lse_base += q_start
    if PAGED:
        SKV = tl.load(CACHE_LENS + b)
        k_base = K + hk * sk_h
        v_base = V + hk * sv_h
    if PACK_GROUP:
        h = hk * GROUP + r // SQ
        pos = r % SQ
        valid = r < GROUP * SQ
        pos_lo, pos_hi = 0, SQ - 1
    else:
        pos = r
        valid = r < SQ
        pos_lo = start_m * BLOCK_M
        pos_hi = tl.minimum(pos_lo + BLOCK_M, SQ) - 1
    offs_n = tl.arange(0, BLOCK_N)
    q0, q1 = _load2(q_base, h * sq_h + pos * sq_m, valid, D, D0, D1, True, False, UPCAST)

    # m_i is already in the log2 domain (scaled); -inf until the row sees a key
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_M, D0], dtype=tl.float32)
    acc1 = acc0  # stands in for the second chunk's accumulator when there is none
    if D1 > 0:
        acc1 = tl.zeros([BLOCK_M, D1], dtype=tl.float32)
    lo_off = SKV - SQ - LEFT
    hi_off = SKV - SQ + RIGHT
    lo = split * KEYS_PER_SPLIT
    lo, full_lo, full_hi, hi = _key_ranges(pos_lo, pos_hi, lo, tl.minimum(SKV, lo + KEYS_PER_SPLIT), SKV, lo_off,
                                           hi_off, BLOCK_N, BOUND_LEFT, BOUND_RIGHT)
    first_key = 0
    if BOUND_LEFT:
        first_key = tl.maximum(pos_lo + lo_off, 0)
    table = TABLE + b.to(tl.int64) * stable_b
    for part in tl.static_range(3):  # masked, whole, masked
        acc0, acc1, l_i, m_i = _fwd_tiles(acc0, acc1, l_i, m_i, q0, q1, k_base, v_base, table, sk_b, sk_n, sv_b,
                                          sv_n, pos, offs_n, (lo, full_lo, full_hi)[part],
                                          (full_lo, full_hi, hi)[part], SKV, first_key, lo_off, hi_off, scale_log2,
                                          squash, cap_log2, D, D0, D1, part != 1, BOUND_LEFT, BOUND_RIGHT, SOFTCAP,
                                          PAGED, PAGE, UPCAST, NEGATIVE_SCALE, PRECISION)
    seen = l_i > 0
    norm = 1.0 / tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    _store2(o_base, h * so_h + pos * so_m, valid, acc0 * norm[:, None], acc1 * norm[:, None], D, D1)
    tl.store(lse_base + h.to(tl.int64) * slse_h + pos, lse, mask=valid)


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
def _delta_kernel(O, DO, DELTA, DQ_SUM, so_b, so_h, so_m, sdo_b, sdo_h, sdo_m, H, SQ,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, ZERO_DQ: tl.constexpr,
                  OFFSETS_64: tl.constexpr):
    """rowsum(dO * O): the softmax-gradient correction, one float32 per query row. With ``ZERO_DQ``, the
    same rows of the float32 dQ [B, H, SQ, D] that the Hopper backward adds into are zeroed here: one
    launch fewer than a fill of their own (~15 us of host time a call on the H100)."""
    if OFFSETS_64:  # see _offsets_64
        so_h, so_m = tl.cast(so_h, tl.int64), tl.cast(so_m, tl.int64)
        sdo_h, sdo_m = tl.cast(sdo_h, tl.int64), tl.cast(sdo_m, tl.int64)
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
    if ZERO_DQ:
        tl.store(DQ_SUM + (bh.to(tl.int64) * SQ + rows[:, None]) * D + cols[None, :],
                 tl.zeros([BLOCK, BLOCK_D], tl.float32), mask=mask)

@triton.jit
def _dkdv_tiles(dk0, dk1, dv0, dv1, k0, k1, v0, v1, q_base, do_base, lse_base, delta_base, sq_m, sdo_m, cols,
                offs_m, lo, hi, SQ, SKV, lo_off, hi_off, scale_log2, squash, cap_log2, D: tl.constexpr,
                D0: tl.constexpr, D1: tl.constexpr, MASK: tl.constexpr, BOUND_LEFT: tl.constexpr,
                BOUND_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
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
        p_t, slope = _probs(_dot2(k0, k1, q0_t, q1_t, zeros, D1, PRECISION), lse[None, :], scale_log2, squash,
                            cap_log2, SOFTCAP)
        if MASK:
            p_t = tl.where(_visible(rows[None, :], cols[:, None], cols[:, None] < SKV, lo_off, hi_off, BOUND_LEFT,
                                    BOUND_RIGHT), p_t, 0.0)
        dv0 = tl.dot(p_t.to(do0.dtype), do0, dv0, input_precision=PRECISION)
        if D1 > 0:
            dv1 = tl.dot(p_t.to(do1.dtype), do1, dv1, input_precision=PRECISION)
        dp_t = _dot2(v0, v1, tl.trans(do0), tl.trans(do1), zeros, D1, PRECISION)
        ds_t = p_t * (dp_t - delta[None, :]) * slope
        dk0 = tl.dot(ds_t.to(q0_t.dtype), tl.trans(q0_t), dk0, input_precision=PRECISION)
        if D1 > 0:
            dk1 = tl.dot(ds_t.to(q1_t.dtype), tl.trans(q1_t), dk1, input_precision=PRECISION)
    return dk0, dk1, dv0, dv1


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K, sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h,
                     sv_n, sdo_b, sdo_h, sdo_m, sdk_b, sdk_h, sdk_n, sdv_b, sdv_h, sdv_n, slse_b, slse_h,
                     HKV, GROUP, SQ, SKV, LEFT, RIGHT, scale, scale_log2, squash, cap_log2,
                     BOUND_LEFT: tl.constexpr, BOUND_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr,
                     D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, UNIT: tl.constexpr,
                     OFFSETS_64: tl.constexpr, PRECISION: tl.constexpr):
    sq_b, sq_h, sq_m = _unit_strides(sq_b, sq_h, sq_m, UNIT, OFFSETS_64)
    sk_b, sk_h, sk_n = _unit_strides(sk_b, sk_h, sk_n, UNIT, OFFSETS_64)
    sv_b, sv_h, sv_n = _unit_strides(sv_b, sv_h, sv_n, UNIT, OFFSETS_64)
    sdo_b, sdo_h, sdo_m = _unit_strides(sdo_b, sdo_h, sdo_m, UNIT, OFFSETS_64)
    sdk_b, sdk_h, sdk_n = _unit_strides(sdk_b, sdk_h, sdk_n, UNIT, OFFSETS_64)
    sdv_b, sdv_h, sdv_n = _unit_strides(sdv_b, sdv_h, sdv_n, UNIT, OFFSETS_64)
    start_n = tl.program_id(0)
    bh = tl.program_id(1)
    b, hk = bh // HKV, bh % HKV
    n0 = start_n * BLOCK_N
    q_off = b * sq_b
    do_off = b * sdo_b
    k_off = b * sk_b
    v_off = b * sv_b
    dk_off = b * sdk_b
    dv_off = b * sdv_b
    lse_off = b.to(tl.int64) * slse_b
    if VARLEN:  # as in the forward: one [1, H, T, D] tensor, batch strides 0
        q_start, SQ, k_start, SKV = _sequence(CU_Q, CU_K, b)
        if n0 >= SKV:
            return
        q_off += q_start.to(tl.int64) * sq_m
        do_off += q_start.to(tl.int64) * sdo_m
        k_off += k_start.to(tl.int64) * sk_n
        v_off += k_start.to(tl.int64) * sv_n
        dk_off += k_start.to(tl.int64) * sdk_n
        dv_off += k_start.to(tl.int64) * sdv_n
        lse_off += q_start
    cols = n0 + tl.arange(0, BLOCK_N)
    in_bounds = cols < SKV
    offs_m = tl.arange(0, BLOCK_M)
    k0, k1 = _load2(K + k_off + hk * sk_h, cols * sk_n, in_bounds, D, D0, D1, True, False, UPCAST)
    v0, v1 = _load2(V + v_off + hk * sv_h, cols * sv_n, in_bounds, D, D0, D1, True, False, UPCAST)
    dk0 = tl.zeros([BLOCK_N, D0], dtype=tl.float32)
    dk1, dv1 = dk0, dk0  # stand in for the second chunk's accumulators when there is none
    if D1 > 0:
        dk1 = tl.zeros([BLOCK_N, D1], dtype=tl.float32)
        dv1 = tl.zeros([BLOCK_N, D1], dtype=tl.float32)
    dv0 = tl.zeros([BLOCK_N, D0], dtype=tl.float32)
    lo_off = SKV - SQ - LEFT
    hi_off = SKV - SQ + RIGHT
    lo, full_lo, full_hi, hi = _query_ranges(n0, SQ, SKV, lo_off, hi_off, BLOCK_M, BLOCK_N, BOUND_LEFT, BOUND_RIGHT)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_base = Q + q_off + h * sq_h
        do_base = DO + do_off + h * sdo_h
        row0 = lse_off + h.to(tl.int64) * slse_h  # lse and delta share one layout
        for part in tl.static_range(3):  # masked, whole, masked
            dk0, dk1, dv0, dv1 = _dkdv_tiles(dk0, dk1, dv0, dv1, k0, k1, v0, v1, q_base, do_base, LSE + row0,
                                             DELTA + row0, sq_m, sdo_m, cols, offs_m, (lo, full_lo, full_hi)[part],
                                             (full_lo, full_hi, hi)[part], SQ, SKV, lo_off, hi_off, scale_log2, squash,
                                             cap_log2, D, D0, D1, part != 1, BOUND_LEFT, BOUND_RIGHT, SOFTCAP, UPCAST,
                                             PRECISION)
    _store2(DK + dk_off + hk * sdk_h, cols * sdk_n, in_bounds, dk0 * scale, dk1 * scale, D, D1)
    _store2(DV + dv_off + hk * sdv_h, cols * sdv_n, in_bounds, dv0, dv1, D, D1)


@triton.jit
def _dq_tiles(dq0, dq1, q0, q1, do0, do1, lse, delta, k_base, v_base, sk_n, sv_n, rows, offs_n, lo, hi, SKV,
              lo_off, hi_off, scale_log2, squash, cap_log2, D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
              MASK: tl.constexpr, BOUND_LEFT: tl.constexpr, BOUND_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
              UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    for start_n in tl.range(lo, hi, offs_n.shape[0]):
        cols = start_n + offs_n
        in_bounds = cols < SKV
        k0_t, k1_t = _load2(k_base, cols * sk_n, in_bounds, D, D0, D1, MASK, True, UPCAST)
        v0_t, v1_t = _load2(v_base, cols * sv_n, in_bounds, D, D0, D1, MASK, True, UPCAST)
        zeros = tl.zeros([rows.shape[0], offs_n.shape[0]], dtype=tl.float32)
        p, slope = _probs(_dot2(q0, q1, k0_t, k1_t, zeros, D1, PRECISION), lse[:, None], scale_log2, squash, cap_log2,
                          SOFTCAP)
        if MASK:
            p = tl.where(_visible(rows[:, None], cols[None, :], in_bounds[None, :], lo_off, hi_off, BOUND_LEFT,
                                  BOUND_RIGHT), p, 0.0)
        dp = _dot2(do0, do1, v0_t, v1_t, zeros, D1, PRECISION)
        ds = p * (dp - delta[:, None]) * slope
        dq0 = tl.dot(ds.to(k0_t.dtype), tl.trans(k0_t), dq0, input_precision=PRECISION)
        if D1 > 0:
            dq1 = tl.dot(ds.to(k1_t.dtype), tl.trans(k1_t), dq1, input_precision=PRECISION)
    return dq0, dq1


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K, sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                   sdo_b, sdo_h, sdo_m, sdq_b, sdq_h, sdq_m, slse_b, slse_h, H, GROUP, SQ, SKV, LEFT, RIGHT, scale,
                   scale_log2, squash, cap_log2,
                   BOUND_LEFT: tl.constexpr, BOUND_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr,
                   D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, UNIT: tl.constexpr,
                   OFFSETS_64: tl.constexpr, PRECISION: tl.constexpr):
    sq_b, sq_h, sq_m = _unit_strides(sq_b, sq_h, sq_m, UNIT, OFFSETS_64)
    sk_b, sk_h, sk_n = _unit_strides(sk_b, sk_h, sk_n, UNIT, OFFSETS_64)
    sv_b, sv_h, sv_n = _unit_strides(sv_b, sv_h, sv_n, UNIT, OFFSETS_64)
    sdo_b, sdo_h, sdo_m = _unit_strides(sdo_b, sdo_h, sdo_m, UNIT, OFFSETS_64)
    sdq_b, sdq_h, sdq_m = _unit_strides(sdq_b, sdq_h, sdq_m, UNIT, OFFSETS_64)
    start_m = tl.program_id(0)
    if BOUND_RIGHT:  # heaviest query blocks first, as in the forward
        start_m = tl.num_programs(0) - 1 - start_m
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    q_off = b * sq_b
    do_off = b * sdo_b
    dq_off = b * sdq_b
    k_off = b * sk_b
    v_off = b * sv_b
    lse_off = b.to(tl.int64) * slse_b
    if VARLEN:  # as in the forward
        q_start, SQ, k_start, SKV = _sequence(CU_Q, CU_K, b)
        if start_m * BLOCK_M >= SQ:
            return
        q_off += q_start.to(tl.int64) * sq_m
        do_off += q_start.to(tl.int64) * sdo_m
        dq_off += q_start.to(tl.int64) * sdq_m
        k_off += k_start.to(tl.int64) * sk_n
        v_off += k_start.to(tl.int64) * sv_n
        lse_off += q_start
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    in_bounds = rows < SQ
    offs_n = tl.arange(0, BLOCK_N)
    q0, q1 = _load2(Q + q_off + h * sq_h, rows * sq_m, in_bounds, D, D0, D1, True, False, UPCAST)
    do0, do1 = _load2(DO + do_off + h * sdo_h, rows * sdo_m, in_bounds, D, D0, D1, True, False, UPCAST)
    row0 = lse_off + h.to(tl.int64) * slse_h
    lse = tl.load(LSE + row0 + rows, mask=in_bounds, other=float("-inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)  # P = 0 on rows that see no key
    delta = tl.load(DELTA + row0 + rows, mask=in_bounds, other=0.0)
    k_base = K + k_off + (h // GROUP) * sk_h
    v_base = V + v_off + (h // GROUP) * sv_h
    dq0 = tl.zeros([BLOCK_M, D0], dtype=tl.float32)
    dq1 = dq0  # stands in for the second chunk's accumulator when there is none
    if D1 > 0:
        dq1 = tl.zeros([BLOCK_M, D1], dtype=tl.float32)
    lo_off = SKV - SQ - LEFT
    hi_off = SKV - SQ + RIGHT
    pos_lo = start_m * BLOCK_M
    lo, full_lo, full_hi, hi = _key_ranges(pos_lo, tl.minimum(pos_lo + BLOCK_M, SQ) - 1, 0, SKV, SKV, lo_off, hi_off,
                                           BLOCK_N, BOUND_LEFT, BOUND_RIGHT)
    for part in tl.static_range(3):  # masked, whole, masked
        dq0, dq1 = _dq_tiles(dq0, dq1, q0, q1, do0, do1, lse, delta, k_base, v_base, sk_n, sv_n, rows, offs_n,
                             (lo, full_lo, full_hi)[part], (full_lo, full_hi, hi)[part], SKV, lo_off, hi_off,
                             scale_log2, squash, cap_log2, D, D0, D1, part != 1, BOUND_LEFT, BOUND_RIGHT, SOFTCAP,
                             UPCAST, PRECISION)
    _store2(DQ + dq_off + h * sdq_h, rows * sdq_m, in_bounds, dq0 * scale, dq1 * scale, D, D1)


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
# Decode on sm_90 whose programs would take the narrow tiles more than one wave: each streams its whole
# cache, in wider key tiles (136 KiB of shared memory at D 128, one program an SM, where the narrow
# tiles' 70 KiB fit three; more than sm_86/89 have; measured on sm_90 only).
_DECODE_CONFIG_WIDE = (16, 128, 4, 3)
_DECODE_NARROW_PER_SM = 3
_KERNELS = (_load, _load2, _dot2, _store, _store2, _visible, _key_ranges, _query_ranges, _tanh, _logits, _probs,
            _kv_rows, _sequence, _fwd_tiles, _fwd_kernel, _combine_kernel, _delta_kernel, _dkdv_tiles,
            _bwd_dkdv_kernel, _dq_tiles, _bwd_dq_kernel, to_dtype)
_tuner = Tuner(name="attention", sources=_KERNELS)


def _config(kernel: str, q, sq, skv, hkv, causal, precision, launch, programs=0) -> tuple:
    """``q``: the [B, H, S, D] view; ``sq``, ``skv``: each sequence's (longest) query and key lengths;
    ``programs``: a decode's (sequences x heads a program takes)."""
    if INTERPRETED:
        return _INTERPRETER_CONFIG
    b, h, _, d = q.shape
    width = sum(head_split(d))
    if kernel == "fwd" and sq <= 16:
        return _decode_config(q, programs)
    key = (kernel, d, q.dtype, precision, causal, bucket(sq), bucket(skv), bucket(b * h), h // max(hkv, 1))
    return _tuner.pick(key, CONFIGS[kernel][width], launch)


def _decode_config(q, programs: int) -> tuple:
    """The split-key forward's tiles for ``programs`` (sequences x the heads a program takes) over
    ``q``'s head dim. H100 sweeps (docs/performance.md, "Decode"), D 128, bf16, 8 KV heads, unsplit:
    128-key tiles took 15-24% longer than 64-key ones at batch 17 (136 programs: one program an SM
    where the narrow tiles run three, so a second, part-empty wave), from 4% less to 9% more at
    24-48 (more at 512 keys), and 4-9% less at 56 and 64 (448 and 512 programs) from 2k keys; with
    fewer programs than SMs, 64-key tiles split across more programs were as fast or faster. So: wide
    only past three programs an SM, and only where that was measured and fits: heads 97-128 wide,
    one column chunk of 128 (D 64 spills 8 bytes in them, D 80 152), of a 2-byte dtype (float32
    tiles would need 272 KiB of shared memory)."""
    split = head_split(q.shape[-1])
    if split == (128, 0) and q.element_size() == 2:
        index = attention_sm90._index(q.device)
        if programs > _DECODE_NARROW_PER_SM * _multiprocessors(index) and attention_sm90._is_sm90(index):
            return _DECODE_CONFIG_WIDE
    return _DECODE_CONFIG[sum(split) > 128]


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


def _grid_reasons(programs: int, what: str) -> list[str]:
    if programs <= MAX_GRID_Y:
        return []
    return [f"{programs} {what}: a launch takes at most {MAX_GRID_Y} (CUDA's limit on a grid's second dimension)"]


def attention_supports(call) -> list[str]:
    q = call["q"]
    return _grid_reasons(q.shape[1], "heads")  # batches over the limit run in slices


def attention_varlen_supports(call) -> list[str]:
    q = call["q"]
    sequences = call["cu_seqlens_q"].shape[0] - 1
    return _grid_reasons(sequences * q.shape[1], "sequences x heads")


def paged_attention_supports(call) -> list[str]:
    q = call["q"]
    return _grid_reasons(q.shape[0] * q.shape[2], "sequences x heads")


def paged_kv_append_supports(call) -> list[str]:
    reasons = _grid_reasons(call["k_new"].shape[2], "KV heads")
    if any(call[name].stride(-1) != 1 for name in ("k_cache", "v_cache")):
        reasons.append("a cache whose last dim is strided: the kernel writes rows of unit-stride columns")
    return reasons


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


MAX_SPLITS = 64


def _splits(b, h, sq, skv, block_m, block_n, device=None) -> int:
    """How many key ranges to split a forward into: decode (one query block) over a long cache
    leaves most of the GPU idle unless the keys are shared out too. One wave: as many ranges as
    keep programs x ranges within the SM count, each of at least two key blocks. From H100 sweeps
    of one-token decode under graph replay (docs/performance.md, "Decode"): a second wave of
    ranges (the earlier policy: two programs an SM, and two ranges for a full GPU's long caches)
    was 1-8% slower."""
    if sq > block_m or b * h == 0:  # prefill, or no programs at all
        return 1
    # the interpreter, as if on four SMs: small test shapes still take the split path
    sms = 4 if INTERPRETED else _multiprocessors(attention_sm90._index(device) if device is not None
                                                 else torch.cuda.current_device())
    # at most MAX_SPLITS: the merge holds a [splits, D] float32 tile per row in registers
    return max(1, min(sms // (b * h), skv // (2 * block_n), MAX_SPLITS))


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


# An index runs up to a tile past its dim's end (masked, but its address is formed): the widest tile.
TILE_OVERRUN = 256


def _offsets_64(d, *extents) -> bool:
    """Whether an offset the kernels form in int32 may reach 2^31 elements, so that they must form it in int64
    (``OFFSETS_64``). ``extents``: each tensor's (heads, rows, (batch, head, row) strides) as one program
    addresses it, from its sequence's start (a paged cache's rows: one page's); batches, pages, splits and
    packed sequences' starts are stepped in int64 always."""
    return any((heads + TILE_OVERRUN) * st[1] + (rows + TILE_OVERRUN) * st[2] + d + TILE_OVERRUN >= 2**31
               for heads, rows, st in extents)


class Sequences(NamedTuple):
    """Where a call's sequences lie in the [B, H, S, D] views the kernels take: a dense batch, packed
    (``attention_varlen``: one [1, H, T, D] view, rows from ``cu_seqlens``) or keys in a paged cache
    (``paged_attention``: k, v views [pages, Hkv, page_size, D], rows through ``block_table``)."""
    kind: str  # "dense", "varlen" or "paged"
    batch: int  # sequences: the grid's batch
    sq: int  # query rows (the longest sequence's)
    skv: int  # keys (the longest sequence's)
    page: int = 0  # page size, paged only
    table_stride: int = 0
    tokens: int = 0  # query rows of every sequence together, varlen only

    def lse_strides(self, h: int) -> tuple:
        """lse's (batch, head) strides: [B, H, Sq], or varlen's [H, T] (rows offset by each start)."""
        return (0, self.tokens) if self.kind == "varlen" else (h * self.sq, self.sq)


def _dense(q, k) -> Sequences:
    """A dense batch's :class:`Sequences`. Its calls pass None instead (their plan key holds the shapes
    already): built per call, it cost the eager call's host path ~0.5 us."""
    return Sequences("dense", q.shape[0], q.shape[2], k.shape[2])


def _mask(causal, window, seqs) -> tuple:
    """(BOUND_LEFT, BOUND_RIGHT, LEFT, RIGHT) of the kernels: keys from ``LEFT`` before to ``RIGHT`` after
    a row's position are seen; causal is a right bound of 0. A side wider than every sequence is cut to
    that width (the same mask): the kernels add it to positions in int32."""
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    widest = seqs.sq + seqs.skv
    return left is not None, right is not None, min(left or 0, widest), min(right or 0, widest)


# A cap this large is the identity on any float32 score a softmax can tell apart (tanh(x) = x to float32
# below |x| ~ 1e-4); cap * log2(e) would overflow float32 above ~2e38.
SOFTCAP_NONE_ABOVE = 1e30
FLOAT32_MAX = 3.4e38


def _softcap(softcap):
    return None if softcap is None or softcap > SOFTCAP_NONE_ABOVE else softcap


def _cap(scale, softcap) -> tuple:
    """The softcap's per-call floats: (scale / cap, cap * log2(e)); unused zeros without one. A tiny cap's
    scale / cap is held to float32's range: every nonzero score saturates either way, and a zero one
    stays 0 (not 0 * inf)."""
    if softcap is None:
        return 0.0, 0.0
    return max(-FLOAT32_MAX, min(scale / softcap, FLOAT32_MAX)), softcap * LOG2E.value


class _FwdPlan:
    __slots__ = ("out_stride", "hopper", "splits", "args", "keys_per_split", "fwd", "combine")


def _fwd_plan(key, q, k, v, causal, scale, window, softcap, precision, out_stride, seqs, extras):
    seqs = seqs or _dense(q, k)
    h, d = q.shape[1], q.shape[3]
    hkv, b, sq, skv = k.shape[1], seqs.batch, seqs.sq, seqs.skv
    d0, d1 = head_split(d)
    plan = _FwdPlan()
    plan.out_stride = out_stride
    # the Gluon kernel on sm_90 where it takes the call (attention_sm90.supports says when)
    plan.hopper = None
    if (not INTERPRETED and seqs.kind == "dense"
            and not attention_sm90.supports(q, k, v, causal, out_stride, window, softcap)):
        plan.hopper = attention_sm90.Plan(q, k, v, out_stride, causal, scale)
        return _remember(_fwd_plans, key, plan)
    bound_left, bound_right, left, right = _mask(causal, window, seqs)
    group = h // max(hkv, 1)  # no heads at all: no programs either

    def packed(block_m) -> tuple:
        """(pack, heads, rows): decode under GQA, the group's heads share one program where their rows
        fit its tile; the grid has ``heads`` programs a sequence, of ``rows`` rows each."""
        pack = seqs.kind != "varlen" and group > 1 and group * sq <= block_m
        return (pack, hkv, group * sq) if pack else (pack, h, sq)

    def configure(config):
        block_m, block_n, warps, stages = config
        pack, heads, rows = packed(block_m)
        splits = 1 if seqs.kind == "varlen" else _splits(b, heads, rows, skv, block_m, block_n, q.device)
        plan.keys_per_split = max(triton.cdiv(triton.cdiv(skv, splits), block_n), 1) * block_n
        plan.splits = max(triton.cdiv(skv, plan.keys_per_split), 1)  # no keys: one range, seeing none
        if plan.splits == 1:  # out, through its own strides
            so, slse = (0, *_strides(q.shape, out_stride)), (0, *seqs.lse_strides(h))
        else:  # contiguous float32 partials [splits, B, H, SQ, D] and [splits, B, H, SQ]
            so = (b * h * sq * d, *_strides(q.shape, (h * sq * d, sq * d, d)))
            slse = (b * h * sq, h * sq, sq)
        q_st, k_st, v_st = (_strides(t.shape, t.stride()) for t in (q, k, v))
        strides = (*q_st, *k_st, *v_st, *so)
        unit = _stride_unit(strides)
        kv_rows = k.shape[2] if seqs.kind == "paged" else skv
        offsets_64 = _offsets_64(d, (h, sq, q_st), (hkv, kv_rows, k_st), (hkv, kv_rows, v_st), (h, sq, so[1:]))
        plan.args = (*_divided(strides, unit), *slse, seqs.table_stride, h, group, sq, skv, left, right)
        plan.fwd = Launch(_fwd_kernel, (triton.cdiv(rows, block_m), b * heads, plan.splits), 9,
                          BOUND_LEFT=bound_left, BOUND_RIGHT=bound_right, SOFTCAP=softcap is not None,
                          VARLEN=seqs.kind == "varlen", PAGED=seqs.kind == "paged", PAGE=seqs.page, D=d, D0=d0,
                          D1=d1, BLOCK_M=block_m, BLOCK_N=block_n, UPCAST=_upcast(q.dtype), PACK_GROUP=pack,
                          NEGATIVE_SCALE=scale < 0, UNIT=unit, OFFSETS_64=offsets_64, PRECISION=precision,
                          num_warps=warps, num_stages=stages)
        plan.combine = Launch(_combine_kernel, (b * h * sq,), 4, D=d, BLOCK_D=triton.next_power_of_2(d),
                              BLOCK_S=triton.next_power_of_2(plan.splits), num_warps=4)
        return plan

    decode_programs = b * packed(_DECODE_CONFIG[False][0])[1]  # every decode tile's BLOCK_M
    config = _config("fwd", q, sq, skv, hkv, bound_right, precision,
                     lambda c: _forward(configure(c), q, k, v, scale, softcap, extras), decode_programs)
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
    slices = _batch_slices(q)
    if slices is not None:
        run = lambda *t: attention_fwd(*t, causal=causal, scale=scale, window=window, softcap=softcap)  # noqa: E731
        return _by_batch_slices(run, slices, (q, k, v),
                                (layout.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)))
    return _forward_call(q, k, v, causal, scale, window, softcap, layout.strides_like(q), None, (q, q, q, q))


def attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal, scale,
                         window=None, softcap=None):
    """``q [Tq, H, D]`` -> (out ``[Tq, H, D]`` contiguous, lse ``[H, Tq]``), one launch for every sequence."""
    seqs = Sequences("varlen", cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k, tokens=q.shape[0])
    offsets = (cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous())  # the kernels step them by one
    out, lse = _forward_call(*_as_batch(q, k, v), causal, scale, window, softcap, _as_batch_strides(q), seqs,
                             (*offsets, q, q))
    return layout.unviewed(out[0].transpose(0, 1)), lse[0]


def paged_attention(q, k_cache, v_cache, block_table, cache_seqlens, *, scale, window=None, softcap=None):
    """``q [B, Sq, Hq, D]`` over ``[pages, page_size, Hkv, D]`` caches -> ``[B, Sq, Hq, D]`` contiguous."""
    b, sq, h, d = q.shape
    page = k_cache.shape[1]
    block_table = block_table.contiguous()  # its row stride is a plan's, its columns are stepped by one
    seqs = Sequences("paged", b, sq, block_table.shape[1] * page, page, block_table.stride(0))
    out, _ = _forward_call(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2), True, scale, window,
                           softcap, (sq * h * d, d, h * d, 1), seqs, (q, q, cache_seqlens.contiguous(), block_table))
    return layout.unviewed(out.transpose(1, 2))


def _as_batch(*packed):
    """Packed ``[T, H, D]`` tensors as the kernels' ``[1, H, T, D]`` views."""
    return tuple(t.transpose(0, 1)[None] for t in packed)


def _as_batch_strides(t) -> tuple:
    """The ``[1, H, T, D]`` view's strides of a contiguous ``[T, H, D]`` tensor shaped as ``t``."""
    tokens, h, d = t.shape
    return (tokens * h * d, d, h * d, 1)


def prepare_attention_fwd(q, k, v, *, causal, scale, window=None, softcap=None):
    """``attention_fwd`` for every call of this one's layout and options (``OpImpl.prepare``):
    ``run(q, k, v)``, its plan found here, once."""
    # not one launch of q, k, v as they are; or float32, whose products follow torch's TF32 switch per call
    if _batch_slices(q) is not None or any(t.stride(-1) != 1 for t in (q, k, v)) or q.dtype == torch.float32:
        return lambda q, k, v: attention_fwd(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap)
    plan, scale, softcap = _plan_of_forward(q, k, v, causal, scale, window, softcap, layout.strides_like(q), None,
                                            (q, q, q, q))
    return lambda q, k, v: _forward(plan, q, k, v, scale, softcap, (q, q, q, q))


def _forward_call(q, k, v, causal, scale, window, softcap, out_stride, seqs, extras):
    """``seqs``: None for a dense batch; ``extras``: the kernel's CU_Q, CU_K, CACHE_LENS, TABLE (q where unused)."""
    q, k, v = _row_major(q), _row_major(k), _row_major(v)
    plan, scale, softcap = _plan_of_forward(q, k, v, causal, scale, window, softcap, out_stride, seqs, extras)
    return _forward(plan, q, k, v, scale, softcap, extras)


def _plan_of_forward(q, k, v, causal, scale, window, softcap, out_stride, seqs, extras) -> tuple:
    """(plan, scale, softcap): the plan of row-major q, k, v's layout, and the floats its launches take."""
    scale = float(scale)  # a plan's launches take floats: an int would be specialised on its value
    softcap = _softcap(softcap)
    precision = _dot_precision(q.dtype)
    key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), out_stride, q.dtype, k.dtype, v.dtype, q.device,
           causal, window, softcap is None, scale < 0, precision, seqs, _aligned(q, k, v))
    plan = _fwd_plans.get(key)
    if plan is None:
        plan = _fwd_plan(key, q, k, v, causal, scale, window, softcap, precision, out_stride, seqs, extras)
    return plan, scale, softcap


def _forward(plan, q, k, v, scale, softcap, extras):
    b, h, sq, d = q.shape
    out = torch.empty_strided(q.shape, plan.out_stride, dtype=q.dtype, device=q.device)
    if plan.hopper is not None:
        return attention_sm90.forward(plan.hopper, q, k, v, out, scale)
    floats = (scale * LOG2E.value, *_cap(scale, softcap))
    if plan.splits == 1:
        lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
        plan.fwd(q, k, v, out, lse, *extras, *plan.args, *floats, plan.keys_per_split)
        return out, lse
    # Split partial results stay in float32 until they are merged.
    parts = torch.empty((plan.splits, b, h, sq, d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((plan.splits, b, h, sq), dtype=torch.float32, device=q.device)
    plan.fwd(q, k, v, parts, part_lse, *extras, *plan.args, *floats, plan.keys_per_split)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    plan.combine(parts, part_lse, out, lse, plan.splits, h, sq, *plan.out_stride[:3])
    return out, lse


class _BwdPlan:
    __slots__ = ("dq_stride", "dk_stride", "dv_stride", "delta", "delta_args", "hopper", "dkdv", "dkdv_args", "dq",
                 "dq_args")


def _bwd_plan(key, q, k, v, out, lse, dout, causal, scale, window, softcap, precision, out_strides, seqs, extras):
    seqs = seqs or _dense(q, k)
    h, d = q.shape[1], q.shape[3]
    hkv, b, sq, skv = k.shape[1], seqs.batch, seqs.sq, seqs.skv
    d0, d1 = head_split(d)
    plan = _BwdPlan()
    plan.dq_stride, plan.dk_stride, plan.dv_stride = out_strides
    plan.hopper = None
    if (not INTERPRETED and seqs.kind == "dense"
            and not attention_sm90.supports_backward(q, k, v, dout, causal, out_strides, window, softcap)):
        plan.hopper = attention_sm90.BwdPlan(q, k, v, dout, plan.dk_stride, plan.dv_stride, causal)
    block = 64 if d <= 128 else 32
    # delta over the [B, H, S] rows of the views (varlen: [1, H, T], the layout of its lse)
    rows = q.shape[2]
    delta_64 = _offsets_64(d, (h, rows, _strides(q.shape, out.stride())), (h, rows, _strides(q.shape, dout.stride())))
    plan.delta = Launch(_delta_kernel, (triton.cdiv(rows, block), q.shape[0] * h), 4, D=d,
                        BLOCK_D=triton.next_power_of_2(d), BLOCK=block, ZERO_DQ=plan.hopper is not None,
                        OFFSETS_64=delta_64)
    plan.delta_args = (*out.stride()[:3], *dout.stride()[:3], h, q.shape[2])
    if plan.hopper is not None:
        return _remember(_bwd_plans, key, plan)
    bound_left, bound_right, left, right = _mask(causal, window, seqs)
    query_like = [_strides(q.shape, st) for st in (q.stride(), dout.stride(), plan.dq_stride)]
    key_like = [_strides(k.shape, st) for st in (k.stride(), v.stride(), plan.dk_stride, plan.dv_stride)]
    inputs = (*query_like[0], *key_like[0], *key_like[1], *query_like[1])
    dkdv_strides = (*inputs, *key_like[2], *key_like[3])
    dq_strides = (*inputs, *query_like[2])
    dkdv_unit, dq_unit = _stride_unit(dkdv_strides), _stride_unit(dq_strides)
    offsets_64 = _offsets_64(d, *((h, sq, st) for st in query_like), *((hkv, skv, st) for st in key_like))
    common = dict(BOUND_LEFT=bound_left, BOUND_RIGHT=bound_right, SOFTCAP=softcap is not None,
                  VARLEN=seqs.kind == "varlen", D=d, D0=d0, D1=d1, UPCAST=_upcast(q.dtype), OFFSETS_64=offsets_64,
                  PRECISION=precision)
    group = h // max(hkv, 1)
    tail = (group, sq, skv, left, right)

    def configure_dkdv(config):
        block_m, block_n, warps, stages = config
        plan.dkdv = Launch(_bwd_dkdv_kernel, (triton.cdiv(skv, block_n), b * hkv), 10, **common, BLOCK_M=block_m,
                           BLOCK_N=block_n, UNIT=dkdv_unit, num_warps=warps, num_stages=stages)
        plan.dkdv_args = (*_divided(dkdv_strides, dkdv_unit), *seqs.lse_strides(h), hkv, *tail)
        return plan

    def configure_dq(config):
        block_m, block_n, warps, stages = config
        plan.dq = Launch(_bwd_dq_kernel, (triton.cdiv(sq, block_m), b * h), 9, **common, BLOCK_M=block_m,
                         BLOCK_N=block_n, UNIT=dq_unit, num_warps=warps, num_stages=stages)
        plan.dq_args = (*_divided(dq_strides, dq_unit), *seqs.lse_strides(h), h, *tail)
        return plan

    # A candidate is timed on its own kernel, over real buffers: each kernel overwrites its outputs,
    # so nothing is left to undo.
    delta, dq, dk, dv = _bwd_buffers(plan, q, k, v)
    plan.delta(out, dout, delta, delta, *plan.delta_args)
    floats = (scale, scale * LOG2E.value, *_cap(scale, softcap))
    configure_dkdv(_config("dkdv", q, sq, skv, hkv, bound_right, precision,
                           lambda c: configure_dkdv(c).dkdv(q, k, v, dout, lse, delta, dk, dv, *extras,
                                                            *plan.dkdv_args, *floats)))
    configure_dq(_config("dq", q, sq, skv, hkv, bound_right, precision,
                         lambda c: configure_dq(c).dq(q, k, v, dout, lse, delta, dq, *extras, *plan.dq_args,
                                                      *floats)))
    return _remember(_bwd_plans, key, plan)


def attention_bwd(q, k, v, out, lse, dout, *, causal, scale, window=None, softcap=None):
    slices = _batch_slices(q)
    if slices is not None:
        return _by_batch_slices(lambda *t: attention_bwd(*t, causal=causal, scale=scale, window=window,
                                                         softcap=softcap),
                                slices, (q, k, v, out, lse, dout), tuple(layout.empty_like(t) for t in (q, k, v)))
    strides = (layout.strides_like(q), layout.strides_like(k), layout.strides_like(v))
    return _backward_call(q, k, v, out, lse, dout, causal, scale, window, softcap, strides, None, (q, q))


def attention_varlen_bwd(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                         causal, scale, window=None, softcap=None):
    """Gradients ``[T, H, D]``, contiguous, of :func:`attention_varlen_fwd`."""
    seqs = Sequences("varlen", cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k, tokens=q.shape[0])
    strides = tuple(_as_batch_strides(t) for t in (q, k, v))
    grads = _backward_call(*_as_batch(q, k, v, out), lse[None], *_as_batch(dout), causal, scale, window, softcap,
                           strides, seqs, (cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()))
    return tuple(layout.unviewed(g[0].transpose(0, 1)) for g in grads)


def prepare_attention_bwd(q, k, v, *, causal, scale, window=None, softcap=None):
    """``attention_bwd`` for every call whose q, k and v have this one's layout (shapes, strides, dtypes,
    device, 16-byte alignment; the caller sees to that) and these options (``OpImpl.prepare``):
    ``run(q, k, v, out, lse, dout)``, which finds its plan by out, lse and dout's layouts alone."""
    # not one launch of q, k, v as they are; or float32, whose products follow torch's TF32 switch per call
    if _batch_slices(q) is not None or any(t.stride(-1) != 1 for t in (q, k, v)) or q.dtype == torch.float32:
        return lambda q, k, v, out, lse, dout: attention_bwd(q, k, v, out, lse, dout, causal=causal, scale=scale,
                                                             window=window, softcap=softcap)
    strides = (layout.strides_like(q), layout.strides_like(k), layout.strides_like(v))
    plans: dict = {}  # a model hands its backward dout in one layout; bounded all the same

    def run(q, k, v, out, lse, dout):
        key = (out.stride(), out.dtype, lse.stride(), lse.dtype, dout.stride(), dout.dtype, dout.data_ptr() % 16 == 0,
               torch.are_deterministic_algorithms_enabled())
        found = plans.get(key)
        if found is None:
            if out.stride(-1) != 1 or dout.stride(-1) != 1 or not lse.is_contiguous():
                return _backward_call(q, k, v, out, lse, dout, causal, scale, window, softcap, strides, None, (q, q))
            if len(plans) >= 16:
                plans.clear()
            found = plans[key] = _plan_of_backward(q, k, v, out, lse, dout, causal, scale, window, softcap, strides,
                                                   None, (q, q))
        return _backward(*found, q, k, v, out, lse, dout, (q, q))

    return run


def _backward_call(q, k, v, out, lse, dout, causal, scale, window, softcap, strides, seqs, extras):
    q, k, v, out, dout = _row_major(q), _row_major(k), _row_major(v), _row_major(out), _row_major(dout)
    lse = lse.contiguous()  # ours: already contiguous, so no copy
    plan = _plan_of_backward(q, k, v, out, lse, dout, causal, scale, window, softcap, strides, seqs, extras)
    return _backward(*plan, q, k, v, out, lse, dout, extras)


def _plan_of_backward(q, k, v, out, lse, dout, causal, scale, window, softcap, strides, seqs, extras) -> tuple:
    """(plan, scale, softcap): the plan of row-major q, k, v, out, dout and contiguous lse whose gradients
    take ``strides``, and the floats its launches take."""
    scale = float(scale)
    softcap = _softcap(softcap)
    precision = _dot_precision(q.dtype)
    key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), out.stride(), dout.stride(), strides, q.dtype,
           k.dtype, v.dtype, out.dtype, dout.dtype, lse.dtype, q.device, causal, window, softcap is None, precision,
           torch.are_deterministic_algorithms_enabled(), seqs, _aligned(q, k, v, dout))
    plan = _bwd_plans.get(key)
    if plan is None:
        plan = _bwd_plan(key, q, k, v, out, lse, dout, causal, scale, window, softcap, precision, strides, seqs,
                         extras)
    return plan, scale, softcap


def _backward(plan, scale, softcap, q, k, v, out, lse, dout, extras):
    delta, dq, dk, dv = _bwd_buffers(plan, q, k, v)
    if plan.hopper is not None:
        dq_sum = torch.empty(q.shape, dtype=torch.float32, device=q.device)  # zeroed by the delta kernel
        plan.delta(out, dout, delta, dq_sum, *plan.delta_args)
        attention_sm90.backward(plan.hopper, q, k, v, dout, lse, delta, dq_sum, dk, dv, scale)
        dq.copy_(dq_sum)
        return dq, dk, dv
    plan.delta(out, dout, delta, delta, *plan.delta_args)
    floats = (scale, scale * LOG2E.value, *_cap(scale, softcap))
    plan.dkdv(q, k, v, dout, lse, delta, dk, dv, *extras, *plan.dkdv_args, *floats)
    plan.dq(q, k, v, dout, lse, delta, dq, *extras, *plan.dq_args, *floats)
    return dq, dk, dv


def _bwd_buffers(plan, q, k, v):
    delta = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    dq = torch.empty_strided(q.shape, plan.dq_stride, dtype=q.dtype, device=q.device)
    dk = torch.empty_strided(k.shape, plan.dk_stride, dtype=k.dtype, device=k.device)
    dv = torch.empty_strided(v.shape, plan.dv_stride, dtype=v.dtype, device=v.device)
    return delta, dq, dk, dv


# ----------------------------------------------------------------------------- paged cache writes

@triton.jit
def _append_kernel(K_NEW, V_NEW, K_CACHE, V_CACHE, CACHE_LENS, TABLE, SN, skn_b, skn_t, skn_h, svn_b, svn_t,
                   svn_h, skc_p, skc_s, skc_h, svc_p, svc_s, svc_h, stable_b,
                   PAGE: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Token ``t`` of sequence ``b`` (program ``b * SN + t``), every KV head: to its slot in the cache."""
    # indices in int64: an offset into k_new, v_new or a cache may pass 2^31 elements (one multiply each a program)
    token = tl.program_id(0).to(tl.int64)
    b, t = token // SN, token % SN
    heads = tl.program_id(1).to(tl.int64)
    pos = tl.load(CACHE_LENS + b) + t
    page = tl.load(TABLE + b * stable_b + pos // PAGE).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    ok = cols < D
    src = b * skn_b + t * skn_t + heads * skn_h + cols
    tl.store(K_CACHE + page * skc_p + (pos % PAGE) * skc_s + heads * skc_h + cols, tl.load(K_NEW + src, mask=ok),
             mask=ok)
    src = b * svn_b + t * svn_t + heads * svn_h + cols
    tl.store(V_CACHE + page * svc_p + (pos % PAGE) * svc_s + heads * svc_h + cols, tl.load(V_NEW + src, mask=ok),
             mask=ok)


def paged_kv_append(k_cache, v_cache, block_table, cache_seqlens, k_new, v_new):
    """``k_new, v_new [B, Sn, Hkv, D]`` to positions ``cache_seqlens[b] + t`` of the paged caches, in place."""
    b, sn, hkv, d = k_new.shape
    k_new, v_new = _row_major(k_new), _row_major(v_new)
    block_table, cache_seqlens = block_table.contiguous(), cache_seqlens.contiguous()  # read by stepping one
    _append_kernel[(b * sn, hkv)](k_new, v_new, k_cache, v_cache, cache_seqlens, block_table, sn,
                                  *k_new.stride()[:3], *v_new.stride()[:3], *k_cache.stride()[:3],
                                  *v_cache.stride()[:3], block_table.stride(0), PAGE=k_cache.shape[1], D=d,
                                  BLOCK_D=triton.next_power_of_2(d))
