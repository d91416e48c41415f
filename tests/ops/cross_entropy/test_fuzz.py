"""Property-based fuzzing (hypothesis) of lp.fused_linear_cross_entropy against the fp64
reference (tests/reference.py): loss, z_loss, and the gradients of hidden, weight and bias.

Every example is a ``Spec`` (printed by hypothesis when it fails: it is a complete reproducer,
since every tensor comes from a torch.Generator seeded with the drawn ``seed``). Drawn:

- backend: "torch", and "triton" under the Triton interpreter (smaller shapes: it is slow);
- shapes: hidden (..., H) with 0-3 leading dims (sizes 0 and 1 included), H in 1..40, V in
  1..130 (odd sizes, sizes not dividing 16/32/64); H = 0 in its own property;
- dtype fp32/bf16/fp16 (tolerances: op_helpers.TOL), logits_dtype None or fp32;
- reduction mean/sum/none, with a random upstream gradient (a random tensor for "none", a
  random scalar, 1 included, for mean/sum), and an upstream on z_loss (return_z_loss=True);
- options: label_smoothing, z_loss_scale, softcap, logit_scale (negative too), bias on/off,
  ignore_index outside [0, V) or equal to a valid class (those labels are then ignored);
- num_items_in_batch: None, int, float, int tensor, float tensor, and 0 when nothing is kept;
- ignored tokens: every op_helpers.ignore_mask pattern, "all" included;
- layouts: hidden, weight, bias and labels contiguous, strided, transposed, padded, with a
  storage offset, expanded (stride 0), leaves made non-contiguous by empty_strided + copy_,
  and aliased (hidden = weight[:N], bias = weight[:, 0]). Gradients are compared on the leaf
  tensors behind the views, so expanded and aliased inputs sum their contributions;
- which leaves require grad; chunking through ``memory_budget`` (bytes for ``rows`` logits rows
  per chunk) and the two-pass path (its 512-row threshold lowered to ``rows + 1``; one property
  takes it at the real threshold).

Tolerance: |op - ref| <= tol * (|ref| + max(max |ref|, m)) elementwise, where m is the same
gradient (or loss) with every term in absolute value: results that cancel to ~0 (V = 1, an
expanded bias) get the error scale of the terms they are summed from.

Run (the default profile "ci" is derandomized and bounded; profiles live in tests/conftest.py):

    .venv/bin/pytest tests/ops/cross_entropy/test_fuzz.py                            # ci: fixed examples
    HYPOTHESIS_PROFILE=dev .venv/bin/pytest tests/ops/cross_entropy/test_fuzz.py     # random, 3x the examples
    HYPOTHESIS_PROFILE=long .venv/bin/pytest tests/ops/cross_entropy/test_fuzz.py    # random, 15x (thousands)

Add ``--hypothesis-show-statistics`` to see which paths ran (chunk counts, two-pass, fused GEMM)
and ``--hypothesis-seed=N`` to replay a random run.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import event, given, note
from hypothesis import strategies as st
from op_helpers import IGNORE_PATTERNS, TOL, examples, ignore_mask, raises_by_step

import liger_patch as lp
from liger_patch.ops.core.budget import PER_TOKEN_BYTES, SLACK_BYTES
from liger_patch.ops.core.tuning import DEFAULT_TUNING, Tuning
from liger_patch.ops.cross_entropy import chunks as chunked
from liger_patch.ops.reference import reference_flce

# Leaves made column-major get contiguous gradients from autograd's reshape: torch says so, rightly.
pytestmark = [
    pytest.mark.filterwarnings("ignore:grad and param do not obey the gradient layout contract"),
    pytest.mark.usefixtures("one_cpu_thread"),
]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Inputs live here: the GPU where there is one (the Triton kernels natively), else the CPU (the
# Triton backend under the interpreter, tests/conftest.py). Random values come from CPU generators.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
REDUCTIONS = ("mean", "sum", "none")


# ---------------------------------------------------------------- layouts
# Each layout: (shape of the leaf tensor, view of the leaf that is passed to the op). The fp64
# reference applies the same view to an fp64 copy of the leaf.

Shape = tuple[int, ...]


def _hidden_layouts(lead: Shape, H: int) -> dict[str, tuple[Shape, Callable]]:
    layouts = {
        "contiguous": ((*lead, H), lambda t: t),
        "transposed": ((H, *lead), lambda t: t.movedim(0, -1)),  # x.t() of an (H, N) tensor
        "row_padded": ((*lead, H + 3), lambda t: t[..., 2 : H + 2]),  # row stride > H, offset 2
        "expanded_tokens": ((H,), lambda t: t.expand(*lead, H)),  # every token the same row
        "expanded_features": ((*lead, 1), lambda t: t.expand(*lead, H)),  # stride 0 along H
        "strided_leaf": ((*lead, H), lambda t: t),  # the leaf itself is column-major
    }
    if lead:
        layouts["strided_tokens"] = ((2 * lead[0] + 1, *lead[1:], H), lambda t: t[1::2])
    return layouts


def _weight_layouts(V: int, H: int) -> dict[str, tuple[Shape, Callable]]:
    return {
        "contiguous": ((V, H), lambda t: t),
        "transposed": ((H, V), lambda t: t.t()),  # lm_head stored as (H, V)
        "strided_columns": ((V, 2 * H), lambda t: t[:, ::2]),
        "strided_rows": ((2 * V + 1, H), lambda t: t[1::2]),
        "offset": ((V + 1, H + 3), lambda t: t[1:, 3:]),
        "expanded_columns": ((V, 1), lambda t: t.expand(V, H)),
        "strided_leaf": ((V, H), lambda t: t),
    }


def _bias_layouts(V: int) -> dict[str, tuple[Shape, Callable]]:
    return {
        "contiguous": ((V,), lambda t: t),
        "strided": ((2 * V,), lambda t: t[::2]),  # randn(2V)[::2]
        "offset": ((V + 1,), lambda t: t[1:]),
        "expanded_scalar": ((), lambda t: t.expand(V)),
        "strided_leaf": ((V,), lambda t: t),  # empty_strided((V,), (2,))
    }


ALIAS = "alias_weight"  # hidden = weight[:N] (hidden layout) or bias = weight[:, 0] (bias layout)


# ---------------------------------------------------------------- the drawn example


@dataclasses.dataclass
class Spec:
    """Everything one example is built from (hypothesis prints it for a failing example)."""

    backend: str
    dtype: torch.dtype
    lead: Shape
    H: int
    V: int
    seed: int
    logit_std: float
    hidden_layout: str
    weight_layout: str
    bias_layout: str | None  # None: no bias
    labels_layout: str
    labels_dtype: torch.dtype
    ignore: str  # an op_helpers.ignore_mask pattern
    ignore_index: int
    requires_grad: tuple[str, ...]  # among "hidden", "weight", "bias" (aliases follow weight)
    options: dict  # reduction, label_smoothing, z_loss_scale, softcap, logit_scale, ...
    num_items: tuple | None  # (kind, value): "int", "float", "int_tensor", "float_tensor"
    rows: int | None  # logits rows per chunk through memory_budget (None: the default budget)
    two_pass: bool  # lower the two-pass threshold to rows + 1
    loss_weight: float | None  # upstream scale on loss (None: only z_loss is backpropagated)
    z_weight: float | None  # upstream scale on z_loss (None: z_loss not backpropagated)
    accumulate: bool  # the leaves already hold a .grad, which the backward must add to

    @property
    def n(self) -> int:
        return math.prod(self.lead)


# ---------------------------------------------------------------- strategies


@st.composite
def lead_shapes(draw, max_tokens: int) -> Shape:
    """0-3 leading dims, sizes 0 and 1 included, at most max_tokens tokens in all."""
    ndim = draw(st.sampled_from([1, 2, 3, 1, 2, 0]))
    out, n = [], 1
    for i in range(ndim):
        room = max_tokens // n  # what the remaining dims may still multiply to
        fair = min(room, max(1, round(2 * room ** (1 / (ndim - i)))))  # balanced shapes
        # Mostly large: hypothesis favours tiny sizes anyway, and they hide most layout bugs.
        kind = draw(st.sampled_from(["tiny", "any", "large", "large", "large", "large"]))
        if kind == "tiny":
            d = min(fair, draw(st.sampled_from([1, 0, 2])))
        else:
            d = draw(st.integers(1 if kind == "any" else max(1, fair // 2), fair))
        out.append(d)
        n *= max(d, 1)
    return tuple(out)


def hidden_sizes() -> st.SearchStrategy[int]:
    """1..40: 1, odd sizes, and multiples of 4 (where the interpreter runs the fused logits GEMM)."""
    return st.sampled_from([1, 3, 5, 8, 16, 17, 32, 33]) | st.integers(1, 40)


def vocab_sizes() -> st.SearchStrategy[int]:
    """1..130: 1, odd sizes, sizes around powers of two, and multiples of 8 (fused GEMM)."""
    return st.sampled_from([1, 2, 3, 31, 32, 33, 63, 64, 65, 96, 97, 127, 128, 129]) | st.integers(1, 130)


def upstream_scales() -> st.SearchStrategy[float]:
    """1 (as after loss.backward()) or a random scalar of either sign."""
    return st.just(1.0) | st.floats(0.05, 2.0) | st.floats(-2.0, -0.05)


@st.composite
def loss_options(draw, z_loss_scale: float | None = None) -> dict:
    return dict(
        reduction=draw(st.sampled_from(REDUCTIONS)),
        label_smoothing=draw(st.just(0.0) | st.just(1.0) | st.floats(0.0, 1.0)),
        z_loss_scale=draw(st.just(0.0) | st.floats(1e-4, 0.1)) if z_loss_scale is None else z_loss_scale,
        softcap=draw(st.none() | st.floats(0.5, 30.0)),
        logit_scale=draw(st.none() | st.floats(0.25, 2.0) | st.floats(-2.0, -0.25)),
        return_z_loss=draw(st.booleans()),
    )


@st.composite
def num_items(draw, zero: bool) -> tuple:
    """num_items_in_batch of every kind: (kind, value[, tensor dtype]); 0 when ``zero``."""
    kind = draw(st.sampled_from(["int", "float", "int_tensor", "float_tensor"]))
    if kind in ("int", "int_tensor"):
        value = 0 if zero else draw(st.integers(1, 200))
    else:
        value = 0.0 if zero else draw(st.floats(0.5, 200.0))
    if kind == "int_tensor":
        return kind, value, draw(st.sampled_from([torch.int64, torch.int32]))
    if kind == "float_tensor":
        return kind, value, draw(st.sampled_from([torch.float32, torch.float64]))
    return kind, value


def labels_dtypes(ignore_index: int, V: int) -> st.SearchStrategy[torch.dtype]:
    """Any integer dtype that holds every class and ignore_index."""
    choices = [torch.int64, torch.int32, torch.int16]
    if 0 <= ignore_index < 256:
        choices.append(torch.uint8)
    if -128 <= ignore_index < 128 and V <= 128:
        choices.append(torch.int8)
    return st.sampled_from(choices)


BACKENDS = st.sampled_from(["torch", "triton"])
EVERY = ("hidden", "weight", "bias")


@st.composite
def cases(
    draw,
    backend: st.SearchStrategy[str],
    lead: st.SearchStrategy[Shape],
    *,
    H: st.SearchStrategy[int] | None = None,
    V: st.SearchStrategy[int] | None = None,
    dtype: st.SearchStrategy[torch.dtype] | None = None,
    logit_std: st.SearchStrategy[float] | None = None,
    z_loss_scale: float | None = None,
    requires_grad: tuple[str, ...] | None = None,
    layouts: str = "any",  # "any", "contiguous", "aligned" (16-byte rows) or "aliased" (views of weight)
    nothing_kept: bool = False,
    rows: st.SearchStrategy[int | None] | None = None,
    two_pass: bool = True,
    ignore: st.SearchStrategy[str] | None = None,
) -> Spec:
    """One example. Fields not given are drawn; ``nothing_kept``: every label ignored (or no token)."""
    backend, lead = draw(backend), draw(lead)
    dtype = draw(st.sampled_from(DTYPES) if dtype is None else dtype)
    H = draw(hidden_sizes() if H is None else H)
    V = draw(vocab_sizes() if V is None else V)
    n = math.prod(lead)

    hidden_choices = [*_hidden_layouts(lead, H), *([ALIAS] if n <= V else [])]
    weight_choices = list(_weight_layouts(V, H))
    bias_choices = [None, *_bias_layouts(V), ALIAS]
    label_choices = ["contiguous", "offset", "expanded", *(["strided"] if lead else [])]
    label_choices += ["transposed"] if len(lead) >= 2 else []
    if layouts == "contiguous" or H == 0:  # (H = 0: nothing to expand or alias along H)
        hidden_choices = weight_choices = label_choices = ["contiguous"]
        bias_choices = [None, "contiguous"]
    elif layouts == "aligned":  # operands the fused logits GEMM can load (TMA: 16-byte aligned rows)
        hidden_choices = ["contiguous", "expanded_tokens", *(["strided_tokens"] if lead else [])]
        weight_choices = ["contiguous", "strided_rows"]
    elif layouts == "aliased":
        hidden_choices = [ALIAS] if n <= V else hidden_choices
        bias_choices = [ALIAS, None]

    options = draw(loss_options(z_loss_scale=z_loss_scale))
    options["logits_dtype"] = draw(st.sampled_from([None, torch.float32, dtype]))  # dtype: same as None
    reduction = options["reduction"]
    ignore_index = draw(st.sampled_from([-100, -1, V, 1000, draw(st.integers(0, V - 1))]))  # last: a class

    # Now and then num_items_in_batch=0, which is only right with every label ignored.
    zero_items = ignore is None and reduction == "mean" and draw(st.sampled_from([False] * 9 + [True]))
    if nothing_kept or zero_items:
        ignore = "all"
    else:
        ignore = draw(st.sampled_from([*IGNORE_PATTERNS, "mixed", "all"]) if ignore is None else ignore)
    items = None
    if reduction == "mean" and (zero_items or draw(st.booleans())):
        items = draw(num_items(zero=zero_items or (nothing_kept and draw(st.booleans()))))

    if rows is None:
        rows = st.none() | st.just(1) | st.integers(1, max(1, n)) | st.integers(max(1, n // 3), max(1, n))
    rows = draw(rows)
    some = [("hidden",), ("weight",), ("bias",), ("hidden", "bias"), ("weight", "bias"), ()]
    requires = requires_grad if requires_grad is not None else draw(st.sampled_from([EVERY] * 3 + some))
    loss_weight = draw(upstream_scales())
    z_weight = None
    if options["return_z_loss"]:
        z_weight = draw(st.none() | upstream_scales())
        if z_weight is not None and draw(st.sampled_from([False, False, False, True])):
            loss_weight = None  # backward through z_loss alone

    return Spec(
        backend=backend,
        dtype=dtype,
        lead=lead,
        H=H,
        V=V,
        seed=draw(st.integers(0, 2**32 - 1)),
        logit_std=draw(st.floats(1.0, 3.0) if logit_std is None else logit_std),  # the logits' std
        hidden_layout=draw(st.sampled_from(hidden_choices)),
        weight_layout=draw(st.sampled_from(weight_choices)),
        bias_layout=draw(st.sampled_from(bias_choices)),
        labels_layout=draw(st.sampled_from(label_choices)),
        labels_dtype=draw(labels_dtypes(ignore_index, V)),
        ignore=ignore,
        ignore_index=ignore_index,
        requires_grad=requires,
        options=options,
        num_items=items,
        rows=rows,
        two_pass=two_pass and rows is not None and rows + 1 < n and draw(st.booleans()),
        loss_weight=loss_weight,
        z_weight=z_weight,
        accumulate=draw(st.sampled_from([False, False, True])),
    )


# ---------------------------------------------------------------- building tensors


def _column_major_leaf(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` copied into a non-contiguous tensor made with empty_strided: column-major, or
    with a gap between elements when 1-D."""
    shape = values.shape
    column_major = tuple(math.prod(shape[:i]) for i in range(len(shape)))
    strides = (2,) * len(shape) if len(shape) <= 1 else column_major
    leaf = torch.empty_strided(shape, strides, dtype=dtype, device=values.device)
    return leaf.copy_(values)


@dataclasses.dataclass
class Built:
    leaves: dict[str, torch.Tensor]  # the tensors gradients are compared on
    build: Callable[[dict[str, torch.Tensor]], tuple]  # leaves -> (hidden, weight, bias)
    labels: torch.Tensor


def make_inputs(spec: Spec, gen: torch.Generator) -> Built:
    lead, H, V, dtype = spec.lead, spec.H, spec.V, spec.dtype
    w_scale = spec.logit_std / math.sqrt(max(H, 1))  # logits with a std of about logit_std

    def leaf(shape: Shape, scale: float, layout: str, name: str) -> torch.Tensor:
        values = (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEVICE)
        t = _column_major_leaf(values, dtype) if layout == "strided_leaf" else values
        return t.requires_grad_(name in spec.requires_grad)

    w_shape, w_view = _weight_layouts(V, H)[spec.weight_layout]
    leaves = {"weight": leaf(w_shape, w_scale, spec.weight_layout, "weight")}
    h_view = b_view = None
    if spec.hidden_layout != ALIAS:
        h_shape, h_view = _hidden_layouts(lead, H)[spec.hidden_layout]
        leaves["hidden"] = leaf(h_shape, 1.0, spec.hidden_layout, "hidden")
    if spec.bias_layout not in (None, ALIAS):
        b_shape, b_view = _bias_layouts(V)[spec.bias_layout]
        leaves["bias"] = leaf(b_shape, 0.5, spec.bias_layout, "bias")

    def build(ls: dict[str, torch.Tensor]) -> tuple:
        weight = w_view(ls["weight"])
        hidden = weight[: spec.n].reshape(*lead, H) if h_view is None else h_view(ls["hidden"])
        if spec.bias_layout is None:
            bias = None
        elif spec.bias_layout == ALIAS:
            bias = weight[:, 0]
        else:
            bias = b_view(ls["bias"])
        return hidden, weight, bias

    return Built(leaves, build, make_labels(spec, gen))


def make_labels(spec: Spec, gen: torch.Generator) -> torch.Tensor:
    lead, V, n, ldtype = spec.lead, spec.V, spec.n, spec.labels_dtype

    def fill(shape: Shape) -> torch.Tensor:
        return torch.randint(0, V, shape, generator=gen).to(ldtype).to(DEVICE)

    layout = spec.labels_layout
    if layout == "expanded":  # torch.tensor(c).expand(lead): one label (or all ignored)
        value = spec.ignore_index if spec.ignore == "all" else int(torch.randint(0, V, (), generator=gen))
        return torch.tensor(value, dtype=ldtype, device=DEVICE).expand(lead)
    if layout == "strided":  # randint(...)[..., 1::2]
        labels = fill((*lead[:-1], 2 * lead[-1] + 1))[..., 1::2]
    elif layout == "transposed":
        labels = fill(lead[::-1]).permute(*reversed(range(len(lead))))
    elif layout == "offset":
        labels = fill((n + 3,))[3:].view(lead)
    else:
        labels = fill(lead)
    labels[ignore_mask(spec.ignore, n, gen).reshape(lead).to(DEVICE)] = spec.ignore_index
    return labels


def materialize_num_items(spec: Spec):
    if spec.num_items is None:
        return None
    kind, value, *tensor_dtype = spec.num_items
    if kind.endswith("tensor"):
        return torch.tensor(value, dtype=tensor_dtype[0])
    return value


def memory_budget_for(spec: Spec) -> int | None:
    """Bytes that give chunks of about ``spec.rows`` logits rows (fused_linear_ce subtracts the
    per-token vectors and the slack before sizing chunks; the fused GEMM's partials take a little)."""
    if spec.rows is None:
        return None
    itemsize = (spec.options["logits_dtype"] or spec.dtype).itemsize
    return SLACK_BYTES + PER_TOKEN_BYTES * spec.n + spec.rows * spec.V * itemsize


def tuning_for(spec: Spec) -> Tuning:
    """The two-pass threshold lowered when ``spec.two_pass``."""
    return Tuning(min_token_chunk_rows=spec.rows + 1) if spec.two_pass else DEFAULT_TUNING


def _record(mp: pytest.MonkeyPatch, module, name: str, calls: collections.Counter) -> None:
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls[name] += 1
        result = real(*args, **kwargs)
        if name == "_chunk_logits" and result.partials is not None:
            calls["logits_with_partials"] += 1  # the chunk went through the fused logits GEMM
        return result

    mp.setattr(module, name, spy)


@contextlib.contextmanager
def chunk_plan(spec: Spec):
    """Counts the paths that ran (token chunks, fused logits GEMM, two-pass)."""
    calls = collections.Counter()
    with pytest.MonkeyPatch.context() as mp:
        _record(mp, chunked, "vocab_pass", calls)
        _record(mp, chunked, "_chunk_logits", calls)
        yield calls
    chunks = calls["_chunk_logits"]  # token chunks over the forward and any recomputing backward
    event(f"token chunks: {'0' if not chunks else '1' if chunks == 1 else '2-4' if chunks <= 4 else '5+'}")
    if calls["vocab_pass"]:
        event("path: two-pass")
    if calls["logits_with_partials"]:
        event("path: fused logits GEMM (interpreter)")


def call_op(spec: Spec, hidden, weight, labels, bias):
    return lp.fused_linear_cross_entropy(
        hidden,
        weight,
        labels,
        bias,
        ignore_index=spec.ignore_index,
        num_items_in_batch=materialize_num_items(spec),
        backend=spec.backend,
        memory_budget=memory_budget_for(spec),
        tuning=tuning_for(spec),
        **spec.options,
    )


# ---------------------------------------------------------------- reference and comparison


def reference(spec: Spec, hidden, weight, labels, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """reference_flce in fp64. For H = 0 (which its reshape(-1, H) cannot take), hidden and weight
    get one zero column: every logit, hence the loss, is unchanged, and gradients still reach the
    (empty) originals."""
    if hidden.shape[-1] == 0:
        hidden = torch.cat([hidden, hidden.new_zeros(*hidden.shape[:-1], 1)], dim=-1)
        weight = torch.cat([weight, weight.new_zeros(weight.shape[0], 1)], dim=-1)
    return reference_flce(hidden, weight, labels, bias, **_reference_options(spec))


def _reference_options(spec: Spec) -> dict:
    opts = {k: v for k, v in spec.options.items() if k not in ("return_z_loss", "logits_dtype")}
    return dict(opts, ignore_index=spec.ignore_index, num_items_in_batch=materialize_num_items(spec))


def _reduction_weights(spec: Spec, labels: torch.Tensor) -> torch.Tensor:
    """Per-token weight of loss_i in the reduced loss (fp64, flattened)."""
    keep = (labels.reshape(-1).long() != spec.ignore_index).double()
    if spec.options["reduction"] != "mean":
        return keep
    num = materialize_num_items(spec)
    denom = float(num) if num is not None and float(num) != 0 else max(float(keep.sum()), 1.0)
    return keep / denom


@dataclasses.dataclass
class Logits:
    """The fp64 quantities the error scales are made of (rows: flattened tokens)."""

    h: torch.Tensor  # (N, H)
    xabs: torch.Tensor  # (N, V): sum_k |h_ik w_jk| + |b_j|, what a logit's rounding scales with
    z: torch.Tensor  # (N, V) logits after scale and softcap
    dz: torch.Tensor  # (N, V) d z / d x, the logit scale included
    lse: torch.Tensor
    p: torch.Tensor
    onehot: torch.Tensor  # zero rows at ignored tokens
    keep: torch.Tensor  # (N,) fp64 0/1


def _logits(spec: Spec, hidden, weight, bias, labels) -> Logits:
    o = spec.options
    s = o["logit_scale"] or 1.0
    H, V = weight.shape[1], weight.shape[0]
    h = hidden.reshape(labels.numel(), H)
    x = h @ weight.T + (0 if bias is None else bias)
    if o["softcap"] is not None:
        u = s * x / o["softcap"]
        z, dz = o["softcap"] * torch.tanh(u), s / torch.cosh(u).square()
    else:
        z, dz = s * x, torch.full_like(x, s)
    lse = torch.logsumexp(z, dim=-1)
    flat = labels.reshape(-1).long()
    keep = flat != spec.ignore_index
    onehot = torch.zeros_like(x)
    if V:
        onehot[keep] = torch.nn.functional.one_hot(flat[keep], V).double()
    xabs = h.abs() @ weight.abs().T + (0 if bias is None else bias.abs())
    return Logits(h, xabs, z, dz, lse, torch.exp(z - lse[:, None]), onehot, keep.double())


def _reduce_like_loss(spec: Spec, per_token: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    weighted = per_token * _reduction_weights(spec, labels)
    return weighted.reshape(labels.shape) if spec.options["reduction"] == "none" else weighted.sum()


def _through_weights(A: torch.Tensor, lg: Logits, hidden, weight) -> dict[str, torch.Tensor]:
    """A nonnegative (N, V) bound on d objective / d x carried to hidden, weight and bias."""
    return {"hidden": (A @ weight.abs()).reshape(hidden.shape), "weight": A.T @ lg.h.abs(), "bias": A.sum(0)}


def magnitudes(spec: Spec, hidden, weight, bias, labels, u_tok, v_tok) -> dict[str, torch.Tensor]:
    """The error scale of each compared result: the same sums with every term in absolute value.

    ``u_tok``/``v_tok``: d(objective)/d(loss_i) and d(objective)/d(z_i) per token. Returns
    magnitudes for "loss", "z_loss" (shaped like the outputs) and "hidden"/"weight"/"bias"
    (shaped like those inputs, fp64)."""
    e, zs = spec.options["label_smoothing"], spec.options["z_loss_scale"]
    lg = _logits(spec, hidden, weight, bias, labels)
    V = weight.shape[0]
    # |d objective / d x|, term by term: the cross-entropy's p, one-hot and smoothing terms, and
    # the z-loss's (its upstream is that of loss plus that of z_loss), through softcap and scale.
    ce_terms = u_tok.abs()[:, None] * (lg.p + (1 - e) * lg.onehot + e / V)
    z_terms = (u_tok + v_tok).abs()[:, None] * 2 * zs * lg.lse.abs()[:, None] * lg.p
    A = (ce_terms + z_terms) * lg.dz.abs() * lg.keep[:, None]
    z_y = (lg.z * lg.onehot).sum(-1).abs()
    per_token = lg.lse.abs() + (1 - e) * z_y + e * lg.z.abs().mean(-1) + zs * lg.lse**2
    return {
        "loss": _reduce_like_loss(spec, per_token, labels),
        "z_loss": _reduce_like_loss(spec, zs * lg.lse**2, labels),
        **_through_weights(A, lg, hidden, weight),
    }


def conditioning(spec: Spec, hidden, weight, bias, labels, u_tok, v_tok) -> dict[str, torch.Tensor]:
    """What rounding the logits alone may change, as absolute errors (same keys as ``magnitudes``).

    A logit is stored in the logits dtype after an fp32 GEMM of H terms: it is off by up to
    delta = (eps_store + H * eps_fp32) * xabs. Logits of a row off by at most D change every
    p_ij by a factor within exp(+-2D), the log-sum-exp and each logit by D, and a saturated
    softcap's derivative by a factor within exp(+-2 du). Negligible for ordinary logits, this is
    what bounds any implementation when the logits reach 1e4..1e30."""
    e, zs = spec.options["label_smoothing"], spec.options["z_loss_scale"]
    store = spec.options["logits_dtype"] or spec.dtype
    lg = _logits(spec, hidden, weight, bias, labels)
    eps = torch.finfo(store).eps / 2 + weight.shape[1] * torch.finfo(torch.float32).eps / 2
    delta = eps * lg.xabs * lg.dz.abs()
    D = delta.amax(-1) if delta.numel() else delta.new_zeros(delta.shape[0])
    dp = torch.minimum(lg.p * torch.expm1(2 * D[:, None]), torch.ones_like(lg.p))
    lse_coef = (u_tok + v_tok).abs()[:, None] * 2 * zs
    A = (u_tok.abs()[:, None] + lse_coef * lg.lse.abs()[:, None]) * dp + lse_coef * D[:, None] * lg.p
    if spec.options["softcap"] is not None:
        # A saturated softcap's derivative 1/cosh(u)^2 changes by a factor up to exp(2 |du|) when
        # the logit moves by du: its part of the gradient is that much less certain.
        du = eps * lg.xabs * abs(spec.options["logit_scale"] or 1.0) / spec.options["softcap"]
        g = u_tok.abs()[:, None] * (lg.p + (1 - e) * lg.onehot + e / weight.shape[0])
        A = A + (g + lse_coef * lg.lse.abs()[:, None] * lg.p) * torch.expm1(2 * du)
    A = A * lg.dz.abs() * lg.keep[:, None]
    return {
        "loss": _reduce_like_loss(spec, (2 + e) * D + zs * (2 * lg.lse.abs() * D + D * D), labels),
        "z_loss": _reduce_like_loss(spec, zs * (2 * lg.lse.abs() * D + D * D), labels),
        **_through_weights(A, lg, hidden, weight),
    }


def assert_matches(
    name: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    scale: torch.Tensor,
    tol: float,
    floor: torch.Tensor | float = 0.0,
) -> None:
    """|actual - expected| <= tol * (|expected| + max(max |expected|, scale)) + floor, elementwise."""
    assert actual is not None, f"{name}: got None"
    a = actual.detach().double()
    e = expected.detach().double()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != reference {tuple(e.shape)}"
    assert torch.isfinite(a).all(), f"{name}: non-finite values {a[~torch.isfinite(a)][:5].tolist()}"
    if not e.numel():
        return
    relative_to = torch.clamp(scale.detach().double(), min=float(e.abs().max()))
    # Plus one subnormal step of the result's dtype: below the smallest normal (fp16: 6e-5) a
    # correctly rounded result can be off by that much.
    info = torch.finfo(actual.dtype)
    bound = tol * (e.abs() + relative_to) + floor + info.tiny * info.eps
    bad = (a - e).abs() > bound
    if bad.any():
        i = int(((a - e).abs() - bound).reshape(-1).argmax())
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{e.numel()} elements off; worst flat index {i}: got "
            f"{a.reshape(-1)[i].item():.8g}, expected {e.reshape(-1)[i].item():.8g}, allowed error "
            f"{bound.reshape(-1)[i].item():.3g} (max |expected| {e.abs().max().item():.4g})"
        )


def _upstream(weight: float | None, like: torch.Tensor, gen: torch.Generator) -> torch.Tensor | None:
    """fp32 upstream gradient: weight * randn for a per-token output, the scalar weight else."""
    if weight is None:
        return None
    if like.dim() == 0:
        return torch.tensor(weight, dtype=torch.float32, device=like.device)
    return (torch.randn(like.shape, generator=gen) * weight).to(like.device)


def _describe(name: str, t: torch.Tensor | None) -> str:
    if t is None:
        return f"{name}: None"
    return f"{name}: shape {tuple(t.shape)} stride {t.stride()} offset {t.storage_offset()} {t.dtype}"


# ---------------------------------------------------------------- the checks


def check_against_reference(
    spec: Spec, tol: float | None = None, backwards: int = 1, logit_rounding: bool = False
) -> collections.Counter:
    """Forward and backward through the op and the fp64 reference; compare loss, z_loss, the
    leaves' gradients (dtype, shape, values), and that no input was modified. ``backwards=2``
    runs the backward twice over the retained graph (the gradients must double);
    ``logit_rounding`` also allows what rounding the logits may change (``conditioning``), for
    huge logits. Returns the paths that ran (``chunk_plan``)."""
    tol = TOL[spec.dtype] if tol is None else tol
    gen = torch.Generator().manual_seed(spec.seed)
    built = make_inputs(spec, gen)
    hidden, weight, bias = built.build(built.leaves)
    labels = built.labels
    for name, t in (("hidden", hidden), ("weight", weight), ("bias", bias), ("labels", labels)):
        note(_describe(name, t))
    before = {k: t.detach().clone() for k, t in built.leaves.items()}
    labels_before = labels.clone()

    with chunk_plan(spec) as paths:
        out = call_op(spec, hidden, weight, labels, bias)
        loss, z = out if spec.options["return_z_loss"] else (out, None)
        reduced_shape = labels.shape if spec.options["reduction"] == "none" else ()
        assert tuple(loss.shape) == tuple(reduced_shape), f"loss shape {tuple(loss.shape)}"
        if z is not None:
            assert tuple(z.shape) == tuple(reduced_shape), f"z_loss shape {tuple(z.shape)}"

        u = _upstream(spec.loss_weight, loss, gen)
        v = _upstream(spec.z_weight, loss, gen) if z is not None else None
        terms = [(loss * u).sum()] if u is not None else []
        if v is not None:
            terms.append((z * v).sum())
        objective = sum(terms)
        initial = {}  # .grad already there (gradient accumulation)
        if spec.accumulate and objective.requires_grad:
            for name, t in built.leaves.items():
                if t.requires_grad:
                    t.grad = (0.1 * torch.randn(t.shape, generator=gen)).to(t.dtype).to(t.device)
                    initial[name] = t.grad.double()
        if objective.requires_grad:
            for i in range(backwards):
                objective.backward(retain_graph=i + 1 < backwards)

    # The reference, on fp64 copies of the same leaves through the same views.
    leaves64 = {k: t.detach().double().requires_grad_(t.requires_grad) for k, t in built.leaves.items()}
    h64, w64, b64 = built.build(leaves64)
    ref, ref_z = reference(spec, h64, w64, labels, b64)
    ref_terms = [(ref * u.double()).sum()] if u is not None else []
    if v is not None:
        ref_terms.append((ref_z * v.double()).sum())
    ref_objective = sum(ref_terms)
    if ref_objective.requires_grad:
        ref_objective.backward()

    r = _reduction_weights(spec, labels)
    u_tok = r * (0 if u is None else u.double().reshape(-1))
    v_tok = r * (0 if v is None else v.double().reshape(-1))
    mags = on_leaves(magnitudes, spec, built, labels, u_tok, v_tok)
    floors = {k: 0.0 for k in mags}
    if logit_rounding:
        floors = on_leaves(conditioning, spec, built, labels, u_tok, v_tok)

    assert_matches("loss", loss, ref, mags["loss"], tol, floors["loss"])
    if z is not None:
        assert_matches("z_loss", z, ref_z, mags["z_loss"], tol, floors["z_loss"])
    for name, t in built.leaves.items():
        if not t.requires_grad or not objective.requires_grad:
            assert t.grad is None, f"{name} does not require grad but got a .grad"
            continue
        assert t.grad is not None, f"grad of {name} is None"
        assert t.grad.dtype == t.dtype, f"grad of {name}: dtype {t.grad.dtype}, input {t.dtype}"
        assert t.grad.shape == t.shape, f"grad of {name}: shape {tuple(t.grad.shape)}, input {tuple(t.shape)}"
        expected = leaves64[name].grad
        expected = torch.zeros_like(leaves64[name]) if expected is None else backwards * expected
        scale = backwards * mags[name]
        if name in initial:
            expected, scale = expected + initial[name], scale + initial[name].abs()
        assert_matches(f"grad {name}", t.grad, expected, scale, tol, backwards * floors[name])

    for name, t in built.leaves.items():
        assert torch.equal(t.detach(), before[name]), f"{name} was modified in place"
    assert torch.equal(labels, labels_before), "labels were modified in place"
    return paths


def on_leaves(fn, spec: Spec, built: Built, labels, u_tok, v_tok) -> dict[str, torch.Tensor]:
    """``magnitudes`` or ``conditioning`` carried back through the views onto the leaves (an
    expanded leaf sums, an aliased one adds up its views)."""
    leaves = {k: t.detach().double().requires_grad_() for k, t in built.leaves.items()}
    h, w, b = built.build(leaves)
    with torch.no_grad():
        bounds = fn(spec, h, w, b, labels, u_tok, v_tok)
    outs = [(h, bounds["hidden"]), (w, bounds["weight"])] + ([] if b is None else [(b, bounds["bias"])])
    grads = torch.autograd.grad(
        [o for o, _ in outs], list(leaves.values()), [m for _, m in outs], allow_unused=True
    )
    result = {"loss": bounds["loss"], "z_loss": bounds["z_loss"]}
    for (name, t), g in zip(leaves.items(), grads, strict=True):
        result[name] = torch.zeros_like(t) if g is None else g
    return result


# ---------------------------------------------------------------- properties: parity


@examples(2.0)
@given(spec=cases(st.just("torch"), lead_shapes(48)))
def test_torch_backend_matches_reference(spec):
    """Everything drawn, torch backend, up to 48 tokens."""
    check_against_reference(spec)


@examples(0.6)
@given(spec=cases(st.just("triton"), lead_shapes(20)))
def test_triton_backend_matches_reference(spec):
    """Everything drawn, Triton backend under the interpreter, up to 20 tokens."""
    check_against_reference(spec)


@examples(0.3)
@given(
    spec=cases(
        st.just("triton"),
        lead_shapes(20),
        H=st.sampled_from([4, 8, 16, 24, 32, 40]),
        V=st.sampled_from([8, 16, 32, 40, 64, 96, 128]),
        layouts="aligned",
    )
)
def test_triton_fused_logits_gemm_matches_reference(spec):
    """Aligned shapes and operands, where the interpreter runs the fused logits GEMM and its
    partials (bias and labels in any layout; hidden also expanded or with strided rows)."""
    check_against_reference(spec)


@examples(0.05)
@given(
    spec=cases(
        st.just("torch"),
        st.sampled_from([(513,), (2, 300), (640,), (3, 7, 29)]),
        H=st.integers(1, 12),
        V=st.integers(1, 40),
        requires_grad=EVERY,
        rows=st.integers(1, 511),
        two_pass=False,
        ignore=st.just("none"),
    )
)
def test_two_pass_at_the_real_threshold(spec):
    """More than 512 tokens and chunks of fewer than 512 rows: the two-pass path, unpatched. (No
    label ignored: a forward that skips ignored rows counts only the kept ones.)"""
    assert check_against_reference(spec)["vocab_pass"], "the two-pass path did not run"


@examples(0.3)
@given(spec=cases(BACKENDS, lead_shapes(16), layouts="aliased"))
def test_aliased_inputs_match_reference_and_are_not_modified(spec):
    """hidden = weight[:N], bias = weight[:, 0]: one storage read three ways, one leaf whose
    gradient sums three contributions; the op must not write into any of them."""
    check_against_reference(spec)


@examples(0.2)
@given(spec=cases(BACKENDS, lead_shapes(16), H=st.just(0)))
def test_zero_hidden_size(spec):
    """H = 0: every logit is the bias (or 0), e.g. loss = log V without bias, as torch computes."""
    check_against_reference(spec)


@examples(0.3)
@given(
    spec=cases(
        BACKENDS,
        lead_shapes(16),
        dtype=st.sampled_from([torch.float32, torch.bfloat16]),
        logit_std=st.sampled_from([1e2, 1e4, 1e8, 1e15, 1e19, 3e19, 1e25, 1e30]),
        z_loss_scale=0.0,
        layouts="contiguous",
    )
)
def test_extreme_logits_stay_finite_and_accurate(spec):
    """Logits up to 1e30 (z_loss off, so that every exact result is representable in fp32): loss
    and gradients finite, and off by no more than rounding the logits can explain."""
    check_against_reference(spec, tol=max(TOL[spec.dtype], 1e-4), logit_rounding=True)


@examples(0.15)
@given(spec=cases(BACKENDS, lead_shapes(12)))
def test_second_backward_over_retained_graph(spec):
    """backward(retain_graph=True) twice: every gradient exactly doubles."""
    check_against_reference(spec, backwards=2)


# ---------------------------------------------------------------- properties: targeted


@examples(0.3)
@given(spec=cases(BACKENDS, lead_shapes(12), nothing_kept=True))
def test_nothing_kept_is_exact_zero_with_zero_grads(spec):
    """Every label ignored or no token, any reduction, num_items_in_batch None, 0 or n: loss and
    z_loss exactly 0 and finite, attached to the graph, and exactly zero gradients."""
    gen = torch.Generator().manual_seed(spec.seed)
    built = make_inputs(spec, gen)
    hidden, weight, bias = built.build(built.leaves)
    with chunk_plan(spec):
        out = call_op(spec, hidden, weight, built.labels, bias)
        loss, z = out if spec.options["return_z_loss"] else (out, None)
        for name, t in (("loss", loss), ("z_loss", z)):
            if t is not None:
                assert torch.isfinite(t).all() and (t == 0).all(), f"{name} must be exactly 0, got {t}"
        wants_grad = any(t.requires_grad for t in built.leaves.values())
        if wants_grad:
            assert loss.requires_grad and loss.grad_fn is not None, "loss must stay attached to the graph"
            u = _upstream(spec.loss_weight or 1.0, loss, gen)
            v = _upstream(spec.z_weight, loss, gen) if z is not None else None
            ((loss * u).sum() + (0 if v is None else (z * v).sum())).backward()
    for name, t in built.leaves.items():
        if not t.requires_grad:
            assert t.grad is None, f"{name} does not require grad but got a .grad"
            continue
        assert t.grad is not None, f"{name}.grad is None: DDP/FSDP would hang"
        assert t.grad.dtype == t.dtype, f"{name}.grad has dtype {t.grad.dtype}, input {t.dtype}"
        assert t.grad.shape == t.shape, f"{name}.grad has shape {tuple(t.grad.shape)}, input {tuple(t.shape)}"
        assert torch.isfinite(t.grad).all() and (t.grad == 0).all(), f"{name}.grad must be exactly zero"


@examples(0.3)
@given(spec=cases(BACKENDS, lead_shapes(12)), no_grad=st.booleans())
def test_output_shapes_and_gradient_dtypes(spec, no_grad):
    """ "none" returns the labels' shape (mean/sum a 0-d tensor), z_loss too; gradients come back
    with their input's dtype and shape, and only for inputs that require grad; under no_grad
    nothing is attached. The op never writes into its inputs."""
    gen = torch.Generator().manual_seed(spec.seed)
    built = make_inputs(spec, gen)
    hidden, weight, bias = built.build(built.leaves)
    before = {k: t.detach().clone() for k, t in built.leaves.items()}
    labels_before = built.labels.clone()
    with chunk_plan(spec), torch.set_grad_enabled(not no_grad):
        out = call_op(spec, hidden, weight, built.labels, bias)
        loss, z = out if spec.options["return_z_loss"] else (out, torch.zeros(()))
        shape = built.labels.shape if spec.options["reduction"] == "none" else torch.Size()
        assert loss.shape == shape, f"loss shape {tuple(loss.shape)}, expected {tuple(shape)}"
        if spec.options["return_z_loss"]:
            assert z.shape == shape, f"z_loss shape {tuple(z.shape)}, expected {tuple(shape)}"
        assert loss.is_floating_point() and loss.device == hidden.device
        if no_grad:
            assert loss.grad_fn is None and not loss.requires_grad
        elif loss.requires_grad:
            (loss.sum() + 2.0 * z.sum()).backward()
    for name, t in built.leaves.items():
        if t.requires_grad and not no_grad:
            assert t.grad is not None, f"grad of {name} is None"
            assert t.grad.dtype == t.dtype, f"grad of {name}: dtype {t.grad.dtype}, input {t.dtype}"
            assert t.grad.shape == t.shape, f"grad of {name}: shape {tuple(t.grad.shape)} != {tuple(t.shape)}"
        else:
            assert t.grad is None, f"{name} got a .grad"
        assert torch.equal(t.detach(), before[name]), f"{name} was modified in place"
    assert torch.equal(built.labels, labels_before), "labels were modified in place"


def invalid_num_items() -> st.SearchStrategy:
    """Negative, infinite or NaN num_items_in_batch, as Python numbers and as tensors."""
    negative_int = st.integers(max_value=-1)
    negative_float = st.floats(max_value=-5e-324, allow_infinity=False)  # -0.0 is not negative
    non_finite = st.sampled_from([math.inf, -math.inf, math.nan])
    int_tensor = st.builds(
        lambda v, dtype: torch.tensor(v, dtype=dtype),
        st.integers(-(2**31), -1),
        st.sampled_from([torch.int64, torch.int32]),
    )
    float_tensor = st.builds(
        lambda v, dtype: torch.tensor(v, dtype=dtype),
        st.floats(max_value=-1e-3, allow_infinity=False) | non_finite,  # negative in every dtype
        st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
    )
    return negative_int | negative_float | non_finite | int_tensor | float_tensor


@examples(0.5)
@given(
    spec=cases(BACKENDS, lead_shapes(6), requires_grad=EVERY),
    value=invalid_num_items(),
    shape=st.sampled_from([(), (1,), (1, 1)]),
)
def test_invalid_num_items_in_batch_raises(spec, value, shape):
    """A negative or non-finite num_items_in_batch (number, int tensor or float tensor of any
    scalar shape) is a ValueError, whatever else the call holds (nothing kept included)."""
    if isinstance(value, torch.Tensor):
        value = value.reshape(shape)
    gen = torch.Generator().manual_seed(spec.seed)
    built = make_inputs(spec, gen)
    hidden, weight, bias = built.build(built.leaves)
    options = dict(spec.options, reduction="mean")
    with raises_by_step(ValueError, match="num_items_in_batch"):
        lp.fused_linear_cross_entropy(
            hidden,
            weight,
            built.labels,
            bias,
            ignore_index=spec.ignore_index,
            num_items_in_batch=value,
            backend=spec.backend,
            **options,
        )


@examples(0.3)
@given(spec=cases(BACKENDS, lead_shapes(8), dtype=st.just(torch.float32), requires_grad=EVERY))
def test_double_backward_is_exact_or_refused(spec):
    """create_graph=True (a gradient penalty): d/dθ [objective + <∇objective, r>] must match the
    fp64 reference, or the op must refuse with an error; never a silently wrong gradient."""
    gen = torch.Generator().manual_seed(spec.seed)
    built = make_inputs(spec, gen)
    labels = built.labels
    directions = [torch.randn(t.shape, generator=gen).to(DEVICE) for t in built.leaves.values()]

    returns_z = spec.options["return_z_loss"]
    loss_shape = labels.shape if spec.options["reduction"] == "none" else ()
    u = _upstream(spec.loss_weight or 1.0, torch.empty(loss_shape, device=DEVICE), gen)

    def penalised(leaves: dict[str, torch.Tensor], out, fp64: bool = False) -> torch.Tensor:
        loss, z = out if returns_z else (out, None)
        objective = (loss * (u.double() if fp64 else u)).sum() + (0 if z is None else 0.5 * z.sum())
        grads = torch.autograd.grad(objective, list(leaves.values()), create_graph=True, allow_unused=True)
        pairs = zip(grads, directions, strict=True)
        return objective + sum((g * (r.double() if fp64 else r)).sum() for g, r in pairs if g is not None)

    hidden, weight, bias = built.build(built.leaves)
    with chunk_plan(spec):
        out = call_op(spec, hidden, weight, labels, bias)
        try:
            penalised(built.leaves, out).backward()
        except RuntimeError as exc:  # refused: acceptable, as long as it is loud
            note(f"refused: {exc}")
            event("double backward refused")
            return

    leaves64 = {k: t.detach().double().requires_grad_() for k, t in built.leaves.items()}
    h64, w64, b64 = built.build(leaves64)
    ref = reference(spec, h64, w64, labels, b64)
    penalised(leaves64, ref if returns_z else ref[0], fp64=True).backward()
    # Error scale: the first-order gradient terms in absolute value (fp32 leaves noise of their
    # size where they cancel: V = 1, an expanded bias), times the largest direction.
    r = _reduction_weights(spec, labels)
    mags = on_leaves(
        magnitudes, spec, built, labels, r * u.double().reshape(-1), r * (0.5 if returns_z else 0.0)
    )
    largest = max(float(m.max()) for k, m in mags.items() if k in built.leaves and m.numel())
    scale = torch.tensor(largest * max(float(d.abs().max()) for d in directions if d.numel()))
    for name, t in built.leaves.items():
        expected = torch.zeros_like(t) if leaves64[name].grad is None else leaves64[name].grad
        assert_matches(f"second-order grad {name}", t.grad, expected, scale, 1e-4)
