"""Emulated ``nki.isa`` element-wise instructions: tensor-tensor and tensor-scalar arithmetic (with its free-axis
reduction), the Scalar Engine's activation functions with their reduce registers and valid input ranges, and the
Vector Engine's reciprocal.
"""

from __future__ import annotations

import math

import torch

from .. import core, cost, trace
from .. import language as nl
from ..core import psum, reject, sbuf
from ..tensors import Tensor
from .enums import engine, reduce_cmd
from .operands import (SIXTEEN_BIT, alu, binary, engine_name, gpsimd_psum, one_input_cost, op_name, packed16,
                       same_layout, tile, vector_operand)

# Scalar Engine reduce registers: one fp32 per compute lane (nki.isa.activation: reduce_regs).
_reduce_regs = torch.zeros(128, 1)


def _registers(core_index: int) -> Tensor:
    """The reduce registers of one core of a launch as a tile, so the cost model sees what waits on them."""
    registers = Tensor(torch.zeros(128, 1), core.float32, sbuf)
    registers.buffer_id = -1 - core_index
    return registers


_REDUCE_REGS = (_registers(0), _registers(1))


def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    """``dst = data1 <op> data2`` element-wise, Vector or GpSimd Engine."""
    for label, t in (("dst", dst), ("data1", data1), ("data2", data2)):
        tile(label, t, "tensor_tensor")
    same_layout(data1, data2, "tensor_tensor", "data1 and data2")
    same_layout(dst, data1, "tensor_tensor", "dst and data1")
    if data1.buffer is psum and data2.buffer is psum:
        reject("psum-operands", "tensor_tensor: data1 and data2 cannot both be in PSUM")
    eng = engine_name(engine, "vector", ("vector", "gpsimd"), "tensor_tensor")
    if eng == "gpsimd":
        gpsimd_psum("tensor_tensor on gpsimd", dst, data1, data2)
    fn = alu(op, "tensor_tensor")
    dst.assign(lambda: fn(data1.read(), data2.read().reshape(data1.shape)).reshape(dst.shape))
    perf = eng == "vector" and packed16(data1, data2) and dst.dtype.name in SIXTEEN_BIT
    trace.record(eng, "stream" if perf else "stream2", data1.free_size, inputs=2, reads=(data1, data2),
                writes=(dst,))


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=engine.unknown, name=None):
    """``(data <op0> operand0) <op1> operand1``, operands scalars or float32 ``[P, 1]`` vectors;
    a unary op0 (abs, square, rsqrt, reciprocal) takes operand0 ``None`` or ``0``."""
    tile("dst", dst, "tensor_scalar"), tile("data", data, "tensor_scalar")
    same_layout(dst, data, "tensor_scalar", "dst and data")
    if (op1 is None) != (operand1 is None):
        reject("operand-shape", "tensor_scalar: op1 and operand1 must both be given or both be None")
    eng = engine_name(engine, "vector", ("vector", "scalar", "gpsimd"), "tensor_scalar")
    if eng == "gpsimd":
        gpsimd_psum("tensor_scalar on gpsimd", dst, data)
    if op0 in nl.ALU_UNARY:
        if operand0 not in (None, 0, 0.0):
            reject("operand-shape", f"tensor_scalar: operand0 must be None or 0 with the unary {op_name(op0)}")
    else:
        a = vector_operand(operand0, data, "tensor_scalar", "operand0", float32_only=True)
        alu(op0, "tensor_scalar")
    if op1 is not None:
        b = vector_operand(operand1, data, "tensor_scalar", "operand1", float32_only=True)
        alu(op1, "tensor_scalar")

    def value():
        x = data.read()
        x = nl.ALU_UNARY[op0](x) if op0 in nl.ALU_UNARY else binary(op0, x, a, reverse0, "tensor_scalar")
        if op1 is not None:
            x = binary(op1, x, b, reverse1, "tensor_scalar")
        return torch.as_tensor(x).expand(data.shape).reshape(dst.shape)

    dst.assign(value)
    trace.record(eng, one_input_cost(eng, dst, data), data.free_size,
                reads=(data, operand0, operand1), writes=(dst,))


def tensor_scalar_reduce(dst, data, op0, operand0, reduce_op, reduce_res=None, reverse0=False,
                         reduce_cmd=reduce_cmd.reset_reduce, reduce_init=None, reduce_res_negate=False, name=None):
    """``dst = data <op0> operand0`` on the Vector Engine and ``reduce_res`` its reduction over every free axis
    by ``reduce_op`` (add, multiply, max or min), negated under ``reduce_res_negate``; a fresh reduction
    (``reset_reduce``) only."""
    tile("dst", dst, "tensor_scalar_reduce"), tile("data", data, "tensor_scalar_reduce")
    same_layout(dst, data, "tensor_scalar_reduce", "dst and data")
    if reduce_cmd is not type(reduce_cmd).reset_reduce or reduce_init is not None:
        reject("api-subset", "tensor_scalar_reduce: only reduce_cmd.reset_reduce without reduce_init is emulated")
    if reduce_op not in (nl.add, nl.multiply, nl.maximum, nl.minimum):
        reject("alu-op", f"tensor_scalar_reduce: reduce_op must be nl.add, nl.multiply, nl.maximum or nl.minimum, "
               f"not {op_name(reduce_op)}")
    if reduce_res is None:
        reject("api-subset", "tensor_scalar_reduce: the emulator needs reduce_res (the reduction's destination)")
    tile("reduce_res", reduce_res, "tensor_scalar_reduce")
    if reduce_res.shape[0] != data.shape[0] or reduce_res.free_size != 1:
        reject("operand-shape",
               f"tensor_scalar_reduce: reduce_res must be ({data.shape[0]}, 1); got {reduce_res.shape}")
    a = vector_operand(operand0, data, "tensor_scalar_reduce", "operand0", float32_only=True)
    alu(op0, "tensor_scalar_reduce")
    p = data.shape[0]
    result = {}

    def value():
        result["x"] = binary(op0, data.read(), a, reverse0, "tensor_scalar_reduce").expand(data.shape)
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
        tile(label, t, "scalar_tensor_tensor")
    same_layout(dst, data, "scalar_tensor_tensor", "dst and data")
    same_layout(operand1, data, "scalar_tensor_tensor", "operand1 and data")
    if data.buffer is psum and operand1.buffer is psum:
        reject("psum-operands", "scalar_tensor_tensor: data and operand1 cannot both be in PSUM")
    a = vector_operand(operand0, data, "scalar_tensor_tensor", "operand0")
    alu(op0, "scalar_tensor_tensor"), alu(op1, "scalar_tensor_tensor")

    def value():
        tmp = binary(op0, data.read(), a, reverse0, "scalar_tensor_tensor")
        return binary(op1, tmp, operand1.read().reshape(data.shape), reverse1,
                       "scalar_tensor_tensor").reshape(dst.shape)

    dst.assign(value)
    trace.record("vector", "stream2", data.free_size, inputs=2, reads=(data, operand0, operand1), writes=(dst,))


def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=reduce_cmd.idle,
               name=None):
    """``op(data * scale + bias)`` on the Scalar Engine; with a reduce command, the free-axis sum of
    the result goes into the engine's per-lane ``reduce_regs`` (reset, reduce onto, or reset then
    reduce), and ``reduce_res`` (a ``[P, 1]`` tile) reads the registers out."""
    tile("dst", dst, "activation"), tile("data", data, "activation")
    same_layout(dst, data, "activation", "dst and data")
    if op not in nl.ACTIVATION:
        reject("activation-op", f"activation: {op_name(op)} is not an activation function here")
    s = vector_operand(scale, data, "activation", "scale", float32_only=True)
    b = vector_operand(bias, data, "activation", "bias")
    p = data.shape[0]
    cmd = reduce_cmd
    if cmd is not type(cmd).idle and reduce_op is not nl.add:
        reject("activation-reduce",
               "activation: reduce_op must be nl.add (the Scalar Engine reduce registers can only sum)")
    if cmd is type(cmd).load_reduce:
        reject("api-subset", "activation: reduce_cmd.load_reduce is outside the emulated subset")
    if reduce_res is not None:
        tile("reduce_res", reduce_res, "activation")
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
    reject("engine-domain", f"activation: {op_name(op)}'s input {x[outside].flatten()[0].item()!r} is outside the "
           f"Scalar Engine's valid range {sign}[2^{math.log2(low):.0f}, 2^{math.log2(high):.0f}], where it gives "
           "invalid results; bring the input into range first (emulator.domain_policy('poison') writes NaN instead)")


def _check_rsqrt_domain(x):
    _in_domain(nl.rsqrt, x, x)


def reciprocal(dst, data, name=None):
    """``1 / data`` on the Vector Engine (at an eighth of its streaming rate: nki.api.shared,
    'NKI Engine Selection', ``max(MIN_II, 8*N)``)."""
    tile("dst", dst, "reciprocal"), tile("data", data, "reciprocal")
    same_layout(dst, data, "reciprocal", "dst and data")
    dst.assign(lambda: (1.0 / data.read()).reshape(dst.shape))
    trace.record("vector", "reciprocal", data.free_size, reads=(data,), writes=(dst,))
