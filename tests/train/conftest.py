"""tests/train: small models on one thread (the machine is shared; OpenMP threads that wait on
each other make small ops erratic) and eager fewbits kernels (compiling takes seconds each)."""
import pytest
import torch

import fewbits as fb


@pytest.fixture(autouse=True)
def _one_thread_eager():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    with fb.use_backend("eager"):
        yield
    torch.set_num_threads(old)
