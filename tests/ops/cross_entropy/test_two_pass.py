"""The two-pass path for small memory budgets: token chunks give the loss and grad_h (their
logits kept in grad_W's not-yet-written bytes), vocabulary blocks recompute the logits and give
grad_W one block at a time. Checked against the fp64 reference in every gradient mode."""

import pytest
import torch
from op_helpers import (
    BACKENDS,
    DTYPES,
    IGNORE_PATTERNS,
    TOL,
    call_op,
    call_rows,
    check_parity,
    make_case,
    record_calls,
)

from liger_patch.ops.core.tuning import Tuning
from liger_patch.ops.core.vocab_shard import VocabShard
from liger_patch.ops.cross_entropy import chunks as chunked
from liger_patch.ops.cross_entropy.backends import row_backend
from liger_patch.ops.cross_entropy.options import LossOptions
from liger_patch.ops.cross_entropy.rows import ce_rows_torch
from liger_patch.ops.cross_entropy.vocab_parallel import shard_backend


@pytest.fixture
def vocab_pass_calls(monkeypatch):
    """Counts the vocabulary passes, so a test knows the two-pass path really ran."""
    return record_calls(monkeypatch, chunked, "vocab_pass", lambda args, kwargs, result: 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_pass_parity(gen, device, chunk_rows, vocab_pass_calls, backend, reduction, dtype):
    # V = 61 is not a multiple of the 7-column blocks; H = 10 gives pass A 10-row chunks.
    tuned = chunk_rows(7, 61, two_pass=True)
    case = make_case(gen, (4, 13), 10, 61, dtype=dtype, device=device, bias=True)
    check_parity(case, gen, tol=TOL[dtype], backend=backend, reduction=reduction, z_loss_scale=1e-2, **tuned)
    assert vocab_pass_calls


@pytest.mark.parametrize(
    "opts",
    [
        dict(label_smoothing=0.1),
        dict(softcap=5.0, logit_scale=0.7),
        dict(z_loss_scale=1e-2, return_z_loss=True),
        dict(num_items_in_batch=17),
    ],
    ids=str,
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_pass_options(gen, device, chunk_rows, vocab_pass_calls, backend, opts):
    tuned = chunk_rows(6, 50, two_pass=True)
    case = make_case(gen, (37,), 12, 50, device=device, bias=True)
    check_parity(case, gen, tol=TOL[torch.float32], backend=backend, **opts, **tuned)
    assert vocab_pass_calls


@pytest.mark.parametrize("ignore", IGNORE_PATTERNS + ["all"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_pass_ignore_patterns(gen, device, chunk_rows, backend, ignore):
    tuned = chunk_rows(5, 40, two_pass=True)
    case = make_case(gen, (29,), 9, 40, device=device, ignore=ignore)
    check_parity(case, gen, tol=TOL[torch.float32], backend=backend, **tuned)


@pytest.mark.parametrize("requires_grad", [("weight",), ("weight", "bias"), ("bias",), ("hidden",)], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_pass_partial_grads(gen, device, chunk_rows, backend, requires_grad):
    tuned = chunk_rows(5, 40, two_pass=True)
    case = make_case(gen, (31,), 8, 40, device=device, bias=True, requires_grad=requires_grad)
    check_parity(case, gen, tol=TOL[torch.float32], backend=backend, **tuned)


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_budget_takes_two_passes_on_its_own(gen, device, vocab_pass_calls, backend):
    """No forced path: a budget too small for ``min_token_chunk_rows`` rows of logits selects the
    two-pass path whenever grad_W is needed, and only then."""
    tuning = Tuning(min_token_chunk_rows=8)
    case = make_case(gen, (40,), 16, 64, device=device)
    budget = 4 * 64 * 3  # three fp32 rows
    check_parity(case, gen, tol=TOL[torch.float32], backend=backend, memory_budget=budget, tuning=tuning)
    assert len(vocab_pass_calls) == 1
    frozen = make_case(gen, (40,), 16, 64, device=device, requires_grad=("hidden",))
    check_parity(frozen, gen, tol=TOL[torch.float32], backend=backend, memory_budget=budget, tuning=tuning)
    assert len(vocab_pass_calls) == 1


def test_column_block_gradient_matches_the_full_row(gen):
    """The row function's column-block mode: the gradient of a block, given the full rows'
    log-sum-exp, equals that block of the full-row gradient (labels inside and outside it)."""
    opts = LossOptions(label_smoothing=0.1, z_loss_scale=1e-2, softcap=6.0)
    logits = torch.randn(12, 30, generator=gen) * 3
    labels = torch.randint(0, 30, (12,), generator=gen)
    labels[3] = -100
    coef = torch.rand(12, generator=gen)
    full = torch.empty_like(logits)
    _, lse = call_rows(ce_rows_torch, logits, labels, opts, grad=full, coef_ce=coef, coef_z=coef)
    for v0, v1 in ((0, 7), (7, 19), (19, 30)):
        block = torch.empty(12, v1 - v0)
        ce, lse_out = call_rows(
            ce_rows_torch,
            logits[:, v0:v1],
            labels,
            opts,
            grad=block,
            coef_ce=coef,
            coef_z=coef,
            lse_in=lse,
            col_offset=v0,
            vocab_total=30,
        )
        assert ce is None and lse_out is lse
        torch.testing.assert_close(block, full[:, v0:v1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_shard_row_kernel_without_the_rows_lse_is_refused(gen, device, backend):
    """A block of columns of wider rows needs the whole rows' log-sum-exp: a row kernel's column
    block comes with it (``row_io.GivenLse``), and a vocabulary shard's kernel, whose every call is
    such a block, refuses a call without one."""
    kernel = shard_backend(row_backend(backend, device), VocabShard(offset=5, vocab=10)).row_kernel
    logits = torch.randn(3, 5, generator=gen).to(device)
    with pytest.raises(ValueError, match="log-sum-exp"):
        kernel(logits, torch.zeros(3, dtype=torch.long, device=device), LossOptions())


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_pass_second_backward_and_fp16_recompute(gen, device, chunk_rows, vocab_pass_calls, backend):
    """The backward's recompute path (here: a retained graph's second backward) also runs two
    passes and gives the same gradients as the first backward."""
    tuned = chunk_rows(5, 40, two_pass=True)
    case = make_case(gen, (33,), 8, 40, device=device)
    loss = call_op(case, backend=backend, **tuned)
    loss.backward(retain_graph=True)
    first = case.weight.grad.clone()
    case.weight.grad = None
    loss.backward()
    torch.testing.assert_close(case.weight.grad, first, rtol=1e-5, atol=1e-7)
    assert len(vocab_pass_calls) >= 2
