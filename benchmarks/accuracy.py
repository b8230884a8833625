"""How far are the kernel's Q/K outputs from the exact result, and from the reference? The
fused kernel against ``qkrope.reference`` (the same rounding points: differences come only
from the sin/cos and rsqrt implementations) and against the exact fp64 result
(``qk_rotated_fp64``), at positions up to 2**18 (the cache limit), in bf16 and fp16. One line
per case and tensor; errors against the exact result in units of half an ulp of the output
dtype, relative to the magnitude of the products.

    python benchmarks/accuracy.py                 # on a GPU: 1024 tokens per case
    python benchmarks/accuracy.py --tokens 8      # without one: Triton's interpreter (slow)
"""

from __future__ import annotations

import argparse

import torch

import qkrope
from qkrope.ops.qknorm_rope.reference import qk_rotated_fp64
from qkrope.suite import rope_inv_freq


def main() -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024 if dev == "cuda" else 16,
                   help="tokens S per case (default: 1024 on a GPU, 16 in the interpreter)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--max-pos", type=int, nargs="+", default=[4096, 2**18],
                   help="positions are drawn from [max_pos - 4096, max_pos)")
    args = p.parse_args()

    g = torch.Generator(device=dev).manual_seed(0)
    B, Hq, Hkv, S, D, L = args.batch, 96, 8, args.tokens, 128, 64
    print(f"device {dev}{' (Triton interpreter)' if dev == 'cpu' else ''} | B={B} S={S} "
          f"Hq={Hq} Hkv={Hkv} D={D}, random norm weights, theta 1e7")
    print("| case | tensor | max |fused - ref| | bit-identical to ref | "
          "max |fused - exact| / scale | same for ref |")
    print("|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float16):
        def rnd(*shape):
            return torch.randn(*shape, generator=g, device=dev, dtype=dtype)

        u = torch.finfo(dtype).eps / 2
        for max_pos in args.max_pos:
            q, k, v = rnd(B, Hq, S, D), rnd(B, Hkv, S, D), rnd(B, Hkv, S, D)
            pos = torch.randint(max(max_pos - 4096, 0), max_pos, (B, S), generator=g,
                                device=dev)
            rows = torch.arange(S, device=dev) % L
            kc, vc = rnd(B, Hkv, L, D), rnd(B, Hkv, L, D)
            qw, kw = 1 + 0.5 * rnd(D), 1 + 0.5 * rnd(D)
            inv = rope_inv_freq(D, 1e7, dev)
            call = (q, k, v, pos, kc, vc, rows, qw, kw, inv, 1e-6)
            out = qkrope.run(*call, inplace=False)
            ref = qkrope.reference(*call, inplace=False)
            exact = qk_rotated_fp64(q, k, pos, qw, kw, inv, 1e-6)
            for name, o, r, (ex, mag) in (("q", out[0], ref[0], exact[0]),
                                          ("k", out[1], ref[1], exact[1])):
                def rel(t):
                    return ((t.double() - ex).abs() / (mag + ex.abs()) / u).max().item()

                print(f"| {str(dtype)[6:]} pos<{max_pos} | {name} | "
                      f"{(o.float() - r.float()).abs().max().item():.3g} | "
                      f"{(o == r).float().mean().item():.5%} | {rel(o):.2f} u | {rel(r):.2f} u |",
                      flush=True)


if __name__ == "__main__":
    main()
