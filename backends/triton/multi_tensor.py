"""Multi-tensor launches: one kernel over many tensors through device-side address tables.

A list of tensors is cut into chunks of ``CHUNK`` elements; program ``i`` of the launch
handles chunk ``i``, reading which tensor it belongs to and where the chunk starts from
two small device arrays, and the tensors' base addresses from one int64 table per list.
Tables are built once per set of tensors (keyed by their addresses and sizes) and cached,
so a steady-state optimizer step builds nothing on the host but a dictionary key.
"""

from __future__ import annotations

import operator
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .interpreter import INTERPRETED, to_dtype


class Launch(NamedTuple):
    chunk: int  # elements per program
    block: int  # elements per inner iteration of a program
    num_warps: int


# one block a program in the interpreter, where every masked-off iteration costs real time
INTERPRETER_LAUNCH = Launch(1024, 1024, 4)


def launch_for(table: dict, key) -> Launch:
    """The shape for ``key`` (element sizes in bytes) in a kernel's table of launch shapes (the sweep may set
    its entries), else the table's first entry."""
    if INTERPRETED:
        return INTERPRETER_LAUNCH
    return table.get(key) or next(iter(table.values()))


_CACHE_SIZE = 16
_building = threading.local()  # ``written``: what this thread's caches take while :func:`built` builds a plan


class LRU:
    """A small least-recently-used map: ``get`` refreshes a hit, ``put`` evicts the oldest entry
    past ``size`` and returns the value it stored (noted while :func:`built` builds a plan)."""

    def __init__(self, size: int = _CACHE_SIZE):
        self._items: OrderedDict = OrderedDict()
        self._size = size

    def get(self, key):
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key, value):
        self._items[key] = value
        if len(self._items) > self._size:
            self._items.popitem(last=False)
        written = getattr(_building, "written", None)
        if written is not None:
            written.append((self, key, value))
        return value

    def clear(self):
        self._items.clear()

    def forget(self, key, value):
        """``key``'s entry out, unless it holds another value by now."""
        if self._items.get(key) is value:
            del self._items[key]


def built(plans: LRU, key, build) -> tuple:
    """``(plan, written)``: ``build()``'s plan, put in ``plans`` under ``key``, and every entry that cached (the
    plan, its tables) for :func:`forget` to take out if the call's launches fail; a failed build leaves none."""
    written = _building.written = []
    try:
        return plans.put(key, build()), written
    except BaseException:
        forget(written)
        raise
    finally:
        _building.written = None


def forget(written: list) -> None:
    """Every entry in ``written`` out of its cache: a call that failed leaves nothing it cached behind."""
    for cache, key, value in written:
        cache.forget(key, value)


@dataclass(frozen=True)
class Tables:
    addresses: torch.Tensor  # int64 [lists, tensors]: base address of tensor j of list i
    chunk_tensor: torch.Tensor  # int32 [chunks]: which tensor a chunk belongs to
    chunk_start: torch.Tensor  # int64 [chunks]: the chunk's first element in its tensor
    numels: torch.Tensor  # int64 [tensors]
    chunks: int
    aligned: bool  # every base address a multiple of 16 bytes: the kernels may use vector loads


_cache = LRU()  # Tables by chunk size, device, sizes and every address


@triton.jit
def this_chunk(chunk_tensor, chunk_start, numels):
    """(tensor index, first element, tensor size) of the chunk this program handles."""
    t = tl.load(chunk_tensor + tl.program_id(0))
    return t, tl.load(chunk_start + tl.program_id(0)), tl.load(numels + t)


@triton.jit
def address(addresses, row, n_tensors, t, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """Base pointer of tensor ``t`` of list ``row``. Addresses read from memory carry no alignment:
    say so when the host checked it, or every load stays scalar."""
    pointer = tl.load(addresses + row * n_tensors + t).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        pointer = tl.multiple_of(pointer, 16)
    return pointer


@triton.jit
def block_offsets(start, block, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    offs = start + block + tl.arange(0, BLOCK)
    if ALIGNED:
        offs = tl.max_contiguous(tl.multiple_of(offs, BLOCK), BLOCK)
    return offs


@triton.jit
def load_f32(pointer, offs, mask, FULL: tl.constexpr):
    """Load as float32. A full block goes unmasked: a bounds mask against a size read from memory
    has unknown constancy, so the compiler would split every access into scalar ones."""
    if FULL:
        return tl.load(pointer + offs).to(tl.float32)
    else:
        return tl.load(pointer + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def step_inputs(lr_ptr, lr_value, grad_scale_ptr, found_inf_ptr, clip_coef_ptr, BLOCK: tl.constexpr,
                LR_IS_TENSOR: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
                HAS_CLIP: tl.constexpr):
    """An optimizer step's values read from the device: (lr, the grads' factor (unscale, clip), the stores'
    keep mask: all False where found_inf != 0, which skips the step)."""
    if LR_IS_TENSOR:
        lr = tl.load(lr_ptr).to(tl.float32)
    else:
        lr = lr_value
    grad_factor = 1.0
    if HAS_GRAD_SCALE:
        grad_factor = grad_factor / tl.load(grad_scale_ptr).to(tl.float32)
    if HAS_CLIP:
        grad_factor = grad_factor * tl.load(clip_coef_ptr).to(tl.float32)
    keep = tl.full([BLOCK], True, tl.int1)
    if HAS_FOUND_INF:
        keep = (tl.zeros([BLOCK], dtype=tl.float32) + tl.load(found_inf_ptr)) == 0
    return lr, grad_factor, keep


@triton.jit
def store_as(pointer, offs, value, mask, MASKED: tl.constexpr):
    """Store ``value`` converted to the pointer's type, rounded to nearest even (interpreter included)."""
    if MASKED:
        tl.store(pointer + offs, to_dtype(value, pointer.dtype.element_ty), mask=mask)
    else:
        tl.store(pointer + offs, to_dtype(value, pointer.dtype.element_ty))


def tables(lists: list[list[torch.Tensor]], chunk: int) -> Tables:
    """Address and chunk tables for parallel lists of same-shaped tensors (the first list sets the sizes).

    Cached by every address. Grads freed by ``zero_grad(set_to_none=True)`` come back at new
    addresses on many steps, so a miss must stay cheap: the chunk tables depend on the sizes only
    and are cached by them, and the address table goes to the device without waiting for it."""
    first = lists[0]
    device = first[0].device
    numels = tuple(map(_numel, first))
    ptrs = [tuple(map(_data_ptr, ts)) for ts in lists]
    key = (chunk, device, numels, *ptrs)
    hit = _cache.get(key)
    if hit is not None:
        return hit
    chunk_tensor, chunk_start, numels_tensor, chunks = _chunk_tables(chunk, device, numels)
    addresses = _to_device(torch.tensor(ptrs, dtype=torch.int64), device)
    aligned = all(p % 16 == 0 for row in ptrs for p in row)
    return _cache.put(key, Tables(addresses, chunk_tensor, chunk_start, numels_tensor, chunks, aligned))


_chunk_cache = LRU()  # (chunk tensor, chunk starts, sizes, chunk count) by chunk size, device and sizes


def _chunk_tables(chunk: int, device: torch.device, numels: tuple[int, ...]) -> tuple:
    key = (chunk, device, numels)
    hit = _chunk_cache.get(key)
    if hit is not None:
        return hit
    counts = torch.tensor([-(-n // chunk) for n in numels], dtype=torch.int64)
    chunk_tensor = torch.repeat_interleave(torch.arange(len(numels)), counts)
    first_chunk = torch.cumsum(counts, 0) - counts
    chunk_start = (torch.arange(len(chunk_tensor)) - first_chunk[chunk_tensor]) * chunk
    built = (_to_device(chunk_tensor.to(torch.int32), device), _to_device(chunk_start, device),
             _to_device(torch.tensor(numels, dtype=torch.int64), device), len(chunk_tensor))
    return _chunk_cache.put(key, built)


def _to_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host-built table on ``device``, without a stream synchronisation: a plain ``.to(device)``
    from pageable memory waits for the device, which would stall every step whose grads moved."""
    if device.type != "cuda":
        return table.to(device)
    if torch.cuda.is_current_stream_capturing():
        # A captured copy would replay from a host buffer that is later reused.
        raise RuntimeError("portable_ops: these tensors have no launch tables yet, and a CUDA graph is being "
                           "captured: run one step with the same tensors before capturing")
    return table.pin_memory().to(device, non_blocking=True)


class PlanCache(LRU):
    """Launch plans keyed by the device, every tensor's address, the first list's sizes and dtypes.

    A steady-state step computes one key (a C-level ``map`` over the tensors) and one dict
    lookup; everything else a launch needs was built on the first step with these tensors.
    The device is in the key because the plan's tables live on it: an address alone does not
    say which device's memory it is in.
    """

    @staticmethod
    def key(first: list[torch.Tensor], *lists: list[torch.Tensor], extra=()) -> tuple:
        ptrs = tuple(map(_data_ptr, first))
        for more in lists:
            ptrs += tuple(map(_data_ptr, more))
        device = first[0].device if first else None
        return (*extra, device, ptrs, tuple(map(_numel, first)), tuple(map(dtype_of, first)))


_data_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel
dtype_of = operator.attrgetter("dtype")


def by_dtype(*lists: list[torch.Tensor]) -> dict[tuple[torch.dtype, ...], list[int]]:
    """Positions grouped by the dtypes of the parallel lists' tensors at each position: one launch
    per group, since a kernel's pointer element types are compile-time constants."""
    groups: dict[tuple[torch.dtype, ...], list[int]] = {}
    for i, ts in enumerate(zip(*lists)):
        groups.setdefault(tuple(t.dtype for t in ts), []).append(i)
    return groups


def not_contiguous(lists: dict[str, list[torch.Tensor]]) -> list[str]:
    for name, tensors in lists.items():
        if all(map(torch.Tensor.is_contiguous, tensors)):  # C-level: asked of every tensor every step
            continue
        i = next(i for i, t in enumerate(tensors) if not t.is_contiguous())
        return [f"{name}[{i}] is not contiguous (the multi-tensor kernels address flat storage)"]
    return []
