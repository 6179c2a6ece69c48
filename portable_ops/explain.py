"""``explain``: which backend would run a call, and why each other backend would not."""

from __future__ import annotations

from .attention import attention, attention_call
from .clip import clip_grad_norm_, grad_norm_call, grads_of
from .dispatch import Choice, choose
from .functional import adam, adam_call

# For each public op: the dispatch op name, and a function building its checked call from the user's arguments.
_OPS = {
    "attention": ("attention_fwd", lambda q, k, v, *, causal=False, scale=None: attention_call(q, k, v, causal, scale)),
    "adam": ("adam", adam_call),
    "clip_grad_norm_": ("grad_norm", lambda parameters, max_norm, norm_type=2.0, error_if_nonfinite=False:
                        grad_norm_call(grads_of(parameters), norm_type)),
}
_BY_FUNCTION = {attention: "attention", adam: "adam", clip_grad_norm_: "clip_grad_norm_"}


def explain(op, *args, **kwargs) -> Choice:
    """The backend that ``op(*args, **kwargs)`` would run on, with every other backend's reasons.

    ``op`` is a public function (``portable_ops.attention``, ``portable_ops.functional.adam``,
    ``portable_ops.clip_grad_norm_``) or its name. Nothing is computed; the returned
    :class:`~portable_ops.dispatch.Choice` prints as a readable report.
    """
    name = _BY_FUNCTION.get(op, op)
    if name not in _OPS:
        raise ValueError(f"explain: unknown op {op!r}; expected one of {', '.join(_OPS)}")
    dispatch_op, build = _OPS[name]
    call = build(*args, **kwargs)
    tensors = call.get("params") or call.get("grads") or [call.get("q")]
    device = tensors[0].device if tensors and tensors[0] is not None else None
    return choose(dispatch_op, call, device)
