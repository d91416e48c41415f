"""Calling a registered operator's implementation directly where nothing needs the registration.

Both losses are registered operators (``torch.library.custom_op``) so that ``torch.compile``, fake
tensors, functionalization and ``torch.func`` see one node with a fake implementation. A plain
eager call needs none of that, and the registration's dispatch and generated autograd wrapper
cost the host a share of a small call's time (docs/perf-notes.md item 53). ``EagerOp`` runs the
same implementation and autograd formula (the functions given to the registration) as a plain
``torch.autograd.Function`` wherever ``runs_plainly`` says the call is plain eager, and the
registered operator everywhere else: the results are the same bits either way. An operator
registered without an autograd formula (the backward operators, the in-place scaling of the
gradients) runs its implementation directly, under ``torch.no_grad`` as the registration's
outputs carry no graph either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.overrides import has_torch_function
from torch.utils._python_dispatch import _get_current_dispatch_mode

from liger_patch.ops.core.contexts import without_grad

_PLAIN_TYPES = (Tensor, torch.nn.Parameter)


def runs_plainly(args: tuple) -> bool:
    """Whether a call with ``args`` runs plain eager: not traced by ``torch.compile``, under no
    Python dispatch mode (fake tensors, ``make_fx``, functionalization), no torch function mode,
    no ``torch.func`` transform, every tensor (an argument, or in a list argument) a plain tensor
    or parameter."""
    if torch.compiler.is_compiling():
        return False
    tensors = []
    for a in args:  # loops, not generators: this runs at every call (host time)
        for t in a if isinstance(a, list) else (a,):
            if isinstance(t, Tensor):
                if type(t) not in _PLAIN_TYPES:
                    return False
                tensors.append(t)
    return (
        not has_torch_function(tensors)
        and _get_current_dispatch_mode() is None
        and torch._C._functorch.peek_interpreter_stack() is None
    )


class EagerOp:
    """A registered operator and its eager twin: ``op`` (``torch.ops.<ns>.<name>``) and the
    ``impl``, ``setup_context`` and ``backward`` it was registered with (none for an operator
    without an autograd formula; ``impl`` may differ from the registered one only where an
    autograd.Function allows what an operator does not, ``EmptyOutputs``). Calling it with every
    argument positional runs the twin where ``runs_plainly``, else ``op``."""

    def __init__(
        self,
        op: Callable[..., Any],
        impl: Callable,
        setup_context: Callable | None = None,
        backward: Callable | None = None,
    ):
        self.op, self.impl = op, impl
        self.twin = None if backward is None else self._autograd_twin(op, impl, setup_context, backward)
        # Without a formula the registration's outputs carry no graph: neither may the twin's.
        self._plain = without_grad(impl) if backward is None else None

    @staticmethod
    def _autograd_twin(op: Callable, impl: Callable, setup_context: Callable, backward: Callable) -> type:
        def forward(ctx, *args):
            output = impl(*args)
            setup_context(ctx, args, output)
            return output

        def twin_backward(ctx, *grads):
            return backward(ctx, *grads)

        # Made with type() so that the name (and its grad_fn's, "<op>_eagerBackward") says what it is.
        name = f"{getattr(op, '__name__', 'op')}_eager"
        body = {"forward": staticmethod(forward), "backward": staticmethod(twin_backward)}
        return type(name, (torch.autograd.Function,), body)

    def __call__(self, *args):
        if not runs_plainly(args):
            return self.op(*args)
        if self.twin is not None:
            return self.twin.apply(*args)
        return self._plain(*args)


class EmptyOutputs:
    """Zero-size tensors for an operator's outputs that a call did not ask for (an operator's
    outputs may not be ``None``), on ``device``. A registered operator's outputs may not alias
    each other or its inputs, so there (``shared=False``) each is a new tensor; the eager twin, a
    plain ``autograd.Function``, may return one tensor in several places, so there one tensor per
    dtype serves the whole call: fewer allocations, each of them host time."""

    def __init__(self, device: torch.device, shared: bool):
        self.device, self.shared = device, shared
        self._made: dict[torch.dtype, Tensor] = {}

    def __call__(self, dtype: torch.dtype) -> Tensor:
        if not self.shared:
            return torch.empty(0, dtype=dtype, device=self.device)
        made = self._made.get(dtype)
        if made is None:
            made = self._made[dtype] = torch.empty(0, dtype=dtype, device=self.device)
        return made
