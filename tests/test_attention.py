"""portable_ops.attention's behaviour as PyTorch code sees it, on every backend runnable here.

Each backend is forced in strict mode (a fallback fails the test) and compared with a float64
"math" attention written from its definition (softmax of masked, scaled scores times V), which,
unlike SDPA's fused CPU kernels, supports every derivative torch.func asks for.
"""

import importlib
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import portable_ops
from portable_ops import dispatch
from portable_ops.conformance import GRADIENT_FACTOR, tolerance, usable_backends
from portable_ops.conformance.runner import default_device, forced_strict
from conftest import slow_in_the_interpreter

BACKENDS = usable_backends()
F64 = torch.float64


def qkv(b=2, hq=4, hkv=2, sq=9, skv=9, d=16, dtype=F64, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    make = lambda h, s: torch.randn(b, h, s, d, generator=g, dtype=dtype).to(device).requires_grad_()  # noqa: E731
    return make(hq, sq), make(hkv, skv), make(hkv, skv)


def math_attention(q, k, v, causal=False, scale=None):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if causal:
        sq, skv = q.shape[-2], k.shape[-2]
        scores = scores.masked_fill(torch.ones(sq, skv, dtype=torch.bool, device=q.device).triu(skv - sq + 1),
                                    float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def backend_inputs(backend, **kw):
    """float32 inputs on the backend's device (float64 is reference-only), and float64 copies."""
    device = default_device(backend)
    inputs = qkv(dtype=torch.float32, device=device, d=32, **kw)
    return inputs, [t.detach().to("cpu", F64).requires_grad_() for t in inputs]


OUT_TOL = tolerance("attention", torch.float32)  # backend_inputs are float32
GRAD_TOL = OUT_TOL.scaled(GRADIENT_FACTOR)


def close(got, want, tol=OUT_TOL):
    torch.testing.assert_close(got.detach().to("cpu", F64), want.detach(), **tol._asdict())


# ----------------------------------------------------------------------------- semantics (reference)

@pytest.mark.parametrize("causal", [False, True])
def test_matches_sdpa_with_gqa(causal):
    q, k, v = qkv(dtype=torch.float32)
    out = portable_ops.attention(q, k, v, causal=causal, scale=0.3)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, ref)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_gradcheck_float64_causal_cross_lengths():
    q, k, v = qkv(b=1, hq=2, hkv=1, sq=3, skv=5, d=4)
    assert torch.autograd.gradcheck(lambda q, k, v: portable_ops.attention(q, k, v, causal=True), (q, k, v))


def test_causal_is_bottom_right_aligned_for_decode():
    q, k, v = qkv(sq=1, skv=12)
    # With one query, bottom-right causal sees every key: same as no mask at all.
    torch.testing.assert_close(portable_ops.attention(q, k, v, causal=True), portable_ops.attention(q, k, v))
    q, k, v = qkv(sq=3, skv=7)
    out = portable_ops.attention(q, k, v, causal=True)
    mask = torch.ones(3, 7, dtype=torch.bool).tril(diagonal=4)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))


def test_rows_that_see_no_key_are_zero_with_zero_gradient():
    q, k, v = qkv(sq=6, skv=2)
    out = portable_ops.attention(q, k, v, causal=True)
    assert torch.equal(out[:, :, :4], torch.zeros_like(out[:, :, :4]))
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert torch.equal(dq[:, :, :4], torch.zeros_like(dq[:, :, :4]))
    assert torch.isfinite(dq).all()


def test_definition_holds_one_block_of_scores_at_a_time(monkeypatch):
    from portable_ops.definitions import attention as definition

    monkeypatch.setattr(definition, "SCORE_BUDGET", 2 * 2 * 40)  # a handful of rows per block
    widest = []
    original = definition._scores
    monkeypatch.setattr(definition, "_scores", lambda *a: widest.append(a[0].shape[-2]) or original(*a))
    q, k, v = qkv(sq=33, skv=40)
    scale = q.shape[-1] ** -0.5
    out, lse = definition.attention_fwd(q, k, v, causal=True, scale=scale)
    definition.attention_bwd(q, k, v, out, lse, torch.ones_like(out), causal=True, scale=scale)
    assert len(widest) > 10 and max(widest) * 2 * 2 * 40 <= definition.SCORE_BUDGET * 2
    torch.testing.assert_close(out, math_attention(q, k, v, causal=True))


@pytest.mark.parametrize("sq, skv, window", [(33, 40, None), (40, 40, (5, 3)), (40, 33, (7, 0))])
def test_reference_masks_one_block_of_queries_at_a_time(monkeypatch, sq, skv, window):
    """Bottom-right causal with Sq != Skv, and windows, run the fused kernel one query block at a time
    under a mask of that block's size, never one of Sq x Skv."""
    from portable_ops.backends.reference import attention as reference

    monkeypatch.setattr(reference, "MASK_BUDGET", 8 * 16)
    masks = []
    kernel = reference.CPU_KERNEL
    spy = reference.Kernel(forward=lambda *a: masks.append(a[4].shape) or kernel.forward(*a),
                           backward=lambda *a: masks.append(a[7].shape) or kernel.backward(*a))
    monkeypatch.setitem(reference.FUSED_KERNELS, "cpu", reference.FUSED_KERNELS["cpu"]._replace(pick=lambda *_: spy))
    q, k, v = qkv(sq=sq, skv=skv)
    with portable_ops.use_backend("reference"):
        out = portable_ops.attention(q, k, v, causal=True, window=window)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert len(masks) > 4 and all(rows * keys <= reference.MASK_BUDGET for rows, keys in masks)
    from attention_definitions import definition

    expected = definition(q, k, v, causal=True, window=window)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grads, torch.autograd.grad(expected.sum(), (q, k, v)))


# ----------------------------------------------------------------------------- edge values, every backend

ZERO_SIZES = {"batch": ((0, 4, 9, 32), (0, 2, 9, 32)), "heads": ((2, 0, 9, 32), (2, 0, 9, 32)),
              "queries": ((2, 4, 0, 32), (2, 2, 9, 32)), "keys": ((2, 4, 9, 32), (2, 2, 0, 32)),
              "head_dim": ((2, 4, 9, 0), (2, 2, 9, 0))}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ZERO_SIZES)
def test_zero_size_dimensions_answer_like_sdpa(backend, which):
    q_shape, kv_shape = ZERO_SIZES[which]
    device = default_device(backend)
    q, k, v = (torch.randn(s, device=device, requires_grad=True) for s in (q_shape, kv_shape, kv_shape))
    with forced_strict(backend):
        out = portable_ops.attention(q, k, v, causal=True)
        grads = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
    assert out.shape == q.shape and not out.abs().sum()  # zeros where a query sees no key
    for g, t in zip(grads, (q, k, v)):
        assert g is None and t.numel() == 0 or g.shape == t.shape and not g.abs().sum()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [0.0, -0.4, 3.0])
def test_any_finite_scale(backend, scale):
    (q, k, v), exact = backend_inputs(backend)
    with forced_strict(backend):
        out = portable_ops.attention(q, k, v, causal=True, scale=scale)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = math_attention(*exact, causal=True, scale=scale)
    close(out, expected)
    for g, e in zip(grads, torch.autograd.grad(expected.square().sum(), exact)):
        close(g, e, GRAD_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_infinite_inputs_answer_like_sdpa(backend):
    """A key that scores +inf makes its rows NaN; a query that scores -inf against every key gets 0."""
    device = default_device(backend)
    q, k, v = torch.ones(1, 1, 2, 16), torch.ones(1, 1, 3, 16), torch.arange(48.0).view(1, 1, 3, 16)
    plus = k.clone()
    plus[0, 0, 1, 0] = math.inf
    minus = q.clone()
    minus[0, 0, 0, 0] = -math.inf
    for q_, k_ in ((q, plus), (minus, k)):
        want = F.scaled_dot_product_attention(q_, k_, v)
        with forced_strict(backend):
            got = portable_ops.attention(*(t.to(device) for t in (q_, k_, v))).cpu()
        torch.testing.assert_close(got, want, equal_nan=True)


# ----------------------------------------------------------------------------- derivatives, every backend

@pytest.mark.parametrize("backend", BACKENDS)
def test_second_derivatives_through_create_graph(backend):
    """A gradient penalty: d/dq of |d loss / dq|^2, as MAML and WGAN-GP take it."""
    (q, k, v), exact = backend_inputs(backend)

    def penalty(att, q, k, v):
        (dq,) = torch.autograd.grad(att(q, k, v).square().sum(), q, create_graph=True)
        return torch.autograd.grad(dq.square().sum(), (q, k, v))

    with forced_strict(backend):
        got = penalty(lambda q, k, v: portable_ops.attention(q, k, v, causal=True), q, k, v)
    want = penalty(lambda q, k, v: math_attention(q, k, v, causal=True), *exact)
    for g, w in zip(got, want):
        close(g, w, GRAD_TOL)


@pytest.mark.parametrize("backend", slow_in_the_interpreter(BACKENDS))
def test_torch_func_transforms(backend):
    (q, k, v), exact = backend_inputs(backend, b=1, sq=5, skv=5)
    batch = [torch.stack([t.detach(), t.detach().flip(-2)]) for t in (q, k, v)]
    exact_batch = [t.to("cpu", F64) for t in batch]
    tangents = [torch.randn_like(t) for t in (q, k, v)]
    ours = lambda q, k, v: portable_ops.attention(q, k, v, causal=True)  # noqa: E731
    math_ = lambda q, k, v: math_attention(q, k, v, causal=True)  # noqa: E731
    with forced_strict(backend):
        close(torch.func.vmap(ours)(*batch), torch.func.vmap(math_)(*exact_batch))
        per_sample = torch.func.vmap(torch.func.grad(lambda *a: ours(*a).square().sum(), argnums=(0, 1, 2)))
        expected = torch.func.vmap(torch.func.grad(lambda *a: math_(*a).square().sum(), argnums=(0, 1, 2)))
        for g, e in zip(per_sample(*batch), expected(*exact_batch)):
            close(g, e, GRAD_TOL)
        _, tangent = torch.func.jvp(ours, (q, k, v), tuple(tangents))
        close(tangent, torch.func.jvp(math_, tuple(exact), tuple(t.to("cpu", F64) for t in tangents))[1], GRAD_TOL)
        # jacrev backpropagates once per output element, batched: a small call keeps the interpreter's grid small
        small = [t[:, :h, :3, :16].detach().contiguous() for t, h in zip((q, k, v), (2, 1, 1))]
        small_exact = [t[:, :h, :3, :16].contiguous() for t, h in zip(exact, (2, 1, 1))]
        close(torch.func.jacrev(ours)(*small), torch.func.jacrev(math_)(*small_exact), GRAD_TOL)


def test_second_derivatives_inside_torch_func_are_refused_clearly():
    q, k, v = qkv(b=1, sq=3, skv=3, d=4)
    with pytest.raises(RuntimeError, match="second derivatives inside torch.func"):
        torch.func.hessian(lambda q: portable_ops.attention(q, k, v).sum())(q)


# ----------------------------------------------------------------------------- autocast

def test_autocast_casts_like_sdpa():
    """After a float32 RoPE autocast hands attention float32 q/k and a bf16 v: both cast them."""
    q, k, v = (t.detach() for t in qkv(dtype=torch.float32))
    v = v.bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = portable_ops.attention(q, k, v, causal=True)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert portable_ops.attention(q.double(), k.double(), v.double()).dtype == F64  # float64 is left alone
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_only_casts_the_inputs(backend):
    """Inside the call autocast is off: the backends' float32 products and accumulations stay
    float32, so autocast's answer is the answer for the cast inputs, bit for bit."""
    device = default_device(backend)
    (q, k, v), _ = backend_inputs(backend)
    q, k, v = (t.detach().mul(3).requires_grad_() for t in (q, k, v))  # larger scores: rounding would show
    cast = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
    with forced_strict(backend):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = portable_ops.attention(q, k, v, causal=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        plain = portable_ops.attention(*cast, causal=True)
        plain_grads = torch.autograd.grad(plain, cast, dout)
    assert torch.equal(out, plain)
    for g, want in zip(grads, plain_grads):
        assert g.dtype == torch.float32 and torch.equal(g, want.float())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("sq", [1, 9])
def test_an_output_made_under_no_grad_is_modifiable_in_place(backend, transposed, sq):
    """Like SDPA's: an output is a fresh tensor, not a view, so that adding a tensor that requires grad
    into it in place is legal once grad mode is back on."""
    device = default_device(backend)
    g = torch.Generator().manual_seed(0)
    make = lambda h, s: (torch.randn(2, s, h, 32, generator=g).transpose(1, 2) if transposed  # noqa: E731
                         else torch.randn(2, h, s, 32, generator=g)).to(device)
    q, k, v = make(4, sq), make(2, 9), make(2, 9)
    with forced_strict(backend), torch.no_grad():
        out = portable_ops.attention(q, k, v, causal=True)
    want = out.detach().clone()
    bias = torch.ones(out.shape, device=device, requires_grad=True)
    out.add_(bias)
    assert out.requires_grad and torch.equal(out.detach(), want + 1)


def test_causal_must_be_a_bool_and_scale_must_not_need_grad():
    q, k, v = (t.detach() for t in qkv(dtype=torch.float32))
    with pytest.raises(TypeError, match="causal must be a bool, got str 'false'"):
        portable_ops.attention(q, k, v, causal="false")
    with pytest.raises(TypeError, match="scale must be a number, or a tensor that does not require grad"):
        portable_ops.attention(q, k, v, scale=torch.tensor(0.5, requires_grad=True))
    np = pytest.importorskip("numpy")
    torch.testing.assert_close(portable_ops.attention(q, k, v, causal=np.bool_(True), scale=np.float32(0.5)),
                               portable_ops.attention(q, k, v, causal=True, scale=0.5))


def test_mixed_dtypes_outside_autocast_are_an_error():
    q, k, v = (t.detach() for t in qkv(dtype=torch.float32))
    with pytest.raises(TypeError, match="v has dtype torch.bfloat16 but q has torch.float32"):
        portable_ops.attention(q, k, v.bfloat16())


# ----------------------------------------------------------------------------- the eager inference memo

api = importlib.import_module("portable_ops.attention")


class _Unmemoised(Exception):
    """Raised by the checks once a test has made every call it expects the memo to answer."""


def _refuse(*args, **kwargs):
    raise _Unmemoised


def _misaligned(t):
    """``t``'s values at an address 4 bytes past a 16-byte boundary."""
    moved = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape)
    return moved.copy_(t)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_inference_call_seen_before_skips_its_checks(backend, monkeypatch):
    """An eager call with nothing to differentiate runs the memoised result of its checks, dispatch and plan;
    a call that differs in anything those read (options, shapes, strides, dtypes, alignment, grad mode,
    autocast, the forced backend, a non-plain argument) is checked again."""
    monkeypatch.setattr(api, "_memo", {})  # none of another test's calls
    device = default_device(backend)
    q, k, v = (t.detach() for t in qkv(dtype=torch.float32, d=32, device=device))
    with forced_strict(backend), torch.no_grad():
        want = portable_ops.attention(q, k, v, causal=True, scale=0.25)
        checked = api._checked
        monkeypatch.setattr(api, "_checked", _refuse)
        assert torch.equal(portable_ops.attention(q, k, v, causal=True, scale=0.25), want)
        again = [t.clone() for t in (q, k, v)]  # other tensors of the same layout
        assert torch.equal(portable_ops.attention(*again, causal=True, scale=0.25), want)
        np = pytest.importorskip("numpy")
        changed = [dict(causal=False), dict(scale=0.5), dict(scale=None), dict(window=(2, None)), dict(softcap=5.0),
                   dict(window=[2, None]), dict(scale=True), dict(softcap=torch.tensor(5.0)),
                   dict(causal=np.bool_(True)), dict(scale=np.float64(0.25)), dict(q=q[:, :, :5]),
                   dict(q=q.transpose(2, 3).contiguous().transpose(2, 3)), dict(k=_misaligned(k)),
                   dict(q=q.double(), k=k.double(), v=v.double())]
        for change in changed:
            with pytest.raises(_Unmemoised):
                portable_ops.attention(**{**dict(q=q, k=k, v=v, causal=True, scale=0.25), **change})
    monkeypatch.setattr(api, "_checked", checked)  # back: a window of floats equals one of ints, and is refused
    with forced_strict(backend), torch.no_grad():
        portable_ops.attention(q, k, v, causal=True, scale=0.25, window=(2, None))
        with pytest.raises(TypeError, match="window.0. must be a non-negative int"):
            portable_ops.attention(q, k, v, causal=True, scale=0.25, window=(2.0, None))
    monkeypatch.setattr(api, "_checked", _refuse)
    with pytest.raises(_Unmemoised):  # not forced, and so not strict either
        portable_ops.attention(q, k, v, causal=True, scale=0.25)
    with forced_strict(backend), pytest.raises(_Unmemoised):  # grad mode on, and an input needs grad
        portable_ops.attention(q.requires_grad_(), k, v, causal=True, scale=0.25)
    q.requires_grad_(False)
    with forced_strict(backend), torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16), \
            pytest.raises(_Unmemoised):
        portable_ops.attention(q, k, v, causal=True, scale=0.25)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_call_seen_before_under_autograd_or_autocast_skips_its_checks(backend, monkeypatch):
    """Memoised calls that need autograd differentiate as checked ones do; under autocast they cast first."""
    monkeypatch.setattr(api, "_memo", {})
    device = default_device(backend)
    q, k, v = (t.detach().requires_grad_() for t in qkv(dtype=torch.float32, d=32, device=device))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(device)

    def calls():
        out = portable_ops.attention(q, k, v, causal=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            cast = portable_ops.attention(q, k, v, causal=True)
        return [out, *torch.autograd.grad(out, (q, k, v), dout), cast, *torch.autograd.grad(cast, (q, k, v), dout)]

    with forced_strict(backend):
        want = calls()
        monkeypatch.setattr(api, "_checked", _refuse)
        got = calls()
    assert want[4].dtype == torch.bfloat16 and want[5].dtype == torch.float32
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_memoised_calls_backward_is_dispatched_with_its_forward(backend, monkeypatch):
    """A call seen before dispatches neither its forward nor its backward again, and its gradients are those
    of the checked path, with dout in another layout too."""
    monkeypatch.setattr(api, "_memo", {})
    device = default_device(backend)
    q, k, v = (t.detach().requires_grad_() for t in qkv(dtype=torch.float32, d=32, device=device))
    douts = [torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(device)]
    douts.append(douts[0].transpose(1, 2).contiguous().transpose(1, 2))  # heads inner, as from [B, S, H, D]

    def grads(dout, causal=True):
        out = portable_ops.attention(q, k, v, causal=causal)
        return torch.autograd.grad(out, (q, k, v), dout)

    np = pytest.importorskip("numpy")
    with forced_strict(backend):
        want = [grads(dout, np.bool_(True)) for dout in douts]  # not a plain option: checked, dispatched per call
        for dout in douts:  # the first memoises, each prepares its backward's plan
            grads(dout)
        chosen = []
        for module, name in ((dispatch, "choose"), (dispatch, "select"), (dispatch, "select_by_layout"),
                             (api, "select_by_layout")):
            monkeypatch.setattr(module, name, lambda *a, _name=name, **kw: chosen.append(_name))
        got = [grads(dout) for dout in douts]
    assert chosen == []
    for a, b in zip(got, want):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_data_swap_between_forward_and_backward_is_dispatched_afresh(backend, monkeypatch):
    """Model surgery between a memoised call's forward and its backward: q, k, v's ``.data`` swapped for another
    layout or dtype. The backward runs as the per-call path runs it: gradients in the new layout, a dtype the
    backend can't take falls back (warning once) or, under strict mode, raises."""
    np = pytest.importorskip("numpy")
    device = default_device(backend)

    def swapped(causal, swap):
        q, k, v = (t.detach().requires_grad_() for t in qkv(dtype=torch.float32, d=32, device=device))
        with portable_ops.use_backend(backend):
            out = portable_ops.attention(q, k, v, causal=causal)
        for t in (q, k, v):
            t.data = swap(t.data)
        out.backward(torch.ones_like(out))  # autograd.grad finds no path to a leaf whose dtype changed
        return q.grad, k.grad, v.grad

    heads_inner = lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)  # noqa: E731
    for swap in (heads_inner, lambda t: t.double()):
        monkeypatch.setattr(api, "_memo", {})
        monkeypatch.setattr(dispatch, "_warned", set())
        with warnings.catch_warnings(record=True) as per_call:
            warnings.simplefilter("always")
            want = swapped(np.bool_(True), swap)
        for _ in range(2):  # the second call is memoised
            monkeypatch.setattr(dispatch, "_warned", set())
            with warnings.catch_warnings(record=True) as memoised:
                warnings.simplefilter("always")
                got = swapped(True, swap)
            assert [str(w.message) for w in memoised] == [str(w.message) for w in per_call]
            for a, b in zip(got, want):
                assert a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a, b)
    if backend != "reference":  # float64 falls back from triton and nki: refused under strict mode
        monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")
        with pytest.raises(portable_ops.BackendUnavailableError):
            swapped(True, lambda t: t.double())


def test_a_backward_forced_after_an_unforced_forward_runs_where_it_is_forced(fake_backend, monkeypatch):
    """With nothing forced when the forward ran, the backward goes where a backend is forced when it runs,
    memoised call or not; and a backward op replaced after the call was memoised runs from then on."""
    monkeypatch.setattr(api, "_memo", {})
    stand_in = fake_backend("triton")
    calls = []
    run = stand_in.ops["attention_bwd"].run
    stand_in.ops["attention_bwd"] = dispatch.OpImpl(run=lambda **call: calls.append(call) or run(**call))
    q, k, v = (t.detach().requires_grad_() for t in qkv(dtype=torch.float32))
    for _ in range(2):  # the second call is memoised
        out = portable_ops.attention(q, k, v)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        assert calls == []  # CPU tensors: the reference backend
        out = portable_ops.attention(q, k, v)
        with portable_ops.use_backend("triton"):
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        assert len(calls) == 1
        calls.clear()
    reference = dispatch.get_backend("reference")
    replaced = []
    monkeypatch.setitem(reference.ops, "attention_bwd",
                        dispatch.OpImpl(run=lambda **call: replaced.append(call) or run(**call)))
    out = portable_ops.attention(q, k, v)
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert len(replaced) == 1


def test_an_inference_call_runs_the_backend_op_installed_now(fake_backend):
    """A backend's op replaced after a call was memoised (as tests stand one in) runs from then on."""
    stand_in = fake_backend("triton")
    q, k, v = (t.detach() for t in qkv(dtype=torch.float32))
    with portable_ops.use_backend("triton"), torch.no_grad():
        want = portable_ops.attention(q, k, v)
        calls = []
        stand_in.ops["attention_fwd"] = dispatch.OpImpl(run=lambda **call: calls.append(call) or (want + 1, None))
        assert torch.equal(portable_ops.attention(q, k, v), want + 1) and len(calls) == 1


def test_an_inference_call_that_fell_back_is_not_memoised(fake_backend, monkeypatch):
    """Each fallback still goes through dispatch: it warns (once), or raises under strict mode."""
    fake_backend("triton", reasons=["the stand-in declines"])
    q, k, v = (t.detach() for t in qkv(dtype=torch.float32))
    with portable_ops.use_backend("triton"), torch.no_grad():
        with pytest.warns(portable_ops.FallbackWarning, match="the stand-in declines"):
            want = portable_ops.attention(q, k, v)
        monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")
        with pytest.raises(portable_ops.BackendUnavailableError, match="the stand-in declines"):
            portable_ops.attention(q, k, v)
        monkeypatch.delenv("PORTABLE_OPS_STRICT")
        assert torch.equal(portable_ops.attention(q, k, v), want)


def test_a_negative_zero_scale_is_not_memoised_as_a_positive_one(monkeypatch):
    """0.0 == -0.0 with one hash; the sign reaches the gradients' zeros."""
    monkeypatch.setattr(api, "_memo", {})
    q, k, v = qkv(dtype=torch.float32)

    def dq(scale):
        out = portable_ops.attention(q, k, v, scale=scale)
        return torch.autograd.grad(out, q, torch.ones_like(out))[0]

    dq(0.0)
    memoised = dq(-0.0)
    api._memo.clear()
    assert torch.equal(torch.signbit(memoised), torch.signbit(dq(-0.0)))


def test_an_unknown_forced_backend_fails_only_where_dispatch_runs(monkeypatch):
    """The memo's key reads the forced backend; a bad PORTABLE_OPS_BACKEND still leaves the checks' errors
    and the empty inputs' answer (which never reach dispatch) as they were."""
    monkeypatch.setenv("PORTABLE_OPS_BACKEND", "cuda")
    assert portable_ops.attention(torch.randn(1, 2, 0, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)).shape == \
        (1, 2, 0, 8)
    with pytest.raises(ValueError, match="head_dim"):
        portable_ops.attention(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    with pytest.raises(ValueError, match="PORTABLE_OPS_BACKEND='cuda'"):
        portable_ops.attention(*(torch.randn(1, 2, 3, 8) for _ in range(3)))


def test_the_definition_carries_forward_mode_tangents():
    """torch.func.jvp through the definition itself (its outputs pass through layout.unviewed): the tangent is
    the finite difference's, not dropped with a detached view."""
    from portable_ops.definitions import attention as definition

    q, k, v = (t.detach() for t in qkv(sq=4, skv=6))
    tangent = torch.randn_like(q)
    forward = lambda q: definition.attention_fwd(q, k, v, causal=True, scale=0.3)[0]  # noqa: E731
    _, tangent_out = torch.func.jvp(forward, (q,), (tangent,))
    eps = 1e-6
    torch.testing.assert_close(tangent_out, (forward(q + eps * tangent) - forward(q - eps * tangent)) / (2 * eps))
