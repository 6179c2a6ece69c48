"""The training bench's shape 1, eager, torch's stack and ours alternately, twice each, in one process
(GPU; about a minute). ``python benchmarks/train_host_ab.py``. Per run
(``train.measure``): ms per step over 25 back-to-back steps after its warm-up, the host ms of a step
(``train.step_host_ms``: each step queued behind a sleep kernel, median of 10) and the host us of one
attention call, forward and backward (``train.attention_host_us``, device drained before each). Run it
from two trees in alternate processes to compare them on one host."""
import torch

import portable_ops
from portable_ops.bench.common import device_info
from portable_ops.bench.train import SHAPES, attention_host_us, measure

cfg, device = SHAPES["d1024 hd64 s2048"], torch.device("cuda")
info = device_info()
print(f"{info['device']}, {info['date']}, commit {info['commit']}; portable_ops from {portable_ops.__file__}")
print("stack          ms/step  host ms/step  attention host us fwd / bwd")
for _ in range(2):
    for stack in ("torch", "portable_ops"):
        row = measure(cfg, stack, "eager", device, timed_steps=25, profiled_steps=0, host_steps=10)
        host = row["host ms/step"]  # "waited" where a step outlasted its sleep
        host = f"{host:.2f}" if isinstance(host, float) else host
        attention = attention_host_us(cfg, stack, device)
        print(f"{stack:13s} {row['ms/step']:8.2f} {host:>13}  "
              f"{attention['host us fwd']:6.1f} / {attention['host us bwd']:6.1f}")
