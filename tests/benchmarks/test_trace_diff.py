"""``benchmarks/experiments/trace_diff.py`` on hand-made chrome traces: the GPU's busy time is the
union of its intervals, a host event's self time leaves out what is nested in it, and each
variant is compared with the unpatched trace of its stage, row and rank."""

from __future__ import annotations

import gzip
import json

import pytest


@pytest.fixture(scope="module")
def trace_diff(import_script):
    return import_script("experiments.trace_diff")


def _event(name, cat, ts, dur, tid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def _write(path, events):
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_busy_time_self_time_and_the_pairs(trace_diff, tmp_path):
    unpatched = [
        _event("aten::mm", "cpu_op", 0, 1000),
        _event("cudaLaunchKernel", "cuda_runtime", 100, 300),  # inside aten::mm
        _event("gemm", "kernel", 500, 2000, tid=7),
        _event("ncclAllReduce", "kernel", 1500, 2000, tid=8),  # overlaps the GEMM
    ]
    patched = [
        _event("flce_eager", "cpu_op", 0, 3000),
        _event("cudaEventSynchronize", "cuda_runtime", 1000, 500),
        _event("Optimizer.step", "user_annotation", 3000, 1000),
        _event("row_kernel", "kernel", 500, 1000, tid=7),
    ]
    _write(tmp_path / "trace_zero2_h1024_l4_unpatched_rank0.json.gz", unpatched)
    _write(tmp_path / "trace_zero2_h1024_l4_patched_rank0.json.gz", patched)
    (row,) = trace_diff.compare(tmp_path, top=10)
    assert (row["stage"], row["row"], row["rank"], row["variant"]) == ("zero2", "h1024_l4", 0, "patched")
    before, after = row["unpatched"], row["patched"]
    assert before["gpu_busy_ms"] == pytest.approx(3.0) and before["span_ms"] == pytest.approx(3.5)
    assert before["kernel_ms"] == pytest.approx({"compute": 2.0, "nccl": 2.0})
    assert after["host_wait_ms"] == pytest.approx({"cudaEventSynchronize": 0.5})
    assert after["annotations"] == pytest.approx({"Optimizer.step": 1.0})
    host = row["host_self_largest_differences"]
    assert host["aten::mm"] == pytest.approx(-0.7) and host["flce_eager"] == pytest.approx(2.5)
    assert row["kernel_largest_differences"]["gemm"] == pytest.approx(-2.0)
    assert row["patched_minus_unpatched"]["gpu_busy_ms"] == pytest.approx(-2.0)


def test_a_variant_without_its_unpatched_trace_is_left_out(trace_diff, tmp_path):
    _write(tmp_path / "trace_zero3_h1024_l4_patched_rank1.json.gz", [_event("k", "kernel", 0, 10)])
    assert trace_diff.compare(tmp_path, top=5) == []
