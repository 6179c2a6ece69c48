"""portable_ops.optim.SGD and functional.sgd against torch.optim.SGD: trajectories on every backend, checkpoints
both ways, buffer semantics, AMP, the fused clip, torch's refusals and bad input refused by name with nothing
written (each backend's kernel: tests/test_sgd_kernels.py)."""

import copy
import io

import numpy as np
import pytest
import torch
from torch.optim.sgd import sgd as torch_sgd

import portable_ops
from portable_ops.conformance.runner import default_device, usable_backends

from conftest import assert_bit_identical, slow_in_the_interpreter, snapshot

BACKENDS = slow_in_the_interpreter(usable_backends())


def model_and_batches(seed=0, steps=20, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(13, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    batches = [(torch.randn(16, 13, generator=g), torch.randn(16, 5, generator=g)) for _ in range(steps)]
    model = model.to(device, dtype)
    return model, [(x.to(device, dtype), y.to(device, dtype)) for x, y in batches]


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
    "plain": dict(lr=0.1),
    "momentum": dict(lr=0.05, momentum=0.9),
    "dampening": dict(lr=0.05, momentum=0.9, dampening=0.5),
    "nesterov_weight_decay": dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "maximize_weight_decay": dict(lr=0.02, momentum=0.8, weight_decay=0.1, maximize=True),
}


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_twenty_steps_match_torch_optim_sgd(backend, name, monkeypatch):
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")  # the backend's own kernel, not a fallback
    kw = CONFIGS[name]
    device = default_device(backend)
    model_t, batches = model_and_batches(device=device)
    model_o = copy.deepcopy(model_t)
    losses_t = train(model_t, torch.optim.SGD(model_t.parameters(), **kw), batches)
    opt = portable_ops.optim.SGD(model_o.parameters(), **kw)
    with portable_ops.use_backend(backend):
        losses_o = train(model_o, opt, batches)
    # float32 steps, torch's roundings in another order: a few ulps drift in; a wrong formula is far off
    torch.testing.assert_close(losses_o, losses_t, rtol=1e-5, atol=1e-5)
    for a, b in zip(model_o.parameters(), model_t.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    has_buffers = kw.get("momentum", 0) != 0
    assert all(("momentum_buffer" in opt.state[p]) == has_buffers for p in model_o.parameters())
    assert not has_buffers or all(opt.state[p]["momentum_buffer"].dtype == p.dtype for p in model_o.parameters())


def test_defaults_and_signature_match_torch():
    import inspect

    ours, theirs = inspect.signature(portable_ops.optim.SGD.__init__), inspect.signature(torch.optim.SGD.__init__)
    torch_params = {k: (v.default, v.kind) for k, v in theirs.parameters.items()}
    our_params = {k: (v.default, v.kind) for k, v in ours.parameters.items()}
    assert {k: v for k, v in our_params.items() if k in torch_params} == torch_params
    assert set(our_params) - set(torch_params) == {"max_grad_norm"}
    p = [torch.nn.Parameter(torch.zeros(1))]
    d_o, d_t = portable_ops.optim.SGD(p).defaults, torch.optim.SGD(p).defaults
    assert {k: d_o[k] for k in d_t} == d_t and d_o["max_grad_norm"] is None


@pytest.mark.parametrize("kw, error", [
    (dict(lr=-0.1), "lr must be >= 0.0"),
    (dict(lr=float("nan")), "lr must be finite"),
    (dict(momentum=-0.5), "momentum must be >= 0.0"),
    (dict(weight_decay=-1e-3), "weight_decay must be >= 0.0"),
    (dict(dampening=float("inf")), "dampening must be finite"),
    (dict(nesterov=True), "Nesterov momentum requires a momentum and zero dampening"),
    (dict(nesterov=True, momentum=0.9, dampening=0.1), "Nesterov momentum requires a momentum and zero dampening"),
    (dict(max_grad_norm=0.0), "max_grad_norm must be > 0 or None"),
])
def test_what_torch_refuses_is_refused(kw, error):
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match=error):
        portable_ops.optim.SGD(p, **kw)
    torch_kw = {k: v for k, v in kw.items() if k != "max_grad_norm"}
    if torch_kw and not any(isinstance(v, float) and not np.isfinite(v) for v in torch_kw.values()):
        with pytest.raises(ValueError):  # torch refuses these too (NaN and inf it lets through)
            torch.optim.SGD(p, **torch_kw)


def test_differentiable_and_fused_with_foreach_are_refused():
    p = [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(ValueError, match="differentiable=True is not supported"):
        portable_ops.optim.SGD(p, differentiable=True)
    for cls in (torch.optim.SGD, portable_ops.optim.SGD):
        with pytest.raises(RuntimeError, match="`fused` and `foreach` cannot be `True` together"):
            cls(p, fused=True, foreach=True)
    portable_ops.optim.SGD(p, fused=True)  # accepted, as torch's; every step is the fused path anyway


def test_numpy_scalars_and_a_tensor_lr_are_taken_as_torch_takes_them():
    kw = dict(lr=np.float32(0.05), momentum=np.float64(0.9), dampening=np.array(0.1), weight_decay=np.float32(1e-2))
    model_t, batches = model_and_batches(steps=8)
    model_o = copy.deepcopy(model_t)
    losses_t = train(model_t, torch.optim.SGD(model_t.parameters(), **kw), batches)
    losses_o = train(model_o, portable_ops.optim.SGD(model_o.parameters(), **kw), batches)
    torch.testing.assert_close(losses_o, losses_t, rtol=1e-5, atol=1e-6)
    model_t, batches = model_and_batches(steps=8)
    model_o = copy.deepcopy(model_t)
    losses_t = train(model_t, torch.optim.SGD(model_t.parameters(), lr=torch.tensor(0.05), momentum=0.9), batches)
    losses_o = train(model_o, portable_ops.optim.SGD(model_o.parameters(), lr=torch.tensor(0.05), momentum=0.9),
                     batches)
    torch.testing.assert_close(losses_o, losses_t, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("direction", ["torch_to_ours", "ours_to_torch"])
def test_checkpoint_moves_both_ways_and_continues_the_trajectory(direction, momentum):
    model_a, batches = model_and_batches(steps=20)
    classes = (torch.optim.SGD, portable_ops.optim.SGD)
    first, second = classes if direction == "torch_to_ours" else classes[::-1]
    kw = dict(lr=0.05, momentum=momentum, nesterov=momentum > 0, weight_decay=0.01)
    opt_a = first(model_a.parameters(), **kw)
    train(model_a, opt_a, batches[:10])
    buffer = io.BytesIO()
    torch.save(opt_a.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert all(set(s) == {"momentum_buffer"} for s in saved["state"].values())
    assert len(saved["state"]) == (4 if momentum else 0)  # torch keeps no state without momentum

    model_b = copy.deepcopy(model_a)
    opt_b = second(model_b.parameters(), **kw)
    opt_b.load_state_dict(saved)
    losses_a = train(model_a, opt_a, batches[10:])
    losses_b = train(model_b, opt_b, batches[10:])
    torch.testing.assert_close(losses_b, losses_a, rtol=1e-5, atol=1e-6)
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(opt_a.state_dict()["state"].values(), opt_b.state_dict()["state"].values()):
        torch.testing.assert_close(a["momentum_buffer"], b["momentum_buffer"], rtol=1e-5, atol=1e-6)


def test_a_checkpoint_without_our_keys_loads_and_keeps_max_grad_norm():
    p = torch.nn.Parameter(torch.ones(3))
    saved = torch.optim.SGD([p], lr=0.1, momentum=0.9).state_dict()
    for key in ("nesterov", "maximize", "foreach", "differentiable", "fused"):
        del saved["param_groups"][0][key]  # as an older torch wrote them
    opt = portable_ops.optim.SGD([p], lr=0.1, momentum=0.9, max_grad_norm=1.0)
    opt.load_state_dict(saved)
    group = opt.param_groups[0]
    assert (group["nesterov"], group["maximize"], group["max_grad_norm"]) == (False, False, 1.0)


def test_the_first_step_makes_the_buffer_from_the_decayed_grad_and_none_without_momentum():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    opt = portable_ops.optim.SGD([p], lr=0.1, momentum=0.9, dampening=0.5, weight_decay=0.1)
    p.grad = torch.tensor([0.5, 0.5, -1.0])
    opt.step()
    # torch clones grad + wd * p, undampened, on the first step
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], torch.tensor([0.6, 0.3, -0.7]))
    torch.testing.assert_close(p.detach(), torch.tensor([0.94, -2.03, 3.07]))
    p.grad = torch.tensor([1.0, 0.0, 0.0])
    opt.step()  # 0.9 * buf + 0.5 * (grad + wd * p)
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], torch.tensor([1.087, 0.1685, -0.4765]))

    q = torch.nn.Parameter(torch.ones(3))
    plain = portable_ops.optim.SGD([q], lr=0.1)
    q.grad = torch.ones(3)
    plain.step()
    assert len(plain.state) == 0 and plain.state_dict()["state"] == {}


def test_functional_sgd_fills_the_none_buffers_in_the_list_as_torch_does():
    params = [torch.randn(4), torch.randn(2, 3)]
    grads = [torch.randn(4), torch.randn(2, 3)]
    theirs = [t.clone() for t in params]
    ours_buffers, their_buffers = [None, None], [None, None]
    kw = dict(weight_decay=0.01, momentum=0.9, lr=0.1, dampening=0.0, nesterov=True, maximize=False)
    for _ in range(3):
        portable_ops.functional.sgd(params, grads, ours_buffers, **kw)
        torch_sgd(theirs, [g.clone() for g in grads], their_buffers, foreach=False, **kw)
    for a, b in zip(params + ours_buffers, theirs + their_buffers):
        torch.testing.assert_close(a, b)
    assert ours_buffers[1].shape == (2, 3) and ours_buffers[1].dtype == params[1].dtype
    grads_before = snapshot(grads)
    portable_ops.functional.sgd(params, grads, [None, None], momentum=0.0, lr=0.1)  # no buffer read or made
    assert_bit_identical(grads_before, grads)


def test_late_params_mix_new_and_old_buffers_in_one_step_as_torch():
    """A param that gets its first grad after others (unfrozen later) makes its buffer while the others decay
    theirs: the kernels take new and old buffers in one call."""
    model_t, batches = model_and_batches(steps=6)
    model_o = copy.deepcopy(model_t)
    opts = [cls(m.parameters(), lr=0.05, momentum=0.9, dampening=0.3)
            for cls, m in ((torch.optim.SGD, model_t), (portable_ops.optim.SGD, model_o))]
    for step, (x, y) in enumerate(batches):
        for model, opt in zip((model_t, model_o), opts):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if step < 3:
                model[2].weight.grad = None  # frozen for three steps
            opt.step()
    for a, b in zip(model_o.parameters(), model_t.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_param_groups_step_with_their_own_options():
    model_t, batches = model_and_batches(steps=8)
    model_o = copy.deepcopy(model_t)

    def groups(m):
        return [{"params": m[0].parameters(), "lr": 0.1}, {"params": m[2].parameters(), "momentum": 0.5,
                                                           "nesterov": True}]

    losses_t = train(model_t, torch.optim.SGD(groups(model_t), lr=0.02, momentum=0.9), batches)
    losses_o = train(model_o, portable_ops.optim.SGD(groups(model_o), lr=0.02, momentum=0.9), batches)
    torch.testing.assert_close(losses_o, losses_t, rtol=1e-5, atol=1e-6)


def test_a_bad_param_group_is_refused_and_not_added():
    opt = portable_ops.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum and zero dampening"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "nesterov": True})
    with pytest.raises(ValueError, match="lr must be >= 0.0"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": -1.0})
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="holds a parameter twice"):
        opt.add_param_group({"params": [p, p]})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_size_params_step_as_torch(backend, monkeypatch):
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")
    device = default_device(backend)
    shapes = [(0,), (3, 0), (5,)]
    ours = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt_o = portable_ops.optim.SGD(ours, lr=0.1, momentum=0.9)
    opt_t = torch.optim.SGD(theirs, lr=0.1, momentum=0.9)
    for _ in range(2):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        with portable_ops.use_backend(backend):
            opt_o.step()
        opt_t.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)
        assert opt_o.state[a]["momentum_buffer"].shape == opt_t.state[b]["momentum_buffer"].shape


# ----------------------------------------------------------------------------- AMP and the fused clip

def test_grad_scaler_unscales_and_a_skipped_first_step_makes_no_buffer():
    """GradScaler hands grad_scale / found_inf to the step. torch's SGD (not fused) has its step skipped
    whole on an inf: no buffer is made, and the next step makes it from that step's grad."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ref = copy.deepcopy(model)
    opt = portable_ops.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, dampening=0.2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, dampening=0.2)
    assert opt._step_supports_amp_scaling
    scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0) for _ in range(2)]
    x = torch.randn(16, 8)
    for step in range(4):
        for m, o, scaler in ((model, opt, scalers[0]), (ref, ref_opt, scalers[1])):
            o.zero_grad()
            scaler.scale(m(x * (float("inf") if step in (0, 2) else 1.0)).square().mean()).backward()
            scaler.step(o)
            scaler.update()
        if step == 0:
            assert len(opt.state) == 0 and len(ref_opt.state) == 0
    torch.testing.assert_close(model.weight, ref.weight)
    torch.testing.assert_close(opt.state[model.weight]["momentum_buffer"],
                               ref_opt.state[ref.weight]["momentum_buffer"])
    assert scalers[0].get_scale() == scalers[1].get_scale()


@pytest.mark.parametrize("backend", BACKENDS)
def test_found_inf_on_a_later_step_changes_nothing(backend, monkeypatch):
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")
    device = default_device(backend)
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in ((7,), (130,), (3, 5))]
    opt = portable_ops.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True)
    for p in params:
        p.grad = torch.randn_like(p)
    with portable_ops.use_backend(backend):
        opt.step()
        before = snapshot(params) + snapshot([opt.state[p]["momentum_buffer"] for p in params])
        for p in params:
            p.grad.fill_(float("nan"))
        opt.grad_scale, opt.found_inf = torch.tensor(8.0, device=device), torch.tensor(1.0, device=device)
        opt.step()
    assert_bit_identical(before, snapshot(params) + snapshot([opt.state[p]["momentum_buffer"] for p in params]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_grad_norm_equals_clip_then_step(backend, monkeypatch):
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")
    device = default_device(backend)
    model_t, batches = model_and_batches(steps=10, device=device)
    model_o = copy.deepcopy(model_t)
    kw = dict(lr=0.05, momentum=0.9, nesterov=True)
    # torch's single-tensor step: its foreach Nesterov step (CUDA's default) adds the buffer into the grads
    losses_t = train(model_t, torch.optim.SGD(model_t.parameters(), foreach=False, **kw), batches, clip=0.05)
    opt = portable_ops.optim.SGD(model_o.parameters(), max_grad_norm=0.05, **kw)
    with portable_ops.use_backend(backend):
        losses_o = train(model_o, opt, batches)
    torch.testing.assert_close(losses_o, losses_t, rtol=1e-5, atol=1e-6)
    assert opt.last_grad_norm is not None and opt.last_grad_norm > 0.05  # the clip was active
    # the step leaves the grads clipped, as torch's clip_grad_norm_ does
    for a, b in zip(model_o.parameters(), model_t.parameters()):
        torch.testing.assert_close(a.grad.cpu(), b.grad.cpu(), rtol=1e-5, atol=1e-7)
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model_o.parameters()]))
    assert float(total) <= 0.05 * (1 + 1e-5)


# ----------------------------------------------------------------------------- bad input

def sgd_lists(n=3, shape=(4, 5)):
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=g) for _ in range(n)]
    return params, [torch.randn(shape, generator=g) for _ in range(n)], [torch.randn(shape, generator=g)
                                                                          for _ in range(n)]


BAD_LISTS = {
    "grad shape": (lambda p, g, b: g.__setitem__(1, torch.zeros(5, 4)), r"grads\[1\] has shape \(5, 4\)"),
    "grad dtype": (lambda p, g, b: g.__setitem__(2, g[2].double()), r"grads\[2\] has dtype torch.float64"),
    "buffer shape": (lambda p, g, b: b.__setitem__(0, torch.zeros(3)),
                     r"momentum_buffer_list\[0\] has shape \(3,\) but params\[0\] has \(4, 5\)"),
    "buffer dtype": (lambda p, g, b: b.__setitem__(1, b[1].half()),
                     r"momentum_buffer_list\[1\] has dtype torch.float16 but params\[1\] has torch.float32"),
    "buffer not a tensor": (lambda p, g, b: b.__setitem__(2, 0.0), r"momentum_buffer_list\[2\] must be a tensor"),
    "buffers short": (lambda p, g, b: b.pop(), "momentum_buffer_list has 2 entries but params has 3"),
    "buffer twice": (lambda p, g, b: b.__setitem__(2, b[0]), r"momentum_buffer_list\[2\] is momentum_buffer_list\[0\]"),
    "param twice": (lambda p, g, b: p.__setitem__(1, p[0]), r"params\[1\] is params\[0\]"),
    "integer param": (lambda p, g, b: p.__setitem__(0, p[0].int()), r"params\[0\] has dtype torch.int32"),
}


@pytest.mark.parametrize("name", BAD_LISTS)
def test_bad_tensors_are_refused_by_name_before_anything_changes(name):
    params, grads, buffers = sgd_lists()
    mutate, error = BAD_LISTS[name]
    mutate(params, grads, buffers)
    tensors = [t for t in params + grads + buffers if isinstance(t, torch.Tensor)]
    before = snapshot(tensors)
    with pytest.raises((TypeError, ValueError), match=error):
        portable_ops.functional.sgd(params, grads, buffers, momentum=0.9, lr=0.1)
    assert_bit_identical(before, tensors)


@pytest.mark.parametrize("kw, error", [
    (dict(lr=-1.0), "lr must be >= 0.0"), (dict(momentum=-0.1), "momentum must be >= 0.0"),
    (dict(nesterov=True, dampening=0.5), "Nesterov momentum requires"), (dict(lr=torch.ones(2)), "one-element"),
    (dict(grad_scale=torch.ones(2)), "grad_scale must be None or a one-element tensor"),
])
def test_bad_hyperparameters_are_refused_before_anything_changes(kw, error):
    params, grads, buffers = sgd_lists()
    before = snapshot(params + grads + buffers)
    with pytest.raises((TypeError, ValueError), match=error):
        portable_ops.functional.sgd(params, grads, buffers, **{"momentum": 0.9, "lr": 0.1, **kw})
    assert_bit_identical(before, params + grads + buffers)


def test_the_optimizer_names_the_tensor_the_user_handed_over():
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(4))]
    opt = portable_ops.optim.SGD(params, lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.load_state_dict(opt.state_dict())  # drops the cached lists, as replacing state should
    opt.state[params[1]]["momentum_buffer"] = torch.zeros(5)
    before = snapshot(params) + [opt.state[params[0]]["momentum_buffer"].clone()]
    with pytest.raises(ValueError, match=r'state\[param_groups\[0\]\["params"\]\[1\]\]\["momentum_buffer"\] has '
                                         r'shape \(5,\)'):
        opt.step()
    assert_bit_identical(before, snapshot(params) + [opt.state[params[0]]["momentum_buffer"]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_step_between_forward_and_backward_is_caught_as_torchs(backend, monkeypatch):
    """torch's SGD bumps the params' versions; every backend's writes must, kernels through raw pointers too."""
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")
    device = default_device(backend)
    w = torch.nn.Parameter(torch.randn(4, 4, device=device))
    x = torch.randn(3, 4, device=device, requires_grad=True)
    loss = (x @ w).square().sum()  # saves w for x's gradient
    w.grad = torch.randn_like(w)
    buffers = [torch.zeros_like(w)]
    version = buffers[0]._version
    with portable_ops.use_backend(backend), torch.no_grad():
        portable_ops.functional.sgd([w], [w.grad], buffers, momentum=0.9, lr=0.1)
    assert buffers[0]._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_step_strict_mode_refuses_makes_no_buffer_and_writes_nothing(monkeypatch):
    """The backend is chosen, and may be refused, before the step's new buffers go into the state: a refused
    first step leaves the optimizer as it was, so the next step is a first step again."""
    if "triton" not in usable_backends():
        pytest.skip("triton can't run here")
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")
    device = default_device("triton")
    params = [torch.nn.Parameter(torch.randn(5, dtype=torch.float64, device=device)),
              torch.nn.Parameter(torch.randn(3, device=device))]
    opt = portable_ops.optim.SGD(params, lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.randn_like(p)
    before = snapshot(params)
    with portable_ops.use_backend("triton"), pytest.raises(portable_ops.BackendUnavailableError, match="float64"):
        opt.step()
    assert_bit_identical(before, params)
    assert len(opt.state) == 0
    with portable_ops.use_backend("reference"):  # on CUDA, unforced, strict mode would refuse triton's fallback
        opt.step()  # the first step makes the buffers from these grads
    for p in params:
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], p.grad)
