"""Linear cross-entropy: the LM head and its loss, in plain PyTorch, written to be read.

``logits = hidden @ weight.T (+ bias)`` in the inputs' dtype (rounded once to it, as ``F.linear`` gives them); from
there on float32 (float64 for float64 inputs): ``z = softcap * tanh(logits / softcap)`` (Gemma 2's final-logit
softcapping; ``z = logits`` without one), and per token, with ``lse = logsumexp(z)`` and ``eps`` the label smoothing,

    loss = (1 - eps) * (lse - z[target]) + eps * (lse - mean(z)),

torch's ``F.cross_entropy`` with ``label_smoothing``; 0 for a token whose target is ``ignore_index``. ``"mean"``
divides the sum by the number of tokens not ignored (0 / 0 is NaN, as torch's), ``"sum"`` sums, ``"none"`` keeps
one loss per token. The logits are materialised here: this is the conformance suite's oracle and what torch.func
transforms differentiate, not what the backends run (``portable_ops/lm_head.py``).
"""

from __future__ import annotations

import torch

REDUCTIONS = ("mean", "sum", "none")


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def capped(logits, softcap):
    """``softcap * tanh(logits / softcap)``; the logits themselves without a softcap."""
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def token_losses(z, lse, target, ignore_index, label_smoothing):
    """Each token's loss from its row of capped logits ``z [N, V]`` (in the loss dtype) and their ``lse [N]``: 0
    where ignored."""
    valid = target != ignore_index
    picked = z.gather(-1, torch.where(valid, target, 0)[:, None])[:, 0]
    loss = (1 - label_smoothing) * (lse - picked)
    if label_smoothing:
        loss = loss + label_smoothing * (lse - z.mean(-1))
    return torch.where(valid, loss, 0.0)


def reduced(losses, valid, reduction):
    if reduction == "none":
        return losses
    total = losses.sum()
    return total / valid.sum() if reduction == "mean" else total


def linear_cross_entropy(hidden, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0, reduction="mean",
                         softcap=None):
    """The loss of ``hidden [..., H]`` through ``weight [V, H]`` (and ``bias [V]``) against ``target [...]``,
    differentiable in hidden, weight and bias; ``"none"`` returns target's shape."""
    flat = target.reshape(-1)
    rows = hidden.reshape(flat.shape[0], hidden.shape[-1])  # not -1: H may be 0
    logits = rows @ weight.T if bias is None else torch.addmm(bias, rows, weight.T)
    z = capped(logits.to(loss_dtype(logits.dtype)), softcap)
    losses = token_losses(z, torch.logsumexp(z, dim=-1), flat, ignore_index, label_smoothing)
    loss = reduced(losses, flat != ignore_index, reduction)
    return loss.reshape(target.shape) if reduction == "none" else loss
