"""How fast could any speculative-length schedule be at batch 1 with this draft? A hindsight bound, against stock
assisted generation measured on the same prompts.

Greedy decoding makes the output fixed (it is the target's), so the draft's agreement with it is fixed too: one
teacher-forced draft forward over prompt + output gives, at every output position i, whether the draft's next token
is the target's; run[i] = how many in a row agree from i. A step at position i that drafts g tokens commits
min(run[i], g) + 1 of them and costs T(g) = verify(g + 1 tokens) + g draft tokens (this machine's `profile`, batch 1).
The best schedule in hindsight (drafting exactly what will be accepted, or nothing) is a dynamic program over i. Its
time is a bound on every length policy with this draft: it knows the future, and it is charged no catch-up beyond
one draft token per step and no per-step overhead. Its ratio to stock assisted generation's measured time is the most
any policy could gain over stock here.

    python benchmarks/oracle_bound.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --dtype bfloat16 \\
        --workload humaneval-chat --num-prompts 8 --new-tokens 32
    python benchmarks/oracle_bound.py --dtype float32 --prepare --workload humaneval-chat --num-prompts 3 --new-tokens 48
    python benchmarks/oracle_bound.py --dtype float32 --draft-dtype bfloat16 --prepare --workload humaneval-chat \
        --num-prompts 3 --new-tokens 48
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

from spec_adapt import prepare
from spec_adapt.tools.models import load_model
from spec_adapt.tools.profiling import profile
from spec_adapt.recipes import workloads


def agreement_runs(draft, prompt: torch.Tensor, output: torch.Tensor, vocab: int) -> list[int]:
    """run[i]: how many output tokens from i on the draft predicts in a row, given the target's own prefix."""
    ids = torch.cat([prompt, output])[None]
    with torch.no_grad():
        logits = draft(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(output), :vocab]
    match = (logits.argmax(-1) == output).tolist()
    runs, run = [0] * (len(output) + 1), 0
    for i in range(len(output) - 1, -1, -1):
        run = run + 1 if match[i] else 0
        runs[i] = run
    return runs


def best_schedule(runs: list[int], n: int, cost, max_gamma: int) -> tuple[float, list[int]]:
    """Least time to commit output tokens 1..n-1 (token 0 comes from the prefill): (seconds, widths chosen)."""
    best, choice = [0.0] * (n + 1), [0] * (n + 1)
    for i in range(n - 1, 0, -1):
        options = []
        for g in range(0, min(max_gamma, n - 1 - i) + 1):
            reach = min(n, i + min(runs[i], g) + 1)
            options.append((cost(g) + best[reach], g))
        best[i], choice[i] = min(options)
    widths, i = [], 1
    while i < n:
        widths.append(choice[i])
        i = min(n, i + min(runs[i], choice[i]) + 1)
    return best[1], widths


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
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    model, tok = load_model(args.model, dtype=dtype)
    draft, _ = load_model(args.draft, dtype=getattr(torch, args.draft_dtype or args.dtype))
    if args.prepare:
        prepare(model), prepare(draft)
    table = profile(model, draft, batch_sizes=(1,), lengths=tuple(range(args.max_gamma + 1)), lags=(32,))
    cost = lambda g: table.step_time(1, g)                                     # noqa: E731
    print("batch-1 step seconds by width:", {g: round(cost(g), 4) for g in range(args.max_gamma + 1)})
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
        output = out[0, ids.shape[1]:]
        prefill_s, _ = timed(lambda: model(input_ids=ids))
        runs = agreement_runs(draft, ids[0], output, model.config.vocab_size)
        oracle_s, widths = best_schedule(runs, len(output), cost, args.max_gamma)
        rows.append(dict(plain=plain_s, assisted=assisted_s, oracle=prefill_s + oracle_s,
                         plain_model=prefill_s + (len(output) - 1) * cost(0), steps=len(widths), tokens=len(output) - 1, same=same))
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
