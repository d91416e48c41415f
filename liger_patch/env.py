"""Environment flags, read on every call.

The library never writes these variables; it only reads them at the moment they matter, so a
user can flip them between steps (for example to fetch logits for one evaluation batch).
"""

from __future__ import annotations

import os
import sys

_TRUE = {"1", "true", "yes", "on"}

# ``os.environ.get`` runs four Python frames (``Mapping.get``, ``__getitem__``, the key's encoding
# and the value's decoding), and one call of the fused loss reads a flag about ten times: host
# time in every training step (docs/perf-notes.md item 60). On POSIX, CPython keeps the
# variables as the bytes mapping ``os.environ._data``, which every write through ``os.environ``
# (and ``monkeypatch.setenv``, ``mock.patch.dict``) updates; it is read directly where it exists,
# as long as ``os.environ`` is still the mapping it belongs to (a test may replace it whole).
_ENVIRON = os.environ
_RAW = getattr(_ENVIRON, "_data", None) if os.name == "posix" else None
if not isinstance(_RAW, dict):
    _RAW = None
_ENCODING = sys.getfilesystemencoding()  # how os.environ encodes and decodes on POSIX


def _get(name: str) -> str:
    """The variable ``name``'s value now, ``""`` when unset."""
    if _RAW is None or os.environ is not _ENVIRON:
        return os.environ.get(name, "")
    value = _RAW.get(name.encode(_ENCODING, "surrogateescape"))
    return "" if value is None else value.decode(_ENCODING, "surrogateescape")


def flag(name: str) -> bool:
    """True when the environment variable ``name`` is set to 1/true/yes/on (case-insensitive)."""
    value = _get(name)
    return bool(value) and value.strip().lower() in _TRUE


def triton_interpret() -> bool:
    """``TRITON_INTERPRET=1``: Triton kernels run on the CPU through Triton's interpreter."""
    return flag("TRITON_INTERPRET")


def return_logits() -> bool:
    """``LIGER_RETURN_LOGITS=1``: patched forwards also return the real logits."""
    return flag("LIGER_RETURN_LOGITS")


def memory_budget() -> str | None:
    """``LIGER_MEMORY_BUDGET``: the fused loss's working-memory budget when a call does not pass
    one (``lean``, ``default``, or a size such as ``256MiB``); ``None`` when unset or empty."""
    value = _get("LIGER_MEMORY_BUDGET").strip()
    return value or None
