"""Triton-specific paths the shared suite reaches only through its shapes (interpreter on CPU)."""

import pytest
import torch

import portable_ops
from portable_ops import dispatch

pytestmark = pytest.mark.skipif(dispatch.unavailable_reason("triton") is not None, reason="triton not installed")


def test_decode_splits_keys_across_programs_and_merges_exactly():
    from portable_ops.backends.triton.attention import _blocks, _splits

    block_m, block_n, _ = _blocks(64)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert _splits(1, 2, 1, 1100, block_m, block_n) > 1  # the conformance case takes the split path
    assert _splits(1, 2, block_m + 1, 1100, block_m, block_n) == 1  # prefill does not
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 64, generator=g).to(device)
    k, v = (torch.randn(1, 1, 1100, 64, generator=g).to(device) for _ in range(2))
    for causal in (False, True):
        with portable_ops.use_backend("triton"):
            out = portable_ops.attention(q, k, v, causal=causal)
        with portable_ops.use_backend("reference"):
            ref = portable_ops.attention(q, k, v, causal=causal)
        torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


def test_multi_tensor_tables_are_reused_while_the_tensors_are():
    from portable_ops.backends.triton.multi_tensor import CHUNK, tables

    xs = [torch.zeros(n) for n in (3, 5000)]
    first = tables([xs])
    assert tables([xs]) is first
    assert first.chunks == sum(-(-x.numel() // CHUNK) for x in xs)
    assert tables([[torch.zeros(3), torch.zeros(5000)]]) is not first
