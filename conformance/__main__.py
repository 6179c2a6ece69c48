"""python -m portable_ops.conformance [--backend NAME ...] [--json FILE] [--case SUBSTRING] [--device DEVICE]

Runs the shared suite on each named backend (default: every backend usable on
this machine), prints a table, and exits 0 only when every case passes: a
fallback or an error is not a pass.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

from portable_ops.dispatch import BACKEND_NAMES, unavailable_reason

from .cases import CASES
from .runner import format_table, run, usable_backends


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m portable_ops.conformance", description=__doc__.split("\n\n")[1])
    parser.add_argument("--backend", action="append", choices=BACKEND_NAMES,
                        help="backend to check (repeatable); default: every usable backend")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON to FILE")
    parser.add_argument("--case", metavar="SUBSTRING", help="only cases whose id contains SUBSTRING")
    parser.add_argument("--device", help="run every backend's cases on this device (default: each backend's own)")
    args = parser.parse_args(argv)

    backends = args.backend or usable_backends()
    for name in backends:
        reason = unavailable_reason(name)
        if reason:
            print(f"backend {name!r} is unavailable: {reason}", file=sys.stderr)
            return 2
    cases = [c for c in CASES if not args.case or args.case in c.id]
    device = torch.device(args.device) if args.device else None
    start = time.perf_counter()
    rows = run(backends, cases, device, progress=lambda r: print(f"  {r.backend:<10} {r.case:<44} {r.status}",
                                                                   file=sys.stderr, flush=True))
    elapsed = time.perf_counter() - start
    print(format_table(rows))
    print(f"backends: {', '.join(backends)}; torch {torch.__version__}; python {platform.python_version()}; "
          f"{elapsed:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "backends": backends, "seconds": elapsed,
                       "rows": [r.as_dict() for r in rows]}, f, indent=1)
    return 0 if rows and all(r.status == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
