"""FlashInfer's fused op as a ``qkrope bench`` peer (qkrope/bench/flashinfer.py): its input forms
derived from the bench's paged inputs follow FlashInfer's position/slot rules exactly, inputs it
cannot express are refused, and on the CPU a torch model of FlashInfer's documented op
(:func:`fake_flashinfer`) passes the bench's correctness check through the adapter, while a
planted position bug fails it. On a GPU with FlashInfer installed, the real op runs through
``run_benchmark``."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from qkrope.bench import flashinfer as fi
from qkrope.bench import impls as bench_impls
from qkrope.bench.runner import check_result, run_benchmark
from qkrope.suite import MODELS, ModelGeometry, Workload, make_paged_inputs

# FlashInfer's second head configuration (8, 1) keeps the CPU quick; Qwen3-32B's RoPE constants.
SMALL = replace(MODELS["qwen3-32b"], name="fi-8-1", num_q_heads=8, num_kv_heads=1)
WORKLOADS = {"decode": Workload(1, 0, 6, 1e-5), "prefill": Workload(37, 0, 1, 9.8e-3),
             "prefill-after-cache": Workload(21, 19, 1, 9.8e-3)}


def fake_flashinfer(qkv, cos_sin, seq_lens, q_indptr, page_indices, key_cache, value_cache, *,
                    num_q_heads, num_kv_heads, qk_norm_policy=0, q_norm_weight=None,
                    k_norm_weight=None, eps=1e-6, out_q=None, out_k=None, out_v=None,
                    clear_unused_last_page_rows=True, enable_pdl=False, position_shift=0):
    """FlashInfer's op as its docstring specifies it (argument checks of its backend included),
    written from q_indptr/seq_lens/page_indices, not from the bench's slots (FlashInfer's kernel
    is SM90+ only: this CPU stand-in replaces it here).
    ``position_shift`` plants a bug (rows rotated and written one position off)."""
    D = 128
    assert qkv.dtype == torch.bfloat16 and qkv.dim() == 2
    assert qkv.shape[1] == (num_q_heads + 2 * num_kv_heads) * D
    assert cos_sin.dtype == torch.float32 and cos_sin.shape[1] == D
    for t in (seq_lens, q_indptr, page_indices):
        assert t.dtype == torch.int32
    assert q_indptr.shape[0] == seq_lens.shape[0] + 1 and page_indices.dim() == 2
    for w in (q_norm_weight, k_norm_weight):
        assert w.dtype == torch.float32 and tuple(w.shape) == (D,)
    for t in (qkv, cos_sin, seq_lens, q_indptr, page_indices, key_cache, value_cache,
              q_norm_weight, k_norm_weight):
        assert t.is_contiguous()
    assert qk_norm_policy == 2 and out_k is None and out_v is None
    T, ps = qkv.shape[0], key_cache.shape[1]
    rows = torch.arange(T)
    req = torch.searchsorted(q_indptr[1:].long(), rows, right=True)
    pos = rows + seq_lens.long()[req] - q_indptr.long()[req + 1] + position_shift
    q, k, v = qkv.view(T, num_q_heads + 2 * num_kv_heads, D).split(
        [num_q_heads, num_kv_heads, num_kv_heads], dim=1)
    cos, sin = cos_sin[pos, :64][:, None], cos_sin[pos, 64:][:, None]

    def norm_rope(x, w):
        xf = x.float()
        n = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w
        a, b = n[..., :64], n[..., 64:]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), -1).to(torch.bfloat16)

    page = page_indices.long()[req, pos // ps]
    key_cache[page, pos % ps] = norm_rope(k, k_norm_weight)
    value_cache[page, pos % ps] = v
    if clear_unused_last_page_rows:
        for b in range(seq_lens.shape[0]):
            last = (int(seq_lens[b]) - 1) // ps
            first_unused = (int(seq_lens[b]) - 1) % ps + 1
            key_cache[page_indices[b, last], first_unused:] = 0
            value_cache[page_indices[b, last], first_unused:] = 0
    q_rot = norm_rope(q, q_norm_weight)
    if out_q is None:
        return q_rot
    out_q.copy_(q_rot)
    return out_q


def inputs(name, geometry=SMALL, seed=0):
    g = torch.Generator().manual_seed(seed)
    return make_paged_inputs(WORKLOADS[name], geometry, device="cpu", generator=g)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_inputs_follow_flashinfers_rules(name):
    args = inputs(name)
    q, k, v, positions, key_cache, _, slots, q_w, k_w, inv_freq, _ = args
    f = fi.flashinfer_inputs(q, k, v, positions, slots, q_w, k_w, inv_freq)
    T, ps = q.shape[0], key_cache.shape[1]
    # FlashInfer's documented rule, row by row.
    indptr, seq_lens, table = f.q_indptr.tolist(), f.seq_lens.tolist(), f.page_indices.long()
    for row in range(T):
        b = next(r for r in range(len(seq_lens)) if indptr[r] <= row < indptr[r + 1])
        pos = row + seq_lens[b] - indptr[b + 1]
        assert pos == int(positions[row])
        assert int(table[b, pos // ps]) * ps + pos % ps == int(slots[row])
    assert len(seq_lens) == (T if name == "decode" else 1)
    assert torch.equal(f.qkv.view(T, -1, q.shape[-1]), torch.cat((q, k, v), 1))
    assert f.qkv.is_contiguous() and f.qkv.dtype == torch.bfloat16
    angle = positions[-1].float() * inv_freq
    torch.testing.assert_close(f.cos_sin[int(positions[-1])], torch.cat((angle.cos(), angle.sin())))
    for t in (f.seq_lens, f.q_indptr, f.page_indices):
        assert t.dtype == torch.int32
    assert f.q_norm_weight.dtype == f.k_norm_weight.dtype == torch.float32


def test_sequences_at_adjacent_positions_stay_separate_requests():
    q, k, v, positions, _, _, slots, q_w, k_w, inv_freq, _ = inputs("decode")
    positions, slots = positions.clone(), slots.clone()
    positions[3] = positions[2] + 1 if int(positions[2]) % 16 != 15 else positions[2] - 1
    slots[3] = slots[3] // 16 * 16 + positions[3] % 16  # its own block, as the bench gives
    f = fi.flashinfer_inputs(q, k, v, positions, slots, q_w, k_w, inv_freq)
    assert f.q_indptr.tolist() == list(range(q.shape[0] + 1))


def test_slots_that_no_page_table_gives_are_refused():
    q, k, v, positions, _, _, slots, q_w, k_w, inv_freq, _ = inputs("decode")
    slots = slots.clone()
    slots[2] += 1 if int(positions[2]) % 16 != 15 else -1  # off its position's page offset
    with pytest.raises(ValueError, match="page"):
        fi.flashinfer_inputs(q, k, v, positions, slots, q_w, k_w, inv_freq)


def test_heads_flashinfer_does_not_ship_are_refused():
    geometry = ModelGeometry("x", 16, 2, 128)
    q, k, v, positions, _, _, slots, q_w, k_w, inv_freq, _ = inputs("decode", geometry)
    with pytest.raises(ValueError, match="qwen3-32b"):
        fi.flashinfer_inputs(q, k, v, positions, slots, q_w, k_w, inv_freq)


def _call_stand_in(args, clear=False):
    q, k, v, positions, key_cache, value_cache, slots, q_w, k_w, inv_freq, eps = args
    f = fi.flashinfer_inputs(q, k, v, positions, slots, q_w, k_w, inv_freq)
    kc, vc = key_cache.clone(), value_cache.clone()
    out = fake_flashinfer(f.qkv, f.cos_sin, f.seq_lens, f.q_indptr, f.page_indices, kc, vc,
                          num_q_heads=q.shape[1], num_kv_heads=k.shape[1], qk_norm_policy=2,
                          q_norm_weight=f.q_norm_weight, k_norm_weight=f.k_norm_weight, eps=eps,
                          clear_unused_last_page_rows=clear)
    return out.view(q.shape), kc, vc


def test_stand_in_clears_the_rest_of_the_last_page():
    """FlashInfer's default (``clear_unused_last_page_rows=True``) zeroes each request's last
    page past its last token; the bench times it with False, the same work as qkrope's op."""
    args = inputs("decode")
    _, kc, vc = _call_stand_in(args, clear=True)
    ps = kc.shape[1]
    for t in range(args[0].shape[0]):
        page, off = divmod(int(args[6][t]), ps)
        assert (kc[page, off + 1:] == 0).all() and (vc[page, off + 1:] == 0).all()
        assert torch.equal(vc[page, off], args[2][t])


def test_stand_in_rounds_once_closer_to_the_exact_result():
    """FlashInfer's norm and rotation in fp32 with one rounding: closer to an fp64 evaluation
    than the eager bf16 rounding chain of the reference, so not bit-identical to it (~60% of
    elements on the H200: BENCHMARKS.md, FlashInfer)."""
    args = inputs("prefill", seed=1)
    q, positions, q_w, inv_freq, eps = args[0], args[3], args[7], args[9], args[10]
    q_fi, _, _ = _call_stand_in(args)
    q_ref = bench_impls.LAYOUTS["paged"].reference(args)[0]
    x = q.double()
    n = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * q_w.double()
    angle = positions.double()[:, None] * inv_freq.double()
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    a, b = n[..., :64], n[..., 64:]
    exact = torch.cat((a * cos - b * sin, b * cos + a * sin), -1)
    err_fi = (q_fi.double() - exact).abs().max()
    err_ref = (q_ref.double() - exact).abs().max()
    assert err_fi <= err_ref
    assert not torch.equal(q_fi, q_ref)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU model of FlashInfer's op")
@pytest.mark.parametrize("name", list(WORKLOADS))
@pytest.mark.parametrize("shift", [0, -1], ids=["faithful", "planted-position-bug"])
def test_bench_check_through_the_adapter(name, shift):
    layout = bench_impls.LAYOUTS["paged"]
    args = inputs(name, seed=3)
    ref = layout.reference(args)
    peer = fi.FlashInferPaged(functools.partial(fake_flashinfer, position_shift=shift))
    call_args = bench_impls.fresh_arguments(args)
    out = peer(*call_args)
    assert out[1] is None and out[2] is call_args[4]  # no rotated K: checked through the cache
    omits = bench_impls.PAGED_IMPLS["flashinfer"].omits
    assert check_result(out, ref, WORKLOADS[name].atol, omits).correct is (shift == 0)
    assert peer(*call_args)[0].shape == args[0].shape  # the second call reuses the inputs
    assert peer._args[0] is call_args[0]


def test_flashinfer_is_named_not_default_and_says_why_when_absent():
    assert "flashinfer" not in bench_impls.default_impls("paged")
    assert "flashinfer" not in bench_impls.default_impls("bhsd")
    assert "--layout paged" in bench_impls.peer_unavailable("flashinfer", "bhsd")
    if fi.unavailable() is not None:
        assert bench_impls.peer_unavailable("flashinfer", "paged") == fi.unavailable()


@pytest.mark.gpu
@pytest.mark.skipif(fi.unavailable() is not None, reason="needs FlashInfer and a CUDA GPU")
def test_real_flashinfer_in_a_paged_bench_run():
    report = run_benchmark([Workload(1, 0, 8, 1e-5), Workload(512, 0, 1, 9.8e-3)],
                           MODELS["qwen3-32b"], ["qkrope", "flashinfer"], layout="paged",
                           iters=5, warmup=2, host_calls=20, graphs=False)
    for w in report.workloads:
        assert w.impls["qkrope"].correct and w.impls["flashinfer"].correct, w.impls
