"""GPU-only: the 13-workload suite under the suite's correctness rule (docs/spec.md §2), one launch per call, larger shapes."""

import pytest
import torch
from helpers import Case, make_inputs, poisoned_like, run_and_check

import qkrope
import qkrope.suite
from qkrope.suite import MODELS, SUITE, check_outputs
from qkrope.suite import make_inputs as suite_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.big_gpu_memory]


@pytest.mark.parametrize("workload", SUITE, ids=[w.name for w in SUITE])
@pytest.mark.parametrize("weights", ["random", "ones"])
def test_suite_workload_ten_fresh_rounds(workload, weights):
    g = torch.Generator(device="cuda").manual_seed(hash((workload, weights)) % 2**31)
    for _ in range(10):
        args = suite_inputs(workload, device="cuda", generator=g,
                            benchmark_weights=weights == "ones")
        ref = qkrope.reference(*args, inplace=False)
        out = qkrope.run(*args)
        for chk in check_outputs(out, ref, workload.atol):
            assert chk.ok, f"{workload.name}: {chk}"
        del args, ref, out


def test_one_launch_per_call():
    args = suite_inputs(SUITE[6], device="cuda", cache_capacity=4096)
    qkrope.run(*args)  # compile outside the trace
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        qkrope.run(*args)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, [k.name for k in kernels]


@pytest.mark.parametrize("case", [
    Case(B=4, Hq=96, Hkv=8, S=333, D=128, L=4096, start=3000, noncontig=True),
    Case(B=2, Hq=32, Hkv=8, S=1000, D=128, L=2**18, start=2**18 - 1000, max_pos=2**18,
         per_batch_pos=True, expand_pos=False),
    Case(B=3, Hq=16, Hkv=16, S=77, D=256, L=300, dtype=torch.float16, index_dtype=torch.int32),
    Case(B=1, Hq=64, Hkv=4, S=4096, D=64, L=8192, pad_rows=(0, 17, 4095), far_rows=(5,)),
    Case(B=16, Hq=96, Hkv=8, S=1, D=128, L=2**18, start=2**18 - 1),
], ids=["noncontig-96-8", "positions-to-2^18", "fp16-d256-int32", "d64-padding", "decode-b16"])
def test_large_random_shapes(case):
    run_and_check(make_inputs(case, device="cuda"))


def test_cache_larger_than_2_pow_31_elements():
    # [9, 8, 262144, 128] bf16 = 2.4e9 elements per cache: offsets must be 64-bit.
    case = Case(B=9, Hq=16, Hkv=8, S=3, D=128, L=2**18, start=2**18 - 3)
    run_and_check(make_inputs(case, device="cuda"))


@pytest.mark.parametrize("model", list(MODELS))
def test_model_geometries(model):
    w = SUITE[8]
    args = suite_inputs(w, MODELS[model], device="cuda", cache_capacity=4096)
    options = MODELS[model].options()  # partial rotary, (1 + w) norms
    ref = qkrope.reference(*args, inplace=False, **options)
    for chk in check_outputs(qkrope.run(*args, **options), ref, w.atol):
        assert chk.ok, chk


def test_fast_launch_path_is_used_and_respects_specialization():
    # The cached direct launch must only be reused for the exact signature it was compiled
    # for: a misaligned view of the same shape and strides has to take the checked path.
    from qkrope.ops.qknorm_rope.launcher import LAUNCHER

    def plans():  # a plan serves its signature and that with fresh outputs left out
        return len({id(p) for p in LAUNCHER.plans.values()})

    case = Case(B=2, Hq=8, Hkv=2, S=9, D=128, L=64, start=40, noncontig=True)
    args = make_inputs(case, device="cuda")
    LAUNCHER.clear_plans()
    run_and_check(args)
    assert plans() == 1
    run_and_check(args)  # now through the plan (query_out/key_out given: a second signature)
    run_and_check(args, use_out=False)
    n = plans()
    flat = torch.randn(2 * 9 * 12 * 128 + 1, device="cuda", dtype=torch.bfloat16)
    q_misaligned = flat[1:].view(2, 9, 12, 128)[:, :, :8].transpose(1, 2)  # 2-byte offset
    assert q_misaligned.stride() == args[0].stride()
    assert q_misaligned.data_ptr() % 16 != 0
    run_and_check((q_misaligned, *args[1:]), use_out=False)
    assert plans() == n + 1


def test_a_negative_bit_view_of_a_planned_signature_is_refused():
    # A negative-bit view has the sizes and strides of the plain tensor, so the same plan key:
    # the fast path must not launch it (its memory holds the negated values).
    from qkrope.ops.qknorm_rope.launcher import LAUNCHER

    args = make_inputs(Case(B=2, Hq=8, Hkv=2, S=9, D=128, L=64, start=40), device="cuda")
    LAUNCHER.clear_plans()
    run_and_check(args)
    run_and_check(args)  # the plan is made and used
    for i, name in ((1, "key"), (4, "key_cache")):
        call = list(args)
        call[i] = torch._neg_view(args[i].neg() if i == 1 else args[i])
        cache = args[4].clone()
        with pytest.raises(ValueError, match=f"{name} is a negative-bit view"):
            qkrope.run(*call)
        assert torch.equal(args[4], cache), "a refused call wrote the cache"


def test_native_launch_plans_are_used_and_exact():
    """Once the native helpers are built, plans launch through them (cuLaunchKernel from C++)
    under the same rule; also from a thread that never used CUDA (the launcher makes the
    device's primary context current there)."""
    import threading

    from qkrope.ops import _native
    from qkrope.ops.qknorm_rope.checks import Options
    from qkrope.ops.qknorm_rope.launcher import LAUNCHER

    if not _native.enabled():
        pytest.skip("QKROPE_NATIVE=0")
    module = _native.load()
    assert module is not None, _native.status()
    args = make_inputs(Case(B=2, Hq=8, Hkv=2, S=9, D=128, L=64, start=40, noncontig=True),
                       device="cuda")
    LAUNCHER.clear_plans()
    run_and_check(args)  # the checked path makes the plan (kept under several signatures)
    (plan,) = {id(p): p for p in LAUNCHER.plans.values()}.values()
    run_and_check(args)  # through it

    expected = qkrope.run(*args, query_out=poisoned_like(args[0]), key_out=poisoned_like(args[1]))
    q_out, k_out = poisoned_like(args[0]), poisoned_like(args[1])
    no_scales = (None,) * 5  # k/v/q scales, k/v scale caches
    key, addresses = LAUNCHER.signature(Options(rotary_dim=128),  # the canonical options
                                        (*args[:10], *no_scales, q_out, k_out))
    assert LAUNCHER.find(key) is plan
    errors = []

    def worker():
        try:
            plan.launch((*addresses, args[10]))
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert not errors, errors
    torch.cuda.synchronize()
    assert torch.equal(q_out, expected[0]) and torch.equal(k_out, expected[1])


def test_cuda_graph_decode_loop_matches_eager():
    # A captured decode step, replayed with new tokens, positions and cache rows written into
    # the static input tensors: same outputs and caches as eager calls.
    g = torch.Generator(device="cuda").manual_seed(7)
    B, Hq, Hkv, D, L, steps = 4, 16, 4, 128, 64, 8

    def rnd(*s):
        return torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16)

    q, k, v = rnd(B, Hq, 1, D), rnd(B, Hkv, 1, D), rnd(B, Hkv, 1, D)
    pos = torch.zeros(B, 1, dtype=torch.int64, device="cuda")
    row = torch.zeros(1, dtype=torch.int64, device="cuda")
    kc, vc = rnd(B, Hkv, L, D), rnd(B, Hkv, L, D)
    qw, kw = 1 + 0.5 * rnd(D), 1 + 0.5 * rnd(D)
    inv = qkrope.suite.rope_inv_freq(D, 1e7, "cuda")
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)

    def step():
        qkrope.run(q, k, v, pos, kc, vc, row, qw, kw, inv, 1e-6, query_out=q_out, key_out=k_out)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up compiles and caches the launch plan outside capture
    torch.cuda.current_stream().wait_stream(s)
    kc_eager, vc_eager, kc0 = kc.clone(), vc.clone(), kc.clone()  # after the warm-up's write
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for t in range(steps):
        for x in (q, k, v):
            x.copy_(rnd(*x.shape))
        pos.copy_(torch.arange(B, device="cuda")[:, None] * 1000 + 30 + t)
        row.fill_(30 + t)
        graph.replay()
        eq, ek, _, _ = qkrope.run(q, k, v, pos, kc_eager, vc_eager, row, qw, kw, inv, 1e-6)
        assert torch.equal(q_out, eq) and torch.equal(k_out, ek)
    torch.cuda.synchronize()
    assert torch.equal(kc, kc_eager) and torch.equal(vc, vc_eager)
    written = torch.zeros(L, dtype=torch.bool, device="cuda")
    written[30:30 + steps] = True
    assert (kc[:, :, written] != kc0[:, :, written]).any(dim=-1).all(), "a replay missed its row"
    assert torch.equal(kc[:, :, ~written], kc0[:, :, ~written])


def test_a_float_scale_first_seen_in_a_capture_is_right_in_eager_calls_and_replays():
    # A Python-float scale becomes a cached device tensor; one first made inside a CUDA-graph
    # capture is the capture's own (its fill runs only at replays), so it must not be cached for
    # eager calls, and a cached one must never be evicted from under a graph that reads it.
    from test_qknorm_rope import PCase, make

    args, kwargs = make(PCase(T=4, cache_dtype=torch.float8_e4m3fn, seed=21))
    scale = 0.0173  # a value no other test uses: first seen below, in the capture
    kwargs.update(k_scale=0.02, v_scale=0.02)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up: the kernel and its plan, outside the capture
        qkrope.fused_qk_norm_rope_paged(*args, **kwargs)
    torch.cuda.current_stream().wait_stream(s)
    kwargs.update(k_scale=scale, v_scale=scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qkrope.fused_qk_norm_rope_paged(*args, **kwargs)
    kc, vc = args[4], args[5]
    kc.zero_(), vc.zero_()
    want = qkrope.reference_paged(*args, **kwargs)
    qkrope.fused_qk_norm_rope_paged(*args, **kwargs)  # eager, after the capture
    torch.cuda.synchronize()
    assert torch.equal(vc.view(torch.uint8), want[3].view(torch.uint8))
    kc.zero_(), vc.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(vc.view(torch.uint8), want[3].view(torch.uint8))
