"""What a short draft head saves and what it misses (README, "A short draft head").

    python benchmarks/draft_head.py [--dtype bfloat16] [--prompts 32]
    python benchmarks/draft_head.py --smoke

1. Time of one batch-1 decode step of the 0.5B draft over a 150-token cache: the whole model, its body alone, and
   the vocabulary projection onto the whole vocabulary and onto the 16k/32k/64k lowest ids (median of 20).
2. Coverage: the share of the 0.5B's greedy answer tokens (48 per prompt) that a head of the k lowest ids scores,
   alone and with the prompt's and the special tokens, on HumanEval-chat and ShareGPT prompts 16 onwards (the bench
   uses the first 16).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from spec_adapt.compat import output_cache, with_cache

from spec_adapt.tools.models import load_model
from spec_adapt.recipes import workloads

import _smoke

SIZES = (16384, 32768, 65536)


def median_ms(fn, n=25, warm=5) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[warm:]) * 1000


def step_times(model, dtype) -> dict:
    out = model(input_ids=torch.randint(0, 1000, (1, 150)), use_cache=True, logits_to_keep=1)
    cache, token = output_cache(out), torch.tensor([[5]])

    def whole():
        model(input_ids=token, use_cache=True, logits_to_keep=1, **with_cache(model, cache))
        cache.crop(-1)

    def body():
        model.base_model(input_ids=token, use_cache=True, **with_cache(model.base_model, cache))
        cache.crop(-1)

    weight = model.get_output_embeddings().weight
    hidden = torch.randn(1, 1, weight.shape[1], dtype=dtype)
    times = {"whole step": median_ms(whole), "body": median_ms(body),
             "head, whole vocabulary": median_ms(lambda: torch.nn.functional.linear(hidden, weight))}
    for k in SIZES:
        rows = weight[:k].contiguous()
        times[f"head, {k} ids"] = median_ms(lambda: torch.nn.functional.linear(hidden, rows))
    return times


def coverage(model, tok, workload: str, n: int) -> dict:
    ds = workloads.with_inputs(workloads.load(workload, 16 + n), tok)
    prompts = list(ds["input_text"])[16:]
    special = torch.tensor(tok.all_special_ids)
    answers, context = [], []
    for i in range(0, len(prompts), 8):
        enc = tok(prompts[i:i + 8], return_tensors="pt", padding=True)
        out = model.generate(**enc, max_new_tokens=48, do_sample=False)
        for b in range(out.shape[0]):
            answer = out[b, enc.input_ids.shape[1]:]
            answers.append(answer[~torch.isin(answer, special)])          # padding after EOS is not an answer
            context.append(torch.cat([enc.input_ids[b][enc.attention_mask[b].bool()], special]))
    result = {}
    for k in SIZES:
        alone = torch.cat([a < k for a in answers]).float().mean()
        seen = torch.cat([(a < k) | torch.isin(a, c) for a, c in zip(answers, context)]).float().mean()
        result[k] = (float(alone), float(seen))
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=32)
    _smoke.add(p)
    args = _smoke.apply(p.parse_args(), globals(), dtype="float32", prompts=2)
    dtype = getattr(torch, args.dtype)
    model, tok = load_model("qwen2.5-coder-0.5b", dtype=dtype)
    tok.padding_side = "left"
    with torch.no_grad():
        for name, ms in step_times(model, dtype).items():
            print(f"{name:>24}: {ms:6.1f} ms")
        for workload in ("humaneval-chat", "sharegpt"):
            for k, (alone, seen) in coverage(model, tok, workload, args.prompts).items():
                print(f"{workload} {k} lowest ids: {alone:.1%} of answer tokens; with prompt + special: {seen:.1%}")


if __name__ == "__main__":
    main()
