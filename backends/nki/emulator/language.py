"""Emulated ``nki.language`` (``import nki.language as nl``): the subset this project's kernels use.

Docs: https://awsdocs-neuron.readthedocs-hosted.com/general/nki/api/index.html (nki.language:
creation operations, iterators, memory hierarchy, data types, constants).
"""

from __future__ import annotations

import math

import torch

from . import core
from .core import (DType, EmulatorError, Tensor, bfloat16, float16, float32, hbm, int8, int32,  # noqa: F401
                   private_hbm, psum, sbuf, shared_hbm, tfloat32, uint8, uint16, uint32)

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
class Op:
    """An ALU / activation operator, passed to nki.isa instructions (nl.add, nl.exp, ...)."""

    def __init__(self, name, fn, kind):
        self.name, self.fn, self.kind = name, fn, kind  # kind: "binary", "unary", "compare"

    def __call__(self, *args, **kwargs):
        raise EmulatorError("api-subset", f"nl.{self.name}(...) as a tile-level call is outside the emulated subset; "
                            "use it as an op= of an nki.isa instruction")

    def __repr__(self):
        return f"nl.{self.name}"


def _f(x):
    return x.to(torch.float32) if isinstance(x, torch.Tensor) else x


add = Op("add", lambda a, b: a + b, "binary")
subtract = Op("subtract", lambda a, b: a - b, "binary")
multiply = Op("multiply", lambda a, b: a * b, "binary")
divide = Op("divide", lambda a, b: a / b, "binary")
maximum = Op("maximum", lambda a, b: torch.maximum(torch.as_tensor(a), torch.as_tensor(b)), "binary")
minimum = Op("minimum", lambda a, b: torch.minimum(torch.as_tensor(a), torch.as_tensor(b)), "binary")
max = maximum  # noqa: A001  (nl.max is the reduction spelling of maximum)
min = minimum  # noqa: A001
greater_equal = Op("greater_equal", lambda a, b: torch.as_tensor(a >= b).to(torch.float32), "compare")
greater = Op("greater", lambda a, b: torch.as_tensor(a > b).to(torch.float32), "compare")
less_equal = Op("less_equal", lambda a, b: torch.as_tensor(a <= b).to(torch.float32), "compare")
less = Op("less", lambda a, b: torch.as_tensor(a < b).to(torch.float32), "compare")
equal = Op("equal", lambda a, b: torch.as_tensor(a == b).to(torch.float32), "compare")
not_equal = Op("not_equal", lambda a, b: torch.as_tensor(a != b).to(torch.float32), "compare")

# Activation functions (Scalar Engine): "Supported Activation Functions for NKI ISA".
exp = Op("exp", torch.exp, "unary")
log = Op("log", torch.log, "unary")
sqrt = Op("sqrt", torch.sqrt, "unary")
rsqrt = Op("rsqrt", torch.rsqrt, "unary")
square = Op("square", torch.square, "unary")
abs = Op("abs", torch.abs, "unary")  # noqa: A001
copy = Op("copy", lambda x: x, "unary")
identity = copy

REDUCE = {"add": lambda x, dims: x.sum(dims, keepdim=True),
          "maximum": lambda x, dims: x.amax(dims, keepdim=True),
          "minimum": lambda x, dims: x.amin(dims, keepdim=True),
          "multiply": lambda x, dims: x.prod(dims[0], keepdim=True) if len(dims) == 1 else x.flatten(1).prod(1, keepdim=True)}


# ----------------------------------------------------------------------------- creation
def ndarray(shape, dtype, buffer=None, name=None) -> Tensor:
    """nl.ndarray(shape, dtype, buffer): a new tensor; on chip the first axis is the partition axis."""
    return core.allocate(shape, dtype, buffer)


def zeros(shape, dtype, buffer=None, name=None) -> Tensor:
    tensor = core.allocate(shape, dtype, buffer)
    tensor.data.zero_()
    if tensor.buffer.on_chip:
        core.record("gpsimd", tensor.free_size)  # a memset instruction
    return tensor


def par_dim(n):
    raise EmulatorError("block-dimension", "nl.par_dim / block dimensions were removed from NKI; the partition "
                        "axis is the first axis (NKI Block Dimension Migration Guide)")


# ----------------------------------------------------------------------------- iterators
def _range(*args):
    for i in range(*args):
        with core.memory.scope():  # tiles declared in an iteration live for that iteration
            yield i


def affine_range(*args, **kwargs):
    """Iterations with no loop-carried dependency (the compiler may reorder / pipeline them)."""
    return _range(*args)


def sequential_range(*args, **kwargs):
    """Iterations that run in order: loop-carried dependencies (running max, accumulators) are allowed."""
    return _range(*args)


def static_range(*args, **kwargs):
    return _range(*args)


def program_id(axis=0):
    return 0


def num_programs(axis=0):
    return 1


inf = math.inf
