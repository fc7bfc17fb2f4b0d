"""Per-forward cost of the real pair on this machine: the 1.5B target at widths 1/2/4/8 (cached context of 150
tokens) and the 0.5B draft at width 1, batch 1 and 4, median of 7.

    python benchmarks/forward_costs.py float32
    python benchmarks/forward_costs.py bfloat16
"""
import time, torch, sys
from spec_adapt.tools.models import load_model
from transformers import DynamicCache
dt = getattr(torch, sys.argv[1])
tgt, tok = load_model("qwen2.5-coder-1.5b", dtype=dt)
dr, _ = load_model("qwen2.5-coder-0.5b", dtype=dt)
ids = torch.randint(100, 5000, (1, 150))
def bench(m, w, n=7, b=1):
    with torch.no_grad():
        x0 = ids.repeat(b, 1)
        c = DynamicCache(config=m.config); m(x0, past_key_values=c, use_cache=True)
        ts=[]
        for i in range(n):
            x = torch.randint(100, 1000, (b, w))
            t=time.perf_counter(); m(x, past_key_values=c, use_cache=True, logits_to_keep=w); ts.append(time.perf_counter()-t)
            c.crop(-w)
    return sorted(ts)[n//2]
for b in (1, 4):
    r = {w: bench(tgt, w, b=b) for w in (1, 2, 4, 8)}
    d = bench(dr, 1, b=b)
    print(sys.argv[1], "B", b, "target", {w: round(v*1000) for w, v in r.items()}, "draft w1", round(d*1000), "c", round(d/r[1], 2))
