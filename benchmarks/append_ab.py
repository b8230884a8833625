"""Kernel time of ``append=True`` calls against the same calls with their rows given
(docs/design.md, "Appending at a running length"): one atomic per K/V program instead of a load
of its rows. Alternating blocks of CUDA-event-timed calls, medians per block, ratio per shape.

    python benchmarks/append_ab.py [--shapes B:S,...] [--blocks 15] [--calls 200]

Qwen3-8B heads (32 query, 8 key/value, D 128), bf16, caches of 2**18 rows: every call appends
S rows, so a shape's calls fit the cache (--blocks x --calls x S < 2**18 after resets).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import qkrope


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shapes", default="1:1,8:1,64:1,1:128,4:512,1:2048")
    p.add_argument("--blocks", type=int, default=15)
    p.add_argument("--calls", type=int, default=200)
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("append_ab.py: needs CUDA")
    Hq, Hkv, D, L = 32, 8, 128, 2**18
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}")
    print("| B:S | rows given µs | append µs | append ÷ rows |\n|---|---|---|---|")
    for shape in a.shapes.split(","):
        B, S = (int(x) for x in shape.split(":"))
        g = torch.Generator(device="cuda").manual_seed(0)

        def randn(*s):
            return torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)

        q, k, v = randn(B, Hq, S, D), randn(B, Hkv, S, D), randn(B, Hkv, S, D)
        kc, vc = randn(B, Hkv, L, D), randn(B, Hkv, L, D)
        qw, kw = 1 + 0.5 * randn(D), 1 + 0.5 * randn(D)
        inv = 1.0 / 1e6 ** (torch.arange(0, D, 2, device="cuda").float() / D)
        pos = torch.arange(S, device="cuda")[None].expand(B, S)
        rows = torch.arange(S, device="cuda")
        length = torch.zeros((), dtype=torch.int64, device="cuda")
        qo, ko = torch.empty_like(q), torch.empty_like(k)
        # The same rows every call: the length is reset before each block.
        calls = {
            "rows": lambda: qkrope.fused_rope_with_qk_norm_and_kv_cache_update(
                q, k, v, pos, kc, vc, rows, qw, kw, inv, 1e-6, query_out=qo, key_out=ko),
            "append": lambda: qkrope.fused_rope_with_qk_norm_and_kv_cache_update(
                q, k, v, pos, kc, vc, length, qw, kw, inv, 1e-6, query_out=qo, key_out=ko,
                append=True)}
        per_block = min(a.calls, (L // S) - 1)
        medians = {name: [] for name in calls}
        for block in range(a.blocks + 1):  # the first block warms up
            for name, fn in calls.items():
                length.zero_()
                starts = [torch.cuda.Event(enable_timing=True) for _ in range(per_block)]
                ends = [torch.cuda.Event(enable_timing=True) for _ in range(per_block)]
                for i in range(per_block):
                    starts[i].record()
                    fn()
                    ends[i].record()
                torch.cuda.synchronize()
                if block:
                    medians[name].append(statistics.median(
                        s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)))
        assert int(length) == per_block * S, "append: the length must advance by S a call"
        r, ap = statistics.median(medians["rows"]), statistics.median(medians["append"])
        print(f"| {B}:{S} | {r:.2f} | {ap:.2f} | {ap / r:.3f} |")


if __name__ == "__main__":
    main()
