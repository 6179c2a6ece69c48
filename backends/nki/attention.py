"""Flash attention on NKI (GQA, bottom-right causal, sliding window, logit softcap, sinks, a head dim of V's own):
the host side the backend registers. The kernels: ``attention_forward.py`` (:func:`attention_fwd_kernel`) and
``attention_backward.py`` (:func:`attention_bwd_kernel`, one pass); what they share (layout, the band mask,
transposes, PSUM rings): ``attention_tiles.py``.

Here: what the kernels take (:func:`attention_supports`), the launches (every (batch, head) of a call in one, split
where a launch would pass the compiler's instruction budget: :func:`head_instructions`), and the custom ops
``portable_ops_nki::attention_fwd`` / ``attention_bwd`` with the backward registered as the forward's autograd.
GQA reads K/V head ``h // (Hq // Hkv)`` in place, never a repeated copy; sinks go down as ``[Hq, 128, 1]``, and
the backward's per-row shares of their gradient are summed here. Semantics: ``backends/reference/attention.py``.
"""
from __future__ import annotations

import torch

from portable_ops.layout import as_layout_of

from . import runtime
from .attention_backward import attention_bwd_kernel
from .attention_forward import attention_fwd_kernel
from .attention_tiles import B_K, B_Q, FLOAT32_MAX, SCORE_KEYS, _band, _key_blocks
from .runtime import kernel_op, launch

# The largest head dim the backend declares: the one tested. The kernels' own bound is 512: P V and the
# gradients hold a [rows, D] fp32 tile in one 2 KiB PSUM bank, and a matmul's moving free size is at most 512.
MAX_HEAD_DIM = 256


def attention_supports(call) -> list[str]:
    """Every window, softcap and sink is taken (the kernels' masks, cap and sink term), dtypes and head dims
    are declared (``BACKEND``): what is left is q, k and v agreeing, having sizes, options the engines can
    hold, and a head the compiler takes in one launch."""
    q = call["q"]
    reasons = options_reasons(call)
    sq, skv = q.shape[-2], call["k"].shape[-2]
    if sq == 0 or skv == 0 or q.shape[-1] == 0:
        reasons.append("NKI attention needs non-empty sequences and head dim")
    else:
        reasons += head_reasons(sq, skv, call)
    return reasons


def head_reasons(sq, skv, call) -> list[str]:
    """Why a head of ``sq`` queries over ``skv`` keys (with the call's mask) can't run: past the compiler's
    instructions in one launch."""
    needs = head_instructions(sq, skv, call["causal"], call.get("window"))
    if needs <= runtime.INSTRUCTION_BUDGET:
        return []
    return [f"one head of {sq} queries over {skv} keys takes up to {needs} instructions, past the Neuron compiler's "
            f"{runtime.INSTRUCTION_BUDGET} a launch"]


def head_instructions(sq, skv, causal, window) -> int:
    """At least the instructions the forward or the backward kernel issues for one query head, every option on:
    by the score tiles of 512 keys its query tiles see, and its query tiles and key blocks."""
    left, right = _band(causal, *(window or (None, None)))
    score_tiles = 0
    for q0 in range(0, sq, B_Q):
        first, stop = _key_blocks(q0, min(B_Q, sq - q0), skv - sq, skv, left, right)
        score_tiles += -(-(stop - first) * B_K // SCORE_KEYS)
    return 48 * score_tiles + 64 * (-(-sq // B_Q) + -(-skv // B_K)) + 200


def _in_launches(kernel, q, k, args, laid_out, per_head, static):
    """``kernel``'s outputs for every (batch, head) of ``q [B, Hq, ..]`` and ``k [B, Hkv, ..]``, in as many launches
    as the instruction budget needs, each taking some batch entries' KV heads with their query heads. ``args``
    (positional) and ``laid_out`` (keywords, or None): tensors laid out as q or k, told apart by their head count;
    ``per_head``: keywords ``[Hq, ..]``, or None."""
    (b, hq), hkv = q.shape[:2], k.shape[1]
    group = hq // hkv
    per_launch = max(1, runtime.INSTRUCTION_BUDGET // (group * head_instructions(
        q.shape[2], k.shape[2], static["causal"], (static["window_left"], static["window_right"]))))
    heads = min(hkv, per_launch)
    batch = max(1, per_launch // hkv) if heads == hkv else 1
    if batch >= b and heads == hkv:
        return launch(kernel, *args, **laid_out, **per_head, **static)
    rows = []
    for b0 in range(0, b, batch):
        parts = []
        for h0 in range(0, hkv, heads):
            def piece(t):
                if t is None:
                    return None
                first, width = (h0 * group, heads * group) if t.shape[1] == hq else (h0, heads)
                return t[b0:b0 + batch, first:first + width]

            parts.append(launch(kernel, *(piece(t).contiguous() for t in args),
                                **{name: piece(t) for name, t in laid_out.items()},
                                **{name: None if t is None else t[h0 * group:(h0 + heads) * group]
                                   for name, t in per_head.items()}, **static))
        rows.append(parts)
    return tuple(torch.cat([torch.cat([part[i] for part in parts], 1) for parts in rows])
                 for i in range(len(rows[0][0])))


def options_reasons(call) -> list[str]:
    """What dense and packed attention share: q, k and v in one dtype, and a scale the engines can take as the
    float32 immediate it is (a softcap out of float32's range is split in two)."""
    reasons = []
    if not (call["q"].dtype == call["k"].dtype == call["v"].dtype):
        reasons.append("NKI attention needs q, k and v in one dtype")
    scale = call.get("scale")
    if scale is not None and abs(float(scale)) > FLOAT32_MAX:
        reasons.append(f"NKI attention takes scale as a float32 immediate: at most {FLOAT32_MAX:.4g} in magnitude, "
                       f"got {float(scale):g}")
    return reasons


def _static(causal, scale, window, softcap):
    """The kernels' trace-time arguments, as plain Python numbers (one compiled kernel per value)."""
    left, right = window if window is not None else (None, None)
    return dict(scale=float(scale), causal=bool(causal),
                window_left=None if left is None else int(left), window_right=None if right is None else int(right),
                softcap=float(softcap) if softcap else None)  # 0 is off, as the public API's


def _sinks_down_partitions(sinks):
    """``[Hq]`` -> ``[Hq, 128, 1]`` float32: each head's sink on every partition a query tile uses."""
    return None if sinks is None else sinks.to(torch.float32).reshape(-1, 1, 1).expand(-1, B_Q, 1).contiguous()


def _fake_fwd(q, k, v, sinks, scale, causal, window_left, window_right, softcap):
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=torch.float32)


@kernel_op("attention_fwd", _fake_fwd)
def attention_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, scale: float,
                     causal: bool, window_left: int | None, window_right: int | None,
                     softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel's launch as the op ``portable_ops_nki::attention_fwd``: a contiguous ``out`` and
    ``lse [B, Hq, Sq]`` float32; differentiable in q, k, v and sinks (``[Hq]``) through the backward op."""
    out, lse = _in_launches(attention_fwd_kernel, q, k, (q.contiguous(), k.contiguous(), v.contiguous()), {},
                            dict(sinks=_sinks_down_partitions(sinks)),
                            dict(scale=scale, causal=causal, window_left=window_left, window_right=window_right,
                                 softcap=softcap))
    return out, lse.reshape(q.shape[:-1])


def _rows(t, q):
    """A ``[B, Hq, Sq]`` row vector as the kernels' ``[B, Hq, Sq, 1]`` float32 (None for None)."""
    return None if t is None else t.to(torch.float32).reshape(*q.shape[:-1], 1).contiguous()


def _dsinks_like(q, sinks):
    """The backward op's last output without its values: ``[Hq]`` in sinks' dtype, empty without sinks."""
    return q.new_empty(0, dtype=torch.float32) if sinks is None else sinks.new_empty(sinks.shape)


def _fake_bwd(q, k, v, out, lse, dout, sinks, dlse, scale, causal, window_left, window_right, softcap):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), _dsinks_like(q, sinks)


@kernel_op("attention_bwd", _fake_bwd)
def attention_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                     dout: torch.Tensor, sinks: torch.Tensor | None, dlse: torch.Tensor | None, scale: float,
                     causal: bool, window_left: int | None, window_right: int | None, softcap: float | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward kernel's launch as the op ``portable_ops_nki::attention_bwd``: contiguous ``(dq, dk, dv,
    dsinks)``, dsinks empty without sinks (an op's outputs are fixed)."""
    dq, dk, dv, *dsink_rows = _in_launches(
        attention_bwd_kernel, q, k, (q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), _rows(lse, q),
                                     dout.to(q.dtype).contiguous()),
        dict(dlse=_rows(dlse, q)), dict(sinks=_sinks_down_partitions(sinks)),
        dict(scale=scale, causal=causal, window_left=window_left, window_right=window_right, softcap=softcap))
    dsinks = dsink_rows[0].sum((0, 2, 3)).to(sinks.dtype) if sinks is not None else _dsinks_like(q, None)
    return dq, dk, dv, dsinks


def _save(ctx, inputs, output):
    q, k, v, sinks, *options = inputs
    ctx.save_for_backward(q, k, v, sinks, *output)
    ctx.options = options
    ctx.set_materialize_grads(False)  # no dlse unless lse was used


def _backward(ctx, dout, dlse):
    q, k, v, sinks, out, lse = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    dq, dk, dv, dsinks = attention_bwd_op(q, k, v, out, lse, dout, sinks, dlse, *ctx.options)
    return dq, dk, dv, dsinks if sinks is not None else None, *(None,) * len(ctx.options)


attention_fwd_op.op.register_autograd(_backward, setup_context=_save)


def attention_fwd(q, k, v, *, causal, scale, window=None, softcap=None, sinks=None):
    """The kernels take contiguous ``[B, H, S, D]``; ``out`` comes back in the layout
    portable_ops/layout.py gives q's output (a copy only when q's heads are inner to its sequence)."""
    out, lse = attention_fwd_op(q, k, v, sinks, **_static(causal, scale, window, softcap))
    return as_layout_of(out, q), lse


def attention_bwd(q, k, v, out, lse, dout, *, causal, scale, window=None, softcap=None, sinks=None, dlse=None):
    """``(dq, dk, dv)``, and ``dsinks`` after them when there are sinks."""
    dq, dk, dv, dsinks = attention_bwd_op(q, k, v, out, lse, dout, sinks, dlse,
                                          **_static(causal, scale, window, softcap))
    grads = as_layout_of(dq, q), as_layout_of(dk, k), as_layout_of(dv, v)
    return grads if sinks is None else (*grads, dsinks)
