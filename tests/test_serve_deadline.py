"""The serving engine's per-step deadline (`Engine(step_timeout=...)`): a drafter call that overruns the step's draft
budget is abandoned, the drafter is dropped and every request goes on plain, token-identical to stock `generate`;
a slow target does not trip it; without a deadline the drafter runs in the thread that steps the engine."""

from __future__ import annotations

import math
import threading
import time
import warnings

import numpy as np
import pytest
import torch

from spec_adapt import FixedLength, ModelDrafter, PromptLookupDrafter, ScriptedDrafter
from spec_adapt.drafters import Observes
from spec_adapt.serving.engine import Engine

from conftest import PAD, cached_model, tiny_model

MODEL = cached_model("llama")
DRAFT = tiny_model("llama", seed=7, layers=1)
PROMPTS = [[5, 9, 17, 5, 9], [40, 41, 42], [7, 7, 8, 9, 10, 11], [60, 3, 61], [12, 13, 12, 13, 12], [90, 80, 70]]
_STOCK: dict = {}


def stock(prompt: list[int], n: int) -> list[int]:
    """Stock greedy generate's first n tokens (no EOS, so they are a prefix of its 24), computed once per prompt."""
    key = tuple(prompt)
    if key not in _STOCK:
        ids = torch.tensor([prompt])
        out = MODEL.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                             eos_token_id=None, pad_token_id=PAD)
        _STOCK[key] = out[0, len(prompt):].tolist()
    assert n <= 24
    return _STOCK[key][:n]


@pytest.fixture(autouse=True)
def references():
    """Stock's outputs before any timing: the scripted drafts read them."""
    for prompt in PROMPTS:
        stock(prompt, 24)


def right(row, context, gamma):
    """The stock continuation of the request whose prompt starts `context` (every draft accepted)."""
    prompt = next(p for p in PROMPTS if context[: len(p)] == p)
    full = prompt + stock(prompt, 24)
    return full[len(context): len(context) + gamma] + [3] * max(0, len(context) + gamma - len(full))


class Stalling(Observes, ScriptedDrafter):
    """Drafts the stock continuation; the `at`-th call of method `stalls` sleeps `seconds` first (and then raises,
    with `then_raise`). Records every method call (start and end), and whether two calls were ever inside the
    drafter at once."""

    def __init__(self, stalls: str = "propose", at: int = 3, seconds: float = 3.0, then_raise: bool = False):
        super().__init__(right)
        self.stalls, self.at, self.seconds, self.then_raise = stalls, at, seconds, then_raise
        self.counts, self.log, self.inside, self.overlapped = {}, [], 0, False
        self.threads = set()
        self.lock = threading.Lock()

    def _call(self, name, fn, *args):
        with self.lock:
            self.inside += 1
            self.overlapped |= self.inside > 1
            self.counts[name] = self.counts.get(name, 0) + 1
            stall = name == self.stalls and self.counts[name] == self.at
            self.log.append((name, "start", stall))
            self.threads.add(threading.current_thread())
        try:
            if stall:
                time.sleep(self.seconds)
                if self.then_raise:
                    raise RuntimeError("late and broken")
            return fn(*args)
        finally:
            with self.lock:
                self.inside -= 1
                self.log.append((name, "end", stall))

    def begin(self, *args):
        return self._call("begin", super().begin, *args)

    def add_rows(self, *args):
        return self._call("add_rows", super().add_rows, *args)

    def propose(self, *args):
        return self._call("propose", super().propose, *args)

    def observe(self, *args):
        return self._call("observe", super().observe, *args)

    def rollback(self, *args):
        return self._call("rollback", super().rollback, *args)

    def select_rows(self, *args):
        return self._call("select_rows", super().select_rows, *args)

    def end(self, *args):
        return self._call("end", super().end, *args)


def engine_with(drafter, step_timeout, max_batch=4, gamma=2):
    return Engine(MODEL, drafter=drafter, assistant_policy=FixedLength(gamma), max_batch=max_batch,
                  eos_token_id=None, pad_token_id=PAD, step_timeout=step_timeout)


def serve(engine, prompts, budget, at=None, steps=None):
    """Submit prompts[i] before engine step at[i] (all at once by default); step until idle. `steps`: a list that
    gets each step's duration."""
    at = at or [0] * len(prompts)
    handles, step = [None] * len(prompts), 0
    while True:
        for i, when in enumerate(at):
            if when == step:
                handles[i] = engine.submit(prompts[i], max_new_tokens=budget)
        began = time.perf_counter()
        busy = engine.step()
        if steps is not None:
            steps.append(time.perf_counter() - began)
        step += 1
        if not busy and step > max(at):
            return handles


@pytest.mark.parametrize("bad", [0, -1, -0.5, math.nan, math.inf, True, False, "1", [1.0], torch.tensor(1.0)])
def test_step_timeout_is_checked(bad):
    with pytest.raises(ValueError, match="step_timeout"):
        Engine(MODEL, step_timeout=bad)


@pytest.mark.parametrize("good", [None, 1, 0.25, 1e-3, np.float32(0.5)])
def test_good_step_timeouts_are_taken(good):
    """A good deadline is kept as float seconds, and with one the drafter's calls run in a thread of their own (the
    engine can stop waiting for them); without one they run in the thread that steps the engine."""
    engine = Engine(MODEL, drafter=PromptLookupDrafter(), step_timeout=good)
    expected = None if good is None else float(good)
    assert engine.loop.step_timeout == expected and type(engine.loop.step_timeout) is type(expected)
    assert (engine.loop.calls is None) == (good is None)


@pytest.mark.parametrize("stalls,at", [("propose", 3), ("begin", 1), ("add_rows", 1), ("observe", 2),
                                        ("rollback", 2)])
def test_a_drafter_call_that_overruns_the_deadline_is_dropped_and_every_request_completes(stalls, at):
    """The stall outlasts the test: the engine stops waiting at the deadline, and the requests finish meanwhile. (The
    margins are wide: these tests share loaded CPUs.)"""
    drafter = Stalling(stalls, at=at, seconds=10.0)
    engine = engine_with(drafter, step_timeout=1.0)
    began, steps = time.perf_counter(), []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handles = serve(engine, PROMPTS[:4], 16, at=[0, 0, 2, 3], steps=steps)
    elapsed = time.perf_counter() - began
    assert 0.9 <= max(steps) < 5.0, steps                # the 10 s stall held one step for the 1 s deadline
    assert elapsed < 10.0, elapsed
    for prompt, handle in zip(PROMPTS, handles):
        assert handle.state == "done"
        assert handle.result() == stock(prompt, 16)
    phase = {"begin": "admission", "add_rows": "admission"}.get(stalls, stalls)
    assert f"draft {phase} overran the step deadline" in engine.fallback
    assert engine.loop.drafter is None                   # dropped; restarted only after the stalled call returns
    assert [str(w.message) for w in caught if "deadline" in str(w.message)] == [f"spec_adapt: {engine.fallback}"]
    assert not drafter.overlapped
    assert drafter.log[-1] == (stalls, "start", True)    # nothing ran on the drafter after the stalled call


@pytest.mark.parametrize("then_raise", [False, True])
def test_a_late_drafter_call_is_waited_for_before_the_drafter_restarts(then_raise):
    """The abandoned call runs on to its end (its result, or its error, unread); the drafter's `end` follows it, and
    only then does the engine restart the drafter (after its back-off): the drafter never runs two calls at once, one
    warning tells of the drop, and every output is stock's."""
    drafter = Stalling("propose", at=3, seconds=1.5, then_raise=then_raise)
    engine = engine_with(drafter, step_timeout=0.5)
    handles, began, i = [], time.perf_counter(), 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        while engine.stats.restarts == 0 or len(handles) < 3:
            assert time.perf_counter() - began < 15, "the drafter never restarted"
            if len(engine.running) + len(engine.waiting) < 3:
                prompt = PROMPTS[i % len(PROMPTS)]
                handles.append((prompt, engine.submit(prompt, max_new_tokens=24)))
                i += 1
            engine.step()
        engine.run_until_idle()
    assert engine.fallback.startswith("draft propose overran the step deadline")
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == [
        f"spec_adapt: {engine.fallback}"]
    assert not drafter.overlapped
    stalled = drafter.log.index(("propose", "end", True))
    after = [(name, edge) for name, edge, _ in drafter.log[stalled + 1:]]
    assert after[:4] == [("end", "start"), ("end", "end"), ("begin", "start"), ("begin", "end")]
    assert ("propose", "start") in after                 # the restarted drafter drafts again
    for prompt, handle in handles:
        assert handle.result() == stock(prompt, 24)


def test_a_drafter_error_under_a_deadline_falls_back_as_without_one():
    calls = {"n": 0}

    def flaky(row, context, gamma):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("draft exploded")
        return right(row, context, gamma)

    engine = engine_with(ScriptedDrafter(flaky), step_timeout=5.0, max_batch=2)
    with pytest.warns(RuntimeWarning, match="draft exploded"):
        handles = serve(engine, PROMPTS[:4], 16, at=[0, 1, 3, 5])
    assert engine.fallback == "draft propose failed (RuntimeError: draft exploded); continued without speculation"
    for prompt, handle in zip(PROMPTS, handles):
        assert handle.result() == stock(prompt, 16)


def test_without_a_deadline_the_drafter_runs_in_the_engines_thread_and_is_waited_for():
    drafter = Stalling("propose", at=3, seconds=0.4)
    engine = engine_with(drafter, step_timeout=None)
    began = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handles = serve(engine, PROMPTS[:3], 12)
    assert time.perf_counter() - began >= 0.4
    assert engine.fallback is None and engine.loop.drafter is drafter
    assert drafter.threads == {threading.current_thread()}
    for prompt, handle in zip(PROMPTS, handles):
        assert handle.result() == stock(prompt, 12)


@pytest.mark.parametrize("kind", ["scripted", "model", "lookup"])
def test_a_fast_drafter_never_trips_the_deadline(kind):
    drafter = {"scripted": lambda: ScriptedDrafter(right), "model": lambda: ModelDrafter(DRAFT),
               "lookup": lambda: PromptLookupDrafter(2, 1)}[kind]()
    engine = engine_with(drafter, step_timeout=5.0, max_batch=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handles = serve(engine, PROMPTS, 16, at=[0, 0, 1, 3, 3, 6])
    assert engine.fallback is None and engine.loop.drafter is drafter
    assert sum(sum(r.drafted) for r in engine.stats.trace) > 0
    for prompt, handle in zip(PROMPTS, handles):
        assert handle.result() == stock(prompt, 16)


def test_a_slow_target_does_not_trip_the_deadline_nor_fail_its_requests():
    """The deadline bounds the drafter's calls only: a target forward that takes longer than it is waited for, and the
    drafter stays."""
    slow = {"left": 1}

    def stall(module, args, kwargs, out):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if slow["left"] and ids is not None and tuple(ids.shape) == (3, 3):    # verifying 2 drafts of 3 rows
            slow["left"] -= 1
            time.sleep(1.5)

    drafter = ScriptedDrafter(right)
    engine = engine_with(drafter, step_timeout=1.0)
    hook = MODEL.register_forward_hook(stall, with_kwargs=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            handles = serve(engine, PROMPTS[:3], 12, at=[0, 1, 1])
    finally:
        hook.remove()
    assert slow["left"] == 0
    assert engine.fallback is None and engine.loop.drafter is drafter
    for prompt, handle in zip(PROMPTS, handles):
        assert handle.state == "done" and handle.result() == stock(prompt, 12)


def test_the_deadline_holds_in_the_background_thread():
    drafter = Stalling("propose", at=2, seconds=10.0)
    engine = engine_with(drafter, step_timeout=1.0).start()
    began = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            handles = [engine.submit(p, max_new_tokens=10) for p in PROMPTS[:3]]
            results = [h.result(timeout=20) for h in handles]
    finally:
        engine.stop()
    assert time.perf_counter() - began < 10.0
    assert "deadline" in engine.fallback
    for prompt, result in zip(PROMPTS, results):
        assert result == stock(prompt, 10)
