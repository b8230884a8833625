"""``append=True``: the cache rows from a running length that the launch advances (HF's
StaticLayer bookkeeping in the op's own launch; docs/design.md, "Appending at a running
length"). Every check is against the same op with the rows spelled out: the same kernel must
give the same bits, write exactly those rows, and leave the length advanced by S."""

import subprocess
import sys

import pytest
import torch
from helpers import DEVICE, ON_GPU, Case, make_inputs, poisoned_like

import qkrope
from qkrope.ops.qknorm_rope import rope_cos_sin
from qkrope.ops.qknorm_rope.checks import Options
from qkrope.ops.qknorm_rope.registration import options_key


def _length(n: int, shape=()) -> torch.Tensor:
    return torch.full(shape, n, dtype=torch.int64, device=DEVICE)


def _both(case: Case, n: int, shape=(), **kw):
    """The op with ``append=True`` at running length ``n`` and with rows n .. n + S - 1 given,
    on copies of one input set: ``(inputs, [(q_rot, k_rot, key_cache, value_cache)] for the
    two calls, the running length after the first)``."""
    args = make_inputs(case)
    S = args[0].shape[2]
    runs = []
    length = _length(n, shape)
    for rows, extra in ((length, dict(append=True)),
                        (torch.arange(n, n + S, device=DEVICE), {})):
        kc, vc = args[4].clone(), args[5].clone()
        out = qkrope.fused_rope_with_qk_norm_and_kv_cache_update(
            *args[:4], kc, vc, rows, *args[7:], query_out=poisoned_like(args[0]),
            key_out=poisoned_like(args[1]), **extra, **kw)
        runs.append((out[0], out[1], kc, vc))
    return args, runs, length


@pytest.mark.parametrize("case, n", [
    (Case(B=3, S=1, Hq=8, Hkv=2, D=128, L=16), 5),           # a decode step
    (Case(B=3, S=40, Hq=4, Hkv=2, D=64, L=48), 8),            # several programs take tickets
    (Case(B=2, S=4, L=12), 8),                                 # up to the last cache slot
    (Case(B=2, S=7, noncontig=True, per_batch_pos=True, expand_pos=False), 0),
], ids=["decode", "prefill_many_programs", "last_slot", "strided_from_empty"])
@pytest.mark.parametrize("shape", [(), (1,)], ids=["0d", "1elem"])
def test_append_is_the_op_at_rows_n_to_n_plus_s(case, n, shape):
    args, (appended, explicit), length = _both(case, n, shape)
    for name, a, b in zip(("query_rotated", "key_rotated", "key_cache", "value_cache"),
                          appended, explicit):
        assert torch.equal(a, b), name  # same kernel, same rows: the same bits
    assert length.shape == shape and int(length.reshape(())) == n + case.S
    untouched = torch.ones(case.L, dtype=torch.bool, device=DEVICE)
    untouched[n:n + case.S] = False
    assert torch.equal(appended[2][:, :, untouched], args[4][:, :, untouched])
    assert torch.equal(appended[3][:, :, untouched], args[5][:, :, untouched])


def test_consecutive_appends_fill_the_cache_as_one_call():
    # A prefill of 5 then three decode steps: the cache holds what one call of 8 rows writes.
    case = Case(B=2, S=8, Hq=4, Hkv=2, D=64, L=10, per_batch_pos=True, expand_pos=False)
    args = make_inputs(case)
    kc, vc, length = args[4].clone(), args[5].clone(), _length(0)
    for lo, hi in ((0, 5), (5, 6), (6, 7), (7, 8)):
        piece = [x[:, :, lo:hi] for x in args[:3]]
        qkrope.fused_rope_with_qk_norm_and_kv_cache_update(
            *piece, args[3][:, lo:hi], kc, vc, length, *args[7:], append=True)
    assert int(length) == 8
    want = qkrope.reference(*args[:6], torch.arange(8, device=DEVICE), *args[7:],
                            inplace=False)
    assert torch.equal(kc, want[2]) and torch.equal(vc, want[3])


def test_oracle_append_matches_the_op():
    args = make_inputs(Case(B=2, S=5, L=9))
    length, ref_length = _length(3), _length(3)
    kc, vc = args[4].clone(), args[5].clone()
    out = qkrope.fused_rope_with_qk_norm_and_kv_cache_update(*args[:4], kc, vc, length,
                                                             *args[7:], append=True)
    ref = qkrope.reference(*args[:6], ref_length, *args[7:], append=True, inplace=True)
    assert torch.equal(out[2], ref[2]) and torch.equal(out[3], ref[3])
    assert (out[0] == ref[0]).float().mean() > 0.99 and int(length) == int(ref_length) == 8


def test_inv_freq_in_bf16_or_fp16_is_read_as_its_float32():
    # model.to(bf16) casts the rotary buffer; the op reads it as HF's forward does (.float()).
    args = make_inputs(Case(S=6))
    for dtype in (torch.bfloat16, torch.float16):
        low = args[9].to(dtype)
        outs = [qkrope.fused_rope_with_qk_norm_and_kv_cache_update(
            *args[:4], args[4].clone(), args[5].clone(), args[6], *args[7:9], inv, args[10])
            for inv in (low, low.float())]
        for a, b in zip(outs[0], outs[1]):
            assert torch.equal(a, b), dtype
        tables = [rope_cos_sin(args[3], inv, torch.bfloat16) for inv in (low, low.float())]
        assert all(torch.equal(a, b) for a, b in zip(*tables))


def _call(args, length, **kw):
    return qkrope.fused_rope_with_qk_norm_and_kv_cache_update(*args[:6], length, *args[7:],
                                                              append=True, **kw)


@pytest.mark.parametrize("length, kw, exc, words", [
    (torch.tensor([1, 2]), {}, ValueError, "cache_position must be one element"),
    (torch.tensor(1, dtype=torch.int32), {}, TypeError, "cache_position"),
    (torch.zeros(1, 1, dtype=torch.int64), {}, ValueError, "cache_position must have rank 0 or 1"),
    (torch.tensor(0), dict(inplace=False), ValueError, "inplace=False"),
    (torch.tensor(0), dict(append=1), TypeError, "append must be a Python bool"),
], ids=["two_elements", "int32", "rank2", "copies", "not_bool"])
def test_bad_append_calls_are_named(length, kw, exc, words):
    args = make_inputs(Case(S=3, L=8))
    kc0 = args[4].clone()
    kw = dict(kw)
    append = kw.pop("append", True)
    with pytest.raises(exc, match=words):
        qkrope.fused_rope_with_qk_norm_and_kv_cache_update(
            *args[:6], length.to(DEVICE), *args[7:], append=append, **kw)
    assert torch.equal(args[4], kc0)


def test_more_new_rows_than_the_cache_holds_is_refused():
    args = make_inputs(Case(S=7, L=5))
    with pytest.raises(ValueError, match="S=7 new rows do not fit key_cache's L=5"):
        _call(args, _length(0))


def test_a_running_length_that_overlaps_another_argument_is_refused():
    args = list(make_inputs(Case(S=3, L=8)))
    args[3] = torch.zeros(args[0].shape[0], 3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="cache_position"):  # it would move the positions
        _call(args, args[3][0, :1])


@pytest.mark.parametrize("n", [-1, 6, 2**32 + 1])
def test_validate_names_a_running_length_without_room(n):
    args = make_inputs(Case(S=3, L=8))
    kc0, length = args[4].clone(), _length(n)
    with pytest.raises(ValueError, match=f"cache_position .*is {n}: 3 new rows do not fit"):
        _call(args, length, validate=True)
    assert torch.equal(args[4], kc0) and int(length) == n


def test_the_registered_ops_refuse_the_other_ones_options():
    args = make_inputs(Case(S=2, L=8))
    q_out, k_out = torch.empty_like(args[0]), torch.empty_like(args[1])
    tail = (*args[7:10], *(None,) * 5, q_out, k_out, 1e-6)
    with pytest.raises(ValueError, match="takes options without append=True"):
        torch.ops.qkrope.qknorm_rope(*args[:6], _length(0), *tail,
                                     options_key(Options(rotary_dim=64, append=True)))
    with pytest.raises(ValueError, match="takes options with append=True"):
        torch.ops.qkrope.qknorm_rope_append(*args[:6], _length(0), *tail,
                                            options_key(Options(rotary_dim=64)))


@pytest.mark.skipif(ON_GPU, reason="the interpreter's check; on a GPU the device assert "
                                   "(test_a_full_cache_is_a_device_side_assert)")
@pytest.mark.parametrize("n", [-1, 6, 2**32 + 1])
def test_a_full_cache_raises_in_the_interpreter_before_writing(n):
    args = make_inputs(Case(S=3, L=8))
    kc0, length = args[4].clone(), _length(n)
    with pytest.raises(IndexError, match=f"is {n}: 3 new rows do not fit a cache of 8 rows"):
        _call(args, length)
    assert torch.equal(args[4], kc0) and int(length) == n


_FULL = """
import sys, torch, qkrope
sys.path.insert(0, "tests")
from helpers import Case, make_inputs
args = make_inputs(Case(S=3, L=8))
n = torch.full((), int(sys.argv[1]), dtype=torch.int64, device="cuda")
qkrope.fused_rope_with_qk_norm_and_kv_cache_update(*args[:6], n, *args[7:], append=True)
torch.cuda.synchronize()
print("no error", int(n))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("n", [-1, 6, 2**32 + 1])
def test_a_full_cache_is_a_device_side_assert(n):
    # As the stock StaticLayer's index_copy_ on a GPU: the assert ends the CUDA context, so
    # each call runs in a process of its own.
    run = subprocess.run([sys.executable, "-c", _FULL, str(n)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode != 0 and "device-side assert" in run.stderr, run
    # (the assert's own message comes through the device's printf: on stdout or stderr)
    assert "cache_position (append=True" in run.stdout + run.stderr, run


def test_compiled_appends_advance_the_length_for_what_reads_it_next():
    # Two appends in one graph, then a read of the length: torch.compile must order the reads
    # after the op's declared write (qkrope::qknorm_rope_append), as the eager calls do.
    args = make_inputs(Case(B=2, S=2, L=8, seed=9))

    def two_steps(length, kc, vc):
        for i in range(2):
            qkrope.fused_rope_with_qk_norm_and_kv_cache_update(
                *(x[:, :, i:i + 1] for x in args[:3]), args[3][:, i:i + 1], kc, vc, length,
                *args[7:], append=True)
        return length + 0

    results = []
    for fn in (two_steps, torch.compile(two_steps, fullgraph=True)):
        torch._dynamo.reset()
        length, kc, vc = _length(4), args[4].clone(), args[5].clone()
        results.append((fn(length, kc, vc), length, kc, vc))
    (got_after, got_len, got_k, got_v), (want_after, want_len, want_k, want_v) = results[1], \
        results[0]
    assert int(got_after) == int(want_after) == 6 and int(got_len) == int(want_len) == 6
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@pytest.mark.gpu
def test_a_cuda_graph_of_an_append_advances_at_every_replay():
    case = Case(B=2, S=1, Hq=8, Hkv=2, D=128, L=8)
    args = make_inputs(case)
    kc, vc, length = args[4].clone(), args[5].clone(), _length(0)
    q_out, k_out = torch.empty_like(args[0]), torch.empty_like(args[1])

    def step():
        qkrope.fused_rope_with_qk_norm_and_kv_cache_update(
            *args[:4], kc, vc, length, *args[7:], append=True, query_out=q_out,
            key_out=k_out)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()  # warm: compile, plan
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    length.zero_()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert int(length) == 3
    for row in range(3):
        assert torch.equal(kc[:, :, row:row + 1], k_out) and torch.equal(vc[:, :, row:row + 1],
                                                                         args[2])
