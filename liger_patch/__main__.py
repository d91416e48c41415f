"""``python -m liger_patch {demo,doctor}``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m liger_patch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="versions, device, chosen backend, and a one-second self-check of the op")
    demo = sub.add_parser("demo", help="train a tiny Llama patched and unpatched and compare", add_help=False)
    demo.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)

    if args.command == "doctor":
        from liger_patch.doctor import run_doctor

        return run_doctor()
    from liger_patch.demo import main as demo_main

    return demo_main(args.rest)


if __name__ == "__main__":
    sys.exit(main())
