"""``verify --model``: a user's own architecture, named by a model directory, a hub id or
``package.module:ClassName``, checked as the sweep checks a type.

What ``--model`` names is resolved first, and a name that leads nowhere is a
:class:`ModelSpecError` whose one-line message says what was tried (the command prints it and
exits 2, never a traceback). Building the tiny model is the sweep's business: a model that
cannot be built is reported as **unbuildable** or **builder-error**, like any type.
"""

from __future__ import annotations

import importlib
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from liger_patch.verify.sweep import verify_built
from liger_patch.verify.verdicts import Verdict, brief

__all__ = ["ModelSpecError", "UserModel", "resolve_user_model", "verify_user_model"]

FORMS = "a model directory with a config.json, a hub id such as Qwen/Qwen2.5-0.5B, or module:ClassName"
"""What ``--model`` accepts, as the error messages name it."""

_CLASS_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class ModelSpecError(ValueError):
    """``--model`` names nothing a model can be built from; the message says what was tried."""


@dataclass(frozen=True)
class UserModel:
    """A resolved ``--model``: the name reported for it and how to build its tiny model."""

    model_type: str
    build: Callable[[], nn.Module]


def resolve_user_model(spec: str, trust_remote_code: bool = False) -> UserModel:
    """What ``spec`` names, ready to build; :class:`ModelSpecError` when it names nothing usable."""
    if _CLASS_PATH.match(spec) and not os.path.exists(spec):
        return _from_class_path(spec)
    if os.path.isdir(spec) and not os.path.isfile(os.path.join(spec, "config.json")):
        raise ModelSpecError(f"--model {spec}: the directory has no config.json (expected {FORMS})")
    if not os.path.exists(spec) and _looks_like_a_path(spec):
        raise ModelSpecError(f"--model {spec}: no such file or directory (expected {FORMS})")
    return _from_config(spec, _load_config(spec, trust_remote_code), trust_remote_code)


def _looks_like_a_path(spec: str) -> bool:
    """A local path rather than a hub id (``owner/name``): absolute, relative, or deeper than one slash."""
    return spec.startswith(("/", ".", "~")) or "\\" in spec or spec.count("/") > 1 or spec.endswith("/")


def _from_class_path(spec: str) -> UserModel:
    """``package.module:ClassName``: the class, imported; its own config class gives the sizes."""
    module_name, class_name = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # the user's module: any failure to import is theirs to see
        why = f"--model {spec}: cannot import module {module_name!r} ({brief(error)})"
        raise ModelSpecError(why) from error
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ModelSpecError(f"--model {spec}: module {module_name!r} has no attribute {class_name!r}")
    config_class = getattr(cls, "config_class", None)
    if not isinstance(cls, type) or config_class is None:
        raise ModelSpecError(f"--model {spec}: not a transformers model class (it has no config_class)")
    from liger_patch.verify.models import tiny_model_from_config

    model_type = getattr(config_class, "model_type", "") or cls.__name__
    return UserModel(model_type, lambda: tiny_model_from_config(config_class(), cls))


def _load_config(spec: str, trust_remote_code: bool) -> Any:
    """The config at ``spec`` (a directory, a config file or a hub id), or why none could be read."""
    from transformers import AutoConfig

    if not os.path.exists(spec):
        print(f"--model {spec}: not a local path; fetching its config from the Hugging Face Hub", flush=True)
    try:
        return AutoConfig.from_pretrained(spec, trust_remote_code=trust_remote_code)
    except Exception as error:  # OSError, ValueError, a hub error: the reason goes into one line
        raise ModelSpecError(f"--model {spec}: {_where_tried(spec)}: {_reason(error)}") from error


def _where_tried(spec: str) -> str:
    if os.path.exists(spec):
        return "its config could not be read"
    offline = _hub_offline()
    hub = "the Hugging Face Hub (offline: HF_HUB_OFFLINE is set)" if offline else "the Hugging Face Hub"
    return f"not a local path, and no config could be fetched for it from {hub}"


def _hub_offline() -> bool:
    """Whether the hub client is in offline mode (it reads ``HF_HUB_OFFLINE`` once, at import)."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    return bool(constants.HF_HUB_OFFLINE)


def _reason(error: BaseException) -> str:
    """The first sentence of the error, with a hint where it is about remote code."""
    first = brief(error)
    if "trust_remote_code" in str(error):
        return f"{first} (pass --trust-remote-code to allow the model's own code to run)"
    return first


def _from_config(spec: str, config: Any, trust_remote_code: bool) -> UserModel:
    """A config's model: its own remote class when allowed, else the class transformers maps."""
    from liger_patch.verify.models import tiny_model_from_config

    model_type = getattr(config, "model_type", "") or type(config).__name__
    auto_map = getattr(config, "auto_map", None) or {}
    if trust_remote_code and "AutoModelForCausalLM" in auto_map:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        def build() -> nn.Module:
            cls = get_class_from_dynamic_module(auto_map["AutoModelForCausalLM"], spec)
            return tiny_model_from_config(config, cls)

        return UserModel(model_type, build)
    return UserModel(model_type, lambda: tiny_model_from_config(config))


def verify_user_model(
    user: UserModel, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> Verdict:
    """The verdict for the user's architecture (from :func:`resolve_user_model`)."""
    start = time.perf_counter()
    verdict = verify_built(user.model_type, None, user.build, dtype=dtype, device=device)
    verdict.seconds = round(time.perf_counter() - start, 3)
    return verdict
