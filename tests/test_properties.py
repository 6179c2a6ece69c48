"""Property-based tests: hypothesis draws the cases, the conformance runner checks them; below, the
classes of misuse and edge values the adversarial review found (params replaced between steps,
non-finite grads anywhere, numpy hyperparameters), each checked against its own model.

Every backend usable on CPU tensors here runs them (reference natively, triton in the Triton
interpreter, nki in the NKI emulator), with fewer examples where the backend is slow on a CPU.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import portable_ops
from portable_ops.conformance import Case, run_case, usable_backends
from portable_ops.conformance.runner import default_device

CPU_BACKENDS = [b for b in usable_backends() if default_device(b).type == "cpu"]
EXAMPLES = {"reference": 40, "triton": 8, "nki": 8}
DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])
SHAPES = st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple), min_size=0, max_size=6)


def examples(backend):
    return settings(max_examples=EXAMPLES.get(backend, 8), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


adam_params = st.fixed_dictionaries({
    "shapes": SHAPES,
    "steps": st.integers(1, 3),
    "lr": st.floats(0.0, 0.1),
    "betas": st.tuples(st.floats(0.0, 0.999), st.floats(0.0, 0.9999)),
    "eps": st.floats(1e-10, 1e-3),
    "weight_decay": st.floats(0.0, 0.2),
    "decoupled": st.booleans(),
    "amsgrad": st.booleans(),
    "maximize": st.booleans(),
    "lr_tensor": st.booleans(),
}, optional={
    "grad_scale": st.sampled_from([2.0, 1024.0]),
    "clip_coef": st.floats(0.01, 1.0),
    "found_inf_steps": st.sets(st.integers(0, 2)).map(tuple),
})

def _valid_nesterov(p):
    """Nesterov as torch takes it: with momentum and no dampening."""
    if p["nesterov"]:
        return {**p, "momentum": max(p["momentum"], 0.1), "dampening": 0.0}
    return p


sgd_params = st.fixed_dictionaries({
    "shapes": SHAPES,
    "steps": st.integers(1, 3),
    "lr": st.floats(0.0, 0.2),
    "momentum": st.one_of(st.just(0.0), st.floats(0.0, 0.99)),
    "dampening": st.floats(0.0, 1.0),
    "weight_decay": st.floats(0.0, 0.2),
    "nesterov": st.booleans(),
    "maximize": st.booleans(),
    "lr_tensor": st.booleans(),
}, optional={
    "grad_scale": st.sampled_from([2.0, 1024.0]),
    "clip_coef": st.floats(0.01, 1.0),
    "found_inf_steps": st.sets(st.integers(0, 2)).map(tuple),
}).map(_valid_nesterov)

attention_params = st.fixed_dictionaries({
    "B": st.integers(1, 2), "Hkv": st.integers(1, 2), "groups": st.integers(1, 3),
    "Sq": st.integers(1, 70), "Skv": st.integers(1, 70), "D": st.sampled_from([32, 64]), "causal": st.booleans(),
}).map(lambda p: {**{k: v for k, v in p.items() if k != "groups"}, "Hq": p["Hkv"] * p["groups"]})

clip_params = st.fixed_dictionaries({
    "shapes": SHAPES, "max_norm": st.floats(1e-3, 10.0), "norm_type": st.sampled_from([2.0, math.inf]),
})


def check(backend, case):
    row = run_case(case, backend)
    if row.status == "fallback":
        pytest.skip(f"FALLBACK (not a pass): {row.detail}")
    assert row.status == "pass", f"{case.params}: {row.detail}"


STRATEGIES = {
    "adam": (adam_params, DTYPES),
    "sgd": (sgd_params, DTYPES),
    "clip_grad_norm_": (clip_params, DTYPES),
    "attention": (attention_params, st.sampled_from([torch.float32, torch.float16])),
}


@pytest.mark.parametrize("op", STRATEGIES)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_any_valid_input(backend, op):
    params_strategy, dtypes = STRATEGIES[op]

    @examples(backend)
    @given(params=params_strategy, dtype=dtypes)
    def prop(params, dtype):
        check(backend, Case(f"property_{op}", op, dtype, params))

    prop()


def test_a_failing_group_leaves_no_group_half_updated(monkeypatch):
    """Checks run before any write; a kernel that fails mid-step (out of memory, say) leaves each
    group either fully stepped or untouched, never partly, and the untouched groups without the state
    the step made for them."""
    from portable_ops import dispatch

    backend = dispatch.get_backend("reference")
    real = backend.ops["adam"].run
    calls = []

    def fails_on_second_group(**call):
        calls.append(call)
        if len(calls) == 2:
            raise RuntimeError("simulated device failure")
        real(**call)

    monkeypatch.setitem(backend.ops, "adam", dispatch.OpImpl(run=fails_on_second_group))
    first = [torch.nn.Parameter(torch.randn(5)) for _ in range(3)]
    second = [torch.nn.Parameter(torch.randn(7)) for _ in range(2)]
    opt = portable_ops.optim.AdamW([{"params": first}, {"params": second}])
    for p in first + second:
        p.grad = torch.randn_like(p)
    before = [p.detach().clone() for p in first + second]
    with pytest.raises(RuntimeError, match="simulated device failure"):
        opt.step()
    stepped = [not torch.equal(p, b) for p, b in zip(first + second, before)]
    assert stepped == [True, True, True, False, False]
    assert [float(opt.state[p]["step"]) for p in first] == [1.0, 1.0, 1.0]
    assert not any(p in opt.state for p in second)  # as torch keeps no state for a param never stepped
    monkeypatch.setitem(backend.ops, "adam", dispatch.OpImpl(run=real))
    opt.step()  # the failed group's first step, from fresh state
    assert [float(opt.state[p]["step"]) for p in first + second] == [2.0, 2.0, 2.0, 1.0, 1.0]


def test_a_failing_sgd_group_leaves_no_buffer_uninitialised(monkeypatch):
    """As for Adam; and SGD's buffers, made uninitialised for the step to fill, are unmade for the groups whose
    launch failed or never ran: the next step makes them from its grad, as a first step does."""
    from portable_ops import dispatch

    backend = dispatch.get_backend("reference")
    real = backend.ops["sgd"].run
    calls = []

    def fails_on_second_group(**call):
        calls.append(call)
        if len(calls) == 2:
            raise RuntimeError("simulated device failure")
        real(**call)

    monkeypatch.setitem(backend.ops, "sgd", dispatch.OpImpl(run=fails_on_second_group))
    first = [torch.nn.Parameter(torch.randn(5)) for _ in range(3)]
    second = [torch.nn.Parameter(torch.randn(7)) for _ in range(2)]
    opt = portable_ops.optim.SGD([{"params": first}, {"params": second}], lr=0.1, momentum=0.9)
    for p in first + second:
        p.grad = torch.randn_like(p)
    before = [p.detach().clone() for p in first + second]
    with pytest.raises(RuntimeError, match="simulated device failure"):
        opt.step()
    stepped = [not torch.equal(p, b) for p, b in zip(first + second, before)]
    assert stepped == [True, True, True, False, False]
    assert ["momentum_buffer" in opt.state.get(p, {}) for p in first + second] == [True, True, True, False, False]
    assert len(opt.state_dict()["state"]) == 3
    monkeypatch.setitem(backend.ops, "sgd", dispatch.OpImpl(run=real))
    for p in second:
        p.grad = torch.full_like(p, 2.0)
    opt.step()
    for p in second:  # made from this step's grad, as on a first step
        assert torch.equal(opt.state[p]["momentum_buffer"], torch.full_like(p, 2.0))


# ----------------------------------------------------------------------------- classes of misuse and edge values

import copy  # noqa: E402

import numpy as np  # noqa: E402

from portable_ops import checks  # noqa: E402

MISUSE_EXAMPLES = {"reference": 40, "triton": 8, "nki": 8}


def misuse_examples(backend):
    return settings(max_examples=MISUSE_EXAMPLES.get(backend, 4), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


SIZES = st.lists(st.integers(1, 1500), min_size=1, max_size=4)
REPLACEMENT = st.fixed_dictionaries({
    "which": st.integers(0, 3),  # modulo the number of params
    "size": st.one_of(st.none(), st.integers(1, 3000)),  # None: keep the size
    "dtype": st.one_of(st.none(), DTYPES),  # None: keep the dtype
})


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_params_replaced_between_steps_rebuild_or_refuse_never_reach_a_kernel(backend, checked_kernels, monkeypatch):
    """Between steps a param's ``.data`` is replaced by one of another size and/or dtype. A size the state
    lacks is refused by name with everything left as it was; a dtype change casts the moments and steps as
    an optimizer loading the same state afresh would. A stale list reaching a kernel fails the guard."""
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")

    @misuse_examples(backend)
    @given(sizes=SIZES, dtype=DTYPES, state_dtype=st.sampled_from([None, torch.float32]),
           amsgrad=st.booleans(), replacements=st.lists(REPLACEMENT, min_size=1, max_size=3))
    def prop(sizes, dtype, state_dtype, amsgrad, replacements):
        g = torch.Generator().manual_seed(len(sizes))
        params = [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in sizes]
        opt = portable_ops.optim.AdamW(params, lr=1e-2, amsgrad=amsgrad, state_dtype=state_dtype)

        def set_grads():
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(p.dtype)

        set_grads()
        with portable_ops.use_backend(backend):
            opt.step()
        for change in replacements:
            p = params[change["which"] % len(params)]
            state_size = opt.state[p]["exp_avg"].numel() if opt.state.get(p) else None  # None: made on the step
            p.data = torch.randn(change["size"] or p.numel(), generator=g).to(change["dtype"] or p.dtype)
            set_grads()
            before = [t.detach().clone() for t in params], copy.deepcopy(opt.state_dict())
            if state_size not in (None, p.numel()):
                with portable_ops.use_backend(backend), pytest.raises(ValueError, match=r'\["exp_avg"\] has shape'):
                    opt.step()
                assert all(torch.equal(a, b) for a, b in zip(params, before[0]))
                del opt.state[p]  # the user's way out: fresh state for the resized param
                continue
            twins = [torch.nn.Parameter(t.detach().clone()) for t in params]
            for t, q in zip(twins, params):
                t.grad = q.grad.clone()
            fresh = portable_ops.optim.AdamW(twins, lr=1e-2, amsgrad=amsgrad, state_dtype=state_dtype)
            fresh.load_state_dict(before[1])
            with portable_ops.use_backend(backend):
                opt.step()
                fresh.step()
            for q, t in zip(params, twins):
                assert opt.state[q]["exp_avg"].dtype == checks.state_dtype_for(q.dtype, state_dtype)
                assert torch.equal(q, t)
                assert torch.equal(opt.state[q]["exp_avg_sq"], fresh.state[t]["exp_avg_sq"])

    prop()


NONFINITE = st.lists(st.tuples(st.integers(0, 10 ** 6), st.sampled_from([math.nan, math.inf, -math.inf])),
                     min_size=1, max_size=3)


def planted(sizes, dtype, values, device, seed=0):
    """Params whose grads hold ``values`` at positions drawn modulo the total size."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype, device=device)) for n in sizes]
    flat = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    total = sum(sizes)
    for where, value in values:
        where %= total
        for t in flat:
            if where < t.numel():
                t[where] = value
                break
            where -= t.numel()
    for p, t in zip(params, flat):
        p.grad = t.to(device)
    return params


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_non_finite_grads_anywhere_give_torchs_non_finite_norm(backend, monkeypatch):
    """NaN/inf at random positions (chunk starts, block tails, later tensors): the 2- and inf-norm, the clip
    and the fused ``max_grad_norm`` all see them as torch does (Triton's max used to drop a NaN)."""
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")

    @misuse_examples(backend)
    @given(sizes=SIZES, dtype=DTYPES, values=NONFINITE, norm_type=st.sampled_from([2.0, math.inf]))
    def prop(sizes, dtype, values, norm_type):
        device = default_device(backend)
        expected = torch.nn.utils.get_total_norm([p.grad.double() for p in planted(sizes, dtype, values, "cpu")],
                                                 norm_type)
        assert not expected.isfinite()
        with portable_ops.use_backend(backend):
            norm = portable_ops.clip_grad_norm_(planted(sizes, dtype, values, device), 1.0, norm_type)
            with pytest.raises(RuntimeError, match="non-finite"):
                portable_ops.clip_grad_norm_(planted(sizes, dtype, values, device), 1.0, norm_type,
                                             error_if_nonfinite=True)
            opt = portable_ops.optim.AdamW(planted(sizes, dtype, values, device), max_grad_norm=1.0)
            opt.step()
        assert norm.isnan() == expected.isnan() and norm.isinf() == expected.isinf()
        two_norm = torch.nn.utils.get_total_norm([p.grad.double() for p in planted(sizes, dtype, values, "cpu")])
        assert opt.last_grad_norm.isnan() == two_norm.isnan() and opt.last_grad_norm.isinf() == two_norm.isinf()

    prop()


NUMBER_KINDS = {"float": float, "np.float32": np.float32, "np.float64": np.float64, "0-d array": np.array}
HYPER = st.fixed_dictionaries({
    "lr": st.floats(1e-5, 0.1), "beta1": st.floats(0.0, 0.99), "beta2": st.floats(0.5, 0.9999),
    "eps": st.floats(1e-10, 1e-3), "weight_decay": st.floats(0.0, 0.2), "max_norm": st.floats(1e-3, 10.0),
})


def numbers_as(kind, hyper):
    """``hyper`` with each value made a ``kind`` number, and the Python floats those numbers are."""
    wrapped = {k: NUMBER_KINDS[kind](v) for k, v in hyper.items()}
    return wrapped, {k: float(v) for k, v in wrapped.items()}


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_numpy_hyperparameters_act_as_the_floats_they_hold(backend, monkeypatch):
    """numpy scalars and 0-d arrays (a scheduler's lambda computing in numpy) through the optimizer, the
    functional step and the clip: bit-identical to the same values as Python floats."""
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")

    @misuse_examples(backend)
    @given(hyper=HYPER, kind=st.sampled_from(list(NUMBER_KINDS)), sizes=SIZES, amsgrad=st.booleans())
    def prop(hyper, kind, sizes, amsgrad):
        wrapped, floats = numbers_as(kind, hyper)
        device = default_device(backend)
        results = []
        for h in (wrapped, floats):
            params = planted(sizes, torch.float32, [], device)
            opt = portable_ops.optim.AdamW(params, lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                                           weight_decay=h["weight_decay"], amsgrad=amsgrad, max_grad_norm=h["max_norm"])
            g = torch.Generator().manual_seed(1)
            state = [[torch.rand(p.shape, generator=g).to(device) for p in params] for _ in range(3)]
            state.append([torch.tensor(2.0, device=device) for _ in params])
            with portable_ops.use_backend(backend), torch.no_grad():
                opt.step()
                portable_ops.functional.adam(params, [p.grad for p in params], *state[:3], state[3], amsgrad=amsgrad,
                                             **{k: v for k, v in h.items() if k != "max_norm"})
                norm = portable_ops.clip_grad_norm_(params, h["max_norm"], norm_type=NUMBER_KINDS[kind](2.0))
            results.append([norm, *params, *(p.grad for p in params), *state[0]])
        assert all(torch.equal(a, b) for a, b in zip(*results))

    prop()
