"""Every Triton kernel against its PyTorch reference (exact for integer outputs and data movement), under Triton's
interpreter on the CPU, across odd vocabularies, empty drafts, batch sizes, dtypes and seeds; and the loop with
kernels on and off."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import spec_adapt  # noqa: E402
from spec_adapt import FixedLength, ModelDrafter
from spec_adapt import acceptor  # noqa: E402
from spec_adapt.acceptance_rules import greedy_accept, rejection_sample, sample_randoms  # noqa: E402
from spec_adapt.kernels.compact import gather_slots  # noqa: E402
from spec_adapt.kernels.verify import greedy_verify, rejection_verify, token_rank, token_rank_reference  # noqa: E402

from conftest import PAD, cached_model, ragged_batch, tiny_model  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 0, 1000), (3, 1, 4099), (5, 4, 32005), (16, 3, 151), (2, 8, 49152)]


def drafts_agreeing(logits, width, gen):
    """Drafts that match the target's argmax for a random prefix of each row, then differ."""
    batch = logits.shape[0]
    target = logits.float().argmax(-1)
    agree = torch.randint(0, width + 1, (batch,), generator=gen)
    noise = torch.randint(0, logits.shape[-1], (batch, width), generator=gen)
    pos = torch.arange(width)[None, :]
    return torch.where(pos < agree[:, None], target[:, :width], noise)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_kernel_matches_reference(shape, dtype, seed):
    batch, width, vocab = shape
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, width + 1, vocab, generator=gen).to(dtype)
    drafts = drafts_agreeing(logits, width, gen)
    lengths = torch.randint(0, width + 1, (batch,), generator=gen)
    ref = greedy_accept(logits, drafts, lengths)
    out = greedy_verify(logits, drafts, lengths)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


@pytest.mark.parametrize("chunk", [64, 100, 8192])
def test_greedy_kernel_breaks_ties_to_the_first_index_across_chunks(chunk):
    """Equal maxima in several vocabulary chunks (and inside one block): the first index wins, as torch.argmax."""
    vocab, width = 700, 3
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, width + 1, vocab, generator=gen).round()     # many equal values
    logits[0, :, [5, 64, 650]] = 9.0                                      # ties in three chunks
    logits[1, :, [699, 128]] = 9.0                                        # the later chunk first in the list
    logits[2, :, :] = float("-inf")                                       # nothing finite: index 0
    logits[3, 1, [63, 64]] = 9.0                                          # a tie across a chunk boundary
    drafts = logits.argmax(-1)[:, :width].clone()
    drafts[3, 2] = (drafts[3, 2] + 1) % vocab                             # row 3 is rejected at position 2
    lengths = torch.tensor([3, 2, 3, 3])
    ref = greedy_accept(logits, drafts, lengths)
    out = greedy_verify(logits, drafts, lengths, block=32, chunk=chunk)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert out[1].tolist()[:2] == [5, 128] and out[0].tolist()[3] == 2


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_rejection_kernel_matches_reference_bit_for_bit(shape, dtype, point_mass, seed):
    batch, width, vocab = shape
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(batch, width + 1, vocab, generator=gen).mul(3).softmax(-1).to(dtype)
    q = None if point_mass else torch.randn(batch, width, vocab, generator=gen).mul(3).softmax(-1).to(dtype)
    source = q.float() if q is not None else p[:, :width].float()
    drafts = torch.multinomial(source.reshape(-1, vocab), 1, generator=gen).reshape(batch, width) if width else \
        torch.zeros(batch, 0, dtype=torch.long)
    lengths = torch.randint(0, width + 1, (batch,), generator=gen)
    u, e = sample_randoms(batch, width, vocab, torch.device("cpu"), gen)
    ref = rejection_sample(p, drafts, q, lengths, u, e)
    out = rejection_verify(p, drafts, q, lengths, u, e)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


@pytest.mark.parametrize("chunk", [64, 100, 8192])
@pytest.mark.parametrize("point_mass", [False, True])
def test_rejection_kernel_splits_the_vocabulary_and_keeps_the_first_index_on_ties(chunk, point_mass):
    """Small chunks make many partials per row; equal race scores in several chunks (and inside one block) must give
    the first index overall, as torch.argmax, whether the row samples from the residual or from p."""
    batch, width, vocab = 6, 3, 700
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(batch, width + 1, vocab, generator=gen).mul(3).softmax(-1)
    q = None if point_mass else torch.randn(batch, width, vocab, generator=gen).mul(3).softmax(-1)
    drafts = torch.randint(0, vocab, (batch, width), generator=gen)
    lengths = torch.tensor([3, 0, 2, 3, 1, 3])
    u, e = sample_randoms(batch, width, vocab, torch.device("cpu"), gen)
    u[0], u[3] = 0.0, 1.0                        # row 0 accepts all where it may, row 3 rejects its first draft
    p[3, 0] = torch.nn.functional.one_hot(drafts[3, 0], vocab).float()
    if q is not None:
        q[3, 0] = p[3, 0]                        # row 3: p == q, no residual mass, so the row samples from p
    p[4], e[4] = 1.0 / vocab, 1.0                # row 4: flat p and flat race, so every index ties
    p[5, :, [5, 64, 650]] = 0.5                  # row 5: three equal winners in three chunks
    e[5, [5, 64, 650]] = 1e-3
    ref = rejection_sample(p, drafts, q, lengths, u, e)
    out = rejection_verify(p, drafts, q, lengths, u, e, block=32, chunk=chunk)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert out[1].tolist()[3:5] == [drafts[3, 0].item(), 0]


@pytest.mark.parametrize("chunk", [64, 100, 8192])
def test_rank_kernel_sums_its_chunks(chunk):
    """Counts summed over chunks, none counted twice where the last block of a chunk reaches past its end."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 700, generator=gen).round()      # many equal values: "strictly above" must hold
    tokens = torch.randint(0, 700, (5,), generator=gen)
    assert torch.equal(token_rank(logits, tokens, block=32, chunk=chunk), token_rank_reference(logits, tokens))


@pytest.mark.parametrize("n, vocab", [(1, 1000), (7, 32005), (33, 151), (4, 151936)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rank_kernel_matches_reference(n, vocab, dtype):
    gen = torch.Generator().manual_seed(n)
    logits = torch.randn(n, vocab, generator=gen).to(dtype)
    tokens = torch.randint(0, vocab, (n,), generator=gen)
    tokens[0] = logits[0].float().argmax()                       # rank 0 case
    assert torch.equal(token_rank(logits, tokens), token_rank_reference(logits, tokens))


@pytest.mark.parametrize("batch, heads, length, dim", [(1, 1, 5, 8), (3, 4, 37, 64), (16, 2, 9, 48)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_compaction_kernel_matches_reference(batch, heads, length, dim, dtype):
    gen = torch.Generator().manual_seed(length)
    cache = torch.randn(batch, heads, length, dim, generator=gen).to(dtype)
    keep = max(1, length // 2)
    index = torch.stack([torch.randperm(length, generator=gen)[:keep].sort().values for _ in range(batch)])
    assert torch.equal(gather_slots(cache, index), acceptor.gather_slots_reference(cache, index))


@pytest.mark.parametrize("do_sample, rule", [(False, "coupled"), (True, "coupled"), (True, "rejection")])
def test_loop_identical_with_kernels_on_and_off(do_sample, rule):
    model = cached_model("llama")
    draft = tiny_model("llama", seed=9, layers=1)
    ids, mask = ragged_batch(4, seed=60)
    outputs = {}
    for mode in ("force", "off"):
        torch.manual_seed(0)
        stats = spec_adapt.SpecStats()
        outputs[mode] = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=do_sample, pad_token_id=PAD, eos_token_id=None,
            max_new_tokens=20, custom_generate=spec_adapt.generate, drafter=ModelDrafter(draft),
            assistant_policy=FixedLength(3),
            spec_stats=stats, acceptor=acceptor.Acceptor(kernels=mode, rule=rule))
        path = "greedy" if not do_sample else rule       # the coupled rule runs the greedy kernel over scores + noise
        assert stats.kernel_paths[path] == ("triton" if mode == "force" else "torch")
    assert torch.equal(outputs["force"], outputs["off"])


def test_compaction_through_the_ledger_with_kernels():
    from spec_adapt.ledger import KVLedger

    model = cached_model("llama")
    ids, mask = ragged_batch(3, seed=61)
    results = []
    for mode in ("force", "off"):
        ledger = KVLedger(model, kernels=mode)
        ledger.prefill(ids, mask)
        ledger.forward(torch.randint(3, 90, (3, 4), generator=torch.Generator().manual_seed(0)), torch.tensor([4, 2, 3]))
        ledger.rollback(ledger.n_cached - torch.tensor([2, 1, 3]))
        ledger.compact()
        results.append([layer.keys.clone() for layer in ledger.cache.layers] + [ledger.slots.clone()])
        assert ledger.compact_path == ("triton" if mode == "force" else "torch")
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_a_chunk_that_is_no_power_of_two_scans_in_a_power_of_two_block_and_bad_sizes_are_refused():
    """tl.arange takes powers of two: a 100-token chunk scans in blocks of 128, masked at the chunk's end."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 3, 700, generator=gen)
    drafts, lengths = logits.argmax(-1)[:, :2], torch.tensor([2, 1, 0])
    ref = greedy_accept(logits, drafts, lengths)
    out = greedy_verify(logits, drafts, lengths, chunk=100)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert torch.equal(token_rank(logits[:, 0], drafts[:, 0], chunk=100),
                       token_rank_reference(logits[:, 0], drafts[:, 0]))
    for bad in (dict(chunk=0), dict(block=100), dict(block=0)):
        with pytest.raises(ValueError, match="power of two"):
            greedy_verify(logits, drafts, lengths, **bad)
