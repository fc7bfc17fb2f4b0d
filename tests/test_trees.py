"""Token trees: validation, the acceptance walks (greedy and recursive rejection sampling), the ledger's tree
region against a fresh cache, and greedy identity through the loop with scripted, lookup, suffix and model trees."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

import spec_adapt
from spec_adapt import FixedLength, FixedTree, ModelDrafter, PromptLookupDrafter, ScriptedDrafter, SuffixDrafter
from spec_adapt.acceptance_rules import tree_greedy_accept, tree_rejection_sample
from spec_adapt.drafters.drafter import DraftRequest, InvalidProposal, Proposal, check_proposal
from spec_adapt.ledger import KVLedger
from spec_adapt.processors import ScoreProcessor
from spec_adapt.tree import ancestry, from_branches, path_nodes, tree_problems

from conftest import EOS, PAD, VOCAB, Oracle, cached_model, ragged_batch, spec_generate, stock_greedy, tiny_model


# -- trees as data -----------------------------------------------------------------------------------------------
@st.composite
def trees(draw, max_nodes=8, vocab=6):
    """A random well-formed tree: (tokens [S], parents [S]), siblings with distinct tokens."""
    n = draw(st.integers(0, max_nodes))
    tokens, parents = [], []
    for i in range(n):
        parent = draw(st.integers(-1, i - 1))
        used = {t for t, p in zip(tokens, parents) if p == parent}
        free = [t for t in range(vocab) if t not in used]
        if not free:
            break
        tokens.append(draw(st.sampled_from(free)))
        parents.append(parent)
    return tokens, parents


def as_batch(rows):
    width = max((len(t) for t, _ in rows), default=0)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    parents = torch.full((len(rows), width), -1, dtype=torch.long)
    for b, (t, p) in enumerate(rows):
        tokens[b, : len(t)], parents[b, : len(p)] = torch.tensor(t, dtype=torch.long), torch.tensor(p, dtype=torch.long)
    return tokens, parents, torch.tensor([len(t) for t, _ in rows])


def test_worked_example_of_the_module_docstring():
    tokens, parents, lengths = as_batch([([10, 11, 12, 13], [-1, -1, 0, 1])])
    anc, depth = ancestry(parents, lengths)
    assert depth.tolist() == [[1, 1, 2, 2]]
    assert anc[0, 2].nonzero().flatten().tolist() == [0, 2]
    assert tree_problems(parents, tokens, lengths) is None


@pytest.mark.parametrize("parents,tokens,problem", [
    ([-1, 0, 2], [5, 6, 7], "parent 2"),          # a parent after its child (and a cycle: 2 -> 2)
    ([-1, 0, 1], [5, 6, 7], None),
    ([-1, -1], [5, 5], "same token 5"),           # twins under the root
    ([-1, 0, 0], [5, 6, 6], "same token 6"),
    ([-1, -3], [5, 6], "parent -3"),
])
def test_tree_problems_are_named(parents, tokens, problem):
    found = tree_problems(torch.tensor([parents]), torch.tensor([tokens]), torch.tensor([len(tokens)]))
    assert (found is None) if problem is None else (problem in found)


def test_from_branches_merges_prefixes_and_keeps_the_budget():
    [(tokens, parents)] = from_branches([[[1, 2, 3], [1, 4], [5, 6]]], [5], [2])
    assert tokens == [1, 2, 4, 5, 6] and parents == [-1, 0, 0, -1, 3]
    [(tokens, parents)] = from_branches([[[1, 2, 3], [1, 4], [5, 6]]], [3], None)
    assert tokens == [1, 2, 3] and parents == [-1, 0, 1]


def brute_force_walk(best, tokens, parents):
    """The greedy walk written the obvious way: follow the child whose token is the argmax at the current column."""
    cur, path = 0, []
    while True:
        child = [i for i, (t, p) in enumerate(zip(tokens, parents)) if p + 1 == cur and t == best[cur]]
        if not child:
            return path, best[cur]
        cur = child[0] + 1
        path.append(child[0])


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(trees(), min_size=1, max_size=3), seed=st.integers(0, 10_000))
def test_greedy_walk_matches_the_obvious_walk(rows, seed):
    tokens, parents, lengths = as_batch(rows)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(rows), tokens.shape[1] + 1, 6, generator=gen)
    logits[..., :3] += 2.0 * torch.rand(len(rows), tokens.shape[1] + 1, 1, generator=gen)   # frequent matches
    path, accepted, next_token = tree_greedy_accept(logits, tokens, parents, lengths)
    best = logits.argmax(-1)
    for b, (t, p) in enumerate(rows):
        expect, token = brute_force_walk(best[b].tolist(), t, p)
        assert path[b].nonzero().flatten().tolist() == expect
        assert int(accepted[b]) == len(expect) and int(next_token[b]) == token
        nodes, counts = path_nodes(path)
        assert nodes[b, : int(counts[b])].tolist() == expect


# -- recursive rejection sampling: exact marginals ----------------------------------------------------------------
V = 5


def lossy_siblings(target_probs, draft_tokens, parents, draft_probs, lengths, uniforms, exponentials):
    """A naive tree rule: each sibling is tested against the untouched target p (no residual after a rejection)."""
    batch, width = draft_tokens.shape
    rows = torch.arange(batch)
    cur = torch.zeros(batch, dtype=torch.long)
    path = torch.zeros(batch, width, dtype=torch.bool)
    for i in range(width):
        tried = (parents[:, i] + 1 == cur) & (i < lengths)
        x = draft_tokens[:, i]
        p = target_probs[rows, cur]
        accept = tried & (uniforms[:, i] < p[rows, x])
        path[:, i] = accept
        cur = torch.where(accept, i + 1, cur)
    next_token = (target_probs[rows, cur] / exponentials).argmax(-1)
    return path, path.long().sum(1), next_token


def two_level_marginals(rule, n, with_probs, seed=0):
    """Sample n rows through `rule` on a fixed two-level tree; return the empirical distributions of the first two
    committed tokens and their exact ones. Root children [0, 1, 2] (drawn without replacement from q when
    with_probs), node 0 has children [3, 1]."""
    gen = torch.Generator().manual_seed(seed)
    p_root = torch.tensor([0.1, 0.2, 0.15, 0.25, 0.3])
    p_after = torch.stack([torch.roll(p_root, k) for k in range(V)])          # p after token t: roll by t
    q = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.1])
    if with_probs:       # draw the root's three children without replacement (Gumbel-top-k), per row
        keys = q.log() - torch.empty(n, V).exponential_(generator=gen).log()
        first = keys.topk(3, dim=1).indices                                   # [n, 3]
    else:
        first = torch.tensor([0, 1, 2]).expand(n, 3)
    second = torch.tensor([3, 1]).expand(n, 2)                                # children of the first root child
    tokens = torch.cat([first, second], dim=1)
    parents = torch.tensor([-1, -1, -1, 0, 0]).expand(n, 5)
    lengths = torch.full((n,), 5)
    target = torch.zeros(n, 6, V)
    target[:, 0] = p_root
    for i in range(5):
        target[:, i + 1] = p_after[tokens[:, i]]
    probs = None
    if with_probs:
        q_after = torch.stack([torch.roll(q, k) for k in range(V)])
        probs = torch.cat([q.expand(n, 3, V), q_after[first[:, 0]][:, None].expand(n, 2, V)], dim=1)
        # node 3 and 4 (children of node 0) are point choices here, so treat them as drawn from one-hot-ish q:
        # draw them without replacement from q_after instead, to keep the contract
        keys = q_after[first[:, 0]].log() - torch.empty(n, V).exponential_(generator=gen).log()
        tokens[:, 3:] = keys.topk(2, dim=1).indices
        for i in (3, 4):
            target[:, i + 1] = p_after[tokens[:, i]]
    uniforms = torch.rand(n, 5, generator=gen)
    exponentials = torch.empty(n, V).exponential_(generator=gen)
    path, accepted, next_token = rule(target, tokens, parents, probs, lengths, uniforms, exponentials)
    nodes, counts = path_nodes(path)
    committed = torch.cat([tokens.gather(1, nodes), next_token[:, None]], dim=1)
    first_token = torch.where(counts > 0, committed[:, 0], next_token)
    exact_first = p_root
    empirical = torch.bincount(first_token, minlength=V).float() / n
    # second committed token, when the path is >= 1 deep: it follows p_after[first]
    deep = counts >= 1
    second_token = torch.where(counts >= 2, committed[:, 1], next_token)[deep]
    joint = torch.zeros(V, V)
    joint.index_put_((first_token[deep], second_token), torch.ones(int(deep.sum())), accumulate=True)
    return empirical, exact_first, joint, p_after


@pytest.mark.parametrize("with_probs", [False, True])
def test_recursive_rejection_sampling_is_exact(with_probs):
    n = 200_000
    empirical, exact, joint, p_after = two_level_marginals(tree_rejection_sample, n, with_probs)
    tolerance = 5 * (exact * (1 - exact) / n).sqrt()
    assert bool(((empirical - exact).abs() < tolerance).all()), (empirical, exact)
    for t in range(V):                     # given the first token, the second follows the target after it
        count = joint[t].sum()
        if count > 2000:
            conditional = joint[t] / count
            tol = 5 * (p_after[t] * (1 - p_after[t]) / count).sqrt()
            assert bool(((conditional - p_after[t]).abs() < tol).all()), (t, conditional, p_after[t])


@pytest.mark.parametrize("with_probs", [False, True])
def test_a_lossy_sibling_rule_fails_the_same_check(with_probs):
    n = 200_000
    empirical, exact, _, _ = two_level_marginals(lossy_siblings, n, with_probs)
    tolerance = 5 * (exact * (1 - exact) / n).sqrt()
    assert not bool(((empirical - exact).abs() < tolerance).all())


# -- the ledger: tree forwards against a fresh cache --------------------------------------------------------------
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(trees(max_nodes=6, vocab=5), min_size=1, max_size=3), seed=st.integers(0, 1000),
       arch=st.sampled_from(["llama", "gpt2"]), rounds=st.integers(1, 3))
def test_tree_region_matches_a_fresh_cache(rows, seed, arch, rounds):
    """Feed a tree (the root = last committed token, then the nodes), keep a random root path, commit it: every
    node's logits equal a fresh prefill of its path, and the next forward sees exactly the committed tokens."""
    model = cached_model(arch)
    gen = torch.Generator().manual_seed(seed)
    batch = len(rows)
    lengths = torch.randint(2, 6, (batch,), generator=gen).tolist()
    width = max(lengths)
    ids, mask = torch.zeros(batch, width, dtype=torch.long), torch.zeros(batch, width, dtype=torch.long)
    seqs = []
    for b, n in enumerate(lengths):
        toks = torch.randint(3, VOCAB, (n,), generator=gen)
        ids[b, width - n:], mask[b, width - n:] = toks, 1
        seqs.append(toks.tolist())
    ledger = KVLedger(model, compact_threshold=2.0)
    with torch.no_grad():
        ledger.prefill(ids[:, :-1], mask[:, :-1])
        for round_ in range(rounds):
            if round_:          # the token committed after the last path (a correction or bonus) is the next root
                for b in range(batch):
                    seqs[b].append(int(torch.randint(3, VOCAB, (1,), generator=gen)))
            tokens, parents, n_nodes = as_batch(rows)
            tokens = tokens + 3
            last = torch.tensor([s[-1] for s in seqs])
            chunk = torch.cat([last[:, None], tokens], dim=1)
            chunk_parents = torch.cat([torch.full((batch, 1), -1), parents + 1], dim=1)
            logits = ledger.forward(chunk, n_nodes + 1, parents=chunk_parents)
            anc, depth = ancestry(parents, n_nodes)
            for b in range(batch):
                for i in range(int(n_nodes[b])):
                    path = [int(tokens[b, j]) for j in anc[b, i].nonzero().flatten().tolist()]
                    fresh = fresh_last_logits(model, seqs[b] + path)
                    assert torch.allclose(logits[b, i + 1], fresh, atol=1e-4)
            kept = torch.zeros(batch, chunk.shape[1], dtype=torch.bool)
            kept[:, 0] = True
            for b in range(batch):           # a random path: walk down choosing a random child
                cur, path = -1, []
                while True:
                    kids = [i for i in range(int(n_nodes[b])) if int(parents[b, i]) == cur]
                    if not kids or torch.rand(1, generator=gen).item() < 0.3:
                        break
                    cur = kids[int(torch.randint(len(kids), (1,), generator=gen))]
                    path.append(cur)
                for node in path:
                    kept[b, node + 1] = True
                seqs[b] = seqs[b] + [int(tokens[b, j]) for j in path]
            ledger.keep_tree(kept)
            ledger.rollback(ledger.n_cached)
            assert ledger.n_cached.tolist() == [len(s) + (width - n) for s, n in zip(seqs, lengths)]
        probe = torch.randint(3, VOCAB, (batch, 1), generator=gen)
        out = ledger.forward(probe, torch.ones(batch, dtype=torch.long))[:, 0]
        for b in range(batch):
            assert torch.allclose(out[b], fresh_last_logits(model, seqs[b] + [int(probe[b])]), atol=1e-4)


def fresh_last_logits(model, sequence):
    return model(torch.tensor([sequence])).logits[0, -1]


def test_a_pending_tree_nobody_kept_is_dropped_by_rollback(llama):
    ledger = KVLedger(llama)
    with torch.no_grad():
        ledger.prefill(torch.tensor([[5, 6, 7]]), None)
        ledger.forward(torch.tensor([[8, 9]]), torch.tensor([2]), parents=torch.tensor([[-1, -1]]))
        ledger.rollback(torch.tensor([5]))
    assert ledger.tree is None and ledger.n_cached.tolist() == [3] and ledger.physical_length == 3


# -- validation -------------------------------------------------------------------------------------------------
def request(depths=(2,), gammas=(4,)):
    return DraftRequest(torch.zeros(1, 8, dtype=torch.long), torch.tensor([4]), torch.tensor(gammas),
                        torch.tensor([0]), False, ScoreProcessor(None),
                        depths=None if depths is None else torch.tensor(depths))


@pytest.mark.parametrize("parents,tokens,depths,message", [
    ([-1, 1], [5, 6], (2,), "parent 1"),
    ([-1, -1], [5, 5], (2,), "same token"),
    ([-1, 0, 1], [5, 6, 7], (2,), "exceed"),
    ([-1, -1], [5, 6], None, "asked for chains"),
])
def test_malformed_trees_are_refused_where_they_enter(parents, tokens, depths, message):
    proposal = Proposal(torch.tensor([tokens]), torch.tensor([len(tokens)]), parents=torch.tensor([parents]))
    with pytest.raises(InvalidProposal, match=message):
        check_proposal(proposal, request(depths), VOCAB)


def test_a_chain_shaped_tree_becomes_a_chain():
    proposal = Proposal(torch.tensor([[5, 6]]), torch.tensor([2]), parents=torch.tensor([[-1, 0]]))
    assert check_proposal(proposal, request(None), VOCAB).parents is None


def test_siblings_must_share_their_probabilities():
    probs = torch.full((1, 2, VOCAB), 1.0 / VOCAB)
    probs[0, 1] = torch.softmax(torch.arange(VOCAB).float(), 0)
    proposal = Proposal(torch.tensor([[5, 6]]), torch.tensor([2]), probs, parents=torch.tensor([[-1, -1]]))
    with pytest.raises(InvalidProposal, match="same probs"):
        check_proposal(proposal, request(), VOCAB)


def test_a_malformed_tree_falls_back_and_output_stays_identical(llama):
    ids, mask = ragged_batch(2)
    ref = stock_greedy(llama, ids, mask, eos_token_id=None)
    bad = ScriptedDrafter(lambda row, context, gamma: [[5, 6], [5, 7], [9]])    # fine
    twins = ScriptedDrafter(lambda row, context, gamma: [[5, 6], [5, 7], [9]])
    twins.propose = lambda req: Proposal(torch.tensor([[5, 5]] * 2), torch.tensor([2, 2]),
                                         parents=torch.tensor([[-1, -1]] * 2))
    for drafter in (bad, twins):
        with pytest.warns(RuntimeWarning) if drafter is twins else _nothing():
            out, stats = spec_generate(llama, ids, mask, drafter, FixedTree(4, 2))
        assert torch.equal(out, ref)
        assert (stats.fallback is not None) == (drafter is twins)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_trees_need_a_tree_verifier_and_a_4d_mask(llama):
    ids, mask = ragged_batch(1)
    from spec_adapt import EarlyExitVerifier

    with pytest.raises(ValueError, match="verifies chains only"):
        spec_generate(llama, ids, mask, PromptLookupDrafter(), FixedTree(4, 2), verifier=EarlyExitVerifier())
    flash = tiny_model("llama")
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation"):
        spec_generate(flash, ids, mask, PromptLookupDrafter(), FixedTree(4, 2))


@pytest.mark.parametrize("nodes,depth", [(0, 1), (2, 3), (2, 0), (True, 1)])
def test_fixed_tree_checks_its_shape(nodes, depth):
    with pytest.raises(ValueError):
        FixedTree(nodes, depth)


# -- greedy identity through the loop ---------------------------------------------------------------------------
def tree_script(oracle: Oracle, kinds):
    """Scripted trees that know the target's answer. kind per row:
    - "second": the right continuation is the second branch (the first is wrong from its first token);
    - "deep": right for 2 tokens, then the right token on a sibling at depth 3;
    - "wrong": every branch wrong;
    - "right": one right branch, with a wrong sibling at every depth."""
    def script(row, context, gamma):
        right = oracle.right(row, context, gamma)
        if not right:
            return [[3]]
        wrong = [(t + 1) % VOCAB for t in right]
        other = [(t + 2) % VOCAB for t in right]
        kind = kinds[row % len(kinds)]
        if kind == "second":
            return [wrong, right]
        if kind == "deep":
            return [right[:2] + wrong[2:], right]
        if kind == "wrong":
            return [wrong, other]
        return [right] + [right[:d] + [wrong[d]] for d in range(len(right))]
    return script


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("kinds", [["second"], ["deep"], ["wrong"], ["right"], ["second", "deep", "wrong", "right"]])
def test_greedy_identity_with_scripted_trees(arch, batch, kinds):
    model = cached_model(arch)
    ids, mask = ragged_batch(batch)
    ref = stock_greedy(model, ids, mask, eos_token_id=None)
    oracle = Oracle(ref, mask, ["right"])
    out, stats = spec_generate(model, ids, mask, ScriptedDrafter(tree_script(oracle, kinds)), FixedTree(8, 4))
    assert torch.equal(out, ref)
    assert stats.fallback is None and stats.drafted > 0
    if kinds == ["wrong"]:
        assert stats.accepted == 0
    if kinds in (["second"], ["deep"], ["right"]):
        assert stats.accepted > 0            # the right token was found on a branch that was not the first
    if kinds == ["right"]:
        assert stats.steps <= 24 // 5 + 2


@pytest.mark.parametrize("batch", [1, 3])
def test_eos_inside_a_branch(llama, batch):
    ids, mask = ragged_batch(batch)
    probe = stock_greedy(llama, ids, mask, eos_token_id=None, max_new_tokens=12)
    eos = int(probe[0, -5])                     # a token the target really produces: make it the EOS
    ref = stock_greedy(llama, ids, mask, eos_token_id=eos, max_new_tokens=12)
    oracle = Oracle(ref, mask, ["right"], eos=(eos,))
    stats = spec_adapt.SpecStats()
    out = llama.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, eos_token_id=eos,
                         max_new_tokens=12, custom_generate=spec_adapt.generate,
                         drafter=ScriptedDrafter(tree_script(oracle, ["second", "right"])),
                         assistant_policy=FixedTree(8, 4), spec_stats=stats)
    assert torch.equal(out, ref) and stats.fallback is None


def test_processors_see_each_node_with_its_own_ancestors(llama):
    """A repetition penalty reads input_ids: every node must be scored with its own path as context."""
    ids, mask = ragged_batch(2)
    ref = stock_greedy(llama, ids, mask, eos_token_id=None, repetition_penalty=1.8)
    oracle = Oracle(ref, mask, ["right"])
    out, stats = spec_generate(llama, ids, mask, ScriptedDrafter(tree_script(oracle, ["second", "deep"])),
                               FixedTree(8, 4), repetition_penalty=1.8)
    assert torch.equal(out, ref) and stats.accepted > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("policy", [FixedTree(8, 4), FixedTree(3, 2), FixedTree(12, 6)])
def test_model_drafter_trees_are_identical(arch, batch, policy):
    model = cached_model(arch)
    draft = tiny_model(arch, seed=1, layers=1)
    ids, mask = ragged_batch(batch)
    ref = stock_greedy(model, ids, mask, eos_token_id=None)
    out, stats = spec_generate(model, ids, mask, ModelDrafter(draft, branch=3), policy)
    assert torch.equal(out, ref) and stats.fallback is None and stats.drafted > 0


def test_a_self_draft_tree_always_holds_the_target_path(llama):
    """The target as its own draft: the argmax child is the best node at every expansion, so every step accepts;
    with one branch the tree is the greedy chain and every step accepts it to full depth."""
    ids, mask = ragged_batch(2)
    ref = stock_greedy(llama, ids, mask, eos_token_id=None)
    out, stats = spec_generate(llama, ids, mask, ModelDrafter(llama, branch=2), FixedTree(8, 4))
    assert torch.equal(out, ref)
    assert all(a >= 1 for r in stats.trace for a, d in zip(r.accepted, r.drafted) if d)
    out, stats = spec_generate(llama, ids, mask, ModelDrafter(llama, branch=1), FixedTree(4, 4))
    assert torch.equal(out, ref)
    assert max(sum(r.committed) for r in stats.trace) == 2 * 5         # both rows: 4 accepted + the bonus


@pytest.mark.parametrize("make", [PromptLookupDrafter, lambda: SuffixDrafter(min_share=0.1)])
@pytest.mark.parametrize("batch", [1, 3])
def test_model_free_trees_are_identical(make, batch):
    model = cached_model("llama")
    ids, mask = ragged_batch(batch, max_len=30)
    ref = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=40)
    out, stats = spec_generate(model, ids, mask, make(), FixedTree(8, 4), max_new_tokens=40)
    assert torch.equal(out, ref) and stats.fallback is None and stats.drafted > 0


def test_lookup_branches_are_distinct_continuations():
    from spec_adapt.drafters.lookup import lookup_branches

    context = torch.tensor([5, 8, 3, 9, 5, 8, 4, 1, 5, 8])
    assert lookup_branches(context, 2, 2, 1, 4) == [[4, 1], [3, 9]]


def test_suffix_tree_branches_on_shared_contexts():
    from spec_adapt.drafters.suffix import SuffixIndex

    index = SuffixIndex(depth=2)
    index.add([1, 2, 3, 1, 2, 4, 1, 2, 3])
    tokens, parents = index.tree([7, 1, 2], budget=4, depth=2, min_share=0.3)
    assert tokens[:2] == [3, 4] and parents[:2] == [-1, -1]


def test_a_chain_drafter_under_a_tree_plan_drafts_the_chain(llama):
    """A drafter that cannot branch gets a chain of min(nodes, depth)."""
    ids, mask = ragged_batch(2)
    ref = stock_greedy(llama, ids, mask, eos_token_id=None)
    seen = []

    class Chain(ScriptedDrafter):
        trees = False

        def propose(self, request):
            seen.append((request.depths, int(request.gammas.max())))
            return super().propose(request)

    oracle = Oracle(ref, mask, ["right"])
    out, _ = spec_generate(llama, ids, mask, Chain(oracle), FixedTree(8, 3))
    assert torch.equal(out, ref) and all(d is None and g <= 3 for d, g in seen)


# -- one budget per step ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", [FixedTree(4, 4, pooled=True), FixedTree(6, 3, pooled=True)])
def test_a_pooled_budget_is_spent_across_rows_and_stays_identical(policy):
    model = cached_model("llama")
    ids, mask = ragged_batch(4)
    ref = stock_greedy(model, ids, mask, eos_token_id=None)
    out, stats = spec_generate(model, ids, mask, ModelDrafter(tiny_model("llama", seed=1, layers=1), branch=3),
                               policy)
    assert torch.equal(out, ref) and stats.fallback is None
    assert all(sum(r.drafted) <= policy.nodes * r.batch_size for r in stats.trace)
    assert any(max(r.drafted) > policy.nodes for r in stats.trace)        # some row got more than its share


def test_a_pooled_proposal_over_the_total_is_refused():
    req = DraftRequest(torch.zeros(2, 8, dtype=torch.long), torch.tensor([4, 4]), torch.tensor([2, 2]),
                       torch.tensor([0, 1]), False, ScoreProcessor(None), depths=torch.tensor([3, 3]), pooled=True)
    fine = Proposal(torch.tensor([[5, 6, 7], [5, 0, 0]]), torch.tensor([3, 1]), parents=torch.tensor([[-1, 0, -1]] * 2))
    assert check_proposal(fine, req, VOCAB).lengths.tolist() == [3, 1]
    over = Proposal(torch.tensor([[5, 6, 7], [5, 6, 0]]), torch.tensor([3, 2]), parents=torch.tensor([[-1, 0, -1]] * 2))
    with pytest.raises(InvalidProposal, match="pooled budget"):
        check_proposal(over, req, VOCAB)


def test_calibration_ranks_rows_by_what_they_really_accept(llama):
    """A row whose drafts were accepted more than their path probabilities said gets a positive offset."""
    drafter = ModelDrafter(tiny_model("llama", seed=1, layers=1))
    drafter.begin(torch.tensor([[5, 6], [7, 8]]), None)
    drafter.tree_expected = torch.tensor([0.5, 2.0])
    drafter.keep_tree(torch.tensor([[True, True, False], [False, False, False]]))
    offsets = drafter.calibration()
    assert offsets[0] > 0 > offsets[1]
    drafter.select_rows(torch.tensor([1]))
    assert drafter.calibration().shape == (1,) and drafter.calibration()[0] < 0


# -- the default policy with trees ---------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [1, 4])
def test_adaptive_with_trees_stays_identical_and_measures_every_shape(batch, monkeypatch):
    """On a virtual clock (a target forward costs 10 ms plus 1 ms per token fed, a draft forward a tenth of that),
    so what the policy measures, and so what it tries, does not move with the machine's load. The strong draft is
    the target's twin (every draft right, at a draft's price): a draft that pays at both batch sizes."""
    import copy

    from spec_adapt.loop import Clock

    model, weak = cached_model("llama"), tiny_model("llama", seed=1, layers=1)
    strong = copy.deepcopy(model)
    ids, mask = ragged_batch(batch)
    ref = stock_greedy(model, ids, mask, eos_token_id=None)
    clock = [0.0]
    monkeypatch.setattr(Clock, "now", lambda self: clock[0])

    def tick(scale):
        def hook(module, args, kwargs, out):
            clock[0] += scale * (0.01 + 0.001 * kwargs["input_ids"].numel())
        return hook

    hooks = [m.register_forward_hook(tick(scale), with_kwargs=True)
             for m, scale in ((model, 1.0), (strong, 0.1), (weak, 0.1))]
    policy = spec_adapt.Adaptive(trees=True)
    try:
        for _ in range(3):
            out, stats = spec_generate(model, ids, mask, ModelDrafter(strong), policy)    # a draft that always pays
            assert torch.equal(out, ref) and stats.fallback is None
            out, stats = spec_generate(model, ids, mask, ModelDrafter(weak), policy)
            assert torch.equal(out, ref) and stats.fallback is None
    finally:
        for hook in hooks:
            hook.remove()
    measured = {factor for (_, factor), (_, n) in policy.tree_shapes.value.items() if n >= 2}
    assert measured == {1, 2, 3}


def test_tree_shapes_prefer_what_measures_faster_and_probe_the_rest():
    from spec_adapt.policies.estimators import TreeShapes

    shapes = TreeShapes((1, 2), start=4, max_gap=8)
    for factor in (1, 1, 2, 2):          # each shape measured twice, the chain first
        assert shapes.pick(1) == factor
        shapes.observe(1, factor, tokens=2.0 if factor == 1 else 3.0, seconds=1.0)
    picks = []
    for _ in range(30):
        factor = shapes.pick(1)
        picks.append(factor)
        shapes.observe(1, factor, tokens=2.0 if factor == 1 else 3.0, seconds=1.0)
    assert picks.count(2) > 20 and 1 in picks          # the tree wins; the chain is still probed
    with pytest.raises(ValueError):
        TreeShapes((2, 3))


def test_adaptive_trees_round_trip_and_refuse_bad_values(tmp_path):
    policy = spec_adapt.Adaptive(trees=(1, 2))
    policy.tree_shapes.observe(1, 2, 3.0, 1.0)
    policy.save(tmp_path / "p.json")
    loaded = spec_adapt.Adaptive.load(tmp_path / "p.json")
    assert loaded.trees and loaded.tree_shapes.value == policy.tree_shapes.value
    state = policy.state_dict()
    state["tree_shapes"]["value"][0][1][0] = float("nan")
    with pytest.raises(ValueError, match="Not a valid Adaptive state"):
        spec_adapt.Adaptive(trees=(1, 2)).load_state_dict(state)
    with pytest.raises(ValueError):
        spec_adapt.Adaptive(trees="yes")


# -- serving ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [lambda: ModelDrafter(tiny_model("llama", seed=7, layers=1), branch=3),
                                  lambda: PromptLookupDrafter(2, 1)], ids=["model", "lookup"])
@pytest.mark.parametrize("policy", [FixedTree(6, 3), FixedTree(4, 3, pooled=True)], ids=repr)
def test_the_engine_serves_trees_to_rows_that_join(make, policy):
    """Requests join a running batch of trees; every output equals stock generate on its prompt alone."""
    import random

    from spec_adapt.serving.engine import Engine

    model = cached_model("llama")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 10))] for _ in range(6)]
    budgets = [rng.randrange(4, 14) for _ in prompts]
    engine = Engine(model, drafter=make(), assistant_policy=policy, max_batch=3, eos_token_id=EOS, pad_token_id=PAD)
    handles, step = [], 0
    for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
        handles.append(engine.submit(prompt, max_new_tokens=budget))
        engine.step()
    while engine.step():
        pass
    for prompt, budget, handle in zip(prompts, budgets, handles):
        ids = torch.tensor([prompt])
        ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=budget,
                             do_sample=False, eos_token_id=EOS, pad_token_id=PAD)[0, len(prompt):].tolist()
        assert handle.result(timeout=1) == ref
    assert engine.stats.fallback is None and engine.stats.drafted > 0


def test_an_offloadable_draft_grows_trees_too(llama):
    from spec_adapt import DraftOffload

    ids, mask = ragged_batch(2)
    ref = stock_greedy(llama, ids, mask, eos_token_id=None)
    out, stats = spec_generate(llama, ids, mask, DraftOffload(ModelDrafter(llama, branch=2), low=0), FixedTree(6, 3))
    assert torch.equal(out, ref) and stats.fallback is None and stats.accepted > 0


def test_a_tree_slower_than_plain_decoding_runs_as_the_chain():
    from spec_adapt.policies.estimators import TreeShapes

    shapes = TreeShapes((1, 2))
    for factor, tokens in ((1, 1.2), (1, 1.2), (2, 2.0), (2, 2.0)):
        assert shapes.pick(4) == factor
        shapes.observe(4, factor, tokens=tokens, seconds=1.0)
    assert shapes.pick(4) == 2                       # the tree measures best ...
    assert shapes.pick(4, floor=2.5) == 1            # ... but plain decoding (2.5 tokens/s per row) is faster


@pytest.mark.parametrize("drafter", ["model", "lookup", "scripted"])
def test_tree_steps_record_scores_and_logits_like_stock(drafter):
    """output_scores / output_logits through tree steps, those where no row accepts a node included: the same
    tuples stock greedy returns, position by position."""
    from spec_adapt import ModelDrafter, PromptLookupDrafter, ScriptedDrafter

    model = cached_model("llama")
    ids, mask = ragged_batch(3, seed=3)
    kw = dict(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, eos_token_id=None,
              max_new_tokens=12, return_dict_in_generate=True, output_logits=True, output_scores=True)
    reference = model.generate(**kw)
    drafters = {"model": lambda: ModelDrafter(cached_model("llama", seed=1)),
                "lookup": lambda: PromptLookupDrafter(2, 1),
                "scripted": lambda: ScriptedDrafter(lambda row, context, gamma: [5] * gamma)}
    out = model.generate(**kw, custom_generate=spec_adapt.generate, drafter=drafters[drafter](),
                         assistant_policy=FixedTree(8, 3))
    assert torch.equal(out.sequences, reference.sequences)
    for name in ("scores", "logits"):
        ours, theirs = getattr(out, name), getattr(reference, name)
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("junk", [99, -7, 2**40])
def test_parent_slots_past_a_rows_length_are_ignored(junk):
    """Slots past a row's length are never read, whatever they hold: the tree is accepted as the used slots say."""
    req = DraftRequest(torch.zeros(2, 8, dtype=torch.long), torch.tensor([4, 4]), torch.tensor([3, 3]),
                       torch.tensor([0, 1]), False, ScoreProcessor(None), depths=torch.tensor([2, 2]))
    proposal = Proposal(torch.tensor([[5, 6, 7], [5, 6, 0]]), torch.tensor([3, 2]),
                        parents=torch.tensor([[-1, -1, 0], [-1, -1, junk]]))
    checked = check_proposal(proposal, req, VOCAB)
    assert checked.parents.tolist() == [[-1, -1, 0], [-1, -1, -1]]


@pytest.mark.parametrize("make", [lambda: FixedTree(2**64, 2), lambda: FixedTree(2000, 1),
                                  lambda: FixedTree(4, 2**40), lambda: FixedLength(10**9),
                                  lambda: spec_adapt.Adaptive(max_gamma=2**31)])
def test_absurd_sizes_are_refused_where_they_enter(make):
    from spec_adapt.policies.policy import MAX_WIDTH

    with pytest.raises(ValueError, match=rf"in \[\d+, {MAX_WIDTH}\]"):
        make()


def test_an_absurd_plan_from_a_policy_is_refused_before_drafting(llama):
    from spec_adapt.policies.policy import Plan, Policy

    class Huge(Policy):
        def choose(self, info):
            return Plan(10**9, depth=1)

    ids, mask = ragged_batch(2)
    with pytest.raises(ValueError, match="Huge.choose"):
        spec_generate(llama, ids, mask, ModelDrafter(tiny_model("llama", seed=1, layers=1)), Huge())


def test_a_tree_plan_allocates_no_chain_buffers(llama, monkeypatch):
    """Under a tree plan the gammas are node budgets: the draft model allocates by the tree it grows, never a
    [rows, budget, vocabulary] chain buffer."""
    import spec_adapt.drafters.model as model_module

    shapes = []
    real = torch.zeros

    class Recording:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def zeros(*size, **kwargs):
            shapes.append(tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list)) else size)
            return real(*size, **kwargs)

    monkeypatch.setattr(model_module, "torch", Recording())
    ids, mask = ragged_batch(2)
    torch.manual_seed(0)
    llama.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=6, pad_token_id=PAD,
                   eos_token_id=None, custom_generate=spec_adapt.generate,
                   drafter=ModelDrafter(tiny_model("llama", seed=1, layers=1)), assistant_policy=FixedTree(300, 2))
    assert spec_adapt.last_stats().drafted > 0
    assert not [s for s in shapes if len(s) >= 2 and s[1] == 300]
