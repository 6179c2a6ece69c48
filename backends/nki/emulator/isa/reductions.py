"""Emulated ``nki.isa`` reductions: along the free axes on the Vector Engine, across partitions on the GpSimd Engine.
"""

from __future__ import annotations

import math

from .. import language as nl
from .. import trace
from ..core import reject
from .operands import gpsimd_psum, op_name, tile


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    """Reduce the last free axes of ``data`` with ``op``, Vector Engine."""
    tile("dst", dst, "tensor_reduce"), tile("data", data, "tensor_reduce")
    axes = sorted([axis] if isinstance(axis, int) else list(axis))
    if 0 in axes:
        reject("reduce-axis", "tensor_reduce: axis 0 is the partition axis and cannot be reduced here "
               "(use nisa.tensor_partition_reduce or a matmul)")
    if axes != list(range(data.ndim - len(axes), data.ndim)):
        reject("reduce-axis",
               f"tensor_reduce: axes {axes} must be the last contiguous free axes of a rank-{data.ndim} tile")
    if op not in nl.REDUCE:
        reject("alu-op", f"tensor_reduce: {op_name(op)} is not a reduction operator here")
    kept = math.prod(data.shape[1:data.ndim - len(axes)])
    if dst.shape[0] != data.shape[0] or dst.free_size != kept:
        reject("tile-shape", f"tensor_reduce: dst {dst.shape} does not hold the reduction of {data.shape} over {axes}")
    dst.assign(lambda: ((-1 if negate else 1) * nl.REDUCE[op](data.read(), axes)).reshape(dst.shape))
    trace.record("vector", "stream", data.free_size, reads=(data,), writes=(dst,))


def tensor_partition_reduce(dst, op, data, name=None):
    """Reduce across partitions with ``op`` (add, max, ...), GpSimd Engine: ``dst`` is ``[1, ...]``."""
    tile("dst", dst, "tensor_partition_reduce"), tile("data", data, "tensor_partition_reduce")
    gpsimd_psum("tensor_partition_reduce", dst, data)
    if op not in nl.REDUCE:
        reject("alu-op", f"tensor_partition_reduce: {op_name(op)} is not a reduction operator here")
    if dst.shape[0] != 1 or dst.free_size != data.free_size:
        reject("tile-shape", f"tensor_partition_reduce: dst must be (1, {data.free_size}); got {dst.shape}")
    # the partitions, seen as a free axis
    dst.assign(lambda: nl.REDUCE[op](data.read().reshape(data.shape[0], -1).T, [1]).T.reshape(dst.shape))
    trace.record("gpsimd", "stream", data.free_size, reads=(data,), writes=(dst,))
