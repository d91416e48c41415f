"""Command line: ``python -m liger_patch {doctor,demo,verify}`` (also installed as ``liger-patch``).

Each subcommand owns its options (``demo`` defines them in ``liger_patch.demo``, ``verify`` in
``liger_patch.verify.cli``), so
``python -m liger_patch demo --help`` lists them and an unknown option is an argparse error.
"""

from __future__ import annotations

import argparse
import os
import sys

DESCRIPTION = """\
liger_patch: fused linear cross-entropy for HuggingFace causal LMs.

Check an installation with `doctor`; see what patching a model changes with `demo`; check that
patching gives the unpatched loss and gradients for every model type (or your own) with `verify`.
Run `%(prog)s COMMAND --help` for a command's options."""


def _prog() -> str:
    """The name usage lines show: the installed script's, else ``python -m liger_patch``."""
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    return script if script == "liger-patch" else "python -m liger_patch"


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per command; ``demo``'s options come from demo.py."""
    from liger_patch.demo import add_arguments as add_demo_arguments
    from liger_patch.verify.cli import add_arguments as add_verify_arguments

    parser = argparse.ArgumentParser(
        prog=_prog(), description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser(
        "doctor",
        help="versions, device, chosen backend and why, and a self-check of the op against fp64",
        description="Print versions, device, memory budget and backend, then check the fused loss "
        "and its gradients against an fp64 dense reference. Exit status 0 when the check passes.",
    )
    demo = sub.add_parser(
        "demo",
        help="train a tiny Llama unpatched and patched: losses, peak memory and speed side by side",
        description="Train a tiny Llama (built from a config, no download) unpatched and patched on "
        "the same batches; print both loss curves, the peak memory of the loss step and the speed.",
    )
    add_demo_arguments(demo)
    verify = sub.add_parser(
        "verify",
        help="patched vs unpatched training step for every model type, or your own (--model)",
        description="Build a tiny random model of each causal-LM, image-text-to-text, seq2seq-LM, "
        "speech-seq2seq and masked-LM type of the installed transformers (or of your own "
        "architecture with --model), run one training step "
        "unpatched and patched from the same weights, compare the loss and every gradient, and "
        "classify each type as verified, refused (the patch declines it, with the reason) or failed, "
        "or say why there was nothing to compare: unbuildable (no tiny model can be built here), "
        "builder-error (building it raised) or unpatched-fails (the unpatched model fails on its "
        "own batch). Each line gives the relative errors of the loss and of the worst gradient with "
        "their tolerances; warnings of the code under test are counted and written to a file. "
        "Exit status 1 when any type failed, 2 for an unknown model type or a --model that names "
        "nothing.",
    )
    add_verify_arguments(verify)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: the process arguments) and run the chosen command; its exit code."""
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        from liger_patch.doctor import run_doctor

        return run_doctor()
    if args.command == "verify":
        from liger_patch.verify.cli import run_verify

        return run_verify(args)
    from liger_patch.demo import run_demo

    return run_demo(args)


if __name__ == "__main__":
    sys.exit(main())
