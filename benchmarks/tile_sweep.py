"""Time tile configurations of the fused kernel with the SPEC §3 protocol (CUPTI, L2 flushed,
median) on chosen suite workloads: the tool behind docs/perf-notes.md's config tables.

    python benchmarks/tile_sweep.py                       # default workloads and candidates
    python benchmarks/tile_sweep.py --workloads 1,3,13 --configs 16,8,1,2 1,1,1,1
"""

import argparse

import torch

from qkrope.bench.timing import L2Flusher, copy_bandwidth, cupti_call_times_us, summarize
from qkrope.ops.qknorm_rope_cache.launcher import TileConfig, launch, pick_config
from qkrope.suite import SUITE, bytes_moved, make_inputs

DEFAULT = ["1,1,1,1", "2,2,1,1", "8,8,1,2", "16,8,1,2", "32,8,1,4", "16,8,2,2"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workloads", default="1,2,3,5,13", help="suite numbers, 1-based")
    p.add_argument("--configs", nargs="+", default=DEFAULT,
                   help="BLOCK_HQ,BLOCK_HKV,BLOCK_S,num_warps[,eviction[,trig]]")
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    bw, flush = copy_bandwidth(), L2Flusher()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    for n in (int(x) for x in args.workloads.split(",")):
        w = SUITE[n - 1]
        a = make_inputs(w, device="cuda")
        q_out, k_out = torch.empty_like(a[0]), torch.empty_like(a[1])
        pos = a[3].expand(w.batch, w.seq_len)
        res = []
        for text in args.configs:
            f = text.split(",")
            cfg = TileConfig(*map(int, f[:4]), *(f[4:5] or [""]), *map(int, f[5:6]))
            times = cupti_call_times_us(
                lambda: launch(*a[:3], pos, *a[4:], q_out, k_out, cfg), flush, iters=args.iters)
            res.append((summarize(times).median, text))
        default = pick_config(w.batch, 96, 8, w.seq_len, 128, False)
        print(f"#{n} {w.name} floor {bytes_moved(w) / bw * 1e6:.2f} µs, default "
              f"{tuple(default)[:4]}: " + "  ".join(f"({c})={t:.2f}" for t, c in sorted(res)))
        del a, q_out, k_out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
