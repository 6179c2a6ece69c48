"""Host time of one fused clip + AdamW step (the triton backend) over a Llama-like parameter list, with the
kernels launched directly (launch.Launch) and through Triton's own launcher (PORTABLE_OPS_DIRECT_LAUNCH=0),
interleaved in one process; and torch's clip_grad_norm_(foreach) + fused AdamW beside them.

    python benchmarks/optimizer_launch_host.py
"""

import os
import statistics
import time

import torch

import portable_ops


def params(seed):
    torch.manual_seed(seed)
    shapes = [(32000, 1024)] + [(1024,), (1024, 1024), (256, 1024), (256, 1024), (1024, 1024), (1024,),
                                (2816, 1024), (2816, 1024), (1024, 2816)] * 8 + [(1024,)]
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes]
    for p in ps:
        p.grad = torch.randn_like(p)
    return ps


def host_ms(step, n=30):
    times = []
    for _ in range(n):
        torch.cuda._sleep(2_000_000)  # the device busy, so that the host never waits for it
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
    return statistics.median(times)


def main():
    ours = portable_ops.optim.AdamW(params(0), lr=1e-4, max_grad_norm=1.0)
    theirs_params = params(0)
    theirs = torch.optim.AdamW(theirs_params, lr=1e-4, fused=True)

    def torch_step():
        torch.nn.utils.clip_grad_norm_(theirs_params, 1.0, foreach=True)
        theirs.step()

    for step in (ours.step, torch_step):
        for _ in range(3):
            step()
    torch.cuda.synchronize()
    rows = {"ours, direct launches": [], "ours, Triton's launcher": [], "torch": []}
    for _ in range(5):
        os.environ["PORTABLE_OPS_DIRECT_LAUNCH"] = "1"
        rows["ours, direct launches"].append(host_ms(ours.step))
        os.environ["PORTABLE_OPS_DIRECT_LAUNCH"] = "0"
        rows["ours, Triton's launcher"].append(host_ms(ours.step))
        rows["torch"].append(host_ms(torch_step))
    os.environ.pop("PORTABLE_OPS_DIRECT_LAUNCH")
    print(f"{torch.cuda.get_device_name()}, {len(ours.param_groups[0]['params'])} tensors; host ms per clip + step, "
          "median of 30 steps, 5 interleaved rounds:")
    for name, values in rows.items():
        print(f"  {name:24s} median {statistics.median(values):6.3f}  range {min(values):.3f}-{max(values):.3f}")


if __name__ == "__main__":
    main()
