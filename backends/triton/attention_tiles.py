"""The @triton.jit helpers the tl.* attention kernels share: tiles of a row split in two column chunks,
the bands of keys a mask leaves visible, the softcap, and where a key or a packed sequence lies.

A row of Q, K, V or O is covered by two power-of-two column chunks, ``D0`` and ``D1``
(``attention_configs.head_split``; ``D1 = 0`` when one chunk does, and then the second chunk's code is
not compiled): products over the head dim (Q K^T, dO V^T) are two dots summed into one accumulator, and
products into it (P V, dS K, ...) keep one accumulator per chunk. Columns past the head dim load as zeros
and are never stored.

Every mask is a band around the diagonal: query row ``i`` sits at key position ``i + SKV - SQ`` and sees
keys from ``lo_off`` to ``hi_off`` past its row, bounded on a side only under BOUND_LEFT / BOUND_RIGHT
(causal is ``hi_off = SKV - SQ``). A loop over tiles runs in three ranges: tiles that some rows see only
partly (masked), tiles every row sees in full (no mask), then partly seen tiles again. Tiles no row sees
are never visited, so a sliding window costs time in proportion to its width, not to the sequence.
"""

import triton
import triton.language as tl

from .interpreter import to_dtype

LOG2E = tl.constexpr(1.4426950408889634)  # kernels may read only constexpr globals
LN2 = tl.constexpr(0.6931471805599453)


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
def load_tile(base, row_offs, row_ok, D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
              MASK_ROWS: tl.constexpr, TRANSPOSE: tl.constexpr, UPCAST: tl.constexpr):
    """Both column chunks of a tile; the second is the first again (unused) when D1 == 0."""
    first = _load(base, row_offs, row_ok, 0, D0, D, MASK_ROWS, TRANSPOSE, UPCAST)
    second = first
    if D1 > 0:
        second = _load(base, row_offs, row_ok, D0, D1, D, MASK_ROWS, TRANSPOSE, UPCAST)
    return first, second


@triton.jit
def dot_over_head(a0, a1, b0, b1, acc, D1: tl.constexpr, PRECISION: tl.constexpr):
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
def store_tile(base, row_offs, row_ok, first, second, D: tl.constexpr, D1: tl.constexpr):
    _store(base, row_offs, row_ok, first, 0, D)
    if D1 > 0:
        _store(base, row_offs, row_ok, second, first.shape[1], D)


@triton.jit
def visible(pos, cols, in_bounds, lo_off, hi_off, BOUND_LEFT: tl.constexpr, BOUND_RIGHT: tl.constexpr):
    """Which (row at key position ``pos``, key ``cols``) pairs are seen; broadcasting operands."""
    seen = in_bounds
    if BOUND_RIGHT:
        seen = seen & (cols <= pos + hi_off)
    if BOUND_LEFT:
        seen = seen & (cols >= pos + lo_off)
    return seen


@triton.jit
def key_ranges(pos_lo, pos_hi, lo, hi, SKV, lo_off, hi_off, BLOCK_N: tl.constexpr, BOUND_LEFT: tl.constexpr,
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
def query_ranges(n0, SQ, SKV, lo_off, hi_off, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BOUND_LEFT: tl.constexpr, BOUND_RIGHT: tl.constexpr):
    """The transpose of :func:`key_ranges` for keys ``n0..n0 + BLOCK_N - 1``: ``(lo, full_lo, full_hi,
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
def tanh(x):
    """tanh from exp2 (one MUFU op): libdevice's tanh is not in every Triton's interpreter. Near 0, where
    1 - 2 / (e^2x + 1) cancels (a large cap makes every x small), its series, exact to float32 there."""
    x2 = x * x
    series = x * (1.0 - x2 * (1.0 / 3.0 - x2 * (2.0 / 15.0)))
    return tl.where(x2 < 0.015625, series, 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0))


@triton.jit
def logits(s, scale_log2, squash, cap_log2, SOFTCAP: tl.constexpr):
    """Scores ``q . k`` -> scaled (and soft-capped: ``cap * tanh(scale * s / cap)``) scores, in the log2 domain."""
    if SOFTCAP:
        s = tanh(s * squash) * cap_log2
    else:
        s = s * scale_log2
    return s


@triton.jit
def probabilities(s, lse_log2, scale_log2, squash, cap_log2, SOFTCAP: tl.constexpr):
    """``(P, slope)`` from scores and the rows' log2-domain lse (broadcast): the probabilities, and
    d(capped score) / d(scaled score), which the score gradient takes (1 without a softcap)."""
    # one return statement: a compiled function's returns must agree in type, constexpr branches included
    if SOFTCAP:
        t = tanh(s * squash)
        p = tl.exp2(t * cap_log2 - lse_log2)
        slope = 1.0 - t * t
    else:
        p = tl.exp2(s * scale_log2 - lse_log2)
        slope = 1.0
    return p, slope


@triton.jit
def kv_rows(cols, readable, table, sk_page, sk_n, sv_page, sv_n, PAGED: tl.constexpr, PAGE: tl.constexpr):
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
def packed_sequence(CU_Q, CU_K, b):
    """``(q_start, SQ, k_start, SKV)`` of packed sequence ``b``: where its rows start, and how many."""
    q_start = tl.load(CU_Q + b)
    k_start = tl.load(CU_K + b)
    return q_start, tl.load(CU_Q + b + 1) - q_start, k_start, tl.load(CU_K + b + 1) - k_start


@triton.jit
def unit_strides(batch, head, row, UNIT: tl.constexpr, OFFSETS_64: tl.constexpr):
    """A tensor's (batch, head, row) strides multiplied back by UNIT (``attention_plans.stride_unit``): the
    batch's in int64, as a batch's offset may pass 2^31 elements, and the others too under OFFSETS_64
    (``attention_plans.offsets_64``)."""
    batch = tl.cast(batch, tl.int64) * UNIT
    if OFFSETS_64:
        head = tl.cast(head, tl.int64)
        row = tl.cast(row, tl.int64)
    return batch, head * UNIT, row * UNIT
