"""The oracles the runner compares a backend with: ``float64``, the reference backend's code run in float64
on the CPU, and ``torch``, PyTorch itself (``torch.optim``'s functional Adam and SGD, SDPA under an explicit
mask) or, for what SDPA lacks, the defining formula of the model family that introduced it (Gemma 2's softcap,
gpt-oss's sinks)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.optim.adam import adam as torch_adam
from torch.optim.sgd import sgd as torch_sgd

from portable_ops.definitions.adam import adam as reference_adam
from portable_ops.definitions.attention import attention_bwd as reference_attention_bwd
from portable_ops.definitions.attention import attention_fwd as reference_attention_fwd
from portable_ops.definitions.sgd import sgd as reference_sgd

F64 = torch.float64


def adam_oracle(oracle, state, grads, kw):
    """One step of the oracle on float64 CPU copies of ``state`` (params, exp_avgs, exp_avg_sqs, maxs, steps) and
    ``grads``, which it leaves as the step must leave the caller's (scaled, where the step scales them)."""
    params, exp_avgs, exp_avg_sqs, maxs, steps = state
    if oracle == "float64":
        reference_adam(params, grads, exp_avgs, exp_avg_sqs, maxs, steps, **kw)
        return
    # torch's functional adam (its fused CPU kernel takes grad_scale/found_inf and unscales the grads in place);
    # clip_coef is ours alone: the grads clipped in place first, as torch's clip_grad_norm_, unless the step is skipped
    clip, found_inf = kw["clip_coef"], kw["found_inf"]
    if clip is not None and (found_inf is None or found_inf.item() == 0):
        for g in grads:
            g.mul_(clip.item())
    steps32 = [s.float() for s in steps]
    torch_adam(params, grads, exp_avgs, exp_avg_sqs, maxs, steps32, fused=True,
               grad_scale=None if kw["grad_scale"] is None else kw["grad_scale"].float(),
               found_inf=None if kw["found_inf"] is None else kw["found_inf"].float(),
               decoupled_weight_decay=kw["decoupled_weight_decay"], amsgrad=kw["amsgrad"],
               beta1=kw["beta1"], beta2=kw["beta2"],
               lr=kw["lr"].item() if isinstance(kw["lr"], torch.Tensor) else kw["lr"],
               weight_decay=kw["weight_decay"], eps=kw["eps"], maximize=kw["maximize"])
    for s, s32 in zip(steps, steps32):
        s.copy_(s32)


def torch_mask(sq, skv, causal, window):
    """Which keys each query sees, spelled apart from the reference's ``visible`` (diagonal offsets of
    ``tril``, bottom-right: query ``i`` sits at key position ``i + skv - sq``)."""
    ones = torch.ones(sq, skv, dtype=torch.bool)
    shift, mask = skv - sq, ones
    if causal:
        mask = mask & ones.tril(shift)
    left, right = window or (None, None)
    if left is not None:
        mask = mask & ~ones.tril(shift - left - 1)
    if right is not None:
        mask = mask & ones.tril(shift + right)
    return mask


def torch_attention(q, k, v, mask, scale, softcap, sinks=None):
    """``(out, lse)``, PyTorch's attention under an explicit boolean mask: SDPA (v padded with zeros to q's head
    dim where it has its own, as transformers pads it for FlashAttention, out cut back) or, where SDPA has no
    such option, the model family's own formula: the softcapped scores (``softcap * tanh(s / softcap)`` of the
    scaled scores, then the mask; Gemma 2's), and the sinks as gpt-oss's eager attention takes them (one more
    column of logits per row, the row's maximum subtracted, dropped after the softmax). lse is the logsumexp of
    those logits."""
    groups = q.shape[1] // k.shape[1]
    k_heads, v_heads = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    scores = (q @ k_heads.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    if softcap is None and sinks is None:
        return _padded_sdpa(q, k, v, mask, scale), lse
    weights = torch.softmax(scores - scores.max(dim=-1, keepdim=True).values, dim=-1)
    return (weights if sinks is None else weights[..., :-1]) @ v_heads, lse


def _padded_sdpa(q, k, v, mask, scale):
    """SDPA, its q, k and v zero-padded to one head dim (the wider of q's and v's: zeros add nothing to a score
    or to out), out cut back to v's."""
    width = max(q.shape[-1], v.shape[-1])
    q, k, padded_v = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, padded_v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[..., :v.shape[-1]]


class Expected(NamedTuple):
    """An oracle's attention of some query rows: out and lse on those rows, and the gradients (None when no dout
    was given): dq on those rows, dk, dv over every key, dsinks (None without sinks)."""

    out: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor | None = None
    dk: torch.Tensor | None = None
    dv: torch.Tensor | None = None
    dsinks: torch.Tensor | None = None


def attention_oracle(oracle, q, k, v, dout, rows, causal, scale, window=None, softcap=None, sinks=None,
                     dlse=None) -> Expected:
    """The attention of query rows ``rows = (start, end)`` alone: with ``dout`` (and ``dlse``) zero on every other
    row, the whole attention's gradients. Causal: the keys end at the last one the block's last row sees, so
    that the block's bottom-right mask is the whole sequence's. ``dout=None``: out and lse alone. Without sinks
    the torch oracle takes only the rows that see a key (SDPA gives NaN for the others): zeros and lse -inf
    elsewhere, as the convention says; with sinks every row (gpt-oss's formula gives the others the sink alone)."""
    start, end = rows
    skv = k.shape[-2]
    seen = max(0, min(skv, end + skv - q.shape[-2])) if causal else skv  # 0: the block sees no key
    q, k, v = q[:, :, start:end], k[:, :, :seen], v[:, :, :seen]
    dlse = None if dlse is None else dlse[:, :, start:end]
    if oracle == "float64":
        out, lse = reference_attention_fwd(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
                                           sinks=sinks)
        if dout is None:
            return Expected(out, lse)
        grads = reference_attention_bwd(q, k, v, out, lse, dout[:, :, start:end], causal=causal, scale=scale,
                                        window=window, softcap=softcap, sinks=sinks, dlse=dlse)
    else:
        leaves = [t.clone().requires_grad_(dout is not None) for t in (q, k, v, *_given(sinks))]
        mask = torch_mask(q.shape[-2], seen, causal, window)
        taken = torch.arange(q.shape[-2]) if sinks is not None else mask.any(-1).nonzero()[:, 0]
        out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
        if len(taken):
            out_rows, lse_rows = torch_attention(leaves[0][:, :, taken], *leaves[1:3], mask[taken], scale, softcap,
                                                 *leaves[3:])
            out, lse = out.index_copy(2, taken, out_rows), lse.index_copy(2, taken, lse_rows)
        if dout is None:
            return Expected(out.detach(), lse.detach())
        grads = [torch.zeros_like(t) for t in leaves]
        if len(taken):
            outputs, given = ((out,), (dout[:, :, start:end],)) if dlse is None else \
                ((out, lse), (dout[:, :, start:end], dlse))
            grads = torch.autograd.grad(outputs, leaves, given)
    dq, dk, dv, *dsinks = grads
    unseen = (0, 0, 0, skv - seen)
    return Expected(out.detach(), lse.detach(), dq, F.pad(dk, unseen), F.pad(dv, unseen), (dsinks or [None])[0])


def _given(tensor) -> tuple:
    return () if tensor is None else (tensor,)


def sgd_oracle(oracle, params, buffers, grads, kw):
    """One SGD step of the oracle on float64 CPU copies: ``buffers`` holds None where a momentum buffer is not
    made yet, and takes the new ones. ``float64``: the definition. ``torch``: ``torch.optim``'s functional SGD,
    its single-tensor path, on grads unscaled and clipped in place beforehand (grad_scale and clip_coef are the
    fused step's), and a step found_inf skips is not taken, as torch's GradScaler skips ``step()``. Both leave
    ``grads`` as the step must leave the caller's."""
    if kw["found_inf"] is not None and kw["found_inf"].item() != 0:
        return
    options = {k: kw[k] for k in ("momentum", "dampening", "weight_decay", "nesterov", "maximize")}
    lr = kw["lr"].item() if isinstance(kw["lr"], torch.Tensor) else kw["lr"]
    if oracle == "float64":
        first = [b is None for b in buffers] if kw["momentum"] else []
        made = [torch.empty_like(p) if b is None else b for p, b in zip(params, buffers)] if kw["momentum"] else []
        reference_sgd(params, grads, made, first, lr=lr, grad_scale=kw["grad_scale"], clip_coef=kw["clip_coef"],
                      **options)
        buffers[:] = made or buffers
        return
    for g in grads:  # in place: a scaled step leaves the grads unscaled and clipped
        if kw["grad_scale"] is not None:
            g.div_(kw["grad_scale"].item())
        if kw["clip_coef"] is not None:
            g.mul_(kw["clip_coef"].item())
    torch_sgd(params, grads, buffers, foreach=False, fused=False, lr=lr, **options)
