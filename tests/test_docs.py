"""Every Python snippet in the README and in docs/ runs. The snippets of one file share a namespace, in order (a later
one may use what an earlier one made). Models they load come from the session's cache: SmolLM2 and the Qwen pair are
loaded once."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import spec_adapt

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def snippets(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text())


def test_the_docs_have_snippets():
    assert len(snippets(ROOT / "README.md")) >= 4
    assert sum(len(snippets(p)) for p in FILES) >= 8


@pytest.mark.real
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_snippets_run(path, smollm2, qwen_pair, monkeypatch, tmp_path):
    from spec_adapt.tools import models

    loaded = {"smollm2-135m": smollm2, models.SMOLLM2.lower(): smollm2,
              "qwen2.5-coder-0.5b": (qwen_pair[1], qwen_pair[2])}

    def load_model(name=models.SMOLLM2, *args, **kwargs):
        if name.lower() in loaded and not args and not kwargs:
            return loaded[name.lower()]
        raise AssertionError(f"a docs snippet loads {name!r} {args} {kwargs}: keep snippets to the session's models")

    monkeypatch.setattr(models, "load_model", load_model)
    monkeypatch.chdir(tmp_path)
    model = smollm2[0]
    namespace: dict = {"__name__": "__snippet__"}
    try:
        for i, code in enumerate(snippets(path)):
            try:
                exec(compile(code, f"{path.name}[snippet {i}]", "exec"), namespace)
            except Exception as exc:
                raise AssertionError(f"{path.name}, snippet {i} failed: {type(exc).__name__}: {exc}\n{code}") from exc
    finally:                      # the session's model goes back as it was
        spec_adapt.unprepare(model)
        spec_adapt.disable(model)
        spec_adapt.reset_default_policies()


def test_results_are_at_most_twenty_sets_each_cited_by_the_docs():
    entries = sorted(p.name for p in (ROOT / "results").iterdir() if not p.name.startswith("."))
    prose = "\n".join(p.read_text() for p in FILES)
    for head, options, tail in re.findall(r"results/([\w.-]*)\{([^}]*)\}([\w.-]*)", prose):    # results/a-{b,c}/
        prose += "".join(f"\nresults/{head}{option}{tail}" for option in options.split(","))
    assert len(entries) <= 20, entries
    uncited = [name for name in entries if f"results/{name}" not in prose]
    assert not uncited, f"result sets no doc cites: {uncited}"


def test_the_public_names_are_few():
    assert len(spec_adapt.__all__) <= 25
    assert all(hasattr(spec_adapt, name) for name in spec_adapt.__all__)
