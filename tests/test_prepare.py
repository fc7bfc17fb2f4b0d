"""`prepare(model)`: packed linear weights. Lossless within the prepared configuration (spec_adapt on a prepared model
against stock generate on the same prepared model), undoable, never stale."""

from __future__ import annotations

import warnings

import pytest
import torch

import spec_adapt
from spec_adapt import FixedLength, PromptLookupDrafter
from spec_adapt.execution import eager, prepare, prepared, unprepare, why_not_packed

from conftest import PAD, Oracle, cached_model, ragged_batch, spec_generate, stock_greedy, tiny_model

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
@pytest.mark.parametrize("change", ["data.mul_", "data.copy_", "data assignment", "detach().add_", "no_grad mul_",
                                    "data transposed", "data.fill_"])
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
            elif change == "data transposed":                # the same storage and shape, other strides
                weight = m.model.layers[0].self_attn.q_proj.weight
                weight.data = weight.data.t()
            elif change == "data.fill_":
                weight.data.fill_(0.03)
            else:
                weight.mul_(-1.0)
        torch.testing.assert_close(model(ids).logits, twin(ids).logits, rtol=1e-4, atol=1e-4)
    reference = stock_greedy(twin, ids, torch.ones_like(ids), eos_token_id=None, max_new_tokens=8)
    assert torch.equal(stock_greedy(model, ids, torch.ones_like(ids), eos_token_id=None, max_new_tokens=8), reference)


def _computes_like(model, twin, ids):
    """`model` (prepared) computes what its unprepared `twin` computes: logits, and greedy output."""
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, twin(ids).logits, rtol=1e-4, atol=1e-4)
    mask = torch.ones_like(ids)
    reference = stock_greedy(twin, ids, mask, eos_token_id=None, max_new_tokens=8)
    assert torch.equal(stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=8), reference)


@needs_packing
@pytest.mark.parametrize("replace", ["load_state_dict(assign=True)", "new Parameter"])
def test_a_replaced_weight_written_through_data_is_packed_again(replace, tmp_path):
    """A Parameter replaced after prepare is packed from at the next forward; a later write to it through `.data`
    (which neither its version nor its pointer shows) is packed again too."""
    model, twin = prepare(tiny_model("llama"), spill=tmp_path), tiny_model("llama")
    ids = torch.randint(3, 90, (2, 6))
    with torch.no_grad():
        model(ids)
        for m in (model, twin):
            if replace == "new Parameter":
                layer = m.model.layers[0].mlp.down_proj
                layer.weight = torch.nn.Parameter(layer.weight.detach().clone())
            else:
                m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}, assign=True)
        _computes_like(model, twin, ids)                   # packed from the new Parameter
        for m in (model, twin):
            m.model.layers[0].mlp.down_proj.weight.data.mul_(3.0)
            m.lm_head.weight.data.copy_(torch.randn(m.lm_head.weight.shape, generator=torch.Generator().manual_seed(1)))
    _computes_like(model, twin, ids)


@needs_packing
def test_weights_loaded_in_place_under_inference_mode_are_packed_again():
    """Inference tensors have no version counter, and an in-place load keeps their storage."""
    with torch.inference_mode():
        model, twin, other = tiny_model("llama"), tiny_model("llama"), tiny_model("llama", seed=5)
    prepare(model)
    ids = torch.randint(3, 90, (2, 6))
    with torch.inference_mode():
        model(ids)
        for m in (model, twin):
            m.load_state_dict(other.state_dict())
        _computes_like(model, twin, ids)
        for m in (model, twin):
            m.model.layers[1].self_attn.o_proj.weight.fill_(0.01)
    _computes_like(model, twin, ids)


@needs_packing
@pytest.mark.parametrize("alias", ["state_dict", "detach", "view", "data"])
def test_a_write_through_an_alias_made_before_prepare_reaches_the_model(alias, tmp_path):
    """Tensors that share a weight's storage before prepare (state_dict entries, detached tensors, views, `.data`)
    still share it after: a write through them changes the prepared model as it changes the unprepared one."""
    model, twin = tiny_model("llama"), tiny_model("llama")
    name = "model.layers.0.mlp.down_proj.weight"

    def alias_of(m):
        weight = m.get_parameter(name)
        return {"state_dict": lambda: m.state_dict()[name], "detach": weight.detach, "view": lambda: weight[:, :16],
                "data": lambda: weight.data}[alias]()

    aliases = [alias_of(model), alias_of(twin)]
    heads = [m.state_dict()["lm_head.weight"] for m in (model, twin)]
    prepare(model, spill=tmp_path)
    ids = torch.randint(3, 90, (2, 6))
    with torch.no_grad():
        model(ids)
        for tensor in aliases:
            tensor.mul_(3.0)
        _computes_like(model, twin, ids)
        for head in heads:
            head.copy_(torch.randn(head.shape, generator=torch.Generator().manual_seed(2)) * 8)
    _computes_like(model, twin, ids)
    assert aliases[0].untyped_storage().data_ptr() == model.get_parameter(name).untyped_storage().data_ptr()


def _unwritable_folder(tmp_path, monkeypatch):
    """A folder that exists and that this process cannot create files in: read-only for a user, immutable for root
    where chattr can make it so; failing that, file creation in it fails as the kernel would fail it."""
    import os
    import shutil
    import subprocess
    import tempfile

    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    if os.access(folder, os.W_OK):                          # root
        immutable = shutil.which("chattr") and subprocess.run(["chattr", "+i", str(folder)], capture_output=True)
        if immutable and immutable.returncode == 0:
            return folder, lambda: subprocess.run(["chattr", "-i", str(folder)], capture_output=True)
        mkstemp = tempfile.mkstemp

        def refused(*args, dir=None, **kwargs):
            if dir is not None and os.path.realpath(dir) == os.path.realpath(folder):
                raise PermissionError(13, "Permission denied", str(folder))
            return mkstemp(*args, dir=dir, **kwargs)

        monkeypatch.setattr(tempfile, "mkstemp", refused)
    return folder, lambda: None


@needs_packing
def test_an_unwritable_spill_folder_is_reported_and_warned_once(tmp_path, monkeypatch):
    import spec_adapt.execution as p

    folder, restore = _unwritable_folder(tmp_path, monkeypatch)
    try:
        model = tiny_model("llama")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            prepare(model, spill=folder)
        plain = prepared(model)["plain"]
        weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert not any(p._file_mapped(w.data_ptr()) for w in weights)
        assert "not resident" not in plain and "kept in memory" in plain and str(folder) in plain, plain
        spill_warnings = [w for w in caught if str(folder) in str(w.message)]
        assert len(spill_warnings) == 1, [str(w.message) for w in caught]
        ids = torch.randint(3, 90, (1, 6))
        _computes_like(model, tiny_model("llama"), ids)
    finally:
        restore()


@needs_packing
def test_an_unchanged_weight_is_never_packed_again(monkeypatch):
    """The fingerprint matches as long as nothing writes: forwards, reads of `.data`, `state_dict` and generate
    leave the packed copies as they are."""
    import spec_adapt.execution as p

    model, packs = prepare(tiny_model("llama")), []
    pack = p._pack
    monkeypatch.setattr(p, "_pack", lambda module: packs.append(module) or pack(module))
    ids = torch.randint(3, 90, (2, 6))
    with torch.no_grad():
        model(ids)
        _ = [m.weight.data for m in model.modules() if isinstance(m, torch.nn.Linear)], model.state_dict()
        stock_greedy(model, ids, torch.ones_like(ids), eos_token_id=None, max_new_tokens=4)
    assert packs == []


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
    from spec_adapt.tools import models

    target, loaded = tiny_model("llama"), []
    monkeypatch.setattr(models, "load_draft", lambda t, name, dtype=None, quantization=None:
                        loaded.append(dtype) or tiny_model("llama", seed=1))
    monkeypatch.setattr(p, "native_bf16", lambda: False)
    args = argparse.Namespace(draft="tiny", draft_dtype="fastest", draft_quant=None, prepare=True, draft_layers=None)
    draft = models.draft_from_args(target, args)
    assert loaded == [torch.float32] and draft.dtype == torch.float32
    assert (prepared(draft) is not None) == (why_not_packed(torch.float32) is None)
    args.draft_quant = "int8"
    with pytest.raises(SystemExit, match="--draft-quant"):
        models.draft_from_args(target, args)


def test_serve_loads_its_draft_in_the_fastest_dtype_unless_it_is_quantized(monkeypatch):
    """`spec-adapt serve`'s draft: float32 converted to the fastest dtype by default, the dtype asked with
    --draft-dtype, and with --draft-quant alone the quantized draft (not refused as fastest-and-quantized)."""
    from spec_adapt.tools import cli, models, serve

    loaded, parsed = [], []
    monkeypatch.setattr(cli.serve, "serve_cmd", parsed.append)
    monkeypatch.setattr(models, "load_model", lambda name, dtype=None: (tiny_model("llama"), None))
    monkeypatch.setattr(models, "load_draft", lambda t, name, dtype=None, quantization=None:
                        loaded.append((dtype, quantization)) or tiny_model("llama", seed=1))
    for extra in ([], ["--draft-dtype", "bfloat16"], ["--draft-quant", "int8"]):
        cli.main(["serve", "--model", "m", "--draft", "d", "--no-prepare", *extra])
        serve.load_models(parsed[-1])
    assert loaded == [(torch.float32, None), (torch.bfloat16, None), (None, "int8")]
    assert parsed[-1].draft_dtype is None        # the parsed options are not changed


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


# -- one resident copy: the plain weights leave the resident set ----------------------------------------------------
def _mapping_kib(address: int, end: int | None = None) -> dict:
    """{"Rss": ..., "Anonymous": ...} KiB of the mappings that hold `address` (to `end`, where given) in
    /proc/self/smaps: what this process keeps resident of them alone, whatever other threads allocate meanwhile."""
    end = address + 1 if end is None else end
    inside, fields = False, {"Rss": 0, "Anonymous": 0}
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, stop = (int(x, 16) for x in head.split("-"))
                inside = start < end and address < stop
            elif inside and head.rstrip(":") in fields:
                fields[head.rstrip(":")] += int(line.split()[1])
    return fields


def _held_kib(tensor) -> dict:
    """_mapping_kib of every mapping that `tensor`'s bytes lie in (madvise on a few of its pages splits one)."""
    return _mapping_kib(tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size())


def _wide_linears(count: int = 3, size: int = 2048) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(size, size) for _ in range(count)]).eval()


needs_smaps = pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps")


@needs_packing
@needs_smaps
@pytest.mark.parametrize("spill", [True, False])
def test_a_prepared_model_keeps_one_resident_copy_of_its_weights(spill, tmp_path):
    """Spilled: each plain weight lives in a file mapping of which nothing is resident after prepare, and nothing but
    the few pages that hold its fingerprint's samples after forwards; again after an in-place write (copy-on-write
    pages) and the repack that follows. The control keeps them in memory."""
    import mmap

    import spec_adapt.execution as p

    model, x = _wide_linears(), torch.randn(3, 2048)
    size_kib = model[0].weight.numel() * 4 // 1024
    with torch.no_grad():
        expected = model(x)
        prepare(model, spill=tmp_path if spill else False)
        torch.testing.assert_close(model(x), expected, rtol=1e-4, atol=1e-4)
        held = [_held_kib(layer.weight) for layer in model]
        if not spill:
            assert "kept in memory" in prepared(model)["plain"]
            assert all(not p._file_mapped(layer.weight.data_ptr()) for layer in model)
            assert all(h["Rss"] >= size_kib for h in held), held
            return
        assert "not resident" in prepared(model)["plain"]
        assert all(p._file_mapped(layer.weight.data_ptr()) for layer in model)
        sampled_kib = 2 * p._STRIPES * mmap.PAGESIZE // 1024          # a stripe of samples spans at most two pages
        assert all(h["Anonymous"] == 0 and h["Rss"] <= sampled_kib for h in held), held
        for layer in model:
            layer.weight.data.mul_(0.5)
        assert all(_held_kib(layer.weight)["Anonymous"] >= size_kib for layer in model)
        model(x)                           # packed again, and spilled again
        held = [_held_kib(layer.weight) for layer in model]
        assert all(h == {"Rss": 0, "Anonymous": 0} for h in held), held
        model(x)
        held = [_held_kib(layer.weight) for layer in model]
    assert all(h["Anonymous"] == 0 and h["Rss"] <= sampled_kib for h in held), held


@needs_packing
def test_spilled_weights_read_write_save_and_unprepare_like_plain_ones(tmp_path):
    """A spilled weight is an ordinary tensor to every reader: state_dict, save_pretrained (safetensors checks shared
    storage), tied embeddings, in-place writes (copy-on-write, then packed and spilled again)."""
    import spec_adapt.execution as p
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=96, tie_word_embeddings=True)
    torch.manual_seed(0)
    model, twin = LlamaForCausalLM(config).eval(), LlamaForCausalLM(config).eval()
    twin.load_state_dict(model.state_dict())
    ids = torch.randint(3, 90, (2, 6))
    prepare(model, spill=tmp_path / "spill")
    weight = model.model.layers[0].mlp.down_proj.weight
    assert p._spilled(weight) and model.lm_head.weight is model.model.embed_tokens.weight
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))
    assert not list((tmp_path / "spill").iterdir())            # the files are unlinked; the mappings keep them
    model.save_pretrained(tmp_path / "saved")
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "saved").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, twin(ids).logits)
        for m in (model, twin):
            m.model.layers[0].mlp.down_proj.weight.mul_(3.0)
        assert not p._spilled(weight)                          # written: its pages are in memory now
        torch.testing.assert_close(model(ids).logits, twin(ids).logits, rtol=1e-4, atol=1e-4)
        assert p._spilled(weight)                              # packed and spilled again
    unprepare(model)
    assert not p._in_mapping(weight) and torch.equal(weight, twin.model.layers[0].mlp.down_proj.weight)


@needs_packing
def test_a_spill_folder_that_cannot_take_the_weights_keeps_them_in_memory(tmp_path, monkeypatch):
    import spec_adapt.execution as p

    def full_disk(tensor, folder):
        raise OSError(28, "No space left on device")

    ids = torch.randint(3, 90, (1, 6))
    expected = tiny_model("llama")(ids).logits.detach()
    monkeypatch.setattr(p, "_mapped_copy", full_disk)
    model = prepare(tiny_model("llama"), spill=tmp_path)
    assert not p._in_mapping(model.model.layers[0].mlp.down_proj.weight)
    torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(p, "_filesystem", lambda folder: "tmpfs")
    assert "tmpfs" in p.spill_folder(tmp_path)[1] and p.spill_folder(False)[0] is None
    with pytest.raises(TypeError, match="spill"):
        prepare(tiny_model("llama"), spill=3)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert "cannot create" in prepare(tiny_model("llama"), spill=blocked / "sub").__dict__["_spec_adapt_prepared"][
        "plain"]


@needs_packing
@needs_smaps
def test_a_checkpoint_mapped_from_its_file_stays_there_and_leaves_resident_memory(tmp_path):
    """from_pretrained maps a safetensors checkpoint: the plain weights are file pages already. Packing reads them;
    prepare hands those pages back instead of writing a second file, and the weights read the same afterwards."""
    import spec_adapt.execution as p
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=8, vocab_size=96)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "ckpt")
    model = LlamaForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    weight = model.model.layers[0].mlp.down_proj.weight
    if not p._file_mapped(weight.data_ptr()):
        pytest.skip("this transformers release copies checkpoints into memory")
    linears = [m.weight for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    linear_kib = sum(w.numel() * 4 for w in linears) // 1024
    span = (min(w.data_ptr() for w in linears), max(w.data_ptr() + w.numel() * 4 for w in linears))
    ids = torch.randint(3, 90, (1, 6))
    with torch.no_grad():
        expected = model(ids).logits                    # every page read: resident
        copy = weight.detach().clone()
        before = _mapping_kib(*span)["Rss"]
        prepare(model, spill=tmp_path / "spill")
        after = _mapping_kib(*span)["Rss"]
        assert before - after > 0.75 * linear_kib, (before, after, linear_kib)
        assert p._file_mapped(weight.data_ptr()) and not list((tmp_path / "spill").iterdir())
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-4)
        model(ids)                                      # the fingerprint reads its samples' pages alone
        assert _mapping_kib(*span)["Rss"] - after < 0.1 * linear_kib, (after, _mapping_kib(*span), linear_kib)
    assert torch.equal(weight, copy)


def test_converting_a_mapped_checkpoint_tensor_by_tensor_is_to_dtype(tmp_path):
    """convert_paging_out gives what `.to(dtype)` gives (parameters, the tied embedding once, buffers), in place,
    on a model whose weights live in its safetensors file's mapping."""
    from transformers import AutoModelForCausalLM

    from spec_adapt.execution import convert_paging_out

    cached_model("llama").save_pretrained(tmp_path)
    mapped = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    expected = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval().to(torch.bfloat16)
    assert convert_paging_out(mapped, torch.bfloat16) is mapped
    got, want = dict(mapped.named_parameters()), dict(expected.named_parameters())
    assert got.keys() == want.keys()
    for name, tensor in got.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, want[name]), name
    for (name, buffer), (_, reference) in zip(mapped.named_buffers(), expected.named_buffers()):
        assert buffer.dtype == reference.dtype and torch.equal(buffer, reference), name
    ids = torch.tensor([[3, 7, 9, 4]])
    assert torch.equal(mapped.generate(ids, max_new_tokens=4, do_sample=False),
                       expected.generate(ids, max_new_tokens=4, do_sample=False))
