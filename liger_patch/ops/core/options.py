"""What the options of every loss share: the names of the reductions and backends, the checks of
a value (``option_float``, ``check_shared``, ...), and how options travel: as one string into a
registered operator (``options_key``, ``options_from_key``), as constants into a compiled graph
(``constant_changes``, ``from_constant``, ``compile_constant``), built once per distinct call
(``cached_build``), and listed in an entry point's signature and docstring.

The cross-entropy's ``LossOptions`` and the distillation's ``DistillOptions`` are both frozen
dataclasses of options, checked on construction with these, and travel the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import torch

from liger_patch.ops.core.budget import parse_memory_budget
from liger_patch.ops.core.tuning import Tuning
from liger_patch.ops.core.validation import FLOAT_DTYPES

Reduction = Literal["mean", "sum", "none"]
BackendName = Literal["auto", "triton", "torch"]
REDUCTIONS = ("mean", "sum", "none")
BACKEND_NAMES = ("auto", "triton", "torch")

T = TypeVar("T")


def option_float(name: str, value: object) -> float:
    """``float(value)`` for a numeric option; a string or a non-number is refused, naming ``name``
    (``float("0.1")`` would quietly accept text, ``float("abc")`` fail without saying which option)."""
    if not isinstance(value, (str, bytes)):
        try:
            return float(value)
        except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of several elements
            pass
    raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")


def unit_interval(name: str, value: object) -> float:
    """A number in [0, 1] (NaN is refused too)."""
    number = option_float(name, value)
    if not 0.0 <= number <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {number}")
    return number


def optional_positive(name: str, value: object) -> float | None:
    """``None``, or a finite number > 0 (a softcap)."""
    if value is None:
        return None
    number = option_float(name, value)
    if not (math.isfinite(number) and number > 0.0):
        raise ValueError(f"{name} must be a finite number > 0 (or None), got {number}")
    return number


def optional_nonzero(name: str, value: object) -> float | None:
    """``None``, or a finite number other than 0 (a logit scale)."""
    if value is None:
        return None
    number = option_float(name, value)
    if not (math.isfinite(number) and number != 0.0):
        raise ValueError(f"{name} must be a finite non-zero number (or None), got {number}")
    return number


def check_shared(opts: Any) -> None:
    """Check the options every loss has, raising for a bad one, naming it: ``ignore_index`` (an
    int64), ``reduction``, ``backend``, ``memory_budget``, ``logits_dtype`` (a float dtype; against
    the inputs' at the call: :func:`check_logits_dtype`) and ``tuning``."""
    if not isinstance(opts.ignore_index, int) or isinstance(opts.ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {type(opts.ignore_index).__name__}")
    if not -(2**63) <= opts.ignore_index < 2**63:
        raise ValueError(f"ignore_index must fit in int64 (labels are int64), got {opts.ignore_index}")
    if opts.reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {opts.reduction!r}; expected one of {REDUCTIONS}")
    if opts.backend not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {opts.backend!r}; expected one of {BACKEND_NAMES}")
    if opts.memory_budget is not None:
        parse_memory_budget(opts.memory_budget)
    if opts.logits_dtype is not None and opts.logits_dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"logits_dtype must be None or a float dtype (torch.float32), got {opts.logits_dtype!r}"
        )
    if not isinstance(opts.tuning, Tuning):
        raise TypeError(
            f"tuning must be a liger_patch.ops.core.tuning.Tuning, got {type(opts.tuning).__name__}"
        )


def check_logits_dtype(logits_dtype: torch.dtype | None, input_dtype: torch.dtype) -> None:
    """``logits_dtype`` is None (the input dtype), fp32, or the input dtype itself."""
    if logits_dtype is None or logits_dtype in (torch.float32, input_dtype):
        return
    raise ValueError(
        f"logits_dtype must be None (the input dtype, {input_dtype}) or torch.float32, got {logits_dtype!r}"
    )


_HEX_FLOAT = "float.hex:"


def constant_changes(changes: dict[str, Any]) -> dict[str, Any]:
    """``changes`` as values that ``torch.compile`` passes to an options builder (``build_options``,
    ``build_distill_options``) as constants on every torch version: a ``Tuning`` as its key
    (torch 2.11's dynamo refuses a frozen dataclass there) and a float as its exact hex string
    (under ``dynamic=True`` a float read from a variable, such as a config's softcap, is traced as
    a symbol; ``float.hex`` specializes it, with a guard, so a changed value recompiles)."""
    return {name: _as_constant(value) for name, value in changes.items()}


def _as_constant(value: Any) -> Any:
    if isinstance(value, Tuning):
        return value.key
    if isinstance(value, float):
        return _HEX_FLOAT + value.hex()
    return value


def from_constant(name: str, value: Any) -> Any:
    """The value ``constant_changes`` encoded for the option ``name`` (other values as given)."""
    if not isinstance(value, str):
        return value
    if name == "tuning":
        try:
            return Tuning.from_key(value)
        except (ValueError, TypeError, KeyError):
            message = f"tuning must be a liger_patch.ops.core.tuning.Tuning, got the str {value!r}"
            raise TypeError(message) from None
    if value.startswith(_HEX_FLOAT):
        return float.fromhex(value.removeprefix(_HEX_FLOAT))
    return value


def compile_constant(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` marked as ``torch.compiler.assume_constant_result`` marks it (torch 2.0 onwards):
    under ``torch.compile`` a call runs once while tracing and its result is a constant of the
    graph. (The decorator itself imports torch._dynamo, ~1 s of ``import liger_patch``.)"""
    fn._dynamo_marked_constant = True
    return fn


def options_key(opts: Any) -> str:
    """Every field of the options dataclass ``opts`` as one JSON string (the tuning by its key, the
    logits' dtype by its name): how options reach a registered operator, which takes strings."""
    values = {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)}
    values["tuning"] = opts.tuning.key
    if opts.logits_dtype is not None:
        values["logits_dtype"] = str(opts.logits_dtype).removeprefix("torch.")
    return json.dumps(values, sort_keys=True)


def options_from_key(cls: type[T], key: str) -> T:
    """The options of class ``cls`` that ``options_key`` made ``key`` from."""
    values = json.loads(key)
    values["tuning"] = Tuning.from_key(values["tuning"])
    dtype = values["logits_dtype"]
    values["logits_dtype"] = None if dtype is None else getattr(torch, dtype)
    return cls(**values)


def refuse_unknown(given: dict[str, Any], names: tuple[str, ...], where: str) -> None:
    """Raise ``TypeError`` naming ``where``, the unknown names and the options, for a name of
    ``given`` that is not one of ``names``."""
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise TypeError(f"{where} got unknown option(s) {unknown}; the options are {list(names)}")


def cached_build(build: Callable[..., T]) -> Callable[..., T]:
    """``build(*args, changes)`` (``changes`` a dict of options) remembered for its arguments, so
    that a call repeated with the same options builds nothing; built anew when a value cannot be
    hashed (and refused there if it is wrong)."""

    @functools.lru_cache(maxsize=256)
    def cached(*args_and_items: Any) -> T:
        *args, items = args_and_items
        return build(*args, dict(items))

    def call(*args: Any, changes: dict[str, Any]) -> T:
        try:
            return cached(*args, tuple(sorted(changes.items())))
        except TypeError as exc:
            if "unhashable" not in str(exc):
                raise
            return build(*args, changes)

    return call


def keyword_parameters(cls: type, exclude: tuple[str, ...] = ()) -> list[inspect.Parameter]:
    """Keyword-only parameters, one per field of the options dataclass ``cls`` (defaults and
    annotations from the fields), for the ``__signature__`` of an entry point that takes
    ``**options``: ``help()``, IDEs and ``inspect.signature`` then list every option."""
    return [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in dataclasses.fields(cls)
        if f.name not in exclude
    ]


def docstring_lines(
    docs: dict[str, str], names: tuple[str, ...], exclude: tuple[str, ...] = (), indent: str = "        "
) -> str:
    """``name: meaning`` lines of the options ``names`` (meanings from ``docs``), for an entry
    point's docstring."""
    return "\n".join(f"{indent}{name}: {docs[name]}" for name in names if name not in exclude)
