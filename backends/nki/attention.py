"""Flash attention forward and backward as NKI kernels (online softmax, GQA, bottom-right causal,
sliding window, logit softcap).

Layout: a query tile holds up to 128 rows on the partitions; a key tile holds up to 128 keys.
V (and O, dO) may have a head dim of their own, ``Dv`` (DeepSeek's MLA): Q and K's ``D`` is
contracted in ``S`` and dQ, dK; ``Dv`` in ``dP = dO V^T``, and it is P V's free size.

Scores ``S = Q K^T`` come from ``nc_matmul(stationary=Q^T [D, bq], moving=K^T [D, bk])`` into
PSUM, so the head dim is the contraction, on the partitions. A head dim over 128 is split into
chunks of at most 128 partitions (``[128, n_chunks, rows]`` tiles) whose matmuls accumulate into
one PSUM tile; where D is a free size (``P V`` and the gradients, ``[rows, D]`` in PSUM) it needs
no split up to 512 fp32 per bank. ``Q^T`` / ``K^T`` / ``P^T`` are made on the Tensor Engine with
``nc_transpose``. Ragged
sequence lengths use smaller static edge tiles.

Masks are one band: query ``i`` sits at key position ``p = i + Skv - Sq`` and sees key ``j`` iff
``p - left <= j <= p + right`` (either side None: unbounded), where ``causal`` makes ``right``
at most 0 and ``window=(left, right)`` gives the sides (``visible`` in the reference). Key blocks
wholly outside the band of a query tile are skipped at trace time (and query tiles wholly outside
a key block's, in the dK/dV pass), so a window of W keys costs O(W) per query, not O(Skv); only
blocks that a band edge crosses get a GpSimd ``affine_select`` (one per edge). A softcap replaces
each scaled score ``s`` by ``softcap * tanh(s / softcap)`` before the mask: the Scalar Engine's
``tanh`` as the scores leave PSUM, its output kept for the backward's ``1 - tanh^2``. GQA reads
K/V head ``h // (Hq // Hkv)`` in place (query heads loop inside their KV head), never a repeated
copy.

Sinks (one logit per query head) join each row's denominator once, after its last key block; the
host hands each head's sink down the partitions (``[Hq, 128, 1]``), so a query tile loads its column
in one DMA.

Forward returns ``out`` and ``lse`` (float32, natural log; ``-inf`` and zero output for rows that
see no key; with sinks their lse is the sink). Backward recomputes P from ``lse`` (the sunk lse:
the sinked probabilities) in two passes: dQ with query tiles outside, then dK/dV with key tiles
outside and every query head of the group inside, so dK/dV are summed over the group in SBUF.
The dQ pass also writes each row's share of the sinks' gradient, ``-p_sink * delta``, which the
host sums. Semantics: ``backends/reference/attention.py``.
"""

from __future__ import annotations

import math

import torch

from portable_ops.layout import as_layout_of

from .compat import nki, nisa, nl
from .runtime import kernel_op, launch

B_Q = 128  # query rows per tile (partition axis)
B_K = 128  # keys per tile (P^T needs the keys on <= 128 partitions)
NEG = -1.0e30  # finite "minus infinity" for masked scores: exp(NEG - m) == 0, no inf - inf
PMAX = 128  # partitions: the most a matmul contracts over, and a transpose's largest side
SCORE_KEYS = 512  # keys per forward score tile: one PSUM bank of fp32, a matmul's largest moving free size
TENSOR_TRANSPOSED = 2  # of a score tile's four P blocks, how many the Tensor Engine transposes (the DMA the rest)
SCORED_AHEAD = 2  # query tiles whose scores are issued before a tile's P V
RESIDENT_BYTES = 96 * 1024  # SBUF per partition for a section's resident K^T and V
WORKING_BYTES = 48 * 1024  # and for one query tile's scores, P and P^T (the allocator double-buffers them)


def _transposed(src, rows, cols, dtype):
    """``src [rows, cols]`` (SBUF, ``cols <= 128``) -> ``[cols, rows]`` in SBUF, through a Tensor Engine
    transpose (into PSUM in ``src``'s dtype, as nc_transpose requires)."""
    t_ps = nl.ndarray((cols, rows), dtype=src.dtype, buffer=nl.psum)
    nisa.nc_transpose(t_ps, src)
    t_sb = nl.ndarray((cols, rows), dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_copy(t_sb, t_ps)
    return t_sb


def _chunks(n):
    """``(index, start, size)`` of the pieces of at most 128 that a dimension of ``n`` splits into."""
    return [(c, c0, min(PMAX, n - c0)) for c, c0 in enumerate(range(0, n, PMAX))]


def _transposed_chunks(src, rows, cols, dtype):
    """``src [rows, cols]`` (SBUF) -> ``[min(cols, 128), n_chunks, rows]`` in SBUF: chunk ``c`` is
    ``src[:, c0:c0 + size]`` transposed, on its first ``size`` partitions (the layout
    :func:`_matmul_chunked` contracts over). All chunks share one PSUM tile (in ``src``'s dtype, as
    nc_transpose requires; a bank holds ``n_chunks * rows <= 512`` of them), so a wider head dim
    costs no extra PSUM bank."""
    chunks = _chunks(cols)
    shape = (min(cols, PMAX), len(chunks), rows)
    t_ps = nl.ndarray(shape, dtype=src.dtype, buffer=nl.psum)
    for c, c0, size in chunks:
        nisa.nc_transpose(t_ps[0:size, c, :], src[:, c0:c0 + size])
    t_sb = nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf)
    full, ragged = divmod(cols, PMAX)
    if full:  # the full chunks in one copy
        nisa.tensor_copy(t_sb[:, 0:full, :], t_ps[:, 0:full, :])
    if ragged:  # only the written partitions of the last chunk
        nisa.tensor_copy(t_sb[0:ragged, full, :], t_ps[0:ragged, full, :])
    return t_sb


def _matmul_chunked(dst, stationary, moving, contraction):
    """``dst = stationary^T moving`` over a contraction that may exceed the 128 partitions: both
    operands are in :func:`_transposed_chunks`' layout, and the chunk matmuls accumulate into the
    one PSUM tile ``dst``."""
    for c, _, size in _chunks(contraction):
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


def _query_tiles(k0, bk, shift, Sq, left, right):
    """``(first, stop)``: the query tiles with some row that sees a key of ``[k0, k0 + bk)``; key
    ``j`` is seen by positions ``j - right .. j + left``, query rows ``i = p - shift``."""
    lo = 0 if right is None else max(0, k0 - right - shift)
    hi = Sq - 1 if left is None else min(Sq - 1, k0 + bk - 1 + left - shift)
    return (lo // B_Q, hi // B_Q + 1) if lo <= hi else (0, 0)


def _cuts(q0, k0, bq, bk, shift, left, right):
    """``(right_cut, left_cut)``: whether the band's right edge (the block's last key is past row 0's band) and its
    left edge (the block's first key is before the last row's) cut the block ``[k0, k0 + bk)`` of the query tile."""
    return (right is not None and k0 + bk - 1 > q0 + shift + right,
            left is not None and k0 < q0 + bq - 1 + shift - left)


def _mask(s, q0, k0, bq, bk, shift, left, right):
    """Scores outside the band -> NEG, on edge blocks only. With ``d = (q0 + r + shift) - (k0 + c)``
    (the query's position minus the key's, ``r`` the partition and ``c`` the free index), key
    ``k0 + c`` is visible iff ``-right <= d <= left``: one affine_select per side that cuts the block.

    A row with no visible key in this block (but some in another) gets weights exp(NEG - NEG) = 1
    here while its running max is still NEG; its first visible score rescales them by
    exp(NEG - m) = 0, and rows with no visible key anywhere are overwritten by _rows_without_keys."""
    right_cut, left_cut = _cuts(q0, k0, bq, bk, shift, left, right)
    if right_cut:
        nisa.affine_select(s, pattern=[[-1, bk]], offset=q0 + shift - k0 + right, channel_multiplier=1,
                           on_true_tile=s, on_false_value=NEG, cmp_op=nl.greater_equal)
    if left_cut:
        nisa.affine_select(s, pattern=[[-1, bk]], offset=q0 + shift - k0 - left, channel_multiplier=1,
                           on_true_tile=s, on_false_value=NEG, cmp_op=nl.less_equal)


def _scores(qT, kT, D, bq, bk, q0, k0, shift, scale, left, right, softcap):
    """Scaled, capped, masked scores ``[bq, bk]`` in float32 SBUF, and ``tanh(scale * QK^T / softcap)``
    for the softcap's derivative (None without a softcap)."""
    s_ps = nl.ndarray((bq, bk), dtype=nl.float32, buffer=nl.psum)
    _matmul_chunked(s_ps, qT, kT, D)
    s = nl.ndarray((bq, bk), dtype=nl.float32, buffer=nl.sbuf)
    t = None
    if softcap is None:
        nisa.activation(s, op=nl.copy, data=s_ps, scale=scale)
    else:
        # The activation's pre-scale takes scale / softcap for free as the scores leave PSUM; the
        # Scalar Engine's tanh is valid on [-inf, inf], so huge scores saturate at +-softcap.
        t = nl.ndarray((bq, bk), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(t, op=nl.tanh, data=s_ps, scale=scale / softcap)
        nisa.tensor_scalar(s, t, op0=nl.multiply, operand0=softcap)
    _mask(s, q0, k0, bq, bk, shift, left, right)  # after the cap, as the reference: capped scores are masked
    return s, t


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


def _itemsize(dtype):
    return 4 if dtype == nl.float32 else 2


def _section_keys(D, Dv, dtype):
    """Keys per resident section: the most whole score tiles whose K^T and V fit ``RESIDENT_BYTES`` per partition
    and whose one query tile's scores (fp32), P and P^T fit ``WORKING_BYTES``, at least one tile."""
    size = _itemsize(dtype)
    resident = len(_chunks(D)) * size + (Dv + 1) * size / PMAX  # K^T [D, keys]; V [128 keys, blocks, Dv + 1]
    working = 4 + 2 * size  # scores, P, P^T (bq = 128 columns per 128 keys)
    tiles = min(RESIDENT_BYTES / resident, WORKING_BYTES / working) // SCORE_KEYS
    return SCORE_KEYS * max(1, int(tiles))


def _transposed_rows(src, n, width, dt):
    """HBM ``src [n, width]`` -> ``[min(width, 128), chunks, n]`` in SBUF by DMA transposes, one per 128 columns
    and score tile of rows (so that the first tile's work need not wait for the whole section)."""
    dst = nl.ndarray((min(width, PMAX), len(_chunks(width)), n), dtype=dt, buffer=nl.sbuf)
    for r0 in range(0, n, SCORE_KEYS):
        rows = slice(r0, min(n, r0 + SCORE_KEYS))
        for c, c0, size in _chunks(width):
            nisa.dma_transpose(dst[0:size, c, rows], src[rows, c0:c0 + size])
    return dst


def _pieces(k_lo, k_hi, q0, bq, shift, left, right):
    """The score tiles ``(k0, n)`` of up to ``SCORE_KEYS`` keys over ``[k_lo, k_hi)``, each with its pieces
    ``(k0, n, cut)``: the 128-key blocks a band edge cuts (``cut``) alone, runs of the others merged."""
    tiles = []
    for t0 in range(k_lo, k_hi, SCORE_KEYS):
        pieces = []
        for _, j0, size in _chunks(min(SCORE_KEYS, k_hi - t0)):
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
        # the eight banks: scores, Tensor Engine transposes (four 128-column slots each), [P V, rowsum]
        self.scores_ps = _PsumRing(4, (B_Q, SCORE_KEYS), nl.float32)
        self.transposes_ps = _PsumRing(2, (PMAX, 4, PMAX), self.dt)
        self.pv_ps = _PsumRing(2, (B_Q, self.Dv + 1), nl.float32)

    def resident(self, b, hkv, s0, n):
        """Keys ``[s0, s0 + n)`` of KV head ``hkv`` on chip: ``K^T [min(D, 128), chunks, n]``, and ``V [128,
        blocks, Dv + 1]`` (block ``j`` holds keys ``s0 + 128 j ..`` on the partitions), its last column ones, so
        that P V's last column is P's row sum. Both come in as DMA transposes from HBM (one long run per partition,
        where V's rows would be 2 * Dv bytes each); V is turned back per block on the Tensor Engine."""
        Dv, dt = self.Dv, self.dt
        kT, vT = (_transposed_rows(x[b, hkv, s0:s0 + n, :], n, width, dt) for x, width in ((self.k, self.D),
                                                                                             (self.v, Dv)))
        blocks, chunks = _chunks(n), _chunks(Dv)
        v_sb = nl.ndarray((PMAX, len(blocks), Dv + 1), dtype=dt, buffer=nl.sbuf)
        per_tile = 4 // len(chunks)  # blocks per PSUM tile: a slot per (block, 128 columns of Dv)
        for g0 in range(0, len(blocks), per_tile):
            group = blocks[g0:g0 + per_tile]
            t_ps = self.transposes_ps.take()
            for i, (_, j0, size) in enumerate(group):
                for c, c0, width in chunks:
                    nisa.nc_transpose(t_ps[0:size, i * len(chunks) + c, 0:width], vT[0:width, c, j0:j0 + size])
            full = len(group) - (group[-1][2] < PMAX)  # only the section's last block can be short
            for c, c0, width in chunks:
                slots = slice(c, len(group) * len(chunks), len(chunks))
                if full:
                    nisa.tensor_copy(v_sb[:, g0:g0 + full, c0:c0 + width], t_ps[:, slots, 0:width][:, 0:full, :])
                if full < len(group):
                    rows, slot = group[-1][2], full * len(chunks) + c
                    nisa.tensor_copy(v_sb[0:rows, g0 + full, c0:c0 + width], t_ps[0:rows, slot, 0:width])
        nisa.memset(v_sb[:, :, Dv:Dv + 1], 1.0)
        return kT, v_sb

    def scores_stage(self, b, h, q0, bq, kT, s0, sn):
        """The first half of a query tile's work on a section: its visible keys there, Q^T, the scores and their
        max; a dict for :meth:`output_stage`, ``tiles`` None when the tile sees no key of the section."""
        k_first, k_stop = _key_blocks(q0, bq, self.shift, self.Skv, self.left, self.right)
        k_lo, k_hi = max(k_first * B_K, s0), min(k_stop * B_K, self.Skv, s0 + sn)
        stage = dict(h=h, q0=q0, bq=bq, first=k_first * B_K >= s0, last=min(k_stop * B_K, self.Skv) <= s0 + sn,
                     blind=s0 == 0 and k_first == k_stop, tiles=None)
        if k_lo < k_hi:
            qT = _transposed_rows(self.q[b, h, q0:q0 + bq, :], bq, self.D, self.dt)
            stage["tiles"] = _pieces(k_lo, k_hi, q0, bq, self.shift, self.left, self.right)
            stage["s"], stage["neg_m"] = self.section_scores(qT, kT, s0, stage["tiles"], bq, q0)
        return stage

    def section_scores(self, qT, kT, s0, tiles, bq, q0):
        """Scaled, capped, masked scores of the keys ``tiles`` cover (fp32 ``[bq, keys]``, SBUF) and their row max,
        negated (``[bq, 1]``): each 512-key tile's PSUM is evacuated with the scale and the max of each of its
        pieces in one Vector instruction; a piece an edge cuts is scaled, masked (GpSimd), then its max taken."""
        k_lo = tiles[0][0][0]
        s = nl.ndarray((bq, tiles[-1][0][0] + tiles[-1][0][1] - k_lo), dtype=nl.float32, buffer=nl.sbuf)
        maxima = nl.ndarray((bq, sum(len(p) for _, p in tiles)), dtype=nl.float32, buffer=nl.sbuf)
        column = 0
        for (t0, tn), pieces in tiles:
            s_ps = self.scores_ps.take()[0:bq, 0:tn]
            _matmul_chunked(s_ps, qT, kT[:, :, t0 - s0:t0 - s0 + tn], self.D)
            src, factor = s_ps, self.scale
            if self.softcap is not None:  # the scale / softcap pre-scale is free as the scores leave PSUM
                src, factor = nl.ndarray((bq, tn), dtype=nl.float32, buffer=nl.sbuf), self.softcap
                nisa.activation(src, op=nl.tanh, data=s_ps, scale=self.scale / self.softcap)
            for p0, pn, cut in pieces:
                dst, piece = s[:, p0 - k_lo:p0 - k_lo + pn], src[:, p0 - t0:p0 - t0 + pn]
                peak = maxima[:, column:column + 1]
                if cut:
                    nisa.tensor_scalar(dst, piece, op0=nl.multiply, operand0=factor)
                    _mask(dst, q0, p0, bq, pn, self.shift, self.left, self.right)
                    nisa.tensor_reduce(peak, op=nl.maximum, data=dst, axis=1, keepdims=True)
                else:
                    nisa.tensor_scalar_reduce(dst, piece, op0=nl.multiply, operand0=factor, reduce_op=nl.maximum,
                                              reduce_res=peak)
                column += 1
        neg_m = nl.ndarray((bq, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(neg_m, op=nl.maximum, data=maxima, axis=1, negate=True, keepdims=True)
        return s, neg_m

    def probabilities_stage(self, stage, b, s0):
        """The second: the row max joined with the state carried from earlier sections, ``P = exp(s - m)`` (one
        exponential per score tile) and P^T per 128-key block (the first ``TENSOR_TRANSPOSED`` of a tile's blocks
        on the Tensor Engine, copied out of PSUM by the Scalar Engine, the rest by DMA)."""
        tiles, h, q0, bq, Dv, dt = stage["tiles"], stage["h"], stage["q0"], stage["bq"], self.Dv, self.dt
        if tiles is None:
            return stage
        s, neg_m = stage["s"], stage["neg_m"]
        if not stage["first"]:  # the max over both, the carried sums to be rescaled to it
            stage["carried"] = carried = _load(self.carried[b, h, q0:q0 + bq, 0:Dv + 2], bq, Dv + 2, nl.float32)
            nisa.tensor_tensor(neg_m, neg_m, carried[:, Dv + 1:Dv + 2], op=nl.minimum)
            stage["alpha"] = nl.ndarray((bq, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(stage["alpha"], op=nl.exp, data=carried[:, Dv + 1:Dv + 2], scale=-1.0, bias=neg_m)
        k_lo = tiles[0][0][0]
        p = nl.ndarray(s.shape, dtype=dt, buffer=nl.sbuf)
        stage["pT"] = pT = nl.ndarray((PMAX, len(_chunks(s.shape[1])), bq), dtype=dt, buffer=nl.sbuf)
        for (t0, tn), _ in tiles:  # every exponential first: the Scalar Engine's copies below wait on transposes
            nisa.activation(p[:, t0 - k_lo:t0 - k_lo + tn], op=nl.exp, data=s[:, t0 - k_lo:t0 - k_lo + tn],
                            bias=neg_m)
        for (t0, tn), _ in tiles:
            keys = slice(t0 - k_lo, t0 - k_lo + tn)
            blocks, block0 = _chunks(tn), (t0 - k_lo) // PMAX
            on_tensor = blocks[:TENSOR_TRANSPOSED]
            t_ps = self.transposes_ps.take()
            for j, j0, size in on_tensor:
                nisa.nc_transpose(t_ps[0:size, j, 0:bq], p[:, keys.start + j0:keys.start + j0 + size])
            rows = on_tensor[-1][2] if len(on_tensor) == 1 else PMAX  # only a last block is short
            nisa.tensor_copy(pT[0:rows, block0:block0 + len(on_tensor), :], t_ps[0:rows, 0:len(on_tensor), 0:bq],
                             engine=nisa.scalar_engine)
            for j, j0, size in blocks[len(on_tensor):]:
                nisa.dma_transpose(pT[0:size, block0 + j, :], p[:, keys.start + j0:keys.start + j0 + size])
        return stage

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
            for j, j0, size in _chunks(tn):
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
            nisa.tensor_copy(l_sum, acc[:, Dv:Dv + 1])
        sinks = self.sinks
        decay = None if sinks is None else _neg_max_with_sink(neg_m, l_sum, _sink_column(sinks, h, bq), bq)
        # A real row's sum is >= 1 (its max term, a key's or its sink's, is exp(0)); one that sees nothing sums to
        # 0 and is overwritten below, one with a key scoring +inf is NaN (its acc too): 1 in both keeps reciprocal
        # and log in their domains. The one-column steps run on GpSimd and the Scalar Engine where they can, off
        # the Vector Engine's score evacuations.
        l_safe = nl.ndarray((bq, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(l_safe, l_sum, op0=nl.maximum, operand0=1.0, engine=nisa.gpsimd_engine)
        real = nl.ndarray((bq, 1), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.tensor_scalar(real, l_sum, op0=nl.less_equal, operand0=float(2 ** 60),  # NaN: false
                           engine=nisa.gpsimd_engine)
        nisa.tensor_copy_predicated(dst=l_safe, src=1.0, predicate=real, reverse_pred=True)
        inv_l = nl.ndarray((bq, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(inv_l, l_safe)
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
        nisa.scalar_tensor_tensor(lse_t, data=l_sum, op0=nl.multiply, operand0=0.0, op1=nl.add, operand1=lse_t)
        nisa.tensor_tensor(lse_t, lse_t, neg_m, op=nl.subtract, engine=nisa.gpsimd_engine)
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
                kT, v_sb = fwd.resident(b, hkv, s0, sn)
                # software-pipelined: a query tile's scores are issued SCORED_AHEAD tiles ahead of its P, and its
                # P (and P^T) a tile ahead of its P V, so none of them waits on another's engines or transfers
                jobs = [(hkv * G + g, qi) for g in range(G) for qi in range(n_q)]
                scored, transposed = [], []
                for index in range(len(jobs) + SCORED_AHEAD):
                    if index < len(jobs):
                        h, qi = jobs[index]
                        scored.append(fwd.scores_stage(b, h, qi * B_Q, min(B_Q, Sq - qi * B_Q), kT, s0, sn))
                    if len(scored) > SCORED_AHEAD or (scored and index >= len(jobs)):
                        transposed.append(fwd.probabilities_stage(scored.pop(0), b, s0))
                    if len(transposed) > 1:
                        fwd.output_stage(transposed.pop(0), b, v_sb, s0)
                for stage in transposed:
                    fwd.output_stage(stage, b, v_sb, s0)
    return out, lse


def _query_side(q, o, do, lse, dlse, b, h, q0, bq, D, Dv, dt, shift, right, sunk):
    """Per query tile: Q, dO, their transposes, -lse (NEG for rows without keys, unless ``sunk``: their
    lse is then their sink) and delta = rowsum(dO * O), less the gradient that reached lse (``dlse``, or
    None: d lse / d s = P)."""
    q_sb = _load(q[b, h, q0:q0 + bq, 0:D], bq, D, dt)
    do_sb = _load(do[b, h, q0:q0 + bq, 0:Dv], bq, Dv, dt)
    o_sb = _load(o[b, h, q0:q0 + bq, 0:Dv], bq, Dv, dt)
    qT = _transposed_chunks(q_sb, bq, D, dt)
    doT = _transposed_chunks(do_sb, bq, Dv, dt)
    lse_t = _load(lse[b, h, q0:q0 + bq, 0:1], bq, 1, nl.float32)
    neg_lse = nl.ndarray((bq, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(neg_lse, lse_t, op0=nl.multiply, operand0=-1.0)
    if not sunk:
        _rows_without_keys(neg_lse, q0, shift, right, 1, NEG)  # lse = -inf there: P must be 0, not exp(+inf)
    prod = nl.ndarray((bq, Dv), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(prod, do_sb, o_sb, op=nl.multiply)
    delta = nl.ndarray((bq, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(delta, op=nl.add, data=prod, axis=1, keepdims=True)
    if dlse is not None:
        nisa.tensor_tensor(delta, delta, _load(dlse[b, h, q0:q0 + bq, 0:1], bq, 1, nl.float32), op=nl.subtract)
    return q_sb, do_sb, qT, doT, neg_lse, delta


def _probs_and_dscores(qT, kT, doT, vT, neg_lse, delta, D, Dv, bq, bk, q0, k0, shift, scale, left, right, softcap):
    """P = exp(S - lse) and dS = P * (dO V^T - delta), both ``[bq, bk]`` float32; under a softcap dS
    is taken back through it, times ``1 - tanh^2``, so that it is the derivative by the scaled scores."""
    s, t = _scores(qT, kT, D, bq, bk, q0, k0, shift, scale, left, right, softcap)
    p = nl.ndarray((bq, bk), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(p, op=nl.exp, data=s, bias=neg_lse)
    dp_ps = nl.ndarray((bq, bk), dtype=nl.float32, buffer=nl.psum)
    _matmul_chunked(dp_ps, doT, vT, Dv)
    ds = nl.ndarray((bq, bk), dtype=nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(ds, data=dp_ps, op0=nl.subtract, operand0=delta, op1=nl.multiply, operand1=p)
    if t is not None:
        # tanh is taken before the mask, so 1 - t^2 is finite on masked keys too, where P = 0 made dS 0.
        t2 = nl.ndarray((bq, bk), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(t2, op=nl.square, data=t)  # on the Scalar Engine, beside VectorE's dS work
        nisa.scalar_tensor_tensor(ds, data=t2, op0=nl.subtract, operand0=1.0, reverse0=True,
                                  op1=nl.multiply, operand1=ds)
    return p, ds


def _cast(src, rows, cols, dtype):
    if src.dtype == dtype:
        return src
    dst = nl.ndarray((rows, cols), dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst, src)
    return dst


@nki.jit
def attention_bwd_kernel(q, k, v, o, lse, do, sinks=None, dlse=None, scale=1.0, causal=False, window_left=None,
                         window_right=None, softcap=None):
    """Gradients ``(dq, dk, dv)``, and with ``sinks`` each row's share of theirs, ``-p_sink * delta``
    (``[B, Hq, Sq, 1]`` fp32, summed on the host); ``lse`` is ``[B, Hq, Sq, 1]`` float32 from the
    forward, ``dlse`` None or the gradient that reached it, laid out as it; the masks, softcap and sinks as
    :func:`attention_fwd_kernel`'s."""
    B, Hq, Sq, D = q.shape
    Hkv, Skv, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    dt = q.dtype
    shift = Skv - Sq
    left, right = _band(causal, window_left, window_right)
    dq = nl.ndarray(q.shape, dtype=dt, buffer=nl.shared_hbm)
    dk = nl.ndarray(k.shape, dtype=dt, buffer=nl.shared_hbm)
    dv = nl.ndarray(v.shape, dtype=dt, buffer=nl.shared_hbm)
    dsink_rows = None if sinks is None else nl.ndarray((B, Hq, Sq, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    sunk = sinks is not None
    n_q = (Sq + B_Q - 1) // B_Q
    n_k = (Skv + B_K - 1) // B_K

    # Pass 1: dQ = scale * dS K, query tiles outside.
    for b in nl.affine_range(B):
        for hkv in nl.affine_range(Hkv):
            for g in nl.affine_range(G):
                h = hkv * G + g
                for qi in nl.static_range(n_q):
                    q0 = qi * B_Q
                    bq = min(B_Q, Sq - q0)
                    _, _, qT, doT, neg_lse, delta = _query_side(q, o, do, lse, dlse, b, h, q0, bq, D, Dv, dt, shift,
                                                                right, sunk)
                    if sunk:  # p_sink = exp(sink - lse); its row's term -p_sink * delta
                        p_sink = nl.ndarray((bq, 1), dtype=nl.float32, buffer=nl.sbuf)
                        nisa.activation(p_sink, op=nl.exp, data=_sink_column(sinks, h, bq), bias=neg_lse)
                        term = nl.ndarray((bq, 1), dtype=nl.float32, buffer=nl.sbuf)
                        nisa.scalar_tensor_tensor(term, data=delta, op0=nl.multiply, operand0=-1.0, op1=nl.multiply,
                                                  operand1=p_sink)
                        nisa.dma_copy(dsink_rows[b, h, q0:q0 + bq, 0:1], term)
                    dq_acc = nl.zeros((bq, D), dtype=nl.float32, buffer=nl.sbuf)
                    k_first, k_stop = _key_blocks(q0, bq, shift, Skv, left, right)
                    for ki in nl.static_range(k_first, k_stop):
                        k0 = ki * B_K
                        bk = min(B_K, Skv - k0)
                        k_sb = _load(k[b, hkv, k0:k0 + bk, 0:D], bk, D, dt)
                        v_sb = _load(v[b, hkv, k0:k0 + bk, 0:Dv], bk, Dv, dt)
                        kT = _transposed_chunks(k_sb, bk, D, dt)
                        vT = _transposed_chunks(v_sb, bk, Dv, dt)
                        _, ds = _probs_and_dscores(qT, kT, doT, vT, neg_lse, delta, D, Dv, bq, bk, q0, k0, shift, scale,
                                                   left, right, softcap)
                        dsT = _transposed(_cast(ds, bq, bk, dt), bq, bk, dt)
                        dq_ps = nl.ndarray((bq, D), dtype=nl.float32, buffer=nl.psum)
                        nisa.nc_matmul(dq_ps, dsT, k_sb, accumulate=False)
                        nisa.tensor_tensor(dq_acc, dq_acc, dq_ps, op=nl.add)
                    dq_t = nl.ndarray((bq, D), dtype=dt, buffer=nl.sbuf)
                    nisa.tensor_scalar(dq_t, dq_acc, op0=nl.multiply, operand0=scale)
                    nisa.dma_copy(dq[b, h, q0:q0 + bq, 0:D], dq_t)

    # Pass 2: dV = P^T dO and dK = scale * dS^T Q, key tiles outside, summed over the GQA group.
    for b in nl.affine_range(B):
        for hkv in nl.affine_range(Hkv):
            for ki in nl.static_range(n_k):
                k0 = ki * B_K
                bk = min(B_K, Skv - k0)
                k_sb = _load(k[b, hkv, k0:k0 + bk, 0:D], bk, D, dt)
                v_sb = _load(v[b, hkv, k0:k0 + bk, 0:Dv], bk, Dv, dt)
                kT = _transposed_chunks(k_sb, bk, D, dt)
                vT = _transposed_chunks(v_sb, bk, Dv, dt)
                dk_acc = nl.zeros((bk, D), dtype=nl.float32, buffer=nl.sbuf)
                dv_acc = nl.zeros((bk, Dv), dtype=nl.float32, buffer=nl.sbuf)
                q_first, q_stop = _query_tiles(k0, bk, shift, Sq, left, right)
                for g in nl.static_range(G):
                    h = hkv * G + g
                    for qi in nl.static_range(q_first, q_stop):
                        q0 = qi * B_Q
                        bq = min(B_Q, Sq - q0)
                        q_sb, do_sb, qT, doT, neg_lse, delta = _query_side(q, o, do, lse, dlse, b, h, q0, bq, D,
                                                                            Dv, dt, shift, right, sunk)
                        p, ds = _probs_and_dscores(qT, kT, doT, vT, neg_lse, delta, D, Dv, bq, bk, q0, k0, shift,
                                                   scale, left, right, softcap)
                        dv_ps = nl.ndarray((bk, Dv), dtype=nl.float32, buffer=nl.psum)
                        nisa.nc_matmul(dv_ps, _cast(p, bq, bk, dt), do_sb, accumulate=False)
                        nisa.tensor_tensor(dv_acc, dv_acc, dv_ps, op=nl.add)
                        dk_ps = nl.ndarray((bk, D), dtype=nl.float32, buffer=nl.psum)
                        nisa.nc_matmul(dk_ps, _cast(ds, bq, bk, dt), q_sb, accumulate=False)
                        nisa.tensor_tensor(dk_acc, dk_acc, dk_ps, op=nl.add)
                dk_t = nl.ndarray((bk, D), dtype=dt, buffer=nl.sbuf)
                nisa.tensor_scalar(dk_t, dk_acc, op0=nl.multiply, operand0=scale)
                nisa.dma_copy(dk[b, hkv, k0:k0 + bk, 0:D], dk_t)
                dv_t = _cast(dv_acc, bk, Dv, dt)
                nisa.dma_copy(dv[b, hkv, k0:k0 + bk, 0:Dv], dv_t)
    return (dq, dk, dv) if dsink_rows is None else (dq, dk, dv, dsink_rows)


# ----------------------------------------------------------------------------- host side
# The largest head dim the backend declares: the one tested. The kernels' own bound is 512: P V and the
# gradients hold a [rows, D] fp32 tile in one 2 KiB PSUM bank, and a matmul's moving free size is at most 512.
MAX_HEAD_DIM = 256


def attention_supports(call) -> list[str]:
    """Every window, softcap and sink is taken (the kernels' masks, cap and sink term), dtypes and head dims
    are declared (``BACKEND``): what is left is q, k and v agreeing, and having sizes."""
    q, k, v = call["q"], call["k"], call["v"]
    reasons = []
    if not (q.dtype == k.dtype == v.dtype):
        reasons.append("NKI attention needs q, k and v in one dtype")
    if q.shape[-2] == 0 or k.shape[-2] == 0 or q.shape[-1] == 0:
        reasons.append("NKI attention needs non-empty sequences and head dim")
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
    out, lse = launch(attention_fwd_kernel, q.contiguous(), k.contiguous(), v.contiguous(),
                      sinks=_sinks_down_partitions(sinks), scale=scale, causal=causal, window_left=window_left,
                      window_right=window_right, softcap=softcap)
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
    dq, dk, dv, *dsink_rows = launch(attention_bwd_kernel, q.contiguous(), k.contiguous(), v.contiguous(),
                                     out.contiguous(), _rows(lse, q), dout.to(q.dtype).contiguous(),
                                     sinks=_sinks_down_partitions(sinks), dlse=_rows(dlse, q), scale=scale,
                                     causal=causal, window_left=window_left, window_right=window_right,
                                     softcap=softcap)
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
