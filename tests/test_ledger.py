"""KV ledger properties: any sequence of appends, per-row rollbacks, compactions and row removals (keeping spare
rows or not) leaves attention over the valid entries identical to a cache built fresh from the committed tokens."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from spec_adapt.compat import with_cache
from spec_adapt.ledger import KVLedger

from conftest import VOCAB, cached_model

op = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 5), st.integers(0, 2**31 - 1)),
    st.tuples(st.just("rollback"), st.integers(0, 2**31 - 1)),
    st.tuples(st.just("compact")),
    st.tuples(st.just("drop_row"), st.integers(0, 7), st.integers(0, 2)),   # (row, spare rows to keep)
    st.tuples(st.just("release")),
)


def fresh_logits(model, sequences):
    """Last-position logits of each sequence, from a new left-padded prefill."""
    longest = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(sequences):
        ids[b, longest - len(s):] = torch.tensor(s)
        mask[b, longest - len(s):] = 1
    ledger = KVLedger(model)
    return ledger.prefill(ids, mask)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(1, 4), prompt_seed=st.integers(0, 1000), ops=st.lists(op, min_size=1, max_size=8),
       arch=st.sampled_from(["llama", "gpt2"]))
def test_ledger_matches_fresh_cache(batch, prompt_seed, ops, arch):
    model = cached_model(arch)
    gen = torch.Generator().manual_seed(prompt_seed)
    lengths = torch.randint(1, 6, (batch,), generator=gen).tolist()
    width = max(lengths)
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    seqs = []
    for b, n in enumerate(lengths):
        toks = torch.randint(3, VOCAB, (n,), generator=gen)
        ids[b, width - n:], mask[b, width - n:] = toks, 1
        seqs.append(toks.tolist())
    ledger = KVLedger(model, compact_threshold=2.0)   # compaction only when the test asks for it
    ledger.prefill(ids, mask)
    pads = [width - n for n in lengths]

    with torch.no_grad():
        for operation in ops:
            kind = operation[0]
            if kind == "append":
                _, chunk, seed = operation
                g = torch.Generator().manual_seed(seed)
                tokens = torch.randint(3, VOCAB, (len(seqs), chunk), generator=g)
                n_valid = torch.randint(0, chunk + 1, (len(seqs),), generator=g)
                ledger.forward(tokens, n_valid)
                for b in range(len(seqs)):
                    seqs[b] += tokens[b, : int(n_valid[b])].tolist()
            elif kind == "rollback":
                g = torch.Generator().manual_seed(operation[1])
                keep = [int(torch.randint(1, len(s) + 1, (1,), generator=g)) for s in seqs]
                ledger.rollback(torch.tensor([k + p for k, p in zip(keep, pads)]))
                seqs = [s[:k] for s, k in zip(seqs, keep)]
            elif kind == "compact":
                ledger.compact()
            elif kind == "drop_row" and len(seqs) > 1:
                drop = operation[1] % len(seqs)
                keep_rows = [b for b in range(len(seqs)) if b != drop]
                ledger.select_rows(torch.tensor(keep_rows), spare=operation[2])
                seqs, pads = [seqs[b] for b in keep_rows], [pads[b] for b in keep_rows]
            elif kind == "release":
                ledger.release_spares()
            assert all(layer.keys.shape[0] == ledger.held_rows for layer in ledger._layers())
            assert ledger.held_rows == len(seqs) + ledger.spare

        assert ledger.n_cached.tolist() == [len(s) + p for s, p in zip(seqs, pads)]
        assert ((ledger.slots >= 0).sum(dim=1)).tolist() == [len(s) for s in seqs]
        # Probe: one or two more tokens per row through the ledger, read at each row's last one (the draft's
        # catch-up path: `columns`), vs. a fresh prefill of the same sequences.
        probe = torch.randint(3, VOCAB, (len(seqs), 2), generator=gen)
        n_probe = torch.randint(1, 3, (len(seqs),), generator=gen)
        ours = ledger.forward(probe, n_probe, columns=(n_probe - 1)[:, None])[:, 0]
        assert ours.shape[0] == len(seqs)                       # spare rows' logits never come back
        theirs = fresh_logits(model, [s + probe[b, : int(n_probe[b])].tolist() for b, s in enumerate(seqs)])
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_rollback_is_only_a_mask_and_trim():
    """Rollback moves no data: surviving entries keep their physical slots; only the all-hole tail is trimmed."""
    model = cached_model("llama")
    ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    ledger = KVLedger(model)
    ledger.prefill(ids, mask)
    ledger.forward(torch.tensor([[10, 11, 12], [13, 14, 0]]), torch.tensor([3, 2]))
    assert ledger.slots.tolist() == [[-1, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, -1]]
    keys_before = ledger.cache.layers[0].keys.clone()
    ledger.rollback(torch.tensor([5, 4]))
    assert ledger.slots.tolist() == [[-1, 1, 2, 3, 4], [0, 1, 2, 3, -1]]
    assert torch.equal(ledger.cache.layers[0].keys, keys_before[:, :, :5])
    ledger.compact()
    assert ledger.slots.tolist() == [[1, 2, 3, 4], [0, 1, 2, 3]]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(1, 4), padded=st.booleans(),
       steps=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 2**31 - 1)), min_size=1, max_size=6))
def test_a_rollback_told_what_rows_give_back_ends_as_one_that_reads(batch, padded, steps):
    """The loop tells the rollback how many of a dense verification's columns each row gives back (`dropped`): the
    ledger must end exactly as one that reads its slots (slots, counts, length, whether it knows itself without
    holes, compactions), and attend alike. A padded prompt has holes: the hint is not enough there, and is ignored."""
    model = cached_model("llama")
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, VOCAB, (batch, 4), generator=gen)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :2] = 0
    told, read = KVLedger(model), KVLedger(model)
    with torch.no_grad():
        for ledger in (told, read):
            ledger.prefill(ids, mask)
        for width, seed in steps:
            g = torch.Generator().manual_seed(seed)
            tokens = torch.randint(3, VOCAB, (batch, width), generator=g)
            dropped = torch.randint(0, width + 1, (batch,), generator=g)
            for ledger in (told, read):
                ledger.forward(tokens, ledger.filled(batch, width))
            told.rollback(told.n_cached - dropped, dropped.tolist())
            read.rollback(read.n_cached - dropped)
            assert torch.equal(told.slots, read.slots) and torch.equal(told.n_cached, read.n_cached)
            assert (told.slots is told._full) == (read.slots is read._full)
            assert told.compactions == read.compactions
            assert all(a.keys.shape == b.keys.shape for a, b in zip(told._layers(), read._layers()))
        probe = torch.randint(3, VOCAB, (batch, 1), generator=gen)
        ones = torch.ones(batch, dtype=torch.long)
        torch.testing.assert_close(told.forward(probe, ones), read.forward(probe, ones))


@pytest.mark.parametrize("dropped", [[-1, 0], [0, 9], [0], [0.5, 0], [True, 0]])
def test_a_rollback_hint_that_is_not_counts_of_the_ledgers_columns_is_ignored(dropped):
    """A hint of the wrong length, a negative count, one past the ledger's columns or a non-int: the rollback reads
    its slots instead, and ends where the keep lengths say."""
    model = cached_model("llama")
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    told, read = KVLedger(model), KVLedger(model)
    with torch.no_grad():
        for ledger in (told, read):
            ledger.prefill(ids, torch.ones_like(ids))
            ledger.forward(torch.tensor([[11, 12], [13, 14]]), ledger.filled(2, 2))
        told.rollback(told.n_cached - 1, dropped)      # each row gives back its last column: the cache is trimmed
        read.rollback(read.n_cached - 1)
    assert torch.equal(told.slots, read.slots) and torch.equal(told.n_cached, read.n_cached)
    assert (told.slots is told._full) == (read.slots is read._full)


def test_spare_rows_keep_the_batch_shape_and_leave_with_added_rows():
    """A row that leaves can stay in the cache as a spare: the model still runs 3 rows, the ledger describes 2;
    adding rows releases it first."""
    model = cached_model("llama")
    ids = torch.tensor([[0, 5, 6], [7, 8, 9], [4, 4, 4]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [1, 1, 1]])
    ledger = KVLedger(model)
    ledger.prefill(ids, mask)
    ledger.select_rows(torch.tensor([0, 2]), spare=5)          # at most the one row that left
    assert (ledger.spare, ledger.held_rows, ledger.slots.shape[0]) == (1, 3, 2)
    seen = []
    handle = model.register_forward_hook(lambda mod, args, kwargs, out: seen.append(kwargs["input_ids"].shape),
                                         with_kwargs=True)
    try:
        logits = ledger.forward(torch.tensor([[10], [11]]), torch.tensor([1, 1]))
    finally:
        handle.remove()
    assert seen == [(3, 1)] and logits.shape[0] == 2
    other = KVLedger(model)
    other.prefill(torch.tensor([[3, 3]]), None)
    ledger.add_rows(other)
    assert (ledger.spare, ledger.held_rows) == (0, 3)
    assert ledger.cache.layers[0].keys.shape[0] == 3


class _NoLogitsToKeep(torch.nn.Module):
    """A causal LM whose forward does not take `logits_to_keep` (older remote-code models)."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config = model, model.config

    @property
    def device(self):
        return self.inner.device

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=True):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=use_cache, **with_cache(self.inner, past_key_values))


def test_columns_read_the_same_logits_with_or_without_logits_to_keep():
    model = cached_model("llama")
    ids = torch.randint(3, VOCAB, (3, 4), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]])
    chunk = torch.randint(3, VOCAB, (3, 3), generator=torch.Generator().manual_seed(1))
    n_valid, columns = torch.tensor([3, 1, 2]), torch.tensor([[2, 0], [0, 0], [1, 0]])
    with torch.no_grad():
        full = KVLedger(model)
        full.prefill(ids, mask)
        expected = full.forward(chunk, n_valid).gather(1, columns[..., None].expand(-1, -1, VOCAB))
        for wrapped in (model, _NoLogitsToKeep(model)):
            ledger = KVLedger(wrapped)
            assert ledger._keeps_logits == (wrapped is model)
            ledger.prefill(ids, mask)
            torch.testing.assert_close(ledger.forward(chunk, n_valid, columns=columns), expected)
