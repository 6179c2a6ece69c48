"""The attention features' definitions, written here from their meaning, and the inputs the feature tests build:
masks from Python loops over query and key positions, the softcap as ``softcap * tanh(s / softcap)``, sinks as
one more logit per row whose probability is dropped, packed sequences one at a time, a paged cache gathered
position by position (tests/test_attention_features.py, tests/test_attention_sinks.py,
tests/test_paged_attention.py)."""

import math

import numpy as np
import torch

from portable_ops import dispatch
from portable_ops.conformance import usable_backends

F64 = torch.float64
BACKENDS = usable_backends()
NOT_REFERENCE = [b for b in BACKENDS if b != "reference"]
# kernel backends without packed sequences (their Backend.declined says so), and with
DECLINING = [b for b in NOT_REFERENCE if "attention_varlen_fwd" in dispatch.get_backend(b).declined]
TAKING = [b for b in NOT_REFERENCE if b not in DECLINING]
# kernel backends without paged caches (whether or not they have packed sequences), and with
PAGED_DECLINING = [b for b in NOT_REFERENCE if "paged_attention" in dispatch.get_backend(b).declined]
PAGED_TAKING = [b for b in NOT_REFERENCE if b not in PAGED_DECLINING]


def definition_mask(sq, skv, causal, window):
    """Which keys query i sees, from the definition: position p = i + skv - sq; p - left <= j <= p + right;
    causal: j <= p."""
    left, right = window or (None, None)
    mask = torch.zeros(sq, skv, dtype=torch.bool)
    for i in range(sq):
        p = i + skv - sq
        for j in range(skv):
            mask[i, j] = ((left is None or j >= p - left) and (right is None or j <= p + right)
                          and (not causal or j <= p))
    return mask


def definition(q, k, v, causal=False, scale=None, window=None, softcap=None, sinks=None, return_lse=False):
    """Dense attention ``[B, H, S, D]`` from its definition; rows that see no key are zeros. ``return_lse``: and
    each row's log-sum-exp of its logits (its sink's included; -inf where there are none)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~definition_mask(q.shape[-2], k.shape[-2], causal, window), -math.inf)
    if sinks is not None:  # the sink is one more logit of each row, carrying no value
        scores = torch.cat([scores, sinks.to(scores.dtype)[:, None, None].expand(*scores.shape[:-1], 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = (probs if sinks is None else probs[..., :-1]) @ v
    return (out, torch.logsumexp(scores, dim=-1)) if return_lse else out


def qkv(b=2, hq=4, hkv=2, sq=9, skv=9, d=8, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda h, s: torch.randn(b, h, s, d, generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    return make(hq, sq), make(hkv, skv), make(hkv, skv)


def packed(lens_q, lens_k, hq=4, hkv=2, d=8, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), hq, d, generator=g, dtype=dtype).requires_grad_()
    k, v = (torch.randn(sum(lens_k), hkv, d, generator=g, dtype=dtype).requires_grad_() for _ in range(2))
    offsets = lambda lens: torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)  # noqa: E731
    return q, k, v, offsets(lens_q), offsets(lens_k)


def per_sequence(q, k, v, lens_q, lens_k, **options):
    """The definition of each sequence's attention in turn, concatenated."""
    outs, q0, k0 = [], 0, 0
    for lq, lk in zip(lens_q, lens_k):
        dense = [t.transpose(0, 1)[None] for t in (q[q0:q0 + lq], k[k0:k0 + lk], v[k0:k0 + lk])]
        outs.append(definition(*dense, **options)[0].transpose(0, 1))
        q0, k0 = q0 + lq, k0 + lk
    return torch.cat(outs)


def paged_cache(lens, page_size, hkv=2, d=8, dtype=F64, seed=0, spare=3):
    """k/v caches with each sequence's pages drawn from a shuffled pool; the table's unused entries -1."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // page_size) for n in lens]
    pool = torch.randperm(sum(pages) + spare, generator=g)
    table = torch.full((len(lens), max(pages) + 1), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = pool[start:start + n]
        start += n
    caches = [torch.randn(len(pool), page_size, hkv, d, generator=g, dtype=dtype) for _ in range(2)]
    return *caches, table, torch.tensor(lens, dtype=torch.int32)


def gathered(cache, table, b, length, page_size):
    """Sequence b's tokens, position by position: ``[1, H, length, D]``."""
    rows = [cache[int(table[b, j // page_size]), j % page_size] for j in range(length)]
    return (torch.stack(rows) if rows else cache.new_zeros(0, *cache.shape[2:])).transpose(0, 1)[None]
