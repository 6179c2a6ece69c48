"""Linear cross-entropy's rows step as an NKI kernel: the chunks and their matmuls run on the host side
(``portable_ops/lm_head.py``, torch's matmul on the device), and the kernel takes a chunk's logits ``[C, V]`` from
HBM and returns each token's loss and, with gradients, ``d loss / d logits`` times the token's scale.

Layout: tokens on the partitions, up to 128 per tile; the vocab along the free axis in tiles of ``TILE_V`` columns
(any V: Gemma's 256k is 63 tiles), loaded as stored (a DMA converts only in some descriptor modes; the engines
read any dtype and compute in float32). A softcap is the Scalar Engine's ``tanh`` of the tile as it is loaded,
``y = tanh(x / softcap)``; the capped logits are ``softcap * y``, a scale the exponentials take for free as the
activation's pre-scale. The first pass keeps per row the running max (Vector Engine reduce; none under a softcap
up to ``BOUNDED_CAP``, whose logits are bounded), the running sum of exponentials (the Scalar Engine's ``exp`` with
its add-reduction, the old sum rescaled by ``exp(old max - new max)``) and, for label smoothing, the row's sum; then
``loss = lse - (1 - eps) * z[target] - eps * mean(z)``, ``z[target]`` from the target's logit the host gathers.
The second pass takes the first tiles from SBUF, where the first pass kept them (``KEPT_BYTES`` a partition), reads
the others again, and writes ``(softmax - eps / V) * (1 - y^2) * scale`` (``exp`` on the Scalar
Engine, the shift and scale on GpSimd, the softcap's square split between the Scalar Engine and GpSimd and its
product on the Vector Engine), rounded once to the
logits' dtype by the engine that computes it last: every column's gradient but the target's. The target's,
``(softmax - (1 - eps) - eps / V) * (1 - y^2) * scale``, is a ``[C, 1]`` float32 column computed from the gathered
logit, which the host writes into its column (one element a token, rounded once): no one-hot pass over the tiles.

The host hands a 0/1 ``valid`` column and the per-token ``scale`` (0 for an ignored token), so an ignored token's
loss and gradients are zeros.
"""

from __future__ import annotations

from functools import partial

import torch

from portable_ops import lm_head

from .compat import nisa, nki, nl
from .runtime import kernel_op, launch

PMAX = 128
TILE_V = 4096  # columns per tile: a pass holds five float32 tiles of it, 80 KiB of a partition's 224
SQUARED_ON_SCALAR = 0.375  # the Scalar Engine's share of the softcap's y^2, GpSimd squaring the rest: both done
# within the Vector Engine's product of the same tile
KEPT_BYTES = 128 * 1024  # of a partition's SBUF, the logits the first pass keeps for the second (not re-read)
NEG = -1.0e30  # the running max before the first tile: finite, so exp(NEG - max) is 0 with no inf - inf
BOUNDED_CAP = 40.0  # a softcap up to this: exp(z - softcap) >= e^-80, inside float32's normal range


def _column(rows, value=None):
    column = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    if value is not None:
        nisa.memset(dst=column, value=value)
    return column


def _loaded_column(src, r0, rows):
    column = _column(rows)
    nisa.dma_copy(dst=column, src=src[r0:r0 + rows, 0:1])
    return column


def _tile(logits, r0, rows, v0, width, softcap, kept=None):
    """A ``[rows, width]`` tile of the logits as stored; with a softcap ``tanh(x / softcap)`` in float32. ``kept``
    (the row tile's logits the first pass keeps in SBUF for the second, by first column): the tile is taken from
    it if there, else loaded and put in it while it holds fewer than ``KEPT_BYTES`` a partition."""
    raw = None if kept is None else kept.pop(v0, None)
    if raw is None:
        raw = nl.ndarray((rows, width), dtype=logits.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=raw, src=logits[r0:r0 + rows, v0:v0 + width])  # as stored: the engines read any dtype
        if kept is not None and (v0 + width) * logits.dtype.itemsize <= KEPT_BYTES:
            kept[v0] = raw
    if softcap is None:
        return raw
    y = nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=y, op=nl.tanh, data=raw, scale=1.0 / softcap)
    return y


def _statistics(logits, r0, rows, softcap, smoothing, kept):
    """``(lse, total)`` ``[rows, 1]`` columns of a row tile: the capped logits' logsumexp, and the row's sum of ``y``
    (the capped logits over ``softcap``; None unless ``smoothing``)."""
    v = logits.shape[1]
    zscale = 1.0 if softcap is None else softcap
    bounded = softcap is not None and softcap <= BOUNDED_CAP
    # capped logits lie in [-softcap, softcap]: shifted by softcap, exp neither overflows nor leaves float32's
    # normal range, so no running max is kept
    top = _column(rows, softcap if bounded else NEG)
    neg_top = _column(rows, -softcap if bounded else None)
    sum_exp = _column(rows, 0.0)
    total = _column(rows, 0.0) if smoothing else None
    for v0 in range(0, v, TILE_V):
        width = min(TILE_V, v - v0)
        y = _tile(logits, r0, rows, v0, width, softcap, kept)
        part = _column(rows)
        if not bounded:  # the running max, and the sum so far rescaled to it
            new_top, rescale = _column(rows), _column(rows)
            nisa.tensor_reduce(dst=part, op=nl.maximum, data=y, axis=1)
            nisa.tensor_scalar(dst=new_top, data=part, op0=nl.multiply, operand0=zscale, op1=nl.maximum,
                               operand1=top, engine=nisa.engine.gpsimd)
            nisa.tensor_scalar(dst=neg_top, data=new_top, op0=nl.multiply, operand0=-1.0, engine=nisa.engine.gpsimd)
            nisa.activation(dst=rescale, op=nl.exp, data=top, bias=neg_top)
            nisa.tensor_tensor(dst=sum_exp, data1=sum_exp, data2=rescale, op=nl.multiply, engine=nisa.engine.gpsimd)
            nisa.tensor_copy(dst=top, src=new_top, engine=nisa.engine.gpsimd)
        scratch = nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=scratch, op=nl.exp, data=y, bias=neg_top, scale=zscale, reduce_op=nl.add, reduce_res=part,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.tensor_tensor(dst=sum_exp, data1=sum_exp, data2=part, op=nl.add, engine=nisa.engine.gpsimd)
        if total is not None:  # on the Scalar Engine, or the Vector Engine where the softcap's tanh keeps it busy
            if softcap is None:
                nisa.activation(dst=scratch, op=nl.copy, data=y, reduce_op=nl.add, reduce_res=part,
                                reduce_cmd=nisa.reduce_cmd.reset_reduce)
            else:
                nisa.tensor_reduce(dst=part, op=nl.add, data=y, axis=1)
            nisa.tensor_tensor(dst=total, data1=total, data2=part, op=nl.add, engine=nisa.engine.gpsimd)
    lse = _column(rows)
    nisa.activation(dst=lse, op=nl.log, data=sum_exp)
    nisa.tensor_tensor(dst=lse, data1=lse, data2=top, op=nl.add, engine=nisa.engine.gpsimd)
    return lse, total


def _gradients(logits, dlogits, lse, scale, r0, rows, softcap, smoothing, kept):
    """Writes the row tile's ``(softmax - eps / V) * slope * scale`` to ``dlogits``: every column's gradient but the
    target's, whose ``- (1 - eps) * slope * scale`` the host adds (``_target_gradient``)."""
    v = logits.shape[1]
    neg_lse = _column(rows)
    nisa.tensor_scalar(dst=neg_lse, data=lse, op0=nl.multiply, operand0=-1.0, engine=nisa.engine.gpsimd)
    if softcap is not None:  # the slope is applied as (y^2 - 1): the scale's sign flips to match
        flipped = _column(rows)
        nisa.tensor_scalar(dst=flipped, data=scale, op0=nl.multiply, operand0=-1.0, engine=nisa.engine.gpsimd)
        scale = flipped
    for v0 in range(0, v, TILE_V):
        width = min(TILE_V, v - v0)
        y = _tile(logits, r0, rows, v0, width, softcap, kept)
        grad = nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=grad, op=nl.exp, data=y, bias=neg_lse, scale=1.0 if softcap is None else softcap)
        # the last instruction writes the logits' dtype: rounded once, by the engine (a DMA may not convert)
        out = grad if dlogits.dtype == nl.float32 else nl.ndarray((rows, width), dtype=dlogits.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=grad if softcap is not None else out, data=grad, op0=nl.subtract,
                           operand0=smoothing / v, op1=nl.multiply, operand1=scale, engine=nisa.engine.gpsimd)
        if softcap is not None:  # y^2: the Scalar Engine squares the first SQUARED_ON_SCALAR of the columns
            cut = int(width * SQUARED_ON_SCALAR)
            if cut:
                nisa.activation(dst=y[0:rows, 0:cut], op=nl.square, data=y[0:rows, 0:cut])
            if cut < width:
                nisa.tensor_tensor(dst=y[0:rows, cut:width], data1=y[0:rows, cut:width], data2=y[0:rows, cut:width],
                                   op=nl.multiply, engine=nisa.engine.gpsimd)
            nisa.scalar_tensor_tensor(dst=out, data=y, op0=nl.subtract, operand0=1.0, op1=nl.multiply, operand1=grad)
        nisa.dma_copy(dst=dlogits[r0:r0 + rows, v0:v0 + width], src=out)


def _target_gradient(z, lse, scale, rows, softcap, smoothing, v):
    """The gradient at each row's target column, a ``[rows, 1]`` float32 column: ``(p - (1 - eps) - eps / V) *
    slope * scale``, ``p`` the target's probability from ``z`` (its logit, capped and over softcap with one)."""
    zscale = 1.0 if softcap is None else softcap
    p = _column(rows)
    nisa.activation(dst=p, op=nl.exp, data=z, bias=_negated(lse, rows), scale=zscale)
    grad = _column(rows)
    nisa.tensor_scalar(dst=grad, data=p, op0=nl.subtract, operand0=1.0 - smoothing + smoothing / v, op1=nl.multiply,
                       operand1=scale)
    if softcap is not None:  # times 1 - z^2
        slope = _column(rows)
        nisa.tensor_tensor(dst=slope, data1=z, data2=z, op=nl.multiply)
        nisa.tensor_scalar(dst=slope, data=slope, op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=1.0)
        nisa.tensor_tensor(dst=grad, data1=grad, data2=slope, op=nl.multiply)
    return grad


def _negated(column, rows):
    negated = _column(rows)
    nisa.tensor_scalar(dst=negated, data=column, op0=nl.multiply, operand0=-1.0, engine=nisa.engine.gpsimd)
    return negated


@nki.jit
def rows_kernel(logits, picked, valid, scale, label_smoothing=0.0, softcap=None, grad=True):
    """``(loss, [dlogits, target_grad])`` of a chunk's contiguous logits ``[C, V]``: ``loss [C, 1]`` float32; with
    ``grad``, ``dlogits`` like the logits, right but at each token's target column, whose gradient is
    ``target_grad [C, 1]`` float32 (the host writes it there). ``picked`` (each token's target logit, as the logits
    hold it), ``valid``, ``scale``: ``[C, 1]`` float32 columns (module docstring)."""
    c, v = logits.shape
    loss_out = nl.ndarray((c, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    dlogits = nl.ndarray((c, v), dtype=logits.dtype, buffer=nl.shared_hbm) if grad else None
    target_out = nl.ndarray((c, 1), dtype=nl.float32, buffer=nl.shared_hbm) if grad else None
    for r0 in range(0, c, PMAX):
        rows = min(PMAX, c - r0)
        kept = {} if grad else None  # the first vocab tiles, loaded once for both passes
        lse, total = _statistics(logits, r0, rows, softcap, label_smoothing > 0, kept)
        z = _tile(picked, r0, rows, 0, 1, softcap)  # the target's capped logit, over softcap
        loss = _column(rows)  # lse - (1 - eps) * z[target] - eps * mean(z), zero where ignored
        zscale = 1.0 if softcap is None else softcap
        nisa.scalar_tensor_tensor(dst=loss, data=z, op0=nl.multiply, operand0=-zscale * (1 - label_smoothing),
                                  op1=nl.add, operand1=lse)
        if total is not None:
            nisa.scalar_tensor_tensor(dst=loss, data=total, op0=nl.multiply, operand0=-zscale * label_smoothing / v,
                                      op1=nl.add, operand1=loss)
        nisa.tensor_tensor(dst=loss, data1=loss, data2=_loaded_column(valid, r0, rows), op=nl.multiply)
        nisa.dma_copy(dst=loss_out[r0:r0 + rows, 0:1], src=loss)
        if grad:
            row_scale = _loaded_column(scale, r0, rows)
            nisa.dma_copy(dst=target_out[r0:r0 + rows, 0:1],
                          src=_target_gradient(z, lse, row_scale, rows, softcap, label_smoothing, v))
            _gradients(logits, dlogits, lse, row_scale, r0, rows, softcap, label_smoothing, kept)
    return (loss_out, dlogits, target_out) if grad else (loss_out,)


# ----------------------------------------------------------------------------- host side
def _as_column(t):
    return t.to(torch.float32).reshape(-1, 1).contiguous()


def _fake_rows(logits, picked, valid, scale, label_smoothing, softcap, grad):
    column = logits.new_empty((logits.shape[0], 1), dtype=torch.float32)
    return [column, *([logits.new_empty(logits.shape), torch.empty_like(column)] if grad else [])]


@kernel_op("linear_cross_entropy_rows", _fake_rows)
def rows_op(logits: torch.Tensor, picked: torch.Tensor, valid: torch.Tensor, scale: torch.Tensor,
            label_smoothing: float, softcap: float | None, grad: bool) -> list[torch.Tensor]:
    """The kernel's launch as the op ``portable_ops_nki::linear_cross_entropy_rows``: ``[loss [C, 1] float32,
    dlogits?, target_grad [C, 1] float32?]`` from the ``[C, 1]`` float32 columns (module docstring)."""
    return list(launch(rows_kernel, logits.contiguous(), picked, valid, scale, label_smoothing=label_smoothing,
                       softcap=softcap, grad=grad))


def _rows(logits, target, row_scale, ignore_index, label_smoothing, softcap, grad):
    valid = target != ignore_index
    index = torch.where(valid, target, 0)[:, None]  # an ignored token's row is zeros, its "target" column too
    outs = rows_op(logits, _as_column(logits.gather(1, index)), _as_column(valid),
                   _as_column(torch.where(valid, row_scale, 0.0)), float(label_smoothing),
                   None if softcap is None else float(softcap), grad)
    if not grad:
        return outs[0].reshape(-1), None
    dlogits = outs[1].scatter_(1, index, outs[2].to(outs[1].dtype))  # rounded once, from float32
    return outs[0].reshape(-1), dlogits


linear_cross_entropy_fwd = partial(lm_head.forward, _rows)
linear_cross_entropy_bwd = partial(lm_head.backward, _rows)
