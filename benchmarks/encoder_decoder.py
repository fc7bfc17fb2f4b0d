"""Speculative decoding of an encoder-decoder target: Whisper at whisper-tiny's configuration (random weights), with
a Distil-Whisper-shaped draft (the target's embeddings, first decoder layers and head as a WhisperForCausalLM that
attends to the target's encoder outputs; the target's later decoder layers have their output projections scaled by
`--late-scale`, so the draft agrees with the target often, as a distilled draft does) and with prompt lookup, beside stock generate and stock assisted
generation with the same drafts.

Random weights make the acceptance this workload's own (not a trained pair's): the table compares spec_adapt with
stock on equal drafts, and the tokens per second of each. Medians of interleaved repeats; every output is checked
against stock greedy on the same inputs.

    python benchmarks/encoder_decoder.py --out results/encoder-decoder-whisper-tiny-shape
    python benchmarks/encoder_decoder.py --smoke      # a 64-wide Whisper over 200 frames, one repeat
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import WhisperConfig, WhisperForCausalLM, WhisperForConditionalGeneration

import spec_adapt
from spec_adapt import FixedLength, PromptLookupDrafter
from spec_adapt.tools.cli import cpu_name

import _smoke

# whisper-tiny's configuration (openai/whisper-tiny): 4 encoder and 4 decoder layers, d_model 384, 6 heads.
TINY = dict(vocab_size=51865, d_model=384, encoder_layers=4, decoder_layers=4, encoder_attention_heads=6,
            decoder_attention_heads=6, encoder_ffn_dim=1536, decoder_ffn_dim=1536, num_mel_bins=80,
            max_source_positions=1500, max_target_positions=448, decoder_start_token_id=50258,
            eos_token_id=50257, pad_token_id=50257, bos_token_id=50257, suppress_tokens=None,
            begin_suppress_tokens=None)
SMOKE = dict(TINY, vocab_size=512, d_model=64, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=100,
             max_target_positions=64, decoder_start_token_id=3, eos_token_id=2, pad_token_id=2, bos_token_id=2)


def models(draft_layers: int, late_scale: float, shape: dict = TINY):
    torch.manual_seed(0)
    target = WhisperForConditionalGeneration(WhisperConfig(**shape)).eval()
    with torch.no_grad():   # later decoder layers refine less: the first layers predict most of the target's tokens
        for layer in target.model.decoder.layers[draft_layers:]:
            for linear in (layer.self_attn.out_proj, layer.encoder_attn.out_proj, layer.fc2):
                linear.weight.mul_(late_scale)
    config = WhisperConfig(**{**shape, "decoder_layers": draft_layers, "is_encoder_decoder": False})
    draft = WhisperForCausalLM(config).eval()
    state = {f"model.decoder.{k}": v for k, v in target.model.decoder.state_dict().items()}
    state["proj_out.weight"] = target.proj_out.weight
    draft.load_state_dict(state, strict=False)        # the decoder's first layers: extra ones are not loaded
    return target, draft


def features(batch: int, seed: int, frames: int = 3000) -> torch.Tensor:
    """[batch, 80, frames] log-mel-shaped inputs (3000: 30 s of audio frames), one random clip per row."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 80, frames, generator=gen)


def configurations(target, draft, new_tokens):
    common = dict(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None)
    spec = dict(common, custom_generate=spec_adapt.generate)
    return {
        "stock generate": (1, dict(common)),
        "stock assisted (draft)": (1, dict(common, assistant_model=draft)),
        "stock prompt lookup": (1, dict(common, prompt_lookup_num_tokens=3)),
        "spec_adapt Adaptive (draft)": (1, dict(spec, drafter=draft)),
        "spec_adapt Adaptive (lookup)": (1, dict(spec, drafter=PromptLookupDrafter())),
        "spec_adapt FixedLength(3) (draft)": (1, dict(spec, drafter=draft, assistant_policy=FixedLength(3))),
        "spec_adapt FixedLength(3) (lookup)": (1, dict(spec, drafter=PromptLookupDrafter(),
                                                       assistant_policy=FixedLength(3))),
        "stock generate, batch 4": (4, dict(common)),
        "spec_adapt Adaptive (draft), batch 4": (4, dict(spec, drafter=draft)),
    }


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--late-scale", type=float, default=0.3,
                        help="scale of the output projections of the decoder layers the draft does not have")
    parser.add_argument("--out", type=Path, default=None)
    _smoke.add(parser)
    args = _smoke.apply(parser.parse_args(), new_tokens=8, repeats=1, out=Path(_smoke.folder()))
    shape = SMOKE if args.smoke else TINY
    target, draft = models(args.draft_layers, args.late_scale, shape)
    configs = configurations(target, draft, args.new_tokens)
    inputs = {batch: features(batch, batch, 2 * shape["max_source_positions"]) for batch in (1, 4)}
    references = {batch: target.generate(input_features=x, do_sample=False, max_new_tokens=args.new_tokens,
                                         eos_token_id=None) for batch, x in inputs.items()}
    for name, (batch, kwargs) in configs.items():     # warm-up, and the default policy's first calls
        target.generate(input_features=inputs[batch], **kwargs)
    times = {name: [] for name in configs}
    identical, accepted = {}, {}
    for _ in tqdm(range(args.repeats), desc="repeats"):
        for name, (batch, kwargs) in tqdm(configs.items(), desc="configurations", leave=False):
            start = time.perf_counter()
            out = target.generate(input_features=inputs[batch], **kwargs)
            times[name].append(time.perf_counter() - start)
            identical[name] = identical.get(name, True) and torch.equal(out, references[batch])
            if "spec_adapt" in name:
                stats = spec_adapt.last_stats()
                accepted[name] = f"{stats.accepted}/{stats.drafted}"
    rows = []
    for name, (batch, _) in configs.items():
        seconds = statistics.median(times[name])
        base = statistics.median(times["stock generate" if batch == 1 else "stock generate, batch 4"])
        rows.append({"configuration": name, "batch": batch, "seconds": round(seconds, 3),
                     "tokens_per_s": round(batch * args.new_tokens / seconds, 1), "speedup": round(base / seconds, 2),
                     "accepted/drafted": accepted.get(name, ""), "identical": identical[name]})
    header = (f"Whisper at whisper-tiny's configuration, random weights, {args.new_tokens} new tokens, median of "
              f"{args.repeats} interleaved repeats; draft: the target's first {args.draft_layers} decoder layers "
              f"(later layers' output projections scaled by {args.late_scale}). "
              f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}.")
    lines = [header, "", "| configuration | batch | s | tok/s | speed-up vs stock generate | accepted/drafted | "
             "identical |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['configuration']} | {r['batch']} | {r['seconds']} | {r['tokens_per_s']} | {r['speedup']}x | "
              f"{r['accepted/drafted']} | {'yes' if r['identical'] else 'NO'} |" for r in rows]
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "table.md").write_text("\n".join(lines) + "\n")
        (args.out / "rows.json").write_text(json.dumps(rows, indent=1) + "\n")
        plot(rows, args.out / "speedup.png")


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.barh([r["configuration"] for r in rows], [r["speedup"] for r in rows], color="#4c72b0")
    ax.axvline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("speed-up over stock generate at the same batch")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
