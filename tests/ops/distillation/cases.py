"""What the distillation tests share: the fp64 dense reference, case builders, the memory budget
that forces chunks of a given size on either backend, and the check of the op against the
reference (values and the student's gradients, with the floor that fp32 rounding of the logits
alone allows)."""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import liger_patch as lp
from liger_patch.ops.core.backends import pick
from liger_patch.ops.core.budget import PER_TOKEN_BYTES, SLACK_BYTES
from liger_patch.ops.distillation.chunks import Head, Side
from liger_patch.ops.distillation.operator import chunk_math
from liger_patch.ops.distillation.options import build_distill_options
from tests.op_helpers import TOL, ignore_mask

LEAD, HS, HT, V = (2, 7), 9, 12, 37
BETAS = [0.0, 0.3, 0.5, 1.0]
FP32 = TOL[torch.float32]
STUDENT = ("student_hidden", "student_weight", "student_bias")


# ---------------------------------------------------------------- the reference


def final_logits(hidden, weight, bias, scale, cap):
    """softcap(s * (W h + b)) in fp64, (tokens, V)."""
    x = hidden.reshape(-1, hidden.shape[-1]).double() @ weight.double().T
    if bias is not None:
        x = x + bias.double()
    return divergence_input(x, scale, cap)


def divergence_input(x, scale, cap):
    """softcap(s * x) in fp64 for raw logits ``x``."""
    x = x.double()
    if scale is not None:
        x = x * scale
    return x if cap is None else cap * torch.tanh(x / cap)


def reference_rows(zs, zt, labels, *, beta=0.0, temperature=1.0, ce_weight=0.0, ignore_index=-100):
    """Each token's loss (0 where ignored) from the final logits ``zs``, ``zt`` (tokens, V)."""
    log_ps = F.log_softmax(zs / temperature, dim=-1)
    log_pt = F.log_softmax(zt / temperature, dim=-1)
    ps, pt = log_ps.exp(), log_pt.exp()
    if beta == 0:
        div = (pt * (log_pt - log_ps)).sum(-1)
    elif beta == 1:
        div = (ps * (log_ps - log_pt)).sum(-1)
    else:
        log_m = ((1 - beta) * ps + beta * pt).log()
        div = beta * (pt * (log_pt - log_m)).sum(-1) + (1 - beta) * (ps * (log_ps - log_m)).sum(-1)
    y = labels.reshape(-1)
    keep = y != ignore_index
    ce = torch.logsumexp(zs, -1) - zs.gather(-1, torch.where(keep, y, 0)[:, None]).squeeze(-1)
    return torch.where(keep, (1 - ce_weight) * div + ce_weight * ce, 0.0)


def reduce_reference(rows, labels, reduction="mean", num_items_in_batch=None, ignore_index=-100):
    if reduction == "none":
        return rows.reshape(labels.shape)
    if reduction == "sum":
        return rows.sum()
    keep = labels.reshape(-1) != ignore_index
    divisor = keep.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch)
    return rows.sum() / (divisor.double() if float(divisor) != 0 else 1.0)


def reference_distill(
    student_hidden,
    student_weight,
    teacher_hidden,
    teacher_weight,
    labels,
    student_bias=None,
    teacher_bias=None,
    *,
    beta=0.0,
    temperature=1.0,
    ce_weight=0.0,
    ignore_index=-100,
    reduction="mean",
    num_items_in_batch=None,
    student_softcap=None,
    teacher_softcap=None,
    student_logit_scale=None,
    teacher_logit_scale=None,
):
    """The loss in fp64 with the full logits, from the math (docs/distillation.md):
    differentiable with respect to whatever requires grad."""
    zs = final_logits(student_hidden, student_weight, student_bias, student_logit_scale, student_softcap)
    zt = final_logits(teacher_hidden, teacher_weight, teacher_bias, teacher_logit_scale, teacher_softcap)
    rows = reference_rows(
        zs, zt, labels, beta=beta, temperature=temperature, ce_weight=ce_weight, ignore_index=ignore_index
    )
    return reduce_reference(rows, labels, reduction, num_items_in_batch, ignore_index)


# ---------------------------------------------------------------- cases


def on_device(case: dict, device) -> dict:
    """The case's tensors moved to ``device`` (the student's float tensors new leaves that require
    grad as before). Cases are drawn on the CPU from a seeded generator, so a test draws the same
    values on every device."""
    return {
        k: v if v is None else v.detach().to(device).requires_grad_(v.requires_grad) for k, v in case.items()
    }


def make_case(
    gen,
    lead=LEAD,
    hs=HS,
    ht=HT,
    vocab=V,
    *,
    dtype=torch.float32,
    bias=True,
    ignore="mixed",
    spread=2.5,
    device="cpu",
):
    """Student and teacher tensors on ``device`` (the student's require grad), labels with
    ``ignore`` tokens."""
    n = math.prod(lead)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[ignore_mask(ignore, n, gen)] = -100
    case = dict(
        student_hidden=rand(*lead, hs).requires_grad_(),
        student_weight=rand(vocab, hs, scale=spread / math.sqrt(hs)).requires_grad_(),
        teacher_hidden=rand(*lead, ht),
        teacher_weight=rand(vocab, ht, scale=spread / math.sqrt(ht)),
        labels=labels.reshape(lead),
        student_bias=rand(vocab, scale=0.5).requires_grad_() if bias else None,
        teacher_bias=rand(vocab, scale=0.5) if bias else None,
    )
    return on_device(case, device)


def correlated_case(
    gen, n: int, hidden: int, vocab: int, rho: float, dtype=torch.bfloat16, spread=4.0, device="cpu"
):
    """A student and a teacher that read the same hidden states through weights correlated at
    ``rho`` (the teacher's ``rho W_s + sqrt(1 - rho^2) W_noise``), so their logits agree closely
    and the divergence's gradient p_s - p_t is a small difference; every fifth token ignored."""
    student_weight = torch.randn(vocab, hidden, generator=gen) * spread / math.sqrt(hidden)
    noise = torch.randn(vocab, hidden, generator=gen) * spread / math.sqrt(hidden)
    hidden_states = torch.randn(n, hidden, generator=gen).to(dtype)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[::5] = -100
    case = dict(
        student_hidden=hidden_states.clone().requires_grad_(),
        student_weight=student_weight.to(dtype).requires_grad_(),
        teacher_hidden=hidden_states,
        teacher_weight=(rho * student_weight + math.sqrt(1 - rho**2) * noise).to(dtype),
        labels=labels,
        student_bias=None,
        teacher_bias=None,
    )
    return on_device(case, device)


def with_dtype(case: dict, dtype: torch.dtype) -> dict:
    """Copies of the case's float tensors in ``dtype`` (new leaves, requiring grad as before)."""
    return {
        k: v.detach().to(dtype).requires_grad_(v.requires_grad)
        if v is not None and v.is_floating_point()
        else v
        for k, v in case.items()
    }


def sides(case: dict) -> tuple[Side, Side]:
    """The case's student and teacher as the chunk GEMMs read them."""

    def side(name: str) -> Side:
        hidden = case[f"{name}_hidden"].detach()
        bias = case[f"{name}_bias"]
        return Side.of(
            Head(
                hidden.reshape(-1, hidden.shape[-1]),
                case[f"{name}_weight"].detach(),
                None if bias is None else bias.detach(),
            )
        )

    return side("student"), side("teacher")


def row_bytes(case: dict, backend: str, **opts) -> int:
    """Working bytes per row of a chunk of ``case`` that computes gradients over gathered rows
    (the most a row takes) on ``backend``."""
    math_ = chunk_math(pick(backend, case["labels"].device))
    student, teacher = sides(case)
    options = build_distill_options(backend=backend, **opts)
    return math_.row_bytes(case["student_weight"].shape[0], student, teacher, options, True, True)


def budget_for(rows: int, case: dict, backend: str = "torch", **opts) -> int:
    """The memory budget whose working bytes give chunks of exactly ``rows`` kept tokens (a chunk
    that computes no gradient, or walks every row, may take more)."""
    n = case["labels"].numel()
    return SLACK_BYTES + PER_TOKEN_BYTES * n + rows * row_bytes(case, backend, **opts)


# ---------------------------------------------------------------- checks


def loss_and_grads(fn, case, upstream, **opts):
    """``fn``'s loss and the student's gradients of ``sum(loss * upstream)``."""
    leaves = {k: case[k] for k in STUDENT if case[k] is not None and case[k].requires_grad}
    loss = fn(**case, **opts)
    grads = torch.autograd.grad((loss * upstream).sum(), list(leaves.values()))
    return loss, dict(zip(leaves, grads, strict=True))


def rounding_floors(case: dict, upstream: torch.Tensor, opts: dict) -> dict[str, torch.Tensor]:
    """What fp32 rounding of the logits alone may change, as absolute errors per element (fp64).

    A final logit a = z / T is computed to about eps |a|, which moves each log-prob of its row by
    up to eps max_v |a|: the token's loss by that much, and d loss / d x_v by that times
    (p_s + p_t + p_ce)_v and the chain's scale. Negligible unless the divergence or its gradient
    is formed by cancellation (a student close to its teacher), where fp32 cannot do better."""
    with torch.no_grad():
        t = opts.get("temperature", 1.0)
        s = abs(opts.get("student_logit_scale") or 1.0)
        zs, zt = (
            final_logits(
                *(case[f"{side}_{k}"] for k in ("hidden", "weight", "bias")),
                opts.get(f"{side}_logit_scale"),
                opts.get(f"{side}_softcap"),
            )
            for side in ("student", "teacher")
        )
        hidden = case["student_hidden"].reshape(zs.shape[0], case["student_hidden"].shape[-1]).double()
        keep = (case["labels"].reshape(-1) != opts.get("ignore_index", -100)).double()
        divisor = opts.get("num_items_in_batch") or keep.sum().clamp(min=1)
        row_weight = keep / float(divisor) if opts.get("reduction", "mean") == "mean" else keep
        row_err = 8 * torch.finfo(torch.float32).eps * (1 + (zs / t).abs().amax(-1) + (zt / t).abs().amax(-1))
        p = (zs / t).softmax(-1) + (zt / t).softmax(-1) + zs.softmax(-1)
        coef = row_weight * row_err * upstream.double().expand(case["labels"].shape).reshape(-1).abs()
        per_logit = coef[:, None] * p * max(s / t, s)
        loss = row_weight * row_err
        floors = {
            "loss": loss.reshape(case["labels"].shape) if opts.get("reduction") == "none" else loss.sum(),
            "student_hidden": (per_logit @ case["student_weight"].double().abs()).reshape(
                case["student_hidden"].shape
            ),
            "student_weight": per_logit.T @ hidden.abs(),
            "student_bias": per_logit.sum(0),
        }
    return floors


def assert_near(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float, floor) -> None:
    """|actual - expected| <= tol (|expected| + max |expected|) + floor, elementwise."""
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert torch.isfinite(a).all(), f"{name}: non-finite values"
    bound = tol * (e.abs() + (e.abs().max() if e.numel() else 0.0)) + floor
    worst = (a - e).abs() - bound
    assert not (worst > 0).any(), (
        f"{name}: {int((worst > 0).sum())}/{e.numel()} elements off; worst by {float(worst.max()):.3g} "
        f"(max |expected| {float(e.abs().max()):.4g})"
    )


MATH_OPTIONS = (
    "beta",
    "temperature",
    "ce_weight",
    "student_softcap",
    "teacher_softcap",
    "student_logit_scale",
    "teacher_logit_scale",
)


def check(case, gen, *, backend="torch", tol=FP32, rows=4, upstream=None, **opts):
    """The op on ``backend`` (chunks of ``rows`` tokens) against the reference: loss and the
    student's gradients under ``upstream``, else a random upstream gradient (per token for "none")."""
    ref_case = with_dtype(case, torch.float64)
    ref_loss = reference_distill(**ref_case, **opts)
    if upstream is None:
        upstream = torch.rand(ref_loss.shape, generator=gen, dtype=torch.float64) + 0.5
    upstream = torch.as_tensor(upstream, dtype=torch.float64).to(ref_loss.device)
    ref, ref_grads = loss_and_grads(reference_distill, ref_case, upstream, **opts)
    floors = rounding_floors(ref_case, upstream, opts)
    budget = budget_for(rows, case, backend, **{k: v for k, v in opts.items() if k in MATH_OPTIONS})
    loss, grads = loss_and_grads(
        lp.fused_linear_distillation, case, upstream.float(), memory_budget=budget, backend=backend, **opts
    )
    assert loss.dtype == torch.float32
    assert_near("loss", loss, ref, tol, floors["loss"])
    for name, g in grads.items():
        assert g.dtype == case[name].dtype, name
        assert_near(f"grad {name}", g, ref_grads[name], tol, floors[name])
    return loss, grads


class LiveBytes(TorchDispatchMode):
    """The most bytes of tensors made by ops inside the mode that were alive at once. Views of
    ``inputs`` (a transposed weight, a slice of an index) are not new tensors: not counted."""

    def __init__(self, *inputs: torch.Tensor | None) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.sizes: dict[int, int] = {t.untyped_storage().data_ptr(): 0 for t in inputs if t is not None}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            storage = t.untyped_storage() if isinstance(t, torch.Tensor) else None
            if storage is None or storage.data_ptr() in self.sizes or storage.nbytes() == 0:
                continue
            ptr = storage.data_ptr()
            self.sizes[ptr] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._free, ptr)
        return out

    def _free(self, ptr: int) -> None:
        self.live -= self.sizes.pop(ptr, 0)
