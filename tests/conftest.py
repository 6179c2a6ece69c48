import dataclasses

import pytest
import torch

from portable_ops import dispatch, index_values
from portable_ops.conformance.runner import default_device


def slow_in_the_interpreter(backends):
    """``backends`` as test parameters, triton marked ``slow`` where its kernels run in the Triton interpreter
    (CPU tensors): the README's test command runs it, ``-m "not slow"`` leaves it out of a quick loop."""
    return [pytest.param(name, marks=pytest.mark.slow) if name == "triton" and default_device(name).type == "cpu"
            else name for name in backends]


@pytest.fixture
def fake_backend(monkeypatch):
    """Install a stand-in backend under a real backend's name; returns a function that builds it.
    ``reasons``: why it declines every call, or a function of the call giving them. ``devices``: the device
    types it runs, "cpu" when forced (it is the default for the others)."""

    def install(name="triton", reasons=(), devices=("cpu",),
                ops=("adam", "grad_norm", "attention_fwd", "attention_bwd")):
        reference = dispatch.get_backend("reference")
        supports = reasons if callable(reasons) else lambda call, r=list(reasons): list(r)
        backend = dispatch.Backend(
            name=name,
            devices=tuple(kind for kind in devices if kind != "cpu"),
            cpu_runner="the test stand-in" if "cpu" in devices else None,
            ops={op: dispatch.OpImpl(run=reference.ops[op].run, supports=supports) for op in ops},
            description="test stand-in",
        )
        monkeypatch.setitem(dispatch._backends, name, backend)
        monkeypatch.setattr(dispatch, "_warned", set())
        return backend

    return install


def snapshot(tensors):
    return [t.detach().clone() for t in tensors]


def assert_bit_identical(before, after):
    """Same dtype, shape and bytes (NaN payloads included); meta tensors hold no data to compare."""
    assert len(before) == len(after)
    for b, a in zip(before, after):
        assert b.dtype == a.dtype and b.shape == a.shape
        if b.device.type == "meta":
            continue
        if b.is_sparse:
            b, a = b.to_dense(), a.to_dense()
        assert torch.equal(b.reshape(-1).view(torch.uint8), a.reshape(-1).view(torch.uint8))


def _checked_adam(run):
    def checked(**call):
        for i, p in enumerate(call["params"]):
            moments = [call[k][i] for k in ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs") if call[k]]
            for t in [call["grads"][i], *moments]:
                assert t.shape == p.shape and t.device == p.device, (
                    f"a kernel was handed a tensor of shape {tuple(t.shape)} on {t.device} for a param of shape "
                    f"{tuple(p.shape)} on {p.device}")
            assert call["grads"][i].dtype == p.dtype
            assert len({m.dtype for m in moments}) == 1 and moments[0].dtype in (p.dtype, torch.float32)
        return run(**call)
    return checked


@pytest.fixture
def checked_kernels(monkeypatch):
    """Every backend's Adam kernel first asserts that each tensor it is handed has its param's shape and
    device (the grad its dtype, the moments one dtype): a stale list fails the test where a real kernel
    would read and write past the end of a smaller tensor and take the process down."""
    for name in dispatch.BACKEND_NAMES:
        backend = dispatch.get_backend(name)
        if backend is not None and "adam" in backend.ops:
            impl = backend.ops["adam"]
            monkeypatch.setitem(backend.ops, "adam", dataclasses.replace(impl, run=_checked_adam(impl.run)))


@pytest.fixture
def reads(monkeypatch):
    """The tensors value checks read back from the device, in order."""
    seen = []
    original = index_values.read_values
    monkeypatch.setattr(index_values, "read_values", lambda t: seen.append(t) or original(t))
    return seen


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and counters of this test alone: graph breaks and graphs counted from zero. Imported here,
    not at the top: torch._dynamo imports triton, which must come after the backend switched its interpreter on."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
