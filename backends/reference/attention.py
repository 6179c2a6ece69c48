"""Attention forward and backward, materialising the score matrix, in plain PyTorch.

Conventions every backend shares: ``lse`` is the natural-log log-sum-exp of the
scaled, masked scores per query row (float32, float64 for float64 inputs);
``causal`` aligns the mask to the bottom right, so query ``i`` sees keys
``j <= i + Skv - Sq``; a row that sees no key (only when ``Sq > Skv``) outputs
zeros, has ``lse = -inf`` and gets zero gradient.
"""

from __future__ import annotations

import torch


def _opmath(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _expand_kv(t, groups):
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


def _probabilities(q, k, causal, scale):
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        sq, skv = q.shape[-2], k.shape[-2]
        rows = torch.arange(sq, device=q.device)[:, None]
        cols = torch.arange(skv, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows + (skv - sq), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    finite_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - finite_lse[..., None]), lse


def attention_fwd(q, k, v, *, causal, scale):
    dtype, groups = _opmath(q), q.shape[1] // k.shape[1]
    q32, k32, v32 = q.to(dtype), _expand_kv(k.to(dtype), groups), _expand_kv(v.to(dtype), groups)
    p, lse = _probabilities(q32, k32, causal, scale)
    return (p @ v32).to(q.dtype), lse


def attention_bwd(q, k, v, out, lse, dout, *, causal, scale):
    dtype, groups = _opmath(q), q.shape[1] // k.shape[1]
    q32, k32, v32 = q.to(dtype), _expand_kv(k.to(dtype), groups), _expand_kv(v.to(dtype), groups)
    dout32 = dout.to(dtype)
    p, _ = _probabilities(q32, k32, causal, scale)
    dv = p.transpose(-1, -2) @ dout32
    dp = dout32 @ v32.transpose(-1, -2)
    delta = (dout32 * out.to(dtype)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = (ds @ k32) * scale
    dk = (ds.transpose(-1, -2) @ q32) * scale
    b, hkv, skv, d = k.shape
    dk = dk.view(b, hkv, groups, skv, d).sum(2)
    dv = dv.view(b, hkv, groups, skv, d).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
