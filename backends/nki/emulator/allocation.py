"""On-chip allocation in the emulator: new tensors (``nl.ndarray``) with the rules on their shape, dtype and
buffer, kernel arguments as HBM tensors, and the live SBUF/PSUM tiles, held to the target's capacity and, while
instructions are counted, given buffers whose reuse the trace's dependencies follow.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import weakref

import torch

from . import core
from .core import (DTYPES, Buffer, as_dtype, bfloat16, counting_only, device, float16, float32, from_torch, int32,
                   psum, reject, sbuf, shared_hbm, target)
from .tensors import Tensor
from .trace import collecting


class _Memory:
    """Live on-chip allocations. A tile is live while the kernel holds a reference to it (Python
    frees it when its last variable is rebound or goes out of scope, a stand-in for the compiler's
    liveness analysis) and, if it was declared inside an ``nl.*_range`` iteration, until that
    iteration ends.

    While instructions are counted, each tile also gets a buffer for the cost model's dependencies: a dead
    tile's buffer is kept until SBUF (or PSUM) needs its space, then the oldest is reused, so a tile declared
    inside a loop gets as many copies as fit, as a compiler multi-buffering it may give (AWS's NKI migration
    guide, nki/migration/index.rst: "the compiler could choose to allocate 2 physical tiles")."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.tiles, self.scopes = weakref.WeakSet(), []
        self.held = {}  # buffer id -> (size, memory, ref) of a live tile's buffer
        self.kept = {sbuf: collections.deque(), psum: collections.deque()}  # dead tiles' (buffer id, size)
        self.used = {sbuf: 0, psum: 0}  # size held and kept

    def assign_buffer(self, tile: "Tensor", size: int, capacity: int):
        """Give ``tile`` (``size`` of ``capacity``) a new buffer, or the space of the oldest dead ones kept."""
        kept, reused = self.kept[tile.buffer], None
        while kept and self.used[tile.buffer] + size > capacity:
            reused, freed = kept.popleft()
            self.used[tile.buffer] -= freed
        tile.buffer_id = next(_buffer_ids) if reused is None else reused
        self.held[tile.buffer_id] = (size, tile.buffer, weakref.ref(tile, lambda _, b=tile.buffer_id: self.release(b)))
        self.used[tile.buffer] += size

    def release(self, buffer_id):
        """The tile in ``buffer_id`` is dead: keep its buffer for now."""
        entry = self.held.pop(buffer_id, None)
        if entry is not None:
            self.kept[entry[1]].append((buffer_id, entry[0]))

    def live(self, buffer):
        return [t for t in self.tiles if t.buffer is buffer]

    def allocate(self, tile: "Tensor"):
        tgt = target()
        if tile.buffer is sbuf:
            used = sum(t.partition_bytes for t in self.live(sbuf)) + tile.partition_bytes
            if used > tgt.sbuf_partition_bytes:
                reject("sbuf-capacity", f"SBUF tile {tile.shape} {tile.dtype} needs {tile.partition_bytes} bytes per "
                       f"partition; with the live tiles that is {used} > {tgt.sbuf_partition_bytes} bytes per "
                       f"partition on {tgt.name} (SBUF is 128 partitions x {tgt.sbuf_partition_bytes // 1024} KiB)")
            for stats in collecting:
                stats.sbuf_peak_bytes = max(stats.sbuf_peak_bytes, used)
            if collecting:
                self.assign_buffer(tile, tile.partition_bytes, tgt.sbuf_partition_bytes)
        elif tile.buffer is psum:
            if tile.partition_bytes > tgt.psum_bank_bytes:
                reject("psum-bank", f"PSUM tile {tile.shape} {tile.dtype} needs {tile.partition_bytes} bytes per "
                       f"partition; a PSUM tile must fit one {tgt.psum_bank_bytes}-byte bank "
                       f"(nl.tile_size.psum_bank_fmax = {tgt.psum_bank_bytes // 4} fp32)")
            banks = len(self.live(psum)) + 1
            if banks > tgt.psum_num_banks:
                reject("psum-capacity", f"{banks} live PSUM tiles, each holding a bank; PSUM has "
                       f"{tgt.psum_num_banks} banks of {tgt.psum_bank_bytes} bytes per partition "
                       f"({tgt.psum_partition_bytes} bytes)")
            for stats in collecting:
                stats.psum_peak_banks = max(stats.psum_peak_banks, banks)
            if collecting:
                self.assign_buffer(tile, 1, tgt.psum_num_banks)
        self.tiles.add(tile)
        if self.scopes:
            self.scopes[-1].append(weakref.ref(tile))

    @contextlib.contextmanager
    def scope(self):
        self.scopes.append([])
        try:
            yield
        finally:
            for ref in self.scopes.pop():
                if ref() is not None:
                    self.tiles.discard(ref())
                    self.release(ref().buffer_id)


_buffer_ids = itertools.count()


memory = _Memory()


def allocate(shape, dtype, buffer) -> Tensor:
    shape = tuple(int(n) for n in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    dtype = as_dtype(dtype)
    if dtype not in DTYPES:
        reject("dtype-unsupported", f"{dtype} is not a NeuronCore data type")
    if not isinstance(buffer, Buffer):
        reject("buffer", f"buffer must be nl.sbuf, nl.psum, nl.hbm, nl.private_hbm or nl.shared_hbm, not {buffer!r}")
    if any(n <= 0 for n in shape):
        reject("tile-shape", f"tensor shape {shape} has an empty dimension")
    if buffer.on_chip:
        if len(shape) < 2:
            reject("tile-rank", f"an {buffer.name} tile needs a partition axis and at least one free axis; got {shape}")
        if shape[0] > target().pmax:
            reject("partition-dim", f"{buffer.name} tile {shape} has {shape[0]} partitions; the partition axis "
                   f"(first) is at most nl.tile_size.pmax = {target().pmax}")
        if buffer is psum and dtype not in (float32, bfloat16, float16, int32):
            reject("dtype-unsupported", f"PSUM holds fp32 accumulations (or 16-bit transpose output), not {dtype}")
    def fresh():
        # fresh memory reads as NaN (floats) / 4 (integers), like nki.simulate's sentinels, so a kernel
        # that computes on memory it never wrote shows it in its output
        return Tensor(torch.full(shape, float("nan") if dtype.is_float else 4, dtype=dtype.torch_dtype,
                                 device=device()), dtype, buffer)

    if buffer is shared_hbm and core.launch.cores > 1:
        return core.launch.shared_tensor(shape, dtype, fresh)
    tensor = fresh()
    if buffer.on_chip:
        memory.allocate(tensor)
    return tensor


def wrap_hbm(value: torch.Tensor) -> Tensor:
    """A kernel argument: a torch tensor seen as an HBM tensor (shares storage)."""
    if value.device.type != device().type:
        allowed = "meta (count-only mode)" if counting_only() else "CPU"
        reject("device", f"the emulator takes {allowed} tensors here, not {value.device.type}")
    return Tensor(value, from_torch(value.dtype), shared_hbm)
