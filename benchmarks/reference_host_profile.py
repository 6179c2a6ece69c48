"""Where the reference backend's host time goes on CUDA: per-call host time (launch-bound loops) and
drained per-call time for ours and SDPA, a cProfile of ours, and whether the flash aten op takes GQA as it comes.

    python benchmarks/reference_host_profile.py
"""

import cProfile
import io
import pstats
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

import portable_ops


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


def drained_us(fn, n=100):
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[n // 2]


def main():
    dev = "cuda"
    for b, hq, hkv, s, d in ((4, 8, 2, 512, 64), (4, 16, 4, 2048, 128)):
        q = torch.randn(b, hq, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, hkv, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, hkv, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dout = torch.randn_like(q)
        choice = torch._fused_sdp_choice(q, k, v, None, 0.0, True, scale=None, enable_gqa=True)
        print(f"shape B{b} H{hq}/{hkv} S{s} D{d}: SDPA picks {SDPBackend(choice).name}")

        def ours_fwd():
            with torch.no_grad():
                portable_ops.attention(q, k, v, causal=True)

        def sdpa_fwd():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def ours_fb():
            torch.autograd.grad(portable_ops.attention(q, k, v, causal=True), (q, k, v), dout)

        def sdpa_fb():
            torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), (q, k, v),
                                dout)

        def ours_fgrad():
            portable_ops.attention(q, k, v, causal=True)

        def sdpa_fgrad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        with portable_ops.use_backend("reference"):
            for name, fn in (("ours fwd", ours_fwd), ("sdpa fwd", sdpa_fwd), ("ours fwd grad", ours_fgrad),
                             ("sdpa fwd grad", sdpa_fgrad), ("ours fwd+bwd", ours_fb),
                             ("sdpa fwd+bwd", sdpa_fb)):
                print(f"  {name:14s} host {host_us(fn):8.1f} us  drained {drained_us(fn):8.1f} us")
            if s == 512:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(200):
                    ours_fb()
                prof.disable()
                torch.cuda.synchronize()
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(22)
                print(out.getvalue())
        try:
            with torch.no_grad():
                o = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=None)[0]
                ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            print("  flash aten op with GQA heads:", (o - ref).abs().max().item())
        except Exception as exc:  # noqa: BLE001
            print("  flash aten op with GQA heads refused:", str(exc).splitlines()[0][:200])


if __name__ == "__main__":
    main()
