"""The hardware rules the NKI emulator enforces beyond shapes and memories (docs/backends/nki.md, "The emulator's
rules"): each with a small kernel that breaks it and is refused, and one that obeys it and runs; then the
project's kernels on the inputs those rules are about."""

import math

import pytest
import torch

from portable_ops.backends.nki import emulator
from portable_ops.backends.nki.adam import adam, adam_supports
from portable_ops.backends.nki.grad_norm import grad_norm
from portable_ops.backends.nki.emulator import isa as nisa
from portable_ops.backends.nki.emulator import language as nl
from portable_ops.definitions.adam import adam as reference_adam
from portable_ops.definitions.grad_norm import grad_norm as reference_grad_norm

from test_nki_emulator import rejects  # noqa: E402

jit = emulator.jit


@jit
def _activate(x, op):
    out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.activation(dst=t, op=op, data=t)
    nisa.dma_copy(dst=out, src=t)
    return out


# ----------------------------------------------------------------------------- activation domains
DOMAINS = [  # op, torch's function, inputs inside the valid range, inputs outside it
    (nl.sqrt, torch.sqrt, [2.0 ** -116, 2.0, 2.0 ** 118], [0.0, 2.0 ** 119, -1.0, math.inf, math.nan]),
    (nl.log, torch.log, [2.0 ** -64, 3.0, 2.0 ** 64], [0.0, 2.0 ** -65, 2.0 ** 65, math.inf]),
    (nl.reciprocal, torch.reciprocal, [-2.0 ** 42, -2.0 ** -42, 2.0 ** -42, 5.0], [0.0, 2.0 ** -43, -2.0 ** 43]),
]


def test_activation_functions_refuse_inputs_outside_their_valid_range():
    for op, exact, inside, outside in DOMAINS:
        x = torch.tensor([inside])
        torch.testing.assert_close(_activate(x, op), exact(x))
        for value in outside:
            message = rejects("engine-domain", _activate, torch.tensor([[1.0, value]]), op)
            assert op.__name__ in message


def test_the_poison_policy_writes_nan_where_the_input_is_outside_and_leaves_the_rest_exact():
    x = torch.tensor([[0.0, 4.0, -1.0, 2.0 ** 120, 9.0]])
    with emulator.domain_policy("poison"):
        out = _activate(x, nl.sqrt)
    assert torch.equal(out[0, [1, 4]], torch.tensor([2.0, 3.0]))
    assert out[0, [0, 2, 3]].isnan().all()
    with pytest.raises(ValueError, match="mode must be"):
        emulator.domain_policy("ignore")


def test_functions_valid_everywhere_take_inf_and_nan():
    x = torch.tensor([[-math.inf, math.inf, math.nan, 0.0]])
    torch.testing.assert_close(_activate(x, nl.exp), torch.exp(x), equal_nan=True)


# ----------------------------------------------------------------------------- DMA
def _dma(dtype, dge_mode=nisa.dge_mode.unknown, priority=None, engine=nisa.engine.unknown):
    @jit
    def kernel(x):
        t = nl.ndarray(x.shape, dtype=dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x, dge_mode=dge_mode, priority=priority, engine=engine)
        out = nl.ndarray(x.shape, dtype=dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out
    return kernel


def test_a_dma_converts_dtypes_only_in_the_descriptor_modes_it_is_told_convert():
    x = torch.tensor([[1.0, 1 + 2 ** -9]])
    assert torch.equal(_dma(nl.float32)(x), x)  # no conversion: any mode
    message = rejects("dma-cast", _dma(nl.bfloat16), x)
    assert "convert on an engine" in message
    with emulator.dma_casting(nisa.dge_mode.swdge):
        assert torch.equal(_dma(nl.bfloat16, nisa.dge_mode.swdge)(x), x.bfloat16())
        rejects("dma-cast", _dma(nl.bfloat16, nisa.dge_mode.hwdge), x)


def test_dma_priority_is_neuroncore_v4s_and_engine_picks_the_hardware_dge_sequencer():
    x = torch.ones(2, 4)
    rejects("dma-priority", _dma(nl.float32, priority=0), x)
    with emulator.use_target("trn3"):
        _dma(nl.float32, priority=0)(x)
        rejects("dma-priority", _dma(nl.float32, priority=4), x)
    _dma(nl.float32, nisa.dge_mode.hwdge, engine=nisa.engine.scalar)(x)
    rejects("dma-engine", _dma(nl.float32, engine=nisa.engine.sync), x)  # engine without hwdge
    rejects("dma-engine", _dma(nl.float32, nisa.dge_mode.hwdge, engine=nisa.engine.vector), x)


@jit
def _gather_then_scatter(data, index, out, oob=nisa.oob_mode.skip, dge=nisa.dge_mode.swdge, index_in_hbm=False,
                         pattern=None):
    """Rows ``index[p]`` of ``data`` to ``out`` (rows past it: zeros), then those rows of ``data`` doubled."""
    P, F = index.shape[0], out.shape[1]
    pattern = pattern or [[F, P], [1, F]]
    rows = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(rows, index)
    rows = index if index_in_hbm else rows
    tile = nl.ndarray((P, F), dtype=data.dtype, buffer=nl.sbuf)
    nisa.memset(tile, 0.0)
    nisa.dma_copy(tile, data.ap(pattern, vector_offset=rows, indirect_dim=0), oob_mode=oob, dge_mode=dge)
    nisa.dma_copy(out, tile)
    nisa.tensor_scalar(tile, tile, op0=nl.multiply, operand0=2.0)
    nisa.dma_copy(data.ap(pattern, vector_offset=rows, indirect_dim=0), tile, oob_mode=oob, dge_mode=dge)
    return out


def test_an_indirect_dma_gathers_and_scatters_the_indexed_rows_and_skips_those_past_the_axis():
    data, index = torch.randn(6, 5), torch.tensor([[4], [1], [6], [0]], dtype=torch.int32)
    before, out = data.clone(), torch.full((4, 5), 7.0)
    _gather_then_scatter(data, index, out)
    torch.testing.assert_close(out, torch.stack([before[4], before[1], torch.zeros(5), before[0]]), atol=0, rtol=0)
    want = before.clone()
    want[[4, 1, 0]] *= 2
    torch.testing.assert_close(data, want, atol=0, rtol=0)


@pytest.mark.parametrize("bad, rule", [(dict(oob=nisa.oob_mode.error), "dma-oob"),
                                       (dict(dge=nisa.dge_mode.hwdge), "indirect-dge"),
                                       (dict(index_in_hbm=True), "indirect-index"),
                                       (dict(pattern=[[5, 2], [5, 2], [1, 5]], oob=nisa.oob_mode.error), "dma-oob"),
                                       (dict(pattern=[[5, 2], [1]]), "access-pattern"),
                                       (dict(pattern=[[1, 2], [1, 5]]), "api-subset")],
                         ids=["out of bounds", "hardware DGE", "index in HBM", "a run past the end", "malformed",
                              "partition step"])
def test_an_indirect_dma_refuses_what_the_hardware_would(bad, rule):
    data, index = torch.randn(6, 5), torch.tensor([[4], [5 if "pattern" in bad else 6]], dtype=torch.int32)
    before = data.clone()
    width = 10 if rule == "dma-oob" and "pattern" in bad else 5  # two rows a partition
    rejects(rule, _gather_then_scatter, data, index, torch.zeros(2, width), **bad)
    assert torch.equal(data, before)


# ----------------------------------------------------------------------------- SBUF partitions
def _engine_on(index):
    @jit
    def kernel(x):
        t = nl.zeros((128, 4), dtype=nl.float32, buffer=nl.sbuf)
        view = t[index]
        nisa.tensor_scalar(dst=view, data=view, op0=nl.add, operand0=1.0)
        return x
    return kernel


def test_an_on_chip_access_covers_consecutive_partitions():
    message = rejects("partition-stride", _engine_on(slice(0, 128, 2)), torch.zeros(1))
    assert "steps over partitions" in message
    _engine_on(slice(0, 64))(torch.zeros(1))

    @jit
    def integer_index(x):
        t = nl.zeros((128, 4), dtype=nl.float32, buffer=nl.sbuf)
        assert t[3].shape == (1, 4) and t[-1, 2].shape == (1,)  # the partition axis stays, at size 1
        return x

    integer_index(torch.zeros(1))


def test_an_engine_access_starts_on_the_partition_its_size_allows():
    for start, stop in ((0, 128), (64, 128), (32, 64), (96, 97)):
        _engine_on(slice(start, stop))(torch.zeros(1))
    for start, stop in ((5, 6), (32, 96), (1, 128)):
        rejects("start-partition", _engine_on(slice(start, stop)), torch.zeros(1))

    @jit
    def dma_to_one_partition(x):  # DMA descriptors address any partition
        t = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[5:6, 0:4], src=x)
        return x

    dma_to_one_partition(torch.zeros(1, 4))


# ----------------------------------------------------------------------------- memset
def _memset(value, dtype, shape=(4, 4)):
    @jit
    def kernel(x):
        nisa.memset(dst=nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf), value=value)
        return x
    return kernel


def test_memset_takes_a_number_its_dtype_holds():
    for value, dtype in ((1e30, nl.bfloat16), (-math.inf, nl.float16), (-5, nl.int32), (255, nl.uint8)):
        _memset(value, dtype)(torch.zeros(1))
    for value, dtype in ((1e5, nl.float16), (1.5, nl.int32), (300, nl.uint8), (-1, nl.uint16), (True, nl.int8)):
        rejects("memset-value", _memset(value, dtype), torch.zeros(1))
    rejects("memset-shape", _memset(0.0, nl.float32, (2, 1, 1, 1, 1, 1)), torch.zeros(1))


# ----------------------------------------------------------------------------- logical NeuronCores
@jit
def _sharded_double(x):
    """Each core doubles its half of the rows; without a grid, one core does both halves."""
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    cores, core = nl.num_programs(), nl.program_id(0)
    rows = x.shape[0] // cores
    for r0 in range(core * rows, (core + 1) * rows, 128):
        t = nl.ndarray((128, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[r0:r0 + 128, :])
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
        nisa.dma_copy(dst=out[r0:r0 + 128, :], src=t)
    return out


def test_kernel_2_runs_one_program_per_core_over_shared_hbm():
    x = torch.randn(256, 8)
    with emulator.count_instructions() as stats:
        out = _sharded_double[2](x)
    assert torch.equal(out, 2 * x) and torch.equal(_sharded_double(x), 2 * x)
    assert stats.launches == 1 and stats.instructions["vector"] == 2  # one tile per core


def test_each_core_has_its_own_sbuf():
    @jit
    def fill_sbuf(x):
        nl.ndarray((128, 224 * 1024 // 4), dtype=nl.float32, buffer=nl.sbuf)  # a whole core's SBUF
        return x

    fill_sbuf[2](torch.zeros(1))


def test_cores_that_write_the_same_hbm_race():
    @jit
    def both_write_everything(x):
        t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.dma_copy(dst=x, src=t)
        return x

    both_write_everything(torch.zeros(4, 4))
    message = rejects("lnc-race", both_write_everything[2], torch.zeros(4, 4))
    assert "core 1" in message


def test_launch_grids_and_outputs_follow_lnc():
    for grid in (3, 0, (2,), True):
        rejects("lnc-grid", lambda g=grid: _sharded_double[g])

    @jit
    def private_output(x):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.private_hbm)
        t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.dma_copy(dst=out, src=t)
        return out

    private_output(torch.zeros(2, 2))
    rejects("lnc-output", private_output[2], torch.zeros(2, 2))

    @jit
    def per_core_shapes(x):
        return nl.ndarray((nl.program_id(0) + 1, 2), dtype=nl.float32, buffer=nl.shared_hbm)

    rejects("lnc-divergent", per_core_shapes[2], torch.zeros(1))

    @jit
    def second_grid_axis(x):
        nl.program_id(1)
        return x

    rejects("lnc-grid", second_grid_axis, torch.zeros(1))


# ----------------------------------------------------------------------------- Trn3 and the instruction budget
def _matmul_into(dtype):
    @jit
    def kernel(x):
        a = nl.zeros((8, 4), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.nc_matmul(nl.ndarray((4, 4), dtype=dtype, buffer=nl.psum), a, a)
        return x
    return kernel


def test_bf16_matmul_output_is_trn3s():
    rejects("matmul-dtype", _matmul_into(nl.bfloat16), torch.zeros(1))
    with emulator.use_target("trn3"):
        _matmul_into(nl.bfloat16)(torch.zeros(1))


def test_a_launch_issues_at_most_the_instruction_budget_per_core():
    assert emulator.core.INSTRUCTION_BUDGET == 5_000_000
    x = torch.ones(128, 8)
    with emulator.instruction_budget(2):  # one tile: load, double, store
        rejects("instruction-budget", _sharded_double, x)
    with emulator.instruction_budget(3):
        assert torch.equal(_sharded_double(x), 2 * x)


# ----------------------------------------------------------------------------- the kernels, on those inputs
def _adam_case(grads, eps=1e-8):
    params = [torch.linspace(-1, 1, g.numel()).reshape(g.shape) for g in grads]
    state = [params, [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params], [],
             [torch.zeros(()) for _ in params]]
    kw = dict(amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-2, weight_decay=0.0, eps=eps, maximize=False,
              decoupled_weight_decay=False)
    expected = [[t.clone() for t in ts] for ts in state]
    reference_adam(expected[0], grads, *expected[1:], **kw)
    return state, kw, expected


def test_adam_keeps_the_scalar_engine_in_its_domains_on_zero_huge_and_nonfinite_moments():
    """Zero grads (an untouched embedding row: sqrt of 0), a grad whose square overflows (m / inf = 0), inf and
    NaN grads (NaN params): torch's answers, with the emulator refusing any out-of-domain input."""
    grads = [torch.tensor([0.0, 1.0, 1e30, 0.0]), torch.tensor([math.inf, math.nan, -2.0])]
    state, kw, expected = _adam_case(grads)
    adam(state[0], grads, *state[1:], **kw)
    for outs, refs in zip(state[:3], expected[:3]):
        for out, ref in zip(outs, refs):
            torch.testing.assert_close(out, ref, equal_nan=True, rtol=1e-5, atol=1e-6)


def test_adam_declines_an_eps_the_reciprocal_cannot_take():
    call = dict(params=[torch.zeros(3)], exp_avgs=[torch.zeros(3)], exp_avg_sqs=[torch.zeros(3)],
                max_exp_avg_sqs=[], eps=1e-16)
    assert "eps" in adam_supports(call)[0]
    assert adam_supports({**call, "eps": 1e-8}) == []


@pytest.mark.parametrize("scale", [0.0, 1e-19, 1e18, math.inf, math.nan])
def test_the_2_norm_of_zero_tiny_huge_and_nonfinite_grads_is_the_definitions(scale):
    """Sums of squares 0, below sqrt's valid range (2^-116), above it (2^118), inf and NaN; a bfloat16 grad in
    its own tail tile."""
    grads = [torch.full((130,), scale), torch.zeros(3, dtype=torch.bfloat16)]
    expected = reference_grad_norm(grads, 2.0)
    torch.testing.assert_close(grad_norm(grads, 2.0), expected, equal_nan=True, rtol=1e-5, atol=0)
