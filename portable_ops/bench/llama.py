"""A Llama-style decoder, written the way transformers are: the end-to-end benchmark's model.

RoPE computed in float32, grouped-query attention with q, k and v sliced from one projection and
transposed out of ``[B, S, H, D]``, RMSNorm, a SwiGLU MLP, an untied output head. Parameters stay
float32; training runs it under bf16 autocast, so after RoPE attention gets float32 q and k and a
bf16 v, as in a real model. ``attention`` picks the kernel: ``"portable_ops"``, ``"sdpa"``
(``F.scaled_dot_product_attention`` with its default backend choice) or ``"sdpa-flash"`` (SDPA held
to its flash backend). ``ops`` picks the rest: ``"torch"`` (the above) or ``"portable_ops"``: its
RMSNorm modules, ``portable_ops.rope`` on the transposed q and k (rotated in their own dtype, bf16
under autocast, as transformers does after casting cos and sin) and ``portable_ops.linear_cross_entropy``
for the head and the loss, which never forms the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import portable_ops
import portable_ops.nn


@dataclass(frozen=True)
class LlamaConfig:
    d_model: int = 1024
    layers: int = 8
    heads: int = 16
    kv_heads: int = 4
    seq: int = 2048
    batch: int = 4
    vocab: int = 32000
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def hidden(self) -> int:
        """SwiGLU width: 8/3 of d_model, rounded up to a multiple of 256 (Llama's rule)."""
        return -(-8 * self.d_model // 3 // 256) * 256


def _sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def _sdpa_flash(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return _sdpa(q, k, v, causal)


def _portable_ops(q, k, v, causal):
    return portable_ops.attention(q, k, v, causal=causal)


# "sdpa-flash": torch's stack with another of its attention kernels, the same function computed with
# other roundings (the benchmark's measure of how far apart bf16 noise alone sends two loss curves)
ATTENTION = {"sdpa": _sdpa, "sdpa-flash": _sdpa_flash, "portable_ops": _portable_ops}


def rope_tables(cfg: LlamaConfig, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = cfg.rope_theta ** (-torch.arange(0, cfg.head_dim, 2, dtype=torch.float32, device=device) / cfg.head_dim)
    angles = torch.outer(torch.arange(cfg.seq, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]  # [S, 1, D]: broadcast over heads
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """x ``[B, S, H, D]`` rotated in float32 (HF's rotate-half form)."""
    x = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    s = x.shape[1]
    return x * cos[:s] + rotated * sin[:s]


def _torch_rope(q, k, cos, sin):
    """q, k ``[B, S, H, D]`` -> ``[B, H, S, D]``, rotated in float32."""
    return apply_rope(q, cos, sin).transpose(1, 2), apply_rope(k, cos, sin).transpose(1, 2)


def _portable_ops_rope(q, k, cos, sin):
    s = q.shape[1]
    return portable_ops.rope(q.transpose(1, 2), k.transpose(1, 2), cos[:s, 0], sin[:s, 0])


def _torch_loss(hidden, head, targets):
    return F.cross_entropy(head(hidden).float().flatten(0, -2), targets.reshape(-1))


def _portable_ops_loss(hidden, head, targets):
    return portable_ops.linear_cross_entropy(hidden, head.weight, targets)


@dataclass(frozen=True)
class Ops:
    """What runs the model's norms, RoPE and head + loss."""
    norm: type
    rope: object
    loss: object


OPS = {"torch": Ops(nn.RMSNorm, _torch_rope, _torch_loss),
       "portable_ops": Ops(portable_ops.nn.RMSNorm, _portable_ops_rope, _portable_ops_loss)}


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, attention: str, ops: Ops):
        super().__init__()
        self.cfg, self.attention, self.rope = cfg, ATTENTION[attention], ops.rope
        self.qkv = nn.Linear(cfg.d_model, (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim, bias=False)
        self.out = nn.Linear(cfg.heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        cfg = self.cfg
        q, k, v = self.qkv(x).view(b, s, cfg.heads + 2 * cfg.kv_heads, cfg.head_dim).split(
            [cfg.heads, cfg.kv_heads, cfg.kv_heads], dim=2)
        q, k = self.rope(q, k, cos, sin)
        y = self.attention(q, k, v.transpose(1, 2), True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, attention: str, ops: Ops):
        super().__init__()
        self.attn_norm, self.mlp_norm = ops.norm(cfg.d_model), ops.norm(cfg.d_model)
        self.attn = Attention(cfg, attention, ops)
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.d_model, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig, attention: str = "portable_ops", ops: str = "torch"):
        super().__init__()
        self.cfg, self.loss = cfg, OPS[ops].loss
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, attention, OPS[ops]) for _ in range(cfg.layers))
        self.norm = OPS[ops].norm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        cos, sin = rope_tables(cfg, None)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens, targets):
        """Mean next-token cross-entropy (computed in float32)."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return self.loss(self.norm(x), self.head, targets)


def batches(cfg: LlamaConfig, steps: int, device, seed: int = 0):
    """Token batches of a learnable sequence (a noisy repeating pattern over a few hundred tokens),
    the same for every model given the seed: losses fall, so the curves of two stacks can be compared."""
    g = torch.Generator().manual_seed(seed)
    period = 97
    pattern = torch.randint(0, min(cfg.vocab, 512), (period,), generator=g)
    for _ in range(steps):
        offsets = torch.randint(0, period, (cfg.batch, 1), generator=g)
        positions = (offsets + torch.arange(cfg.seq + 1)) % period
        tokens = pattern[positions]
        noise = torch.rand(tokens.shape, generator=g) < 0.1
        tokens = torch.where(noise, torch.randint(0, cfg.vocab, tokens.shape, generator=g), tokens)
        tokens = tokens.to(device, non_blocking=True)
        yield tokens[:, :-1], tokens[:, 1:]
