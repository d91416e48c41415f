#!/usr/bin/env bash
# The whole test suite on a GPU machine, in one command (docs/results/gpu_tests.log holds its runs):
#
#     bash tests/gpu_suite.sh [LOG] [PYTEST ARGS...]
#
# The same tests as the README's `pytest`: there the Triton cases run natively on CUDA tensors
# (tests/conftest.py turns the interpreter on only where there is no GPU). pytest-xdist spreads
# them over up to 16 workers, each with its share of the cores (tests/conftest.py); `--dist
# loadgroup` keeps each module whose fixture launches processes on one worker, so that fixture
# runs once. Every test is bound by the suite's own timeout (pyproject.toml). The header records
# the commit (GIT_COMMIT where the checkout has no .git), the card and the versions; the last line
# is pytest's summary. SUITE_TIMEOUT=<seconds> interrupts pytest then as Ctrl-C would, so a run
# cut short still prints its failures and summary (and writes a --junitxml it was given).
set -euo pipefail
cd "$(dirname "$0")/.."
log=${1:-/tmp/gpu_tests.out}
shift || true
limit=()
if [[ -n "${SUITE_TIMEOUT:-}" ]]; then
    limit=(timeout -s INT -k 30 "$SUITE_TIMEOUT")
fi
python -c "import xdist" 2>/dev/null || { echo "tests/gpu_suite.sh needs pytest-xdist (pip install pytest-xdist)" >&2; exit 2; }
workers=${WORKERS:-$(( $(nproc) < 16 ? $(nproc) : 16 ))}
commit=${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "unknown")}
{
    echo "commit $commit; $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$(nvidia-smi -L | wc -l)"
    python -c 'import importlib.metadata as m, importlib.util as u
names = ("torch", "triton", "transformers", "accelerate", "peft", "trl", "deepspeed", "hypothesis")
print("; ".join(f"{p} {m.version(p)}" for p in names if u.find_spec(p)))'
    echo "python -m pytest -q -n $workers --dist loadgroup -rfEs --tb=short $*"
} | tee "$log"
set +e
"${limit[@]}" python -m pytest -q -n "$workers" --dist loadgroup -rfEs --tb=short -p no:cacheprovider "$@" \
    2>&1 | tee -a "$log"
status=${PIPESTATUS[0]}
exit "$status"
