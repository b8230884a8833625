"""Shared test machinery: case construction with teeth, poisoning, and the checks every kernel
test applies (outputs vs the reference, caches written exactly where they should be and
bit-identical everywhere else)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

import qkrope
from qkrope.ops.qknorm_rope.reference import cos_sin_ref, rms_norm_ref, rope_angles_ref
from qkrope.suite import rope_inv_freq

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"


def division_check():
    """A fresh copy of ``benchmarks/fp8_division_check.py`` (exact-FMA emulations of the
    kernel's divisions): a test may replace its functions to give a check teeth."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "fp8_division_check.py"
    spec = importlib.util.spec_from_file_location("fp8_division_check", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    return check


@dataclass
class Case:
    B: int = 2
    Hq: int = 4
    Hkv: int = 2
    S: int = 7
    D: int = 64
    L: int = 32
    dtype: torch.dtype = torch.bfloat16
    index_dtype: torch.dtype = torch.int64
    start: int = 3                 # first position / cache row
    noncontig: bool = False        # q/k/v as strided views of one packed [B, S, H, D] projection
    expand_pos: bool = True        # position_ids [B, S] view with batch stride 0
    per_batch_pos: bool = False    # distinct positions per batch element
    pad_rows: tuple[int, ...] = () # token indices whose cache row is set to -1 (padding)
    far_rows: tuple[int, ...] = () # token indices whose cache row is set to >= L (skipped)
    max_pos: int | None = None     # draw random positions in [0, max_pos) instead of a range
    theta: float = 1e7
    seed: int = 0


def make_inputs(c: Case, device: str = DEVICE) -> tuple:
    """The eleven op arguments for ``c`` (random data, random norm weights, never zeros)."""
    g = torch.Generator(device=device).manual_seed(c.seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=c.dtype)

    if c.noncontig:
        # Mimic an engine's fused projection: [B, S, Hq + 2 Hkv, D] sliced and transposed.
        packed = randn(c.B, c.S, c.Hq + 2 * c.Hkv, c.D)
        query = packed[:, :, : c.Hq].transpose(1, 2)
        key = packed[:, :, c.Hq : c.Hq + c.Hkv].transpose(1, 2)
        value = packed[:, :, c.Hq + c.Hkv :].transpose(1, 2)
    else:
        query, key, value = randn(c.B, c.Hq, c.S, c.D), randn(c.B, c.Hkv, c.S, c.D), randn(
            c.B, c.Hkv, c.S, c.D)
    key_cache, value_cache = randn(c.B, c.Hkv, c.L, c.D), randn(c.B, c.Hkv, c.L, c.D)

    rows = torch.arange(c.start, c.start + c.S, dtype=torch.int64, device=device)
    if c.max_pos is not None:
        pos = torch.randint(0, c.max_pos, (c.B if c.per_batch_pos else 1, c.S), generator=g,
                            device=device)
    elif c.per_batch_pos:
        pos = rows[None] + 100 * torch.arange(c.B, device=device)[:, None]
    else:
        pos = rows[None]
    position_ids = pos.expand(c.B, c.S) if (c.expand_pos and pos.shape[0] == 1) else pos.repeat(
        c.B // pos.shape[0], 1)
    cache_position = rows.clone()
    for i in c.pad_rows:
        cache_position[i] = -1
    for i in c.far_rows:
        cache_position[i] = c.L + i
    q_w, k_w = 1 + 0.5 * randn(c.D), 1 + 0.5 * randn(c.D)
    inv_freq = rope_inv_freq(c.D, c.theta).to(device)
    return (query, key, value, position_ids.to(device=device, dtype=c.index_dtype),
            key_cache, value_cache, cache_position.to(device=device, dtype=c.index_dtype),
            q_w, k_w, inv_freq, 1e-6)


def poisoned_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"), memory_format=torch.contiguous_format)


def rope_tolerance(x: torch.Tensor, weight: torch.Tensor, position_ids: torch.Tensor,
                   inv_freq: torch.Tensor, eps: float, norm_rounding: str = "weight_fp32"
                   ) -> torch.Tensor:
    """Per-element bound on |fused - reference| for one rotated tensor.

    Both compute the same rounding points; they may differ only in fp32 details (sum order of
    the squares, rsqrt/sin/cos ulps), which can flip a bf16 rounding of a normalized value by one
    unit (relative 2u, u the unit roundoff). Such a flip moves each product by at most 2u of
    itself plus a rounding (u) and the sum by a further rounding: 4u * (|n1 c| + |n2 s|) covers it.
    """
    u = torch.finfo(x.dtype).eps / 2  # unit roundoff
    n = rms_norm_ref(x, weight, eps, norm_rounding).float()
    cos, sin = cos_sin_ref(rope_angles_ref(position_ids.expand(x.shape[0], x.shape[2]),
                                           inv_freq), x.dtype)
    c, s = cos.float()[:, None], sin.float()[:, None]
    n1, n2 = n.chunk(2, dim=-1)
    b1 = (n1 * c).abs() + (n2 * s).abs()
    b2 = (n2 * c).abs() + (n1 * s).abs()
    return 4 * u * torch.cat((b1, b2), dim=-1)


def assert_mostly_identical(out: torch.Tensor, ref: torch.Tensor, name: str,
                            exact_fraction: float = 0.99) -> float:
    """At most a ``1 - exact_fraction`` share of the elements differ from the reference's (the
    callers bound each one), and at least one may: a call of a single 64-wide head would
    otherwise fail on one element an ulp apart (a large angle's cos in the interpreter against
    torch's). Returns the bit-identical fraction."""
    allowed = (1 - exact_fraction) * out.numel()
    if exact_fraction < 1:
        allowed = max(allowed, 1.0)
    same = (out == ref).float().mean().item()
    assert (out != ref).sum().item() <= allowed, f"{name}: only {same:.4%} bit-identical"
    return same


def run_and_check(args: tuple, *, exact_fraction: float = 0.99, use_out: bool = True,
                  norm_rounding: str = "weight_fp32") -> dict:
    """Run the fused op (in place, poisoned outputs) and the reference; assert every contract.

    Returns measured figures (max error, fraction bit-identical) for callers that report them.
    """
    (query, key, value, position_ids, key_cache, value_cache, cache_position,
     q_w, k_w, inv_freq, eps) = args
    kc_in, vc_in = key_cache.clone(), value_cache.clone()
    kwargs = dict(norm_rounding=norm_rounding)
    if use_out:
        kwargs.update(query_out=poisoned_like(query), key_out=poisoned_like(key))
    q_rot, k_rot, kc, vc = qkrope.fused_rope_with_qk_norm_and_kv_cache_update(*args, **kwargs)
    assert kc is key_cache and vc is value_cache, "in-place call must return the given caches"
    if use_out:
        assert q_rot is kwargs["query_out"] and k_rot is kwargs["key_out"]

    # The reference writes its rows into the input copies (only its q and k are compared; the
    # rows it writes are no untouched rows): no third pair of caches, which can be tens of GiB.
    ref_q, ref_k, _, _ = qkrope.reference(
        query, key, value, position_ids, kc_in, vc_in, cache_position,
        q_w, k_w, inv_freq, eps, inplace=True, norm_rounding=norm_rounding)

    figures = {}
    for name, out, ref, x, w in (("query", q_rot, ref_q, query, q_w),
                                 ("key", k_rot, ref_k, key, k_w)):
        assert not torch.isnan(out).any(), f"{name}_rotated has unwritten (NaN-poisoned) elements"
        err = (out.float() - ref.float()).abs()
        bound = rope_tolerance(x, w, position_ids, inv_freq, eps, norm_rounding)
        worst = (err - bound).max().item()
        assert worst <= 0, f"{name}_rotated: error exceeds derived bound by {worst}"
        same = assert_mostly_identical(out, ref, f"{name}_rotated", exact_fraction)
        figures[name] = dict(max_abs_err=err.max().item(), bit_identical=same)

    # Caches: written rows hold exactly the kernel's own key_rotated / the value; every other row
    # is bit-identical to the input.
    L = key_cache.shape[2]
    rows = cache_position.long()
    valid = (rows >= 0) & (rows < L)
    assert torch.equal(kc[:, :, rows[valid]], k_rot[:, :, valid]), "key_cache row != key_rotated"
    assert torch.equal(vc[:, :, rows[valid]], value[:, :, valid]), "value_cache row != value"
    keep = torch.ones(L, dtype=torch.bool, device=kc.device)
    keep[rows[valid]] = False
    # One batch element at a time: a boolean index copies what it selects.
    for b in range(kc.shape[0]):
        assert torch.equal(kc[b][:, keep], kc_in[b][:, keep]), \
            f"key_cache: an untouched row changed (batch {b})"
        assert torch.equal(vc[b][:, keep], vc_in[b][:, keep]), \
            f"value_cache: an untouched row changed (batch {b})"
    return figures
