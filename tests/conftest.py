import os
import shutil
import tempfile
import warnings

import pytest
import torch
from filelock import FileLock

import qkrope  # noqa: F401  (turns on Triton's interpreter when there is no CUDA device)


def pytest_configure(config):
    """The native helper the tests build (tests/test_native.py, the GPU session's wait below)
    goes into a temporary cache for the session, never the user's ``~/.cache/qkrope``, unless
    ``QKROPE_CACHE_DIR`` is set. Set here, in the main process, before pytest-xdist starts its
    workers: they inherit it and share one build."""
    if not os.environ.get("QKROPE_CACHE_DIR"):
        config._qkrope_cache_dir = tempfile.mkdtemp(prefix="qkrope-test-cache-")
        os.environ["QKROPE_CACHE_DIR"] = config._qkrope_cache_dir


def pytest_unconfigure(config):
    made = getattr(config, "_qkrope_cache_dir", None)
    if made:
        os.environ.pop("QKROPE_CACHE_DIR", None)
        shutil.rmtree(made, ignore_errors=True)


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


#: Seconds a test marked big_gpu_memory waits for its turn before it errors (never a hang).
GPU_MEMORY_TURN_S = 1200.0


@pytest.fixture(scope="session")
def _gpu_memory_lock(tmp_path_factory):
    # pytest-xdist workers share the parent of their base temporary directories.
    return FileLock(str(tmp_path_factory.getbasetemp().parent / "qkrope-gpu-memory.lock"))


@pytest.fixture(autouse=True)
def _gpu_memory_turns(request):
    """Tests marked big_gpu_memory allocate tens of GiB; under pytest-xdist (``-n N``) they take
    turns through a lock file, so N workers never hold N such peaks at once, and each gives its
    cached blocks back before the next starts. The OS drops the lock of a killed worker."""
    if ("big_gpu_memory" not in request.keywords or not torch.cuda.is_available()
            or "PYTEST_XDIST_WORKER" not in os.environ):
        yield
        return
    with request.getfixturevalue("_gpu_memory_lock").acquire(timeout=GPU_MEMORY_TURN_S):
        try:
            yield
        finally:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
