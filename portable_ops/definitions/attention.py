"""Attention forward, backward and forward-mode derivative in plain PyTorch, one block of queries
at a time.

Conventions every backend shares: ``lse`` is the natural-log log-sum-exp of the scaled, capped,
masked scores per query row (float32, float64 for float64 inputs). Masks are aligned to the bottom
right: query ``i`` sits at key position ``p = i + Skv - Sq``; ``causal`` hides keys ``j > p``, and
``window = (left, right)`` hides keys outside ``p - left <= j <= p + right`` (None: that side
unbounded); :func:`visible` is the one definition. ``softcap`` replaces each scaled score ``s`` by
``softcap * tanh(s / softcap)`` before the mask. ``sinks`` (gpt-oss), one logit per query head, adds a
term ``exp(sink)`` that carries no value to each row's softmax denominator (neither scaled nor capped):
``lse`` includes it, and its gradient is ``-sum over rows of p_sink * delta`` (:func:`sink_gradient`). A row
that sees no key outputs zeros and gets zero gradient; its ``lse`` is ``-inf``, or its sink. The gradient
through ``lse`` is exact: an incoming ``dlse`` turns each row's ``delta = rowsum(dout * out)`` into ``delta -
dlse`` (``d lse / d s = P``), the sinks' gradient included.

Grouped-query attention is computed without repeating K and V: the ``G = Hq / Hkv`` query heads
of a KV head are stacked as ``G * Sq`` rows against that head's keys. Rows are taken in blocks
sized so that one block's scores hold at most ``SCORE_BUDGET`` elements, so a call that falls
back here costs time, never a whole ``Sq x Skv`` matrix of memory. The forward is built from
differentiable torch ops: run with autograd on, it is also the definition that double backward
and every torch.func transform differentiate. Packed (varlen) and paged attention are this dense
attention applied per sequence (``attention_varlen.py``, ``paged.py``). v may have a head dim of its own
(DeepSeek's MLA): q and k's is contracted in the scores, v's is out's.
"""

from __future__ import annotations

import torch

from portable_ops.layout import as_layout_of

SCORE_BUDGET = 1 << 24  # elements of one block's scores (64 MiB in float32)


def opmath(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _rows(t, hkv):
    """``[B, Hq, S, D]`` -> ``[B, Hkv, G * S, D]``: the query heads of each KV head as one stack of rows."""
    b, hq, s, d = t.shape
    return t.reshape(b, hkv, (hq // hkv) * s, d)


def _heads(t, hq):
    """The inverse of :func:`_rows` (also for ``[B, Hkv, G * S]`` row vectors)."""
    b, hkv, rows = t.shape[:3]
    return t.reshape(b, hq, rows * hkv // hq, *t.shape[3:])


def _blocks(rows, b, hkv, skv):
    """``(start, end)`` blocks of rows; one empty block when there are no rows, so that every result
    (an empty one included) is a concatenation of blocks."""
    step = max(1, SCORE_BUDGET // max(1, b * hkv * skv))
    return [(start, min(rows, start + step)) for start in range(0, max(rows, 1), step)]


def visible(q_pos, k_pos, causal, window):
    """Which keys each query sees, ``[len(q_pos), len(k_pos)]`` booleans from the queries' and keys'
    positions, or None when every key is visible."""
    left, right = window or (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    if left is None and right is None:
        return None
    offset = k_pos[None, :] - q_pos[:, None]  # how far after the query's position each key sits
    seen = torch.ones_like(offset, dtype=torch.bool)
    if left is not None:
        seen &= offset >= -left
    if right is not None:
        seen &= offset <= right
    return seen


def _scores(q_rows, k, start, sq, causal, scale, window=None, softcap=None):
    """Scaled, capped, masked scores of rows ``start ..`` of the stacked queries against every key, and
    ``tanh(s / softcap)`` of the scaled scores ``s`` for the softcap's chain rule (None without one)."""
    scores = (q_rows @ k.transpose(-1, -2)) * scale
    tanh = None
    if softcap is not None:
        # a cap past the scores' dtype's range is inf there (inf * tanh(0) is NaN): such a cap is taken in float64
        wide = scores.double() if softcap > torch.finfo(scores.dtype).max else scores
        tanh = torch.tanh(wide / softcap)
        scores, tanh = (softcap * tanh).to(scores.dtype), tanh.to(scores.dtype)
    skv = k.shape[-2]
    q_pos = torch.arange(start, start + q_rows.shape[-2], device=q_rows.device) % sq + (skv - sq)
    seen = visible(q_pos, torch.arange(skv, device=q_rows.device), causal, window)
    if seen is not None:
        scores = scores.masked_fill(~seen, float("-inf"))
    return scores, tanh


def _sink_rows(sinks, hkv, sq, dtype):
    """``sinks [Hq]`` as the stacked rows' ``[Hkv, G * Sq]`` (None for None)."""
    if sinks is None:
        return None
    return sinks.to(dtype).reshape(hkv, -1, 1).expand(-1, -1, sq).reshape(hkv, -1)


def _logsumexp(scores, sinks):
    """Each row's lse, its sink (``[rows]``, broadcast over the batch) one more column: gpt-oss's formula. A
    row that sees no key has ``lse = sink``, with finite gradients."""
    if sinks is None:
        return torch.logsumexp(scores, dim=-1)
    return torch.logsumexp(torch.cat([scores, sinks.expand(scores.shape[:-1])[..., None]], dim=-1), dim=-1)


def sink_gradient(sinks, lse, delta):
    """The gradient of ``sinks [H]``, from each row's lse and its ``delta`` (``rowsum(dout * out)``), both
    ``[..., H, S]``: the sink's probability is ``p_sink = exp(sink - lse)``, and ``d/d sink = -sum of p_sink *
    delta`` over the rows of its head (zero on rows whose lse is -inf: a sink of -inf is none)."""
    p_sink = torch.exp(sinks.to(lse.dtype)[:, None] - lse).masked_fill(lse == float("-inf"), 0.0)
    return -(p_sink * delta).sum(dim=[d for d in range(lse.dim()) if d != lse.dim() - 2])


def _probabilities(scores, lse):
    """exp(scores - lse), zero on rows that see no key (lse = -inf there)."""
    return torch.exp(scores - torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)[..., None])


def _through_softcap(d_scores, tanh):
    """A derivative by the capped scores taken back to the scaled ones: ``d/ds softcap tanh(s / softcap)
    = 1 - tanh^2``; finite where the mask hid a key (tanh is taken before the mask)."""
    return d_scores if tanh is None else d_scores * (1 - tanh * tanh)


def _opmath_rows(q, k, v):
    dtype, hkv = opmath(q), k.shape[1]
    return _rows(q.to(dtype), hkv), k.to(dtype), v.to(dtype)


def attention_fwd(q, k, v, *, causal, scale, window=None, softcap=None, sinks=None):
    hq, sq = q.shape[1], q.shape[2]
    q_rows, k32, v32 = _opmath_rows(q, k, v)
    b, hkv, rows = q_rows.shape[:3]
    sink_rows = _sink_rows(sinks, hkv, sq, q_rows.dtype)
    outs, lses = [], []
    for start, end in _blocks(rows, b, hkv, k.shape[2]):
        scores, _ = _scores(q_rows[:, :, start:end], k32, start, sq, causal, scale, window, softcap)
        lse = _logsumexp(scores, None if sink_rows is None else sink_rows[:, start:end])
        outs.append(_probabilities(scores, lse) @ v32)
        lses.append(lse)
    out = _heads(torch.cat(outs, dim=2), hq).to(q.dtype)
    return as_layout_of(out, q), _heads(torch.cat(lses, dim=2), hq)


def attention_bwd(q, k, v, out, lse, dout, *, causal, scale, window=None, softcap=None, sinks=None, dlse=None):
    """``(dq, dk, dv)``, and ``dsinks`` after them when there are sinks; ``dlse``: None, or the gradient that
    reached lse."""
    hq, sq = q.shape[1], q.shape[2]
    q_rows, k32, v32 = _opmath_rows(q, k, v)
    b, hkv, rows = q_rows.shape[:3]
    dtype = q_rows.dtype
    do_rows = _rows(dout.to(dtype), hkv)
    delta = (do_rows * _rows(out.to(dtype), hkv)).sum(-1)
    if dlse is not None:
        delta = delta - _rows(dlse.to(dtype)[..., None], hkv)[..., 0]
    lse_rows = _rows(lse.to(dtype)[..., None], hkv)[..., 0]
    dq = torch.empty_like(q_rows)
    dk, dv = torch.zeros_like(k32), torch.zeros_like(v32)
    for start, end in _blocks(rows, b, hkv, k.shape[2]):
        q_blk, do_blk = q_rows[:, :, start:end], do_rows[:, :, start:end]
        scores, tanh = _scores(q_blk, k32, start, sq, causal, scale, window, softcap)
        p = _probabilities(scores, lse_rows[:, :, start:end])
        dv += p.transpose(-1, -2) @ do_blk
        ds = _through_softcap(p * (do_blk @ v32.transpose(-1, -2) - delta[:, :, start:end, None]), tanh)
        dq[:, :, start:end] = (ds @ k32) * scale
        dk += (ds.transpose(-1, -2) @ q_blk) * scale
    grads = (as_layout_of(_heads(dq, hq).to(q.dtype), q), as_layout_of(dk.to(k.dtype), k),
             as_layout_of(dv.to(v.dtype), v))
    if sinks is None:
        return grads
    return *grads, sink_gradient(sinks, lse.to(dtype), _heads(delta, hq))


def attention_jvp(q, k, v, lse, tq, tk, tv, *, causal, scale, window=None, softcap=None, sinks=None, tsinks=None):
    """The forward-mode derivative: the tangents of ``out`` and ``lse`` along tangents ``tq, tk, tv, tsinks`` of
    the inputs (None for none). With ``dS = scale (tQ K^T + Q tK^T)`` (times ``1 - tanh^2`` under a
    softcap) and ``c = rowsum(P * dS) + p_sink * tsink``, ``t_out = P tV + (P * (dS - c)) V`` and ``t_lse = c``."""
    hq, sq = q.shape[1], q.shape[2]
    q_rows, k32, v32 = _opmath_rows(q, k, v)
    b, hkv, rows = q_rows.shape[:3]
    dtype = q_rows.dtype
    tq_rows = None if tq is None else _rows(tq.to(dtype), hkv)
    tk32, tv32 = (None if t is None else t.to(dtype) for t in (tk, tv))
    lse_rows = _rows(lse.to(dtype)[..., None], hkv)[..., 0]
    sink_rows, tsink_rows = _sink_rows(sinks, hkv, sq, dtype), _sink_rows(tsinks, hkv, sq, dtype)
    t_outs, t_lses = [], []
    for start, end in _blocks(rows, b, hkv, k.shape[2]):
        q_blk = q_rows[:, :, start:end]
        scores, tanh = _scores(q_blk, k32, start, sq, causal, scale, window, softcap)
        p = _probabilities(scores, lse_rows[:, :, start:end])
        ds = torch.zeros_like(p)
        if tq_rows is not None:
            ds = ds + tq_rows[:, :, start:end] @ k32.transpose(-1, -2)
        if tk32 is not None:
            ds = ds + q_blk @ tk32.transpose(-1, -2)
        ds = _through_softcap(ds * scale, tanh)
        c = (p * ds).sum(-1, keepdim=True)
        if tsink_rows is not None:
            p_sink = torch.exp(sink_rows[:, start:end] - lse_rows[:, :, start:end])
            c = c + (p_sink * tsink_rows[:, start:end])[..., None]
        t_out = (p * (ds - c)) @ v32
        if tv32 is not None:
            t_out = t_out + p @ tv32
        t_outs.append(t_out)
        t_lses.append(c[..., 0])
    return _heads(torch.cat(t_outs, dim=2), hq).to(q.dtype), _heads(torch.cat(t_lses, dim=2), hq)
