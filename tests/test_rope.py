"""rope and rope_ on every backend that has kernels for them here.

Both layouts and partial rotary against transformers' formula in float64; the real
``transformers.models.llama.modeling_llama.apply_rotary_pos_emb`` on the tables its rotary module makes; bad input
refused by name with nothing written; ``rope_`` in place; the custom ops through ``torch.library.opcheck``;
torch.compile of q and k as transposed slices of a fused projection with no graph break and one graph across
sequence lengths; autocast; torch.func and double backward. The conformance suite (tests/test_conformance.py) covers
the edge shapes, dtypes and non-finite inputs per backend.
"""

import importlib

import pytest
import torch
import torch._dynamo.testing
from torch._dynamo.utils import counters

import portable_ops
from portable_ops import dispatch, layout
from portable_ops.conformance import tolerance, usable_backends
from portable_ops.conformance.runner import default_device, forced_strict
from tests.conftest import slow_in_the_interpreter

F64 = torch.float64
rope_module = importlib.import_module("portable_ops.rope")  # the package's name rope is the function
# the backends with rope kernels here (one that declines them is checked by tests/test_adding_an_op.py)
BACKENDS = [b for b in usable_backends() if "rope_fwd" in dispatch.get_backend(b).ops]
OPS = ("rope_fwd", "rope_bwd", "rope_inplace")


def tables(positions, r, interleaved=False, dtype=torch.float32):
    """cos, sin as transformers' rotary modules make them: ``positions [..., S]`` -> ``[..., S, R]``."""
    inv_freq = 10000.0 ** (-torch.arange(0, r, 2, dtype=F64) / r)
    freqs = positions.double()[..., None] * inv_freq
    emb = freqs.repeat_interleave(2, -1) if interleaved else torch.cat((freqs, freqs), -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def fused_qk(b=2, s=7, hq=4, hk=2, d=32, device="cpu", dtype=torch.float32, seed=0):
    """q, k: transposed slices of one fused projection ``[B, S, (Hq + 2 Hk) * D]`` (v left out), and that tensor."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, s, (hq + 2 * hk) * d, generator=g).to(device, dtype)
    q, k, _v = qkv.view(b, s, hq + 2 * hk, d).split([hq, hk, hk], dim=2)
    return q.transpose(1, 2), k.transpose(1, 2), qkv


def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), dim=-1)


def rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def transformers_rope(x, cos, sin, interleaved=False):
    """transformers' formula, partial rotary included (GPT-NeoX's split), written out."""
    cos, sin = (t if t.dim() == 3 else t[None] for t in (cos, sin))
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    rot = (rotate_every_two if interleaved else rotate_half)(x[..., :r])
    return torch.cat((x[..., :r] * cos + rot * sin, x[..., r:]), dim=-1)


def _f64(*tensors):
    return [t.detach().to("cpu", F64) for t in tensors]


# ----------------------------------------------------------------------------- the values

@pytest.mark.parametrize("r", [32, 16], ids=["whole", "partial"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("backend", slow_in_the_interpreter(BACKENDS))
def test_forward_and_gradients_match_transformers_formula(backend, interleaved, r):
    device = default_device(backend)
    q, k, qkv = fused_qk(device=device)
    qkv.requires_grad_()
    q, k, _ = (t.transpose(1, 2) for t in qkv.view(2, 7, 8, 32).split([4, 2, 2], dim=2))
    cos, sin = (t.to(device) for t in tables(torch.arange(40, 47).expand(2, 7), r, interleaved))  # [B, S, R]
    g = torch.Generator().manual_seed(1)
    dq_out, dk_out = torch.randn(q.shape, generator=g).to(device), torch.randn(k.shape, generator=g).to(device)
    with forced_strict(backend):
        q_out, k_out = portable_ops.rope(q, k, cos, sin, interleaved=interleaved)
        dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (dq_out, dk_out))
    q64, k64, cos64, sin64 = (t.requires_grad_() if i < 2 else t for i, t in enumerate(_f64(q, k, cos, sin)))
    ref_q, ref_k = transformers_rope(q64, cos64, sin64, interleaved), transformers_rope(k64, cos64, sin64, interleaved)
    ref_dq, ref_dk = torch.autograd.grad((ref_q, ref_k), (q64, k64), _f64(dq_out, dk_out))
    tol = tolerance("rope", torch.float32)
    for got, want in ((q_out, ref_q), (k_out, ref_k), (dq, ref_dq), (dk, ref_dk)):
        torch.testing.assert_close(got.cpu().double(), want.detach(), atol=tol.atol, rtol=tol.rtol)
    assert torch.equal(q_out[..., r:], q[..., r:]) and torch.equal(dq[..., r:], dq_out[..., r:])  # passed through
    assert q_out.stride() == layout.same_layout(q).stride() and dq.stride() == layout.same_layout(dq_out).stride()


@pytest.mark.parametrize("backend", slow_in_the_interpreter(BACKENDS))
def test_equals_transformers_apply_rotary_pos_emb_with_its_own_tables(backend):
    """The real transformers function and the tables LlamaRotaryEmbedding makes, in bfloat16 as a bf16 model runs
    them (cos/sin rounded to bfloat16, three roundings): within twice the one-rounding tolerance of ours."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    device = default_device(backend)
    config = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    q, k, _ = fused_qk(s=9, d=32, device=device, dtype=torch.bfloat16)
    positions = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11], [200, 201, 202, 203, 204, 205, 206, 207, 208]])
    cos, sin = LlamaRotaryEmbedding(config)(q.float().cpu(), positions)  # [B, S, D] float32 (x's dtype)
    cos, sin = cos.to(device, torch.bfloat16), sin.to(device, torch.bfloat16)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    with forced_strict(backend):
        got_q, got_k = portable_ops.rope(q, k, cos, sin)
    tol = tolerance("rope", torch.bfloat16).scaled(2)
    for got, want in ((got_q, want_q), (got_k, want_k)):
        assert got.dtype == want.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize("backend", slow_in_the_interpreter(BACKENDS))
def test_rope_in_place_rotates_the_slices_and_nothing_else(backend):
    """DeepSeek's rope part: the last 16 dims of each head of a fused projection, rotated where they are."""
    device = default_device(backend)
    g = torch.Generator().manual_seed(2)
    fused = torch.randn(2, 5, 3 + 1, 24 + 16, generator=g).to(device)  # [B, S, Hq + Hk, nope + rope]
    before = fused.clone()
    q, k = (t[..., 24:].transpose(1, 2) for t in fused.split([3, 1], dim=2))
    cos, sin = (t.to(device) for t in tables(torch.arange(5), 16, interleaved=True))
    want_q, want_k = (transformers_rope(t.double(), cos.double(), sin.double(), True) for t in (q, k))
    versions = q._version, k._version
    with forced_strict(backend):
        got = portable_ops.rope_(q, k, cos, sin, interleaved=True)
    assert got[0] is q and got[1] is k
    assert q._version > versions[0] and k._version > versions[1]
    tol = tolerance("rope", torch.float32)
    torch.testing.assert_close(q.double(), want_q, atol=tol.atol, rtol=tol.rtol)
    torch.testing.assert_close(k.double(), want_k, atol=tol.atol, rtol=tol.rtol)
    assert torch.equal(fused[..., :24], before[..., :24])  # the nope dims: untouched


@pytest.mark.parametrize("backend", slow_in_the_interpreter(BACKENDS))
def test_half_precision_q_with_float32_tables_is_computed_in_float32_and_rounded_once(backend):
    device = default_device(backend)
    q, k, _ = fused_qk(device=device, dtype=torch.bfloat16)
    cos, sin = (t.to(device) for t in tables(torch.arange(1000, 1007), 32))  # float32, angles far from 0
    with forced_strict(backend):
        q_out, k_out = portable_ops.rope(q, k, cos, sin)
    assert q_out.dtype == k_out.dtype == torch.bfloat16
    want = transformers_rope(q.float(), cos, sin).to(torch.bfloat16)  # float32 math, one rounding
    diff = (q_out.float() - want.float()).abs()
    assert diff.max() <= 2 ** -7 * want.float().abs().max()  # an ulp at most: fma vs separate products


# ----------------------------------------------------------------------------- bad input

def _args(**change):
    g = torch.Generator().manual_seed(5)
    args = dict(q=torch.randn(2, 4, 6, 16, generator=g), k=torch.randn(2, 2, 6, 16, generator=g))
    args["cos"], args["sin"] = tables(torch.arange(6), 8)
    args.update(change)
    return args


BAD = {
    "q_dtype": (dict(q=torch.zeros(2, 4, 6, 16, dtype=torch.int32)), TypeError, "q has dtype torch.int32"),
    "q_rank": (dict(q=torch.zeros(4, 6, 16)), ValueError, r"q must have 4 dimensions \[batch, heads, seq, head_dim\]"),
    "k_dtype": (dict(k=torch.zeros(2, 2, 6, 16, dtype=torch.float64)), TypeError, "k has dtype torch.float64 but q"),
    "k_seq": (dict(k=torch.zeros(2, 2, 5, 16)), ValueError, "k has shape .* they must share batch, seq and head_dim"),
    "cos_type": (dict(cos=[1.0] * 8), TypeError, "cos must be a tensor"),
    "cos_rank": (dict(cos=torch.ones(1, 1, 6, 8), sin=torch.ones(1, 1, 6, 8)), ValueError,
                 r"cos must be \[seq, rotary_dim\] or \[batch \(or 1\), seq, rotary_dim\]"),
    "cos_batch": (dict(cos=torch.ones(3, 6, 8), sin=torch.ones(3, 6, 8)), ValueError,
                  r"with batch 2 \(q's\), got shape \(3, 6, 8\)"),
    "cos_positions": (dict(cos=torch.ones(5, 8), sin=torch.ones(5, 8)), ValueError, "cos has 5 positions"),
    "rotary_odd": (dict(cos=torch.ones(6, 7), sin=torch.ones(6, 7)), ValueError, "the rotary dims R, is 7"),
    "rotary_wide": (dict(cos=torch.ones(6, 18), sin=torch.ones(6, 18)), ValueError, "at most head_dim 16"),
    "sin_shape": (dict(sin=torch.ones(6, 6)), ValueError, "sin is torch.float32 of shape .* but cos"),
    "sin_dtype": (dict(sin=torch.ones(6, 8, dtype=torch.float16)), ValueError, "they must match"),
    "interleaved": (dict(interleaved="yes"), TypeError, "interleaved must be a bool"),
    "cos_grad": (dict(cos=torch.ones(6, 8, requires_grad=True)), RuntimeError, "cos requires grad, but rope"),
}


@pytest.mark.parametrize("inplace", [False, True], ids=["rope", "rope_"])
@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_refused_naming_the_argument_with_nothing_written(case, inplace):
    change, error, message = BAD[case]
    args = _args(**change)
    q, k = args.pop("q"), args.pop("k")
    before = [t.clone() if isinstance(t, torch.Tensor) else t for t in (q, k)]
    op = "rope_" if inplace else "rope"
    with pytest.raises(error, match=f"^{op}: .*{message}"):
        getattr(portable_ops, op)(q, k, **args)
    for t, b in zip((q, k), before):
        assert torch.equal(t, b)


INPLACE_BAD = {
    "requires_grad": (lambda a: a["q"].requires_grad_(), RuntimeError, "rope_: q requires grad, and rope_ writes it"),
    "expanded": (lambda a: a.update(k=torch.randn(2, 1, 6, 16).expand(2, 2, 6, 16)), ValueError,
                 "rope_: k has elements that share memory"),
    "same_memory": (lambda a: a.update(k=a["q"][:, :2]), ValueError, "rope_: q and k share memory"),
}


@pytest.mark.parametrize("case", INPLACE_BAD)
def test_rope_in_place_refuses_what_torchs_in_place_rules_refuse_before_writing(case):
    change, error, message = INPLACE_BAD[case]
    args = _args()
    change(args)
    before = [args["q"].detach().clone(), args["k"].detach().clone()]
    with pytest.raises(error, match=message):
        portable_ops.rope_(**args)
    assert torch.equal(args["q"], before[0]) and torch.equal(args["k"], before[1])


def test_rope_in_place_under_no_grad_takes_a_tensor_that_requires_grad():
    args = _args()
    q = args["q"].requires_grad_()
    want = transformers_rope(q.detach(), args["cos"], args["sin"])
    with torch.no_grad():
        portable_ops.rope_(**args)
    torch.testing.assert_close(q.detach(), want)


def test_an_inference_tensor_is_written_only_inside_inference_mode():
    with torch.inference_mode():
        args = _args()
    with pytest.raises(RuntimeError, match="rope_: q was made under torch.inference_mode()"):
        portable_ops.rope_(**args)
    with torch.inference_mode():
        portable_ops.rope_(**args)


def test_explain_names_the_backend_and_the_empty_and_no_rotary_calls_need_none():
    args = _args()
    assert portable_ops.explain("rope", **args).backend == "reference"
    assert portable_ops.explain(portable_ops.rope_, **args).op == "rope_inplace"
    q, k = torch.randn(2, 4, 0, 16, requires_grad=True), torch.randn(2, 2, 0, 16)
    q_out, k_out = portable_ops.rope(q, k, torch.ones(0, 8), torch.ones(0, 8))
    assert q_out.shape == q.shape and k_out.shape == k.shape
    q, k = _args()["q"].requires_grad_(), _args()["k"]
    q_out, _ = portable_ops.rope(q, k, torch.ones(6, 0), torch.ones(6, 0))  # R = 0: nothing rotated
    assert torch.equal(q_out, q)
    assert torch.equal(torch.autograd.grad(q_out.sum(), q)[0], torch.ones_like(q))


# ----------------------------------------------------------------------------- PyTorch's machinery

@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("backend", slow_in_the_interpreter(BACKENDS))
def test_every_custom_op_passes_opcheck(backend, interleaved):
    device = default_device(backend)
    q, k, _ = fused_qk(s=5, d=16, device=device)
    contiguous = [t.contiguous() for t in (q, k)]
    cos, sin = (t.to(device) for t in tables(torch.arange(5).expand(2, 5), 8, interleaved))
    g = torch.Generator().manual_seed(6)
    with forced_strict(backend):
        for qk in ((q, k), contiguous):
            torch.library.opcheck(torch.ops.portable_ops.rope_fwd.default, (*qk, cos, sin, interleaved))
            grads = [torch.randn(t.shape, generator=g).to(device).transpose(0, 1).contiguous().transpose(0, 1)
                     for t in qk]
            torch.library.opcheck(torch.ops.portable_ops.rope_bwd.default, (*grads, cos, sin, interleaved))
            torch.library.opcheck(torch.ops.portable_ops.rope_.default,
                                  (*(t.clone() for t in qk), cos[:1], sin[:1], interleaved))


def attention_block(x, w, cos, sin):
    """q and k sliced from one projection and transposed, rotated, attended."""
    b, s, _ = x.shape
    q, k, v = (x @ w).view(b, s, 8, 16).split([4, 2, 2], dim=2)
    q, k = portable_ops.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    y = portable_ops.attention(q, k, v.transpose(1, 2), causal=True)
    return y.transpose(1, 2).reshape(b, s, -1).square().mean()


def in_place_step(x, w, cos, sin):
    b, s, _ = x.shape
    q, k, _ = (x @ w).view(b, s, 8, 16).split([4, 2, 2], dim=2)
    portable_ops.rope_(q.transpose(1, 2), k.transpose(1, 2), cos, sin, interleaved=True)
    return q.sum() + k.sum()


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("backend", slow_in_the_interpreter(BACKENDS))
def test_compiled_fused_projection_without_breaks_or_recompiles_across_lengths(backend):
    device = default_device(backend)
    compiled = torch.compile(attention_block, backend="aot_eager", fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(64, 128, generator=g) / 8).to(device).requires_grad_()
    with forced_strict(backend):
        for s in (9, 13):
            x = torch.randn(2, s, 64, generator=g).to(device).requires_grad_()
            cos, sin = (t.to(device) for t in tables(torch.arange(s).expand(2, s), 16))
            loss = compiled(x, w, cos, sin)
            grads = torch.autograd.grad(loss, (x, w))
            expected = attention_block(x, w, cos, sin)
            torch.testing.assert_close(loss, expected)
            for a, b in zip(grads, torch.autograd.grad(expected, (x, w))):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1  # one graph served both lengths


@pytest.mark.skipif("triton" not in BACKENDS, reason="the triton backend can't run here")
def test_traced_ops_pass_opcheck():
    """The ops torch.compile runs for the triton backend, on transposed slices of a fused projection."""
    device = default_device("triton")
    q, k, _ = fused_qk(s=5, d=16, device=device)
    cos, sin = (t.to(device) for t in tables(torch.arange(5), 8))
    assert dispatch.get_backend("triton").ops["rope_fwd"].traced() == "triton_rope_fwd"
    ops = torch.ops.portable_ops
    torch.library.opcheck(ops.triton_rope_fwd.default, (q, k, cos[None], sin[None], False))
    torch.library.opcheck(ops.triton_rope_bwd.default, (q, k.contiguous(), cos[None], sin[None], True))


def rotated_block(x, w, cos, sin):
    """q and k sliced from one projection and transposed, rotated, reduced."""
    b, s, _ = x.shape
    q, k, _ = (x @ w).view(b, s, 8, 16).split([4, 2, 2], dim=2)
    q, k = portable_ops.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q.square().sum() + (k * k.detach()).sum()


@pytest.mark.skipif("triton" not in BACKENDS, reason="the triton backend can't run here")
@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_triton_runs_its_traced_ops_with_the_eager_kernels_bits(monkeypatch):
    """Under forced triton the graph holds the traced ops, not the custom ops: running it dispatches nothing, and
    the gradients are the eager path's to the bit (the same kernel, configured alike). One graph serves every
    length (the sequence dim marked dynamic)."""
    device = default_device("triton")
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(rotated_block, backend=counter, fullgraph=True)
    g = torch.Generator().manual_seed(8)
    w = (torch.randn(64, 128, generator=g) / 8).to(device).requires_grad_()
    dispatched = []
    for s in (9, 13):
        x = torch.randn(2, s, 64, generator=g).to(device).requires_grad_()
        cos, sin = (t.to(device) for t in tables(torch.arange(s), 16))
        with forced_strict("triton"):
            expected = torch.autograd.grad(rotated_block(x, w, cos, sin), (x, w))
            for t in (x, cos, sin):
                torch._dynamo.mark_dynamic(t, t.dim() - 2)
            with monkeypatch.context() as patch:
                patch.setattr(rope_module, "run_op", lambda *args: dispatched.append(args[0]))
                grads = torch.autograd.grad(compiled(x, w, cos, sin), (x, w))
        assert all(torch.equal(a, b) for a, b in zip(grads, expected))
    assert not dispatched
    assert sum(counters["graph_break"].values()) == 0
    assert counter.frame_count == 1
    assert "triton_rope_fwd" in counter.graphs[0].code and "portable_ops.rope_fwd" not in counter.graphs[0].code


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_in_place_writes_back_and_inductor_keeps_it():
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        compiled = torch.compile(in_place_step, backend=backend, fullgraph=True)
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(2, 5, 64, generator=g), torch.randn(64, 128, generator=g)
        cos, sin = tables(torch.arange(5), 16, interleaved=True)
        with torch.no_grad():
            # a sum of 640 terms of about 8 that cancel: Inductor's order of summation moves it by ~1e-5; a rotation
            # not written back would move it by several units
            torch.testing.assert_close(compiled(x, w, cos, sin), in_place_step(x, w, cos, sin), atol=1e-3, rtol=1e-5)
    assert sum(counters["graph_break"].values()) == 0


def test_autocast_leaves_q_k_and_the_tables_as_given():
    """Under bfloat16 autocast a linear's q and k are bfloat16 and transformers' tables float32: the output is
    bfloat16, the float32 rotation rounded once (mul and add are on no autocast list)."""
    x, w = torch.randn(2, 5, 64), torch.randn(64, 96) / 8
    cos, sin = tables(torch.arange(5), 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, _ = (x @ w).view(2, 5, 6, 16).split([2, 2, 2], dim=2)
        q_out, k_out = portable_ops.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    assert q.dtype == q_out.dtype == k_out.dtype == torch.bfloat16
    torch.testing.assert_close(q_out, transformers_rope(q.transpose(1, 2).float(), cos, sin).to(torch.bfloat16))


def test_torch_func_grad_vmap_jvp_and_double_backward():
    q, k, _ = fused_qk()
    cos, sin = tables(torch.arange(7), 32)
    f = lambda q: portable_ops.rope(q, k, cos, sin)[0].pow(2).sum()  # noqa: E731
    ref = lambda q: transformers_rope(q, cos, sin).pow(2).sum()  # noqa: E731
    torch.testing.assert_close(torch.func.grad(f)(q), torch.func.grad(ref)(q))
    batched = torch.func.vmap(lambda q: portable_ops.rope(q, k, cos, sin, interleaved=True)[0])(q.unsqueeze(0))
    torch.testing.assert_close(batched[0], transformers_rope(q, cos, sin, True))
    tangent = torch.randn_like(q)
    _, jvp = torch.func.jvp(lambda q: portable_ops.rope(q, k, cos, sin)[0], (q,), (tangent,))
    torch.testing.assert_close(jvp, transformers_rope(tangent, cos, sin))
    qd = q.double().detach().requires_grad_()
    kd = k.double().detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda q, k: portable_ops.rope(q, k, cos[:, :16].double(), sin[:, :16].double(),
                                                                   interleaved=True), (qd, kd))
    assert torch.autograd.gradgradcheck(lambda q, k: portable_ops.rope(q, k, cos.double(), sin.double()), (qd, kd))


def test_the_custom_ops_are_each_others_gradient_so_double_backward_works_in_compiled_graphs():
    """What a compiled graph's autograd runs: rope_fwd's gradient is rope_bwd, and rope_bwd's is rope_fwd."""
    q, k, _ = fused_qk()
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    cos, sin = tables(torch.arange(7), 32)

    def second(rope):
        q_out, k_out = rope(q, k)
        (dq,) = torch.autograd.grad(q_out.pow(3).sum() + k_out.sum(), q, create_graph=True)
        return torch.autograd.grad(dq.square().sum(), q)[0]

    got = second(lambda q, k: torch.ops.portable_ops.rope_fwd(q, k, cos[None], sin[None], False))
    want = second(lambda q, k: (transformers_rope(q, cos, sin), transformers_rope(k, cos, sin)))
    torch.testing.assert_close(got, want)


def test_a_backend_declines_what_it_cant_hold_with_a_reason():
    q, k = torch.zeros(1, 1, 2, 8192), torch.zeros(1, 1, 2, 8192)
    cos = sin = torch.zeros(2, 8192)
    with portable_ops.use_backend("triton"):
        choice = portable_ops.explain("rope", q.to(default_device("triton")), k.to(default_device("triton")),
                                      cos.to(default_device("triton")), sin.to(default_device("triton")))
    assert choice.backend == "reference"
    assert "the rotary dims R are 8192, over 4096" in " ".join(choice.reasons)
    with portable_ops.use_backend("nki"):
        choice = portable_ops.explain(portable_ops.rope_, q.double(), k.double(), cos, sin)
    assert "float64 is not supported" in " ".join(choice.reasons)
    assert "the rotary dims R are 8192, over 4096" in " ".join(choice.reasons)


def test_nki_kernel_at_its_widest_tables_fits_sbuf_with_every_option():
    """``MAX_ROTARY`` is what SBUF holds: partial rotary, interleaved, the backward, in count-only mode (the
    emulator enforces the capacity), over positions that fill more than one tile."""
    from portable_ops.backends.nki import emulator
    from portable_ops.backends.nki.rope import MAX_ROTARY
    ops = dispatch.get_backend("nki").ops
    q, k = torch.zeros(1, 2, 130, MAX_ROTARY + 64, device="meta"), torch.zeros(1, 1, 130, MAX_ROTARY + 64,
                                                                                device="meta")
    cos = torch.zeros(1, 130, MAX_ROTARY, device="meta")
    with emulator.count_only(), emulator.count_instructions() as counted:
        ops["rope_fwd"].run(q=q, k=k, cos=cos, sin=cos, interleaved=True)
        ops["rope_bwd"].run(dq=q, dk=None, cos=cos, sin=cos, interleaved=False)
    assert counted.sbuf_peak_bytes <= 224 * 1024


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_gradient_reaching_one_output_alone_eager_through_the_custom_op_and_compiled():
    q, k, _ = fused_qk()
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    cos, sin = tables(torch.arange(7), 32)
    want = torch.autograd.grad(transformers_rope(k, cos, sin).square().sum(), k)[0]
    calls = (lambda q, k: portable_ops.rope(q, k, cos, sin),
             lambda q, k: torch.ops.portable_ops.rope_fwd(q, k, cos[None], sin[None], False),
             torch.compile(lambda q, k: portable_ops.rope(q, k, cos, sin), backend="aot_eager", fullgraph=True))
    for call in calls:
        dq, dk = torch.autograd.grad(call(q, k)[1].square().sum(), (q, k), allow_unused=True, materialize_grads=True)
        torch.testing.assert_close(dk, want)
        assert not dq.any()
