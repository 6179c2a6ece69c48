"""What torch accepts, we accept, with torch's results: numpy hyperparameters, every norm_type and an
infinite max_norm, torch's functional signature, complex params. Every backend usable here."""

import copy
import inspect
import math

import numpy as np
import pytest
import torch
from torch.optim.adam import adam as torch_adam

import portable_ops
from portable_ops.conformance.runner import default_device, usable_backends
from conftest import assert_bit_identical, snapshot

BACKENDS = usable_backends()


def grads_for(params, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g, dtype=torch.complex64 if p.is_complex() else torch.float32).to(p.dtype)
            for p in params]


def twin_runs(make_params, torch_opt, our_opt, backend, steps=4, clip=None):
    """The same grads into torch's optimizer (after torch's clip, if ``clip``) and into ours; returns both params."""
    theirs = make_params()
    ours = [torch.nn.Parameter(p.detach().clone().to(default_device(backend))) for p in theirs]
    opt_t, opt_o = torch_opt(theirs), our_opt(ours)
    for step in range(steps):
        for t, o, g in zip(theirs, ours, grads_for(theirs, step)):
            t.grad, o.grad = g.clone(), g.clone().to(o.device)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(theirs, clip)
        opt_t.step()
        with portable_ops.use_backend(backend):
            opt_o.step()
    return theirs, ours, opt_t, opt_o


def assert_params_close(theirs, ours, **tol):
    for t, o in zip(theirs, ours):
        torch.testing.assert_close(o.detach().cpu(), t.detach(), **(tol or dict(rtol=1e-5, atol=1e-6)))


def real_params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((4, 5), (7,), (1,))]


# ----------------------------------------------------------------------------- numpy scalars

NUMPY_HYPER = {
    "float32": dict(lr=np.float32(1e-2), betas=(np.float32(0.9), np.float32(0.99)), eps=np.float32(1e-8),
                    weight_decay=np.float32(0.1)),
    "float64": dict(lr=np.float64(1e-2), betas=(np.float64(0.9), np.float64(0.99)), eps=np.float64(1e-8),
                    weight_decay=np.float64(0.1)),
    "0-d arrays and an array of betas": dict(lr=np.array(1e-2), betas=np.array([0.9, 0.99]), eps=np.array(1e-8),
                                             weight_decay=np.array(0.1)),
}


@pytest.mark.parametrize("kind", NUMPY_HYPER)
@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_hyperparameters_step_as_their_float_values(backend, kind):
    """torch takes numpy scalars (its step does arithmetic with them); our checks refused np.float32."""
    as_float = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    theirs, ours, *_ = twin_runs(real_params, lambda ps: portable_ops.optim.AdamW(ps, **as_float),
                                 lambda ps: portable_ops.optim.AdamW(ps, max_grad_norm=np.float32(0.5),
                                                                     **NUMPY_HYPER[kind]),
                                 backend, clip=0.5)
    assert_params_close(theirs, ours)


@pytest.mark.parametrize("returns", [np.float32, np.float64])
def test_a_lambda_lr_returning_numpy_floats_matches_torch(returns):
    schedule = lambda step: returns(0.5 ** step)  # noqa: E731
    start = real_params()
    runs = []
    for cls in (torch.optim.Adam, portable_ops.optim.Adam):
        params = [torch.nn.Parameter(p.detach().clone()) for p in start]
        opt = cls(params, lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        for step in range(4):
            for p, g in zip(params, grads_for(params, step)):
                p.grad = g
            opt.step()
            sched.step()
        assert isinstance(opt.param_groups[0]["lr"], np.floating)  # what the schedule handed the step
        runs.append(params)
    assert_params_close(*runs)


def test_functional_adam_takes_numpy_scalars():
    lists = [[torch.randn(3)] for _ in range(5)]
    steps = [torch.tensor(0.0)]
    portable_ops.functional.adam(*lists, steps, amsgrad=True, beta1=np.float32(0.9), beta2=np.float64(0.99),
                                 lr=np.float32(1e-3), weight_decay=np.array(0.1), eps=np.float32(1e-8))
    assert steps[0].item() == 1.0


def test_numpy_values_are_still_checked():
    p = [torch.nn.Parameter(torch.zeros(2))]
    for kw, error, message in [(dict(lr=np.float32("nan")), ValueError, "lr must be finite"),
                               (dict(betas=(np.float32(0.9), np.float32(1.0))), ValueError, r"betas\[1\] must be < 1"),
                               (dict(lr=np.array([1e-3])), TypeError, "lr must be a number, got ndarray"),
                               (dict(eps=np.bool_(True)), TypeError, "eps must be a number"),
                               (dict(max_grad_norm=np.float32(-1.0)), ValueError, "max_grad_norm must be >= 0")]:
        with pytest.raises(error, match=message):
            portable_ops.optim.AdamW(p, **kw)


# ----------------------------------------------------------------------------- max_grad_norm

def test_max_grad_norm_is_read_from_every_group_at_each_step():
    """Only group 0's value was read after construction: a different one set later silently changed nothing."""
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(4))
    opt = portable_ops.optim.AdamW([{"params": [a]}, {"params": [b]}], max_grad_norm=1.0)
    a.grad, b.grad = torch.randn(3), torch.randn(4)
    opt.step()
    before, state = snapshot([a, b]), copy.deepcopy(opt.state_dict())
    opt.param_groups[1]["max_grad_norm"] = 0.5
    with pytest.raises(ValueError, match=r"max_grad_norm must be the same in every param group .*"
                                         r"param_groups\[1\] has 0.5, param_groups\[0\] has 1.0"):
        opt.step()
    assert_bit_identical(before, snapshot([a, b]))
    for i, s in opt.state_dict()["state"].items():
        assert all(torch.equal(v, state["state"][i][k]) for k, v in s.items())
    opt.param_groups[1]["max_grad_norm"] = float("nan")
    with pytest.raises(ValueError, match="max_grad_norm must be a number or inf, not NaN"):
        opt.step()
    for group in opt.param_groups:  # changed together: the new value is the clip
        group["max_grad_norm"] = np.float32(1e-3)
    opt.step()
    assert opt.last_grad_norm > 1e-3


def test_an_infinite_max_grad_norm_measures_without_clipping():
    theirs, ours, _, opt = twin_runs(real_params, lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                                     lambda ps: portable_ops.optim.AdamW(ps, lr=1e-2, max_grad_norm=math.inf),
                                     "reference")
    assert_params_close(theirs, ours)
    expected = torch.nn.utils.get_total_norm([p.grad for p in theirs])
    torch.testing.assert_close(opt.last_grad_norm, expected)


# ----------------------------------------------------------------------------- clip_grad_norm_

def grads_with_a_zero_tensor(dtype=torch.float32, device="cpu"):
    """Params whose grads include an all-zero tensor and a zero element (0-norms count them, negative
    norms vanish on them)."""
    g = torch.Generator().manual_seed(1)
    values = [torch.randn(5, 3, generator=g), torch.zeros(4), torch.randn(9, generator=g) * 3,
              torch.randn(1, generator=g)]
    values[0][1, 2] = 0.0
    if dtype.is_complex:  # zero stays zero: torch's 0-norm of a complex tensor drops its imaginary part
        values = [torch.complex(v, torch.randn(v.shape, generator=g) * (v != 0)) for v in values]
    params = [torch.nn.Parameter(torch.zeros(v.shape, dtype=dtype, device=device)) for v in values]
    for p, v in zip(params, values):
        p.grad = v.to(device, dtype)
    return params


NORM_TYPES = [2.0, 1.0, 0.5, 3, math.inf, "inf", 0, 0.0, -1.0, -math.inf, np.float32(2.0), np.float64(math.inf)]


@pytest.mark.parametrize("max_norm", [0.7, math.inf, np.float32(0.7)])
@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=repr)
@pytest.mark.parametrize("backend", BACKENDS)
def test_clip_takes_every_norm_type_and_max_norm_torch_takes(backend, norm_type, max_norm):
    """norm_type 0 (a count), negative and -inf, and max_norm=inf (measure only) were refused. Backends
    without a kernel for a norm_type decline it with a reason and the reference runs it."""
    theirs, ours = grads_with_a_zero_tensor(), grads_with_a_zero_tensor(device=default_device(backend))
    expected = torch.nn.utils.clip_grad_norm_(theirs, float(max_norm), norm_type)
    with portable_ops.use_backend(backend):
        got = portable_ops.clip_grad_norm_(ours, max_norm, norm_type)
    torch.testing.assert_close(got.cpu(), expected)
    assert_params_close([p.grad for p in theirs], [p.grad for p in ours])


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])  # the reference takes every one
def test_a_norm_type_a_backend_lacks_falls_back_with_its_reason(backend, monkeypatch):
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")
    with portable_ops.use_backend(backend), pytest.raises(portable_ops.BackendUnavailableError, match="norm_type"):
        portable_ops.clip_grad_norm_(grads_with_a_zero_tensor(device=default_device(backend)), 1.0, -math.inf)


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0, 0, -math.inf])
@pytest.mark.parametrize("backend", BACKENDS)
def test_complex_grads_are_measured_by_their_magnitudes(backend, norm_type):
    theirs = grads_with_a_zero_tensor(torch.complex64)
    ours = grads_with_a_zero_tensor(torch.complex64, default_device(backend))
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type)
    with portable_ops.use_backend(backend):
        got = portable_ops.clip_grad_norm_(ours, 0.5, norm_type)
    torch.testing.assert_close(got.cpu(), expected)
    assert_params_close([p.grad for p in theirs], [p.grad for p in ours])


# ----------------------------------------------------------------------------- complex params

def complex_params(dtype=torch.complex64):
    g = torch.Generator().manual_seed(2)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=g, dtype=dtype)),
            torch.nn.Parameter(torch.randn(6, generator=g, dtype=dtype.to_real())),
            torch.nn.Parameter(torch.randn(1, generator=g, dtype=dtype))]


@pytest.mark.parametrize("config", [dict(), dict(amsgrad=True, maximize=True), dict(weight_decay=0.1)], ids=str)
@pytest.mark.parametrize("cls", ["Adam", "AdamW"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_complex_params_step_as_torchs(backend, cls, config):
    """torch steps a complex param as (real, imaginary) pairs; ours refused it. The state keeps torch's
    layout (complex moments), so checkpoints move both ways."""
    torch_cls, our_cls = getattr(torch.optim, cls), getattr(portable_ops.optim, cls)
    theirs, ours, opt_t, opt_o = twin_runs(complex_params, lambda ps: torch_cls(ps, lr=1e-2, **config),
                                           lambda ps: our_cls(ps, lr=1e-2, **config), backend)
    assert_params_close(theirs, ours)
    assert opt_o.state[ours[0]]["exp_avg"].dtype == torch.complex64
    loaded = torch_cls([torch.nn.Parameter(p.detach().clone().cpu()) for p in ours], lr=1e-2, **config)
    loaded.load_state_dict(copy.deepcopy(opt_o.state_dict()))
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(loaded.state[loaded.param_groups[0]["params"][0]][key],
                                   opt_t.state[theirs[0]][key])


@pytest.mark.parametrize("backend", BACKENDS)
def test_complex_params_with_the_fused_clip_match_torchs_clip_then_step(backend):
    theirs, ours, *_ = twin_runs(complex_params, lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                                 lambda ps: portable_ops.optim.AdamW(ps, lr=1e-2, max_grad_norm=0.3), backend,
                                 clip=0.3)
    assert_params_close(theirs, ours)


def test_complex_params_with_float32_state():
    params = complex_params(torch.complex32)[::2]  # complex32 holds float16 pairs
    opt = portable_ops.optim.Adam(params, state_dtype=torch.float32)
    for p, g in zip(params, grads_for(params, 0)):
        p.grad = g
    opt.step()
    assert {opt.state[p]["exp_avg_sq"].dtype for p in params} == {torch.complex64}


def test_a_complex_param_with_a_real_grad_is_refused_by_name():
    lists = [[torch.randn(3, dtype=torch.complex64)] for _ in range(5)]
    lists[1] = [torch.randn(3)]
    with pytest.raises(TypeError, match=r"grads\[0\] has dtype torch.float32 but params\[0\] has torch.complex64"):
        portable_ops.functional.adam(*lists, [torch.tensor(0.0)], amsgrad=True)


# ----------------------------------------------------------------------------- functional.adam's signature

def test_functional_adam_takes_torchs_signature():
    """Every parameter of the installed torch's ``torch.optim.adam.adam`` (2.11 and 2.13 share it), at the
    same position or keyword-only as there; ours beyond it are keyword-only."""
    theirs = list(inspect.signature(torch_adam).parameters.values())
    ours = list(inspect.signature(portable_ops.functional.adam).parameters.values())
    positional = [p.name for p in theirs if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in ours if p.kind is p.POSITIONAL_OR_KEYWORD] == positional
    keyword = {p.name for p in ours if p.kind is p.KEYWORD_ONLY}
    assert {p.name for p in theirs if p.kind is p.KEYWORD_ONLY} <= keyword
    assert {"clip_coef", "state_dtype"} <= keyword


def adam_lists(dtype, amsgrad, seed=4):
    """params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs (empty without AMSGrad, as torch's fused step
    wants) and state_steps of two tensors, the moments in range."""
    g = torch.Generator().manual_seed(seed)
    make = lambda: [torch.randn(s, generator=g, dtype=dtype) for s in ((5,), (2, 3))]  # noqa: E731
    nonnegative = lambda t: torch.view_as_complex(torch.view_as_real(t).abs()) if t.is_complex() else t.abs()  # noqa: E731
    exp_avg_sqs = [nonnegative(t) * 0.1 for t in make()]
    return [make(), make(), [t * 0.1 for t in make()], exp_avg_sqs, [t * 1.5 for t in exp_avg_sqs] if amsgrad else [],
            [torch.tensor(3.0), torch.tensor(3.0)]]


# foreach, capturable, differentiable, fused, grad_scale, found_inf, has_complex, decoupled_weight_decay
POSITIONAL = {
    "fused, grad_scale, found_inf": (torch.float32, (None, False, False, True, torch.tensor(4.0), torch.tensor(0.0),
                                                     False, True)),
    "foreach, complex": (torch.complex64, (True, False, False, None, None, None, True, True)),
}


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("call", POSITIONAL)
def test_functional_adam_called_as_torch_is_steps_as_torch(call, amsgrad):
    dtype, args = POSITIONAL[call]
    theirs, ours = adam_lists(dtype, amsgrad), adam_lists(dtype, amsgrad)
    kw = dict(amsgrad=amsgrad, beta1=0.9, beta2=0.99, lr=1e-2, weight_decay=0.1, eps=1e-8, maximize=False)
    torch_adam(*theirs, *args, **kw)
    portable_ops.functional.adam(*ours, *args, **kw)
    del theirs[1], ours[1]  # torch's fused step unscales the grads in place; ours reads them scaled
    for ts, os_ in zip(theirs, ours):
        for t, o in zip(ts, os_):
            torch.testing.assert_close(o, t, rtol=1e-5, atol=1e-6)


def test_functional_adam_refuses_differentiable():
    lists = [[torch.randn(3)] for _ in range(5)]
    before = snapshot([t for ts in lists for t in ts])
    with pytest.raises(ValueError, match="differentiable=True is not supported"):
        portable_ops.functional.adam(*lists, [torch.tensor(0.0)], differentiable=True)
    assert_bit_identical(before, snapshot([t for ts in lists for t in ts]))


def test_an_infinite_max_grad_norm_leaves_the_grads_of_an_overflowed_norm_unclipped():
    """An infinite max_grad_norm never clips (docs/api.md), even where the norm itself overflows: its coefficient
    was inf / inf = NaN, which made every param NaN, those with finite grads too."""
    theirs, ours = (torch.nn.Parameter(torch.linspace(-1, 1, 4)) for _ in range(2))
    for p in (theirs, ours):
        p.grad = torch.full((4,), 1e30)  # finite, but their squares' sum overflows float32
    torch.optim.AdamW([theirs], lr=1e-2).step()
    opt = portable_ops.optim.AdamW([ours], lr=1e-2, max_grad_norm=math.inf)
    with portable_ops.use_backend("reference"):
        opt.step()
    assert opt.last_grad_norm == math.inf
    torch.testing.assert_close(ours, theirs)
