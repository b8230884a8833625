"""The native helpers of the direct-launch fast path and of the registered ops' compile route
(``csrc/fast_path.cpp`` + ``csrc/launch_plan.cpp`` + ``csrc/op_route.cpp``, one translation
unit): built once per machine in a separate process, loaded at a call boundary once ready.

What: a small C++ extension that does, each in one call, what the eager fast path otherwise does
in Python: read the call's signature (shape, strides, dtype, device and alignment of every
tensor), allocate its outputs, and launch the compiled kernel (``cuLaunchKernel`` on parameters
packed once per plan). Until it is loaded, and wherever it cannot be built, the Python helpers
and Triton's launcher are used: same keys, same outputs (tests/test_native.py), same kernel
(benchmarks/launch_ab.py). What it saves is measured in docs/perf-notes.md.

Why it is built this way:

- **In its own process.** The first launch outside Triton's interpreter (:func:`start_build`)
  returns at once: it loads the module from the cache, or starts ``python _native.py --build``
  (a session of its own, output to a log) and goes on on the Python route. The compiler never
  runs as a thread of the caller's process, where it raced with ``torch.compile`` tracing.
  Later calls notice the finished build (:func:`poll`, at most every :data:`POLL_INTERVAL`
  seconds, a clock read otherwise) and load the module on the caller's own thread, between
  two calls.
- **In a private directory, published atomically.** ``torch.utils.cpp_extension`` compiles
  into a fresh directory under the cache root (so its lock file is private: a killed build
  cannot leave a lock that every later build waits on); the ``.so`` then replaces the cache
  entry with one ``os.replace``, next to its SHA-256, which is checked before the file is ever
  loaded (a truncated or corrupt file is rebuilt, never mapped). Builders on one machine take
  turns on a ``filelock`` lock (released by the kernel when its holder dies) and the second
  finds the first's result; each gives up after :data:`BUILD_DEADLINE` seconds, and leftover
  private directories of dead builders are removed by the next one.
- **Bounded waits only.** :func:`load` and :func:`build` wait at most ``timeout`` seconds; a
  build that is not done by then goes on in the background.

Cache: ``$QKROPE_CACHE_DIR/native`` (default ``$XDG_CACHE_HOME/qkrope/native``, else
``~/.cache/qkrope/native``), one file per C++ source, compile flags, torch version and Python
build, so an upgrade rebuilds. Needs a C++ compiler and ninja (a first build takes about 20 s
on two cores). On by default; ``QKROPE_NATIVE=0`` keeps the Python route and never starts
a compiler.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

__all__ = ["signature_fn", "outputs_fn", "module", "keep_scalar", "enabled", "set_enabled",
           "start_build", "poll", "load", "build", "status", "cache_path", "describe"]

#: Seconds between two looks at a running build from the hot path.
POLL_INTERVAL = 0.5
#: Seconds after which a build process gives up (waiting for another builder included).
BUILD_DEADLINE = 900.0
# A private directory this old is removed whatever its builder's state (pid reuse, zombies).
_STALE_AFTER = 3600.0
_PRIVATE_PREFIX = "build-"
# One translation unit in three files, joined in this order: the signature, overlap and outputs
# helpers; the launch plans; the registered ops' C++ kernel and the module's function table.
_SOURCES = tuple(Path(__file__).with_name("csrc") / f
                 for f in ("fast_path.cpp", "launch_plan.cpp", "op_route.cpp"))
_CFLAGS = ("-O2",)
_LDFLAGS = ("-ldl",)
_FUNCTIONS = ("signature", "outputs", "bump", "make_launch", "launch", "serve_op", "add_plan",
              "keep_scalar")


def _fresh_state() -> dict:
    return {"module": None, "signature": None, "outputs": None, "bump": None,
            # Read once: these are on the hot path (an environment lookup costs ~0.3 µs).
            "enabled": os.environ.get("QKROPE_NATIVE", "1").strip().lower()
            not in ("0", "false", "no", "off"),
            "proc": None, "dir": None, "log": None, "started": 0.0, "next_poll": 0.0,
            "error": None, "rejected": None}


_state = _fresh_state()
# What keep_scalar was told, for a module loaded later (bounded by the checks' own cache size).
_KEPT: list = []
# Guards starting a build and installing the module; never held while waiting for a build.
_lock = threading.Lock()


# --- the hot path -------------------------------------------------------------------------------

def signature_fn():
    """The native ``signature(*tensors) -> (bytes key, addresses) | None`` once loaded and
    enabled, else None (never blocks; looks at a running build at most every
    :data:`POLL_INTERVAL` seconds)."""
    if _state["signature"] is None and _state["proc"] is not None:
        poll()
    return _state["signature"] if _state["enabled"] else None


def outputs_fn():
    """The native ``outputs(like_1..like_n, given_1..given_n) -> (out_1..out_n, address_1..
    address_n)`` once loaded and enabled, else None (never blocks)."""
    return _state["outputs"] if _state["enabled"] else None


def bump_fn():
    """The native ``bump(written, inputs, outputs)`` once loaded and enabled, else None."""
    return _state["bump"] if _state["enabled"] else None


def keep_scalar(value: float, tensor: torch.Tensor) -> None:
    """From now on a Python float ``value`` in a signature call on ``tensor``'s device stands for
    ``tensor`` (a scale the checks keep for the process's life, ``checks.scalar_on``): the
    loaded module learns it now, one loaded later when it loads."""
    value = float(value)
    _KEPT.append((value, tensor))
    if _state["module"] is not None:
        _state["module"].keep_scalar(value, tensor)


def module():
    """The native module (``signature``, ``outputs``, ``make_launch``, ``launch``) once loaded
    and enabled, else None (never blocks)."""
    if _state["module"] is None and _state["proc"] is not None:
        poll()
    return _state["module"] if _state["enabled"] else None


def poll() -> None:
    """Load the module if its build process has finished. Never blocks: while the build runs
    this is a clock read, plus a ``waitpid`` every :data:`POLL_INTERVAL` seconds."""
    proc = _state["proc"]
    if proc is None:
        return
    now = time.monotonic()
    if now < _state["next_poll"]:
        return
    _state["next_poll"] = now + POLL_INTERVAL
    if proc.poll() is None:
        return
    if _lock.acquire(blocking=False):  # else another thread is installing it right now
        try:
            _finish()
        finally:
            _lock.release()


def set_enabled(on: bool) -> None:
    """Turn the native helpers on or off for this process (``QKROPE_NATIVE`` at import). Off,
    the registered ops' C++ kernels forget their plans and hand every call to the Python body."""
    _state["enabled"] = bool(on)
    if not on and _state["module"] is not None:
        _state["module"].clear_plans()


def enabled() -> bool:
    """Whether the native helpers are on for this process (``QKROPE_NATIVE``,
    :func:`set_enabled`)."""
    return _state["enabled"]


# --- building and loading -----------------------------------------------------------------------

def start_build(force: bool = False) -> None:
    """Make the module available without waiting: load it from the cache if it is there, else
    start the build process (once per process). A no-op once loaded, when disabled and not
    ``force``, and after a failed build (see :func:`status`; :func:`build` tries again)."""
    if _state["module"] is not None or not (force or _state["enabled"]):
        return
    with _lock:
        if _state["module"] is not None:
            return
        if _state["proc"] is not None:
            _finish()
            return
        if _state["error"] is not None:
            return
        try:  # called from a launch: whatever goes wrong here leaves it on the Python route
            if _load_cached() is None:
                return
            _spawn()
        except Exception as e:  # noqa: BLE001
            _state["error"] = f"cannot build: {_first_line(e)}"


def load(timeout: float = 300.0, force: bool = False):
    """The native module, built if needed: waits at most ``timeout`` seconds, then returns the
    module, or None if it is not ready by then (the build goes on in the background), cannot be
    built, or is disabled and not ``force``. The fast path *uses* it only while enabled."""
    deadline = time.monotonic() + _seconds(timeout, "load")
    start_build(force)
    proc = _state["proc"]
    if proc is not None:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return _state["module"]
        with _lock:
            _finish()
    return _state["module"]


def build(timeout: float = 300.0) -> tuple[bool, str]:
    """Build (or find in the cache) and load the module now, whatever ``QKROPE_NATIVE`` says,
    waiting at most ``timeout`` seconds: ``(True, path of the .so)`` or ``(False, why not)``.
    Unlike :func:`load`, it tries again after a failed build."""
    seconds = _seconds(timeout, "build")
    with _lock:
        if _state["proc"] is None:
            _state["error"] = None
    if load(seconds, force=True) is not None:
        return True, str(cache_path())
    if _state["proc"] is not None:
        return False, (f"the build did not finish within {seconds:g} s; it goes on in the "
                       f"background (log: {_state['log']})")
    return False, _state["error"] or "the native helpers could not be built"


def status() -> str:
    """One line: ``"native"`` when the native helpers are in use, else ``"python (...)"`` with
    why not: off, being built, failed (with the log), or not built yet."""
    if not enabled():
        return "python (native off: QKROPE_NATIVE=0)"
    proc = _state["proc"]
    if _state["module"] is None and proc is not None and proc.poll() is not None:
        if _lock.acquire(blocking=False):
            try:
                _finish()
            finally:
                _lock.release()
    if _state["module"] is not None:
        return "native"
    if _state["proc"] is not None:
        since = time.monotonic() - _state["started"]
        return f"python (native build in progress since {since:.0f} s; log: {_state['log']})"
    if _state["error"] is not None:
        return f"python (native build failed: {_state['error']})"
    if _verified_sha(cache_path()) is not None:  # built by another process (build-native)
        return ("python (native built and cached, not loaded in this process: it loads at "
                "the first GPU launch)")
    return "python (native not built yet: it starts with the first GPU launch)"


def cache_path() -> Path:
    """Where the built ``.so`` lives (or will), for this source, torch and Python."""
    return _cache_root() / f"{_module_name()}.so"


def describe() -> dict:
    """What ``qkrope info`` shows about the native helpers."""
    path = cache_path()
    compiler = os.environ.get("CXX", "c++")
    return {"status": status(), "enabled": enabled(), "path": str(path),
            "cached": _verified_sha(path) is not None,
            "log": str(log) if (log := _state["log"]) is not None and log.exists() else None,
            "torch": torch.__version__, "python": platform.python_version(),
            "compiler": shutil.which(compiler), "ninja": shutil.which("ninja", path=_build_path())}


def _seconds(timeout, who: str) -> float:
    if timeout is None or isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{who}(timeout=...) takes a number of seconds (a build is never waited "
                        f"for without bound), got {timeout!r}")
    return max(0.0, float(timeout))


def _cache_root() -> Path:
    if os.environ.get("QKROPE_CACHE_DIR"):
        return Path(os.environ["QKROPE_CACHE_DIR"]).expanduser() / "native"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "qkrope" / "native"


def _source() -> str:
    """The helper's C++ source: the files of :data:`_SOURCES`, joined."""
    return "".join(f.read_text() for f in _SOURCES)


def _module_name(source: str | None = None) -> str:
    """The extension's module name (its ``PyInit_`` symbol, hence also its cache key)."""
    source = _source() if source is None else source
    key = "\0".join((source, repr((_CFLAGS, _LDFLAGS)), torch.__version__, sys.version,
                     platform.machine()))
    return "qkrope_native_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _sidecar(path: Path) -> Path:
    return path.with_suffix(".sha256")


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest() if hasattr(hashlib, "file_digest") \
            else hashlib.sha256(f.read()).hexdigest()


def _verified_sha(path: Path) -> str | None:
    """The file's SHA-256 if it matches the one its builder recorded, else None."""
    try:
        recorded = _sidecar(path).read_text().strip()
        return recorded if recorded and _sha256(path) == recorded else None
    except OSError:
        return None


def _import(path: Path, name: str):
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    missing = [f for f in _FUNCTIONS if not hasattr(mod, f)]
    if missing:
        raise ImportError(f"{path} lacks {', '.join(missing)}")
    return mod


def _load_cached() -> str | None:
    """Install the cached module (None), or say why not. Caller holds ``_lock``."""
    path = cache_path()
    sha = _verified_sha(path)
    if sha is None:
        return f"{path} is missing or does not match its checksum"
    try:
        mod = _import(path, path.stem)
    except Exception as e:  # noqa: BLE001  (a bad file must never stop the caller)
        _state["rejected"] = sha  # the build process replaces exactly this file
        return f"{path} does not load: {_first_line(e)}"
    # The module before the functions: a plan made from a native key can launch natively.
    _state["module"] = mod
    for value, tensor in _KEPT:  # after the module (keep_scalar's own calls then reach it too;
        mod.keep_scalar(value, tensor)  # twice is once), before the signature that reads them
    _state["outputs"] = mod.outputs
    _state["bump"] = mod.bump
    _state["signature"] = mod.signature
    return None


def _spawn() -> None:
    """Start the build process. Caller holds ``_lock``."""
    if not sys.executable:
        _state["error"] = "cannot start the build: no Python executable (sys.executable)"
        return
    cmd = [sys.executable]
    if sys.version_info >= (3, 11):
        cmd.append("-P")  # this file's folder is not an import root
    try:
        root = _cache_root()
        root.mkdir(parents=True, exist_ok=True)
        private = Path(tempfile.mkdtemp(prefix=_PRIVATE_PREFIX, dir=root))
        log = private / "build.log"
        cmd += [str(Path(__file__).resolve()), "--build", str(private)]
        if _state["rejected"]:
            cmd += ["--reject", _state["rejected"]]
        env = dict(os.environ, PATH=_build_path())
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=env, close_fds=True,
                                    start_new_session=True)
    except OSError as e:
        _state["error"] = f"cannot start the build: {_first_line(e)}"
        return
    now = time.monotonic()
    _state.update(proc=proc, dir=private, log=log, started=now, next_poll=now + POLL_INTERVAL)


def _build_path() -> str:
    # torch runs `ninja` from PATH; the ninja wheel puts it next to this interpreter, which a
    # virtual environment used without activation leaves off PATH.
    bindir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    return path if bindir in path.split(os.pathsep) else os.pathsep.join((bindir, path))


def _finish() -> None:
    """Take the result of a finished build process. Caller holds ``_lock``."""
    proc = _state["proc"]
    if proc is None or proc.poll() is None:
        return
    _state["proc"] = None
    if proc.returncode == 0:
        try:
            problem = _load_cached()
        except Exception as e:  # noqa: BLE001  (called from a launch, see start_build)
            problem = _first_line(e)
        if problem is not None:
            _state["error"] = f"built, but {problem}"
        return
    try:
        why = (_state["dir"] / "error").read_text().strip()
    except OSError:
        why = f"the build process exited with code {proc.returncode}"
    _state["error"] = f"{why}; log: {_state['log']}"


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text.splitlines()[0][:300]


def _after_fork_in_child() -> None:
    # The build process is the parent's child; this process looks at the cache afresh.
    _state.update(proc=None, dir=None, log=None)


os.register_at_fork(after_in_child=_after_fork_in_child)


# --- the build process --------------------------------------------------------------------------

def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(root: Path, keep: Path) -> None:
    """Remove private directories left by builders that died (a failed build's keeps its log
    for :data:`_STALE_AFTER` seconds). Caller holds the build lock."""
    for d in root.glob(_PRIVATE_PREFIX + "*"):
        if d == keep or not d.is_dir():
            continue
        try:
            age = time.time() - d.stat().st_mtime
        except OSError:  # removed meanwhile
            continue
        try:
            pid = int((d / "pid").read_text())
        except (OSError, ValueError):  # its builder has not started yet
            pid = None
        if age > _STALE_AFTER or (pid is not None and not _alive(pid)
                                  and not (d / "error").exists()):
            shutil.rmtree(d, ignore_errors=True)


def _arm_deadline(private: Path) -> None:
    import signal

    def expire(signum, frame):
        (private / "error").write_text(f"the build took over {BUILD_DEADLINE:.0f} s\n")
        if os.getpgrp() == os.getpid():  # our own session: take the compiler down with us
            os.killpg(os.getpid(), signal.SIGKILL)
        os._exit(124)

    signal.signal(signal.SIGALRM, expire)
    signal.alarm(int(BUILD_DEADLINE))


def _build_main(private: Path, reject: str | None) -> int:
    """Compile into ``private``, publish into its parent (the cache root); exit status 0 when
    the cache holds a verified module."""
    import traceback

    (private / "pid").write_text(str(os.getpid()))
    _arm_deadline(private)
    try:
        from filelock import FileLock

        root = private.parent
        source = _source()
        name = _module_name(source)
        final = root / f"{name}.so"
        with FileLock(str(root / f"{name}.lock"), timeout=BUILD_DEADLINE):
            _remove_stale(root, keep=private)
            sha = _verified_sha(final)
            if sha is not None and sha != reject:
                print(f"{final}: already built", flush=True)
            else:
                _compile_and_publish(source, name, private, final)
                print(f"{final}: built", flush=True)
    except BaseException as e:  # noqa: BLE001  (the parent reads the first line)
        traceback.print_exc()
        (private / "error").write_text(_first_line(e) + "\n")
        return 1
    shutil.rmtree(private, ignore_errors=True)
    return 0


def _compile_and_publish(source: str, name: str, private: Path, final: Path) -> None:
    from torch.utils.cpp_extension import load

    build_dir = private / "build"
    build_dir.mkdir()
    # From a file rather than load_inline, which would put <torch/extension.h> first: the source
    # includes only the headers it uses (a build: ~22 s on two cores, against ~34).
    path = build_dir / f"{name}.cpp"
    path.write_text(source)
    mod = load(name=name, sources=[str(path)], extra_cflags=list(_CFLAGS),
               extra_ldflags=list(_LDFLAGS), build_directory=str(build_dir), verbose=True)
    missing = [f for f in _FUNCTIONS if not hasattr(mod, f)]
    if missing:
        raise ImportError(f"the built module lacks {', '.join(missing)}")
    built = Path(mod.__file__)
    digest = private / "sha256"
    digest.write_text(_sha256(built) + "\n")
    # .so first: a reader that sees the new file with the old checksum rebuilds (finding this
    # one), never loads an unverified file.
    os.replace(built, final)
    os.replace(digest, _sidecar(final))


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="build qkrope's native helpers (internal)")
    parser.add_argument("--build", type=Path, required=True, metavar="PRIVATE_DIR")
    parser.add_argument("--reject", default=None, metavar="SHA256",
                        help="rebuild even if the cached file has this checksum")
    args = parser.parse_args()
    sys.exit(_build_main(args.build.resolve(), args.reject))
