"""Triton-specific paths the shared suite reaches only through its shapes (interpreter on CPU)."""

import pytest
import torch

import portable_ops
from portable_ops import dispatch

pytestmark = pytest.mark.skipif(dispatch.unavailable_reason("triton") is not None, reason="triton not installed")


def test_decode_splits_keys_across_programs_and_merges_exactly():
    from portable_ops.backends.triton.attention import _config, _splits

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 64, generator=g).to(device)
    k, v = (torch.randn(1, 1, 1100, 64, generator=g).to(device) for _ in range(2))
    block_m, block_n = _config("fwd", q, k, False, launch=None)[:2]  # decode shapes are never timed
    assert _splits(1, 2, 1, 1100, block_m, block_n) > 1  # the conformance case takes the split path
    assert _splits(1, 2, block_m + 1, 1100, block_m, block_n) == 1  # prefill does not
    for causal in (False, True):
        with portable_ops.use_backend("triton"):
            out = portable_ops.attention(q, k, v, causal=causal)
        with portable_ops.use_backend("reference"):
            ref = portable_ops.attention(q, k, v, causal=causal)
        torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


def test_multi_tensor_tables_are_reused_while_the_tensors_are():
    from portable_ops.backends.triton.multi_tensor import CHUNK, tables

    xs = [torch.zeros(n) for n in (3, 5000)]
    first = tables([xs])
    assert tables([xs]) is first
    assert first.chunks == sum(-(-x.numel() // CHUNK) for x in xs)
    assert tables([[torch.zeros(3), torch.zeros(5000)]]) is not first


def test_tuner_times_each_candidate_once_per_key_and_skips_ones_that_do_not_fit(monkeypatch):
    from triton.runtime.errors import OutOfResources

    from portable_ops.backends.triton import autotune

    monkeypatch.setattr(autotune, "INTERPRETED", False)
    cost = {"a": 3.0, "b": 1.0, "c": 2.0}
    timed = []

    def launch(config):
        timed.append(config)
        if config == "b":
            raise OutOfResources(300000, 232448, "shared memory")
        return cost[config]

    tuner = autotune.Tuner(timer=lambda run: run())
    assert tuner.pick("k", ["a", "b", "c"], launch) == "c"  # b would be fastest but does not fit
    assert tuner.pick("k", ["a", "b", "c"], launch) == "c" and timed == ["a", "b", "c"]  # remembered
    monkeypatch.setenv("PORTABLE_OPS_AUTOTUNE", "0")
    assert tuner.pick("other", ["a", "b", "c"], launch) == "a" and len(timed) == 3  # off: the first, untimed
    monkeypatch.delenv("PORTABLE_OPS_AUTOTUNE")
    with pytest.raises(RuntimeError, match="no launch configuration fits"):
        tuner.pick("none", ["b", "b"], launch)
