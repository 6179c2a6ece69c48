"""The Gluon attention kernels for Hopper (sm_90): which calls they take, their launch shapes, and their
plans' launches. The forward (attention_sm90_fwd_kernels) and the backward (attention_sm90_bwd_kernels)
address every tensor through a rank-4 TMA descriptor over its own ``[B, H, S, D]`` strides, so q/k/v
transposed out of ``[B, S, H, D]`` need no copy, and tiles past a sequence's end read zeros and are never
written (TMA clips them), never another head's rows. Grouped-query attention reads KV head ``h // group``.
Every call they don't take (:func:`supports` says why) keeps the tl.* kernels: other head dims, float32,
decode, rows that see no key (causal with ``Sq > Skv``), strides TMA can't address.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
from typing import NamedTuple

import torch
import triton

from .attention_tiles import LOG2E
from .launch import TRITON_RELEASE, Launch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # a Triton without Gluon: the tl.* kernels take every call
    gluon = None
if gluon is not None:
    from .attention_sm90_bwd_kernels import bwd_kernel
    from .attention_sm90_fwd_kernels import fwd_kernel

HEAD_DIMS = (64, 128, 256)  # the forward's
BWD_HEAD_DIMS = (64, 128)  # dK and dV of 64 keys at D 256 would take 256 float32 registers a thread
WARPGROUP_ROWS = 64  # query rows a consumer warpgroup of the forward takes


class FwdConfig(NamedTuple):
    """The forward's launch shape for one (head dim, causal)."""

    block_n: int  # keys a K/V tile
    stages: int  # K/V ring slots
    o_through_q: bool  # O leaves through its Q tile's shared memory, where there is no room for a tile of its own
    consumers: int  # consumer warpgroups, WARPGROUP_ROWS query rows each


CONFIGS = {
    (64, False): FwdConfig(128, 4, False, 3),  # three consumers: a K/V tile feeds 192 rows (FlashAttention-3's)
    (64, True): FwdConfig(128, 4, False, 2),  # two: a 192-row tile's first warpgroup streams every key its last sees
    (128, False): FwdConfig(128, 3, True, 2),
    (128, True): FwdConfig(128, 3, True, 2),
    (256, False): FwdConfig(64, 2, True, 2),  # the one shape that fits: O alone is 128 registers a consumer thread
    (256, True): FwdConfig(64, 2, True, 2),
}


class BwdConfig(NamedTuple):
    """The backward's launch shape for one (head dim, causal); a program takes 2 x BWD_BLOCK_N keys."""

    block_m: int  # query rows a Q/dO tile
    stages: int  # Q/dO ring slots
    dq_buffers: int  # dQ buffers a warpgroup writes in turn
    split_mask: bool  # only the tiles that need a mask are masked (else all are)


BWD_CONFIGS = {
    (64, False): BwdConfig(128, 2, 1, False),  # 128-row tiles (FlashAttention-3's): small MMAs' overheads weigh less
    (64, True): BwdConfig(128, 2, 1, True),  # masking only the diagonal's tiles was faster here
    (128, False): BwdConfig(64, 2, 1, False),  # S^T and dP^T of 128 rows would not fit the registers beside dK, dV
    (128, True): BwdConfig(64, 2, 2, False),  # a second copy of the tile's code for the mask spills here
}
BWD_BLOCK_N = 64
# The most keys x head dim a row reads where the forward runs on a persistent grid (programs)
PERSISTENT_MAX_WORK = 8192 * 128
MAXNREG = 168  # registers a thread across the backward's warpgroups: the loader keeps 24, each consumer gets 240
FWD_MAXNREG = {2: MAXNREG, 3: 128}  # the forward's, by consumers: three make four warpgroups, 160 registers a consumer
# Gluon is experimental and its API moves between releases: the kernel was written against these two.
GLUON_READ_IN = ((3, 6), (3, 9))


def supports(q, k, v, causal, out_stride, window=None, softcap=None, sinks=None) -> list[str]:
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
    if sinks is not None:
        reasons.append("sinks: the Hopper kernels have no sink term in their softmax yet (the tl.* kernels have)")
    if v.shape[-1] != q.shape[-1]:
        reasons.append(f"v's head_dim {v.shape[-1]} is not q's {q.shape[-1]}: the Hopper kernels take one head dim "
                       f"(the tl.* kernels take both)")
    if not (q.is_cuda and is_sm90(device_index(q.device))):
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


def config(d: int, causal: bool) -> FwdConfig:
    """``CONFIGS[d, causal]`` for the Triton this runs on: three consumers were timed with Triton 3.6;
    compiled by 3.9 they spill inside the main loop, untimed, so 3.9 keeps two."""
    chosen = CONFIGS[d, causal]
    return chosen if TRITON_RELEASE == (3, 6) else chosen._replace(consumers=2)


def programs(q, k, causal) -> int:
    """The forward's grid: persistent (one program per SM, which its shared memory fills, each taking
    the next work tile as it frees up) where rows are short enough that a tile's set-up and the ring's
    refill show (up to PERSISTENT_MAX_WORK, where it was faster), one program per tile past that (where
    it was slower)."""
    tiles = triton.cdiv(q.shape[2], WARPGROUP_ROWS * config(q.shape[3], causal).consumers) * q.shape[0] * q.shape[1]
    if k.shape[2] * q.shape[3] > PERSISTENT_MAX_WORK:
        return tiles
    return min(tiles, _multiprocessors(q.device))


def device_index(device) -> int:
    """A CUDA device's index, the current device's where it names none (``torch.device("cuda")``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def _multiprocessors(device) -> int:
    return _device_multiprocessors(device_index(device))


@functools.lru_cache(maxsize=None)
def _device_multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def is_sm90(index: int) -> bool:
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
        shape = config(d, causal)
        descriptors = (_template(q, q.stride(), WARPGROUP_ROWS), _template(k, k.stride(), shape.block_n),
                       _template(v, v.stride(), shape.block_n), _template(q, out_stride, WARPGROUP_ROWS))
        self.launch = Launch(fwd_kernel, (programs(q, k, causal),), 0, descriptors, CAUSAL=causal,
                             NEGATIVE_SCALE=scale < 0, STAGES=shape.stages, O_THROUGH_Q=shape.o_through_q,
                             CONSUMERS=shape.consumers, num_warps=4, maxnreg=FWD_MAXNREG[shape.consumers])
        self.args = (b * h, h, h // k.shape[1], sq, k.shape[2])


def forward(plan, q, k, v, out, scale):
    """(out, lse) for a call :func:`supports` took and ``plan`` was built for; ``out`` is written
    through its strides."""
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    plan.launch(q, k, v, out, lse, _tile_counter(q.device), *plan.args, scale * LOG2E.value)
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
    index = device_index(device)
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
        shape = BWD_CONFIGS[d, causal]
        dq_sum = torch.empty(q.shape, dtype=torch.float32, device="meta")
        descriptors = tuple(_template(t, stride, rows) for t, stride, rows in
                            ((q, q.stride(), shape.block_m), (k, k.stride(), BWD_BLOCK_N),
                             (v, v.stride(), BWD_BLOCK_N), (dout, dout.stride(), shape.block_m),
                             (k, dk_stride, BWD_BLOCK_N), (v, dv_stride, BWD_BLOCK_N)))
        descriptors += (_template(dq_sum, dq_sum.stride(), shape.block_m, d // 2),)
        blocks = triton.cdiv(skv, 2 * BWD_BLOCK_N)
        self.launch = Launch(bwd_kernel, (blocks, b * hkv), 2, descriptors, CAUSAL=causal,
                             STAGES=shape.stages, DQ_BUFFERS=shape.dq_buffers, SPLIT_MASK=shape.split_mask,
                             num_warps=4, maxnreg=MAXNREG)
        self.args = (h, h // hkv, sq, skv, band(blocks, b * hkv, causal, _multiprocessors(q.device)))


def band(blocks: int, pairs: int, causal: bool, multiprocessors: int) -> int:
    """How many (batch, KV head) pairs the backward's programs start together (``bwd_kernel``): one
    without a mask (every program has the same work). Under a causal mask, the divisor of ``pairs``
    whose programs come nearest to filling the GPU once, the fastest timed (no band is cut short: a short
    last band's heavy programs start last), within half to twice that; where none is, one (a band of all
    pairs loses L2's sharing of the heads that run together)."""
    if not causal:
        return 1
    wave = multiprocessors / blocks  # pairs whose programs fill the GPU once
    fits = [c for c in range(1, pairs + 1)
            if pairs % c == 0 and c <= 2 * wave and (c >= wave / 2 or c == pairs)]
    return min(fits, key=lambda c: abs(math.log(c / wave)), default=1)


def backward(plan, q, k, v, dout, lse, delta, dq_sum, dk, dv, scale):
    """For a call :func:`supports_backward` took: dk and dv written through their strides, and dQ added
    into ``dq_sum`` (float32 [B, H, Sq, D], contiguous, zeros before), for the caller to cast."""
    plan.launch(q, k, v, dout, dk, dv, dq_sum, lse, delta, *plan.args, scale * LOG2E.value, scale)


def supports_backward(q, k, v, dout, causal, strides, window=None, softcap=None, sinks=None, dlse=None):
    """Why the Hopper backward can't take this call (empty: it can); ``strides``: dq's, dk's, dv's."""
    reasons = supports(q, k, v, causal, strides[0], window, softcap, sinks)
    if dlse is not None:
        reasons.append("a gradient through lse: not verified on the Hopper backward yet (the tl.* one takes it)")
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
