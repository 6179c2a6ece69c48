"""python -m portable_ops doctor"""

import sys

from .doctor import report


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["doctor"]:
        print("usage: python -m portable_ops doctor\n"
              "       python -m portable_ops.conformance [--backend NAME ...] [--json FILE]\n"
              "       python -m portable_ops.bench optimizer|clip|attention", file=sys.stderr)
        return 2
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
