"""Speculative decoding of an encoder-decoder target, batched: Whisper with a draft decoder that shares its encoder
outputs (Distil-Whisper's shape), with a smaller Whisper that runs its own encoder, and with prompt lookup. Each
output is checked against stock greedy generate.

    python examples/multimodal.py                 # Whisper at whisper-tiny's shape, random weights (offline)
    python examples/multimodal.py --whisper openai/whisper-large-v2 --draft distil-whisper/distil-large-v2 \
        --own-encoder openai/whisper-tiny

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

        target, draft = models(draft_layers=2, late_scale=0.3)
        return target, draft, own_encoder_draft(target)
    from transformers import WhisperForCausalLM, WhisperForConditionalGeneration

    return (WhisperForConditionalGeneration.from_pretrained(args.whisper).eval(),
            WhisperForCausalLM.from_pretrained(args.draft).eval(),
            WhisperForConditionalGeneration.from_pretrained(args.own_encoder).eval())


def own_encoder_draft(target, layers: int = 2):
    """A Whisper with the target's encoder and its first `layers` decoder layers: an encoder-decoder draft (whisper-
    tiny's role for a larger Whisper) whose encoder spec_adapt runs once per call on the call's audio."""
    from transformers import WhisperForConditionalGeneration

    config = target.config.__class__(**{**target.config.to_dict(), "decoder_layers": layers})
    draft = WhisperForConditionalGeneration(config).eval()
    draft.load_state_dict(target.state_dict(), strict=False)       # the layers it has, the head and embeddings
    return draft


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--whisper", default=None, help="a Whisper checkpoint (default: random whisper-tiny shape)")
    parser.add_argument("--draft", default=None, help="its draft decoder as a WhisperForCausalLM checkpoint")
    parser.add_argument("--own-encoder", default="openai/whisper-tiny",
                        help="with --whisper: a smaller Whisper of the same vocabulary, which runs its own encoder")
    args = parser.parse_args()
    target, draft, small = load(args)
    audio = torch.randn(3, target.config.num_mel_bins, 2 * target.config.max_source_positions)   # 3 clips' features
    plain = target.generate(input_features=audio, max_new_tokens=32, do_sample=False)

    spec_adapt.enable(target)       # stock's assistant_model= now speculates at any batch size
    # enable hands a draft with its own encoder the call's input_features (generate itself passes on only the
    # target's encoder outputs).
    drafters = (("draft decoder", draft), ("draft with its own encoder", small), ("prompt lookup", PromptLookupDrafter()))
    for name, drafter in drafters:
        out = target.generate(input_features=audio, max_new_tokens=32, do_sample=False, assistant_model=drafter)
        print(f"{name}: identical to plain generate: {torch.equal(out, plain)}")
        print(spec_adapt.last_stats().summary())


if __name__ == "__main__":
    main()
