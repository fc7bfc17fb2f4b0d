"""Adaptive vs the best fixed gamma in hindsight, in the lab (no model runs).

    python benchmarks/lab_adaptive.py --cycles 5
    python benchmarks/lab_adaptive.py --synthetic --seeds 5
    python benchmarks/lab_adaptive.py --draft-model humaneval-chat sharegpt --num-prompts 12 --new-tokens 64
    python benchmarks/lab_adaptive.py --smoke     # each mode at its smallest (tiny models for --draft-model)

Traces (default): replays results/lab-suffix/<workload>/traces.json under the fp32 latency table at B = 1, 4, 16
(closed loop); model-free drafter, so only verification costs (the lab's draft_cost=False).

`--synthetic`: eight synthetic workloads as closed generate calls of one row (12 calls of 48-64 tokens, one policy
across them, a draft model's cost per token in the table's slope): i.i.d. acceptance at 0.6-0.95, runs drawn from a
good or a bad regime per position (bimodal), and regimes that persist for about ten positions (bursty). Prints
each workload's mean and least ratio over `--seeds` draws, and the mean over all.

`--draft-model WORKLOAD ...`: the bench's pair (Qwen2.5-Coder-1.5B in float32, its 0.5B in bf16) on real prompts.
The target's greedy outputs are generated, the draft's agreement runs at every output position are read
teacher-forced (`spec_adapt.tools.bound.agreement_runs`), and the per-position acceptance given the drafts before is
printed. Then Adaptive is replayed beside every fixed width at batch 1 (closed calls, one policy across them), each
step priced by the step costs of the bench run in `results/bench-qwen-sources/<workload>-b1` (its verification by
tokens fed, and its draft time per token). Ratios are shown for the bench's first 3 prompts and for the others.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
from pathlib import Path

import torch

from spec_adapt import Adaptive
from spec_adapt.tools import lab
from spec_adapt.policies.estimators import LatencyTable

import _smoke


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--latency", default="results/lab-suffix/latency-float32.json")
    parser.add_argument("--workloads", nargs="+", default=["humaneval", "sharegpt"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--synthetic", action="store_true", help="the synthetic workloads instead of the traces")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--draft-model", nargs="+", metavar="WORKLOAD", help="the real pair's traces on these workloads")
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prefill-ms", type=float, default=None,
                        help="with --draft-model: tell the policy the target's prompt forward took this many ms a "
                             "token (as a call's loop does, Policy.prefilled), which bounds an unmeasured catch-up")
    parser.add_argument("--runs", help="a folder: the agreement runs are read from <workload>.json there if it exists, "
                        "else recorded and written there (a policy change is then replayed in seconds)")
    _smoke.add(parser)
    args = parser.parse_args()
    if args.smoke:
        return smoke(args.latency)
    if args.synthetic:
        return synthetic(args.seeds)
    if args.draft_model:
        if args.num_prompts < 1 or args.new_tokens < 1:
            parser.error(f"--num-prompts and --new-tokens must be at least 1, got {args.num_prompts}, {args.new_tokens}")
        missing = [w for w in args.draft_model if not Path(f"results/bench-qwen-sources/{w}-b1/summary.json").exists()]
        if missing:
            parser.error(f"no bench run to take step costs from for {', '.join(missing)}: "
                         "results/bench-qwen-sources/<workload>-b1/summary.json (run from the repository root)")
        return draft_model(args.draft_model, args.num_prompts, args.new_tokens, args.runs, args.prefill_ms)
    return traces(args.workloads, args.cycles, args.batch_sizes, args.latency)


def smoke(latency: str) -> None:
    """Each mode at its smallest: the traces at batch 4 once, two synthetic workloads once, and the draft-model
    replay over 4 prompts of 8 tokens from tiny random models."""
    traces(["humaneval"], 1, [4], latency)
    synthetic(1, WORKLOADS[:2])
    _smoke.use_tiny_models()
    draft_model(["humaneval-chat"], 4, 8, None)


def traces(names: list[str], cycles: int, batch_sizes: list[int], latency: str) -> None:
    """Adaptive against the best fixed width in hindsight on the recorded suffix-drafter traces."""
    table = LatencyTable.load(latency)
    print(f"{'workload':<10} {'B':>3} {'best fixed':>10} {'adaptive vs best':>17}")
    for workload in names:
        pool = [lab.Request(**r) for r in json.load(open(f"results/lab-suffix/{workload}/traces.json"))]
        requests = [lab.Request(r.runs, name=r.name, lengths=r.lengths) for _ in range(cycles) for r in pool]
        for batch in batch_sizes:
            ours = lab.simulate(Adaptive(), requests, table, lab.Static(batch), draft_cost=False).goodput
            gamma, best, _ = lab.best_fixed(requests, table, lab.Static(batch), draft_cost=False)
            print(f"{workload:<10} {batch:>3} {gamma:>10} {100 * (ours / best.goodput - 1):>+16.1f}%")


def slope_table(slope: float) -> LatencyTable:
    """T(1, s) / T(1, 0) = 1 + slope x s: verification and drafting together, per drafted token."""
    return LatencyTable(step={1: {s: 1.0 + slope * s for s in range(17)}})


def regimes(n: int, length: int, seed: int, good: float, bad: float, stay: float, p_good: float = 0.5):
    """Requests whose runs come from a good or a bad acceptance rate; the regime persists with probability `stay`
    from one position to the next (0: drawn afresh at each position, with `p_good`)."""
    rng, out = random.Random(seed), []
    for i in range(n):
        runs, is_good = [], rng.random() < p_good
        for _ in range(length):
            is_good = is_good if rng.random() < stay else rng.random() < p_good
            alpha, k = (good if is_good else bad), 0
            while k < 64 and rng.random() < alpha:
                k += 1
            runs.append(k)
        out.append(lab.Request(runs, name=f"regimes-{i}"))
    return out


WORKLOADS = [
    ("i.i.d. 0.90, slope 0.30", lambda s: lab.synthetic_requests(12, 48, 0.9, seed=s), 0.3),
    ("i.i.d. 0.80, slope 0.30", lambda s: lab.synthetic_requests(12, 48, 0.8, seed=s), 0.3),
    ("i.i.d. 0.75, slope 0.33", lambda s: lab.synthetic_requests(12, 48, 0.75, seed=s), 0.33),
    ("i.i.d. 0.60, slope 0.30", lambda s: lab.synthetic_requests(12, 48, 0.6, seed=s), 0.3),
    ("i.i.d. 0.95, slope 0.10", lambda s: lab.synthetic_requests(12, 64, 0.95, seed=s), 0.1),
    ("bimodal, slope 0.30", lambda s: regimes(12, 48, s, 0.95, 0.4, stay=0.0, p_good=0.6), 0.3),
    ("bursty, slope 0.30", lambda s: regimes(12, 48, s, 0.95, 0.3, stay=0.9), 0.3),
    ("bursty, slope 0.15", lambda s: regimes(12, 48, s, 0.95, 0.3, stay=0.9), 0.15),
]


def synthetic(seeds: int, workloads=WORKLOADS) -> None:
    print(f"{'workload':<26} {'adaptive / best fixed: mean':>28} {'least':>7}")
    every = []
    for name, make, slope in workloads:
        ratios = []
        for seed in range(seeds):
            requests, table = make(seed), slope_table(slope)
            _, best, _ = lab.best_fixed(requests, table, lab.Batches(1))
            ratios.append(lab.simulate(Adaptive(), requests, table, lab.Batches(1)).goodput / best.goodput)
        every += ratios
        print(f"{name:<26} {statistics.mean(ratios):>28.3f} {min(ratios):>7.3f}")
    print(f"{'all':<26} {statistics.mean(every):>28.3f} {min(every):>7.3f}")


def draft_model(names: list[str], prompts: int, new_tokens: int, folder: str | None,
                prefill_ms: float | None = None) -> None:
    from spec_adapt import FixedLength

    for name in names:
        saved = Path(folder) / f"{name}.json" if folder else None
        if saved is not None and saved.exists():
            every = json.loads(saved.read_text())
        else:
            every = pair_runs(name, prompts, new_tokens)
            if saved is not None:
                saved.parent.mkdir(parents=True, exist_ok=True)
                saved.write_text(json.dumps(every))
        requests = [lab.Request(runs) for runs in every]
        runs = [r for request in requests for r in request.runs]
        rates = [sum(r > i for r in runs) / max(1, sum(r >= i for r in runs)) for i in range(8)]
        print(f"{name}: acceptance at draft position 1..8, given the drafts before: "
              + " ".join(f"{rate:.2f}" for rate in rates))
        table = bench_costs(f"results/bench-qwen-sources/{name}-b1/summary.json")
        for part, chosen in (("the bench's 3 prompts", requests[:3]), (f"the other {len(requests) - 3}", requests[3:])):
            if not chosen:      # --num-prompts 3 or fewer: nothing beyond the bench's prompts
                continue
            fixed = {g: lab.simulate(FixedLength(g), chosen, table, lab.Batches(1)).goodput for g in range(9)}
            best = max(fixed, key=fixed.get)
            policy = Adaptive()
            if prefill_ms is not None:
                policy.prefilled(1000, prefill_ms)       # 1000 tokens in prefill_ms x 1000 ms
            ours = lab.simulate(policy, chosen, table, lab.Batches(1)).goodput
            print(f"  {part:<22} best fixed width {best}; Adaptive / best fixed {ours / fixed[best]:.3f}, "
                  f"/ plain {ours / fixed[0]:.2f}")


def pair_runs(workload: str, prompts: int, new_tokens: int) -> list[list[int]]:
    """Per prompt, the draft's agreement run at each position of the target's greedy output (to its EOS)."""
    from tqdm import tqdm

    from spec_adapt.recipes import workloads
    from spec_adapt.tools.bound import agreement_runs

    model, tok, draft = the_pair()
    texts = list(workloads.with_inputs(workloads.load(workload, prompts), tok)["input_text"])
    out = []
    for text in tqdm(texts, desc=f"{workload}: outputs and agreement runs"):
        ids = tok(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            new = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
        if tok.eos_token_id in new:
            new = new[: new.index(tok.eos_token_id) + 1]
        out.append(agreement_runs(draft, ids[0], torch.tensor(new), model.config.vocab_size)[:-1])
    return out


@functools.cache
def the_pair():
    """(target, tokenizer, draft), loaded once for every workload of the run."""
    from spec_adapt.tools.models import load_model

    model, tok = load_model("qwen2.5-coder-1.5b", dtype=torch.float32)
    return model, tok, load_model("qwen2.5-coder-0.5b", dtype=torch.float32)[0].to(torch.bfloat16)


def bench_costs(path: str) -> LatencyTable:
    """A batch-1 table from a bench run's bound: verification by drafts fed, and the draft's mean time per token."""
    bound = json.loads(Path(path).read_text())["bound"]
    verify, steps = bound["verify_costs"], bound["costs"]
    widths = range(1, len(steps))
    per_token = statistics.mean((steps[g] - verify[g]) / g for g in widths)
    return LatencyTable(step={1: {s: verify[s] for s in range(len(steps))}}, draft_token={1: per_token})


if __name__ == "__main__":
    main()
