"""RMSNorm and LayerNorm, forward and backward, with the residual add fused into the forward.

Forward: one program per row, the whole row in one block (``D <= MAX_D``): it loads x (and the residual,
storing their sum rounded to x's dtype, which is what it normalises), takes the float32 mean (LayerNorm) and
``rstd``, stores them for the backward, and writes the output in x's dtype. Any strides: rows and columns are
addressed through both strides, in 64-bit offsets.

Backward, in two steps and no atomics, so the weight and bias gradients are the same bits on every run:
each of ``P`` programs takes a contiguous run of rows, writes their dx (plus the gradient that reached the
sum, for the fused residual) and keeps its rows' ``dy * xhat`` and ``dy`` column sums in registers, stored as
one row of a ``[P, D]`` float32 partials tensor; a second launch per partials tensor sums its rows in a fixed
order.

Eagerly every launch is a plan's (``launch.Launch``), kept per layout: a call costs a key, its allocations and its
launches, and a prepared run (``OpImpl.prepare``, for the memoised eager calls) not even the key. Under
torch.compile the ops ``portable_ops::triton_rms_norm_fwd`` / ``_bwd`` and ``triton_layer_norm_fwd`` / ``_bwd``
(:func:`traced_ops`) make the same allocations and launches from the same configuration, which Inductor then calls.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from portable_ops.norms import register_gradients

from .adam import _TL_DTYPE
from .interpreter import INTERPRETED, to_dtype
from .launch import Launch
from .traced import triton_op, wrap_triton

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


def _torch_norm_takes(call) -> bool:
    """No residual, and the tensors of one dtype: what torch's own norm computes as this op does."""
    x = call["x"]
    return call["residual"] is None and all(t is None or t.dtype == x.dtype for t in (call["weight"], call.get("bias")))


def eager_to_aten(call) -> list[str]:
    """``OpImpl.defer_eager``: an eager call torch's norm computes runs ATen's fused norm (on 'reference'), whose
    kernels take this backend's device time and whose backward torch's autograd runs without Python; this backend's
    kernels keep the residual's fused add."""
    if not _torch_norm_takes(call):
        return []
    return ["an eager call with no residual and one dtype runs ATen's fused norm on 'reference' (the same kernel "
            "time, and a backward without Python)"]


def traced_to_inductor(call) -> list[str]:
    """``OpImpl.defer_traced``: a call torch.compile traces that torch's norm computes is traced as torch's norm (on
    'reference'), which Inductor generates and fuses with the ops around it (the casts, the residual stream's add)
    where this backend's kernel is a call of its own."""
    if not _torch_norm_takes(call):
        return []
    return ["under torch.compile a call with no residual and one dtype is traced as torch's norm on 'reference', "
            "which Inductor fuses with the ops around it"]


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


def _programs(m, device: torch.device):
    """The backward's programs for ``m`` rows (a symbolic ``m`` while torch.compile traces: ``sym_min`` keeps the
    graph free of a guard on it)."""
    if INTERPRETED or device.type != "cuda":
        return torch.sym_min(m, INTERPRETER_PROGRAMS)
    return torch.sym_min(m, 4 * torch.cuda.get_device_properties(device).multi_processor_count)


def _dense(t):
    """A ``[D]`` weight or bias as the kernels read it, at unit stride (a strided view, ``w[::2]``, is copied)."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def _dtype(t):
    return None if t is None else t.dtype


# ----------------------------------------------------------------------------- the launches, eager and traced

def _forward_launch(x, residual, weight, bias, rms):
    """The forward's grid, integer arguments and options (constexprs and warps) for rows ``x [M, D]``: what an
    eager plan fixes and a traced op launches with."""
    m, d = x.shape[0], int(x.shape[1])  # D sizes the block: a symbolic one (while torch.compile traces) specialised
    r = residual if residual is not None else x
    block = triton.next_power_of_2(d)
    options = dict(DTYPE=_TL_DTYPE[x.dtype], HAS_RES=residual is not None, HAS_W=weight is not None,
                   HAS_B=bias is not None, RMS=rms, BLOCK_D=block, num_warps=_warps(block))
    return (m,), (x.stride(0), x.stride(1), r.stride(0), r.stride(1), d), options


def _forward_outputs(x, residual, weight, bias, rms):
    """The forward's outputs, allocated: ``(out, h, mean, rstd)`` (h None without a residual, mean None for
    RMSNorm), and the kernel's tensor arguments over them, x in place of those it doesn't have (never an output:
    a tensor written and passed twice would keep Inductor from writing it in place)."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    h = torch.empty_like(out) if residual is not None else None
    rstd = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    mean = None if rms else torch.empty_like(rstd)
    weight, bias = _dense(weight), _dense(bias)
    return (out, h, mean, rstd), (x, residual if residual is not None else x, weight if weight is not None else x,
                                  bias if bias is not None else x, out, h if h is not None else x,
                                  mean if mean is not None else x, rstd)


def _backward_launch(x, weight, dout, dh, rms, has_bias):
    """The backward's programs (each a contiguous run of rows, and a row of partial sums), integer arguments and
    options for rows ``x [M, D]``: what an eager plan fixes and a traced op launches with."""
    m, d = x.shape[0], int(x.shape[1])  # D sizes the block: a symbolic one (while torch.compile traces) specialised
    rows_per_program = triton.cdiv(m, _programs(m, x.device))
    g = dh if dh is not None else dout
    block = triton.next_power_of_2(d)
    options = dict(DTYPE=_TL_DTYPE[x.dtype], HAS_W=weight is not None, HAS_DH=dh is not None, BIAS_GRAD=has_bias,
                   RMS=rms, BLOCK_D=block, W_RESIDENT=block <= W_RESIDENT_BLOCK, num_warps=_warps(block))
    ints = (x.stride(0), x.stride(1), dout.stride(0), dout.stride(1), g.stride(0), g.stride(1), m, d,
            rows_per_program)
    return triton.cdiv(m, rows_per_program), ints, options


def _column_sum_grid(d):
    return (triton.cdiv(d, COLUMN_BLOCK),)


COLUMN_SUM_OPTIONS = dict(BLOCK=COLUMN_BLOCK, num_warps=4)


def _backward_outputs(programs, x, weight, mean, rstd, dout, dh, has_bias):
    """dx and the partial sums, allocated: ``(dx, dw_part, db_part)`` (None where there is no such parameter), and
    the row kernel's tensor arguments over them, inputs in place of those it doesn't have."""
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    dw_part = _partials(programs, x) if weight is not None else None
    db_part = _partials(programs, x) if has_bias else None
    weight = _dense(weight)
    return (dx, dw_part, db_part), (x, weight if weight is not None else x, mean if mean is not None else rstd, rstd,
                                    dout, dh if dh is not None else dout, dx,
                                    dw_part if dw_part is not None else rstd, db_part if db_part is not None else rstd)


def _partials(programs, x):
    return torch.empty((programs, x.shape[1]), dtype=torch.float32, device=x.device)


def _column_sums(partials):
    """The column sums' output for a ``[P, D]`` partials tensor."""
    return torch.empty(partials.shape[1], dtype=torch.float32, device=partials.device)


# ----------------------------------------------------------------------------- eager: plans by layout

# Plans by layout: a launch fixes its grid, constexprs and integers (launch.Launch), all of which the key holds
PLANS_SIZE = 4096
_plans: dict = {}


def _plan(key, build):
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= PLANS_SIZE:
            _plans.clear()
        plan = _plans[key] = build()
    return plan


def _launched(key, plan, launch, *args):
    """``launch(*args)``; a launch that fails takes its plan out with it (a plan built from what made it fail
    would fail every later call of its layout)."""
    try:
        launch(*args)
    except BaseException:
        if _plans.get(key) is plan:
            del _plans[key]
        raise


class _Forward:
    """The forward of one layout (x's shape, strides and dtype; the residual's strides and dtype; the weight's and
    bias's dtypes; the device): its allocations and its one launch, for any eps. Returns the op's tuple."""

    __slots__ = ("key", "rms", "ints", "launch")

    def __init__(self, key, x, residual, weight, bias, rms):
        grid, self.ints, options = _forward_launch(x, residual, weight, bias, rms)
        self.key, self.rms = key, rms
        self.launch = Launch(_norm_fwd_kernel, grid, 8, **options)

    def __call__(self, x, residual, weight, bias, eps):
        (out, h, mean, rstd), tensors = _forward_outputs(x, residual, weight, bias, self.rms)
        _launched(self.key, self, self.launch, *tensors, *self.ints, float(eps))
        return (out, h, rstd) if self.rms else (out, h, mean, rstd)


def _forward(x, residual, weight, bias, rms) -> _Forward:
    key = (x.shape, x.stride(), None if residual is None else residual.stride(), x.dtype, _dtype(residual),
           _dtype(weight), _dtype(bias), x.device, rms)
    return _plan(key, lambda: _Forward(key, x, residual, weight, bias, rms))


class _Backward:
    """The backward of one layout (x's shape, strides and dtype; the weight's dtype; whether there is a bias; the
    device; dout's and dh's strides and dtypes): dx and each program's weight and bias partial sums in one
    launch, then a launch summing each partial's rows. Returns ``(dx, dweight, dbias)``."""

    __slots__ = ("key", "columns", "bias", "programs", "ints", "rows", "column_sums")

    def __init__(self, key, x, weight, dout, dh, rms, has_bias):
        self.key, self.columns, self.bias = key, x.shape[1], has_bias
        self.programs, self.ints, options = _backward_launch(x, weight, dout, dh, rms, has_bias)
        self.rows = Launch(_norm_bwd_kernel, (self.programs,), 9, **options)
        self.column_sums = Launch(_column_sum_kernel, _column_sum_grid(self.columns), 2, **COLUMN_SUM_OPTIONS)

    def __call__(self, x, weight, mean, rstd, dout, dh):
        (dx, dw_part, db_part), tensors = _backward_outputs(self.programs, x, weight, mean, rstd, dout, dh, self.bias)
        _launched(self.key, self, self.rows, *tensors, *self.ints)
        return dx, self._summed(dw_part), self._summed(db_part)

    def _summed(self, partials):
        if partials is None:
            return None
        out = _column_sums(partials)
        _launched(self.key, self, self.column_sums, partials, out, self.programs, self.columns)
        return out


def _backward_layout(x, weight, rms, has_bias) -> tuple:
    """What a backward's plan key holds besides dout's and dh's strides and dtypes."""
    return x.shape, x.stride(), x.dtype, _dtype(weight), x.device, rms, has_bias


def _backward(layout, x, weight, mean, rstd, dout, dh):
    """``(dx, dweight, dbias)`` from the plan of ``layout`` (:func:`_backward_layout`) and dout's and dh's strides
    and dtypes."""
    key = (layout, dout.stride(), dout.dtype, None if dh is None else dh.stride(), _dtype(dh))
    plan = _plan(key, lambda: _Backward(key, x, weight, dout, dh, *layout[-2:]))
    return plan(x, weight, mean, rstd, dout, dh)


def rms_norm_fwd(x, residual, weight, eps):
    return _forward(x, residual, weight, None, True)(x, residual, weight, None, eps)


def prepare_rms_norm_fwd(x, residual, weight, eps):
    """``rms_norm_fwd`` for every call of this one's layout and eps (``OpImpl.prepare``): ``run(x, residual,
    weight)``, its plan found here, once."""
    return functools.partial(_forward(x, residual, weight, None, True), bias=None, eps=eps)


def rms_norm_bwd(x, weight, rstd, dout, dh):
    return _backward(_backward_layout(x, weight, True, False), x, weight, None, rstd, dout, dh)[:2]


def prepare_rms_norm_bwd(x, weight, rstd):
    """``rms_norm_bwd`` for every call whose x and weight have this one's layout (``OpImpl.prepare``):
    ``run(x, weight, rstd, dout, dh)``, which finds its plan by dout's and dh's alone."""
    layout = _backward_layout(x, weight, True, False)
    return lambda x, weight, rstd, dout, dh: _backward(layout, x, weight, None, rstd, dout, dh)[:2]


def layer_norm_fwd(x, residual, weight, bias, eps):
    return _forward(x, residual, weight, bias, False)(x, residual, weight, bias, eps)


def prepare_layer_norm_fwd(x, residual, weight, bias, eps):
    """``layer_norm_fwd`` for every call of this one's layout and eps (``OpImpl.prepare``): ``run(x, residual,
    weight, bias)``, its plan found here, once."""
    return functools.partial(_forward(x, residual, weight, bias, False), eps=eps)


def layer_norm_bwd(x, weight, mean, rstd, dout, dh, has_bias):
    return _backward(_backward_layout(x, weight, False, has_bias), x, weight, mean, rstd, dout, dh)


def prepare_layer_norm_bwd(x, weight, mean, rstd, has_bias):
    """``layer_norm_bwd`` for every call whose x and weight have this one's layout (``OpImpl.prepare``):
    ``run(x, weight, mean, rstd, dout, dh)``, which finds its plan by dout's and dh's alone."""
    layout = _backward_layout(x, weight, False, has_bias)
    return functools.partial(_backward, layout)


# ----------------------------------------------------------------------------- traced: torch.compile's ops

def _traced_forward(x, residual, weight, bias, eps, rms):
    grid, ints, options = _forward_launch(x, residual, weight, bias, rms)
    (out, h, mean, rstd), tensors = _forward_outputs(x, residual, weight, bias, rms)
    wrap_triton(_norm_fwd_kernel)[grid](*tensors, *ints, eps, **options)
    return out, h if h is not None else x.new_empty(0), mean, rstd  # an op's schema returns tensors, not None


def _traced_backward(x, weight, mean, rstd, dout, dh, rms, has_bias):
    programs, ints, options = _backward_launch(x, weight, dout, dh, rms, has_bias)
    (dx, *partials), tensors = _backward_outputs(programs, x, weight, mean, rstd, dout, dh, has_bias)
    wrap_triton(_norm_bwd_kernel)[(programs,)](*tensors, *ints, **options)
    return dx, *(_traced_sums(part, programs) if part is not None else rstd.new_empty(0) for part in partials)


def _traced_sums(partials, programs):
    out, d = _column_sums(partials), partials.shape[1]
    wrap_triton(_column_sum_kernel)[_column_sum_grid(d)](partials, out, programs, d, **COLUMN_SUM_OPTIONS)
    return out


def _rms_norm_fwd(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, h, _, rstd = _traced_forward(x, residual, weight, None, eps, True)
    return out, h, rstd


def _rms_norm_bwd(x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor, dout: torch.Tensor,
                  dh: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return _traced_backward(x, weight, None, rstd, dout, dh, True, False)[:2]


def _layer_norm_fwd(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                    bias: torch.Tensor | None,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _traced_forward(x, residual, weight, bias, eps, False)


def _layer_norm_bwd(x: torch.Tensor, weight: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor,
                    dout: torch.Tensor, dh: torch.Tensor | None,
                    has_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _traced_backward(x, weight, mean, rstd, dout, dh, False, has_bias)


@functools.cache
def traced_ops() -> dict[str, str]:
    """The ops torch.compile traces into (``OpImpl.traced``): ``portable_ops::triton_rms_norm_fwd`` / ``_bwd`` and
    ``triton_layer_norm_fwd`` / ``_bwd``, each backward its forward's gradient, registered at the first call, when
    a graph first chooses them (``torch.library.triton_op`` loads Inductor, which eager use need not). Returns the
    forwards' names in ``torch.ops.portable_ops`` by the op each stands for."""
    for rms, name, forward, backward in ((True, "rms_norm", _rms_norm_fwd, _rms_norm_bwd),
                                         (False, "layer_norm", _layer_norm_fwd, _layer_norm_bwd)):
        register_gradients(rms, triton_op(f"portable_ops::triton_{name}_fwd", mutates_args=())(forward),
                           triton_op(f"portable_ops::triton_{name}_bwd", mutates_args=())(backward))
    return {"rms_norm_fwd": "triton_rms_norm_fwd", "layer_norm_fwd": "triton_layer_norm_fwd"}
