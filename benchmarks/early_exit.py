"""Top-K early exit on real traces: how well an intermediate layer predicts rejection, and what a test costs.

1. Traces. For each prompt, the target's own greedy continuation is the truth. A speculative run is replayed on it:
   at each step the drafter proposes gamma tokens from the committed context, the accepted count is the matching
   prefix (greedy verification), and the step advances by accepted + 1. For every step the target runs once on
   context + drafts with all hidden states, and each checkpoint layer's projection (final norm + LM head) ranks each
   draft d_{i+1} at position i.
2. Table per (layer, K): positions pruned (would leave before the last layer) as a share of verified positions,
   and prediction errors: pruned positions whose draft would have been accepted (the cut costs tokens), with the
   tokens lost per step. Lossless either way: errors cost speed, never output.
3. Cost: one decoder layer vs the LM head per position, timed at each model's shape (random weights) for
   1..4 rows x 1 or 6 positions, beside the shape-only cost model (`head_cost_in_layers`).

    python benchmarks/early_exit.py --model smollm2-135m --drafter lookup --prompts 6 --new-tokens 96
    python benchmarks/early_exit.py --model qwen2.5-coder-1.5b --drafter qwen2.5-coder-0.5b --prompts 3 --new-tokens 48
    python benchmarks/early_exit.py --smoke       # a tiny model and a tiny shape, written to a temporary folder
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

import _smoke

SHAPES = {   # (vocab, hidden, intermediate, heads, kv heads, layers)
    "smollm2-135m": (49152, 576, 1536, 9, 3, 30),
    "qwen2.5-coder-1.5b": (151936, 1536, 8960, 12, 2, 28),
    "llama-7b": (32000, 4096, 11008, 32, 32, 32),
}
TINY_SHAPE = {"tiny": (256, 64, 128, 4, 2, 4)}     # the smoke run's


def _layer_weights(config) -> int:
    """Weights of one decoder layer (attention projections with grouped KV heads, gated MLP): its compute per position."""
    hidden, inter = config.hidden_size, config.intermediate_size
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    return 2 * hidden * hidden + 2 * hidden * hidden * kv // heads + 3 * hidden * inter


def head_cost_in_layers(config) -> float:
    """The LM head's compute per position in units of one decoder layer's."""
    return config.vocab_size * config.hidden_size / _layer_weights(config)


def predicted_gain(config, width: int, kept: float, checkpoint: int) -> float:
    """Shape-only cost model, in decoder-layer units of compute per row: (layers the dropped positions skip) minus
    (the head projections of the tested positions). `kept`: mean positions a row keeps after the checkpoint. Positive
    = pruning should pay where the device is compute-bound (it never pays where a forward costs the weights' read)."""
    saved = (width - kept) * (config.num_hidden_layers - checkpoint - 1)     # position-layers skipped
    return saved - (width - 1) * head_cost_in_layers(config)                 # tested positions, a head each


def draft_fn(name, target, tok):
    if name == "lookup":
        from spec_adapt.drafters.lookup import lookup_continuation

        return lambda ctx, gamma: lookup_continuation(ctx, gamma, 3, 2).tolist()
    from spec_adapt.tools.models import load_model

    draft = load_model(name, dtype=target.dtype)[0]

    def greedy(ctx, gamma):
        out = draft.generate(ctx[None], attention_mask=torch.ones_like(ctx[None]), max_new_tokens=gamma,
                             do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=None)
        return out[0, len(ctx):].tolist()
    return greedy


@torch.no_grad()
def record(model, tok, prompts, drafter, gamma, new_tokens, layers):
    """Per step: accepted count and, per checkpoint layer, the rank of each draft."""
    steps = []
    for text in tqdm(prompts, desc="prompts"):
        ids = tok(text, return_tensors="pt").input_ids[0]
        truth = model.generate(ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=new_tokens,
                               do_sample=False, pad_token_id=tok.pad_token_id)[0]
        t = len(ids)
        while t < len(truth) - 1:
            drafts = list(drafter(truth[:t], gamma))[:gamma]
            if not drafts:
                t += 1
                continue
            future = truth[t : t + len(drafts)].tolist()
            accepted = next((i for i, (d, f) in enumerate(zip(drafts, future)) if d != f), len(drafts))
            accepted = min(accepted, len(future))
            chunk = torch.cat([truth[:t], torch.tensor(drafts)])
            out = model(chunk[None], output_hidden_states=True)
            ranks = {}
            for layer in layers:
                hidden = out.hidden_states[layer + 1][0, t - 1 : t - 1 + len(drafts)]   # positions scoring d_1..d_L
                logits = model.lm_head(model.model.norm(hidden)).float()
                target = logits.gather(1, torch.tensor(drafts)[:, None])
                ranks[layer] = (logits > target).sum(1).tolist()
            steps.append({"drafted": len(drafts), "accepted": accepted, "ranks": ranks})
            t += accepted + 1
    return steps


def table(steps, layers, ks):
    rows = []
    verified = sum(s["drafted"] + 1 for s in steps)
    for layer in layers:
        for k in ks:
            pruned = lost = 0
            for s in steps:
                bad = [i for i, r in enumerate(s["ranks"][layer]) if r >= k]
                if not bad:
                    continue
                keep = bad[0] + 1                    # drafts kept d_1..d_{i+1} = positions kept 0..i
                pruned += s["drafted"] + 1 - keep     # positions that leave (the bonus position included)
                # Position j >= keep would have committed a token iff j <= accepted: those are the cut's errors.
                lost += max(0, s["accepted"] - keep + 1)
            rows.append({"layer": layer, "K": k, "pruned_share": pruned / verified,
                         "error_share": lost / max(1, pruned), "tokens_lost_per_step": lost / max(1, len(steps))})
    return rows


@torch.no_grad()
def time_shape(name, rows_list=(1, 4), widths=(1, 6), dtype=torch.float32, repeats=5):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    vocab, hidden, inter, heads, kv, layers = {**SHAPES, **TINY_SHAPE}[name]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                      num_key_value_heads=kv, num_hidden_layers=layers)
    layer = LlamaDecoderLayer(cfg, 0).to(dtype).eval()
    head = torch.nn.Linear(hidden, vocab, bias=False).to(dtype)
    rope = LlamaRotaryEmbedding(cfg)
    out = []
    for b in rows_list:
        for w in widths:
            x = torch.randn(b, w, hidden, dtype=dtype)
            pos = torch.arange(w)[None].expand(b, w)
            emb = tuple(t.to(dtype) for t in rope(x, pos))
            t_layer, t_head = [], []
            for _ in range(repeats):
                s = time.perf_counter()
                layer(x, attention_mask=None, position_embeddings=emb, position_ids=pos)
                t_layer.append(time.perf_counter() - s)
                s = time.perf_counter()
                head(x)
                t_head.append(time.perf_counter() - s)
            tl, th = sorted(t_layer)[repeats // 2], sorted(t_head)[repeats // 2]
            out.append({"shape": name, "rows": b, "width": w, "layer_ms": 1000 * tl, "head_ms": 1000 * th,
                        "head_in_layers_measured": th / tl, "head_in_layers_model": head_cost_in_layers(cfg),
                        "gain_model_w6_keep2": predicted_gain(cfg, 6, 2.0, layers // 2)})
    del layer, head
    return out


def plot(rows, out_dir, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for layer in sorted({r["layer"] for r in rows}):
        sub = [r for r in rows if r["layer"] == layer]
        axes[0].plot([r["K"] for r in sub], [r["pruned_share"] for r in sub], marker="o", label=f"layer {layer}")
        axes[1].plot([r["K"] for r in sub], [r["error_share"] for r in sub], marker="o", label=f"layer {layer}")
    axes[0].set(xscale="log", xlabel="K", ylabel="pruned share of verified positions")
    axes[1].set(xscale="log", xlabel="K", ylabel="pruned positions that would have been accepted")
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_dir / "early_exit.png", dpi=120)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", default="lookup", help="lookup or a draft model name")
    p.add_argument("--workload", default="humaneval-chat")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--gamma", type=int, default=6)
    p.add_argument("--ks", type=int, nargs="+", default=[1, 3, 10, 30, 100])
    p.add_argument("--shapes", nargs="*", default=list(SHAPES))
    p.add_argument("--out", default=None)
    _smoke.add(p)
    args = _smoke.apply(p.parse_args(), globals(), prompts=1, new_tokens=12, shapes=list(TINY_SHAPE),
                        out=_smoke.folder())
    from spec_adapt.tools.models import load_model
    from spec_adapt.recipes import workloads

    model, tok = load_model(args.model)
    depth = model.config.num_hidden_layers
    layers = sorted({depth // 4, depth // 2, 3 * depth // 4})
    prompts = list(workloads.with_inputs(workloads.load(args.workload, args.prompts), tok)["input_text"])
    steps = record(model, tok, prompts, draft_fn(args.drafter, model, tok), args.gamma, args.new_tokens, layers)
    rows = table(steps, layers, args.ks)
    timings = [t for shape in tqdm(args.shapes, desc="shapes") for t in time_shape(shape)]
    out_dir = Path(args.out or f"results/early-exit-{args.model}-{args.drafter}")
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = vars(args) | {"layers": layers, "steps": len(steps),
                         "alpha": sum(s["accepted"] for s in steps) / max(1, sum(s["drafted"] for s in steps))}
    (out_dir / "summary.json").write_text(json.dumps({"meta": meta, "table": rows, "timings": timings}, indent=1))
    plot(rows, out_dir, f"{args.model} / {args.drafter}: {len(steps)} steps")
    print(json.dumps(meta))
    for r in rows:
        print(f"layer {r['layer']:>2} K {r['K']:>4}: pruned {r['pruned_share']:.2f}  errors {r['error_share']:.2f}"
              f"  tokens lost/step {r['tokens_lost_per_step']:.2f}")
    for t in timings:
        print(f"{t['shape']:>20} B={t['rows']} W={t['width']}: layer {t['layer_ms']:.2f} ms, head {t['head_ms']:.2f} ms"
              f" = {t['head_in_layers_measured']:.1f} layers (model {t['head_in_layers_model']:.1f})")


if __name__ == "__main__":
    main()
