import dataclasses
import os
import types
import warnings

import pytest
import torch

import portable_ops
from portable_ops import dispatch


def qkv(sq=8, skv=8, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 2, sq, d, generator=g, dtype=dtype), torch.randn(1, 2, skv, d, generator=g, dtype=dtype),
            torch.randn(1, 2, skv, d, generator=g, dtype=dtype))


def test_cpu_tensors_default_to_reference_and_say_why_not_others():
    choice = portable_ops.explain(portable_ops.attention, *qkv())
    assert choice.backend == "reference" and not choice.is_fallback
    text = str(choice)
    assert "runs on 'reference'" in text
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # else (a GPU machine) triton can't take CPU tensors
    assert ("triton: not used: not the default for cpu tensors" if interpreted else
            "triton: not used: CPU tensors need the Triton interpreter") in text
    assert "use_backend('nki')" in text


def test_preference_by_device_type():
    assert dispatch.preference(torch.device("cuda")) == ["triton", "reference"]
    # The native Neuron device registers through privateuseone under the name "neuron"; only .type is read.
    assert dispatch.preference(types.SimpleNamespace(type="neuron")) == ["nki", "reference"]
    assert dispatch.preference(torch.device("xla")) == ["reference"]  # PyTorch/XLA's torch-neuronx: not nki's
    assert dispatch.preference(torch.device("cpu")) == ["reference"]


def test_use_backend_forces_and_nests(fake_backend):
    fake_backend("triton")
    with portable_ops.use_backend("triton"):
        assert portable_ops.explain("attention", *qkv()).backend == "triton"
        with portable_ops.use_backend("reference"):
            assert portable_ops.explain("attention", *qkv()).backend == "reference"
        assert portable_ops.explain("attention", *qkv()).backend == "triton"
    assert portable_ops.explain("attention", *qkv()).backend == "reference"


def test_env_var_forces_backend(fake_backend, monkeypatch):
    fake_backend("nki")
    monkeypatch.setenv("PORTABLE_OPS_BACKEND", "nki")
    assert portable_ops.explain("attention", *qkv()).backend == "nki"
    monkeypatch.setenv("PORTABLE_OPS_BACKEND", "cuda-magic")
    with pytest.raises(ValueError, match="PORTABLE_OPS_BACKEND='cuda-magic'"):
        portable_ops.explain("attention", *qkv())


def test_unknown_backend_name_is_rejected():
    with pytest.raises(ValueError, match="unknown backend 'cudnn'"):
        with portable_ops.use_backend("cudnn"):
            pass


def test_fallback_warns_once_with_the_reason_and_runs_reference(fake_backend):
    fake_backend("triton", reasons=["head_dim 16 is too small"])
    q, k, v = qkv()
    with portable_ops.use_backend("triton"):
        with pytest.warns(portable_ops.FallbackWarning, match="head_dim 16 is too small"):
            out = portable_ops.attention(q, k, v)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a second identical fallback stays quiet
            portable_ops.attention(q, k, v)
        choice = portable_ops.explain("attention", q, k, v)
    assert choice.is_fallback and choice.backend == "reference"
    assert choice.rejected["triton"] == ["head_dim 16 is too small"]
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v))


def test_strict_mode_turns_fallback_into_an_error(fake_backend, monkeypatch):
    fake_backend("triton", reasons=["float64 is not supported"])
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")
    params = [torch.zeros(3)]
    before = params[0].clone()
    with portable_ops.use_backend("triton"):
        with pytest.raises(portable_ops.BackendUnavailableError, match="float64 is not supported.*STRICT"):
            portable_ops.functional.adam(params, [torch.ones(3)], [torch.zeros(3)], [torch.zeros(3)], [],
                                         [torch.zeros(())])
    assert torch.equal(params[0], before)


def test_backend_that_does_not_run_on_the_device_is_passed_over(fake_backend):
    fake_backend("triton", devices=("cuda",))
    with portable_ops.use_backend("triton"):
        choice = portable_ops.explain("attention", *qkv())
    assert choice.backend == "reference"
    assert choice.rejected["triton"] == ["triton runs on cuda tensors; not on cpu"]


def test_backend_missing_an_op_is_passed_over(fake_backend):
    fake_backend("nki", ops=("adam",))
    with portable_ops.use_backend("nki"):
        choice = portable_ops.explain("attention", *qkv())
    assert choice.rejected["nki"] == ["nki does not implement attention_fwd"]


def test_backward_runs_on_the_forward_backend_or_falls_back(fake_backend):
    fake_backend("triton", ops=("attention_fwd",))
    q, k, v = (t.requires_grad_(True) for t in qkv())
    with portable_ops.use_backend("triton"):
        out = portable_ops.attention(q, k, v, causal=True)
    with pytest.warns(portable_ops.FallbackWarning, match="triton does not implement attention_bwd"):
        out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_a_backend_that_fails_to_import_is_reported_not_raised(monkeypatch):
    monkeypatch.setitem(dispatch._import_errors, "nki", "portable_ops.backends.nki failed to load: boom")
    monkeypatch.delitem(dispatch._backends, "nki", raising=False)
    assert "boom" in dispatch.unavailable_reason("nki")
    with portable_ops.use_backend("nki"):
        choice = portable_ops.explain("attention", *qkv())
    assert choice.backend == "reference" and "boom" in choice.rejected["nki"][0]


def test_explain_names_unknown_ops():
    with pytest.raises(ValueError, match="unknown op 'softmax'"):
        portable_ops.explain("softmax")


def test_layout_memo_reuses_a_choice_but_not_a_fallback(fake_backend, monkeypatch):
    built = []

    def make_call():
        built.append(1)
        return dict(q=torch.empty(1, 1, 4, 16), k=torch.empty(1, 1, 4, 16), v=torch.empty(1, 1, 4, 16),
                    causal=False, scale=0.25)

    layout = ("a layout only this test uses",)
    cpu = torch.device("cpu")
    fake_backend("triton")
    with portable_ops.use_backend("triton"):
        assert dispatch.select_by_layout("attention_fwd", layout, make_call, cpu).backend == "triton"
        assert dispatch.select_by_layout("attention_fwd", layout, make_call, cpu).backend == "triton"
    assert len(built) == 1  # the second call was served from the memo
    assert dispatch.select_by_layout("attention_fwd", layout, make_call, cpu).backend == "reference"  # not forced
    fake_backend("triton", reasons=["declines everything"])  # a new backend object: a new memo key
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")
    with portable_ops.use_backend("triton"):
        for _ in range(2):  # a fallback is decided afresh each time, so strict mode refuses each time
            with pytest.raises(dispatch.BackendUnavailableError, match="declines everything"):
                dispatch.select_by_layout("attention_fwd", layout, make_call, cpu)


def test_fallback_warnings_point_at_the_users_line():
    """Not at the library frame that happened to call dispatch (attention.py, distributed.py, torch's
    contextlib): the warning names the line of user code that made the call."""
    import warnings

    dispatch._warned.clear()
    q = torch.randn(1, 2, 4, 16, dtype=torch.float64, requires_grad=True)
    p = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    p.grad = torch.randn(3, dtype=torch.float64)
    opt = portable_ops.optim.AdamW([p])
    with warnings.catch_warnings(record=True) as caught, portable_ops.use_backend("nki"):
        warnings.simplefilter("always")
        out = portable_ops.attention(q, q, q)
        out.sum().backward()
        portable_ops.clip_grad_norm_([p], 1.0, norm_type=3)
        opt.step()
    fallbacks = [w for w in caught if issubclass(w.category, portable_ops.FallbackWarning)]
    assert len(fallbacks) >= 4, [str(w.message) for w in fallbacks]
    assert {w.filename for w in fallbacks} == {__file__}, [(w.filename, w.lineno) for w in fallbacks]


def test_strict_mode_error_carries_the_choice(fake_backend, monkeypatch):
    fake_backend("triton", reasons=["no kernel for this test"])
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")
    with portable_ops.use_backend("triton"), pytest.raises(portable_ops.BackendUnavailableError) as caught:
        portable_ops.attention(*qkv())
    error = caught.value
    assert (error.op, error.preferred, error.backend) == ("attention_fwd", "triton", "reference")
    assert error.reasons == error.choice.rejected["triton"] == ["no kernel for this test"]


def test_declared_limits_give_the_generic_reasons(monkeypatch):
    """dtypes, head dims and features declared as data: dispatch words the refusals, supports adds its own."""
    impl = dispatch.OpImpl(run=print, dtypes=(torch.float16,), max_head_dim=8, features=("causal",),
                           supports=lambda call: ["a limit of this stand-in's own"])
    backend = dispatch.Backend(name="triton", devices=("cuda",), cpu_runner="the test", ops={"attention_fwd": impl})
    monkeypatch.setitem(dispatch._backends, "triton", backend)
    with portable_ops.use_backend("triton"):
        choice = portable_ops.explain("attention", *qkv(), window=(2, 3), softcap=5.0)
    assert choice.rejected["triton"] == ["float32 is not supported (float16 is)",
                                         "head_dim 16 is over 8, the largest the triton kernels take",
                                         "window=(2, 3) is not supported", "softcap=5 is not supported",
                                         "a limit of this stand-in's own"]
    assert backend.device_reasons(torch.device("mps")) == [
        "triton runs on cuda tensors, and on CPU tensors in the test; not on mps"]


def test_the_preference_reads_each_backends_declared_devices(fake_backend):
    fake_backend("nki", devices=("cpu", "mps"))  # a stand-in declaring mps as its device type
    assert dispatch.preference(torch.device("mps")) == ["nki", "reference"]
    assert dispatch.preference(torch.device("xla")) == ["reference"]



def test_a_backend_may_leave_eager_calls_to_the_next_without_a_fallback(fake_backend, monkeypatch):
    """``OpImpl.defer_eager``: the next backend runs the eager call, which is no fallback (strict mode allows it,
    explain says why); a forced backend and a call torch.compile traces are not deferred."""
    stand_in = fake_backend("triton", devices=("meta",), ops=("rms_norm_fwd",))
    stand_in.ops["rms_norm_fwd"] = dataclasses.replace(
        stand_in.ops["rms_norm_fwd"], defer_eager=lambda call: ["torch's kernel"] if call["residual"] is None else [])
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")
    x, w = torch.empty(4, 8, device="meta"), torch.empty(8, device="meta")
    call = dict(x=x, residual=None, weight=w, eps=1e-6)
    choice = dispatch.select("rms_norm_fwd", call, x.device)
    assert (choice.backend, choice.is_fallback, choice.rejected["triton"]) == ("reference", False, ["torch's kernel"])
    assert "triton: not used: torch's kernel" in str(choice)
    assert dispatch.select("rms_norm_fwd", dict(call, residual=x), x.device).backend == "triton"
    with portable_ops.use_backend("triton"):
        assert dispatch.select("rms_norm_fwd", call, x.device).backend == "triton"
    stand_in.ops["rms_norm_fwd"] = dataclasses.replace(stand_in.ops["rms_norm_fwd"], traced=lambda: "stand_in_fwd")
    tensors = (("x", (1, 8), torch.float32), ("residual", (1, 8), None), ("weight", (8,), torch.float32))
    assert dispatch.traced_op("rms_norm_fwd", tensors, (("eps", 1e-6),), x.device, None) == "stand_in_fwd"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert dispatch.select("rms_norm_fwd", call, x.device).backend == "triton"


def test_a_backend_may_leave_traced_calls_to_the_next_whose_torch_ops_the_graph_traces_in(fake_backend):
    """``OpImpl.defer_traced``: while torch.compile traces a call, the next backend is chosen (its ``OpImpl.autograd``
    torch ops are traced in, no traced op of the stand-in); a forced backend and a call it keeps are not deferred."""
    stand_in = fake_backend("triton", devices=("meta",), ops=("rms_norm_fwd",))
    stand_in.ops["rms_norm_fwd"] = dataclasses.replace(
        stand_in.ops["rms_norm_fwd"], traced=lambda: "stand_in_fwd",
        defer_traced=lambda call: ["Inductor fuses torch's norm"] if call["residual"] is None else [])
    device, rows, eps = torch.device("meta"), (1, 8), (("eps", 1e-6),)
    plain = (("x", rows, torch.float32), ("residual", rows, None), ("weight", (8,), torch.float32))
    with_residual = (("x", rows, torch.float32), ("residual", rows, torch.float32), ("weight", (8,), torch.float32))
    assert dispatch.traced_op("rms_norm_fwd", plain, eps, device, None) is None
    assert dispatch.traced_backend("rms_norm_fwd", plain, eps, device, None) == "reference"
    assert dispatch.traced_op("rms_norm_fwd", plain, eps, device, "triton") == "stand_in_fwd"
    assert dispatch.traced_op("rms_norm_fwd", with_residual, eps, device, None) == "stand_in_fwd"
    x, w = torch.empty(4, 8, device="meta"), torch.empty(8, device="meta")
    assert dispatch.select("rms_norm_fwd", dict(x=x, residual=None, weight=w, eps=1e-6), device).backend == "triton"
