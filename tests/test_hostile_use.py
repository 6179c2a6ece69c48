"""What a hostile or careless user does around the kernels, on every backend usable here: inference tensors
written outside inference mode, transforms an op has no rule for, optimizer refusals that must name the user's
own tensor."""

import sys

import pytest
import torch
from torch.autograd import forward_ad

import portable_ops
from portable_ops.conformance.runner import default_device, forced_strict, usable_backends

BACKENDS = usable_backends()


def paged_cache(device, batch=2, page_size=4, pages=4, hkv=2, d=8):
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(pages * batch, page_size, hkv, d, generator=g).to(device) for _ in range(2)]
    table = torch.arange(pages * batch, dtype=torch.int32).reshape(batch, pages).to(device)
    return caches, table, torch.tensor([3, 5], dtype=torch.int32, device=device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_appending_to_an_inference_cache_outside_inference_mode_is_refused_alike(backend):
    """A cache made under inference_mode, appended to under no_grad: torch refuses the in-place write, so every
    backend does, kernels that write through raw pointers included, before anything is written."""
    device = default_device(backend)
    with torch.inference_mode():
        (k_cache, v_cache), table, lens = paged_cache(device)
    k_new, v_new = (torch.randn(2, 1, 2, 8, device=device) for _ in range(2))
    before = [k_cache.clone(), v_cache.clone()]
    with portable_ops.use_backend(backend), torch.no_grad(), pytest.raises(
            RuntimeError, match=r"paged_kv_append: k_cache was made under torch.inference_mode\(\)"):
        portable_ops.paged_kv_append(k_cache, v_cache, table, lens, k_new, v_new)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    with portable_ops.use_backend(backend), torch.inference_mode():  # where torch allows it, it runs
        portable_ops.paged_kv_append(k_cache, v_cache, table, lens, k_new, v_new)
    assert torch.equal(k_cache[table[0, 0], 3], k_new[0, 0])


def test_forward_ad_through_an_op_without_its_rule_is_refused_by_name():
    """attention_varlen and paged_attention have no forward-mode rule: a tangent is refused naming the op, never
    dropped (paged_attention's output would otherwise carry none) nor left to torch's generic jvp message."""
    (k_cache, v_cache), table, lens = paged_cache("cpu")
    q = torch.randn(2, 1, 4, 8)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    packed = [torch.randn(5, h, 8) for h in (4, 2, 2)]
    with forward_ad.dual_level(), torch.no_grad():
        dual_q = forward_ad.make_dual(q, torch.ones_like(q))
        with pytest.raises(RuntimeError, match=r"portable_ops.paged_attention does not support forward-mode AD"):
            portable_ops.paged_attention(dual_q, k_cache, v_cache, table, lens)
        dual_k = forward_ad.make_dual(packed[1], torch.ones_like(packed[1]))
        with pytest.raises(RuntimeError, match=r"portable_ops.attention_varlen does not support forward-mode AD"):
            portable_ops.attention_varlen(packed[0], dual_k, packed[2], cu, cu, 3, 3)
        out = portable_ops.paged_attention(q, k_cache, v_cache, table, lens)  # no tangent anywhere: it runs
    assert forward_ad.unpack_dual(out).tangent is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_refused_step_names_the_tensor_as_the_user_holds_it(backend):
    """The step's lists hold only the params with grads, per device; a refusal names the user's
    ``param_groups[g]["params"][i]`` (and its grad or state), not an index into those lists."""
    device = default_device(backend)
    groups = [[torch.nn.Parameter(torch.randn(3, device=device)) for _ in range(2)],
              [torch.nn.Parameter(torch.randn(n, device=device)) for n in (4, 5, 6)]]
    opt = portable_ops.optim.AdamW([{"params": groups[0]}, {"params": groups[1], "lr": 1e-2}])
    for p in groups[0] + groups[1][1:]:  # param_groups[1]["params"][0] has no grad: not in the step's lists
        p.grad = torch.randn_like(p)
    with forced_strict(backend):
        opt.step()
        groups[1][2].data = torch.randn(7, device=device)  # model surgery: its state no longer fits
        groups[1][2].grad = torch.randn(7, device=device)
        with pytest.raises(ValueError, match=r'^state\[param_groups\[1\]\["params"\]\[2\]\]\["exp_avg"\] has shape '
                                             r'\(6,\) but param_groups\[1\]\["params"\]\[2\] has \(7,\)'):
            opt.step()
        groups[1][2].data = torch.randn(6, device=device)
        groups[1][2].grad = torch.randn(6, device=device)
        groups[1][1].grad = groups[1][1].grad.to_sparse()
        with pytest.raises(ValueError, match=r'^param_groups\[1\]\["params"\]\[1\]\.grad is torch.sparse_coo'):
            opt.step()


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_a_call_that_failed_leaves_no_memo_behind(fake_backend, grad):
    """A kernel that fails once (out of memory, a launch error): nothing of the failed call is memoised, so the
    next call of the same layout is dispatched and prepared afresh and runs what is installed then."""
    stand_in = fake_backend("triton")
    attention = sys.modules["portable_ops.attention"]
    q, k, v = (torch.randn(1, h, 8, 16, requires_grad=grad) for h in (2, 2, 2))

    def failing(**call):
        raise RuntimeError("the stand-in's launch failed")
    stand_in.ops["attention_fwd"] = portable_ops.dispatch.OpImpl(run=failing)
    before = dict(attention._memo)
    with portable_ops.use_backend("triton"), pytest.raises(RuntimeError, match="launch failed"):
        portable_ops.attention(q, k, v)
    assert attention._memo == before
    stand_in.ops["attention_fwd"] = portable_ops.dispatch.get_backend("reference").ops["attention_fwd"]
    with portable_ops.use_backend("triton"):
        out = portable_ops.attention(q, k, v)
    assert len(attention._memo) == len(before) + 1
    torch.testing.assert_close(out, portable_ops.attention(q, k, v))


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_append_bumps_the_caches_versions(backend):
    """A graph that saved a cache refuses its backward once an append wrote the cache, on every backend, kernels
    that write through raw pointers included."""
    device = default_device(backend)
    (k_cache, v_cache), table, lens = paged_cache(device)
    w = torch.ones_like(k_cache, requires_grad=True)
    loss = (w * k_cache).sum()  # saves k_cache for w's gradient
    with portable_ops.use_backend(backend), torch.no_grad():
        portable_ops.paged_kv_append(k_cache, v_cache, table, lens, *(torch.ones(2, 1, 2, 8, device=device)
                                                                       for _ in range(2)))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_window_or_max_seqlen_past_any_sequence_means_what_the_longest_would(backend):
    """A window side of 10**30 is an unbounded side, and a max_seqlen of 10**12 the longest sequence, on every
    backend: no overflow in one, no grid sized by it in another."""
    device = default_device(backend)
    q, k, v = (torch.randn(1, h, 6, 16, device=device) for h in (2, 1, 1))
    with forced_strict(backend):
        torch.testing.assert_close(portable_ops.attention(q, k, v, causal=True, window=(10**30, None)),
                                   portable_ops.attention(q, k, v, causal=True))
    packed = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]
    cu = torch.tensor([0, 2, 6], dtype=torch.int32, device=device)
    with portable_ops.use_backend(backend):  # a backend declining packed sequences: its fallback answers
        torch.testing.assert_close(portable_ops.attention_varlen(*packed, cu, cu, 10**12, 10**12, causal=True),
                                   portable_ops.attention_varlen(*packed, cu, cu, 4, 4, causal=True))
