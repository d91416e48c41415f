"""``apply_liger_to`` / ``revert_liger`` / ``liger_patched``: putting the generic forward in place.

Patching an *instance* sets ``model.forward`` on that instance only (its class and every other
model are untouched). Patching a *class* (or a ``model_type`` string, which names a class)
replaces ``cls.forward``, so every instance made later is patched. Either way the object gets a
:class:`~liger_patch.patching.state.PatchState` recording the options and what was there
before, which is how a second apply stays a no-op wrapper-wise and how ``revert_liger``
restores the exact original. A patched instance also gets its own ``__reduce_ex__``, so that
``torch.save`` / ``pickle`` / ``copy`` bring it back patched (see the section below).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator
from typing import Any, TypeVar

import torch.nn as nn

from liger_patch.ops.options import LossOptions, options_docstring, options_parameters
from liger_patch.patching.forward import FORWARD_SETS, is_liger_forward, make_liger_forward, set_by_forward
from liger_patch.patching.head import fusable_head, unfusable_head_message
from liger_patch.patching.instance import (
    _rebuild_patched,  # noqa: F401 - pickles made before the split name it here
    drop_helpers,
    forget_stale_patch,
    install_instance_forward,
)
from liger_patch.patching.registry import (
    ModelSpec,
    UnsupportedModelError,
    missing_path_message,
    spec_for,
    spec_for_model_type,
    supported_models,
)
from liger_patch.patching.state import STATE_ATTR, PatchState, base_model_of, own_state

__all__ = ["apply_liger_to", "base_model_of", "checked_options", "liger_patched", "revert_liger"]

Target = TypeVar("Target", nn.Module, type, str)


def _check_target(target: Any, caller: str) -> None:
    """Refuse anything but a model, a model class or a model_type string, naming what was given."""
    if not isinstance(target, (str, type, nn.Module)):
        raise TypeError(
            f"{caller} expects a model, a model class or a model_type string, got {type(target).__name__}"
        )


def _module_path(model: nn.Module, module: nn.Module | None) -> str | None:
    """The attribute path of ``module`` inside ``model`` (``"lm_head"``), or ``None``."""
    return next((name for name, m in model.named_modules() if m is module and name), None)


def _body_path(model: nn.Module) -> str | None:
    """The decoder body of an instance: its ``base_model_prefix`` child, else a PreTrainedModel child."""
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        return prefix
    from transformers import PreTrainedModel

    return next((n for n, child in model.named_children() if isinstance(child, PreTrainedModel)), None)


def _output_embeddings(model: nn.Module) -> nn.Module | None:
    """``model.get_output_embeddings()`` where the model has one (transformers models do)."""
    getter = getattr(model, "get_output_embeddings", None)
    try:
        return getter() if callable(getter) else None
    except (AttributeError, NotImplementedError):
        return None


def _suggested_paths(target: type | nn.Module) -> tuple[str, str, str]:
    """``(body, head, note)`` for a registration hint: read from an instance, guessed for a class.

    An instance shows its real body (the ``base_model_prefix`` child: ``transformer`` for GPT-2)
    and its output projection (``get_output_embeddings()``). A class only has
    ``base_model_prefix``; the head name is then the usual ``lm_head``, and the note says so.
    """
    if isinstance(target, type):
        prefix = getattr(target, "base_model_prefix", "")
        body = prefix if isinstance(prefix, str) and prefix else "model"
        source = "its base_model_prefix" if body == prefix else "the usual name"
        note = (
            f" (guessed from the class: body is {source}, head the usual name; apply_liger_to an "
            "instance to see the paths it really has)"
        )
        return body, "lm_head", note
    body, head = _body_path(target), _module_path(target, _output_embeddings(target))
    guessed = [role for role, path in (("body", body), ("head", head)) if path is None]
    note = ""
    if guessed:
        note = f" ({' and '.join(guessed)} guessed: the model shows no base-model child / output embeddings)"
    return body or "model", head or "lm_head", note


def _how_to_register(target: type | nn.Module) -> str:
    """The ``register_model`` call that would serve ``target``, with paths it really has."""
    cls = target if isinstance(target, type) else type(target)
    config_class = getattr(cls, "config_class", None)
    model_type = getattr(getattr(target, "config", None), "model_type", None) or getattr(
        config_class, "model_type", None
    )
    body, head, note = _suggested_paths(target)
    return (
        f"Register it with liger_patch.register_model({cls.__name__}, liger_patch.ModelSpec("
        f"model_type={model_type or '<your model_type>'!r}, class_name={cls.__name__!r}, "
        f"body={body!r}, head={head!r})){note}, or pass strict=False to leave it unpatched"
    )


def _refuse(message: str, strict: bool) -> None:
    """Raise :class:`UnsupportedModelError`, or with ``strict=False`` warn that nothing is patched."""
    if strict:
        raise UnsupportedModelError(message)
    warnings.warn(message + " The model is left unpatched.", UserWarning, stacklevel=4)


def _unsupported(what: str, hint: str, strict: bool) -> None:
    known = ", ".join(sorted(supported_models()))
    _refuse(f"liger_patch has no registry row for {what}. {hint}. Supported model types: {known}.", strict)


def _spec_mismatch(model: nn.Module, spec: ModelSpec) -> str | None:
    """Why ``spec``'s body/head paths do not fit ``model`` (checked at apply time), or ``None``."""
    for role, path in (("body", spec.body), ("head", spec.head)):
        problem = missing_path_message(model, path)
        if problem is not None:
            return (
                f"liger_patch: the registry row for {type(model).__name__} (model_type "
                f"{spec.model_type!r}) says {role}={path!r}, but {problem}. Register a ModelSpec "
                "whose body and head name the decoder body and the output projection."
            )
    return None


def checked_options(where: str, options: dict[str, Any]) -> LossOptions:
    """The user's loss options for a patch, validated once: any ``LossOptions`` field except the
    ones the patched forward sets on every call (``FORWARD_SETS``), with the op's own rules."""
    set_per_call = [name for name in FORWARD_SETS if name in options]
    if set_per_call:
        raise TypeError(
            f"{where} does not take {set_per_call}: the patched forward sets them on every call: "
            f"{set_by_forward(set_per_call)}"
        )
    return LossOptions.from_kwargs(where=where, **options)


def options_signature(
    head: list[inspect.Parameter], return_annotation: Any = inspect.Signature.empty
) -> inspect.Signature:
    """``head`` + ``strict`` + one keyword-only parameter per option a patch takes: the
    ``__signature__`` of an entry point written as ``(..., *, strict=True, **options)``."""
    strict = inspect.Parameter("strict", inspect.Parameter.KEYWORD_ONLY, default=True, annotation="bool")
    parameters = [*head, strict, *options_parameters(exclude=FORWARD_SETS)]
    return inspect.Signature(parameters, return_annotation=return_annotation)


def with_options_doc(doc: str | None) -> str | None:
    """``doc`` (a docstring indented by 4) followed by the options a patch takes, one line each,
    and the options the patched forward sets itself."""
    if doc is None:  # python -OO
        return None
    return (
        f"{doc.rstrip()}\n\n    Options:\n\n{options_docstring(exclude=FORWARD_SETS)}\n\n"
        f"    The patched forward sets {', '.join(FORWARD_SETS)} itself, on every call.\n"
    )


def _install(obj: Any, spec: ModelSpec, options: LossOptions) -> None:
    """Give ``obj`` (a class or an instance) the generic forward and a PatchState; idempotent."""
    forget_stale_patch(obj)
    state = own_state(obj)
    if state is not None:  # already patched here: only the options change, the wrapper is not stacked
        state.spec, state.options = spec, options
        return
    had_own_forward = "forward" in vars(obj)
    state = PatchState(
        spec, options, had_own_forward=had_own_forward, previous_forward=vars(obj).get("forward")
    )
    if isinstance(obj, type):
        if not is_liger_forward(obj.forward):  # a subclass of a patched class inherits the wrapper
            obj.forward = make_liger_forward(obj.forward)
    else:
        if had_own_forward and not is_liger_forward(type(obj).forward):
            warnings.warn(
                f"liger_patch: {type(obj).__name__}.forward was already replaced on this instance "
                "(accelerate's mixed-precision wrapper or another patch). The original path still runs "
                "it, but the fused loss path calls the decoder body directly and so does not run under "
                "that wrapper's autocast. Patch before accelerator.prepare()/Trainer(...), or use "
                "liger_patch.LigerPatchCallback.",
                UserWarning,
                stacklevel=3,
            )
        install_instance_forward(obj, state)
    setattr(obj, STATE_ATTR, state)


def _patch_class(cls: type, strict: bool, options: LossOptions) -> None:
    spec = spec_for(cls)
    if spec is None:
        _unsupported(f"class {cls.__module__}.{cls.__qualname__}", _how_to_register(cls), strict)
        return
    _install(cls, spec, options)


def _patch_instance(model: nn.Module, strict: bool, options: LossOptions) -> None:
    cls = type(model)
    spec = spec_for(cls)
    if spec is None:
        _unsupported(f"class {cls.__module__}.{cls.__qualname__}", _how_to_register(model), strict)
        return
    mismatch = _spec_mismatch(model, spec)
    if mismatch is not None:
        _refuse(mismatch, strict)
        return
    _install(model, spec, options)
    head, reason = fusable_head(model, spec)
    state = own_state(model)
    if head is None and state is not None and not state.warned_unfusable_head:
        state.warned_unfusable_head = True
        warnings.warn(unfusable_head_message(model, reason), UserWarning, stacklevel=3)


def _model_type_class(model_type: str) -> tuple[ModelSpec | None, type | None]:
    """The row registered under ``model_type`` and the class it names in the installed
    transformers (``None`` for either that is missing)."""
    spec = spec_for_model_type(model_type)
    return spec, spec.resolve_class() if spec is not None else None


def _patch_target(target: Any) -> Any:
    """The object a patch of ``target`` lives on: the class a model_type names (``None`` if none),
    a class itself, or an instance's base model (through PEFT / torch.compile wrappers)."""
    if isinstance(target, str):
        return _model_type_class(target)[1]
    return target if isinstance(target, type) else base_model_of(target)


def apply_liger_to(target: Target, *, strict: bool = True, **options: Any) -> Target:
    """Swap a causal LM's head + cross-entropy for the fused linear cross-entropy.

    ``target`` may be a model instance (also PEFT-wrapped or ``torch.compile``-d: the base model
    is patched), a ``*ForCausalLM`` class (every instance made later is patched) or a
    ``model_type`` string such as ``"llama"`` (its transformers class is patched). Applying again
    only updates the options. Returns ``target`` unchanged in identity.

    With ``strict=True`` an architecture without a registry row raises
    :class:`UnsupportedModelError`; with ``strict=False`` it warns and leaves the model as is.

    The loss options act in the fused path only and are checked here, with the fused loss's own
    rules (:func:`liger_patch.fused_linear_cross_entropy`). ``z_loss_scale > 0`` reports the
    z-loss term as ``outputs.z_loss``; ``memory_budget=None`` reads ``LIGER_MEMORY_BUDGET`` on
    every call.
    """
    _check_target(target, "apply_liger_to")
    loss_options = checked_options("apply_liger_to", options)
    obj = _patch_target(target)
    if isinstance(target, str):
        if obj is None:
            _unsupported(f"model_type {target!r}", _model_type_hint(target), strict)
            return target
        _install(obj, _model_type_class(target)[0], loss_options)
    elif isinstance(target, type):
        _patch_class(obj, strict, loss_options)
    else:
        _patch_instance(obj, strict, loss_options)
    return target


def _model_type_hint(model_type: str) -> str:
    """Why ``model_type`` names no class, and what to do."""
    spec = spec_for_model_type(model_type)
    if spec is None:
        return "Register it with liger_patch.register_model('<model_type>', liger_patch.ModelSpec(...))"
    import transformers

    return f"the installed transformers {transformers.__version__} has no {spec.class_name}"


def _uninstall(obj: Any) -> None:
    """Remove ``obj``'s own patch: its PatchState and the forward (and reducer) it installed."""
    forget_stale_patch(obj)
    state = own_state(obj)
    if state is None:
        return
    delattr(obj, STATE_ATTR)
    if not isinstance(obj, type):
        drop_helpers(obj)
    if is_liger_forward(vars(obj).get("forward")):
        if state.had_own_forward:
            obj.forward = state.previous_forward
        elif "forward" in vars(obj):
            delattr(obj, "forward")


def revert_liger(target: Target) -> Target:
    """Undo ``apply_liger_to`` on the same target: the exact original forward comes back.

    Reverting something that was never patched does nothing. Reverting an instance whose class
    is patched leaves the class patch in force (revert the class, or its model_type, for that).
    """
    _check_target(target, "revert_liger")
    obj = _patch_target(target)
    if obj is None:
        return target
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

    Takes ``apply_liger_to``'s ``strict`` and options. If ``target`` was already patched on
    entry, its previous row and options come back on exit and it stays patched.
    """
    _check_target(target, "liger_patched")
    obj = _patch_target(target)
    if obj is not None:
        forget_stale_patch(obj)  # a dead PatchState is no patch to come back to
    before = own_state(obj) if obj is not None else None
    saved = (before.spec, before.options) if before is not None else None
    apply_liger_to(target, **options)
    try:
        yield target
    finally:
        if saved is None:
            revert_liger(target)
        else:
            before.spec, before.options = saved


_TARGET = inspect.Parameter("target", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="Target")
apply_liger_to.__signature__ = options_signature([_TARGET], return_annotation="Target")
liger_patched.__signature__ = options_signature([_TARGET], return_annotation="Iterator[Target]")
apply_liger_to.__doc__ = with_options_doc(apply_liger_to.__doc__)
liger_patched.__doc__ = with_options_doc(liger_patched.__doc__)
