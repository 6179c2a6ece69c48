"""Issue 12's features against the nearest torch equivalent, in one process on the GPU.

* packed sequences (``attention_varlen``): documents of mixed lengths packed into 16k tokens, causal,
  forward and backward; against our dense attention on the same total tokens (a batch of equal
  documents) and FlexAttention with a document block mask. TFLOP/s count only the visible pairs.
* sliding window: S 16k, window 4096 to the left, causal; against FlexAttention's sliding-window
  block mask and our full causal attention.
* softcap (Gemma 2's 50): S 4096, causal; against FlexAttention with a tanh ``score_mod``.
* decode from a paged cache (page 16 and 256) against our decode from a contiguous cache, under
  CUDA graph replay.
"""

from __future__ import annotations

import torch

from portable_ops import attention, attention_varlen, paged_attention

from .common import graphed, median_ms, steady_ms

H, D, DTYPE = 16, 128, torch.bfloat16


def _flex():
    """FlexAttention compiled (its eager path is a reference implementation), or None."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    return torch.compile(flex_attention, dynamic=False), create_block_mask


def _timed(fn, inputs, direction):
    """(drained ms, steady ms) of the forward, or of the backward through a kept graph."""
    if direction == "fwd":
        with torch.no_grad():
            return median_ms(fn, iters=20), steady_ms(fn)
    out = fn()
    dout = torch.randn_like(out)
    backward = lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)  # noqa: E731
    return median_ms(backward, iters=20), steady_ms(backward)


def _row(feature, variant, direction, shape, pairs, fn, inputs, error=None):
    ms, steady = _timed(fn, inputs, direction)
    flop = 4 * pairs * D * H * (1 if direction == "fwd" else 2.5)
    return dict(feature=feature, variant=variant, dir=direction, shape=shape, ms=ms, **{"steady ms": steady},
                **{"TFLOP/s": flop / ms / 1e9, "steady TFLOP/s": flop / steady / 1e9}, error=error)


def _qkv(b, s, layout="bhsd"):
    shape = (b, H, s, D) if layout == "bhsd" else (b * s, H, D)
    return [torch.randn(shape, device="cuda", dtype=DTYPE, requires_grad=True) for _ in range(3)]


def _max_error(got, want):
    return (got.float() - want.float()).abs().max().item()


def run_features() -> list[dict]:
    rows = []
    flex = _flex()
    flex_attention, create_block_mask = flex if flex else (None, None)
    tokens = 16384

    # packed documents: lengths cycling through 512..4096, causal within each
    lengths = [512, 4096, 1024, 2048, 3072, 1536, 2560, 1536][:]
    lengths.append(tokens - sum(lengths))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    q, k, v = _qkv(1, tokens, "thd")
    shape = f"T {tokens}, {len(lengths)} docs 512-4096"
    for direction in ("fwd", "bwd"):
        rows.append(_row("varlen", "ours varlen", direction, shape, pairs,
                         lambda: attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True),
                         (q, k, v)))
        dq, dk, dv = _qkv(tokens // 2048, 2048)
        rows.append(_row("varlen", "ours dense (B 8 x 2048)", direction, "T 16384", 8 * 2048 * 2049 // 2,
                         lambda: attention(dq, dk, dv, causal=True), (dq, dk, dv)))
        if flex_attention is not None:
            doc = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"),
                                          torch.tensor(lengths, device="cuda"))
            mask = create_block_mask(lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i), None, None, tokens, tokens)
            fq, fk, fv = (t.detach().transpose(0, 1)[None].requires_grad_() for t in (q, k, v))
            rows.append(_row("varlen", "flex document mask", direction, shape, pairs,
                             lambda: flex_attention(fq, fk, fv, block_mask=mask), (fq, fk, fv)))

    # sliding window: S 16k, 4096 keys to the left, causal
    s, left = 16384, 4096
    q, k, v = _qkv(1, s)
    pairs = sum(min(i, left) + 1 for i in range(s))
    shape = f"S {s}, window ({left}, 0)"
    for direction in ("fwd", "bwd"):
        rows.append(_row("window", "ours window", direction, shape, pairs,
                         lambda: attention(q, k, v, causal=True, window=(left, None)), (q, k, v)))
        rows.append(_row("window", "ours full causal", direction, f"S {s}, causal", s * (s + 1) // 2,
                         lambda: attention(q, k, v, causal=True), (q, k, v)))
        if flex_attention is not None:
            mask = create_block_mask(lambda b, h, i, j: (j <= i) & (i - j <= left), None, None, s, s)
            rows.append(_row("window", "flex sliding window", direction, shape, pairs,
                             lambda: flex_attention(q, k, v, block_mask=mask), (q, k, v)))

    # softcap 50, S 4096, causal
    s, cap = 4096, 50.0
    q, k, v = _qkv(4, s)
    pairs = 4 * s * (s + 1) // 2
    for direction in ("fwd", "bwd"):
        rows.append(_row("softcap", "ours softcap", direction, f"B 4, S {s}", pairs,
                         lambda: attention(q, k, v, causal=True, softcap=cap), (q, k, v)))
        if flex_attention is not None:
            mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, s, s)
            score = lambda x, b, h, i, j: cap * torch.tanh(x / cap)  # noqa: E731
            rows.append(_row("softcap", "flex tanh score_mod", direction, f"B 4, S {s}", pairs,
                             lambda: flex_attention(q, k, v, score_mod=score, block_mask=mask), (q, k, v)))

    rows += _paged_decode()
    return rows


def _paged_decode(batches=(16, 64), caches=(4096, 32768), pages=(16, 256), hq=32, hkv=8) -> list[dict]:
    """Graph-replay us of one decode step: ours from a paged cache (pages shuffled) against ours from a
    contiguous cache holding the same keys."""
    rows = []
    for b in batches:
        for length in caches:
            k = torch.randn(b, hkv, length, D, device="cuda", dtype=DTYPE)
            v = torch.randn_like(k)
            q = torch.randn(b, hq, 1, D, device="cuda", dtype=DTYPE)
            with torch.no_grad():
                want = attention(q, k, v)
                contiguous = graphed(lambda: attention(q, k, v))
            base = median_ms(contiguous) * 1e3
            for page in pages:
                per_seq = length // page
                perm = torch.randperm(b * per_seq, device="cuda")
                table = perm.view(b, per_seq).to(torch.int32)
                k_cache = torch.empty(b * per_seq, page, hkv, D, device="cuda", dtype=DTYPE)
                v_cache = torch.empty_like(k_cache)
                k_cache[perm] = k.transpose(1, 2).reshape(b * per_seq, page, hkv, D)
                v_cache[perm] = v.transpose(1, 2).reshape(b * per_seq, page, hkv, D)
                lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
                pq = q.transpose(1, 2).contiguous()
                with torch.no_grad():
                    got = paged_attention(pq, k_cache, v_cache, table, lens)
                    replay = graphed(lambda: paged_attention(pq, k_cache, v_cache, table, lens))
                us = median_ms(replay) * 1e3
                rows.append(dict(feature="paged decode", variant=f"ours paged (page {page})", dir="fwd",
                                 shape=f"B {b}, cache {length}, 32/8 heads", us=us, contiguous_us=base,
                                 of_contiguous=base / us, error=_max_error(got.transpose(1, 2), want)))
    return rows
