"""What the benchmarks' `--smoke` modes share (tests/test_benchmarks.py runs every script so).

A smoke run takes the script's own code path end to end at the smallest size it accepts: models are tiny random-weight
Llamas and the tokenizer is built in memory (one id per character, with a chat template), so nothing is downloaded;
workloads are the installed recipes; whatever the script writes goes to a temporary folder, never to results/.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
from pathlib import Path

import torch

VOCAB = 5120                 # the scripts feed random ids up to 5000
HELP = "a tiny random-weight model and the smallest sizes, written to a temporary folder: checks the script runs"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def add(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help=HELP)


def apply(args: argparse.Namespace, namespace: dict | None = None, **small) -> argparse.Namespace:
    """With --smoke: the given options take these small values, no policy state is saved, and with `namespace` (the
    script's globals) every model loaded is a tiny one (`use_tiny_models`)."""
    if args.smoke:
        os.environ["SPEC_ADAPT_POLICY_DIR"] = "off"
        for name, value in small.items():
            setattr(args, name, value)
        if namespace is not None:
            use_tiny_models(namespace)
    return args


def folder(name: str = "out") -> str:
    """A path in a temporary folder for what a smoke run writes (the folder is removed at exit)."""
    return str(Path(_tmp().name) / name)


@functools.cache
def _tmp():
    return tempfile.TemporaryDirectory(prefix="spec-adapt-smoke-")


@functools.cache
def tokenizer():
    """One token per printable character (and newline, tab), ids padded up to VOCAB, left padding."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = ["\n", "\t"] + [chr(c) for c in range(32, 127)]
    extra = [f"<x{i}>" for i in range(VOCAB - len(specials) - len(chars))]
    vocab = {t: i for i, t in enumerate(specials + chars + extra)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>", padding_side="left")
    tok.chat_template = TEMPLATE
    return tok


@functools.cache
def target():
    """A 2-layer, 64-wide random Llama with clear-cut greedy choices (its head scaled, as a trained model's)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config.pad_token_id = 0
    return model


def load_model(name: str = "target", dtype: torch.dtype = torch.float32, *args, **kwargs):
    """`spec_adapt.loading.load_model`'s stand-in: (model, tokenizer). The first name asked for is the tiny target,
    any other a perturbed copy of it (a draft that agrees with it often); each call returns a model of its own."""
    import copy

    from spec_adapt.tools.synthetic import perturbed_copy

    first = _names.setdefault("first", name)
    base = target()
    model = copy.deepcopy(base) if name == first else perturbed_copy(base, 0.05, seed=len(name))
    return model.to(dtype).eval(), tokenizer()


_names: dict = {}


def use_tiny_models(namespace: dict | None = None) -> None:
    """Every `load_model` the run reaches (the library's, and the script's own name in `namespace`) loads the tiny
    models above."""
    from spec_adapt import loading
    from spec_adapt.tools import models

    loading.load_model = models.load_model = load_model
    if namespace is not None and "load_model" in namespace:
        namespace["load_model"] = load_model
