"""Every ```python block in README.md and docs/*.md runs as written, on a CPU, offline.

Each block is a standalone script: it is written to a file and run in a fresh interpreter, the
way a reader pastes it (no TRITON_INTERPRET, no test fixtures). Two HTML comments, on the line
before a block's opening fence, say how a block runs:

* ``<!-- run: torchrun -->``: a distributed training script; it runs under
  ``torchrun --standalone --nproc_per_node 1`` (gloo on a CPU).
* ``<!-- not-run: REASON -->``: a block that cannot run here (it needs CUDA, several GPUs or a
  hub model); the test skips it with that reason. Such blocks must stay rare: ``MAX_NOT_RUN``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_NOT_RUN = 3
TIMEOUT_S = 300

_FENCE_OPEN = re.compile(r"^```python\s*$")
_FENCE_CLOSE = re.compile(r"^```\s*$")
_NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(?P<reason>.*?)\s*-->$")
_TORCHRUN = re.compile(r"^<!--\s*run:\s*torchrun\s*-->$")


@dataclass(frozen=True)
class Block:
    """One ```python block: where it is, its code, and how its marker says to run it."""

    doc: str  # path relative to the repository root
    index: int  # 0-based among the document's python blocks
    line: int  # 1-based line of the opening fence
    code: str
    not_run: str | None  # the reason, for a block marked not-run
    torchrun: bool

    @property
    def id(self) -> str:
        return f"{self.doc}#{self.index}"


def _marker(lines: list[str], fence: int) -> str:
    """The nearest non-blank line above the fence at index ``fence`` ('' if none)."""
    for line in reversed(lines[:fence]):
        if line.strip():
            return line.strip()
    return ""


def python_blocks(path: Path) -> list[Block]:
    """The ```python blocks of one Markdown file, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if not _FENCE_OPEN.match(lines[i]):
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if _FENCE_CLOSE.match(lines[j]))
        marker = _marker(lines, i)
        not_run = _NOT_RUN.match(marker)
        blocks.append(
            Block(
                doc=path.relative_to(ROOT).as_posix(),
                index=len(blocks),
                line=i + 1,
                code="\n".join(lines[i + 1 : end]) + "\n",
                not_run=not_run.group("reason") if not_run else None,
                torchrun=bool(_TORCHRUN.match(marker)),
            )
        )
        i = end + 1
    return blocks


ALL_BLOCKS = [block for path in DOC_FILES for block in python_blocks(path)]


def _command(block: Block, script: Path) -> list[str]:
    if block.torchrun:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
        return [*torchrun, str(script)]
    return [sys.executable, str(script)]


def _env() -> dict[str, str]:
    """The reader's environment: no TRITON_INTERPRET (tests/conftest.py sets it), the checkout
    importable even without an install, and no hub access."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["HF_HUB_OFFLINE"] = "1"
    return env


_TEARDOWN_ABORT = "terminate called without an active exception"
"""What a torchrun rank (gloo, CPU) prints when it aborts in the interpreter's teardown after its
work is done, now and then and not again when rerun: the race ``tests/distributed/workers.py``'s
``leave_rank`` keeps out of the distributed tests. A recipe cannot leave that way (a user's
``train.py`` does not), so a block that fails with it runs once more."""


def _run(block: Block, script: Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        _command(block, script), cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=lambda b: b.id)
def test_python_block_runs(block: Block, tmp_path: Path):
    if block.not_run is not None:
        compile(block.code, f"{block.doc}:{block.line}", "exec")  # still valid Python, pasted
        pytest.skip(f"{block.doc}:{block.line} marked not-run: {block.not_run}")
    script = tmp_path / f"{Path(block.doc).stem}_{block.index}.py"
    script.write_text(block.code, encoding="utf-8")
    done = _run(block, script, tmp_path)
    if done.returncode != 0 and _TEARDOWN_ABORT in done.stderr:
        done = _run(block, script, tmp_path)  # once: the interpreter's teardown race (see _TEARDOWN_ABORT)
    if done.returncode != 0:
        pytest.fail(
            f"{block.doc}:{block.line} (python block {block.index}) failed with exit code "
            f"{done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}",
            pytrace=False,
        )


def test_docs_have_python_blocks_and_few_are_not_run():
    assert len(ALL_BLOCKS) >= 5, [b.id for b in ALL_BLOCKS]
    not_run = [f"{b.id}: {b.not_run}" for b in ALL_BLOCKS if b.not_run is not None]
    assert all(b.not_run for b in ALL_BLOCKS if b.not_run is not None), "a not-run marker needs a reason"
    assert len(not_run) <= MAX_NOT_RUN, f"too many blocks skipped, make them runnable on a CPU: {not_run}"
