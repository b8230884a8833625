"""The autograd contract: the op has no backward, so it refuses inputs autograd would record
(instead of returning outputs cut off from the graph), and its in-place writes bump version
counters as torch's own in-place ops do (a tensor saved for backward and overwritten by the op
makes that backward raise instead of using stale values). Both entry points, eager (checked and,
on a GPU, the native fast path) and compiled; the FP8 scales and scale caches too."""

import pytest
import torch
from helpers import Case, make_inputs

import qkrope

NAMES = ("query", "key", "value", None, "key_cache", "value_cache", None, "q_norm_weight",
         "k_norm_weight", "inv_freq")


def _paged(seed, **case):
    from test_qknorm_rope import PCase, make

    args, kwargs = make(PCase(seed=seed, **case))
    return args, kwargs


@pytest.mark.parametrize("which", [i for i, n in enumerate(NAMES) if n is not None])
def test_inputs_that_require_grad_are_refused_naming_autograd(which):
    args = list(make_inputs(Case(S=2, seed=which)))
    qkrope.run(*args)                         # a plan for this signature, where there are plans
    args[which] = args[which].detach().clone().requires_grad_()
    with pytest.raises(RuntimeError, match=f"{NAMES[which]} requires grad.*no backward"):
        qkrope.run(*args)
    with torch.no_grad():                     # nothing to record: runs
        out = qkrope.run(*args)
    assert not out[0].requires_grad


def test_outputs_that_require_grad_are_refused():
    args = make_inputs(Case(S=2, seed=3))
    q_out = torch.empty_like(args[0]).requires_grad_()
    with pytest.raises(RuntimeError, match="query_out requires grad"):
        qkrope.run(*args, query_out=q_out)


def test_paged_entry_point_refuses_autograd_too():
    args, kwargs = _paged(4)
    args = list(args)
    args[0] = args[0].detach().clone().requires_grad_()
    with pytest.raises(RuntimeError, match="query requires grad.*no backward"):
        qkrope.fused_qk_norm_rope_paged(*args, **kwargs)


@pytest.mark.parametrize("name", ["k_scale", "v_scale", "q_scale", "k_scale_cache",
                                  "v_scale_cache"])
def test_scales_and_scale_caches_that_require_grad_are_refused(name):
    fp8 = torch.float8_e4m3fn
    args, kwargs = _paged(8, T=3, cache_dtype=fp8, per_head_scale=True)
    device = args[0].device
    if name.endswith("_cache"):  # per-token-head scales, computed and written by the op
        del kwargs["k_scale"], kwargs["v_scale"]
        kwargs.update(k_scale_cache=torch.zeros(args[4].shape[:-1], device=device),
                      v_scale_cache=torch.zeros(args[5].shape[:-1], device=device))
    if name == "q_scale":
        kwargs.update(q_scale=torch.full((1,), 0.05, device=device),
                      query_out=torch.empty(args[0].shape, dtype=fp8, device=device))
    kwargs[name] = kwargs[name].detach().clone().requires_grad_()
    with pytest.raises(RuntimeError, match=f"{name} requires grad.*no backward"):
        qkrope.fused_qk_norm_rope_paged(*args, **kwargs)
    with torch.no_grad():                     # nothing to record: runs
        qkrope.fused_qk_norm_rope_paged(*args, **kwargs)


def test_compiled_call_refuses_autograd_at_trace_time():
    args = list(make_inputs(Case(S=2, seed=5)))
    args[0] = args[0].detach().clone().requires_grad_()
    torch._dynamo.reset()
    with pytest.raises(Exception, match="query requires grad"):
        torch.compile(qkrope.run, fullgraph=True)(*args)


@pytest.mark.parametrize("written", ["key_cache", "query_out"])
def test_in_place_writes_bump_version_counters(written):
    args = make_inputs(Case(S=2, seed=6))
    q_out = torch.empty_like(args[0])
    qkrope.run(*args, query_out=q_out)        # a plan (on a GPU: the next call is native)
    target = args[4] if written == "key_cache" else q_out
    w = torch.ones((), dtype=target.dtype, requires_grad=True)
    y = (w * target).sum()                    # saves `target` for backward
    before = target._version
    qkrope.run(*args, query_out=q_out)
    assert target._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_paged_writes_bump_version_counters():
    args, kwargs = _paged(7)
    before = (args[4]._version, args[5]._version)
    qkrope.fused_qk_norm_rope_paged(*args, **kwargs)
    qkrope.fused_qk_norm_rope_paged(*args, **kwargs)
    assert args[4]._version >= before[0] + 2 and args[5]._version >= before[1] + 2
