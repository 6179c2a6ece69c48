"""A small GPT-2-style language model trained with portable_ops' attention, AdamW and fused clip.

    python examples/gpt2_tiny.py --backend reference --steps 300
    python examples/gpt2_tiny.py --backend triton --device cuda --steps 300 --compare-torch

The text is generated (a seeded grammar of short sentences), so nothing is downloaded. With
``--compare-torch`` the same model is also trained with ``F.scaled_dot_product_attention`` and
``torch.optim.AdamW(fused=True)`` plus ``clip_grad_norm_``, and both throughputs are printed.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import portable_ops
from portable_ops import cli


@dataclass
class Config:
    vocab: int = 64
    seq: int = 64
    d_model: int = 64
    heads: int = 2
    kv_heads: int = 1  # grouped-query attention; head_dim 32
    layers: int = 2
    batch: int = 8
    lr: float = 3e-3
    max_grad_norm: float = 1.0
    dtype: str = "float32"


def corpus(chars: int, seed: int = 0) -> str:
    """Sentences from a tiny seeded grammar: enough structure for the loss to fall steadily."""
    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "my friend", "the old man", "every bird", "our teacher"]
    verbs = ["sees", "likes", "follows", "paints", "finds", "remembers"]
    objects = ["the river", "a red ball", "the moon", "some bread", "the garden", "a quiet song"]
    out = []
    while sum(map(len, out)) < chars:
        out.append(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}. ")
    return "".join(out)[:chars]


class Attention(nn.Module):
    def __init__(self, cfg: Config, use_torch: bool):
        super().__init__()
        self.cfg, self.use_torch = cfg, use_torch
        self.head_dim = cfg.d_model // cfg.heads
        self.qkv = nn.Linear(cfg.d_model, (cfg.heads + 2 * cfg.kv_heads) * self.head_dim)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.cfg.heads * self.head_dim, self.cfg.kv_heads * self.head_dim,
                                     self.cfg.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, s, self.cfg.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.cfg.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.cfg.kv_heads, self.head_dim).transpose(1, 2)
        if self.use_torch:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            y = portable_ops.attention(q, k, v, causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, cfg: Config, use_torch: bool):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg, use_torch)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                 nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: Config, use_torch: bool = False):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, use_torch) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.tok.weight.T  # tied embeddings


def batches(cfg: Config, steps: int, device, seed: int = 0):
    text = corpus(cfg.batch * cfg.seq * 64, seed)
    data = torch.tensor([min(ord(c) - 32, cfg.vocab - 1) for c in text], dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - cfg.seq - 1, (cfg.batch,), generator=g)
        chunk = torch.stack([data[s:s + cfg.seq + 1] for s in starts]).to(device)
        yield chunk[:, :-1], chunk[:, 1:]


class Progress:
    """A bar on a terminal (redrawn at most ten times a second), ten lines in a log. The loss is
    read only when a line is written: reading it waits for the device, and a wait every step
    would keep the host from queueing the next step while the device runs this one."""

    def __init__(self, total: int, stream=None):
        self.total, self.stream = total, stream or sys.stderr
        self.start = self.last = time.perf_counter()

    def __call__(self, step: int, loss: torch.Tensor):
        now, tty = time.perf_counter(), self.stream.isatty()
        due = now - self.last >= 0.1 if tty else step % max(1, self.total // 10) == 0
        if not (due or step in (1, self.total)):
            return
        self.last, width = now, 30
        done = int(width * step / self.total)
        end = "\n" if step == self.total or not tty else "\r"
        self.stream.write(f"[{'#' * done}{'.' * (width - done)}] {step}/{self.total} loss {loss.item():.4f} "
                          f"{step / max(now - self.start, 1e-9):.1f} it/s{end}")
        self.stream.flush()


WARMUP_STEPS = 10  # kernels compile (and triton's attention tunes its tiles) here: not counted in tokens/s


def _profile_too_long(steps: int, profile_steps: int) -> str | None:
    if profile_steps and steps < WARMUP_STEPS + profile_steps:
        return f"profiling {profile_steps} steps after the warm-up needs at least {WARMUP_STEPS + profile_steps} steps"
    return None


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def train(cfg: Config, steps: int, device="cpu", backend: str | None = None, use_torch: bool = False,
          seed: int = 0, show_progress: bool = False, profile_steps: int = 0) -> dict:
    """Train from a seeded initialisation; returns the per-step losses and the tokens per second of
    the steps after the first ``WARMUP_STEPS`` (all steps when there are no more than that).

    ``profile_steps``: run torch.profiler over that many steps after the warm-up and return its
    table of the operators and kernels that took the most time (the rate then includes its overhead)."""
    torch.manual_seed(seed)
    dtype = getattr(torch, cfg.dtype)
    model = GPT(cfg, use_torch).to(device, dtype)
    if use_torch:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=torch.device(device).type in ("cpu", "cuda"))
    else:
        opt = portable_ops.optim.AdamW(model.parameters(), lr=cfg.lr, max_grad_norm=cfg.max_grad_norm)
    losses, start = [], time.perf_counter()
    timed_from, timed_start = 0, start
    show = Progress(steps) if show_progress else None
    if problem := _profile_too_long(steps, profile_steps):
        raise ValueError(problem)
    profiler = _profiler(device) if profile_steps else None
    context = portable_ops.use_backend(backend) if backend else _nothing()
    with context:
        for step, (x, y) in enumerate(batches(cfg, steps, device, seed), 1):
            loss = F.cross_entropy(model(x).float().view(-1, cfg.vocab), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if use_torch:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm, foreach=True)
            opt.step()
            losses.append(loss.detach())
            if show:
                show(step, losses[-1])
            if step == WARMUP_STEPS and steps > WARMUP_STEPS:
                _sync(device)
                timed_from, timed_start = step, time.perf_counter()
            if profiler and step == WARMUP_STEPS:
                profiler.start()
            if profiler and step == WARMUP_STEPS + profile_steps:
                _sync(device)
                profiler.stop()
    _sync(device)
    end = time.perf_counter()
    result = {"losses": [l.item() for l in losses],
              "tokens_per_s": (steps - timed_from) * cfg.batch * cfg.seq / (end - timed_start),
              "seconds": end - start, "warmup_seconds": timed_start - start}
    if profiler:
        on_device = torch.device(device).type == "cuda"
        result["profile"] = profiler.key_averages().table(
            sort_by="self_cuda_time_total" if on_device else "self_cpu_time_total", row_limit=15,
            max_name_column_width=60)
    return result


def _profiler(device):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["reference", "triton", "nki"],
                        help="force a backend (default: by device)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", help="write losses and throughput here")
    parser.add_argument("--compare-torch", action="store_true", help="also train with SDPA + torch fused AdamW")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="profile this many steps after the warm-up and print where the time went")
    for field, default in asdict(Config()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(default), default=default)
    args = parser.parse_args(argv)
    cfg = Config(**{f: getattr(args, f) for f in asdict(Config())})
    if problem := _profile_too_long(args.steps, args.profile):
        parser.error(problem)  # before any training
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    try:
        cli.device(args.device)
        if args.json:
            cli.writable_file("--json", args.json)
    except ValueError as exc:
        parser.error(str(exc))
    result = {"config": asdict(cfg), "portable_ops": train(cfg, args.steps, args.device, args.backend,
                                                           show_progress=True, profile_steps=args.profile)}
    if args.compare_torch:
        result["torch"] = train(cfg, args.steps, args.device, use_torch=True, show_progress=True,
                                profile_steps=args.profile)
    for name in ("portable_ops", "torch"):
        if name in result:
            r = result[name]
            if "profile" in r:
                print(f"{name}: {args.profile} steps after the warm-up\n{r.pop('profile')}")
            print(f"{name:<13} first loss {r['losses'][0]:.4f}  last loss {r['losses'][-1]:.4f}  "
                  f"{r['tokens_per_s']:,.0f} tokens/s (warm-up {r['warmup_seconds']:.1f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    final = result["portable_ops"]["losses"][-1]
    return 0 if math.isfinite(final) else 1


if __name__ == "__main__":
    sys.exit(main())
