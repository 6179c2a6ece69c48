"""Launch configurations chosen per problem shape by timing a few candidates on first use.

Each kernel has a short candidate list per head dim, best-known first (the H100 sweep in
docs/performance.md); a shape bucket (powers of two of the sequence lengths and of the number of
programs) is timed once per process on its first call and the winner is kept in memory. The
first candidate is used without timing in the interpreter, during CUDA-graph capture (timing
can't run there; a bucket tuned before capture keeps its choice) and under
``PORTABLE_OPS_AUTOTUNE=0``.
"""

from __future__ import annotations

import os
from typing import Callable, Hashable, Sequence

import torch
import triton
import triton.testing
from triton.runtime.errors import OutOfResources

from .interpreter import INTERPRETED


def bucket(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _time_ms(launch: Callable[[], object]) -> float:
    return triton.testing.do_bench(launch, warmup=5, rep=20)


class Tuner:
    def __init__(self, timer: Callable[[Callable[[], object]], float] = _time_ms):
        self.timer = timer
        self.chosen: dict[Hashable, tuple] = {}

    def enabled(self) -> bool:
        return (not INTERPRETED and os.environ.get("PORTABLE_OPS_AUTOTUNE", "1") != "0"
                and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()))

    def pick(self, key: Hashable, candidates: Sequence[tuple], launch: Callable[[tuple], object]) -> tuple:
        """The fastest of ``candidates`` for ``key``; ``launch(config)`` runs the kernel once."""
        if key in self.chosen:
            return self.chosen[key]
        if len(candidates) == 1 or not self.enabled():
            return candidates[0]
        times = []
        for config in candidates:
            try:
                times.append((self.timer(lambda: launch(config)), config))
            except OutOfResources:  # too much shared memory or too many registers on this GPU
                continue
        if not times:
            raise RuntimeError(f"no launch configuration fits this GPU for {key}: tried {list(candidates)}")
        self.chosen[key] = min(times, key=lambda t: t[0])[1]
        return self.chosen[key]
