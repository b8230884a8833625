"""The op's loads and stores, with none of its arithmetic, as a hand-written CUDA streaming
kernel, on every suite row: does a different program than the Triton kernel move the op's
bytes faster than the same-bytes copy? A probe for issue "faster than a copy", not production
code.

The kernel reads every row the op reads (Q, K, V, the token's ``cache_position``) and writes
every row the op writes (Q and K outputs, the K and V cache rows at ``cache_position``), as
bit copies: Q → Q out; K → K out and the K cache row; V → the V cache row. Positions, norm
weights and inverse frequencies (a few hundred bytes) are not read. One row is 16 lanes of
16 bytes; a thread handles ``UNROLL`` rows (1 or 4, both timed; the faster is the skeleton),
issuing all their loads before any store. Rows are ordered as the tensors are laid out
(sequence, head, token), so neighbouring lanes touch neighbouring bytes.

Timed, interleaved, in one process with the L2 flushed before each call (the bench's
protocol): the same-bytes copy (the faster of torch's and a Triton streaming copy), the op
(outputs given), and the two skeletons; each skeleton's outputs are checked bit for bit
against its inputs first. Needs a CUDA GPU; head_dim 128, bf16, the suite's bhsd layout.

    python benchmarks/skeleton_cuda_probe.py [--rows 1,2,...] [--rounds 5] [--iters 40]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qkrope  # noqa: E402
from _common import interleaved_medians  # noqa: E402
from qkrope.bench.timing import L2Flusher, same_bytes_copies  # noqa: E402
from qkrope.suite import SUITE, bytes_moved, make_inputs  # noqa: E402

SOURCE = r"""
__device__ __forceinline__ void ld16(const void* p, unsigned int* r) {
    asm volatile("ld.global.nc.v4.b32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(p));
}
__device__ __forceinline__ void st16(void* p, const unsigned int* r) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

// Strides in bf16 elements (each fits 32 bits; products are taken in 64). Row u < Uq is Q row
// (b, h, s); past it, K/V row (b, hk, s).
template <int UNROLL>
__device__ __forceinline__ void skeleton(
    const unsigned short* q, const unsigned short* k, const unsigned short* v,
    unsigned short* qo, unsigned short* ko, unsigned short* kc, unsigned short* vc,
    const long long* cpos, int S, int Hq, int Hkv, int Uq, int U, int sqb, int sqh, int sqs,
    int skb, int skh, int sks, int svb, int svh, int svs, int sqob, int sqoh, int sqos,
    int skob, int skoh, int skos, int scb, int sch, int scr) {
    int g = blockIdx.x * blockDim.x + threadIdx.x;  // U * 16 < 2**31: the launcher checks
    int chunk = g & 15, nrow = (gridDim.x * blockDim.x) >> 4, row0 = g >> 4;
    unsigned int a[UNROLL][4], b[UNROLL][4];
    const unsigned short* src_a[UNROLL];
    unsigned short* dst_a[UNROLL];
    unsigned short* dst_a2[UNROLL];
    unsigned short* dst_b[UNROLL];
    long long slot[UNROLL];
#pragma unroll
    for (int i = 0; i < UNROLL; ++i) {  // every load first
        int u = row0 + i * nrow;
        dst_a[i] = nullptr;
        if (u >= U) continue;
        if (u < Uq) {
            int s = u % S, t = u / S;
            long long h = t % Hq, bb = t / Hq;
            src_a[i] = q + bb * sqb + h * sqh + (long long)s * sqs + chunk * 8;
            dst_a[i] = qo + bb * sqob + h * sqoh + (long long)s * sqos + chunk * 8;
            dst_a2[i] = nullptr;
            ld16(src_a[i], a[i]);
        } else {
            int w = u - Uq, s = w % S, t = w / S;
            long long h = t % Hkv, bb = t / Hkv;
            src_a[i] = k + bb * skb + h * skh + (long long)s * sks + chunk * 8;
            dst_a[i] = ko + bb * skob + h * skoh + (long long)s * skos + chunk * 8;
            ld16(src_a[i], a[i]);
            ld16(v + bb * svb + h * svh + (long long)s * svs + chunk * 8, b[i]);
            long long r;
            asm volatile("ld.global.nc.b64 %0, [%1];" : "=l"(r) : "l"(cpos + s));
            slot[i] = bb * scb + h * sch + chunk * 8;
            dst_a2[i] = kc + slot[i] + r * scr;
            dst_b[i] = vc + slot[i] + r * scr;
        }
    }
#pragma unroll
    for (int i = 0; i < UNROLL; ++i) {
        if (!dst_a[i]) continue;
        st16(dst_a[i], a[i]);
        if (dst_a2[i]) { st16(dst_a2[i], a[i]); st16(dst_b[i], b[i]); }
    }
}

#define ENTRY(NAME, UNROLL)                                                                   \
extern "C" __global__ void NAME(                                                              \
    const unsigned short* q, const unsigned short* k, const unsigned short* v,                \
    unsigned short* qo, unsigned short* ko, unsigned short* kc, unsigned short* vc,           \
    const long long* cpos, int S, int Hq, int Hkv, int Uq, int U, int sqb, int sqh, int sqs,  \
    int skb, int skh, int sks, int svb, int svh, int svs, int sqob, int sqoh, int sqos,       \
    int skob, int skoh, int skos, int scb, int sch, int scr) {                                \
    skeleton<UNROLL>(q, k, v, qo, ko, kc, vc, cpos, S, Hq, Hkv, Uq, U, sqb, sqh, sqs, skb,    \
                     skh, sks, svb, svh, svs, sqob, sqoh, sqos, skob, skoh, skos, scb, sch,   \
                     scr);                                                                    \
}
ENTRY(skeleton1, 1)
ENTRY(skeleton4, 4)
"""

VARIANTS = {"skeleton1": 1, "skeleton4": 4}
THREADS = 128


def launcher(kernel, unroll: int, args, q_out, k_out):
    """A call of a skeleton kernel on the op's bhsd arguments (as ``make_inputs`` gives them)."""
    q, k, v, _pos, kc, vc, cpos = args[:7]
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    if D != 128 or any(t.stride(-1) != 1 for t in (q, k, v, kc, vc, q_out, k_out)):
        raise ValueError("the probe handles head_dim 128 with contiguous rows")
    Uq, U = B * Hq * S, B * (Hq + Hkv) * S
    threads = math.ceil(U * 16 / unroll)
    grid = (math.ceil(threads / THREADS), 1, 1)
    cpos64 = cpos.to(torch.int64).contiguous()
    ints = [Uq, U, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *q_out.stride()[:3],
            *k_out.stride()[:3], *kc.stride()[:3]]
    if max(ints) >= 2**31 or U * 16 + THREADS * 4 >= 2**31 or vc.stride() != kc.stride():
        raise ValueError("the probe passes 32-bit strides (torch's NVRTC launcher: int -> int)")
    kargs = [q, k, v, q_out, k_out, kc, vc, cpos64, S, Hq, Hkv, *ints]
    return lambda: kernel(grid=grid, block=(THREADS, 1, 1), args=kargs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(str(i + 1) for i in range(len(SUITE))))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=40)
    a = p.parse_args()
    kernels = {n: torch.cuda._compile_kernel(SOURCE, n) for n in VARIANTS}
    flush = L2Flusher()
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | qkrope {qkrope.__version__}"
          f" | {a.rounds} rounds x {a.iters} calls, interleaved; GPU µs (CUPTI, L2 flushed)")
    names = ("copy", "qkrope", *VARIANTS)
    print("| row | tokens | " + " | ".join(f"{n} µs" for n in names)
          + " | skeleton ÷ copy | qkrope ÷ skeleton | skeleton outputs exact |")
    print("|---|---|" + "---|" * (len(names) + 3))
    best = {"copy": [], "qkrope": [], "skeleton": []}
    for r in a.rows.split(","):
        w = SUITE[int(r) - 1]
        args = make_inputs(w, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
        q_out, k_out = torch.empty_like(args[0]), torch.empty_like(args[1])
        calls = {"qkrope": lambda a_=args, q_=q_out, k_=k_out: qkrope.run(*a_, query_out=q_,
                                                                           key_out=k_)}
        calls.update({n: launcher(kernels[n], u, args, q_out, k_out) for n, u in VARIANTS.items()})
        copies = same_bytes_copies(bytes_moved(w))[2]
        rows = args[6].to(torch.int64)
        exact = True
        for n in VARIANTS:  # bit copies: every row written, equal to its source
            for t in (q_out, k_out):
                t.fill_(float("nan"))
            args[4].index_fill_(2, rows, float("nan"))
            args[5].index_fill_(2, rows, float("nan"))
            calls[n]()
            torch.cuda.synchronize()
            exact &= all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in (
                (q_out, args[0]), (k_out, args[1]), (args[4][:, :, rows], args[1]),
                (args[5][:, :, rows], args[2])))
        med = interleaved_medians(calls, copies, flush, a.rounds, a.iters)
        skel = min(med[n] for n in VARIANTS)
        best["copy"].append(med["copy"])
        best["qkrope"].append(med["qkrope"])
        best["skeleton"].append(skel)
        print(f"| {r} | {w.tokens} | " + " | ".join(f"{med[n]:.2f}" for n in names)
              + f" | {skel / med['copy']:.3f} | {med['qkrope'] / skel:.3f} | {exact} |", flush=True)
    geo = {n: math.exp(statistics.fmean(math.log(x) for x in v)) for n, v in best.items()}
    print(f"\ngeomean µs over these rows: copy {geo['copy']:.2f}, qkrope {geo['qkrope']:.2f}, "
          f"skeleton (the faster of the two) {geo['skeleton']:.2f}")


if __name__ == "__main__":
    main()
