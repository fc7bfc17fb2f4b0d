"""The soak: a serving engine runs many requests from its background thread, and what it holds must not grow.

`run_soak` serves `requests` requests on a tiny random-weight Llama (a draft model perturbed from it, prompt lookup
or a suffix index as the drafter; the default Adaptive policy or a fixed width), keeping `2 * max_batch` requests
in flight from the caller's thread. Every `window` finished requests it records the process's resident memory, the
seconds per request and per engine step. Every `check_every`-th request is compared with stock greedy `generate` on
its prompt alone, after the soak (so the check does not compete with the engine for the CPU). `spec-adapt soak` runs
it and plots memory and time against requests served.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections import deque

import torch
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from ..drafters.lookup import PromptLookupDrafter
from ..drafters.model import ModelDrafter
from ..drafters.suffix import SuffixDrafter
from ..serving.engine import Engine
from .bench import parse_policy
from .synthetic import perturbed_copy

PAD, BOS, EOS = 0, 1, 2


def tiny_target(vocab: int = 256, seed: int = 0):
    """A 2-layer random Llama whose greedy choices are clear-cut (a scaled-up output head, like a trained LM)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def make_drafter(kind: str, target):
    if kind == "model":
        return ModelDrafter(perturbed_copy(target, 0.3, seed=1))
    if kind == "lookup":
        return PromptLookupDrafter(3, 1)
    if kind == "suffix":
        return SuffixDrafter()
    raise ValueError(f"soak drafter is model, lookup or suffix, got {kind!r}")


def rss_mb() -> float:
    """The process's resident memory now (psutil, as serve-bench reads it)."""
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def workload(n: int, vocab: int, seed: int):
    """n (prompt, budget) pairs: prompts of 4-24 tokens, a few with repeats (lookup finds matches), budgets 4-32."""
    rng = random.Random(seed)
    for _ in range(n):
        body = [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 13))]
        prompt = body * 2 if rng.random() < 0.5 else body
        yield prompt, rng.randrange(4, 33)


def run_soak(requests: int = 20000, max_batch: int = 8, drafter: str = "model", window: int = 500,
             check_every: int = 100, seed: int = 0, progress: bool = True, policy: str = "adaptive") -> dict:
    for name, value in (("requests", requests), ("max_batch", max_batch), ("window", window),
                        ("check_every", check_every)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"run_soak needs {name} to be a positive int, got {value!r}.")
    target = tiny_target(seed=seed)
    # policy: a bench name; `adaptive` keeps learning while it serves, `fixed<k>` shows what the engine itself costs.
    engine = Engine(target, drafter=make_drafter(drafter, target), assistant_policy=parse_policy(policy),
                    max_batch=max_batch, eos_token_id=EOS, pad_token_id=PAD).start()
    jobs, flying, samples, windows = workload(requests, target.config.vocab_size, seed), deque(), [], []
    done, mark, counts = 0, time.perf_counter(), (0, 0, 0)
    bar = tqdm(total=requests, unit="req", disable=not progress, desc=f"soak ({drafter} drafter)")
    try:
        while done < requests:
            while len(flying) < 2 * max_batch and (job := next(jobs, None)) is not None:
                flying.append((job, engine.submit(job[0], max_new_tokens=job[1])))
            (prompt, budget), handle = flying.popleft()
            tokens = handle.result(timeout=120)
            if done % check_every == 0:
                samples.append((prompt, budget, tokens))
            done += 1
            bar.update(1)
            if done % window == 0:
                now, stats = time.perf_counter(), engine.stats
                steps, drafted, tokens = (stats.steps - counts[0], stats.drafted - counts[1],
                                          stats.step_tokens - counts[2])
                gc.collect()
                windows.append({"served": done, "rss_mb": round(rss_mb(), 2),
                                "ms_per_request": round(1e3 * (now - mark) / window, 4),
                                "ms_per_step": round(1e3 * (now - mark) / max(steps, 1), 4), "steps": steps,
                                "drafted_per_step": round(drafted / max(steps, 1), 3),
                                "tokens_per_step": round(tokens / max(steps, 1), 3)})
                bar.set_postfix(rss=f"{windows[-1]['rss_mb']:.0f}MB", ms_req=windows[-1]["ms_per_request"])
                mark, counts = time.perf_counter(), (stats.steps, stats.drafted, stats.step_tokens)
    finally:
        bar.close()
        engine.stop()
    identical = sum(tokens == _stock(target, prompt, budget) for prompt, budget, tokens in samples)
    return {"requests": requests, "max_batch": max_batch, "drafter": drafter, "policy": policy, "window": window,
            "windows": windows, "checked": len(samples), "identical": identical,
            "restarts": engine.stats.restarts, "fallback": engine.fallback,
            "drafted": engine.stats.drafted, "accepted": engine.stats.accepted, **_verdict(windows)}


def _stock(model, prompt, budget) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=budget, eos_token_id=EOS, pad_token_id=PAD)
    return out[0, len(prompt):].tolist()


def _verdict(windows: list[dict], warm: int = 2000) -> dict:
    """RSS growth from the first window at or after `warm` requests to the end, and the time per request of the last
    quarter of windows against the first quarter after warm-up (medians)."""
    after = [w for w in windows if w["served"] >= warm] or windows
    if not after:
        return {}
    quarter = max(1, len(after) // 4)
    first = statistics.median(w["ms_per_request"] for w in after[:quarter])
    last = statistics.median(w["ms_per_request"] for w in after[-quarter:])
    return {"rss_growth_mb": round(after[-1]["rss_mb"] - after[0]["rss_mb"], 2),
            "rss_from": after[0]["served"], "time_ratio_last_to_first": round(last / first, 4)}


def plot(report: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    windows = report["windows"]
    served = [w["served"] for w in windows]
    fig, (mem, speed, policy) = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    mem.plot(served, [w["rss_mb"] for w in windows], marker=".")
    mem.set_ylabel("resident memory (MB)")
    speed.plot(served, [w["ms_per_request"] for w in windows], marker=".", label="ms per request")
    speed.plot(served, [w["ms_per_step"] for w in windows], marker=".", label="ms per engine step")
    speed.set_ylabel("milliseconds")
    speed.legend()
    policy.plot(served, [w["drafted_per_step"] for w in windows], marker=".", label="draft tokens per step")
    policy.plot(served, [w["tokens_per_step"] for w in windows], marker=".", label="tokens committed per step")
    policy.set_ylabel("tokens (whole batch)")
    policy.set_xlabel("requests served")
    policy.legend()
    fig.suptitle(f"Engine soak: {report['requests']} requests, max_batch {report['max_batch']}, "
                 f"{report['drafter']} drafter, {report['policy']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
