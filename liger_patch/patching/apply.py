"""``apply_liger_to`` / ``revert_liger`` / ``liger_patched``: putting the generic forward in place.

Patching an *instance* sets ``model.forward`` on that instance only (its class and every other
model are untouched). Patching a *class* (or a ``model_type`` string, which names a class)
replaces ``cls.forward``, so every instance made later is patched. Either way the object gets a
:class:`~liger_patch.patching.forward.PatchState` recording the options and what was there
before, which is how a second apply stays a no-op wrapper-wise and how ``revert_liger``
restores the exact original.
"""

from __future__ import annotations

import contextlib
import types
import warnings
from collections.abc import Iterator
from typing import Any, TypeVar

import torch.nn as nn

from liger_patch.ops.options import parse_memory_budget
from liger_patch.patching.forward import (
    STATE_ATTR,
    PatchState,
    fusable_head,
    is_liger_forward,
    make_liger_forward,
    unfusable_head_message,
)
from liger_patch.patching.registry import (
    ModelSpec,
    UnsupportedModelError,
    spec_for,
    spec_for_model_type,
    supported_models,
)

__all__ = ["apply_liger_to", "base_model_of", "liger_patched", "revert_liger"]

Target = TypeVar("Target", nn.Module, type, str)


def base_model_of(model: Any) -> Any:
    """The causal-LM module inside wrappers: a PEFT model's base model, a compiled module's original."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):  # torch.compile
            model = model._orig_mod
        elif callable(getattr(model, "get_base_model", None)):  # peft.PeftModel
            model = model.get_base_model()
    return model


def _how_to_register(cls: type) -> str:
    return (
        f"Register it with liger_patch.register_model({cls.__name__}, liger_patch.ModelSpec("
        f"model_type='<your model_type>', class_name='{cls.__name__}', body='model', head='lm_head'))"
        ", or pass strict=False to leave it unpatched"
    )


def _unsupported(what: str, hint: str, strict: bool) -> None:
    known = ", ".join(sorted(supported_models()))
    message = f"liger_patch has no registry row for {what}. {hint}. Supported model types: {known}."
    if strict:
        raise UnsupportedModelError(message)
    warnings.warn(message + " The model is left unpatched.", UserWarning, stacklevel=3)


_OPTION_NAMES = ("z_loss_scale", "label_smoothing", "memory_budget")


def _validate_options(z_loss_scale: float, label_smoothing: float, memory_budget: int | str | None) -> None:
    if not z_loss_scale >= 0.0:
        raise ValueError(f"z_loss_scale must be >= 0, got {z_loss_scale!r}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")
    if memory_budget is not None:
        parse_memory_budget(memory_budget)


def _set_options(state: PatchState, options: dict[str, Any]) -> None:
    for name in _OPTION_NAMES:
        setattr(state, name, options[name])


def _own_state(obj: Any) -> PatchState | None:
    """The PatchState set on ``obj`` itself (not inherited from a patched class)."""
    return vars(obj).get(STATE_ATTR)


def _install(obj: Any, spec: ModelSpec, options: dict[str, Any]) -> None:
    """Give ``obj`` (a class or an instance) the generic forward and a PatchState; idempotent."""
    state = _own_state(obj)
    if state is not None:  # already patched here: only the options change, the wrapper is not stacked
        state.spec = spec
        _set_options(state, options)
        return
    is_class = isinstance(obj, type)
    had_own_forward = "forward" in vars(obj)
    previous = vars(obj).get("forward")
    state = PatchState(spec, had_own_forward=had_own_forward, previous_forward=previous)
    _set_options(state, options)
    if is_class:
        if not is_liger_forward(obj.forward):  # a subclass of a patched class inherits the wrapper
            obj.forward = make_liger_forward(obj.forward)
    elif not is_liger_forward(type(obj).forward):
        fallback = None
        if had_own_forward:  # e.g. accelerate's autocast wrapper set on the instance
            warnings.warn(
                f"liger_patch: {type(obj).__name__}.forward was already replaced on this instance "
                "(accelerate's mixed-precision wrapper or another patch). The original path still runs "
                "it, but the fused loss path calls the decoder body directly and so does not run under "
                "that wrapper's autocast. Patch before accelerator.prepare()/Trainer(...), or use "
                "liger_patch.LigerPatchCallback.",
                UserWarning,
                stacklevel=3,
            )
            fallback = lambda self, *args, **kwargs: previous(*args, **kwargs)  # noqa: ARG005
        obj.forward = types.MethodType(make_liger_forward(type(obj).forward, fallback), obj)
    # else: the class is patched already; the instance only needs its own options
    setattr(obj, STATE_ATTR, state)


def _patch_class(cls: type, strict: bool, options: dict[str, Any]) -> None:
    spec = spec_for(cls)
    if spec is None:
        _unsupported(f"class {cls.__module__}.{cls.__qualname__}", _how_to_register(cls), strict)
        return
    _install(cls, spec, options)


def _patch_instance(model: nn.Module, strict: bool, options: dict[str, Any]) -> None:
    cls = type(model)
    spec = spec_for(cls)
    if spec is None:
        _unsupported(f"class {cls.__module__}.{cls.__qualname__}", _how_to_register(cls), strict)
        return
    _install(model, spec, options)
    head, reason = fusable_head(model, spec)
    state = _own_state(model)
    if head is None and state is not None and not state.warned_unfusable_head:
        state.warned_unfusable_head = True
        warnings.warn(unfusable_head_message(model, reason), UserWarning, stacklevel=3)


def apply_liger_to(
    target: Target,
    *,
    z_loss_scale: float = 0.0,
    label_smoothing: float = 0.0,
    memory_budget: int | str | None = None,
    strict: bool = True,
) -> Target:
    """Swap a causal LM's head + cross-entropy for the fused linear cross-entropy.

    ``target`` may be a model instance (also PEFT-wrapped or ``torch.compile``-d: the base model
    is patched), a ``*ForCausalLM`` class (every instance made later is patched) or a
    ``model_type`` string such as ``"llama"`` (its transformers class is patched). Applying again
    only updates the options. Returns ``target`` unchanged in identity.

    ``z_loss_scale`` adds ``z_loss_scale * logsumexp^2`` per token (reported as
    ``outputs.z_loss``); ``label_smoothing`` smooths the targets. Both act in the fused path
    only. ``memory_budget`` is the fused loss's working-memory budget (bytes, ``"256MiB"``,
    ``"default"`` or ``"lean"``; ``None`` reads ``LIGER_MEMORY_BUDGET`` on every call, else 512 MiB;
    see :func:`liger_patch.fused_linear_cross_entropy`). With ``strict=True`` an architecture
    without a registry row raises :class:`UnsupportedModelError`; with ``strict=False`` it warns
    and leaves the model as is.
    """
    _validate_options(z_loss_scale, label_smoothing, memory_budget)
    options = dict(z_loss_scale=z_loss_scale, label_smoothing=label_smoothing, memory_budget=memory_budget)
    if isinstance(target, str):
        spec = spec_for_model_type(target)
        cls = spec.resolve_class() if spec is not None else None
        if cls is None:
            import transformers

            hint = (
                f"the installed transformers {transformers.__version__} has no {spec.class_name}"
                if spec is not None
                else "Register it with liger_patch.register_model('<model_type>', liger_patch.ModelSpec(...))"
            )
            _unsupported(f"model_type {target!r}", hint, strict)
            return target
        _install(cls, spec, options)
    elif isinstance(target, type):
        _patch_class(target, strict, options)
    elif isinstance(target, nn.Module):
        _patch_instance(base_model_of(target), strict, options)
    else:
        raise TypeError(
            "apply_liger_to expects a model, a model class or a model_type string, "
            f"got {type(target).__name__}"
        )
    return target


def _uninstall(obj: Any) -> bool:
    state = _own_state(obj)
    if state is None:
        return False
    delattr(obj, STATE_ATTR)
    if is_liger_forward(vars(obj).get("forward")):
        if state.had_own_forward:
            obj.forward = state.previous_forward
        elif "forward" in vars(obj):
            delattr(obj, "forward")
    return True


def revert_liger(target: Target) -> Target:
    """Undo ``apply_liger_to`` on the same target: the exact original forward comes back.

    Reverting something that was never patched does nothing. Reverting an instance whose class
    is patched leaves the class patch in force (revert the class, or its model_type, for that).
    """
    if isinstance(target, str):
        spec = spec_for_model_type(target)
        cls = spec.resolve_class() if spec is not None else None
        if cls is not None:
            _uninstall(cls)
        return target
    obj = target if isinstance(target, type) else base_model_of(target)
    _uninstall(obj)
    if not isinstance(obj, type) and is_liger_forward(type(obj).forward):
        warnings.warn(
            f"liger_patch: {type(obj).__name__} is patched at class level; this instance stays patched "
            f"until revert_liger({type(obj).__name__}) is called",
            UserWarning,
            stacklevel=2,
        )
    return target


@contextlib.contextmanager
def liger_patched(target: Target, **options: Any) -> Iterator[Target]:
    """Scoped ``apply_liger_to``: patched inside the ``with`` block, as before after it.

    If ``target`` was already patched on entry, its previous options come back on exit and it
    stays patched.
    """
    obj: Any = target
    if isinstance(target, str):
        spec = spec_for_model_type(target)
        obj = spec.resolve_class() if spec is not None else None
    elif not isinstance(target, type):
        obj = base_model_of(target)
    before = _own_state(obj) if obj is not None else None
    saved = None
    if before is not None:
        saved = before.spec, {name: getattr(before, name) for name in _OPTION_NAMES}
    apply_liger_to(target, **options)
    try:
        yield target
    finally:
        if saved is None:
            revert_liger(target)
        else:
            before.spec = saved[0]
            _set_options(before, saved[1])
