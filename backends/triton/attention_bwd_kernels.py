"""The tl.* backward kernels: delta (the softmax gradient's row correction), then dK/dV and dQ in
kernels of their own, each over the tiles its block of keys or of queries meets, so that every
gradient is written once, without atomics. The dK/dV kernel walks the query heads of its KV head's
group itself (grouped-query attention). Q, K, dQ and dK rows are ``D`` wide (``D0``, ``D1``), V, dO, dV rows
``VD`` (``VD0``, ``VD1``).
"""

import triton
import triton.language as tl

from .attention_tiles import LOG2E, dot_over_head, key_ranges, load_tile, packed_sequence, probabilities, \
    query_ranges, store_tile, unit_strides, visible


@triton.jit(do_not_specialize=["PAIRS"])  # read only under FOLD: its value compiles no variant of its own
def delta_kernel(O, DO, DLSE, DELTA, DQ_SUM, so_b, so_h, so_m, sdo_b, sdo_h, sdo_m, H, SQ, PAIRS,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, ZERO_DQ: tl.constexpr,
                 OFFSETS_64: tl.constexpr, FOLD: tl.constexpr, LSE_GRADIENT: tl.constexpr):
    """rowsum(dO * O): the softmax-gradient correction, one float32 per query row; under LSE_GRADIENT less the
    gradient that reached the row's lse (``DLSE``, laid out as DELTA: d lse / d s = P). With ``ZERO_DQ``, the
    same rows of the float32 dQ [B, H, SQ, D] that the Hopper backward adds into are zeroed here: one
    launch fewer than a fill of their own, and its host time."""
    if OFFSETS_64:  # attention_plans.offsets_64 says when
        so_h, so_m = tl.cast(so_h, tl.int64), tl.cast(so_m, tl.int64)
        sdo_h, sdo_m = tl.cast(sdo_h, tl.int64), tl.cast(sdo_m, tl.int64)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bh = tl.program_id(1)
    if FOLD:  # the (batch, head) pairs over the grid's second and third dims, as in the forward
        bh += tl.program_id(2) * tl.num_programs(1)
        if bh >= PAIRS:
            return
    b, h = bh // H, bh % H
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < SQ) & (cols[None, :] < D)
    o = tl.load(O + b.to(tl.int64) * so_b + h * so_h + rows[:, None] * so_m + cols[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b.to(tl.int64) * sdo_b + h * sdo_h + rows[:, None] * sdo_m + cols[None, :], mask=mask,
                 other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if LSE_GRADIENT:
        delta -= tl.load(DLSE + bh.to(tl.int64) * SQ + rows, mask=rows < SQ, other=0.0)
    tl.store(DELTA + bh.to(tl.int64) * SQ + rows, delta, mask=rows < SQ)
    if ZERO_DQ:
        tl.store(DQ_SUM + (bh.to(tl.int64) * SQ + rows[:, None]) * D + cols[None, :],
                 tl.zeros([BLOCK, BLOCK_D], tl.float32), mask=mask)


@triton.jit
def _dkdv_tiles(dk0, dk1, dv0, dv1, k0, k1, v0, v1, q_base, do_base, lse_base, delta_base, sq_m, sdo_m, cols,
                offs_m, lo, hi, SQ, SKV, lo_off, hi_off, scale_log2, squash, cap_log2, D: tl.constexpr,
                D0: tl.constexpr, D1: tl.constexpr, VD: tl.constexpr, VD0: tl.constexpr, VD1: tl.constexpr,
                MASK: tl.constexpr, BOUND_LEFT: tl.constexpr, BOUND_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Query tiles ``[lo, hi)`` against this program's keys, on transposed tiles (keys x queries): P^T and
    dS^T come out of tl.dot in the layout the dV and dK products want, with no register transposes."""
    for start_m in tl.range(lo, hi, offs_m.shape[0]):
        rows = start_m + offs_m
        in_bounds = rows < SQ
        q0_t, q1_t = load_tile(q_base, rows * sq_m, in_bounds, D, D0, D1, MASK, True, UPCAST)
        do0, do1 = load_tile(do_base, rows * sdo_m, in_bounds, VD, VD0, VD1, MASK, False, UPCAST)
        # rows past SQ and rows that see no key read lse = -inf: their P is 0
        lse = tl.load(lse_base + rows, mask=in_bounds, other=float("-inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
        delta = tl.load(delta_base + rows, mask=in_bounds, other=0.0)
        zeros = tl.zeros([cols.shape[0], offs_m.shape[0]], dtype=tl.float32)
        p_t, slope = probabilities(dot_over_head(k0, k1, q0_t, q1_t, zeros, D1, PRECISION), lse[None, :],
                                   scale_log2, squash, cap_log2, SOFTCAP)
        if MASK:
            p_t = tl.where(visible(rows[None, :], cols[:, None], cols[:, None] < SKV, lo_off, hi_off, BOUND_LEFT,
                                   BOUND_RIGHT), p_t, 0.0)
        dv0 = tl.dot(p_t.to(do0.dtype), do0, dv0, input_precision=PRECISION)
        if VD1 > 0:
            dv1 = tl.dot(p_t.to(do1.dtype), do1, dv1, input_precision=PRECISION)
        dp_t = dot_over_head(v0, v1, tl.trans(do0), tl.trans(do1), zeros, VD1, PRECISION)
        ds_t = p_t * (dp_t - delta[None, :]) * slope
        dk0 = tl.dot(ds_t.to(q0_t.dtype), tl.trans(q0_t), dk0, input_precision=PRECISION)
        if D1 > 0:
            dk1 = tl.dot(ds_t.to(q1_t.dtype), tl.trans(q1_t), dk1, input_precision=PRECISION)
    return dk0, dk1, dv0, dv1


@triton.jit(do_not_specialize=["PAIRS"])  # read only under FOLD
def dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K, sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h,
                sv_n, sdo_b, sdo_h, sdo_m, sdk_b, sdk_h, sdk_n, sdv_b, sdv_h, sdv_n, slse_b, slse_h,
                HKV, GROUP, SQ, SKV, LEFT, RIGHT, PAIRS, scale, scale_log2, squash, cap_log2,
                BOUND_LEFT: tl.constexpr, BOUND_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr,
                D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, VD: tl.constexpr, VD0: tl.constexpr,
                VD1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
                UNIT: tl.constexpr, OFFSETS_64: tl.constexpr, PRECISION: tl.constexpr, FOLD: tl.constexpr):
    sq_b, sq_h, sq_m = unit_strides(sq_b, sq_h, sq_m, UNIT, OFFSETS_64)
    sk_b, sk_h, sk_n = unit_strides(sk_b, sk_h, sk_n, UNIT, OFFSETS_64)
    sv_b, sv_h, sv_n = unit_strides(sv_b, sv_h, sv_n, UNIT, OFFSETS_64)
    sdo_b, sdo_h, sdo_m = unit_strides(sdo_b, sdo_h, sdo_m, UNIT, OFFSETS_64)
    sdk_b, sdk_h, sdk_n = unit_strides(sdk_b, sdk_h, sdk_n, UNIT, OFFSETS_64)
    sdv_b, sdv_h, sdv_n = unit_strides(sdv_b, sdv_h, sdv_n, UNIT, OFFSETS_64)
    start_n = tl.program_id(0)
    bh = tl.program_id(1)
    if FOLD:  # as in the forward
        bh += tl.program_id(2) * tl.num_programs(1)
        if bh >= PAIRS:
            return
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
        q_start, SQ, k_start, SKV = packed_sequence(CU_Q, CU_K, b)
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
    k0, k1 = load_tile(K + k_off + hk * sk_h, cols * sk_n, in_bounds, D, D0, D1, True, False, UPCAST)
    v0, v1 = load_tile(V + v_off + hk * sv_h, cols * sv_n, in_bounds, VD, VD0, VD1, True, False, UPCAST)
    dk0 = tl.zeros([BLOCK_N, D0], dtype=tl.float32)
    dv0 = tl.zeros([BLOCK_N, VD0], dtype=tl.float32)
    dk1, dv1 = dk0, dv0  # stand in for the second chunks' accumulators when there are none
    if D1 > 0:
        dk1 = tl.zeros([BLOCK_N, D1], dtype=tl.float32)
    if VD1 > 0:
        dv1 = tl.zeros([BLOCK_N, VD1], dtype=tl.float32)
    lo_off = SKV - SQ - LEFT
    hi_off = SKV - SQ + RIGHT
    lo, full_lo, full_hi, hi = query_ranges(n0, SQ, SKV, lo_off, hi_off, BLOCK_M, BLOCK_N, BOUND_LEFT, BOUND_RIGHT)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_base = Q + q_off + h * sq_h
        do_base = DO + do_off + h * sdo_h
        row0 = lse_off + h.to(tl.int64) * slse_h  # lse and delta share one layout
        for part in tl.static_range(3):  # masked, whole, masked
            dk0, dk1, dv0, dv1 = _dkdv_tiles(dk0, dk1, dv0, dv1, k0, k1, v0, v1, q_base, do_base, LSE + row0,
                                             DELTA + row0, sq_m, sdo_m, cols, offs_m, (lo, full_lo, full_hi)[part],
                                             (full_lo, full_hi, hi)[part], SQ, SKV, lo_off, hi_off, scale_log2, squash,
                                             cap_log2, D, D0, D1, VD, VD0, VD1, part != 1, BOUND_LEFT, BOUND_RIGHT,
                                             SOFTCAP, UPCAST, PRECISION)
    store_tile(DK + dk_off + hk * sdk_h, cols * sdk_n, in_bounds, dk0 * scale, dk1 * scale, D, D1)
    store_tile(DV + dv_off + hk * sdv_h, cols * sdv_n, in_bounds, dv0, dv1, VD, VD1)


@triton.jit
def _dq_tiles(dq0, dq1, q0, q1, do0, do1, lse, delta, k_base, v_base, sk_n, sv_n, rows, offs_n, lo, hi, SKV,
              lo_off, hi_off, scale_log2, squash, cap_log2, D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
              VD: tl.constexpr, VD0: tl.constexpr, VD1: tl.constexpr, MASK: tl.constexpr, BOUND_LEFT: tl.constexpr,
              BOUND_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    for start_n in tl.range(lo, hi, offs_n.shape[0]):
        cols = start_n + offs_n
        in_bounds = cols < SKV
        k0_t, k1_t = load_tile(k_base, cols * sk_n, in_bounds, D, D0, D1, MASK, True, UPCAST)
        v0_t, v1_t = load_tile(v_base, cols * sv_n, in_bounds, VD, VD0, VD1, MASK, True, UPCAST)
        zeros = tl.zeros([rows.shape[0], offs_n.shape[0]], dtype=tl.float32)
        p, slope = probabilities(dot_over_head(q0, q1, k0_t, k1_t, zeros, D1, PRECISION), lse[:, None], scale_log2,
                                 squash, cap_log2, SOFTCAP)
        if MASK:
            p = tl.where(visible(rows[:, None], cols[None, :], in_bounds[None, :], lo_off, hi_off, BOUND_LEFT,
                                 BOUND_RIGHT), p, 0.0)
        dp = dot_over_head(do0, do1, v0_t, v1_t, zeros, VD1, PRECISION)
        ds = p * (dp - delta[:, None]) * slope
        dq0 = tl.dot(ds.to(k0_t.dtype), tl.trans(k0_t), dq0, input_precision=PRECISION)
        if D1 > 0:
            dq1 = tl.dot(ds.to(k1_t.dtype), tl.trans(k1_t), dq1, input_precision=PRECISION)
    return dq0, dq1


@triton.jit(do_not_specialize=["PAIRS"])  # read only under FOLD
def dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K, sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
              sdo_b, sdo_h, sdo_m, sdq_b, sdq_h, sdq_m, slse_b, slse_h, H, GROUP, SQ, SKV, LEFT, RIGHT, PAIRS, scale,
              scale_log2, squash, cap_log2,
              BOUND_LEFT: tl.constexpr, BOUND_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr,
              D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, VD: tl.constexpr, VD0: tl.constexpr,
              VD1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
              UNIT: tl.constexpr, OFFSETS_64: tl.constexpr, PRECISION: tl.constexpr, FOLD: tl.constexpr):
    sq_b, sq_h, sq_m = unit_strides(sq_b, sq_h, sq_m, UNIT, OFFSETS_64)
    sk_b, sk_h, sk_n = unit_strides(sk_b, sk_h, sk_n, UNIT, OFFSETS_64)
    sv_b, sv_h, sv_n = unit_strides(sv_b, sv_h, sv_n, UNIT, OFFSETS_64)
    sdo_b, sdo_h, sdo_m = unit_strides(sdo_b, sdo_h, sdo_m, UNIT, OFFSETS_64)
    sdq_b, sdq_h, sdq_m = unit_strides(sdq_b, sdq_h, sdq_m, UNIT, OFFSETS_64)
    start_m = tl.program_id(0)
    if BOUND_RIGHT:  # heaviest query blocks first, as in the forward
        start_m = tl.num_programs(0) - 1 - start_m
    bh = tl.program_id(1)
    if FOLD:  # as in the forward
        bh += tl.program_id(2) * tl.num_programs(1)
        if bh >= PAIRS:
            return
    b, h = bh // H, bh % H
    q_off = b * sq_b
    do_off = b * sdo_b
    dq_off = b * sdq_b
    k_off = b * sk_b
    v_off = b * sv_b
    lse_off = b.to(tl.int64) * slse_b
    if VARLEN:  # as in the forward
        q_start, SQ, k_start, SKV = packed_sequence(CU_Q, CU_K, b)
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
    q0, q1 = load_tile(Q + q_off + h * sq_h, rows * sq_m, in_bounds, D, D0, D1, True, False, UPCAST)
    do0, do1 = load_tile(DO + do_off + h * sdo_h, rows * sdo_m, in_bounds, VD, VD0, VD1, True, False, UPCAST)
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
    lo, full_lo, full_hi, hi = key_ranges(pos_lo, tl.minimum(pos_lo + BLOCK_M, SQ) - 1, 0, SKV, SKV, lo_off, hi_off,
                                          BLOCK_N, BOUND_LEFT, BOUND_RIGHT)
    for part in tl.static_range(3):  # masked, whole, masked
        dq0, dq1 = _dq_tiles(dq0, dq1, q0, q1, do0, do1, lse, delta, k_base, v_base, sk_n, sv_n, rows, offs_n,
                             (lo, full_lo, full_hi)[part], (full_lo, full_hi, hi)[part], SKV, lo_off, hi_off,
                             scale_log2, squash, cap_log2, D, D0, D1, VD, VD0, VD1, part != 1, BOUND_LEFT,
                             BOUND_RIGHT, SOFTCAP, UPCAST, PRECISION)
    store_tile(DQ + dq_off + h * sdq_h, rows * sdq_m, in_bounds, dq0 * scale, dq1 * scale, D, D1)
