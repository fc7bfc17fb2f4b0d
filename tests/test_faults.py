"""Faults and bad inputs: a failing target (in prefill, in verification, in the middle of a forward), a stopped or
undriven engine, malformed requests. Every handle ends, the unaffected requests stay identical to stock, and the
engine goes on serving."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spec_adapt import Engine, FixedLength, ModelDrafter, PromptLookupDrafter
from spec_adapt.ledger import KVLedger
from spec_adapt.serving.engine import EngineError

from conftest import PAD, cached_model, tiny_model

EOS = 2


class Fault:
    """Raises once, on the first call for which `when(module, kwargs)` holds, while armed."""

    def __init__(self, when):
        self.when, self.armed, self.fired = when, False, 0

    def __call__(self, module, args, kwargs):
        if self.armed and self.when(module, kwargs):
            self.armed = False
            self.fired += 1
            raise RuntimeError("injected fault")


def cached_length(kwargs) -> int:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return cache.get_seq_length() if cache is not None else 0


def stock(model, prompt, budget):
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=budget,
                         eos_token_id=EOS, pad_token_id=PAD)
    return out[0, len(prompt):].tolist()


def prompts(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (int(torch.randint(3, 9, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def test_failed_forward_cuts_the_cache_back():
    model = tiny_model("llama")
    ledger = KVLedger(model)
    ids = torch.randint(3, 90, (2, 6))
    with torch.no_grad():
        ledger.prefill(ids, None)
        fault = Fault(lambda m, kw: True)
        hook = model.model.layers[1].register_forward_pre_hook(fault, with_kwargs=True)
        fault.armed = True
        with pytest.raises(RuntimeError, match="injected"):
            ledger.forward(torch.randint(3, 90, (2, 3)), torch.tensor([3, 2]))     # layer 0 has run, layer 1 fails
        hook.remove()
        assert {layer.keys.shape[-2] for layer in ledger.cache.layers} == {ledger.physical_length}
        more = torch.randint(3, 90, (2, 2))
        logits = ledger.forward(more, torch.tensor([2, 2]))
        fresh = model(torch.cat([ids, more], dim=1)).logits[:, -2:]
    torch.testing.assert_close(logits, fresh, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("where", ["prefill", "verify", "mid-forward"])
def test_engine_survives_a_failing_target_while_serving_from_its_thread(where):
    model = tiny_model("llama", seed=4)
    draft = ModelDrafter(tiny_model("llama", seed=4))          # the target's twin: drafts are accepted
    if where == "mid-forward":
        fault = Fault(lambda m, kw: True)
        hook = model.model.layers[1].register_forward_pre_hook(fault, with_kwargs=True)
    else:
        first = where == "prefill"
        fault = Fault(lambda m, kw: (cached_length(kw) == 0) == first and kw["input_ids"].shape[1] > 1)
        hook = model.register_forward_pre_hook(fault, with_kwargs=True)
    engine = Engine(model, drafter=draft, assistant_policy=FixedLength(3), max_batch=4, eos_token_id=EOS,
                    pad_token_id=PAD).start()
    try:
        before = [engine.submit(p, max_new_tokens=12) for p in prompts(3, seed=1)]
        [h.result(timeout=30) for h in before]
        fault.armed = True
        hit = [engine.submit(p, max_new_tokens=12) for p in prompts(3, seed=2)]
        outcomes = []
        for h in hit:
            try:
                outcomes.append(h.result(timeout=30))
            except EngineError:
                outcomes.append(None)
        assert fault.fired == 1 and None in outcomes                       # the fault hit some request
        after = [(p, engine.submit(p, max_new_tokens=12)) for p in prompts(4, seed=3)]
        for p, h in after:                                                  # and the engine serves on, unchanged
            assert h.result(timeout=30) == stock(model, p, 12)
        for p, out in zip(prompts(3, seed=2), outcomes):
            if out is not None:
                assert out == stock(model, p, 12)
    finally:
        hook.remove()
        engine.stop()
    assert engine.fallback is None                                           # not a drafter's failure


def test_stop_fails_pending_and_later_requests():
    engine = Engine(cached_model("llama"), max_batch=2, eos_token_id=None, pad_token_id=PAD)
    pending = [engine.submit([5, 6, 7], max_new_tokens=4) for _ in range(3)]
    engine.stop()
    for h in pending:
        with pytest.raises(EngineError, match="stopped"):
            h.result(timeout=1)
    late = engine.submit([5, 6], max_new_tokens=2)
    assert late.state == "failed" and isinstance(late.error, EngineError)
    engine.start()                                                           # serving again after start()
    try:
        assert len(engine.submit([5, 6], max_new_tokens=2).result(timeout=10)) == 2
    finally:
        engine.stop()


def test_result_on_an_undriven_engine_says_so():
    engine = Engine(cached_model("llama"), max_batch=2, eos_token_id=None, pad_token_id=PAD)
    handle = engine.submit([5, 6, 7], max_new_tokens=4)
    with pytest.raises(EngineError, match="nobody drives"):
        handle.result()
    engine.run_until_idle()
    assert len(handle.result()) == 4


def test_a_step_longer_than_a_second_still_counts_as_driven():
    """A caller that drives the engine from its own thread with steps of over a second (a CPU target's verification):
    another thread's result() waits for the request instead of saying nobody drives the engine. result() is called
    once the driver is inside its first step (an event, not a sleep: a loaded machine may start the thread late)."""
    import threading
    import time

    from spec_adapt import ScriptedDrafter

    stepping = threading.Event()

    def slow(row, context, gamma):
        stepping.set()
        time.sleep(1.3)
        return [5] * gamma

    engine = Engine(cached_model("llama"), drafter=ScriptedDrafter(slow), assistant_policy=FixedLength(1),
                    max_batch=2, eos_token_id=None, pad_token_id=PAD)
    handle = engine.submit([5, 6, 7], max_new_tokens=3)
    driver = threading.Thread(target=engine.run_until_idle)
    driver.start()
    assert stepping.wait(60)
    try:
        assert len(handle.result(timeout=30)) == 3
    finally:
        driver.join()


def test_a_dead_engine_thread_fails_every_handle(monkeypatch):
    engine = Engine(cached_model("llama"), max_batch=2, eos_token_id=None, pad_token_id=PAD)

    def broken():
        raise MemoryError("injected")

    monkeypatch.setattr(engine, "_step", broken)
    handle = engine.submit([5, 6, 7], max_new_tokens=4)
    engine.start()
    engine._thread.join(timeout=10)
    with pytest.raises(EngineError, match="died"):
        handle.result(timeout=5)
    assert isinstance(engine.submit([5], max_new_tokens=1).error, EngineError)


@pytest.mark.parametrize("prompt", [None, {"ids": [1, 2]}, object(), [[1, 2], [3, 4]], [], [1.5, 2.0]])
def test_malformed_prompts_fail_their_handle_not_submit(prompt):
    engine = Engine(cached_model("llama"), max_batch=2, eos_token_id=None, pad_token_id=PAD)
    handle = engine.submit(prompt)
    assert handle.state == "failed" and handle.error is not None


@pytest.mark.parametrize("budget", [np.int64(3), torch.tensor(3), 3])
def test_integer_budgets_of_numpy_and_torch(budget):
    engine = Engine(cached_model("llama"), max_batch=2, eos_token_id=None, pad_token_id=PAD, max_new_tokens=budget)
    handle = engine.submit([5, 6, 7], max_new_tokens=budget)
    engine.run_until_idle()
    assert len(handle.result()) == 3


def test_engine_runs_without_autograd_in_its_thread():
    model = cached_model("llama")
    engine = Engine(model, drafter=PromptLookupDrafter(2, 1), assistant_policy=FixedLength(2), max_batch=2,
                    eos_token_id=None, pad_token_id=PAD).start()
    try:
        engine.submit([5, 6, 7, 5, 6], max_new_tokens=30)
        seen = []
        while not seen:
            ledger = engine.loop.target
            if ledger is not None and ledger._layers():
                seen.append(ledger._layers()[0].keys)
        assert not seen[0].requires_grad and seen[0].grad_fn is None
    finally:
        engine.stop()


# -- generate: options, inputs, budgets ------------------------------------------------------------------------------
@pytest.mark.parametrize("option", [dict(guidance_scale=1.5), dict(dola_layers="high"), dict(penalty_alpha=0.6, top_k=4)])
def test_generate_refuses_options_it_cannot_honour_by_name(option):
    import spec_adapt

    from conftest import ragged_batch

    ids, mask = ragged_batch(2)
    name = next(iter(option))
    with pytest.raises(ValueError, match=name):
        cached_model("llama").generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, pad_token_id=PAD,
                                       custom_generate=spec_adapt.generate, drafter=PromptLookupDrafter(), **option)


def test_generate_refuses_a_mask_of_the_wrong_width():
    import spec_adapt

    from conftest import ragged_batch

    ids, _ = ragged_batch(2)
    with pytest.raises(ValueError, match="wide"):
        cached_model("llama").generate(input_ids=ids, attention_mask=torch.ones(2, 3, dtype=torch.long),
                                       max_new_tokens=4, pad_token_id=PAD, custom_generate=spec_adapt.generate,
                                       drafter=PromptLookupDrafter())


def test_strict_makes_a_drafter_failure_raise():
    import spec_adapt
    from spec_adapt import ScriptedDrafter

    from conftest import ragged_batch

    def broken(row, context, gamma):
        raise KeyError("drafter bug")

    ids, mask = ragged_batch(2)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, pad_token_id=PAD, eos_token_id=None,
              custom_generate=spec_adapt.generate, drafter=ScriptedDrafter(broken), assistant_policy=FixedLength(2))
    with pytest.warns(RuntimeWarning, match="drafter bug"):
        cached_model("llama").generate(**kw)                      # falls back by default
    with pytest.raises(KeyError, match="drafter bug"):
        cached_model("llama").generate(**kw, strict=True)


def test_a_huge_budget_with_an_early_stop_allocates_nothing_for_it():
    """The token buffer grows with what is generated: max_new_tokens=10**9 and a row that stops at once cost what
    stock costs (stock allocates nothing up front either). Measured by the largest tensor any operation of each call
    makes, not by their times, which move with the machine's load."""
    import spec_adapt
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from transformers import StoppingCriteria, StoppingCriteriaList

    class After(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 20, dtype=torch.bool)

    class Largest(TorchDispatchMode):
        """The most elements of any tensor an operation makes while it is entered."""

        def __init__(self):
            super().__init__()
            self.most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.most = max([self.most] + [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
            return out

    model = cached_model("llama")
    ids = torch.randint(3, 90, (2, 8))
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=10**9, pad_token_id=PAD,
              eos_token_id=None, stopping_criteria=StoppingCriteriaList([After()]))
    with Largest() as stock:
        reference = model.generate(**kw)
    loop = {}
    original = spec_adapt.loop.SpeculativeLoop.run

    def spy(self):
        loop["self"] = self
        return original(self)

    spec_adapt.loop.SpeculativeLoop.run = spy
    try:
        with Largest() as ours:
            out = model.generate(**kw, custom_generate=spec_adapt.generate, drafter=PromptLookupDrafter(),
                                 assistant_policy=FixedLength(3))
    finally:
        spec_adapt.loop.SpeculativeLoop.run = original
    assert torch.equal(out, reference)
    assert loop["self"].rows_state.buffer.shape[1] <= 2 * 20 + 32            # grew with the tokens, not with the budget
    assert ours.most <= 10 * stock.most, (ours.most, stock.most)   # no tensor sized by the budget, anywhere


# -- policies shared across threads, and their state files ------------------------------------------------------------
def test_one_adaptive_shared_by_eight_threads():
    from concurrent.futures import ThreadPoolExecutor

    import spec_adapt
    from spec_adapt import Adaptive

    from conftest import ragged_batch, stock_greedy

    model, policy = cached_model("llama"), Adaptive()
    cases = [ragged_batch(1 + i % 4, seed=i) for i in range(8)]
    references = [stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=8) for ids, mask in cases]

    def call(i):
        ids, mask = cases[i % 8]
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8, pad_token_id=PAD,
                             eos_token_id=None, custom_generate=spec_adapt.generate,
                             drafter=PromptLookupDrafter(2, 1), assistant_policy=policy)
        return torch.equal(out, references[i % 8])

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, range(200)))
    assert all(results) and len(results) == 200


def _trained_adaptive():
    import spec_adapt
    from spec_adapt import Adaptive

    from conftest import ragged_batch

    policy = Adaptive(max_gamma=4)
    ids, mask = ragged_batch(3, seed=1)
    cached_model("llama").generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, pad_token_id=PAD,
                                   custom_generate=spec_adapt.generate, drafter=PromptLookupDrafter(2, 1),
                                   assistant_policy=policy)
    return policy


@pytest.mark.parametrize("damage", ["max_gamma", "missing", "nan", "negative", "inf_time", "shape"])
def test_a_bad_state_is_refused_whole_and_leaves_the_policy_as_it_was(damage):
    import copy
    import json

    from spec_adapt import Adaptive

    policy = _trained_adaptive()
    good = policy.state_dict()
    state = copy.deepcopy(good)
    if damage == "max_gamma":
        target = Adaptive(max_gamma=6)
        with pytest.raises(ValueError, match="max_gamma=4"):
            target.load_state_dict(state)
        return
    if damage == "missing":
        del state["pooled"]
    elif damage == "nan":
        state["pooled"]["accepted"][0][0] = float("nan")
    elif damage == "negative":
        state["row_states"][0][0][0][0] = -3.0
    elif damage == "inf_time":
        state["cost"]["verify"][0][1][0] = float("inf")
    elif damage == "shape":
        state["pooled"]["tried"] = state["pooled"]["tried"][:2]
    before = json.dumps(policy.state_dict(), sort_keys=True)
    with pytest.raises(ValueError, match="Not a valid Adaptive state"):
        policy.load_state_dict(state)
    assert json.dumps(policy.state_dict(), sort_keys=True) == before
    fresh = Adaptive(max_gamma=4)
    fresh.load_state_dict(good)                                   # the undamaged state still loads
    assert json.dumps(fresh.state_dict(), sort_keys=True) == before


@pytest.mark.parametrize("budget", [float("nan"), float("inf"), -1, 0, True, "4GB"])
def test_memory_budget_refuses_what_is_not_a_positive_finite_size(budget):
    from spec_adapt import MemoryBudget

    with pytest.raises(ValueError, match="positive, finite"):
        MemoryBudget(budget)


def test_engine_state_does_not_grow_with_steps_served():
    """The trace and timeline are bounded unless asked for; finished requests leave no delivery record."""
    engine = Engine(cached_model("llama"), drafter=PromptLookupDrafter(2, 1), assistant_policy=FixedLength(2),
                    max_batch=4, eos_token_id=None, pad_token_id=PAD)
    handles = [engine.submit([5 + i % 7, 6, 7], max_new_tokens=6) for i in range(120)]
    engine.run_until_idle()
    assert all(len(h.result()) == 6 for h in handles)
    assert engine.stats.steps > 128 and len(engine.stats.trace) <= 128
    assert engine.timeline == [] and engine.delivered == {} and engine.running == {}
    assert engine.stats.acceptance_length > 1.0           # kept by a running count, not from the trace


def test_a_batch_that_cannot_be_dropped_is_reset_and_serving_goes_on(monkeypatch):
    """If even dropping the failed rows fails, the engine forgets the batch, goes on without speculation (its drafter
    could not follow the reset) and serves later requests identically to stock."""
    model = cached_model("llama")
    engine = Engine(model, drafter=PromptLookupDrafter(2, 1), assistant_policy=FixedLength(2), max_batch=2,
                    eos_token_id=EOS, pad_token_id=PAD)
    first = engine.submit(prompts(1, seed=4)[0], max_new_tokens=8)
    engine.step()                                              # admitted and running
    monkeypatch.setattr(engine.loop, "drop", lambda rows: (_ for _ in ()).throw(RuntimeError("drop failed")))
    engine._fail_running(EngineError("injected"))
    monkeypatch.undo()
    with pytest.raises(EngineError, match="injected"):
        first.result(timeout=1)
    assert engine.loop.drafter is None and "reset" in engine.fallback
    later = [(p, engine.submit(p, max_new_tokens=8)) for p in prompts(3, seed=5)]
    engine.run_until_idle()
    for p, h in later:
        assert h.result() == stock(model, p, 8)


def test_stop_with_a_timeout_returns_on_time_while_a_step_blocks():
    """A drafter blocked in a call holds the engine's step: stop(timeout=...) returns on time, every request fails
    with an EngineError at once, a new request is refused, and after the step ends the engine starts again. The
    draft call blocks until the checks are done (events, not sleeps: on a loaded machine the thread may reach it
    late, and the checks may take long)."""
    import threading
    import time

    from spec_adapt import ScriptedDrafter

    entered, release = threading.Event(), threading.Event()

    def slow(row, context, gamma):
        entered.set()
        release.wait(60)
        return [5] * gamma

    engine = Engine(cached_model("llama"), drafter=ScriptedDrafter(slow), assistant_policy=FixedLength(1),
                    max_batch=2, eos_token_id=None, pad_token_id=PAD).start()
    handles = [engine.submit([5, 6, 7], max_new_tokens=8) for _ in range(2)]
    try:
        assert entered.wait(60)                         # the thread is inside the blocked draft call
        began = time.perf_counter()
        engine.stop(timeout=0.3)
        assert time.perf_counter() - began < 1.5
        for handle in handles:
            with pytest.raises(EngineError, match="stopped"):
                handle.result(timeout=1)
        with pytest.raises(EngineError, match="no requests"):
            engine.submit([5, 6], max_new_tokens=2).result(timeout=1)
        with pytest.raises(EngineError, match="still finishing"):
            engine.start()
    finally:
        release.set()                                   # the draft call returns; later ones do not block
    engine.stop(timeout=None)                            # waits for the step; the state is cleaned up
    assert all(h.state == "failed" for h in handles)
    engine.start()
    try:
        assert len(engine.submit([5, 6], max_new_tokens=3).result(timeout=20)) == 3
    finally:
        engine.stop()


@pytest.mark.parametrize("step_timeout", [None, 5.0])
def test_stop_returns_within_its_own_timeout_whatever_a_drafter_does(step_timeout):
    """stop() with no argument waits at most the engine's `stop_timeout` for a step a drafter blocks: the requests
    fail at once, no other caller may step the engine while the blocked step runs, the thread ends the step's rows
    when the call returns, and the engine then starts and serves as stock. The call returns when the test releases
    it, after the checks made while it blocks (not after a fixed time, which a loaded machine can outrun)."""
    import threading
    import time

    from spec_adapt import ScriptedDrafter

    entered, release = threading.Event(), threading.Event()

    def blocks(row, context, gamma):
        entered.set()
        release.wait(60)
        return [5] * gamma

    model = cached_model("llama")
    engine = Engine(model, drafter=ScriptedDrafter(blocks), assistant_policy=FixedLength(1), max_batch=2,
                    eos_token_id=None, pad_token_id=PAD, step_timeout=step_timeout)
    engine.stop_timeout = 0.2
    try:
        engine.start()
        handle = engine.submit([5, 6, 7], max_new_tokens=8)
        assert entered.wait(60)                         # the engine's thread is inside the blocked call
        began = time.perf_counter()
        engine.stop()
        assert time.perf_counter() - began < 1.0
        with pytest.raises(EngineError, match="stopped"):
            handle.result(timeout=1)
        with pytest.raises(EngineError, match="still finishing"):
            engine.step()                               # a second driver would race the blocked step
        release.set()                                   # the drafter's call returns
        engine._thread.join(60)                         # the blocked step returned: the thread ended its rows
        assert not engine._thread.is_alive() and not engine.running and len(engine.loop.rows_state.rows) == 0
    finally:
        release.set()
    engine.start()
    try:
        ids = torch.tensor([[5, 6, 7]])
        reference = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=6, eos_token_id=None, pad_token_id=PAD)[0, 3:].tolist()
        assert engine.submit([5, 6, 7], max_new_tokens=6).result(timeout=20) == reference
    finally:
        engine.stop()
