"""A backend for the "toy" device type (device.py), registered as docs/adding-a-backend.md says, for
tests/test_adding_a_backend.py. Its kernels are the reference's, run on toy tensors; each first checks
that every tensor it is handed is on the toy device, and counts the call."""

from __future__ import annotations

import collections

import torch

from portable_ops.backends import reference
from portable_ops.dispatch import Backend, OpImpl

from . import device

CALLS: collections.Counter = collections.Counter()  # op -> calls run here
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DECLINED = ("paged_attention", "paged_kv_append")
ATTENTION_OPS = ("attention_fwd", "attention_bwd", "attention_varlen_fwd", "attention_varlen_bwd")


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _on_toy(op, run):
    def kernel(**call):
        for name, value in call.items():
            for t in _tensors(value):
                if t.device.type != device.TYPE:
                    raise AssertionError(f"toy's {op} was handed {name} on {t.device}")
        CALLS[op] += 1
        return run(**call)
    return kernel


def _declared(op):
    """Dtypes for every op; attention without windows, softcaps and sinks, up to head dim 128."""
    if op in ATTENTION_OPS:
        return dict(dtypes=DTYPES, max_head_dim=128, features=("causal",))
    return dict(dtypes=DTYPES)


BACKEND = Backend(
    name="toy",
    devices=(device.TYPE,),
    ops={op: OpImpl(run=_on_toy(op, impl.run), **_declared(op))
         for op, impl in reference.BACKEND.ops.items() if op not in DECLINED},
    declined=DECLINED,
    description="the reference's kernels on toy tensors",
)
