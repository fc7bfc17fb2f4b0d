"""The step-cost model (`spec_adapt.policies.cost.StepCost`): what every time-weighing decision reads."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, strategies as st

from spec_adapt.policies.cost import StepCost
from spec_adapt.policies.estimators import LatencyTable


def test_a_measured_width_is_its_mean_and_the_others_lie_on_the_line():
    cost = StepCost()
    for _ in range(3):
        for fed, seconds in ((1, 0.20), (3, 0.24), (5, 0.28)):
            cost.observe_verify(1, fed, seconds)
    assert cost.verify_time(1, 3) == pytest.approx(0.24)
    assert cost.verify_time(1, 4) == pytest.approx(0.26)            # the line through the drafting steps
    assert cost.verify_time(1, 3.5) == pytest.approx(0.25)          # a mix of widths 3 and 4
    assert cost.verify_time(1, 9) == pytest.approx(0.36)


def test_verification_never_costs_less_than_a_plain_step():
    """A steep line through wide steps says less than nothing at narrow widths: never under the one-token time."""
    cost = StepCost()
    for _ in range(4):
        cost.observe_verify(1, 8, 0.5)
        cost.observe_verify(1, 9, 1.0)
    cost.observe_verify(1, 1, 0.2)
    assert cost.lines[("full", 1)](2) < 0
    assert all(cost.verify_time(1, w) >= 0.2 for w in range(1, 10))


def test_past_the_widest_width_measured_a_flat_line_is_no_cheaper_per_token_than_elsewhere():
    """A batch that shrank to one row after drafting at four measured only narrow widths at batch 1, and their line
    is flat: a 24-token verification there reads the per-token slope batch 4 measured (per token fed across the
    batch), not the 4-token time; within the widths batch 1 measured, its own line; with no wider bucket, its own
    line past them too; nor does a smaller batch bound a larger one."""
    cost = StepCost()
    for w, t in [(1, 0.41), (3, 0.62), (8, 0.98), (9, 1.17), (12, 1.38), (10, 1.23)]:
        for _ in range(3):
            cost.observe_verify(4, w, t)
    alone = StepCost()
    for c in (cost, alone):
        for w, t in [(1, 0.42), (3, 0.46), (4, 0.47), (3, 0.46), (4, 0.48), (3, 0.45), (4, 0.47)]:
            c.observe_verify(1, w, t)
    slope4 = cost.lines[("full", 4)].slope()
    assert cost.verify_time(1, 4) == pytest.approx(alone.verify_time(1, 4))          # measured: its own
    assert cost.verify_time(1, 24) == pytest.approx(cost.verify_time(1, 4) + slope4 / 4 * 20, rel=0.02)
    assert cost.verify_time(1, 24) > 1.5 * cost.verify_time(1, 4)
    line = alone.lines[("full", 1)]
    assert alone.verify_time(1, 24) == pytest.approx(max(line(24), 0.42))
    # A smaller batch never bounds a larger one (its cost per token fed is higher): batch 4's own line stands.
    small_wide = StepCost()
    for w, t in [(1, 0.41), (3, 0.50), (4, 0.52), (3, 0.50), (4, 0.53), (3, 0.51), (4, 0.52)]:
        small_wide.observe_verify(4, w, t)
    for w, t in [(1, 0.28), (8, 0.55), (16, 1.0), (24, 1.3), (8, 0.56), (16, 1.0), (24, 1.3)]:
        small_wide.observe_verify(1, w, t)
    own = small_wide.lines[("full", 4)]
    assert small_wide.verify_time(4, 20) == pytest.approx(max(own(20), 0.41))


def test_a_stall_counts_as_three_times_the_estimate():
    cost = StepCost()
    for _ in range(20):
        cost.observe_verify(8, 1, 0.002)
    cost.observe_verify(8, 1, 0.5)                                   # a GC pause
    assert cost.verify_time(8, 1) < 0.0025


def test_a_batch_size_never_seen_reads_the_nearest_one():
    cost = StepCost()
    for batch, seconds in ((1, 0.1), (16, 0.4)):
        cost.observe_step(batch, 1, seconds + 0.01, seconds)
        cost.observe_draft("model", batch, 4, 4 * seconds / 10)
    assert cost.verify_time(12, 1) == cost.verify_time(16, 1)       # bucket 8: 16 is nearer than 1
    assert cost.verify_time(2, 1) == cost.verify_time(1, 1)
    assert cost.draft_time("model", 2, 4) == pytest.approx(0.04)
    assert cost.host_time(2) == pytest.approx(0.01)


def test_an_unmeasured_source_costs_what_the_caller_or_the_prior_says():
    cost = StepCost(prior_draft=0.25)
    cost.observe_verify(1, 1, 0.2)
    assert cost.draft_time("suffix", 1, 4) == pytest.approx(4 * 0.25 * 0.2)
    assert cost.draft_time("suffix", 1, 4, unknown=0.0) == 0.0
    assert not cost.knows("suffix", 1)
    cost.observe_draft("suffix", 1, 4, 0.004)
    assert cost.knows("suffix", 8) and cost.draft_time("suffix", 1, 2) == pytest.approx(0.002)


def test_with_a_profile_and_nothing_measured_it_is_the_profile():
    """The lab's clock: a StepCost over a table reads the table's own times."""
    table = LatencyTable(step={1: {0: 0.1, 4: 0.14}, 8: {0: 0.3, 4: 0.5}}, draft_token={1: 0.01, 8: 0.02},
                         prefill={100: {1: 0.3, 8: 0.9}})
    cost = StepCost(table)
    for batch in (1, 4, 8):
        for width in (0, 2, 4):
            drafts = {"model": width} if width else None
            assert cost.step_time(batch, width + 1, drafts) == pytest.approx(table.step_time(batch, width))
    assert cost.catchup_time("model", 8, 50) == pytest.approx(table.switch_cost(50, 8))


def test_the_catch_up_is_proportional_then_a_line():
    cost = StepCost()
    assert cost.catchup_time("model", 1, 100) == 0.0 and cost.catchup_time("model", 1, 100, unknown=7.0) == 7.0
    cost.observe_catchup("model", 1, 100, 1.0)
    assert cost.catchup_time("model", 1, 10) == pytest.approx(0.1)
    cost.observe_catchup("model", 1, 10, 0.2)
    cost.observe_catchup("model", 1, 100, 1.0)
    assert cost.catchup_time("model", 1, 50) == pytest.approx(0.2 + 40 * 0.8 / 90)


observations = st.lists(st.tuples(st.sampled_from([1, 2, 3, 8, 16]), st.integers(1, 9),
                                  st.floats(1e-4, 2.0, allow_nan=False)), min_size=1, max_size=60)


@given(observations, st.sampled_from([1, 2, 5, 16, 64]), st.floats(1.0, 12.0))
def test_every_prediction_is_a_positive_finite_time_and_survives_a_round_trip(seen, batch, fed):
    cost = StepCost()
    for b, w, seconds in seen:
        cost.observe_step(b, w, 1.5 * seconds, seconds, {"model": (w - 1, 0.3 * seconds)} if w > 1 else None)
    value = cost.step_time(batch, fed, {"model": fed - 1})
    assert 0 < value < float("inf")
    again = StepCost()
    again.load_state_dict(json.loads(json.dumps(cost.state_dict())))
    assert again.step_time(batch, fed, {"model": fed - 1}) == pytest.approx(value)


@pytest.mark.parametrize("poison", ["key of two", "bool batch", "zero time", "negative sample", "host of a string"])
def test_a_poisoned_state_is_refused_whole(poison):
    cost = StepCost()
    for w in (1, 2, 3):
        cost.observe_step(2, w, 0.3, 0.2, {"model": (w, 0.05)})
    state = json.loads(json.dumps(cost.state_dict()))
    if poison == "key of two":
        state["verify"][0][0] = state["verify"][0][0][:2]
    elif poison == "bool batch":
        state["near"].append([["full", True, 2], [0.1, 3]])
    elif poison == "zero time":
        state["verify"][0][1][0] = 0
    elif poison == "negative sample":
        state["draft"][0][1].append([2, -1.0])
    else:
        state["host"].append(["2", 0.1])
    before = json.dumps(cost.state_dict())
    with pytest.raises(ValueError):
        cost.load_state_dict(state)
    assert json.dumps(cost.state_dict()) == before


def test_device_marks_read_the_device_timeline_waiting_once_per_step(monkeypatch):
    """On a GPU the loop marks its phases with CUDA events: the differences are the device's seconds between the
    marks, and reading a step's three times waits on its last mark, never a device-wide synchronize."""
    import spec_adapt.loop as loop

    clock, waits = [0.0], []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self, stream=None):
            clock[0] += 2.5                       # each phase takes 2.5 ms on the fake device
            self.at = clock[0]

        def synchronize(self):
            waits.append(self.at)

        def elapsed_time(self, later):
            return later.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: pytest.fail("a device-wide synchronize"))
    t0, t1, t2, t3 = (loop.DeviceMark(torch.device("cuda")) for _ in range(4))
    assert (t3 - t0, t1 - t0, t2 - t1) == (0.0075, 0.0025, 0.0025)
    assert waits[0] == t3.event.at                # the first wait is on the step's last mark


@pytest.mark.parametrize("table, entry", [("host", [0, 0.01]), ("host", [True, 0.01]), ("host", [-2, 0.01]),
                                          ("near", [["full", 0, 2], [0.1, 3]]), ("verify", [["full", 4, 0], [0.1, 3]]),
                                          ("draft", [["model", 0], [[1, 0.1]]])])
def test_a_saved_bucket_or_width_below_1_is_refused(table, entry):
    """A step-cost state whose batch size, bucket or width is 0 (or not an int) is refused where it is loaded: read,
    the nearest bucket to 0 is log2(0), and every later decision would raise."""
    cost = StepCost()
    cost.observe_step(2, 3, 0.2, 0.15, {"model": (2, 0.04)})
    state = cost.state_dict()
    state[table] = [entry]
    before = cost.state_dict()
    with pytest.raises(ValueError, match="bucket|int >= 1|ints >= 1|non-negative"):
        cost.load_state_dict(state)
    assert cost.state_dict() == before


def test_a_record_is_observed_on_its_path_with_its_own_drafting():
    """`observe_record` (the loop's writer under a policy that keeps no model): the verification on the step's path,
    the drafter's own per-source timing where reported, the step's drafting as the model's only where no row drafted
    from a model-free source, and the rest as host work."""
    from spec_adapt.metrics import StepRecord

    cost = StepCost()
    cost.observe_record(StepRecord(2, [0, 1], [3, 3], [3, 2], [1, 2], [2, 3], 0.5, 0.1, 0.3, path="pruned"))
    assert cost.exact(2, 4, "pruned") == [0.3, 1] and cost.exact(2, 4) is None
    assert list(cost.draft[("model", 2)].samples) == [(3, 0.1)] and cost.host[2] == pytest.approx(0.1)
    free = StepCost()
    free.observe_record(StepRecord(1, [0], [3], [5], [5], [6], 0.5, 0.1, 0.3, free=[True]))
    assert free.exact(1, 6) == [0.3, 1] and not free.draft and free.host[1] == pytest.approx(0.1)
    told = StepCost()
    told.observe_record(StepRecord(2, [0, 1], [3, 3], [5, 2], [5, 2], [6, 3], 0.5, 0.2, 0.3, {"draft_seconds": {
        "model": (2, 0.05)}}, free=[True, False]))
    assert list(told.draft) == [("model", 2)] and list(told.draft[("model", 2)].samples) == [(2, 0.05)]
    assert told.host[2] == pytest.approx(0.0)
