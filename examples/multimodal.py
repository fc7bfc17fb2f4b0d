"""Speculative decoding of an encoder-decoder target, batched: Whisper with a draft decoder that shares its encoder
outputs (Distil-Whisper's shape), and with prompt lookup. Each output is checked against stock greedy generate.

    python examples/multimodal.py                 # Whisper at whisper-tiny's shape, random weights (offline)
    python examples/multimodal.py --whisper openai/whisper-large-v2 --draft distil-whisper/distil-large-v2

A vision-language model works the same way: pass `pixel_values=` (and what its processor returns) to generate.
"""

import argparse
import sys
from pathlib import Path

import torch

import spec_adapt
from spec_adapt import PromptLookupDrafter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def load(args):
    if args.whisper is None:
        from encoder_decoder import models

        return models(draft_layers=2, late_scale=0.3)
    from transformers import WhisperForCausalLM, WhisperForConditionalGeneration

    return (WhisperForConditionalGeneration.from_pretrained(args.whisper).eval(),
            WhisperForCausalLM.from_pretrained(args.draft).eval())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--whisper", default=None, help="a Whisper checkpoint (default: random whisper-tiny shape)")
    parser.add_argument("--draft", default=None, help="its draft decoder as a WhisperForCausalLM checkpoint")
    args = parser.parse_args()
    target, draft = load(args)
    audio = torch.randn(3, target.config.num_mel_bins, 2 * target.config.max_source_positions)   # 3 clips' features
    plain = target.generate(input_features=audio, max_new_tokens=32, do_sample=False)

    spec_adapt.enable(target)       # stock's assistant_model= now speculates at any batch size
    for name, drafter in (("draft decoder", draft), ("prompt lookup", PromptLookupDrafter())):
        out = target.generate(input_features=audio, max_new_tokens=32, do_sample=False, assistant_model=drafter)
        print(f"{name}: identical to plain generate: {torch.equal(out, plain)}")
        print(spec_adapt.last_stats().summary())


if __name__ == "__main__":
    main()
