"""Property-based tests for the classes of hostile use fixed in the code around the kernels, each on every
backend usable on CPU tensors here (reference natively, triton in the Triton interpreter, nki in the NKI
emulator), so that a class, once fixed, stays fixed: in-place writes bump versions, numpy and tensor options
mean what the Python numbers mean, failed calls leave nothing behind, refusals name the user's tensor."""

import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import portable_ops
from portable_ops.conformance.runner import default_device, forced_strict, usable_backends

CPU_BACKENDS = [b for b in usable_backends() if default_device(b).type == "cpu"]
EXAMPLES = {"reference": 25, "triton": 6, "nki": 6}
attention_module = sys.modules["portable_ops.attention"]


def examples(backend):
    return settings(max_examples=EXAMPLES.get(backend, 6), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


optimizer_configs = st.fixed_dictionaries({
    "sizes": st.lists(st.integers(1, 300), min_size=1, max_size=4),
    "with_grad": st.lists(st.booleans(), min_size=4, max_size=4),
    "amsgrad": st.booleans(), "decoupled": st.booleans(), "max_grad_norm": st.sampled_from([None, 0.5, 1e3]),
    "dtype": st.sampled_from([torch.float32, torch.bfloat16]),
})


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_every_write_of_a_step_bumps_its_tensors_version(backend):
    """Whatever the configuration, a step bumps the version of every param it changes (and of their state), as
    torch's in-place ops do: a graph that saved one of them then refuses its backward."""
    @examples(backend)
    @given(config=optimizer_configs)
    def prop(config):
        g = torch.Generator().manual_seed(len(config["sizes"]))
        params = [torch.nn.Parameter(torch.randn(n, generator=g).to(config["dtype"])) for n in config["sizes"]]
        stepped = [p for p, grad in zip(params, config["with_grad"]) if grad]
        for p in stepped:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        cls = portable_ops.optim.AdamW if config["decoupled"] else portable_ops.optim.Adam
        opt = cls(params, lr=1e-2, amsgrad=config["amsgrad"], max_grad_norm=config["max_grad_norm"])
        with forced_strict(backend):
            opt.step()  # the state exists from here on
            before = {id(t): t._version for p in stepped for t in (p, *opt.state[p].values())}
            opt.step()
        for p in stepped:
            for t in (p, *opt.state[p].values()):
                assert t._version > before[id(t)]
        assert all(p._version == 0 for p, grad in zip(params, config["with_grad"]) if not grad)

    prop()


option_spellings = st.fixed_dictionaries({
    "scale": st.sampled_from([None, 0.3, 2]), "softcap": st.sampled_from([None, 3.0, 30]),
    "left": st.sampled_from([None, 0, 5]), "right": st.sampled_from([None, 0, 3]), "causal": st.booleans(),
    "as_numpy": st.lists(st.sampled_from(["scale", "softcap", "left", "right", "causal"]), unique=True),
    "as_tensor": st.lists(st.sampled_from(["scale", "softcap"]), unique=True),
})


def spelled(value, numpy, tensor):
    if value is None:
        return None
    if tensor:
        return torch.tensor(float(value))
    if numpy:
        return {bool: np.bool_, int: np.int64, float: np.float32}[type(value)](value)
    return value


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_numpy_and_tensor_options_mean_what_python_numbers_mean(backend):
    """Every documented spelling of an option (numpy scalars, one-element tensors) gives the call with the
    Python numbers bit for bit, and a later call with Python numbers is unaffected by the earlier spelling
    (no memo or plan keyed on a value that compares equal across types)."""
    @examples(backend)
    @given(opts=option_spellings)
    def prop(opts):
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(1, h, 9, 16, generator=g) for h in (2, 1, 1))
        window = None if opts["left"] is None and opts["right"] is None else (opts["left"], opts["right"])
        plain = dict(scale=opts["scale"], softcap=opts["softcap"], window=window, causal=opts["causal"])
        other = {name: spelled(opts[name], name in opts["as_numpy"], name in opts["as_tensor"])
                 for name in ("scale", "softcap", "causal")}
        other["window"] = None if window is None else tuple(
            spelled(side, name in opts["as_numpy"], False) for side, name in zip(window, ("left", "right")))
        with forced_strict(backend):
            got = portable_ops.attention(q, k, v, **other)
            want = portable_ops.attention(q, k, v, **plain)
            again = portable_ops.attention(q, k, v, **other)
        assert torch.equal(got, want) and torch.equal(again, want)

    prop()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_failed_call_leaves_no_memo_and_the_next_call_runs(backend, monkeypatch):
    """Any call of any layout that fails inside its backend leaves the front end's memo as it was, and the same
    call then runs."""
    @examples(backend)
    @given(sq=st.integers(1, 12), skv=st.integers(1, 12), grad=st.booleans(), causal=st.booleans())
    def prop(sq, skv, grad, causal):
        q, k, v = (torch.randn(1, 2, s, 16, requires_grad=grad) for s in (sq, skv, skv))
        impl = portable_ops.dispatch.get_backend(backend).ops["attention_fwd"]
        failing = type(impl)(**{**impl.__dict__, "run": _raise, "prepare": None})
        before = dict(attention_module._memo)
        monkeypatch.setitem(portable_ops.dispatch.get_backend(backend).ops, "attention_fwd", failing)
        with forced_strict(backend), pytest.raises(RuntimeError, match="the launch failed"):
            portable_ops.attention(q, k, v, causal=causal)
        assert attention_module._memo == before
        monkeypatch.setitem(portable_ops.dispatch.get_backend(backend).ops, "attention_fwd", impl)
        with forced_strict(backend):
            portable_ops.attention(q, k, v, causal=causal)

    prop()


def _raise(**call):
    raise RuntimeError("the launch failed")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_refusal_names_the_param_as_the_user_holds_it(backend):
    """Whichever params have grads and whichever group holds the bad one, the refusal names its
    ``param_groups[g]["params"][i]``."""
    @examples(backend)
    @given(sizes=st.lists(st.lists(st.integers(1, 8), min_size=1, max_size=4), min_size=1, max_size=3),
           data=st.data())
    def prop(sizes, data):
        groups = [[torch.nn.Parameter(torch.randn(n)) for n in group] for group in sizes]
        g = data.draw(st.integers(0, len(groups) - 1))
        i = data.draw(st.integers(0, len(groups[g]) - 1))
        for group in groups:
            for p in group:
                p.grad = torch.randn_like(p) if data.draw(st.booleans()) else None
        groups[g][i].grad = torch.randn_like(groups[g][i]).to_sparse()
        opt = portable_ops.optim.AdamW([{"params": group} for group in groups])
        with forced_strict(backend), pytest.raises(
                ValueError, match=rf'^param_groups\[{g}\]\["params"\]\[{i}\]\.grad is torch.sparse_coo'):
            opt.step()

    prop()


grid_calls = st.fixed_dictionaries({
    "b": st.integers(1, 6), "hkv": st.integers(1, 3), "group": st.integers(1, 3), "sq": st.integers(1, 20),
    "skv": st.integers(1, 24), "causal": st.booleans(), "window": st.sampled_from([None, (3, None), (5, 2)]),
    "softcap": st.sampled_from([None, 4.0]), "cap": st.integers(2, 5),
})


@pytest.mark.skipif("triton" not in CPU_BACKENDS, reason="needs triton in the interpreter")
def test_any_call_past_a_lowered_grid_cap_equals_the_reference(monkeypatch):
    """With CUDA's grid cap lowered to a handful of programs, any dense call (batch, GQA group, lengths, mask,
    softcap) folds its pairs and gives the reference's output and gradients: past the cap is never a
    fallback, nor a different answer."""
    plans = sys.modules["portable_ops.backends.triton.attention_plans"]

    @examples("triton")
    @given(call=grid_calls)
    def prop(call):
        pairs = call["b"] * call["hkv"] * call["group"]
        assume(call["b"] * call["hkv"] > call["cap"] and pairs <= call["cap"] ** 2)  # past the cap, within the fold
        monkeypatch.setattr(plans, "MAX_GRID_Y", call["cap"])
        for module, memo in ((plans, "fwd_plans"), (plans, "bwd_plans"), (attention_module, "_memo"),
                             (portable_ops.dispatch, "_memo")):
            monkeypatch.setattr(module, memo, {})  # each example's cap is its own: nothing planned under another
        g = torch.Generator().manual_seed(call["b"] * 7 + call["sq"])
        shapes = [(call["b"], call["hkv"] * call["group"], call["sq"], 16)] + [(call["b"], call["hkv"], call["skv"],
                                                                               16)] * 2
        inputs = [torch.randn(shape, generator=g, dtype=torch.float64) for shape in shapes]
        options = dict(causal=call["causal"], window=call["window"], softcap=call["softcap"])
        results = []
        for backend in ("triton", "reference"):
            q, k, v = (t.clone().to(torch.float32).requires_grad_() for t in inputs)
            with forced_strict(backend):
                out = portable_ops.attention(q, k, v, **options)
                grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
            results.append((out, *grads))
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    prop()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_inference_caches_are_refused_alike_outside_inference_mode(backend):
    """Whatever the batch, the new tokens and the page size, appending to an inference-mode cache outside
    inference mode is refused on every backend with one message, and nothing is written."""
    @examples(backend)
    @given(b=st.integers(1, 3), sn=st.integers(1, 3), page=st.sampled_from([1, 4, 16]))
    def prop(b, sn, page):
        pages = b * (-(-(sn + 2) // page))
        with torch.inference_mode():
            caches = [torch.randn(pages, page, 2, 8) for _ in range(2)]
        table = torch.arange(pages, dtype=torch.int32).reshape(b, -1)
        lens = torch.full((b,), 2, dtype=torch.int32)
        new = [torch.randn(b, sn, 2, 8) for _ in range(2)]
        before = [c.clone() for c in caches]
        with portable_ops.use_backend(backend), torch.no_grad(), pytest.raises(
                RuntimeError, match="was made under torch.inference_mode"):
            portable_ops.paged_kv_append(*caches, table, lens, *new)
        assert all(torch.equal(c, w) for c, w in zip(caches, before))

    prop()
