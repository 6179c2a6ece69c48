"""AWS's own expectations for every NKI instruction the kernels use, checked on the emulator.

Each test ports one of AWS's per-instruction examples, github aws-neuron/aws-neuron-sdk
``nki/test/test_nki_isa_<name>.py`` (at the commit in backends/nki/aws_signatures.py), or an
example or rule from the instruction's API reference (``nki/api/nki/isa/__init__.py``). The
examples are written against the older NKI API (instructions returning tiles, ``nl.load`` /
``nl.store``, ``nl.mgrid``); here they are rewritten, by us, in the NKI 0.7 API the kernels use
(``dst=`` tiles, ``nisa.dma_copy``), with the same inputs and the same NumPy expectations.
The corner cases the docs state (reversed operands, ``[P, 1]`` operands broadcast along the free
axis, accumulation into PSUM, predicated copies, the dtype of results) have tests of their own.
"""

import numpy as np
import pytest
import torch

from portable_ops.backends.nki import emulator
from portable_ops.backends.nki.emulator import EmulatorError
from portable_ops.backends.nki.emulator import isa as nisa
from portable_ops.backends.nki.emulator import language as nl

jit = emulator.jit
FP32_MIN = float(np.finfo(np.float32).min)  # nl.fp32.min in the older API


def _random(*shape):
    return torch.from_numpy(np.random.random_sample(shape).astype(np.float32) * 100)


def _load(src, dtype=None):
    tile = nl.ndarray(src.shape, dtype=dtype or src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=src)
    return tile


def _store(tile, dtype=None):
    out = nl.ndarray(tile.shape, dtype=dtype or tile.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=tile)
    return out


def _allclose(a, b):
    return np.allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64))


@pytest.fixture(autouse=True)
def _seed():
    np.random.seed(0)
    # the examples load and store across dtypes with the DMA converting, as the reference they follow says
    # DMAs do; the emulator refuses that unless told the descriptor mode converts (its dma-cast rule)
    with emulator.dma_casting(nisa.dge_mode.unknown):
        yield


# ----------------------------------------------------------------------------- tensor_tensor
def test_tensor_tensor_example_1_adds_two_tiles():
    """test_nki_isa_tensor_tensor.py, Example 1: c = a + b for two (128, 512) tiles."""
    @jit
    def kernel(a_t, b_t):
        a, b = _load(a_t), _load(b_t)
        c = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=c, data1=a, data2=b, op=nl.add)
        return _store(c)

    a, b = _random(128, 512), _random(128, 512)
    assert _allclose(kernel(a, b), np.add(a.numpy(), b.numpy()))


def test_tensor_tensor_computes_in_fp32_and_rounds_once_to_dst_and_takes_one_psum_operand():
    """API reference: 'casts input data types to float32 ... The float32 results are cast to
    dst.dtype'; data1 or data2 may be in PSUM, not both."""
    @jit
    def kernel(a_t, b_t, both_in_psum):
        a, b = _load(a_t, nl.bfloat16), _load(b_t, nl.bfloat16)
        b_ps = nl.ndarray(b.shape, dtype=nl.float32, buffer=nl.psum)
        nisa.tensor_copy(dst=b_ps, src=b)
        c = nl.ndarray(a.shape, dtype=nl.bfloat16, buffer=nl.sbuf)
        first = b_ps if both_in_psum else a
        nisa.tensor_tensor(dst=c, data1=first, data2=b_ps, op=nl.subtract)
        return _store(c)

    a, b = torch.tensor([[1.0, 3.0]]), torch.tensor([[2 ** -9, 2 ** -8 + 2 ** -10]])
    bf = a.bfloat16().float() - b.bfloat16().float()  # fp32 difference of the bf16 inputs
    assert torch.equal(kernel(a, b, False), bf.bfloat16())
    with pytest.raises(EmulatorError, match="psum-operands"):
        kernel(a, b, True)


# ----------------------------------------------------------------------------- tensor_scalar
def test_tensor_scalar_examples_1_to_3():
    """test_nki_isa_tensor_scalar.py: Example 1 a - 1.0; Example 2 (reverse0) 1.0 - c; Example 3
    e * f + 2.5 with f a (64, 1) vector broadcast along the free axis of e (64, 1024)."""
    @jit
    def kernel(a_t, c_t, e_t, f_t):
        a, c, e, f = _load(a_t), _load(c_t), _load(e_t), _load(f_t)
        b, d, g = (nl.ndarray(t.shape, dtype=t.dtype, buffer=nl.sbuf) for t in (a, c, e))
        nisa.tensor_scalar(dst=b, data=a, op0=nl.subtract, operand0=1.0)
        nisa.tensor_scalar(dst=d, data=c, op0=nl.subtract, operand0=1.0, reverse0=True)
        nisa.tensor_scalar(dst=g, data=e, op0=nl.multiply, operand0=f, op1=nl.add, operand1=2.5)
        return _store(b), _store(d), _store(g)

    a, c, e, f = _random(128, 512), _random(128, 512), _random(64, 1024), _random(64, 1)
    b, d, g = kernel(a, c, e, f)
    assert _allclose(b, a.numpy() - 1)
    assert _allclose(d, 1 - c.numpy())
    assert _allclose(g, e.numpy() * f.numpy() + 2.5)


def test_tensor_scalar_reverse1_and_operand_rules():
    """API reference: reverse1 makes operand1 the lhs of op1; a vector operand is (P, 1) and float32."""
    @jit
    def kernel(x_t, v_t, bad):
        x, v = _load(x_t), _load(v_t)
        y = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        if bad == "shape":
            nisa.tensor_scalar(dst=y, data=x, op0=nl.add, operand0=x)
        elif bad == "dtype":
            v16 = nl.ndarray(v.shape, dtype=nl.bfloat16, buffer=nl.sbuf)
            nisa.tensor_copy(dst=v16, src=v)
            nisa.tensor_scalar(dst=y, data=x, op0=nl.add, operand0=v16)
        else:
            nisa.tensor_scalar(dst=y, data=x, op0=nl.multiply, operand0=v, op1=nl.subtract, operand1=10.0,
                               reverse1=True)
        return _store(y)

    x, v = _random(4, 8), _random(4, 1)
    assert _allclose(kernel(x, v, None), 10.0 - x.numpy() * v.numpy())
    with pytest.raises(EmulatorError, match="operand-shape"):
        kernel(x, v, "shape")
    with pytest.raises(EmulatorError, match="operand-dtype"):
        kernel(x, v, "dtype")


# ----------------------------------------------------------------------------- scalar_tensor_tensor
def test_scalar_tensor_tensor_is_tensor_scalar_then_tensor_tensor_with_reversible_operands():
    """API reference: 'equivalent to ... temp = tensor_scalar(data, op0, operand0); dst =
    tensor_tensor(temp, op1, operand1)'; reverse0 / reverse1 swap each operator's operands;
    operand0 may be a (P, 1) vector."""
    @jit
    def kernel(x_t, y_t, s_t):
        x, y, s = _load(x_t), _load(y_t), _load(s_t)
        fused, plain, rev = (nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf) for _ in range(3))
        nisa.scalar_tensor_tensor(dst=fused, data=x, op0=nl.subtract, operand0=s, op1=nl.multiply, operand1=y)
        tmp = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=tmp, data=x, op0=nl.subtract, operand0=s)
        nisa.tensor_tensor(dst=plain, data1=tmp, data2=y, op=nl.multiply)
        nisa.scalar_tensor_tensor(dst=rev, data=x, op0=nl.subtract, operand0=s, op1=nl.subtract, operand1=y,
                                  reverse0=True, reverse1=True)
        return _store(fused), _store(plain), _store(rev)

    x, y, s = _random(16, 32), _random(16, 32), _random(16, 1)
    fused, plain, rev = kernel(x, y, s)
    assert torch.equal(fused, plain)
    assert _allclose(rev, y.numpy() - (s.numpy() - x.numpy()))


# ----------------------------------------------------------------------------- activation
def test_activation_example_1_exp():
    """test_nki_isa_activation.py, Example 1: exp of a (128, 1024) tile."""
    @jit
    def kernel(a_t):
        a = _load(a_t)
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
        nisa.activation(dst=out, op=nl.exp, data=a)
        return _store(out)

    a = _random(128, 1024)
    with np.errstate(over="ignore"):
        assert _allclose(kernel(a), np.exp(a.numpy()))


def test_activation_example_2_square_of_scaled_plus_bias_vector_into_bfloat16():
    """test_nki_isa_activation.py, Example 2: square(b * 2.0 + c), c a (128, 1) bias vector, the
    result in bfloat16. AWS checks it with np.allclose's default tolerances, which a bfloat16
    output cannot meet; the API reference's rule (fp32 math, one cast to dst.dtype) is what is
    checked here."""
    @jit
    def kernel(b_t, c_t):
        b, c = _load(b_t), _load(c_t)
        out = nl.ndarray(b.shape, dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.activation(dst=out, op=nl.square, data=b, bias=c, scale=2.0)
        return _store(out, nl.float32)

    b, c = _random(128, 512), _random(128, 1)
    golden = np.square(b.numpy() * 2 + c.numpy())
    out = kernel(b, c)
    assert torch.equal(out, torch.from_numpy(golden).bfloat16().float())
    assert np.allclose(out, golden, rtol=2 ** -8)


def test_activation_reduce_registers_sum_reset_and_accumulate():
    """API reference: reset_reduce resets the per-lane reduce_regs and sums the activated data
    into them, reduce adds onto them, reduce_res (P, 1) reads them out; reduce_op must be add."""
    @jit
    def kernel(a_t, b_t, bad):
        a, b = _load(a_t), _load(b_t)
        out = nl.ndarray(a.shape, dtype=nl.float32, buffer=nl.sbuf)
        first, total = (nl.ndarray((a.shape[0], 1), dtype=nl.float32, buffer=nl.sbuf) for _ in range(2))
        nisa.activation(dst=out, op=nl.square, data=a, reduce_op=nl.maximum if bad else nl.add, reduce_res=first,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.activation(dst=out, op=nl.copy, data=b, reduce_op=nl.add, reduce_res=total,
                        reduce_cmd=nisa.reduce_cmd.reduce)
        return _store(first), _store(total)

    a, b = _random(8, 16), _random(8, 16)
    first, total = kernel(a, b, False)
    assert _allclose(first, (a.double() ** 2).sum(1, keepdim=True))
    assert _allclose(total, (a.double() ** 2).sum(1, keepdim=True) + b.double().sum(1, keepdim=True))
    with pytest.raises(EmulatorError, match="activation-reduce"):
        kernel(a, b, True)


# ----------------------------------------------------------------------------- reciprocal
def test_reciprocal_example():
    """test_nki_isa_reciprocal.py: 1 / x of a (128, 512) tile."""
    @jit
    def kernel(x_t):
        x = _load(x_t)
        y = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.reciprocal(dst=y, data=x)
        return _store(y)

    x = _random(128, 512)
    assert _allclose(kernel(x), np.reciprocal(x.numpy()))


# ----------------------------------------------------------------------------- reductions
def test_tensor_reduce_example_1_sums_the_free_axis():
    """test_nki_isa_reduce.py, Example 1: add-reduce a (128, 512) tile along axis 1 into (128, 1)."""
    @jit
    def kernel(a_t):
        a = _load(a_t)
        b = nl.ndarray((a.shape[0], 1), dtype=a.dtype, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=b, op=nl.add, data=a, axis=[1])
        return _store(b)

    a = _random(128, 512)
    assert _allclose(kernel(a), np.sum(a.numpy(), axis=1, keepdims=True))


def test_tensor_reduce_negate_and_trailing_axes_only():
    """API reference: negate multiplies the result by -1; the axes must be the last free ones."""
    @jit
    def kernel(a_t, axis):
        a = _load(a_t)
        b = nl.ndarray((a.shape[0], 1), dtype=a.dtype, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=b, op=nl.maximum, data=a, axis=axis, negate=True)
        return _store(b)

    a = _random(4, 3, 5)
    assert _allclose(kernel(a, (1, 2)), -a.numpy().reshape(4, -1).max(1, keepdims=True))
    with pytest.raises(EmulatorError, match="reduce-axis"):
        kernel(a, 1)


@pytest.mark.parametrize("batched", [False, True])
def test_tensor_partition_reduce_examples(batched):
    """test_nki_isa_partition_reduce.py: Example 1 add-reduces a (128, 32, 4) tile across
    partitions into (1, 32, 4); Example 2 does it per batch of a (4, 128, 32, 8) tensor."""
    @jit
    def kernel(a_t):
        out = nl.ndarray((a_t.shape[0], 1, *a_t.shape[2:]), dtype=a_t.dtype, buffer=nl.shared_hbm)
        for i in nl.affine_range(a_t.shape[0]):
            a = _load(a_t[i])
            b = nl.ndarray((1, *a.shape[1:]), dtype=a.dtype, buffer=nl.sbuf)
            nisa.tensor_partition_reduce(dst=b, op=nl.add, data=a)
            nisa.dma_copy(dst=out[i], src=b)
        return out

    a = _random(4, 128, 32, 8) if batched else _random(1, 128, 32, 4)
    assert _allclose(kernel(a), np.sum(a.numpy(), axis=1, keepdims=True))


# ----------------------------------------------------------------------------- data movement
def test_dma_copy_example_1_copies_a_tensor():
    """test_nki_isa_dma_copy.py, Example 1: copy a (256, 1) HBM tensor into another."""
    @jit
    def kernel(a):
        b = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=b, src=a)
        return b

    src = _random(256, 1)
    assert _allclose(kernel(src), src.numpy())


def test_tensor_copy_example_1_on_the_vector_engine():
    """test_nki_isa_tensor_copy.py, Example 1: copy an (8, 8) tile with the Vector Engine."""
    @jit
    def kernel(x_t):
        x = _load(x_t)
        y = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=y, src=x, engine=nisa.engine.vector)
        return _store(y)

    src = _random(8, 8)
    assert _allclose(kernel(src), src.numpy())


def test_memset_example_1():
    """test_nki_isa_memset.py, Example 1: a float32 (128, 128) tile filled with 0.2."""
    @jit
    def kernel(x):
        a = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=a, value=0.2)
        return _store(a)

    assert _allclose(kernel(torch.zeros(1)), np.full([128, 128], 0.2).astype(np.float32))


@pytest.mark.parametrize("reverse", [False, True])
def test_tensor_copy_predicated_example_1_and_reverse_pred(reverse):
    """test_nki_isa_copypredicated.py, Example 1: dst = where(a <= 0.8, a, b); reverse_pred
    inverts the predicate (API reference)."""
    @jit
    def kernel(pred_t, on_true_t, on_false_t):
        pred, src, dst = _load(pred_t), _load(on_true_t), _load(on_false_t)
        nisa.tensor_copy_predicated(dst=dst, src=src, predicate=pred, reverse_pred=reverse)
        return _store(dst)

    a, b = _random(128, 512) / 100, _random(128, 512)  # a in [0, 1) so both branches are taken
    predicate = torch.from_numpy(np.less_equal(a.numpy(), 0.8).astype(np.uint8))
    golden = np.where(np.less_equal(a.numpy(), 0.8) != reverse, a.numpy(), b.numpy())
    assert _allclose(kernel(predicate, a, b), golden)


def test_tensor_copy_predicated_scalar_source_and_rules():
    """API reference: a scalar src is copied where the predicate is true; the predicate is
    uint8/16/32; src and dst share a dtype."""
    @jit
    def kernel(pred_t, dst_t, bad):
        pred, dst = _load(pred_t), _load(dst_t)
        if bad == "dtype":
            other = nl.ndarray(dst.shape, dtype=nl.bfloat16, buffer=nl.sbuf)
            nisa.tensor_copy(dst=other, src=dst)
            nisa.tensor_copy_predicated(dst=dst, src=other, predicate=pred)
        elif bad == "predicate":
            nisa.tensor_copy_predicated(dst=dst, src=1.0, predicate=dst)
        else:
            nisa.tensor_copy_predicated(dst=dst, src=float("nan"), predicate=pred)
        return _store(dst)

    pred = torch.tensor([[1, 0, 1, 0]], dtype=torch.uint8)
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    out = kernel(pred, x, None)
    assert out.isnan().tolist() == [[True, False, True, False]] and out[0, 1] == 2.0 and out[0, 3] == 4.0
    with pytest.raises(EmulatorError, match="copy-dtype"):
        kernel(pred, x, "dtype")
    with pytest.raises(EmulatorError, match="predicate-dtype"):
        kernel(pred, x, "predicate")


# ----------------------------------------------------------------------------- selection
def test_affine_select_example_1_masks_the_upper_triangle():
    """test_nki_isa_affine_select.py, Example 1: replace the upper triangle (j >= i) of a
    (128, 128) tile with fp32 min; the older API's predicate iy < ix is, in NKI 0.7's affine form,
    ``i * 1 + j * (-1) > 0``."""
    @jit
    def kernel(a_t):
        a = _load(a_t)
        b = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
        nisa.affine_select(dst=b, pattern=[[-1, 128]], channel_multiplier=1, on_true_tile=a,
                           on_false_value=FP32_MIN, cmp_op=nl.greater)
        return _store(b)

    a = _random(128, 128)
    golden = a.numpy().copy()
    golden[np.triu_indices_from(golden)] = FP32_MIN
    assert _allclose(kernel(a), golden)


def test_affine_select_offset_multi_axis_pattern_and_sbuf_only():
    """API reference pseudo code: value = offset + p * channel_multiplier + sum(i_k * step_k) over
    a pattern of up to 4 [step, num] pairs; dst and on_true_tile in SBUF."""
    @jit
    def kernel(a_t, in_psum):
        a = _load(a_t)
        if in_psum:
            ps = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.psum)
            nisa.tensor_copy(dst=ps, src=a)
            a = ps
        b = nl.ndarray(a.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.affine_select(dst=b, pattern=[[10, 3], [-1, 4]], channel_multiplier=2, on_true_tile=a,
                           on_false_value=-1.0, cmp_op=nl.greater_equal, offset=-7)
        return _store(b)

    a = _random(5, 3, 4)
    p, i, j = np.meshgrid(np.arange(5), np.arange(3), np.arange(4), indexing="ij")
    golden = np.where(-7 + 2 * p + 10 * i - j >= 0, a.numpy(), -1.0)
    assert _allclose(kernel(a, False), golden)
    with pytest.raises(EmulatorError, match="gpsimd-psum"):
        kernel(a, True)


# ----------------------------------------------------------------------------- Tensor Engine
def test_nc_matmul_examples_1_and_2():
    """test_nki_isa_nc_matmul.py: Example 1 c = a.T @ b for a (128, 128), b (128, 512) into
    PSUM; Example 2 f = d.T @ e over a 256 contraction in two 128-row chunks accumulated in PSUM
    (the older API's ``f_psum += nc_matmul(...)`` is ``accumulate=(i > 0)`` in NKI 0.7, as in the
    API reference's nc_matmul_accumulate_kernel example)."""
    @jit
    def kernel(a_t, b_t, d_t, e_t):
        a, b = _load(a_t), _load(b_t)
        c = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=c, stationary=a, moving=b)
        f = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
        for i in nl.affine_range(2):
            d, e = _load(d_t[i * 128:(i + 1) * 128, :]), _load(e_t[i * 128:(i + 1) * 128, :])
            nisa.nc_matmul(dst=f, stationary=d, moving=e, accumulate=(i > 0))
        outs = []
        for ps in (c, f):
            sb = nl.ndarray(ps.shape, dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=sb, src=ps)
            outs.append(_store(sb))
        return outs

    a, b, d, e = _random(128, 128), _random(128, 512), _random(256, 128), _random(256, 512)
    c, f = kernel(a, b, d, e)
    assert np.allclose(c, np.matmul(a.numpy().T.astype(np.float64), b.numpy()), rtol=1e-5)
    assert np.allclose(f, np.matmul(d.numpy().T.astype(np.float64), e.numpy()), rtol=1e-5)


def test_nc_matmul_accumulate_kernel_from_the_api_reference():
    """nc_matmul's API reference example: K=512 tiled in 4 chunks of 128, accumulate=(i > 0);
    accumulate=None (the default) does the same (first write overwrites, later ones add)."""
    @jit
    def kernel(lhsT, rhs, explicit):
        K, M = lhsT.shape
        res_psum = nl.ndarray((M, rhs.shape[1]), dtype=nl.float32, buffer=nl.psum)
        for i in nl.static_range(K // 128):
            lhs_sb, rhs_sb = _load(lhsT[i * 128:(i + 1) * 128, :]), _load(rhs[i * 128:(i + 1) * 128, :])
            nisa.nc_matmul(dst=res_psum, stationary=lhs_sb, moving=rhs_sb,
                           **({"accumulate": i > 0} if explicit else {}))
        res_sb = nl.ndarray(res_psum.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=res_sb, src=res_psum)
        return _store(res_sb)

    lhsT, rhs = torch.randn(512, 64).bfloat16(), torch.randn(512, 96).bfloat16()
    golden = lhsT.double().T @ rhs.double()
    for explicit in (True, False):
        torch.testing.assert_close(kernel(lhsT, rhs, explicit).double(), golden, rtol=1e-5, atol=1e-4)


def test_nc_matmul_accumulating_onto_psum_no_matmul_initialised_is_rejected():
    """API reference: accumulate=True 'is only valid after the PSUM location has been
    initialized by a matmul with accumulate=False'; on NeuronCore-v2/v3 accumulating onto a
    location a memset/tensor_copy initialised is undefined behaviour."""
    @jit
    def kernel(x_t, init):
        x = _load(x_t)
        acc = nl.zeros((x.shape[1], x.shape[1]), dtype=nl.float32, buffer=nl.psum) if init \
            else nl.ndarray((x.shape[1], x.shape[1]), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc, stationary=x, moving=x, accumulate=True)
        return x_t

    for init in (False, True):
        with pytest.raises(EmulatorError, match="psum-accumulate"):
            kernel(torch.randn(8, 4), init)


def test_nc_matmul_fp32_and_bf16_inputs_do_not_mix():
    """API reference: 'if one of the input tiles is tfloat32/float32, the other tile must also be'."""
    @jit
    def kernel(x_t):
        x = _load(x_t)
        x16 = nl.ndarray(x.shape, dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy(dst=x16, src=x)
        out = nl.ndarray((x.shape[1], x.shape[1]), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=out, stationary=x, moving=x16)
        return x_t

    with pytest.raises(EmulatorError, match="matmul-dtype"):
        kernel(torch.randn(8, 4))


@pytest.mark.parametrize("example", [1, 2])
def test_nc_transpose_examples(example):
    """test_nki_isa_nc_transpose.py: Example 1 transposes a (128, 64) tile on the Tensor Engine
    (SBUF -> PSUM), Example 2 a (32, 2) tile on the Vector Engine; the output keeps the input's
    dtype (API reference)."""
    engine = nisa.engine.tensor if example == 1 else nisa.engine.vector

    @jit
    def kernel(a_t):
        a = _load(a_t)
        t = nl.ndarray((a.shape[1], a.shape[0]), dtype=a.dtype, buffer=nl.psum if example == 1 else nl.sbuf)
        nisa.nc_transpose(dst=t, data=a, engine=engine)
        sb = nl.ndarray(t.shape, dtype=t.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=sb, src=t)
        return _store(sb)

    a = _random(128, 64) if example == 1 else _random(32, 2)
    assert _allclose(kernel(a), np.transpose(a.numpy()))


def test_nc_transpose_output_dtype_must_match_and_vector_engine_takes_32x32():
    @jit
    def kernel(a_t, case):
        a = _load(a_t, nl.bfloat16)
        if case == "dtype":
            t = nl.ndarray((a.shape[1], a.shape[0]), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_transpose(dst=t, data=a)
        else:
            t = nl.ndarray((a.shape[1], a.shape[0]), dtype=nl.bfloat16, buffer=nl.sbuf)
            nisa.nc_transpose(dst=t, data=a, engine=nisa.engine.vector)
        return a_t

    with pytest.raises(EmulatorError, match="transpose-dtype"):
        kernel(torch.randn(16, 8), "dtype")
    with pytest.raises(EmulatorError, match="transpose-shape"):
        kernel(torch.randn(64, 8), "vector")
