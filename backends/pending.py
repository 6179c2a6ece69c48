"""Ops of the public API that some backends have no kernels for yet (issue 12), as the reasons those
backends give when they decline a call: one wording for every backend, read by ``portable_ops.explain``,
fallback warnings, strict mode's error and the conformance CLI (a fallback on a declared op is
reported as such; docs/conformance.md)."""

from __future__ import annotations

# Dispatch ops -> what a user would call them.
NEW_OPS = {
    "attention_varlen_fwd": "packed variable-length sequences (attention_varlen)",
    "attention_varlen_bwd": "packed variable-length sequences (attention_varlen)",
    "paged_attention": "attention over a paged KV cache (paged_attention)",
    "paged_kv_append": "appending to a paged KV cache (paged_kv_append)",
}


def declined_ops(kernels: str) -> dict[str, str]:
    """``Backend.declined`` for a backend with none of :data:`NEW_OPS`; ``kernels``: "NKI kernels"."""
    return {op: f"{feature}: not in the {kernels} yet (issue 12)" for op, feature in NEW_OPS.items()}
