"""Fused Adam / AdamW / AMSGrad: one NKI kernel launch updates every tensor of a step, in place.

The kernel walks the step's tensors as a table (``tensor_table``: each tensor's flat HBM view as a
``[128, F]`` body in ``[128, 1024]`` tiles, its ``n % 128`` leftover elements one row of a tail tile that
tensors of the same dtypes share, so odd-sized tensors cost a row of a tile, not a tile). Why a table and
not one flat ``[128, F]`` view of all tensors: the tensors are separate allocations (a flat view would mean
concatenating and copying back, the cost this kernel exists to avoid), and each tensor keeps its own dtype
and step count.

Everything that changes from step to step is data, not code: a ``[128, C]`` float32 HBM tensor
of hyperparameters computed on the device with a few torch ops (no host synchronisation), so one
compiled kernel serves every step and every learning-rate schedule. Columns: the shared ones
(:data:`SHARED`), then per tensor ``-lr / bias_correction1`` and ``1 / bias_correction2`` (steps
may differ between tensors), then the same pair per tail tile, one row per tensor of that tile.
Only structural flags (amsgrad, decay mode, whether there is a gate, whether the grads are scaled, maximize) and
the tensors' shapes and dtypes select a compiled variant.

Semantics are ``backends/reference/adam.py``: tiles are loaded in their tensors' dtypes (DMAs do not
convert), the engines read them and compute in float32, and each new value is rounded once to its
tensor's dtype on an engine before the DMA stores it, so float32 moments under bf16/fp16 params need no
variant. The first moment is ``beta1 m + (1 - beta1) g`` (one VectorE pass; where a grad is infinite its
kind of non-finite value may differ from torch's lerp, which the contract leaves open, and the param is
NaN as torch's). With ``grad_scale`` or ``clip_coef`` set, each grad is stored back as ``grad / grad_scale *
clip_coef`` (before maximize's negation), rounded once to its dtype, as torch's fused kernels unscale grads in
place; otherwise grads are only read. A non-zero ``found_inf`` keeps every old value, grads included (predicated
copies of the new values onto the old tiles, so NaN/inf grads cannot leak), and the step counts.

``1 / (sqrt(v / bias_correction2) + eps)`` runs on the Scalar Engine, whose sqrt is valid on
[2^-116, 2^118] and reciprocal on +-[2^-42, 2^42] only (AWS's 'Supported Activation Functions'; the
emulator refuses other inputs). The sqrt takes ``x + 2^-116``, which brings ``x = 0`` (an untouched
embedding row's moment) into the domain and leaves every ``x >= 2^-91`` as it is; below that the sqrt
moves by at most 2^-58, under half an ulp of ``eps >= 2^-33`` (default 1e-8): one rounding of
``sqrt + eps`` at most. Where ``x`` is over 2^84, infinite or NaN, it is replaced by 0 and the step's
factor by 0: an infinite moment then gives ``inf * 0 = NaN`` and a finite one over an infinite second
moment 0, torch's answers (a finite ``x`` over 2^84, a grad past ~2^42 a step, is the one case that
differs: no update there). ``eps`` outside [2^-42, 2^16] is declined (the reciprocal's domain). The work
is spread over the engines so each stays under the HBM time (docs/backends/nki.md, cost model): the
Scalar Engine scales, squares, takes the sqrt and the reciprocal, the Vector Engine the moment updates
and the domain guard's copy, GpSimd the rest.
"""

from __future__ import annotations

import torch

from . import tensor_table
from .compat import nki, nisa, nl
from .runtime import kernel_op, launch, no_outputs

PMAX = 128
F_TILE = 1024  # fp32 elements per partition per tile: 4 KiB DMA payloads; ~20 live tiles = 80 KiB of SBUF
MAX_TENSORS = 1024  # per launch: their hyperparameter columns (8 KiB per partition) stay in SBUF
# shared hyperparameter columns: the grad multiplier, decay (wd for L2, 1 - lr*wd decoupled),
# beta1, 1 - beta1, sqrt(1 - beta2), beta2, eps, and the found_inf gate (1.0 = apply the step)
SHARED = (MULT, DECAY, BETA1, ONE_MINUS_BETA1, SQRT_ONE_MINUS_BETA2, BETA2, EPS, APPLY) = tuple(range(8))
NEG_STEP, INV_BC2 = 0, 1  # offsets within a tensor's (or a tail tile's) pair of columns
PAIR = 2
DECAY_NONE, DECAY_L2, DECAY_DECOUPLED = 0, 1, 2
# The Scalar Engine's sqrt takes [2^-116, 2^118], its reciprocal +-[2^-42, 2^42] (module docstring):
SQRT_BIAS = 2.0 ** -116  # sqrt(x + 2^-116): 0 enters the domain, and x >= 2^-91 is unchanged by the add
SECOND_MAX = 2.0 ** 84  # the largest x whose sqrt (2^42) the reciprocal takes
EPS_RANGE = (2.0 ** -42, 2.0 ** 16)  # eps that keeps sqrt(x) + eps within the reciprocal's domain


def _update(p, g, m, v, vmax, hp, neg_step, inv_bc2, shape, param_dtype, flags):
    """New ``(p, g, m, v, vmax)`` SBUF tiles from the loaded ones (each in its tensor's dtype): p in
    ``param_dtype``, g (the scaled grad to store; None when grads are only read) in the grad's, the moments
    float32. ``neg_step`` / ``inv_bc2`` are the ``[rows, 1]`` columns of the tensor (or tail tile) at hand."""
    amsgrad, decay_mode, scale_grads, maximize = flags
    rows = shape[0]

    def col(i):
        return hp[0:rows, i:i + 1]

    def tile(dtype=nl.float32):
        return nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf)

    grad = g
    if scale_grads or maximize:  # g / grad_scale * clip_coef, negated under maximize
        grad = tile()
        nisa.activation(grad, op=nl.copy, data=g, scale=col(MULT))
    # the grad to store, maximize's negation undone, on GpSimd: ScalarE scales it, VectorE takes the gate's copies
    g_new = tensor_table.as_dtype(grad, g.dtype, negate=maximize, engine=nisa.engine.gpsimd) if scale_grads else None
    if decay_mode == DECAY_L2:  # + wd * p
        with_decay = tile()
        nisa.scalar_tensor_tensor(with_decay, data=p, op0=nl.multiply, operand0=col(DECAY), op1=nl.add, operand1=grad)
        grad = with_decay
    # m <- beta1 m + (1 - beta1) g: the product by 1 - beta1 on the Scalar Engine, the rest one VectorE pass
    scaled, m_new = tile(), tile()
    nisa.activation(scaled, op=nl.copy, data=grad, scale=col(ONE_MINUS_BETA1))
    nisa.scalar_tensor_tensor(m_new, data=m, op0=nl.multiply, operand0=col(BETA1), op1=nl.add, operand1=scaled)
    # v <- beta2 v + (1 - beta2) g^2, the square on the Scalar Engine
    gv, v_new = tile(), tile()
    nisa.activation(gv, op=nl.square, data=grad, scale=col(SQRT_ONE_MINUS_BETA2))
    nisa.scalar_tensor_tensor(v_new, data=v, op0=nl.multiply, operand0=col(BETA2), op1=nl.add, operand1=gv)
    second, vmax_new = v_new, None
    if amsgrad:
        vmax_new = tile()
        nisa.tensor_tensor(vmax_new, vmax, v_new, op=nl.maximum, engine=nisa.engine.gpsimd)
        second = vmax_new
    # m / (sqrt(v / bias_correction2) + eps), the sqrt and reciprocal fed only their domains: where x = v / bc2 is
    # over SECOND_MAX, inf or NaN ('ok' false) x becomes 0 and m's factor 0, so m / inf stays 0 and inf / inf NaN
    x = tile()
    nisa.activation(x, op=nl.copy, data=second, scale=inv_bc2)
    ok = tile(nl.uint8)
    nisa.tensor_scalar(ok, data=x, op0=nl.less_equal, operand0=SECOND_MAX, engine=nisa.engine.gpsimd)
    nisa.tensor_copy_predicated(dst=x, src=0.0, predicate=ok, reverse_pred=True)
    step = tile()
    nisa.activation(step, op=nl.sqrt, data=x, bias=SQRT_BIAS)
    nisa.activation(step, op=nl.reciprocal, data=step, bias=col(EPS))
    nisa.tensor_tensor(step, m_new, step, op=nl.multiply, engine=nisa.engine.gpsimd)
    nisa.tensor_tensor(step, step, ok, op=nl.multiply, engine=nisa.engine.gpsimd)
    nisa.activation(step, op=nl.copy, data=step, scale=neg_step)
    # p <- p (1 - lr wd) - lr / bias_correction1 * m / den, rounded once to the param's dtype
    decayed = p
    if decay_mode == DECAY_DECOUPLED:
        decayed = tile()
        nisa.activation(decayed, op=nl.copy, data=p, scale=col(DECAY))
    p_new = tile(param_dtype)
    nisa.tensor_tensor(p_new, decayed, step, op=nl.add, engine=nisa.engine.gpsimd)
    return p_new, g_new, m_new, v_new, vmax_new


def _step_tiles(views, dtypes, hp, c0, pred, shape, flags):
    """Load, update and store one tile's worth. ``views[k]`` / ``dtypes[k]`` (k: 0 param, 1 grad, 2 exp_avg,
    3 exp_avg_sq, 4 max_exp_avg_sq): where the HBM views land in the tile (tensor_table) and their dtype.
    ``c0`` is the first of this tile's NEG_STEP / INV_BC2 columns."""
    amsgrad, decay_mode, gated, scale_grads, maximize = flags
    rows = shape[0]
    loaded = [tensor_table.load(views[k], dtypes[k], shape) for k in range(5 if amsgrad else 4)]
    p, g, m, v = loaded[:4]
    vmax = loaded[4] if amsgrad else None
    new = _update(p, g, m, v, vmax, hp, hp[0:rows, c0 + NEG_STEP:c0 + NEG_STEP + 1],
                  hp[0:rows, c0 + INV_BC2:c0 + INV_BC2 + 1], shape, dtypes[0],
                  (amsgrad, decay_mode, scale_grads, maximize))
    for k, fresh in enumerate(new):
        if fresh is None:
            continue
        fresh = tensor_table.as_dtype(fresh, dtypes[k])
        if gated:  # keep the old values where found_inf is set
            nisa.tensor_copy_predicated(dst=loaded[k], src=fresh, predicate=pred[0:rows, 0:shape[1]])
            fresh = loaded[k]
        tensor_table.store(fresh, views[k])


@nki.jit
def adam_kernel(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, hyper, amsgrad=False,
                decay_mode=DECAY_NONE, gated=False, scale_grads=False, maximize=False):
    """One Adam step, in place, over lists of 1-D HBM tensors (the flat views of each parameter,
    its grad and moments; ``max_exp_avg_sqs`` is read only under ``amsgrad``, ``grads`` written only under
    ``scale_grads``: grad_scale or clip_coef set)."""
    n = len(params)
    state = (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)
    flags = (amsgrad, decay_mode, gated, scale_grads, maximize)
    hp = nl.ndarray((PMAX, hyper.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=hp, src=hyper)
    pred = None
    if gated:  # uint8 predicate: 1 where the step applies (found_inf == 0)
        ones = nl.ndarray((PMAX, F_TILE), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=ones, value=1.0)
        pred = nl.ndarray((PMAX, F_TILE), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=pred, data=ones, op0=nl.multiply, operand0=hp[0:PMAX, APPLY:APPLY + 1])

    def dtypes(i):
        return [t[i].dtype for t in state]

    for i in range(n):
        for views, shape in tensor_table.body_tiles(state, i, F_TILE):
            _step_tiles(views, dtypes(i), hp, len(SHARED) + PAIR * i, pred, shape, flags)
    blocks = tensor_table.tail_blocks([t.shape[0] for t in params], [tuple(dtypes(i)) for i in range(n)])
    for b, block in enumerate(blocks):
        views, shape = tensor_table.tail_tile(state, block)
        _step_tiles(views, dtypes(block[0]), hp, len(SHARED) + PAIR * (n + b), pred, shape, flags)


# grads are declared written, scaled or not, as torch's _fused_adamw_ declares its grads (a schema is per op)
@kernel_op("adam", no_outputs, mutates_args=("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"))
def adam_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
              exp_avg_sqs: list[torch.Tensor], max_exp_avg_sqs: list[torch.Tensor], hyper: torch.Tensor, amsgrad: bool,
              decay_mode: int, gated: bool, scale_grads: bool, maximize: bool) -> None:
    """The kernel's launch as the op ``portable_ops_nki::adam``: writes params and moments (``max_exp_avg_sqs`` only
    under ``amsgrad``, empty otherwise, as the op's arguments may not alias one another), and the grads under
    ``scale_grads``."""
    launch(adam_kernel, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else exp_avg_sqs, hyper,
           amsgrad=amsgrad, decay_mode=decay_mode, gated=gated, scale_grads=scale_grads, maximize=maximize)


# ----------------------------------------------------------------------------- host side
def hyperparameters(steps, tail_blocks, *, device, beta1, beta2, lr, weight_decay, eps, maximize,
                    decoupled_weight_decay, grad_scale, found_inf, clip_coef) -> torch.Tensor:
    """The ``[128, C]`` float32 tensor the kernel reads, computed on ``device`` (no sync). ``steps``
    are the tensors' step counts before this step, ``tail_blocks`` the kernel's tail tiles
    (``tensor_table.tail_blocks``)."""
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
    shared = torch.stack([mult, decay, one * beta1, one * (1 - beta1), one * (1 - beta2) ** 0.5, one * beta2, one * eps,
                          apply])
    per_tensor = torch.stack([-lr_t / (1 - beta1 ** step), 1 / (1 - beta2 ** step)], dim=1)  # [n, 2]
    blocks = []
    for block in tail_blocks:  # tail tile b: row r holds the pair of tensor block[r]
        rows = torch.tensor(block, device=device)
        blocks.append(torch.nn.functional.pad(per_tensor.index_select(0, rows), (0, 0, 0, 128 - len(rows))))
    row = torch.cat([shared, per_tensor.reshape(-1)]).reshape(1, -1).expand(128, -1)
    return torch.cat([row, *blocks], dim=1).contiguous()


def adam_supports(call) -> list[str]:
    """Dtypes are declared (``BACKEND``); the kernel updates flat views of the state (and of scaled grads) in
    place, and ``eps`` keeps the Scalar Engine's reciprocal in its domain."""
    reasons = []
    low, high = EPS_RANGE
    if not low <= call["eps"] <= high:
        reasons.append(f"eps is {call['eps']!r}, outside [2^-42, 2^16]: the NKI Adam kernel takes 1 / (sqrt(v) + eps) "
                       "on the Scalar Engine, whose reciprocal is valid on +-[2^-42, 2^42] only")
    noncontiguous = tensor_table.first_noncontiguous(call, ("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"))
    if noncontiguous:
        reasons.append(f"{noncontiguous} is not contiguous (the NKI Adam kernel updates flat views in place)")
    return reasons


def adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, amsgrad, beta1, beta2, lr,
         weight_decay, eps, maximize, decoupled_weight_decay, grad_scale=None, found_inf=None, clip_coef=None):
    decay_mode = DECAY_NONE if weight_decay == 0 else (DECAY_DECOUPLED if decoupled_weight_decay else DECAY_L2)
    flags = dict(amsgrad=amsgrad, decay_mode=decay_mode, gated=found_inf is not None,
                 scale_grads=grad_scale is not None or clip_coef is not None, maximize=maximize)
    live = [i for i, p in enumerate(params) if p.numel()]
    for start in range(0, len(live), MAX_TENSORS):
        chosen = live[start:start + MAX_TENSORS]
        lists = (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)  # the last empty unless amsgrad
        flat = [[tensor_table.flat(lst[i]) for i in chosen] if lst else [] for lst in lists]
        blocks = tensor_table.tail_blocks([p.numel() for p in flat[0]],
                                          [tuple(lst[j].dtype for lst in flat if lst) for j in range(len(chosen))])
        hyper = hyperparameters([state_steps[i] for i in chosen], blocks, device=params[chosen[0]].device,
                                beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, maximize=maximize,
                                decoupled_weight_decay=decoupled_weight_decay, grad_scale=grad_scale,
                                found_inf=found_inf, clip_coef=clip_coef)
        adam_step(*flat, hyper, **flags)
    if state_steps:
        if found_inf is None:
            torch._foreach_add_(state_steps, 1.0)
        else:  # a skipped step keeps its count
            s = state_steps[0]
            torch._foreach_add_(state_steps, (found_inf.to(s.device).reshape(()) == 0).to(s.dtype))
