"""Where a transformers training step's time goes, per attention implementation (``bench hf``'s models and
steps): GPU kernel time per step split into attention, optimizer and the rest, and the host's wall time per
step beside it (a step whose wall time exceeds its GPU time waits on the host).

    python benchmarks/hf_profile.py [--families llama,mistral] [--modes eager,compiled]
"""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from portable_ops.bench import hf

ATTENTION = ("attn", "attention", "flash", "fmha", "cudnn", "sdpa", "flex", "fwd_kernel", "bwd_kernel", "dq_kernel",
             "dkdv_kernel", "delta_kernel", "triton_tem")
OPTIMIZER = ("adam", "multi_tensor", "foreach", "_partials_kernel", "_final_kernel", "norm")


def category(name: str) -> str:
    low = name.lower()
    if any(word in low for word in ATTENTION):
        return "attention"
    if any(word in low for word in OPTIMIZER):
        return "optimizer"
    return "rest"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", default="llama,mistral")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda")
    attentions = hf.implementations(device)
    for family in args.families.split(","):
        shape = hf.SHAPES[family]
        weights, data = hf._initial(shape, 8 + args.steps, device)
        for mode in args.modes.split(","):
            torch._dynamo.reset()
            for attention in attentions:
                variant = hf.Variant(shape, attention, mode, weights, data, device, autocast=True)
                for _ in range(8):
                    variant.step()
                torch.cuda.synchronize()
                start = time.perf_counter()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(args.steps):
                        variant.step()
                    torch.cuda.synchronize()
                wall = (time.perf_counter() - start) / args.steps * 1e3
                split = {"attention": 0.0, "optimizer": 0.0, "rest": 0.0}
                top = []
                for event in prof.key_averages():
                    cuda_us = getattr(event, "self_device_time_total", 0) or 0
                    if cuda_us <= 0:
                        continue
                    split[category(event.key)] += cuda_us
                    top.append((cuda_us, event.key))
                gpu = sum(split.values()) / args.steps / 1e3
                print(f"{family:8s} {mode:8s} {attention:15s} wall {wall:7.2f} ms/step  GPU {gpu:7.2f} ms  "
                      + "  ".join(f"{k} {v / args.steps / 1e3:6.2f}" for k, v in split.items()))
                for cuda_us, key in sorted(top, reverse=True)[:6]:
                    print(f"      {cuda_us / args.steps / 1e3:7.3f} ms  {key[:110]}")
                del variant
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
