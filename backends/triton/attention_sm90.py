"""Attention for Hopper (sm_90) in Gluon: TMA loads into a shared-memory ring filled by a producer
warp, warpgroup MMAs, and softmax overlapped with the tensor cores. The backward is at the end
(``_bwd_kernel``: one pass over the queries per block of keys, dQ through TMA reduce-adds).

A work tile is 64 query rows of one (batch, head) for each of two or three consumer warpgroups
(``CONFIGS``), which share every K/V tile. A one-warp loader loads the Q tiles and streams the K/V
tiles through ``STAGES`` slots, each guarded by a ready and an empty mbarrier; they run as
partitions of ``gl.warp_specialize``. A program takes one work tile, or, on a persistent grid
(:func:`programs` says where), the next one free after each, its ring running on from one to the next.
Each consumer runs an iteration in this order, so that the exponentials of one tile overlap the
tensor cores' work on the previous one::

    (my turn) S_j = Q K_j^T; O += P_{j-1} V_{j-1}   (both issued, not waited) (their turn)
    wait S_j; P_j = exp2(S_j * scale - m_j) ...    (softmax while P_{j-1} V_{j-1} runs)
    wait O; O *= alpha_j; free slot j - 1

and the consumers take turns issuing their MMAs (FlashAttention-3's ping-pong), so that one's
softmax also runs under the others' MMAs.

Every tensor is addressed through a rank-4 TMA descriptor over its own ``[B, H, S, D]`` strides, so
q/k/v transposed out of ``[B, S, H, D]`` need no copy, and tiles past a sequence's end read zeros
and are never written (TMA clips them), never another head's rows. Grouped-query attention reads
KV head ``h // group``. The kernel declares what it takes (:func:`supports`); every other call
keeps the ``tl.*`` kernels of ``attention.py``: other head dims, float32, decode, rows that see no
key (causal with ``Sq > Skv``), strides TMA can't address.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math

import torch
import triton

from .launch import TRITON_RELEASE, Launch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # a Triton without Gluon: the tl.* kernels take every call
    gluon = None

HEAD_DIMS = (64, 128, 256)  # the forward's
BWD_HEAD_DIMS = (64, 128)  # dK and dV of 64 keys at D 256 would take 256 float32 registers a thread
WARPGROUP_ROWS = 64  # query rows a consumer warpgroup of the forward takes
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

if gluon is not None:
    # Triton 3.6 names TMA copies async_copy_*; later releases async_load/async_store and refuse the old names.
    _tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    _tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global
    if hasattr(tma, "async_atomic_add"):
        _tma_add = tma.async_atomic_add
    else:  # Triton 3.6 builds TMA reduce-adds but has no Gluon function for them
        from triton._C.libtriton import ir as _ir
        from triton.experimental.gluon.language._core import builtin as _builtin

        @_builtin
        def _tma_add(tensor_desc, coord, src, _semantic=None):
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                      src.handle)
    _LN2 = gl.constexpr(LN2)  # kernels may read only constexpr globals
    _LOG2E = gl.constexpr(LOG2E)

    @gluon.constexpr_function
    def _mma_layout(n):
        """The accumulator layout of a warpgroup MMA (4 warps) whose tiles are ``n`` columns wide."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])

    @gluon.jit
    def _fill(a_desc, b_desc, a_smem, b_smem, ready, empty, i, coord):
        """The ring's ``i``-th load: once its slot is free, ``a`` and ``b`` at ``coord`` into it. Returns the slot."""
        STAGES: gl.constexpr = a_smem.shape[0]
        slot = i % STAGES
        # a fresh barrier counts as having completed the phase before its first: the first pass does not wait
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        _tma_load(a_desc, coord, ready.index(slot), a_smem.index(slot))
        _tma_load(b_desc, coord, ready.index(slot), b_smem.index(slot))
        return slot

    @gluon.jit
    def _stream(a_desc, b_desc, a_smem, b_smem, ready, empty, b, head, heads, lo, hi, count):
        """Streams tiles ``[lo, hi)`` of ``a`` and ``b`` (rows of one sequence), head by head for ``heads``
        heads from ``head``, through the ring, whose ``count`` loads so far place them (the forward's K/V).
        Returns the count after them."""
        BLOCK: gl.constexpr = a_desc.block_type.shape[2]
        per_head = hi - lo
        for t in range(heads * per_head):
            _fill(a_desc, b_desc, a_smem, b_smem, ready, empty, count + t,
                  [b, head + t // per_head, (lo + t % per_head) * BLOCK, 0])
        return count + heads * per_head

    @gluon.jit
    def _bwd_loader(q_desc, do_desc, q_smem, do_smem, stats_smem, ready, empty, lse_ptr, delta_ptr, b, head, heads,
                    lo, hi, H, SQ):
        """The backward's Q/dO tiles ``[lo, hi)`` of ``heads`` heads from ``head``, through the ring; each
        slot also gets its rows' lse (times log2 e) and delta in shared memory, which the consumers read
        when they use them. Loaded by them from global memory instead, the two stayed live in registers
        across the MMAs, and the wait for them was exposed: 4-13% slower on the H100
        (docs/perf/backward_variants_ab.txt, run 6). A slot is ready on its TMA bytes and this warp's arrive
        (mbarrier arrives release the stores before them to the waiting warps)."""
        BM: gl.constexpr = q_desc.block_type.shape[2]
        row_layout: gl.constexpr = gl.BlockedLayout([BM // 32], [32], [1], [0])
        per_head = hi - lo
        for t in range(heads * per_head):
            h = head + t // per_head
            m0 = (lo + t % per_head) * BM
            slot = _fill(q_desc, do_desc, q_smem, do_smem, ready, empty, t, [b, h, m0, 0])
            rows = m0 + gl.arange(0, BM, row_layout)
            at = (b * H + h).to(gl.int64) * SQ + rows
            stats_smem.index(2 * slot).store(gl.load(lse_ptr + at, mask=rows < SQ, other=0.0) * _LOG2E)
            stats_smem.index(2 * slot + 1).store(gl.load(delta_ptr + at, mask=rows < SQ, other=0.0))
            mbarrier.arrive(ready.index(slot), count=1)

    @gluon.jit
    def _tile(smem, i, BLOCK: gl.constexpr, D: gl.constexpr):
        """Slot ``i`` of a ring of [1, 1, BLOCK, D] TMA tiles, as the [BLOCK, D] matrix the MMAs take."""
        return smem.index(i).reshape([BLOCK, D])

    @gluon.jit
    def _softmax(s, m_i, l_i, qk_scale, rows, cols, SKV, diagonal, MASK: gl.constexpr, CAUSAL: gl.constexpr,
                 NEGATIVE_SCALE: gl.constexpr):
        """One tile's online-softmax update: (P, m, l, alpha) with m in the scaled log2 domain."""
        if MASK:
            visible = cols[None, :] < SKV
            if CAUSAL:
                visible = visible & (cols[None, :] <= rows[:, None] + diagonal)
            s = gl.where(visible, s * qk_scale, float("-inf"))  # scaled first: a negative scale flips -inf
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            p = gl.exp2(s - m_new[:, None])
        else:
            # the row maximum of the scaled scores from the unscaled ones: one FMA per score below
            if NEGATIVE_SCALE:
                m_new = gl.maximum(m_i, gl.min(s, axis=1) * qk_scale)
            else:
                m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
            p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        return p, m_new, l_i * alpha + gl.sum(p, axis=1), alpha

    @gluon.jit
    def _consume(q_tile, k_smem, v_smem, ready, empty, turn, p, o, m_i, l_i, lo, hi, count, qk_scale, rows, SKV,
                 diagonal, WARPGROUP: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr,
                 NEGATIVE_SCALE: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
        """Tiles [lo, hi) of this work tile, which starts at ring position ``count``: the previous tile's
        P V runs on the tensor cores while this tile's softmax runs."""
        STAGES: gl.constexpr = k_smem.shape[0]
        BLOCK_N: gl.constexpr = k_smem.shape[3]
        D: gl.constexpr = k_smem.shape[4]
        BM: gl.constexpr = q_tile.shape[0]
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        for j in range(lo, hi):
            slot = (count + j) % STAGES
            prev = (count + j - 1) % STAGES
            mbarrier.wait(ready.index(slot), ((count + j) // STAGES) & 1)
            _my_turn(turn, count + j, WARPGROUP)
            s = warpgroup_mma(q_tile, _tile(k_smem, slot, BLOCK_N, D).permute((1, 0)),
                              gl.zeros([BM, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
            o = warpgroup_mma(p, _tile(v_smem, prev, BLOCK_N, D), o, is_async=True)
            _their_turn(turn, WARPGROUP)
            s = warpgroup_mma_wait(1, deps=(s,))  # groups retire in order: S_j is done, P V may still run
            cols = j * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
            p_new, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, rows, cols, SKV, diagonal, MASK, CAUSAL,
                                              NEGATIVE_SCALE)
            o = warpgroup_mma_wait(0, deps=(o, p))[0]
            mbarrier.arrive(empty.index(prev), count=1)
            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            p = gl.convert_layout(p_new.to(q_tile.dtype), p_layout)
        return p, o, m_i, l_i

    @gluon.jit
    def _my_turn(turn, j, WARPGROUP: gl.constexpr):
        """Wait until the warpgroup before this one has issued its MMAs of tile ``j`` (warpgroup 0: the
        last one, of tile ``j - 1``): the consumers take turns on the tensor cores, so that one's softmax
        runs under the others' MMAs (FlashAttention-3's ping-pong). ``turn[w]`` completes a phase each
        time warpgroup ``w - 1`` hands over; a fresh barrier passes a wait on parity 1, so warpgroup 0
        goes first."""
        if WARPGROUP == 0:
            mbarrier.wait(turn.index(0), (j & 1) ^ 1)
        else:
            mbarrier.wait(turn.index(WARPGROUP), j & 1)

    @gluon.jit
    def _their_turn(turn, WARPGROUP: gl.constexpr):
        NEXT: gl.constexpr = (WARPGROUP + 1) % turn.shape[0]
        mbarrier.arrive(turn.index(NEXT), count=1)

    @gluon.jit
    def _work(tile, n_m, H, SQ, SKV, BM: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
        """Work tile ``tile``: its (batch, head, first row) and how many K/V tiles it reads, ``[0, full)`` of
        them visible to every row and in bounds, ``[full, n_blocks)`` needing a mask. Query blocks are the
        fast axis, so that the tiles running together share a head's K/V in L2, and run from the last (under
        a causal mask, the most keys) to the first, so that the light ones fill the tail."""
        bh = tile // n_m
        start_m = n_m - 1 - tile % n_m
        m0 = start_m * BM
        hi = SKV
        full = SKV // BLOCK_N
        if CAUSAL:
            hi = gl.minimum(SKV, m0 + BM + SKV - SQ)
            full = gl.minimum(full, gl.maximum(m0 + SKV - SQ + 1, 0) // BLOCK_N)
        return bh // H, bh % H, m0, full, gl.cdiv(hi, BLOCK_N)

    @gluon.jit
    def _attend(q_tile, k_smem, v_smem, o_smem, o_desc, ready, empty, turn, q_free, lse_ptr, qk_scale, b, h, m0, SQ,
                SKV, full, n_blocks, count, WARPGROUP: gl.constexpr, CAUSAL: gl.constexpr,
                NEGATIVE_SCALE: gl.constexpr, O_THROUGH_Q: gl.constexpr):
        """One consumer warpgroup on one work tile: 64 query rows against its K/V tiles, the first at ring
        position ``count``, then those rows of O (through ``o_smem``) and lse. Unless O goes out through Q's
        tile, ``q_free`` is arrived on once the last S is computed, so that the next work tile's Q loads
        while this one's last P V and its epilogue run."""
        BLOCK_N: gl.constexpr = k_smem.shape[3]
        D: gl.constexpr = k_smem.shape[4]
        BM: gl.constexpr = q_tile.shape[0]
        s_layout: gl.constexpr = _mma_layout(BLOCK_N)
        o_layout: gl.constexpr = _mma_layout(D)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        STAGES: gl.constexpr = k_smem.shape[0]
        rows = m0 + gl.arange(0, BM, gl.SliceLayout(1, s_layout))
        diagonal = SKV - SQ
        # Tile 0, alone: every row sees a key in it (the kernel takes no rows that see none), so m is finite after it.
        first = count % STAGES
        mbarrier.wait(ready.index(first), (count // STAGES) & 1)
        _my_turn(turn, count, WARPGROUP)
        s = warpgroup_mma(q_tile, _tile(k_smem, first, BLOCK_N, D).permute((1, 0)),
                          gl.zeros([BM, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
        _their_turn(turn, WARPGROUP)
        s = warpgroup_mma_wait(0, deps=(s,))
        cols = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
        m_i = gl.full([BM], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BM], gl.float32, gl.SliceLayout(1, s_layout))
        p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, rows, cols, SKV, diagonal, True, CAUSAL, NEGATIVE_SCALE)
        p = gl.convert_layout(p.to(q_tile.dtype), p_layout)
        o = gl.zeros([BM, D], gl.float32, o_layout)
        unmasked = gl.maximum(full, 1)
        p, o, m_i, l_i = _consume(q_tile, k_smem, v_smem, ready, empty, turn, p, o, m_i, l_i, 1, unmasked, count,
                                  qk_scale, rows, SKV, diagonal, WARPGROUP, False, CAUSAL, NEGATIVE_SCALE, s_layout,
                                  o_layout)
        p, o, m_i, l_i = _consume(q_tile, k_smem, v_smem, ready, empty, turn, p, o, m_i, l_i, unmasked, n_blocks,
                                  count, qk_scale, rows, SKV, diagonal, WARPGROUP, True, CAUSAL, NEGATIVE_SCALE,
                                  s_layout, o_layout)
        if not O_THROUGH_Q:
            mbarrier.arrive(q_free, count=1)  # every S MMA has been waited for: Q's tile is read no more
        last = (count + n_blocks - 1) % STAGES
        o = warpgroup_mma(p, _tile(v_smem, last, BLOCK_N, D), o)
        mbarrier.arrive(empty.index(last), count=1)
        o = o / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
        lse = (m_i + gl.log2(l_i)) * _LN2
        gl.store(lse_ptr + rows, lse, mask=rows < SQ)
        tma.store_wait(0)  # the previous work tile's rows of O have left o_smem
        o_smem.reshape([BM, D]).store(o.to(q_tile.dtype))
        fence_async_shared()
        _tma_store(o_desc, [b, h, m0, 0], o_smem)

    @gluon.jit
    def _consumer(shared, WARPGROUP: gl.constexpr, CAUSAL: gl.constexpr, NEGATIVE_SCALE: gl.constexpr,
                  O_THROUGH_Q: gl.constexpr):
        """One consumer warpgroup's share of every work tile the program takes: its 64 rows of each. Its
        rows of O go out through ``o_smem``, or, where shared memory has no room for that, through its Q
        tile, which is then reloaded only once they have left. ``shared``: what every consumer takes
        (``_fwd_kernel``)."""
        (q_desc, o_desc, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, ready, empty, turn, tiles, tile_ready,
         tile_empty, lse_ptr, qk_scale, n_m, BH, H, SQ, SKV) = shared
        CONSUMERS: gl.constexpr = q_smem.shape[0]
        BM: gl.constexpr = q_smem.shape[3]
        D: gl.constexpr = q_smem.shape[4]
        BLOCK_N: gl.constexpr = k_smem.shape[3]
        q_tile = _tile(q_smem, WARPGROUP, BM, D)
        count = 0
        i = 0
        tile = _next_tile(tiles, tile_ready, tile_empty, i, 4)
        while tile < n_m * BH:
            b, h, m0, full, n_blocks = _work(tile, n_m, H, SQ, SKV, CONSUMERS * BM, BLOCK_N, CAUSAL)
            mbarrier.wait(q_ready.index(WARPGROUP), i & 1)
            _attend(q_tile, k_smem, v_smem, o_smem.index(WARPGROUP), o_desc, ready, empty, turn,
                    q_empty.index(WARPGROUP), lse_ptr + (b * H + h).to(gl.int64) * SQ, qk_scale, b, h,
                    m0 + WARPGROUP * BM, SQ, SKV, full, n_blocks, count, WARPGROUP, CAUSAL, NEGATIVE_SCALE, O_THROUGH_Q)
            if O_THROUGH_Q:
                tma.store_wait(0)
                mbarrier.arrive(q_empty.index(WARPGROUP), count=1)  # its rows of O have left Q's tile: reload Q
            count += n_blocks
            i += 1
            tile = _next_tile(tiles, tile_ready, tile_empty, i, 4)
        tma.store_wait(0)

    @gluon.jit
    def _next_tile(tiles, tile_ready, tile_empty, i, WARPS: gl.constexpr):
        """The ``i``-th work tile the loader handed this program (a number past the last: none left)."""
        mbarrier.wait(tile_ready.index(i % 2), (i // 2) & 1)
        tile = gl.max(tiles.index(i % 2).load(gl.BlockedLayout([1], [32], [WARPS], [0])), axis=0)
        mbarrier.arrive(tile_empty.index(i % 2), count=1)
        return tile

    @gluon.jit
    def _hand_out(tiles, tile_ready, tile_empty, i, tile):
        """Gives the consumers their ``i``-th work tile through a two-slot ring."""
        mbarrier.wait(tile_empty.index(i % 2), ((i // 2) & 1) ^ 1)
        tiles.index(i % 2).store(gl.full([1], tile, gl.int32, gl.BlockedLayout([1], [32], [1], [0])))
        mbarrier.arrive(tile_ready.index(i % 2), count=1)

    @gluon.jit
    def _fwd_loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, ready, empty, tiles, tile_ready,
                    tile_empty, counter, n_m, BH, H, GROUP, SQ, SKV, CAUSAL: gl.constexpr, O_THROUGH_Q: gl.constexpr):
        """Every work tile's Q (a 64-row part a consumer, each reloaded once its warpgroup is done with the last)
        and K/V tiles, in the consumers' order. The first tile's Q goes first; a later tile's, which waits
        for the consumers to be done with the tile before, after its first K/V tiles, so that the ring
        fills for it meanwhile. Where the consumers free Q after their last S, that is one tile fewer than
        the ring holds: the last slot is freed only after their last P V, and the Q load would wait for it.

        Program ``p`` takes tile ``p`` first; after that each next tile is whichever is next in order
        when it asks (``counter[0]``, an atomic add), so that programs that drew light tiles (a causal
        mask's first query blocks) take more of them. The last program to finish sets the counter back
        to zero for the next launch on its stream (:func:`_tile_counter`)."""
        STAGES: gl.constexpr = k_smem.shape[0]
        CONSUMERS: gl.constexpr = q_smem.shape[0]
        BM: gl.constexpr = CONSUMERS * q_smem.shape[3]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        # (Triton 3.6 passes the loader's constexprs as runtime values, and folds this back to a constant)
        KV_BEFORE_Q: gl.constexpr = STAGES if O_THROUGH_Q else STAGES - 1
        count = 0
        i = 0
        tile = gl.program_id(0)
        while tile < n_m * BH:
            _hand_out(tiles, tile_ready, tile_empty, i, tile)
            b, h, m0, full, n_blocks = _work(tile, n_m, H, SQ, SKV, BM, BLOCK_N, CAUSAL)
            early = gl.minimum(n_blocks, KV_BEFORE_Q) * (i > 0).to(gl.int32)
            count = _stream(k_desc, v_desc, k_smem, v_smem, ready, empty, b, h // GROUP, 1, 0, early, count)
            for part in gl.static_range(CONSUMERS):
                mbarrier.wait(q_empty.index(part), (i & 1) ^ 1)
                mbarrier.expect(q_ready.index(part), q_desc.block_type.nbytes)
                _tma_load(q_desc, [b, h, m0 + part * q_smem.shape[3], 0], q_ready.index(part), q_smem.index(part))
            count = _stream(k_desc, v_desc, k_smem, v_smem, ready, empty, b, h // GROUP, 1, early, n_blocks, count)
            tile = gl.num_programs(0) + gl.atomic_add(counter, 1)
            i += 1
        _hand_out(tiles, tile_ready, tile_empty, i, tile)
        # every program asks once past the last tile, and only then counts itself done here
        if gl.atomic_add(counter + 1, 1) == gl.num_programs(0) - 1:
            gl.store(counter, 0)
            gl.store(counter + 1, 0)

    @gluon.jit
    def _fwd_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, counter, BH, H, GROUP, SQ, SKV, qk_scale,
                    CAUSAL: gl.constexpr, NEGATIVE_SCALE: gl.constexpr, STAGES: gl.constexpr,
                    O_THROUGH_Q: gl.constexpr, CONSUMERS: gl.constexpr, num_warps: gl.constexpr):
        """Each program takes work tiles (64 query rows a consumer warpgroup, of one batch and head) until
        none is left, its barriers set up once and its K/V ring running on from one tile into the next: a
        persistent grid where the host launches fewer programs than tiles (:func:`programs`), one tile a
        program else. The partitions: CONSUMERS consumer warpgroups (the first is the default partition)
        and the loader warp.
        ``counter``: two int32 zeros (:func:`_tile_counter`), back at zero when the launch ends."""
        BM: gl.constexpr = q_desc.block_type.shape[2]  # a consumer warpgroup's rows
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        D: gl.constexpr = q_desc.block_type.shape[3]
        dtype: gl.constexpr = q_desc.dtype
        gl.static_assert(STAGES >= 2, "a consumer holds a slot while it waits for the next one")
        n_m = gl.cdiv(SQ, CONSUMERS * BM)
        q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, 1, 1, BM, D], q_desc.layout)
        if O_THROUGH_Q:
            o_smem = q_smem
        else:
            o_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, 1, 1, BM, D], o_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, D], v_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        tiles = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        tile_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        tile_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(CONSUMERS):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=1)
            mbarrier.init(turn.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(tile_ready.index(i), count=1)
            mbarrier.init(tile_empty.index(i), count=CONSUMERS)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=CONSUMERS)  # a slot is free once every consumer is done with it
        # what every consumer takes (a tuple keeps no constexpr: those go apart)
        shared = (q_desc, o_desc, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, ready, empty, turn, tiles,
                  tile_ready, tile_empty, lse_ptr, qk_scale, n_m, BH, H, SQ, SKV)
        loader = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, ready, empty, tiles, tile_ready,
                  tile_empty, counter, n_m, BH, H, GROUP, SQ, SKV, CAUSAL, O_THROUGH_Q)
        # the consumers' and the loader's registers (setmaxnreg) within the register file: FWD_MAXNREG
        gl.static_assert(CONSUMERS == 2 or CONSUMERS == 3, "two or three consumer warpgroups")
        if CONSUMERS == 2:
            gl.warp_specialize([(_consumer, (shared, 0, CAUSAL, NEGATIVE_SCALE, O_THROUGH_Q)),
                                (_consumer, (shared, 1, CAUSAL, NEGATIVE_SCALE, O_THROUGH_Q)),
                                (_fwd_loader, loader)], [4, 1], [240, 24])
        else:
            gl.warp_specialize([(_consumer, (shared, 0, CAUSAL, NEGATIVE_SCALE, O_THROUGH_Q)),
                                (_consumer, (shared, 1, CAUSAL, NEGATIVE_SCALE, O_THROUGH_Q)),
                                (_consumer, (shared, 2, CAUSAL, NEGATIVE_SCALE, O_THROUGH_Q)),
                                (_fwd_loader, loader)], [4, 4, 1], [160, 160, 32])

    @gluon.jit
    def _dkdv_tile(q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, ds_bar, ready, empty, dq_desc, stats_smem,
                   dk, dv, t, b, head, m0, keys, qk_scale, scale, SQ, SKV, WARPGROUP: gl.constexpr,
                   MASK: gl.constexpr, CAUSAL: gl.constexpr):
        """The query tile of ``head`` from row ``m0``, the ``t``-th this warpgroup takes: its share of dK and
        dV, and of dQ; with ``MASK`` its causal or bounds mask applied, else none."""
        BM: gl.constexpr = q_smem.shape[3]
        D: gl.constexpr = q_smem.shape[4]
        BN: gl.constexpr = k_smem.shape[3]
        HALF: gl.constexpr = D // 2
        STAGES: gl.constexpr = q_smem.shape[0]
        DQ_BUFFERS: gl.constexpr = dq_smem.shape[0] // 2
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = _mma_layout(BM)
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_mma_layout(D), k_width=2)
        slot = t % STAGES
        mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
        q_tile = _tile(q_smem, slot, BM, D)
        do_tile = _tile(do_smem, slot, BM, D)
        rows = m0 + gl.arange(0, BM, gl.SliceLayout(0, s_layout))
        # S^T and dP^T, keys x queries: P^T and dS^T then feed dV and dK from registers
        st = warpgroup_mma(_tile(k_smem, WARPGROUP, BN, D), q_tile.permute((1, 0)),
                           gl.zeros([BN, BM], gl.float32, s_layout), use_acc=False)
        dpt = warpgroup_mma(_tile(v_smem, WARPGROUP, BN, D), do_tile.permute((1, 0)),
                            gl.zeros([BN, BM], gl.float32, s_layout), use_acc=False)
        lse = stats_smem.index(2 * slot).load(gl.SliceLayout(0, s_layout))
        if MASK:
            # rows past Sq need no mask (_dkdv); under a causal mask with Sq <= Skv no other row sees a key
            # past Skv, so the causal term alone (2-8% faster at D 128, docs/perf/backward_mask_ab.txt; at D 64
            # the short masks were 0-4% faster: docs/perf/backward_tile_rows_ab.txt)
            if CAUSAL:
                visible = keys[:, None] <= rows[None, :] + (SKV - SQ)
            elif D == 128:  # the rows' term, redundant, was 1-2% faster at D 128 (and 1-3% slower at D 64)
                visible = (rows[None, :] < SQ) & (keys[:, None] < SKV)
            else:
                visible = keys[:, None] < SKV
            pt = gl.where(visible, gl.exp2(st * qk_scale - lse[None, :]), 0.0)
        else:
            pt = gl.exp2(st * qk_scale - lse[None, :])
        dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do_tile, dv)
        delta = stats_smem.index(2 * slot + 1).load(gl.SliceLayout(0, s_layout))
        ds = (pt * (dpt - delta[None, :])).to(dtype)
        dk = warpgroup_mma(gl.convert_layout(ds, a_layout), q_tile, dk)
        # dS^T double-buffered: a warpgroup writes this buffer again two tiles on, by when the other
        # has passed the next tile's barrier, so it is done reading this one
        buf = t % 2
        ds_smem.index(2 * buf + WARPGROUP).store(ds.permute((1, 0)))
        fence_async_shared()
        mbarrier.arrive(ds_bar.index(buf), count=1)
        mbarrier.wait(ds_bar.index(buf), (t // 2) & 1)
        dq = warpgroup_mma(ds_smem.index(2 * buf), _tile(k_smem, 0, BN, D).slice(WARPGROUP * HALF, HALF, 1),
                           gl.zeros([BM, HALF], gl.float32, _mma_layout(HALF)), use_acc=False)
        dq = warpgroup_mma(ds_smem.index(2 * buf + 1), _tile(k_smem, 1, BN, D).slice(WARPGROUP * HALF, HALF, 1),
                           dq)
        mbarrier.arrive(empty.index(slot), count=1)
        dq_buf = dq_smem.index(2 * (t % DQ_BUFFERS) + WARPGROUP)
        tma.store_wait(DQ_BUFFERS - 1)  # that buffer's last reduce-add has read it
        dq_buf.reshape([BM, HALF]).store(dq * scale)
        fence_async_shared()
        _tma_add(dq_desc, [b, head, m0, WARPGROUP * HALF], dq_buf)
        return dk, dv

    @gluon.jit
    def _dkdv_tiles(q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, ds_bar, ready, empty, dq_desc, stats_smem,
                    dk, dv, t, b, head, m_lo, m_hi, keys, qk_scale, scale, SQ, SKV,
                    WARPGROUP: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr):
        """Query tiles [m_lo, m_hi) of ``head``, the first the ``t``-th this warpgroup takes: (dk, dv, t) after them."""
        BM: gl.constexpr = q_smem.shape[3]
        for m in range(m_lo, m_hi):
            dk, dv = _dkdv_tile(q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, ds_bar, ready, empty, dq_desc,
                                stats_smem, dk, dv, t, b, head, m * BM, keys, qk_scale, scale, SQ, SKV,
                                WARPGROUP, MASK, CAUSAL)
            t += 1
        return dk, dv, t

    @gluon.jit
    def _dkdv(q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, kv_bar, ds_bar, ready, empty, dk_desc, dv_desc,
              dq_desc, stats_smem, qk_scale, scale, b, hk, GROUP, SQ, SKV, n0, lo, hi,
              WARPGROUP: gl.constexpr, CAUSAL: gl.constexpr, SPLIT_MASK: gl.constexpr):
        """One consumer warpgroup of the backward: its 64 keys against every query tile of the group's
        heads that sees them. dK and dV stay in registers. Each tile's dS^T goes to shared memory, and
        once both warpgroups' are there, each computes dS K over all 128 keys for half of dQ's columns
        and adds it to the float32 dQ through a TMA reduce-add: one add per tile and 128 keys, in
        whole lines (per-element atomics from registers, twice as many, took 1.7 ms of a 5.4 ms step).

        With ``SPLIT_MASK`` only the tiles that need it are masked (else all are; BWD_CONFIGS says where):
        the causal diagonal's, and every tile of a block of keys that runs past Skv (its keys' zero rows give
        P the value e^-lse, which overflows where a row's scores are all far below zero: inf times K's zero
        rows is NaN in dQ). Query rows past Sq need no mask: their Q and dO rows read as zeros, so they add
        nothing to dK or dV (the loader gives them lse and delta 0, so P is 1 and dS 0 there)."""
        BM: gl.constexpr = q_smem.shape[3]
        D: gl.constexpr = q_smem.shape[4]
        BN: gl.constexpr = k_smem.shape[3]
        dtype: gl.constexpr = q_smem.dtype
        acc_layout: gl.constexpr = _mma_layout(D)
        k_tile = _tile(k_smem, WARPGROUP, BN, D)
        v_tile = _tile(v_smem, WARPGROUP, BN, D)
        my_keys = n0 + WARPGROUP * BN
        keys = my_keys + gl.arange(0, BN, gl.SliceLayout(1, _mma_layout(BM)))
        dk = gl.zeros([BN, D], gl.float32, acc_layout)
        dv = gl.zeros([BN, D], gl.float32, acc_layout)
        # query tiles [lo, split) see only some of these keys; [split, hi) see all of them
        split = lo
        if CAUSAL:
            split = gl.minimum(gl.maximum(gl.cdiv(gl.maximum(n0 + 2 * BN - 1 - (SKV - SQ), 0), BM), lo), hi)
        if n0 + 2 * BN > SKV:
            split = hi
        mbarrier.wait(kv_bar, 0)
        if SPLIT_MASK:
            t = 0
            for g in range(GROUP):
                dk, dv, t = _dkdv_tiles(q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, ds_bar, ready, empty,
                                        dq_desc, stats_smem, dk, dv, t, b, hk * GROUP + g, lo, split, keys,
                                        qk_scale, scale, SQ, SKV, WARPGROUP, True, CAUSAL)
                dk, dv, t = _dkdv_tiles(q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, ds_bar, ready, empty,
                                        dq_desc, stats_smem, dk, dv, t, b, hk * GROUP + g, split, hi, keys,
                                        qk_scale, scale, SQ, SKV, WARPGROUP, False, CAUSAL)
        else:  # one flat loop over all heads' tiles: nested loops spill more at D 128 (80 / 208 bytes, Triton 3.6)
            per_head = hi - lo
            for t in range(GROUP * per_head):
                dk, dv = _dkdv_tile(q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, ds_bar, ready, empty, dq_desc,
                                    stats_smem, dk, dv, t, b, hk * GROUP + t // per_head,
                                    (lo + t % per_head) * BM, keys, qk_scale, scale, SQ, SKV, WARPGROUP, True,
                                    CAUSAL)
        # the other warpgroup's last dQ MMA reads this one's K tile
        mbarrier.arrive(ds_bar.index(2), count=1)
        mbarrier.wait(ds_bar.index(2), 0)
        # this warpgroup's K and V tiles are free: its rows of dK and dV go out through them
        k_tile.store((dk * scale).to(dtype))
        v_tile.store(dv.to(dtype))
        fence_async_shared()
        _tma_store(dk_desc, [b, hk, my_keys, 0], k_smem.index(WARPGROUP))
        _tma_store(dv_desc, [b, hk, my_keys, 0], v_smem.index(WARPGROUP))
        tma.store_wait(0)

    # one build for every band: Triton would otherwise compile BAND = 1 (every unmasked call) and multiples of
    # 16 apart, builds whose registers tests/test_triton_compiles.py does not see
    @gluon.jit(do_not_specialize=["BAND"])
    def _bwd_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, lse_ptr, delta_ptr, H, GROUP, SQ, SKV,
                    BAND, qk_scale, scale, CAUSAL: gl.constexpr, STAGES: gl.constexpr, DQ_BUFFERS: gl.constexpr,
                    SPLIT_MASK: gl.constexpr, num_warps: gl.constexpr):
        """dK and dV of 2 x 64 keys of one (batch, KV head) over every query of its group's heads that sees
        them, and those queries' dS K added to a float32 dQ (cast afterwards).

        Programs start in the order of their id, which runs over bands of ``BAND`` (batch, KV head) pairs,
        and within a band over key blocks, each block for every pair of the band: a band's programs run
        together and share its Q/dO tiles and dQ in L2, and under a causal mask the heaviest (the first key
        blocks, which the most queries see) start first, so that no heavy program starts last (:func:`band`)."""
        BM: gl.constexpr = q_desc.block_type.shape[2]
        BN: gl.constexpr = k_desc.block_type.shape[2]
        D: gl.constexpr = q_desc.block_type.shape[3]
        dtype: gl.constexpr = q_desc.dtype
        hkv = H // GROUP
        blocks = gl.num_programs(0)
        pairs = gl.num_programs(1)
        pid = gl.program_id(1) * blocks + gl.program_id(0)
        first = pid // (BAND * blocks) * BAND
        width = gl.minimum(BAND, pairs - first)
        within = pid - first * blocks
        pair = first + within % width
        b = pair // hkv
        hk = pair % hkv
        n0 = within // width * 2 * BN
        lo = 0
        if CAUSAL:  # query tiles before the first that sees key n0 see none of these keys
            lo = gl.maximum(n0 - (SKV - SQ), 0) // BM
        hi = gl.cdiv(SQ, BM)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BM, D], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BM, D], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, BN, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, BN, D], v_desc.layout)
        ds_smem = gl.allocate_shared_memory(dtype, [4, BM, BN], gl.NVMMASharedLayout.get_default_for([BM, BN], dtype))
        dq_smem = gl.allocate_shared_memory(gl.float32, [2 * DQ_BUFFERS, 1, 1, BM, D // 2], dq_desc.layout)
        # each slot's lse and delta rows (a shape of powers of two: room for up to 4 stages)
        gl.static_assert(STAGES <= 4)
        stats_smem = gl.allocate_shared_memory(gl.float32, [8, BM],
                                               gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ds_bar = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())  # two dS buffers, the end
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(3):
            mbarrier.init(ds_bar.index(i), count=2)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=2)  # the TMA bytes' arrive and the lse/delta stores'
            mbarrier.init(empty.index(i), count=2)  # a slot is free once both consumer warpgroups are done with it
        mbarrier.expect(kv_bar, 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
        for i in gl.static_range(2):
            _tma_load(k_desc, [b, hk, n0 + i * BN, 0], kv_bar, k_smem.index(i))
            _tma_load(v_desc, [b, hk, n0 + i * BN, 0], kv_bar, v_smem.index(i))
        gl.warp_specialize([
            (_dkdv, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, kv_bar, ds_bar, ready, empty, dk_desc, dv_desc,
                     dq_desc, stats_smem, qk_scale, scale, b, hk, GROUP, SQ, SKV, n0, lo, hi, 0, CAUSAL,
                     SPLIT_MASK)),
            (_dkdv, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, kv_bar, ds_bar, ready, empty, dk_desc, dv_desc,
                     dq_desc, stats_smem, qk_scale, scale, b, hk, GROUP, SQ, SKV, n0, lo, hi, 1, CAUSAL,
                     SPLIT_MASK)),
            (_bwd_loader, (q_desc, do_desc, q_smem, do_smem, stats_smem, ready, empty, lse_ptr, delta_ptr, b, hk * GROUP,
                           GROUP, lo, hi, H, SQ)),
        ], [4, 1], [240, 24])


# (BLOCK_N, STAGES, O_THROUGH_Q, CONSUMERS) per (head dim, causal): a work tile is 64 query rows a consumer
# warpgroup. At D 64 unmasked, three consumers on 192-row tiles were 10-12% faster than two from 2k on the
# H100 (docs/perf/forward_config_sweep_d64.txt): each K/V tile feeds 50% more rows (FlashAttention-3's
# D 64 tile). Under a causal mask they were 2.4x slower at 1k and level only from 8k: a 192-row tile's
# first warpgroup runs through every key its last one sees, and fewer tiles share the diagonal's work.
# D 256: 64-key tiles in two stages, O out through Q, the one config that fits (O alone is 128 float32
# registers a consumer thread; 128-key tiles fit one stage only and spill 408 bytes there, three stages of
# 64 keys take 256 KB of shared memory).
CONFIGS = {(64, False): (128, 4, False, 3), (64, True): (128, 4, False, 2), (128, False): (128, 3, True, 2),
           (128, True): (128, 3, True, 2), (256, False): (64, 2, True, 2), (256, True): (64, 2, True, 2)}
# The backward: (query rows a tile, Q/dO ring stages, dQ buffers a warpgroup writes in turn, masked tiles looped
# apart) per (head dim, causal), the faster of those timed on the H100 (docs/backends/triton.md,
# docs/perf/backward_variants_ab.txt); 2 x 64 keys (BWD_BLOCK_N) a program. Each fits the 227 KB of shared memory
# an H100 block may have. D 64 takes 128-row tiles (FlashAttention-3's): its MMAs are small, so a tile's
# barriers, dS hand-over and dQ add weigh less over twice the rows; 3-10% faster than 64 rows, with room for
# two stages and one dQ buffer. D 128 keeps 64: S^T and dP^T of 128 rows would not fit the registers beside
# dK and dV. Masking only the tiles that need it was faster at D 64 causal (2-4% with 16 KV heads at 128
# rows); at D 128 the consumers are at their 240 registers and the second copy of the tile's code spills (a
# runtime branch does too), up to 13% slower, so every tile there is masked, as at D 64 unmasked (where the
# only mask is Skv's, 1-3% faster so). D 128 unmasked: 2 stages and one dQ buffer were 3-6% faster than 3 and one.
BWD_CONFIGS = {(64, False): (128, 2, 1, False), (64, True): (128, 2, 1, True), (128, False): (64, 2, 1, False),
               (128, True): (64, 2, 2, False)}
BWD_BLOCK_N = 64
# The most keys x head dim a row reads where the forward runs on a persistent grid (programs)
PERSISTENT_MAX_WORK = 8192 * 128
# Three warpgroups (two consumers, the loader's) share the register file: capped at 168 a thread overall,
# the loader keeps 24 and each consumer gets 240 (setmaxnreg). With three consumers (the forward's
# CONSUMERS): four warpgroups, 128 overall, 160 a consumer.
MAXNREG = 168
FWD_MAXNREG = {2: MAXNREG, 3: 128}


# Gluon is experimental and its API moves between releases: the kernel was written against these two.
GLUON_READ_IN = ((3, 6), (3, 9))


def supports(q, k, v, causal, out_stride, window=None, softcap=None) -> list[str]:
    """Why the Hopper kernel can't take this call, whose output will have strides ``out_stride``
    (empty: it can)."""
    from portable_ops import env  # here: the kernel module loads without the package (tests/test_triton_compiles.py)

    if gluon is None:
        return ["this Triton has no Gluon"]
    if TRITON_RELEASE not in GLUON_READ_IN:
        return [f"Triton {triton.__version__}: the Gluon kernel was written against Triton 3.6 and 3.9"]
    if not env.flag("PORTABLE_OPS_SM90_ATTENTION", True):
        return ["PORTABLE_OPS_SM90_ATTENTION is off"]
    reasons = []
    if window is not None:
        reasons.append("a sliding window: the Hopper kernels have no window mask yet (the tl.* kernels skip the "
                       "blocks outside it)")
    if softcap is not None:
        reasons.append("a softcap: the Hopper kernels have no tanh in their softmax yet (the tl.* kernels have)")
    if not (q.is_cuda and _is_sm90(_index(q.device))):
        reasons.append("not an sm_90 GPU")
    if q.dtype not in (torch.float16, torch.bfloat16) or not (q.dtype == k.dtype == v.dtype):
        reasons.append("only float16/bfloat16 q, k, v of one dtype")
    d = q.shape[-1]
    if d not in HEAD_DIMS:
        reasons.append(f"head_dim {d} is not one of {HEAD_DIMS}")
    sq, skv = q.shape[2], k.shape[2]
    if sq <= 64:
        reasons.append("decode-sized Sq (<= 64) runs the split-key kernel")
    if causal and sq > skv:
        reasons.append("causal with Sq > Skv has rows that see no key")
    if q.numel() == 0 or k.numel() == 0:
        reasons.append("an empty dim (a TMA descriptor has none)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        reasons += _tma_reasons(name, t, t.stride())
    return reasons + _tma_reasons("out", q, out_stride, allocated=False)


def config(d: int, causal: bool) -> tuple:
    """``CONFIGS[d, causal]`` for the Triton this runs on: three consumers were timed with Triton 3.6
    (the H100's); compiled by 3.9 they spill 96 bytes inside the main loop (8 with 3.6), untimed, so
    3.9 keeps two."""
    block_n, stages, o_through_q, consumers = CONFIGS[d, causal]
    return block_n, stages, o_through_q, consumers if TRITON_RELEASE == (3, 6) else 2


def programs(q, k, causal) -> int:
    """The forward's grid: persistent (one program per SM, which its shared memory fills, each taking
    the next work tile as it frees up) where rows are short enough that a tile's set-up and the
    ring's refill show, one program per tile past that. On the H100 at 16k tokens the persistent grid
    was 2-12% faster up to 8192 x 128 keys x head dim a row, causal or not, and up to 7% slower past
    it (``docs/performance.md``, "The persistent forward")."""
    tiles = triton.cdiv(q.shape[2], WARPGROUP_ROWS * config(q.shape[3], causal)[3]) * q.shape[0] * q.shape[1]
    if k.shape[2] * q.shape[3] > PERSISTENT_MAX_WORK:
        return tiles
    return min(tiles, _multiprocessors(q.device))


def _index(device) -> int:
    """A CUDA device's index, the current device's where it names none (``torch.device("cuda")``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def _multiprocessors(device) -> int:
    return _device_multiprocessors(_index(device))


@functools.lru_cache(maxsize=None)
def _device_multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _is_sm90(index: int) -> bool:
    # ROCm reports gfx90a and the MI300s as capability 9.x too
    return torch.version.hip is None and torch.cuda.get_device_capability(index) == (9, 0)


def _tma_strides(shape, stride, element_size) -> list[int]:
    """``stride``, with any stride of a size-one dim (never stepped, but TMA wants it 16-byte
    aligned all the same) replaced by an aligned one."""
    return [st if n > 1 else 16 // element_size for n, st in zip(shape, stride)]


def _tma_reasons(name, t, stride, allocated=True) -> list[str]:
    """Why TMA can't address ``t`` through ``stride``; a tensor not ``allocated`` yet (an output)
    has no base to check, only its shape and the strides it will have."""
    reasons = []
    if not _tma_addressable(t.shape, stride, t.element_size()) or (allocated and t.data_ptr() % 16):
        reasons.append(f"{name}'s strides or base are not 16-byte aligned with a unit last stride (TMA needs them)")
    if any(st == 0 and n > 1 for n, st in zip(t.shape, stride)):
        reasons.append(f"{name} is broadcast (a stride-0 dim): not verified through TMA")
    return reasons


def _tma_addressable(shape, stride, element_size) -> bool:
    return stride[-1] == 1 and all(st * element_size % 16 == 0
                                   for st in _tma_strides(shape, stride, element_size)[:-1])


def tile(block, head_dim, dtype):
    """The TMA tile of ``block`` rows of a ``[B, H, S, head_dim]`` tensor of Gluon ``dtype``: its
    block shape and shared-memory layout, what the kernel is specialised on."""
    shape = [1, 1, block, head_dim]
    return shape, gl.NVMMASharedLayout.get_default_for(shape, dtype)


def _template(t, stride, block, cols=None):
    """A descriptor of ``t``'s shape and dtype over ``stride`` (tiles of ``block`` rows and ``cols``
    columns, all of them by default), checked once, holding no tensor (a plan outlives the call that
    built it): its launch gives it one per call."""
    dtype = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[t.dtype]
    shape, layout = tile(block, cols or t.shape[-1], dtype)
    descriptor = TensorDescriptor(t, list(t.shape), _tma_strides(t.shape, stride, t.element_size()), shape, layout)
    descriptor.base = None
    return descriptor


class Plan:
    """What a call of one layout needs, built once: the launch, over descriptor templates of q, k,
    v and the output."""

    __slots__ = ("launch", "args")

    def __init__(self, q, k, v, out_stride, causal, scale):
        b, h, sq, d = q.shape
        block_n, stages, o_through_q, consumers = config(d, causal)
        descriptors = (_template(q, q.stride(), WARPGROUP_ROWS), _template(k, k.stride(), block_n),
                       _template(v, v.stride(), block_n), _template(q, out_stride, WARPGROUP_ROWS))
        self.launch = Launch(_fwd_kernel, (programs(q, k, causal),), 0, descriptors, CAUSAL=causal,
                             NEGATIVE_SCALE=scale < 0, STAGES=stages, O_THROUGH_Q=o_through_q, CONSUMERS=consumers,
                             num_warps=4, maxnreg=FWD_MAXNREG[consumers])
        self.args = (b * h, h, h // k.shape[1], sq, k.shape[2])


def forward(plan, q, k, v, out, scale):
    """(out, lse) for a call :func:`supports` took and ``plan`` was built for; ``out`` is written
    through its strides."""
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    plan.launch(q, k, v, out, lse, _tile_counter(q.device), *plan.args, scale * LOG2E)
    return out, lse


_TILE_COUNTERS: dict = {}


def _tile_counter(device) -> torch.Tensor:
    """The forward's work-tile counter: two int32 zeros, which a launch counts up and its last program
    sets back. Eagerly, one per stream, kept: launches running at once on two streams never share one.
    While a CUDA graph is captured, a new one per call, its zero-fill captured with it: a kept one made
    during a capture would never be filled outside that graph's replays, and one kept from before would
    be shared by every graph captured on the stream, whichever stream each is replayed on."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(2, dtype=torch.int32, device=device)
    index = _index(device)
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    counter = _TILE_COUNTERS.get(key)
    if counter is None:
        counter, filled = _kept_zeros(index)
        torch.cuda.current_stream(index).wait_event(filled)
        # two threads on one stream may both get here: all use the first one kept
        counter = _TILE_COUNTERS.setdefault(key, counter)
    return counter


def _kept_zeros(index: int):
    """Two int32 zeros outside any CUDA-graph memory pool, and the event their fill records:
    torch.compile's CUDA-graph warm-up sends every allocation of the current thread to its graphs'
    pool, which must hold no tensor it doesn't track, so they are made on a thread of their own,
    on a stream of its own (no wait on the default stream, nothing the host waits for)."""
    def make():
        with torch.cuda.device(index):
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                zeros = torch.zeros(2, dtype=torch.int32, device="cuda")
                filled = torch.cuda.Event()
                filled.record(stream)
        return zeros, filled

    with concurrent.futures.ThreadPoolExecutor(1) as worker:
        return worker.submit(make).result()


class BwdPlan:
    """The backward's launch for one layout, over descriptor templates of q, k, v, dO, dK, dV and the
    float32 dQ it adds into."""

    __slots__ = ("launch", "args")

    def __init__(self, q, k, v, dout, dk_stride, dv_stride, causal):
        b, h, sq, d = q.shape
        hkv, skv = k.shape[1], k.shape[2]
        block_m, stages, dq_buffers, split_mask = BWD_CONFIGS[d, causal]
        dq_sum = torch.empty(q.shape, dtype=torch.float32, device="meta")
        descriptors = tuple(_template(t, stride, rows) for t, stride, rows in
                            ((q, q.stride(), block_m), (k, k.stride(), BWD_BLOCK_N), (v, v.stride(), BWD_BLOCK_N),
                             (dout, dout.stride(), block_m), (k, dk_stride, BWD_BLOCK_N), (v, dv_stride, BWD_BLOCK_N)))
        descriptors += (_template(dq_sum, dq_sum.stride(), block_m, d // 2),)
        blocks = triton.cdiv(skv, 2 * BWD_BLOCK_N)
        self.launch = Launch(_bwd_kernel, (blocks, b * hkv), 2, descriptors, CAUSAL=causal,
                             STAGES=stages, DQ_BUFFERS=dq_buffers, SPLIT_MASK=split_mask, num_warps=4,
                             maxnreg=MAXNREG)
        self.args = (h, h // hkv, sq, skv, band(blocks, b * hkv, causal, _multiprocessors(q.device)))


# On the H100 (docs/perf/backward_bands_ab.txt, bands of 16k-token batches: pairs a power of two) the bands
# that fill the GPU about once were the fastest timed, 12-25% ahead of one pair a band with 4 KV heads at
# 1k-8k and 3-5% with 16; bands of two waves were up to 9% behind them, and one band of all pairs took
# up to 1.68x their time (L2 no longer holds the heads that run together).
def band(blocks: int, pairs: int, causal: bool, multiprocessors: int) -> int:
    """How many (batch, KV head) pairs the backward's programs start together (``_bwd_kernel``): one
    without a mask (every program has the same work). Under a causal mask, the divisor of ``pairs``
    whose programs come nearest to filling the GPU once (no band is cut short: a short last band's heavy
    programs start last), within half to twice that; where none is, one (the order before bands: a band
    larger or smaller was not timed, and one of all pairs lost L2's sharing)."""
    if not causal:
        return 1
    wave = multiprocessors / blocks  # pairs whose programs fill the GPU once
    fits = [c for c in range(1, pairs + 1)
            if pairs % c == 0 and c <= 2 * wave and (c >= wave / 2 or c == pairs)]
    return min(fits, key=lambda c: abs(math.log(c / wave)), default=1)


def backward(plan, q, k, v, dout, lse, delta, dq_sum, dk, dv, scale):
    """For a call :func:`supports_backward` took: dk and dv written through their strides, and dQ added
    into ``dq_sum`` (float32 [B, H, Sq, D], contiguous, zeros before), for the caller to cast."""
    plan.launch(q, k, v, dout, dk, dv, dq_sum, lse, delta, *plan.args, scale * LOG2E, scale)


def supports_backward(q, k, v, dout, causal, strides, window=None, softcap=None):
    """Why the Hopper backward can't take this call (empty: it can); ``strides``: dq's, dk's, dv's."""
    reasons = supports(q, k, v, causal, strides[0], window, softcap)
    if q.shape[-1] not in BWD_HEAD_DIMS:
        reasons.append(f"head_dim {q.shape[-1]}: the Hopper backward takes {BWD_HEAD_DIMS} (the tl.* one the rest)")
    if torch.are_deterministic_algorithms_enabled():
        reasons.append("torch.use_deterministic_algorithms is on: dQ is summed with float32 reduce-adds in no fixed "
                       "order (the tl.* backward's dQ pass is deterministic)")
    if dout.dtype != q.dtype:
        reasons.append(f"dout has dtype {dout.dtype}, q {q.dtype}: the kernel reads both through one tile type")
    reasons += _tma_reasons("dout", dout, dout.stride())
    for name, t, stride in (("dk", k, strides[1]), ("dv", v, strides[2])):
        reasons += _tma_reasons(name, t, stride, allocated=False)
    return reasons
