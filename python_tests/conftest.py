import numpy as np
import pytest
import torch


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def pytest_configure(config):
    torch.set_num_threads(max(1, torch.get_num_threads()))
