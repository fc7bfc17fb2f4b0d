"""Greedy agreement of the 1.5B target between fp32 and bf16 (stock generate, 3 HumanEval-chat + 3 ShareGPT prompts,
48 new tokens): the first position where the two dtypes choose differently, per prompt.

    python benchmarks/dtype_agreement.py
"""
import json, torch
from spec_adapt.tools.models import load_model
from spec_adapt.recipes import workloads
torch.set_grad_enabled(False)
res = {}
outs = {}
for dt in ("float32", "bfloat16"):
    model, tok = load_model("qwen2.5-coder-1.5b", dtype=getattr(torch, dt))
    for wl in ("humaneval-chat", "sharegpt"):
        ds = workloads.with_inputs(workloads.load(wl, 3), tok)
        for i, text in enumerate(ds["input_text"]):
            enc = tok([text], return_tensors="pt")
            out = model.generate(**enc, max_new_tokens=48, do_sample=False)
            outs[(dt, wl, i)] = out[0, enc.input_ids.shape[1]:].tolist()
    del model
rows = []
for wl in ("humaneval-chat", "sharegpt"):
    for i in range(3):
        a, b = outs[("float32", wl, i)], outs[("bfloat16", wl, i)]
        n = min(len(a), len(b))
        first = next((j for j in range(n) if a[j] != b[j]), n)
        rows.append({"workload": wl, "prompt": i, "tokens": n, "agree_prefix": first, "same_position": sum(x == y for x, y in zip(a, b)) / max(1, n)})
print(json.dumps(rows, indent=1))
tot = sum(r["tokens"] for r in rows)
print("prefix agreement", sum(r["agree_prefix"] for r in rows) / tot, "positionwise", sum(r["same_position"] * r["tokens"] for r in rows) / tot)
