"""Emulated ``nki.isa`` data movement: DMA copies and transposes between HBM and SBUF (gathers and scatters through
``indirect.py``), on-chip copies, predicated copies and memset.
"""

from __future__ import annotations

import math

import torch

from .. import core, indirect, trace
from ..core import psum, reject, sbuf
from ..tensors import Tensor
from .enums import dge_mode, engine, oob_mode
from .operands import engine_name, gpsimd_psum, one_input_cost, same_layout, tile


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
    tile("dst", dst, "tensor_copy"), tile("src", src, "tensor_copy")
    same_layout(dst, src, "tensor_copy", "dst and src")
    eng = engine_name(engine, "vector", ("vector", "scalar", "gpsimd"), "tensor_copy")
    if eng == "gpsimd":
        gpsimd_psum("tensor_copy on gpsimd", dst, src)
    # bit-accurate when the dtypes match, else through float32
    dst.assign(lambda: (src.data if src.dtype == dst.dtype else src.read()).reshape(dst.shape))
    trace.record(eng, one_input_cost(eng, dst, src), src.free_size, reads=(src,), writes=(dst,))


def memset(dst, value, engine=engine.unknown, name=None):
    """Fill ``dst`` with the compile-time constant ``value`` (any NKI dtype; at most four free axes, the
    v2.33 reference says), on the Vector or GpSimd Engine."""
    tile("dst", dst, "memset")
    if dst.ndim > 5:
        reject("memset-shape", f"memset: dst {dst.shape} has {dst.ndim - 1} free axes; memset takes at most four")
    _memset_value(value, dst.dtype)
    eng = engine_name(engine, "vector" if dst.buffer is psum else "gpsimd", ("vector", "gpsimd"), "memset")
    if eng == "gpsimd":
        gpsimd_psum("memset on gpsimd", dst)
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
    tile("dst", dst, "tensor_copy_predicated"), tile("predicate", predicate, "tensor_copy_predicated")
    if predicate.dtype.name not in ("uint8", "uint16", "uint32"):
        reject("predicate-dtype",
               f"tensor_copy_predicated: predicate must be uint8/uint16/uint32, not {predicate.dtype}")
    same_layout(dst, predicate, "tensor_copy_predicated", "dst and predicate")
    if isinstance(src, Tensor):
        tile("src", src, "tensor_copy_predicated")
        same_layout(dst, src, "tensor_copy_predicated", "dst and src")
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
