"""Property-based tests: hypothesis draws the cases, the conformance runner checks them.

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
    "clip": (clip_params, DTYPES),
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
    group either fully stepped or untouched, never partly."""
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
    assert [float(opt.state[p]["step"]) for p in first + second] == [1.0, 1.0, 1.0, 0.0, 0.0]
