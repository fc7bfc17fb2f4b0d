"""The hindsight bound (`spec_adapt.tools.bound`) and its column in `spec-adapt bench`: the dynamic program finds the
best schedule on hand-made runs and costs, never loses to plain decoding or a fixed length, and the bench reports
each configuration's fraction of it only where it was computed (batch 1 with a draft)."""

from __future__ import annotations

import copy
import csv
import json
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spec_adapt.tools import bench as b
from spec_adapt.tools.bound import (MIN_STEPS, agreement_runs, best_drafting_schedule, best_fixed_share,
                                    best_schedule, fixed_schedule, measured_costs)

from conftest import PAD, cached_model, tiny_model
from tiny_tokenizers import char_tokenizer


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread and lose much when another process holds a core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def runs_of(matches: list[bool]) -> list[int]:
    """run[i] from whether the draft's token at each output position is the target's (as `agreement_runs` counts)."""
    runs = [0] * (len(matches) + 1)
    for i in range(len(matches) - 1, -1, -1):
        runs[i] = runs[i + 1] + 1 if matches[i] else 0
    return runs


def test_no_agreement_gives_plain_decoding():
    """A draft that is never right: every drafted token is paid for and rejected, so the best is to draft nothing."""
    costs = [1.0 + 0.2 * g for g in range(9)]
    seconds, widths = best_schedule(runs_of([False] * 10), costs)
    assert widths == [0] * 9 and seconds == pytest.approx(9 * costs[0])


def test_long_agreement_with_cheap_drafts_drafts_the_widest():
    """A draft that is always right and nearly free: 27 tokens in 3 steps of the widest draft (8 + 1 each); no
    schedule has fewer steps, and 3 steps reach the end only at full width."""
    costs = [1.0 + 0.01 * g for g in range(9)]
    seconds, widths = best_schedule(runs_of([True] * 28), costs)
    assert widths == [8, 8, 8] and seconds == pytest.approx(3 * costs[8])


def test_a_rejected_token_is_covered_by_the_target_token():
    """Right on output tokens 1-4, wrong on 5, right on 6-9: a width-4 step at 1 commits 1-4 plus the target's own
    token 5, and another at 6 commits 6-10. Two steps at 2.0 each; any other schedule costs more."""
    matches = [True] * 5 + [False] + [True] * 4 + [False]
    seconds, widths = best_schedule(runs_of(matches), [1.0 + 0.25 * g for g in range(5)])
    assert widths == [4, 4] and seconds == pytest.approx(4.0)


def test_expensive_drafts_decode_plainly_however_good_the_draft():
    """Each drafted token costs more than a plain step: drafting g commits g + 1 tokens for more than g + 1 steps."""
    costs = [1.0 + 1.5 * g for g in range(9)]
    seconds, widths = best_schedule(runs_of([True] * 12), costs)
    assert set(widths) == {0} and seconds == pytest.approx(11 * costs[0])


@settings(max_examples=200, deadline=None)
@given(matches=st.lists(st.booleans(), min_size=1, max_size=40),
       costs=st.lists(st.floats(0.01, 2.0), min_size=1, max_size=9))
def test_the_bound_is_never_slower_than_plain_or_any_fixed_length(matches, costs):
    """With the same costs, the bound's time is at most plain decoding's and every fixed length's, and it is the
    time of the widths it reports, which commit exactly the output."""
    runs = runs_of(matches)
    seconds, widths = best_schedule(runs, costs)
    for width in range(len(costs)):
        assert seconds <= fixed_schedule(runs, costs, width) + 1e-9
    assert seconds == pytest.approx(sum(costs[g] for g in widths))
    position = 1
    for g in widths:
        position += min(runs[position], g) + 1
    assert position == max(1, len(matches))


def test_the_draft_prompt_forward_is_paid_once_by_a_schedule_that_drafts():
    """A draft always right over 11 tokens, plain steps at 1.0 and width-4 steps at 1.2: drafting saves 10 - 2 * 1.2
    = 7.6 s minus the draft's prompt forward. At 1 s the forward is paid once; at 8 s plain decoding is cheaper."""
    runs, costs = runs_of([True] * 11), [1.0, 1.05, 1.1, 1.15, 1.2]
    seconds, widths = best_drafting_schedule(runs, costs, draft_prefill=1.0)
    assert widths == [4, 4] and seconds == pytest.approx(2 * 1.2 + 1.0)
    seconds, widths = best_drafting_schedule(runs, costs, draft_prefill=8.0)
    assert widths == [0] * 10 and seconds == pytest.approx(10.0)


@settings(max_examples=200, deadline=None)
@given(matches=st.lists(st.booleans(), min_size=1, max_size=40),
       costs=st.lists(st.floats(0.01, 2.0), min_size=1, max_size=9), draft_prefill=st.floats(0.0, 20.0))
def test_the_drafting_bound_is_never_slower_than_plain_or_any_fixed_length(matches, costs, draft_prefill):
    """Plain decoding never pays the draft's forward, every fixed width above 0 pays it once: the bound is at most
    each, and at least the bound without the forward."""
    runs = runs_of(matches)
    seconds, widths = best_drafting_schedule(runs, costs, draft_prefill)
    assert seconds <= fixed_schedule(runs, costs, 0) + 1e-9
    for width in range(1, len(costs)):
        assert seconds <= draft_prefill + fixed_schedule(runs, costs, width) + 1e-9
    assert seconds >= best_schedule(runs, costs)[0] - 1e-9
    assert seconds == pytest.approx(sum(costs[g] for g in widths) + (draft_prefill if any(widths) else 0.0))


def test_the_best_fixed_width_is_read_off_the_same_cost_model():
    """Runs of agreement of alternating lengths 1 and 5 with cheap drafts: the bound drafts each run to its end
    (widths 1 and 5), a fixed width cannot; its share of the bound's speedup is the bound's time over its own, and
    the width it picks is the one with the least time. Where every run has one length, the fixed width matches it."""
    costs = [1.0 + 0.1 * g for g in range(9)]
    short_long = runs_of(([True, False] + [True] * 5 + [False]) * 4)
    seconds, _ = best_schedule(short_long, costs)
    fixed = [fixed_schedule(short_long, costs, g) for g in range(9)]
    bound = {"seconds": seconds, "fixed_seconds": fixed, "best_fixed_width": min(range(9), key=fixed.__getitem__)}
    width, share = best_fixed_share(bound)
    assert fixed[width] == min(fixed) and share == pytest.approx(seconds / min(fixed)) and share < 0.95
    even = runs_of([False] + ([True] * 3 + [False]) * 6)       # output token 0 is the prefill's
    seconds, _ = best_schedule(even, costs)
    assert min(fixed_schedule(even, costs, g) for g in range(9)) == pytest.approx(seconds)


def test_measured_costs_take_each_well_timed_width_median_and_fill_the_rest_from_a_line():
    """Widths 2 and 4 timed often (medians 0.5 and 0.7 despite one slow outlier each), width 3 timed once: the
    medians stand, width 3 and widths 1, 5, 6 come from the line through them (0.1 a token), width 0 is the plain
    time given. The line never falls with the width (noise can tilt it) nor below a plain step."""
    times = {2: [0.5, 0.5, 0.5, 3.0], 4: [0.7, 0.7, 0.7, 2.0], 3: [9.0]}
    assert measured_costs(times, plain=0.25, max_width=6) == pytest.approx([0.25, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    falling = measured_costs({2: [0.7] * 3, 4: [0.5] * 3}, plain=0.25, max_width=6)
    assert falling[1] == falling[3] == falling[6] == pytest.approx(0.6)
    steep = measured_costs({5: [0.5] * 3, 6: [0.7] * 3}, plain=0.25, max_width=6)
    assert steep[1] == pytest.approx(0.25)


@pytest.mark.parametrize("times, plain", [({2: [0.5] * 5}, 0.25),                   # one width: no line
                                          ({2: [0.5] * 5, 4: [0.7] * (MIN_STEPS - 1)}, 0.25),
                                          ({2: [0.5] * 5, 4: [0.7] * 5}, 0.0),       # prefills ate the run
                                          ({9: [0.5] * 5, 12: [0.7] * 5}, 0.25)])    # beyond max_width
def test_measured_costs_refuse_what_a_run_cannot_give(times, plain):
    assert measured_costs(times, plain, max_width=8) is None


@settings(max_examples=100, deadline=None)
@given(intercept=st.floats(0.05, 1.0), slope=st.floats(0.0, 0.3), widths=st.sets(st.integers(1, 8), min_size=2),
       count=st.integers(MIN_STEPS, 6))
def test_measured_costs_recover_a_linear_cost_curve(intercept, slope, widths, count):
    """Steps that cost intercept + slope * g exactly, timed at any two or more widths: every width's cost is the
    curve's (a plain step costs less than any of them)."""
    times = {g: [intercept + slope * g] * count for g in widths}
    costs = measured_costs(times, plain=0.04, max_width=8)
    assert costs[1:] == pytest.approx([intercept + slope * g for g in range(1, 9)], rel=1e-6, abs=1e-9)


def test_the_prefill_is_timed_as_generate_runs_it():
    """The head over the last position only, with a cache: a head over every prompt position costs more than the
    layers at a large vocabulary and would pad both sides of the bound's ratio with time generate never spends."""
    from spec_adapt.tools.bound import prefill_seconds

    model, seen = cached_model("llama"), []
    handle = model.register_forward_hook(lambda module, args, kwargs, out: seen.append((kwargs, out)),
                                         with_kwargs=True)
    try:
        assert prefill_seconds(model, torch.tensor([5, 17, 33, 9]), repeats=2) > 0
    finally:
        handle.remove()
    assert len(seen) == 2 and all(k.get("logits_to_keep") == 1 and out.logits.shape[1] == 1 for k, out in seen)


def test_agreement_runs_of_the_target_itself():
    """The target as its own draft predicts all of its greedy output; another model's runs stay within bounds."""
    target = cached_model("llama")
    prompt = torch.tensor([5, 17, 33, 9, 41])
    output = target.generate(prompt[None], max_new_tokens=12, do_sample=False, pad_token_id=PAD,
                             eos_token_id=None)[0, len(prompt):]
    assert agreement_runs(target, prompt, output, target.config.vocab_size) == list(range(12, -1, -1))
    other = agreement_runs(cached_model("llama", seed=1), prompt, output, target.config.vocab_size)
    assert all(0 <= r <= 12 - i for i, r in enumerate(other))


@pytest.fixture(scope="module")
def pair_folders(tmp_path_factory):
    """A tiny Llama and a draft that agrees with it often (its head perturbed), saved with a character tokenizer,
    and a JSONL file of completion prompts."""
    folder = tmp_path_factory.mktemp("pair")
    target = tiny_model("llama")
    draft = copy.deepcopy(target)
    torch.manual_seed(1)
    with torch.no_grad():
        draft.lm_head.weight.add_(0.02 * torch.randn_like(draft.lm_head.weight))
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(folder / name)
        char_tokenizer().save_pretrained(folder / name)
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text, "format": "completion"}) + "\n"
                               for text in ("def add(a, b):", "for i in range(10):", "Hello, world!")))
    return folder


def bench(*argv: str) -> None:
    """`spec-adapt bench ...`, leaving the session's grad mode as it was (the command turns grad off)."""
    from spec_adapt.tools.cli import main

    with torch.enable_grad():
        main(["bench", *argv])


def test_bench_writes_the_bound_column(pair_folders, capsys):
    """`spec-adapt bench --bound --cold` at batch sizes 1 and 2: every batch-1 row has its speedup's fraction of the
    bound's in (0, 3] (above 1 only by timing noise: the bound is the best schedule, and stock generate's own
    fraction is 1 / the bound's speedup); batch-2 rows leave it empty in JSON and CSV; the default policy has a cold
    row beside its warm one."""
    out = pair_folders / "out"
    bench("--model", str(pair_folders / "target"), "--draft", str(pair_folders / "draft"),
          "--prompts", str(pair_folders / "prompts.jsonl"), "--num-prompts", "2", "--rows", "2",
          "--batch-sizes", "1", "2", "--new-tokens", "10", "--repeats", "1", "--ignore-eos",
          "--configs", "target", "draft:fixed1", "draft:fixed2", "draft:adaptive", "lookup:fixed2", "--bound", "4",
          "--cold", "--out", str(out))
    saved = json.loads((out / "summary.json").read_text())
    rows = {(s["config"], s["batch_size"]): s for s in saved["summary"]}
    configs = ["target", "draft:fixed1", "draft:fixed2", "draft:adaptive", "draft:adaptive (cold)", "lookup:fixed2"]
    assert set(rows) == {(c, batch) for c in configs for batch in (1, 2)}
    for config in configs:
        assert 0 < rows[config, 1]["of_bound"] <= 3, config
        assert rows[config, 1]["of_bound"] == pytest.approx(rows[config, 1]["speedup"]
                                                            / rows[config, 1]["bound_speedup"])
        assert rows[config, 2]["of_bound"] is None and rows[config, 2]["bound_speedup"] is None
        assert rows[config, 1]["identical"] and rows[config, 2]["identical"]
    bound = saved["bound"]
    assert rows["target", 1]["bound_speedup"] == pytest.approx(bound["plain_seconds"] / bound["seconds"])
    assert len(bound["prompts"]) == 2 and len(bound["costs"]) == 5 and all(p["tokens"] == 10 for p in bound["prompts"])
    assert 0 < bound["seconds"] <= bound["plain_seconds"] == bound["fixed_seconds"][0]
    assert len(bound["fixed_seconds"]) == 5 and min(bound["fixed_seconds"]) >= bound["seconds"]
    assert bound["fixed_seconds"][bound["best_fixed_width"]] == min(bound["fixed_seconds"])
    # The costs are the run's own: plain decoding is stock generate as timed (one repeat of 2 x 10 tokens), and each
    # width timed often enough costs the median of the batch-1 draft configurations' steps at that width.
    assert bound["cost_source"] == "run"
    assert bound["plain_seconds"] == pytest.approx(rows["target", 1]["ms_per_token"] * 20 / 1000)
    steps = {}
    for cell in json.loads((out / "traces.json").read_text()):
        if cell["batch_size"] == 1 and cell["config"].startswith("draft:"):
            for step in cell["trace"]:
                steps.setdefault(max(step["drafted"], default=0), []).append(step["step_time"])
    timed = [g for g in range(1, 5) if len(steps.get(g, ())) >= MIN_STEPS]
    assert len(timed) >= 2
    assert all(bound["costs"][g] == pytest.approx(statistics.median(steps[g])) for g in timed)
    with open(out / "summary.csv") as f:
        table = {(r["config"], r["batch_size"]): r["of_bound"] for r in csv.DictReader(f)}
    assert table["draft:adaptive (cold)", "2"] == "" and float(table["draft:adaptive (cold)", "1"]) > 0
    printed = capsys.readouterr().out
    assert "of bound" in printed and "best fixed width in hindsight" in printed and (out / "bench.png").exists()
    assert "step costs from this run's own timed steps" in printed
    assert "cost model check: draft:fixed2 measured" in printed and "cost model check: draft:fixed1" in printed


def test_no_draft_leaves_the_column_empty():
    """Without a draft model there is no bound to compute: the column is None, not a number."""
    model, tok = cached_model("llama"), char_tokenizer()
    cells = b.run_bench(model, tok, ["def add(a, b):"], ["target", "lookup:fixed2"], [1], 6, 1, progress=False,
                        rows=1, ignore_eos=True, bound=4)
    assert all(s["of_bound"] is None and s["bound_speedup"] is None for s in b.summarize(cells))


@pytest.mark.parametrize("argv, message", [(["--bound", "0"], "--bound"), (["--repeats", "0"], "--repeats"),
                                           (["--cold", "--configs", "target", "draft:fixed2"], "--cold"),
                                           (["--configs", "lookup:fixed2@bf16", "--target-memory", "900"], "@bf16"),
                                           (["--configs", "lookup:fixed2@bf16", "--dtype", "bfloat16"], "@bf16")])
def test_bench_refuses_bad_options_before_loading(argv, message):
    with pytest.raises(SystemExit, match=message):
        bench("--model", "/nonexistent", *argv)


def test_cold_rows_follow_their_warm_row():
    assert b.cold_rows(["target", "draft:adaptive", "lookup:adaptive+ee", "draft:fixed3"]) == [
        "target", "draft:adaptive", "draft:adaptive (cold)", "lookup:adaptive+ee", "lookup:adaptive+ee (cold)",
        "draft:fixed3"]


def test_configuration_names_split_into_drafter_policy_and_verifier():
    assert b.split_config("draft:adaptive+ee10@14 (cold)") == ("draft", "adaptive", "ee10@14")
    assert b.split_config("lookup:fixed3") == ("lookup", "fixed3", "")
    assert [b.fixed_width(p) for p in ("fixed", "fixed3", "fixed12", "fixedx", "adaptive")] == [4, 3, 12, None, None]
    assert b.parse_policy("fixed5").k == 5 and b.parse_policy("fixed").k == 4
    with pytest.raises(ValueError, match="Unknown policy 'fixedx'"):
        b.parse_policy("fixedx")


# -- the several-source bound: the draft model or prompt lookup per step, in hindsight -------------------------------
@settings(derandomize=True, max_examples=60, deadline=None)
@given(matches=st.lists(st.booleans(), min_size=2, max_size=24),
       free=st.lists(st.integers(0, 8), min_size=24, max_size=24),
       costs=st.lists(st.floats(0.5, 3.0), min_size=4, max_size=4), draft_prefill=st.floats(0.0, 2.0))
def test_several_sources_are_never_slower_than_one(matches, free, costs, draft_prefill):
    """Choosing per step between the draft model and lookup never does worse than the draft model alone, and a
    lookup that never matches changes nothing."""
    from spec_adapt.tools.bound import several_sources_schedule

    runs = runs_of(matches)
    n = len(runs) - 1
    free_runs = [min(f, n - i) for i, f in enumerate(free[:n])] + [0]
    costs = sorted(costs)
    verify = [costs[0]] * 9
    one, _ = best_drafting_schedule(runs, costs, draft_prefill)
    several, steps = several_sources_schedule(runs, free_runs, costs, verify, draft_prefill)
    assert several <= one + 1e-9
    none, _ = several_sources_schedule(runs, [0] * (n + 1), costs, verify, draft_prefill)
    assert none == pytest.approx(one)
    assert all(source in ("plain", "draft", "lookup") for source, _ in steps)


def test_a_long_lookup_match_is_taken_in_one_step():
    from spec_adapt.tools.bound import several_sources_schedule

    runs = [0] * 11                       # the draft model never agrees
    free = [9 - i if i >= 1 else 0 for i in range(10)] + [0]
    steps = several_sources_schedule(runs, free, [1.0, 1.5, 2.0], [1.0] + [1.1] * 12, draft_prefill=5.0)[1]
    assert steps[0] == ("lookup", 8)      # the rest of the output in one verification


def test_lookup_runs_match_what_prompt_lookup_proposes():
    from spec_adapt.tools.bound import lookup_runs

    prompt = torch.tensor([5, 8, 3, 9, 4])
    output = torch.tensor([5, 8, 3, 9, 7])
    runs = lookup_runs(prompt, output, width=4)
    # after [.. 4 5] the latest earlier 1..3-gram match of the suffix "4 5"? none with 2; "5" at 0 -> proposes 8 3 9 4
    assert runs[1] == 3 and len(runs) == len(output) + 1 and runs[-1] == 0


def test_configurations_on_the_bf16_copy_run_beside_float32(capsys):
    """<config>@bf16 runs on the target's bfloat16 copy, after stock generate on that copy (added when missing):
    identity is judged against it, the speedup is over float32 stock and "vs bf16 stock" over the copy's; without
    a copy the bench refuses before timing anything."""
    model, tok = cached_model("llama"), char_tokenizer()
    twin = b.bf16_twin(model)
    cells = b.run_bench(model, tok, ["def add(a, b):", "for i in range(3):"], ["target", "lookup:fixed2@bf16"], [1],
                        8, 1, progress=False, rows=2, ignore_eos=True, twin=twin)
    summary = {s["config"]: s for s in b.summarize(cells)}
    assert list(summary) == ["target", "target@bf16", "lookup:fixed2@bf16"]
    assert summary["lookup:fixed2@bf16"]["verdict"] in ("identical",) and summary["lookup:fixed2@bf16"]["checks"] == 2
    assert summary["target"]["speedup_vs_bf16_stock"] is None
    copy_cell = next(c for c in cells if c.config == "target@bf16")
    assert summary["target@bf16"]["speedup_vs_bf16_stock"] == pytest.approx(1.0)
    assert summary["target@bf16"]["speedup"] == pytest.approx(
        next(c for c in cells if c.config == "target").times[0] / copy_cell.times[0])
    b.print_table(list(summary.values()))
    assert "vs bf16 stock" in capsys.readouterr().out
    with pytest.raises(ValueError, match="twin="):
        b.run_bench(model, tok, ["x"], ["target", "lookup:fixed2@bf16"], [1], 2, 1, progress=False, rows=1)
    with pytest.raises(ValueError, match="float32 target"):
        b.bf16_twin(twin)
    with pytest.raises(ValueError, match="before spec_adapt.prepare"):
        from spec_adapt import prepare, unprepare

        prepared = prepare(copy.deepcopy(model), spill=False)
        try:
            b.bf16_twin(prepared)
        finally:
            unprepare(prepared)


def test_bf16_names_keep_their_drafter_policy_and_cold_row():
    assert b.split_config("multi:adaptive@bf16 (cold)") == ("multi", "adaptive", "")
    assert b.cold_rows(["target", "multi:adaptive@bf16"]) == ["target", "multi:adaptive@bf16",
                                                              "multi:adaptive@bf16 (cold)"]
    assert b.ordered_configs(["lookup:fixed2@bf16"]) == ["target", "target@bf16", "lookup:fixed2@bf16"]


# -- what a lookup's verification costs: measured on the run's own model-free steps ----------------------------------
def test_a_lookups_verification_is_priced_from_the_runs_free_steps():
    """Derived costs (a draft step's time less its drafts) come out flat when the draft's per-token time absorbs the
    step's overhead; the run's lookup steps say what verifying g tokens really costs, and wider is never cheaper."""
    from spec_adapt.tools.bound import free_costs, verify_costs

    costs = [1.0, 2.0, 3.0]                                    # every width: exactly one more draft token's time
    flat = verify_costs(costs, draft_token=1.0, width=16)
    assert flat[:3] == [1.0, 1.0, 1.0]                          # the fragile derivation: width is free
    free = {2: [1.2, 1.2, 1.2], 8: [1.8, 1.8], 12: [2.2]}       # 0.1 s per token fed
    priced = free_costs(free, 1.0, 16)
    assert priced[2] == pytest.approx(1.2)                      # a width measured MIN_STEPS times: its median
    assert priced[16] == pytest.approx(2.6, rel=0.05)           # past the widest: on the line
    assert priced[0] == 1.0 and all(b >= a for a, b in zip(priced, priced[1:]))
    assert free_costs({4: [1.4, 1.4, 1.4]}, 1.0, 8) is None     # one width gives no line
    assert free_costs({2: [1.2], 4: [1.4]}, 1.0, 8) is None     # too few steps for the step-cost model's line
    assert free_costs({2: [1.2] * 3, 4: [1.4] * 2}, 1.0, 8) is None


def test_the_bound_reads_free_steps_from_lookup_cells_and_several_source_steps_that_took_no_model():
    from spec_adapt.tools import bench as b

    def step(drafted, seconds, source=None):
        return {"drafted": drafted, "step_time": seconds, "source": source}

    row = {name: b.Cell(name, 1) for name in ("target", "lookup:adaptive", "multi:adaptive", "draft:fixed4",
                                              "lookup:adaptive@bf16", "lookup:adaptive+ee")}
    row["lookup:adaptive"].trace = [step([4], 1.4), step([0], 1.0)]
    row["multi:adaptive"].trace = [step([8], 1.8, ["suffix"]), step([3], 2.5, ["model"]),
                                   step([2, 5], 2.9, ["lookup", "model"]), step([6, 0], 1.6, ["lookup", None])]
    row["draft:fixed4"].trace = [step([4], 3.0)]
    row["lookup:adaptive@bf16"].trace = [step([4], 0.7)]       # another model's steps
    row["lookup:adaptive+ee"].trace = [step([4], 0.9)]         # a verifier that skips layers
    assert b._free_step_times(row) == {4: [1.4], 8: [1.8], 6: [1.6]}
