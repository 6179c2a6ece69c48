"""Attention features the public API has and some backends' kernels do not have yet (issue 12), as the
reasons those backends give when they decline a call: one wording for every backend, read by
``portable_ops.explain``, fallback warnings and strict mode's error."""

from __future__ import annotations

# Dispatch ops with no kernel yet -> what a user would call it.
NEW_OPS = {
    "attention_varlen_fwd": "packed variable-length sequences (attention_varlen)",
    "attention_varlen_bwd": "packed variable-length sequences (attention_varlen)",
    "paged_attention": "attention over a paged KV cache (paged_attention)",
    "paged_kv_append": "appending to a paged KV cache (paged_kv_append)",
}


def _not_yet(feature: str, kernels: str) -> str:
    return f"{feature}: not in the {kernels} yet (issue 12)"


def declined_ops(kernels: str) -> dict[str, str]:
    """``Backend.declined`` for a backend with none of :data:`NEW_OPS`; ``kernels``: "triton kernels"."""
    return {op: _not_yet(feature, kernels) for op, feature in NEW_OPS.items()}


def dense_feature_reasons(call, kernels: str) -> list[str]:
    """Why dense attention kernels without a sliding window or softcap decline ``call``."""
    reasons = []
    if call.get("window") is not None:
        reasons.append(_not_yet("sliding window", kernels))
    if call.get("softcap") is not None:
        reasons.append(_not_yet("logit softcapping", kernels))
    return reasons


def refuse_features(window, softcap, kernels: str) -> None:
    """For a kernel called directly, not through dispatch (which would have declined): never drop a
    window or a softcap silently."""
    if window is not None or softcap is not None:
        raise NotImplementedError("; ".join(dense_feature_reasons(dict(window=window, softcap=softcap), kernels)))
