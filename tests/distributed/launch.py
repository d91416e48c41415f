"""Start the distributed test workers as real processes, always time-bound.

One subprocess per rank (no torchrun: we own every process, so a timeout can kill each of them
and its children). Each rank runs in its own session; when the deadline passes, every rank's
process group is killed and the test fails with the ranks' output instead of hanging CI.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):  # its own session: the rank and its children only
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


_PORT_TAKEN = "EADDRINUSE"  # the rendezvous port was taken between free_port() and rank 0's bind
_ATTEMPTS = 3


def run_workers(
    module: str, args: list[str], out_dir: Path, world_size: int = 2, timeout: float = 240
) -> None:
    """Run ``python -m module *args`` on ``world_size`` ranks; raise if one fails or time runs out.
    A run whose rendezvous port another process took first (parallel test workers pick ports
    too) is run again on a new port."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for attempt in range(_ATTEMPTS):
        failure, codes = _run_once(module, args, out_dir, world_size, timeout)
        if not (failure or any(codes)):
            return
        if _PORT_TAKEN not in (out_dir / "rank0.log").read_text() or attempt == _ATTEMPTS - 1:
            break
    tails = "\n".join(
        f"--- rank {r} (exit {codes[r]}) ---\n{(out_dir / f'rank{r}.log').read_text()[-4000:]}"
        for r in range(world_size)
    )
    raise AssertionError(f"distributed run failed: {failure or codes}\n{tails}")


def _environment(world_size: int) -> dict[str, str]:
    env = dict(os.environ)  # tests/conftest.py restores it after each test: no earlier test's leftovers
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(world_size),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
    )
    if torch.cuda.device_count() < world_size:
        # The ranks run on CPU (gloo), as on CI: one thread each (CI has 2 cores for 2 ranks), and
        # no GPU in sight. With one visible, on a 1-GPU machine (torch 2.11), an FSDP2 DTensor's
        # full_tensor crashed in torch's functional collectives (SIGSEGV), and accelerate chose
        # nccl, so DeepSpeed's zero.Init broadcast of a CPU tensor had no backend.
        env.setdefault("OMP_NUM_THREADS", "1")
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a rank that crashes shows its Python stack
    return env


def _run_once(
    module: str, args: list[str], out_dir: Path, world_size: int, timeout: float
) -> tuple[str, list[int]]:
    """One run of the ranks: why it failed ("" when no rank hung or outlived a failed one) and
    their exit codes."""
    env = _environment(world_size)
    procs, logs = [], []
    for rank in range(world_size):
        log = open(out_dir / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        env_rank = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", module, *args],
                cwd=REPO,
                env=env_rank,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        logs.append(log)
    deadline = time.monotonic() + timeout
    failure = ""  # also when pytest-timeout's exception ends the wait below
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"distributed workers still running after {timeout:.0f}s")
            if any(p.returncode not in (None, 0) for p in procs):
                time.sleep(5)  # let the other rank fail on its own (collective timeout) or finish
                break
            time.sleep(0.2)
    except TimeoutError as error:
        failure = str(error)
    finally:
        for proc in procs:
            if proc.poll() is None and not failure:
                failure = "a rank failed while another was still running"
            _kill(proc)
        for log in logs:
            log.close()
    return failure, [p.returncode for p in procs]
