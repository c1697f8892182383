"""The assembled jcp-serve over one Trainer: state store, scheduler, worker, futures, app.

Owns `Server` (the pieces of jcp/server/ wired together, uvicorn in a background thread for
tests and benchmarks, or run in the foreground by jcp/serve.py), its settings
(`ServerConfig`) and `peft_layout` (what an uploaded adapter of the served model may hold).
The worker (and with it jax) is imported only when a Server is built.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

from jcp.cli import CliError
from jcp.server.edge import Limits
from jcp.server.state import TenantLimits


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """jcp-serve's settings beyond the trainer, the model's name and the state folder (the
    flags of the same names; jcp/serve.py)."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    tokenizer_id: str | None = None  # the Hugging Face folder clients load the tokenizer from
    limits: Limits = dataclasses.field(default_factory=Limits)  # the edge's bounds
    max_offload_bytes: int = 16 << 30
    session_timeout_s: float = 180.0
    sample_slots: int | None = None
    sample_max_len: int | None = None
    sample_chunk: int = 8
    prefill_tokens: int | None = None
    tenant_limits: TenantLimits = dataclasses.field(default_factory=TenantLimits)


def peft_layout(cfg):
    """The PEFT tensors an uploaded adapter of this model may hold (checkpoint_api's
    PeftLayout): every lora_A / lora_B jcp's export names, by module and layer, and the
    modules each Tinker LoraConfig flag selects, as create_model chooses them."""
    from jcp import lora, peft
    from jcp.server.checkpoint_api import PeftLayout

    keys = {}
    for m in lora.table_modules(cfg):
        if m in lora.EXPERT:
            continue
        i, o = lora.module_dims(cfg, m)
        layers = [None] if m == lora.HEAD else lora.module_layer_ids(cfg, m)
        for li in layers:
            keys[peft.peft_key(m, li, "a")] = (m, "a", i)
            keys[peft.peft_key(m, li, "b")] = (m, "b", o)
    have = set(lora.table_modules(cfg))
    attn = lora.ATTN + (lora.LINEAR if cfg.is_hybrid else ())
    return PeftLayout(
        keys=keys,
        groups={
            "train_attn": tuple(m for m in attn if m in have),
            "train_mlp": None if cfg.is_moe else lora.MLP,
            "train_unembed": (lora.HEAD,),
        },
        fingerprint=cfg.fingerprint(),
    )


class Server:
    """The assembled server over `trainer`; start() serves in a background thread.

    Settings come as a ServerConfig (`config`) or as its fields by keyword
    (`Server(tr, name, folder, sample_slots=16)`), the latter replacing the former's."""

    def __init__(
        self,
        trainer,
        model_name: str,
        state_dir: str,
        api_keys=None,
        config: ServerConfig | None = None,
        leader=None,
        **options,
    ):
        import uvicorn

        from jcp.server.app import FutureTable, ServedModel, create_app
        from jcp.server.scheduler import Scheduler
        from jcp.server.state import StateStore
        from jcp.server.worker import Worker, WorkerConfig

        c = dataclasses.replace(config or ServerConfig(), **options)
        self.config = c
        self.store = StateStore(state_dir, api_keys, c.tenant_limits)
        self.scheduler = Scheduler()
        self.limits = c.limits
        self.futures = FutureTable(self.limits.futures)
        worker_config = WorkerConfig(
            model_name=model_name,
            max_offload_bytes=c.max_offload_bytes,
            session_timeout_s=c.session_timeout_s,
            sample_slots=c.sample_slots,
            sample_rows=c.sample_max_len,
            chunk=c.sample_chunk,
            prefill_tokens=c.prefill_tokens,
        )
        try:
            self.worker = Worker(
                trainer, self.store, self.scheduler, self.futures.complete, worker_config, leader
            )
        except ValueError as e:  # an engine size that does not fit the mesh
            raise CliError(f"sampling engine: {e}") from None
        if leader is not None:  # a follower lost: pending requests fail, new ones are refused
            leader.on_failure = self._job_failed
        served = ServedModel(
            model_name,
            self.worker.token_cap,
            self.worker.max_rank,
            c.tokenizer_id,
            peft_layout(trainer.cfg),
        )
        self.app = create_app(
            self.store,
            self.scheduler,
            self.futures,
            served,
            self.limits,
            alive=self.worker.alive,
            failure=self.worker.failure,
        )
        host, port = c.host, c.port
        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.host, self.port = host, port
        self.url = f"http://{host}:{port}"
        # httptools parses HTTP/1.1 in C (h11, uvicorn's pure-Python fallback, costs the
        # engine CPU on a CPU host); the event loop is uvloop (orbax-checkpoint needs it).
        self._uv = uvicorn.Server(
            uvicorn.Config(
                self.app,
                host=host,
                port=port,
                http="httptools",
                loop="uvloop",
                log_level="warning",
                access_log=False,
            )
        )
        self._thread: threading.Thread | None = None

    @property
    def engine(self):
        """Deprecated name of `worker` (the server's worker is not the sampling Engine)."""
        import warnings

        warnings.warn("Server.engine is now Server.worker", DeprecationWarning, stacklevel=2)
        return self.worker

    def _job_failed(self, message: str) -> None:
        self.scheduler.close()
        self.futures.fail_pending(message)

    def start(self) -> Server:
        self.worker.start()
        self._thread = threading.Thread(target=self._uv.run, name="jcp-serve-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._uv.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"jcp-serve did not start on {self.url}")
            time.sleep(0.02)
        return self

    def run(self) -> None:
        """Serve in this thread until stopped (the worker already started)."""
        self._uv.run()

    def stop(self) -> None:
        self._uv.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.worker.stop()
