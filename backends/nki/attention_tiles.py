"""What the NKI attention kernels (``attention_forward.py``, ``attention_backward.py``) share: the tile sizes, the
band mask and the key blocks it leaves, head dims split over the partitions, DMA and Tensor Engine transposes,
the softcap's factors, a query head's sink column and the PSUM rings.

Layout: a query tile holds up to 128 rows on the partitions. V (and O, dO) may have a head dim of their own,
``Dv`` (DeepSeek's MLA): Q and K's ``D`` is contracted in ``S`` and dQ, dK; ``Dv`` in ``dP = dO V^T``, and it is
P V's free size. A head dim over 128 is split into chunks of at most 128 partitions (``[128, n_chunks, rows]``
tiles) whose matmuls accumulate into one PSUM tile; where it is a free size it needs no split up to 512 fp32.

Masks are one band: query ``i`` sits at key position ``p = i + Skv - Sq`` and sees key ``j`` iff
``p - left <= j <= p + right`` (either side None: unbounded), where ``causal`` makes ``right`` at most 0 and
``window=(left, right)`` gives the sides (``visible`` in the reference). Keys wholly outside the band of a query
tile are skipped at trace time, 128 at a time, so a window of W keys costs O(W) per query, not O(Skv); only
128-key blocks that a band edge crosses get a GpSimd ``affine_select`` (one per edge): on the scores in the
forward, on P in the backward. A softcap replaces each scaled score ``s`` by ``softcap * tanh(s / softcap)``
before the mask: the Scalar Engine's ``tanh`` as the scores leave PSUM (the backward's ``1 - tanh^2`` from it).

Sinks (one logit per query head): the host hands each head's sink down the partitions (``[Hq, 128, 1]``), so a
query tile loads its column in one DMA.
"""
from __future__ import annotations

import math

from .compat import nisa, nl

B_Q = 128  # query rows per tile (partition axis)
B_K = 128  # keys per block (P^T needs the keys on <= 128 partitions)
NEG = -1.0e30  # finite "minus infinity" for masked scores: exp(NEG - m) == 0, no inf - inf
FLOAT32_MAX, FLOAT32_TINY = 3.4028234663852886e38, 2.0 ** -126  # float32's largest and smallest normal
PMAX = 128  # partitions: the most a matmul contracts over, and a transpose's largest side
SCORE_KEYS = 512  # keys per forward score tile: one PSUM bank of fp32, a matmul's largest moving free size


def partition_chunks(n):
    """``(index, start, size)`` of the pieces of at most 128 that a dimension of ``n`` splits into."""
    return [(c, c0, min(PMAX, n - c0)) for c, c0 in enumerate(range(0, n, PMAX))]


def _matmul_chunked(dst, stationary, moving, contraction):
    """``dst = stationary^T moving`` over a contraction that may exceed the 128 partitions: both
    operands are in :func:`_transposed_rows`' layout, and the chunk matmuls accumulate into the
    one PSUM tile ``dst``."""
    for c, _, size in partition_chunks(contraction):
        nisa.nc_matmul(dst, stationary[0:size, c, :], moving[0:size, c, :], accumulate=c > 0)


def _load(src, rows, cols, dtype):
    tile = nl.ndarray((rows, cols), dtype=dtype, buffer=nl.sbuf)
    nisa.dma_copy(tile, src)
    return tile


def _band(causal, window_left, window_right):
    """``(left, right)``: the query at position ``p`` sees keys ``p - left .. p + right`` (None: that
    side unbounded). ``causal`` is the right side at most 0, so it and a window are one mask."""
    right = window_right
    if causal:
        right = 0 if right is None else min(right, 0)
    return window_left, right


def _key_blocks(q0, bq, shift, Skv, left, right):
    """``(first, stop)``: the key blocks some row of the query tile ``[q0, q0 + bq)`` can see. Row
    bands slide by one key per row and each holds at least one position (``left, right >= 0`` or
    None), so the tile sees one contiguous run of keys: from its first row's lowest to its last
    row's highest. ``(0, 0)`` when that run misses ``[0, Skv)``."""
    lo = 0 if left is None else max(0, q0 + shift - left)
    hi = Skv - 1 if right is None else min(Skv - 1, q0 + bq - 1 + shift + right)
    return (lo // B_K, hi // B_K + 1) if lo <= hi else (0, 0)


def _cuts(q0, k0, bq, bk, shift, left, right):
    """``(right_cut, left_cut)``: whether the band's right edge (the block's last key is past row 0's band) and its
    left edge (the block's first key is before the last row's) cut the block ``[k0, k0 + bk)`` of the query tile."""
    return (right is not None and k0 + bk - 1 > q0 + shift + right,
            left is not None and k0 < q0 + bq - 1 + shift - left)


def _mask(s, q0, k0, bq, bk, shift, left, right, fill=NEG):
    """Entries of ``s`` (scores, or P in the backward) outside the band -> ``fill``, on edge blocks only. With
    ``d = (q0 + r + shift) - (k0 + c)`` (the query's position minus the key's, ``r`` the partition and ``c`` the
    free index), key ``k0 + c`` is visible iff ``-right <= d <= left``: one affine_select per side that cuts the
    block. A row with no visible key at all keeps max NEG, its masked scores weigh exp(0) = 1; such rows are
    overwritten by _rows_without_keys."""
    right_cut, left_cut = _cuts(q0, k0, bq, bk, shift, left, right)
    if right_cut:
        nisa.affine_select(s, pattern=[[-1, bk]], offset=q0 + shift - k0 + right, channel_multiplier=1,
                           on_true_tile=s, on_false_value=fill, cmp_op=nl.greater_equal)
    if left_cut:
        nisa.affine_select(s, pattern=[[-1, bk]], offset=q0 + shift - k0 - left, channel_multiplier=1,
                           on_true_tile=s, on_false_value=fill, cmp_op=nl.less_equal)


def _rows_without_keys(tile, q0, shift, right, width, fill):
    """Set the rows of a query tile that see no key to ``fill``: row ``r`` sees none iff its band ends
    before key 0, ``q0 + r + shift + right < 0`` (its band never passes the last key: ``p <= Skv - 1``).
    A no-op unless the tile has such rows (checked at trace time)."""
    if right is not None and q0 + shift + right < 0:
        nisa.affine_select(tile, pattern=[[0, width]], offset=q0 + shift + right, channel_multiplier=1,
                           on_true_tile=tile, on_false_value=fill, cmp_op=nl.greater_equal)


def _sink_column(sinks, h, bq):
    """Head ``h``'s sink on each of ``bq`` partitions, ``[bq, 1]`` float32 (``sinks``: the host's
    ``[Hq, 128, 1]``)."""
    return _load(sinks[h, 0:bq, 0:1], bq, 1, nl.float32)



def _factors(factor):
    """``factor`` as one float32 immediate, or as two whose product it is where it is out of float32's normal range
    (a tiny or huge softcap makes ``scale / softcap`` or ``softcap`` so): the engines take float32 immediates."""
    if factor == 0 or FLOAT32_TINY <= abs(factor) <= FLOAT32_MAX:
        return (factor,)
    root = math.sqrt(abs(factor))
    return (math.copysign(root, factor), root)


def _multiply(dst, src, factor):
    """``dst = src * factor`` on the Vector Engine, in two steps where ``factor`` needs two immediates."""
    first, *second = _factors(factor)
    nisa.tensor_scalar(dst, src, op0=nl.multiply, operand0=first, op1=nl.multiply if second else None,
                       operand1=second[0] if second else None)


def _tanh(dst, src, factor):
    """``dst = tanh(src * factor)`` on the Scalar Engine, the factor its free pre-scale where one immediate holds
    it, else applied first."""
    if len(_factors(factor)) == 1:
        nisa.activation(dst, op=nl.tanh, data=src, scale=factor)
    else:
        _multiply(dst, src, factor)
        nisa.activation(dst, op=nl.tanh, data=dst)


def _itemsize(dtype):
    return 4 if dtype == nl.float32 else 2


def _transposed_tiles(n, widths, dt):
    """SBUF for ``[n, width]`` rows transposed, each ``[min(width, 128), chunks, n]``."""
    return [nl.ndarray((min(width, PMAX), len(partition_chunks(width)), n), dtype=dt, buffer=nl.sbuf)
            for width in widths]


def _transpose_rows_into(dsts, sources, widths, rows):
    """Rows ``rows`` (a slice) of HBM ``sources`` (each ``[n, width]``) into ``dsts`` (:func:`_transposed_tiles`) by
    DMA transposes, one per 128 columns, the sources' interleaved."""
    for src, dst, width in zip(sources, dsts, widths):
        for c, c0, size in partition_chunks(width):
            nisa.dma_transpose(dst[0:size, c, rows], src[rows, c0:c0 + size])


def _transposed_rows_of(sources, n, widths, dt):
    """HBM ``sources`` (each ``[n, width]``) -> ``[min(width, 128), chunks, n]`` each in SBUF by DMA transposes, a
    score tile of rows at a time (so that the first tile's work waits for no more than its own rows)."""
    dsts = _transposed_tiles(n, widths, dt)
    for r0 in range(0, n, SCORE_KEYS):
        _transpose_rows_into(dsts, sources, widths, slice(r0, min(n, r0 + SCORE_KEYS)))
    return dsts


def _transposed_rows(src, n, width, dt):
    """HBM ``src [n, width]`` -> ``[min(width, 128), chunks, n]`` in SBUF (:func:`_transposed_rows_of`)."""
    return _transposed_rows_of((src,), n, (width,), dt)[0]


def _turn_back(rows, xT, width, ring, span, engine):
    """Rows ``span`` (a slice starting on a block) of ``xT`` (:func:`_transposed_rows`' layout) into ``rows``
    (:func:`_rows_from_transposed`'s) on the Tensor Engine, four 128-column slots per PSUM tile of ``ring``, copied
    out by ``engine``: cheaper than DMAing the rows, whose runs per partition are ``width`` elements only."""
    blocks = [block for block in partition_chunks(span.stop) if block[1] >= span.start]
    chunks = partition_chunks(width)
    per_tile = 4 // len(chunks)  # blocks per PSUM tile: a slot per (block, 128 columns)
    for first in range(0, len(blocks), per_tile):
        group = blocks[first:first + per_tile]
        g0 = group[0][0]
        t_ps = ring.take()
        for i, (_, j0, size) in enumerate(group):
            for c, c0, w in chunks:
                nisa.nc_transpose(t_ps[0:size, i * len(chunks) + c, 0:w], xT[0:w, c, j0:j0 + size])
        full = len(group) - (group[-1][2] < PMAX)  # only the last block can be short
        for c, c0, w in chunks:
            slots = slice(c, len(group) * len(chunks), len(chunks))
            if full:
                nisa.tensor_copy(rows[:, g0:g0 + full, c0:c0 + w], t_ps[:, slots, 0:w][:, 0:full, :], engine=engine)
            if full < len(group):
                short, slot = group[-1][2], full * len(chunks) + c
                nisa.tensor_copy(rows[0:short, g0 + full, c0:c0 + w], t_ps[0:short, slot, 0:w], engine=engine)



class _PsumRing:
    """PSUM tiles taken in turn: explicit multi-buffering, since PSUM's eight banks are too few to leave to the
    allocator (a new tile would take the bank of one still being read)."""

    def __init__(self, count, shape, dtype):
        self.tiles = [nl.ndarray(shape, dtype=dtype, buffer=nl.psum) for _ in range(count)]
        self.turn = -1

    def take(self):
        self.turn = (self.turn + 1) % len(self.tiles)
        return self.tiles[self.turn]

