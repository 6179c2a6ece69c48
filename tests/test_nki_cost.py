"""The cost model (backends/nki/emulator/cost.py) and ``python -m portable_ops.bench nki``.

Estimates are deterministic functions of the emulator's counts (no timing happens here): the
model is checked against hand-computed cases, and the bench's rows against the floors they are
documented to meet in docs/backends/nki.md.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from portable_ops.backends.nki import emulator
from portable_ops.backends.nki.emulator import cost
from portable_ops.backends.nki.emulator import isa as nisa
from portable_ops.backends.nki.emulator import language as nl


@emulator.jit
def _scale_and_store(x):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)  # one input: ~N VectorE cycles
    nisa.tensor_tensor(dst=t, data1=t, data2=t, op=nl.add)  # two inputs: ~2N
    nisa.activation(dst=t, op=nl.exp, data=t)  # ScalarE: ~N
    small = nl.ndarray((x.shape[0], 1), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=small, op=nl.add, data=t[:, 0:8], axis=1)  # N=8: the 64-cycle minimum
    nisa.dma_copy(dst=out, src=t)
    return out


def test_estimate_prices_each_instruction_by_its_documented_rule():
    x = torch.randn(128, 4096)
    with emulator.count_instructions() as stats:
        _scale_and_store(x)
    assert stats.dma_bytes_in == stats.dma_bytes_out == x.numel() * 4
    assert stats.sbuf_peak_bytes == 4096 * 4 + 4
    est = cost.estimate(stats, cost.TRN2)
    assert est.seconds["vector"] == pytest.approx((4096 + 2 * 4096 + 64) / 0.96e9)
    assert est.seconds["scalar"] == pytest.approx(4096 / 1.2e9)
    core_bw = min(16 * 23e9, 2.9e12 / 8)
    assert est.seconds["dma"] == pytest.approx(2 * (x.numel() * 4 / core_bw + 1.3e-6 / 16))
    assert est.bound == "vector" and est.chip_seconds == pytest.approx(est.seconds["vector"] / 8)
    trn3 = cost.estimate(stats, cost.TRN3)
    assert trn3.seconds["vector"] == pytest.approx((4096 + 2 * 4096 + 64) / 1.2e9)


def test_count_only_counts_what_a_real_run_counts_without_memory():
    x = torch.randn(64, 1000)
    with emulator.count_instructions() as real:
        _scale_and_store(x)
    with emulator.count_only(), emulator.count_instructions() as counted:
        out = _scale_and_store(torch.empty(64, 1000, device="meta"))
    assert out.is_meta
    assert counted.work == real.work and counted.as_dict() == real.as_dict()
    with emulator.count_only(), pytest.raises(emulator.EmulatorError, match="device"):
        _scale_and_store(x)  # count-only mode takes meta tensors


def test_bfloat16_tensor_scalar_in_sbuf_runs_in_vector_performance_mode():
    @emulator.jit
    def kernel(x):
        t = nl.ndarray(x.shape, dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
        return x

    with emulator.count_instructions() as stats:
        kernel(torch.randn(128, 2048).bfloat16())  # the DMA moves the dtype as it is (the emulator's dma-cast rule)
    assert cost.estimate(stats, cost.TRN2).seconds["vector"] == pytest.approx(2048 / 4 / 0.96e9)


@pytest.fixture(scope="module")
def bench_rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("nki_bench")
    result = subprocess.run([sys.executable, "-m", "portable_ops.bench", "nki", "--out", str(out)],
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # the nki bench needs no GPU
    assert result.returncode == 0, result.stderr
    assert "Trn2 ms" in result.stdout and "Trn3 ms" in result.stdout
    return json.loads((out / "nki.json").read_text())["rows"]


def test_bench_nki_runs_without_a_gpu_and_the_optimizer_and_clip_are_within_1_3x_of_their_floors(bench_rows):
    by_kernel = {r["kernel"].split(",")[0]: r for r in bench_rows}
    for name in ("AdamW fp32", "AdamW AMSGrad fp32", "AdamW bf16 params", "clip: global 2-norm fp32"):
        row = by_kernel[name]
        assert row["launches"] == 1, name
        for machine in ("Trn2", "Trn3"):
            assert row[f"{machine} x floor"] <= 1.3, (name, machine, row[f"{machine} x floor"])
            assert row[f"{machine} bound"] == "dma", (name, machine)
    adamw = by_kernel["AdamW fp32"]
    assert adamw["Trn2 floor ms"] == pytest.approx(28 * 354_823_168 / 2.9e12 * 1e3)  # the 3.4 ms


def test_bench_nki_sgd_is_one_launch_at_its_floor_but_nesterov_with_weight_decay_in_bf16(bench_rows):
    """docs/backends/nki.md: momentum SGD moves 5 bytes per element per byte of dtype and is DMA-bound; Nesterov
    with weight decay takes four two-tensor passes (decay, buffer, look-ahead, param), which the Vector Engine and
    GpSimd split two and two, more than bf16's DMA time."""
    by_kernel = {r["kernel"].split(",")[0]: r for r in bench_rows}
    for name in ("SGD momentum fp32", "SGD momentum bf16"):
        row = by_kernel[name]
        assert row["launches"] == 1, name
        for machine in ("Trn2", "Trn3"):
            assert row[f"{machine} x floor"] <= 1.3, (name, machine, row[f"{machine} x floor"])
            assert row[f"{machine} bound"] == "dma", (name, machine)
    assert by_kernel["SGD momentum fp32"]["Trn2 floor ms"] == pytest.approx(20 * 354_823_168 / 2.9e12 * 1e3)
    nesterov = by_kernel["SGD Nesterov weight decay bf16"]
    assert nesterov["launches"] == 1
    assert nesterov["Trn2 bound"] == nesterov["Trn3 bound"] == "vector"
    assert nesterov["Trn2 x floor"] <= 1.3


def test_bench_nki_says_what_bounds_attention(bench_rows):
    attention = [r for r in bench_rows if r["kernel"].startswith("attention")]
    assert len(attention) == 4
    for row in attention:  # docs/backends/nki.md explains why: per-128-key-block bookkeeping on VectorE
        assert row["Trn2 bound"] == "vector" and row["Trn2 x floor"] > 1.3


def test_bench_nki_prices_the_norms_forward_near_its_floor_and_says_what_bounds_the_backward(bench_rows):
    norms = {r["kernel"].split(" bf16")[0]: r for r in bench_rows if "Norm" in r["kernel"]}
    assert set(norms) == {"RMSNorm + residual fwd", "RMSNorm bwd", "LayerNorm fwd", "LayerNorm bwd"}
    for name, row in norms.items():
        assert row["launches"] == 1, name
        if name == "RMSNorm + residual fwd":  # a pre-norm block's call: bound by its four tensors' DMA
            assert row["Trn2 x floor"] <= 1.3 and row["Trn2 bound"] == "dma", (name, row)
        elif name == "LayerNorm fwd":  # two tensors' DMA against three Scalar Engine streams a tile
            assert row["Trn2 x floor"] <= 2.0 and row["Trn2 bound"] == "scalar", (name, row)
        else:  # docs/backends/nki.md: three two-tile products and two accumulations a tile, over VectorE and GpSimd
            assert row["Trn2 bound"] == "vector", (name, row["Trn2 bound"])


def test_bench_nki_prices_the_cross_entropy_rows_and_says_what_bounds_them(bench_rows):
    """docs/backends/nki.md: two passes over the logits, each tile's exponentials on the Scalar Engine and the
    one-hot and the gradient's terms on GpSimd and the Vector Engine; a softcap adds two tanh and a square a tile
    to the Scalar Engine."""
    prefix = "linear cross-entropy rows + grad bf16 "
    rows = {r["kernel"].removeprefix(prefix).split(" V=")[0]: r for r in bench_rows if r["kernel"].startswith(prefix)}
    assert set(rows) == {"Llama 3", "Gemma 2"}
    for name, row in rows.items():
        assert row["launches"] == 1 and row["Trn2 bound"] != "dma", (name, row)
    assert rows["Llama 3"]["Trn2 x floor"] <= 3.0
    assert rows["Gemma 2"]["Trn2 bound"] == "scalar"
