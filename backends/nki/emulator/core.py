"""Core of the NKI emulator: tensors in HBM/SBUF/PSUM, the hardware rules, scopes and the counters.

A test double, not a simulator of timing: it executes the subset of ``nki.language`` /
``nki.isa`` that this project's kernels use, on CPU, with torch as the storage (so bfloat16
is stored as bfloat16 and every engine write rounds once, round-to-nearest-even), and it
raises :class:`EmulatorError` where the Neuron compiler or hardware would reject a kernel.
Every rule names itself in brackets at the start of the message, e.g. ``[partition-dim]``.

Modes and policies besides plain execution (each a context manager):

* **count-only** (:func:`count_only`): kernel arguments may be torch ``meta`` tensors (shape and
  dtype, no storage), every tile is allocated on ``meta`` too, so each instruction runs its
  checks and its counters while torch skips the arithmetic. That is how the cost model counts a
  354.9M-element optimizer step without 354.9M elements of memory or compute.
* **NaN-dropping max** (:func:`max_nan_semantics` ``("drop")``): the NKI docs do not say what the
  engines' ``maximum`` / ``minimum`` and max/min reductions do with NaN. By default the emulator
  propagates NaN (as numpy and torch do); under ``"drop"`` they return the other operand
  (IEEE-754 maxNum), so tests can check a kernel does not rely on the undocumented behaviour.
* **domain policy** (:func:`domain_policy`): an activation input outside its function's valid range is
  refused (default) or gives NaN; **DMA casting** (:func:`dma_casting`): the descriptor modes in which
  a DMA may convert dtypes (none by default); **instruction budget** (:func:`instruction_budget`).

Sources for the numbers (NKI 0.7 / Neuron SDK 2.33 docs; aws-neuron/aws-neuron-sdk):

* 128 partitions, 512 fp32 per PSUM bank, 8 PSUM banks, matmul free sizes 128 / 512:
  https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/nki.language.tile_size.html
* SBUF 28 MiB = 128 partitions x 224 KiB on NeuronCore-v3 (Trn2), PSUM 2 MiB (16 KiB per
  partition): nki/guides/architecture/trainium2_arch.rst
* SBUF 32 MiB (256 KiB per partition) on NeuronCore-v4 (Trn3), PSUM unchanged:
  nki/guides/architecture/trainium3_arch.rst
* Logical NeuronCores: 1 or 2 physical cores per launch on Trn2 and Trn3, each with its own SBUF and PSUM
  and the HBM shared: about-neuron/arch/neuron-features/logical-neuroncore-config.rst, nki/get-started/about/lnc.rst
* The compiler's instruction threshold, 5,000,000: its XTP002/XTP003 messages ("Number of instructions (N) is
  over the threshold (5000000)", github aws-neuron/aws-neuron-sdk issues 987 and 1003); AWS's error-code pages
  (NCC_EBVF030, NCC_EVRF007, NCC_EXTP004) name the error without the figure.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import torch


class EmulatorError(ValueError):
    """A kernel broke a rule the Neuron compiler or hardware enforces. ``rule`` names it."""

    def __init__(self, rule: str, message: str):
        super().__init__(f"[{rule}] {message}")
        self.rule = rule


def reject(rule: str, message: str):
    raise EmulatorError(rule, message)


# ----------------------------------------------------------------------------- targets and modes
@dataclass(frozen=True)
class Target:
    """A NeuronCore's limits. Trn3's own figures where AWS's Trn3 docs give them (SBUF, bf16 matmul output,
    DMA priority); PSUM banks, matmul tile sizes and partitions are Trn2's, which those docs do not restate."""
    name: str
    pmax: int = 128
    sbuf_partition_bytes: int = 224 * 1024
    psum_partition_bytes: int = 16 * 1024
    psum_bank_bytes: int = 2 * 1024
    psum_num_banks: int = 8
    gemm_stationary_fmax: int = 128
    gemm_moving_fmax: int = 512
    matmul_psum_dtypes: tuple = ("float32",)  # nc_matmul output dtypes
    dma_priority: bool = False  # dma_copy(priority=...): "NeuronCore-v4+ only"
    max_lnc: int = 2  # physical cores per logical NeuronCore


TARGETS = {
    "trn2": Target("trn2"),  # NeuronCore-v3: 28 MiB SBUF / 128 partitions
    # NeuronCore-v4: 32 MiB SBUF; matmuls may write and accumulate bf16 in PSUM (trainium3_arch.rst,
    # 'BF16 Matmul Results in PSUM')
    "trn3": Target("trn3", sbuf_partition_bytes=256 * 1024, matmul_psum_dtypes=("float32", "bfloat16"),
                   dma_priority=True),
}
DOMAIN_POLICIES = ("raise", "poison")
INSTRUCTION_BUDGET = 5_000_000  # per core and launch: the compiler's threshold (module docstring)
_state = {"target": TARGETS["trn2"], "count_only": False, "max_nan": "propagate", "domain": "raise",
          "dma_cast_modes": frozenset(), "budget": INSTRUCTION_BUDGET}


def target() -> Target:
    return _state["target"]


@contextlib.contextmanager
def _setting(key, value):
    previous = _state[key]
    _state[key] = value
    try:
        yield
    finally:
        _state[key] = previous


def use_target(name: str):
    """Check kernels against ``"trn2"`` (default) or ``"trn3"``'s capacities inside the block."""
    return _setting("target", TARGETS[name])


def count_only():
    """Inside the block kernels take ``meta`` tensors and skip the arithmetic (see the module doc)."""
    return _setting("count_only", True)


def max_nan_semantics(mode: str):
    """``"propagate"`` (default) or ``"drop"``: what ``maximum``/``minimum`` do with a NaN operand."""
    if mode not in ("propagate", "drop"):
        raise ValueError(f"mode must be 'propagate' or 'drop', got {mode!r}")
    return _setting("max_nan", mode)


def nan_drops() -> bool:
    return _state["max_nan"] == "drop"


def domain_policy(mode: str):
    """What an activation function does with inputs outside its documented valid range (where the hardware
    gives invalid results): ``"raise"`` (default) rejects the kernel (``engine-domain``), ``"poison"``
    writes NaN there, so a test can check the kernel never lets such a result reach its outputs."""
    if mode not in DOMAIN_POLICIES:
        raise ValueError(f"mode must be one of {DOMAIN_POLICIES}, got {mode!r}")
    return _setting("domain", mode)


def poisons() -> bool:
    return _state["domain"] == "poison"


def dma_casting(*modes):
    """Inside the block a ``dma_copy`` may convert dtypes when its ``dge_mode`` is one of ``modes``
    (``nki.isa.dge_mode`` members); by default no mode is trusted to, so every dtype-converting DMA is
    refused (``dma-cast``) and kernels convert on an engine (docs/backends/nki.md says why)."""
    return _setting("dma_cast_modes", frozenset(modes))


def dma_casts_in(mode) -> bool:
    return mode in _state["dma_cast_modes"]


def instruction_budget(count: int):
    """Instructions one core may issue in one launch (default :data:`INSTRUCTION_BUDGET`)."""
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive int, got {count!r}")
    return _setting("budget", count)


def program() -> tuple[int, int]:
    """``(program_id, num_programs)`` of the core running now: ``(0, 1)`` outside a multi-core launch."""
    return launch.core, launch.cores


def device() -> torch.device:
    return torch.device("meta" if _state["count_only"] else "cpu")


# ----------------------------------------------------------------------------- dtypes
@dataclass(frozen=True)
class DType:
    name: str
    torch_dtype: torch.dtype
    itemsize: int
    is_float: bool = True

    def __repr__(self) -> str:
        return f"nl.{self.name}"


float32 = DType("float32", torch.float32, 4)
tfloat32 = DType("tfloat32", torch.float32, 4)
bfloat16 = DType("bfloat16", torch.bfloat16, 2)
float16 = DType("float16", torch.float16, 2)
int32 = DType("int32", torch.int32, 4, False)
int16 = DType("int16", torch.int16, 2, False)
int8 = DType("int8", torch.int8, 1, False)
uint8 = DType("uint8", torch.uint8, 1, False)
uint16 = DType("uint16", torch.int32, 2, False)  # stored widened; values stay in range
uint32 = DType("uint32", torch.int64, 4, False)
# Supported Data Types (NKI docs: fp32, tf32, bf16, fp16, fp8, int8/16/32, uint8/16/32);
# there is no float64 on any NeuronCore engine. fp8 types are not emulated.
DTYPES = [float32, tfloat32, bfloat16, float16, int32, int16, int8, uint8, uint16, uint32]
_FROM_TORCH = {torch.float32: float32, torch.bfloat16: bfloat16, torch.float16: float16,
               torch.int32: int32, torch.int16: int16, torch.uint8: uint8, torch.int8: int8}


def from_torch(dtype: torch.dtype) -> DType:
    if dtype not in _FROM_TORCH:
        reject("dtype-unsupported", f"{dtype} has no NeuronCore data type (float64 and int64 are not supported)")
    return _FROM_TORCH[dtype]


def as_dtype(dtype) -> DType:
    if isinstance(dtype, DType):
        return dtype
    if isinstance(dtype, torch.dtype):
        return from_torch(dtype)
    reject("dtype-unsupported", f"{dtype!r} is not an NKI data type")


# ----------------------------------------------------------------------------- buffers
class Buffer:
    def __init__(self, name: str, on_chip: bool):
        self.name, self.on_chip = name, on_chip

    def __repr__(self) -> str:
        return f"nl.{self.name}"


sbuf = Buffer("sbuf", True)
psum = Buffer("psum", True)
shared_hbm = Buffer("shared_hbm", False)
private_hbm = Buffer("private_hbm", False)
hbm = private_hbm  # nki.language: "HBM - Alias of private_hbm"


# ----------------------------------------------------------------------------- statistics
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
        reuses a dead tile's buffer depends on what used it: :class:`_Memory`)."""
        queue, index = (launch.core, engine), len(self.trace)
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
        self.trace.append(Instruction(launch.core, engine, rule, int(size), int(detail), tuple(needs - lead),
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


_stats_stack: list[Stats] = []


@contextlib.contextmanager
def count_instructions():
    """Collect the instructions of every kernel launched inside the block into one Stats."""
    stats = Stats()
    _stats_stack.append(stats)
    try:
        yield stats
    finally:
        _stats_stack.remove(stats)


def _on_chip(tiles) -> tuple:
    return tuple(t for t in tiles if isinstance(t, Tensor) and t.buffer.on_chip)


def record(engine: str, cost: str, size: int, inputs: int = 1, flops: int = 0, reads=(), writes=(),
           stationary=None):
    """One instruction on ``engine``, priced by rule ``cost`` at ``size`` free elements per partition, reading
    and writing the tiles given (a matmul names its ``stationary`` operand among the reads)."""
    launch.issue()
    detail = stationary.free_size if stationary is not None else 0
    for stats in _stats_stack:
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
    launch.issue()
    for stats in _stats_stack:
        stats.instructions["dma"] += 1
        stats.elements["dma"] += int(nbytes)
        stats.work[("dma", direction, int(nbytes))] += 1
        setattr(stats, f"dma_bytes_{direction}", getattr(stats, f"dma_bytes_{direction}") + int(nbytes))
        stats.append("dma", rule, nbytes, descriptor_bytes, _on_chip([src, index]), _on_chip([dst]))


def record_launch(cores: int = 1):
    for stats in _stats_stack:
        stats.launches += 1
        stats.cores = max(stats.cores, cores)
        stats.launch_starts.append(len(stats.trace))


# ----------------------------------------------------------------------------- launches
class Launch:
    """One kernel launch: its cores (``kernel[cores]``), the core running now and what it has issued (against
    the instruction budget), and across cores the shared-HBM tensors the kernel allocates (one tensor for all
    cores, as the compiler makes an LNC kernel's outputs) and which core read or wrote each HBM element: the
    cores run concurrently with no ordering between them, so an element one core writes and another reads or
    writes is a race (``lnc-race``)."""

    def __init__(self, cores: int = 1):
        self.cores, self.core, self.issued = cores, 0, 0
        self.shared, self.next_shared = [], 0
        self.marks = {}  # HBM storage -> (written-by, read-by) core bit masks per element

    def start_core(self, core: int):
        self.core, self.issued, self.next_shared = core, 0, 0

    def issue(self):
        self.issued += 1
        if self.issued > _state["budget"]:
            reject("instruction-budget", f"core {self.core} issued more than {_state['budget']:,} instructions in one "
                   "launch, the Neuron compiler's threshold (its XTP002 error); tile the work over more launches")

    def shared_tensor(self, shape, dtype, make) -> "Tensor":
        """The ``nl.shared_hbm`` tensor the current core declares: core 0's, for the others."""
        if self.core == 0:
            self.shared.append(make())
            return self.shared[-1]
        if self.next_shared >= len(self.shared) or self.shared[self.next_shared].shape != shape \
                or self.shared[self.next_shared].dtype != dtype:
            reject("lnc-divergent", f"core {self.core} declares shared HBM tensor #{self.next_shared} {shape} {dtype}, "
                   "which core 0 did not: every core of a launch must declare the same shared tensors")
        self.next_shared += 1
        return self.shared[self.next_shared - 1]

    def access(self, tensor: "Tensor", write: bool):
        """Record that the current core reads or writes ``tensor`` (in HBM); reject a cross-core race."""
        if self.cores == 1 or _state["count_only"]:
            return
        data = tensor.data
        key = (data.untyped_storage().data_ptr(), data.element_size())
        if key not in self.marks:
            n = data.untyped_storage().nbytes() // data.element_size()
            self.marks[key] = (torch.zeros(n, dtype=torch.int8), torch.zeros(n, dtype=torch.int8))
        written, read = (m.as_strided(data.shape, data.stride(), data.storage_offset()) for m in self.marks[key])
        others = ~(1 << self.core)
        clash = (written | read) & others if write else written & others
        if bool(clash.any()):
            kind = "writes" if write else "reads"
            reject("lnc-race", f"core {self.core} {kind} HBM elements of {tensor.shape} that another core of the "
                   "launch wrote or read: the cores run concurrently, so each must own the HBM it writes")
        (written if write else read).bitwise_or_(1 << self.core)


launch = Launch()


# ----------------------------------------------------------------------------- on-chip allocations
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
            for stats in _stats_stack:
                stats.sbuf_peak_bytes = max(stats.sbuf_peak_bytes, used)
            if _stats_stack:
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
            for stats in _stats_stack:
                stats.psum_peak_banks = max(stats.psum_peak_banks, banks)
            if _stats_stack:
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


# ----------------------------------------------------------------------------- tensors
class Tensor:
    """An NKI tensor (``nl.NkiTensor``): torch storage, an NKI dtype and a buffer. Partition axis
    first on chip. Views (indexing, :meth:`reshape`) share the storage, as NKI's do."""

    def __init__(self, data: torch.Tensor, dtype: DType, buffer: Buffer, root: "Tensor | None" = None):
        self.data, self.dtype, self.buffer = data, dtype, buffer
        self._root = root  # the allocation a view belongs to (None for the allocation itself)
        self.last_writer = None  # on the root: what last wrote it ('matmul' or 'other', for PSUM accumulation)
        self.buffer_id = None  # on an on-chip root while instructions are counted: the buffer it occupies

    @property
    def root(self) -> "Tensor":
        return self._root or self

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def ndim(self) -> int:
        return self.data.dim()

    @property
    def size(self) -> int:
        return self.data.numel()

    @property
    def free_size(self) -> int:
        free = 1
        for n in self.shape[1:]:
            free *= n
        return free

    @property
    def partition_bytes(self) -> int:
        return self.free_size * self.dtype.itemsize

    def __getitem__(self, index) -> "Tensor":
        if self.buffer.on_chip:
            index = _keep_partition_axis(index, self.shape[0])
        view = self.data[index]
        if self.buffer.on_chip:
            if view.dim() == 0:
                reject("tile-rank", "an on-chip tile access must keep the partition axis (got a scalar)")
            if view.shape[0] > 1 and view.stride(0) != self.root.data.stride(0):
                # trainium_inferentia2_arch.rst: "hardware does not allow P dimension striding"
                reject("partition-stride", f"{self.buffer.name} access {tuple(view.shape)} steps over partitions; an "
                       "SBUF/PSUM access covers consecutive partitions (no stride on the partition axis)")
        return Tensor(view, self.dtype, self.buffer, self.root)

    @property
    def start_partition(self) -> int:
        """The first partition an on-chip view covers."""
        return (self.data.storage_offset() - self.root.data.storage_offset()) // self.root.data.stride(0)

    def __setitem__(self, key, value):
        reject("tile-assign", "assign through nki.isa instructions (dst=...), not with Python item assignment")

    def reshape(self, shape: tuple[int, ...]) -> "Tensor":
        """NkiTensor.reshape: a view with the same elements; on chip the partition axis is kept."""
        shape = tuple(int(n) for n in shape)
        if self.buffer.on_chip and shape[0] != self.shape[0]:
            reject("tile-shape", f"reshape of an on-chip tile must keep its partition axis: {self.shape} -> {shape}")
        if not self.data.is_contiguous():
            reject("view", f"reshape needs a contiguous view; {self.shape} is strided")
        return Tensor(self.data.view(shape), self.dtype, self.buffer, self.root)

    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None):
        """NkiTensor.ap, an explicit ``[[step, num], ...]`` access pattern; emulated for one use, an HBM tensor's
        rows gathered or scattered by a DMA through a per-partition index tile (``emulator/indirect.py``)."""
        from .indirect import IndirectView
        if vector_offset is None or scalar_offset is not None or dtype is not None:
            reject("api-subset", "NkiTensor.ap is emulated with vector_offset= only (no scalar_offset, no dtype)")
        return IndirectView(self, pattern, 0 if offset is None else offset, vector_offset, indirect_dim)

    def __repr__(self) -> str:
        return f"Tensor({self.shape}, {self.dtype}, {self.buffer})"

    # values as float32 (engines compute in fp32) / write with one rounding to the tile's dtype
    def read(self) -> torch.Tensor:
        if _state["count_only"] or not self.dtype.is_float:
            return self.data
        return self.data.to(torch.float32)

    def assign(self, compute):
        """``self = compute()``, rounded once to the tile's dtype; in count-only mode nothing is computed."""
        if _state["count_only"]:
            self.root.last_writer = "other"
        else:
            self.write(compute())

    def write(self, value: torch.Tensor):
        if tuple(value.shape) != self.shape:
            value = value.expand(self.shape) if value.dim() <= len(self.shape) else value.reshape(self.shape)
        self.data.copy_(value.to(self.data.dtype))
        self.root.last_writer = "other"


def _keep_partition_axis(index, partitions: int):
    """An integer index on the partition axis keeps it, at size 1 (NKI language guide, 'The partition dimension
    is special')."""
    first, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
    if isinstance(first, int) and -partitions <= first < partitions:  # out of range: torch's IndexError
        first = slice(first % partitions, first % partitions + 1)
    return (first, *rest)


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

    if buffer is shared_hbm and launch.cores > 1:
        return launch.shared_tensor(shape, dtype, fresh)
    tensor = fresh()
    if buffer.on_chip:
        memory.allocate(tensor)
    return tensor


def wrap_hbm(value: torch.Tensor) -> Tensor:
    """A kernel argument: a torch tensor seen as an HBM tensor (shares storage)."""
    if value.device.type != device().type:
        allowed = "meta (count-only mode)" if _state["count_only"] else "CPU"
        reject("device", f"the emulator takes {allowed} tensors here, not {value.device.type}")
    return Tensor(value, from_torch(value.dtype), shared_hbm)
