"""The rows' state (spec_adapt.rows.Rows): the buffer grows with what rows generate and no further, what it keeps of
the limits on the host stays true (a bound below every row's room, limits[rows]), lengths only grow except where
`Stopper.settle` takes tokens back, and rows that leave, join or take slots keep the right rows."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from spec_adapt.rows import Rows
from spec_adapt.stopping import Stopper

PAD = 0


def _prompts(data, batch: int) -> torch.Tensor:
    width = data.draw(st.integers(1, 6))
    return torch.tensor([[data.draw(st.integers(1, 9)) for _ in range(width)] for _ in range(batch)])


def _check_kept(rows: Rows) -> None:
    """What Rows keeps of its limits is true: limits[rows], and a bound below every active row's room."""
    assert torch.equal(rows.row_limits(), rows.limits[rows.rows])
    if len(rows.rows):
        assert rows.min_tokens_left() <= int((rows.limits[rows.rows] - rows.lengths[rows.rows]).min())


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_the_buffer_grows_with_the_rows_and_never_past_what_a_step_needs(data):
    """Steps of random widths over a generate call's rows: after `reserve(extra)` every active row has room for a
    block of `extra` tokens past its length; the buffer is never wider than its start, the furthest limit or what a
    step has needed (its longest row plus its block), and where a step's width fits every row's room, never past the furthest
    limit; the host bound and limits[rows] stay true throughout."""
    batch = data.draw(st.integers(1, 4))
    ids = _prompts(data, batch)
    max_length = ids.shape[1] + data.draw(st.integers(1, 200))
    rows = Rows.of_prompts(ids, max_length, PAD)
    start_width = rows.buffer.shape[1]
    assert torch.equal(rows.buffer[:, : ids.shape[1]], ids) and bool((rows.buffer[:, ids.shape[1]:] == PAD).all())
    assert rows.lengths.tolist() == rows.starts.tolist() == [ids.shape[1]] * batch
    fits = data.draw(st.booleans())
    most = 0                                           # the most a step has needed: its longest row plus its block
    for _ in range(data.draw(st.integers(1, 40))):
        if not len(rows.rows):
            break
        room = rows.limits[rows.rows] - rows.lengths[rows.rows]
        extra = data.draw(st.integers(1, int(room.min()) if fits else 12))
        longest = int(rows.lengths[rows.rows].max())
        most = max(most, longest + extra)
        rows.reserve(extra)
        width = rows.buffer.shape[1]
        assert width >= longest + extra
        assert width <= max(start_width, max_length, most)
        if fits:
            assert width <= max(start_width, max_length)
        old = rows.lengths[rows.rows]
        gain = torch.tensor([data.draw(st.integers(0, extra)) for _ in range(len(rows.rows))])
        new = torch.minimum(old + gain, rows.limits[rows.rows])
        rows.buffer[rows.rows, old] = 7                    # a block write reaches past every kept token: in range
        rows.set_lengths(rows.rows, new, extra)
        _check_kept(rows)
        rows.finished = new >= rows.limits[rows.rows]
        rows.leave()
        _check_kept(rows)
    assert bool((rows.lengths <= max_length).all())


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_leaving_and_joining_keep_the_right_rows(data):
    """`leave` keeps the rows that did not finish, in order, and answers their positions; `join` appends; `clear`
    empties; limits[rows] follows each change."""
    batch = data.draw(st.integers(1, 6))
    ids = _prompts(data, batch)
    rows = Rows.of_prompts(ids, ids.shape[1] + 10, PAD)
    rows.limits[:] = torch.tensor([data.draw(st.integers(ids.shape[1] + 1, 30)) for _ in range(batch)])
    rows.limits_written()
    expected = list(range(batch))
    for _ in range(data.draw(st.integers(1, 5))):
        finished = [data.draw(st.booleans()) for _ in expected]
        rows.finished = torch.tensor(finished, dtype=torch.bool)
        keep = rows.leave()
        assert keep.tolist() == [i for i, f in enumerate(finished) if not f]
        expected = [r for r, f in zip(expected, finished) if not f]
        assert rows.rows.tolist() == expected and rows.finished.tolist() == [False] * len(expected)
        _check_kept(rows)
    back = [r for r in range(batch) if r not in expected][:2]
    rows.join(torch.tensor(back, dtype=torch.long), torch.zeros(len(back), dtype=torch.bool))
    assert rows.rows.tolist() == expected + back
    _check_kept(rows)
    rows.clear()
    assert rows.rows.tolist() == [] and rows.finished.tolist() == []
    rows.reserve(5)                                                  # no active row: nothing to make room for
    _check_kept(rows)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_serving_slots_are_the_lowest_free_ones_and_placing_writes_the_prompt(data):
    """A serving engine's slots: `take_slots` answers the lowest slots no active row holds, then new ones; `place`
    writes each prompt at the start of its slot's row (padding after it), its length, start, limit and left padding,
    grows the buffer to hold it, and leaves every other slot as it was."""
    rows = Rows.empty("cpu", PAD)
    for _ in range(data.draw(st.integers(1, 4))):
        n = data.draw(st.integers(1, 3))
        slots = rows.take_slots(n)
        held = set(rows.rows.tolist())
        free = [s for s in range(rows.buffer.shape[0]) if s not in held]
        assert slots.tolist() == (free + list(range(rows.buffer.shape[0], rows.buffer.shape[0] + n)))[:n]
        lengths = [data.draw(st.integers(1, 8)) for _ in range(n)]
        width = max(lengths)
        ids = torch.full((n, width), PAD, dtype=torch.long)
        mask = torch.zeros(n, width, dtype=torch.long)
        for i, k in enumerate(lengths):
            ids[i, width - k:] = torch.arange(1, k + 1)
            mask[i, width - k:] = 1
        others = [s for s in held]
        before = {s: (rows.buffer[s].clone(), int(rows.lengths[s]), int(rows.limits[s])) for s in others}
        budgets = torch.tensor([data.draw(st.integers(1, 20)) for _ in range(n)])
        rows.place(slots, ids, mask, width + budgets)
        assert rows.buffer.shape[1] > width
        for i, slot in enumerate(slots.tolist()):
            assert torch.equal(rows.buffer[slot, :width], ids[i]) and bool((rows.buffer[slot, width:] == PAD).all())
            assert int(rows.lengths[slot]) == int(rows.starts[slot]) == width
            assert int(rows.limits[slot]) == width + int(budgets[i]) and int(rows.pads[slot]) == width - lengths[i]
        for s, (buffer, length, limit) in before.items():
            w = min(len(buffer), rows.buffer.shape[1])
            assert torch.equal(rows.buffer[s, :w], buffer[:w])
            assert (int(rows.lengths[s]), int(rows.limits[s])) == (length, limit)
        rows.join(slots, torch.zeros(n, dtype=torch.bool))
        _check_kept(rows)
        leaving = [data.draw(st.booleans()) for _ in range(len(rows.rows))]
        rows.finished = torch.tensor(leaving, dtype=torch.bool)
        rows.leave()


class _StopAfter:
    """A stopping criterion other than EOS and max length: the row stops once its last token is `token`."""

    def __init__(self, token):
        self.token = token

    def __call__(self, ids, scores):
        return ids[:, -1] == self.token


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_lengths_only_grow_except_where_settle_takes_tokens_back(data):
    """Commits as the loop makes them (`Stopper.cut`, then `Stopper.settle`, then `set_lengths`), with an EOS id or a
    criterion that makes stopped rows wait for the others: a row's length falls only where `settle` takes tokens
    back (rows that wait for each other), by what it says: an active row's negative count, or the tokens it names
    of a row that had left; with an EOS nothing falls. No row passes its limit."""
    batch = data.draw(st.integers(1, 4))
    ids = _prompts(data, batch)
    max_length = ids.shape[1] + data.draw(st.integers(1, 12))
    waits = data.draw(st.booleans())
    criteria = [_StopAfter(5)] if waits else []
    stopper = Stopper(criteria, max_length, "cpu", together=True)
    if not waits:
        stopper.eos = torch.tensor([5])
    assert stopper.waits == waits
    rows = Rows.of_prompts(ids, max_length, PAD)
    for _ in range(30):
        if not len(rows.rows):
            break
        width = data.draw(st.integers(1, 4))
        rows.reserve(width)
        active = rows.rows
        old = rows.lengths[active]
        before = rows.lengths.clone()
        new = torch.tensor([[data.draw(st.integers(1, 6)) for _ in range(width)] for _ in range(len(active))])
        n_new = torch.tensor([data.draw(st.integers(1, width)) for _ in range(len(active))])
        n_keep, finished = stopper.cut(rows.buffer, active, old, new, n_new, PAD, rows.row_limits())
        rows.limits_written()
        n_keep, finished, taken = stopper.settle(rows.buffer, active, old, n_keep, finished, rows.limits,
                                                 rows.lengths, PAD)
        rows.set_lengths(active, old + n_keep, width)
        rows.finished = finished
        taken, position = dict(taken), {row: b for b, row in enumerate(active.tolist())}
        fell = (rows.lengths < before).nonzero().flatten().tolist()
        for row in fell:              # an active row's take-back is its negative count; a row that left, `taken`
            back = -int(n_keep[position[row]]) if row in position else taken[row]
            assert waits and int(before[row] - rows.lengths[row]) == back
        if not waits:
            assert fell == [] and not taken and bool((n_keep >= 0).all())
        assert bool((rows.lengths <= rows.limits).all())
        _check_kept(rows)
        rows.leave()
