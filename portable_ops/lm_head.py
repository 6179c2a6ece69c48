"""The LM head and its loss in chunks of tokens: how every backend runs ``linear_cross_entropy`` without a
``[tokens, vocab]`` tensor.

Per chunk of ``C`` tokens, ``C = max(1, logits_per_chunk() // V)`` (rounded down to a multiple of 128 where it is
at least 128: ``chunk_tokens``) so that a chunk's logits hold at most that many elements: torch's matmul makes the
chunk's logits ``[C, V]`` (``addmm`` with the bias) in the inputs' dtype; the backend's ``rows`` step turns them
into each token's loss and, when gradients are wanted, ``d loss / d logits`` times the token's ``row_scale``;
torch's matmuls then take the chunk's ``d_hidden = dlogits @ weight`` and add ``dlogits.T @ hidden`` to
``d_weight`` (and the column sums to ``d_bias``), whose sums are float32 (float64 for float64) and rounded once to
the parameters' dtypes at the end.

A ``rows`` step is ``rows(logits, target, row_scale, ignore_index, label_smoothing, softcap, grad)`` ->
``(loss [C], dlogits)``: ``logits [C, V]`` contiguous, ``target [C]`` int64, ``row_scale`` a 0-d or ``[C]`` tensor
in the loss dtype; ``loss`` in the loss dtype (float32, float64 for float64), 0 for an ignored token; ``dlogits``
(None unless ``grad``) in the logits' dtype and shape, 0 on an ignored token's row: the logits' own buffer,
overwritten, or a new one.
"""

from __future__ import annotations

import contextlib

import torch

from .definitions.linear_cross_entropy import loss_dtype, reduced

LOGITS_PER_CHUNK = 1 << 25  # elements of one chunk's logits: 64 MiB in bfloat16
ROW_TILE = 128  # the NKI rows kernel's tokens a tile (partitions): a ragged last tile costs a whole one
_budget = [LOGITS_PER_CHUNK]


def logits_per_chunk() -> int:
    return _budget[0]


@contextlib.contextmanager
def chunk_budget(elements: int):
    """Chunks of at most ``elements`` logits inside the block: small inputs then span several chunks (the tests'
    and the conformance cases' way to reach the chunk boundaries at small sizes)."""
    previous, _budget[0] = _budget[0], elements
    try:
        yield
    finally:
        _budget[0] = previous


def chunk_tokens(vocab: int) -> int:
    """Tokens a chunk takes: as many as the budget holds, rounded down to whole ``ROW_TILE`` rows where it holds
    that many."""
    fits = max(1, logits_per_chunk() // vocab)
    return fits - fits % ROW_TILE if fits >= ROW_TILE else fits


# CUDA's GEMM adds a half-precision product into a float32 sum itself (aten's addmm with out_dtype)
_ADDMM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out")


def _add_product(acc, a, b):
    """``acc += a @ b``; for half-precision ``a, b`` (a float32 ``acc``) the sum is kept in float32: on CUDA the GEMM
    accumulates into it, elsewhere each chunk's product is rounded once to their dtype and then added (summing in
    their dtype would round once per chunk)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda and _ADDMM_OUT_DTYPE:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += a @ b


def _chunks(rows, hidden, weight, bias, target, row_scale, ignore_index, label_smoothing, softcap, hidden_grad,
            weight_grad, bias_grad):
    """``(losses [N], dhidden, dweight, dbias)``: each token's loss, and the gradients of ``sum(row_scale * losses)``
    asked for (None for the others)."""
    n, v = hidden.shape[0], weight.shape[0]
    wide = loss_dtype(weight.dtype)
    grad = hidden_grad or weight_grad or bias_grad
    losses = torch.empty(n, dtype=wide, device=hidden.device)
    dhidden = torch.empty_like(hidden, memory_format=torch.contiguous_format) if hidden_grad else None
    dweight = torch.zeros(weight.shape, dtype=wide, device=weight.device) if weight_grad else None
    dbias = torch.zeros(v, dtype=wide, device=weight.device) if bias_grad else None
    step = chunk_tokens(v)
    for start in range(0, n, step):
        end = min(start + step, n)
        h = hidden[start:end]
        logits = h @ weight.T if bias is None else torch.addmm(bias, h, weight.T)
        scale = row_scale if row_scale.dim() == 0 else row_scale[start:end]
        losses[start:end], dlogits = rows(logits, target[start:end], scale, ignore_index, label_smoothing, softcap,
                                          grad)
        if hidden_grad:
            torch.mm(dlogits, weight, out=dhidden[start:end])
        if weight_grad:
            _add_product(dweight, dlogits.T, h)
        if bias_grad:
            dbias += dlogits.sum(0, dtype=wide)
    return (losses, dhidden, None if dweight is None else dweight.to(weight.dtype),
            None if dbias is None else dbias.to(bias.dtype))


def forward(rows, hidden, weight, bias, target, ignore_index, label_smoothing, reduction, softcap, hidden_grad,
            weight_grad, bias_grad):
    """``(loss, dhidden, dweight, dbias)``: the reduced loss (target's shape ``[N]`` for ``"none"``) and the
    gradients of the reduced loss that were asked for (the public API asks for none under ``"none"``)."""
    valid = target != ignore_index
    wide = loss_dtype(weight.dtype)
    # mean: each token's gradient over the tokens not ignored, none of them 1 / 0 when every token is ignored
    row_scale = (valid.sum().clamp(min=1).to(wide).reciprocal() if reduction == "mean"
                 else torch.ones((), dtype=wide, device=hidden.device))
    losses, dhidden, dweight, dbias = _chunks(rows, hidden, weight, bias, target, row_scale, ignore_index,
                                              label_smoothing, softcap, hidden_grad, weight_grad, bias_grad)
    return reduced(losses, valid, reduction), dhidden, dweight, dbias


def backward(rows, hidden, weight, bias, target, dloss, ignore_index, label_smoothing, softcap, hidden_grad,
             weight_grad, bias_grad):
    """``(dhidden, dweight, dbias)`` for per-token loss gradients ``dloss [N]`` (reduction ``"none"``): the chunks
    again, each token's gradient scaled by its own."""
    _, dhidden, dweight, dbias = _chunks(rows, hidden, weight, bias, target, dloss.to(loss_dtype(weight.dtype)),
                                         ignore_index, label_smoothing, softcap, hidden_grad, weight_grad, bias_grad)
    return dhidden, dweight, dbias
