"""Shared pytest fixtures."""

import pytest

from scalerlt_mcore.testing import model_parallel_context


@pytest.fixture
def mcore_single():
    """World size 1 gloo + MCore model-parallel state (TP=PP=1, seed 1234), destroyed after."""
    with model_parallel_context(seed=1234):
        yield
