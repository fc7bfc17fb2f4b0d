"""A generate call ends with its slowest row: does speculation shorten the call, or only give tokens to rows that end
early anyway? Per batch of prompts, stock generate against Adaptive judging the batch as closed (the default in a
generate call) and the same policy told every batch is open (counting every row's tokens, as serving should).

    python benchmarks/closed_batches.py --workload sharegpt --num-prompts 16 --repeats 3
    python benchmarks/closed_batches.py --smoke

Prints, per batch and config: wall time, decode steps (stock: forwards after the prefill, timed by a forward hook;
ours: verification steps), how many of them drafted, and at the end each config's speedup vs stock over all batches
per repeat (median [min-max]). Configs run interleaved in a rotating order, so machine drift hits all alike.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from tqdm import tqdm

import spec_adapt
from spec_adapt import Adaptive
from spec_adapt.tools.models import load_model
from spec_adapt.recipes import workloads

import _smoke


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--workload", default="sharegpt")
    p.add_argument("--drafter", choices=["lookup", "suffix"], default="lookup")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    _smoke.add(p)
    args = _smoke.apply(p.parse_args(), globals(), num_prompts=2, batch=2, new_tokens=8, repeats=1)
    model, tok = load_model(args.model, dtype=getattr(torch, args.dtype))
    prompts = list(workloads.with_inputs(workloads.load(args.workload, args.num_prompts), tok)["input_text"])
    batches = [tok(prompts[i : i + args.batch], return_tensors="pt", padding=True)
               for i in range(0, len(prompts) - args.batch + 1, args.batch)]
    common = dict(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    make = {"lookup": lambda: spec_adapt.PromptLookupDrafter(max_ngram=3, min_ngram=2),
            "suffix": lambda: spec_adapt.SuffixDrafter(index=spec_adapt.drafters.SuffixIndex())}[args.drafter]

    def stock(enc):
        starts = []
        hook = model.register_forward_pre_hook(lambda *a: starts.append(time.perf_counter()))
        try:
            model.generate(**enc, **common)
        finally:
            hook.remove()
        return len(starts) - 1, 0

    def ours(policy):
        def run(enc):
            model.generate(**enc, **common, custom_generate=spec_adapt.generate, drafter=make(),
                           assistant_policy=policy)
            trace = spec_adapt.last_stats().trace
            return len(trace), sum(1 for r in trace if max(r.drafted, default=0) > 0)
        return run

    configs = {"stock": stock, "closed (default)": ours(Adaptive()), "told open": ours(Adaptive(closed_batches=False))}
    for fn in configs.values():      # warm-up; the policies start learning here, as in `spec-adapt bench`
        fn(batches[0])
    walls, per_batch = defaultdict(list), defaultdict(list)
    names = list(configs)
    for rep in tqdm(range(args.repeats), desc="repeats"):
        order = names[rep % len(names):] + names[: rep % len(names)]
        total = dict.fromkeys(names, 0.0)
        for b, enc in enumerate(batches):
            for name in order:
                start = time.perf_counter()
                steps, drafting = configs[name](enc)
                wall = time.perf_counter() - start
                total[name] += wall
                per_batch[(b, name)].append((wall, steps, drafting))
        for name in names:
            walls[name].append(total[name])
    for b in range(len(batches)):
        cells = []
        for name in names:
            wall, steps, drafting = (statistics.median(r[i] for r in per_batch[(b, name)]) for i in range(3))
            cells.append(f"{name} {wall:.2f} s, {steps:.0f} steps ({drafting:.0f} drafting)")
        print(f"batch {b}: " + " | ".join(cells))
    for name in names[1:]:
        ratios = [a / b for a, b in zip(walls["stock"], walls[name])]
        print(f"{name:16s} speedup vs stock {statistics.median(ratios):.3f}x [{min(ratios):.3f}-{max(ratios):.3f}]")


if __name__ == "__main__":
    main()
