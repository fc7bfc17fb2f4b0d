"""A generate call and a serving engine share one lifecycle: the prefill and first token, the drafter's begin, and
what the statistics report beside the step counts (compactions, kernel paths, the verifier's counters, the
drafter's events). The engine's `stats` then say what a generate call's say, and every output stays stock's."""

from __future__ import annotations

import functools

import pytest
import torch

from spec_adapt import ChainDrafter, EarlyExitVerifier, FixedLength, ModelDrafter, PromptLookupDrafter, ScriptedDrafter
from spec_adapt.drafters.drafter import Drafter, Proposal, TakesInputs
from spec_adapt.serving.engine import Engine

from conftest import PAD, Breaks, cached_model, ragged_batch, spec_generate, stock_greedy, tiny_model

PROMPTS = [[5, 6, 7, 5, 6, 7], [9, 10, 11, 12], [20, 21, 22, 20, 21]]
BUDGET = 14


@functools.lru_cache(maxsize=None)
def deep_model():
    return tiny_model("llama", 0, layers=4)     # room for an early exit below the last layer


def wrong(row, context, gamma):
    return [3] * gamma


def stock(model, prompt, budget=BUDGET):
    ids = torch.tensor([prompt])
    return stock_greedy(model, ids, torch.ones_like(ids), eos_token_id=None, max_new_tokens=budget)[0, len(prompt):]


def serve(model, drafter, policy, prompts=PROMPTS, **kw) -> Engine:
    """An engine that serves `prompts` together; every request's output is checked against stock's alone."""
    engine = Engine(model, drafter=drafter, assistant_policy=policy, max_batch=len(prompts), eos_token_id=None,
                    pad_token_id=PAD, **kw)
    handles = [engine.submit(p, max_new_tokens=BUDGET) for p in prompts]
    engine.run_until_idle()
    for prompt, handle in zip(prompts, handles):
        assert handle.result() == stock(model, prompt).tolist()
    return engine


def call(model, drafter, policy, **kw):
    """The same prompt through a generate call (greedy, checked against stock): its SpecStats."""
    ids = torch.tensor([PROMPTS[0]])
    out, stats = spec_generate(model, ids, torch.ones_like(ids), drafter, policy, max_new_tokens=BUDGET, **kw)
    assert torch.equal(out[0, ids.shape[1]:], stock(model, PROMPTS[0]))
    return stats


def test_engine_reports_the_verifiers_counters_as_a_generate_call_does():
    model = deep_model()

    def verifier():
        return EarlyExitVerifier(layers=[0], top_k=1, gate="always")

    engine = serve(model, ScriptedDrafter(wrong), FixedLength(3), verifier=verifier())
    report = engine.stats.verifier
    assert report["tested"] > 0 and report["pruned"] > 0
    assert set(report) == set(call(model, ScriptedDrafter(wrong), FixedLength(3), verifier=verifier()).verifier)


@pytest.fixture
def compact_every_rollback(monkeypatch):
    from spec_adapt import ledger

    original = ledger.KVLedger.rollback

    def rollback_then_compact(self, keep_len, dropped=None):
        original(self, keep_len, dropped)
        self.compact()

    monkeypatch.setattr(ledger.KVLedger, "rollback", rollback_then_compact)


def test_engine_reports_compactions_kernel_paths_and_prefill_time(compact_every_rollback):
    model = cached_model("llama")
    engine = serve(model, ScriptedDrafter(wrong), FixedLength(3))
    stats = call(model, ScriptedDrafter(wrong), FixedLength(3))
    assert stats.compactions > 0 and engine.stats.compactions > 0
    assert set(engine.stats.kernel_paths) == set(stats.kernel_paths) == {"greedy", "compact"}
    assert engine.stats.time_prefill > 0


def test_engine_compactions_count_on_after_its_batch_is_reset(compact_every_rollback):
    """A failure that resets the batch lets its target ledger go (and drops the drafter until its back-off of 16
    steps has passed): what that ledger compacted stays counted, and the next one's count adds to it."""
    model = cached_model("llama")
    engine = serve(model, ScriptedDrafter(wrong), FixedLength(3))
    before = engine.stats.compactions
    with pytest.warns(RuntimeWarning, match="the batch was reset"):
        engine.loop.reset_rows()
    engine.step()                        # nothing to serve: the stats are as they were
    assert engine.stats.compactions == before > 0
    handle = engine.submit(PROMPTS[1], max_new_tokens=24)      # long enough for the drafter to restart
    engine.run_until_idle()
    assert handle.result() == stock(model, PROMPTS[1], 24).tolist()
    assert engine.stats.restarts == 1 and engine.stats.compactions > before


def test_engine_reports_the_drafters_events_as_a_generate_call_does():
    """A chain's intermediate level fails: the chain drops it and says so in its events, which the engine's stats
    carry as a generate call's do."""
    model = cached_model("llama")
    draft = tiny_model("llama", seed=7, layers=1)

    def chain():
        return ChainDrafter([PromptLookupDrafter(2, 1), Breaks(draft, after=2)])

    engine = serve(model, chain(), FixedLength(3))
    stats = call(model, chain(), FixedLength(3))
    assert engine.fallback is None and stats.fallback is None
    assert any("OutOfMemoryError" in e for e in stats.drafter_events)
    assert any("OutOfMemoryError" in e for e in engine.stats.drafter_events)


class NoInputs(TakesInputs, ScriptedDrafter):
    """A drafter that fails on the target's inputs, before its begin."""

    def share_inputs(self, inputs):
        raise RuntimeError("no inputs for me")


def test_a_drafter_that_fails_before_its_begin_falls_back():
    model = cached_model("llama")
    with pytest.warns(RuntimeWarning, match="no inputs for me"):
        stats = call(model, NoInputs(wrong), FixedLength(3))
    assert stats.fallback.startswith("draft prefill failed (RuntimeError: no inputs for me)")
    assert stats.drafted == 0


# The operations that copy a device value to the host (on a GPU, each waits for the device): `item()` and `int()` of a
# tensor (both dispatch `item`), `bool()` (`is_nonzero`), `nonzero` (`nonzero_numpy` as a tuple) and `tolist()`
# (which dispatches one resolve_neg per call).
HOST_READS = {"aten._local_scalar_dense.default", "aten.item.default", "aten.is_nonzero.default",
              "aten.nonzero.default", "aten.nonzero_numpy.default", "aten.resolve_neg.default"}


def _ops_outside_forward(model, run, only: set | None = None) -> int:
    """Tensor operations `run()` dispatches outside `model`'s forward (a count, which no machine load moves); `only`:
    just those operations."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops, inside = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += not self.inside and (only is None or str(func) in only)
            return func(*args, **(kwargs or {}))

    count = Count()
    hooks = [model.register_forward_pre_hook(lambda *a: setattr(count, "inside", count.inside + 1)),
             model.register_forward_hook(lambda *a: setattr(count, "inside", count.inside - 1))]
    try:
        with torch.inference_mode(), count:
            run()
    finally:
        for hook in hooks:
            hook.remove()
    return count.ops


def test_a_step_without_drafts_dispatches_at_most_1_15_times_what_stocks_decode_step_does():
    """The host loop's weight, counted: per generated token beyond the first 8, the tensor operations outside the
    forward of a call without a drafter, and of one whose policy plans width 0, against stock's decode step."""
    model = cached_model("llama")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])

    def per_token(call) -> float:
        return (_ops_outside_forward(model, lambda: call(24)) - _ops_outside_forward(model, lambda: call(8))) / 16

    def spec(drafter):
        return lambda n: spec_generate(model, ids, torch.ones_like(ids), drafter, FixedLength(0), max_new_tokens=n)

    stock = per_token(lambda n: stock_greedy(model, ids, torch.ones_like(ids), eos_token_id=None, max_new_tokens=n))
    # Measured with transformers 5.24: stock 23 a token, no drafter 25, a planned width 0 25 (the policy reads no
    # row lengths, so none are gathered; every row keeps its one token, so nothing is masked).
    assert per_token(spec(None)) <= 1.15 * stock
    assert per_token(spec(ScriptedDrafter(lambda row, context, gamma: [5] * gamma))) <= 1.15 * stock


def test_a_step_without_drafts_reads_the_device_once_as_stocks_decode_step_does():
    """On a GPU every host read is a wait: a plain step copies its record's counts and the finished rows in one read,
    where stock's decode step reads once whether every row has finished."""
    model = cached_model("llama")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])

    def per_token(call) -> float:
        return (_ops_outside_forward(model, lambda: call(24), HOST_READS)
                - _ops_outside_forward(model, lambda: call(8), HOST_READS)) / 16

    def spec(drafter):
        return lambda n: spec_generate(model, ids, torch.ones_like(ids), drafter, FixedLength(0), max_new_tokens=n)

    assert per_token(lambda n: stock_greedy(model, ids, torch.ones_like(ids), eos_token_id=None,
                                            max_new_tokens=n)) == 1
    assert per_token(spec(None)) == 1
    assert per_token(spec(ScriptedDrafter(lambda row, context, gamma: [5] * gamma))) == 1


def test_a_drafting_step_dispatches_no_more_than_stocks_decode_step_per_generated_token():
    """The loop's own work when every draft is right (width 4: five tokens a forward), counted per generated token
    beyond the first 10, against stock's decode step: proposal checks, acceptance, commit and rollback included."""
    model = cached_model("llama")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    reference = stock_greedy(model, ids, torch.ones_like(ids), eos_token_id=None, max_new_tokens=40)[0].tolist()
    right = ScriptedDrafter(lambda row, context, gamma: reference[len(context): len(context) + gamma])

    def per_token(call) -> float:
        return (_ops_outside_forward(model, lambda: call(40)) - _ops_outside_forward(model, lambda: call(10))) / 30

    stock = per_token(lambda n: stock_greedy(model, ids, torch.ones_like(ids), eos_token_id=None, max_new_tokens=n))
    spec = per_token(lambda n: spec_generate(model, ids, torch.ones_like(ids), right, FixedLength(4),
                                             max_new_tokens=n))
    # Measured with transformers 5.20 and 5.24: stock 23 a token, the always-right width-4 loop 18.9-19.3 (97 a step).
    assert spec <= stock, (spec, stock)


def test_a_policy_that_reads_the_rows_lengths_gets_them_and_one_that_does_not_costs_none():
    """The loop hands `StepInfo.generated` and `remaining` over as functions run on first read: a policy that reads
    them sees every row's tokens so far and what it may still generate (ragged rows, rows that finish early); one
    that answers without them has none gathered (the plain step's operation count above)."""
    model = cached_model("llama")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [PAD, PAD, 7, 8, 9, 10], [PAD, 6, 7, 8, 9, 10]])
    mask = (ids != PAD).long()
    seen = []

    class Reading(FixedLength):
        def choose(self, info):
            seen.append((info.rows.tolist(), info.generated.tolist(), info.remaining.tolist()))
            return super().choose(info)

    out, stats = spec_generate(model, ids, mask, ScriptedDrafter(lambda row, context, gamma: [5] * gamma),
                               Reading(2), max_new_tokens=12)
    so_far = {row: 1 for row in range(3)}                    # the first token comes with the prefill
    for (rows, generated, remaining), record in zip(seen, stats.trace):
        assert rows == record.rows
        assert generated == [so_far[r] for r in rows]
        assert [g + r for g, r in zip(generated, remaining)] == [12] * len(rows)
        for row, committed in zip(record.rows, record.committed):
            so_far[row] += committed
    assert len(seen) == len(stats.trace) > 3


def test_what_a_row_may_still_generate_follows_the_end_stock_sets_when_every_row_has_stopped():
    """No EOS: a row a criterion stopped goes on until every row has, and the call then ends every row at the
    longest stop (`Stopper.settle` writes the rows' limits). A row behind that end is told the tokens left to it,
    not its first budget: a policy never sees a row that may generate past where the call ends."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    from conftest import Oracle

    model = cached_model("llama")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    mask = torch.ones_like(ids)
    start, budget = ids.shape[1], 24
    free = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=budget)

    class StopRows(StoppingCriteria):     # row 0 after 14 new tokens, row 1 after 3
        def __call__(self, input_ids, scores, **kwargs):
            after = {10: 14, 16: 3}[int(input_ids[0, start - 1])]
            return torch.tensor([input_ids.shape[1] - start >= after])

    seen = []

    class Reading(FixedLength):
        def choose(self, info):
            seen.append((info.generated.tolist(), info.remaining.tolist()))
            return super().choose(info)

    criteria = StoppingCriteriaList([StopRows()])
    out, _ = spec_generate(model, ids, mask, Oracle(free, mask, ["right", "wrong"]).drafter(), Reading(4),
                           max_new_tokens=budget, stopping_criteria=criteria)
    expected = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=budget, stopping_criteria=criteria)
    assert torch.equal(out, expected)
    end = out.shape[1] - start
    assert end < budget                                          # the call ended at the longest stop
    assert all(g + r <= end for generated, remaining in seen[-3:] for g, r in zip(generated, remaining))


def test_a_policy_that_reads_the_rows_lengths_after_choosing_is_told_to_read_them_inside_choose():
    """The lengths a StepInfo hands over lazily describe the step being chosen; read first after `choose` returned,
    they would describe a later one, so the read raises and names the fix instead."""
    model = cached_model("llama")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])

    class Late(FixedLength):
        def choose(self, info):
            self.info = info
            return super().choose(info)

        def observe(self, record):
            assert "remaining=<not read>" in repr(self.info)     # shown without computing (or raising)
            self.info.remaining

    with pytest.raises(RuntimeError, match="read it inside choose"):
        spec_generate(model, ids, torch.ones_like(ids), ScriptedDrafter(lambda row, context, gamma: [5] * gamma),
                      Late(2), max_new_tokens=8)


class _Reading(Drafter):
    """Always right, width 4, without a host read of its own: the reference continuation gathered on the device."""

    def __init__(self, reference: torch.Tensor):
        self.reference = reference

    def propose(self, request):
        columns = request.lengths[:, None] + torch.arange(4)
        return Proposal(self.reference[request.rows].gather(1, columns), request.gammas.clamp(max=4))


@pytest.mark.parametrize("batch", [1, 3])
def test_a_drafting_step_reads_the_device_at_most_twice(batch):
    """On a GPU every host read is a wait. A drafting step's own reads: the proposal's bounds (one copy, which also
    tells whether every row drafted the full width) and the step's counts (one copy, made before the rollback: over a
    cache without holes, what each row gives back gives the extent without a read of the slots). Whether any row
    drafts is known on the host (one width for every row, and room for it), a verification after a rollback that
    left no hole needs no hole check, and the committed tokens are written without an index list built from a
    mask."""
    model = cached_model("llama")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]] * batch)
    reference = stock_greedy(model, ids, torch.ones_like(ids), eos_token_id=None, max_new_tokens=70)

    def reads(n) -> int:
        return _ops_outside_forward(model, lambda: spec_generate(model, ids, torch.ones_like(ids), _Reading(reference),
                                                                 FixedLength(4), max_new_tokens=n), HOST_READS)

    # Two a step, and the buffer's room (`_reserve`), read once when it runs out: once in these 8 steps.
    assert (reads(51) - reads(11)) / 8 <= 2 + 1 / 8


class _NeverAskedForNone(ScriptedDrafter):
    """Fails the call if the loop asks it for no drafts in any row (the loop's contract: `StepPlan.drafts`)."""

    def propose(self, request):
        assert int(request.gammas.max()) > 0, "asked for no drafts"
        return super().propose(request)


@pytest.mark.parametrize("width", [1, 4])
@pytest.mark.parametrize("budget", [2, 3, 5, 6, 9, 12])
def test_a_drafter_is_never_asked_for_no_drafts_when_the_loop_knows_on_the_host_that_some_row_drafts(width, budget):
    """The loop keeps a host bound below every row's tokens left and skips the read of whether any row drafts while
    the bound leaves room; near the end (a budget the widths do not divide, rows that finish at an EOS) it reads
    again, so no drafter is asked for nothing, and the output is stock's."""
    model = cached_model("llama")
    ids, mask = ragged_batch(3, seed=4)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=budget)
    right = _NeverAskedForNone(lambda row, context, gamma: [5] * gamma)
    out, stats = spec_generate(model, ids, mask, right, FixedLength(width), max_new_tokens=budget)
    assert torch.equal(out, reference)
    assert stats.fallback is None


@pytest.mark.parametrize("batch", [1, 3])
def test_a_drafting_step_with_a_draft_model_reads_the_device_at_most_four_times(batch):
    """The draft model's own reads, on top of the loop's two: the widths' and the catch-up's ends (one copy) and
    its rollback's extent. Without an early exit or a stop rule, which rows go on drafting is known from the widths,
    its forwards where every row feeds (equal widths, rows as far behind) need no hole check, and the tokens whose
    KV it writes are counted on the device (`kv_writes` reads them)."""
    model = cached_model("llama")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]] * batch)

    def reads(n) -> int:      # the target drafting for itself: every draft is right
        return _ops_outside_forward(model, lambda: spec_generate(model, ids, torch.ones_like(ids), ModelDrafter(model),
                                                                 FixedLength(4), max_new_tokens=n), HOST_READS)

    assert (reads(51) - reads(11)) / 8 <= 4 + 1 / 8


def test_a_draft_models_written_token_count_stays_on_the_device_in_a_few_tensors():
    """`ModelDrafter.kv_writes` is counted on the device as the draft runs (no read a step) and folded into one
    tensor now and then, so a long run keeps a few counts, not one per step; reading it gives the total, once."""
    model = cached_model("llama")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    drafter = ModelDrafter(tiny_model("llama", seed=9, layers=1))
    spec_generate(model, ids, torch.ones_like(ids), drafter, FixedLength(1), max_new_tokens=150)
    assert 0 < len(drafter._writes) < 64
    total = drafter.kv_writes
    assert total >= 150 // 2 and drafter._writes == [] and drafter.kv_writes == total
