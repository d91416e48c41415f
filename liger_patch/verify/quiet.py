"""Warnings and log messages of the code ``verify`` runs, collected instead of printed.

Building ~300 tiny models makes transformers (and torch, and the models' own code) warn about
configs, attention implementations and deprecated arguments: dozens of lines that say nothing
about the patch and bury the verdicts. :func:`collected` gathers Python warnings and log records
(WARNING and above) while the sweep runs; the command then prints one line with their count and
writes them, each tagged with the model type it came with, to a file the line names.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["Collected", "collected"]

_LOGGERS = ("", "transformers")
"""The root logger, and transformers', which does not propagate to it once configured."""


@dataclass
class Collected:
    """What was collected: ``(origin, context, text)`` per message, ``origin`` the top-level
    package that emitted it and ``context`` what was being checked (``tag`` at the time)."""

    messages: list[tuple[str, str, str]] = field(default_factory=list)
    tag: str = ""

    def add(self, origin: str, text: str) -> None:
        self.messages.append((origin, self.tag, " ".join(text.split())))

    def summary(self, path: str | None) -> str:
        """One line: how many, from where, and where to read them (``path``), or '' for none."""
        if not self.messages:
            return ""
        origins = Counter(origin for origin, _, _ in self.messages)
        parts = ", ".join(f"{origin} {count}" for origin, count in origins.most_common())
        where = f"; see {path}" if path else ""
        return f"{len(self.messages)} warnings collected instead of printed ({parts}){where}"

    def write(self, directory: str | None = None) -> str | None:
        """Write every message to a new file (in ``directory``, default the temp dir); its path."""
        if not self.messages:
            return None
        handle, path = tempfile.mkstemp(prefix="liger_patch_verify_", suffix=".log", dir=directory)
        with os.fdopen(handle, "w") as out:
            for origin, context, text in self.messages:
                out.write(f"[{context or '-'}] {origin}: {text}\n")
        return path


class _Handler(logging.Handler):
    """Adds each record to the sink once. It sits on the root logger and on transformers', which
    propagates to the root until transformers configures it (or after ``enable_propagation()``),
    so one record can reach it twice, one logger after the other."""

    def __init__(self, sink: Collected) -> None:
        super().__init__(logging.WARNING)
        self.sink = sink
        self._last: logging.LogRecord | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record is self._last:
            return
        self._last = record
        self.sink.add(record.name.split(".")[0] or "root", record.getMessage())


def _origin(filename: str) -> str:
    """The top-level package a warning's source file belongs to (``site-packages/<pkg>/...``)."""
    parts = filename.replace("\\", "/").split("/")
    for marker in ("site-packages", "dist-packages"):
        if marker in parts and parts.index(marker) + 1 < len(parts):
            return parts[parts.index(marker) + 1].removesuffix(".py")
    return "liger_patch" if "liger_patch" in parts else os.path.basename(filename).removesuffix(".py")


@contextlib.contextmanager
def collected() -> Iterator[Collected]:
    """Collect Python warnings and WARNING+ log records (transformers' too) for the block's
    duration; transformers' own handler is silenced meanwhile and restored after."""
    sink = Collected()
    handler = _Handler(sink)
    loggers = [logging.getLogger(name) for name in _LOGGERS]
    transformers_handlers = _pause_handlers(logging.getLogger("transformers"))

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ARG001 - warnings' API
        sink.add(_origin(filename), f"{category.__name__}: {message}")

    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = show
        for logger in loggers:
            logger.addHandler(handler)
        try:
            yield sink
        finally:
            for logger in loggers:
                logger.removeHandler(handler)
            logging.getLogger("transformers").handlers.extend(transformers_handlers)


def _pause_handlers(logger: logging.Logger) -> list[logging.Handler]:
    """Take ``logger``'s handlers off it (to be put back) so that nothing it logs is printed."""
    handlers = list(logger.handlers)
    for handler in handlers:
        logger.removeHandler(handler)
    return handlers
