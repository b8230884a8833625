"""End-to-end decode-step latency of a small random Qwen3-family model with and without
qkrope's patch (``qkrope.integrations.transformers.patch``).

Default: 4 layers at Qwen3-8B width (hidden 4096, 32/8 heads, head_dim 128, MLP 12288), a
random init (no download), bf16, StaticCache, batch 1 and 8; eager and torch.compile'd forward.
``--family qwen3.5`` / ``qwen3-next``: 4 full-attention layers at Qwen3.5-27B / Qwen3-Next-80B
attention width (head_dim 256, gated query, (1 + w) norms, partial rotary 0.25; Qwen3.5 with
interleaved mRoPE); their linear-attention layers are left out, as the patch does not touch
them and transformers' PyTorch fallback for them (no flash-linear-attention) would dominate.
Also the host time of one op call through the public eager path versus through the registered
custom op (the dispatcher), which is why eager calls bypass it.

    python benchmarks/e2e_qwen3.py                       # on a GPU
    python benchmarks/e2e_qwen3.py --family qwen3.5
    python benchmarks/e2e_qwen3.py --tiny                # smoke run anywhere (CPU: interpreter)
"""

import argparse
import statistics
import time

import torch
import transformers
from transformers import StaticCache

import qkrope
from qkrope.integrations.transformers import patch, unpatch
from qkrope.suite import SUITE, make_inputs

FULL = {
    "qwen3": dict(vocab_size=32000, hidden_size=4096, intermediate_size=12288,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "qwen3.5": dict(vocab_size=32000, hidden_size=5120, intermediate_size=17408,
                    num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                     "partial_rotary_factor": 0.25,
                                     "mrope_section": [11, 11, 10], "mrope_interleaved": True}),
    "qwen3-next": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5120,
                       num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                       num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512,
                       shared_expert_intermediate_size=512),
}
TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64)


def build_model(family: str, tiny: bool, device: str):
    cfg = dict(FULL[family], num_hidden_layers=4, max_position_embeddings=40960,
               rms_norm_eps=1e-6)
    if tiny:
        cfg.update(TINY, num_hidden_layers=2)
        if "rope_parameters" in cfg:  # 8 rotary frequencies at head_dim 64: a section that fits
            cfg["rope_parameters"] = dict(cfg["rope_parameters"], mrope_section=[2, 3, 3])
    if family == "qwen3":
        config, model_cls = transformers.Qwen3Config(**cfg), transformers.Qwen3ForCausalLM
    elif family == "qwen3.5":
        config = transformers.Qwen3_5TextConfig(
            **cfg, layer_types=["full_attention"] * cfg["num_hidden_layers"])
        model_cls = transformers.Qwen3_5ForCausalLM
    else:
        config = transformers.Qwen3NextConfig(
            **cfg, layer_types=["full_attention"] * cfg["num_hidden_layers"])
        model_cls = transformers.Qwen3NextForCausalLM
    torch.manual_seed(0)
    return model_cls(config).to(device, torch.bfloat16).eval(), cfg


def decode_step_ms(model, batch, prompt, steps, compiled, device):
    """Median ms of one decode step (model forward on 1 new token per sequence)."""
    cache = StaticCache(config=model.config, max_cache_len=prompt + steps + 8)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device=device)
    fwd = torch.compile(model.forward, fullgraph=False) if compiled else model.forward
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)          # prefill (eager)
        nxt = ids[:, -1:]
        times = []
        for i in range(steps):
            pos = torch.full((batch, 1), prompt + i, device=device)
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fwd(nxt, cache=cache, position_ids=pos, use_cache=True)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            nxt = out.logits[:, -1:].argmax(-1)
    return statistics.median(times[steps // 2:]) * 1e3   # second half: compiled and warm


def host_us(fn, n):
    for _ in range(20):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--family", choices=sorted(FULL), default="qwen3")
    p.add_argument("--tiny", action="store_true", help="a tiny model and few steps (smoke run)")
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    steps, batches, modes = args.steps, (1, 8), (False, True)
    if args.tiny:
        steps, batches, modes = 6, (1,), (False,)
    model, cfg = build_model(args.family, args.tiny, device)
    print(f"{device} torch {torch.__version__} transformers {transformers.__version__} | "
          f"{args.family}: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, heads "
          f"{cfg['num_attention_heads']}/{cfg['num_key_value_heads']}, head_dim {cfg['head_dim']}")
    print("| batch | mode | stock ms/step | patched ms/step | speed-up |")
    print("|---|---|---|---|---|")
    for batch in batches:
        for compiled in modes:
            torch._dynamo.reset()
            stock = decode_step_ms(model, batch, 32, steps, compiled, device)
            n = patch(model)
            assert n == cfg["num_hidden_layers"], f"only {n} layers patched"
            torch._dynamo.reset()
            patched = decode_step_ms(model, batch, 32, steps, compiled, device)
            unpatch(model)
            print(f"| {batch} | {'compiled' if compiled else 'eager'} | {stock:.3f} | "
                  f"{patched:.3f} | {stock / patched:.2f}× |")

    a = make_inputs(SUITE[0], device=device, cache_capacity=64)
    q_out, k_out = torch.empty_like(a[0]), torch.empty_like(a[1])
    n = 20 if args.tiny else 2000
    public = host_us(lambda: qkrope.run(*a, query_out=q_out, key_out=k_out), n)
    # The registered op is destination-passing: every option spelled out (the public defaults).
    D = a[0].shape[-1]
    dispatched = host_us(lambda: torch.ops.qkrope.qknorm_rope(
        *a[:10], None, None, q_out, k_out, a[10], "bhsd", "neox", D, 0.0, "weight_fp32", 1.0,
        None, False), n)
    print(f"host µs per op call (1 token, outputs given): public eager path {public:.1f}, "
          f"through torch.ops (dispatcher) {dispatched:.1f}")


if __name__ == "__main__":
    main()
