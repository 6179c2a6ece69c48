"""Every rejected call names the argument, and leaves params and optimizer state bit-identical."""

import math

import pytest
import torch

import portable_ops
from conftest import assert_bit_identical, snapshot


def adam_lists(n=3, shape=(4, 5), dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    def make():
        return [torch.randn(shape, generator=g, dtype=dtype) for _ in range(n)]

    return dict(params=make(), grads=make(), exp_avgs=make(), exp_avg_sqs=make().copy(),
                max_exp_avg_sqs=make(), state_steps=[torch.tensor(3.0) for _ in range(n)])


def run_adam(lists, **kw):
    portable_ops.functional.adam(lists["params"], lists["grads"], lists["exp_avgs"], lists["exp_avg_sqs"],
                                 lists["max_exp_avg_sqs"], lists["state_steps"], **kw)


def mutate(key, i, value):
    def apply(lists):
        lists[key][i] = value(lists[key][i])
    return apply


BAD_ADAM = {
    "grad shape": (mutate("grads", 1, lambda t: torch.zeros(5, 4)), ValueError,
                   r"grads\[1\] has shape \(5, 4\) but params\[1\] has \(4, 5\)"),
    "grad dtype": (mutate("grads", 2, lambda t: t.half()), TypeError,
                   r"grads\[2\] has dtype torch.float16 but params\[2\] has torch.float32"),
    "state shape": (mutate("exp_avg_sqs", 0, lambda t: t[:2]), ValueError, r"exp_avg_sqs\[0\] has shape"),
    "state dtype": (mutate("exp_avgs", 0, lambda t: t.double()), TypeError, r"exp_avgs\[0\] has dtype torch.float64"),
    "max state dtype": (mutate("max_exp_avg_sqs", 1, lambda t: t.bfloat16()), TypeError, r"max_exp_avg_sqs\[1\]"),
    "mixed devices": (mutate("grads", 0, lambda t: t.to("meta")), ValueError,
                      r"grads\[0\] is on meta but params\[0\] is on cpu"),
    "sparse grad": (mutate("grads", 1, lambda t: t.to_sparse()), ValueError, r"grads\[1\] is torch.sparse_coo"),
    "integer param": (mutate("params", 0, lambda t: t.int()), TypeError, r"params\[0\] has dtype torch.int32"),
    "short list": (lambda lists: lists["exp_avgs"].pop(), ValueError, r"exp_avgs has 2 tensors but params has 3"),
    "step shape": (mutate("state_steps", 0, lambda t: torch.zeros(2)), TypeError,
                   r"state_steps\[0\] must be a one-element"),
}

BAD_HYPER = {
    "nan lr": (dict(lr=math.nan), ValueError, "lr must be finite"),
    "inf lr": (dict(lr=math.inf), ValueError, "lr must be finite"),
    "negative lr": (dict(lr=-1e-3), ValueError, "lr must be >= 0"),
    "nan lr tensor": (dict(lr=torch.tensor(math.nan)), ValueError, "lr must be finite"),
    "beta1 = 1": (dict(beta1=1.0), ValueError, r"betas\[0\] must be < 1"),
    "beta2 < 0": (dict(beta2=-0.1), ValueError, r"betas\[1\] must be >= 0"),
    "negative eps": (dict(eps=-1e-8), ValueError, "eps must be >= 0"),
    "negative weight_decay": (dict(weight_decay=-0.1), ValueError, "weight_decay must be >= 0"),
    "grad_scale not scalar": (dict(grad_scale=torch.ones(2)), TypeError,
                              "grad_scale must be None or a one-element tensor"),
    "found_inf on another device": (dict(found_inf=torch.zeros((), device="meta")), ValueError, "found_inf is on meta"),
    "state_dtype float16": (dict(state_dtype=torch.float16), ValueError,
                            r"state_dtype must be None \(state in the param's dtype\) or torch.float32, "
                            r"got torch.float16"),
    "state_dtype a string": (dict(state_dtype="float32"), TypeError, "state_dtype must be None or torch.float32"),
}


@pytest.mark.parametrize("name", BAD_ADAM)
def test_bad_adam_tensors_are_rejected_before_anything_changes(name):
    apply, error, message = BAD_ADAM[name]
    lists = adam_lists()
    apply(lists)
    before = {k: snapshot(v) for k, v in lists.items()}
    with pytest.raises(error, match=message):
        run_adam(lists, amsgrad=True)
    for key, tensors in lists.items():
        assert_bit_identical(before[key], [t.detach().clone() for t in tensors])


@pytest.mark.parametrize("name", BAD_HYPER)
def test_bad_adam_hyperparameters_are_rejected_before_anything_changes(name):
    kw, error, message = BAD_HYPER[name]
    lists = adam_lists()
    before = {k: snapshot(v) for k, v in lists.items()}
    with pytest.raises(error, match=message):
        run_adam(lists, amsgrad=True, **kw)
    for key, tensors in lists.items():
        assert_bit_identical(before[key], tensors)


def set_dtype(key, i, dtype):
    return mutate(key, i, lambda t: t.to(dtype))


def fp32_state(lists):
    for key in ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"):
        lists[key] = [t.float() for t in lists[key]]


# bfloat16 params: (change, state_dtype, error, message)
BAD_STATE_DTYPES = {
    "fp32 state without state_dtype": (fp32_state, None, TypeError,
                                       r"exp_avgs\[0\] has dtype torch.float32 but params\[0\] has torch.bfloat16; "
                                       r"pass state_dtype=torch.float32"),
    "bf16 state under state_dtype=float32": (lambda lists: None, torch.float32, TypeError,
                                             r"exp_avgs\[0\] has dtype torch.bfloat16, but with "
                                             r"state_dtype=torch.float32 the state of a torch.bfloat16 params\[0\]"),
    "one moment left in bf16": (lambda lists: (fp32_state(lists), set_dtype("exp_avg_sqs", 2, torch.bfloat16)(lists)),
                                torch.float32, TypeError, r"exp_avg_sqs\[2\] has dtype torch.bfloat16"),
    "float16 state": (set_dtype("max_exp_avg_sqs", 1, torch.float16), None, TypeError,
                      r"max_exp_avg_sqs\[1\] has dtype torch.float16 but params\[1\] has torch.bfloat16"),
    "float64 state": (lambda lists: (fp32_state(lists), set_dtype("exp_avgs", 1, torch.float64)(lists)),
                      torch.float32, TypeError, r"exp_avgs\[1\] has dtype torch.float64"),
}


@pytest.mark.parametrize("name", BAD_STATE_DTYPES)
def test_state_dtype_must_match_the_moments_passed(name):
    change, state_dtype, error, message = BAD_STATE_DTYPES[name]
    lists = adam_lists(dtype=torch.bfloat16)
    change(lists)
    before = {k: snapshot(v) for k, v in lists.items()}
    with pytest.raises(error, match=message):
        run_adam(lists, amsgrad=True, state_dtype=state_dtype)
    for key, tensors in lists.items():
        assert_bit_identical(before[key], tensors)


def test_fp32_state_is_taken_under_half_params_and_means_the_params_own_dtype_otherwise():
    half = adam_lists(dtype=torch.bfloat16)
    fp32_state(half)
    run_adam(half, amsgrad=True, state_dtype=torch.float32)
    run_adam(adam_lists(dtype=torch.float64), amsgrad=True, state_dtype=torch.float32)
    wide = adam_lists(dtype=torch.float64)
    fp32_state(wide)
    with pytest.raises(TypeError, match=r"exp_avgs\[0\] has dtype torch.float32, but with state_dtype=torch.float32 "
                                        r"the state of a torch.float64 params\[0\] is torch.float64"):
        run_adam(wide, amsgrad=True, state_dtype=torch.float32)


def test_optimizer_rejects_a_bad_state_dtype_before_anything_changes():
    p = torch.nn.Parameter(torch.randn(3, dtype=torch.bfloat16))
    for bad, error in ((torch.float16, ValueError), (torch.bfloat16, ValueError), ("float32", TypeError)):
        with pytest.raises(error, match="state_dtype must be None"):
            portable_ops.optim.AdamW([p], state_dtype=bad)
    opt = portable_ops.optim.AdamW([p], state_dtype=torch.float32)
    with pytest.raises(ValueError, match="state_dtype must be None"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "state_dtype": torch.float64})
    assert len(opt.param_groups) == 1
    p.grad = torch.randn_like(p)
    opt.step()
    before_param, before_state = p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}
    opt.param_groups[0]["state_dtype"] = torch.float16  # set by hand: checked on the next step
    with pytest.raises(ValueError, match="state_dtype must be None"):
        opt.step()
    assert_bit_identical([before_param], [p.detach()])
    assert_bit_identical(list(before_state.values()), list(opt.state[p].values()))


def test_optimizer_constructor_rejects_bad_hyperparameters():
    p = [torch.nn.Parameter(torch.zeros(2))]
    for kw, message in [(dict(lr=math.nan), "lr must be finite"), (dict(betas=(0.9, 1.0)), r"betas\[1\] must be < 1"),
                        (dict(eps=-1.0), "eps must be >= 0"), (dict(max_grad_norm=0.0), "max_grad_norm must be > 0"),
                        (dict(betas=(0.9,)), "betas must be a pair")]:
        with pytest.raises(ValueError, match=message):
            portable_ops.optim.AdamW(p, **kw)


def test_optimizer_step_with_one_bad_group_changes_no_group():
    good = [torch.nn.Parameter(torch.randn(3, 3)) for _ in range(2)]
    bad = torch.nn.Parameter(torch.randn(4))
    opt = portable_ops.optim.AdamW([{"params": good}, {"params": [bad], "lr": 1e-2}], amsgrad=True)
    for p in good + [bad]:
        p.grad = torch.randn_like(p)
    opt.step()  # state exists now
    before_params = snapshot(good + [bad])
    before_state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in good + [bad]}
    for p in good:
        p.grad = torch.randn_like(p)
    bad.grad = torch.randn(4).to_sparse()
    with pytest.raises(ValueError, match=r'param_groups\[1\]\["params"\]\[0\].grad is torch.sparse_coo'):
        opt.step()
    assert_bit_identical(before_params, snapshot(good + [bad]))
    for p in good + [bad]:
        for k, v in opt.state[p].items():
            assert torch.equal(v, before_state[id(p)][k]), k


def test_optimizer_step_that_fails_creates_no_state():
    p = torch.nn.Parameter(torch.randn(3))
    opt = portable_ops.optim.Adam([p], lr=1e-3)
    p.grad = torch.randn(3).to_sparse()
    with pytest.raises(ValueError, match="sparse"):
        opt.step()
    assert len(opt.state) == 0


def qkv(q=(1, 4, 8, 16), k=(1, 2, 8, 16), v=None, dtype=torch.float32):
    return torch.randn(q, dtype=dtype), torch.randn(k, dtype=dtype), torch.randn(v or k, dtype=dtype)


BAD_ATTENTION = {
    "q rank 3": (lambda: (torch.randn(4, 8, 16),) + qkv()[1:], ValueError,
                 r"q must have 4 dimensions .* got shape \(4, 8, 16\)"),
    "k rank 5": (lambda: (qkv()[0], torch.randn(1, 1, 2, 8, 16), qkv()[2]), ValueError, "k must have 4 dimensions"),
    "heads not a multiple": (lambda: qkv(q=(1, 4, 8, 16), k=(1, 3, 8, 16)), ValueError,
                             "q's head count must be a multiple of k's"),
    "head dims differ": (lambda: qkv(q=(1, 4, 8, 16), k=(1, 2, 8, 32)), ValueError,
                         "k has head_dim 32 but q has head_dim 16"),
    # v may have a head dim of its own (tests/test_attention_sinks.py), but not heads of its own
    "v heads differ": (lambda: qkv(k=(1, 2, 8, 16), v=(1, 1, 8, 32)), ValueError,
                       r"k has shape \(1, 2, 8, 16\) but v has \(1, 1, 8, 32\); they must match but in the head dim"),
    "k and v lengths differ": (lambda: qkv(k=(1, 2, 8, 16), v=(1, 2, 9, 16)), ValueError, "k has shape .* but v has"),
    "batch differs": (lambda: qkv(q=(2, 4, 8, 16)), ValueError, "k has batch 1 but q has batch 2"),
    "dtype differs": (lambda: (torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16).half(), torch.randn(1, 2, 8, 16)),
                      TypeError, "k has dtype torch.float16 but q has torch.float32"),
    "integer": (lambda: (torch.ones(1, 2, 8, 16, dtype=torch.int64),) * 3, TypeError, "q has dtype torch.int64"),
    "devices differ": (lambda: (torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16, device="meta"),
                                torch.randn(1, 2, 8, 16)),
                       ValueError, "k is on meta but q is on cpu"),
    # zero-size dimensions are valid (SDPA answers them; tests/test_attention.py), but not queries with no KV heads
    "no kv heads": (lambda: qkv(k=(1, 0, 8, 16)), ValueError, "q has 4 heads, k and v have 0"),
}


@pytest.mark.parametrize("name", BAD_ATTENTION)
def test_bad_attention_input_is_rejected(name):
    make, error, message = BAD_ATTENTION[name]
    with pytest.raises(error, match=message):
        portable_ops.attention(*make())


def test_bad_attention_scale_is_rejected():
    with pytest.raises(ValueError, match="scale must be finite"):
        portable_ops.attention(*qkv(), scale=math.inf)


def test_bad_clip_input_is_rejected_and_grads_untouched():
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
    for p in params:
        p.grad = torch.randn(3)
    before = snapshot([p.grad for p in params])
    with pytest.raises(ValueError, match=r"norm_type must be a number or \+-inf, got nan"):
        portable_ops.clip_grad_norm_(params, 1.0, norm_type=math.nan)
    with pytest.raises(TypeError, match="norm_type must be a number or 'inf', got 'fro'"):
        portable_ops.clip_grad_norm_(params, 1.0, norm_type="fro")
    with pytest.raises(ValueError, match="max_norm must be a number or inf, not NaN"):
        portable_ops.clip_grad_norm_(params, math.nan)
    with pytest.raises(ValueError, match="max_norm must be >= 0"):
        portable_ops.clip_grad_norm_(params, -1.0)  # torch would scale the grads by a negative factor
    on_meta = torch.nn.Parameter(torch.empty(3, device="meta"))
    on_meta.grad = torch.empty(3, device="meta")
    with pytest.raises(ValueError, match=r"grads\[2\] is on meta but grads\[0\] is on cpu"):
        portable_ops.clip_grad_norm_(params + [on_meta], 1.0)
    assert torch.equal(params[0].grad, before[0])


@pytest.mark.parametrize("first_step", [True, False])
@pytest.mark.parametrize("edit", ["none", "amsgrad on", "state_dtype to None"])
def test_a_step_refused_by_strict_mode_writes_nothing(monkeypatch, fake_backend, first_step, edit):
    """The backend of every (group, device) is chosen before the first kernel runs or any state is
    made, cast or moved: a refusal in the second group leaves the first group's params, moments and
    step as they were, and a retried step steps once."""
    a = torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
    b = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    opt = portable_ops.optim.AdamW([{"params": [a]}, {"params": [b]}], lr=0.1, state_dtype=torch.float32,
                                   max_grad_norm=1.0)
    if not first_step:
        a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
        opt.step()
    opt.param_groups[0].update({"none": {}, "amsgrad on": {"amsgrad": True},
                                "state_dtype to None": {"state_dtype": None}}[edit])
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    before_params = snapshot([a, b])
    before_state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in (a, b) if p in opt.state}
    # a stand-in 'triton' that takes the float32 group and refuses the float64 one
    fake_backend(reasons=lambda call: ["no float64 here"] if any(t.dtype == torch.float64
                                                                 for t in call.get("params", ())) else [])
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")
    with portable_ops.use_backend("triton"), pytest.raises(portable_ops.BackendUnavailableError,
                                                           match="no float64 here"):
        opt.step()
    assert_bit_identical(before_params, snapshot([a, b]))
    assert {id(p) for p in (a, b) if p in opt.state} == set(before_state)
    for p in (a, b):
        if p in opt.state:
            assert opt.state[p].keys() == before_state[id(p)].keys()
            assert_bit_identical(list(before_state[id(p)].values()), list(opt.state[p].values()))


def test_a_tensor_listed_twice_is_refused_before_anything_changes():
    """One fused launch would read and write it from two programs at once (a race): torch steps it twice."""
    import warnings

    p = torch.nn.Parameter(torch.ones(3))
    with warnings.catch_warnings(), pytest.raises(ValueError, match=r"param_groups\[0\] holds a parameter twice"):
        warnings.simplefilter("ignore")  # torch's own warning about duplicates
        portable_ops.optim.AdamW([p, p])
    grads = [torch.ones(3), torch.ones(3)]
    state = [torch.zeros(3) for _ in range(4)]
    step = torch.zeros(())
    before = snapshot([p, *state, step])
    for params, steps, message in (([p, p], [step, torch.zeros(())], r"params\[1\] is params\[0\]"),
                                   ([p, torch.nn.Parameter(torch.ones(3))], [step, step],
                                    r"state_steps\[1\] is state_steps\[0\]")):
        with pytest.raises(ValueError, match=message):
            portable_ops.functional.adam(params, grads, state[:2], state[2:], [], steps, lr=0.1)
    assert_bit_identical(before, snapshot([p, *state, step]))
