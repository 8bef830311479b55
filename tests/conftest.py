"""Shared pytest fixtures."""

import gc

import pytest
import torch

from scalerlt_mcore.testing import model_parallel_context, releasing_models, thread_count


@pytest.fixture
def mcore_single():
    """World size 1 gloo + MCore model-parallel state (TP=PP=1, seed 1234), destroyed after."""
    with model_parallel_context(seed=1234):
        yield


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tests use tiny tensors: intra-op threads gain nothing and spin on a busy 2-core host.
    Spawned ranks set one thread themselves (scalerlt_mcore.testing)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def released_models():
    """Nothing a test builds outlives it (``releasing_models``): the main job run in-process
    sets up model parallelism itself, and every group its model kept would keep three gloo
    threads polling for the rest of the suite."""
    threads = thread_count()
    with releasing_models():
        yield
    if thread_count() > threads:  # a model in a reference cycle: its groups go with it
        gc.collect()
