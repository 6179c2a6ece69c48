"""The triton backend's four ops against the float64 reference, forced onto triton.

On a machine without CUDA these run through Triton's interpreter on CPU tensors (small sizes:
the whole file takes well under the CI budget on two cores); with CUDA they run the compiled
kernels on the GPU, plus the GPU-only checks at the bottom (CUDA-graph capture, > 2**31
elements).
"""

from __future__ import annotations

import math

import pytest
import torch

import portable_ops
from portable_ops import dispatch
from portable_ops.conformance import GRADIENT_FACTOR, tolerance
import importlib

# the package re-exports each op's function under its module's name: import the modules themselves
ref_adam_mod = importlib.import_module("portable_ops.definitions.adam")
ref_attn = importlib.import_module("portable_ops.definitions.attention")
ref_norm_mod = importlib.import_module("portable_ops.definitions.grad_norm")

pytestmark = pytest.mark.skipif(dispatch.unavailable_reason("triton") is not None, reason="triton not installed")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

SIZES = (1, 7, 1023, 1024, 1025, 3000, 5)  # one element, around a block, not multiples of anything


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _adam_state(sizes, dtype, amsgrad, seed=0, steps_at=0.0):
    g = _gen(seed)
    make = lambda scale=1.0: [(torch.randn(n, generator=g) * scale).to(dtype).to(DEVICE) for n in sizes]  # noqa: E731
    params, grads = make(), make(0.1)
    exp_avgs = make(0.01)
    exp_avg_sqs = [(torch.rand(n, generator=g) * 1e-3).to(dtype).to(DEVICE) for n in sizes]
    maxes = [v.clone() * 1.5 for v in exp_avg_sqs] if amsgrad else []
    steps = [torch.full((), steps_at, dtype=torch.float32, device=DEVICE) for _ in sizes]
    return params, grads, exp_avgs, exp_avg_sqs, maxes, steps


def _step_both(state, n_steps=1, **kw):
    """Run ``n_steps`` on triton (forced) and on the float64 reference, each from the grads ``state`` starts with (a
    backward hands each step new ones: a scaled step writes its grads back); return both states."""
    ref = [[t.double().cpu() for t in ts] for ts in state[:5]] + [[s.clone().cpu() for s in state[5]]]
    grads = [g.clone() for g in state[1]]
    for _ in range(n_steps):
        for ours, theirs, g in zip(state[1], ref[1], grads):
            ours.copy_(g)
            theirs.copy_(g)
        with portable_ops.use_backend("triton"):
            portable_ops.functional.adam(*state, **kw)
        ref_adam_mod.adam(*ref, **{k: (v.double().cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})
    return state, ref


def _close(got, want, tol):
    atol, rtol = tol
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double().cpu(), b.to(a.dtype).double(), atol=atol, rtol=rtol)


ADAM_KW = dict(beta1=0.9, beta2=0.999, lr=1e-2, eps=1e-8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("amsgrad,maximize,weight_decay,decoupled", [
    (False, False, 0.0, True), (False, False, 0.1, True), (False, False, 0.1, False),
    (True, False, 0.1, True), (False, True, 0.05, False), (True, True, 0.0, False)])
def test_adam_matches_reference(dtype, amsgrad, maximize, weight_decay, decoupled):
    state = _adam_state(SIZES, dtype, amsgrad, steps_at=3.0)
    kw = dict(ADAM_KW, amsgrad=amsgrad, maximize=maximize, weight_decay=weight_decay,
              decoupled_weight_decay=decoupled)
    got, want = _step_both(state, n_steps=2, **kw)
    for i in range(5):
        _close(got[i], want[i], tolerance("adam", dtype))
    assert all(s.item() == 5.0 for s in got[5])


def test_adam_lr_tensor_grad_scale_clip_coef():
    state = _adam_state(SIZES, torch.float32, False)
    kw = dict(ADAM_KW, amsgrad=False, maximize=False, weight_decay=0.01, decoupled_weight_decay=True,
              lr=torch.tensor(3e-3, device=DEVICE), grad_scale=torch.tensor(64.0, device=DEVICE),
              found_inf=torch.tensor(0.0, device=DEVICE), clip_coef=torch.tensor(0.25, device=DEVICE))
    got, want = _step_both(state, n_steps=3, **kw)
    for i in (0, 2, 3):  # the grads written back: tests/test_triton_scaled_grads.py
        _close(got[i], want[i], tolerance("adam", torch.float32))
    assert all(s.item() == 3.0 for s in got[5])


def test_adam_found_inf_leaves_everything_bit_identical():
    from conftest import assert_bit_identical, snapshot

    state = _adam_state(SIZES, torch.bfloat16, True, steps_at=2.0)
    before = [snapshot(ts) for ts in state]
    with portable_ops.use_backend("triton"):
        portable_ops.functional.adam(*state, **ADAM_KW, amsgrad=True, maximize=False, weight_decay=0.1,
                                     decoupled_weight_decay=True, grad_scale=torch.tensor(8.0, device=DEVICE),
                                     found_inf=torch.tensor(1.0, device=DEVICE))
    for b, a in zip(before, state):
        assert_bit_identical(b, a)


def test_adam_many_tensors_mixed_dtypes_one_call():
    sizes = [1, 2, 33, 1500, 4097, 1, 600] * 6  # 42 tensors
    g = _gen(3)
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    params = [torch.randn(n, generator=g).to(dtypes[i % 3]).to(DEVICE) for i, n in enumerate(sizes)]
    grads = [torch.randn(p.shape, generator=g).to(p.dtype).to(DEVICE) for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    steps = [torch.zeros((), device=DEVICE) for _ in params]
    state = (params, grads, m, v, [], steps)
    kw = dict(ADAM_KW, amsgrad=False, maximize=False, weight_decay=0.0, decoupled_weight_decay=True)
    got, want = _step_both(state, n_steps=2, **kw)
    # From zero moments, half-precision exp_avg_sq of small grads lands in fp16 subnormals that the
    # float64 reference does not round: an update may be off by half an lr step there.
    for i in range(4):
        for a, b in zip(got[i], want[i]):
            tol = tolerance("adam", a.dtype)
            _close([a], [b], tol if a.dtype == torch.float32 else tol._replace(atol=0.5 * ADAM_KW["lr"]))


class _Launches:
    """Stands in for the Adam kernel and records each launch's (param dtype, state dtype)."""

    def __init__(self, kernel):
        self.kernel, self.dtypes = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.dtypes.append((kw["DTYPE"], kw["STATE_DTYPE"]))
            return self.kernel[grid](*args, **kw)
        return launch

    def __getattr__(self, name):  # what launch.Launch reads of a kernel on CUDA (fn, pre_run_hooks)
        return getattr(self.kernel, name)


@pytest.mark.parametrize("state_dtype", [None, torch.float32])
def test_adam_one_launch_per_param_and_state_dtype(state_dtype, monkeypatch):
    triton_adam = importlib.import_module("portable_ops.backends.triton.adam")
    launch_module = importlib.import_module("portable_ops.backends.triton.launch")
    mt = importlib.import_module("portable_ops.backends.triton.multi_tensor")
    launches = _Launches(triton_adam._adam_kernel)
    monkeypatch.setattr(triton_adam, "_adam_kernel", launches)
    monkeypatch.setattr(triton_adam, "_plans", mt.PlanCache())  # plans hold their launches: none made before the spy
    in_env = []  # every launch (each may compile) under the environment the backend loaded with (launch.py)
    monkeypatch.setattr(launch_module, "in_compile_env", lambda call, *a, **k: in_env.append(1) or call(*a, **k))
    sizes = [1, 33, 1500, 4097, 600] * 3
    g = _gen(4)
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    params = [torch.randn(n, generator=g).to(dtypes[i % 3]).to(DEVICE) for i, n in enumerate(sizes)]
    grads = [(torch.randn(p.shape, generator=g) * 1e-2).to(p.dtype).to(DEVICE) for p in params]
    moments = [[torch.zeros_like(p, dtype=torch.float32 if state_dtype else p.dtype) for p in params] for _ in range(3)]
    state = (params, grads, *moments, [torch.zeros((), device=DEVICE) for _ in params])
    kw = dict(ADAM_KW, amsgrad=True, maximize=False, weight_decay=0.01, decoupled_weight_decay=True)
    ref = [[t.double().cpu() for t in ts] for ts in state[:5]] + [[s.clone().cpu() for s in state[5]]]
    with portable_ops.use_backend("triton"):
        portable_ops.functional.adam(*state, state_dtype=state_dtype, **kw)
    ref_adam_mod.adam(*ref, **kw, grad_scale=None, found_inf=None, clip_coef=None)
    expected = {(triton_adam._TL_DTYPE[d], triton_adam._TL_DTYPE[state_dtype or d]) for d in dtypes}
    assert sorted(launches.dtypes, key=str) == sorted(expected, key=str) and len(in_env) == len(expected)
    for k in range(5):  # the param at its dtype's tolerance, the moments at their own
        for a, b in zip(state[k], ref[k]):
            _close([a], [b], tolerance("adam", a.dtype))
    assert all(m.dtype == (torch.float32 if state_dtype else p.dtype) for m, p in zip(moments[0], params))


def test_adam_plan_is_keyed_by_the_state_dtype_not_only_its_address():
    """A float32 moment can be allocated where a bfloat16 one was freed: same addresses, other
    pointer types. Here the bfloat16 moments are views of the float32 ones' memory."""
    sizes = (5, 1030)
    g = _gen(5)
    params = [torch.randn(n, generator=g).bfloat16().to(DEVICE) for n in sizes]
    grads = [(torch.randn(n, generator=g) * 1e-2).bfloat16().to(DEVICE) for n in sizes]
    wide = [[torch.zeros(n, device=DEVICE) for n in sizes] for _ in range(2)]
    narrow = [[t.view(torch.bfloat16)[:t.numel()] for t in ts] for ts in wide]
    assert narrow[0][1].data_ptr() == wide[0][1].data_ptr()
    steps = [torch.zeros((), device=DEVICE) for _ in sizes]
    kw = dict(ADAM_KW, amsgrad=False, maximize=False, weight_decay=0.0, decoupled_weight_decay=True)
    with portable_ops.use_backend("triton"):
        portable_ops.functional.adam(params, grads, *narrow, [], steps, **kw)
        for t in wide[0] + wide[1]:
            t.zero_()
        state = (params, grads, *wide, [], steps)
        ref = [[t.double().cpu() for t in ts] for ts in state[:5]] + [[s.clone().cpu() for s in state[5]]]
        portable_ops.functional.adam(*state, state_dtype=torch.float32, **kw)
    ref_adam_mod.adam(*ref, **kw, grad_scale=None, found_inf=None, clip_coef=None)
    for k in (1, 2):
        _close(state[k + 1], ref[k + 1], tolerance("adam", torch.float32))


def test_plans_are_keyed_by_the_device_not_only_the_addresses():
    """A plan's tables live on one device; an address alone does not say which device's memory it is.
    (Empty tensors have address 0 on every device.)"""
    from portable_ops.backends.triton.multi_tensor import PlanCache

    here, there = [torch.empty(0)], [torch.empty(0, device="meta")]
    assert here[0].data_ptr() == there[0].data_ptr()
    assert PlanCache.key(here, here) != PlanCache.key(there, there)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_non_finite_grad_propagates_like_reference(amsgrad):
    """NaN reaches the param and every moment where torch puts it: AMSGrad's running max included
    (torch.maximum keeps a NaN; Triton's maximum drops it unless told otherwise)."""
    state = _adam_state((5, 1030), torch.float32, amsgrad)
    state[1][1][17] = float("nan")
    state[1][0][2] = float("inf")
    kw = dict(ADAM_KW, amsgrad=amsgrad, maximize=False, weight_decay=0.0, decoupled_weight_decay=True)
    got, want = _step_both(state, **kw)
    for k in (0, 2, 3, 4):
        for a, b in zip(got[k], want[k]):
            assert torch.equal(torch.isnan(a.cpu()), torch.isnan(b)), k


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grad_norm_matches_reference(norm_type, dtype):
    g = _gen(1)
    grads = [(torch.randn(n, generator=g) * (i + 1)).to(dtype).to(DEVICE) for i, n in enumerate(SIZES * 3)]
    with portable_ops.use_backend("triton"):
        got = portable_ops.clip.total_norm(grads, norm_type)
    want = ref_norm_mod.grad_norm([x.double().cpu() for x in grads], norm_type)
    assert got.dtype == torch.float32 and got.dim() == 0 and got.device.type == DEVICE.type
    # the norm is float32 whatever the grads' dtype (the kernels accumulate in float32)
    torch.testing.assert_close(got.double().cpu(), want, **tolerance("clip_grad_norm_", torch.float32)._asdict())


def test_grad_norm_other_norm_type_falls_back_with_a_reason():
    grads = [torch.ones(3, device=DEVICE)]
    reasons = dispatch.get_backend("triton").reasons("grad_norm", {"grads": grads, "norm_type": 1.0})
    assert reasons == ["norm_type 1 is not supported (2 and inf are)"]


ATTN_CASES = {  # B, Hq, Hkv, Sq, Skv, D, causal
    "square": (2, 2, 2, 64, 64, 64, False),
    "causal_ragged": (1, 2, 2, 45, 45, 32, True),
    "gqa_causal": (1, 4, 2, 40, 40, 64, True),
    "cross": (1, 2, 1, 19, 70, 32, False),
    "causal_bottom_right": (1, 2, 1, 19, 70, 32, True),
    "more_queries_than_keys": (1, 2, 1, 40, 9, 32, True),  # first rows see no key
    "decode": (2, 4, 2, 1, 200, 64, True),
    "decode_long_split": (1, 2, 1, 1, 700, 32, True),
    "decode_gqa_packed_split": (1, 8, 2, 3, 1100, 64, True),  # 4 heads x 3 tokens share a program; keys split
    "head_dim_128": (1, 1, 1, 40, 40, 128, True),
    "head_dim_256": (1, 1, 1, 20, 33, 256, False),
}


def _attn_inputs(case, dtype, seed=0):
    b, hq, hkv, sq, skv, d, causal = ATTN_CASES[case]
    g = _gen(seed)
    q = torch.randn(b, hq, sq, d, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(b, hkv, skv, d, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(b, hkv, skv, d, generator=g).to(dtype).to(DEVICE)
    return q, k, v, causal


@pytest.mark.parametrize("case", list(ATTN_CASES))
def test_attention_forward_and_backward(case):
    dtype = torch.float16
    q, k, v, causal = _attn_inputs(case, dtype)
    scale = 1.0 / math.sqrt(q.shape[-1])
    backend = dispatch.get_backend("triton")
    out, lse = backend.ops["attention_fwd"].run(q=q, k=k, v=v, causal=causal, scale=scale)
    q64, k64, v64 = (t.double().cpu() for t in (q, k, v))
    ref_out, ref_lse = ref_attn.attention_fwd(q64, k64, v64, causal=causal, scale=scale)
    tol = tolerance("attention", dtype)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    torch.testing.assert_close(out.double().cpu(), ref_out, **tol._asdict())
    torch.testing.assert_close(lse.double().cpu(), ref_lse, **tol._asdict())
    if q.shape[2] == 1 and "split" in case:
        from portable_ops.backends.triton.attention_configs import key_splits, tile_config

        tiles = tile_config("fwd", q, q.shape[2], k.shape[2], k.shape[1], causal, "ieee", launch=None)[:2]
        assert key_splits(1, 2, 1, 700, *tiles) > 1 or DEVICE.type == "cuda"
    dout = torch.randn(out.shape, generator=_gen(9)).to(dtype).to(DEVICE)
    dq, dk, dv = backend.ops["attention_bwd"].run(q=q, k=k, v=v, out=out, lse=lse, dout=dout, causal=causal,
                                                  scale=scale)
    ref = ref_attn.attention_bwd(q64, k64, v64, ref_out, ref_lse, dout.double().cpu(), causal=causal, scale=scale)
    for got, want in zip((dq, dk, dv), ref):
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got.double().cpu(), want, **tol.scaled(GRADIENT_FACTOR)._asdict())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_dtypes_through_the_public_api(dtype):
    q, k, v, causal = _attn_inputs("gqa_causal", dtype, seed=4)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with portable_ops.use_backend("triton"):
        out = portable_ops.attention(q, k, v, causal=causal)
    out.backward(torch.ones_like(out))
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    with portable_ops.use_backend("reference"):
        ref = portable_ops.attention(qr, kr, vr, causal=causal)
    ref.backward(torch.ones_like(ref))
    tol = tolerance("attention", dtype)
    torch.testing.assert_close(out.double(), ref, **tol._asdict())
    for t, r in ((q, qr), (k, kr), (v, vr)):
        torch.testing.assert_close(t.grad.double(), r.grad, **tol.scaled(GRADIENT_FACTOR)._asdict())


def test_attention_non_contiguous_inputs():
    g = _gen(5)
    # [B, S, H, D] storage viewed as [B, H, S, D], as a transformer's projections produce
    q = torch.randn(1, 33, 2, 64, generator=g).half().to(DEVICE).transpose(1, 2)
    k = torch.randn(1, 50, 2, 64, generator=g).half().to(DEVICE).transpose(1, 2)
    v = torch.randn(1, 50, 2, 64, generator=g).half().to(DEVICE).transpose(1, 2)
    assert not q.is_contiguous()
    out, _ = dispatch.get_backend("triton").ops["attention_fwd"].run(q=q, k=k, v=v, causal=True, scale=0.125)
    ref, _ = ref_attn.attention_fwd(q.double().cpu(), k.double().cpu(), v.double().cpu(), causal=True, scale=0.125)
    torch.testing.assert_close(out.double().cpu(), ref, **tolerance("attention", torch.float16)._asdict())


def test_unsupported_shapes_and_dtypes_give_reasons():
    backend = dispatch.get_backend("triton")
    q = torch.zeros(1, 1, 4, 264, device=DEVICE)
    assert any("head_dim 264" in r for r in backend.reasons("attention_fwd", {"q": q, "k": q, "v": q, "scale": 0.1}))
    p = [torch.zeros(3, dtype=torch.float64, device=DEVICE)]
    call = dict(params=p, grads=p, exp_avgs=p, exp_avg_sqs=p, max_exp_avg_sqs=[],
                state_steps=[torch.zeros((), device=DEVICE)])
    assert any("float64" in r for r in backend.reasons("adam", call))


def test_public_api_routes_to_triton_when_forced():
    q = torch.zeros(1, 1, 4, 32, device=DEVICE)
    p = [torch.zeros(3, device=DEVICE)]
    with portable_ops.use_backend("triton"):
        assert portable_ops.explain(portable_ops.attention, q, q, q).backend == "triton"
        assert portable_ops.explain(portable_ops.functional.adam, p, p, [torch.zeros(3, device=DEVICE)],
                                    [torch.zeros(3, device=DEVICE)], [], [torch.zeros((), device=DEVICE)]
                                    ).backend == "triton"
        params = [torch.nn.Parameter(torch.ones(3, device=DEVICE))]
        params[0].grad = torch.ones(3, device=DEVICE)
        assert portable_ops.explain(portable_ops.clip_grad_norm_, params, 1.0).backend == "triton"
        wide = torch.zeros(1, 1, 4, 264, device=DEVICE)
        choice = portable_ops.explain(portable_ops.attention, wide, wide, wide)
        assert choice.backend == "reference" and "head_dim 264" in str(choice)


def test_device_reasons():
    backend = dispatch.get_backend("triton")
    assert backend.device_reasons(torch.device("meta"))
    if not torch.cuda.is_available():
        assert backend.device_reasons(torch.device("cpu")) == []


# ----------------------------------------------------------------------------- GPU only

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda_only
def test_cuda_graph_step_follows_lr_tensor_and_clip():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in (1000, 33, 70000)]
    for p in params:
        p.grad = torch.randn_like(p)
    lr = torch.tensor(1e-3, device="cuda")
    opt = portable_ops.optim.AdamW(params, lr=lr, max_grad_norm=0.5)
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, r in zip(params, ref_params):
        r.grad = p.grad.clone()
    ref = torch.optim.AdamW(ref_params, lr=1e-3)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        opt.step()  # creates state, compiles
    torch.cuda.current_stream().wait_stream(s)
    torch.nn.utils.clip_grad_norm_(ref_params, 0.5)
    ref.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for lr_value in (1e-3, 5e-4, 2e-3):
        lr.fill_(lr_value)
        for g in ref.param_groups:
            g["lr"] = lr_value
        for r, p in zip(ref_params, params):  # before the replay: the clipped step writes the grads it clips
            r.grad = p.grad.clone()
        graph.replay()
        torch.nn.utils.clip_grad_norm_(ref_params, 0.5)
        ref.step()
    torch.cuda.synchronize()
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(p.grad, r.grad, atol=1e-6, rtol=1e-5)  # left clipped, as clip_grad_norm_ leaves them
    assert opt.state[params[0]]["step"].item() == 4


@cuda_only
def test_steps_whose_grads_moved_never_wait_for_the_device():
    """zero_grad(set_to_none=True) frees the grads; the next backward may put them elsewhere, so the
    launch tables are rebuilt: that must not synchronise (the host would stop running ahead)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in (1000, 33, 70000)]
    opt = portable_ops.optim.AdamW(params, lr=1e-3, max_grad_norm=0.5)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # state and kernels
    torch.cuda.synchronize()
    kept = [torch.randn_like(p) for p in params]  # keeps the old grads' blocks from being reused
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
            kept += [p.grad for p in params]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert opt.state[params[0]]["step"].item() == 4


@cuda_only
def test_capturing_a_step_over_tensors_never_seen_before_is_refused_with_a_reason():
    params, grads, m, v = ([torch.randn(100, device="cuda")] for _ in range(4))
    steps = [torch.zeros((), device="cuda")]
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="run one step with the same tensors before capturing"):
        with torch.cuda.graph(graph):
            with portable_ops.use_backend("triton"):
                portable_ops.functional.adam(params, grads, m, v, [], steps, lr=1e-3)
    assert steps[0].item() == 0


@cuda_only
def test_past_two_to_the_31_elements():
    n = 2**31 + 4099
    free, _ = torch.cuda.mem_get_info()
    if free < 6 * n * 2 + 2**30:
        pytest.skip("not enough GPU memory")
    p = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    g = torch.zeros_like(p)
    g[-5:] = 1.0
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    step = [torch.zeros((), device="cuda")]
    with portable_ops.use_backend("triton"):
        portable_ops.functional.adam([p], [g], [m], [v], [], step, lr=0.1, weight_decay=0.0)
        norm = portable_ops.clip.total_norm([g])
    torch.cuda.synchronize()
    assert p[-5:].float().sub(-0.1).abs().max().item() < 1e-3 and p[-6].item() == 0.0
    assert abs(norm.item() - math.sqrt(5)) < 1e-4
