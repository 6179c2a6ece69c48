"""Regressions found by a hostile-user pass over the scaled optimizer steps (a step under a clip or a GradScaler
writes the grads back).

Each test failed before its fix: grads that were overlapping views of one buffer passed the shared-grad check
(only the same start address was refused) and were scaled twice where they overlap; a grad shared by params of two
param groups was clipped (or unscaled) twice, the check looking within a group; the optimizers chose each call's
backend before setting the clip's coefficient in it, so the nki kernels, which decline a non-contiguous grad only
when the step writes the grads, took a clipped one and clipped a copy, leaving the grad as it was; an expanded
grad (its elements sharing memory) under a clip was refused by the reference backend mid-step, after the groups
before it were stepped; the nki kernels took a one-dimensional strided grad they only read as it was (its flat
view is itself), which the emulator refused as no dense HBM view."""

import warnings

import pytest
import torch

import portable_ops
from portable_ops import dispatch, functional
from portable_ops.conformance.runner import default_device, usable_backends

OPTIMIZERS = {"adamw": (portable_ops.optim.AdamW, torch.optim.AdamW), "sgd": (portable_ops.optim.SGD, torch.optim.SGD)}


def _views_of_one_buffer(starts_and_sizes, length=16):
    buffer = torch.linspace(-8, 8, length)
    return buffer, [buffer[start:start + size] for start, size in starts_and_sizes]


@pytest.mark.parametrize("op", ["adam", "sgd"])
def test_grads_that_are_overlapping_views_of_one_buffer_are_refused_before_anything_is_written(op):
    """A scaled step writes each grad once: where two grads overlap, the shared elements would be scaled twice."""
    buffer, grads = _views_of_one_buffer([(0, 8), (6, 8)])
    params = [torch.linspace(-1, 1, 8) for _ in grads]
    before = [t.clone() for t in (buffer, *params)]
    state = ([torch.zeros(8) for _ in grads], [torch.zeros(8) for _ in grads], [], [torch.zeros(()) for _ in grads])
    step = ((lambda: functional.adam(params, grads, *state, lr=0.1, grad_scale=torch.tensor(4.0))) if op == "adam"
            else lambda: functional.sgd(params, grads, [], lr=0.1, grad_scale=torch.tensor(4.0)))
    with portable_ops.use_backend("reference"), pytest.raises(ValueError, match=r"grads\[1\] overlaps grads\[0\]"):
        step()
    assert all(torch.equal(a, b) for a, b in zip(before, (buffer, *params)))


def test_grads_that_are_views_of_one_buffer_apart_step_as_separate_tensors():
    """DDP's gradient buckets: grads that are views of one flat buffer, next to each other (an empty one among
    them), are stepped, and left scaled, as grads of their own memory are."""
    buffer, bucket = _views_of_one_buffer([(0, 6), (6, 0), (6, 10)])
    separate = [g.clone() for g in bucket]
    results = []
    for grads in (bucket, separate):
        params = [torch.linspace(-1, 1, g.numel()) for g in grads]
        with portable_ops.use_backend("reference"):
            functional.sgd(params, grads, [], lr=0.1, grad_scale=torch.tensor(4.0))
        results.append([*params, *grads])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert torch.equal(buffer, torch.cat(separate))


@pytest.mark.parametrize("scaled_by", ["clip", "grad_scale"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_grad_shared_by_params_of_two_groups_is_refused_before_anything_is_written(name, scaled_by):
    params = [torch.nn.Parameter(torch.linspace(-1, 1, 6)) for _ in range(2)]
    shared = torch.linspace(8, -4, 6)
    params[0].grad = params[1].grad = shared
    opt = OPTIMIZERS[name][0]([{"params": [params[0]]}, {"params": [params[1]]}], lr=0.1,
                              max_grad_norm=0.5 if scaled_by == "clip" else None)
    if scaled_by == "grad_scale":
        opt.grad_scale, opt.found_inf = torch.tensor(4.0), torch.tensor(0.0)
    before = [t.clone() for t in (*params, shared)]
    with portable_ops.use_backend("reference"), pytest.raises(
            ValueError, match=r'param_groups\[1\]\["params"\]\[0\]\.grad is param_groups\[0\]\["params"\]\[0\]\.grad'):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, (*params, shared)))
    assert not opt.state


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_an_expanded_grad_of_a_later_group_is_refused_before_the_first_group_is_stepped(name):
    params = [torch.nn.Parameter(torch.linspace(-1, 1, 6)) for _ in range(2)]
    params[0].grad, params[1].grad = torch.linspace(8, -4, 6), torch.full((1,), 2.0).expand(6)
    opt = OPTIMIZERS[name][0]([{"params": [params[0]]}, {"params": [params[1]]}], lr=0.1, max_grad_norm=0.5)
    before = [t.clone() for t in (*params, params[0].grad)]
    with portable_ops.use_backend("reference"), pytest.raises(
            ValueError, match=r'param_groups\[1\]\["params"\]\[0\]\.grad has elements that share memory'):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, (*params, params[0].grad)))
    assert not opt.state


@pytest.mark.parametrize("backend", usable_backends())
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_clipped_step_leaves_a_noncontiguous_grad_clipped_on_every_backend(name, backend, monkeypatch):
    """A backend whose kernels write flat views declines the call (a readable reason) and the reference steps it;
    the grad is left as torch's clip_grad_norm_ leaves it, the params as torch's step after it."""
    monkeypatch.setattr(dispatch, "_warned", set())
    device = default_device(backend)
    g = torch.Generator().manual_seed(0)
    values = [(torch.randn(5, 3, generator=g), 3 * torch.randn(3, 5, generator=g).t()),
              (torch.randn(7, generator=g), 3 * torch.randn(7, generator=g))]
    ours, theirs = ([torch.nn.Parameter(value.to(device)) for value, _ in values] for _ in range(2))
    for params in (ours, theirs):
        for p, (_, grad) in zip(params, values):
            p.grad = grad.to(device).clone(memory_format=torch.preserve_format)
    assert not ours[0].grad.is_contiguous()
    with portable_ops.use_backend(backend), warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        OPTIMIZERS[name][0](ours, lr=0.1, max_grad_norm=0.5).step()
    torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    OPTIMIZERS[name][1](theirs, lr=0.1, foreach=False).step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)
        torch.testing.assert_close(a.detach(), b.detach())
    step_op = "sgd" if name == "sgd" else "adam"
    reasons = [str(w.message) for w in warned if str(w.message).startswith(f"portable_ops.{step_op}:")]
    if backend == "reference":
        assert reasons == []
    else:
        assert len(reasons) == 1 and "can't take this call (grads[0] is not contiguous" in reasons[0]


@pytest.mark.parametrize("backend", usable_backends())
def test_a_one_dimensional_strided_grad_is_read_by_the_norm_and_an_unscaled_step(backend):
    g = torch.Generator().manual_seed(0)
    device = default_device(backend)
    value, grad = torch.randn(6, generator=g).to(device), torch.randn(12, generator=g).to(device)[::2]
    ours, theirs = torch.nn.Parameter(value.clone()), torch.nn.Parameter(value.clone())
    ours.grad, theirs.grad = grad, grad.clone()
    opt = portable_ops.optim.AdamW([ours], lr=0.1, max_grad_norm=float("inf"))
    with portable_ops.use_backend(backend):
        opt.step()
    torch.optim.AdamW([theirs], lr=0.1, foreach=False).step()
    torch.testing.assert_close(opt.last_grad_norm, torch.linalg.vector_norm(grad))
    torch.testing.assert_close(ours.detach(), theirs.detach())
    assert torch.equal(ours.grad, theirs.grad)
