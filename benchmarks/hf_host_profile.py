"""Host time of an eager transformers training step (``bench hf``'s Llama), ours against "sdpa": wall time per
step without a profiler, then a cProfile of ours, the portable_ops and integration functions first.

    python benchmarks/hf_host_profile.py [--family llama]
"""

import argparse
import cProfile
import io
import pstats
import time

import torch

from portable_ops.bench import hf


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="llama")
    args = parser.parse_args()
    device = torch.device("cuda")
    shape = hf.SHAPES[args.family]
    weights, data = hf._initial(shape, 40, device)
    variants = {name: hf.Variant(shape, name, "eager", weights, data, device, autocast=True)
                for name in ("sdpa", hf.implementations(device)[-1])}
    for variant in variants.values():
        for _ in range(5):
            variant.step()
    torch.cuda.synchronize()
    for _ in range(2):
        for name, variant in variants.items():
            start = time.perf_counter()
            for _ in range(5):
                variant.step()
            torch.cuda.synchronize()
            print(f"{name:14s} {(time.perf_counter() - start) / 5 * 1e3:7.2f} ms/step")
    for name, variant in variants.items():
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            variant.step()
        torch.cuda.synchronize()
        prof.disable()
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(18)
        print(f"==== {name}: by own time\n" + "\n".join(out.getvalue().splitlines()[6:30]))
        if name != "sdpa":
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats("portable_ops", 30)
            print(f"==== {name}: portable_ops, cumulative\n" + "\n".join(out.getvalue().splitlines()[6:45]))


if __name__ == "__main__":
    main()
