"""Emulated ``nki.isa`` Tensor Engine instructions: ``nc_matmul`` into PSUM and ``nc_transpose`` (on the Tensor or
Vector Engine).
"""

from __future__ import annotations

from .. import core, trace
from ..core import psum, reject, sbuf
from .enums import engine, matmul_perf_mode
from .operands import engine_name, tile

_FLOAT_MATMUL = {"float32", "tfloat32", "bfloat16", "float16"}  # fp8 types are not emulated


def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False,
              accumulate=None, tile_position=(), tile_size=(), perf_mode=matmul_perf_mode.none, name=None):
    """``dst = stationary.T @ moving`` into PSUM with fp32 accumulation: ``accumulate=False``
    overwrites, ``True`` adds onto a location a matmul initialised, ``None`` overwrites on the
    first write and accumulates after. Limits: contraction partitions <= 128, stationary free
    <= 128, moving free <= 512 (NeuronCore-v2/v3; nl.tile_size.gemm_*_fmax)."""
    tgt = core.target()
    for label, t in (("stationary", stationary), ("moving", moving), ("dst", dst)):
        tile(label, t, "nc_matmul")
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
    tile("dst", dst, "nc_transpose"), tile("data", data, "nc_transpose")
    eng = engine_name(engine, "tensor", ("tensor", "vector"), "nc_transpose")
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
