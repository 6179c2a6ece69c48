"""A/B of the training benchmark's all-ops step with one of portable_ops' parts swapped back to torch's.

    source benchmarks/device_setup.sh
    python benchmarks/train_ops_ab.py [--shapes PREFIX] [--modes compiled,eager] [--variants all,...] [--repeats N]

Variants (the model of ``portable_ops.bench.train``, on CUDA, bf16 autocast, portable_ops' attention and fused
clip + AdamW in every one of them):

* ``all``: every part portable_ops has (its RMSNorm, RoPE and linear cross-entropy): the bench's all-ops stack;
* ``torch-norm``, ``torch-rope``, ``torch-loss``: that part torch's, the rest portable_ops';
* ``none``: norms, RoPE and loss all torch's: the bench's portable_ops stack;
* ``host-targets``: ``all`` with the loss's CUDA targets read on the host each step (a device-to-host copy and a
  test), the check the device-side assert replaced.

Each (shape, mode, variant), torch's stack included, is built, warmed up and timed in turn, in an order that
reverses every repeat; a row gives the median ms a step over repeats and each repeat's time. What decided the
norms' tracing under torch.compile (``OpImpl.defer_traced``) and the loss's device-side target check.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from portable_ops import cross_entropy_checks
from portable_ops.bench import llama, train

OURS, THEIRS = llama.OPS["portable_ops"], llama.OPS["torch"]
VARIANTS = {"all": llama.Ops(OURS.norm, OURS.rope, OURS.loss),
            "torch-norm": llama.Ops(THEIRS.norm, OURS.rope, OURS.loss),
            "torch-rope": llama.Ops(OURS.norm, THEIRS.rope, OURS.loss),
            "torch-loss": llama.Ops(OURS.norm, OURS.rope, THEIRS.loss),
            "none": llama.Ops(THEIRS.norm, THEIRS.rope, THEIRS.loss),
            "host-targets": llama.Ops(OURS.norm, OURS.rope, OURS.loss)}
WARMUP_STEPS, TIMED_STEPS = 6, 15
_device_check = cross_entropy_checks.check_target_values


def _host_check(target, classes, ignore_index):
    """The targets read on the host, as before the device-side assert (one device-to-host copy a call)."""
    if target.is_cuda and not torch.compiler.is_compiling():
        if bool(((target != ignore_index) & ((target < 0) | (target >= classes))).any()):
            raise ValueError("a target is out of range")
        return
    _device_check(target, classes, ignore_index)


def _register(variants):
    """Each variant as a stack of the bench: portable_ops' attention and optimizer, its own norms, RoPE and loss."""
    for name in variants:
        llama.OPS[name] = VARIANTS[name]
        train.ATTENTION_OF[name] = "portable_ops"
        train.OPS_OF[name] = name
    train.PORTABLE_STACKS = tuple(train.PORTABLE_STACKS) + tuple(variants)


def step_ms(cfg, stack: str, mode: str, device) -> tuple[float, float]:
    """ms a step and peak GiB of ``stack`` after its warm-up."""
    cross_entropy_checks.check_target_values = _host_check if stack == "host-targets" else _device_check
    try:
        run = train.Run(cfg, stack, mode, device, WARMUP_STEPS + TIMED_STEPS)
        for _ in range(WARMUP_STEPS):
            run.step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(TIMED_STEPS):
            run.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / TIMED_STEPS * 1e3, torch.cuda.max_memory_allocated() / 2**30
    finally:
        cross_entropy_checks.check_target_values = _device_check
        torch._dynamo.reset()  # each run compiles a new model: dynamo's recompile limit counts them all
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="d1024", help="prefix of the bench's shape names")
    parser.add_argument("--modes", default="compiled", help="compiled, eager or both, comma-separated")
    parser.add_argument("--variants", default="all,none", help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: unknown {', '.join(sorted(unknown))}; expected some of {', '.join(VARIANTS)}")
    _register(variants)
    device = torch.device("cuda")
    for shape in (s for s in train.SHAPES if s.startswith(args.shapes)):
        for mode in args.modes.split(","):
            runs: dict[str, list] = {}
            for repeat in range(args.repeats):
                for stack in (["torch", *variants])[:: 1 if repeat % 2 == 0 else -1]:
                    runs.setdefault(stack, []).append(step_ms(train.SHAPES[shape], stack, mode, device))
            base = statistics.median(ms for ms, _ in runs["torch"])
            for stack, measured in runs.items():
                ms = statistics.median(m for m, _ in measured)
                print(f"{shape} {mode:8s} {stack:12s} {ms:7.2f} ms/step  vs torch {base / ms:.3f}  "
                      f"peak {max(g for _, g in measured):.2f} GiB  runs {[round(m, 2) for m, _ in measured]}",
                      flush=True)


if __name__ == "__main__":
    main()
