"""Calling a registered operator's implementation directly where nothing needs the registration.

Both losses are registered operators (``torch.library.custom_op``) so that ``torch.compile``, fake
tensors, functionalization and ``torch.func`` see one node with a fake implementation. A plain
eager call needs none of that, and the registration's dispatch and generated autograd wrapper
cost the host a share of a small call's time (docs/perf-notes.md item 53). ``EagerOp`` runs the
same implementation and autograd formula (the functions given to the registration) as a plain
``torch.autograd.Function`` wherever ``runs_plainly`` says the call is plain eager, and the
registered operator everywhere else: the results are the same bits either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import has_torch_function
from torch.utils._python_dispatch import _get_current_dispatch_mode

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def runs_plainly(args: tuple) -> bool:
    """Whether a call with ``args`` runs plain eager: not traced by ``torch.compile``, under no
    Python dispatch mode (fake tensors, ``make_fx``, functionalization), no torch function mode,
    no ``torch.func`` transform, every tensor a plain tensor or parameter."""
    tensors = tuple(a for a in args if isinstance(a, torch.Tensor))
    return (
        not torch.compiler.is_compiling()
        and all(type(t) in _PLAIN_TYPES for t in tensors)
        and not has_torch_function(tensors)
        and _get_current_dispatch_mode() is None
        and torch._C._functorch.peek_interpreter_stack() is None
    )


class EagerOp:
    """A registered operator and its eager twin: ``op`` (``torch.ops.<ns>.<name>``) and the
    ``impl``, ``setup_context`` and ``backward`` it was registered with. Calling it with every
    argument positional runs the twin where ``runs_plainly``, else ``op``."""

    def __init__(self, op: Callable[..., Any], impl: Callable, setup_context: Callable, backward: Callable):
        self.op = op

        def forward(ctx, *args):
            output = impl(*args)
            setup_context(ctx, args, output)
            return output

        def twin_backward(ctx, *grads):
            return backward(ctx, *grads)

        # Made with type() so that the name (and its grad_fn's, "<impl>_eagerBackward") says what it is.
        name = f"{getattr(impl, '__name__', 'op').lstrip('_')}_eager"
        body = {"forward": staticmethod(forward), "backward": staticmethod(twin_backward)}
        self.twin = type(name, (torch.autograd.Function,), body)

    def __call__(self, *args):
        if runs_plainly(args):
            return self.twin.apply(*args)
        return self.op(*args)
