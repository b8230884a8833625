"""The fused Triton kernel against the reference: on the GPU when there is one, otherwise the
real kernel through Triton's interpreter. Every run poisons the outputs, checks every element
against a derived bound and the bit-identical fraction, and checks the caches row by row."""

import pytest
import torch
from helpers import DEVICE, Case, make_inputs, run_and_check
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qkrope

CASES = {
    "basic": Case(),
    "prime_S_B3": Case(B=3, S=37, Hq=4, Hkv=4),
    "gqa4_d128": Case(B=2, Hq=8, Hkv=2, S=13, D=128, L=40),
    "gqa1_d256": Case(B=1, Hq=2, Hkv=2, S=5, D=256, L=9),
    "fp16": Case(dtype=torch.float16, S=11, Hq=4, Hkv=1),
    "int32_indices": Case(index_dtype=torch.int32, S=9),
    "noncontig_packed_qkv": Case(noncontig=True, B=2, Hq=4, Hkv=2, S=17, D=64, L=24),
    "per_batch_positions": Case(B=3, per_batch_pos=True, expand_pos=False, S=6),
    "padding_and_out_of_range_rows": Case(S=10, L=16, pad_rows=(0, 4), far_rows=(7, 9)),
    "last_cache_slot": Case(S=4, L=12, start=8),
    "decode_S1": Case(B=3, S=1, Hq=8, Hkv=2, D=128, L=64, start=63),
    "large_positions": Case(B=2, S=19, max_pos=2**18, per_batch_pos=True, expand_pos=False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fused_matches_reference(name):
    run_and_check(make_inputs(CASES[name]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hf_norm_rounding(dtype):
    run_and_check(make_inputs(Case(S=9, dtype=dtype, seed=11)), norm_rounding="hf")


def test_default_allocation_and_no_mutation_mode():
    args = make_inputs(Case(S=9))
    kc, vc = args[4], args[5]
    kc0, vc0 = kc.clone(), vc.clone()
    q_rot, k_rot, kc_new, vc_new = qkrope.fused_rope_with_qk_norm_and_kv_cache_update(
        *args, inplace=False)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0), "inplace=False mutated the caches"
    assert kc_new.data_ptr() != kc.data_ptr() and vc_new.data_ptr() != vc.data_ptr()
    ref = qkrope.reference(*args, inplace=False)
    assert q_rot.is_contiguous() and k_rot.is_contiguous()
    for out, r in zip((kc_new, vc_new), ref[2:]):
        assert torch.equal(out, r)
    torch.testing.assert_close(q_rot, ref[0], rtol=0, atol=0.05)


def test_query_out_may_alias_query():
    args = make_inputs(Case(S=8))
    expected = qkrope.reference(*args, inplace=False)[0]
    query = args[0].clone()
    out = qkrope.fused_rope_with_qk_norm_and_kv_cache_update(query, *args[1:], query_out=query)[0]
    assert out is query
    assert (out == expected).float().mean() > 0.99


def test_strided_query_out():
    args = make_inputs(Case(S=6))
    big = torch.full((2, 6, 4, 64 * 2), float("nan"), dtype=args[0].dtype, device=DEVICE)
    q_out = big[..., :64].transpose(1, 2)  # [B, Hq, S, D], non-contiguous
    out = qkrope.fused_rope_with_qk_norm_and_kv_cache_update(*args, query_out=q_out)[0]
    assert out is q_out and not torch.isnan(q_out).any()
    assert torch.isnan(big[..., 64:]).all(), "wrote outside the query_out view"


def test_repeated_cache_position_writes_one_of_the_tokens_per_element():
    # Documented contract: each element of a repeated row holds that element of one of the
    # tokens naming it (programs race, so tokens may mix within the row); other rows untouched.
    args = list(make_inputs(Case(S=4, L=8)))
    args[6] = torch.tensor([5, 5, 2, 5], dtype=torch.int64, device=DEVICE)
    kc0, vc0 = args[4].clone(), args[5].clone()
    _, k_rot, kc, vc = qkrope.fused_rope_with_qk_norm_and_kv_cache_update(*args)
    for cache, new in ((kc, k_rot), (vc, args[2])):
        candidates = new[:, :, [0, 1, 3]]                      # [B, H, 3, D]
        assert (cache[:, :, 5:6] == candidates).any(dim=2).all()
        assert torch.equal(cache[:, :, 2], new[:, :, 2])
    untouched = [0, 1, 3, 4, 6, 7]
    assert torch.equal(kc[:, :, untouched], kc0[:, :, untouched])
    assert torch.equal(vc[:, :, untouched], vc0[:, :, untouched])


def test_benchmark_all_ones_weights():
    args = list(make_inputs(Case(S=5)))
    args[7] = torch.ones_like(args[7])
    args[8] = torch.ones_like(args[8])
    run_and_check(tuple(args))


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    B=st.integers(1, 3),
    Hkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 4]),
    S=st.integers(1, 40),
    D=st.sampled_from([64, 128]),
    extra_rows=st.integers(0, 5),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    noncontig=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fused_matches_reference_random_shapes(B, Hkv, group, S, D, extra_rows, dtype,
                                               noncontig, seed):
    # The new rows end at the last cache slot.
    c = Case(B=B, Hq=Hkv * group, Hkv=Hkv, S=S, D=D, L=S + 3 + extra_rows, dtype=dtype,
             noncontig=noncontig, start=3 + extra_rows, seed=seed, max_pos=2**18)
    run_and_check(make_inputs(c))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is turned on only without CUDA")
def test_kernels_run_when_triton_was_imported_before_qkrope():
    # transformers (through torch._inductor) imports triton before a user imports qkrope; the
    # interpreter is then enabled after triton.language exists, and the kernels must still run.
    import os
    import subprocess
    import sys

    code = (
        "import triton.language, torch, sys\n"
        "sys.path.insert(0, 'tests')\n"
        "import qkrope\n"
        "from helpers import Case, make_inputs, run_and_check\n"
        "run_and_check(make_inputs(Case(S=3)))\n"
        "from test_paged import PCase, check\n"
        "check(PCase(T=4))\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=root, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
