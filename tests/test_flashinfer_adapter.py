"""FlashInfer's fused op as a ``qkrope bench`` peer (qkrope/bench/flashinfer.py): its input forms
derived from the bench's paged inputs follow FlashInfer's position/slot rules exactly, inputs it
cannot express are refused, and on the CPU a torch model of FlashInfer's documented op
(tests/test_flashinfer_h2h.py) passes the bench's correctness check through the adapter, while
a planted position bug fails it. On a GPU with FlashInfer installed, the real op runs through
``run_benchmark``."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from test_flashinfer_h2h import fake_flashinfer

from qkrope.bench import flashinfer as fi
from qkrope.bench import impls as bench_impls
from qkrope.bench.runner import _check, run_benchmark
from qkrope.suite import MODELS, ModelGeometry, Workload, make_paged_inputs

# FlashInfer's second head configuration (8, 1) keeps the CPU quick; Qwen3-32B's RoPE constants.
SMALL = replace(MODELS["qwen3-32b"], name="fi-8-1", num_q_heads=8, num_kv_heads=1)
WORKLOADS = {"decode": Workload(1, 0, 6, 1e-5), "prefill": Workload(37, 0, 1, 9.8e-3),
             "prefill-after-cache": Workload(21, 19, 1, 9.8e-3)}


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU model of FlashInfer's op")
@pytest.mark.parametrize("name", list(WORKLOADS))
@pytest.mark.parametrize("shift", [0, -1], ids=["faithful", "planted-position-bug"])
def test_bench_check_through_the_adapter(name, shift):
    layout = bench_impls.LAYOUTS["paged"]
    args = inputs(name, seed=3)
    ref = layout.reference(args)
    peer = fi.FlashInferPaged(functools.partial(fake_flashinfer, position_shift=shift))
    call_args = bench_impls.with_fresh_caches(args)
    out = peer(*call_args)
    assert out[1] is None and out[2] is call_args[4]  # no rotated K: checked through the cache
    assert _check(out, ref, WORKLOADS[name].atol).correct is (shift == 0)
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
