"""The training bench's shape 1, eager, torch's stack and ours alternately, twice each, in one process
(GPU; about a minute). ``PYTHONPATH=$PWD python docs/perf/train_host_ab.py``. Per run: ms per step over
25 back-to-back steps, the host ms of a step (``train.step_host_ms``: each step queued behind a sleep
kernel, median of 10) and the host us of one attention call, forward and backward
(``train.attention_host_us``, device drained before each). Run it from two trees in alternate
processes to compare them on one host."""
import time

import torch

import portable_ops
from portable_ops.bench.common import device_info
from portable_ops.bench.train import SHAPES, Run, attention_host_us, step_host_ms

cfg, device = SHAPES["d1024 hd64 s2048"], torch.device("cuda")
info = device_info()
print(f"{info['device']}, {info['date']}, commit {info['commit']}; portable_ops from {portable_ops.__file__}")
print("stack          ms/step  host ms/step  attention host us fwd / bwd")
for _ in range(2):
    for stack in ("torch", "portable_ops"):
        run = Run(cfg, stack, "eager", device, 50)
        for _ in range(3):
            run.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(25):
            run.step()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - start) * 1e3 / 25
        host = step_host_ms(run, 10)["host ms/step"]  # "waited" where a step outlasted its sleep
        host = f"{host:.2f}" if isinstance(host, float) else host
        attention = attention_host_us(cfg, stack, device)
        print(f"{stack:13s} {ms:8.2f} {host:>13}  "
              f"{attention['host us fwd']:6.1f} / {attention['host us bwd']:6.1f}")
        del run
