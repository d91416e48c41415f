"""Rewrite the supported-models table in docs/patching.md from the registry.

python docs/gen_supported_models.py          # rewrite in place
python docs/gen_supported_models.py --check  # exit 1 if the docs are stale
"""

from __future__ import annotations

import pathlib
import sys

from liger_patch.patching.registry import supported_models_markdown

DOC = pathlib.Path(__file__).with_name("patching.md")
BEGIN, END = "<!-- supported-models:begin -->", "<!-- supported-models:end -->"


def render(text: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{supported_models_markdown()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    text = DOC.read_text()
    new = render(text)
    if "--check" in argv:
        return 0 if new == text else 1
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
