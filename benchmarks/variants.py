"""Kernel variants: the production kernel.py (or its store helpers, quantize.py) with a checked
text substitution each, the one variant mechanism of the benchmark scripts (experiments stay
out of ``src/``).

A variant is used two ways:

- as a whole patched copy of ``src/`` (:func:`write_tree`), for ``kernel_ab.py --variant NAME``
  (timed in its own worker process against a git revision) or to run the tests on it;
- as a kernel imported from patched copies of kernel.py and quantize.py
  (:func:`variant_kernel`), for ``tile_sweep.py --variants`` and ``compile_sm90.py --variant``
  (in-process, forced tiles).

Every text to replace must occur exactly once (``every``: at least once), so a kernel change
breaks a variant loudly instead of silently timing the production kernel
(tests/test_variants.py). Variants that were adopted or refuted (rstd_first, two_q_heads,
trig_first_single_row; the eviction hints of docs/design.md §Tile rule: commit bdd73a8;
partial_rotary_freqs, fma_division, satfinite_store, fp8_stores: adopted, in git before the
commit that adopted them) are in git history. What each variant measured: docs/design.md.

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

# Per-token-head scales with the max instructions handling NaN (docs/perf-notes.md, lead 6 d):
# the row maximum's combine (max.f32 on a GPU, fmax in the interpreter) skips a NaN (fp8: no
# select per element before the amax), a NaN-propagating one (max.NaN.f32) keeps it (int8: the
# row's NaN flag is its amax, one reduction fewer).
_PTH_AMAX_MAX = [
    Edit(QUANTIZE, """@triton.jit
def _token_head_scale(""", """@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _token_head_scale("""),
    Edit(QUANTIZE, """    amax = tl.maximum(_row_max(tl.where(x_lo != x_lo, 0.0, tl.abs(x_lo))),
                      _row_max(tl.where(x_hi != x_hi, 0.0, tl.abs(x_hi))))
    if out_ptr.dtype.element_ty == tl.int8:
        s = tl.maximum(tl.math.div_rn(amax, 127.0), 1e-6)
        nan = tl.maximum(_row_max(tl.where(x_lo != x_lo, 1.0, 0.0)),
                         _row_max(tl.where(x_hi != x_hi, 1.0, 0.0)))
        stored = tl.where(nan > 0, float("nan"), s)
    else:
        s = tl.maximum(tl.math.div_rn(amax, 448.0), 1e-6)
""", """    if out_ptr.dtype.element_ty == tl.int8:
        amax = tl.maximum(tl.reduce(tl.abs(x_lo), 2, _max_nan)[:, :, None],
                          tl.reduce(tl.abs(x_hi), 2, _max_nan)[:, :, None],
                          propagate_nan=tl.PropagateNan.ALL)
        s = tl.maximum(tl.math.div_rn(amax, 127.0), 1e-6)
        stored = tl.where(amax != amax, float("nan"), s)
    else:
        amax = tl.maximum(_row_max(tl.abs(x_lo)), _row_max(tl.abs(x_hi)))
        amax = tl.where(amax != amax, 0.0, amax)  # an all-NaN row: one select per row
        s = tl.maximum(tl.math.div_rn(amax, 448.0), 1e-6)
"""),
]

# INT8 codes without the clamp to [-128, 127]: from a per-token-head scale |y| < 127.00003, so
# trunc(y +- 0.5) is in [-127, 127] already (docs/perf-notes.md, lead 6 c).
_INT8_NO_CLAMP = [Edit(
    QUANTIZE, """        z = tl.minimum(tl.maximum(tl.where(y >= 0, y + 0.5, y - 0.5), -128.0), 127.0)""",
    """        z = tl.where(y >= 0, y + 0.5, y - 0.5)""")]

# Per-token-head scales with every row reduction of K and V before the first division
# (docs/perf-notes.md, lead 6 e): ``div_rn``'s slow-path branch ends a basic block, and ptxas
# schedules within one, so in production K's amax, K's division, K's NaN flag, V's amax, V's
# division... run one after another (row 1's one-warp programs: 5 shuffle rounds each). Here
# the amax of K and of V (an int8 row's NaN carried in it) come first and interleave.
_PTH_EARLY_KERNEL = [
    Edit(KERNEL, "from .quantize import _store_codes, _store_fp8, _token_head_scale",
         "from .quantize import _store_codes, _store_fp8, _token_head_amax, _token_head_scale_of"),
    Edit(KERNEL, """\
        if K_DYN:  # each row's own scale, stored too (docs/design.md, "Per-token-head scales")
            k32_lo, k32_hi = _f32(k_lo, INTERPRETER), _f32(k_hi, INTERPRETER)
            k_sc, k_r = _token_head_scale(k32_lo, k32_hi, k_cache_ptr)
""", """        if K_DYN:
            k32_lo, k32_hi = _f32(k_lo, INTERPRETER), _f32(k_hi, INTERPRETER)
            k_amax = _token_head_amax(k32_lo, k32_hi, k_cache_ptr)
        if V_DYN:
            v32 = _f32(v, INTERPRETER)
            v_amax = _token_head_amax(v32, v32, v_cache_ptr)
        if K_DYN:  # each row's own scale, stored too (docs/design.md, "Per-token-head scales")
            k_sc, k_r = _token_head_scale_of(k_amax, k_cache_ptr)
"""),
    Edit(KERNEL, """            v32 = _f32(v, INTERPRETER)
            v_sc, v_r = _token_head_scale(v32, v32, v_cache_ptr)
""", """            v_sc, v_r = _token_head_scale_of(v_amax, v_cache_ptr)
"""),
]
_SCALE_RETURN = "    return stored, tl.math.div_rn(1.0, stored)\n"
_SCALE_OF = '''

@triton.jit
def _token_head_scale_of(amax, out_ptr):
    """_token_head_scale's divisions, from _token_head_amax's row maximum."""
    if out_ptr.dtype.element_ty == tl.int8:
        s = tl.maximum(tl.math.div_rn(amax, 127.0), 1e-6)
        stored = tl.where(amax != amax, float("nan"), s)
    else:
        stored = tl.maximum(tl.math.div_rn(amax, 448.0), 1e-6)
    return stored, tl.math.div_rn(1.0, stored)
'''
_PTH_EARLY = _PTH_EARLY_KERNEL + [Edit(QUANTIZE, _SCALE_RETURN, _SCALE_RETURN + '''

@triton.jit
def _token_head_amax(x_lo, x_hi, out_ptr):
    """_token_head_scale's row reductions alone; an int8 row holding a NaN: amax NaN."""
    amax = tl.maximum(_row_max(tl.where(x_lo != x_lo, 0.0, tl.abs(x_lo))),
                      _row_max(tl.where(x_hi != x_hi, 0.0, tl.abs(x_hi))))
    if out_ptr.dtype.element_ty == tl.int8:
        nan = tl.maximum(_row_max(tl.where(x_lo != x_lo, 1.0, 0.0)),
                         _row_max(tl.where(x_hi != x_hi, 1.0, 0.0)))
        amax = tl.where(nan > 0, float("nan"), amax)
    return amax
''' + _SCALE_OF)]
# The same on pth_lean's quantize.py (its int8 amax carries a row's NaN already).
_PTH_LEAN_EARLY = _PTH_AMAX_MAX + _INT8_NO_CLAMP + _PTH_EARLY_KERNEL + [
    Edit(QUANTIZE, _SCALE_RETURN, _SCALE_RETURN + '''

@triton.jit
def _token_head_amax(x_lo, x_hi, out_ptr):
    """_token_head_scale's row reductions alone; an int8 row holding a NaN: amax NaN."""
    if out_ptr.dtype.element_ty == tl.int8:
        return tl.maximum(tl.reduce(tl.abs(x_lo), 2, _max_nan)[:, :, None],
                          tl.reduce(tl.abs(x_hi), 2, _max_nan)[:, :, None],
                          propagate_nan=tl.PropagateNan.ALL)
    amax = tl.maximum(_row_max(tl.abs(x_lo)), _row_max(tl.abs(x_hi)))
    return tl.where(amax != amax, 0.0, amax)  # an all-NaN row: one select per row
''' + _SCALE_OF)]

#: name -> (what it probes, edits).
VARIANTS: dict[str, tuple[str, list[Edit]]] = {
    "skeleton": ("loads and stores only, no norm, rotation or trig: a lower bound for this "
                 "structure (wrong results by design)", [_SKELETON]),
    "no_trig": ("cos = 1, sin = 0, still computed from the loaded positions: what the trig "
                "costs (wrong results by design)", _NO_TRIG),
    "trig_hw": ("libdevice's fast_cosf/fast_sinf (MUFU approximations) instead of the accurate "
                "cos/sin: cost probe, wrong at large angles", _TRIG_HW),
    "pth_amax_max": ("per-token-head amax with NaN handled by max.f32 / max.NaN.f32: no "
                     "select per element, int8's NaN flag reduction gone",
                     _PTH_AMAX_MAX),
    "int8_no_clamp": ("int8 codes without the dead clamp to [-128, 127]", _INT8_NO_CLAMP),
    "pth_lean": ("pth_amax_max and int8_no_clamp together", _PTH_AMAX_MAX + _INT8_NO_CLAMP),
    "pth_early": ("per-token-head: K's and V's row reductions before the first division",
                  _PTH_EARLY),
    "pth_lean_early": ("pth_lean and pth_early together", _PTH_LEAN_EARLY),
    "int32_addressing": ("every int64 conversion made int32: what int64 offsets cost (wrong "
                         "past 2**31 elements by design)",
                         [Edit(KERNEL, ".to(tl.int64)", ".to(tl.int32)", every=True)]),
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
