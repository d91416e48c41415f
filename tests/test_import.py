"""``import liger_patch`` stays light: it must not pull in torch.compile's stack or transformers'
model and trainer modules, which cost seconds at import. Checked in a fresh interpreter, since
the test process has long imported everything."""

from __future__ import annotations

import json
import os
import subprocess
import sys

HEAVY_MODULES = (
    "torch._dynamo",
    "torch._inductor",
    "transformers.modeling_utils",
    "transformers.trainer",
)

_PROBE = """
import json, sys
import liger_patch
print(json.dumps(sorted(m for m in sys.modules if m in {heavy})))
"""


def test_import_liger_patch_does_not_import_heavy_modules():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    probe = _PROBE.format(heavy=set(HEAVY_MODULES))
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert not loaded, (
        f"`import liger_patch` imported {', '.join(loaded)}: import them lazily, where they are "
        f"used (see `python -X importtime -c 'import liger_patch'`)"
    )


_NO_TRITON = """
import sys

class NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}")

sys.meta_path.insert(0, NoTriton())
import liger_patch
import liger_patch.integrations.distill_heads
import liger_patch.ops.distillation.vocab_parallel
print("imported")
"""


def test_import_liger_patch_without_triton():
    """Triton is optional (pyproject installs it on Linux only; ``backends`` says why a call cannot
    run it): the package and its ops import without it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    probe = [sys.executable, "-c", _NO_TRITON]
    done = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("imported"), done.stderr[-3000:]
