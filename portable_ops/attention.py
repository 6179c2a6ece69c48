"""Fused attention, differentiable, reachable from torch.compile.

Under torch.compile the forward and backward are torch.library custom ops taking the chosen
backend's name as an argument: dispatch (pure Python, reading only shapes, strides, dtypes and
devices) runs at trace time, and the compiled graph holds one opaque call per direction, with no
graph break. Eager calls run the same functions through an autograd.Function, with the choice of
backend memoised per layout, to keep the per-call host time small.
"""

from __future__ import annotations

import math

import torch

from . import checks
from .dispatch import dispatch, get_backend, select_by_layout


def attention_call(q, k, v, causal, scale):
    checks.check_attention(q, k, v, scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return dict(q=q, k=k, v=v, causal=bool(causal), scale=scale)


def _lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _run_fwd(q, k, v, causal, scale, backend):
    call = dict(q=q, k=k, v=v, causal=causal, scale=scale)
    return dispatch("attention_fwd", call, q.device, prefer=backend).run(**call)


def _run_bwd(q, k, v, out, lse, dout, causal, scale, backend):
    call = dict(q=q, k=k, v=v, out=out, lse=lse, dout=dout.contiguous(), causal=causal, scale=scale)
    return dispatch("attention_bwd", call, q.device, prefer=backend).run(**call)


# torch.compile's path: custom ops, opaque to the graph, with their autograd formula.
@torch.library.custom_op("portable_ops::attention_fwd", mutates_args=())
def _attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                   backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _run_fwd(q, k, v, causal, scale, backend)


@_attention_fwd.register_fake
def _(q, k, v, causal, scale, backend):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=_lse_dtype(q))


@torch.library.custom_op("portable_ops::attention_bwd", mutates_args=())
def _attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   dout: torch.Tensor, causal: bool, scale: float,
                   backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _run_bwd(q, k, v, out, lse, dout, causal, scale, backend)


@_attention_bwd.register_fake
def _(q, k, v, out, lse, dout, causal, scale, backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale, ctx.backend = causal, scale, backend


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _attention_bwd(q, k, v, out, lse, dout, ctx.causal, ctx.scale, ctx.backend)
    return dq, dk, dv, None, None, None


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The eager path: the same kernels without the custom ops' dispatcher, which costs ~80 us a
    call with autograd on, against ~3 us here. ``backend`` was chosen for this exact layout
    (memoised), so the forward runs it without asking again. The old-style ``forward(ctx, ...)``:
    the ``setup_context`` style binds arguments through ``inspect`` on every call (~50 us)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, backend):
        out, lse = get_backend(backend).ops["attention_fwd"].run(q=q, k=k, v=v, causal=causal, scale=scale)
        _setup_context(ctx, (q, k, v, causal, scale, backend), (out, lse))
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _run_bwd(q, k, v, out, lse, dout, ctx.causal, ctx.scale, ctx.backend)
        return dq, dk, dv, None, None, None


def _layout(t):
    return tuple(t.shape), tuple(t.stride()), t.dtype


@torch._dynamo.assume_constant_result
def _backend_for(device: str, q_layout, k_layout, v_layout, causal: bool, scale: float) -> str:
    # Dispatch reads only shapes, strides, dtypes and devices, so under torch.compile it runs once,
    # at trace time, on meta stand-ins, and the chosen name is a constant of the graph.
    def meta_call():
        q, k, v = (torch.empty_strided(shape, stride, dtype=dtype, device="meta")
                   for shape, stride, dtype in (q_layout, k_layout, v_layout))
        return dict(q=q, k=k, v=v, causal=causal, scale=scale)

    layout = (q_layout, k_layout, v_layout, causal, scale)
    return select_by_layout("attention_fwd", layout, meta_call, torch.device(device)).backend


def attention(q, k, v, *, causal=False, scale=None):
    """Softmax attention of q ``[B, Hq, Sq, D]`` over k, v ``[B, Hkv, Skv, D]``, ``Hq % Hkv == 0``.

    ``causal`` masks key ``j`` from query ``i`` when ``j > i + Skv - Sq`` (the
    mask is aligned to the bottom right, so with ``Sq == 1`` the one query sees
    the whole KV cache). ``scale`` defaults to ``1 / sqrt(D)``. Equal to
    ``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
    enable_gqa=True)`` when ``Sq == Skv``. Differentiable in q, k and v.
    """
    call = attention_call(q, k, v, causal, scale)
    backend = _backend_for(str(q.device), _layout(q), _layout(k), _layout(v), call["causal"], call["scale"])
    fwd = _attention_fwd if torch.compiler.is_compiling() else _EagerAttention.apply
    out, _lse = fwd(q, k, v, call["causal"], call["scale"], backend)
    return out
