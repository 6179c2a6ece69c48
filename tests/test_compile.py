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
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


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


def test_use_backend_inside_a_traced_function_says_where_it_belongs(fake_backend):
    """The compiled ops dispatch when the graph runs, outside a block entered while tracing: under fullgraph the
    trace stops with that said; without it the block runs eagerly, on the backend it forces."""
    calls = []
    stand_in = fake_backend("triton")
    run = stand_in.ops["attention_fwd"].run
    stand_in.ops["attention_fwd"] = dispatch.OpImpl(run=lambda **call: calls.append("triton") or run(**call))

    def body(q, k, v):
        with portable_ops.use_backend("triton"):
            return portable_ops.attention(q, k, v, causal=True)

    q, k, v = inputs("contiguous", torch.device("cpu"))
    with pytest.raises(Exception, match="use_backend.*inside a function torch.compile traces"):
        torch.compile(body, backend="aot_eager", fullgraph=True)(q, k, v)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(body, backend="aot_eager")(q, k, v), body(q, k, v))
    assert calls == ["triton", "triton"]


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


# ----------------------------------------------------------------------------- issue 12: window, softcap, varlen, paged

def test_window_and_softcap_ops_pass_opcheck():
    for kind in LAYOUTS:
        q, k, v = inputs(kind, torch.device("cpu"))
        for window, softcap in (((3, 2), None), ((None, 5), 30.0), ((4, None), 2.0)):
            args = (q, k, v, False, 0.25, *window, softcap)
            torch.library.opcheck(torch.ops.portable_ops.attention_fwd.default, args)
            out, lse = torch.ops.portable_ops.attention_fwd.default(*args)
            assert out.stride() == layout.strides_like(q)
            torch.library.opcheck(torch.ops.portable_ops.attention_bwd.default,
                                  (q, k, v, out, lse, inputs(kind, torch.device("cpu"), seed=1)[0], *args[3:]))


def window_softcap_step(x, w, left):
    """model_step with a sliding window (its left side an argument: dynamic under dynamic=True) and a softcap."""
    b, s, _ = x.shape
    q, k, v = (x @ w).view(b, s, 8, 32).split([4, 2, 2], dim=2)
    y = portable_ops.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window=(left, 2), softcap=30.0)
    return y.transpose(1, 2).reshape(b, s, -1).square().mean()


def test_window_and_softcap_compile_without_breaks_or_recompiles():
    compiled = torch.compile(window_softcap_step, backend="aot_eager", fullgraph=True, dynamic=True)
    for s, left in ((9, 3), (17, 5), (33, 0)):
        g = torch.Generator().manual_seed(s)
        x = torch.randn(2, s, 64, generator=g, requires_grad=True)
        w = (torch.randn(64, 256, generator=g) / 2).requires_grad_()  # scores large enough for the cap to bend
        got, want = compiled(x, w, left), window_softcap_step(x, w, left)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for a, b in zip(torch.autograd.grad(got, (x, w)), torch.autograd.grad(want, (x, w))):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1


def packed_qkv(lens, hq=4, hkv=2, d=16, seed=0):
    """q, k, v sliced from one fused projection ``[T, Hq + 2 Hkv, D]`` (not contiguous), and the offsets."""
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(sum(lens), hq + 2 * hkv, d, generator=g, requires_grad=True)
    q, k, v = fused.split([hq, hkv, hkv], dim=1)
    return fused, q, k, v, torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def test_varlen_ops_pass_opcheck():
    _, q, k, v, cu = packed_qkv([5, 0, 11])
    q, k, v = (t.detach() for t in (q, k, v))
    for options in ((False, 0.3, None, None, None), (True, 0.3, 3, None, 20.0), (False, 0.3, 2, 4, None)):
        args = (q, k, v, cu, cu, 11, 11, *options)
        torch.library.opcheck(torch.ops.portable_ops.attention_varlen_fwd.default, args)
        out, lse = torch.ops.portable_ops.attention_varlen_fwd.default(*args)
        torch.library.opcheck(torch.ops.portable_ops.attention_varlen_bwd.default,
                              (q, k, v, out, lse, torch.randn_like(out), *args[3:]))


def varlen_step(q, k, v, cu, longest):
    return portable_ops.attention_varlen(q, k, v, cu, cu, longest, longest, causal=True, window=(6, None),
                                         softcap=20.0).square().sum()


def test_varlen_compiles_without_breaks_or_recompiles_and_checks_offsets_when_it_runs():
    """Token and sequence counts chosen apart from the head counts and dim (torch's duck sizing would
    otherwise tie equal sizes together in the first graph, and recompile when they part)."""
    compiled = torch.compile(varlen_step, backend="aot_eager", fullgraph=True, dynamic=True)
    for lens in ([5, 0, 12, 1, 3], [17, 3], [2, 9, 9, 30, 1, 1]):
        fused, q, k, v, cu = packed_qkv(lens)
        got, want = compiled(q, k, v, cu, max(lens)), varlen_step(q, k, v, cu, max(lens))
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(torch.autograd.grad(got, fused)[0], torch.autograd.grad(want, fused)[0])
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1
    bad = torch.tensor([0, 20, 9, 32], dtype=torch.int32)  # a shape the graph takes, offsets it must refuse
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        compiled(q[:32], k[:32], v[:32], bad, 20)


def paged_tables(batch, page_size=8, pages_each=4, hkv=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    pool = torch.randperm(batch * pages_each + 2, generator=g)
    table = pool[:batch * pages_each].view(batch, pages_each).to(torch.int32)
    caches = [torch.randn(len(pool), page_size, hkv, 16, generator=g) for _ in range(2)]
    return *caches, table


def test_paged_ops_pass_opcheck():
    k_cache, v_cache, table = paged_tables(2)
    lens = torch.tensor([5, 13], dtype=torch.int32)
    for window, softcap in (((None, None), None), ((4, None), 30.0)):
        torch.library.opcheck(torch.ops.portable_ops.paged_attention.default,
                              (torch.randn(2, 3, 4, 16), k_cache, v_cache, table, lens, 0.25, *window, softcap))
    torch.library.opcheck(torch.ops.portable_ops.paged_kv_append.default,
                          (k_cache, v_cache, table, lens, torch.randn(2, 3, 2, 16), torch.randn(2, 3, 2, 16)))


def decode_step(q, k_cache, v_cache, table, lens, k_new, v_new):
    portable_ops.paged_kv_append(k_cache, v_cache, table, lens, k_new, v_new)
    return portable_ops.paged_attention(q, k_cache, v_cache, table, lens + k_new.shape[1], window=(5, None),
                                        softcap=30.0)


def test_paged_decode_compiles_without_breaks_or_recompiles_and_checks_tables_when_it_runs():
    """Append, then attend: speculative steps of 2 and 3 tokens over batches of 5 to 7; q and the new k/v
    transposed out of ``[B, H, S, D]`` (not contiguous). Sizes are chosen apart (torch's duck sizing ties
    equal ones together), and Sq = 1 is left out: torch specialises size-1 dimensions, so it would be a graph
    of its own."""
    compiled = torch.compile(decode_step, backend="aot_eager", fullgraph=True, dynamic=True)
    hq, hkv = 6, 3
    with torch.no_grad():
        for batch, sn in ((5, 2), (7, 3), (6, 2)):
            k_cache, v_cache, table = paged_tables(batch, hkv=hkv, seed=batch)
            lens = torch.tensor([1, 7, 12, 0, 29, 20, 9][:batch], dtype=torch.int32)
            g = torch.Generator().manual_seed(sn)
            q = torch.randn(batch, hq, sn, 16, generator=g).transpose(1, 2)
            k_new, v_new = (torch.randn(batch, hkv, sn, 16, generator=g).transpose(1, 2) for _ in range(2))
            caches = [k_cache.clone(), v_cache.clone()]
            got = compiled(q, k_cache, v_cache, table, lens, k_new, v_new)
            want = decode_step(q, *caches, table, lens, k_new, v_new)
            torch.testing.assert_close(got, want)
            assert torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])
        assert sum(counters["graph_break"].values()) == 0
        assert counters["stats"]["unique_graphs"] == 1
        before = [k_cache.clone(), v_cache.clone()]
        too_long = torch.tensor([1, 7, 31, 0, 29, 20], dtype=torch.int32)
        with pytest.raises(ValueError, match=r"cache_seqlens\[2\] \+ 2 new tokens = 33 exceeds the 32 positions"):
            compiled(q, k_cache, v_cache, table, too_long, k_new, v_new)
        assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_inductor_keeps_the_appends_in_place():
    """Inductor functionalises the mutating append and writes it back into the caches: they must hold
    what eager writes."""
    compiled = torch.compile(decode_step, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for batch, sn in ((5, 2), (7, 3)):
            k_cache, v_cache, table = paged_tables(batch, hkv=3, seed=batch)
            lens = torch.tensor([1, 7, 12, 0, 29, 20, 9][:batch], dtype=torch.int32)
            q = torch.randn(batch, 6, sn, 16).transpose(1, 2)
            k_new, v_new = (torch.randn(batch, 3, sn, 16).transpose(1, 2) for _ in range(2))
            caches = [k_cache.clone(), v_cache.clone()]
            torch.testing.assert_close(compiled(q, k_cache, v_cache, table, lens, k_new, v_new),
                                       decode_step(q, *caches, table, lens, k_new, v_new))
            assert torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])
    assert sum(counters["graph_break"].values()) == 0
