"""The architecture registry: one declarative row (a :class:`ModelSpec`) per causal-LM family.

A row says *where* things are and *which config attributes* change the head's math; it never
holds a forward. Every row is served by the one generic forward in ``forward.py``. Adding an
architecture is one row here (or one ``register_model`` call in user code) plus one test
parametrization; if it needs more, the generic forward is missing a concept.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

__all__ = [
    "ModelSpec",
    "MoeAuxLoss",
    "UnsupportedModelError",
    "get_submodule_path",
    "missing_path_message",
    "register_model",
    "spec_for",
    "spec_for_model_type",
    "supported_models",
]


class UnsupportedModelError(TypeError):
    """Raised by ``apply_liger_to(..., strict=True)`` for an architecture with no registry row,
    or whose row names a body or head path that the model does not have."""


@dataclass(frozen=True)
class MoeAuxLoss:
    """How a mixture-of-experts row adds its router load-balancing loss.

    The loss function itself is the model's own: ``loss_func_name`` is looked up in the module
    that defines the model's forward, exactly the function the original forward calls. The three
    numbers come from the model's config, as the original ``__init__`` reads them.
    """

    num_experts_attr: str = "num_experts"
    top_k_attr: str = "num_experts_per_tok"
    coef_attr: str = "router_aux_loss_coef"
    loss_func_name: str = "load_balancing_loss_func"


@dataclass(frozen=True)
class ModelSpec:
    """One registry row: how the generic fused forward reaches and reproduces a model's head.

    Attributes:
        model_type: ``config.model_type`` of the family (``"llama"``); also the key of the row.
        class_name: the transformers causal-LM class this row describes (``"LlamaForCausalLM"``).
            Used to find the class in the installed transformers; users' own classes registered
            with ``register_model(cls, spec)`` are matched by the class object instead.
        body: attribute path of the decoder body that returns the last hidden states.
        head: attribute path of the output projection (an ``nn.Linear``; bias allowed).
        logit_scale_attr: config attribute that *multiplies* the logits (Cohere's ``logit_scale``).
        logit_divisor_attr: config attribute that *divides* the logits (Granite's ``logits_scaling``).
        softcap_attr: config attribute c for ``c * tanh(logits / c)`` (Gemma2/3's
            ``final_logit_softcapping``); a ``None`` value in the config means no softcap.
        moe: router aux-loss settings for mixture-of-experts rows, else ``None``.
        notes: one line shown in the supported-models table.
    """

    model_type: str
    class_name: str
    body: str = "model"
    head: str = "lm_head"
    logit_scale_attr: str | None = None
    logit_divisor_attr: str | None = None
    softcap_attr: str | None = None
    moe: MoeAuxLoss | None = None
    notes: str = ""

    def logit_scale(self, config: Any) -> float | None:
        """The multiplier applied to the logits for this config, or ``None`` when there is none."""
        scale = _config_value(config, self.logit_scale_attr)
        scale = None if scale is None else float(scale)
        divisor = _config_value(config, self.logit_divisor_attr)
        if divisor is not None:
            scale = (1.0 if scale is None else scale) / float(divisor)
        return scale

    def softcap(self, config: Any) -> float | None:
        """The final-logit softcap for this config, or ``None``."""
        value = _config_value(config, self.softcap_attr)
        return None if value is None else float(value)

    def transform_logits(self, logits: torch.Tensor, config: Any) -> torch.Tensor:
        """This row's head math on ``head(hidden)``, in the original forwards' op order: divide
        by the divisor, multiply by the scale, then softcap as ``tanh(x / c) * c`` (what the
        fused loss computes in its kernel, for ``LIGER_RETURN_LOGITS=1``)."""
        divisor = _config_value(config, self.logit_divisor_attr)
        if divisor is not None:
            logits = logits / divisor
        scale = _config_value(config, self.logit_scale_attr)
        if scale is not None:
            logits = logits * scale
        softcap = self.softcap(config)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    def resolve_class(self) -> type[nn.Module] | None:
        """The class named by this row in the installed transformers, or ``None`` if it has none."""
        import transformers

        try:
            return getattr(transformers, self.class_name)
        except (AttributeError, ImportError, RuntimeError):
            return None


def _config_value(config: Any, attr: str | None) -> Any:
    """``config.<attr>`` as the original forward reads it; ``None`` without that attribute or name."""
    return None if attr is None else getattr(config, attr, None)


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


def _row(model_type: str, class_name: str, **fields: Any) -> ModelSpec:
    return ModelSpec(model_type=model_type, class_name=class_name, **fields)


_MIXTRAL_STYLE_MOE = MoeAuxLoss(num_experts_attr="num_local_experts")
_QWEN_STYLE_MOE = MoeAuxLoss(num_experts_attr="num_experts")
_GEMMA_SOFTCAP = "final_logit_softcapping"

_BUILTIN_ROWS: tuple[ModelSpec, ...] = (
    _row("llama", "LlamaForCausalLM"),
    _row("mistral", "MistralForCausalLM"),
    _row("qwen2", "Qwen2ForCausalLM"),
    _row("qwen2_moe", "Qwen2MoeForCausalLM", moe=_QWEN_STYLE_MOE),
    _row("qwen3", "Qwen3ForCausalLM"),
    _row("qwen3_moe", "Qwen3MoeForCausalLM", moe=_QWEN_STYLE_MOE),
    _row("mixtral", "MixtralForCausalLM", moe=_MIXTRAL_STYLE_MOE),
    _row("gemma", "GemmaForCausalLM", notes="tied embeddings"),
    _row("gemma2", "Gemma2ForCausalLM", softcap_attr=_GEMMA_SOFTCAP),
    _row("gemma3_text", "Gemma3ForCausalLM", softcap_attr=_GEMMA_SOFTCAP),
    _row("phi3", "Phi3ForCausalLM"),
    _row("phi", "PhiForCausalLM", notes="lm_head bias"),
    _row("olmo2", "Olmo2ForCausalLM"),
    _row("olmo3", "Olmo3ForCausalLM"),
    _row("glm", "GlmForCausalLM"),
    _row("glm4", "Glm4ForCausalLM"),
    _row("granite", "GraniteForCausalLM", logit_divisor_attr="logits_scaling"),
    _row(
        "granitemoe",
        "GraniteMoeForCausalLM",
        logit_divisor_attr="logits_scaling",
        moe=_MIXTRAL_STYLE_MOE,
    ),
    _row("cohere", "CohereForCausalLM", logit_scale_attr="logit_scale"),
    _row("cohere2", "Cohere2ForCausalLM", logit_scale_attr="logit_scale"),
    _row("smollm3", "SmolLM3ForCausalLM"),
)

# model_type -> row, for the built-in rows and rows users add by model_type.
_ROWS_BY_MODEL_TYPE: dict[str, ModelSpec] = {row.model_type: row for row in _BUILTIN_ROWS}
# class -> row, for users' own classes (and built-in classes they re-register).
_ROWS_BY_CLASS: dict[type, ModelSpec] = {}


def supported_models() -> dict[str, ModelSpec]:
    """All registry rows, keyed by model_type (a copy: editing it changes nothing).

    Rows whose class is missing from the installed transformers are included; use
    ``spec.resolve_class()`` to tell which ones this installation can patch.
    """
    rows = dict(_ROWS_BY_MODEL_TYPE)
    for cls, spec in _ROWS_BY_CLASS.items():
        rows.setdefault(spec.model_type or cls.__name__, spec)
    return rows


def register_model(cls_or_model_type: type[nn.Module] | str, spec: ModelSpec) -> ModelSpec:
    """Add (or replace) a registry row for a user's architecture.

    Pass the causal-LM class itself for your own model code (subclasses match too), or a
    ``model_type`` string for a transformers class named by ``spec.class_name``.
    Returns the row as stored.
    """
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"register_model expects a ModelSpec, got {type(spec).__name__}")
    if isinstance(cls_or_model_type, str):
        stored = dataclasses.replace(spec, model_type=cls_or_model_type)
        _ROWS_BY_MODEL_TYPE[cls_or_model_type] = stored
        return stored
    if isinstance(cls_or_model_type, type):
        stored = dataclasses.replace(spec, class_name=cls_or_model_type.__name__)
        _ROWS_BY_CLASS[cls_or_model_type] = stored
        return stored
    raise TypeError(
        f"register_model expects a model class or a model_type string, got {type(cls_or_model_type).__name__}"
    )


def spec_for(cls: type) -> ModelSpec | None:
    """The row for a causal-LM class (or its nearest registered base class), else ``None``.

    User-registered classes win; built-in rows match a transformers class by name, walking the
    MRO so that a user's subclass of ``LlamaForCausalLM`` is still served by the llama row.
    """
    builtin_by_class_name = {row.class_name: row for row in _ROWS_BY_MODEL_TYPE.values()}
    for klass in cls.__mro__:
        if klass in _ROWS_BY_CLASS:
            return _ROWS_BY_CLASS[klass]
        row = builtin_by_class_name.get(klass.__name__)
        if row is not None and klass.__module__.startswith("transformers.") and row.resolve_class() is klass:
            return row
    return None


def spec_for_model_type(model_type: str) -> ModelSpec | None:
    """The row registered under ``model_type``, else ``None``."""
    return _ROWS_BY_MODEL_TYPE.get(model_type)


def supported_models_markdown() -> str:
    """The supported-models table of ``docs/patching.md``, generated from the registry rows.

    ``python docs/gen_supported_models.py`` rewrites the table in the docs; a test checks that
    the table there is this one.
    """
    lines = [
        "| model_type | transformers class | logit scaling | final-logit softcap | MoE aux loss | notes |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in sorted(_ROWS_BY_MODEL_TYPE.values(), key=lambda r: r.model_type):
        if row not in _BUILTIN_ROWS:
            continue
        scaling = []
        if row.logit_scale_attr:
            scaling.append(f"`* config.{row.logit_scale_attr}`")
        if row.logit_divisor_attr:
            scaling.append(f"`/ config.{row.logit_divisor_attr}`")
        softcap = f"`config.{row.softcap_attr}`" if row.softcap_attr else ""
        moe = ""
        if row.moe is not None:
            moe = (
                f"`{row.moe.loss_func_name}`, `{row.moe.coef_attr}`, "
                f"`{row.moe.num_experts_attr}`, `{row.moe.top_k_attr}`"
            )
        cells = [f"`{row.model_type}`", f"`{row.class_name}`", " ".join(scaling), softcap, moe, row.notes]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
