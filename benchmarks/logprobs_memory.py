"""Per-device compiled memory of token log-probs, forward + backward: jcp's chunked
vocab-parallel path against a naive full-logits log-softmax.

Both programs compute d(Σ_t c_t · log p(target_t))/d(hidden, unembedding) for S tokens,
hidden D, vocab V; they are only compiled (never run), and XLA's memory analysis of the
compiled program is reported: temp (scratch) + argument + output bytes. The naive program
holds [S, V] fp32 logits and their softmax; the chunked one never holds more than a
[chunk, V] block.

    python benchmarks/logprobs_memory.py [--tokens 16384 --hidden 256 --vocab 32768]

Runs on CPU with one (fake) device in well under a minute.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jcp import losses  # noqa: E402
from jcp import mesh as mesh_lib  # noqa: E402


def chunked_program(mesh, chunk):
    sp = mesh_lib.SPECS

    def loss(h_SxD, w_DxV, targets_S, coef_S):
        def inner(h, w, t, c):
            lp_S = losses.target_logprobs(
                losses.Unembedding((h[0, 0],), (w,)), t[0, 0], chunk=chunk
            )
            return jax.lax.psum(jnp.sum(c[0, 0] * lp_S), mesh_lib.BATCH_AXES)

        return jax.shard_map(
            inner,
            mesh=mesh,
            in_specs=(sp.stream_DPxCPxSxD, sp.unembed_DxV, sp.stream_DPxCPxS, sp.stream_DPxCPxS),
            out_specs=sp.replicated,
        )(h_SxD[None, None], w_DxV, targets_S[None, None], coef_S[None, None])

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def naive_program():
    def loss(h_SxD, w_DxV, targets_S, coef_S):
        logits_SxV = jnp.einsum("sd,dv->sv", h_SxD, w_DxV, preferred_element_type=jnp.float32)
        logp_SxV = jax.nn.log_softmax(logits_SxV, axis=-1)
        lp_S = jnp.take_along_axis(logp_SxV, targets_S[:, None], axis=-1)[:, 0]
        return jnp.sum(coef_S * lp_S)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def memory(fn, args):
    m = fn.lower(*args).compile().memory_analysis()
    if m is None:
        raise SystemExit("this backend reports no memory analysis")
    return {
        "temp": m.temp_size_in_bytes,
        "argument": m.argument_size_in_bytes,
        "output": m.output_size_in_bytes,
        "total": m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes,
    }


def mib(b):
    return f"{b / 2**20:10.1f} MiB"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=losses.DEFAULT_CHUNK)
    args = ap.parse_args()
    s, d, v = args.tokens, args.hidden, args.vocab

    f32 = jnp.float32
    shapes = (
        jax.ShapeDtypeStruct((s, d), f32),
        jax.ShapeDtypeStruct((d, v), f32),
        jax.ShapeDtypeStruct((s,), jnp.int32),
        jax.ShapeDtypeStruct((s,), f32),
    )
    mesh = mesh_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    chunk = mesh_lib.block_size(s, args.chunk)

    chunked = memory(chunked_program(mesh, chunk), shapes)
    naive = memory(naive_program(), shapes)

    print(
        f"log-prob forward+backward, S={s} tokens, D={d}, V={v}, fp32, "
        f"{jax.devices()[0].platform} (one device), chunk={chunk}"
    )
    print(f"{'':10s} {'chunked (jcp)':>16s} {'naive [S, V]':>16s} {'ratio':>8s}")
    for k in ("temp", "argument", "output", "total"):
        ratio = naive[k] / chunked[k] if chunked[k] else float("nan")
        print(f"{k:10s} {mib(chunked[k]):>16s} {mib(naive[k]):>16s} {ratio:7.1f}x")
    print(f"one [S, V] fp32 array: {mib(s * v * 4).strip()}")


if __name__ == "__main__":
    main()
