"""``liger_patch.env``: flags read at every call, seeing every way a user sets them."""

from __future__ import annotations

import os
from unittest import mock

import pytest

from liger_patch import env


@pytest.fixture(params=["bytes mapping", "os.environ.get"])
def read_path(request, monkeypatch):
    """Every test twice: reading CPython's bytes mapping (POSIX) and ``os.environ.get`` (elsewhere)."""
    if request.param == "os.environ.get":
        monkeypatch.setattr(env, "_RAW", None)
    return request.param


@pytest.mark.parametrize("value", ["1", "true", "YES", " on ", "True"])
def test_flag_true(monkeypatch, read_path, value):
    monkeypatch.setenv("LIGER_RETURN_LOGITS", value)
    assert env.return_logits()


@pytest.mark.parametrize("value", ["", "0", "false", "no", "off", "2", "enable"])
def test_flag_false(monkeypatch, read_path, value):
    monkeypatch.setenv("LIGER_RETURN_LOGITS", value)
    assert not env.return_logits()


def test_flags_follow_every_kind_of_change(monkeypatch, read_path):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not env.triton_interpret()
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        assert env.triton_interpret()
    finally:
        del os.environ["TRITON_INTERPRET"]
    assert not env.triton_interpret()
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "on"}):
        assert env.triton_interpret()
    assert not env.triton_interpret()
    os.environ.update(TRITON_INTERPRET="yes")
    try:
        assert env.triton_interpret()
    finally:
        os.environ.pop("TRITON_INTERPRET")
    assert not env.triton_interpret()


def test_memory_budget(monkeypatch, read_path):
    monkeypatch.delenv("LIGER_MEMORY_BUDGET", raising=False)
    assert env.memory_budget() is None
    monkeypatch.setenv("LIGER_MEMORY_BUDGET", "  ")
    assert env.memory_budget() is None
    monkeypatch.setenv("LIGER_MEMORY_BUDGET", " 256MiB ")
    assert env.memory_budget() == "256MiB"


def test_non_ascii_value_reads_as_os_environ_does(monkeypatch, read_path):
    monkeypatch.setenv("LIGER_MEMORY_BUDGET", "été")
    assert env.memory_budget() == os.environ["LIGER_MEMORY_BUDGET"] == "été"


def test_a_replaced_os_environ_is_read(monkeypatch):
    """A test may swap ``os.environ`` for a plain dict; the flags then follow that dict."""
    monkeypatch.delenv("LIGER_RETURN_LOGITS", raising=False)
    with mock.patch("os.environ", {"LIGER_RETURN_LOGITS": "1"}):
        assert env.return_logits()
    assert not env.return_logits()
    monkeypatch.setattr(os, "environ", {"LIGER_MEMORY_BUDGET": "lean"})
    assert env.memory_budget() == "lean"
    assert not env.triton_interpret()
