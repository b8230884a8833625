"""The native signature helper of the direct-launch fast path: built once per machine, in the
background, used once ready.

Python reads a call's 60 tensor attributes (shape, strides, dtype, device, address of 12
tensors) in ~11 µs on the H200 test host, more than the launch itself; ``csrc/signature.cpp``
reads them from the TensorImpls in one call (~0.4 µs on the CPU machine vs ~5.5 µs in Python).
It is compiled with ``torch.utils.cpp_extension`` (a C++ compiler and ninja; ~30 s on two
cores, cached per torch version under torch's extension directory) on a background thread the
first time a kernel is launched outside the interpreter, so no call ever waits for the
compiler; until it is ready, and wherever it cannot be built, the Python signature is used.

Opt-in for now: ``QKROPE_NATIVE=1`` turns it on. Its keys are tested against the Python ones
on the CPU (tests/test_native.py) but it has not yet run on a GPU machine; it becomes the
default once it has (issue 4).
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import torch

__all__ = ["signature_fn", "start_build", "load", "status", "set_enabled"]

_SOURCE = Path(__file__).with_name("csrc") / "signature.cpp"
_lock = threading.Lock()
# Read once: signature_fn() is on the hot path (an environment lookup costs ~0.3 µs).
_state: dict = {"fn": None, "thread": None, "error": None,
                "enabled": os.environ.get("QKROPE_NATIVE", "0").strip().lower()
                in ("1", "true", "yes", "on")}


def signature_fn():
    """The native ``signature(*tensors)`` once built and enabled, else None (never blocks)."""
    return _state["fn"] if _state["enabled"] else None


def set_enabled(on: bool) -> None:
    """Turn the native signature on or off for this process (``QKROPE_NATIVE`` at import)."""
    _state["enabled"] = bool(on)


def _enabled() -> bool:
    return _state["enabled"]


def _build() -> None:
    try:
        from torch.utils.cpp_extension import load_inline

        src = _SOURCE.read_text()
        tag = hashlib.sha1((src + torch.__version__).encode()).hexdigest()[:12]
        module = load_inline(name=f"qkrope_native_{tag}", cpp_sources=[src],
                             extra_cflags=["-O2"], verbose=False)
        _state["fn"] = module.signature
    except Exception as e:  # no compiler, no ninja, no headers: stay on the Python path
        _state["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]


def start_build(force: bool = False) -> None:
    """Start the background build once per process (no-op when started, or when disabled and
    not ``force``)."""
    if _state["thread"] is not None or not (force or _enabled()):
        return
    with _lock:
        if _state["thread"] is None:
            _state["thread"] = threading.Thread(target=_build, name="qkrope-native-build",
                                                daemon=True)
            _state["thread"].start()


def load(timeout: float | None = None, force: bool = False):
    """Build (or finish building) and return the native function, or None if it cannot be
    built or is disabled (unless ``force``); waits up to ``timeout`` seconds (None: as long as
    it takes). The function is *used* by the fast path only when enabled."""
    start_build(force)
    thread = _state["thread"]
    if thread is not None:
        thread.join(timeout)
    return _state["fn"]


def status() -> str:
    """One line: whether the native signature is in use, being built, off, or why not."""
    if not _enabled():
        return "python (native off: QKROPE_NATIVE=1 turns it on)"
    if _state["fn"] is not None:
        return "native"
    if _state["error"] is not None:
        return f"python (native build failed: {_state['error']})"
    if _state["thread"] is not None:
        return "python (native build in progress)"
    return "python (native not built yet: it starts with the first GPU launch)"
