"""The per-signature tables (call plans, their graphs) kept small whatever shapes the calls take."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TypeVar

V = TypeVar("V")


def keep_bounded(table: dict[Hashable, V], key: Hashable, value: V, limit: int) -> None:
    """``table[key] = value``, the oldest key dropped first where a new key would pass ``limit``
    (dynamic padding gives each call a new token count: the table must not grow with them)."""
    if key not in table and len(table) >= limit:
        del table[next(iter(table))]
    table[key] = value
