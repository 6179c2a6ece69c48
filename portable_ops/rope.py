"""Rotary position embeddings: ``rope`` (differentiable) and ``rope_`` (in place), reachable from torch.compile and
torch.func.

The backends take q ``[B, Hq, S, D]`` and k ``[B, Hk, S, D]`` in any strides and cos/sin ``[Bc, S, R]`` (``Bc``
1 or B: the public functions give ``[S, R]`` tables a batch dim of 1), and rotate the first R dims of every head
(``portable_ops/definitions/rope.py``). Outputs keep their input's layout (``layout.same_layout``). Three
wrappers run them, as for the norms:

* eager calls: :class:`_EagerRope`, an ``autograd.Function`` whose backward dispatches ``rope_bwd`` (the same
  rotation by the opposite angle; ``create_graph=True`` differentiates the definition's instead);
* torch.compile: as the norms, ``rope`` runs the traced ``rope_fwd`` / ``rope_bwd`` of the backend dispatch
  chooses while the graph is traced (the triton backend's ``torch.library.triton_op``s), else the custom ops
  ``portable_ops::rope_fwd`` / ``rope_bwd``; either pair each the other's gradient. ``rope_`` is always the custom
  op ``portable_ops::rope_`` (``mutates_args=("q", "k")``), which checks what it writes as it runs;
* torch.func transforms and forward-mode AD: the definition, plain torch ops.
"""

from __future__ import annotations

import operator

import torch

from . import dispatch, layout, rope_checks
from .attention import call_layout, run_op, transformed
from .definitions import rope as definition
from .dispatch import forced_backend


def _batched(table):
    return table if table.dim() == 3 else table[None]


def rope_call(q, k, cos, sin, interleaved):
    """Check one call's arguments and return them as the backends take them (cos and sin ``[Bc, S, R]``)."""
    interleaved = rope_checks.check_rope("rope", q, k, cos, sin, interleaved)
    return dict(q=q, k=k, cos=_batched(cos), sin=_batched(sin), interleaved=interleaved)


def rope_inplace_call(q, k, cos, sin, interleaved):
    """As :func:`rope_call`, with what an in-place write must also be checked for (``rope_checks``)."""
    interleaved = rope_checks.check_rope("rope_", q, k, cos, sin, interleaved)
    rope_checks.check_rope_inplace(q, k)
    if not torch.compiler.is_compiling():  # not traceable: the custom op checks as it runs
        rope_checks.check_writable(q, k)
    return dict(q=q, k=k, cos=_batched(cos), sin=_batched(sin), interleaved=interleaved)


def forward(q, k, cos, sin, interleaved):
    """``(q_out, k_out)`` from the backend chosen for this call."""
    call = dict(q=q, k=k, cos=cos, sin=sin, interleaved=interleaved)
    return run_op("rope_fwd", call, call_layout(call), q.device, None)


def backward(dq, dk, cos, sin, interleaved, prefer=None):
    """``(dq_in, dk_in)`` from the backend chosen for this call (either gradient may be None: None comes back for
    it); ``prefer``: the backend forced when the forward ran, which the backward keeps."""
    call = dict(dq=dq, dk=dk, cos=cos, sin=sin, interleaved=interleaved)
    return run_op("rope_bwd", call, call_layout(call), cos.device, prefer)


def _in_place(call):
    run_op("rope_inplace", call, call_layout(call), call["q"].device, None)


def _nothing_to_launch(q, k, cos):
    return q.numel() == 0 or k.numel() == 0 or cos.shape[-1] == 0


# ----------------------------------------------------------------------------- eager

class _EagerRope(torch.autograd.Function):
    """``apply(q, k, cos, sin, interleaved)`` -> (q_out, k_out), differentiable in q and k."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, interleaved):
        ctx.save_for_backward(cos, sin)
        ctx.interleaved, ctx.prefer = interleaved, forced_backend()
        ctx.set_materialize_grads(False)
        return forward(q, k, cos, sin, interleaved)

    @staticmethod
    def backward(ctx, dq, dk):
        if dq is None and dk is None:
            return None, None, None, None, None
        cos, sin = ctx.saved_tensors
        dq, dk = (g if needed else None for g, needed in zip((dq, dk), ctx.needs_input_grad[:2]))
        if dq is None and dk is None:
            return None, None, None, None, None
        if torch.is_grad_enabled():  # create_graph=True: the definition's backward, differentiable in dq and dk
            dq, dk = definition.rope_bwd(dq, dk, cos, sin, ctx.interleaved)
        else:
            dq, dk = backward(dq, dk, cos, sin, ctx.interleaved, ctx.prefer)
        return dq, dk, None, None, None


# ----------------------------------------------------------------------------- torch.compile

@torch.library.custom_op("portable_ops::rope_fwd", mutates_args=())
def _rope_fwd_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return forward(q, k, cos, sin, interleaved)


@_rope_fwd_op.register_fake
def _(q, k, cos, sin, interleaved):
    return layout.same_layout(q), layout.same_layout(k)


@torch.library.custom_op("portable_ops::rope_bwd", mutates_args=())
def _rope_bwd_op(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return backward(dq, dk, cos, sin, interleaved)


@_rope_bwd_op.register_fake
def _(dq, dk, cos, sin, interleaved):
    return layout.same_layout(dq), layout.same_layout(dk)


def _setup(ctx, inputs, output):
    _q, _k, cos, sin, interleaved = inputs
    ctx.save_for_backward(cos, sin)
    ctx.interleaved = interleaved


def _gradient_through(op):
    """The backward of one rotation op: the other op (rope_fwd's gradient is rope_bwd, and rope_bwd's is rope_fwd:
    each is the other's transpose), so double backward works in a compiled graph too."""
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        return *op(grad_q, grad_k, cos, sin, ctx.interleaved), None, None, None
    return backward


def register_gradients(forward_op, backward_op):
    """Register each of the two rotation ops as the other's gradient: portable_ops' custom ops, and a backend's
    traced ops (``OpImpl.traced``), of the custom ops' schemas."""
    forward_op.register_autograd(_gradient_through(backward_op), setup_context=_setup)
    backward_op.register_autograd(_gradient_through(forward_op), setup_context=_setup)


register_gradients(_rope_fwd_op, _rope_bwd_op)


def _traced_forward(q, k, cos, sin, interleaved):
    """The traced ``rope_fwd`` (``OpImpl.traced``, by name) of the backend dispatch chooses for this call while
    torch.compile traces it, or None: portable_ops' custom op runs, and dispatches when the graph runs. Chosen from
    the call's device and dtypes and its rotary dims R, a constant of the graph (as the kernel's block is: a
    symbolic one is specialised, guarded); batch, heads and positions are the graph's and no backend's choice reads
    them."""
    r = operator.index(cos.shape[-1])
    tensors = (("q", (1, 1, 1, r), q.dtype), ("k", (1, 1, 1, r), k.dtype), ("cos", (1, 1, r), cos.dtype),
               ("sin", (1, 1, r), sin.dtype))
    return dispatch.traced_op("rope_fwd", tensors, (("interleaved", interleaved),), q.device,
                              dispatch.forced_by_use_backend())


@torch.library.custom_op("portable_ops::rope_", mutates_args=("q", "k"))
def _rope_inplace_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     interleaved: bool) -> None:
    rope_checks.check_writable(q, k)  # a compiled graph's first chance to (tracing could not)
    _in_place(dict(q=q, k=k, cos=cos, sin=sin, interleaved=interleaved))


@_rope_inplace_op.register_fake
def _(q, k, cos, sin, interleaved):
    return None


# ----------------------------------------------------------------------------- the public functions

def rope(q, k, cos, sin, *, interleaved=False):
    """Rotary position embeddings of q ``[B, Hq, S, D]`` and k ``[B, Hk, S, D]``: returns ``(q_out, k_out)``.

    ``cos`` and ``sin``: ``[S, R]`` or ``[B, S, R]`` (batch 1 broadcasts), what transformers' rotary embedding
    modules return; R even and at most D. The first R dims of each head become transformers'
    ``x * cos + rotate_half(x) * sin`` (``interleaved=False``: dims i and i + R/2 are a pair, cos/sin hold each
    pair's angle in both halves) or GPT-J's rotation of pairs (2i, 2i + 1) (``interleaved=True``: cos/sin hold each
    pair's angle twice side by side, ``repeat_interleave(2)``); the other D - R dims pass through unchanged
    (partial rotary). q and k may have any strides (transposed views of a fused projection); each output is laid
    out as its input (``portable_ops.layout.same_layout``), in its dtype, computed in float32 (float64 for
    float64) from cos and sin as given. Differentiable in q and k (twice, with ``create_graph=True``); cos and sin
    take no gradient. ``docs/api.md``, "RoPE".
    """
    call = rope_call(q, k, cos, sin, interleaved)
    q, k, cos, sin, interleaved = call["q"], call["k"], call["cos"], call["sin"], call["interleaved"]
    if _nothing_to_launch(q, k, cos) or transformed():  # or torch.func: the definition's torch ops
        return definition.rope(q, k, cos, sin, interleaved)
    if torch.compiler.is_compiling():
        name = _traced_forward(q, k, cos, sin, interleaved)
        op = _rope_fwd_op if name is None else getattr(torch.ops.portable_ops, name)
        return op(q, k, cos, sin, interleaved)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _EagerRope.apply(q, k, cos, sin, interleaved)
    return forward(q, k, cos, sin, interleaved)


def rope_(q, k, cos, sin, *, interleaved=False):
    """:func:`rope` written into q and k themselves: returns ``(q, k)``, their first R dims rotated in place, the
    other dims untouched.

    Not differentiable: q and k must not require grad while grad mode is on (call it under ``torch.no_grad()``,
    or use :func:`rope`). Refused before anything is written: q or k with elements sharing memory (an expanded
    view), q and k at the same memory, an inference tensor outside ``torch.inference_mode()``.
    """
    call = rope_inplace_call(q, k, cos, sin, interleaved)
    cos, sin, interleaved = call["cos"], call["sin"], call["interleaved"]
    if _nothing_to_launch(q, k, cos):
        return q, k
    if transformed():
        r = cos.shape[-1]
        for t in (q, k):
            t[..., :r].copy_(definition.rotated(t, cos, sin, interleaved))
        return q, k
    if torch.compiler.is_compiling():
        _rope_inplace_op(q, k, cos, sin, interleaved)
    else:
        _in_place(call)
    return q, k
