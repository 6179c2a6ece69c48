"""Operand checks and cost rules the emulated ``nki.isa`` instructions share: on-chip tiles and where their
partitions start, matching layouts, scalar-or-vector operands, PSUM and engine restrictions, ALU operators, and the
performance modes that price one-input instructions.
"""

from __future__ import annotations

from .. import core
from .. import language as nl
from ..core import psum, reject, sbuf
from ..tensors import Tensor
from .enums import engine

SIXTEEN_BIT = {"bfloat16", "float16"}


def op_name(op) -> str:
    return f"nl.{op.__name__}" if callable(op) and hasattr(op, "__name__") else repr(op)


def tile(name: str, t, instr: str) -> Tensor:
    if not isinstance(t, Tensor):
        reject("operand-type", f"{instr}: {name} must be an NKI tensor, got {type(t).__name__}")
    if not t.buffer.on_chip:
        reject("engine-memory", f"{instr}: {name} is in {t.buffer.name}; compute engines read and write SBUF/PSUM "
               "only (move HBM data with nisa.dma_copy)")
    if t.shape[0] > core.target().pmax:
        reject("partition-dim", f"{instr}: {name} spans {t.shape[0]} partitions > {core.target().pmax}")
    start, count = t.start_partition, t.shape[0]
    if start % _start_alignment(count):
        reject("start-partition", f"{instr}: {name} covers {count} partitions from partition {start}; an engine "
               f"access of {count} partitions starts at a multiple of {_start_alignment(count)}")
    return t


def _start_alignment(partitions: int) -> int:
    """Where an engine's SBUF/PSUM access of ``partitions`` partitions may start (trainium_inferentia2_arch.rst):
    over 64 at 0, over 32 at 0 or 64, else at 0/32/64/96."""
    return 128 if partitions > 64 else 64 if partitions > 32 else 32


def same_layout(a: Tensor, b: Tensor, instr: str, what: str):
    if a.shape[0] != b.shape[0] or a.free_size != b.free_size:
        reject("tile-shape", f"{instr}: {what} must have the same partitions and elements per partition; "
               f"got {a.shape} and {b.shape}")


def vector_operand(x, data: Tensor, instr: str, name: str, float32_only: bool = False):
    """A compile-time scalar or a ``[P, 1]`` tile broadcast along the free axis (as a torch value)."""
    if x is None or isinstance(x, (int, float)):
        return x
    tile(name, x, instr)
    if x.shape[0] != data.shape[0] or x.free_size != 1:
        reject("operand-shape", f"{instr}: {name} must be a scalar or a tile of shape ({data.shape[0]}, 1); "
               f"got {x.shape}")
    if float32_only and x.dtype is not core.float32:
        reject("operand-dtype", f"{instr}: {name} must be float32, got {x.dtype}")
    return x.read().reshape(data.shape[0], *([1] * (data.ndim - 1)))


def _no_psum(instr: str, why: str, *tiles):
    for t in tiles:
        if isinstance(t, Tensor) and t.buffer is psum:
            reject("gpsimd-psum" if "GpSimd" in why else "operand-memory", f"{instr}: {why}")


def gpsimd_psum(instr: str, *tiles):
    _no_psum(instr, "runs on the GpSimd Engine, which cannot access PSUM (nki.isa.tensor_copy: 'GpSimd Engine "
             "cannot access PSUM'); copy the tile to SBUF first", *tiles)


def engine_name(requested, default: str, allowed: tuple[str, ...], instr: str) -> str:
    name = default if requested in (None, engine.unknown) else requested.name
    if name not in allowed:
        reject("engine", f"{instr} runs on the {' / '.join(allowed)} engine(s), not {name}")
    return name


def alu(op, instr: str):
    if op not in nl.ALU:
        reject("alu-op", f"{instr}: {op_name(op)} is not an arithmetic ALU operator "
               "(nki.api.shared 'Supported Math Operators'; nl.divide is not one)")
    return nl.ALU[op]


def binary(op, a, b, reverse, instr):
    fn = alu(op, instr)
    return fn(b, a) if reverse else fn(a, b)


def packed16(*tiles) -> bool:
    """Every tile 16-bit float in SBUF with a contiguous innermost axis: VectorE's performance mode
    (trainium2_arch.rst, 'Vector Engine Performance Mode')."""
    return all(t.buffer is sbuf and t.dtype.name in SIXTEEN_BIT and t.data.stride(-1) == 1 for t in tiles)


def one_input_cost(engine: str, dst, *inputs) -> str:
    """Cost rule of a one-input (tensor_copy / tensor_scalar) instruction: VectorE's and ScalarE's BF16/FP16
    performance modes (trainium2_arch.rst, 'Vector Engine Performance Mode'; trainium3_arch.rst, Scalar Engine
    'Performance mode', NeuronCore-v4's: the cost model's machines say where it applies)."""
    sixteen_bit = all(t.dtype.name in SIXTEEN_BIT for t in (dst, *inputs))
    if engine == "vector" and packed16(dst, *inputs):
        return "perf4"
    if engine == "vector" and sixteen_bit:
        return "perf2"
    return "scalar_perf2" if engine == "scalar" and sixteen_bit else "stream"
