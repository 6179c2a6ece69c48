"""Optimizer and clip+step benchmarks on a GPT-2-medium-like list of 292 tensors (354.8M elements): AdamW
against torch's fused and foreach AdamW, SGD with momentum against torch's fused and foreach SGD."""

from __future__ import annotations

import torch

import portable_ops

from .common import copy_bandwidth, graphed, host_ms, median_ms, steady_ms


def bytes_per_element(param_dtype: torch.dtype, state_dtype: torch.dtype, amsgrad: bool) -> int:
    """Param and grad read, param written; exp_avg and exp_avg_sq (and max_exp_avg_sq) read and written."""
    p, s = param_dtype.itemsize, state_dtype.itemsize
    return 3 * p + (6 if amsgrad else 4) * s


def sgd_bytes_per_element(dtype: torch.dtype, momentum: bool) -> int:
    """Param and grad read, param written; under momentum the buffer read and written (in the param's dtype)."""
    return (5 if momentum else 3) * dtype.itemsize


def gpt2_medium_shapes() -> list[tuple[int, ...]]:
    d, vocab, ctx, layers = 1024, 50257, 1024, 24
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def _params(shapes, seed=0, dtype=torch.float32):
    g = torch.Generator(device="cuda").manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g).to(dtype)) for s in shapes]
    for p in params:
        p.grad = (torch.randn(p.shape, device="cuda", generator=g) * 1e-2).to(dtype)
    return params


# (bench, param dtype, amsgrad): fp32 as torch's fused AdamW is usually run, then bf16 params, where
# portable_ops also runs with float32 moments (state_dtype) at the cost of their extra bytes.
OPTIMIZER_BENCHES = [("adamw", torch.float32, False), ("adamw amsgrad", torch.float32, True),
                     ("adamw bf16", torch.bfloat16, False)]


def _optimizer_rows(bench, dtype, amsgrad, shapes, numel, copy) -> list[dict]:
    """One AdamW bench's rows; its parameters (and every optimizer made over them) are freed on return."""
    params = _params(shapes, dtype=dtype)
    lr_tensor = torch.tensor(1e-4, device="cuda")
    # name -> (make, state dtype); graph replay removes host time: what the kernels alone take.
    variants = {
        "torch fused": (lambda: torch.optim.AdamW(params, lr=1e-4, amsgrad=amsgrad, fused=True), dtype),
        "torch foreach": (lambda: torch.optim.AdamW(params, lr=1e-4, amsgrad=amsgrad, foreach=True), dtype),
        "portable_ops": (lambda: portable_ops.optim.AdamW(params, lr=1e-4, amsgrad=amsgrad), dtype),
        "torch fused, graph": (lambda: torch.optim.AdamW(params, lr=lr_tensor, amsgrad=amsgrad, fused=True,
                                                         capturable=True), dtype),
        "portable_ops, graph": (lambda: portable_ops.optim.AdamW(params, lr=lr_tensor, amsgrad=amsgrad), dtype),
    }
    if dtype != torch.float32:
        variants["portable_ops fp32 state, graph"] = (
            lambda: portable_ops.optim.AdamW(params, lr=lr_tensor, amsgrad=amsgrad, state_dtype=torch.float32),
            torch.float32)
    nbytes = {name: bytes_per_element(dtype, state_dtype, amsgrad) * numel
              for name, (_, state_dtype) in variants.items()}
    return _timed_rows(bench, {name: make for name, (make, _) in variants.items()}, nbytes, copy)


# (bench, param dtype): SGD with momentum 0.9, the buffers made on the warm-up steps (a step after the first).
SGD_BENCHES = [("sgd momentum", torch.float32), ("sgd momentum bf16", torch.bfloat16)]


def sgd_variants(params, lr_tensor) -> dict:
    """name -> a function making the optimizer. torch's SGD takes no ``capturable``: its graph row is ours alone."""
    kw = dict(lr=1e-4, momentum=0.9)
    return {
        "torch fused": lambda: torch.optim.SGD(params, fused=True, **kw),
        "torch foreach": lambda: torch.optim.SGD(params, foreach=True, **kw),
        "portable_ops": lambda: portable_ops.optim.SGD(params, **kw),
        "portable_ops, graph": lambda: portable_ops.optim.SGD(params, **dict(kw, lr=lr_tensor)),
    }


def _sgd_rows(bench, dtype, shapes, numel, copy) -> list[dict]:
    """One SGD bench's rows, against torch's fused and foreach SGD; its parameters are freed on return."""
    params = _params(shapes, dtype=dtype)
    variants = sgd_variants(params, torch.tensor(1e-4, device="cuda"))
    nbytes = dict.fromkeys(variants, sgd_bytes_per_element(dtype, momentum=True) * numel)
    return _timed_rows(bench, variants, nbytes, copy)


def _timed_rows(bench, variants, nbytes, copy) -> list[dict]:
    """Time each variant's step (``make()`` builds its optimizer): drained, back to back and host time, or graph
    replay for a variant named ``..., graph``; compared with "torch fused" (its graph row, for a graph row)."""
    rows = []
    times, hosts, steady = {}, {}, {}
    for name, make in variants.items():
        opt = make()
        step = graphed(opt.step) if name.endswith("graph") else opt.step
        times[name] = median_ms(step)
        steady[name] = steady_ms(step)
        hosts[name] = host_ms(opt.step) if not name.endswith("graph") else None
        del opt, step
        torch.cuda.empty_cache()
    for name, ms in times.items():
        base = "torch fused, graph" if name.endswith("graph") else "torch fused"
        rows.append({"bench": bench, "variant": name, "ms": ms, "steady ms": steady[name],
                     "steady vs torch fused": steady[base] / steady[name] if base in steady else None,
                     "host ms": hosts[name], "TB/s": nbytes[name] / (ms * 1e-3) / 1e12,
                     "of copy": nbytes[name] / copy / (ms * 1e-3),
                     "vs torch fused": times[base] / ms if base in times else None})
    return rows


def run_optimizer(benches=OPTIMIZER_BENCHES, sgd_benches=SGD_BENCHES) -> list[dict]:
    shapes = gpt2_medium_shapes()
    numel = sum(torch.Size(s).numel() for s in shapes)
    copy = copy_bandwidth()
    rows = []
    for bench, dtype, amsgrad in benches:
        rows += _optimizer_rows(bench, dtype, amsgrad, shapes, numel, copy)
        torch.cuda.empty_cache()
    for bench, dtype in sgd_benches:
        rows += _sgd_rows(bench, dtype, shapes, numel, copy)
        torch.cuda.empty_cache()
    rows.append({"bench": "copy", "variant": "device copy", "TB/s": copy / 1e12, "tensors": len(shapes),
                 "elements": numel})
    return rows


def run_clip_step(max_norm: float = 1.0) -> list[dict]:
    shapes = gpt2_medium_shapes()
    params = _params(shapes)
    rows = []
    for graph in (False, True):
        lr = torch.tensor(1e-4, device="cuda") if graph else 1e-4
        torch_opt = torch.optim.AdamW(params, lr=lr, fused=True, capturable=graph)

        def torch_pair(torch_opt=torch_opt):
            torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
            torch_opt.step()

        fn = graphed(torch_pair) if graph else torch_pair
        torch_ms, torch_steady = median_ms(fn), steady_ms(fn)
        clip = lambda: torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)  # noqa: E731
        clip_ms = median_ms(graphed(clip) if graph else clip)
        del torch_opt, torch_pair, fn
        torch.cuda.empty_cache()
        ours = portable_ops.optim.AdamW(params, lr=lr, max_grad_norm=max_norm)
        fn = graphed(ours.step) if graph else ours.step
        ours_ms, ours_steady = median_ms(fn), steady_ms(fn)
        norm = lambda: portable_ops.clip.total_norm([p.grad for p in params])  # noqa: E731
        norm_ms = median_ms(graphed(norm) if graph else norm)
        del ours, fn
        torch.cuda.empty_cache()
        suffix = ", graph" if graph else ""
        rows += [
            {"bench": "clip+step", "variant": "torch clip_grad_norm_(foreach) + fused AdamW" + suffix, "ms": torch_ms,
             "steady ms": torch_steady, "clip ms": clip_ms, "vs torch pair": 1.0, "steady vs torch pair": 1.0},
            {"bench": "clip+step", "variant": "portable_ops AdamW(max_grad_norm)" + suffix, "ms": ours_ms,
             "steady ms": ours_steady, "clip ms": norm_ms, "vs torch pair": torch_ms / ours_ms,
             "steady vs torch pair": torch_steady / ours_steady},
        ]
    return rows
