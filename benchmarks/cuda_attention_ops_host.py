"""Host time per call of the aten attention ops the reference backend calls on CUDA, against SDPA's own call.

    python benchmarks/cuda_attention_ops_host.py
"""

import time

import torch
import torch.nn.functional as F

aten = torch.ops.aten


def host_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    return host


def main():
    b, hq, hkv, s, d = 4, 8, 2, 512, 64
    q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16)
    kr, vr = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    out, lse, *_ = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)
    dout = torch.randn_like(out)
    seed = torch.empty(0, dtype=torch.int64, device="cuda")
    flash = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)
    rng, unused = torch.empty(2, dtype=torch.uint64, device="cuda"), torch.empty((), dtype=torch.uint64, device="cuda")
    cases = {
        "F.sdpa gqa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        "F.sdpa repeated": lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True),
        "cudnn gqa lse": lambda: aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False),
        "cudnn gqa nolse": lambda: aten._scaled_dot_product_cudnn_attention(q, k, v, None, False, 0.0, True, False),
        "cudnn repeated lse": lambda: aten._scaled_dot_product_cudnn_attention(q, kr, vr, None, True, 0.0, True, False),
        "cudnn gqa lse .default": lambda: aten._scaled_dot_product_cudnn_attention.default(q, k, v, None, True, 0.0,
                                                                                         True, False),
        "cudnn bwd gqa": lambda: aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse, seed, seed, None, None, None, s, s, 0.0, True),
        "flash gqa": lambda: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False),
        "flash bwd gqa": lambda: aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, flash[0], flash[1], None, None, s, s, 0.0, True, rng, unused),
        "torch.empty": lambda: torch.empty(0, device="cuda"),
        "fused_sdp_choice": lambda: torch._fused_sdp_choice(q, k, v, None, 0.0, True, enable_gqa=True),
    }
    with torch.no_grad():
        for name, fn in cases.items():
            try:
                print(f"{name:24s} {host_us(fn):7.1f} us")
            except Exception as exc:  # noqa: BLE001
                print(f"{name:24s} failed: {str(exc).splitlines()[0][:150]}")


if __name__ == "__main__":
    main()
