"""Fused Adam / AdamW / AMSGrad: one NKI kernel launch updates every tensor of a step, in place.

The kernel takes the step's tensors as lists (a table it walks at specialization time, NKI
unrolling the loop): each tensor is its flat HBM view, updated in place, with
``n // 128 * 128`` elements seen as a ``[128, F]`` body walked in ``[128, 1024]`` tiles, and the
``n % 128`` elements left over gathered, one tensor per partition, into shared tail tiles
(``[<=128, <=127]``) so that odd-sized tensors cost a row of a tile, not a tile. Why a table and
not one flat ``[128, F]`` view of all tensors: the tensors are separate allocations (a flat view
would mean concatenating and copying back, the cost this kernel exists to avoid), and each
tensor keeps its own dtype and step count.

Everything that changes from step to step is data, not code: a ``[128, C]`` float32 HBM tensor
of hyperparameters computed on the device with a few torch ops (no host synchronisation), so one
compiled kernel serves every step and every learning-rate schedule. Columns: the shared ones
(:data:`SHARED`), then per tensor ``-lr / bias_correction1`` and ``1 / bias_correction2`` (steps
may differ between tensors), then the same pair per tail tile, one row per tensor of that tile.
Only structural flags (amsgrad, decay mode, whether there is a gate or a grad multiplier) and the
tensors' shapes and dtypes select a compiled variant.

Semantics are ``backends/reference/adam.py``: tiles are loaded into float32 (the DMA converts),
the engines compute in float32, and each store rounds once to its tensor's dtype (the DMA
converts back), so float32 moments under bf16/fp16 params need no variant. A non-zero
``found_inf`` keeps every old value (predicated copies of the new values onto the old tiles, so
NaN/inf grads cannot leak) and the step counts. The work is spread over the engines so the
Vector Engine stays under the HBM time (docs/backends/nki.md, cost model): the Scalar Engine
scales the grads and does sqrt and reciprocal, GpSimd the element-wise products.
"""

from __future__ import annotations

import torch

from .compat import nki, nisa, nl
from .runtime import launch

PMAX = 128
F_TILE = 1024  # fp32 elements per partition per tile: 4 KiB DMA payloads; ~16 live tiles = 64 KiB of SBUF
MAX_TENSORS = 1024  # per launch: their hyperparameter columns (8 KiB per partition) stay in SBUF
# shared hyperparameter columns: the grad multiplier, decay (wd for L2, 1 - lr*wd decoupled),
# 1 - beta1, sqrt(1 - beta2), beta2, eps, and the found_inf gate (1.0 = apply the step)
SHARED = (MULT, DECAY, ONE_MINUS_BETA1, SQRT_ONE_MINUS_BETA2, BETA2, EPS, APPLY) = tuple(range(7))
NEG_STEP, INV_BC2 = 0, 1  # offsets within a tensor's (or a tail tile's) pair of columns
PAIR = 2
DECAY_NONE, DECAY_L2, DECAY_DECOUPLED = 0, 1, 2


def _update(p, g, m, v, vmax, hp, neg_step, inv_bc2, shape, amsgrad, decay_mode, scale_grad):
    """New (p, m, v, vmax) float32 SBUF tiles from the loaded ones; ``neg_step`` / ``inv_bc2`` are
    the ``[rows, 1]`` columns of the tensor (or tail tile) at hand."""
    rows = shape[0]

    def col(i):
        return hp[0:rows, i:i + 1]

    def tile():
        return nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)

    grad = g
    if scale_grad:  # g / grad_scale * clip_coef, negated under maximize
        grad = tile()
        nisa.activation(grad, op=nl.copy, data=g, scale=col(MULT))
    if decay_mode == DECAY_L2:  # + wd * p
        with_decay = tile()
        nisa.scalar_tensor_tensor(with_decay, data=p, op0=nl.multiply, operand0=col(DECAY), op1=nl.add, operand1=grad)
        grad = with_decay
    # m <- m + (1 - beta1) (g - m), torch.lerp's form (an inf moment turns NaN as in torch)
    m_new = tile()
    nisa.tensor_tensor(m_new, grad, m, op=nl.subtract, engine=nisa.engine.gpsimd)
    nisa.scalar_tensor_tensor(m_new, data=m_new, op0=nl.multiply, operand0=col(ONE_MINUS_BETA1), op1=nl.add,
                              operand1=m)
    # v <- beta2 v + (1 - beta2) g^2, the square on the Scalar Engine
    gv, v_new = tile(), tile()
    nisa.activation(gv, op=nl.square, data=grad, scale=col(SQRT_ONE_MINUS_BETA2))
    nisa.scalar_tensor_tensor(v_new, data=v, op0=nl.multiply, operand0=col(BETA2), op1=nl.add, operand1=gv)
    second, vmax_new = v_new, None
    if amsgrad:
        vmax_new = tile()
        nisa.tensor_tensor(vmax_new, vmax, v_new, op=nl.maximum, engine=nisa.engine.gpsimd)
        second = vmax_new
    # m / (sqrt(v / bias_correction2) + eps)
    den = tile()
    nisa.activation(den, op=nl.sqrt, data=second, scale=inv_bc2)
    nisa.activation(den, op=nl.reciprocal, data=den, bias=col(EPS))
    nisa.tensor_tensor(den, m_new, den, op=nl.multiply, engine=nisa.engine.gpsimd)
    # p <- p (1 - lr wd) - lr / bias_correction1 * m / den
    decayed = p
    if decay_mode == DECAY_DECOUPLED:
        decayed = tile()
        nisa.activation(decayed, op=nl.copy, data=p, scale=col(DECAY))
    p_new = tile()
    nisa.scalar_tensor_tensor(p_new, data=den, op0=nl.multiply, operand0=neg_step, op1=nl.add, operand1=decayed)
    return p_new, m_new, v_new, vmax_new


def _part(tile, row, count):
    """The whole tile (``row`` None), or ``count`` elements of partition ``row``."""
    return tile if row is None else tile[row:row + 1, 0:count]


def _step_tiles(views, hp, c0, pred, shape, flags):
    """Load, update and store one tile's worth. ``views[k]`` (k: 0 param, 1 grad, 2 exp_avg,
    3 exp_avg_sq, 4 max_exp_avg_sq) lists ``(row, count, hbm_view)``: where the HBM view lands in
    the tile. ``c0`` is the first of this tile's NEG_STEP / INV_BC2 columns."""
    amsgrad, decay_mode, gated, scale_grad = flags
    rows = shape[0]
    loaded = []
    for k in range(5 if amsgrad else 4):
        tile = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
        for row, count, view in views[k]:
            nisa.dma_copy(dst=_part(tile, row, count), src=view)  # the DMA converts bf16/fp16 to float32
        loaded.append(tile)
    p, g, m, v = loaded[:4]
    vmax = loaded[4] if amsgrad else None
    new = _update(p, g, m, v, vmax, hp, hp[0:rows, c0 + NEG_STEP:c0 + NEG_STEP + 1],
                  hp[0:rows, c0 + INV_BC2:c0 + INV_BC2 + 1], shape, amsgrad, decay_mode, scale_grad)
    for k, old, fresh in ((0, p, new[0]), (2, m, new[1]), (3, v, new[2]), (4, vmax, new[3])):
        if fresh is None:
            continue
        if gated:  # keep the old values where found_inf is set
            nisa.tensor_copy_predicated(dst=old, src=fresh, predicate=pred[0:rows, 0:shape[1]])
            fresh = old
        for row, count, view in views[k]:
            nisa.dma_copy(dst=view, src=_part(fresh, row, count))  # rounds once to the tensor's dtype


@nki.jit
def adam_kernel(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, hyper, amsgrad=False,
                decay_mode=DECAY_NONE, gated=False, scale_grad=False):
    """One Adam step, in place, over lists of 1-D HBM tensors (the flat views of each parameter,
    its grad and moments; ``max_exp_avg_sqs`` is read only under ``amsgrad``)."""
    n = len(params)
    state = (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)
    flags = (amsgrad, decay_mode, gated, scale_grad)
    hp = nl.ndarray((PMAX, hyper.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=hp, src=hyper)
    pred = None
    if gated:  # uint8 predicate: 1 where the step applies (found_inf == 0)
        ones = nl.ndarray((PMAX, F_TILE), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=ones, value=1.0)
        pred = nl.ndarray((PMAX, F_TILE), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=pred, data=ones, op0=nl.multiply, operand0=hp[0:PMAX, APPLY:APPLY + 1])

    # bodies: tensor i as [128, F], in [128, F_TILE] tiles and one partial tile
    for i in range(n):
        F = params[i].shape[0] // PMAX
        for f0 in range(0, F, F_TILE):
            fs = min(F_TILE, F - f0)
            views = [[(None, None, t[i][0:PMAX * F].reshape((PMAX, F))[0:PMAX, f0:f0 + fs])] for t in state]
            _step_tiles(views, hp, len(SHARED) + PAIR * i, pred, (PMAX, fs), flags)

    # tails: the n % 128 last elements of each tensor, one tensor per partition of a shared tile
    tails = [i for i in range(n) if params[i].shape[0] % PMAX]
    for b in range(0, len(tails), PMAX):
        block = tails[b:b + PMAX]
        views = [[] for _ in state]
        for r, i in enumerate(block):
            size = params[i].shape[0]
            start = size - size % PMAX
            for k, t in enumerate(state):
                views[k].append((r, size - start, t[i][start:size].reshape((1, size - start))))
        width = max(params[i].shape[0] % PMAX for i in block)
        _step_tiles(views, hp, len(SHARED) + PAIR * (n + b // PMAX), pred, (len(block), width), flags)


# ----------------------------------------------------------------------------- host side
def hyperparameters(steps, sizes, *, device, beta1, beta2, lr, weight_decay, eps, maximize, decoupled_weight_decay,
                    grad_scale, found_inf, clip_coef) -> torch.Tensor:
    """The ``[128, C]`` float32 tensor the kernel reads, computed on ``device`` (no sync). ``steps``
    are the tensors' step counts before this step, ``sizes`` their element counts."""
    f32 = torch.float32
    step = torch.stack([s.reshape(()) for s in steps]).to(device, f32) + 1
    lr_t = (lr.to(device, f32).reshape(()) if isinstance(lr, torch.Tensor)
            else torch.tensor(lr, dtype=f32, device=device))
    one = torch.ones((), dtype=f32, device=device)
    mult = one
    if grad_scale is not None:
        mult = mult / grad_scale.to(device, f32).reshape(())
    if clip_coef is not None:
        mult = mult * clip_coef.to(device, f32).reshape(())
    if maximize:
        mult = -mult
    decay = (1 - lr_t * weight_decay) if decoupled_weight_decay else one * weight_decay
    apply = one if found_inf is None else (found_inf.to(device).reshape(()) == 0).to(f32)
    shared = torch.stack([mult, decay, one * (1 - beta1), one * (1 - beta2) ** 0.5, one * beta2, one * eps, apply])
    per_tensor = torch.stack([-lr_t / (1 - beta1 ** step), 1 / (1 - beta2 ** step)], dim=1)  # [n, 2]
    tails = [i for i, size in enumerate(sizes) if size % 128]
    blocks = []
    for b in range(0, len(tails), 128):  # tail tile b: row r holds the pair of tensor tails[b + r]
        rows = torch.tensor(tails[b:b + 128], device=device)
        blocks.append(torch.nn.functional.pad(per_tensor.index_select(0, rows), (0, 0, 0, 128 - len(rows))))
    row = torch.cat([shared, per_tensor.reshape(-1)]).reshape(1, -1).expand(128, -1)
    return torch.cat([row, *blocks], dim=1).contiguous()


def adam_supports(call) -> list[str]:
    """Dtypes are declared (``BACKEND``); the kernel updates flat views of the state in place."""
    reasons = []
    for key in ("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"):
        if not all(map(torch.Tensor.is_contiguous, call[key])):
            i = next(i for i, t in enumerate(call[key]) if not t.is_contiguous())
            reasons.append(f"{key}[{i}] is not contiguous (the NKI Adam kernel updates flat views in place)")
            break
    return reasons


def adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, amsgrad, beta1, beta2, lr,
         weight_decay, eps, maximize, decoupled_weight_decay, grad_scale=None, found_inf=None, clip_coef=None):
    decay_mode = DECAY_NONE if weight_decay == 0 else (DECAY_DECOUPLED if decoupled_weight_decay else DECAY_L2)
    flags = dict(amsgrad=amsgrad, decay_mode=decay_mode, gated=found_inf is not None,
                 scale_grad=grad_scale is not None or clip_coef is not None or maximize)
    live = [i for i, p in enumerate(params) if p.numel()]
    for start in range(0, len(live), MAX_TENSORS):
        chosen = live[start:start + MAX_TENSORS]
        hyper = hyperparameters([state_steps[i] for i in chosen], [params[i].numel() for i in chosen],
                                device=params[chosen[0]].device, beta1=beta1, beta2=beta2, lr=lr,
                                weight_decay=weight_decay, eps=eps, maximize=maximize,
                                decoupled_weight_decay=decoupled_weight_decay, grad_scale=grad_scale,
                                found_inf=found_inf, clip_coef=clip_coef)
        lists = [params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else exp_avg_sqs]
        flat = [[lst[i].reshape(-1) for i in chosen] for lst in lists]  # views (grads may be copied: read only)
        launch(adam_kernel, *flat, hyper, **flags)
    if state_steps:
        if found_inf is None:
            torch._foreach_add_(state_steps, 1.0)
        else:  # a skipped step keeps its count
            s = state_steps[0]
            torch._foreach_add_(state_steps, (found_inf.to(s.device).reshape(()) == 0).to(s.dtype))
