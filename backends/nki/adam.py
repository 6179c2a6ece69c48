"""Fused Adam / AdamW / AMSGrad as one NKI kernel over a flattened parameter.

The parameter (and its grad and moments) is seen as ``[128, F]`` (partition p holds elements
``p*F .. p*F+F-1``) plus a ``[T, 1]`` tail for the last ``T = n % 128`` elements; the same
kernel runs on both. Along F the kernel walks ``[P, 2048]`` tiles and one static partial tile.

Everything that changes from step to step is data, not code: a ``[128, 10]`` float32 HBM tensor
of hyperparameters (negated step size ``lr / bias_correction1``, ``1 / sqrt(bias_correction2)``,
the weight-decay factor, the grad multiplier ``clip_coef / grad_scale`` (negated under
``maximize``), the ``found_inf`` gate, betas, eps) is computed on the device with a few torch
ops, so one compiled kernel serves every step and every learning-rate schedule, with no host
synchronisation. Only structural flags (amsgrad, decay mode, whether there is a gate or a grad
multiplier) and shapes select a compiled variant.

Semantics are ``backends/reference/adam.py``: arithmetic in fp32 whatever the storage dtype,
one rounding per stored tensor (the moments may be float32 under bf16/fp16 params: tiles are
loaded in their own dtype and outputs take their input's, so that needs no variant), and a non-zero ``found_inf`` leaves param, moments and step
unchanged (the new values are discarded with a predicated copy, so NaN/inf grads cannot leak).
"""

from __future__ import annotations

import torch

from .compat import nki, nisa, nl
from .runtime import launch

F_TILE = 2048  # fp32 elements per partition per tile: 8 KiB, ~12 live tiles -> ~100 KiB of SBUF
(NEG_STEP, INV_BC2, DECAY, GRAD_MULT, APPLY, BETA1, ONE_MINUS_BETA1, BETA2, ONE_MINUS_BETA2, EPS) = range(10)
N_HYPER = 10
DECAY_NONE, DECAY_L2, DECAY_DECOUPLED = 0, 1, 2


def _adam_tile(outs, ins, hp, pred, f0, fs, amsgrad, decay_mode, gated, scale_grad):
    param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq = ins
    p_out, m_out, v_out, vmax_out = outs
    P = param.shape[0]
    f32 = nl.float32

    def load(src):
        tile = nl.ndarray((P, fs), dtype=src.dtype, buffer=nl.sbuf)
        nisa.dma_copy(tile, src[0:P, f0:f0 + fs])
        return tile

    def col(i):
        return hp[0:P, i:i + 1]

    p, g, m, v = load(param), load(grad), load(exp_avg), load(exp_avg_sq)
    vmax = load(max_exp_avg_sq) if amsgrad else None

    gf = nl.ndarray((P, fs), dtype=f32, buffer=nl.sbuf)
    if scale_grad:  # grad / grad_scale * clip_coef, negated under maximize
        nisa.tensor_scalar(gf, g, op0=nl.multiply, operand0=col(GRAD_MULT))
    else:
        nisa.tensor_copy(gf, g)
    pf = p
    if decay_mode == DECAY_DECOUPLED:  # p * (1 - lr * wd)
        pf = nl.ndarray((P, fs), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_scalar(pf, p, op0=nl.multiply, operand0=col(DECAY))
    elif decay_mode == DECAY_L2:  # grad + wd * p
        nisa.scalar_tensor_tensor(gf, data=p, op0=nl.multiply, operand0=col(DECAY), op1=nl.add, operand1=gf)

    # m <- m + (1 - beta1) * (g - m)   (torch.lerp)
    m_new = nl.ndarray((P, fs), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_tensor(m_new, gf, m, op=nl.subtract)
    nisa.scalar_tensor_tensor(m_new, data=m_new, op0=nl.multiply, operand0=col(ONE_MINUS_BETA1), op1=nl.add, operand1=m)
    # v <- v * beta2 + ((1 - beta2) * g) * g
    sq = nl.ndarray((P, fs), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(sq, gf, op0=nl.multiply, operand0=col(ONE_MINUS_BETA2))
    nisa.tensor_tensor(sq, sq, gf, op=nl.multiply)
    v_new = nl.ndarray((P, fs), dtype=f32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(v_new, data=v, op0=nl.multiply, operand0=col(BETA2), op1=nl.add, operand1=sq)
    second = v_new
    vmax_new = None
    if amsgrad:
        vmax_new = nl.ndarray((P, fs), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_tensor(vmax_new, vmax, v_new, op=nl.maximum)
        second = vmax_new
    # 1 / (sqrt(v) / sqrt(bias_correction2) + eps)
    den = nl.ndarray((P, fs), dtype=f32, buffer=nl.sbuf)
    nisa.activation(den, op=nl.sqrt, data=second)
    nisa.tensor_scalar(den, den, op0=nl.multiply, operand0=col(INV_BC2), op1=nl.add, operand1=col(EPS))
    nisa.reciprocal(den, den)
    # p <- p - (lr / bias_correction1) * m / den, rounded once to the parameter's dtype
    nisa.tensor_tensor(den, m_new, den, op=nl.multiply)
    p_new = nl.ndarray((P, fs), dtype=param.dtype, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(p_new, data=den, op0=nl.multiply, operand0=col(NEG_STEP), op1=nl.add, operand1=pf)

    def store(dst, new, old):
        if new.dtype != dst.dtype:
            cast = nl.ndarray((P, fs), dtype=dst.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(cast, new)
            new = cast
        if gated:  # keep the old values where found_inf is set
            nisa.tensor_copy_predicated(old, new, pred[0:P, 0:fs])
            new = old
        nisa.dma_copy(dst[0:P, f0:f0 + fs], new)

    store(p_out, p_new, p)
    store(m_out, m_new, m)
    store(v_out, v_new, v)
    if amsgrad:
        store(vmax_out, vmax_new, vmax)


@nki.jit
def adam_kernel(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, hyper,
                amsgrad=False, decay_mode=DECAY_NONE, gated=False, scale_grad=False):
    """One Adam step on ``[P, F]`` HBM tensors (P <= 128); returns the new (param, exp_avg,
    exp_avg_sq[, max_exp_avg_sq]). ``max_exp_avg_sq`` is ignored unless ``amsgrad``."""
    P, F = param.shape
    p_out = nl.ndarray(param.shape, dtype=param.dtype, buffer=nl.shared_hbm)
    m_out = nl.ndarray(exp_avg.shape, dtype=exp_avg.dtype, buffer=nl.shared_hbm)
    v_out = nl.ndarray(exp_avg_sq.shape, dtype=exp_avg_sq.dtype, buffer=nl.shared_hbm)
    vmax_out = None
    if amsgrad:
        vmax_out = nl.ndarray(max_exp_avg_sq.shape, dtype=max_exp_avg_sq.dtype, buffer=nl.shared_hbm)

    hp = nl.ndarray((P, N_HYPER), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(hp, hyper[0:P, 0:N_HYPER])
    pred = None
    if gated:  # uint8 predicate tile: 1 where the step applies (found_inf == 0)
        ones = nl.ndarray((P, F_TILE), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(ones, 1.0)
        pred = nl.ndarray((P, F_TILE), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.tensor_scalar(pred, ones, op0=nl.multiply, operand0=hp[0:P, APPLY:APPLY + 1])

    ins = (param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq)
    outs = (p_out, m_out, v_out, vmax_out)
    flags = (amsgrad, decay_mode, gated, scale_grad)
    n_full = F // F_TILE
    for t in nl.affine_range(n_full):
        _adam_tile(outs, ins, hp, pred, t * F_TILE, F_TILE, *flags)
    if F % F_TILE:  # the static partial tile at the end of the free axis
        _adam_tile(outs, ins, hp, pred, n_full * F_TILE, F % F_TILE, *flags)
    if amsgrad:
        return p_out, m_out, v_out, vmax_out
    return p_out, m_out, v_out


# ----------------------------------------------------------------------------- host side
def hyperparameters(step, *, device, beta1, beta2, lr, weight_decay, eps, maximize, decoupled_weight_decay,
                    grad_scale, found_inf, clip_coef) -> torch.Tensor:
    """The ``[128, N_HYPER]`` float32 tensor the kernel reads, computed on ``device`` (no sync)."""
    f32 = torch.float32
    step = step.to(device, f32).reshape(()) + 1
    lr_t = lr.to(device, f32).reshape(()) if isinstance(lr, torch.Tensor) else torch.tensor(lr, dtype=f32, device=device)
    bc1 = 1 - beta1 ** step
    bc2_sqrt = (1 - beta2 ** step).sqrt()
    one = torch.ones((), dtype=f32, device=device)
    decay = (1 - lr_t * weight_decay) if decoupled_weight_decay else one * weight_decay
    mult = one
    if grad_scale is not None:
        mult = mult / grad_scale.to(device, f32).reshape(())
    if clip_coef is not None:
        mult = mult * clip_coef.to(device, f32).reshape(())
    if maximize:
        mult = -mult
    apply = one if found_inf is None else (found_inf.to(device).reshape(()) == 0).to(f32)
    row = torch.stack([-(lr_t / bc1), 1 / bc2_sqrt, decay, mult, apply, one * beta1, one * (1 - beta1),
                       one * beta2, one * (1 - beta2), one * eps])
    return row.reshape(1, N_HYPER).expand(128, N_HYPER).contiguous()


SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def adam_supports(call) -> list[str]:
    reasons = []
    tensors = [t for key in ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs") for t in call[key]]
    bad = sorted({str(t.dtype).removeprefix("torch.") for t in tensors if t.dtype not in SUPPORTED_DTYPES})
    if bad:
        reasons.append(f"NKI Adam takes float32, bfloat16 and float16 tensors; got {', '.join(bad)} "
                       "(NeuronCore engines have no float64)")
    return reasons


def adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, amsgrad, beta1, beta2, lr,
         weight_decay, eps, maximize, decoupled_weight_decay, grad_scale=None, found_inf=None, clip_coef=None):
    decay_mode = DECAY_NONE if weight_decay == 0 else (DECAY_DECOUPLED if decoupled_weight_decay else DECAY_L2)
    scale_grad = grad_scale is not None or clip_coef is not None or maximize
    gated = found_inf is not None
    for i, param in enumerate(params):
        step_t = state_steps[i]
        n = param.numel()
        if n:
            hp = hyperparameters(step_t, device=param.device, beta1=beta1, beta2=beta2, lr=lr,
                                 weight_decay=weight_decay, eps=eps, maximize=maximize,
                                 decoupled_weight_decay=decoupled_weight_decay, grad_scale=grad_scale,
                                 found_inf=found_inf, clip_coef=clip_coef)
            states = [param, grads[i], exp_avgs[i], exp_avg_sqs[i]]
            states.append(max_exp_avg_sqs[i] if amsgrad else exp_avg_sqs[i])
            flat = [t.reshape(-1) for t in states]
            main = (n // 128) * 128
            pieces = []
            if main:
                pieces.append(launch(adam_kernel, *[f[:main].reshape(128, main // 128) for f in flat], hp,
                                     amsgrad=amsgrad, decay_mode=decay_mode, gated=gated, scale_grad=scale_grad))
            if n - main:
                pieces.append(launch(adam_kernel, *[f[main:].reshape(n - main, 1) for f in flat], hp,
                                     amsgrad=amsgrad, decay_mode=decay_mode, gated=gated, scale_grad=scale_grad))
            targets = [param, exp_avgs[i], exp_avg_sqs[i]] + ([max_exp_avg_sqs[i]] if amsgrad else [])
            for k, dst in enumerate(targets):
                new = torch.cat([piece[k].reshape(-1) for piece in pieces]) if len(pieces) > 1 else pieces[0][k]
                dst.copy_(new.reshape(dst.shape))
        if found_inf is None:
            step_t.add_(1)
        else:
            step_t.add_((found_inf.to(step_t.device).reshape(()) == 0).to(step_t.dtype))
