"""Element offsets past 2^31: the triton kernels form them in int64 wherever a stride times an index can get
there, and in int32 only where it can't.

On CPU (Triton's interpreter) the tensors are strided views of one buffer of 2^31 + 2^22 float16 elements
(4 GiB of address space, which the OS commits only where written): a view whose far dim (its heads, batch,
rows or tokens) steps just past 2^31 elements reads a few rows. Each case is checked against the reference
backend on the same views. On a GPU the shapes where int32 offsets failed run whole, checked against the
reference on sampled rows.
"""

from __future__ import annotations

import fcntl
import importlib
import math
import pathlib
import tempfile

import pytest
import torch

import portable_ops
from portable_ops import dispatch

pytestmark = [pytest.mark.skipif(dispatch.unavailable_reason("triton") is not None, reason="triton not installed"),
              pytest.mark.filterwarnings("error::portable_ops.FallbackWarning")]  # every case runs the triton kernels

FAR = 2**31  # the first element offset int32 can't hold
INTERPRETED = dispatch.unavailable_reason("triton") is None and importlib.import_module(
    "portable_ops.backends.triton.interpreter").INTERPRETED
on_cpu = pytest.mark.skipif(not INTERPRETED, reason="CPU tensors in Triton's interpreter")
on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
D = 16
TOL = dict(atol=4e-3, rtol=4e-3)  # float16 outputs of two float32 computations
GRAD_TOL = dict(atol=3e-2, rtol=8e-3)


ref_adam = importlib.import_module("portable_ops.definitions.adam")
ref_norm = importlib.import_module("portable_ops.definitions.grad_norm")


def _triton_module(name):  # imported where used: it needs triton
    return importlib.import_module(f"portable_ops.backends.triton.{name}")


# ----------------------------------------------------------------------------- CPU: far views

@pytest.fixture(scope="module")
def buffer():
    return torch.empty(FAR + 2**22, dtype=torch.float16)


def _far_stride(n: int) -> int:
    """A stride, a multiple of 2^16 elements, at which index ``n - 1`` lies just past 2^31."""
    return -(-(FAR + 2**16) // ((n - 1) * 2**16)) * 2**16


def _strides(shape, far: int) -> tuple:
    """Row-major strides of ``shape`` with dim ``far`` left out, and that dim stepping just past 2^31."""
    strides, step = [0] * len(shape), 1
    for dim in reversed(range(len(shape))):
        if dim != far:
            strides[dim], step = step, step * shape[dim]
    strides[far] = _far_stride(shape[far])
    return tuple(strides)


def _view(buffer, shape, far, slot, seed):
    """``buffer`` as ``shape``, dim ``far`` stepping past 2^31, from element ``slot * 4096`` (each view's near
    part fits 4096 elements): filled with samples, the only elements written."""
    t = buffer.as_strided(shape, _strides(shape, far), slot * 4096)
    assert (t.shape[far] - 1) * t.stride(far) >= FAR
    t.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(seed)))
    return t


def _both(call):
    """``call()`` on the triton backend and on the reference."""
    results = []
    for backend in ("triton", "reference"):
        with portable_ops.use_backend(backend):
            results.append(call())
    return results


def _attention_with_grads(q, k, v, dout, **options):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]  # views of the buffer, not copies
    out = portable_ops.attention(*leaves, **options)
    return (out, *torch.autograd.grad(out, leaves, dout))


def _assert_close(got, want):
    (out, *grads), (ref_out, *ref_grads) = got, want
    torch.testing.assert_close(out, ref_out, **TOL)
    for name, g, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        torch.testing.assert_close(g, ref, **GRAD_TOL, msg=name)


@on_cpu
@pytest.mark.parametrize("far,q_shape,kv_shape,options", [
    (1, (1, 4, 6, D), (1, 2, 6, D), dict(causal=True)),  # heads, under GQA: a KV head's stride passes 2^31 itself
    (0, (2, 2, 5, D), (2, 2, 7, D), dict(causal=True, window=(3, None))),  # the batch: its stride passes 2^31
    (2, (1, 2, 5, D), (1, 2, 5, D), dict(causal=False, softcap=5.0)),  # rows
])
def test_dense_forward_and_backward_on_far_views(buffer, far, q_shape, kv_shape, options):
    q, k, v = _view(buffer, q_shape, far, 0, 0), _view(buffer, kv_shape, far, 1, 1), _view(buffer, kv_shape, far, 2, 2)
    dout = _view(buffer, q_shape, far, 3, 3)
    _assert_close(*_both(lambda: _attention_with_grads(q, k, v, dout, **options)))


@on_cpu
def test_outputs_written_past_2_31(buffer):
    """out, dq, dk and dv written through strides that pass 2^31 (the backend's own outputs are dense, so these
    come from the plans' output strides): the same values as into dense ones."""
    attn = _triton_module("attention")
    q, k, v, dout = (_view(buffer, (1, 3, 5, D), 1, slot, slot) for slot in range(4))
    q, k, v, dout = (t.clone() for t in (q, k, v, dout))  # dense inputs: only the outputs are far
    far = _strides(q.shape, 1)
    out, lse = attn.attention_fwd(q, k, v, causal=True, scale=0.25)
    far_out, far_lse = attn._forward_call(q, k, v, True, 0.25, None, None, None, far, None, (q, q, q, q))
    assert far_out.stride() == far
    assert torch.equal(far_out, out) and torch.equal(far_lse, lse)
    grads = attn.attention_bwd(q, k, v, out, lse, dout, causal=True, scale=0.25)
    for i in range(3):  # one far gradient at a time: each is 4 GiB of address space
        strides = [g.stride() for g in grads]
        strides[i] = far
        far_grads = attn._backward_call(q, k, v, out, lse, dout, True, 0.25, None, None, None, None, tuple(strides),
                                        None, (q, q))
        assert far_grads[i].stride() == far
        assert all(torch.equal(a, b) for a, b in zip(far_grads, grads))


@on_cpu
@pytest.mark.parametrize("far", [0, 1])  # tokens (one sequence's rows), heads
def test_varlen_forward_and_backward_on_far_views(buffer, far):
    cu_seqlens = torch.tensor([0, 5], dtype=torch.int32)
    q, k, v, dout = (_view(buffer, (5, 2, D), far, slot, slot) for slot in range(4))

    def run():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = portable_ops.attention_varlen(*leaves, cu_seqlens, cu_seqlens, 5, 5, causal=True)
        return (out, *torch.autograd.grad(out, leaves, dout))

    _assert_close(*_both(run))


@on_cpu
def test_paged_decode_and_append_on_far_views(buffer):
    """A decode over 150 keys split between programs (the interpreter counts four SMs), its query heads and
    the caches' KV heads stepping past 2^31; then an append of tokens that do too."""
    page, pages = 16, 10
    k_cache, v_cache = (_view(buffer, (pages, page, 2, D), 2, slot, slot) for slot in (0, 1))
    q = _view(buffer, (1, 1, 4, D), 2, 2, 2)
    block_table = torch.randperm(pages, generator=torch.Generator().manual_seed(0)).to(torch.int32)[None]
    lengths = torch.tensor([150], dtype=torch.int32)
    out, ref = _both(lambda: portable_ops.paged_attention(q, k_cache, v_cache, block_table, lengths))
    torch.testing.assert_close(out, ref, **TOL)

    k_new, v_new = (_view(buffer, (1, 3, 2, D), 1, slot, slot) for slot in (3, 4))
    ref_caches = k_cache.clone(), v_cache.clone()
    with portable_ops.use_backend("reference"):
        portable_ops.paged_kv_append(*ref_caches, block_table, lengths, k_new, v_new)
    with portable_ops.use_backend("triton"):
        portable_ops.paged_kv_append(k_cache, v_cache, block_table, lengths, k_new, v_new)
    assert torch.equal(k_cache, ref_caches[0]) and torch.equal(v_cache, ref_caches[1])


def test_int64_kernels_compile_for_sm90():
    """The kernels' OFFSETS_64 forms, which only tensors past 2^31 elements reach, compile for sm_90."""
    compiles = importlib.import_module("test_triton_compiles")  # its compiler, in a process of its own
    configs = _triton_module("attention_configs")
    specs = [{"kernel": kernel, "d": 128, "config": list(configs.CONFIGS[kernel][128][0]), "offsets_64": True}
             for kernel in ("fwd", "dkdv", "dq")]
    specs += [{"kernel": "paged", "d": 128, "config": list(configs.DECODE_CONFIG), "window": True,
               "offsets_64": True}, {"kernel": "delta", "d": 128, "offsets_64": True}]
    rows = compiles._run(specs)
    assert len(rows) == len(specs) and not [r for r in rows if "error" in r], rows
    assert all(r["shared"] <= compiles.SHARED_LIMIT for r in rows), rows
    assert all(r["mma"] > 0 and r["scalar_loads"] == 0 for r in rows if r["kernel"] != "delta"), rows


# ----------------------------------------------------------------------------- GPU: the shapes that failed

WINDOW = 255
GPU_GIB = 45  # a case holds at most 42 GiB at once on an H100


@pytest.fixture
def gpu_to_itself():
    """One case at a time across processes (pytest-xdist's workers share the GPU), each with GPU_GIB free."""
    lock = open(pathlib.Path(tempfile.gettempdir()) / "portable_ops_offsets64_gpu.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        free = torch.cuda.mem_get_info()[0] / 2**30
        if free < GPU_GIB:
            pytest.skip(f"needs {GPU_GIB} GiB of free GPU memory, has {free:.0f}")
        yield
    finally:
        torch.cuda.empty_cache()  # the next case's process may need it
        lock.close()


def _randn(shape, seed):
    """bf16 samples made on the GPU 2^26 at a time (no float32 copy of the whole tensor)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    for part in t.view(-1).split(2**26):
        part.copy_(torch.randn(part.numel(), generator=g, device="cuda"))
    return t


def _reference_rows(q, k, v, dout, heads, start, rows, window):
    """The reference's out, dq, dk, dv for query rows ``[start, start + rows)`` of ``heads`` of ``[1, H, S, D]``
    views, causal with ``window`` keys to the left (None: every earlier key): computed over the keys those rows
    see. Its dk and dv are exact for keys ``[start, start + rows - window)`` (with no window: for the last rows'
    keys, ``[start, S)`` with ``start + rows == S``), whose every query is among the rows."""
    first = 0 if window is None else max(start - window, 0)
    pick = lambda t, lo, hi: t[:, heads, lo:hi].float().detach().requires_grad_()  # noqa: E731
    qs, ks, vs = pick(q, start, start + rows), pick(k, first, start + rows), pick(v, first, start + rows)
    with portable_ops.use_backend("reference"):
        out = portable_ops.attention(qs, ks, vs, causal=True, window=None if window is None else (window, None))
        dq, dk, dv = torch.autograd.grad(out, (qs, ks, vs), dout[:, heads, start:start + rows].float())
    return out, dq, dk[:, :, start - first:], dv[:, :, start - first:]


def _check_rows(got, q, k, v, dout, heads, start, rows, window):
    """``got`` (out, dq, dk, dv of the whole call) against :func:`_reference_rows` there."""
    ref_out, ref_dq, ref_dk, ref_dv = _reference_rows(q, k, v, dout, heads, start, rows, window)
    out, dq, dk, dv = (t[:, heads].float() for t in got)
    bf16 = dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out[:, :, start:start + rows], ref_out, **bf16)
    torch.testing.assert_close(dq[:, :, start:start + rows], ref_dq, atol=5e-2, rtol=2e-2)
    keys = rows if start + rows == q.shape[2] else rows - (window or rows)
    for name, g, ref in (("dk", dk, ref_dk), ("dv", dv, ref_dv)):
        torch.testing.assert_close(g[:, :, start:start + keys], ref[:, :, :keys], atol=5e-2, rtol=2e-2, msg=name)


@on_gpu
@pytest.mark.parametrize("window", [WINDOW, None])  # the tl.* kernels; the Hopper ones (and the delta kernel)
def test_dense_head_offsets_past_2_31_on_gpu(window, gpu_to_itself):
    """q, k, v ``[1, 64, 270336, 128]`` bf16 (2.2e9 elements, head 63's rows past 2^31), causal."""
    shape = (1, 64, 270336, 128)
    q, k, v, dout = (_randn(shape, seed) for seed in range(4))
    with portable_ops.use_backend("triton"):
        got = _attention_with_grads(q, k, v, dout, causal=True, window=None if window is None else (window, None))
    s, rows = shape[2], 512
    starts = [s - rows] if window is None else [0, s // 2, s - rows]  # all of a row's keys: the last rows only
    for start in starts:
        _check_rows(got, q, k, v, dout, [0, 31, 63], start, rows, window)


@on_gpu
def test_varlen_token_offsets_past_2_31_on_gpu(gpu_to_itself):
    """One 540,000-token sequence, 32 heads, D 128, bf16 (its rows past token 524,288 lie past 2^31):
    causal with a 255-key window, forward and backward; and the forward without the window."""
    tokens, heads = 540_000, 32
    q, k, v, dout = (_randn((tokens, heads, 128), seed) for seed in range(4))
    cu = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    as_batch = lambda t: t.transpose(0, 1)[None]  # noqa: E731
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with portable_ops.use_backend("triton"):
        out = portable_ops.attention_varlen(*leaves, cu, cu, tokens, tokens, causal=True, window=(WINDOW, None))
        grads = torch.autograd.grad(out, leaves, dout)
    got = [as_batch(t) for t in (out.detach(), *grads)]
    views = [as_batch(t) for t in (q, k, v, dout)]
    for start in (0, 530_000, tokens - 512):
        _check_rows(got, *views, [0, 31], start, 512, WINDOW)
    del out, grads, got
    with portable_ops.use_backend("triton"), torch.no_grad():
        out = portable_ops.attention_varlen(q, k, v, cu, cu, tokens, tokens, causal=True)
    ref = _reference_rows(*views, [31], tokens - 256, 256, None)[0]
    torch.testing.assert_close(as_batch(out)[:, [31], -256:].float(), ref, atol=2e-2, rtol=2e-2)


@on_gpu
def test_optimizer_and_norm_over_one_tensor_past_2_31_on_gpu(gpu_to_itself):
    """An Adam step and the global norms over one bf16 tensor of 2^31 + 2^20 elements, checked on its first and
    last elements against the float64 reference (Adam is elementwise; the grad is zero between them)."""
    n = FAR + 2**20
    param, grad = _randn((n,), 0), torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    ends = torch.cat([torch.arange(4096), torch.arange(n - 4096, n)]).cuda()
    grad[ends] = _randn((ends.numel(),), 1)
    for norm_type in (2.0, math.inf):
        with portable_ops.use_backend("triton"):
            norm = portable_ops.clip.total_norm([grad], norm_type)
        want = ref_norm.grad_norm([grad[ends].double().cpu()], norm_type)
        torch.testing.assert_close(norm.double().cpu(), want, rtol=1e-5, atol=0)
    state = [[param], [grad], [torch.zeros_like(param)], [torch.zeros_like(param)], [],
             [torch.full((), 2.0, device="cuda")]]
    ref = [[t[0][ends].double().cpu()] for t in state[:4]] + [[], [state[5][0].cpu()]]
    options = dict(amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-2, weight_decay=0.1, eps=1e-8, maximize=False,
                   decoupled_weight_decay=True)
    with portable_ops.use_backend("triton"):
        portable_ops.functional.adam(*state, **options)
    ref_adam.adam(*ref, **options)
    for name, got, want in zip(("param", "exp_avg", "exp_avg_sq"), (state[0], *state[2:4]), (ref[0], *ref[2:4])):
        torch.testing.assert_close(got[0][ends].double().cpu(), want[0].to(torch.bfloat16).double(), atol=2e-2,
                                   rtol=2e-2, msg=name)


@on_cpu
def test_any_far_view_gives_the_references_answer(buffer):
    """Whichever dim steps past 2^31 (batch, heads, rows), whatever the GQA group, lengths and mask: the triton
    kernels read and write the far elements the reference does."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=4, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(far=st.integers(0, 2), group=st.integers(1, 2), sq=st.integers(2, 6), skv=st.integers(2, 6),
           causal=st.booleans(), softcap=st.sampled_from([None, 5.0]))
    def prop(far, group, sq, skv, causal, softcap):
        q_shape, kv_shape = (2, 2 * group, sq, D), (2, 2, skv, D)
        q, k, v = (_view(buffer, shape, far, slot, slot) for slot, shape in enumerate((q_shape, kv_shape, kv_shape)))
        dout = _view(buffer, q_shape, far, 3, 3)
        _assert_close(*_both(lambda: _attention_with_grads(q, k, v, dout, causal=causal, softcap=softcap)))

    prop()
