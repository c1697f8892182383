"""One Trainer's jitted steps and their compiled programs: forward and forward_backward
(train_step) for its model, mesh and step settings, the compiled forward_backward program
of each batch shape with remat="auto" decided per program (jcp/remat.py), and the
host-summed variants of a multi-process XLA:CPU job (jcp/host_sum.py, where
`sums_on_host`).

It compiles and runs programs only; it never validates a call (jcp.calls, the Trainer)
and never holds adapter state (the caller passes the tables in and keeps what comes
back).
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from jcp import host_sum, train_step
from jcp import remat as remat_lib
from jcp.config import QwenConfig
from jcp.mesh import TP, axis_size
from jcp.program_store import StoredPrograms


class PassTurns:
    """A forward_backward micro-batch in turns (StepPrograms.first_turn), its first program
    run: the forward pass of part 0 of its n parts (its layer spans, then the head and the
    loss: train_step.make_forward_backward_turns). `next(slot_meta)` runs the next program
    but the last (the forward passes of parts 1 … n - 1, then the backward passes of parts
    n - 1 … 1), `last(acc, slot_meta)` the last (part 0's backward pass and the
    accumulation) -> (acc + grad, loss, out, finite_A), as forward_backward returns them,
    acc donated. slot_meta: the slot header as it is then (a slot written between turns
    donated the old one). `held`: what the programs so far left on the device (to wait
    on); `left`: how many programs are still to run."""

    def __init__(self, programs: tuple, args: tuple, out, pull, pieces: list):
        (self._forward, self._backward), self._args = programs, args
        self.n = len(pieces) + 1
        self._pieces = pieces  # parts 1 … n - 1: their factors
        self._out = out  # the last program's output: hidden states, losses or a cotangent
        self._pulls = [pull]  # the pullbacks of the parts whose backward is still to run
        self._grads: list = []  # the gradients of parts 1 … n - 1, once their backward ran
        self._outputs = None  # (loss, out), from the last part's backward pass
        self._done = 1  # programs run

    @property
    def left(self) -> int:
        return 2 * self.n - self._done

    @property
    def held(self) -> tuple:
        return self._out, self._grads

    def next(self, slot_meta) -> None:
        if self.left < 2:
            raise RuntimeError(f"PassTurns.next with {self.left} programs to run")
        params, batch, loss_cfg, static = self._args
        k = self._done
        if k < self.n:  # part k's forward pass
            self._out, pull = self._forward(
                self._pieces[k - 1],
                self._out,
                params,
                slot_meta,
                batch,
                loss_cfg,
                static=static,
                i=k,
            )
            self._pulls.append(pull)
        else:  # part i's backward pass, from the last part down
            i = 2 * self.n - 1 - k
            grads, self._out, outputs = self._backward(
                None, self._pulls.pop(), self._out, (), slot_meta, batch, static=static, i=i
            )
            self._grads.insert(0, grads)
            if outputs is not None:
                self._outputs = outputs
        self._done = k + 1

    def last(self, acc, slot_meta) -> tuple:
        if self.left != 1:
            raise RuntimeError(f"PassTurns.last with {self.left} programs to run")
        _, batch, _, static = self._args
        acc, finite_A, outputs = self._backward(
            acc,
            self._pulls.pop(),
            self._out,
            tuple(self._grads),
            slot_meta,
            batch,
            static=static,
            i=0,
        )
        self._done += 1
        loss, out = outputs if outputs is not None else self._outputs
        return acc, loss, out, finite_A


class StepPrograms:
    """The steps of one (model, mesh, StepConfig) and a cache of compiled forward_backward
    programs keyed by everything a program is specialised on.

    `fb_steps` {remat: program_store.StoredPrograms of the jitted forward_backward} holds
    both variants under remat="auto" (each program compiled once, or loaded from the program
    store by a restart); `compiled` the programs so far; `decisions` how each one's remat
    was chosen (the Trainer's remat_decisions); `sums_on_host` whether forward and
    forward_backward (dense
    models, Tinker losses) take the host-summed path (settable before the first call).
    """

    def __init__(
        self,
        cfg: QwenConfig,
        mesh,
        step_cfg: train_step.StepConfig,
        max_rank: int,
        budget_bytes: int | None = None,
        turn_spans: int = 2,
    ):
        self.cfg, self.mesh, self.step_cfg, self.max_rank = cfg, mesh, step_cfg, max_rank
        self.forward_step = train_step.make_forward(cfg, mesh, step_cfg)
        self.fb_steps = {
            r: StoredPrograms(
                train_step.make_forward_backward(cfg, mesh, c), "forward_backward", (cfg, c), mesh
            )
            for r in (True, False)
            if step_cfg.remat in (r, "auto")
            for c in [dataclasses.replace(step_cfg, remat=r)]
        }
        self._budget = budget_bytes
        self.sums_on_host = host_sum.sums_on_host(mesh)
        self.compiled: dict = {}
        self.decisions: dict = {}
        self.turns_fit: dict = {}  # key -> whether first_turn runs that program in turns
        # The layer spans of a forward_backward in turns (first_turn; TrainerOptions).
        self.turn_spans = turn_spans

    @functools.cached_property
    def host_step(self) -> host_sum.HostSummedStep:
        return host_sum.HostSummedStep(self.cfg, self.mesh, self.step_cfg, tuple(self.fb_steps))

    def budget_bytes(self) -> int:
        """The per-device bytes a forward_backward program may take without recomputation
        (None at construction: remat.default_budget of the mesh, taken on first use)."""
        if self._budget is None:
            self._budget = remat_lib.default_budget(self.mesh)
        return self._budget

    def forward(self, lora, step_args: tuple, static: train_step.BatchStatics):
        """train_step's forward -> (loss, out); host-summed where sums_on_host allows.
        step_args: (params, slot_meta, batch, loss_cfg, custom_args); static: the batch's
        train_step.BatchStatics."""
        if self._on_host(static):
            return self.host_step.forward(
                lora,
                *step_args[:-1],
                loss_fns=static.loss_fns,
                num_slots=static.num_slots,
                modules=static.modules,
            )
        return self.forward_step(lora, *step_args, static=static)

    def forward_first(self, lora, step_args: tuple, static: train_step.BatchStatics):
        """The first of forward's two programs (train_step.make_forward_halves) -> a handle
        for `forward_second`; or None where the forward runs whole (host-summed, or not
        forward_halves_apply). The handle holds the first half's hidden states (the size
        of one layer's input) and the batch, not the adapter tables or the slot header: a
        slot written in between (a create, an optim_step of another adapter) donates
        those, and `forward_second` takes them as they are then."""
        if self._on_host(static) or not train_step.forward_halves_apply(self.cfg, static.custom):
            return None
        params, slot_meta, batch, loss_cfg, _ = step_args
        first, second = train_step.make_forward_halves(self.cfg, self.mesh, self.step_cfg)
        h = first(lora, params, slot_meta, batch, static=static)
        return second, h, (params, batch, loss_cfg), static

    def forward_second(self, lora, slot_meta, half) -> tuple:
        """The second program of `forward_first`'s handle -> (loss, out), as `forward`;
        lora and slot_meta: the adapter tables and the slot header as they are now."""
        second, h, (params, batch, loss_cfg), static = half
        return second(lora, params, slot_meta, batch, loss_cfg, h, static=static)

    def forward_backward(self, acc, lora, step_args: tuple, static: train_step.BatchStatics):
        """train_step's forward_backward through the program compiled for this batch's
        shapes (with remat="auto", the one `decide` picks); step_args and static as
        `forward`'s."""
        args = (acc, lora, *step_args)
        return self.compiled[self._program_key(args, static)](*args)

    def _program_key(self, args: tuple, static: train_step.BatchStatics):
        """The key of forward_backward's program for args (acc, lora, *step_args), compiled
        (and its remat decided) here if it is new."""
        _, _, batch, loss_cfg, custom_args = args[2:]
        # Everything the compiled program is specialised on: the per-call arguments' tree and
        # every leaf's shape and dtype (2-D targets, custom inputs), and the static arguments.
        per_call = (batch, loss_cfg, custom_args)
        key = (
            jax.tree.structure(per_call),
            tuple((x.shape, x.dtype) for x in jax.tree.leaves(per_call)),
            static.loss_fns,
            static.num_slots,
            static.custom,
            static.modules,
        )
        if key not in self.compiled:
            self.compiled[key], self.decisions[key] = self._compile(key, args, static)
        return key

    def first_turn(self, acc, lora, step_args: tuple, static: train_step.BatchStatics):
        """The first of forward_backward's programs in turns (train_step.
        make_forward_backward_turns, over `turn_spans` layer spans) -> its PassTurns, the
        others still to run; or None where the pass runs whole: not a folded pass
        (turns_apply), host-summed, or one whose program would not fit the memory budget
        twice beside its arguments (the residuals the forward turns leave wait on the
        device while another program runs). The remat decision is forward_backward's for
        the same batch."""
        params, slot_meta, batch, loss_cfg, _ = step_args
        if self._on_host(static) or not train_step.turns_apply(
            self.cfg, static.custom, slot_meta, batch.active
        ):
            return None
        args = (acc, lora, *step_args)
        key = self._program_key(args, static)
        if key not in self.turns_fit:
            need = self.decisions[key]["bytes"]
            if need is None:  # remat set by hand: XLA's measure of the program
                need = remat_lib.program_bytes(self.compiled[key])
            # What the program holds beyond its arguments (temporaries and outputs), twice:
            # the forward turns' residuals, and another program of that size beside them.
            placed = remat_lib.placed_bytes(args)
            self.turns_fit[key] = placed + 2 * (need - placed) <= self.budget_bytes()
        if not self.turns_fit[key]:
            return None
        programs = self.turns(self.decisions[key]["remat"])
        out, pull, pieces = programs[0](lora, params, slot_meta, batch, loss_cfg, static=static)
        return PassTurns(programs[1:], (params, batch, loss_cfg, static), out, pull, pieces)

    def turns(self, remat: bool) -> tuple:
        """train_step.make_forward_backward_turns of this model and mesh with `remat`."""
        return train_step.make_forward_backward_turns(
            self.cfg, self.mesh, dataclasses.replace(self.step_cfg, remat=remat), self.turn_spans
        )

    def _on_host(self, static: train_step.BatchStatics) -> bool:
        return self.sums_on_host and train_step.folds_outputs(self.cfg, static.custom)

    def _compile(self, key, args: tuple, static: train_step.BatchStatics):
        """(the program for args, its remat decision)."""
        on_host = self._on_host(static)

        def compile_(remat):
            if on_host:
                return self.host_step.compile(
                    remat,
                    args[:-1],
                    loss_fns=static.loss_fns,
                    num_slots=static.num_slots,
                    modules=static.modules,
                )
            return self.fb_steps[remat].program(*args, static=static)

        remat = self.step_cfg.remat
        if remat != "auto":
            decision = {"remat": remat, "bytes": None, "budget": None, "estimate": None}
            return compile_(remat), {**decision, "how": None}
        program, decision = self.decide(key, args, args[4].tokens.shape[-1], compile_)
        return program or compile_(decision["remat"]), decision

    def decide(self, key, args, s_len: int, compile_):
        """remat="auto": (the program without recomputation if it was compiled to decide,
        else None; the decision) — remat.decide for this model, mesh and budget."""
        store = remat_lib.RematStore.open(
            key, self.cfg, self.mesh, self.step_cfg, self.budget_bytes()
        )
        return remat_lib.decide(
            self.cfg,
            axis_size(self.mesh, TP),
            self.max_rank,
            self.budget_bytes(),
            args,
            s_len,
            compile_,
            store,
        )
