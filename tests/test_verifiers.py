"""The verify phase: FullVerifier (one forward) and EarlyExitVerifier (FASER's Top-K early exit), lossless both.

Random-weight targets with a small K prune often (their intermediate layers predict little), which is what these
tests want: every cut path (a row cut at its first draft, at its last, the widest row cut, all rows cut) runs, and
each case asserts that pruning really happened, so a verifier that silently never pruned cannot pass.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch

import spec_adapt
from spec_adapt import Adaptive, EarlyExitVerifier, FixedLength, FullVerifier, ModelDrafter, ScriptedDrafter
from spec_adapt.policies.cost import CostReader, StepCost

from conftest import PAD, Oracle, ragged_batch, stock_greedy, tiny_model

MODES = {"right": ["right"], "wrong": ["wrong"], "j2": [2], "mixed": ["right", "wrong", 1, 3, 0]}


@functools.lru_cache(maxsize=None)
def deep_model(arch: str, seed: int = 0):
    return tiny_model(arch, seed, layers=4)


def run(model, ids, mask, drafter, policy, verifier, **kw):
    kw.setdefault("max_new_tokens", 24)
    stats = spec_adapt.SpecStats()
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD,
                         custom_generate=spec_adapt.generate, drafter=drafter, assistant_policy=policy,
                         verifier=verifier, spec_stats=stats, **kw)
    return out, stats


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("gamma", [1, 3, 8])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("layers", [[1], [0, 2]])
def test_early_exit_greedy_identity(arch, batch, gamma, mode, layers):
    model = deep_model(arch)
    ids, mask = ragged_batch(batch, seed=batch + gamma)
    reference = stock_greedy(model, ids, mask, eos_token_id=None)
    oracle = Oracle(reference, mask, MODES[mode])
    verifier = EarlyExitVerifier(layers=layers, top_k=1, gate="always")
    out, stats = run(model, ids, mask, oracle.drafter(), FixedLength(gamma), verifier, eos_token_id=None)
    assert torch.equal(out, reference)
    assert stats.fallback is None
    for rec in stats.trace:            # acceptance is exactly the script's on the drafts the verifier kept
        for row, drafted, accepted in zip(rec.rows, rec.drafted, rec.accepted):
            assert accepted == oracle.expected_accepted(row, drafted)
    assert stats.verifier["tested"] > 0 and stats.verifier["pruned"] > 0
    assert sum(stats.verifier["per_layer"].get(x, {}).get("tested", 0) for x in layers) == stats.verifier["tested"]


def test_cut_row_commits_its_last_kept_draft_without_a_bonus():
    """A row cut after d_{i+1} that accepts all it kept commits exactly its kept drafts (no token after them)."""
    model = deep_model("llama")
    ids, mask = ragged_batch(2, seed=3)
    reference = stock_greedy(model, ids, mask, eos_token_id=None)
    oracle = Oracle(reference, mask, ["right"])
    out, stats = run(model, ids, mask, oracle.drafter(), FixedLength(6),
                     EarlyExitVerifier(layers=[0], top_k=1, gate="always"), eos_token_id=None)
    assert torch.equal(out, reference)
    cut = [(d, c) for rec in stats.trace for d, c in zip(rec.drafted, rec.committed) if 0 < d < 6]
    assert cut, "no row was cut"
    assert all(c in (d, d + 1) for d, c in cut)
    assert any(c == d for d, c in cut)        # all kept drafts accepted and nothing after them


@pytest.mark.parametrize("batch", [1, 5])
def test_early_exit_eos_mid_batch(batch):
    model = deep_model("qwen2")
    ids, mask = ragged_batch(batch, seed=20 + batch)
    free = stock_greedy(model, ids, mask, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 4])
    reference = stock_greedy(model, ids, mask, eos_token_id=eos)
    oracle = Oracle(reference, mask, MODES["mixed"], eos=(eos,))
    out, stats = run(model, ids, mask, oracle.drafter(), FixedLength(4),
                     EarlyExitVerifier(layers=[1], top_k=1, gate="always"), eos_token_id=eos)
    assert torch.equal(out, reference)
    assert stats.verifier["tested"] > 0


def _drafters(model):
    draft = tiny_model("llama", seed=7, layers=1)
    return {
        "model": ModelDrafter(draft),
        "model-confident": ModelDrafter(draft, confidence_threshold=0.3),
        "lookup": spec_adapt.PromptLookupDrafter(max_ngram=2, min_ngram=1),
        "suffix": spec_adapt.SuffixDrafter(index=spec_adapt.drafters.SuffixIndex()),
        "chain": spec_adapt.ChainDrafter([spec_adapt.PromptLookupDrafter(2, 1), draft]),
    }


@pytest.mark.parametrize("name", ["model", "model-confident", "lookup", "suffix", "chain"])
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_early_exit_every_drafter_and_a_policy(name, policy):
    model = deep_model("llama")
    ids, mask = ragged_batch(4, seed=31)
    ids[:, -4:] = ids[:, -8:-4].clone() if ids.shape[1] >= 8 else ids[:, -4:]      # repeats for lookup to find
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=32)
    drafter = _drafters(model)[name]
    chooser = FixedLength(4) if policy == "fixed" else Adaptive()
    out, stats = run(model, ids, mask, drafter, chooser, EarlyExitVerifier(layers=[1], top_k=1, gate="always"),
                     eos_token_id=None, max_new_tokens=32)
    assert torch.equal(out, reference)
    assert stats.fallback is None


def test_full_verifier_is_the_default_and_explicit_matches():
    model = deep_model("llama")
    ids, mask = ragged_batch(3, seed=4)
    reference = stock_greedy(model, ids, mask, eos_token_id=None)
    oracle = Oracle(reference, mask, MODES["mixed"])
    out, stats = run(model, ids, mask, oracle.drafter(), FixedLength(3), FullVerifier(), eos_token_id=None)
    assert torch.equal(out, reference) and stats.verifier == {}


def test_enable_passes_the_verifier_through():
    model = deep_model("llama")
    ids, mask = ragged_batch(2, seed=5)
    reference = stock_greedy(model, ids, mask, eos_token_id=None)
    oracle = Oracle(reference, mask, ["right"])
    spec_adapt.enable(model)
    try:
        stats = spec_adapt.SpecStats()
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD,
                             eos_token_id=None, max_new_tokens=24, assistant_model=oracle.drafter(),
                             assistant_policy=FixedLength(4), spec_stats=stats,
                             verifier=EarlyExitVerifier(layers=[1], top_k=1, gate="always"))
    finally:
        spec_adapt.disable(model)
    assert torch.equal(out, reference) and stats.verifier["pruned"] > 0


# -- sampling ----------------------------------------------------------------------------------------------------------
def test_early_exit_sampling_follows_target_distribution():
    from test_sampling import TEMPERATURE, TOP_K, VOCAB_SMALL, exact_marginals, marginals_miss

    target = tiny_model("llama", seed=5, vocab=VOCAB_SMALL, layers=3)
    draft = tiny_model("llama", seed=6, vocab=VOCAB_SMALL, layers=1)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.3)
        draft.lm_head.weight.mul_(0.3)
    n, prompt = 6000, [3, 7, 9, 4]
    marginals = exact_marginals(target, prompt)
    ids = torch.tensor([prompt]).repeat(n, 1)
    verifier = EarlyExitVerifier(layers=[0], top_k=3, gate="always")
    torch.manual_seed(0)
    out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                          temperature=TEMPERATURE, top_k=TOP_K, top_p=None, max_new_tokens=5, eos_token_id=None,
                          pad_token_id=PAD, custom_generate=spec_adapt.generate, drafter=draft,
                          assistant_policy=FixedLength(3), verifier=verifier)
    stats = spec_adapt.last_stats()
    assert stats.fallback is None and stats.verifier["pruned"] > 0
    assert marginals_miss(out[:, len(prompt):], marginals) is None


# -- boundaries ----------------------------------------------------------------------------------------------------------
def test_unsupported_models_and_settings_are_refused():
    ids, mask = ragged_batch(1)
    drafter = ScriptedDrafter(lambda row, context, gamma: [3] * gamma)
    with pytest.raises(ValueError, match="Llama- and Qwen2-style"):
        run(tiny_model("gpt2", layers=4), ids, mask, drafter, FixedLength(2), EarlyExitVerifier())
    model = deep_model("llama")
    with pytest.raises(ValueError, match="layers must be ints"):
        run(model, ids, mask, drafter, FixedLength(2), EarlyExitVerifier(layers=[3]))
    with pytest.raises(ValueError, match="layers must be ints"):
        run(model, ids, mask, drafter, FixedLength(2), EarlyExitVerifier(layers=[1.5]))
    with pytest.raises(TypeError, match="verifier must be"):
        run(model, ids, mask, drafter, FixedLength(2), "early-exit")
    with pytest.raises(ValueError, match="top_k"):
        EarlyExitVerifier(top_k=0)
    with pytest.raises(ValueError, match="gate"):
        EarlyExitVerifier(gate="sometimes")


def _gated() -> EarlyExitVerifier:
    """An auto gate reading a step-cost model as a call hands it one (`share_cost`); the test writes that model
    (`verifier.cost.cost`), as the call's writer would."""
    verifier = EarlyExitVerifier(gate="auto")
    verifier.cost = CostReader(StepCost(), threading.Lock())
    return verifier


def _gate_step(verifier, key, batch, seconds, tokens=2.0):
    """One gated step at (bucket, width) = key: the gate picks a path, the step verifies in seconds[path] and
    commits `tokens` per row."""
    path = verifier._choose(key, batch)
    verifier.cost.cost.observe_verify(batch, key[1], seconds[path], path)
    verifier._observe(key, path, batch, tokens)
    return path


def test_gate_takes_the_faster_path_and_keeps_probing():
    """The gate reads each path's verification time from the step-cost model: mostly the faster path, with rare
    probes of the other; swap the times and it swaps paths."""
    verifier = _gated()
    key, fast_pruned = (4, 5), {"full": 1.0, "pruned": 0.5}
    chosen = [_gate_step(verifier, key, 4, fast_pruned) for _ in range(4)]      # two samples of each path first
    assert sorted(chosen) == ["full", "full", "pruned", "pruned"]
    picks = [_gate_step(verifier, key, 4, fast_pruned) for _ in range(40)]
    assert picks.count("pruned") >= 36 and "full" in picks          # mostly the faster, with rare probes
    slow = _gated()
    for _ in range(44):
        _gate_step(slow, key, 4, {"full": 0.5, "pruned": 1.0})
    assert slow._choose(key, 4) == "full"


def test_gate_weighs_the_tokens_a_path_drops():
    """A pruned path that verifies faster but commits fewer tokens per step (its cuts drop accepted drafts) loses
    when its seconds per committed token are higher."""
    verifier = _gated()
    key = (1, 5)
    for _ in range(20):
        path = verifier._choose(key, 1)
        verifier.cost.cost.observe_verify(1, 5, {"full": 1.0, "pruned": 0.8}[path], path)
        verifier._observe(key, path, 1, {"full": 4.0, "pruned": 2.0}[path])
    assert verifier._choose(key, 1) == "full"
