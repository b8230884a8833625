"""How the native helpers are built, published and loaded (qkrope/ops/_native.py), with real
compiles into temporary cache directories: in a separate process, never a thread of the caller;
published once, atomically, under a lock that dies with its holder; loaded from the cache
without a compiler; bounded waits; a corrupt cache entry rebuilt, never loaded; killed builds
never block the next one; QKROPE_NATIVE=0 never starts a compiler.

Four real compiles (~20 s each on two cores), shared through module-scoped fixtures."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import qkrope
from qkrope.ops import _native

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None
    or shutil.which("ninja", path=_native._build_path()) is None,
    reason="needs a C++ compiler and ninja")

SRC = str(Path(qkrope.__file__).resolve().parents[1])
BOUND_S = 300.0  # any single build, waiting for another builder included


def env_for(cache: Path, **extra) -> dict:
    path = os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, QKROPE_CACHE_DIR=str(cache), PYTHONPATH=path, **extra)


def script(*parts: str) -> str:
    return "".join(textwrap.dedent(p) for p in parts)


def python(code: str, cache: Path, timeout: float = BOUND_S + 60, **extra) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line last."""
    out = subprocess.run([sys.executable, "-c", code], env=env_for(cache, **extra),
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def native_dir(cache: Path) -> Path:
    return cache / "native"


def private_dirs(cache: Path) -> list[Path]:
    return sorted(native_dir(cache).glob("build-*"))


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def compiling(private: Path) -> bool:
    """torch has written its ninja file and the lock of its (private) build directory."""
    return (private / "build" / "build.ninja").exists() and (private / "build" / "lock").exists()


def kill_group(proc) -> None:
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


class Process:
    """This process's native state, swapped for a fresh one reading ``cache``."""

    def __init__(self, mp: pytest.MonkeyPatch, cache: Path):
        mp.setenv("QKROPE_CACHE_DIR", str(cache))
        self.state = _native._fresh_state()
        self.state["enabled"] = True
        mp.setattr(_native, "_state", self.state)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    process = Process(monkeypatch, tmp_path)
    yield process
    kill_group(process.state["proc"])


SIGNATURE_CHECK = """
    t = torch.randn(2, 3, 8)
    key, addresses = _native.module().signature(b"", t, None)
    assert addresses == [t.data_ptr(), None], addresses
"""


# --- (c) concurrent builders, then (a) a fresh process loads from the cache -------------------

@pytest.fixture(scope="module")
def built_cache(tmp_path_factory):
    """Two processes build into one cold cache at the same time."""
    cache = tmp_path_factory.mktemp("concurrent")
    code = script(f"""
        import json, torch
        from qkrope.ops import _native
        ok, path = _native.build(timeout={BOUND_S})
        assert ok, path
    """, SIGNATURE_CHECK, """
        print(json.dumps(dict(path=path, status=_native.status())))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env_for(cache),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=2 * BOUND_S)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return cache, results


@pytest.mark.slow
def test_concurrent_builders_both_load_one_published_module(built_cache):
    cache, results = built_cache
    published = sorted(native_dir(cache).glob("*.so"))
    assert [r["status"] for r in results] == ["native", "native"]
    assert {r["path"] for r in results} == {str(p) for p in published}
    assert len(published) == 1
    assert _native._verified_sha(published[0]) is not None
    assert private_dirs(cache) == []  # each builder cleaned up after itself


@pytest.mark.slow
def test_cached_module_loads_in_a_fresh_process_without_a_compiler(built_cache):
    cache, results = built_cache
    so = Path(results[0]["path"])
    before = so.stat().st_mtime_ns
    out = python(script("""
        import json, subprocess, sys, time, torch

        def refuse(*args, **kwargs):
            raise AssertionError("a process was started: " + repr(args))

        subprocess.Popen = refuse
        from qkrope.ops import _native
        start = time.monotonic()
        _native.start_build()  # what the first GPU launch calls
        took = time.monotonic() - start
        assert _native.status() == "native", _native.status()
    """, SIGNATURE_CHECK, """
        print(json.dumps(dict(took=took, path=_native.module().__file__,
                              cpp_extension="torch.utils.cpp_extension" in sys.modules)))
    """), cache)
    assert out["path"] == str(so)
    assert not out["cpp_extension"]
    assert out["took"] < 2.0
    assert so.stat().st_mtime_ns == before
    assert private_dirs(cache) == []


@pytest.mark.slow
def test_truncated_cache_entry_is_never_loaded_and_is_rebuilt(built_cache, tmp_path, monkeypatch):
    cache, results = built_cache
    so = native_dir(tmp_path) / Path(results[0]["path"]).name
    so.parent.mkdir()
    shutil.copy(results[0]["path"], so)
    shutil.copy(_native._sidecar(Path(results[0]["path"])), _native._sidecar(so))
    good = so.read_bytes()
    so.write_bytes(good[: len(good) // 2])  # as after a full disk or an interrupted copy
    process = Process(monkeypatch, tmp_path)
    imported = []
    real_import = _native._import

    def recording_import(path, name):
        imported.append(path.stat().st_size)
        return real_import(path, name)

    monkeypatch.setattr(_native, "_import", recording_import)
    try:
        _native.start_build(force=True)  # must not map the truncated file (SIGBUS)
        assert imported == []
        assert _native.status().startswith("python (native build in progress"), _native.status()
        assert _native.load(timeout=BOUND_S, force=True) is not None, _native.status()
    finally:
        kill_group(process.state["proc"])
    assert _native.status() == "native"
    assert imported == [so.stat().st_size] and so.stat().st_size > len(good) // 2
    assert _native._verified_sha(so) is not None


# --- (d), (f), (e): a build in flight, started because the cached file does not load ---------

@pytest.fixture(scope="module")
def in_flight(tmp_path_factory):
    """A cache entry with a matching checksum that is not a loadable module: start_build must
    reject it and start a build process, without a thread of this process."""
    cache = tmp_path_factory.mktemp("in_flight")
    with pytest.MonkeyPatch.context() as mp:
        Process(mp, cache)
        so = _native.cache_path()
        so.parent.mkdir(parents=True)
        so.write_bytes(b"\x7fELF not really a shared object")
        _native._sidecar(so).write_text(_native._sha256(so))
        threads_before = set(threading.enumerate())
        _native.start_build()
        threads_after = set(threading.enumerate())
        state = _native._state
    try:
        yield cache, state, so, threads_after - threads_before
    finally:
        kill_group(state["proc"])


@pytest.fixture
def with_in_flight(in_flight, monkeypatch):
    cache, state, so, new_threads = in_flight
    monkeypatch.setenv("QKROPE_CACHE_DIR", str(cache))
    monkeypatch.setattr(_native, "_state", state)
    return in_flight


@pytest.mark.slow
def test_build_runs_in_its_own_process_not_a_thread(with_in_flight):
    cache, state, so, new_threads = with_in_flight
    proc = state["proc"]
    assert proc is not None and proc.poll() is None, _native.status()
    assert new_threads == set()
    assert not [t.name for t in threading.enumerate() if "build" in t.name or "native" in t.name]
    assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0)  # a session of its own
    assert "--reject" in proc.args  # the unloadable file is replaced, not trusted again


@pytest.mark.slow
def test_load_with_a_short_timeout_returns_none_while_the_build_runs(with_in_flight):
    start = time.monotonic()
    assert _native.load(timeout=0.5) is None
    assert time.monotonic() - start < 2.0
    assert _native.status().startswith("python (native build in progress since"), _native.status()
    assert _native.signature_fn() is None and _native.module() is None


@pytest.mark.slow
def test_torch_compile_traces_while_a_build_runs(with_in_flight):
    cache, state, so, _ = with_in_flight
    assert state["proc"].poll() is None

    def f(x, y):
        return torch.nn.functional.rms_norm(x, (8,)) * y.sin() + torch.arange(8.0)

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    for n in range(1, 6):  # several traces (dynamic shapes after the first recompile)
        x, y = torch.randn(n, 8), torch.randn(n, 8)
        torch.testing.assert_close(compiled(x, y), f(x, y))
    torch._dynamo.reset()


@pytest.mark.slow
def test_hot_path_picks_up_the_finished_build(with_in_flight):
    cache, state, so, _ = with_in_flight
    # What _launch.py calls on every eager call: the module appears there, no wait anywhere.
    wait_for(_native.signature_fn, BOUND_S, "signature_fn() to load the built module")
    assert _native.status() == "native"
    # (One process maps one file per module name: the module object may be an earlier test's
    # load of the same name from another directory, so only the cache entry is checked here.)
    assert _native._verified_sha(so) is not None and not so.read_bytes().startswith(b"\x7fELF not")
    t = torch.randn(4, 8)
    assert _native.signature_fn()(b"", t)[1] == [t.data_ptr()]
    assert private_dirs(cache) == []


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU launch starts the build")
def test_first_gpu_launch_starts_the_build_and_later_calls_use_it(tmp_path):
    out = python(script("""
        import json, torch, qkrope
        from qkrope.ops import _launch, _native
        from qkrope.ops.qknorm_rope.launcher import LAUNCHER
        from qkrope.suite import SUITE, make_inputs
        args = make_inputs(SUITE[0], device="cuda")
        before = _native.status()
        qkrope.run(*args)
        after_launch = _native.status()
        _native.load(timeout=%r)
        qkrope.run(*args)  # keeps a native plan
        qkrope.run(*args)  # takes it
        torch.cuda.synchronize()
        print(json.dumps(dict(before=before, after_launch=after_launch,
                              route=_launch.route()[0],
                              plans=len({id(p) for p in LAUNCHER.plans.values()}))))
    """ % BOUND_S), tmp_path)
    assert "not built yet" in out["before"]
    assert "build in progress" in out["after_launch"], out
    assert out["route"] == "native" and out["plans"] == 1, out


# --- (b) killed builds -------------------------------------------------------------------------

@pytest.mark.slow
def test_killed_builds_never_block_the_next_one(fresh, tmp_path):
    # A build process killed mid-compile: torch's lock file stays in its private directory.
    _native.start_build(force=True)
    proc = fresh.state["proc"]
    killed_dir = fresh.state["dir"]
    wait_for(lambda: compiling(killed_dir), 60, "the first build to compile")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    status = _native.status()
    assert status.startswith("python (native build failed: the build process exited with code -9")
    assert str(fresh.state["log"]) in status
    assert (killed_dir / "build" / "lock").exists()

    # A process that started a build, killed mid-compile (its build goes on).
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import time
        from qkrope.ops import _native
        _native.start_build(force=True)
        print(_native._state["dir"], flush=True)
        time.sleep(600)
    """)], env=env_for(tmp_path), stdout=subprocess.PIPE, text=True)
    try:
        orphan_dir = Path(parent.stdout.readline().strip())
        wait_for(lambda: compiling(orphan_dir), 60, "the second build to compile")
    finally:
        parent.kill()
        parent.wait(10)

    start = time.monotonic()
    ok, path = _native.build(timeout=BOUND_S)
    assert ok, path
    assert time.monotonic() - start < BOUND_S
    assert _native.status() == "native"
    assert path == str(_native.cache_path())
    assert not killed_dir.exists()  # removed as stale by the next builder
    assert private_dirs(tmp_path) == []


# --- cheap checks (no compile) -----------------------------------------------------------------

def test_native_off_never_starts_a_compiler(tmp_path):
    out = python(script("""
        import json, subprocess, sys, torch

        def refuse(*args, **kwargs):
            raise AssertionError("a process was started: " + repr(args))

        subprocess.Popen = refuse
        from qkrope.ops import _native
        _native.start_build()
        got = [_native.load(timeout=1.0), _native.signature_fn(), _native.outputs_fn(),
               _native.module()]
        _native.poll()
        print(json.dumps(dict(got=[g is None for g in got], status=_native.status(),
                              threads=[t.name for t in __import__("threading").enumerate()],
                              cpp_extension="torch.utils.cpp_extension" in sys.modules)))
    """), tmp_path, QKROPE_NATIVE="0")
    assert out["got"] == [True] * 4
    assert out["status"] == "python (native off: QKROPE_NATIVE=0)"
    assert out["threads"] == ["MainThread"]
    assert not out["cpp_extension"]
    assert not native_dir(tmp_path).exists()


def test_waits_are_bounded(fresh):
    for bad in (None, "300", True):
        with pytest.raises(TypeError, match="timeout"):
            _native.load(timeout=bad)
        with pytest.raises(TypeError, match="timeout"):
            _native.build(timeout=bad)


def test_not_ready_hot_path_waits_for_nothing_and_looks_rarely(fresh):
    class Running:
        args, polls = [], 0

        def poll(self):
            Running.polls += 1
            return None

    fresh.state["proc"] = Running()
    start = time.monotonic()
    for _ in range(20000):
        assert _native.signature_fn() is None
        assert _native.module() is None
    took = time.monotonic() - start
    assert took < 0.5  # ~0.4 µs per call on the test host
    assert Running.polls <= 1 + took / _native.POLL_INTERVAL
    fresh.state["proc"] = None


def test_cache_key_follows_source_torch_and_python(fresh, tmp_path, monkeypatch):
    path = _native.cache_path()
    assert path.parent == tmp_path / "native" and path.suffix == ".so"
    assert _native._module_name() == path.stem
    assert _native._module_name("// edited\n" + _native._source()) != path.stem
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".post1")
    assert _native.cache_path() != path
    monkeypatch.undo()
    monkeypatch.setattr(sys, "version", sys.version + " (rebuilt)")
    assert _native.cache_path() != path


def test_status_before_any_build(fresh):
    assert _native.status() == "python (native not built yet: it starts with the first GPU launch)"
    info = _native.describe()
    assert info["status"] == _native.status() and info["path"] == str(_native.cache_path())
    assert info["cached"] is False and info["torch"] == torch.__version__
    assert info["compiler"] is not None and info["ninja"] is not None


def test_stale_private_directories_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for name, pid, error, age in (("build-dead", dead.pid, False, 0),
                                  ("build-failed", dead.pid, True, 0),
                                  ("build-alive", os.getpid(), False, 0),
                                  ("build-unstarted", None, False, 0),
                                  ("build-old", os.getpid(), True, 2 * _native._STALE_AFTER),
                                  ("build-mine", None, False, 0)):
        d = tmp_path / name
        d.mkdir()
        if pid is not None:
            (d / "pid").write_text(str(pid))
        if error:
            (d / "error").write_text("failed\n")
        (d / "build").mkdir()
        (d / "build" / "lock").write_text("")
        stamp = time.time() - age
        os.utime(d, (stamp, stamp))
    _native._remove_stale(tmp_path, keep=tmp_path / "build-mine")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "build-alive", "build-failed", "build-mine", "build-unstarted"]


def test_unusable_cache_dir_leaves_the_caller_on_the_python_route(fresh, tmp_path, monkeypatch):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setenv("QKROPE_CACHE_DIR", str(not_a_dir))
    _native.start_build(force=True)  # what a launch calls: it must not raise
    assert fresh.state["proc"] is None
    assert _native.status().startswith("python (native build failed: cannot start the build:")
    ok, why = _native.build(timeout=5.0)
    assert not ok and "cannot start the build" in why, why
