"""Implementations the benchmark compares, each behind the op's eleven-argument convention.

Every entry writes the new rows into the given caches in place (what engines and competitive
entries do) and returns the four outputs. Peers that are not installed are reported
as skipped with the reason, never as errors.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import flashinfer
from ..ops.qknorm_rope import fused_qk_norm_rope_paged, fused_rope_with_qk_norm_and_kv_cache_update
from ..ops.qknorm_rope.reference import qknorm_rope_cache_ref, qknorm_rope_paged_ref
from ..suite import make_inputs, make_paged_inputs

__all__ = ["Impl", "IMPLS", "PAGED_IMPLS", "ALL_IMPLS", "Layout", "LAYOUTS", "resolve_impls",
           "default_impls", "impl_layouts", "peer_unavailable", "fresh_arguments",
           "WRITTEN_ARGUMENTS"]

OpFn = Callable[..., tuple]


@dataclass(frozen=True)
class Impl:
    name: str
    description: str
    build: Callable[[], OpFn]     # returns the callable; raises ImportError when unavailable
    # Why it cannot run on this machine (cheap: no import of the peer), or None when it can.
    unavailable: Callable[[], str | None] = lambda: None
    # Takes the op's keywords (partial rotary, (1 + w) norms) that some geometries need.
    takes_options: bool = True
    # In the list a run compares when none is named (a peer for one geometry only is not).
    default: bool = True
    # Why a run of another layout cannot have it (None: "no <layout> adapter").
    elsewhere: str | None = None
    # Outputs it returns as None (suite.OUTPUT_NAMES; checked through the caches instead).
    omits: tuple[str, ...] = ()


def _eager_reference() -> OpFn:
    # Rows of the suite are always in range: one index_copy_ per cache, no host sync.
    return functools.partial(qknorm_rope_cache_ref, skip_out_of_range=False, inplace=True)


def _compile(fn: OpFn) -> OpFn:
    """``torch.compile(fn, dynamic=False)``: one specialised graph per shape, as a serving engine
    would warm up, with Dynamo's recompile limits raised for the many shapes of a run."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    return torch.compile(fn, dynamic=False)


def _compiled_reference() -> OpFn:
    return _compile(_eager_reference())


def _liger_unavailable() -> str | None:
    return None if importlib.util.find_spec("liger_kernel") else "liger-kernel is not installed"


def _liger() -> OpFn:
    """Liger-Kernel's RMSNorm and RoPE kernels composed with two ``index_copy_`` cache writes."""
    if (why := _liger_unavailable()) is not None:
        raise ImportError(why)
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction

    def run(query, key, value, position_ids, key_cache, value_cache, cache_position,
            q_norm_weight, k_norm_weight, inv_freq, rms_norm_eps):
        B, _, S, D = query.shape
        q = LigerRMSNormFunction.apply(query.reshape(-1, D), q_norm_weight, rms_norm_eps, 0.0,
                                       "llama", False).view(query.shape)
        k = LigerRMSNormFunction.apply(key.reshape(-1, D), k_norm_weight, rms_norm_eps, 0.0,
                                       "llama", False).view(key.shape)
        freqs = position_ids.expand(B, S).float()[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        q, k = LigerRopeFunction.apply(q, k, emb.cos().to(query.dtype), emb.sin().to(query.dtype))
        key_cache.index_copy_(2, cache_position, k)
        value_cache.index_copy_(2, cache_position, value)
        return q, k, key_cache, value_cache

    return run


IMPLS: dict[str, Impl] = {
    i.name: i
    for i in (
        Impl("qkrope", "qkrope fused kernel (one launch, in place)",
             lambda: fused_rope_with_qk_norm_and_kv_cache_update),
        Impl("torch.compile", "torch.compile(reference, dynamic=False), in place",
             _compiled_reference),
        Impl("eager", "eager PyTorch reference, in place", _eager_reference),
        Impl("liger", "Liger-Kernel RMSNorm + RoPE + index_copy_", _liger, _liger_unavailable,
             takes_options=False),
    )
}


def _paged_outputs(op: OpFn) -> OpFn:
    """The paged op with the caches appended to its outputs, as the checks compare four."""

    def run(*args, **options):
        return (*op(*args, **options), args[4], args[5])

    return run


def _paged_unfused() -> OpFn:
    """The unfused serving sequence: RMSNorm, RoPE and the cache write as separate eager ops
    (slots of the benchmark are all valid: no filtering, no host sync)."""
    return functools.partial(qknorm_rope_paged_ref, skip_out_of_range=False, inplace=True)


def _paged_compiled() -> OpFn:
    return _compile(_paged_unfused())


PAGED_IMPLS: dict[str, Impl] = {
    i.name: i
    for i in (
        Impl("qkrope", "qkrope paged kernel (one launch)",
             lambda: _paged_outputs(fused_qk_norm_rope_paged)),
        Impl("torch.compile", "torch.compile of the unfused serving sequence", _paged_compiled),
        Impl("eager", "unfused serving sequence: RMSNorm, RoPE, cache index_put (eager)",
             _paged_unfused),
        Impl("flashinfer", "FlashInfer's fused QK RMSNorm + RoPE + paged K/V append (64/8 or "
             "8/1 heads of 128; rotated K checked through the cache)", flashinfer.build,
             flashinfer.unavailable, takes_options=False, default=False,
             omits=("key_rotated",),
             elsewhere="FlashInfer's fused op is token-major with a paged cache: --layout paged "
                       "(its heads: --model qwen3-32b)"),
    )
}

#: Every implementation by name, whichever layouts have it: the names ``--impl`` takes and
#: ``--list`` shows (a peer of one layout only is named in the other with the reason).
ALL_IMPLS: dict[str, Impl] = {**IMPLS, **{n: i for n, i in PAGED_IMPLS.items() if n not in IMPLS}}


@dataclass(frozen=True)
class Layout:
    """What a benchmark layout needs: its inputs, its oracle (fresh caches) and its peers."""

    name: str
    make_inputs: Callable[..., tuple]
    reference: Callable[..., tuple]     # (args, **op options) -> outputs, fresh caches
    impls: dict[str, Impl]


def fresh_arguments(args: tuple) -> tuple:
    """Copies of the op's tensor arguments: each implementation gets its own (one that writes
    an input in place, or the caches, leaves the next one's intact). Each is the same view
    (sizes, strides, offset: expanded positions stay expanded) of a copy of its storage."""
    def copy(a):
        return torch.empty(0, dtype=a.dtype, device=a.device).set_(
            a.untyped_storage().clone(), a.storage_offset(), a.shape, a.stride())

    return tuple(copy(a) if isinstance(a, torch.Tensor) else a for a in args)


#: The op's arguments an implementation may write: the two caches (either layout).
WRITTEN_ARGUMENTS = (4, 5)


def _paged_reference(args: tuple, **options) -> tuple:
    return qknorm_rope_paged_ref(*args, **options)  # fresh caches


LAYOUTS: dict[str, Layout] = {
    "bhsd": Layout("bhsd", make_inputs, lambda a, **o: qknorm_rope_cache_ref(*a, **o),  # fresh
                   IMPLS),
    "paged": Layout("paged", make_paged_inputs, _paged_reference, PAGED_IMPLS),
}


def default_impls(layout: str = "bhsd", timed: bool = True) -> list[str]:
    """The implementations a run compares when none are named: every one of the layout that can
    run here; without CUDA only qkrope (the others are only worth running to be timed)."""
    if not timed:
        return ["qkrope"]
    return [n for n, impl in LAYOUTS[layout].impls.items()
            if impl.default and impl.unavailable() is None]


def _known(name: str) -> None:
    if name not in ALL_IMPLS:
        raise ValueError(f"unknown implementation {name!r}; choose from {', '.join(ALL_IMPLS)}")


def _no_adapter(name: str, layout: str) -> str:
    return ALL_IMPLS[name].elsewhere or f"no {layout} adapter"


def impl_layouts(name: str) -> list[str]:
    """The layouts that have an adapter for ``name``."""
    return [k for k, lay in LAYOUTS.items() if name in lay.impls]


def peer_unavailable(name: str, layout: str = "bhsd") -> str | None:
    """Why ``name`` cannot run in ``layout`` on this machine, without building it; None when
    it can."""
    _known(name)
    impl = LAYOUTS[layout].impls.get(name)
    return _no_adapter(name, layout) if impl is None else impl.unavailable()


def resolve_impls(names: list[str], layout: str = "bhsd", options: dict | None = None
                  ) -> tuple[dict[str, OpFn], dict[str, str]]:
    """Build the requested implementations, each called with the geometry's op ``options``;
    returns ``(available, skipped_with_reason)``."""
    registry = LAYOUTS[layout].impls
    available, skipped = {}, {}
    for name in names:
        _known(name)
        if name not in registry:
            skipped[name] = _no_adapter(name, layout)
            continue
        if options and not registry[name].takes_options:
            skipped[name] = f"does not support {', '.join(sorted(options))}"
            continue
        try:
            fn = registry[name].build()
        except ImportError as e:
            skipped[name] = str(e)
            continue
        available[name] = functools.partial(fn, **options) if options else fn
    return available, skipped
