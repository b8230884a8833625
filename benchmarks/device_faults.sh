#!/usr/bin/env bash
# The "killed mid-build" check on a GPU machine (docs: issue "dependable"): a process starts
# the native helper's build and is killed, with its compiler, in the middle of the compile; then
# the GPU tests run twice: the first builds the helper again (nothing left behind may block it),
# the second finds it cached.
#
#     bash benchmarks/device_faults.sh [OUT_DIR] [RUNS]     # RUNS: how many test runs (2)
#     PYTEST_ARGS="-n 8" PYTEST_TIMEOUT=500 bash benchmarks/device_faults.sh ...  # xdist, bound
set -uo pipefail
out=${1:-/tmp/qkrope-faults}
runs=${2:-2}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-}${PYTHONPATH:+:}$PWD/src  # the working tree's qkrope
cache=$(python3 -c "from qkrope.ops import _native; print(_native.cache_path().parent)")
echo "== native cache: $cache"; ls -la "$cache" 2>/dev/null

echo "== 1. a process starts the build (first GPU launch), then it and its build are killed"
python3 - <<'PY' &
import time, torch, qkrope
from qkrope.suite import SUITE, make_inputs
qkrope.run(*make_inputs(SUITE[0], device="cuda"))  # first launch: the build starts
time.sleep(600)
PY
parent=$!
# Processes from /proc (the GPU image has no procps): "PID PGID ARGS". `procs compiler`: the C++
# compiler proper (by executable name, so no shell whose command line merely mentions it);
# `procs build`: qkrope's build process (an argument ending in _native.py, then --build).
procs() { python3 - "$1" <<'PY'
import os, sys
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().decode().split("\0")
        comm = open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        continue
    if sys.argv[1] == "compiler":
        hit = comm == "cc1plus"
    else:
        hit = any(a.endswith("_native.py") for a in argv) and "--build" in argv
    if hit and int(pid) != os.getpid():
        print(pid, os.getpgid(int(pid)), " ".join(argv)[:120])
PY
}
for _ in $(seq 90); do  # wait for the compiler to be running
  [ -n "$(procs compiler)" ] && break
  sleep 1
done
sleep 3
echo "-- processes at the kill:"; procs build; procs compiler
build=$(procs build | head -1)
kill -9 "$parent"
[ -n "$build" ] && kill -9 -- "-$(echo "$build" | cut -d' ' -f2)"
sleep 1
echo "-- left behind:"; ls -la "$cache" "$cache"/* 2>/dev/null | head -30
python3 -c "from qkrope.ops import _native; print('status after the kill:', _native.status())"

for run in $(seq "$runs"); do
  echo "== $((run + 1)). GPU tests, run $run"
  start=$(date +%s)
  timeout "${PYTEST_TIMEOUT:-900}" python3 -m pytest tests/ -q -p no:cacheprovider --durations=15 ${PYTEST_ARGS:-} 2>&1 | tee "$out/pytest-run$run.log" | tail -40
  echo "run $run: rc=${PIPESTATUS[0]}, $(( $(date +%s) - start )) s"
done
ls -la "$cache"
