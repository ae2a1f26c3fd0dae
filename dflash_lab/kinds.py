"""Kind checks for values a user writes: matrix YAML, notebook parameters, dataclass fields.

In Python ``True`` is an ``int``, so ``isinstance(v, int)`` lets ``concurrency: true`` through as 1. Every validator
in the library asks these two instead (``runner.validate_matrix``, ``capture.CaptureConfig``, ``asyncsched.Scenario``).
"""
from __future__ import annotations


def number(v) -> bool:
    """An int or a float as YAML gives it: not a bool, not a quoted string."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def whole(v) -> bool:
    """An int as YAML gives it, not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)
