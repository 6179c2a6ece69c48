"""The ``sgd`` family's runner (``runner.RUNNERS["sgd"]``): functional steps compared one at a time, and the
optimizer class with ``max_grad_norm`` against clip-then-step.

Functional cases step lists of params whose momentum buffers start unmade (None), so the first step makes
them; a case's ``late`` params join the lists only from a later step, so one call mixes new and old buffers.
Before each step the oracles start from the backend's own state (as ``run_adam``'s do): the error measured
is one step's, in the backend's dtype. ``dtypes`` cycles the params through several dtypes in one call (one
launch per dtype group), each compared at its own dtype's tolerance.
"""

from __future__ import annotations

import math

import torch

import portable_ops
from portable_ops.definitions.grad_norm import grad_norm as reference_grad_norm

from .cases import Case
from .oracles import F64, sgd_oracle
from .tolerances import tolerance


def _f64(tensors):
    return [None if t is None else t.detach().to("cpu", F64).clone() for t in tensors]


def _scalar(value, device):
    return None if value is None else torch.tensor(value, dtype=torch.float32, device=device)


def _draws(case: Case, device):
    """The params (each in its dtype, on ``device``) and a function drawing step ``k``'s grads, from the seed."""
    p = case.params
    gen = torch.Generator().manual_seed(case.seed)
    dtypes = p.get("dtypes") or (case.dtype,)
    kinds = [dtypes[i % len(dtypes)] for i in range(len(p["shapes"]))]
    params = [torch.randn(s, generator=gen).to(device, dtype) for s, dtype in zip(p["shapes"], kinds)]
    scale = p.get("grad_scale", 1.0)

    def grads(step):
        drawn = [(torch.randn(s, generator=gen) * scale).to(device, dtype) for s, dtype in zip(p["shapes"], kinds)]
        if step in p.get("nonfinite_steps", ()) and drawn:
            drawn[0].view(-1)[0] = math.inf
            drawn[-1].view(-1)[-1] = math.nan
        return drawn

    return params, grads


def _options(p: dict, device) -> dict:
    return dict(momentum=p.get("momentum", 0.0), dampening=p.get("dampening", 0.0),
                weight_decay=p.get("weight_decay", 0.0), nesterov=p.get("nesterov", False),
                maximize=p.get("maximize", False),
                lr=_scalar(p["lr"], device) if p.get("lr_tensor") else p["lr"],
                grad_scale=_scalar(p.get("grad_scale"), device), clip_coef=_scalar(p.get("clip_coef"), device))


def run_sgd(case: Case, backend: str, device: torch.device, oracles: list[str], result):
    from .runner import forced_strict  # runner.py imports this module for its table

    p = case.params
    if p.get("max_grad_norm") is not None:
        return _run_optimizer_clip(case, backend, device, oracles, result)
    params, draw = _draws(case, device)
    buffers = [None] * len(params)
    late = dict(p.get("late", ()))  # param index -> the first step it takes part in
    kw = _options(p, device)
    for step in range(p["steps"]):
        grads = draw(step)
        taking = [i for i in range(len(params)) if late.get(i, 0) <= step]
        kw["found_inf"] = _scalar(float(step in p.get("found_inf_steps", ())), device) if "found_inf_steps" in p \
            else None
        skip = kw["found_inf"] is not None and kw["found_inf"].item() != 0
        listed = [buffers[i] for i in taking]
        before_p, before_b, before_g = _f64([params[i] for i in taking]), _f64(listed), _f64([grads[i] for i in taking])
        with forced_strict(backend):
            portable_ops.functional.sgd([params[i] for i in taking], [grads[i] for i in taking], listed, **kw)
        for j, i in enumerate(taking):
            buffers[i] = listed[j]
        kw64 = {k: (v.to("cpu", F64) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        for oracle in oracles:
            ref_p, ref_b = [t.clone() for t in before_p], [None if b is None else b.clone() for b in before_b]
            ref_g = [g.clone() for g in before_g]
            sgd_oracle(oracle, ref_p, ref_b, ref_g, kw64)
            for j, i in enumerate(taking):
                tol = (0.0, 0.0) if skip else tolerance("sgd", params[i].dtype)  # a skip leaves every bit
                result.check(oracle, f"step {step + 1} param[{i}]", params[i], ref_p[j], *tol)
                if (listed[j] is None) != (ref_b[j] is None):
                    result.failure = result.failure or (f"step {step + 1} momentum_buffer[{i}] is "
                                                        f"{'None' if listed[j] is None else 'made'}, {oracle}'s "
                                                        f"{'None' if ref_b[j] is None else 'made'}")
                elif listed[j] is not None:
                    result.check(oracle, f"step {step + 1} momentum_buffer[{i}]", listed[j], ref_b[j], *tol)
            scaled = kw["grad_scale"] is not None or kw["clip_coef"] is not None
            for j, i in enumerate(taking):  # written back scaled by a scaled step, else read only: every bit
                tol = tolerance("sgd", params[i].dtype) if scaled and not skip else (0.0, 0.0)
                result.check(oracle, f"step {step + 1} grad[{i}]", grads[i], ref_g[j], *tol)


def _run_optimizer_clip(case, backend, device, oracles, result):
    """``optim.SGD(max_grad_norm=...)`` against clip-then-step by each oracle, from the same state every step."""
    from .runner import _leaves, forced_strict

    p = case.params
    params, draw = _draws(case, device)
    params = [t.requires_grad_(True) for t in params]
    options = {k: v for k, v in _options(p, device).items() if k not in ("grad_scale", "clip_coef")}
    opt = portable_ops.optim.SGD(params, max_grad_norm=p["max_grad_norm"], **options)
    for step in range(p["steps"]):
        for t, g in zip(params, draw(step)):
            t.grad = g
        values, grads = _f64(params), _f64([t.grad for t in params])
        buffers = _f64([opt.state[t].get("momentum_buffer") for t in params])
        with forced_strict(backend):
            opt.step()
        for oracle in oracles:
            leaves = _leaves(values, [g.clone() for g in grads])
            if oracle == "float64":
                norm = reference_grad_norm([leaf.grad for leaf in leaves], 2.0)
            else:
                norm = torch.nn.utils.clip_grad_norm_(leaves, math.inf)  # the norm only: coef 1
            coef = (p["max_grad_norm"] / (norm + 1e-6)).clamp(max=1.0)
            refs, ref_b = [leaf.detach() for leaf in leaves], [None if b is None else b.clone() for b in buffers]
            kw = dict(options, grad_scale=None, found_inf=None, clip_coef=coef)
            with torch.no_grad():
                sgd_oracle(oracle, refs, ref_b, [leaf.grad for leaf in leaves], kw)
            tol = tolerance("sgd", case.dtype)
            result.check(oracle, f"step {step + 1} grad norm", opt.last_grad_norm, norm, *tol)
            for i, (t, ref, leaf) in enumerate(zip(params, refs, leaves)):
                result.check(oracle, f"step {step + 1} param[{i}]", t, ref, *tol)
                result.check(oracle, f"step {step + 1} grad[{i}] (clipped)", t.grad, leaf.grad, *tol)
                if ref_b[i] is not None:
                    result.check(oracle, f"step {step + 1} momentum_buffer[{i}]", opt.state[t]["momentum_buffer"],
                                 ref_b[i], *tol)
