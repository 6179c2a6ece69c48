"""The nki optimizer kernels' grads (docs/adding-a-backend.md, rows ``adam`` and ``sgd``), in the emulator: with
``grad_scale`` or ``clip_coef`` set, a step writes each grad back as ``grad / grad_scale * clip_coef`` (before
maximize's negation and the weight decay), rounded once to its dtype; under a set ``found_inf``, and in a step with
neither, the grads stay bit for bit. The expected grads are float64 arithmetic done here."""

import pytest
import torch
from conftest import assert_bit_identical, snapshot

from portable_ops.backends import nki as nki_backend
from portable_ops.backends.nki import emulator
from portable_ops.backends.nki.emulator import cost

OPS = nki_backend.BACKEND.ops
SHAPES = [(130,), (3, 5)]  # a [128, 1] body with a tail row, and a tail row alone
# A power-of-two scale (GradScaler's) and a clip coefficient of 5 significant bits: the float32 product of a bf16
# grad is exact and a float32 grad's is rounded once, so the float64 value rounded to the grad's dtype is the answer.
GRAD_SCALE, CLIP_COEF = 1024.0, 0.71875
ADAM = dict(beta1=0.9, beta2=0.999, lr=1e-2, eps=1e-8)
SGD = dict(lr=0.1, momentum=0.9)
# (op, options): maximize and weight decay, which the grads written back must not see; a found_inf of 0 (the gate
# that lets the step through) in half of them
VARIANTS = {
    "adam amsgrad maximize l2": ("adam", dict(ADAM, amsgrad=True, maximize=True, weight_decay=0.1,
                                               decoupled_weight_decay=False, found_inf=torch.tensor(0.0))),
    "adamw": ("adam", dict(ADAM, amsgrad=False, maximize=False, weight_decay=0.1, decoupled_weight_decay=True)),
    "sgd nesterov maximize decay": ("sgd", dict(SGD, nesterov=True, maximize=True, weight_decay=0.1, dampening=0.0,
                                                found_inf=torch.tensor(0.0))),
    "sgd momentum dampening": ("sgd", dict(SGD, nesterov=False, maximize=False, weight_decay=0.0, dampening=0.1)),
}


def _state(op, dtype, amsgrad):
    """Seeded params, grads and the op's state lists, in ``dtype``."""
    g = torch.Generator().manual_seed(7)

    def tensors(scale=1.0):
        return [(scale * torch.randn(s, generator=g)).to(dtype) for s in SHAPES]

    params, grads = tensors(), tensors()
    if op == "sgd":
        return dict(params=params, grads=grads, momentum_buffers=tensors(), first_steps=(False,) * len(SHAPES))
    exp_avg_sqs = [v.abs() for v in tensors(0.01)]
    return dict(params=params, grads=grads, exp_avgs=tensors(0.1), exp_avg_sqs=exp_avg_sqs,
                max_exp_avg_sqs=[1.5 * v for v in exp_avg_sqs] if amsgrad else [],
                state_steps=[torch.tensor(3.0) for _ in SHAPES])


def _step(variant, dtype, nonfinite=False, **scaling):
    """One step of the variant; ``(grads before, grads after, bytes the launch stored)``."""
    op, options = VARIANTS[variant]
    call = {**_state(op, dtype, options.get("amsgrad")), "grad_scale": None, "found_inf": None, "clip_coef": None,
            **options, **scaling}
    if nonfinite:
        call["grads"][0][3], call["grads"][1][0, 2] = float("inf"), float("nan")
    before = snapshot(call["grads"])
    with emulator.count_instructions() as stats:
        OPS[op].run(**call)
    return before, call["grads"], stats.dma_bytes_out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_scaled_step_writes_the_grads_back_scaled_and_a_skipped_or_plain_one_leaves_them(variant, dtype):
    scaled = dict(grad_scale=torch.tensor(GRAD_SCALE), clip_coef=torch.tensor(CLIP_COEF))
    before, after, stored = _step(variant, dtype, **scaled)
    assert_bit_identical([(g.double() / GRAD_SCALE * CLIP_COEF).to(dtype) for g in before], after)

    before, after, stored_plain = _step(variant, dtype)
    assert_bit_identical(before, after)
    assert stored - stored_plain == sum(g.numel() for g in before) * dtype.itemsize  # the grads' store is traffic

    before, after, _ = _step(variant, dtype, nonfinite=True, **dict(scaled, found_inf=torch.tensor(1.0)))
    assert_bit_identical(before, after)


@pytest.mark.parametrize("op", ["adam", "sgd"])
def test_a_noncontiguous_grad_is_declined_only_when_the_step_writes_grads(op):
    call = dict(_state(op, torch.float32, False), grad_scale=None, found_inf=None, clip_coef=None, eps=1e-8)
    call["grads"][1] = torch.randn(5, 3).t()
    assert OPS[op].supports(call) == []
    reasons = OPS[op].supports(dict(call, clip_coef=torch.tensor(0.5)))
    assert len(reasons) == 1 and reasons[0].startswith("grads[1] is not contiguous")


@pytest.mark.parametrize("op", ["adam", "sgd"])
def test_a_clipped_step_stores_the_grads_once_and_momentum_sgd_stays_bound_by_its_dma(op):
    """The grads' store is traffic the cost model prices (bf16 params and grads; Adam's moments float32), and
    momentum SGD stays bound by its DMA with it (docs/backends/nki.md, "SGD")."""
    n = 128 * 2048 * 8

    def meta(dtype=torch.bfloat16):
        return [torch.empty(n, dtype=dtype, device="meta")]

    if op == "adam":
        state = dict(exp_avgs=meta(torch.float32), exp_avg_sqs=meta(torch.float32), max_exp_avg_sqs=[],
                     state_steps=[torch.zeros(())])
        options = VARIANTS["adamw"][1]
    else:
        state = dict(momentum_buffers=meta(), first_steps=(False,))
        options = dict(SGD, nesterov=False, maximize=False, weight_decay=0.0, dampening=0.0)  # torch's defaults
    call = dict(params=meta(), grads=meta(), **state, **options, grad_scale=None, found_inf=None,
                clip_coef=torch.tensor(0.5))
    with emulator.count_only(), emulator.count_instructions() as stats:
        OPS[op].run(**call)
    stored = ("params", "grads", "exp_avgs", "exp_avg_sqs", "momentum_buffers")  # each once, the grads included
    assert stats.dma_bytes_out == sum(t.numel() * t.element_size() for key in stored for t in call.get(key, []))
    for machine in cost.MACHINES if op == "sgd" else ():
        assert cost.estimate(stats, machine).bound == "dma", machine.name
