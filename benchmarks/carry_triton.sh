#!/usr/bin/env bash
# Pack a Triton release for the GPU machine, which cannot install from a registry and takes at
# most 64 MiB per call (device tool README): the cp312 manylinux wheel, unpacked, less its
# profiler libraries (proton, CUPTI) and Blackwell ptxas, xz-packed and split into 53 MB parts
# under .carry/triton/ (git-ignored). Run here, from the repo root:
#   bash benchmarks/carry_triton.sh 3.8.0            # ~3 min on two cores; 3.8.0: 2 parts
# Then one device call per part, back to back (a warm machine is released after 30 s idle):
# every call but the last copies its part to /tmp (`cp .carry/triton/part00 /tmp/`, carry
# [".carry/triton/part00"]); the last carries the last part and runs
#   OUT=$OUT bash benchmarks/device_session.sh carried STEP [ARGS]
# which unpacks the parts to /tmp/triton-carried, puts it first on PYTHONPATH and runs STEP
# (e.g. route-check, the checks behind a new entry of _launch.VERIFIED_TRITON).
set -euo pipefail
version=${1:?usage: carry_triton.sh VERSION}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$work" "triton==$version"
mkdir "$work/pkg"
unzip -q -d "$work/pkg" "$work"/triton-*.whl  # (unzip keeps the executables' mode bits)
rm -rf "$work"/pkg/triton/backends/nvidia/lib/cupti* "$work"/pkg/triton/_C/libproton.so \
  "$work"/pkg/triton/backends/nvidia/bin/ptxas-blackwell
rm -rf .carry/triton && mkdir -p .carry/triton
tar -cf - -C "$work/pkg" . | xz -T2 -6 | split -b 53000000 -d - .carry/triton/part
ls -l .carry/triton
