"""Tokenizers built in the tests (no download): a character-level one whose ids match the tiny models' vocabulary,
and small BPE tokenizers trained on a fixed corpus (SentencePiece-style Metaspace, and GPT-2-style byte level)."""

from __future__ import annotations

import functools

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]      # ids 0, 1, 2 = conftest's PAD, BOS, EOS

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
    "Le café est très bon, naïve résumé, déjà vu.",
    "数据 模型 推理 速度 中文 文本",
    "emoji 🙂 and 🚀 rockets, ümlaut ß straße",
    "class Stack:\n    def push(self, x):\n        self.items.append(x)\n",
    "import torch\nx = torch.zeros(3, 4)\ny = x.sum(dim=1)\n",
    "A batch of rows, each with its own prompt, decodes together.",
    "the the the of of and and to to in in is is it it",
    "Hello, world! How are you today? I am fine, thank you.",
]


def _wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@functools.lru_cache(maxsize=None)
def char_tokenizer(size: int = 96) -> PreTrainedTokenizerFast:
    """One token per printable ASCII character, `size` ids in all: every id sequence is its text's only
    tokenization."""
    chars = [chr(c) for c in range(32, 32 + size - len(SPECIALS))]
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return _wrap(tokenizer)


@functools.lru_cache(maxsize=None)
def bpe_tokenizer(kind: str, size: int) -> PreTrainedTokenizerFast:
    """A BPE tokenizer of `size` ids trained on CORPUS: kind "metaspace" (SentencePiece-style word starts) or
    "bytelevel" (GPT-2-style bytes: multi-byte characters span tokens)."""
    if kind == "metaspace":
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        tokenizer.decoder = decoders.Metaspace()
        alphabet = []
    else:
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=SPECIALS, initial_alphabet=alphabet,
                                  show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    return _wrap(tokenizer)
