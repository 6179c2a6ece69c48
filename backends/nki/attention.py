"""Flash attention forward and backward as NKI kernels (GQA, bottom-right causal, sliding window, logit
softcap, sinks, a head dim of V's own).

Layout: a query tile holds up to 128 rows on the partitions. V (and O, dO) may have a head dim of their own,
``Dv`` (DeepSeek's MLA): Q and K's ``D`` is contracted in ``S`` and dQ, dK; ``Dv`` in ``dP = dO V^T``, and it is
P V's free size. A head dim over 128 is split into chunks of at most 128 partitions (``[128, n_chunks, rows]``
tiles) whose matmuls accumulate into one PSUM tile; where it is a free size it needs no split up to 512 fp32.

Forward (:class:`_Forward`): per (batch, KV head), a section of keys is resident in SBUF (K^T and V, brought in by
DMA transposes, whose runs per partition are long, V turned back per 128-key block on the Tensor Engine, with a
ones column appended so that P V's last column is P's row sum), reused by every query tile of every query head
of the GQA group. Per query tile, the keys of the section it sees are scored in 512-key tiles (one PSUM bank):
``S = Q K^T`` with ``Q^T`` stationary (a cut block's mask added in PSUM by a matmul where it can be: ``mask``),
evacuated with the scale and the row max in one ``tensor_scalar_reduce``; the section's max comes first, so the
exponentials need no rescale; ``P = exp(s - m)`` in the input dtype; P^T per 128-key block, the first one or two
of a tile's four on the Tensor Engine in turn (copied out of PSUM by the Scalar Engine), the rest by DMA
transpose; ``[P V, rowsum]`` accumulates in one PSUM bank over the section.
Sections: as many whole 512-key tiles as fit ``RESIDENT_BYTES`` (K^T and V) and ``WORKING_BYTES`` (one tile's
scores, P, P^T) per partition; with several, a query tile carries ``[P V, rowsum, -max]`` through fp32 HBM from one
to the next and joins them at the larger max. The stages are software-pipelined (scores two tiles ahead of P, P a
tile ahead of P V) and PSUM is multi-buffered in explicit rings, so that the engines overlap.

Backward (:class:`_Backward`, one pass): per (batch, KV head) and key section (K^T, V^T and K resident, dK and dV
summed over the GQA group in fp32 SBUF), per query head and query section (Q^T, dO^T, Q and dO resident, dQ
summed in fp32 SBUF, carried through HBM between key sections), per 512-key group and query tile: S and dP into
PSUM, ``P = exp(scale S - lse)`` straight out of PSUM, ``dS = P (dP - delta)``; dV and dK accumulate in PSUM over
the section's query tiles (P and dS are the stationary operands as they are, queries contracted), dQ over the
group's blocks through dS^T.

Masks are one band: query ``i`` sits at key position ``p = i + Skv - Sq`` and sees key ``j`` iff
``p - left <= j <= p + right`` (either side None: unbounded), where ``causal`` makes ``right`` at most 0 and
``window=(left, right)`` gives the sides (``visible`` in the reference). Keys wholly outside the band of a query
tile are skipped at trace time, 128 at a time, so a window of W keys costs O(W) per query, not O(Skv); only
128-key blocks that a band edge crosses get a GpSimd ``affine_select`` (one per edge): on the scores in the
forward, on P in the backward. A softcap replaces each scaled score ``s`` by ``softcap * tanh(s / softcap)``
before the mask: the Scalar Engine's ``tanh`` as the scores leave PSUM (the backward's ``1 - tanh^2`` from it).
GQA reads K/V head ``h // (Hq // Hkv)`` in place, never a repeated copy.

Sinks (one logit per query head) join each row's denominator once, at its end; the host hands each head's sink
down the partitions (``[Hq, 128, 1]``), so a query tile loads its column in one DMA.

Forward returns ``out`` and ``lse`` (float32, natural log; ``-inf`` and zero output for rows that see no key; with
sinks their lse is the sink). Backward recomputes P from ``lse`` (the sunk lse: the sinked probabilities) and also
writes each row's share of the sinks' gradient, ``-p_sink * delta``, which the host sums. Semantics:
``backends/reference/attention.py``.
"""
from __future__ import annotations

import math

import torch

from portable_ops.layout import as_layout_of

from .compat import nki, nisa, nl
from . import runtime
from .runtime import kernel_op, launch

B_Q = 128  # query rows per tile (partition axis)
B_K = 128  # keys per block (P^T needs the keys on <= 128 partitions)
NEG = -1.0e30  # finite "minus infinity" for masked scores: exp(NEG - m) == 0, no inf - inf
FLOAT32_MAX, FLOAT32_TINY = 3.4028234663852886e38, 2.0 ** -126  # float32's largest and smallest normal
PMAX = 128  # partitions: the most a matmul contracts over, and a transpose's largest side
SCORE_KEYS = 512  # keys per forward score tile: one PSUM bank of fp32, a matmul's largest moving free size
# of each score tile's four P blocks, how many the Tensor Engine transposes, tile by tile in turn (the DMA the rest):
# the Scalar Engine copies those out of PSUM, so this balances its time against the DMA queues'
TENSOR_TRANSPOSED = (1, 2, 1, 1)
SCORED_AHEAD = 2  # query tiles whose scores are issued before a tile's P V
BACKWARD_TENSOR_TRANSPOSED = 3  # of a group's four dS blocks, how many the Tensor Engine transposes (the DMA the rest)
BACKWARD_SIDE_BYTES = 64 * 1024  # SBUF per partition for the backward's query side, and for its key side
PSUM_BANK_FP32 = 512  # fp32 per partition in a PSUM bank
RESIDENT_BYTES = 96 * 1024  # SBUF per partition for a section's resident K^T and V
WORKING_BYTES = 48 * 1024  # and for one query tile's scores, P and P^T (the pipeline holds a few such at once)


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


def _neg_max_with_sink(neg_m, l_sum, sink, bq):
    """A row's ``-max`` and sum with its sink joined, in place, and the factor ``exp(m_old - m)`` that takes its
    accumulator to the new max (0 for a row that saw no key: its ``m`` is NEG)."""
    neg_all = nl.ndarray((bq, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(neg_all, data=sink, op0=nl.multiply, operand0=-1.0, op1=nl.minimum, operand1=neg_m)
    decay = nl.ndarray((bq, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(decay, op=nl.exp, data=neg_m, scale=-1.0, bias=neg_all)
    sink_term = nl.ndarray((bq, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(sink_term, op=nl.exp, data=sink, bias=neg_all)
    nisa.scalar_tensor_tensor(l_sum, data=l_sum, op0=nl.multiply, operand0=decay, op1=nl.add, operand1=sink_term)
    nisa.tensor_copy(neg_m, neg_all)
    return decay


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


def _section_keys(D, Dv, dtype):
    """Keys per resident section: the most whole score tiles whose K^T and V fit ``RESIDENT_BYTES`` per partition
    and whose one query tile's scores (fp32), P and P^T fit ``WORKING_BYTES``, at least one tile."""
    size = _itemsize(dtype)
    resident = len(partition_chunks(D)) * size + (Dv + 1) * size / PMAX  # K^T [D, keys]; V [128 keys, blocks, Dv + 1]
    working = 4 + 2 * size  # scores, P, P^T (bq = 128 columns per 128 keys)
    tiles = min(RESIDENT_BYTES / resident, WORKING_BYTES / working) // SCORE_KEYS
    return SCORE_KEYS * max(1, int(tiles))


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


def _rows_from_transposed(xT, n, width, dt, ring, columns=None):
    """``xT`` (:func:`_transposed_rows`' layout of ``[n, width]``) turned back into ``[128, blocks, columns]``
    (block ``j`` holds rows ``128 j ..`` on the partitions; ``columns`` >= ``width``, the rest left unwritten) by
    :func:`_turn_back`, copied out by the Scalar Engine (the forward's Vector Engine has the scores to evacuate)."""
    rows = nl.ndarray((PMAX, len(partition_chunks(n)), columns or width), dtype=dt, buffer=nl.sbuf)
    _turn_back(rows, xT, width, ring, slice(0, n), nisa.scalar_engine)
    return rows


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


def _pieces(k_lo, k_hi, q0, bq, shift, left, right):
    """The score tiles ``(k0, n)`` of up to ``SCORE_KEYS`` keys over ``[k_lo, k_hi)``, each with its pieces
    ``(k0, n, cut)``: the 128-key blocks a band edge cuts (``cut``) alone, runs of the others merged."""
    tiles = []
    for t0 in range(k_lo, k_hi, SCORE_KEYS):
        pieces = []
        for _, j0, size in partition_chunks(min(SCORE_KEYS, k_hi - t0)):
            cut = _cuts(q0, t0 + j0, bq, size, shift, left, right) != (False, False)
            if pieces and not cut and not pieces[-1][2]:
                pieces[-1] = (pieces[-1][0], pieces[-1][1] + size, False)
            else:
                pieces.append((t0 + j0, size, cut))
        tiles.append(((t0, min(SCORE_KEYS, k_hi - t0)), pieces))
    return tiles


class _PsumRing:
    """PSUM tiles taken in turn: explicit multi-buffering, since PSUM's eight banks are too few to leave to the
    allocator (a new tile would take the bank of one still being read)."""

    def __init__(self, count, shape, dtype):
        self.tiles = [nl.ndarray(shape, dtype=dtype, buffer=nl.psum) for _ in range(count)]
        self.turn = -1

    def take(self):
        self.turn = (self.turn + 1) % len(self.tiles)
        return self.tiles[self.turn]


class _Forward:
    """One forward launch's trace-time constants, outputs and PSUM rings; its methods are the kernel's stages."""

    def __init__(self, q, k, v, sinks, carried, out, lse, scale, left, right, softcap):
        self.q, self.k, self.v, self.sinks, self.carried, self.out, self.lse = q, k, v, sinks, carried, out, lse
        self.Sq, self.D, self.Skv, self.Dv = q.shape[2], q.shape[3], k.shape[2], v.shape[3]
        self.dt, self.shift = q.dtype, self.Skv - self.Sq
        self.scale, self.left, self.right, self.softcap = scale, left, right, softcap
        # Where the scale is positive, no softcap comes between, and NEG / scale fits the input dtype, a cut block's
        # mask is a bias the Tensor Engine adds to its scores in PSUM (identity^T x mask): NEG once scaled, and the
        # Vector Engine evacuates it with its tile's other blocks; else it is masked after the scale (and cap).
        bias = NEG / scale if scale > 0 else -math.inf
        in_psum = softcap is None and self.dt in (nl.bfloat16, nl.float32) and abs(bias) <= FLOAT32_MAX / 4
        self.mask_value, self.masks, self.identity = (bias if in_psum else None), {}, None
        if in_psum and (left is not None or right is not None):
            self.identity = nl.ndarray((PMAX, PMAX), dtype=self.dt, buffer=nl.sbuf)
            nisa.memset(self.identity, 1.0)
            nisa.affine_select(self.identity, pattern=[[-1, PMAX]], offset=0, channel_multiplier=1,
                               on_true_tile=self.identity, on_false_value=0.0, cmp_op=nl.equal)
        # the eight banks: scores, Tensor Engine transposes (four 128-column slots each), [P V, rowsum]
        self.scores_ps = _PsumRing(4, (B_Q, SCORE_KEYS), nl.float32)
        self.transposes_ps = _PsumRing(2, (PMAX, 4, PMAX), self.dt)
        self.pv_ps = _PsumRing(2, (B_Q, self.Dv + 1), nl.float32)

    def resident(self, b, hkv, s0, n):
        """Keys ``[s0, s0 + n)`` of KV head ``hkv`` on chip: ``K^T [min(D, 128), chunks, n]``, and ``V [128,
        blocks, Dv + 1]`` (block ``j`` holds keys ``s0 + 128 j ..`` on the partitions), its last column ones, so
        that P V's last column is P's row sum. Both come in as DMA transposes from HBM (one long run per partition,
        where V's rows would be 2 * Dv bytes each); V is turned back by :func:`_rows_from_transposed`."""
        Dv, dt = self.Dv, self.dt
        kT, vT = _transposed_rows_of((self.k[b, hkv, s0:s0 + n, :], self.v[b, hkv, s0:s0 + n, :]), n,
                                     (self.D, Dv), dt)
        v_sb = _rows_from_transposed(vT, n, Dv, dt, self.transposes_ps, columns=Dv + 1)
        nisa.memset(v_sb[:, :, Dv:Dv + 1], 1.0)
        return kT, v_sb

    def query_transposed(self, b, h, q0, bq):
        """A query tile's ``Q^T`` (DMA transposes)."""
        return _transposed_rows(self.q[b, h, q0:q0 + bq, :], bq, self.D, self.dt)

    def scores_stage(self, b, h, q0, bq, kT, s0, sn, qT=None):
        """The first stage of a query tile's work on a section: its visible keys there, Q^T (unless given), the
        scores and their max; a dict for the next stages, ``tiles`` None when the tile sees no key of the section."""
        k_first, k_stop = _key_blocks(q0, bq, self.shift, self.Skv, self.left, self.right)
        k_lo, k_hi = max(k_first * B_K, s0), min(k_stop * B_K, self.Skv, s0 + sn)
        stage = dict(h=h, q0=q0, bq=bq, first=k_first * B_K >= s0, last=min(k_stop * B_K, self.Skv) <= s0 + sn,
                     blind=s0 == 0 and k_first == k_stop, tiles=None)
        if k_lo < k_hi:
            qT = self.query_transposed(b, h, q0, bq) if qT is None else qT
            stage["tiles"] = _pieces(k_lo, k_hi, q0, bq, self.shift, self.left, self.right)
            stage["s"], stage["neg_m"] = self.section_scores(qT, kT, s0, stage["tiles"], bq, q0)
        return stage

    def section_scores(self, qT, kT, s0, tiles, bq, q0):
        """Scaled, capped, masked scores of the keys ``tiles`` cover (fp32 ``[bq, keys]``, SBUF) and their row max,
        negated (``[bq, 1]``): each 512-key tile's PSUM is evacuated with the scale and the max of each of its
        pieces in one Vector instruction; a piece an edge cuts has its mask added in PSUM (one piece with the rest of
        its tile), or is scaled, masked (GpSimd), then its max taken."""
        k_lo, in_psum = tiles[0][0][0], self.mask_value is not None
        s = nl.ndarray((bq, tiles[-1][0][0] + tiles[-1][0][1] - k_lo), dtype=nl.float32, buffer=nl.sbuf)
        maxima = nl.ndarray((bq, len(tiles) if in_psum else sum(len(p) for _, p in tiles)), dtype=nl.float32,
                            buffer=nl.sbuf)
        column = 0
        for (t0, tn), pieces in tiles:
            s_ps = self.scores_ps.take()[0:bq, 0:tn]
            _matmul_chunked(s_ps, qT, kT[:, :, t0 - s0:t0 - s0 + tn], self.D)
            if in_psum:
                for p0, pn, cut in pieces:
                    if cut:
                        nisa.nc_matmul(s_ps[:, p0 - t0:p0 - t0 + pn], self.identity[0:bq, 0:bq],
                                       self.mask(q0, p0, bq, pn), accumulate=True)
                pieces = [(t0, tn, False)]
            src, factor = s_ps, self.scale
            if self.softcap is not None:  # the scale / softcap pre-scale is free as the scores leave PSUM
                src, factor = nl.ndarray((bq, tn), dtype=nl.float32, buffer=nl.sbuf), self.softcap
                _tanh(src, s_ps, self.scale / self.softcap)
            for p0, pn, cut in pieces:
                dst, piece = s[:, p0 - k_lo:p0 - k_lo + pn], src[:, p0 - t0:p0 - t0 + pn]
                peak = maxima[:, column:column + 1]
                if cut or len(_factors(factor)) > 1:  # masked, or a factor of two immediates: apart
                    _multiply(dst, piece, factor)
                    _mask(dst, q0, p0, bq, pn, self.shift, self.left, self.right)
                    nisa.tensor_reduce(peak, op=nl.maximum, data=dst, axis=1, keepdims=True)
                else:
                    nisa.tensor_scalar_reduce(dst, piece, op0=nl.multiply, operand0=factor, reduce_op=nl.maximum,
                                              reduce_res=peak)
                column += 1
        width = maxima.shape[1]
        while width > 1:  # the maxima halved on GpSimd, off the Vector Engine, which evacuates the scores
            half = width // 2
            nisa.tensor_tensor(maxima[:, 0:half], maxima[:, 0:half], maxima[:, width - half:width], op=nl.maximum,
                               engine=nisa.gpsimd_engine)
            width -= half
        # negated, and a max of at least NEG: a row scoring -inf against every key gets exp(-inf - NEG) = 0, not
        # exp(-inf + inf)
        neg_m = nl.ndarray((bq, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(neg_m, maxima[:, 0:1], op0=nl.multiply, operand0=-1.0, op1=nl.minimum, operand1=-NEG,
                           engine=nisa.gpsimd_engine)
        return s, neg_m

    def probabilities_stage(self, stage, b, s0, draining=False):
        """The second: the row max joined with the state carried from earlier sections, ``P = exp(s - m)`` (one
        exponential per score tile) and P^T per 128-key block (the first ``TENSOR_TRANSPOSED`` of a tile's blocks,
        tile by tile in turn, on the Tensor Engine, copied out of PSUM by the Scalar Engine, the rest by DMA; while
        the pipeline drains, with the scores all evacuated, every block on the Tensor Engine, copied out by the
        Vector Engine, so that the last tiles wait on no DMA transposes)."""
        tiles, h, q0, bq, Dv, dt = stage["tiles"], stage["h"], stage["q0"], stage["bq"], self.Dv, self.dt
        if tiles is None:
            return stage
        s, neg_m = stage.pop("s"), stage["neg_m"]  # the scores are dead once P is made
        if not stage["first"]:  # the max over both, the carried sums to be rescaled to it
            stage["carried"] = carried = _load(self.carried[b, h, q0:q0 + bq, 0:Dv + 2], bq, Dv + 2, nl.float32)
            nisa.tensor_tensor(neg_m, neg_m, carried[:, Dv + 1:Dv + 2], op=nl.minimum)
            stage["alpha"] = nl.ndarray((bq, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(stage["alpha"], op=nl.exp, data=carried[:, Dv + 1:Dv + 2], scale=-1.0, bias=neg_m)
        k_lo = tiles[0][0][0]
        p = nl.ndarray(s.shape, dtype=dt, buffer=nl.sbuf)
        stage["pT"] = pT = nl.ndarray((PMAX, len(partition_chunks(s.shape[1])), bq), dtype=dt, buffer=nl.sbuf)
        for (t0, tn), _ in tiles:  # every exponential first: the Scalar Engine's copies below wait on transposes
            nisa.activation(p[:, t0 - k_lo:t0 - k_lo + tn], op=nl.exp, data=s[:, t0 - k_lo:t0 - k_lo + tn],
                            bias=neg_m)
        for i, ((t0, tn), _) in enumerate(tiles):
            keys = slice(t0 - k_lo, t0 - k_lo + tn)
            blocks, block0 = partition_chunks(tn), (t0 - k_lo) // PMAX
            on_tensor = blocks if draining else blocks[:TENSOR_TRANSPOSED[i % len(TENSOR_TRANSPOSED)]]
            t_ps = self.transposes_ps.take()
            for j, j0, size in on_tensor:
                nisa.nc_transpose(t_ps[0:size, j, 0:bq], p[:, keys.start + j0:keys.start + j0 + size])
            rows = on_tensor[-1][2] if len(on_tensor) == 1 else PMAX  # only a last block is short
            nisa.tensor_copy(pT[0:rows, block0:block0 + len(on_tensor), :], t_ps[0:rows, 0:len(on_tensor), 0:bq],
                             engine=nisa.vector_engine if draining else nisa.scalar_engine)
            for j, j0, size in blocks[len(on_tensor):]:
                nisa.dma_transpose(pT[0:size, block0 + j, :], p[:, keys.start + j0:keys.start + j0 + size])
        return stage

    def mask(self, q0, k0, bq, bk):
        """The bias that masks the block ``[k0, k0 + bk)`` of the query tile at ``q0`` in PSUM (``[bq, bk]``, 0 where
        visible, ``mask_value`` where not), made once per offset of the block from the tile's diagonal."""
        key = (q0 + self.shift - k0, bq, bk)
        if key not in self.masks:
            self.masks[key] = tile = nl.ndarray((bq, bk), dtype=self.dt, buffer=nl.sbuf)
            nisa.memset(tile, 0.0)
            _mask(tile, q0, k0, bq, bk, self.shift, self.left, self.right, fill=self.mask_value)
        return self.masks[key]

    def output_stage(self, stage, b, v_sb, s0):
        """The last: ``[P V, rowsum(P)]`` in PSUM (one accumulating matmul per 128-key block), joined with the
        carried state, and the tile's rows written (its last section) or its state carried on (``[P V, rowsum,
        -max]``, fp32 HBM)."""
        h, q0, bq, tiles, Dv = stage["h"], stage["q0"], stage["bq"], stage["tiles"], self.Dv
        if tiles is None:  # no key of this section; of none at all: written once, as seeing nothing
            if stage["blind"]:
                self.write_rows(None, None, b, h, q0, bq)
            return
        k_lo, pT = tiles[0][0][0], stage["pT"]
        acc = pv = self.pv_ps.take()[0:bq, :]
        for (t0, tn), _ in tiles:
            for j, j0, size in partition_chunks(tn):
                block = (t0 + j0 - k_lo) // PMAX
                nisa.nc_matmul(pv, pT[0:size, block, :], v_sb[0:size, (t0 + j0 - s0) // PMAX, :],
                               accumulate=block > 0)
        if not stage["first"]:
            acc = stage["carried"][:, 0:Dv + 1]
            nisa.scalar_tensor_tensor(acc, data=acc, op0=nl.multiply, operand0=stage["alpha"], op1=nl.add,
                                      operand1=pv)
        if stage["last"]:
            self.write_rows(acc, stage["neg_m"], b, h, q0, bq)
        else:
            state = nl.ndarray((bq, Dv + 2), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(state[:, 0:Dv + 1], acc)
            nisa.tensor_copy(state[:, Dv + 1:Dv + 2], stage["neg_m"])
            nisa.dma_copy(self.carried[b, h, q0:q0 + bq, 0:Dv + 2], state)

    def write_rows(self, acc, neg_m, b, h, q0, bq):
        """A query tile's output ``acc[:, :Dv] / rowsum`` and lse ``max + log(rowsum)`` from ``acc = [P V, rowsum]``
        (PSUM or SBUF) and ``-max``, with head ``h``'s sink joined; ``acc`` None: the tile sees no key."""
        Dv, shift, right = self.Dv, self.shift, self.right
        l_sum = nl.zeros((bq, 1), dtype=nl.float32, buffer=nl.sbuf)
        if acc is None:
            neg_m = nl.ndarray((bq, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(neg_m, -NEG)
        else:
            nisa.tensor_copy(l_sum, acc[:, Dv:Dv + 1], engine=nisa.scalar_engine)
        sinks = self.sinks
        decay = None if sinks is None else _neg_max_with_sink(neg_m, l_sum, _sink_column(sinks, h, bq), bq)
        # A real row's sum is >= 1 (its max term, a key's or its sink's, is exp(0)); one that sees nothing sums to
        # 0 and is overwritten below, one with a key scoring +inf is NaN (its acc too): 1 in both keeps log in its
        # domain. The one-column steps run on GpSimd and the Scalar Engine where they can, off the Vector Engine's
        # score evacuations.
        l_safe = nl.ndarray((bq, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(l_safe, l_sum, op0=nl.maximum, operand0=1.0, engine=nisa.gpsimd_engine)
        real = nl.ndarray((bq, 1), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.tensor_scalar(real, l_sum, op0=nl.less_equal, operand0=float(2 ** 60),  # NaN: false
                           engine=nisa.gpsimd_engine)
        nisa.tensor_copy_predicated(dst=l_safe, src=1.0, predicate=real, reverse_pred=True)
        inv_l = nl.ndarray((bq, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(inv_l, l_safe, op0=nl.reciprocal, operand0=None, engine=nisa.gpsimd_engine)
        if decay is not None:
            nisa.tensor_tensor(inv_l, inv_l, decay, op=nl.multiply, engine=nisa.gpsimd_engine)
        o = nl.ndarray((bq, Dv), dtype=self.dt, buffer=nl.sbuf)
        if acc is None:
            nisa.memset(o, 0.0)
        else:
            nisa.activation(o, op=nl.copy, data=acc[:, 0:Dv], scale=inv_l)
        lse_t = nl.ndarray((bq, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(lse_t, op=nl.log, data=l_safe)
        # + l_sum * 0: NaN where the sum is, so such a row's lse is NaN as its output
        nan_or_max = nl.ndarray((bq, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(nan_or_max, l_sum, op0=nl.multiply, operand0=0.0, op1=nl.subtract, operand1=neg_m,
                           engine=nisa.gpsimd_engine)
        nisa.tensor_tensor(lse_t, lse_t, nan_or_max, op=nl.add, engine=nisa.gpsimd_engine)
        # Rows that see no key had only masked scores (or, with no visible block, none): out 0 and lse -inf, as
        # the reference, not the mean of masked values (with a sink their lse is already the sink's: the decay
        # dropped the masked ones).
        _rows_without_keys(o, q0, shift, right, Dv, 0.0)
        if sinks is None:
            _rows_without_keys(lse_t, q0, shift, right, 1, -math.inf)
        nisa.dma_copy(self.out[b, h, q0:q0 + bq, 0:Dv], o)
        # lse as one row: a 4-byte DMA per partition would be as slow as a whole tile
        lse_row = nl.ndarray((1, bq), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_transpose(lse_row, lse_t)
        nisa.dma_copy(self.lse[b, h, q0:q0 + bq, 0:1], lse_row)


@nki.jit
def attention_fwd_kernel(q, k, v, sinks=None, scale=1.0, causal=False, window_left=None, window_right=None,
                         softcap=None, section_keys=None):
    """``q [B, Hq, Sq, D]``, ``k [B, Hkv, Skv, D]``, ``v [B, Hkv, Skv, Dv]`` -> ``out [B, Hq, Sq, Dv]``,
    ``lse [B, Hq, Sq, 1]`` fp32.
    ``sinks``: None or ``[Hq, 128, 1]`` fp32 (each head's sink down the partitions). ``window_left`` /
    ``window_right``: the sliding window's sides (None: unbounded); ``softcap``: None or a positive float;
    ``section_keys``: keys resident at a time (None: :func:`_section_keys`, a multiple of 512). The options are
    trace-time constants: each combination is its own kernel."""
    B, Hq, Sq, D = q.shape
    Hkv, Skv, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    step = section_keys or _section_keys(D, Dv, q.dtype)
    sections = [(s0, min(step, Skv - s0)) for s0 in range(0, Skv, step)]
    out = nl.ndarray((B, Hq, Sq, Dv), dtype=q.dtype, buffer=nl.shared_hbm)
    lse = nl.ndarray((B, Hq, Sq, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    # a query tile's [P V, rowsum, -max] between the sections it sees, when there are several
    carried = nl.ndarray((B, Hq, Sq, Dv + 2), dtype=nl.float32, buffer=nl.private_hbm) if len(sections) > 1 else None
    fwd = _Forward(q, k, v, sinks, carried, out, lse, scale, *_band(causal, window_left, window_right), softcap)
    n_q = (Sq + B_Q - 1) // B_Q
    for b in nl.affine_range(B):
        for hkv in nl.affine_range(Hkv):
            for s0, sn in sections:
                # the first query tiles first: under a causal mask they see the fewest keys, so the pipeline fills
                # while the first resident keys arrive, and drains with long tiles that keep the engines busy
                jobs = [(hkv * G + g, qi * B_Q, min(B_Q, Sq - qi * B_Q)) for g in range(G) for qi in range(n_q)]
                # the first tiles' Q^T ahead of the resident keys: the DMA queues serve transfers in program order
                early = [fwd.query_transposed(b, *job) for job in jobs[:SCORED_AHEAD + 1]]
                kT, v_sb = fwd.resident(b, hkv, s0, sn)
                # software-pipelined: a query tile's scores are issued SCORED_AHEAD tiles ahead of its P, and its
                # P (and P^T) a tile ahead of its P V, so none of them waits on another's engines or transfers
                scored, transposed = [], []
                for index in range(len(jobs) + SCORED_AHEAD):
                    if index < len(jobs):
                        qT = early[index] if index < len(early) else None
                        scored.append(fwd.scores_stage(b, *jobs[index], kT, s0, sn, qT))
                    if len(scored) > SCORED_AHEAD or (scored and index >= len(jobs)):
                        # the last tiles' P are made after the last scores: the Vector Engine is free to copy
                        transposed.append(fwd.probabilities_stage(scored.pop(0), b, s0,
                                                                  draining=index >= len(jobs)))
                    if len(transposed) > 1:
                        fwd.output_stage(transposed.pop(0), b, v_sb, s0)
                for stage in transposed:
                    fwd.output_stage(stage, b, v_sb, s0)
    return out, lse


def _sections(n, step):
    """``(start, size)`` of the sections of at most ``step`` that ``n`` splits into."""
    return [(s0, min(step, n - s0)) for s0 in range(0, n, step)]


def _backward_sections(D, Dv, dtype):
    """``(query rows, keys)`` per backward section: the query side (Q^T, dO^T, Q, dO, dQ's fp32 sum) and the key side
    (K^T, V^T, K, dK's and dV's fp32 sums) each within ``BACKWARD_SIDE_BYTES`` per partition."""
    size = _itemsize(dtype)
    query = len(partition_chunks(D)) * size + len(partition_chunks(Dv)) * size + (D * (size + 4) + Dv * size) / PMAX
    key = len(partition_chunks(D)) * size + len(partition_chunks(Dv)) * size + (D * (size + 4) + Dv * 4) / PMAX
    return (B_Q * max(1, int(BACKWARD_SIDE_BYTES / query) // B_Q),
            SCORE_KEYS * max(1, int(BACKWARD_SIDE_BYTES / key) // SCORE_KEYS))


def _row_runs(tiles):
    """``(first, rows, count)`` of :func:`partition_chunks`' pieces ``tiles`` (their positions in the list) in runs of
    equal rows, the whole ones, then a short last one, so that one instruction covers a run's columns."""
    full = len(tiles) - (tiles[-1][2] < PMAX)
    return [(0, PMAX, full)] * (full > 0) + [(full, tiles[-1][2], 1)] * (full < len(tiles))


def _add_into(total, part, started):
    """``total += part``, or ``total = part`` where the sum has not ``started``: a sum needs no zeros written first,
    and a copy streams one input where an add streams two."""
    if started:
        nisa.tensor_tensor(total, total, part, op=nl.add)
    else:
        nisa.tensor_copy(total, part)


def _rows_in_blocks(src, n, width, dt):
    """HBM ``src [n, width]`` -> ``[128, blocks, width]`` in SBUF: block ``j`` holds rows ``128 j ..`` on the
    partitions."""
    dst = nl.ndarray((PMAX, len(partition_chunks(n)), width), dtype=dt, buffer=nl.sbuf)
    for j, j0, size in partition_chunks(n):
        nisa.dma_copy(dst[0:size, j, :], src[j0:j0 + size, :])
    return dst


class _Backward:
    """One backward launch's trace-time constants, outputs and PSUM; its methods are the kernel's stages. One pass:
    per KV head and key section (K^T, V^T, K resident, dK and dV summed in SBUF over the GQA group), per query head
    and query section (Q^T, dO^T, Q, dO resident, dQ summed in SBUF over the key groups), per 512-key group, per
    query tile: S and dP into PSUM, P = exp(S - lse) straight out of PSUM, dS = P (dP - delta); dV and dK of the
    group's blocks accumulate in PSUM over the section's query tiles, dQ over the group's blocks."""

    def __init__(self, q, k, v, o, lse, do, sinks, dlse, outputs, carried, scale, left, right, softcap):
        self.q, self.k, self.v, self.o, self.lse, self.do, self.sinks, self.dlse = q, k, v, o, lse, do, sinks, dlse
        self.dq, self.dk, self.dv, self.dsink_rows = outputs
        self.carried = carried
        self.Sq, self.D, self.Skv, self.Dv = q.shape[2], q.shape[3], k.shape[2], v.shape[3]
        self.dt, self.shift = q.dtype, self.Skv - self.Sq
        self.scale, self.left, self.right, self.softcap = scale, left, right, softcap
        # PSUM's eight banks: dK and dV of a 512-key group (a bank holds PSUM_BANK_FP32 // D blocks), dQ, the dS
        # transposes, and the rest split between S and dP
        self.dk_per_bank, self.dv_per_bank = (max(1, PSUM_BANK_FP32 // d) for d in (self.D, self.Dv))
        dk_banks, dv_banks = (-(-4 // n) for n in (self.dk_per_bank, self.dv_per_bank))
        self.dk_ps = [nl.ndarray((PMAX, self.dk_per_bank, self.D), dtype=nl.float32, buffer=nl.psum)
                      for _ in range(dk_banks)]
        self.dv_ps = [nl.ndarray((PMAX, self.dv_per_bank, self.Dv), dtype=nl.float32, buffer=nl.psum)
                      for _ in range(dv_banks)]
        self.dq_ps = _PsumRing(1, (B_Q, self.D), nl.float32)
        self.ones = nl.ndarray((min(self.Dv, PMAX), len(partition_chunks(self.Dv)), 1), dtype=nl.float32,
                               buffer=nl.sbuf)
        nisa.memset(self.ones, 1.0)
        self.transposes_ps = _PsumRing(1, (PMAX, 4, PMAX), self.dt)
        each = max(1, (8 - dk_banks - dv_banks - 2) // 2)
        self.scores_ps, self.dp_ps = (_PsumRing(each, (B_Q, SCORE_KEYS), nl.float32) for _ in range(2))

    def key_side(self, b, hkv, s0, sn):
        """The key section's SBUF for K^T, V^T and K rows, filled a group at a time as the first pass reaches it
        (:meth:`load_keys`), and fp32 sums for dK and dV, ``summed`` naming the blocks they hold a sum for."""
        kT, vT = _transposed_tiles(sn, (self.D, self.Dv), self.dt)
        k_rows = nl.ndarray((PMAX, len(partition_chunks(sn)), self.D), dtype=self.dt, buffer=nl.sbuf)
        dk_sum, dv_sum = (nl.ndarray((PMAX, len(partition_chunks(sn)), d), dtype=nl.float32, buffer=nl.sbuf)
                          for d in (self.D, self.Dv))
        return dict(s0=s0, sn=sn, kT=kT, vT=vT, k_rows=k_rows, dk_sum=dk_sum, dv_sum=dv_sum, loaded=set(),
                    summed=set(), sources=(self.k[b, hkv, s0:s0 + sn, :], self.v[b, hkv, s0:s0 + sn, :]))

    def load_keys(self, key, g0, gn):
        """The group's K^T and V^T (DMA transposes) and K rows turned back, unless an earlier pass loaded them. The
        sides load as the groups reach them, so that the first group waits for its own rows only; the rows are
        copied out of PSUM by the Vector Engine, where the Scalar Engine has the groups' exponentials."""
        if g0 in key["loaded"]:
            return
        key["loaded"].add(g0)
        rows = slice(g0 - key["s0"], g0 - key["s0"] + gn)
        _transpose_rows_into((key["kT"], key["vT"]), key["sources"], (self.D, self.Dv), rows)
        _turn_back(key["k_rows"], key["kT"], self.D, self.transposes_ps, rows, nisa.vector_engine)

    def query_side(self, b, h, r0, rn, first):
        """The query section's SBUF for Q^T, dO^T, Q and dO rows and per tile ``-lse`` and ``-delta`` columns, filled
        a score tile of rows at a time as the groups reach them (:meth:`load_rows`), and dQ's fp32 sum (on later key
        sections as the last one left it), ``summed`` naming the tiles it holds a sum for."""
        rows = slice(r0, r0 + rn)
        tiles = partition_chunks(rn)
        side = dict(b=b, r0=r0, rn=rn, h=h, first=first, written=set(), loaded=set(),  # tiles whose dQ has left
                    sources=(self.q[b, h, rows, :], self.do[b, h, rows, :]))
        side["qT"], side["doT"] = _transposed_tiles(rn, (self.D, self.Dv), self.dt)
        side["q_rows"], side["do_rows"] = (nl.ndarray((PMAX, len(tiles), d), dtype=self.dt, buffer=nl.sbuf)
                                           for d in (self.D, self.Dv))
        side["neg_lse"], side["neg_delta"] = (nl.ndarray((PMAX, len(tiles)), dtype=nl.float32, buffer=nl.sbuf)
                                              for _ in range(2))
        if first:
            side["dq_sum"], side["summed"] = nl.ndarray((PMAX, len(tiles), self.D), dtype=nl.float32,
                                                        buffer=nl.sbuf), set()
        else:
            side["dq_sum"] = _rows_in_blocks(self.carried[b, h, rows, :], rn, self.D, nl.float32)
            side["summed"] = {t for t, _, _ in tiles}
        return side

    def load_rows(self, side, t):
        """The score tile of rows holding query tile ``t``, unless loaded: Q^T and dO^T (DMA transposes), Q and dO
        rows turned back (as :meth:`load_keys`), and its tiles' ``-lse`` and ``-delta``; with sinks, each row's
        share of their gradient, written on the first key section."""
        r = t * B_Q // SCORE_KEYS * SCORE_KEYS
        if r in side["loaded"]:
            return
        side["loaded"].add(r)
        b, h, r0, rows = side["b"], side["h"], side["r0"], slice(r, min(side["rn"], r + SCORE_KEYS))
        _transpose_rows_into((side["qT"], side["doT"]), side["sources"], (self.D, self.Dv), rows)
        for xT, width, dst in ((side["qT"], self.D, side["q_rows"]), (side["doT"], self.Dv, side["do_rows"])):
            _turn_back(dst, xT, width, self.transposes_ps, rows, nisa.vector_engine)
        tiles = [tile for tile in partition_chunks(rows.stop) if tile[1] >= r]
        delta = self.scores_ps.take()  # the tiles' sums in its columns, negated in one copy
        for i, (t, t0, bq) in enumerate(tiles):
            self.lse_column(b, h, r0 + t0, bq, side["neg_lse"][0:bq, t:t + 1])
            self.delta_column(b, h, r0 + t0, bq, side["doT"][:, :, t0:t0 + bq], delta[0:bq, i:i + 1])
        for i, bq, n in _row_runs(tiles):
            t = tiles[i][0]
            nisa.activation(side["neg_delta"][0:bq, t:t + n], op=nl.copy, data=delta[0:bq, i:i + n], scale=-1.0)
        for t, t0, bq in tiles:
            self.row_terms(b, h, r0 + t0, bq, side["neg_lse"][0:bq, t:t + 1], side["neg_delta"][0:bq, t:t + 1],
                           side["first"])

    def lse_column(self, b, h, q0, bq, neg_lse):
        """A query tile's ``-lse``: NEG for rows without keys, unless sinks make their lse the sink's."""
        lse_row = _load(self.lse[b, h, q0:q0 + bq, 0:1], 1, bq, nl.float32)  # one row: a 4-byte run per partition
        nisa.dma_transpose(neg_lse, lse_row)  # would cost as much as a whole tile
        nisa.tensor_scalar(neg_lse, neg_lse, op0=nl.multiply, operand0=-1.0, engine=nisa.gpsimd_engine)
        if self.sinks is None:  # lse = -inf there: P must be 0, not exp(+inf)
            _rows_without_keys(neg_lse, q0, self.shift, self.right, 1, NEG)

    def delta_column(self, b, h, q0, bq, doT, delta):
        """A query tile's ``rowsum(dO * O)`` into ``delta`` (PSUM), taken transposed (``doT``: the tile's dO^T), so
        that O comes in by DMA transposes, whose runs per partition are long where O's rows are ``2 * Dv`` bytes,
        and its sum over Dv is a matmul against ones."""
        oT = _transposed_rows(self.o[b, h, q0:q0 + bq, :], bq, self.Dv, self.dt)
        prod = nl.ndarray(oT.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(prod, doT, oT, op=nl.multiply, engine=nisa.gpsimd_engine)
        _matmul_chunked(delta, prod, self.ones, self.Dv)

    def row_terms(self, b, h, q0, bq, neg_lse, neg_delta, first):
        """``-delta = -(rowsum(dO * O) - dlse)`` from ``-rowsum(dO * O)``; with sinks, on the first key section,
        ``-p_sink * delta`` per row."""
        if self.dlse is not None:
            nisa.tensor_tensor(neg_delta, neg_delta, _load(self.dlse[b, h, q0:q0 + bq, 0:1], bq, 1, nl.float32),
                               op=nl.add, engine=nisa.gpsimd_engine)
        if self.sinks is not None and first:  # p_sink = exp(sink - lse); its row's term -p_sink * delta
            term = nl.ndarray((bq, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(term, op=nl.exp, data=_sink_column(self.sinks, h, bq), bias=neg_lse)
            nisa.tensor_tensor(term, term, neg_delta, op=nl.multiply, engine=nisa.gpsimd_engine)
            nisa.dma_copy(self.dsink_rows[b, h, q0:q0 + bq, 0:1], term)

    def probabilities(self, key, side, t, q0, bq, a, z):
        """Stage one of a query tile against keys ``[a, z)`` of a group: ``P`` and ``dS`` (``[bq, z - a]`` in the
        input dtype), dS taken back through a softcap, so that it is the derivative by the scaled scores."""
        s0, w, dt = key["s0"], z - a, self.dt
        qT, doT = side["qT"][:, :, t * B_Q:t * B_Q + bq], side["doT"][:, :, t * B_Q:t * B_Q + bq]
        s_ps, dp_ps = self.scores_ps.take()[0:bq, 0:w], self.dp_ps.take()[0:bq, 0:w]
        _matmul_chunked(s_ps, qT, key["kT"][:, :, a - s0:z - s0], self.D)
        _matmul_chunked(dp_ps, doT, key["vT"][:, :, a - s0:z - s0], self.Dv)
        neg_lse, neg_delta = side["neg_lse"][0:bq, t:t + 1], side["neg_delta"][0:bq, t:t + 1]
        p = nl.ndarray((bq, w), dtype=dt, buffer=nl.sbuf)
        capped = None
        if self.softcap is None:
            nisa.activation(p, op=nl.exp, data=s_ps, scale=self.scale, bias=neg_lse)
        else:  # tanh is taken before the mask, so 1 - t^2 is finite on masked keys too, where P = 0 makes dS 0
            capped = nl.ndarray((bq, w), dtype=nl.float32, buffer=nl.sbuf)
            _tanh(capped, s_ps, self.scale / self.softcap)
            if len(_factors(self.softcap)) == 1:
                nisa.activation(p, op=nl.exp, data=capped, scale=self.softcap, bias=neg_lse)
            else:
                scores = nl.ndarray((bq, w), dtype=nl.float32, buffer=nl.sbuf)
                _multiply(scores, capped, self.softcap)
                nisa.activation(p, op=nl.exp, data=scores, bias=neg_lse)
        for _, j0, size in partition_chunks(w):
            _mask(p[:, j0:j0 + size], q0, a + j0, bq, size, self.shift, self.left, self.right, fill=0.0)
        dp = nl.ndarray((bq, w), dtype=dt, buffer=nl.sbuf)
        nisa.activation(dp, op=nl.copy, data=dp_ps, bias=neg_delta)
        ds = nl.ndarray((bq, w), dtype=dt, buffer=nl.sbuf)
        nisa.tensor_tensor(ds, p, dp, op=nl.multiply)
        if capped is not None:
            nisa.activation(capped, op=nl.square, data=capped)
            nisa.scalar_tensor_tensor(ds, data=capped, op0=nl.subtract, operand0=1.0, reverse0=True,
                                      op1=nl.multiply, operand1=ds)
        return p, ds

    def key_gradients(self, key, side, work, p, ds, g0, touched):
        """Stage two: dV += P^T dO and dK += dS^T Q per 128-key block (PSUM, over the group's query tiles), and
        dS^T per block for dQ (the first ``BACKWARD_TENSOR_TRANSPOSED`` on the Tensor Engine into one PSUM tile, one
        copy; the rest by DMA transpose)."""
        t, _, bq, a, z = work
        blocks = partition_chunks(z - a)
        on_tensor = blocks[:BACKWARD_TENSOR_TRANSPOSED]
        t_ps = self.transposes_ps.take()
        for j, j0, size in on_tensor:
            nisa.nc_transpose(t_ps[0:size, j, 0:bq], ds[:, j0:j0 + size])
        dsT = nl.ndarray((PMAX, len(blocks), bq), dtype=self.dt, buffer=nl.sbuf)
        rows = on_tensor[-1][2] if len(on_tensor) == 1 else PMAX  # only a last block is short
        nisa.tensor_copy(dsT[0:rows, 0:len(on_tensor), :], t_ps[0:rows, 0:len(on_tensor), 0:bq])
        for j, j0, size in blocks[len(on_tensor):]:
            nisa.dma_transpose(dsT[0:size, j, :], ds[:, j0:j0 + size])
        do_t, q_t = side["do_rows"][0:bq, t, :], side["q_rows"][0:bq, t, :]
        for j, j0, size in blocks:
            i = (a + j0 - g0) // PMAX  # the block's place in its group
            first = i not in touched
            touched.add(i)
            dv = self.dv_ps[i // self.dv_per_bank][0:size, i % self.dv_per_bank, :]
            nisa.nc_matmul(dv, p[:, j0:j0 + size], do_t, accumulate=not first)
            dk = self.dk_ps[i // self.dk_per_bank][0:size, i % self.dk_per_bank, :]
            nisa.nc_matmul(dk, ds[:, j0:j0 + size], q_t, accumulate=not first)
        return dsT

    def query_gradient(self, key, side, work, dsT):
        """Stage three: dQ += dS K over the group's blocks (PSUM), added into the query section's fp32 sum."""
        t, _, bq, a, z = work
        dq = self.dq_ps.take()[0:bq, :]
        for j, j0, size in partition_chunks(z - a):
            nisa.nc_matmul(dq, dsT[0:size, j, :], key["k_rows"][0:size, (a + j0 - key["s0"]) // PMAX, :],
                           accumulate=j > 0)
        _add_into(side["dq_sum"][0:bq, t, :], dq, t in side["summed"])
        side["summed"].add(t)

    def group(self, b, hkv, key, side, g0, gn, last_pass, last_section):
        """A 512-key group against every query tile of the query section that sees some of it, software-pipelined:
        a tile's P and dS, then the previous tile's dV, dK and dS^T, then dQ of the one before, so that no engine
        waits on the step before in the same tile. A block's dK and dV leave once the last tile that sees it is done:
        the last tiles first, under a causal mask the group's last blocks are done before its first."""
        work = []  # (tile, first row, rows, keys a..z of the group it sees), the last tiles first
        for t, t0, bq in reversed(partition_chunks(side["rn"])):
            k_first, k_stop = _key_blocks(side["r0"] + t0, bq, self.shift, self.Skv, self.left, self.right)
            a, z = max(k_first * B_K, g0), min(k_stop * B_K, self.Skv, g0 + gn)
            if a < z:
                work.append((t, side["r0"] + t0, bq, a, z))
        last_seen = {}  # the group's block -> the last work item that sees it
        for index, (_, _, _, a, z) in enumerate(work):
            for i in range((a - g0) // PMAX, (z - 1 - g0) // PMAX + 1):
                last_seen[i] = index
        first_block = (g0 - key["s0"]) // PMAX
        self.load_keys(key, g0, gn)
        touched, probabilities, transposed = set(), {}, {}
        for index in range(len(work) + 2):
            if index < len(work):
                self.load_rows(side, work[index][0])
                probabilities[index] = self.probabilities(key, side, *work[index])
            if 0 <= index - 1 < len(work):
                transposed[index - 1] = self.key_gradients(key, side, work[index - 1],
                                                           *probabilities.pop(index - 1), g0, touched)
                for i in sorted(i for i, seen in last_seen.items() if seen == index - 1):
                    self.finish_key_block(b, hkv, key, first_block, i, last_pass)
            if 0 <= index - 2 < len(work):
                t, q0, bq, a, _ = work[index - 2]
                self.query_gradient(key, side, work[index - 2], transposed.pop(index - 2))
                if last_section and a == max(_key_blocks(q0, bq, self.shift, self.Skv, self.left, self.right)[0]
                                             * B_K, key["s0"]):  # the tile's first keys here, its last group: dQ whole
                    self.write_query_tile(b, side, t, bq, last=True)
                    side["written"].add(t)
        if last_pass:  # the blocks no query tile sees: their zeros
            for i, _, _ in partition_chunks(gn):
                if i not in last_seen:
                    self.write_key_blocks(b, hkv, key, first_block + i, first_block + i + 1)

    def finish_key_block(self, b, hkv, key, first_block, i, last_pass):
        """The group's block ``i``, which no later tile of the group sees: its dK and dV from PSUM added into the
        section's sums, and written on the last pass."""
        block = first_block + i
        for sums, banks, per_bank in ((key["dk_sum"], self.dk_ps, self.dk_per_bank),
                                      (key["dv_sum"], self.dv_ps, self.dv_per_bank)):
            _add_into(sums[:, block, :], banks[i // per_bank][:, i % per_bank, :], block in key["summed"])
        key["summed"].add(block)
        if last_pass:
            self.write_key_blocks(b, hkv, key, block, block + 1)

    def finish_query_side(self, b, side, last):
        """After the groups: the sinks' terms of the tiles no group loaded (on the first key section), and the dQ of
        the tiles not yet written (:meth:`write_query_tile`)."""
        for t, _, bq in partition_chunks(side["rn"]):
            if self.sinks is not None and side["first"]:
                self.load_rows(side, t)
            if t not in side["written"]:
                self.write_query_tile(b, side, t, bq, last)

    def write_query_tile(self, b, side, t, bq, last):
        """A query tile's dQ sum, scaled, into dq (``last``: the last key section) or carried on in fp32 HBM."""
        rows = slice(side["r0"] + t * B_Q, side["r0"] + t * B_Q + bq)
        if t not in side["summed"]:  # no key seen yet
            nisa.memset(side["dq_sum"][0:bq, t, :], 0.0)
        if not last:
            nisa.dma_copy(self.carried[b, side["h"], rows, :], side["dq_sum"][0:bq, t, :])
            return
        dq_t = nl.ndarray((bq, self.D), dtype=self.dt, buffer=nl.sbuf)
        nisa.tensor_scalar(dq_t, side["dq_sum"][0:bq, t, :], op0=nl.multiply, operand0=self.scale,
                           engine=nisa.gpsimd_engine)
        nisa.dma_copy(self.dq[b, side["h"], rows, :], dq_t)

    def write_key_blocks(self, b, hkv, key, first, stop):
        """dK (scaled) and dV of the section's blocks ``first .. stop - 1``."""
        s0 = key["s0"]
        for sums, out, factor in ((key["dk_sum"], self.dk, self.scale), (key["dv_sum"], self.dv, 1.0)):
            cast = nl.ndarray((PMAX, stop - first, sums.shape[2]), dtype=self.dt, buffer=nl.sbuf)
            if all(block in key["summed"] for block in range(first, stop)):
                nisa.tensor_scalar(cast, sums[:, first:stop, :], op0=nl.multiply, operand0=factor,
                                   engine=nisa.gpsimd_engine)
            else:  # blocks no query sees
                nisa.memset(cast, 0.0)
            for j, j0, size in partition_chunks(key["sn"])[first:stop]:
                nisa.dma_copy(out[b, hkv, s0 + j0:s0 + j0 + size, :], cast[0:size, j - first, :])


@nki.jit
def attention_bwd_kernel(q, k, v, o, lse, do, sinks=None, dlse=None, scale=1.0, causal=False, window_left=None,
                         window_right=None, softcap=None, section_rows=None, section_keys=None):
    """Gradients ``(dq, dk, dv)``, and with ``sinks`` each row's share of theirs, ``-p_sink * delta``
    (``[B, Hq, Sq, 1]`` fp32, summed on the host); ``lse`` is ``[B, Hq, Sq, 1]`` float32 from the
    forward, ``dlse`` None or the gradient that reached it, laid out as it; the masks, softcap and sinks as
    :func:`attention_fwd_kernel`'s. ``section_rows`` / ``section_keys``: query rows (a multiple of 128) and keys
    (of 512) resident at a time (None: :func:`_backward_sections`)."""
    B, Hq, Sq, D = q.shape
    Hkv, Skv, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    rows_step, keys_step = _backward_sections(D, Dv, q.dtype)
    key_sections, row_sections = _sections(Skv, section_keys or keys_step), _sections(Sq, section_rows or rows_step)
    outputs = (nl.ndarray(q.shape, dtype=q.dtype, buffer=nl.shared_hbm),
               nl.ndarray(k.shape, dtype=q.dtype, buffer=nl.shared_hbm),
               nl.ndarray(v.shape, dtype=q.dtype, buffer=nl.shared_hbm),
               None if sinks is None else nl.ndarray((B, Hq, Sq, 1), dtype=nl.float32, buffer=nl.shared_hbm))
    # dQ's fp32 sum between key sections, when there are several
    carried = nl.ndarray((B, Hq, Sq, D), dtype=nl.float32, buffer=nl.private_hbm) if len(key_sections) > 1 else None
    bwd = _Backward(q, k, v, o, lse, do, sinks, dlse, outputs, carried, scale,
                    *_band(causal, window_left, window_right), softcap)
    for b in nl.affine_range(B):
        for hkv in nl.affine_range(Hkv):
            for s0, sn in key_sections:
                key = bwd.key_side(b, hkv, s0, sn)
                passes = [(hkv * G + g, r0, rn) for g in range(G) for r0, rn in row_sections]
                for h, r0, rn in passes:
                    side = bwd.query_side(b, h, r0, rn, first=s0 == 0)
                    # the last pass over a group finishes its dK and dV, the last key section each tile's dQ; the
                    # groups last to first: under a causal mask the first keys are seen by every query tile, so the
                    # last group is long and the dQ rows leave while it runs, not all at the end
                    for g0, gn in reversed(_sections(sn, SCORE_KEYS)):
                        bwd.group(b, hkv, key, side, s0 + g0, gn, last_pass=(h, r0) == passes[-1][:2],
                                  last_section=s0 + sn == Skv)
                    bwd.finish_query_side(b, side, last=s0 + sn == Skv)
    return outputs[:3] if sinks is None else outputs


# ----------------------------------------------------------------------------- host side
# The largest head dim the backend declares: the one tested. The kernels' own bound is 512: P V and the
# gradients hold a [rows, D] fp32 tile in one 2 KiB PSUM bank, and a matmul's moving free size is at most 512.
MAX_HEAD_DIM = 256


def attention_supports(call) -> list[str]:
    """Every window, softcap and sink is taken (the kernels' masks, cap and sink term), dtypes and head dims
    are declared (``BACKEND``): what is left is q, k and v agreeing, having sizes, options the engines can
    hold, and a head the compiler takes in one launch."""
    q = call["q"]
    reasons = options_reasons(call)
    sq, skv = q.shape[-2], call["k"].shape[-2]
    if sq == 0 or skv == 0 or q.shape[-1] == 0:
        reasons.append("NKI attention needs non-empty sequences and head dim")
    else:
        reasons += head_reasons(sq, skv, call)
    return reasons


def head_reasons(sq, skv, call) -> list[str]:
    """Why a head of ``sq`` queries over ``skv`` keys (with the call's mask) can't run: past the compiler's
    instructions in one launch."""
    needs = head_instructions(sq, skv, call["causal"], call.get("window"))
    if needs <= runtime.INSTRUCTION_BUDGET:
        return []
    return [f"one head of {sq} queries over {skv} keys takes up to {needs} instructions, past the Neuron compiler's "
            f"{runtime.INSTRUCTION_BUDGET} a launch"]


def head_instructions(sq, skv, causal, window) -> int:
    """At least the instructions the forward or the backward kernel issues for one query head, every option on:
    by the score tiles of 512 keys its query tiles see, and its query tiles and key blocks."""
    left, right = _band(causal, *(window or (None, None)))
    score_tiles = 0
    for q0 in range(0, sq, B_Q):
        first, stop = _key_blocks(q0, min(B_Q, sq - q0), skv - sq, skv, left, right)
        score_tiles += -(-(stop - first) * B_K // SCORE_KEYS)
    return 48 * score_tiles + 64 * (-(-sq // B_Q) + -(-skv // B_K)) + 200


def _in_launches(kernel, q, k, args, laid_out, per_head, static):
    """``kernel``'s outputs for every (batch, head) of ``q [B, Hq, ..]`` and ``k [B, Hkv, ..]``, in as many launches
    as the instruction budget needs, each taking some batch entries' KV heads with their query heads. ``args``
    (positional) and ``laid_out`` (keywords, or None): tensors laid out as q or k, told apart by their head count;
    ``per_head``: keywords ``[Hq, ..]``, or None."""
    (b, hq), hkv = q.shape[:2], k.shape[1]
    group = hq // hkv
    per_launch = max(1, runtime.INSTRUCTION_BUDGET // (group * head_instructions(
        q.shape[2], k.shape[2], static["causal"], (static["window_left"], static["window_right"]))))
    heads = min(hkv, per_launch)
    batch = max(1, per_launch // hkv) if heads == hkv else 1
    if batch >= b and heads == hkv:
        return launch(kernel, *args, **laid_out, **per_head, **static)
    rows = []
    for b0 in range(0, b, batch):
        parts = []
        for h0 in range(0, hkv, heads):
            def piece(t):
                if t is None:
                    return None
                first, width = (h0 * group, heads * group) if t.shape[1] == hq else (h0, heads)
                return t[b0:b0 + batch, first:first + width]

            parts.append(launch(kernel, *(piece(t).contiguous() for t in args),
                                **{name: piece(t) for name, t in laid_out.items()},
                                **{name: None if t is None else t[h0 * group:(h0 + heads) * group]
                                   for name, t in per_head.items()}, **static))
        rows.append(parts)
    return tuple(torch.cat([torch.cat([part[i] for part in parts], 1) for parts in rows])
                 for i in range(len(rows[0][0])))


def options_reasons(call) -> list[str]:
    """What dense and packed attention share: q, k and v in one dtype, and a scale the engines can take as the
    float32 immediate it is (a softcap out of float32's range is split in two)."""
    reasons = []
    if not (call["q"].dtype == call["k"].dtype == call["v"].dtype):
        reasons.append("NKI attention needs q, k and v in one dtype")
    scale = call.get("scale")
    if scale is not None and abs(float(scale)) > FLOAT32_MAX:
        reasons.append(f"NKI attention takes scale as a float32 immediate: at most {FLOAT32_MAX:.4g} in magnitude, "
                       f"got {float(scale):g}")
    return reasons


def _static(causal, scale, window, softcap):
    """The kernels' trace-time arguments, as plain Python numbers (one compiled kernel per value)."""
    left, right = window if window is not None else (None, None)
    return dict(scale=float(scale), causal=bool(causal),
                window_left=None if left is None else int(left), window_right=None if right is None else int(right),
                softcap=float(softcap) if softcap else None)  # 0 is off, as the public API's


def _sinks_down_partitions(sinks):
    """``[Hq]`` -> ``[Hq, 128, 1]`` float32: each head's sink on every partition a query tile uses."""
    return None if sinks is None else sinks.to(torch.float32).reshape(-1, 1, 1).expand(-1, B_Q, 1).contiguous()


def _fake_fwd(q, k, v, sinks, scale, causal, window_left, window_right, softcap):
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=torch.float32)


@kernel_op("attention_fwd", _fake_fwd)
def attention_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, scale: float,
                     causal: bool, window_left: int | None, window_right: int | None,
                     softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel's launch as the op ``portable_ops_nki::attention_fwd``: a contiguous ``out`` and
    ``lse [B, Hq, Sq]`` float32; differentiable in q, k, v and sinks (``[Hq]``) through the backward op."""
    out, lse = _in_launches(attention_fwd_kernel, q, k, (q.contiguous(), k.contiguous(), v.contiguous()), {},
                            dict(sinks=_sinks_down_partitions(sinks)),
                            dict(scale=scale, causal=causal, window_left=window_left, window_right=window_right,
                                 softcap=softcap))
    return out, lse.reshape(q.shape[:-1])


def _rows(t, q):
    """A ``[B, Hq, Sq]`` row vector as the kernels' ``[B, Hq, Sq, 1]`` float32 (None for None)."""
    return None if t is None else t.to(torch.float32).reshape(*q.shape[:-1], 1).contiguous()


def _dsinks_like(q, sinks):
    """The backward op's last output without its values: ``[Hq]`` in sinks' dtype, empty without sinks."""
    return q.new_empty(0, dtype=torch.float32) if sinks is None else sinks.new_empty(sinks.shape)


def _fake_bwd(q, k, v, out, lse, dout, sinks, dlse, scale, causal, window_left, window_right, softcap):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), _dsinks_like(q, sinks)


@kernel_op("attention_bwd", _fake_bwd)
def attention_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                     dout: torch.Tensor, sinks: torch.Tensor | None, dlse: torch.Tensor | None, scale: float,
                     causal: bool, window_left: int | None, window_right: int | None, softcap: float | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward kernel's launch as the op ``portable_ops_nki::attention_bwd``: contiguous ``(dq, dk, dv,
    dsinks)``, dsinks empty without sinks (an op's outputs are fixed)."""
    dq, dk, dv, *dsink_rows = _in_launches(
        attention_bwd_kernel, q, k, (q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), _rows(lse, q),
                                     dout.to(q.dtype).contiguous()),
        dict(dlse=_rows(dlse, q)), dict(sinks=_sinks_down_partitions(sinks)),
        dict(scale=scale, causal=causal, window_left=window_left, window_right=window_right, softcap=softcap))
    dsinks = dsink_rows[0].sum((0, 2, 3)).to(sinks.dtype) if sinks is not None else _dsinks_like(q, None)
    return dq, dk, dv, dsinks


def _save(ctx, inputs, output):
    q, k, v, sinks, *options = inputs
    ctx.save_for_backward(q, k, v, sinks, *output)
    ctx.options = options
    ctx.set_materialize_grads(False)  # no dlse unless lse was used


def _backward(ctx, dout, dlse):
    q, k, v, sinks, out, lse = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    dq, dk, dv, dsinks = attention_bwd_op(q, k, v, out, lse, dout, sinks, dlse, *ctx.options)
    return dq, dk, dv, dsinks if sinks is not None else None, *(None,) * len(ctx.options)


attention_fwd_op.op.register_autograd(_backward, setup_context=_save)


def attention_fwd(q, k, v, *, causal, scale, window=None, softcap=None, sinks=None):
    """The kernels take contiguous ``[B, H, S, D]``; ``out`` comes back in the layout
    portable_ops/layout.py gives q's output (a copy only when q's heads are inner to its sequence)."""
    out, lse = attention_fwd_op(q, k, v, sinks, **_static(causal, scale, window, softcap))
    return as_layout_of(out, q), lse


def attention_bwd(q, k, v, out, lse, dout, *, causal, scale, window=None, softcap=None, sinks=None, dlse=None):
    """``(dq, dk, dv)``, and ``dsinks`` after them when there are sinks."""
    dq, dk, dv, dsinks = attention_bwd_op(q, k, v, out, lse, dout, sinks, dlse,
                                          **_static(causal, scale, window, softcap))
    grads = as_layout_of(dq, q), as_layout_of(dk, k), as_layout_of(dv, v)
    return grads if sinks is None else (*grads, dsinks)
