import math

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
    torch.testing.assert_close(total, torch.linalg.vector_norm(torch.cat(grads)))
