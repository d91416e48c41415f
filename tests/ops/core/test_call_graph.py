"""``call_graph.GraphCache``'s bookkeeping, with stand-in graphs on any device: when a signature's
graph is captured (its second call at one weight address, before the call runs anything of its
own), refused (a held output, the weight elsewhere, another stream), dropped (refusals in a row,
evicted by newer ones, a failed capture, running out of memory) and captured again (a weight
that moved and stays); what is known of signatures is bounded; one caller at a time checks and
replays. The real graphs of each op: tests/ops/cross_entropy/test_call_graph.py and
tests/ops/distillation/test_call_graph.py (on a GPU)."""

import threading
import time

import pytest
import torch

from liger_patch.ops.core import call_graph
from liger_patch.ops.core.call_graph import GraphCache

# ``GraphCache``'s bookkeeping with stand-ins: a plan that counts its runs, graphs that count their
# replays, and "streams" that are plain values.


class _Plan:
    def __init__(self) -> None:
        self.runs = 0

    def run(self, *inputs):
        self.runs += 1
        return "run"


class _Graph:
    """A stand-in graph: serves its stream and weight unless ``held``; ``fail`` makes capture raise."""

    made: list = []
    fail: BaseException | None = None

    def __init__(self, plan, weight, stream, inputs) -> None:
        if _Graph.fail is not None:
            raise _Graph.fail
        self.plan, self.weight, self.stream, self.held, self.replays = plan, weight, stream, False, 0
        self.weight_ptr = weight.data_ptr()
        _Graph.made.append(self)

    def serves(self, weight, stream) -> bool:
        return weight.data_ptr() == self.weight.data_ptr() and stream == self.stream and not self.held

    def replay(self, inputs):
        self.replays += 1
        return "replay"


@pytest.fixture
def cache():
    _Graph.made, _Graph.fail = [], None
    return GraphCache(_Graph)


def _weight() -> torch.Tensor:
    """A stand-in weight: only its address is read (the test keeps it alive while it matters)."""
    return torch.empty(8)


def _calls(cache, plan, key, weight, n, stream="s0") -> list:
    return [cache.run(plan, key, weight, stream, (None,)) for _ in range(n)]


def test_the_second_call_at_one_address_captures_and_replays(cache):
    """The capturing call runs nothing of its own before the capture: it replays the new graph."""
    plan, weight = _Plan(), _weight()
    assert _calls(cache, plan, "k", weight, 5) == ["run", "replay", "replay", "replay", "replay"]
    assert plan.runs == 1 and len(_Graph.made) == 1 and _Graph.made[0].stream == "s0"


def test_a_weight_that_moves_at_every_call_is_never_captured(cache):
    plan, weights = _Plan(), [_weight() for _ in range(6)]
    for weight in weights:
        _calls(cache, plan, "k", weight, 1)
    assert plan.runs == 6 and not _Graph.made


def test_a_weight_that_moved_and_stays_is_captured_again_there(cache):
    """A model loaded anew: its weight's new address, found by two calls in a row, gets a graph of
    its own, the old one dropped; a weight moving back and forth between two places keeps one."""
    plan, old, new = _Plan(), _weight(), _weight()
    _calls(cache, plan, "k", old, 2)
    assert _calls(cache, plan, "k", new, 3) == ["run", "replay", "replay"]
    assert len(_Graph.made) == 2 and cache.graphs() == [_Graph.made[1]]
    assert [_calls(cache, plan, "k", w, 1)[0] for w in (old, new, old, new)] == ["run", "replay"] * 2


def test_refusals_in_a_row_drop_the_graph_for_good(cache):
    plan, weight = _Plan(), _weight()
    _calls(cache, plan, "k", weight, 3)
    assert _calls(cache, plan, "k", weight, call_graph._MAX_MISSES - 1, stream="s1") == ["run"] * 7
    assert _calls(cache, plan, "k", weight, 1) == ["replay"]  # a replay ends the run of refusals
    assert _calls(cache, plan, "k", weight, call_graph._MAX_MISSES, stream="s1") == ["run"] * 8
    assert not cache.graphs()
    assert _calls(cache, plan, "k", weight, 4) == ["run"] * 4 and len(_Graph.made) == 1


def test_a_held_output_refuses_the_replay(cache):
    plan, weight = _Plan(), _weight()
    _calls(cache, plan, "k", weight, 2)
    _Graph.made[0].held = True
    assert _calls(cache, plan, "k", weight, 2) == ["run", "run"]
    _Graph.made[0].held = False
    assert _calls(cache, plan, "k", weight, 1) == ["replay"]


def test_the_least_recently_replayed_graph_makes_room_and_may_come_back(cache):
    plans, weight = {k: _Plan() for k in range(call_graph._MAX_GRAPHS + 1)}, _weight()
    for k in range(call_graph._MAX_GRAPHS):
        _calls(cache, plans[k], k, weight, 2)
    for k in (0, 2, 3):  # 1 is the least recently replayed
        _calls(cache, plans[k], k, weight, 1)
    _calls(cache, plans[4], 4, weight, 2)
    assert {g.plan for g in cache.graphs()} == {plans[k] for k in (0, 2, 3, 4)}
    assert _calls(cache, plans[1], 1, weight, 3) == ["run", "replay", "replay"]  # captured again
    assert len(cache.graphs()) == call_graph._MAX_GRAPHS and plans[0] not in {g.plan for g in cache.graphs()}


def test_signatures_taking_turns_stop_capturing(cache):
    """More signatures than graphs, each called in turn: each is captured at most a few times."""
    plans, weight = {k: _Plan() for k in range(call_graph._MAX_GRAPHS + 1)}, _weight()
    for _ in range(4 * call_graph._MAX_CAPTURES):
        for k, plan in plans.items():
            _calls(cache, plan, k, weight, 2)
    assert len(_Graph.made) <= len(plans) * call_graph._MAX_CAPTURES


def test_a_failed_capture_leaves_the_signature_to_its_plan(cache):
    plan, weight = _Plan(), _weight()
    _Graph.fail = RuntimeError("operation not permitted when stream is capturing")
    with pytest.warns(RuntimeWarning, match="could not be captured"):
        assert _calls(cache, plan, "k", weight, 2) == ["run", "run"]  # the call's own result
    _Graph.fail = None
    assert _calls(cache, plan, "k", weight, 4) == ["run"] * 4 and not _Graph.made


def test_running_out_of_memory_in_a_capture_drops_every_graph(cache):
    weight = _weight()
    _calls(cache, _Plan(), "a", weight, 2)
    assert len(cache.graphs()) == 1
    _Graph.fail = torch.cuda.OutOfMemoryError("CUDA out of memory")
    assert _calls(cache, _Plan(), "b", weight, 2) == ["run", "run"]
    assert not cache.graphs()


def test_a_plan_made_anew_is_not_replayed_from_the_old_ones_graph(cache):
    weight, old, new = _weight(), _Plan(), _Plan()
    _calls(cache, old, "k", weight, 2)
    assert _calls(cache, new, "k", weight, 3) == ["run", "replay", "replay"]
    assert cache.graphs()[0].plan is new


def test_the_signatures_noted_are_bounded(cache):
    for k in range(call_graph._MAX_ENTRIES + 5):
        _calls(cache, _Plan(), k, _weight(), 1)
    assert len(cache.entries) == call_graph._MAX_ENTRIES and 0 not in cache.entries


def test_a_signature_in_use_outlives_a_stream_of_new_ones(cache):
    """Dynamic padding brings a new signature at every call: the one called at every step keeps
    its graph, and one whose capture failed is not retried."""
    plan, weight, failing = _Plan(), _weight(), _Plan()
    _calls(cache, plan, "busy", weight, 2)
    _Graph.fail = RuntimeError("not capturable")
    with pytest.warns(RuntimeWarning):
        _calls(cache, failing, "failed", weight, 2)
    _Graph.fail = None
    for k in range(3 * call_graph._MAX_ENTRIES):
        _calls(cache, _Plan(), ("padded", k), _weight(), 1)
        if k % 64 == 0:
            assert _calls(cache, plan, "busy", weight, 1) == ["replay"]
            _calls(cache, failing, "failed", weight, 2)
    assert len(_Graph.made) == 1 and failing.runs == 2 + 2 * 12


def test_a_graph_captured_by_another_thread_meanwhile_is_kept(cache):
    """Call B looks (nothing known of its signature), runs its plan; meanwhile calls A of the same
    signature note the weight and capture; B's bookkeeping after its run must keep A's graph."""
    weight = _weight()

    class Racing(_Plan):
        def run(self, *inputs):
            if self.runs == 0:  # B's run: A's two calls inside it
                self.runs += 1
                assert _calls(cache, self, "k", weight, 2) == ["run", "replay"]
            return super().run(*inputs)

    plan = Racing()
    assert _calls(cache, plan, "k", weight, 1) == ["run"]  # B, with A inside
    assert len(cache.graphs()) == 1 and _calls(cache, plan, "k", weight, 1) == ["replay"]


def test_one_caller_at_a_time_checks_and_replays(cache):
    """Threads calling one signature: no replay starts while another is between its check that
    nothing holds the outputs and its replay (a graph marks itself held for that time)."""
    plan, weight = _Plan(), _weight()
    _calls(cache, plan, "k", weight, 2)
    graph, overlaps = _Graph.made[0], []
    serves = graph.serves

    def slow_serves(weight, stream):  # another thread runs between this check and the replay
        ok = serves(weight, stream)
        time.sleep(1e-4)
        return ok

    def replay(inputs):
        overlaps.append(graph.held)
        graph.held = True
        time.sleep(1e-4)
        graph.held, graph.replays = False, graph.replays + 1
        return "replay"

    graph.serves, graph.replay = slow_serves, replay
    threads = [threading.Thread(target=_calls, args=(cache, plan, "k", weight, 50)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not any(overlaps) and graph.replays == 1 + 200 and plan.runs == 1
