"""The harness that starts the distributed tests' ranks (tests/distributed/launch.py)."""

import socket

import pytest

from tests.distributed import launch

_PROBE = """
import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""


def test_a_taken_rendezvous_port_is_retried_on_a_new_one(tmp_path, monkeypatch):
    """Parallel test workers pick ports too: when another process binds the port between
    ``free_port`` and rank 0's rendezvous (seen on a 16-worker GPU run: EADDRINUSE), the run is
    started again on a new port instead of failing its tests."""
    (tmp_path / "rendezvous_probe.py").write_text(_PROBE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1]]
        real = launch.free_port
        monkeypatch.setattr(launch, "free_port", lambda: ports.pop() if ports else real())
        launch.run_workers("rendezvous_probe", [], tmp_path / "out", timeout=120)
    assert not ports  # the taken port was handed out first


def test_a_failing_rank_still_fails_the_run(tmp_path, monkeypatch):
    """Only a taken port is retried: a rank that fails otherwise fails the run, with its output."""
    (tmp_path / "failing_probe.py").write_text("raise SystemExit('planted failure')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(AssertionError, match="planted failure"):
        launch.run_workers("failing_probe", [], tmp_path / "out", timeout=60)
