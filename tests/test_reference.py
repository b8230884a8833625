"""The oracle itself, checked against an independent fp64 formulation of docs/spec.md §1."""

import pytest
import torch
from helpers import Case, make_inputs

import qkrope
from qkrope.ops.qknorm_rope.reference import qk_rotated_fp64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("max_pos", [4096, 2**18])
def test_reference_matches_fp64_within_rounding_bound(dtype, max_pos):
    # Four roundings to dtype stand between the exact value and the reference's: the normalized
    # row, cos/sin, each product (3u on a product) and the sum (u); so per element
    # |ref - exact| <= 3u (|n1 c| + |n2 s|) + u |exact|, plus fp32 noise (we allow 3.2u and 1.2u).
    c = Case(B=2, Hq=4, Hkv=2, S=33, D=128, L=8, dtype=dtype, max_pos=max_pos, start=0,
             per_batch_pos=True)
    args = make_inputs(c, device="cpu")
    q_ref, k_ref, *_ = qkrope.reference(*args)
    u = torch.finfo(dtype).eps / 2  # unit roundoff
    query, key, _, pos, _, _, _, q_w, k_w, inv_freq, eps = args
    for ref, (exact, mag) in zip((q_ref, k_ref),
                                 qk_rotated_fp64(query, key, pos, q_w, k_w, inv_freq, eps)):
        bound = 3.2 * u * mag + 1.2 * u * exact.abs()
        excess = (ref.double() - exact).abs() - bound
        assert excess.max() <= 0, f"reference off the fp64 model by {excess.max():.3g} over bound"


def test_reference_rounds_like_eager_hf_rope():
    # The reference must reproduce HF's eager rounding: cos/sin cast to bf16, q*cos +
    # rotate_half(q)*sin in bf16. Written out independently here with cat(freqs, freqs).
    c = Case(B=1, Hq=2, Hkv=1, S=5, D=64, start=2048, dtype=torch.bfloat16)
    args = make_inputs(c, device="cpu")
    query, _, _, pos, *_, q_w, _, inv_freq, eps = args
    xf = query.float()
    normed = (q_w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).bfloat16()
    freqs = pos.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().bfloat16()[:, None], emb.sin().bfloat16()[:, None]
    half = normed.shape[-1] // 2
    rotated = torch.cat((-normed[..., half:], normed[..., :half]), -1)
    expected = normed * cos + rotated * sin
    q_ref = qkrope.reference(*args)[0]
    assert torch.equal(q_ref, expected)


def test_reference_cache_semantics_and_no_mutation_mode():
    c = Case(B=2, Hq=2, Hkv=1, S=6, D=64, L=16, pad_rows=(1,), far_rows=(4,))
    args = make_inputs(c, device="cpu")
    kc, vc = args[4], args[5]
    kc0, vc0 = kc.clone(), vc.clone()
    _, k_rot, kc_new, vc_new = qkrope.reference(*args, inplace=False)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0), "inplace=False mutated the caches"
    rows = args[6]
    for s, r in enumerate(rows.tolist()):
        if 0 <= r < c.L:
            assert torch.equal(kc_new[:, :, r], k_rot[:, :, s])
            assert torch.equal(vc_new[:, :, r], args[2][:, :, s])
    untouched = [r for r in range(c.L) if r not in rows.tolist()]
    assert torch.equal(kc_new[:, :, untouched], kc0[:, :, untouched])


def test_oracles_return_fresh_caches_by_default_and_write_in_place_on_request():
    from test_qknorm_rope import PCase, make

    for oracle, args, kw in ((qkrope.reference, make_inputs(Case(B=1, S=3), device="cpu"), {}),
                             (qkrope.reference_paged, *make(PCase(T=4)))):
        kc, vc = args[4], args[5]
        kc0, vc0 = kc.clone(), vc.clone()
        out = oracle(*args, **kw)
        assert torch.equal(kc, kc0) and torch.equal(vc, vc0), f"{oracle.__name__} mutated"
        assert out[2] is not kc and not torch.equal(out[2], kc0), "no rows written"
        out = oracle(*args, **kw, inplace=True)
        assert out[2] is kc and not torch.equal(kc, kc0)


def test_hf_norm_rounding_matches_transformers_qwen3_rmsnorm():
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    from qkrope.ops.qknorm_rope.reference import rms_norm_ref

    x = torch.randn(3, 5, 128).bfloat16()
    norm = qwen3.Qwen3RMSNorm(128, eps=1e-6).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(128))
        expected = norm(x)
    assert torch.equal(rms_norm_ref(x, norm.weight.detach(), 1e-6, "hf"), expected)
    assert not torch.equal(rms_norm_ref(x, norm.weight.detach(), 1e-6), expected)


ROWS_BEYOND_INT32 = 2**31 + 16


def _sparse_cache(path, shape, dtype):
    """A cache of ``shape`` backed by a sparse file: gigabytes of address space, only the pages
    written take memory or disk."""
    n = 1
    for s in shape:
        n *= s
    return torch.from_file(str(path), shared=True, size=n * dtype.itemsize,
                           dtype=torch.uint8).view(dtype).view(shape)


@pytest.mark.parametrize("paged", [False, True], ids=["bhsd", "paged"])
def test_oracles_keep_int32_rows_of_caches_beyond_2_31_rows(tmp_path, paged):
    # int32 rows against a bound of 2**31 rows or more: compared as int32, the bound wrapped
    # negative and every valid row was skipped. Caches of 2 dims per row (the oracle's math
    # does not care), FP8: 4 GiB of address space each, a few pages of it written.
    D, L, bs = 2, ROWS_BEYOND_INT32, 16
    shape = (L // bs, bs, 1, D) if paged else (1, 1, L, D)
    fp8 = torch.float8_e4m3fn
    kc, vc = (_sparse_cache(tmp_path / n, shape, fp8) for n in ("k", "v"))
    rows = torch.tensor([5, -1, 2**31 - 1], dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(*s, generator=g).bfloat16() for s in
               (((3, 2, D), (3, 1, D), (3, 1, D)) if paged else
                ((1, 2, 3, D), (1, 1, 3, D), (1, 1, 3, D))))
    w = 1 + 0.5 * torch.randn(D, generator=g).bfloat16()
    pos = torch.tensor([7, 8, 9]) if paged else torch.tensor([[7, 8, 9]])
    inv_freq = torch.tensor([1.0])
    oracle = qkrope.reference_paged if paged else qkrope.reference
    _, k_rot, *_ = oracle(q, k, v, pos, kc, vc, rows, w, w, inv_freq, 1e-6, k_scale=1.0,
                          v_scale=1.0, inplace=True)
    for token, row in ((0, 5), (2, 2**31 - 1)):
        if paged:
            got_k, got_v = kc[row // bs, row % bs], vc[row // bs, row % bs]
            want_k, want_v = k_rot[token], v[token]
        else:
            got_k, got_v = kc[:, :, row], vc[:, :, row]
            want_k, want_v = k_rot[:, :, token], v[:, :, token]
        assert torch.equal(got_k.float(), want_k.float().clamp(-448, 448).to(fp8).float()), row
        assert torch.equal(got_v.float(), want_v.float().to(fp8).float()), row
