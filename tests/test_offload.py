"""Draft offload and reload in the middle of a call: output stays token-identical to stock generate; a reload that
fails continues without the draft and loses nothing."""

from __future__ import annotations

import shutil

import pytest
import torch

from spec_adapt import Adaptive, FixedLength, ModelDrafter

from spec_adapt.policies import Nightjar
from spec_adapt.drafters.offload import DraftOffload
from spec_adapt.policies.policy import Policy

from conftest import PAD, cached_model, ragged_batch, spec_generate, stock_greedy, tiny_model


def draft_model():
    # The target's own weights as the draft: it is always right, so every speculative step drafts and accepts.
    return tiny_model("llama", seed=0)


class Script(Policy):
    """γ by step number: `plain` steps run at 0, the rest at `gamma`."""

    needs_timing = False

    def __init__(self, gamma, plain):
        self.gamma, self.plain, self.step = gamma, set(plain), 0

    def begin(self, batch_size):
        self.step = 0

    def choose(self, info):
        return 0 if info.step in self.plain else self.gamma

    def observe(self, record):
        pass


class Pressure:
    """free_memory(): short between steps `short[0]` and `short[1]` (counted by the drafter's observe calls)."""

    def __init__(self, offload, short):
        self.offload, self.short = offload, short

    def __call__(self):
        step = self.offload._steps
        return 0 if self.short[0] <= step < self.short[1] else 1 << 40


def run(model, ids, mask, drafter, policy, **kw):
    return spec_generate(model, ids, mask, drafter, policy, **{"max_new_tokens": 40, **kw})


@pytest.mark.parametrize("batch", [1, 3])
def test_identity_through_offload_and_reload(batch, tmp_path):
    model = cached_model("llama")
    ids, mask = ragged_batch(batch, seed=batch)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=40)
    offload = DraftOffload(ModelDrafter(draft_model()), low=1, persist=2, folder=tmp_path / "draft")
    offload.free_memory = Pressure(offload, (3, 7))
    out, stats = run(model, ids, mask, offload, Script(3, plain=range(1, 5)))
    assert torch.equal(out, reference)
    assert stats.fallback is None
    kinds = [e["event"] for e in offload.events]
    assert kinds == ["offload", "reload"]
    off, on = (e["step"] for e in offload.events)
    drafted = [max(r.drafted) for r in stats.trace]
    assert all(d == 0 for d in drafted[off:on]) and max(drafted[on:]) > 0      # drafting resumed after reload
    # The draft is the target itself: with its KV rebuilt right after the reload, every draft is accepted.
    assert stats.accepted == stats.drafted > 0


@pytest.mark.parametrize("policy", ["adaptive", "nightjar"])
def test_manual_offload_with_a_learning_policy(policy, tmp_path):
    model = cached_model("llama")
    ids, mask = ragged_batch(4, seed=9)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=40)
    offload = DraftOffload(ModelDrafter(draft_model()), folder=tmp_path / "d", free_memory=lambda: 1 << 40)
    inner = Adaptive() if policy == "adaptive" else Nightjar(max_gamma=4)

    class Driver(Policy):
        needs_timing = inner.needs_timing

        def begin(self, batch_size):
            inner.begin(batch_size)

        def choose(self, info):
            if info.step == 3:
                offload.offload()
            return inner.choose(info)

        def observe(self, record):
            inner.observe(record)

    offload.low = 1 << 41          # stay away until the memory check says otherwise...
    calls = {"n": 0}

    def memory():
        calls["n"] += 1
        return 0 if calls["n"] < 6 else 1 << 42       # ...then free: reload
    offload.free_memory = memory
    out, stats = run(model, ids, mask, offload, Driver())
    assert torch.equal(out, reference)
    assert [e["event"] for e in offload.events][:2] == ["offload", "reload"]
    assert stats.fallback is None


def test_weights_leave_and_come_back_exactly(tmp_path):
    draft = draft_model()
    before = {n: p.detach().clone() for n, p in draft.named_parameters()}
    offload = DraftOffload(draft, folder=tmp_path / "w")
    size = offload.size
    offload.offload()
    assert offload.offloaded and not offload.available()
    assert all(p.numel() == 0 for p in draft.parameters())
    assert offload.size == size
    offload.reload()
    for n, p in draft.named_parameters():
        assert torch.equal(p, before[n])


def test_bfloat16_weights_round_trip(tmp_path):
    draft = draft_model().to(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in draft.named_parameters()}
    offload = DraftOffload(draft, folder=tmp_path / "bf")
    offload.offload()
    offload.reload()
    for n, p in draft.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, before[n])


def test_failed_reload_falls_back_without_losing_tokens(tmp_path):
    model = cached_model("llama")
    ids, mask = ragged_batch(3, seed=4)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=40)
    folder = tmp_path / "gone"
    offload = DraftOffload(ModelDrafter(draft_model()), low=1, persist=2, folder=folder)

    def memory():
        if offload.offloaded and folder.exists():
            shutil.rmtree(folder)                         # the offload copy vanished: the reload must fail
        return 0 if offload._steps < 6 else 1 << 40
    offload.free_memory = memory
    with pytest.warns(RuntimeWarning, match="observe"):
        out, stats = run(model, ids, mask, offload, Script(3, plain=range(1, 5)))
    assert torch.equal(out, reference)
    assert stats.fallback is not None and "observe" in stats.fallback
    assert [e["event"] for e in offload.events] == ["offload", "reload failed"]


def test_engine_admits_rows_while_the_draft_is_away(tmp_path):
    from spec_adapt.serving.engine import Engine

    model = cached_model("llama")
    offload = DraftOffload(ModelDrafter(draft_model()), folder=tmp_path / "e", free_memory=lambda: 1 << 40)
    engine = Engine(model, drafter=offload, assistant_policy=FixedLength(3), max_batch=4, eos_token_id=None, pad_token_id=PAD)
    prompts = [[5, 9, 11, 4], [7, 7, 3], [20, 21, 22, 23, 24], [8, 3]]
    handles = [engine.submit(prompts[0], max_new_tokens=20)]
    engine.step()
    offload.offload()
    handles += [engine.submit(p, max_new_tokens=20) for p in prompts[1:3]]
    engine.step()
    engine.step()
    offload.reload()
    handles.append(engine.submit(prompts[3], max_new_tokens=20))
    engine.run_until_idle()
    assert engine.fallback is None
    for p, h in zip(prompts, handles):
        ref = stock_greedy(model, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long), eos_token_id=None,
                           max_new_tokens=20)
        assert h.result() == ref[0, len(p):].tolist()
    assert max(max(r.drafted) for r in engine.stats.trace[-3:]) > 0 or engine.stats.drafted > 0


def test_offload_arguments_are_checked():
    with pytest.raises(ValueError, match="persist"):
        DraftOffload(draft_model(), persist=0)


def test_offload_refuses_a_drafter_whose_model_it_cannot_move():
    """DraftOffload moves one draft model's weights: the several-source drafter is refused with the form that offloads
    its draft model, a drafter with no model at all as having nothing to offload, both before anything is copied."""
    from spec_adapt import MultiSourceDrafter, PromptLookupDrafter, SuffixDrafter

    draft = draft_model()
    storage = [p.data_ptr() for p in draft.parameters()]
    with pytest.raises(ValueError, match=r"MultiSourceDrafter\(DraftOffload\(ModelDrafter\(draft\)\)"):
        DraftOffload(MultiSourceDrafter(draft))
    assert [p.data_ptr() for p in draft.parameters()] == storage           # nothing was copied
    for model_free in (PromptLookupDrafter(), SuffixDrafter(), MultiSourceDrafter(None)):
        with pytest.raises(ValueError, match="nothing to offload"):
            DraftOffload(model_free)


def test_the_several_source_drafter_offloads_its_draft_model(tmp_path):
    """The form the refusal names, MultiSourceDrafter(DraftOffload(ModelDrafter(draft))): the draft model leaves and
    comes back inside the several-source drafter, the output is stock's, and the draft drafts again after."""
    from spec_adapt import MultiSourceDrafter

    model = cached_model("llama")
    ids, mask = ragged_batch(3, seed=3)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=40)
    offload = DraftOffload(ModelDrafter(draft_model()), low=1, persist=2, folder=tmp_path / "multi")
    offload.free_memory = Pressure(offload, (3, 7))
    out, stats = run(model, ids, mask, MultiSourceDrafter(offload), Script(3, plain=range(1, 5)))
    assert torch.equal(out, reference) and stats.fallback is None
    assert [e["event"] for e in offload.events] == ["offload", "reload"]
    on = offload.events[1]["step"]
    model_rows = [d for r in stats.trace[on:] for d, f in zip(r.drafted, r.free or [False] * r.batch_size) if not f]
    assert max(model_rows, default=0) > 0
