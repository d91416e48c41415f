"""``apply_liger_to`` / ``revert_liger`` / ``liger_patched``: putting the generic forward in place.

Patching an *instance* sets ``model.forward`` on that instance only (its class and every other
model are untouched). Patching a *class* (or a ``model_type`` string, which names a class)
replaces ``cls.forward``, so every instance made later is patched. Either way the object gets a
:class:`~liger_patch.patching.forward.PatchState` recording the options and what was there
before, which is how a second apply stays a no-op wrapper-wise and how ``revert_liger``
restores the exact original. A patched instance also gets its own ``__reduce_ex__``, so that
``torch.save`` / ``pickle`` / ``copy`` bring it back patched (see the section below).
"""

from __future__ import annotations

import contextlib
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch.nn as nn

from liger_patch.ops.budget import parse_memory_budget
from liger_patch.ops.options import LossOptions
from liger_patch.ops.validation import check_options, option_float
from liger_patch.patching.forward import (
    STATE_ATTR,
    PatchState,
    fusable_head,
    is_liger_forward,
    make_liger_forward,
    missing_path_message,
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


_OPTION_NAMES = ("z_loss_scale", "label_smoothing", "memory_budget")


def _validate_options(z_loss_scale: Any, label_smoothing: Any, memory_budget: Any) -> None:
    """Refuse at apply time what the fused loss would refuse on every forward: the op's own rules."""
    options = LossOptions(
        z_loss_scale=option_float("z_loss_scale", z_loss_scale),
        label_smoothing=option_float("label_smoothing", label_smoothing),
    )
    check_options(options, "mean", "auto", None)
    if memory_budget is not None:
        parse_memory_budget(memory_budget)


def _set_options(state: PatchState, options: dict[str, Any]) -> None:
    for name in _OPTION_NAMES:
        setattr(state, name, options[name])


def _own_state(obj: Any) -> PatchState | None:
    """The PatchState set on ``obj`` itself (not inherited from a patched class)."""
    return vars(obj).get(STATE_ATTR)


# --------------------------------------------------------------------------------------------
# Instance patches that survive pickling (torch.save / torch.load, pickle, copy)
#
# A bound method pickles as ``getattr(instance, "forward")``, evaluated on the instance before
# its ``__dict__`` is restored: that is the class's unpatched forward. So a patched instance
# gets its own ``__reduce_ex__``: the state it pickles leaves out the two instance attributes
# (the forward and that reducer), and the rebuilt instance re-installs them from its PatchState
# right after its state is set. The options, and the fused path, survive the round trip.
# --------------------------------------------------------------------------------------------

_REDUCER_ATTR = "__reduce_ex__"
_REPLICATE_ATTR = "_replicate_for_data_parallel"
_HELPER_ATTRS = (_REDUCER_ATTR, _REPLICATE_ATTR)
"""Instance methods a patch adds beside the forward, each bound to the instance."""


def _reduce_patched_instance(self: nn.Module, protocol: int) -> Any:
    """The class's own reduction, minus the patch's instance attributes, rebuilt by ``_rebuild_patched``."""
    reduced = type(self).__reduce_ex__(self, protocol)
    if not (isinstance(reduced, tuple) and len(reduced) >= 3 and isinstance(reduced[2], dict)):
        return reduced  # a class with its own pickling: left as it is (apply_liger_to re-patches)
    state = {k: v for k, v in reduced[2].items() if k != "forward" and k not in _HELPER_ATTRS}
    return (_rebuild_patched, (reduced[0], reduced[1]), state, *reduced[3:])


def _rebuild_patched(constructor: Callable, args: tuple) -> Any:
    """Unpickling step 1: the bare instance, with a one-shot ``__setstate__`` that re-patches it."""
    obj = constructor(*args)
    vars(obj)["__setstate__"] = types.MethodType(_setstate_and_repatch, obj)
    return obj


def _setstate_and_repatch(self: nn.Module, state: dict[str, Any]) -> None:
    """Unpickling step 2: the class's ``__setstate__``, then the forward from the PatchState."""
    del vars(self)["__setstate__"]
    class_setstate = getattr(type(self), "__setstate__", None)
    if class_setstate is not None:
        class_setstate(self, state)
    else:
        vars(self).update(state)
    patch = _own_state(self)
    if patch is not None:
        _install_instance_forward(self, patch)


def _install_instance_forward(obj: nn.Module, state: PatchState) -> None:
    """Give an instance the generic forward (unless its class is patched), its reducer and its
    DataParallel replicator."""
    cls_forward = type(obj).forward
    if is_liger_forward(cls_forward):
        return  # the class patch serves this instance; only its options are its own
    fallback = None
    if state.had_own_forward:  # e.g. accelerate's autocast wrapper, which must keep running
        previous = state.previous_forward
        fallback = lambda self, *args, **kwargs: previous(*args, **kwargs)  # noqa: ARG005, E731
    obj.forward = types.MethodType(make_liger_forward(cls_forward, fallback), obj)
    setattr(obj, _REDUCER_ATTR, types.MethodType(_reduce_patched_instance, obj))
    setattr(obj, _REPLICATE_ATTR, types.MethodType(_replicate_patched_instance, obj))


def _replicate_patched_instance(self: nn.Module) -> nn.Module:
    """``nn.DataParallel``'s replica of a patched instance, its methods bound to the replica.

    A replica starts as a copy of the instance's ``__dict__``, so the patched forward would still
    be bound to the original module (on the first GPU) and every replica would run it there.
    """
    replica = type(self)._replicate_for_data_parallel(self)
    _install_instance_forward(replica, _own_state(replica))
    return replica


def _drop_helpers(obj: Any) -> None:
    """Remove the instance methods a patch added beside the forward (``_HELPER_ATTRS``)."""
    for name in _HELPER_ATTRS:
        vars(obj).pop(name, None)


def _is_stale(obj: Any) -> bool:
    """True for an instance whose PatchState outlived its forward, so applying must install again.

    That is a model pickled by an earlier liger_patch (its instance forward came back as the
    class's own, bound again), or an instance given options under a class patch that was then
    reverted. Any other own forward (a wrapper someone put over ours) is left alone.
    """
    if isinstance(obj, type) or _own_state(obj) is None or is_liger_forward(obj.forward):
        return False
    own = vars(obj).get("forward")
    return own is None or getattr(own, "__func__", None) is type(obj).forward


def _forget_stale_patch(obj: Any) -> None:
    """Drop a stale PatchState (and the class forward bound again in its place), see ``_is_stale``."""
    if not _is_stale(obj):
        return
    delattr(obj, STATE_ATTR)
    vars(obj).pop("forward", None)
    _drop_helpers(obj)


def _install(obj: Any, spec: ModelSpec, options: dict[str, Any]) -> None:
    """Give ``obj`` (a class or an instance) the generic forward and a PatchState; idempotent."""
    _forget_stale_patch(obj)
    state = _own_state(obj)
    if state is not None:  # already patched here: only the options change, the wrapper is not stacked
        state.spec = spec
        _set_options(state, options)
        return
    had_own_forward = "forward" in vars(obj)
    state = PatchState(spec, had_own_forward=had_own_forward, previous_forward=vars(obj).get("forward"))
    _set_options(state, options)
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
        _install_instance_forward(obj, state)
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
        _unsupported(f"class {cls.__module__}.{cls.__qualname__}", _how_to_register(model), strict)
        return
    mismatch = _spec_mismatch(model, spec)
    if mismatch is not None:
        _refuse(mismatch, strict)
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
    _check_target(target, "apply_liger_to")
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
    else:
        _patch_instance(base_model_of(target), strict, options)
    return target


def _uninstall(obj: Any) -> None:
    """Remove ``obj``'s own patch: its PatchState and the forward (and reducer) it installed."""
    _forget_stale_patch(obj)
    state = _own_state(obj)
    if state is None:
        return
    delattr(obj, STATE_ATTR)
    if not isinstance(obj, type):
        _drop_helpers(obj)
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
    _check_target(target, "liger_patched")
    obj: Any = target
    if isinstance(target, str):
        spec = spec_for_model_type(target)
        obj = spec.resolve_class() if spec is not None else None
    elif not isinstance(target, type):
        obj = base_model_of(target)
    if obj is not None:
        _forget_stale_patch(obj)  # a dead PatchState is no patch to come back to
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
