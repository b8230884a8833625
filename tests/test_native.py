"""The native fast-path helpers (qkrope/ops/csrc/fast_path.cpp) against plain Python: two calls
get equal native keys exactly when their tensors' (shape, strides, dtype, device, 16 B
alignment) are equal, and the same addresses; outputs are allocated as
torch.empty_like(contiguous) would, given ones passed through."""

import functools
import itertools
import shutil

import pytest
import torch

from qkrope.ops import _launch, _native


@pytest.fixture(scope="module")
def module():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    mod = _native.load(force=True)  # built and tested here even where QKROPE_NATIVE=0
    assert mod is not None, _native.status()
    return mod


@pytest.fixture(scope="module")
def native(module):
    return functools.partial(module.signature, b"")  # no overlap rules: keys only


def python_key(tensors):
    """What the signature must capture, in Python: (key, addresses)."""
    key, addresses = [], []
    for t in tensors:
        if t is None:
            key.append(None)
            addresses.append(None)
        else:
            key.append((t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() % 16 == 0))
            addresses.append(t.data_ptr())
    return tuple(key), addresses


def variants():
    base = torch.randn(4, 6, 8, dtype=torch.bfloat16)
    return {
        "base": base,
        "same metadata, other storage": torch.randn(4, 6, 8, dtype=torch.bfloat16),
        "fp16": base.half(),
        "transposed": base.transpose(0, 1),
        "transposed back to contiguous": base.transpose(0, 1).contiguous().transpose(0, 1),
        "slice (aligned)": base[:, :, :4],
        "offset view (2 B: unaligned)": torch.randn(193, dtype=torch.bfloat16)[1:].view(4, 6, 8),
        "expanded (stride 0)": base[:1].expand(4, 6, 8),
        "other shape": torch.randn(4, 6, 16, dtype=torch.bfloat16)[:, :, :8].contiguous(),
        "3 x 1-D": torch.randn(192, dtype=torch.bfloat16),
        "parameter": torch.nn.Parameter(torch.randn(4, 6, 8, dtype=torch.bfloat16),
                                        requires_grad=False),
        "int64": torch.arange(192).view(4, 6, 8),
        "none": None,
    }


def test_native_keys_equal_exactly_when_python_keys_do(native):
    vs = list(variants().values())
    calls = [*itertools.product(vs, repeat=2), *((a, None, b) for a, b in
                                                  itertools.product(vs[:5], repeat=2))]
    py = [python_key(c) for c in calls]
    nat = [native(*c) for c in calls]
    for (pk, pa), (nk, na) in zip(py, nat):
        assert pk is not None and nk is not None and pa == na
    for i, j in itertools.product(range(len(calls)), repeat=2):
        assert (py[i][0] == py[j][0]) == (nat[i][0] == nat[j][0]), (i, j)


def test_native_signature_rejects_what_the_checked_path_must_see(native):
    t = torch.ones(3)

    class Sub(torch.Tensor):
        pass

    assert native(t, 1) is None                      # a non-tensor argument
    assert native(t.as_subclass(Sub)) is None        # a Tensor subclass
    assert native(torch.ones(3).to_sparse()) is None  # no strides
    key, addrs = native(t, None)
    assert isinstance(key, bytes) and addrs == [t.data_ptr(), None]
    # What autograd would record: the checked path refuses it by name (the ops have no backward).
    w = torch.nn.Parameter(torch.ones(3))
    assert native(t, w) is None
    with torch.no_grad():
        assert native(t, w) is not None


def test_a_float_stands_for_the_scale_tensor_the_checks_keep_for_it(native):
    """A Python float scale reaches the fast path as it is: the signature packs the tensor that
    checks.scalar_on keeps for its value on the first argument's device (the same key and
    address as that tensor), and gives None for any other float, so the checks see it."""
    from qkrope.ops.qknorm_rope import checks

    q = torch.ones(2, 3)
    value = 0.0078125 + 2.0 ** -40  # a value no other test keeps
    assert native(q, value) is None  # not kept yet
    kept = checks.scalar_on(value, q.device)
    assert checks.scalar_on(value, q.device) is kept
    assert native(q, value) == native(q, kept)
    assert native(q, value)[1] == [q.data_ptr(), kept.data_ptr()]
    assert native(q, value, None, value) == native(q, kept, None, kept)
    assert native(q, value + 2.0 ** -30) is None  # another value
    assert native(q, float("nan")) is None and native(q, 0.0) is None
    assert native(value, q) is None  # the device comes from a tensor first
    assert native(torch.ones(2, 3, device="meta"), value) is None  # another device


@pytest.mark.parametrize("given", ["none", "query_out", "both"])
def test_native_outputs_match_python(module, given):
    v = variants()
    query, key = v["transposed"], v["offset view (2 B: unaligned)"].half()
    q_given = torch.empty_like(query) if given != "none" else None
    k_given = torch.empty_like(key) if given == "both" else None
    for _ in range(2):
        q_out, k_out, q_addr, k_addr = module.outputs(query, key, q_given, k_given)
        for out, like, g, addr in ((q_out, query, q_given, q_addr), (k_out, key, k_given, k_addr)):
            if g is not None:
                assert out is g
            else:
                assert out.is_contiguous()
                assert (out.shape, out.dtype, out.device, out.requires_grad) == (
                    like.shape, like.dtype, like.device, False)
                assert out.data_ptr() != like.data_ptr()
            assert type(addr) is int and addr == out.data_ptr()


def test_native_outputs_take_any_number_of_pairs(module):
    # KernelLauncher declares its outputs by name: one (like, given) pair per output.
    a, b, c = torch.randn(3, 5), torch.randn(2, 4).half(), torch.randn(7).t()
    given = torch.empty(2, 4, dtype=torch.half)
    out = module.outputs(a, b, c, None, given, None)
    assert len(out) == 6 and out[1] is given
    for o, like, addr in zip(out[:3], (a, b, c), out[3:]):
        assert (o.shape, o.dtype) == (like.shape, like.dtype) and addr == o.data_ptr()
    (one, addr), = [module.outputs(a, None)]
    assert one.shape == a.shape and addr == one.data_ptr()


def test_native_outputs_raise_torch_errors(module):
    """An allocation failure reaches Python as torch's exception (not a crash, not None)."""
    huge = torch.empty(1).expand(2**62)  # 2**64 bytes: no allocator can
    with pytest.raises(RuntimeError):
        module.outputs(huge, huge, None, None)
    with pytest.raises(TypeError):  # like_1..like_n, given_1..given_n: an even count
        module.outputs(huge, huge, None)


def test_param_kinds_follow_tritons_abi():
    sig = {"q": "*bf16", "pos": "*i64", "eps": "fp32", "S": "i32", "L": "i64", "one": "constexpr",
           "flag": "i1", "u": "u64", "BLOCK": "constexpr"}
    assert _launch.param_kinds(sig) == "ppfilcbLcpp"  # + global and profile scratch
    assert _launch.param_kinds({"x": "fp16"}) is None  # scalars it does not pack
    assert _launch.param_kinds({"d": ("*bf16", "i32")}) is None  # tuples


def test_native_launch_plan_packs_parameters(module):
    """make_launch + params: the bytes a launch passes are the arguments at their C sizes, the
    per-call ones from each call, constexprs left out, scratch pointers null."""
    import struct

    kinds = "ppfilcbLhHIBdpp"
    values = (None, None, None, 7, -(2**40), "ignored", 1, 2**63 + 5, -3, 65535, 2**31, 255,
              0.1, None, None)
    plan = module.make_launch(0, 4, 2, 1, 128, 0, 0, kinds, values, (0, 1, 2), False)
    for a, b, eps in ((0x7F00_0000_0010, None, 1e-6), (16, 2**64 - 16, 3.5)):
        expected = struct.pack("<QQfiqbQhHIBdQQ", a, b or 0, eps, 7, -(2**40), 1, 2**63 + 5, -3,
                               65535, 2**31, 255, 0.1, 0, 0)
        assert module.params(plan, a, b, eps) == expected
    with pytest.raises(TypeError):
        module.params(plan, 16, 16)  # per-call arity is fixed by the plan
    with pytest.raises(OverflowError):
        module.make_launch(0, 1, 1, 1, 32, 0, 0, "pi", (None, 2**31), (0,), False)
    with pytest.raises(OverflowError):
        module.params(plan, -16, None, 1.0)  # an address is unsigned
    with pytest.raises(ValueError):
        module.make_launch(0, 1, 1, 1, 32, 0, 0, "pz", (None, 1), (0,), False)
    with pytest.raises(ValueError):  # a per-call argument must be a kernel parameter
        module.make_launch(0, 1, 1, 1, 32, 0, 0, "pc", (None, 1), (1,), False)
    # With the driver check: no plan for a function the driver does not know (nor without one).
    assert module.make_launch(0, 1, 1, 1, 32, 0, 0, "pp", (None, None), ()) is None


def test_native_plan_takes_per_call_values_by_position_in_the_kernel(module):
    """Per-call parameters may sit anywhere among the kernel's: their slots are named."""
    import struct

    plan = module.make_launch(0, 1, 1, 1, 32, 0, 0, "ipcfpp", (5, None, 3, 0.0, None, None),
                              (3, 1), False)
    assert module.params(plan, 2.5, 64) == struct.pack("<iQfQQ", 5, 64, 2.5, 0, 0)


# A registered op served by the native route (csrc/op_route.cpp), on the CPU dispatch key here
# (the ops' own route is on CUDA): (pointer arguments, float scalars, options).
_ROUTE_LIB = torch.library.Library("qkrope_route_test", "DEF")
_ROUTE_CALLS = []


def _route_body(x: torch.Tensor, out: torch.Tensor, eps: float, options: str) -> None:
    _ROUTE_CALLS.append(options)
    out.copy_(x)


for _name in ("route", "route_checked"):
    _ROUTE_LIB.define(_name + "(Tensor x, Tensor(a!) out, float eps, str options) -> ()")
    _ROUTE_LIB.impl(_name, _route_body, "CompositeExplicitAutograd")


def test_served_op_launches_its_plans_in_cpp_and_hands_every_miss_to_its_twin(module):
    """The C++ kernel takes a call whose (options, signature) has a plan -- it launches that plan
    and bumps the written tensors' versions, running no Python -- and hands any other call, to
    the letter, to the checked twin (the Python body)."""
    op, rules = torch.ops.qkrope_route_test.route, bytes([1, 1, 0])  # writes out; no in-place
    name = "qkrope_route_test::route"
    assert module.route_stats(name) is None
    assert module.serve_op(name, name + "_checked", rules, 2, 1, "CPU")
    assert not module.serve_op(name, name + "_checked", rules, 2, 1, "CPU")  # once per process
    x, out = torch.randn(16), torch.empty(16)
    _ROUTE_CALLS.clear()
    op(x, out, 1e-6, "a")  # no plan yet
    assert _ROUTE_CALLS == ["a"] and torch.equal(out, x)
    # A plan of an empty grid: the C++ kernel takes the call and launches nothing (no GPU here).
    plan = module.make_launch(0, 0, 1, 1, 32, 0, 0, "ppfpp", (None, None, 0.0, None, None),
                              (0, 1, 2), False)
    assert module.add_plan(name, "a", module.signature(rules, x, out)[0], plan)
    assert not module.add_plan("qkrope_route_test::nothing", "a", b"", plan)  # not served
    other = module.make_launch(0, 0, 1, 1, 32, 0, 0, "pppp", (None,) * 4, (0, 1, 2), False)
    assert not module.add_plan(name, "b", b"", other)  # its third per-call value is no float
    assert module.route_stats(name) == (1, 0, 1)
    version = out._version
    op(x, torch.empty(32)[::2], 1e-6, "a")  # another signature (strides)
    op(x, out, 1e-6, "b")  # other options
    op(x, out, float("nan"), "a")  # a scalar the fast path never passes unchecked
    op(x, out, 1e300, "a")  # not a float32
    op(x[:16], x, 1e-6, "a")  # out aliases x (same signature as x, out): the overlap rule
    assert _ROUTE_CALLS == ["a"] * 2 + ["b", "a", "a", "a"]
    op(x, out, 1e-6, "a")
    op(x, out, 0.0, "a")
    assert _ROUTE_CALLS == ["a"] * 2 + ["b", "a", "a", "a"]  # both through the plan
    assert out._version > version + 1
    assert module.route_stats(name) == (1, 2, 6)
    module.clear_plans(name)
    op(x, out, 1e-6, "a")
    assert _ROUTE_CALLS[-1] == "a" and len(_ROUTE_CALLS) == 7
    assert module.route_stats(name) == (0, 2, 7)


def test_the_op_and_its_launcher_are_set_up_for_the_native_route():
    from qkrope.ops.qknorm_rope.launcher import LAUNCHER

    assert LAUNCHER.op == "qkrope::qknorm_rope"
    schemas = [str(getattr(torch.ops.qkrope, n).default._schema).split("(", 1)[1]
               for n in ("qknorm_rope", "qknorm_rope_checked")]
    assert schemas[0] == schemas[1]  # the twin: the same arguments, the same body
    args = torch.ops.qkrope.qknorm_rope.default._schema.arguments
    n = LAUNCHER._n_pointers
    assert [str(a.type) for a in args[n:]] == ["float"] * (len(LAUNCHER.per_call) - n) + ["str"]
