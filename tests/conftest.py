"""Shared fixtures."""
import contextlib

import pytest

from linear_mha.functional import backend


@pytest.fixture
def backends():
    """``backends(native_kernels=..., block_positions=...)`` selects backends (``functional.backend.override``) for
    the rest of the test."""
    with contextlib.ExitStack() as stack:
        yield lambda **settings: stack.enter_context(backend.override(**settings))
