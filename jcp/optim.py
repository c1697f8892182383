"""AdamW on one adapter slot: the jitted optim_step over every slot array.

Owns the per-slot AdamW update (optax's scale_by_adam, bias-corrected by the slot's own
step count, decoupled weight decay, global-norm clipping) and the rule that nothing
non-finite is ever applied. It must never touch a slot other than the one being stepped.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jcp.program_cache import shared


@dataclasses.dataclass(frozen=True)
class OptState:
    """AdamW state of every slot: moments like the slots, step count per slot [G]."""

    mu: dict
    nu: dict
    count: jax.Array


jax.tree_util.register_dataclass(OptState, data_fields=["mu", "nu", "count"], meta_fields=[])


def _norm(flat) -> jax.Array:
    """L2 norm of a vector; where Σ g² overflows float32 although every g is finite, the
    norm is taken with the entries scaled by the largest one, so it stays finite."""
    plain = jnp.sqrt(jnp.sum(jnp.square(flat)))
    big = jnp.max(jnp.abs(flat))
    safe = jnp.where((big > 0) & jnp.isfinite(big), big, 1.0)
    scaled = safe * jnp.sqrt(jnp.sum(jnp.square(flat / safe)))
    return jnp.where(jnp.isfinite(plain) | ~jnp.isfinite(big), plain, scaled)


@shared
def make_optim_step(mesh):
    """jit(step)(lora, acc, opt, slot, pages_K, hp) -> (lora, acc, opt, metrics) for one
    slot: its step count at `slot`, its weights, gradient and moments in the table pages
    pages_K (entries ≥ the page count: none; see lora.gather_pages).

    hp: float32 [6] = (learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm).
    AdamW (optax.scale_by_adam, bias-corrected by the slot's own count, decoupled weight
    decay); grad_clip_norm > 0 clips the slot's global gradient norm. The slot's
    accumulator is zeroed. Every other slot is left bit-identical (only its own pages and
    count are written).
    Nothing non-finite is ever applied: unless the gradient and the new weights and moments
    are all finite, the slot's weights, moments and count are written back unchanged
    (metrics grad_finite / applied say which).
    """
    replicated = NamedSharding(mesh, P())

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def optim_step(lora, acc, opt: OptState, slot, pages_K, hp):
        lr, b1, b2, eps, wd, clip = (hp[i] for i in range(6))
        # The slot's pages, [K, …page]; a missing page reads zeros (weights, gradient and
        # moments all zero: its AdamW update is zero) and is not written back.
        take = lambda t: jax.tree.map(  # noqa: E731
            lambda x: jnp.take(x, pages_K, axis=0, mode="fill", fill_value=0), t
        )
        # The slot's pages of each table as one vector (every leaf in turn): the update is
        # elementwise and the norm one sum, so one vector makes a few fused loops where
        # per-leaf ops made some per table leaf (64 leaves for attn + mlp + unembedding:
        # 1.84 -> ~0.9 s to compile on CPU, and as many fewer kernels a step on a GPU).
        params, unravel = ravel_pytree(take(lora))
        grads, mu, nu = (ravel_pytree(take(t))[0] for t in (acc, opt.mu, opt.nu))
        taken = grads
        grad_finite = jnp.all(jnp.isfinite(grads))
        grad_norm = _norm(grads)
        factor = jnp.where((clip > 0) & (grad_norm > clip), clip / grad_norm, 1.0)
        adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)
        old = optax.ScaleByAdamState(count=opt.count[slot], mu=mu, nu=nu)
        updates, state = adam.update(grads * factor, old, params)
        new_params = params - lr * (updates + wd * params)
        applied = grad_finite & jnp.all(
            jnp.isfinite(new_params) & jnp.isfinite(state.mu) & jnp.isfinite(state.nu)
        )
        keep = lambda new, prev: jnp.where(applied, new, prev)  # noqa: E731
        put = lambda t, v: jax.tree.map(  # noqa: E731
            lambda x, y: x.at[pages_K].set(y.astype(x.dtype), mode="drop"), t, unravel(v)
        )
        lora = put(lora, keep(new_params, params))
        # Zeros computed from the pages read above: the write then follows the read by data,
        # and XLA clears the donated accumulator in place; a constant 0 made it copy every
        # whole table (a step cost O(all pages): 89 against 2.6 ms at 1,170 pages vs 8).
        acc = put(acc, jnp.where(jnp.isfinite(taken), jnp.abs(taken), 0.0) * 0.0)
        count = keep(state.count, old.count)
        opt = OptState(
            mu=put(opt.mu, keep(state.mu, mu)),
            nu=put(opt.nu, keep(state.nu, nu)),
            count=opt.count.at[slot].set(count),
        )
        metrics = {
            "grad_norm": grad_norm,
            "learning_rate": lr,
            "step": count,
            "grad_finite": grad_finite,
            "applied": applied,
        }
        metrics = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, replicated), metrics)
        return lora, acc, opt, metrics

    return optim_step
