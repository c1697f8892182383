"""Mixture-of-experts pieces: the router, the dropless grouped expert matmuls, and which
layers are MoE.

Owns routing exactly as transformers' Qwen3-MoE computes it and the per-shard expert
computation over this tp rank's E/tp whole experts. model.moe_mlp assembles them into the
MLP block. It must never drop a token (no capacity factor), never add a collective (the
MLP's psum over tp combines the experts of all ranks), and never hold or place weights.

Shapes: see the legend in jcp/mesh.py (X experts per token, Z = S·X (token, choice) rows,
Fe an expert's width); here E is this rank's experts (E/tp of them).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jcp import lora as lora_lib
from jcp.lora_grouped import plan_rows, tile_product, tile_rows
from jcp.mesh import vary_all

# Rows per tile of the CPU grouped matmul (see grouped_matmul).
TILE = 64


def router_probs(x_SxD, router_DxE):
    """The router's probabilities of every expert, fp32 [S, E] (E all the model's experts):
    logits x @ W in x's dtype, softmax in fp32 (as transformers)."""
    logits_SxE = jnp.einsum("sd,de->se", x_SxD, router_DxE.astype(x_SxD.dtype))
    return jax.nn.softmax(logits_SxE.astype(jnp.float32), axis=-1)


def route(x_SxD, router_DxE, top_k: int, normalize: bool):
    """(weights [S, X] in x's dtype, experts [S, X] int32) as transformers routes:
    logits x @ W in x's dtype, softmax in fp32, top-k, renormalised when `normalize`."""
    probs_SxE = router_probs(x_SxD, router_DxE)
    top_SxX, experts_SxX = jax.lax.top_k(probs_SxE, top_k)
    if normalize:
        top_SxX = top_SxX / jnp.sum(top_SxX, axis=-1, keepdims=True)
    return top_SxX.astype(x_SxD.dtype), experts_SxX.astype(jnp.int32)


def grouped_matmul(x_ZxI, w_ExIxO, sizes_E):
    """Row block g of x (rows sorted by group, sizes_E[g] rows each) times w[g]: [Z, O].

    Rows past Σ sizes_E belong to no group and come back as zeros. Accelerators use
    jax.lax.ragged_dot. On CPU (jax 0.10.2) ragged_dot is a masked dense matmul (every row
    times every group); there each group is padded to a multiple of TILE rows and a
    lax.map runs one [TILE, I] @ [I, O] per tile — (Z + E·TILE)·I·O work, not E·Z·I·O.
    Measured at Z=1024, I=256, O=128, E=8 (fwd / grad of x): ragged_dot 9.2 / 5.9 ms,
    all-experts dense then select 6.6 / 0.6 ms, tiles 1.5 / 2.3 ms.
    """
    if jax.default_backend() != "cpu":
        return jax.lax.ragged_dot(x_ZxI, w_ExIxO.astype(x_ZxI.dtype), sizes_E)
    m, num_groups = x_ZxI.shape[0], w_ExIxO.shape[0]
    tiles = -(-m // TILE) + num_groups
    padded_E = (sizes_E + TILE - 1) // TILE * TILE
    pad_end_E = jnp.cumsum(padded_E)
    row_group_Z = jnp.searchsorted(jnp.cumsum(sizes_E), jnp.arange(m), side="right")
    in_group = row_group_Z < num_groups
    g = jnp.minimum(row_group_Z, num_groups - 1)
    rank_in_group = jnp.arange(m) - (jnp.cumsum(sizes_E) - sizes_E)[g]
    # Destination row in the padded buffer; rows of no group go past its end (dropped).
    dest_Z = jnp.where(in_group, pad_end_E[g] - padded_E[g] + rank_in_group, tiles * TILE)
    buf = jnp.zeros((tiles * TILE, x_ZxI.shape[1]), x_ZxI.dtype).at[dest_Z].set(x_ZxI, mode="drop")
    tile_group = jnp.minimum(
        jnp.searchsorted(pad_end_E, jnp.arange(tiles) * TILE, side="right"), num_groups - 1
    )
    w = w_ExIxO.astype(x_ZxI.dtype)

    # Rematerialised, so the backward pass keeps each tile's rows, not a [tiles, I, O]
    # stack of the weight slices the tiles read (measured at Z=8192, I=512, O=768, E=8:
    # grad temp 329 -> 125 MiB). Tiles past the groups' rows (other tp ranks' experts)
    # still run on zeros: skipping them with lax.cond deadlocked under tp (the zero
    # branch must be cast to varying over tp, and that cast's transpose is a psum that
    # only the ranks taking the branch would enter).
    y = jax.lax.map(
        jax.checkpoint(lambda t: t[0] @ w[t[1]]), (buf.reshape(tiles, TILE, -1), tile_group)
    )
    return y.reshape(tiles * TILE, -1).at[dest_Z].get(mode="fill", fill_value=0)


def _per_expert(w_AxExIxO):
    """[A, E, I, O] -> [E, I, A·O]: every active adapter's factor of an expert side by
    side, so one grouped matmul applies all of them."""
    a, e, i, o = w_AxExIxO.shape
    return jnp.transpose(w_AxExIxO, (1, 2, 0, 3)).reshape(e, i, a * o)


def _expert_lora(x_ZxI, lora_m, sizes_E, token_Z, route, token_w_SxA, u_shared_SxAxR=None):
    """One expert module's LoRA update of the sorted rows: [Z, O].

    Row m (token t, its local expert e, t's adapter k) gets scale_k · x_m @ A_ke @ B_ke;
    the other adapters' columns of u = x @ [A_1e … A_Ae] are zeroed by token_w (the
    token's own adapter only, at its scale). A shared-outer adapter's A (a_shared, one per
    layer) is applied per token before the sort (u_shared_SxAxR), its B (b_shared) after
    the per-expert side; jnp.where keeps the unused factor of each mode without gradient.
    """
    m_rows, num_a = x_ZxI.shape[0], token_w_SxA.shape[1]
    shared_A = (route.shared_A > 0.5)[None, :, None]
    if "a" not in lora_m:  # a table of shared-outer adapters only
        u_ZxAxR = u_shared_SxAxR[token_Z]
    else:
        u_ZxAxR = grouped_matmul(x_ZxI, _per_expert(lora_m["a"]), sizes_E).reshape(
            m_rows, num_a, -1
        )
        if u_shared_SxAxR is not None:
            u_ZxAxR = jnp.where(shared_A, u_shared_SxAxR[token_Z], u_ZxAxR)
    u_ZxAxR = u_ZxAxR * token_w_SxA[token_Z][:, :, None].astype(u_ZxAxR.dtype)

    def per_expert_b(u):
        b = lora_m["b"]  # [A, E, R, O]
        b_ExARxO = jnp.transpose(b, (1, 0, 2, 3)).reshape(b.shape[1], -1, b.shape[3])
        return grouped_matmul(u.reshape(m_rows, -1), b_ExARxO, sizes_E)

    def shared_b(u):
        b_sh = lora_m["b_shared"]  # [A, R, O]
        return u.reshape(m_rows, -1) @ b_sh.reshape(-1, b_sh.shape[-1]).astype(u.dtype)

    if "b_shared" not in lora_m:
        return per_expert_b(u_ZxAxR)
    if "b" not in lora_m:
        return shared_b(u_ZxAxR)
    return per_expert_b(jnp.where(shared_A, 0, u_ZxAxR)) + shared_b(jnp.where(shared_A, u_ZxAxR, 0))


def _masked_lora(x_SxD, lora, route, token_Z, sizes_E):
    """delta(module, x_ZxI) -> [Z, O]: the expert modules' LoRA of a few adapters (a dense
    routing): every row times all A adapters' factors of its expert, masked to its own
    adapter (_expert_lora)."""
    token_w_SxA = jnp.where(route.mask_SxA(x_SxD.shape[0]), route.scale_A[None, :], 0.0)

    def shared_in(m):
        if m == "expert_down" or "a_shared" not in lora[m]:  # down: B is the shared side
            return None
        a_sh = lora[m]["a_shared"]  # [A, D, R]
        return jnp.einsum("sd,adr->sar", x_SxD, a_sh.astype(x_SxD.dtype))

    def delta(m, x_ZxI):
        lora_m = _tied_up(lora, route) if m == "expert_up" else lora[m]
        return _expert_lora(x_ZxI, lora_m, sizes_E, token_Z, route, token_w_SxA, shared_in(m))

    return delta


def _grouped_lora(x_SxD, lora, route, token_Z, expert_Z, num_local):
    """delta(module, x_ZxI) -> [Z, O]: the expert modules' LoRA of a grouped routing
    (route.tiles) over the sorted rows (token_Z, expert_Z: local expert, -1 for another
    rank's), each (token, expert) row times its own adapter's factors of its expert
    only, in tiles of one (expert, adapter) group's rows (lora_grouped: G = E·A groups,
    group e·A + k) — no row pays for the other adapters. Shared-outer factors: the shared
    A per token by the routing's own tiles (lora.low_rank_input), the shared B as the
    group's B; an adapter's unused factor gets no gradient (jnp.where)."""
    tiles, n_a = route.tiles, route.active_A.shape[0]
    k_S, w_S = tiles.pick_Q, tiles.weight_Q
    if tiles.place_S is not None:  # rows routed one by one: back to the stream's order
        k_S, w_S = k_S[tiles.place_S], w_S[tiles.place_S]
    k_Z, w_Z = k_S[token_Z], w_S[token_Z]
    n_g, n_z = num_local * n_a, k_Z.shape[0]
    t = plan_rows(
        jnp.maximum(expert_Z, 0) * n_a + k_Z,
        jnp.ones((n_g,), bool),
        jnp.zeros((n_g,), jnp.float32),
        tile_rows(n_z, min(n_g, n_z)),
        live_S=(expert_Z >= 0) & (w_Z != 0),
    )
    shared_A = route.shared_A > 0.5
    shared_Q = shared_A[k_Z][t.order_Q][:, None]
    shared_G = jnp.tile(shared_A, num_local)[:, None, None]  # group e·A + k: adapter k's
    token_Q = token_Z[t.order_Q]

    def groups(f_AxE):
        """[A, E, …] -> [E·A, …] (group e·A + k)."""
        return jnp.swapaxes(f_AxE, 0, 1).reshape((n_g,) + f_AxE.shape[2:])

    def product(x_QxI, w_GxIxO):
        w_GxIxO = w_GxIxO.astype(x_QxI.dtype)
        return tile_product(vary_all(x_QxI, w_GxIxO), vary_all(w_GxIxO, x_QxI), t)

    def shared_in(m, dtype):
        """Each row's (x @ a_shared[k])·scale_k, in the plan's row order."""
        u_S = lora_lib.low_rank_input(x_SxD, lora[m]["a_shared"], route)
        u_S = u_S if tiles.place_S is None else u_S[tiles.place_S]
        return u_S.astype(dtype)[token_Q]

    def delta(m, x_ZxI):
        lora_m = _tied_up(lora, route) if m == "expert_up" else lora[m]
        dtype = x_ZxI.dtype
        u_sh = None if m == "expert_down" or "a_shared" not in lora_m else shared_in(m, dtype)
        if "a" in lora_m:
            u = product(x_ZxI[t.order_Q], groups(lora_m["a"])) * w_Z[t.order_Q][:, None]
            u = u.astype(dtype) if u_sh is None else jnp.where(shared_Q, u_sh, u.astype(dtype))
        else:  # a table of shared-outer adapters only
            u = u_sh
        b_G = None if "b" not in lora_m else groups(lora_m["b"])
        if "b_shared" in lora_m:
            b_sh = lora_m["b_shared"]  # [A, R, O]: every expert of a group's adapter
            b_sh = groups(jnp.broadcast_to(b_sh[:, None], (n_a, num_local) + b_sh.shape[1:]))
            b_G = b_sh if b_G is None else jnp.where(shared_G, b_sh, b_G)
        return product(u, b_G)[t.place_S]

    return delta


def _tied_up(lora, route) -> dict:
    """expert_up's factors with a fused_gate_up slot's A taken from expert_gate (the one A
    of peft's fused gate_up: both uses of it add into its gradient)."""
    up, gate = lora["expert_up"], lora["expert_gate"]
    if route.tied_A is None or "a" not in gate:
        return up
    tied = (route.tied_A > 0.5)[:, None, None, None]  # [A, 1, 1, 1] over a [A, E, D, R]
    return {**up, "a": jnp.where(tied, gate["a"], up["a"]) if "a" in up else gate["a"]}


class ExpertWeights(NamedTuple):
    """One layer's expert matrices held on this rank (E of them): a pytree."""

    gate_ExDxFe: jax.Array
    up_ExDxFe: jax.Array
    down_ExFexD: jax.Array


def experts(
    x_SxD,
    weights_SxX,
    experts_SxX,
    w: ExpertWeights,
    first: int,
    lora=None,
    route=None,
):
    """Σ over each token's chosen experts held here (global ids first … first+E−1) of
    weight · down(silu(gate(x)) · up(x)) with w's matrices: [S, D], this rank's part (psum
    over tp after).

    The (token, choice) rows are sorted by local expert, rows for other ranks' experts
    last, with weight 0 (on CPU their tiles still multiply zeros: the static tile count
    covers every row, dropless). An expert that receives no row adds no tile.
    lora: this layer's expert factors of the active adapters ({"expert_gate": {"a":
    [A, E, D, R], "a_shared": [A, D, R], "b": [A, E, R, Fe]}, "expert_up": likewise,
    "expert_down": {"a": [A, E, Fe, R], "b": [A, E, R, D], "b_shared": [A, R, D]}}, E this
    rank's experts) or None; route: the tokens' adapters (lora.Routing).
    """
    gate_ExDxFe, up_ExDxFe, down_ExFexD = w
    s_len, top_k = experts_SxX.shape
    num_local = gate_ExDxFe.shape[0]
    local_Z = experts_SxX.reshape(-1) - first
    mine_Z = (local_Z >= 0) & (local_Z < num_local)
    key_Z = jnp.where(mine_Z, local_Z, num_local)
    order_Z = jnp.argsort(key_Z, stable=True)
    sizes_E = jnp.bincount(key_Z, length=num_local + 1)[:num_local].astype(jnp.int32)
    token_Z = order_Z // top_k
    x_ZxD = x_SxD[token_Z]
    g_ZxFe = grouped_matmul(x_ZxD, gate_ExDxFe, sizes_E)
    u_ZxFe = grouped_matmul(x_ZxD, up_ExDxFe, sizes_E)
    if lora is not None:
        if route.tiles is None:
            delta = _masked_lora(x_SxD, lora, route, token_Z, sizes_E)
        else:
            expert_Z = jnp.where(mine_Z, local_Z, -1)[order_Z]  # -1: another rank's
            delta = _grouped_lora(x_SxD, lora, route, token_Z, expert_Z, num_local)
        g_ZxFe = g_ZxFe + delta("expert_gate", x_ZxD).astype(g_ZxFe.dtype)
        u_ZxFe = u_ZxFe + delta("expert_up", x_ZxD).astype(u_ZxFe.dtype)
    z_ZxFe = jax.nn.silu(g_ZxFe) * u_ZxFe
    y_ZxD = grouped_matmul(z_ZxFe, down_ExFexD, sizes_E)
    if lora is not None:
        y_ZxD = y_ZxD + delta("expert_down", z_ZxFe).astype(y_ZxD.dtype)
    w_Z = jnp.where(mine_Z, weights_SxX.reshape(-1), 0)[order_Z]
    return jnp.zeros_like(x_SxD).at[token_Z].add(y_ZxD * w_Z[:, None].astype(y_ZxD.dtype))


# ----------------------------------------------------------------------------------------
# Routing statistics: Tinker's load metrics and the opt-in auxiliary loss. Here E is all
# the model's experts (routing is the same on every tp rank).


@dataclasses.dataclass(frozen=True)
class RouterStats:
    """How one shard routed the tokens it counts, per MoE layer: [E] each, [Lm, E] once
    stacked over the MoE layers.

    counts: int32, the (token, choice) assignments each expert received (Σ = tokens · X);
    prob_sum: float32, Σ over those tokens of the router's probability of each expert — it
    carries the auxiliary loss's gradient to everything upstream of the router.
    """

    counts: jax.Array
    prob_sum: jax.Array


jax.tree_util.register_dataclass(RouterStats, data_fields=["counts", "prob_sum"], meta_fields=[])


def router_stats(probs_SxE, experts_SxX, count_S) -> RouterStats:
    """RouterStats [E] of the tokens where count_S (bool [S]; training counts its real
    tokens, padding excluded). The counts are integers: no gradient passes through them."""
    num_experts = probs_SxE.shape[1]
    key_Z = jnp.where(count_S[:, None], experts_SxX, num_experts).reshape(-1)
    counts_E = jnp.bincount(key_Z, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    prob_sum_E = jnp.sum(jnp.where(count_S[:, None], probs_SxE, 0.0), axis=0)
    return RouterStats(counts_E, prob_sum_E)


def load_balancing_loss(counts_LxE, prob_sum_LxE, num_tokens, top_k: int):
    """Switch Transformer's auxiliary loss, summed over the MoE layers: float32 [].

        aux = Σ_l E · Σ_e f_le · P_le,  f_le = counts_le / (n · X),  P_le = prob_sum_le / n

    with n = num_tokens (the counted tokens, Σ_e counts_le = n · X): f_le is the fraction
    of layer l's (token, choice) assignments that went to expert e (a constant of the
    gradient), P_le the mean router probability of e. A layer's term is 1 when routing is
    uniform. transformers' load_balancing_loss_func of a single layer normalises f by n
    alone, so it is X times that layer's term (over several layers it pools them first).
    """
    n = jnp.maximum(num_tokens, 1).astype(jnp.float32)
    f_LxE = jax.lax.stop_gradient(counts_LxE.astype(jnp.float32)) / (n * top_k)
    return counts_LxE.shape[-1] * jnp.sum(f_LxE * prob_sum_LxE / n)


LOAD_METRICS = (
    "e_frac_with_tokens:mean",
    "e_frac_oversubscribed:mean",
    "e_max_violation:mean",
    "e_max_violation:max",
    "e_min_violation:mean",
)


def load_metrics(counts_LxE) -> dict[str, float]:
    """Tinker's MoE load metrics (host, NumPy) from each MoE layer's per-expert assignment
    counts [Lm, E] over a whole batch.

    Per layer l, with c_e its (token, choice) assignments to expert e and perfect balance
    b = Σ_e c_e / E (every expert an equal share; Σ_e c_e = tokens · X):
      frac_with_tokens   = #{e : c_e ≥ 1} / E
      frac_oversubscribed = #{e : c_e > b} / E
      max_violation      = (max_e c_e − b) / b     (≥ 0; 2.0: the busiest expert got 3 b)
      min_violation      = (min_e c_e − b) / b     (in [−1, 0]; −1: some expert got none)
    then the mean over layers (`:mean`), and for max_violation also the max (`:max`).
    min_violation has Tinker's sign ("typically negative; decreasing is concerning"). A
    layer without assignments (no real token) gets violations 0.
    """
    c = np.asarray(counts_LxE, np.float64)
    num_experts = c.shape[-1]
    b = c.sum(axis=-1) / num_experts
    safe = np.where(b > 0, b, 1.0)
    with_tokens = np.mean(c >= 1, axis=-1)
    over = np.mean(c > b[:, None], axis=-1)
    max_v = np.where(b > 0, (c.max(axis=-1) - b) / safe, 0.0)
    min_v = np.where(b > 0, (c.min(axis=-1) - b) / safe, 0.0)
    return dict(
        zip(
            LOAD_METRICS,
            (
                float(with_tokens.mean()),
                float(over.mean()),
                float(max_v.mean()),
                float(max_v.max()),
                float(min_v.mean()),
            ),
        )
    )
