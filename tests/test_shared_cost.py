"""One step-cost model per call and per serving engine (`spec_adapt.policies.cost.share_cost`): the policy, the
several-source router, the early-exit gate and a chain scheduler hold the same `StepCost`, and its one writer observes
each step into it exactly once, on the verification path the step took."""

from __future__ import annotations

import pytest
import torch

from spec_adapt import Adaptive, ChainDrafter, ChainScheduler, EarlyExitVerifier, FixedLength, PromptLookupDrafter
from spec_adapt.drafters.sources import MultiSourceDrafter
from spec_adapt.policies.cost import StepCost
from spec_adapt.serving.engine import Engine

from conftest import PAD, stock_greedy
from test_sources import GOOD_DRAFT, TARGET, AdaptiveDraftingThree, looping_batch, one_thread, run  # noqa: F401


@pytest.fixture
def observed(monkeypatch):
    """Every verification observed into any StepCost, in order: (the instance, the path)."""
    seen = []
    observe = StepCost.observe_verify

    def spy(self, batch, fed, seconds, path="full"):
        seen.append((self, path))
        observe(self, batch, fed, seconds, path)

    monkeypatch.setattr(StepCost, "observe_verify", spy)
    return seen


def handed_costs(drafter) -> list:
    """The step-cost models the router is handed, one per routed step."""
    handed, route = [], drafter.route
    drafter.route = lambda *a, **k: handed.append(a[5].cost) or route(*a, **k)    # (batch, ..., rows, cost, lags)
    return handed


def told(policy) -> list:
    """The records the policy observes, in order."""
    records, observe = [], policy.observe
    policy.observe = lambda record: records.append(record) or observe(record)
    return records


@pytest.mark.parametrize("kind", ["adaptive", "fixed"])
def test_a_call_holds_one_step_cost(kind):
    """The router, the gate and the policy of one generate call read one StepCost: the policy's where it keeps one,
    else the call's own."""
    ids, mask = looping_batch(3, seed=40, distinct=[1])
    policy = AdaptiveDraftingThree() if kind == "adaptive" else FixedLength(3)
    drafter, verifier = MultiSourceDrafter(GOOD_DRAFT), EarlyExitVerifier()
    handed = handed_costs(drafter)
    out, stats = run(TARGET, ids, mask, drafter, policy, verifier=verifier)
    assert torch.equal(out, stock_greedy(TARGET, ids, mask, eos_token_id=None, max_new_tokens=30))
    cost = verifier.cost.cost
    assert isinstance(cost, StepCost) and handed and all(c is cost for c in handed)
    assert cost is policy.cost if kind == "adaptive" else policy.cost is None
    assert cost.verify and cost is not drafter.state.cost and not drafter.state.cost.verify


def test_a_chain_scheduler_shares_its_length_policys_step_cost(observed):
    """ChainScheduler(length_policy=Adaptive()) holds the length policy's StepCost, which the gate reads too; the
    length policy writes each step's verification once, the scheduler none."""
    ids, mask = looping_batch(2, seed=41)
    length = Adaptive()
    chain = ChainDrafter([PromptLookupDrafter(), GOOD_DRAFT])
    scheduler = ChainScheduler(chain, length_policy=length)
    assert scheduler.cost is length.cost
    records = told(length)
    verifier = EarlyExitVerifier()
    out, _ = run(TARGET, ids, mask, chain, scheduler, verifier=verifier)
    assert torch.equal(out, stock_greedy(TARGET, ids, mask, eos_token_id=None, max_new_tokens=30))
    assert verifier.cost.cost is length.cost is scheduler.cost
    assert records and [path for _, path in observed] == [r.path for r in records]
    assert all(instance is length.cost for instance, _ in observed)


@pytest.mark.parametrize("kind", ["adaptive", "fixed"])
def test_an_engine_holds_one_step_cost(kind):
    """The serving engine makes one StepCost for everything it serves: its policy's, or its own, which the router
    and the gate read."""
    ids, mask = looping_batch(3, seed=42, distinct=[1])
    policy = AdaptiveDraftingThree() if kind == "adaptive" else FixedLength(3)
    drafter, verifier = MultiSourceDrafter(GOOD_DRAFT), EarlyExitVerifier()
    handed = handed_costs(drafter)
    engine = Engine(TARGET, drafter=drafter, assistant_policy=policy, verifier=verifier, max_batch=3,
                    eos_token_id=None, pad_token_id=PAD)
    prompts = [ids[b, mask[b] == 1].tolist() for b in range(len(ids))]
    handles = [engine.submit(prompt, max_new_tokens=20) for prompt in prompts]
    engine.run_until_idle()
    for b, handle in enumerate(handles):
        assert handle.result() == stock_greedy(TARGET, ids[b : b + 1, mask[b] == 1], None, eos_token_id=None,
                                               max_new_tokens=20)[0, len(prompts[b]):].tolist()
    cost = verifier.cost.cost
    assert engine.loop.policy.cost.cost is cost and handed and all(c is cost for c in handed)
    assert cost is policy.cost if kind == "adaptive" else cost is engine.loop.policy.own_cost
    assert cost.verify


@pytest.mark.parametrize("kind", ["adaptive", "fixed"])
def test_each_step_is_observed_once_on_the_path_it_took(kind, observed):
    """With an early-exit gate and the several-source router, every step the policy observes puts one verification
    into the call's StepCost, on the path the gate took ("full" or "pruned"), and none goes anywhere else: the gate
    and the router only read. Under a policy that keeps no model, the loop is that one writer."""
    ids, mask = looping_batch(3, seed=40, distinct=[1])
    policy = AdaptiveDraftingThree() if kind == "adaptive" else FixedLength(3)
    records = told(policy)
    drafter, verifier = MultiSourceDrafter(GOOD_DRAFT), EarlyExitVerifier()
    out, stats = run(TARGET, ids, mask, drafter, policy, verifier=verifier)
    assert torch.equal(out, stock_greedy(TARGET, ids, mask, eos_token_id=None, max_new_tokens=30))
    cost = verifier.cost.cost
    assert records and {"full", "pruned"} <= {r.path for r in records}
    assert [path for _, path in observed] == [r.path for r in records]          # one per step, its own path
    assert all(instance is cost for instance, _ in observed)
    pruned = sum(samples for (path, *_), (_, samples) in cost.verify.items() if path == "pruned")
    assert pruned == sum(r.path == "pruned" for r in records) == stats.verifier["pruned_steps"]
