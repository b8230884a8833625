"""Bad input gets a clear TypeError/ValueError naming the argument and what was expected."""

import math
import struct

import pytest
import torch
from helpers import DEVICE, Case, make_inputs
from hypothesis import given, settings
from hypothesis import strategies as st

import qkrope
from qkrope.ops.qknorm_rope.checks import _as_float32

NAMES = ["query", "key", "value", "position_ids", "key_cache", "value_cache", "cache_position",
         "q_norm_weight", "k_norm_weight", "inv_freq", "rms_norm_eps"]


def args_with(**changes):
    args = dict(zip(NAMES, make_inputs(Case(B=2, Hq=4, Hkv=2, S=5, D=64, L=16))))
    for name, fn in changes.items():
        args[name] = fn(args[name]) if callable(fn) else fn
    return [args[n] for n in NAMES]


def call(args, **kw):
    return qkrope.fused_rope_with_qk_norm_and_kv_cache_update(*args, **kw)


@pytest.mark.parametrize("change, exc, words", [
    (dict(query=lambda x: x.float()), TypeError, ["query", "bfloat16 or float16", "float32"]),
    (dict(key=lambda x: x.half()), TypeError, ["key", "bfloat16"]),
    (dict(value=lambda x: x[0]), ValueError, ["value", "rank 4"]),
    (dict(position_ids=lambda x: x.float()), TypeError, ["position_ids", "int32 or int64"]),
    (dict(cache_position=lambda x: x[None]), ValueError, ["cache_position", "rank 1"]),
    (dict(inv_freq=lambda x: x.double()), TypeError, ["inv_freq", "float32"]),
    (dict(q_norm_weight=lambda x: x.float()), TypeError, ["q_norm_weight", "bfloat16"]),
    (dict(key=lambda x: x[:1]), ValueError, ["key", "[2, 2, 5, 64]"]),
    (dict(key=lambda x: x[:, :, :4]), ValueError, ["key", "S"]),
    (dict(value=lambda x: x[:, :1]), ValueError, ["value", "[2, 2, 5, 64]"]),
    (dict(key=lambda x: torch.cat([x, x[:, :1]], 1),
          value=lambda x: torch.cat([x, x[:, :1]], 1)), ValueError,
     ["query heads (4)", "multiple of key heads (3)"]),
    (dict(query=lambda x: x[..., :48], key=lambda x: x[..., :48], value=lambda x: x[..., :48]),
     ValueError, ["head_dim", "(64, 128, 256, 512)", "48"]),
    (dict(value_cache=lambda x: x[:, :, :8]), ValueError, ["value_cache", "shape of key_cache"]),
    (dict(key_cache=lambda x: x[:, :1]), ValueError, ["key_cache", "Hkv"]),
    (dict(position_ids=lambda x: x[:, :3]), ValueError, ["position_ids", "[B, S]"]),
    (dict(cache_position=lambda x: x[:3]), ValueError, ["cache_position", "[S]"]),
    (dict(inv_freq=lambda x: x[:5]), ValueError, ["inv_freq", "[rotary_dim/2]"]),
    (dict(k_norm_weight=lambda x: x[:5]), ValueError, ["k_norm_weight", "[D]"]),
    (dict(rms_norm_eps="1e-6"), TypeError, ["rms_norm_eps", "float"]),
    (dict(rms_norm_eps=float("nan")), ValueError, ["rms_norm_eps", "finite"]),
    (dict(query=[1, 2]), TypeError, ["query", "torch.Tensor"]),
])
def test_bad_argument_is_named(change, exc, words):
    with pytest.raises(exc) as info:
        call(args_with(**change))
    for w in words:
        assert w in str(info.value), f"{w!r} not in error message: {info.value}"


@pytest.mark.parametrize("options, exc, words", [
    # The kernel computes with these in float32: 1e39 is inf there (all-NaN outputs), 1e-46 is
    # 0 (all-zero outputs); both are finite and > 0 in float64.
    (dict(cos_sin_scale=1e39), ValueError, ["cos_sin_scale", "float32's range", "got 1e+39"]),
    (dict(cos_sin_scale=1e-46), ValueError, ["cos_sin_scale", "smallest normal", "is 0"]),
    (dict(norm_weight_offset=1e39), ValueError, ["norm_weight_offset", "float32's range"]),
    (dict(norm_weight_offset=-1e39), ValueError, ["norm_weight_offset", "-inf"]),
    (dict(mrope_interleaved=True), ValueError, ["mrope_interleaved=True needs mrope_section"]),
    (dict(mrope_interleaved=1), TypeError, ["mrope_interleaved", "got 1 of type int"]),
])
def test_bad_option_is_named(options, exc, words):
    with pytest.raises(exc) as info:
        call(args_with(), **options)
    for w in words:
        assert w in str(info.value), f"{w!r} not in error message: {info.value}"


@pytest.mark.parametrize("eps", [1e39, 1e-40])
def test_rms_norm_eps_must_be_a_float32_value(eps):
    with pytest.raises(ValueError, match="rms_norm_eps must be"):
        call(args_with(rms_norm_eps=eps))


@settings(max_examples=3000, deadline=None)
@given(st.floats(allow_nan=False) | st.floats(-2.0**-120, 2.0**-120)
       | st.integers(-(2**24), 2**24).map(lambda m: m * 2.0**-150))  # ties of subnormals
def test_float32_rounding_of_scalars_is_cs(x):
    # The checks' float32 rounding (plain arithmetic, so torch.compile can trace it) is C's
    # (float)x, as struct gives it: nearest even, subnormals, -0, overflow to inf.
    try:
        want = struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        want = math.copysign(math.inf, x)
    got = _as_float32(x)
    assert got == want and math.copysign(1, got) == math.copysign(1, want), (x, got, want)


def test_float32_edges_are_accepted():
    # Far from 1 but float32-normal, and so are the outputs: run, and match the oracle. (The
    # smallest normal scales give subnormal outputs, which Triton's interpreter, unlike the GPU,
    # converts to bf16 wrongly.)
    for kw in (dict(cos_sin_scale=2.0**-100), dict(norm_weight_offset=-1e30)):
        args = args_with()
        out = call(args, **kw, inplace=False)
        ref = qkrope.reference(*args, **kw)
        for o, r in zip(out, ref):
            assert o.isfinite().all() and (o == r).float().mean() > 0.99, kw


def test_wrong_device_is_named():
    other = "meta"
    with pytest.raises(ValueError, match="inv_freq is on meta.*one device"):
        call(args_with(inv_freq=lambda x: x.to(other)))


@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA to have a non-CUDA tensor to reject")
def test_cpu_tensors_rejected_on_gpu_build():
    args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args_with()]
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        call(args)


@pytest.mark.parametrize("which, shape, exc", [
    ("query_out", (2, 4, 5, 32), ValueError),
    ("key_out", (2, 4, 5, 64), ValueError),
])
def test_bad_out_buffers(which, shape, exc):
    args = args_with()
    out = torch.empty(shape, dtype=args[0].dtype, device=DEVICE)
    with pytest.raises(exc, match=which):
        call(args, **{which: out})


def test_out_buffer_wrong_dtype():
    args = args_with()
    with pytest.raises(TypeError, match="query_out"):
        call(args, query_out=torch.empty(args[0].shape, dtype=torch.float32, device=DEVICE))


def test_position_ids_batch_one_broadcasts():
    args = args_with(position_ids=lambda x: x[:1])
    q_rot = call(args)[0]
    ref = qkrope.reference(*args_with(), inplace=False)[0]
    assert (q_rot == ref).float().mean() > 0.99


@pytest.mark.parametrize("row", [-1, 16, 10**6])
def test_out_of_range_rows_skipped_or_raised(row):
    args = args_with(cache_position=lambda x: torch.tensor([0, 1, row, 3, 4], dtype=x.dtype,
                                                             device=x.device))
    kc0 = args[4].clone()
    call(args)  # skipped silently: no out-of-bounds write, other rows written
    untouched = [2] + list(range(5, 16))
    assert torch.equal(args[4][:, :, untouched], kc0[:, :, untouched])
    with pytest.raises(ValueError, match=rf"cache_position holds {row}, outside the cache \[0, 16\)"):
        call(args, validate=True)


def test_bad_norm_rounding():
    with pytest.raises(ValueError, match="norm_rounding must be one of"):
        call(args_with(), norm_rounding="HF")


def test_batch_beyond_the_launch_grid_is_refused():
    q = torch.empty(65536, 1, 1, 64).bfloat16().expand(65536, 1, 1, 64)
    args = args_with()
    with pytest.raises(ValueError, match="batch must be <= 65535"):
        call([q, *args[1:]])


def test_validate_keeps_int32_rows_of_a_cache_beyond_2_31_rows():
    # int32 rows were compared with the bound as int32: 2**31 + 16 wrapped negative and every
    # valid row was refused ("holds 0, outside the cache [0, 2147483664)"). A cache that big
    # does not fit here: an expanded view passes the checks up to the launch, which refuses it
    # (overlapping elements) only after validate has judged the rows.
    L = 2**31 + 16

    def big(x):
        return x[:, :, :1].expand(x.shape[0], x.shape[1], L, x.shape[3])

    def rows(*r):
        return torch.tensor(r, dtype=torch.int32, device=DEVICE)

    args = args_with(key_cache=big, value_cache=big, cache_position=rows(0, 1, 5, 3, 2**31 - 1))
    with pytest.raises(ValueError, match="key_cache has elements that overlap"):
        call(args, validate=True)
    args = args_with(key_cache=big, value_cache=big, cache_position=rows(0, 1, -1, 3, 4))
    with pytest.raises(ValueError, match=r"cache_position holds -1, outside the cache "
                                         r"\[0, 2147483664\)"):
        call(args, validate=True)


def test_float_scale_tensors_are_kept_per_value_and_never_evicted(monkeypatch):
    # A CUDA graph that captured a cached scale tensor reads it at every replay: the cache
    # must not drop it (it had been an LRU of 64); past its size, tensors are made per call.
    from qkrope.ops.qknorm_rope import checks

    monkeypatch.setattr(checks, "_SCALARS", {})  # (the process's own cache stays as it was)
    dev = torch.device("cpu")
    first = checks.scalar_on(0.03125, dev)
    for i in range(checks._SCALARS_MAX + 8):
        checks.scalar_on(1.0 + i / 1024, dev)
    assert checks.scalar_on(0.03125, dev) is first and first.item() == 0.03125
    assert len(checks._SCALARS) <= checks._SCALARS_MAX
    late = 3.0 + checks._SCALARS_MAX
    assert checks.scalar_on(late, dev) is not checks.scalar_on(late, dev)
    assert checks.scalar_on(late, dev).item() == late


def test_a_scale_tensor_made_under_a_tracing_mode_is_not_kept(monkeypatch):
    # A fake tensor kept for a value would later stand for it in real calls (and, through
    # _native.keep_scalar, in the fast path's signature): only plain tensors are kept.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from qkrope.ops.qknorm_rope import checks

    monkeypatch.setattr(checks, "_SCALARS", {})
    dev = torch.device("cpu")
    with FakeTensorMode():
        fake = checks.scalar_on(0.375, dev)
    assert type(fake) is not torch.Tensor and not checks._SCALARS
    real = checks.scalar_on(0.375, dev)
    assert type(real) is torch.Tensor and real.item() == 0.375
    assert checks.scalar_on(0.375, dev) is real
