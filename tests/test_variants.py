"""The kernel variants of benchmarks/variants.py (the one variant mechanism of kernel_ab.py,
tile_sweep.py and compile_sm90.py) still apply to the kernel, so the device steps that measure
them (benchmarks/device_session.sh) never time a stale tree."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("variants", ROOT / "benchmarks" / "variants.py")
variants = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(variants)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU check of the source")


def make_trees(dest: Path, *names: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "variants.py"), str(dest),
                           *names], capture_output=True, text=True, timeout=120)


def test_every_variant_applies_to_the_kernel(tmp_path):
    out = make_trees(tmp_path)
    assert out.returncode == 0, out.stderr
    made = sorted(p.parent.name for p in tmp_path.glob("*/src"))
    assert made == sorted(variants.VARIANTS) and "skeleton" in made
    for name in made:  # each differs from src/ where it says
        for edit in variants.VARIANTS[name][1]:
            got = (tmp_path / name / "src" / edit.path).read_text()
            assert got != (ROOT / "src" / edit.path).read_text() and edit.new in got, name


def test_an_unknown_variant_is_refused(tmp_path):
    out = make_trees(tmp_path, "no_such_variant")
    assert out.returncode != 0 and "unknown variant" in out.stderr


def test_tile_sweep_checks_a_quantised_mode_after_dequantisation():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tile_sweep.py"), "--check-only",
         "--rows", "1:0:1", "--configs", "pick", "--kv-dtype", "int8", "--kv-scales",
         "per-token-head", "--variants", "production,skeleton"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "INT8 caches, per-token-head scales" in out.stdout
    assert "(pick)=ok" in out.stdout and "(pick/skeleton)=WRONG" in out.stdout, out.stdout
