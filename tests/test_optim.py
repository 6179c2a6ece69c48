"""portable_ops.optim against torch.optim: free-running trajectories, checkpoints both ways, AMP, fused clip."""

import copy

import pytest
import torch

import portable_ops


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
    # The grads are read scaled, not rewritten: they still hold the unclipped values.
    assert torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model_o.parameters()])) > 0.05


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
