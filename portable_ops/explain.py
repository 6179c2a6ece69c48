"""``explain``: which backend would run a call, and why each other backend would not."""

from __future__ import annotations

import inspect

from .attention import attention, attention_call
from .attention_varlen import attention_varlen, attention_varlen_call
from .clip import clip_grad_norm_, grad_norm_call, grads_of
from .dispatch import Choice, choose
from .functional import adam, adam_call, sgd, sgd_call
from .linear_cross_entropy import backend_call, linear_cross_entropy, linear_cross_entropy_call, wanted_grads
from .norms import layer_norm, norm_call, rms_norm
from .ops import public_ops
from .paged import paged_attention, paged_attention_call, paged_kv_append, paged_kv_append_call
from .rope import rope, rope_, rope_call, rope_inplace_call

_ADAM_CALL_ARGS = inspect.signature(adam_call).parameters
_SGD_CALL_KEYWORDS = [name for name, p in inspect.signature(sgd_call).parameters.items()
                      if p.kind == p.KEYWORD_ONLY]

# For each public op of portable_ops/ops.py: the function, and the checked call built from the function's
# arguments as bound to its signature (defaults applied).
_CALLS = {
    "attention": (attention,
                  lambda a: attention_call(a["q"], a["k"], a["v"], a["causal"], a["scale"], a["window"], a["softcap"],
                                           a["sinks"])),
    "attention_varlen": (attention_varlen, lambda a: attention_varlen_call(**_forward_arguments(a))),
    "paged_attention": (paged_attention, lambda a: paged_attention_call(**_forward_arguments(a))),
    "paged_kv_append": (paged_kv_append, lambda a: paged_kv_append_call(**a)),
    "adam": (adam, lambda a: adam_call(**{k: v for k, v in a.items() if k in _ADAM_CALL_ARGS})),
    "sgd": (sgd, lambda a: sgd_call(a["params"], a["d_p_list"], a["momentum_buffer_list"],
                                    **{k: v for k, v in a.items() if k in _SGD_CALL_KEYWORDS})),
    "clip_grad_norm_": (clip_grad_norm_, lambda a: grad_norm_call(grads_of(a["parameters"]), a["norm_type"])),
    "rms_norm": (rms_norm, lambda a: _rows(norm_call("rms_norm", a["x"], a["residual"], a["weight"], None, a["eps"]))),
    "layer_norm": (layer_norm, lambda a: _rows(norm_call("layer_norm", a["x"], a["residual"], a["weight"], a["bias"],
                                                         a["eps"]))),
    "linear_cross_entropy": (linear_cross_entropy, lambda a: _tokens(linear_cross_entropy_call(**a))),
    "rope": (rope, lambda a: rope_call(**a)),
    "rope_": (rope_, lambda a: rope_inplace_call(**a)),
}
_PUBLIC_OPS = public_ops()


def _forward_arguments(arguments):
    """An attention's bound arguments as its checked call takes them: what it returns aside."""
    return {k: v for k, v in arguments.items() if k != "return_lse"}


def _rows(call):
    """A norm's checked call as its backends take it: x and residual folded into rows ``[M, D]``."""
    return {k: v.reshape(-1, v.shape[-1]) if k in ("x", "residual") and v is not None else v for k, v in call.items()}


def _tokens(call):
    """A linear cross-entropy's checked call as its backends take it: tokens ``[N, H]``, the gradients to compute."""
    return backend_call(call, wanted_grads(call))


if set(_CALLS) != set(_PUBLIC_OPS):  # an op added to the table without its call here, or the reverse
    raise ImportError(f"explain builds calls of {sorted(_CALLS)}; portable_ops/ops.py's public ops are "
                      f"{sorted(_PUBLIC_OPS)}")
_BY_FUNCTION = {function: name for name, (function, _) in _CALLS.items()}


def explain(op, *args, **kwargs) -> Choice:
    """The backend that ``op(*args, **kwargs)`` would run on, with every other backend's reasons.

    ``op`` is a public function (``portable_ops.attention``, ``attention_varlen``, ``paged_attention``,
    ``paged_kv_append``, ``rms_norm``, ``layer_norm``, ``rope``, ``rope_``, ``linear_cross_entropy``,
    ``portable_ops.functional.adam``,
    ``portable_ops.functional.sgd``, ``portable_ops.clip_grad_norm_``) or its name.
    The arguments are checked as the call would check them (offsets' and page tables' values included);
    nothing is computed. The returned :class:`~portable_ops.dispatch.Choice` prints as a readable report.
    """
    name = _BY_FUNCTION.get(op) if callable(op) else op
    if not isinstance(name, str) or name not in _PUBLIC_OPS:
        raise ValueError(f"explain: unknown op {op!r}; expected one of {', '.join(_PUBLIC_OPS)} or its function")
    function, build = _CALLS[name]
    call = build(_bound(name, function, args, kwargs))
    leading = next((call[key] for key in ("q", "k_new", "x", "hidden") if key in call), None)
    tensors = call.get("params") or call.get("grads") or [leading]
    device = tensors[0].device if tensors and tensors[0] is not None else None
    return choose(_PUBLIC_OPS[name], call, device)


def _bound(name, function, args, kwargs) -> dict:
    """``function``'s arguments by name, defaults applied; a TypeError naming every missing one (or the
    unexpected one) and the signature, when the call would not bind."""
    signature = inspect.signature(function)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        problem = str(exc)
        try:
            given = signature.bind_partial(*args, **kwargs).arguments
            missing = [p.name for p in signature.parameters.values() if p.default is p.empty and p.name not in given]
            problem = "missing " + ", ".join(missing) if missing else problem
        except TypeError:
            pass
        raise TypeError(f"explain({name}, ...): {problem}; {name} takes {signature}") from None
    bound.apply_defaults()
    return bound.arguments
