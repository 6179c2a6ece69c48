import pytest
import torch

from portable_ops import dispatch


@pytest.fixture
def fake_backend(monkeypatch):
    """Install a stand-in backend under a real backend's name; returns a function that builds it."""

    def install(name="triton", reasons=(), devices=("cpu",), ops=("adam", "grad_norm", "attention_fwd", "attention_bwd")):
        reference = dispatch.get_backend("reference")
        backend = dispatch.Backend(
            name=name,
            ops={op: dispatch.OpImpl(run=reference.ops[op].run, supports=lambda call, r=list(reasons): list(r))
                 for op in ops},
            device_reasons=lambda device: [] if device.type in devices else [f"{name} does not run on {device.type}"],
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
