"""The default policy's memory across processes (`spec_adapt.policies.saved`): written after each call, read by the
next process's first call, ignored with a warning when it is not a valid state or cannot be written, forgotten by
`reset_default_policies`. A new process is stood for by clearing the in-memory defaults."""

from __future__ import annotations

import json
import threading

import pytest
import torch

import spec_adapt
from spec_adapt import api
from spec_adapt.api import default_policy
from spec_adapt.drafters import ModelDrafter, PromptLookupDrafter
from spec_adapt.policies import saved

from conftest import PAD, cached_model, ragged_batch, stock_greedy


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_ADAPT_POLICY_DIR", str(tmp_path / "policies"))
    api._DEFAULTS.clear()
    yield tmp_path / "policies"
    api._DEFAULTS.clear()


def call(model, drafter, seed=3):
    ids, mask = ragged_batch(2, seed=seed)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, eos_token_id=None,
                         max_new_tokens=16, custom_generate=spec_adapt.generate, drafter=drafter)
    assert torch.equal(out, stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=16))


def new_process():
    api._DEFAULTS.clear()


def test_the_next_process_starts_where_the_last_call_stopped(folder):
    model, draft = cached_model("llama"), cached_model("llama", seed=1)
    call(model, draft)
    call(model, draft, seed=4)
    learned = default_policy(model, ModelDrafter(draft))
    files = list(folder.glob("*.json"))
    assert len(files) == 1 and "ModelDrafter" in files[0].name
    new_process()
    restored = default_policy(model, ModelDrafter(draft))
    assert restored is not learned and restored.steps == learned.steps > 0
    assert restored.state_dict() == learned.state_dict()
    call(model, draft, seed=5)                                       # and it runs on, still the target's output
    assert restored.steps > learned.steps


def test_each_drafter_kind_has_its_own_file(folder):
    model = cached_model("llama")
    call(model, cached_model("llama", seed=1))
    call(model, PromptLookupDrafter(2, 1))
    names = sorted(p.name for p in folder.glob("*.json"))
    assert len(names) == 2 and any("PromptLookupDrafter" in n for n in names)


@pytest.mark.parametrize("content", ["{not json", json.dumps({"config": {"max_gamma": 3}}), json.dumps([1, 2]),
                                     json.dumps({"config": {}, "pooled": {"tried": [[-1.0]]}})])
def test_a_file_that_is_not_a_state_is_ignored_with_a_warning(folder, content):
    model, draft = cached_model("llama"), cached_model("llama", seed=1)
    call(model, draft)
    path = next(folder.glob("*.json"))
    path.write_text(content)
    new_process()
    with pytest.warns(UserWarning, match="Ignoring the saved default policy"):
        call(model, draft)
    assert json.loads(path.read_text())["steps"] == default_policy(model, ModelDrafter(draft)).steps > 0


def test_a_file_too_large_to_be_a_state_is_not_read(folder, monkeypatch):
    """A file over the size a saved policy can have is refused by its size, before it is parsed."""
    model, draft = cached_model("llama"), cached_model("llama", seed=1)
    call(model, draft)
    path = next(folder.glob("*.json"))
    with open(path, "r+b") as f:
        f.truncate(saved.MAX_STATE_BYTES + 1)             # sparse: nothing is written
    monkeypatch.setattr(type(path), "read_text", lambda *a, **k: pytest.fail("a file over the limit was read"))
    new_process()
    with pytest.warns(UserWarning, match="more than a saved policy"):
        default_policy(model, ModelDrafter(draft))


def test_a_folder_that_cannot_be_written_never_fails_a_call(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SPEC_ADAPT_POLICY_DIR", str(blocker / "policies"))      # a folder under a file
    new_process()
    with pytest.warns(UserWarning, match="Could not save the default policy"):
        call(cached_model("llama"), cached_model("llama", seed=1))
    new_process()


@pytest.mark.parametrize("value", ["off", "OFF", "0", ""])
def test_off_keeps_defaults_in_memory(tmp_path, monkeypatch, value):
    monkeypatch.setenv("SPEC_ADAPT_POLICY_DIR", value)
    monkeypatch.setattr(saved, "cache_dir", lambda: tmp_path)          # where it would write if not off
    monkeypatch.chdir(tmp_path)                                         # and a folder named "off" would go
    new_process()
    call(cached_model("llama"), cached_model("llama", seed=1))
    assert not list(tmp_path.rglob("*.json"))
    new_process()


def test_reset_forgets_on_disk_too(folder):
    llama, qwen = cached_model("llama"), cached_model("qwen2")
    call(llama, PromptLookupDrafter(2, 1))
    call(qwen, PromptLookupDrafter(2, 1))
    assert len(list(folder.glob("*.json"))) == 2
    spec_adapt.reset_default_policies(llama)
    assert len(list(folder.glob("*.json"))) == 1
    new_process()
    assert default_policy(llama, PromptLookupDrafter(2, 1)).steps == 0           # cold
    assert default_policy(qwen, PromptLookupDrafter(2, 1)).steps > 0             # kept
    spec_adapt.reset_default_policies()
    assert not list(folder.glob("*.json"))


def test_calls_in_threads_leave_a_valid_file(folder):
    model = cached_model("llama")
    errors = []

    def worker(seed):
        try:
            for k in range(3):
                call(model, PromptLookupDrafter(2, 1), seed=seed + k)
        except Exception as exc:      # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(10 * i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    path = next(folder.glob("*.json"))
    new_process()
    assert default_policy(model, PromptLookupDrafter(2, 1)).steps > 0
    assert json.loads(path.read_text())["steps"] > 0
