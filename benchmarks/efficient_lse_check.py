"""How the memory-efficient kernel's aten backward wants its log-sum-exp: the forward's own tensor against the
ways the reference backend could hand back a [B, H, Sq] one.

    python benchmarks/efficient_lse_check.py
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

aten = torch.ops.aten


def main():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for b, h, s, d in ((2, 4, 257, 128), (2, 4, 256, 128), (2, 4, 100, 64), (1, 2, 1000, 64)):
            torch.manual_seed(0)
            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
            dout = torch.randn(b, h, s, d, device="cuda", dtype=dtype)
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                ref = F.scaled_dot_product_attention(q, k, v)
            expected = torch.autograd.grad(ref, (q, k, v), dout)
            with torch.no_grad():
                out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False)
            row = []
            padded = lse.new_full(lse.shape[:-1] + (-(-s // 32) * 32,), float("inf"))
            padded[..., :s] = lse[..., :s]
            variants = {"raw": lse, "sliced contiguous": lse[..., :s].contiguous(),
                        "padded32 sliced": padded[..., :s], "padded32 whole": padded}
            for name, lse_v in variants.items():
                try:
                    grads = aten._scaled_dot_product_efficient_attention_backward(
                        dout, q, k, v, None, out, lse_v, seed, offset, 0.0, [True, True, True, False], False)[:3]
                    err = max(((g.float() - e.float()).abs().max() / e.float().abs().max()).item()
                              for g, e in zip(grads, expected))
                    row.append(f"{name}: {err:.1e}")
                except Exception as exc:  # noqa: BLE001
                    row.append(f"{name}: refused ({str(exc).splitlines()[0][:60]})")
            print(f"{str(dtype):15s} {b, h, s, d} lse {tuple(lse.shape)} seed {tuple(seed.shape)} | " + " | ".join(row))


if __name__ == "__main__":
    main()
