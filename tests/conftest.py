import pytest
import torch

import qkrope  # noqa: F401  (turns on Triton's interpreter when there is no CUDA device)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def native_helpers_ready():
    """Wait for the fast path's native helpers (built in the background on a GPU machine's
    first launch; ~30 s on two cores) before any test, so every test runs one path: native
    unless QKROPE_NATIVE=0 (that run covers the Python helpers and Triton's launcher)."""
    from qkrope.ops import _native

    _native.load()
    yield
