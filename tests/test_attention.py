import pytest
import torch
import torch.nn.functional as F

import portable_ops


def qkv(b=2, hq=4, hkv=2, sq=9, skv=9, d=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda h, s: torch.randn(b, h, s, d, generator=g, dtype=dtype, requires_grad=True)
    return make(hq, sq), make(hkv, skv), make(hkv, skv)


@pytest.mark.parametrize("causal", [False, True])
def test_matches_sdpa_with_gqa(causal):
    q, k, v = qkv(dtype=torch.float32)
    out = portable_ops.attention(q, k, v, causal=causal, scale=0.3)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, ref)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_gradcheck_float64_causal_cross_lengths():
    q, k, v = qkv(b=1, hq=2, hkv=1, sq=3, skv=5, d=4)
    assert torch.autograd.gradcheck(lambda q, k, v: portable_ops.attention(q, k, v, causal=True), (q, k, v))


def test_causal_is_bottom_right_aligned_for_decode():
    q, k, v = qkv(sq=1, skv=12)
    # With one query, bottom-right causal sees every key: same as no mask at all.
    torch.testing.assert_close(portable_ops.attention(q, k, v, causal=True), portable_ops.attention(q, k, v))
    q, k, v = qkv(sq=3, skv=7)
    out = portable_ops.attention(q, k, v, causal=True)
    mask = torch.ones(3, 7, dtype=torch.bool).tril(diagonal=4)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))


def test_rows_that_see_no_key_are_zero_with_zero_gradient():
    q, k, v = qkv(sq=6, skv=2)
    out = portable_ops.attention(q, k, v, causal=True)
    assert torch.equal(out[:, :, :4], torch.zeros_like(out[:, :, :4]))
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert torch.equal(dq[:, :, :4], torch.zeros_like(dq[:, :, :4]))
    assert torch.isfinite(dq).all()


def test_compiles_without_graph_breaks():
    q, k, v = qkv(dtype=torch.float32)

    def step(q, k, v):
        return portable_ops.attention(q, k, v, causal=True).square().sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    ref_grads = torch.autograd.grad(step(q, k, v), (q, k, v))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_custom_ops_pass_torch_library_checks():
    q, k, v = (t.detach().float() for t in qkv())
    torch.library.opcheck(torch.ops.portable_ops.attention_fwd.default, (q, k, v, True, 0.25, "reference"))
