"""RMSNorm and LayerNorm, forward and backward, with the residual add fused into the forward.

Forward: one program per row, the whole row in one block (``D <= MAX_D``): it loads x (and the residual,
storing their sum rounded to x's dtype, which is what it normalises), takes the float32 mean (LayerNorm) and
``rstd``, stores them for the backward, and writes the output in x's dtype. Any strides: rows and columns are
addressed through both strides, in 64-bit offsets.

Backward, in two launches and no atomics, so the weight and bias gradients are the same bits on every run:
each of ``P`` programs takes a contiguous run of rows, writes their dx (plus the gradient that reached the
sum, for the fused residual) and keeps its rows' ``dy * xhat`` and ``dy`` column sums in registers, stored as
one row of a ``[P, D]`` float32 partials tensor; a second launch sums the partials' rows in a fixed order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .adam import _TL_DTYPE
from .interpreter import INTERPRETED, to_dtype
from .launch import in_compile_env

MAX_D = 8192  # a row is one block of registers: at 16384 the forward spills (sm_90, 16 or 32 warps)
W_RESIDENT_BLOCK = 4096  # the backward keeps the weight in registers up to this block; wider rows spill with it
COLUMN_BLOCK = 256
INTERPRETER_PROGRAMS = 4  # backward programs on CPU tensors: a few, so the partials' second step is exercised


@triton.jit
def _norm_fwd_kernel(X, R, W, B, OUT, H, MEAN, RSTD, stride_xm, stride_xd, stride_rm, stride_rd, D, eps,
                     DTYPE: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                     RMS: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(X + row * stride_xm + cols * stride_xd, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(R + row * stride_rm + cols * stride_rd, mask=mask, other=0.0).to(tl.float32)
        h = to_dtype(x + r, DTYPE)  # the sum in x's dtype is what the norm sees and what is returned
        tl.store(H + row * D + cols, h, mask=mask)
        x = h.to(tl.float32)
    if RMS:
        centred = x
    else:
        mean = tl.sum(x, axis=0) / D
        tl.store(MEAN + row, mean)
        centred = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / D + eps)
    tl.store(RSTD + row, rstd)
    y = centred * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * D + cols, to_dtype(y, DTYPE), mask=mask)


@triton.jit
def _norm_bwd_kernel(X, W, MEAN, RSTD, DY, DH, DX, DW_PART, DB_PART, stride_xm, stride_xd, stride_ym, stride_yd,
                     stride_hm, stride_hd, M, D, rows_per_program,
                     DTYPE: tl.constexpr, HAS_W: tl.constexpr, HAS_DH: tl.constexpr, BIAS_GRAD: tl.constexpr,
                     RMS: tl.constexpr, BLOCK_D: tl.constexpr, W_RESIDENT: tl.constexpr):
    program = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    if HAS_W and W_RESIDENT:
        w_kept = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    db = tl.zeros([BLOCK_D], dtype=tl.float32)
    first = program * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    for row in range(first, last):
        x = tl.load(X + row * stride_xm + cols * stride_xd, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_ym + cols * stride_yd, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        if RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(mask, (x - tl.load(MEAN + row)) * rstd, 0.0)
        if HAS_W:
            if W_RESIDENT:
                wdy = dy * w_kept
            else:  # wide rows: the weight read again (from cache) each row, its registers left to the row's values
                wdy = dy * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            wdy = dy
        c1 = tl.sum(xhat * wdy, axis=0) / D
        if RMS:
            dx = (wdy - xhat * c1) * rstd
        else:
            dx = (wdy - xhat * c1 - tl.sum(wdy, axis=0) / D) * rstd
        if HAS_DH:
            dx += tl.load(DH + row * stride_hm + cols * stride_hd, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row * D + cols, to_dtype(dx, DTYPE), mask=mask)
        dw += dy * xhat
        db += dy
    if HAS_W:
        tl.store(DW_PART + program * D + cols, dw, mask=mask)
    if BIAS_GRAD:
        tl.store(DB_PART + program * D + cols, db, mask=mask)


@triton.jit
def _column_sum_kernel(PART, OUT, P, D, BLOCK: tl.constexpr):
    """``OUT[c] = sum_p PART[p, c]``, the rows added in order: the same bits every run."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p in range(0, P):
        acc += tl.load(PART + p * D + cols, mask=mask, other=0.0)
    tl.store(OUT + cols, acc, mask=mask)


def norm_supports(call) -> list[str]:
    """Dtypes are declared (``BACKEND``); a row must fit one block."""
    d = call["x"].shape[-1]
    if d > MAX_D:
        return [f"the normalised dim is {d}, over {MAX_D}, the largest row the triton norm kernels hold in one block"]
    return []


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


def _programs(m: int, device: torch.device) -> int:
    if INTERPRETED or device.type != "cuda":
        return min(m, INTERPRETER_PROGRAMS)
    return min(m, 4 * torch.cuda.get_device_properties(device).multi_processor_count)


def _dense(t):
    """A ``[D]`` weight or bias as the kernels read it, at unit stride (a strided view, ``w[::2]``, is copied)."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def _norm_fwd(x, residual, weight, bias, eps, rms):
    m, d = x.shape
    weight, bias = _dense(weight), _dense(bias)
    out = torch.empty((m, d), dtype=x.dtype, device=x.device)
    h = torch.empty_like(out) if residual is not None else None
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    mean = None if rms else torch.empty_like(rstd)
    block = triton.next_power_of_2(d)
    r = residual if residual is not None else x
    in_compile_env(_norm_fwd_kernel[(m,)], x, r, weight if weight is not None else x, bias if bias is not None else x,
                   out, h if h is not None else out, mean if mean is not None else rstd, rstd, x.stride(0),
                   x.stride(1), r.stride(0), r.stride(1), d, eps, DTYPE=_TL_DTYPE[x.dtype],
                   HAS_RES=residual is not None, HAS_W=weight is not None, HAS_B=bias is not None, RMS=rms,
                   BLOCK_D=block, num_warps=_warps(block))
    return out, h, mean, rstd


def _column_sums(partials):
    p, d = partials.shape
    out = torch.empty(d, dtype=torch.float32, device=partials.device)
    in_compile_env(_column_sum_kernel[(triton.cdiv(d, COLUMN_BLOCK),)], partials, out, p, d, BLOCK=COLUMN_BLOCK,
                   num_warps=4)
    return out


def _norm_bwd(x, weight, mean, rstd, dout, dh, rms, has_bias):
    m, d = x.shape
    weight = _dense(weight)
    programs = _programs(m, x.device)
    rows_per_program = triton.cdiv(m, programs)
    programs = triton.cdiv(m, rows_per_program)
    dx = torch.empty((m, d), dtype=x.dtype, device=x.device)
    dw_part = torch.empty((programs, d), dtype=torch.float32, device=x.device) if weight is not None else None
    db_part = torch.empty((programs, d), dtype=torch.float32, device=x.device) if has_bias else None
    block = triton.next_power_of_2(d)
    g = dh if dh is not None else dout
    in_compile_env(_norm_bwd_kernel[(programs,)], x, weight if weight is not None else x,
                   mean if mean is not None else rstd, rstd, dout, g, dx,
                   dw_part if dw_part is not None else rstd, db_part if db_part is not None else rstd,
                   x.stride(0), x.stride(1), dout.stride(0), dout.stride(1), g.stride(0), g.stride(1), m, d,
                   rows_per_program, DTYPE=_TL_DTYPE[x.dtype], HAS_W=weight is not None, HAS_DH=dh is not None,
                   BIAS_GRAD=has_bias, RMS=rms, BLOCK_D=block, W_RESIDENT=block <= W_RESIDENT_BLOCK,
                   num_warps=_warps(block))
    dweight = _column_sums(dw_part) if dw_part is not None else None
    dbias = _column_sums(db_part) if db_part is not None else None
    return dx, dweight, dbias


def rms_norm_fwd(x, residual, weight, eps):
    out, h, _, rstd = _norm_fwd(x, residual, weight, None, eps, rms=True)
    return out, h, rstd


def rms_norm_bwd(x, weight, rstd, dout, dh):
    dx, dweight, _ = _norm_bwd(x, weight, None, rstd, dout, dh, rms=True, has_bias=False)
    return dx, dweight


def layer_norm_fwd(x, residual, weight, bias, eps):
    return _norm_fwd(x, residual, weight, bias, eps, rms=False)


def layer_norm_bwd(x, weight, mean, rstd, dout, dh, has_bias):
    return _norm_bwd(x, weight, mean, rstd, dout, dh, rms=False, has_bias=has_bias)
