"""RMSNorm and LayerNorm over the last dim, forward and backward, in plain PyTorch.

``x`` is ``[M, D]`` (the public function folds the leading dims into rows); ``residual``, when given,
is added first and the sum, rounded to x's dtype, is what is normalised and returned (a pre-norm
block's residual stream). Statistics are float32 (float64 for float64 inputs): ``mean`` and ``rstd``
per row, ``rstd = 1 / sqrt(mean((h - mean)^2) + eps)`` (RMSNorm: ``mean`` is 0). The output and the
gradients of x are in x's dtype, weight and bias gradients in theirs, as torch's ``F.rms_norm`` /
``F.layer_norm`` give them.
"""

from __future__ import annotations

import torch


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def norm_fwd(x, residual, weight, bias, eps, rms):
    """``(out, h, mean, rstd)``: ``h = x + residual`` in x's dtype (None without a residual), ``out`` the
    norm of ``h`` (of x without one) in its dtype; ``mean`` None for RMSNorm."""
    h = (x + residual).to(x.dtype) if residual is not None else None
    src = h if h is not None else x
    f = src.to(stats_dtype(src.dtype))
    mean = None if rms else f.mean(-1)
    centred = f if rms else f - mean[:, None]
    rstd = torch.rsqrt(centred.square().mean(-1) + eps)
    y = centred * rstd[:, None]
    if weight is not None:
        y = y * weight.to(y.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(src.dtype), h, mean, rstd


def norm_bwd(x, weight, mean, rstd, dout, dh, rms, has_bias):
    """``(dx, dweight, dbias)`` from the saved ``mean``/``rstd`` (``x``: what was normalised, the sum
    ``h`` with a residual); ``dh``: a gradient reaching ``h`` itself, added to dx (None: none).
    ``dx`` in x's dtype; ``dweight`` (None without a weight) and ``dbias`` (None unless ``has_bias``) in the
    statistics' dtype, summed over the rows: the caller rounds them once to the parameters' dtypes."""
    dt = stats_dtype(x.dtype)
    f = x.to(dt)
    xhat = (f if rms else f - mean[:, None]) * rstd[:, None]
    dy = dout.to(dt)
    wdy = dy * weight.to(dt) if weight is not None else dy
    d = x.shape[-1]
    c1 = (wdy * xhat).sum(-1, keepdim=True) / d
    dx = wdy - xhat * c1
    if not rms:
        dx = dx - wdy.sum(-1, keepdim=True) / d
    dx = dx * rstd[:, None]
    if dh is not None:
        dx = dx + dh.to(dt)
    dweight = (dy * xhat).sum(0) if weight is not None else None
    dbias = dy.sum(0) if has_bias else None
    return dx.to(x.dtype), dweight, dbias


def rms_norm(x, weight=None, eps=1e-6, residual=None):
    """RMSNorm of ``x [..., D]`` over its last dim, differentiable (what double backward and the
    torch.func transforms differentiate); with ``residual``, ``(norm(x + residual), x + residual)``."""
    return _differentiable(x, weight, None, eps, residual, rms=True)


def layer_norm(x, weight=None, bias=None, eps=1e-5, residual=None):
    """LayerNorm of ``x [..., D]`` over its last dim, as :func:`rms_norm`."""
    return _differentiable(x, weight, bias, eps, residual, rms=False)


def _differentiable(x, weight, bias, eps, residual, rms):
    h = (x + residual).to(x.dtype) if residual is not None else x
    f = h.to(stats_dtype(h.dtype))
    centred = f if rms else f - f.mean(-1, keepdim=True)
    y = centred * torch.rsqrt(centred.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    y = y.to(h.dtype)
    return (y, h) if residual is not None else y
