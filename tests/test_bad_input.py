"""Every rejected call names the argument, and leaves params and optimizer state bit-identical."""

import math

import pytest
import torch

import portable_ops
from conftest import assert_bit_identical, snapshot


def adam_lists(n=3, shape=(4, 5), dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    make = lambda: [torch.randn(shape, generator=g, dtype=dtype) for _ in range(n)]
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
    "grad shape": (mutate("grads", 1, lambda t: torch.zeros(5, 4)), ValueError, r"grads\[1\] has shape \(5, 4\) but params\[1\] has \(4, 5\)"),
    "grad dtype": (mutate("grads", 2, lambda t: t.half()), TypeError, r"grads\[2\] has dtype torch.float16 but params\[2\] has torch.float32"),
    "state shape": (mutate("exp_avg_sqs", 0, lambda t: t[:2]), ValueError, r"exp_avg_sqs\[0\] has shape"),
    "state dtype": (mutate("exp_avgs", 0, lambda t: t.double()), TypeError, r"exp_avgs\[0\] has dtype torch.float64"),
    "max state dtype": (mutate("max_exp_avg_sqs", 1, lambda t: t.bfloat16()), TypeError, r"max_exp_avg_sqs\[1\]"),
    "mixed devices": (mutate("grads", 0, lambda t: t.to("meta")), ValueError, r"grads\[0\] is on meta but params\[0\] is on cpu"),
    "sparse grad": (mutate("grads", 1, lambda t: t.to_sparse()), ValueError, r"grads\[1\] is torch.sparse_coo"),
    "integer param": (mutate("params", 0, lambda t: t.int()), TypeError, r"params\[0\] has dtype torch.int32"),
    "short list": (lambda lists: lists["exp_avgs"].pop(), ValueError, r"exp_avgs has 2 tensors but params has 3"),
    "step shape": (mutate("state_steps", 0, lambda t: torch.zeros(2)), TypeError, r"state_steps\[0\] must be a one-element"),
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
    "grad_scale not scalar": (dict(grad_scale=torch.ones(2)), TypeError, "grad_scale must be None or a one-element tensor"),
    "found_inf on another device": (dict(found_inf=torch.zeros((), device="meta")), ValueError, "found_inf is on meta"),
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
    with pytest.raises(ValueError, match=r"grads\[0\] is torch.sparse_coo"):
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
    "q rank 3": (lambda: (torch.randn(4, 8, 16),) + qkv()[1:], ValueError, r"q must have 4 dimensions .* got shape \(4, 8, 16\)"),
    "k rank 5": (lambda: (qkv()[0], torch.randn(1, 1, 2, 8, 16), qkv()[2]), ValueError, "k must have 4 dimensions"),
    "heads not a multiple": (lambda: qkv(q=(1, 4, 8, 16), k=(1, 3, 8, 16)), ValueError, "q's head count must be a multiple of k's"),
    "head dims differ": (lambda: qkv(q=(1, 4, 8, 16), k=(1, 2, 8, 32)), ValueError, "k has head_dim 32 but q has head_dim 16"),
    "v head dim differs": (lambda: qkv(k=(1, 2, 8, 16), v=(1, 2, 8, 32)), ValueError, "v has head_dim 32"),
    "k and v lengths differ": (lambda: qkv(k=(1, 2, 8, 16), v=(1, 2, 9, 16)), ValueError, "k has shape .* but v has"),
    "batch differs": (lambda: qkv(q=(2, 4, 8, 16)), ValueError, "k has batch 1 but q has batch 2"),
    "dtype differs": (lambda: (torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16).half(), torch.randn(1, 2, 8, 16)), TypeError, "k has dtype torch.float16 but q has torch.float32"),
    "integer": (lambda: (torch.ones(1, 2, 8, 16, dtype=torch.int64),) * 3, TypeError, "q has dtype torch.int64"),
    "devices differ": (lambda: (torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16, device="meta"), torch.randn(1, 2, 8, 16)), ValueError, "k is on meta but q is on cpu"),
    "empty sequence": (lambda: qkv(q=(1, 4, 0, 16)), ValueError, "empty attention"),
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
    with pytest.raises(ValueError, match="norm_type must be a positive number or inf"):
        portable_ops.clip_grad_norm_(params, 1.0, norm_type=-1)
    with pytest.raises(ValueError, match="max_norm must be finite"):
        portable_ops.clip_grad_norm_(params, math.nan)
    on_meta = torch.nn.Parameter(torch.empty(3, device="meta"))
    on_meta.grad = torch.empty(3, device="meta")
    with pytest.raises(ValueError, match=r"grads\[2\] is on meta but grads\[0\] is on cpu"):
        portable_ops.clip_grad_norm_(params + [on_meta], 1.0)
    assert torch.equal(params[0].grad, before[0])
