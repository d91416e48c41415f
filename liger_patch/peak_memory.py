"""How much memory one block of code takes: the most in use while it runs, above what was in use
when it started (``measure_peak``). CUDA's peak allocation on a GPU; on a CPU the process's peak
resident memory (RSS), read from the kernel's high-water mark where Linux lets it be reset, else
sampled. ``python -m liger_patch demo`` reports the loss step's peak with it."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import threading
from collections.abc import Callable, Iterator

import torch

from liger_patch.ops.core.budget import MiB

__all__ = ["measure_peak"]


def _proc_status_bytes(key: str) -> int:
    """A ``kB`` field of /proc/self/status (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_rss_high_water_mark() -> bool:
    """Reset this process's peak RSS (Linux: writing 5 to /proc/self/clear_refs); False if not
    possible here. ``resource.getrusage``'s ru_maxrss cannot be reset, hence this."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _proc_status_bytes("VmHWM")
    except (OSError, KeyError):
        return False
    return True


def _release_free_heap() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``), so that memory the previous
    run freed but the allocator kept does not hide this run's growth."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@contextlib.contextmanager
def _sampled_rss_peak(out: list[float]) -> Iterator[None]:
    """Fallback where the kernel's peak cannot be reset (macOS): sample RSS every millisecond with
    psutil in a thread. Appends the peak above the start (MiB), or nothing without psutil."""
    try:
        import psutil
    except ImportError:
        yield
        return
    process = psutil.Process()
    start = peak = process.memory_info().rss
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.001):
            peak = max(peak, process.memory_info().rss)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        out.append((max(peak, process.memory_info().rss) - start) / MiB)


def measure_peak(fn: Callable[[], object], device: torch.device) -> float | None:
    """Run ``fn`` and return the most memory (MiB) in use during it above what was in use when it
    started: CUDA's peak allocation on a GPU, the process's peak RSS on a CPU; None if neither
    can be measured here."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - start) / MiB
    gc.collect()
    _release_free_heap()
    if _reset_rss_high_water_mark():
        start = _proc_status_bytes("VmRSS")
        fn()
        return (_proc_status_bytes("VmHWM") - start) / MiB
    sampled: list[float] = []
    with _sampled_rss_peak(sampled):
        fn()
    return sampled[0] if sampled else None
