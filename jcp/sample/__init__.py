"""Sampling with the Trainer's own base weights and adapter slots.

The package, by owner:

    params.py    SamplingParams, PromptFields (SDK 0.38 extras), results, validation of a
                 call, per-sequence seed streams
    draws.py     the token draw of one decode step, per-row parameters, vocab-parallel
    layout.py    the host-side layout of a call (pure NumPy): cache plan, rows, positions,
                 prefill sources, adapter indices
    kv_cache.py  the KV cache: its layouts, prefill's fill, decode's attention and writes
    programs.py  the compiled prefill and decode programs (dataclass arguments + specs)
    decode_loop.py  the decode loop both decoders run: its rows, the model each step
                 runs (StepModel), the loop in named steps
    runner.py    the device side both samplers hold: weights, programs, device arrays and
                 program calls (Runner), and one engine's paged cache (EngineDevice)
    sampler.py   the static sampler behind Trainer.sample / compute_logprobs
    paged.py     the engine's paged KV cache: the pool and the extend (chunked prefill),
                 decode and page-copy programs
    paged_attention.py  attention through page tables (extend, decode, in place)
    engine_config.py  EngineConfig (the engine's settings) and EngineSizes (its buckets)
    pages.py     the host page pool (free lists, reference counts, prefix cache) and
                 prefix keys (pure host)
    requests.py  the engine's request records, submit's options, a request's result
                 (pure host)
    admission.py the engine's admission policy over those records: place, fork, grow,
                 release, what could never fit, decode length (pure host)
    warmup.py    every program of an engine's buckets compiled up front
    engine.py    the continuous-batching engine (requests join and leave between steps):
                 submit / step / result

Sampling reuses the one decoder (model.hidden_states), LoRA routing and log-prob code;
it never writes a second decoder and never changes adapter state.
"""

from jcp.sample.draws import nucleus_mask, sample_tokens
from jcp.sample.engine_config import EngineConfig
from jcp.sample.layout import CACHE_MODES, SPLIT_ABOVE_BYTES, Plan, choose_cache_mode
from jcp.sample.params import (
    BASE,
    MAX_TOPK,
    MIN_TEMPERATURE,
    PromptFields,
    SampledSequence,
    SampleResult,
    SamplingParams,
    TopK,
    check_fields,
    check_params,
    check_prompts,
    sequence_keys,
)
from jcp.sample.programs import SLICE_LAYERS_MAX_BYTES, make_decode, make_prefill
from jcp.sample.sampler import Limits, Sampler

__all__ = [
    "BASE",
    "CACHE_MODES",
    "EngineConfig",
    "Limits",
    "MAX_TOPK",
    "MIN_TEMPERATURE",
    "Plan",
    "PromptFields",
    "SLICE_LAYERS_MAX_BYTES",
    "SPLIT_ABOVE_BYTES",
    "SampleResult",
    "SampledSequence",
    "Sampler",
    "SamplingParams",
    "TopK",
    "check_fields",
    "check_params",
    "check_prompts",
    "choose_cache_mode",
    "make_decode",
    "make_prefill",
    "nucleus_mask",
    "sample_tokens",
    "sequence_keys",
]
