"""Host time of eager ``portable_ops.rope`` calls on a GPU, profiled (cProfile), beside ``rms_norm``'s.

``python benchmarks/rope_host_profile.py`` (a GPU; seconds).
"""

import cProfile
import pstats
import time

import torch

import portable_ops


def main():
    b, s, hq, hk, d = 2, 4096, 16, 8, 128
    qkv = torch.randn(b, s, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16)
    q, k, _ = qkv.view(b, s, hq + 2 * hk, d).split([hq, hk, hk], 2)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos = sin = torch.randn(1, s, d, device="cuda")
    x = torch.randn(b * s, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, device="cuda")
    with torch.no_grad():
        for name, call in (("rope", lambda: portable_ops.rope(q, k, cos, sin)),
                           ("rms_norm", lambda: portable_ops.rms_norm(x, w)),
                           ("empty_like x2", lambda: (torch.empty_like(q), torch.empty_like(k)))):
            for _ in range(50):
                call()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(500):
                call()
            host = (time.perf_counter() - start) / 500 * 1e6
            torch.cuda.synchronize()
            print(f"{name}: {host:.1f} us of host time a call")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(500):
            portable_ops.rope(q, k, cos, sin)
        profile.disable()
        torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
