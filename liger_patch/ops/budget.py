"""``liger_patch.ops.budget``, this module's path before issue 42, as an alias: the same module
object as ``liger_patch.ops.core.budget``. Kept because liger_patch/doctor.py (owned by another
engineer now) imports it by this path; remove it once doctor names the new one."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("liger_patch.ops.core.budget")
