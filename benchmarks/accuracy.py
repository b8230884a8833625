"""Accuracy report: the fused kernel against qkrope.reference and against the exact fp64
result, at positions up to 2**18 (the cache limit). Prints one line per case.

    python benchmarks/accuracy.py            # on a GPU (or slowly, through the interpreter)
"""

import torch

import qkrope
from qkrope.ops.qknorm_rope_cache.reference import qk_rotated_fp64
from qkrope.suite import rope_inv_freq

dev = "cuda" if torch.cuda.is_available() else "cpu"
g = torch.Generator(device=dev).manual_seed(0)
print("case | tensor | max |fused-ref| | bit-identical to ref | max |fused-exact| / scale | "
      "same for ref")
for dtype in (torch.bfloat16, torch.float16):
    for max_pos in (4096, 2**18):
        B, Hq, Hkv, S, D, L = 2, 96, 8, 1024 if dev == "cuda" else 16, 128, 64
        rnd = lambda *s: torch.randn(*s, generator=g, device=dev, dtype=dtype)  # noqa: E731
        q, k, v = rnd(B, Hq, S, D), rnd(B, Hkv, S, D), rnd(B, Hkv, S, D)
        pos = torch.randint(max_pos - 4096, max_pos, (B, S), generator=g, device=dev)
        rows = torch.arange(S, device=dev) % L
        kc, vc = rnd(B, Hkv, L, D), rnd(B, Hkv, L, D)
        qw, kw = 1 + 0.5 * rnd(D), 1 + 0.5 * rnd(D)
        inv = rope_inv_freq(D, 1e7, dev)
        args = (q, k, v, pos, kc, vc, rows[:S], qw, kw, inv, 1e-6)
        out = qkrope.run(*args, inplace=False)
        ref = qkrope.reference(*args, inplace=False)
        exact = qk_rotated_fp64(q, k, pos, qw, kw, inv, 1e-6)
        for name, o, r, (ex, mag) in (("q", out[0], ref[0], exact[0]), ("k", out[1], ref[1], exact[1])):
            u = torch.finfo(dtype).eps / 2
            rel = lambda t: ((t.double() - ex).abs() / (mag + ex.abs()) / u).max().item()  # noqa: E731
            print(f"{str(dtype)[6:]} pos<{max_pos} | {name} | {(o.float() - r.float()).abs().max().item():.3g} | "
                  f"{(o == r).float().mean().item():.5%} | {rel(o):.2f} u | {rel(r):.2f} u")
