"""The native fast path (``ops/_launch.py`` + ``csrc/fast_path.cpp``), exercised on any machine
with a stand-in for Triton's compiled kernel: a repeated call passes exactly the parameters
Triton's own launch got, and only for the argument signature its plan was built from."""

import gc
import struct
import warnings
import weakref

import numpy as np
import pytest
import torch
from helpers import Case, make_inputs
from test_qknorm_rope import PCase, make

import qkrope
from qkrope.ops import _launch, _native
from qkrope.ops.qknorm_rope import launcher
from qkrope.ops.qknorm_rope.kernel import qknorm_rope_kernel

_TRITON_VERIFIED = _launch._triton_verified
_FORMATS = {"p": "Q", "i": "i", "l": "q", "f": "f"}


class FakeCompiled:
    """Stands in for Triton's CompiledKernel: what the native plan reads of it."""

    function = 0
    metadata_fields = {"num_ctas": 1, "num_warps": 2, "shared": 0}

    def __init__(self, signature):
        self.src = type("Src", (), {"signature": signature})()
        self.metadata = type("Md", (), dict(self.metadata_fields))()
        self.run = type("Run", (), dict(launch_cooperative_grid=False, launch_pdl=False,
                                        global_scratch_size=0, profile_scratch_size=0))()


class FakeJit:
    """Stands in for the @triton.jit kernel: records checked launches (keyword arguments) and
    returns a FakeCompiled whose signature types them as Triton would (1 is specialised)."""

    arg_names = qknorm_rope_kernel.arg_names
    fn = qknorm_rope_kernel.fn

    def __init__(self):
        self.launches = []
        self.compiled = []  # a weak reference to each FakeCompiled returned

    def __getitem__(self, grid):
        def launch(**kwargs):
            self.launches.append((grid, kwargs))
            compiled = FakeCompiled({n: _triton_type(kwargs[n]) for n in self.arg_names})
            self.compiled.append(weakref.ref(compiled))
            return compiled
        return launch


def _triton_type(x):
    if isinstance(x, torch.Tensor):
        return "*" + str(x.dtype).removeprefix("torch.")
    if isinstance(x, float):
        return "fp32"
    if isinstance(x, bool) or x is None or isinstance(x, str) or x == 1:
        return "constexpr"
    return "i32" if -2**31 <= x < 2**31 else "i64"


def triton_params(names, kwargs, signature) -> bytes:
    """The kernel parameters of a Triton launch as the driver receives them: each runtime
    argument at its C size (tensors as addresses), constexprs left out, two null scratch
    pointers appended."""
    out = b""
    for n in names:
        kind = _launch.param_kinds({n: signature[n]})[0]
        if kind == "c":
            continue
        v = kwargs[n]
        out += struct.pack("<" + _FORMATS[kind], v.data_ptr() if isinstance(v, torch.Tensor) else v)
    return out + struct.pack("<QQ", 0, 0)


@pytest.fixture
def fake(monkeypatch):
    """Native helpers built and pinned; plans made without a driver (check_driver=False) and
    'launched' by recording the parameters the driver would get."""
    module = _native.load(force=True)
    if module is None:
        pytest.skip(f"native helpers unavailable: {_native.status()}")
    runs = []

    class Module:
        signature, outputs, params, bump = (module.signature, module.outputs, module.params,
                                            module.bump)

        @staticmethod
        def make_launch(*args):
            return module.make_launch(*args, False)

        @staticmethod
        def launch(plan, stream, *values):
            runs.append((stream, module.params(plan, *values)))

        # The registered op's C++ route: what the launcher tells it, kept here.
        served, added = [], []

        @staticmethod
        def serve_op(*args):
            Module.served.append(args)
            return True

        @staticmethod
        def add_plan(op, options, signature, plan):
            Module.added.append((op, options, signature))
            return True

        @staticmethod
        def clear_plans(op):
            Module.added.clear()

    jit = FakeJit()
    jit.module = Module
    for name, value in (("signature_fn", lambda: Module.signature),
                        ("outputs_fn", lambda: Module.outputs),
                        ("bump_fn", lambda: Module.bump), ("module", lambda: Module),
                        ("start_build", lambda force=False: None)):
        monkeypatch.setattr(_native, name, value)
    monkeypatch.setattr(_launch, "interpreting", lambda: False)
    monkeypatch.setattr(_launch, "raw_stream", lambda index: 1234)
    monkeypatch.setattr(_launch, "current_device", lambda: -1)  # CPU get_device()
    monkeypatch.setattr(_launch, "_no_launch_hooks", lambda: True)
    # The stand-in is what the route reads of a compiled kernel: any installed Triton will do.
    monkeypatch.setattr(_launch, "_triton_verified", lambda: True)
    monkeypatch.setattr(launcher.LAUNCHER, "kernel", jit)
    monkeypatch.setattr(launcher.LAUNCHER, "plans", {})
    monkeypatch.setattr(launcher.LAUNCHER, "_op_served", False)
    # torch.cuda.device stood in below breaks torch's own device lookups: the capability that
    # picks the FP8 conversion (on a GPU machine the calls' tensors are CUDA ones) is read first.
    capabilities = {torch.device("cuda", i): torch.cuda.get_device_capability(i)
                    for i in range(torch.cuda.device_count())}
    monkeypatch.setattr(launcher, "_capability", capabilities.__getitem__)
    monkeypatch.setattr(torch.cuda, "device", lambda d: _Nothing())
    return jit, runs


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def bhsd_call(variant):
    args = make_inputs(Case(B=2, S=5, noncontig=True))
    kwargs = dict(query_out=torch.empty_like(args[0]), key_out=torch.empty_like(args[1]))
    if variant == "mrope":
        kwargs.update(mrope_section=(12, 10, 10), mrope_interleaved=True)
        args = (*args[:3], torch.stack([args[3], args[3] + 1, args[3] * 2]), *args[4:])
    return qkrope.fused_rope_with_qk_norm_and_kv_cache_update, args, kwargs


def paged_call(variant):
    fp8 = variant.startswith("fp8")
    args, kwargs = make(PCase(cache_dtype=torch.float8_e4m3fn if fp8 else None,
                              per_head_scale=variant == "fp8-per-head", style="gptj",
                              rotary_dim=32))
    kwargs.update(query_out=torch.empty_like(args[0]), key_out=torch.empty_like(args[1]))
    return qkrope.fused_qk_norm_rope_paged, args, kwargs


CALLS = {"bhsd": lambda: bhsd_call(""), "bhsd-mrope": lambda: bhsd_call("mrope"),
         "paged-gptj-partial": lambda: paged_call(""), "paged-fp8": lambda: paged_call("fp8"),
         "paged-fp8-per-head": lambda: paged_call("fp8-per-head")}


@pytest.mark.parametrize("name", list(CALLS))
def test_fast_path_passes_what_triton_got(fake, name):
    jit, runs = fake
    op, args, kwargs = CALLS[name]()
    op(*args, **kwargs)
    assert len(jit.launches) == 1 and not runs
    op(*args, **kwargs)
    assert len(jit.launches) == 1 and len(runs) == 1, "second call not through the plan"
    grid, triton_args = jit.launches[0]
    stream, params = runs[0]
    assert stream == 1234
    expected = triton_params(FakeJit.arg_names, triton_args,
                             {n: _triton_type(triton_args[n]) for n in FakeJit.arg_names})
    # Absent scales: Triton got a dummy pointer, the plan a null one (never read).
    absent = [f"{n}_ptr" for n in ("k_scale", "v_scale", "q_scale", "k_scale_cache",
                                   "v_scale_cache") if n not in kwargs]
    expected = _null_scales(expected, triton_args, absent)
    assert _null_scales(params, triton_args, absent) == expected
    # The plan also went to the registered op's C++ kernel, under the op's options argument.
    served, added = jit.module.served, jit.module.added
    assert [s[:2] for s in served] == [("qkrope::qknorm_rope", "qkrope::qknorm_rope_checked")]
    assert served[0][3:] == (17, 1, "CUDA") and len(added) == 1
    op_name, options, signature = added[0]
    assert op_name == "qkrope::qknorm_rope" and options.startswith("(")


def _null_scales(params: bytes, triton_args, names) -> bytes:
    """Zero the parameter slots ``names`` (the absent scales' pointers)."""
    offset = 0
    out = bytearray(params)
    for n in FakeJit.arg_names:
        kind = _launch.param_kinds({n: _triton_type(triton_args[n])})[0]
        if kind == "c":
            continue
        size = struct.calcsize(_FORMATS[kind])
        if n in names:
            out[offset:offset + size] = bytes(size)
        offset += size
    return bytes(out)


@pytest.mark.parametrize("name", ["bhsd", "paged-fp8"])
def test_new_signature_takes_the_checked_path(fake, name):
    jit, runs = fake
    op, args, kwargs = CALLS[name]()
    args = list(args)
    op(*args, **kwargs)
    op(*args, **kwargs)
    assert len(jit.launches) == 1 and len(runs) == 1
    # Same shapes, other strides (a transposed copy viewed back): a new signature.
    args[0] = args[0].transpose(0, 1).contiguous().transpose(0, 1)
    op(*args, **kwargs)
    assert len(jit.launches) == 2
    # A non-float epsilon is checked (and converted) on the checked path, never reused
    # blindly; once converted, the registered op's body finds the signature's plan.
    n = len(runs)
    op(*args[:10], 1, **kwargs)
    assert len(jit.launches) == 2 and len(runs) == n + 1
    with pytest.raises(ValueError, match="rms_norm_eps"):
        op(*args[:10], -1.0, **kwargs)
    op(*args, **{**kwargs, "rotary_style": "gptj" if name == "bhsd" else "neox"})
    assert len(jit.launches) == 3, "options are part of the signature"


@pytest.mark.parametrize("change, error, words", [
    (dict(mrope_interleaved=1), TypeError, "mrope_interleaved"),
    (dict(mrope_interleaved=np.bool_(True)), TypeError, "mrope_interleaved"),
    (dict(rotary_dim=64.0), (TypeError, ValueError), "rotary_dim"),
    (dict(rotary_dim=np.int64(64)), (TypeError, ValueError), "rotary_dim"),
    (dict(cos_sin_scale=True), TypeError, "cos_sin_scale"),
    (dict(norm_weight_offset=False), TypeError, "norm_weight_offset"),
], ids=["interleaved_int", "interleaved_numpy", "rotary_dim_float", "rotary_dim_numpy",
        "scale_bool", "offset_bool"])
def test_an_option_equal_to_a_plans_but_of_another_type_meets_the_checks(fake, change, error,
                                                                          words):
    # A plan is found by ==: True == 1 == 1.0 and numpy scalars hash alike, so without a type
    # test a warm plan would run what the checks refuse.
    jit, runs = fake
    op, args, kwargs = CALLS["bhsd-mrope"]()
    op(*args, **kwargs)
    op(*args, **kwargs)
    assert len(runs) == 1
    with pytest.raises(error, match=words):
        op(*args, **{**kwargs, **change})
    assert len(runs) == 1 and len(jit.launches) == 1


def test_bhsd_tensors_given_to_the_paged_entry_point_meet_its_checks(fake):
    jit, runs = fake
    op, args, kwargs = CALLS["bhsd"]()
    op(*args, **kwargs)
    op(*args, **kwargs)
    with pytest.raises(ValueError, match="query must have rank 3"):
        qkrope.fused_qk_norm_rope_paged(*args, cache_layout="bhsd", **kwargs)
    assert len(runs) == 1


def test_allocated_outputs_match_the_checked_path(fake):
    jit, runs = fake
    args = make_inputs(Case(B=2, S=5))
    q1, k1, _, _ = qkrope.run(*args)
    q2, k2, _, _ = qkrope.run(*args)
    assert runs, "second call not through the plan"
    for a, b in ((q1, q2), (k1, k2)):
        assert (a.shape, a.stride(), a.dtype, a.device) == (b.shape, b.stride(), b.dtype,
                                                            b.device)


@pytest.mark.parametrize("name", ["bhsd", "paged"])
def test_a_call_that_leaves_its_outputs_to_the_op_skips_the_checks(fake, monkeypatch, name):
    # The checked call allocates the outputs before the registered op plans the launch; the
    # plan must also serve the same call with the outputs absent, or every allocating eager
    # call runs the Python checks (3.2x the host time of c8a1d67 on the H200).
    from qkrope.ops.qknorm_rope import api

    jit, runs = fake
    checks = []
    for fn in ("check_bhsd", "check_paged"):
        real = getattr(api, fn)
        monkeypatch.setattr(api, fn, lambda *a, real=real: checks.append(1) or real(*a))
    if name == "bhsd":
        args, kwargs, op = make_inputs(Case(B=2, S=3)), {}, qkrope.run
    else:
        (args, kwargs), op = make(PCase(T=3)), qkrope.fused_qk_norm_rope_paged
    op(*args, **kwargs)
    assert len(checks) == 1 and len(jit.launches) == 1 and not runs
    op(*args, **kwargs)
    op(*args, **kwargs)
    assert len(checks) == 1 and len(jit.launches) == 1 and len(runs) == 2
    # Outputs of another layout than the op allocates: checked, then a plan of their own.
    q_out = args[0].transpose(-2, -3).contiguous().transpose(-2, -3)  # new memory, strided
    op(*args, **kwargs, query_out=q_out)
    op(*args, **kwargs, query_out=q_out)
    assert len(checks) == 2 and len(runs) == 3


def test_fast_path_makes_the_tensors_device_current(fake, monkeypatch):
    jit, runs = fake
    entered = []

    class FakeDevice(_Nothing):
        def __init__(self, index):
            entered.append(index)

    args = make_inputs(Case(S=2))
    qkrope.run(*args)
    monkeypatch.setattr(torch.cuda, "device", FakeDevice)
    monkeypatch.setattr(_launch, "current_device", lambda: 7)  # another device current
    qkrope.run(*args)
    assert entered == [args[0].get_device()] and len(runs) == 1


def test_paged_signature_tracks_scales_and_options(fake):
    jit, runs = fake
    args, kwargs = make(PCase(cache_dtype=torch.float8_e4m3fn))
    call = qkrope.fused_qk_norm_rope_paged
    call(*args, **kwargs)
    call(*args, **kwargs)
    assert len(jit.launches) == 1 and len(runs) == 1
    call(*args, **{**kwargs, "k_scale": 0.5})   # another float scale: the same plan, per call
    assert len(jit.launches) == 1 and len(runs) == 2
    call(*args, **{**kwargs, "k_scale": 1})     # an int scale is checked, then works like 1.0
    assert len(jit.launches) == 1 and len(runs) == 3  # (through the plan, once checked)
    for bad in (float("nan"), -1.0, 0.0):       # never through the plan unchecked
        with pytest.raises(ValueError, match="k_scale"):
            call(*args, **{**kwargs, "k_scale": bad})
    with pytest.raises(TypeError, match="k_scale"):
        call(*args, **{**kwargs, "k_scale": "0.5"})
    call(*args, **{**kwargs, "rotary_style": "gptj"})  # options are part of the signature
    assert len(jit.launches) == 2


def test_a_plan_keeps_its_compiled_kernel_alive(fake):
    """Triton (3.8) unloads a kernel's module when its CompiledKernel is freed, e.g. when the
    kernel's cache is dropped; a plan launching that CUfunction must keep the object alive
    until the plan itself goes."""
    jit, runs = fake
    args = make_inputs(Case(S=2))
    qkrope.run(*args)
    gc.collect()  # Triton's cache (the stand-in keeps none) has let the kernel go
    assert jit.compiled[0]() is not None, "the plan let its kernel be freed"
    qkrope.run(*args)
    assert len(runs) == 1
    launcher.LAUNCHER.clear_plans()
    gc.collect()
    assert jit.compiled[0]() is None, "a forgotten plan still holds its kernel"


@pytest.mark.parametrize("field, value", [("instrumentation_mode", "gsan"),
                                          ("shared", 228 * 1024 + 16)])
def test_a_kernel_needing_more_of_tritons_launcher_keeps_it(fake, monkeypatch, field, value):
    """An instrumented kernel (Triton 3.8's gsan appends a parameter) or one whose shared
    memory needs the oversized mode's launch attribute gets no native plan."""
    jit, runs = fake
    monkeypatch.setattr(FakeCompiled, "metadata_fields",
                        {**FakeCompiled.metadata_fields, field: value})
    args = make_inputs(Case(S=2))
    qkrope.run(*args)
    qkrope.run(*args)
    assert len(jit.launches) == 2 and not runs and not launcher.LAUNCHER.plans


@pytest.mark.parametrize("name", ["launch_enter_hook", "launch_exit_hook"])
def test_a_triton_launch_hook_keeps_tritons_launch(name):
    """A native launch would skip the hook (a profiler's, say): none may be installed."""
    chain = getattr(_launch.triton.knobs.runtime, name)
    assert _launch._no_launch_hooks()

    def hook(*args):
        pass

    chain.add(hook)
    try:
        assert not _launch._no_launch_hooks()
    finally:
        chain.remove(hook)
    assert _launch._no_launch_hooks()


def test_unverified_triton_takes_tritons_launch_with_one_warning(fake, monkeypatch):
    jit, runs = fake
    monkeypatch.setattr(_launch, "_triton_verified", _TRITON_VERIFIED)  # the real check
    monkeypatch.setattr(_launch.triton, "__version__", "9.9.0")
    monkeypatch.setattr(_launch, "_warned", set())
    args = make_inputs(Case(S=2))
    with pytest.warns(UserWarning, match="Triton 9.9.0"):
        qkrope.run(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qkrope.run(*args)
    assert len(jit.launches) == 2 and not runs and not launcher.LAUNCHER.plans
    assert _launch.route()[0] == "triton" and "9.9.0" in _launch.route()[1]


def test_first_checked_launch_starts_the_native_build(fake, monkeypatch):
    """Until the native helpers are loaded there is no native signature to key a plan by; the
    first eager GPU launch must still start their build, or the fast path never comes."""
    jit, runs = fake
    started = []
    monkeypatch.setattr(_native, "signature_fn", lambda: None)
    monkeypatch.setattr(_native, "start_build", lambda force=False: started.append(force))
    qkrope.run(*make_inputs(Case(S=2)))
    assert len(jit.launches) == 1 and started == [False]
    assert not runs and not launcher.LAUNCHER.plans


# --------------------------------------------------------------------------------------------
# tiling (pick_config on a GPU's rule, the SM count stood in)
# --------------------------------------------------------------------------------------------
@pytest.fixture
def h200_sms(monkeypatch):
    launcher.pick_config.cache_clear()
    monkeypatch.setattr(launcher, "_num_sms", lambda: 132)
    yield
    launcher.pick_config.cache_clear()


@pytest.mark.parametrize("B,T,Hq,Hkv,D,want", [
    (1, 1, 96, 8, 128, (1, 1, 1, 1)),      # suite #1: one head per program
    (4, 1, 96, 8, 128, (1, 1, 1, 1)),      # suite #2, B = 4 decode
    (1, 4, 96, 8, 128, (1, 1, 1, 1)),      # the last tied size
    (1, 5, 96, 8, 128, (16, 8, 1, 2)),
    (1, 16, 96, 8, 128, (16, 8, 1, 2)),    # 2.66 -> 2.14 µs measured
    (16, 1, 96, 8, 128, (16, 8, 1, 2)),    # a 16-sequence decode step: 2.62 -> 2.14
    (1, 32, 32, 8, 128, (16, 8, 1, 2)),    # qwen3-8b: 2.43 -> 2.11
    (1, 8, 16, 4, 256, (1, 1, 1, 1)),      # qwen3.5-27b, heads of 256: 2.21 against 2.40
    (1, 44, 16, 4, 256, (8, 4, 1, 2)),     # ... until its 3 tiles a token fill the SMs
    (1, 4096, 96, 8, 128, (16, 8, 1, 2)),
])
def test_pick_config_one_head_per_program_only_for_a_few_tokens(h200_sms, B, T, Hq, Hkv, D, want):
    assert tuple(launcher.pick_config(B, T, Hq, Hkv, D, False)) == want


def test_pick_config_keeps_big_tiles_when_even_a_few_tokens_fill_the_chip(h200_sms):
    # 4 tokens of 2048 query heads: 4 * (128 + 1) programs of 16 heads already exceed 132 SMs.
    assert tuple(launcher.pick_config(1, 4, 2048, 8, 128, False)) == (16, 8, 1, 2)


@pytest.mark.parametrize("B, T, want", [
    (1, 128, (16, 4, 1, 2)),   # #3: INT8 per-token-head caches take 4 KV heads a program
    (64, 1, (16, 4, 1, 2)),    # p1
    (2, 256, (16, 4, 1, 2)),   # #4
    (1, 541, (16, 8, 1, 2)),   # #10: past 512 tokens the usual tile
    (1, 1, (1, 1, 1, 1)),      # a decode step: one head a program either way
])
def test_pick_config_narrows_kv_tiles_only_for_int8_caches_of_few_tokens(h200_sms, B, T, want):
    assert tuple(launcher.pick_config(B, T, 96, 8, 128, False, True)) == want
    assert launcher.pick_config(B, T, 96, 8, 128, False)[1] == (1 if B * T == 1 else 8)


@pytest.mark.parametrize("B, T, want, want_int8", [
    (1, 128, (8, 4, 1, 2), None),    # #3: an FP8 query beside per-token-head caches, 8 + 4 heads
    (64, 1, (8, 4, 1, 2), None),     # p1
    (1, 129, (16, 8, 1, 2), (16, 4, 1, 2)),  # past 128 tokens the usual tile (INT8: its own)
    (1, 293, (16, 8, 1, 2), (16, 4, 1, 2)),  # #8
    (2, 512, (16, 8, 1, 2), None),   # #9: past 512 tokens the usual tile either way
    (1, 1, (1, 1, 1, 1), None),      # a decode step: one head a program either way
])
def test_pick_config_narrows_q_and_kv_tiles_for_an_fp8_query_of_few_tokens(h200_sms, B, T,
                                                                         want, want_int8):
    assert tuple(launcher.pick_config(B, T, 96, 8, 128, False, False, True)) == want
    assert tuple(launcher.pick_config(B, T, 96, 8, 128, False, True, True)) == (want_int8
                                                                                 or want)


class _Picked(Exception):
    pass


@pytest.mark.parametrize("kv, q_out, want", [
    ("bf16", torch.bfloat16, (16, 8, 1, 2)),
    ("fp8", torch.float8_e4m3fn, (16, 8, 1, 2)),        # per-tensor cache scales
    ("fp8-pth", torch.bfloat16, (16, 8, 1, 2)),         # a bf16 query: the usual tile
    ("fp8-pth", torch.float8_e4m3fn, (8, 4, 1, 2)),
    ("int8-pth", torch.bfloat16, (16, 4, 1, 2)),
    ("int8-pth", torch.float8_e4m3fn, (8, 4, 1, 2)),
])
def test_a_call_takes_the_tile_of_its_stores(h200_sms, monkeypatch, kv, q_out, want):
    # What launch() tells pick_config of its stores, from the tensors it is given: 128 tokens of
    # 96 / 8 heads, the call stopped at the pick (the GPU's rule, not the interpreter's).
    seen, rule = [], launcher.pick_config.__wrapped__

    def pick(*a):
        seen.append(rule(*a[:5], False, *a[6:]))
        raise _Picked

    pick.cache_clear = lambda: None  # (h200_sms clears the cache before this is undone)
    monkeypatch.setattr(launcher, "pick_config", pick)
    args = list(make_inputs(Case(B=1, Hq=96, Hkv=8, S=128, D=128, L=128)))
    kw = {}
    if kv != "bf16":
        dtype = torch.int8 if kv == "int8-pth" else torch.float8_e4m3fn
        args[4], args[5] = args[4].to(dtype), args[5].to(dtype)
        kw.update(dict(k_scale_cache=args[4].new_zeros(args[4].shape[:-1], dtype=torch.float),
                       v_scale_cache=args[5].new_zeros(args[5].shape[:-1], dtype=torch.float))
                  if kv.endswith("pth") else dict(k_scale=0.05, v_scale=0.05))
    if q_out != torch.bfloat16:
        kw.update(query_out=args[0].new_empty(args[0].shape, dtype=q_out), q_scale=0.01)
    with pytest.raises(_Picked):
        qkrope.fused_rope_with_qk_norm_and_kv_cache_update(*args, **kw)
    assert tuple(seen[0]) == want


@pytest.mark.parametrize("name", ["bhsd", "paged-fp8"])
def test_fast_path_bumps_what_it_writes(fake, name):
    # The native bump(): the caches (and a scale cache where given) and every output, as the
    # checked path's increment_version; never a tensor that is only read.
    jit, runs = fake
    op, args, kwargs = CALLS[name]()
    op(*args, **kwargs)
    written = [args[4], args[5], kwargs["query_out"], kwargs["key_out"]]
    read = [args[0], args[1], args[2], args[3]]
    before = [t._version for t in written + read]
    op(*args, **kwargs)
    assert len(runs) == 1, "second call not through the plan"
    after = [t._version for t in written + read]
    assert [a - b for a, b in zip(after, before)] == [1] * len(written) + [0] * len(read)


def test_fast_path_takes_inference_caches_outside_inference_mode(fake):
    # Caches made under torch.inference_mode() have no version counter: the fast path skips
    # them as the checked path (torch._C._increment_version) does, instead of raising after
    # its launch.
    jit, runs = fake
    op, args, kwargs = CALLS["bhsd"]()
    with torch.inference_mode():
        caches = args[4].clone(), args[5].clone()
    args = (*args[:4], *caches, *args[6:])
    op(*args, **kwargs)
    op(*args, **kwargs)
    assert len(runs) == 1, "second call not through the plan"
