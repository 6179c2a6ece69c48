"""The ops a backend may implement, in one table: what a user calls each, and what a backend may declare about it.

A backend names its ops by the keys of :data:`OPS` (``Backend.ops``, ``Backend.declined``); naming any
other is an error when it registers. ``explain``'s op names, the reason a declined op gives, the
conformance suite's families and doctor's listing are read from here; ``docs/adding-an-op.md`` walks
through adding a row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

Call = dict  # the keyword arguments of one op call, validated by the public API


@dataclass(frozen=True)
class Feature:
    """An optional part of an op that a backend may lack (``OpImpl.features`` lists those it has)."""

    name: str
    # How ``call`` uses the feature, in a user's words ("softcap=30"), or "" when it does not.
    usage: Callable[[Call], str]
    # What a backend without the feature takes, for its reason ("2 and inf are"), or "".
    without: str = ""


@dataclass(frozen=True)
class Op:
    public: str  # the public function a user calls to run it, as ``explain`` names it
    description: str  # what it is, in a user's words: a declined op's reason starts with it
    family: str  # the conformance cases that check it (``Case.op``): its public op's, for one run by another
    tensors: tuple[str, ...]  # the call's keys whose tensors (or lists of them) carry its floating-point dtypes
    head_dim: Callable[[Call], int] | None = None  # the call's head dim, for an op that has one
    features: tuple[Feature, ...] = ()
    backward: str | None = None  # the op computing its gradients; None: not differentiable through a backend


def _value(call: Call):
    """The call's values: v, or a paged call's v_cache."""
    return call["v"] if "v" in call else call["v_cache"]


def _head_dim(call: Call) -> int:
    """The widest head dim of the call: q and k's, or v's where it has its own."""
    return max(call["q"].shape[-1], _value(call).shape[-1])


def _value_head_dim(call: Call) -> str:
    q_dim, v_dim = call["q"].shape[-1], _value(call).shape[-1]
    return f"v's head_dim {v_dim} beside q and k's {q_dim}" if v_dim != q_dim else ""


CAUSAL = Feature("causal", lambda call: "causal=True" if call["causal"] else "")
WINDOW = Feature("window", lambda call: f"window={call['window']}" if call["window"] is not None else "")
SOFTCAP = Feature("softcap", lambda call: f"softcap={call['softcap']:g}" if call["softcap"] is not None else "")
VALUE_HEAD_DIM = Feature("value head dim", _value_head_dim)
SINKS = Feature("sinks", lambda call: "sinks (a learned logit per query head)" if call.get("sinks") is not None else "")
# A backward's: the gradient that reached lse (return_lse=True), which changes each row's delta
LSE_GRADIENT = Feature("lse gradient", lambda call: "a gradient through lse (return_lse=True)"
                       if call.get("dlse") is not None else "")
OTHER_NORMS = Feature("other norm types",
                      lambda call: "" if call["norm_type"] in (2.0, math.inf) else f"norm_type {call['norm_type']:g}",
                      without="2 and inf are")

_ATTENTION = dict(tensors=("q", "k", "v"), head_dim=_head_dim,
                  features=(CAUSAL, WINDOW, SOFTCAP, SINKS, LSE_GRADIENT, VALUE_HEAD_DIM))
_VARLEN = dict(public="attention_varlen", description="packed variable-length sequences", family="attention_varlen",
               **_ATTENTION)

OPS: dict[str, Op] = {
    # The public API gives each grad its param's dtype, and a param's moments one dtype, its exp_avg's.
    "adam": Op(public="adam", description="the Adam/AdamW step", family="adam", tensors=("params", "exp_avgs")),
    # A param's momentum buffer has its dtype.
    "sgd": Op(public="sgd", description="the SGD step", family="sgd", tensors=("params",)),
    "grad_norm": Op(public="clip_grad_norm_", description="the global norm of gradients", family="clip_grad_norm_",
                    tensors=("grads",), features=(OTHER_NORMS,)),
    "attention_fwd": Op(public="attention", description="attention", family="attention", backward="attention_bwd",
                        **_ATTENTION),
    "attention_bwd": Op(public="attention", description="attention's gradients", family="attention", **_ATTENTION),
    "attention_varlen_fwd": Op(backward="attention_varlen_bwd", **_VARLEN),
    "attention_varlen_bwd": Op(**_VARLEN),
    "paged_attention": Op(public="paged_attention", description="attention over a paged KV cache",
                          family="paged_attention", tensors=("q", "k_cache", "v_cache"), head_dim=_head_dim,
                          features=(WINDOW, SOFTCAP, SINKS, VALUE_HEAD_DIM)),
    "paged_kv_append": Op(public="paged_kv_append", description="appending to a paged KV cache",
                          family="paged_attention", tensors=("k_cache", "v_cache", "k_new", "v_new"),
                          head_dim=lambda call: max(call["k_new"].shape[-1], call["v_new"].shape[-1])),
    # Rows ``x [M, D]`` (the leading dims folded), normalised over D; dweight and dbias come back float32.
    "rms_norm_fwd": Op(public="rms_norm", description="RMSNorm", family="rms_norm", backward="rms_norm_bwd",
                       tensors=("x", "residual", "weight")),
    "rms_norm_bwd": Op(public="rms_norm", description="RMSNorm's gradients", family="rms_norm",
                       tensors=("x", "weight", "dout", "dh")),
    "layer_norm_fwd": Op(public="layer_norm", description="LayerNorm", family="layer_norm",
                         backward="layer_norm_bwd", tensors=("x", "residual", "weight", "bias")),
    "layer_norm_bwd": Op(public="layer_norm", description="LayerNorm's gradients", family="layer_norm",
                         tensors=("x", "weight", "dout", "dh")),
    # Tokens ``hidden [N, H]`` (the leading dims folded) against ``weight [V, H]``, in chunks of tokens: the
    # gradients come out of the forward (mean and sum); the backward op recomputes them for reduction="none".
    "linear_cross_entropy_fwd": Op(public="linear_cross_entropy", description="linear cross-entropy",
                                   family="linear_cross_entropy", backward="linear_cross_entropy_bwd",
                                   tensors=("hidden", "weight", "bias")),
    "linear_cross_entropy_bwd": Op(public="linear_cross_entropy", description="linear cross-entropy's gradients",
                                   family="linear_cross_entropy", tensors=("hidden", "weight", "bias")),
    # q ``[B, Hq, S, D]`` and k ``[B, Hk, S, D]`` (any strides), cos and sin ``[B or 1, S, R]``: the first R dims of
    # each head rotated, the rest passed through. The backward is the same rotation by the opposite angle.
    "rope_fwd": Op(public="rope", description="rotary position embeddings", family="rope", backward="rope_bwd",
                   tensors=("q", "k", "cos", "sin")),
    "rope_bwd": Op(public="rope", description="rotary position embeddings' gradients", family="rope",
                   tensors=("dq", "dk", "cos", "sin")),
    "rope_inplace": Op(public="rope_", description="rotary position embeddings in place", family="rope",
                       tensors=("q", "k", "cos", "sin")),
}


def public_ops() -> dict[str, str]:
    """Each public op's name -> the op its call dispatches first (a differentiable op's forward)."""
    ops: dict[str, str] = {}
    for name, op in OPS.items():
        ops.setdefault(op.public, name)
    return ops


def families() -> tuple[str, ...]:
    """The conformance families, each once, in the table's order."""
    return tuple(dict.fromkeys(op.family for op in OPS.values()))


def declined_reason(op: str, backend: str) -> str:
    """Why ``backend``, which declares it has no kernel for ``op`` yet, declines it."""
    return f"{OPS[op].description} ({OPS[op].public}): not in the {backend} kernels yet"
