"""The cached direct launch (GPU fast path), exercised on any machine with a stand-in for
Triton's compiled kernel: it must pass exactly the arguments Triton's own launch got, and only
for the argument signature it was built from."""

import pytest
import torch
from helpers import Case, make_inputs

from qkrope.ops.qknorm_rope_cache import launcher
from qkrope.ops.qknorm_rope_cache.kernel import qknorm_rope_cache_kernel


class FakeCompiled:
    """Stands in for triton's CompiledKernel: records direct launches."""

    function = "function-handle"
    packed_metadata = "packed-metadata"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class FakeJit:
    """Stands in for the @triton.jit kernel: records Triton-path launches."""

    arg_names = qknorm_rope_cache_kernel.arg_names

    def __init__(self):
        self.launches = []
        self.compiled = FakeCompiled()

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.launches.append((grid, args, meta))
            return self.compiled
        return launch


@pytest.fixture
def fake(monkeypatch):
    jit = FakeJit()
    monkeypatch.setattr(launcher, "qknorm_rope_cache_kernel", jit)
    monkeypatch.setattr(launcher, "_fast_path_ok", lambda: True)
    monkeypatch.setattr(launcher, "_raw_stream", lambda index: 1234)
    monkeypatch.setattr(launcher, "_current_device", lambda: -1)  # CPU tensors' get_device()
    monkeypatch.setattr(launcher, "_PLANS", {})
    return jit


def test_direct_launch_passes_what_triton_got(fake):
    args = make_inputs(Case(B=2, S=5, noncontig=True))
    q_out, k_out = torch.empty_like(args[0]), torch.empty_like(args[1])
    launcher.fused_rope_with_qk_norm_and_kv_cache_update(*args, query_out=q_out, key_out=k_out)
    assert len(fake.launches) == 1 and not fake.compiled.runs
    launcher.fused_rope_with_qk_norm_and_kv_cache_update(*args, query_out=q_out, key_out=k_out)
    assert len(fake.launches) == 1 and len(fake.compiled.runs) == 1, "second call not direct"

    grid, triton_args, meta = fake.launches[0]
    run = fake.compiled.runs[0]
    assert run[:3] == grid and run[3:9] == (1234, "function-handle", "packed-metadata",
                                            None, None, None)
    constexprs = tuple(meta[n] for n in FakeJit.arg_names[len(triton_args):])
    direct = run[9:]
    assert len(direct) == len(FakeJit.arg_names)
    for name, a, b in zip(FakeJit.arg_names, direct, (*triton_args, *constexprs)):
        assert a is b or a == b, f"argument {name}: direct {a!r} != Triton's {b!r}"


def test_new_signature_takes_the_checked_path(fake):
    args = list(make_inputs(Case(B=2, S=5)))
    launcher.fused_rope_with_qk_norm_and_kv_cache_update(*args)
    launcher.fused_rope_with_qk_norm_and_kv_cache_update(*args)
    assert len(fake.launches) == 1 and len(fake.compiled.runs) == 1
    # Same shapes, other strides (a transposed copy viewed back): a new signature.
    args[0] = args[0].transpose(1, 2).contiguous().transpose(1, 2)
    launcher.fused_rope_with_qk_norm_and_kv_cache_update(*args)
    assert len(fake.launches) == 2
    # A non-float epsilon is checked (and converted) on the checked path, never reused blindly.
    launcher.fused_rope_with_qk_norm_and_kv_cache_update(*args[:10], 1)
    assert len(fake.launches) == 3
    with pytest.raises(ValueError, match="rms_norm_eps"):
        launcher.fused_rope_with_qk_norm_and_kv_cache_update(*args[:10], -1.0)


def test_allocated_outputs_match_the_checked_path(fake):
    args = make_inputs(Case(B=2, S=5))
    q1, k1, _, _ = launcher.fused_rope_with_qk_norm_and_kv_cache_update(*args)
    q2, k2, _, _ = launcher.fused_rope_with_qk_norm_and_kv_cache_update(*args)
    assert fake.compiled.runs, "second call not direct"
    for a, b in ((q1, q2), (k1, k2)):
        assert (a.shape, a.stride(), a.dtype, a.device) == (b.shape, b.stride(), b.dtype,
                                                            b.device)


def test_direct_launch_makes_the_tensors_device_current(fake, monkeypatch):
    entered = []

    class FakeDevice:
        def __init__(self, index):
            entered.append(index)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    args = make_inputs(Case(S=2))
    launcher.fused_rope_with_qk_norm_and_kv_cache_update(*args)
    monkeypatch.setattr(torch.cuda, "device", FakeDevice)
    monkeypatch.setattr(launcher, "_current_device", lambda: 7)  # another device is current
    launcher.fused_rope_with_qk_norm_and_kv_cache_update(*args)
    assert entered == [args[0].get_device()] and len(fake.compiled.runs) == 1
