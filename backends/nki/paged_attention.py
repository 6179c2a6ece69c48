"""Decode attention over a paged KV cache (``paged_attention``) as an NKI kernel: GQA, a left window (the right side
is moot: queries are a sequence's last tokens), softcap, sinks, lse, and v's own head dim (DeepSeek's absorbed MLA).

Keys. The caches ``[num_pages, page_size, Hkv, D]`` are seen as rows ``[slots, Hkv, D]``: token ``j`` of sequence
``b`` is slot ``block_table[b, j // page_size] * page_size + j % page_size`` (vLLM's slot mapping), one row of every
KV head's ``D`` values. Keys go in blocks of ``run * 128``, ``run`` consecutive slots of a page (up to 4) on each
partition, and each block's K and V arrive in one indirect DMA per cache (``.ap(vector_offset=...)``, a run of
rows of every KV head of a group per partition). The host maps the block table to the runs' first slots, giving a
run that no query of the sequence sees a slot past the pool, which the DMA skips (``oob_mode.skip``): a page is
read once, and only where some query sees it. A K run with a seen key is read whole (its other keys are masked),
a V run only when every key is seen, as a slot past a sequence's length may hold anything and ``0 * NaN`` is NaN;
the keys of the runs a sequence's ends cut (at most ``run - 1`` at each end) come key by key as a tail of the
last section. V tiles are zeroed before their gathers, so a skipped run adds nothing to ``P V``.

Rows. A sequence's query rows for a group of KV heads, ordered (KV head, query token, query head of its group), share
the partitions (at most 128), and one score tile serves every head of the group: each head's matmul contracts its
keys with a copy of ``Q^T`` whose other heads' columns are zero, all accumulating into one PSUM tile, so the softmax
runs once per tile for every head. A key of one KV head that is not finite therefore reaches the other heads' rows
at that position (0 * inf). ``P V`` is computed transposed: each head's V is the stationary operand and its rows'
``P^T`` columns the moving one, into those rows' columns of ``(P V)^T``.

Softmax by sections of keys: the section's scores go to SBUF (scaled, capped, then masked by each row's bounds,
from the host: the row at position ``p`` sees key ``j`` iff ``p - left <= j <= p``), then its row max, the exps and
their sums once, and ``P V`` accumulates in PSUM over its blocks: the accumulator is rescaled once per section, not
per tile. Rows end as in ``attention_forward.py`` (sinks join the denominator last; rows that see no key give 0 and
-inf, or their sink). Semantics: ``portable_ops/definitions/paged.py``.
"""

from __future__ import annotations

import torch

from .compat import nki, nisa, nl
from . import runtime
from .attention_tiles import partition_chunks
from .runtime import kernel_op, launch

PMAX = 128  # partitions: keys per tile, query rows per group, a transpose's largest side
SCORE_COLUMNS = 512  # fp32 per PSUM bank: scores, or (P V)^T
PSUM_BANK_BYTES = 2048  # per partition (nl.tile_size.psum_bank_fmax_bytes)
SECTION_KEYS = 4096  # keys whose scores are in SBUF at once (16 KiB fp32 per partition)
MAX_RUN = 4  # consecutive slots of a page a partition of a gather holds: a block of 512 keys, a PSUM bank of scores
GATHER_BYTES = 32 * 1024  # of a partition, for one block's K or V tile
NEG = -1.0e30  # a masked score: finite, so exp(NEG - NEG) is 1, never NaN
MAX_HEAD_DIM = 576  # DeepSeek's absorbed MLA (576 / 512): its v's 512 fp32 is one PSUM bank


def groups(hkv: int, rows_per_head: int, d: int, dv: int, itemsize: int) -> list[tuple[int, int]]:
    """``(first KV head, heads)`` of each group sharing the partitions: at most 128 query rows, whose ``(P V)^T``
    (v's head dim in chunks of 128 on the partitions, the rows on the free axis) fits one PSUM bank, and whose
    gathered K or V block takes at most ``GATHER_BYTES`` of a partition."""
    per_group = max(1, min(PMAX // rows_per_head, SCORE_COLUMNS // (len(partition_chunks(dv)) * rows_per_head),
                           GATHER_BYTES // (MAX_RUN * max(d, dv) * itemsize)))
    return [(h0, min(per_group, hkv - h0)) for h0 in range(0, hkv, per_group)]


def sequence_instructions(positions, page_size, sq, hq, hkv, d, dv, itemsize) -> int:
    """At least the instructions :func:`paged_attention_kernel` issues for one sequence of a table of ``positions``
    (every block up to the table's width is issued: the trace cannot know the lengths), with every option on."""
    run = run_of(page_size)
    n_blocks = -(-max(positions, page_size) // (run * PMAX))
    sections = -(-n_blocks // max(1, SECTION_KEYS // (run * PMAX)))
    nc, ncv = len(partition_chunks(d)), len(partition_chunks(dv))
    total = 2
    for _, heads in groups(hkv, sq * (hq // hkv), d, dv, itemsize):
        per_block = 5 + 2 * run + run * heads * (3 * nc + ncv)  # gathers, K^T, scores, P^T, P V
        per_section = 14 + 2 * ncv  # slots, mask, softmax, rescale
        tail = 10 + heads * (3 * nc + ncv)
        total += 40 + 2 * nc + 2 * heads + tail + sections * per_section + n_blocks * per_block
    return total


def _transpose_batches(count, rows, itemsize, multiple=1):
    """``(first, count)`` batches of ``count`` transposes of ``rows`` columns that one PSUM bank holds, each batch a
    multiple of ``multiple``."""
    per_bank = PSUM_BANK_BYTES // (rows * itemsize) // multiple * multiple
    return [(i, min(per_bank, count - i)) for i in range(0, count, per_bank)]


def _query_columns(q_sb, R, D, HG, rows_per_head, dt):
    """Per KV head of the group, ``Q^T`` in contraction chunks ``[min(D, 128), chunks, R]`` with only that head's
    rows' columns: the stationary operands whose score matmuls accumulate into one tile."""
    chunks = partition_chunks(D)
    qT = nl.ndarray((min(D, PMAX), len(chunks), R), dtype=dt, buffer=nl.sbuf)
    for c, c0, size in chunks:
        qT_ps = nl.ndarray((size, R), dtype=dt, buffer=nl.psum)
        nisa.nc_transpose(qT_ps, q_sb[:, c0:c0 + size])
        nisa.tensor_copy(qT[0:size, c, :], qT_ps)
    padded = []
    for h in range(HG):
        mine = nl.ndarray((min(D, PMAX), len(chunks), R), dtype=dt, buffer=nl.sbuf)
        nisa.memset(mine, 0.0)
        cols = slice(h * rows_per_head, (h + 1) * rows_per_head)
        nisa.tensor_copy(mine[:, :, cols], qT[:, :, cols])
        padded.append(mine)
    return padded


def _gather_into(tile, rows, slot, h0, heads, width, run=1):
    """``tile [P, run * heads * width]`` = ``run`` consecutive cache rows from slot ``slot[p]`` on partition ``p``,
    KV heads ``h0 ..`` of them; a partition whose slot is past the pool is left as it was."""
    row = rows.shape[1] * width
    pattern = [[row, tile.shape[0]], [row, run], [1, heads * width]]
    nisa.dma_copy(tile, rows.ap(pattern, offset=h0 * width, vector_offset=slot, indirect_dim=0),
                  oob_mode=nisa.oob_mode.skip, dge_mode=nisa.dge_mode.swdge)


def _scores_of_block(s_ps, qT, k_sb, run, HG, D, dt):
    """``s_ps [R, run * P]``, column ``u * P + p`` = key ``run * p + u`` of the block: ``Q_h K_h^T`` summed over
    the group's heads ``h`` (``k_sb [P, run * HG * D]``, ``run`` keys a partition)."""
    chunks, keys = partition_chunks(D), k_sb.shape[0]
    pieces = [(u, h, c, u * HG * D + h * D + c0, size) for u in range(run) for h in range(HG)
              for c, c0, size in chunks]
    kT = nl.ndarray((min(D, PMAX), len(pieces), keys), dtype=dt, buffer=nl.sbuf)
    for batch, (first, count) in enumerate(_transpose_batches(len(pieces), keys, dt.itemsize)):
        kT_ps = nl.ndarray((min(D, PMAX), count, keys), dtype=dt, buffer=nl.psum)
        for j in range(count):
            *_, c0, size = pieces[first + j]
            nisa.nc_transpose(kT_ps[0:size, j, :], k_sb[:, c0:c0 + size])
        # the evacuations alternate between the Vector and Scalar Engines, which the softmax leaves room on
        nisa.tensor_copy(kT[:, first:first + count, :], kT_ps,
                         engine=nisa.engine.scalar if batch % 2 else nisa.engine.vector)
    for j, (u, h, c, _, size) in enumerate(pieces):
        nisa.nc_matmul(s_ps[:, u * keys:(u + 1) * keys], qT[h][0:size, c, :], kT[0:size, j, :],
                       accumulate=j % (HG * len(chunks)) > 0)


def _mask(scores, key_index, k0, bounds, windowed):
    """Scores of keys ``k0 + key_index[c]`` outside each row's ``[bounds[:, 0], bounds[:, 1]]`` -> NEG (the first
    bound is 0, and not compared, without a window)."""
    R, width = scores.shape
    hidden = nl.ndarray((R, width), dtype=nl.uint8, buffer=nl.sbuf)
    sides = ((bounds[:, 1:2], nl.greater), (bounds[:, 0:1], nl.less))
    for side, past in sides[:2 if windowed else 1]:
        nisa.tensor_scalar(hidden, key_index[0:R, 0:width], op0=nl.add, operand0=float(k0), op1=past, operand1=side,
                           engine=nisa.engine.gpsimd)  # beside the Vector Engine's predicated copy
        nisa.tensor_copy_predicated(dst=scores, src=NEG, predicate=hidden)


def _evacuate(out, s_ps, scale, softcap):
    """Scores from PSUM into ``out``, scaled (and capped)."""
    if softcap is None:
        nisa.activation(out, op=nl.copy, data=s_ps, scale=scale)
    else:  # the Scalar Engine's tanh saturates: huge scores cap at +-softcap
        nisa.activation(out, op=nl.tanh, data=s_ps, scale=scale / softcap)
        nisa.tensor_scalar(out, out, op0=nl.multiply, operand0=softcap)


def _section_scores(scores, qT, k_rows, k_slots, run, HG, h0, D, scale, softcap, dt):
    """``scores [R, blocks * run * 128]``: the section's scaled (and capped) scores, 512 per PSUM tile, in the
    blocks' column order (:func:`_scores_of_block`); ``k_slots [128, blocks]``: the section's runs' first slots."""
    R, width = scores.shape[0], run * PMAX
    blocks = scores.shape[1] // width
    per_bank = SCORE_COLUMNS // width
    for first in nl.static_range(0, blocks, per_bank):
        count = min(per_bank, blocks - first)
        s_ps = nl.ndarray((R, count * width), dtype=nl.float32, buffer=nl.psum)
        for i in nl.static_range(count):
            k_sb = nl.ndarray((PMAX, run * HG * D), dtype=dt, buffer=nl.sbuf)
            _gather_into(k_sb, k_rows, k_slots[:, first + i:first + i + 1], h0, HG, D, run)
            _scores_of_block(s_ps[:, i * width:(i + 1) * width], qT, k_sb, run, HG, D, dt)
        _evacuate(scores[:, first * width:(first + count) * width], s_ps, scale, softcap)


def _tail_scores(scores, qT, k_rows, tail_slots, hidden, HG, h0, D, scale, softcap, dt):
    """``scores [R, T]``: the keys of runs partly seen, a key a partition (``tail_slots [T, 1]``), masked where
    ``hidden``."""
    R, T = scores.shape
    k_sb = nl.ndarray((T, HG * D), dtype=dt, buffer=nl.sbuf)
    _gather_into(k_sb, k_rows, tail_slots, h0, HG, D)
    s_ps = nl.ndarray((R, T), dtype=nl.float32, buffer=nl.psum)
    _scores_of_block(s_ps, qT, k_sb, 1, HG, D, dt)
    _evacuate(scores, s_ps, scale, softcap)
    nisa.tensor_copy_predicated(dst=scores, src=NEG, predicate=hidden)


def _values_into(pvT, v_sb, pT, HG, Dv, rows_per_head, accumulate):
    """``pvT[:, :, rows of head h] (+)= V_h^T P^T`` for the group's heads (``v_sb [keys, HG * Dv]``, ``pT [keys,
    R]``)."""
    for h in range(HG):
        cols = slice(h * rows_per_head, (h + 1) * rows_per_head)
        for c, c0, size in partition_chunks(Dv):
            nisa.nc_matmul(pvT[0:size, c, cols], v_sb[:, h * Dv + c0:h * Dv + c0 + size], pT[:, cols],
                           accumulate=accumulate)


def _section_values(p, v_rows, v_slots, run, R, HG, h0, Dv, rows_per_head, dt):
    """``(P V)^T`` of the section's blocks, ``[min(Dv, 128), Dv chunks, R]`` in PSUM: each head's matmul takes its V
    as the stationary operand and its rows' ``P^T`` columns as the moving one, into those rows' columns. A block's V
    arrives as its K did, ``run`` keys a partition (runs wholly seen; the others are zeros here)."""
    pvT = nl.ndarray((min(Dv, PMAX), len(partition_chunks(Dv)), R), dtype=nl.float32, buffer=nl.psum)
    tiles = p.shape[1] // PMAX
    for first, count in _transpose_batches(tiles, R, dt.itemsize, run):
        pT_ps = nl.ndarray((PMAX, count, R), dtype=dt, buffer=nl.psum)
        for j in nl.static_range(count):
            nisa.nc_transpose(pT_ps[:, j, :], p[:, (first + j) * PMAX:(first + j + 1) * PMAX])
        pT = nl.ndarray((PMAX, count, R), dtype=dt, buffer=nl.sbuf)
        nisa.tensor_copy(pT, pT_ps)
        for i in nl.static_range(count // run):
            n = first // run + i
            v_sb = nl.ndarray((PMAX, run * HG * Dv), dtype=dt, buffer=nl.sbuf)
            nisa.memset(v_sb, 0.0)  # a skipped run stays 0: P is 0 there, and 0 * stale data may be NaN
            _gather_into(v_sb, v_rows, v_slots[:, n:n + 1], h0, HG, Dv, run)
            for u in range(run):
                j = i * run + u
                _values_into(pvT, v_sb[:, u * HG * Dv:(u + 1) * HG * Dv], pT[:, j, :], HG, Dv, rows_per_head,
                             first + j > 0)
    return pvT


def _tail_values(pvT, p, v_rows, tail_slots, R, HG, h0, Dv, rows_per_head, dt):
    """``pvT += `` the tail keys' ``(P V)^T`` (``p [R, T]``, :func:`_tail_scores`)."""
    T = p.shape[1]
    pT_ps = nl.ndarray((T, R), dtype=dt, buffer=nl.psum)
    nisa.nc_transpose(pT_ps, p)
    pT = nl.ndarray((T, R), dtype=dt, buffer=nl.sbuf)
    nisa.tensor_copy(pT, pT_ps)
    v_sb = nl.ndarray((T, HG * Dv), dtype=dt, buffer=nl.sbuf)
    nisa.memset(v_sb, 0.0)
    _gather_into(v_sb, v_rows, tail_slots, h0, HG, Dv)
    _values_into(pvT, v_sb, pT, HG, Dv, rows_per_head, True)


def _rescaled(acc, pvT, alpha, R, Dv):
    """``acc = acc * alpha + (pvT)^T``, ``acc [R, Dv]`` fp32: the section's ``P V`` back to rows, a chunk of v's head
    dim at a time."""
    pvT_sb = nl.ndarray(pvT.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(pvT_sb, pvT)
    for c, c0, size in partition_chunks(Dv):
        pv = nl.ndarray((R, size), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_transpose(pv, pvT_sb[0:size, c, :])
        nisa.scalar_tensor_tensor(acc[:, c0:c0 + size], data=acc[:, c0:c0 + size], op0=nl.multiply, operand0=alpha,
                                  op1=nl.add, operand1=pv)


def _column(src, R):
    """``[R, 1]`` float32 from HBM."""
    col = nl.ndarray((R, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(col, src)
    return col


def _finish(acc, m, l_sum, position, sink, R, width, dt):
    """``(out [R, width] in dt, lse [R, 1])`` from the running max, sum and accumulator (as
    ``attention_forward.py``'s tiles end)."""
    decay = None
    if sink is not None:
        m_all = nl.ndarray((R, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(m_all, m, sink, op=nl.maximum)
        neg_m = nl.ndarray((R, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(neg_m, m_all, op0=nl.multiply, operand0=-1.0)
        decay = nl.ndarray((R, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(decay, op=nl.exp, data=m, bias=neg_m)
        sink_term = nl.ndarray((R, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(sink_term, op=nl.exp, data=sink, bias=neg_m)
        nisa.scalar_tensor_tensor(l_sum, data=l_sum, op0=nl.multiply, operand0=decay, op1=nl.add,
                                  operand1=sink_term)
        nisa.tensor_copy(m, m_all)
    # A real row's sum is >= 1 (its max term is exp(0)); one with a key scoring +inf is NaN: 1 keeps reciprocal
    # and log in their domains, and the NaN is added back to its lse below
    l_safe = nl.ndarray((R, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(l_safe, l_sum, op0=nl.maximum, operand0=1.0)
    real = nl.ndarray((R, 1), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_scalar(real, l_sum, op0=nl.less_equal, operand0=float(2 ** 60))  # NaN: false
    nisa.tensor_copy_predicated(dst=l_safe, src=1.0, predicate=real, reverse_pred=True)
    inv_l = nl.ndarray((R, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(inv_l, l_safe)
    # a row before its sequence's first key (more queries than tokens) sees none: its sum counted masked keys
    no_key = nl.ndarray((R, 1), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_scalar(no_key, position, op0=nl.less, operand0=0.0)
    if decay is not None:  # the sink's decay is 0 for such a row
        nisa.tensor_tensor(inv_l, inv_l, decay, op=nl.multiply)
    else:
        nisa.tensor_copy_predicated(dst=inv_l, src=0.0, predicate=no_key)
    out = nl.ndarray((R, width), dtype=dt, buffer=nl.sbuf)
    nisa.tensor_scalar(out, acc, op0=nl.multiply, operand0=inv_l)
    lse = nl.ndarray((R, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(lse, op=nl.log, data=l_safe)
    nisa.scalar_tensor_tensor(lse, data=l_sum, op0=nl.multiply, operand0=0.0, op1=nl.add, operand1=lse)
    nisa.tensor_tensor(lse, lse, m, op=nl.add)
    if decay is None:
        nisa.tensor_copy_predicated(dst=lse, src=float("-inf"), predicate=no_key)
    return out, lse


@nki.jit
def paged_attention_kernel(q, k_rows, v_rows, k_slots, v_slots, bounds, tail_slots=None, tail_hidden=None, sinks=None,
                           scale=1.0, softcap=None, windowed=False):
    """``q [B, Hkv * Sq * G, D]``: each sequence's query rows ordered (KV head, token, query head of its group);
    ``k_rows [slots, Hkv, D]``, ``v_rows [slots, Hkv, Dv]``: the caches' token rows. Keys in blocks of ``run * 128``,
    key ``run * p + u`` of block ``n`` at partition ``p``, a run being consecutive slots of a page: ``k_slots`` and
    ``v_slots [B, 128, blocks]`` int32, a run's first slot, past the pool where no row sees any of its keys (K) or
    not every one (V). ``bounds [B, Hkv * Sq * G, 3]`` float32, per row: the first and last key it sees in runs wholly
    seen, and its position. The keys of runs partly seen, ``T`` of them (None without runs): ``tail_slots [B, T,
    1]`` int32 and ``tail_hidden [B, Hkv * Sq * G, T]`` uint8, 1 where the row does not see it. ``sinks``: None or
    ``[Hkv * Sq * G, 1]`` float32 per row. -> ``out [B, Hkv * Sq * G, Dv]``, ``lse [B, Hkv * Sq * G, 1]`` float32.
    ``scale``, ``softcap`` and ``windowed`` (a window bounds the rows' first keys) are trace-time constants."""
    B, rows_all, D = q.shape
    Hkv, Dv = k_rows.shape[1], v_rows.shape[2]
    rows_per_head = rows_all // Hkv
    n_blocks = k_slots.shape[2]
    run = 1 if tail_slots is None else tail_slots.shape[1] // 2 + 1
    T = 0 if tail_slots is None else tail_slots.shape[1]
    dt = q.dtype
    out = nl.ndarray((B, rows_all, Dv), dtype=dt, buffer=nl.shared_hbm)
    lse = nl.ndarray((B, rows_all, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    section_blocks = max(1, SECTION_KEYS // (run * PMAX))
    # each score column's key within its section: column (block n, u, p) holds key n * run * 128 + run * p + u
    blocks = min(n_blocks, section_blocks)
    key_index = nl.ndarray((PMAX, blocks * run * PMAX), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(key_index, pattern=[[run * PMAX, blocks], [1, run], [run, PMAX]], offset=0)
    for b in nl.affine_range(B):
        if T:
            tail_sb = nl.ndarray((T, 1), dtype=nl.int32, buffer=nl.sbuf)
            nisa.dma_copy(tail_sb, tail_slots[b])
        for h0, HG in groups(Hkv, rows_per_head, D, Dv, dt.itemsize):
            R, r0 = HG * rows_per_head, h0 * rows_per_head
            q_sb = nl.ndarray((R, D), dtype=dt, buffer=nl.sbuf)
            nisa.dma_copy(q_sb, q[b, r0:r0 + R, :])
            qT = _query_columns(q_sb, R, D, HG, rows_per_head, dt)
            bounds_sb = nl.ndarray((R, 3), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(bounds_sb, bounds[b, r0:r0 + R, :])
            m = nl.ndarray((R, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(m, NEG)
            l_sum = nl.zeros((R, 1), dtype=nl.float32, buffer=nl.sbuf)
            acc = nl.zeros((R, Dv), dtype=nl.float32, buffer=nl.sbuf)
            for n0 in nl.static_range(0, n_blocks, section_blocks):
                blocks_here = min(section_blocks, n_blocks - n0)
                width = blocks_here * run * PMAX
                # the section's slots only: SBUF does not grow with the table's width
                k_slots_sb = nl.ndarray((PMAX, blocks_here), dtype=nl.int32, buffer=nl.sbuf)
                nisa.dma_copy(k_slots_sb, k_slots[b, :, n0:n0 + blocks_here])
                v_slots_sb = nl.ndarray((PMAX, blocks_here), dtype=nl.int32, buffer=nl.sbuf)
                nisa.dma_copy(v_slots_sb, v_slots[b, :, n0:n0 + blocks_here])
                tail = T if n0 + section_blocks >= n_blocks else 0  # the last section takes the tail's keys
                scores = nl.ndarray((R, width + tail), dtype=nl.float32, buffer=nl.sbuf)
                _section_scores(scores[:, 0:width], qT, k_rows, k_slots_sb, run, HG, h0, D, scale, softcap, dt)
                _mask(scores[:, 0:width], key_index, n0 * run * PMAX, bounds_sb, windowed)
                if tail:
                    hidden = nl.ndarray((R, T), dtype=nl.uint8, buffer=nl.sbuf)
                    nisa.dma_copy(hidden, tail_hidden[b, r0:r0 + R, :])
                    _tail_scores(scores[:, width:width + T], qT, k_rows, tail_sb, hidden, HG, h0, D, scale, softcap,
                                 dt)
                # m_new = max(m, rowmax); alpha = exp(m - m_new); p = exp(s - m_new), its sums on the way
                m_new = nl.ndarray((R, 1), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_reduce(m_new, op=nl.maximum, data=scores, axis=1, keepdims=True)
                nisa.tensor_tensor(m_new, m_new, m, op=nl.maximum)
                neg_m = nl.ndarray((R, 1), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_scalar(neg_m, m_new, op0=nl.multiply, operand0=-1.0)
                alpha = nl.ndarray((R, 1), dtype=nl.float32, buffer=nl.sbuf)
                nisa.activation(alpha, op=nl.exp, data=m, bias=neg_m)
                p = nl.ndarray((R, width + tail), dtype=dt, buffer=nl.sbuf)
                row_sum = nl.ndarray((R, 1), dtype=nl.float32, buffer=nl.sbuf)
                nisa.activation(p, op=nl.exp, data=scores, bias=neg_m, reduce_op=nl.add, reduce_res=row_sum,
                                reduce_cmd=nisa.reduce_cmd.reset_reduce)
                nisa.scalar_tensor_tensor(l_sum, data=l_sum, op0=nl.multiply, operand0=alpha, op1=nl.add,
                                          operand1=row_sum)
                pvT = _section_values(p[:, 0:width], v_rows, v_slots_sb, run, R, HG, h0, Dv, rows_per_head, dt)
                if tail:
                    _tail_values(pvT, p[:, width:width + T], v_rows, tail_sb, R, HG, h0, Dv, rows_per_head, dt)
                _rescaled(acc, pvT, alpha, R, Dv)
                nisa.tensor_copy(m, m_new)
            sink = None if sinks is None else _column(sinks[r0:r0 + R, :], R)
            o, lse_t = _finish(acc, m, l_sum, bounds_sb[:, 2:3], sink, R, Dv, dt)
            nisa.dma_copy(out[b, r0:r0 + R, :], o)
            nisa.dma_copy(lse[b, r0:r0 + R, :], lse_t)
    return out, lse


# ----------------------------------------------------------------------------- host side
def cache_rows(cache):
    """A contiguous ``[num_pages, page_size, Hkv, D]`` cache as its token rows ``[slots, Hkv, D]`` (a view)."""
    return cache.view(-1, *cache.shape[2:])


def run_of(page_size: int) -> int:
    """Keys a partition of a gather: consecutive slots of one page, up to 4 (a block of ``run * 128`` keys, one PSUM
    bank of scores)."""
    return next(n for n in (MAX_RUN, 2, 1) if page_size % n == 0)


def kernel_tables(block_table, cache_seqlens, sq, hkv, group, page_size, num_slots, left):
    """The kernel's ``k_slots, v_slots, bounds, tail_slots, tail_hidden`` (:func:`paged_attention_kernel`). A slot of
    ``num_slots`` is past the pool: never read. Every key no query of a sequence sees (past its length, before its
    window) gets it, which covers every table entry the checks let hold anything. A run partly seen (at most one at
    each end of a sequence's seen keys) is read whole for K, its keys outside masked, and key by key for V (a slot
    past a sequence's length may hold anything, and 0 * NaN is NaN)."""
    run = run_of(page_size)
    b, device = block_table.shape[0], block_table.device
    if block_table.shape[1] == 0:  # no pages (every length 0): one entry, never read, keeps the tables' shapes
        block_table = block_table.new_zeros((block_table.shape[0], 1))
    n_blocks = -(-block_table.shape[1] * page_size // (run * PMAX))

    def slots_of(keys):
        columns = (keys // page_size).clamp(0, block_table.shape[1] - 1).expand(b, -1)
        return block_table.long().gather(1, columns) * page_size + keys % page_size

    keys = torch.arange(n_blocks * PMAX * run, device=device)
    lengths = cache_seqlens.long()[:, None]
    first = torch.zeros_like(lengths) if left is None else (lengths - sq - left).clamp(min=0)
    seen = ((keys >= first) & (keys < lengths)).view(b, n_blocks, PMAX, run)
    starts = slots_of(keys[None, ::run]).view(b, n_blocks, PMAX)

    def table(read):
        return torch.where(read, starts, num_slots).to(torch.int32).transpose(1, 2).contiguous()

    # runs wholly seen: [whole_first, whole_end); the partly seen runs' keys: [first, ..) and [.., lengths)
    whole_first, whole_end = (first + run - 1) // run * run, lengths // run * run
    positions = lengths - sq + torch.arange(sq, device=device)  # [B, Sq]
    lo = whole_first if left is None else torch.maximum(positions - left, whole_first)
    rows = torch.stack([lo.expand_as(positions), torch.minimum(positions, whole_end - 1), positions], -1)
    tail_slots = tail_hidden = None
    if run > 1:
        head_end = torch.minimum(whole_first, lengths)
        tail_start = torch.maximum(whole_end, head_end)
        steps = torch.arange(run - 1, device=device)
        tail = torch.cat([first + steps, tail_start + steps], 1)  # [B, T]
        real = torch.cat([first + steps < head_end, tail_start + steps < lengths], 1)
        tail_slots = torch.where(real, slots_of(tail), num_slots).to(torch.int32)[..., None].contiguous()
        sees = real[:, None] & (tail[:, None] <= positions[..., None])  # [B, Sq, T]
        if left is not None:
            sees &= tail[:, None] >= positions[..., None] - left
        tail_hidden = _per_row((~sees).to(torch.uint8), hkv, group)
    bounds = _per_row(rows.to(torch.float32), hkv, group)
    return table(seen.any(-1)), table(seen.all(-1)), bounds, tail_slots, tail_hidden


def _per_row(t, hkv, group):
    """``[B, Sq, n]`` per token -> ``[B, Hkv * Sq * G, n]`` per query row (:func:`_as_rows`' order)."""
    b, sq, n = t.shape
    return t[:, None, :, None, :].expand(b, hkv, sq, group, n).reshape(b, -1, n).contiguous()


def _as_rows(t, hkv):
    """``[B, Sq, Hq, d]`` -> ``[B, Hkv * Sq * G, d]``, rows ordered (KV head, token, query head of its group)."""
    b, sq, hq, d = t.shape
    return t.reshape(b, sq, hkv, hq // hkv, d).transpose(1, 2).reshape(b, -1, d).contiguous()


def _fake(q, k_rows, v_rows, k_slots, v_slots, bounds, tail_slots, tail_hidden, sinks, scale, softcap, windowed):
    return (q.new_empty((*q.shape[:-1], v_rows.shape[-1])), q.new_empty((*q.shape[:-1], 1), dtype=torch.float32))


@kernel_op("paged_attention", _fake)
def paged_attention_op(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, k_slots: torch.Tensor,
                       v_slots: torch.Tensor, bounds: torch.Tensor, tail_slots: torch.Tensor | None,
                       tail_hidden: torch.Tensor | None, sinks: torch.Tensor | None, scale: float,
                       softcap: float | None, windowed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's launch as the op ``portable_ops_nki::paged_attention`` (its arguments as the kernel's)."""
    return launch(paged_attention_kernel, q, k_rows, v_rows, k_slots, v_slots, bounds, tail_slots=tail_slots,
                  tail_hidden=tail_hidden, sinks=sinks, scale=scale, softcap=softcap, windowed=windowed)


def paged_attention(q, k_cache, v_cache, block_table, cache_seqlens, *, scale, window=None, softcap=None, sinks=None):
    """``q [B, Sq, Hq, D]`` over ``[pages, page_size, Hkv, D]`` (v: ``Dv``) caches -> (out ``[B, Sq, Hq, Dv]``
    contiguous, lse ``[B, Hq, Sq]``), in as many launches as the instruction budget needs."""
    b, sq, hq, d = q.shape
    per_launch = max(1, runtime.INSTRUCTION_BUDGET // sequence_instructions(
        block_table.shape[1] * k_cache.shape[1], k_cache.shape[1], sq, hq, k_cache.shape[2], d, v_cache.shape[-1],
        q.element_size()))
    parts = [_launch(q[i:i + per_launch], k_cache, v_cache, block_table[i:i + per_launch],
                     cache_seqlens[i:i + per_launch], scale, window, softcap, sinks) for i in range(0, b, per_launch)]
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat(pieces) for pieces in zip(*parts))


def _launch(q, k_cache, v_cache, block_table, cache_seqlens, scale, window, softcap, sinks):
    """One launch of the kernel over every sequence of ``q``."""
    b, sq, hq, _ = q.shape
    page_size, hkv, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[-1]
    group = hq // hkv
    left = None if window is None or window[0] is None else int(window[0])
    tables = kernel_tables(block_table, cache_seqlens, sq, hkv, group, page_size, k_cache.shape[0] * page_size, left)
    sink_rows = None if sinks is None else \
        sinks.to(torch.float32).view(hkv, 1, group).expand(hkv, sq, group).reshape(-1, 1).contiguous()
    out, lse = paged_attention_op(_as_rows(q, hkv), cache_rows(k_cache), cache_rows(v_cache), *tables, sink_rows,
                                  float(scale), float(softcap) if softcap else None, left is not None)
    out = out.view(b, hkv, sq, group, dv).transpose(1, 2).reshape(b, sq, hq, dv)
    return out, lse.view(b, hkv, sq, group).permute(0, 1, 3, 2).reshape(b, hq, sq)


def paged_attention_supports(call) -> list[str]:
    """What the kernel's layout needs beyond the declared dtypes and head dims."""
    q, k_cache, v_cache = call["q"], call["k_cache"], call["v_cache"]
    reasons = []
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        reasons.append("the NKI kernel gathers token rows of contiguous caches; a strided k_cache or v_cache would "
                       "need a copy of the whole pool per call")
    rows = q.shape[1] * (q.shape[2] // max(k_cache.shape[2], 1))
    if rows > PMAX:
        reasons.append(f"{q.shape[1]} new tokens x {q.shape[2] // k_cache.shape[2]} query heads per KV head = {rows} "
                       f"query rows per KV head; the NKI kernel holds them on its {PMAX} partitions")
    elif rows * len(partition_chunks(v_cache.shape[-1])) > SCORE_COLUMNS:
        reasons.append(f"{rows} query rows per KV head with v's head dim {v_cache.shape[-1]}: the NKI kernel's (P V)^T "
                       f"of one KV head, the head dim in chunks of {PMAX}, must fit one PSUM bank")
    if k_cache.shape[0] * k_cache.shape[1] >= 2 ** 31:
        reasons.append("a pool of 2^31 or more token slots: the NKI kernel's gather indices are int32")
    positions = call["block_table"].shape[1] * k_cache.shape[1]
    if positions > 2 ** 24:
        reasons.append("block_table holds over 2^24 positions: the NKI kernel compares positions in float32")
    elif not reasons:
        needs = sequence_instructions(positions, k_cache.shape[1], q.shape[1], q.shape[2], k_cache.shape[2],
                                      q.shape[3], v_cache.shape[3], q.element_size())
        if needs > runtime.INSTRUCTION_BUDGET:
            reasons.append(f"one sequence of a block table of {positions} positions takes up to {needs} instructions, "
                           f"past the Neuron compiler's {runtime.INSTRUCTION_BUDGET} a launch: the NKI kernel issues "
                           "every block up to the table's width")
    return reasons
