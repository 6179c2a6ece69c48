"""RMSNorm and LayerNorm over the last dim, with an optional fused residual add: differentiable,
autocast-aware, reachable from torch.compile and torch.func.

The backends take rows: ``x [M, D]`` (the leading dims folded, a copy only where the strides can't be
folded), and return the output, the sum ``x + residual`` where there is one, and float32 statistics
(``mean``, LayerNorm only, and ``rstd`` per row) that the backward reuses. Three wrappers run them:

* eager calls: :class:`_EagerNorm`, an ``autograd.Function`` whose backward dispatches the row's
  backward op (``create_graph=True`` differentiates the definition instead), memoised as attention's eager
  calls are (``portable_ops/memo.py``): a call whose key was seen runs its backend's prepared run with no
  checks or dispatch, and its backward is dispatched and prepared once per key;
* torch.compile: dispatch chooses while the graph is traced. A backend with a traced op (``OpImpl.traced``, the
  triton backend's ``torch.library.triton_op``) puts it in the graph, on x's rows, and Inductor calls its kernels
  from the code it generates; otherwise the graph holds the custom ops ``portable_ops::rms_norm_fwd`` / ``_bwd``
  and ``layer_norm_fwd`` / ``_bwd``, with fake implementations, which dispatch when the graph runs. Both with
  ``register_autograd`` (:func:`register_gradients`);
* torch.func transforms and forward-mode AD: the definition (``portable_ops.definitions.norms``), plain
  torch ops, which every transform differentiates and batches.
"""

from __future__ import annotations

import functools
import operator

import torch

from . import dispatch, memo, norm_checks
from .attention import call_layout, run_op, transformed
from .definitions import norms as definition
from .dispatch import forced_backend

# Device types whose autocast puts layer_norm and rms_norm on its float32 list (ATen's AT_FORALL_FP32, which
# CUDA's autocast registers): half inputs are cast to float32 there. CPU autocast lists neither: inputs as given.
FP32_UNDER_AUTOCAST = ("cuda",)


def autocast_inputs(x, residual, weight, bias):
    """torch's autocast policy for its norms: on a device type in :data:`FP32_UNDER_AUTOCAST`, float16 and
    bfloat16 tensors cast to float32; elsewhere unchanged."""
    device_type = x.device.type
    if device_type not in FP32_UNDER_AUTOCAST or not memo.autocasting(device_type):
        return x, residual, weight, bias
    return tuple(t.float() if t is not None and t.dtype in (torch.float16, torch.bfloat16) else t
                 for t in (x, residual, weight, bias))


def _cast(x, residual, weight, bias):
    """Autocast's casts, then torch's promotion of a residual of another dtype (``x + residual``'s dtype)."""
    x, residual, weight, bias = autocast_inputs(x, residual, weight, bias)
    if residual is not None and residual.dtype != x.dtype:
        dtype = torch.promote_types(x.dtype, residual.dtype)
        x, residual = x.to(dtype), residual.to(dtype)
    return x, residual, weight, bias


def norm_call(op, x, residual, weight, bias, eps):
    """Check one call's arguments, then apply autocast's casts and torch's promotion of a residual of another
    dtype, and return them as the backends take them, but for x and residual in their own shapes
    (:func:`forward` folds them into rows)."""
    norm_checks.check_norm(op, x, residual, weight, bias)
    x, residual, weight, bias = _cast(x, residual, weight, bias)
    return _forward_call(op == "rms_norm", x, residual, weight, bias, norm_checks.norm_eps(op, eps, x.dtype))


def _forward_call(rms, x, residual, weight, bias, eps):
    call = dict(x=x, residual=residual, weight=weight)
    if not rms:
        call["bias"] = bias
    call["eps"] = eps
    return call


def _rows(t):
    return None if t is None else t.reshape(-1, t.shape[-1])


def _dtype(t):
    return None if t is None else t.dtype


_FWD_OP = {True: "rms_norm_fwd", False: "layer_norm_fwd"}
_BWD_OP = {True: "rms_norm_bwd", False: "layer_norm_bwd"}
# the tensors of each op's call, as its prepared runs take them positionally
_FWD_TENSORS = {True: ("x", "residual", "weight"), False: ("x", "residual", "weight", "bias")}
_BWD_TENSORS = {True: ("x", "weight", "rstd", "dout", "dh"), False: ("x", "weight", "mean", "rstd", "dout", "dh")}


def forward(rms, x, residual, weight, bias, eps):
    """``(out, h, mean, rstd)`` in x's shape (statistics in its leading shape) from the backend chosen for this
    call; ``h`` None without a residual, ``mean`` None for RMSNorm."""
    call = _forward_call(rms, _rows(x), _rows(residual), weight, bias, eps)
    result = run_op(_FWD_OP[rms], call, call_layout(call), x.device, None)
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
    result = run_op(_BWD_OP[rms], call, call_layout(call), x.device, prefer)
    dx, dweight, dbias = (result[0], result[1], None) if rms else result
    return dx.reshape(x.shape), dweight, dbias


def _param_grad(grad, param):
    return None if grad is None or param is None else grad.to(param.dtype)


def _definition(rms, x, residual, weight, bias, eps):
    if rms:
        return definition.rms_norm(x, weight, eps, residual)
    return definition.layer_norm(x, weight, bias, eps, residual)


# ----------------------------------------------------------------------------- eager

class _How:
    """What :class:`_EagerNorm` runs, handed over as one argument: ``forward(x, residual, weight, bias) -> (out, h,
    mean, rstd)`` and ``backward(x, weight, mean, rstd, dout, dh, has_bias, prefer) -> (dx, dweight, dbias)``, whose
    statistics are the forward's as it returns them; ``rms`` and ``eps`` for the definition."""

    __slots__ = ("rms", "eps", "forward", "backward")

    def __init__(self, rms, eps, forward, backward):
        self.rms, self.eps, self.forward, self.backward = rms, eps, forward, backward


class _EagerNorm(torch.autograd.Function):
    """``apply(x, residual, weight, bias, how)`` -> out, or (out, h) with a residual."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, how):
        out, h, mean, rstd = how.forward(x, residual, weight, bias)
        # what was normalised (the sum, an output, with a residual): x and residual themselves are not kept
        ctx.save_for_backward(h if h is not None else x, weight, bias, mean, rstd)
        ctx.how, ctx.prefer, ctx.has_residual = how, forced_backend(), residual is not None
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
            dx, dweight, dbias = _differentiated_again(ctx.how, saved, weight, bias, dout, dh)
        else:
            dx, dweight, dbias = ctx.how.backward(saved, weight, mean, rstd, dout, dh, bias is not None, ctx.prefer)
            dweight, dbias = _param_grad(dweight, weight), _param_grad(dbias, bias)
        return dx, dx if ctx.has_residual else None, dweight, dbias, None


def _differentiated_again(how, saved, weight, bias, dout, dh):
    """First derivatives that are themselves differentiable: the definition's, taken at what was normalised
    (the sum, an output of the forward, through which a second derivative reaches x and residual)."""
    given = [t if t is not None and t.requires_grad else None for t in (saved, weight, bias)]
    with torch.enable_grad():
        out = _definition(how.rms, saved, None, weight, bias, how.eps)
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


def _ln_setup(ctx, inputs, output):
    x, residual, weight, bias, _eps = inputs
    _out, h, mean, rstd = output
    ctx.save_for_backward(h if residual is not None else x, weight, bias, mean, rstd)
    ctx.has_residual = residual is not None


def register_gradients(rms, forward_op, backward_op):
    """Register ``backward_op`` as the gradient of ``forward_op``: portable_ops' custom ops, and a backend's traced
    ops (``OpImpl.traced``), of the custom ops' schemas."""
    if rms:
        def backward(ctx, dout, dh, _drstd):
            saved, weight, rstd = ctx.saved_tensors
            dx, dweight = backward_op(saved, weight, rstd, dout, dh if ctx.has_residual else None)
            return dx, dx if ctx.has_residual else None, _param_grad(dweight, weight), None
    else:
        def backward(ctx, dout, dh, _dmean, _drstd):
            saved, weight, bias, mean, rstd = ctx.saved_tensors
            dx, dweight, dbias = backward_op(saved, weight, mean, rstd, dout, dh if ctx.has_residual else None,
                                             bias is not None)
            return (dx, dx if ctx.has_residual else None, _param_grad(dweight, weight), _param_grad(dbias, bias),
                    None)
    forward_op.register_autograd(backward, setup_context=_rms_setup if rms else _ln_setup)


register_gradients(True, _rms_fwd_op, _rms_bwd_op)
register_gradients(False, _ln_fwd_op, _ln_bwd_op)


def _traced_call(rms, x, residual, weight, bias):
    """What the backends' choice reads of this call while torch.compile traces it (``dispatch.traced_op``'s
    arguments): its device and dtypes and its normalised dim D, a constant of the graph (as the kernels' block is: a
    symbolic one is specialised, guarded); the rows are the graph's, dynamic, and no backend's choice reads them."""
    d = operator.index(x.shape[-1])
    rows, params = (1, d), (d,)
    tensors = (("x", rows, x.dtype), ("residual", rows, _dtype(residual)), ("weight", params, _dtype(weight)))
    if not rms:
        tensors += (("bias", params, _dtype(bias)),)
    return _FWD_OP[rms], tensors, (), x.device, dispatch.forced_by_use_backend()


def _compiled(rms, x, residual, weight, bias, eps):
    """A call while torch.compile traces it: the chosen backend's traced op on x's rows where it has one, else its
    torch ops (``OpImpl.autograd``, which Inductor fuses with their neighbours), else the custom op (which dispatches
    when the graph runs). Returns what the public function does."""
    traced = _traced_call(rms, x, residual, weight, bias)
    name = dispatch.traced_op(*traced)
    backend = dispatch.traced_backend(*traced) if name is None else None
    if backend is not None:
        inline = _differentiable(rms, dispatch.loaded_op(backend, _FWD_OP[rms]), x, residual, weight, bias, eps)
        if inline is not None:
            return _autocast_off(inline, x.device.type)(x, residual, weight, bias)
    if name is None:
        result = _rms_fwd_op(x, residual, weight, eps) if rms else _ln_fwd_op(x, residual, weight, bias, eps)
        out, h = result[0], result[1]
    else:
        result = getattr(torch.ops.portable_ops, name)(**_forward_call(rms, _rows(x), _rows(residual), weight,
                                                                       bias, eps))
        out, h = result[0].reshape(x.shape), result[1].reshape(x.shape) if residual is not None else None
    return (out, h) if residual is not None else out


# ----------------------------------------------------------------------------- the public functions

def _norm(rms, x, residual, weight, bias, eps):
    key = _memo_key(rms, x, residual, weight, bias, eps)
    if key is not None:
        call = memo.memoised(_memo, key, _FWD_OP[rms])
        if call is not None:
            return call(x, residual, weight, bias)
    given = (x, residual, weight, bias)
    call = norm_call("rms_norm" if rms else "layer_norm", x, residual, weight, bias, eps)
    x, residual, weight, bias, eps = call["x"], call["residual"], call["weight"], call.get("bias"), call["eps"]
    if x.numel() == 0 or transformed():  # nothing to launch, or torch.func: the definition's torch ops
        return _definition(rms, x, residual, weight, bias, eps)
    if torch.compiler.is_compiling():
        return _compiled(rms, x, residual, weight, bias, eps)
    needs_grad = _needs_grad(x, residual, weight, bias)
    entry = _memoise(rms, given, (x, residual, weight, bias), eps, needs_grad) if key is not None else None
    if entry is not None:
        result = entry[2](x, residual, weight, bias)
        memo.remember(_memo, key, entry)
        return result
    if not needs_grad:
        out, h, _, _ = forward(rms, x, residual, weight, bias, eps)
        return (out, h) if residual is not None else out
    differentiable = _chosen_differentiable(rms, x, residual, weight, bias, eps) if key is None else None
    if differentiable is not None:
        return differentiable(x, residual, weight, bias)
    return _EagerNorm.apply(x, residual, weight, bias, _How(rms, eps, functools.partial(forward, rms, eps=eps),
                                                           functools.partial(backward, rms)))


# ----------------------------------------------------------------------------- eager calls, memoised

_memo: dict = {}  # key -> (backend, its op, call): portable_ops.memo's rules
# Classes whose == and hash stand for everything the checks read of an argument (bool is refused as an eps)
_PLAIN_EPS = (float, int, type(None))
_PLAIN_TENSOR = (torch.Tensor, torch.nn.Parameter)
_PLAIN_OPTIONAL = (torch.Tensor, torch.nn.Parameter, type(None))


def _needs_grad(x, residual, weight, bias) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or (residual is not None and residual.requires_grad)
                                        or (weight is not None and weight.requires_grad)
                                        or (bias is not None and bias.requires_grad))


def _layout_of(t):
    """What a memo key holds of a tensor: its shape, strides, dtype, device and 16-byte alignment."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


def _memo_key(rms, x, residual, weight, bias, eps):
    """The memo key of an eager call outside torch.func transforms with plain tensors (parameters included)
    and a plain eps; None for any other call, and for one whose forced backend is not a backend's name (the
    checked path says what is wrong, where the call gets that far). Written out: every eager call builds one."""
    if (torch.compiler.is_compiling() or x.__class__ not in _PLAIN_TENSOR or residual.__class__ not in _PLAIN_OPTIONAL
            or weight.__class__ not in _PLAIN_OPTIONAL or bias.__class__ not in _PLAIN_OPTIONAL
            or eps.__class__ not in _PLAIN_EPS or transformed()):
        return None
    try:
        return (rms, x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16,
                None if residual is None else _layout_of(residual), None if weight is None else _layout_of(weight),
                None if bias is None else _layout_of(bias), eps, _needs_grad(x, residual, weight, bias),
                memo.autocast_key(x), dispatch.state())
    except (RuntimeError, ValueError):  # no strides or storage (sparse, ...), or PORTABLE_OPS_BACKEND unknown
        return None


def _memoise(rms, given, cast, eps, needs_grad):
    """``(backend, its op, call)``, where ``call(x, residual, weight, bias)`` serves every call of the key of
    ``given`` (the tensors as the caller gave them; ``cast``: as :func:`_cast` casts them, checked); None where
    the call falls back (a fallback is not memoised: each warns, or raises under strict mode)."""
    x, residual, weight, bias = cast
    rows = _forward_call(rms, _rows(x), _rows(residual), weight, bias, eps)
    layout = call_layout(rows)
    _, backend_op = memo.choose(_FWD_OP[rms], layout, rows, x.device)
    if backend_op is None:
        return None
    backend, impl = backend_op
    differentiable = _differentiable(rms, impl, x, residual, weight, bias, eps) if needs_grad else None
    if differentiable is not None:  # torch's autograd runs the backward: no autograd.Function, no Python in it
        forward_rows, needs_grad = differentiable, False
    else:
        run = memo.prepared(impl, rows, _FWD_TENSORS[rms])
        forward_rows = _folded_forward(rms, run, x, residual is not None, statistics=needs_grad)
    compute = _autocast_off(forward_rows, x.device.type)
    if needs_grad:
        backward_rows = _prepared_backward(rms, layout, x, residual is not None, weight, bias is not None)
        how = _How(rms, eps, compute, backward_rows)
        finish = lambda x, residual, weight, bias: _EagerNorm.apply(x, residual, weight, bias, how)  # noqa: E731
    else:  # autograd.Function.apply costs tens of us of host time with nothing to differentiate
        finish = compute
    if any(a is not b for a, b in zip(cast, given)):  # this key's calls are cast, as the checked path casts them
        return backend, impl, lambda *tensors: finish(*_cast(*tensors))
    return backend, impl, finish


def _autocast_off(forward_rows, device_type):
    """``forward_rows`` as run_op runs a backend: its inputs cast before, autocast off while it runs."""
    if not memo.autocasting(device_type):
        return forward_rows

    def compute(x, residual, weight, bias):
        with memo.autocast_off(device_type):
            return forward_rows(x, residual, weight, bias)

    return compute


def _chosen_differentiable(rms, x, residual, weight, bias, eps):
    """For an eager call with no memo key (checked, cast): :func:`_differentiable` of the backend dispatch chooses,
    autocast off as it runs, or None (a fallback, warned of or raised under strict mode by dispatch just now)."""
    rows = _forward_call(rms, _rows(x), _rows(residual), weight, bias, eps)
    _, backend_op = memo.choose(_FWD_OP[rms], call_layout(rows), rows, x.device)
    differentiable = None if backend_op is None else _differentiable(rms, backend_op[1], x, residual, weight, bias,
                                                                       eps)
    return None if differentiable is None else _autocast_off(differentiable, x.device.type)


def _differentiable(rms, impl, x, residual, weight, bias, eps):
    """``forward(x, residual, weight, bias)`` returning what the public function does, through the backend's
    ``OpImpl.autograd`` (torch's differentiable ops), where it has one for this call; else None."""
    if impl.autograd is None:
        return None
    if rms:
        run = impl.autograd(x=x, residual=residual, weight=weight, eps=eps)
        return None if run is None else lambda x, residual, weight, bias: run(x, residual, weight)
    return impl.autograd(x=x, residual=residual, weight=weight, bias=bias, eps=eps)


def _folded_forward(rms, run, x, has_residual, statistics):
    """``forward(x, residual, weight, bias)`` through ``run`` (a prepared run of the forward op) for every x of this
    one's shape, in that shape: ``(out, h, mean, rstd)``, the statistics as rows, where ``statistics``; else what
    the public function returns (out, or ``(out, h)`` with a residual)."""
    shape, rows = x.shape, (-1, x.shape[-1])
    fold = x.dim() != 2

    def forward_rows(x, residual, weight, bias):
        if fold:
            x = x.reshape(rows)
            if has_residual:
                residual = residual.reshape(rows)
        result = run(x, residual, weight) if rms else run(x, residual, weight, bias)
        out, h = result[0], result[1]
        if fold:
            out = out.reshape(shape)
            h = None if h is None else h.reshape(shape)
        if statistics:
            return out, h, None if rms else result[2], result[-1]
        return (out, h) if has_residual else out

    return forward_rows


def _prepared_backward(rms, layout, x, has_residual, weight, has_bias):
    """``_How.backward`` for every call of a memoised key (x and weight: the forward's, cast): the backward
    op with its dispatch memoised per forced backend and its backend's run prepared, both at its first call
    (``memo.prepared_backward``), dout and dh of any layout. Where what the forward saved (x, or the sum with a
    residual) or the weight no longer has the forward's layout (a ``.data`` swapped since), :func:`backward` runs."""
    names = _BWD_TENSORS[rms]
    options = {} if rms else {"has_bias": has_bias}
    run = memo.prepared_backward(_BWD_OP[rms], layout, x.device, lambda *given: dict(zip(names, given), **options),
                                 names, ("dout", "dh"))
    # the sum is the backend's, contiguous in x's shape (and so aligned)
    saved = _layout_of(x) if not has_residual else (x.shape, x.new_empty(x.shape, device="meta").stride(), x.dtype,
                                                     x.device, 0)
    expected = (saved, _layout_of(weight))
    shape, rows = x.shape, (-1, x.shape[-1])
    fold = x.dim() != 2

    def run_backward(x, weight, mean, rstd, dout, dh, has_bias, prefer):
        if (_layout_of(x), _layout_of(weight)) != expected:
            return backward(rms, x, weight, mean, rstd, dout, dh, has_bias, prefer)
        if fold:
            x, dout = x.reshape(rows), dout.reshape(rows)
            dh = None if dh is None else dh.reshape(rows)
        result = run(prefer, x, weight, rstd, dout, dh) if rms else run(prefer, x, weight, mean, rstd, dout, dh)
        dx = result[0].reshape(shape) if fold else result[0]
        return dx, result[1], None if rms else result[2]

    return run_backward


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
