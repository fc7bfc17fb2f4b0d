"""Per-request sampling in the serving Engine: each row is processed by its own temperature / top-k / top-p (greedy rows
by their argmax), keyed by its own seed, inside one running batch (spec_adapt.serving.sampling)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import spec_adapt
from spec_adapt import FixedLength, ModelDrafter
from spec_adapt.serving.engine import Engine, QueueFull, RequestError
from spec_adapt.serving.sampling import Sampling, warp

from conftest import PAD, sampling_pair, stock_greedy


@pytest.fixture(scope="module")
def pair():
    return sampling_pair()


PROMPTS = [list(range(3 + i, 9 + 2 * i)) for i in range(6)]


def serve(target, draft, requests, max_batch=4, arrivals=None, policy=None):
    """requests: (prompt, kwargs) pairs, submitted at engine steps `arrivals` (default all at once). Their tokens."""
    engine = Engine(target, drafter=ModelDrafter(draft), assistant_policy=policy or FixedLength(3),
                    max_batch=max_batch, eos_token_id=None, pad_token_id=PAD, max_new_tokens=12)
    arrivals = arrivals or [0] * len(requests)
    handles, step = [None] * len(requests), 0
    while True:
        for i, at in enumerate(arrivals):
            if at == step:
                prompt, kw = requests[i]
                handles[i] = engine.submit(prompt, **kw)
        busy = engine.step()
        step += 1
        if not busy and step > max(arrivals):
            return [h.result() for h in handles]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31), st.lists(st.tuples(st.sampled_from([0.0, 0.5, 1.0, 1.7]), st.sampled_from([0, 1, 5, 40]),
                                                 st.sampled_from([1.0, 0.9, 0.3, 0.01])), min_size=1, max_size=5))
def test_each_row_is_warped_as_stocks_warpers_warp_it_alone(seed, params):
    """warp() row by row equals transformers' temperature, top-k and top-p warpers (in generate's order) on that row
    alone; a greedy row keeps exactly its argmax."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(len(params), 50, generator=gen) * 3
    scores[:, 7] = scores[:, 9]                      # a tie for top-k and top-p to break as stock breaks it
    t, k, p = (torch.tensor(c) for c in zip(*params))
    out = warp(scores, t.float(), k.long(), p.float())
    for b, (temp, top_k, top_p) in enumerate(params):
        row = scores[b:b + 1]
        if temp == 0:
            expect = torch.full_like(row, float("-inf"))
            expect[0, row.argmax()] = row.max()
        else:
            expect = TemperatureLogitsWarper(temp)(None, row) if temp != 1.0 else row
            if top_k:
                expect = TopKLogitsWarper(top_k)(None, expect)
            if top_p < 1.0:
                expect = TopPLogitsWarper(top_p)(None, expect)
        assert torch.equal(out[b:b + 1], expect), (temp, top_k, top_p)


def test_greedy_rows_beside_sampled_rows_are_stocks_greedy(pair):
    """Greedy requests share steps with requests that sample (the batch then samples): each greedy answer is stock's
    greedy output for its prompt."""
    target, draft = pair
    requests = [(p, {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.9, "top_k": 40, "seed": i})
                for i, p in enumerate(PROMPTS)]
    out = serve(target, draft, requests, arrivals=[0, 0, 1, 2, 2, 5])
    for (prompt, kw), tokens in zip(requests, out):
        if kw["temperature"] == 0.0:
            ids = torch.tensor([prompt])
            plain = stock_greedy(target, ids, torch.ones_like(ids), eos_token_id=None, max_new_tokens=12)
            assert tokens == plain[0, len(prompt):].tolist()


def test_a_seeded_request_samples_what_it_samples_alone_and_what_generate_samples(pair):
    """A request with seed s: the same tokens alone (max_batch 1), in a batch with other requests and other
    parameters, at another width; and the tokens spec_adapt's generate samples for its prompt when its call seed is
    s (spec_adapt.noise)."""
    target, draft = pair
    kw = {"temperature": 0.9, "top_k": 40, "top_p": 0.95}
    torch.manual_seed(123)
    seed = spec_adapt.noise.call_seed()
    ids = torch.tensor([PROMPTS[2]])
    torch.manual_seed(123)
    expected = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                               max_new_tokens=12, pad_token_id=PAD, eos_token_id=None, custom_generate=spec_adapt.generate,
                               drafter=ModelDrafter(draft), assistant_policy=FixedLength(3), **kw)[0, ids.shape[1]:]
    alone = serve(target, draft, [(PROMPTS[2], {**kw, "seed": seed})], max_batch=1)[0]
    others = [(p, {"temperature": 1.3, "seed": 7 + i} if i % 2 else {}) for i, p in enumerate(PROMPTS)]
    batched = serve(target, draft, others[:2] + [(PROMPTS[2], {**kw, "seed": seed})] + others[3:],
                    arrivals=[0, 1, 1, 1, 3, 4], policy=FixedLength(5))[2]
    assert alone == batched == expected.tolist()
    other_seed = serve(target, draft, [(PROMPTS[2], {**kw, "seed": seed + 1})], max_batch=1)[0]
    assert other_seed != alone


def test_requests_with_other_temperatures_keep_their_own_distribution(pair):
    """Two temperatures in one batch: each request's tokens are its own alone (the coupled rule's tokens are a
    function of its processed scores and its noise), and the temperatures give different tokens."""
    target, draft = pair
    requests = [(PROMPTS[0], {"temperature": t, "seed": 5}) for t in (0.3, 2.0)]
    together = serve(target, draft, requests)
    apart = [serve(target, draft, [r], max_batch=1)[0] for r in requests]
    assert together == apart and together[0] != together[1]


def test_request_parameters_are_checked_where_they_enter(pair):
    target, draft = pair
    engine = Engine(target, drafter=ModelDrafter(draft), max_batch=2, eos_token_id=None, pad_token_id=PAD,
                    max_waiting=2)
    for bad, match in (({"temperature": -1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
                       ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -3}, "top_k"),
                       ({"seed": -1}, "seed"), ({"seed": 2**70}, "seed"), ({"temperature": "hot"}, "temperature"),
                       ({"min_p": 0.1}, "min_p")):
        handle = engine.submit([3, 4, 5], **bad)
        assert handle.state == "failed" and isinstance(handle.error, RequestError)
        assert match in str(handle.error)
    first = [engine.submit([3, 4, 5], max_new_tokens=2) for _ in range(2)]
    late = engine.submit([3, 4, 5])
    assert isinstance(late.error, QueueFull) and "max_waiting=2" in str(late.error)
    engine.run_until_idle()
    assert all(len(h.result()) == 2 for h in first)
    with pytest.raises(ValueError, match="max_waiting"):
        Engine(target, max_waiting=-1)
    with pytest.raises(ValueError, match="temperature"):
        Engine(target, do_sample=True, temperature=0)
    assert Sampling(0.5).samples and not Sampling().samples


def test_stop_ends_the_drafter_and_finalises_the_statistics_and_start_begins_it_again(pair):
    """The serving path's end is a generate call's: the drafter's end runs, stats.time_total is set; the engine
    serves again after start(), the drafter begun afresh, with the same answers."""
    target, draft = pair
    drafter = ModelDrafter(draft)
    ends = []
    real_end = drafter.end
    drafter.end = lambda *a: (ends.append(1), real_end(*a))[1]
    engine = Engine(target, drafter=drafter, assistant_policy=FixedLength(3), max_batch=2, eos_token_id=None,
                    pad_token_id=PAD, max_new_tokens=8)
    first = engine.submit(PROMPTS[0])
    engine.run_until_idle()
    engine.stop()
    assert ends == [1] and engine.stats.time_total > 0 and engine.stats.fallback is None
    engine.start()
    try:
        again = engine.submit(PROMPTS[0])
        assert again.result(timeout=60) == first.result()
    finally:
        engine.stop()
    assert ends == [1, 1] and engine.stats.drafted > 0 and engine.stats.fallback is None
