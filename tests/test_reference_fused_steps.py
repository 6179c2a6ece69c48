"""The reference backend's fused optimizer steps through torch's fused kernels (backends/reference/kernel_scalars.py):
a scaled or clipped step leaves the grads as torch's clip and fused step leave them, float16 grads under a
GradScaler keep what a product in float16 would flush to zero, float64 grads clip by a float64 coefficient, and
a skipped step changes nothing."""

import math

import pytest
import torch

import portable_ops
from portable_ops.conformance.runner import default_device, forced_strict, usable_backends
from portable_ops.conformance.tolerances import tolerance

SHAPES = [(37, 5), (3,), (), (0, 4), (129,), (11, 13)]

def _family(name):
    return "sgd" if name.startswith("sgd") else "adam"


OPTIMIZERS = {
    "adamw_clip": (lambda ps: portable_ops.optim.AdamW(ps, lr=1e-2, max_grad_norm=0.5),
                   lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)),
    "adam_amsgrad_clip": (lambda ps: portable_ops.optim.Adam(ps, lr=1e-2, amsgrad=True, max_grad_norm=0.5),
                          lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, fused=True)),
    "sgd_momentum_clip": (lambda ps: portable_ops.optim.SGD(ps, lr=1e-2, momentum=0.9, max_grad_norm=0.5),
                          lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)),
}


def _pair(dtypes, seed=0):
    """Two copies of the same params (one dtype per shape) with the same grads."""
    g = torch.Generator().manual_seed(seed)
    values = [(torch.randn(s, generator=g), torch.randn(s, generator=g) * 3) for s in SHAPES]
    ours, theirs = [], []
    for (value, grad), dtype in zip(values, dtypes):
        for params in (ours, theirs):
            p = torch.nn.Parameter(value.to(dtype))
            p.grad = grad.to(dtype, copy=True)
            params.append(p)
    return ours, theirs


DTYPES = {"float32": [torch.float32] * 6, "bfloat16": [torch.bfloat16] * 6,
          "mixed": [torch.float32] * 3 + [torch.float64] * 3}


# the reference's SGD runs the definition for half precision on the CPU (tests/test_sgd.py covers it)
@pytest.mark.parametrize("name, dtypes", [(name, dtypes) for name in OPTIMIZERS for dtypes in DTYPES
                                          if not (_family(name) == "sgd" and dtypes == "bfloat16")])
def test_a_clipped_step_is_torchs_clip_then_step_grads_included(name, dtypes):
    """Params and the grads left behind, against ``clip_grad_norm_`` then torch's step, over two steps; one
    launch per dtype under one global clip."""
    dtypes = DTYPES[dtypes]
    make_ours, make_theirs = OPTIMIZERS[name]
    ours, theirs = _pair(dtypes)
    opt, torch_opt = make_ours(ours), make_theirs(theirs)
    tol = tolerance(_family(name), dtypes[0])
    for step in range(2):
        with portable_ops.use_backend("reference"), forced_strict("reference"):
            opt.step()
        torch.nn.utils.clip_grad_norm_(theirs, 0.5)
        torch_opt.step()
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a.grad, b.grad, atol=tol.atol, rtol=tol.rtol, msg=f"step {step}: grads")
            torch.testing.assert_close(a, b, atol=tol.atol, rtol=tol.rtol, msg=f"step {step}: params")
            a.grad, b.grad = a.grad * 2, b.grad * 2  # a norm that needs clipping again


def test_float16_under_a_grad_scale_keeps_grads_float16_would_flush():
    # 1e-8 unscaled is below float16's smallest subnormal: a product in float16 would make it 0
    scale = torch.tensor(2.0**16)
    p = torch.nn.Parameter(torch.zeros(64, dtype=torch.float16))
    g = torch.full((64,), 1e-8 * 2.0**16, dtype=torch.float16)
    m, v, step = torch.zeros_like(p), torch.zeros_like(p), torch.zeros(())
    from portable_ops.backends.reference.adam import adam
    adam([p.detach()], [g], [m], [v], [], [step], amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-3, weight_decay=0.0,
         eps=1e-12, maximize=False, decoupled_weight_decay=True, grad_scale=scale)
    assert bool((p < 0).all()), "the unscaled grad was flushed to zero"
    assert torch.equal(g, torch.zeros(64, dtype=torch.float16)), "the grads are left unscaled (in float16: 0)"


@pytest.mark.parametrize("backend", usable_backends())
@pytest.mark.parametrize("name", ["adamw_clip", "sgd_momentum_clip"])
def test_any_non_zero_found_inf_changes_nothing(name, backend):
    """A non-zero ``found_inf`` changes nothing, step counts and grads included (docs/api.md), not only GradScaler's
    1.0: torch's fused kernels skip on exactly 1.0 and count ``step - found_inf``, so 2.0 stepped with a step count
    of 0 (the next step divides by a bias correction of 0) and NaN stepped with a NaN count."""
    device = default_device(backend)
    params = [torch.nn.Parameter(torch.linspace(-1, 1, n, device=device)) for n in (20, 3)]
    opt = OPTIMIZERS[name][0](params)
    for p in params:
        p.grad = torch.linspace(2, -1, p.numel(), device=device)
    with forced_strict(backend):
        opt.step()
        for found_inf in (2.0, 0.5, -1.0, math.nan):
            tensors = [*params, *(p.grad for p in params), *(s for state in opt.state.values() for s in state.values())]
            before = [t.clone() for t in tensors]
            opt.grad_scale, opt.found_inf = (torch.tensor(v, device=device) for v in (4.0, found_inf))
            opt.step()
            assert all(torch.equal(a, b) for a, b in zip(before, tensors)), f"found_inf={found_inf} wrote"


@pytest.mark.parametrize("name", ["adamw_clip", "sgd_momentum_clip"])
def test_float64_grads_past_float32s_range_clip_as_torchs(name):
    """The clip multiplies float64 grads by a float64 coefficient, as torch's clip does: rounded to float32 it would
    be 0 for a norm past 2^149 times max_grad_norm (no step at all) and subnormal, a few digits, well before."""
    g = torch.Generator().manual_seed(2)
    init, grad = (torch.randn(40, generator=g, dtype=torch.float64) for _ in range(2))
    ours, theirs = (torch.nn.Parameter(init.clone()) for _ in range(2))
    ours.grad, theirs.grad = grad * 1e50, grad * 1e50
    with portable_ops.use_backend("reference"):
        OPTIMIZERS[name][0]([ours]).step()
    torch.nn.utils.clip_grad_norm_([theirs], 0.5)
    (torch.optim.SGD([theirs], lr=1e-2, momentum=0.9) if name.startswith("sgd")
     else torch.optim.AdamW([theirs], lr=1e-2)).step()
    tol = tolerance(_family(name), torch.float32)
    torch.testing.assert_close(ours - init, theirs - init, atol=tol.atol, rtol=tol.rtol)
    torch.testing.assert_close(ours.grad, theirs.grad, atol=0.0, rtol=1e-15)


BF16_CANCELLATIONS = {
    # found by tests/test_properties.py: L2 weight decay nearly cancelling a clipped grad (17% off float64)
    "l2_decay": ({"shapes": [(12,)], "steps": 3, "lr": 0.080078125, "betas": (0.0, 0.0),
                  "eps": 0.00026134489411392835, "weight_decay": 0.09375, "decoupled": False, "amsgrad": False,
                  "maximize": False, "lr_tensor": False, "clip_coef": 0.01}, 0),
    # the first moment's decay and an eps of the grad's size cancel with no weight decay at all (Adam and AdamW)
    "adam_no_decay": ({"shapes": [(12,)], "steps": 2, "lr": 0.0806363522352242, "betas": (0.9, 0.0),
                       "eps": 0.00018151676807743285, "weight_decay": 0.0, "decoupled": False, "amsgrad": False,
                       "maximize": False, "lr_tensor": False, "clip_coef": 0.5161619741549225, "grad_scale": 1024.0},
                      0),
    "adamw": ({"shapes": [(40,)], "steps": 2, "lr": 0.06881085234157915, "betas": (0.9, 0.0),
               "eps": 0.000519540430991103, "weight_decay": 0.1, "decoupled": True, "amsgrad": False,
               "maximize": False, "lr_tensor": False, "clip_coef": 0.7510010223856106}, 22),
}


@pytest.mark.parametrize("name", BF16_CANCELLATIONS)
def test_a_bfloat16_clip_is_computed_in_float32_where_the_step_nearly_cancels_it(name):
    """A clip (or grad scale) multiplied out in bfloat16 rounds the grad; wherever the step nearly cancels it (L2
    weight decay, the first moment's decay, eps) that rounding missed the float64 step by several percent, past the
    tolerance; the kernel's float32 division does not."""
    from portable_ops.conformance.cases import Case
    from portable_ops.conformance.runner import run_case

    params, seed = BF16_CANCELLATIONS[name]
    row = run_case(Case("property_adam", "adam", torch.bfloat16, params, seed=seed), "reference")
    assert row.status == "pass", row.detail


@pytest.mark.parametrize("name", ["adamw_clip", "sgd_momentum_clip"])
def test_a_one_element_grad_scale_under_a_clip_steps_as_a_0d_one(name):
    """GradScaler's scale is [1] in older torch releases (docs/api.md takes any one-element tensor): the clip's
    coefficient divided by it must stay 0-d."""
    results = []
    for scale in (torch.tensor(4.0), torch.tensor([4.0])):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 6))
        p.grad = torch.linspace(8, -4, 6)
        opt = OPTIMIZERS[name][0]([p])
        opt.grad_scale = scale
        with portable_ops.use_backend("reference"):
            opt.step()
        assert opt.last_grad_norm.dim() == 0
        results.append((p.detach(), p.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("name", ["adamw_clip", "sgd_momentum_clip"])
def test_a_grad_shared_by_two_params_is_refused_before_anything_is_written(name):
    """A clipped step writes each grad once: one tensor that is two params' grad would be scaled twice."""
    params = [torch.nn.Parameter(torch.linspace(-1, 1, 6)) for _ in range(2)]
    shared = torch.linspace(8, -4, 6)
    params[0].grad = params[1].grad = shared
    opt = OPTIMIZERS[name][0](params)
    before = [t.clone() for t in (*params, shared)]
    with portable_ops.use_backend("reference"), pytest.raises(
            ValueError, match=r'param_groups\[0\]\["params"\]\[1\]\.grad is param_groups\[0\]\["params"\]\[0\]\.grad'):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, (*params, shared)))
    assert not opt.state
