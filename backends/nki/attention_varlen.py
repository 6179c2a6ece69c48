"""Packed attention (``attention_varlen``) on NKI: one launch of the dense kernels (``attention.py``) per sequence.

The offsets are read on the host (as the public function's checks already do once per version of them) and each
sequence's rows run as a dense ``[1, H, S, D]`` problem, its masks aligned to its own bottom right. Why not one
launch over the packed tokens: NKI kernels are traced with static shapes and control flow, so one launch would need
the offsets as trace-time constants (a kernel per packing) or masks built from per-token document ids at run time
(every tile computed, none skipped), and the resident kernels' 128-key blocks assume a sequence's keys start on a
block, which packed sequences do not. A sequence with no query or no key has nothing to compute: its answer is the
one the public API gives zero-size attention (``portable_ops.attention.degenerate``: zeros, lse -inf or the sink),
with its gradients taken through it.
"""

from __future__ import annotations

import functools

import torch

from portable_ops.attention import degenerate
from portable_ops.definitions import attention_varlen as definition

from .attention import attention_bwd, attention_fwd, head_reasons, options_reasons


def attention_varlen_supports(call) -> list[str]:
    """The dense kernels' conditions that the packed layout leaves (its empty sequences are handled here), the
    longest sequences' heads (at most max_seqlen, and at most every token) bounding every sequence's."""
    longest_q = min(call["max_seqlen_q"], call["q"].shape[0])
    longest_k = min(call["max_seqlen_k"], call["k"].shape[0])
    return options_reasons(call) + head_reasons(longest_q, longest_k, call)


def _empty(q, k):
    return q.shape[-2] == 0 or k.shape[-2] == 0


def _sequence_fwd(q, k, v, *, sinks=None, **options):
    return degenerate(q, k, v, sinks) if _empty(q, k) else attention_fwd(q, k, v, sinks=sinks, **options)


def _sequence_bwd(q, k, v, out, lse, dout, *, sinks=None, dlse=None, **options):
    if not _empty(q, k):
        return attention_bwd(q, k, v, out, lse, dout, sinks=sinks, dlse=dlse, **options)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, *([] if sinks is None else [sinks]))]
    with torch.enable_grad():
        out, lse = degenerate(*leaves[:3], None if sinks is None else leaves[3])
        grads = torch.autograd.grad((out, lse), leaves, (dout, torch.zeros_like(lse) if dlse is None else dlse),
                                    allow_unused=True)
    return tuple(torch.zeros_like(leaf) if g is None else g for leaf, g in zip(leaves, grads))


attention_varlen_fwd = functools.partial(definition.attention_varlen_fwd, dense_fwd=_sequence_fwd)
attention_varlen_bwd = functools.partial(definition.attention_varlen_bwd, dense_bwd=_sequence_bwd)
