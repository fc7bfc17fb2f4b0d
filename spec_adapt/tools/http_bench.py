"""The load client for OpenAI-compatible servers (`spec-adapt serve`, `transformers serve`, vLLM, ...): streamed chat
completions through the `openai` client, closed-loop at fixed concurrencies and open-loop under Poisson arrivals.

Per load it reports output tokens/s (all tokens over the first send to the last finish), time to first token (from
the scheduled send, so queueing counts) and time per output token after the first (p50, p90, p99), requests answered,
refused (429) and failed. From a spec_adapt server it also reads `/metrics` before and after each load: per drafting
source the drafted and accepted tokens, and the widths the policy chose.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
import urllib.request


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


async def one(client, model: str, prompt: str, new_tokens: int, sent: float) -> dict:
    """One streamed chat request: its first-token and end times, and the tokens it got (usage, else chunks)."""
    first, chunks, usage = None, 0, None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=new_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].delta.content:
                chunks += 1
                first = first or time.perf_counter()
    except Exception as exc:  # noqa: BLE001 - a refused or failed request is counted, not raised
        status = getattr(exc, "status_code", None)
        return {"status": "refused" if status == 429 else "failed", "error": f"{type(exc).__name__}: {exc}"[:200]}
    end = time.perf_counter()
    tokens = usage if usage is not None else chunks
    return {"status": "ok", "ttft": (first or end) - sent, "end": end, "tokens": tokens,
            "tpot": (end - first) / (tokens - 1) if first and tokens > 1 else None, "sent": sent}


async def closed_loop(client, model, prompts, new_tokens, concurrency: int, requests: int) -> list[dict]:
    """`concurrency` clients, each sending its next request when its last one ends, `requests` in all."""
    order = iter(range(requests))
    results = []

    async def worker():
        for i in order:
            results.append(await one(client, model, prompts[i % len(prompts)], new_tokens, time.perf_counter()))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def open_loop(client, model, prompts, new_tokens, rate: float, requests: int, seed: int = 0) -> list[dict]:
    """`requests` sent at Poisson arrivals of `rate` per second, whatever the answers."""
    rng, start, tasks, t = random.Random(seed), time.perf_counter(), [], 0.0
    for i in range(requests):
        t += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
        tasks.append(asyncio.create_task(one(client, model, prompts[i % len(prompts)], new_tokens, start + t)))
    return list(await asyncio.gather(*tasks))


def summarize(results: list[dict]) -> dict:
    ok = [r for r in results if r["status"] == "ok"]
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    span = max(r["end"] for r in ok) - min(r["sent"] for r in ok) if ok else 0.0
    out = {"requests": len(results), "answered": len(ok),
           "refused": sum(r["status"] == "refused" for r in results),
           "failed": sum(r["status"] == "failed" for r in results),
           "tokens": sum(r["tokens"] for r in ok), "tokens_per_s": sum(r["tokens"] for r in ok) / span if span else 0.0}
    for name, values in (("ttft", ttft), ("tpot", tpot)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = percentile(values, q)
    out["tpot_mean"] = statistics.fmean(tpot) if tpot else None
    return out


def scrape(url: str) -> dict:
    """The server's /metrics samples (name with labels -> value), or {} where it has none."""
    try:
        text = urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10).read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and " " in line:
            name, value = line.rsplit(" ", 1)
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


def speculation(before: dict, after: dict) -> dict:
    """What the server drafted and accepted during one load (the difference of two scrapes), per source."""
    delta = {k: after[k] - before.get(k, 0.0) for k in after if k.startswith("spec_adapt_spec_decode_")
             and "acceptance_length" not in k}
    out = {}
    for key, value in delta.items():
        family, _, label = key.partition("{")
        out.setdefault(family.replace("spec_adapt_spec_decode_", ""), {})[label.rstrip("}") or "all"] = value
    return out


def run(url: str, model: str, prompts: list[str], new_tokens: int, concurrencies=(1, 4, 16), rates=(),
        requests_per_load: int = 16, seed: int = 0, progress=None) -> list[dict]:
    """Every load against one server: closed loops at `concurrencies`, open loops at `rates`. Rows of results."""
    from openai import AsyncOpenAI

    loads = [("concurrency", c) for c in concurrencies] + [("rate", r) for r in rates]
    rows = []

    async def main():
        client = AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key="none", max_retries=0, timeout=3600)
        used = 0
        for kind, value in loads:
            before = scrape(url)
            n = max(requests_per_load, int(value)) if kind == "concurrency" else requests_per_load
            # Each load its own prompts (the next n, cycling only when the list runs out): a server that learns
            # from what it answered (the suffix index) is not handed the answers of an earlier load.
            batch = [prompts[(used + i) % len(prompts)] for i in range(n)]
            used += n
            if kind == "concurrency":
                results = await closed_loop(client, model, batch, new_tokens, int(value), n)
            else:
                results = await open_loop(client, model, batch, new_tokens, value, n, seed)
            rows.append({"load": kind, "value": value, **summarize(results),
                         "speculation": speculation(before, scrape(url))})
            if progress is not None:
                progress(rows[-1])
        await client.close()

    asyncio.run(main())
    return rows
