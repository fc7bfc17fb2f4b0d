"""The hindsight bound: how fast any speculative-length schedule with this draft could be, at batch 1.

Greedy decoding fixes the output (it is the target's), so the draft's agreement with it is fixed too: one
teacher-forced draft forward over prompt + output gives, at every output position i, run[i] = how many output tokens
from i the draft predicts in a row. A step at i that drafts g tokens commits min(run[i], g) + 1 of them and costs
T(g) = verify(g + 1 tokens) + g draft tokens, measured on this machine at batch 1. The least total time
over all schedules is a dynamic program over i. Every schedule pays the target's prefill, and one that drafts at all
also the draft's forward over the prompt (any draft must read the prompt before it drafts). It bounds every length
policy with this draft: it knows the future and is charged no catch-up beyond one draft token per drafted token.

Where T(g) comes from decides how far the bound can be trusted. `spec-adapt bench` takes it from the same run
(`measured_costs`): the median time of the timed steps that drafted g tokens, and plain decoding's per-token time
from stock `generate`'s measured time less the prefills. The bound is then the best schedule of the loop as it ran,
and its plain decoding is stock `generate` as it ran. A separate profile (`step_costs`, the fallback) is one
measurement taken at another moment, under other load, so its costs can differ from the steps the run timed.

The several-source bound (`several_sources_schedule`) also chooses prompt lookup at any width up to `max_free`, a
verification with no draft forward. Its price comes from the run's steps that drafted from model-free sources alone
(`free_costs`), and only without them from the draft model's steps less their drafts (`verify_costs`).
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch

from ..policies.cost import FULL, StepCost


def agreement_runs(draft, prompt: torch.Tensor, output: torch.Tensor, vocab: int) -> list[int]:
    """run[i]: how many output tokens from i on the draft predicts in a row, given the target's own prefix
    (len(output) + 1 entries; the last is 0). `vocab`: the target's vocabulary (a draft's head may be padded)."""
    ids = torch.cat([prompt, output])[None]
    with torch.no_grad():
        logits = draft(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(output), :vocab]
    return runs_of_matches((logits.argmax(-1) == output).tolist())


def runs_of_matches(match: Sequence[bool]) -> list[int]:
    """run[i]: how many positions from i on match in a row (len(match) + 1 entries; the last is 0)."""
    runs = [0] * (len(match) + 1)
    for i in range(len(match) - 1, -1, -1):
        runs[i] = runs[i + 1] + 1 if match[i] else 0
    return runs


def _reach(runs: Sequence[int], i: int, width: int) -> int:
    """Where a step at i drafting `width` tokens leaves the output: its accepted drafts plus the target's token."""
    return i + min(runs[i], width) + 1


def best_schedule(runs: Sequence[int], costs: Sequence[float]) -> tuple[float, list[int]]:
    """Least seconds to commit output tokens 1..n-1 (token 0 comes from the prefill; n = len(runs) - 1) when a step
    drafting g tokens costs costs[g]: (seconds, the width of each step). Widths never pass the output's end, where
    nothing more can be accepted."""
    n = len(runs) - 1
    best, choice = [0.0] * (n + 1), [0] * (n + 1)
    for i in range(n - 1, 0, -1):
        best[i], choice[i] = min((costs[g] + best[_reach(runs, i, g)], g)
                                 for g in range(min(len(costs) - 1, n - 1 - i) + 1))
    widths, i = [], 1
    while i < n:
        widths.append(choice[i])
        i = _reach(runs, i, choice[i])
    return best[1] if n > 1 else 0.0, widths


def best_drafting_schedule(runs: Sequence[int], costs: Sequence[float], draft_prefill: float) -> tuple[float, list[int]]:
    """`best_schedule` where a schedule that drafts at all first pays `draft_prefill` seconds (the draft's forward over
    the prompt): the cheaper of plain decoding and the best schedule plus that forward."""
    seconds, widths = best_schedule(runs, costs)
    plain = fixed_schedule(runs, costs, 0)
    if any(widths) and seconds + draft_prefill >= plain:
        return plain, [0] * max(0, len(runs) - 2)
    return seconds + (draft_prefill if any(widths) else 0.0), widths


def lookup_runs(prompt: torch.Tensor, output: torch.Tensor, width: int, max_ngram: int = 3) -> list[int]:
    """run[i]: how many output tokens from i on prompt lookup's proposal of up to `width` tokens (what followed the
    latest earlier match of the context's last 1..max_ngram tokens, in the prompt and output[:i]) matches in a row
    (len(output) + 1 entries; the last is 0)."""
    from ..drafters.lookup import lookup_match

    ids = torch.cat([prompt, output])
    runs = []
    for i in range(len(output)):
        found, _ = lookup_match(ids[: len(prompt) + i], width, max_ngram, 1)
        matched = 0
        for token, target in zip(found, output[i:].tolist()):
            if token != target:
                break
            matched += 1
        runs.append(matched)
    return runs + [0]


def several_sources_schedule(runs: Sequence[int], free_runs: Sequence[int], costs: Sequence[float],
                             verify: Sequence[float], draft_prefill: float) -> tuple[float, list[tuple[str, int]]]:
    """The least seconds when each step chooses, in hindsight, the draft model at width g (costs[g]) or prompt
    lookup at width g (verify[g]: a verification of g + 1 tokens, no draft forward), or a plain step; a schedule
    that uses the draft model at all pays `draft_prefill` once. Returns (seconds, [(source, width)] per step)."""
    best = [_several(runs, free_runs, costs, verify, model) for model in (True, False)]
    with_model, free_only = best
    if any(source == "draft" and g for source, g in with_model[1]) and with_model[0] + draft_prefill < free_only[0]:
        return with_model[0] + draft_prefill, with_model[1]
    return free_only


def _several(runs, free_runs, costs, verify, model: bool):
    n = len(runs) - 1
    best, choice = [0.0] * (n + 1), [("plain", 0)] * (n + 1)
    for i in range(n - 1, 0, -1):
        room = n - 1 - i
        options = [(costs[0] + best[i + 1], ("plain", 0))]
        if model:
            options += [(costs[g] + best[_reach(runs, i, g)], ("draft", g))
                        for g in range(1, min(len(costs) - 1, room) + 1)]
        options += [(verify[g] + best[_reach(free_runs, i, g)], ("lookup", g))
                    for g in range(1, min(len(verify) - 1, room, free_runs[i]) + 1)]
        best[i], choice[i] = min(options, key=lambda o: o[0])
    steps, i = [], 1
    while i < n:
        source, g = choice[i]
        steps.append((source, g))
        i = _reach(free_runs if source == "lookup" else runs, i, g)
    return (best[1] if n > 1 else 0.0), steps


def verify_costs(costs: Sequence[float], draft_token: float, width: int) -> list[float]:
    """verify[g], g = 0..width, derived from the draft model's steps where the run has no model-free ones to measure
    it (`free_costs`): a step's seconds without its g draft tokens (costs[g] - g x draft_token), the widths past the
    measured ones on the least-squares line through them (never below a plain step). Fragile: a drafting step's
    overhead (the draft's catch-up, its rollback) counts into `draft_token`, and the difference can come out flat,
    pricing a 32-token verification as a plain step."""
    known = [max(costs[0], c - g * draft_token) for g, c in enumerate(costs)]
    cost = StepCost()
    for g, seconds in enumerate(known):
        for _ in range(3):      # each point counts as measured (the step-cost model reads a width after 3 samples)
            cost.observe_verify(1, g + 1, seconds)
    return known + [cost.verify_time(1, g + 1) for g in range(len(known), width + 1)]


def free_costs(free_times: dict[int, list[float]], plain: float, width: int) -> list[float] | None:
    """verify[g], g = 0..width, from a run's timed steps that drafted only from model-free sources, read from the
    step-cost model (`StepCost`) they are observed into: a width's median where MIN_STEPS steps drafted it (a wide
    lookup is drafted rarely, at many different widths: its own steps), else the model's line through every such
    step; never below a plain step, never cheaper for more tokens. None where the model has no line through them
    (fewer than two widths, or fewer steps than its line needs)."""
    cost = StepCost()
    cost.observe_verify(1, 1, plain)
    for g, times in free_times.items():
        median = statistics.median(times) if g >= 1 and len(times) >= MIN_STEPS else None
        for seconds in times if g >= 1 else ():
            cost.observe_verify(1, g + 1, seconds if median is None else median)
    line = cost.lines.get((FULL, 1))
    if line is None or not line.ready() or not plain > 0:
        return None
    out = [plain]
    for g in range(1, width + 1):
        out.append(max(out[-1], cost.verify_time(1, g + 1)))
    return out


def fixed_schedule(runs: Sequence[int], costs: Sequence[float], width: int) -> float:
    """Seconds to commit output tokens 1..n-1 drafting `width` tokens at every step (fewer near the end), with the
    same costs as `best_schedule`: what a fixed length would cost under the bound's model."""
    n, i, seconds = len(runs) - 1, 1, 0.0
    while i < n:
        g = min(width, n - 1 - i)
        seconds += costs[g]
        i = _reach(runs, i, g)
    return seconds


def step_costs(model, draft, max_width: int, context: int = 256, progress: bool = True) -> list[float]:
    """costs[g] = verify(g + 1 tokens) + g draft tokens at batch 1, g = 0..max_width, measured now with `profile`
    at `context` cached tokens (the bound is only as right as the costs it is charged with)."""
    from .profiling import profile

    table = profile(model, draft, batch_sizes=(1,), lengths=tuple(range(max_width + 1)), lags=(), context=context,
                    progress=progress)
    cost = StepCost(table)
    return [cost.step_time(1, g + 1, {"model": g}) for g in range(max_width + 1)]


MIN_STEPS = 3    # a width's median step time is used when at least this many timed steps drafted that width


def measured_costs(step_times: dict[int, list[float]], plain: float, max_width: int) -> list[float] | None:
    """costs[g], g = 0..max_width, from a run's own timed steps: costs[0] = `plain` (seconds per plainly decoded
    token), costs[g] = the median of `step_times[g]` (seconds of each step whose widest row drafted g) where at least
    MIN_STEPS steps drafted g, else the step-cost model's line through those medians (`StepCost`: its slope at
    least 0, its values at least a plain step's: drafting never makes a step cheaper). None where the run cannot
    give them: fewer than two widths measured that often, or a plain time that is not positive."""
    measured = {g: statistics.median(t) for g, t in step_times.items() if 1 <= g <= max_width and len(t) >= MIN_STEPS}
    if len(measured) < 2 or not plain > 0:
        return None
    cost = StepCost()
    cost.observe_verify(1, 1, plain)
    for g, median in measured.items():      # a width's median counted once per timed step: robust to a stall
        for _ in step_times[g]:
            cost.observe_verify(1, g + 1, median)
    return [plain] + [measured[g] if g in measured else cost.verify_time(1, g + 1) for g in range(1, max_width + 1)]


def prefill_seconds(model, prompt: torch.Tensor, repeats: int = 3) -> float:
    """The target's forward over the prompt (median of `repeats`), as generate runs it: with a cache, and the head
    over the last position only (the head over every position of a 150k vocabulary costs more than the layers).
    Every schedule pays it once."""
    import inspect

    from .. import compat

    last = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            model(input_ids=prompt[None], use_cache=True, **compat.with_cache(model, compat.DynamicCache()), **last)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def prompt_bound(model, draft, prompt: torch.Tensor, output: torch.Tensor, costs: Sequence[float],
                 prefill: float | None = None, verify: Sequence[float] | None = None) -> dict:
    """The bound for one prompt and the target's greedy `output`: seconds (the target's prefill, the draft's if the
    best schedule drafts, and the schedule's steps), the same cost model's plain decoding (to read the model against
    measured stock generate), every fixed width's (`fixed_seconds[g]`), tokens, steps and widths. `prefill`: the
    target's measured prefill seconds (None: measured here)."""
    runs = agreement_runs(draft, prompt, output, model.config.vocab_size)
    prefill = prefill_seconds(model, prompt) if prefill is None else prefill
    draft_prefill = prefill_seconds(draft, prompt)
    seconds, widths = best_drafting_schedule(runs, costs, draft_prefill)
    fixed = [prefill + fixed_schedule(runs, costs, g) + (draft_prefill if g else 0.0) for g in range(len(costs))]
    out = {"seconds": prefill + seconds, "plain_seconds": fixed[0], "fixed_seconds": fixed,
           "draft_prefill_seconds": draft_prefill, "tokens": len(output), "steps": len(widths), "widths": widths}
    if verify is not None:       # several sources: the draft model or prompt lookup, per step in hindsight
        free_runs = lookup_runs(prompt, output, len(verify) - 1)
        several, steps = several_sources_schedule(runs, free_runs, costs, verify, draft_prefill)
        out.update(several_seconds=prefill + several, several_steps=steps)
    return out


def hindsight(model, draft, prompts: list[torch.Tensor], outputs: list[torch.Tensor], max_width: int = 8,
              progress: bool = True, step_times: dict[int, list[float]] | None = None,
              plain_seconds: float | None = None, draft_token: float | None = None, max_free: int = 32,
              free_times: dict[int, list[float]] | None = None) -> dict:
    """The bound over prompts (1-D ids) and the target's greedy outputs (1-D new tokens). Step costs from the run
    itself where given (`step_times`: seconds of its timed drafting steps by width; `plain_seconds`: stock
    `generate`'s time over all these prompts; see `measured_costs`), else profiled now at a typical context of these
    calls (a median prompt plus half a median output). `cost_source` says which ("run" or "profile")."""
    from tqdm import tqdm

    context = int(statistics.median(len(p) for p in prompts) + statistics.median(len(o) for o in outputs) // 2)
    prefills = [prefill_seconds(model, p) for p in prompts]
    costs = None
    if step_times is not None and plain_seconds is not None:
        decoded = sum(max(0, len(o) - 1) for o in outputs)      # token 0 of each output comes from the prefill
        plain = (plain_seconds - sum(prefills)) / decoded if decoded else 0.0
        costs = measured_costs(step_times, plain, max_width)
    source = "run" if costs is not None else "profile"
    if costs is None:
        costs = step_costs(model, draft, max_width, context=max(1, context), progress=progress)
    # `draft_token`: seconds per drafted token, measured in the run; with it, the bound over several sources too.
    # `free_times`: its steps drafted by prompt lookup alone, by width, which price a lookup's verification.
    measured = verify = None
    if draft_token is not None:
        measured = free_costs(free_times or {}, costs[0], max_free)
        verify = measured or verify_costs(costs, draft_token, max_free)
    rows = [prompt_bound(model, draft, p, o, costs, prefill, verify)
            for p, o, prefill in tqdm(list(zip(prompts, outputs, prefills)), desc="bound", disable=not progress)]
    fixed = [sum(r["fixed_seconds"][g] for r in rows) for g in range(max_width + 1)]
    several = {"several_seconds": sum(r["several_seconds"] for r in rows), "verify_costs": verify,
               "verify_cost_source": "free steps" if measured else "derived"} \
        if verify is not None else {}
    return {"seconds": sum(r["seconds"] for r in rows), "plain_seconds": sum(r["plain_seconds"] for r in rows),
            "best_fixed_width": min(range(max_width + 1), key=fixed.__getitem__), "fixed_seconds": fixed,
            "max_width": max_width, "context": context, "costs": costs, "cost_source": source, "prompts": rows,
            **several}


def best_fixed_share(bound: dict) -> tuple[int, float]:
    """The width a whole run would best have drafted at every step, chosen in hindsight over all prompts, and the
    fraction of the bound's speedup it reaches under the same cost model. A schedule that does not know where each
    run of agreement ends (any policy choosing widths before it drafts) is judged against this too: the bound
    itself places every width at the end of a run."""
    width = bound["best_fixed_width"]
    return width, bound["seconds"] / bound["fixed_seconds"][width]
