"""HF transformers drop-in for the Qwen3 family: the same greedy tokens and the same cache
contents, bit for bit, with and without the patch, on tiny randomly initialised models (no
downloads); patch-time and call-time fallbacks that never raise."""

import inspect
import warnings

import pytest
import torch
from helpers import DEVICE
from torch._dynamo.testing import CompileCounter

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, StaticCache  # noqa: E402

import qkrope.integrations.transformers as integ  # noqa: E402
from qkrope.integrations.transformers import (  # noqa: E402
    FallbackWarning, is_patched, patch, patch_qwen3, unpatch, unpatch_qwen3,
)

VOCAB = 128
IMAGE, VIDEO, VISION_START, VISION_END = 100, 101, 102, 103
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-6,
            max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.2)
# Gated-delta-net layers of Qwen3.5 / Qwen3-Next, as small as they go.
LINEAR = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=2, layer_types=["linear_attention", "full_attention"])
# Qwen3.5 / Qwen3-Next rotary: partial_rotary_factor 0.25 of head_dim 64 -> 16 rotated dims, 8
# frequencies; the (interleaved) mRoPE section covers them: W at 2, 5, H at 1, 4, 7, T elsewhere.
PARTIAL_MROPE = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25,
                 "mrope_section": [2, 3, 3], "mrope_interleaved": True}
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=2,
              temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64,
              num_position_embeddings=16)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def _randomize_norms(model, offset_norm: bool):
    # Random q/k norm weights, or a kernel that ignored them (or the wrong offset) would pass.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_((0.0 if offset_norm else 1.0) + 0.5 * torch.randn_like(p))


def _prompt(batch):
    # Left padding on the last sequence: per-sequence positions (cumsum of the mask).
    mask = torch.ones(batch, 6, dtype=torch.long, device=DEVICE)
    mask[1:, :2] = 0
    return {"input_ids": torch.randint(0, IMAGE, (batch, 6), device=DEVICE),
            "attention_mask": mask}


def _image_prompt():
    # One 4x4-patch image (2x2 merged tokens): its tokens get 3 differing position streams
    # (temporal, height, width) and the text after it a rope delta.
    ids = torch.tensor([[5, 6, VISION_START, IMAGE, IMAGE, IMAGE, IMAGE, VISION_END, 7, 8]],
                       device=DEVICE)
    return {"input_ids": ids, "mm_token_type_ids": (ids == IMAGE).long(),
            "image_grid_thw": torch.tensor([[1, 4, 4]], device=DEVICE),
            "pixel_values": torch.randn(16, 3 * 2 * 2 * 2, device=DEVICE).to(torch.bfloat16)}


def _causal_lm(config_cls, model_cls, offset_norm=False, batch=2, **over):
    def build():
        model = model_cls(config_cls(**{**TEXT, **over}))
        return model, offset_norm, _prompt(batch)
    return build


def _vision_lm(config_cls, model_cls, offset_norm=False, text=None, **vision):
    def build():
        cfg = config_cls(text_config={**TEXT, **(text or {})}, vision_config={**VISION, **vision},
                         image_token_id=IMAGE, video_token_id=VIDEO,
                         vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
        return model_cls(cfg), offset_norm, _image_prompt()
    return build


def _families():
    t = transformers
    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
            "original_max_position_embeddings": 8}
    # Rotary embeddings whose inv_freq changes with the positions seen (before the layers run).
    dynamic = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    longrope = {"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 8,
                "short_factor": [1.0 + 0.1 * i for i in range(32)],
                "long_factor": [2.0 + 0.2 * i for i in range(32)]}
    vl_rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [12, 10, 10],
               "mrope_interleaved": True}
    return {
        "qwen3": _causal_lm(t.Qwen3Config, t.Qwen3ForCausalLM),
        "qwen3-yarn": _causal_lm(t.Qwen3Config, t.Qwen3ForCausalLM, rope_parameters=yarn),
        "qwen3-dynamic": _causal_lm(t.Qwen3Config, t.Qwen3ForCausalLM, rope_parameters=dynamic,
                                    max_position_embeddings=8),
        "qwen3-longrope": _causal_lm(t.Qwen3Config, t.Qwen3ForCausalLM,
                                     rope_parameters=longrope),
        "qwen3-moe": _causal_lm(t.Qwen3MoeConfig, t.Qwen3MoeForCausalLM, batch=1, **MOE),
        "qwen3-vl": _vision_lm(t.Qwen3VLConfig, t.Qwen3VLForConditionalGeneration,
                               text={"rope_parameters": vl_rope},
                               deepstack_visual_indexes=[0]),
        "qwen3-vl-moe": _vision_lm(t.Qwen3VLMoeConfig, t.Qwen3VLMoeForConditionalGeneration,
                                   text={"rope_parameters": vl_rope, **MOE},
                                   deepstack_visual_indexes=[0]),
        "qwen3.5": _causal_lm(t.Qwen3_5TextConfig, t.Qwen3_5ForCausalLM, offset_norm=True,
                              rope_parameters=PARTIAL_MROPE, **LINEAR),
        "qwen3.5-vl": _vision_lm(t.Qwen3_5Config, t.Qwen3_5ForConditionalGeneration,
                                 offset_norm=True,
                                 text={"rope_parameters": PARTIAL_MROPE, **LINEAR}),
        "qwen3.5-moe": _causal_lm(t.Qwen3_5MoeTextConfig, t.Qwen3_5MoeForCausalLM,
                                  offset_norm=True, batch=1, rope_parameters=PARTIAL_MROPE,
                                  shared_expert_intermediate_size=32, **MOE, **LINEAR),
        "qwen3-next": _causal_lm(t.Qwen3NextConfig, t.Qwen3NextForCausalLM, offset_norm=True,
                                 batch=1, shared_expert_intermediate_size=32, **MOE, **LINEAR),
    }


FAMILIES = _families()


def build(family, seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    model, offset_norm, inputs = FAMILIES[family]()
    model = model.to(DEVICE, dtype).eval()
    _randomize_norms(model, offset_norm)
    return model, inputs


def cache_kwarg(model) -> str:
    """The model's name for its cache argument: ``cache`` from transformers 5.24 (where the old
    name warns), ``past_key_values`` in earlier 5.x (the GPU machine has 5.17)."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters \
        else "past_key_values"


def generate(model, inputs, new_tokens=4, cache="static", disable_compile=True):
    # generate() compiles the decode step of a StaticCache model on GPUs by default; Inductor
    # then keeps the stock norm and rotary in fp32 between ops, which changes ~3% of the
    # stock model's own layer-0 keys (H200, transformers 5.17). The stock eager model is the
    # reference the patch must reproduce bit for bit.
    if hasattr(model.model, "rope_deltas"):
        model.model.rope_deltas = None  # VL models keep the last prompt's mRoPE offsets
    if cache == "static":
        cache = StaticCache(config=model.config, max_cache_len=inputs["input_ids"].shape[1]
                            + new_tokens + 2)
    elif cache == "dynamic":
        cache = DynamicCache(config=model.config)
    out = model.generate(**inputs, **{cache_kwarg(model): cache}, max_new_tokens=new_tokens,
                         do_sample=False, min_new_tokens=new_tokens,
                         disable_compile=disable_compile)
    return out, cache


def cache_tensors(cache):
    """Every tensor a cache holds (K/V rows, linear-attention states), by (layer, name)."""
    out = {}
    for i, layer in enumerate(cache.layers):
        for name, x in vars(layer).items():
            xs = x if isinstance(x, (list, tuple)) else [x]
            for j, t in enumerate(xs):
                if isinstance(t, torch.Tensor):
                    out[(i, name, j)] = t
    return out


def assert_same_cache(cache, stock_cache):
    got, want = cache_tensors(cache), cache_tensors(stock_cache)
    assert got.keys() == want.keys() and any(k[1] == "keys" for k in want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), f"cache {k} differs"


@pytest.fixture
def op_calls(monkeypatch):
    """Every call of the fused op from the integration: its positions and options."""
    calls = []
    real = integ.fused_rope_with_qk_norm_and_kv_cache_update

    def spy(*args, **kwargs):
        calls.append(dict(positions=args[3].clone(), cache_rows=args[4].shape[2], **kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(integ, "fused_rope_with_qk_norm_and_kv_cache_update", spy)
    return calls


@pytest.fixture(autouse=True)
def fresh_call_warnings():
    integ._warned.clear()  # call-time fallbacks warn once per process and reason
    yield


def full_attention_count(model):
    return sum(type(m).__name__ in integ.SUPPORTED_ATTENTION for m in model.modules())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_generates_the_same_tokens_and_cache(family, op_calls):
    model, inputs = build(family)
    stock_tokens, stock_cache = generate(model, inputs)
    n_attn = full_attention_count(model)
    assert patch(model) == n_attn >= 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        tokens, cache = generate(model, inputs)
    assert torch.equal(tokens, stock_tokens)
    assert_same_cache(cache, stock_cache)

    # One launch per patched layer and forward (prefill + 3 decode steps), writing the cache.
    assert len(op_calls) == 4 * n_attn and all(c["cache_rows"] > 1 for c in op_calls)
    text = model.config.get_text_config(decoder=True)
    rope = text.rope_parameters
    rot = next(m for m in model.modules() if type(m).__name__ in integ._ROTARY)
    first = op_calls[0]
    assert first["cos_sin_scale"] == rot.attention_scaling
    assert first["rotary_dim"] == int(text.head_dim * rope.get("partial_rotary_factor", 1.0))
    if family in ("qwen3-yarn", "qwen3-longrope"):
        assert rot.attention_scaling != 1.0
    if family in ("qwen3-dynamic", "qwen3-longrope"):  # the generation went past the original
        assert not torch.equal(rot.inv_freq, rot.original_inv_freq)
    if inputs["input_ids"].shape[0] > 1:  # left padding: each sequence its own positions
        pos = first["positions"]
        assert pos.shape[-2] == 2 and not torch.equal(pos[..., 0, :], pos[..., 1, :])
    if "vl" in family:  # the prompt's image tokens: 3 streams that really differ
        pos = first["positions"]
        assert pos.shape[0] == 3 and not torch.equal(pos[0], pos[1])
        assert not torch.equal(pos[1], pos[2])
    if "linear_attention" in (getattr(text, "layer_types", None) or ()):
        linear = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
        assert linear and not any("forward" in m.__dict__ for m in linear)

    assert unpatch(model) == n_attn
    assert not any(is_patched(m) or "forward" in m.__dict__ for m in model.modules())
    again, _ = generate(model, inputs)
    assert torch.equal(again, stock_tokens)


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_float16_models(family):
    model, inputs = build(family, seed=1, dtype=torch.float16)
    stock_tokens, stock_cache = generate(model, inputs)
    assert patch(model) == full_attention_count(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        tokens, cache = generate(model, inputs)
    assert torch.equal(tokens, stock_tokens)
    assert_same_cache(cache, stock_cache)


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_dynamic_cache_takes_the_op_without_its_cache_write(family, op_calls):
    # generate()'s default cache: the op computes the rotated Q/K (its cache write skipped),
    # the stock cache.update stores them.
    model, inputs = build(family, seed=3)
    stock_tokens, stock_cache = generate(model, inputs, cache="dynamic")
    patch(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        tokens, cache = generate(model, inputs, cache="dynamic")
    assert torch.equal(tokens, stock_tokens)
    assert_same_cache(cache, stock_cache)
    assert op_calls and all(c["cache_rows"] == 1 for c in op_calls)


def test_sliding_window_layers_through_the_stock_cache_update(op_calls):
    torch.manual_seed(4)
    cfg = transformers.Qwen3Config(**{**TEXT, "use_sliding_window": True, "sliding_window": 4,
                                      "max_window_layers": 1})
    model = transformers.Qwen3ForCausalLM(cfg).to(DEVICE, torch.bfloat16).eval()
    _randomize_norms(model, False)
    inputs = _prompt(2)
    stock_tokens, stock_cache = generate(model, inputs, new_tokens=5)
    assert [type(layer).__name__ for layer in stock_cache.layers] == [
        "StaticLayer", "StaticSlidingWindowLayer"]
    assert patch(model) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        tokens, cache = generate(model, inputs, new_tokens=5)
    assert torch.equal(tokens, stock_tokens)
    assert_same_cache(cache, stock_cache)
    assert sorted({c["cache_rows"] > 1 for c in op_calls}) == [False, True]


def _tiny_qwen3(seed=0, dtype=torch.bfloat16, **over):
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**TEXT, **over}))
    model = model.to(DEVICE, dtype).eval()
    _randomize_norms(model, False)
    return model


@pytest.mark.parametrize("over, dtype, reason", [
    ({"head_dim": 16}, torch.bfloat16, "head_dim 16"),
    ({}, torch.float32, "float32 weights"),
])
def test_unsupported_layers_are_left_alone_with_one_warning(over, dtype, reason, op_calls):
    model = _tiny_qwen3(seed=5, dtype=dtype, **over)
    inputs = _prompt(1)
    stock_tokens, stock_cache = generate(model, inputs)
    with pytest.warns(FallbackWarning) as record:
        assert patch(model) == 0
    assert len(record) == 1 and reason in str(record[0].message)
    assert "2 of 2 attention layers" in str(record[0].message)
    assert not any(is_patched(m) or "forward" in m.__dict__ for m in model.modules())
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        tokens, cache = generate(model, inputs)
    assert torch.equal(tokens, stock_tokens) and not op_calls
    assert_same_cache(cache, stock_cache)


def test_mixed_model_patches_only_the_layers_the_op_can_run(op_calls):
    model = _tiny_qwen3(seed=6)
    model.model.layers[1].self_attn.k_norm.variance_epsilon = 1e-5  # one eps for q and k only
    inputs = _prompt(2)
    stock_tokens, stock_cache = generate(model, inputs)
    with pytest.warns(FallbackWarning, match="1 of 2 attention layers .* epsilons differ"):
        assert patch(model) == 1
    assert [is_patched(layer.self_attn) for layer in model.model.layers] == [True, False]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        tokens, cache = generate(model, inputs)
    assert torch.equal(tokens, stock_tokens)
    assert_same_cache(cache, stock_cache)
    assert len(op_calls) == 4  # layer 0 only, 4 forwards


def test_call_time_rejection_falls_back_for_that_call():
    # Patched in bf16, then converted to fp32: the op's own check rejects each call, and the
    # stock forward runs it instead, with one warning.
    model = _tiny_qwen3(seed=7)
    assert patch(model) == 2
    model.float()
    inputs = _prompt(1)
    with pytest.warns(FallbackWarning, match="the op rejected it: query must be"):
        tokens, cache = generate(model, inputs)
    unpatch(model)
    stock_tokens, stock_cache = generate(model, inputs)
    assert torch.equal(tokens, stock_tokens)
    assert_same_cache(cache, stock_cache)


def test_autograd_training_and_foreign_position_embeddings_fall_back():
    model = _tiny_qwen3(seed=8)
    ids = _prompt(1)["input_ids"]
    stock = model(ids).logits
    patch(model)
    with pytest.warns(FallbackWarning, match="autograd is recording"):
        logits = model(ids).logits  # grad enabled: the op has no backward
    assert logits.grad_fn is not None and torch.equal(logits, stock)

    model.train()
    with torch.no_grad(), pytest.warns(FallbackWarning, match="training"):
        model(ids)
    model.eval()

    # A layer called on its own: no positions of a forward (the last layer released them).
    attn = model.model.layers[0].self_attn
    # (as long as the prompt: positions left over from the forward above would fit)
    h = torch.randn(1, ids.shape[1], TEXT["hidden_size"], device=DEVICE, dtype=torch.bfloat16)
    cos = torch.ones(1, ids.shape[1], 64, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        with pytest.warns(FallbackWarning, match="rotary embedding has not run"):
            out, _ = attn(h, (cos, torch.zeros_like(cos)), None)
        # The same compiled: no positions left over from the forward above.
        try:
            compiled, _ = torch.compile(attn, backend="eager")(h, (cos, torch.zeros_like(cos)),
                                                               None)
        finally:
            torch._dynamo.reset()
        # In a forward, with position embeddings its model's rotary did not make.
        foreign = attn.register_forward_pre_hook(
            lambda mod, args, kwargs: (args, {**kwargs, "position_embeddings": (
                cos, torch.zeros_like(cos))}), with_kwargs=True)
        with pytest.warns(FallbackWarning, match="position_embeddings were not computed"):
            got = model(ids).logits
        try:  # the same check compiled (it once held in eager only)
            got_compiled = torch.compile(model, backend="eager")(ids).logits
        finally:
            torch._dynamo.reset()
        unpatch(model)
        want = model(ids).logits
        foreign.remove()
        want_out, _ = attn(h, (cos, torch.zeros_like(cos)), None)
    assert torch.equal(out, want_out) and torch.equal(compiled, want_out)
    assert torch.equal(got, want) and torch.equal(got_compiled, want)


def test_patch_is_idempotent_and_the_old_names_still_work():
    model = _tiny_qwen3(seed=9)
    assert patch_qwen3(model) == 2 and patch(model) == 2
    rotary = model.model.rotary_emb
    assert type(rotary).forward is integ._rotary_forward
    assert type(rotary).__mro__[1] is transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding
    assert unpatch_qwen3(model) == 2 and unpatch(model) == 0
    assert type(rotary) is transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding
    assert "forward" not in rotary.__dict__ and "_qkrope_state" not in rotary.__dict__


def test_patch_swaps_the_layer_class_and_unpatch_restores_it_and_an_instance_forward():
    # A patched layer is an instance of a subclass of its class with the same name (its
    # forward on the class: no per-layer guards under torch.compile); a forward set on the
    # instance before patch (an accelerate hook) is what its fallback runs, and is back after
    # unpatch.
    model = _tiny_qwen3(seed=9)
    first, second = (blk.self_attn for blk in model.model.layers)
    stock_cls = type(first)
    calls = []

    def hooked(*args, **kwargs):
        calls.append(1)
        return stock_cls.forward(first, *args, **kwargs)

    first.forward = hooked
    rotary = model.model.rotary_emb
    stock_rotary_cls, rotary_calls = type(rotary), []

    def hooked_rotary(*args, **kwargs):
        rotary_calls.append(1)
        return stock_rotary_cls.forward(rotary, *args, **kwargs)

    rotary.forward = hooked_rotary
    assert patch(model) == 2
    for module, cls in ((first, stock_cls), (second, stock_cls), (rotary, stock_rotary_cls)):
        assert type(module) is not cls and isinstance(module, cls)
        assert type(module).__name__ == cls.__name__ and "forward" not in module.__dict__
    assert type(first) is type(second)
    with torch.no_grad():  # the rotary's hook runs inside the patched rotary's forward
        model(**_prompt(1))
    assert rotary_calls == [1] and calls == []
    model.train()  # a call the patched layers hand to what ran before patch
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        model(**_prompt(1))
    assert calls == [1] and rotary_calls == [1, 1]
    assert unpatch(model) == 2
    assert type(first) is stock_cls and type(second) is stock_cls
    assert type(rotary) is stock_rotary_cls and rotary.forward is hooked_rotary
    assert first.forward is hooked and "forward" not in second.__dict__


def test_a_patched_model_survives_torch_save_and_deepcopy(monkeypatch):
    # The patched classes have no importable name: a patched model pickles as the stock classes
    # plus qkrope's role and loads patched, also in a process that never patched (no constants
    # registered there yet), with the same logits; the copy unpatches on its own.
    import copy
    import io

    model = _tiny_qwen3(seed=11)
    assert patch(model) == 2
    inputs = _prompt(2)
    with torch.no_grad():
        want = model(**inputs).logits
    buffer = io.BytesIO()
    saved = model.model.layers[0].self_attn
    key = saved._qkrope_key
    keys = [blk.self_attn._qkrope_key for blk in model.model.layers]
    # As if saved under a transformers that took the cache from the other keyword: the loaded
    # layer takes it from this one's (the wrong one would leave the cache unwritten).
    other = {"cache": "past_key_values", "past_key_values": "cache"}
    saved._qkrope_key = integ._register(integ._STATIC[key]._replace(
        cache_kwarg=other[integ._STATIC[key].cache_kwarg]))
    torch.save(model, buffer)
    saved._qkrope_key = key
    buffer.seek(0)
    monkeypatch.setattr(integ, "_STATIC", {})
    loaded = torch.load(buffer, weights_only=False)
    for copied in (loaded, copy.deepcopy(model)):
        layers = [blk.self_attn for blk in copied.model.layers]
        assert all(is_patched(m) for m in layers) and type(layers[0]) is type(saved)
        assert [m._qkrope_key for m in layers] == keys
        # the copy's layers read the copy's rotary, not the original's
        assert layers[0]._qkrope_rotary_state is copied.model.rotary_emb._qkrope_state
        with torch.no_grad():
            assert torch.equal(copied(**inputs).logits, want)
        assert unpatch(copied) == 2 and is_patched(model.model.layers[0].self_attn)


def test_patch_rejects_models_without_qwen3_attention():
    with pytest.raises(ValueError, match="no Qwen3-family attention"):
        patch(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("family", ["qwen3", "qwen3-vl", "qwen3.5"])
def test_patched_decode_step_compiles_into_one_graph(family):
    # What generate() compiles on GPUs (a StaticCache decode step), traced here on any device:
    # one graph for every step (fullgraph=True: no break, no recompile from the patch or the
    # rotary's position hand-over), the op inside it once per patched layer, same bits as eager.
    model, inputs = build(family, seed=10)
    n_attn = patch(model)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def decode(forward):
        if hasattr(model.model, "rope_deltas"):
            model.model.rope_deltas = None
        cache = StaticCache(config=model.config, max_cache_len=inputs["input_ids"].shape[1] + 4)
        with torch.no_grad():
            nxt = model(**inputs, **{cache_kwarg(model): cache},
                        use_cache=True).logits[:, -1:].argmax(-1)
            steps = []
            for i in range(3):
                # generate()'s positions: text, and for VL models text + the prompt's rope delta
                # in the 3 mRoPE streams.
                pos = torch.full_like(nxt, inputs["input_ids"].shape[1] + i)
                if getattr(model.model, "rope_deltas", None) is not None:
                    vision = pos + model.model.rope_deltas
                    pos = torch.stack([pos, vision, vision, vision])
                nxt = forward(input_ids=nxt, **{cache_kwarg(model): cache}, position_ids=pos,
                              use_cache=True).logits[:, -1:].argmax(-1)
                steps.append(nxt)
        return torch.cat(steps, 1), cache

    eager_tokens, eager_cache = decode(model.forward)
    torch._dynamo.reset()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FallbackWarning)
            tokens, cache = decode(torch.compile(model.forward, backend=backend, fullgraph=True))
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1
    # (a StaticCache: the op that also advances the cache's running length)
    op = torch.ops.qkrope.qknorm_rope_append.default
    assert sum(n.target is op for n in graphs[0].graph.nodes) == n_attn
    assert torch.equal(tokens, eager_tokens)
    assert_same_cache(cache, eager_cache)
    # No output beyond stock's: whatever the patch leaves in its state that the graph made
    # would be returned by the graph and rebuilt on every CUDA-graph replay (design.md,
    # "Compile route").
    unpatch(model)
    try:
        decode(torch.compile(model.forward, backend=backend, fullgraph=True))
    finally:
        torch._dynamo.reset()
    stock, patched = (len(g.graph.output_node().args[0]) for g in (graphs[-1], graphs[-2]))
    assert patched == stock


@pytest.mark.parametrize("family, dynamic", [("qwen3", None), ("qwen3.5", True)])
def test_prefills_of_any_length_compile_as_often_as_stock(family, dynamic):
    # A compiled model fed prompts of several lengths: the second length makes the sizes
    # symbolic (or dynamic=True does from the start), and the patched layers must not pin them
    # (a recompile per length, and past torch's recompile limit the whole forward runs eager).
    model, _ = build(family, seed=13)

    def prefills(forward):
        torch.manual_seed(0)
        cache = StaticCache(config=model.config, max_cache_len=40)
        logits, start = [], 0
        with torch.no_grad():
            for n in (5, 7, 9):
                ids = torch.randint(0, IMAGE, (1, n), device=DEVICE)
                pos = torch.arange(start, start + n, device=DEVICE)[None]
                logits.append(forward(input_ids=ids, position_ids=pos, use_cache=True,
                                      **{cache_kwarg(model): cache}).logits)
                start += n
        return logits

    counts, got = {}, {}
    for variant in ("stock", "patched"):
        if variant == "patched":
            patch(model)
        counter = CompileCounter()
        torch._dynamo.reset()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", FallbackWarning)
                got[variant] = prefills(torch.compile(model.forward, dynamic=dynamic,
                                                      backend=counter))
        finally:
            torch._dynamo.reset()
        counts[variant] = counter.frame_count
    assert counts["patched"] <= counts["stock"], counts
    # The same bits as the stock model traced alike (transformers 5.17 masks attention
    # differently when traced: neither traced model equals its eager self there).
    for p, s in zip(got["patched"], got["stock"]):
        assert torch.equal(p, s)


def _decode_step_guards(layers: int, patched: bool) -> int:
    """Guards the compiled decode step of a ``layers``-layer Qwen3 model evaluates per call."""
    from qkrope.bench.e2e import step_guards

    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **{**TEXT, "num_hidden_layers": layers})).to(DEVICE, torch.bfloat16).eval()
    if patched:
        assert patch(model) == layers
    cache = StaticCache(config=model.config, max_cache_len=8)
    kw = {cache_kwarg(model): cache, "use_cache": True}
    ids = torch.randint(0, IMAGE, (1, 5), device=DEVICE)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            model(ids[:, :4], **kw)
            step = {"position_ids": torch.full((1, 1), 4, device=DEVICE), **kw}
            compiled = torch.compile(model.forward, backend="eager", fullgraph=True)
            compiled(ids[:, 4:], **step)
            found = step_guards(compiled, ids[:, 4:], **step)
            assert found is not None, "the compiled step's guards fail on its own arguments"
            manager, frame = found
            checked = manager.check_verbose(frame)
    finally:
        torch._dynamo.reset()
    assert checked.result, checked.verbose_code_parts
    return checked.num_guards_executed


#: Guards a patched model may check beyond the stock model's, once per model (not per layer):
#: the fields of its two patch-time `_Static`s (12 each) and the functions and constants of the
#: integration's module that its layers read (C++ ID/EQUALS matches, ~40-50 ns each on the GPU
#: hosts: under 2.5 µs per step). Measured, 4 layers, stock / patched: transformers 5.25 (CPU,
#: torch 2.13) 765 / 768; 5.17 708 / 752 (CPU) and 637 / 685 (H100, torch 2.11; 5.25's stock
#: layers also read transformers' kernel-hub rotary function). No room is left: one more
#: module-level function read in a compiled path (its code-object guard) fails this test.
ONCE_PER_MODEL_GUARDS = 48


def test_a_patched_layer_adds_no_guards_to_the_compiled_step():
    # Every guard of a compiled step is evaluated on every call, CUDA-graph replays included
    # (reduce-overhead, generate()): host time the patched model must not add per layer
    # (docs/design.md, "Compile route"). A forward set on the instance, or patch-time fields
    # read one by one from each layer, cost 9 more guards per layer than the stock layer's.
    # 2 and 4 layers: both have the two patch-time keys (the last layer's differs), whose
    # guards are once per key, not per layer.
    guards = {(n, patched): _decode_step_guards(n, patched) for n in (2, 4)
              for patched in (False, True)}
    per_layer = {patched: (guards[4, patched] - guards[2, patched]) / 2
                 for patched in (False, True)}
    assert per_layer[True] <= per_layer[False], (per_layer, guards)
    # And in all: the op is called directly under compile, its checks in its fake (traced,
    # the public function's checks were ~80 guards more than stock's at 4 layers).
    assert guards[4, True] <= guards[4, False] + ONCE_PER_MODEL_GUARDS, guards


def first_steps_logits(model, inputs, compiled: bool) -> tuple:
    """generate()'s first two tokens and the logits they were chosen from (the prompt's, then
    the first decode step's: the step generate() compiles)."""
    if hasattr(model.model, "rope_deltas"):
        model.model.rope_deltas = None
    cache = StaticCache(config=model.config, max_cache_len=inputs["input_ids"].shape[1] + 4)
    out = model.generate(**inputs, **{cache_kwarg(model): cache}, max_new_tokens=2,
                         min_new_tokens=2, do_sample=False, disable_compile=not compiled,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, -2:], [x.float() for x in out.logits]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="generate() compiles only on GPUs")
@pytest.mark.parametrize("family", ["qwen3", "qwen3-vl"])
def test_patched_model_under_generate_compile(family):
    # generate()'s default for a StaticCache on a GPU: the decode step is torch.compile'd and the
    # fused op goes through its registered custom op inside the compiled graph (no fallback).
    # Inductor rounds the rest of the model (its other norms, the MLP) unlike eager, so no
    # compiled model equals the stock eager one bit for bit (H200: the stock model's own layer-0
    # keys change, and one later greedy token did); the patched model, compiled, must stay as
    # close to the stock eager model as the stock model compiled does (within twice its largest
    # logit deviation plus one bf16 ulp), on the steps whose inputs are identical.
    model, inputs = build(family, seed=2)
    eager_tokens, eager = first_steps_logits(model, inputs, compiled=False)
    stock_tokens, stock = first_steps_logits(model, inputs, compiled=True)
    patch(model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FallbackWarning)
            fused_tokens, fused = first_steps_logits(model, inputs, compiled=True)
    finally:
        unpatch(model)
    assert torch.equal(fused_tokens[:, 0], eager_tokens[:, 0])  # the prompt step is eager
    same_input = torch.equal(stock_tokens[:, 0], eager_tokens[:, 0])
    for step in range(2 if same_input else 1):
        ulp = 2.0 ** (torch.floor(torch.log2(eager[step].abs().max())) - 7)
        stock_err = (stock[step] - eager[step]).abs().max()
        fused_err = (fused[step] - eager[step]).abs().max()
        assert fused_err <= 2 * stock_err + ulp, (step, fused_err, stock_err, ulp)


def _decode(model, ids, cache, steps):
    """Greedy decode ``steps`` tokens after prompt ``ids`` into ``cache``, as generate() does
    it with a StaticCache (the model's own cache keyword)."""
    kw = {cache_kwarg(model): cache}
    with torch.no_grad():
        nxt = model(ids, **kw, use_cache=True).logits[:, -1:].argmax(-1)
        for i in range(steps):
            pos = torch.full_like(nxt, ids.shape[1] + i)
            nxt = model(nxt, **kw, position_ids=pos, use_cache=True).logits[:, -1:].argmax(-1)
    return nxt


def test_an_eager_decode_step_reads_the_running_offset_in_place():
    # A patched layer's eager decode step passes the StaticCache's running offset itself as
    # the op's one row: no arange (nor add) of its own, where the stock layer's update makes
    # one per layer; the rows are the same, so are the tokens and caches (the tests above).
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket] += 1
            return func(*args, **(kwargs or {}))

    def aranges(model):
        ids = _prompt(1)["input_ids"]
        kw = {cache_kwarg(model): StaticCache(config=model.config, max_cache_len=8)}
        with torch.no_grad():
            nxt = model(ids, **kw, use_cache=True).logits[:, -1:].argmax(-1)
            with Count() as count:
                model(nxt, **kw, position_ids=torch.full_like(nxt, 6), use_cache=True)
        return count.ops[torch.ops.aten.arange]

    model = _tiny_qwen3(seed=3)
    stock = aranges(model)
    assert patch(model) == model.config.num_hidden_layers
    assert aranges(model) == stock - model.config.num_hidden_layers


_OVERFLOW = """
import sys, torch, transformers
from transformers import StaticCache
from qkrope.integrations.transformers import patch
torch.manual_seed(0)
cfg = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=2, num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-6)
model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg)).cuda().bfloat16().eval()
if sys.argv[1] == "patched":
    assert patch(model) == 2
kw = {"cache" if "cache" in __import__("inspect").signature(type(model).forward).parameters
      else "past_key_values": StaticCache(config=model.config, max_cache_len=8)}
ids = torch.randint(0, 100, (1, 6), device="cuda")
with torch.no_grad():
    nxt = model(ids, **kw, use_cache=True).logits[:, -1:].argmax(-1)
    for i in range(4):
        pos = torch.full_like(nxt, 6 + i)
        nxt = model(nxt, **kw, position_ids=pos, use_cache=True).logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
print("no error")
"""


def test_static_cache_overflow_raises_like_stock():
    # Decoding past max_cache_len: the stock model's index_copy_ raises (IndexError on CPU, a
    # device-side assert on a GPU); the op would skip the rows that do not fit (its padding
    # rule) and go on with wrong tokens, so the patched layer must raise too.
    model = _tiny_qwen3(seed=11)
    ids = _prompt(1)["input_ids"]                       # 6 tokens
    patch(model)
    _decode(model, ids, StaticCache(config=model.config, max_cache_len=8), steps=2)  # fits
    with pytest.raises(IndexError, match="6 new tokens do not fit.*max_cache_len=4"):
        _decode(model, ids, StaticCache(config=model.config, max_cache_len=4), steps=0)
    if DEVICE == "cuda":
        # A device-side assert ends the process's CUDA context: each model in a process of
        # its own.
        import subprocess
        import sys

        for variant in ("stock", "patched"):
            run = subprocess.run([sys.executable, "-c", _OVERFLOW, variant], capture_output=True,
                                 text=True, timeout=300)
            assert run.returncode != 0 and "device-side assert" in run.stderr, (variant, run)
        return
    unpatch(model)
    with pytest.raises(IndexError):
        _decode(model, ids, StaticCache(config=model.config, max_cache_len=8), steps=4)
    patch(model)
    with pytest.raises(IndexError, match="is 8: 1 new rows do not fit a cache of 8 rows"):
        _decode(model, ids, StaticCache(config=model.config, max_cache_len=8), steps=4)


def test_input_gradients_of_a_frozen_model_equal_stock():
    # Prompt tuning / attributions: frozen weights, inputs_embeds that require grad. Autograd
    # records through the layer's input, so the patched layer must take the stock forward.
    model = _tiny_qwen3(seed=12)
    model.requires_grad_(False)
    ids = _prompt(1)["input_ids"]

    def input_grad():
        emb = model.model.embed_tokens(ids).detach().requires_grad_()
        model(inputs_embeds=emb).logits.float().square().sum().backward()
        return emb.grad

    want = input_grad()
    patch(model)
    with pytest.warns(FallbackWarning, match="autograd is recording"):
        got = input_grad()
    assert torch.equal(got, want)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_trainable_module_set_in_after_patch_keeps_its_gradients(compiled):
    # An adapter / new q_proj attached after patch: the patch-time parameters do not know it,
    # so the patched layer checks the op's own inputs (a graph-cut result would lose q_proj's
    # gradient without a word).
    model = _tiny_qwen3(seed=13)
    model.requires_grad_(False)
    ids = _prompt(1)["input_ids"]
    patch(model)
    torch.manual_seed(1)
    q_proj = torch.nn.Linear(TEXT["hidden_size"], 128, bias=False).to(DEVICE, torch.bfloat16)
    model.model.layers[0].self_attn.q_proj = q_proj

    def backward():  # stock is compared in the same mode
        forward = torch.compile(model, backend="eager") if compiled else model
        try:
            forward(ids).logits.float().square().sum().backward()
        finally:
            torch._dynamo.reset()

    with pytest.warns(FallbackWarning, match="autograd is recording"):
        backward()
    got = q_proj.weight.grad
    q_proj.weight.grad = None
    unpatch(model)
    backward()
    assert got is not None and torch.equal(got, q_proj.weight.grad)


def test_a_norm_epsilon_changed_after_patch_takes_the_stock_forward():
    model = _tiny_qwen3(seed=14)
    ids = _prompt(1)["input_ids"]
    patch(model)
    for layer in model.model.layers:
        layer.self_attn.q_norm.variance_epsilon = layer.self_attn.k_norm.variance_epsilon = 1e-2
    with torch.no_grad():
        with pytest.warns(FallbackWarning, match="epsilon changed after patch"):
            got = model(ids).logits
        unpatch(model)
        want = model(ids).logits
    assert torch.equal(got, want)


def test_eager_attention_and_its_weights_equal_stock(op_calls):
    # attn_implementation="eager" (what output_attentions needs): the modeling file's eager
    # attention function, which the patched class carries.
    model = _tiny_qwen3(seed=15, attn_implementation="eager")
    ids = _prompt(1)["input_ids"]
    with torch.no_grad():
        want = model(ids, output_attentions=True)
        patch(model)
        got = model(ids, output_attentions=True)
    assert len(op_calls) == 2 and torch.equal(got.logits, want.logits)
    assert all(torch.equal(a, b) for a, b in zip(got.attentions, want.attentions))


def test_patch_again_after_the_rotary_embedding_is_replaced_fuses_again(op_calls):
    model = _tiny_qwen3(seed=16)
    ids = _prompt(1)["input_ids"]
    patch(model)
    model.model.rotary_emb = type(model.model.rotary_emb).__mro__[1](model.config).to(DEVICE)
    with torch.no_grad():
        with pytest.warns(FallbackWarning, match="rotary embedding has not run"):
            model(ids)              # the new rotary is not hooked: every layer falls back
        assert not op_calls and patch(model) == 2
        got = model(ids).logits     # hooked again: fused
        assert len(op_calls) == 2
        unpatch(model)
        want = model(ids).logits
    assert torch.equal(got, want)


@pytest.fixture
def table_calls(monkeypatch):
    """The rotary table's launches from the integration (its patch-time probe included)."""
    calls = []
    real = integ.rope_cos_sin

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(integ, "rope_cos_sin", spy)
    return calls


def _table_route_ready() -> bool:
    """Whether the patched rotary takes the table: under the interpreter, or on a GPU once the
    native launch route is loaded (docs/design.md, "The rotary table"); loaded here where it is
    on (a first build on a fresh machine takes ~20 s; ``QKROPE_NATIVE=0`` keeps it off)."""
    from qkrope._interpret import interpreting
    from qkrope.ops import _launch, _native
    if DEVICE == "cuda" and _native.enabled():
        _native.load(timeout=300)
    return interpreting() or _launch.native_ready()


def _rotary_and_probe_positions(model):
    rot = next(m for m in model.modules() if type(m).__name__ in integ._ROTARY)
    g = torch.Generator(device=DEVICE).manual_seed(3)
    pos = torch.randint(0, 70000, (2, 37), generator=g, device=DEVICE)
    if integ._ROTARY[type(rot).__name__]:  # mRoPE: three streams that differ
        pos = torch.stack([pos, pos // 3, (pos + 11) % 5000])
    return rot, pos


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_rotary_table_is_the_stock_forwards_in_one_launch(family, table_calls):
    # Eager: the patched rotary embedding returns qkrope's table where patch found it equal to
    # the stock forward's (every rotary here but the dynamic ones), the stock cos/sin bit for
    # bit at positions far past the probe's; the dynamic ones keep the stock forward.
    model, _ = build(family)
    rot, pos = _rotary_and_probe_positions(model)
    patch(model)
    dynamic = family in ("qwen3-dynamic", "qwen3-longrope")
    assert (rot._qkrope_table is None) == dynamic
    ready = _table_route_ready()
    table_calls.clear()
    x = torch.zeros(1, dtype=torch.bfloat16, device=DEVICE)
    with torch.no_grad():
        got = rot(x, pos)
        want = type(rot)._qkrope_base.forward(rot, x, pos)
    assert len(table_calls) == (0 if dynamic or not ready else 1)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)
    assert rot._qkrope_state["cos"] is got[0]  # what the layers check they were given
    unpatch(model)
    assert not any(k.startswith("_qkrope") for k in vars(rot))


def test_the_rotary_table_steps_aside_for_another_dtype_or_tf32(table_calls):
    # A call unlike the probe's (activations of another dtype, cuBLAS's TF32 turned on since:
    # a stock matmul's product would change) takes the stock forward; patch again for the
    # model's new dtype probes anew.
    if not _table_route_ready():
        pytest.skip("the native launch route is off (QKROPE_NATIVE=0): no table to step aside")
    model, _ = build("qwen3")
    rot, pos = _rotary_and_probe_positions(model)
    patch(model)
    table_calls.clear()
    with torch.no_grad():
        rot(torch.zeros(1, dtype=torch.float16, device=DEVICE), pos)
        tf32 = torch.backends.cuda.matmul.allow_tf32  # (a module whose attributes are
        try:                                           # properties: monkeypatch cannot undo)
            torch.backends.cuda.matmul.allow_tf32 = True
            rot(torch.zeros(1, dtype=torch.bfloat16, device=DEVICE), pos)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        assert not table_calls
        model.half()
        patch(model)
        assert rot._qkrope_table.dtype is torch.float16
        table_calls.clear()
        cos, _ = rot(torch.zeros(1, dtype=torch.float16, device=DEVICE), pos)
    assert len(table_calls) == 1 and cos.dtype is torch.float16
    # A rope type set since the probe (any: a dynamic one would have to update inv_freq), or a
    # rotary pickled by an older qkrope (no probe at all): the stock forward.
    rot.rope_type = "linear"
    rot(torch.zeros(1, dtype=torch.float16, device=DEVICE), pos)
    del rot._qkrope_table
    rot.rope_type = "default"
    rot(torch.zeros(1, dtype=torch.float16, device=DEVICE), pos)
    assert len(table_calls) == 1


def test_cache_comes_from_the_stock_keyword_only():
    # A cache under the keyword the installed transformers' layers do not read (``cache=``
    # before 5.24: the stock layers ignore it and the model builds its own DynamicCache, and
    # its attention mask) must be handled as the stock layers handle it, not written while the
    # mask was built for another cache (that mismatch crashed a compiled model on a GPU).
    model = _tiny_qwen3(seed=13)
    other = "past_key_values" if cache_kwarg(model) == "cache" else "cache"
    ids = _prompt(1)["input_ids"]
    caches = [StaticCache(config=model.config, max_cache_len=16) for _ in range(2)]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 5.24+ maps the old keyword, with a warning
        stock = model(ids, **{other: caches[0]}, use_cache=True).logits
        patch(model)
        got = model(ids, **{other: caches[1]}, use_cache=True).logits
    assert torch.equal(got, stock)
    assert [layer.is_initialized for layer in caches[1].layers] == \
        [layer.is_initialized for layer in caches[0].layers]
    if caches[0].layers[0].is_initialized:
        assert_same_cache(caches[1], caches[0])


_OTHER_KEYWORD_COMPILED = """
import inspect, sys, warnings, torch, transformers
from transformers import StaticCache
from qkrope.integrations.transformers import patch, unpatch
torch.manual_seed(0)
B, PROMPT, STEPS = 8, 32, 3
# Qwen3-8B's heads (32/8 of 128 dims) on a narrow model: the attention the crash was in.
cfg = dict(vocab_size=1024, hidden_size=1024, intermediate_size=1024, num_hidden_layers=2,
           num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6)
model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg)).cuda().bfloat16().eval()
with torch.no_grad():
    for n, p in model.named_parameters():
        if n.endswith(("q_norm.weight", "k_norm.weight")):
            p.copy_(1 + 0.5 * torch.randn_like(p))
own = "cache" if "cache" in inspect.signature(type(model).forward).parameters \\
    else "past_key_values"
other = "past_key_values" if own == "cache" else "cache"
ids = torch.randint(0, 1024, (B, PROMPT + STEPS), device="cuda")

def decode(forward):
    cache = StaticCache(config=model.config, max_cache_len=PROMPT + STEPS + 8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 5.24+ maps the old keyword, with a warning
        model(ids[:, :PROMPT], **{other: cache}, use_cache=True)
        for i in range(STEPS):
            pos = torch.full((B, 1), PROMPT + i, device="cuda")
            logits = forward(ids[:, PROMPT + i:PROMPT + i + 1], **{other: cache},
                             position_ids=pos, use_cache=True).logits[:, -1].float()
    torch.cuda.synchronize()
    return logits

eager = decode(model.forward)
torch._dynamo.reset()
stock = decode(torch.compile(model.forward))
patch(model)
torch._dynamo.reset()
fused = decode(torch.compile(model.forward))
ulp = 2.0 ** (torch.floor(torch.log2(eager.abs().max())) - 7)
stock_err, fused_err = (stock - eager).abs().max(), (fused - eager).abs().max()
assert fused_err <= 2 * stock_err + ulp, (fused_err, stock_err, ulp)
print("ok", own, other, float(stock_err), float(fused_err))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the crash was a CUDA fault")
def test_compiled_batch_of_8_with_the_cache_under_the_other_keyword_runs_like_stock():
    # The reproducer of a CUDA "misaligned address": a compiled batch-8 decode step given its
    # StaticCache under the keyword the installed transformers does not read (``cache=`` before
    # 5.24). The stock model ignores it and builds its own DynamicCache and attention mask; a
    # patched layer that wrote and attended the StaticCache anyway ran cuDNN's SDPA with that
    # mask against the StaticCache's longer keys, and the kernel faulted (compute-sanitizer:
    # misaligned 4-byte reads in cudnn_generated_fort_native_sdpa_sm80_flash_fprop; docs/
    # design.md, "HF cache keyword"). A process of its own: a fault ends the CUDA context.
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _OTHER_KEYWORD_COMPILED], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0 and "CUDA error" not in run.stderr, run.stderr[-3000:]
    assert run.stdout.startswith("ok"), run.stdout
