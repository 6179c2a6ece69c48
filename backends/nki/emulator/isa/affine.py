"""Emulated ``nki.isa`` instructions over an affine pattern of partition and free indices, on the GpSimd Engine:
``affine_select`` and ``iota``.
"""

from __future__ import annotations

import math

import torch

from .. import language as nl
from .. import trace
from ..core import reject, sbuf
from .operands import alu, gpsimd_psum, same_layout, tile


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
    tile("dst", dst, "affine_select"), tile("on_true_tile", on_true_tile, "affine_select")
    gpsimd_psum("affine_select", dst, on_true_tile)
    same_layout(dst, on_true_tile, "affine_select", "dst and on_true_tile")
    _, _, affine = _affine(dst, pattern, offset, channel_multiplier, "affine_select")
    cmp = alu(cmp_op, "affine_select")

    def value():
        keep = cmp(affine(), 0.0) != 0
        return torch.where(keep, on_true_tile.read().reshape(dst.shape), torch.tensor(float(on_false_value)))

    dst.assign(value)
    trace.record("gpsimd", "stream", dst.free_size, reads=(on_true_tile,), writes=(dst,))


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    """GpSimd Engine: ``dst = offset + p * channel_multiplier + sum(i_k * step_k)`` (the partition ``p``, the free
    indices ``i_k`` of ``pattern``'s ``[[step, num], ...]``), computed in int32 and converted to dst's dtype; ``dst``
    in SBUF."""
    tile("dst", dst, "iota")
    if dst.buffer is not sbuf:
        reject("iota-memory", "iota writes its pattern to SBUF")
    low, high, affine = _affine(dst, pattern, offset, channel_multiplier, "iota")
    if low < -2 ** 31 or high >= 2 ** 31:
        reject("iota-range", f"iota: the pattern's values span [{low}, {high}]; they are computed in int32")
    dst.assign(affine)
    trace.record("gpsimd", "stream", dst.free_size, writes=(dst,))
