"""Core of the NKI emulator: tensors in HBM/SBUF/PSUM, the hardware rules, scopes and counters.

A test double, not a simulator of timing: it executes the subset of ``nki.language`` /
``nki.isa`` that this project's kernels use, on CPU, with torch as the storage (so bfloat16
is stored as bfloat16 and every engine write rounds once, round-to-nearest-even), and it
raises :class:`EmulatorError` where the Neuron compiler or hardware would reject a kernel.
Every rule names itself in brackets at the start of the message, e.g. ``[partition-dim]``.

Sources for the numbers (NKI 0.7 / Neuron SDK 2.33 docs):

* 128 partitions, 512 fp32 per PSUM bank, 8 PSUM banks, matmul free sizes 128 / 512:
  https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/nki.language.tile_size.html
* SBUF 28 MiB = 128 partitions x 224 KiB on NeuronCore-v3 (Trn2), PSUM 2 MiB (16 KiB per
  partition): aws-neuron/aws-neuron-sdk nki/guides/architecture/trainium2_arch.rst
  (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/arch/trainium2_arch.html)
* SBUF 32 MiB (256 KiB per partition) on NeuronCore-v4 (Trn3), PSUM unchanged:
  https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/about/trainium3_arch.html
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch


class EmulatorError(ValueError):
    """A kernel broke a rule the Neuron compiler or hardware enforces. ``rule`` names it."""

    def __init__(self, rule: str, message: str):
        super().__init__(f"[{rule}] {message}")
        self.rule = rule


def reject(rule: str, message: str):
    raise EmulatorError(rule, message)


# ----------------------------------------------------------------------------- targets
@dataclass(frozen=True)
class Target:
    name: str
    pmax: int = 128
    sbuf_partition_bytes: int = 224 * 1024
    psum_partition_bytes: int = 16 * 1024
    psum_bank_bytes: int = 2 * 1024
    psum_num_banks: int = 8
    gemm_stationary_fmax: int = 128
    gemm_moving_fmax: int = 512


TARGETS = {
    "trn2": Target("trn2"),  # NeuronCore-v3: 28 MiB SBUF / 128 partitions
    "trn3": Target("trn3", sbuf_partition_bytes=256 * 1024),  # NeuronCore-v4: 32 MiB SBUF
}
_state = {"target": TARGETS["trn2"]}


def target() -> Target:
    return _state["target"]


@contextlib.contextmanager
def use_target(name: str):
    previous = _state["target"]
    _state["target"] = TARGETS[name]
    try:
        yield
    finally:
        _state["target"] = previous


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
uint8 = DType("uint8", torch.uint8, 1, False)
uint16 = DType("uint16", torch.int32, 2, False)  # stored widened; values stay in range
uint32 = DType("uint32", torch.int64, 4, False)
int8 = DType("int8", torch.int8, 1, False)
# Supported Data Types (NKI docs: fp32, tf32, bf16, fp16, fp8, int8/16/32, uint8/16/32);
# there is no float64 on any NeuronCore engine.
DTYPES = [float32, tfloat32, bfloat16, float16, int32, uint8, uint16, uint32, int8]
_FROM_TORCH = {torch.float32: float32, torch.bfloat16: bfloat16, torch.float16: float16,
               torch.int32: int32, torch.uint8: uint8, torch.int8: int8}


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
hbm = Buffer("hbm", False)
shared_hbm = Buffer("shared_hbm", False)
private_hbm = Buffer("private_hbm", False)


# ----------------------------------------------------------------------------- statistics
@dataclass
class Stats:
    """Instructions issued per engine, and free-axis elements per partition they streamed."""

    instructions: Counter = field(default_factory=Counter)
    elements: Counter = field(default_factory=Counter)  # per-partition free elements (cycles ~ this)
    dma_bytes: int = 0
    matmul_flops: int = 0

    def add(self, engine: str, elements: int = 0):
        self.instructions[engine] += 1
        self.elements[engine] += int(elements)

    def merge(self, other: "Stats"):
        self.instructions.update(other.instructions)
        self.elements.update(other.elements)
        self.dma_bytes += other.dma_bytes
        self.matmul_flops += other.matmul_flops

    def as_dict(self) -> dict:
        return {"instructions": dict(self.instructions), "elements_per_partition": dict(self.elements),
                "dma_bytes": self.dma_bytes, "matmul_flops": self.matmul_flops}


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


def record(engine: str, elements: int = 0, dma_bytes: int = 0, flops: int = 0):
    for stats in _stats_stack:
        stats.add(engine, elements)
        stats.dma_bytes += dma_bytes
        stats.matmul_flops += flops


# ----------------------------------------------------------------------------- allocation scopes
class _Scope:
    def __init__(self):
        self.tiles: list[Tensor] = []


class _Memory:
    """Live on-chip allocations: tiles belong to the loop iteration (or kernel) that declared them."""

    def __init__(self):
        self.scopes: list[_Scope] = []

    def reset(self):
        self.scopes = [_Scope()]

    def live(self, buffer):
        return [t for s in self.scopes for t in s.tiles if t.buffer is buffer]

    def allocate(self, tile: "Tensor"):
        tgt = target()
        if tile.buffer is sbuf:
            used = sum(t.partition_bytes for t in self.live(sbuf)) + tile.partition_bytes
            if used > tgt.sbuf_partition_bytes:
                reject("sbuf-capacity", f"SBUF tile {tile.shape} {tile.dtype} needs {tile.partition_bytes} bytes per "
                       f"partition; with the live tiles that is {used} > {tgt.sbuf_partition_bytes} bytes per "
                       f"partition on {tgt.name} (SBUF is 128 partitions x {tgt.sbuf_partition_bytes // 1024} KiB)")
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
        if self.scopes:
            self.scopes[-1].tiles.append(tile)

    @contextlib.contextmanager
    def scope(self):
        self.scopes.append(_Scope())
        try:
            yield
        finally:
            self.scopes.pop()


memory = _Memory()
memory.reset()


# ----------------------------------------------------------------------------- tensors
class Tensor:
    """An NKI tensor: torch storage, an NKI dtype and a buffer. Partition axis first on chip."""

    def __init__(self, data: torch.Tensor, dtype: DType, buffer: Buffer, root: "Tensor | None" = None):
        self.data, self.dtype, self.buffer = data, dtype, buffer
        self.root = root or self

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def ndim(self) -> int:
        return self.data.dim()

    @property
    def partition_bytes(self) -> int:
        free = 1
        for n in self.shape[1:]:
            free *= n
        return free * self.dtype.itemsize

    @property
    def free_size(self) -> int:
        free = 1
        for n in self.shape[1:]:
            free *= n
        return free

    def __getitem__(self, index) -> "Tensor":
        view = self.data[index]
        if self.buffer.on_chip and view.dim() == 0:
            reject("tile-rank", "an on-chip tile access must keep the partition axis (got a scalar)")
        return Tensor(view, self.dtype, self.buffer, self.root)

    def __setitem__(self, index, value):
        reject("tile-assign", "assign through nki.isa instructions (dst=...), not with Python item assignment")

    def __repr__(self) -> str:
        return f"Tensor({self.shape}, {self.dtype}, {self.buffer})"

    # values as float32 (engines compute in fp32) / write with one rounding to the tile's dtype
    def read(self) -> torch.Tensor:
        return self.data.to(torch.float32) if self.dtype.is_float else self.data

    def write(self, value: torch.Tensor):
        if tuple(value.shape) != self.shape:
            value = value.expand(self.shape) if value.dim() <= len(self.shape) else value.reshape(self.shape)
        self.data.copy_(value.to(self.data.dtype))


def allocate(shape, dtype, buffer) -> Tensor:
    shape = tuple(int(n) for n in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    dtype = as_dtype(dtype)
    if dtype not in DTYPES:
        reject("dtype-unsupported", f"{dtype} is not a NeuronCore data type")
    if buffer is None:
        buffer = sbuf
    if not isinstance(buffer, Buffer):
        reject("buffer", f"buffer must be nl.sbuf, nl.psum, nl.hbm or nl.shared_hbm, not {buffer!r}")
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
    fill = torch.full(shape, float("nan")) if dtype.is_float else torch.zeros(shape)
    tensor = Tensor(fill.to(dtype.torch_dtype), dtype, buffer)
    if buffer.on_chip:
        memory.allocate(tensor)
    return tensor


def wrap_hbm(value: torch.Tensor) -> Tensor:
    """A kernel argument: a CPU torch tensor seen as an HBM tensor (shares storage)."""
    if value.device.type != "cpu":
        reject("device", f"the emulator runs on CPU tensors, not {value.device.type}")
    return Tensor(value, from_torch(value.dtype), hbm)
