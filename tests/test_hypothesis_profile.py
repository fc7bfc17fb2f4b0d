"""The suite's hypothesis examples are the same on every run (the "ci" profile, root conftest.py); `make test-random`
explores fresh ones."""

from hypothesis import given, settings, strategies as st


def test_the_suite_runs_derandomized():
    current = settings.default
    assert settings.get_current_profile_name() == "ci"
    assert current.derandomize and current.database is None and current.print_blob and current.deadline is None


@settings(max_examples=3)
@given(st.integers())
def test_a_tests_own_settings_keep_the_profile(x):
    assert settings.default.derandomize


def test_own_settings_inherit_derandomize():
    own = test_a_tests_own_settings_keep_the_profile._hypothesis_internal_use_settings
    assert own.max_examples == 3 and own.derandomize and own.database is None
