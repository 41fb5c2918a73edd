import numpy as np
import pytest
import torch

from test_generate_utils import one_thread


@pytest.fixture(scope="module")
def single_thread():
    """Tiny models run faster and steadier on one thread of the shared CPU (a module opts in with
    ``pytestmark = pytest.mark.usefixtures("single_thread")``)."""
    with one_thread():
        yield


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def pytest_configure(config):
    torch.set_num_threads(max(1, torch.get_num_threads()))
