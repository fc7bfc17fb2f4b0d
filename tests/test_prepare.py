"""`prepare(model)`: packed linear weights. Lossless within the prepared configuration (spec_adapt on a prepared model
against stock generate on the same prepared model), undoable, never stale."""

from __future__ import annotations

import warnings

import pytest
import torch

import spec_adapt
from spec_adapt import FixedLength, PromptLookupDrafter
from spec_adapt.execution import eager, prepare, prepared, unprepare, why_not_packed

from conftest import PAD, Oracle, ragged_batch, spec_generate, stock_greedy, tiny_model

needs_packing = pytest.mark.skipif(why_not_packed(torch.float32) is not None, reason="no oneDNN linear ops")


def prepared_model(arch: str, seed: int = 0):
    return prepare(tiny_model(arch, seed))


@needs_packing
@pytest.mark.parametrize("arch", ["llama", "qwen2"])      # qwen2: q, k, v carry biases
def test_prepare_packs_linears_and_unprepare_restores(arch, monkeypatch):
    import spec_adapt.execution as p

    calls = []
    packed_linear = p._packed_linear
    monkeypatch.setattr(p, "_packed_linear", lambda *a: calls.append(1) or packed_linear(*a))
    model = tiny_model(arch)
    ids = torch.randint(3, 90, (2, 7))
    with torch.no_grad():
        for module in model.modules():              # initialised to zero: make them count
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_()
        eager_logits = model(ids).logits
        prepare(model)
        info = prepared(model)
        assert info["layers"] == 2 * 7 + 1          # q, k, v, o, gate, up, down per layer, and the LM head
        packed = model(ids).logits
        assert len(calls) == info["layers"]                 # every packed layer ran its packed path
        with eager(model):
            bypassed = model(ids).logits
        assert len(calls) == info["layers"]                 # none did inside `eager`
        assert torch.equal(model(ids).logits, packed)
        unprepare(model)
        again = model(ids).logits
    torch.testing.assert_close(packed, eager_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(again, eager_logits) and torch.equal(bypassed, eager_logits)
    assert prepared(model) is None and not any("forward" in m.__dict__ for m in model.modules())


@needs_packing
def test_prepare_is_idempotent_and_keeps_state_dict():
    model = tiny_model("qwen2")
    keys = set(model.state_dict())
    prepare(model)
    prepare(model)
    assert set(model.state_dict()) == keys


@needs_packing
def test_weight_changed_after_prepare_is_packed_again():
    """A stale packed copy would silently compute with old weights."""
    model = prepare(tiny_model("llama"))
    other = tiny_model("llama", seed=5)
    ids = torch.randint(3, 90, (1, 6))
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, other(ids).logits, rtol=1e-4, atol=1e-4)


@needs_packing
@pytest.mark.parametrize("change", ["data.mul_", "data.copy_", "data assignment", "detach().add_", "no_grad mul_"])
def test_any_in_place_weight_change_after_prepare_is_packed_again(change):
    """`.data` has a version counter of its own: a write through it changes neither the parameter's version nor its
    pointer, and the prepared model (stock generate included) must still compute with the new weights."""
    model, twin = prepare(tiny_model("llama")), tiny_model("llama")
    ids = torch.randint(3, 90, (2, 6))
    with torch.no_grad():
        model(ids)                                     # packed before the change
        for m in (model, twin):
            weight = m.model.layers[0].mlp.down_proj.weight
            if change == "data.mul_":
                weight.data.mul_(3.0)
            elif change == "data.copy_":
                weight.data.copy_(torch.ones_like(weight) * 0.05)
            elif change == "data assignment":
                weight.data = weight.detach() * 2.0
            elif change == "detach().add_":
                weight.detach().add_(0.5)
            else:
                weight.mul_(-1.0)
        torch.testing.assert_close(model(ids).logits, twin(ids).logits, rtol=1e-4, atol=1e-4)
    reference = stock_greedy(twin, ids, torch.ones_like(ids), eos_token_id=None, max_new_tokens=8)
    assert torch.equal(stock_greedy(model, ids, torch.ones_like(ids), eos_token_id=None, max_new_tokens=8), reference)


@needs_packing
def test_a_prepared_model_survives_dtype_changes_copies_pickling_and_inference_mode(tmp_path):
    import copy

    ids = torch.randint(3, 90, (1, 6))
    model = prepare(tiny_model("llama"))
    with torch.no_grad():
        expected = model(ids).logits
        twin = copy.deepcopy(model)                     # packs again on its first forward
        torch.testing.assert_close(twin(ids).logits, expected, rtol=1e-5, atol=1e-5)
        torch.save(model, tmp_path / "model.pt")
        loaded = torch.load(tmp_path / "model.pt", weights_only=False)
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(model.double()(ids).logits, tiny_model("llama").double()(ids).logits)
    with torch.inference_mode():
        frozen = tiny_model("llama")
    prepare(frozen)
    with torch.inference_mode():
        torch.testing.assert_close(frozen(ids).logits, expected, rtol=1e-4, atol=1e-4)


@needs_packing
def test_training_runs_eagerly_with_gradients():
    model = prepare(tiny_model("llama")).train()
    loss = model(torch.randint(3, 90, (1, 5))).logits.sum()
    loss.backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None


def test_unsupported_dtype_warns_and_leaves_the_model():
    model = tiny_model("llama").to(torch.float16)
    with pytest.warns(RuntimeWarning, match="float16"):
        prepare(model)
    assert prepared(model)["layers"] == 0
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_bf16_packs_only_with_native_bf16(monkeypatch):
    import spec_adapt.execution as p

    monkeypatch.setattr(p, "native_bf16", lambda: False)
    model = tiny_model("llama").to(torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepare(model)
    assert prepared(model)["layers"] == 0 and "native bfloat16" in str(caught[0].message)


@needs_packing
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("batch", [1, 3])
def test_prepared_greedy_identity_scripted(arch, batch):
    """The greedy-identity suite on a prepared model: right, wrong, right for j tokens, per row different."""
    model = prepared_model(arch)
    ids, mask = ragged_batch(batch, seed=11)
    reference = stock_greedy(model, ids, mask, eos_token_id=None)
    for modes in (["right"], ["wrong"], [2, "right", "wrong"], [1, 3, 0]):
        oracle = Oracle(reference, mask, modes)
        out, stats = spec_generate(model, ids, mask, oracle.drafter(), FixedLength(4))
        assert torch.equal(out, reference), modes
        assert stats.fallback is None


@needs_packing
def test_prepared_identity_with_a_prepared_draft_model_and_lookup():
    target, draft = prepared_model("llama"), prepared_model("llama", seed=3)
    ids, mask = ragged_batch(3, seed=12)
    reference = stock_greedy(target, ids, mask, eos_token_id=None)
    for drafter in (draft, PromptLookupDrafter(2, 1)):
        out, _ = spec_generate(target, ids, mask, drafter, spec_adapt.Adaptive())
        assert torch.equal(out, reference)


@needs_packing
def test_a_bfloat16_draft_on_a_float32_target_keeps_the_float32_output():
    """The draft runs in its own dtype (prepared where this CPU packs bf16): its precision changes what it proposes,
    never what the float32 target commits. The draft is the target's weights in bf16, so most drafts are accepted."""
    target = prepared_model("llama")
    draft = tiny_model("llama").to(torch.bfloat16)
    if why_not_packed(torch.bfloat16) is None:
        prepare(draft)
    ids, mask = ragged_batch(3, seed=21)
    reference = stock_greedy(target, ids, mask, eos_token_id=None)
    for policy in (FixedLength(4), spec_adapt.Adaptive()):
        out, stats = spec_generate(target, ids, mask, draft, policy)
        assert torch.equal(out, reference)
        assert stats.fallback is None and stats.accepted > 0


def test_bench_draft_dtype_fastest_times_the_draft(monkeypatch):
    """`--draft-dtype fastest` loads the draft in float32 and converts it to the dtype this CPU computes natively
    (float32 where bf16 is not native); a quantized draft has no dtype to choose and is refused."""
    import argparse

    import spec_adapt.execution as p
    from spec_adapt.tools import cli, models

    target, loaded = tiny_model("llama"), []
    monkeypatch.setattr(models, "load_draft", lambda t, name, dtype=None, quantization=None:
                        loaded.append(dtype) or tiny_model("llama", seed=1))
    monkeypatch.setattr(p, "native_bf16", lambda: False)
    args = argparse.Namespace(draft="tiny", draft_dtype="fastest", draft_quant=None, prepare=True, draft_layers=None)
    draft = cli._draft(target, args)
    assert loaded == [torch.float32] and draft.dtype == torch.float32
    assert (prepared(draft) is not None) == (why_not_packed(torch.float32) is None)
    args.draft_quant = "int8"
    with pytest.raises(SystemExit, match="--draft-quant"):
        cli._draft(target, args)


@needs_packing
def test_prepared_sampling_is_seeded_like_stock_per_configuration():
    """Sampling on a prepared model: the same seed gives the same sample twice (the statistical test of the target's
    distribution runs on the accept rule, which prepare does not touch)."""
    model = prepared_model("llama")
    ids, mask = ragged_batch(2, seed=13)
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        outs.append(model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=12,
                                   pad_token_id=PAD, custom_generate=spec_adapt.generate,
                                   drafter=PromptLookupDrafter(2, 1), assistant_policy=FixedLength(3)))
    assert torch.equal(outs[0], outs[1])


def test_the_draft_dtype_is_chosen_by_capability_not_by_timing(monkeypatch):
    """bfloat16 exactly where the CPU computes it natively, float32 elsewhere; nothing is timed (a timing flips on a
    busy machine), so the choice is the same however slow a forward is."""
    import spec_adapt.execution as p
    from spec_adapt.execution import fastest

    def timed(*args, **kwargs):
        raise AssertionError("the dtype choice must not time forwards")

    model = tiny_model("llama")
    monkeypatch.setattr(torch.nn.Module, "__call__", timed)
    monkeypatch.setattr(p, "native_bf16", lambda: False)
    chosen, dtype, why = fastest(model, pack=False)
    assert chosen is model and dtype == torch.float32 and model.dtype == torch.float32 and "no native" in why
    monkeypatch.setattr(p, "native_bf16", lambda: True)
    chosen, dtype, why = fastest(model, pack=False)
    assert dtype == chosen.dtype == torch.bfloat16 and model.dtype == torch.float32 and "natively" in why
