"""The norms' eager memo (portable_ops/norms.py, portable_ops/memo.py): a call whose key was seen is neither checked
nor dispatched again, forward or backward, and gives what the checked path gives (torch's answer, on every backend);
anything the key holds that changes is checked again; a fallback, a failed call and a replaced backend op leave
nothing memoised that would hide them; the triton backend's plans and launches per call; the host bench's norm rows.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import portable_ops
from portable_ops import dispatch, norm_checks, norms
from portable_ops.conformance import GRADIENT_FACTOR, tolerance, usable_backends
from portable_ops.conformance.runner import default_device, forced_strict

BACKENDS = usable_backends()
api = importlib.import_module("portable_ops.attention")
D = 8


@pytest.fixture(autouse=True)
def fresh_memo(monkeypatch):
    """A memo of this test alone, and every backend loaded before the first key is built (the keys hold them)."""
    dispatch.loaded_backends()
    monkeypatch.setattr(norms, "_memo", {})


def _leaves(device, shape=(2, 3, D), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [t.to(device).requires_grad_() for t in (torch.randn(shape, generator=g), torch.randn(shape, generator=g),
                                                    1 + 0.5 * torch.randn(D, generator=g),
                                                    0.5 * torch.randn(D, generator=g))]


def _calls(x, r, w, b, dout):
    """An inference call, then forward and backward of RMSNorm with its residual and of LayerNorm: every output
    and gradient."""
    with torch.no_grad():
        got = [portable_ops.rms_norm(x, w, 1e-6)]
    out, h = portable_ops.rms_norm(x, w, 1e-6, residual=r)
    got += [out, h, *torch.autograd.grad((out, h), (x, r, w), (dout, dout))]
    out = portable_ops.layer_norm(x, w, b)
    return got + [out, *torch.autograd.grad(out, (x, w, b), dout)]


def _torchs(x, r, w, b, dout):
    x, r, w, b = (t.detach().cpu().double().requires_grad_() for t in (x, r, w, b))
    dout = dout.cpu().double()
    want = [F.rms_norm(x, (D,), w, 1e-6)]
    h = x + r
    out = F.rms_norm(h, (D,), w, 1e-6)
    want += [out, h, *torch.autograd.grad((out, h), (x, r, w), (dout, dout))]
    out = F.layer_norm(x, (D,), w, b)
    return want + [out, *torch.autograd.grad(out, (x, w, b), dout)]


def _counting(monkeypatch) -> list:
    """Every check of a norm call and every dispatch from now on, by name."""
    counted = []
    for module, name in ((norm_checks, "check_norm"), (dispatch, "select"), (dispatch, "select_by_layout"),
                         (api, "select_by_layout")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **kw: counted.append(_n) or _f(*a, **kw))
    return counted


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_call_seen_before_is_neither_checked_nor_dispatched_and_gives_torchs_answer(backend, monkeypatch):
    device = default_device(backend)
    x, r, w, b = _leaves(device)
    dout = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(device)
    with forced_strict(backend):
        first = _calls(x, r, w, b, dout)  # memoises each call, and prepares each backward at its first run
        counted = _counting(monkeypatch)
        again = _calls(x, r, w, b, dout)
    assert counted == []
    for a, c in zip(again, first):
        assert a.dtype == c.dtype and a.shape == c.shape and torch.equal(a, c)
    tol = tolerance("rms_norm", torch.float32).scaled(GRADIENT_FACTOR)
    for a, want in zip(again, _torchs(x, r, w, b, dout)):
        torch.testing.assert_close(a.detach().cpu().double(), want, atol=tol.atol, rtol=tol.rtol)


def test_a_call_that_differs_in_anything_the_key_holds_is_checked_again(monkeypatch):
    x, _, w, _ = (t.detach() for t in _leaves("cpu"))
    with torch.no_grad():
        portable_ops.rms_norm(x, w, 1e-6)
    counted = _counting(monkeypatch)
    checks = lambda: counted.count("check_norm")  # noqa: E731
    with torch.no_grad():
        portable_ops.rms_norm(x, w, 1e-6)
        portable_ops.rms_norm(x.clone(), w.clone(), 1e-6)  # other tensors of the same layout
        assert checks() == 0
        misaligned = torch.empty(x.numel() + 1)[1:].view(x.shape).copy_(x)
        changed = [dict(x=x.transpose(0, 1).contiguous().transpose(0, 1)), dict(x=x.double()), dict(x=misaligned),
                   dict(x=x[:, :2]), dict(eps=1e-5), dict(eps=None), dict(eps=0), dict(weight=w.half()),
                   dict(weight=None), dict(weight=w.repeat(2)[::2]), dict(residual=x)]
        for i, change in enumerate(changed, 1):
            portable_ops.rms_norm(**{**dict(x=x, weight=w, eps=1e-6), **change})
            assert checks() == i, change
        with portable_ops.use_backend("reference"):  # the forced backend: the same one, forced
            portable_ops.rms_norm(x, w, 1e-6)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            portable_ops.rms_norm(x, w, 1e-6)
    portable_ops.rms_norm(x, w.requires_grad_(), 1e-6)  # grad mode on, and an input needs grad
    assert checks() == len(changed) + 3
    with pytest.raises(TypeError, match="eps must be a float"):  # True == 1 with one hash, and is refused
        portable_ops.rms_norm(x, w, True)


def test_a_memoised_call_casts_as_the_checked_path_does(monkeypatch):
    """Under an autocast that puts the norms on its float32 list (CUDA's, stood in for on the CPU), and with a
    residual of another dtype (torch's promotion), a call seen before casts its inputs again and its gradients
    reach the leaves in their own dtypes."""
    monkeypatch.setattr(norms, "FP32_UNDER_AUTOCAST", ("cpu",))
    x, r, w, b = (t.detach().bfloat16().requires_grad_() for t in _leaves("cpu"))

    def calls():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cast = portable_ops.layer_norm(x, w, b)
        promoted, h = portable_ops.rms_norm(x.float(), w, residual=r)
        return [cast, *torch.autograd.grad(cast, (x, w, b), torch.ones_like(cast)), promoted, h,
                *torch.autograd.grad(promoted, (r, w), torch.ones_like(promoted))]

    first = calls()
    counted = _counting(monkeypatch)
    again = calls()
    assert counted == []
    assert [t.dtype for t in again] == [torch.float32, *[torch.bfloat16] * 3, torch.float32, torch.float32,
                                        torch.bfloat16, torch.bfloat16]
    for a, c in zip(again, first):
        assert torch.equal(a, c)


def test_a_fallback_is_never_memoised_so_strict_mode_refuses_it_every_time(fake_backend, monkeypatch):
    fake_backend("triton", reasons=["the stand-in declines"], ops=("rms_norm_fwd", "rms_norm_bwd"))
    x, _, w, _ = _leaves("cpu")
    with portable_ops.use_backend("triton"):
        for _ in range(2):
            with pytest.warns(portable_ops.FallbackWarning, match="the stand-in declines"):
                monkeypatch.setattr(dispatch, "_warned", set())
                want = portable_ops.rms_norm(x, w)
            assert norms._memo == {}
        monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")
        for _ in range(2):
            with pytest.raises(portable_ops.BackendUnavailableError, match="the stand-in declines"):
                portable_ops.rms_norm(x, w)
        monkeypatch.delenv("PORTABLE_OPS_STRICT")
        assert torch.equal(portable_ops.rms_norm(x, w), want)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_a_call_that_failed_leaves_nothing_memoised(fake_backend, grad):
    """A kernel that fails once (out of memory, a launch error): the next call of the same key is dispatched and
    prepared afresh, forward and backward, and runs what is installed then."""
    stand_in = fake_backend("triton", ops=("rms_norm_fwd", "rms_norm_bwd"))
    reference = dispatch.get_backend("reference").ops
    x, _, w, _ = (t.requires_grad_(grad) for t in _leaves("cpu"))

    def failing(**call):
        raise RuntimeError("the stand-in's launch failed")

    with portable_ops.use_backend("triton"):
        stand_in.ops["rms_norm_fwd"] = dispatch.OpImpl(run=failing)
        with pytest.raises(RuntimeError, match="launch failed"):
            portable_ops.rms_norm(x, w)
        assert norms._memo == {}
        # its run alone: the backward stays the stand-in's
        stand_in.ops["rms_norm_fwd"] = dispatch.OpImpl(run=reference["rms_norm_fwd"].run)
        out = portable_ops.rms_norm(x, w)
        assert len(norms._memo) == 1
        if grad:
            stand_in.ops["rms_norm_bwd"] = dispatch.OpImpl(run=failing)
            with pytest.raises(RuntimeError, match="launch failed"):
                torch.autograd.grad(out, (x, w), torch.ones_like(out), retain_graph=True)
            stand_in.ops["rms_norm_bwd"] = reference["rms_norm_bwd"]
            got = torch.autograd.grad(out, (x, w), torch.ones_like(out))
            want = torch.autograd.grad(F.rms_norm(x, (D,), w), (x, w), torch.ones_like(out))
            for a, c in zip(got, want):
                torch.testing.assert_close(a, c)
    torch.testing.assert_close(out, F.rms_norm(x, (D,), w))


def test_a_backend_op_replaced_after_a_call_was_memoised_runs_from_then_on(fake_backend):
    stand_in = fake_backend("triton", ops=("layer_norm_fwd", "layer_norm_bwd"))
    x, _, w, b = _leaves("cpu")
    ran = []

    def spied(op):
        run = stand_in.ops[op].run
        return dispatch.OpImpl(run=lambda **call: ran.append(op) or run(**call))

    with portable_ops.use_backend("triton"):
        for _ in range(2):  # the second call is memoised, and its backward prepared
            out = portable_ops.layer_norm(x, w, b)
            torch.autograd.grad(out, (x, w, b), torch.ones_like(out))
        stand_in.ops.update({op: spied(op) for op in ("layer_norm_fwd", "layer_norm_bwd")})
        out = portable_ops.layer_norm(x, w, b)
        torch.autograd.grad(out, (x, w, b), torch.ones_like(out))
    assert ran == ["layer_norm_fwd", "layer_norm_bwd"]


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "nki"])
def test_a_data_swap_between_forward_and_backward_is_read_in_its_new_layout(backend):
    """Model surgery between a memoised call's forward and its backward: x's and the weight's ``.data`` swapped for
    the same values in other strides. The backward reads them as they are now (a backward prepared for the
    forward's strides would read other elements), as torch's does."""
    device = default_device(backend)
    dout = torch.randn(2, 3, D, generator=torch.Generator().manual_seed(1)).to(device)

    def grads(swap):
        x, _, w, _ = _leaves(device)
        out = portable_ops.rms_norm(x, w)
        if swap:
            x.data = torch.empty(2, 3, 2 * D, device=device)[..., :D].copy_(x.data)  # rows 2D apart
            w.data = torch.empty(2 * D, device=device)[::2].copy_(w.data)
        return torch.autograd.grad(out, (x, w), dout), (x, w)

    with forced_strict(backend):
        grads(swap=False)  # memoises the call, and prepares its backward for the forward's layout
        got, (x, w) = grads(swap=True)
    want = torch.autograd.grad(F.rms_norm(x, (D,), w), (x, w), dout)
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c)


triton_norms = importlib.import_module("portable_ops.backends.triton.norms") if "triton" in BACKENDS else None
needs_triton = pytest.mark.skipif("triton" not in BACKENDS, reason="the triton backend can't run here")


@needs_triton
def test_a_memoised_triton_call_launches_once_and_its_backward_once_plus_a_sum_per_parameter(monkeypatch):
    launch = importlib.import_module("portable_ops.backends.triton.launch")
    launches = []
    run = launch.Launch.__call__
    monkeypatch.setattr(launch.Launch, "__call__", lambda self, *args: launches.append(self.kernel) or run(self, *args))
    device = default_device("triton")
    x, _, w, b = _leaves(device)
    with portable_ops.use_backend("triton"):
        for norm, params, sums in ((lambda: portable_ops.rms_norm(x, w), (x, w), 1),
                                   (lambda: portable_ops.layer_norm(x, w, b), (x, w, b), 2)):
            for _ in range(2):  # the second call is memoised
                launches.clear()
                out = norm()
                forward = list(launches)
                torch.autograd.grad(out, params, torch.ones_like(out))
            kernels = [triton_norms._norm_fwd_kernel, triton_norms._norm_bwd_kernel,
                       *[triton_norms._column_sum_kernel] * sums]
            assert [*forward, *launches[len(forward):]] == kernels


@needs_triton
@pytest.mark.parametrize("kernel", ["_norm_fwd_kernel", "_norm_bwd_kernel", "_column_sum_kernel"])
def test_a_triton_norm_launch_that_fails_keeps_no_plan(kernel, monkeypatch):
    class Unlaunchable:
        pre_run_hooks = ()

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("this launch fails")

            return launch

    monkeypatch.setattr(triton_norms, "_plans", {})
    device = default_device("triton")
    x, _, w, _ = (t.detach() for t in _leaves(device, shape=(5, D)))
    ops = dispatch.get_backend("triton").ops

    def run():
        out, _, rstd = ops["rms_norm_fwd"].run(x=x, residual=None, weight=w, eps=1e-6)
        return out, *ops["rms_norm_bwd"].run(x=x, weight=w, rstd=rstd, dout=torch.ones_like(x), dh=None)

    with monkeypatch.context() as patched:
        patched.setattr(triton_norms, kernel, Unlaunchable())
        with pytest.raises(RuntimeError, match="this launch fails"):
            run()
        kept = list(triton_norms._plans.values())  # the forward's, where it launched; never the failed one
        assert [type(plan).__name__ for plan in kept] == ([] if kernel == "_norm_fwd_kernel" else ["_Forward"])
    got = run()
    reference = dispatch.get_backend("reference").ops
    out, _, rstd = reference["rms_norm_fwd"].run(x=x, residual=None, weight=w, eps=1e-6)
    want = (out, *reference["rms_norm_bwd"].run(x=x, weight=w, rstd=rstd, dout=torch.ones_like(x), dh=None))
    for a, c in zip(got, want):
        torch.testing.assert_close(a.float(), c.float())


def test_the_host_bench_times_every_norm_row_and_leaves_the_kernels_plans_and_memo_as_they_were():
    from portable_ops.bench.attention import run_norm_host

    memo = norms._memo
    rows = run_norm_host(calls=2, rounds=1, shape=(2, 3, D))
    variants = {r["variant"] for r in rows}
    assert len(rows) == 3 * 2 * len(variants) and all(r["host us"] > 0 for r in rows)
    assert {(r["op"], r["dir"]) for r in rows} == {(op, d) for op in ("rms_norm", "rms_norm + residual", "layer_norm")
                                                   for d in ("fwd", "fwd+bwd")}
    assert norms._memo is memo
    if triton_norms is not None:
        assert type(triton_norms._norm_fwd_kernel).__name__ != "_NoLaunch"


@pytest.mark.parametrize("rms", [True, False], ids=["rms_norm", "layer_norm"])
def test_eager_calls_with_gradients_run_torchs_differentiable_norm_where_the_backend_has_one(rms):
    """reference's ``OpImpl.autograd``: float32 rows (with and without a residual) go through torch's own norm, whose
    backward torch's autograd runs; bfloat16 on the CPU keeps portable_ops' backward (ATen's sums a bfloat16 weight
    gradient in bfloat16 there). Both give torch's answer."""
    fn = portable_ops.rms_norm if rms else portable_ops.layer_norm
    for dtype, native in ((torch.float32, True), (torch.bfloat16, False)):
        x, r, w, _ = (t.to(dtype).requires_grad_() for t in _leaves("cpu"))
        for residual in (None, r):
            for _ in range(2):  # the first call memoises, the second runs the memoised call
                result = fn(x, w, residual=residual)
            out = result if residual is None else result[0]
            assert ("_EagerNorm" not in type(out.grad_fn).__name__) == native, (dtype, type(out.grad_fn))
            h = x if residual is None else x + residual
            want = F.rms_norm(h, (D,), w) if rms else F.layer_norm(h, (D,), w)
            inputs = (x, w) if residual is None else (x, r, w)
            tol = tolerance("rms_norm" if rms else "layer_norm", dtype).scaled(GRADIENT_FACTOR)
            for got, expected in zip(torch.autograd.grad(out, inputs, torch.ones_like(out)),
                                     torch.autograd.grad(want, inputs, torch.ones_like(want))):
                torch.testing.assert_close(got, expected, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize("rms", [True, False], ids=["rms_norm", "layer_norm"])
def test_an_eager_call_the_memo_does_not_take_runs_torchs_differentiable_norm_too(rms):
    """An eps that is not a Python float (numpy's): no memo key, and still the reference backend's ``OpImpl.autograd``,
    whose backward torch's autograd runs (the triton backend leaves such a call on CUDA to it for that backward)."""
    x, r, w, b = _leaves("cpu")
    eps = np.float32(1e-5)
    out, h = (portable_ops.rms_norm(x, w, eps, residual=r) if rms else
              portable_ops.layer_norm(x, w, b, eps, residual=r))
    assert "_EagerNorm" not in type(out.grad_fn).__name__ and norms._memo == {}
    want = F.rms_norm(x + r, (D,), w, float(eps)) if rms else F.layer_norm(x + r, (D,), w, b, float(eps))
    inputs = (x, r, w) if rms else (x, r, w, b)
    dout = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    for got, expected in zip(torch.autograd.grad((out, h), inputs, (dout, dout)),
                             torch.autograd.grad((want, x + r), inputs, (dout, dout))):
        torch.testing.assert_close(got, expected)


def test_an_eager_call_the_backend_would_leave_to_the_next_is_no_fallback_where_it_cant_take_it_either(fake_backend,
                                                                                                       monkeypatch):
    """The triton backend on CUDA, stood in for on "meta": an eager call it leaves to ATen's norm (``defer_eager``) is
    left there whether or not its kernels take it (float64 here), so nothing warns and strict mode allows it; a call it
    would run but can't (with a residual) is a fallback."""
    stand_in = fake_backend("triton", devices=("meta",), ops=("rms_norm_fwd", "rms_norm_bwd"),
                            reasons=lambda call: ["no float64 kernel"] if call["x"].dtype == torch.float64 else [])
    stand_in.ops["rms_norm_fwd"] = dataclasses.replace(
        stand_in.ops["rms_norm_fwd"], defer_eager=lambda call: ["ATen's norm"] if call["residual"] is None else [])
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")
    x, w = torch.empty(4, D, device="meta", dtype=torch.float64), torch.empty(D, device="meta", dtype=torch.float64)
    choice = portable_ops.explain("rms_norm", x, w)
    assert (choice.backend, choice.is_fallback, choice.rejected["triton"]) == ("reference", False, ["ATen's norm"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for grad in (False, True):
            assert portable_ops.rms_norm(x.requires_grad_(grad), w).shape == x.shape
    with pytest.raises(portable_ops.BackendUnavailableError, match="no float64 kernel"):
        portable_ops.rms_norm(x, w, residual=x)
