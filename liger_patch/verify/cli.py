"""``python -m liger_patch verify``: the verification sweep from the command line.

With no arguments every causal-LM and image-text-to-text type of the installed transformers is
checked; name model types to check only those; ``--model`` checks your own architecture (a
model directory or hub id with a ``config.json``, or ``package.module:ClassName``). Prints one
line per type and a summary (a count per status: ``verdicts.STATUS_MEANINGS`` says what each
means); ``--json`` writes the verdicts (``docs/gen_models.py`` renders ``docs/models.md`` from
such files). Exit status 1 when any type failed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import warnings
from typing import Any

import torch

from liger_patch.patching.derive import CAUSAL_LM, TASKS
from liger_patch.verify.compare import batch_to, verify_model
from liger_patch.verify.sweep import sweep
from liger_patch.verify.verdicts import FAILED, STATUSES, Verdict

__all__ = ["add_arguments", "run_verify"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``verify`` subcommand's options."""
    parser.add_argument("model_types", nargs="*", help="model types to check (default: all)")
    parser.add_argument("--task", choices=[*TASKS, "all"], default="all", help="which auto mapping to sweep")
    parser.add_argument(
        "--model",
        help="your own architecture: a model directory / hub id (its config.json), or module:ClassName",
    )
    parser.add_argument("--trust-remote-code", action="store_true", help="allow --model's own code to run")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", metavar="PATH", help="write the verdicts (and versions) as JSON")
    parser.add_argument("--quiet", action="store_true", help="print only the summary and the failures")


def _user_model(spec: str, trust_remote_code: bool) -> torch.nn.Module:
    """A tiny random model of the user's architecture: ``module:Class`` or a config location."""
    from liger_patch.verify.models import tiny_model_from_config

    module_name, _, class_name = spec.partition(":")
    if class_name and not os.path.exists(spec):
        cls = getattr(importlib.import_module(module_name), class_name)
        return tiny_model_from_config(cls.config_class(), cls)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(spec, trust_remote_code=trust_remote_code)
    auto_map = getattr(config, "auto_map", None) or {}
    if trust_remote_code and "AutoModelForCausalLM" in auto_map:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        cls = get_class_from_dynamic_module(auto_map["AutoModelForCausalLM"], spec)
        return tiny_model_from_config(config, cls)
    return tiny_model_from_config(config)


def _verify_user_model(args: argparse.Namespace, dtype: torch.dtype) -> list[Verdict]:
    from liger_patch.verify.batches import example_batch

    model = _user_model(args.model, args.trust_remote_code)  # the batch is built for it in fp32 on CPU
    batch = batch_to(example_batch(model), torch.device(args.device), dtype)
    model.to(device=args.device, dtype=dtype)
    verdict = verify_model(model, batch)
    verdict.model_type = getattr(model.config, "model_type", "") or type(model).__name__
    verdict.task = CAUSAL_LM
    return [verdict]


def _line(verdict: Verdict) -> str:
    errors = ""
    if verdict.loss_error is not None:
        errors = f" loss {verdict.loss_error:.1e} grad {verdict.grad_error:.1e}"
    reason = f"  {verdict.reason}" if verdict.reason else ""
    return f"{verdict.status:15s} {verdict.task:19s} {verdict.model_type:28s}{errors}{reason}"


def _versions(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "device": args.device,
        "dtype": args.dtype,
    }


def run_verify(args: argparse.Namespace) -> int:
    """Run the sweep the arguments ask for; print and optionally save it. 1 when any failed."""
    if args.model is None:  # the sweep builds everything from configs: never wait on the hub
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dtype = _DTYPES[args.dtype]
    tasks = TASKS if args.task == "all" else (args.task,)

    def report(verdict: Verdict) -> None:
        if not args.quiet or verdict.status == FAILED:
            print(_line(verdict), flush=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if args.model:
            verdicts = _verify_user_model(args, dtype)
            report(verdicts[0])
        else:
            verdicts = sweep(
                args.model_types or None, tasks, dtype=dtype, device=args.device, progress=report
            )
    counts = {status: sum(v.status == status for v in verdicts) for status in STATUSES}
    versions = _versions(args)
    print(f"{counts} on transformers {versions['transformers']} ({args.device}, {args.dtype})")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"versions": versions, "verdicts": [v.as_dict() for v in verdicts]}, handle, indent=1)
            handle.write("\n")
    return 1 if counts[FAILED] else 0
