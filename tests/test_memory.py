"""Admission under a memory budget, and draft offload / reload driven by it (Nightjar's elastic memory) inside the
serving engine: never over budget, every request token-identical to stock generate, the batch grows once the draft
has left and the draft comes back when the load falls."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spec_adapt import Adaptive, FixedLength, ModelDrafter
from spec_adapt.drafters.offload import DraftOffload
from spec_adapt.serving.memory import MemoryBudget, kv_bytes_per_token, reserved_tokens, weight_bytes
from spec_adapt.policies.policy import Policy
from spec_adapt.serving.engine import Engine, RequestError

from conftest import PAD, VOCAB, cached_model, drive_engine, tiny_model

MODEL = cached_model("llama")


def stock(prompt, n):
    ids = torch.tensor([prompt])
    out = MODEL.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=PAD)
    return out[0, len(prompt):].tolist()


class PlainWhenBusy(Policy):
    """γ = `gamma` while at most `quiet` rows run, 0 above: speculation off under load, as a learned policy does."""

    needs_timing = False

    def __init__(self, gamma=3, quiet=1):
        self.gamma, self.quiet = gamma, quiet

    def choose(self, info):
        return 0 if info.batch_size > self.quiet else self.gamma

    def observe(self, record):
        pass


def budget_for(rows_with_draft, tokens, draft):
    """Bytes for the target, the draft and `rows_with_draft` requests of `tokens` tokens (KV in both models)."""
    per_token = kv_bytes_per_token(MODEL) + kv_bytes_per_token(draft)
    return weight_bytes(MODEL) + weight_bytes(draft) + rows_with_draft * tokens * per_token


class Checked(Engine):
    """An engine that asserts the budget holds after every step."""

    def step(self):
        busy = super().step()
        assert self.memory.used() <= self.memory.total, (self.memory.used(), self.memory.total)
        return busy


serve = drive_engine


def test_batch_grows_after_offload_and_draft_returns_when_load_falls(tmp_path):
    draft = tiny_model("llama", seed=0)                       # the target's own weights: always right
    offload = DraftOffload(ModelDrafter(draft), low=0, persist=2, folder=tmp_path / "d")
    prompts = [[5 + i, 9, 11, 4 + i] for i in range(6)] + [[30, 31, 32]]
    budgets = [12] * 6 + [20]
    memory = MemoryBudget(budget_for(2, 4 + 12, draft))       # 2 requests with the draft in, many more without
    assert memory.total < weight_bytes(MODEL) + weight_bytes(draft) + 3 * 16 * (
        kv_bytes_per_token(MODEL) + kv_bytes_per_token(draft))
    engine = Checked(MODEL, drafter=offload, assistant_policy=PlainWhenBusy(), max_batch=6, eos_token_id=None,
                     pad_token_id=PAD, memory=memory, timeline=True)
    handles = serve(engine, prompts, budgets, arrivals=[0] * 6 + [40])
    assert engine.fallback is None
    for prompt, n, handle in zip(prompts, budgets, handles):
        assert handle.result() == stock(prompt, n)
    events = [e["event"] for e in offload.events]
    assert events[:2] == ["offload", "reload"], events
    sizes = [s["batch_size"] for s in engine.timeline]
    resident = [s["draft_resident"] for s in engine.timeline]
    assert max(b for b, r in zip(sizes, resident) if r) <= 2         # the budget held the batch while resident
    assert max(b for b, r in zip(sizes, resident) if not r) > 2      # ... and it grew once the draft had left
    late = [s for s in engine.timeline if s["draft_resident"]][-3:]   # the last request drafts again
    assert any(max(s["gammas"]) > 0 for s in late)


def test_a_head_that_fits_only_without_the_draft_does_not_deadlock(tmp_path):
    draft = tiny_model("llama", seed=0)
    offload = DraftOffload(ModelDrafter(draft), low=0, persist=2, folder=tmp_path / "d")
    memory = MemoryBudget(weight_bytes(MODEL) + weight_bytes(draft) + 10 * kv_bytes_per_token(MODEL))
    engine = Checked(MODEL, drafter=offload, assistant_policy=FixedLength(3), max_batch=4, eos_token_id=None,
                     pad_token_id=PAD, memory=memory)
    handle = engine.submit([5, 9, 11, 4], max_new_tokens=12)       # 16 tokens: too big beside the draft
    engine.run_until_idle(max_steps=100)
    assert handle.done and handle.result() == stock([5, 9, 11, 4], 12)
    assert offload.events[0]["event"] == "offload"


def test_requests_that_never_fit_are_rejected_on_their_handle():
    draft = tiny_model("llama", seed=7, layers=1)
    memory = MemoryBudget(weight_bytes(MODEL) + weight_bytes(draft) + 20 * (kv_bytes_per_token(MODEL)
                                                                              + kv_bytes_per_token(draft)))
    engine = Engine(MODEL, drafter=draft, assistant_policy=FixedLength(2), max_batch=4, eos_token_id=None, pad_token_id=PAD,
                    memory=memory)
    too_big = engine.submit([5, 9, 11, 4], max_new_tokens=30)
    fine = engine.submit([5, 9, 11, 4], max_new_tokens=10)
    engine.run_until_idle()
    assert too_big.state == "failed" and isinstance(too_big.error, RequestError)
    assert "budget" in str(too_big.error)
    assert fine.result() == stock([5, 9, 11, 4], 10)


def test_budget_arguments_are_checked():
    with pytest.raises(ValueError, match="positive"):
        MemoryBudget(0)
    with pytest.raises(ValueError, match="no room for KV"):
        Engine(MODEL, memory=MemoryBudget(weight_bytes(MODEL)), eos_token_id=None, pad_token_id=PAD)


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 4), policy=st.sampled_from(["busy", "adaptive", "fixed"]),
       persist=st.integers(1, 4))
def test_never_over_budget_and_every_request_matches_stock(tmp_path_factory, seed, rows, policy, persist):
    rng = random.Random(seed)
    n = rng.randrange(2, 9)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 9))] for _ in range(n)]
    budgets = [rng.randrange(1, 16) for _ in range(n)]
    arrivals = sorted(rng.randrange(0, 20) for _ in range(n))
    draft = tiny_model("llama", seed=0)
    offload = DraftOffload(ModelDrafter(draft), low=0, persist=persist, folder=tmp_path_factory.mktemp("d"))
    chooser = {"busy": PlainWhenBusy(), "adaptive": Adaptive(), "fixed": FixedLength(2)}[policy]
    memory = MemoryBudget(budget_for(rows, 24, draft))
    engine = Checked(MODEL, drafter=offload, assistant_policy=chooser, max_batch=6, eos_token_id=None, pad_token_id=PAD,
                     memory=memory)
    handles = serve(engine, prompts, budgets, arrivals)
    assert engine.fallback is None
    for prompt, b, handle in zip(prompts, budgets, handles):
        assert handle.state == "done" and handle.result() == stock(prompt, b)
    assert all(reserved_tokens(h) > 0 for h in handles)


def test_serve_bench_phases_memory_and_residency(tmp_path):
    """The memory-pressure run's machinery: a phased schedule, a budget per engine, the draft reloaded after the
    run (its weights are shared with the next configuration), residency in the timeline and the plot."""
    from spec_adapt.tools import serve_bench as sb

    phases = sb.parse_phases("40:0.1,400:0.05,40:0.1")
    arrivals = sb.phased_schedule(phases, n_prompts=3, seed=2)
    assert arrivals == sb.phased_schedule(phases, n_prompts=3, seed=2)
    assert all(a < b for (a, _), (b, _) in zip(arrivals, arrivals[1:])) and arrivals[-1][0] <= 0.25
    with pytest.raises(ValueError, match="RATE:SECONDS"):
        sb.parse_phases("fast")
    with pytest.raises(ValueError, match="positive"):
        sb.parse_phases("0:10")
    draft = tiny_model("llama", seed=0)
    prompts = [torch.tensor([5 + i, 9, 11, 4]) for i in range(3)]
    offload = DraftOffload(ModelDrafter(draft), low=0, persist=2, folder=tmp_path / "d")
    engine = Engine(MODEL, drafter=offload, assistant_policy=PlainWhenBusy(), max_batch=8, max_new_tokens=12,
                    eos_token_id=None, pad_token_id=PAD, memory=MemoryBudget(budget_for(2, 16, draft)))
    out = sb.serve(engine, prompts, [(0.0, i % 3) for i in range(6)])
    assert out["requests"] == 6 and out["tokens"] == 6 * 12 and out["offloads"] >= 1
    assert not offload.offloaded                                  # reloaded for whoever uses the draft next
    assert 0 < out["resident_share"] < 1 and all("rss_mb" in s for s in out["steps"])
    rows = sb.write([{"rate": "40:0.1", "config": "offload:busy", **out}], tmp_path / "out", {})
    assert (tmp_path / "out" / "serve.png").exists() and rows[0]["offloads"] == out["offloads"]
