"""Fixtures for the tests of the scripts in ``benchmarks/``."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def import_script():
    """``import_script(name)``: ``benchmarks/<name>.py`` as a module. The folder is on ``sys.path``
    for the test module's duration: the scripts import their helpers as top-level modules."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCHMARKS))
        yield importlib.import_module
