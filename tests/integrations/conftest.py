"""Fixtures the integration tests share."""

import pytest

from liger_patch.integrations import trl as trl_head


@pytest.fixture
def op_calls(monkeypatch):
    """How many times the fused op computed TRL's log-prob fields (each call's token count)."""
    calls = []
    original = trl_head.fused_log_prob_fields

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(trl_head, "fused_log_prob_fields", counted)
    return calls
