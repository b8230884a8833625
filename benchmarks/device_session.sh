#!/usr/bin/env bash
# One device call per step (each step's output lands in $OUT, which the device tool returns).
# Usage on the GPU machine, from the repo root:
#   bash benchmarks/device_session.sh tests      # full GPU test run                 (~80 s)
#   bash benchmarks/device_session.sh tests-x    # the same with pytest-xdist -n 12  (~2.5 min)
#   bash benchmarks/device_session.sh python     # QKROPE_NATIVE=0: launcher + GPU tests
#   bash benchmarks/device_session.sh faults     # kill mid-build, GPU tests x2 (-n 12), memcheck
#   bash benchmarks/device_session.sh quick      # qkrope bench, qkrope only (~80 s)
#   bash benchmarks/device_session.sh memcheck   # the append and compiled paths' GPU tests
#                                                  # under compute-sanitizer memcheck (~2 min)
#   bash benchmarks/device_session.sh suite      # qkrope bench, suite, JSON + plot (~200 s)
#   bash benchmarks/device_session.sh paged      # qkrope bench --layout paged       (~90 s)
#   bash benchmarks/device_session.sh flashinfer # qkrope bench --layout paged vs FlashInfer
#   bash benchmarks/device_session.sh sweep      # --sweep vs torch.compile, 96/8 and 32/8 heads
#   bash benchmarks/device_session.sh presets    # sweeps: qwen3-32b, qwen3-vl-8b, qwen3.5-27b
#   bash benchmarks/device_session.sh e2e [PRESET [ARGS]] # qkrope bench --e2e: the model, stock vs
#                                                  # patched (H100, two processes per variant:
#                                                  # qwen3-8b 270-324 s, qwen3-32b 293-353,
#                                                  # qwen3.5-27b 309-374); ARGS pass on (e.g.
#                                                  # --modes reduce-overhead --phases decode
#                                                  # --batch 1)
#   bash benchmarks/device_session.sh tests-e2e [PRESET] # the GPU tests (xdist, ~3 min), then
#                                                  # e2e, in one call: after a change of the op
#                                                  # or the integration (qwen3-8b only: the
#                                                  # others pass the 600 s a call may take)
#   bash benchmarks/device_session.sh quant [MODES] # qkrope only, bf16 vs each quantised mode,
#                                                  # both layouts (~3 min; one file per layout),
#                                                  # the ratio table (quant_table.py), then
#                                                  # host_probe --modes; MODES (e.g.
#                                                  # bf16,fp8,fp8-pth-q8): those, no host table
#   bash benchmarks/device_session.sh tiles      # tile sweep on the mid-size workloads
#   bash benchmarks/device_session.sh small-tiles # one head per program vs tiles, 1-64 tokens, 5 models
#   bash benchmarks/device_session.sh trig       # trig cost: kernel variants trig_hw, no_trig
#   bash benchmarks/device_session.sh host       # host µs per call: native helpers vs off
#   bash benchmarks/device_session.sh accuracy   # kernel vs reference vs exact fp64
#   bash benchmarks/device_session.sh ab REV     # kernel_ab.py: REV against the tree (needs .git)
#   bash benchmarks/device_session.sh ab-model REV MODEL # the same on MODEL's heads and options
#   bash benchmarks/device_session.sh variants REV NAME... # kernel_ab: REV, the tree, variants
#   bash benchmarks/device_session.sh variants-quant NAME... # quantised-store variants: the
#                                                  # per-token-head GPU tests on the last one's
#                                                  # tree, then tile_sweep: bf16, fp8-pth-q8 and
#                                                  # int8-pth, production and each variant at 4
#                                                  # tiles, alternating (tests ~2-3 min, sweep ~3)
#   bash benchmarks/device_session.sh variants-modes NAME... # a kernel variant that moves every
#                                                  # mode: the GPU tests of the op, quantised
#                                                  # outputs and appends on the last one's tree,
#                                                  # then tile_sweep at pick_config's tile,
#                                                  # production and each variant alternating,
#                                                  # in bf16, fp8, fp8-pth-q8, int8-pth and
#                                                  # fp8-pth-q8 at a scale not a power of two
#                                                  # (~5 min)
#   bash benchmarks/device_session.sh variants-q8 NAME... # FP8-query variants: the last
#                                                  # one's tree's GPU tests (variant_tests), then
#                                                  # tile_sweep of fp8-pth-q8 at 1/64 and 0.0166
#                                                  # (~4 min)
#   bash benchmarks/device_session.sh quant-tiles HQ,HKV,T,WARPS... # tile_sweep: bf16, fp8-pth-q8,
#                                                  # int8-pth at pick_config's tile and each
#                                                  # given one, alternating (~4 min)
#   bash benchmarks/device_session.sh verify REV # after a kernel change: tests, suite, A/B, sweep
#   bash benchmarks/device_session.sh e2e-ab SRC [ARGS] # e2e cells, another tree's src/ (e.g. a
#                                                  # carried `git archive REV src` copy) against
#                                                  # the working tree, alternating (~5 min)
#   bash benchmarks/device_session.sh bound [PRESET [CELLS]] # e2e_profile stock, patched and
#                                                  # free (a prologue reduced to the K/V copy),
#                                                  # kernels by name: what any prologue could
#                                                  # gain (~2 min); CELLS: mode:batch:phase,...
#   bash benchmarks/device_session.sh carried STEP [ARGS] # STEP under a Triton packed by
#                                                  # benchmarks/carry_triton.sh (its header)
#   bash benchmarks/device_session.sh route-check # tests and host figures behind a verified
#                                                  # Triton of the native route (~6 min)
#   bash benchmarks/device_session.sh route [PRESET] # the op's C++ compile route: its GPU tests,
#                                                  # host times, e2e_profile, e2e compile mode (~8 min)
# What needs no GPU runs here instead: python benchmarks/compile_sm90.py (benchmarks/README.md).
# Liger-Kernel, if wanted, travels as a wheel in .whl/ (see the device tool's README).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

# The bench / tile_sweep flags of an output mode (docs/perf-notes.md, lead 6); fp8-pth-q8-cal is
# fp8-pth-q8 at a static scale that is not a power of two, as calibrated ones are (lead 6 m).
mode_flags() {
  case $1 in
    bf16) echo "" ;;
    fp8) echo "--kv-dtype fp8" ;;
    fp8-pth-q8) echo "--kv-dtype fp8 --kv-scales per-token-head --q-out fp8" ;;
    fp8-pth-q8-cal) echo "--kv-dtype fp8 --kv-scales per-token-head --q-out fp8 --scale 0.0166" ;;
    int8-pth) echo "--kv-dtype int8 --kv-scales per-token-head" ;;
  esac
}

# Variants NAME...: each one's tree written under /tmp/v, the GPU tests of the op, quantised
# outputs and appends run on the last one's; sets $kernels (production,NAME,...) for tile_sweep.
variant_tests() {
  python3 benchmarks/variants.py /tmp/v "$@" || return 1
  PYTHONPATH=/tmp/v/${!#}/src${PYTHONPATH:+:$PYTHONPATH} timeout 240 python3 -m pytest -q \
    -p no:cacheprovider -n 12 tests/test_per_token_head.py tests/test_fp8_outputs.py \
    tests/test_append.py tests/test_qknorm_rope.py tests/test_gpu.py 2>&1 | tail -3
  kernels=production; for name in "$@"; do kernels=$kernels,$name; done
}

case "${1:-tests}" in
  tests) python3 -m pytest -q tests/ -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -15 ;;
  tests-x) # the same, 12 workers (~2.5 min on an H100), failures and the summary printed
    timeout 240 python3 -m pytest tests/ -q -p no:cacheprovider -n 12 > "$OUT/pytest.log" 2>&1
    echo "pytest rc=$?"; grep -E "^FAILED|^ERROR" "$OUT/pytest.log" | head
    tail -1 "$OUT/pytest.log" ;;
  suite) python3 -m qkrope bench --json "$OUT/bench.json" --plot "$OUT/bench.png" \
           2>&1 | tee "$OUT/bench.md" ;;
  paged) python3 -m qkrope bench --layout paged --impl qkrope,torch.compile,eager \
           --json "$OUT/paged.json" 2>&1 | tee "$OUT/paged.md" ;;
  sweep) for m in qwen3-coder-480b qwen3-8b; do
           python3 -m qkrope bench --sweep --model $m --impl qkrope,torch.compile --no-graph \
             --host-calls 200 --json "$OUT/sweep-$m.json" --plot "$OUT/sweep-$m.png" \
             2>&1 | tee "$OUT/sweep-$m.md"
         done ;;
  e2e)   python3 -m qkrope bench --e2e ${2:+--model $2} "${@:3}" --json "$OUT/e2e.json" \
           --plot "$OUT/e2e.png" 2>&1 | tee "$OUT/e2e.md" ;;
  tests-e2e)
    timeout 240 python3 -m pytest tests/ -q -p no:cacheprovider -n 12 > "$OUT/pytest.log" 2>&1
    echo "pytest rc=$?"; grep -E "^FAILED|^ERROR" "$OUT/pytest.log" | head; tail -1 "$OUT/pytest.log"
    python3 -m qkrope bench --e2e ${2:+--model $2} --json "$OUT/e2e.json" \
      --plot "$OUT/e2e.png" 2>&1 | tee "$OUT/e2e.md" | tail -30 ;;
  quant) # the quantised modes against bf16 outputs, one run each (~3 min in all); MODES
    # (comma-separated, bf16 first) times those only, without the host table
    modes=${2:-bf16,fp8,fp8-pth-q8,int8-pth,fp8-pth-q8-cal}
    for layout in bhsd paged; do
      for mode in ${modes//,/ }; do
        f=$(mode_flags $mode)
        # (one markdown file per layout: the device tool returns at most 8 files, so the step
        # leaves room for another step's in the same call)
        { echo "## $layout $mode"; echo
          python3 -m qkrope bench --impl qkrope --layout $layout $f --no-graph --host-calls 500 \
            2>&1 | grep -v "━"; echo "rc=${PIPESTATUS[0]}"; echo; } > /tmp/quant-run.md
        cat /tmp/quant-run.md >> "$OUT/quant-$layout.md"
        echo "$layout $mode $(grep "^rc=" /tmp/quant-run.md)"; grep -E "Geometric" /tmp/quant-run.md
      done
    done
    python3 benchmarks/quant_table.py "$OUT"  # the ratios to bf16 (BENCHMARKS.md's table)
    # host time per call, each mode against bf16 outputs in one process, runs alternating
    [ -n "${2:-}" ] || timeout 120 python3 benchmarks/host_probe.py --rows 1,2,p1,p2 --calls 1000 \
      --modes fp8,fp8-pth-q8,int8-pth 2>&1 | tee "$OUT/quant-host.md" ;;
  tiles) python3 benchmarks/tile_sweep.py --rows 3,4,6,8,10 \
           --configs pick 16,8,1,2 8,8,2,2 16,8,2,2 8,4,2,1 32,8,1,4 4,4,4,2 \
           --json "$OUT/tiles.json" 2>&1 | tee "$OUT/tiles.md" ;;
  trig)  python3 benchmarks/tile_sweep.py --rows 1,2,3,6,8,13 --configs pick \
           --variants production,trig_hw,no_trig --rounds 3 \
           --json "$OUT/trig.json" 2>&1 | tee "$OUT/trig.md" ;;
  host)  python3 benchmarks/host_probe.py --rows 1,2 2>&1 | tee "$OUT/host.md" ;;
  python) QKROPE_NATIVE=0 python3 -m pytest -q -p no:cacheprovider tests/test_launcher.py \
            tests/test_gpu.py tests/test_compile.py 2>&1 | tee "$OUT/pytest-python.log" | tail -5 ;;
  accuracy) python3 benchmarks/accuracy.py 2>&1 | tee "$OUT/accuracy.md" ;;
  ab)    python3 benchmarks/kernel_ab.py --rev "${2:?usage: device_session.sh ab REV}" \
           --json "$OUT/kernel-ab.json" 2>&1 | tee "$OUT/kernel-ab.md" ;;
  ab-model) python3 benchmarks/kernel_ab.py --rev "${2:?usage: device_session.sh ab-model REV MODEL}" \
           --model "${3:?usage: device_session.sh ab-model REV MODEL}" --rounds 3 --iters 40 \
           --workloads 1,2,3,4,5,8,10,12,13,p1,p2 --json "$OUT/kernel-ab-$3.json" \
           2>&1 | tee "$OUT/kernel-ab-$3.md" ;;
  quick) python3 -m qkrope bench --impl qkrope --json "$OUT/quick.json" 2>&1 | tee "$OUT/quick.md" ;;
  memcheck) # (not the full-cache test: its device assert, on purpose, is a report per warp)
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 300 compute-sanitizer --tool memcheck \
      --report-api-errors no --error-exitcode 7 python3 -m pytest tests/test_append.py \
      tests/test_compile.py -q -p no:cacheprovider -k "not device_side_assert" \
      > "$OUT/memcheck.log" 2>&1; echo "memcheck rc=$?"; tail -2 "$OUT/memcheck.log" ;;
  faults) # a process killed mid-build, then the GPU tests twice (pytest-xdist), then memcheck
          # (API statuses not reported: the native plan's end-of-table parameter probe is one)
    PYTEST_ARGS="-n 12" PYTEST_TIMEOUT=300 bash benchmarks/device_faults.sh "$OUT" 2 \
      > "$OUT/faults.log" 2>&1
    grep -E "^==|^--|status after|rc=|passed|failed" "$OUT/faults.log" | tail -14
    # (No caching allocator: memcheck then knows each tensor's bounds. Caches of at most 8192
    # rows: the suite's 2**18-row caches ran out of an H100's 80 GB under memcheck.)
    k="(large_random_shapes and (noncontig or fp16 or d64)) or fast_launch_path"
    k="$k or paged_matches_reference or bhsd_entry_point_has_every_variant"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool memcheck \
      --report-api-errors no --error-exitcode 7 python3 -m pytest tests/test_gpu.py \
      tests/test_qknorm_rope.py -q -p no:cacheprovider -k "$k" \
      > "$OUT/sanitizer.log" 2>&1; echo "sanitizer rc=$?"
    grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitizer.log" | tail -3 ;;
  presets) for m in qwen3-32b qwen3-vl-8b qwen3.5-27b; do
           python3 -m qkrope bench --sweep --model $m --impl qkrope,torch.compile --no-graph \
             --host-calls 200 --json "$OUT/sweep-$m.json" --plot "$OUT/sweep-$m.png" \
             2>&1 | tee "$OUT/sweep-$m.md" | tail -3
         done ;;
  flashinfer) # FlashInfer 0.7.x importable (installed, or carried: PYTHONPATH=its site dir)
    python3 -m qkrope bench --layout paged --model qwen3-32b --impl qkrope,flashinfer \
      --json "$OUT/paged-flashinfer.json" 2>&1 | tee "$OUT/paged-flashinfer.md" ;;
  variants) # kernel variants of benchmarks/variants.py against REV and the tree, interleaved
    rev=${2:?usage: device_session.sh variants REV NAME...}; shift 2
    python3 benchmarks/kernel_ab.py --rev "$rev" ${@/#/--variant=} --rounds 3 --iters 40 \
      --json "$OUT/kernel-ab-variants.json" 2>&1 | tee "$OUT/kernel-ab-variants.md" ;;
  variants-quant) # quantised-store variants (benchmarks/variants.py): the per-token-head GPU
    # tests on the last variant's tree, then tile_sweep per mode (bf16 outputs first, for the
    # ratio): production and each variant at pick_config's tile and at narrower K/V tiles
    # (docs/perf-notes.md, lead 6 f), alternating in one process
    shift; variant_tests "$@" || exit 1
    rows=1,2,3,4,5,6,7,8,9,10,11,12,13,p1,p2,p3 tiles="pick 16,4,1,2 16,2,1,2 16,1,1,2"
    timeout 120 python3 benchmarks/tile_sweep.py --rows $rows --configs $tiles --rounds 3 \
      > "$OUT/tiles-bf16.md" 2>&1; echo "bf16 rc=$?"
    for mode in fp8-pth-q8 int8-pth; do
      f=$(mode_flags $mode)
      timeout 240 python3 benchmarks/tile_sweep.py --rows $rows $f --rounds 3 \
        --configs $tiles --variants $kernels > "$OUT/tiles-$mode.md" 2>&1; echo "$mode rc=$?"
    done
    grep -h "^#" "$OUT"/tiles-*.md | cut -c1-400 ;;
  variants-modes) # (docs/perf-notes.md, lead 6 k)
    shift; variant_tests "$@" || exit 1
    for mode in bf16 fp8 fp8-pth-q8 int8-pth fp8-pth-q8-cal; do
      f=$(mode_flags $mode)
      timeout 150 python3 benchmarks/tile_sweep.py --rows 1,2,3,4,8,13,p1,p2,p3 $f \
        --configs pick --variants $kernels --rounds 5 > "$OUT/variants-$mode.md" 2>&1
      echo "$mode rc=$?"
    done
    grep -h "^#\|^|" "$OUT"/variants-*.md | cut -c1-300 ;;
  variants-q8) # FP8-query variants (docs/perf-notes.md, lead 6 m): variant_tests on the last
    # one's tree, then tile_sweep of fp8-pth-q8 at 1/64 and at 0.0166, production and each
    # variant alternating (~4 min)
    shift; variant_tests "$@" || exit 1
    for mode in fp8-pth-q8 fp8-pth-q8-cal; do
      timeout 120 python3 benchmarks/tile_sweep.py --rows 3,4,8,13,p1,p2,p3 $(mode_flags $mode) \
        --configs pick --variants $kernels --rounds 3 > "$OUT/variants-$mode.md" 2>&1
      echo "$mode rc=$?"; grep "^#" "$OUT/variants-$mode.md" | cut -c1-300
    done ;;
  quant-tiles) # pick_config's tile against the given ones per output mode (bf16 first, for the
    # ratio), candidates alternating in one process (docs/perf-notes.md, lead 6)
    shift; tiles="pick $*"; rows=1,2,3,4,5,6,7,8,9,10,11,12,13,p1,p2,p3
    for mode in bf16 fp8-pth-q8 int8-pth; do
      f=$(mode_flags $mode)
      timeout 180 python3 benchmarks/tile_sweep.py --rows $rows $f --configs $tiles --rounds 3 \
        > "$OUT/tiles-$mode.md" 2>&1; echo "$mode rc=$?"
    done
    grep -h "^#" "$OUT"/tiles-*.md | cut -c1-400 ;;
  verify) # GPU tests (xdist), the suite, the partial-rotary preset's sweep, kernel_ab against REV
    rev=${2:?usage: device_session.sh verify REV}
    timeout 240 python3 -m pytest tests/ -q -p no:cacheprovider -n 12 > "$OUT/pytest.log" 2>&1
    echo "pytest rc=$?"; tail -2 "$OUT/pytest.log"
    timeout 150 python3 -m qkrope bench --impl qkrope --json "$OUT/quick.json" > "$OUT/quick.md" 2>&1
    grep -E "^\| [0-9]+ \||Geometric" "$OUT/quick.md" | head -14 | cut -d'|' -f2,8,9,12,14
    timeout 90 python3 -m qkrope bench --sweep --model qwen3.5-27b --impl qkrope --no-graph \
      --host-calls 200 --json "$OUT/sweep-qwen3.5-27b.json" --plot "$OUT/sweep-qwen3.5-27b.png" \
      > "$OUT/sweep-qwen3.5-27b.md" 2>&1; echo "sweep rc=$?"; grep Geometric "$OUT/sweep-qwen3.5-27b.md"
    timeout 150 python3 benchmarks/kernel_ab.py --rev "$rev" --rounds 2 --iters 30 \
      --json "$OUT/kernel-ab.json" > "$OUT/kernel-ab.md" 2>&1; echo "kernel_ab rc=$?"
    grep -E "^\| (row|[0-9p]+) \||geomean" "$OUT/kernel-ab.md" ;;
  small-tiles) for m in qwen3-coder-480b qwen3-32b qwen3-8b qwen3-0.6b qwen3.5-27b; do
           big=16,8,1,2; [ $m = qwen3.5-27b ] && big=8,4,1,2
           python3 benchmarks/tile_sweep.py --model $m --configs pick 1,1,1,1 $big --rounds 3 \
             --rows 1:0:1,2:0:1,4:0:1,6:0:1,8:0:1,16:0:1,32:0:1,64:0:1,1:511:4,1:511:16 \
             --json "$OUT/small-tiles-$m.json" 2>&1 | tee "$OUT/small-tiles-$m.md"
         done ;;
  bound) # docs/perf-notes.md, lead 7: stock ÷ free is the most a prologue could gain per cell
    cells=${3:-eager:1:decode,compile:1:decode,reduce-overhead:1:decode,reduce-overhead:8:decode}
    timeout 300 python3 benchmarks/e2e_profile.py --model "${2:-qwen3-8b}" --variants \
      stock,patched,free --cells "$cells" \
      --top 40 --json "$OUT/bound.json" > "$OUT/bound.md" 2>&1; echo "bound rc=$?"
    grep -E "^###|^\| " "$OUT/bound.md" ;;
  carried) # Triton packed by benchmarks/carry_triton.sh: the earlier calls' parts in /tmp, the
           # last one carried; unpacked, put first on PYTHONPATH, then STEP [ARGS] as usual
    parts=()
    for n in $( (ls .carry/triton; ls /tmp) 2>/dev/null | grep -E '^part[0-9]+$' | sort -u); do
      if [ -f ".carry/triton/$n" ]; then parts+=(".carry/triton/$n"); else parts+=("/tmp/$n"); fi
    done
    mkdir -p /tmp/triton-carried
    cat "${parts[@]}" | xz -d | tar -x -C /tmp/triton-carried ||
      { echo "carried: unpacking ${parts[*]} failed"; exit 3; }
    PYTHONPATH=/tmp/triton-carried${PYTHONPATH:+:$PYTHONPATH} exec bash "$0" "${@:2}" ;;
  route-check) # what a new entry of _launch.VERIFIED_TRITON rests on (docs/design.md, "Native
    # launch route"): the kernel and launch tests, the compile and HF tests, then decode #1 and
    # #2 on the native route and #1 with QKROPE_NATIVE=0 (Triton's own launch), host beside GPU
    timeout 200 python3 -m pytest -q -p no:cacheprovider -n 12 tests/test_gpu.py \
      tests/test_launcher.py tests/test_native.py tests/test_qknorm_rope.py \
      tests/test_per_token_head.py tests/test_fp8_outputs.py tests/test_faults.py \
      tests/test_autograd.py > "$OUT/pytest-route.log" 2>&1
    echo "kernel and launch tests rc=$?"; grep -E "^FAILED|^ERROR" "$OUT/pytest-route.log" | head
    tail -1 "$OUT/pytest-route.log"
    timeout 150 python3 -m pytest -q -p no:cacheprovider -n 12 tests/test_compile.py \
      tests/test_transformers.py > "$OUT/pytest-route-compile.log" 2>&1
    echo "compile and HF tests rc=$?"; tail -1 "$OUT/pytest-route-compile.log"
    for s in 1,0,1:native 1,2048,4:native 1,0,1:triton; do  # (no commas in $OUT's file names)
      native=1; [ "${s#*:}" = triton ] && native=0; f="$OUT/route-${s//,/-}.md"; f=${f/:/-}
      QKROPE_NATIVE=$native timeout 90 python3 -m qkrope bench --impl qkrope --shape "${s%:*}" \
        --no-graph --host-calls 500 > "$f" 2>&1; echo "bench ${s} rc=$?"
      grep -E "^Launch route|^\| [0-9]+ \|" "$f" | cut -c1-160
    done ;;
  route) # the registered op's C++ kernel (csrc/op_route.cpp): its tests, the op's host time in a
         # graph, what a compiled step launches, then the compiled cells of the e2e table
    timeout 240 python3 -m pytest -q -p no:cacheprovider -n 12 tests/test_compile.py \
      tests/test_native.py tests/test_gpu.py tests/test_transformers.py 2>&1 | tail -4
    timeout 150 python3 benchmarks/e2e_profile.py --model "${2:-qwen3-8b}" > "$OUT/e2e-profile.md" 2>&1
    tail -7 "$OUT/e2e-profile.md"
    timeout 180 python3 -m qkrope bench --e2e --model "${2:-qwen3-8b}" --modes compile \
      --json "$OUT/e2e-compile.json" 2>&1 | tee "$OUT/e2e-compile.md" | tail -9 ;;
  e2e-ab) # the working tree against another tree's src/ (PYTHONPATH first), runs alternating
         # old, new, new, old while under 5 minutes; a cell's ratio is interleaved within a run
    src=$(realpath "${2:?usage: device_session.sh e2e-ab SRC [qkrope bench --e2e ARGS]}")
    args=("${@:3}"); [ ${#args[@]} -eq 0 ] && args=(--model qwen3-8b --modes
      reduce-overhead,compile --phases decode --batch 1)
    t0=$(date +%s)
    for tree in other this this other; do
      [ $(( $(date +%s) - t0 )) -gt 300 ] && break
      p=${PYTHONPATH:-}; [ $tree = other ] && p=$src${PYTHONPATH:+:$PYTHONPATH}
      PYTHONPATH=$p timeout 200 python3 -m qkrope bench --e2e "${args[@]}" > /tmp/ab-run.md 2>&1
      echo "$tree rc=$? t=$(( $(date +%s) - t0 ))s" | tee -a "$OUT/e2e-ab.md"
      grep -E "^\| [a-z]" /tmp/ab-run.md | grep -v "^| preset" | tee -a "$OUT/e2e-ab.md"
    done ;;
  *) echo "unknown step $1" >&2; exit 2 ;;
esac
