"""The 13-workload suite: workloads (S new tokens after C cached ones, for B sequences),
model geometries, input construction, the correctness rule, and the reduced sizes a machine
without CUDA checks them at."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

__all__ = [
    "Workload", "SUITE", "PAGED_SUITE", "ModelGeometry", "MODELS", "DEFAULT_MODEL", "OpInputs",
    "make_inputs", "make_paged_inputs", "cache_rows_needed", "rope_inv_freq", "TensorCheck",
    "check_outputs", "bytes_moved", "reduced_workload", "reduced_geometry", "REDUCED_MAX_SEQ",
    "REDUCED_MAX_BATCH",
]


@dataclass(frozen=True)
class Workload:
    """One benchmark shape: S new tokens per sequence, written after C tokens already in the KV
    cache (positions C .. C+S-1), for a batch of B sequences; checked at ``atol``."""

    seq_len: int
    cache_len: int
    batch: int
    atol: float = 1e-5

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    @property
    def name(self) -> str:
        return f"S={self.seq_len} C={self.cache_len} B={self.batch}"


SUITE: tuple[Workload, ...] = (
    Workload(1, 0, 1, 1e-5),
    Workload(1, 2048, 4, 1e-5),
    Workload(128, 0, 1, 1e-5),
    Workload(128, 0, 2, 1.3e-3),
    Workload(128, 0, 8, 2e-3),
    Workload(256, 128, 1, 4.9e-3),
    Workload(256, 1024, 8, 5.6e-3),
    Workload(293, 131, 1, 2.9e-3),
    Workload(512, 256, 2, 4.4e-3),
    Workload(541, 0, 1, 4.6e-3),
    Workload(1024, 512, 1, 4.5e-3),
    Workload(2048, 0, 1, 3.4e-3),
    Workload(4096, 2048, 1, 9.8e-3),
)


#: Serving-layout workloads: decode batches of 64 and 256 sequences at mixed positions
#: (S=1, B sequences) and a 4096-token prefill, token-major with a paged NHD cache.
PAGED_SUITE: tuple[Workload, ...] = (
    Workload(1, 0, 64, 1e-5),
    Workload(1, 0, 256, 1e-5),
    Workload(4096, 0, 1, 9.8e-3),
)
PAGED_BLOCK_SIZE = 16


@dataclass(frozen=True)
class ModelGeometry:
    """Attention-head geometry and RoPE/norm constants of a model family."""

    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1e7
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    rotary_dim: int | None = None        # partial rotary (Qwen3.5 / Qwen3-Next: head_dim / 4)
    norm_weight_offset: float = 0.0      # (1 + w) norms (Qwen3.5 / Qwen3-Next)

    def options(self) -> dict:
        """The op keywords this geometry needs beyond the eleven arguments (none for Qwen3)."""
        out = {}
        if self.rotary_dim is not None and self.rotary_dim != self.head_dim:
            out["rotary_dim"] = self.rotary_dim
        if self.norm_weight_offset:
            out["norm_weight_offset"] = self.norm_weight_offset
        return out


# Attention geometry of each model's full-attention layers, from its published config.
MODELS: dict[str, ModelGeometry] = {
    m.name: m
    for m in (
        ModelGeometry("qwen3-coder-480b", 96, 8, 128, 1e7, 1e-6, 262144),
        ModelGeometry("qwen3-235b", 64, 4, 128, 1e6, 1e-6, 40960),
        ModelGeometry("qwen3-32b", 64, 8, 128, 1e6, 1e-6, 40960),
        ModelGeometry("qwen3-8b", 32, 8, 128, 1e6, 1e-6, 40960),
        ModelGeometry("qwen3-0.6b", 16, 8, 128, 1e6, 1e-6, 40960),
        # Qwen3-VL-8B's text decoder; the suite's positions are text tokens (the three mRoPE
        # streams equal), so its interleaved mRoPE reduces to plain RoPE here.
        ModelGeometry("qwen3-vl-8b", 32, 8, 128, 5e6, 1e-6, 262144),
        # Qwen3.5 (transformers' Qwen3_5TextConfig defaults, Qwen3.5-27B) and Qwen3-Next-80B
        # full-attention layers: heads of 256, a quarter of each rotated, (1 + w) norm weights.
        ModelGeometry("qwen3.5-27b", 16, 4, 256, 1e7, 1e-6, 262144, rotary_dim=64,
                      norm_weight_offset=1.0),
        ModelGeometry("qwen3-next-80b", 16, 2, 256, 1e7, 1e-6, 262144, rotary_dim=64,
                      norm_weight_offset=1.0),
    )
}
DEFAULT_MODEL = MODELS["qwen3-coder-480b"]


def rope_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """[D/2] fp32 ``1 / theta ** (arange(0, D, 2) / D)``, as HF's default RoPE init computes it."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta ** exponent)


OpInputs = tuple  # the eleven op arguments, in the op's (and the benchmark's) order


def _norm_weights(D: int, benchmark_weights: bool, randn, device, dtype):
    """q/k norm weights: the benchmark's all-ones, or random ``1 + 0.5 * randn`` (default: a
    kernel that ignored the weights would pass on all-ones)."""
    if benchmark_weights:
        ones = torch.ones(D, device=device, dtype=dtype)
        return ones, ones.clone()
    return 1 + 0.5 * randn(D), 1 + 0.5 * randn(D)


def cache_rows_needed(workload: Workload, layout: str = "bhsd") -> int:
    """Cache rows a workload's inputs write up to: ``bhsd`` C + S per sequence; ``paged``, a
    decode (S = 1) puts each sequence in a block of its own, a prefill writes rows C .. C + B S."""
    if layout == "bhsd":
        return workload.cache_len + workload.seq_len
    if workload.seq_len == 1:
        return PAGED_BLOCK_SIZE * workload.tokens
    return workload.cache_len + workload.tokens


def make_inputs(
    workload: Workload,
    geometry: ModelGeometry = DEFAULT_MODEL,
    *,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    cache_capacity: int | None = None,
    benchmark_weights: bool = False,
    generator: torch.Generator | None = None,
) -> OpInputs:
    """Build the eleven op arguments for ``workload`` as the suite specifies.

    q/k/v and both caches are ``randn``; ``position_ids`` is ``arange(C, C+S)`` expanded over the
    batch (batch stride 0); ``cache_position`` the same rows. Norm weights are random
    (``1 + 0.5 * randn``) unless ``benchmark_weights`` asks for the benchmark's all-ones.
    ``cache_capacity`` (L) defaults to the model's ``max_position_embeddings``.
    """
    B, S, C = workload.batch, workload.seq_len, workload.cache_len
    Hq, Hkv, D = geometry.num_q_heads, geometry.num_kv_heads, geometry.head_dim
    L = cache_capacity or geometry.max_position_embeddings
    if cache_rows_needed(workload) > L:
        raise ValueError(f"workload {workload.name} needs {C + S} cache rows, capacity is {L}")

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=device, dtype=dtype)

    query, key, value = randn(B, Hq, S, D), randn(B, Hkv, S, D), randn(B, Hkv, S, D)
    key_cache, value_cache = randn(B, Hkv, L, D), randn(B, Hkv, L, D)
    rows = torch.arange(C, C + S, device=device, dtype=torch.int64)
    position_ids = rows[None, :].expand(B, S)
    q_w, k_w = _norm_weights(D, benchmark_weights, randn, device, dtype)
    inv_freq = rope_inv_freq(geometry.rotary_dim or D, geometry.rope_theta, device=device)
    return (query, key, value, position_ids, key_cache, value_cache, rows, q_w, k_w, inv_freq,
            geometry.rms_norm_eps)


def make_paged_inputs(
    workload: Workload,
    geometry: ModelGeometry = DEFAULT_MODEL,
    *,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    cache_capacity: int | None = None,
    benchmark_weights: bool = False,
    generator: torch.Generator | None = None,
) -> OpInputs:
    """The eleven arguments of :func:`qkrope.fused_qk_norm_rope_paged` for ``workload``.

    T = B * S tokens, token-major; NHD cache of 16-token blocks. Decode (S = 1): each of the B
    sequences at a random position below 32768, its row in a random block of its own at the
    position's offset in a block (``slot = block * 16 + position % 16``, as a page table gives
    an engine), in a cache of ``cache_capacity`` slots (default 64 per sequence). Prefill:
    positions and slots ``arange(C, C + S)``.
    """
    T, Hq, Hkv, D = workload.tokens, geometry.num_q_heads, geometry.num_kv_heads, geometry.head_dim

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=device, dtype=dtype)

    query, key, value = randn(T, Hq, D), randn(T, Hkv, D), randn(T, Hkv, D)
    need = cache_rows_needed(workload, "paged")
    slots_total = cache_capacity or (64 * T if workload.seq_len == 1 else need)
    if slots_total < need:
        raise ValueError(f"workload {workload.seq_len},{workload.cache_len},{workload.batch} "
                         f"needs a paged cache of at least {need} slots, got {slots_total}")
    if workload.seq_len == 1:
        positions = torch.randint(0, 32768, (T,), generator=generator, device=device)
        blocks = torch.randperm(slots_total // PAGED_BLOCK_SIZE, generator=generator,
                                device=device)[:T]
        slots = blocks * PAGED_BLOCK_SIZE + positions % PAGED_BLOCK_SIZE
    else:
        positions = torch.arange(workload.cache_len, workload.cache_len + T, device=device)
        slots = positions.clone()
    num_blocks = -(-slots_total // PAGED_BLOCK_SIZE)
    key_cache = randn(num_blocks, PAGED_BLOCK_SIZE, Hkv, D)
    value_cache = randn(num_blocks, PAGED_BLOCK_SIZE, Hkv, D)
    q_w, k_w = _norm_weights(D, benchmark_weights, randn, device, dtype)
    inv_freq = rope_inv_freq(geometry.rotary_dim or D, geometry.rope_theta, device=device)
    return (query, key, value, positions, key_cache, value_cache, slots, q_w, k_w, inv_freq,
            geometry.rms_norm_eps)


@dataclass(frozen=True)
class TensorCheck:
    """The correctness rule's verdict on one output tensor."""

    name: str
    match_fraction: float
    max_abs_err: float
    finite: bool

    @property
    def ok(self) -> bool:
        return self.finite and self.match_fraction >= 0.99


OUTPUT_NAMES = ("query_rotated", "key_rotated", "key_cache_out", "value_cache_out")


def check_outputs(outputs, reference, atol: float, rtol: float = 0.05,
                  omits: tuple[str, ...] = ()) -> list[TensorCheck]:
    """Apply the correctness rule (``|out - ref| <= atol + rtol*|ref|`` on >= 99 % of elements, no
    NaN/Inf) to each of the four outputs; returns one :class:`TensorCheck` per tensor. Before
    the rule, which compares in fp32 and would broadcast, each output must be a tensor of its
    reference's shape and dtype (a ValueError says which is not). An output given as None is
    allowed only where named in ``omits`` (an implementation without it, e.g. FlashInfer's
    rotated K, which only goes to the cache: checked there)."""
    if len(outputs) != len(reference):
        raise ValueError(f"{len(outputs)} outputs where the reference has {len(reference)}")
    checks = []
    for name, out, ref in zip(OUTPUT_NAMES, outputs, reference, strict=True):
        if out is None and name in omits:
            continue
        if not isinstance(out, torch.Tensor) or out.shape != ref.shape or \
                out.dtype != ref.dtype:
            got = (f"{out.dtype} {list(out.shape)}" if isinstance(out, torch.Tensor)
                   else type(out).__name__)
            raise ValueError(f"{name} is {got} where the reference's is {ref.dtype} "
                             f"{list(ref.shape)}")
        o, r = out.float(), ref.float()
        err = (o - r).abs()
        match = (err <= atol + rtol * r.abs()).float().mean().item()
        checks.append(TensorCheck(name, match, err.max().item(), bool(torch.isfinite(o).all())))
    return checks


def bytes_moved(workload: Workload, geometry: ModelGeometry = DEFAULT_MODEL,
                elem_bytes: int = 2, q_out_bytes: int | None = None,
                cache_bytes: int | None = None, row_scale_bytes: int = 0) -> int:
    """Minimum DRAM traffic of one call: Q read+write, K read+write+cache row, V
    read+cache row, plus 16 B of position indices per token. Quantised modes: the query output
    and the cache rows at their element sizes, and a scale per written row and head."""
    hq, hkv, d = geometry.num_q_heads, geometry.num_kv_heads, geometry.head_dim
    q_out, cache = q_out_bytes or elem_bytes, cache_bytes or elem_bytes
    per_token = (hq * d * (elem_bytes + q_out) + 3 * hkv * d * elem_bytes
                 + 2 * hkv * (d * cache + row_scale_bytes))
    return workload.tokens * (per_token + 16)


# ----------------------------------------------------------------------------------------------
# Reduced sizes for Triton's interpreter
# ----------------------------------------------------------------------------------------------
#: New tokens per sequence above this are cut (see :func:`reduced_workload`).
REDUCED_MAX_SEQ = 32
#: Sequences per batch above this are cut (no suite workload has more).
REDUCED_MAX_BATCH = 8


def reduced_workload(workload: Workload) -> Workload:
    """The workload's shape class at a size Triton's CPU interpreter checks in seconds.

    The interpreter's cost grows with every (head, token) row (the full suite takes a minute or
    two there). Kept: C (so the same positions start the rotation and the same cache rows start
    the write: decode at position 2048 with atol 1e-5 is checked exactly), the atol, S = 1
    (decode) versus S > 1, and S modulo 32 (so a prefill of 293 or 541 tokens still ends in a
    partial tile of tokens). S above :data:`REDUCED_MAX_SEQ` becomes ``32 + S % 32`` and B
    above :data:`REDUCED_MAX_BATCH` becomes 8.
    """
    s = workload.seq_len
    if s > REDUCED_MAX_SEQ:
        s = REDUCED_MAX_SEQ + s % REDUCED_MAX_SEQ
    return Workload(s, workload.cache_len, min(workload.batch, REDUCED_MAX_BATCH), workload.atol)


def reduced_geometry(geometry: ModelGeometry) -> ModelGeometry:
    """The model's head geometry with fewer heads, for the interpreter: at most 2 key/value
    heads and 3 query heads per key/value head (96/8 becomes 6/2). Kept: head_dim, rope theta,
    eps, grouped-query attention (more query than key/value heads), more than one key/value
    head (the cache's head stride), and a query head count that is not a power of two
    wherever the model's is not (a partly masked tile of heads)."""
    kv = min(geometry.num_kv_heads, 2)
    group = min(geometry.num_q_heads // geometry.num_kv_heads, 3)
    return replace(geometry, num_q_heads=kv * group, num_kv_heads=kv)
