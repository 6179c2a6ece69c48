"""Linear cross-entropy as torch runs it, a chunk of tokens at a time (``portable_ops/lm_head.py``): per chunk,
torch's matmul, then the rows step below, torch ops over the whole chunk (no loop over tokens): the capped logits
in the loss dtype, their logsumexp, each token's loss, and d(loss)/d(logits) formed in place in that buffer (the
softmax, minus the smoothed one-hot, times the softcap's slope and the token's scale) and written over the logits.
Float32 logits are their own work buffer; half-precision ones get a float32 copy.
"""

from __future__ import annotations

from functools import partial

import torch

from portable_ops import lm_head
from portable_ops.definitions.linear_cross_entropy import loss_dtype, token_losses


def _rows(logits, target, row_scale, ignore_index, label_smoothing, softcap, grad):
    z = logits.to(loss_dtype(logits.dtype))
    tanh = None
    if softcap is not None:
        tanh = z.div_(softcap).tanh_()  # kept for the slope, 1 - tanh^2
        z = tanh * softcap
    lse = torch.logsumexp(z, dim=-1)
    loss = token_losses(z, lse, target, ignore_index, label_smoothing)
    if not grad:
        return loss, None
    valid = target != ignore_index
    probs = z.sub_(lse[:, None]).exp_()
    picked = torch.where(valid, target, 0)[:, None]
    probs.scatter_add_(1, picked, probs.new_full(picked.shape, label_smoothing - 1))
    if label_smoothing:
        probs -= label_smoothing / logits.shape[1]
    if tanh is not None:
        probs *= tanh.square_().neg_().add_(1)
    probs *= torch.where(valid, row_scale, 0.0)[:, None]
    return loss, logits.copy_(probs)


linear_cross_entropy_fwd = partial(lm_head.forward, _rows)
linear_cross_entropy_bwd = partial(lm_head.backward, _rows)
