"""The kernel variants of benchmarks/variants.py (the one variant mechanism of kernel_ab.py,
tile_sweep.py and compile_sm90.py) still apply to the kernel, and the exact candidate among
them (``partial_rotary_freqs``) still matches the reference, so the device steps that measure
them (benchmarks/device_session.sh) never time a stale or wrong tree."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("variants", ROOT / "benchmarks" / "variants.py")
variants = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(variants)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="CPU check; on a GPU the step partial-freqs runs the tests")


def make_trees(dest: Path, *names: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "variants.py"), str(dest),
                           *names], capture_output=True, text=True, timeout=120)


def test_every_variant_applies_to_the_kernel(tmp_path):
    out = make_trees(tmp_path)
    assert out.returncode == 0, out.stderr
    made = sorted(p.parent.name for p in tmp_path.glob("*/src"))
    assert made == sorted(variants.VARIANTS) and "partial_rotary_freqs" in made
    for name in made:  # each differs from src/ where it says
        for edit in variants.VARIANTS[name][1]:
            got = (tmp_path / name / "src" / edit.path).read_text()
            assert got != (ROOT / "src" / edit.path).read_text() and edit.new in got, name


def test_an_unknown_variant_is_refused(tmp_path):
    out = make_trees(tmp_path, "no_such_variant")
    assert out.returncode != 0 and "unknown variant" in out.stderr


def test_partial_rotary_freqs_matches_the_reference(tmp_path):
    """The partial-rotary cases of the op's tests (NeoX 32 of 128, Qwen3.5's 64 of 256 with
    (1 + w) weights, mRoPE), run on the patched tree in the interpreter."""
    assert make_trees(tmp_path, "partial_rotary_freqs").returncode == 0
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "partial_rotary_freqs" / "src"))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         str(ROOT / "tests" / "test_qknorm_rope.py"), "-k",
         "neox_partial or qwen35_gated_partial_offset or partial_neox or mrope_contiguous_partial"],
        capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    tail = out.stdout[-2000:]
    assert out.returncode == 0, tail
    assert "4 passed" in tail, tail
    # the patched package was the one tested
    probe = subprocess.run([sys.executable, "-c", "import qkrope; print(qkrope.__file__)"],
                           capture_output=True, text=True, timeout=120, env=env)
    assert str(tmp_path) in probe.stdout


def test_fma_division_gives_the_ieee_quotients_e4m3_codes():
    """The arithmetic of the ``fma_division`` candidate (its GPU branch: the interpreter keeps
    div_rn) stores the same e4m3 code as torch's ``x / s`` for every bf16 and fp16 ``x`` on a
    few scales (the full check: ``python benchmarks/fp8_division_check.py``), and the check has
    teeth: the quotient without its FMA correction is caught."""
    spec = importlib.util.spec_from_file_location(
        "fp8_division_check", ROOT / "benchmarks" / "fp8_division_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    assert check.main(["--scales", "4"]) == 0
    check.variant_quotient = lambda x, s: (x.astype(check.F64) * check.F64(
        check.F32(1.0 / check.F64(s)))).astype(check.F32)
    assert check.main(["--scales", "40"]) == 1


def test_fp8_store_candidates_import_and_run_in_the_interpreter(tmp_path):
    """``fp8_stores`` (``fma_division`` in kernel.py, ``satfinite_store`` in quantize.py): the
    patched tree must import and give the production bytes in the interpreter, which keeps the
    checked store (their GPU branch is what the device step fp8-stores tests and times)."""
    assert make_trees(tmp_path, "fp8_stores").returncode == 0
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "fp8_stores" / "src"))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         *(str(ROOT / "tests" / f) for f in ("test_fp8_outputs.py", "test_per_token_head.py")),
         "-k", "rotated_rows_quantised and bhsd or zero_nan_inf or int8 and matches"],
        capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    tail = out.stdout[-2000:]
    assert out.returncode == 0 and " passed" in tail and "failed" not in tail, tail
