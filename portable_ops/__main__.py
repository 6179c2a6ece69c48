"""python -m portable_ops COMMAND"""

import argparse
import sys

from .doctor import report

EPILOG = """other command lines:
  python -m portable_ops.conformance [--backend NAME ...] [--json FILE]   the shared suite on each backend
  python -m portable_ops.bench BENCH                                      GPU benchmarks against torch
(each takes --help)"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m portable_ops", epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("doctor", help="hardware found, backends available, and why any is not")
    parser.parse_args(argv)  # --help exits 0; a missing or unknown command exits 2 with the usage
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
