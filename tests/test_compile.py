"""The registered custom op: torch.compile(fullgraph=True) without graph breaks or cache
copies, and torch.library.opcheck."""

import pytest
import torch
from helpers import Case, make_inputs

import qkrope


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


def test_opcheck():
    args = make_inputs(Case(S=3, seed=5))
    outs = (torch.empty_like(args[0]), torch.empty_like(args[1]))
    torch.library.opcheck(torch.ops.qkrope.qknorm_rope_cache.default, (*args, *outs))


def test_eager_path_does_not_use_the_dispatcher(monkeypatch):
    # Eager calls must not pay for the custom op: make it fail and call eagerly.
    from qkrope.ops.qknorm_rope_cache import registration

    monkeypatch.setattr(registration, "traced_call", None)
    op(*make_inputs(Case(S=2)))  # would raise TypeError if it went through traced_call
