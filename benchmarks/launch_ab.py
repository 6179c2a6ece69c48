"""Direct kernel launches against Triton's launch path, in one process: the training benchmark's
first shape, ms/step and attention host time per call, each configuration twice, interleaved with
torch's stack (a host-bound step moves between machine starts; one process removes that).

``python benchmarks/launch_ab.py`` (a GPU; about five minutes).
"""

from __future__ import annotations

import os

import torch

from portable_ops.bench import train
from portable_ops.bench.common import device_info, table

CONFIGS = (("torch", "1"), ("portable_ops", "1"), ("portable_ops", "0"))


def run(shape: str = "d1024 hd64 s2048", repeats: int = 2) -> list[dict]:
    cfg, device, rows = train.SHAPES[shape], torch.device("cuda"), []
    for mode in train.MODES:
        for _ in range(repeats):
            for stack, direct in CONFIGS:
                os.environ["PORTABLE_OPS_DIRECT_LAUNCH"] = direct
                torch._dynamo.reset()
                row = train.measure(cfg, stack, mode, device, timed_steps=20, profiled_steps=0)
                host = train.attention_host_us(cfg, stack, device) if mode == "eager" else {}
                rows.append({"mode": mode, "stack": stack, "direct launch": direct == "1", "ms/step": row["ms/step"],
                             **host})
    os.environ.pop("PORTABLE_OPS_DIRECT_LAUNCH")
    return rows


if __name__ == "__main__":
    print(table(run(), ["mode", "stack", "direct launch", "ms/step", "host us fwd", "host us bwd"]))
    info = device_info()
    print(f"{info['device']}, {info['date']}, commit {info['commit']}, torch {info['torch']}, triton {info['triton']}")
