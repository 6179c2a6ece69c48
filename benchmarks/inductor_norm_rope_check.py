"""Whether torch.compile (Inductor) calls the norms' and RoPE's Triton kernels from the code it generates, rather
than calling back into portable_ops' custom ops: a 2-layer pre-norm decoder (fused residual RMSNorm, LayerNorm,
RoPE on q and k sliced from one projection and transposed, SDPA) compiled whole, forward and backward.

    python benchmarks/inductor_norm_rope_check.py [--mode reduce-overhead] [--device cuda]

Per precision (float32; bf16 autocast), eager and compiled from the same weights and inputs at two sequence lengths
(marked dynamic): no graph break, one graph, gradients as eager's, and in the generated code (forward and backward)
every kernel of the traced ops and no call of a norm or RoPE op, portable_ops' custom ops or the traced ops left
whole. Exit status 0 only when every check holds. On CUDA the Triton kernels are the check's subject; on the CPU
(the Triton interpreter, ``PORTABLE_OPS_BACKEND=triton``) the traced ops stay custom ops, so there the code checks
fail by design and the rest still runs.
"""

import argparse
import re
import sys

import torch

import portable_ops  # first: on a machine without CUDA it switches Triton's interpreter on before triton loads
import torch._dynamo
import torch._inductor.config
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

KERNELS = ("_norm_fwd_kernel", "_norm_bwd_kernel", "_column_sum_kernel", "_rope_kernel")
# the custom ops, and the traced ops themselves where they were not decomposed into their launches
OPS_CALLED = re.compile(r"torch\.ops\.portable_ops\.(triton_)?(rms_norm|layer_norm|rope)_(fwd|bwd)")
LENGTHS = (100, 164)
D_MODEL, HEADS, KV_HEADS, HEAD_DIM = 256, 4, 2, 64


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.Parameter(1 + torch.randn(D_MODEL) / 8)
        self.ln_weight = nn.Parameter(1 + torch.randn(D_MODEL) / 8)
        self.ln_bias = nn.Parameter(torch.randn(D_MODEL) / 8)
        self.qkv = nn.Linear(D_MODEL, (HEADS + 2 * KV_HEADS) * HEAD_DIM, bias=False)
        self.out = nn.Linear(HEADS * HEAD_DIM, D_MODEL, bias=False)
        self.up, self.down = nn.Linear(D_MODEL, 4 * D_MODEL, bias=False), nn.Linear(4 * D_MODEL, D_MODEL, bias=False)

    def forward(self, x, residual, cos, sin):
        b, s, _ = x.shape
        h, residual = portable_ops.rms_norm(x, self.norm, 1e-6, residual=residual)
        q, k, v = self.qkv(h).view(b, s, HEADS + 2 * KV_HEADS, HEAD_DIM).split([HEADS, KV_HEADS, KV_HEADS], dim=2)
        q, k = portable_ops.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        y = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True, enable_gqa=True)
        h, residual = portable_ops.layer_norm(self.out(y.transpose(1, 2).reshape(b, s, -1)), self.ln_weight,
                                              self.ln_bias, residual=residual)
        return self.down(F.gelu(self.up(h))), residual


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x, cos, sin):
        residual = torch.zeros_like(x)
        for block in self.blocks:
            x, residual = block(x, residual, cos, sin)
        return (x + residual).float().square().mean()


def tables(s, device):
    inv_freq = 10000.0 ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
    angles = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(device), angles.sin().to(device)


def step(model, x, cos, sin, autocast):
    """The loss and the gradients of x and every parameter."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(x, cos, sin)
    return loss, torch.autograd.grad(loss, (x, *model.parameters()))


def relative_error(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def check(device, autocast, mode):
    """The checks of one precision: ``[(what, passed, detail)]``."""
    counters.clear()
    torch.manual_seed(0)
    model = Model().to(device)
    compiled = torch.compile(model, fullgraph=True, mode=mode)
    worst = 0.0
    # compiled afresh, so that Inductor generates the code read here rather than loading it from its caches
    with torch._inductor.config.patch(force_disable_caches=True):
        for s in LENGTHS:
            x = torch.randn(2, s, D_MODEL, device=device, requires_grad=True)
            cos, sin = tables(s, device)
            want = step(model, x, cos, sin, autocast)
            for t, dim in ((x, 1), (cos, 0), (sin, 0)):
                torch._dynamo.mark_dynamic(t, dim)
            if s == LENGTHS[0]:  # run_and_get_code resets dynamo first
                got, sources = run_and_get_code(step, compiled, x, cos, sin, autocast)
                code = "\n".join(sources)
            else:
                got = step(compiled, x, cos, sin, autocast)
            worst = max([worst, relative_error(got[0], want[0])] +
                        [relative_error(a, b) for a, b in zip(got[1], want[1])])
    breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    missing = [k for k in KERNELS if k not in code]
    called = sorted(set(m.group(0) for m in OPS_CALLED.finditer(code)))
    tolerance = 2e-2 if autocast else 1e-4
    return [("no graph break", breaks == 0, f"{breaks} breaks"),
            ("one graph across lengths", graphs == 1, f"{graphs} graphs for lengths {LENGTHS}"),
            ("gradients as eager's", worst <= tolerance, f"largest relative error {worst:.2e} (<= {tolerance:g})"),
            ("generated code launches the kernels", not missing, f"missing {missing}" if missing else "all of them"),
            ("no norm/RoPE op called back", not called, ", ".join(called) or "none")]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--mode", default=None, help="torch.compile's mode, e.g. reduce-overhead (CUDA graphs)")
    args = parser.parse_args()
    device = torch.device(args.device)
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    print(f"torch {torch.__version__}, triton {triton.__version__}, {name}, mode {args.mode}")
    failed = False
    for autocast in (False, True):
        print("bf16 autocast" if autocast else "float32")
        for what, passed, detail in check(device, autocast, args.mode):
            failed |= not passed
            print(f"  {'ok  ' if passed else 'FAIL'} {what}: {detail}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
