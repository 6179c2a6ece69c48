"""``python -m portable_ops.bench nki``: the NKI kernels' estimated time on Trn2 and Trn3 beside their floors.

Rows: the AdamW step over the optimizer bench's 292-tensor GPT-2-medium list (fp32, AMSGrad,
bf16 params with fp32 state), the SGD step over it (momentum fp32 and bf16; Nesterov with weight
decay bf16), the global 2-norm of its grads (the clip: the clip coefficient itself is fused into
the step), attention forward and backward at S=4096, D=128, bf16, RMSNorm (with the fused residual
add) and LayerNorm forward and backward over 4096 rows of 4096, bf16, RoPE forward (its backward and rope_ are the
same kernel) of q and k at B=1, 32/8 heads, S=4096, D=128, bf16 with float32 tables, and linear cross-entropy's rows
kernel on one chunk of tokens with their gradients, bf16, at Llama 3's vocab and at Gemma 2's with its softcap (the
chunk's matmuls are the host's, torch's, and not counted: the floor is the kernel's, one read of the logits and one
write of their gradient), and a decode step of paged attention, bf16, B=32 sequences of 4096 keys in pages of 16:
32/8 heads of D=128, and DeepSeek's absorbed MLA (128 query heads over one KV head, k 576 and v 512 wide; the API
takes v's cache apart, so the floor reads both).

How: each kernel runs in the project's NKI emulator in count-only mode (``meta`` tensors: every
instruction is checked and traced, no arithmetic, no memory), through the same host code a
training step uses; ``backends/nki/emulator/cost.py`` prices each instruction from AWS's
documented rates and schedules the trace (engines in program order, waiting on the tiles they
read) into the time on the NeuronCores a launch runs on: every time here is per NeuronCore, and
``cores`` says how many a launch uses (LNC=2 launches use 2, side by side). Attention is counted for
one (batch, head) and multiplied by B * H: every head runs the same instructions, one after another
on the core. The floor is the core's DMA time for the bytes the operation must move, or its Tensor
Engine time for the FLOPs it must do, over the launch's cores.

On a Trainium host (torch-neuronx, the Neuron SDK and a ``neuron`` device present) the same operations are also
timed on the device, so the estimate meets a measurement; the counting then runs in a child
process under the emulator (``PORTABLE_OPS_NKI_EMULATOR=1``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

from portable_ops import lm_head
from portable_ops.backends.nki import compat
from portable_ops.backends.nki.emulator import cost

from .common import table, write
from .optimizer import bytes_per_element, gpt2_medium_shapes, sgd_bytes_per_element

COLUMNS = ["kernel", "launches", "cores", "instructions t/v/s/g/dma", "HBM GB", "SBUF KiB", "PSUM banks",
           "Trn2 ms", "Trn2 floor ms", "Trn2 x floor", "Trn2 bound", "Trn3 ms", "Trn3 floor ms", "Trn3 x floor",
           "Trn3 bound", "measured ms"]
F32, BF16 = torch.float32, torch.bfloat16
OPTIMIZER = [("AdamW fp32", F32, F32, False), ("AdamW AMSGrad fp32", F32, F32, True),
             ("AdamW bf16 params, fp32 state", BF16, F32, False)]
# (name, param dtype, options): the buffers exist (a step after the first), torch's usual momentum
SGD_ROWS = [("SGD momentum fp32", F32, dict(momentum=0.9)), ("SGD momentum bf16", BF16, dict(momentum=0.9)),
            ("SGD Nesterov weight decay bf16", BF16, dict(momentum=0.9, nesterov=True, weight_decay=0.01))]
ATTENTION = dict(B=1, H=16, S=4096, D=128)
NORM = dict(M=4096, D=4096)  # rows x hidden size: a 4096-token batch of a 4096-wide model, bf16
# (model, vocab, hidden size, final-logit softcap)
CROSS_ENTROPY = [("Llama 3", 128256, 4096, None), ("Gemma 2", 256000, 2304, 30.0)]
# (label, B, Hq, Hkv, keys per sequence, page size, D, Dv): one decode token per sequence, bf16
PAGED = [("GQA", 32, 32, 8, 4096, 16, 128, 128), ("absorbed MLA", 32, 128, 1, 4096, 16, 576, 512)]
ROPE = dict(B=1, Hq=32, Hk=8, S=4096, D=128)  # a Llama-3-8B layer's q and k at 4096 tokens, bf16; float32 tables
ADAMW = dict(beta1=0.9, beta2=0.999, lr=1e-4, weight_decay=0.01, eps=1e-8, maximize=False,
             decoupled_weight_decay=True)


def _ops():
    from portable_ops.backends import nki
    return nki.BACKEND.ops


def _optimizer_state(dtype, state_dtype, amsgrad, device):
    shapes = gpt2_medium_shapes()
    params, grads = ([torch.zeros(s, dtype=dtype, device=device) for s in shapes] for _ in range(2))
    moments = [[torch.zeros(s, dtype=state_dtype, device=device) for s in shapes] for _ in range(3 if amsgrad else 2)]
    steps = [torch.zeros((), device=device) for _ in shapes]
    return params, grads, moments[0], moments[1], moments[2] if amsgrad else [], steps


def _workloads(device):
    """(name, run, floor) per row: ``run()`` launches the kernels on ``device``; ``floor`` is
    (bytes, flops) the operation must move / do, and ``scale`` the count multiplier."""
    numel = sum(torch.Size(s).numel() for s in gpt2_medium_shapes())
    rows = []
    for name, dtype, state_dtype, amsgrad in OPTIMIZER:
        state = _optimizer_state(dtype, state_dtype, amsgrad, device)
        rows.append((f"{name}, 292 tensors / {numel / 1e6:.1f}M", 1,
                     lambda state=state, amsgrad=amsgrad: _ops()["adam"].run(*state, amsgrad=amsgrad, **ADAMW),
                     (bytes_per_element(dtype, state_dtype, amsgrad) * numel, 0)))
    for name, dtype, options in SGD_ROWS:
        params, grads, buffers = ([torch.zeros(s, dtype=dtype, device=device) for s in gpt2_medium_shapes()]
                                  for _ in range(3))
        call = dict(params=params, grads=grads, momentum_buffers=buffers, first_steps=(False,) * len(params),
                    lr=1e-2, dampening=0.0, maximize=False, **{"nesterov": False, "weight_decay": 0.0, **options})
        rows.append((f"{name}, 292 tensors / {numel / 1e6:.1f}M", 1, lambda call=call: _ops()["sgd"].run(**call),
                     (sgd_bytes_per_element(dtype, True) * numel, 0)))
    grads = [torch.zeros(s, device=device) for s in gpt2_medium_shapes()]
    rows.append((f"clip: global 2-norm fp32, 292 grads / {numel / 1e6:.1f}M", 1,
                 lambda: _ops()["grad_norm"].run(grads=grads, norm_type=2.0), (4 * numel, 0)))
    B, H, S, D = ATTENTION.values()
    q, k, v, o, do = (torch.zeros(1, 1, S, D, dtype=BF16, device=device) for _ in range(5))
    lse = torch.zeros(1, 1, S, device=device)
    for causal in (False, True):
        flops = 4 * S * S * D * (0.5 if causal else 1.0)  # per head, the FLOPs attention must do
        label = f"attention {'causal' if causal else 'full'} bf16 B={B} H={H} S={S} D={D}"
        call = dict(q=q, k=k, v=v, causal=causal, scale=D ** -0.5)
        rows.append((f"{label} fwd", B * H, lambda call=call: _ops()["attention_fwd"].run(**call),
                     (4 * S * D * 2 * B * H, flops * B * H)))
        rows.append((f"{label} bwd", B * H,
                     lambda call=call: _ops()["attention_bwd"].run(out=o, lse=lse, dout=do, **call),
                     (8 * S * D * 2 * B * H, 2.5 * flops * B * H)))
    m, d = NORM.values()
    x, residual, dout = (torch.zeros(m, d, dtype=BF16, device=device) for _ in range(3))
    weight, bias = torch.zeros(d, dtype=BF16, device=device), torch.zeros(d, dtype=BF16, device=device)
    stats = torch.zeros(m, device=device)
    moved = m * d * 2  # bytes of one bf16 [M, D] tensor
    rows += [
        (f"RMSNorm + residual fwd bf16 M={m} D={d}", 1,
         lambda: _ops()["rms_norm_fwd"].run(x=x, residual=residual, weight=weight, eps=1e-6), (4 * moved, 0)),
        (f"RMSNorm bwd bf16 M={m} D={d}", 1,
         lambda: _ops()["rms_norm_bwd"].run(x=x, weight=weight, rstd=stats, dout=dout, dh=None), (3 * moved, 0)),
        (f"LayerNorm fwd bf16 M={m} D={d}", 1,
         lambda: _ops()["layer_norm_fwd"].run(x=x, residual=None, weight=weight, bias=bias, eps=1e-5),
         (2 * moved, 0)),
        (f"LayerNorm bwd bf16 M={m} D={d}", 1,
         lambda: _ops()["layer_norm_bwd"].run(x=x, weight=weight, mean=stats, rstd=stats, dout=dout, dh=None,
                                              has_bias=True), (3 * moved, 0)),
    ]
    for model, v, h, softcap in CROSS_ENTROPY:
        c = lm_head.chunk_tokens(v)
        call = dict(hidden=torch.zeros(c, h, dtype=BF16, device=device), weight=torch.zeros(v, h, dtype=BF16,
                                                                                           device=device),
                    bias=None, target=torch.zeros(c, dtype=torch.int64, device=device), ignore_index=-100,
                    label_smoothing=0.0, reduction="mean", softcap=softcap, hidden_grad=True, weight_grad=True,
                    bias_grad=False)
        capped = "" if softcap is None else f" softcap {softcap:g}"
        rows.append((f"linear cross-entropy rows + grad bf16 {model} V={v}{capped}, one chunk of {c} tokens", 1,
                     lambda call=call: _ops()["linear_cross_entropy_fwd"].run(**call), (2 * c * v * 2, 0)))
    b, hq, hk, s, d = ROPE.values()
    q, k = torch.zeros(b, hq, s, d, dtype=BF16, device=device), torch.zeros(b, hk, s, d, dtype=BF16, device=device)
    cos = sin = torch.zeros(1, s, d, device=device)
    rows.append((f"RoPE fwd bf16 B={b} H={hq}/{hk} S={s} D={d}, float32 tables", 1,
                 lambda: _ops()["rope_fwd"].run(q=q, k=k, cos=cos, sin=sin, interleaved=False),
                 (2 * 2 * (q.numel() + k.numel()) + 2 * 4 * cos.numel(), 0)))  # q, k read and written; the tables
    for label, b, hq, hkv, keys, page, d, dv in PAGED:
        pages = keys // page
        call = dict(q=torch.zeros(b, 1, hq, d, dtype=BF16, device=device),
                    k_cache=torch.zeros(b * pages, page, hkv, d, dtype=BF16, device=device),
                    v_cache=torch.zeros(b * pages, page, hkv, dv, dtype=BF16, device=device),
                    block_table=torch.arange(b * pages, dtype=torch.int32, device=device).view(b, pages),
                    cache_seqlens=torch.full((b,), keys, dtype=torch.int32, device=device), scale=d ** -0.5)
        moved = 2 * b * (keys * hkv * (d + dv) + hq * (d + dv))  # the caches read once, q read, out written
        rows.append((f"paged decode {label} bf16 B={b} H={hq}/{hkv} keys={keys} page={page} D={d}/{dv}", 1,
                     lambda call=call: _ops()["paged_attention"].run(**call), (moved, 2 * b * hq * keys * (d + dv))))
    return rows


def count() -> list[dict]:
    """Count every workload in the emulator (count-only) and price it on each machine."""
    from portable_ops.backends.nki import emulator
    rows = []
    for name, scale, run, (nbytes, flops) in _workloads("meta"):
        with emulator.count_only(), emulator.count_instructions() as stats:
            run()
        n = stats.instructions
        row = {"kernel": name, "launches": stats.launches, "cores": stats.cores,
               "instructions t/v/s/g/dma": "/".join(str(n[e] * scale) for e in cost.ENGINES),
               "HBM GB": stats.hbm_bytes * scale / 1e9, "SBUF KiB": stats.sbuf_peak_bytes / 1024,
               "PSUM banks": stats.psum_peak_banks, "counts": {**stats.as_dict(), "scale": scale}}
        for machine in cost.MACHINES:
            est = cost.estimate(stats, machine)
            ms = est.core_seconds * scale * 1e3
            floor = max(nbytes / machine.core_bytes_per_s, flops / machine.tensor_flops_bf16) / est.cores * 1e3
            row.update({f"{machine.name} ms": ms, f"{machine.name} floor ms": floor,
                        f"{machine.name} x floor": ms / floor, f"{machine.name} bound": est.bound,
                        f"{machine.name} engine ms": {e: s * scale * 1e3 for e, s in est.seconds.items()}})
        rows.append(row)
    return rows


def _trainium_device():
    """The ``neuron`` device where torch-neuronx, the Neuron SDK and a NeuronCore are present, else None."""
    from portable_ops import dispatch
    if not compat.USING_TORCH_NEURONX or not dispatch.device_present("neuron"):
        return None
    return torch.device("neuron")


def measure(device, iters: int = 10) -> list[float]:
    """Wall ms per call of each workload on the neuron device (after a warm-up that compiles)."""
    times = []
    for _, _, run, _ in _workloads(device):
        for _ in range(2):
            run()
        torch.neuron.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            run()
        torch.neuron.synchronize()
        times.append((time.perf_counter() - start) / iters * 1e3)
    return times


def run(out_dir: str = "docs/perf") -> int:
    if compat.MODE == "emulator":
        rows = count()
    else:  # the kernels are bound to the real SDK here: count them in a child running the emulator
        env = dict(os.environ, PORTABLE_OPS_NKI_EMULATOR="1")
        child = subprocess.run([sys.executable, "-c", "import json, portable_ops.bench.nki as b; "
                                "print(json.dumps(b.count()))"], env=env, capture_output=True, text=True, check=True)
        rows = json.loads(child.stdout.splitlines()[-1])
    device = _trainium_device()
    if device is not None:
        for row, ms in zip(rows, measure(device)):
            row["measured ms"] = ms
    info = {"device": "estimate per NeuronCore (cost model over emulator traces)"
                      f"{'' if device is None else '; measured on ' + str(device)}",
            "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "nki": compat.MODE}
    path = write("nki", rows, info, out_dir)
    print(table(rows, COLUMNS))
    print(f"{info['device']}, {info['date']}, torch {info['torch']}; wrote {path}")
    return 0
