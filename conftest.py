"""Session fixtures shared by tests/ and eval/: the real SmolLM2 model is loaded once per test session."""

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2():
    from spec_adapt.models import load_model

    torch.manual_seed(0)
    return load_model()
