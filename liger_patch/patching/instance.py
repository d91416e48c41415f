"""An instance-level patch: its forward, and the helpers that keep it through pickling and
``nn.DataParallel``; recognising a patch that outlived its forward.

A bound method pickles as ``getattr(instance, "forward")``, evaluated on the instance before
its ``__dict__`` is restored: that is the class's unpatched forward. So a patched instance
gets its own ``__reduce_ex__``: the state it pickles leaves out the two instance attributes
(the forward and that reducer), and the rebuilt instance re-installs them from its PatchState
right after its state is set. The options, and the fused path, survive the round trip.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch.nn as nn

from liger_patch.patching.forward import is_liger_forward, make_liger_forward
from liger_patch.patching.state import STATE_ATTR, PatchState, own_state

__all__ = ["drop_helpers", "forget_stale_patch", "install_instance_forward"]

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
    patch = own_state(self)
    if patch is not None:
        install_instance_forward(self, patch)


def _replicate_patched_instance(self: nn.Module) -> nn.Module:
    """``nn.DataParallel``'s replica of a patched instance, its methods bound to the replica.

    A replica starts as a copy of the instance's ``__dict__``, so the patched forward would still
    be bound to the original module (on the first GPU) and every replica would run it there.
    """
    replica = type(self)._replicate_for_data_parallel(self)
    install_instance_forward(replica, own_state(replica))
    return replica


def install_instance_forward(obj: nn.Module, state: PatchState) -> None:
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


def drop_helpers(obj: Any) -> None:
    """Remove the instance methods a patch added beside the forward (``_HELPER_ATTRS``)."""
    for name in _HELPER_ATTRS:
        vars(obj).pop(name, None)


def _is_stale(obj: Any) -> bool:
    """True for an instance whose PatchState outlived its forward, so applying must install again.

    That is a model pickled by an earlier liger_patch (its instance forward came back as the
    class's own, bound again), or an instance given options under a class patch that was then
    reverted. Any other own forward (a wrapper someone put over ours) is left alone.
    """
    if isinstance(obj, type) or own_state(obj) is None or is_liger_forward(obj.forward):
        return False
    own = vars(obj).get("forward")
    return own is None or getattr(own, "__func__", None) is type(obj).forward


def forget_stale_patch(obj: Any) -> None:
    """Drop a stale PatchState (and the class forward bound again in its place), see ``_is_stale``."""
    if not _is_stale(obj):
        return
    delattr(obj, STATE_ATTR)
    vars(obj).pop("forward", None)
    drop_helpers(obj)
