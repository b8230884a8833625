"""The cached direct launch (GPU fast path), exercised on any machine with a stand-in for
Triton's compiled kernel: it must pass exactly the arguments Triton's own launch got, and only
for the argument signature it was built from."""

import pytest
import torch
from helpers import Case, make_inputs

from qkrope.ops import _direct_launch, _native
from qkrope.ops.qknorm_rope_cache import launcher
from qkrope.ops.qknorm_rope_cache.kernel import qknorm_rope_cache_kernel


class Recorder:
    """A callable that records its calls (stands in for a launch function)."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


class FakeLauncher:
    """Stands in for Triton 3.6's CudaLauncher: the direct path calls its C ``launch``."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid = launch_pdl = False

    def __init__(self):
        self.launch = Recorder()


class FakeCompiled:
    """Stands in for triton's CompiledKernel: records direct launches, either through the C
    launch function (``c_launch``) or through ``CompiledKernel.run`` (the fallback)."""

    function = "function-handle"
    packed_metadata = "packed-metadata"

    def __init__(self, c_launch=True):
        self.c_launch = c_launch
        self.run = FakeLauncher() if c_launch else Recorder()

    @property
    def runs(self):
        """Each direct launch as ``(grid, stream, kernel arguments)``, after checking the
        launcher arguments between the stream and the kernel's own."""
        out = []
        for call in (self.run.launch if self.c_launch else self.run).calls:
            middle = ((self.function, False, False, None, None, self.packed_metadata, None,
                       None, None) if self.c_launch
                      else (self.function, self.packed_metadata, None, None, None))
            assert call[4:4 + len(middle)] == middle
            out.append((call[:3], call[3], call[4 + len(middle):]))
        return out


class FakeJit:
    """Stands in for the @triton.jit kernel: records Triton-path launches."""

    arg_names = qknorm_rope_cache_kernel.arg_names

    def __init__(self, c_launch=True):
        self.launches = []
        self.compiled = FakeCompiled(c_launch)

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.launches.append((grid, args, meta))
            return self.compiled
        return launch


def pin_helpers(monkeypatch, native: bool) -> None:
    """Pin the fast path's helpers (signature, outputs) to native or Python for a test (no
    background build switching them), and let plans be made although the interpreter runs."""
    module = _native.load(force=True) if native else None
    monkeypatch.setattr(_native, "start_build", lambda force=False: None)
    if native and module is None:
        pytest.skip(f"native helpers unavailable: {_native.status()}")
    monkeypatch.setattr(_native, "signature_fn", lambda: module and module.signature)
    monkeypatch.setattr(_native, "outputs_fn", lambda: module and module.outputs)
    monkeypatch.setattr(_native, "module", lambda: module)
    monkeypatch.setattr(_direct_launch, "interpreting", lambda: False)


@pytest.fixture(params=[(True, False), (False, False), (True, True)],
                ids=["c-launch", "run", "c-launch-native-helpers"])
def fake(monkeypatch, request):
    c_launch, native = request.param
    pin_helpers(monkeypatch, native)
    jit = FakeJit(c_launch)
    monkeypatch.setattr(launcher, "qknorm_rope_cache_kernel", jit)
    monkeypatch.setattr(_direct_launch, "fast_path_ok", lambda: True)
    monkeypatch.setattr(launcher, "fast_path_ok", lambda: True)
    monkeypatch.setattr(_direct_launch, "raw_stream", lambda index: 1234)
    monkeypatch.setattr(_direct_launch, "current_device", lambda: -1)  # CPU get_device()
    monkeypatch.setattr(launcher, "_PLANS", _direct_launch.PlanCache())
    return jit


def test_direct_launch_passes_what_triton_got(fake):
    args = make_inputs(Case(B=2, S=5, noncontig=True))
    q_out, k_out = torch.empty_like(args[0]), torch.empty_like(args[1])
    launcher.fused_rope_with_qk_norm_and_kv_cache_update(*args, query_out=q_out, key_out=k_out)
    assert len(fake.launches) == 1 and not fake.compiled.runs
    launcher.fused_rope_with_qk_norm_and_kv_cache_update(*args, query_out=q_out, key_out=k_out)
    assert len(fake.launches) == 1 and len(fake.compiled.runs) == 1, "second call not direct"

    grid, triton_args, meta = fake.launches[0]
    run_grid, stream, direct = fake.compiled.runs[0]
    assert run_grid == grid and stream == 1234
    constexprs = tuple(meta[n] for n in FakeJit.arg_names[len(triton_args):])
    assert_same_arguments(FakeJit.arg_names, direct, (*triton_args, *constexprs))


def assert_same_arguments(names, direct, triton_args):
    """The direct launch passes each tensor as its address and every other argument as is."""
    for name, a, b in zip(names, direct, triton_args, strict=True):
        if isinstance(b, torch.Tensor):
            assert type(a) is int and a == b.data_ptr(), f"argument {name}: {a!r} is not {b}'s address"
        else:
            assert type(a) is type(b) and a == b, f"argument {name}: direct {a!r} != Triton's {b!r}"


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
    monkeypatch.setattr(_direct_launch, "current_device", lambda: 7)  # another device current
    launcher.fused_rope_with_qk_norm_and_kv_cache_update(*args)
    assert entered == [args[0].get_device()] and len(fake.compiled.runs) == 1


@pytest.fixture(params=[(True, False), (False, False), (True, True)],
                ids=["c-launch", "run", "c-launch-native-helpers"])
def fake_paged(monkeypatch, request):
    from qkrope.ops.qknorm_rope_paged import launcher as paged
    from qkrope.ops.qknorm_rope_paged.kernel import qknorm_rope_paged_kernel

    c_launch, native = request.param
    pin_helpers(monkeypatch, native)
    jit = FakeJit(c_launch)
    jit.arg_names = qknorm_rope_paged_kernel.arg_names
    monkeypatch.setattr(paged, "qknorm_rope_paged_kernel", jit)
    monkeypatch.setattr(_direct_launch, "fast_path_ok", lambda: True)
    monkeypatch.setattr(paged, "fast_path_ok", lambda: True)
    monkeypatch.setattr(_direct_launch, "raw_stream", lambda index: 1234)
    monkeypatch.setattr(_direct_launch, "current_device", lambda: -1)
    monkeypatch.setattr(paged, "_PLANS", _direct_launch.PlanCache())
    return paged, jit


@pytest.mark.parametrize("fp8, per_head", [(False, False), (True, False), (True, True)])
def test_paged_direct_launch_passes_what_triton_got(fake_paged, fp8, per_head):
    from test_paged import PCase, make

    paged, jit = fake_paged
    args, kwargs = make(PCase(cache_dtype=torch.float8_e4m3fn if fp8 else None,
                              per_head_scale=per_head, style="gptj", rotary_dim=32))
    q_out, k_out = torch.empty_like(args[0]), torch.empty_like(args[1])
    for _ in range(2):
        paged.fused_qk_norm_rope_paged(*args, **kwargs, query_out=q_out, key_out=k_out)
    assert len(jit.launches) == 1 and len(jit.compiled.runs) == 1
    grid, triton_args, meta = jit.launches[0]
    run_grid, stream, direct = jit.compiled.runs[0]
    assert len(grid) == 2 and run_grid == (*grid, 1)  # a 2-D grid, padded for the launcher
    assert stream == 1234
    constexprs = tuple(meta[n] for n in jit.arg_names[len(triton_args):])
    assert_same_arguments(jit.arg_names, direct, (*triton_args, *constexprs))


def test_paged_signature_tracks_scales_and_options(fake_paged):
    from test_paged import PCase, make

    paged, jit = fake_paged
    args, kwargs = make(PCase(cache_dtype=torch.float8_e4m3fn))
    call = paged.fused_qk_norm_rope_paged
    call(*args, **kwargs)
    call(*args, **kwargs)
    assert len(jit.launches) == 1
    call(*args, **{**kwargs, "k_scale": 0.5})          # another float scale: another signature
    call(*args, **{**kwargs, "k_scale": 1})            # an int scale works like 1.0
    call(*args, **{**kwargs, "k_scale": 1.0})
    assert len(jit.launches) == 3 and len(jit.compiled.runs) == 2
    with pytest.raises(TypeError, match="k_scale"):
        call(*args, **{**kwargs, "k_scale": "0.5"})
    call(*args, **{**kwargs, "rotary_style": "gptj"})  # options are part of the signature
    assert len(jit.launches) == 4
