"""Where a batched call's time goes on the real pair: the target's prefill, then the steps (draft, verify).

    python benchmarks/call_decomposition.py --batch 4 --new-tokens 32
    python benchmarks/call_decomposition.py --model smollm2-135m --dtype float32 --workload sharegpt --batch 4
    python benchmarks/call_decomposition.py --dtype float32 --prepare --workload sharegpt --batch 4 --new-tokens 48 \
        --widths --adaptive --repeats 2
    python benchmarks/call_decomposition.py --dtype float32 --draft-dtype bfloat16 --prepare --batch 4 \
        --new-tokens 48 --widths 2 --repeats 2
    python benchmarks/call_decomposition.py --smoke

One call each of stock `generate`, spec_adapt at γ = 0 and with the draft at fixed widths (the 0.5B for the Qwen
target, prompt lookup for the others), on the first `--batch` prompts of the workload; prints wall time, the loop's
prefill and step times, each path's median step and the draft's first catch-up (a draft model is fed the prompts at
its first proposal). Single samples: run it twice.
"""

from __future__ import annotations

import argparse
import time

import torch

import spec_adapt
from spec_adapt import FixedLength, ModelDrafter, PromptLookupDrafter
from spec_adapt.tools.models import load_model
from spec_adapt.recipes import workloads

import _smoke


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--draft-dtype", help="the 0.5B draft's dtype (default: --dtype)")
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--workload", default="humaneval-chat")
    p.add_argument("--prepare", action="store_true", help="spec_adapt.prepare the target (and the draft)")
    p.add_argument("--widths", type=int, nargs="*", default=[1, 2, 3], help="fixed draft widths to run")
    p.add_argument("--repeats", type=int, default=1, help="rounds of every path, interleaved")
    p.add_argument("--adaptive", action="store_true", help="also run the draft under Adaptive")
    _smoke.add(p)
    args = _smoke.apply(p.parse_args(), globals(), batch=2, new_tokens=8, dtype="float32", widths=[2], adaptive=True)
    dtype = getattr(torch, args.dtype)
    model, tok = load_model(args.model, dtype=dtype)
    if args.prepare:
        spec_adapt.prepare(model)
    if args.model == "qwen2.5-coder-1.5b":
        draft = load_model("qwen2.5-coder-0.5b", dtype=getattr(torch, args.draft_dtype or args.dtype))[0]
        if args.prepare:
            spec_adapt.prepare(draft)
        drafter = lambda: ModelDrafter(draft)      # noqa: E731
    else:
        drafter = PromptLookupDrafter
    ds = workloads.with_inputs(workloads.load(args.workload, args.batch), tok)
    batch = tok(list(ds["input_text"])[: args.batch], return_tensors="pt", padding=True)
    print("prompt batch", tuple(batch.input_ids.shape))
    with torch.no_grad():
        for _ in range(2):
            start = time.perf_counter()
            model(**batch)
            print(f"target prefill alone: {time.perf_counter() - start:.2f} s")

    def stock():
        times = []
        hook = model.register_forward_pre_hook(lambda *a: times.append(time.perf_counter()))
        start = time.perf_counter()
        try:
            model.generate(**batch, max_new_tokens=args.new_tokens, do_sample=False)
        finally:
            hook.remove()
        gaps = sorted(b - a for a, b in zip(times[1:], times[2:]))       # decode forwards, start to start
        print(f"{'stock generate':16s} wall {time.perf_counter() - start:.2f} s, {len(times)} forwards, median "
              f"decode step {1000 * gaps[len(gaps) // 2]:.1f} ms")

    def ours(label, **kw):
        stats = spec_adapt.SpecStats()
        start = time.perf_counter()
        model.generate(**batch, max_new_tokens=args.new_tokens, do_sample=False, custom_generate=spec_adapt.generate,
                       spec_stats=stats, **kw)
        wall = time.perf_counter() - start
        steps = sum(r.step_time for r in stats.trace)
        median = sorted(r.step_time for r in stats.trace)[len(stats.trace) // 2]
        first = next((r.draft_time for r in stats.trace if r.draft_time > 0), 0.0)
        print(f"{label:16s} wall {wall:.2f} s: prefill {stats.time_prefill:.2f}, {len(stats.trace)} steps "
              f"{steps:.2f} (draft {stats.time_draft:.2f}, of which the first drafting step {first:.2f}; verify "
              f"{stats.time_verify:.2f}), median step {1000 * median:.1f} ms")

    adaptive = spec_adapt.Adaptive()
    for _ in range(args.repeats):
        stock()
        ours("spec γ=0", assistant_policy=FixedLength(0))
        for gamma in args.widths:
            ours(f"draft fixed{gamma}", drafter=drafter(), assistant_policy=FixedLength(gamma))
        if args.adaptive:
            ours("draft adaptive", drafter=drafter(), assistant_policy=adaptive)
    stock()


if __name__ == "__main__":
    main()
