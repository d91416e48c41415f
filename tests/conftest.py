"""Shared fixtures.

Without CUDA the Triton backend can only run under the Triton interpreter, and
TRITON_INTERPRET must be in the environment before Triton (hence liger_patch) is imported.
Importing torch and pytest does not import Triton, so setting it here is early enough; the
op package itself is imported lazily below and by the test modules.
"""

import os
import sys
import zlib

import pytest

try:
    import torch
except ImportError as exc:  # a pytest from another environment than the one pip installed into
    raise pytest.UsageError(
        f"torch is not importable by the Python running pytest ({sys.executable}): install with "
        f'that Python, `{sys.executable} -m pip install torch==2.13.0 -e ".[test]"`, or run '
        "the pytest of the environment you installed into (README, Set-up)"
    ) from exc

HAS_CUDA = torch.cuda.is_available()

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    # Triton reads TRITON_INTERPRET when a kernel is defined, and inductor defines its helpers
    # (triton_helpers) at import: were that import to happen inside a test that sets the flag,
    # every later torch.compile in this worker would fail ("Unsupported function referenced:
    # InterpretedFunction"). On a GPU machine they are defined here, natively, first.
    import torch._inductor.runtime.triton_helpers  # noqa: F401


def _share_cores_between_workers() -> None:
    """Under pytest-xdist, each worker (and each process a test starts: distributed ranks, the
    demo, the examples) gets its share of the cores instead of one thread per core each: 16
    workers on 16 cores otherwise ran 256 threads, and CPU-bound tests took 5-10x longer (the
    verification sweep and the distributed ranks ran past any timeout)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return
    share = max(1, (os.cpu_count() or 1) // workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(share))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_share_cores_between_workers()


def _register_hypothesis_profiles() -> None:
    """Hypothesis profiles for the property-based tests (tests/ops/test_fuzz.py), chosen by the
    HYPOTHESIS_PROFILE environment variable (default "ci"):

    - "ci": derandomized (the same examples on every run), no example database, bounded so
      that the fuzz file stays within ~3 minutes on 2 CPU cores under the Triton interpreter;
    - "dev": random seeds, 3x the examples, failures replayed first on the next run;
    - "long": random seeds, 15x the examples (thousands per property; ~20-30 min on 2 cores).

    Each test takes a share of the profile's ``max_examples`` (see ``examples`` in the fuzz
    file), so the ratios between tests stay the same in every profile. The example database
    lives under .pytest_cache (ignored by git), never in the working tree.
    """
    try:
        from hypothesis import HealthCheck, Phase, settings
        from hypothesis.database import DirectoryBasedExampleDatabase
    except ImportError:  # hypothesis is only needed by the fuzz tests
        return
    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    database = DirectoryBasedExampleDatabase(os.path.join(repo_root, ".pytest_cache", "hypothesis"))
    common = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
    fast_failure = [Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink]  # no "explain" re-runs
    settings.register_profile(
        "ci", max_examples=400, derandomize=True, database=None, phases=fast_failure, **common
    )
    settings.register_profile("dev", max_examples=1200, database=database, **common)
    settings.register_profile("long", max_examples=6000, database=database, **common)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


_register_hypothesis_profiles()


def _matmul_precision() -> str:
    return (
        f"float32 matmul precision {torch.get_float32_matmul_precision()!r}, "
        f"cuda.matmul.allow_tf32={torch.backends.cuda.matmul.allow_tf32}, "
        f"NVIDIA_TF32_OVERRIDE={os.environ.get('NVIDIA_TF32_OVERRIDE')}, "
        f"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE={os.environ.get('TORCH_ALLOW_TF32_CUBLAS_OVERRIDE')}"
    )


def pytest_report_header(config):
    return f"liger_patch tests: {_matmul_precision()}"


@pytest.fixture(autouse=True)
def _ieee_fp32_matmuls():
    """fp32 tolerances (1e-5) assume IEEE fp32 GEMMs; TF32 (some images and libraries switch it
    on globally) would add ~1e-4. Pinned per test, since any import may flip it."""
    if HAS_CUDA:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    yield


@pytest.fixture(autouse=True)
def _restore_environment():
    """Each test starts from the same environment: transformers 4.57's
    ``TrainingArguments(bf16=True)`` (every TRL config by default) writes
    ``ACCELERATE_MIXED_PRECISION=bf16`` into ``os.environ``, and every later Trainer in the
    process (and every worker it starts) then trained under bf16 autocast. Pytest's own
    ``PYTEST_CURRENT_TEST`` is left to pytest."""
    saved = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    yield
    for key in [k for k in os.environ if k not in saved and k != "PYTEST_CURRENT_TEST"]:
        del os.environ[key]
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _no_call_plan_left():
    """Each test starts with no call plan (``ops/cross_entropy/one_chunk.py``) made by an earlier
    one: a planned call skips the chunk loop's decisions, which tests spy on, so a test's first
    calls must not depend on which tests ran before it on its worker."""
    plans = sys.modules.get("liger_patch.ops.cross_entropy.one_chunk")
    if plans is not None:
        plans.forget()
    yield


@pytest.fixture(autouse=True)
def _no_label_error_left():
    """A bad label's error that a call on CUDA left for later (``core/deferred_checks.py``) is
    raised in the test that made it, never by a later test's first call."""
    yield
    checks = sys.modules.get("liger_patch.ops.core.deferred_checks")
    first = None
    while checks is not None and checks.pending():  # all of them: none is left to a later test
        try:
            checks.raise_pending()
        except (IndexError, ValueError) as error:
            first = first or error
    if first is not None:
        raise first


@pytest.fixture(scope="module")
def one_cpu_thread():
    """One torch thread for a module of tiny ops (``pytestmark = pytest.mark.usefixtures(...)``):
    they gain nothing from threads, and on a busy CPU the hand-offs cost 100x the work. The
    setting is restored for the other modules."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU generator seeded from the test id: every test (and parameter set) gets its own,
    reproducible stream."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def chunk_rows():
    """chunk_rows(rows, V, two_pass=False) -> the op options (``tuning``, ``memory_budget``) that
    run it in chunks of exactly `rows` token rows (and, on the two-pass path, vocabulary blocks of
    `rows` columns where the budget sizes them), so that small inputs go through several chunks
    and a remainder chunk. The memory budget is `rows` fp32 logit rows of width V, which leaves
    nothing once the per-token vectors and slack are taken: an fp32 grad_W never fits.
    `two_pass=True` makes every input with more than `rows + 1` tokens take the two-pass path;
    otherwise it is never taken. chunk_rows(None, V) puts everything in one chunk. The
    ignored rows are skipped by the share rule alone (``wait_to_skip_gflop=0``: on CUDA the
    forward then always reads its label check), whatever the tiny size."""
    from liger_patch.ops.core.tuning import Tuning

    def options(rows, V, two_pass=False):
        forced = (1 << 40) if rows is None else rows
        tuning = Tuning(
            chunk_rows=forced, min_token_chunk_rows=forced + 1 if two_pass else 0, wait_to_skip_gflop=0.0
        )
        return {"tuning": tuning, "memory_budget": (1 << 34) if rows is None else 4 * V * rows}

    return options
