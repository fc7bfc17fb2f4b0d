"""The serving engine: requests join and leave a running speculative batch; every request's greedy output is
token-identical to stock `generate` on that prompt alone, whatever the arrival order and timing."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import spec_adapt
from spec_adapt import Adaptive, FixedLength, ModelDrafter, PromptLookupDrafter, ScriptedDrafter
from spec_adapt.policies import Nightjar
from spec_adapt.serving.engine import Engine, RequestError

from spec_adapt.drafters.cross import CrossTokenizerDrafter

from conftest import EOS, PAD, VOCAB, SpareRows, cached_model, tiny_model
from tiny_tokenizers import bpe_tokenizer, char_tokenizer

MODEL = cached_model("llama")
DRAFT = tiny_model("llama", seed=7, layers=1)
CROSS_DRAFT = tiny_model("gpt2", seed=8, vocab=len(bpe_tokenizer("bytelevel", 420)), layers=1)    # its own tokenizer


def stock(prompt: list[int], n: int, eos=EOS) -> list[int]:
    ids = torch.tensor([prompt])
    out = MODEL.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=eos, pad_token_id=PAD)
    return out[0, len(prompt):].tolist()


class Truth:
    """Scripted drafts per request: 'right' (the stock continuation), 'wrong', or right for exactly j tokens."""

    def __init__(self, prompts, budgets, modes):
        self.refs = {tuple(p): p + stock(p, n) for p, n in zip(prompts, budgets)}
        self.modes = {tuple(p): m for p, m in zip(prompts, modes)}

    def __call__(self, row, context, gamma):
        key = next(k for k in self.refs if tuple(context[: len(k)]) == k)
        ref, mode = self.refs[key], self.modes[key]
        right = ref[len(context): len(context) + gamma]
        j = {"right": gamma, "wrong": 0}.get(mode, mode)
        out = right[:j]
        return out + [(t + 1) % VOCAB for t in right[len(out):]] + [3] * (gamma - len(right))


def random_prompts(rng, n):
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 10))] for _ in range(n)]


def drive(engine, prompts, budgets, arrivals, cancel_at=None):
    """Submit request i at engine step arrivals[i] (a deterministic schedule); cancel_at: {request: step}."""
    handles, step = [None] * len(prompts), 0
    cancel_at = cancel_at or {}
    while True:
        for i, at in enumerate(arrivals):
            if at == step:
                handles[i] = engine.submit(prompts[i], max_new_tokens=budgets[i])
        for i, at in cancel_at.items():
            if at == step and handles[i] is not None:
                handles[i].cancel()
        busy = engine.step()
        step += 1
        if not busy and step > max(arrivals):
            return handles


DRAFTERS = {
    "scripted": None,                      # built per test from the truth
    "model": lambda: ModelDrafter(DRAFT),
    "short-head": lambda: ModelDrafter(DRAFT, head_tokens=24),     # joiners' prompts join the scored set
    "lookup": lambda: PromptLookupDrafter(2, 1),
    "suffix": lambda: spec_adapt.SuffixDrafter(index=spec_adapt.drafters.SuffixIndex()),
    "chain": lambda: spec_adapt.ChainDrafter([PromptLookupDrafter(2, 1), DRAFT]),
    "cross": lambda: CrossTokenizerDrafter(CROSS_DRAFT, bpe_tokenizer("bytelevel", 420), char_tokenizer(VOCAB)),
    "none": lambda: None,
}


@settings(max_examples=14, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), drafter=st.sampled_from(sorted(DRAFTERS)),
       policy=st.sampled_from(["fixed", "adaptive", "nightjar", "spares"]), max_batch=st.integers(1, 5),
       step_timeout=st.sampled_from([None, 60.0]))
@example(seed=7, drafter="short-head", policy="fixed", max_batch=3, step_timeout=None)   # always run: rows join
@example(seed=7, drafter="cross", policy="adaptive", max_batch=3, step_timeout=None)     # mid-batch
@example(seed=7, drafter="model", policy="adaptive", max_batch=3, step_timeout=60.0)     # drafts in its own thread
def test_every_request_matches_stock_alone(seed, drafter, policy, max_batch, step_timeout):
    rng = random.Random(seed)
    n = rng.randrange(2, 8)
    prompts = random_prompts(rng, n)
    budgets = [rng.randrange(1, 20) for _ in range(n)]
    arrivals = sorted(rng.randrange(0, 12) for _ in range(n))
    modes = [rng.choice(["right", "wrong", 1, 3]) for _ in range(n)]
    if drafter == "scripted":
        made = ScriptedDrafter(Truth(prompts, budgets, modes))
    else:
        made = DRAFTERS[drafter]()
    chooser = {"fixed": FixedLength(rng.randrange(1, 6)), "adaptive": Adaptive(), "nightjar": Nightjar(),
               "spares": SpareRows(rng.randrange(1, 6))}[policy]
    engine = Engine(MODEL, drafter=made, assistant_policy=chooser, max_batch=max_batch, eos_token_id=EOS, pad_token_id=PAD,
                    step_timeout=step_timeout)
    handles = drive(engine, prompts, budgets, arrivals)
    assert engine.fallback is None
    for prompt, budget, handle in zip(prompts, budgets, handles):
        assert handle.state == "done"
        assert handle.result() == stock(prompt, budget)
    assert max(r.batch_size for r in engine.stats.trace) <= max_batch if engine.stats.trace else True


def test_admission_really_merges_rows_into_a_running_batch():
    """Requests arriving at different steps share steps (the batch grows while others are mid-generation)."""
    rng = random.Random(1)
    prompts = random_prompts(rng, 4)
    budgets = [16, 16, 16, 16]
    truth = Truth(prompts, budgets, ["right", 2, "wrong", "right"])
    engine = Engine(MODEL, drafter=ScriptedDrafter(truth), assistant_policy=FixedLength(3), max_batch=4, eos_token_id=None,
                    pad_token_id=PAD)
    handles = drive(engine, prompts, budgets, [0, 1, 1, 2])
    sizes = [r.batch_size for r in engine.stats.trace]
    assert sizes[:3] == [1, 3, 4]
    for prompt, budget, handle in zip(prompts, budgets, handles):
        assert handle.result() == stock(prompt, budget, eos=None)
    for rec in engine.stats.trace:       # acceptance is exactly the script's (the rows were not mixed up)
        assert all(d >= a for d, a in zip(rec.drafted, rec.accepted))


def test_eos_mid_batch_and_cancellation():
    rng = random.Random(2)
    prompts = random_prompts(rng, 5)
    free = [stock(p, 12, eos=None) for p in prompts]
    eos = free[0][4]                                        # request 0 ends at its 5th token
    engine = Engine(MODEL, drafter=ModelDrafter(DRAFT), assistant_policy=FixedLength(3), max_batch=3, eos_token_id=eos,
                    pad_token_id=PAD)
    handles = drive(engine, prompts, [12] * 5, [0, 0, 1, 2, 2], cancel_at={1: 2, 4: 2})
    assert handles[0].result() == stock(prompts[0], 12, eos=eos) and handles[0].result()[-1] == eos
    assert handles[1].state == "cancelled"
    assert handles[1].result() == stock(prompts[1], 12, eos=eos)[: len(handles[1].result())]
    assert handles[4].state == "cancelled"
    for i in (2, 3):
        assert handles[i].result() == stock(prompts[i], 12, eos=eos)


def test_bad_requests_fail_on_their_handle_and_do_not_disturb_others():
    engine = Engine(MODEL, drafter=PromptLookupDrafter(2, 1), assistant_policy=FixedLength(2), max_batch=4,
                    eos_token_id=None, pad_token_id=PAD)
    good = engine.submit([5, 6, 7, 5, 6], max_new_tokens=10)
    bad = [engine.submit([], max_new_tokens=4), engine.submit([5, VOCAB + 3]),
           engine.submit([5, 6], max_new_tokens=0), engine.submit([5, 6], max_new_tokens=600),
           engine.submit([[1, 2], [3, 4]]), engine.submit("text without a tokenizer"),
           engine.submit([1.5, 2.0])]
    engine.run_until_idle()
    for handle in bad:
        assert handle.state == "failed"
        with pytest.raises(RequestError):
            handle.result()
    assert "positions" in str(bad[3].error) and "[0, 96)" in str(bad[1].error)
    assert good.result() == stock([5, 6, 7, 5, 6], 10, eos=None)


def test_draft_failure_falls_back_for_everyone_without_losing_tokens():
    calls = {"n": 0}

    def flaky(row, context, gamma):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("draft exploded")
        return [3] * gamma

    rng = random.Random(3)
    prompts = random_prompts(rng, 4)
    engine = Engine(MODEL, drafter=ScriptedDrafter(flaky), assistant_policy=FixedLength(2), max_batch=2, eos_token_id=None,
                    pad_token_id=PAD)
    with pytest.warns(RuntimeWarning, match="draft exploded"):
        handles = drive(engine, prompts, [10] * 4, [0, 1, 3, 5])
    assert "draft exploded" in engine.fallback
    for prompt, handle in zip(prompts, handles):
        assert handle.result() == stock(prompt, 10, eos=None)


def test_streaming_and_background_thread():
    rng = random.Random(4)
    prompts = random_prompts(rng, 3)
    engine = Engine(MODEL, drafter=ModelDrafter(DRAFT), assistant_policy=Adaptive(), max_batch=2, eos_token_id=None,
                    pad_token_id=PAD).start()
    try:
        handles = [engine.submit(p, max_new_tokens=9) for p in prompts]
        streamed = []
        reader = threading.Thread(target=lambda: streamed.extend(handles[0].stream(timeout=60)))
        reader.start()
        results = [h.result(timeout=60) for h in handles]
        reader.join(timeout=60)
    finally:
        engine.stop()
    assert streamed == results[0]
    for prompt, result in zip(prompts, results):
        assert result == stock(prompt, 9, eos=None)
    assert all(h.first_token is not None and h.finished >= h.first_token for h in handles)


def test_sampling_engine_is_seeded_deterministic_for_a_fixed_schedule():
    rng = random.Random(5)
    prompts = random_prompts(rng, 4)

    def once(seed):
        engine = Engine(MODEL, drafter=ModelDrafter(DRAFT), assistant_policy=FixedLength(3), max_batch=3, do_sample=True,
                        temperature=0.8, top_k=20, eos_token_id=None, pad_token_id=PAD, seed=seed)
        return [h.result() for h in drive(engine, prompts, [10] * 4, [0, 0, 2, 3])]

    assert once(11) == once(11) and once(11) != once(12)


def test_engine_arguments_are_checked():
    with pytest.raises(ValueError, match="max_batch"):
        Engine(MODEL, max_batch=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        Engine(MODEL, max_new_tokens=-1)
    with pytest.raises(TypeError):
        Engine(MODEL, assistant_policy="nightjar")
    with pytest.raises(ValueError, match="temperature"):
        Engine(MODEL, do_sample=True, temperature=0)


@settings(max_examples=20, deadline=None)
@given(first=st.lists(st.integers(1, 9), min_size=1, max_size=3), second=st.lists(st.integers(1, 9), min_size=1,
       max_size=3), steps=st.integers(0, 3), seed=st.integers(0, 1000))
def test_ledger_add_rows_matches_each_row_alone(first, second, steps, seed):
    """Rows prefilled apart and merged (after the running rows took `steps` steps) give the logits each row gets
    alone: masks, position ids and cache columns all line up."""
    from spec_adapt.ledger import KVLedger

    gen = torch.Generator().manual_seed(seed)

    def group(lengths):
        width = max(lengths)
        ids = torch.full((len(lengths), width), PAD)
        mask = torch.zeros(len(lengths), width, dtype=torch.long)
        for i, n in enumerate(lengths):
            ids[i, width - n:] = torch.randint(3, VOCAB, (n,), generator=gen)
            mask[i, width - n:] = 1
        return ids, mask

    model = MODEL
    a_ids, a_mask = group(first)
    running = KVLedger(model)
    running.prefill(a_ids, a_mask)
    seqs = [a_ids[i, a_mask[i].bool()].tolist() for i in range(len(first))]
    for _ in range(steps):                                  # the running rows move on first
        nxt = torch.randint(3, VOCAB, (len(first), 1), generator=gen)
        running.forward(nxt, torch.ones(len(first), dtype=torch.long))
        for i in range(len(first)):
            seqs[i].append(int(nxt[i]))
    b_ids, b_mask = group(second)
    joining = KVLedger(model)
    joining.prefill(b_ids, b_mask)
    running.add_rows(joining)
    seqs += [b_ids[i, b_mask[i].bool()].tolist() for i in range(len(second))]
    probe = torch.randint(3, VOCAB, (len(seqs), 1), generator=gen)
    merged = running.forward(probe, torch.ones(len(seqs), dtype=torch.long))[:, -1]
    for i, seq in enumerate(seqs):
        alone = model(torch.tensor([seq + [int(probe[i])]])).logits[0, -1]
        torch.testing.assert_close(merged[i], alone, atol=1e-4, rtol=1e-4)


def test_serve_bench_schedule_and_measurements():
    from spec_adapt.tools.serve_bench import schedule, serve, summary_rows

    arrivals = schedule(rate=50.0, duration=0.2, n_prompts=3, seed=1)
    assert arrivals == schedule(rate=50.0, duration=0.2, n_prompts=3, seed=1) and len(arrivals) > 3
    assert all(a < b for (a, _), (b, _) in zip(arrivals, arrivals[1:]))
    rng = random.Random(6)
    prompts = [torch.tensor(p) for p in random_prompts(rng, 3)]
    rows = []
    for config, drafter in (("target", None), ("lookup:fixed3", PromptLookupDrafter(2, 1))):
        engine = Engine(MODEL, drafter=drafter, assistant_policy=FixedLength(0 if drafter is None else 3), max_batch=4,
                        max_new_tokens=8, eos_token_id=None, pad_token_id=PAD)
        out = serve(engine, prompts, arrivals)
        assert out["requests"] == len(arrivals) and out["tokens"] == 8 * len(arrivals)
        assert out["ttft_p50"] >= 0 and out["tpot_p50"] > 0 and out["mean_batch"] >= 1
        rows.append({"rate": 50.0, "config": config, **out})
    assert summary_rows(rows)[0]["speedup"] == 1.0
    assert summary_rows([{**rows[0], "tok_s": 0.0}])[0]["speedup"] is None      # nothing served: no ratio


def test_a_joining_row_catches_up_apart_from_the_running_rows():
    """A request that joins a drafting batch has its whole prompt to catch up on while the running rows are one or two
    tokens behind: its catch-up runs in a ledger of its own (one row's width, not the batch's), and every output is
    still identical to stock."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (4, 5, 24)]
    widths = []
    hook = DRAFT.register_forward_hook(lambda module, args, kwargs, out: widths.append(tuple(kwargs["input_ids"].shape)),
                                       with_kwargs=True)
    try:
        engine = Engine(MODEL, drafter=ModelDrafter(DRAFT), assistant_policy=FixedLength(2), max_batch=3)
        handles = drive(engine, prompts, [12, 12, 8], [0, 0, 3])
    finally:
        hook.remove()
    for h, p, n in zip(handles, prompts, [12, 12, 8]):
        assert h.result() == stock(p, n)
    assert (1, 25) in widths                       # the joiner's prompt and its first token, alone
    assert not any(b > 1 and w >= 20 for b, w in widths)   # never the running rows padded out to its width
