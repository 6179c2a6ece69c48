"""Emulated ``nki.isa`` (``import nki.isa as nisa``): the instructions this project's kernels use.

Each instruction checks the operand rules its doc page states, then computes in float32 (as the
engines do) and writes ``dst`` with one rounding to its dtype. Docs, NKI 0.7 / SDK 2.33, under
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/ unless noted.
"""

from __future__ import annotations

import enum
import math

import torch

from . import core
from . import language as nl
from .core import EmulatorError, Tensor, psum, reject, sbuf


class engine(enum.Enum):  # noqa: N801  (nki.isa.engine)
    unknown = 0
    tensor = 1
    vector = 2
    scalar = 3
    gpsimd = 4
    sync = 5


class reduce_cmd(enum.Enum):  # noqa: N801  (nki.isa.reduce_cmd)
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3


class oob_mode(enum.Enum):  # noqa: N801
    error = 0
    skip = 1


class dge_mode(enum.Enum):  # noqa: N801
    unknown = 0
    none = 1
    swdge = 2
    hwdge = 3


tensor_engine, vector_engine, scalar_engine, gpsimd_engine = engine.tensor, engine.vector, engine.scalar, engine.gpsimd
unknown_engine = engine.unknown

_ENGINE_NAME = {engine.tensor: "tensor", engine.vector: "vector", engine.scalar: "scalar", engine.gpsimd: "gpsimd",
                engine.unknown: "vector", engine.sync: "sync"}
_FLOAT_MATMUL = {"float32", "tfloat32", "bfloat16", "float16"}  # fp8 types are not emulated

# Scalar Engine reduce registers, one fp32 per partition (nki.isa.activation: reduce_regs).
_reduce_regs = torch.zeros(128, 1)


# ----------------------------------------------------------------------------- operand checks
def _tile(name: str, t, instr: str) -> Tensor:
    if not isinstance(t, Tensor):
        reject("operand-type", f"{instr}: {name} must be an NKI tensor, got {type(t).__name__}")
    if not t.buffer.on_chip:
        reject("engine-memory", f"{instr}: {name} is in {t.buffer.name}; compute engines read and write SBUF/PSUM "
               "only (move HBM data with nisa.dma_copy)")
    if t.shape[0] > core.target().pmax:
        reject("partition-dim", f"{instr}: {name} spans {t.shape[0]} partitions > {core.target().pmax}")
    return t


def _same_layout(a: Tensor, b: Tensor, instr: str, what: str):
    if a.shape[0] != b.shape[0] or a.free_size != b.free_size:
        reject("tile-shape", f"{instr}: {what} must have the same partitions and elements per partition; "
               f"got {a.shape} and {b.shape}")


def _vector_operand(x, data: Tensor, instr: str, name: str):
    """A compile-time scalar or a [P, 1] tile broadcast along the free axis."""
    if x is None or isinstance(x, (int, float)):
        return x
    _tile(name, x, instr)
    if x.shape[0] != data.shape[0] or x.free_size != 1:
        reject("operand-shape", f"{instr}: {name} must be a scalar or a tile of shape ({data.shape[0]}, 1); "
               f"got {x.shape}")
    return x.read().reshape(data.shape[0], *([1] * (data.ndim - 1)))


def _no_gpsimd_psum(instr: str, *tiles):
    for t in tiles:
        if isinstance(t, Tensor) and t.buffer is psum:
            reject("gpsimd-psum", f"{instr} runs on the GpSimd Engine, which cannot access PSUM "
                   "(nki.isa.tensor_copy: 'GpSimd Engine cannot access PSUM'); copy the tile to SBUF first")


def _engine_of(requested, default: str) -> str:
    return default if requested in (None, engine.unknown) else _ENGINE_NAME[requested]


def _binary(op, a, b, reverse=False):
    if not isinstance(op, nl.Op) or op.kind not in ("binary", "compare"):
        reject("alu-op", f"{op!r} is not an arithmetic ALU operator")
    return op.fn(b, a) if reverse else op.fn(a, b)


# ----------------------------------------------------------------------------- data movement
def dma_copy(dst, src, dst_rmw_op=None, oob_mode=None, dge_mode=None, engine=None, name=None):
    """nki.isa.dma_copy -- .../latest/nki/api/generated/nki.isa.dma_copy.html"""
    for label, t in (("dst", dst), ("src", src)):
        if not isinstance(t, Tensor):
            reject("operand-type", f"dma_copy: {label} must be an NKI tensor")
        if t.buffer is psum:
            reject("dma-psum", "dma_copy moves data between HBM and SBUF; DMA engines do not access PSUM "
                   "(evacuate PSUM to SBUF with a compute-engine copy)")
        if t.buffer.on_chip and t.shape[0] > core.target().pmax:
            reject("partition-dim", f"dma_copy: {label} tile spans {t.shape[0]} partitions > {core.target().pmax}")
    if dst.data.numel() != src.data.numel() or (dst.buffer.on_chip and src.buffer.on_chip and dst.shape != src.shape):
        reject("dma-shape", f"dma_copy: dst {dst.shape} and src {src.shape} hold different element counts")
    if dst.dtype != src.dtype:
        reject("dma-dtype", f"dma_copy: src is {src.dtype} and dst is {dst.dtype}; this emulator requires equal "
               "dtypes for DMA (cast on a compute engine: nisa.tensor_copy / activation)")
    value = src.data.reshape(dst.shape)
    if dst_rmw_op is not None:
        if dst_rmw_op is not nl.add:
            reject("dma-rmw", "dma_copy: dst_rmw_op supports nl.add only")
        value = (dst.read() + src.read().reshape(dst.shape))
    dst.write(value)
    nbytes = src.data.numel() * src.dtype.itemsize
    core.record("dma", src.data.numel() // builtin_max(1, src.shape[0] if src.buffer.on_chip else dst.shape[0]),
                dma_bytes=nbytes)


builtin_max = max


def tensor_copy(dst, src, engine=None, name=None):
    """nki.isa.tensor_copy -- .../v2.31.0/nki/api/generated/nki.isa.tensor_copy.html"""
    _tile("dst", dst, "tensor_copy"), _tile("src", src, "tensor_copy")
    _same_layout(dst, src, "tensor_copy", "dst and src")
    eng = _engine_of(engine, "vector")
    if eng == "gpsimd":
        _no_gpsimd_psum("tensor_copy on gpsimd", dst, src)
    dst.write(src.read().reshape(dst.shape))
    core.record(eng, src.free_size)


def memset(dst, value, engine=None, name=None):
    _tile("dst", dst, "memset")
    dst.data.fill_(value)
    core.record(_engine_of(engine, "gpsimd"), dst.free_size)


# ----------------------------------------------------------------------------- elementwise
def tensor_tensor(dst, data1, data2, op, engine=None, name=None):
    """nki.isa.tensor_tensor (Vector or GpSimd Engine) -- .../nki.isa.tensor_tensor.html"""
    for label, t in (("dst", dst), ("data1", data1), ("data2", data2)):
        _tile(label, t, "tensor_tensor")
    _same_layout(data1, data2, "tensor_tensor", "data1 and data2")
    _same_layout(dst, data1, "tensor_tensor", "dst and data1")
    if data1.buffer is psum and data2.buffer is psum:
        reject("psum-operands", "tensor_tensor: data1 and data2 cannot both be in PSUM")
    eng = _engine_of(engine, "vector")
    if eng == "gpsimd":
        _no_gpsimd_psum("tensor_tensor on gpsimd", dst, data1, data2)
    result = _binary(op, data1.read(), data2.read().reshape(data1.shape))
    dst.write(result.reshape(dst.shape))
    core.record(eng, data1.free_size)


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=None, name=None):
    """nki.isa.tensor_scalar: (data <op0> operand0) <op1> operand1 -- .../nki.isa.tensor_scalar.html"""
    _tile("dst", dst, "tensor_scalar"), _tile("data", data, "tensor_scalar")
    _same_layout(dst, data, "tensor_scalar", "dst and data")
    if (op1 is None) != (operand1 is None):
        reject("operand-shape", "tensor_scalar: op1 and operand1 must both be given or both be None")
    a = _vector_operand(operand0, data, "tensor_scalar", "operand0")
    result = _binary(op0, data.read(), a, reverse0)
    if op1 is not None:
        b = _vector_operand(operand1, data, "tensor_scalar", "operand1")
        result = _binary(op1, result, b, reverse1)
    eng = _engine_of(engine, "vector")
    if eng == "gpsimd":
        _no_gpsimd_psum("tensor_scalar on gpsimd", dst, data)
    dst.write(torch.as_tensor(result).expand(data.shape).reshape(dst.shape))
    core.record(eng, data.free_size)


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None, **kw):
    """nki.isa.scalar_tensor_tensor: (data <op0> operand0) <op1> operand1, Vector Engine
    -- .../v2.33.0/nki/api/generated/nki.isa.scalar_tensor_tensor.html"""
    for label, t in (("dst", dst), ("data", data), ("operand1", operand1)):
        _tile(label, t, "scalar_tensor_tensor")
    _same_layout(dst, data, "scalar_tensor_tensor", "dst and data")
    _same_layout(operand1, data, "scalar_tensor_tensor", "operand1 and data")
    if data.buffer is psum and operand1.buffer is psum:
        reject("psum-operands", "scalar_tensor_tensor: data and operand1 cannot both be in PSUM")
    a = _vector_operand(operand0, data, "scalar_tensor_tensor", "operand0")
    tmp = _binary(op0, data.read(), a, reverse0)
    result = _binary(op1, tmp, operand1.read().reshape(data.shape), reverse1)
    dst.write(result.reshape(dst.shape))
    core.record("vector", data.free_size)


def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=reduce_cmd.idle,
               engine=None, name=None):
    """nki.isa.activation: op(data * scale + bias) on the Scalar Engine, optional add-reduction
    -- .../v2.33.0/nki/api/generated/nki.isa.activation.html"""
    global _reduce_regs
    _tile("dst", dst, "activation"), _tile("data", data, "activation")
    _same_layout(dst, data, "activation", "dst and data")
    if not isinstance(op, nl.Op) or op.kind != "unary":
        reject("activation-op", f"activation: {op!r} is not an activation function")
    s = _vector_operand(scale, data, "activation", "scale")
    b = _vector_operand(bias, data, "activation", "bias")
    x = data.read() * s
    if b is not None:
        x = x + b
    out = op.fn(x)
    if reduce_res is not None or reduce_cmd is not reduce_cmd.__class__.idle:
        if reduce_op is not None and reduce_op is not nl.add:
            reject("activation-reduce", "activation: reduce_op must be nl.add (the Scalar Engine reduce registers "
                   "can only sum)")
        p = data.shape[0]
        summed = out.reshape(p, -1).sum(1, keepdim=True)
        cmd = reduce_cmd
        if cmd is reduce_cmd.__class__.reset:
            _reduce_regs[:p] = 0
        elif cmd is reduce_cmd.__class__.reset_reduce:
            _reduce_regs[:p] = summed
        elif cmd is reduce_cmd.__class__.reduce:
            _reduce_regs[:p] += summed
        if reduce_res is not None:
            _tile("reduce_res", reduce_res, "activation")
            if reduce_res.shape[0] != p or reduce_res.free_size != 1:
                reject("operand-shape", f"activation: reduce_res must be ({p}, 1); got {reduce_res.shape}")
            reduce_res.write(_reduce_regs[:p].clone().reshape(reduce_res.shape))
    dst.write(out.reshape(dst.shape))
    core.record("scalar", data.free_size)


def reciprocal(dst, data, engine=None, name=None):
    """nki.isa.reciprocal (listed in https://awsdocs-neuron.readthedocs-hosted.com/en/v2.29.1/_sources/nki/api/nki.isa.rst);
    counted on the Vector Engine."""
    _tile("dst", dst, "reciprocal"), _tile("data", data, "reciprocal")
    _same_layout(dst, data, "reciprocal", "dst and data")
    dst.write((1.0 / data.read()).reshape(dst.shape))
    core.record("vector", data.free_size)


def tensor_copy_predicated(dst, src, predicate, reverse_pred=False, name=None):
    """nki.isa.tensor_copy_predicated: dst = where(predicate, src, dst), Vector Engine
    -- .../v2.33.0/nki/api/generated/nki.isa.tensor_copy_predicated.html"""
    _tile("dst", dst, "tensor_copy_predicated"), _tile("predicate", predicate, "tensor_copy_predicated")
    if predicate.dtype.name not in ("uint8", "uint16", "uint32"):
        reject("predicate-dtype", f"tensor_copy_predicated: predicate must be uint8/uint16/uint32, not {predicate.dtype}")
    _same_layout(dst, predicate, "tensor_copy_predicated", "dst and predicate")
    mask = predicate.data.reshape(dst.shape) != 0
    if reverse_pred:
        if isinstance(src, Tensor):
            reject("operand-type", "tensor_copy_predicated: reverse_pred needs a scalar src")
        mask = ~mask
    if isinstance(src, Tensor):
        _tile("src", src, "tensor_copy_predicated")
        _same_layout(dst, src, "tensor_copy_predicated", "dst and src")
        if src.dtype != dst.dtype:
            reject("copy-dtype", f"tensor_copy_predicated: src ({src.dtype}) and dst ({dst.dtype}) must share a dtype")
        if src.buffer is psum and predicate.buffer is psum:
            reject("psum-operands", "tensor_copy_predicated: src and predicate cannot both be in PSUM")
        value = src.data.reshape(dst.shape)
    else:
        value = torch.full(dst.shape, float(src)).to(dst.data.dtype)
    dst.data.copy_(torch.where(mask, value, dst.data))
    core.record("vector", dst.free_size)


def affine_select(dst, pattern, offset, channel_multiplier, on_true_tile, on_false_value, cmp_op=nl.equal, name=None):
    """nki.isa.affine_select on the GpSimd Engine: predicate = cmp_op(offset + p*channel_multiplier +
    sum(i_k*step_k), 0) -- https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.isa.affine_select.html"""
    _tile("dst", dst, "affine_select"), _tile("on_true_tile", on_true_tile, "affine_select")
    _no_gpsimd_psum("affine_select", dst, on_true_tile)
    _same_layout(dst, on_true_tile, "affine_select", "dst and on_true_tile")
    p = dst.shape[0]
    steps = [int(s) for s, _ in pattern]
    nums = [int(n) for _, n in pattern]
    if math.prod(nums) != dst.free_size:
        reject("operand-shape", f"affine_select: pattern {pattern} covers {math.prod(nums)} elements per partition; "
               f"the tile has {dst.free_size}")
    value = torch.full((p, *nums), float(offset), dtype=torch.float64)
    value += (torch.arange(p, dtype=torch.float64) * channel_multiplier).reshape(p, *([1] * len(nums)))
    for axis, (s, n) in enumerate(zip(steps, nums)):
        shape = [1] * (len(nums) + 1)
        shape[axis + 1] = n
        value += (torch.arange(n, dtype=torch.float64) * s).reshape(shape)
    keep = cmp_op.fn(value, 0.0).reshape(dst.shape) != 0
    result = torch.where(keep, on_true_tile.read().reshape(dst.shape), torch.tensor(float(on_false_value)))
    dst.write(result)
    core.record("gpsimd", dst.free_size)


# ----------------------------------------------------------------------------- reductions
def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    """nki.isa.tensor_reduce over free axes, Vector Engine -- .../v2.31.0/nki/api/generated/nki.isa.tensor_reduce.html"""
    _tile("dst", dst, "tensor_reduce"), _tile("data", data, "tensor_reduce")
    axes = sorted([axis] if isinstance(axis, int) else list(axis))
    if 0 in axes:
        reject("reduce-axis", "tensor_reduce: axis 0 is the partition axis and cannot be reduced here "
               "(use nisa.tensor_partition_reduce or a matmul)")
    if axes != list(range(data.ndim - len(axes), data.ndim)):
        reject("reduce-axis", f"tensor_reduce: axes {axes} must be the last contiguous free axes of a rank-{data.ndim} tile")
    if op.name not in nl.REDUCE:
        reject("alu-op", f"tensor_reduce: {op!r} is not a reduction operator here")
    out = nl.REDUCE[op.name](data.read(), axes)
    if negate:
        out = -out
    if dst.shape[0] != data.shape[0] or dst.free_size != out[0].numel():
        reject("tile-shape", f"tensor_reduce: dst {dst.shape} does not hold the reduction of {data.shape} over {axes}")
    dst.write(out.reshape(dst.shape))
    core.record("vector", data.free_size)


def tensor_partition_reduce(dst, op, data, name=None):
    """nki.isa.tensor_partition_reduce: reduce across partitions, GpSimd Engine
    (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/nki.isa.html)"""
    _tile("dst", dst, "tensor_partition_reduce"), _tile("data", data, "tensor_partition_reduce")
    _no_gpsimd_psum("tensor_partition_reduce", dst, data)
    if op.name not in nl.REDUCE:
        reject("alu-op", f"tensor_partition_reduce: {op!r} is not a reduction operator here")
    x = data.read().reshape(data.shape[0], -1)
    out = {"add": lambda: x.sum(0, keepdim=True), "maximum": lambda: x.amax(0, keepdim=True),
           "minimum": lambda: x.amin(0, keepdim=True), "multiply": lambda: x.prod(0, keepdim=True)}[op.name]()
    if dst.shape[0] != 1 or dst.free_size != data.free_size:
        reject("tile-shape", f"tensor_partition_reduce: dst must be (1, {data.free_size}); got {dst.shape}")
    dst.write(out.reshape(dst.shape))
    core.record("gpsimd", data.free_size)


# ----------------------------------------------------------------------------- Tensor Engine
def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False,
              accumulate=None, tile_position=(), tile_size=(), perf_mode=None, name=None):
    """nki.isa.nc_matmul: dst = stationary.T @ moving into PSUM (fp32 accumulation).
    .../v2.33.0/nki/api/generated/nki.isa.nc_matmul.html; limits (contraction partitions <= 128,
    stationary free <= 128, moving free <= 512) from .../v2.26.1/nki/api/generated/nki.isa.nc_matmul.html
    and nl.tile_size.gemm_stationary_fmax / gemm_moving_fmax."""
    tgt = core.target()
    for label, t in (("stationary", stationary), ("moving", moving), ("dst", dst)):
        _tile(label, t, "nc_matmul")
    if stationary.buffer is not sbuf or moving.buffer is not sbuf:
        reject("matmul-memory", "nc_matmul reads stationary and moving from SBUF")
    if dst.buffer is not psum:
        reject("matmul-memory", "nc_matmul writes its result to PSUM")
    if stationary.ndim != 2 or moving.ndim != 2 or dst.ndim != 2:
        reject("api-subset", "the emulator takes 2-D nc_matmul operands only")
    k, m = stationary.shape
    k2, n = moving.shape
    if k != k2:
        reject("matmul-contraction", f"nc_matmul: stationary {stationary.shape} and moving {moving.shape} must have the "
               "same partition (contraction) size")
    if k > tgt.pmax:
        reject("matmul-contraction", f"nc_matmul: contraction over {k} partitions > {tgt.pmax}")
    if m > tgt.gemm_stationary_fmax:
        reject("matmul-stationary-fmax", f"nc_matmul: stationary free size {m} > gemm_stationary_fmax "
               f"{tgt.gemm_stationary_fmax}")
    if n > tgt.gemm_moving_fmax:
        reject("matmul-moving-fmax", f"nc_matmul: moving free size {n} > gemm_moving_fmax {tgt.gemm_moving_fmax}")
    if dst.shape != (m, n):
        reject("tile-shape", f"nc_matmul: dst must be ({m}, {n}); got {dst.shape}")
    for label, t in (("stationary", stationary), ("moving", moving)):
        if t.dtype.name not in _FLOAT_MATMUL:
            reject("matmul-dtype", f"nc_matmul: {label} is {t.dtype}; the Tensor Engine takes fp8/bf16/fp16/tf32/fp32")
    if dst.dtype.name != "float32":
        reject("matmul-dtype", f"nc_matmul accumulates in fp32; dst is {dst.dtype}")
    result = stationary.read().T @ moving.read()
    if accumulate:
        result = dst.read() + result
    dst.write(result)
    core.record("tensor", n, flops=2 * k * m * n)


def nc_transpose(dst, data, engine=None, name=None):
    """nki.isa.nc_transpose: swap partition and free axes; on the Tensor Engine (default here)
    data [P<=128, F<=128] in SBUF -> dst [F, P] in PSUM (fp32, or the input's 16-bit type in
    NeuronCore-v3 transpose mode; trainium2_arch.rst 'Built-in Transpose Support')."""
    _tile("dst", dst, "nc_transpose"), _tile("data", data, "nc_transpose")
    eng = _engine_of(engine, "tensor")
    if data.ndim != 2 or dst.ndim != 2:
        reject("api-subset", "the emulator takes 2-D nc_transpose operands only")
    p, f = data.shape
    limit = 128 if eng == "tensor" else 32
    if p > limit or f > limit:
        reject("transpose-shape", f"nc_transpose on the {eng} engine takes at most {limit}x{limit}; got {data.shape}")
    if dst.shape != (f, p):
        reject("tile-shape", f"nc_transpose: dst must be ({f}, {p}); got {dst.shape}")
    if eng == "tensor":
        if data.buffer is not sbuf or dst.buffer is not psum:
            reject("matmul-memory", "nc_transpose on the Tensor Engine reads SBUF and writes PSUM")
        if dst.dtype.name not in ("float32", data.dtype.name):
            reject("matmul-dtype", f"nc_transpose: PSUM output is fp32 or {data.dtype}; got {dst.dtype}")
    dst.data.copy_(data.data.T.to(dst.data.dtype))
    core.record(eng, p, flops=0)
