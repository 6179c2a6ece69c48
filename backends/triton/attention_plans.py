"""Everything a tl.* attention launch needs that depends only on the layout of the call (shapes, strides,
dtypes, device, options), built once into a plan kept by that layout: a call then costs one key, one dict
lookup, its allocations and its launches. Where the Gluon kernels (attention_sm90) take a call, its plan
holds theirs.

Every tensor is addressed through its strides, outputs included (``layout.empty_like``), so nothing is
copied on the way in or out unless its last dim is strided.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton

from portable_ops.definitions.attention import sink_gradient

from . import attention_sm90
from .attention_bwd_kernels import delta_kernel, dkdv_kernel, dq_kernel
from .attention_configs import DECODE_CONFIG, dot_precision, head_split, key_splits, tile_config, upcast
from .attention_fwd_kernels import combine_kernel, fwd_kernel
from .attention_tiles import LOG2E
from .interpreter import INTERPRETED
from .launch import Launch


PLANS_SIZE = 4096  # a decode loop meets a new cache length every token: bounded, cleared when full
fwd_plans: dict = {}
bwd_plans: dict = {}


def remember(plans: dict, plan):
    if len(plans) >= PLANS_SIZE:
        plans.clear()
    plans[plan.key] = plan
    return plan


def forget(plans: dict, plan) -> None:
    """``plan`` out of ``plans``, where a call with it failed: a plan built from what made it fail (a value
    equal to a valid one, of another type) would fail every later call of its layout."""
    if plans.get(plan.key) is plan:
        del plans[plan.key]


MAX_GRID_Y = 65535  # CUDA's limit on a grid's second and third dims


def fold(pairs: int) -> tuple[int, int]:
    """A grid's second and third dims for ``pairs`` programs across (sequence, head) pairs: all in the second
    where they fit, else folded over the third in as few parts as keep the second within MAX_GRID_Y (the
    kernels' ``FOLD``), whose last may run a few programs that return at once."""
    parts = max(triton.cdiv(pairs, MAX_GRID_Y), 1)
    return triton.cdiv(pairs, parts), parts


def most_pairs() -> int:
    """The most (sequence, head) pairs a launch takes: folded over two grid dims, numbered in int32."""
    return min(MAX_GRID_Y * MAX_GRID_Y, 2**31 - MAX_GRID_Y)


def over_pairs(kernel, blocks: int, pairs: int, tensors: int, splits: int = 1, **options) -> Launch:
    """``kernel``'s launch over ``blocks`` x ``pairs`` (x ``splits``, never with a fold) programs."""
    y, z = fold(pairs)
    return Launch(kernel, (blocks, y, z * splits), tensors, FOLD=z > 1, **options)


class Strides(NamedTuple):
    """A [B, H, S, D] view's strides as the kernels take them (its columns are a unit stride apart)."""

    batch: int
    head: int
    row: int


def kernel_strides(shape, stride) -> Strides:
    """``stride``'s batch, head and row strides, 0 for a dim of size one (never stepped)."""
    return Strides(*(st if n > 1 else 0 for n, st in zip(shape[:3], stride[:3])))


def stride_unit(strides) -> int:
    """The largest power of two up to 16 that divides every stride. The kernels take the strides divided
    by it and multiply them back: the compiler then knows each row's alignment, and loads 16 bytes at
    a time. Without it, a stride Triton did not see as a multiple of 16 (40 for D = 40) makes every
    load a 2-byte one (sm_90 PTX: ld.global.b16 only)."""
    g = math.gcd(*strides)
    return min(16, g & -g) if g else 16


def divided(strides, unit):
    return tuple(st // unit for st in strides)


class Extent(NamedTuple):
    """What one program of a kernel addresses of a tensor, from its sequence's start: batches, pages, splits
    and packed sequences' starts are stepped in int64 always."""

    heads: int
    rows: int  # one sequence's (a paged cache's: one page's)
    strides: Strides


TILE_OVERRUN = 256  # an index runs up to a tile past its dim's end: masked, but its address is formed


def needs_offsets_64(d: int, *extents: Extent) -> bool:
    """Whether an offset the kernels form in int32 may reach 2^31 elements in a tensor of head dim ``d``, so
    that they must form it in int64 (their ``OFFSETS_64``)."""
    return any((e.heads + TILE_OVERRUN) * e.strides.head + (e.rows + TILE_OVERRUN) * e.strides.row + d
               + TILE_OVERRUN >= 2**31 for e in extents)


class Sequences(NamedTuple):
    """Where a call's sequences lie in the [B, H, S, D] views the kernels take: a dense batch, packed
    (``attention_varlen``: one [1, H, T, D] view, rows from ``cu_seqlens``) or keys in a paged cache
    (``paged_attention``: k, v views [pages, Hkv, page_size, D], rows through ``block_table``)."""
    kind: str  # "dense", "varlen" or "paged"
    batch: int  # sequences: the grid's batch
    sq: int  # query rows (the longest sequence's)
    skv: int  # keys (the longest sequence's)
    page: int = 0  # page size, paged only
    table_stride: int = 0
    tokens: int = 0  # query rows of every sequence together, varlen only

    def lse_strides(self, h: int) -> tuple:
        """lse's (batch, head) strides: [B, H, Sq], or varlen's [H, T] (rows offset by each start)."""
        return (0, self.tokens) if self.kind == "varlen" else (h * self.sq, self.sq)


def dense_sequences(q, k) -> Sequences:
    """A dense batch's :class:`Sequences`. Its calls pass None instead: their plan key holds the shapes
    already, and one built per call would cost every eager call host time."""
    return Sequences("dense", q.shape[0], q.shape[2], k.shape[2])


class Band(NamedTuple):
    """The keys a row sees, as the kernels take them: from ``left`` before to ``right`` after its position,
    each side bounded only where its flag says so."""

    bound_left: bool
    bound_right: bool
    left: int
    right: int


def band(causal, window, seqs) -> Band:
    """The mask of ``causal`` and ``window``; causal is a right bound of 0. A side wider than every sequence
    is cut to that width (the same mask): the kernels add it to positions in int32."""
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    widest = seqs.sq + seqs.skv
    return Band(left is not None, right is not None, min(left or 0, widest), min(right or 0, widest))


SOFTCAP_NONE_ABOVE = 1e30  # identity on every score a float32 softmax tells apart; cap * log2(e) must stay finite
FLOAT32_MAX = 3.4e38


def effective_softcap(softcap):
    return None if softcap is None or softcap > SOFTCAP_NONE_ABOVE else softcap


def softcap_floats(scale, softcap) -> tuple:
    """The softcap's per-call floats: (scale / cap, cap * log2(e)); unused zeros without one. A tiny cap's
    scale / cap is held to float32's range: every nonzero score saturates either way, and a zero one
    stays 0 (not 0 * inf)."""
    if softcap is None:
        return 0.0, 0.0
    return max(-FLOAT32_MAX, min(scale / softcap, FLOAT32_MAX)), softcap * LOG2E.value


def aligned(*tensors) -> bool:
    """Whether every base is 16-byte aligned: what TMA (the Hopper kernels) needs and a stride check
    can't see, so a plan's key holds it."""
    return not any(t.data_ptr() % 16 for t in tensors)


class FwdPlan:
    __slots__ = ("key", "out_stride", "hopper", "splits", "args", "keys_per_split", "fwd", "combine")


def fwd_plan(key, q, k, v, causal, scale, window, softcap, sinks, precision, out_stride, seqs, extras):
    seqs = seqs or dense_sequences(q, k)
    h, d, value_dim = q.shape[1], q.shape[3], v.shape[3]
    hkv, b, sq, skv = k.shape[1], seqs.batch, seqs.sq, seqs.skv
    d0, d1 = head_split(d)
    dv0, dv1 = head_split(value_dim)
    plan = FwdPlan()
    plan.key, plan.out_stride = key, out_stride
    # the Gluon kernel on sm_90 where it takes the call (attention_sm90.supports says when)
    plan.hopper = None
    if (not INTERPRETED and seqs.kind == "dense"
            and not attention_sm90.supports(q, k, v, causal, out_stride, window, softcap, sinks)):
        plan.hopper = attention_sm90.Plan(q, k, v, out_stride, causal, scale)
        return remember(fwd_plans, plan)
    bound_left, bound_right, left, right = band(causal, window, seqs)
    group = h // max(hkv, 1)  # no heads at all: no programs either

    def packed(block_m) -> tuple:
        """(pack, heads, rows): decode under GQA, the group's heads share one program where their rows
        fit its tile; the grid has ``heads`` programs a sequence, of ``rows`` rows each."""
        pack = seqs.kind != "varlen" and group > 1 and group * sq <= block_m
        return (pack, hkv, group * sq) if pack else (pack, h, sq)

    def configure(config):
        pack, heads, rows = packed(config.BLOCK_M)
        # keys are not split where the grid's third dim folds pairs (a batch that fills the GPU anyway)
        splits = 1 if seqs.kind == "varlen" or b * heads > MAX_GRID_Y else key_splits(
            b, heads, rows, skv, config.BLOCK_M, config.BLOCK_N, q.device)
        plan.keys_per_split = max(triton.cdiv(triton.cdiv(skv, splits), config.BLOCK_N), 1) * config.BLOCK_N
        plan.splits = max(triton.cdiv(skv, plan.keys_per_split), 1)  # no keys: one range, seeing none
        if plan.splits == 1:  # out, through its own strides
            split_stride, out_st, slse = 0, kernel_strides(q.shape, out_stride), (0, *seqs.lse_strides(h))
        else:  # contiguous float32 partials [splits, B, H, SQ, D] and [splits, B, H, SQ]
            split_stride = b * h * sq * value_dim
            out_st = kernel_strides(q.shape, (h * sq * value_dim, sq * value_dim, value_dim))
            slse = (b * h * sq, h * sq, sq)
        q_st, k_st, v_st = (kernel_strides(t.shape, t.stride()) for t in (q, k, v))
        strides = (*q_st, *k_st, *v_st, split_stride, *out_st)
        unit = stride_unit(strides)
        kv_rows = k.shape[2] if seqs.kind == "paged" else skv
        offsets_64 = needs_offsets_64(max(d, value_dim), Extent(h, sq, q_st), Extent(hkv, kv_rows, k_st),
                                      Extent(hkv, kv_rows, v_st), Extent(h, sq, out_st))
        plan.args = (*divided(strides, unit), *slse, seqs.table_stride, h, group, sq, skv, left, right, b * heads)
        plan.fwd = over_pairs(fwd_kernel, triton.cdiv(rows, config.BLOCK_M), b * heads, 10, plan.splits,
                              BOUND_LEFT=bound_left, BOUND_RIGHT=bound_right, SOFTCAP=softcap is not None,
                              VARLEN=seqs.kind == "varlen", PAGED=seqs.kind == "paged", PAGE=seqs.page, D=d,
                              D0=d0, D1=d1, VD=value_dim, VD0=dv0, VD1=dv1, UPCAST=upcast(q.dtype), PACK_GROUP=pack,
                              NEGATIVE_SCALE=scale < 0, UNIT=unit, OFFSETS_64=offsets_64, PRECISION=precision,
                              SINKS=sinks is not None and plan.splits == 1, **config._asdict())
        plan.combine = Launch(combine_kernel, (b * h * sq,), 5, D=value_dim,
                              BLOCK_D=triton.next_power_of_2(value_dim), BLOCK_S=triton.next_power_of_2(plan.splits),
                              SINKS=sinks is not None, num_warps=4)
        return plan

    decode_programs = b * packed(DECODE_CONFIG.BLOCK_M)[1]  # every decode tile's BLOCK_M
    config = tile_config("fwd", q, sq, skv, hkv, bound_right, precision,
                         lambda c: run_forward(configure(c), q, k, v, scale, softcap, extras, sinks), decode_programs,
                         value_dim)
    return remember(fwd_plans, configure(config))


def plan_of_forward(q, k, v, causal, scale, window, softcap, sinks, out_stride, seqs, extras) -> tuple:
    """(plan, scale, softcap): the plan of row-major q, k, v's layout, and the floats its launches take."""
    scale = float(scale)  # a plan's launches take floats: an int would be specialised on its value
    softcap = effective_softcap(softcap)
    precision = dot_precision(q.dtype)
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), out_stride, q.dtype, k.dtype, v.dtype,
           q.device, causal, window, softcap is None, sinks is None, scale < 0, precision, seqs, aligned(q, k, v))
    plan = fwd_plans.get(key)
    if plan is None:
        plan = fwd_plan(key, q, k, v, causal, scale, window, softcap, sinks, precision, out_stride, seqs, extras)
    return plan, scale, softcap


def run_forward(plan, q, k, v, scale, softcap, extras, sinks=None):
    """``sinks``: None, or the ``[H]`` float32 logits the plan was made for."""
    b, h, sq = q.shape[:3]
    value_dim = v.shape[3]
    try:
        out = torch.empty_strided((b, h, sq, value_dim), plan.out_stride, dtype=q.dtype, device=q.device)
        if plan.hopper is not None:
            return attention_sm90.forward(plan.hopper, q, k, v, out, scale)
        floats = (scale * LOG2E.value, *softcap_floats(scale, softcap))
        sink = q if sinks is None else sinks  # q stands in for a pointer the kernels do not read
        if plan.splits == 1:
            lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
            plan.fwd(q, k, v, out, lse, *extras, sink, *plan.args, *floats, plan.keys_per_split)
            return out, lse
        # Split partial results stay in float32 until they are merged.
        parts = torch.empty((plan.splits, b, h, sq, value_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((plan.splits, b, h, sq), dtype=torch.float32, device=q.device)
        plan.fwd(q, k, v, parts, part_lse, *extras, sink, *plan.args, *floats, plan.keys_per_split)
        lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
        plan.combine(parts, part_lse, out, lse, sink, plan.splits, h, sq, *plan.out_stride[:3])
        return out, lse
    except BaseException:
        forget(fwd_plans, plan)
        raise


class BwdPlan:
    __slots__ = ("key", "dq_stride", "dk_stride", "dv_stride", "delta", "delta_args", "hopper", "dkdv", "dkdv_args",
                 "dq", "dq_args")


def bwd_plan(key, q, k, v, out, lse, dout, causal, scale, window, softcap, sinks, dlse, precision, out_strides, seqs,
             extras):
    seqs = seqs or dense_sequences(q, k)
    h, d, value_dim = q.shape[1], q.shape[3], v.shape[3]
    hkv, b, sq, skv = k.shape[1], seqs.batch, seqs.sq, seqs.skv
    d0, d1 = head_split(d)
    dv0, dv1 = head_split(value_dim)
    plan = BwdPlan()
    plan.key = key
    plan.dq_stride, plan.dk_stride, plan.dv_stride = out_strides
    plan.hopper = None
    # the Hopper backward's grid has batch x KV heads programs in its second dim, not folded
    if (not INTERPRETED and seqs.kind == "dense" and b * hkv <= MAX_GRID_Y
            and not attention_sm90.supports_backward(q, k, v, dout, causal, out_strides, window, softcap, sinks,
                                                     dlse)):
        plan.hopper = attention_sm90.BwdPlan(q, k, v, dout, plan.dk_stride, plan.dv_stride, causal)
    block = 64 if value_dim <= 128 else 32
    # delta over the [B, H, S] rows of the views (varlen: [1, H, T], the layout of its lse)
    rows = q.shape[2]
    delta_64 = needs_offsets_64(value_dim, *(Extent(h, rows, kernel_strides(q.shape, t.stride()))
                                             for t in (out, dout)))
    plan.delta = over_pairs(delta_kernel, triton.cdiv(rows, block), q.shape[0] * h, 5, D=value_dim,
                            BLOCK_D=triton.next_power_of_2(value_dim), BLOCK=block, ZERO_DQ=plan.hopper is not None,
                            OFFSETS_64=delta_64, LSE_GRADIENT=dlse is not None)
    plan.delta_args = (*out.stride()[:3], *dout.stride()[:3], h, q.shape[2], q.shape[0] * h)
    if plan.hopper is not None:
        return remember(bwd_plans, plan)
    bound_left, bound_right, left, right = band(causal, window, seqs)
    query_like = [kernel_strides(q.shape, st) for st in (q.stride(), dout.stride(), plan.dq_stride)]
    key_like = [kernel_strides(k.shape, st) for st in (k.stride(), v.stride(), plan.dk_stride, plan.dv_stride)]
    inputs = (*query_like[0], *key_like[0], *key_like[1], *query_like[1])
    dkdv_strides = (*inputs, *key_like[2], *key_like[3])
    dq_strides = (*inputs, *query_like[2])
    dkdv_unit, dq_unit = stride_unit(dkdv_strides), stride_unit(dq_strides)
    offsets_64 = needs_offsets_64(max(d, value_dim), *(Extent(h, sq, st) for st in query_like),
                                  *(Extent(hkv, skv, st) for st in key_like))
    common = dict(BOUND_LEFT=bound_left, BOUND_RIGHT=bound_right, SOFTCAP=softcap is not None,
                  VARLEN=seqs.kind == "varlen", D=d, D0=d0, D1=d1, VD=value_dim, VD0=dv0, VD1=dv1,
                  UPCAST=upcast(q.dtype), OFFSETS_64=offsets_64,
                  PRECISION=precision)
    group = h // max(hkv, 1)
    tail = (group, sq, skv, left, right)

    def configure_dkdv(config):
        plan.dkdv = over_pairs(dkdv_kernel, triton.cdiv(skv, config.BLOCK_N), b * hkv, 10, **common, UNIT=dkdv_unit,
                               **config._asdict())
        plan.dkdv_args = (*divided(dkdv_strides, dkdv_unit), *seqs.lse_strides(h), hkv, *tail, b * hkv)
        return plan

    def configure_dq(config):
        plan.dq = over_pairs(dq_kernel, triton.cdiv(sq, config.BLOCK_M), b * h, 9, **common, UNIT=dq_unit,
                             **config._asdict())
        plan.dq_args = (*divided(dq_strides, dq_unit), *seqs.lse_strides(h), h, *tail, b * h)
        return plan

    # each candidate is timed on its own kernel, over real buffers, which it overwrites: nothing is left to undo
    delta, dq, dk, dv = bwd_buffers(plan, q, k, v)
    plan.delta(out, dout, delta if dlse is None else dlse, delta, delta, *plan.delta_args)
    floats = (scale, scale * LOG2E.value, *softcap_floats(scale, softcap))
    configure_dkdv(tile_config("dkdv", q, sq, skv, hkv, bound_right, precision,
                               lambda c: configure_dkdv(c).dkdv(q, k, v, dout, lse, delta, dk, dv, *extras,
                                                                *plan.dkdv_args, *floats), dv=value_dim))
    configure_dq(tile_config("dq", q, sq, skv, hkv, bound_right, precision,
                             lambda c: configure_dq(c).dq(q, k, v, dout, lse, delta, dq, *extras, *plan.dq_args,
                                                          *floats), dv=value_dim))
    return remember(bwd_plans, plan)


def plan_of_backward(q, k, v, out, lse, dout, causal, scale, window, softcap, sinks, dlse, strides, seqs,
                     extras) -> tuple:
    """(plan, scale, softcap): the plan of row-major q, k, v, out, dout and contiguous lse (and dlse) whose
    gradients take ``strides``, and the floats its launches take."""
    scale = float(scale)
    softcap = effective_softcap(softcap)
    precision = dot_precision(q.dtype)
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), out.stride(), dout.stride(), strides,
           q.dtype, k.dtype, v.dtype, out.dtype, dout.dtype, lse.dtype, q.device, causal, window, softcap is None,
           sinks is None, dlse is None, precision, torch.are_deterministic_algorithms_enabled(), seqs,
           aligned(q, k, v, dout))
    plan = bwd_plans.get(key)
    if plan is None:
        plan = bwd_plan(key, q, k, v, out, lse, dout, causal, scale, window, softcap, sinks, dlse, precision,
                        strides, seqs, extras)
    return plan, scale, softcap


def run_backward(plan, scale, softcap, q, k, v, out, lse, dout, extras, sinks=None, dlse=None):
    """``(dq, dk, dv)``, and ``dsinks`` after them with ``sinks``: the probabilities come from the sunk lse as
    they are, and the sinks' gradient from lse and delta, row by row. ``dlse``: None, or the contiguous
    gradient that reached lse, which delta takes in."""
    dq, dk, dv, delta = _gradients(plan, scale, softcap, q, k, v, out, lse, dout, extras, dlse)
    return (dq, dk, dv) if sinks is None else (dq, dk, dv, sink_gradient(sinks, lse, delta))


def _gradients(plan, scale, softcap, q, k, v, out, lse, dout, extras, dlse):
    """``(dq, dk, dv, delta)``."""
    try:
        delta, dq, dk, dv = bwd_buffers(plan, q, k, v)
        dlse = delta if dlse is None else dlse  # delta stands in for a pointer the kernel does not read
        if plan.hopper is not None:
            dq_sum = torch.empty(q.shape, dtype=torch.float32, device=q.device)  # zeroed by the delta kernel
            plan.delta(out, dout, dlse, delta, dq_sum, *plan.delta_args)
            attention_sm90.backward(plan.hopper, q, k, v, dout, lse, delta, dq_sum, dk, dv, scale)
            dq.copy_(dq_sum)
            return dq, dk, dv, delta
        plan.delta(out, dout, dlse, delta, delta, *plan.delta_args)
        floats = (scale, scale * LOG2E.value, *softcap_floats(scale, softcap))
        plan.dkdv(q, k, v, dout, lse, delta, dk, dv, *extras, *plan.dkdv_args, *floats)
        plan.dq(q, k, v, dout, lse, delta, dq, *extras, *plan.dq_args, *floats)
        return dq, dk, dv, delta
    except BaseException:
        forget(bwd_plans, plan)
        raise


def bwd_buffers(plan, q, k, v):
    delta = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    dq = torch.empty_strided(q.shape, plan.dq_stride, dtype=q.dtype, device=q.device)
    dk = torch.empty_strided(k.shape, plan.dk_stride, dtype=k.dtype, device=k.device)
    dv = torch.empty_strided(v.shape, plan.dv_stride, dtype=v.dtype, device=v.device)
    return delta, dq, dk, dv
