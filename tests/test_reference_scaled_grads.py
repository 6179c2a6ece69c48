"""The reference backend's fused optimizer steps on scaled copies of the grads, in batches on the CPU
(backends/reference/scaled_grads.py): batching changes nothing beyond rounding, the caller's grads stay as
they were, and float16 grads under a GradScaler keep what a product in float16 would flush to zero."""

import math

import pytest
import torch

import portable_ops
from portable_ops.backends.reference import scaled_grads
from portable_ops.conformance.runner import default_device, forced_strict, usable_backends
from portable_ops.conformance.tolerances import tolerance

SHAPES = [(37, 5), (3,), (), (0, 4), (129,), (11, 13)]


def _model(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]
    grads = [torch.randn(s, generator=g).to(dtype) for s in SHAPES]
    return params, grads


def _steps(make, dtype, batch, monkeypatch, steps=3):
    monkeypatch.setattr(scaled_grads, "CPU_BATCH", batch)
    cuts = []
    cut = scaled_grads._cut
    monkeypatch.setattr(scaled_grads, "_cut", lambda *a: cuts.append(len(a[0])) or cut(*a))
    params, grads = _model(dtype)
    opt = make(params)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    for _ in range(steps):
        with portable_ops.use_backend("reference"):
            opt.step()
    for p, g in zip(params, grads):
        assert torch.equal(p.grad, g), "the step wrote the caller's grads"
    if batch == 1:  # one launch per element; a zero-size piece joins a batch (the definition would launch none)
        assert len(cuts) == steps * sum(p.numel() for p in params)
    return [p.detach() for p in params], opt


OPTIMIZERS = {
    "adamw_clip": lambda ps: portable_ops.optim.AdamW(ps, lr=1e-2, max_grad_norm=0.5),
    "adam_amsgrad_clip": lambda ps: portable_ops.optim.Adam(ps, lr=1e-2, amsgrad=True, max_grad_norm=0.5),
    "sgd_momentum_clip": lambda ps: portable_ops.optim.SGD(ps, lr=1e-2, momentum=0.9, max_grad_norm=0.5),
}
# the reference's SGD runs the definition for half-precision params on the CPU (backends/reference/sgd.py)
CASES = [(name, dtype) for name in OPTIMIZERS for dtype in (torch.float32, torch.bfloat16)
         if not (name.startswith("sgd") and dtype == torch.bfloat16)]


@pytest.mark.parametrize("name, dtype", CASES)
def test_batches_of_any_size_step_as_one_launch(name, dtype, monkeypatch):
    whole, _ = _steps(OPTIMIZERS[name], dtype, 1 << 30, monkeypatch)
    for batch in (1, 7, 64):
        pieces, _ = _steps(OPTIMIZERS[name], dtype, batch, monkeypatch)
        for a, b in zip(whole, pieces):
            # within one step's rounding: torch's CPU kernel takes a piece's tail outside its vector loop
            tol = tolerance("sgd" if name.startswith("sgd") else "adam", dtype)
            torch.testing.assert_close(a, b, atol=tol.atol, rtol=tol.rtol,
                                       msg=f"batches of {batch} elements step differently from one launch")


def test_step_counts_once_per_step_whatever_the_batches(monkeypatch):
    _, opt = _steps(OPTIMIZERS["adamw_clip"], torch.float32, 7, monkeypatch, steps=3)
    assert {float(s["step"]) for s in opt.state.values()} == {3.0}


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
    assert torch.equal(g, torch.full((64,), 1e-8 * 2.0**16, dtype=torch.float16))



def test_params_of_several_dtypes_step_as_torchs_clip_then_step():
    """One launch per dtype, each group's scaled copies of its own dtype, under one global clip."""
    params, grads = _model(torch.float32)
    ours = params[:3] + [torch.nn.Parameter(p.detach().double()) for p in params[3:]]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b, g in zip(ours, theirs, grads):
        a.grad, b.grad = g.to(a.dtype), g.to(a.dtype)
    opt = portable_ops.optim.AdamW(ours, lr=1e-2, max_grad_norm=0.5)
    torch_opt = torch.optim.AdamW(theirs, lr=1e-2, fused=True)
    for _ in range(2):
        with portable_ops.use_backend("reference"):
            opt.step()
        torch.nn.utils.clip_grad_norm_(theirs, 0.5)
        torch_opt.step()
        for b, g in zip(theirs, grads):
            b.grad = g.to(b.dtype)
    for a, b in zip(ours, theirs):
        tol = tolerance("adam", torch.float32)
        torch.testing.assert_close(a, b, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize("backend", usable_backends())
@pytest.mark.parametrize("name", ["adamw_clip", "sgd_momentum_clip"])
def test_any_non_zero_found_inf_changes_nothing(name, backend):
    """A non-zero ``found_inf`` changes nothing, step counts included (docs/api.md), not only GradScaler's 1.0:
    torch's fused kernels skip on exactly 1.0 and count ``step - found_inf``, so 2.0 stepped with a step count of 0
    (the next step divides by a bias correction of 0) and NaN stepped with a NaN count."""
    device = default_device(backend)
    params = [torch.nn.Parameter(torch.linspace(-1, 1, n, device=device)) for n in (20, 3)]
    opt = OPTIMIZERS[name](params)
    for p in params:
        p.grad = torch.linspace(2, -1, p.numel(), device=device)
    with forced_strict(backend):
        opt.step()
        for found_inf in (2.0, 0.5, -1.0, math.nan):
            before = [t.clone() for t in (*params, *(s for state in opt.state.values() for s in state.values()))]
            opt.grad_scale, opt.found_inf = (torch.tensor(v, device=device) for v in (4.0, found_inf))
            opt.step()
            after = [*params, *(s for state in opt.state.values() for s in state.values())]
            assert all(torch.equal(a, b) for a, b in zip(before, after)), f"found_inf={found_inf} wrote"



@pytest.mark.parametrize("name", ["adamw_clip", "sgd_momentum_clip"])
def test_float64_grads_past_float32s_range_clip_as_torchs(name):
    """The clip multiplies float64 grads by a float64 coefficient, as torch's clip does: rounded to float32 it was 0
    for a norm past 2^149 times max_grad_norm (no step at all) and subnormal, a few digits, well before."""
    g = torch.Generator().manual_seed(2)
    init, grad = (torch.randn(40, generator=g, dtype=torch.float64) for _ in range(2))
    ours, theirs = (torch.nn.Parameter(init.clone()) for _ in range(2))
    ours.grad, theirs.grad = grad * 1e50, grad * 1e50
    with portable_ops.use_backend("reference"):
        OPTIMIZERS[name]([ours]).step()
    torch.nn.utils.clip_grad_norm_([theirs], 0.5)
    (torch.optim.SGD([theirs], lr=1e-2, momentum=0.9) if name.startswith("sgd")
     else torch.optim.AdamW([theirs], lr=1e-2)).step()
    tol = tolerance("sgd" if name.startswith("sgd") else "adam", torch.float32)
    torch.testing.assert_close(ours - init, theirs - init, atol=tol.atol, rtol=tol.rtol)


def test_a_step_interrupted_between_batches_counts_the_params_it_stepped(monkeypatch):
    """Python runs between two batches' launches, so a KeyboardInterrupt (Ctrl-C on a long CPU step) lands there:
    the params of the batches before it are stepped and counted, those after neither, as a checkpoint saved on the
    interrupt must have them (every count had advanced before the first launch)."""
    monkeypatch.setattr(scaled_grads, "CPU_BATCH", 8)
    params = [torch.nn.Parameter(torch.linspace(-1, 1, 6) * (i + 1)) for i in range(3)]  # a batch each
    opt = OPTIMIZERS["adamw_clip"](params)
    for p in params:
        p.grad = torch.linspace(2, -1, 6)
    opt.step()
    before = [p.detach().clone() for p in params]
    cut, launched = scaled_grads._cut, []

    def interrupted(*args):
        if launched:
            raise KeyboardInterrupt
        launched.append(args)
        return cut(*args)

    monkeypatch.setattr(scaled_grads, "_cut", interrupted)
    with portable_ops.use_backend("reference"), pytest.raises(KeyboardInterrupt):
        opt.step()
    assert [not torch.equal(p, b) for p, b in zip(params, before)] == [True, False, False]
    assert [float(opt.state[p]["step"]) for p in params] == [2.0, 1.0, 1.0]


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
    coefficient divided by it was [1] too, which the step's multiply refused ('scalar tensor expected to be 0 dim')."""
    results = []
    for scale in (torch.tensor(4.0), torch.tensor([4.0])):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 6))
        p.grad = torch.linspace(8, -4, 6)
        opt = OPTIMIZERS[name]([p])
        opt.grad_scale = scale
        with portable_ops.use_backend("reference"):
            opt.step()
        assert opt.last_grad_norm.dim() == 0
        results.append(p.detach())
    assert torch.equal(*results)


def test_0d_grads_keep_their_dtype_under_a_float64_clip_off_the_cpu():
    """Off the CPU the grads go whole (no batches): a 0-d float32 grad times a float64 clip's 0-d coefficient (a
    float64 param in the step) came out float64, which the fused kernel refuses beside a float32 param."""
    grads = [torch.ones((), device="meta"), torch.ones(3, device="meta", dtype=torch.float64)]
    params = [torch.empty_like(g) for g in grads]
    clip = torch.tensor(0.5, dtype=torch.float64, device="meta")
    for (piece_params,), _, copies, _ in scaled_grads.batches(grads, None, clip, (params,)):
        assert [c.dtype for c in copies] == [p.dtype for p in piece_params]
        assert [c.shape for c in copies] == [p.shape for p in piece_params]
