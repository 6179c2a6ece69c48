"""The reference backend's fast paths against the definitions: layouts torch's kernels don't read as given."""

import pytest
import torch
import torch.nn.functional as F

import portable_ops


def test_adam_on_strided_params_and_grads_matches_torch_and_writes_only_the_param():
    torch.manual_seed(0)
    by_column = lambda t: t.t().contiguous().t()  # noqa: E731
    layouts = [(lambda t: t, by_column), (by_column, lambda t: t), (lambda t: t, lambda g: g[:1, :1].expand(4, 5))]
    for make_param, make_grad in layouts:
        w, g = torch.randn(4, 5), torch.randn(4, 5)
        ours, theirs = (torch.nn.Parameter(make_param(w.clone())) for _ in range(2))
        ours.grad, theirs.grad = make_grad(g.clone()), make_grad(g.clone())
        grad_before = ours.grad.clone()
        with portable_ops.use_backend("reference"):
            portable_ops.optim.AdamW([ours], lr=0.1).step()
        torch.optim.AdamW([theirs], lr=0.1, foreach=False).step()
        torch.testing.assert_close(ours, theirs)
        assert torch.equal(ours.grad, grad_before)
    base = torch.zeros(4, 10)
    param = torch.nn.Parameter(base[:, ::2])
    param.grad = torch.ones(4, 5)
    with portable_ops.use_backend("reference"):
        portable_ops.optim.AdamW([param], lr=0.1, weight_decay=0.0).step()
    assert torch.equal(base[:, 1::2], torch.zeros(4, 5))
    assert (param != 0).all()


def test_attention_with_a_strided_head_dim_matches_sdpa():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 16)[..., ::2].requires_grad_() for _ in range(3))
    with portable_ops.use_backend("reference"):
        out = portable_ops.attention(q, k, v, causal=True)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grads, torch.autograd.grad(expected.sum(), (q, k, v)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel", ["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
def test_cuda_attention_matches_sdpa_under_each_kernel_sdpa_can_pick(kernel, dtype, heads):
    """Each SDPA kernel through its aten ops, GQA as each takes it and out in the layout each backward reads."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    hq, hkv = heads
    q = torch.randn(2, hq, 257, 64, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, hkv, 257, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    with sdpa_kernel(getattr(SDPBackend, kernel)):
        try:
            expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        except RuntimeError:
            pytest.skip(f"SDPA's {kernel} does not take this call here")
        with portable_ops.use_backend("reference"):
            out = portable_ops.attention(q, k, v, causal=True)
            grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, torch.autograd.grad(expected, (q, k, v), dout)):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


# the CPU's kernel, and on CUDA the memory-efficient one (float32), read a KV head once a query head
DECODE_CASES = [("cpu", torch.float32), ("cpu", torch.bfloat16)] + ([("cuda", torch.float32)]
                                                                     if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device, dtype", DECODE_CASES)
@pytest.mark.parametrize("mask", ["causal", "none", "window"])
def test_gqa_decode_runs_each_kv_head_once_for_its_query_heads(device, dtype, mask, monkeypatch):
    """One query of 8 heads over 2 KV heads runs as 4 rows of each KV head ([B, 2, 4, D]), q contiguous or a
    transposed view of a [B, S, H, D] projection: SDPA's result (the window's keys sliced), out in q's layout."""
    from portable_ops.backends.reference import attention as reference_attention

    seen = []
    kernels = reference_attention.FUSED_KERNELS
    kernel = kernels[device]
    def pick(*args):  # the kernel it picks, recording the q its forward is handed
        chosen = kernel.pick(*args)
        return chosen._replace(forward=lambda q, *rest: seen.append(q.shape) or chosen.forward(q, *rest))

    monkeypatch.setitem(kernels, device, kernel._replace(pick=pick))
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(3, 2, 300, 64, generator=g).to(device, dtype) for _ in range(2))
    for q in (torch.randn(3, 8, 1, 64, generator=g), torch.randn(3, 1, 8, 64, generator=g).transpose(1, 2)):
        q = q.to(device, dtype)
        window, keys = ((100, 0), slice(199, 300)) if mask == "window" else (None, slice(0, 300))
        with portable_ops.use_backend("reference"), torch.no_grad():
            out = portable_ops.attention(q, k, v, causal=mask == "causal", window=window)
        expected = F.scaled_dot_product_attention(q, k[:, :, keys].repeat_interleave(4, 1),
                                                  v[:, :, keys].repeat_interleave(4, 1))
        torch.testing.assert_close(out, expected, **({} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))
        assert out.stride() == portable_ops.layout.strides_like(q)
    assert seen and all(shape[1:3] == (2, 4) for shape in seen)
