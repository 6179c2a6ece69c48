"""portable_ops.optim against torch.optim: free-running trajectories, checkpoints both ways, AMP, fused clip."""

import copy
import io

import pytest
import torch

import portable_ops
from portable_ops import dispatch
from portable_ops.conformance.runner import default_device, usable_backends


def model_and_batches(seed=0, steps=50):
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(13, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    batches = [(torch.randn(16, 13, generator=g), torch.randn(16, 5, generator=g)) for _ in range(steps)]
    return model, batches


def train(model, opt, batches, clip=None):
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses


CONFIGS = {
    "adam": (torch.optim.Adam, portable_ops.optim.Adam, dict(lr=1e-2)),
    "adam_l2_amsgrad": (torch.optim.Adam, portable_ops.optim.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    "adamw": (torch.optim.AdamW, portable_ops.optim.AdamW, dict(lr=1e-2)),
    "adamw_amsgrad_maximize": (torch.optim.AdamW, portable_ops.optim.AdamW,
                               dict(lr=1e-3, weight_decay=0.05, amsgrad=True, maximize=True, betas=(0.8, 0.99))),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_fifty_steps_match_torch_optim(name):
    torch_cls, ours_cls, kw = CONFIGS[name]
    model_t, batches = model_and_batches()
    model_o = copy.deepcopy(model_t)
    losses_t = train(model_t, torch_cls(model_t.parameters(), **kw), batches)
    losses_o = train(model_o, ours_cls(model_o.parameters(), **kw), batches)
    # 50 free-running float32 steps: torch orders the update's roundings differently, so a few
    # float32 ulps drift in; a wrong formula is off by orders of magnitude more.
    torch.testing.assert_close(losses_o, losses_t, rtol=1e-5, atol=1e-5)
    for a, b in zip(model_o.parameters(), model_t.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_defaults_match_torch():
    p = [torch.nn.Parameter(torch.zeros(1))]
    for ours, theirs in ((portable_ops.optim.Adam, torch.optim.Adam), (portable_ops.optim.AdamW, torch.optim.AdamW)):
        d_o, d_t = ours(p).defaults, theirs(p).defaults
        for key in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"):
            assert d_o[key] == d_t[key], key


def test_lr_as_a_tensor_matches_torch():
    model_t, batches = model_and_batches(steps=10)
    model_o = copy.deepcopy(model_t)
    losses_t = train(model_t, torch.optim.AdamW(model_t.parameters(), lr=torch.tensor(1e-2)), batches)
    opt = portable_ops.optim.AdamW(model_o.parameters(), lr=torch.tensor(1e-2))
    losses_o = train(model_o, opt, batches)
    torch.testing.assert_close(losses_o, losses_t, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("direction", ["torch_to_ours", "ours_to_torch"])
def test_checkpoint_moves_both_ways_and_continues_the_trajectory(direction, amsgrad):
    model_a, batches = model_and_batches(steps=30)
    classes = (torch.optim.AdamW, portable_ops.optim.AdamW)
    first, second = classes if direction == "torch_to_ours" else classes[::-1]
    kw = dict(lr=1e-2, weight_decay=0.05, amsgrad=amsgrad)
    opt_a = first(model_a.parameters(), **kw)
    train(model_a, opt_a, batches[:15])
    saved = copy.deepcopy(opt_a.state_dict())
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if amsgrad else set())

    model_b = copy.deepcopy(model_a)
    opt_b = second(model_b.parameters(), **kw)
    opt_b.load_state_dict(saved)
    losses_a = train(model_a, opt_a, batches[15:])
    losses_b = train(model_b, opt_b, batches[15:])
    torch.testing.assert_close(losses_b, losses_a, rtol=1e-5, atol=1e-6)
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert float(opt_b.state_dict()["state"][0]["step"]) == 30


def test_max_grad_norm_equals_clip_then_step():
    model_t, batches = model_and_batches(steps=20)
    model_o = copy.deepcopy(model_t)
    losses_t = train(model_t, torch.optim.AdamW(model_t.parameters(), lr=1e-2), batches, clip=0.05)
    opt = portable_ops.optim.AdamW(model_o.parameters(), lr=1e-2, max_grad_norm=0.05)
    losses_o = train(model_o, opt, batches)
    torch.testing.assert_close(losses_o, losses_t, rtol=1e-5, atol=1e-6)
    assert opt.last_grad_norm is not None and opt.last_grad_norm > 0.05  # the clip was active
    # the step leaves the grads clipped, as torch's clip_grad_norm_ does
    for a, b in zip(model_o.parameters(), model_t.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model_o.parameters()]))
    assert float(total) <= 0.05 * (1 + 1e-5)


def test_max_grad_norm_must_agree_across_groups():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = portable_ops.optim.AdamW([a], max_grad_norm=1.0)
    with pytest.raises(ValueError, match="max_grad_norm must be the same in every param group"):
        opt.add_param_group({"params": [b], "max_grad_norm": 2.0})
    assert len(opt.param_groups) == 1


def test_grad_scaler_protocol_skips_on_inf_and_unscales():
    """GradScaler hands fused-capable optimizers grad_scale / found_inf instead of unscaling."""
    model, batches = model_and_batches(steps=3)
    ref = copy.deepcopy(model)
    opt = portable_ops.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    assert opt._step_supports_amp_scaling
    scale = torch.tensor(1024.0)
    x, y = batches[0]
    for m, o in ((model, opt), (ref, ref_opt)):
        o.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
    for p in model.parameters():
        p.grad.mul_(scale)
    opt.grad_scale, opt.found_inf = scale, torch.tensor(0.0)
    opt.step()
    ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    before = [p.detach().clone() for p in model.parameters()]
    state_before = copy.deepcopy(opt.state_dict())
    for p in model.parameters():
        p.grad.fill_(float("inf"))
    opt.found_inf = torch.tensor(1.0)
    opt.step()
    for a, b in zip(model.parameters(), before):
        assert torch.equal(a, b)
    after = opt.state_dict()
    for i, s in state_before["state"].items():
        for k, v in s.items():
            assert torch.equal(after["state"][i][k], v), k


def test_closure_is_called_and_its_loss_returned():
    model, batches = model_and_batches(steps=1)
    opt = portable_ops.optim.Adam(model.parameters())
    x, y = batches[0]

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    assert opt.step(closure) is not None


def test_differentiable_is_refused():
    with pytest.raises(ValueError, match="differentiable=True is not supported"):
        portable_ops.optim.Adam([torch.nn.Parameter(torch.zeros(1))], differentiable=True)


def test_real_grad_scaler_unscales_and_skips_inf_steps():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ref = copy.deepcopy(model)
    opt, ref_opt = portable_ops.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x = torch.randn(16, 8)
    for _ in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        scaler.scale(model(x).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        ref(x).square().mean().backward()
        ref_opt.step()
    torch.testing.assert_close(model.weight, ref.weight)
    before = copy.deepcopy(opt.state_dict()), model.weight.detach().clone()
    opt.zero_grad()
    scaler.scale(model(x * float("inf")).square().mean()).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(model.weight, before[1]) and scaler.get_scale() == 512.0
    assert float(opt.state[model.weight]["step"]) == 3


# ----------------------------------------------------------------------------- state_dtype

def pull_trajectory(dtype, state_dtype, steps, lr, backend="reference", seed=0):
    """AdamW on a noisy quadratic pull: params of scale 0.02, grads of scale 1e-3 (a typical unscaled
    size), each grad taken in float64 from the param as stored, then rounded to its dtype.
    Runs on the backend's own device (CUDA for triton where present). Returns the start, the final
    param and its moments, in float64 on the CPU."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randn(256, generator=g, dtype=torch.float64) * 0.02
    target = torch.randn(256, generator=g, dtype=torch.float64) * 0.02
    device = default_device(backend)
    w = torch.nn.Parameter(start.to(device, dtype, copy=True))
    opt = portable_ops.optim.AdamW([w], lr=lr, weight_decay=0.0, state_dtype=state_dtype)
    for _ in range(steps):
        noise = torch.randn(256, generator=g, dtype=torch.float64)
        w.grad = (1e-3 * ((w.detach().cpu().double() - target) / 0.02 + noise)).to(device, dtype)
        with portable_ops.use_backend(backend):
            opt.step()
    state = opt.state[w]
    return start, *(t.detach().cpu().double() for t in (w, state["exp_avg"], state["exp_avg_sq"]))


def distances_to_float64(dtype, steps, lr, backend="reference"):
    """Per state_dtype (None, float32): the param's distance to the float64 run's over the float64
    run's displacement, and exp_avg_sq's relative distance."""
    start, w64, _, v64 = pull_trajectory(torch.float64, None, steps, lr)
    out = {}
    for state_dtype in (None, torch.float32):
        _, w, _, v = pull_trajectory(dtype, state_dtype, steps, lr, backend)
        out[state_dtype] = (float((w - w64).norm() / (w64 - start).norm()), float((v - v64).norm() / v64.norm()))
    return out


@pytest.mark.parametrize("backend", ["reference", "triton", "nki"])
def test_fp32_state_tracks_float64_where_fp16_state_underflows(backend, monkeypatch):
    """float16 exp_avg_sq of 1e-3 grads is (1 - beta2) * 1e-6: below float16's smallest subnormal, so it
    flushes to zero and the step becomes lr * m / eps. float32 state keeps it."""
    if backend not in usable_backends():
        pytest.skip(f"{backend} can't run here: {dispatch.unavailable_reason(backend) or 'no device for it'}")
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")  # the backend's own kernel, not a fallback
    d = distances_to_float64(torch.float16, steps=100, lr=1e-3, backend=backend)
    fp16_state, fp32_state = d[None][0], d[torch.float32][0]
    assert fp32_state < 2e-3  # float16 rounding of the param itself (measured 6e-4)
    assert fp16_state > 100 * fp32_state  # measured 4e1: the run is ruined


def test_fp32_state_keeps_bf16_moments_from_drifting():
    """bfloat16 has 8 significant bits: once exp_avg_sq's per-step change (about 1/1000 of it at
    beta2 = 0.999) is under half an ulp (2**-9), the change is rounded away and the moment drifts
    from the float64 run's, taking the step size with it. Over the first 100 steps the change is
    still larger, and the param's own bfloat16 rounding dominates (measured 1.0-1.1x closer with
    float32 state); after 2000 steps float32 state is 4-6x closer."""
    d = distances_to_float64(torch.bfloat16, steps=2000, lr=3e-3)
    (p16, v16), (p32, v32) = d[None], d[torch.float32]
    assert v32 < v16 / 100  # measured 3e-4 vs 1.8e-1
    assert p32 < p16 / 3  # measured 3-4e-3 vs 1.6-1.7e-2


@pytest.mark.parametrize("amsgrad", [False, True])
def test_state_dtype_sets_the_moments_dtype(amsgrad):
    params = [torch.nn.Parameter(torch.randn(3, dtype=dt)) for dt in (torch.bfloat16, torch.float16, torch.float32)]
    for state_dtype, expected in ((None, [p.dtype for p in params]), (torch.float32, [torch.float32] * 3)):
        opt = portable_ops.optim.AdamW(params, amsgrad=amsgrad, state_dtype=state_dtype)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
        for p, dtype in zip(params, expected):
            assert {k: opt.state[p][k].dtype for k in keys} == dict.fromkeys(keys, dtype)
            assert opt.state[p]["step"].dtype == torch.float32
    p64 = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))  # float32 state never narrows a float64 param's
    opt = portable_ops.optim.Adam([p64], state_dtype=torch.float32)
    p64.grad = torch.randn_like(p64)
    opt.step()
    assert opt.state[p64]["exp_avg"].dtype == torch.float64


def bf16_model_and_batches(steps):
    model, batches = model_and_batches(steps=steps)
    return model.to(torch.bfloat16), [(x.bfloat16(), y.bfloat16()) for x, y in batches]


def moments(opt):
    return [{k: v for k, v in s.items() if k != "step"} for s in opt.state_dict()["state"].values()]


def test_fp32_state_survives_a_checkpoint_round_trip():
    model, batches = bf16_model_and_batches(steps=20)
    kw = dict(lr=1e-2, amsgrad=True, state_dtype=torch.float32)
    opt = portable_ops.optim.AdamW(model.parameters(), **kw)
    train(model, opt, batches[:10])
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert all(t.dtype == torch.float32 for m in moments(opt) for t in m.values())

    model_b = copy.deepcopy(model)
    opt_b = portable_ops.optim.AdamW(model_b.parameters(), **kw)
    opt_b.load_state_dict(saved)
    for a, b in zip(moments(opt), moments(opt_b)):
        for k in a:
            assert b[k].dtype == torch.float32 and torch.equal(a[k], b[k]), k
    assert train(model_b, opt_b, batches[10:]) == train(model, opt, batches[10:])  # bit for bit
    for a, b in zip(model.parameters(), model_b.parameters()):
        assert torch.equal(a, b)


def test_torch_bf16_checkpoint_is_upcast_exactly_into_fp32_state():
    model, batches = bf16_model_and_batches(steps=20)
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, torch_opt, batches[:10])
    saved = copy.deepcopy(torch_opt.state_dict())
    assert all(t.dtype == torch.bfloat16 for m in moments(torch_opt) for t in m.values())

    opt = portable_ops.optim.AdamW(copy.deepcopy(model).parameters(), lr=1e-2, state_dtype=torch.float32)
    opt.load_state_dict(saved)
    assert all(g["state_dtype"] is torch.float32 for g in opt.param_groups)  # the loading optimizer's setting
    for theirs, ours in zip(moments(torch_opt), moments(opt)):
        for k in theirs:
            assert ours[k].dtype == torch.float32 and torch.equal(ours[k], theirs[k].float()), k


def test_fp32_state_checkpoint_loads_into_bf16_state_as_torch_would():
    model, batches = bf16_model_and_batches(steps=20)
    opt = portable_ops.optim.AdamW(model.parameters(), lr=1e-2, state_dtype=torch.float32)
    train(model, opt, batches[:10])
    saved = copy.deepcopy(opt.state_dict())
    for target in (portable_ops.optim.AdamW, torch.optim.AdamW):
        model_b = copy.deepcopy(model)
        opt_b = target(model_b.parameters(), lr=1e-2)
        opt_b.load_state_dict(copy.deepcopy(saved))
        for ours, loaded in zip(moments(opt), moments(opt_b)):
            for k in ours:
                assert loaded[k].dtype == torch.bfloat16 and torch.equal(loaded[k], ours[k].bfloat16()), k
        train(model_b, opt_b, batches[10:])  # and the run goes on


def test_changing_a_groups_state_dtype_converts_the_state_on_the_next_step():
    p = torch.nn.Parameter(torch.randn(5, dtype=torch.bfloat16))
    opt = portable_ops.optim.Adam([p], lr=1e-2)
    for state_dtype, expected in ((None, torch.bfloat16), (torch.float32, torch.float32), (None, torch.bfloat16)):
        opt.param_groups[0]["state_dtype"] = state_dtype
        before = opt.state[p]["exp_avg"].clone() if opt.state else None
        p.grad = torch.zeros_like(p)  # exp_avg only decays: 0.9 * its old value, rounded to the new dtype
        opt.step()
        assert opt.state[p]["exp_avg"].dtype == opt.state[p]["exp_avg_sq"].dtype == expected
        if before is not None:
            torch.testing.assert_close(opt.state[p]["exp_avg"].float(), before.float() * 0.9, rtol=2 ** -7, atol=0)


# ----------------------------------------------------------------------------- params replaced between steps

def stepped_once(backend, n=1000, dtype=torch.float32, **kw):
    """Three params on the backend's device, one AdamW step taken (the step's lists are cached)."""
    device = default_device(backend)
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(size, generator=g).to(device, dtype)) for size in (7, n, 33)]
    opt = portable_ops.optim.AdamW(params, lr=1e-2, **kw)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(device, dtype)
    with portable_ops.use_backend(backend):
        opt.step()
    return params, opt


def state_snapshot(opt):
    return {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}


@pytest.mark.parametrize("new_size", [5000, 100])
@pytest.mark.parametrize("backend", usable_backends())
def test_a_resized_param_is_refused_like_an_uncached_step(backend, new_size, checked_kernels, monkeypatch):
    """Model surgery (an embedding resized through ``p.data``) after a step: the cached lists still hold
    moments of the old size, which a kernel would run past the end of (a grown param) or leave stale (a
    shrunk one). torch raises a size mismatch; so do we, naming the tensors, before anything is written."""
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")  # the backend's own kernel
    params, opt = stepped_once(backend)
    params[1].data = torch.randn(new_size, device=params[1].device)
    for p in params:
        p.grad = torch.randn_like(p)
    before_params, before_state = [p.detach().clone() for p in params], state_snapshot(opt)
    with portable_ops.use_backend(backend), pytest.raises(
            ValueError, match=rf'state\[param_groups\[0\]\["params"\]\[1\]\]\["exp_avg"\] has shape \(1000,\) but '
                              rf'param_groups\[0\]\["params"\]\[1\] has \({new_size},\)'):
        opt.step()
    for p, b in zip(params, before_params):
        assert torch.equal(p, b)
    for p in params:
        for k, v in opt.state[p].items():
            assert torch.equal(v, before_state[id(p)][k]), k
    del opt.state[params[1]]  # the user's fix: fresh state for the new param
    with portable_ops.use_backend(backend):
        opt.step()
    assert opt.state[params[1]]["exp_avg"].shape == (new_size,)


@pytest.mark.parametrize("backend", usable_backends())
def test_a_param_cast_after_steps_takes_its_moments_along(backend, checked_kernels, monkeypatch):
    """``model.half()`` after some steps with ``state_dtype=None``: the moments follow the param's new dtype
    (the documented contract), and the step equals that of an optimizer loading the same state afresh."""
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")
    params, opt = stepped_once(backend)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p in params + twins:
        p.data = p.data.half()
    for p, t in zip(params, twins):
        p.grad = torch.randn_like(p)
        t.grad = p.grad.clone()
    fresh = portable_ops.optim.AdamW(twins, lr=1e-2)
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch's load casts the moments to the param's dtype
    with portable_ops.use_backend(backend):
        opt.step()
        fresh.step()
    for p, t in zip(params, twins):
        assert opt.state[p]["exp_avg"].dtype == opt.state[p]["exp_avg_sq"].dtype == torch.float16
        assert torch.equal(p, t)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][k], fresh.state[t][k]), k


def test_a_cast_param_keeps_float32_moments_under_state_dtype_float32(checked_kernels):
    params, opt = stepped_once("reference", state_dtype=torch.float32)
    for p in params:
        p.data = p.data.bfloat16()
        p.grad = torch.randn_like(p)
    opt.step()
    assert {opt.state[p]["exp_avg"].dtype for p in params} == {torch.float32}
    params[0].data = params[0].data.double()  # float32 state never narrows a float64 param's
    params[0].grad = torch.randn_like(params[0])
    opt.step()
    assert opt.state[params[0]]["exp_avg_sq"].dtype == torch.float64


def test_a_checkpoint_with_python_number_steps_loads_as_torchs_does():
    """torch before 1.12 saved ``step`` as an int; torch.optim still loads such checkpoints."""

    p0 = torch.nn.Parameter(torch.ones(3))
    saver = torch.optim.AdamW([p0])
    p0.grad = torch.ones(3)
    saver.step()
    saved = copy.deepcopy(saver.state_dict())
    saved["state"][0]["step"] = 1
    results = []
    for cls in (torch.optim.AdamW, portable_ops.optim.AdamW):
        p = torch.nn.Parameter(torch.ones(3))
        opt = cls([p])
        opt.load_state_dict(copy.deepcopy(saved))
        p.grad = torch.ones(3)
        opt.step()
        results.append((p.detach().clone(), float(opt.state[p]["step"])))
    torch.testing.assert_close(results[1][0], results[0][0])
    assert results[1][1] == results[0][1] == 2.0


@pytest.mark.parametrize("functional", [False, True], ids=["optimizer", "functional"])
@pytest.mark.parametrize("backend", usable_backends())
def test_a_step_between_forward_and_backward_is_caught_as_torchs(backend, functional, monkeypatch):
    """A step between a forward and its backward (a GAN or accumulation mistake): torch's AdamW bumps the
    params' versions, so backward() raises instead of silently using the stepped weights. Every backend's
    writes must do the same, kernels writing through raw pointers included."""
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")
    device = default_device(backend)
    w = torch.nn.Parameter(torch.randn(4, 4, device=device))
    x = torch.randn(3, 4, device=device, requires_grad=True)
    loss = (x @ w).square().sum()  # saves w for x's gradient
    w.grad = torch.randn_like(w)
    state = [torch.zeros_like(w), torch.zeros_like(w), torch.zeros((), device=device)]
    versions = [t._version for t in (w, *state[:2])]
    with portable_ops.use_backend(backend), torch.no_grad():  # no_grad: as torch.optim's steps run
        if functional:
            portable_ops.functional.adam([w], [w.grad], [state[0]], [state[1]], [], [state[2]], lr=0.1)
        else:
            portable_ops.optim.AdamW([w], lr=0.1).step()
    if functional:
        assert all(t._version > v for t, v in zip((w, *state[:2]), versions))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_step_after_unchanged_ones_still_checks_what_changed():
    """Steps of unchanged lists and options reuse the checked call (optim._steady_call): an option changed
    since, a bad one, or grads of another layout are still seen, before anything is written."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=g)) for _ in range(2)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = portable_ops.optim.AdamW(params, lr=1e-2)
    torch_opt = torch.optim.AdamW(twins, lr=1e-2)
    changes = [{}, {}, {"lr": 0.05}, {"betas": (0.8, 0.99)}, {"weight_decay": 0.0}, {"eps": 1e-3}, {}]
    for change in changes:
        for group in (opt.param_groups[0], torch_opt.param_groups[0]):
            group.update(change)
        for a, b in zip(params, twins):
            a.grad = b.grad = torch.randn(5, 3, generator=g)
        with portable_ops.use_backend("reference"):
            opt.step()
        torch_opt.step()
        for a, b in zip(params, twins):
            torch.testing.assert_close(a, b)
    before = [p.detach().clone() for p in params]
    for bad, match in (({"lr": float("nan")}, "lr"), ({"betas": (0.9, 1.5)}, "betas")):
        good = dict(opt.param_groups[0])
        opt.param_groups[0].update(bad)
        with portable_ops.use_backend("reference"), pytest.raises(ValueError, match=match):
            opt.step()
        opt.param_groups[0].update({k: good[k] for k in bad})
        assert all(torch.equal(p, b) for p, b in zip(params, before))
    for a, b in zip(params, twins):  # strided grads, which the fused kernel can't read: the definition steps them
        a.grad = b.grad = torch.randn(3, 5, generator=g).t()
    with portable_ops.use_backend("reference"):
        opt.step()
    torch_opt.step()
    for a, b in zip(params, twins):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("later", [None, float("inf")])
def test_a_clip_switched_off_after_unchanged_steps_no_longer_clips(later):
    """The call kept for unchanged steps (optim._steady_call) holds no clip of its own: with max_grad_norm set to
    None (or inf, which only measures) the next step takes the grads as they are, as torch's AdamW."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3, generator=g)) for _ in range(2)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = portable_ops.optim.AdamW(params, lr=1e-2, max_grad_norm=0.5)
    torch_opt = torch.optim.AdamW(twins, lr=1e-2)
    for step in range(3):
        if step == 2:
            opt.param_groups[0]["max_grad_norm"] = later
        for a, b in zip(params, twins):  # each its own grad: the fused clip writes ours
            a.grad = torch.randn(4, 3, generator=g)
            b.grad = a.grad.clone()
        if step < 2:
            torch.nn.utils.clip_grad_norm_(twins, 0.5)
        with portable_ops.use_backend("reference"):
            opt.step()
        torch_opt.step()
        for a, b in zip(params, twins):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq", "step", "momentum_buffer"])
@pytest.mark.parametrize("how", ["data", "resize_"])
def test_a_state_tensor_resized_in_place_after_cached_steps_is_refused_by_name(key, how):
    """The cached lists hold the same state tensor objects; one given other data or resized since (the kernels
    would write past its end) is seen, and the step refuses it before anything is written."""
    params = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(2)]
    opt = (portable_ops.optim.SGD(params, lr=0.1, momentum=0.9) if key == "momentum_buffer"
           else portable_ops.optim.AdamW(params, lr=0.1))
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(4, 3)
        with portable_ops.use_backend("reference"):
            opt.step()
    state = opt.state[params[1]][key]
    if how == "data":
        state.data = torch.zeros(2, 2)
    else:
        state.resize_(2)
    before = [p.detach().clone() for p in params]
    with portable_ops.use_backend("reference"), pytest.raises((ValueError, TypeError), match=key):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_adams_decoupled_weight_decay_option_and_checkpoints_are_torchs():
    """torch's Adam takes ``decoupled_weight_decay`` (a group option, kept in its checkpoints) and its AdamW is
    decoupled whatever a checkpoint says: ours the same, so a checkpoint of either moves both ways unchanged."""
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(5, 3, generator=g) for _ in range(2)]
    grads = [[torch.randn(5, 3, generator=g) for _ in init] for _ in range(4)]
    kw = dict(lr=0.05, weight_decay=0.1)

    def run(make, steps, start=init, load=None):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = make(params)
        if load is not None:  # a copy: a loaded state dict shares its tensors with the optimizer it came from
            opt.load_state_dict(copy.deepcopy(load))
        for step in steps:
            for p, grad in zip(params, grads[step]):
                p.grad = grad.clone()
            with portable_ops.use_backend("reference"):
                opt.step()
        return [p.detach() for p in params], opt

    def same(a, b):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y)

    for decoupled in (True, False):
        ours = lambda ps: portable_ops.optim.Adam(ps, decoupled_weight_decay=decoupled, **kw)  # noqa: E731
        theirs = lambda ps: torch.optim.Adam(ps, decoupled_weight_decay=decoupled, **kw)  # noqa: E731
        whole, _ = run(theirs, range(4))
        same(run(ours, range(4))[0], whole)
        half, first = run(theirs, range(2))  # two steps by torch, two by ours from its checkpoint: and back
        same(run(lambda ps: portable_ops.optim.Adam(ps, **kw), range(2, 4), half, first.state_dict())[0], whole)
        half, first = run(ours, range(2))
        same(run(lambda ps: torch.optim.Adam(ps, **kw), range(2, 4), half, first.state_dict())[0], whole)
    half, l2 = run(lambda ps: torch.optim.Adam(ps, **kw), range(2))  # an L2 checkpoint into AdamW: decoupled
    resumed, opt = run(lambda ps: portable_ops.optim.AdamW(ps, **kw), range(2, 4), half, l2.state_dict())
    assert opt.param_groups[0]["decoupled_weight_decay"] is True
    same(resumed, run(lambda ps: torch.optim.AdamW(ps, **kw), range(2, 4), half, l2.state_dict())[0])
