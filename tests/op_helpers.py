"""Inputs, calls and comparisons shared by the op tests (tests/ops/).

Every case is built from a seeded torch.Generator (never zeros), in fp32, then rounded to the
dtype under test; the fp64 reference sees exactly the rounded values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch

import liger_patch as lp
from liger_patch.ops.core import call_graph, deferred_checks
from liger_patch.ops.cross_entropy.options import OUTPUT_OPTIONS, OptionKind, options_of_kind
from liger_patch.ops.reference import reference_flce

TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a model split over GPUs needs two")
BACKENDS = ["torch", "triton"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Relative tolerance (also used as a fraction of the largest reference value for atol).
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}

TENSOR_NAMES = ("hidden", "weight", "bias")
IGNORE_PATTERNS = [
    "none",
    "first",
    "last",
    "first_and_last",
    "all_but_one",
    "only_first_kept",
    "only_last_kept",
    "runs",
    "every_other",
    "half",
]


def ignore_mask(pattern: str, n: int, gen: torch.Generator) -> torch.Tensor:
    """Bool mask of the token positions to ignore (over the flattened tokens)."""
    m = torch.zeros(n, dtype=torch.bool)
    if n == 0 or pattern == "none":
        return m
    if pattern == "first":
        m[0] = True
    elif pattern == "last":
        m[-1] = True
    elif pattern == "first_and_last":
        m[0] = m[-1] = True
    elif pattern == "all":
        m[:] = True
    elif pattern == "all_but_one":
        m[:] = True
        m[int(torch.randint(1, max(n - 1, 2), (1,), generator=gen)) % n] = False
    elif pattern == "only_first_kept":
        m[1:] = True
    elif pattern == "only_last_kept":
        m[:-1] = True
    elif pattern == "runs":  # runs of different lengths, one touching each end
        for start, length in ((0, 3), (5, 1), (9, 6), (n - 4, 4)):
            m[max(start, 0) : max(start + length, 0)] = True
    elif pattern == "every_other":
        m[::2] = True
    elif pattern == "half":
        m = torch.rand(n, generator=gen) < 0.5
    elif pattern == "mixed":  # first, last, a run in the middle, ~20% at random
        m = torch.rand(n, generator=gen) < 0.2
        m[0] = m[-1] = True
        m[n // 3 : n // 3 + 4] = True
        if bool(m.all()):
            m[n // 2] = False
    else:
        raise ValueError(pattern)
    return m


@dataclasses.dataclass
class Case:
    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    bias: torch.Tensor | None
    ignore_index: int

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"hidden": self.hidden, "weight": self.weight}
        if self.bias is not None:
            out["bias"] = self.bias
        return out

    def grad_leaves(self) -> dict[str, torch.Tensor]:
        return {k: t for k, t in self.tensors().items() if t.requires_grad}

    @property
    def n_kept(self) -> int:
        return int((self.labels != self.ignore_index).sum())


def make_case(
    gen: torch.Generator,
    lead: tuple[int, ...],
    H: int,
    V: int,
    *,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    bias: bool = False,
    ignore: str = "mixed",
    ignore_index: int = -100,
    requires_grad=TENSOR_NAMES,
    logit_std: float = 2.0,
) -> Case:
    n = math.prod(lead)
    hidden = torch.randn(n, H, generator=gen).reshape(*lead, H)
    weight = torch.randn(V, H, generator=gen) * (logit_std / math.sqrt(H))
    b = torch.randn(V, generator=gen) * 0.5 if bias else None
    labels = torch.randint(0, V, (n,), generator=gen)
    labels[ignore_mask(ignore, n, gen)] = ignore_index
    labels = labels.reshape(lead)

    def prep(t, name):
        t = t.to(dtype).to(device)
        return t.requires_grad_(name in requires_grad)

    return Case(
        hidden=prep(hidden, "hidden"),
        weight=prep(weight, "weight"),
        labels=labels.to(device),
        bias=None if b is None else prep(b, "bias"),
        ignore_index=ignore_index,
    )


COMBINED = dict(label_smoothing=0.15, z_loss_scale=2e-2, softcap=4.0, logit_scale=1.6, return_z_loss=True)
RANDOM_CLASS_WEIGHT = ("random", 0.5)
"""``class_weight=`` in a case: weights drawn uniformly from [0.5, 1.5), one per class."""
OUTPUTS = dict(return_token_accuracy=True, return_predicted_tokens=True, return_entropy=True)
ALL_OPTIONS = dict(COMBINED, **OUTPUTS, class_weight=RANDOM_CLASS_WEIGHT)
"""Every option at once but token scaling: that shrinks the loss's gradient by p_y, leaving the
entropy's (a sum formed by cancellation) the largest part of grad_h, with an fp32 error of ~1e-5
of it at V = 1001 (tests/ops/cross_entropy/test_outputs.py checks that with its own floors)."""

# id -> (make_case kwargs, op kwargs): every option of the loss math (and class weights) and every
# output, one at a time, then combined. tests/ops/cross_entropy/test_parity.py runs them against
# the fp64 reference on both backends and tests/ops/cross_entropy/vocab_parallel_workers.py on a
# vocabulary-sharded head; tests/ops/cross_entropy/test_parity.py checks that they set every
# loss-math and output option of LossOptions.
OPTION_CASES = {
    "plain": ({}, {}),
    "bias": ({"bias": True}, {}),
    "ignore_index_-1": ({"ignore_index": -1}, {"ignore_index": -1}),
    "ignore_index_1000": ({"ignore_index": 1000}, {"ignore_index": 1000}),
    "ignore_index_in_vocab": ({"ignore_index": 7}, {"ignore_index": 7}),
    "reduction_sum": ({}, {"reduction": "sum"}),
    "reduction_none": ({}, {"reduction": "none"}),
    "num_items_int": ({}, {"num_items_in_batch": 50}),
    "num_items_int_tensor": ({}, {"num_items_in_batch": ("tensor", 23, torch.int64)}),
    "num_items_float_tensor": ({}, {"num_items_in_batch": ("tensor", 41.5, torch.float32)}),
    "label_smoothing": ({}, {"label_smoothing": 0.1}),
    "label_smoothing_1": ({}, {"label_smoothing": 1.0}),
    "z_loss": ({}, {"z_loss_scale": 2e-2, "return_z_loss": True}),
    "z_loss_not_returned": ({}, {"z_loss_scale": 2e-2}),
    "z_loss_none": ({}, {"z_loss_scale": 2e-2, "return_z_loss": True, "reduction": "none"}),
    "softcap": ({}, {"softcap": 4.0}),
    "softcap_tight": ({}, {"softcap": 0.7}),
    "logit_scale_up": ({}, {"logit_scale": 1.7}),
    "logit_scale_down": ({}, {"logit_scale": 0.25}),
    "softcap_and_scale": ({"bias": True}, {"softcap": 3.0, "logit_scale": 0.6}),
    "token_scaling": ({}, {"use_token_scaling": True}),
    "token_scaling_z_loss": ({}, {"use_token_scaling": True, "z_loss_scale": 2e-2, "return_z_loss": True}),
    "token_scaling_z_loss_none": (
        {},
        {"use_token_scaling": True, "z_loss_scale": 2e-2, "return_z_loss": True, "reduction": "none"},
    ),
    "class_weight": ({}, {"class_weight": RANDOM_CLASS_WEIGHT}),
    "class_weight_smoothing_sum": (
        {"bias": True},
        {"class_weight": RANDOM_CLASS_WEIGHT, "label_smoothing": 0.1, "reduction": "sum"},
    ),
    "outputs": ({}, dict(OUTPUTS)),
    "outputs_none": ({}, dict(OUTPUTS, reduction="none")),
    "combined_mean": ({"bias": True}, dict(COMBINED)),
    "combined_sum": ({"bias": True}, dict(COMBINED, reduction="sum")),
    "combined_none": ({"bias": True}, dict(COMBINED, reduction="none")),
    "combined_num_items": (
        {"bias": True, "ignore_index": -1},
        dict(COMBINED, ignore_index=-1, num_items_in_batch=("tensor", 61.0, torch.float32)),
    ),
    "all_options": ({"bias": True}, dict(ALL_OPTIONS)),
    "all_options_none": ({"bias": True}, dict(ALL_OPTIONS, reduction="none")),
}


def materialize_options(opts: dict, device, vocab: int | None = None) -> dict:
    """Options with num_items_in_batch given as ("tensor", value, dtype) made a tensor on the device,
    and ``RANDOM_CLASS_WEIGHT`` made ``vocab`` weights (parametrize ids must not hold tensors)."""
    out = dict(opts)
    n = out.get("num_items_in_batch")
    if isinstance(n, tuple):
        out["num_items_in_batch"] = torch.tensor(n[1], dtype=n[2], device=device)
    if out.get("class_weight") == RANDOM_CLASS_WEIGHT:
        low = RANDOM_CLASS_WEIGHT[1]
        gen = torch.Generator().manual_seed(vocab)
        out["class_weight"] = (torch.rand(vocab, generator=gen) + low).to(device)
    return out


def record_calls(monkeypatch, module, name: str, record=lambda args, kwargs, result: (args, kwargs, result)):
    """Wrap ``module.name`` (for this test) so that every call still runs and appends
    ``record(args, kwargs, result)`` to the returned list: how a test sees which path ran."""
    calls = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        calls.append(record(args, kwargs, result))
        return result

    monkeypatch.setattr(module, name, spy)
    return calls


def checks_taken_ahead(monkeypatch) -> list[bool]:
    """For each lookup of a label check begun ahead (``early_checks.take``) from now on in this
    test, whether it found one."""
    from liger_patch.ops.core import early_checks

    return record_calls(monkeypatch, early_checks, "take", lambda args, kwargs, result: result is not None)


def call_op(case: Case, **opts):
    opts.setdefault("ignore_index", case.ignore_index)
    return lp.fused_linear_cross_entropy(case.hidden, case.weight, case.labels, case.bias, **opts)


def call_raw(hidden, weight, labels, bias=None, **opts):
    return lp.fused_linear_cross_entropy(hidden, weight, labels, bias, **opts)


NOT_MATH = options_of_kind(OptionKind.OUTPUT, OptionKind.RUNTIME)
"""Options the fp64 reference does not take: outputs, and how the op runs."""


def reference_for(case: Case, **opts):
    """fp64 reference on CPU. Returns (loss, z_loss, leaves) where leaves mirror requires_grad."""
    for how_not_what in NOT_MATH:
        opts.pop(how_not_what, None)
    opts.setdefault("ignore_index", case.ignore_index)
    leaves = {
        k: t.detach().cpu().to(torch.float64).requires_grad_(t.requires_grad)
        for k, t in case.tensors().items()
    }
    loss, z = reference_flce(
        leaves["hidden"], leaves["weight"], case.labels.cpu(), leaves.get("bias"), **opts
    )
    return loss, z, leaves


def fresh_values(case: Case, gen: torch.Generator, reignore: bool = False) -> None:
    """New values in ``case``'s own tensors (the same tensors: the same signature) and new kept
    labels; with ``reignore`` the ignored positions are drawn anew too (as many as before), so
    each row's weight in the reduced loss changes from call to call."""
    with torch.no_grad():
        for t in case.tensors().values():
            t.copy_((torch.randn(t.shape, generator=gen) * t.float().std().cpu()).to(t.device, t.dtype))
    kept = (case.labels != case.ignore_index).cpu()
    if reignore:
        kept = kept.flatten()[torch.randperm(kept.numel(), generator=gen)].view(kept.shape)
    fresh = torch.randint(0, case.weight.shape[0], case.labels.shape, generator=gen)
    case.labels.copy_(torch.where(kept, fresh, case.ignore_index).to(case.labels.device))


def assert_same_bits(a, b) -> None:
    """Two sequences of tensors equal bit for bit (same dtypes and shapes)."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y), (x, y)


def upstream_like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random upstream gradient: a scalar in [0.5, 1.5) for scalars, N(0,1) otherwise."""
    if t.dim() == 0:
        return 0.5 + torch.rand((), generator=gen, dtype=torch.float64)
    return torch.randn(t.shape, generator=gen, dtype=torch.float64)


def assert_close(
    name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float, floor: float = 0.0
) -> None:
    """``actual`` equals ``expected`` to ``tol`` relative to the largest expected magnitude; the
    absolute tolerance is at least ``floor`` (for values formed by cancellation, such as a loss
    far below the logits it is the difference of)."""
    assert actual is not None, f"{name}: got None"
    a = actual.detach().cpu().to(torch.float64)
    e = expected.detach().cpu().to(torch.float64)
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != reference {tuple(e.shape)}"
    assert torch.isfinite(a).all(), f"{name}: non-finite values"
    scale = float(e.abs().max()) if e.numel() else 0.0
    atol = max(tol * max(scale, 1e-6), floor)
    torch.testing.assert_close(a, e, rtol=tol, atol=atol, msg=lambda m: f"{name}: {m}")


def check_parity(case: Case, gen: torch.Generator, *, tol: float, z_weight=None, **opts) -> None:
    """Forward + backward through the op with random upstream gradients and compare the loss (and
    z_loss) and the gradients of every input that requires grad with the fp64 reference. Other
    outputs asked for must come back, by name (tests/ops/cross_entropy/test_outputs.py checks their values).

    z_weight: when return_z_loss=True, also backprop z_loss with this upstream (None: random)."""
    out = call_op(case, **opts)
    asked = tuple(name for name, flag in OUTPUT_FLAGS.items() if opts.get(flag))
    if asked:
        assert isinstance(out, tuple) and out._fields == ("loss", *asked), f"expected (loss, {asked})"
        loss, z = out.loss, getattr(out, "z_loss", None)
    else:
        assert isinstance(out, torch.Tensor), "no output asked for: the op must return a tensor"
        loss, z = out, None

    ref_loss, ref_z, leaves = reference_for(case, **opts)
    assert_close("loss", loss, ref_loss, tol)
    if z is not None:
        assert_close("z_loss", z, ref_z, tol)

    g = upstream_like(ref_loss, gen)
    ref_obj = (ref_loss * g).sum()
    obj = (loss * g.to(loss.device, loss.dtype)).sum()
    if z is not None:
        gz = (
            upstream_like(ref_z, gen)
            if z_weight is None
            else torch.tensor(float(z_weight), dtype=torch.float64)
        )
        ref_obj = ref_obj + (ref_z * gz).sum()
        obj = obj + (z * gz.to(z.device, z.dtype)).sum()

    grad_leaves = case.grad_leaves()
    if not grad_leaves:
        return
    obj.backward()
    ref_grads = torch.autograd.grad(ref_obj, [leaves[k] for k in grad_leaves], allow_unused=True)
    for (name, t), rg in zip(grad_leaves.items(), ref_grads, strict=True):
        assert t.grad is not None, f"grad of {name} is None"
        assert t.grad.dtype == t.dtype, f"grad of {name} has dtype {t.grad.dtype}, input {t.dtype}"
        if rg is None:
            rg = torch.zeros_like(leaves[name])
        assert_close(f"grad {name}", t.grad, rg, tol)


# ---------------------------------------------------------------- optional outputs (additive)

OUTPUT_FLAGS = {flag.removeprefix("return_"): flag for flag in OUTPUT_OPTIONS}
"""Each optional output of the op (in the order the named tuple lists them) and its flag."""


def reference_outputs_for(case: Case, **opts) -> dict:
    """Every output of the op in fp64 on CPU from one set of fp64 leaves (so gradients of any
    combination can be compared): ``loss``, ``z_loss``, ``token_accuracy``, ``predicted_tokens``,
    ``entropy`` (reduced as the op reduces them), and ``correct`` (per token, bool), ``logits``
    (the final fp64 logits, tokens x V, detached) and ``leaves`` (mirroring requires_grad).
    ``class_weight`` may be a tensor of any float dtype and layout: its values are used."""
    from liger_patch.ops.reference import reference_token_outputs

    for how_not_what in NOT_MATH:
        opts.pop(how_not_what, None)
    opts.setdefault("ignore_index", case.ignore_index)
    leaves = {
        k: t.detach().cpu().to(torch.float64).requires_grad_(t.requires_grad)
        for k, t in case.tensors().items()
    }
    cw = opts.get("class_weight")
    if cw is not None:
        opts["class_weight"] = cw.detach().cpu().to(torch.float64)
    labels = case.labels.cpu()
    loss, z = reference_flce(leaves["hidden"], leaves["weight"], labels, leaves.get("bias"), **opts)
    tok = reference_token_outputs(
        leaves["hidden"],
        leaves["weight"],
        labels,
        leaves.get("bias"),
        ignore_index=opts["ignore_index"],
        softcap=opts.get("softcap"),
        logit_scale=opts.get("logit_scale"),
    )
    reduction = opts.get("reduction", "mean")
    correct = tok.correct.to(torch.float64)
    entropy = tok.entropy
    if reduction != "none":
        kept = case.n_kept
        correct = correct.sum() / kept if kept else correct.sum() * 0.0
        entropy = entropy.sum() / kept if kept else entropy.sum() * 0.0
    return {
        "loss": loss,
        "z_loss": z,
        "token_accuracy": correct,
        "predicted_tokens": tok.predicted,
        "entropy": entropy,
        "correct": tok.correct,
        "logits": tok.logits,
        "leaves": leaves,
    }


def near_max(logits: torch.Tensor, picked: torch.Tensor, gap_tol) -> torch.Tensor:
    """Per row: whether column ``picked`` is within ``gap_tol`` (a number or per-row tensor) of
    the row's largest logit. ``logits`` (rows, V) fp64, ``picked`` (rows,) valid column ids."""
    top = logits.amax(dim=-1)
    return logits.gather(1, picked.reshape(-1, 1)).squeeze(1) >= top - gap_tol


def top2_gap(logits: torch.Tensor) -> torch.Tensor:
    """Per row: largest logit minus the second largest (inf for V = 1)."""
    if logits.shape[-1] < 2:
        return torch.full(logits.shape[:1], float("inf"), dtype=logits.dtype)
    top = logits.topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def examples(share: float):
    """A hypothesis ``settings`` with this test's share of the profile's max_examples (the
    profiles live in tests/conftest.py; the Triton interpreter is slow)."""
    from hypothesis import settings

    return settings(max_examples=max(1, round(settings.default.max_examples * share)))


def chunk_call(
    backend,
    hidden,
    weight,
    bias,
    labels,
    opts,
    *,
    budget_bytes,
    need_hidden=False,
    need_weight=False,
    need_bias=False,
    **fields,
):
    """A ``ChunkCall`` from the flat arguments the chunk loops took before issue 42 (``fields``: the
    call's other fields by name: ``coef_ce``, ``lse_in``, ``outputs``, ``row_index``, ...)."""
    from liger_patch.ops.cross_entropy.chunk_call import ChunkCall, GradsWanted, HeadInputs

    return ChunkCall(
        backend=backend,
        inputs=HeadInputs(hidden, weight, bias),
        labels=labels,
        opts=opts,
        budget_bytes=budget_bytes,
        wanted=GradsWanted(need_hidden, need_weight, need_bias),
        **fields,
    )


def call_rows(
    kernel,
    logits,
    labels,
    opts,
    grad=None,
    coef_ce=None,
    coef_z=None,
    lse_in=None,
    col_offset=0,
    vocab_total=None,
    *,
    class_weight=None,
    outputs=None,
    entropy_grad=None,
    partials=None,
):
    """A row kernel (``ce_rows_torch``, ``ce_rows_triton``) called with the flat arguments it took
    before issue 42, turned into its records (``row_io``). Coefficients without ``grad`` are not
    passed (a kernel reads them only to write a gradient)."""
    from liger_patch.ops.cross_entropy.row_io import ChunkRecords, GivenLse, RowGrad

    extra = {} if partials is None else {"partials": partials}
    return kernel(
        logits,
        labels,
        opts,
        grad=None if grad is None else RowGrad(grad, coef_ce, coef_z),
        given=None if lse_in is None else GivenLse(lse_in, col_offset, vocab_total),
        records=ChunkRecords(class_weight, outputs, entropy_grad),
        **extra,
    )


def capture_step(step, static: dict, leaves: tuple[str, ...]):
    """``step`` (an op's forward and backward on the tensors of ``static``, returning its detached
    outputs: a tensor or a tuple) captured in a ``torch.cuda.CUDAGraph``, and a ``replay(values)``
    that copies ``values`` into the static tensors, replays and gives the outputs and the
    ``leaves``' gradients (clones). The capture-safety tests of both ops run it."""
    # Warm-up on a side stream (kernel compilation, the allocator's first blocks; the label check
    # synchronises here, outside capture), as torch.cuda.graphs' whole-network example does.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for name in leaves:
                static[name].grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    # Gradients set to None: the captured backward allocates them from the graph's pool, and every
    # replay writes them again in place.
    for name in leaves:
        static[name].grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)

    def replay(values: dict) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
        with torch.no_grad():
            for name, value in values.items():
                static[name].copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        return tuple(o.clone() for o in outputs), {n: static[n].grad.clone() for n in leaves}

    return replay


@contextlib.contextmanager
def raises_by_step(exc, match=None):
    """``pytest.raises`` for a bad label or ``num_items_in_batch``: raised by the call itself, or,
    on CUDA when the GPU had not checked the labels by the time the call needed them, by the
    deferred check (``core/deferred_checks.py``) before any optimizer step."""
    with pytest.raises(exc, match=match):
        yield
        deferred_checks.raise_pending()


def count_replays(monkeypatch) -> list:
    """One entry per replay of a CUDA graph of the ops' own (``core/call_graph.py``) begun in this
    test (counted before it runs: a replay may raise a label check's error; nothing of its
    results kept: a kept output would stop the next replay)."""
    replays, real = [], call_graph.CallGraph.replay

    def spy(self, inputs):
        replays.append(None)
        return real(self, inputs)

    monkeypatch.setattr(call_graph.CallGraph, "replay", spy)
    return replays


def warm_capture_stream(device) -> None:
    """A first capture in this process, then every plan and graph dropped: what the side stream
    graphs are captured on sets up at its first capture (cuBLAS's workspaces, kept for the
    stream, not by a graph) is made, so that memory measured around a later capture is what its
    graph keeps."""
    from liger_patch.ops.core.tuning import Tuning
    from liger_patch.ops.cross_entropy import one_chunk

    hidden = torch.randn(8, 64, device=device, dtype=torch.bfloat16)
    weight = torch.randn(96, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 96, (8,), device=device)
    for _ in range(2):
        lp.fused_linear_cross_entropy(hidden, weight, labels, tuning=Tuning(call_graphs=True)).backward()
    one_chunk.forget()


def embedded_head_sums(device, tied: bool, vocab: int, step, tunings) -> tuple[dict, dict, dict, int]:
    """A head in small, per tuning of ``tunings`` (graphs on, then off): an embedding table and a
    head weight of ``vocab`` rows of width 1024 (bf16, the same tensor where ``tied``), six
    micro-batches ``step(table, weight, tuning, gen)`` (each makes its hidden states from the
    table and runs forward and backward with fresh inputs from ``gen``, seeded alike per
    tuning), the gradients cleared after the second (an optimizer step's ``zero_grad``). Returns
    each tuning's gradient sums (table, weight), the memory its run left allocated beyond them
    (what its graphs keep), the bytes its graphs' pools reserve (``graph_pool_bytes``), and the
    bytes of one such gradient."""
    from liger_patch.ops.core import call_graph

    gen = torch.Generator().manual_seed(3)
    table0 = torch.randn(vocab, 1024, generator=gen).to(device, torch.bfloat16) / 8
    weight0 = table0 if tied else torch.randn(vocab, 1024, generator=gen).to(device, torch.bfloat16) / 8
    sums, held, pools = {}, {}, {}
    for tuning in tunings:
        before = torch.cuda.memory_allocated(device)
        table = table0.clone().requires_grad_()
        weight = table if tied else weight0.clone().requires_grad_()
        inputs = torch.Generator().manual_seed(7)
        for call in range(6):
            if call == 2:
                table.grad = weight.grad = None
            step(table, weight, tuning, inputs)
        sums[tuning] = (table.grad.clone(), weight.grad.clone())
        del table, weight
        torch.cuda.synchronize(device)
        held[tuning] = torch.cuda.memory_allocated(device) - before - 2 * table0.nbytes
        pools[tuning] = graph_pool_bytes(call_graph._GRAPHS.graphs())
    return sums, held, pools, table0.nbytes


def graph_pool_bytes(graphs) -> int:
    """The bytes the memory pools of ``graphs`` (``call_graph.CallGraph``) reserve: what they
    hold from every other allocation, free blocks included."""
    ids = {tuple(g.pool.id) for g in graphs}
    segments = torch.cuda.memory_snapshot()
    return sum(seg["total_size"] for seg in segments if tuple(seg["segment_pool_id"]) in ids)


def needs_gpu_for_graphs(device) -> None:
    """Skip where ``device`` is not CUDA: the ops capture graphs of their own only there."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU: this runs in tests/gpu_suite.sh")
