"""The native helpers of the direct-launch fast path: built once per machine, in the
background, used once ready.

In Python, an eager call's fast path spends ~14 µs reading 60 tensor attributes (shape,
strides, dtype, device, address of 12 tensors) for its signature, ~8 µs allocating the two
outputs and ~7.6 µs in Triton's C launcher, which parses an ~80-argument tuple per call (H200
test host, where ``x.add_(1)`` takes ~10 µs). ``csrc/fast_path.cpp`` does each in one C++ call:
signature 1.4 µs, outputs 2.8 µs, launch 4.9 µs (``cuLaunchKernel`` on parameters packed once
per plan; docs/perf-notes.md, run 13). It is compiled with ``torch.utils.cpp_extension`` (a
C++ compiler and ninja; ~30 s on two cores, cached per torch version and source under torch's
extension directory) on a background thread the first time a kernel is launched outside the
interpreter, so no call ever waits for the compiler; until it is ready, and wherever it cannot
be built, the Python helpers and Triton's launcher are used (same keys, same outputs:
tests/test_native.py; same kernel, same GPU time: benchmarks/launch_ab.py).

On by default; ``QKROPE_NATIVE=0`` keeps the Python route (and never starts a compiler).
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import torch

__all__ = ["signature_fn", "outputs_fn", "module", "enabled", "start_build", "load", "status",
           "set_enabled"]

_SOURCE = Path(__file__).with_name("csrc") / "fast_path.cpp"
_lock = threading.Lock()
# Read once: these are on the hot path (an environment lookup costs ~0.3 µs).
_state: dict = {"module": None, "signature": None, "outputs": None, "thread": None,
                "error": None,
                "enabled": os.environ.get("QKROPE_NATIVE", "1").strip().lower()
                not in ("0", "false", "no", "off")}


def signature_fn():
    """The native ``signature(*tensors) -> (bytes key, addresses) | None`` once built and
    enabled, else None (never blocks)."""
    return _state["signature"] if _state["enabled"] else None


def outputs_fn():
    """The native ``outputs(query, key, query_out, key_out) -> (query_out, key_out, address,
    address)`` once built and enabled, else None (never blocks)."""
    return _state["outputs"] if _state["enabled"] else None


def module():
    """The native module (``signature``, ``outputs``, ``make_launch``, ``launch``) once built
    and enabled, else None (never blocks)."""
    return _state["module"] if _state["enabled"] else None


def set_enabled(on: bool) -> None:
    """Turn the native signature on or off for this process (``QKROPE_NATIVE`` at import)."""
    _state["enabled"] = bool(on)


def enabled() -> bool:
    """Whether the native helpers are on for this process (``QKROPE_NATIVE``,
    :func:`set_enabled`)."""
    return _state["enabled"]


def _build() -> None:
    try:
        from torch.utils.cpp_extension import load_inline

        src = _SOURCE.read_text()
        tag = hashlib.sha1((src + torch.__version__).encode()).hexdigest()[:12]
        mod = load_inline(name=f"qkrope_native_{tag}", cpp_sources=[src],
                          extra_cflags=["-O2"], extra_ldflags=["-ldl"], verbose=False)
        # The module first: plans keyed natively from now on can also launch natively.
        _state["module"] = mod
        _state["outputs"] = mod.outputs
        _state["signature"] = mod.signature
    except Exception as e:  # no compiler, no ninja, no headers: stay on the Python path
        _state["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]


def start_build(force: bool = False) -> None:
    """Start the background build once per process (no-op when started, or when disabled and
    not ``force``)."""
    if _state["thread"] is not None or not (force or enabled()):
        return
    with _lock:
        if _state["thread"] is None:
            _state["thread"] = threading.Thread(target=_build, name="qkrope-native-build",
                                                daemon=True)
            _state["thread"].start()


def load(timeout: float | None = None, force: bool = False):
    """Build (or finish building) and return the native module (``.signature``,
    ``.outputs``, ``.make_launch``, ``.launch``), or None if it cannot be built or is disabled (unless ``force``); waits up to
    ``timeout`` seconds (None: as long as it takes). The fast path *uses* it only when
    enabled."""
    start_build(force)
    thread = _state["thread"]
    if thread is not None:
        thread.join(timeout)
    return _state["module"]


def status() -> str:
    """One line: whether the native helpers are in use, being built, off, or why not."""
    if not enabled():
        return "python (native off: QKROPE_NATIVE=0)"
    if _state["module"] is not None:
        return "native"
    if _state["error"] is not None:
        return f"python (native build failed: {_state['error']})"
    if _state["thread"] is not None:
        return "python (native build in progress)"
    return "python (native not built yet: it starts with the first GPU launch)"
