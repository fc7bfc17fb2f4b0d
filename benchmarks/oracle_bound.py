"""How fast could any speculative-length schedule be at batch 1 with this draft? A hindsight bound
(`spec_adapt.tools.bound`: the draft's teacher-forced agreement with the target's greedy output, this machine's step
costs, a dynamic program over output positions), against stock assisted generation measured on the same prompts.
Its ratio to stock assisted generation's measured time is the most any policy could gain over stock here.
`spec-adapt bench --bound` reports the same bound beside every configuration it times.

    python benchmarks/oracle_bound.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --dtype bfloat16 \\
        --workload humaneval-chat --num-prompts 8 --new-tokens 32
    python benchmarks/oracle_bound.py --dtype float32 --prepare --workload humaneval-chat --num-prompts 3 --new-tokens 48
    python benchmarks/oracle_bound.py --dtype float32 --draft-dtype bfloat16 --prepare --workload humaneval-chat \
        --num-prompts 3 --new-tokens 48
    python benchmarks/oracle_bound.py --smoke
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

from spec_adapt import prepare
from spec_adapt.tools.bound import prompt_bound, step_costs
from spec_adapt.tools.models import load_model
from spec_adapt.recipes import workloads

import _smoke


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


@torch.no_grad()
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--draft-dtype", help="the draft's dtype (default: --dtype); it changes the draft's cost and "
                   "agreement, never the output")
    p.add_argument("--workload", default="humaneval-chat")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--max-gamma", type=int, default=8)
    p.add_argument("--prepare", action="store_true", help="spec_adapt.prepare target and draft (the cost curve, "
                   "stock and stock assisted all run prepared)")
    _smoke.add(p)
    args = _smoke.apply(p.parse_args(), globals(), dtype="float32", num_prompts=1, new_tokens=8, max_gamma=2)
    for name in ("num_prompts", "new_tokens", "max_gamma"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    dtype = getattr(torch, args.dtype)
    model, tok = load_model(args.model, dtype=dtype)
    draft, _ = load_model(args.draft, dtype=getattr(torch, args.draft_dtype or args.dtype))
    if args.prepare:
        prepare(model), prepare(draft)
    costs = step_costs(model, draft, args.max_gamma)
    print("batch-1 step seconds by width:", {g: round(c, 4) for g, c in enumerate(costs)})
    texts = list(workloads.with_inputs(workloads.load(args.workload, args.num_prompts), tok)["input_text"])
    settings = dict(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    rows = []
    for text in tqdm(texts, desc="prompts"):
        ids = tok(text, return_tensors="pt").input_ids
        plain_s, out = timed(lambda: model.generate(ids, **settings))
        assisted_s, assisted = timed(lambda: model.generate(ids, assistant_model=draft, **settings))
        # bf16 can differ between a one-token and a multi-token forward, so stock assisted may leave stock greedy
        # output (the bound is over stock generate's output); counted, not asserted.
        same = torch.equal(out, assisted)
        bound = prompt_bound(model, draft, ids[0], out[0, ids.shape[1]:], costs)
        rows.append(dict(plain=plain_s, assisted=assisted_s, oracle=bound["seconds"],
                         plain_model=bound["plain_seconds"], steps=bound["steps"], tokens=bound["tokens"] - 1, same=same))
    total = {k: sum(r[k] for r in rows) for k in ("plain", "assisted", "oracle", "plain_model")}
    drafted_in = f" (draft {args.draft_dtype})" if args.draft_dtype else ""
    setup = f"{args.dtype}{drafted_in}{' prepared' if args.prepare else ''}"
    print(f"\n{args.model} <- {args.draft}, {setup}, {args.workload}, {len(rows)} prompts x "
          f"{args.new_tokens} new tokens, batch 1")
    print(f"stock generate        {total['plain']:7.2f} s   (the cost model says {total['plain_model']:.2f} s)")
    print(f"stock assisted        {total['assisted']:7.2f} s   {total['plain'] / total['assisted']:.2f}x")
    print(f"hindsight schedule    {total['oracle']:7.2f} s   {total['plain'] / total['oracle']:.2f}x  (bound, "
          f"{sum(r['steps'] for r in rows)} steps for {sum(r['tokens'] for r in rows)} tokens)")
    print(f"stock assisted output identical to stock generate on {sum(r['same'] for r in rows)} of {len(rows)} prompts")
    ratios = [r["assisted"] / r["oracle"] for r in rows]
    print(f"bound / stock assisted: {total['assisted'] / total['oracle']:.2f}x over all prompts, per prompt median "
          f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]")


if __name__ == "__main__":
    main()
