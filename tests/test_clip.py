import math

import numpy as np
import pytest
import torch

import portable_ops


def params_with_grads(shapes=((3, 4), (7,), (1,)), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype))
        p.grad = torch.randn(s, generator=g, dtype=dtype) * 5
        params.append(p)
    return params


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.1, 1e9])
def test_matches_torch(norm_type, max_norm):
    ours, theirs = params_with_grads(), params_with_grads()
    total_o = portable_ops.clip_grad_norm_(ours, max_norm, norm_type)
    total_t = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    assert isinstance(total_o, torch.Tensor) and total_o.dim() == 0
    torch.testing.assert_close(total_o, total_t)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("max_norm", [torch.tensor([0.1]), torch.tensor(0.1, dtype=torch.float64), np.float32(0.1),
                                      np.array(0.1)], ids=["tensor_of_shape_1", "float64_0d_tensor", "np_float32",
                                                           "0d_array"])
def test_max_norm_is_read_as_torch_reads_it(max_norm):
    """torch takes ``float(max_norm)``: a one-element tensor clips as the number it holds (a ``[1]`` tensor raised a
    raw 'scalar tensor expected to be 0 dim' from the multiply)."""
    ours, theirs = params_with_grads(), params_with_grads()
    total = portable_ops.clip_grad_norm_(ours, max_norm)
    torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert total.shape == () and total.dtype == torch.float32
    for a, b in zip(ours, theirs):
        assert a.grad.dtype == b.grad.dtype
        torch.testing.assert_close(a.grad, b.grad)


def test_single_tensor_and_params_without_grad():
    p = params_with_grads()[0]
    no_grad = torch.nn.Parameter(torch.zeros(3))
    expected = p.grad.norm()
    total = portable_ops.clip_grad_norm_(p, 1.0)  # a bare tensor, as torch accepts
    torch.testing.assert_close(total, expected)
    torch.testing.assert_close(p.grad.norm(), torch.tensor(1.0), rtol=1e-5, atol=1e-5)
    assert portable_ops.clip_grad_norm_([no_grad], 1.0).item() == 0.0


def test_error_if_nonfinite_raises_and_leaves_grads():
    params = params_with_grads()
    params[1].grad[0] = math.nan
    before = [p.grad.clone() for p in params]
    with pytest.raises(RuntimeError, match="non-finite"):
        portable_ops.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    for p, b in zip(params, before):
        assert torch.equal(p.grad.nan_to_num(), b.nan_to_num())


def test_bf16_grads_norm_is_float32():
    params = params_with_grads(dtype=torch.bfloat16)
    total = portable_ops.clip_grad_norm_(params, 1.0)
    assert total.dtype == torch.float32
    grads = [p.grad.float().flatten() for p in params_with_grads(dtype=torch.bfloat16)]
    exact = torch.linalg.vector_norm(torch.cat(grads))
    # the reference rounds each grad's norm to bfloat16 once, as torch does (docs/api.md): 2^-9 relative at most
    torch.testing.assert_close(total, exact, atol=0, rtol=2.0**-9)


# ----------------------------------------------------------------------------- non-finite grads

from portable_ops.conformance.runner import default_device, usable_backends  # noqa: E402


def grads_holding(value, where, dtype, device):
    """Three grads (one spans several chunks of every backend's launch) with ``value`` at ``where``
    (tensor, index): a first element, one deep in a later chunk, a tensor's last element."""
    g = torch.Generator().manual_seed(3)
    params = []
    for n in (5, 5000, 130):
        p = torch.nn.Parameter(torch.zeros(n, device=device, dtype=dtype))
        p.grad = torch.randn(n, generator=g).to(device, dtype)
        params.append(p)
    params[where[0]].grad[where[1]] = value
    return params


WHERE = [(0, 0), (1, 3071), (2, 129)]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("backend", usable_backends())
def test_a_nan_anywhere_makes_the_norm_nan(backend, norm_type, where, monkeypatch):
    """Triton's max returns the other operand of a NaN: the inf-norm came out finite, so a loop that
    skips steps on a non-finite norm went on, and error_if_nonfinite did not raise."""
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")
    params = grads_holding(math.nan, where, torch.float32, default_device(backend))
    with portable_ops.use_backend(backend):
        assert portable_ops.clip_grad_norm_(params, 1.0, norm_type).isnan()
        with pytest.raises(RuntimeError, match="non-finite"):
            portable_ops.clip_grad_norm_(params, 1.0, norm_type, error_if_nonfinite=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", usable_backends())
def test_non_finite_grads_give_torchs_norm(backend, dtype, monkeypatch):
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")
    device = default_device(backend)
    for value in (math.nan, math.inf, -math.inf):
        for norm_type in (2.0, math.inf):
            params = grads_holding(value, WHERE[1], dtype, device)
            expected = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
            with portable_ops.use_backend(backend):
                got = total_norm_of(params, norm_type)
            torch.testing.assert_close(got.cpu(), expected.float().cpu(), equal_nan=True)


def total_norm_of(params, norm_type):
    return portable_ops.clip.total_norm([p.grad for p in params], norm_type)


@pytest.mark.parametrize("backend", usable_backends())
def test_the_fused_clip_of_a_nan_grad_reports_a_nan_norm(backend, monkeypatch):
    """``max_grad_norm``: the norm is NaN (``last_grad_norm``), and the step writes NaN as torch's clip + step does."""
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")
    params = grads_holding(math.nan, WHERE[1], torch.float32, default_device(backend))
    opt = portable_ops.optim.AdamW(params, max_grad_norm=1.0)
    with portable_ops.use_backend(backend):
        opt.step()
    assert opt.last_grad_norm.isnan()
    assert all(p.isnan().all() for p in params)


@pytest.mark.parametrize("backend", usable_backends())
def test_zero_size_grads_hold_nothing_to_measure_on_every_backend(backend, monkeypatch):
    """The inf-norm is the largest |g| over every grad's elements; a zero-size grad holds none.
    torch raises there (its per-tensor max has no identity); the kernels skip it, and so does the
    reference, so a model clips the same on every device."""
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")
    device = default_device(backend)
    empty, full = (torch.nn.Parameter(torch.zeros(n, device=device)) for n in (0, 5))
    empty.grad, full.grad = torch.zeros(0, device=device), torch.full((5,), -3.0, device=device)
    with portable_ops.use_backend(backend):
        assert portable_ops.clip_grad_norm_([empty, full], 1.0, math.inf).item() == 3.0
        assert portable_ops.clip_grad_norm_([empty], 1.0, math.inf).item() == 0.0
