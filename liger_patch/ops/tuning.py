"""``liger_patch.ops.tuning``, this module's path before issue 42, as an alias: the same module
object as ``liger_patch.ops.core.tuning``. Kept because tests/conftest.py and docs/benchmarks.md
(owned by others now) import ``Tuning`` by this path, and users may have followed them; remove
it once they name the new one."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("liger_patch.ops.core.tuning")
