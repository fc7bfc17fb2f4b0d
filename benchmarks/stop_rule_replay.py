"""Depth inside the step, replayed on the real pair: how close each length rule comes to the hindsight bound.

    python benchmarks/stop_rule_replay.py
    python benchmarks/stop_rule_replay.py --num-prompts 6 --new-tokens 48 --orders 6
    python benchmarks/stop_rule_replay.py --bench results/bench-qwen-bf16-draft-b1
    python benchmarks/stop_rule_replay.py --smoke      # tiny random models, step costs profiled on them

For each prompt of each workload: the target's greedy output, then one teacher-forced draft forward over prompt +
output, which gives at every output position whether the draft's token is the target's and the draft's probability
of its token (its confidence). Each rule is then replayed over those outputs at batch 1 under this machine's step
costs: with `--bench`, those a `spec-adapt bench --bound` run measured on its own steps; else profiled now
(`spec_adapt.tools.bound.step_costs`: verify g + 1 tokens and draft g). The first drafting step pays the draft's
prompt forward, a drafting step after plain steps the draft's catch-up (both at the measured prompt forward's
seconds per token). Printed: each rule's share of the bound's decode time (the bound drafts every step exactly to
the end of the draft's run of agreement and pays the draft's prompt forward once, no catch-up), and the AUC of the
draft's confidence for telling its accepted tokens from its rejected ones.

Rules: fixed widths; a survival rule at fixed thresholds (the draft's confidence read as its acceptance, up to 4, 5
or 8 tokens), and the best of those fixed rules in hindsight; the default `Adaptive()` and `Adaptive(stop_rule=True)`, each on a fresh policy's first call (cold) and
on calls after it has seen every prompt once (warm), over `--orders` shuffled orders. Past a token the target
rejects, the replay reads the teacher-forced confidence of that position (the draft's own continuation is not
run), which a real draft would have seen after its own tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from spec_adapt import Adaptive, FixedLength, prepare
from spec_adapt.running_estimates import Calibration, StopRule
from spec_adapt.execution import fastest
from spec_adapt.metrics import StepRecord
from spec_adapt.policies.policy import Plan, StepInfo
from spec_adapt.recipes import workloads
from spec_adapt.tools.bound import best_drafting_schedule, fixed_schedule, runs_of_matches, step_costs
from spec_adapt.tools.models import load_model

import _smoke

MAX_WIDTH = 8


def observe_pair(model, draft, tok, workload: str, prompts: int, new_tokens: int) -> list[dict]:
    """Per prompt: match[i], conf[i] over the output, and the draft's prompt forward in seconds."""
    vocab = model.config.vocab_size
    data = workloads.with_inputs(workloads.load(workload, prompts), tok)
    out = []
    for text in data["input_text"]:
        ids = tok(text, return_tensors="pt").input_ids[0]
        gen = model.generate(ids[None], max_new_tokens=new_tokens, do_sample=False)[0, len(ids):]
        with torch.no_grad():
            start = time.perf_counter()
            draft(input_ids=ids[None])
            catchup = time.perf_counter() - start
            q = draft(input_ids=torch.cat([ids, gen])[None]).logits[0, len(ids) - 1: len(ids) - 1 + len(gen), :vocab]
        q = q.float().softmax(-1)
        out.append({"match": (q.argmax(-1) == gen).tolist(), "conf": q.max(-1).values.tolist(),
                    "per_token": catchup / len(ids), "prompt": len(ids)})
    return out


def replay(policy, prompt: dict, costs: list[float]) -> float:
    """Decode seconds of one batch-1 call under `policy` (tokens after the prefill's first one)."""
    match, conf = prompt["match"], prompt["conf"]
    runs, n = runs_of_matches(match), len(match)
    policy.begin(1)
    i, seconds, lag = 1, 0.0, prompt["prompt"] + 1
    while i < n:
        info = StepInfo(1, torch.tensor([0]), torch.tensor([i]), torch.tensor([n - i]), 0,
                        draft_lag=torch.tensor([lag]), closed=True)
        plan = policy.choose(info)
        stop = plan.stop if isinstance(plan, Plan) else None
        asked = plan.gammas if isinstance(plan, Plan) else plan
        asked = max(0, min(int(torch.as_tensor(asked).reshape(-1)[0]), n - 1 - i))
        drafted = asked if stop is None else int(stop.depths(torch.tensor([conf[i: i + asked]]))[0])
        catchup = prompt["per_token"] * lag if drafted and lag > 2 else 0.0
        step = costs[drafted] + catchup
        accepted = min(runs[i], drafted)
        confidence = torch.tensor([conf[i: i + drafted]]) if drafted else None
        policy.observe(StepRecord(1, [0], [asked], [drafted], [accepted], [accepted + 1], step, 0.0, step,
                                  confidence=confidence))
        lag = (2 if accepted == drafted else 1) if drafted else lag + 1
        i += accepted + 1
        seconds += step
    return seconds


class Rule(FixedLength):
    """Up to `width` tokens, each row stopping where its survival (confidence read as acceptance) < threshold."""

    def __init__(self, threshold: float, width: int = MAX_WIDTH):
        super().__init__(width)
        self.rule = StopRule(threshold, Calibration(prior=1e5))      # never updated: it stays on the diagonal

    def choose(self, info):
        return Plan(super().choose(info), stop=self.rule)


def run_costs(folder: str, workload: str) -> list[float]:
    """A bench run's step costs for `workload` (`summary.json`'s bound, taken from the run's own steps)."""
    bound = json.loads((Path(folder) / workload / "summary.json").read_text())["bound"]
    if bound is None or bound.get("cost_source") != "run" or len(bound["costs"]) < MAX_WIDTH + 1:
        raise SystemExit(f"{folder}/{workload}/summary.json has no bound with step costs from its own run up to "
                         f"width {MAX_WIDTH}: run `spec-adapt bench ... --bound` (it takes them from the run)")
    return bound["costs"][: MAX_WIDTH + 1]


def auc(data: list[dict]) -> float:
    hits = [c for p in data for c, m in zip(p["conf"], p["match"]) if m]
    misses = [c for p in data for c, m in zip(p["conf"], p["match"]) if not m]
    return sum((h > x) + 0.5 * (h == x) for h in hits for x in misses) / max(1, len(hits) * len(misses))


def bound_seconds(prompt: dict, costs: list[float]) -> float:
    """The bound's decode seconds for one prompt: the best schedule, plus the draft's prompt forward if it drafts."""
    return best_drafting_schedule(runs_of_matches(prompt["match"]), costs, prompt["per_token"] * prompt["prompt"])[0]


def fixed_seconds(prompt: dict, costs: list[float], width: int) -> float:
    """A fixed width's decode seconds under the bound's model (the draft's prompt forward paid where it drafts)."""
    forward = prompt["per_token"] * prompt["prompt"] if width else 0.0
    return forward + fixed_schedule(runs_of_matches(prompt["match"]), costs, width)


def share(data, costs, make, orders: int) -> tuple[float, float]:
    """(cold, warm) mean share of the bound over prompts and `orders` shuffled orders."""
    bound = [bound_seconds(p, costs) for p in data]
    cold, warm = [], []
    for seed in range(orders):
        order = list(range(len(data)))
        random.Random(seed).shuffle(order)
        policy = make()
        for k, j in enumerate(order * 2):
            value = bound[j] / replay(policy, data[j], costs)
            if k == 0:
                cold.append(value)
            elif k >= len(order):
                warm.append(value)
    return statistics.mean(cold), statistics.mean(warm)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--workloads", nargs="+", default=["humaneval-chat", "sharegpt"])
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--orders", type=int, default=6, help="shuffled prompt orders per adaptive policy")
    p.add_argument("--bench", metavar="DIR", help="take each workload's step costs from a `spec-adapt bench --bound` "
                   "run saved in DIR/<workload>/summary.json (its own timed steps) instead of profiling them now")
    _smoke.add(p)
    args = _smoke.apply(p.parse_args(), globals(), workloads=["humaneval-chat"], num_prompts=2, new_tokens=12,
                        orders=1)
    torch.set_grad_enabled(False)
    model, tok = load_model(args.model, dtype=torch.float32)
    draft = fastest(load_model(args.draft, dtype=torch.float32)[0])[0]     # prepared, bf16 where native
    prepare(model)
    data = {w: observe_pair(model, draft, tok, w, args.num_prompts, args.new_tokens) for w in args.workloads}
    costs = {w: run_costs(args.bench, w) if args.bench else None for w in args.workloads}
    if None in costs.values():
        prompt = statistics.median(p["prompt"] for ps in data.values() for p in ps)
        profiled = step_costs(model, draft, MAX_WIDTH, context=int(prompt + args.new_tokens // 2))
        costs = {w: c or profiled for w, c in costs.items()}
    for w, ps in data.items():
        agree = statistics.mean(m for p in ps for m in p["match"])
        print(f"\n{w}: {len(ps)} prompts, agreement {agree:.2f}, confidence AUC {auc(ps):.2f}, draft catch-up "
              f"{1000 * statistics.mean(p['per_token'] for p in ps):.1f} ms per prompt token")
        fixed = {g: statistics.mean(bound_seconds(p, costs[w]) / fixed_seconds(p, costs[w], g) for p in ps)
                 for g in range(MAX_WIDTH + 1)}
        best = max(fixed, key=fixed.get)
        print(f"  step costs (s): {' '.join(f'{c:.3f}' for c in costs[w])}")
        print(f"  best fixed width in hindsight (no catch-up after the prompt): {best}, {fixed[best]:.3f} of the bound")
        rows = [(f"FixedLength({g})", lambda g=g: FixedLength(g)) for g in (3, 4, 5)]
        rows += [(f"survival rule at {t}, up to {g}", lambda t=t, g=g: Rule(t, g))
                 for g in (4, 5, MAX_WIDTH) for t in (0.1, 0.2, 0.3, 0.4, 0.5)]
        fixed_rules = len(rows)
        rows += [("Adaptive() (default)", Adaptive), ("Adaptive(stop_rule=True)", lambda: Adaptive(stop_rule=True))]
        shares = []
        for name, make in rows:
            cold, warm = share(ps, costs[w], make, args.orders)
            shares.append((warm, name))
            print(f"  {name:<32} cold {cold:.3f}  warm {warm:.3f}")
        print(f"  the best fixed rule above in hindsight: {max(shares[:fixed_rules])[1]}, "
              f"{max(shares[:fixed_rules])[0]:.3f} of the bound")


if __name__ == "__main__":
    main()
