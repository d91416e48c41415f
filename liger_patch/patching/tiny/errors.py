"""The error a tiny model or batch raises when it cannot be made, and a short rendering of causes."""

from __future__ import annotations


class TinyModelError(RuntimeError):
    """A tiny model or batch cannot be made for a type; the message says what did not fit."""


def short(err: BaseException, limit: int = 300) -> str:
    """A one-line, bounded rendering of an exception."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:limit]}"
