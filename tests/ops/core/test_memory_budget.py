"""The ``memory_budget`` option: how it is given (argument, ``LIGER_MEMORY_BUDGET``, default),
what it accepts, that it changes only how the work is chunked (never the result), and, on CUDA,
that the op's working memory stays inside it."""

import pytest
import torch
from op_helpers import BACKENDS, TOL, call_op, check_parity, make_case, record_calls

from liger_patch.ops.core.budget import (
    MEMORY_BUDGETS,
    PER_TOKEN_BYTES,
    SLACK_BYTES,
    batch_budget,
    one_chunk_bytes,
    parse_memory_budget,
    resolve_budget,
)
from liger_patch.ops.cross_entropy import chunks as chunked
from liger_patch.ops.cross_entropy.options import LossOptions

MiB = 1 << 20


@pytest.mark.parametrize(
    "value, nbytes",
    [
        (12345, 12345),
        ("default", 512 * MiB),
        ("LEAN", 32 * MiB),
        ("256MiB", 256 * MiB),
        (" 1.5 GiB ", int(1.5 * (1 << 30))),
        ("64mb", 64 * 10**6),
        ("4096", 4096),
        ("2KiB", 2048),
    ],
)
def test_parse_memory_budget(value, nbytes):
    assert parse_memory_budget(value) == nbytes


@pytest.mark.parametrize("value", [0, -1, "0MiB", "lots", "12XB", "MiB", "-5MiB", ""])
def test_bad_memory_budget_values(value):
    with pytest.raises(ValueError, match="memory_budget"):
        parse_memory_budget(value)


@pytest.mark.parametrize("value", [True, 1.5, None, [1]])
def test_bad_memory_budget_types(value):
    with pytest.raises(TypeError, match="memory_budget"):
        parse_memory_budget(value)


def test_presets():
    assert {"default": 512 * MiB, "lean": 32 * MiB} == MEMORY_BUDGETS


@pytest.mark.parametrize(
    "hidden_bytes, nbytes",
    [
        (None, 1024 * MiB),  # size unknown (an option's check, doctor): its most
        (1, 256 * MiB),
        (256 * MiB // 6, 256 * MiB),
        (50 * MiB, 300 * MiB),
        (64 * MiB, 384 * MiB),  # Llama-1B, 8 x 2048 tokens in bf16
        (128 * MiB, 768 * MiB),  # 16 x 2048
        (1024 * MiB // 6 + 1, 1024 * MiB),
        (1 << 40, 1024 * MiB),
    ],
)
def test_batch_budget_is_six_times_the_hidden_states_within_256_mib_to_1_gib(hidden_bytes, nbytes):
    assert batch_budget(hidden_bytes) == nbytes
    assert parse_memory_budget(" Batch ", hidden_bytes) == nbytes


@pytest.mark.parametrize(
    "hidden_bytes, whole_bytes, nbytes",
    [
        (8 * MiB, 789 * MiB, 789 * MiB),  # 4 x 1024 tokens at H=1024, V=128256: one chunk
        (8 * MiB, 1024 * MiB, 1024 * MiB),
        (8 * MiB, 1024 * MiB + 1, 256 * MiB),  # beyond 1 GiB: sized by the hidden states alone
        (64 * MiB, 200 * MiB, 384 * MiB),  # already larger than one chunk
        (None, 10 * MiB, 1024 * MiB),
    ],
)
def test_batch_budget_runs_a_small_call_as_one_chunk(hidden_bytes, whole_bytes, nbytes):
    assert batch_budget(hidden_bytes, whole_bytes) == nbytes
    assert parse_memory_budget("batch", hidden_bytes, whole_bytes) == nbytes
    assert resolve_budget("batch", hidden_bytes, whole_bytes) == nbytes
    assert parse_memory_budget("default", hidden_bytes, whole_bytes) == 512 * MiB  # "batch" only


def test_one_chunk_bytes_counts_rows_partials_gathers_and_per_token_vectors():
    # 3 rows walked of 5 tokens, V=256 in bf16 (512 B + 16 B of partials), H=8 in bf16 (32 B)
    assert one_chunk_bytes(3, 5, 256, 2, 8, 2) == 3 * (512 + 16 + 32) + 5 * PER_TOKEN_BYTES + SLACK_BYTES


def test_batch_budget_from_the_environment_and_as_an_option(monkeypatch):
    monkeypatch.setenv("LIGER_MEMORY_BUDGET", "batch")
    assert resolve_budget(None, 50 * MiB) == 300 * MiB
    monkeypatch.delenv("LIGER_MEMORY_BUDGET")
    assert resolve_budget(None, 50 * MiB) == 512 * MiB  # "default" ignores the size
    assert LossOptions(memory_budget="batch").memory_budget == "batch"
    with pytest.raises(ValueError, match="'batch'"):  # the refusal lists it among the names
        parse_memory_budget("batches")


@pytest.fixture
def logits_calls(monkeypatch):
    """Records the row count of every logits chunk the op builds (a first chunk begun before the
    label check, ``head_start``, when it is finished)."""
    return record_calls(monkeypatch, chunked, "_chunk_logits", lambda args, kwargs, out: out.logits.shape[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_argument_environment_default(gen, device, monkeypatch, logits_calls, backend):
    """The argument wins; without it the environment variable, read on every call, decides. (No
    label ignored: every row is walked, and the budget holds exactly eight of them.)"""
    case = make_case(gen, (40,), 16, 64, device=device, requires_grad=(), ignore="none")
    monkeypatch.delenv("LIGER_MEMORY_BUDGET", raising=False)
    call_op(case, backend=backend)
    assert logits_calls == [40]
    logits_calls.clear()
    # Eight fp32 rows, with the log-sum-exp partials that Triton's fused logits GEMM keeps per row.
    row_bytes = 4 * 64
    if backend == "triton":
        from liger_patch.ops.core.triton import logits

        row_bytes += logits.partial_bytes_per_row(64, LossOptions())
    monkeypatch.setenv("LIGER_MEMORY_BUDGET", str(row_bytes * 8 + PER_TOKEN_BYTES * 40 + SLACK_BYTES))
    call_op(case, backend=backend)
    assert logits_calls == [8] * 5
    logits_calls.clear()
    call_op(case, backend=backend, memory_budget="default")
    assert logits_calls == [40]
    monkeypatch.setenv("LIGER_MEMORY_BUDGET", "a lot")
    with pytest.raises(ValueError, match="LIGER_MEMORY_BUDGET='a lot'"):
        call_op(case, backend=backend)


def test_a_batch_call_that_fits_one_gib_runs_as_one_chunk(gen, logits_calls):
    """1200 kept fp32 rows of V=65536 (300 MiB of logits; the hidden states' 25 KiB alone size
    ``"batch"`` at its 256 MiB floor) run as one chunk, the 400 ignored rows skipped."""
    case = make_case(gen, (1600,), 4, 65536, requires_grad=("hidden",), ignore="none")
    case.labels[::4] = -100
    call_op(case, backend="torch", memory_budget="batch")
    assert logits_calls == [1200]
    logits_calls.clear()
    call_op(case, backend="torch", memory_budget="256MiB")
    assert len(logits_calls) == 2 and sum(logits_calls) == 1200


@pytest.mark.parametrize("budget", ["lean", "default", 4 * 50 * 3, 1])
@pytest.mark.parametrize("backend", BACKENDS)
def test_budget_never_changes_the_result(gen, device, backend, budget):
    """Budgets from one row of logits up give the reference's values and gradients."""
    case = make_case(gen, (3, 9), 12, 50, device=device, bias=True)
    check_parity(case, gen, tol=TOL[torch.float32], backend=backend, memory_budget=budget, z_loss_scale=1e-3)


@pytest.mark.parametrize("value", [0, "nope"])
def test_module_checks_budget_at_construction(value):
    from liger_patch import FusedLinearCrossEntropyLoss

    with pytest.raises(ValueError, match="memory_budget"):
        FusedLinearCrossEntropyLoss(memory_budget=value)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "budget_mib, shape",
    [(4, (4096, 512, 32000)), (8, (4096, 512, 32000)), (64, (4096, 512, 32000)), (4, (4096, 2048, 32768))],
)
@pytest.mark.parametrize("grads", ["all", "hidden"])
def test_working_memory_stays_in_budget(budget_mib, shape, grads):
    """Peak memory during forward + backward, beyond inputs and their gradients, stays within
    the budget; 4 MiB runs the two-pass path (V=32000 rows are 62.5 KiB). At H=2048 pass A's
    chunks in grad_W are 2048 rows, whose log-sum-exp partials (Hopper's fused logits GEMM)
    take 2 MiB of the 4."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    n, h, v = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=g) / h**0.5).bfloat16()
    weight.requires_grad_(grads == "all")
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    from liger_patch import fused_linear_cross_entropy

    fused_linear_cross_entropy(hidden, weight, labels, memory_budget=f"{budget_mib}MiB").backward()
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fused_linear_cross_entropy(hidden, weight, labels, memory_budget=f"{budget_mib}MiB").backward()
    torch.cuda.synchronize()
    grads_bytes = hidden.numel() * 2 + (weight.numel() * 2 if grads == "all" else 0)
    extra = torch.cuda.max_memory_allocated() - base - grads_bytes
    assert extra <= budget_mib * MiB, f"{extra / MiB:.2f} MiB extra with a {budget_mib} MiB budget"


@pytest.mark.cuda
@pytest.mark.parametrize("budget_mib", [4, 64, 512])
@pytest.mark.parametrize("grads", ["all", "hidden"])
def test_working_memory_stays_in_budget_under_autocast(budget_mib, grads):
    """An fp32 weight and hidden under bf16 autocast (the HF Trainer's ``bf16=True``): the GEMMs'
    bf16 copy of the weight lives in grad_W's bytes, so beyond the inputs and their fp32
    gradients the op holds its budget plus what ``nn.Linear`` under autocast would too (the bf16
    copy of the hidden states, saved for the backward) and, with no grad_W to hold it, the bf16
    copy of the weight (96 MiB here, also what ``nn.Linear`` makes). 4 MiB runs the two-pass path."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    n, h, v = 4096, 1536, 32768
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", generator=g).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=g) / h**0.5).requires_grad_(grads == "all")
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    from liger_patch import fused_linear_cross_entropy

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fused_linear_cross_entropy(hidden, weight, labels, memory_budget=f"{budget_mib}MiB")
        loss.backward()

    step()
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    grads_bytes = hidden.numel() * 4 + (weight.numel() * 4 if grads == "all" else 0)
    allowed = budget_mib * MiB + hidden.numel() * 2 + (0 if grads == "all" else weight.numel() * 2)
    extra = torch.cuda.max_memory_allocated() - base - grads_bytes
    assert extra <= allowed, f"{extra / MiB:.2f} MiB extra, {allowed / MiB:.2f} allowed"
