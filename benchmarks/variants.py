"""Kernel variants: the production kernel.py (or its store helpers, quantize.py) with a checked
text substitution each, the one variant mechanism of the benchmark scripts (experiments stay
out of ``src/``).

A variant is used two ways:

- as a whole patched copy of ``src/`` (:func:`write_tree`), for ``kernel_ab.py --variant NAME``
  (timed in its own worker process against a git revision) or to run the tests on it;
- as a kernel imported from patched copies of kernel.py and quantize.py
  (:func:`variant_kernel`), for ``tile_sweep.py --variants`` and ``compile_sm90.py --variant``
  (in-process, forced tiles).

Every text to replace must occur exactly once (``every``: at least once), so a kernel change breaks
a variant loudly instead of silently timing the production kernel (tests/test_variants.py).
Variants that were adopted or refuted (rstd_first, two_q_heads, trig_first_single_row; the eviction
hints of docs/design.md §Tile rule: commit bdd73a8; partial_rotary_freqs, fma_division,
satfinite_store, fp8_stores, pth_amax_max, int8_no_clamp, pth_lean, pth_early, pth_lean_early,
pth_fma_quotient, pth_newton_reciprocal, pth_int_amax, int8_cvt_rz, quotient_no_select: adopted, in
git before the commit that adopted them; q8_store8, kv_first: refuted, docs/perf-notes.md leads 6 g
and 6 k; quant_lean, scaled_pow2_branch with int8_cvt_rz, scaled_pow2_only, q8_lean: mixed, not
adopted, lead 6 m) are in git history. What each variant measured: docs/design.md and
docs/perf-notes.md.

    python benchmarks/variants.py /tmp/v [NAME ...]     # writes /tmp/v/<name>/src, prints it
"""

from __future__ import annotations

import hashlib
import importlib.util
import pathlib
import shutil
import sys
import tempfile
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
KERNEL = "qkrope/ops/qknorm_rope/kernel.py"
QUANTIZE = "qkrope/ops/qknorm_rope/quantize.py"


class Edit(NamedTuple):
    path: str           # relative to src/
    old: str
    new: str
    every: bool = False  # replace every occurrence (at least one) instead of exactly one


# The op's memory skeleton: every row load and store, the slot load and the cache addressing,
# but no norm, no rotation and no trig (weights and positions become dead loads). A floor for
# any kernel of this structure (docs/design.md §Load and trig order).
_SKELETON = Edit(KERNEL, '''    if not GPTJ and ROT == D:  # full NeoX rotary: one cos/sin per frequency, shared by halves
''', '''    SKELETON: tl.constexpr = True
    if SKELETON:
        lo = x_lo.to(DT)
        hi = x_hi.to(DT)
    elif not GPTJ and ROT == D:
''')

_NO_TRIG = [Edit(KERNEL, "cos = libdevice.cos(angle)", "cos = angle * 0.0 + 1.0"),
            Edit(KERNEL, "sin = libdevice.sin(angle)", "sin = angle * 0.0")]

_TRIG_HW = [Edit(KERNEL, "cos = libdevice.cos(angle)", "cos = libdevice.fast_cosf(angle)"),
            Edit(KERNEL, "sin = libdevice.sin(angle)", "sin = libdevice.fast_sinf(angle)")]

# The static-scale FP8 store's exact quotient (kernel._store_scaled): without the subnormal
# scale's rescale, and, a bound for any exact form, as a plain product by the reciprocal.
_SCALED_RESCALE = ("            m = tl.where((a > 0.0) & (a < 1.1754943508222875e-38), "
                   "18446744073709551616.0, 1.0)\n")
_SCALED_FMA = ("            q = tl.fma(tl.fma(q0, tl.where(s == float(\"inf\"), 0.0, s), nx), nr, "
               "q0)\n")
_NO_RESCALE = Edit(KERNEL, _SCALED_RESCALE, "            m = 1.0\n")
_PRODUCT = Edit(KERNEL, _SCALED_FMA, "            q = x * tl.math.div_rn(1.0, scale)\n")

# The query's power-of-two test from one scalar load, no reduction over the tile: a per-tensor
# q_scale (stride 0) that is a normal power of two takes the bare product, anything else
# production's quotient (scaled_pow2_only's tile-wide max read 3-5% slower on mid-size rows at
# a calibrated scale, docs/perf-notes.md lead 6 m).
_Q_STORES = """\
        _store_scaled(q_out_ptr, qo_row + d_lo * stride_qo_d, q_lo, q_mask, q_sc, QO_SCALED,
                      INTERPRETER, SAT_CVT)
        _store_scaled(q_out_ptr, qo_row + d_hi * stride_qo_d, q_hi, q_mask, q_sc, QO_SCALED,
                      INTERPRETER, SAT_CVT)
"""
_POW2_SCALAR = [
    Edit(KERNEL, _Q_STORES, """        pow2 = False
        if QO_SCALED and not INTERPRETER:
            sb = tl.load(q_scale_ptr).to(tl.int32, bitcast=True)
            pow2 = ((sb & 0x7FFFFF) == 0) & ((sb & 0x7F800000) != 0) & (stride_q_scale == 0)
        if pow2:
            r = tl.math.div_rn(1.0, q_sc)
            _store_fp8(q_out_ptr, qo_row + d_lo * stride_qo_d, _f32(q_lo, INTERPRETER) * r, q_mask,
                       INTERPRETER, SAT_CVT)
            _store_fp8(q_out_ptr, qo_row + d_hi * stride_qo_d, _f32(q_hi, INTERPRETER) * r, q_mask,
                       INTERPRETER, SAT_CVT)
        else:
""" + "".join(f"    {line}\n" for line in _Q_STORES.splitlines()))]

# Every bf16 -> fp32 conversion of the GPU path (rows, weights, the FP8 quotient's rotated
# rows) as one shift and one mask a register of two elements (PTX through inline assembly; the
# interpreter path keeps its own), where LLVM extracts each 16-bit half first: PRMT + SHF for
# every high element. The same bits (the conversion is a shift either way).
_BF16_UNPACK = [
    Edit(KERNEL, """@triton.jit
def _f32(""", """@triton.jit
def _bf16_pairs_f32(x):
    return tl.inline_asm_elementwise("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xFFFF0000; }",
                                     "=r,=r,r", [x], dtype=tl.float32, is_pure=True, pack=2)


@triton.jit
def _f32("""),
    Edit(KERNEL, """        return tl.where(y != y, float("nan"), y)
    else:
        return x.to(tl.float32)
""", """        return tl.where(y != y, float("nan"), y)
    elif x.dtype == tl.bfloat16:
        return _bf16_pairs_f32(x)
    else:
        return x.to(tl.float32)
""")]

# HF's Qwen3 norm (norm_rounding="hf") multiplies the weight and the rounded normalised row
# in bf16. Loaded as [1, 1, D/2], the weights cross to the rows' layout in fp32 through shared
# memory, and LLVM no longer sees a bf16 operand: an FMUL and a rounding an element. Loaded in
# the rows' own shape (zero strides along heads and tokens; L1 hits), they stay bf16 into the
# product, a native bf16 multiply a pair. The same values (the fp32 product of two bf16 values
# is exact, so one rounding either way); the GPU path only.
_HF_WEIGHTS_ROWS = [
    Edit(KERNEL, """def _load_tile(x_ptr, row_off, stride_d, mask, w_ptr, stride_w, D: tl.constexpr,
               W_OFFSET: tl.constexpr, INTERPRETER: tl.constexpr, WIDE: tl.constexpr):""",
         """def _load_tile(x_ptr, row_off, stride_d, mask, w_ptr, stride_w, D: tl.constexpr,
               W_OFFSET: tl.constexpr, HF_NORM: tl.constexpr, INTERPRETER: tl.constexpr,
               WIDE: tl.constexpr):"""),
    Edit(KERNEL, """    w_lo = _load_weight(w_ptr, d_lo, stride_w, W_OFFSET, INTERPRETER, WIDE)
    w_hi = _load_weight(w_ptr, d_hi, stride_w, W_OFFSET, INTERPRETER, WIDE)
""", """    if HF_NORM and W_OFFSET == 0.0 and not INTERPRETER:
        zero = row_off * 0
        w_lo = tl.load(w_ptr + (zero + _index(d_lo, WIDE)[None, None, :] * stride_w))
        w_hi = tl.load(w_ptr + (zero + _index(d_hi, WIDE)[None, None, :] * stride_w))
        w_lo, w_hi = w_lo.to(tl.float32), w_hi.to(tl.float32)
    else:
        w_lo = _load_weight(w_ptr, d_lo, stride_w, W_OFFSET, INTERPRETER, WIDE)
        w_hi = _load_weight(w_ptr, d_hi, stride_w, W_OFFSET, INTERPRETER, WIDE)
"""),
    Edit(KERNEL, "stride_q_w, D, W_OFFSET, INTERPRETER, WIDE)",
         "stride_q_w, D, W_OFFSET, HF_NORM, INTERPRETER,\n"
         "                                                WIDE)"),
    Edit(KERNEL, "stride_k_w, D, W_OFFSET, INTERPRETER, WIDE)",
         "stride_k_w, D, W_OFFSET, HF_NORM, INTERPRETER,\n"
         "                                                WIDE)")]

#: name -> (what it probes, edits).
VARIANTS: dict[str, tuple[str, list[Edit]]] = {
    "skeleton": ("loads and stores only, no norm, rotation or trig: a lower bound for this "
                 "structure (wrong results by design)", [_SKELETON]),
    "no_trig": ("cos = 1, sin = 0, still computed from the loaded positions: what the trig "
                "costs (wrong results by design)", _NO_TRIG),
    "trig_hw": ("libdevice's fast_cosf/fast_sinf (MUFU approximations) instead of the accurate "
                "cos/sin: cost probe, wrong at large angles", _TRIG_HW),
    "int32_addressing": ("every int64 conversion made int32: what int64 offsets cost (wrong "
                         "past 2**31 elements by design)",
                         [Edit(KERNEL, ".to(tl.int64)", ".to(tl.int32)", every=True)]),
    "scaled_no_rescale": ("static-scale FP8 stores without the subnormal scale's rescale: what "
                          "it costs (wrong for subnormal scales by design)", [_NO_RESCALE]),
    "scaled_product": ("static-scale FP8 stores as x * RN(1/s), no rescale, no FMA correction: "
                       "what the exact quotient costs (wrong in rare last-ulp cases by design)",
                       [_PRODUCT]),
    "scaled_pow2_scalar": ("FP8 query stores: a per-tensor q_scale that is a normal power of "
                           "two (one scalar load, no reduction) takes the product by the "
                           "reciprocal; else production's quotient; the same bits",
                           _POW2_SCALAR),
    "bf16_unpack": ("every bf16 -> fp32 conversion of the GPU path as a shift and a mask a "
                    "register of two elements, not an extract and shift each; the same bits",
                    _BF16_UNPACK),
    "hf_weights_rows": ("HF's norm rounding: the weights loaded in the rows' shape, so the "
                        "weight product stays a bf16 multiply; the same values",
                        _HF_WEIGHTS_ROWS),
    "bf16_unpack_hf": ("bf16_unpack and hf_weights_rows together", _BF16_UNPACK
                       + _HF_WEIGHTS_ROWS),
}


def _known(name: str) -> None:
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; this kernel has {', '.join(VARIANTS)} "
                         "(older ones: see benchmarks/variants.py's docstring)")


def patched(name: str, src: pathlib.Path = ROOT / "src") -> dict[str, str]:
    """``{path relative to src: patched text}`` of variant ``name``; raises RuntimeError where
    a text to replace is not there (exactly once, or at all for ``every``)."""
    _known(name)
    out: dict[str, str] = {}
    for e in VARIANTS[name][1]:
        text = out.get(e.path) or (src / e.path).read_text()
        n = text.count(e.old)
        if n < 1 or (not e.every and n != 1):
            raise RuntimeError(f"variant {name!r}: {e.old[:60]!r} occurs {n} times in {e.path} "
                               f"(want {'at least ' if e.every else ''}1): update VARIANTS")
        out[e.path] = text.replace(e.old, e.new)
    return out


def write_tree(name: str, dest: pathlib.Path | str) -> pathlib.Path:
    """A copy of ``src/`` at ``dest/name/src`` with variant ``name`` applied; returns it."""
    files = patched(name)
    tree = pathlib.Path(dest) / name / "src"
    shutil.rmtree(tree, ignore_errors=True)
    shutil.copytree(ROOT / "src", tree, ignore=shutil.ignore_patterns("__pycache__"))
    for rel, text in files.items():
        (tree / rel).write_text(text)
    return tree


def variant_kernel(name: str | None):
    """The production ``qknorm_rope_kernel`` (``name`` None or "production"), or the kernel of
    a fresh copy of kernel.py (and of quantize.py, its store helpers) with variant ``name``
    applied. The copies are imported from files, not exec'd from strings: @triton.jit reads
    its source with ``inspect``."""
    from qkrope.ops.qknorm_rope import kernel as production

    if name in (None, "production"):
        return production.qknorm_rope_kernel
    root = pathlib.Path(production.__file__).resolve().parents[3]
    files = patched(name, root)
    if set(files) - {KERNEL, QUANTIZE}:
        raise ValueError(f"variant {name!r} patches {', '.join(files)}: use write_tree")
    src = files.get(KERNEL) or (root / KERNEL).read_text()
    if QUANTIZE in files:  # the copy's store helpers come from the patched quantize.py
        helpers = _import_copy(f"qkrope_quantize_{name}", files[QUANTIZE])
        src = src.replace("\nfrom .quantize import", f"\nfrom {helpers.__name__} import")
    # Imported as a lone file: its other relative imports name the production package.
    src = src.replace("\nfrom .", "\nfrom qkrope.ops.qknorm_rope.")
    return _import_copy(f"qkrope_kernel_{name}", src).qknorm_rope_kernel


def _import_copy(prefix: str, src: str):
    """``src`` imported as a module of its own (named by its hash: one module per text)."""
    module_name = f"{prefix}_{hashlib.sha1(src.encode()).hexdigest()[:10]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    path = pathlib.Path(tempfile.gettempdir()) / "qkrope-kernel-variants" / f"{module_name}.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        sys.exit("usage: python benchmarks/variants.py DEST [NAME ...]")
    names = argv[1:] or list(VARIANTS)
    try:
        for name in names:
            _known(name)
        for name in names:
            print(write_tree(name, argv[0]))
    except (ValueError, RuntimeError) as e:
        sys.exit(str(e))


if __name__ == "__main__":
    main()
