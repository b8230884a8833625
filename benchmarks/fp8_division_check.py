"""Exhaustive CPU check of the kernel's static-scale FP8 quotient (``kernel._store_scaled`` on a
GPU; the interpreter keeps ``div_rn``): for every bf16 and fp16 value x (+-inf and NaN
included) and many fp32 scales s (random ones, and every kind of value a scale tensor may hold
unchecked: +-0, negative, +-inf, NaN, subnormal of either sign, huge), is

    m = 2**64 if s is subnormal else 1;  nm = m if s < 0 (its sign bit) else -m  (per head)
    s' = |s| * m;  nr = RN(-1 / s');  nx = x * nm (exact);  q0 = clamp(RN(nx * nr), +-2**17)
    q = RN(q0 + RN(q0 * s'' + nx) * nr)   (FMAs one rounding; s'' = 0 where s' is inf, else s')

stored as the same e4m3 and e5m2 codes as the IEEE quotient RN(x / s) (spec.md R4: saturate to
+-448, nearest even, every NaN one code)? The clamp keeps NaN and lies past every FP8 maximum (an
infinite x or quotient leaves a finite residual); nm and nr carry the negations (Triton's unary
minus is `0 - v`, which gives +0 for +0; the emulation does each operation the kernel does, signed
zeros included). The form with a final select instead of the clamp and the sign fold is in git
(docs/design.md, "FP8 stores"). The FMAs are emulated exactly in float64 (products of two fp32 are
exact there; the sum is split by TwoSum, so a float64 sum that lands on an fp32 midpoint is
resolved by its error term). The reference quotient is float64 division rounded to fp32, which is
the correctly rounded fp32 quotient (53 >= 2 * 24 + 2).

    python benchmarks/fp8_division_check.py                 # 2,000 random scales + edge cases
    python benchmarks/fp8_division_check.py --scales 20000 --seed 3

Exit status 1 when any code differs (the kernel's quotient is then wrong).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

F32, F64 = np.float32, np.float64


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """RN32(a * b + c) with one rounding, for fp32 arrays."""
    p, c64 = a.astype(F64) * b.astype(F64), c.astype(F64)
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)  # p + c = s + err exactly
    out = s.astype(F32)
    up, dn = np.nextafter(out, F32(np.inf)), np.nextafter(out, F32(-np.inf))
    # Rounding s differs from rounding the exact sum only where s is an fp32 midpoint.
    on_up = s == (out.astype(F64) + up.astype(F64)) / 2
    on_dn = s == (out.astype(F64) + dn.astype(F64)) / 2
    out = np.where(on_up & (err > 0), up, out)
    return np.where(on_dn & (err < 0), dn, out)


#: The smallest normal fp32: a scale below it (either sign) is rescaled by 2**64.
TINY = F32(1.1754943508222875e-38)


def _rescale(s: F32) -> F32:
    return F32(2.0**64) if 0 < abs(s) < TINY else F32(1.0)


def kernel_quotient(x: np.ndarray, s: F32) -> np.ndarray:
    m = _rescale(s)
    nm = m if np.signbit(s) else -m
    s = F32(abs(s) * m)
    nr = F32(-1.0 / F64(s))
    nx = (x.astype(F64) * F64(nm)).astype(F32)
    q0 = (nx.astype(F64) * F64(nr)).astype(F32)
    q0 = np.where(np.isnan(q0), q0, np.clip(q0, F32(-2.0**17), F32(2.0**17))).astype(F32)
    e = fma32(q0, np.full_like(x, F32(0.0) if s == np.inf else s), nx)
    return fma32(e, np.full_like(x, nr), q0)


def newton_reciprocal(s: np.ndarray, start: np.ndarray) -> np.ndarray:
    """One Newton step for 1/s from ``start`` with exact FMAs, as the kernel makes a
    per-token-head row's reciprocal (``quantize._token_head_scale``): ``r1 = fma(r0, fma(-s,
    r0, 1), r0)``, ``r0`` where r1 is NaN."""
    r1 = fma32(start, fma32(-s, start, np.ones_like(s)), start)
    with np.errstate(invalid="ignore"):
        return np.where(r1 == r1, r1, start)


#: FP8 dtype -> its largest finite value (the store saturates there).
FP8 = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def fp8_codes(q: np.ndarray, fp8: torch.dtype = torch.float8_e4m3fn) -> np.ndarray:
    """The stored codes of ``q``: saturated, nearest even, every NaN 0x7F (as the kernel's
    ``cvt.rn.satfinite`` and the oracle store it)."""
    t = torch.from_numpy(np.ascontiguousarray(q))
    top = FP8[fp8]
    codes = t.clamp(-top, top).to(fp8).view(torch.uint8).numpy()
    return np.where(np.isnan(q), np.uint8(0x7F), codes)


def every_value(dtype: torch.dtype) -> np.ndarray:
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    x = bits.view(dtype).float().numpy()
    return x[np.isfinite(x)]


#: Besides every finite value: what a row can also hold.
NON_FINITE = np.array([np.inf, -np.inf, np.nan, -np.nan], dtype=F32)


def scales(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    edge = [1.0, 1 / 448, 1 / 64, 7.0, 0.1, 3.0, 1.5, 1e-6, 1e6, 2.0**-20, 2.0**20,
            float(np.nextafter(F32(2), F32(0))), float(np.nextafter(F32(1), F32(2)))]
    mantissas = rng.integers(1 << 23, 1 << 24, n).astype(F64) * 2.0**-23  # every mantissa bit
    # What a scale tensor may hold when nothing checks it (validate off): the oracle's bytes
    # hold there too (tests/test_qknorm_rope.py, the cache bytes for every scale value).
    odd = [0.0, -0.0, -0.025, -1 / 64, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 1.4e-45,
           float(np.nextafter(TINY, F32(0))), 2.0**-126, 3.4e38, 2.0**17, 2.0**40, 1e30]
    return np.concatenate([np.array(edge + odd, F32), (10 ** rng.uniform(-6, 6, n)).astype(F32),
                           (mantissas * 2.0 ** rng.integers(-8, 8, n)).astype(F32)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--scales", type=int, default=2000, help="random scales of each kind")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    ss = scales(args.scales, args.seed)
    worst = 0
    print("| x dtype | values | scales | e4m3 codes differing | e5m2 codes differing | "
          "fp32 quotients differing (2**-12 < |x/s| < 2**16) |")
    print("|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float16):
        x = np.concatenate([every_value(dtype), NON_FINITE])
        codes = {fp8: 0 for fp8 in FP8}
        quotients = 0
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            for s in ss:
                ref = (x.astype(F64) / F64(s)).astype(F32)
                q = kernel_quotient(x, s)
                for fp8 in FP8:
                    codes[fp8] += int((fp8_codes(q, fp8) != fp8_codes(ref, fp8)).sum())
                # (past 2**16 every FP8 store saturates: the kernel clamps there)
                quotients += int(((q != ref) & (np.abs(ref) > 2.0**-12)
                                  & (np.abs(ref) < 2.0**16)).sum())
        worst = max(worst, *codes.values())
        print(f"| {str(dtype).removeprefix('torch.')} | {len(x)} | {len(ss)} | "
              f"{codes[torch.float8_e4m3fn]} | {codes[torch.float8_e5m2]} | {quotients} |")
    return 1 if worst else 0


if __name__ == "__main__":
    sys.exit(main())
