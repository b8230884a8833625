"""Head-to-head (issue 13): qkrope's paged op against FlashInfer 0.7.4's
``cake_fused_qk_rmsnorm_rope_append_paged_kv_cache``, the other CUDA op that fuses QK RMSNorm +
RoPE + paged K/V append, on Qwen3-32B's geometry (64 query heads, 8 KV heads, head_dim 128),
which is one of the two head configurations FlashInfer ships.

    bash benchmarks/flashinfer_carry.sh                  # here: builds .fi/ (git-ignored)
    python3 benchmarks/flashinfer_h2h.py --json OUT.json # on the H200, .fi carried (~3 min)

The device call carries ``.fi`` and runs, from the repository root:

    export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/.fi/site; set -o pipefail;
    timeout 470 python3 benchmarks/flashinfer_h2h.py --json $OUT/fi_h2h.json 2>&1
      | tee $OUT/fi_h2h.md

One set of random tensors per case feeds both ops: the packed bf16 QKV [T, (64 + 2*8) * 128],
bf16 norm weights ``1 + 0.5 randn`` (FlashInfer takes f32: the same values, upcast), an NHD
cache of 16-token pages, and a page table from which qkrope's ``slot_mapping`` is derived
(FlashInfer derives each row's position from ``seq_lens``/``q_indptr`` and its slot from the page
table). FlashInfer reads cos/sin from an f32 ``[max_position, 128]`` table; to give both ops the
same values, the table holds qkrope's rounded cos/sin (R2 of reference.py: fp32 angle, cos/sin
rounded to bf16), upcast. Both are checked against ``qkrope.reference_paged`` (max abs error and
bit-identical share of Q out and of the written K/V cache rows; every other cache row must stay
untouched) and against the exact fp64 result; FlashInfer is also compared with an emulation of
its documented math (norm and rotation in f32, one rounding), which tells its rounding apart
from a misuse of its arguments.

Timing is qkrope's protocol (qkrope.bench.timing: CUPTI kernel time, L2 flushed before every
call, warm-ups, medians), the two ops interleaved in rounds. FlashInfer runs with
``clear_unused_last_page_rows=False`` (the same work as qkrope); its default (True, zeroing the
rest of every request's last page) is timed as an extra column. qkrope also writes the rotated
K to a separate output (T * 8 * 128 * 2 bytes), which FlashInfer does not.

Exit status 2, with the evidence printed (and in the JSON), when FlashInfer cannot be imported
or its kernel neither loads prebuilt nor JIT-compiles.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FI_SITE = ROOT / ".fi" / "site"
FI_COMPAT = ROOT / ".fi" / "compat"
if str(ROOT / "src") not in sys.path:  # this tree's qkrope, installed or not
    sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

import qkrope  # noqa: E402
from qkrope.ops.qknorm_rope.reference import (  # noqa: E402
    cos_sin_ref, qk_rotated_fp64, rope_angles_ref,
)
from qkrope.suite import rope_inv_freq  # noqa: E402

# Qwen3-32B attention geometry (config.json: 64 heads, 8 KV heads, head_dim 128, theta 1e6).
HQ, HKV, D = 64, 8, 128
ROPE_THETA, EPS = 1e6, 1e-6
PAGE_SIZE = 16
MAX_DECODE_POSITION = 32768  # decode rows sit at random positions below this (as PAGED_SUITE)
DEFAULT_CASES = "d1,d8,d64,d256,p512,p2048,p4096"


@dataclass(frozen=True)
class Case:
    """``d<B>``: B sequences decoding one token each; ``p<S>``: one sequence prefilling S tokens
    from position 0."""

    name: str
    num_seqs: int
    tokens_per_seq: int

    @property
    def tokens(self) -> int:
        return self.num_seqs * self.tokens_per_seq

    @classmethod
    def parse(cls, spec: str) -> "Case":
        kind, n = spec[:1], spec[1:]
        if kind not in ("d", "p") or not n.isdigit() or int(n) < 1:
            raise ValueError(f"case {spec!r}: expected d<sequences> or p<tokens>, e.g. d64, p2048")
        return cls(spec, int(n), 1) if kind == "d" else cls(spec, 1, int(n))


# ----------------------------------------------------------------------------- inputs


def build_case(case: Case, device, generator: torch.Generator, *, hq: int = HQ, hkv: int = HKV,
               d: int = D, page_size: int = PAGE_SIZE, theta: float = ROPE_THETA) -> dict:
    """Every tensor both ops (and the reference) take for ``case``, from one random draw.

    Caches are the initial state; each op gets its own clones (:func:`fresh_caches`)."""

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=generator, device=device, dtype=dtype)

    def randint(high, shape):
        return torch.randint(0, high, shape, generator=generator, device=device)

    B, S, T = case.num_seqs, case.tokens_per_seq, case.tokens
    if S == 1:
        last_pos = randint(MAX_DECODE_POSITION, (B,))
    else:
        last_pos = torch.full((B,), S - 1, device=device, dtype=torch.int64)
    seq_lens = last_pos + 1
    # Row r of request b sits at position r + seq_lens[b] - q_indptr[b + 1] (FlashInfer's rule).
    q_indptr = torch.arange(0, T + 1, S, device=device, dtype=torch.int64)
    req = torch.arange(B, device=device).repeat_interleave(S)
    positions = torch.arange(T, device=device) + (seq_lens - q_indptr[1:])[req]
    max_pages = int(-(-int(seq_lens.max()) // page_size))
    pages_used = -(-seq_lens // page_size)
    # Distinct physical pages for every page a request writes to, shuffled so that paging is real;
    # the other table entries (never read) point at random pages.
    if S == 1:
        num_pages = max(64, 4 * B)
        page_indices = randint(num_pages, (B, max_pages))
        page_indices[torch.arange(B, device=device), pages_used - 1] = torch.randperm(
            num_pages, generator=generator, device=device)[:B]
    else:  # one sequence (Case.parse): its pages, scattered over twice as many
        num_pages = 2 * max_pages
        page_indices = torch.randperm(num_pages, generator=generator, device=device)[
            :max_pages].view(1, max_pages)
    page = page_indices[req, positions // page_size]
    slots = page * page_size + positions % page_size
    qkv = randn(T, (hq + 2 * hkv) * d)
    key_cache = randn(num_pages, page_size, hkv, d)
    value_cache = randn(num_pages, page_size, hkv, d)
    q_w, k_w = 1 + 0.5 * randn(d), 1 + 0.5 * randn(d)
    inv_freq = rope_inv_freq(d, theta, device=device)
    # One table row per position up to the largest used: [cos | sin] of R2, rounded to bf16 as
    # qkrope (and the reference) round them, then upcast for FlashInfer's f32 table.
    angles = rope_angles_ref(torch.arange(int(seq_lens.max()), device=device), inv_freq)
    cos, sin = cos_sin_ref(angles, torch.bfloat16)
    cos_sin = torch.cat((cos.float(), sin.float()), dim=-1).contiguous()
    cos_sin_f32 = torch.cat((angles.cos(), angles.sin()), dim=-1).contiguous()
    return dict(
        qkv=qkv, positions=positions, slots=slots, key_cache=key_cache, value_cache=value_cache,
        q_w=q_w, k_w=k_w, inv_freq=inv_freq, eps=EPS, hq=hq, hkv=hkv, d=d,
        # FlashInfer's f32 weights, converted once (a cast per call would be a timed kernel).
        q_w32=q_w.float(), k_w32=k_w.float(),
        cos_sin=cos_sin, cos_sin_f32=cos_sin_f32, seq_lens=seq_lens.to(torch.int32),
        q_indptr=q_indptr.to(torch.int32), page_indices=page_indices.to(torch.int32).contiguous(),
    )


def fresh_caches(inp: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return inp["key_cache"].clone(), inp["value_cache"].clone()


def qkrope_call(inp: dict, key_cache, value_cache):
    """qkrope on the packed projection: returns ``(q_out [T, Hq, D], k_out)``; caches in place."""
    return qkrope.fused_qkv_norm_rope_paged(
        inp["qkv"], inp["hq"], inp["hkv"], inp["positions"], key_cache, value_cache,
        inp["slots"], inp["q_w"], inp["k_w"], inp["inv_freq"], inp["eps"])


def flashinfer_call(op, inp: dict, key_cache, value_cache, *, out_q=None, clear: bool = False,
                    cos_sin: torch.Tensor | None = None):
    """FlashInfer's op (``qk_norm_policy=2``: RMSNorm, then RoPE, as Qwen3) on the same inputs;
    returns ``out_q [T, Hq, D]``; caches written in place."""
    return op(
        inp["qkv"], inp["cos_sin"] if cos_sin is None else cos_sin, inp["seq_lens"],
        inp["q_indptr"], inp["page_indices"], key_cache, value_cache,
        num_q_heads=inp["hq"], num_kv_heads=inp["hkv"], qk_norm_policy=2,
        q_norm_weight=inp["q_w32"], k_norm_weight=inp["k_w32"], eps=inp["eps"],
        out_q=out_q, clear_unused_last_page_rows=clear)


def split(inp: dict):
    return qkrope.split_packed_qkv(inp["qkv"], inp["hq"], inp["hkv"], inp["d"])


def reference(inp: dict):
    """``qkrope.reference_paged`` on fresh caches: ``(q_rot, k_rot, key_cache, value_cache)``."""
    q, k, v = split(inp)
    return qkrope.reference_paged(q, k, v, inp["positions"], inp["key_cache"], inp["value_cache"],
                                  inp["slots"], inp["q_w"], inp["k_w"], inp["inv_freq"],
                                  inp["eps"])


def flashinfer_emulation(inp: dict, cos_sin: torch.Tensor | None = None):
    """FlashInfer's documented math in torch: f32 RMSNorm with f32 weights, NeoX rotation by the
    table's f32 cos/sin, one rounding to bf16; K/V to the page-table slot. Returns
    ``(q_out, key_cache, value_cache)`` (fresh caches)."""
    q, k, v = split(inp)
    table = inp["cos_sin"] if cos_sin is None else cos_sin
    cos, sin = table[inp["positions"]].chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]

    def one(x, w):
        xf = x.float()
        n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + inp["eps"]) * w.float()
        n1, n2 = n.chunk(2, dim=-1)
        return torch.cat((n1 * cos - n2 * sin, n2 * cos + n1 * sin), dim=-1).to(x.dtype)

    kc, vc = fresh_caches(inp)
    kc.view(-1, inp["hkv"], inp["d"])[inp["slots"]] = one(k, inp["k_w"])
    vc.view(-1, inp["hkv"], inp["d"])[inp["slots"]] = v
    return one(q, inp["q_w"]), kc, vc


# ----------------------------------------------------------------------------- comparison


def diff(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Max abs error (fp32) and the share of bit-identical elements."""
    if out.shape != ref.shape:
        raise ValueError(f"shape {list(out.shape)} != reference {list(ref.shape)}")
    same = out.contiguous().view(torch.int16) == ref.contiguous().view(torch.int16)
    err = (out.float() - ref.float()).abs()
    return {"max_abs": float(err.max()) if err.numel() else 0.0,
            "identical_pct": 100.0 * float(same.float().mean()) if same.numel() else 100.0,
            "finite": bool(torch.isfinite(out.float()).all())}


def cache_diff(cache: torch.Tensor, ref_cache: torch.Tensor, slots: torch.Tensor) -> dict:
    """:func:`diff` of the written rows, plus whether every other row is bit-identical to the
    reference's (i.e. untouched)."""
    rows = cache.view(-1, *cache.shape[2:])
    ref_rows = ref_cache.view(-1, *ref_cache.shape[2:])
    out = diff(rows[slots], ref_rows[slots])
    others = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
    others[slots] = False
    same = (rows.view(rows.shape[0], -1).view(torch.int16)
            == ref_rows.view(rows.shape[0], -1).view(torch.int16)).all(dim=1)
    out["others_untouched"] = bool(same[others].all())
    return out


def exact_q_error(inp: dict, q_out: torch.Tensor) -> float:
    """Max |q_out - exact| of Q against the fp64 result (norm, trig and rotation in fp64, the
    fp32 angle of R2 kept), T tokens as a batch of T one-token sequences."""
    q, k, _ = split(inp)
    (exact, _), _ = qk_rotated_fp64(q.unsqueeze(2), k.unsqueeze(2), inp["positions"][:, None],
                                    inp["q_w"], inp["k_w"], inp["inv_freq"], inp["eps"])
    return float((q_out.unsqueeze(2).double() - exact).abs().max())


def check_case(inp: dict, fi_op) -> dict:
    """Both ops once on fresh caches, compared with the reference (and fp64, and FlashInfer's
    emulation). ``fi_op`` None: qkrope only."""
    slots = inp["slots"]
    ref_q, ref_k, ref_kc, ref_vc = reference(inp)
    kc, vc = fresh_caches(inp)
    q_out, k_out = qkrope_call(inp, kc, vc)
    res = {"qkrope": {"q": diff(q_out, ref_q), "k_out": diff(k_out, ref_k),
                      "k_cache": cache_diff(kc, ref_kc, slots),
                      "v_cache": cache_diff(vc, ref_vc, slots),
                      "q_exact_max_abs": exact_q_error(inp, q_out)},
           "reference": {"q_exact_max_abs": exact_q_error(inp, ref_q)}}
    if fi_op is None:
        return res
    kc, vc = fresh_caches(inp)
    fq = flashinfer_call(fi_op, inp, kc, vc)
    em_q, em_kc, em_vc = flashinfer_emulation(inp)
    res["flashinfer"] = {"q": diff(fq, ref_q), "k_cache": cache_diff(kc, ref_kc, slots),
                         "v_cache": cache_diff(vc, ref_vc, slots),
                         "q_exact_max_abs": exact_q_error(inp, fq),
                         "q_vs_emulation": diff(fq, em_q),
                         "k_cache_vs_emulation": cache_diff(kc, em_kc, slots),
                         "v_cache_vs_emulation": cache_diff(vc, em_vc, slots)}
    # FlashInfer's natural input, an exact f32 table (not rounded to bf16): accuracy only.
    kc, vc = fresh_caches(inp)
    fq32 = flashinfer_call(fi_op, inp, kc, vc, cos_sin=inp["cos_sin_f32"])
    res["flashinfer_f32_table"] = {"q": diff(fq32, ref_q),
                                   "k_cache": cache_diff(kc, ref_kc, slots),
                                   "q_exact_max_abs": exact_q_error(inp, fq32)}
    return res


# ----------------------------------------------------------------------------- FlashInfer


class FlashInferUnavailable(RuntimeError):
    """FlashInfer's op could not be imported, loaded or compiled; ``evidence`` says why."""

    def __init__(self, message: str, evidence: dict):
        super().__init__(message)
        self.evidence = evidence


def _cmd(args: list[str]) -> str:
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=60)
        return (r.stdout + r.stderr).strip()
    except Exception as e:  # the evidence itself must not fail
        return f"<{type(e).__name__}: {e}>"


def environment_evidence() -> dict:
    """What explains an import or build failure: the carried tree, the toolchain, the libraries."""
    backend = FI_SITE / "flashinfer" / "cake_fused_qk_rope_append_backend"
    ev = {
        "fi_site": str(FI_SITE), "fi_site_exists": FI_SITE.is_dir(),
        "fi_files": sorted(str(p.relative_to(FI_SITE)) for p in (FI_SITE / "flashinfer").rglob("*")
                           if p.is_file() and "csrc" not in p.parts) if FI_SITE.is_dir() else [],
        "backend_csrc_files": len(list((backend / "csrc").glob("*"))) if backend.is_dir() else 0,
        "aot": sorted(p.name for p in (backend / "aot").glob("*")) if backend.is_dir() else [],
        "python": sys.version, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "typing_extensions": getattr(sys.modules.get("typing_extensions"), "__file__", None),
        "CUDA_HOME": os.environ.get("CUDA_HOME"), "which_nvcc": shutil.which("nvcc"),
        "which_ninja": shutil.which("ninja"), "nvcc_version": _cmd(["nvcc", "--version"]),
        "ldconfig_cudart": "\n".join(line for line in _cmd(["ldconfig", "-p"]).splitlines()
                                     if "libcudart" in line or "libcuda.so" in line),
    }
    if torch.cuda.is_available():
        ev["gpu"] = torch.cuda.get_device_name()
        ev["capability"] = torch.cuda.get_device_capability()
    return ev


def _ensure_cuda_home() -> None:
    """FlashInfer guesses CUDA_HOME from ``which nvcc``; a wrapper script outside the toolkit
    (e.g. /usr/local/bin/nvcc) would give a directory without CUDA headers."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    for cand in ("/usr/local/cuda",):
        if Path(cand, "include", "cuda_runtime.h").is_file():
            os.environ["CUDA_HOME"] = cand
            return


def _ensure_libcuda_linkable(workdir: Path) -> None:
    """build.json links ``-lcuda`` although the libraries use no driver symbol; where the toolkit
    has no stubs/libcuda.so and no libcuda.so is on the linker path, link against a stub."""
    cuda_home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    if (cuda_home / "lib64" / "stubs" / "libcuda.so").exists() or "libcuda.so " in _cmd(
            ["ldconfig", "-p"]):
        return
    stub = workdir / "libcuda-stub"
    stub.mkdir(parents=True, exist_ok=True)
    src = stub / "stub.c"
    src.write_text("void qkrope_libcuda_stub(void) {}\n")
    subprocess.run(["cc", "-shared", "-fPIC", str(src), "-Wl,-soname,libcuda.so.1", "-o",
                    str(stub / "libcuda.so")], check=True, capture_output=True, text=True)
    os.environ["FLASHINFER_EXTRA_LDFLAGS"] = (
        os.environ.get("FLASHINFER_EXTRA_LDFLAGS", "") + f" -L{stub}").strip()


def _cudart_loaded() -> bool:
    with contextlib.suppress(OSError):
        return "libcudart.so" in Path("/proc/self/maps").read_text()
    return False


def _preload_cudart() -> str | None:
    """The libraries need libcudart.so.13, which torch's CUDA wheels load from their own folder
    (not on the loader path); make sure one is loaded process-wide. Returns what was loaded."""
    import ctypes

    torch.cuda.init()
    if _cudart_loaded():
        return None
    cands = []
    with contextlib.suppress(Exception):
        import nvidia

        for base in nvidia.__path__:
            cands += sorted(Path(base).glob("*/lib/libcudart.so.*"))
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    cands += sorted(Path(cuda_home, "lib64").glob("libcudart.so.*"))
    for c in cands:
        with contextlib.suppress(OSError):
            ctypes.CDLL(str(c), mode=ctypes.RTLD_GLOBAL)
            return str(c)
    return None


def import_flashinfer():
    """``(op, modules)``: the public entry point and its backend modules, from the carried tree
    (.fi/site, put first on sys.path only now) or an installed FlashInfer."""
    if FI_SITE.is_dir() and str(FI_SITE) not in sys.path:
        sys.path.insert(0, str(FI_SITE))
    import typing_extensions

    if not hasattr(typing_extensions, "get_annotations") and FI_COMPAT.is_dir():
        # tvm-ffi needs typing-extensions >= 4.13; torch already holds the older module, so the
        # carried one replaces it in sys.modules (it is a superset).
        sys.path.insert(0, str(FI_COMPAT))
        del sys.modules["typing_extensions"]
        import typing_extensions  # noqa: F401,F811
    if not (hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
            or hasattr(torch.Tensor, "__c_dlpack_exchange_api__")):
        # tvm-ffi would otherwise compile a torch extension at import (minutes); the plain
        # __dlpack__ route costs host time only, which the GPU timing does not count.
        os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
    with warnings.catch_warnings():
        # @flashinfer_api tries to attach tracing helpers (flashinfer.fi_trace), not carried.
        warnings.filterwarnings("ignore", message=r".*fi_trace.*")
        import flashinfer
        from flashinfer.cake_fused_qk_rope_append import (
            cake_fused_qk_rmsnorm_rope_append_paged_kv_cache as op,
        )
        from flashinfer.cake_fused_qk_rope_append_backend import cake_build, cake_jit
    return op, {"flashinfer": flashinfer, "cake_build": cake_build, "cake_jit": cake_jit}


def needed_libraries(mods: dict, cases: list[Case], device_index: int) -> dict[str, str]:
    """``{library: stage}`` that FlashInfer's stage policy picks for ``cases`` on this GPU."""
    cj = mods["cake_jit"]
    arch, sms = cj.device_arch(device_index), cj.sm_count(device_index)
    out = {}
    for c in cases:
        stage = cj.stage_for(HQ, HKV, arch=arch, num_rows=c.tokens, num_requests=c.num_seqs,
                             page_size=PAGE_SIZE, num_sms=sms, qk_norm_policy=2)
        out[cj.library_name(stage, arch)] = stage
    return out


def use_jit(mods: dict) -> None:
    """Route library loads through FlashInfer's JIT (same build.json sources and flags) instead
    of the prebuilt aot/ files."""
    cb, cj = mods["cake_build"], mods["cake_jit"]
    cb.load_library = lambda name: cb.jit_spec(name).build_and_load()
    cj.load.cache_clear()


def jit_build(mods: dict, libraries: list[str]) -> float:
    """Compile ``libraries`` in one parallel ninja run; returns the seconds it took."""
    _ensure_cuda_home()
    _ensure_libcuda_linkable(Path(os.environ["FLASHINFER_WORKSPACE_BASE"]))
    from flashinfer.jit.core import build_jit_specs

    cb = mods["cake_build"]
    t0 = time.perf_counter()
    build_jit_specs([cb.jit_spec(n) for n in libraries], verbose=False)
    return time.perf_counter() - t0


def load_flashinfer(cases: list[Case], force_jit: bool) -> tuple:
    """Import the op and load (or JIT-compile) the libraries ``cases`` need.

    Returns ``(op, info)``; raises :class:`FlashInferUnavailable` with the evidence."""
    info: dict = {}
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/qkrope-fi-jit")
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    os.environ.setdefault("TVM_FFI_CACHE_DIR", "/tmp/qkrope-tvm-ffi")
    t0 = time.perf_counter()
    try:
        op, mods = import_flashinfer()
    except Exception as e:
        raise FlashInferUnavailable(f"import failed: {e!r}", {
            "traceback": traceback.format_exc(), **environment_evidence()}) from e
    import tvm_ffi

    info["import_s"] = time.perf_counter() - t0
    info["flashinfer_version"] = mods["flashinfer"].__version__
    info["tvm_ffi_version"] = getattr(tvm_ffi, "__version__", "?")
    info["torch_dlpack_c_exchange_api"] = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
    info["TVM_FFI_DISABLE_TORCH_C_DLPACK"] = os.environ.get("TVM_FFI_DISABLE_TORCH_C_DLPACK")
    info["cudart_preloaded"] = _preload_cudart()
    dev = torch.cuda.current_device()
    try:
        libs = needed_libraries(mods, cases, dev)
    except Exception as e:
        raise FlashInferUnavailable(f"no FlashInfer build for this GPU: {e!r}", {
            "traceback": traceback.format_exc(), **environment_evidence()}) from e
    info["libraries"] = libs
    cj = mods["cake_jit"]
    arch = cj.device_arch(dev)
    info["route"] = "prebuilt"
    if not force_jit:
        t0 = time.perf_counter()
        try:
            for stage in libs.values():
                cj.load(stage, arch)
            info["load_s"] = time.perf_counter() - t0
            return op, info
        except Exception:
            info["prebuilt_error"] = traceback.format_exc()
            print("prebuilt FlashInfer libraries did not load; JIT-compiling instead:\n"
                  + info["prebuilt_error"], flush=True)
    info["route"] = "jit"
    use_jit(mods)
    try:
        info["compile_s"] = jit_build(mods, list(libs))
        t0 = time.perf_counter()
        for stage in libs.values():
            cj.load(stage, arch)
        info["load_s"] = time.perf_counter() - t0
    except Exception as e:
        raise FlashInferUnavailable(f"JIT build failed: {e!r}", {
            "traceback": traceback.format_exc(), **info, **environment_evidence()}) from e
    return op, info


# ----------------------------------------------------------------------------- timing


def time_case(inp: dict, fi_op, *, rounds: int, iters: int, warmup: int, clear_col: bool,
              flusher) -> dict:
    """GPU µs per call (SPEC §3) of each op, interleaved: every round times each op once
    (``iters`` calls after ``warmup``), the order alternating between rounds."""
    from qkrope.bench.timing import cupti_call_times_us, summarize

    kq, vq = fresh_caches(inp)
    kf, vf = fresh_caches(inp)
    kfc, vfc = fresh_caches(inp)
    out_q = torch.empty(inp["qkv"].shape[0], inp["hq"], inp["d"], dtype=torch.bfloat16,
                        device=inp["qkv"].device)
    fns = {"qkrope": lambda: qkrope_call(inp, kq, vq)}
    if fi_op is not None:
        fns["flashinfer"] = lambda: flashinfer_call(fi_op, inp, kf, vf, out_q=out_q)
        if clear_col:
            fns["flashinfer_clear"] = lambda: flashinfer_call(fi_op, inp, kfc, vfc, out_q=out_q,
                                                              clear=True)
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name] += cupti_call_times_us(fns[name], flusher, iters=iters, warmup=warmup)
    return {k: summarize(v).as_dict() for k, v in times.items()}


def host_case(inp: dict, fi_op, calls: int) -> dict:
    """Wall-clock µs per back-to-back eager call (what the host pays per launch), FlashInfer
    beside qkrope in alternating batches."""
    from qkrope.bench.timing import host_times_beside_us

    kq, vq = fresh_caches(inp)
    kf, vf = fresh_caches(inp)
    out_q = torch.empty(inp["qkv"].shape[0], inp["hq"], inp["d"], dtype=torch.bfloat16,
                        device=inp["qkv"].device)
    fi_us, q_us, ratio = host_times_beside_us(
        lambda: flashinfer_call(fi_op, inp, kf, vf, out_q=out_q),
        lambda: qkrope_call(inp, kq, vq), calls=calls, batches=10)
    return {"qkrope_us": q_us, "flashinfer_us": fi_us, "ratio": ratio}


# ----------------------------------------------------------------------------- report


def _acc(res: dict, impl: str) -> str:
    if impl not in res:
        return "—"
    r = res[impl]
    return (f"{r['q']['max_abs']:.3g} / {r['q']['identical_pct']:.2f}% / "
            f"{r['k_cache']['max_abs']:.3g} / {r['k_cache']['identical_pct']:.2f}% / "
            f"{r['v_cache']['identical_pct']:.2f}%")


def markdown(rows: list[dict], fi_info: dict | None) -> str:
    lines = [
        "| case | T | qkrope µs | FlashInfer µs | FI / qkrope | FI clear=True µs | "
        "qkrope vs ref: Q max / Q ident / K max / K ident / V ident | "
        "FlashInfer vs ref: Q max / Q ident / K max / K ident / V ident |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in rows:
        t = row.get("timing", {})
        q = t.get("qkrope", {}).get("median_us")
        f = t.get("flashinfer", {}).get("median_us")
        fc = t.get("flashinfer_clear", {}).get("median_us")
        fmt = (lambda x: f"{x:.2f}" if x is not None else "—")  # noqa: E731
        lines.append(f"| {row['case']} | {row['tokens']} | {fmt(q)} | {fmt(f)} | "
                     f"{fmt(f / q) if q and f else '—'} | {fmt(fc)} | "
                     f"{_acc(row['check'], 'qkrope')} | {_acc(row['check'], 'flashinfer')} |")
    lines.append("")
    lines.append("| case | \\|Q − fp64\\| max: reference / qkrope / FI / FI f32 table | "
                 "FI vs its f32 emulation: Q max / Q ident | other cache rows untouched "
                 "(qkrope, FI) | FI f32-table vs ref: Q max / Q ident |")
    lines.append("|---|---|---|---|---|")
    for row in rows:
        c = row["check"]
        fi = c.get("flashinfer")
        f32 = c.get("flashinfer_f32_table")
        ex = [c["reference"]["q_exact_max_abs"], c["qkrope"]["q_exact_max_abs"]]
        ex += [fi["q_exact_max_abs"], f32["q_exact_max_abs"]] if fi else []
        untouched = [c["qkrope"]["k_cache"]["others_untouched"]
                     and c["qkrope"]["v_cache"]["others_untouched"]]
        if fi:
            untouched.append(fi["k_cache"]["others_untouched"]
                             and fi["v_cache"]["others_untouched"])
        lines.append(
            f"| {row['case']} | {' / '.join(f'{x:.3g}' for x in ex)} | "
            + (f"{fi['q_vs_emulation']['max_abs']:.3g} / "
               f"{fi['q_vs_emulation']['identical_pct']:.2f}%" if fi else "—")
            + f" | {', '.join(map(str, untouched))} | "
            + (f"{f32['q']['max_abs']:.3g} / {f32['q']['identical_pct']:.2f}%" if f32 else "—")
            + " |")
    if any("host" in r for r in rows):
        lines += ["", "| case | host µs/call qkrope | FlashInfer | FI / qkrope |",
                  "|---|---:|---:|---:|"]
        for r in rows:
            if "host" in r:
                h = r["host"]
                lines.append(f"| {r['case']} | {h['qkrope_us']:.2f} | {h['flashinfer_us']:.2f} | "
                             f"{h['ratio']:.2f} |")
    if fi_info:
        stages = sorted(set(fi_info["libraries"].values()))
        lines += ["", f"FlashInfer {fi_info.get('flashinfer_version')} via "
                      f"{fi_info.get('route')} libraries, stages {stages}"]
    return "\n".join(lines)


def run_cases(cases: list[Case], fi_op, *, device, seed: int, timing, host, deadline: float
              ) -> list[dict]:
    """Check and time every case (``timing(inp)`` / ``host(inp)``, the latter on decode cases
    only and when given), each from its own seeded draw; cases not started by ``deadline``
    (a ``time.perf_counter()`` value) are skipped."""
    rows = []
    for case in cases:
        if time.perf_counter() > deadline:
            print(f"deadline reached: skipping {case.name} and later cases", flush=True)
            break
        g = torch.Generator(device=device).manual_seed(seed)
        inp = build_case(case, device, g)
        row = {"case": case.name, "tokens": case.tokens, "num_seqs": case.num_seqs,
               "check": check_case(inp, fi_op), "timing": timing(inp)}
        if host is not None and case.tokens_per_seq == 1:
            row["host"] = host(inp)
        t = row["timing"]
        print(f"{case.name}: qkrope {t['qkrope']['median_us']:.2f} µs, FlashInfer "
              f"{t['flashinfer']['median_us']:.2f} µs", flush=True)
        rows.append(row)
        del inp
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def result_payload(rows: list[dict], env: dict, fi_info: dict, protocol: dict) -> dict:
    return {"status": "ok", "env": env, "flashinfer": fi_info,
            "geometry": {"hq": HQ, "hkv": HKV, "d": D, "rope_theta": ROPE_THETA, "eps": EPS,
                         "page_size": PAGE_SIZE},
            "protocol": protocol, "cases": [asdict(Case.parse(r["case"])) | r for r in rows]}


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=1, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=DEFAULT_CASES,
                    help=f"comma-separated d<sequences> / p<tokens> (default {DEFAULT_CASES})")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--no-clear-column", action="store_true",
                    help="skip timing FlashInfer's default clear_unused_last_page_rows=True")
    ap.add_argument("--host-calls", type=int, default=1000,
                    help="eager calls per op for host µs on decode cases (0: skip)")
    ap.add_argument("--force-jit", action="store_true",
                    help="JIT-compile FlashInfer's libraries even if prebuilt ones are carried")
    ap.add_argument("--deadline-s", type=float, default=420.0,
                    help="stop timing further cases after this many seconds (results so far "
                         "are still printed and saved)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--qkrope-bench", nargs=argparse.REMAINDER, metavar="BENCH_ARGS",
                    help="instead: load the carried FlashInfer as above (libraries for --cases), "
                         "then run `qkrope bench BENCH_ARGS` in this process (e.g. --layout paged "
                         "--model qwen3-32b --impl qkrope,flashinfer)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    cases = [Case.parse(s) for s in args.cases.split(",") if s]
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (FlashInfer's op is SM90/SM100 only)", file=sys.stderr)
        return 1
    if args.qkrope_bench is not None:
        try:
            load_flashinfer(cases, args.force_jit)
        except FlashInferUnavailable as e:
            print(f"FLASHINFER UNAVAILABLE: {e}", flush=True)
            return 2
        from qkrope.cli import main as qkrope_main

        return qkrope_main(["bench", *args.qkrope_bench])
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "qkrope": qkrope.__file__, "python": platform.python_version()}
    print(f"# qkrope vs FlashInfer on {env['gpu']}, Qwen3-32B heads {HQ}/{HKV}/{D}, "
          f"pages of {PAGE_SIZE}", flush=True)
    try:
        fi_op, fi_info = load_flashinfer(cases, args.force_jit)
    except FlashInferUnavailable as e:
        print(f"FLASHINFER UNAVAILABLE: {e}", flush=True)
        for k, v in e.evidence.items():
            print(f"--- {k}:\n{v}" if isinstance(v, str) and "\n" in v else f"--- {k}: {v}")
        write_json(args.json, {"status": "flashinfer_unavailable", "error": str(e),
                               "evidence": e.evidence, "env": env})
        return 2
    print(f"FlashInfer {fi_info['flashinfer_version']} (tvm-ffi {fi_info['tvm_ffi_version']}): "
          f"import {fi_info['import_s']:.1f} s, route {fi_info['route']}, "
          + (f"JIT compile {fi_info['compile_s']:.1f} s, " if "compile_s" in fi_info else "")
          + f"load {fi_info['load_s']:.2f} s", flush=True)
    from qkrope.bench.timing import L2Flusher
    from qkrope.ops import _native

    t0 = time.perf_counter()
    if _native.enabled():
        with contextlib.suppress(Exception):
            _native.load(120)  # host µs only; GPU time does not depend on it
    env["qkrope_native"] = _native.status()
    env["qkrope_native_build_s"] = time.perf_counter() - t0
    print(f"qkrope launch route: {env['qkrope_native']} "
          f"(helper ready in {env['qkrope_native_build_s']:.1f} s)", flush=True)
    flusher = L2Flusher()

    def timing(inp):
        return time_case(inp, fi_op, rounds=args.rounds, iters=args.iters, warmup=args.warmup,
                         clear_col=not args.no_clear_column, flusher=flusher)

    host = (lambda inp: host_case(inp, fi_op, args.host_calls)) if args.host_calls else None
    rows = run_cases(cases, fi_op, device="cuda", seed=args.seed, timing=timing, host=host,
                     deadline=start + args.deadline_s)
    print()
    print(markdown(rows, fi_info))
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    write_json(args.json, result_payload(rows, env, fi_info, {
        "rounds": args.rounds, "iters": args.iters, "warmup": args.warmup,
        "timing": "qkrope.bench.timing.cupti_call_times_us, L2 flushed before every call"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
