"""The NKI emulator's rules: each kernel that breaks one is rejected with a message naming it.

The emulator is a test double for the Neuron compiler and a NeuronCore (see
backends/nki/emulator/__init__.py); these tests pin what it rejects and how it computes.
"""

import pytest
import torch

from portable_ops.backends.nki import emulator
from portable_ops.backends.nki.adam import EPS, PAIR, SHARED, adam_kernel
from portable_ops.backends.nki.emulator import EmulatorError
from portable_ops.backends.nki.emulator import isa as nisa
from portable_ops.backends.nki.emulator import language as nl

jit = emulator.jit


def rejects(rule, fn, *args, **kwargs):
    with pytest.raises(EmulatorError) as info:
        fn(*args, **kwargs)
    assert info.value.rule == rule and f"[{rule}]" in str(info.value), str(info.value)
    return str(info.value)


@jit
def _broken_201_partitions(x):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    tile = nl.ndarray((201, 4), dtype=x.dtype, buffer=nl.sbuf)  # 201 partitions: over nl.tile_size.pmax
    nisa.dma_copy(tile, x)
    nisa.dma_copy(out, tile)
    return out


def test_broken_kernel_with_201_partitions_is_rejected():
    message = rejects("partition-dim", _broken_201_partitions, torch.zeros(201, 4))
    assert "201 partitions" in message and "128" in message


def _alloc(shape, dtype=nl.float32, buffer=nl.sbuf):
    @jit
    def kernel(x):
        nl.ndarray(shape, dtype=dtype, buffer=buffer)
        return x
    return kernel


def test_sbuf_capacity_per_partition():
    _alloc((128, 224 * 1024 // 4))(torch.zeros(1))  # exactly 224 KiB per partition fits on trn2
    message = rejects("sbuf-capacity", _alloc((128, 224 * 1024 // 4 + 1)), torch.zeros(1))
    assert "224 KiB" in message
    with emulator.use_target("trn3"):  # 32 MiB SBUF on NeuronCore-v4
        _alloc((128, 240 * 1024 // 4))(torch.zeros(1))


def test_sbuf_capacity_counts_live_tiles_and_frees_loop_iterations():
    @jit
    def loop_ok(x):
        for _ in nl.affine_range(50):  # each iteration's 128 KiB tile is freed when it ends
            nl.ndarray((128, 32 * 1024), dtype=nl.float32, buffer=nl.sbuf)
        return x

    @jit
    def too_many_live(x):
        a = nl.ndarray((128, 32 * 1024), dtype=nl.float32, buffer=nl.sbuf)
        b = nl.ndarray((128, 32 * 1024), dtype=nl.float32, buffer=nl.sbuf)
        return x, a, b

    loop_ok(torch.zeros(1))
    rejects("sbuf-capacity", too_many_live, torch.zeros(1))


def test_psum_tile_must_fit_one_bank_and_psum_has_eight_banks():
    _alloc((128, 512), buffer=nl.psum)(torch.zeros(1))
    rejects("psum-bank", _alloc((128, 513), buffer=nl.psum), torch.zeros(1))

    @jit
    def nine_banks(x):
        tiles = [nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum) for _ in range(9)]
        return x, tiles

    rejects("psum-capacity", nine_banks, torch.zeros(1))


def _matmul(k, m, n, dtype=nl.bfloat16, stationary_buffer=nl.sbuf, dst_dtype=nl.float32, moving_k=None):
    @jit
    def kernel(x):
        s = nl.zeros((k, m), dtype=dtype, buffer=stationary_buffer)
        mv = nl.zeros((moving_k or k, n), dtype=dtype, buffer=nl.sbuf)
        d = nl.ndarray((min(m, 128), min(n, 512)), dtype=dst_dtype, buffer=nl.psum)  # a legal dst
        nisa.nc_matmul(d, s, mv, accumulate=False)
        return x
    return kernel


def test_matmul_limits():
    _matmul(128, 128, 512)(torch.zeros(1))
    rejects("matmul-stationary-fmax", _matmul(128, 129, 64), torch.zeros(1))
    rejects("matmul-moving-fmax", _matmul(128, 64, 513, dst_dtype=nl.float32), torch.zeros(1))
    rejects("matmul-contraction", _matmul(64, 64, 64, moving_k=32), torch.zeros(1))
    rejects("matmul-memory", _matmul(64, 64, 64, stationary_buffer=nl.psum, dtype=nl.float32), torch.zeros(1))
    rejects("matmul-dtype", _matmul(64, 64, 64, dtype=nl.int32), torch.zeros(1))


def test_matmul_accumulates_in_psum_in_fp32():
    @jit
    def kernel(a, b):
        out = nl.ndarray((4, 6), dtype=nl.float32, buffer=nl.shared_hbm)
        sa = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
        sb = nl.ndarray(b.shape, dtype=b.dtype, buffer=nl.sbuf)
        nisa.dma_copy(sa, a)
        nisa.dma_copy(sb, b)
        acc = nl.ndarray((4, 6), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(acc, sa, sb, accumulate=False)
        nisa.nc_matmul(acc, sa, sb, accumulate=True)
        res = nl.ndarray((4, 6), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(res, acc)
        nisa.dma_copy(out, res)
        return out

    a, b = torch.randn(8, 4).bfloat16(), torch.randn(8, 6).bfloat16()
    expected = 2 * (a.float().T @ b.float())
    torch.testing.assert_close(kernel(a, b), expected)


def test_engines_cannot_read_hbm_and_dma_cannot_touch_psum():
    @jit
    def engine_on_hbm(x):
        t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(t, x, x, op=nl.add)
        return x

    @jit
    def dma_to_psum(x):
        t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.psum)
        nisa.dma_copy(t, x)
        return x

    rejects("engine-memory", engine_on_hbm, torch.zeros(4, 4))
    rejects("dma-psum", dma_to_psum, torch.zeros(4, 4))


def test_gpsimd_cannot_access_psum():
    @jit
    def select_in_psum(x):
        t = nl.zeros((4, 4), dtype=nl.float32, buffer=nl.psum)
        nisa.affine_select(t, pattern=[[-1, 4]], offset=0, channel_multiplier=1, on_true_tile=t,
                           on_false_value=0.0, cmp_op=nl.greater_equal)
        return x

    rejects("gpsimd-psum", select_in_psum, torch.zeros(1))


def test_dtypes_the_engines_cannot_take():
    rejects("dtype-unsupported", _broken_201_partitions, torch.zeros(4, 4, dtype=torch.float64))

    @jit
    def float_predicate(x):
        t = nl.zeros((4, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy_predicated(t, t, t)
        return x

    rejects("predicate-dtype", float_predicate, torch.zeros(1))


def test_dma_converts_dtypes_through_float32_rounding_once():
    # nki.isa.dma_copy: "The DMA engines automatically handle data type conversion ... first casting
    # from src.dtype to float32, then from float32 to dst.dtype", in the descriptor modes that convert
    @jit
    def kernel(x):
        out = nl.ndarray(x.shape, dtype=nl.float16, buffer=nl.shared_hbm)
        t = nl.ndarray(x.shape, dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.dma_copy(dst=out, src=t)
        return out

    x = torch.tensor([[1 + 2 ** -9, 1 + 3 * 2 ** -9, 3.14159, 70000.0]])
    with emulator.dma_casting(nisa.dge_mode.unknown):
        assert torch.equal(kernel(x), x.to(torch.bfloat16).float().to(torch.float16))


def test_reduce_axis_and_transpose_shape():
    @jit
    def reduce_partitions(x):
        t = nl.zeros((4, 4), dtype=nl.float32, buffer=nl.sbuf)
        r = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(r, op=nl.add, data=t, axis=0)
        return x

    @jit
    def transpose_too_wide(x):
        t = nl.zeros((64, 200), dtype=nl.float32, buffer=nl.sbuf)
        r = nl.ndarray((200, 64), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_transpose(r, t)
        return x

    rejects("reduce-axis", reduce_partitions, torch.zeros(1))
    # 200 output partitions are refused when the PSUM tile is declared, before the transpose
    with pytest.raises(EmulatorError):
        transpose_too_wide(torch.zeros(1))


def test_bf16_is_stored_as_bf16_with_one_rounding():
    @jit
    def kernel(x):
        out = nl.ndarray(x.shape, dtype=nl.bfloat16, buffer=nl.shared_hbm)
        t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(t, x)
        b = nl.ndarray(x.shape, dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_scalar(b, t, op0=nl.add, operand0=0.0)
        nisa.dma_copy(out, b)
        return out

    x = torch.tensor([[1 + 2 ** -9, 1 + 3 * 2 ** -9, 3.14159]], dtype=torch.float32)
    out = kernel(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, x.to(torch.bfloat16))  # round-to-nearest-even, once


def test_affine_select_matches_its_documented_predicate():
    @jit
    def kernel(x):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(t, x)
        nisa.affine_select(t, pattern=[[-1, x.shape[1]]], offset=2, channel_multiplier=1, on_true_tile=t,
                           on_false_value=-5.0, cmp_op=nl.greater_equal)
        nisa.dma_copy(out, t)
        return out

    x = torch.ones(6, 9)
    rows, cols = torch.arange(6)[:, None], torch.arange(9)[None, :]
    expected = torch.where(2 + rows - cols >= 0, x, torch.tensor(-5.0))
    assert torch.equal(kernel(x), expected)


def test_iota_writes_its_documented_pattern_in_sbuf_only():
    """nki.isa.iota: ``offset + p * channel_multiplier + sum(i_k * step_k)``, computed in int32, converted to dst's
    dtype; dst in SBUF."""
    @jit
    def kernel(x):
        out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.iota(t, pattern=[[10, 3], [-1, 4]], offset=7, channel_multiplier=100)
        nisa.dma_copy(out, t)
        return out

    expected = (7 + 100 * torch.arange(5)[:, None, None] + 10 * torch.arange(3)[None, :, None]
                - torch.arange(4)[None, None, :]).reshape(5, 12).float()
    assert torch.equal(kernel(torch.zeros(5, 12)), expected)
    with pytest.raises(EmulatorError, match="iota-memory"):
        nisa.iota(nl.ndarray((2, 4), dtype=nl.float32, buffer=nl.psum), pattern=[[1, 4]])
    with pytest.raises(EmulatorError, match="iota-range"):
        nisa.iota(nl.ndarray((2, 4), dtype=nl.float32, buffer=nl.sbuf), pattern=[[2 ** 30, 4]])


def test_tanh_activation_scales_first_and_saturates():
    """nl.tanh as an activation function: ``tanh(data * scale + bias)`` on the Scalar Engine, valid on
    [-inf, inf] (nki.api.shared, 'Supported Activation Functions'), so +-inf map to +-1."""
    @jit
    def kernel(x):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(t, x)
        nisa.activation(t, op=nl.tanh, data=t, scale=0.5)
        nisa.dma_copy(out, t)
        return out

    x = torch.tensor([[-float("inf"), -3.0, 0.0, 1e-3, 2.0, 1e30, float("inf")]])
    with emulator.count_instructions() as stats:
        out = kernel(x)
    assert torch.equal(out, torch.tanh(x * 0.5))
    assert out[0, 0] == -1.0 and out[0, -1] == 1.0 and out[0, -2] == 1.0
    assert stats.instructions["scalar"] == 1
    with pytest.raises(EmulatorError, match="api-subset"):
        nl.tanh(x)  # a tile-level call is outside the emulated subset, as every nl operator


def test_tensor_scalar_reduce_writes_the_product_and_reduces_it_in_one_vector_instruction():
    """nisa.tensor_scalar_reduce: ``dst = data <op0> operand0`` and ``reduce_res`` its reduction over the free axis
    (negated under reduce_res_negate), one Vector Engine instruction priced max(MIN_II, N) + MIN_II (its reference
    page); a reduce command other than reset_reduce is outside the emulated subset."""
    @jit
    def kernel(x, reduce_op, negate):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        peak = nl.ndarray((x.shape[0], 1), dtype=nl.float32, buffer=nl.shared_hbm)
        t, r = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf), nl.ndarray((x.shape[0], 1), dtype=nl.float32,
                                                                               buffer=nl.sbuf)
        nisa.dma_copy(t, x)
        nisa.tensor_scalar_reduce(t, t, op0=nl.multiply, operand0=-2.0, reduce_op=reduce_op, reduce_res=r,
                                  reduce_res_negate=negate)
        nisa.dma_copy(out, t)
        nisa.dma_copy(peak, r)
        return out, peak

    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    with emulator.count_instructions() as stats:
        out, peak = kernel(x, nl.maximum, True)
    assert torch.equal(out, x * -2.0) and torch.equal(peak, -(x * -2.0).amax(1, keepdim=True))
    assert stats.instructions["vector"] == 1 and stats.work[("vector", "stream", 300 + 64)] == 1
    out, total = kernel(x, nl.add, False)
    torch.testing.assert_close(total, (x * -2.0).sum(1, keepdim=True))

    @jit
    def accumulating(x):
        t, r = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf), nl.ndarray((x.shape[0], 1), dtype=nl.float32,
                                                                               buffer=nl.sbuf)
        nisa.dma_copy(t, x)
        nisa.tensor_scalar_reduce(t, t, op0=nl.add, operand0=1.0, reduce_op=nl.add, reduce_res=r,
                                  reduce_cmd=nisa.reduce_cmd.reduce)
        return x

    rejects("api-subset", accumulating, x)


def test_instruction_counts_per_engine():
    hp = torch.zeros(128, len(SHARED) + PAIR)
    hp[:, EPS] = 1e-8  # the reciprocal's domain takes no eps of 0
    p = torch.zeros(128 * 1500)
    with emulator.count_instructions() as stats:
        adam_kernel([p], [p], [p], [p], [p], hp, amsgrad=False, decay_mode=0, gated=False, scale_grads=False)
    counts = stats.instructions
    # one [128, 1500] body in two tiles (1024 + 476): 4 loads + 3 stores each, plus the hyperparameters
    assert stats.launches == 1
    assert counts["dma"] == 2 * 7 + 1
    # per tile: ScalarE (1-beta1) g, g^2, v/bc2, sqrt, 1/x, the step's scale; VectorE m, v and the domain guard;
    # GpSimd the guard's flag, m/den, its mask, p's sum
    assert counts["scalar"] == 2 * 6 and counts["vector"] == 2 * 3 and counts["gpsimd"] == 2 * 4
    assert stats.dma_bytes_in == 4 * 128 * 1500 * 4 + hp.numel() * 4
    assert stats.dma_bytes_out == 3 * 128 * 1500 * 4
    assert stats.elements["vector"] == 3 * 2 * 128 * 1500 // 128  # three two-input instructions per element


def test_rsqrt_takes_only_its_input_domain():
    """The Scalar Engine's rsqrt takes [2^-87, 2^97]: 0, past either end, inf and NaN are refused."""
    @jit
    def kernel(x):
        out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.activation(dst=t, op=nl.rsqrt, data=t)
        nisa.dma_copy(dst=out, src=t)
        return out

    inside = torch.tensor([[2.0 ** -87, 1.0, 2.0 ** 97]])
    torch.testing.assert_close(kernel(inside), torch.rsqrt(inside))
    for value in (0.0, 2.0 ** -88, 2.0 ** 98, float("inf"), float("nan")):
        with pytest.raises(EmulatorError, match="engine-domain"):
            kernel(torch.tensor([[1.0, value]]))
