"""``python -m liger_patch verify``: the verification sweep from the command line.

With no arguments every causal-LM, image-text-to-text, seq2seq-LM, speech-seq2seq and masked-LM
type of the installed transformers is checked, with a progress bar on a terminal; name model
types to check only those (``--list`` prints the names); ``--model`` checks your own architecture
(a model directory or hub id with a ``config.json``, or ``package.module:ClassName``). Prints one
line per type (``report.line``: the relative errors against their tolerances), then a table of
the statuses (``verdicts.STATUS_MEANINGS`` says what each means) and one line counting the
warnings of the code under test, which are written to a file rather than printed (``quiet``).
``--json`` writes the verdicts (``docs/gen_models.py`` renders ``docs/models.md`` from such files).

Exit status: 0 when no type failed, 1 when any failed, 2 for a bad argument (an unknown model
type, with the closest known ones; a ``--model`` that names nothing, with what was tried).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import os
import sys
import textwrap
import time
from collections.abc import Sequence
from typing import Any

import torch

from liger_patch.patching.derive import TASKS
from liger_patch.verify.quiet import Collected, collected
from liger_patch.verify.report import legend, line, summary_table
from liger_patch.verify.sweep import sweep, sweep_plan
from liger_patch.verify.verdicts import FAILED, Tolerance, Verdict

__all__ = ["UsageError", "add_arguments", "run_verify"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
USAGE_ERROR = 2
"""The exit status for a bad argument, as argparse's own."""


class UsageError(ValueError):
    """An argument ``verify`` cannot act on; the message says what is wrong and what would do."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``verify`` subcommand's options."""
    parser.add_argument("model_types", nargs="*", help="model types to check (default: all; see --list)")
    parser.add_argument("--task", choices=[*TASKS, "all"], default="all", help="which auto mapping to sweep")
    parser.add_argument(
        "--model",
        help="your own architecture: a model directory / hub id (its config.json), or module:ClassName",
    )
    parser.add_argument("--trust-remote-code", action="store_true", help="allow --model's own code to run")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", metavar="PATH", help="write the verdicts (and versions) as JSON")
    parser.add_argument("--quiet", action="store_true", help="print only the failures and the summary")
    parser.add_argument("--list", action="store_true", help="print the model types there are, and exit")
    parser.add_argument(
        "--show-warnings",
        action="store_true",
        help="let the warnings of transformers and the models through as they come "
        "(by default they are counted and written to a file)",
    )


def run_verify(args: argparse.Namespace) -> int:
    """Run what the arguments ask for: 0 when nothing failed, 1 when a type failed, 2 (one line
    on stderr) for an argument that names nothing to check."""
    from liger_patch.verify.user_model import ModelSpecError

    try:
        return _run(args)
    except (UsageError, ModelSpecError) as error:
        print(f"verify: error: {error}", file=sys.stderr)
        return USAGE_ERROR


def _run(args: argparse.Namespace) -> int:
    if args.model is None:  # the sweep builds everything from configs: never wait on the hub
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tasks = TASKS if args.task == "all" else (args.task,)
    if args.list:
        return _print_types(tasks)
    if args.model and args.model_types:
        raise UsageError("name model types or pass --model, not both")
    check_names(args.model_types, tasks)
    dtype = _DTYPES[args.dtype]
    tolerance = Tolerance.for_dtype(dtype)
    with contextlib.nullcontext(Collected()) if args.show_warnings else collected() as sink:
        user = _user_model(args)  # a bad --model stops here, before anything is printed
        print(textwrap.fill(legend(tolerance), width=100), flush=True)
        start = time.perf_counter()
        verdicts = _verdicts(args, tasks, dtype, tolerance, sink, user)
    warnings_line = "" if args.show_warnings else sink.summary(sink.write())
    _summarize(args, verdicts, time.perf_counter() - start, warnings_line)
    return 1 if any(v.status == FAILED for v in verdicts) else 0


def _user_model(args: argparse.Namespace) -> Any:
    """``--model`` resolved (a ``UserModel``), or ``None`` for a sweep."""
    if not args.model:
        return None
    from liger_patch.verify.user_model import resolve_user_model

    return resolve_user_model(args.model, args.trust_remote_code)


def check_names(names: Sequence[str], tasks: Sequence[str]) -> None:
    """:class:`UsageError` naming each of ``names`` that no task of ``tasks`` maps, with the
    closest known names, or the task that does map it."""
    from liger_patch.verify.models import model_types

    known = {task: model_types(task) for task in TASKS}
    wanted = sorted({name for task in tasks for name in known[task]})
    problems = [_unknown(name, tasks, known, wanted) for name in dict.fromkeys(names)]
    problems = [problem for problem in problems if problem]
    if problems:
        raise UsageError("; ".join(problems))


def _unknown(name: str, tasks: Sequence[str], known: dict[str, list[str]], wanted: list[str]) -> str:
    """Why ``name`` cannot be checked under ``tasks``, or '' when it can."""
    if any(name in known[task] for task in tasks):
        return ""
    import transformers

    elsewhere = [task for task in TASKS if name in known[task]]
    if elsewhere:
        tasks_named = " or ".join(tasks)
        return f"model type {name!r} has no {tasks_named} class; it is a {elsewhere[0]} type (--task all)"
    close = difflib.get_close_matches(name, wanted, n=5, cutoff=0.6)
    hint = f"closest: {', '.join(close)}" if close else "no close match (--list prints every type)"
    return f"unknown model type {name!r} in transformers {transformers.__version__}; {hint}"


def _print_types(tasks: Sequence[str]) -> int:
    from liger_patch.verify.models import model_types

    for task in tasks:
        names = model_types(task)
        print(f"{task} ({len(names)}):")
        print(textwrap.fill(" ".join(names), width=100, initial_indent="  ", subsequent_indent="  "))
    return 0


def _verdicts(
    args: argparse.Namespace,
    tasks: Sequence[str],
    dtype: torch.dtype,
    tolerance: Tolerance,
    sink: Collected,
    user: Any,
) -> list[Verdict]:
    """The verdicts, each line printed as it comes (``--quiet``: the failures only)."""

    def show(verdict: Verdict) -> None:
        if not args.quiet or verdict.status == FAILED:
            _write(line(verdict, tolerance))

    if user is not None:
        from liger_patch.verify.user_model import verify_user_model

        sink.tag = args.model
        verdict = verify_user_model(user, dtype=dtype, device=args.device)
        show(verdict)
        return [verdict]
    return _swept(args, tasks, dtype, sink, show)


def _swept(args: argparse.Namespace, tasks: Sequence[str], dtype: torch.dtype, sink: Collected, show) -> list:
    """The sweep, with a progress bar on a terminal (none in a log or a pipe)."""
    from tqdm.auto import tqdm

    plan = sweep_plan(args.model_types or None, tasks)
    names = iter([*(f"{task}/{model_type}" for task, model_type in plan), ""])
    sink.tag = next(names)
    bar = tqdm(total=len(plan), unit="type", disable=None, leave=False, file=sys.stderr, dynamic_ncols=True)
    with bar:

        def progress(verdict: Verdict) -> None:
            show(verdict)
            sink.tag = next(names)
            bar.set_postfix_str(verdict.model_type, refresh=False)
            bar.update(1)

        return sweep(args.model_types or None, tasks, dtype=dtype, device=args.device, progress=progress)


def _write(text: str) -> None:
    """A line on stdout that does not tear the progress bar."""
    from tqdm.auto import tqdm

    tqdm.write(text, file=sys.stdout)
    sys.stdout.flush()


def _summarize(args: argparse.Namespace, verdicts: list[Verdict], seconds: float, warnings_line: str) -> None:
    """The status table, what ran where, the warnings' line, and the JSON file when asked."""
    versions = _versions(args)
    print()
    print("\n".join(summary_table(verdicts)))
    failed = sum(v.status == FAILED for v in verdicts)
    print(
        f"{len(verdicts)} checked in {seconds:.0f} s on transformers {versions['transformers']}, "
        f"torch {versions['torch']} ({args.device}, {args.dtype}): "
        + (f"{failed} FAILED" if failed else "none failed")
    )
    if warnings_line:
        print(warnings_line)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"versions": versions, "verdicts": [v.as_dict() for v in verdicts]}, handle, indent=1)
            handle.write("\n")
        print(f"verdicts written to {args.json}")


def _versions(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "device": args.device,
        "dtype": args.dtype,
    }
