"""What a multi-token-prediction (MTP) draft costs per drafted token, as a fraction of one target verification, beside
a 0.5B draft model's, at GLM-4.5-Air's shape with random weights (timing does not depend on the weights' values).

    python benchmarks/mtp_cost.py [--dtype bfloat16] [--threads 8] [--repeats 7] [--out mtp-cost.json]
    python benchmarks/mtp_cost.py --smoke     # 64-wide shapes: checks the script runs

The shape is GLM-4.5-Air's config.json (transformers' Glm4MoeConfig defaults, plus the checkpoint's head_dim=128,
attention_bias=True and rope_theta=1e6, which the defaults lack): hidden 4096, 96 query / 8 KV heads of 128, dense
MLP 10944, experts of 1408 (8 routed per token + 1 shared), vocabulary 151552, 46 layers (1 dense + 45 MoE), one MTP
layer. The whole model does not fit a small machine, so the target is built with 1 dense + `--moe-layers` MoE layers
and `--experts` routed experts (16 by default, not 128). Only num_experts_per_tok = 8 experts run per token, so a
token's compute is unchanged; what changes is how many distinct experts a forward of w tokens reads: up to min(8w, E).
At w = 1 that is 8 either way; at w > 1 fewer than with 128 (both columns are printed), so the w > 1 verification is
cheaper here than in the real model and the fractions against it are upper bounds (`--experts 128 --dtype bfloat16`
builds every expert: about 14 GB).

Measured, medians of `--repeats` interleaved rounds over a cache filled with `--context` tokens (each forward is
cropped back off it):
  a. the target's forward of w = 1..8 tokens, per part (forward hooks): the dense layer, each MoE layer, the final
     norm + LM head over all w positions (as a verification projects them), and the rest (embedding, masks, rotary);
  b. the MTP draft step for one token, as spec_adapt's MTPDrafter runs it: projections + one MoE decoder layer over
     its own cache, the shared head on the last position, argmax;
  c. the 0.5B draft's one-token step (Qwen2.5-0.5B's shape, 24 layers, head on the last position).
A full verification is extrapolated as the measured forward + (45 - moe_layers) more MoE layers at the measured
per-layer time. Not counted: each drafter's catch-up (the MTP layer re-reads the accepted positions, the 0.5B draft
feeds them), host work and acceptance; this is the per-token forward cost only.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import time

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, DynamicCache, Glm4MoeConfig, Qwen2Config

from spec_adapt import compat
from spec_adapt.tools.cli import cpu_name

REAL_LAYERS, REAL_EXPERTS, TOP_K = 46, 128, 8
GLM_AIR = dict(hidden_size=4096, num_attention_heads=96, num_key_value_heads=8, head_dim=128, intermediate_size=10944,
               moe_intermediate_size=1408, num_experts_per_tok=TOP_K, n_shared_experts=1, first_k_dense_replace=1,
               vocab_size=151552, attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                                        "partial_rotary_factor": 0.5},
               n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0, num_mtp_layers=1)
QWEN_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
SMOKE_GLM = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                 moe_intermediate_size=32, vocab_size=1000)
SMOKE_QWEN = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1000)
WIDTHS = range(1, 9)


def build(args, dtype):
    """The scaled target (1 dense + moe_layers MoE), its MTP layer (random, as MtpModel initialises it), the draft."""
    glm = {**GLM_AIR, **(SMOKE_GLM if args.smoke else {})}
    target_config = Glm4MoeConfig(**glm, num_hidden_layers=1 + args.moe_layers, n_routed_experts=args.experts)
    draft_config = Qwen2Config(**{**QWEN_05B, **(SMOKE_QWEN if args.smoke else {})})
    target = AutoModelForCausalLM.from_config(target_config, dtype=dtype).eval()
    mtp = compat.MtpModel(target, 1).to(dtype).eval()
    draft = AutoModelForCausalLM.from_config(draft_config, dtype=dtype).eval()
    return target, mtp, draft


class Parts:
    """Seconds spent in each named module during one forward, and the distinct experts each MoE router picked."""

    def __init__(self, target):
        self.seconds, self.experts, self.started = {}, [], {}
        decoder = target.get_decoder()
        named = {f"layer{i}": layer for i, layer in enumerate(decoder.layers)}
        named.update(norm=decoder.norm, head=target.lm_head)
        for name, module in named.items():
            module.register_forward_pre_hook(lambda m, a, name=name: self._start(name))
            module.register_forward_hook(lambda m, a, o, name=name: self._stop(name))
        for layer in decoder.layers[target.config.first_k_dense_replace:]:
            layer.mlp.gate.register_forward_hook(lambda m, a, out: self.experts.append(out[-1].unique().numel()))

    def _start(self, name):
        self.started[name] = time.perf_counter()

    def _stop(self, name):
        self.seconds[name] = time.perf_counter() - self.started[name]

    def reset(self):
        self.seconds, self.experts = {}, []


def filled(model, context: int) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    model(torch.randint(0, 1000, (1, context)), use_cache=True, logits_to_keep=1, **compat.with_cache(model, cache))
    return cache


def verify(target, cache, parts: Parts, width: int) -> dict:
    """One forward of `width` tokens, every position projected; its parts' seconds."""
    parts.reset()
    start = time.perf_counter()
    target(torch.randint(0, 1000, (1, width)), use_cache=True, **compat.with_cache(target, cache))
    total = time.perf_counter() - start
    cache.crop(-width)
    dense = target.config.first_k_dense_replace
    moe = [parts.seconds[f"layer{i}"] for i in range(dense, target.config.num_hidden_layers)]
    head = parts.seconds["norm"] + parts.seconds["head"]
    rest = total - sum(parts.seconds.values())
    return dict(total=total, dense=sum(parts.seconds[f"layer{i}"] for i in range(dense)), moe=statistics.mean(moe),
                head=head, rest=rest, experts=statistics.mean(parts.experts))


def mtp_step(mtp, cache, context: int) -> float:
    hidden = torch.randn(1, 1, mtp.config.hidden_size, dtype=mtp.dtype)
    start = time.perf_counter()
    out = compat.mtp_layer_forward(mtp, 0, torch.randint(0, 1000, (1, 1)), hidden, torch.tensor([[context]]), None,
                                   cache)
    compat.mtp_logits(mtp, out[:, -1:]).argmax(-1)
    seconds = time.perf_counter() - start
    cache.crop(-1)
    return seconds


def draft_step(draft, cache) -> float:
    start = time.perf_counter()
    draft(torch.randint(0, 1000, (1, 1)), use_cache=True, logits_to_keep=1, **compat.with_cache(draft, cache))
    seconds = time.perf_counter() - start
    cache.crop(-1)
    return seconds


def measure(args, target, mtp, draft) -> tuple[list, list]:
    parts = Parts(target)
    target_cache, draft_cache = filled(target, args.context), filled(draft, args.context)
    mtp_cache = DynamicCache(config=mtp.config)
    compat.mtp_layer_forward(mtp, 0, torch.randint(0, 1000, (1, args.context)),
                             torch.randn(1, args.context, mtp.config.hidden_size, dtype=mtp.dtype),
                             torch.arange(args.context)[None], None, mtp_cache)
    jobs = [("verify", w) for w in WIDTHS] + [("mtp", 1), ("draft", 1)]
    runs = {job: [] for job in jobs}
    order = random.Random(0)
    for round_ in tqdm(range(args.repeats + 1), desc="rounds"):
        order.shuffle(jobs)                  # interleaved, in a new order each round: drift hits every job alike
        for kind, width in jobs:
            if kind == "verify":
                result = verify(target, target_cache, parts, width)
            else:
                result = mtp_step(mtp, mtp_cache, args.context) if kind == "mtp" else draft_step(draft, draft_cache)
            if round_:                       # the first round is a warm-up
                runs[(kind, width)].append(result)
    rows = []
    for w in WIDTHS:
        row = {key: statistics.median(r[key] for r in runs[("verify", w)]) for key in runs[("verify", w)][0]}
        row.update(width=w, full=row["total"] + (REAL_LAYERS - 1 - args.moe_layers) * row["moe"],
                   experts_real=REAL_EXPERTS * (1 - (1 - TOP_K / REAL_EXPERTS) ** w))
        rows.append(row)
    by_width = {row["width"]: row["full"] for row in rows}
    summary = []
    for name, key in (("MTP layer (1 drafted token per step)", "mtp"), ("0.5B draft (Qwen2.5-0.5B shape)", "draft")):
        seconds = statistics.median(runs[(key, 1)])
        summary.append(dict(drafter=name, seconds=seconds, of_verify_1=seconds / by_width[1],
                            of_verify_5=seconds / by_width[5]))
    return rows, summary


def report(args, meta, rows, summary):
    print(f"\nCPU: {meta['cpu']}  torch {torch.__version__}, {meta['threads']} threads, {args.dtype}, "
          f"context {args.context}, {args.repeats} rounds, experts implementation {meta['experts_impl']}")
    print(f"Target built: 1 dense + {args.moe_layers} MoE layers, {args.experts} routed experts "
          f"({meta['params']['target'] / 1e9:.2f}B params; MTP {meta['params']['mtp'] / 1e9:.2f}B incl. its own "
          f"layer, draft {meta['params']['draft'] / 1e9:.2f}B). Full verification EXTRAPOLATED to 46 layers = "
          f"measured forward + {REAL_LAYERS - 1 - args.moe_layers} x measured MoE layer.")
    print(f"\n{'w':>2} {'dense ms':>9} {'MoE/layer':>10} {'norm+head':>10} {'rest':>7} {'forward':>9} "
          f"{'46-layer ms':>12} {'experts read':>13} {'at 128':>7}")
    for r in rows:
        print(f"{r['width']:>2} {1e3 * r['dense']:>9.2f} {1e3 * r['moe']:>10.2f} {1e3 * r['head']:>10.2f} "
              f"{1e3 * r['rest']:>7.2f} {1e3 * r['total']:>9.2f} {1e3 * r['full']:>12.1f} {r['experts']:>13.1f} "
              f"{r['experts_real']:>7.1f}")
    print(f"\n{'per drafted token':<38} {'ms':>9} {'/ 1-token verify':>17} {'/ 5-token verify':>17}")
    for s in summary:
        print(f"{s['drafter']:<38} {1e3 * s['seconds']:>9.2f} {s['of_verify_1']:>17.4f} {s['of_verify_5']:>17.4f}")
    print(f"\nPeak resident memory: {meta['peak_rss_gb']:.1f} GB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--moe-layers", type=int, default=1)
    parser.add_argument("--experts", type=int, default=16, help="routed experts built (GLM-4.5-Air has 128)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script runs")
    parser.add_argument("--out", default=None, help="write the results as JSON here (default: print only)")
    args = parser.parse_args()
    if args.experts < TOP_K:
        parser.error(f"--experts must be at least num_experts_per_tok = {TOP_K}")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with torch.inference_mode():
        target, mtp, draft = build(args, getattr(torch, args.dtype))
        rows, summary = measure(args, target, mtp, draft)
    own = {id(p) for p in target.parameters()}
    meta = dict(cpu=cpu_name(), torch=torch.__version__, threads=torch.get_num_threads(), dtype=args.dtype,
                context=args.context, repeats=args.repeats, moe_layers=args.moe_layers, experts=args.experts,
                smoke=args.smoke, experts_impl=target.config._experts_implementation,
                params=dict(target=sum(p.numel() for p in target.parameters()),
                            mtp=sum(p.numel() for p in mtp.parameters() if id(p) not in own),
                            draft=sum(p.numel() for p in draft.parameters())),
                peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                extrapolation=f"46-layer verification = measured forward + {REAL_LAYERS - 1 - args.moe_layers} x "
                              "measured MoE layer time")
    report(args, meta, rows, summary)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows, summary=summary), f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
