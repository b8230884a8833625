#!/usr/bin/env bash
# Builds .fi/ (git-ignored): the smallest tree that imports and runs FlashInfer 0.7.4's
# flashinfer.cake_fused_qk_rmsnorm_rope_append_paged_kv_cache on the H200 device machine, which
# has no internet and takes at most 64 MiB of working tree per call (the FlashInfer wheel alone
# is 101 MB). benchmarks/flashinfer_h2h.py puts .fi/site on sys.path; nothing is pip-installed.
#
#   bash benchmarks/flashinfer_carry.sh          # here, once; prints the size of .fi/
#
# How the FlashInfer wheel is trimmed (what the op reaches, read from the code and checked by
# importing it here):
#   - flashinfer/cake_fused_qk_rope_append.py      public entry point (a pass-through to ...)
#   - flashinfer/cake_fused_qk_rope_append_backend/ ... the self-contained backend, unmodified:
#       __init__.py (host checks), cake_jit.py (stage policy, launch plan, tvm-ffi launch),
#       cake_build.py (loader: aot/<lib>.so if present, else FlashInfer's JIT from build.json),
#       build.json (sources, nvcc flags, digests), csrc/ (generated .cu + one header; needs only
#       the CUDA toolkit and tvm-ffi's headers)
#   - flashinfer/api_logging.py                    the @flashinfer_api decorator (stdlib + torch;
#                                                  a no-op at FLASHINFER_LOGLEVEL=0)
#   - flashinfer/version.py, _build_meta.py, compilation_context.py,
#     flashinfer/jit/{core,cpp_ext,env,utils,_cuda_architecture}.py
#                                                  FlashInfer's nvcc/ninja JIT (the fallback when
#                                                  a prebuilt library does not load); these import
#                                                  only tvm_ffi, filelock, packaging and torch
#   - flashinfer/__init__.py, flashinfer/jit/__init__.py: REPLACED by stubs. The real ones import
#     every FlashInfer op (cutlass-dsl, cuda-tile, nccl4py, cudnn-frontend, ...); this op needs
#     none of them. Everything else in the wheel (data/ 451 MB of headers/cubins, all other ops)
#     is left out.
# Dependencies the device image lacks: apache-tvm-ffi only (filelock, packaging, ninja, torch,
# typing-extensions are there). Its cp312 manylinux wheel is unpacked as a plain directory into
# .fi/site; typing_extensions.py (>= 4.13, which tvm-ffi needs) waits in .fi/compat in case the
# image's copy is older.
#
# Prebuilt libraries: when this machine has nvcc and a Python with torch, the backend's sm_90a
# libraries (the H100/H200 builds; 6 stages, 3 of them for 64/8 heads) are compiled here by
# FlashInfer's own JIT (same build.json sources and flags, FLASHINFER_CUDA_ARCH_LIST=9.0) and
# placed where the backend's loader looks for prebuilt files (aot/<lib>.so + aot/build_info.json),
# so the device compiles nothing. The device's toolkit is CUDA 13.0 (nvcc 13.0.88 here too).
# PREBUILD=0 skips this; the device then JIT-compiles on first use (about a minute, printed by
# flashinfer_h2h.py), and flashinfer_h2h.py also falls back to that JIT when a prebuilt library
# fails to load.
#
# Environment: FI_WHEEL (default: $FI_CACHE/flashinfer_python-0.7.4-py3-none-any.whl, else
# /tmp/fi/..., else downloaded), FI_CACHE (downloads, default /tmp/fi-carry), PYTHON (a local
# Python with torch, for the prebuild; default python3), PREBUILD (1/0, default 1).
set -euo pipefail

FI_VERSION=0.7.4
TVM_FFI_VERSION=0.1.15.post2   # FlashInfer 0.7.4 needs apache-tvm-ffi >=0.1.11,<0.2
TYPING_EXT_VERSION=4.15.0      # tvm-ffi needs typing-extensions >=4.13 (get_annotations)
ROOT=$(git rev-parse --show-toplevel)
DEST="$ROOT/.fi"
FI_CACHE=${FI_CACHE:-/tmp/fi-carry}
PYTHON=${PYTHON:-python3}
PREBUILD=${PREBUILD:-1}
mkdir -p "$FI_CACHE"

# Ignore .fi/ in every worktree of this repository (worktrees share the common git dir).
EXCLUDE="$(git rev-parse --path-format=absolute --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF '/.fi/' "$EXCLUDE" 2>/dev/null || echo '/.fi/' >> "$EXCLUDE"

wheel_name="flashinfer_python-${FI_VERSION}-py3-none-any.whl"
if [[ -z "${FI_WHEEL:-}" ]]; then
  for cand in "$FI_CACHE/$wheel_name" "/tmp/fi/$wheel_name"; do
    [[ -f "$cand" ]] && FI_WHEEL=$cand && break
  done
fi
if [[ -z "${FI_WHEEL:-}" ]]; then
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$FI_CACHE" \
    "flashinfer-python==$FI_VERSION"
  FI_WHEEL="$FI_CACHE/$wheel_name"
fi
echo "FlashInfer wheel: $FI_WHEEL"

# The device's interpreter: CPython 3.12, x86-64 manylinux.
TVM312_DIR="$FI_CACHE/tvm312"
mkdir -p "$TVM312_DIR"
if ! ls "$TVM312_DIR"/apache_tvm_ffi-"$TVM_FFI_VERSION"-cp312-*.whl >/dev/null 2>&1; then
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$TVM312_DIR" "apache-tvm-ffi==$TVM_FFI_VERSION"
fi
TVM312_WHEEL=$(ls "$TVM312_DIR"/apache_tvm_ffi-"$TVM_FFI_VERSION"-cp312-*.whl | head -1)
echo "tvm-ffi wheel (device): $TVM312_WHEEL"

rm -rf "$DEST"
SITE="$DEST/site"
mkdir -p "$SITE"
unzip -q "$FI_WHEEL" -d "$SITE" \
  'flashinfer/cake_fused_qk_rope_append.py' \
  'flashinfer/cake_fused_qk_rope_append_backend/*' \
  'flashinfer/api_logging.py' \
  'flashinfer/version.py' \
  'flashinfer/_build_meta.py' \
  'flashinfer/compilation_context.py' \
  'flashinfer/jit/core.py' \
  'flashinfer/jit/cpp_ext.py' \
  'flashinfer/jit/env.py' \
  'flashinfer/jit/utils.py' \
  'flashinfer/jit/_cuda_architecture.py' \
  "flashinfer_python-${FI_VERSION}.dist-info/licenses/*"
mv "$SITE/flashinfer_python-${FI_VERSION}.dist-info/licenses/LICENSE" "$SITE/flashinfer/LICENSE"
rm -rf "$SITE/flashinfer_python-${FI_VERSION}.dist-info"

cat > "$SITE/flashinfer/__init__.py" <<EOF
"""FlashInfer ${FI_VERSION}, trimmed by qkrope's benchmarks/flashinfer_carry.sh to the modules that
flashinfer.cake_fused_qk_rope_append reaches. The wheel's own __init__ imports every FlashInfer
op and their optional dependencies; this stub imports nothing else."""

from .version import __git_commit__, __version__  # noqa: F401
EOF
cat > "$SITE/flashinfer/jit/__init__.py" <<'EOF'
"""FlashInfer's JIT, trimmed (see flashinfer/__init__.py): core, cpp_ext, env, utils and
_cuda_architecture only, imported by their full names."""
EOF

unzip -q "$TVM312_WHEEL" -d "$SITE"

# A fallback only: the device image's typing-extensions is expected to be new enough; if it is
# not, flashinfer_h2h.py swaps this one in (.fi/compat is not on sys.path otherwise).
if ! ls "$FI_CACHE"/typing_extensions-"$TYPING_EXT_VERSION"-*.whl >/dev/null 2>&1; then
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$FI_CACHE" \
    "typing-extensions==$TYPING_EXT_VERSION"
fi
mkdir -p "$DEST/compat"
unzip -q "$(ls "$FI_CACHE"/typing_extensions-"$TYPING_EXT_VERSION"-*.whl | head -1)" \
  typing_extensions.py -d "$DEST/compat"

BACKEND="$SITE/flashinfer/cake_fused_qk_rope_append_backend"
if [[ "$PREBUILD" == 1 ]] && command -v nvcc >/dev/null && "$PYTHON" -c 'import torch' 2>/dev/null
then
  # tvm-ffi for the local interpreter (same version: same headers as the device's copy).
  LOCAL_TAG=$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  LOCAL_DIR="$FI_CACHE/tvm-$LOCAL_TAG"
  mkdir -p "$LOCAL_DIR"
  if ! ls "$LOCAL_DIR"/apache_tvm_ffi-"$TVM_FFI_VERSION"-*.whl >/dev/null 2>&1; then
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$LOCAL_DIR" \
      "apache-tvm-ffi==$TVM_FFI_VERSION"
  fi
  LOCAL_SITE="$FI_CACHE/site-$LOCAL_TAG"
  rm -rf "$LOCAL_SITE"
  unzip -q "$(ls "$LOCAL_DIR"/apache_tvm_ffi-"$TVM_FFI_VERSION"-*.whl | head -1)" -d "$LOCAL_SITE"
  WS="$FI_CACHE/jit-workspace"
  rm -rf "$WS"
  # FlashInfer guesses CUDA_HOME from `which nvcc`: a wrapper such as /usr/local/bin/nvcc would
  # give /usr/local, which holds no CUDA headers or libraries.
  if [[ -z "${CUDA_HOME:-}" ]]; then
    CUDA_HOME=/usr/local/cuda
    [[ -e "$CUDA_HOME/include/cuda_runtime.h" ]] \
      || CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
  fi
  export CUDA_HOME
  if [[ ! -e "$CUDA_HOME/lib64/stubs/libcuda.so" ]]; then
    # build.json links -lcuda, but the libraries reference no driver symbol (checked with nm -u:
    # only cudart and tvm-ffi ones); a machine without a driver needs a stub to link against.
    STUB="$FI_CACHE/libcuda-stub"
    mkdir -p "$STUB"
    echo 'void qkrope_libcuda_stub(void) {}' | cc -shared -fPIC -x c - \
      -Wl,-soname,libcuda.so.1 -o "$STUB/libcuda.so"
    export FLASHINFER_EXTRA_LDFLAGS="-L$STUB"
  fi
  echo "prebuilding the sm_90a libraries with FlashInfer's JIT (MAX_JOBS=$(nproc)) ..."
  start=$(date +%s)
  # The local tvm-ffi first (the carried one is for CPython 3.12); .fi/site for flashinfer.
  PYTHONPATH="$LOCAL_SITE:$SITE" FLASHINFER_CUDA_ARCH_LIST=9.0 FLASHINFER_WORKSPACE_BASE="$WS" \
    MAX_JOBS=$(nproc) TVM_FFI_DISABLE_TORCH_C_DLPACK=1 "$PYTHON" - "$BACKEND" <<'EOF'
import json, re, shutil, subprocess, sys
from pathlib import Path

from flashinfer.cake_fused_qk_rope_append_backend import cake_build
from flashinfer.jit.core import build_jit_specs
from flashinfer.jit.cpp_ext import get_cuda_path

backend = Path(sys.argv[1])
names = [n for n, e in cake_build.libraries_by_name().items() if e["arch"] == "sm_90a"]
specs = [cake_build.jit_spec(n) for n in names]
build_jit_specs(specs, verbose=False)
(backend / "aot").mkdir(exist_ok=True)
for name, spec in zip(names, specs):
    shutil.copy2(spec.get_library_path(), cake_build.prebuilt_path(name))
nvcc = subprocess.check_output([f"{get_cuda_path()}/bin/nvcc", "--version"], text=True)
full = re.search(r"V(\d+\.\d+\.\d+)", nvcc).group(1)
major, minor = (int(x) for x in full.split(".")[:2])
# CUDART_VERSION of the toolkit the libraries were compiled with (major * 1000 + minor * 10):
# the loader compares it with each library's build_cuda_version() on the device.
(backend / "aot" / "build_info.json").write_text(json.dumps(
    {"schema": "cake-build-info/1", "cuda": full, "cudart_version": major * 1000 + minor * 10,
     "arches": ["sm_90a"]}, indent=1) + "\n")
print(f"prebuilt {len(names)} libraries with CUDA {full}")
EOF
  echo "prebuild took $(( $(date +%s) - start )) s"
else
  echo "no prebuild (PREBUILD=$PREBUILD, nvcc or torch missing): the device will JIT-compile"
fi

find "$DEST" -name __pycache__ -type d -prune -exec rm -rf {} +
cat > "$DEST/README.txt" <<EOF
Built by benchmarks/flashinfer_carry.sh on $(date -u +%FT%TZ) from $(basename "$FI_WHEEL") and
$(basename "$TVM312_WHEEL"). site/ goes on sys.path (benchmarks/flashinfer_h2h.py does it).
Prebuilt: $(ls "$BACKEND"/aot/*.so 2>/dev/null | wc -l) sm_90a libraries.
EOF
echo "--- .fi/ contents"
du -sh "$SITE"/*
if [[ -d "$BACKEND/aot" ]]; then du -sh "$BACKEND/aot"; fi
total=$(du -sb "$DEST" | cut -f1)
echo "TOTAL: $(du -sh "$DEST" | cut -f1) ($total bytes) in $DEST"
# The device takes 64 MiB of working tree per call, the repository itself included.
if (( total > 60 * 1024 * 1024 )); then
  echo "error: .fi/ is over 60 MiB" >&2
  exit 1
fi
echo "device: carry ['.fi'], run python3 benchmarks/flashinfer_h2h.py (see its docstring)"
