"""A call into the triton backend that fails leaves no plan, memo or cache behind: the next valid call of the
same layout builds its own and gets the right answer. The failure is a kernel that can't be launched while
the call runs (then launchable again), or, in the interpreter, a numpy integer where an int was meant,
whose == and hash are the int's: a plan built from it and kept under that equal key would fail every later
call of its layout. Against the float64 reference."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from portable_ops import dispatch
from portable_ops.conformance import GRADIENT_FACTOR, tolerance

pytestmark = pytest.mark.skipif(dispatch.unavailable_reason("triton") is not None, reason="triton not installed")

attn = importlib.import_module("portable_ops.backends.triton.attention")
plans = importlib.import_module("portable_ops.backends.triton.attention_plans")
adam_mod = importlib.import_module("portable_ops.backends.triton.adam")
norm_mod = importlib.import_module("portable_ops.backends.triton.grad_norm")
mt = importlib.import_module("portable_ops.backends.triton.multi_tensor")
ref_attn = importlib.import_module("portable_ops.definitions.attention")
ref_varlen = importlib.import_module("portable_ops.definitions.attention_varlen")
ref_paged = importlib.import_module("portable_ops.definitions.paged")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETER_ONLY = pytest.mark.skipif(DEVICE.type == "cuda", reason="the interpreter refuses numpy integers at launch")


class Unlaunchable:
    """A kernel whose every launch fails, as one handed an argument it can't take does."""

    pre_run_hooks = ()

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise RuntimeError("this launch fails")

        return launch


@pytest.fixture(autouse=True)
def fresh_plans(monkeypatch):
    """Plan caches of this test alone, empty at its start."""
    monkeypatch.setattr(plans, "fwd_plans", {})
    monkeypatch.setattr(plans, "bwd_plans", {})


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def _close(got, want, dtype, factor=1.0):
    tol = tolerance("attention", dtype).scaled(factor)
    torch.testing.assert_close(got.double().cpu(), want.double().cpu(), **tol._asdict())


def _packed(lens_q, lens_k, hq=2, hkv=1, d=16):
    q = _randn(sum(lens_q), hq, d, seed=1)
    k, v = _randn(sum(lens_k), hkv, d, seed=2), _randn(sum(lens_k), hkv, d, seed=3)
    offsets = lambda lens: torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32, device=DEVICE)  # noqa: E731
    return q, k, v, offsets(lens_q), offsets(lens_k)


def _varlen_against_reference(q, k, v, cu_q, cu_k, max_q, max_k, **options):
    out, lse = attn.attention_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, **options)
    f64 = [t.double().cpu() for t in (q, k, v)]
    want_out, want_lse = ref_varlen.attention_varlen_fwd(*f64, cu_q.cpu(), cu_k.cpu(), max_q, max_k, **options)
    _close(out, want_out, q.dtype)
    _close(lse, want_lse, q.dtype)
    return out, lse


@INTERPRETER_ONLY
def test_a_numpy_max_seqlen_that_fails_leaves_no_plan_and_the_int_call_runs():
    lens = [5, 15, 0, 3]
    q, k, v, cu_q, cu_k = _packed(lens, lens)
    options = dict(causal=True, scale=0.25)
    longest = np.array(lens).max()  # numpy's int64: == 15 and hashed as 15
    with pytest.raises(Exception, match="numpy"):
        attn.attention_varlen_fwd(q, k, v, cu_q, cu_k, longest, longest, **options)
    assert plans.fwd_plans == {}
    _varlen_against_reference(q, k, v, cu_q, cu_k, 15, 15, **options)


@INTERPRETER_ONLY
def test_a_numpy_window_that_fails_leaves_no_paged_plan_and_the_int_window_runs():
    page, lens = 4, [7, 13]
    k_cache, v_cache = _randn(8, page, 1, 16, seed=4), _randn(8, page, 1, 16, seed=5)
    table = torch.tensor([[3, 0, -1, -1], [5, 1, 7, 2]], dtype=torch.int32, device=DEVICE)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = _randn(2, 1, 4, 16, seed=6)
    with pytest.raises(Exception, match="numpy"):
        attn.paged_attention(q, k_cache, v_cache, table, seqlens, scale=0.25, window=(np.int64(5), None))
    assert plans.fwd_plans == {}
    out, _ = attn.paged_attention(q, k_cache, v_cache, table, seqlens, scale=0.25, window=(5, None))
    f64 = [t.double().cpu() for t in (q, k_cache, v_cache)]
    want, _ = ref_paged.paged_attention(f64[0], f64[1], f64[2], table.cpu(), seqlens.cpu(), scale=0.25,
                                        window=(5, None))
    _close(out, want, q.dtype)


def test_a_dense_forward_whose_launch_fails_leaves_no_plan(monkeypatch):
    q, k, v = _randn(2, 4, 20, 16, seed=7), _randn(2, 2, 30, 16, seed=8), _randn(2, 2, 30, 16, seed=9)
    with monkeypatch.context() as patched:
        patched.setattr(plans, "fwd_kernel", Unlaunchable())
        with pytest.raises(RuntimeError, match="this launch fails"):
            attn.attention_fwd(q, k, v, causal=True, scale=0.25)
    assert plans.fwd_plans == {}
    out, lse = attn.attention_fwd(q, k, v, causal=True, scale=0.25)
    want_out, want_lse = ref_attn.attention_fwd(*(t.double().cpu() for t in (q, k, v)), causal=True, scale=0.25)
    _close(out, want_out, q.dtype)
    _close(lse, want_lse, q.dtype)


@pytest.mark.parametrize("kernel", ["delta_kernel", "dkdv_kernel", "dq_kernel"])
def test_a_varlen_backward_whose_launch_fails_leaves_no_plan(kernel, monkeypatch):
    lens_q, lens_k = [4, 0, 9], [6, 3, 9]
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k)
    options = dict(causal=True, scale=0.3)
    out, lse = _varlen_against_reference(q, k, v, cu_q, cu_k, 9, 9, **options)
    dout = _randn(*out.shape, seed=10)
    with monkeypatch.context() as patched:
        patched.setattr(plans, kernel, Unlaunchable())
        with pytest.raises(RuntimeError, match="this launch fails"):
            attn.attention_varlen_bwd(q, k, v, out, lse, dout, cu_q, cu_k, 9, 9, **options)
    assert plans.bwd_plans == {}
    grads = attn.attention_varlen_bwd(q, k, v, out, lse, dout, cu_q, cu_k, 9, 9, **options)
    f64 = [t.double().cpu() for t in (q, k, v, out, lse, dout)]
    want = ref_varlen.attention_varlen_bwd(*f64, cu_q.cpu(), cu_k.cpu(), 9, 9, **options)
    for got, expected in zip(grads, want):
        _close(got, expected, q.dtype, GRADIENT_FACTOR)


def test_a_prepared_forward_whose_launch_fails_leaves_no_plan_for_the_next_prepare(monkeypatch):
    q, k, v = (_randn(1, 2, 24, 16, dtype=torch.float16, seed=s) for s in (11, 12, 13))
    with monkeypatch.context() as patched:
        patched.setenv("PORTABLE_OPS_SM90_ATTENTION", "0")  # the tl.* kernel on Hopper too: it is the one made to fail
        patched.setattr(plans, "fwd_kernel", Unlaunchable())
        run = attn.prepare_attention_fwd(q, k, v, causal=False, scale=0.25)
        with pytest.raises(RuntimeError, match="this launch fails"):
            run(q, k, v)
    assert plans.fwd_plans == {}
    out, lse = attn.prepare_attention_fwd(q, k, v, causal=False, scale=0.25)(q, k, v)
    want_out, want_lse = ref_attn.attention_fwd(*(t.double().cpu() for t in (q, k, v)), causal=False, scale=0.25)
    _close(out, want_out, q.dtype)
    _close(lse, want_lse, q.dtype)


def test_a_prepared_backward_whose_launch_fails_keeps_no_plan_in_its_memo(monkeypatch):
    """The prepared run memoises plans by out, lse and dout's layouts: the one its failed call built is
    dropped there too, so the same run builds a fresh one next time."""
    q, k, v = (_randn(1, 2, 24, 16, dtype=torch.float16, seed=s) for s in (14, 15, 16))
    out, lse = attn.attention_fwd(q, k, v, causal=True, scale=0.25)
    dout = _randn(*out.shape, dtype=torch.float16, seed=17)
    run = attn.prepare_attention_bwd(q, k, v, causal=True, scale=0.25)
    with monkeypatch.context() as patched:
        patched.setattr(plans, "dq_kernel", Unlaunchable())
        with pytest.raises(RuntimeError, match="this launch fails"):
            run(q, k, v, out, lse, dout)
    assert plans.bwd_plans == {}
    grads = run(q, k, v, out, lse, dout)
    f64 = [t.double().cpu() for t in (q, k, v, out, lse, dout)]
    for got, expected in zip(grads, ref_attn.attention_bwd(*f64, causal=True, scale=0.25)):
        _close(got, expected, q.dtype, GRADIENT_FACTOR)


@pytest.fixture
def fresh_caches(monkeypatch):
    """The optimizer's, the norm's and the tables' caches of this test alone, empty at its start."""
    for module, name in ((adam_mod, "_plans"), (norm_mod, "_plans"), (mt, "_cache"), (mt, "_chunk_cache")):
        monkeypatch.setattr(module, name, type(getattr(module, name))())


def _cached() -> list:
    return [list(cache._items) for cache in (adam_mod._plans, norm_mod._plans, mt._cache, mt._chunk_cache)]


def test_an_adam_step_whose_launch_fails_caches_no_plan_or_tables(fresh_caches, monkeypatch):
    """A launch that fails leaves every tensor as it was (the step counts included) and nothing cached; the next
    step then equals, bit for bit, the step of a twin state that never saw the failure."""
    sizes = (7, 1500, 3)
    params, grads, exp_avgs = ([_randn(n, seed=20 + 3 * i + j) for i, n in enumerate(sizes)] for j in range(3))
    exp_avg_sqs = [_randn(n, seed=30 + i).abs() * 1e-3 for i, n in enumerate(sizes)]
    steps = [torch.full((), 2.0, device=DEVICE) for _ in sizes]
    options = dict(amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-2, weight_decay=0.1, eps=1e-8, maximize=False,
                   decoupled_weight_decay=True)
    state = (params, grads, exp_avgs, exp_avg_sqs, [], steps)
    twin = [[t.clone() for t in ts] for ts in state]
    with monkeypatch.context() as patched:
        patched.setattr(adam_mod, "_adam_kernel", Unlaunchable())
        with pytest.raises(RuntimeError, match="this launch fails"):
            adam_mod.adam(*state, **options)
    assert _cached() == [[]] * 4
    for got_list, want_list in zip(state, twin):
        assert all(torch.equal(got, want) for got, want in zip(got_list, want_list))
    adam_mod.adam(*state, **options)
    adam_mod.adam(*twin, **options)
    for got_list, want_list in zip(state, twin):
        assert all(torch.equal(got, want) for got, want in zip(got_list, want_list))


@pytest.mark.parametrize("kernel", ["_partials_kernel", "_final_kernel"])
def test_a_grad_norm_whose_launch_fails_caches_no_plan_or_tables(kernel, fresh_caches, monkeypatch):
    grads = [_randn(n, seed=40 + n) for n in (5, 3000, 1)]
    with monkeypatch.context() as patched:
        patched.setattr(norm_mod, kernel, Unlaunchable())
        with pytest.raises(RuntimeError, match="this launch fails"):
            norm_mod.grad_norm(grads, 2.0)
    assert _cached() == [[]] * 4
    want = torch.cat([g.double().cpu() for g in grads]).norm()
    torch.testing.assert_close(norm_mod.grad_norm(grads, 2.0).double().cpu(), want, rtol=1e-5, atol=0)


def test_a_plan_build_that_fails_caches_nothing_and_later_caching_is_not_noted(fresh_caches):
    def build():
        mt.tables([[torch.zeros(11, device=DEVICE)]], 4)
        raise RuntimeError("this build fails")

    with pytest.raises(RuntimeError, match="this build fails"):
        mt.built(adam_mod._plans, "key", build)
    assert _cached() == [[]] * 4
    plan, written = mt.built(adam_mod._plans, "key", lambda: mt.tables([[torch.zeros(11, device=DEVICE)]], 4))
    assert [cache for cache, _, _ in written] == [mt._chunk_cache, mt._cache, adam_mod._plans]
    mt.tables([[torch.zeros(5, device=DEVICE)]], 4)  # no build under way: cached, noted nowhere
    assert len(written) == 3 and getattr(mt._building, "written", None) is None


def test_the_autotuner_keeps_no_choice_from_a_timing_whose_launch_failed(monkeypatch, tmp_path):
    """A tile choice is kept (in memory, on disk) only once every candidate's launch ran: a launch that
    raises for anything but a lack of resources leaves nothing a later call would pick up."""
    autotune = importlib.import_module("portable_ops.backends.triton.autotune")
    monkeypatch.setattr(autotune, "INTERPRETED", False)  # timing as on a GPU
    monkeypatch.setattr(autotune, "device_identity", lambda: "Some GPU sm_90")
    monkeypatch.setenv("PORTABLE_OPS_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PORTABLE_OPS_AUTOTUNE", raising=False)
    tuner = autotune.Tuner(timer=lambda run: run())

    def launch(config):
        if config == "b":
            raise RuntimeError("this launch fails")
        return 1.0

    with pytest.raises(RuntimeError, match="this launch fails"):
        tuner.pick("key", ["a", "b"], launch)
    assert tuner.chosen == {} and list(tmp_path.iterdir()) == []
