"""One-token forward time of a model at batch 4, 3 and 2 over the same prompts (a ledger as the loop uses it), and at
batch 3 after a row left (`select_rows`): whether retiring finished rows makes the remaining rows' steps cheaper.

    python benchmarks/batch_shape.py --model smollm2-135m --workload sharegpt
    python benchmarks/batch_shape.py --smoke
"""

from __future__ import annotations

import argparse
import time

import torch

from spec_adapt.ledger import KVLedger
from spec_adapt.tools.models import load_model
from spec_adapt.recipes import workloads

import _smoke


def one_token_ms(ledger: KVLedger, repeats: int = 15) -> float:
    rows = ledger.slots.shape[0]
    times = []
    for _ in range(repeats):
        tokens = torch.randint(3, 1000, (rows, 1))
        start = time.perf_counter()
        with torch.no_grad():
            ledger.forward(tokens, torch.ones(rows, dtype=torch.long))
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[repeats // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--workload", default="sharegpt")
    p.add_argument("--first", type=int, default=4, help="index of the first of the 4 prompts")
    _smoke.add(p)
    args = _smoke.apply(p.parse_args(), globals())
    model, tok = load_model(args.model, dtype=getattr(torch, args.dtype))
    texts = list(workloads.with_inputs(workloads.load(args.workload, args.first + 4), tok)["input_text"])
    batch = tok(texts[args.first : args.first + 4], return_tensors="pt", padding=True)
    for rows in (4, 3, 2):
        ledger = KVLedger(model)
        with torch.no_grad():
            ledger.prefill(batch.input_ids[:rows], batch.attention_mask[:rows])
        print(f"B={rows}: {one_token_ms(ledger):.1f} ms per one-token step")
    ledger = KVLedger(model)
    with torch.no_grad():
        ledger.prefill(batch.input_ids, batch.attention_mask)
    ledger.select_rows(torch.tensor([0, 1, 2]))
    print(f"B=3 after a row left (select_rows): {one_token_ms(ledger):.1f} ms")


if __name__ == "__main__":
    main()
