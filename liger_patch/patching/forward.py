"""The one generic forward that every patched model uses, row or derived.

``make_liger_forward(original)`` returns a drop-in replacement for a causal LM's ``forward``.
It keeps the original signature (``functools.wraps``: the Trainer filters dataset columns and
decides whether to pass ``num_items_in_batch`` by inspecting it, and ``generate`` inspects it
too) and decides on every call which path runs:

* **fused** (training with labels, or ``skip_logits=True``): the model's *own* forward runs,
  with its output projection swapped for a capture (``capture.HeadCapture``) and its causal-LM
  loss for ``causal_loss.causal_lm_loss``, for this call only. The body, any prediction-head
  transform, ``logits_to_keep``, the head math (scale, softcap), the label shift, the MoE aux
  loss and the output class are all the model's; the ``tokens x vocab`` logits are never built
  and the loss comes from the fused op with the user's options (and what this forward sets per
  call, :data:`FORWARD_SETS`). ``logits`` comes back ``None`` (a real ``None``: sentinel objects
  break accelerate's evaluation loop), or real with ``LIGER_RETURN_LOGITS=1`` (read per call).
* **original** (eval mode, no labels, ``generate``, ``skip_logits=False``, a head that cannot be
  fused exactly): the unpatched forward runs untouched.
* **refused on the way**: a forward that uses its logits in a way with no fused counterpart gets
  the real logits right there (``deferred.py``: made from the captured hidden states, the use
  applied to them) and goes on with them, so its output is the unpatched one and its body runs
  once (dropout's random draws, memory and time as unpatched). That patch says why, once, and runs
  the original path from its next call on.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from liger_patch import env
from liger_patch.ops.cross_entropy.options import FLAG_NAMES, build_options
from liger_patch.ops.cross_entropy.outputs import OUTPUT_NAMES
from liger_patch.patching.call import bind_call, positional_names, wants_fused_path
from liger_patch.patching.capture import HeadCapture
from liger_patch.patching.causal_loss import causal_lm_loss
from liger_patch.patching.deferred import replace_deferred
from liger_patch.patching.head import fusable_head, unfusable_head_message
from liger_patch.patching.labels_ahead import LabelsAhead, begin_labels_ahead
from liger_patch.patching.lazy import lazy_imports
from liger_patch.patching.seam import CapturedCall, LossRequest, LossResult
from liger_patch.patching.sharded_head import fused_head_loss
from liger_patch.patching.state import STATE_ATTR, PatchState

__all__ = [
    "CALL_FLAGS",
    "FORWARD_SETS",
    "PatchLoss",
    "is_liger_forward",
    "make_liger_forward",
    "set_by_forward",
]

ORIGINAL_ATTR = "__liger_original__"

_SOURCES = {
    "ignore_index": "the model's own loss call (transformers' default -100)",
    "reduction": "the model's own loss call: 'mean', divided by num_items_in_batch when the call passes it",
    "softcap": "the model's own forward: the tanh softcap it applies to its logits",
    "logit_scale": "the model's own forward: the constants it scales its logits by",
    "return_z_loss": "on when z_loss_scale > 0, the term reported as outputs.z_loss",
}

FORWARD_SETS = tuple(_SOURCES)
"""The loss options the patched forward sets on every call (``_per_call_options``), so a patch
does not take them (``apply_liger_to`` refuses them); ``_SOURCES`` says where each comes from."""


CALL_FLAGS = tuple(name for name in FLAG_NAMES if name not in FORWARD_SETS)
"""The on/off loss options the forward does not set itself. A call may pass them to the patched
model as keywords (TRL's SFTTrainer sent ``return_token_accuracy`` and ``use_token_scaling`` with
``use_liger_kernel`` before its own fused head, as liger-kernel's patched models accept them);
they are taken out of the call (the model's forward never sees them) and turn that option on for
the call. The outputs land on the output as attributes: ``outputs.token_accuracy``,
``outputs.predicted_tokens``, ``outputs.entropy``."""


def set_by_forward(names: list[str]) -> str:
    """``name (where the forward takes it from)`` for each of ``names``, for an error message."""
    return "; ".join(f"{name} ({_SOURCES[name]})" for name in names)


# Not frozen, as seam.LossRequest (torch 2.11's dynamo).
@dataclass
class PatchLoss:
    """The patched forward's side of the loss seam (``seam.DeferredLoss``): the fused loss with
    the patch's options, the options this call sets (:data:`FORWARD_SETS`, from the request and
    the head math) and the call's ``CALL_FLAGS`` (``flags``), through the head's own call when
    FSDP2 / ZeRO-3 owns its weight (``sharded_head.fused_head_loss``)."""

    state: PatchState
    flags: dict[str, bool]
    labels_ahead: LabelsAhead | None = None

    def __call__(
        self,
        *,
        head: nn.Module,
        hidden: torch.Tensor,
        logit_scale: float | None,
        softcap: float | None,
        bias: torch.Tensor | None,
        request: LossRequest,
    ) -> LossResult:
        per_call = self._per_call_options(request, logit_scale, softcap)
        self.state.fused_ran = True
        num_items_in_batch = request.num_items_in_batch
        if self.labels_ahead is not None:  # the tensor its check was begun with
            num_items_in_batch = self.labels_ahead.num_items_for(num_items_in_batch, hidden.device)
        elif torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(hidden.device)
        result = fused_head_loss(
            head,
            hidden.reshape(-1, hidden.shape[-1]),
            request.targets.reshape(-1),
            options=self.state.options,
            num_items_in_batch=num_items_in_batch,
            extra_bias=bias,
            **per_call,
        )
        if not isinstance(result, tuple):
            return result, {}
        return result.loss, dict(zip(result._fields[1:], result[1:], strict=True))

    def _per_call_options(
        self, request: LossRequest, logit_scale: float | None, softcap: float | None
    ) -> dict[str, Any]:
        """The options this call sets (:data:`FORWARD_SETS`, a smoothing the loss call asked for,
        the call's flags, the batch budget) over the patch's own."""
        per_call = dict(
            ignore_index=request.ignore_index,
            reduction=request.reduction,
            softcap=softcap,
            logit_scale=logit_scale,
            # Read from the options rebuilt from their key: under torch.compile the numbers inside the
            # patch's own options object are traced as symbols, and the options must be constants.
            return_z_loss=build_options(self.state.options.key).z_loss_scale > 0,
            **{name: True for name, on in self.flags.items() if on},
            **self.state.budget_changes(),
        )
        if request.label_smoothing:
            per_call["label_smoothing"] = request.label_smoothing
        return per_call


def _parent_and_name(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent_path, _, name = path.rpartition(".")
    return (model.get_submodule(parent_path) if parent_path else model), name


def _stock_causal_loss(model: nn.Module) -> bool:
    """True when the model's ``loss_function`` is transformers' own ``ForCausalLM`` loss (not a
    user's): only then is it swapped for the fused one during the call."""
    if "_loss_function" in vars(model):
        return False
    stock = lazy_imports()["causal_lm_loss"]
    try:
        return getattr(model, "loss_function", None) is stock
    except Exception:  # a property of remote code may raise; then it is not the stock one
        return False


def _finish(model: nn.Module, output: Any, call: CapturedCall, state: PatchState) -> Any:
    """The output with deferred logits replaced (``None``, or real with ``LIGER_RETURN_LOGITS=1``
    or when the call was refused) and ``z_loss`` attached; refused when the forward computed no
    loss from its logits (they come back real, as unpatched)."""
    if call.head_calls and not call.losses:
        call.refuse("its forward called its output projection but computed no loss from it")
    if call.refusal is not None:
        _note_unfusable(
            model, state, f"{call.refusal} (there is no exact fused counterpart){_not_vocab(model)}"
        )
    materialize = env.return_logits() or call.refusal is not None
    if isinstance(output, dict):  # every ModelOutput
        for key, value in list(output.items()):
            new = replace_deferred(value, materialize)
            if new is not value:
                output[key] = new  # item assignment: the key keeps its to_tuple() slot even as None
    else:
        output = replace_deferred(output, materialize)
    z_loss = torch.stack(call.z_losses).sum() if call.z_losses else None
    if z_loss is not None and model.training:
        state.z_loss_tracker.add(z_loss)
    if hasattr(output, "__dict__"):  # a ModelOutput (a tuple or a plain dict has no attributes)
        # Attributes, not fields: they stay out of to_tuple() and of the Trainer's logits tuple.
        values = {**call.outputs, "z_loss": z_loss}
        for name in OUTPUT_NAMES:  # attributes, the op's outputs (None when not asked for)
            object.__setattr__(output, name, values.get(name))
    return output


def _not_vocab(model: nn.Module) -> str:
    """Where the module ``get_output_embeddings()`` names is not vocabulary-sized (DeBERTa-v2's
    new head names its transform's dense layer, and multiplies by the embedding's weight itself):
    the words that say so, for a refusal's reason; else ``""``."""
    head = _output_module(model)
    vocab = getattr(_text_config(model), "vocab_size", None)
    out = getattr(head, "out_features", None)
    if not isinstance(vocab, int) or not isinstance(out, int) or out == vocab:
        return ""
    return (
        f"; note: the layer get_output_embeddings() names gives {out} outputs, not the vocabulary's "
        f"{vocab}: the forward makes its logits without an output projection to capture"
    )


def _output_module(model: nn.Module) -> Any:
    try:
        return model.get_output_embeddings()
    except Exception:  # no such method, or one remote code breaks
        return None


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    try:
        return config.get_text_config()
    except Exception:
        return config


def fused_forward(
    model: nn.Module,
    state: PatchState,
    run: Callable,
    args: tuple,
    kwargs: dict,
    path: str,
    head: nn.Module,
    flags: dict[str, bool] | None = None,
    bound: dict[str, Any] | None = None,
) -> Any:
    """The fused path: ``run(model, *args, **kwargs)``, the model's own forward, with the module at
    ``path`` replaced by a capture of ``head`` (wearing the registered module's face) and the
    stock causal-LM loss swapped, both restored afterwards whatever happens; its losses come from
    :class:`PatchLoss` (``flags``: the call's ``CALL_FLAGS``). Where the stock loss is swapped,
    the label check of the call's labels (``bound``: its arguments by name) is begun before the
    body runs (``labels_ahead.py``)."""
    swap_loss = _stock_causal_loss(model)
    parent, name = _parent_and_name(model, path)
    registered = parent._modules[name]
    ahead = begin_labels_ahead(head, state, bound) if swap_loss and bound is not None else None
    call = CapturedCall(compute_loss=PatchLoss(state, flags or {}, ahead), labels_ahead=ahead)
    parent._modules[name] = HeadCapture(head, call, registered)
    if swap_loss:
        model.__dict__["_loss_function"] = causal_lm_loss
    output = None
    try:
        output = run(model, *args, **kwargs)
    finally:
        parent._modules[name] = registered
        if swap_loss:
            delattr(model, "_loss_function")  # (not __dict__.pop: torch 2.11's dynamo cannot trace it)
        if ahead is not None:
            ahead.end(state, completed=output is not None)
    if not call.head_calls:
        _note_unfusable(model, state, _never_called(parent, name, path, call))
    return _finish(model, output, call, state)


def _never_called(parent: nn.Module, name: str, path: str, call: CapturedCall) -> str:
    """Why a forward that never called its output projection cannot be fused: its own loss, or
    (it read the projection's weight) logits its own code makes from that weight, e.g.
    MobileBERT's head multiplying by the decoder's weight concatenated with another layer's."""
    if not call.weight_reads:
        return f"its forward never called its output projection ({path}; the loss is its own)"
    return (
        f"its forward never called its output projection ({path}) but read its weight: "
        f"{type(parent).__name__}.forward makes the logits from {name}.weight itself (a product "
        "with it, or with a matrix built from it), so there is no head call to capture"
    )


def _note_unfusable(model: nn.Module, state: PatchState, reason: str) -> None:
    """Remember (and say once) why this patch runs the original path from now on."""
    if state.unfusable_reason is None:
        state.unfusable_reason = reason
        warnings.warn(unfusable_head_message(model, reason), UserWarning, stacklevel=4)


def _warn_unfusable_once(model: nn.Module, state: PatchState, reason: str) -> None:
    if not state.warned_unfusable_head:
        state.warned_unfusable_head = True
        warnings.warn(unfusable_head_message(model, reason), UserWarning, stacklevel=4)


def warn_logits_in_training(model: nn.Module, state: PatchState) -> None:
    """A training call without labels builds the full logits, and whatever takes a loss from
    them bypasses the fused op: said once per patch."""
    state.bypass_reason = "it was called in training without labels and returned the full logits"
    state.warn_bypass_once(bypass_message(model, state.bypass_reason), stacklevel=4)


def bypass_message(model: nn.Module, reason: str) -> str:
    """The bypass warning: what happened to ``model``'s loss and what to do."""
    return (
        f"liger_patch: the fused loss did not compute {type(model).__name__}'s loss: {reason}. A loss "
        "taken from logits (a compute_loss override, compute_loss_func, knowledge distillation) "
        "builds the tokens x vocab logits the patch exists to avoid. Pass labels= to the model, or "
        "call liger_patch.fused_linear_cross_entropy / fused_linear_logprobs on its hidden states "
        "(docs/integrations.md). Silence with warnings.filterwarnings('ignore', "
        "category=liger_patch.LigerBypassWarning)."
    )


def make_liger_forward(original: Callable, fallback: Callable | None = None) -> Callable:
    """Wrap an unbound causal-LM ``forward`` with the fused path.

    ``original`` gives the signature (kept via ``functools.wraps``) and, unless ``fallback`` is
    given, is what runs (captured on the fused path, as is on the original path).
    ``fallback(self, *args, **kwargs)`` replaces it when the instance already had its own
    forward (accelerate's autocast wrapper, another patch) that must keep running.
    """
    lazy_imports()  # here, eagerly: the forward itself (maybe under torch.compile) then imports nothing
    run = fallback if fallback is not None else original
    names = positional_names(original)

    @functools.wraps(original)
    def liger_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        skip_logits = kwargs.pop("skip_logits", None)
        flags = {name: bool(kwargs.pop(name)) for name in CALL_FLAGS if name in kwargs}
        state: PatchState | None = getattr(self, STATE_ATTR, None)
        if state is None or kwargs.get("fused_lm_head"):
            # unpatched, or TRL's fused head, whose log-prob kernel is ours (integrations/trl.py)
            return run(self, *args, **kwargs)
        call = bind_call(names, args, kwargs)
        if call is None or not wants_fused_path(self, call.get("labels"), skip_logits):
            if call is not None and skip_logits is None and self.training and torch.is_grad_enabled():
                warn_logits_in_training(self, state)
            return run(self, *args, **kwargs)  # not fused, or a call it must reject
        if state.unfusable_reason is not None:
            return run(self, *args, **kwargs)
        head, reason, path = fusable_head(self, state.spec)
        if head is None:
            _warn_unfusable_once(self, state, reason)
            return run(self, *args, **kwargs)
        return fused_forward(self, state, run, args, kwargs, path, head, flags, call)

    setattr(liger_forward, ORIGINAL_ATTR, original)
    return liger_forward


def is_liger_forward(function: Any) -> bool:
    """True for a forward made by :func:`make_liger_forward` (bound or not)."""
    return hasattr(getattr(function, "__func__", function), ORIGINAL_ATTR)
