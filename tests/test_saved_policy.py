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
    call(model, ModelDrafter(draft))
    call(model, ModelDrafter(draft), seed=4)
    learned = default_policy(model, ModelDrafter(draft))
    files = list(folder.glob("*.json"))
    assert len(files) == 1 and "ModelDrafter" in files[0].name
    new_process()
    restored = default_policy(model, ModelDrafter(draft))
    assert restored is not learned and restored.steps == learned.steps > 0
    assert restored.state_dict() == learned.state_dict()
    call(model, ModelDrafter(draft), seed=5)                         # and it runs on, still the target's output
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
    call(model, ModelDrafter(draft))
    path = next(folder.glob("*.json"))
    path.write_text(content)
    new_process()
    with pytest.warns(UserWarning, match="Ignoring the saved default policy"):
        call(model, ModelDrafter(draft))
    assert json.loads(path.read_text())["steps"] == default_policy(model, ModelDrafter(draft)).steps > 0


def test_a_file_too_large_to_be_a_state_is_not_read(folder, monkeypatch):
    """A file over the size a saved policy can have is refused by its size, before it is parsed."""
    model, draft = cached_model("llama"), cached_model("llama", seed=1)
    call(model, ModelDrafter(draft))
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
    with pytest.warns(UserWarning, match="Could not save the default policy") as record:
        call(cached_model("llama"), cached_model("llama", seed=1))
    assert not [w for w in record if "Ignoring" in str(w.message)]        # no file there: nothing to ignore
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


def _restore_in_a_thread(path, seconds=20.0):
    """saved.restore on `path` in a daemon thread: (finished, returned, warnings) - a read that blocks cannot hang
    the test run."""
    import warnings as w

    from spec_adapt.policies import Adaptive

    out = {}

    def work():
        with w.catch_warnings(record=True) as caught:
            w.simplefilter("always")
            out["returned"] = saved.restore(Adaptive(), path)
        out["warnings"] = [str(c.message) for c in caught]

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive(), out.get("returned"), out.get("warnings", [])


def test_a_fifo_at_the_path_is_not_read(tmp_path):
    """A FIFO nobody writes to would block a reader forever: it is refused as not a regular file."""
    import os

    path = tmp_path / "policy.json"
    os.mkfifo(path)
    finished, returned, caught = _restore_in_a_thread(path)
    assert finished, "reading a FIFO at the saved-policy path blocked"
    assert returned is False and any("not a regular file" in m for m in caught)


@pytest.mark.parametrize("target", ["/dev/zero", "/dev/null"])
def test_a_link_to_a_device_is_not_read(tmp_path, target):
    """/dev/zero reports size 0 and never ends: a link to it must not be read to the end."""
    import os

    if not os.path.exists(target):
        pytest.skip(f"no {target} here")
    path = tmp_path / "policy.json"
    path.symlink_to(target)
    finished, returned, caught = _restore_in_a_thread(path)
    assert finished and returned is False and any("not a regular file" in m for m in caught)


def test_a_link_to_a_saved_state_is_read(folder):
    """A symbolic link that ends at a regular file is followed: only what it ends at is checked."""
    model, draft = cached_model("llama"), cached_model("llama", seed=1)
    call(model, ModelDrafter(draft))
    path = next(folder.glob("*.json"))
    elsewhere = folder.parent / "kept.json"
    path.rename(elsewhere)
    path.symlink_to(elsewhere)
    new_process()
    assert default_policy(model, ModelDrafter(draft)).steps > 0


def _named_like(path: str, seed: int):
    """A tiny llama with random weights from `seed`, saved (as a config would say) at `path`."""
    from conftest import tiny_model

    model = tiny_model("llama", seed=seed)
    model.config._name_or_path = path
    return model


def test_different_weights_under_one_name_get_different_files(folder):
    """Two fine-tunes of one base saved as checkpoint-500 in different runs: the same config, folder name and size,
    other weights. Each pair has its own file; the same weights loaded again find theirs."""
    one, other = _named_like("run-a/checkpoint-500", 0), _named_like("run-b/checkpoint-500", 5)
    draft = cached_model("llama", seed=1)
    kind = "ModelDrafter"
    assert saved.state_path(one, draft, kind, None) != saved.state_path(other, draft, kind, None)
    again = _named_like("run-c/checkpoint-500", 0)                       # the same weights, loaded again
    assert saved.state_path(one, draft, kind, None) == saved.state_path(again, draft, kind, None)
    # and the draft's weights count too
    assert saved.state_path(one, draft, kind, None) != saved.state_path(one, cached_model("llama", seed=2), kind, None)


def test_the_weights_fingerprint_follows_changes_in_place():
    """Cached per model, but weights changed in place (training, load_state_dict) give another fingerprint."""
    model = _named_like("m", 0)
    before = saved.fingerprint(model)
    assert saved.fingerprint(model) == before
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    changed = saved.fingerprint(model)
    assert changed != before
    model.set_input_embeddings(torch.nn.Embedding(*model.get_input_embeddings().weight.shape))     # new embeddings
    assert saved.fingerprint(model) not in (before, changed)


def test_another_pairs_file_does_not_steer_the_first_call(folder, monkeypatch):
    """Pair A (a draft that is always wrong) learns not to draft and saves that. Pair B has the same config and
    name but other weights and a draft that is always right: its first call in a new process starts cold and
    drafts, as it does when no file exists. (The runs' counts are not compared: the default policy times each step,
    so they move with the machine's load.)"""
    from conftest import Oracle, spec_generate

    def first_call(target):
        ids, mask = ragged_batch(2, seed=3)
        reference = stock_greedy(target, ids, mask, eos_token_id=None, max_new_tokens=24)
        out, stats = spec_generate(target, ids, mask, Oracle(reference, mask, ["right"]).drafter(), None)
        assert torch.equal(out, reference)
        return stats

    a, b = _named_like("runs/checkpoint-500", 0), _named_like("other/checkpoint-500", 7)
    with monkeypatch.context() as m:
        m.setenv("SPEC_ADAPT_POLICY_DIR", "off")                         # B's first call with no file at all
        cold = first_call(b)
    new_process()
    assert cold.accepted > 0
    for seed in range(6):                                               # A learns that drafting never pays
        ids, mask = ragged_batch(2, seed=seed)
        reference = stock_greedy(a, ids, mask, eos_token_id=None, max_new_tokens=24)
        spec_generate(a, ids, mask, Oracle(reference, mask, ["wrong"]).drafter(), None)
    assert list(folder.glob("*.json"))
    new_process()
    kind = Oracle(None, torch.ones(1, 1), ["right"]).drafter()
    assert default_policy(a, kind).steps > 0                           # A's own file is found in a new process,
    fresh = default_policy(b, kind)
    assert fresh.steps == 0                                             # B's first call does not read it
    assert fresh.state_dict() == api.Adaptive.for_model(b, None).state_dict()
    steered = first_call(b)
    assert steered.accepted > 0


def test_a_save_that_fails_warns_once_and_leaves_no_temporary_file(folder):
    """The path taken by a folder: every save fails at the rename, with another temporary file each time; one
    warning for the process, and no temporary file left behind."""
    import warnings as w

    model = cached_model("llama")
    drafter = PromptLookupDrafter(2, 1)
    path = saved.state_path(model, None, api._drafter_kind(drafter), None)
    (path / "occupied").mkdir(parents=True)
    saved._WARNED.clear()
    with w.catch_warnings(record=True) as caught:
        w.simplefilter("always")
        for seed in range(3):
            call(model, drafter, seed=seed)
    assert sum("Could not save the default policy" in str(c.message) for c in caught) == 1
    assert not list(folder.glob("*.tmp"))


def test_the_several_source_default_is_kept_under_its_own_name(folder):
    """A bare draft model drafts through the several-source default, whose policy is saved apart from the draft
    model alone's."""
    model, draft = cached_model("llama"), cached_model("llama", seed=1)
    call(model, draft)
    call(model, ModelDrafter(draft))
    names = sorted(p.name for p in folder.glob("*.json"))
    assert len(names) == 2 and any("MultiSourceDrafter" in n for n in names), names
