"""Forbidden memory overlap is refused, on both entry points and on the fast path; allowed
overlap (in-place outputs, packed projections, K/V caches as views of one allocation) runs.

The rules (``ops/_overlap.py``) are checked against brute-force enumeration of the addressed
bytes, and their native copy (``csrc/fast_path.cpp``) against the Python one."""

import itertools
import shutil

import pytest
import torch
from helpers import Case, make_inputs
from hypothesis import given, settings
from hypothesis import strategies as st
from test_launcher import fake  # noqa: F401  (fixture)
from test_qknorm_rope import PCase, make

import qkrope
from qkrope.ops import _native
from qkrope.ops._overlap import check_disjoint, may_overlap, self_overlaps
from qkrope.ops.qknorm_rope import launcher


def addressed(t: torch.Tensor) -> set[int]:
    e, base = t.element_size(), t.data_ptr()
    out = set()
    for idx in itertools.product(*(range(n) for n in t.shape)):
        a = base + e * sum(i * s for i, s in zip(idx, t.stride()))
        out.update(range(a, a + e))
    return out


BUF = torch.empty(8192, dtype=torch.uint8)
# Views of one buffer as bytes, bf16 or float32 (as vLLM's per-token-head cache reads FP8 rows and
# the float32 scales between them), at any byte offset the element size allows.
views = st.integers(1, 3).flatmap(lambda nd: st.tuples(
    st.lists(st.integers(1, 4), min_size=nd, max_size=nd),
    st.lists(st.sampled_from([0, 1, 2, 3, 4, 5, 8, 12, 16, 20]), min_size=nd, max_size=nd),
    st.integers(0, 96), st.sampled_from([torch.bfloat16, torch.bfloat16, torch.uint8,
                                         torch.float32])))


def as_view(spec):
    shape, strides, offset, dtype = (*spec, torch.bfloat16)[:4]
    return BUF.view(dtype).as_strided(shape, strides, offset)


@settings(max_examples=500, deadline=None)
@given(a=views, b=views, same_strides=st.booleans())
def test_overlap_rules_match_enumeration(a, b, same_strides):
    if same_strides and len(a[0]) == len(b[0]):
        b = (b[0], a[1], *b[2:])
    x, y = as_view(a), as_view(b)
    truth = bool(addressed(x) & addressed(y))
    assert may_overlap(x, y) == truth, "the rule must be exact"
    e = x.element_size()
    elements = {x.data_ptr() + e * sum(i * s for i, s in zip(idx, x.stride()))
                for idx in itertools.product(*(range(n) for n in x.shape))}
    if len(elements) < x.numel():
        assert self_overlaps(x), "a self-overlapping view was missed"


def test_vllm_per_token_head_cache_views_are_disjoint():
    # vLLM 0.34's per-token-head cache: one [blocks, Hkv, slots, 2 (D + 4)] byte buffer, each
    # (slot, head) cell [K data | K scale fp32 | V data | V scale fp32]; the writer's four views.
    nb, H, bs, D = 3, 2, 4, 16
    cell = torch.empty(nb, H, bs, 2 * (D + 4), dtype=torch.uint8).transpose(1, 2)
    f32 = cell.view(torch.float32)
    k, v = cell[..., :D], cell[..., D + 4:2 * D + 4]
    ks, vs = f32[..., D // 4], f32[..., (2 * D + 4) // 4]
    for x, y in itertools.combinations((k, v, ks, vs), 2):
        assert not may_overlap(x, y) and not addressed(x) & addressed(y)
    assert may_overlap(ks, cell[..., D:D + 1]) and may_overlap(k, cell[..., D - 1:D + 2])


@pytest.fixture(scope="module")
def native_ok():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    module = _native.load(force=True)
    if module is None:
        pytest.skip(f"native helpers unavailable: {_native.status()}")
    return module.overlap_ok


@settings(max_examples=300, deadline=None)
@given(specs=st.lists(views, min_size=2, max_size=4), n_written=st.integers(1, 2),
       same=st.booleans())
def test_native_overlap_rule_equals_python(native_ok, specs, n_written, same):
    tensors = [as_view(s) for s in specs]
    if same:  # an allowed identical pair: written 0 is read 1
        tensors[1] = tensors[0]
    written = {f"w{i}": tensors[i] for i in range(n_written)}
    read = {f"r{i}": t for i, t in enumerate(tensors[n_written:], n_written)}
    pairs = (("w0", "r1"),) if n_written == 1 else ()
    try:
        check_disjoint(written, read, identical_ok=pairs)
        python_ok = True
    except ValueError:
        python_ok = False
    rules = bytes([n_written, *range(n_written), len(pairs), *([0, 1] if pairs else [])])
    assert native_ok(rules, *tensors) == python_ok


# --------------------------------------------------------------------------------------------
# the op
# --------------------------------------------------------------------------------------------
def bhsd(**kw):
    """[B, H, S, D] call with Hq == Hkv (so any output can take any input's place)."""
    args = list(make_inputs(Case(B=2, Hq=2, Hkv=2, S=3, L=8)))
    return args, kw


BHSD_FORBIDDEN = {
    # name: (make the call, (arg a, arg b) the error must name)
    "query_out is key": (lambda a: {"query_out": a[1]}, ("query_out", "key")),
    "key_out is query": (lambda a: {"key_out": a[0]}, ("key_out", "query")),
    "query_out is key_out": (lambda a: {"query_out": (o := torch.empty_like(a[0])),
                                        "key_out": o}, ("query_out", "key_out")),
    "key_out inside key_cache": (lambda a: {"key_out": a[4][:, :, :3]}, ("key_out", "key_cache")),
    "query_out overlaps value": (lambda a: {"query_out": a[2]}, ("query_out", "value")),
    "query_out is query shifted by one row": (None, ("query_out", "query")),
    "expanded query_out": (lambda a: {"query_out": torch.empty_like(a[0][:, :1]).expand_as(a[0])},
                           ("query_out",)),
    "query_out inside the norm weights": (
        lambda a: {"query_out": _around(a[7], a[0])}, ("query_out", "q_norm_weight")),
}


def _around(weight, like):
    """A tensor shaped ``like`` whose storage contains ``weight``'s bytes."""
    big = torch.empty(like.numel() + weight.numel(), dtype=like.dtype, device=like.device)
    big[: weight.numel()].copy_(weight)
    weight.set_(big[: weight.numel()])
    return big[: like.numel()].view(like.shape)


@pytest.mark.parametrize("name", list(BHSD_FORBIDDEN))
def test_bhsd_forbidden_overlap_is_refused_and_nothing_written(name):
    args, _ = bhsd()
    make_kw, names = BHSD_FORBIDDEN[name]
    if make_kw is None:
        # query itself lives in a larger buffer; query_out is that buffer one row later.
        big = torch.randn(args[0].numel() + args[0].shape[-1], dtype=args[0].dtype,
                          device=args[0].device)
        args[0] = big[: args[0].numel()].view(args[0].shape)
        kw = {"query_out": big[args[0].shape[-1]:].view(args[0].shape)}
    else:
        kw = make_kw(args)
    before = [t.clone() for t in args if isinstance(t, torch.Tensor)]
    with pytest.raises(ValueError) as err:
        qkrope.fused_rope_with_qk_norm_and_kv_cache_update(*args, **kw)
    for n in names:
        assert n in str(err.value)
    after = [t for t in args if isinstance(t, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "refused, yet written"


def test_caches_sharing_memory_are_refused_on_both_entry_points():
    args, _ = bhsd()
    args[5] = args[4]
    with pytest.raises(ValueError, match="key_cache.*value_cache|value_cache.*key_cache"):
        qkrope.run(*args)
    pargs, kw = make(PCase(T=5))
    pargs = list(pargs)
    pargs[5] = pargs[4][:, :]  # another view object, same memory
    with pytest.raises(ValueError, match="key_cache.*value_cache|value_cache.*key_cache"):
        qkrope.fused_qk_norm_rope_paged(*pargs, **kw)


PAGED_FORBIDDEN = {
    "key_out inside key_cache": (lambda a: {"key_out": a[4].reshape(-1, *a[1].shape[1:])[
        : a[1].shape[0]]}, ("key_out", "key_cache")),
    "query_out is value (GQA 1:1)": (lambda a: {"query_out": a[2]}, ("query_out", "value")),
    "expanded key_out": (lambda a: {"key_out": torch.empty_like(a[1][:1]).expand_as(a[1])},
                         ("key_out",)),
    "value_cache inside positions": (None, ("value_cache", "positions")),
}


@pytest.mark.parametrize("name", list(PAGED_FORBIDDEN))
def test_paged_forbidden_overlap_is_refused(name):
    args, kw = make(PCase(T=5, Hq=2, Hkv=2))
    args = list(args)
    make_kw, names = PAGED_FORBIDDEN[name]
    if make_kw is None:
        # A cache whose bytes include the positions tensor's (one allocation, both views).
        nbytes = args[5].numel() * args[5].element_size()
        raw = torch.zeros(nbytes + 64, dtype=torch.uint8, device=args[5].device)
        args[5] = raw[64:].view(args[5].dtype).view(args[5].shape)
        args[3] = raw[64: 64 + 8 * args[3].numel()].view(torch.int64)
    else:
        kw.update(make_kw(args))
    with pytest.raises(ValueError) as err:
        qkrope.fused_qk_norm_rope_paged(*args, **kw)
    for n in names:
        assert n in str(err.value)


def test_allowed_overlaps_run_and_match_the_reference():
    """In place on a packed QKV (query_out is query, key_out is key, all three views of one
    projection) with K/V caches as the two halves of one vLLM-style allocation."""
    args, kw = make(PCase(T=6, packed=True, shared_kv=True, layout="HND"))
    ref_q, ref_k, ref_kc, ref_vc = qkrope.reference_paged(*args, **kw)
    args = list(args)
    q, k = args[0], args[1]
    out_q, out_k = qkrope.fused_qk_norm_rope_paged(*args, **kw, query_out=q, key_out=k)
    assert out_q is q and out_k is k
    torch.testing.assert_close(q, ref_q, atol=0.05, rtol=0)
    torch.testing.assert_close(k, ref_k, atol=0.05, rtol=0)
    assert torch.equal(args[5].view(torch.uint8), ref_vc.view(torch.uint8))


def test_fast_path_refuses_overlap_that_its_plan_did_not_have(fake):  # noqa: F811
    """Same signature (shapes, strides, dtypes) as a planned call, but key_out now lies inside
    key_cache: the fast path must not launch; the checked path names the arguments."""
    jit, runs = fake
    args = list(make_inputs(Case(B=1, Hq=2, Hkv=2, S=3, L=8)))
    spare = torch.empty_like(args[4])
    kw = {"key_out": spare[:, :, :3]}
    qkrope.run(*args, **kw)
    qkrope.run(*args, **kw)
    assert len(jit.launches) == 1 and len(runs) == 1
    with pytest.raises(ValueError, match="key_out overlaps key_cache"):
        qkrope.run(*args, key_out=args[4][:, :, 2:5])
    assert len(jit.launches) == 1 and len(runs) == 1, "an overlapping call was launched"


def test_fast_path_keeps_in_place_calls(fake):  # noqa: F811
    jit, runs = fake
    args = list(make_inputs(Case(B=1, Hq=2, Hkv=2, S=3, L=8)))
    for _ in range(3):
        qkrope.run(*args, query_out=args[0], key_out=args[1])
    assert len(jit.launches) == 1 and len(runs) == 2


def test_fast_path_overlap_check_runs_in_the_signature(fake):  # noqa: F811
    """The rules the launcher passes name the written parameters and the in-place pairs."""
    rules = launcher.LAUNCHER.rules
    per_call = launcher.PER_CALL
    n = rules[0]
    assert {per_call[i] for i in rules[1:1 + n]} == {
        "k_cache_ptr", "v_cache_ptr", "k_scale_cache_ptr", "v_scale_cache_ptr", "q_out_ptr",
        "k_out_ptr"}
    pairs = rules[2 + n:]
    assert {(per_call[pairs[i]], per_call[pairs[i + 1]]) for i in range(0, len(pairs), 2)} == {
        ("q_out_ptr", "q_ptr"), ("k_out_ptr", "k_ptr")}
