"""A serving engine that runs for days: per-request state lives in slots recycled when a request leaves, so what the
engine holds is bounded by `max_batch`, not by the requests it has served; a long request widens nothing after it
leaves; and speculation comes back after a drafter's failure, after a back-off."""

from __future__ import annotations

import pytest
import torch

from spec_adapt import Adaptive, Engine, FixedLength, ModelDrafter, PromptLookupDrafter, ScriptedDrafter
from spec_adapt.metrics import SpecStats
from spec_adapt.policies import ElasticEWMA, Heuristic, PerRequest
from spec_adapt.drafters.suffix import SuffixDrafter

from conftest import EOS, PAD, VOCAB, cached_model, tiny_model

MODEL = cached_model("llama")


def stock(prompt, n, eos=EOS):
    ids = torch.tensor([prompt])
    out = MODEL.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=eos, pad_token_id=PAD)
    return out[0, len(prompt):].tolist()


def prompts(n, seed=0, low=2, high=10):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(low, high, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def serve(engine, batch, budget=6):
    handles = [(p, engine.submit(p, max_new_tokens=budget)) for p in batch]
    engine.run_until_idle()
    return handles


@pytest.mark.parametrize("drafter", ["lookup", "suffix", "model"])
def test_engine_state_is_bounded_by_its_slots(drafter):
    """After hundreds of requests through 3 slots, every per-request structure (buffer, lengths, per-row stats, the
    drafter's per-row lists, the policy's per-row tables) holds at most the slots, and outputs equal stock."""
    made = {"lookup": lambda: PromptLookupDrafter(2, 1), "suffix": lambda: SuffixDrafter(),
            "model": lambda: ModelDrafter(tiny_model("llama", seed=7, layers=1))}[drafter]()
    policy = Adaptive()
    engine = Engine(MODEL, drafter=made, assistant_policy=policy, max_batch=3, eos_token_id=EOS, pad_token_id=PAD)
    batch = prompts(240, seed=1)
    for p, h in serve(engine, batch):
        assert h.result() == stock(p, 6)
    loop = engine.loop
    rows = loop.rows_state
    assert rows.buffer.shape[0] <= 3 and len(rows.lengths) <= 3 and len(rows.starts) <= 3 and len(rows.limits) <= 3
    assert len(engine.stats.per_row_new_tokens) <= 3 and len(engine.stats.per_row_steps) <= 3
    assert policy.row_tried.shape[0] <= 4 and policy.row_expected.shape[0] <= 4
    pad = getattr(made, "pad", None)
    assert pad is None or len(pad) <= 3
    assert engine.stats.batch_size == 240                  # requests admitted, counted


def test_totals_count_every_request_served():
    engine = Engine(MODEL, drafter=PromptLookupDrafter(2, 1), assistant_policy=FixedLength(2), max_batch=2,
                    eos_token_id=None, pad_token_id=PAD)
    handles = serve(engine, prompts(30, seed=2), budget=5)
    assert engine.stats.new_tokens == 30 * 5 == sum(len(h.result()) for _, h in handles)


def test_a_reused_slot_forgets_the_request_before():
    """A slot's per-row state starts afresh for its next request: the policy's tables, the drafter's padding."""
    seen = []

    def script(row, context, gamma):
        seen.append((row, tuple(context[:2])))
        return [3] * gamma

    engine = Engine(MODEL, drafter=ScriptedDrafter(script), assistant_policy=FixedLength(2), max_batch=1,
                    eos_token_id=EOS, pad_token_id=PAD)
    long_first, short_next = list(range(3, 15)), [40, 41]          # different left paddings in the same slot
    for p, h in serve(engine, [long_first, short_next], budget=4):
        assert h.result() == stock(p, 4)
    assert {row for row, _ in seen} == {0}
    assert (0, (40, 41)) in seen                                     # the script saw the new request's own context


@pytest.mark.parametrize("make", [Adaptive, Heuristic, ElasticEWMA, PerRequest])
def test_policies_forget_a_slot_when_a_new_request_takes_it(make):
    """After `admit([1])`, row 1 is decided like a row never seen (row 9), though its old request had taught the
    policy something different."""
    from spec_adapt.metrics import StepRecord
    from spec_adapt.policies.policy import StepInfo

    policy = make()
    policy.begin(0)
    policy.admit([0, 1])
    record = StepRecord(batch_size=2, rows=[0, 1], gammas=[4, 4], drafted=[4, 4], accepted=[4, 0],
                        committed=[5, 1], step_time=0.01, draft_time=0.001, verify_time=0.008)
    for _ in range(6):
        policy.choose(StepInfo(2, torch.tensor([0, 1]), torch.tensor([3, 3]), torch.tensor([50, 50]), 1))
        policy.observe(record)

    def decision(row):
        if isinstance(policy, Adaptive):
            return policy.expected(torch.tensor([row]))[0].tolist()
        if isinstance(policy, PerRequest):
            return policy._optimistic_rates(row)
        info = StepInfo(1, torch.tensor([row]), torch.tensor([3]), torch.tensor([50]), 12)
        return int(torch.as_tensor(policy.choose(info))[0])

    assert decision(1) != decision(9)          # slot 1's request was learned
    policy.admit([1])
    assert decision(1) == decision(9)
    assert decision(0) != decision(9)          # the other slot keeps its request's state


def test_stats_admit_recycles_slots():
    stats = SpecStats()
    stats.start(0)
    stats.admit([0, 1])
    stats.per_row_new_tokens[1] = 7
    stats.admit([1])
    assert stats.per_row_new_tokens == [0, 0] and stats.batch_size == 3


def test_a_long_request_widens_nothing_after_it_leaves():
    engine = Engine(MODEL, drafter=PromptLookupDrafter(2, 1), assistant_policy=FixedLength(2), max_batch=2,
                    eos_token_id=EOS, pad_token_id=PAD)
    serve(engine, [list(range(3, 90)) * 3], budget=40)               # 261 + 40 tokens
    assert engine.loop.rows_state.buffer.shape[1] >= 300
    for p, h in serve(engine, prompts(6, seed=3), budget=6):
        assert h.result() == stock(p, 6)
    assert engine.loop.rows_state.buffer.shape[1] <= 64
    assert engine.loop.target is None or engine.loop.target.physical_length <= 64


class FailsOnce(PromptLookupDrafter):
    def __init__(self, at_call):
        super().__init__(2, 1)
        self.calls, self.at_call = 0, at_call

    def propose(self, request):
        self.calls += 1
        if self.calls == self.at_call:
            raise RuntimeError("transient draft failure")
        return super().propose(request)


def test_speculation_comes_back_after_a_transient_drafter_failure():
    """A drafter that failed once is tried again after a back-off, here with the batch idle in between (the next
    test restarts it under running rows)."""
    drafter = FailsOnce(at_call=2)
    engine = Engine(MODEL, drafter=drafter, assistant_policy=FixedLength(2), max_batch=4, eos_token_id=None,
                    pad_token_id=PAD)
    repeat = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]]
    with pytest.warns(RuntimeWarning, match="transient"):
        handles = serve(engine, repeat, budget=6) + serve(engine, repeat * 2, budget=6)
    for p, h in handles:
        assert h.result() == stock(p, 6, None)
    assert engine.loop.drafter is None and "transient" in engine.fallback
    drafted = engine.stats.drafted
    later = serve(engine, repeat * 2 + prompts(2, seed=4), budget=60)
    for p, h in later:
        assert h.result() == stock(p, 60, None)
    assert engine.loop.drafter is drafter and engine.stats.drafted > drafted


def test_speculation_comes_back_while_rows_are_running():
    """The restart happens between steps of a running batch: the rows already running get drafts again."""
    drafter = FailsOnce(at_call=3)
    engine = Engine(MODEL, drafter=drafter, assistant_policy=FixedLength(2), max_batch=4, eos_token_id=None,
                    pad_token_id=PAD)
    repeat = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    handles = [(p, engine.submit(p, max_new_tokens=200)) for p in [repeat, repeat[1:], repeat[2:]]]
    with pytest.warns(RuntimeWarning, match="transient"):
        engine.run_until_idle()
    for p, h in handles:
        assert h.result() == stock(p, 200, None)
    drafted_after = [r.drafted for r in engine.stats.trace if r.batch_size == 3][-5:]
    assert any(sum(d) for d in drafted_after)


def test_a_model_drafter_restarts_on_running_rows_and_stays_identical():
    draft = ModelDrafter(tiny_model("llama", seed=7, layers=1))
    engine = Engine(MODEL, drafter=draft, assistant_policy=FixedLength(3), max_batch=3, eos_token_id=None,
                    pad_token_id=PAD)
    engine.loop.restarts.start = engine.loop.restarts.gap = 4      # restart soon
    batch = prompts(3, seed=6)
    handles = [(p, engine.submit(p, max_new_tokens=80)) for p in batch]
    for _ in range(3):
        engine.step()
    with pytest.warns(RuntimeWarning, match="draft lost"):
        engine.loop._guard("test", lambda: (_ for _ in ()).throw(RuntimeError("draft lost")))
    assert engine.loop.drafter is None
    engine.run_until_idle()
    for p, h in handles:
        assert h.result() == stock(p, 80, None)
    assert engine.loop.drafter is draft
    assert sum(sum(r.drafted) for r in engine.stats.trace[-10:]) > 0
