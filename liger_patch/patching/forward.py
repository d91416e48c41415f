"""The one generic causal-LM forward that every registry row uses.

``make_liger_forward(original)`` returns a drop-in replacement for a ``*ForCausalLM.forward``.
It keeps the original signature (``functools.wraps``: the Trainer filters dataset columns and
decides whether to pass ``num_items_in_batch`` by inspecting it, and ``generate`` inspects it
too) and decides on every call which path runs:

* **fused** (training with labels, or ``skip_logits=True``): run the decoder body, slice the
  hidden states as ``logits_to_keep`` says, shift the labels exactly as transformers'
  ``ForCausalLMLoss`` does, and hand hidden states + head weight to
  ``fused_linear_cross_entropy`` with the row's logit scale and softcap. No ``tokens x vocab``
  tensor is built; ``logits`` is ``None`` (a real ``None``: sentinel objects break accelerate's
  evaluation loop). MoE rows add the model's own router load-balancing loss.
* **original** (eval mode, no labels, ``generate``, ``skip_logits=False``, or a head that cannot
  be fused exactly): the unpatched forward runs untouched.

``LIGER_RETURN_LOGITS=1`` (read on every call) keeps the fused loss and also returns the real
logits, computed exactly like the original head does.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from liger_patch import env
from liger_patch.patching.registry import ModelSpec
from liger_patch.patching.sharded_head import fused_head_loss, is_dtensor, sharded_head_reason

STATE_ATTR = "_liger_patch_state"
ORIGINAL_ATTR = "__liger_original__"
_FLOAT8_DTYPES = tuple(getattr(torch, name) for name in dir(torch) if name.startswith("float8_"))


class ZLossTracker:
    """Accumulates the detached z-loss terms of training forwards for the Trainer callback.

    It only adds tensors (no ``.item()``, so no host sync in the training step); the callback
    turns the sum into a number when it logs.
    """

    def __init__(self) -> None:
        self._terms: list[torch.Tensor] = []  # this optimizer step's forwards so far
        self._step_sum: torch.Tensor | None = None
        self._steps = 0

    def add(self, z_loss: torch.Tensor) -> None:
        """Record one forward's z-loss term (the part already inside its loss). ``nn.DataParallel``
        replicas call this from their own threads with terms on their own GPUs: ``list.append``
        is atomic, and nothing is added across devices here."""
        self._terms.append(z_loss.detach().float())

    def end_step(self) -> None:
        """Close an optimizer step: its micro-batches' terms add up to the step's z-loss. Under
        ``nn.DataParallel`` every GPU's replica saw a slice of each micro-batch and the Trainer
        averages the replicas' losses, so the step's z-loss is the mean over GPUs of each GPU's
        sum (with one device, just the sum)."""
        if not self._terms:
            return
        terms, self._terms = self._terms, []
        per_device: dict[torch.device, list[torch.Tensor]] = {}
        for term in terms:
            per_device.setdefault(term.device, []).append(term)
        home = terms[0].device
        step = torch.stack([torch.stack(ts).sum().to(home) for ts in per_device.values()]).mean()
        self._step_sum = step if self._step_sum is None else self._step_sum + step
        self._steps += 1

    def pop_mean(self) -> float | None:
        """Mean z-loss per optimizer step since the last call, or ``None`` if none was recorded."""
        self.end_step()
        if self._step_sum is None or self._steps == 0:
            return None
        value = float(self._step_sum) / self._steps
        self._step_sum, self._steps = None, 0
        return value


@dataclass
class PatchState:
    """What ``apply_liger_to`` attaches to a patched model or class.

    ``spec`` is the registry row; the loss options are the user's; ``previous_forward`` is
    what ``revert_liger`` puts back (``None`` when the object had no forward of its own).
    """

    spec: ModelSpec
    z_loss_scale: float = 0.0
    label_smoothing: float = 0.0
    memory_budget: int | str | None = None
    had_own_forward: bool = False
    previous_forward: Any = None
    z_loss_tracker: ZLossTracker = field(default_factory=ZLossTracker)
    warned_unfusable_head: bool = False


# --------------------------------------------------------------------------------------------
# Imports made on first use: importing transformers (or peft) costs about a second, and
# ``import liger_patch`` must not pay it. ``make_liger_forward`` fills the cache eagerly, so
# the patched forward (also when torch.compile traces it) only reads a dict.
# --------------------------------------------------------------------------------------------

_LAZY: dict[str, Any] = {}


def _load_lazy_imports() -> dict[str, Any]:
    """The transformers/peft names the patched forward uses, imported once and cached."""
    if not _LAZY:
        from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

        try:  # transformers 5.x names the slicing (and adds 2-D position/mask forms); 4.57 sliced inline
            from transformers.modeling_utils import slice_logits_to_keep
        except ImportError:
            slice_logits_to_keep = None
        try:
            from peft.tuners.tuners_utils import BaseTunerLayer
        except ImportError:
            BaseTunerLayer = ()  # noqa: N806 - peft absent: nothing can be a peft layer
        _LAZY.update(
            dense_output=CausalLMOutputWithPast,
            moe_output=MoeCausalLMOutputWithPast,
            slice_logits_to_keep=slice_logits_to_keep,
            peft_tuner_layer=BaseTunerLayer,
        )
    return _LAZY


def missing_path_message(model: nn.Module, path: str) -> str | None:
    """Why ``model.<path>`` is not a submodule, naming the child modules that are there; else ``None``.

    Registry rows name the body and head by attribute path; a wrong path should be reported as
    such (with what the model does have), not as an AttributeError from inside a forward.
    """
    obj: Any = model
    names = path.split(".")
    for depth, name in enumerate(names):
        child = getattr(obj, name, None)
        if not isinstance(child, nn.Module):
            owner = ".".join([type(model).__name__, *names[:depth]])
            children = ", ".join(n for n, _ in obj.named_children()) or "none"
            return f"{owner} has no submodule {name!r} (path {path!r}); its child modules are: {children}"
        obj = child
    return None


def get_submodule_path(model: nn.Module, path: str) -> Any:
    """``model.<path>`` for a dotted attribute path such as ``"model"`` or ``"transformer.h"``."""
    obj: Any = model
    try:
        for name in path.split("."):
            obj = getattr(obj, name)
    except AttributeError as error:
        message = missing_path_message(model, path) or str(error)
        raise AttributeError(f"liger_patch: {message}; fix the ModelSpec registered for it") from error
    return obj


# --------------------------------------------------------------------------------------------
# Which head can be fused exactly
# --------------------------------------------------------------------------------------------


def _active_modules_to_save_copy(head: nn.Module) -> nn.Module:
    """The module a peft ``ModulesToSaveWrapper`` would run: the trainable copy when active."""
    if not (hasattr(head, "modules_to_save") and hasattr(head, "original_module")):
        return head
    active = list(getattr(head, "active_adapters", []) or [])
    if getattr(head, "disable_adapters", False) or not active or active[0] not in head.modules_to_save:
        return head.original_module
    return head.modules_to_save[active[0]]


def _is_peft_adapter_layer(module: nn.Module) -> bool:
    """True for peft tuner layers (LoRA & co.): their ``.weight`` is the base weight only."""
    tuner_layer = _load_lazy_imports()["peft_tuner_layer"]
    return isinstance(module, tuner_layer) or type(module).__module__.startswith("peft.tuners")


def fusable_head(model: nn.Module, spec: ModelSpec) -> tuple[nn.Linear | None, str]:
    """The ``nn.Linear`` whose weight/bias the fused loss may use, or ``(None, reason)``.

    The kernel reads ``head.weight`` and ``head.bias`` directly, so it is exact only for a plain
    linear layer with a dense floating-point weight. A LoRA-wrapped head (the adapter would be
    silently dropped), a quantized head (packed integer/float8 weight or an overridden forward)
    and an offloaded head (weight on ``meta``) all take the original path instead. An FSDP2-sharded
    weight (a DTensor) is fused: ``sharded_head.fused_head_loss`` gathers it; a tensor-parallel one
    is not.
    """
    head = _active_modules_to_save_copy(get_submodule_path(model, spec.head))
    if _is_peft_adapter_layer(head):
        return None, (
            f"its {spec.head} is a PEFT adapter layer ({type(head).__name__}, e.g. LoRA on lm_head), whose "
            "weight is the base weight only; fusing would drop the adapter. Use "
            "modules_to_save=['lm_head'] instead of targeting lm_head with LoRA to keep the fused loss"
        )
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        return None, f"its {spec.head} is a {type(head).__name__}, not a plain nn.Linear (quantized?)"
    weight = head.weight
    sharded_reason = sharded_head_reason(model, head)
    if sharded_reason:
        return None, sharded_reason
    if (
        (type(weight) not in (nn.Parameter, torch.Tensor) and not is_dtensor(weight))
        or not weight.is_floating_point()
        or weight.dtype in _FLOAT8_DTYPES
    ):
        return None, f"its {spec.head} weight is quantized ({type(weight).__name__}, {weight.dtype})"
    if weight.device.type == "meta":
        return None, f"its {spec.head} weight is offloaded (on the meta device)"
    return head, ""


def unfusable_head_message(model: nn.Module, reason: str) -> str:
    return f"liger_patch: {type(model).__name__} keeps its original loss path (full logits) because {reason}."


# --------------------------------------------------------------------------------------------
# The pieces of the fused path
# --------------------------------------------------------------------------------------------


def keep_positions(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """Slice hidden states exactly as the original forward slices them before its head."""
    slice_logits_to_keep = _load_lazy_imports()["slice_logits_to_keep"]
    if slice_logits_to_keep is not None:
        return slice_logits_to_keep(hidden, logits_to_keep)
    positions = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return hidden[:, positions, :]


def causal_targets(
    labels: torch.Tensor, shift_labels: torch.Tensor | None, ignore_index: int
) -> torch.Tensor:
    """Per-position targets, as transformers' ``ForCausalLMLoss`` builds them.

    Position t predicts token t+1: labels are shifted left by one and the last position gets
    ``ignore_index``. ``shift_labels`` (already shifted, e.g. by context parallelism) wins.
    """
    if shift_labels is not None:
        return shift_labels
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def head_logits(head: nn.Linear, hidden: torch.Tensor, spec: ModelSpec, config: Any) -> torch.Tensor:
    """The logits the original head produces (for ``LIGER_RETURN_LOGITS=1``), same op order."""
    logits = head(hidden)
    if spec.logit_divisor_attr is not None and getattr(config, spec.logit_divisor_attr, None) is not None:
        logits = logits / getattr(config, spec.logit_divisor_attr)
    if spec.logit_scale_attr is not None and getattr(config, spec.logit_scale_attr, None) is not None:
        logits = logits * getattr(config, spec.logit_scale_attr)
    softcap = spec.softcap(config)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def _model_module_function(model: nn.Module, original: Callable, name: str) -> Callable:
    """A function from the module that defines the original forward (the model's own helper)."""
    module = sys.modules.get(getattr(inspect.unwrap(original), "__module__", ""), None)
    func = getattr(module, name, None)
    if func is None:
        module = sys.modules.get(type(model).__module__)
        func = getattr(module, name, None)
    if func is None:
        raise AttributeError(
            f"liger_patch: {type(model).__name__}'s modeling module has no {name}(); set "
            "ModelSpec.moe.loss_func_name to the name its forward uses"
        )
    return func


# body class -> (names its forward accepts, whether it takes **kwargs). A plain dict rather than
# functools.lru_cache: torch.compile traces through a dict lookup without warnings.
_BODY_PARAMETERS: dict[type, tuple[frozenset[str], bool]] = {}


def _accepted_parameters(body_cls: type) -> tuple[frozenset[str], bool]:
    """Names a body's forward accepts, and whether it takes ``**kwargs``."""
    if body_cls not in _BODY_PARAMETERS:
        params = inspect.signature(body_cls.forward).parameters.values()
        names = frozenset(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
        _BODY_PARAMETERS[body_cls] = (names, any(p.kind is p.VAR_KEYWORD for p in params))
    return _BODY_PARAMETERS[body_cls]


def _body_arguments(body: nn.Module, call: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments that the decoder body takes (all of them when it has ``**kwargs``)."""
    names, takes_kwargs = _accepted_parameters(type(body))
    arguments = {k: v for k, v in call.items() if takes_kwargs or k in names}
    if "return_dict" in names:
        arguments["return_dict"] = True
    return arguments


def _output_class(spec: ModelSpec) -> type:
    """The output dataclass the original forward returns: the MoE one for MoE rows."""
    return _load_lazy_imports()["moe_output" if spec.moe is not None else "dense_output"]


def _as_tuple(output: Any) -> tuple:
    """``output.to_tuple()`` as the unpatched model's ``return_dict=False`` gives it, slot for slot.

    ``to_tuple()`` drops ``None`` fields. The unpatched model always has logits, so dropping the
    fused path's ``None`` logits would shift every later field (``past_key_values`` would land
    where callers read logits). The logits slot is kept (``None``, or the real logits with
    ``LIGER_RETURN_LOGITS=1``); every other field is dropped when ``None``, as the original does.
    """
    values = ((f.name, getattr(output, f.name)) for f in dataclasses.fields(output))
    return tuple(value for name, value in values if value is not None or name == "logits")


def _body_field(outputs: Any, name: str) -> Any:
    return outputs.get(name) if hasattr(outputs, "get") else None


def fused_causal_lm_forward(
    model: nn.Module, original: Callable, call: dict[str, Any], head: nn.Linear, state: PatchState
) -> Any:
    """The fused path: body -> last hidden states -> fused linear cross-entropy -> output."""
    spec, config = state.spec, model.config
    labels = call.pop("labels")
    logits_to_keep = call.pop("logits_to_keep", 0)
    return_dict = call.pop("return_dict", None)
    num_items_in_batch = call.pop("num_items_in_batch", None)
    shift_labels = call.pop("shift_labels", None)
    ignore_index = call.pop("ignore_index", -100)
    if return_dict is None:
        return_dict = getattr(config, "return_dict", True)

    output_router_logits = False
    if spec.moe is not None:
        output_router_logits = call.get("output_router_logits")
        if output_router_logits is None:
            output_router_logits = bool(getattr(config, "output_router_logits", False))
        call["output_router_logits"] = output_router_logits

    body = get_submodule_path(model, spec.body)
    outputs = body(**_body_arguments(body, call))
    hidden = keep_positions(outputs[0], logits_to_keep)

    targets = causal_targets(labels, shift_labels, ignore_index).to(hidden.device)
    if targets.numel() * hidden.shape[-1] != hidden.numel():
        raise ValueError(
            f"liger_patch: labels give {targets.numel()} targets but the model produced "
            f"{hidden.numel() // hidden.shape[-1]} positions (hidden states {tuple(hidden.shape)}, "
            f"logits_to_keep={logits_to_keep!r}); labels must cover the kept positions"
        )
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(hidden.device)

    want_z_loss = state.z_loss_scale > 0
    result = fused_head_loss(  # through the head's own call when FSDP2 / ZeRO-3 owns its weight
        head,
        hidden.reshape(-1, hidden.shape[-1]),
        targets.reshape(-1),
        ignore_index=ignore_index,
        reduction="mean",
        num_items_in_batch=num_items_in_batch,
        label_smoothing=state.label_smoothing,
        z_loss_scale=state.z_loss_scale,
        softcap=spec.softcap(config),
        logit_scale=spec.logit_scale(config),
        return_z_loss=want_z_loss,
        memory_budget=state.memory_budget,
    )
    loss, z_loss = result if want_z_loss else (result, None)
    if z_loss is not None and model.training:
        state.z_loss_tracker.add(z_loss)

    aux_loss = None
    if spec.moe is not None and output_router_logits:
        load_balancing_loss = _model_module_function(model, original, spec.moe.loss_func_name)
        router_logits = _body_field(outputs, "router_logits")
        if router_logits is None:
            router_logits = outputs[-1]
        aux_loss = load_balancing_loss(
            router_logits,
            getattr(config, spec.moe.num_experts_attr),
            getattr(config, spec.moe.top_k_attr),
            call.get("attention_mask"),
        )
        if torch.is_tensor(aux_loss):  # some versions return a plain 0 when no router logits were recorded
            loss = loss + getattr(config, spec.moe.coef_attr) * aux_loss.to(loss.device)

    logits = head_logits(head, hidden, spec, config) if env.return_logits() else None
    fields = {
        "loss": loss,
        "aux_loss": aux_loss,
        "logits": logits,
        "past_key_values": _body_field(outputs, "past_key_values"),
        "hidden_states": _body_field(outputs, "hidden_states"),
        "attentions": _body_field(outputs, "attentions"),
        "router_logits": _body_field(outputs, "router_logits"),
    }
    output_cls = _output_class(spec)
    output = output_cls(**{k: v for k, v in fields.items() if k in output_cls.__dataclass_fields__})
    # An attribute, not a field: it stays out of to_tuple() and of the Trainer's logits tuple.
    output.z_loss = z_loss
    return output if return_dict else _as_tuple(output)


# --------------------------------------------------------------------------------------------
# The wrapper
# --------------------------------------------------------------------------------------------


def _wants_fused_path(model: nn.Module, labels: Any, skip_logits: bool | None) -> bool:
    """Training with labels fuses; ``skip_logits`` (sent by HF's Trainer) overrides the mode."""
    if skip_logits is None:
        return model.training and labels is not None
    if skip_logits and labels is None:
        raise ValueError("liger_patch: skip_logits=True needs labels: without labels there is no loss")
    return bool(skip_logits)


def _warn_unfusable_once(model: nn.Module, state: PatchState, reason: str) -> None:
    if not state.warned_unfusable_head:
        state.warned_unfusable_head = True
        warnings.warn(unfusable_head_message(model, reason), UserWarning, stacklevel=4)


def make_liger_forward(original: Callable, fallback: Callable | None = None) -> Callable:
    """Wrap an unbound ``*ForCausalLM.forward`` with the fused path.

    ``original`` gives the signature (kept via ``functools.wraps``) and, unless ``fallback`` is
    given, is what runs on the original path. ``fallback(self, *args, **kwargs)`` replaces it
    when the instance already had its own forward (another wrapper) that must keep running.
    """
    _load_lazy_imports()  # here, eagerly: the forward itself (maybe under torch.compile) then imports nothing
    run_original = fallback if fallback is not None else original
    parameters = list(inspect.signature(original).parameters.values())[1:]
    positional_names = [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]

    @functools.wraps(original)
    def liger_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        skip_logits = kwargs.pop("skip_logits", None)
        state: PatchState | None = getattr(self, STATE_ATTR, None)
        if (
            state is None
            or len(args) > len(positional_names)
            or any(name in kwargs for name in positional_names[: len(args)])
        ):
            return run_original(self, *args, **kwargs)  # unpatched, or a call it must reject itself
        call = dict(zip(positional_names, args, strict=False))
        call.update(kwargs)
        if not _wants_fused_path(self, call.get("labels"), skip_logits):
            return run_original(self, *args, **kwargs)
        head, reason = fusable_head(self, state.spec)
        if head is None:
            _warn_unfusable_once(self, state, reason)
            return run_original(self, *args, **kwargs)
        return fused_causal_lm_forward(self, original, call, head, state)

    setattr(liger_forward, ORIGINAL_ATTR, original)
    return liger_forward


def is_liger_forward(function: Any) -> bool:
    """True for a forward made by :func:`make_liger_forward` (bound or not)."""
    return hasattr(getattr(function, "__func__", function), ORIGINAL_ATTR)
