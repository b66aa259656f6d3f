"""Shared pytest setup: makes tests/helpers.py importable from every test folder."""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


import pytest  # noqa: E402

import fewbits as fb  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def lib():
    """The native library of this machine's build (fewbits.kernels.native): a failure when a C
    compiler is here but it did not build, a skip where there is none. Test files that build
    several ISAs define their own `lib`."""
    import shutil

    from fewbits.kernels import native

    built = native.library()
    if built is None:
        if shutil.which("cc") is not None or shutil.which("gcc") is not None:
            pytest.fail(f"a C compiler is here but the native kernels did not build: {native.status()}")
        pytest.skip(native.status()["reason"])
    return built


@pytest.fixture
def eager_kernels():
    """Eager kernels: the compiled ones are specialised per format and take seconds each to
    compile; they are compared with the reference in test_round_exact.py."""
    with fb.use_backend("eager"):
        yield


@pytest.fixture
def one_thread():
    """torch on one thread: tiny matrices gain nothing from threads, and threads fighting over
    2 shared cores cost 10x and more."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# The accelerator the device tests (tests/*/test_device_*.py) run on: CUDA when there is one,
# else they skip. FEWBITS_TEST_DEVICE=cpu runs them against the CPU itself, which checks the
# tests' own logic on a machine without a GPU.
ACCEL_DEVICE = os.environ.get("FEWBITS_TEST_DEVICE", "cuda")


@pytest.fixture
def accel() -> torch.device:
    if ACCEL_DEVICE.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device(ACCEL_DEVICE)
