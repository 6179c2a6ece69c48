"""rms_norm and layer_norm (with the fused residual add), and nn.RMSNorm / nn.LayerNorm, on every backend usable here.

Forward and every gradient against torch's ``F.rms_norm`` / ``F.layer_norm`` and its autograd in float64; bad
input refused by name; the custom ops through ``torch.library.opcheck``; torch.compile with no graph break and one
graph across shapes; autocast; torch.func; the modules' state_dicts both ways with torch's. The conformance
suite (tests/test_conformance.py) covers the edge shapes, dtypes and non-finite inputs per backend.
"""

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from torch._dynamo.utils import counters

import portable_ops
from portable_ops import dispatch, norms
from portable_ops.conformance import GRADIENT_FACTOR, tolerance, usable_backends
from portable_ops.conformance.runner import default_device, forced_strict

BACKENDS = usable_backends()
F64 = torch.float64


def _inputs(shape, device, dtype=torch.float32, residual=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = shape[-1]
    make = lambda: torch.randn(shape, generator=g).to(device, dtype).requires_grad_()  # noqa: E731
    x = make()
    r = make() if residual else None
    w = (1 + 0.5 * torch.randn(d, generator=g)).to(device).requires_grad_()
    b = (0.5 * torch.randn(d, generator=g)).to(device).requires_grad_()
    return x, r, w, b


def _torch_norm(rms, x, r, w, b, eps):
    """torch's composition, in float64: the sum rounded to x's dtype, then F.rms_norm / F.layer_norm."""
    x64, r64, w64, b64 = (None if t is None else t.detach().to("cpu", F64).requires_grad_() for t in (x, r, w, b))
    leaves = [t for t in (x64, r64, w64, b64) if t is not None]
    h = (x64 + r64).to(x.dtype).to(F64) if r is not None else x64
    if r is not None:  # the rounding must not cut the gradient: x + r is differentiable as a straight sum
        h = x64 + r64 + (h - (x64 + r64)).detach()
    d = x.shape[-1]
    out = F.rms_norm(h, (d,), w64, eps) if rms else F.layer_norm(h, (d,), w64, b64, eps)
    return out, h, leaves


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("rms", [True, False], ids=["rms_norm", "layer_norm"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_and_every_gradient_match_torch(backend, rms, residual):
    device = default_device(backend)
    x, r, w, b = _inputs((3, 5, 24), device, residual=residual)
    x = x.detach().transpose(0, 1).requires_grad_()  # a non-contiguous x
    if r is not None:
        r = r.detach().transpose(0, 1).requires_grad_()
    eps = 1e-6 if rms else 1e-5
    g = torch.Generator().manual_seed(1)
    dout, dh = (torch.randn(x.shape, generator=g).to(device) for _ in range(2))
    with forced_strict(backend):
        got = (portable_ops.rms_norm(x, w, eps, residual=r) if rms
               else portable_ops.layer_norm(x, w, b, eps, residual=r))
    out, h = got if residual else (got, None)
    params = (x, r, w) if rms else (x, r, w, b)
    inputs = [t for t in params if t is not None]
    grads = torch.autograd.grad((out, h) if residual else out, inputs, (dout, dh) if residual else dout)
    ref, ref_h, leaves = _torch_norm(rms, x, r, w, None if rms else b, eps)
    ref_grads = torch.autograd.grad((ref, ref_h) if residual else ref, leaves,
                                    (dout.cpu().double(), dh.cpu().double()) if residual else dout.cpu().double())
    tol = tolerance("rms_norm" if rms else "layer_norm", torch.float32)
    torch.testing.assert_close(out.cpu().double(), ref, atol=tol.atol, rtol=tol.rtol)
    if residual:
        torch.testing.assert_close(h.cpu().double(), ref_h, atol=0, rtol=0)
    grad_tol = tol.scaled(GRADIENT_FACTOR)
    for got_grad, want in zip(grads, ref_grads):
        torch.testing.assert_close(got_grad.cpu().double(), want, atol=grad_tol.atol, rtol=grad_tol.rtol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_weight_gradients_are_the_same_bits_every_run(backend):
    device = default_device(backend)
    x, _, w, b = _inputs((70, 40), device, residual=False)
    runs = []
    for _ in range(2):
        with forced_strict(backend):
            out = portable_ops.layer_norm(x, w, b)
        runs.append(torch.autograd.grad(out.square().sum(), (w, b)))
    for first, second in zip(*runs):
        assert torch.equal(first, second)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b == "nki"])
def test_nki_rsqrt_domain_edges_give_torchs_answers(backend):
    """Rows whose variance leaves the Scalar Engine's rsqrt domain: 2^120 (above it), 0 with eps=0 (below it)."""
    x = torch.stack([torch.full((16,), 2.0 ** 60) * torch.linspace(0.5, 1.5, 16), torch.zeros(16),
                     torch.linspace(-1, 1, 16)])
    with forced_strict(backend):
        out = portable_ops.rms_norm(x, None, 0.0)
    torch.testing.assert_close(out, F.rms_norm(x, (16,), None, 0.0), equal_nan=True)
    from portable_ops.backends.nki.emulator import EmulatorError
    from portable_ops.backends.nki.emulator.isa import elementwise
    with pytest.raises(EmulatorError, match="engine-domain"):
        elementwise._check_rsqrt_domain(torch.tensor([0.0]))


# ----------------------------------------------------------------------------- bad input

BAD = {
    "x": (dict(x=torch.arange(8)), TypeError, "x has dtype torch.int64"),
    "x_0d": (dict(x=torch.tensor(1.0)), ValueError, "x must have at least one dimension"),
    "weight_shape": (dict(weight=torch.ones(7)), ValueError, r"weight must have shape \(8,\)"),
    "bias_shape": (dict(bias=torch.ones(2, 8)), ValueError, r"bias must have shape \(8,\)"),
    "residual_shape": (dict(residual=torch.ones(3, 8)), ValueError, r"residual must have shape \(2, 8\)"),
    "residual_dtype": (dict(residual=torch.ones(2, 8, dtype=torch.int32)), TypeError, "residual has dtype"),
    "eps_negative": (dict(eps=-1e-5), ValueError, "eps must be a finite number >= 0"),
    "eps_nan": (dict(eps=float("nan")), ValueError, "eps must be a finite number >= 0"),
    "eps_int_past_float": (dict(eps=10**400), ValueError, "eps must be a finite number >= 0"),
    "eps_tensor": (dict(eps=torch.tensor(1e-5)), TypeError, "eps must be a float"),
    "weight_type": (dict(weight=[1.0] * 8), TypeError, "weight must be a tensor"),
}


@pytest.mark.parametrize("op, case", [(op, case) for op in ("rms_norm", "layer_norm") for case in BAD
                                      if op == "layer_norm" or "bias" not in BAD[case][0]])  # rms_norm has no bias
def test_bad_input_is_refused_naming_the_argument(op, case):
    change, error, message = BAD[case]
    args = dict(x=torch.randn(2, 8), weight=torch.ones(8), eps=1e-5, residual=None)
    if op == "layer_norm":
        args["bias"] = torch.zeros(8)
    args.update(change)
    with pytest.raises(error, match=f"{op}: {message}"):
        getattr(portable_ops, op)(args.pop("x"), **args)


def test_modules_refuse_a_normalized_shape_wider_than_the_last_dim():
    with pytest.raises(ValueError, match=r"normalized_shape must be the last dim alone .* got \(4, 8\)"):
        portable_ops.nn.LayerNorm((4, 8))
    with pytest.raises(ValueError, match="normalized_shape must be the last dim alone"):
        portable_ops.nn.RMSNorm([2, 3])


def test_a_backend_declines_what_it_cant_hold_with_a_reason():
    x = torch.randn(2, 20000)
    with portable_ops.use_backend("triton"):
        choice = portable_ops.explain("rms_norm", x.to(default_device("triton")))
    assert choice.backend == "reference"
    assert "the normalised dim is 20000, over 8192" in " ".join(choice.reasons)
    with portable_ops.use_backend("nki"):
        choice = portable_ops.explain(portable_ops.layer_norm, x.double().to(default_device("nki")))
    assert "float64 is not supported" in " ".join(choice.reasons)
    assert "the normalised dim is 20000, over 5120" in " ".join(choice.reasons)


# ----------------------------------------------------------------------------- PyTorch's machinery

@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_ops_pass_opcheck(backend):
    device = default_device(backend)
    x, r, w, b = (t.detach() for t in _inputs((2, 3, 12), device))
    xt = x.transpose(0, 1)
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(3, 2, 12, generator=g).to(device)
    with forced_strict(backend):
        for residual, weight in ((None, w), (r.transpose(0, 1), None)):
            torch.library.opcheck(torch.ops.portable_ops.rms_norm_fwd.default, (xt, residual, weight, 1e-6))
            torch.library.opcheck(torch.ops.portable_ops.layer_norm_fwd.default, (xt, residual, weight, b, 1e-5))
        _, _, rstd = torch.ops.portable_ops.rms_norm_fwd.default(xt, None, w, 1e-6)
        torch.library.opcheck(torch.ops.portable_ops.rms_norm_bwd.default, (xt, w, rstd, dout, None))
        _, _, mean, rstd = torch.ops.portable_ops.layer_norm_fwd.default(xt, None, w, b, 1e-5)
        torch.library.opcheck(torch.ops.portable_ops.layer_norm_bwd.default, (xt, w, mean, rstd, dout, dout, True))


def _pre_norm_block(x, h, w_norm, b_norm, w_proj):
    """Two pre-norm sub-blocks: the residual stream through the fused add, then a LayerNorm."""
    y, h = portable_ops.rms_norm(x, w_norm, 1e-6, residual=h)
    y = y @ w_proj
    z = portable_ops.layer_norm(y, w_norm, b_norm, residual=h)[0]
    return z.square().mean()


TRACED = "triton" in BACKENDS  # the backend with traced ops (OpImpl.traced), usable here
needs_traced = pytest.mark.skipif(not TRACED, reason="the triton backend can't run here")


@needs_traced
def test_traced_ops_pass_opcheck():
    """The ops torch.compile runs for the triton backend take the backends' rows, any strides."""
    x, r, w, b = (t.detach() for t in _inputs((2, 3, 12), default_device("triton")))
    rows, residual = x.transpose(0, 1).reshape(6, 12), r.reshape(6, 12)
    declared = dispatch.get_backend("triton").ops
    assert [declared[op].traced() for op in ("rms_norm_fwd", "layer_norm_fwd")] == ["triton_rms_norm_fwd",
                                                                                    "triton_layer_norm_fwd"]
    ops = torch.ops.portable_ops
    torch.library.opcheck(ops.triton_rms_norm_fwd.default, (rows.t().contiguous().t(), residual, w, 1e-6))
    torch.library.opcheck(ops.triton_layer_norm_fwd.default, (rows, None, w, b, 1e-5))
    _, _, rstd = ops.triton_rms_norm_fwd(rows, None, None, 1e-6)
    torch.library.opcheck(ops.triton_rms_norm_bwd.default, (rows, None, rstd, residual.t().contiguous().t(), None))
    _, _, mean, rstd = ops.triton_layer_norm_fwd(rows, None, w, b, 1e-5)
    torch.library.opcheck(ops.triton_layer_norm_bwd.default, (rows, w, mean, rstd, residual, residual, True))


@needs_traced
@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_triton_runs_its_traced_ops_with_the_eager_kernels_bits(monkeypatch):
    """Under forced triton the graph holds the traced ops, not the custom ops: running it dispatches nothing, and
    its loss and gradients are the eager path's to the bit (the same kernels, configured alike). One graph serves
    every token count (the token dim marked dynamic); x and the residual are transposed views."""
    device = default_device("triton")
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_pre_norm_block, backend=counter, fullgraph=True)
    g = torch.Generator().manual_seed(5)
    params = [(1 + torch.randn(16, generator=g) / 4).to(device).requires_grad_(),
              (torch.randn(16, generator=g) / 4).to(device).requires_grad_(),
              (torch.randn(16, 16, generator=g) / 4).to(device).requires_grad_()]
    dispatched = []
    for s in (5, 11):
        x, h = (torch.randn(2, s, 16, generator=g).to(device).transpose(0, 1).requires_grad_() for _ in range(2))
        with forced_strict("triton"):
            expected = _pre_norm_block(x, h, *params)
            expected_grads = torch.autograd.grad(expected, (x, h, *params))
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(h, 0)
            with monkeypatch.context() as patch:
                patch.setattr(norms, "run_op", lambda *args: dispatched.append(args[0]))
                loss = compiled(x, h, *params)
                grads = torch.autograd.grad(loss, (x, h, *params))
        assert torch.equal(loss, expected)
        assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads))
    assert not dispatched
    assert sum(counters["graph_break"].values()) == 0
    assert counter.frame_count == 1
    code = counter.graphs[0].code
    assert "triton_rms_norm_fwd" in code and "triton_layer_norm_fwd" in code and ".rms_norm_fwd" not in code


@needs_traced
@pytest.mark.usefixtures("fresh_dynamo")
def test_a_graph_traced_for_triton_is_traced_again_for_a_backend_forced_later():
    """The choice is the trace's, guarded on the backend use_backend forces: forcing another recompiles, and that
    graph holds the reference's torch ops (``OpImpl.autograd``), traced in."""
    device = default_device("triton")
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda x, w: portable_ops.rms_norm(x, w) * 2, backend=counter, fullgraph=True)
    x, w = torch.randn(3, 8).to(device), torch.randn(8).to(device)
    for backend in ("triton", "reference", "triton"):
        with forced_strict(backend):
            torch.testing.assert_close(compiled(x, w), F.rms_norm(x, (8,), w) * 2)
    assert counter.frame_count == 2
    assert "triton_rms_norm_fwd" in counter.graphs[0].code and "torch.rms_norm" in counter.graphs[1].code


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_forward_and_backward_without_breaks_or_recompiles(backend):
    device = default_device(backend)
    compiled = torch.compile(_pre_norm_block, backend="aot_eager", fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(4)
    params = [(1 + torch.randn(16, generator=g) / 4).to(device).requires_grad_(),
              (torch.randn(16, generator=g) / 4).to(device).requires_grad_(),
              (torch.randn(16, 16, generator=g) / 4).to(device).requires_grad_()]
    with forced_strict(backend):
        for s in (5, 9, 13):
            x, h = (torch.randn(2, s, 16, generator=g).to(device).transpose(0, 1).requires_grad_()
                    for _ in range(2))
            loss = compiled(x, h, *params)
            grads = torch.autograd.grad(loss, (x, h, *params))
            expected = _pre_norm_block(x, h, *params)
            expected_grads = torch.autograd.grad(expected, (x, h, *params))
            torch.testing.assert_close(loss, expected)
            for a, b in zip(grads, expected_grads):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1


def test_autocast_follows_torch_on_the_cpu_and_casts_to_float32_where_torch_does(monkeypatch):
    x, w = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for ours, theirs in ((portable_ops.rms_norm(x, w), F.rms_norm(x, (8,), w)),
                             (portable_ops.layer_norm(x.float(), w), F.layer_norm(x.float(), (8,), w))):
            assert ours.dtype == theirs.dtype  # CPU autocast lists neither norm: inputs as given
    monkeypatch.setattr(norms, "FP32_UNDER_AUTOCAST", ("cpu",))  # what CUDA's autocast does
    monkeypatch.setattr(norms, "_memo", {})  # the calls above were memoised under the CPU's policy
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = portable_ops.rms_norm(x, w)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, F.rms_norm(x.float(), (8,), w))


def test_torch_func_grad_vmap_and_double_backward_match_torch():
    x, _, w, b = _inputs((3, 10), torch.device("cpu"), residual=False)
    f = lambda x: portable_ops.layer_norm(x, w, b).square().sum()  # noqa: E731
    g = lambda x: F.layer_norm(x, (10,), w, b).square().sum()  # noqa: E731
    torch.testing.assert_close(torch.func.grad(f)(x), torch.func.grad(g)(x))
    torch.testing.assert_close(torch.func.vmap(lambda r: portable_ops.rms_norm(r, w))(x), F.rms_norm(x, (10,), w))
    (dx,) = torch.autograd.grad(portable_ops.rms_norm(x, w).pow(3).sum(), x, create_graph=True)
    (dx_ref,) = torch.autograd.grad(F.rms_norm(x, (10,), w).pow(3).sum(), x, create_graph=True)
    torch.testing.assert_close(dx, dx_ref)
    torch.testing.assert_close(torch.autograd.grad(dx.sum(), w), torch.autograd.grad(dx_ref.sum(), w))


@pytest.mark.parametrize("ours, theirs, kwargs", [
    (portable_ops.nn.RMSNorm, torch.nn.RMSNorm, dict(eps=1e-6)),
    (portable_ops.nn.LayerNorm, torch.nn.LayerNorm, dict(eps=1e-5)),
    (portable_ops.nn.LayerNorm, torch.nn.LayerNorm, dict(bias=False)),
    (portable_ops.nn.RMSNorm, torch.nn.RMSNorm, dict(elementwise_affine=False)),
])
def test_modules_drop_in_for_torchs_and_state_dicts_load_both_ways(ours, theirs, kwargs):
    mine, torchs = ours(12, **kwargs), theirs(12, **kwargs)
    with torch.no_grad():
        for p in torchs.parameters():
            p.uniform_(0.5, 1.5)
    mine.load_state_dict(torchs.state_dict())
    assert mine.state_dict().keys() == torchs.state_dict().keys()
    x = torch.randn(2, 3, 12)
    torch.testing.assert_close(mine(x), torchs(x))
    with torch.no_grad():
        for p in mine.parameters():
            p.add_(0.25)
    torchs.load_state_dict(mine.state_dict())
    torch.testing.assert_close(mine(x), torchs(x))
    residual = torch.randn(2, 3, 12)
    out, h = mine(x, residual)
    torch.testing.assert_close(out, torchs(x + residual))
    torch.testing.assert_close(h, x + residual)


def test_empty_inputs_give_torchs_empty_answers_and_zero_weight_grads():
    x, _, w, b = _inputs((0, 6), torch.device("cpu"), residual=False)
    out = portable_ops.layer_norm(x, w, b)
    assert out.shape == (0, 6)
    dw, db = torch.autograd.grad(out.sum(), (w, b))
    assert torch.equal(dw, torch.zeros(6)) and torch.equal(db, torch.zeros(6))


def test_the_reference_is_the_default_on_cpu_and_strict_mode_names_the_decline(monkeypatch):
    x = torch.randn(2, 8)
    assert portable_ops.explain("layer_norm", x).backend == "reference"
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")
    with portable_ops.use_backend("nki"), pytest.raises(dispatch.BackendUnavailableError, match="over 5120"):
        portable_ops.rms_norm(torch.randn(2, 6000))


def test_gradcheck_and_gradgradcheck_through_the_fused_residual_in_float64():
    x, r, w, b = (t.detach().double().requires_grad_() for t in _inputs((3, 7), torch.device("cpu")))
    assert torch.autograd.gradcheck(lambda x, r, w: portable_ops.rms_norm(x, w, residual=r), (x, r, w))
    assert torch.autograd.gradgradcheck(lambda x, r, w, b: portable_ops.layer_norm(x, w, b, residual=r),
                                        (x, r, w, b))


def test_nki_kernels_at_their_largest_row_fit_sbuf_with_every_option():
    """``MAX_D`` is what SBUF holds: every option on, in count-only mode (the emulator enforces the capacity)."""
    from portable_ops.backends.nki import emulator
    from portable_ops.backends.nki.norms import MAX_D
    ops = dispatch.get_backend("nki").ops
    x, w = torch.zeros(130, MAX_D, device="meta"), torch.zeros(MAX_D, device="meta")
    stats = torch.zeros(130, device="meta")
    with emulator.count_only(), emulator.count_instructions() as counted:
        ops["layer_norm_fwd"].run(x=x, residual=x, weight=w, bias=w, eps=1e-5)
        ops["layer_norm_bwd"].run(x=x, weight=w, mean=stats, rstd=stats, dout=x, dh=x, has_bias=True)
    assert counted.sbuf_peak_bytes <= 224 * 1024
