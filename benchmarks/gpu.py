"""The GPU check: losslessness in three dtypes, sampling, the Triton kernels and timing against stock, on one GPU.

    python benchmarks/gpu.py --out results/gpu.json     # `make test-gpu`; without CUDA it says so and exits 0
    python benchmarks/gpu.py --smoke                    # the same code paths on the CPU, at tiny shapes

Nothing is downloaded: the models are random weights at real shapes, built from configs written here (Qwen2.5-1.5B's
and Llama-3.2-1B's widths, depths, heads and vocabularies), attention through sdpa. Four parts, one JSON, one table:

1. identity: float32, bfloat16 and float16, both shapes cut to 4 layers; prompt lookup on repetitive prompts,
   self-drafting by early exit (`assistant_early_exit=2`) and scripted drafts (right for 2 tokens, then wrong), batch
   1 and 4, ragged; each output judged against stock `generate` in the same dtype by the tie-aware rule
   (`spec_adapt.identity`): "identical" or "tie-equivalent" pass, "differs" fails;
2. sampling: the enumerated marginal test of tests/test_sampling.py, smaller: the first 3 sampled tokens of 4000
   rows through the loop (a draft model, and point-mass drafts) against the target's exact marginals, 5 standard
   errors;
3. kernels: benchmarks/kernels.py's `run` (each Triton kernel equal to its PyTorch reference, then both timed);
4. timing: both shapes at full depth in bfloat16, batch 1, 8 and 32, 64 new tokens: stock `generate`, spec_adapt
   without a drafter and with prompt lookup (FixedLength(4)) on the random model; then stock and an always-right
   scripted drafter at width 4 on the same model made to repeat (`repeating`: every layer's output projections
   zeroed, so the same FLOPs run and greedy repeats the last token by a wide margin; on a random bfloat16 model a
   script of the stock output goes wrong at the first near-tie and stays wrong). Median of 3 interleaved repeats;
   every spec_adapt output judged as in 1.

A run takes about 3-4 minutes on one H100 (under 8). Exit status 1 when an identity, sampling or kernel check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

SHAPES = {
    "qwen2.5-1.5b": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                   max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                   use_sliding_window=False)),
    "llama-3.2-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                                   max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True)),
}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=256, max_position_embeddings=512, tie_word_embeddings=True)
PARTS = ["identity", "sampling", "kernels", "timing"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PAD = 0


def build(arch: str, config: dict, dtype, device, layers: int | None = None, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config = dict(config, pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
    if layers is not None:
        config["num_hidden_layers"] = layers
    if arch == "qwen2":
        config.pop("head_dim", None)
    cfg_class, model_class = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class._from_config(cfg_class(**config), attn_implementation="sdpa", dtype=dtype)
    return model.eval()


def repetitive_batch(batch: int, vocab: int, device, seed: int = 0, length: int = 24, ragged: bool = True):
    """Left-padded prompts repeating a short phrase with a random tail (prompt lookup finds matches)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [length - ((i * 5) % 9 if ragged else 0) for i in range(batch)]
    ids = torch.full((batch, length), PAD, dtype=torch.long)
    mask = torch.zeros(batch, length, dtype=torch.long)
    for b, n in enumerate(lengths):
        phrase = torch.randint(3, vocab, (5,), generator=gen)
        row = phrase.repeat(n // 5 + 1)[:n]
        row[-2:] = torch.randint(3, vocab, (2,), generator=gen)
        ids[b, length - n:] = row
        mask[b, length - n:] = 1
    return ids.to(device), mask.to(device)


def repeating(model):
    """The model with every layer's output projections zeroed: the residual stream stays the token's embedding, so
    with tied embeddings greedy repeats the last token by a margin of |e|^2 against random e.e' (no near-ties), while
    every matrix product still runs at its real shape."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


def stock(model, ids, mask, new_tokens):
    return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                          pad_token_id=PAD, eos_token_id=None)


def spec(model, ids, mask, new_tokens, **kw):
    import spec_adapt

    stats = spec_adapt.SpecStats()
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                         pad_token_id=PAD, eos_token_id=None, custom_generate=spec_adapt.generate, spec_stats=stats,
                         **kw)
    return out, stats


def scripted(reference, mask, right: int | None):
    """A ScriptedDrafter reading the stock output: right for `right` tokens then wrong (None: always right)."""
    from spec_adapt import ScriptedDrafter

    pads = (mask == 0).sum(dim=1).tolist()
    rows = [reference[b, pads[b]:].tolist() for b in range(reference.shape[0])]

    def script(row, context, gamma):
        out = rows[row][len(context): len(context) + gamma]
        if right is None:
            return out
        return out[:right] + [(t + 1) % 1000 + 3 for t in out[right:]]
    return ScriptedDrafter(script)


# -- 1. identity ------------------------------------------------------------------------------------------------------
def identity(device, shapes, batches, new_tokens, log) -> list[dict]:
    from spec_adapt import FixedLength, PromptLookupDrafter
    from spec_adapt.identity import judge

    rows = []
    for shape, (arch, config) in shapes.items():
        for dtype_name, dtype in DTYPES.items():
            model = build(arch, config, dtype, device, layers=4)
            for batch in batches:
                ids, mask = repetitive_batch(batch, config["vocab_size"], device, seed=batch)
                reference = stock(model, ids, mask, new_tokens)
                cases = {
                    "prompt lookup": dict(drafter=PromptLookupDrafter(), assistant_policy=FixedLength(4)),
                    "early exit (2 layers)": dict(assistant_early_exit=2, assistant_policy=FixedLength(3)),
                    "scripted (right for 2)": dict(drafter=scripted(reference, mask, 2),
                                                   assistant_policy=FixedLength(4)),
                }
                for name, kw in cases.items():
                    out, stats = spec(model, ids, mask, new_tokens, **kw)
                    verdict = judge(model, ids, mask, reference, out, dtype=dtype)
                    row = {"shape": shape + " (4 layers)", "dtype": dtype_name, "batch": batch, "drafter": name,
                           "verdict": [str(r) for r in verdict.rows], "ok": verdict.ok and stats.fallback is None,
                           "ties": verdict.ties, "drafted": stats.drafted, "accepted": stats.accepted,
                           "fallback": stats.fallback}
                    rows.append(row)
                    log(f"identity  {shape:<13} {dtype_name:<9} B={batch:<2} {name:<23} "
                        f"{'ok ' if row['ok'] else 'FAIL'} ties={verdict.ties} accepted {stats.accepted}/"
                        f"{stats.drafted}" + ("" if verdict.ok else f"  {verdict}"))
            del model
            _free(device)
    return rows


# -- 2. sampling ------------------------------------------------------------------------------------------------------
def sampling(device, n: int, log) -> list[dict]:
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

    import spec_adapt
    from spec_adapt import FixedLength, ScriptedDrafter

    vocab, temperature, top_k, prompt = 16, 0.9, 12, [3, 7, 9, 4]
    small = dict(TINY, vocab_size=vocab, hidden_size=32, intermediate_size=64, head_dim=8, num_hidden_layers=2,
                 tie_word_embeddings=False)
    target = build("llama", small, torch.float32, device, seed=5)
    draft = build("llama", small, torch.float32, device, layers=1, seed=6)
    with torch.no_grad():             # mild logits (as tests/test_sampling.py): every token has real probability
        for m in (target, draft):
            m.lm_head.weight.mul_(8 * 0.3)

    def processed(prefixes):
        with torch.no_grad():
            logits = target(prefixes).logits[:, -1].float()
        logits = TopKLogitsWarper(top_k)(prefixes, TemperatureLogitsWarper(temperature)(prefixes, logits))
        return logits.softmax(-1)

    prefixes, joint, marginals = torch.tensor([prompt], device=device), torch.ones(1, device=device), []
    for _ in range(3):                # exact marginals of the first 3 tokens, by enumerating every prefix
        step = joint[:, None] * processed(prefixes)
        marginals.append(step.sum(0))
        joint = step.flatten()
        prefixes = torch.cat([prefixes.repeat_interleave(vocab, 0),
                              torch.arange(vocab, device=device).repeat(len(prefixes))[:, None]], dim=1)
    drafters = {"draft model": draft,
                "point mass": ScriptedDrafter(lambda row, context, gamma: [int(marginals[1].argmax()), 5, 6][:gamma])}
    rows = []
    for name, drafter in drafters.items():
        ids = torch.tensor([prompt], device=device).repeat(n, 1)
        torch.manual_seed(0)
        out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                              temperature=temperature, top_k=top_k, top_p=None, max_new_tokens=5, eos_token_id=None,
                              pad_token_id=PAD, custom_generate=spec_adapt.generate, drafter=drafter,
                              assistant_policy=FixedLength(3))[:, len(prompt):]
        worst = 0.0
        for i, exact in enumerate(marginals):
            empirical = torch.bincount(out[:, i], minlength=vocab).double() / n
            se = (exact.double() * (1 - exact.double()) / n).sqrt().clamp(min=1e-4)
            worst = max(worst, float(((empirical - exact.double()).abs() / se).max()))
        rows.append({"drafter": name, "rows": n, "worst_z": worst, "ok": worst < 5.0})
        log(f"sampling  {name:<13} {n} rows: worst |z| {worst:.2f} (< 5) {'ok' if worst < 5 else 'FAIL'}")
    return rows


# -- 3. kernels -------------------------------------------------------------------------------------------------------
def kernels(device, smoke: bool, log) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import kernels as bench_kernels

    if smoke:
        result = bench_kernels.run(device, vocabs=(64,), batches=(1, 3), widths=(1, 3), caches=((2, 2, 16, 8),),
                                   timed=False)
    else:
        result = bench_kernels.run(device)
    log(f"kernels   {len(result['rows'])} kernel/shape pairs equal to their references")
    return result


# -- 4. timing --------------------------------------------------------------------------------------------------------
def timing(device, shapes, batches, new_tokens, repeats, dtype, log) -> list[dict]:
    from spec_adapt import FixedLength, PromptLookupDrafter

    rows = []
    for shape, (arch, config) in shapes.items():
        model = build(arch, config, dtype, device)
        for batch in batches:
            ids, mask = repetitive_batch(batch, config["vocab_size"], device, seed=100 + batch, length=64,
                                         ragged=False)
            reference = stock(model, ids, mask, new_tokens)
            configs = {
                "stock": lambda: (stock(model, ids, mask, new_tokens), None),
                "spec, no drafter": lambda: spec(model, ids, mask, new_tokens, drafter=None,
                                                 assistant_policy=FixedLength(0)),
                "spec, prompt lookup w4": lambda: spec(model, ids, mask, new_tokens, drafter=PromptLookupDrafter(),
                                                       assistant_policy=FixedLength(4)),
            }
            rows += _timed(model, ids, mask, reference, configs, shape, batch, new_tokens, repeats, dtype, log)
            rows += _timed_repeating(model, ids, mask, shape, batch, new_tokens, repeats, dtype, log)
        del model
        _free(device)
    return rows


def _timed_repeating(model, ids, mask, shape, batch, new_tokens, repeats, dtype, log) -> list[dict]:
    """Stock and an always-right scripted draft at width 4 on the repeating copy of the model."""
    from spec_adapt import FixedLength, ScriptedDrafter

    saved = {k: v.clone() for k, v in model.state_dict().items() if "o_proj" in k or "down_proj" in k}
    repeating(model)
    try:
        reference = stock(model, ids, mask, new_tokens)
        always_right = ScriptedDrafter(lambda row, context, gamma: [int(context[-1])] * gamma)
        configs = {
            "stock (repeating)": lambda: (stock(model, ids, mask, new_tokens), None),
            "spec, scripted w4 (repeating)": lambda: spec(model, ids, mask, new_tokens, drafter=always_right,
                                                          assistant_policy=FixedLength(4)),
        }
        return _timed(model, ids, mask, reference, configs, shape, batch, new_tokens, repeats, dtype, log)
    finally:
        model.load_state_dict(saved, strict=False)


def _timed(model, ids, mask, reference, configs, shape, batch, new_tokens, repeats, dtype, log) -> list[dict]:
    from spec_adapt.identity import judge

    device, rows = ids.device, []
    seconds = {name: [] for name in configs}
    verdicts, accepted = {}, {}
    for name, run in configs.items():                 # warm-up, judged
        out, stats = run()
        if stats is not None:
            verdicts[name] = judge(model, ids, mask, reference, out, dtype=dtype)
            accepted[name] = (stats.accepted, stats.drafted)
    for _ in range(repeats):
        for name, run in configs.items():
            _sync(device)
            start = time.perf_counter()
            run()
            _sync(device)
            seconds[name].append(time.perf_counter() - start)
    base = statistics.median(next(iter(seconds.values())))    # the first configuration is stock
    for name, values in seconds.items():
        median = statistics.median(values)
        verdict = verdicts.get(name)
        row = {"shape": shape, "dtype": str(dtype).replace("torch.", ""), "batch": batch, "config": name,
               "ms_per_token": 1e3 * median / new_tokens, "tokens_per_s": batch * new_tokens / median,
               "speedup": base / median, "seconds": values,
               "ok": verdict is None or verdict.ok, "ties": None if verdict is None else verdict.ties,
               "accepted": accepted.get(name)}
        rows.append(row)
        log(f"timing    {shape:<13} B={batch:<3} {name:<29} {row['ms_per_token']:8.2f} ms/step "
            f"{row['tokens_per_s']:9.0f} tok/s {row['speedup']:5.2f}x"
            + ("" if verdict is None else f"  {'ok' if verdict.ok else 'FAIL'} ties={verdict.ties}"
                                          f" accepted {row['accepted'][0]}/{row['accepted'][1]}"))
    return rows


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--smoke", "--cpu-smoke", dest="cpu_smoke", action="store_true",
                        help="run every part on the CPU at tiny shapes (the kernels untimed, under TRITON_INTERPRET=1)")
    parser.add_argument("--new-tokens", type=int, default=64, help="timing: new tokens per call")
    parser.add_argument("--repeats", type=int, default=3, help="timing: interleaved repeats (median)")
    parser.add_argument("--parts", nargs="+", default=PARTS, choices=PARTS, help="the parts to run (default: all)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES),
                        help="the model shapes (default: both)")
    args = parser.parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("benchmarks/gpu.py: skipped, no CUDA device here (run it on a machine with a GPU; "
              "--cpu-smoke runs its code paths on the CPU at tiny shapes).")
        return 0
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")     # the kernels under Triton's interpreter
        os.environ.setdefault("SPEC_ADAPT_POLICY_DIR", "off")
        device = torch.device("cpu")
        shapes = {name: (arch, dict(TINY, vocab_size=TINY["vocab_size"] + 64 * i))
                  for i, (name, (arch, _)) in enumerate(SHAPES.items())}
        id_batches, time_batches, new_tokens, repeats, n_samples = (1, 3), (1, 2), 8, 1, 600
    else:
        device = torch.device("cuda")
        shapes, id_batches, time_batches = {k: SHAPES[k] for k in args.shapes}, (1, 4), (1, 8, 32)
        new_tokens, repeats, n_samples = args.new_tokens, args.repeats, 4000
    import transformers

    began = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or 'cpu'})"
    print(f"gpu check on {name}; torch {torch.__version__}, transformers {transformers.__version__}"
          + ("; CPU smoke run at tiny shapes (skipped: the GPU itself, real shapes and the kernels' timing)"
             if args.cpu_smoke else ""))

    def log(line):
        print(f"[{time.perf_counter() - began:6.1f}s] {line}", flush=True)

    result = {"device": name, "cpu_smoke": args.cpu_smoke, "torch": torch.__version__,
              "transformers": transformers.__version__, "failures": []}
    parts = (("identity", lambda: identity(device, shapes, id_batches, 24 if args.cpu_smoke else 32, log)),
             ("sampling", lambda: sampling(device, n_samples, log)),
             ("kernels", lambda: kernels(device, args.cpu_smoke, log)),
             ("timing", lambda: timing(device, shapes, time_batches, new_tokens, repeats,
                                       torch.bfloat16 if device.type == "cuda" else torch.float32, log)))
    for part, run in parts:
        if part not in args.parts:
            continue
        try:
            result[part] = run()
        except Exception as exc:  # noqa: BLE001 - a part that fails is reported, the others still run
            result[part] = None
            result["failures"].append(f"{part}: {type(exc).__name__}: {exc}")
            log(f"{part} FAILED: {type(exc).__name__}: {exc}")
    for part in ("identity", "sampling", "timing"):
        for row in result.get(part) or []:
            if not row["ok"]:
                result["failures"].append(f"{part}: {row}")
    result["elapsed_s"] = time.perf_counter() - began
    print(f"\n{'shape':<14} {'B':>3} {'configuration':<29} {'ms/step':>8} {'tok/s':>9} {'x stock':>8}")
    for row in result.get("timing") or []:
        print(f"{row['shape']:<14} {row['batch']:>3} {row['config']:<29} {row['ms_per_token']:8.2f} "
              f"{row['tokens_per_s']:9.0f} {row['speedup']:7.2f}x")
    verdicts = [v for row in result.get("identity") or [] for v in row["verdict"]]
    print(f"identity: {len(result.get('identity') or [])} cases, {sum(v == 'identical' for v in verdicts)} rows "
          f"identical, {sum(v.startswith('tie') for v in verdicts)} tie-equivalent, "
          f"{sum(v.startswith('differs') for v in verdicts)} differ; "
          f"{len(result['failures'])} failure(s); {result['elapsed_s']:.0f} s")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {args.out}")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
