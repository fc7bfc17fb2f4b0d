"""Shared fixtures: tiny random-weight models of several families, ragged batches, and scripted oracle drafts."""

from __future__ import annotations

import functools
import os

import pytest
import torch

# Triton kernels run under Triton's interpreter on machines without a GPU (read when kernels are first imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Default policies stay in memory: a state an earlier session saved must not steer this one's first calls
# (tests/test_saved_policy.py turns saving on in a folder of its own).
os.environ["SPEC_ADAPT_POLICY_DIR"] = "off"
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from spec_adapt import FixedLength, ScriptedDrafter

VOCAB = 96
PAD, BOS, EOS = 0, 1, 2


def tiny_model(arch: str, seed: int = 0, vocab: int = VOCAB, layers: int = 2):
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    if arch == "llama":
        cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=512, **common)
        model = LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=512, use_sliding_window=False, **common)
        model = Qwen2ForCausalLM(cfg)
    elif arch == "gpt2":
        cfg = GPT2Config(n_embd=32, n_layer=layers, n_head=4, n_positions=512, tie_word_embeddings=False, **common)
        model = GPT2LMHeadModel(cfg)
    else:
        raise ValueError(arch)
    # Random init gives near-uniform logits; a larger output scale makes greedy choices clear-cut, like a real LM.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.eval()



def sampling_pair():
    """A target with milder logits than the greedy fixtures (real choices to sample) and a draft perturbed from it."""
    from spec_adapt.tools.synthetic import perturbed_copy

    target = tiny_model("llama", seed=11)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.15)
    return target, perturbed_copy(target, 0.4, seed=2)


@functools.lru_cache(maxsize=None)
def cached_model(arch: str, seed: int = 0, vocab: int = VOCAB):
    return tiny_model(arch, seed, vocab)


def ragged_batch(batch: int, seed: int = 0, max_len: int = 9):
    """Left-padded prompts of different lengths: (input_ids [B, L], attention_mask [B, L])."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [max_len - (i * 3) % 5 for i in range(batch)]
    ids = torch.full((batch, max_len), PAD, dtype=torch.long)
    mask = torch.zeros(batch, max_len, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, max_len - n:] = torch.randint(3, VOCAB, (n,), generator=gen)
        mask[b, max_len - n:] = 1
    return ids, mask


def stock_greedy(model, ids, mask, **kw):
    kw.setdefault("max_new_tokens", 24)
    return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, **kw)


def spec_generate(model, ids, mask, drafter, policy, max_new_tokens=24, **kw):
    """Greedy spec_adapt generation with no EOS: (sequences, SpecStats)."""
    import spec_adapt

    stats = spec_adapt.SpecStats()
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, eos_token_id=None,
                         max_new_tokens=max_new_tokens, custom_generate=spec_adapt.generate,
                         drafter=drafter, assistant_policy=policy, spec_stats=stats, **kw)
    return out, stats


class Oracle:
    """Scripted drafts that know the target's greedy answer (the stock reference output).

    mode per row: "right" (always right), "wrong" (always wrong), an int j (right for exactly j tokens, then wrong).
    Right continuations stop after EOS: nothing after EOS can be accepted.
    """

    def __init__(self, reference: torch.Tensor, mask: torch.Tensor, modes, eos=(EOS,)):
        self.reference, self.modes, self.eos = reference, modes, set(eos)
        self.pad = (mask == 0).sum(dim=1).tolist()

    def right(self, row, context, gamma):
        seq = self.reference[row, self.pad[row]:].tolist()
        out = seq[len(context): len(context) + gamma]
        for i, t in enumerate(out):
            if t in self.eos:
                return out[: i + 1]
        return out

    def __call__(self, row, context, gamma):
        mode = self.modes[row % len(self.modes)]
        right = self.right(row, context, gamma)
        j = {"right": gamma, "wrong": 0}.get(mode, mode)
        out = right[:j]
        if out and out[-1] in self.eos:    # the row ends here: nothing after it can count
            return out
        for i in range(len(out), gamma):
            out.append((right[i] + 1) % VOCAB if i < len(right) else 3)
        return out

    def expected_accepted(self, row, drafted):
        mode = self.modes[row % len(self.modes)]
        j = {"right": drafted, "wrong": 0}.get(mode, mode)
        return min(j, drafted)

    def drafter(self):
        return ScriptedDrafter(self)


class SpareRows(FixedLength):
    """FixedLength that keeps every row that leaves as a spare row: the target always runs the first batch shape."""

    def batch_rows(self, live, held):
        return held


class Collect:
    """A streamer that records what it is given and whether it was ended."""

    def __init__(self):
        self.tokens, self.ended = [], False

    def put(self, value):
        self.tokens.extend(value.flatten().tolist())

    def end(self):
        self.ended = True


@pytest.fixture(scope="session")
def llama():
    return cached_model("llama")


def drive_engine(engine, prompts, budgets, arrivals):
    """Submit request i at engine step arrivals[i] (a deterministic schedule); step until all are done. The handles."""
    handles, step = [None] * len(prompts), 0
    while True:
        for i, at in enumerate(arrivals):
            if at == step:
                handles[i] = engine.submit(prompts[i], max_new_tokens=budgets[i])
        busy = engine.step()
        step += 1
        if not busy and step > max(arrivals):
            return handles


class Breaks(torch.nn.Module):
    """Wraps a model; its forward raises an out-of-memory error from the n-th call on."""

    def __init__(self, model, after):
        super().__init__()
        self.inner, self.after, self.calls = model, after, 0
        self.config, self.device, self.forward_signature = model.config, model.device, None

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, **kwargs):
        self.calls += 1
        if self.calls > self.after:
            raise torch.OutOfMemoryError("simulated out of memory in an intermediate level")
        return self.inner(**kwargs)
