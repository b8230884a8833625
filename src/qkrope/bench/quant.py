"""Quantised modes of ``qkrope bench``: FP8 caches with per-tensor or per-token-head scales,
INT8 caches with per-token-head scales, an FP8 query output (``--kv-dtype``, ``--kv-scales``,
``--q-out``).

Each call gets fresh output buffers (the FP8 query output, the per-token-head scale caches);
the correctness rule (suite.check_outputs) is applied to the dequantised outputs of the
implementation and of the oracle run with the same options (``float(stored) * scale``): both
quantise the same bf16 rows, so they differ only where those rows do, by one FP8 code.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..suite import ModelGeometry, Workload, bytes_moved

__all__ = ["Quant", "add_arguments", "QUANT_IMPLS"]

#: The quantised dtypes by option name (fp8: e4m3, the serving default; fp8-e5m2: vLLM's
#: kv_cache_dtype="fp8_e5m2", per-tensor scales only).
DTYPES = {"fp8": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2, "int8": torch.int8}
#: Per-tensor scale of K, V and Q in these runs (``--scale``): 448 x 1/64 = 7 covers the rotated
#: rows of the random inputs (RMS ~1, weights 1 +- 0.5) and V ~ N(0, 1) but for rare saturated
#: elements. A power of two, as engines' default 1.0; calibrated scales mostly are not.
SCALE = 1.0 / 64
# What the per-token-head scale caches hold before a call: not 0, so the rows an implementation
# must leave alone dequantise to values and corrupting their codes shows (the caches are random
# bytes); runner._rows_kept checks that those entries still hold it.
SCALE_CACHE_FILL = 0.75
#: The implementations that have the quantised modes (the oracles take the same keywords).
QUANT_IMPLS = ("qkrope", "eager", "torch.compile")


@dataclasses.dataclass(frozen=True)
class Quant:
    kv_dtype: str = "bf16"         # "bf16" (the activations' dtype) or a key of DTYPES
    kv_scales: str = "tensor"      # "tensor" (k_scale / v_scale) or "per-token-head"
    q_out: str = "bf16"            # "bf16" (the activations' dtype), "fp8" or "fp8-e5m2"
    scale: float = SCALE           # the static scales' value (k_scale, v_scale, q_scale)

    @classmethod
    def from_args(cls, args) -> Quant:
        """From ``qkrope bench``'s arguments; ValueError for a combination that means nothing."""
        q = cls(args.kv_dtype, args.kv_scales, args.q_out, args.scale)
        if not (math.isfinite(q.scale) and q.scale > 0):
            raise ValueError(f"--scale must be finite and > 0, got {q.scale}")
        if q.kv_scales == "per-token-head" and q.kv_dtype == "bf16":
            raise ValueError("--kv-scales per-token-head needs --kv-dtype fp8 or int8")
        if q.kv_dtype == "fp8-e5m2" and q.kv_scales == "per-token-head":
            raise ValueError("--kv-scales per-token-head needs --kv-dtype fp8 (e4m3) or int8, "
                             "as vLLM's fp8/int8_per_token_head")
        if q.kv_dtype == "int8" and q.kv_scales != "per-token-head":
            raise ValueError("--kv-dtype int8 needs --kv-scales per-token-head (int8 caches "
                             "take per-token-head scales only)")
        return q

    @property
    def active(self) -> bool:
        return self.kv_dtype != "bf16" or self.q_out != "bf16"

    def describe(self) -> str:
        if not self.active:
            return "bf16 caches and outputs"
        kv = (f"{self.kv_dtype.upper()} caches, "
              f"{'per-token-head' if self.per_token_head else 'per-tensor'} scales"
              if self.kv_dtype != "bf16" else "bf16 caches")
        out = f"{kv}, {'bf16' if self.q_out == 'bf16' else self.q_out.upper()} query output"
        static = self.q_out != "bf16" or (self.kv_dtype != "bf16" and not self.per_token_head)
        return out + (f", static scales {self.scale:g}" if static else "")

    @property
    def per_token_head(self) -> bool:
        return self.kv_dtype != "bf16" and self.kv_scales == "per-token-head"

    def prepare(self, args: tuple) -> tuple:
        """The op's eleven arguments with FP8 / INT8 caches where asked (their bytes: the bf16
        rows cast)."""
        if self.kv_dtype == "bf16":
            return args
        dtype = DTYPES[self.kv_dtype]
        return (*args[:4], args[4].to(dtype), args[5].to(dtype), *args[6:])

    def call_kwargs(self, args: tuple) -> dict:
        """Fresh per-call keywords: scales, scale caches (each entry ``SCALE_CACHE_FILL``), an
        FP8 query output buffer."""
        kw = {}
        if self.kv_dtype != "bf16":
            if self.per_token_head:
                f32 = torch.float32
                fill = SCALE_CACHE_FILL
                kw.update(k_scale_cache=args[4].new_full(args[4].shape[:-1], fill, dtype=f32),
                          v_scale_cache=args[5].new_full(args[5].shape[:-1], fill, dtype=f32))
            else:
                kw.update(k_scale=self.scale, v_scale=self.scale)
        if self.q_out != "bf16":
            kw.update(q_scale=self.scale,
                      query_out=torch.empty(args[0].shape, dtype=DTYPES[self.q_out],
                                            device=args[0].device))
        return kw

    def dequantize(self, outputs: tuple, kw: dict) -> tuple:
        """The four outputs as float32, FP8 ones times their scales."""
        q, k, kc, vc = outputs
        if self.q_out != "bf16":
            q = q.float() * self.scale
        if self.kv_dtype != "bf16":
            if self.per_token_head:
                kc = kc.float() * kw["k_scale_cache"][..., None]
                vc = vc.float() * kw["v_scale_cache"][..., None]
            else:
                kc, vc = kc.float() * self.scale, vc.float() * self.scale
        return q, k, kc, vc

    def bytes_moved(self, workload: Workload, geometry: ModelGeometry) -> int:
        """The op's DRAM traffic in this mode (:func:`qkrope.suite.bytes_moved`)."""
        return bytes_moved(workload, geometry, q_out_bytes=1 if self.q_out != "bf16" else None,
                           cache_bytes=1 if self.kv_dtype != "bf16" else None,
                           row_scale_bytes=4 if self.per_token_head else 0)


def add_arguments(parser) -> None:
    """``qkrope bench``'s quantised-mode options (an argument group of ``parser``)."""
    g = parser.add_argument_group(
        "quantised modes", "FP8 caches and query output (qkrope, and the oracles as eager and "
        "torch.compile); correctness on the dequantised outputs against the oracle in the "
        "same mode")
    g.add_argument("--kv-dtype", choices=("bf16", *DTYPES), default="bf16",
                   help="cache dtype: bf16 (the activations', default), fp8 (float8_e4m3fn), "
                        "fp8-e5m2 (float8_e5m2, per-tensor scales), or int8 (with --kv-scales "
                        "per-token-head)")
    g.add_argument("--kv-scales", choices=("tensor", "per-token-head"), default="tensor",
                   help="cache scales: one per tensor (k_scale/v_scale, default) or one per "
                        "written row and head, computed by the op (vLLM's fp8/int8_per_token_head)")
    g.add_argument("--q-out", choices=("bf16", "fp8", "fp8-e5m2"), default="bf16",
                   help="query output dtype: bf16 (default), fp8 (float8_e4m3fn) or fp8-e5m2 "
                        "(float8_e5m2), with q_scale")
    g.add_argument("--scale", type=float, default=SCALE,
                   help=f"the static scales: q_scale, and k_scale / v_scale of per-tensor FP8 "
                        f"caches (default {SCALE:g}, a power of two like engines' default 1.0; "
                        f"0.0166 is one that is not, as calibrated scales mostly are)")
