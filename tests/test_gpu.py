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


def _real_width_rotaries():
    """Qwen3-8B's rotary (128-dim heads, theta 1e6) and Qwen3.5-27B's (64 of 256 dims rotated,
    theta 1e7, interleaved mRoPE), as transformers builds them."""
    transformers = pytest.importorskip("transformers")
    qwen3 = transformers.Qwen3Config(head_dim=128, rope_parameters={
        "rope_type": "default", "rope_theta": 1e6}, max_position_embeddings=40960)
    qwen35 = transformers.Qwen3_5TextConfig(head_dim=256, rope_parameters={
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding
    return {"qwen3": Qwen3RotaryEmbedding(qwen3).cuda(),
            "qwen3.5": Qwen3_5TextRotaryEmbedding(qwen35).cuda()}


@pytest.mark.parametrize("name", ["qwen3", "qwen3.5"])
def test_rotary_table_equals_the_stock_forward_at_every_position(name):
    # Every position below 2**17 (angles to 1.3e5 rad), bf16 tables: the stock forward of the
    # installed transformers (a batched matmul in 5.17, a product later) against the table.
    from qkrope.ops.qknorm_rope import rope_cos_sin

    rot = _real_width_rotaries()[name]
    pos = torch.arange(2**17, device="cuda")[None]
    section = None
    if name == "qwen3.5":
        half = rot.inv_freq.shape[0]
        section = (half - rot.mrope_section[1] - rot.mrope_section[2], *rot.mrope_section[1:])
        pos = torch.stack([pos, pos.flip(-1), (pos * 7) % 2**17])
    x = torch.zeros(1, dtype=torch.bfloat16, device="cuda")
    want = rot(x, pos)
    got = rope_cos_sin(pos, rot.inv_freq.float(), torch.bfloat16,
                       cos_sin_scale=rot.attention_scaling, mrope_section=section,
                       mrope_interleaved=section is not None)
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.equal(g, w)


def test_patched_rotary_is_one_native_launch():
    # The patched eager rotary embedding: the table's one kernel (plus the bf16 buffer's fp32
    # conversion), launched natively once the helpers are loaded; the stock forward runs ~10.
    from qkrope.integrations.transformers import patch
    from qkrope.ops import _native
    from qkrope.ops.qknorm_rope.launcher import COS_SIN_LAUNCHER

    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(vocab_size=128, hidden_size=256, intermediate_size=256,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=128)
    model = transformers.Qwen3ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    rot = model.model.rotary_emb
    x = torch.zeros(1, dtype=torch.bfloat16, device="cuda")
    pos = torch.arange(5, 9, device="cuda")[None]

    def kernels():
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            with torch.no_grad():
                out = rot(x, pos)
            torch.cuda.synchronize()
        return out, [e.name for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA]

    want, stock = kernels()
    patch(model)
    if _native.enabled():
        _native.load(timeout=300)
    rot(x, pos)  # the table's first call of this signature: checked, then planned
    got, patched = kernels()
    assert len(stock) >= 8 and len(patched) <= 2, (stock, patched)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    if _native.module() is not None:
        assert COS_SIN_LAUNCHER.plans
