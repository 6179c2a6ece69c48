"""Optimizer and clip+step benchmarks on a GPT-2-medium-like list of 292 tensors (354.8M elements)."""

from __future__ import annotations

import torch

import portable_ops

from .common import copy_bandwidth, graphed, host_ms, median_ms, steady_ms

BYTES_PER_ELEMENT = {False: 28, True: 36}  # fp32 AdamW; AMSGrad adds max_exp_avg_sq read+write


def gpt2_medium_shapes() -> list[tuple[int, ...]]:
    d, vocab, ctx, layers = 1024, 50257, 1024, 24
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def _params(shapes, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=g) * 1e-2
    return params


def run_optimizer(amsgrad_options=(False, True)) -> list[dict]:
    shapes = gpt2_medium_shapes()
    numel = sum(torch.Size(s).numel() for s in shapes)
    copy = copy_bandwidth()
    rows = []
    params = _params(shapes)
    for amsgrad in amsgrad_options:
        floor_ms = BYTES_PER_ELEMENT[amsgrad] * numel / copy * 1e3
        variants = {
            "torch fused": lambda: torch.optim.AdamW(params, lr=1e-4, amsgrad=amsgrad, fused=True),
            "torch foreach": lambda: torch.optim.AdamW(params, lr=1e-4, amsgrad=amsgrad, foreach=True),
            "portable_ops": lambda: portable_ops.optim.AdamW(params, lr=1e-4, amsgrad=amsgrad),
            # Graph replay removes host time: what the kernels alone take.
            "torch fused, graph": lambda: torch.optim.AdamW(params, lr=torch.tensor(1e-4, device="cuda"),
                                                            amsgrad=amsgrad, fused=True, capturable=True),
            "portable_ops, graph": lambda: portable_ops.optim.AdamW(params, lr=torch.tensor(1e-4, device="cuda"),
                                                                    amsgrad=amsgrad),
        }
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
            baseline = times[base]
            rows.append({"bench": "adamw" + (" amsgrad" if amsgrad else ""), "variant": name, "ms": ms,
                         "steady ms": steady[name], "steady vs torch fused": steady[base] / steady[name],
                         "host ms": hosts[name], "TB/s": BYTES_PER_ELEMENT[amsgrad] * numel / (ms * 1e-3) / 1e12,
                         "of copy": floor_ms / ms, "vs torch fused": baseline / ms})
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

        def torch_pair():
            torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
            torch_opt.step()

        fn = graphed(torch_pair) if graph else torch_pair
        torch_ms, torch_steady = median_ms(fn), steady_ms(fn)
        clip = lambda: torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)  # noqa: E731
        clip_ms = median_ms(graphed(clip) if graph else clip)
        del torch_opt, fn
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
