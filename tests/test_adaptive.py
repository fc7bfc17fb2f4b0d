"""Adaptive, the default policy: never behind plain decoding, close to the best fixed width, and learning that
carries over. Deterministic simulations in the lab (no model runs): each workload has a known best fixed width."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

import spec_adapt
from spec_adapt import Adaptive, FixedLength
from spec_adapt.policies import Heuristic, Nightjar
from spec_adapt.tools.lab import Batches, Request, Static, best_fixed, compare, simulate, synthetic_requests
from spec_adapt.policies.policy import Plan
from spec_adapt.policies.estimators import LatencyTable

from conftest import PAD, Oracle, cached_model, ragged_batch, stock_greedy


def latency(slope_at_1: float, slope_at_16: float) -> LatencyTable:
    """T(B, s) / T(B, 0) = 1 + slope(B) * s, slope interpolated between B = 1 and B = 16."""
    return LatencyTable(step={1: {s: 1.0 + slope_at_1 * s for s in range(17)},
                              16: {s: 1.0 + slope_at_16 * s for s in range(17)}})


def speculative_share(result, skip: int = 50) -> float:
    late = result.history[skip:]
    return sum(1 for _, _, mean_gamma in late if mean_gamma > 0) / len(late)


@pytest.mark.parametrize("batch", [1, 16])
def test_plain_decoding_when_speculation_never_pays(batch):
    """Verification is expensive and drafts are poor: plain decoding is best. After warm-up Adaptive speculates on
    under 3% of steps; transformers' heuristic schedule (the old default) keeps drafting."""
    lat = latency(0.5, 0.9)
    requests = synthetic_requests(batch * 8, 200, 0.3, seed=1)
    assert best_fixed(requests, lat, Static(batch))[0] == 0
    assert speculative_share(simulate(Adaptive(), requests, lat, Static(batch))) < 0.03
    assert speculative_share(simulate(Heuristic(initial=4), requests, lat, Static(batch))) > 0.5


def test_drafts_at_batch_1_and_not_at_batch_16():
    """One policy object serving both batch sizes: at B = 1 verification is cheap and drafting 4-5 tokens is best;
    at B = 16 verification is compute-bound and plain decoding is best. Adaptive is within 5% of the best fixed
    width at each, which no single fixed width achieves at both."""
    lat = latency(0.15, 0.9)
    policy = Adaptive()
    for batch in (1, 16, 1, 16):
        requests = synthetic_requests(batch * 8, 200, 0.8, seed=batch)
        gamma, best, fixed = best_fixed(requests, lat, Static(batch))
        result = simulate(policy, requests, lat, Static(batch))
        assert gamma == (0 if batch == 16 else 5) or (batch == 1 and gamma in (4, 5, 6))
        assert result.goodput >= 0.95 * best.goodput, (batch, result.goodput / best.goodput)
    assert fixed[5].goodput < 0.8 * fixed[0].goodput          # at B = 16 the B = 1 choice is far behind


def test_shifting_workload_beats_every_fixed_width():
    """Blocks of code-like requests (acceptance 0.85) and chat-like ones (0.2): the best width moves; Adaptive
    follows it and ends ahead of every fixed width."""
    lat = LatencyTable(step={b: {s: 1 + 0.1 * s * (1 + 0.15 * (b - 1)) for s in range(17)} for b in (1, 4, 16)})
    requests = []
    for block in range(6):
        requests += synthetic_requests(24, 120, 0.85 if block % 2 == 0 else 0.2, seed=block)
    out = compare({"adaptive": Adaptive()}, requests, lat, Static(4))
    assert out["policies"]["adaptive"]["goodput"] > max(r.goodput for r in out["fixed"].values())


@pytest.mark.parametrize("batch", [1, 16])
def test_a_draft_that_is_always_wrong_costs_almost_nothing(batch):
    lat = latency(0.3, 0.6)
    requests = [Request([0] * 400) for _ in range(batch * 2)]
    plain = simulate(FixedLength(0), requests, lat, Static(batch))
    ours = simulate(Adaptive(), requests, lat, Static(batch))
    assert ours.seconds <= 1.03 * plain.seconds, ours.seconds / plain.seconds
    assert simulate(Nightjar(), requests, lat, Static(batch)).seconds > 1.03 * plain.seconds


def mixed_batches(groups: int, length: int = 200) -> list[Request]:
    """Closed batches of 4 equally long requests: one the draft gets right for long runs, three it never does."""
    requests = []
    for g in range(groups):
        requests += synthetic_requests(1, length, 0.95, seed=g) + [Request([0] * length) for _ in range(3)]
    return requests


def test_a_closed_batch_is_judged_by_its_slowest_row():
    """A generate call ends with its slowest row. Drafting is cheap, so counting every row's tokens (throughput)
    drafts for the one good row: it finishes early and the call still takes as many steps, each dearer. Judged by
    the slowest row, Adaptive stays plain; the per-step choice differs the same way."""
    lat = latency(0.05, 0.2)
    requests = mixed_batches(6)
    plain = simulate(FixedLength(0), requests, lat, Batches(4))
    open_ = simulate(Adaptive(closed_batches=False), requests, lat, Batches(4))
    closed = simulate(Adaptive(), requests, lat, Batches(4))
    assert open_.seconds > 1.03 * plain.seconds, open_.seconds / plain.seconds
    assert closed.seconds <= 1.02 * plain.seconds, closed.seconds / plain.seconds
    assert speculative_share(open_) > 0.08 and speculative_share(closed) < 0.06     # probes only


def test_a_closed_batch_still_drafts_when_every_row_gains():
    lat = latency(0.05, 0.2)
    requests = synthetic_requests(24, 200, 0.85, seed=5)
    gamma, best, fixed = best_fixed(requests, lat, Batches(4))
    result = simulate(Adaptive(), requests, lat, Batches(4))
    assert gamma > 0 and result.goodput >= 0.95 * best.goodput, (gamma, result.goodput / best.goodput)
    assert result.goodput > 1.5 * fixed[0].goodput


def test_closed_batch_value_is_the_slowest_rows_progress():
    """batch_tokens: sum over rows when open; sum_b r_b / max_b (r_b / E_b(s)) when closed (equal at B = 1)."""
    from spec_adapt.policies.adaptive import batch_tokens

    expected = torch.tensor([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]])
    assert batch_tokens(expected) == [2.0, 3.0, 4.0]
    assert batch_tokens(expected, torch.tensor([10, 10])) == [2.0, 2.0, 2.0]      # row 1 sets the pace
    # Row 1 has a fifth of row 0's budget left: row 0 is the slowest at every width, and it gains.
    assert batch_tokens(expected, torch.tensor([10, 2])) == pytest.approx([1.2, 2.4, 3.6])
    assert batch_tokens(expected[:1], torch.tensor([7])) == batch_tokens(expected[:1])


def test_the_loop_tells_the_policy_its_batch_is_closed():
    """A generate call's StepInfo says closed; the serving loop's says open."""
    from spec_adapt.loop import SpeculativeLoop
    from spec_adapt.serving.engine import ServingLoop

    seen = []

    class Spy(FixedLength):
        def choose(self, info):
            seen.append(info.closed)
            return super().choose(info)

    model = cached_model("llama")
    ids, mask = ragged_batch(2, seed=71)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=6)
    oracle = Oracle(reference, mask, ["right", "right"])
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, eos_token_id=None,
                         max_new_tokens=6, custom_generate=spec_adapt.generate, drafter=oracle.drafter(),
                         assistant_policy=Spy(2))
    assert torch.equal(out, reference) and seen and all(seen)
    assert SpeculativeLoop.closed is True and ServingLoop.closed is False


def _decision(plan):
    """A choice as comparable values: the widths, and a stop rule's threshold and calibration (the threshold to 9
    digits: a restored line fit sums its window in another order)."""
    if not isinstance(plan, Plan):
        return torch.as_tensor(plan).tolist(), None
    rule = plan.stop and ([float(f"{t:.9g}") for t in plan.stop.thresholds], plan.stop.calibration.state_dict())
    return torch.as_tensor(plan.gammas).tolist(), rule


def test_what_was_learned_carries_over(tmp_path):
    """save / load in JSON: the loaded policy makes the same choices, and exports the same vLLM schedule."""
    lat = latency(0.15, 0.9)
    policy = Adaptive(seed=3)
    for batch in (1, 16):
        simulate(policy, synthetic_requests(batch * 4, 100, 0.8, seed=batch), lat, Static(batch))
    policy.save(tmp_path / "adaptive.json")
    loaded = Adaptive.load(tmp_path / "adaptive.json")
    json.loads((tmp_path / "adaptive.json").read_text())
    for step in range(20):
        batch = (1, 4, 16)[step % 3]
        info = spec_adapt.policies.StepInfo(batch, torch.arange(batch), torch.zeros(batch, dtype=torch.long),
                                   torch.full((batch,), 50), step)
        assert _decision(policy.choose(info)) == _decision(loaded.choose(info))
    schedule = policy.to_vllm_schedule(max_batch=64)
    assert schedule == loaded.to_vllm_schedule(max_batch=64)
    assert schedule[0][0] == 1 and schedule[-1][1] == 64
    assert all(a[1] + 1 == b[0] for a, b in zip(schedule, schedule[1:]))        # contiguous ranges
    assert schedule[0][2] >= 3 and schedule[-1][2] == 0                          # drafts at B = 1, not at 64


def test_adaptive_is_the_default_policy():
    model = cached_model("llama")
    ids, mask = ragged_batch(3, seed=70)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=24)
    oracle = Oracle(reference, mask, ["right", "wrong", 2])
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, eos_token_id=None,
                         max_new_tokens=24, custom_generate=spec_adapt.generate, drafter=oracle.drafter())
    assert torch.equal(out, reference)
    assert spec_adapt.last_stats().policy == "Adaptive(max_gamma=8)"


def test_profile_cached_per_model_dtype_device_is_loaded(tmp_path, monkeypatch):
    """`spec-adapt profile` writes to the cache path; Adaptive.for_model and generate's default policy read it."""
    from spec_adapt import api
    from spec_adapt.tools.profiling import LatencyTable, cached_profile, profile_key, profile_path

    from conftest import tiny_model

    monkeypatch.setenv("SPEC_ADAPT_CACHE", str(tmp_path))
    model = tiny_model("llama")
    assert cached_profile(model) is None and Adaptive.for_model(model).table is None
    table = LatencyTable(step={1: {0: 0.01, 4: 0.02}}, meta={"note": "test"})
    table.save(profile_path(model))
    assert Adaptive.for_model(model).table.step == table.step
    assert profile_key(model) != profile_key(model.to(torch.bfloat16))           # dtype is part of the key
    assert api._default_policy(model.float(), None).table.step == table.step
    draft = tiny_model("llama", seed=3, layers=1)
    assert Adaptive.for_model(model, draft).table is None                          # so is the draft
    key = profile_key(model)
    spec_adapt.prepare(model)
    assert profile_key(model) != key                                               # and whether it is prepared
    spec_adapt.unprepare(model)
    assert profile_key(model) == key


def test_a_call_kept_plain_never_runs_the_draft():
    """The draft is not prefilled: a call the policy keeps plain costs no draft forward at all (an eager prompt
    prefill cost the 0.5B draft more than its drafts saved at batch 4 on the real pair)."""
    from spec_adapt import ModelDrafter

    from conftest import spec_generate, tiny_model

    model, draft = cached_model("llama"), tiny_model("llama", seed=3, layers=1)
    calls = []
    hook = draft.register_forward_hook(lambda *a: calls.append(1))
    try:
        ids, mask = ragged_batch(3)
        drafter = ModelDrafter(draft)
        out, stats = spec_generate(model, ids, mask, drafter, FixedLength(0))
        assert not calls and drafter.kv_writes == 0
        assert torch.equal(out, stock_greedy(model, ids, mask, eos_token_id=None))
        out, stats = spec_generate(model, ids, mask, ModelDrafter(draft), FixedLength(2))
        assert calls and stats.drafted > 0                       # the first proposal caught up on the prompt
        assert torch.equal(out, stock_greedy(model, ids, mask, eos_token_id=None))
    finally:
        hook.remove()


def test_catch_up_cost_is_a_line_in_the_lag():
    policy = Adaptive()
    assert policy.catchup_time(1, 100) == 0.0                   # nothing seen: no charge
    policy.cost.observe_catchup("model", 1, 100, 1.0)
    assert policy.catchup_time(1, 10) == pytest.approx(0.1)     # one sample: proportional to the lag
    policy.cost.observe_catchup("model", 1, 10, 0.2)
    policy.cost.observe_catchup("model", 1, 100, 1.0)
    assert policy.catchup_time(1, 50) == pytest.approx(0.2 + 40 * 0.8 / 90)   # a line once two lags are seen
    assert policy.catchup_time(4, 50) == pytest.approx(policy.catchup_time(1, 50))   # the nearest batch size seen
    state = policy.state_dict()
    again = Adaptive()
    again.load_state_dict(json.loads(json.dumps(state)))
    assert again.catchup_time(1, 50) == pytest.approx(policy.catchup_time(1, 50))


def test_a_stall_does_not_stand_for_a_plain_step():
    """One plain step that stalled (a GC pause, the OS preempting the engine's thread) must not make plain decoding
    look slower than drafting: two stalled steps of 13 and 23 ms against ~2 ms (as `spec-adapt soak` saw) would
    otherwise raise the plain estimate enough that the policy drafts at a loss, and plain steps are not re-measured
    while it drafts."""
    from spec_adapt.metrics import StepRecord
    from spec_adapt.policies.policy import StepInfo

    def plain(seconds):
        policy._pending = {"width": 0, "lag": 0, "probing": False, "burst": False}
        policy.observe(StepRecord(8, list(range(8)), [0] * 8, [0] * 8, [0] * 8, [1] * 8, seconds, 0, seconds))

    policy = Adaptive()
    policy.begin(8)
    for _ in range(30):
        policy.cost.observe_verify(8, 2, 0.0045)                 # width 1 measured at 4.5 ms
    policy.tried[:, 0], policy.accepted[:, 0] = 100.0, 33.0       # a third of first drafts accepted
    policy._refresh()
    for _ in range(50):
        plain(0.002)
    plain(0.013)
    plain(0.0235)
    assert policy.step_time(8, 0) < 0.003
    info = StepInfo(8, torch.arange(8), torch.full((8,), 5), torch.full((8,), 50), 60)
    assert int(torch.as_tensor(policy.choose(info)).max()) == 0   # plain still pays more


def test_a_probe_pays_for_its_catch_up():
    """A probe whose draft first caught up on a long lag (a whole prompt) is judged with that time: when the catch-up
    costs more than the probe's drafts saved, the gap to the next probe doubles instead of resetting."""
    from spec_adapt.metrics import StepRecord

    def record(seconds, committed):
        return StepRecord(4, [0, 1, 2, 3], [3] * 4, [3] * 4, [c - 1 for c in committed], committed, seconds,
                          seconds - 0.3, 0.3)

    policy = Adaptive(probe_every=4, max_probe_gap=64)
    for _ in range(10):
        policy.cost.observe_verify(4, 1, 0.2)                    # a plain step at batch 4: 0.2 s for 4 tokens
    gap = policy.probe_gap
    # The step itself (0.4 s for 12 tokens: 0.033 s per row-token) beats plain (0.05 s), its 3 s catch-up does not.
    policy._pending = {"width": 3, "lag": 300, "probing": True, "burst": False}
    policy.observe(record(3.4, [3, 3, 3, 3]))
    assert policy.probe_gap == 2 * gap
    policy._pending = {"width": 3, "lag": 1, "probing": True, "burst": False}    # no catch-up: a winning probe
    policy.observe(record(0.4, [3, 3, 3, 3]))
    assert policy.probe_gap == policy.probe_every


def test_bench_policy_state_round_trip(tmp_path):
    """`spec-adapt bench --policy-state`: a cell's policy is saved after the run and a later run starts from it."""
    from types import SimpleNamespace

    from spec_adapt.tools.bench import _policy_file

    lat = latency(0.15, 0.9)
    trained = Adaptive(seed=3)
    simulate(trained, synthetic_requests(8, 60, 0.8, seed=1), lat, Static(4))
    fresh = SimpleNamespace(policy=Adaptive(seed=3))
    assert _policy_file(tmp_path, "lookup:adaptive", 4, fresh, load=True) is False          # nothing saved: cold
    _policy_file(tmp_path, "lookup:adaptive", 4, SimpleNamespace(policy=trained), load=False)
    assert _policy_file(tmp_path, "lookup:adaptive", 4, fresh, load=True) is True           # warm
    assert json.dumps(fresh.policy.state_dict()) == json.dumps(trained.state_dict())
    assert _policy_file(tmp_path, "target", 4, SimpleNamespace(policy=None), load=True) is None


def _draft_model_table() -> LatencyTable:
    """The real pair at batch 4 on this CPU (bench traces, bf16): a plain step 0.145 s, gamma = 2 about 0.32 s
    (1.1x plain's goodput at acceptance 0.8), and a draft that is not prefilled catches up on a 147-token prompt
    in 1.1 s the first time its row drafts."""
    return LatencyTable(step={4: {s: 0.145 + 0.015 * s for s in range(9)}}, draft_token={4: 0.07},
                        prefill={147: {4: 1.1}})


def _prompted(n, length, seed):
    requests = synthetic_requests(n, length, 0.8, seed=seed)
    for r in requests:
        r.prompt = 147
    return requests


def test_a_draft_whose_catch_up_does_not_pay_stays_off():
    """Short outputs (32 tokens) behind a 147-token prompt: catching the draft up costs more than its drafts can
    save, so plain decoding is the best fixed width. Adaptive must stay within 3% of it: probes that pay for a
    catch-up are spaced by what they cost, and re-enabling is charged over the steps the rows have left. (Before:
    probes every 16-256 steps, each paying a whole catch-up: 0.89x of plain.)"""
    lat, requests = _draft_model_table(), _prompted(192, 32, seed=1)
    gamma, best, _ = best_fixed(requests, lat, Static(4))
    assert gamma == 0
    ours = simulate(Adaptive(), requests, lat, Static(4))
    assert ours.goodput >= 0.97 * best.goodput, ours.goodput / best.goodput


def test_a_draft_whose_catch_up_pays_is_used():
    """The same draft and prompts with long outputs (1000 tokens): the catch-up is paid once per request and drafting
    wins; Adaptive stays within 5% of the best fixed width."""
    lat, requests = _draft_model_table(), _prompted(8, 1000, seed=2)
    gamma, best, fixed = best_fixed(requests, lat, Static(4))
    assert gamma > 0 and best.goodput > 1.05 * fixed[0].goodput
    ours = simulate(Adaptive(), requests, lat, Static(4))
    assert ours.goodput >= 0.95 * best.goodput, ours.goodput / best.goodput


def test_a_profiled_catch_up_cost_is_used_until_one_is_measured():
    lat = _draft_model_table()
    policy = Adaptive(latency=lat)
    assert policy.catchup_time(4, 147) == pytest.approx(1.1)       # the table's c_prefill(L, B)
    assert Adaptive().catchup_time(4, 147) == 0.0


def test_the_targets_prompt_forwards_bound_a_catch_up_until_one_is_measured():
    """Before a catch-up is measured (and with no profile), it is charged what the target's own prompt forwards took
    per token, for batch x lag tokens: a draft no larger than its target catches up no slower. A measured catch-up
    replaces the bound; the bound is saved with the policy."""
    policy = Adaptive()
    policy.prefilled(800, 8.0)                                   # 4 prompts of 200 tokens: 10 ms a token
    assert policy.catchup_time(4, 200) == pytest.approx(8.0)
    assert policy.catchup_time(1, 50) == pytest.approx(0.5)
    again = Adaptive()
    again.load_state_dict(json.loads(json.dumps(policy.state_dict())))
    assert again.catchup_time(4, 200) == pytest.approx(8.0)
    policy.cost.observe_catchup("model", 4, 200, 5.0)
    assert policy.catchup_time(4, 200) == pytest.approx(5.0)
    for bad in ([0.0, 1], [-1.0, 1], [0.01, 0], [float("nan"), 1], "fast"):
        state = json.loads(json.dumps(again.state_dict()))
        state["cost"]["prefill"] = bad
        with pytest.raises(ValueError, match="prefill holds"):
            Adaptive().load_state_dict(state)


def test_a_call_tells_the_policy_what_its_prompt_forward_took():
    model = cached_model("llama")
    ids, mask = ragged_batch(3, seed=2)
    policy = Adaptive()
    spec_adapt.generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=4, pad_token_id=PAD,
                        eos_token_id=None, assistant_policy=policy,
                        drafter=spec_adapt.ScriptedDrafter(lambda row, context, gamma: [5] * gamma))
    seconds, samples = policy.cost.prefill
    assert samples == 1 and seconds > 0


def test_a_short_closed_batch_starts_no_draft_whose_catch_up_it_never_pays_back():
    """Batch 4, 48 tokens left, a draft 200 tokens behind: drafting pays per step, but catching the draft up on four
    200-token prompts costs, by what the target's own prompt forward took, more than 48 tokens of drafting save.
    Unmeasured and unbounded, the catch-up would be charged nothing and the draft started."""
    from spec_adapt.policies.policy import StepInfo

    def choose(policy):
        info = StepInfo(4, torch.arange(4), torch.zeros(4, dtype=torch.long), torch.full((4,), 48), 10,
                        torch.full((4,), 200), None, True)
        return int(torch.as_tensor(policy.choose(info)).max())

    def trained():
        policy = Adaptive(explore=0.0)
        policy.begin(4)
        for _ in range(4):
            for fed in range(1, 10):
                policy.cost.observe_verify(4, fed, 0.3 + 0.02 * (fed - 1))
            policy.cost.observe_draft("model", 4, 4, 0.28)
        policy.tried[:], policy.accepted[:] = 100.0, 85.0
        policy._refresh()
        return policy

    assert choose(trained()) > 0
    bounded = trained()
    bounded.prefilled(800, 8.0)
    assert choose(bounded) == 0


def test_a_cold_policy_does_not_probe_through_a_whole_prompt():
    """No catch-up measured yet: a probe that would catch a draft model up on a 500-token prompt is not due however
    long the plain run (worst case: a plain step per lag token); once a catch-up is measured cheap, it is."""
    policy = Adaptive(probe_every=4)
    for _ in range(10):
        policy.cost.observe_verify(32, 1, 1.0)
    policy.probes.idle = 10_000
    assert not policy._probe_due(32, 500)
    assert policy._probe_due(32, 1)                              # nothing to catch up on: the usual gap
    policy.cost.observe_catchup("model", 32, 500, 5.0)           # measured: 5 s, within 1% of 10,000 plain seconds
    assert policy._probe_due(32, 500)


def test_a_probe_comes_back_when_waiting_cannot_make_its_catch_up_cheaper():
    """After plain steps the draft's lag grows a token a step, so its catch-up's share of the plain time since the last
    probe never falls below what one lag token costs over a plain step. Here that floor (4 ms a token at 0.26 s
    plain steps: 0.015) is above the 1% budget; the probe is due once the share is within twice the floor, not never
    (one rejected step kept the draft off for the rest of the call). A whole prompt's catch-up is still not probed,
    nor is a draft that catches up as slowly as its target decodes."""
    policy = Adaptive(probe_every=16)
    for _ in range(4):
        policy.cost.observe_verify(1, 1, 0.26)
    policy.prefilled(150, 0.6)                   # the target's prompt forward: 4 ms a token bounds the catch-up
    policy.probes.idle = 16
    assert policy.catchup_time(1, 17) > policy.probe_budget * 16 * 0.26     # over the budget itself
    assert policy._probe_due(1, 17)
    assert not policy._probe_due(1, 500)         # a prompt behind: its share is far above the floor
    slow = Adaptive(probe_every=16)
    for _ in range(4):
        slow.cost.observe_verify(1, 1, 0.26)
    slow.prefilled(150, 150 * 0.26)              # a floor of one plain step per token: never
    slow.probes.idle = 10_000
    assert not slow._probe_due(1, 10_001)


@pytest.mark.parametrize("kwargs", [dict(explore=1.5), dict(probe_every=0), dict(max_probe_gap=2), dict(horizon=0),
                                    dict(probe_budget=-0.1), dict(max_gamma=0), dict(shape_margin=-1),
                                    dict(closed_batches="yes")])
def test_malformed_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="Adaptive"):
        Adaptive(**kwargs)


def shape_record(held, live, drafted, verify_time):
    from spec_adapt.metrics import StepRecord

    return StepRecord(live, list(range(live)), [drafted] * live, [drafted] * live, [0] * live, [1] * live,
                      verify_time, 0, verify_time, held=held)


def test_batch_rows_keeps_a_faster_bigger_batch():
    """The 2-core CPU's SmolLM2 forwards (97 ms at 4 rows, 158 ms at 3, 113 ms at 2): when rows finish, the target
    keeps 4 rows; where the smaller batch is as fast (a GPU), it compacts; a size never measured is not kept."""
    policy = Adaptive()
    assert policy.batch_rows(3, 4) == 3                          # nothing measured: compact (and measure 3)
    for held, seconds in ((4, 0.097), (3, 0.158), (2, 0.113)):
        for _ in range(2):
            policy.observe(shape_record(held, held, 0, seconds))
    assert policy.batch_rows(3, 4) == 4
    assert policy.batch_rows(2, 4) == 4 and policy.batch_rows(2, 3) == 2
    assert policy.batch_rows(1, 4) == 1                          # batch 1 never ran: nothing to compare with
    again = Adaptive()
    again.load_state_dict(json.loads(json.dumps(policy.state_dict())))
    assert again.batch_rows(3, 4) == 4
    gpu = Adaptive()
    for held, seconds in ((4, 0.0100), (3, 0.0098), (2, 0.0097)):
        for _ in range(2):
            gpu.observe(shape_record(held, held, 2, seconds))
    assert gpu.batch_rows(3, 4) == 3 and gpu.batch_rows(2, 4) == 2
    gpu.observe(shape_record(4, 4, 5, 0.001))                    # one sample at another width: not enough
    assert gpu.batch_rows(2, 4) == 2


def test_batch_rows_compares_at_the_widths_both_sizes_ran():
    policy = Adaptive()
    for _ in range(2):
        policy.observe(shape_record(4, 4, 3, 0.10))              # 4 rows only ever verified 4 tokens
        policy.observe(shape_record(3, 3, 0, 0.05))              # 3 rows only ever ran plain
    assert policy.batch_rows(3, 4) == 3                          # no common width: no comparison, compact
    for _ in range(2):
        policy.observe(shape_record(3, 3, 3, 0.20))
    assert policy.batch_rows(3, 4) == 4


def test_batch_rows_weighs_the_widths_the_batch_runs():
    """Measured on the CPU (HumanEval, suffix drafter): 4 rows beat 3 at one token, lose at 4-7 tokens. A batch that
    mostly drafts wide compacts; the same shapes with mostly plain steps keep the spare row."""
    times = {0: (0.096, 0.117), 3: (0.124, 0.104), 5: (0.122, 0.111), 6: (0.128, 0.117)}   # width: (4 rows, 3 rows)

    def policy_running(counts):
        policy = Adaptive()
        for width, (four, three) in times.items():
            for _ in range(2):
                policy.observe(shape_record(3, 3, width, three))
            for _ in range(counts[width]):
                policy.observe(shape_record(4, 4, width, four))
        return policy

    assert policy_running({0: 2, 3: 20, 5: 20, 6: 20}).batch_rows(3, 4) == 3
    assert policy_running({0: 60, 3: 2, 5: 2, 6: 2}).batch_rows(3, 4) == 4


def test_a_slow_batch_of_three_keeps_a_spare_row_in_a_real_loop(monkeypatch):
    """End to end on a tiny model whose forward at 3 rows is made slower (on a virtual clock, so the test does not
    depend on the machine's load): the first call compacts and measures it, the second keeps the finished row as a
    spare; every output equals stock generate."""
    from spec_adapt import PromptLookupDrafter
    from spec_adapt.loop import Clock

    model = cached_model("llama")
    ids, mask = ragged_batch(4, seed=30)
    free = stock_greedy(model, ids, mask, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 2])
    reference = stock_greedy(model, ids, mask, eos_token_id=eos)
    clock = [0.0]
    monkeypatch.setattr(Clock, "now", lambda self: clock[0])

    def tick(mod, args, kwargs, out):
        clock[0] += 0.1 if kwargs["input_ids"].shape[0] == 3 else 0.01

    hook = model.register_forward_hook(tick, with_kwargs=True)

    class Widths2(Adaptive):      # Adaptive's batch shapes; its widths fixed, so the shapes it sees do not vary
        def choose(self, info):
            return 2

    policy = Widths2()
    try:
        held = []
        for _ in range(2):
            stats = spec_adapt.SpecStats()
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD,
                                 max_new_tokens=24, eos_token_id=eos, custom_generate=spec_adapt.generate,
                                 drafter=PromptLookupDrafter(3, 1), assistant_policy=policy, spec_stats=stats)
            assert torch.equal(out, reference)
            held.append({r.held for r in stats.trace if r.batch_size == 3})
    finally:
        hook.remove()
    assert held[0] == {3} and held[1] == {4}, sorted(policy.cost.verify.items())


def drive(policy, steps: int, plain_seconds, draft_seconds=0.06, verify_seconds=0.10, accept=0.8, seed=0):
    """Drive `policy` through `steps` batch-1 steps of a synthetic pair: plain steps take plain_seconds(step), a step
    drafting s tokens takes verify_seconds + s * draft_seconds, and each draft is accepted with probability `accept`
    until the first rejection. Returns the widths chosen."""
    import random

    from spec_adapt.metrics import StepRecord
    from spec_adapt.policies.policy import StepInfo

    rng, widths = random.Random(seed), []
    policy.begin(1)
    for step in range(steps):
        info = StepInfo(1, torch.arange(1), torch.full((1,), step), torch.full((1,), 10**6), step,
                        draft_lag=torch.ones(1, dtype=torch.long))
        width = int(torch.as_tensor(policy.choose(info)).max())
        accepted = 0
        while accepted < width and rng.random() < accept:
            accepted += 1
        seconds = plain_seconds(step) if width == 0 else verify_seconds + width * draft_seconds
        policy.observe(StepRecord(1, [0], [width], [width], [accepted], [accepted + 1], seconds,
                                  width * draft_seconds, seconds - width * draft_seconds))
        widths.append(width)
    return widths


def test_plain_decoding_is_rechecked_while_the_policy_drafts():
    """While the policy drafts, plain steps are not measured: a plain estimate taken once (the first steps of a cold
    process, a machine busy at that moment) would stand for the rest of the policy's life. A drafting policy runs a
    plain step again now and then, and switches to plain decoding once plain measures faster: here plain steps take
    0.5 s for the first 4 steps (drafting pays), then 0.05 s (plain pays 2.5x more than any width)."""
    policy = Adaptive(explore=0.0)
    widths = drive(policy, 1500, plain_seconds=lambda step: 0.5 if step < 4 else 0.05)
    assert sum(w > 0 for w in widths[2:60]) > 50             # it drafted while plain looked slow
    assert sum(w == 0 for w in widths[-300:]) > 270          # then found plain decoding faster and kept to it


def test_rechecks_back_off_while_plain_stays_slower():
    """Where drafting keeps paying, the plain steps re-measured cost little: the gap between them doubles after each
    one that plain loses, up to max_recheck_gap."""
    policy = Adaptive(explore=0.0, recheck_every=16, max_recheck_gap=256)
    widths = drive(policy, 2000, plain_seconds=lambda step: 0.5)
    plain = [i for i, w in enumerate(widths) if w == 0 and i >= 2]
    assert 3 <= len(plain) <= 12, plain
    assert plain[-1] - plain[-2] >= 128                       # backed off


def test_recheck_settings_are_validated_and_saved():
    with pytest.raises(ValueError, match="recheck"):
        Adaptive(recheck_every=0)
    with pytest.raises(ValueError, match="recheck"):
        Adaptive(recheck_every=64, max_recheck_gap=32)
    with pytest.raises(ValueError, match="recheck"):
        Adaptive(recheck_every=1.5)
    policy = Adaptive(recheck_every=8, max_recheck_gap=64)
    drive(policy, 200, plain_seconds=lambda step: 0.5)
    state = policy.state_dict()
    copy = Adaptive(recheck_every=8, max_recheck_gap=64)
    copy.load_state_dict(state)
    assert (copy.rechecks.gap, copy.rechecks.idle) == (policy.rechecks.gap, policy.rechecks.idle)
    del state["recheck_gap"], state["recheck_idle"]               # a state saved before rechecks existed loads
    Adaptive(recheck_every=8, max_recheck_gap=64).load_state_dict(state)


def _learned() -> Adaptive:
    policy = Adaptive(seed=3)
    simulate(policy, synthetic_requests(8, 60, 0.8, seed=1), latency(0.15, 0.9), Static(2))
    return policy


def _choices(policy) -> list:
    out = []
    for step in range(6):
        batch = (1, 2, 4)[step % 3]
        info = spec_adapt.policies.StepInfo(batch, torch.arange(batch), torch.zeros(batch, dtype=torch.long),
                                            torch.full((batch,), 50), step)
        out.append(policy.choose(info))
    return out


@pytest.mark.parametrize("poison", ["cost key of two", "cost key of four", "span key of two",
                                    "cost key with a bool", "negative tree gap", "tree key of one",
                                    "calibration accepting more than it reached", "calibration of 3 bins"])
def test_a_poisoned_state_is_refused_whole_and_the_policy_keeps_working(poison):
    ruled = poison.startswith("calibration")
    source = Adaptive(seed=3, trees=True) if "tree" in poison else Adaptive(seed=3, stop_rule=True) if ruled \
        else _learned()
    state = json.loads(json.dumps(source.state_dict()))
    if poison == "cost key with a bool":
        state["cost"]["near"].append([["full", True, 2], [0.1, 3]])
    elif poison.startswith("cost"):
        key = state["cost"]["verify"][0][0]
        state["cost"]["verify"][0][0] = key[:2] if "two" in poison else key + [1]
    elif poison.startswith("span"):
        state["span"].append([[1, True], 1.0])
    elif poison.startswith("calibration"):
        calibration = state["calibration"]
        if "3 bins" in poison:
            calibration["reached"], calibration["accepted"] = [4.0] * 3, [2.0] * 3
        else:
            calibration["accepted"][0] = calibration["reached"][0] + 1
    elif poison == "negative tree gap":
        state["tree_shapes"]["gaps"].append([[1, 2], [-5, 0]])
    else:
        state["tree_shapes"]["value"].append([[1], [0.5, 2]])
    target = Adaptive(seed=3, trees=True, stop_rule=ruled)
    before = json.dumps(target.state_dict())
    with pytest.raises(ValueError, match="Not a valid Adaptive state"):
        target.load_state_dict(state)
    assert json.dumps(target.state_dict()) == before          # nothing changed
    assert _choices(target)                                    # and every later decision still runs


def test_the_calibration_of_the_draft_confidence_is_saved_and_restored():
    """A policy that learned how often its draft's confidences are accepted plans the same stop rule after a round
    trip through JSON (a new process's default starts with it)."""
    policy = Adaptive(seed=3, stop_rule=True)
    confidence = torch.tensor([[0.9, 0.8, 0.3], [0.6, 0.2, 0.1]])
    for step in range(40):
        info = spec_adapt.policies.StepInfo(2, torch.arange(2), torch.full((2,), step), torch.full((2,), 500), step,
                                            draft_lag=torch.ones(2, dtype=torch.long))
        policy.choose(info)
        policy.observe(spec_adapt.metrics.StepRecord(2, [0, 1], [3, 3], [3, 3], [2, 0], [3, 1], 0.3, 0.1, 0.2,
                                                     confidence=confidence))
    assert policy.confident and float(policy.calibration(torch.tensor([0.35]))) < 0.2      # 0.3 is always rejected
    loaded = Adaptive(seed=3, stop_rule=True)
    loaded.load_state_dict(json.loads(json.dumps(policy.state_dict())))
    assert loaded.confident
    assert torch.equal(loaded.calibration.reached, policy.calibration.reached)
    assert [_decision(p) for p in _choices(loaded)] == [_decision(p) for p in _choices(policy)]


def test_a_state_round_trips_and_decides_alike():
    policy = _learned()
    loaded = Adaptive(seed=3)
    loaded.load_state_dict(json.loads(json.dumps(policy.state_dict())))
    assert _choices(loaded) == _choices(policy)


@pytest.mark.parametrize("content", ["{\"config\": {\"max_gamma\": 8}, \"pooled\"", "[1, 2, 3]", "{\"steps\": 3}",
                                     "{\"config\": {\"max_gamma\": \"many\"}}", "{\"config\": {\"max_gamma\": 8}}"])
def test_loading_a_file_that_is_not_a_state_names_the_file(tmp_path, content):
    path = tmp_path / "policy.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="policy.json is not an Adaptive state"):
        Adaptive.load(path)


@pytest.mark.parametrize("max_batch", [0, -1, 10**8, 2.5, True])
def test_an_export_batch_out_of_range_is_refused(max_batch):
    from spec_adapt.tools.vllm import speculative_config

    with pytest.raises(ValueError, match="max_batch"):
        speculative_config(_learned(), "ngram", max_batch=max_batch)
    with pytest.raises(ValueError, match="max_batch"):
        _learned().to_vllm_schedule(max_batch)


class _Planned(FixedLength):
    """FixedLength(k) that answers with a Plan: a stop rule (chains) or a tree depth."""

    def __init__(self, k, tree=False):
        super().__init__(k)
        self.tree = tree

    def choose(self, info):
        from spec_adapt.running_estimates import Calibration, StopRule

        gammas = super().choose(info)
        return Plan(gammas, depth=2) if self.tree else Plan(gammas, stop=StopRule(0.5, Calibration()))


def test_the_lab_runs_a_stop_rule_plan_at_its_widths_and_refuses_trees():
    """Recorded traces carry no draft confidences: a plan's stop rule has nothing to read, and the lab drafts its
    widths, as a drafter without probabilities does. Trees are not simulated: refused with the fix."""
    requests = synthetic_requests(4, 40, 0.8, seed=2)
    ruled = simulate(_Planned(3), requests, latency(0.15, 0.9), Static(2))
    plain = simulate(FixedLength(3), requests, latency(0.15, 0.9), Static(2))
    assert ruled.history == plain.history and ruled.goodput == pytest.approx(plain.goodput, rel=0.05)
    with pytest.raises(ValueError, match="chains only"):
        simulate(_Planned(3, tree=True), requests, latency(0.15, 0.9), Static(2))


def test_without_shrinking_a_fresh_row_reads_the_pooled_rates():
    """shrink=0 (a row's own counts alone) is a valid setting: a row with no counts yet reads the pooled rates, not
    0 / 0 (NaN expected tokens, which no width can beat)."""
    policy = Adaptive(shrink=0.0)
    policy.begin(2)
    expected = policy.expected(torch.tensor([0, 1]))
    assert bool(torch.isfinite(expected).all())
    assert torch.allclose(expected[0], policy.expected())


def _observe_widths(policy, width: int, steps: int, accepted: int | None = None) -> None:
    """`steps` batch-1 steps that each draft `width` tokens and have `accepted` of them accepted (all by default),
    whatever the policy chose."""
    from spec_adapt.metrics import StepRecord
    from spec_adapt.policies.policy import StepInfo

    accepted = width if accepted is None else accepted
    policy.begin(1)
    for step in range(steps):
        policy.choose(StepInfo(1, torch.arange(1), torch.full((1,), step), torch.full((1,), 10**6), step))
        policy.observe(StepRecord(1, [0], [width], [width], [accepted], [accepted + 1], 0.3, 0.1, 0.2))


def test_a_width_no_row_has_reached_reads_as_good_as_the_last_measured():
    """Rows that always accept their 2 drafts: position 3 was never reached, and its rate is read from position 2's
    (which is near 1), not from the 0.5 the counts start at. At 0.5 each width past the measured ones looks worse
    than it is, and the policy kept drafting 2 through a hundred steps of full acceptance."""
    policy = Adaptive()
    _observe_widths(policy, 2, 200)
    expected = policy.expected()
    gains = expected[1:] - expected[:-1]                 # prod_{j <= s} p_j: the s-th draft's expected token
    assert float(gains[1]) > 0.9 and float(gains[2]) > 0.9 * float(gains[1])
    assert float(gains[7]) > 0.6 * float(gains[1])
    burst = 2      # the prior's weight decays with the rows that reach a position, as the counts do
    assert float(policy.prior[burst, 1]) < 0.05 and float(policy.prior[burst, 2]) == 1.0


def test_a_position_read_low_does_not_pull_the_next_below_one_half():
    """Rows that always reject their first draft: the first position reads near 0, and the second, never reached,
    still reads 0.5 (a low rate before is no evidence that the next position is worse still)."""
    policy = Adaptive(shrink=0.0)
    _observe_widths(policy, 1, 200, accepted=0)
    rates = policy.accepted / policy.tried
    from spec_adapt.policies.adaptive import prior_rates

    read = prior_rates(policy.tried, policy.accepted, policy.prior)
    missed = 1
    assert float(read[missed, 0]) < 0.05 and float(read[missed, 1]) == pytest.approx(0.5)
    assert torch.allclose(read[:, 1:], torch.maximum(rates[:, 1:], read[:, 1:]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.integers(0, 50)), min_size=1, max_size=8))
def test_prior_rates_move_only_the_prior(positions):
    """prior_rates: a count of n rows (h hits) beside a prior of weight m reads (m x max(0.5, rate before) + h) /
    (m + n): in [0, 1]; the counts alone where no prior is left; max(0.5, the rate before) where no row reached the
    position."""
    from spec_adapt.policies.adaptive import prior_rates

    prior = torch.tensor([m for m, _, _ in positions])
    reached = torch.tensor([float(n) for _, _, n in positions])
    hits = torch.tensor([min(f, 1.0) * n for _, f, n in positions]).floor()
    tried, accepted = prior + reached, 0.5 * prior + hits
    if not bool((tried > 0).all()):
        return
    rates = prior_rates(tried, accepted, prior)
    before = 0.5
    for i in range(len(positions)):
        want = (float(prior[i]) * max(before, 0.5) + float(hits[i])) / float(tried[i])
        assert abs(float(rates[i]) - want) < 1e-5 and -1e-6 <= float(rates[i]) <= 1 + 1e-6
        before = float(rates[i])


def test_the_prior_is_saved_and_a_state_saved_without_it_still_loads():
    """The prior's weight left per position is part of the state; a state written before it was kept apart loads
    with the untouched first observation where no row reached the position and none elsewhere; counts the prior
    cannot have come from are refused."""
    policy = Adaptive(seed=3)
    _observe_widths(policy, 2, 30)
    state = json.loads(json.dumps(policy.state_dict()))
    loaded = Adaptive(seed=3)
    loaded.load_state_dict(state)
    assert torch.equal(loaded.prior, policy.prior) and torch.allclose(loaded.expected(), policy.expected())
    del state["pooled"]["prior"]
    old = Adaptive(seed=3)
    old.load_state_dict(state)
    untouched = (policy.tried == 1) & (policy.accepted == 0.5)
    assert torch.equal(old.prior, untouched.float()) and bool(untouched[:, 2:].all())
    for bad in ([[2.0] * 8] * 3, [[0.0] * 7 + [1.0]] * 3):
        broken = json.loads(json.dumps(policy.state_dict()))
        broken["pooled"]["prior"] = bad
        if bad[0][0] == 0.0:        # a prior of 1 beside accepted counts below its 0.5
            broken["pooled"]["accepted"] = [[0.0] * 8] * 3
        with pytest.raises(ValueError, match="prior"):
            Adaptive(seed=3).load_state_dict(broken)


def _hindsight_steps(policy, steps: list[tuple[int, int, int]]) -> None:
    """Batch-1 steps (width asked and drafted, accepted, the hindsight the drafter reports with that step)."""
    from spec_adapt.metrics import StepRecord
    from spec_adapt.policies.policy import StepInfo

    for step, (width, accepted, seen) in enumerate(steps):
        policy.choose(StepInfo(1, torch.arange(1), torch.full((1,), step), torch.full((1,), 10**6), step))
        policy.observe(StepRecord(1, [0], [width], [width], [accepted], [accepted + 1], 0.3, 0.1, 0.2,
                                  telemetry={"hindsight": [seen]}))


def test_hindsight_measures_the_position_past_a_fully_accepted_width():
    """A state whose second position once read low: width-1 steps accepted in full never reach that position, so
    without hindsight it stays low through any run of them. The drafter's hindsight (would a second draft have been
    accepted) counts there, in the state the accepted step was chosen in, at the position after its width."""
    burst, missed = 2, 1
    # Width 1 accepted (now BURST), then width 2 chosen in BURST with its second draft rejected (now MISSED): BURST's
    # second position reads low.
    warm = [(1, 1, -1), (2, 1, -1)] * 15
    run = [(1, 1, -1)] * 60
    from spec_adapt.policies.adaptive import prior_rates

    reads, tried = {}, {}
    for seen in (1, 0, None):
        policy = Adaptive(shrink=0.0, explore=0.0)
        policy.begin(1)
        _hindsight_steps(policy, warm + [(w, a, -1 if seen is None else seen) for w, a, _ in run])
        reads[seen], tried[seen] = prior_rates(policy.tried, policy.accepted, policy.prior), policy.tried
    assert float(reads[None][burst, 1]) < 0.3                   # nothing measured it again
    assert float(reads[1][burst, 1]) > 0.85 and float(reads[0][burst, 1]) < 0.1
    # Hindsight after a step chosen in BURST counts in BURST; the first step of the run was chosen in MISSED.
    assert float(reads[1][missed, 1]) > float(reads[None][missed, 1])
    assert torch.equal(tried[1][:, 2:], tried[None][:, 2:])     # no other position was counted


def test_hindsight_counts_only_after_a_full_acceptance_of_the_width_asked():
    """A step with a rejection, or whose drafter filled less than the width asked (the rest counted as misses
    already), gives the next step's hindsight nothing to judge; a step the model did not draft reports -1."""
    from spec_adapt.metrics import StepRecord
    from spec_adapt.policies.policy import StepInfo

    def counts(steps):
        policy = Adaptive(shrink=0.0, explore=0.0)
        policy.begin(1)
        for step, (gamma, drafted, accepted, seen) in enumerate(steps):
            policy.choose(StepInfo(1, torch.arange(1), torch.full((1,), step), torch.full((1,), 10**6), step))
            policy.observe(StepRecord(1, [0], [gamma], [drafted], [accepted], [accepted + 1], 0.3, 0.1, 0.2,
                                      telemetry={"hindsight": [seen]}))
        return policy.tried.clone(), policy.accepted.clone()

    for first in ((2, 2, 1, -1), (3, 2, 2, -1)):         # a rejection; a short fill
        assert all(torch.equal(x, y) for x, y in zip(counts([first, (2, 2, 2, 1)]), counts([first, (2, 2, 2, -1)])))
    full = counts([(2, 2, 2, -1), (2, 2, 2, 1)])
    assert not torch.equal(full[0], counts([(2, 2, 2, -1), (2, 2, 2, -1)])[0])

    # A stop rule cut the chain at 2 of 8 where the draft's confidence fell: the position it declined is not read.
    for ruled, moved in ((True, False), (False, True)):
        policy = Adaptive()
        policy.begin(1)
        policy._count(StepRecord(1, [0], [8 if ruled else 2], [2], [2], [3], 0.3, 0.1, 0.2), ruled=ruled)
        before = policy.tried.clone()
        policy.observe(StepRecord(1, [0], [2], [2], [0], [1], 0.3, 0.1, 0.2, telemetry={"hindsight": [1]}))
        assert torch.equal(before, policy.tried) is not moved
        read = policy.row_expected.clone()          # the rates are read again even on a step the policy did not choose
        policy._refresh()
        assert torch.equal(read, policy.row_expected)
