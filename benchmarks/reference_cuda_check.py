"""The reference backend's CUDA attention under each SDPA kernel torch can pick (cuDNN, FlashAttention-2,
memory-efficient), GQA included: forward and gradients against SDPA under the same kernel, and against the
float64 definition.

    python benchmarks/reference_cuda_check.py
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import portable_ops
from portable_ops.definitions import attention as definition


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def main():
    worst = 0.0
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        for dtype in (torch.bfloat16, torch.float16):
            for b, hq, hkv, sq, skv, d, causal in ((2, 8, 2, 300, 300, 64, True), (2, 4, 4, 257, 257, 128, False),
                                                  (1, 8, 1, 1, 777, 80, True), (2, 6, 2, 128, 128, 96, True)):
                torch.manual_seed(0)
                q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype, requires_grad=True)
                k = torch.randn(b, hkv, skv, d, device="cuda", dtype=dtype, requires_grad=True)
                v = torch.randn(b, hkv, skv, d, device="cuda", dtype=dtype, requires_grad=True)
                dout = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype)
                with sdpa_kernel(backend), portable_ops.use_backend("reference"):
                    try:
                        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal and sq == skv,
                                                             enable_gqa=True)
                    except RuntimeError:
                        print(f"{backend.name:20s} {dtype} {b, hq, hkv, sq, skv, d, causal}: SDPA refuses")
                        continue
                    pick = torch._fused_sdp_choice(q, k, v, None, 0.0, causal and sq == skv, enable_gqa=hq != hkv)
                    out = portable_ops.attention(q, k, v, causal=causal)
                    grads = torch.autograd.grad(out, (q, k, v), dout)
                ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
                q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
                o64 = definition.attention_fwd(q64, k64, v64, causal=causal, scale=d ** -0.5)[0]
                g64 = torch.autograd.grad(o64, (q64, k64, v64), dout.double())
                errs = [rel(out, o64)] + [rel(g, e) for g, e in zip(grads, g64)]
                sdpa_errs = [rel(ref, o64)] + [rel(g, e) for g, e in zip(ref_grads, g64)]
                worst = max(worst, max(e / max(s, 1e-3) for e, s in zip(errs, sdpa_errs)))
                print(f"{backend.name:20s} picked {SDPBackend(pick).name:20s} {str(dtype):15s} "
                      f"{b, hq, hkv, sq, skv, d, causal}: ours vs f64 " + " ".join(f"{e:.1e}" for e in errs)
                      + " | sdpa vs f64 " + " ".join(f"{e:.1e}" for e in sdpa_errs))
    print(f"worst ratio of our error to SDPA's (floored at 1e-3): {worst:.2f}")


if __name__ == "__main__":
    main()
