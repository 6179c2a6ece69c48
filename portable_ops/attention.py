"""Fused attention: differentiable, autocast-aware, reachable from torch.compile and torch.func.

The backend is chosen when a call runs, from the tensors it gets (their device, shapes, strides
and dtypes; memoised per layout) and from the backend forced at that moment: a graph compiled
outside ``use_backend(...)`` follows a backend forced later, with no recompilation.

Three thin autograd wrappers run the same two functions, :func:`forward` and :func:`backward`:

* eager calls: :class:`_EagerAttention`, an old-style ``autograd.Function`` (the custom ops'
  dispatcher costs ~80 us a call with autograd on; ``setup_context``-style functions bind their
  arguments through ``inspect`` on every call, ~50 us). Its backward supports
  ``create_graph=True`` by differentiating the reference definition again.
* torch.compile: the ``torch.library`` custom ops ``portable_ops::attention_fwd`` / ``_bwd``,
  opaque to the graph, whose fake implementations allocate what the real ones return
  (``portable_ops.layout``), so any input strides and dynamic shapes trace without graph breaks.
* torch.func transforms (``vmap``, ``grad``, ``jvp``, ...) and forward-mode AD:
  :class:`_FuncAttention`, a ``setup_context``-style function with a batching rule that folds the
  vmapped dimension into the batch and a forward-mode rule.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.autograd import forward_ad

from . import checks, layout
from .backends.reference import attention as reference
from .dispatch import forced_backend, get_backend, select_by_layout


def _autocasting(device_type: str) -> bool:
    if torch.compiler.is_compiling():
        # Dynamo (torch 2.11) can't trace is_autocast_available; it only compiles for device
        # types that have autocast
        return torch.is_autocast_enabled(device_type)
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def _autocast_off(device_type: str):
    """Autocast off for a backend's computation: the inputs are already cast (:func:`_autocast`); left
    on, autocast would also run the float32 products and accumulations (the reference's, the
    emulator's) in the low dtype."""
    return torch.autocast(device_type, enabled=False) if _autocasting(device_type) else contextlib.nullcontext()


def _autocast(q, k, v):
    """SDPA's autocast policy: under autocast every floating input but float64 is cast to the
    autocast dtype of its device type (its lower-precision list, on CUDA, CPU and XLA alike)."""
    device_type = q.device.type if isinstance(q, torch.Tensor) else None
    if device_type is None or not _autocasting(device_type):
        return q, k, v
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 else t for t in (q, k, v))


def attention_call(q, k, v, causal, scale):
    """Check one call's arguments (after autocast's casts) and return them as the backends take them."""
    q, k, v = _autocast(q, k, v)
    # Under torch.compile a float scale that changes between calls is symbolic: reading its value
    # here would break the graph or recompile per value, so the custom op checks it when it runs.
    compiling = torch.compiler.is_compiling()
    checks.check_attention(q, k, v, causal, scale, check_scale_value=not compiling)
    if scale is None:
        d = int(q.shape[-1])  # under torch.compile this specialises the head dim: the kernels do too
        scale = 1.0 / math.sqrt(d) if d else 1.0
    elif not (compiling and isinstance(scale, float)):
        scale = float(checks.as_number(scale))
    return dict(q=q, k=k, v=v, causal=bool(causal), scale=scale)


def _layout(q, k, v, causal, scale):
    return (q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, causal, scale)


def _implementation(op, call, prefer):
    choice = select_by_layout(op, _layout(call["q"], call["k"], call["v"], call["causal"], call["scale"]),
                              lambda: call, call["q"].device, prefer)
    return get_backend(choice.backend).ops[op]


def _run(op, call, prefer):
    run = _implementation(op, call, prefer).run
    with _autocast_off(call["q"].device.type):
        return run(**call)


def forward(q, k, v, causal, scale):
    """(out, lse) from the backend chosen for this call."""
    return _run("attention_fwd", dict(q=q, k=k, v=v, causal=causal, scale=scale), None)


def backward(q, k, v, out, lse, dout, causal, scale, prefer=None):
    """(dq, dk, dv) from the backend chosen for this call; ``prefer``: the backend forced when the
    forward ran, which the backward keeps (``loss.backward()`` usually runs outside the block that
    forced a backend for the forward)."""
    return _run("attention_bwd", dict(q=q, k=k, v=v, out=out, lse=lse, dout=dout, causal=causal, scale=scale),
                prefer)


def _differentiated_again(q, k, v, dout, causal, scale, needs_grad):
    """First derivatives that are themselves differentiable (``create_graph=True``): the kernels'
    backward is not, so the reference definition is differentiated instead, one block of queries
    at a time (its autograd graph keeps every block's probabilities: O(Sq x Skv) memory)."""
    inputs = [t for t, needed in zip((q, k, v), needs_grad) if needed]
    with torch.enable_grad(), _autocast_off(q.device.type):
        out, _ = reference.attention_fwd(q, k, v, causal=causal, scale=scale)
        grads = iter(torch.autograd.grad(out, inputs, dout, create_graph=True))
    return tuple(next(grads) if needed else None for needed in needs_grad)


# ----------------------------------------------------------------------------- eager

class _EagerAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        out, lse = forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.prefer = causal, scale, forced_backend()
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # _dlse, materialised, would cost a zero-filled tensor every call
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # no gradient reached the output (gradcheck sends such a call)
            return None, None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True
            grads = _differentiated_again(q, k, v, dout, ctx.causal, ctx.scale, ctx.needs_input_grad[:3])
        else:
            grads = backward(q, k, v, out, lse, dout, ctx.causal, ctx.scale, ctx.prefer)
        return (*grads, None, None)


# ----------------------------------------------------------------------------- torch.compile

@torch.library.custom_op("portable_ops::attention_fwd", mutates_args=())
def _attention_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    checks.check_number("scale", scale)
    return forward(q, k, v, causal, scale)


def _lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@_attention_fwd_op.register_fake
def _(q, k, v, causal, scale):
    return layout.empty_like(q), q.new_empty(q.shape[:-1], dtype=_lse_dtype(q))


@torch.library.custom_op("portable_ops::attention_bwd", mutates_args=())
def _attention_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                      dout: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return backward(q, k, v, out, lse, dout, causal, scale)


@_attention_bwd_op.register_fake
def _(q, k, v, out, lse, dout, causal, scale):
    return layout.empty_like(q), layout.empty_like(k), layout.empty_like(v)


def _op_setup_context(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.causal, ctx.scale = causal, scale


def _op_backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    return (*_attention_bwd_op(q, k, v, out, lse, dout, ctx.causal, ctx.scale), None, None)


_attention_fwd_op.register_autograd(_op_backward, setup_context=_op_setup_context)


# ----------------------------------------------------------------------------- torch.func

def _batched(tensors, in_dims, size):
    """Fold a vmapped dimension into the batch: ``[N, B, ...]`` -> ``[N * B, ...]`` (unbatched
    inputs are expanded to ``N``)."""
    folded = []
    for t, dim in zip(tensors, in_dims):
        t = t.movedim(dim, 0) if dim is not None else t.expand(size, *t.shape)
        folded.append(t.reshape(size * t.shape[1], *t.shape[2:]))
    return folded


def _unbatched(tensors, size):
    return tuple(t.reshape(size, t.shape[0] // size, *t.shape[1:]) for t in tensors)


class _FuncAttention(torch.autograd.Function):
    @staticmethod
    def forward(q, k, v, causal, scale):
        return forward(q, k, v, causal, scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, causal, scale = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.save_for_forward(q, k, v, lse)
        ctx.causal, ctx.scale, ctx.prefer = causal, scale, forced_backend()
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        return (*_FuncAttentionBackward.apply(q, k, v, out, lse, dout, ctx.causal, ctx.scale, ctx.prefer), None,
                None)

    @staticmethod
    def jvp(ctx, tq, tk, tv, _causal, _scale):
        q, k, v, lse = ctx.saved_tensors
        with _autocast_off(q.device.type):
            return reference.attention_jvp(q, k, v, lse, tq, tk, tv, causal=ctx.causal, scale=ctx.scale), None

    @staticmethod
    def vmap(info, in_dims, q, k, v, causal, scale):
        out = _FuncAttention.apply(*_batched((q, k, v), in_dims[:3], info.batch_size), causal, scale)
        return _unbatched(out, info.batch_size), (0, 0)


_NO_SECOND_DERIVATIVES = ("portable_ops.attention: second derivatives inside torch.func transforms (hessian, "
                          "jacfwd(jacrev), grad(grad)) are not supported; outside them, "
                          "torch.autograd.grad(..., create_graph=True) is")


class _FuncAttentionBackward(torch.autograd.Function):
    @staticmethod
    def forward(q, k, v, out, lse, dout, causal, scale, prefer):
        return backward(q, k, v, out, lse, dout, causal, scale, prefer)

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
    def vmap(info, in_dims, q, k, v, out, lse, dout, causal, scale, prefer):
        grads = _FuncAttentionBackward.apply(*_batched((q, k, v, out, lse, dout), in_dims[:6], info.batch_size),
                                             causal, scale, prefer)
        return _unbatched(grads, info.batch_size), (0, 0, 0)


# ----------------------------------------------------------------------------- the public function

def _transformed() -> bool:
    return torch._C._are_functorch_transforms_active() or forward_ad._current_level >= 0


def _degenerate(q, k, v):
    """Inputs with a zero-size dimension: SDPA's answer (zeros where a query sees no key, empty
    otherwise), built from torch ops so that gradients (zeros, or empty) flow to q, k and v."""
    groups = q.shape[1] // k.shape[1] if k.shape[1] else 1
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v


def attention(q, k, v, *, causal=False, scale=None):
    """Softmax attention of q ``[B, Hq, Sq, D]`` over k, v ``[B, Hkv, Skv, D]``, ``Hq % Hkv == 0``.

    ``causal`` masks key ``j`` from query ``i`` when ``j > i + Skv - Sq`` (the mask is aligned
    to the bottom right, so with ``Sq == 1`` the one query sees the whole KV cache). ``scale``
    defaults to ``1 / sqrt(D)``. Equal to ``F.scaled_dot_product_attention(q, k, v,
    is_causal=causal, scale=scale, enable_gqa=True)`` when ``Sq == Skv``, autocast included.
    Differentiable in q, k and v, twice with ``create_graph=True``; the output's memory layout
    follows q's (``portable_ops.layout``).
    """
    call = attention_call(q, k, v, causal, scale)
    q, k, v, causal, scale = call["q"], call["k"], call["v"], call["causal"], call["scale"]
    if q.numel() == 0 or k.numel() == 0:
        return _degenerate(q, k, v)
    if torch.compiler.is_compiling():
        return _attention_fwd_op(q, k, v, causal, scale)[0]
    if _transformed():
        return _FuncAttention.apply(q, k, v, causal, scale)[0]
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        # nothing to differentiate (inference, decode): autograd.Function.apply costs 20-50 us of host time
        # even then (H100 host, one-token decode), as much as the rest of the call
        return forward(q, k, v, causal, scale)[0]
    return _EagerAttention.apply(q, k, v, causal, scale)[0]
