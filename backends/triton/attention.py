"""Flash attention (FlashAttention-2's algorithm): forward, backward, and a split-key decode.

Scores are kept in the log2 domain (``scale * log2(e)`` folded into one multiply) so the
online softmax uses ``exp2``. Causal masks are aligned to the bottom right: query ``i``
sees key ``j`` when ``j <= i + Skv - Sq``. Grouped-query attention indexes KV head
``h // group`` and never materialises repeated K/V; the dK/dV kernel walks the group's
query heads itself, so dK and dV are written once, without atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .interpreter import INTERPRETED

LOG2E = tl.constexpr(1.4426950408889634)  # kernels may read only constexpr globals
LN2 = tl.constexpr(0.6931471805599453)
HEAD_DIMS = (32, 64, 128, 256)


@triton.jit
def _tile(base, rows, row_stride, offs_d, n_rows):
    """A [rows, D] tile whose rows past ``n_rows`` read as zeros."""
    return tl.load(base + rows[:, None] * row_stride + offs_d[None, :], mask=rows[:, None] < n_rows, other=0.0)


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                H, GROUP, SQ, SKV, scale_log2, KEYS_PER_SPLIT,
                CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                UPCAST: tl.constexpr):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    split = tl.program_id(2)  # which range of keys, when decode splits them across programs
    b, h = bh // H, bh % H
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = _tile(Q + b * sq_b + h * sq_h, offs_m, sq_m, offs_d, SQ)
    k_base = K + b * sk_b + (h // GROUP) * sk_h
    v_base = V + b * sv_b + (h // GROUP) * sv_h
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    diagonal = SKV - SQ
    lo = split * KEYS_PER_SPLIT
    hi = tl.minimum(SKV, lo + KEYS_PER_SPLIT)
    if CAUSAL:  # keys past the block's last visible one never contribute
        hi = tl.minimum(hi, (start_m + 1) * BLOCK_M + diagonal)
    for start_n in tl.range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = tl.load(k_base + cols[None, :] * sk_n + offs_d[:, None], mask=cols[None, :] < SKV, other=0.0)
        v = _tile(v_base, cols, sv_n, offs_d, SKV)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, k) * scale_log2
        visible = cols[None, :] < SKV
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None] + diagonal)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    row = (split * tl.num_programs(1) + bh) * SQ  # outputs are [splits, B * H, SQ, ...]
    o_offs = (row + offs_m[:, None]) * D + offs_d[None, :]
    tl.store(O + o_offs, out.to(O.dtype.element_ty), mask=offs_m[:, None] < SQ)
    tl.store(LSE + row + offs_m, lse, mask=offs_m < SQ)


@triton.jit
def _scores(q, k, lse, rows, cols, SQ, SKV, scale_log2, CAUSAL: tl.constexpr):
    """Recomputed probabilities P of a (rows x cols) tile, zero where masked or where a row sees no key."""
    s = tl.dot(q, k) * scale_log2
    lse_log2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    p = tl.exp2(s - lse_log2[:, None])
    visible = (rows[:, None] < SQ) & (cols[None, :] < SKV)
    if CAUSAL:
        visible = visible & (cols[None, :] <= rows[:, None] + (SKV - SQ))
    return tl.where(visible, p, 0.0)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                     HKV, GROUP, SQ, SKV, scale, scale_log2,
                     CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     UPCAST: tl.constexpr):
    start_n = tl.program_id(0)
    bh = tl.program_id(1)
    b, hk = bh // HKV, bh % HKV
    cols = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    k = _tile(K + b * sk_b + hk * sk_h, cols, sk_n, offs_d, SKV)
    v = _tile(V + b * sv_b + hk * sv_h, cols, sv_n, offs_d, SKV)
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    lo = 0
    if CAUSAL:  # queries before this one cannot see the block's first key
        lo = tl.maximum(0, start_n * BLOCK_N - (SKV - SQ)) // BLOCK_M * BLOCK_M
    num_h = b * HKV * GROUP + hk * GROUP
    for g in range(0, GROUP):
        h = num_h + g  # flat (batch, query head) index
        q_base = Q + b * sq_b + (hk * GROUP + g) * sq_h
        for start_m in tl.range(lo, SQ, BLOCK_M):
            rows = start_m + offs_m
            q = _tile(q_base, rows, sq_m, offs_d, SQ)
            do = _tile(DO + h * SQ * D, rows, D, offs_d, SQ)
            lse = tl.load(LSE + h * SQ + rows, mask=rows < SQ, other=float("-inf"))
            delta = tl.load(DELTA + h * SQ + rows, mask=rows < SQ, other=0.0)
            if UPCAST:
                q, do = q.to(tl.float32), do.to(tl.float32)
            p = _scores(q, tl.trans(k), lse, rows, cols, SQ, SKV, scale_log2, CAUSAL)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do)
            dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    kv_offs = bh * SKV * D + cols[:, None] * D + offs_d[None, :]
    tl.store(DK + kv_offs, (dk * scale).to(DK.dtype.element_ty), mask=cols[:, None] < SKV)
    tl.store(DV + kv_offs, dv.to(DV.dtype.element_ty), mask=cols[:, None] < SKV)


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                   H, GROUP, SQ, SKV, scale, scale_log2,
                   CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   UPCAST: tl.constexpr):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = _tile(Q + b * sq_b + h * sq_h, rows, sq_m, offs_d, SQ)
    do = _tile(DO + bh * SQ * D, rows, D, offs_d, SQ)
    lse = tl.load(LSE + bh * SQ + rows, mask=rows < SQ, other=float("-inf"))
    delta = tl.load(DELTA + bh * SQ + rows, mask=rows < SQ, other=0.0)
    if UPCAST:
        q, do = q.to(tl.float32), do.to(tl.float32)
    k_base = K + b * sk_b + (h // GROUP) * sk_h
    v_base = V + b * sv_b + (h // GROUP) * sv_h
    dq = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    hi = SKV
    if CAUSAL:
        hi = tl.minimum(SKV, (start_m + 1) * BLOCK_M + SKV - SQ)
    for start_n in tl.range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        k = _tile(k_base, cols, sk_n, offs_d, SKV)
        v = _tile(v_base, cols, sv_n, offs_d, SKV)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        p = _scores(q, tl.trans(k), lse, rows, cols, SQ, SKV, scale_log2, CAUSAL)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    tl.store(DQ + bh * SQ * D + rows[:, None] * D + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=rows[:, None] < SQ)


def _blocks(d: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for head dim ``d``."""
    if INTERPRETED:
        return 32, 32, 4
    if d <= 64:
        return 128, 64, 4
    if d <= 128:
        return 128, 64, 8
    return 64, 32, 8


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
    return reasons


def _splits(b, h, sq, skv, block_m, block_n) -> int:
    """How many key ranges to split a forward into: decode (one query block) over a long cache
    leaves most of the GPU idle unless the keys are shared out too."""
    if sq > block_m:
        return 1
    programs = b * h
    target = 4 if INTERPRETED else 2 * torch.cuda.get_device_properties(0).multi_processor_count
    by_length = skv // (8 * block_n)  # keep each range at least 8 key blocks long
    return max(1, min(by_length, triton.cdiv(target, programs)))


def attention_fwd(q, k, v, *, causal, scale):
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    b, h, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    block_m, block_n, warps = _blocks(d)
    splits = _splits(b, h, sq, skv, block_m, block_n)
    keys_per_split = triton.cdiv(triton.cdiv(skv, splits), block_n) * block_n
    splits = triton.cdiv(skv, keys_per_split)
    # Split partial results stay in float32 until they are merged.
    out = torch.empty((splits, b, h, sq, d), dtype=q.dtype if splits == 1 else torch.float32, device=q.device)
    lse = torch.empty((splits, b, h, sq), dtype=torch.float32, device=q.device)
    _fwd_kernel[(triton.cdiv(sq, block_m), b * h, splits)](
        q, k, v, out, lse, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), h, h // hkv, sq, skv, scale * LOG2E.value, keys_per_split,
        CAUSAL=causal, D=d, BLOCK_M=block_m, BLOCK_N=block_n, UPCAST=_upcast(q.dtype), num_warps=warps)
    if splits == 1:
        return out[0], lse[0]
    # Merge: each range's output weighs exp(its lse - the total lse); a range that saw no key weighs 0.
    total = torch.logsumexp(lse, dim=0)
    weights = torch.nan_to_num(torch.exp(lse - total), nan=0.0)
    return (weights[..., None] * out).sum(0).to(q.dtype), total


def attention_bwd(q, k, v, out, lse, dout, *, causal, scale):
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    dout = dout.contiguous()
    b, h, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    delta = (dout.float() * out.float()).sum(-1)  # rowsum(dO * O), the softmax-gradient correction
    dq = torch.empty((b, h, sq, d), dtype=q.dtype, device=q.device)
    dk = torch.empty((b, hkv, skv, d), dtype=k.dtype, device=k.device)
    dv = torch.empty((b, hkv, skv, d), dtype=v.dtype, device=v.device)
    block_m, block_n, warps = _blocks(d)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2))
    common = dict(CAUSAL=causal, D=d, UPCAST=_upcast(q.dtype), num_warps=warps)
    # dK/dV tiles are keyed by keys: use the smaller block there, the larger over queries.
    _bwd_dkdv_kernel[(triton.cdiv(skv, block_n), b * hkv)](
        q, k, v, dout, lse, delta, dk, dv, *strides, hkv, h // hkv, sq, skv, scale, scale * LOG2E.value,
        BLOCK_M=block_n, BLOCK_N=block_n, **common)
    _bwd_dq_kernel[(triton.cdiv(sq, block_m), b * h)](
        q, k, v, dout, lse, delta, dq, *strides, h, h // hkv, sq, skv, scale, scale * LOG2E.value,
        BLOCK_M=block_m, BLOCK_N=block_n, **common)
    return dq, dk, dv
