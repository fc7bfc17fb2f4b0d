"""A draft whose head scores only part of the vocabulary (ModelDrafter(head_tokens=...)): lossless, greedy and
sampled, and the part it scores grows with what it sees."""

from __future__ import annotations

import pytest
import torch

import spec_adapt
from spec_adapt import FixedLength, ModelDrafter
from spec_adapt.drafters.head import ShortHead, check_short_head

from conftest import EOS, PAD, VOCAB, cached_model, ragged_batch, stock_greedy, tiny_model
from test_identity import run_spec
from test_sampling import assert_follows_target, small  # noqa: F401  (fixture)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_short_head_scores_the_kept_tokens_like_the_model(arch):
    model = cached_model(arch)
    short = ShortHead(model, 10)
    short.add(torch.tensor([[50, 60], [61, -1]]))               # out-of-range ids are ignored
    kept = torch.zeros(VOCAB, dtype=torch.bool)
    kept[:10] = True
    kept[[EOS, PAD, 50, 60, 61]] = True
    assert torch.equal(short.keep, kept)
    ids = torch.tensor([[5, 9, 50, 3], [7, 7, 8, 60]])
    with torch.no_grad():
        full = model(input_ids=ids).logits
        cut = short(input_ids=ids).logits
        last = short(input_ids=ids, logits_to_keep=torch.tensor([[1], [3]])).logits
    torch.testing.assert_close(cut[..., kept], full[..., kept])
    assert bool(torch.isinf(cut[..., ~kept]).all())
    torch.testing.assert_close(last[:, 0], cut[[0, 1], [1, 3]])


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("batch", [1, 5])
def test_same_weights_whole_head_accepts_everything(arch, batch):
    """With every token kept, a draft that is the target must have every draft accepted: the cut path computes the
    model's own logits at the positions the ledger reads (a wrong column would show as a rejection)."""
    model = cached_model(arch)
    ids, mask = ragged_batch(batch, seed=21)
    reference = stock_greedy(model, ids, mask, eos_token_id=None)
    out, stats = run_spec(model, ids, mask, ModelDrafter(model, head_tokens=VOCAB), FixedLength(4), eos_token_id=None)
    assert torch.equal(out, reference)
    assert stats.fallback is None and stats.drafted > 0 and stats.accepted == stats.drafted


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("batch", [1, 5, 8])
def test_short_head_greedy_identity(arch, batch):
    """Half the vocabulary cut: the target's tokens outside it are never drafted, yet output is unchanged."""
    model = cached_model(arch)
    ids, mask = ragged_batch(batch, seed=22)
    reference = stock_greedy(model, ids, mask, eos_token_id=None)
    drafter = ModelDrafter(model, head_tokens=VOCAB // 2)
    out, stats = run_spec(model, ids, mask, drafter, FixedLength(3), eos_token_id=None)
    assert torch.equal(out, reference)
    assert stats.fallback is None and 0 < stats.accepted < stats.drafted
    # Everything the call committed is scored from the next call on.
    assert bool(drafter.short.keep[reference.unique()].all())


def test_short_head_sampling_follows_target_distribution(small):  # noqa: F811
    target, draft = small
    drafter = ModelDrafter(draft, head_tokens=6)      # 6 lowest ids + prompt tokens + special ids of 16
    assert_follows_target(target, drafter, 6000)


def test_refused_settings_and_models():
    model = cached_model("llama")
    for bad in (0, VOCAB + 1, 2.5, True):
        with pytest.raises(ValueError, match="head_tokens"):
            ModelDrafter(model, head_tokens=bad)
    capped = tiny_model("llama", seed=0)
    original = capped.forward

    def soft_capped(*args, **kwargs):
        out = original(*args, **kwargs)
        out.logits = 3.0 * torch.tanh(out.logits / 3.0)
        return out

    capped.forward = soft_capped
    with pytest.raises(ValueError, match="soft-capping"):
        check_short_head(ShortHead(capped, 10))
    ids, mask = ragged_batch(2, seed=23)
    with pytest.raises(ValueError, match="soft-capping"):
        spec_adapt.generate(model, input_ids=ids, attention_mask=mask, drafter=ModelDrafter(capped, head_tokens=10),
                            max_new_tokens=4, pad_token_id=PAD)
