"""Attention sinks (gpt-oss), the returned log-sum-exp and v with a head dim of its own (DeepSeek's MLA) in
``attention``, ``attention_varlen`` and ``paged_attention``.

Each is compared with a computation written in the tests from its definition (tests/attention_definitions.py:
the sink is one more logit of each row, dropped after the softmax; lse the log-sum-exp of a row's logits) and
with transformers' own gpt-oss eager attention, v's own head dim with SDPA over v padded to q's (as transformers
pads it for FlashAttention); gradients through torch's autograd of those, in float64. Bad
input must be refused before anything runs, naming the argument. torch.compile, torch.func and autocast must
see them as they see the other options. The kernel backends' numbers are the conformance suite's
(tests/test_conformance.py, the ``*sinks*``, ``*lse*``, ``*dv*`` and ``*mla*`` cases).
"""

import math
import re

import pytest
import torch
import torch.nn.functional as F

import portable_ops
from attention_definitions import (F64, NOT_REFERENCE, TAKING, PAGED_TAKING, definition, gathered, packed, paged_cache,
                                   qkv)
from portable_ops import dispatch, layout
from portable_ops.conformance.runner import default_device, forced_strict


def sinks_of(heads, dtype=F64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (1.0 + torch.randn(heads, generator=g, dtype=dtype)).requires_grad_()


def assert_same_with_gradients(ours, theirs, inputs, tol=1e-10):
    """Outputs (a tensor, or a tuple of them), and gradients of a random projection of them, equal."""
    ours, theirs = (t if isinstance(t, tuple) else (t,) for t in (ours, theirs))
    g = torch.Generator().manual_seed(9)
    douts = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in ours]
    torch.testing.assert_close(ours, theirs, atol=tol, rtol=tol)
    for a, b in zip(torch.autograd.grad(ours, inputs, douts), torch.autograd.grad(theirs, inputs, douts)):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- the definition, and gpt-oss's

@pytest.mark.parametrize("options", [dict(), dict(causal=True), dict(window=(2, 1)), dict(causal=True, softcap=3.0)],
                         ids=["plain", "causal", "window", "causal-softcap"])
@pytest.mark.parametrize("sq, skv", [(9, 9), (5, 13), (11, 4)], ids=["square", "fewer-queries", "more-queries"])
def test_sinks_are_the_definition(options, sq, skv):
    q, k, v = qkv(sq=sq, skv=skv)
    sinks = sinks_of(4)
    ours = portable_ops.attention(q, k, v, sinks=sinks, **options)
    assert_same_with_gradients(ours, definition(q, k, v, sinks=sinks, **options), (q, k, v, sinks))


def test_sinks_are_gpt_oss_eager_attention():
    """transformers' gpt-oss eager attention (its sinks as one more column of logits, under an additive mask)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, k, v = qkv(b=2, hq=4, hkv=2, sq=7, skv=7)
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups = sinks_of(4), 2
    window = (3, 0)  # gpt-oss's sliding layers: the last 4 tokens, the query's own included
    visible = torch.ones(7, 7, dtype=torch.bool).tril() & ~torch.ones(7, 7, dtype=torch.bool).tril(-4)
    mask = torch.zeros(7, 7, dtype=F64).masked_fill(~visible, -math.inf)
    theirs, _ = eager_attention_forward(module, q, k, v, mask, scaling=0.3)
    ours = portable_ops.attention(q, k, v, window=window, scale=0.3, sinks=module.sinks)
    assert_same_with_gradients(ours.transpose(1, 2), theirs, (q, k, v, module.sinks))


def test_a_row_that_sees_no_key_outputs_zeros_and_its_lse_is_its_sink():
    """Queries 0-2 of 8 over 5 keys under window (0, 0) see nothing: the sink is all of their softmax."""
    from portable_ops.definitions.attention import attention_fwd

    q, k, v = qkv(sq=8, skv=5)
    sinks = sinks_of(4)
    out = portable_ops.attention(q, k, v, window=(0, 0), sinks=sinks)
    dq, dsinks = torch.autograd.grad(out[:, :, :3].sum(), (q, sinks))
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    assert torch.equal(dq, torch.zeros_like(dq)) and torch.equal(dsinks, torch.zeros_like(dsinks))
    _, lse = attention_fwd(q.detach(), k.detach(), v.detach(), causal=False, scale=0.3, window=(0, 0),
                           sinks=sinks.detach())
    torch.testing.assert_close(lse[:, :, :3], sinks.detach()[None, :, None].expand(2, 4, 3))


def test_no_keys_at_all():
    q, k, v = qkv(skv=0)
    sinks = sinks_of(4)
    out = portable_ops.attention(q, k, v, sinks=sinks)
    assert torch.equal(out, torch.zeros_like(out))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in torch.autograd.grad(out.sum(), (q, sinks)))


def test_the_sinks_gradient_is_minus_p_sink_times_dout_dot_out():
    """``d/d sinks[h] = -sum over the rows of head h of p_sink * (dout . out)``, ``p_sink = exp(sink - lse)``."""
    from portable_ops.definitions.attention import attention_fwd

    q, k, v = (t.detach() for t in qkv(hq=4, hkv=1))
    sinks = sinks_of(4)
    out = portable_ops.attention(q, k, v, causal=True, sinks=sinks)
    dout = torch.randn_like(out)
    dsinks, = torch.autograd.grad(out, sinks, dout)
    _, lse = attention_fwd(q, k, v, causal=True, scale=1 / math.sqrt(8), sinks=sinks.detach())
    p_sink = torch.exp(sinks.detach()[None, :, None] - lse)
    torch.testing.assert_close(dsinks, -(p_sink * (dout * out.detach()).sum(-1)).sum((0, 2)))


def test_varlen_sinks_are_each_sequence_on_its_own():
    lens_q, lens_k = (5, 0, 4, 7), (6, 3, 2, 7)
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k)
    sinks = sinks_of(4)
    ours = portable_ops.attention_varlen(q, k, v, cu_q, cu_k, 7, 7, causal=True, sinks=sinks)
    theirs, start_q, start_k = [], 0, 0
    for lq, lk in zip(lens_q, lens_k):
        dense = [t.transpose(0, 1)[None] for t in (q[start_q:start_q + lq], k[start_k:start_k + lk],
                                                   v[start_k:start_k + lk])]
        theirs.append(definition(*dense, causal=True, sinks=sinks)[0].transpose(0, 1))
        start_q, start_k = start_q + lq, start_k + lk
    assert_same_with_gradients(ours, torch.cat(theirs), (q, k, v, sinks))


def test_paged_sinks_are_dense_sinks_over_the_gathered_keys():
    lens, page_size = [5, 9, 1], 4
    k_cache, v_cache, table, seqlens = paged_cache(lens, page_size)
    q = torch.randn(3, 2, 4, 8, dtype=F64)
    sinks = sinks_of(4).detach()
    with torch.no_grad():
        out = portable_ops.paged_attention(q, k_cache, v_cache, table, seqlens, sinks=sinks, window=(3, None))
    for b, length in enumerate(lens):
        keys = [gathered(cache, table, b, length, page_size) for cache in (k_cache, v_cache)]
        want = definition(q[b].transpose(0, 1)[None], *keys, causal=True, window=(3, None), sinks=sinks)
        torch.testing.assert_close(out[b], want[0].transpose(0, 1))


# ----------------------------------------------------------------------------- the returned lse

@pytest.mark.parametrize("options", [dict(), dict(causal=True, window=(3, None)), dict(softcap=2.0, sinks=True),
                                     dict(window=(0, 0), sinks=True)],
                         ids=["plain", "causal-window", "softcap-sinks", "rows-seeing-nothing-sinks"])
def test_lse_and_its_gradient_are_the_definitions(options):
    """lse is each row's log-sum-exp of its logits, its sink included; its gradient is exact (``dS += P dlse``)."""
    q, k, v = qkv(sq=8, skv=6)
    extra = [sinks_of(4)] if options.get("sinks") else []
    options = {**options, "sinks": extra[0] if extra else None}
    ours = portable_ops.attention(q, k, v, **options, return_lse=True)
    assert ours[1].shape == (2, 4, 8) and ours[1].dtype == F64
    assert_same_with_gradients(ours, definition(q, k, v, **options, return_lse=True), (q, k, v, *extra))


def test_lse_of_rows_that_see_nothing_is_minus_inf_with_no_gradient():
    q, k, v = qkv(sq=8, skv=5)
    out, lse = portable_ops.attention(q, k, v, window=(0, 0), return_lse=True)
    assert torch.isneginf(lse[:, :, :3]).all() and torch.isfinite(lse[:, :, 3:]).all()
    grads = torch.autograd.grad(lse[:, :, 3:].sum() + out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)


def test_partial_attentions_merge_through_their_lse():
    """The use lse is returned for: attention over all keys is the lse-weighted merge of attentions over
    parts of them (context parallelism, split prefixes), the sinks counted once."""
    q, k, v = (t.detach() for t in qkv(sq=5, skv=12))
    sinks = sinks_of(4).detach()
    whole, whole_lse = portable_ops.attention(q, k, v, sinks=sinks, return_lse=True)
    first, first_lse = portable_ops.attention(q, k[:, :, :7], v[:, :, :7], sinks=sinks, return_lse=True)
    second, second_lse = portable_ops.attention(q, k[:, :, 7:], v[:, :, 7:], return_lse=True)
    lse = torch.logaddexp(first_lse, second_lse)
    torch.testing.assert_close(lse, whole_lse)
    torch.testing.assert_close(first * torch.exp(first_lse - lse)[..., None]
                               + second * torch.exp(second_lse - lse)[..., None], whole)


def test_varlen_and_paged_lse_are_each_sequences():
    lens_q, lens_k = (5, 0, 4), (6, 3, 7)
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k)
    sinks = sinks_of(4)
    out, lse = portable_ops.attention_varlen(q, k, v, cu_q, cu_k, 5, 7, causal=True, sinks=sinks, return_lse=True)
    assert lse.shape == (4, 9)
    start_q = start_k = 0
    for lq, lk in zip(lens_q, lens_k):
        dense = [t.transpose(0, 1)[None] for t in (q[start_q:start_q + lq], k[start_k:start_k + lk],
                                                   v[start_k:start_k + lk])]
        _, want = definition(*dense, causal=True, sinks=sinks, return_lse=True)
        torch.testing.assert_close(lse[:, start_q:start_q + lq], want[0])
        start_q, start_k = start_q + lq, start_k + lk
    lens, page_size = [5, 9, 1], 4
    k_cache, v_cache, table, seqlens = paged_cache(lens, page_size)
    pq = torch.randn(3, 2, 4, 8, dtype=F64)
    with torch.no_grad():
        out, lse = portable_ops.paged_attention(pq, k_cache, v_cache, table, seqlens, sinks=sinks.detach(),
                                                return_lse=True)
    assert lse.shape == (3, 4, 2)
    for b, length in enumerate(lens):
        keys = [gathered(cache, table, b, length, page_size) for cache in (k_cache, v_cache)]
        _, want = definition(pq[b].transpose(0, 1)[None], *keys, causal=True, sinks=sinks.detach(), return_lse=True)
        torch.testing.assert_close(lse[b], want[0])


def test_empty_inputs_return_lse_too():
    q, k, v = qkv(skv=0)
    sinks = sinks_of(4)
    _, lse = portable_ops.attention(q, k, v, sinks=sinks, return_lse=True)
    torch.testing.assert_close(lse, sinks.detach()[None, :, None].expand(2, 4, 9))
    assert torch.isneginf(portable_ops.attention(q, k, v, return_lse=True)[1]).all()
    k_cache, v_cache, table, seqlens = paged_cache([3], 4)
    _, lse = portable_ops.paged_attention(torch.randn(1, 0, 4, 8, dtype=F64), k_cache, v_cache, table, seqlens,
                                          return_lse=True)
    assert lse.shape == (1, 4, 0)


def test_gradcheck_and_second_derivatives_through_out_lse_and_sinks():
    q, k, v = qkv(b=1, hq=2, hkv=1, sq=4, skv=6, d=3)
    sinks = sinks_of(2)

    def f(q, k, v, sinks):
        return portable_ops.attention(q, k, v, causal=True, window=(2, None), softcap=2.0, scale=1.5, sinks=sinks,
                                      return_lse=True)

    assert torch.autograd.gradcheck(f, (q, k, v, sinks))
    assert torch.autograd.gradgradcheck(f, (q, k, v, sinks))


def test_a_backend_without_the_lse_gradient_declines_only_the_backward_that_needs_it(fake_backend):
    stand_in = fake_backend("triton")
    stand_in.ops["attention_bwd"] = dispatch.OpImpl(run=stand_in.ops["attention_bwd"].run,
                                                    features=("causal", "window", "softcap", "sinks"))
    q, k, v = qkv()
    with forced_strict("triton"):
        out, lse = portable_ops.attention(q, k, v, return_lse=True)
        out.sum().backward()  # no gradient reached lse: the backward runs there
        out, lse = portable_ops.attention(q, k, v, return_lse=True)
        with pytest.raises(portable_ops.BackendUnavailableError,
                           match=re.escape("a gradient through lse (return_lse=True) is not supported")):
            (out.sum() + lse.sum()).backward()


@pytest.mark.parametrize("value, error", [("yes", TypeError), (1, TypeError), (None, TypeError)])
def test_return_lse_must_be_a_bool(value, error):
    q, k, v = qkv()
    pq, pk, pv, cu_q, cu_k = packed((3, 4), (3, 4))
    k_cache, v_cache, table, seqlens = paged_cache([3, 5], 4)
    for call in (lambda: portable_ops.attention(q, k, v, return_lse=value),
                 lambda: portable_ops.attention_varlen(pq, pk, pv, cu_q, cu_k, 4, 4, return_lse=value),
                 lambda: portable_ops.paged_attention(torch.randn(2, 1, 4, 8, dtype=F64), k_cache, v_cache, table,
                                                      seqlens, return_lse=value)):
        with pytest.raises(error, match="return_lse must be a bool"):
            call()


# ----------------------------------------------------------------------------- v with a head dim of its own

def mla_qkv(b=2, hq=4, hkv=2, sq=7, skv=9, d=24, dv=16, dtype=F64, seed=3):
    """q and k of head dim ``d``, v of ``dv`` (DeepSeek's MLA: 192 and 128, here in small)."""
    q, k, _ = qkv(b, hq, hkv, sq, skv, d, dtype, seed)
    return q, k, torch.randn(b, hkv, skv, dv, generator=torch.Generator().manual_seed(seed + 1),
                             dtype=dtype).requires_grad_()


@pytest.mark.parametrize("dv", [16, 40], ids=["narrower", "wider"])
@pytest.mark.parametrize("options", [dict(), dict(causal=True, window=(3, None), sinks=True)], ids=["plain", "all"])
def test_a_value_head_dim_of_its_own_is_the_definition(dv, options):
    q, k, v = mla_qkv(dv=dv)
    extra = [sinks_of(4)] if options.get("sinks") else []
    options = {**options, "sinks": extra[0] if extra else None}
    ours = portable_ops.attention(q, k, v, **options, return_lse=True)
    assert ours[0].shape == (2, 4, 7, dv)
    assert_same_with_gradients(ours, definition(q, k, v, **options, return_lse=True), (q, k, v, *extra))


def test_a_value_head_dim_of_its_own_is_sdpa_over_v_padded():
    """transformers' way to run MLA on FlashAttention: v zero-padded to q's head dim, out cut back."""
    q, k, v = mla_qkv(sq=9, dv=16)
    ours = portable_ops.attention(q, k, v, causal=True, scale=0.3)
    theirs = F.scaled_dot_product_attention(q, k, F.pad(v, (0, 8)), is_causal=True, scale=0.3,
                                            enable_gqa=True)[..., :16]
    assert_same_with_gradients(ours, theirs, (q, k, v))


def test_the_output_follows_qs_layout_with_vs_head_dim():
    q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2) for t in mla_qkv())  # [B, S, H, D] in memory
    out = portable_ops.attention(q, k, v)
    assert out.shape == (2, 4, 7, 16) and out.stride() == layout.strides_like(q, 16)
    assert out.transpose(1, 2).is_contiguous()


def test_packed_and_paged_values_of_their_own_head_dim():
    lens_q, lens_k = (5, 0, 4), (6, 3, 7)
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, d=24)
    v = torch.randn(16, 2, 16, dtype=F64, requires_grad=True)
    out = portable_ops.attention_varlen(q, k, v, cu_q, cu_k, 5, 7, causal=True)
    assert out.shape == (9, 4, 16)
    theirs, start_q, start_k = [], 0, 0
    for lq, lk in zip(lens_q, lens_k):
        dense = [t.transpose(0, 1)[None] for t in (q[start_q:start_q + lq], k[start_k:start_k + lk],
                                                   v[start_k:start_k + lk])]
        theirs.append(definition(*dense, causal=True)[0].transpose(0, 1))
        start_q, start_k = start_q + lq, start_k + lk
    assert_same_with_gradients(out, torch.cat(theirs), (q, k, v))
    # the absorbed decode: one KV head, a cache of keys wider than its values
    lens, page_size = [5, 9, 1], 4
    k_cache, _, table, seqlens = paged_cache(lens, page_size, hkv=1, d=24)
    v_cache = torch.randn(*k_cache.shape[:3], 16, dtype=F64)
    k_new, v_new = torch.randn(3, 1, 1, 24, dtype=F64), torch.randn(3, 1, 1, 16, dtype=F64)
    with torch.no_grad():
        portable_ops.paged_kv_append(k_cache, v_cache, table, seqlens - 1, k_new, v_new)
        out = portable_ops.paged_attention(torch.randn(3, 1, 4, 24, dtype=F64), k_cache, v_cache, table, seqlens)
    assert out.shape == (3, 1, 4, 16)
    for b, length in enumerate(lens):
        assert torch.equal(v_cache[table[b, (length - 1) // page_size], (length - 1) % page_size], v_new[b, 0])


def test_mismatched_value_shapes_are_refused_by_name():
    q, k, v = mla_qkv()
    with pytest.raises(ValueError, match=r"k has shape \(2, 2, 9, 24\) but v has \(2, 2, 8, 16\); they must match "
                                         r"but in the head dim"):
        portable_ops.attention(q, k, v[:, :, :8])
    with pytest.raises(ValueError, match="k has head_dim 16 but q has head_dim 24"):
        portable_ops.attention(q, v, v)
    k_cache, v_cache, table, seqlens = paged_cache([3, 5], 4)
    with pytest.raises(ValueError, match=r"v_new has \(kv_heads, head_dim\) \(2, 4\) but v_cache has \(2, 8\)"):
        portable_ops.paged_kv_append(k_cache, v_cache, table, seqlens, torch.randn(2, 1, 2, 8, dtype=F64),
                                     torch.randn(2, 1, 2, 4, dtype=F64))


def test_a_backend_without_value_head_dims_declines_them_and_head_dim_limits_read_the_wider(fake_backend):
    stand_in = fake_backend("triton", ops=("attention_fwd", "attention_bwd", "paged_attention"))
    for op in stand_in.ops:
        stand_in.ops[op] = dispatch.OpImpl(run=stand_in.ops[op].run, features=("causal", "window", "softcap"),
                                           max_head_dim=256)
    q, k, v = mla_qkv()
    with portable_ops.use_backend("triton"):
        choice = portable_ops.explain(portable_ops.attention, q, k, v)
    assert choice.rejected["triton"] == ["v's head_dim 16 beside q and k's 24 is not supported"]
    k_cache, _, table, seqlens = paged_cache([3, 5], 4, hkv=1, d=576)
    with portable_ops.use_backend("triton"):
        choice = portable_ops.explain(portable_ops.paged_attention, torch.randn(2, 1, 8, 576, dtype=F64), k_cache,
                                      k_cache[..., :512], table, seqlens)
    assert "head_dim 576 is over 256, the largest the triton kernels take" in choice.rejected["triton"]


# ----------------------------------------------------------------------------- inside PyTorch's machinery

def test_torch_func_grad_vmap_jvp_and_jacrev_in_sinks():
    q, k, v = (t.detach() for t in qkv(b=1, sq=5, skv=7))
    sinks = sinks_of(4).detach()
    options = dict(causal=True, window=(3, None), scale=0.7)

    def ours(q, k, v, sinks):
        return portable_ops.attention(q, k, v, sinks=sinks, **options)

    def theirs(q, k, v, sinks):
        return definition(q, k, v, sinks=sinks, **options)

    for a, b in zip(torch.func.grad(lambda *t: ours(*t).square().sum(), argnums=(0, 3))(q, k, v, sinks),
                    torch.func.grad(lambda *t: theirs(*t).square().sum(), argnums=(0, 3))(q, k, v, sinks)):
        torch.testing.assert_close(a, b)
    tangents = tuple(torch.randn_like(t) for t in (q, k, v, sinks))
    torch.testing.assert_close(torch.func.jvp(ours, (q, k, v, sinks), tangents)[1],
                               torch.func.jvp(theirs, (q, k, v, sinks), tangents)[1])
    batch = [torch.stack([t, t.flip(0)]) for t in (q, k, v, sinks)]
    for in_dims in ((0, 0, 0, None), (None, None, None, 0)):  # sinks shared, then one per sample
        torch.testing.assert_close(torch.func.vmap(ours, in_dims)(*(b if d is not None else t for b, t, d
                                                                    in zip(batch, (q, k, v, sinks), in_dims))),
                                   torch.func.vmap(theirs, in_dims)(*(b if d is not None else t for b, t, d
                                                                      in zip(batch, (q, k, v, sinks), in_dims))))
    torch.testing.assert_close(torch.func.jacrev(lambda s: ours(q, k, v, s).sum((0, 2, 3)))(sinks),
                               torch.func.jacrev(lambda s: theirs(q, k, v, s).sum((0, 2, 3)))(sinks))


def test_torch_func_with_a_value_head_dim_of_its_own():
    q, k, v = (t.detach() for t in mla_qkv(b=1))
    tangents = tuple(torch.randn_like(t) for t in (q, k, v))
    torch.testing.assert_close(torch.func.jvp(lambda *t: portable_ops.attention(*t, causal=True), (q, k, v), tangents),
                               torch.func.jvp(lambda *t: definition(*t, causal=True), (q, k, v), tangents))
    batch = [torch.stack([t, t.flip(-2)]) for t in (q, k, v)]
    torch.testing.assert_close(torch.func.vmap(portable_ops.attention)(*batch), torch.func.vmap(definition)(*batch))


def test_torch_func_through_lse():
    q, k, v = (t.detach() for t in qkv(b=1, sq=5, skv=7))
    sinks = sinks_of(4).detach()
    options = dict(causal=True, softcap=3.0, sinks=sinks, return_lse=True)

    def ours(q, k, v):
        return portable_ops.attention(q, k, v, **options)

    def theirs(q, k, v):
        return definition(q, k, v, **options)

    for a, b in zip(torch.func.grad(lambda *t: ours(*t)[1].sum(), argnums=(0, 1))(q, k, v),
                    torch.func.grad(lambda *t: theirs(*t)[1].sum(), argnums=(0, 1))(q, k, v)):
        torch.testing.assert_close(a, b)
    tangents = tuple(torch.randn_like(t) for t in (q, k, v))
    torch.testing.assert_close(torch.func.jvp(ours, (q, k, v), tangents)[1],
                               torch.func.jvp(theirs, (q, k, v), tangents)[1])
    batch = [torch.stack([t, t.flip(-2)]) for t in (q, k, v)]
    torch.testing.assert_close(torch.func.vmap(ours)(*batch), torch.func.vmap(theirs)(*batch))


def test_autocast_keeps_sinks_in_float32_and_gives_their_gradient_in_their_dtype():
    q, k, v = (t.detach().float().requires_grad_() for t in qkv())
    sinks = sinks_of(4, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = portable_ops.attention(q, k, v, causal=True, sinks=sinks)
    assert out.dtype == torch.bfloat16
    low = [t.detach().bfloat16() for t in (q, k, v)]
    torch.testing.assert_close(out, portable_ops.attention(*low, causal=True, sinks=sinks.detach()))
    out.float().sum().backward()
    assert sinks.grad.dtype == torch.float32 and sinks.grad.abs().sum() > 0
    half_sinks = sinks.detach().bfloat16().requires_grad_()  # taken in float32, its gradient in its own dtype
    portable_ops.attention(*low, sinks=half_sinks).float().sum().backward()
    assert half_sinks.grad.dtype == torch.bfloat16


def sinks_step(x, w, sinks):
    """A transformer's attention block with gpt-oss's learned sinks (a parameter of the module), its loss
    reading the lse too (a z-loss on it), v's head dim half q's (MLA's kind)."""
    b, s, _ = x.shape
    q, k, v = (x @ w).view(b, s, -1).split([64, 32, 16], dim=2)
    q, k, v = q.view(b, s, 4, 16), k.view(b, s, 2, 16), v.view(b, s, 2, 8)
    y, lse = portable_ops.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                                    sinks=sinks, return_lse=True)
    return y.transpose(1, 2).reshape(b, s, -1).square().mean() + 1e-2 * lse.square().mean()


@pytest.mark.usefixtures("fresh_dynamo")
def test_sinks_lse_and_value_head_dims_compile_fullgraph_without_breaks_and_train_like_eager():
    from torch._dynamo.utils import counters

    sinks = torch.nn.Parameter(torch.randn(4))
    compiled = torch.compile(sinks_step, backend="aot_eager", fullgraph=True, dynamic=True)
    for s in (9, 17):
        g = torch.Generator().manual_seed(s)
        x = torch.randn(2, s, 32, generator=g, requires_grad=True)
        w = (torch.randn(32, 112, generator=g) / 4).requires_grad_()
        got, want = compiled(x, w, sinks), sinks_step(x, w, sinks)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for a, b in zip(torch.autograd.grad(got, (x, w, sinks)), torch.autograd.grad(want, (x, w, sinks))):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1


def test_custom_ops_with_sinks_lse_gradients_and_value_head_dims_pass_opcheck():
    q, k, v = (t.detach().float() for t in qkv(d=16))
    sinks = torch.randn(4)
    args = (q, k, v, True, 0.25, 3, None, None, None, None, sinks)
    torch.library.opcheck(torch.ops.portable_ops.attention_fwd.default, args)
    out, lse = torch.ops.portable_ops.attention_fwd.default(*args)
    torch.library.opcheck(torch.ops.portable_ops.attention_bwd.default,
                          (q, k, v, out, lse, torch.randn_like(out), *args[3:], torch.randn_like(lse)))
    tq, tk, tv, cu_q, cu_k = (t.detach().float() if t.is_floating_point() else t for t in packed((3, 5), (4, 5)))
    args = (tq, tk, tv, cu_q, cu_k, 5, 5, True, 0.3, None, None, None, None, None, sinks)
    torch.library.opcheck(torch.ops.portable_ops.attention_varlen_fwd.default, args)
    out, lse = torch.ops.portable_ops.attention_varlen_fwd.default(*args)
    torch.library.opcheck(torch.ops.portable_ops.attention_varlen_bwd.default,
                          (tq, tk, tv, out, lse, torch.randn_like(out), *args[3:], torch.randn_like(lse)))
    k_cache, v_cache, table, seqlens = (t.float() if t.is_floating_point() else t for t in paged_cache([3, 6], 4))
    torch.library.opcheck(torch.ops.portable_ops.paged_attention.default,
                          (torch.randn(2, 1, 4, 8), k_cache, v_cache[..., :5], table, seqlens, 0.3, None, None, None,
                           None, None, sinks))
    q, k, v = (t.detach().float().transpose(1, 2).contiguous().transpose(1, 2) for t in mla_qkv())
    args = (q, k, v, True, 0.25, 3, None, None, None, None, sinks)
    torch.library.opcheck(torch.ops.portable_ops.attention_fwd.default, args)
    out, lse = torch.ops.portable_ops.attention_fwd.default(*args)
    torch.library.opcheck(torch.ops.portable_ops.attention_bwd.default,
                          (q, k, v, out, lse, torch.randn_like(out), *args[3:], torch.randn_like(lse)))


# ----------------------------------------------------------------------------- bad input, and the backends

BAD_SINKS = {
    "a list": ([1.0, 2.0, 3.0, 4.0], TypeError, r"sinks must be None or a floating-point tensor \[heads\]"),
    "integers": (torch.arange(4), TypeError, "sinks has dtype torch.int64; expected a floating-point tensor"),
    "complex": (torch.zeros(4, dtype=torch.complex64), TypeError, "sinks has dtype torch.complex64"),
    "2-d": (torch.zeros(1, 4), ValueError, r"sinks must have 1 dimension \[heads\], got shape \(1, 4\)"),
    "one per KV head": (torch.zeros(2), ValueError, "sinks has 2 entries but q has 4 heads: one logit per query head"),
    "another device": (torch.zeros(4, device="meta"), ValueError, "sinks is on meta but q is on cpu"),
}


@pytest.mark.parametrize("name", BAD_SINKS)
def test_bad_sinks_are_refused_by_name_before_anything_runs(name, fake_backend):
    calls = []
    stand_in = fake_backend("triton", ops=("attention_fwd", "attention_bwd", "attention_varlen_fwd",
                                           "attention_varlen_bwd", "paged_attention"))
    for op in stand_in.ops:
        stand_in.ops[op] = dispatch.OpImpl(run=lambda **call: calls.append(call))
    sinks, error, message = BAD_SINKS[name]
    q, k, v = qkv()
    pq, pk, pv, cu_q, cu_k = packed((3, 4), (3, 4))
    k_cache, v_cache, table, seqlens = paged_cache([3, 5], 4)
    tensors = [t for t in (q, k, v, sinks) if isinstance(t, torch.Tensor) and t.device.type != "meta"]
    before = [t.detach().clone() for t in tensors]
    with portable_ops.use_backend("triton"):
        for call in (lambda: portable_ops.attention(q, k, v, sinks=sinks),
                     lambda: portable_ops.attention_varlen(pq, pk, pv, cu_q, cu_k, 4, 4, sinks=sinks),
                     lambda: portable_ops.paged_attention(torch.randn(2, 1, 4, 8, dtype=F64), k_cache, v_cache,
                                                          table, seqlens, sinks=sinks)):
            with pytest.raises(error, match=message):
                call()
    assert not calls
    assert all(torch.equal(a, b) for a, b in zip(before, tensors))


def test_paged_sinks_that_require_grad_are_refused():
    k_cache, v_cache, table, seqlens = paged_cache([3, 5], 4)
    with pytest.raises(RuntimeError, match="paged_attention is not differentiable .* but sinks requires grad"):
        portable_ops.paged_attention(torch.randn(2, 1, 4, 8, dtype=F64), k_cache, v_cache, table, seqlens,
                                     sinks=sinks_of(4))


def test_a_backend_without_sinks_declines_them_with_the_reason(fake_backend):
    """explain, the fallback and strict mode all name the feature the backend lacks."""
    stand_in = fake_backend("triton")
    for op in ("attention_fwd", "attention_bwd"):
        stand_in.ops[op] = dispatch.OpImpl(run=stand_in.ops[op].run, features=("causal", "window", "softcap"))
    q, k, v = qkv()
    sinks = sinks_of(4)
    expected = "sinks (a learned logit per query head) is not supported"
    with portable_ops.use_backend("triton"):
        choice = portable_ops.explain(portable_ops.attention, q, k, v, sinks=sinks)
        assert choice.backend == "reference" and choice.rejected["triton"] == [expected]
        assert portable_ops.explain(portable_ops.attention, q, k, v).backend == "triton"
    with forced_strict("triton"), pytest.raises(portable_ops.BackendUnavailableError, match=re.escape(expected)):
        portable_ops.attention(q, k, v, sinks=sinks)


def test_a_backend_whose_sinks_gradient_is_wrong_fails_its_case(fake_backend):
    from portable_ops.conformance import CASES, run_case

    stand_in = fake_backend("triton")
    run = stand_in.ops["attention_bwd"].run

    def off_by_a_tenth(**call):
        dq, dk, dv, dsinks = run(**call)
        return dq, dk, dv, dsinks * 1.1

    stand_in.ops["attention_bwd"] = dispatch.OpImpl(run=off_by_a_tenth)
    case = next(c for c in CASES if c.name == "attn_sinks_lse_gqa_window_more_queries" and c.dtype == torch.float16)
    row = run_case(case, "triton", device=torch.device("cpu"))
    assert row.status == "fail" and "dsinks" in row.detail, row


@pytest.mark.parametrize("backend", NOT_REFERENCE)
def test_kernel_backends_take_sinks_lse_gradients_and_value_head_dims(backend, monkeypatch):
    """No fallback: explain and strict mode see the calls run on the backend, the backward through lse
    included, with v of a head dim of its own."""
    monkeypatch.setattr(dispatch, "_warned", set())
    device = default_device(backend)
    q, k, v = (t.detach().to(device, torch.float32).requires_grad_() for t in mla_qkv(d=8, dv=12))
    sinks = sinks_of(4, dtype=torch.float32).detach().to(device).requires_grad_()
    with portable_ops.use_backend(backend):
        assert portable_ops.explain(portable_ops.attention, q, k, v, sinks=sinks).backend == backend
    with forced_strict(backend):
        out, lse = portable_ops.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
        grads = torch.autograd.grad(out.square().sum() + lse.sum(), (q, k, v, sinks))
    inputs = [t.detach().double().cpu().requires_grad_() for t in (q, k, v, sinks)]
    want = definition(*inputs[:3], causal=True, sinks=inputs[3], return_lse=True)
    torch.testing.assert_close((out.cpu(), lse.cpu()), tuple(t.float() for t in want), atol=2e-3, rtol=2e-3)
    for got, expected in zip(grads, torch.autograd.grad(want[0].square().sum() + want[1].sum(), inputs)):
        torch.testing.assert_close(got.cpu(), expected.float(), atol=8e-3, rtol=8e-3)
    if backend in TAKING:
        pq, pk, pv, cu_q, cu_k = (t.detach().to(device, torch.float32) if t.is_floating_point() else t.to(device)
                                  for t in packed((3, 5), (4, 5)))
        with forced_strict(backend), torch.no_grad():
            portable_ops.attention_varlen(pq, pk, pv[..., :5], cu_q, cu_k, 5, 5, causal=True, sinks=sinks,
                                          return_lse=True)
    if backend in PAGED_TAKING:
        k_cache, v_cache, table, seqlens = (t.to(device, torch.float32) if t.is_floating_point() else t.to(device)
                                            for t in paged_cache([3, 6], 4))
        v_cache = v_cache[..., :5].contiguous()  # v's own head dim (nki takes contiguous caches)
        with forced_strict(backend), torch.no_grad():
            portable_ops.paged_kv_append(k_cache, v_cache, table, seqlens - 1,
                                         torch.randn(2, 1, 2, 8, device=device), torch.randn(2, 1, 2, 5, device=device))
            portable_ops.paged_attention(torch.randn(2, 1, 4, 8, device=device), k_cache, v_cache, table,
                                         seqlens, sinks=sinks, return_lse=True)
