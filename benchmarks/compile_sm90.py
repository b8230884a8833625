"""Compile the fused kernel for sm_90 on a machine without a GPU and report what it became:
PTX op counts, load/store widths and SASS instruction mix per tile shape. Catches Triton
frontend errors and register spills before spending device time.

    TRITON_INTERPRET=0 python benchmarks/compile_sm90.py
"""

import collections
import os
import re
import subprocess
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # compile for real even without a GPU

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from qkrope.ops.qknorm_rope_cache.kernel import qknorm_rope_cache_kernel as fn  # noqa: E402
from qkrope.ops.qknorm_rope_paged.kernel import qknorm_rope_paged_kernel  # noqa: E402

POINTER_TYPES = {"pos_ptr": "*i64", "cache_pos_ptr": "*i64", "inv_freq_ptr": "*fp32"}
UNIT_STRIDES = ("stride_q_w", "stride_k_w", "stride_inv_freq", "stride_cache_pos", "stride_pos_s")


def compile_tile(block_hq, block_hkv, block_s, num_warps, hf_norm=False):
    """Compile as Triton would at launch for contiguous bf16 inputs, expanded positions."""
    const = {"HALF": 64, "BLOCK_HQ": block_hq, "BLOCK_HKV": block_hkv, "BLOCK_S": block_s,
             "INTERPRETER": False, "EVICTION": "", "HF_NORM": hf_norm, "TRIG": 0}
    sig = {}
    for n in fn.arg_names:
        if n.endswith("_d") or n in UNIT_STRIDES:
            const[n] = 1  # Triton specialises arguments equal to 1
        elif n == "stride_pos_b":
            const[n] = 0
        if n in const:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            sig[n] = POINTER_TYPES.get(n, "*bf16")
        elif n == "eps":
            sig[n] = "fp32"
        else:
            sig[n] = "i64" if n.startswith(("stride_kc", "stride_vc")) else "i32"
    # Pointers and (multiple-of-16) strides get the divisibility hint Triton gives them.
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names
             if sig[n].startswith("*") or (n.startswith("stride") and sig[n] != "constexpr")}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "enable_fp_fusion": False})


def compile_paged(D, rot, gptj, fp8, per_head, block_h, num_warps, hf_norm=False):
    """The paged kernel as Triton would compile it for contiguous bf16 rows, int64 indices."""
    pk = qknorm_rope_paged_kernel
    const = dict(D=D, ROT=rot, GPTJ=gptj, HF_NORM=hf_norm, W_OFFSET=0.0, BLOCK_H=block_h, BLOCK_T=1,
                 K_SCALED=fp8, V_SCALED=fp8, PER_HEAD_SCALE=per_head, INTERPRETER=False)
    ptr_types = {"pos_ptr": "*i64", "slot_ptr": "*i64", "inv_freq_ptr": "*fp32",
                 "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    sig = {}
    for n in pk.arg_names:
        if n.endswith("_d") or n in ("stride_pos", "stride_slot", "stride_q_w", "stride_k_w",
                                     "stride_inv_freq"):
            const[n] = 1
        if n in const:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            sig[n] = ptr_types.get(n, "*fp8e4nv" if fp8 and "cache" in n else "*bf16")
        elif n == "eps":
            sig[n] = "fp32"
        else:
            sig[n] = "i64" if n.startswith(("stride_kc", "stride_vc")) else "i32"
    attrs = {(pk.arg_names.index(n),): [["tt.divisibility", 16]] for n in pk.arg_names
             if sig[n].startswith("*") or (n.startswith("stride") and sig[n] != "constexpr")}
    src = ASTSource(pk, sig, constexprs={(pk.arg_names.index(k),): v for k, v in const.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "enable_fp_fusion": False})


def sass_mix(kernel) -> collections.Counter:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(@!?P\d\s+)?([A-Z0-9]+)", out)
    return collections.Counter(op for _, op in ops)


if __name__ == "__main__":
    for tile in [(1, 1, 1, 1), (2, 2, 1, 1), (16, 8, 1, 2), (32, 8, 1, 4), (16, 8, 2, 2)]:
        k = compile_tile(*tile)
        ptx = k.asm["ptx"]
        widths = collections.Counter(re.findall(r"(?:ld|st)\.global[.\w]*", ptx))
        mix = sass_mix(k)
        bf16_ops = len(re.findall(r"(?:mul|add|sub)\.rn\.bf16", ptx))
        print(f"{tile}: SASS {sum(mix.values())} instr, spills {mix['STL']} STL; "
              f"bf16 ops {bf16_ops}; "
              f"global ld/st {dict(widths)}; top {mix.most_common(6)}")
    print("paged kernel (D, rotary_dim, gptj, fp8, per-head scale, heads/program, warps):")
    for variant in [(128, 128, False, False, False, 16, 2), (128, 64, True, False, False, 16, 2),
                    (256, 256, False, True, True, 8, 2), (512, 512, False, False, False, 4, 4)]:
        k = compile_paged(*variant)
        widths = collections.Counter(re.findall(r"(?:ld|st)\.global[.\w]*", k.asm["ptx"]))
        mix = sass_mix(k)
        print(f"  {variant}: SASS {sum(mix.values())} instr, spills {mix['STL']} STL; "
              f"global ld/st {dict(widths)}")
