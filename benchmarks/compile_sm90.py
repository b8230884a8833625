"""Compile the production kernel for sm_90 (H100/H200) on a machine without a GPU and report
what it became: registers, spills, shared memory, SASS instruction mix, global load/store
widths. Catches Triton frontend errors, register spills and lost vector loads before any
device time is spent (docs/design.md §Load and trig order).

    python benchmarks/compile_sm90.py                          # default rows and features
    python benchmarks/compile_sm90.py --rows 2 --config 2,1,1,1 --dump /tmp/sm90
    python benchmarks/compile_sm90.py --rows 3 --variant no_trig

Each kernel is compiled exactly as a launch on an H200 would compile it: the public call's
arguments (meta tensors: no memory) go through the production ``launcher.launch`` with the
launch itself captured, so the kernel parameters, constexprs and tile come from the production
code (``pick_config`` with ``--sms`` SMs); Triton's own argument binder then specialises them
(ints equal to 1 become constexprs, multiples of 16 get divisibility hints, pointers are taken
as 16-byte aligned, as fresh allocations are) and ``triton.compile`` targets
``GPUTarget("cuda", 90, 32)``. SASS comes from the ``cuobjdump`` Triton ships.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile for real (qkrope would turn the interpreter on)

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import sm_arch_from_capability  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import forced, launch_args, parse_config, parse_rows, row_options  # noqa: E402
from variants import VARIANTS, variant_kernel  # noqa: E402
from qkrope.ops.qknorm_rope import launcher  # noqa: E402
from qkrope.suite import MODELS, ModelGeometry, make_inputs, make_paged_inputs  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # what Triton's driver reports for an H100/H200

#: name -> (Options fields, quantised outputs, head_dim or None): the kernel's constexpr
#: features. Quantised: "fp8" (FP8 caches, per-head scales; "fp8-e5m2" the same in e5m2),
#: "fp8-pth" (FP8 caches with per-token-head scale caches), "fp8-pth-q8" (the same and an FP8
#: query out), "int8-pth" (INT8 per-token-head caches).
FEATURES = {
    "default": ({}, None, None),
    "gptj": ({"rotary_style": "gptj"}, None, None),
    "partial": ({"rotary_dim": 64}, None, None),
    "hf": ({"norm_rounding": "hf"}, None, None),
    "offset": ({"norm_weight_offset": 1.0}, None, None),
    "mrope": ({"mrope_section": (24, 20, 20), "mrope_interleaved": True}, None, None),
    "fp8": ({}, "fp8", None),
    "fp8-e5m2": ({}, "fp8-e5m2", None),
    "fp8-pth": ({}, "fp8-pth", None),
    "fp8-pth-q8": ({}, "fp8-pth-q8", None),
    "int8-pth": ({}, "int8-pth", None),
    "d64": ({}, None, 64),
    "d256": ({}, None, 256),
    "d512": ({}, None, 512),
    # Qwen3.5 / Qwen3-Next full attention: heads of 256, a quarter rotated, (1 + w) weights.
    "qwen35": ({"rotary_dim": 64, "norm_weight_offset": 1.0}, None, 256),
    # rows from a running length the launch advances (HF's StaticLayer), its device assert
    "append": ({"append": True}, None, None),
}


def captured_launch(row, feature: str, config, num_sms: int, kernel):
    """``(grid, args, meta)`` of the production launch of ``row`` with ``feature``."""
    fields, quant, head_dim = FEATURES[feature]
    geometry = MODELS["qwen3-coder-480b"]
    if head_dim is not None:
        geometry = ModelGeometry(f"d{head_dim}", geometry.num_q_heads, geometry.num_kv_heads,
                                 head_dim)
    make = make_paged_inputs if row.paged else make_inputs
    args = list(make(row.workload, geometry, device="meta"))
    opts = row_options(row, **fields)
    if opts.mrope_section is not None:  # three position streams: [3, B, S] / [3, T]
        args[3] = torch.empty(3, *args[3].shape, dtype=args[3].dtype, device="meta")
    if opts.append:  # the running length: one int64
        args[6] = torch.empty((), dtype=torch.int64, device="meta")
    scales, q_out = (None, None, None, None, None), torch.empty_like(args[0])
    if quant is not None:
        dtype = {"int8-pth": torch.int8, "fp8-e5m2": torch.float8_e5m2}.get(
            quant, torch.float8_e4m3fn)
        args[4], args[5] = args[4].to(dtype), args[5].to(dtype)
        Hkv = args[1].shape[1]  # key: [B, Hkv, S, D] or [T, Hkv, D]
        if quant in ("fp8", "fp8-e5m2"):
            scales = (*(torch.empty(Hkv, dtype=torch.float32, device="meta") for _ in "kv"),
                      None, None, None)
        else:
            q_scale = None
            if quant.endswith("q8"):
                q_out = torch.empty_like(args[0], dtype=torch.float8_e4m3fn)
                q_scale = torch.empty(1, dtype=torch.float32, device="meta")
            scales = (None, None, q_scale, *(torch.empty(c.shape[:-1], dtype=torch.float32,
                                                          device="meta") for c in args[4:6]))
    k_out = torch.empty_like(args[1])
    got = []
    with forced(kernel=None, config=config, num_sms=num_sms, capture=got):
        launcher.launch(*launch_args(tuple(args), q_out, k_out, opts, *scales))
    grid, kargs, meta = got[0]
    # Meta tensors have no device to ask: sm_90 converts to FP8 with cvt.rn.satfinite.
    return grid, kargs, dict(meta, SAT_CVT=True)


def compile_launch(kernel, grid, args: dict, meta: dict):
    """Compile ``kernel`` for sm_90 as ``kernel[grid](**args, **meta)`` would on the GPU:
    through ``JITFunction.run``'s own binder and ``_pack_args`` (Triton 3.6 internals; another
    Triton version may move them, which shows as FAILED rows)."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(args, **{"debug": False, "instrumentation_mode": "", **meta})
    bound, specialization, options = binder(**kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound,
                                                              specialization, options)
    src = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=TARGET, options=options.__dict__)


def cubin_sass(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", f.name], capture_output=True,
                             text=True, timeout=120)
    if out.returncode:
        raise RuntimeError(f"cuobjdump -sass failed: {out.stderr.strip()[:500]}")
    return out.stdout


def ptxas_report(ptx: str, ptxas: str) -> dict:
    """Registers, stack and spills from ``ptxas -v`` with the flags Triton compiles with (fp
    fusion off, as the launch asks)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run([ptxas, "-lineinfo", "--fmad=false", "-v",
                              f"--gpu-name={sm_arch_from_capability(TARGET.arch)}", f.name,
                              "-o", os.devnull], capture_output=True, text=True, timeout=300)
    log = out.stderr + out.stdout
    if out.returncode:
        raise RuntimeError(f"{ptxas} failed: {log.strip()[:500]}")

    def number(pattern: str) -> int:
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    return dict(regs=number(r"Used (\d+) registers"), stack=number(r"(\d+) bytes stack frame"),
                spill_st=number(r"(\d+) bytes spill stores"),
                spill_ld=number(r"(\d+) bytes spill loads"))


def stats(compiled, ptxas: str) -> dict:
    """ptxas's resource report and the SASS/PTX instruction counts of a compiled kernel."""
    ptx = compiled.asm["ptx"]
    sass = cubin_sass(compiled.asm["cubin"])
    ops = [op for _, op in re.findall(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass)]
    base = collections.Counter(op.split(".")[0] for op in ops)
    return dict(
        ptxas_report(ptx, ptxas), shared=compiled.metadata.shared, sass=len(ops), base=base,
        bf16=len(re.findall(r"(?:mul|add|sub)\.rn\.bf16", ptx)),
        widths=collections.Counter(re.findall(r"\b(?:ld|st)\.global[.\w]*", ptx)),
        sass_text=sass)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default="1,2,3,13,p1,p3",
                   help="suite numbers 1-13, paged p1-p3, or S:C:B (default: 1,2,3,13,p1,p3)")
    p.add_argument("--features", default="default",
                   help=f"comma-separated, of: {', '.join(FEATURES)}; 'all' for every one "
                        "(default: default)")
    p.add_argument("--config", action="append", type=parse_config, metavar="HQ,HKV,T,WARPS",
                   help="compile this tile instead of pick_config's (repeatable)")
    p.add_argument("--variant", default="production",
                   choices=("production", *VARIANTS),
                   help="a patched kernel (benchmarks/variants.py), e.g. to see what "
                        "the trig costs in instructions")
    p.add_argument("--sms", type=int, default=132,
                   help="SM count pick_config assumes (H200: 132, H100 SXM: 132)")
    p.add_argument("--ptxas", default=knobs.nvidia.ptxas.path,
                   help="ptxas for the register/spill report (default: the one Triton ships and "
                        "compiles with; e.g. /usr/local/bin/ptxas to cross-check)")
    p.add_argument("--dump", metavar="DIR", help="write each kernel's .ttgir, .ptx and .sass")
    p.add_argument("--top", type=int, default=8, help="most frequent SASS opcodes to show")
    args = p.parse_args()
    try:
        rows = parse_rows(args.rows)
    except ValueError as e:
        p.error(str(e))
    features = list(FEATURES) if args.features == "all" else args.features.split(",")
    for f in features:
        if f not in FEATURES:
            p.error(f"unknown feature {f!r}; known: {', '.join(FEATURES)}")
    kernel = variant_kernel(args.variant)
    dump = Path(args.dump) if args.dump else None
    if dump:
        dump.mkdir(parents=True, exist_ok=True)

    print(f"triton {triton.__version__} | target sm_{TARGET.arch} | ptxas {args.ptxas} | "
          f"kernel: {args.variant} | pick_config with {args.sms} SMs")
    print("regs/spills/stack: ptxas -v (stack: libdevice sin/cos range reduction, not spills); "
          "smem: Triton's metadata; SASS: instructions; LDG/STG/BAR/MUFU: SASS counts; bf16 ops: "
          "PTX mul/add/sub.rn.bf16")
    print("| row | feature | tile (HQ,HKV,T,warps) | grid | regs | spill st/ld B | stack B | "
          "smem B | SASS | LDG | STG | BAR | MUFU | bf16 ops | PTX global ld/st | top SASS | s |")
    print("|" + "---|" * 17)
    failed = 0
    for row in rows:
        for feature in features:
            for config in args.config or [None]:
                t0 = time.perf_counter()
                try:
                    grid, kargs, meta = captured_launch(row, feature, config, args.sms, kernel)
                    tile = (meta["BLOCK_HQ"], meta["BLOCK_HKV"], meta["BLOCK_T"],
                            meta["num_warps"])
                    compiled = compile_launch(kernel, grid, kargs, meta)
                    s = stats(compiled, args.ptxas)
                except Exception as e:  # report and go on: one bad variant hides no others
                    failed += 1
                    why = (str(e).splitlines() or [""])[0][:200]
                    print(f"| {row.label} | {feature} | {config and tuple(config)} | FAILED: "
                          f"{type(e).__name__}: {why} |", flush=True)
                    continue
                widths = "; ".join(
                    f"{kind}: " + " ".join(f"{k[len(kind) + 7:] or '.?'}x{n}"
                                           for k, n in sorted(s["widths"].items())
                                           if k.startswith(kind))
                    for kind in ("ld", "st"))
                top = " ".join(f"{op}:{n}" for op, n in s["base"].most_common(args.top))
                b = s["base"]
                print(f"| {row.label} | {feature} | {tile} | {grid} | {s['regs']} | "
                      f"{s['spill_st']}/{s['spill_ld']} | {s['stack']} | {s['shared']} | "
                      f"{s['sass']} | {b['LDG']} | {b['STG']} | {b['BAR']} | {b['MUFU']} | "
                      f"{s['bf16']} | {widths} | {top} | {time.perf_counter() - t0:.1f} |",
                      flush=True)
                if dump:
                    stem = dump / (f"{row.label.replace(':', '-')}_{feature}_{args.variant}_"
                                   + "-".join(map(str, tile)))
                    stem.with_suffix(".ttgir").write_text(compiled.asm["ttgir"])
                    stem.with_suffix(".ptx").write_text(compiled.asm["ptx"])
                    stem.with_suffix(".sass").write_text(s["sass_text"])
    if failed:
        sys.exit(f"{failed} compile(s) failed")


if __name__ == "__main__":
    main()
