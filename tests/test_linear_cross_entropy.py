"""linear_cross_entropy on every backend usable here that has its kernels (a backend that declines it is covered by
the conformance suite's declared fallbacks).

Every option against torch's ``F.cross_entropy`` over ``F.linear`` (the softcap written out), in float64 where the
backend takes it; a non-contiguous hidden; bad input refused by name before anything runs, every tensor unchanged;
the custom ops through ``torch.library.opcheck``; torch.compile with no graph break and one graph across token
counts; autocast; torch.func; and the reference path holding no ``[tokens, V]`` tensor. The conformance suite
(tests/test_conformance.py) covers the edge cases per backend and dtype.
"""

import importlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

import portable_ops
from portable_ops import dispatch, lm_head
from portable_ops.conformance import GRADIENT_FACTOR, tolerance, usable_backends
from portable_ops.conformance.runner import default_device, forced_strict

from conftest import assert_bit_identical, snapshot

lce_module = importlib.import_module("portable_ops.linear_cross_entropy")  # the package's name is the function
BACKENDS = [b for b in usable_backends() if "linear_cross_entropy_fwd" in dispatch.get_backend(b).ops]
OPTIONS = dict(label_smoothing=0.1, softcap=3.0, ignore_index=-100)


def _inputs(device, dtype=torch.float32, n=(2, 5), h=12, v=29, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*n, h, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / 2).to(device, dtype).requires_grad_()
    b = torch.randn(v, generator=g).to(device, dtype).requires_grad_() if bias else None
    target = torch.randint(0, v, n, generator=g)
    target.view(-1)[::4] = -100
    return hidden, weight, b, target.to(device)


def _torch_loss(hidden, weight, bias, target, reduction, label_smoothing=0.0, softcap=None, ignore_index=-100):
    z = F.linear(hidden, weight, bias)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z.to(torch.promote_types(z.dtype, torch.float32))  # float(), but float64 kept
    loss = F.cross_entropy(z.reshape(-1, z.shape[-1]), target.reshape(-1), ignore_index=ignore_index,
                           label_smoothing=label_smoothing, reduction=reduction)
    return loss.reshape(target.shape) if reduction == "none" else loss


def _against_torch(backend, hidden, weight, bias, target, reduction, **options):
    """The loss and gradients (for an upstream gradient that is not 1) of ours on ``backend`` and torch's, the
    latter in float64 on CPU copies."""
    with forced_strict(backend), lm_head.chunk_budget(3 * weight.shape[0]):
        loss = portable_ops.linear_cross_entropy(hidden, weight, target, bias=bias, reduction=reduction, **options)
    leaves = [t for t in (hidden, weight, bias) if t is not None]
    upstream = torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape).to(loss.device)
    grads = torch.autograd.grad(loss, leaves, upstream)
    copies = [t.detach().cpu().double().requires_grad_() for t in leaves]
    ref = _torch_loss(*copies[:2], copies[2] if bias is not None else None, target.cpu(), reduction, **options)
    ref_grads = torch.autograd.grad(ref, copies, upstream.cpu().double())
    return (loss, *grads), (ref, *ref_grads)


def _assert_close(got, want, dtype=torch.float32):
    tol = tolerance("linear_cross_entropy", dtype)
    loss, *grads = got
    ref, *ref_grads = want
    torch.testing.assert_close(loss.cpu().double(), ref.detach(), atol=tol.atol, rtol=tol.rtol, equal_nan=True)
    grad_tol = tol.scaled(GRADIENT_FACTOR)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.cpu().double(), b, atol=grad_tol.atol, rtol=grad_tol.rtol)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_option_matches_torch(backend, reduction):
    """Ignored tokens, label smoothing and the softcap together, over several chunks."""
    device = default_device(backend)
    _assert_close(*_against_torch(backend, *_inputs(device), reduction, **OPTIONS))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sliced_hidden_and_an_all_ignored_batch(backend):
    """hidden a strided slice of a wider tensor (its rows can't be folded without a copy); then a batch whose every
    target is ignore_index: torch's NaN mean and zero gradients."""
    device = default_device(backend)
    hidden, weight, bias, target = _inputs(device, n=(3, 4), h=24)
    sliced = hidden.detach()[:, :, ::2].requires_grad_()  # [3, 4, 12], strides (96, 24, 2)
    _assert_close(*_against_torch(backend, sliced, weight[:, :12].detach().requires_grad_(), None, target, "sum"))
    ignored = torch.full_like(target, -100)
    got, want = _against_torch(backend, hidden, weight, bias, ignored, "mean")
    assert got[0].isnan() and want[0].isnan()
    assert all(torch.equal(g, torch.zeros_like(g)) for g in got[1:])


@pytest.mark.skipif("nki" not in BACKENDS, reason="the NKI backend is not usable here")
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_nki_kernel_takes_its_second_pass_from_kept_and_reloaded_vocab_tiles(softcap, monkeypatch):
    """The first vocab tiles stay in SBUF for the second pass, the rest are loaded again: at a small vocab in
    32-column tiles of which the first pass keeps two, both kinds meet in one row."""
    nki_rows = importlib.import_module("portable_ops.backends.nki.linear_cross_entropy")
    monkeypatch.setattr(nki_rows, "TILE_V", 32)
    monkeypatch.setattr(nki_rows, "KEPT_BYTES", 2 * 32 * 4)
    hidden, weight, bias, target = _inputs(default_device("nki"), v=150)
    _assert_close(*_against_torch("nki", hidden, weight, bias, target, "mean", label_smoothing=0.1, softcap=softcap))


# ----------------------------------------------------------------------------- bad input

def _bad(**change):
    hidden, weight, bias, target = (t.detach() for t in _inputs(torch.device("cpu")))
    args = dict(hidden=hidden, weight=weight, target=target, bias=bias)
    args.update(change)
    return args


BAD = {
    "target_past_v": (lambda a: a["target"].view(-1)[3].fill_(29), ValueError,
                      r"target\[3\] \(flattened\) is 29, outside \[0, 29\) and not ignore_index"),
    "target_negative": (lambda a: a["target"].view(-1)[1].fill_(-1), ValueError, r"target\[1\] .* is -1"),
    "target_int32": (dict(target=torch.zeros(2, 5, dtype=torch.int32)), TypeError, "target has dtype torch.int32"),
    "target_shape": (dict(target=torch.zeros(10, dtype=torch.int64)), ValueError, r"target must have shape \(2, 5\)"),
    "weight_dtype": (dict(weight=torch.zeros(29, 12, dtype=torch.float64)), TypeError,
                     "weight has dtype torch.float64 but hidden has torch.float32"),
    "weight_shape": (dict(weight=torch.zeros(29, 11)), ValueError, r"weight must have shape \[V, 12\]"),
    "bias_shape": (dict(bias=torch.zeros(28)), ValueError, r"bias must have shape \(29,\)"),
    "hidden_int": (dict(hidden=torch.zeros(2, 5, 12, dtype=torch.int64)), TypeError, "hidden has dtype torch.int64"),
    "label_smoothing": (dict(label_smoothing=1.5), ValueError, r"label_smoothing must be in \[0, 1\]"),
    "reduction": (dict(reduction="avg"), ValueError, "reduction must be one of 'mean', 'sum', 'none'"),
    "softcap_zero": (dict(softcap=0.0), ValueError, "softcap must be a finite number > 0"),
    "ignore_index_float": (dict(ignore_index=-100.0), TypeError, "ignore_index must be an int"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_refused_by_name_before_anything_runs(case, monkeypatch):
    change, error, message = BAD[case]
    args = _bad() if callable(change) else _bad(**change)
    if callable(change):
        change(args)
    tensors = [t for t in args.values() if isinstance(t, torch.Tensor)]
    before = snapshot(tensors)
    launched = []
    monkeypatch.setattr(lce_module, "run_op", lambda *a, **k: launched.append(a))
    with pytest.raises(error, match=f"linear_cross_entropy: {message}"):
        portable_ops.linear_cross_entropy(**args)
    assert not launched
    assert_bit_identical(before, tensors)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_targets_are_checked_on_the_device_without_a_synchronisation():
    """A good CUDA target costs no device-to-host read (sync debug mode raises on one); a bad one fails the device
    assert queued before the kernels (in a child process: a device-side assert loses the CUDA context)."""
    hidden, weight, bias, target = (t.detach().cuda() for t in _inputs(torch.device("cpu")))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = portable_ops.linear_cross_entropy(hidden, weight, target, bias=bias)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = F.cross_entropy(F.linear(hidden, weight, bias).float().flatten(0, -2), target.reshape(-1))
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)
    code = ("import torch, portable_ops\n"
            "h, w = torch.randn(4, 8, device='cuda'), torch.randn(16, 8, device='cuda')\n"
            "t = torch.tensor([0, 3, 16, 1], device='cuda')\n"
            "portable_ops.linear_cross_entropy(h, w, t)\n"
            "torch.cuda.synchronize()\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    # the assert's own message, which the kernels' index asserts would not print
    assert child.returncode != 0 and "linear_cross_entropy: a target is outside [0, 16)" in child.stderr, \
        child.stderr[-2000:]


def test_a_backend_declines_what_it_cant_take_with_a_reason():
    hidden, weight, bias, target = (t.detach() for t in _inputs(torch.device("cpu")))
    for backend in (b for b in BACKENDS if b != "reference"):
        device = default_device(backend)
        with portable_ops.use_backend(backend):
            choice = portable_ops.explain(portable_ops.linear_cross_entropy, hidden.double().to(device),
                                          weight.double().to(device), target.to(device))
        assert choice.backend == "reference" and "float64 is not supported" in " ".join(choice.reasons)
    if "nki" in BACKENDS:
        wide = dict(weight=torch.empty(2 ** 24 + 1, 12, device="meta"))  # past float32's exact integers: taken
        assert dispatch.get_backend("nki").ops["linear_cross_entropy_fwd"].supports(wide) == []


def test_second_derivatives_are_refused_clearly():
    hidden, weight, bias, target = _inputs(torch.device("cpu"))
    loss = portable_ops.linear_cross_entropy(hidden, weight, target, bias=bias)
    with pytest.raises(RuntimeError, match=r"second derivatives \(create_graph=True\) are not supported"):
        torch.autograd.grad(loss, hidden, create_graph=True)


# ----------------------------------------------------------------------------- PyTorch's machinery

@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_ops_pass_opcheck(backend):
    device = default_device(backend)
    hidden, weight, bias, target = (t.detach() for t in _inputs(device))
    options = (-100, 0.1, 3.0)
    with forced_strict(backend), lm_head.chunk_budget(3 * weight.shape[0]):
        for reduction, grads in (("mean", (True, True, True)), ("none", (False, False, False))):
            torch.library.opcheck(torch.ops.portable_ops.linear_cross_entropy_fwd.default,
                                  (hidden, weight, bias, target, options[0], options[1], reduction, options[2], *grads))
        dloss = torch.rand(target.shape, device=device)
        torch.library.opcheck(torch.ops.portable_ops.linear_cross_entropy_bwd.default,
                              (hidden, weight, None, target, dloss, *options, True, True, False))


def _lm_head_loss(x, w_proj, weight, target):
    """A last block's projection, then the LM head and its loss."""
    return portable_ops.linear_cross_entropy(torch.tanh(x @ w_proj), weight, target, label_smoothing=0.1,
                                             softcap=5.0)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_forward_and_backward_without_breaks_or_recompiles(backend):
    device = default_device(backend)
    compiled = torch.compile(_lm_head_loss, backend="aot_eager", fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(4)
    params = [(torch.randn(16, 16, generator=g) / 4).to(device).requires_grad_(),
              (torch.randn(23, 16, generator=g) / 2).to(device).requires_grad_()]
    with forced_strict(backend):
        for tokens in (5, 9):
            x = torch.randn(2, tokens, 16, generator=g).to(device).requires_grad_()
            target = torch.randint(0, 23, (2, tokens), generator=g).to(device)
            loss = compiled(x, *params, target)
            grads = torch.autograd.grad(loss, (x, *params))
            expected = _lm_head_loss(x, *params, target)
            torch.testing.assert_close(loss, expected)
            for a, b in zip(grads, torch.autograd.grad(expected, (x, *params))):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        if not target.is_cuda:  # CUDA asserts on the device (its own test, in a child process)
            target[0, 0] = 23
            with pytest.raises(ValueError, match=r"target\[0\] \(flattened\) is 23"):
                compiled(x, *params, target)  # refused by the custom op, when the graph runs
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1


def test_autocast_runs_the_head_in_bfloat16_and_the_loss_in_float32():
    hidden, weight, bias, target = _inputs(torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = portable_ops.linear_cross_entropy(hidden, weight, target, bias=bias, **OPTIONS)
        ref = _torch_loss(hidden, weight, bias, target, "mean", **OPTIONS)
    assert loss.dtype == ref.dtype == torch.float32
    grads = torch.autograd.grad(loss, (hidden, weight, bias))
    ref_grads = torch.autograd.grad(ref, (hidden, weight, bias))
    tol = tolerance("linear_cross_entropy", torch.bfloat16)
    torch.testing.assert_close(loss, ref, atol=tol.atol, rtol=tol.rtol)
    for a, b in zip(grads, ref_grads):
        assert a.dtype == torch.float32  # the parameters' dtype, through autocast's cast
        torch.testing.assert_close(a, b, atol=tol.atol * GRADIENT_FACTOR, rtol=tol.rtol * GRADIENT_FACTOR)


def test_torch_func_grad_matches_torch():
    hidden, weight, _, target = _inputs(torch.device("cpu"), bias=False)
    hidden, weight = hidden.detach(), weight.detach()
    ours = torch.func.grad(lambda w: portable_ops.linear_cross_entropy(hidden, w, target, **OPTIONS))(weight)
    theirs = torch.func.grad(lambda w: _torch_loss(hidden, w, None, target, "mean", **OPTIONS))(weight)
    torch.testing.assert_close(ours, theirs)


class _Allocations(TorchDispatchMode):
    """The shape of every floating tensor an op allocates: the outputs of ops that neither view nor write their
    inputs."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func._schema.is_mutable:
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.shapes.append(tuple(t.shape))
        return out


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_the_reference_never_holds_more_than_a_chunk_of_logits(reduction):
    tokens, h, v, chunk = 64, 16, 50, 8
    hidden, weight, bias, target = _inputs(torch.device("cpu"), n=(tokens,), h=h, v=v)
    with lm_head.chunk_budget(chunk * v), _Allocations() as seen:
        loss = portable_ops.linear_cross_entropy(hidden, weight, target, bias=bias, reduction=reduction, **OPTIONS)
        torch.autograd.grad(loss, (hidden, weight, bias), torch.ones_like(loss))
    with_vocab = [s for s in seen.shapes if v in s and s not in ((v, h), (v,))]
    assert (chunk, v) in with_vocab  # the chunks' logits are seen, so the bound below can fail
    assert max(torch.Size(s).numel() for s in with_vocab) <= chunk * v
    with torch.no_grad(), lm_head.chunk_budget(chunk * v), _Allocations() as seen:
        portable_ops.linear_cross_entropy(hidden, weight, target, bias=bias, **OPTIONS)
    assert (v, h) not in seen.shapes and (tokens, h) not in seen.shapes  # inference makes no gradients
