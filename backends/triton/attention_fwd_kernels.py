"""The tl.* forward kernels (FlashAttention-2's algorithm): the forward, which also runs a decode split
into ranges of keys, the merge of those ranges, and the paged cache's append.

Scores are kept in the log2 domain (``scale * log2(e)`` folded into one multiply), so the online softmax
uses ``exp2``. Grouped-query attention reads KV head ``h // group`` and never materialises repeated K/V.
Q and K rows are ``D`` wide (column chunks ``D0``, ``D1``), V and O rows ``VD`` (``VD0``, ``VD1``): a value
head dim of its own (DeepSeek's MLA) is one more pair of chunks.
A sink (one logit per query head) joins each row's denominator once, where the row's sum is final: in the
forward when its keys are not split, else in the merge.
"""

import triton
import triton.language as tl

from .attention_tiles import LN2, LOG2E, dot_over_head, key_ranges, kv_rows, load_tile, logits, packed_sequence, \
    store_tile, unit_strides, visible
from .interpreter import to_dtype


@triton.jit
def _fwd_tiles(acc0, acc1, l_i, m_i, q0, q1, k_base, v_base, table, sk_page, sk_n, sv_page, sv_n, pos, offs_n, lo,
               hi, SKV, first_key, lo_off, hi_off, scale_log2, squash, cap_log2, D: tl.constexpr,
               D0: tl.constexpr, D1: tl.constexpr, VD: tl.constexpr, VD0: tl.constexpr, VD1: tl.constexpr,
               MASK: tl.constexpr, BOUND_LEFT: tl.constexpr,
               BOUND_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
               UPCAST: tl.constexpr, NEGATIVE_SCALE: tl.constexpr, PRECISION: tl.constexpr):
    for start_n in tl.range(lo, hi, offs_n.shape[0]):
        cols = start_n + offs_n
        in_bounds = cols < SKV
        readable = in_bounds
        if PAGED:  # pages before the window may be released: not even their page numbers are read
            readable = in_bounds & (cols >= first_key)
        k_rows, v_rows = kv_rows(cols, readable, table, sk_page, sk_n, sv_page, sv_n, PAGED, PAGE)
        k0, k1 = load_tile(k_base, k_rows, readable, D, D0, D1, MASK, True, UPCAST)
        s = dot_over_head(q0, q1, k0, k1, tl.zeros([q0.shape[0], offs_n.shape[0]], dtype=tl.float32), D1, PRECISION)
        if MASK or SOFTCAP:
            # scaled before masking: -inf times a zero scale would be NaN
            s = logits(s, scale_log2, squash, cap_log2, SOFTCAP)
            if MASK:
                s = tl.where(visible(pos[:, None], cols[None, :], in_bounds[None, :], lo_off, hi_off, BOUND_LEFT,
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
        v0, v1 = load_tile(v_base, v_rows, readable, VD, VD0, VD1, MASK, False, UPCAST)
        acc0 = tl.dot(p.to(v0.dtype), v0, acc0 * alpha[:, None], input_precision=PRECISION)
        if VD1 > 0:
            acc1 = tl.dot(p.to(v1.dtype), v1, acc1 * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc0, acc1, l_i, m_i


@triton.jit
def _with_sink(m_i, l_i, SINK, heads):
    """A row's running max and sum (log2 domain) with its head's sink joined, and the factor that takes its
    accumulator to the new max (0 for a row that saw no key). A sink of -inf is none."""
    sink = tl.load(SINK + heads) * LOG2E
    m_all = tl.maximum(m_i, sink)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    decay = tl.exp2(m_i - m_all)
    return m_all, l_i * decay + tl.exp2(sink - m_all), decay


@triton.jit(do_not_specialize=["PAIRS"])  # read only under FOLD: its value compiles no variant of its own
def fwd_kernel(Q, K, V, O, LSE, CU_Q, CU_K, CACHE_LENS, TABLE, SINK,
               sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_split, so_b, so_h, so_m,
               slse_split, slse_b, slse_h, stable_b, H, GROUP, SQ, SKV, LEFT, RIGHT, PAIRS,
               scale_log2, squash, cap_log2, KEYS_PER_SPLIT,
               BOUND_LEFT: tl.constexpr, BOUND_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr,
               PAGED: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
               VD: tl.constexpr, VD0: tl.constexpr, VD1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               UPCAST: tl.constexpr, PACK_GROUP: tl.constexpr, NEGATIVE_SCALE: tl.constexpr, UNIT: tl.constexpr,
               OFFSETS_64: tl.constexpr, PRECISION: tl.constexpr, FOLD: tl.constexpr, SINKS: tl.constexpr):
    """BLOCK_M query rows of one (batch, head) against one range of keys (``program_id(2)``: a decode
    splits its keys between programs). Under PACK_GROUP (decode under GQA) the rows are every query head
    of a KV head's group, head-major, so that each K/V tile is read once for the whole group. Packed
    sequences (VARLEN) start at rows ``q_start``, ``k_start`` of one [1, H, T, D] view whose batch strides
    are 0; a paged cache's batch strides are its pages'. Under FOLD the grid's (batch, head) pairs, ``PAIRS``
    of them, run over its second and third dims (``attention_plans.fold``), and keys are not split. Under
    SINKS each row's head's sink joins its denominator (never with split keys: the merge adds it)."""
    sq_b, sq_h, sq_m = unit_strides(sq_b, sq_h, sq_m, UNIT, OFFSETS_64)
    sk_b, sk_h, sk_n = unit_strides(sk_b, sk_h, sk_n, UNIT, OFFSETS_64)
    sv_b, sv_h, sv_n = unit_strides(sv_b, sv_h, sv_n, UNIT, OFFSETS_64)
    so_b, so_h, so_m = unit_strides(so_b, so_h, so_m, UNIT, OFFSETS_64)
    so_split = tl.cast(so_split, tl.int64) * UNIT
    start_m = tl.program_id(0)
    if BOUND_RIGHT:  # the last query blocks see the most keys: start them first, so the tail of the grid is light
        start_m = tl.num_programs(0) - 1 - start_m
    split = tl.program_id(2)  # which range of keys, when decode splits them across programs
    pair = tl.program_id(1)
    if FOLD:
        pair += split * tl.num_programs(1)
        split = split * 0  # a tensor still: it is stepped in int64 below
        if pair >= PAIRS:  # the last fold's tail
            return
    r = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if PACK_GROUP:
        b, hk = pair // (H // GROUP), pair % (H // GROUP)
    else:
        b, h = pair // H, pair % H
        hk = h // GROUP
    q_base = Q + b * sq_b
    k_base = K + b * sk_b + hk * sk_h
    v_base = V + b * sv_b + hk * sv_h
    o_base = O + split * so_split + b * so_b
    lse_base = LSE + split.to(tl.int64) * slse_split + b.to(tl.int64) * slse_b
    if VARLEN:
        q_start, SQ, k_start, SKV = packed_sequence(CU_Q, CU_K, b)
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
    q0, q1 = load_tile(q_base, h * sq_h + pos * sq_m, valid, D, D0, D1, True, False, UPCAST)

    # m_i is already in the log2 domain (scaled); -inf until the row sees a key
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_M, VD0], dtype=tl.float32)
    acc1 = acc0  # stands in for the second chunk's accumulator when there is none
    if VD1 > 0:
        acc1 = tl.zeros([BLOCK_M, VD1], dtype=tl.float32)
    lo_off = SKV - SQ - LEFT
    hi_off = SKV - SQ + RIGHT
    lo = split * KEYS_PER_SPLIT
    lo, full_lo, full_hi, hi = key_ranges(pos_lo, pos_hi, lo, tl.minimum(SKV, lo + KEYS_PER_SPLIT), SKV, lo_off,
                                          hi_off, BLOCK_N, BOUND_LEFT, BOUND_RIGHT)
    first_key = 0
    if BOUND_LEFT:
        first_key = tl.maximum(pos_lo + lo_off, 0)
    table = TABLE + b.to(tl.int64) * stable_b
    for part in tl.static_range(3):  # masked, whole, masked
        acc0, acc1, l_i, m_i = _fwd_tiles(acc0, acc1, l_i, m_i, q0, q1, k_base, v_base, table, sk_b, sk_n, sv_b,
                                          sv_n, pos, offs_n, (lo, full_lo, full_hi)[part],
                                          (full_lo, full_hi, hi)[part], SKV, first_key, lo_off, hi_off, scale_log2,
                                          squash, cap_log2, D, D0, D1, VD, VD0, VD1, part != 1, BOUND_LEFT,
                                          BOUND_RIGHT, SOFTCAP, PAGED, PAGE, UPCAST, NEGATIVE_SCALE, PRECISION)
    decay = 1.0
    if SINKS:
        m_i, l_i, decay = _with_sink(m_i, l_i, SINK, tl.where(valid, h, 0))
    seen = l_i > 0
    norm = decay / tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    store_tile(o_base, h * so_h + pos * so_m, valid, acc0 * norm[:, None], acc1 * norm[:, None], VD, VD1)
    tl.store(lse_base + h.to(tl.int64) * slse_h + pos, lse, mask=valid)


@triton.jit
def combine_kernel(O_PART, LSE_PART, O, LSE, SINK, SPLITS, H, SQ, so_b, so_h, so_m,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, SINKS: tl.constexpr):
    """Merge split-key partial results of one query row: weights exp(lse_i - lse_total), the row's head's sink
    one more term of lse_total under SINKS. Partials are [splits, B * H * SQ, D] float32; the output is written
    through its strides."""
    row = tl.program_id(0).to(tl.int64)
    rows = tl.num_programs(0)
    b, h, pos = row // (H * SQ), row // SQ % H, row % SQ
    splits = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    lse = tl.load(LSE_PART + splits * rows + row, mask=splits < SPLITS, other=float("-inf"))
    m = tl.max(lse, axis=0)
    if SINKS:
        sink = tl.load(SINK + h)
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)
    total = tl.sum(w, axis=0)
    if SINKS:
        total += tl.exp(sink - m_safe)
    parts = tl.load(O_PART + (splits[:, None] * rows + row) * D + offs_d[None, :],
                    mask=(splits[:, None] < SPLITS) & (offs_d[None, :] < D), other=0.0)
    out = tl.sum(parts * (w / tl.where(total > 0, total, 1.0))[:, None], axis=0)
    tl.store(O + b * so_b + h * so_h + pos * so_m + offs_d, to_dtype(out, O.dtype.element_ty), mask=offs_d < D)
    tl.store(LSE + row, tl.where(total > 0, m_safe + tl.log(total), float("-inf")))


@triton.jit(do_not_specialize=["HKV"])  # read only under FOLD
def append_kernel(K_NEW, V_NEW, K_CACHE, V_CACHE, CACHE_LENS, TABLE, SN, skn_b, skn_t, skn_h, svn_b, svn_t,
                  svn_h, skc_p, skc_s, skc_h, svc_p, svc_s, svc_h, stable_b, HKV,
                  PAGE: tl.constexpr, D: tl.constexpr, VD: tl.constexpr, BLOCK_D: tl.constexpr, FOLD: tl.constexpr):
    """Token ``t`` of sequence ``b`` (program ``b * SN + t``), one KV head: to its slot in the cache (keys ``D``
    wide, values ``VD``; ``BLOCK_D`` covers both). Under FOLD the ``HKV`` heads run over the grid's second and
    third dims."""
    # indices in int64: an offset into k_new, v_new or a cache may pass 2^31 elements (one multiply each a program)
    token = tl.program_id(0).to(tl.int64)
    b, t = token // SN, token % SN
    heads = tl.program_id(1).to(tl.int64)
    if FOLD:
        heads += tl.program_id(2).to(tl.int64) * tl.num_programs(1)
        if heads >= HKV:
            return
    pos = tl.load(CACHE_LENS + b) + t
    page = tl.load(TABLE + b * stable_b + pos // PAGE).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    ok = cols < D
    src = b * skn_b + t * skn_t + heads * skn_h + cols
    tl.store(K_CACHE + page * skc_p + (pos % PAGE) * skc_s + heads * skc_h + cols, tl.load(K_NEW + src, mask=ok),
             mask=ok)
    ok = cols < VD
    src = b * svn_b + t * svn_t + heads * svn_h + cols
    tl.store(V_CACHE + page * svc_p + (pos % PAGE) * svc_s + heads * svc_h + cols, tl.load(V_NEW + src, mask=ok),
             mask=ok)
