"""The training step's other ops (the norms, RoPE, the head and its loss), each against torch:
``python -m portable_ops.bench ops``.

Every case runs one portable_ops call and the same computation written in torch, eagerly and under
``torch.compile`` (Inductor's fused kernel, torch's best for these ops), on the Llama benchmark's activations
(``portable_ops.bench.train.SHAPES``: tokens = batch * seq, width d_model, bf16 under autocast's rules as the
model has them). Forward alone, and forward plus backward. Times are steady ms (calls enqueued back to back);
``vs compiled`` is compiled torch's time over ours (above 1: ours is faster).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import portable_ops

from .common import steady_ms
from .train import SHAPES

DIRECTIONS = ("fwd", "fwd+bwd")
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Case:
    op: str
    case: str
    inputs: Callable[[torch.device], tuple]  # tensors (those that take gradients require them), then options
    ours: Callable
    torch: Callable


def _rows(shape, device, *widths, grad=True, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    tokens = shape.batch * shape.seq
    return tuple(torch.randn(tokens, w, device=device, dtype=DTYPE, generator=g).requires_grad_(grad) for w in widths)


def _weight(width, device, dtype=DTYPE):
    return (1 + 0.1 * torch.randn(width, device=device, dtype=dtype)).requires_grad_()


def norm_cases(name, shape) -> list[Case]:
    d = shape.d_model

    def rms_inputs(device):
        return (*_rows(shape, device, d), _weight(d, device))

    def residual_inputs(device):
        return (*_rows(shape, device, d, d), _weight(d, device))

    def ln_inputs(device):
        return (*_rows(shape, device, d), _weight(d, device), _weight(d, device))

    def torch_residual(x, r, w):
        h = x + r
        return F.rms_norm(h, (d,), w, 1e-6), h

    return [
        Case("rms_norm", name, rms_inputs, lambda x, w: portable_ops.rms_norm(x, w, 1e-6),
             lambda x, w: F.rms_norm(x, (d,), w, 1e-6)),
        Case("rms_norm + residual", name, residual_inputs,
             lambda x, r, w: portable_ops.rms_norm(x, w, 1e-6, residual=r), torch_residual),
        Case("layer_norm", name, ln_inputs, lambda x, w, b: portable_ops.layer_norm(x, w, b),
             lambda x, w, b: F.layer_norm(x, (d,), w, b)),
    ]


# The train benchmark's shapes with distinct activations (its third has its second's tokens and width)
OPS_SHAPES = {name: SHAPES[name] for name in list(SHAPES)[:2]}


def rope_cases(name, shape) -> list[Case]:
    """q and k transposed out of the model's fused projection, float32 tables (the benchmark model's)."""
    b, s, d = shape.batch, shape.seq, shape.head_dim

    def inputs(device):
        qkv = torch.randn(b, s, shape.heads + 2 * shape.kv_heads, d, device=device, dtype=DTYPE, requires_grad=True)
        q, k = qkv[:, :, :shape.heads].transpose(1, 2), qkv[:, :, shape.heads:-shape.kv_heads].transpose(1, 2)
        angles = torch.outer(torch.arange(s, device=device, dtype=torch.float32),
                             torch.rand(d // 2, device=device))
        angles = torch.cat([angles, angles], dim=-1)
        return q, k, angles.cos(), angles.sin()

    def transformers_rope(q, k, cos, sin):  # transformers' apply_rotary_pos_emb, its tables cast to q's dtype
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)

        def rotate_half(x):
            return torch.cat([-x[..., d // 2:], x[..., :d // 2]], dim=-1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    return [Case("rope", name, inputs, portable_ops.rope, transformers_rope)]


def cross_entropy_cases(name, shape) -> list[Case]:
    """The model's head and loss over its tokens: hidden and weight in bf16 (as autocast hands them)."""
    def inputs(device):
        hidden, = _rows(shape, device, shape.d_model)
        weight = (0.02 * torch.randn(shape.vocab, shape.d_model, device=device, dtype=DTYPE)).requires_grad_()
        target = torch.randint(0, shape.vocab, (hidden.shape[0],), device=device)
        return hidden, weight, target

    def torch_loss(hidden, weight, target):
        return F.cross_entropy(F.linear(hidden, weight).float(), target)

    return [Case("linear_cross_entropy", name, inputs, portable_ops.linear_cross_entropy, torch_loss)]


def cases(shapes=OPS_SHAPES) -> list[Case]:
    return [case for name, shape in shapes.items()
            for case in norm_cases(name, shape) + rope_cases(name, shape) + cross_entropy_cases(name, shape)]


def _outputs(result):
    return result if isinstance(result, tuple) else (result,)


def _timed(fn, inputs, direction):
    tensors = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if direction == "fwd":
        def call():
            with torch.no_grad():
                fn(*inputs)
        return call
    grads = [torch.randn_like(o) for o in _outputs(fn(*inputs))]

    def call():
        outs = _outputs(fn(*inputs))
        torch.autograd.grad(outs, tensors, grads)
    return call


def _max_abs_diff(case, inputs) -> float:
    with torch.no_grad():
        return max((a.float() - b.float()).abs().max().item()
                   for a, b in zip(_outputs(case.ours(*inputs)), _outputs(case.torch(*inputs))))


def _cpu_ms(fn, warmup: int = 1, iters: int = 3) -> float:
    for _ in range(warmup):
        fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) * 1e3 / iters


def run_ops(shapes=OPS_SHAPES, device="cuda") -> list[dict]:
    device = torch.device(device)
    timer = steady_ms if device.type == "cuda" else _cpu_ms
    rows = []
    for case in cases(shapes):
        inputs = case.inputs(device)
        compiled = torch.compile(case.torch, dynamic=False)
        diff = _max_abs_diff(case, inputs)
        for direction in DIRECTIONS:
            times = {variant: timer(_timed(fn, inputs, direction))
                     for variant, fn in (("ours", case.ours), ("torch", case.torch), ("compiled", compiled))}
            rows.append({"op": case.op, "case": case.case, "dtype": "bf16", "dir": direction,
                         "ours ms": times["ours"], "torch ms": times["torch"], "compiled ms": times["compiled"],
                         "vs torch": times["torch"] / times["ours"], "vs compiled": times["compiled"] / times["ours"],
                         "max abs diff": diff})
    return rows
