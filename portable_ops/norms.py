"""RMSNorm and LayerNorm over the last dim, with an optional fused residual add: differentiable,
autocast-aware, reachable from torch.compile and torch.func.

The backends take rows: ``x [M, D]`` (the leading dims folded, a copy only where the strides can't be
folded), and return the output, the sum ``x + residual`` where there is one, and float32 statistics
(``mean``, LayerNorm only, and ``rstd`` per row) that the backward reuses. Three wrappers run them:

* eager calls: :class:`_EagerNorm`, an ``autograd.Function`` whose backward dispatches the row's
  backward op (``create_graph=True`` differentiates the definition instead);
* torch.compile: the custom ops ``portable_ops::rms_norm_fwd`` / ``_bwd`` and ``layer_norm_fwd`` / ``_bwd``,
  with fake implementations and ``register_autograd``;
* torch.func transforms and forward-mode AD: the definition (``portable_ops.definitions.norms``), plain
  torch ops, which every transform differentiates and batches.
"""

from __future__ import annotations

import torch

from . import norm_checks
from .attention import _autocasting, call_layout, run_op, transformed
from .definitions import norms as definition
from .dispatch import forced_backend

# Device types whose autocast puts layer_norm and rms_norm on its float32 list (ATen's AT_FORALL_FP32, which
# CUDA's autocast registers): half inputs are cast to float32 there. CPU autocast lists neither: inputs as given.
FP32_UNDER_AUTOCAST = ("cuda",)


def autocast_inputs(x, residual, weight, bias):
    """torch's autocast policy for its norms: on a device type in :data:`FP32_UNDER_AUTOCAST`, float16 and
    bfloat16 tensors cast to float32; elsewhere unchanged."""
    device_type = x.device.type
    if device_type not in FP32_UNDER_AUTOCAST or not _autocasting(device_type):
        return x, residual, weight, bias
    return tuple(t.float() if t is not None and t.dtype in (torch.float16, torch.bfloat16) else t
                 for t in (x, residual, weight, bias))


def norm_call(op, x, residual, weight, bias, eps):
    """Check one call's arguments, then apply autocast's casts and torch's promotion of a residual of another
    dtype, and return them as the backends take them, but for x and residual in their own shapes
    (:func:`forward` folds them into rows)."""
    norm_checks.check_norm(op, x, residual, weight, bias)
    x, residual, weight, bias = autocast_inputs(x, residual, weight, bias)
    if residual is not None and residual.dtype != x.dtype:  # torch's x + residual: the promoted dtype
        dtype = torch.promote_types(x.dtype, residual.dtype)
        x, residual = x.to(dtype), residual.to(dtype)
    eps = norm_checks.norm_eps(op, eps, x.dtype)
    call = dict(x=x, residual=residual, weight=weight)
    if op == "layer_norm":
        call["bias"] = bias
    call["eps"] = eps
    return call


def _rows(t):
    return None if t is None else t.reshape(-1, t.shape[-1])


def forward(rms, x, residual, weight, bias, eps):
    """``(out, h, mean, rstd)`` in x's shape (statistics in its leading shape) from the backend chosen for this
    call; ``h`` None without a residual, ``mean`` None for RMSNorm."""
    call = dict(x=_rows(x), residual=_rows(residual), weight=weight)
    if not rms:
        call["bias"] = bias
    call["eps"] = eps
    op = "rms_norm_fwd" if rms else "layer_norm_fwd"
    result = run_op(op, call, call_layout(call), x.device, None)
    out, h, *stats = result if not rms else (result[0], result[1], None, result[2])
    lead = x.shape[:-1]
    mean, rstd = (None if s is None else s.reshape(lead) for s in stats)
    return out.reshape(x.shape), None if h is None else h.reshape(x.shape), mean, rstd


def backward(rms, x, weight, mean, rstd, dout, dh, has_bias, prefer=None):
    """``(dx, dweight, dbias)``, the last two float32 or the parameter's dtype (None where there is no such
    parameter), from the backend
    chosen for this call; ``prefer``: the backend forced when the forward ran, which the backward keeps."""
    call = dict(x=_rows(x), weight=weight)
    if not rms:
        call["mean"] = mean.reshape(-1)
    call.update(rstd=rstd.reshape(-1), dout=_rows(dout), dh=_rows(dh))
    if not rms:
        call["has_bias"] = has_bias
    op = "rms_norm_bwd" if rms else "layer_norm_bwd"
    result = run_op(op, call, call_layout(call), x.device, prefer)
    dx, dweight, dbias = (result[0], result[1], None) if rms else result
    return dx.reshape(x.shape), dweight, dbias


def _param_grad(grad, param):
    return None if grad is None or param is None else grad.to(param.dtype)


def _definition(rms, x, residual, weight, bias, eps):
    if rms:
        return definition.rms_norm(x, weight, eps, residual)
    return definition.layer_norm(x, weight, bias, eps, residual)


# ----------------------------------------------------------------------------- eager

class _EagerNorm(torch.autograd.Function):
    """``apply(x, residual, weight, bias, (rms, eps))`` -> out, or (out, h) with a residual."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, how):
        rms, eps = how
        out, h, mean, rstd = forward(rms, x, residual, weight, bias, eps)
        # what was normalised (the sum, an output, with a residual): x and residual themselves are not kept
        ctx.save_for_backward(h if h is not None else x, weight, bias, mean, rstd)
        ctx.rms, ctx.eps, ctx.prefer, ctx.has_residual = rms, eps, forced_backend(), residual is not None
        ctx.set_materialize_grads(False)
        return (out, h) if h is not None else out

    @staticmethod
    def backward(ctx, dout, dh=None):
        saved, weight, bias, mean, rstd = ctx.saved_tensors
        if dout is None and dh is None:
            return None, None, None, None, None
        if dout is None:  # only the sum's gradient arrived: the norm's output was not used
            return dh, dh if ctx.has_residual else None, None, None, None
        if torch.is_grad_enabled():  # create_graph=True: differentiate the definition again
            dx, dweight, dbias = _differentiated_again(ctx, saved, weight, bias, dout, dh)
        else:
            dx, dweight, dbias = backward(ctx.rms, saved, weight, mean, rstd, dout, dh, bias is not None, ctx.prefer)
            dweight, dbias = _param_grad(dweight, weight), _param_grad(dbias, bias)
        return dx, dx if ctx.has_residual else None, dweight, dbias, None


def _differentiated_again(ctx, saved, weight, bias, dout, dh):
    """First derivatives that are themselves differentiable: the definition's, taken at what was normalised
    (the sum, an output of the forward, through which a second derivative reaches x and residual)."""
    given = [t if t is not None and t.requires_grad else None for t in (saved, weight, bias)]
    with torch.enable_grad():
        out = _definition(ctx.rms, saved, None, weight, bias, ctx.eps)
        wanted = [t for t in given if t is not None]
        grads = iter(torch.autograd.grad(out, wanted, dout, create_graph=True, allow_unused=True))
    dx, dweight, dbias = (next(grads) if t is not None else None for t in given)
    if dx is None:
        dx = torch.zeros_like(saved)
    return (dx if dh is None else dx + dh), dweight, dbias


# ----------------------------------------------------------------------------- torch.compile

def _stats_like(x):
    return x.new_empty(x.shape[:-1], dtype=definition.stats_dtype(x.dtype))


def _or_empty(t, like):
    return t if t is not None else like.new_empty(0)


@torch.library.custom_op("portable_ops::rms_norm_fwd", mutates_args=())
def _rms_fwd_op(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, h, _, rstd = forward(True, x, residual, weight, None, eps)
    return out, _or_empty(h, x), rstd


@_rms_fwd_op.register_fake
def _(x, residual, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape if residual is not None else (0,)), _stats_like(x)


@torch.library.custom_op("portable_ops::rms_norm_bwd", mutates_args=())
def _rms_bwd_op(x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor, dout: torch.Tensor,
                dh: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dweight, _ = backward(True, x, weight, None, rstd, dout, dh, False)
    return dx, _or_empty(dweight, rstd)


@_rms_bwd_op.register_fake
def _(x, weight, rstd, dout, dh):
    return x.new_empty(x.shape), rstd.new_empty(x.shape[-1:] if weight is not None else (0,))


@torch.library.custom_op("portable_ops::layer_norm_fwd", mutates_args=())
def _ln_fwd_op(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
               bias: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    out, h, mean, rstd = forward(False, x, residual, weight, bias, eps)
    return out, _or_empty(h, x), mean, rstd


@_ln_fwd_op.register_fake
def _(x, residual, weight, bias, eps):
    return (x.new_empty(x.shape), x.new_empty(x.shape if residual is not None else (0,)), _stats_like(x),
            _stats_like(x))


@torch.library.custom_op("portable_ops::layer_norm_bwd", mutates_args=())
def _ln_bwd_op(x: torch.Tensor, weight: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor,
               dout: torch.Tensor, dh: torch.Tensor | None,
               has_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dweight, dbias = backward(False, x, weight, mean, rstd, dout, dh, has_bias)
    return dx, _or_empty(dweight, rstd), _or_empty(dbias, rstd)


@_ln_bwd_op.register_fake
def _(x, weight, mean, rstd, dout, dh, has_bias):
    d = x.shape[-1:]
    return (x.new_empty(x.shape), rstd.new_empty(d if weight is not None else (0,)),
            rstd.new_empty(d if has_bias else (0,)))


def _rms_setup(ctx, inputs, output):
    x, residual, weight, _eps = inputs
    _out, h, rstd = output
    ctx.save_for_backward(h if residual is not None else x, weight, rstd)
    ctx.has_residual = residual is not None


def _rms_backward(ctx, dout, dh, _drstd):
    saved, weight, rstd = ctx.saved_tensors
    dx, dweight = _rms_bwd_op(saved, weight, rstd, dout, dh if ctx.has_residual else None)
    return dx, dx if ctx.has_residual else None, _param_grad(dweight, weight), None


def _ln_setup(ctx, inputs, output):
    x, residual, weight, bias, _eps = inputs
    _out, h, mean, rstd = output
    ctx.save_for_backward(h if residual is not None else x, weight, bias, mean, rstd)
    ctx.has_residual = residual is not None


def _ln_backward(ctx, dout, dh, _dmean, _drstd):
    saved, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dweight, dbias = _ln_bwd_op(saved, weight, mean, rstd, dout, dh if ctx.has_residual else None,
                                    bias is not None)
    return (dx, dx if ctx.has_residual else None, _param_grad(dweight, weight), _param_grad(dbias, bias), None)


_rms_fwd_op.register_autograd(_rms_backward, setup_context=_rms_setup)
_ln_fwd_op.register_autograd(_ln_backward, setup_context=_ln_setup)


# ----------------------------------------------------------------------------- the public functions

def _norm(rms, x, residual, weight, bias, eps):
    op = "rms_norm" if rms else "layer_norm"
    call = norm_call(op, x, residual, weight, bias, eps)
    x, residual, weight, eps = call["x"], call["residual"], call["weight"], call["eps"]
    if x.numel() == 0 or transformed():  # nothing to launch, or torch.func: the definition's torch ops
        return _definition(rms, x, residual, weight, bias, eps)
    if torch.compiler.is_compiling():
        if rms:
            out, h, _ = _rms_fwd_op(x, residual, weight, eps)
        else:
            out, h, _, _ = _ln_fwd_op(x, residual, weight, bias, eps)
        return (out, h) if residual is not None else out
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                 for t in (x, residual, weight, bias))
    if not needs_grad:
        out, h, _, _ = forward(rms, x, residual, weight, bias, eps)
        return (out, h) if residual is not None else out
    return _EagerNorm.apply(x, residual, weight, bias, (rms, eps))


def rms_norm(x, weight=None, eps=None, *, residual=None):
    """RMSNorm of ``x [..., D]`` over its last dim: ``x / sqrt(mean(x^2) + eps) * weight``, torch's
    ``F.rms_norm(x, (D,), weight, eps)``.

    ``weight``: None or ``[D]``; ``eps`` None means ``torch.finfo(x.dtype).eps``, as torch's. Statistics in
    float32; the output in x's dtype, any leading shape and strides. With ``residual`` (x's shape), returns
    ``(rms_norm(x + residual), x + residual)``, the sum in x's dtype (torch's promotion if they differ): the
    pre-norm block's add fused into the norm. Under CUDA autocast half inputs are cast to float32, as torch's
    autocast does for ``rms_norm``. Differentiable in x, residual and weight (``docs/api.md``, "Norms").
    """
    return _norm(True, x, residual, weight, None, eps)


def layer_norm(x, weight=None, bias=None, eps=1e-5, *, residual=None):
    """LayerNorm of ``x [..., D]`` over its last dim: torch's ``F.layer_norm(x, (D,), weight, bias, eps)``.

    As :func:`rms_norm`, with the row's mean subtracted and ``bias`` (None or ``[D]``) added; ``eps`` defaults to
    1e-5. Differentiable in x, residual, weight and bias.
    """
    return _norm(False, x, residual, weight, bias, eps)
