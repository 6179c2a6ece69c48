"""Hugging Face transformers models trained with each attention implementation: ``python -m portable_ops.bench hf``.

Random-initialised ``LlamaForCausalLM`` and ``MistralForCausalLM`` (a sliding window) built from configs, no
downloads, trained (fp32 parameters, bf16 autocast on CUDA) with

* each transformers attention implementation installed here: "sdpa", "flash_attention_2" (where ``flash_attn``
  imports) and "flex_attention" (on CUDA: it has no CPU backward), with ``clip_grad_norm_(foreach=True)`` and
  ``torch.optim.AdamW(fused=True)``;
* portable_ops through the integration (``attn_implementation=register()``), with
  ``portable_ops.optim.AdamW(max_grad_norm=...)``;

each eagerly and as ``torch.compile(model)`` (the optimizer step eager on both sides), from the same weights
on the same batches. A step is ``model(input_ids=tokens, labels=tokens).loss`` (transformers' loss, the
config's defaults), backward and the optimizer step. Every variant of a (model, mode) warms up first
(compilation happens there), then the variants take turns over several rounds of timed steps, in a rotated
order, so that a drift of the machine's speed reaches all of them. Per variant: the median tokens/s over the
rounds and their range, the ratio to the best transformers implementation of the same (model, mode), peak
memory (less the other variants' weights and optimizer state, which stay allocated), and the loss: the last
step's, its difference to "sdpa"'s in the same mode, and the largest difference over all steps, beside
transformers' own spread (the largest such difference between two runs of transformers' implementations of
the model). A variant that fails (a kernel, a compile) gets a row with its error; the others run on.

``--tiny`` shrinks both models to seconds of CPU (float32, no autocast, eager only): a smoke run, not a
measurement.
"""

from __future__ import annotations

import gc
import platform
import re
import time
from dataclasses import asdict, dataclass, replace
from types import SimpleNamespace

import torch

import portable_ops

from .common import median, sync
from .llama import batches
from .train import HYPER, LR_WARMUP_STEPS, MAX_GRAD_NORM


@dataclass(frozen=True)
class Shape:
    family: str  # "llama" or "mistral": the transformers model class
    hidden: int = 1024
    layers: int = 8
    heads: int = 16
    kv_heads: int = 4
    intermediate: int = 2816
    vocab: int = 32000
    seq: int = 2048
    batch: int = 4
    window: int | None = None  # Mistral's sliding_window


SHAPES = {"llama": Shape("llama"), "mistral": Shape("mistral", window=512)}
MODES = ("eager", "compiled")
TRANSFORMERS_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "flex_attention")
WARMUP_STEPS, TIMED_STEPS, ROUNDS = 10, 20, 3
SEED = 0


def tiny(shape: Shape) -> Shape:
    """The same architecture at a size a CPU trains in seconds; the window still cuts the sequence."""
    return replace(shape, hidden=64, layers=2, heads=4, kv_heads=1, intermediate=176, vocab=256, seq=64, batch=2,
                   window=16 if shape.window else None)


def _transformers():
    from portable_ops.integrations.transformers import _transformers

    return _transformers()


def config(shape: Shape):
    transformers = _transformers()
    common = dict(hidden_size=shape.hidden, num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                  num_key_value_heads=shape.kv_heads, intermediate_size=shape.intermediate, vocab_size=shape.vocab,
                  max_position_embeddings=shape.seq, attention_dropout=0.0, tie_word_embeddings=False)
    if shape.family == "mistral":
        return transformers.MistralConfig(sliding_window=shape.window, **common)
    return transformers.LlamaConfig(**common)


def implementations(device: torch.device) -> list[str]:
    """transformers' implementations installed for ``device``, then portable_ops' (registered here)."""
    from transformers.utils import is_flash_attn_2_available, is_torch_flex_attn_available

    from portable_ops.integrations.transformers import register

    found = ["sdpa"]
    if device.type == "cuda" and is_flash_attn_2_available():
        found.append("flash_attention_2")
    # FlexAttention has no backward on CPU (torch raises NotImplementedError)
    if device.type == "cuda" and is_torch_flex_attn_available():
        found.append("flex_attention")
    return [*found, register()]


def _held_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                if isinstance(t, torch.Tensor)}
    return sum(storages.values())


def _compiled(model, name: str):
    """``torch.compile`` of a call of ``model`` through a code object of this variant's own. Dynamo keeps its
    compiled entries per code object and tries the last one hit first: through ``torch.compile(model)`` every
    transformers model enters at one shared function, and the entry of a variant whose graph breaks early,
    guarded on little, is taken by the next model of the class (sound, but that model then runs in pieces)."""
    def forward(**inputs):
        return model(**inputs)

    forward.__code__ = forward.__code__.replace(co_name="forward_" + re.sub(r"\W", "_", name))
    return torch.compile(forward)


class Variant:
    """One (model, attention implementation, mode): its model, optimizer, lr schedule and step."""

    def __init__(self, shape: Shape, attention: str, mode: str, weights: dict, data: list, device: torch.device,
                 autocast: bool):
        transformers = _transformers()
        self.attention, self.mode, self.device, self.data, self.autocast = attention, mode, device, data, autocast
        self.ours = attention not in TRANSFORMERS_IMPLEMENTATIONS
        with torch.device(device):  # initialised where it runs (faster), then overwritten with the common weights
            self.model = transformers.AutoModelForCausalLM.from_config(config(shape), attn_implementation=attention)
        self.model.load_state_dict(weights)
        self.model.train()
        params = list(self.model.parameters())
        if self.ours:
            self.opt = portable_ops.optim.AdamW(params, max_grad_norm=MAX_GRAD_NORM, **HYPER)
        else:
            self.opt = torch.optim.AdamW(params, fused=device.type == "cuda", **HYPER)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / LR_WARMUP_STEPS))
        self.forward = _compiled(self.model, attention) if mode == "compiled" else self.model
        self.losses: list[torch.Tensor] = []

    def step(self):
        tokens = self.data[len(self.losses)]
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            # The plain call: use_cache=False without a mask makes transformers look for packed sequences
            loss = self.forward(input_ids=tokens, labels=tokens).loss
        loss.backward()
        if not self.ours:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_GRAD_NORM, foreach=True)
        self.opt.step()
        self.schedule.step()
        self.opt.zero_grad(set_to_none=True)
        self.losses.append(loss.detach())

    def held_bytes(self) -> int:
        """What this variant keeps between steps: its parameters and optimizer state."""
        state = [t for s in self.opt.state.values() for t in s.values()]
        return _held_bytes([*self.model.parameters(), *state])


def _initial(shape: Shape, steps: int, device: torch.device) -> tuple[dict, list]:
    """The weights every variant starts from and the batches every variant trains on."""
    transformers = _transformers()
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config(shape))
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = SimpleNamespace(vocab=shape.vocab, batch=shape.batch, seq=shape.seq)
    return weights, [tokens for tokens, _ in batches(cfg, steps, device, SEED)]


def _compilations() -> tuple[int, int]:
    """Dynamo's counts so far in this process: graphs compiled, graph breaks."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _measure_group(shape: Shape, mode: str, attentions: list[str], weights: dict, data: list, device, autocast,
                   warmup: int, timed: int, rounds: int, progress) -> list[dict]:
    """Warm every variant up, then time them in turns; one row per variant."""
    torch._dynamo.reset()  # each (model, mode) compiles as a fresh process would
    variants, rows = [], {}
    for attention in attentions:
        row = rows[attention] = {"attention": attention, "mode": mode}
        try:
            variant = Variant(shape, attention, mode, weights, data, device, autocast)
            graphs, breaks = _compilations()
            sync(device)
            start = time.perf_counter()
            for _ in range(warmup):
                variant.step()
            sync(device)
            row["warm-up s"] = time.perf_counter() - start
            if mode == "compiled":
                now = _compilations()
                row["graphs"], row["graph breaks"] = now[0] - graphs, now[1] - breaks
                row["graphs compiled while timed"] = 0
            variants.append(variant)
        except Exception as error:  # one implementation failing (a kernel, a compile) leaves the others' figures
            variant = None
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
            progress(f"  {attention:<18} {mode:<8} failed: {row['error']}")
        finally:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if not variants:
        return list(rows.values())
    times = {v.attention: [] for v in variants}
    peaks = {v.attention: 0 for v in variants}
    tokens = shape.batch * shape.seq
    for r in range(rounds):
        for variant in variants[r % len(variants):] + variants[:r % len(variants)]:
            if device.type == "cuda":
                sync(device)
                others = torch.cuda.memory_allocated(device) - variant.held_bytes()
                torch.cuda.reset_peak_memory_stats(device)
            graphs = _compilations()[0]
            sync(device)
            start = time.perf_counter()
            for _ in range(timed):
                variant.step()
            sync(device)
            times[variant.attention].append(time.perf_counter() - start)
            if mode == "compiled":  # a recompile here would be timed: the row says so
                rows[variant.attention]["graphs compiled while timed"] += _compilations()[0] - graphs
            if device.type == "cuda":  # as if it were alone: less the other variants' weights and state
                peaks[variant.attention] = max(peaks[variant.attention],
                                               torch.cuda.max_memory_allocated(device) - others)
    for variant in variants:
        speeds = sorted(tokens * timed / s for s in times[variant.attention])
        row = rows[variant.attention]
        row.update({"optimizer": ("portable_ops AdamW(max_grad_norm)" if variant.ours
                                  else "torch AdamW(fused) + clip_grad_norm_"),
                    "tokens/s": median(speeds), "tokens/s min": speeds[0], "tokens/s max": speeds[-1],
                    "ms/step": tokens / median(speeds) * 1e3,
                    "peak GiB": peaks[variant.attention] / 2**30 if device.type == "cuda" else None,
                    "losses": torch.stack(variant.losses).float().cpu().tolist()})
        row["final loss"] = row["losses"][-1]
        progress(f"  {variant.attention:<18} {mode:<8} {row['tokens/s']:10.0f} tokens/s "
                 f"({row['tokens/s min']:.0f} to {row['tokens/s max']:.0f}), warm-up {row['warm-up s']:.1f} s")
    del variants
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return list(rows.values())


def _max_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def _compare(rows: list[dict]) -> None:
    """Ratios to the best transformers implementation of the same mode, and loss gaps to "sdpa"'s, in place."""
    timed = [r for r in rows if "tokens/s" in r]
    theirs = [r for r in timed if r["attention"] in TRANSFORMERS_IMPLEMENTATIONS]
    own = [_max_gap(a["losses"], b["losses"]) for i, a in enumerate(theirs) for b in theirs[i + 1:]]
    for row in timed:
        same_mode = [r for r in theirs if r["mode"] == row["mode"]]
        if same_mode:
            best = max(same_mode, key=lambda r: r["tokens/s"])
            row["best transformers"] = best["attention"]
            row["vs best transformers"] = row["tokens/s"] / best["tokens/s"]
        sdpa = next((r for r in theirs if r["mode"] == row["mode"] and r["attention"] == "sdpa"), None)
        if sdpa is not None:
            row["loss - sdpa's"] = row["final loss"] - sdpa["final loss"]
            row["max |loss - sdpa's|"] = _max_gap(row["losses"], sdpa["losses"])
        row["transformers' own loss spread"] = max(own) if own else None


def run_hf(shapes: dict[str, Shape] | None = None, device=None, modes=None, attentions=None,
           warmup: int = WARMUP_STEPS, timed: int = TIMED_STEPS, rounds: int = ROUNDS, autocast=None,
           progress=print) -> list[dict]:
    """Train every (model, mode, attention implementation); returns one row per variant.
    Defaults: both SHAPES, MODES on CUDA and eager only elsewhere, every implementation installed for the
    device, bf16 autocast on CUDA only."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = SHAPES if shapes is None else shapes
    modes = modes or (MODES if device.type == "cuda" else ("eager",))
    attentions = attentions or implementations(device)
    autocast = device.type == "cuda" if autocast is None else autocast
    rows, start = [], time.perf_counter()
    for name, shape in shapes.items():
        progress(f"{name}: {asdict(shape)} ({time.perf_counter() - start:.0f} s in)")
        weights, data = _initial(shape, warmup + rounds * timed, device)
        model_rows = []
        for mode in modes:
            model_rows += _measure_group(shape, mode, attentions, weights, data, device, autocast, warmup, timed,
                                         rounds, progress)
        _compare(model_rows)
        rows += [{"model": name, **row} for row in model_rows]
    return rows


def info(device: torch.device) -> dict:
    """What the rows need said beside device_info's: the transformers release, the shapes, the protocol."""
    from .common import device_info

    found = device_info()
    if device.type != "cuda":
        found["device"] = f"CPU ({platform.machine()})"
    found["transformers"] = _transformers().__version__
    return found


def protocol(shapes: dict[str, Shape], warmup: int, timed: int, rounds: int, autocast: bool) -> dict:
    return {"shapes": {name: asdict(shape) for name, shape in shapes.items()}, "warm-up steps": warmup,
            "timed steps per round": timed, "rounds": rounds, "autocast": "bf16" if autocast else None}


def run_cli(tiny_run: bool, models=None) -> tuple[list[dict], dict]:
    """The CLI's ``hf`` benchmark: the rows and what to record with them (``--tiny``: on CPU). ``models``, a
    subset of SHAPES' names, splits a run over processes (``benchmarks/merge_results.py`` joins the files)."""
    device = torch.device("cpu" if tiny_run or not torch.cuda.is_available() else "cuda")
    shapes = {name: tiny(shape) for name, shape in SHAPES.items()} if tiny_run else SHAPES
    steps = (2, 2, 2) if tiny_run else (WARMUP_STEPS, TIMED_STEPS, ROUNDS)
    autocast = device.type == "cuda"
    rows = run_hf({name: shapes[name] for name in models or shapes}, device, None, None, *steps, autocast)
    # every model's shape, run here or not: the files of a split run then merge with one info
    return rows, {**info(device), **protocol(shapes, *steps, autocast)}
