"""Can a hand-written CUDA kernel reach the decode targets of issue "faster than a copy"
(#1 <= 1.45 µs, #2 <= 1.70 µs)? A probe, not production code.

The Triton kernel's loads-and-stores skeleton already takes 1.44 µs at #1 and the norm and
rotation add ~0.19 µs (docs/perf-notes.md, "Probes: int32 offsets, no trig, the skeleton
again"). This script times, in one process and interleaved, on suite rows #1 and #2 (bhsd,
96/8/128, one new token per sequence):

- ``copy``: the faster of torch's and a Triton streaming copy of the op's bytes (the bench's
  same-bytes copy);
- ``qkrope``: the production op (outputs given);
- ``cuda_skeleton``: one warp per (sequence, head); every row the op reads is loaded and every
  row it writes is stored, the K/V cache row through the loaded ``cache_position`` (no math);
- ``cuda_norm``: the skeleton plus the RMS norm (warp-shuffle sum, rsqrt, weight multiply,
  bf16 rounding) on Q and K;
- ``cuda_full``: the whole op, NeoX rotation with precise ``sincosf`` at the op's rounding
  points (fp fusion off); its match to ``qkrope.reference`` is printed.

Each lane holds dims (2l, 2l+1) and (64+2l, 64+2l+1), so NeoX pairs stay in one lane (no
shuffles but the norm's). Kernels are compiled at run time by NVRTC
(``torch.cuda._compile_kernel``), header-free. Needs a CUDA GPU; head_dim 128, bf16.

    python benchmarks/decode_cuda_probe.py [--rows 1,2] [--rounds 3] [--iters 60]
"""

from __future__ import annotations

import argparse
import statistics

import torch

import qkrope
from qkrope.bench.timing import L2Flusher, cupti_call_times_us, same_bytes_copies
from qkrope.suite import SUITE, bytes_moved, make_inputs

SOURCE = r"""
// bf16 as raw 16-bit patterns: NVRTC without headers.
__device__ __forceinline__ float lo16(unsigned int u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float hi16(unsigned int u) { return __uint_as_float(u & 0xFFFF0000u); }
__device__ __forceinline__ unsigned int bits_rne(float x) {  // fp32 -> bf16 bits, nearest even
    unsigned int u = __float_as_uint(x);
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}
__device__ __forceinline__ float rnd(float x) { return __uint_as_float(bits_rne(x) << 16); }
__device__ __forceinline__ unsigned int pack(float a, float b) {
    return bits_rne(a) | (bits_rne(b) << 16);
}

// MODE 0: loads and stores only; 1: + RMS norm of Q and K; 2: + NeoX rotation (the op).
template <int MODE>
__device__ __forceinline__ void row(const unsigned int* x, unsigned int* out, unsigned int* out2,
                                    const unsigned int* w, float angle_scale_pos,
                                    const float* inv, float eps, int lane) {
    unsigned int a = x[lane], b = x[32 + lane];  // dims 2l, 2l+1 and 64+2l, 64+2l+1
    if (MODE == 0) {
        out[lane] = a; out[32 + lane] = b;
        if (out2) { out2[lane] = a; out2[32 + lane] = b; }
        return;
    }
    unsigned int wa = w[lane], wb = w[32 + lane];
    float x0 = lo16(a), x1 = hi16(a), x2 = lo16(b), x3 = hi16(b);
    float ss = x0 * x0 + x1 * x1 + x2 * x2 + x3 * x3;
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xFFFFFFFFu, ss, o);
    float rstd = rsqrtf(ss * (1.0f / 128.0f) + eps);
    float n0 = rnd(lo16(wa) * (x0 * rstd)), n1 = rnd(hi16(wa) * (x1 * rstd));
    float n2 = rnd(lo16(wb) * (x2 * rstd)), n3 = rnd(hi16(wb) * (x3 * rstd));
    if (MODE == 2) {
        float s0, c0, s1, c1;
        sincosf(angle_scale_pos * inv[2 * lane], &s0, &c0);
        sincosf(angle_scale_pos * inv[2 * lane + 1], &s1, &c1);
        c0 = rnd(c0); s0 = rnd(s0); c1 = rnd(c1); s1 = rnd(s1);
        float r0 = rnd(rnd(n0 * c0) - rnd(n2 * s0)), r2 = rnd(rnd(n2 * c0) + rnd(n0 * s0));
        float r1 = rnd(rnd(n1 * c1) - rnd(n3 * s1)), r3 = rnd(rnd(n3 * c1) + rnd(n1 * s1));
        n0 = r0; n1 = r1; n2 = r2; n3 = r3;
    }
    unsigned int pa = pack(n0, n1), pb = pack(n2, n3);
    out[lane] = pa; out[32 + lane] = pb;
    if (out2) { out2[lane] = pa; out2[32 + lane] = pb; }
}

// Grid (Hq + Hkv, B), one warp. Strides in bf16 elements; head_dim 128, contiguous rows, S = 1.
template <int MODE>
__device__ __forceinline__ void decode(
    const unsigned short* q, const unsigned short* k, const unsigned short* v,
    unsigned short* qo, unsigned short* ko, unsigned short* kc, unsigned short* vc,
    const long long* pos, const long long* cpos, const unsigned short* qw,
    const unsigned short* kw, const float* inv, int Hq, int sqb, int sqh, int skb, int skh,
    int svb, int svh, int sqob, int sqoh, int skob, int skoh, int scb, int sch, int scr,
    int spb, double eps) {
    int lane = threadIdx.x, h = blockIdx.x, bb = blockIdx.y;
    float p = MODE == 2 ? (float)pos[(long long)bb * spb] : 0.0f;
    if (h < Hq) {
        row<MODE>((const unsigned int*)(q + (long long)bb * sqb + (long long)h * sqh),
                  (unsigned int*)(qo + (long long)bb * sqob + (long long)h * sqoh), nullptr,
                  (const unsigned int*)qw, p, inv, (float)eps, lane);
    } else {
        h -= Hq;
        long long slot = cpos[0];
        long long c = (long long)bb * scb + (long long)h * sch + slot * scr;
        const unsigned int* vr = (const unsigned int*)(v + (long long)bb * svb + (long long)h * svh);
        unsigned int va = vr[lane], vb = vr[32 + lane];
        row<MODE>((const unsigned int*)(k + (long long)bb * skb + (long long)h * skh),
                  (unsigned int*)(ko + (long long)bb * skob + (long long)h * skoh),
                  (unsigned int*)(kc + c), (const unsigned int*)kw, p, inv, (float)eps, lane);
        unsigned int* vo = (unsigned int*)(vc + c);
        vo[lane] = va; vo[32 + lane] = vb;
    }
}

#define ENTRY(NAME, MODE)                                                                     \
extern "C" __global__ void NAME(                                                              \
    const unsigned short* q, const unsigned short* k, const unsigned short* v,                \
    unsigned short* qo, unsigned short* ko, unsigned short* kc, unsigned short* vc,           \
    const long long* pos, const long long* cpos, const unsigned short* qw,                    \
    const unsigned short* kw, const float* inv, int Hq, int sqb, int sqh, int skb, int skh,   \
    int svb, int svh, int sqob, int sqoh, int skob, int skoh, int scb, int sch, int scr,      \
    int spb, double eps) {                                                                    \
    decode<MODE>(q, k, v, qo, ko, kc, vc, pos, cpos, qw, kw, inv, Hq, sqb, sqh, skb, skh,     \
                 svb, svh, sqob, sqoh, skob, skoh, scb, sch, scr, spb, eps);                  \
}
ENTRY(cuda_skeleton, 0)
ENTRY(cuda_norm, 1)
ENTRY(cuda_full, 2)
"""

VARIANTS = ("cuda_skeleton", "cuda_norm", "cuda_full")


def compile_variants() -> dict:
    try:  # fp fusion off: an FMA would skip the rounding of a product
        return {n: torch.cuda._compile_kernel(SOURCE, n, nvcc_options=["--fmad=false"])
                for n in VARIANTS}
    except TypeError:  # a torch without nvcc_options: contraction may then differ
        return {n: torch.cuda._compile_kernel(SOURCE, n) for n in VARIANTS}


def launcher(kernel, args, q_out, k_out):
    """A call of ``kernel`` on the op's bhsd arguments (as ``make_inputs`` gives them)."""
    q, k, v, pos, kc, vc, cpos, qw, kw, inv = args[:10]
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    if S != 1 or D != 128 or q.stride(-1) != 1 or kc.stride(-1) != 1 or vc.stride() != kc.stride():
        raise ValueError("the probe handles decode rows (S = 1) of head_dim 128, rows contiguous")
    pos64, cpos64 = pos.to(torch.int64), cpos.to(torch.int64)
    spb = pos64.stride(0) if pos64.shape[0] == B else 0
    kargs = [q, k, v, q_out, k_out, kc, vc, pos64, cpos64, qw, kw, inv, Hq,
             q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
             q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
             kc.stride(0), kc.stride(1), kc.stride(2), spb, float(args[10])]
    return lambda: kernel(grid=(Hq + Hkv, B, 1), block=(32, 1, 1), args=kargs)


def match(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.view(torch.int16) == ref.view(torch.int16)).float().mean().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=60)
    a = p.parse_args()
    kernels = compile_variants()
    flush = L2Flusher()
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | qkrope {qkrope.__version__}"
          f" | {a.rounds} rounds x {a.iters} calls, interleaved; GPU µs (CUPTI, L2 flushed)")
    names = ("copy", "qkrope", *VARIANTS)
    print("| row | " + " | ".join(f"{n} µs" for n in names) + " | cuda_full Q / K / cache match |")
    print("|---|" + "---|" * (len(names) + 1))
    for r in a.rows.split(","):
        w = SUITE[int(r) - 1]
        args = make_inputs(w, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
        args[7].normal_(1.0, 0.3)  # random norm weights (the suite's are ones)
        args[8].normal_(1.0, 0.3)
        q_out, k_out = torch.empty_like(args[0]), torch.empty_like(args[1])
        calls = {"qkrope": lambda: qkrope.run(*args, query_out=q_out, key_out=k_out)}
        calls.update({n: launcher(kernels[n], args, q_out, k_out) for n in VARIANTS})
        src_dst_copies = same_bytes_copies(bytes_moved(w))[2]
        # Correctness of the full CUDA version against the reference (fresh caches).
        ref = qkrope.reference(*[x.clone() if isinstance(x, torch.Tensor) else x for x in args])
        slot = int(args[6][0])
        calls["cuda_full"]()
        torch.cuda.synchronize()
        m = (match(q_out, ref[0]), match(k_out, ref[1]),
             (match(args[4][:, :, slot], ref[2][:, :, slot])
              + match(args[5][:, :, slot], ref[3][:, :, slot])) / 2)
        times = {n: [] for n in names}
        for _ in range(a.rounds):
            times["copy"].append(min(statistics.median(cupti_call_times_us(c, flush, iters=a.iters))
                                     for c in src_dst_copies.values()))
            for n in names[1:]:
                times[n].append(statistics.median(cupti_call_times_us(calls[n], flush,
                                                                      iters=a.iters)))
        med = {n: statistics.median(t) for n, t in times.items()}
        print(f"| {r} | " + " | ".join(f"{med[n]:.2f}" for n in names)
              + f" | {m[0]:.4f} / {m[1]:.4f} / {m[2]:.4f} |", flush=True)


if __name__ == "__main__":
    main()
