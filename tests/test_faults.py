"""Faults and misuse: huge strides (int64 addressing), NaN in FP8 caches, concurrent calls in
Triton's interpreter, tensors on devices the kernel cannot run on, bad head counts, scales
given as strided views."""

import threading

import pytest
import torch
from helpers import DEVICE, ON_GPU, Case, make_inputs
from test_qknorm_rope import PCase, make

import qkrope

# A head-dim stride this large makes (D/2) * stride_d exceed 2**31 for every head_dim: int32
# address arithmetic would wrap and touch memory gigabytes away from the tensor.
HUGE = 2**26 + 16


def _sparse_buffer(tmp_path, elements: int, dtype=torch.bfloat16) -> torch.Tensor:
    """``elements`` of ``dtype`` backed by a sparse file: only written pages cost memory."""
    path = tmp_path / "sparse.bin"
    with open(path, "wb") as f:
        f.truncate(elements * torch.empty((), dtype=dtype).element_size())
    return torch.from_file(str(path), shared=True, size=elements, dtype=dtype)


@pytest.mark.skipif(ON_GPU, reason="a file-backed (host) tensor: the interpreter's check")
def test_huge_head_dim_stride_is_addressed_in_int64(tmp_path, offset_width):
    D = 64
    buf = _sparse_buffer(tmp_path, 2 * D * HUGE + 8)
    args = list(make_inputs(Case(B=1, Hq=1, Hkv=1, S=1, D=D, L=4)))
    # query and query_out: [1, 1, 1, D] with head-dim stride HUGE, in disjoint halves of buf.
    q = buf.as_strided((1, 1, 1, D), (D * HUGE, D * HUGE, D * HUGE, HUGE), 0)
    q_out = buf.as_strided((1, 1, 1, D), (D * HUGE, D * HUGE, D * HUGE, HUGE), D * HUGE + 8)
    q.copy_(args[0])
    q_out.fill_(float("nan"))
    args[0] = q
    ref_q, *_ = qkrope.reference(*[a.clone() if isinstance(a, torch.Tensor) else a
                                   for a in args])
    out, *_ = qkrope.run(*args, query_out=q_out)
    assert out is q_out and offset_width == [True]
    assert torch.equal(q_out, ref_q) or (q_out.float() - ref_q.float()).abs().max() <= 2**-6


@pytest.mark.skipif(ON_GPU, reason="a file-backed (host) tensor: the interpreter's check")
def test_huge_stride_paged_key(tmp_path, offset_width):
    D = 64
    args, kw = make(PCase(T=2, Hq=2, Hkv=1, D=D, num_blocks=1, block_size=4))
    args = list(args)
    buf = _sparse_buffer(tmp_path, 2 * D * HUGE + 8)
    k = buf.as_strided((2, 1, D), (1, 1, HUGE), 0)
    k.copy_(args[1])
    args[1] = k
    ref = qkrope.reference_paged(*[a.clone() if isinstance(a, torch.Tensor) else a
                                   for a in args], **kw)
    _, k_rot = qkrope.fused_qk_norm_rope_paged(*args, **kw)
    assert offset_width == [True]
    assert (k_rot.float() - ref[1].float()).abs().max() <= 2**-6
    assert torch.equal(args[5].view(torch.uint8), ref[3].view(torch.uint8))


@pytest.fixture
def offset_width(monkeypatch):
    """The offset width (``WIDE``) of each kernel launch of the test, in order."""
    from qkrope.ops.qknorm_rope import launcher

    seen = []
    real = launcher.LAUNCHER.launch
    # No native plans: the test's calls go through the checked launch, where the width is set.
    monkeypatch.setattr(launcher.LAUNCHER, "plans", {})

    def launch(grid, args, meta, device):
        seen.append(meta["WIDE"])
        return real(grid, args, meta, device)

    monkeypatch.setattr(launcher.LAUNCHER, "launch", launch)
    return seen


def test_offset_width_follows_the_largest_element_offset():
    from qkrope.ops.qknorm_rope.launcher import wide_offsets

    def view(shape, stride):
        return torch.empty_strided(shape, stride, device="meta")

    assert not wide_offsets(view((2, 3), (2**31 - 3, 1)), None)        # largest 2**31 - 1
    assert wide_offsets(None, view((2, 3), (2**31 - 2, 1)))            # largest 2**31
    assert not wide_offsets(view((1, 5), (2**40, 1)))                  # a size-1 dim adds 0
    assert wide_offsets(view((2**16, 2**15 + 1), (2**15 + 1, 1)))      # a large cache
    assert not wide_offsets(view((8, 8, 262144, 128), (2**28, 2**25, 128, 1)))  # 2**31 - 1


@pytest.mark.skipif(ON_GPU, reason="a file-backed (host) tensor: the interpreter's check")
@pytest.mark.parametrize("largest", [2**31 - 1, 2**31 + 1])
def test_offsets_at_the_int32_edge(tmp_path, offset_width, largest):
    """A key whose largest element offset is just below / above 2**31: int32 offsets up to
    the last representable one, int64 past it; both read every element where it is."""
    D, hd_stride = 64, 2**25
    args, kw = make(PCase(T=2, Hq=2, Hkv=1, D=D, num_blocks=1, block_size=4))
    args = list(args)
    buf = _sparse_buffer(tmp_path, largest + 1)
    k = buf.as_strided((2, 1, D), (largest - (D - 1) * hd_stride, 1, hd_stride), 0)
    k.copy_(args[1])
    args[1] = k
    ref = qkrope.reference_paged(*[a.clone() if isinstance(a, torch.Tensor) else a
                                   for a in args], **kw)
    _, k_rot = qkrope.fused_qk_norm_rope_paged(*args, **kw)
    assert offset_width == [largest >= 2**31]
    assert (k_rot.float() - ref[1].float()).abs().max() <= 2**-6
    assert torch.equal(args[5].view(torch.uint8), ref[3].view(torch.uint8))


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.gpu
@pytest.mark.big_gpu_memory
@pytest.mark.parametrize("extra_rows", [0, 64], ids=["2**31 elements", "past 2**31"])
def test_cache_at_and_beyond_2_pow_31_elements_gpu(offset_width, extra_rows):
    """Caches of 2**31 elements (4 GiB bf16: the last offset is int32's largest) and larger
    (int64 offsets): the last rows are written in place, nothing else."""
    B, Hkv, D = 1, 2, 128
    L = 2**31 // (Hkv * D) + extra_rows
    args = list(make_inputs(Case(B=B, Hq=4, Hkv=Hkv, S=3, D=D, L=8)))
    kc = torch.zeros(B, Hkv, L, D, dtype=torch.bfloat16, device="cuda")
    vc = torch.zeros_like(kc)
    rows = torch.tensor([L - 3, L - 1, L - 2], device="cuda")
    args[4], args[5], args[6] = kc, vc, rows
    q_rot, k_rot, _, _ = qkrope.run(*args)
    assert offset_width == [extra_rows > 0]
    assert torch.equal(kc[:, :, rows], k_rot) and torch.equal(vc[:, :, rows], args[2])
    assert kc[:, :, : L - 3].count_nonzero() == 0 and vc[:, :, : L - 3].count_nonzero() == 0


def _fp8_case():
    args, kw = make(PCase(T=5, Hq=2, Hkv=2, cache_dtype=torch.float8_e4m3fn, per_head_scale=True))
    return list(args), kw


def _same_nan_and_bits(cache, ref):
    nan, ref_nan = cache.float().isnan(), ref.float().isnan()
    assert torch.equal(nan, ref_nan), "NaN placement differs from the reference"
    assert torch.equal(cache.view(torch.uint8)[~nan], ref.view(torch.uint8)[~ref_nan])


def test_fp8_cache_keeps_nan_from_k_and_v():
    args, kw = _fp8_case()
    args[1][1, 0, 5] = float("nan")       # a K row: its norm makes the whole row NaN
    args[2][2, 1, 7] = float("nan")       # one V element
    args[2][3, 0, 0] = float("inf")       # +inf saturates to 448 (finite by convention)
    ref = qkrope.reference_paged(*[a.clone() if isinstance(a, torch.Tensor) else a
                                   for a in args], **kw)
    qkrope.fused_qk_norm_rope_paged(*args, **kw)
    _same_nan_and_bits(args[4], ref[2])
    _same_nan_and_bits(args[5], ref[3])
    assert args[4].float().isnan().any() and args[5].float().isnan().any()


def test_fp8_nan_scale_tensor_stores_nan_and_validate_refuses_it():
    args, kw = _fp8_case()
    kw["k_scale"] = kw["k_scale"].clone()
    kw["k_scale"][1] = float("nan")
    ref = qkrope.reference_paged(*[a.clone() if isinstance(a, torch.Tensor) else a
                                   for a in args], **kw)
    qkrope.fused_qk_norm_rope_paged(*args, **kw)
    _same_nan_and_bits(args[4], ref[2])
    args[6] = torch.arange(5, device=DEVICE)  # every slot valid: only the scale is wrong
    with pytest.raises(ValueError, match="k_scale"):
        qkrope.fused_qk_norm_rope_paged(*args, **kw, validate=True)
    for bad in (0.0, -1.0, float("inf")):
        kw["k_scale"][1] = bad
        with pytest.raises(ValueError, match="k_scale"):
            qkrope.fused_qk_norm_rope_paged(*args, **kw, validate=True)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -2.0])
def test_fp8_float_scale_must_be_finite_and_positive(bad):
    args, kw = _fp8_case()
    kw["v_scale"] = bad
    with pytest.raises(ValueError, match="v_scale"):
        qkrope.fused_qk_norm_rope_paged(*args, **kw)


def test_strided_per_head_scale_view():
    """A per-head scale given as a strided view (every other element of a buffer) is read
    through its stride, never through a temporary copy."""
    args, kw = _fp8_case()
    buf = torch.full((4,), 1e9, device=DEVICE)
    buf[::2] = kw["k_scale"]
    kw["k_scale"] = buf[::2]
    ref = qkrope.reference_paged(*[a.clone() if isinstance(a, torch.Tensor) else a
                                   for a in args], **{**kw, "k_scale": kw["k_scale"].clone()})
    for _ in range(2):  # checked path, then the fast path where it exists
        qkrope.fused_qk_norm_rope_paged(*args, **kw)
        _same_nan_and_bits(args[4], ref[2])


@pytest.mark.skipif(ON_GPU, reason="Triton's interpreter only")
def test_interpreter_calls_from_several_threads_equal_the_reference():
    cases = [list(make_inputs(Case(B=1, Hq=2, Hkv=1, S=2, L=6, seed=s))) for s in range(8)]
    refs = [qkrope.reference(*[a.clone() if isinstance(a, torch.Tensor) else a for a in c])
            for c in cases]
    errors = []

    def work(i):
        try:
            for _ in range(2):
                out = qkrope.run(*cases[i])
                assert torch.equal(out[2], refs[i][2]) and torch.equal(out[3], refs[i][3])
                assert (out[0].float() - refs[i][0].float()).abs().max() <= 2**-6
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    assert not errors, errors


def test_meta_tensors_get_a_device_error():
    args = [a.to("meta") if isinstance(a, torch.Tensor) else a
            for a in make_inputs(Case(B=1, S=2))]
    with pytest.raises(ValueError, match="needs CUDA tensors.*meta"):
        qkrope.run(*args)
    pargs, kw = make(PCase(T=3))
    pargs = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in pargs]
    with pytest.raises(ValueError, match="needs CUDA tensors.*meta"):
        qkrope.fused_qk_norm_rope_paged(*pargs, **kw)


@pytest.mark.parametrize("which, value", [("num_q_heads", None), ("num_q_heads", 4.0),
                                          ("num_kv_heads", None), ("num_kv_heads", True),
                                          ("num_kv_heads", 0)])
def test_packed_entry_point_names_bad_head_counts(which, value):
    args, kw = make(PCase(T=3))
    qkv = torch.randn(3, (4 + 2 * 2) * 64, dtype=torch.bfloat16, device=DEVICE)
    heads = {"num_q_heads": 4, "num_kv_heads": 2, which: value}
    with pytest.raises(TypeError, match=which):
        qkrope.fused_qkv_norm_rope_paged(qkv, heads["num_q_heads"], heads["num_kv_heads"],
                                         *args[3:], **kw)


def test_dtensor_weight_is_refused_by_name(tmp_path):
    """Tensor parallelism may hand a weight over as a DTensor: named, never a crash in Triton."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        args = list(make_inputs(Case(B=1, S=2)))
        args[8] = DTensor.from_local(args[8].cpu(), init_device_mesh("cpu", (1,)), [Replicate()])
        with pytest.raises(TypeError, match=r"k_norm_weight is a DTensor.*to_local"):
            qkrope.run(*args)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("wrapped", [2**32 + 1, -(2**32) + 1, 2**31 + 1])
def test_slot_past_int32_is_skipped_not_narrowed(wrapped, offset_width):
    """An int64 slot whose low 32 bits name a valid row (2**32 + 1 -> row 1) is out of range
    and skipped: the range check sees the slot before the int32 offsets do."""
    args, kw = make(PCase(T=5, Hq=2, Hkv=1))
    args = list(args)
    args[6] = args[6].to(torch.int64)
    args[6][2] = wrapped
    ref = qkrope.reference_paged(*[a.clone() if isinstance(a, torch.Tensor) else a
                                   for a in args], **kw)
    qkrope.fused_qk_norm_rope_paged(*args, **kw)
    assert offset_width == [False]
    assert torch.equal(args[4], ref[2]) and torch.equal(args[5], ref[3])
