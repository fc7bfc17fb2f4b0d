"""With a draft that is never right, adaptive policies must turn speculation off and cost (almost) nothing.

    python benchmarks/always_wrong.py --batch-sizes 1 4 --new-tokens 96 --repeats 3

Side by side in one process, alternating: stock generate (target only) and spec_adapt with a scripted draft that
always proposes wrong tokens, under several policies. Reports time relative to target-only (goal: <= 1.05x), the
share of steps run at gamma = 0, and checks outputs are identical.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

import spec_adapt
from spec_adapt.bench import parse_policy
from spec_adapt.models import load_model
from spec_adapt.recipes import workloads


def wrong(row, context, gamma):
    return [(context[-1] + 1 + i) % 49152 for i in range(gamma)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--policies", nargs="+", default=["nightjar", "nightjar-local", "goodput", "ucb", "fixed4"])
    args = parser.parse_args()
    model, tok = load_model()
    prompts = list(workloads.with_inputs(workloads.sharegpt(limit=max(args.batch_sizes)), tok)["input_text"])
    common = dict(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id)
    print(f"{'B':>3} {'policy':<16} {'time vs target':>15} {'gamma=0 steps':>14} identical")
    for batch in args.batch_sizes:
        enc = tok(prompts[:batch], return_tensors="pt", padding=True)
        policies = {name: parse_policy(name) for name in args.policies}   # learned state persists across repeats
        configs = {"target": lambda: (model.generate(**enc, **common), None)}
        for name, policy in policies.items():
            configs[name] = (lambda p: lambda: (model.generate(
                **enc, **common, custom_generate=spec_adapt.generate,
                drafter=spec_adapt.ScriptedDrafter(wrong), assistant_policy=p), spec_adapt.last_stats()))(policy)
        times = {c: [] for c in configs}
        zero = {c: [] for c in configs}
        same = {c: True for c in configs}
        for _ in tqdm(range(args.repeats + 1), desc=f"B={batch}"):   # the first round is a warm-up
            reference = None
            for name, fn in configs.items():
                start = time.perf_counter()
                out, stats = fn()
                times[name].append(time.perf_counter() - start)
                reference = out if name == "target" else reference
                same[name] &= torch.equal(out, reference)
                if stats is not None:
                    zero[name].append(sum(max(r.gammas) == 0 for r in stats.trace) / max(stats.steps, 1))
        base = statistics.median(times["target"][1:])
        for name in policies:
            ratio = statistics.median(times[name][1:]) / base
            print(f"{batch:>3} {name:<16} {ratio:>14.3f}x {100 * statistics.mean(zero[name][1:]):>13.0f}% {same[name]}")


if __name__ == "__main__":
    main()
