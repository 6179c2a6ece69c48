"""Fused attention, differentiable, reachable from torch.compile.

The forward and backward are torch.library custom ops taking the chosen
backend's name as an argument: dispatch (pure Python, reading only shapes,
dtypes and devices) runs at trace time, and the compiled graph holds one opaque
call per direction, with no graph break.
"""

from __future__ import annotations

import math

import torch

from . import checks
from .dispatch import dispatch, select


def attention_call(q, k, v, causal, scale):
    checks.check_attention(q, k, v, scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return dict(q=q, k=k, v=v, causal=bool(causal), scale=scale)


def _lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@torch.library.custom_op("portable_ops::attention_fwd", mutates_args=())
def _attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                   backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    call = dict(q=q, k=k, v=v, causal=causal, scale=scale)
    return dispatch("attention_fwd", call, q.device, prefer=backend).run(**call)


@_attention_fwd.register_fake
def _(q, k, v, causal, scale, backend):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=_lse_dtype(q))


@torch.library.custom_op("portable_ops::attention_bwd", mutates_args=())
def _attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   dout: torch.Tensor, causal: bool, scale: float,
                   backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    call = dict(q=q, k=k, v=v, out=out, lse=lse, dout=dout.contiguous(), causal=causal, scale=scale)
    return dispatch("attention_bwd", call, q.device, prefer=backend).run(**call)


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


def _layout(t):
    return tuple(t.shape), tuple(t.stride()), str(t.dtype).removeprefix("torch.")


@torch._dynamo.assume_constant_result
def _backend_for(device: str, q_layout, k_layout, v_layout, causal: bool, scale: float) -> str:
    # Dispatch reads only shapes, strides, dtypes and devices, so under torch.compile it runs once,
    # at trace time, on meta stand-ins, and the chosen name is a constant of the graph.
    meta = [torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device="meta")
            for shape, stride, dtype in (q_layout, k_layout, v_layout)]
    call = dict(q=meta[0], k=meta[1], v=meta[2], causal=causal, scale=scale)
    return select("attention_fwd", call, torch.device(device)).backend


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
    out, _lse = _attention_fwd(q, k, v, call["causal"], call["scale"], backend)
    return out
