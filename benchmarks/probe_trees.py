"""Variant copies of ``src/`` for ``kernel_ab.py --tree`` (session 2026-12-03 probes; see
docs/perf-notes.md, "one op core: performance gate"). Each variant is a checked text
substitution: if the target text is gone the script fails instead of timing production code.
Variants that were adopted or refuted (rstd_first, two_q_heads, trig_first_single_row) no longer
apply to this kernel; they are in this file's history (commit bdd73a8).

    python benchmarks/probe_trees.py /tmp/probes [NAME ...]   # writes /tmp/probes/<name>/src
"""

import pathlib
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
KERNEL = "qkrope/ops/qknorm_rope/kernel.py"

# The op's memory skeleton (issue "faster than a copy"): every row load and store, the slot
# load and the cache addressing, but no norm, no rotation and no trig (weights and positions
# are then dead loads and compile away). Its time is a floor for any kernel of this structure.
SKELETON = (KERNEL, '''    if not GPTJ and ROT == D:  # full NeoX rotary: one cos/sin per frequency, shared by halves
''', '''    SKELETON: tl.constexpr = True
    if SKELETON:
        lo = x_lo.to(DT)
        hi = x_hi.to(DT)
    elif not GPTJ and ROT == D:
''')

# The op without its trig: cos = 1, sin = 0, still computed from the loaded positions (the
# position load stays on the chain). The norm and rotation arithmetic are all there.
NO_TRIG = (KERNEL, '''        cos = libdevice.cos(angle)
        sin = libdevice.sin(angle)
''', '''        cos = angle * 0.0 + 1.0
        sin = angle * 0.0
''')

# Issue "one op core", #8 (+3.1% against c847d97, whose kernel computed some address products
# in int32): the same kernel with every int64 conversion made int32 (wrong for caches and views
# past 2**31 elements, right for the suite at its default capacity; never adopt as is). If #8
# comes back to 1.00, the fix is a launcher-chosen constexpr: int32 offsets when every tensor's
# largest element offset fits, int64 otherwise.
INT32_ADDRESSING = (KERNEL, ".to(tl.int64)", ".to(tl.int32)", "every")

# Partial NeoX rotary (Qwen3.5: 64 of 256 dims), the low half: NeoX's frequency of dim d is
# d % (ROT / 2), so cos/sin of the ROT / 2 distinct frequencies (32, not 128) tiled over the
# half give the same values. Exact (tests/test_probe_trees.py); its SASS counts, prediction and
# the device step that decides adoption: docs/perf-notes.md, "Open leads".
PARTIAL_ROTARY_FREQS = (KERNEL, '''    angle = _angles(pos_ptr, pos_off, t_mask, freq, inv_freq_ptr, stride_inv_freq, stride_pos_r,
                    MROPE, SEC_T, SEC_H, SEC_W, WIDE)
    cos, sin = _cos_sin(angle[None, :, :], DT, COS_SIN_SCALE, INTERPRETER)
''', '''    R2: tl.constexpr = ROT // 2
    BT: tl.constexpr = x.shape[1]
    N: tl.constexpr = x.shape[2]
    # Only ever true for the low half (d = arange(N)): the high half is rotated only when
    # GPT-J or ROT > N.
    PERIODIC: tl.constexpr = (not GPTJ) and ROT <= N and N % R2 == 0 and (R2 & (R2 - 1)) == 0
    if PERIODIC:
        angle = _angles(pos_ptr, pos_off, t_mask, tl.arange(0, R2), inv_freq_ptr,
                        stride_inv_freq, stride_pos_r, MROPE, SEC_T, SEC_H, SEC_W, WIDE)
        cos, sin = _cos_sin(angle, DT, COS_SIN_SCALE, INTERPRETER)
        cos = tl.reshape(tl.broadcast_to(cos[:, None, :], (BT, N // R2, R2)), (BT, N))[None]
        sin = tl.reshape(tl.broadcast_to(sin[:, None, :], (BT, N // R2, R2)), (BT, N))[None]
    else:
        angle = _angles(pos_ptr, pos_off, t_mask, freq, inv_freq_ptr, stride_inv_freq,
                        stride_pos_r, MROPE, SEC_T, SEC_H, SEC_W, WIDE)
        cos, sin = _cos_sin(angle[None, :, :], DT, COS_SIN_SCALE, INTERPRETER)
''')

VARIANTS = {
    # loads and stores only: a lower bound (wrong results by design; never adopt)
    "skeleton": [SKELETON],
    # everything but the trig: what the norm and rotation alone cost (wrong results by design)
    "no_trig": [NO_TRIG],
    # int32 address arithmetic: what int64 offsets cost (wrong past 2**31 elements by design)
    "int32_addressing": [INT32_ADDRESSING],
    # partial NeoX rotary: cos/sin on the ROT / 2 distinct frequencies (exact; a candidate)
    "partial_rotary_freqs": [PARTIAL_ROTARY_FREQS],
}


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    unknown = set(sys.argv[2:]) - set(VARIANTS)
    if unknown:
        sys.exit(f"unknown variant(s) {', '.join(sorted(unknown))}; this kernel has "
                 f"{', '.join(VARIANTS)} (older ones: see the module docstring)")
    for name, edits in VARIANTS.items():
        if sys.argv[2:] and name not in sys.argv[2:]:
            continue
        dest = out / name / "src"
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(ROOT / "src", dest)
        for rel, old, new, *every in edits:
            path = dest / rel
            text = path.read_text()
            if text.count(old) < 1 or (not every and text.count(old) != 1):
                sys.exit(f"{name}: the text to replace in {rel} is not there "
                         f"{'at all' if every else 'exactly once'}")
            path.write_text(text.replace(old, new))
        print(dest)


if __name__ == "__main__":
    main()
