"""Packed variable-length attention: ``attention_varlen``, FlashAttention's ``flash_attn_varlen_func``.

Many sequences of different lengths are packed along one token dimension, with no padding:
q ``[Tq, Hq, D]``, k and v ``[Tk, Hkv, D]``, and ``cu_seqlens_q`` / ``cu_seqlens_k`` (int32, ``N + 1``
entries from 0) mark where each of the N sequences starts. Eager calls run through
:class:`portable_ops.attention.EagerAttention` like dense attention; torch.compile sees the custom ops
``portable_ops::attention_varlen_fwd`` / ``_bwd``.
"""

from __future__ import annotations

import torch

from . import checks
from .attention import (EagerAttention, Options, Variant, as_returned, autocast_inputs, call_layout, degenerate,
                        fake_dsinks, lse_dtype, op_grads, refuse_transforms, register_autograd, run_op, window_args,
                        window_of, with_dsinks)
from .definitions import attention_varlen as definition


def attention_varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window,
                          softcap, sinks=None):
    """Check one call's arguments (after autocast's casts; the offsets' values once per version) and
    return them as the backends take them."""
    q, k, v = autocast_inputs(q, k, v)
    max_seqlen_q, max_seqlen_k = checks.plain(max_seqlen_q), checks.plain(max_seqlen_k)  # no numpy past here
    checks.check_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    sinks = checks.attention_sinks(sinks, q, 1)
    causal, scale, window, softcap = checks.attention_options(q.shape[-1], causal, scale, window, softcap,
                                                              compiling=torch.compiler.is_compiling())
    checks.check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k, causal=causal, scale=scale, window=window, softcap=softcap, sinks=sinks)


def forward(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window, softcap):
    """(out ``[Tq, Hq, D]``, lse ``[Hq, Tq]``) from the backend chosen for this call."""
    call = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k, causal=causal, scale=scale, window=window, softcap=softcap, sinks=sinks)
    return run_op("attention_varlen_fwd", call, call_layout(call), q.device, None)


def backward(q, k, v, out, lse, dout, dlse, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
             scale, window, softcap, prefer=None):
    """(dq, dk, dv, dsinks) from the backend chosen for this call (``prefer``: as dense attention's backward)."""
    call = dict(q=q, k=k, v=v, out=out, lse=lse, dout=dout, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal, scale=scale, window=window,
                softcap=softcap, sinks=sinks, dlse=dlse)
    return with_dsinks(run_op("attention_varlen_bwd", call, call_layout(call), q.device, prefer), sinks)


def _definition(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window,
                softcap):
    return definition.attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                           causal=causal, scale=scale, window=window, softcap=softcap, sinks=sinks)


VARLEN = Variant(forward, backward, _definition, index_tensors=2)


# ----------------------------------------------------------------------------- torch.compile

@torch.library.custom_op("portable_ops::attention_varlen_fwd", mutates_args=())
def _varlen_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool, scale: float,
                   window_left: int | None, window_right: int | None, softcap: float | None,
                   scale_tensor: torch.Tensor | None = None, softcap_tensor: torch.Tensor | None = None,
                   sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    scale, softcap = checks.op_values(scale, softcap, scale_tensor, softcap_tensor)
    # A compiled graph's first chance to read the offsets (tracing could not): once per version, as eagerly.
    checks.check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    return forward(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                   window_of(window_left, window_right), softcap)


@_varlen_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window_left, window_right,
      softcap, scale_tensor=None, softcap_tensor=None, sinks=None):
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty((q.shape[1], q.shape[0]), dtype=lse_dtype(q))


@torch.library.custom_op("portable_ops::attention_varlen_bwd", mutates_args=())
def _varlen_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   dout: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                   max_seqlen_k: int, causal: bool, scale: float, window_left: int | None, window_right: int | None,
                   softcap: float | None, scale_tensor: torch.Tensor | None = None,
                   softcap_tensor: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                   dlse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    scale, softcap = checks.op_values(scale, softcap, scale_tensor, softcap_tensor)
    return op_grads(backward(q, k, v, out, lse, dout, dlse, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                             max_seqlen_k, causal, scale, window_of(window_left, window_right), softcap))


@_varlen_bwd_op.register_fake
def _(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window_left,
      window_right, softcap, scale_tensor=None, softcap_tensor=None, sinks=None, dlse=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), fake_dsinks(q, sinks)


register_autograd(_varlen_fwd_op, _varlen_bwd_op, index_tensors=2)


# ----------------------------------------------------------------------------- the public function

def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, scale=None,
                     window=None, softcap=None, sinks=None, return_lse=False):
    """Attention of each packed sequence's queries over its own keys (FlashAttention's
    ``flash_attn_varlen_func``).

    q ``[Tq, Hq, D]``, k ``[Tk, Hkv, D]`` and v ``[Tk, Hkv, Dv]`` (``Hq % Hkv == 0``); sequence ``b`` is rows
    ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` of q and ``cu_seqlens_k[b] : cu_seqlens_k[b + 1]`` of k
    and v. ``cu_seqlens_*``: int32, on q's device, ``N + 1`` entries from 0, non-decreasing (empty
    sequences allowed), ending at ``Tq`` (``Tk``); ``max_seqlen_*``: ints at least the longest
    sequence. ``causal``, ``scale``, ``window``, ``softcap`` and ``sinks`` mean what they mean for
    :func:`portable_ops.attention`, per sequence (bottom-right: query ``i`` of sequence ``b`` sits at
    key position ``i + len_k(b) - len_q(b)``). Returns ``[Tq, Hq, Dv]``, contiguous; differentiable in
    q, k, v and sinks. ``return_lse=True`` returns ``(out, lse)``, ``lse [Hq, Tq]`` as for
    :func:`portable_ops.attention`. The offsets' values are read once per version of each tensor
    (``docs/api.md``).
    """
    refuse_transforms("attention_varlen", q, k, v, sinks)
    call = attention_varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                                 window, softcap, sinks)
    q, k, v, sinks = call["q"], call["k"], call["v"], call.pop("sinks")
    options = tuple(call.values())[3:]
    return_lse = checks.flag("return_lse", return_lse)
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        # No row sees a key, or there is nothing to compute: dense attention's answer, as one sequence
        out, lse = degenerate(*(t.transpose(0, 1)[None] for t in (q, k, v)), sinks)
        return as_returned((out[0].transpose(0, 1).contiguous(), lse[0]), return_lse)
    if torch.compiler.is_compiling():
        cu_q, cu_k, max_q, max_k, causal, scale, window, softcap = options
        scale, softcap, scale_tensor, softcap_tensor = checks.op_scalars(scale, softcap)
        return as_returned(_varlen_fwd_op(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, *window_args(window),
                                       softcap, scale_tensor, softcap_tensor, sinks), return_lse)
    return as_returned(EagerAttention.apply(q, k, v, sinks, Options(VARLEN, options)), return_lse)
