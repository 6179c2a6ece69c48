"""Regressions found by a hostile-user pass over the scaled optimizer steps (a step under a clip or a GradScaler
writes the grads back) and the reference attention's GQA decode.

Each test failed before its fix: grads that were overlapping views of one buffer passed the shared-grad check
(only the same start address was refused) and were scaled twice where they overlap."""

import pytest
import torch

import portable_ops
from portable_ops import functional


def _views_of_one_buffer(starts_and_sizes, length=16):
    buffer = torch.linspace(-8, 8, length)
    return buffer, [buffer[start:start + size] for start, size in starts_and_sizes]


@pytest.mark.parametrize("op", ["adam", "sgd"])
def test_grads_that_are_overlapping_views_of_one_buffer_are_refused_before_anything_is_written(op):
    """A scaled step writes each grad once: where two grads overlap, the shared elements would be scaled twice."""
    buffer, grads = _views_of_one_buffer([(0, 8), (6, 8)])
    params = [torch.linspace(-1, 1, 8) for _ in grads]
    before = [t.clone() for t in (buffer, *params)]
    state = ([torch.zeros(8) for _ in grads], [torch.zeros(8) for _ in grads], [], [torch.zeros(()) for _ in grads])
    step = ((lambda: functional.adam(params, grads, *state, lr=0.1, grad_scale=torch.tensor(4.0))) if op == "adam"
            else lambda: functional.sgd(params, grads, [], lr=0.1, grad_scale=torch.tensor(4.0)))
    with portable_ops.use_backend("reference"), pytest.raises(ValueError, match=r"grads\[1\] overlaps grads\[0\]"):
        step()
    assert all(torch.equal(a, b) for a, b in zip(before, (buffer, *params)))


def test_grads_that_are_views_of_one_buffer_apart_step_as_separate_tensors():
    """DDP's gradient buckets: grads that are views of one flat buffer, next to each other (an empty one among
    them), are stepped, and left scaled, as grads of their own memory are."""
    buffer, bucket = _views_of_one_buffer([(0, 6), (6, 0), (6, 10)])
    separate = [g.clone() for g in bucket]
    results = []
    for grads in (bucket, separate):
        params = [torch.linspace(-1, 1, g.numel()) for g in grads]
        with portable_ops.use_backend("reference"):
            functional.sgd(params, grads, [], lr=0.1, grad_scale=torch.tensor(4.0))
        results.append([*params, *grads])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert torch.equal(buffer, torch.cat(separate))
