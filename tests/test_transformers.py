"""HF transformers Qwen3 drop-in: same greedy tokens and cache contents with and without the
patch, on a small randomly initialised model (no downloads)."""

import warnings

import pytest
import torch
from helpers import DEVICE

transformers = pytest.importorskip("transformers")
from transformers import Qwen3Config, Qwen3ForCausalLM, StaticCache  # noqa: E402

from qkrope.integrations.transformers import is_patched, patch_qwen3, unpatch_qwen3  # noqa: E402


def small_model(seed=0, **over):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               max_position_embeddings=512, rope_theta=1e6, rms_norm_eps=1e-6,
               tie_word_embeddings=False)
    cfg.update(over)
    model = Qwen3ForCausalLM(Qwen3Config(**cfg)).to(DEVICE, torch.bfloat16).eval()
    with torch.no_grad():  # random norm weights, or a kernel ignoring them would pass
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1 + 0.5 * torch.randn_like(p))
    return model


def generate(model, ids, new_tokens, max_cache_len=64, disable_compile=True):
    # generate() compiles the decode step of a StaticCache model on GPUs by default; Inductor
    # then keeps the stock norm and rotary in fp32 between ops, which changes ~3% of the
    # stock model's own layer-0 keys (H200, transformers 5.17). The stock eager model is the
    # reference the patch must reproduce bit for bit.
    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False,
                         min_new_tokens=new_tokens, disable_compile=disable_compile)
    return out, cache


@pytest.mark.parametrize("batch", [1, 3])
def test_patched_model_generates_the_same_tokens_and_cache(batch):
    model = small_model()
    ids = torch.randint(0, 512, (batch, 7), device=DEVICE, generator=None)
    stock_tokens, stock_cache = generate(model, ids, 6)
    assert patch_qwen3(model) == 2
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="qkrope")  # fused path taken, no fallback
        tokens, cache = generate(model, ids, 6)
    assert torch.equal(tokens, stock_tokens)
    for stock_layer, layer in zip(stock_cache.layers, cache.layers, strict=True):
        assert torch.equal(layer.keys, stock_layer.keys)
        assert torch.equal(layer.values, stock_layer.values)
    assert unpatch_qwen3(model) == 2 and not any(is_patched(m) for m in model.modules())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="generate() compiles only on GPUs")
def test_patched_model_under_generate_compile():
    # generate()'s default for a StaticCache on a GPU: the decode step is torch.compile'd and the
    # fused op goes through its registered custom op inside the compiled graph.
    model = small_model(seed=2)
    ids = torch.randint(0, 512, (2, 7), device=DEVICE)
    stock_tokens, _ = generate(model, ids, 6)
    patch_qwen3(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="qkrope")
        tokens, _ = generate(model, ids, 6, disable_compile=False)
    assert torch.equal(tokens, stock_tokens)
    unpatch_qwen3(model)


def test_dynamic_cache_falls_back_with_a_warning():
    model = small_model(seed=1)
    ids = torch.randint(0, 512, (1, 5), device=DEVICE)
    stock = model.generate(ids, max_new_tokens=3, do_sample=False)
    patch_qwen3(model)
    from qkrope.integrations import transformers as integ

    integ._warned.clear()
    with pytest.warns(UserWarning, match="not a StaticCache"):
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(out, stock)


def test_patch_rejects_models_without_qwen3_attention():
    with pytest.raises(ValueError, match="no Qwen3"):
        patch_qwen3(torch.nn.Linear(2, 2))
