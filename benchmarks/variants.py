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
partial_rotary_freqs, fma_division, satfinite_store, fp8_stores, pth_amax_max, int8_no_clamp,
pth_lean, pth_early, pth_lean_early, pth_fma_quotient, pth_newton_reciprocal: adopted, in git
before the commit that adopted them; q8_store8, kv_first: refuted, docs/perf-notes.md leads 6 g
and 6 k) are in git history. What each variant measured: docs/design.md and docs/perf-notes.md.

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

# A row's amax as the integer maximum of the bits of |x| (order-preserving for every
# non-negative fp32 and NaN above inf), which Triton reduces across a warp with one
# `redux.sync.max.s32` on sm_80 and later instead of five shuffle-and-max rounds.
_INT_AMAX = Edit(QUANTIZE, '''    if out_ptr.dtype.element_ty == tl.int8:
        return tl.maximum(tl.reduce(tl.abs(x_lo), 2, _max_nan)[:, :, None],
                          tl.reduce(tl.abs(x_hi), 2, _max_nan)[:, :, None],
                          propagate_nan=tl.PropagateNan.ALL)
    amax = tl.maximum(_row_max(tl.abs(x_lo)), _row_max(tl.abs(x_hi)))
    return tl.where(amax != amax, 0.0, amax)
''', '''    lo = x_lo.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    hi = x_hi.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    if out_ptr.dtype.element_ty != tl.int8:  # NaN not counted
        lo = tl.where(lo > 0x7F800000, 0, lo)
        hi = tl.where(hi > 0x7F800000, 0, hi)
    return tl.max(tl.maximum(lo, hi), 2)[:, :, None].to(tl.float32, bitcast=True)
''')

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
    "pth_int_amax": ("per-token-head amax as an integer max of |x|'s bits (one warp "
                     "reduction instruction on sm_80+), the same values", [_INT_AMAX]),
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
