"""Sliding windows, softcapping and packed (varlen) sequences (paged KV caches: tests/test_paged_attention.py).

Each feature is compared with a computation written here from its definition: masks from Python loops
over query and key positions, the softcap as ``softcap * tanh(s / softcap)``, packed sequences one at a
time, a paged cache gathered position by position; gradients through torch's autograd of that
computation, in float64. Bad input must be refused before anything runs, naming the argument, and a
refused ``paged_kv_append`` must leave the caches bit-identical. A backend whose kernels lack a feature
declines it with a reason: the calls fall back, or raise under strict mode. nki's kernels take window and
softcap (tests/test_nki_backend.py checks them) and packed sequences, and decline paged attention. torch.compile and
opcheck: tests/test_compile.py.
"""

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import portable_ops
from attention_definitions import (F64, NOT_REFERENCE, TAKING, definition, packed, paged_cache,
                                   per_sequence, qkv)
from portable_ops import dispatch
from portable_ops.conformance import CASES, run_case
from portable_ops.conformance.runner import default_device, forced_strict


def assert_same_with_gradients(ours, theirs, inputs, tol=1e-10):
    """Outputs, and gradients of a random projection of them, equal."""
    dout = torch.randn(ours.shape, generator=torch.Generator().manual_seed(9), dtype=ours.dtype)
    torch.testing.assert_close(ours, theirs, atol=tol, rtol=tol)
    for a, b in zip(torch.autograd.grad(ours, inputs, dout), torch.autograd.grad(theirs, inputs, dout)):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- sliding window and softcap

WINDOWS = [(0, 0), (3, 5), (None, 7), (128, None), (2, None), (None, 0), (1, 0), (None, None)]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, skv", [(9, 9), (5, 13), (11, 4)], ids=["square", "fewer-queries", "more-queries"])
def test_window_is_the_definition(window, causal, sq, skv):
    q, k, v = qkv(sq=sq, skv=skv)
    ours = portable_ops.attention(q, k, v, causal=causal, window=window)
    assert_same_with_gradients(ours, definition(q, k, v, causal, window=window), (q, k, v))


def test_window_0_0_sees_only_its_own_position():
    q, k, v = qkv(sq=6, skv=6, hq=4, hkv=2)
    out = portable_ops.attention(q, k, v, window=(0, 0), scale=100.0)
    torch.testing.assert_close(out, v.repeat_interleave(2, dim=1))  # each query's own key's value, GQA heads


def test_rows_that_see_no_key_are_zero_with_zero_gradient_and_minus_inf_lse():
    # the last key sits at position 9 for query 9 (Sq == Skv); window (0, 0) with 3 more queries than keys:
    # queries 0-2 sit at positions -3..-1 and see nothing
    q, k, v = qkv(sq=8, skv=5)
    out = portable_ops.attention(q, k, v, window=(0, 0))
    dq, = torch.autograd.grad(out.sum(), q)
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    assert torch.equal(dq[:, :, :3], torch.zeros_like(dq[:, :, :3])) and dq[:, :, 3:].abs().sum() > 0
    from portable_ops.definitions.attention import attention_fwd
    _, lse = attention_fwd(q.detach(), k.detach(), v.detach(), causal=False, scale=0.3, window=(0, 0))
    assert torch.isneginf(lse[:, :, :3]).all() and torch.isfinite(lse[:, :, 3:]).all()


@pytest.mark.parametrize("softcap, scale", [(30.0, None), (50.0, 2.0), (5.0, 100.0), (0.5, 1e4)],
                         ids=["30", "50-scale-2", "5-huge-scores", "0.5-saturated"])
@pytest.mark.parametrize("window", [None, (4, 1)], ids=["no-window", "window"])
def test_softcap_is_the_definition(softcap, scale, window):
    """Huge scores (scale 1e4 against a cap of 0.5) saturate tanh: finite, and the definition's answer."""
    q, k, v = qkv(sq=7, skv=10)
    ours = portable_ops.attention(q, k, v, causal=True, scale=scale, window=window, softcap=softcap)
    assert torch.isfinite(ours).all()
    assert_same_with_gradients(ours, definition(q, k, v, True, scale, window, softcap), (q, k, v), tol=1e-9)


def test_softcap_changes_the_answer_and_off_is_off():
    q, k, v = qkv()
    plain = portable_ops.attention(q, k, v, scale=3.0)
    assert (portable_ops.attention(q, k, v, scale=3.0, softcap=5.0) - plain).abs().max() > 0.1
    for off in (None, 0, 0.0, np.float32(0)):
        assert torch.equal(portable_ops.attention(q, k, v, scale=3.0, softcap=off), plain)


def test_gradcheck_and_second_derivatives_through_window_and_softcap():
    q, k, v = qkv(b=1, hq=2, hkv=1, sq=4, skv=6, d=3)

    def f(q, k, v):
        return portable_ops.attention(q, k, v, causal=True, window=(2, None), softcap=2.0, scale=1.5)

    assert torch.autograd.gradcheck(f, (q, k, v))
    assert torch.autograd.gradgradcheck(f, (q, k, v))


def test_torch_func_transforms_with_window_and_softcap():
    q, k, v = (t.detach() for t in qkv(b=1, sq=5, skv=7))
    options = dict(causal=False, window=(1, 2), softcap=3.0, scale=2.0)
    batch = [torch.stack([t, t.flip(-2)]) for t in (q, k, v)]
    ours = lambda q, k, v: portable_ops.attention(q, k, v, **options)  # noqa: E731
    theirs = lambda q, k, v: definition(q, k, v, **options)  # noqa: E731
    torch.testing.assert_close(torch.func.vmap(ours)(*batch), torch.func.vmap(theirs)(*batch))
    tangents = tuple(torch.randn_like(t) for t in (q, k, v))
    torch.testing.assert_close(torch.func.jvp(ours, (q, k, v), tangents)[1],
                               torch.func.jvp(theirs, (q, k, v), tangents)[1])
    for a, b in zip(torch.func.grad(lambda *t: ours(*t).square().sum(), argnums=(0, 1, 2))(q, k, v),
                    torch.func.grad(lambda *t: theirs(*t).square().sum(), argnums=(0, 1, 2))(q, k, v)):
        torch.testing.assert_close(a, b)


def test_numpy_and_tensor_arguments_act_as_the_numbers_they_hold():
    q, k, v = (t.detach() for t in qkv())
    want = portable_ops.attention(q, k, v, window=(3, 2), softcap=30.0)
    for window, softcap in (((np.int64(3), np.int32(2)), np.float32(30.0)), ([3, 2], np.float64(30.0)),
                            ((3, 2), torch.tensor(30.0)), ((3, 2), np.array(30.0)), ((3, 2), 30)):
        assert torch.equal(portable_ops.attention(q, k, v, window=window, softcap=softcap), want)


BAD_OPTIONS = {
    "negative left": (dict(window=(-1, 2)), ValueError, r"window\[0\] must be >= 0, got -1; use None for an unbounded "
                                                       r"side \(FlashAttention's -1\)"),
    "negative right": (dict(window=(2, -1)), ValueError, r"window\[1\] must be >= 0, got -1"),
    "one entry": (dict(window=(3,)), ValueError, r"window must be None or a pair \(left, right\).*1 entries"),
    "three entries": (dict(window=(1, 2, 3)), ValueError, "window must be None or a pair"),
    "an int": (dict(window=3), TypeError, "window must be None or a pair .* got int 3"),
    "a float side": (dict(window=(3.0, 1)), TypeError, r"window\[0\] must be a non-negative int or None .* float"),
    "a bool side": (dict(window=(1, True)), TypeError, r"window\[1\] must be a non-negative int or None .* bool"),
    "a tensor side": (dict(window=(torch.tensor(2), 1)), TypeError, r"window\[0\] must be a non-negative int"),
    "negative softcap": (dict(softcap=-1.0), ValueError, "softcap must be >= 0.0, got -1.0"),
    "nan softcap": (dict(softcap=math.nan), ValueError, "softcap must be finite, got nan"),
    "inf softcap": (dict(softcap=math.inf), ValueError, "softcap must be finite, got inf"),
    "string softcap": (dict(softcap="30"), TypeError, "softcap must be a number, got str"),
    "bool softcap": (dict(softcap=True), TypeError, "softcap must be a number, got bool"),
    "softcap needing grad": (dict(softcap=torch.tensor(3.0, requires_grad=True)), TypeError,
                             "softcap must be a number, or a tensor that does not require grad"),
    "softcap on another device": (dict(softcap=torch.tensor(3.0, device="meta")), ValueError,
                                  "softcap must be a number or a one-element CPU tensor, got a tensor on meta"),
    "softcap of two elements": (dict(softcap=torch.tensor([3.0, 4.0])), ValueError,
                                "softcap must be a float or a one-element tensor"),
}


@pytest.mark.parametrize("name", BAD_OPTIONS)
def test_bad_window_and_softcap_are_refused_by_name(name, fake_backend):
    calls = []
    stand_in = fake_backend("triton")
    for op in ("attention_fwd", "attention_bwd"):
        stand_in.ops[op] = dispatch.OpImpl(run=lambda **call: calls.append(call))
    options, error, message = BAD_OPTIONS[name]
    q, k, v = qkv()
    with portable_ops.use_backend("triton"), pytest.raises(error, match=message):
        portable_ops.attention(q, k, v, **options)
    assert not calls  # refused before any backend ran


@pytest.mark.parametrize("backend", NOT_REFERENCE)
@pytest.mark.parametrize("feature", ["window", "softcap"])
def test_kernel_backends_take_window_and_softcap(backend, feature, monkeypatch):
    """No fallback: explain, strict mode and the warning filter all see the call run on the backend."""
    monkeypatch.setattr(dispatch, "_warned", set())
    q, k, v = (t.to(default_device(backend)) for t in qkv(dtype=torch.float32))
    options = {"window": dict(window=(2, 1)), "softcap": dict(softcap=20.0)}[feature]
    with portable_ops.use_backend(backend):
        choice = portable_ops.explain(portable_ops.attention, q, k, v, **options)
        assert choice.backend == backend
        with warnings.catch_warnings():
            warnings.simplefilter("error", portable_ops.FallbackWarning)
            out = portable_ops.attention(q, k, v, **options)
    torch.testing.assert_close(out.cpu(), definition(*(t.double().cpu() for t in (q, k, v)), **options).float(),
                               atol=2e-3, rtol=2e-3)
    with forced_strict(backend):
        portable_ops.attention(q, k, v, **options)


@pytest.mark.parametrize("backend", NOT_REFERENCE)
def test_masks_a_backend_has_still_run_there(backend):
    """One spelling per mask: window (None, 0) is causal and (None, None) no window, which the kernels take;
    the fast path's choice is unchanged by the new arguments."""
    q, k, v = (t.to(default_device(backend)) for t in qkv(dtype=torch.float32))
    with portable_ops.use_backend(backend):
        for options in (dict(window=(None, 0)), dict(window=(None, None)), dict(causal=True, window=(None, 3)),
                        dict(softcap=0.0), {}):
            assert portable_ops.explain(portable_ops.attention, q, k, v, **options).backend == backend, options


# ----------------------------------------------------------------------------- packed sequences

VARLEN = {
    "ragged": ((17, 0, 33, 5), (17, 0, 33, 5)),
    "cross lengths": ((5, 0, 12, 9), (20, 7, 12, 4)),  # the last sequence has more queries than keys
    "one sequence": ((11,), (11,)),
    "empty first and last": ((0, 6, 0), (3, 6, 0)),
}


@pytest.mark.parametrize("lens", VARLEN.values(), ids=VARLEN.keys())
@pytest.mark.parametrize("options", [dict(), dict(causal=True), dict(window=(3, 5)),
                                     dict(causal=True, window=(2, None)), dict(softcap=5.0, scale=2.0),
                                     dict(causal=True, window=(4, 1), softcap=30.0)],
                         ids=["plain", "causal", "window", "causal-window", "softcap", "all"])
def test_varlen_is_each_sequence_on_its_own(lens, options):
    lens_q, lens_k = lens
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k)
    ours = portable_ops.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **options)
    assert ours.shape == q.shape and ours.is_contiguous()
    assert_same_with_gradients(ours, per_sequence(q, k, v, lens_q, lens_k, **options), (q, k, v))


def test_varlen_equals_dense_attention_for_equal_lengths_and_takes_sliced_inputs():
    """Three sequences of 8 packed are dense attention with batch 3; q, k, v sliced from one projection."""
    qkv_ = torch.randn(24, 8, 16, dtype=F64, requires_grad=True)
    q, k, v = qkv_.split([4, 2, 2], dim=1)
    cu = torch.tensor([0, 8, 16, 24], dtype=torch.int32)
    ours = portable_ops.attention_varlen(q, k, v, cu, cu, 8, 8, causal=True, window=(3, None))
    dense = portable_ops.attention(*(t.view(3, 8, -1, 16).transpose(1, 2) for t in (q, k, v)), causal=True,
                                   window=(3, None))
    assert_same_with_gradients(ours, dense.transpose(1, 2).reshape(24, 4, 16), (qkv_,))


def test_varlen_gradcheck_and_second_derivatives():
    q, k, v, cu_q, cu_k = packed((3, 0, 4), (2, 1, 5), hq=2, hkv=1, d=3)

    def f(q, k, v):
        return portable_ops.attention_varlen(q, k, v, cu_q, cu_k, 4, 5, causal=True, softcap=3.0, window=(2, None))

    assert torch.autograd.gradcheck(f, (q, k, v))
    assert torch.autograd.gradgradcheck(f, (q, k, v))


def test_varlen_without_queries_or_keys():
    q, k, v, cu_q, cu_k = packed((0, 0), (3, 4))
    assert portable_ops.attention_varlen(q, k, v, cu_q, cu_k, 0, 4).shape == (0, 4, 8)
    q, k, v, cu_q, cu_k = packed((3, 4), (0, 0))  # no keys at all: every row sees none
    out = portable_ops.attention_varlen(q, k, v, cu_q, cu_k, 4, 0)
    dq, = torch.autograd.grad(out.sum(), q)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(dq, torch.zeros_like(dq))


def bad_varlen():
    """name -> (a function of the good arguments returning the bad ones, error, message)."""
    def changed(i, value):
        return lambda args: args[:i] + [value] + args[i + 1:]

    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    return {
        "q of 4 dims": (changed(0, torch.randn(1, 7, 4, 8)), ValueError,
                        r"q must have 3 dimensions \[tokens, heads, head_dim\], got shape \(1, 7, 4, 8\)"),
        "k of another dtype": (changed(1, torch.randn(7, 2, 8)), TypeError, "k has dtype torch.float32 but q has"),
        "heads": (changed(0, torch.randn(7, 3, 8, dtype=F64)), ValueError,
                  "q has 3 heads, k and v have 2: q's head count must be a multiple"),
        "int64 offsets": (changed(3, cu.long()), TypeError, "cu_seqlens_q has dtype torch.int64; expected torch.int32"),
        "2-d offsets": (changed(4, cu[None]), ValueError, r"cu_seqlens_k must have 1 dimension"),
        "offsets elsewhere": (changed(3, cu.to("meta")), ValueError, "cu_seqlens_q is on meta but q is on cpu"),
        "offsets a list": (changed(3, [0, 3, 7]), TypeError, "cu_seqlens_q must be an int32 tensor"),
        "no entries": (changed(3, cu[:0]), ValueError, "cu_seqlens_q must have N \\+ 1 >= 1 entries"),
        "sequence counts differ": (changed(4, cu[:2]), ValueError,
                                   "cu_seqlens_q has 3 entries but cu_seqlens_k has 2"),
        "not from 0": (changed(3, torch.tensor([1, 3, 7], dtype=torch.int32)), ValueError,
                       r"cu_seqlens_q\[0\] must be 0, got 1"),
        "decreasing": (changed(4, torch.tensor([0, 5, 4], dtype=torch.int32)), ValueError,
                       r"cu_seqlens_k must be non-decreasing, but cu_seqlens_k\[2\] = 4 < cu_seqlens_k\[1\] = 5"),
        "short of the tokens": (changed(3, torch.tensor([0, 3, 6], dtype=torch.int32)), ValueError,
                                r"cu_seqlens_q\[-1\] is 6 but q has 7 tokens"),
        "max_seqlen too small": (changed(5, 3), ValueError,
                                 "max_seqlen_q is 3 but sequence 1 has 4 tokens .*at least the longest"),
        "max_seqlen a float": (changed(6, 4.0), TypeError, "max_seqlen_k must be an int, got float"),
        "max_seqlen a bool": (changed(6, True), TypeError, "max_seqlen_k must be an int, got bool"),
        "max_seqlen negative": (changed(6, -1), ValueError, "max_seqlen_k must be >= 0, got -1"),
    }


BAD_VARLEN = bad_varlen()


@pytest.mark.parametrize("name", BAD_VARLEN)
def test_bad_varlen_input_is_refused_by_name_before_anything_runs(name, fake_backend):
    calls = []
    stand_in = fake_backend("triton", ops=("attention_varlen_fwd", "attention_varlen_bwd"))
    for op in stand_in.ops:
        stand_in.ops[op] = dispatch.OpImpl(run=lambda **call: calls.append(call))
    q, k, v, cu_q, cu_k = packed((3, 4), (3, 4))
    make, error, message = BAD_VARLEN[name]
    args = make([q, k, v, cu_q, cu_k, 4, 4])
    with portable_ops.use_backend("triton"), pytest.raises(error, match=message):
        portable_ops.attention_varlen(*args, causal=True)
    assert not calls


def test_offsets_are_read_once_per_version(reads):
    """The training loop's case: one cu_seqlens per step, passed to every layer (here as both q's and k's)."""
    q, k, v, cu, _ = packed((3, 4), (3, 4))
    for _layer in range(4):
        portable_ops.attention_varlen(q, k, v, cu, cu, 4, 4, causal=True).sum().backward()
    assert len(reads) == 1 and reads[0] is cu
    cu.copy_(torch.tensor([0, 2, 7], dtype=torch.int32))  # the next step's lengths, written in place
    portable_ops.attention_varlen(q, k, v, cu, cu, 5, 5)
    portable_ops.attention_varlen(q, k, v, cu, cu, 5, 5)
    assert len(reads) == 2
    cu[1] = 9  # a change that breaks the offsets is caught on the next call
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        portable_ops.attention_varlen(q, k, v, cu, cu, 9, 9)
    fresh = torch.tensor([0, 3, 7], dtype=torch.int32)  # equal values, another tensor: read
    portable_ops.attention_varlen(q, k, v, fresh, fresh, 4, 4)
    assert len(reads) == 4


def test_inference_tensors_have_no_version_and_are_read_every_call(reads):
    q, k, v, _, _ = (t.detach() if t.requires_grad else t for t in packed((3, 4), (3, 4)))
    with torch.inference_mode():
        cu = torch.tensor([0, 3, 7], dtype=torch.int32)
        portable_ops.attention_varlen(q, k, v, cu, cu, 4, 4)
        cu[1] = 9
        with pytest.raises(ValueError, match="non-decreasing"):
            portable_ops.attention_varlen(q, k, v, cu, cu, 9, 9)
    assert len(reads) == 2


def test_varlen_inside_torch_func_is_refused_clearly():
    q, k, v, cu_q, cu_k = packed((3, 4), (3, 4))
    with pytest.raises(RuntimeError, match="attention_varlen does not support torch.func transforms"):
        torch.func.grad(lambda q: portable_ops.attention_varlen(q, k, v, cu_q, cu_k, 4, 4).sum())(q.detach())


# ----------------------------------------------------------------------------- properties

PROPERTY = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
SIDE = st.one_of(st.none(), st.integers(0, 12))


@PROPERTY
@given(sq=st.integers(1, 12), skv=st.integers(1, 12), groups=st.integers(1, 3), causal=st.booleans(),
       window=st.one_of(st.none(), st.tuples(SIDE, SIDE)), softcap=st.one_of(st.none(), st.floats(0.5, 60.0)),
       scale=st.floats(-3.0, 30.0))
def test_any_dense_window_and_softcap_is_the_definition(sq, skv, groups, causal, window, softcap, scale):
    q, k, v = qkv(b=1, hq=2 * groups, hkv=2, sq=sq, skv=skv, d=4)
    ours = portable_ops.attention(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap)
    assert_same_with_gradients(ours, definition(q, k, v, causal, scale, window, softcap), (q, k, v), tol=1e-9)


@PROPERTY
@given(lens=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=4),
       causal=st.booleans(), window=st.one_of(st.none(), st.tuples(SIDE, SIDE)),
       softcap=st.one_of(st.none(), st.floats(1.0, 50.0)))
def test_any_packing_is_each_sequence_on_its_own(lens, causal, window, softcap):
    lens_q, lens_k = zip(*lens)
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, hq=2, hkv=1, d=4)
    ours = portable_ops.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, window=window,
                                         softcap=softcap)
    assert_same_with_gradients(ours, per_sequence(q, k, v, lens_q, lens_k, causal=causal, window=window,
                                                  softcap=softcap), (q, k, v))


# ----------------------------------------------------------------------------- the conformance cases can fail

def _broken(run, **changes):
    """``run`` with some of its call's arguments replaced: a backend that gets a feature wrong."""
    return lambda **call: run(**{**call, **changes})


@pytest.mark.parametrize("case_name, op, changes", [
    ("attn_window_3_5_gqa", "attention_fwd", dict(window=None)),
    ("attn_window_left_128_causal", "attention_fwd", dict(window=(127, None))),
    ("attn_softcap_30", "attention_fwd", dict(softcap=None)),
    ("attn_softcap_50_cross", "attention_bwd", dict(softcap=None)),
    ("varlen_window_3_5", "attention_varlen_fwd", dict(window=(3, 4))),
    ("varlen_cross_lengths_causal", "attention_varlen_bwd", dict(causal=False)),
    ("paged_decode_window_page16", "paged_attention", dict(window=None)),
    ("paged_softcap_page16", "paged_attention", dict(softcap=45.0)),
    ("attn_sinks_lse_gqa_window_more_queries", "attention_fwd", dict(sinks=None)),
    ("varlen_sinks_lse_dv_causal_cross_lengths", "attention_varlen_fwd", dict(sinks=None)),
    ("paged_sinks_decode_page16", "paged_attention", dict(sinks=None)),
])
def test_a_backend_that_gets_a_feature_wrong_fails_its_cases(case_name, op, changes, fake_backend):
    ops = ("attention_fwd", "attention_bwd", "attention_varlen_fwd", "attention_varlen_bwd", "paged_attention",
           "paged_kv_append")
    stand_in = fake_backend("triton", ops=ops)
    stand_in.ops[op] = dispatch.OpImpl(run=_broken(stand_in.ops[op].run, **changes))
    case = next(c for c in CASES if c.name == case_name and c.dtype == torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", portable_ops.FallbackWarning)
        row = run_case(case, "triton", device=torch.device("cpu"))
    assert row.status in ("fail", "error"), row  # error: ignoring the window reads a released page


def test_an_append_to_the_wrong_slot_fails_its_case(fake_backend):
    stand_in = fake_backend("triton", ops=("paged_attention", "paged_kv_append"))
    append = stand_in.ops["paged_kv_append"].run
    stand_in.ops["paged_kv_append"] = dispatch.OpImpl(
        run=lambda cache_seqlens, **call: append(cache_seqlens=cache_seqlens + 1, **call))
    case = next(c for c in CASES if c.name == "paged_speculative_page16")
    row = run_case(case, "triton", device=torch.device("cpu"))
    assert row.status == "fail" and "after paged_kv_append" in row.detail, row


# ----------------------------------------------------------------------------- review findings (kernels)

@pytest.mark.parametrize("backend", TAKING)
def test_index_tensors_of_any_strides(backend):
    """Offsets, page tables and lengths that are views with strides (a column of a bigger tensor, a
    transposed table) read as their values, not as the memory after their first element."""
    device = default_device(backend)
    q, k, v, cu_q, cu_k = (t.to(device) for t in packed((3, 5), (3, 5), dtype=torch.float32))
    strided = lambda t: torch.stack([t, t * 0 + 99]).t()[:, 0]  # noqa: E731  same values, stride 2
    k_cache, v_cache, table, seqlens = (t.to(device) for t in paged_cache([6, 9], 4, dtype=torch.float32))
    pq = torch.randn(2, 1, 4, 8, device=device)
    with portable_ops.use_backend(backend):
        got = [portable_ops.attention_varlen(q, k, v, strided(cu_q), strided(cu_k), 5, 5, causal=True),
               portable_ops.paged_attention(pq, k_cache, v_cache, table.t().contiguous().t(), strided(seqlens))]
    with portable_ops.use_backend("reference"):
        want = [portable_ops.attention_varlen(q, k, v, cu_q, cu_k, 5, 5, causal=True),
                portable_ops.paged_attention(pq, k_cache, v_cache, table, seqlens)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["reference", *TAKING])
@pytest.mark.parametrize("options", [dict(window=(None, 2**31 - 1)), dict(window=(2**31 - 1, None), causal=True),
                                     dict(softcap=1e7), dict(softcap=1e-42), dict(softcap=1e39)],
                         ids=["right_int32_max", "left_int32_max", "cap_1e7", "cap_1e-42", "cap_1e39"])
def test_extreme_windows_and_caps_match_the_definition(backend, options):
    """A window side near int32's limit is no window (it overflowed into 'no key' once); a huge or tiny
    cap stays as accurate and as finite as the definition."""
    q, k, v = (t.to(default_device(backend)) for t in qkv(dtype=torch.float32))
    q = torch.cat([torch.zeros_like(q[:, :, :1]), q[:, :, 1:]], dim=2)  # a row of zero scores
    with portable_ops.use_backend(backend):
        out = portable_ops.attention(q, k, v, **options)
    torch.testing.assert_close(out.cpu(), definition(*(t.double().cpu() for t in (q, k, v)), **options).float(),
                               atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- outputs are tensors of their own

@pytest.mark.parametrize("backend", ["reference", *TAKING])
def test_packed_and_paged_outputs_and_gradients_take_in_place_ops_like_dense_ones(backend):
    """As SDPA's (and dense attention's, tests/test_attention.py): no output or gradient is a view, so an
    in-place add of a tensor that requires grad is legal on one made under no_grad."""
    device = default_device(backend)

    def add_in_place(t):
        want = t.detach().clone()
        t.add_(torch.ones(t.shape, device=device, requires_grad=True))
        assert torch.equal(t.detach(), want + 1)

    q, k, v, cu_q, cu_k = (t.detach().to(device) for t in packed([3, 7], [5, 7], dtype=torch.float32))
    with forced_strict(backend):
        with torch.no_grad():
            add_in_place(portable_ops.attention_varlen(q, k, v, cu_q, cu_k, 7, 7, causal=True))
        leaves = [t.requires_grad_() for t in (q, k, v)]
        out = portable_ops.attention_varlen(*leaves, cu_q, cu_k, 7, 7, causal=True)
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    for g in grads:
        add_in_place(g)
    k_cache, v_cache, table, seqlens = (t.to(device) for t in paged_cache([5, 9], 4, dtype=torch.float32))
    # a backend that takes packed sequences may still decline paged caches (nki): its calls go to reference
    paged = "reference" if "paged_attention" in dispatch.get_backend(backend).declined else backend
    with forced_strict(paged), torch.no_grad():
        add_in_place(portable_ops.paged_attention(torch.randn(2, 1, 4, 8, device=device), k_cache, v_cache, table,
                                                  seqlens))
