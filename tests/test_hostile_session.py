"""Regressions found by hostile-user passes over the norms, the optimizers, the transformers integration (mask
path and patch()), linear_cross_entropy's target checks and rope_ under torch.func.

Each test failed before its fix: a LayerNorm weight/bias dtype mix the op takes but the reference backend handed
to aten, which refused it; a momentum buffer assigned or deleted by hand that the SGD step's cached lists did not
see; transformers' mask path run before register(), or with a reloaded transformers, failing on a None.
"""

import types

import pytest
import torch
import torch.nn.functional as F

import portable_ops
from portable_ops.conformance import usable_backends
from portable_ops.conformance.runner import default_device, forced_strict

BACKENDS = usable_backends()


# ----------------------------------------------------------------------------- norms

@pytest.mark.parametrize("dtypes", [(torch.float32, torch.bfloat16, torch.float16),
                                    (torch.float32, torch.bfloat16, None),
                                    (torch.bfloat16, torch.float32, torch.bfloat16),
                                    (torch.float16, torch.bfloat16, torch.float32)],
                         ids=["f32-bf16-f16", "f32-bf16-none", "bf16-f32-bf16", "f16-bf16-f32"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_norm_takes_every_weight_and_bias_dtype_mix(backend, dtypes):
    """docs/api.md: a weight or bias of another floating dtype than x's is taken and read in float32. aten's
    native_layer_norm refuses most such mixes ("mixed dtype (CPU): expect parameter to have scalar type of
    Float"), which the reference backend raised mid-call."""
    x_dtype, w_dtype, b_dtype = dtypes
    device = default_device(backend)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=g).to(device, x_dtype).requires_grad_()
    w = (1 + 0.5 * torch.randn(16, generator=g)).to(device, w_dtype).requires_grad_()
    b = None if b_dtype is None else (0.5 * torch.randn(16, generator=g)).to(device, b_dtype).requires_grad_()
    with forced_strict(backend):
        out = portable_ops.layer_norm(x, w, b, 1e-5)
        dout = torch.randn(out.shape, generator=g).to(device, out.dtype)
        out.backward(dout)
    assert out.dtype == x_dtype and w.grad.dtype == w_dtype and (b is None or b.grad.dtype == b_dtype)
    leaves = [t.detach().double().cpu().requires_grad_() for t in (x, w) + (() if b is None else (b,))]
    want = F.layer_norm(leaves[0], (16,), leaves[1], leaves[2] if b is not None else None, 1e-5)
    want.backward(dout.double().cpu())
    tol = 5e-2 if torch.bfloat16 in dtypes or torch.float16 in dtypes else 1e-4
    torch.testing.assert_close(out.double().cpu(), want, atol=tol, rtol=tol)
    got_grads = [x.grad, w.grad] + ([] if b is None else [b.grad])
    for got, leaf in zip(got_grads, leaves):
        torch.testing.assert_close(got.double().cpu(), leaf.grad, atol=tol * 4, rtol=tol)


# ----------------------------------------------------------------------------- SGD

def _params(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5 + i, generator=g)) for i in range(3)]


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.device)


@pytest.mark.parametrize("how", ["assign_zeros", "assign_none", "delete"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_sgd_sees_a_momentum_buffer_replaced_by_hand(backend, how):
    """Resetting momentum by assigning ``state[p]["momentum_buffer"]`` (or deleting it) after a step: torch's SGD
    steps from the new buffer (a None or missing one is made from the grad). The step's cached lists held the
    old buffer and kept stepping it, so the params drifted from torch's and the state_dict lost the buffer."""
    device = default_device(backend)
    ours = [torch.nn.Parameter(p.detach().to(device)) for p in _params(0)]
    theirs = [torch.nn.Parameter(p.detach().to(device)) for p in _params(0)]
    kw = dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)
    opt, ref = portable_ops.optim.SGD(ours, **kw), torch.optim.SGD(theirs, **kw)
    with forced_strict(backend):
        for step in range(4):
            _grads(ours, step)
            _grads(theirs, step)
            opt.step()
            ref.step()
            if step == 1:  # the lists are cached by now
                for o, params in ((opt, ours), (ref, theirs)):
                    state = o.state[params[1]]
                    if how == "delete":
                        del state["momentum_buffer"]
                    else:
                        state["momentum_buffer"] = torch.zeros_like(params[1]) if how == "assign_zeros" else None
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)
    for a, b in zip(opt.state_dict()["state"].values(), ref.state_dict()["state"].values()):
        torch.testing.assert_close(a["momentum_buffer"], b["momentum_buffer"])


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq", "step"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_adam_sees_a_state_tensor_replaced_by_hand(backend, key):
    """Resetting a moment (or the step count) by assigning ``state[p][key]`` after a step: torch's Adam steps
    from the new tensor. The step's cached lists held the old one and kept stepping it."""
    device = default_device(backend)
    ours = [torch.nn.Parameter(p.detach().to(device)) for p in _params(0)]
    theirs = [torch.nn.Parameter(p.detach().to(device)) for p in _params(0)]
    kw = dict(lr=0.1, weight_decay=0.01)
    opt, ref = portable_ops.optim.AdamW(ours, **kw), torch.optim.AdamW(theirs, foreach=False, **kw)
    with forced_strict(backend):
        for step in range(4):
            _grads(ours, step)
            _grads(theirs, step)
            opt.step()
            ref.step()
            if step == 1:  # the lists are cached by now
                for o, params in ((opt, ours), (ref, theirs)):
                    state = o.state[params[1]]
                    state[key] = torch.zeros_like(state[key])
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)
    for a, b in zip(opt.state_dict()["state"].values(), ref.state_dict()["state"].values()):
        torch.testing.assert_close(a["exp_avg"], b["exp_avg"])
        torch.testing.assert_close(a["step"].cpu(), b["step"].cpu())


# ----------------------------------------------------------------------------- transformers

def test_mask_function_before_register_says_so(monkeypatch):
    pytest.importorskip("transformers", minversion="5.0")
    from transformers import masking_utils

    from portable_ops.integrations import transformers as integration

    monkeypatch.setattr(integration, "_masking_utils", None)
    with pytest.raises(RuntimeError, match=r"before register\(\)"):
        integration.build_mask(1, 4, mask_function=masking_utils.causal_mask_function, q_length=4, q_offset=0)


def test_mask_function_of_a_reloaded_transformers_says_so():
    """A causal_mask_function from another import of transformers.masking_utils (reloaded or imported again after
    register()) is not the one register() holds: the refusal says to call register() again, instead of calling
    causal_mask_function "an extra mask function"."""
    pytest.importorskip("transformers", minversion="5.0")
    from transformers import masking_utils

    from portable_ops.integrations import transformers as integration

    integration.register()
    f = masking_utils.causal_mask_function
    reloaded = types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    reloaded.__qualname__ = f.__qualname__
    with pytest.raises(RuntimeError, match=r"register\(\) again"):
        integration.build_mask(1, 4, mask_function=reloaded, q_length=4, q_offset=0)
    assert integration.build_mask(1, 4, mask_function=f, q_length=4, q_offset=0) is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_norm_custom_ops_give_the_fake_layouts_for_transposed_rows(backend):
    """The custom ops' fake outputs are row-major; the reference backend returned ``x + residual`` (and the
    definition's outputs and dx) in a transposed x's or dout's strides, so torch.compile of a pre-norm block over a
    transposed 2-D x failed ("expected ... stride 1==32": an incorrect fake kernel)."""
    device = default_device(backend)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 7, generator=g).to(device).t()
    r, dout, dh = (torch.randn(7, 32, generator=g).to(device) for _ in range(3))
    w, b = (torch.randn(32, generator=g).to(device) for _ in range(2))
    ops = torch.ops.portable_ops
    with forced_strict(backend):
        torch.library.opcheck(ops.rms_norm_fwd.default, (x, r, w, 1e-5))
        torch.library.opcheck(ops.layer_norm_fwd.default, (x, r, w, b, 1e-5))
        torch.library.opcheck(ops.layer_norm_fwd.default, (x, None, w.bfloat16(), b, 1e-5))
        _, _, rstd = ops.rms_norm_fwd(x.contiguous(), None, w, 1e-5)
        torch.library.opcheck(ops.rms_norm_bwd.default, (x.contiguous(), w, rstd, dout.t().contiguous().t(), dh))
        _, _, mean, rstd = ops.layer_norm_fwd(x.contiguous(), None, w, b, 1e-5)
        torch.library.opcheck(ops.layer_norm_bwd.default, (x.contiguous(), w.bfloat16(), mean, rstd, dout,
                                                          dh.t().contiguous().t(), True))

    def block(x, r, w, b):
        out, h = portable_ops.layer_norm(x, w, b, 1e-5, residual=r)
        return portable_ops.rms_norm(out, w, 1e-6, residual=h)[0].sum()

    leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
    torch._dynamo.reset()
    with forced_strict(backend):
        torch.compile(block, fullgraph=True)(*leaves).backward()
    expect = [t.detach().double().cpu().requires_grad_() for t in (x, r, w, b)]
    h = expect[0] + expect[1]
    out = F.layer_norm(h, (32,), expect[2], expect[3], 1e-5)
    F.rms_norm(out + h, (32,), expect[2], 1e-6).sum().backward()
    for got, want in zip(leaves, expect):
        torch.testing.assert_close(got.grad.double().cpu(), want.grad, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sgd_refuses_an_expanded_param_before_writing_any(backend):
    """A param whose elements share memory (an expanded view) failed inside the step with torch's in-place error,
    after the params before it had been stepped; now refused by name first, every tensor as it was."""
    device = default_device(backend)
    a = torch.nn.Parameter(torch.randn(4, device=device))
    e = torch.nn.Parameter(torch.randn(1, 4, device=device).expand(3, 4))
    a.grad, e.grad = torch.randn(4, device=device), torch.randn(3, 4, device=device)
    before = a.detach().clone()
    opt = portable_ops.optim.SGD([a, e], lr=0.1, momentum=0.9)
    with forced_strict(backend), pytest.raises(ValueError, match=r'param_groups\[0\]\["params"\]\[1\] has elements '
                                                                 r'that share memory'):
        opt.step()
    assert torch.equal(a.detach(), before) and not opt.state
    params, bufs = [a.detach().clone()], [torch.zeros(1, device=device).expand(4)]
    with forced_strict(backend), pytest.raises(ValueError, match=r"momentum_buffer_list\[0\] has elements"):
        portable_ops.functional.sgd(params, [a.grad], bufs, lr=0.1, momentum=0.9)
    assert torch.equal(params[0], before)


def test_functional_sgd_refuses_a_tuple_that_must_take_new_buffers():
    """A None in a tuple momentum_buffer_list: the params were stepped, then putting the new buffer in the tuple
    failed ("'tuple' object does not support item assignment") and the buffer was lost."""
    params, grads = [torch.randn(4)], [torch.randn(4)]
    before = params[0].clone()
    with pytest.raises(TypeError, match="momentum_buffer_list must be a list"):
        portable_ops.functional.sgd(params, grads, (None,), lr=0.1, momentum=0.9)
    assert torch.equal(params[0], before)
    portable_ops.functional.sgd(params, grads, (torch.zeros(4),), lr=0.1, momentum=0.9)  # no None: a tuple does


@pytest.mark.parametrize("rms", [True, False], ids=["rms_norm", "layer_norm"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_norms_read_a_strided_weight_and_bias(backend, rms):
    """A weight or bias that is a strided view (``w[::2]``, a slice of a fused parameter): the triton kernels read
    ``W + col`` as if it were dense, so their output was silently wrong."""
    device = default_device(backend)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=g).to(device).requires_grad_()
    w_base, b_base = (torch.randn(16, generator=g).to(device).requires_grad_() for _ in range(2))
    dout = torch.randn(5, 8, generator=g).to(device)
    with forced_strict(backend):
        got = (portable_ops.rms_norm(x, w_base[::2], 1e-6) if rms
               else portable_ops.layer_norm(x, w_base[::2], b_base[1::2], 1e-5))
        got.backward(dout)
    leaves = [t.detach().double().cpu().requires_grad_() for t in (x, w_base, b_base)]
    want = (F.rms_norm(leaves[0], (8,), leaves[1][::2], 1e-6) if rms
            else F.layer_norm(leaves[0], (8,), leaves[1][::2], leaves[2][1::2], 1e-5))
    want.backward(dout.double().cpu())
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-5, rtol=1e-5)
    for t, leaf in zip((x, w_base) if rms else (x, w_base, b_base), leaves):
        torch.testing.assert_close(t.grad.double().cpu(), leaf.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("elementwise_affine", [False, True], ids=["no_affine", "affine"])
@pytest.mark.parametrize("cls", ["RMSNorm", "LayerNorm"])
def test_norm_modules_refuse_an_x_of_another_width(cls, elementwise_affine):
    """torch's modules refuse an x whose last dim is not normalized_shape; without a weight ours normalised over
    x's own last dim silently."""
    module = getattr(portable_ops.nn, cls)(8, elementwise_affine=elementwise_affine)
    with pytest.raises(ValueError, match=r"last dim is 16 but the module normalises over normalized_shape=\[8\]"):
        module(torch.randn(2, 16))
    with pytest.raises(RuntimeError):
        getattr(torch.nn, cls)(8, elementwise_affine=elementwise_affine)(torch.randn(2, 16))
    assert module(torch.randn(2, 8)).shape == (2, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_sgd_takes_one_element_tensors_of_shape_1_with_a_0d_param(backend, dtype):
    """lr, grad_scale, found_inf and clip_coef as ``[1]`` tensors (taken: one element) beside a 0-d param: the
    definition (the reference's path for half-precision CPU params) broadcast the param's update to ``[1]`` and
    failed copying it back, after the params before it had been stepped."""
    device = default_device(backend)
    g = torch.Generator().manual_seed(0)

    def run(shape):
        params = [torch.randn(4, generator=g).to(device, dtype), torch.tensor(1.5).to(device, dtype)]
        grads = [torch.randn(4, generator=g).to(device, dtype), torch.tensor(0.25).to(device, dtype)]
        one = lambda v: torch.full(shape, v, device=device)  # noqa: E731
        buffers = [None, None]
        with forced_strict(backend):
            for _ in range(2):  # the first step makes the buffers, the second reads them
                portable_ops.functional.sgd(params, grads, buffers, lr=one(0.1), momentum=0.9, grad_scale=one(2.0),
                                            found_inf=one(0.0), clip_coef=one(0.5))
        assert all(b is not None and b.shape == p.shape for b, p in zip(buffers, params))
        return params + buffers

    g.manual_seed(0)
    want = run(())
    g.manual_seed(0)
    got = run((1,))
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b)


def test_register_again_after_this_module_was_reloaded(monkeypatch):
    """importlib.reload (a notebook's autoreload) of the integration makes new functions, and leaves transformers
    holding the old ones under the registered name: register() refused that name as "already registered" to
    portable_ops' own function, so the mask path could not be set up again."""
    pytest.importorskip("transformers", minversion="5.0")
    from transformers import AttentionInterface, AttentionMaskInterface

    from portable_ops.integrations import transformers as integration

    name = "portable_ops_hostile_reload"
    for interface, ours in ((AttentionInterface, integration.attention_forward),
                            (AttentionMaskInterface, integration.build_mask)):
        old = types.FunctionType(ours.__code__, ours.__globals__, ours.__name__, ours.__defaults__, ours.__closure__)
        old.__qualname__, old.__module__ = ours.__qualname__, ours.__module__
        monkeypatch.setitem(interface._global_mapping, name, old)  # removed again when the test ends
    assert integration.register(name) == name
    assert AttentionMaskInterface._global_mapping[name] is integration.build_mask
    monkeypatch.setitem(AttentionInterface._global_mapping, name, lambda *a, **k: None)  # someone else's
    with pytest.raises(ValueError, match="already registered"):
        integration.register(name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_adam_takes_one_element_tensors_of_shape_1_with_a_0d_param(backend):
    """As for SGD: lr, grad_scale and clip_coef of shape [1] beside a 0-d param. The reference runs the
    definition for bfloat16 params with float32 state, which failed writing the 0-d param's [1] update back."""
    device = default_device(backend)

    def run(shape):
        g = torch.Generator().manual_seed(0)
        params = [torch.randn(4, generator=g).to(device, torch.bfloat16), torch.tensor(1.5).to(device, torch.bfloat16)]
        grads = [torch.randn(4, generator=g).to(device, torch.bfloat16), torch.tensor(0.25).to(device, torch.bfloat16)]
        moments = [[torch.zeros(p.shape, device=device) for p in params] for _ in range(2)]
        steps = [torch.zeros((), device=device) for _ in params]
        one = lambda v: torch.full(shape, v, device=device)  # noqa: E731
        with forced_strict(backend):
            portable_ops.functional.adam(params, grads, *moments, [], steps, lr=one(0.1), grad_scale=one(2.0),
                                         found_inf=torch.zeros((), device=device),  # triton's takes 0-d only
                                         clip_coef=one(0.5), state_dtype=torch.float32,
                                         decoupled_weight_decay=True, weight_decay=0.1)
        return params + moments[0] + moments[1]

    for got, want in zip(run((1,)), run(())):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sgd_refuses_a_param_swapped_for_an_expanded_view_after_caching(backend, recwarn):
    """Model surgery after the optimizer cached its lists: ``p.data = <expanded view>`` of the same shape. The step
    (the reference's definition, where the others decline such a param) failed on it after stepping the params
    before it; it is now refused first, every tensor as it was."""
    device = default_device(backend)
    a = torch.nn.Parameter(torch.randn(4, device=device))
    e = torch.nn.Parameter(torch.randn(3, 4, device=device))
    opt = portable_ops.optim.SGD([a, e], lr=0.1, momentum=0.9)
    a.grad, e.grad = torch.randn(4, device=device), torch.randn(3, 4, device=device)
    with portable_ops.use_backend(backend):
        opt.step()
        e.data = torch.randn(1, 4, device=device).expand(3, 4)
        before = [a.detach().clone(), opt.state[a]["momentum_buffer"].clone()]
        with pytest.raises(ValueError, match=r"params\[1\] has elements that share memory"):
            opt.step()  # triton and nki decline it (not contiguous): the reference refuses it
    assert torch.equal(a.detach(), before[0]) and torch.equal(opt.state[a]["momentum_buffer"], before[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_adam_refuses_an_expanded_param_before_writing_any(backend, recwarn):
    """As for SGD: an expanded param failed inside Adam's step (the reference's definition, where triton and nki
    decline it) after the params before it were stepped and their state made; refused first now, both when the
    optimizer first sees it and when a param's .data is swapped for one after the lists were cached."""
    device = default_device(backend)
    a = torch.nn.Parameter(torch.randn(4, device=device))
    e = torch.nn.Parameter(torch.randn(1, 4, device=device).expand(3, 4))
    a.grad, e.grad = torch.randn(4, device=device), torch.randn(3, 4, device=device)
    opt = portable_ops.optim.AdamW([a, e], lr=0.1)
    before = a.detach().clone()
    with portable_ops.use_backend(backend):
        with pytest.raises(ValueError, match=r'param_groups\[0\]\["params"\]\[1\] has elements that share memory'):
            opt.step()
        assert torch.equal(a.detach(), before) and not opt.state
        e.data = torch.randn(3, 4, device=device)
        opt.step()
        e.data = torch.randn(1, 4, device=device).expand(3, 4)
        before = [a.detach().clone(), *(t.clone() for t in opt.state[a].values())]
        with pytest.raises(ValueError, match=r"params\[1\] has elements that share memory"):
            opt.step()
    assert all(torch.equal(x, y) for x, y in zip(before, [a.detach(), *opt.state[a].values()]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_scale_and_found_inf_of_shape_one_are_taken(backend):
    """Older GradScalers hand ``[1]`` tensors; the triton and reference kernels took only ``[]`` and raised a raw
    shape error mid-call."""
    device = default_device(backend)
    results = []
    for shape in ((), (1,)):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 6, device=device))
        p.grad = torch.linspace(2, -2, 6, device=device)
        opt = portable_ops.optim.AdamW([p], lr=0.1)
        opt.grad_scale, opt.found_inf = torch.full(shape, 4.0, device=device), torch.zeros(shape, device=device)
        with forced_strict(backend):
            opt.step()
        results.append(p.detach().clone())
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)


# ----------------------------------------------------------------------------- linear cross-entropy

@pytest.mark.parametrize("swap", ["new_tensor", "same_memory_new_strides"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_cross_entropy_checks_a_target_whose_data_was_swapped(backend, swap):
    """A target's values are checked once per version; ``target.data = ...`` keeps the version counter, so a
    swapped-in target holding a class past V went unchecked and the triton kernel read logits out of bounds."""
    device = default_device(backend)
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(3, 8, generator=g).to(device), torch.randn(5, 8, generator=g).to(device)
    storage = torch.tensor([0, 4, 1, 99, 2, 3, 0], device=device)
    target = storage[:3]
    with forced_strict(backend):
        portable_ops.linear_cross_entropy(hidden, weight, target)
        target.data = (torch.tensor([4, 99, 0], device=device) if swap == "new_tensor"
                       else storage.as_strided((3,), (3,)))
        with pytest.raises(ValueError, match=r"target\[1\] \(flattened\) is 99"):
            portable_ops.linear_cross_entropy(hidden, weight, target)


@pytest.mark.parametrize("name", ["grad_scale", "found_inf"])
@pytest.mark.parametrize("cls", ["AdamW", "SGD"])
def test_optimizers_name_a_grad_scale_or_found_inf_that_is_not_a_tensor(cls, name):
    """A Python number set as the optimizer's grad_scale or found_inf failed inside the step with
    "'float' object has no attribute 'to'" instead of the checks' error naming it."""
    p = torch.randn(4, requires_grad=True)
    p.grad = torch.randn(4)
    before = p.detach().clone()
    opt = getattr(portable_ops.optim, cls)([p], lr=0.1)
    setattr(opt, name, 1.0)
    with pytest.raises(TypeError, match=f"{name} must be None or a one-element tensor"):
        opt.step()
    assert torch.equal(p.detach(), before) and not opt.state[p]


class _BiasedRMSNorm(torch.nn.Module):
    """transformers-like RMSNorm plus a bias its forward adds: made with a zero bias, it computes Llama's formula."""

    def __init__(self, width):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))
        self.bias = torch.nn.Parameter(torch.zeros(width))
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states):
        return F.rms_norm(hidden_states, (hidden_states.shape[-1],), self.weight, self.variance_epsilon) + self.bias


class _SquaredWeightRMSNorm(_BiasedRMSNorm):
    """Scales by weight twice: with a weight of ones it too computes Llama's formula."""

    def forward(self, hidden_states):
        return F.rms_norm(hidden_states, (hidden_states.shape[-1],), self.weight, self.variance_epsilon) * self.weight


@pytest.mark.parametrize("cls", [_BiasedRMSNorm, _SquaredWeightRMSNorm], ids=["bias", "weight_twice"])
def test_patch_leaves_a_norm_that_matches_llama_only_at_its_initial_values(cls):
    """patch() told the formulas apart by running the module with its own parameters: a bias still zero or a
    weight still ones passed as Llama's formula, and once trained the patched model silently dropped the bias
    (or the second weight)."""
    from portable_ops.integrations.transformers import patch

    model = torch.nn.Sequential(cls(8))
    done = patch(model)
    assert done["rms_norm"] == [] and "neither" in done["left"]["0"]
    with torch.no_grad():
        model[0].weight.fill_(2.0)
        model[0].bias.fill_(1.0)
    x = torch.randn(3, 8)
    torch.testing.assert_close(model(x), cls.forward(model[0], x))


class _ResidualRMSNorm(_BiasedRMSNorm):
    def forward(self, hidden_states, residual):
        return F.rms_norm(hidden_states + residual, (hidden_states.shape[-1],), self.weight, self.variance_epsilon)


class _ScaledRMSNorm(_BiasedRMSNorm):
    def forward(self, hidden_states, scale=1.0):
        return F.rms_norm(hidden_states, (hidden_states.shape[-1],), self.weight, self.variance_epsilon) * scale


@pytest.mark.parametrize("cls", [_ResidualRMSNorm, _ScaledRMSNorm], ids=["required", "optional"])
def test_patch_leaves_a_norm_whose_forward_takes_more_than_x(cls):
    """patch() probed forward(x) alone: a forward with a required second argument made patch() itself raise
    TypeError; one with an optional argument was taken, and the patched model's calls passing it then failed."""
    from portable_ops.integrations.transformers import patch

    model = torch.nn.Sequential(cls(8))
    done = patch(model)
    assert done["rms_norm"] == [] and "other arguments" in done["left"]["0"]
    x = torch.randn(3, 8)
    torch.testing.assert_close(model[0](x, x), cls.forward(model[0], x, x))


# ----------------------------------------------------------------------------- rope

def _rope_tables(seq, rotary):
    angles = torch.randn(seq, rotary // 2, generator=torch.Generator().manual_seed(1)).repeat(1, 2)
    return angles.cos(), angles.sin()


def _rotated_half(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_inplace_runs_under_vmap_and_still_refuses_an_expanded_batch(backend):
    """docs/api.md: rope_ under torch.func. Under vmap its check for elements sharing memory called
    torch._debug_has_internal_overlap on a batched tensor, which has no batching rule: every vmapped rope_ raised."""
    device = default_device(backend)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 1, 2, 4, 8, generator=g).to(device), torch.randn(3, 1, 1, 4, 8, generator=g).to(device)
    cos, sin = (t.to(device) for t in _rope_tables(4, 8))
    want_q, want_k = _rotated_half(q, cos, sin), _rotated_half(k, cos, sin)
    with forced_strict(backend), torch.no_grad():
        torch.vmap(lambda a, b: portable_ops.rope_(a, b, cos, sin))(q, k)
        torch.testing.assert_close((q, k), (want_q, want_k))
        expanded = torch.randn(1, 1, 2, 4, 8, generator=g).to(device).expand(3, 1, 2, 4, 8)
        with pytest.raises(ValueError, match="q has elements that share memory"):
            torch.vmap(lambda a, b: portable_ops.rope_(a, b, cos, sin))(expanded, k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_cross_entropy_takes_a_hidden_size_of_zero(backend):
    """F.linear over H = 0 gives the bias (or zeros) as logits; the definition, which empty inputs take, reshaped
    hidden with -1 rows, which torch can't infer from zero elements, and raised a reshape error."""
    device = default_device(backend)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, 0, generator=g).to(device).requires_grad_()
    weight = torch.randn(5, 0, generator=g).to(device).requires_grad_()
    bias = torch.randn(5, generator=g).to(device).requires_grad_()
    target = torch.tensor([[0, 4, -100], [1, 1, 3]], device=device)
    with forced_strict(backend):
        loss = portable_ops.linear_cross_entropy(hidden, weight, target, bias=bias, label_smoothing=0.1)
        loss.backward()
    leaf = bias.detach().requires_grad_()
    want = F.cross_entropy(F.linear(hidden.detach(), weight.detach(), leaf).reshape(6, 5), target.reshape(6),
                           label_smoothing=0.1)
    want.backward()
    torch.testing.assert_close((loss, bias.grad), (want, leaf.grad))
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape


@pytest.mark.parametrize("ignore_index", [2**63, -(2**63) - 1])
def test_linear_cross_entropy_names_an_ignore_index_past_int64(ignore_index):
    """An ignore_index no int64 target can hold passed the checks and failed later with OverflowError "int too big to
    convert", naming nothing."""
    hidden, weight, target = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="ignore_index must fit in int64"):
        portable_ops.linear_cross_entropy(hidden, weight, target, ignore_index=ignore_index)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_inplace_refuses_q_and_k_sharing_some_heads(backend):
    """q and k overlapping in a head but starting apart (base[:, 0:2] and base[:, 1:3]) passed the same-start
    check, and rope_ rotated the shared head twice on every backend; slices of one fused projection still pass."""
    device = default_device(backend)
    base = torch.randn(1, 3, 4, 8, device=device)
    cos, sin = torch.randn(4, 8, device=device), torch.randn(4, 8, device=device)
    before = base.clone()
    with forced_strict(backend), pytest.raises(ValueError, match="share memory"):
        portable_ops.rope_(base[:, 0:2], base[:, 1:3], cos, sin)
    assert torch.equal(base, before)
    fused = torch.randn(1, 4, 5, 8, device=device)  # [B, S, Hq + Hk, D]: q and k its transposed slices
    q, k = fused[:, :, :3].transpose(1, 2), fused[:, :, 3:].transpose(1, 2)
    want = portable_ops.rope(q, k, cos, sin)
    with forced_strict(backend):
        portable_ops.rope_(q, k, cos, sin)
    torch.testing.assert_close((q, k), want)
