"""Gated delta rule: chunked (UT form) against the recurrent form, and the per-layer cp
exchange in bytes. Ratios within one run; run: python benchmarks/delta_rule.py [tokens]."""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jcp import delta_rule as dr


def _time(f, *args, reps=3):
    jax.block_until_ready(f(*args))
    t = time.perf_counter()
    for _ in range(reps):
        jax.block_until_ready(f(*args))
    return (time.perf_counter() - t) / reps


def main(s_len=2048, hk=2, h=4, dk=64, dv=64):
    rng = np.random.default_rng(0)
    q = dr.l2norm(rng.standard_normal((s_len, hk, dk)).astype(np.float32))
    k = dr.l2norm(rng.standard_normal((s_len, hk, dk)).astype(np.float32))
    v = jnp.asarray(rng.standard_normal((s_len, h, dv)).astype(np.float32))
    g = jnp.asarray(-np.abs(rng.standard_normal((s_len, h))).astype(np.float32) * 0.1)
    b = jnp.asarray(np.full((s_len, h), 0.5, np.float32))
    rec = jax.jit(lambda *a: dr.recurrent(*a)[0])
    t_rec = _time(rec, q, k, v, g, b)
    print(f"tokens {s_len}, heads {h} (k {hk}), dk {dk}, dv {dv}")
    print(f"recurrent      fwd {t_rec * 1e3:8.1f} ms")
    for chunk in (32, 64):
        ch = jax.jit(lambda *a, c=chunk: dr.chunked(*a, chunk=c)[0])
        t = _time(ch, q, k, v, g, b)
        print(f"chunked {chunk:3d}    fwd {t * 1e3:8.1f} ms   ({t_rec / t:.1f}x faster)")
    for cp in (2, 4, 8):
        slots = 1
        pieces = 2 * slots + 1
        exchanged = cp * pieces * h * dk * (dk + dv) * 4
        print(f"cp={cp}: exchange per linear layer {exchanged} bytes (all_gather of "
              f"{pieces} pieces' [H, dk, dk+dv] per rank; independent of tokens)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2048)
