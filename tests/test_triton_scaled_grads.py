"""The triton backend's optimizer steps write their scaled grads back (docs/adding-a-backend.md, rows ``adam`` and
``sgd``): with ``grad_scale`` or ``clip_coef`` set, each grad becomes ``grad / grad_scale * clip_coef``, rounded once
to its dtype, before ``maximize``'s negation and weight decay, as torch's fused kernels unscale theirs in place.
A non-zero ``found_inf``, or a step with neither, leaves the grads bit for bit. The kernel entry points are called
directly: on a machine without CUDA they run in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_bit_identical, snapshot

from portable_ops import dispatch

pytestmark = pytest.mark.skipif(dispatch.unavailable_reason("triton") is not None, reason="triton not installed")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# a full block, a masked tail and a tensor smaller than a block (the interpreter's block is 1024 elements)
SIZES = (1030, 3)
DTYPES = [torch.float32, torch.bfloat16]
# a power of two, as GradScaler's: its reciprocal is exact, so torch's division and the kernel's product agree
GRAD_SCALE = 1024.0
CLIP_COEF = 0.3  # not a power of two: the product rounds

ADAM = {
    "adamw": dict(amsgrad=False, maximize=False, weight_decay=0.1, decoupled_weight_decay=True),
    "amsgrad_maximize_l2": dict(amsgrad=True, maximize=True, weight_decay=0.1, decoupled_weight_decay=False),
}
SGD = {
    "no_momentum": dict(momentum=0.0, dampening=0.0, nesterov=False, maximize=False, first=False),
    "momentum_new_buffers": dict(momentum=0.9, dampening=0.1, nesterov=False, maximize=False, first=True),
    "nesterov_maximize": dict(momentum=0.9, dampening=0.0, nesterov=True, maximize=True, first=False),
}
CASES = [("adam", name) for name in ADAM] + [("sgd", name) for name in SGD]
# the variants with every option that touches the grad (maximize, L2 decay; AMSGrad, Nesterov)
FULLEST = [("adam", "amsgrad_maximize_l2"), ("sgd", "nesterov_maximize")]


def _tensors(dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * scale).to(DEVICE, dtype) for n in SIZES]


def _device_scalar(value):
    return None if value is None else torch.tensor(value, device=DEVICE)


def _call(op, variant, dtype, grad_scale=None, found_inf=None, clip_coef=None):
    """The backend's ``run(**call)`` arguments: params, grads as a GradScaler leaves them (scaled), state."""
    call = dict(params=_tensors(dtype, 0), grads=_tensors(dtype, 1, scale=GRAD_SCALE), lr=0.1,
                grad_scale=_device_scalar(grad_scale), found_inf=_device_scalar(found_inf),
                clip_coef=_device_scalar(clip_coef))
    if op == "adam":
        options = ADAM[variant]
        second_moments = [t.abs() for t in _tensors(dtype, 3)]
        maxes = [t.abs() for t in _tensors(dtype, 4)] if options["amsgrad"] else []
        steps = [torch.full((), 2.0, device=DEVICE) for _ in SIZES]
        return dict(call, **options, exp_avgs=_tensors(dtype, 2), exp_avg_sqs=second_moments, max_exp_avg_sqs=maxes,
                    state_steps=steps, beta1=0.9, beta2=0.999, eps=1e-8)
    options = dict(SGD[variant])
    first = options.pop("first")
    buffers = _tensors(dtype, 2) if options["momentum"] else []
    first_steps = (first,) * len(SIZES) if options["momentum"] else ()
    return dict(call, **options, momentum_buffers=buffers, first_steps=first_steps, weight_decay=0.1)


def _run(op, call):
    backend = dispatch.get_backend("triton")
    assert backend.reasons(op, call) == []
    backend.ops[op].run(**call)


def _every_tensor(op, call):
    keys = ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps") if op == "adam" else (
        "params", "grads", "momentum_buffers")
    return [t for key in keys for t in call[key]]


def _assert_rounded_once(got, exact):
    """``got`` is ``exact`` (float64) rounded to nearest in ``got``'s dtype, give or take the float32 product's own
    rounding: as near to it as the nearest value of that dtype is. Rounding twice misses that by up to a unit."""
    error = (got.double().cpu() - exact).abs()
    nearest = (exact.to(got.dtype).double() - exact).abs()
    worse = error > nearest + exact.abs() * 2.0**-23
    if worse.any():
        i = int(worse.nonzero()[0])
        pytest.fail(f"{int(worse.sum())} of {got.numel()} grads not rounded once to nearest, e.g. "
                    f"{got[i].item()!r} for {exact[i].item()!r}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op, variant", CASES)
def test_a_scaled_step_writes_grad_over_grad_scale_times_clip_coef_rounded_once(op, variant, dtype):
    call = _call(op, variant, dtype, grad_scale=GRAD_SCALE, found_inf=0.0, clip_coef=CLIP_COEF)
    clip = call["clip_coef"].double().cpu()  # float32's value of 0.3, as the kernel reads it
    exact = [g.double().cpu() / GRAD_SCALE * clip for g in call["grads"]]
    params, versions = snapshot(call["params"]), [g._version for g in call["grads"]]
    _run(op, call)
    for got, want in zip(call["grads"], exact):
        _assert_rounded_once(got, want)
    assert all(g._version > v for g, v in zip(call["grads"], versions)), "a written grad kept its version"
    assert not any(map(torch.equal, params, call["params"])), "the step did not move the params"


def _torch_fused_step(op, call):
    """torch's fused CPU kernel over CPU copies of ``call``'s tensors; returns its grads."""
    copy = {k: [t.cpu().clone() for t in v] if isinstance(v, list) else v for k, v in call.items()}
    scaling = dict(grad_scale=call["grad_scale"].cpu(), found_inf=call["found_inf"].cpu())
    if op == "adam":
        fused = torch._fused_adamw_ if call["decoupled_weight_decay"] else torch._fused_adam_
        fused(copy["params"], copy["grads"], copy["exp_avgs"], copy["exp_avg_sqs"], copy["max_exp_avg_sqs"],
              copy["state_steps"], amsgrad=call["amsgrad"], lr=call["lr"], beta1=call["beta1"], beta2=call["beta2"],
              weight_decay=call["weight_decay"], eps=call["eps"], maximize=call["maximize"], **scaling)
    else:
        torch._fused_sgd_(copy["params"], copy["grads"], copy["momentum_buffers"], weight_decay=call["weight_decay"],
                          momentum=call["momentum"], lr=call["lr"], dampening=call["dampening"],
                          nesterov=call["nesterov"], maximize=call["maximize"], is_first_step=False, **scaling)
    return copy["grads"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op, variant", FULLEST)
def test_a_grad_scale_alone_unscales_the_grads_as_torchs_fused_kernel(op, variant, dtype):
    call = _call(op, variant, dtype, grad_scale=GRAD_SCALE, found_inf=0.0)
    theirs = _torch_fused_step(op, call)
    _run(op, call)
    assert_bit_identical(theirs, [g.cpu() for g in call["grads"]])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op, variant", FULLEST)
def test_a_non_zero_found_inf_leaves_every_tensor_grads_included_bit_identical(op, variant, dtype):
    call = _call(op, variant, dtype, grad_scale=GRAD_SCALE, found_inf=1.0, clip_coef=CLIP_COEF)
    before = snapshot(_every_tensor(op, call))
    _run(op, call)
    assert_bit_identical(before, _every_tensor(op, call))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op, variant", FULLEST)
def test_a_step_without_grad_scale_or_clip_coef_only_reads_the_grads(op, variant, dtype):
    call = _call(op, variant, dtype)
    grads, params, versions = snapshot(call["grads"]), snapshot(call["params"]), [g._version for g in call["grads"]]
    _run(op, call)
    assert_bit_identical(grads, call["grads"])
    assert [g._version for g in call["grads"]] == versions
    assert not any(map(torch.equal, params, call["params"])), "the step did not move the params"
