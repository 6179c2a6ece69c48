"""Which of out's layout and the RNG stand-ins the memory-efficient kernel's aten backward misreads.

    python benchmarks/efficient_layout_check.py
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

aten = torch.ops.aten


def main():
    for dtype in (torch.bfloat16, torch.float32):
        for b, h, s, d in ((2, 4, 257, 128), (2, 4, 256, 64)):
            torch.manual_seed(0)
            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
            dout = torch.randn(b, h, s, d, device="cuda", dtype=dtype)
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                ref = F.scaled_dot_product_attention(q, k, v)
            expected = torch.autograd.grad(ref, (q, k, v), dout)
            with torch.no_grad():
                out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False)
            empty = torch.empty(0, device="cuda")
            row = [f"out strides {out.stride()} seed {seed.dtype}{tuple(seed.shape)}"]
            for out_name, out_v in (("raw out", out), ("contiguous out", out.contiguous())):
                for dout_name, dout_v in (("contiguous dout", dout), ("BSHD dout", dout.transpose(1, 2).contiguous()
                                                                     .transpose(1, 2))):
                    for seed_name, (s_v, o_v) in (("real seed", (seed, offset)), ("empty seed", (empty, empty))):
                        grads = aten._scaled_dot_product_efficient_attention_backward(
                            dout_v, q, k, v, None, out_v, lse, s_v, o_v, 0.0, [True, True, True, False], False)[:3]
                        err = max(((g.float() - e.float()).abs().max() / e.float().abs().max()).item()
                                  for g, e in zip(grads, expected))
                        row.append(f"{out_name}/{dout_name}/{seed_name}: {err:.1e}")
            print(f"{str(dtype):15s} {b, h, s, d}\n   " + "\n   ".join(row))


if __name__ == "__main__":
    main()
