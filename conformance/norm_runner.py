"""The runners of the norm families: ``rms_norm`` and ``layer_norm``, forward and every gradient.

Inputs are drawn from the case's seed on the CPU and moved to the backend's device; the call runs forced and
strict (``runner.forced_strict``). Oracles: ``float64``, the definition (``portable_ops/definitions/norms.py``)
in float64 on the inputs as the backend saw them (rounded to the case's dtype), and ``torch``, ``F.rms_norm`` /
``F.layer_norm`` and their autograd in float64, for the reference backend. The residual sum is taken in the
case's dtype by both (the sum of two values of that dtype, rounded once), as the public API defines it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import portable_ops
from portable_ops.definitions.norms import norm_bwd, norm_fwd

from .cases import Case
from .tolerances import GRADIENT_FACTOR

F64 = torch.float64


def norm_inputs(case: Case):
    """``x, residual, weight, bias, dout, dh`` (CPU, float32; None where the case has none): x transposed out of
    its leading dims where the case says, one row holding inf and another NaN for a non-finite case."""
    p = case.params
    gen = torch.Generator().manual_seed(case.seed)
    shape = p["shape"]
    d = shape[-1]
    stored = (shape[1], shape[0], *shape[2:]) if p.get("transposed") else shape
    x = torch.randn(stored, generator=gen) * 2 + 0.5  # a mean LayerNorm must remove, a scale RMSNorm must measure
    if p.get("nonfinite") and x.numel():
        rows = x.view(-1, d)
        rows[0, d // 2] = float("inf")
        rows[min(1, rows.shape[0] - 1), d - 1] = float("nan")
    if p.get("transposed"):
        x = x.transpose(0, 1)
    residual = torch.randn(shape, generator=gen) if p.get("residual") else None
    weight = 1 + 0.5 * torch.randn(d, generator=gen) if p.get("weight") else None
    bias = 0.5 * torch.randn(d, generator=gen) if p.get("bias") else None
    dout = torch.randn(shape, generator=gen)
    dh = torch.randn(shape, generator=gen) if residual is not None else None
    return x, residual, weight, bias, dout, dh


def _run_norm(case: Case, backend: str, device: torch.device, oracles: list[str], result, rms: bool):
    from .runner import _f64, forced_strict  # runner.py imports this module for its RUNNERS

    p, dtype = case.params, case.dtype
    x, residual, weight, bias, dout, dh = norm_inputs(case)
    leaves = {name: t.to(device, dtype).requires_grad_(True) for name, t in
              (("x", x), ("residual", residual), ("weight", weight), ("bias", bias)) if t is not None}
    dout, dh = (None if t is None else t.to(device, dtype) for t in (dout, dh))
    eps = p["eps"]
    with forced_strict(backend):
        if rms:
            got = portable_ops.rms_norm(leaves["x"], leaves.get("weight"), eps, residual=leaves.get("residual"))
        else:
            got = portable_ops.layer_norm(leaves["x"], leaves.get("weight"), leaves.get("bias"), eps,
                                          residual=leaves.get("residual"))
        out, h = got if residual is not None else (got, None)
        outputs, grads_out = ((out, h), (dout, dh)) if h is not None else ((out,), (dout,))
        torch.autograd.backward(outputs, grads_out)
    tol = case.tolerance
    grad_tol = tol.scaled(GRADIENT_FACTOR)
    names = list(leaves)
    x64, *rest = _f64(leaves.values())
    given = dict(zip(names[1:], rest))
    r64, w64, b64 = given.get("residual"), given.get("weight"), given.get("bias")
    d = x.shape[-1]
    # the sum as the API defines it: in the case's dtype, one rounding
    h64 = (x64 + r64).to(dtype).to(F64) if r64 is not None else None
    src = h64 if h64 is not None else x64
    dout64 = dout.to("cpu", F64)
    dh64 = dh.to("cpu", F64) if dh is not None else None
    if h is not None:
        result.check("float64", "h = x + residual", h, h64, *tol)
    for oracle in oracles:
        if oracle == "float64":
            rows = src.reshape(-1, d)
            ref, _, mean, rstd = norm_fwd(rows, None, w64, b64, eps, rms)
            dx, dw, db = norm_bwd(rows, w64, mean, rstd, dout64.reshape(-1, d),
                                  None if dh64 is None else dh64.reshape(-1, d), rms, b64 is not None)
            ref, dx = ref.reshape(x.shape), dx.reshape(x.shape)
        else:
            inputs = [t.clone().requires_grad_(True) for t in (src, w64, b64) if t is not None]
            s, w, b = inputs[0], (inputs[1] if w64 is not None else None), (inputs[-1] if b64 is not None else None)
            ref = F.rms_norm(s, (d,), w, eps) if rms else F.layer_norm(s, (d,), w, b, eps)
            grads = torch.autograd.grad(ref, inputs, dout64) if ref.numel() else [torch.zeros_like(t) for t in inputs]
            dx = grads[0] + (dh64 if dh64 is not None else 0)
            dw, db = (grads[1] if w64 is not None else None), (grads[-1] if b64 is not None else None)
        result.check(oracle, "out", out, ref.detach(), *tol)
        result.check(oracle, "dx", leaves["x"].grad, dx, *grad_tol)
        if "residual" in leaves:
            result.check(oracle, "dresidual", leaves["residual"].grad, dx, *grad_tol)
        if "weight" in leaves:
            result.check(oracle, "dweight", leaves["weight"].grad, dw, *grad_tol)
        if "bias" in leaves:
            result.check(oracle, "dbias", leaves["bias"].grad, db, *grad_tol)


def run_rms_norm(case, backend, device, oracles, result):
    _run_norm(case, backend, device, oracles, result, rms=True)


def run_layer_norm(case, backend, device, oracles, result):
    _run_norm(case, backend, device, oracles, result, rms=False)
