"""Trainer construction: clear errors for meshes and settings it cannot run, tuned defaults."""

import os

import jax
import numpy as np
import pytest

import jcp


def test_kv_heads_must_divide_tp():
    cfg = jcp.QwenConfig.tiny()  # 2 kv heads
    with pytest.raises(ValueError, match="tp=4 does not divide num_kv_heads=2"):
        jcp.Trainer(cfg, jcp.make_mesh(1, 1, 4))


@pytest.mark.parametrize(
    "kw, pattern",
    [
        (dict(attn_impl="flash"), "attn_impl"),
        (dict(attn_block=0), "attn_block"),
        (dict(logprob_chunk=True), "logprob_chunk"),
        (dict(max_adapters=0), "max_adapters"),
        (dict(max_rank=2.5), "max_rank"),
        (dict(max_tokens_per_device=1), "max_tokens_per_device"),
        (dict(remat="sometimes"), "remat"),
        (dict(remat=1), "remat"),
        (dict(remat_budget_bytes=0), "remat_budget_bytes"),
        (dict(turn_spans=0), "turn_spans"),
        (dict(turn_spans=True), "turn_spans"),
        (dict(adapter_memory=1.5e9), "adapter_memory"),
        (dict(adapter_memory="lots"), "adapter_memory"),
        (dict(adapter_memory=1000), "adapter memory 1000 bytes holds no adapter of rank 16"),
    ],
)
def test_bad_settings(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        jcp.Trainer(jcp.QwenConfig.tiny(), jcp.make_mesh(1, 1, 1), **kw)


def test_options_object_equals_keywords():
    """TrainerOptions builds the Trainer its keywords build; both at once are refused."""
    from jcp.trainer import TrainerOptions

    cfg, mesh = jcp.QwenConfig.tiny(), jcp.make_mesh(1, 1, 1)
    kw = dict(attn_block=32, logprob_chunk=64, remat=False, expert_lora_modes=["shared_outer"])
    a = jcp.Trainer(cfg, mesh, options=TrainerOptions(**kw))
    b = jcp.Trainer(cfg, mesh, **kw)
    assert a.step_cfg == b.step_cfg != jcp.Trainer(cfg, mesh).step_cfg
    assert a.options == b.options and a.options.expert_lora_modes == ("shared_outer",)
    assert a.state.expert_lora_modes == b.state.expert_lora_modes == ("shared_outer",)
    with pytest.raises(ValueError, match="not both"):
        jcp.Trainer(cfg, mesh, attn_block=32, options=TrainerOptions(remat=False))
    with pytest.raises(ValueError, match="remat_budget_bytes"):
        TrainerOptions(remat_budget_bytes=0)


@pytest.mark.parametrize("vocab, tp", [(512, 1), (151936, 1), (151936, 2)])
def test_default_logprob_chunk_bounds_the_logits(vocab, tp):
    cfg = jcp.QwenConfig.tiny(vocab_size=vocab)
    tr = jcp.Trainer(cfg, jcp.make_mesh(1, 1, tp), base_params=None)
    chunk = tr.step_cfg.logprob_chunk
    assert chunk & (chunk - 1) == 0 and 16 <= chunk <= 1024
    assert chunk * (vocab // tp) * 4 <= 256 * 2**20 or chunk == 16
    assert chunk == 1024 or 2 * chunk * (vocab // tp) * 4 > 256 * 2**20  # the largest such


def test_token_cap_follows_max_tokens_per_device():
    cfg = jcp.QwenConfig.tiny()
    a = jcp.Trainer(cfg, jcp.make_mesh(1, 2, 1), max_tokens_per_device=101)
    b = jcp.Trainer(cfg, jcp.make_mesh(1, 2, 1))
    assert a.token_cap == 100 * 2  # floor to even, times cp
    assert b.token_cap == cfg.max_position_embeddings


def _count_compiles(monkeypatch) -> list:
    """Every AOT compile from now on (the Trainer's forward_backward programs) appends to
    the returned list."""
    import jax

    compiled, compile_ = [], jax.stages.Lowered.compile

    def counting(self, *a, **kw):
        compiled.append(self)
        return compile_(self, *a, **kw)

    monkeypatch.setattr(jax.stages.Lowered, "compile", counting)
    return compiled


def test_remat_auto_decides_without_compiling_the_discarded_program(monkeypatch, tmp_path):
    """remat="auto" with a budget far above / below remat_estimate's figure decides from it
    and compiles only the program it keeps — without recomputation / with it — and both
    programs give the same numbers. With the budget at the estimate it compiles the
    program without recomputation and reads its memory ("measured", within
    Trainer.REMAT_MARGIN of the estimate), keeps it iff it fits, and stores the decision
    beside the compilation cache: a second Trainer of the same settings reads it
    ("cached") and compiles only the program it keeps."""
    import jax
    from helpers import trainer_harness as H

    cfg = jcp.QwenConfig.tiny()
    data = H.random_data((37, 20, 5), seed=1)
    compiled = _count_compiles(monkeypatch)
    results, decisions = [], []
    old_dir = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    try:
        for budget in (1 << 50, 1, "estimate", "estimate"):
            budget = decisions[0]["estimate"] if budget == "estimate" else budget
            tr = jcp.Trainer(
                cfg,
                jcp.make_mesh(1, 1, 1),
                max_adapters=1,
                max_rank=4,
                attn_block=16,
                logprob_chunk=16,
                remat_budget_bytes=budget,
            )
            assert tr.remat == "auto"
            a = tr.create_adapter(rank=4, alpha=8.0, seed=3)
            before = len(compiled)
            out = tr.forward_backward(data, "cross_entropy", adapters=a)
            (d,) = tr.remat_decisions.values()
            assert len(compiled) - before == (2 if d["how"] == "measured" and d["remat"] else 1), d
            decisions.append(d)
            results.append((out, tr.gradients(a)))
    finally:
        jax.config.update("jax_compilation_cache_dir", old_dir)
    assert [(d["how"], d["remat"]) for d in decisions[:2]] == [
        ("estimate", False),
        ("estimate", True),
    ]
    assert all(d["bytes"] == d["estimate"] for d in decisions[:2])
    measured, cached = decisions[2:]
    assert (measured["how"], cached["how"]) == ("measured", "cached")
    assert (measured["remat"], measured["bytes"]) == (cached["remat"], cached["bytes"])
    assert 1 / tr.REMAT_MARGIN <= measured["bytes"] / measured["estimate"] <= tr.REMAT_MARGIN
    _assert_same_training(*results[:2])


def test_groupings_of_one_length_run_the_warmed_up_program():
    """After Trainer.warmup of a stream length, calls of that length compile no
    forward_backward program, whether one adapter holds all datums or two share them (their
    adapter and datum counts follow the length: batch.static_counts), nor a call of that
    length, max_tokens_per_device, run in turns (forward_backward_steps)."""
    from helpers import trainer_harness as H

    cfg = jcp.QwenConfig.tiny(num_layers=1)
    tr = jcp.Trainer(
        cfg,
        jcp.make_mesh(1, 1, 1),
        max_adapters=4,
        max_rank=4,
        attn_block=16,
        logprob_chunk=16,
        remat=False,
        max_tokens_per_device=512,
    )
    assert tr.warmup(rows=[512]) == 1
    a, b = tr.create_adapter(rank=4), tr.create_adapter(rank=2, alpha=4.0)
    data = H.random_data((64,) * 8, seed=2)  # 512 rows
    assert [shape[1] for shape in tr.pass_shapes(data)] == [512]
    for adapters in ([a] * 8, [a] * 4 + [b] * 4):
        tr.forward_backward(data, "cross_entropy", adapters=adapters)
        tr.optim_step(a)
    assert len(tr.forward_backward_programs) == 1
    assert tr.adapters.keys() == {a, b}  # the warm-up's scratch adapter is gone
    assert np.abs(tr.gradients(b)["base_model.model.lm_head.lora_B.weight"]).max() > 0

    # The warm-up also wrote, copied, offloaded and restored slots (_warm_slot_writes): an
    # adapter of another rank needs no new program for any of those.
    def slot_writes():
        c = tr.create_adapter(rank=3)
        tr.delete_adapter(tr.copy_adapter(c))
        tr.delete_adapter(tr.restore_adapter(tr.offload_adapter(c)))

    _, events = H.traces_and_compiles(slot_writes)
    assert events == [], events

    def in_turns():  # a heavy tenant's split pass in jcp-serve
        return _steps_taken(tr.forward_backward_steps(data * 2, adapters=[a] * 16, turns=True))

    n, events = H.traces_and_compiles(in_turns)
    # Two micro-batches, four steps each: one layer span, then the head and the loss.
    assert n == 8 and events == [], (n, events)


def _steps_taken(steps) -> int:
    """Run a call's Steps to the end -> how many steps it took."""
    n = 1
    while not steps.step():
        n += 1
    return n


def test_turns_after_warmup_compile_nothing():
    """Trainer.warmup of max_tokens_per_device also compiles the programs of a pass in
    turns: a forward's two (forward_steps(turns=True): the first half of the layers, then
    the rest and the loss), and a forward_backward's six (two layer spans, then the head
    and the loss: each one's forward pass, then each one's backward pass), so that a heavy
    tenant's pass split in turns in jcp-serve compiles nothing."""
    from helpers import trainer_harness as H

    cfg = jcp.QwenConfig.tiny()  # two layers: a pass in turns needs more than one
    tr = jcp.Trainer(
        cfg, jcp.make_mesh(1, 1, 1), max_adapters=2, max_rank=4, max_tokens_per_device=64
    )
    assert tr.programs.turn_spans == 2
    tr.warmup(rows=[64])
    a = tr.create_adapter(rank=4)
    data = H.random_data((64, 64, 64), seed=3)

    def in_turns(steps):
        return lambda: _steps_taken(steps(data, adapters=a, turns=True))

    n, events = H.traces_and_compiles(in_turns(tr.forward_steps))
    assert n == 6 and events == [], (n, events)  # three micro-batches, two steps each
    n, events = H.traces_and_compiles(in_turns(tr.forward_backward_steps))
    assert n == 18 and events == [], (n, events)  # three micro-batches, six steps each


def test_warmup_call_runs_the_calls_program_and_changes_nothing(monkeypatch):
    """Trainer.warmup_call compiles the call's forward_backward program and runs it
    WARMUP_RUNS times (XLA:CPU prepares its GEMM fusions on a program's first run), and
    every adapter's accumulated gradient is the same bits afterwards; the call itself then
    compiles nothing."""
    from helpers import trainer_harness as H

    from jcp import trainer as trainer_lib

    cfg = jcp.QwenConfig.tiny(num_layers=1)
    tr = jcp.Trainer(cfg, jcp.make_mesh(1, 1, 1), max_adapters=2, max_rank=4, remat=False)
    a = tr.create_adapter(rank=4, seed=1)
    tr.forward_backward(H.random_data((24,), seed=1), "cross_entropy", adapters=a)
    before = tr.gradients(a)
    assert max(float(np.abs(g).max()) for g in before.values()) > 0
    runs = []
    real = tr.programs.forward_backward
    monkeypatch.setattr(tr.programs, "forward_backward", lambda *x: (runs.append(1), real(*x))[1])
    data = H.random_data((40, 8), seed=2)
    assert tr.warmup_call(data, "cross_entropy", adapters=a) == 1
    assert len(runs) == trainer_lib.WARMUP_RUNS > 1
    for name, g in tr.gradients(a).items():
        np.testing.assert_array_equal(g, before[name], err_msg=name)
    programs = len(tr.forward_backward_programs)
    tr.forward_backward(data, "cross_entropy", adapters=a)
    assert len(tr.forward_backward_programs) == programs


def test_trainers_of_equal_settings_share_their_programs(retrace):
    """A second Trainer of the same model, mesh and settings traces and compiles nothing
    for its forward_backward, optim_step and sampling (jcp/program_cache.py), and still
    trains and samples its own adapter; one of another logprob_chunk traces anew."""
    from helpers import trainer_harness as H

    def make(chunk=16):
        return jcp.Trainer(
            jcp.QwenConfig.tiny(num_layers=1),
            jcp.make_mesh(1, 2, 1),
            max_adapters=2,
            max_rank=4,
            logprob_chunk=chunk,
        )

    data = H.random_data((24, 9), seed=1)
    params = jcp.SamplingParams(max_tokens=3, temperature=0.0)

    def run(seed, chunk):
        tr = make(chunk)
        a = tr.create_adapter(rank=4, seed=seed)
        tr.forward_backward(data, "cross_entropy", adapters=a)
        tr.optim_step(a, jcp.AdamParams(learning_rate=1e-2))
        out = tr.forward(data, "cross_entropy", adapters=a)
        tokens = tr.sample([[1, 2, 3]], params, adapters=a)[0].sequences[0].tokens
        return out.loss_fn_outputs[0]["logprobs"], tokens

    results = [
        (*out, events)
        for out, events in (
            H.traces_and_compiles(lambda s=seed, c=chunk: run(s, c))
            for seed, chunk in ((1, 16), (2, 16), (2, 32))
        )
    ]
    (first, t1, e1), (second, t2, e2), (third, t3, e3) = results
    assert e1 and e2 == [] and e3, (e1, e2, e3)
    assert not np.allclose(first, second)  # its own adapter, through the shared program
    np.testing.assert_allclose(second, third, rtol=1e-6)
    assert list(t2) == list(t3) and len(t1) == 3


def _projections_in_loops(program) -> int:
    return sum(
        "si,io->so/dot_general" in ln and "while/body" in ln
        for ln in program.as_text().splitlines()
    )


def test_cpu_unrolled_layer_loop_equals_rolled(monkeypatch, retrace):
    """On XLA:CPU a model of ≤ CPU_UNROLL_LAYERS layers trains with its layer loop unrolled
    (train_step.unroll_layers): none of its layers' projections runs inside a loop, as all
    of the rolled program's do, and the numbers are the same. RoPE's cos / sin are taken
    once for all layers (decoder.rotary), not per layer, nor fused into every q / k element:
    the unrolled program holds one cosine per branch of rotary's cond."""
    from helpers import trainer_harness as H

    from jcp import model_loss

    cfg = jcp.QwenConfig.tiny()
    data = H.random_data((37, 20, 5), seed=1)
    results, whiles, cosines = [], [], []
    for limit in (model_loss.CPU_UNROLL_LAYERS, 0):
        monkeypatch.setattr(model_loss, "CPU_UNROLL_LAYERS", limit)
        jax.clear_caches()  # the second Trainer would share the first one's programs
        tr = jcp.Trainer(
            cfg, jcp.make_mesh(1, 1, 1), max_adapters=1, max_rank=4, attn_block=16, logprob_chunk=16
        )
        a = tr.create_adapter(rank=4, alpha=8.0, seed=3)
        out = tr.forward_backward(data, "cross_entropy", adapters=a)
        (program,) = tr.forward_backward_programs.values()
        whiles.append(_projections_in_loops(program))
        cosines.append(program.as_text().count(" cosine("))
        results.append((out, tr.gradients(a)))
    assert whiles[0] == 0 < whiles[1], whiles
    assert cfg.num_layers > 1 and cosines[0] <= 2, cosines
    _assert_same_training(*results)


def test_cpu_unrolls_a_hybrid_models_runs_of_layers():
    """A hybrid model's runs of same-kind layers (3 Gated DeltaNet, then 1 full attention)
    unroll on XLA:CPU too, the run of one layer included: no projection runs inside a loop
    (a rolled run slices every stack and copies every saved activation, 12-15 % of a 16k
    step). Its numbers against peft: tests/model/test_qwen3_5.py, which trains unrolled."""
    cfg = jcp.QwenConfig.tiny_qwen3_5()
    assert not all(cfg.linear_layers) and any(cfg.linear_layers)
    tr = jcp.Trainer(cfg, jcp.make_mesh(1, 1, 1), max_adapters=1, max_rank=4)
    a = tr.create_adapter(rank=4, alpha=8.0, seed=3)
    ids = np.arange(17, dtype=np.int32) % cfg.vocab_size
    datum = jcp.Datum(ids[:-1], {"target_tokens": ids[1:], "weights": np.ones(16, np.float32)})
    tr.forward_backward([datum], "cross_entropy", adapters=a)
    (program,) = tr.forward_backward_programs.values()
    assert _projections_in_loops(program) == 0


def _assert_same_training(a, b):
    """Two (forward_backward output, gradients) pairs carry the same loss, log-probs and
    (non-zero) gradients."""
    (out_a, g_a), (out_b, g_b) = a, b
    assert out_a.metrics["loss:sum"] == pytest.approx(out_b.metrics["loss:sum"], rel=1e-6)
    for x, y in zip(out_a.loss_fn_outputs, out_b.loss_fn_outputs):
        np.testing.assert_allclose(x["logprobs"], y["logprobs"], rtol=1e-6, atol=1e-6)
    assert any(np.abs(v).max() > 0 for v in g_a.values())
    for k in g_a:
        np.testing.assert_allclose(
            g_a[k], g_b[k], rtol=1e-5, atol=1e-6 * np.abs(g_a[k]).max(), err_msg=k
        )


def test_auto_adapter_memory_takes_a_share_of_free_memory():
    from jcp import adapter_state

    cfg = jcp.QwenConfig.tiny()
    mesh = jcp.make_mesh(2, 2, 2)
    tr = jcp.Trainer(cfg, mesh, max_adapters=4096, max_rank=8, adapter_memory="auto")
    page = adapter_state.page_bytes(cfg, mesh, 8)
    assert tr.state.page_bytes == page
    # A quarter of this host's share per device, and fewer pages than 4096 slots would ask.
    share = 0.5 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / mesh.devices.size
    assert int(0.25 * share) // page < 4096
    assert tr.state.num_pages == int(0.25 * share) // page


def test_a_cpu_meshs_memory_is_the_hosts_share_over_its_own_devices():
    """On CPU a device's memory (mesh.device_memory, the remat and adapter budgets) is half
    the host's memory over the mesh's devices, not over every fake device of the process:
    a (1,1,1) Trainer beside 7 unused devices budgets what a one-device process would."""
    from jcp.mesh import device_memory

    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    one, four = jcp.make_mesh(1, 1, 1), jcp.make_mesh(1, 2, 2)
    assert one.devices.size != four.devices.size
    assert device_memory(one) == (int(0.5 * physical), 0)
    assert device_memory(four) == (int(0.5 * physical / 4), 0)
