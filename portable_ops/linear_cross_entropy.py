"""Linear cross-entropy: the LM head and the loss in one op that never holds the ``[tokens, vocab]`` logits;
differentiable, autocast-aware, reachable from torch.compile and torch.func.

The backends take tokens: ``hidden [N, H]`` (the leading dims folded, a copy only where the strides can't be
folded) and ``target [N]``, and run them in chunks of tokens (``portable_ops/lm_head.py``). Under ``"mean"`` and
``"sum"`` the forward computes the gradients the call will need (the loss is a scalar: its backward only scales
them); under ``"none"`` it computes the losses alone and the backward op runs the chunks again with each token's
gradient. Three wrappers run them:

* eager calls: :class:`_EagerLinearCrossEntropy`, an ``autograd.Function``;
* torch.compile: the custom ops ``portable_ops::linear_cross_entropy_fwd`` / ``_bwd``, with fake implementations
  and ``register_autograd``;
* torch.func transforms and forward-mode AD: the definition (``portable_ops.definitions.linear_cross_entropy``),
  plain torch ops over materialised logits, which every transform differentiates and batches.
"""

from __future__ import annotations

import torch

from . import cross_entropy_checks as checks
from .attention import autocast_inputs, call_layout, run_op, transformed
from .definitions import linear_cross_entropy as definition
from .dispatch import forced_backend

_NO_GRADS = (False, False, False)
_NO_SECOND_DERIVATIVES = ("portable_ops.linear_cross_entropy: second derivatives (create_graph=True) are not "
                          "supported: its gradients are computed in the forward pass, not differentiated there")


def linear_cross_entropy_call(hidden, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0,
                              reduction="mean", softcap=None):
    """Apply autocast's casts (``F.linear``'s: every floating input but float64 to the autocast dtype), check the
    arguments (the targets' values once per version) and return them as a dict, hidden and target in their own
    shapes (:func:`backend_call` folds them)."""
    hidden, weight, bias = autocast_inputs(hidden, weight, bias)
    checks.check_tensors(hidden, weight, target, bias)
    ignore_index, label_smoothing, reduction, softcap = checks.options(ignore_index, label_smoothing, reduction,
                                                                       softcap)
    if not transformed():  # a transform's definition refuses an index out of range itself
        checks.check_target_values(target, weight.shape[0], ignore_index)
    return _call_of(hidden, weight, bias, target, (ignore_index, label_smoothing, reduction, softcap))


def wanted_grads(call) -> tuple[bool, bool, bool]:
    """The gradients the forward computes: those of hidden, weight and bias that autograd will ask for, under
    ``"mean"`` and ``"sum"``; none under ``"none"``, whose backward computes them."""
    if call["reduction"] == "none" or not torch.is_grad_enabled():
        return _NO_GRADS
    bias = call["bias"]
    return call["hidden"].requires_grad, call["weight"].requires_grad, bias is not None and bias.requires_grad


def backend_call(call, grads) -> dict:
    """A checked call as the backends take it: hidden ``[N, H]``, target ``[N]``, and the gradients to compute."""
    hidden = call["hidden"]
    hidden_grad, weight_grad, bias_grad = grads
    return dict(call, hidden=hidden.reshape(-1, hidden.shape[-1]), target=call["target"].reshape(-1),
                hidden_grad=hidden_grad, weight_grad=weight_grad, bias_grad=bias_grad)


def forward(call, grads):
    """``(loss, dhidden, dweight, dbias)`` from the backend chosen for this call: dhidden in hidden's shape, each
    gradient None unless ``grads`` asks for it."""
    rows = backend_call(call, grads)
    loss, dhidden, dweight, dbias = run_op("linear_cross_entropy_fwd", rows, call_layout(rows), rows["hidden"].device,
                                           None)
    if call["reduction"] == "none":
        loss = loss.reshape(call["target"].shape)
    return loss, None if dhidden is None else dhidden.reshape(call["hidden"].shape), dweight, dbias


def backward(call, dloss, grads, prefer=None):
    """``(dhidden, dweight, dbias)`` of ``"none"``'s per-token losses for their gradients ``dloss`` (target's
    shape), from the backend chosen for this call; ``prefer``: the backend forced when the forward ran."""
    rows = backend_call(call, grads)
    del rows["reduction"]
    rows["dloss"] = dloss.reshape(-1)
    dhidden, dweight, dbias = run_op("linear_cross_entropy_bwd", rows, call_layout(rows), rows["hidden"].device,
                                     prefer)
    return None if dhidden is None else dhidden.reshape(call["hidden"].shape), dweight, dbias


def _options(call) -> tuple:
    return call["ignore_index"], call["label_smoothing"], call["reduction"], call["softcap"]


def _call_of(hidden, weight, bias, target, options) -> dict:
    ignore_index, label_smoothing, reduction, softcap = options
    return dict(hidden=hidden, weight=weight, bias=bias, target=target, ignore_index=ignore_index,
                label_smoothing=label_smoothing, reduction=reduction, softcap=softcap)


def _scaled(grads, dloss):
    return tuple(None if g is None else g * dloss for g in grads)


# ----------------------------------------------------------------------------- eager

class _EagerLinearCrossEntropy(torch.autograd.Function):
    """``apply(hidden, weight, bias, target, options)`` -> the loss; ``options``: (ignore_index, label_smoothing,
    reduction, softcap)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, options):
        call = _call_of(hidden, weight, bias, target, options)
        per_token = call["reduction"] == "none"
        loss, dhidden, dweight, dbias = forward(call, _NO_GRADS if per_token else ctx.needs_input_grad[:3])
        # "none": the inputs, for the backward's second pass; else the gradients, which the backward scales
        ctx.save_for_backward(*((hidden, weight, bias, target) if per_token else (dhidden, dweight, dbias)))
        ctx.options, ctx.prefer = options, forced_backend()
        ctx.set_materialize_grads(False)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        if dloss is None:
            return None, None, None, None, None
        if torch.is_grad_enabled():
            raise RuntimeError(_NO_SECOND_DERIVATIVES)
        if ctx.options[2] == "none":
            hidden, weight, bias, target = ctx.saved_tensors
            grads = backward(_call_of(hidden, weight, bias, target, ctx.options), dloss, ctx.needs_input_grad[:3],
                             ctx.prefer)
        else:
            grads = _scaled(ctx.saved_tensors, dloss)
        return *grads, None, None


# ----------------------------------------------------------------------------- torch.compile

def _or_empty(t, like):
    return t if t is not None else like.new_empty(0)


@torch.library.custom_op("portable_ops::linear_cross_entropy_fwd", mutates_args=())
def _fwd_op(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
            ignore_index: int, label_smoothing: float, reduction: str, softcap: float | None, hidden_grad: bool,
            weight_grad: bool, bias_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    checks.check_target_values(target, weight.shape[0], ignore_index)  # the compiled graph's first chance
    call = _call_of(hidden, weight, bias, target, (ignore_index, label_smoothing, reduction, softcap))
    loss, dhidden, dweight, dbias = forward(call, (hidden_grad, weight_grad, bias_grad))
    return loss, _or_empty(dhidden, hidden), _or_empty(dweight, weight), _or_empty(dbias, weight)


@_fwd_op.register_fake
def _(hidden, weight, bias, target, ignore_index, label_smoothing, reduction, softcap, hidden_grad, weight_grad,
      bias_grad):
    loss = hidden.new_empty(target.shape if reduction == "none" else (), dtype=definition.loss_dtype(hidden.dtype))
    return (loss, hidden.new_empty(hidden.shape if hidden_grad else (0,)),
            weight.new_empty(weight.shape if weight_grad else (0,)),
            weight.new_empty(weight.shape[:1] if bias_grad else (0,)))


@torch.library.custom_op("portable_ops::linear_cross_entropy_bwd", mutates_args=())
def _bwd_op(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
            dloss: torch.Tensor, ignore_index: int, label_smoothing: float, softcap: float | None, hidden_grad: bool,
            weight_grad: bool, bias_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    call = _call_of(hidden, weight, bias, target, (ignore_index, label_smoothing, "none", softcap))
    dhidden, dweight, dbias = backward(call, dloss, (hidden_grad, weight_grad, bias_grad))
    return _or_empty(dhidden, hidden), _or_empty(dweight, weight), _or_empty(dbias, weight)


@_bwd_op.register_fake
def _(hidden, weight, bias, target, dloss, ignore_index, label_smoothing, softcap, hidden_grad, weight_grad,
      bias_grad):
    return (hidden.new_empty(hidden.shape if hidden_grad else (0,)),
            weight.new_empty(weight.shape if weight_grad else (0,)),
            weight.new_empty(weight.shape[:1] if bias_grad else (0,)))


def _setup(ctx, inputs, output):
    hidden, weight, bias, target, ignore_index, label_smoothing, reduction, softcap, *_ = inputs
    _loss, dhidden, dweight, dbias = output
    ctx.options = (ignore_index, label_smoothing, reduction, softcap)
    ctx.save_for_backward(*((hidden, weight, bias, target) if reduction == "none" else (dhidden, dweight, dbias)))


def _backward(ctx, dloss, _dhidden, _dweight, _dbias):
    needed = ctx.needs_input_grad[:3]
    if ctx.options[2] == "none":
        hidden, weight, bias, target = ctx.saved_tensors
        ignore_index, label_smoothing, _, softcap = ctx.options
        grads = _bwd_op(hidden, weight, bias, target, dloss, ignore_index, label_smoothing, softcap, *needed)
    else:
        grads = _scaled(ctx.saved_tensors, dloss)
    # a gradient not asked for is an empty placeholder
    return *(g if need else None for g, need in zip(grads, needed)), *(None,) * 8


_fwd_op.register_autograd(_backward, setup_context=_setup)


# ----------------------------------------------------------------------------- the public function

def linear_cross_entropy(hidden, weight, target, *, bias=None, ignore_index=-100, label_smoothing=0.0,
                         reduction="mean", softcap=None):
    """The LM head and its cross-entropy loss without the ``[tokens, vocab]`` logits:
    ``F.cross_entropy(softcap(F.linear(hidden, weight, bias)).float(), target, ignore_index=ignore_index,
    label_smoothing=label_smoothing, reduction=reduction)``, ``softcap(x) = softcap * tanh(x / softcap)`` (Gemma
    2's final-logit softcapping; None: no cap).

    ``hidden [..., H]``, ``weight [V, H]`` and ``bias`` (None or ``[V]``) of one floating dtype (under autocast all
    are cast to its dtype, as for ``F.linear``), ``target [...]`` int64 class indices in ``[0, V)`` or
    ``ignore_index`` (anything else is refused before anything runs). The loss is float32 (float64 for float64
    inputs): a scalar for ``"mean"`` (over the tokens not ignored; NaN when every token is, as torch's) and
    ``"sum"``, target's shape for ``"none"``. Differentiable in hidden, weight and bias; the tokens run in chunks
    whose logits stay within a fixed budget (``docs/api.md``, "Linear cross-entropy").
    """
    call = linear_cross_entropy_call(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, softcap)
    hidden, weight, bias, target = call["hidden"], call["weight"], call["bias"], call["target"]
    options = _options(call)
    if hidden.numel() == 0 or transformed():  # nothing to launch, or torch.func: the definition's torch ops
        return definition.linear_cross_entropy(hidden, weight, target, bias, *options)
    grads = wanted_grads(call)
    if torch.compiler.is_compiling():
        return _fwd_op(hidden, weight, bias, target, *options, *grads)[0]
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if not needs_grad:
        return forward(call, _NO_GRADS)[0]
    return _EagerLinearCrossEntropy.apply(hidden, weight, bias, target, options)
