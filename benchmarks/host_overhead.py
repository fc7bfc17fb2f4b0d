"""Host overhead of the speculative loop: a model whose forward costs almost nothing, so what is timed is the loop.

    python benchmarks/host_overhead.py --out results/execution/host-overhead-cpu.json
    python benchmarks/host_overhead.py --smoke

A 2-layer, 32-wide random Llama generates 200 new tokens (no EOS) at batch 1 and 8, greedy. Per configuration: ms
per generated token (wall time / (rows x new tokens)), the median of 5 repeats, configurations interleaved within a
repeat (one warm-up call each first), and the ratio to stock `generate`:

- `stock`: `model.generate`;
- `spec, no drafter`: spec_adapt with `drafter=None` (every step is a plain one-token step);
- `spec, width 0`: spec_adapt with a drafter and `FixedLength(0)` (the policy is asked, every step is plain);
- `spec, scripted w4`: a `ScriptedDrafter` that proposes the target's own greedy continuation (read from a stock
  run), `FixedLength(4)`: every draft is accepted, 5 tokens per target forward.

A width-0 step should cost what stock's decode step costs; the always-right drafter shows the most a width-4 step can
save when the forward is free. Printed with the CPU's name; `--out` writes the table as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import spec_adapt
from spec_adapt import FixedLength, ScriptedDrafter

import _smoke

VOCAB, PAD, BOS = 128, 0, 1


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=BOS, eos_token_id=None, pad_token_id=PAD)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)    # clear-cut greedy choices, like a trained model
    return model.eval()


def prompts(batch: int, length: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed + batch)
    ids = torch.randint(3, VOCAB, (batch, length), generator=gen)
    return ids, torch.ones_like(ids)


def stock(model, ids, mask, new_tokens):
    return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                          pad_token_id=PAD, eos_token_id=None)


def spec(model, ids, mask, new_tokens, drafter, policy):
    stats = spec_adapt.SpecStats()
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                         pad_token_id=PAD, eos_token_id=None, custom_generate=spec_adapt.generate, drafter=drafter,
                         assistant_policy=policy, spec_stats=stats)
    return out, stats


def right_script(reference: torch.Tensor):
    """script(row, context, gamma): the target's own greedy continuation of the row (prompts are unpadded)."""
    rows = [r.tolist() for r in reference]

    def script(row, context, gamma):
        return rows[row][len(context): len(context) + gamma]
    return script


def measure(model, batch: int, new_tokens: int, repeats: int) -> dict:
    ids, mask = prompts(batch)
    reference = stock(model, ids, mask, new_tokens)
    script = right_script(reference)
    configs = {
        "stock": lambda: (stock(model, ids, mask, new_tokens), None),
        "spec, no drafter": lambda: spec(model, ids, mask, new_tokens, None, FixedLength(0)),
        "spec, width 0": lambda: spec(model, ids, mask, new_tokens, ScriptedDrafter(script), FixedLength(0)),
        "spec, scripted w4": lambda: spec(model, ids, mask, new_tokens, ScriptedDrafter(script), FixedLength(4)),
    }
    times = {name: [] for name in configs}
    for name, run in configs.items():          # warm-up, and each output checked against stock
        out, stats = run()
        assert torch.equal(out, reference), f"{name}: output differs from stock generate"
        if name == "spec, scripted w4":
            assert stats.drafted and stats.accepted == stats.drafted, "the scripted drafter was not always right"
    for _ in range(repeats):
        for name, run in configs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    tokens = batch * new_tokens
    base = statistics.median(times["stock"])
    return {name: {"ms_per_token": 1e3 * statistics.median(t) / tokens,
                   "tokens_per_s": tokens / statistics.median(t),
                   "x_stock_time": statistics.median(t) / base,
                   "speedup": base / statistics.median(t),
                   "seconds": t} for name, t in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the forward is tiny; 1 is steadiest)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    _smoke.add(parser)
    args = _smoke.apply(parser.parse_args(argv), batch_sizes=[1, 2], new_tokens=8, repeats=1,
                        out=Path(_smoke.folder("host-overhead.json")))
    torch.set_num_threads(args.threads)
    model = tiny_llama()
    cpu = cpu_name()
    print(f"CPU: {cpu}; torch threads {args.threads}; {args.new_tokens} new tokens; median of {args.repeats} "
          "interleaved repeats")
    print(f"{'batch':>5}  {'configuration':<20} {'ms/token':>9} {'tokens/s':>9} {'x stock time':>13} {'speedup':>8}")
    results = {}
    with torch.inference_mode():
        for batch in args.batch_sizes:
            rows = measure(model, batch, args.new_tokens, args.repeats)
            results[str(batch)] = rows
            for name, r in rows.items():
                print(f"{batch:>5}  {name:<20} {r['ms_per_token']:9.3f} {r['tokens_per_s']:9.0f} "
                      f"{r['x_stock_time']:12.3f}x {r['speedup']:7.2f}x")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cpu": cpu, "threads": args.threads, "new_tokens": args.new_tokens,
                                        "repeats": args.repeats, "model": "llama, 2 layers, hidden 32, vocab 128",
                                        "results": results}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
