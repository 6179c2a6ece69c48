"""Emulated ``nki.language`` (``import nki.language as nl``): the subset this project's kernels use.

Every public function here has the signature of its namesake in AWS's API reference
(``backends/nki/aws_signatures.py``, checked by tests/test_nki_api.py). Operators (``nl.add``,
``nl.exp``, ...) are functions, as in NKI; the kernels pass them as ``op=`` to ``nki.isa``
instructions, which look their semantics up in :data:`ALU`, :data:`ACTIVATION` and :data:`REDUCE`.
Calling one on tiles directly (NKI's high-level API) is outside the emulated subset.

Docs: aws-neuron/aws-neuron-sdk ``nki/api/nki.language.rst`` and ``nki/api/nki.api.shared.rst``
(supported math operators, activation functions, data types).
"""

from __future__ import annotations

import torch

from . import allocation, core, trace
from .core import (DType, EmulatorError, bfloat16, float16, float32, hbm, int8, int16, int32,  # noqa: F401
                   private_hbm, psum, sbuf, shared_hbm, tfloat32, uint8, uint16, uint32)
from .tensors import Tensor

NkiTensor = Tensor


# ----------------------------------------------------------------------------- constants
class _TileSize:
    """nl.tile_size: https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/nki.language.tile_size.html"""

    @property
    def pmax(self):
        return core.target().pmax

    @property
    def psum_bank_fmax(self):
        return core.target().psum_bank_bytes // 4

    psum_fmax = psum_bank_fmax

    @property
    def psum_bank_fmax_bytes(self):
        return core.target().psum_bank_bytes

    @property
    def psum_num_banks(self):
        return core.target().psum_num_banks

    @property
    def sbuf_size_bytes(self):
        return core.target().sbuf_partition_bytes * core.target().pmax

    @property
    def sbuf_fmax_bytes(self):
        return core.target().sbuf_partition_bytes

    @property
    def sbuf_fmax(self):
        return core.target().sbuf_partition_bytes // 4

    @property
    def gemm_stationary_fmax(self):
        return core.target().gemm_stationary_fmax

    @property
    def gemm_moving_fmax(self):
        return core.target().gemm_moving_fmax


tile_size = _TileSize()


# ----------------------------------------------------------------------------- operators
def _outside_subset(name):
    raise EmulatorError("api-subset", f"nl.{name}(...) as a tile-level call is outside the emulated subset; "
                        "pass it as op= to an nki.isa instruction")


def add(x, y, dtype=None):
    _outside_subset("add")


def subtract(x, y, dtype=None):
    _outside_subset("subtract")


def multiply(x, y, dtype=None):
    _outside_subset("multiply")


def maximum(x, y, dtype=None):
    _outside_subset("maximum")


def minimum(x, y, dtype=None):
    _outside_subset("minimum")


def equal(x, y, dtype=None):
    _outside_subset("equal")


def not_equal(x, y, dtype=None):
    _outside_subset("not_equal")


def greater(x, y, dtype=None):
    _outside_subset("greater")


def greater_equal(x, y, dtype=None):
    _outside_subset("greater_equal")


def less(x, y, dtype=None):
    _outside_subset("less")


def less_equal(x, y, dtype=None):
    _outside_subset("less_equal")


def copy(x, dtype=None):
    _outside_subset("copy")


def exp(x, dtype=None):
    _outside_subset("exp")


def log(x, dtype=None):
    _outside_subset("log")


def sqrt(x, dtype=None):
    _outside_subset("sqrt")


def rsqrt(x, dtype=None):
    _outside_subset("rsqrt")


def square(x, dtype=None):
    _outside_subset("square")


def abs(x, dtype=None):  # noqa: A001
    _outside_subset("abs")


def reciprocal(x, dtype=None):
    _outside_subset("reciprocal")


def tanh(x, dtype=None):
    _outside_subset("tanh")


def _maximum(a, b):
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return torch.fmax(a, b) if core.nan_drops() else torch.maximum(a, b)


def _minimum(a, b):
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return torch.fmin(a, b) if core.nan_drops() else torch.minimum(a, b)


def _flag(cmp):
    return lambda a, b: torch.as_tensor(cmp(torch.as_tensor(a), torch.as_tensor(b))).to(torch.float32)


# Binary arithmetic operators of the ALU ("Supported Math Operators for NKI ISA"); comparisons
# give 1.0 / 0.0 in float32. nl.divide is not an ALU operator there, so it is not here.
ALU = {add: torch.add, subtract: torch.sub, multiply: torch.mul, maximum: _maximum, minimum: _minimum,
       equal: _flag(torch.eq), not_equal: _flag(torch.ne), greater: _flag(torch.gt),
       greater_equal: _flag(torch.ge), less: _flag(torch.lt), less_equal: _flag(torch.le)}
# Unary ALU operators (tensor_scalar with operand0 unused); reciprocal runs at 1/8 rate on VectorE.
ALU_UNARY = {abs: torch.abs, square: torch.square, rsqrt: torch.rsqrt, reciprocal: torch.reciprocal}
# Scalar Engine activation functions (the engine approximates them; the emulator computes exactly).
ACTIVATION = {copy: lambda x: x, exp: torch.exp, log: torch.log, sqrt: torch.sqrt, rsqrt: torch.rsqrt,
              square: torch.square, abs: torch.abs, reciprocal: torch.reciprocal, tanh: torch.tanh}


def _reduce_max(x, dims):
    if core.nan_drops():
        x = torch.where(x.isnan(), float("-inf"), x)
    return x.amax(dims, keepdim=True)


def _reduce_min(x, dims):
    if core.nan_drops():
        x = torch.where(x.isnan(), float("inf"), x)
    return x.amin(dims, keepdim=True)


REDUCE = {add: lambda x, dims: x.sum(dims, keepdim=True), maximum: _reduce_max, minimum: _reduce_min}


# ----------------------------------------------------------------------------- creation
def ndarray(shape, dtype, buffer=sbuf, name='', address=None) -> Tensor:
    """nl.ndarray: a new tensor; on chip the first axis is the partition axis."""
    if address is not None:
        core.reject("api-subset", "nl.ndarray(address=...) (manual allocation) is outside the emulated subset")
    return allocation.allocate(shape, dtype, buffer)


def zeros(shape, dtype, buffer=sbuf, name='') -> Tensor:
    """nl.zeros: a new tensor filled with zeros (on chip, a memset instruction)."""
    tensor = allocation.allocate(shape, dtype, buffer)
    tensor.assign(lambda: torch.zeros(()))
    if tensor.buffer.on_chip:
        trace.record("vector" if tensor.buffer is psum else "gpsimd", "stream", tensor.free_size,  # a memset
                    writes=(tensor,))
    return tensor


# ----------------------------------------------------------------------------- iterators
def _range(start, stop, step):
    if stop is None:
        start, stop = 0, start
    for i in range(start, stop, step):
        with allocation.memory.scope():  # tiles declared in an iteration live for that iteration
            yield i


def affine_range(start, stop=None, step=1):
    """Iterations with no loop-carried dependency (the compiler may reorder / pipeline them)."""
    return _range(start, stop, step)


def sequential_range(start, stop=None, step=1):
    """Iterations that run in order: loop-carried dependencies (running max, accumulators) are allowed."""
    return _range(start, stop, step)


def static_range(start, stop=None, step=1):
    return _range(start, stop, step)


def program_id(axis=0):
    """The index of the core running this program, in a ``kernel[cores]`` launch (0 without one)."""
    _grid_axis(axis)
    return core.program()[0]


def num_programs(axes=0):
    """How many cores the kernel was launched on (``kernel[cores]``; 1 without brackets)."""
    _grid_axis(axes)
    return core.program()[1]


def _grid_axis(axis):
    if axis != 0:
        core.reject("lnc-grid", f"the launch grid has one axis (kernel[cores]), not axis {axis!r}")
