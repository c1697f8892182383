"""forward_backward and forward with the (dp, cp) sum taken on each host: a multi-process
XLA:CPU job's step.

In a multi-process job XLA:CPU runs every collective over gloo's TCP transport, also among
one process's own devices, so the step's one all-reduce is split: each device's gradient
and output parts (train_step's shard_map body, no dp/cp collective), their sum over the
process's devices on the host (NumPy), and an all-reduce of one device per process
(benchmarks/serve_multiprocess.py, issue 24). Chosen by sums_on_host; the values equal
train_step.make_forward_backward's up to float rounding. Shapes: see jcp/mesh.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jcp import lora as lora_lib
from jcp import losses as losses_lib
from jcp import mesh as mesh_lib
from jcp import model as model_lib
from jcp import train_step
from jcp.config import QwenConfig
from jcp.mesh import BATCH_AXES, SPECS, TP


def sums_on_host(mesh) -> bool:
    """Whether forward_backward on `mesh` sums its gradient and outputs over each
    process's devices on the host (HostSummedStep) rather than in the program's all-reduce.

    In a multi-process job XLA:CPU runs every collective over gloo's TCP transport, also
    among the devices of one process: the 8,1,1 step's one all-reduce of 117 KB cost
    ~8 ms over 2 processes × 4 devices, a sum of the 4 local rows on the host plus a
    2-device all-reduce ~3 ms (benchmarks/serve_multiprocess.py, issue 24). So: CPU devices
    in more than one process, tp = 1 (with tp > 1 each tp rank holds its own slice of the
    gradient), and each process's devices one contiguous, equal block of the mesh's device
    order (jax.devices() order: what make_mesh gives)."""
    if mesh.devices.flat[0].platform != "cpu" or mesh_lib.axis_size(mesh, TP) != 1:
        return False
    procs = [d.process_index for d in mesh.devices.flat]
    n = len(set(procs))
    return (
        n > 1
        and procs == sorted(procs)
        and all(procs.count(p) == len(procs) // n for p in set(procs))
    )


class HostSummedStep:
    """forward_backward in two programs with the sum over each process's devices on the
    host between them (see sums_on_host); the same values as make_forward_backward's up to
    the order of the float32 sums.

    `partials[remat]`(lora, params, slot_meta, batch, loss_cfg) -> float32 [DP, CP, 1, V]:
    each device's own gradient of its shard's loss w.r.t. the active slots and its shard's
    output parts (shard_loss(summed=False)), one vector per device; no collective over dp
    or cp. The host adds the rows of its own devices (`local_sum`), and `finish`(acc, lora,
    slot_meta, sums, batch) adds the processes' sums over a (process, local device) view of the mesh —
    an all-reduce of one device per process — and accumulates as forward_backward does.
    `forward` is make_forward's step the same way (the output parts only). Dense models
    without a custom loss only (folds_outputs).
    """

    def __init__(
        self, cfg: QwenConfig, mesh, step_cfg: train_step.StepConfig, remats=(True, False)
    ):
        self.cfg, self.mesh = cfg, mesh
        nproc = len({d.process_index for d in mesh.devices.flat})
        self.view = jax.sharding.Mesh(mesh.devices.reshape(nproc, -1), ("proc", "local"))
        self.sums_sharding = NamedSharding(self.view, P("proc", "local"))
        position = {d: i for i, d in enumerate(mesh.devices.flat)}
        self._position = position.__getitem__
        self.partials = {
            r: self._make_partials(dataclasses.replace(step_cfg, remat=r)) for r in remats
        }
        self.finish = jax.jit(
            self._finish, static_argnames=("num_slots", "modules"), donate_argnums=(0,)
        )
        self.forward_partials = self._make_partials(step_cfg, backward=False)
        self._forward_finish = jax.jit(self._finish_forward, static_argnames=("num_slots",))

    def forward(
        self, lora, params, slot_meta, batch, loss_cfg, *, loss_fns, num_slots, modules=None
    ):
        """make_forward's (loss, out), the outputs summed on the host."""
        local = self.local_sum(
            self.forward_partials(
                lora,
                params,
                slot_meta,
                batch,
                loss_cfg,
                loss_fns=loss_fns,
                num_slots=num_slots,
                modules=modules,
            )
        )
        return self._forward_finish(self.sums(local), batch, num_slots=num_slots)

    def _make_partials(self, step_cfg: train_step.StepConfig, backward: bool = True):
        cfg, mesh = self.cfg, self.mesh

        @functools.partial(
            jax.jit,
            static_argnames=("loss_fns", "num_slots", "modules"),
            compiler_options=train_step.compiler_options(mesh),
        )
        def partials(
            lora, params, slot_meta, batch, loss_cfg, *, loss_fns, num_slots, modules=None
        ):
            active = lora_lib.take_active(
                train_step.used_modules(lora, modules), slot_meta.page_GK, batch.active
            )

            def shard(active, params, slot_meta, b: train_step.Batch, loss_cfg):
                def local(active):
                    p = train_step.PassConfig(cfg, mesh, step_cfg, loss_fns, num_slots)
                    return p.stream_loss(active, params, slot_meta, b, loss_cfg, summed=False)

                if backward:
                    # Varying over dp and cp, so that nothing sums the gradient over them
                    # (tp: the layers' custom VJPs keep the adapters' own tp type).
                    active = jax.tree.map(lambda x: mesh_lib.vary(x, BATCH_AXES), active)
                    loss, vjp, parts = jax.vjp(local, active, has_aux=True)
                    (grads,) = vjp(jnp.ones_like(loss))
                else:
                    grads, parts = {}, local(active)[1]
                flat = [
                    mesh_lib.vary(x, mesh_lib.AXES).astype(jnp.float32).reshape(-1)
                    for x in jax.tree.leaves(grads) + list(parts)
                ]
                return jnp.concatenate(flat)[None, None, None]

            in_specs = (
                lora_lib.slot_specs_active(cfg, active),
                model_lib.param_specs(cfg),
                SPECS.slot_G,
                train_step.batch_specs(),
                SPECS.replicated,
            )
            return jax.shard_map(shard, mesh=mesh, in_specs=in_specs, out_specs=P(*mesh_lib.AXES))(
                active, params, slot_meta, batch, loss_cfg
            )

        return partials

    def local_sum(self, partials) -> np.ndarray:
        """float32 [V]: the rows of this process's devices added in the mesh's device
        order."""
        shards = sorted(partials.addressable_shards, key=lambda s: self._position(s.device))
        total = np.array(shards[0].data, np.float32).reshape(-1)
        for s in shards[1:]:
            total += np.asarray(s.data).reshape(-1)
        return total

    def sums(self, local: np.ndarray) -> jax.Array:
        """[processes, local devices, V] over the view, every local device holding
        `local` (this process's sum)."""
        shape = self.view.devices.shape + local.shape
        return jax.make_array_from_callback(
            shape, self.sums_sharding, lambda idx: local[None, None]
        )

    def _total(self, sums):
        """[V]: the processes' sums added (an all-reduce of each local device with its
        partners in the other processes)."""
        return jax.shard_map(
            lambda s: jax.lax.psum(s, "proc"),
            mesh=self.view,
            in_specs=P("proc", "local"),
            out_specs=P(),
            check_vma=False,
        )(sums)[0, 0]

    def _finish_forward(self, sums, batch, *, num_slots):
        return losses_lib.shard_outputs(
            train_step.split_parts(self._total(sums), train_step.part_shapes(batch, num_slots))
        )

    def _finish(self, acc, lora, slot_meta, sums, batch, *, num_slots, modules=None):
        total = self._total(sums)
        active = lora_lib.take_active(
            train_step.used_modules(lora, modules), slot_meta.page_GK, batch.active
        )
        leaves, treedef = jax.tree.flatten(active)
        pieces = train_step.split_parts(
            total, [x.shape for x in leaves] + list(train_step.part_shapes(batch, num_slots))
        )
        grads = treedef.unflatten([p.astype(x.dtype) for p, x in zip(pieces, leaves)])
        acc, finite_A = train_step.accumulate(
            acc, slot_meta, lora_lib.untake_active(grads), batch.active
        )
        loss, out = losses_lib.shard_outputs(pieces[len(leaves) :])
        return acc, loss, out, finite_A

    def compile(
        self, remat: bool, args: tuple, *, loss_fns, num_slots, modules=None
    ) -> HostSummedProgram:
        """Both programs compiled for args: (acc, lora, params, slot_meta, batch, loss_cfg),
        forward_backward's arguments without custom_args."""
        acc, lora, params, slot_meta, batch, loss_cfg = args
        partials = (
            self.partials[remat]
            .lower(
                lora,
                params,
                slot_meta,
                batch,
                loss_cfg,
                loss_fns=loss_fns,
                num_slots=num_slots,
                modules=modules,
            )
            .compile()
        )
        sums = jax.ShapeDtypeStruct(
            self.view.devices.shape + partials.out_info.shape[-1:],
            jnp.float32,
            sharding=self.sums_sharding,
        )
        finish = self.finish.lower(
            acc, lora, slot_meta, sums, batch, num_slots=num_slots, modules=modules
        ).compile()
        return HostSummedProgram(self, partials, finish)


@dataclasses.dataclass(frozen=True)
class HostSummedProgram:
    """A compiled HostSummedStep, called as a compiled forward_backward is: (acc, lora,
    params, slot_meta, batch, loss_cfg, custom_args=()) -> (acc, loss, out, finite_A).
    `partials` is the model's program (memory_analysis, as_text), `finish` the sum's."""

    step: HostSummedStep
    partials: object
    finish: object

    def __call__(self, acc, lora, params, slot_meta, batch, loss_cfg, custom_args=()):
        local = self.step.local_sum(self.partials(lora, params, slot_meta, batch, loss_cfg))
        return self.finish(acc, lora, slot_meta, self.step.sums(local), batch)

    def memory_analysis(self):
        return self.partials.memory_analysis()
