"""The patched forward begins its loss's label check before the model's body (``labels_ahead.py``):
the loss takes it, the results are those of a check begun by the loss, bit for bit, and nothing
is left behind; on CUDA a forward that waits for its check no longer waits for the body's GPU
work."""

from __future__ import annotations

import copy

import pytest
import torch

import liger_patch as lp
from liger_patch.ops.core import deferred_checks, early_checks
from liger_patch.ops.core.tuning import Tuning
from liger_patch.patching import labels_ahead
from liger_patch.patching.state import patch_state
from tests.op_helpers import checks_taken_ahead
from tests.patching_helpers import make_batch, tiny_model

BUSY_CYCLES = 400_000_000  # a GPU spin of ~0.2 s at 2 GHz


def _pair(**options):
    """A tiny Llama patched with the label check begun ahead, and a copy patched without."""
    ahead = tiny_model("llama")
    loss_only = copy.deepcopy(ahead)
    lp.apply_liger_to(ahead, **options)
    lp.apply_liger_to(loss_only, tuning=Tuning(check_labels_ahead=False), **options)
    return ahead, loss_only


def _step(model, batch, **kwargs):
    """The loss and every gradient of one forward + backward, the gradients cleared."""
    loss = model(**batch, **kwargs).loss
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return [loss.detach(), *grads]


@pytest.mark.parametrize("num_items", [None, 29, "tensor", "host tensor"])
def test_the_loss_takes_the_check_begun_ahead_and_gives_the_same_bits(monkeypatch, num_items):
    ahead, loss_only = _pair()
    batch = make_batch()
    if num_items in ("tensor", "host tensor"):
        num_items = torch.tensor(29, device="cpu" if num_items == "host tensor" else batch["labels"].device)
    found = checks_taken_ahead(monkeypatch)
    for seed in range(2):
        batch = make_batch(seed)
        expected = _step(loss_only, batch, num_items_in_batch=num_items)
        assert found == []  # nothing waits: the loss does not even look
        got = _step(ahead, batch, num_items_in_batch=num_items)
        assert found == [True], "the loss queued its own check"
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b)
        found.clear()
    assert not early_checks.waiting()
    assert not patch_state(ahead).labels_ahead_missed


def test_given_shift_labels_or_off_nothing_is_begun(monkeypatch):
    ahead, loss_only = _pair()
    batch = make_batch()
    begun = []
    begin = labels_ahead.check_labels_ahead
    monkeypatch.setattr(labels_ahead, "check_labels_ahead", lambda *a, **k: begun.append(1) or begin(*a, **k))
    shift_labels = torch.roll(batch["labels"], -1, dims=1)
    ahead(**batch, shift_labels=shift_labels).loss.backward()
    loss_only(**batch).loss.backward()
    assert begun == []
    ahead(**batch).loss.backward()
    assert begun == [1]


def test_labels_written_in_the_body_are_shifted_again_and_none_is_begun_again(monkeypatch):
    """A model whose body writes into its labels (a hook masking positions here) gets the loss of
    the labels as written, not of the targets shifted before: the check begun ahead is left
    behind, dropped, and that patch begins no other."""
    ahead, loss_only = _pair()
    found = checks_taken_ahead(monkeypatch)
    results = []
    for model in (loss_only, ahead):
        batch = make_batch()
        labels = batch["labels"]

        def mask_positions(*_, labels=labels) -> None:
            labels[:, 4:8] = -100

        mask = model.model.layers[0].register_forward_pre_hook(mask_positions)
        results.append([_step(model, batch) for _ in range(2)])
        mask.remove()
    for a, b in zip(sum(results[0], []), sum(results[1], []), strict=True):
        assert torch.equal(a, b)
    unmasked = _step(loss_only, make_batch())[0]
    assert not torch.equal(results[1][0][0], unmasked), "the mask changed nothing: no test"
    assert found == [False]  # the first forward's loss looked and found none; the second began none
    assert patch_state(ahead).labels_ahead_missed and not early_checks.waiting()


def test_under_inference_mode_nothing_is_begun():
    ahead, loss_only = _pair()
    batch = make_batch()
    with torch.inference_mode():
        got, expected = ahead(**batch).loss, loss_only(**batch).loss
    assert torch.equal(got, expected) and not early_checks.waiting()
    assert not patch_state(ahead).labels_ahead_missed


def test_a_forward_that_raises_drops_its_check_and_begins_again():
    ahead, _ = _pair()
    with pytest.raises(ValueError, match="labels"):
        ahead(**make_batch(), logits_to_keep=4)  # 4 kept positions, 12 labels
    assert not early_checks.waiting()
    assert not patch_state(ahead).labels_ahead_missed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("begun_ahead", [True, False])
def test_a_forward_waiting_for_its_check_does_not_wait_for_the_body(begun_ahead):
    """A forward that waits for its label check to skip the ignored rows (``wait_to_skip_gflop``
    0: always) while the GPU still spins at the end of the model's body: with the check begun
    ahead it is answered long before the spin and the forward returns while the GPU spins; begun
    by the loss, it is queued after the spin and the forward waits for it every time."""
    model = tiny_model("llama")
    lp.apply_liger_to(model, tuning=Tuning(wait_to_skip_gflop=0, check_labels_ahead=begun_ahead))
    batch = make_batch()
    spun = torch.cuda.Event()

    def spin_then_mark(*_):
        torch.cuda._sleep(BUSY_CYCLES)
        spun.record()

    def forward_behind_the_spin() -> bool:
        """Whether the forward returned while the spin still ran."""
        torch.cuda.synchronize()
        with torch.no_grad():
            out = model(**batch)
        still_busy = not spun.query()
        torch.cuda.synchronize()
        assert torch.isfinite(out.loss)
        return still_busy

    spin = model.model.norm.register_forward_hook(spin_then_mark)
    try:
        forward_behind_the_spin()  # the first call of a kernel loads its module: a wait
        returned_early = [forward_behind_the_spin() for _ in range(3)]
    finally:
        spin.remove()
    # (one early return of three suffices, as in test_host_syncs.py: a wait fails all three)
    assert any(returned_early) is begun_ahead, returned_early
    assert not early_checks.waiting()
    deferred_checks.raise_pending()


def test_the_targets_and_num_items_serve_only_what_they_were_made_from():
    labels, num_items = torch.tensor([[5, 6, -100, 7]]), torch.tensor(3)
    targets, moved = torch.tensor([6, -100, 7, -100]), num_items.clone()
    ahead = labels_ahead.LabelsAhead(labels, labels._version, targets, num_items, moved, 0, key=())
    cpu = torch.device("cpu")
    assert ahead.targets_for(labels, -100) is targets
    assert ahead.targets_for(labels.clone(), -100) is None  # other labels, equal values
    assert ahead.targets_for(labels, 0) is None  # another ignore_index
    assert ahead.num_items_for(num_items, cpu) is moved
    other = torch.tensor(3)
    assert ahead.num_items_for(other, cpu) is other and ahead.num_items_for(7, cpu) == 7
    if torch.cuda.is_available():  # the loss on another device than the one it was moved to
        assert ahead.num_items_for(num_items, torch.device("cuda")).is_cuda
    labels[0, 1] = -100
    num_items.add_(1)
    assert ahead.targets_for(labels, -100) is None  # written since
    assert ahead.num_items_for(num_items, cpu) is num_items  # written since: its own value
