"""Does compacting the target's KV holes sooner speed up serving at overload? Serves one Poisson schedule (SmolLM2,
ShareGPT, max batch 8, 3 requests/s for 10 s by default) with each configuration, twice in turn, with the ledger's
compaction threshold (share of holes) and minimum (holes) set on the command line; prints tokens per second.

    python benchmarks/serve_holes.py --threshold 0.5 --minimum 64     # the ledger's defaults
    python benchmarks/serve_holes.py --threshold 0.15 --minimum 8     # compact early
    python benchmarks/serve_holes.py --smoke
"""

from __future__ import annotations

import argparse
import inspect

import torch

import spec_adapt.ledger as ledger
from spec_adapt.recipes import workloads
from spec_adapt.tools import serve_bench as sb
from spec_adapt.tools.models import load_model

import _smoke


def compact_at(threshold: float, minimum: int) -> None:
    """Every KVLedger made from now on compacts at `threshold` and `minimum`."""
    original = ledger.KVLedger.__init__
    signature = inspect.signature(original)

    def patched(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments.update(compact_threshold=threshold, compact_min=minimum)
        original(*bound.args, **bound.kwargs)

    ledger.KVLedger.__init__ = patched


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threshold", type=float, default=0.5, help="compact when holes exceed this share")
    p.add_argument("--minimum", type=int, default=64, help="and are at least this many")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--rate", type=float, default=3.0)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--configs", nargs="+", default=["target", "lookup:adaptive"])
    _smoke.add(p)
    args = _smoke.apply(p.parse_args(), globals(), num_prompts=4, rate=8.0, duration=0.5, new_tokens=8)
    compact_at(args.threshold, args.minimum)
    torch.set_grad_enabled(False)
    model, tok = load_model(args.model)
    ds = workloads.with_inputs(workloads.load("sharegpt", args.num_prompts), tok)
    prompts = [tok(text, return_tensors="pt").input_ids[0] for text in ds["input_text"]]
    arrivals = sb.schedule(args.rate, args.duration, len(prompts), 0)
    for config in args.configs * 2:
        out = sb.serve(sb.build_engine(config, model, tok, None, 8, args.new_tokens), prompts, arrivals)
        print(args.threshold, args.minimum, config, round(out["tok_s"], 1), "tok/s")


if __name__ == "__main__":
    main()
