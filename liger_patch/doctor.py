"""``python -m liger_patch doctor``: what is installed, which backend runs, and does the op agree
with an fp64 dense reference here. Exit status 0 when every check passes.

Its output is what a bug report needs (the README's "Report a problem"): the version of every
package liger_patch works with, read from the installed distributions' metadata (nothing is
imported for it: DeepSpeed's import alone takes seconds), and the commit of a checkout.
"""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
import time
from pathlib import Path

import torch

from liger_patch import env
from liger_patch.ops.core.backends import pick
from liger_patch.ops.core.budget import BATCH_BUDGET, BATCH_FACTOR, BATCH_RANGE, MiB, resolve_budget
from liger_patch.ops.cross_entropy.functional import fused_linear_cross_entropy
from liger_patch.ops.reference import reference_flce

ISSUES_URL = "https://github.com/liger-patch/liger-patch/issues"
"""Where problems are reported; pyproject.toml's ``[project.urls] Issues`` (a test keeps them equal)."""

PACKAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torch", ("torch",)),
    ("triton", ("triton", "pytorch-triton", "pytorch-triton-rocm")),
    ("transformers", ("transformers",)),
    ("accelerate", ("accelerate",)),
    ("peft", ("peft",)),
    ("trl", ("trl",)),
    ("deepspeed", ("deepspeed",)),
    ("liger-kernel", ("liger-kernel", "liger-kernel-nightly")),
)
"""Every package whose version changes what liger_patch does: the name shown, and the
distributions that provide it (the first one installed is reported)."""


def _version(distributions: tuple[str, ...]) -> str:
    """The installed version of the first of ``distributions`` there is, else "not installed"."""
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def _liger_patch_version() -> str:
    """This package's version, and the commit when it runs from a git checkout."""
    from liger_patch import __version__

    commit = _checkout_commit(Path(__file__).resolve().parents[1])
    return f"{__version__} (commit {commit})" if commit else __version__


def _checkout_commit(root: Path) -> str:
    """``git describe`` of the checkout at ``root`` (``-dirty`` with local changes), or ''."""
    if not (root / ".git").exists():
        return ""
    try:
        done = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=12"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _versions_lines() -> list[str]:
    """One line each: python and the platform, liger_patch, and every package of ``PACKAGES``."""
    lines = [
        f"python        {platform.python_version()} ({platform.machine()}, {platform.platform(terse=True)})",
        f"liger_patch   {_liger_patch_version()}",
    ]
    for shown, distributions in PACKAGES:
        version = _version(distributions)
        if shown == "torch":
            cuda = torch.version.cuda or getattr(torch.version, "hip", None) or "no CUDA"
            version = f"{version} ({'CUDA ' if torch.version.cuda else ''}{cuda})"
        lines.append(f"{shown:<13} {version}")
    return lines


def _budget_line() -> str:
    """The memory budget of a call that names none: ``LIGER_MEMORY_BUDGET`` (read now), else the
    op's default, and a patched model's ``"batch"`` (sized per call by its hidden states, so a
    range here). Raises ``ValueError`` for a bad ``LIGER_MEMORY_BUDGET``."""
    low, high = (b // MiB for b in BATCH_RANGE)
    batch = f"batch ({BATCH_FACTOR} x the hidden states' bytes, {low}-{high} MiB)"
    from_env = env.memory_budget()
    if from_env is None:
        default = resolve_budget(None) // MiB
        return (
            f"memory budget {default} MiB for the op, {batch} for a patched model (LIGER_MEMORY_BUDGET unset)"
        )
    if from_env.strip().lower() == BATCH_BUDGET:
        return f"memory budget {batch} (LIGER_MEMORY_BUDGET={from_env})"
    return f"memory budget {resolve_budget(None) / MiB:g} MiB (LIGER_MEMORY_BUDGET={from_env})"


def _why_backend(device: torch.device, chosen: str) -> str:
    if chosen == "triton":
        return "CUDA device" if device.type == "cuda" else "TRITON_INTERPRET=1 (Triton interpreter on CPU)"
    if device.type != "cuda" and not env.triton_interpret():
        return "no CUDA device and TRITON_INTERPRET is not set"
    return "triton is not installed"


def self_check(device: torch.device, backend: str) -> tuple[float, float, float]:
    """Relative errors (loss, grad_hidden, grad_weight) of the op against fp64, on random data."""
    gen = torch.Generator().manual_seed(1234)
    n, h, v = 67, 48, 509
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) / h**0.5
    bias = torch.randn(v, generator=gen)
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[::4] = -100
    options = dict(softcap=20.0, z_loss_scale=1e-4, label_smoothing=0.1)

    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref, _ = reference_flce(hr, wr, labels, bias, **options)  # the fp64 reference the tests use
    ref.backward()

    hd, wd = hidden.to(device).requires_grad_(), weight.to(device).requires_grad_()
    loss = fused_linear_cross_entropy(hd, wd, labels.to(device), bias.to(device), backend=backend, **options)
    loss.backward()

    def rel(a, b):
        return float((a.detach().double().cpu() - b.detach()).norm() / b.detach().norm())

    return rel(loss, ref), rel(hd.grad, hr.grad), rel(wd.grad, wr.grad)


def run_doctor() -> int:
    """Print the environment, the budget, the backend and the self-check; 0 when all is well."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"liger_patch doctor: paste this output into a bug report ({ISSUES_URL})")
    print("\n".join(_versions_lines()))
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability()
        count = torch.cuda.device_count()
        print(
            f"device        cuda: {torch.cuda.get_device_name()} (capability {capability}), {count} visible"
        )
    else:
        print("device        cpu (no CUDA device visible)")
    print(
        f"TRITON_INTERPRET={'1' if env.triton_interpret() else 'unset'}  "
        f"LIGER_RETURN_LOGITS={'1' if env.return_logits() else 'unset'}"
    )
    try:
        print(_budget_line())
    except ValueError as exc:
        print(f"memory budget INVALID: {exc}")
        return 1
    chosen = pick("auto", device).name
    print(f"backend=auto  -> {chosen} ({_why_backend(device, chosen)})")

    start = time.perf_counter()
    errors = self_check(device, chosen)
    took = time.perf_counter() - start
    ok = all(e < 1e-4 for e in errors)
    print(
        f"self-check    {'PASS' if ok else 'FAIL'} in {took:.2f}s: relative error vs fp64 "
        f"loss {errors[0]:.1e}, grad_hidden {errors[1]:.1e}, grad_weight {errors[2]:.1e} (limit 1e-4)"
    )
    return 0 if ok else 1
