"""Launch configurations chosen per problem shape by timing a few candidates on first use.

Each kernel has a short candidate list per head dim, best-known first; a shape bucket (powers of two
of the sequence lengths and of the number of programs) is timed once on its first call and the winner
is kept in memory and on disk, so a later process on the same GPU, Triton version and kernel source
reads it instead of timing again (like Triton's own cache). The first candidate is used without timing
in the interpreter and under ``PORTABLE_OPS_AUTOTUNE=0``; during CUDA-graph capture a choice on disk is
still read, but nothing is timed (timing can't run there; a bucket tuned before capture keeps its
choice).

The disk cache: one JSON file per (tuner, GPU, Triton version, kernel source) under
``PORTABLE_OPS_CACHE_DIR`` (default ``~/.cache/portable_ops``), written atomically (a temporary
file renamed over the old one). A file that is missing, unreadable, corrupt or written for other
candidates is ignored, never fatal.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import pathlib
import tempfile
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


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("PORTABLE_OPS_CACHE_DIR") or pathlib.Path.home() / ".cache" / "portable_ops")


def device_identity() -> str:
    """The GPU a timing holds for: its name and compute capability."""
    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return f"{torch.cuda.get_device_name(index)} sm_{major}{minor}"


def _jsonable(value):
    return json.loads(json.dumps(value))


class Tuner:
    """Picks the fastest candidate per key. ``name`` and the source of ``sources`` (the kernels the
    candidates configure) name its disk cache, so an edited kernel is tuned afresh."""

    def __init__(self, timer: Callable[[Callable[[], object]], float] = _time_ms, *, name: str = "tuner",
                 sources: Sequence = ()):
        self.timer = timer
        self.chosen: dict[Hashable, tuple] = {}
        self.name = name
        self._source = hashlib.sha256("\n".join(inspect.getsource(getattr(fn, "fn", fn)) for fn in sources)
                                      .encode()).hexdigest()
        self._disk: dict[str, object] | None = None  # read on first use

    @staticmethod
    def autotuning() -> bool:
        # imported here: the kernel modules load without the package (tests/test_triton_compiles.py)
        from portable_ops import env

        return not INTERPRETED and env.flag("PORTABLE_OPS_AUTOTUNE", True)

    def enabled(self) -> bool:
        """Whether a candidate may be timed now."""
        return self.autotuning() and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())

    def pick(self, key: Hashable, candidates: Sequence[tuple], launch: Callable[[tuple], object]) -> tuple:
        """The fastest of ``candidates`` for ``key``; ``launch(config)`` runs the kernel once."""
        if key in self.chosen:
            return self.chosen[key]
        if len(candidates) == 1 or not self.autotuning():
            return candidates[0]
        stored = self._stored().get(repr(key))
        for config in candidates:
            if stored is not None and _jsonable(config) == stored:
                self.chosen[key] = config
                return config
        if not self.enabled():
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
        self._store(repr(key), _jsonable(self.chosen[key]))
        return self.chosen[key]

    def path(self) -> pathlib.Path:
        identity = f"{device_identity()}|triton {triton.__version__}|{self._source}"
        return cache_dir() / f"tune-{self.name}-{hashlib.sha256(identity.encode()).hexdigest()[:20]}.json"

    def _stored(self) -> dict:
        if self._disk is None:
            self._disk = _read(self.path())
        return self._disk

    def _store(self, key: str, config) -> None:
        path = self.path()
        entries = _read(path)  # another process may have tuned other buckets since we read it
        entries.update(self._stored())
        entries[key] = config
        self._disk = entries
        _write(path, entries)


def _read(path: pathlib.Path) -> dict:
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def _write(path: pathlib.Path, entries: dict) -> None:
    """Atomically: a reader sees the old file or the new one, never half of one. A read-only or full
    disk costs the next process a re-tuning, nothing more."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
