"""Environment flags, read on every call.

The library never writes these variables; it only reads them at the moment they matter, so a
user can flip them between steps (for example to fetch logits for one evaluation batch).
"""

from __future__ import annotations

import os

_TRUE = {"1", "true", "yes", "on"}


def flag(name: str) -> bool:
    """True when the environment variable ``name`` is set to 1/true/yes/on (case-insensitive)."""
    return os.environ.get(name, "").strip().lower() in _TRUE


def triton_interpret() -> bool:
    """``TRITON_INTERPRET=1``: Triton kernels run on the CPU through Triton's interpreter."""
    return flag("TRITON_INTERPRET")


def return_logits() -> bool:
    """``LIGER_RETURN_LOGITS=1``: patched forwards also return the real logits."""
    return flag("LIGER_RETURN_LOGITS")


def memory_budget() -> str | None:
    """``LIGER_MEMORY_BUDGET``: the fused loss's working-memory budget when a call does not pass
    one (``lean``, ``default``, or a size such as ``256MiB``); ``None`` when unset or empty."""
    value = os.environ.get("LIGER_MEMORY_BUDGET", "").strip()
    return value or None
