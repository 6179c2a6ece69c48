"""Flash attention forward as an NKI kernel (GQA, bottom-right causal, sliding window, logit softcap, sinks, a
head dim of V's own); what it shares with the backward (layout, masks, transposes): ``attention_tiles.py``.

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

Sinks join each row's denominator once, at its end. The kernel returns ``out`` and ``lse`` (float32, natural log;
``-inf`` and zero output for rows that see no key; with sinks their lse is the sink). Semantics:
``backends/reference/attention.py``.
"""
from __future__ import annotations

import math

from .compat import nki, nisa, nl
from .attention_tiles import (B_K, B_Q, FLOAT32_MAX, NEG, PMAX, SCORE_KEYS, _band, _cuts, _factors, _itemsize,
                              _key_blocks, _load, _mask, _matmul_chunked, _multiply, _PsumRing, _rows_without_keys,
                              _sink_column, _tanh, _transposed_rows, _transposed_rows_of, _turn_back,
                              partition_chunks)

# of each score tile's four P blocks, how many the Tensor Engine transposes, tile by tile in turn (the DMA the rest):
# the Scalar Engine copies those out of PSUM, so this balances its time against the DMA queues'
TENSOR_TRANSPOSED = (1, 2, 1, 1)
SCORED_AHEAD = 2  # query tiles whose scores are issued before a tile's P V
RESIDENT_BYTES = 96 * 1024  # SBUF per partition for a section's resident K^T and V
WORKING_BYTES = 48 * 1024  # and for one query tile's scores, P and P^T (the pipeline holds a few such at once)


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


def _section_keys(D, Dv, dtype):
    """Keys per resident section: the most whole score tiles whose K^T and V fit ``RESIDENT_BYTES`` per partition
    and whose one query tile's scores (fp32), P and P^T fit ``WORKING_BYTES``, at least one tile."""
    size = _itemsize(dtype)
    resident = len(partition_chunks(D)) * size + (Dv + 1) * size / PMAX  # K^T [D, keys]; V [128 keys, blocks, Dv + 1]
    working = 4 + 2 * size  # scores, P, P^T (bq = 128 columns per 128 keys)
    tiles = min(RESIDENT_BYTES / resident, WORKING_BYTES / working) // SCORE_KEYS
    return SCORE_KEYS * max(1, int(tiles))


def _rows_from_transposed(xT, n, width, dt, ring, columns=None):
    """``xT`` (:func:`_transposed_rows`' layout of ``[n, width]``) turned back into ``[128, blocks, columns]``
    (block ``j`` holds rows ``128 j ..`` on the partitions; ``columns`` >= ``width``, the rest left unwritten) by
    :func:`_turn_back`, copied out by the Scalar Engine (the forward's Vector Engine has the scores to evacuate)."""
    rows = nl.ndarray((PMAX, len(partition_chunks(n)), columns or width), dtype=dt, buffer=nl.sbuf)
    _turn_back(rows, xT, width, ring, slice(0, n), nisa.scalar_engine)
    return rows


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
