"""The Gluon attention backward for Hopper (sm_90): one pass over the queries per block of keys, dK and dV
kept in registers, and dQ added into a float32 buffer through TMA reduce-adds.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma

from .attention_sm90_tma import fill_slot, mma_layout, slot_matrix, tma_add, tma_load, tma_store
from .attention_tiles import LOG2E


@gluon.jit
def _bwd_loader(q_desc, do_desc, q_smem, do_smem, stats_smem, ready, empty, lse_ptr, delta_ptr, b, head, heads,
                lo, hi, H, SQ):
    """The backward's Q/dO tiles ``[lo, hi)`` of ``heads`` heads from ``head``, through the ring; each
    slot also gets its rows' lse (times log2 e) and delta in shared memory, which the consumers read
    when they use them: loaded by them from global memory, the two would stay live in registers across
    the MMAs, and the wait for them would show. A slot is ready on its TMA bytes and this warp's arrive
    (mbarrier arrives release the stores before them to the waiting warps)."""
    BM: gl.constexpr = q_desc.block_type.shape[2]
    row_layout: gl.constexpr = gl.BlockedLayout([BM // 32], [32], [1], [0])
    per_head = hi - lo
    for t in range(heads * per_head):
        h = head + t // per_head
        m0 = (lo + t % per_head) * BM
        slot = fill_slot(q_desc, do_desc, q_smem, do_smem, ready, empty, t, [b, h, m0, 0])
        rows = m0 + gl.arange(0, BM, row_layout)
        at = (b * H + h).to(gl.int64) * SQ + rows
        stats_smem.index(2 * slot).store(gl.load(lse_ptr + at, mask=rows < SQ, other=0.0) * LOG2E)
        stats_smem.index(2 * slot + 1).store(gl.load(delta_ptr + at, mask=rows < SQ, other=0.0))
        mbarrier.arrive(ready.index(slot), count=1)


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
    s_layout: gl.constexpr = mma_layout(BM)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout(D), k_width=2)
    slot = t % STAGES
    mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
    q_tile = slot_matrix(q_smem, slot, BM, D)
    do_tile = slot_matrix(do_smem, slot, BM, D)
    rows = m0 + gl.arange(0, BM, gl.SliceLayout(0, s_layout))
    # S^T and dP^T, keys x queries: P^T and dS^T then feed dV and dK from registers
    st = warpgroup_mma(slot_matrix(k_smem, WARPGROUP, BN, D), q_tile.permute((1, 0)),
                       gl.zeros([BN, BM], gl.float32, s_layout), use_acc=False)
    dpt = warpgroup_mma(slot_matrix(v_smem, WARPGROUP, BN, D), do_tile.permute((1, 0)),
                        gl.zeros([BN, BM], gl.float32, s_layout), use_acc=False)
    lse = stats_smem.index(2 * slot).load(gl.SliceLayout(0, s_layout))
    if MASK:
        # rows past Sq need no mask (_dkdv), and under a causal mask with Sq <= Skv no row sees a key past Skv
        if CAUSAL:
            visible = keys[:, None] <= rows[None, :] + (SKV - SQ)
        elif D == 128:  # the rows' term, redundant, was faster at D 128 (and slower at D 64)
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
    # dS^T double-buffered: two tiles on, when a warpgroup writes this buffer again, the other has read it
    buf = t % 2
    ds_smem.index(2 * buf + WARPGROUP).store(ds.permute((1, 0)))
    fence_async_shared()
    mbarrier.arrive(ds_bar.index(buf), count=1)
    mbarrier.wait(ds_bar.index(buf), (t // 2) & 1)
    dq = warpgroup_mma(ds_smem.index(2 * buf), slot_matrix(k_smem, 0, BN, D).slice(WARPGROUP * HALF, HALF, 1),
                       gl.zeros([BM, HALF], gl.float32, mma_layout(HALF)), use_acc=False)
    dq = warpgroup_mma(ds_smem.index(2 * buf + 1), slot_matrix(k_smem, 1, BN, D).slice(WARPGROUP * HALF, HALF, 1),
                       dq)
    mbarrier.arrive(empty.index(slot), count=1)
    dq_buf = dq_smem.index(2 * (t % DQ_BUFFERS) + WARPGROUP)
    tma.store_wait(DQ_BUFFERS - 1)  # that buffer's last reduce-add has read it
    dq_buf.reshape([BM, HALF]).store(dq * scale)
    fence_async_shared()
    tma_add(dq_desc, [b, head, m0, WARPGROUP * HALF], dq_buf)
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
    whole lines (per-element atomics from registers would be twice as many, and were slower).

    With ``SPLIT_MASK`` only the tiles that need it are masked (else all are; attention_sm90.BWD_CONFIGS says where):
    the causal diagonal's, and every tile of a block of keys that runs past Skv (its keys' zero rows give
    P the value e^-lse, which overflows where a row's scores are all far below zero: inf times K's zero
    rows is NaN in dQ). Query rows past Sq need no mask: their Q and dO rows read as zeros, so they add
    nothing to dK or dV (the loader gives them lse and delta 0, so P is 1 and dS 0 there)."""
    BM: gl.constexpr = q_smem.shape[3]
    D: gl.constexpr = q_smem.shape[4]
    BN: gl.constexpr = k_smem.shape[3]
    dtype: gl.constexpr = q_smem.dtype
    acc_layout: gl.constexpr = mma_layout(D)
    k_tile = slot_matrix(k_smem, WARPGROUP, BN, D)
    v_tile = slot_matrix(v_smem, WARPGROUP, BN, D)
    my_keys = n0 + WARPGROUP * BN
    keys = my_keys + gl.arange(0, BN, gl.SliceLayout(1, mma_layout(BM)))
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
    else:  # one flat loop over all heads' tiles: nested loops spill more at D 128
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
    tma_store(dk_desc, [b, hk, my_keys, 0], k_smem.index(WARPGROUP))
    tma_store(dv_desc, [b, hk, my_keys, 0], v_smem.index(WARPGROUP))
    tma.store_wait(0)


# one build for every band: Triton would specialise BAND = 1 and multiples of 16 apart, builds the compile test misses
@gluon.jit(do_not_specialize=["BAND"])
def bwd_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, lse_ptr, delta_ptr, H, GROUP, SQ, SKV,
               BAND, qk_scale, scale, CAUSAL: gl.constexpr, STAGES: gl.constexpr, DQ_BUFFERS: gl.constexpr,
               SPLIT_MASK: gl.constexpr, num_warps: gl.constexpr):
    """dK and dV of 2 x 64 keys of one (batch, KV head) over every query of its group's heads that sees
    them, and those queries' dS K added to a float32 dQ (cast afterwards).

    Programs start in the order of their id, which runs over bands of ``BAND`` (batch, KV head) pairs,
    and within a band over key blocks, each block for every pair of the band: a band's programs run
    together and share its Q/dO tiles and dQ in L2, and under a causal mask the heaviest (the first key
    blocks, which the most queries see) start first, so that no heavy program starts last (``attention_sm90.band``)."""
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
        tma_load(k_desc, [b, hk, n0 + i * BN, 0], kv_bar, k_smem.index(i))
        tma_load(v_desc, [b, hk, n0 + i * BN, 0], kv_bar, v_smem.index(i))
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
