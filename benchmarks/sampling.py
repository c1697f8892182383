"""Sampling: decode throughput against Hugging Face generate, layer slicing, the cost of
mixing adapters, per-device KV-cache memory over cp, and the number of compiled programs.

    python benchmarks/sampling.py            (CPU; 8 fake devices, meshes as stated)

1. Greedy decode of 8 prompts × 128 new tokens (fp32, the tiny Qwen3 of QwenConfig.tiny
   with a rank-8 PEFT adapter on every attention and MLP module): jcp at mesh (1,1,1)
   against torch transformers' PeftModel.generate on the same weights; tokens/s of each
   (compile excluded, best of 3) and the ratio.
2. The same decode with per-layer weights sliced once outside the decode loop (the
   default) against a lax.scan over the stacked layers inside it: time ratio.
3. 8 sequences over 4 adapters against 8 over one adapter: time ratio (goal ≤ 1.15),
   best of 15 calls each, the two kinds alternating (on a shared machine a load change
   then hits both alike; best of 3 in a row swung this ratio from 0.9 to 1.7).
4. Per-device memory for one 16k-token prompt (+ 16 new tokens) at cp = 1, 2, 4 (tiny
   config with 32k positions, random weights): the KV cache (plan) and the compiled
   decode and prefill programs (XLA memory analysis: arguments + outputs − aliased +
   temporaries), cache mode "split" against "batch"; relative to cp = 1 (goal ≤ 1.2/cp);
   and the decode program's temporaries relative to the cache it updates in place.
5. Compiled programs over 50 calls of 4 prompts with random lengths 1–300 (16 new
   tokens, mesh (1,2,2)): goal ≤ 10.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import copy  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import jcp  # noqa: E402
from jcp import sample as sample_lib  # noqa: E402
from jcp.mesh import SPECS  # noqa: E402
from jcp.sample import kv_cache, programs  # noqa: E402

NEW, BATCH, PROMPT_LEN = 128, 8, 32
LONG = 16384
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_tiny():
    c = jcp.QwenConfig.tiny()
    torch.manual_seed(0)
    hm = transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_layers,
            num_attention_heads=c.num_heads,
            num_key_value_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            rope_theta=c.rope_theta,
            rms_norm_eps=c.rms_norm_eps,
            tie_word_embeddings=False,
            max_position_embeddings=c.max_position_embeddings,
        )
    )
    return hm.eval().float()


def peft_adapter(hm, seed):
    pm = peft.get_peft_model(
        copy.deepcopy(hm),
        peft.LoraConfig(
            r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0, task_type="CAUSAL_LM"
        ),
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return pm.eval()


def alternating_best(fns, n=15):
    """Best time of each of fns over n rounds that run them in turn (after one warm-up)."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(n):
        for ts, fn in zip(times, fns):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return [min(ts) for ts in times]


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
        tr = jcp.Trainer(cfg, jcp.make_mesh(1, 1, 1), base_params=base, max_adapters=4, max_rank=8)
        ids = [tr.load_peft(f"{root}/a{k}") for k in range(4)]

    prompts = [rng.integers(0, cfg.vocab_size, PROMPT_LEN) for _ in range(BATCH)]
    greedy = jcp.SamplingParams(max_tokens=NEW, temperature=0.0, stop=[])

    # 1. throughput
    t_jcp = best_of(lambda: tr.sample(prompts, greedy, adapters=ids[0]))
    ids_t = torch.tensor(np.stack(prompts))
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    def hf():
        with torch.no_grad():
            pms[0].generate(
                input_ids=ids_t,
                attention_mask=torch.ones_like(ids_t),
                do_sample=False,
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                eos_token_id=None,
                pad_token_id=0,
            )

    t_hf = best_of(hf)
    res = tr.sample(prompts, greedy, adapters=ids[0])
    with torch.no_grad():
        want = (
            pms[0]
            .generate(
                input_ids=ids_t,
                attention_mask=torch.ones_like(ids_t),
                do_sample=False,
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                eos_token_id=None,
                pad_token_id=0,
            )[:, PROMPT_LEN:]
            .numpy()
        )
    agree = np.mean([np.mean(r.sequences[0].tokens == w) for r, w in zip(res, want)])
    tok = BATCH * NEW
    print(
        f"1. decode {BATCH}×{NEW} greedy, fp32, mesh (1,1,1): jcp {tok / t_jcp:,.0f} tok/s "
        f"({t_jcp:.3f} s, prefill included), HF+PEFT generate {tok / t_hf:,.0f} tok/s "
        f"({t_hf:.3f} s); ratio {t_hf / t_jcp:.2f}× (goal ≥ 1.0); token agreement "
        f"{agree:.3f}",
        flush=True,
    )

    # 2. per-layer weights sliced outside the decode loop vs scanned inside it
    runner = tr.sampler.runner
    assert runner.slice_layers  # the tiny model's layers are far below the threshold
    runner.slice_layers = False
    try:
        t_scan = best_of(lambda: tr.sample(prompts, greedy, adapters=ids[0]))
    finally:
        runner.slice_layers = True
    t_sliced = best_of(lambda: tr.sample(prompts, greedy, adapters=ids[0]))
    print(
        f"2. layers sliced outside the decode loop {t_sliced:.3f} s vs lax.scan inside it "
        f"{t_scan:.3f} s: {t_scan / t_sliced:.2f}× faster",
        flush=True,
    )

    # 3. mixing adapters
    mixed = [ids[k % 4] for k in range(BATCH)]
    t_one, t_mix = alternating_best(
        [
            lambda: tr.sample(prompts, greedy, adapters=ids[0]),
            lambda: tr.sample(prompts, greedy, adapters=mixed),
        ]
    )
    print(
        f"3. 8 sequences over 4 adapters {t_mix:.3f} s vs over 1 adapter {t_one:.3f} s: "
        f"{t_mix / t_one:.2f}× (goal ≤ 1.15)",
        flush=True,
    )

    # 4. memory per device for one 16k-token prompt
    long_cfg = jcp.QwenConfig.tiny(max_position_embeddings=32768)
    rows = {}
    for cp in (1, 2, 4):
        for mode in ("batch", "split"):
            rows[cp, mode] = long_prompt_memory(long_cfg, cp, mode, LONG)
    print(f"4. memory per device, one {LONG}-token prompt + 16 new (MiB; × of cp=1):")
    for mode in ("split", "batch"):
        for what in ("cache", "decode", "prefill"):
            first = rows[1, mode][what]
            cells = ", ".join(
                f"cp={cp}: {rows[cp, mode][what] / 2**20:.1f} ({rows[cp, mode][what] / first:.2f})"
                for cp in (1, 2, 4)
            )
            print(f"   {mode:5s} {what:7s} {cells}")
        cells = ", ".join(
            f"cp={cp}: {rows[cp, mode]['decode_temp'] / rows[cp, mode]['cache']:.2f}"
            for cp in (1, 2, 4)
        )
        print(f"   {mode:5s} decode temporaries ÷ cache: {cells}")
    print(
        "   (goal ≤ 1.2/cp: 0.60 at cp=2, 0.30 at cp=4; the automatic choice picks "
        '"split" once the "batch" cache passes 1 GiB per device)',
        flush=True,
    )

    # 5. compiled programs over 50 calls with random prompt lengths
    tr2 = jcp.Trainer(cfg, jcp.make_mesh(1, 2, 2), base_params=base, max_adapters=4, max_rank=8)
    a = tr2.create_adapter(rank=8)
    sp = jcp.SamplingParams(max_tokens=16, temperature=1.0, seed=0)
    t = time.perf_counter()
    for _ in range(50):
        ps = [rng.integers(0, cfg.vocab_size, int(rng.integers(1, 301))) for _ in range(4)]
        tr2.sample(ps, sp, adapters=[a, None, a, a])
    s2 = tr2.sampler
    counts = {name: getattr(s2, name)._cache_size() for name in ("prefill", "decode")}
    print(
        f"5. compiled programs over 50 calls (4 prompts of 1–300 tokens, mesh (1,2,2)): "
        f"{sum(counts.values())} {counts} (goal ≤ 10); {time.perf_counter() - t:.1f} s"
    )


def _peak(compiled) -> int:
    m = compiled.memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )


def long_prompt_memory(cfg, cp, mode, n):
    """Per-device bytes of the KV cache and of the compiled decode and prefill programs for
    one n-token prompt at mesh (1, cp, 1) in cache `mode` (compiled, not run)."""
    tr = jcp.Trainer(
        cfg,
        jcp.make_mesh(1, cp, 1),
        max_adapters=1,
        max_rank=8,
        max_tokens_per_device=-(-(n + 16) // cp) + 16,
    )
    s = tr.sampler
    plan = s.plan([n], 16, cache_mode=mode)
    lay = kv_cache.LAYOUTS[mode]
    prompt = np.arange(n, dtype=np.int32) % cfg.vocab_size
    _, (pb,) = s.runner.packed([prompt], [sample_lib.BASE])
    groups = 1 if mode == "split" else cp
    b, t = plan.b_local * groups, plan.t_local * (cp if mode == "split" else 1)
    st = SPECS.stream_DPxCPxS
    put = s.runner.put
    source = np.full((b, t), -1, np.int32)
    args = programs.PrefillArgs(
        put(pb.tokens, st),
        put(pb.segment, st),
        put(pb.position, st),
        put(pb.targets, st),
        put(pb.spans, SPECS.spans_DPxCPxAx2),
        put(pb.active, SPECS.replicated),
    )
    prefill = s.prefill.jitted.lower(
        tr.state.weights,
        tr.params,
        tr.state.meta,
        args,
        put(source, lay.position_BxT),
        None,
        modes=programs.PrefillModes(mode, False),
    ).compile()
    kv_shape = (cfg.num_layers, b, t, cfg.num_kv_heads, cfg.head_dim)
    dt = jax.numpy.dtype(cfg.dtype)
    sds = lambda shape, dtype, spec: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dtype, sharding=NamedSharding(tr.mesh, spec)
    )
    cache = kv_cache.Cache(
        sds(kv_shape, dt, lay.kv_LxBxTxKxH),
        sds(kv_shape, dt, lay.kv_LxBxTxKxH),
        sds((b, t), np.int32, lay.position_BxT),
    )
    seq = lambda dtype: sds((b,), dtype, lay.seqs_B)  # noqa: E731
    i32 = seq(np.int32)
    rows = programs.DecodeRows(
        token=i32,
        position=i32,
        base=i32,
        done=seq(bool),
        count=i32,
        index=i32,
        max_tokens=i32,
        temperature=seq(np.float32),
        top_k=i32,
        top_p=seq(np.float32),
        want_topk=seq(bool),
        steps=i32,
        keys=sds((b, 2), np.uint32, lay.seqs_Bx2),
        stop=sds((b, 8), np.int32, lay.seqs_Bx2),
    )
    decode = s.decode.lower(
        tr.state.weights,
        tr.params,
        tr.state.meta,
        cache,
        rows,
        put(np.full(2, -1, np.int32), SPECS.replicated),
        modes=programs.DecodeModes(mode, 16),
    ).compile()
    return {
        "cache": plan.cache_bytes,
        "decode": _peak(decode),
        "prefill": _peak(prefill),
        "decode_temp": decode.memory_analysis().temp_size_in_bytes,
    }


if __name__ == "__main__":
    main()
