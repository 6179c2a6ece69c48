"""The script behind docs/performance.md's "Shape 1 again" same-host A/B (H100, 2026-11-24, commit
7b03b97; `PYTHONPATH=. python docs/perf/eager_ab.py`). Kept as a record, not a tool. It trains the
training bench's shape 1 eagerly with torch's stack and ours, alternately, three times each, in one
process. It prints ms per step over 25 back-to-back steps, and the median and largest interval
between step() returns, to catch a one-off stall (a compile, a sync)."""
import time, torch
from portable_ops.bench.train import Run, SHAPES
cfg = SHAPES["d1024 hd64 s2048"]
dev = torch.device("cuda")
rows = []
for rep in range(3):
    for stack in ("torch", "portable_ops"):
        run = Run(cfg, stack, "eager", dev, 40)
        for _ in range(3):
            run.step()
        torch.cuda.synchronize()
        t = [time.perf_counter()]
        for _ in range(25):
            run.step()
            t.append(time.perf_counter())
        torch.cuda.synchronize()
        t_end = time.perf_counter()
        d = [(b - a) * 1e3 for a, b in zip(t, t[1:])]
        rows.append((rep, stack, (t_end - t[0]) * 1e3 / 25, sorted(d)[12], max(d), d.index(max(d))))
        del run
for r in rows:
    print("rep %d %-13s ms/step %6.2f  median interval %6.2f  max %7.2f at step %d" % r)
