"""What the triton attention tests share: inputs in the layouts models make, and one call's forward and backward
against the float64 reference (interpreter on CPU, compiled kernels on CUDA)."""

import importlib

import torch

from portable_ops.conformance import GRADIENT_FACTOR, tolerance

attn = importlib.import_module("portable_ops.backends.triton.attention")
ref_attn = importlib.import_module("portable_ops.definitions.attention")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def inputs(b, hq, hkv, sq, skv, d, dtype=torch.float16, seed=0, heads_inner=False):
    """q, k, v ``[B, H, S, D]``; ``heads_inner``: transposed out of ``[B, S, H, D]``, as transformers make them."""
    g = torch.Generator().manual_seed(seed)

    def make(h, s):
        if heads_inner:
            return torch.randn(b, s, h, d, generator=g).to(dtype).to(DEVICE).transpose(1, 2)
        return torch.randn(b, h, s, d, generator=g).to(dtype).to(DEVICE)

    return make(hq, sq), make(hkv, skv), make(hkv, skv)


def check_against_reference(q, k, v, causal, scale, dout=None):
    """Forward and backward of the triton backend against the float64 reference."""
    out, lse = attn.attention_fwd(q, k, v, causal=causal, scale=scale)
    q64, k64, v64 = (t.double().cpu() for t in (q, k, v))
    ref_out, ref_lse = ref_attn.attention_fwd(q64, k64, v64, causal=causal, scale=scale)
    tol = tolerance("attention", q.dtype)
    torch.testing.assert_close(out.double().cpu(), ref_out, **tol._asdict())
    torch.testing.assert_close(lse.double().cpu(), ref_lse, **tol._asdict())
    if dout is None:
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(q.dtype).to(DEVICE)
    grads = attn.attention_bwd(q, k, v, out, lse, dout, causal=causal, scale=scale)
    ref_grads = ref_attn.attention_bwd(q64, k64, v64, ref_out, ref_lse, dout.double().cpu(), causal=causal, scale=scale)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        torch.testing.assert_close(got.double().cpu(), want, **tol.scaled(GRADIENT_FACTOR)._asdict(), msg=name)
    return out, lse, grads
