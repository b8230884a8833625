"""The registered custom op: torch.compile(fullgraph=True) without graph breaks or cache
copies, and torch.library.opcheck."""

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from helpers import Case, make_inputs

import qkrope
from qkrope.ops.qknorm_rope.checks import Options
from qkrope.ops.qknorm_rope.registration import options_key


NO_SCALES = (None,) * 5  # k/v/q scales, k/v per-token-head scale caches


def op(*args, **kw):
    return qkrope.fused_rope_with_qk_norm_and_kv_cache_update(*args, **kw)


@pytest.mark.parametrize("use_out", [False, True])
def test_compile_fullgraph_writes_caches_in_place(use_out):
    args = make_inputs(Case(S=6, seed=3))
    ref = qkrope.reference(*args, inplace=False)
    torch._dynamo.reset()
    kw = dict(query_out=torch.empty_like(args[0]), key_out=torch.empty_like(args[1])) \
        if use_out else {}
    out = torch.compile(op, fullgraph=True)(*args, **kw)
    assert out[2] is args[4] and out[3] is args[5], "compiled call must return the given caches"
    assert torch.equal(out[2], ref[2]) and torch.equal(out[3], ref[3])
    assert (out[0] == ref[0]).float().mean() > 0.99 and (out[1] == ref[1]).float().mean() > 0.99


def test_compile_no_mutation_mode():
    args = make_inputs(Case(S=4, seed=4))
    kc0 = args[4].clone()
    torch._dynamo.reset()
    out = torch.compile(lambda *a: op(*a, inplace=False), fullgraph=True)(*args)
    assert torch.equal(args[4], kc0) and not torch.equal(out[2], kc0)


def _eager_call(entry, args, **kw) -> tuple:
    """``entry``'s eager call on copies of the caches in ``args``: (q_rot, k_rot, key_cache,
    value_cache). A compiled call runs the same kernel: it must give the same bits."""
    args = (*args[:4], args[4].clone(), args[5].clone(), *args[6:])
    out = entry(*args, **kw)
    return (*out[:2], args[4], args[5])


@pytest.mark.parametrize("entry", ["bhsd", "paged"])
def test_dynamic_shapes_compile_one_graph_for_every_length(entry):
    # torch.compile(dynamic=True), or the automatic dynamic shapes a second prefill length
    # turns on: the checks must judge symbolic sizes without pinning them (one graph for every
    # length, as for the stock model) and take scalar options that arrive as symbols (passed
    # to the compiled function: dynamic=True traces ints and floats as symbols too).
    from test_qknorm_rope import PCase, make

    backend = CompileCounter()  # graphs compiled: its frame_count
    torch._dynamo.reset()
    if entry == "bhsd":
        f = torch.compile(lambda *a, eps, rot: op(*a[:10], eps, rotary_dim=rot), backend=backend,
                          fullgraph=True, dynamic=True)
    else:
        f = torch.compile(lambda *a, eps, rot: qkrope.fused_qk_norm_rope_paged(
            *a[:10], eps, rotary_dim=rot), backend=backend, fullgraph=True, dynamic=True)
    for n in (5, 7, 12):
        if entry == "bhsd":
            args = make_inputs(Case(S=n, seed=n))
            eager = _eager_call(op, args, rotary_dim=64)
        else:
            args, _ = make(PCase(T=n, seed=n))
            eager = _eager_call(qkrope.fused_qk_norm_rope_paged, args, rotary_dim=64)
        out = f(*args, eps=args[10], rot=64)
        for o, e in zip((*out[:2], args[4], args[5]), eager):
            assert torch.equal(o, e), n
    assert backend.frame_count == 1
    # A scalar option is part of the op's specialisation: another value compiles again.
    f(*args, eps=1e-5, rot=64)
    assert backend.frame_count == 2


def test_token_count_marked_dynamic_as_serving_engines_do():
    # vLLM compiles its model once with the token count marked dynamic (mark_dynamic on dim 0)
    # and raises if anything pins it; the paged op on a packed projection must leave T free.
    from test_qknorm_rope import PCase, make

    backend = CompileCounter()
    torch._dynamo.reset()
    f = torch.compile(lambda qkv, *a: qkrope.fused_qkv_norm_rope_paged(qkv, 4, 2, *a),
                      backend=backend, fullgraph=True)
    for T in (11, 5, 17):
        args, _ = make(PCase(T=T, seed=T))
        qkv = torch.cat([x.reshape(T, -1) for x in args[:3]], 1)
        for t in (qkv, args[3], args[6]):
            torch._dynamo.mark_dynamic(t, 0)
        eager = _eager_call(qkrope.fused_qk_norm_rope_paged, args)
        out = f(qkv, *args[3:])
        for o, e in zip((*out, args[4], args[5]), eager):
            assert torch.equal(o, e), T
    assert backend.frame_count == 1


def test_opcheck():
    args = make_inputs(Case(S=3, seed=5))
    outs = (torch.empty_like(args[0]), torch.empty_like(args[1]))
    torch.library.opcheck(torch.ops.qkrope.qknorm_rope.default,
                          (*args[:10], *NO_SCALES, *outs, args[10],
                           options_key(Options(rotary_dim=args[0].shape[-1]))))


def test_a_direct_call_of_the_registered_op_is_checked_when_traced():
    # The HF integration's compiled layers call the registered op itself (the public
    # function's checks, traced, would be guards of every compiled step); the op's fake runs
    # the same checks at trace time, with the eager message naming the argument.
    args = list(make_inputs(Case(S=3, seed=6)))
    outs = (torch.empty_like(args[0]), torch.empty_like(args[1]))
    key = options_key(Options(rotary_dim=args[0].shape[-1]))
    direct = torch.compile(lambda *a: torch.ops.qkrope.qknorm_rope(*a), fullgraph=True)
    for i, bad, words in ((5, args[5].to(torch.float16), "value_cache must be"),
                          (7, args[7][:-1], r"q_norm_weight must have shape"),
                          (6, args[6][:2], r"cache_position must have shape")):
        torch._dynamo.reset()
        kc = args[4].clone()
        call = (*args[:i], bad, *args[i + 1:10])
        with pytest.raises(Exception, match=words):
            direct(*call, *NO_SCALES, *outs, args[10], key)
        assert torch.equal(args[4], kc), "a refused call wrote the cache"
    torch._dynamo.reset()
    want = _eager_call(op, args)
    direct(*args[:10], *NO_SCALES, *outs, args[10], key)  # a valid call: the eager bits
    assert all(torch.equal(a, b) for a, b in zip((*outs, args[4], args[5]), want))


def test_a_direct_eager_call_of_the_registered_op_is_checked():
    # torch.ops.qkrope.qknorm_rope called directly, not compiled (as an engine calls its
    # registered ops): the public functions' checks run before the launch. Without them a
    # cache of too few heads was written out of bounds (heap corruption on the CPU).
    args = list(make_inputs(Case(S=3, seed=7)))
    outs = (torch.empty_like(args[0]), torch.empty_like(args[1]))
    key = options_key(Options(rotary_dim=args[0].shape[-1]))
    direct = torch.ops.qkrope.qknorm_rope
    for i, bad, words in ((4, args[4][:, :1].clone(), "key_cache must have shape"),
                          (5, args[5].to(torch.float16), "value_cache must be"),
                          (9, args[9][:-1], "inv_freq must have shape"),
                          (7, args[7].detach().requires_grad_(), "q_norm_weight requires grad")):
        kc, vc = args[4].clone(), args[5].clone()
        call = (*args[:i], bad, *args[i + 1:10])
        with pytest.raises((TypeError, ValueError, RuntimeError), match=words):
            direct(*call, *NO_SCALES, *outs, args[10], key)
        assert torch.equal(args[4], kc) and torch.equal(args[5], vc), "a refused call wrote"
    want = _eager_call(op, args)
    direct(*args[:10], *NO_SCALES, *outs, args[10], key)
    assert all(torch.equal(a, b) for a, b in zip((*outs, args[4], args[5]), want))


def test_eager_path_does_not_use_the_dispatcher(monkeypatch):
    # Eager calls must not pay for the custom op: make the dispatcher's entry fail.
    class Refuse:
        def __getattr__(self, name):
            raise AssertionError("an eager call went through the dispatcher")

        def __call__(self, *args, **kwargs):
            raise AssertionError("an eager call went through the dispatcher")

    monkeypatch.setattr(torch.ops, "qkrope", Refuse())
    op(*make_inputs(Case(S=2)))
    args = make_inputs(Case(S=2, seed=1))
    op(*args)


@pytest.mark.parametrize("fp8", [False, True])
def test_paged_op_compiles_fullgraph_and_writes_caches(fp8):
    from test_qknorm_rope import PCase, make

    c = PCase(cache_dtype=torch.float8_e4m3fn if fp8 else None, seed=6)
    args, kwargs = make(c)
    ref = qkrope.reference_paged(*args, **kwargs)
    kc_ref, vc_ref = ref[2], ref[3]
    ref = ref[:2]
    torch._dynamo.reset()
    out = torch.compile(lambda *a: qkrope.fused_qk_norm_rope_paged(*a, **kwargs),
                        fullgraph=True)(*args)
    for o, r in zip(out, ref):
        assert (o == r).float().mean() > 0.99
    assert torch.equal(args[4].view(torch.uint8), kc_ref.view(torch.uint8))
    assert torch.equal(args[5].view(torch.uint8), vc_ref.view(torch.uint8))


def test_paged_opcheck():
    from test_qknorm_rope import PCase, make

    # bf16 caches: opcheck's mutation check has no CPU kernels for float8 tensors.
    args, _ = make(PCase(seed=8, style="gptj", rotary_dim=32))
    outs = (torch.empty_like(args[0]), torch.empty_like(args[1]))
    torch.library.opcheck(torch.ops.qkrope.qknorm_rope.default,
                          (*args[:10], *NO_SCALES, *outs, args[10],
                           options_key(Options("NHD", "gptj", 32))))


def _native_module():
    from qkrope.ops import _native

    if not _native.enabled():
        pytest.skip("QKROPE_NATIVE=0")
    module = _native.load()
    assert module is not None, _native.status()
    return module


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the op's CUDA kernel")
def test_compiled_calls_launch_from_the_ops_cpp_kernel_exactly_as_eager():
    """Inside a compiled graph a call whose signature has a plan is launched by the op's C++
    kernel (csrc/op_route.cpp), not the Python body, with the eager call's bits; a new
    signature goes to the twin, which makes its plan."""
    module = _native_module()
    name = "qkrope::qknorm_rope"
    args = make_inputs(Case(B=2, Hq=8, Hkv=2, S=5, D=128, L=64, start=40, noncontig=True),
                       device="cuda")
    # the eager fast path's result: the same kernel, so the same bits
    eager = qkrope.run(*args[:4], args[4].clone(), args[5].clone(), *args[6:])
    f = torch.compile(lambda *a, **kw: op(*a, **kw), fullgraph=True)
    torch._dynamo.reset()
    for i in range(3):
        kc, vc = args[4].clone(), args[5].clone()
        q, k = torch.full_like(args[0], float("nan")), torch.full_like(args[1], float("nan"))
        before = module.route_stats(name)
        f(*args[:4], kc, vc, *args[6:], query_out=q, key_out=k)
        torch.cuda.synchronize()
        after = module.route_stats(name)
        for got, want in zip((q, k, kc, vc), eager):
            assert torch.equal(got, want), i
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA")
    assert after[1] == before[1] + 1 and after[2] == before[2], (before, after)  # from C++


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="host time of GPU launches")
def test_compiled_op_host_time_is_at_most_a_trivial_python_ops():
    # Inside a compiled graph every call goes through the dispatcher; the op's C++ kernel
    # launches a known signature without entering Python, so a call costs no more than one of
    # a registered Python op that only adds one to a tensor (the figures themselves: qkrope
    # bench --e2e; the Python body cost 2.0-2.5x that op). Off the native route the checked
    # path runs and this bound does not apply.
    from qkrope.bench.timing import op_host_times

    _native_module()
    # A measurement, not a count: on a loaded host (the GPU tests in 12 processes) one reading
    # can be off by half, so the bound must hold in one of three; a Python body fails all.
    readings = []
    for _ in range(3):
        h = op_host_times(calls=500)
        readings.append(h)
        if h["compiled graph, per call"] <= 1.25 * h["trivial op, compiled graph, per call"]:
            return
    pytest.fail(f"the op's host time in a compiled graph exceeds 1.25x a trivial op's in "
                f"every reading: {readings}")


def test_validate_under_compile_raises_the_eager_error_naming_the_argument():
    # A data-dependent check traced into the graph became inductor's "u0 >= 1"; the checks run
    # as ops of the graph instead, with the eager ValueError.
    args = list(make_inputs(Case(B=1, S=3, L=8, seed=9)))
    compiled = torch.compile(lambda *a: op(*a, validate=True, inplace=False), fullgraph=True)
    torch._dynamo.reset()
    args[6] = torch.tensor([0, 1, 9], device=args[6].device)
    with pytest.raises(ValueError, match=r"cache_position holds 9, outside the cache \[0, 8\)"):
        compiled(*args)
    args[6] = torch.tensor([0, 7, 2], device=args[6].device)  # valid: the same graph runs
    out, ref = compiled(*args), qkrope.reference(*args)
    assert torch.equal(out[2], ref[2]) and torch.equal(out[3], ref[3])


def test_validate_under_compile_names_a_bad_scale():
    from test_qknorm_rope import PCase, make

    args, kwargs = make(PCase(T=4, cache_dtype=torch.float8_e4m3fn, per_head_scale=True, seed=2))
    args = (*args[:6], torch.arange(4, device=args[0].device), *args[7:])  # valid slots
    kwargs["v_scale"] = torch.tensor([0.02, float("nan")], device=args[0].device)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: qkrope.fused_qk_norm_rope_paged(*a, **kwargs,
                                                                       validate=True),
                             fullgraph=True)
    with pytest.raises(ValueError, match="v_scale holds nan, not finite and > 0"):
        compiled(*args)


def test_validation_ops_opcheck():
    from qkrope.ops.qknorm_rope import validation

    torch.library.opcheck(validation.validated_rows, (torch.tensor([0, 3, 5]), 8, "slot_mapping"))
    torch.library.opcheck(validation.validated_scale, (torch.tensor([0.5, 2.0]), "k_scale"))
