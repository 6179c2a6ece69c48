"""The shared numerical suite: the same cases for every backend (see cases.py and runner.py)."""

from .cases import CASES, Case
from .runner import Row, format_table, run, run_case, usable_backends

__all__ = ["CASES", "Case", "Row", "run", "run_case", "format_table", "usable_backends"]
