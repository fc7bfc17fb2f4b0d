"""`spec-adapt serve-bench`: the serving engine under Poisson arrivals of real prompts, configurations side by side.

For each arrival rate one schedule is drawn (exponential gaps, prompts taken in order from the workload) and every
configuration serves exactly that schedule in this process, one after the other. The driver submits each request
when its arrival time has passed and runs engine steps in between (one thread: no scheduling noise from a second
one). Reported per (rate, configuration): output tokens/s over the whole run (first arrival to last finish), time
to first token and time per output token (p50, p99; TTFT counts from the scheduled arrival, so queueing is in it),
mean batch size and mean γ; plots of batch size and γ over time.

Configuration names are the bench's: `target` (the engine with no drafter: continuous batching, plain decoding) and
`<drafter>:<policy>` (drafter in none, lookup, suffix, draft, draftc, wrong, chain; policy as in `spec-adapt bench`).
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from pathlib import Path

import torch


def schedule(rate: float, duration: float, n_prompts: int, seed: int = 0) -> list[tuple[float, int]]:
    """(arrival second, prompt index) of a Poisson process at `rate` requests/s over `duration` seconds."""
    if not (0 < rate < math.inf and 0 <= duration < math.inf):      # else the draws never pass `duration`
        raise ValueError(f"A schedule needs a finite positive rate and a finite duration, got rate {rate!r} and "
                         f"duration {duration!r}.")
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t > duration:
            return out
        out.append((t, len(out) % n_prompts))


def phased_schedule(phases: list[tuple[float, float]], n_prompts: int, seed: int = 0) -> list[tuple[float, int]]:
    """Poisson arrivals whose rate changes: `phases` = [(requests/s, seconds), ...] one after the other."""
    rng, out, begin = random.Random(seed), [], 0.0
    for rate, seconds in phases:
        t = begin
        while True:
            t += rng.expovariate(rate)
            if t > begin + seconds:
                break
            out.append((t, len(out) % n_prompts))
        begin += seconds
    return out


def parse_phases(text: str) -> list[tuple[float, float]]:
    """"0.1:30,1.5:30,0.1:30" -> [(0.1, 30.0), (1.5, 30.0), (0.1, 30.0)]."""
    try:
        phases = [(float(r), float(d)) for r, d in (part.split(":") for part in text.split(","))]
    except ValueError as exc:
        raise ValueError(f"--phases takes RATE:SECONDS pairs joined by commas (e.g. 0.1:30,1.5:30), got {text!r}."
                         ) from exc
    # nan and inf are floats too: a phase must end, and its arrivals must have gaps.
    if not phases or not all(0 < r < math.inf and 0 < d < math.inf for r, d in phases):
        raise ValueError(f"Every phase needs a finite positive rate and duration, got {text!r}.")
    return phases


def build_engine(config: str, model, tok, draft, max_batch: int, new_tokens: int, latency=None, memory=None):
    from .bench import drafter_factory, parse_policy
    from ..policies.fixed import FixedLength
    from ..serving.engine import Engine

    if config == "target":
        drafter, policy = None, FixedLength(0)
    else:
        drafter_name, _, policy_name = config.partition(":")
        drafter, policy = drafter_factory(drafter_name, tok, draft)(), parse_policy(policy_name or "adaptive", latency)
    from ..serving.memory import MemoryBudget

    budget = MemoryBudget(memory) if memory is not None else None
    return Engine(model, drafter=drafter, assistant_policy=policy, max_batch=max_batch, max_new_tokens=new_tokens,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, memory=budget, timeline=True)


def serve(engine, prompts: list[torch.Tensor], arrivals: list[tuple[float, int]]) -> dict:
    """Run one schedule to completion; per-request and per-step measurements."""
    import psutil

    process = psutil.Process()
    engine.record_timeline()                                  # the measurements read the timeline and the trace
    start, pending, handles, rss = time.perf_counter(), list(arrivals), [], []
    while pending or any(not h.done for h, _ in handles):
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            at, index = pending.pop(0)
            handles.append((engine.submit(prompts[index]), at))
        steps = len(engine.timeline)
        if not engine.step() and pending:                     # idle until the next arrival
            time.sleep(max(0.0, min(pending[0][0] - (time.perf_counter() - start), 0.05)))
        if len(engine.timeline) > steps:
            rss.append(process.memory_info().rss)
    end = time.perf_counter()
    drafter = engine.loop.given_drafter
    if getattr(drafter, "offloaded", False):                 # the draft's weights are shared with later configs
        drafter.reload()
    ttft, tpot, tokens = [], [], 0
    for handle, at in handles:
        n = len(handle.tokens)
        tokens += n
        ttft.append(handle.first_token - (start + at))
        if n > 1:
            tpot.append((handle.finished - handle.first_token) / (n - 1))
    steps = [{"t": s["time"] - start, "batch_size": s["batch_size"], "gamma": max(s["gammas"], default=0),
              "waiting": s["waiting"], "draft_resident": s["draft_resident"], "rss_mb": m / 2**20}
             for s, m in zip(engine.timeline, rss)]
    first = start + arrivals[0][0] if arrivals else start
    return {
        "requests": len(handles), "tokens": tokens, "tok_s": tokens / max(end - first, 1e-9),
        "ttft_p50": _quantile(ttft, 0.5), "ttft_p99": _quantile(ttft, 0.99),
        "tpot_p50": _quantile(tpot, 0.5), "tpot_p99": _quantile(tpot, 0.99),
        "mean_batch": statistics.fmean(s["batch_size"] for s in steps) if steps else 0.0,
        "mean_gamma": statistics.fmean(s["gamma"] for s in steps) if steps else 0.0,
        "resident_share": statistics.fmean(s["draft_resident"] for s in steps) if steps else 0.0,
        "offloads": sum(e["event"] == "offload" for e in getattr(drafter, "events", [])),
        "fallback": engine.fallback, "steps": steps,
    }


def run_serve_bench(model, tok, prompts, configs, rates, duration, max_batch, new_tokens, draft=None, seed=0,
                    latency=None, progress=True, memory=None, phases=None) -> list[dict]:
    """`rates`: one Poisson schedule of `duration` seconds per rate; or `phases` ([(rate, seconds), ...]): one
    schedule whose rate changes (labelled by its phases). `memory`: a byte budget per engine (MemoryBudget)."""
    from tqdm import tqdm

    encoded = [tok(p, return_tensors="pt").input_ids[0] for p in prompts]
    results = []
    loads = [",".join(f"{r:g}:{d:g}" for r, d in phases)] if phases else list(rates)
    cells = [(load, config) for load in loads for config in configs]
    warm = build_engine(configs[-1], model, tok, draft, max_batch, new_tokens, latency, memory)
    serve(warm, encoded, [(0.0, 0)])                          # warm-up: first-call costs out of the table
    for rate, config in tqdm(cells, desc="serve-bench", disable=not progress):
        arrivals = phased_schedule(phases, len(encoded), seed) if phases else schedule(rate, duration, len(encoded),
                                                                                       seed)
        if not arrivals:
            raise ValueError(f"No request arrives within {duration} s at {rate} requests/s (seed {seed}): raise "
                             "--duration or the rate.")
        engine = build_engine(config, model, tok, draft, max_batch, new_tokens, latency, memory)
        out = serve(engine, encoded, arrivals)
        results.append({"rate": rate, "config": config, **out})
    return results


def summary_rows(results: list[dict]) -> list[dict]:
    base = {r["rate"]: r["tok_s"] for r in results if r["config"] == "target"}
    return [{k: v for k, v in r.items() if k != "steps"} | {"speedup": r["tok_s"] / base[r["rate"]]
                                                             if base.get(r["rate"]) else None} for r in results]


def write(results, out_dir: Path, meta: dict) -> list[dict]:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summary_rows(results)
    (out_dir / "summary.json").write_text(json.dumps({"meta": meta, "summary": rows}, indent=1))
    (out_dir / "timeline.json").write_text(json.dumps(
        [{"rate": r["rate"], "config": r["config"], "steps": r["steps"]} for r in results]))
    _plot(results, out_dir, meta)
    return rows


def replot(out_dir: Path) -> None:
    """Draw serve.png again from a run's summary.json and timeline.json."""
    out_dir = Path(out_dir)
    saved = json.loads((out_dir / "summary.json").read_text())
    steps = {(t["rate"], t["config"]): t["steps"] for t in json.loads((out_dir / "timeline.json").read_text())}
    results = [{"offloads": 0, **r, "steps": steps[(r["rate"], r["config"])]} for r in saved["summary"]]
    _plot(results, out_dir, saved["meta"])


def print_table(rows) -> None:
    print(f"{'rate':>5} {'config':<22} {'tok/s':>7} {'speedup':>8} {'TTFT p50/p99 s':>16} {'TPOT p50/p99 ms':>17}"
          f" {'batch':>6} {'γ':>5}")
    for r in rows:
        speed = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        print(f"{r['rate']:>5} {r['config']:<22} {r['tok_s']:>7.1f} {speed:>8} "
              f"{r['ttft_p50']:>7.2f}/{r['ttft_p99']:<7.2f} {1000 * r['tpot_p50']:>8.1f}/{1000 * r['tpot_p99']:<7.1f}"
              f" {r['mean_batch']:>6.2f} {r['mean_gamma']:>5.2f}"
              + (f"  draft resident {r['resident_share']:.0%}, {r['offloads']} offloads" if r["offloads"] else "")
              + (f"  fallback: {r['fallback']}" if r["fallback"] else ""))


def _plot(results, out_dir, meta) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(dict.fromkeys(r["rate"] for r in results))
    residency = any(r["offloads"] for r in results)      # a third row when a draft left and came back
    fig, axes = plt.subplots(3 if residency else 2, len(rates), figsize=(5 * len(rates) + 3 * (len(rates) == 1),
                                                                          8 if residency else 6), squeeze=False)
    colors = {c: f"C{i}" for i, c in enumerate(dict.fromkeys(r["config"] for r in results))}
    for col, rate in enumerate(rates):
        for r in (r for r in results if r["rate"] == rate):
            t, style = [s["t"] for s in r["steps"]], {"label": r["config"], "lw": 0.8, "color": colors[r["config"]]}
            axes[0][col].plot(t, [s["batch_size"] for s in r["steps"]], **style)
            axes[1][col].plot(t, [s["gamma"] for s in r["steps"]], **style)
            if residency and r["config"] != "target":
                axes[2][col].step(t, [int(s["draft_resident"]) for s in r["steps"]], **style)
        axes[0][col].set(title=f"{rate} req/s", ylabel="batch size")
        axes[1][col].set(xlabel="seconds", ylabel="γ (widest row)")
        if residency:
            axes[2][col].set(xlabel="seconds", ylabel="draft resident", yticks=[0, 1])
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"serve-bench: {meta.get('model')} on {meta.get('workload')}, max batch {meta.get('max_batch')}")
    fig.tight_layout()
    fig.savefig(out_dir / "serve.png", dpi=110)


def _quantile(values, q) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]
