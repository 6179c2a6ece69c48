"""The emulator's counters and instruction trace: what the kernels launched inside :func:`count_instructions`
issue, per engine, and each instruction with what it depends on through on-chip tiles, for the cost model
(``cost.py``). The instructions call :func:`record` / :func:`record_dma` as they issue.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

from . import core
from .tensors import Tensor


ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma")


class Instruction(NamedTuple):
    """One issued instruction as the cost model schedules it (``Stats.trace``)."""
    core: int  # which core of its launch issued it
    engine: str
    rule: str  # the cost rule that prices it (cost.py)
    size: int  # free elements per partition it streams (compute engines) or bytes it moves (DMA)
    detail: int  # a matmul's stationary free size; a DMA's bytes per descriptor (contiguous run); else 0
    needs: tuple  # trace indices of the instructions whose results it reads
    stationary: tuple  # of those, the writers of a matmul's stationary operand
    after: tuple  # trace indices that must end before it writes: earlier readers or writer of what it writes


@dataclass
class Stats:
    """What the kernels launched inside :func:`count_instructions` issued, for the cost model.

    ``work[(engine, cost, size)]`` counts instructions by the cost rule that prices them
    (``cost.py`` knows the rules) and their size: free elements per partition for compute
    engines, bytes for DMA. ``elements`` sums, per engine, the free elements per partition read
    from each input tile (a two-input instruction counts both). ``trace`` is every instruction in
    program order with its data dependencies through on-chip tiles (:class:`Instruction`), and
    ``launch_starts`` where each launch begins in it, for the cost model's schedule."""

    instructions: Counter = field(default_factory=Counter)
    elements: Counter = field(default_factory=Counter)
    work: Counter = field(default_factory=Counter)
    dma_bytes_in: int = 0  # HBM -> on-chip
    dma_bytes_out: int = 0  # on-chip -> HBM
    dma_bytes_other: int = 0  # HBM -> HBM or SBUF -> SBUF
    matmul_flops: int = 0
    sbuf_peak_bytes: int = 0  # per partition
    psum_peak_banks: int = 0
    launches: int = 0
    cores: int = 0  # the most cores one launch ran on
    trace: list = field(default_factory=list)
    launch_starts: list = field(default_factory=list)
    _accesses: dict = field(default_factory=dict, repr=False)  # buffer id -> [_Access]

    @property
    def hbm_bytes(self) -> int:
        return self.dma_bytes_in + self.dma_bytes_out

    def as_dict(self) -> dict:
        return {"launches": self.launches, "cores": self.cores, "instructions": dict(self.instructions),
                "elements_per_partition": dict(self.elements), "dma_bytes_in": self.dma_bytes_in,
                "dma_bytes_out": self.dma_bytes_out, "dma_bytes_other": self.dma_bytes_other,
                "matmul_flops": self.matmul_flops, "sbuf_peak_bytes_per_partition": self.sbuf_peak_bytes,
                "psum_peak_banks": self.psum_peak_banks}

    def append(self, engine: str, rule: str, size: int, detail: int, reads, writes, stationary=None):
        """Add an instruction to the trace, with what it depends on through the on-chip tiles it reads and
        writes (views: overlapping regions of one buffer depend on each other, disjoint ones do not; a tile that
        reuses a dead tile's buffer depends on what used it: :class:`allocation._Memory`)."""
        queue, index = (core.launch.core, engine), len(self.trace)
        read = [(tile is stationary, self._overlapping(*_region(tile))) for tile in reads]
        written = [(place, self._overlapping(*place)) for place in map(_region, writes)]
        needs, lead, after = set(), set(), set()
        for is_stationary, accesses in read:
            (lead if is_stationary else needs).update(a.writer for a in accesses if a.writer is not None)
        for _, accesses in written:
            for access in accesses:
                after.update(access.readers.values())
                if access.writer is not None:
                    after.add(access.writer)
        self.trace.append(Instruction(core.launch.core, engine, rule, int(size), int(detail), tuple(needs - lead),
                                      tuple(lead), tuple(after)))
        for _, accesses in read:
            for access in accesses:
                access.readers[queue] = index
        for (buffer, region), _ in written:
            kept = [a for a in self._accesses.get(buffer, ()) if not _covers(region, a.region)]
            kept.append(_Access(region, index))
            self._accesses[buffer] = kept if len(kept) <= _ACCESSES_KEPT else [_merged(kept)]

    def _overlapping(self, buffer, region) -> list:
        return [a for a in self._accesses.get(buffer, ()) if _overlap(region, a.region)]


@dataclass
class _Access:
    """A region of a buffer, (first partition, end, first free offset, end), its last writer's trace index and,
    per queue (core, engine), its last reader's since."""
    region: tuple
    writer: int | None
    readers: dict = field(default_factory=dict)


_ACCESSES_KEPT = 32  # regions tracked per buffer; past that they merge into one (dependencies only added)


def _region(tile: "Tensor"):
    """The buffer ``tile`` views and the region it covers: partitions, and free offsets within a partition."""
    root, data = tile.root, tile.data
    first_partition, first = divmod(data.storage_offset() - root.data.storage_offset(), root.data.stride(0))
    shape, stride = data.shape, data.stride()
    last = first
    for axis in range(1, len(shape)):
        last += (shape[axis] - 1) * stride[axis]
    return root.buffer_id, (first_partition, first_partition + shape[0], first, last + 1)


def _overlap(a: tuple, b: tuple) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[2] < b[3] and b[2] < a[3]


def _covers(a: tuple, b: tuple) -> bool:
    return a[0] <= b[0] and b[1] <= a[1] and a[2] <= b[2] and b[3] <= a[3]


def _merged(accesses: list) -> _Access:
    region = tuple(f(a.region[i] for a in accesses) for i, f in enumerate((min, max, min, max)))
    readers = {}
    for a in accesses:
        for queue, index in a.readers.items():
            readers[queue] = max(index, readers.get(queue, index))
    return _Access(region, max((a.writer for a in accesses if a.writer is not None), default=None), readers)


collecting: list[Stats] = []  # the Stats of the count_instructions blocks open now


@contextlib.contextmanager
def count_instructions():
    """Collect the instructions of every kernel launched inside the block into one Stats."""
    stats = Stats()
    collecting.append(stats)
    try:
        yield stats
    finally:
        collecting.remove(stats)


def _on_chip(tiles) -> tuple:
    return tuple(t for t in tiles if isinstance(t, Tensor) and t.buffer.on_chip)


def record(engine: str, cost: str, size: int, inputs: int = 1, flops: int = 0, reads=(), writes=(),
           stationary=None):
    """One instruction on ``engine``, priced by rule ``cost`` at ``size`` free elements per partition, reading
    and writing the tiles given (a matmul names its ``stationary`` operand among the reads)."""
    core.launch.issue()
    detail = stationary.free_size if stationary is not None else 0
    for stats in collecting:
        stats.instructions[engine] += 1
        stats.elements[engine] += int(size) * inputs
        stats.work[(engine, cost, int(size))] += 1
        stats.matmul_flops += flops
        stats.append(engine, cost, size, detail, _on_chip(reads), _on_chip(writes), stationary)


def record_dma(nbytes: int, src: "Tensor", dst: "Tensor", descriptor_bytes: int, transpose: bool = False,
               index: "Tensor | None" = None):
    """A DMA of ``nbytes`` from ``src`` to ``dst`` in descriptors of ``descriptor_bytes`` contiguous bytes (a gather
    or scatter also reads its ``index`` tile)."""
    direction = "in" if dst.buffer.on_chip and not src.buffer.on_chip else \
        "out" if src.buffer.on_chip and not dst.buffer.on_chip else "other"
    rule = "copy" if not transpose else "transpose_on_chip" if src.buffer.on_chip else "transpose_from_hbm"
    core.launch.issue()
    for stats in collecting:
        stats.instructions["dma"] += 1
        stats.elements["dma"] += int(nbytes)
        stats.work[("dma", direction, int(nbytes))] += 1
        setattr(stats, f"dma_bytes_{direction}", getattr(stats, f"dma_bytes_{direction}") + int(nbytes))
        stats.append("dma", rule, nbytes, descriptor_bytes, _on_chip([src, index]), _on_chip([dst]))


def record_launch(cores: int = 1):
    for stats in collecting:
        stats.launches += 1
        stats.cores = max(stats.cores, cores)
        stats.launch_starts.append(len(stats.trace))
