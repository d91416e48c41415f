"""Parity of lp.fused_linear_cross_entropy with the fp64 reference: values and gradients of
hidden, weight and bias, for every option alone and combined, on both backends, for
fp32/bf16/fp16, odd shapes, several chunks and ignored tokens in every position.

Every backward uses a random upstream gradient (a random scalar for mean/sum, a random
tensor for "none"), so a gradient that ignores grad_output fails.
"""

import pytest
import torch
from op_helpers import (
    BACKENDS,
    COMBINED,
    DTYPES,
    IGNORE_PATTERNS,
    OPTION_CASES,
    TOL,
    check_parity,
    make_case,
    materialize_options,
)

from liger_patch.ops.cross_entropy.options import OptionKind, option_defaults


def test_option_cases_set_every_loss_and_output_option():
    """OPTION_CASES (run below, and on a vocabulary-sharded head by
    tests/ops/cross_entropy/test_vocab_parallel.py) give every loss-math and output option of
    ``LossOptions`` (by its kind tag) a value other than its default, and give class weights: a new
    option fails this until a case sets it."""
    defaults = option_defaults(OptionKind.LOSS, OptionKind.OUTPUT)
    covered = {
        name
        for _, op_kw in OPTION_CASES.values()
        for name, value in op_kw.items()
        if name in defaults and value != defaults[name]
    }
    assert covered == set(defaults), f"no case sets {sorted(set(defaults) - covered)}"
    assert any("class_weight" in op_kw for _, op_kw in OPTION_CASES.values())


@pytest.mark.parametrize("case_id", list(OPTION_CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_option_parity_fp32(gen, device, chunk_rows, backend, case_id):
    case_kw, op_kw = OPTION_CASES[case_id]
    V = 97
    tuned = chunk_rows(3, V)  # 37 tokens -> 12 full chunks + a remainder of 1
    case = make_case(gen, (37,), 19, V, device=device, **case_kw)
    check_parity(
        case, gen, tol=TOL[torch.float32], backend=backend, **materialize_options(op_kw, device, V), **tuned
    )


@pytest.mark.parametrize("case_id", ["plain", "bias", "reduction_none", "combined_mean", "combined_none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_dtype_parity(gen, device, chunk_rows, backend, dtype, case_id):
    """bf16/fp16 inputs: the reference runs on the same rounded inputs; grads come back in the
    input dtype."""
    case_kw, op_kw = OPTION_CASES[case_id]
    V = 131
    tuned = chunk_rows(4, V)
    case = make_case(gen, (2, 11), 19, V, dtype=dtype, device=device, **case_kw)
    check_parity(case, gen, tol=TOL[dtype], backend=backend, **materialize_options(op_kw, device, V), **tuned)


# (leading shape, H, V, chunk rows or None for a single chunk)
SHAPES = [
    ((1,), 5, 3, None),
    ((1,), 5, 3, 1),
    ((7,), 19, 131, 3),
    ((37,), 5, 97, 3),
    ((37,), 19, 97, 1),
    ((37,), 19, 131, 36),
    ((37,), 19, 97, 37),
    ((37,), 19, 97, None),
    ((2, 5), 19, 97, 3),
    ((3, 1, 4), 5, 131, 5),
    ((3,), 5, 5003, 2),
]


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"lead{s[0]}-H{s[1]}-V{s[2]}-rows{s[3]}")
@pytest.mark.parametrize("backend", BACKENDS)
def test_shapes_and_chunks(gen, device, chunk_rows, backend, shape, reduction):
    lead, H, V, rows = shape
    tuned = chunk_rows(rows, V)
    ignore = "none" if lead == (1,) else "mixed"
    case = make_case(gen, lead, H, V, device=device, bias=True, ignore=ignore)
    check_parity(case, gen, tol=TOL[torch.float32], backend=backend, reduction=reduction, **tuned)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_no_leading_dims(gen, device, backend, reduction):
    """hidden (H,) with a 0-d label is one token; "none" returns a 0-d loss."""
    case = make_case(gen, (), 19, 97, device=device, bias=True, ignore="none")
    assert case.hidden.shape == (19,) and case.labels.shape == ()
    check_parity(case, gen, tol=TOL[torch.float32], backend=backend, reduction=reduction, softcap=5.0)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("pattern", IGNORE_PATTERNS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ignored_positions(gen, device, chunk_rows, backend, pattern, reduction):
    """Ignored tokens first, last, all but one, in runs, every other, at random; several chunks."""
    V = 97
    tuned = chunk_rows(3, V)
    case = make_case(gen, (2, 11), 5, V, device=device, bias=True, ignore=pattern)
    check_parity(
        case,
        gen,
        tol=TOL[torch.float32],
        backend=backend,
        reduction=reduction,
        label_smoothing=0.1,
        z_loss_scale=1e-2,
        return_z_loss=True,
        **tuned,
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_ignore_index_inside_vocab(gen, device, chunk_rows, backend):
    """ignore_index may be a valid class id: tokens with that label are ignored, others kept."""
    V = 97
    tuned = chunk_rows(3, V)
    case = make_case(gen, (37,), 19, V, device=device, ignore="none", ignore_index=0)
    case.labels[::3] = 0
    check_parity(case, gen, tol=TOL[torch.float32], backend=backend, reduction="none", **tuned)
    assert case.n_kept < 37


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_logits_are_stable(gen, device, chunk_rows, backend):
    """Logits in the hundreds: no overflow, same value and grads as fp64.

    An fp32 logit or lse near 200 carries an absolute rounding error of ~1.5e-5, so
    p = exp(z - lse) is only ~1e-5..1e-4 relative accurate: tolerance 1e-4, not 1e-5.
    Overflow or a missing max-subtraction would give inf/nan or errors of order 1."""
    V = 97
    tuned = chunk_rows(3, V)
    case = make_case(gen, (37,), 19, V, device=device, bias=True, logit_std=200.0)
    check_parity(
        case,
        gen,
        tol=1e-4,
        backend=backend,
        z_loss_scale=1e-4,
        return_z_loss=True,
        label_smoothing=0.1,
        **tuned,
    )


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
def test_backend_auto_and_explicit_agree_with_reference(gen, device, backend):
    case = make_case(gen, (2, 5), 19, 97, device=device, bias=True)
    check_parity(case, gen, tol=TOL[torch.float32], backend=backend, **COMBINED)


@pytest.mark.parametrize("case_id", ["plain", "combined_mean", "combined_none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_balanced_chunks_parity(gen, device, backend, case_id):
    """``Tuning(balanced_chunks=True)``: a budget of 12 fp32 logit rows splits 37 tokens into 4
    chunks of 10 rows (budget-sized chunks would be 12, 12, 12 and 1)."""
    from liger_patch.ops.core.budget import PER_TOKEN_BYTES, SLACK_BYTES, balanced_rows
    from liger_patch.ops.core.tuning import Tuning

    case_kw, op_kw = OPTION_CASES[case_id]
    V, N = 97, 37
    assert balanced_rows(N, 12) == 10
    budget = SLACK_BYTES + PER_TOKEN_BYTES * N + 12 * 4 * V
    case = make_case(gen, (N,), 19, V, device=device, **case_kw)
    check_parity(
        case,
        gen,
        tol=TOL[torch.float32],
        backend=backend,
        memory_budget=budget,
        tuning=Tuning(balanced_chunks=True),
        **materialize_options(op_kw, device, V),
    )
