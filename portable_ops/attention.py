"""Fused attention: differentiable, autocast-aware, reachable from torch.compile and torch.func.

The backend is chosen when a call runs, from the tensors it gets (their device, shapes, strides
and dtypes; memoised per layout) and from the backend forced at that moment: a graph compiled
outside ``use_backend(...)`` follows a backend forced later, with no recompilation.

Three thin autograd wrappers run the same two functions, :func:`forward` and :func:`backward`:

* eager calls: :class:`EagerAttention`, an old-style ``autograd.Function`` (the custom ops'
  dispatcher costs ~80 us a call with autograd on; ``setup_context``-style functions bind their
  arguments through ``inspect`` on every call, ~50 us). Its backward supports
  ``create_graph=True`` by differentiating the definition again. Packed attention
  (``portable_ops/attention_varlen.py``) runs through the same class.
* torch.compile: the ``torch.library`` custom ops ``portable_ops::attention_fwd`` / ``_bwd``,
  opaque to the graph, whose fake implementations allocate what the real ones return
  (``portable_ops.layout``), so any input strides and dynamic shapes trace without graph breaks.
  Their autograd comes from :func:`register_autograd`, which the packed ops share.
* torch.func transforms (``vmap``, ``grad``, ``jvp``, ...) and forward-mode AD:
  :class:`_FuncAttention`, a ``setup_context``-style function with a batching rule that folds the
  vmapped dimension into the batch and a forward-mode rule.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch.autograd import forward_ad

from . import checks, dispatch, layout, memo
from .definitions import attention as definition
from .dispatch import forced_backend, select_by_layout
from .memo import autocast_off, run_choice
from .memo import autocasting as _autocasting


def autocast_inputs(q, k, v):
    """SDPA's autocast policy: under autocast every floating input but float64 is cast to the
    autocast dtype of its device type (its lower-precision list, on CUDA, CPU and XLA alike)."""
    device_type = q.device.type if isinstance(q, torch.Tensor) else None
    if device_type is None or not _autocasting(device_type):
        return q, k, v
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 else t for t in (q, k, v))


def _checked(q, k, v, causal, scale, window, softcap, sinks=None):
    """One call's arguments, checked (after autocast's casts; sinks cast to lse's dtype), as the backends take
    them: a tuple, which the eager call unpacks faster than :func:`attention_call`'s dict."""
    q, k, v = autocast_inputs(q, k, v)
    checks.check_attention(q, k, v)
    return (q, k, v, checks.attention_sinks(sinks, q, 1),
            *checks.attention_options(q.shape[-1], causal, scale, window, softcap,
                                      compiling=torch.compiler.is_compiling()))


def attention_call(q, k, v, causal, scale, window=None, softcap=None, sinks=None):
    """Check one call's arguments (after autocast's casts) and return them as the backends take them."""
    q, k, v, sinks, causal, scale, window, softcap = _checked(q, k, v, causal, scale, window, softcap, sinks)
    return dict(q=q, k=k, v=v, causal=causal, scale=scale, window=window, softcap=softcap, sinks=sinks)


def _layout(q, k, v, causal, scale, window, softcap, sinks=None, dlse=None):
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, causal, scale, window, softcap,
            sinks is not None, dlse is not None)


def call_layout(call) -> tuple:
    """A call's memoisation key for ``select_by_layout``: its tensors' shapes, strides and dtypes and its
    other arguments. For the ops whose host time is not (yet) critical; dense attention's
    :func:`_layout` is written out, as it runs on every eager call."""
    return tuple((t.shape, t.stride(), t.dtype) if isinstance(t, torch.Tensor) else t for t in call.values())


def run_op(op, call, layout, device, prefer):
    """Run ``op(**call)`` on the backend chosen for it, autocast off (the inputs are cast already)."""
    return run_choice(op, select_by_layout(op, layout, lambda: call, device, prefer), call, device)


def forward(q, k, v, sinks, causal, scale, window=None, softcap=None):
    """(out, lse) from the backend chosen for this call."""
    call = dict(q=q, k=k, v=v, causal=causal, scale=scale, window=window, softcap=softcap, sinks=sinks)
    return run_op("attention_fwd", call, _layout(q, k, v, causal, scale, window, softcap, sinks), q.device, None)


def with_dsinks(grads, sinks) -> tuple:
    """A backward op's gradients as ``(dq, dk, dv, dsinks)``: it returns ``dsinks`` only where there are sinks."""
    return grads if sinks is not None else (*grads, None)


def backward(q, k, v, out, lse, dout, dlse, sinks, causal, scale, window=None, softcap=None, prefer=None):
    """(dq, dk, dv, dsinks) from the backend chosen for this call (dsinks None without sinks; ``dlse``: None, or
    the gradient that reached lse); ``prefer``: the backend forced when the forward ran, which the backward keeps
    (``loss.backward()`` usually runs outside the block that forced a backend for the forward)."""
    call = dict(q=q, k=k, v=v, out=out, lse=lse, dout=dout, causal=causal, scale=scale, window=window,
                softcap=softcap, sinks=sinks, dlse=dlse)
    layout = _layout(q, k, v, causal, scale, window, softcap, sinks, dlse)
    return with_dsinks(run_op("attention_bwd", call, layout, q.device, prefer), sinks)


def _definition(q, k, v, sinks, causal, scale, window, softcap):
    return definition.attention_fwd(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
                                    sinks=sinks)


class Variant:
    """One kind of attention as :class:`EagerAttention` runs it: its ``options`` (the arguments after
    q, k, v and sinks) start with ``index_tensors`` tensors (saved for the backward, so an in-place change
    between forward and backward is caught), then plain values."""

    __slots__ = ("forward", "backward", "definition", "index_tensors")

    def __init__(self, forward: Callable, backward: Callable, definition: Callable, index_tensors: int = 0):
        self.forward = forward  # (q, k, v, sinks, *options) -> (out, lse)
        # (q, k, v, out, lse, dout, dlse, sinks, *options, prefer=...) -> (dq, dk, dv, dsinks)
        self.backward = backward
        self.definition = definition  # (q, k, v, sinks, *options) -> (out, lse): the definition, differentiable twice
        self.index_tensors = index_tensors


class Options:
    """A variant and one call's options, handed to :class:`EagerAttention` as one argument: ``Function.apply``
    walks its arguments as a pytree on every call, ~0.2 us per argument."""

    __slots__ = ("variant", "values")

    def __init__(self, variant: Variant, values: tuple):
        self.variant, self.values = variant, values


DENSE = Variant(forward, backward, _definition)


def _differentiated_again(definition, q, k, v, sinks, dout, dlse, options, needs_grad):
    """First derivatives that are themselves differentiable (``create_graph=True``): the kernels'
    backward is not, so the definition is differentiated instead, one block of queries
    at a time (its autograd graph keeps every block's probabilities: O(Sq x Skv) memory)."""
    inputs = [t for t, needed in zip((q, k, v, sinks), needs_grad) if needed]
    with torch.enable_grad(), autocast_off(q.device.type):
        out, lse = definition(q, k, v, sinks, *options)
        outputs, grads_in = ((out,), (dout,)) if dlse is None else ((out, lse), (dout, dlse))
        grads = iter(torch.autograd.grad(outputs, inputs, grads_in, create_graph=True))
    return tuple(next(grads) if needed else None for needed in needs_grad)


# ----------------------------------------------------------------------------- eager

class EagerAttention(torch.autograd.Function):
    """``apply(q, k, v, sinks, Options(variant, options))`` -> (out, lse), differentiable in q, k, v and sinks
    (None: no sinks), through out and lse."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, how):
        variant, options = how.variant, how.values
        out, lse = variant.forward(q, k, v, sinks, *options)
        ctx.save_for_backward(q, k, v, out, lse, sinks, *options[:variant.index_tensors])
        ctx.variant, ctx.options, ctx.prefer = variant, options[variant.index_tensors:], forced_backend()
        ctx.set_materialize_grads(False)  # a dlse materialised would cost a zero-filled tensor every call
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None and dlse is None:  # no gradient reached the outputs (gradcheck sends such a call)
            return None, None, None, None, None
        q, k, v, out, lse, sinks, *index = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        options = (*index, *ctx.options)
        if torch.is_grad_enabled():  # create_graph=True
            grads = _differentiated_again(ctx.variant.definition, q, k, v, sinks, dout, dlse, options,
                                          ctx.needs_input_grad[:4])
        else:
            grads = ctx.variant.backward(q, k, v, out, lse, dout, dlse, sinks, *options, prefer=ctx.prefer)
        return *grads, None


# ----------------------------------------------------------------------------- torch.compile

def window_args(window) -> tuple:
    """``window`` as the custom ops take it: ``(left, right)``, None for no window or an unbounded side."""
    return (None, None) if window is None else window


def window_of(left, right):
    """The inverse of :func:`window_args`."""
    return None if left is None and right is None else (left, right)


def lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def register_autograd(fwd_op, bwd_op, index_tensors=0):
    """Autograd for a forward op ``(q, k, v, *options, sinks) -> (out, lse)`` through its backward op
    ``(q, k, v, out, lse, dout, *options, sinks, dlse) -> (dq, dk, dv, dsinks)`` (dsinks: :func:`op_grads`); the
    first ``index_tensors`` options are tensors, saved for the backward."""
    def setup_context(ctx, inputs, output):
        q, k, v, *options, sinks = inputs
        ctx.save_for_backward(q, k, v, *output, sinks, *options[:index_tensors])
        ctx.options = options[index_tensors:]
        ctx.set_materialize_grads(False)  # no dlse unless lse was used: the backend's fast path

    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks, *index = ctx.saved_tensors
        options = (*index, *ctx.options)
        dout = torch.zeros_like(out) if dout is None else dout
        dq, dk, dv, dsinks = bwd_op(q, k, v, out, lse, dout, *options, sinks, dlse)
        return dq, dk, dv, *(None,) * len(options), dsinks if sinks is not None else None

    fwd_op.register_autograd(backward, setup_context=setup_context)


def op_grads(grads) -> tuple:
    """``(dq, dk, dv, dsinks)`` as a custom op returns them: an empty dsinks without sinks (its schema has no
    optional outputs)."""
    dq, dk, dv, dsinks = grads
    return dq, dk, dv, dsinks if dsinks is not None else dq.new_empty(0, dtype=lse_dtype(dq))


def fake_dsinks(q, sinks):
    return q.new_empty(0 if sinks is None else sinks.shape[0], dtype=lse_dtype(q))


@torch.library.custom_op("portable_ops::attention_fwd", mutates_args=())
def _attention_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                      window_left: int | None = None, window_right: int | None = None, softcap: float | None = None,
                      scale_tensor: torch.Tensor | None = None, softcap_tensor: torch.Tensor | None = None,
                      sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    scale, softcap = checks.op_values(scale, softcap, scale_tensor, softcap_tensor)
    return forward(q, k, v, sinks, causal, scale, window_of(window_left, window_right), softcap)


@_attention_fwd_op.register_fake
def _(q, k, v, causal, scale, window_left=None, window_right=None, softcap=None, scale_tensor=None,
      softcap_tensor=None, sinks=None):
    return layout.empty_like(q, head_dim=v.shape[-1]), q.new_empty(q.shape[:-1], dtype=lse_dtype(q))


@torch.library.custom_op("portable_ops::attention_bwd", mutates_args=())
def _attention_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                      dout: torch.Tensor, causal: bool, scale: float, window_left: int | None = None,
                      window_right: int | None = None, softcap: float | None = None,
                      scale_tensor: torch.Tensor | None = None, softcap_tensor: torch.Tensor | None = None,
                      sinks: torch.Tensor | None = None, dlse: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    scale, softcap = checks.op_values(scale, softcap, scale_tensor, softcap_tensor)
    window = window_of(window_left, window_right)
    return op_grads(backward(q, k, v, out, lse, dout, dlse, sinks, causal, scale, window, softcap))


@_attention_bwd_op.register_fake
def _(q, k, v, out, lse, dout, causal, scale, window_left=None, window_right=None, softcap=None, scale_tensor=None,
      softcap_tensor=None, sinks=None, dlse=None):
    return layout.empty_like(q), layout.empty_like(k), layout.empty_like(v), fake_dsinks(q, sinks)


register_autograd(_attention_fwd_op, _attention_bwd_op)


# ----------------------------------------------------------------------------- torch.func

def _batched(tensors, in_dims, size):
    """Fold a vmapped dimension into the batch: ``[N, B, ...]`` -> ``[N * B, ...]`` (unbatched
    inputs are expanded to ``N``; None stays None)."""
    folded = []
    for t, dim in zip(tensors, in_dims):
        if t is None:
            folded.append(None)
            continue
        t = t.movedim(dim, 0) if dim is not None else t.expand(size, *t.shape)
        folded.append(t.reshape(size * t.shape[1], *t.shape[2:]))
    return folded


def _unbatched(tensors, size):
    return tuple(t.reshape(size, t.shape[0] // size, *t.shape[1:]) for t in tensors)


def _sample_by_sample(function, info, in_dims, args):
    """``function(*args)`` under vmap, one sample at a time, the results stacked: where a sink's gradient (a sum
    over the batch) or a vmapped sinks (one per sample) keeps the samples from folding into the batch."""
    samples = [function(*(a.select(dim, i) if isinstance(a, torch.Tensor) and dim is not None else a
                          for a, dim in zip(args, in_dims))) for i in range(info.batch_size)]
    return tuple(torch.stack(results) for results in zip(*samples)), (0,) * len(samples[0])


class _FuncAttention(torch.autograd.Function):
    @staticmethod
    def forward(q, k, v, sinks, causal, scale, window, softcap):
        return forward(q, k, v, sinks, causal, scale, window, softcap)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, sinks, *options = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.save_for_forward(q, k, v, lse, sinks)
        ctx.options, ctx.prefer = options, forced_backend()
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        dq, dk, dv, dsinks = _FuncAttentionBackward.apply(q, k, v, out, lse, dout, dlse, sinks, *ctx.options,
                                                          ctx.prefer)
        return dq, dk, dv, dsinks if sinks is not None else None, *(None,) * len(ctx.options)

    @staticmethod
    def jvp(ctx, tq, tk, tv, tsinks, *_options):
        q, k, v, lse, sinks = ctx.saved_tensors
        causal, scale, window, softcap = ctx.options
        with autocast_off(q.device.type):
            return definition.attention_jvp(q, k, v, lse, tq, tk, tv, causal=causal, scale=scale, window=window,
                                           softcap=softcap, sinks=sinks, tsinks=tsinks)

    @staticmethod
    def vmap(info, in_dims, q, k, v, sinks, *options):
        if in_dims[3] is not None:
            return _sample_by_sample(_FuncAttention.apply, info, in_dims, (q, k, v, sinks, *options))
        out = _FuncAttention.apply(*_batched((q, k, v), in_dims[:3], info.batch_size), sinks, *options)
        return _unbatched(out, info.batch_size), (0, 0)


_NO_SECOND_DERIVATIVES = ("portable_ops.attention: second derivatives inside torch.func transforms (hessian, "
                          "jacfwd(jacrev), grad(grad)) are not supported; outside them, "
                          "torch.autograd.grad(..., create_graph=True) is")


class _FuncAttentionBackward(torch.autograd.Function):
    """``(dq, dk, dv, dsinks)``, dsinks empty without sinks (a vmapped function returns tensors)."""

    @staticmethod
    def forward(q, k, v, out, lse, dout, dlse, sinks, causal, scale, window, softcap, prefer):
        return op_grads(backward(q, k, v, out, lse, dout, dlse, sinks, causal, scale, window, softcap, prefer))

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(_NO_SECOND_DERIVATIVES)

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError(_NO_SECOND_DERIVATIVES)

    @staticmethod
    def vmap(info, in_dims, q, k, v, out, lse, dout, dlse, sinks, *options):
        if sinks is not None:  # each sample's dsinks is its own sum over the batch
            return _sample_by_sample(_FuncAttentionBackward.apply, info, in_dims, (q, k, v, out, lse, dout, dlse,
                                                                                   sinks, *options))
        *grads, dsinks = _FuncAttentionBackward.apply(*_batched((q, k, v, out, lse, dout, dlse), in_dims[:7],
                                                                info.batch_size), sinks, *options)
        return (*_unbatched(grads, info.batch_size), dsinks), (0, 0, 0, None)


# ----------------------------------------------------------------------------- the public function

def refuse_transforms(op: str, *tensors) -> None:
    """For the ops that have no torch.func or forward-mode AD rules: a clear error naming the op, before their
    checks read an index tensor (which inside a transform fails with a message about storage) and before a
    tangent could be dropped silently."""
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(f"portable_ops.{op} does not support torch.func transforms (vmap, grad, jvp, ...) yet; "
                           f"portable_ops.attention does")
    if forward_ad._current_level >= 0 and any(isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent
                                              is not None for t in tensors):
        raise RuntimeError(f"portable_ops.{op} does not support forward-mode AD (torch.autograd.forward_ad) yet: "
                           f"an input carries a tangent; portable_ops.attention does")


def transformed() -> bool:
    return torch._C._are_functorch_transforms_active() or forward_ad._current_level >= 0


def degenerate(q, k, v, sinks=None):
    """Inputs with a zero-size dimension: SDPA's answer (zeros where a query sees no key, empty
    otherwise) and each row's lse (-inf, or its sink, where it sees no key), built from torch ops so that
    gradients (zeros, or empty, or the sinks') flow to q, k, v and sinks."""
    groups = q.shape[1] // k.shape[1] if k.shape[1] else 1
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2)
    if sinks is not None:  # one more column, dropped after the softmax (gpt-oss's formula)
        scores = torch.cat([scores, sinks.to(scores.dtype)[:, None, None].expand(*scores.shape[:-1], 1)], dim=-1)
    weights = torch.softmax(scores, dim=-1)
    lse = torch.logsumexp(scores.to(lse_dtype(q)), dim=-1)
    return (weights if sinks is None else weights[..., :-1]) @ v, lse


# ----------------------------------------------------------------------------- eager calls, memoised
#
# An eager call is memoised whole: its checks, its dispatch and its backend's plan depend only on what
# the key below holds, so a call whose key was seen casts (under autocast) and runs the backend's
# prepared ``run`` at once, through EagerAttention where it needs autograd, whose backward is
# dispatched and prepared once, at its first call (_prepared_backward). On the H100's host the
# layers it skips cost more than a kernel launch (docs/performance.md, "The eager call's host path").

# Classes whose == and hash stand for everything the checks read of an option: a float window side is an
# error, and 2.0 == 2, so a window's sides must be ints
_PLAIN_NUMBER = (int, float, type(None))
_PLAIN_INT = (int, type(None))
_OP = "attention_fwd"
_BWD_OP = "attention_bwd"
_TENSORS = ("q", "k", "v")
_BWD_TENSORS = ("q", "k", "v", "out", "lse", "dout")
_memo: dict = {}  # key -> (backend, its op, call): portable_ops.memo's rules


def _plain_window(window) -> bool:
    return window is None or (window.__class__ is tuple and len(window) == 2
                              and window[0].__class__ in _PLAIN_INT and window[1].__class__ in _PLAIN_INT)


def _needs_grad(q, k, v, sinks=None) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (sinks is not None and sinks.requires_grad))


def _signed(x):
    """``x``, told apart from its negative zero (0.0 == -0.0, with one hash; the sign reaches the gradients)."""
    return x if x or x is None else (x, math.copysign(1.0, x))


def _memo_key(q, k, v, causal, scale, window, softcap):
    """The memo key of an eager call outside torch.func transforms with plain tensors and plain Python
    options; None for any other call, and for one whose forced backend is not a backend's name (the
    checked path says what is wrong, where the call gets that far)."""
    if (torch.compiler.is_compiling() or type(q) is not torch.Tensor or type(k) is not torch.Tensor
            or type(v) is not torch.Tensor or causal.__class__ is not bool or scale.__class__ not in _PLAIN_NUMBER
            or softcap.__class__ not in _PLAIN_NUMBER or not _plain_window(window) or transformed()):
        return None
    try:
        return (_tensors_key(q, k, v), causal, _signed(scale), window, softcap, _needs_grad(q, k, v),
                memo.autocast_key(q), dispatch.state())
    except (RuntimeError, ValueError):  # no strides or storage (sparse, ...), or PORTABLE_OPS_BACKEND unknown
        return None


def _tensors_key(q, k, v) -> tuple:
    """What the memo's key holds of q, k and v: shapes, strides, dtypes, devices and 16-byte alignment."""
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype, q.device,
            k.device, v.device, q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16)


def _memoised(key):
    """The memoised call of ``key``, unless its backend's op was replaced since (tests stand ones in)."""
    return memo.memoised(_memo, key, _OP)


def _prepared_backward(q, k, v, causal, scale, window, softcap):
    """The backward of every call of a memoised key (q, k, v: as the forward took them, cast): :func:`backward`
    with its dispatch memoised per forced backend and its backend's run prepared, both at its first call
    (``memo.prepared_backward``). A call whose q, k or v no longer has its forward's layout (a ``.data`` swapped
    since) runs :func:`backward` itself."""
    tensors = _tensors_key(q, k, v)
    options = dict(causal=causal, scale=scale, window=window, softcap=softcap)
    run = memo.prepared_backward(_BWD_OP, _layout(q, k, v, causal, scale, window, softcap), q.device,
                                 lambda *given: dict(zip(_BWD_TENSORS, given), **options), _BWD_TENSORS,
                                 ("out", "lse", "dout"))

    def run_backward(q, k, v, out, lse, dout, dlse, sinks, *options, prefer=None):
        if _tensors_key(q, k, v) != tensors:
            return backward(q, k, v, out, lse, dout, dlse, sinks, *options, prefer=prefer)
        return (*run(prefer, q, k, v, out, lse, dout), None)

    return run_backward


def _memoise(key, q, k, v, causal, scale, window, softcap):
    """``(backend, its op, call)``, where ``call(q, k, v) -> out`` serves every call of this one's key (q, k, v:
    checked, as autocast casts them); None where the call falls back (a fallback is not memoised: each warns,
    or raises under strict mode)."""
    arguments = dict(q=q, k=k, v=v, causal=causal, scale=scale, window=window, softcap=softcap)
    _, backend_op = memo.choose(_OP, _layout(q, k, v, causal, scale, window, softcap), arguments, q.device)
    if backend_op is None:
        return None
    backend, impl = backend_op
    run = memo.prepared(impl, arguments, _TENSORS)
    device_type = q.device.type
    autocast = _autocasting(device_type)
    if autocast:
        def compute(q, k, v):  # as run_op does: the inputs cast before, the backend run with autocast off
            with autocast_off(device_type):
                return run(q, k, v)
    else:
        compute = run
    if _needs_grad(q, k, v):
        options = Options(Variant(lambda q, k, v, *_: compute(q, k, v),
                                  _prepared_backward(q, k, v, causal, scale, window, softcap), _definition),
                          (causal, scale, window, softcap))
        finish = lambda q, k, v: EagerAttention.apply(q, k, v, None, options)[0]  # noqa: E731
    else:  # autograd.Function.apply costs 20-50 us of host time even with nothing to differentiate
        finish = lambda q, k, v: compute(q, k, v)[0]  # noqa: E731
    call = (lambda q, k, v: finish(*autocast_inputs(q, k, v))) if autocast else finish
    return backend, impl, call


def attention(q, k, v, *, causal=False, scale=None, window=None, softcap=None, sinks=None, return_lse=False):
    """Softmax attention of q ``[B, Hq, Sq, D]`` over k ``[B, Hkv, Skv, D]`` and v ``[B, Hkv, Skv, Dv]`` (v's head
    dim may be its own: DeepSeek's MLA), ``Hq % Hkv == 0``; out is ``[B, Hq, Sq, Dv]``.

    Query ``i`` sits at key position ``p = i + Skv - Sq`` (masks are aligned to the bottom right, so
    with ``Sq == 1`` the one query is the newest token of a KV cache). ``causal`` hides keys
    ``j > p``; ``window=(left, right)`` hides keys outside ``p - left <= j <= p + right`` (None for
    an unbounded side). ``scale`` defaults to ``1 / sqrt(D)``; ``softcap`` (None or 0: off) replaces
    each scaled score ``s`` by ``softcap * tanh(s / softcap)`` before the mask. ``sinks`` (None, or a
    floating tensor ``[Hq]`` on q's device: gpt-oss's learned sinks) adds ``exp(sinks[h])`` to each row's
    softmax denominator, a term that carries no value (not scaled, not capped). Equal to
    ``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)``
    when ``Sq == Skv`` and there is no window, softcap or sink, autocast included. Differentiable in q, k,
    v and sinks, twice with ``create_graph=True``; the output's memory layout follows q's
    (``portable_ops.layout``). ``return_lse=True`` returns ``(out, lse)``: ``lse [B, Hq, Sq]`` float32 (float64
    for float64 q), each row's natural-log softmax denominator, its sink included (-inf where a row sees
    nothing), with an exact gradient. ``docs/api.md``, "Attention features", has the details.
    """
    key = _memo_key(q, k, v, causal, scale, window, softcap) if sinks is None and return_lse is False else None
    call = _memoised(key) if key is not None else None
    if call is not None:
        return call(q, k, v)
    q, k, v, sinks, causal, scale, window, softcap = _checked(q, k, v, causal, scale, window, softcap, sinks)
    return_lse = checks.flag("return_lse", return_lse)
    return as_returned(_attention(q, k, v, sinks, causal, scale, window, softcap, key), return_lse)


def as_returned(result, return_lse: bool):
    """``(out, lse)`` or ``out`` alone: what the caller asked for."""
    return result if return_lse else result[0]


def _attention(q, k, v, sinks, causal, scale, window, softcap, key):
    """``(out, lse)`` of a checked call; ``key``: its memo key, or None where it is not memoised."""
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        return degenerate(q, k, v, sinks)
    if torch.compiler.is_compiling():
        scale, softcap, scale_tensor, softcap_tensor = checks.op_scalars(scale, softcap)
        return _attention_fwd_op(q, k, v, causal, scale, *window_args(window), softcap, scale_tensor,
                                 softcap_tensor, sinks)
    if transformed():
        return _FuncAttention.apply(q, k, v, sinks, causal, scale, window, softcap)
    entry = _memoise(key, q, k, v, causal, scale, window, softcap) if key is not None else None
    if entry is not None:
        out = entry[2](q, k, v)
        memo.remember(_memo, key, entry)
        return out, None
    if not _needs_grad(q, k, v, sinks):
        return forward(q, k, v, sinks, causal, scale, window, softcap)
    return EagerAttention.apply(q, k, v, sinks, Options(DENSE, (causal, scale, window, softcap)))
