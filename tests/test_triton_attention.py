"""The triton attention backend: every head dim, output layouts and strides, any finite scale, the
host path, and bf16 rounding in the interpreter. Against the float64 reference (interpreter on CPU,
compiled kernels on CUDA)."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import triton
import triton.language as tl
from torch.utils._python_dispatch import TorchDispatchMode

from triton_attention_checks import DEVICE, attn, check_against_reference, inputs, ref_attn

import portable_ops
from portable_ops import dispatch, layout
from portable_ops.conformance import tolerance

pytestmark = pytest.mark.skipif(dispatch.unavailable_reason("triton") is not None, reason="triton not installed")

plans = importlib.import_module("portable_ops.backends.triton.attention_plans")
configs = importlib.import_module("portable_ops.backends.triton.attention_configs")
sm90 = importlib.import_module("portable_ops.backends.triton.attention_sm90")


def test_inputs_whose_row_major_copies_agree_keep_their_own_output_layouts(monkeypatch):
    """q, k, v with a strided last dim, heads inner or not: the kernels read the same row-major copies, but
    out and the gradients follow each input's own layout (the plans' keys hold the outputs' strides)."""
    monkeypatch.setattr(plans, "fwd_plans", {})
    monkeypatch.setattr(plans, "bwd_plans", {})
    g = torch.Generator().manual_seed(0)
    plain = [torch.randn(1, 2, 16, 32, generator=g)[..., ::2].to(DEVICE) for _ in range(3)]
    inner = [torch.randn(1, 16, 2, 32, generator=g)[..., ::2].to(DEVICE).transpose(1, 2) for _ in range(3)]
    for _ in range(2):
        for q, k, v in (plain, inner):
            out, lse, grads = check_against_reference(q, k, v, causal=False, scale=0.25)
            assert out.stride() == layout.strides_like(q)
            assert [t.stride() for t in grads] == [layout.strides_like(t) for t in (q, k, v)]


# ----------------------------------------------------------------------------- head dims

@pytest.mark.parametrize("d,causal,hq,hkv,sq,skv", [
    (40, True, 4, 2, 37, 37),  # 32 + 16, the last 8 columns masked; GQA
    (80, False, 2, 2, 33, 45),  # 64 + 16
    (96, True, 2, 1, 19, 50),  # 64 + 32, bottom-right causal, GQA
    (192, True, 1, 1, 40, 40),  # 128 + 64
    (72, True, 2, 2, 20, 12),  # 64 + 16 masked; rows that see no key
    (160, False, 2, 1, 9, 70),  # 128 + 32
    (24, False, 1, 1, 17, 17),  # one chunk of 32, masked
    (16, True, 2, 2, 33, 33),  # the smallest chunk
    (56, True, 1, 1, 30, 30),  # one chunk of 64: a second of 32 would double the MMA work anyway
    (200, False, 1, 1, 20, 20),  # one chunk of 256
    (20, True, 2, 1, 21, 21),  # not a multiple of 8
    (130, False, 1, 1, 17, 23),  # 128 + 16 with 14 masked
])
def test_every_head_dim_forward_and_backward(d, causal, hq, hkv, sq, skv):
    q, k, v = inputs(1, hq, hkv, sq, skv, d, seed=d)
    assert attn.attention_supports({"q": q, "k": k, "v": v, "scale": 0.1}) == []
    check_against_reference(q, k, v, causal, 1 / math.sqrt(d))


@pytest.mark.parametrize("d", [40, 80, 192])
def test_odd_head_dims_decode_packed_gqa_and_split_keys(d):
    # 4 query heads x 2 tokens share a program (GQA-packed); 1100 keys split across programs
    q, k, v = inputs(1, 8, 2, 2, 1100, d, seed=d)
    plan_block_m, plan_block_n = configs.tile_config("fwd", q, q.shape[2], k.shape[2], k.shape[1], True, "ieee",
                                              launch=None)[:2]
    assert configs.key_splits(1, 2, 8, 1100, plan_block_m, plan_block_n) > 1 or DEVICE.type == "cuda"
    check_against_reference(q, k, v, True, 1 / math.sqrt(d))


def test_head_split_covers_each_head_dim_with_at_most_two_power_of_two_chunks():
    for d in range(1, attn.MAX_HEAD_DIM + 1):
        d0, d1 = configs.head_split(d)
        assert d0 + d1 >= d and d0 >= 16 and d0 & (d0 - 1) == 0, d
        assert d1 == 0 or (16 <= d1 < d0 and d1 & (d1 - 1) == 0 and d0 < d), d
        assert d0 + d1 <= max(16, triton_next_pow2(d)), d  # never more work than padding would do
    assert [configs.head_split(d) for d in (40, 64, 80, 96, 192, 256)] == [(32, 16), (64, 0), (64, 16), (64, 32),
                                                                        (128, 64), (256, 0)]


def triton_next_pow2(n):
    return 1 << (n - 1).bit_length()


def test_head_dims_past_256_fall_back_with_a_reason():
    q = torch.zeros(1, 1, 4, 264, device=DEVICE)
    reasons = dispatch.get_backend("triton").reasons("attention_fwd", {"q": q, "k": q, "v": q, "scale": 0.1})
    assert reasons == ["head_dim 264 is over 256, the largest the triton kernels take"]


# ----------------------------------------------------------------------------- layouts

@pytest.mark.parametrize("d", [64, 80])
def test_outputs_follow_the_layout_rule_and_transposed_inputs_are_read_in_place(d):
    q, k, v = inputs(2, 4, 2, 33, 33, d, seed=1, heads_inner=True)
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(2, 33, 4, d, generator=g).half().to(DEVICE).transpose(1, 2)  # as autograd hands it back
    out, lse, (dq, dk, dv) = check_against_reference(q, k, v, True, 0.125, dout=dout)
    for result, like in ((out, q), (dq, q), (dk, k), (dv, v)):
        assert result.stride() == layout.strides_like(like) == like.stride()
    assert lse.is_contiguous() and lse.dtype == torch.float32
    contiguous = inputs(2, 4, 2, 33, 33, d, seed=1)
    out2, _, grads2 = check_against_reference(*contiguous, True, 0.125, dout=dout.contiguous())
    assert out2.is_contiguous() and all(t.is_contiguous() for t in grads2)


def test_sliced_from_a_fused_qkv_projection_and_strided_dout():
    b, s, h, d = 1, 21, 2, 40
    qkv = torch.randn(b, s, 3 * h * d, generator=torch.Generator().manual_seed(4)).half().to(DEVICE)
    q, k, v = (t.view(b, s, h, d).transpose(1, 2) for t in qkv.split(h * d, dim=-1))
    assert q.stride(2) == 3 * h * d
    wide = torch.randn(b, h, s, 2 * d, generator=torch.Generator().manual_seed(5)).half().to(DEVICE)
    check_against_reference(q, k, v, True, 0.2, dout=wide[..., ::2])  # a last-dim stride of 2: copied, still right
    out, lse, _ = check_against_reference(q, k, v, False, 0.2, dout=wide[..., :d])  # rows strided: read in place
    assert out.stride() == layout.strides_like(q)


def test_rows_at_any_alignment():
    """Strides pass to the kernels divided by the largest power of two (up to 16) dividing them all."""
    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(1, 2, 23, 41, generator=g).half().to(DEVICE)[..., :40] for _ in range(3))  # rows 41 apart
    assert plans.stride_unit(plans.kernel_strides(q.shape, q.stride())) == 1
    check_against_reference(q, k, v, True, 0.2)
    assert plans.stride_unit(plans.kernel_strides((2, 4, 33, 40), (5280, 1320, 40, 1))) == 8
    # a size-one dim's stride is never stepped, so it does not count
    assert plans.stride_unit(plans.kernel_strides((1, 4, 33, 64), (7, 2112, 64, 1))) == 16


def test_split_key_decode_writes_through_the_output_strides():
    q, k, v = inputs(1, 2, 1, 1, 1100, 64, seed=6, heads_inner=True)
    out, _, _ = check_against_reference(q, k, v, True, 0.125)
    assert out.stride() == layout.strides_like(q)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs CUDA: the batch must fill the GPU's multiprocessors")
@pytest.mark.parametrize("sq", [1, 3])
def test_decode_over_a_batch_that_fills_the_gpu(sq):
    """Batch x KV heads past three an SM: no split, and sm_90's 128-key tiles (decode_tile_config),
    dense against float64 and paged (16-token pages, shuffled) against the dense call."""
    hkv = 8
    b = configs.DECODE_NARROW_PER_SM * configs.multiprocessors(torch.cuda.current_device()) // hkv + 1
    q, k, v = inputs(b, 32, hkv, sq, 333, 128, torch.bfloat16, seed=11)
    out, _ = attn.attention_fwd(q, k, v, causal=True, scale=128 ** -0.5)
    plan = next(p for key, p in plans.fwd_plans.items() if key[:3] == (q.shape, q.stride(), k.shape))
    assert plan.splits == 1
    assert plan.fwd.options["BLOCK_N"] == (128 if sm90.is_sm90(torch.cuda.current_device()) else 64)
    q64, k64, v64 = (t.double().cpu() for t in (q, k, v))
    want = ref_attn.attention_fwd(q64, k64, v64, causal=True, scale=128 ** -0.5)[0]
    torch.testing.assert_close(out.double().cpu(), want, **tolerance("attention", q.dtype)._asdict())
    pages = -(-333 // 16)
    order = torch.randperm(b * pages, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    table = order.view(b, pages).to(torch.int32)
    caches = []
    for t in (k, v):
        cache = t.new_zeros(b * pages, 16, hkv, 128)
        padded = torch.nn.functional.pad(t.transpose(1, 2), (0, 0, 0, 0, 0, pages * 16 - 333))
        cache[order] = padded.reshape(b * pages, 16, hkv, 128)
        caches.append(cache)
    lens = torch.full((b,), 333, dtype=torch.int32, device=DEVICE)
    paged = portable_ops.paged_attention(q.transpose(1, 2), *caches, table, lens)
    torch.testing.assert_close(paged, out.transpose(1, 2), **tolerance("attention", q.dtype)._asdict())


# ----------------------------------------------------------------------------- scale

def test_zero_scale_is_the_uniform_average_of_the_visible_values():
    q, k, v = inputs(1, 2, 1, 20, 12, 32, seed=7)
    out, lse, _ = check_against_reference(q, k, v, True, 0.0)  # rows 0..7 see no key
    v32 = v.float().cpu()[:, [0, 0]]
    for i in range(8, 20):
        torch.testing.assert_close(out[0, :, i].float().cpu(), v32[0, :, : i - 7].mean(1), atol=2e-3, rtol=2e-3)
    assert torch.isneginf(lse[0, :, :8]).all() and not out[0, :, :8].cpu().any()
    check_against_reference(*inputs(1, 2, 2, 1, 300, 64, seed=8), False, 0.0)  # split-key decode


@pytest.mark.parametrize("causal", [False, True])
def test_negative_scale(causal):
    q, k, v = inputs(1, 4, 2, 45, 45, 64, seed=9)
    check_against_reference(q, k, v, causal, -0.3)
    check_against_reference(q, k, v, causal, 0.3)  # the same layout with a positive scale after a negative one


@pytest.mark.parametrize("b,hq,hkv,sq,skv", [(0, 2, 1, 5, 7), (1, 0, 0, 5, 7), (1, 2, 1, 0, 7), (1, 2, 1, 5, 0),
                                            (1, 2, 1, 1, 0)])
def test_empty_inputs_give_empty_or_zero_outputs(b, hq, hkv, sq, skv):
    """The public API answers these itself; the backend takes them without crashing all the same."""
    q, k, v = inputs(b, hq, hkv, sq, skv, 40)
    out, lse = attn.attention_fwd(q, k, v, causal=False, scale=0.1)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    assert not out.cpu().any() and torch.isneginf(lse).all()  # rows that see no key
    dq, dk, dv = attn.attention_bwd(q, k, v, out, lse, torch.ones_like(out), causal=False, scale=0.1)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert not dq.cpu().any()


# ----------------------------------------------------------------------------- host path

class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def no_launches():
    """Kernel launches that do nothing: what is left of a call is its host path."""
    from portable_ops.bench.attention import no_launches

    with no_launches():
        yield


@pytest.mark.parametrize("heads_inner", [False, True])
@pytest.mark.parametrize("skv", [64, 1100])  # split-key decode needs a few more allocations
def test_a_call_only_allocates_and_launches(no_launches, heads_inner, skv, monkeypatch):
    q, k, v = inputs(2, 4, 2, 1 if skv > 1000 else 64, skv, 80, heads_inner=heads_inner)
    out, lse = attn.attention_fwd(q, k, v, causal=True, scale=0.1)  # builds the plans
    dout = torch.ones_like(out)
    attn.attention_bwd(q, k, v, out, lse, dout, causal=True, scale=0.1)
    monkeypatch.setattr(plans, "fwd_plan", None)  # a second call of the same layout builds nothing
    monkeypatch.setattr(plans, "bwd_plan", None)
    with _RecordOps() as recorded:
        out, lse = attn.attention_fwd(q, k, v, causal=True, scale=0.1)
        attn.attention_bwd(q, k, v, out, lse, dout, causal=True, scale=0.1)
    assert set(recorded.ops) <= {"aten.empty", "aten.empty_strided"}, recorded.ops


# ----------------------------------------------------------------------------- float32 precision

@pytest.fixture
def restore_fp32_precision():
    before = torch.backends.cuda.matmul.fp32_precision
    yield
    torch.backends.cuda.matmul.fp32_precision = before


def test_float32_tiles_multiply_as_torch_float32_matmuls_do(restore_fp32_precision):
    """IEEE float32 by default (torch's "highest"), TF32 once the user allows it; each its own plan."""
    q, k, v = inputs(1, 2, 2, 64, 64, 32, torch.float32)
    exact, _ = ref_attn.attention_fwd(q.double(), k.double(), v.double(), causal=True, scale=3.0)
    # a large scale makes the softmax sharp, which magnifies any error in the scores
    ieee, _ = attn.attention_fwd(q, k, v, causal=True, scale=3.0)
    assert configs.dot_precision(torch.float32) == "ieee"
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    assert configs.dot_precision(torch.float32) == "tf32"
    tf32, _ = attn.attention_fwd(q, k, v, causal=True, scale=3.0)
    built = {plan.fwd.options["PRECISION"] for key, plan in plans.fwd_plans.items()
             if key[0] == q.shape and torch.float32 in key}
    assert built >= {"ieee", "tf32"}
    ieee_error, tf32_error = ((out.double() - exact).abs().max().item() for out in (ieee, tf32))
    assert ieee_error < 1e-4
    if DEVICE.type == "cuda":  # the interpreter multiplies in float32 whatever it is told
        assert tf32_error > 10 * ieee_error


def test_float32_inference_reads_the_precision_switch_on_every_call(restore_fp32_precision):
    """portable_ops.attention memoises an inference call's plan, but never a float32 one: each call
    multiplies as the switch says when it runs."""
    q, k, v = inputs(1, 2, 2, 64, 64, 32, torch.float32)
    with torch.no_grad(), portable_ops.use_backend("triton"):
        got = {}
        for precision in ("ieee", "tf32", "ieee"):
            torch.backends.cuda.matmul.fp32_precision = precision
            out = portable_ops.attention(q, k, v, causal=True, scale=3.0)
            assert torch.equal(out, attn.attention_fwd(q, k, v, causal=True, scale=3.0)[0])
            got.setdefault(precision, out)
    if DEVICE.type == "cuda":
        assert not torch.equal(got["ieee"], got["tf32"])


# ----------------------------------------------------------------------------- bf16 rounding

interpreter = importlib.import_module("portable_ops.backends.triton.interpreter")


def _ulps_toward_zero(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Signed error of bf16 ``got`` against float64 ``want``, in bf16 ulps at ``want``, positive away
    from zero: a truncating conversion gives about -0.5 on average, rounding to nearest about 0."""
    got, want = got.double().cpu().flatten(), want.double().cpu().flatten()
    keep = want.abs() > 1e-30
    got, want = got[keep], want[keep]
    ulp = torch.exp2(torch.floor(torch.log2(want.abs())) - 7)
    return (got - want) / ulp * torch.sign(want)


@pytest.fixture(params=["rounding", "truncating"])
def bf16_stores(request, monkeypatch):
    """Run with the kernels' bf16 rounding, and (interpreter only) with the interpreter's own
    truncating conversion, to show that the checks below would catch it."""
    if request.param == "truncating":
        if not interpreter.INTERPRETED:
            pytest.skip("a GPU rounds bf16 itself")
        monkeypatch.setattr(interpreter, "BF16_BY_HAND", False)
    return request.param


def _assert_rounded_to_nearest(errors: torch.Tensor, mode: str, worst_ulps: float = math.inf):
    """Unbiased, and within ``worst_ulps`` (half an ulp where the float32 computation is exact enough)."""
    bias, worst = errors.mean().item(), errors.abs().max().item()
    if mode == "rounding":
        assert abs(bias) < 0.05 and worst <= worst_ulps, (bias, worst)
    else:
        assert bias < -0.3, (bias, worst)  # what the check exists to catch


@triton.jit
def _store_bf16(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, interpreter.to_dtype(tl.load(X + offs), Y.dtype.element_ty))


def test_to_dtype_rounds_float32_to_bf16_bit_for_bit_like_torch():
    special = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20, 3.4e38, -3.4e38, 1e-40, -1e-40, 2**-133,
               0.0, -0.0, float("inf"), float("-inf"), float("nan")]
    x = torch.cat([torch.tensor(special), torch.randn(4096 - len(special), generator=torch.Generator().manual_seed(0))
                   * torch.logspace(-30, 30, 4096 - len(special))]).float()
    x[-1] = torch.tensor(0x7F800001, dtype=torch.int32).view(torch.float32)  # a NaN whose payload could carry
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=DEVICE)
    _store_bf16[(1,)](x.to(DEVICE), y, N=4096)
    want = x.to(torch.bfloat16)
    y = y.cpu()
    assert torch.equal(y.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(y[finite].view(torch.int16), want[finite].view(torch.int16))


@pytest.mark.skipif(not interpreter.INTERPRETED, reason="on a GPU, P and dS are rounded to bf16 before their products: "
                    "that error, not the store's rounding, sets the bias (seen: 0.1 ulp on an H100)")
def test_bf16_attention_outputs_and_gradients_round_to_nearest(bf16_stores):
    """By the bias only: where a float32 sum cancels to near zero, its error is more than an ulp of the
    tiny result, but not in one direction."""
    q, k, v = inputs(1, 4, 2, 64, 64, 64, dtype=torch.bfloat16, seed=11)
    scale = 0.125
    out, lse = attn.attention_fwd(q, k, v, causal=True, scale=scale)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(12)).bfloat16().to(DEVICE)
    grads = attn.attention_bwd(q, k, v, out, lse, dout, causal=True, scale=scale)
    q64, k64, v64 = (t.double().cpu() for t in (q, k, v))
    ref_out, ref_lse = ref_attn.attention_fwd(q64, k64, v64, causal=True, scale=scale)
    # the reference's delta from the backend's own (rounded) out, as the kernels compute it
    ref_grads = ref_attn.attention_bwd(q64, k64, v64, out.double().cpu(), ref_lse, dout.double().cpu(), causal=True,
                                       scale=scale)
    _assert_rounded_to_nearest(_ulps_toward_zero(out, ref_out), bf16_stores)
    for got, want in zip(grads, ref_grads):
        _assert_rounded_to_nearest(_ulps_toward_zero(got, want), bf16_stores)
    split = inputs(1, 2, 1, 1, 1100, 64, dtype=torch.bfloat16, seed=13)  # the split-key combine's store
    ref_split, _ = ref_attn.attention_fwd(*(t.double().cpu() for t in split), causal=True, scale=scale)
    got_split, _ = attn.attention_fwd(*split, causal=True, scale=scale)
    _assert_rounded_to_nearest(_ulps_toward_zero(got_split, ref_split), bf16_stores)


def test_bf16_adam_params_over_float32_state_round_to_nearest(bf16_stores):
    import portable_ops

    ref_adam = importlib.import_module("portable_ops.definitions.adam")
    g = torch.Generator().manual_seed(14)
    n = 20000
    params = [torch.randn(n, generator=g).bfloat16().to(DEVICE)]
    grads = [(torch.randn(n, generator=g) * 1e-2).bfloat16().to(DEVICE)]
    moments = [[torch.rand(n, generator=g).to(DEVICE) * 1e-3] for _ in range(2)]
    steps = [torch.full((), 3.0, device=DEVICE)]
    state = (params, grads, *moments, [], steps)
    ref = [[t.double().cpu() for t in ts] for ts in state[:5]] + [[s.clone().cpu() for s in steps]]
    kw = dict(amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-2, weight_decay=0.0, eps=1e-8, maximize=False,
              decoupled_weight_decay=True)
    with portable_ops.use_backend("triton"):
        portable_ops.functional.adam(*state, state_dtype=torch.float32, **kw)
    ref_adam.adam(*ref, **kw, grad_scale=None, found_inf=None, clip_coef=None)
    _assert_rounded_to_nearest(_ulps_toward_zero(params[0], ref[0][0]), bf16_stores, 0.5 + 1e-3)


# ----------------------------------------------------------------------------- bench (pure-Python parts)

def test_bench_rows_give_each_odd_head_dim_as_a_fraction_of_its_next_power_of_two():
    from portable_ops.bench.__main__ import COLUMNS, main
    from portable_ops.bench.attention import add_fraction_of_power_of_two, with_power_of_two_dims

    assert with_power_of_two_dims((40, 80, 96, 192)) == [40, 64, 80, 96, 128, 192, 256]
    shape = dict(S=4096, B=4, Hkv=16, causal=True)
    rows = [dict(shape, variant=v, dir="fwd", D=d, **{"TFLOP/s": t}) for v, d, t in
            [("portable_ops", 64, 400.0), ("portable_ops", 80, 380.0), ("portable_ops", 96, 300.0),
             ("portable_ops", 128, 500.0), ("sdpa flash", 80, 100.0), ("sdpa flash", 128, 200.0)]]
    rows.append(dict(shape, variant="sdpa cudnn", dir="fwd", D=192, error="not supported"))
    rows.append(dict(shape, variant="sdpa cudnn", dir="fwd", D=256, **{"TFLOP/s": 1.0}))
    fractions = {(r["variant"], r["D"]): r.get("of pow2") for r in add_fraction_of_power_of_two(rows)}
    assert fractions == {("portable_ops", 64): None, ("portable_ops", 80): 380 / 500, ("portable_ops", 96): 300 / 500,
                         ("portable_ops", 128): None, ("sdpa flash", 80): 0.5, ("sdpa flash", 128): None,
                         ("sdpa cudnn", 192): None, ("sdpa cudnn", 256): None}
    assert "of pow2" in COLUMNS["attention"]
    if not torch.cuda.is_available():
        assert main(["attention", "--head-dims", "40,80", "--seqs", "4096"]) == 2  # parsed, then: no CUDA here


def test_bench_host_time_runs_without_a_gpu(capsys):
    from portable_ops.bench.attention import run_attention_host

    rows = run_attention_host(calls=3, b=1, s=16, heads=4, kv_heads=2, d=80)
    assert [r["dir"] for r in rows] == ["fwd", "bwd"] and all(r["host us"] > 0 for r in rows)
    assert type(plans.fwd_kernel).__name__ != "_NoLaunch"


def test_the_sweep_builds_a_fresh_plan_for_each_tile_it_sets(monkeypatch):
    from portable_ops.bench.attention import no_launches

    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location("sweep",
                                                  pathlib.Path(__file__).parents[1] / "benchmarks" / "sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    for module in (plans, configs):  # plans take CONFIGS' tiles, as on a GPU
        monkeypatch.setattr(module, "INTERPRETED", False)
    monkeypatch.setenv("PORTABLE_OPS_AUTOTUNE", "0")
    monkeypatch.setattr(plans, "key_splits", lambda *args: 1)
    q = torch.zeros(1, 2, 64, 80)
    default = list(configs.CONFIGS["fwd"][80])
    with no_launches():
        seen = []
        for cfg in sweep._each_tile("fwd", 80, [(64, 32, 4, 3), (32, 64, 4, 2)]):
            attn.attention_fwd(q, q, q, causal=False, scale=0.1)
            plan = next(iter(plans.fwd_plans.values()))
            seen.append((plan.fwd.options["BLOCK_M"], plan.fwd.options["BLOCK_N"], plan.fwd.options["num_stages"]))
    assert seen == [(64, 32, 3), (32, 64, 2)]
    assert configs.CONFIGS["fwd"][80] == default and not plans.fwd_plans
