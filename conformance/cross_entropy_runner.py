"""The runner of the ``linear_cross_entropy`` family: the loss and the gradients of hidden, weight and bias.

Inputs are drawn from the case's seed on the CPU and moved to the backend's device; the call runs forced and strict
(``runner.forced_strict``) with the case's chunk budget. Oracles, in float64 on the inputs as the backend saw them
(rounded to the case's dtype), with the logits rounded to that dtype too (``F.linear`` returns them in it: the
gradient passes that rounding straight through): ``float64``, the definition's steps
(``portable_ops/definitions/linear_cross_entropy.py``), and ``torch``, ``F.cross_entropy`` over ``F.linear`` with
the softcap written out (Gemma 2's ``softcap * tanh(logits / softcap)``), for the reference backend.

The upstream gradient of a ``"mean"`` is the number of tokens it averages (of ``"sum"`` 0.75, of ``"none"`` one
draw per token), so every gradient is of the size of a sum's, O(1), where the tolerances' atol means what it means
for the other families.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import portable_ops
from portable_ops import lm_head
from portable_ops.definitions.linear_cross_entropy import capped, reduced, token_losses

from .cases import Case
from .tolerances import GRADIENT_FACTOR

F64 = torch.float64


def cross_entropy_inputs(case: Case):
    """``hidden, weight, bias, target`` (CPU; floats float32, bias None without one): hidden transposed out of
    its two leading dims where the case says, the case's ``ignored`` tokens (spread over the batch) set to
    ``ignore_index``."""
    p = case.params
    gen = torch.Generator().manual_seed(case.seed)
    shape, h, v = p["shape"], p["H"], p["V"]
    stored = (shape[1], shape[0], *shape[2:]) if p.get("transposed") else shape
    hidden = torch.randn(*stored, h, generator=gen)
    if p.get("transposed"):
        hidden = hidden.transpose(0, 1)
    weight = torch.randn(v, h, generator=gen) * (p["logit_scale"] / h ** 0.5)
    bias = torch.randn(v, generator=gen) if p["bias"] else None
    target = torch.randint(0, v, shape, generator=gen)
    flat = target.view(-1)
    flat[torch.randperm(flat.numel(), generator=gen)[:p["ignored"]]] = p["ignore_index"]
    return hidden, weight, bias, target


def _upstream(case: Case, loss, target):
    p = case.params
    if p["reduction"] == "none":
        return torch.randn(loss.shape, generator=torch.Generator().manual_seed(case.seed + 1)).to(loss.device)
    if p["reduction"] == "sum":
        return torch.tensor(0.75, device=loss.device)
    return (target != p["ignore_index"]).sum().clamp(min=1).to(loss)


def _oracle(oracle, hidden, weight, bias, target, dtype, p):
    """The loss from float64 leaves, the logits rounded to ``dtype`` on the way (straight through for the
    gradient)."""
    logits = F.linear(hidden.reshape(-1, hidden.shape[-1]), weight, bias)
    logits = logits + (logits.detach().to(dtype).to(F64) - logits.detach())
    flat = target.reshape(-1)
    if oracle == "float64":
        z = capped(logits, p["softcap"])
        losses = token_losses(z, torch.logsumexp(z, -1), flat, p["ignore_index"], p["label_smoothing"])
        loss = reduced(losses, flat != p["ignore_index"], p["reduction"])
    else:
        z = logits if p["softcap"] is None else p["softcap"] * torch.tanh(logits / p["softcap"])
        loss = F.cross_entropy(z, flat, ignore_index=p["ignore_index"], label_smoothing=p["label_smoothing"],
                               reduction=p["reduction"])
    return loss.reshape(target.shape) if p["reduction"] == "none" else loss


def run_linear_cross_entropy(case: Case, backend: str, device: torch.device, oracles: list[str], result):
    from .runner import _f64, forced_strict  # runner.py imports this module for its RUNNERS

    p, dtype = case.params, case.dtype
    hidden, weight, bias, target = cross_entropy_inputs(case)
    leaves = {name: t.to(device, dtype).requires_grad_(True) for name, t in
              (("hidden", hidden), ("weight", weight), ("bias", bias)) if t is not None}
    target = target.to(device)
    with forced_strict(backend), lm_head.chunk_budget(p["budget"]):
        loss = portable_ops.linear_cross_entropy(leaves["hidden"], leaves["weight"], target, bias=leaves.get("bias"),
                                                 ignore_index=p["ignore_index"], label_smoothing=p["label_smoothing"],
                                                 reduction=p["reduction"], softcap=p["softcap"])
        upstream = _upstream(case, loss, target)
        grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()), upstream)))
    tol = case.tolerance
    grad_tol = tol.scaled(GRADIENT_FACTOR)
    target = target.cpu()
    for oracle in oracles:
        refs = [t.requires_grad_(True) for t in _f64(leaves.values())]
        ref = _oracle(oracle, *refs, *([None] if bias is None else []), target, dtype, p)
        ref_grads = torch.autograd.grad(ref, refs, upstream.to("cpu", F64), allow_unused=True)
        result.check(oracle, "loss", loss, ref.detach(), *tol)
        for (name, got), leaf, want in zip(grads.items(), refs, ref_grads):
            result.check(oracle, f"d{name}", got, torch.zeros_like(leaf) if want is None else want, *grad_tol)
