"""The shared numerical suite: the same cases for every backend (see cases.py, runner.py and tolerances.py)."""

from .cases import CASES, Case
from .runner import Row, format_table, run, run_case, usable_backends
from .tolerances import GRADIENT_FACTOR, Tolerance, tolerance

__all__ = ["CASES", "Case", "Row", "run", "run_case", "format_table", "usable_backends", "tolerance", "Tolerance",
           "GRADIENT_FACTOR"]
