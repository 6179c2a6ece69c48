"""The Gluon attention forward for Hopper (sm_90): TMA loads into a shared-memory ring filled by a producer
warp, warpgroup MMAs, and softmax overlapped with the tensor cores.

A work tile is 64 query rows of one (batch, head) for each of two or three consumer warpgroups
(``attention_sm90.CONFIGS``), which share every K/V tile. A one-warp loader loads the Q tiles and streams
the K/V tiles through ``STAGES`` slots, each guarded by a ready and an empty mbarrier; they run as
partitions of ``gl.warp_specialize``. A program takes one work tile, or, on a persistent grid
(``attention_sm90.programs`` says where), the next one free after each, its ring running on from one to the
next. Each consumer runs an iteration in this order, so that the exponentials of one tile overlap the
tensor cores' work on the previous one::

    (my turn) S_j = Q K_j^T; O += P_{j-1} V_{j-1}   (both issued, not waited) (their turn)
    wait S_j; P_j = exp2(S_j * scale - m_j) ...    (softmax while P_{j-1} V_{j-1} runs)
    wait O; O *= alpha_j; free slot j - 1

and the consumers take turns issuing their MMAs (FlashAttention-3's ping-pong), so that one's softmax also
runs under the others' MMAs.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .attention_sm90_tma import fill_slot, mma_layout, slot_matrix, tma_load, tma_store
from .attention_tiles import LN2


@gluon.jit
def _stream(a_desc, b_desc, a_smem, b_smem, ready, empty, b, head, heads, lo, hi, count):
    """Streams tiles ``[lo, hi)`` of ``a`` and ``b`` (rows of one sequence), head by head for ``heads``
    heads from ``head``, through the ring, whose ``count`` loads so far place them (the forward's K/V).
    Returns the count after them."""
    BLOCK: gl.constexpr = a_desc.block_type.shape[2]
    per_head = hi - lo
    for t in range(heads * per_head):
        fill_slot(a_desc, b_desc, a_smem, b_smem, ready, empty, count + t,
                  [b, head + t // per_head, (lo + t % per_head) * BLOCK, 0])
    return count + heads * per_head


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
        s = warpgroup_mma(q_tile, slot_matrix(k_smem, slot, BLOCK_N, D).permute((1, 0)),
                          gl.zeros([BM, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
        o = warpgroup_mma(p, slot_matrix(v_smem, prev, BLOCK_N, D), o, is_async=True)
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
    s_layout: gl.constexpr = mma_layout(BLOCK_N)
    o_layout: gl.constexpr = mma_layout(D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    STAGES: gl.constexpr = k_smem.shape[0]
    rows = m0 + gl.arange(0, BM, gl.SliceLayout(1, s_layout))
    diagonal = SKV - SQ
    # Tile 0, alone: every row sees a key in it (the kernel takes no rows that see none), so m is finite after it.
    first = count % STAGES
    mbarrier.wait(ready.index(first), (count // STAGES) & 1)
    _my_turn(turn, count, WARPGROUP)
    s = warpgroup_mma(q_tile, slot_matrix(k_smem, first, BLOCK_N, D).permute((1, 0)),
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
    o = warpgroup_mma(p, slot_matrix(v_smem, last, BLOCK_N, D), o)
    mbarrier.arrive(empty.index(last), count=1)
    o = o / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    lse = (m_i + gl.log2(l_i)) * LN2
    gl.store(lse_ptr + rows, lse, mask=rows < SQ)
    tma.store_wait(0)  # the previous work tile's rows of O have left o_smem
    o_smem.reshape([BM, D]).store(o.to(q_tile.dtype))
    fence_async_shared()
    tma_store(o_desc, [b, h, m0, 0], o_smem)


@gluon.jit
def _consumer(shared, WARPGROUP: gl.constexpr, CAUSAL: gl.constexpr, NEGATIVE_SCALE: gl.constexpr,
              O_THROUGH_Q: gl.constexpr):
    """One consumer warpgroup's share of every work tile the program takes: its 64 rows of each. Its
    rows of O go out through ``o_smem``, or, where shared memory has no room for that, through its Q
    tile, which is then reloaded only once they have left. ``shared``: what every consumer takes
    (``fwd_kernel``)."""
    (q_desc, o_desc, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, ready, empty, turn, tiles, tile_ready,
     tile_empty, lse_ptr, qk_scale, n_m, BH, H, SQ, SKV) = shared
    CONSUMERS: gl.constexpr = q_smem.shape[0]
    BM: gl.constexpr = q_smem.shape[3]
    D: gl.constexpr = q_smem.shape[4]
    BLOCK_N: gl.constexpr = k_smem.shape[3]
    q_tile = slot_matrix(q_smem, WARPGROUP, BM, D)
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
    to zero for the next launch on its stream (``attention_sm90._tile_counter``)."""
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
            tma_load(q_desc, [b, h, m0 + part * q_smem.shape[3], 0], q_ready.index(part), q_smem.index(part))
        count = _stream(k_desc, v_desc, k_smem, v_smem, ready, empty, b, h // GROUP, 1, early, n_blocks, count)
        tile = gl.num_programs(0) + gl.atomic_add(counter, 1)
        i += 1
    _hand_out(tiles, tile_ready, tile_empty, i, tile)
    # every program asks once past the last tile, and only then counts itself done here
    if gl.atomic_add(counter + 1, 1) == gl.num_programs(0) - 1:
        gl.store(counter, 0)
        gl.store(counter + 1, 0)


@gluon.jit
def fwd_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, counter, BH, H, GROUP, SQ, SKV, qk_scale,
               CAUSAL: gl.constexpr, NEGATIVE_SCALE: gl.constexpr, STAGES: gl.constexpr,
               O_THROUGH_Q: gl.constexpr, CONSUMERS: gl.constexpr, num_warps: gl.constexpr):
    """Each program takes work tiles (64 query rows a consumer warpgroup, of one batch and head) until
    none is left, its barriers set up once and its K/V ring running on from one tile into the next: a
    persistent grid where the host launches fewer programs than tiles (``attention_sm90.programs``), one tile a
    program else. The partitions: CONSUMERS consumer warpgroups (the first is the default partition)
    and the loader warp.
    ``counter``: two int32 zeros (``attention_sm90._tile_counter``), back at zero when the launch ends."""
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
    # the consumers' and the loader's registers (setmaxnreg) within the register file: attention_sm90.FWD_MAXNREG
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
