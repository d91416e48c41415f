"""The per-signature tables (call plans, their graphs) kept small whatever shapes the calls take.

Each table is an ``OrderedDict`` kept in order of use: ``touched`` moves a key found to the
newest end, and ``keep_bounded`` drops from the oldest, so that a signature called at every step
stays while dynamic padding brings a new one at every call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import TypeVar

V = TypeVar("V")


def keep_bounded(table: OrderedDict[Hashable, V], key: Hashable, value: V, limit: int) -> None:
    """``table[key] = value`` as its newest key, the least recently used key dropped first where
    a new key would pass ``limit``."""
    if key in table:
        table.move_to_end(key)
    elif len(table) >= limit:
        table.popitem(last=False)
    table[key] = value


def touched(table: OrderedDict[Hashable, V], key: Hashable, default=None):
    """``table[key]`` (``default`` where absent), the key moved to the newest end: in use.
    ``move_to_end`` is one C call, so a thread never sees the key missing meanwhile."""
    try:
        table.move_to_end(key)
    except KeyError:
        return default
    return table[key]
