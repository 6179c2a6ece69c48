"""Core of the NKI emulator: its errors, the targets' limits, the modes and policies, dtypes, buffers and launches.

The rest of the machinery builds on this: NKI tensors in ``tensors.py``, the counters and the instruction trace in
``trace.py``, on-chip allocation (liveness, SBUF/PSUM capacity) in ``allocation.py``.

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

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .tensors import Tensor


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


def counting_only() -> bool:
    return _state["count_only"]


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
