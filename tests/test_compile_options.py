"""Every documented option type of attention and attention_varlen compiles whole under
``torch.compile(fullgraph=True)``: numpy scalars, 0-d numpy arrays and one-element CPU tensors for
``scale`` and ``softcap``, numpy ints for ``window``'s sides; with no graph break, two graphs for three
calls of changing sequence length (static for the first, then one dynamic graph: the option values
are not what recompiles), and the eager call's values and gradients."""

import numpy as np
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import portable_ops
from portable_ops import dispatch
from portable_ops.conformance import usable_backends
from portable_ops.conformance.runner import default_device, forced_strict

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

OPTIONS = {
    "numpy float scale": dict(scale=1 / np.sqrt(16)),
    "0-d array scale": dict(scale=np.array(0.3)),
    "numpy float32 softcap": dict(softcap=np.float32(2.0)),
    "numpy int softcap": dict(softcap=np.int64(3)),
    "numpy int window": dict(window=(np.int64(3), np.int64(1))),
    "tensor scale": dict(scale=torch.tensor(0.3)),
    "tensor softcap": dict(softcap=torch.tensor(2.0, dtype=torch.float64)),
    "tensors and numpy together": dict(scale=torch.tensor([0.3]), softcap=np.float64(2.0),
                                       window=(None, np.int64(2))),
}


def dense(device, s, g):
    return [torch.randn(2, h, s, 16, generator=g).to(device).requires_grad_() for h in (4, 2, 2)]


def packed(device, s, g):
    lens = [s, s // 2 + 1]
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(sum(lens), h, 16, generator=g).to(device).requires_grad_() for h in (4, 2, 2))
    return q, k, v, cu, cu, np.int64(max(lens)), max(lens)  # a numpy max_seqlen, as np.max gives


def run(fn, args):
    out = fn(*args)
    grads = torch.autograd.grad(out.square().sum(), args[:3])
    return out.detach(), grads


# The options are made plain before any backend sees them: every type on reference, all of them at once elsewhere.
CASES = [("reference", name) for name in OPTIONS] + [(backend, "tensors and numpy together")
                                                     for backend in usable_backends() if backend != "reference"]


@pytest.mark.parametrize("op", ["attention", "attention_varlen"])
@pytest.mark.parametrize("backend, name", CASES)
def test_option_types_compile_whole(backend, name, op):
    if f"{op}_fwd" not in dispatch.get_backend(backend).ops:
        pytest.skip(f"{backend} declines {op} (a fallback, not a pass)")
    device, options = default_device(backend), OPTIONS[name]
    make = dense if op == "attention" else packed
    call = getattr(portable_ops, op)

    def f(*args):
        return call(*args, **options)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(0)
    with forced_strict(backend):
        for s in (9, 12, 14):
            args = make(device, s, g)
            got, want = run(compiled, args), run(f, args)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.parametrize("name", ["scale", "softcap"])
def test_a_python_int_option_that_changes_between_calls_compiles_whole(name):
    """An int that dynamo makes dynamic on its second value is read as a float's is: one graph per value, no
    break under fullgraph, the eager values."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 8, 16, generator=g) for h in (2, 1, 1))
    compiled = torch.compile(lambda q, k, v, x: portable_ops.attention(q, k, v, **{name: x}), fullgraph=True,
                             backend="aot_eager")
    for x in (1, 2, 3):
        torch.testing.assert_close(compiled(q, k, v, x), portable_ops.attention(q, k, v, **{name: x}))
    assert sum(counters["graph_break"].values()) == 0
