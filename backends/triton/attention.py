"""Flash attention (FlashAttention-2's algorithm): forward, backward, and a split-key decode.

Scores are kept in the log2 domain (``scale * log2(e)`` folded into one multiply) so the
online softmax uses ``exp2``. Causal masks are aligned to the bottom right: query ``i``
sees key ``j`` when ``j <= i + Skv - Sq``. Grouped-query attention indexes KV head
``h // group`` and never materialises repeated K/V; the dK/dV kernel walks the group's
query heads itself, so dK and dV are written once, without atomics.

Every loop over tiles is cut into a range whose tiles need no mask at all (fully visible,
fully in bounds) and the few tiles that do (the causal diagonal, ragged tails): masking
every tile costs the forward ~15%.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .autotune import Tuner, bucket
from .interpreter import INTERPRETED

LOG2E = tl.constexpr(1.4426950408889634)  # kernels may read only constexpr globals
LN2 = tl.constexpr(0.6931471805599453)
HEAD_DIMS = (32, 64, 128, 256)


# ----------------------------------------------------------------------------- forward

@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, sk_n, sv_n, pos, offs_n, offs_d, lo, hi, SKV, diagonal,
               scale_log2, MASK: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr):
    for start_n in tl.range(lo, hi, offs_n.shape[0]):
        cols = start_n + offs_n
        if MASK:
            k = tl.load(k_base + cols[None, :] * sk_n + offs_d[:, None], mask=cols[None, :] < SKV, other=0.0)
            v = tl.load(v_base + cols[:, None] * sv_n + offs_d[None, :], mask=cols[:, None] < SKV, other=0.0)
        else:
            k = tl.load(k_base + cols[None, :] * sk_n + offs_d[:, None])
            v = tl.load(v_base + cols[:, None] * sv_n + offs_d[None, :])
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, k)
        if MASK:
            visible = cols[None, :] < SKV
            if CAUSAL:
                visible = visible & (cols[None, :] <= pos[:, None] + diagonal)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
            m_exp = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
            m_exp = m_new
        # scale_log2 > 0 (attention_supports), so max(s) * scale is the max of the scaled scores
        p = tl.exp2(s * scale_log2 - m_exp[:, None])
        alpha = tl.exp2(m_i - m_exp)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                H, GROUP, SQ, SKV, scale_log2, KEYS_PER_SPLIT,
                CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                UPCAST: tl.constexpr, PACK_GROUP: tl.constexpr):
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
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b.to(tl.int64) * sq_b + (h * sq_h + pos * sq_m)[:, None] + offs_d[None, :], mask=valid[:, None],
                other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + b.to(tl.int64) * sk_b + hk * sk_h
    v_base = V + b.to(tl.int64) * sv_b + hk * sv_h

    # m_i is already in the log2 domain (scaled); -inf until the row sees a key
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    diagonal = SKV - SQ
    lo = split * KEYS_PER_SPLIT
    hi = tl.minimum(SKV, lo + KEYS_PER_SPLIT)
    # keys [lo, full) are visible to every row of the block and in bounds: no mask needed
    full = SKV // BLOCK_N * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(hi, pos_hi + 1 + diagonal)
        full = tl.minimum(full, tl.maximum(pos_lo + diagonal + 1, 0) // BLOCK_N * BLOCK_N)
    full = tl.maximum(tl.minimum(full, hi), lo)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, sk_n, sv_n, pos, offs_n, offs_d, lo, full,
                               SKV, diagonal, scale_log2, False, CAUSAL, UPCAST)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, sk_n, sv_n, pos, offs_n, offs_d, full, hi,
                               SKV, diagonal, scale_log2, True, CAUSAL, UPCAST)
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    row = (split * n_bh + b * H + h).to(tl.int64) * SQ + pos  # outputs are [splits, B * H, SQ, ...]
    tl.store(O + row[:, None] * D + offs_d[None, :], out.to(O.dtype.element_ty), mask=valid[:, None])
    tl.store(LSE + row, lse, mask=valid)


@triton.jit
def _combine_kernel(O_PART, LSE_PART, O, LSE, SPLITS, ROWS, D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Merge split-key partial results of one query row: weights exp(lse_i - lse_total)."""
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    lse = tl.load(LSE_PART + splits * ROWS + row, mask=splits < SPLITS, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)
    total = tl.sum(w, axis=0)
    parts = tl.load(O_PART + (splits[:, None] * ROWS + row) * D + offs_d[None, :], mask=splits[:, None] < SPLITS,
                    other=0.0)
    out = tl.sum(parts * (w / tl.where(total > 0, total, 1.0))[:, None], axis=0)
    tl.store(O + row * D + offs_d, out.to(O.dtype.element_ty))
    tl.store(LSE + row, tl.where(total > 0, m_safe + tl.log(total), float("-inf")))


# ----------------------------------------------------------------------------- backward

@triton.jit
def _delta_kernel(O, DO, DELTA, ROWS, D: tl.constexpr, BLOCK: tl.constexpr):
    """rowsum(dO * O): the softmax-gradient correction, one float32 per query row."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs = rows.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    o = tl.load(O + offs, mask=rows[:, None] < ROWS, other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=rows[:, None] < ROWS, other=0.0).to(tl.float32)
    tl.store(DELTA + rows, tl.sum(o * do, axis=1), mask=rows < ROWS)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sq_m, cols, offs_m, offs_d, lo, hi,
                SQ, SKV, scale_log2, MASK: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr):
    # Works on transposed tiles (keys x queries) so P^T and dS^T come out of tl.dot in the
    # layout the dV and dK products want, with no register transposes.
    for start_m in tl.range(lo, hi, offs_m.shape[0]):
        rows = start_m + offs_m
        if MASK:
            q_t = tl.load(q_base + rows[None, :] * sq_m + offs_d[:, None], mask=rows[None, :] < SQ, other=0.0)
            do = tl.load(do_base + rows[:, None] * offs_d.shape[0] + offs_d[None, :], mask=rows[:, None] < SQ,
                         other=0.0)
        else:
            q_t = tl.load(q_base + rows[None, :] * sq_m + offs_d[:, None])
            do = tl.load(do_base + rows[:, None] * offs_d.shape[0] + offs_d[None, :])
        # rows past SQ and rows that see no key read lse = -inf: their P is 0
        lse = tl.load(lse_base + rows, mask=rows < SQ, other=float("-inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
        delta = tl.load(delta_base + rows, mask=rows < SQ, other=0.0)
        if UPCAST:
            q_t, do = q_t.to(tl.float32), do.to(tl.float32)
        p_t = tl.exp2(tl.dot(k, q_t) * scale_log2 - lse[None, :])
        if MASK:
            visible = cols[:, None] < SKV
            if CAUSAL:
                visible = visible & (cols[:, None] <= rows[None, :] + (SKV - SQ))
            p_t = tl.where(visible, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), dk)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                     HKV, GROUP, SQ, SKV, scale, scale_log2,
                     CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     UPCAST: tl.constexpr):
    start_n = tl.program_id(0)
    bh = tl.program_id(1)
    b, hk = bh // HKV, bh % HKV
    n0 = start_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    k = tl.load(K + b.to(tl.int64) * sk_b + hk * sk_h + cols[:, None] * sk_n + offs_d[None, :],
                mask=cols[:, None] < SKV, other=0.0)
    v = tl.load(V + b.to(tl.int64) * sv_b + hk * sv_h + cols[:, None] * sv_n + offs_d[None, :],
                mask=cols[:, None] < SKV, other=0.0)
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
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
        h = (b * HKV + hk) * GROUP + g  # flat (batch, query head) index
        q_base = Q + b.to(tl.int64) * sq_b + (hk * GROUP + g) * sq_h
        do_base = DO + h.to(tl.int64) * SQ * D
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, LSE + h * SQ, DELTA + h * SQ, sq_m, cols, offs_m,
                             offs_d, lo, full, SQ, SKV, scale_log2, True, CAUSAL, UPCAST)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, LSE + h * SQ, DELTA + h * SQ, sq_m, cols, offs_m,
                             offs_d, full, even, SQ, SKV, scale_log2, False, CAUSAL, UPCAST)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, LSE + h * SQ, DELTA + h * SQ, sq_m, cols, offs_m,
                             offs_d, even, SQ, SQ, SKV, scale_log2, True, CAUSAL, UPCAST)
    kv_offs = bh.to(tl.int64) * SKV * D + cols[:, None] * D + offs_d[None, :]
    tl.store(DK + kv_offs, (dk * scale).to(DK.dtype.element_ty), mask=cols[:, None] < SKV)
    tl.store(DV + kv_offs, dv.to(DV.dtype.element_ty), mask=cols[:, None] < SKV)


@triton.jit
def _dq_tiles(dq, q, do, lse, delta, k_base, v_base, sk_n, sv_n, rows, offs_n, offs_d, lo, hi, SQ, SKV,
              scale_log2, MASK: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr):
    for start_n in tl.range(lo, hi, offs_n.shape[0]):
        cols = start_n + offs_n
        if MASK:
            k_t = tl.load(k_base + cols[None, :] * sk_n + offs_d[:, None], mask=cols[None, :] < SKV, other=0.0)
            v_t = tl.load(v_base + cols[None, :] * sv_n + offs_d[:, None], mask=cols[None, :] < SKV, other=0.0)
        else:
            k_t = tl.load(k_base + cols[None, :] * sk_n + offs_d[:, None])
            v_t = tl.load(v_base + cols[None, :] * sv_n + offs_d[:, None])
        if UPCAST:
            k_t, v_t = k_t.to(tl.float32), v_t.to(tl.float32)
        p = tl.exp2(tl.dot(q, k_t) * scale_log2 - lse[:, None])
        if MASK:
            visible = cols[None, :] < SKV
            if CAUSAL:
                visible = visible & (cols[None, :] <= rows[:, None] + (SKV - SQ))
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, v_t)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k_t.dtype), tl.trans(k_t), dq)
    return dq


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                   H, GROUP, SQ, SKV, scale, scale_log2,
                   CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   UPCAST: tl.constexpr):
    start_m = tl.program_id(0)
    if CAUSAL:  # heaviest query blocks first, as in the forward
        start_m = tl.num_programs(0) - 1 - start_m
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b.to(tl.int64) * sq_b + h * sq_h + rows[:, None] * sq_m + offs_d[None, :],
                mask=rows[:, None] < SQ, other=0.0)
    do = tl.load(DO + bh.to(tl.int64) * SQ * D + rows[:, None] * D + offs_d[None, :], mask=rows[:, None] < SQ,
                 other=0.0)
    lse = tl.load(LSE + bh * SQ + rows, mask=rows < SQ, other=float("-inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)  # P = 0 on rows that see no key
    delta = tl.load(DELTA + bh * SQ + rows, mask=rows < SQ, other=0.0)
    if UPCAST:
        q, do = q.to(tl.float32), do.to(tl.float32)
    k_base = K + b.to(tl.int64) * sk_b + (h // GROUP) * sk_h
    v_base = V + b.to(tl.int64) * sv_b + (h // GROUP) * sv_h
    dq = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    hi = SKV
    full = SKV // BLOCK_N * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(SKV, (start_m + 1) * BLOCK_M + SKV - SQ)
        full = tl.minimum(full, tl.maximum(start_m * BLOCK_M + SKV - SQ + 1, 0) // BLOCK_N * BLOCK_N)
    full = tl.maximum(tl.minimum(full, hi), 0)
    dq = _dq_tiles(dq, q, do, lse, delta, k_base, v_base, sk_n, sv_n, rows, offs_n, offs_d, 0, full, SQ, SKV,
                   scale_log2, False, CAUSAL, UPCAST)
    dq = _dq_tiles(dq, q, do, lse, delta, k_base, v_base, sk_n, sv_n, rows, offs_n, offs_d, full, hi, SQ, SKV,
                   scale_log2, True, CAUSAL, UPCAST)
    tl.store(DQ + bh.to(tl.int64) * SQ * D + rows[:, None] * D + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=rows[:, None] < SQ)


# ----------------------------------------------------------------------------- tile choices

# (BLOCK_M, BLOCK_N, num_warps, num_stages) candidates per kernel and head dim, timed per shape
# bucket on first use (autotune.py). The first of each list is the best at D=128 / D=64, S=4096 in
# the H100 sweep (docs/performance.md); the others are the sweep's runners-up that give more
# programs on short sequences or fewer registers. Mutable, for the sweep (portable_ops.bench.sweep).
CONFIGS = {
    "fwd": {32: [(128, 64, 4, 3), (64, 64, 4, 3)],
            64: [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 4)],
            128: [(128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3)],
            256: [(64, 64, 8, 2), (64, 32, 4, 2)]},
    "dkdv": {32: [(32, 128, 4, 3), (32, 64, 4, 3)],
             64: [(32, 128, 4, 3), (64, 128, 8, 3), (32, 64, 4, 3)],
             128: [(64, 128, 8, 3), (32, 64, 4, 3), (64, 128, 8, 2)],
             256: [(32, 32, 4, 2)]},
    "dq": {32: [(128, 64, 8, 3), (64, 64, 4, 3)],
           64: [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3)],
           128: [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3)],
           256: [(64, 32, 8, 2), (32, 32, 4, 2)]},
}
_INTERPRETER_CONFIG = (32, 32, 4, 1)  # one small tile: every tile costs real time there
_DECODE_CONFIG = {False: (16, 64, 4, 3), True: (16, 32, 4, 3)}  # by d > 128: a tall query tile would be padding
_tuner = Tuner()


def _config(kernel: str, q, k, causal, launch) -> tuple:
    if INTERPRETED:
        return _INTERPRETER_CONFIG
    b, h, sq, d = q.shape
    if kernel == "fwd" and sq <= 16:
        return _DECODE_CONFIG[d > 128]
    key = (kernel, d, q.dtype, causal, bucket(sq), bucket(k.shape[2]), bucket(b * h), h // k.shape[1])
    return _tuner.pick(key, CONFIGS[kernel][d], launch)


def _upcast(dtype) -> bool:
    # The interpreter computes bf16 dot products wrongly (seen with triton 3.9): upcast there.
    return INTERPRETED and dtype == torch.bfloat16


def _last_dim_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def attention_supports(call) -> list[str]:
    q = call["q"]
    reasons = []
    if q.shape[-1] not in HEAD_DIMS:
        reasons.append(f"head_dim {q.shape[-1]} is not one of {', '.join(map(str, HEAD_DIMS))}")
    if q.dtype == torch.float64:
        reasons.append("float64 is not supported (fp16, bf16 and fp32 are)")
    if call.get("scale") is not None and call["scale"] < 0:
        reasons.append(f"scale {call['scale']} is negative (the kernels take the row maximum before scaling)")
    return reasons


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _splits(b, h, sq, skv, block_m, block_n, device=None) -> int:
    """How many key ranges to split a forward into: decode (one query block) over a long cache
    leaves most of the GPU idle unless the keys are shared out too."""
    if sq > block_m:
        return 1
    programs = b * h
    if INTERPRETED:
        target = 4
    else:
        target = 2 * _multiprocessors(device.index if device is not None and device.index is not None
                                      else torch.cuda.current_device())
    by_length = skv // (8 * block_n)  # keep each range at least 8 key blocks long
    return max(1, min(by_length, triton.cdiv(target, programs)))


def attention_fwd(q, k, v, *, causal, scale):
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    config = _config("fwd", q, k, causal, lambda c: _forward(q, k, v, causal, scale, c))
    return _forward(q, k, v, causal, scale, config)


def _forward(q, k, v, causal, scale, config):
    b, h, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    block_m, block_n, warps, stages = config
    group = h // hkv
    pack = group > 1 and group * sq <= block_m  # decode under GQA: the group's heads share one program
    heads, rows = (hkv, group * sq) if pack else (h, sq)
    splits = _splits(b, heads, rows, skv, block_m, block_n, q.device)
    keys_per_split = triton.cdiv(triton.cdiv(skv, splits), block_n) * block_n
    splits = triton.cdiv(skv, keys_per_split)
    # Split partial results stay in float32 until they are merged.
    out = torch.empty((splits, b, h, sq, d), dtype=q.dtype if splits == 1 else torch.float32, device=q.device)
    lse = torch.empty((splits, b, h, sq), dtype=torch.float32, device=q.device)
    _fwd_kernel[(triton.cdiv(rows, block_m), b * heads, splits)](
        q, k, v, out, lse, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), h, group, sq, skv, scale * LOG2E.value, keys_per_split,
        CAUSAL=causal, D=d, BLOCK_M=block_m, BLOCK_N=block_n, UPCAST=_upcast(q.dtype), PACK_GROUP=pack,
        num_warps=warps, num_stages=stages)
    if splits == 1:
        return out[0], lse[0]
    merged = torch.empty((b, h, sq, d), dtype=q.dtype, device=q.device)
    total = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    _combine_kernel[(b * h * sq,)](out, lse, merged, total, splits, b * h * sq, D=d,
                                   BLOCK_S=triton.next_power_of_2(splits), num_warps=4)
    return merged, total


def attention_bwd(q, k, v, out, lse, dout, *, causal, scale):
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    dout, out, lse = dout.contiguous(), out.contiguous(), lse.contiguous()
    b, h, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    delta = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    rows, block = b * h * sq, 64 if d <= 128 else 32
    _delta_kernel[(triton.cdiv(rows, block),)](out, dout, delta, rows, D=d, BLOCK=block)
    dq = torch.empty((b, h, sq, d), dtype=q.dtype, device=q.device)
    dk = torch.empty((b, hkv, skv, d), dtype=k.dtype, device=k.device)
    dv = torch.empty((b, hkv, skv, d), dtype=v.dtype, device=v.device)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2))
    common = dict(CAUSAL=causal, D=d, UPCAST=_upcast(q.dtype))

    def run_dkdv(config):
        block_m, block_n, warps, stages = config
        _bwd_dkdv_kernel[(triton.cdiv(skv, block_n), b * hkv)](
            q, k, v, dout, lse, delta, dk, dv, *strides, hkv, h // hkv, sq, skv, scale, scale * LOG2E.value,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **common)

    def run_dq(config):
        block_m, block_n, warps, stages = config
        _bwd_dq_kernel[(triton.cdiv(sq, block_m), b * h)](
            q, k, v, dout, lse, delta, dq, *strides, h, h // hkv, sq, skv, scale, scale * LOG2E.value,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **common)

    # Both kernels overwrite their outputs, so timing a candidate leaves nothing to undo.
    run_dkdv(_config("dkdv", q, k, causal, run_dkdv))
    run_dq(_config("dq", q, k, causal, run_dq))
    return dq, dk, dv
