"""Sampling: decode throughput against Hugging Face generate, the cost of mixing adapters,
per-device KV-cache memory over cp, and the number of compiled programs.

    python benchmarks/sampling.py            (CPU; 8 fake devices, meshes as stated)

1. Greedy decode of 8 prompts × 128 new tokens (fp32, the tiny Qwen3 of QwenConfig.tiny
   with a rank-8 PEFT adapter on every module): jcp at mesh (1,1,1) against torch
   transformers' PeftModel.generate on the same weights; tokens/s of each (compile
   excluded, best of 3) and the ratio.
2. 8 sequences over 4 adapters against 8 over one adapter: time ratio (goal ≤ 1.15).
3. Per-device KV-cache bytes for one 16k-token prompt at cp = 1, 2, 4 (the shard shape of
   the cache's sharding), relative to cp = 1.
4. Compiled programs over 50 calls of 4 prompts with random lengths 1–300 (16 new tokens).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import copy  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import jcp  # noqa: E402
from jcp.mesh import SPECS  # noqa: E402

NEW, BATCH, PROMPT_LEN = 128, 8, 32
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_tiny():
    c = jcp.QwenConfig.tiny()
    torch.manual_seed(0)
    hm = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=False, max_position_embeddings=c.max_position_embeddings))
    return hm.eval().float()


def peft_adapter(hm, seed):
    pm = peft.get_peft_model(copy.deepcopy(hm), peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0, task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return pm.eval()


def best_of(fn, n=3):
    fn()  # warm-up (compiles)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main():
    rng = np.random.default_rng(0)
    hm = hf_tiny()
    with tempfile.TemporaryDirectory() as root:
        hm.save_pretrained(f"{root}/base", safe_serialization=True)
        pms = [peft_adapter(hm, s) for s in range(4)]
        for k, pm in enumerate(pms):
            pm.save_pretrained(f"{root}/a{k}")
        cfg, base = jcp.load_hf(f"{root}/base")
        tr = jcp.Trainer(cfg, jcp.make_mesh(1, 1, 1), base_params=base, max_adapters=4,
                         max_rank=8)
        ids = [tr.load_peft(f"{root}/a{k}") for k in range(4)]

    prompts = [rng.integers(0, cfg.vocab_size, PROMPT_LEN) for _ in range(BATCH)]
    greedy = jcp.SamplingParams(max_tokens=NEW, temperature=0.0, stop=[])

    # 1. throughput
    t_jcp = best_of(lambda: tr.sample(prompts, greedy, adapters=ids[0]))
    ids_t = torch.tensor(np.stack(prompts))
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    def hf():
        with torch.no_grad():
            pms[0].generate(input_ids=ids_t, attention_mask=torch.ones_like(ids_t),
                            do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                            eos_token_id=None, pad_token_id=0)

    t_hf = best_of(hf)
    res = tr.sample(prompts, greedy, adapters=ids[0])
    with torch.no_grad():
        want = pms[0].generate(input_ids=ids_t, attention_mask=torch.ones_like(ids_t),
                               do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                               eos_token_id=None, pad_token_id=0)[:, PROMPT_LEN:].numpy()
    agree = np.mean([np.mean(r.sequences[0].tokens == w) for r, w in zip(res, want)])
    tok = BATCH * NEW
    print(f"1. decode {BATCH}×{NEW} greedy, fp32, mesh (1,1,1): jcp {tok / t_jcp:,.0f} tok/s "
          f"({t_jcp:.3f} s, prefill included), HF+PEFT generate {tok / t_hf:,.0f} tok/s "
          f"({t_hf:.3f} s); ratio {t_hf / t_jcp:.2f}× (goal ≥ 1.0); token agreement "
          f"{agree:.3f}")

    # 2. mixing adapters
    t_one = best_of(lambda: tr.sample(prompts, greedy, adapters=ids[0]))
    mixed = [ids[k % 4] for k in range(BATCH)]
    t_mix = best_of(lambda: tr.sample(prompts, greedy, adapters=mixed))
    print(f"2. 8 sequences over 4 adapters {t_mix:.3f} s vs over 1 adapter {t_one:.3f} s: "
          f"{t_mix / t_one:.2f}× (goal ≤ 1.15)")

    # 3. KV-cache memory per device for one 16k-token prompt (+ 16 new tokens)
    line = []
    first = None
    for cp in (1, 2, 4):
        mesh = jcp.make_mesh(1, cp, 1)
        b_total = cp  # one sequence, padded to one row per (dp, cp) device
        t_len = 1 << int(np.ceil(np.log2(16384 + 16)))
        shape = (cfg.num_layers, b_total, t_len, cfg.num_kv_heads, cfg.head_dim)
        per_dev = 2 * 4 * int(np.prod(NamedSharding(mesh, SPECS.cache_LxBxTxKxH)
                                      .shard_shape(shape)))
        first = first or per_dev
        line.append(f"cp={cp}: {per_dev / 2**20:.1f} MiB ({per_dev / first:.2f} of cp=1)")
    print("3. KV cache per device, one 16k-token prompt, cache mode (a): " + ", ".join(line)
          + " (goal ≤ 1.2/cp needs the cp-split cache mode (b), not built)")

    # 4. compiled programs over 50 calls with random prompt lengths
    tr2 = jcp.Trainer(cfg, jcp.make_mesh(1, 2, 2), base_params=base, max_adapters=4,
                      max_rank=8)
    a = tr2.create_adapter(rank=8)
    sp = jcp.SamplingParams(max_tokens=16, temperature=1.0, seed=0)
    t = time.perf_counter()
    for _ in range(50):
        ps = [rng.integers(0, cfg.vocab_size, int(rng.integers(1, 301))) for _ in range(4)]
        tr2.sample(ps, sp, adapters=[a, None, a, a])
    s = tr2._sampler
    counts = {name: getattr(s, name)._cache_size()
              for name in ("_prefill", "_decode", "_to_cache", "_empty_cache")}
    print(f"4. compiled programs over 50 calls (4 prompts of 1–300 tokens, mesh (1,2,2)): "
          f"{sum(counts.values())} {counts} (goal ≤ 10); {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
