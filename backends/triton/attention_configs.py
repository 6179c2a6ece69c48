"""The tl.* attention kernels' launch shapes: how a head dim splits into column chunks, the tile candidates
each shape bucket times on first use (autotune.py), the decode's and the interpreter's tiles, how many
ranges a decode's keys are shared out in, and how tiles multiply float32."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton

from . import attention_bwd_kernels, attention_fwd_kernels, attention_sm90, attention_tiles
from .autotune import Tuner, bucket
from .interpreter import INTERPRETED, to_dtype


def head_split(d: int) -> tuple[int, int]:
    """The column chunks ``(D0, D1)`` that cover head dim ``d``: the largest power of two <= d (at
    least 16, tl.dot's smallest), then the smallest power of two >= 16 covering the rest; one chunk
    of the next power of two when the second would be as wide as the first. 80 -> (64, 16),
    96 -> (64, 32), 192 -> (128, 64), 40 -> (32, 16), 56 -> (64, 0), 128 -> (128, 0)."""
    d0 = max(16, 1 << (d.bit_length() - 1))
    rest = d - d0
    if rest <= 0:
        return d0, 0
    d1 = max(16, triton.next_power_of_2(rest))
    return (2 * d0, 0) if d1 >= d0 else (d0, d1)


def tile_width(d: int, dv: int) -> int:
    """The columns a kernel's widest tile row holds: a q/k row's (head dim ``d``) or a v/o row's (``dv``)."""
    return max(sum(head_split(d)), sum(head_split(dv)))


class TileConfig(NamedTuple):
    """A tl.* kernel's tile and schedule, named as its launch takes them."""

    BLOCK_M: int  # query rows a tile
    BLOCK_N: int  # keys a tile
    num_warps: int
    num_stages: int


# Each kernel's candidates by tile width (D0 + D1, the columns a tile holds), best known first; the sweep sets them.
CONFIGS = {
    "fwd": {16: [TileConfig(128, 64, 4, 3), TileConfig(64, 64, 4, 3)],
            32: [TileConfig(128, 64, 4, 3), TileConfig(64, 64, 4, 3)],
            48: [TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 3)],
            64: [TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 3), TileConfig(128, 128, 8, 4)],
            80: [TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 3), TileConfig(128, 128, 8, 3)],
            96: [TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 3), TileConfig(128, 128, 8, 3)],
            128: [TileConfig(128, 128, 8, 3), TileConfig(64, 64, 4, 3), TileConfig(128, 64, 8, 3)],
            144: [TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 3)],
            160: [TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 3)],
            192: [TileConfig(128, 64, 8, 2), TileConfig(64, 64, 4, 2), TileConfig(64, 64, 8, 2)],
            256: [TileConfig(64, 64, 8, 2), TileConfig(64, 32, 4, 2)]},
    "dkdv": {16: [TileConfig(32, 128, 4, 3), TileConfig(32, 64, 4, 3)],
             32: [TileConfig(32, 128, 4, 3), TileConfig(32, 64, 4, 3)],
             48: [TileConfig(32, 128, 4, 3), TileConfig(32, 64, 4, 3)],
             64: [TileConfig(32, 128, 4, 3), TileConfig(64, 128, 8, 3), TileConfig(32, 64, 4, 3)],
             80: [TileConfig(64, 128, 8, 3), TileConfig(32, 64, 4, 3)],
             96: [TileConfig(64, 128, 8, 3), TileConfig(32, 64, 4, 3)],
             128: [TileConfig(64, 128, 8, 3), TileConfig(32, 64, 4, 3), TileConfig(64, 128, 8, 2)],
             144: [TileConfig(32, 64, 4, 2), TileConfig(64, 64, 8, 2)],
             160: [TileConfig(32, 64, 4, 2), TileConfig(64, 64, 8, 2)],
             192: [TileConfig(32, 64, 4, 2), TileConfig(32, 32, 4, 2)],
             256: [TileConfig(32, 32, 4, 2)]},
    "dq": {16: [TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 3)],
           32: [TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 3)],
           48: [TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 3)],
           64: [TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 3), TileConfig(128, 32, 4, 3)],
           80: [TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 3), TileConfig(128, 32, 4, 3)],
           96: [TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 3), TileConfig(128, 32, 4, 3)],
           128: [TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 3), TileConfig(128, 32, 4, 3)],
           144: [TileConfig(64, 64, 8, 2), TileConfig(64, 32, 4, 2)],
           160: [TileConfig(64, 64, 8, 2), TileConfig(64, 32, 4, 2)],
           192: [TileConfig(64, 64, 8, 2), TileConfig(64, 32, 4, 2)],
           256: [TileConfig(64, 32, 8, 2), TileConfig(32, 32, 4, 2)]},
}
INTERPRETER_CONFIG = TileConfig(32, 32, 4, 1)  # one small tile: every tile costs real time there
DECODE_CONFIG = TileConfig(16, 64, 4, 3)  # a decode's few query rows: a taller query tile would be padding
DECODE_CONFIG_WIDE_HEADS = TileConfig(16, 32, 4, 3)  # heads over 128 columns: K/V tiles of 64 keys hold twice the data
# On sm_90, a decode whose programs would take DECODE_CONFIG more than one wave streams its keys in wider tiles.
DECODE_CONFIG_WIDE_KEYS = TileConfig(16, 128, 4, 3)
DECODE_NARROW_PER_SM = 3  # programs of DECODE_CONFIG whose shared memory fits one SM at D 128
# an edit to the kernels' source is tuned afresh
_tuner = Tuner(name="attention", sources=(attention_tiles, attention_fwd_kernels, attention_bwd_kernels, to_dtype))


def tile_config(kernel: str, q, sq, skv, hkv, causal, precision, launch, programs=0, dv=None) -> TileConfig:
    """``q``: the [B, H, S, D] view; ``sq``, ``skv``: each sequence's (longest) query and key lengths;
    ``programs``: a decode's (sequences x heads a program takes); ``dv``: v's head dim (None: q's)."""
    if INTERPRETED:
        return INTERPRETER_CONFIG
    b, h, _, d = q.shape
    dv = d if dv is None else dv
    if kernel == "fwd" and sq <= 16:
        return decode_tile_config(q, programs, dv)
    key = (kernel, d, dv, q.dtype, precision, causal, bucket(sq), bucket(skv), bucket(b * h), h // max(hkv, 1))
    return _tuner.pick(key, CONFIGS[kernel][tile_width(d, dv)], launch)


def decode_tile_config(q, programs: int, dv: int | None = None) -> TileConfig:
    """The split-key forward's tiles for ``programs`` (sequences x the heads a program takes) over ``q``'s
    head dim and v's ``dv`` (None: q's). The wide key tiles only past DECODE_NARROW_PER_SM programs an SM,
    where a second wave of the narrow ones would run part empty, and only where they were measured and fit:
    sm_90, heads of one column chunk of 128 (narrower ones spill in them), a 2-byte dtype (float32 tiles would
    not fit shared memory)."""
    dv = q.shape[-1] if dv is None else dv
    if head_split(q.shape[-1]) == head_split(dv) == (128, 0) and q.element_size() == 2:
        index = attention_sm90.device_index(q.device)
        if programs > DECODE_NARROW_PER_SM * multiprocessors(index) and attention_sm90.is_sm90(index):
            return DECODE_CONFIG_WIDE_KEYS
    return DECODE_CONFIG_WIDE_HEADS if tile_width(q.shape[-1], dv) > 128 else DECODE_CONFIG


@functools.lru_cache(maxsize=None)
def multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


MAX_SPLITS = 64  # the merge holds a [splits, D] float32 tile per row in registers


def key_splits(b, h, sq, skv, block_m, block_n, device=None) -> int:
    """How many key ranges to split a forward into: decode (one query block) over a long cache leaves most
    of the GPU idle unless the keys are shared out too. One wave, since a second was slower: as many ranges
    as keep programs x ranges within the SM count, each of at least two key blocks."""
    if sq > block_m or b * h == 0:  # prefill, or no programs at all
        return 1
    # the interpreter, as if on four SMs: small test shapes still take the split path
    sms = 4 if INTERPRETED else multiprocessors(attention_sm90.device_index(device) if device is not None
                                                else torch.cuda.current_device())
    return max(1, min(sms // (b * h), skv // (2 * block_n), MAX_SPLITS))


def upcast(dtype) -> bool:
    # The interpreter computes bf16 dot products wrongly (seen with triton 3.9): upcast there.
    return INTERPRETED and dtype == torch.bfloat16


def dot_precision(dtype) -> str:
    """How tl.dot multiplies float32 tiles: as torch's own float32 matmuls on CUDA do, so a float32
    model means the same thing on every backend. TF32 only where the user allowed it
    (``torch.set_float32_matmul_precision("high")`` or ``torch.backends.cuda.matmul.fp32_precision``);
    torch's default, "highest", is IEEE float32. The kernels pass it to every ``tl.dot`` as
    ``input_precision``: Triton 3.6 decides a dot's default in ``tl.dot`` itself, from
    ``TRITON_F32_DEFAULT``, and ignores a launch's ``default_dot_input_precision``. Half-precision tiles
    are exact products either way and pass "ieee", which every target accepts (AMD's only take "ieee"
    and the bf16x3/x6 emulations)."""
    if dtype != torch.float32 or torch.version.hip is not None:
        return "ieee"
    for read in (lambda: torch.backends.cuda.matmul.fp32_precision == "tf32",
                 lambda: torch.backends.cuda.matmul.allow_tf32):
        try:  # torch raises when the legacy and the new TF32 switches were both set: try the other one
            return "tf32" if read() else "ieee"
        except (AttributeError, RuntimeError):
            continue
    return "ieee"
