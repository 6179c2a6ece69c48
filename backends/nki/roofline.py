"""Roofline estimates for the NKI kernels on one Trn2 NeuronCore, beside the emulator's counts.

``python -m portable_ops.backends.nki.roofline`` prints the table in docs/backends/nki.md.
Figures (per NeuronCore-v3; a Trn2 device has 8):

* HBM: 2.9 TB/s per device (nki/arch/trainium2_arch.html; 3 TB/s in the 2.29 source) / 8 cores
  = 0.36 TB/s per core.
* Tensor Engine: 79 TFLOP/s BF16/FP16, 20 TFLOP/s FP32 dense (trainium2_arch.rst).
* Vector Engine: 0.96 GHz x 256 elements/cycle (fp32; 512 for bf16/fp16), Scalar Engine:
  1.2 GHz x 128 elements/cycle (trainium2_arch.rst, "Compute Engine Specifications").

Engine time is estimated from the emulator's per-engine "free elements per partition" (each
instruction streams one element per partition per lane-cycle): cycles ~ elements / (lanes/128),
plus a fixed ~64-cycle issue overhead per instruction (the docs' MIN_II). Lower bounds only.
"""

from __future__ import annotations

import torch

from . import emulator
from .adam import adam_kernel, hyperparameters
from .attention import attention_bwd_kernel, attention_fwd_kernel
from .grad_norm import norm_partials_kernel

HBM_BYTES_PER_S = 2.9e12 / 8
TENSOR_FLOPS = {"bf16": 79e12, "fp32": 20e12}
VECTOR_ELEMS_PER_CYCLE_PER_PARTITION = {"bf16": 512 / 128, "fp32": 256 / 128}
VECTOR_HZ, SCALAR_HZ, GPSIMD_HZ = 0.96e9, 1.2e9, 1.2e9
MIN_II = 64


def _engine_seconds(stats, kind):
    el, n = stats.elements, stats.instructions
    return {
        "vector": (el["vector"] / VECTOR_ELEMS_PER_CYCLE_PER_PARTITION[kind] + MIN_II * n["vector"]) / VECTOR_HZ,
        "scalar": (el["scalar"] + MIN_II * n["scalar"]) / SCALAR_HZ,
        "gpsimd": (el["gpsimd"] + MIN_II * n["gpsimd"]) / GPSIMD_HZ,
    }


def measure():
    rows = []
    n = 128 * 8192  # 1,048,576 fp32 parameters
    p = torch.randn(128, n // 128)
    hp = hyperparameters(torch.tensor(0.0), device=p.device, beta1=0.9, beta2=0.999, lr=1e-3, weight_decay=0.01,
                         eps=1e-8, maximize=False, decoupled_weight_decay=True, grad_scale=None, found_inf=None,
                         clip_coef=None)
    with emulator.count_instructions() as s:
        adam_kernel(p, p, p.abs(), p.abs(), p.abs(), hp, amsgrad=False, decay_mode=2, gated=False, scale_grad=False)
    rows.append(("AdamW fp32, 1,048,576 params ([128, 8192])", s, "fp32", 0))
    with emulator.count_instructions() as s:
        norm_partials_kernel(p)
    rows.append(("grad norm phase 1, fp32, 1,048,576 elements", s, "fp32", 0))
    B, H, S = 1, 4, 512
    for D in (128, 256):  # 256: two chunks of 128 partitions per Q K^T / dO V^T contraction
        q, k, v = (torch.randn(B, H, S, D).bfloat16() for _ in range(3))
        with emulator.count_instructions() as s:
            out, lse = attention_fwd_kernel(q, k, v, scale=D ** -0.5, causal=True)
        rows.append((f"attention fwd bf16 causal B={B} H={H} S={S} D={D}", s, "bf16", 2 * 2 * B * H * S * S * D / 2))
        with emulator.count_instructions() as s:
            attention_bwd_kernel(q, k, v, out, lse, q, scale=D ** -0.5, causal=True)
        rows.append((f"attention bwd bf16 causal B={B} H={H} S={S} D={D}", s, "bf16",
                     2.5 * 2 * 2 * B * H * S * S * D / 2))
    return rows


def table() -> str:
    lines = ["| kernel (size) | instructions dma / tensor / vector / scalar / gpsimd | HBM bytes | HBM time | "
             "TensorE time (issued FLOPs) | Vector / Scalar / GpSimd time | bound |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, s, kind, _useful in measure():
        n = s.instructions
        hbm = s.dma_bytes / HBM_BYTES_PER_S
        tens = s.matmul_flops / TENSOR_FLOPS[kind]
        eng = _engine_seconds(s, kind)
        times = {"HBM": hbm, "TensorE": tens, **eng}
        bound = max(times, key=times.get)
        lines.append(
            f"| {name} | {n['dma']} / {n['tensor']} / {n['vector']} / {n['scalar']} / {n['gpsimd']} | "
            f"{s.dma_bytes / 1e6:.1f} MB | {hbm * 1e6:.1f} us | {tens * 1e6:.1f} us ({s.matmul_flops / 1e9:.2f} GFLOP) | "
            f"{eng['vector'] * 1e6:.1f} / {eng['scalar'] * 1e6:.1f} / {eng['gpsimd'] * 1e6:.1f} us | {bound} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
