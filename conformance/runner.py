"""Run the shared cases on a backend and compare with the oracles.

One runner serves the CLI (``python -m portable_ops.conformance``) and pytest
(``tests/test_conformance.py``). Each case runs with its backend forced and
``PORTABLE_OPS_STRICT=1``, so a call the backend declines raises instead of
quietly running the reference: that case is reported as ``fallback`` with the
backend's reason, never as a pass. A backend's cases run where ``placement`` says: on the first
device type it declares (``Backend.devices``) present in this process, else on the CPU where it
runs there, else nowhere (``not run``, with the reason). A fallback is ``declared`` when the backend lists the op
among those it has no kernel for (``Backend.declined``); the CLI's exit status counts only
undeclared ones, unless ``--strict`` (docs/conformance.md, "Exit status").

Oracles (oracles.py): ``float64`` is the reference backend's code run in float64 on the CPU;
``torch`` is PyTorch itself (``torch.optim`` functional Adam/AdamW and SGD,
``torch.nn.utils.clip_grad_norm_``, ``F.scaled_dot_product_attention``, ``F.rms_norm``, ``F.layer_norm``,
transformers' RoPE formula), used for
the reference backend. Optimizer cases are compared step by step: before each
step the oracles start from the backend's own state, so the error measured is
that of one step, in the backend's dtype.

Attention cases with ``sampled_rows`` (the long ones) are checked on those query rows, against an
oracle that stays exact for dk and dv over every key (see ``run_attention``). A ``long`` case runs
only where the backend's tensors are on an accelerator, or when asked (``long=True``, the CLI's
``--long``, ``PORTABLE_OPS_CONFORMANCE_LONG=1``); elsewhere its row says ``not run``, which is
neither a pass nor a failure.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch

import portable_ops
from portable_ops import dispatch, env
from portable_ops.definitions.attention_varlen import attention_varlen_bwd as reference_varlen_bwd
from portable_ops.definitions.attention_varlen import attention_varlen_fwd as reference_varlen_fwd
from portable_ops.definitions.grad_norm import grad_norm as reference_grad_norm
from portable_ops.definitions.paged import paged_attention as reference_paged_attention
from portable_ops.ops import families

from .cases import CASES, Case
from .cross_entropy_runner import run_linear_cross_entropy
from .norm_runner import run_layer_norm, run_rms_norm
from .oracles import F64, adam_oracle, attention_oracle
from .rope_runner import run_rope
from .sgd_runner import run_sgd
from .tolerances import GRADIENT_FACTOR

# Adam divides by sqrt(v) + eps: where the grad (after L2 decay) nearly cancels, its float32
# rounding is amplified in the update. A parameter may be off by this fraction of its own update.
UPDATE_RTOL = 1e-3
# Run the long cases on the CPU too (the Triton interpreter, the NKI emulator, the reference backend).
LONG_VARIABLE = "PORTABLE_OPS_CONFORMANCE_LONG"
STATUSES = ("pass", "fail", "fallback", "error", "not run")


@dataclass
class Row:
    backend: str
    case: str
    status: str  # one of STATUSES
    max_abs: float = 0.0
    rel: float = 0.0
    atol: float = 0.0
    rtol: float = 0.0
    oracles: list[str] = field(default_factory=list)
    detail: str = ""
    declared: bool = False  # a fallback on an op the backend declares it has no kernel for

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Comparison:
    """The worst of one case's comparisons: max abs error, relative error, and the first failure."""

    max_abs: float = 0.0
    rel: float = 0.0
    failure: str = ""
    oracles: set = field(default_factory=set)

    def check(self, oracle: str, label: str, out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float,
              slack: torch.Tensor | float = 0.0, nonfinite_alike: bool = False):
        """Pass where ``|out - ref| <= atol + rtol * |ref| + slack`` elementwise, NaN matching NaN and an infinity
        itself; with ``nonfinite_alike``, any non-finite value matches any other."""
        self.oracles.add(oracle)
        out, ref = out.detach().to("cpu", F64), ref.detach().to("cpu", F64)
        if out.shape != ref.shape:
            self.failure = self.failure or f"{label}: shape {tuple(out.shape)} vs {oracle} {tuple(ref.shape)}"
            return
        both_nan = out.isnan() & ref.isnan()
        same_inf = out.isinf() & (out == ref)
        alike = both_nan | same_inf
        if nonfinite_alike:
            alike |= ~out.isfinite() & ~ref.isfinite()
        err = torch.where(alike, torch.zeros_like(out), (out - ref).abs())
        err = torch.nan_to_num(err, nan=math.inf)
        if err.numel():
            self.max_abs = max(self.max_abs, err.max().item())
            finite_ref = torch.nan_to_num(ref, nan=0.0, posinf=0.0, neginf=0.0)
            # Relative to the reference's norm, floored at the absolute tolerance so an all-zero
            # reference (dq of a one-key row, say) does not divide by zero.
            floor = max(atol * math.sqrt(err.numel()), 1e-30)
            self.rel = max(self.rel,
                           (torch.nan_to_num(err, posinf=0.0).norm() / finite_ref.norm().clamp_min(floor)).item())
        bad = err > atol + rtol * torch.nan_to_num(ref.abs(), nan=0.0, posinf=0.0) + slack
        if bad.any() and not self.failure:
            i = int(bad.flatten().nonzero()[0])
            self.failure = (f"{label} vs {oracle}: element {i} is {out.flatten()[i].item():.6g}, "
                            f"expected {ref.flatten()[i].item():.6g} (atol {atol:g}, rtol {rtol:g})")


class Placement(NamedTuple):
    device: torch.device | None  # where a backend's cases run; None: nowhere in this process
    why_not: str = ""  # when ``device`` is None, why


def placement(backend: str) -> Placement:
    """Where a backend's cases run: on the first device type it declares (``Backend.devices``) that is present
    in this process, else on the CPU where it runs there (an interpreter, an emulator), else nowhere."""
    reason = dispatch.unavailable_reason(backend)
    if reason is not None:
        return Placement(None, reason)
    declared = dispatch.get_backend(backend)
    for kind in declared.devices:
        if kind != dispatch.EVERY_DEVICE_TYPE and dispatch.device_present(kind):
            return Placement(torch.device(kind))
    cpu = torch.device("cpu")
    on_cpu = declared.device_reasons(cpu)
    if not on_cpu:
        return Placement(cpu)
    return Placement(None, f"no {' or '.join(declared.devices)} device in this process, and {'; '.join(on_cpu)}")


def default_device(backend: str) -> torch.device:
    """The device of ``placement(backend)``; ValueError, with the reason, where its cases can't run here."""
    where = placement(backend)
    if where.device is None:
        raise ValueError(f"{backend}'s cases can't run here: {where.why_not}")
    return where.device


def unusable_reason(backend: str, device: torch.device | None = None) -> str | None:
    """Why ``backend``'s cases can't run on ``device`` (default: its placement's), or None when they can."""
    reason = dispatch.unavailable_reason(backend)
    if reason is not None:
        return reason
    where = Placement(device) if device is not None else placement(backend)
    if where.device is None:
        return where.why_not
    return "; ".join(dispatch.get_backend(backend).device_reasons(where.device)) or None


def usable_backends() -> list[str]:
    return [name for name in dispatch.BACKEND_NAMES if unusable_reason(name) is None]


@contextlib.contextmanager
def forced_strict(backend: str):
    previous = os.environ.get("PORTABLE_OPS_STRICT")
    os.environ["PORTABLE_OPS_STRICT"] = "1"
    try:
        with portable_ops.use_backend(backend):
            yield
    finally:
        if previous is None:
            del os.environ["PORTABLE_OPS_STRICT"]
        else:
            os.environ["PORTABLE_OPS_STRICT"] = previous


def _f64(tensors):
    return [t.detach().to("cpu", F64).clone() for t in tensors]


def _scalar(value, device, dtype=torch.float32):
    return None if value is None else torch.tensor(value, dtype=dtype, device=device)


# ----------------------------------------------------------------------------- adam

_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def run_adam(case: Case, backend: str, device: torch.device, oracles: list[str], result: Comparison):
    p, dtype = case.params, case.dtype
    gen = torch.Generator().manual_seed(case.seed)
    shapes = p["shapes"]
    params = [torch.randn(s, generator=gen).to(device, dtype) for s in shapes]
    state_dtype = p.get("state_dtype")
    exp_avgs = [torch.zeros_like(t, dtype=state_dtype) for t in params]
    exp_avg_sqs = [torch.zeros_like(t, dtype=state_dtype) for t in params]
    maxs = [torch.zeros_like(t, dtype=state_dtype) for t in params] if p["amsgrad"] else []
    steps = [torch.zeros((), dtype=torch.float32, device=device) for _ in params]
    scale = p.get("grad_scale", 1.0)
    kw = dict(amsgrad=p["amsgrad"], beta1=p["betas"][0], beta2=p["betas"][1], weight_decay=p["weight_decay"],
              eps=p["eps"], maximize=p["maximize"], decoupled_weight_decay=p["decoupled"],
              lr=_scalar(p["lr"], device) if p.get("lr_tensor") else p["lr"],
              grad_scale=_scalar(p.get("grad_scale"), device), clip_coef=_scalar(p.get("clip_coef"), device))
    tolerances = {"param": case.tolerance, "step": case.tolerance, "exp_avg": case.state_tolerance,
                  "exp_avg_sq": case.state_tolerance, "max_exp_avg_sq": case.state_tolerance}
    if "grad_scale" in p or "clip_coef" in p:  # a scaled step writes the grads back scaled, rounded once
        tolerances["grad"] = case.tolerance
    for step in range(p["steps"]):
        grads = [(torch.randn(s, generator=gen) * scale).to(device, dtype) for s in shapes]
        if step in p.get("nonfinite_steps", ()) and grads:
            grads[0].view(-1)[0] = math.inf
            grads[-1].view(-1)[-1] = math.nan
        skip = step in p.get("found_inf_steps", ())
        kw["found_inf"] = _scalar(float(skip), device) if "found_inf_steps" in p else None
        state = (params, exp_avgs, exp_avg_sqs, maxs, steps, grads)
        before = [_f64(ts) for ts in state]
        with forced_strict(backend):
            portable_ops.functional.adam(params, grads, exp_avgs, exp_avg_sqs, maxs, steps, state_dtype=state_dtype,
                                         **kw)
        kw64 = {k: (v.to("cpu", F64) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        for oracle in oracles:
            expected = [[t.clone() for t in ts] for ts in before]
            adam_oracle(oracle, expected[:5], expected[5], kw64)
            for label, outs, refs in zip(("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step", "grad"), state,
                                         expected):
                tol = (0.0, 0.0) if skip or label not in tolerances else tolerances[label]  # read-only: every bit
                for i, (out, ref) in enumerate(zip(outs, refs)):
                    slack = 0.0
                    if label == "param" and not skip:
                        slack = UPDATE_RTOL * torch.nan_to_num((ref - before[0][i]).abs(), nan=0.0, posinf=0.0)
                    # the kind of a non-finite moment is not part of the contract: torch's fused CUDA kernel
                    # leaves NaN where a non-finite grad gives the definition an infinity
                    result.check(oracle, f"step {step + 1} {label}[{i}]", out, ref, *tol, slack=slack,
                                 nonfinite_alike=label in _MOMENTS)


# ----------------------------------------------------------------------------- clip

def _leaves(values, grads):
    leaves = []
    for value, grad in zip(values, grads):
        leaf = value.clone().requires_grad_(True)
        leaf.grad = grad
        leaves.append(leaf)
    return leaves


def run_clip(case: Case, backend: str, device: torch.device, oracles: list[str], result: Comparison):
    p, dtype = case.params, case.dtype
    gen = torch.Generator().manual_seed(case.seed)
    shapes = p["shapes"]
    atol, rtol = case.tolerance
    if p.get("fused_step"):
        return _run_fused_clip_step(case, backend, device, oracles, result, gen)
    values = [torch.randn(s, generator=gen).to(device, dtype) for s in shapes]
    grads = [(3 * torch.randn(s, generator=gen)).to(device, dtype) for s in shapes]
    before = _f64(grads)
    leaves = _leaves(values, grads)
    with forced_strict(backend):
        norm = portable_ops.clip_grad_norm_(leaves, p["max_norm"], norm_type=p["norm_type"])
    for oracle in oracles:
        ref_leaves = _leaves(_f64(values), [g.clone() for g in before])
        if oracle == "float64":
            ref_norm = reference_grad_norm([l.grad for l in ref_leaves], p["norm_type"])
            coef = (p["max_norm"] / (ref_norm + 1e-6)).clamp(max=1.0)
            for leaf in ref_leaves:
                leaf.grad.mul_(coef)
        else:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref_leaves, p["max_norm"], norm_type=p["norm_type"])
        result.check(oracle, "total norm", norm, ref_norm, atol, rtol)
        for i, (leaf, ref) in enumerate(zip(leaves, ref_leaves)):
            result.check(oracle, f"grad[{i}]", leaf.grad, ref.grad, atol, rtol)


def _run_fused_clip_step(case, backend, device, oracles, result, gen):
    """AdamW(max_grad_norm=...) against clip-then-step by each oracle, from the same state every step."""
    p, dtype = case.params, case.dtype
    atol, rtol = case.tolerance
    params = [torch.randn(s, generator=gen).to(device, dtype).requires_grad_(True) for s in p["shapes"]]
    opt = portable_ops.optim.AdamW(params, lr=1e-2, weight_decay=0.01, max_grad_norm=p["max_norm"])
    for step in range(p["steps"]):
        for t in params:
            t.grad = (3 * torch.randn(t.shape, generator=gen)).to(device, dtype)
        before = ({k: _f64([opt.state[t][k] for t in params]) for k in ("exp_avg", "exp_avg_sq", "step")}
                  if step else None)
        values, grads = _f64(params), _f64([t.grad for t in params])
        with forced_strict(backend):
            opt.step()
        for oracle in oracles:
            leaves = _leaves(values, [g.clone() for g in grads])
            if oracle == "float64":
                norm = reference_grad_norm([l.grad for l in leaves], p["norm_type"])
            else:
                norm = torch.nn.utils.clip_grad_norm_(leaves, math.inf)  # the norm only: coef 1
            coef = (p["max_norm"] / (norm + 1e-6)).clamp(max=1.0)
            if before:
                start = {k: [t.clone() for t in ts] for k, ts in before.items()}
            else:
                start = {"exp_avg": [torch.zeros_like(v) for v in values],
                         "exp_avg_sq": [torch.zeros_like(v) for v in values],
                         "step": [torch.zeros((), dtype=F64) for _ in values]}
            state = [[l.detach() for l in leaves], start["exp_avg"], start["exp_avg_sq"], [], start["step"]]
            kw = dict(amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-2, weight_decay=0.01, eps=1e-8, maximize=False,
                      decoupled_weight_decay=True, grad_scale=None, found_inf=None, clip_coef=coef)
            with torch.no_grad():
                adam_oracle(oracle, state, [l.grad for l in leaves], kw)
            result.check(oracle, f"step {step + 1} grad norm", opt.last_grad_norm, norm, atol, rtol)
            for i, (t, ref, leaf) in enumerate(zip(params, state[0], leaves)):
                result.check(oracle, f"step {step + 1} param[{i}]", t, ref, atol, rtol)
                result.check(oracle, f"step {step + 1} grad[{i}] (clipped)", t.grad, leaf.grad, atol, rtol)


# ----------------------------------------------------------------------------- attention

def attention_inputs(case: Case):
    """``q, k, v, dout`` (float32, CPU) drawn from the case's seed (v and dout of head dim ``Dv``, where the case
    gives v one of its own), the blocks of query rows that are checked, and a mask of those rows; with
    ``sampled_rows``, dout is zero outside them."""
    p = case.params
    dv = p.get("Dv", p["D"])
    gen = torch.Generator().manual_seed(case.seed)
    q = torch.randn(p["B"], p["Hq"], p["Sq"], p["D"], generator=gen)
    k = torch.randn(p["B"], p["Hkv"], p["Skv"], p["D"], generator=gen)
    v = torch.randn(p["B"], p["Hkv"], p["Skv"], dv, generator=gen)
    dout = torch.randn(p["B"], p["Hq"], p["Sq"], dv, generator=gen)
    blocks = p.get("sampled_rows") or ((0, p["Sq"]),)
    sampled = torch.zeros(p["Sq"], dtype=torch.bool)
    for start, end in blocks:
        sampled[start:end] = True
    if int(sampled.sum()) != sum(end - start for start, end in blocks):  # the oracles' dk, dv sum over blocks
        raise ValueError(f"sampled_rows {blocks} overlap or reach past Sq = {p['Sq']}")
    dout[:, :, ~sampled] = 0
    return q, k, v, dout, blocks, sampled


# Sinks of mean 3 and std 2 against rows whose lse is 2-6 (a few to a few hundred keys of scores of std 1): each row
# gives its sink from a few percent to most of its weight, so a backend that ignored them fails out and dsinks.
SINK_MEAN, SINK_STD = 3.0, 2.0


def case_sinks(case: Case, heads: int) -> torch.Tensor | None:
    """The case's sinks (float32, CPU), None for a case without; drawn apart from its other inputs."""
    if not case.params.get("sinks"):
        return None
    return SINK_MEAN + SINK_STD * torch.randn(heads, generator=torch.Generator().manual_seed(case.seed + 1))


def case_dlse(case: Case, shape) -> torch.Tensor | None:
    """The gradient a case sends back through lse (float32, CPU), None for a case that does not return lse."""
    if not case.params.get("lse"):
        return None
    return torch.randn(shape, generator=torch.Generator().manual_seed(case.seed + 2))


def _leaf(t, device):
    return None if t is None else t.to(device).requires_grad_(True)


def _check_dsinks(result, oracle, sinks, want, tol):
    if sinks is not None:
        result.check(oracle, "dsinks", sinks.grad, want, *tol)


def _backward(out, lse, dout, dlse):
    """Gradients through out, and through lse where the case returned it."""
    if lse is None:
        out.backward(dout)
    else:
        torch.autograd.backward((out, lse), (dout, dlse.to(lse.device)))


def run_attention(case: Case, backend: str, device: torch.device, oracles: list[str], result: Comparison):
    """Out and dq, dk, dv (and dsinks; and lse, with a gradient through it, for an ``lse`` case) against each
    oracle. With ``sampled_rows``, dout is zero outside those blocks of query rows: the backend still runs the
    whole sequence, but its gradients are then exactly those of the sampled rows' attention, which the oracles
    compute at a cost of (sampled rows) x Skv. Out and dq are compared on the sampled rows, dk and dv everywhere,
    and dq elsewhere must be exactly zero (dS = P * (dout V^T - rowsum(dout * out)) is, row by row)."""
    p, dtype = case.params, case.dtype
    q, k, v, dout, blocks, sampled = attention_inputs(case)
    inputs = [t.to(device, dtype).requires_grad_(True) for t in (q, k, v)]
    sinks = _leaf(case_sinks(case, p["Hq"]), device)
    dlse = case_dlse(case, q.shape[:-1])
    scale = p.get("scale", 1.0 / math.sqrt(p["D"]))
    window, softcap = p.get("window"), p.get("softcap")
    with forced_strict(backend):
        out = portable_ops.attention(*inputs, causal=p["causal"], scale=scale, window=window, softcap=softcap,
                                     sinks=sinks, return_lse=dlse is not None)
        out, lse = out if dlse is not None else (out, None)
        _backward(out, lse, dout.to(device, dtype), dlse)
    atol, rtol = case.tolerance
    grad_tol = case.tolerance.scaled(GRADIENT_FACTOR)
    dq, dk, dv = (t.grad for t in inputs)
    if not sampled.all():
        outside = dq[:, :, ~sampled.to(dq.device)]
        result.check("float64", "dq outside the sampled rows", outside, torch.zeros_like(outside), 0.0, 0.0)
    # The oracles see the inputs rounded to the case's dtype, as the backend did.
    q64, k64, v64 = _f64(inputs)
    sinks64 = None if sinks is None else sinks.detach().to("cpu", F64)
    dout64 = dout.to(dtype).to(F64)
    dlse64 = None if dlse is None else dlse.to(F64)
    for oracle in oracles:
        dk_ref = dv_ref = dsinks_ref = 0.0
        for start, end in blocks:
            want = attention_oracle(oracle, q64, k64, v64, dout64, (start, end), p["causal"], scale, window, softcap,
                                    sinks64, dlse64)
            result.check(oracle, f"out rows {start}:{end}", out[:, :, start:end], want.out, atol, rtol)
            if lse is not None:
                result.check(oracle, f"lse rows {start}:{end}", lse[:, :, start:end], want.lse, atol, rtol)
            result.check(oracle, f"dq rows {start}:{end}", dq[:, :, start:end], want.dq, *grad_tol)
            dk_ref, dv_ref = dk_ref + want.dk, dv_ref + want.dv
            dsinks_ref = dsinks_ref + (0.0 if want.dsinks is None else want.dsinks)
        result.check(oracle, "dk", dk, dk_ref, *grad_tol)
        result.check(oracle, "dv", dv, dv_ref, *grad_tol)
        _check_dsinks(result, oracle, sinks, dsinks_ref, grad_tol)


def _dense(t):
    """One packed sequence ``[S, H, D]`` as dense attention's ``[1, H, S, D]``."""
    return t.transpose(0, 1)[None]


def _offsets(lengths) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def run_attention_varlen(case: Case, backend: str, device: torch.device, oracles: list[str], result: Comparison):
    """Packed sequences: out and dq, dk, dv against the reference's varlen definition in float64 and,
    for the reference backend, each sequence's attention in PyTorch (SDPA under its mask)."""
    p, dtype = case.params, case.dtype
    lens_q = p["lens_q"]
    lens_k = p.get("lens_k", lens_q)
    gen = torch.Generator().manual_seed(case.seed)
    tq, tk = sum(lens_q), sum(lens_k)
    dv = p.get("Dv", p["D"])
    q = torch.randn(tq, p["Hq"], p["D"], generator=gen)
    k, v = (torch.randn(tk, p["Hkv"], d, generator=gen) for d in (p["D"], dv))
    dout = torch.randn(tq, p["Hq"], dv, generator=gen)
    cu_q, cu_k = _offsets(lens_q), _offsets(lens_k)
    scale = p.get("scale", 1.0 / math.sqrt(p["D"]))
    options = dict(causal=p["causal"], scale=scale, window=p.get("window"), softcap=p.get("softcap"))
    inputs = [t.to(device, dtype).requires_grad_(True) for t in (q, k, v)]
    sinks = _leaf(case_sinks(case, p["Hq"]), device)
    dlse = case_dlse(case, (p["Hq"], tq))
    with forced_strict(backend):
        out = portable_ops.attention_varlen(*inputs, cu_q.to(device), cu_k.to(device), max(lens_q), max(lens_k),
                                            **options, sinks=sinks, return_lse=dlse is not None)
        out, lse = out if dlse is not None else (out, None)
        _backward(out, lse, dout.to(device, dtype), dlse)
    atol, rtol = case.tolerance
    grad_tol = case.tolerance.scaled(GRADIENT_FACTOR)
    q64, k64, v64 = _f64(inputs)
    options["sinks"] = None if sinks is None else sinks.detach().to("cpu", F64)
    dout64 = dout.to(dtype).to(F64)
    dlse64 = None if dlse is None else dlse.to(F64)
    for oracle in oracles:
        if oracle == "float64":
            ref, lse_ref = reference_varlen_fwd(q64, k64, v64, cu_q, cu_k, max(lens_q), max(lens_k), **options)
            grads = reference_varlen_bwd(q64, k64, v64, ref, lse_ref, dout64, cu_q, cu_k, max(lens_q), max(lens_k),
                                         **options, dlse=dlse64)
            dsinks_ref = grads[3] if sinks is not None else None
        else:
            parts, lses, dsinks_ref = [], [], 0.0
            for (q0, q1), (k0, k1) in zip(itertools.pairwise(cu_q.tolist()), itertools.pairwise(cu_k.tolist())):
                dense = [_dense(t) for t in (q64[q0:q1], k64[k0:k1], v64[k0:k1], dout64[q0:q1])]
                want = attention_oracle("torch", *dense, (0, q1 - q0), p["causal"], scale, options["window"],
                                        options["softcap"], options["sinks"],
                                        None if dlse64 is None else dlse64[None, :, q0:q1])
                parts.append([t[0].transpose(0, 1) for t in (want.out, want.dq, want.dk, want.dv)])
                lses.append(want.lse[0])
                dsinks_ref = dsinks_ref + (0.0 if want.dsinks is None else want.dsinks)
            ref, *grads = (torch.cat(ts) for ts in zip(*parts))
            lse_ref = torch.cat(lses, dim=1)
        result.check(oracle, "out", out, ref, atol, rtol)
        if lse is not None:
            result.check(oracle, "lse", lse, lse_ref, atol, rtol)
        for label, got, want in zip(("dq", "dk", "dv"), (t.grad for t in inputs), grads):
            result.check(oracle, label, got, want, *grad_tol)
        _check_dsinks(result, oracle, sinks, dsinks_ref, grad_tol)


# The table entry of a page a sliding window has left behind (a cache may release it): far past the pool, so
# that reading it fails (-1 would index the last page in torch and read out of bounds in a kernel, unnoticed).
RELEASED = 1 << 30


def paged_inputs(case: Case):
    """A paged cache holding each sequence's first ``lens - Sq`` tokens, the ``Sq`` new tokens' k/v, the
    queries, and the block table: each sequence's pages drawn at random from a shuffled pool (with spares),
    the table's unused entries -1, and pages wholly before a window ``RELEASED`` (never read)."""
    p = case.params
    gen = torch.Generator().manual_seed(case.seed)
    lens, sq, page_size = p["lens"], p["Sq"], p["page_size"]
    pages_needed = [-(-length // page_size) for length in lens]
    max_pages = max(pages_needed) + 1
    pool = torch.randperm(sum(pages_needed) + 3, generator=gen)
    table = torch.full((len(lens), max_pages), -1, dtype=torch.int32)
    taken = 0
    left = (p.get("window") or (None, None))[0]
    for b, (length, n) in enumerate(zip(lens, pages_needed)):
        table[b, :n] = pool[taken:taken + n]
        taken += n
        if left is not None:
            table[b, :max(0, length - sq - left) // page_size] = RELEASED
    dims = (p["D"], p.get("Dv", p["D"]))  # k's, v's
    k_cache, v_cache = (torch.randn(len(pool), page_size, p["Hkv"], d, generator=gen) for d in dims)
    k_new, v_new = (torch.randn(len(lens), sq, p["Hkv"], d, generator=gen) for d in dims)
    q = torch.randn(len(lens), sq, p["Hq"], p["D"], generator=gen)
    return q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32), k_new, v_new


def run_paged(case: Case, backend: str, device: torch.device, oracles: list[str], result: Comparison):
    """One decode step: ``paged_kv_append`` of the new tokens, compared bit for bit with writing each
    token where the table says, then ``paged_attention``, against the reference's paged definition in
    float64 and, for the reference backend, SDPA on each sequence's keys gathered position by position."""
    p, dtype = case.params, case.dtype
    q, k_cache, v_cache, table, lens, k_new, v_new = paged_inputs(case)
    sq, page_size = p["Sq"], p["page_size"]
    scale = p.get("scale", 1.0 / math.sqrt(p["D"]))
    sinks = case_sinks(case, p["Hq"])
    options = dict(scale=scale, window=p.get("window"), softcap=p.get("softcap"))
    q, k_cache, v_cache, k_new, v_new = (t.to(device, dtype) for t in (q, k_cache, v_cache, k_new, v_new))
    expected = _f64([k_cache, v_cache])
    with forced_strict(backend), torch.no_grad():
        portable_ops.paged_kv_append(k_cache, v_cache, table.to(device), (lens - sq).to(device), k_new, v_new)
        out, lse = portable_ops.paged_attention(q, k_cache, v_cache, table.to(device), lens.to(device), **options,
                                                sinks=None if sinks is None else sinks.to(device), return_lse=True)
    options["sinks"] = None if sinks is None else sinks.to(F64)
    for b, length in enumerate(lens.tolist()):
        for t in range(sq):
            position = length - sq + t
            page, offset = int(table[b, position // page_size]), position % page_size
            for cache, new in zip(expected, (k_new, v_new)):
                cache[page, offset] = new[b, t].to("cpu", F64)
    for label, got, want in zip(("k_cache", "v_cache"), (k_cache, v_cache), expected):
        result.check("float64", f"{label} after paged_kv_append", got, want, 0.0, 0.0)
    atol, rtol = case.tolerance
    q64, k64, v64 = _f64([q, k_cache, v_cache])
    for oracle in oracles:
        if oracle == "float64":
            ref, lse_ref = reference_paged_attention(q64, k64, v64, table, lens, **options)
        else:
            left = (options["window"] or (None, None))[0]
            refs, lses = [], []
            for b, length in enumerate(lens.tolist()):
                first = 0 if left is None else max(0, length - sq - left)
                keys = [torch.stack([cache[int(table[b, j // page_size]), j % page_size] for j in range(first, length)])
                        if length > first else cache.new_zeros(0, *cache.shape[2:]) for cache in (k64, v64)]
                want = attention_oracle("torch", _dense(q64[b]), *map(_dense, keys), None, (0, sq), True, scale,
                                        options["window"], options["softcap"], options["sinks"])
                refs.append(want.out[0].transpose(0, 1))
                lses.append(want.lse[0])
            ref, lse_ref = torch.stack(refs), torch.stack(lses)
        result.check(oracle, "out", out, ref, atol, rtol)
        result.check(oracle, "lse", lse, lse_ref, atol, rtol)


RUNNERS = {"adam": run_adam, "sgd": run_sgd, "clip_grad_norm_": run_clip, "attention": run_attention,
           "attention_varlen": run_attention_varlen, "paged_attention": run_paged, "rms_norm": run_rms_norm,
           "layer_norm": run_layer_norm, "rope": run_rope, "linear_cross_entropy": run_linear_cross_entropy}
if set(RUNNERS) != set(families()):  # a family of portable_ops/ops.py without a runner, or the reverse
    raise ImportError(f"runners for {sorted(RUNNERS)}; portable_ops/ops.py's families are {sorted(families())}")


def long_cases_run(device: torch.device, long: bool | None = None) -> bool:
    """Whether long cases run on ``device``: always on an accelerator; on the CPU (interpreter, emulator,
    reference) only when ``long`` is true, or, when it is None, ``PORTABLE_OPS_CONFORMANCE_LONG`` is."""
    return device.type != "cpu" or (env.flag(LONG_VARIABLE, False) if long is None else long)


def run_case(case: Case, backend: str, device: torch.device | None = None, long: bool | None = None) -> Row:
    """One case on ``backend``, forced and strict, on ``device`` (default: the backend's placement)."""
    oracles = ["float64", "torch"] if backend == dispatch.FALLBACK else ["float64"]
    atol, rtol = case.tolerance
    row = Row(backend, case.id, "pass", atol=atol, rtol=rtol)
    where = Placement(device) if device is not None else placement(backend)
    if where.device is None:
        row.status, row.detail = "not run", where.why_not
        return row
    device = where.device
    if case.long and not long_cases_run(device, long):
        row.status = "not run"
        row.detail = (f"long case: runs on an accelerator; on {device.type} only with --long or "
                      f"{LONG_VARIABLE}=1")
        return row
    result = Comparison()
    try:
        RUNNERS[case.op](case, backend, device, oracles, result)
    except dispatch.BackendUnavailableError as exc:
        row.status, row.detail = "fallback", exc.choice.fallback_message()
        row.declared = exc.op in dispatch.get_backend(exc.preferred).declined
        return row
    except Exception as exc:  # a crash is a failure of the case, reported, not raised
        row.status, row.detail = "error", f"{type(exc).__name__}: {exc}"
        return row
    row.max_abs, row.rel, row.oracles = result.max_abs, result.rel, sorted(result.oracles)
    if result.failure:
        row.status, row.detail = "fail", result.failure
    return row


def run(backends: list[str], cases: list[Case] = CASES, device: torch.device | None = None, progress=None,
        long: bool | None = None) -> list[Row]:
    rows = []
    for backend in backends:
        for case in cases:
            rows.append(run_case(case, backend, device, long))
            if progress:
                progress(rows[-1])
    return rows


def passed(rows: list[Row], strict: bool = False) -> bool:
    """Whether a run passes: at least one case ran, and each that ran passed or, unless ``strict``, fell
    back on an op its backend declares it has no kernel for."""
    ran = [r for r in rows if r.status != "not run"]
    return bool(ran) and all(r.status == "pass" or (r.declared and not strict) for r in ran)


def status_counts(rows: list[Row]) -> dict[str, int]:
    return {s: sum(r.status == s for r in rows) for s in STATUSES}


def format_table(rows: list[Row]) -> str:
    header = (f"{'backend':<10} {'case':<44} {'status':<8} {'max abs':>9} {'rel':>9} {'atol':>7} {'rtol':>7}"
              "  oracles / detail")
    lines = [header, "-" * len(header)]
    for r in rows:
        note = r.detail if r.status != "pass" else ",".join(r.oracles)
        # a case that computed nothing has no error to show
        computed = r.status not in ("not run", "error", "fallback")
        errors = f"{r.max_abs:>9.2e} {r.rel:>9.2e}" if computed else f"{'-':>9} {'-':>9}"
        lines.append(f"{r.backend:<10} {r.case:<44} {r.status:<8} {errors} {r.atol:>7.0e} {r.rtol:>7.0e}  {note}")
    counts = status_counts(rows)
    lines.append("-" * len(header))
    declared = sum(r.declared for r in rows)
    lines.append(", ".join(f"{n} {s}" + (f" ({declared} declared)" if s == "fallback" and declared else "")
                           for s, n in counts.items()) + f" of {len(rows)} cases")
    return "\n".join(lines)
