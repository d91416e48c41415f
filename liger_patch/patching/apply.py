"""``apply_liger_to`` / ``revert_liger`` / ``liger_patched``: putting the generic forward in place.

Patching an *instance* sets ``model.forward`` on that instance only (its class and every other
model are untouched). Patching a *class* replaces ``cls.forward``, so every instance made later
is patched; a ``model_type`` string patches every class with a vocabulary head that transformers
maps it to (its causal-LM, image-text-to-text, seq2seq-LM, speech-seq2seq and masked-LM class:
``"bert"`` is ``BertLMHeadModel`` and ``BertForMaskedLM``), and says which on the
``liger_patch`` logger (a class it cannot patch is named in a warning, with the reason). Which
spec serves a model (a registry row, else one derived from the model) is ``derive.py``'s
decision. Either way the object gets a
:class:`~liger_patch.patching.state.PatchState` recording the options and what was there
before, which is how a second apply stays a no-op wrapper-wise and how ``revert_liger``
restores the exact original. A patched instance also gets its own ``__reduce_ex__``, so that
``torch.save`` / ``pickle`` / ``copy`` bring it back patched (see the section below).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch.nn as nn

from liger_patch.ops.cross_entropy.options import LossOptions, options_docstring, options_parameters
from liger_patch.patching.derive import (
    classes_by_task,
    instance_refusal,
    model_type_refusals,
    spec_for,
    spec_for_model_type,
)
from liger_patch.patching.forward import FORWARD_SETS, is_liger_forward, make_liger_forward, set_by_forward
from liger_patch.patching.head import fusable_head, unfusable_head_message
from liger_patch.patching.instance import (
    _rebuild_patched,  # noqa: F401 - pickles made before the split name it here
    drop_helpers,
    forget_stale_patch,
    install_instance_forward,
)
from liger_patch.patching.registry import ModelSpec, UnsupportedModelError
from liger_patch.patching.state import STATE_ATTR, PatchState, base_model_of, own_state

__all__ = [
    "after_apply",
    "apply_liger_to",
    "base_model_of",
    "checked_options",
    "liger_patched",
    "revert_liger",
]

Target = TypeVar("Target", nn.Module, type, str)

logger = logging.getLogger("liger_patch")

_AFTER_APPLY: list[Callable[[], None]] = []


def after_apply(hook: Callable[[], None]) -> Callable[[], None]:
    """Have ``hook()`` run at the end of every ``apply_liger_to`` that patched something (once
    per hook, in registration order); returns ``hook``. How an integration that a patch needs
    hooks in (TRL's log-prob kernel, ``integrations/trl.py``) while patching imports no
    integration."""
    if hook not in _AFTER_APPLY:
        _AFTER_APPLY.append(hook)
    return hook


def _check_target(target: Any, caller: str) -> None:
    """Refuse anything but a model, a model class or a model_type string, naming what was given."""
    if not isinstance(target, (str, type, nn.Module)):
        raise TypeError(
            f"{caller} expects a model, a model class or a model_type string, got {type(target).__name__}"
        )


def _refuse(message: str, strict: bool) -> None:
    """Raise :class:`UnsupportedModelError`, or with ``strict=False`` warn that nothing is patched."""
    if strict:
        raise UnsupportedModelError(message)
    warnings.warn(message + " The model is left unpatched.", UserWarning, stacklevel=4)


def _instance_spec(model: nn.Module) -> ModelSpec:
    """The spec for a model instance (row or derived); :class:`UnsupportedModelError` naming
    what did not fit when its class or its output projection cannot be served."""
    spec = spec_for(type(model))
    reason = instance_refusal(model, spec)
    if reason is not None:
        raise UnsupportedModelError(f"liger_patch cannot patch this {type(model).__name__}: {reason}.")
    return spec


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
        install_instance_forward(obj, state)
    setattr(obj, STATE_ATTR, state)


def _warn_if_head_unfusable(model: nn.Module) -> None:
    """Say at apply time (once) when the head will keep the original path (LoRA, quantized...)."""
    state = own_state(model)
    head, reason, _ = fusable_head(model, state.spec)
    if head is None and not state.warned_unfusable_head:
        state.warned_unfusable_head = True
        warnings.warn(unfusable_head_message(model, reason), UserWarning, stacklevel=3)


def _model_type_classes(model_type: str) -> list[type]:
    """The classes a model_type names in the installed transformers (none: empty)."""
    try:
        return [cls for cls, _ in spec_for_model_type(model_type)]
    except UnsupportedModelError:
        return []


def _patch_targets(target: Any) -> list[Any]:
    """The objects a patch of ``target`` lives on: the classes a model_type names, a class
    itself, or an instance's base model (through PEFT / torch.compile wrappers)."""
    if isinstance(target, str):
        return _model_type_classes(target)
    return [target if isinstance(target, type) else base_model_of(target)]


def _resolve(target: Any) -> list[tuple[Any, ModelSpec]]:
    """``(object to patch, spec)`` pairs for ``target``; :class:`UnsupportedModelError` with the
    reason when it cannot be patched."""
    if isinstance(target, str):
        pairs = spec_for_model_type(target)
        _say_which(target, [cls for cls, _ in pairs])
        return pairs
    if isinstance(target, type):
        return [(target, spec_for(target))]
    model = base_model_of(target)
    return [(model, _instance_spec(model))]


def _say_which(model_type: str, classes: list[type]) -> None:
    """Log the classes a model_type string patches, each with its family; warn naming those it
    maps to but cannot patch, with the reason."""
    families: dict[type, list[str]] = {}
    for task, cls in classes_by_task(model_type).items():
        families.setdefault(cls, []).append(task)
    named = ", ".join(f"{cls.__name__} ({', '.join(families.get(cls, ['registered']))})" for cls in classes)
    logger.info("liger_patch: apply_liger_to(%r) patches %s", model_type, named)
    for cls, reason in model_type_refusals(model_type).items():
        if cls not in classes:
            warnings.warn(
                f"{reason} apply_liger_to({model_type!r}) leaves it unpatched.", UserWarning, stacklevel=4
            )


def apply_liger_to(target: Target, *, strict: bool = True, **options: Any) -> Target:
    """Swap a model's vocabulary head + cross-entropy for the fused linear cross-entropy.

    ``target`` may be a model instance (also PEFT-wrapped or ``torch.compile``-d: the base model
    is patched), a model class with a vocabulary head (``*ForCausalLM``,
    ``*ForConditionalGeneration``, ``*ForMaskedLM``, ...: every instance made later is patched)
    or a ``model_type`` string such as ``"llama"`` or ``"t5"`` (every such class transformers maps
    it to is patched: causal LM, image-text-to-text, seq2seq LM, speech seq2seq, masked LM; which
    ones is logged on the ``liger_patch`` logger, and a class it cannot patch is named in a
    warning). Applying again only updates the options. Returns ``target`` unchanged in identity.

    With ``strict=True`` an architecture without a registry row raises
    :class:`UnsupportedModelError`; with ``strict=False`` it warns and leaves the model as is.

    The loss options act in the fused path only and are checked here, with the fused loss's own
    rules (:func:`liger_patch.fused_linear_cross_entropy`). ``z_loss_scale > 0`` reports the
    z-loss term as ``outputs.z_loss``; ``memory_budget=None`` reads ``LIGER_MEMORY_BUDGET`` on
    every call, and when that is unset too the forward uses ``"batch"`` (working memory sized by
    the batch's hidden states, so that the head does not set a training step's peak).
    """
    _check_target(target, "apply_liger_to")
    loss_options = checked_options("apply_liger_to", options)
    try:
        pairs = _resolve(target)
    except UnsupportedModelError as error:
        _refuse(str(error), strict)
        return target
    for obj, spec in pairs:
        _install(obj, spec, loss_options)
        if not isinstance(obj, type):
            _warn_if_head_unfusable(obj)
    for hook in _AFTER_APPLY:
        hook()
    return target


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
    for obj in _patch_targets(target):
        _revert_one(obj)
    return target


def _revert_one(obj: Any) -> None:
    """Uninstall ``obj``'s own patch; warn when an instance stays patched through its class."""
    _uninstall(obj)
    if not isinstance(obj, type) and is_liger_forward(type(obj).forward):
        warnings.warn(
            f"liger_patch: {type(obj).__name__} is patched at class level; this instance stays patched "
            f"until revert_liger({type(obj).__name__}) is called",
            UserWarning,
            stacklevel=3,
        )


@contextlib.contextmanager
def liger_patched(target: Target, **options: Any) -> Iterator[Target]:
    """Scoped ``apply_liger_to``: patched inside the ``with`` block, as before after it.

    Takes ``apply_liger_to``'s ``strict`` and options. If ``target`` was already patched on
    entry, its previous row and options come back on exit and it stays patched.
    """
    _check_target(target, "liger_patched")
    objs = _patch_targets(target)
    for obj in objs:
        forget_stale_patch(obj)  # a dead PatchState is no patch to come back to
    saved = {id(obj): (obj, own_state(obj)) for obj in objs}
    saved = {key: (obj, (st, st.spec, st.options) if st else None) for key, (obj, st) in saved.items()}
    apply_liger_to(target, **options)
    try:
        yield target
    finally:
        for obj, before in saved.values():
            if before is None:
                _revert_one(obj)
            else:
                state, state.spec, state.options = before[0], before[1], before[2]


_TARGET = inspect.Parameter("target", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="Target")
apply_liger_to.__signature__ = options_signature([_TARGET], return_annotation="Target")
liger_patched.__signature__ = options_signature([_TARGET], return_annotation="Iterator[Target]")
apply_liger_to.__doc__ = with_options_doc(apply_liger_to.__doc__)
liger_patched.__doc__ = with_options_doc(liger_patched.__doc__)
