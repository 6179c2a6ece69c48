"""RMSNorm and LayerNorm as torch runs them: its fused kernels where it has them, the definition elsewhere.

LayerNorm is ``torch.native_layer_norm`` and its ATen backward (what ``F.layer_norm`` and its autograd run),
but for a forward whose weight and bias dtypes aten's kernel refuses (``_aten_takes``: a bfloat16 weight with
float32 x, say, which this op takes), for the backward of half-precision rows off CUDA (on the CPU ATen sums their
weight gradient in that precision, not float32 as this op promises) and for that of a weight whose dtype is not
x's (ATen's backward takes one dtype): those run the definition.

RMSNorm is ATen's ``_fused_rms_norm`` (what ``F.rms_norm`` runs on CUDA and CPU in recent torch) forward, and its
fused backward on CUDA; on other devices, and on a torch without those ops, the definition
(``portable_ops/definitions/norms.py``), plain torch ops, as ``F.rms_norm``'s own composite is there.
"""

from __future__ import annotations

import torch

from portable_ops.definitions.norms import norm_bwd, norm_fwd

_aten = torch.ops.aten
# aten's fused RMSNorm through torch's C binding: torch.ops' Python dispatch costs several us a call
_fused_rms = getattr(torch, "_fused_rms_norm", None)
_FUSED_RMS_BACKWARD = hasattr(_aten, "_fused_rms_norm_backward")
_HALF = (torch.float16, torch.bfloat16)


def _sum(x, residual):
    return None if residual is None else (x + residual).contiguous()


# Every output is row-major, as the custom ops' fake outputs are (portable_ops/norms.py): a sum or the definition's
# element-wise result follows a transposed x's or dout's strides, so those are made contiguous.

def rms_norm_fwd(x, residual, weight, eps):
    h = _sum(x, residual)
    src = h if h is not None else x
    if _fused_rms is None:
        out, _, _, rstd = norm_fwd(src, None, weight, None, eps, rms=True)
        return out.contiguous(), h, rstd
    out, rstd = _fused_rms(src, [src.shape[-1]], weight, eps)
    return out, h, rstd.reshape(-1)


def prepare_rms_norm_fwd(x, residual, weight, eps):
    """``rms_norm_fwd`` for every call of this one's layout and eps (``OpImpl.prepare``): ``run(x, residual,
    weight)``, aten's fused op called at once where it runs the call (no residual to add first)."""
    if residual is not None or _fused_rms is None:
        return lambda x, residual, weight: rms_norm_fwd(x, residual, weight, eps)
    normalized = [x.shape[-1]]

    def run(x, residual, weight):
        out, rstd = _fused_rms(x, normalized, weight, eps)
        return out, None, rstd.reshape(-1)

    return run


def rms_norm_bwd(x, weight, rstd, dout, dh):
    if _FUSED_RMS_BACKWARD and x.is_cuda:
        dx, dweight = _aten._fused_rms_norm_backward(dout, x, [x.shape[-1]], rstd[:, None], weight,
                                                     [True, weight is not None])
        return (dx if dh is None else dx.add_(dh)), dweight  # in place: dx's layout, whatever dh's
    dx, dweight, _ = norm_bwd(x, weight, None, rstd, dout, dh, rms=True, has_bias=False)
    return dx.contiguous(), dweight


def _aten_takes(x, weight, bias) -> bool:
    """Whether ``native_layer_norm`` takes these dtypes: weight and bias in x's, or both float32 with half-precision
    x (the CPU's mixed-dtype kernel; other devices' kernels are given it as before, unverified here). Any other mix
    (a bfloat16 weight with float32 x, a weight and bias of two dtypes), which this op takes, aten's CPU kernel
    refuses."""
    dtypes = {t.dtype for t in (weight, bias) if t is not None}
    return dtypes <= {x.dtype} or (x.dtype in _HALF and dtypes == {torch.float32})


def layer_norm_fwd(x, residual, weight, bias, eps):
    h = _sum(x, residual)
    src = h if h is not None else x
    if not _aten_takes(src, weight, bias):
        out, _, mean, rstd = norm_fwd(src, None, weight, bias, eps, rms=False)
        return out.contiguous(), h, mean, rstd
    out, mean, rstd = torch.native_layer_norm(src, [src.shape[-1]], weight, bias, eps)
    return out, h, mean.reshape(-1), rstd.reshape(-1)


def prepare_layer_norm_fwd(x, residual, weight, bias, eps):
    """``layer_norm_fwd`` for every call of this one's layout and eps (``OpImpl.prepare``): ``run(x, residual,
    weight, bias)``, ``native_layer_norm`` called at once where it runs the call (dtypes it takes, no residual)."""
    if residual is not None or not _aten_takes(x, weight, bias):
        return lambda x, residual, weight, bias: layer_norm_fwd(x, residual, weight, bias, eps)
    normalized = [x.shape[-1]]

    def run(x, residual, weight, bias):
        out, mean, rstd = torch.native_layer_norm(x, normalized, weight, bias, eps)
        return out, None, mean.reshape(-1), rstd.reshape(-1)

    return run


def layer_norm_bwd(x, weight, mean, rstd, dout, dh, has_bias):
    # ATen's backward takes one dtype, and on the CPU sums a half-precision dweight in that precision (CUDA's in
    # float32; other device types are not known to)
    if (weight is not None and weight.dtype != x.dtype) or (x.device.type != "cuda" and x.dtype in _HALF):
        dx, dweight, dbias = norm_bwd(x, weight, mean, rstd, dout, dh, rms=False, has_bias=has_bias)
        return dx.contiguous(), dweight, dbias
    # ATen reads the bias only to know it has one (its gradient is dout's column sums): a placeholder stands in
    stand_in = x.new_empty(x.shape[-1:]) if has_bias else None
    dx, dweight, dbias = _aten.native_layer_norm_backward(dout, x, [x.shape[-1]], mean[:, None], rstd[:, None],
                                                          weight, stand_in, [True, weight is not None, has_bias])
    return (dx if dh is None else dx.add_(dh)), dweight, dbias


def _differentiable(x, weight, bias) -> bool:
    """Whether torch's own norms compute this op for these tensors, backward included: one dtype (torch's
    composite RMSNorm returns a float32 weight's promotion), on CUDA, or float32/float64 elsewhere (on the CPU
    ATen sums a half-precision LayerNorm weight gradient in that precision)."""
    one_dtype = all(t is None or t.dtype == x.dtype for t in (weight, bias))
    return one_dtype and (x.is_cuda or x.dtype in (torch.float32, torch.float64))


def differentiable_rms_norm(x, residual, weight, eps):
    """``OpImpl.autograd`` of rms_norm_fwd: ``run(x, residual, weight)``, ``torch.rms_norm`` (after the sum with a
    residual), or None where :func:`_differentiable` says no."""
    if not _differentiable(x, weight, None):
        return None
    normalized = [x.shape[-1]]
    if residual is None:
        return lambda x, residual, weight: torch.rms_norm(x, normalized, weight, eps)

    def run(x, residual, weight):
        h = x + residual
        return torch.rms_norm(h, normalized, weight, eps), h

    return run


def differentiable_layer_norm(x, residual, weight, bias, eps):
    """``OpImpl.autograd`` of layer_norm_fwd: ``run(x, residual, weight, bias)``, ``torch.layer_norm`` (after the sum
    with a residual), or None where :func:`_differentiable` says no."""
    if not _differentiable(x, weight, bias):
        return None
    normalized = [x.shape[-1]]
    if residual is None:
        return lambda x, residual, weight, bias: torch.layer_norm(x, normalized, weight, bias, eps)

    def run(x, residual, weight, bias):
        h = x + residual
        return torch.layer_norm(h, normalized, weight, bias, eps), h

    return run
