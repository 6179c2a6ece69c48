"""Packed variable-length attention (FlashAttention's ``varlen`` layout): the dense attention of
``attention.py`` run on each sequence in turn.

``q [Tq, Hq, D]``, ``k [Tk, Hkv, D]``, ``v [Tk, Hkv, Dv]``; sequence ``b`` is rows
``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` of q and ``cu_seqlens_k[b] : cu_seqlens_k[b + 1]`` of k and v,
and its masks are aligned to its own bottom right. ``lse`` is ``[Hq, Tq]`` (FlashAttention's layout).
Reading the offsets costs a device-to-host copy per call: fine for the definition and the fallback, not
how a kernel would do it.
"""

from __future__ import annotations

import torch

from .attention import attention_bwd, attention_fwd, opmath


def _sequences(cu_seqlens_q, cu_seqlens_k):
    """``(q rows, k rows)`` slices of each sequence."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])) for i in range(len(cq) - 1)]


def _dense(t):
    """One sequence's ``[S, H, D]`` rows as dense attention's ``[1, H, S, D]`` (a view)."""
    return t.transpose(0, 1)[None]


def _packed(t):
    """The inverse of :func:`_dense`: ``[1, H, S, D]`` -> ``[S, H, D]``."""
    return t[0].transpose(0, 1)


def _cat(parts, like, dim=0):
    """The sequences' results in order (they tile the tokens), or an empty result shaped ``like`` when
    there is no sequence."""
    return torch.cat(parts, dim=dim) if parts else torch.empty_like(like, memory_format=torch.contiguous_format)


def attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal, scale,
                         window=None, softcap=None, sinks=None, dense_fwd=attention_fwd):
    """``dense_fwd``: the dense attention run on each sequence (the reference backend passes its own)."""
    outs, lses = [], []
    for rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k):
        out, lse = dense_fwd(_dense(q[rows_q]), _dense(k[rows_k]), _dense(v[rows_k]), causal=causal, scale=scale,
                             window=window, softcap=softcap, sinks=sinks)
        outs.append(_packed(out))
        lses.append(lse[0])
    lse_like = q.new_empty((q.shape[1], q.shape[0]), dtype=opmath(q))
    out_like = q.new_empty((*q.shape[:-1], v.shape[-1]))
    return _cat(outs, out_like).contiguous(), _cat(lses, lse_like, dim=1).contiguous()


def attention_varlen_bwd(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                         causal, scale, window=None, softcap=None, sinks=None, dlse=None, dense_bwd=attention_bwd):
    """``(dq, dk, dv)``, and ``dsinks`` (summed over the sequences) after them when there are sinks."""
    dqs, dks, dvs = [], [], []
    dsinks = None if sinks is None else torch.zeros_like(sinks, dtype=lse.dtype)
    for rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k):
        dq, dk, dv, *dsink = dense_bwd(_dense(q[rows_q]), _dense(k[rows_k]), _dense(v[rows_k]), _dense(out[rows_q]),
                                       lse[None, :, rows_q], _dense(dout[rows_q]), causal=causal, scale=scale,
                                       window=window, softcap=softcap, sinks=sinks,
                                       dlse=None if dlse is None else dlse[None, :, rows_q])
        dqs.append(_packed(dq))
        dks.append(_packed(dk))
        dvs.append(_packed(dv))
        if dsink:
            dsinks += dsink[0]
    grads = _cat(dqs, q).contiguous(), _cat(dks, k).contiguous(), _cat(dvs, v).contiguous()
    return grads if sinks is None else (*grads, dsinks)
