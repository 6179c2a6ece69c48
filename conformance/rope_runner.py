"""The runner of the ``rope`` family: ``rope``'s outputs and both gradients, or ``rope_``'s writes.

Inputs are drawn from the case's seed on the CPU, made in the case's dtype on the backend's device and then laid
out as the case says (each contiguous, q and k transposed slices of one fused projection
``[B, S, Hq + 2 Hk, D]``, or the last D dims of wider heads, DeepSeek's rope part), so the backend sees those
strides; the call runs forced and strict (``runner.forced_strict``). Oracles, on the inputs as the backend saw
them: ``float64``, the definition (``portable_ops/definitions/rope.py``) in float64, and ``torch``, transformers'
``apply_rotary_pos_emb`` formula written out (``rotate_half``, its partial-rotary split; GPT-J's
``rotate_every_two`` for the interleaved layout) and its autograd in float64, for the reference backend. Each
output must also be laid out as its input (``portable_ops.layout.same_layout``); ``rope_`` must leave every
element it does not rotate as it was, bit for bit, and return q and k themselves.
"""

from __future__ import annotations

import torch

import portable_ops
from portable_ops.definitions import rope as definition

from .cases import Case

F64 = torch.float64
NOPE = 32  # the "tail" layout's dims before the rope part of each head (DeepSeek's qk_nope_head_dim, scaled down)


def rope_tables(case: Case, gen: torch.Generator):
    """cos and sin (float32, CPU) as transformers' rotary modules make them: ``[S, R]``, ``[B, S, R]`` (each
    sequence at its own offset) or ``[1, S, R]``; angles ``position * 10000^(-2i/R)``, each pair's angle twice (as
    halves, or side by side for the interleaved layout). ``tables="random"``: any values (not a rotation)."""
    p = case.params
    s, r, kind = p["S"], p["R"], p.get("tables")
    lead = {"per_batch": (p["B"],), "batch1": (1,)}.get(kind, ())
    if kind == "random":
        return torch.randn(*lead, s, r, generator=gen), torch.randn(*lead, s, r, generator=gen)
    offsets = torch.randint(0, 4000, lead or (1,), generator=gen)[:, None]  # positions far from 0: large angles
    positions = (offsets + torch.arange(s)).reshape(*lead, s).double()
    inv_freq = 10000.0 ** (-torch.arange(0, r, 2, dtype=F64) / max(r, 1))
    freqs = positions[..., None] * inv_freq
    emb = freqs.repeat_interleave(2, -1) if p["interleaved"] else torch.cat((freqs, freqs), -1)
    return emb.cos().float(), emb.sin().float()


def rope_inputs(case: Case, device: torch.device, dtype: torch.dtype):
    """``(base, q, k, cos, sin, dq_out, dk_out)``: q and k views of ``base`` (in ``dtype`` on ``device``, laid out as
    the case says), the tables in their dtype (``table_dtype``, else the case's), the outputs' gradients."""
    p = case.params
    gen = torch.Generator().manual_seed(case.seed)
    b, hq, hk, s, d = p["B"], p["Hq"], p["Hk"], p["S"], p["D"]
    kind = p.get("layout", "contiguous")
    if kind == "contiguous":  # q and k each contiguous, one after the other
        base = torch.randn(b * (hq + hk) * s * d, generator=gen)
    else:  # [B, S, heads, width]: the heads of q and k side by side, as one projection makes them
        base = torch.randn(b, s, hq + 2 * hk, d + (NOPE if kind == "tail" else 0), generator=gen)
    if p.get("nonfinite") and base.numel():
        flat = base.view(-1)
        flat[3], flat[base.numel() // 2], flat[-5] = float("inf"), float("nan"), float("-inf")
    cos, sin = rope_tables(case, gen)
    dq_out = torch.randn(b, hq, s, d, generator=gen)
    dk_out = torch.randn(b, hk, s, d, generator=gen)
    base = base.to(device, dtype)
    q, k = _same_views(case, base)
    table_dtype = p.get("table_dtype", dtype)
    cos, sin = (t.to(device, table_dtype) for t in (cos, sin))
    return base, q, k, cos, sin, dq_out.to(device, dtype), dk_out.to(device, dtype)


def _transformers(x, cos, sin, interleaved):
    """transformers' ``apply_rotary_pos_emb`` for one of q, k (with its partial-rotary split), cos/sin unsqueezed
    over the heads; ``rotate_every_two`` (GPT-J) for the interleaved layout."""
    def rotate_half(x):
        x1, x2 = x[..., :x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    def rotate_every_two(x):
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)

    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    rotated = (x_rot * cos) + ((rotate_every_two if interleaved else rotate_half)(x_rot) * sin)
    return torch.cat((rotated, x_pass), dim=-1)


def _oracle(oracle, q64, k64, cos64, sin64, dq64, dk64, interleaved):
    """``(q_out, k_out, dq, dk)`` in float64; the gradients None for ``dq64`` None (``rope_``)."""
    tables = cos64 if cos64.dim() == 3 else cos64[None], sin64 if sin64.dim() == 3 else sin64[None]
    if oracle == "float64":
        q_out, k_out = definition.rope(q64, k64, *tables, interleaved)
        dq, dk = definition.rope_bwd(dq64, dk64, *tables, interleaved) if dq64 is not None else (None, None)
        return q_out, k_out, dq, dk
    leaves = [t.clone().requires_grad_(True) for t in (q64, k64)]
    outs = [_transformers(t, cos64, sin64, interleaved) for t in leaves]
    grads = (torch.autograd.grad(outs, leaves, (dq64, dk64)) if dq64 is not None and q64.numel() and k64.numel()
             else (None, None))
    return outs[0].detach(), outs[1].detach(), *grads


def _check_layout(result, label, out, given):
    want = portable_ops.layout.same_layout(given).stride()
    if out.stride() != want and out.numel() > 1 and not result.failure:
        result.failure = f"{label}: strides {tuple(out.stride())}, expected {tuple(want)} (laid out as its input)"


def run_rope(case: Case, backend: str, device: torch.device, oracles: list[str], result):
    from .runner import _f64, forced_strict  # runner.py imports this module for its RUNNERS

    p, dtype, tol = case.params, case.dtype, case.tolerance
    interleaved = p["interleaved"]
    if p.get("inplace"):
        return _run_rope_inplace(case, backend, device, oracles, result)
    base, _, _, cos, sin, dq_out, dk_out = rope_inputs(case, device, dtype)
    q, k = _same_views(case, base.requires_grad_(True))  # views made after: they carry base's gradient
    with forced_strict(backend):
        q_out, k_out = portable_ops.rope(q, k, cos, sin, interleaved=interleaved)
        dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (dq_out, dk_out), allow_unused=True)
    dq = torch.zeros_like(q) if dq is None else dq  # no element: nothing reached it
    dk = torch.zeros_like(k) if dk is None else dk
    _check_layout(result, "q_out", q_out, q)
    _check_layout(result, "k_out", k_out, k)
    q64, k64, cos64, sin64, dq64, dk64 = _f64((q, k, cos, sin, dq_out, dk_out))
    for oracle in oracles:
        ref_q, ref_k, ref_dq, ref_dk = _oracle(oracle, q64, k64, cos64, sin64, dq64, dk64, interleaved)
        for label, got, want in (("q_out", q_out, ref_q), ("k_out", k_out, ref_k), ("dq", dq, ref_dq),
                                 ("dk", dk, ref_dk)):
            result.check(oracle, label, got, want if want is not None else torch.zeros_like(got, dtype=F64), *tol)


def _run_rope_inplace(case: Case, backend: str, device: torch.device, oracles: list[str], result):
    from .runner import _f64, forced_strict

    p, dtype, tol = case.params, case.dtype, case.tolerance
    interleaved = p["interleaved"]
    base, q, k, cos, sin, _, _ = rope_inputs(case, device, dtype)
    before = base.clone()
    q64, k64, cos64, sin64 = _f64((q, k, cos, sin))
    # which elements of base are rotated: the first R dims of each head of q and k, found through the same views
    touched = torch.zeros(base.shape, dtype=torch.bool)
    t_q, t_k = _same_views(case, touched)
    t_q[..., :p["R"]] = True
    t_k[..., :p["R"]] = True
    with forced_strict(backend), torch.no_grad():
        got = portable_ops.rope_(q, k, cos, sin, interleaved=interleaved)
    if got[0] is not q or got[1] is not k:
        result.failure = "rope_ must return q and k themselves"
    kept = ~touched.to(device)
    result.check("float64", "elements rope_ does not rotate", base[kept], before[kept], 0.0, 0.0)
    for oracle in oracles:
        ref_q, ref_k, _, _ = _oracle(oracle, q64, k64, cos64, sin64, None, None, interleaved)
        result.check(oracle, "q after rope_", q, ref_q, *tol)
        result.check(oracle, "k after rope_", k, ref_k, *tol)


def _same_views(case: Case, base: torch.Tensor):
    """q and k as :func:`rope_inputs` views them, of another tensor of base's shape."""
    p = case.params
    b, hq, hk, s, d = p["B"], p["Hq"], p["Hk"], p["S"], p["D"]
    if p.get("layout", "contiguous") == "contiguous":
        q, k = base.split([b * hq * s * d, b * hk * s * d])
        return q.view(b, hq, s, d), k.view(b, hk, s, d)
    q, k, _v = (t.transpose(1, 2) for t in base[..., -d:].split([hq, hk, hk], dim=2))
    return q, k
