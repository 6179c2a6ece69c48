"""Emulated ``nki.isa`` (``import nki.isa as nisa``): the instructions this project's kernels use.

Each instruction has the signature AWS publishes (``backends/nki/aws_signatures.py``, checked by
tests/test_nki_api.py), checks the operand rules its reference page states, computes in float32
(as the engines do) and writes ``dst`` with one rounding to its dtype. It also records itself for
the cost model (``cost.py``): the engine it runs on and the rule that prices it. Semantics and
rules are from aws-neuron/aws-neuron-sdk ``nki/api/nki/isa/__init__.py`` (the API reference
source) unless a line says otherwise; tests/test_nki_aws_examples.py ports AWS's own examples.
"""

from __future__ import annotations

import enum
import math

import torch

from . import core, cost, indirect, trace
from . import language as nl
from .core import psum, reject, sbuf
from .tensors import Tensor


class engine(enum.Enum):  # noqa: N801  (nki.isa.engine; values as AWS's)
    tensor = 1
    vector = 5
    scalar = 2
    gpsimd = 3
    dma = 4
    sync = 6
    unknown = 0


class reduce_cmd(enum.Enum):  # noqa: N801
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class dge_mode(enum.Enum):  # noqa: N801
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(enum.Enum):  # noqa: N801
    error = 0
    skip = 1


class matmul_perf_mode(enum.Enum):  # noqa: N801
    none = "none"
    double_row = "double_row"


tensor_engine, vector_engine, scalar_engine, gpsimd_engine = engine.tensor, engine.vector, engine.scalar, engine.gpsimd
unknown_engine = engine.unknown

_FLOAT_MATMUL = {"float32", "tfloat32", "bfloat16", "float16"}  # fp8 types are not emulated
_SIXTEEN_BIT = {"bfloat16", "float16"}

# Scalar Engine reduce registers: one fp32 per compute lane (nki.isa.activation: reduce_regs).
_reduce_regs = torch.zeros(128, 1)


def _registers(core_index: int) -> Tensor:
    """The reduce registers of one core of a launch as a tile, so the cost model sees what waits on them."""
    registers = Tensor(torch.zeros(128, 1), core.float32, sbuf)
    registers.buffer_id = -1 - core_index
    return registers


_REDUCE_REGS = (_registers(0), _registers(1))


# ----------------------------------------------------------------------------- operand checks
def _op_name(op) -> str:
    return f"nl.{op.__name__}" if callable(op) and hasattr(op, "__name__") else repr(op)


def _tile(name: str, t, instr: str) -> Tensor:
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


def _same_layout(a: Tensor, b: Tensor, instr: str, what: str):
    if a.shape[0] != b.shape[0] or a.free_size != b.free_size:
        reject("tile-shape", f"{instr}: {what} must have the same partitions and elements per partition; "
               f"got {a.shape} and {b.shape}")


def _vector_operand(x, data: Tensor, instr: str, name: str, float32_only: bool = False):
    """A compile-time scalar or a ``[P, 1]`` tile broadcast along the free axis (as a torch value)."""
    if x is None or isinstance(x, (int, float)):
        return x
    _tile(name, x, instr)
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


def _gpsimd_psum(instr: str, *tiles):
    _no_psum(instr, "runs on the GpSimd Engine, which cannot access PSUM (nki.isa.tensor_copy: 'GpSimd Engine "
             "cannot access PSUM'); copy the tile to SBUF first", *tiles)


def _engine_name(requested, default: str, allowed: tuple[str, ...], instr: str) -> str:
    name = default if requested in (None, engine.unknown) else requested.name
    if name not in allowed:
        reject("engine", f"{instr} runs on the {' / '.join(allowed)} engine(s), not {name}")
    return name


def _alu(op, instr: str):
    if op not in nl.ALU:
        reject("alu-op", f"{instr}: {_op_name(op)} is not an arithmetic ALU operator "
               "(nki.api.shared 'Supported Math Operators'; nl.divide is not one)")
    return nl.ALU[op]


def _binary(op, a, b, reverse, instr):
    fn = _alu(op, instr)
    return fn(b, a) if reverse else fn(a, b)


def _packed16(*tiles) -> bool:
    """Every tile 16-bit float in SBUF with a contiguous innermost axis: VectorE's performance mode
    (trainium2_arch.rst, 'Vector Engine Performance Mode')."""
    return all(t.buffer is sbuf and t.dtype.name in _SIXTEEN_BIT and t.data.stride(-1) == 1 for t in tiles)


def _one_input_cost(engine: str, dst, *inputs) -> str:
    """Cost rule of a one-input (tensor_copy / tensor_scalar) instruction: VectorE's and ScalarE's BF16/FP16
    performance modes (trainium2_arch.rst, 'Vector Engine Performance Mode'; trainium3_arch.rst, Scalar Engine
    'Performance mode', NeuronCore-v4's: the cost model's machines say where it applies)."""
    sixteen_bit = all(t.dtype.name in _SIXTEEN_BIT for t in (dst, *inputs))
    if engine == "vector" and _packed16(dst, *inputs):
        return "perf4"
    if engine == "vector" and sixteen_bit:
        return "perf2"
    return "scalar_perf2" if engine == "scalar" and sixteen_bit else "stream"


# ----------------------------------------------------------------------------- data movement
def dma_copy(dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown, engine=engine.unknown,
             name=None):
    """``dst = src`` between HBM and SBUF; a dtype conversion goes through float32 ('The DMA engines
    automatically handle data type conversion ... first casting from src.dtype to float32, then from
    float32 to dst.dtype')."""
    for label, t in (("dst", dst), ("src", src)):
        if not isinstance(t, Tensor):
            reject("operand-type", f"dma_copy: {label} must be an NKI tensor")
        if t.buffer is psum:
            reject("dma-psum", "dma_copy moves data between HBM and SBUF; DMA engines do not access PSUM "
                   "(evacuate PSUM to SBUF with a compute-engine copy)")
        if t.buffer.on_chip and t.shape[0] > core.target().pmax:
            reject("partition-dim", f"dma_copy: {label} tile spans {t.shape[0]} partitions > {core.target().pmax}")
    if dst.size != src.size:
        reject("dma-shape", f"dma_copy: dst {dst.shape} and src {src.shape} hold different element counts "
               f"({dst.size} and {src.size})")
    _dma_options(priority, dge_mode, engine)
    if src.dtype != dst.dtype and not core.dma_casts_in(dge_mode):
        reject("dma-cast", f"dma_copy: src is {src.dtype} and dst {dst.dtype}; whether a DMA converts depends on its "
               f"descriptor mode (NKI ISA API Common Fields, 'Type Casting'), and dge_mode={dge_mode.name} is not "
               "one the emulator is told converts (emulator.dma_casting): move the dtype as it is and convert "
               "on an engine")
    view = next((t for t in (dst, src) if isinstance(t, indirect.IndirectView)), None)
    if view is not None:
        indirect.copy(dst, src, oob_mode, dge_mode)
    else:
        for t, write in ((src, False), (dst, True)):
            if not t.buffer.on_chip:
                core.launch.access(t, write)
        dst.assign(lambda: (src.read() if src.dtype != dst.dtype else src.data).reshape(dst.shape))
    hbm_side = src if not src.buffer.on_chip else dst
    descriptor = min(_contiguous_bytes(src), _contiguous_bytes(dst))
    trace.record_dma(hbm_side.size * hbm_side.dtype.itemsize, src, dst, descriptor,
                    index=None if view is None else view.index)


def _contiguous_bytes(t: Tensor) -> int:
    """The longest run of consecutive bytes in ``t``'s access pattern: a DMA descriptor's payload (on chip
    within one partition, each partition being its own buffer: trainium_inferentia2_arch.rst, 'Data movement
    between HBM and SBUF using DMAs')."""
    shape, strides = t.data.shape, t.data.stride()
    run, first = 1, 1 if t.buffer.on_chip or isinstance(t, indirect.IndirectView) else 0  # a gather: row by row
    for n, stride in zip(reversed(shape[first:]), reversed(strides[first:])):
        if n == 1:
            continue
        if stride != run:
            break
        run *= n
    return run * t.dtype.itemsize


def dma_transpose(dst, src, axes=None, priority=None, dge_mode=dge_mode.unknown, oob_mode=oob_mode.error, name=None):
    """``dst = src.T`` on the DMA engines, from HBM or SBUF into SBUF (trainium2_arch.rst, 'DMA Transpose': 2- and
    4-byte dtypes, bit-accurate). 2-D only here."""
    for label, t in (("dst", dst), ("src", src)):
        if not isinstance(t, Tensor):
            reject("operand-type", f"dma_transpose: {label} must be an NKI tensor")
    if dst.buffer is not sbuf or src.buffer is psum:
        reject("dma-transpose-memory", "dma_transpose moves HBM or SBUF data into SBUF (trainium2_arch.rst, "
               f"'DMA Transpose'); got {src.buffer.name} -> {dst.buffer.name}")
    if src.ndim != 2 or dst.ndim != 2 or axes not in (None, (1, 0), [1, 0]):
        reject("api-subset", "the emulator takes 2-D dma_transpose operands only (permutation [1, 0])")
    if dst.shape != src.shape[::-1]:
        reject("tile-shape", f"dma_transpose: dst must be src's shape reversed, {src.shape[::-1]}; got {dst.shape}")
    if src.dtype != dst.dtype or src.dtype.itemsize not in (2, 4):
        reject("transpose-dtype", f"dma_transpose moves 2- or 4-byte data unchanged; got {src.dtype} -> {dst.dtype}")
    _dma_options(priority, dge_mode, engine.unknown)
    if not src.buffer.on_chip:
        core.launch.access(src, False)
    dst.assign(lambda: src.data.T)
    trace.record_dma(src.size * src.dtype.itemsize, src, dst, 0, transpose=True)


def _dma_options(priority, dge, sequencer):
    """dma_copy's ``priority`` is NeuronCore-v4's (dma_copy reference); ``engine`` picks the sequencer that
    triggers hardware DGE, scalar or sync, and only with ``dge_mode.hwdge`` (nki/deep-dives/nki-dge.rst)."""
    if priority is not None and not core.target().dma_priority:
        reject("dma-priority", f"dma_copy(priority={priority!r}): DMA priority levels are NeuronCore-v4+ only, "
               f"not on {core.target().name}")
    if priority is not None and priority not in (0, 1, 2, 3):
        reject("dma-priority", f"dma_copy(priority={priority!r}): a priority is 0 (highest) to 3")
    if sequencer is not engine.unknown and (dge is not dge_mode.hwdge or sequencer not in (engine.scalar, engine.sync)):
        reject("dma-engine", f"dma_copy(engine={sequencer.name}, dge_mode={dge.name}): engine selects the scalar or "
               "sync sequencer that triggers hardware DGE, so it takes dge_mode=hwdge")


def tensor_copy(dst, src, engine=engine.unknown, name=None):
    """``dst = src`` on chip, on the Vector (default here), Scalar or GpSimd Engine."""
    _tile("dst", dst, "tensor_copy"), _tile("src", src, "tensor_copy")
    _same_layout(dst, src, "tensor_copy", "dst and src")
    eng = _engine_name(engine, "vector", ("vector", "scalar", "gpsimd"), "tensor_copy")
    if eng == "gpsimd":
        _gpsimd_psum("tensor_copy on gpsimd", dst, src)
    # bit-accurate when the dtypes match, else through float32
    dst.assign(lambda: (src.data if src.dtype == dst.dtype else src.read()).reshape(dst.shape))
    trace.record(eng, _one_input_cost(eng, dst, src), src.free_size, reads=(src,), writes=(dst,))


def memset(dst, value, engine=engine.unknown, name=None):
    """Fill ``dst`` with the compile-time constant ``value`` (any NKI dtype; at most four free axes, the
    v2.33 reference says), on the Vector or GpSimd Engine."""
    _tile("dst", dst, "memset")
    if dst.ndim > 5:
        reject("memset-shape", f"memset: dst {dst.shape} has {dst.ndim - 1} free axes; memset takes at most four")
    _memset_value(value, dst.dtype)
    eng = _engine_name(engine, "vector" if dst.buffer is psum else "gpsimd", ("vector", "gpsimd"), "memset")
    if eng == "gpsimd":
        _gpsimd_psum("memset on gpsimd", dst)
    dst.assign(lambda: torch.full((), float(value)))
    trace.record(eng, "stream", dst.free_size, writes=(dst,))


def _memset_value(value, dtype):
    """A Python number the dtype holds: what the engines write for one it does not (a fraction or an
    out-of-range integer into an integer tile, a finite value past a float type's range) is undocumented."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        reject("memset-value", f"memset: value must be a compile-time number, got {type(value).__name__}")
    if dtype.is_float:
        if math.isfinite(value) and not math.isfinite(torch.tensor(float(value)).to(dtype.torch_dtype).item()):
            reject("memset-value", f"memset: {value!r} is past {dtype}'s range")
        return
    low, high = _INTEGER_RANGE[dtype.name]
    if not (math.isfinite(value) and float(value).is_integer() and low <= value <= high):
        reject("memset-value", f"memset: {value!r} is not an integer in {dtype}'s range [{low}, {high}]")


_INTEGER_RANGE = {"int8": (-2 ** 7, 2 ** 7 - 1), "uint8": (0, 2 ** 8 - 1), "int16": (-2 ** 15, 2 ** 15 - 1),
                  "uint16": (0, 2 ** 16 - 1), "int32": (-2 ** 31, 2 ** 31 - 1), "uint32": (0, 2 ** 32 - 1)}


def tensor_copy_predicated(dst, src, predicate, reverse_pred=False, name=None):
    """``dst = src`` where ``predicate`` (is non-zero, or zero under ``reverse_pred``), Vector Engine;
    ``src`` may be a scalar."""
    _tile("dst", dst, "tensor_copy_predicated"), _tile("predicate", predicate, "tensor_copy_predicated")
    if predicate.dtype.name not in ("uint8", "uint16", "uint32"):
        reject("predicate-dtype",
               f"tensor_copy_predicated: predicate must be uint8/uint16/uint32, not {predicate.dtype}")
    _same_layout(dst, predicate, "tensor_copy_predicated", "dst and predicate")
    if isinstance(src, Tensor):
        _tile("src", src, "tensor_copy_predicated")
        _same_layout(dst, src, "tensor_copy_predicated", "dst and src")
        if src.dtype != dst.dtype:
            reject("copy-dtype", f"tensor_copy_predicated: src ({src.dtype}) and dst ({dst.dtype}) must share a dtype")
        if src.buffer is psum and predicate.buffer is psum:
            reject("psum-operands", "tensor_copy_predicated: src and predicate cannot both be in PSUM")

    def value():
        keep = (predicate.data.reshape(dst.shape) != 0) != reverse_pred
        new = src.data.reshape(dst.shape) if isinstance(src, Tensor) else torch.tensor(float(src)).to(dst.data.dtype)
        return torch.where(keep, new, dst.data)

    dst.assign(value)
    trace.record("vector", "stream2", dst.free_size, inputs=2, reads=(src, predicate, dst), writes=(dst,))


# ----------------------------------------------------------------------------- elementwise
def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    """``dst = data1 <op> data2`` element-wise, Vector or GpSimd Engine."""
    for label, t in (("dst", dst), ("data1", data1), ("data2", data2)):
        _tile(label, t, "tensor_tensor")
    _same_layout(data1, data2, "tensor_tensor", "data1 and data2")
    _same_layout(dst, data1, "tensor_tensor", "dst and data1")
    if data1.buffer is psum and data2.buffer is psum:
        reject("psum-operands", "tensor_tensor: data1 and data2 cannot both be in PSUM")
    eng = _engine_name(engine, "vector", ("vector", "gpsimd"), "tensor_tensor")
    if eng == "gpsimd":
        _gpsimd_psum("tensor_tensor on gpsimd", dst, data1, data2)
    fn = _alu(op, "tensor_tensor")
    dst.assign(lambda: fn(data1.read(), data2.read().reshape(data1.shape)).reshape(dst.shape))
    perf = eng == "vector" and _packed16(data1, data2) and dst.dtype.name in _SIXTEEN_BIT
    trace.record(eng, "stream" if perf else "stream2", data1.free_size, inputs=2, reads=(data1, data2),
                writes=(dst,))


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=engine.unknown, name=None):
    """``(data <op0> operand0) <op1> operand1``, operands scalars or float32 ``[P, 1]`` vectors;
    a unary op0 (abs, square, rsqrt, reciprocal) takes operand0 ``None`` or ``0``."""
    _tile("dst", dst, "tensor_scalar"), _tile("data", data, "tensor_scalar")
    _same_layout(dst, data, "tensor_scalar", "dst and data")
    if (op1 is None) != (operand1 is None):
        reject("operand-shape", "tensor_scalar: op1 and operand1 must both be given or both be None")
    eng = _engine_name(engine, "vector", ("vector", "scalar", "gpsimd"), "tensor_scalar")
    if eng == "gpsimd":
        _gpsimd_psum("tensor_scalar on gpsimd", dst, data)
    if op0 in nl.ALU_UNARY:
        if operand0 not in (None, 0, 0.0):
            reject("operand-shape", f"tensor_scalar: operand0 must be None or 0 with the unary {_op_name(op0)}")
    else:
        a = _vector_operand(operand0, data, "tensor_scalar", "operand0", float32_only=True)
        _alu(op0, "tensor_scalar")
    if op1 is not None:
        b = _vector_operand(operand1, data, "tensor_scalar", "operand1", float32_only=True)
        _alu(op1, "tensor_scalar")

    def value():
        x = data.read()
        x = nl.ALU_UNARY[op0](x) if op0 in nl.ALU_UNARY else _binary(op0, x, a, reverse0, "tensor_scalar")
        if op1 is not None:
            x = _binary(op1, x, b, reverse1, "tensor_scalar")
        return torch.as_tensor(x).expand(data.shape).reshape(dst.shape)

    dst.assign(value)
    trace.record(eng, _one_input_cost(eng, dst, data), data.free_size,
                reads=(data, operand0, operand1), writes=(dst,))


def tensor_scalar_reduce(dst, data, op0, operand0, reduce_op, reduce_res=None, reverse0=False,
                         reduce_cmd=reduce_cmd.reset_reduce, reduce_init=None, reduce_res_negate=False, name=None):
    """``dst = data <op0> operand0`` on the Vector Engine and ``reduce_res`` its reduction over every free axis
    by ``reduce_op`` (add, multiply, max or min), negated under ``reduce_res_negate``; a fresh reduction
    (``reset_reduce``) only."""
    _tile("dst", dst, "tensor_scalar_reduce"), _tile("data", data, "tensor_scalar_reduce")
    _same_layout(dst, data, "tensor_scalar_reduce", "dst and data")
    if reduce_cmd is not type(reduce_cmd).reset_reduce or reduce_init is not None:
        reject("api-subset", "tensor_scalar_reduce: only reduce_cmd.reset_reduce without reduce_init is emulated")
    if reduce_op not in (nl.add, nl.multiply, nl.maximum, nl.minimum):
        reject("alu-op", f"tensor_scalar_reduce: reduce_op must be nl.add, nl.multiply, nl.maximum or nl.minimum, "
               f"not {_op_name(reduce_op)}")
    if reduce_res is None:
        reject("api-subset", "tensor_scalar_reduce: the emulator needs reduce_res (the reduction's destination)")
    _tile("reduce_res", reduce_res, "tensor_scalar_reduce")
    if reduce_res.shape[0] != data.shape[0] or reduce_res.free_size != 1:
        reject("operand-shape",
               f"tensor_scalar_reduce: reduce_res must be ({data.shape[0]}, 1); got {reduce_res.shape}")
    a = _vector_operand(operand0, data, "tensor_scalar_reduce", "operand0", float32_only=True)
    _alu(op0, "tensor_scalar_reduce")
    p = data.shape[0]
    result = {}

    def value():
        result["x"] = _binary(op0, data.read(), a, reverse0, "tensor_scalar_reduce").expand(data.shape)
        return result["x"].reshape(dst.shape)

    def reduced():
        flat = result["x"].reshape(p, -1)
        total = flat.prod(1, keepdim=True) if reduce_op is nl.multiply else nl.REDUCE[reduce_op](flat, [1])
        return ((-1 if reduce_res_negate else 1) * total).reshape(reduce_res.shape)

    dst.assign(value)
    reduce_res.assign(reduced)
    # its reference page's cost, max(MIN_II, N) + MIN_II Vector cycles, as one streaming instruction
    trace.record("vector", "stream", max(cost.MIN_II, data.free_size) + cost.MIN_II,
                reads=(data, operand0), writes=(dst, reduce_res))


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None):
    """``(data <op0> operand0) <op1> operand1``, Vector Engine: ``operand0`` a scalar or ``[P, 1]``
    vector, ``operand1`` a tile shaped like ``data``."""
    for label, t in (("dst", dst), ("data", data), ("operand1", operand1)):
        _tile(label, t, "scalar_tensor_tensor")
    _same_layout(dst, data, "scalar_tensor_tensor", "dst and data")
    _same_layout(operand1, data, "scalar_tensor_tensor", "operand1 and data")
    if data.buffer is psum and operand1.buffer is psum:
        reject("psum-operands", "scalar_tensor_tensor: data and operand1 cannot both be in PSUM")
    a = _vector_operand(operand0, data, "scalar_tensor_tensor", "operand0")
    _alu(op0, "scalar_tensor_tensor"), _alu(op1, "scalar_tensor_tensor")

    def value():
        tmp = _binary(op0, data.read(), a, reverse0, "scalar_tensor_tensor")
        return _binary(op1, tmp, operand1.read().reshape(data.shape), reverse1,
                       "scalar_tensor_tensor").reshape(dst.shape)

    dst.assign(value)
    trace.record("vector", "stream2", data.free_size, inputs=2, reads=(data, operand0, operand1), writes=(dst,))


def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=reduce_cmd.idle,
               name=None):
    """``op(data * scale + bias)`` on the Scalar Engine; with a reduce command, the free-axis sum of
    the result goes into the engine's per-lane ``reduce_regs`` (reset, reduce onto, or reset then
    reduce), and ``reduce_res`` (a ``[P, 1]`` tile) reads the registers out."""
    _tile("dst", dst, "activation"), _tile("data", data, "activation")
    _same_layout(dst, data, "activation", "dst and data")
    if op not in nl.ACTIVATION:
        reject("activation-op", f"activation: {_op_name(op)} is not an activation function here")
    s = _vector_operand(scale, data, "activation", "scale", float32_only=True)
    b = _vector_operand(bias, data, "activation", "bias")
    p = data.shape[0]
    cmd = reduce_cmd
    if cmd is not type(cmd).idle and reduce_op is not nl.add:
        reject("activation-reduce",
               "activation: reduce_op must be nl.add (the Scalar Engine reduce registers can only sum)")
    if cmd is type(cmd).load_reduce:
        reject("api-subset", "activation: reduce_cmd.load_reduce is outside the emulated subset")
    if reduce_res is not None:
        _tile("reduce_res", reduce_res, "activation")
        if reduce_res.shape[0] != p or reduce_res.free_size != 1:
            reject("operand-shape", f"activation: reduce_res must be ({p}, 1); got {reduce_res.shape}")

    def value():
        x = data.read() * s
        x = x if b is None else x + b
        out = _in_domain(op, x, nl.ACTIVATION[op](x))
        regs = _reduce_regs
        if cmd in (type(cmd).reset, type(cmd).reset_reduce):
            regs[:p] = 0
        if cmd in (type(cmd).reduce, type(cmd).reset_reduce):
            regs[:p] += out.reshape(p, -1).sum(1, keepdim=True)
        return out.reshape(dst.shape)

    dst.assign(value)
    registers = (_REDUCE_REGS[core.launch.core],) if cmd is not type(cmd).idle else ()
    trace.record("scalar", "stream", data.free_size, reads=(data, scale, bias) + registers, writes=(dst,) + registers)
    if reduce_res is not None:
        reduce_res.assign(lambda: _reduce_regs[:p].clone().reshape(reduce_res.shape))
        trace.record("scalar", "accumulator_read", 1, reads=(_REDUCE_REGS[core.launch.core],),  # ActReadAccumulator:
                    writes=(reduce_res,))  # a second instruction


# Valid input ranges of the Scalar Engine's activation functions (nki/api/nki.api.shared.rst, 'Supported
# Activation Functions for NKI ISA', aws-neuron-sdk@81ce03a): outside them "the Scalar Engine will generate
# invalid output results". reciprocal's is +-[2^-42, 2^42]; the functions valid on [-inf, inf] are not listed.
ACTIVATION_DOMAINS = {nl.sqrt: (2.0 ** -116, 2.0 ** 118), nl.rsqrt: (2.0 ** -87, 2.0 ** 97),
                      nl.log: (2.0 ** -64, 2.0 ** 64), nl.reciprocal: (2.0 ** -42, 2.0 ** 42)}
_SIGNED_DOMAINS = {nl.reciprocal}
RSQRT_DOMAIN = ACTIVATION_DOMAINS[nl.rsqrt]


def _in_domain(op, x, out):
    """``out = op(x)`` where ``x`` is in ``op``'s valid range (NaN is in none); elsewhere the kernel is refused,
    or, under ``emulator.domain_policy("poison")``, the result is NaN, standing for the hardware's invalid one."""
    if op not in ACTIVATION_DOMAINS:
        return out
    low, high = ACTIVATION_DOMAINS[op]
    magnitude = x.abs() if op in _SIGNED_DOMAINS else x
    outside = ~((magnitude >= low) & (magnitude <= high))
    if not bool(outside.any()):
        return out
    if core.poisons():
        return out.masked_fill(outside, math.nan)
    sign = "+-" if op in _SIGNED_DOMAINS else ""
    reject("engine-domain", f"activation: {_op_name(op)}'s input {x[outside].flatten()[0].item()!r} is outside the "
           f"Scalar Engine's valid range {sign}[2^{math.log2(low):.0f}, 2^{math.log2(high):.0f}], where it gives "
           "invalid results; bring the input into range first (emulator.domain_policy('poison') writes NaN instead)")


def _check_rsqrt_domain(x):
    _in_domain(nl.rsqrt, x, x)


def reciprocal(dst, data, name=None):
    """``1 / data`` on the Vector Engine (at an eighth of its streaming rate: nki.api.shared,
    'NKI Engine Selection', ``max(MIN_II, 8*N)``)."""
    _tile("dst", dst, "reciprocal"), _tile("data", data, "reciprocal")
    _same_layout(dst, data, "reciprocal", "dst and data")
    dst.assign(lambda: (1.0 / data.read()).reshape(dst.shape))
    trace.record("vector", "reciprocal", data.free_size, reads=(data,), writes=(dst,))


def _affine(dst, pattern, offset, channel_multiplier, instr: str):
    """The values ``offset + p * channel_multiplier + sum(i_k * step_k)`` over ``dst``'s partitions ``p`` and
    ``pattern``'s ``[[step, num], ...]`` free axes: ``(low, high, values)``, the extremes and a function computing
    them in float64 (exact for every int32), shaped like ``dst`` (called only when the instruction computes)."""
    p = dst.shape[0]
    steps = [int(s) for s, _ in pattern]
    nums = [int(n) for _, n in pattern]
    if math.prod(nums) != dst.free_size:
        reject("operand-shape", f"{instr}: pattern {pattern} covers {math.prod(nums)} elements per partition; "
               f"the tile has {dst.free_size}")
    ends = [(p - 1) * channel_multiplier] + [(n - 1) * s for s, n in zip(steps, nums)]

    def values():
        affine = torch.full((p, *nums), float(offset), dtype=torch.float64)
        affine += (torch.arange(p, dtype=torch.float64) * channel_multiplier).reshape(p, *([1] * len(nums)))
        for axis, (s, n) in enumerate(zip(steps, nums)):
            shape = [1] * (len(nums) + 1)
            shape[axis + 1] = n
            affine += (torch.arange(n, dtype=torch.float64) * s).reshape(shape)
        return affine.reshape(dst.shape)

    return offset + sum(min(0, e) for e in ends), offset + sum(max(0, e) for e in ends), values


def affine_select(dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op=nl.equal, offset=0,
                  name=None):
    """GpSimd Engine: ``dst = on_true_tile`` where ``cmp_op(offset + p * channel_multiplier +
    sum(i_k * step_k), 0)``, else ``on_false_value``; both tiles in SBUF."""
    _tile("dst", dst, "affine_select"), _tile("on_true_tile", on_true_tile, "affine_select")
    _gpsimd_psum("affine_select", dst, on_true_tile)
    _same_layout(dst, on_true_tile, "affine_select", "dst and on_true_tile")
    _, _, affine = _affine(dst, pattern, offset, channel_multiplier, "affine_select")
    cmp = _alu(cmp_op, "affine_select")

    def value():
        keep = cmp(affine(), 0.0) != 0
        return torch.where(keep, on_true_tile.read().reshape(dst.shape), torch.tensor(float(on_false_value)))

    dst.assign(value)
    trace.record("gpsimd", "stream", dst.free_size, reads=(on_true_tile,), writes=(dst,))


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    """GpSimd Engine: ``dst = offset + p * channel_multiplier + sum(i_k * step_k)`` (the partition ``p``, the free
    indices ``i_k`` of ``pattern``'s ``[[step, num], ...]``), computed in int32 and converted to dst's dtype; ``dst``
    in SBUF."""
    _tile("dst", dst, "iota")
    if dst.buffer is not sbuf:
        reject("iota-memory", "iota writes its pattern to SBUF")
    low, high, affine = _affine(dst, pattern, offset, channel_multiplier, "iota")
    if low < -2 ** 31 or high >= 2 ** 31:
        reject("iota-range", f"iota: the pattern's values span [{low}, {high}]; they are computed in int32")
    dst.assign(affine)
    trace.record("gpsimd", "stream", dst.free_size, writes=(dst,))


# ----------------------------------------------------------------------------- reductions
def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    """Reduce the last free axes of ``data`` with ``op``, Vector Engine."""
    _tile("dst", dst, "tensor_reduce"), _tile("data", data, "tensor_reduce")
    axes = sorted([axis] if isinstance(axis, int) else list(axis))
    if 0 in axes:
        reject("reduce-axis", "tensor_reduce: axis 0 is the partition axis and cannot be reduced here "
               "(use nisa.tensor_partition_reduce or a matmul)")
    if axes != list(range(data.ndim - len(axes), data.ndim)):
        reject("reduce-axis",
               f"tensor_reduce: axes {axes} must be the last contiguous free axes of a rank-{data.ndim} tile")
    if op not in nl.REDUCE:
        reject("alu-op", f"tensor_reduce: {_op_name(op)} is not a reduction operator here")
    kept = math.prod(data.shape[1:data.ndim - len(axes)])
    if dst.shape[0] != data.shape[0] or dst.free_size != kept:
        reject("tile-shape", f"tensor_reduce: dst {dst.shape} does not hold the reduction of {data.shape} over {axes}")
    dst.assign(lambda: ((-1 if negate else 1) * nl.REDUCE[op](data.read(), axes)).reshape(dst.shape))
    trace.record("vector", "stream", data.free_size, reads=(data,), writes=(dst,))


def tensor_partition_reduce(dst, op, data, name=None):
    """Reduce across partitions with ``op`` (add, max, ...), GpSimd Engine: ``dst`` is ``[1, ...]``."""
    _tile("dst", dst, "tensor_partition_reduce"), _tile("data", data, "tensor_partition_reduce")
    _gpsimd_psum("tensor_partition_reduce", dst, data)
    if op not in nl.REDUCE:
        reject("alu-op", f"tensor_partition_reduce: {_op_name(op)} is not a reduction operator here")
    if dst.shape[0] != 1 or dst.free_size != data.free_size:
        reject("tile-shape", f"tensor_partition_reduce: dst must be (1, {data.free_size}); got {dst.shape}")
    # the partitions, seen as a free axis
    dst.assign(lambda: nl.REDUCE[op](data.read().reshape(data.shape[0], -1).T, [1]).T.reshape(dst.shape))
    trace.record("gpsimd", "stream", data.free_size, reads=(data,), writes=(dst,))


# ----------------------------------------------------------------------------- Tensor Engine
def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False,
              accumulate=None, tile_position=(), tile_size=(), perf_mode=matmul_perf_mode.none, name=None):
    """``dst = stationary.T @ moving`` into PSUM with fp32 accumulation: ``accumulate=False``
    overwrites, ``True`` adds onto a location a matmul initialised, ``None`` overwrites on the
    first write and accumulates after. Limits: contraction partitions <= 128, stationary free
    <= 128, moving free <= 512 (NeuronCore-v2/v3; nl.tile_size.gemm_*_fmax)."""
    tgt = core.target()
    for label, t in (("stationary", stationary), ("moving", moving), ("dst", dst)):
        _tile(label, t, "nc_matmul")
    if stationary.buffer is not sbuf or moving.buffer is not sbuf:
        reject("matmul-memory", "nc_matmul reads stationary and moving from SBUF")
    if dst.buffer is not psum:
        reject("matmul-memory", "nc_matmul writes its result to PSUM")
    if stationary.ndim != 2 or moving.ndim != 2 or dst.ndim != 2 or tile_position or tile_size or is_transpose \
            or perf_mode is not matmul_perf_mode.none:
        reject("api-subset", "the emulator takes 2-D nc_matmul operands without tiling, transpose or perf modes")
    k, m = stationary.shape
    k2, n = moving.shape
    if k != k2:
        reject("matmul-contraction", f"nc_matmul: stationary {stationary.shape} and moving {moving.shape} must have "
               "the same partition (contraction) size")
    if k > tgt.pmax:
        reject("matmul-contraction", f"nc_matmul: contraction over {k} partitions > {tgt.pmax}")
    if m > tgt.gemm_stationary_fmax:
        reject("matmul-stationary-fmax", f"nc_matmul: stationary free size {m} > gemm_stationary_fmax "
               f"{tgt.gemm_stationary_fmax}")
    if n > tgt.gemm_moving_fmax:
        reject("matmul-moving-fmax", f"nc_matmul: moving free size {n} > gemm_moving_fmax {tgt.gemm_moving_fmax}")
    if dst.shape != (m, n):
        reject("tile-shape", f"nc_matmul: dst must be ({m}, {n}); got {dst.shape}")
    names = {stationary.dtype.name, moving.dtype.name}
    if not names <= _FLOAT_MATMUL:
        reject("matmul-dtype",
               f"nc_matmul: inputs are {sorted(names)}; the Tensor Engine takes fp8/bf16/fp16/tf32/fp32")
    wide = names & {"float32", "tfloat32"}
    if wide and not names <= {"float32", "tfloat32"}:
        reject("matmul-dtype", "nc_matmul: if one input is tfloat32/float32 the other must be too")
    if dst.dtype.name not in tgt.matmul_psum_dtypes:
        reject("matmul-dtype", f"nc_matmul writes {' or '.join(tgt.matmul_psum_dtypes)} to PSUM on {tgt.name}; dst is "
               f"{dst.dtype} (bf16 output is NeuronCore-v4's: trainium3_arch.rst)")
    previous = dst.root.last_writer
    if accumulate is None:
        accumulate = previous == "matmul"
    elif accumulate and previous != "matmul":
        reject("psum-accumulate", "nc_matmul(accumulate=True) onto a PSUM location no matmul initialised is undefined "
               f"behaviour (last written by: {previous or 'nothing'}); start with accumulate=False")
    dst.assign(lambda: stationary.read().T @ moving.read() + (dst.read() if accumulate else 0))
    dst.root.last_writer = "matmul"
    trace.record("tensor", "matmul_fp32" if wide else "matmul", n, flops=2 * k * m * n, reads=(stationary, moving),
                writes=(dst,), stationary=stationary)  # accumulating onto dst is PSUM's, not a read


def nc_transpose(dst, data, engine=engine.unknown, name=None):
    """Swap the partition and free axes of a 2-D tile: on the Tensor Engine (the default here)
    ``data`` [<=128, <=128] in SBUF -> ``dst`` in PSUM; on the Vector Engine up to 32x32. ``dst``
    has ``data``'s dtype ('The output dst tile must have the same data type as that of data')."""
    _tile("dst", dst, "nc_transpose"), _tile("data", data, "nc_transpose")
    eng = _engine_name(engine, "tensor", ("tensor", "vector"), "nc_transpose")
    if data.ndim != 2 or dst.ndim != 2:
        reject("api-subset", "the emulator takes 2-D nc_transpose operands only")
    p, f = data.shape
    limit = 128 if eng == "tensor" else 32
    if p > limit or f > limit:
        reject("transpose-shape", f"nc_transpose on the {eng} engine takes at most {limit}x{limit}; got {data.shape}")
    if dst.shape != (f, p):
        reject("tile-shape", f"nc_transpose: dst must be ({f}, {p}); got {dst.shape}")
    if dst.dtype != data.dtype:
        reject("transpose-dtype", f"nc_transpose: dst must have data's dtype {data.dtype}; got {dst.dtype}")
    if eng == "tensor" and (data.buffer is not sbuf or dst.buffer is not psum):
        reject("matmul-memory", "nc_transpose on the Tensor Engine reads SBUF and writes PSUM")
    dst.assign(lambda: data.data.T)
    if eng == "tensor":  # a matmul against an identity: the moving free size is data's partition count
        trace.record("tensor", "transpose_fp32" if data.dtype.itemsize == 4 else "transpose", p, reads=(data,),
                    writes=(dst,), stationary=data)
    else:
        trace.record("vector", "stream", f, reads=(data,), writes=(dst,))
