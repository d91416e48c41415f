"""``liger_patch.peak_memory``: the memory one block of code takes, as the demo reports it."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from liger_patch import peak_memory
from liger_patch.peak_memory import measure_peak


def _allocate_64_mib() -> None:
    held = torch.ones(16 * 2**20).add_(1)  # 64 MiB, touched
    time.sleep(0.05)  # long enough for the sampling fallback, which reads RSS every millisecond
    del held


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RSS high-water mark reset is Linux-only")
def test_cpu_peak_measures_a_block_that_allocates():
    peak = measure_peak(_allocate_64_mib, torch.device("cpu"))
    assert peak is not None and 48 <= peak <= 200


def test_sampled_peak_where_the_high_water_mark_cannot_be_reset(monkeypatch):
    """macOS has no /proc/self/clear_refs: RSS is sampled with psutil in a thread instead."""
    pytest.importorskip("psutil")
    monkeypatch.setattr(peak_memory, "_reset_rss_high_water_mark", lambda: False)
    peak = measure_peak(_allocate_64_mib, torch.device("cpu"))
    assert peak is not None and 48 <= peak <= 200
