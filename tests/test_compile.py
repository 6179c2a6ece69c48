"""attention under torch.compile and torch.library's checks, on every backend runnable here.

Inputs come in the layouts models make: contiguous, transposed out of ``[B, S, H, D]``, and
sliced from one fused qkv projection. Graph breaks and recompilations are counted: zero breaks,
and no recompilation once shapes are dynamic.
"""

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import portable_ops
from portable_ops import dispatch, layout
from portable_ops.bench.llama import Llama, LlamaConfig, batches
from portable_ops.conformance import usable_backends
from portable_ops.conformance.runner import default_device, forced_strict

BACKENDS = usable_backends()


def inputs(kind, device, dtype=torch.float32, b=2, s=9, hq=4, hkv=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "contiguous":
        make = lambda h: torch.randn(b, h, s, d, generator=g)  # noqa: E731
        q, k, v = make(hq), make(hkv), make(hkv)
    elif kind == "transposed":  # [B, S, H, D] viewed as [B, H, S, D]
        q, k, v = (torch.randn(b, s, h, d, generator=g).transpose(1, 2) for h in (hq, hkv, hkv))
    else:  # sliced from a fused projection [B, S, (Hq + 2 Hkv) * D]
        qkv = torch.randn(b, s, hq + 2 * hkv, d, generator=g)
        q, k, v = (t.transpose(1, 2) for t in qkv.split([hq, hkv, hkv], dim=2))
    return [t.to(device, dtype) if t.device != device or t.dtype != dtype else t for t in (q, k, v)]


LAYOUTS = ["contiguous", "transposed", "sliced"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_layout_rule_follows_the_inputs():
    q, _, _ = inputs("transposed", torch.device("cpu"))
    assert layout.heads_inner(q) and layout.empty_like(q).transpose(1, 2).is_contiguous()
    c, _, _ = inputs("contiguous", torch.device("cpu"))
    assert not layout.heads_inner(c) and layout.empty_like(c).is_contiguous()


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_ops_pass_opcheck(backend, kind):
    device = default_device(backend)
    q, k, v = inputs(kind, device)
    with forced_strict(backend):
        for causal in (False, True):
            torch.library.opcheck(torch.ops.portable_ops.attention_fwd.default, (q, k, v, causal, 0.25))
            out, lse = torch.ops.portable_ops.attention_fwd.default(q, k, v, causal, 0.25)
            assert out.stride() == layout.strides_like(q)
            dout = inputs(kind, device, seed=1)[0]
            torch.library.opcheck(torch.ops.portable_ops.attention_bwd.default,
                                  (q, k, v, out, lse, dout, causal, 0.25))


def model_step(x, w, causal=True):
    """A transformer's attention block: q, k, v sliced from one projection and transposed."""
    b, s, _ = x.shape
    q, k, v = (x @ w).view(b, s, 8, 32).split([4, 2, 2], dim=2)
    y = portable_ops.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
    return y.transpose(1, 2).reshape(b, s, -1).square().mean()


def _check_against_eager(compiled, s, device):
    g = torch.Generator().manual_seed(s)
    x = torch.randn(2, s, 64, generator=g).to(device).requires_grad_()
    w = (torch.randn(64, 256, generator=g) / 8).to(device).requires_grad_()
    loss = compiled(x, w)
    grads = torch.autograd.grad(loss, (x, w))
    expected = model_step(x, w)
    expected_grads = torch.autograd.grad(expected, (x, w))
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_forward_and_backward_dynamic_shapes_without_breaks_or_recompiles(backend):
    device = default_device(backend)
    compiled = torch.compile(model_step, backend="aot_eager", fullgraph=True, dynamic=True)
    with forced_strict(backend):
        for s in (9, 17, 33):
            _check_against_eager(compiled, s, device)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1  # one graph served every sequence length


def test_automatic_dynamic_shapes_recompile_once():
    compiled = torch.compile(model_step, backend="aot_eager", fullgraph=True)
    for s in (9, 17, 33, 12):
        _check_against_eager(compiled, s, torch.device("cpu"))
    assert counters["stats"]["unique_graphs"] == 2  # static for the first length, then one dynamic graph


def test_a_scale_that_changes_between_calls_compiles_like_sdpa():
    """fullgraph holds; each new scale value is one more graph, as SDPA's float scale is; a bad
    value is refused with the eager error when the graph runs."""
    import torch.nn.functional as F

    q, k, v = inputs("transposed", torch.device("cpu"))
    ours = torch.compile(lambda q, s: portable_ops.attention(q, k, v, scale=s), backend="aot_eager", fullgraph=True)
    sdpa = torch.compile(lambda q, s: F.scaled_dot_product_attention(q, k, v, scale=s, enable_gqa=True),
                         backend="aot_eager", fullgraph=True)
    scales = (0.1, 0.2, -0.3, 0.0)
    for s in scales:
        torch.testing.assert_close(ours(q, s), portable_ops.attention(q, k, v, scale=s))
    ours_graphs = counters["stats"]["unique_graphs"]
    for s in scales:
        sdpa(q, s)
    assert sum(counters["graph_break"].values()) == 0
    assert ours_graphs == counters["stats"]["unique_graphs"] - ours_graphs
    with pytest.raises(ValueError, match="scale must be finite, got nan"):
        ours(q, float("nan"))


def test_inductor_generates_code_around_the_ops():
    compiled = torch.compile(model_step, fullgraph=True, dynamic=True)
    for s in (9, 20):
        _check_against_eager(compiled, s, torch.device("cpu"))
    assert sum(counters["graph_break"].values()) == 0


def test_backend_is_chosen_when_the_compiled_graph_runs(fake_backend):
    """A graph compiled outside use_backend(...) follows a backend forced later, with no recompilation."""
    calls = []
    stand_in = fake_backend("triton")
    for op in ("attention_fwd", "attention_bwd"):
        run = stand_in.ops[op].run
        stand_in.ops[op] = dispatch.OpImpl(run=lambda run=run, op=op, **call: calls.append(op) or run(**call))
    compiled = torch.compile(model_step, backend="aot_eager", fullgraph=True, dynamic=True)
    x, w = torch.randn(2, 9, 64, requires_grad=True), torch.randn(64, 256, requires_grad=True)
    compiled(x, w).backward()
    assert not calls
    with portable_ops.use_backend("triton"):
        compiled(x, w).backward()
    assert calls == ["attention_fwd", "attention_bwd"]  # the graph compiled before the backend was forced
    assert counters["stats"]["unique_graphs"] == 1


TINY = LlamaConfig(d_model=64, layers=2, heads=4, kv_heads=2, seq=16, batch=2, vocab=128)


def _trainer(model, steps, device):
    """A function running the next of ``steps`` training steps (bf16 autocast, AdamW with a fused clip)."""
    opt = portable_ops.optim.AdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0)
    data = batches(TINY, steps, device)

    def step():
        tokens, targets = next(data)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def test_llama_under_autocast_compiles_whole_and_trains_like_eager():
    device = torch.device("cpu")
    torch.manual_seed(0)
    eager = Llama(TINY).to(device)
    compiled_model = Llama(TINY).to(device)
    compiled_model.load_state_dict(eager.state_dict())
    eager_step, compiled_step = _trainer(eager, 4, device), _trainer(torch.compile(compiled_model, backend="aot_eager",
                                                                                   fullgraph=True), 4, device)
    expected = [eager_step() for _ in range(4)]
    got = [compiled_step() for _ in range(2)]
    with torch._dynamo.config.patch(error_on_recompile=True):  # no recompilation after warm-up
        got += [compiled_step() for _ in range(2)]
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1
    assert max(abs(a - b) for a, b in zip(got, expected)) < 2e-2  # bf16 autocast noise


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_reduce_overhead_mode_on_the_gpu():
    device = torch.device("cuda")
    compiled = torch.compile(model_step, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up runs, then replays of the recorded graph
        _check_against_eager(compiled, 64, device)
    assert sum(counters["graph_break"].values()) == 0
