"""Backends as records: which one ``pick`` gives, and why it refuses one that cannot run."""

import pytest
import torch

from liger_patch.ops.core.backends import TORCH, pick, scale_in_fp32_


def test_torch_record():
    assert pick("torch", torch.device("cpu")) is TORCH
    assert TORCH.fused_logits is None and TORCH.scale_ is scale_in_fp32_
    assert TORCH.unavailable(torch.device("cpu")) is None


def test_auto_on_cpu_follows_triton_interpret_read_on_every_call(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert pick("auto", torch.device("cpu")) is TORCH
    with pytest.raises(ValueError, match="needs CUDA tensors, or TRITON_INTERPRET=1"):
        pick("triton", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton_backend = pick("auto", torch.device("cpu"))
    assert triton_backend.name == "triton" and triton_backend.fused_logits is not None
    assert pick("triton", torch.device("cpu")) is triton_backend


def test_unknown_name():
    with pytest.raises(ValueError, match="unknown backend"):
        pick("cuda", torch.device("cpu"))
