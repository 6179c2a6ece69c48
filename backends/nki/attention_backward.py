"""Flash attention backward as an NKI kernel, one pass (the forward's options: GQA, bottom-right causal, sliding
window, logit softcap, sinks, a head dim of V's own); what it shares with the forward: ``attention_tiles.py``.

Backward (:class:`_Backward`): per (batch, KV head) and key section (K^T, V^T and K resident, dK and dV summed
over the GQA group in fp32 SBUF), per query head and query section (Q^T, dO^T, Q and dO resident, dQ summed in fp32
SBUF, carried through HBM between key sections), per 512-key group and query tile: S and dP into PSUM,
``P = exp(scale S - lse)`` straight out of PSUM, ``dS = P (dP - delta)``; dV and dK accumulate in PSUM over the
section's query tiles (P and dS are the stationary operands as they are, queries contracted), dQ over the group's
blocks through dS^T.

The kernel recomputes P from the forward's ``lse`` (the sunk lse: the sinked probabilities) and also writes each
row's share of the sinks' gradient, ``-p_sink * delta``, which the host sums. Semantics:
``backends/reference/attention.py``.
"""
from __future__ import annotations

from .compat import nki, nisa, nl
from .attention_tiles import (B_K, B_Q, NEG, PMAX, SCORE_KEYS, _band, _factors, _itemsize, _key_blocks, _load, _mask,
                              _matmul_chunked, _multiply, _PsumRing, _rows_without_keys, _sink_column, _tanh,
                              _transpose_rows_into, _transposed_rows, _transposed_tiles, _turn_back, partition_chunks)

BACKWARD_TENSOR_TRANSPOSED = 3  # of a group's four dS blocks, how many the Tensor Engine transposes (the DMA the rest)
BACKWARD_SIDE_BYTES = 64 * 1024  # SBUF per partition for the backward's query side, and for its key side
PSUM_BANK_FP32 = 512  # fp32 per partition in a PSUM bank


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
