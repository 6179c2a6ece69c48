"""python -m portable_ops.conformance [--backend NAME ...] [--json FILE] [--case SUBSTRING] [--device DEVICE]
                                      [--long] [--strict]

Runs the shared suite on each named backend (default: every backend usable on
this machine), prints a table, and exits 0 only when every case run passes or falls back on an
op its backend declares it has no kernel for ("fallback", counted as declared; --strict fails
those too): an undeclared fallback or an error is not a pass. The long cases (attention at 16k and 32k) run
on an accelerator, or on the CPU with --long (or PORTABLE_OPS_CONFORMANCE_LONG=1);
otherwise their rows say "not run", counted apart from the passes.

Exit status: 0 every case run passed or made a declared fallback (and at least one ran); 1 a
case failed, raised or fell back undeclared (any fallback under --strict), or none ran; 2 the command line
can't run (a backend unavailable, a device this machine lacks, a --json folder that is missing or read-only,
a --case that matches no case, a PORTABLE_OPS_CONFORMANCE_LONG that is not a boolean), reported before
any case runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

from portable_ops import cli, env
from portable_ops import dispatch

from .cases import CASES
from .runner import LONG_VARIABLE, format_table, passed, run, status_counts, unusable_reason, usable_backends


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m portable_ops.conformance", description=__doc__.split("\n\n")[1],
                                     epilog=__doc__.split("\n\n")[2])
    parser.add_argument("--backend", action="append", choices=dispatch.BACKEND_NAMES,
                        help="backend to check (repeatable); default: every usable backend")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON to FILE")
    parser.add_argument("--case", metavar="SUBSTRING", help="only cases whose id contains SUBSTRING")
    parser.add_argument("--device", help="run every backend's cases on this device (default: each backend's own)")
    parser.add_argument("--long", action="store_true",
                        help=f"also run the long cases on the CPU, where they are slow (reference: minutes; "
                             f"interpreter, emulator: far longer); default: {LONG_VARIABLE}, else off")
    parser.add_argument("--strict", action="store_true",
                        help="fail on every fallback, declared ones included (an op a backend has no kernel for)")
    args = parser.parse_args(argv)

    backends = list(dict.fromkeys(args.backend)) if args.backend else usable_backends()  # each once
    try:  # after the backends are loaded, as in the run: a backend may bring its device's support
        device = cli.device(args.device) if args.device else None
        if args.json is not None:
            cli.writable_file("--json", args.json)
        long = args.long or env.flag(LONG_VARIABLE, False)
    except ValueError as exc:
        parser.error(str(exc))
    for name in backends:
        reason = unusable_reason(name, device)
        if reason:
            print(f"backend {name!r} is unavailable: {reason}", file=sys.stderr)
            return 2
    cases = [c for c in CASES if not args.case or args.case in c.id]
    if not cases:
        parser.error(f"--case {args.case!r} matches none of the {len(CASES)} case ids "
                     f"(such as {CASES[0].id}, {CASES[-1].id})")
    start = time.perf_counter()
    rows = run(backends, cases, device, long=long,
               progress=lambda r: print(f"  {r.backend:<10} {r.case:<44} {r.status}", file=sys.stderr, flush=True))
    elapsed = time.perf_counter() - start
    print(format_table(rows))
    print(f"backends: {', '.join(backends)}; torch {torch.__version__}; python {platform.python_version()}; "
          f"{elapsed:.1f} s")
    if args.json is not None:
        try:
            with open(args.json, "w") as f:
                json.dump({"torch": torch.__version__, "backends": backends, "seconds": elapsed,
                           "counts": status_counts(rows), "rows": [r.as_dict() for r in rows]}, f, indent=1)
        except OSError as exc:  # checked before the run, but a disk can fill up meanwhile
            print(f"--json {args.json!r}: could not write the results ({exc.strerror or exc})", file=sys.stderr)
            return 2
    return 0 if passed(rows, strict=args.strict) else 1


if __name__ == "__main__":
    sys.exit(main())
