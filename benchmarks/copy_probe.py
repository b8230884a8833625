"""Which plain copy is the fair "same bytes" yardstick? torch's ``copy_`` per element type
against Triton streaming copies of several block sizes, at suite sizes, timed with the SPEC §3
protocol (docs/perf-notes.md, run 8; the winner's rule is in qkrope.bench.timing).

    python benchmarks/copy_probe.py
    python benchmarks/copy_probe.py --rows 1,2,13
"""

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import require_cuda  # noqa: E402
from qkrope.bench.timing import (  # noqa: E402
    L2Flusher, cupti_call_times_us, qkrope_copy_kernel, summarize,
)
from qkrope.suite import SUITE, bytes_moved  # noqa: E402

TRITON_TILES = ((1024, 4), (2048, 4), (4096, 8), (512, 2))  # (bf16 per program, warps)


def median_us(fn, flush) -> float:
    return summarize(cupti_call_times_us(fn, flush, iters=40)).median


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default="1,3,4,5,8,10,12,13", help="suite numbers 1-13")
    args = p.parse_args()
    try:
        rows = [int(n) for n in args.rows.split(",")]
        if not all(1 <= n <= len(SUITE) for n in rows):
            raise ValueError
    except ValueError:
        p.error(f"--rows wants suite numbers 1-{len(SUITE)}, got {args.rows!r}")
    require_cuda("copy_probe.py")
    flush = L2Flusher()
    head = ["#", "MB moved", "torch u8", "torch i32", "torch i64", "torch bf16"]
    head += [f"triton {b}/{w}w" for b, w in TRITON_TILES]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for n in rows:
        half = bytes_moved(SUITE[n - 1]) // 2
        half -= half % 8192  # whole Triton blocks for every tile below: no ragged tail
        raw = torch.randint(0, 100, (max(half, 8192),), dtype=torch.uint8, device="cuda")
        row = []
        for dt in (torch.uint8, torch.int32, torch.int64, torch.bfloat16):
            src = raw.view(dt)
            dst = torch.empty_like(src)
            row.append(median_us(lambda: dst.copy_(src), flush))
        src = raw.view(torch.bfloat16)
        dst = torch.empty_like(src)
        for block, warps in TRITON_TILES:
            grid = (triton.cdiv(src.numel(), block),)
            row.append(median_us(lambda: qkrope_copy_kernel[grid](
                src, dst, src.numel(), BLOCK=block, num_warps=warps), flush))
        print(f"| {n} | {2 * raw.numel() / 1e6:.2f} | " + " | ".join(f"{x:.2f}" for x in row)
              + " |", flush=True)


if __name__ == "__main__":
    main()
