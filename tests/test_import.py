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
