import warnings

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


#: Seconds the session waits for the native helpers before running on the Python route.
NATIVE_WAIT_S = 300.0


@pytest.fixture(scope="session", autouse=True)
def native_helpers_ready():
    """On a GPU machine, wait (at most NATIVE_WAIT_S) for the fast path's native helpers, so
    every test runs one path: native unless QKROPE_NATIVE=0 (that run covers the Python helpers
    and Triton's launcher). If they are not ready by then, warn and run on the Python route.
    Without CUDA nothing is built here: the interpreter never takes the native route, and the
    tests of the helpers themselves build them (tests/test_native.py)."""
    from qkrope.ops import _native

    if torch.cuda.is_available() and _native.enabled():
        if _native.load(timeout=NATIVE_WAIT_S) is None:
            warnings.warn(f"native fast-path helpers not ready after {NATIVE_WAIT_S:.0f} s, "
                          f"tests run on the Python route: {_native.status()}", stacklevel=1)
    yield
