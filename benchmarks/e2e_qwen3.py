"""End-to-end decode-step latency of a small random Qwen3 with and without qkrope's patch.

Default: 4 layers at Qwen3-8B width (hidden 4096, 32/8 heads, head_dim 128, MLP 12288), a
random init (no download), bf16, StaticCache, batch 1 and 8; eager and torch.compile'd forward.
Also the host time of one op call through the public eager path versus through the registered
custom op (the dispatcher), which is why eager calls bypass it.

    python benchmarks/e2e_qwen3.py            # on a GPU
    python benchmarks/e2e_qwen3.py --tiny     # smoke run anywhere (CPU: interpreter)
"""

import argparse
import statistics
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, StaticCache

import qkrope
from qkrope.integrations.transformers import patch_qwen3, unpatch_qwen3
from qkrope.suite import SUITE, make_inputs


def decode_step_ms(model, batch, prompt, steps, compiled, device):
    """Median ms of one decode step (model forward on 1 new token per sequence)."""
    cache = StaticCache(config=model.config, max_cache_len=prompt + steps + 8)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device=device)
    fwd = torch.compile(model.forward, fullgraph=False) if compiled else model.forward
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)          # prefill (eager)
        nxt = ids[:, -1:]
        times = []
        for i in range(steps):
            pos = torch.full((batch, 1), prompt + i, device=device)
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fwd(nxt, past_key_values=cache, position_ids=pos, use_cache=True)
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
    p.add_argument("--tiny", action="store_true", help="a tiny model and few steps (smoke run)")
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = dict(vocab_size=32000, hidden_size=4096, intermediate_size=12288, num_hidden_layers=4,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6)
    steps, batches, modes = args.steps, (1, 8), (False, True)
    if args.tiny:
        cfg.update(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64)
        steps, batches, modes = 6, (1,), (False,)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**cfg)).to(device, torch.bfloat16).eval()
    print(f"{device} torch {torch.__version__} | model {cfg['num_hidden_layers']} layers, hidden "
          f"{cfg['hidden_size']}, heads {cfg['num_attention_heads']}/{cfg['num_key_value_heads']}")
    print("| batch | mode | stock ms/step | patched ms/step | speed-up |")
    print("|---|---|---|---|---|")
    for batch in batches:
        for compiled in modes:
            torch._dynamo.reset()
            stock = decode_step_ms(model, batch, 32, steps, compiled, device)
            patch_qwen3(model)
            torch._dynamo.reset()
            patched = decode_step_ms(model, batch, 32, steps, compiled, device)
            unpatch_qwen3(model)
            print(f"| {batch} | {'compiled' if compiled else 'eager'} | {stock:.3f} | "
                  f"{patched:.3f} | {stock / patched:.2f}× |")

    a = make_inputs(SUITE[0], device=device, cache_capacity=64)
    q_out, k_out = torch.empty_like(a[0]), torch.empty_like(a[1])
    n = 20 if args.tiny else 2000
    public = host_us(lambda: qkrope.run(*a, query_out=q_out, key_out=k_out), n)
    dispatched = host_us(lambda: torch.ops.qkrope.qknorm_rope_cache(*a, q_out, k_out), n)
    print(f"host µs per op call (1 token, outputs given): public eager path {public:.1f}, "
          f"through torch.ops (dispatcher) {dispatched:.1f}")


if __name__ == "__main__":
    main()
