"""Kind checks for values a user writes: matrix YAML and the library's configuration objects.

In Python ``True`` is an ``int``, so ``isinstance(v, int)`` lets ``concurrency: true`` through as 1. The validators of
matrices and of the library's configuration objects ask these two instead (``runner.validate_matrix``,
``capture.Knobs``, ``asyncsched.Spec``); notebook parameters have their own typed check (``nbutil.check``).
"""
from __future__ import annotations


def number(v) -> bool:
    """An int or a float as YAML gives it: not a bool, not a quoted string."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def whole(v) -> bool:
    """An int as YAML gives it, not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)
