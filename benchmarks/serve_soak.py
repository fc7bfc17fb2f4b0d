"""`spec-adapt serve` under a load above its capacity for a long time: resident memory, requests lost, requests hung.

    python benchmarks/serve_soak.py --seconds 600 --rate 40 --out results/soak-tiny/http
    python benchmarks/serve_soak.py --smoke

The server (a tiny random-weight pair with a draft model beside prompt lookup and the suffix index, max batch 8,
64 waiting) gets Poisson arrivals of greedy streamed and non-streamed chat and completion requests at `--rate` per
second through the `openai` client, above what it finishes, for `--seconds`. Every request ends in an answer,
a 429 (the queue is full) or a failure; a request with no end after `--timeout` seconds counts as hung.
`--drafter lookup` serves without the draft model and the suffix index, which grows with the tokens served up to
its bound (`SuffixIndex.max_contexts`; /metrics reports its size, sampled beside the memory). Every 10 s
the server process's resident memory is read (psutil); the report gives its least-squares slope over the second
half of the run, the counts, and soak.png (memory and requests over time). Writes soak.json beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import _smoke


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (x, y) points."""
    n = len(points)
    if n < 2:
        return 0.0
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0


async def soak(url: str, seconds: float, rate: float, timeout: float, proc_pid: int) -> dict:
    import psutil
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=timeout)
    rng, counts, memory, tasks = random.Random(0), {"sent": 0, "answered": 0, "refused": 0, "failed": 0,
                                                     "hung": 0}, [], []
    process, start = psutil.Process(proc_pid), time.perf_counter()

    async def request(i: int):
        words = " ".join(rng.choice(["alpha", "beta", "gamma", "def", "return", "x", "=", "1"]) for _ in range(12))
        try:
            if i % 2:
                stream = await client.chat.completions.create(
                    model="served", messages=[{"role": "user", "content": words}], max_tokens=32, temperature=0,
                    stream=True)
                async for _ in stream:
                    pass
            else:
                await client.completions.create(model="served", prompt=words, max_tokens=32, temperature=0)
            counts["answered"] += 1
        except Exception as exc:  # noqa: BLE001 - counted by kind
            status = getattr(exc, "status_code", None)
            kind = "refused" if status == 429 else "hung" if "Timeout" in type(exc).__name__ else "failed"
            counts[kind] += 1

    async def sample():
        while time.perf_counter() - start < seconds:
            memory.append((time.perf_counter() - start, process.memory_info().rss / 2**20,
                           {**counts, "suffix_contexts": suffix_contexts(url)}))
            await asyncio.sleep(min(10.0, seconds / 10))

    sampler = asyncio.create_task(sample())
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t > seconds:
            break
        await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
        counts["sent"] += 1
        tasks.append(asyncio.create_task(request(counts["sent"])))
    await asyncio.gather(*tasks)
    await sampler
    memory.append((time.perf_counter() - start, process.memory_info().rss / 2**20,
                   {**counts, "suffix_contexts": suffix_contexts(url)}))
    await client.close()
    half = [(x, y) for x, y, _ in memory if x >= seconds / 2]
    return {"seconds": seconds, "rate": rate, **counts, "lost": counts["sent"] - sum(
        counts[k] for k in ("answered", "refused", "failed", "hung")),
        "rss_mib_first": memory[0][1], "rss_mib_last": memory[-1][1],
        "rss_slope_mib_per_hour_second_half": slope(half) * 3600, "samples": memory}


def suffix_contexts(url: str) -> float:
    from spec_adapt.tools.http_bench import scrape

    return scrape(url).get("spec_adapt_suffix_index_contexts", 0.0)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [x for x, _, _ in report["samples"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(xs, [y for _, y, _ in report["samples"]], "o-")
    a.set(xlabel="seconds", ylabel="server resident memory (MiB)", title="memory under overload")
    contexts = [c.get("suffix_contexts", 0) for _, _, c in report["samples"]]
    if any(contexts):
        twin = a.twinx()
        twin.plot(xs, [c / 1000 for c in contexts], "s--", color="tab:orange")
        twin.set_ylabel("suffix index contexts (thousands, dashed)")
    for key in ("sent", "answered", "refused"):
        b.plot(xs, [c[key] for _, _, c in report["samples"]], label=key)
    b.set(xlabel="seconds", ylabel="requests", title="requests over time")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--rate", type=float, default=40.0, help="requests per second (above what it finishes)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--drafter", choices=["default", "lookup"], default="default",
                   help="default: the draft model beside prompt lookup and the suffix index; lookup: prompt lookup alone")
    p.add_argument("--out", default="results/soak-tiny/http")
    _smoke.add(p)
    args = p.parse_args()
    if args.smoke:
        args = _smoke.apply(args, seconds=4.0, rate=4.0, out=_smoke.folder())
    sys.path.insert(0, str(Path(__file__).parent))
    from serve_http import free_port, wait_healthy

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    folder = out / "tiny-pair"
    _smoke.target().save_pretrained(folder)
    _smoke.tokenizer().save_pretrained(folder)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(out / "soak-server.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "spec_adapt.tools.cli", "serve", "--model", str(folder),
                                 *(["--draft", str(folder)] if args.drafter == "default" else ["--drafter", "lookup"]),
                                 "--served-name", "served", "--port", str(port),
                                 "--max-batch", "8", "--max-waiting", "64"], stdout=log, stderr=log,
                                env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        try:
            wait_healthy(url, proc)
            report = asyncio.run(soak(url, args.seconds, args.rate, args.timeout, proc.pid))
        finally:
            proc.terminate()
            report_exit = proc.wait(60)
    from spec_adapt.tools.cli import cpu_name

    report.update(drafter=args.drafter, command="python " + " ".join(sys.argv), cpu=cpu_name(), server_exit=report_exit)
    (out / "soak.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "soak.png")
    print({k: v for k, v in report.items() if k != "samples"})
    assert report["lost"] == 0 and report["hung"] == 0 and report["failed"] == 0 and report_exit == 0, report


if __name__ == "__main__":
    main()
