"""torch.compile (Inductor, CPU freezing and weight prepacking) as the execution path for speculation: what it costs.

Measures, for one model: the compile time of the first forward, the recompiles a speculative generate call triggers
(its forwards vary in width and in cache length), the step times after warm-up, and whether greedy output matches
stock generate run on the same compiled model. `spec_adapt.prepare` is the alternative it is weighed against.

    python benchmarks/compile_path.py --model smollm2-135m --new-tokens 24
    python benchmarks/compile_path.py --smoke        # a tiny model, dynamo with the eager backend (no Inductor)
"""

from __future__ import annotations

import argparse
import time

import torch

import spec_adapt
from spec_adapt import FixedLength, PromptLookupDrafter
from spec_adapt.tools.models import load_model

import _smoke


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend")
    _smoke.add(parser)
    args = _smoke.apply(parser.parse_args(), globals(), new_tokens=4, backend="eager")
    import torch._dynamo as dynamo
    import torch._inductor.config as inductor

    inductor.freezing = True                     # constant-fold weights and prepack them (the CPU path)
    model, tok = load_model(args.model)
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    enc = tok([prompt], return_tensors="pt")
    kwargs = dict(do_sample=False, max_new_tokens=args.new_tokens, pad_token_id=tok.eos_token_id)
    with torch.no_grad():
        eager_ref = model.generate(**enc, **kwargs)
    counts = dynamo.utils.counters
    model.forward = torch.compile(model.forward, dynamic=True, backend=args.backend)
    with torch.no_grad():
        start = time.perf_counter()
        stock = model.generate(**enc, **kwargs)
        first = time.perf_counter() - start
        frames = dict(counts["stats"])
        start = time.perf_counter()
        stock_again = model.generate(**enc, **kwargs)
        warm = time.perf_counter() - start
        start = time.perf_counter()
        ours = model.generate(**enc, **kwargs, custom_generate=spec_adapt.generate,
                              drafter=PromptLookupDrafter(), assistant_policy=FixedLength(4))
        spec_first = time.perf_counter() - start
        after = dict(counts["stats"])
        start = time.perf_counter()
        model.generate(**enc, **kwargs, custom_generate=spec_adapt.generate, drafter=PromptLookupDrafter(),
                       assistant_policy=FixedLength(4))
        spec_warm = time.perf_counter() - start
    print(f"model {args.model}, backend {args.backend}, {args.new_tokens} new tokens, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"stock generate, first call (compiles): {first:.1f} s; warm: {warm:.2f} s")
    print(f"dynamo frames after stock: {frames}")
    print(f"spec_adapt first call: {spec_first:.1f} s; warm: {spec_warm:.2f} s; dynamo frames after: {after}")
    print(f"recompiles: {dict(counts['recompiles']) if 'recompiles' in counts else 'n/a'}")
    print(f"stock compiled == stock eager: {torch.equal(stock, eager_ref)}; warm stock == first: "
          f"{torch.equal(stock, stock_again)}; spec_adapt == stock compiled: {torch.equal(ours, stock)}")


if __name__ == "__main__":
    main()
