"""Zeroed int32 counters that kernels count up and set back to zero before they end.

Two kernels use them: the Hopper forward hands out work tiles through two of them
(``attention_sm90._fwd_loader``), and the split-key decode counts the key ranges of each query
block that are done, so that the last one merges them (``attention._fwd_kernel``). Each launch
leaves every counter it used at zero, so a stream's launches, which run one after another, share
one set.
"""

from __future__ import annotations

import concurrent.futures

import torch

# A launch uses at most this many: split-key decode has fewer (query block, batch, head) programs
# than SMs (attention._splits), the Hopper forward two.
COUNTERS = 1024

_KEPT: dict = {}


def zeroed(device) -> torch.Tensor:
    """``COUNTERS`` int32 zeros for a launch on the current stream of ``device``.

    Eagerly, one set per stream, kept: launches running at once on two streams never share one.
    While a CUDA graph is captured, a new set per call, its zero-fill captured with it: a set kept
    from a capture would never be filled outside that graph's replays, and one kept from before
    would be shared by every graph captured on the stream, whichever stream each is replayed on.
    On the CPU (the interpreter), a new set per call."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    counters = _KEPT.get(key)
    if counters is None:
        counters, filled = _kept_zeros(index)
        torch.cuda.current_stream(index).wait_event(filled)
        # two threads on one stream may both get here: all use the first one kept
        counters = _KEPT.setdefault(key, counters)
    return counters


def _kept_zeros(index: int):
    """Zeros outside any CUDA-graph memory pool, and the event their fill records: torch.compile's
    CUDA-graph warm-up sends every allocation of the current thread to its graphs' pool, which must
    hold no tensor it doesn't track, so they are made on a thread of their own, on a stream of its
    own (no wait on the default stream, nothing the host waits for)."""
    def make():
        with torch.cuda.device(index):
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                zeros = torch.zeros(COUNTERS, dtype=torch.int32, device="cuda")
                filled = torch.cuda.Event()
                filled.record(stream)
        return zeros, filled

    with concurrent.futures.ThreadPoolExecutor(1) as worker:
        return worker.submit(make).result()
