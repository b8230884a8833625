"""The rotary table (``rope_cos_sin``) against its oracle over shapes with teeth: prime lengths,
expanded and strided positions, int32 positions, angles far past 2 pi, frequency counts that are
no power of two, mRoPE streams, every table dtype; bit for bit (the same rounding points as the
op's own cos/sin, docs/spec.md R2). On the GPU when there is one, else through Triton's
interpreter, whose fp32 cos/sin (numpy's) and torch's CPU ones differ by an ulp in ~15% of
values: float32 tables there are held to that (and the scale's rounding), the rounded dtypes to
exact bits."""

import pytest
import torch
from helpers import DEVICE, ON_GPU

from qkrope.ops.qknorm_rope import rope_cos_sin
from qkrope.ops.qknorm_rope.reference import rope_cos_sin_ref


def inv_freq(half: int, theta: float = 1e6) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, 2 * half, 2, dtype=torch.float32, device=DEVICE)
                            / (2 * half)))


def positions(B: int, S: int, kind: str, generator) -> torch.Tensor:
    if kind == "expanded":  # one row for the batch: a [B, S] view with batch stride 0
        return torch.arange(3, 3 + S, device=DEVICE)[None].expand(B, S)
    if kind == "far":  # random, up to 2**20: the trig's range reduction
        return torch.randint(0, 2**20, (B, S), generator=generator, device=DEVICE)
    if kind == "strided":  # a transposed view
        return torch.randint(0, 5000, (S, B), generator=generator, device=DEVICE).t()
    assert kind == "int32"
    return torch.randint(0, 40960, (B, S), generator=generator, device=DEVICE,
                         dtype=torch.int32)


def assert_table(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    if ON_GPU or want.dtype != torch.float32:
        assert torch.equal(got, want)
    else:  # trig within an ulp (2**-23 relative), then the scale's two roundings (2**-24 each)
        assert ((got - want).abs() <= 2.0**-22 * want.abs()).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("B, S, half, kind, scale", [
    (1, 1, 64, "far", 1.0),             # a decode step of Qwen3's 128-dim heads
    (3, 7, 64, "expanded", 1.0),
    (2, 13, 32, "far", 1.2345),         # YaRN's attention_scaling
    (2, 5, 12, "strided", 1.0),         # 12 frequencies: padding lanes in the tile
    (1, 67, 8, "int32", 0.75),          # more tokens than one program's tile
])
def test_table_equals_the_oracle(dtype, B, S, half, kind, scale):
    g = torch.Generator(device=DEVICE).manual_seed(B * S + half)
    pos, inv = positions(B, S, kind, g), inv_freq(half)
    cos, sin = rope_cos_sin(pos, inv, dtype, cos_sin_scale=scale)
    want_cos, want_sin = rope_cos_sin_ref(pos, inv, dtype, scale)
    assert cos.shape == (B, S, 2 * half) and cos.dtype == dtype
    assert_table(cos, want_cos)
    assert_table(sin, want_sin)


@pytest.mark.parametrize("interleaved", [True, False])  # Qwen3-VL / Qwen3.5, Qwen2-VL
@pytest.mark.parametrize("streams", [3, 2])  # [3, B, S] streams, or [B, S] for all three
def test_mrope_table(streams, interleaved):
    g = torch.Generator(device=DEVICE).manual_seed(streams)
    half, section = 32, (12, 10, 10)      # Qwen3-VL's (24, 20, 20) at half the width
    shape = (3, 2, 9) if streams == 3 else (2, 9)
    pos = torch.randint(0, 3000, shape, generator=g, device=DEVICE)
    inv = inv_freq(half, 5e6)
    cos, sin = rope_cos_sin(pos, inv, torch.bfloat16, mrope_section=section,
                            mrope_interleaved=interleaved)
    want = rope_cos_sin_ref(pos, inv, torch.bfloat16, 1.0, section, interleaved)
    assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])
    if streams == 3:  # the streams really differ: the plain table would not match
        plain = rope_cos_sin_ref(pos[0], inv, torch.bfloat16)
        assert not torch.equal(cos, plain[0])


@pytest.mark.parametrize("args, kwargs, error, name", [
    ((torch.zeros(1, 4), None, torch.bfloat16), {}, TypeError, "position_ids"),
    ((torch.zeros(1, 4, dtype=torch.long), "f64", torch.bfloat16), {}, TypeError,
     "inv_freq"),
    ((torch.zeros(4, dtype=torch.long), None, torch.bfloat16), {}, ValueError, "position_ids"),
    ((torch.zeros(3, 1, 4, dtype=torch.long), None, torch.bfloat16), {}, ValueError,
     "position_ids"),
    ((torch.zeros(1, 4, dtype=torch.long), None, torch.int8), {}, TypeError, "dtype"),
    ((torch.zeros(1, 4, dtype=torch.long), None, torch.bfloat16), {"cos_sin_scale": 0.0},
     ValueError, "cos_sin_scale"),
    ((torch.zeros(1, 4, dtype=torch.long), None, torch.bfloat16),
     {"mrope_section": (1, 1, 1), "mrope_interleaved": True}, ValueError, "mrope_section"),
])
def test_refusals_name_the_argument(args, kwargs, error, name):
    pos, inv, dtype = args
    inv = inv_freq(8) if inv is None else (inv_freq(8).double() if inv == "f64" else inv)
    with pytest.raises(error, match=name):
        rope_cos_sin(pos.to(DEVICE), inv, dtype, **kwargs)
