"""`jcp-serve`: a Tinker SDK 0.38 compatible training and sampling server over one Trainer.

    jcp-serve [--hf-model DIR] [--model-name NAME] [--mesh dp,cp,tp] [--host 127.0.0.1]
              [--port 8000] [--max-adapters N] [--adapter-memory B] [--max-rank R]
              [--max-tokens-per-device N]
              [--api-keys FILE] [--state-dir DIR] [--max-body-bytes N] [--max-datums N]
              [--max-num-samples N] [--max-futures N] [--max-offload-gb G] [--max-storage-gb G]
              [--session-timeout S] [--sample-slots N] [--sample-max-len N]
              [--sample-chunk N] [--prefill-tokens N] [--compute-nice N] [--no-warmup]
              [--compilation-cache DIR | --no-compilation-cache]
              [--coordinator-address HOST:PORT --num-processes N --process-id I]
              [--follower-timeout S]

With no --hf-model it serves the tiny random model; with no accelerator it runs on fake
CPU devices, as many as --mesh holds (8 without --mesh; like jcp-train). Owns the command
line; the pieces of jcp/server/ (state store, scheduler, worker, app) are assembled by
jcp.server.service.Server, which also runs one in a background thread for tests and
benchmarks.

Started as a multi-process JAX job (the jax.distributed flags, or JAX_COORDINATOR_ADDRESS /
JAX_NUM_PROCESSES / JAX_PROCESS_ID, on every process alike), process 0 serves HTTP and
leads; every other process follows it call by call (jcp/server/replica.py).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time

from jcp.cli import (
    COUNT,
    GIGABYTES,
    PORT,
    POSITIVE,
    SEED,
    CliError,
    Parser,
    add_cache_flags,
    address,
    build_trainer,
    env_int,
    existing_file,
    existing_folder,
    folder,
    integer,
    memory_bytes,
    number,
    parse_mesh,
    setup_compilation_cache,
    setup_devices,
)
from jcp.server.priority import COMPUTE_NICE, favour_loop

# What jcp-serve's warm-up (on unless --no-warmup) compiles before it serves. Training
# (Trainer.warmup): forward_backward with cross_entropy for adapters of every module (the
# SDK's default LoRA) at every stream length up to TRAINING_WARMUP_ROWS rows per device —
# one program per length, whatever the grouping of tenants in a fused pass; at
# --max-tokens-per-device also the programs of its turns and a forward's two halves (a
# contended split pass runs them) — and
# optim_step, and the slot writes (create, copy, offload, restore) of every page count.
# Other losses, forward, longer passes and passes over adapters of fewer modules compile
# when first met. Sampling (Engine.warmup's buckets): steps with 1 or 2 distinct adapters
# (one bucket), greedy, drawn and top-k / top-p rows, any stop list the edge admits (one
# width, params.STOP_WIDTH), with and without prompt log-probs, any topk_sample_logprobs
# and every decode-chunk length (run-time values inside one program each),
# compute_logprobs and topk_prompt_logprobs ≤ 4: 71 programs on the default engine of
# the tiny model (651 before draw kinds, top-k, prompt log-probs and decode lengths were
# run-time values and one adapter shared the two-adapter bucket). Other requests (wider
# topk_prompt_logprobs, target_prompt_logprobs, prompt_alt_tokens_k, more adapters in one
# step) compile their programs when first met.
TRAINING_WARMUP_ROWS = 4096
SAMPLING_WARMUP = dict(active=(1, 2), compute_logprobs=True, prompt_stats=((4, 0, 0),))


def sampling_warmup(backend: str) -> dict:
    """The sampling warm-up set of jcp-serve on this backend ("cpu", "gpu", "tpu"): the
    whole SAMPLING_WARMUP on every one. (XLA:CPU keeps 300-450 memory maps per compiled
    program of the tiny model, and a process may hold vm.max_map_count = 65,530 of them:
    the 651-program set of before aborted jcp-serve mid warm-up, and CPU warmed up a
    subset; the 71 programs now fit.)"""
    del backend
    return SAMPLING_WARMUP


def parse_args(argv):
    p = Parser(prog="jcp-serve", description=__doc__.split("\n\n")[0])
    _model_flags(p.add_argument_group("model"))
    _http_flags(p.add_argument_group("HTTP and tenants"))
    _memory_flags(p.add_argument_group("memory and sessions"))
    _engine_flags(p.add_argument_group("sampling engine and warm-up"))
    _process_flags(p.add_argument_group("multi-process job"))
    add_cache_flags(p, "--state-dir/xla-cache, or ~/.cache/jcp/xla without --state-dir")
    args = p.parse_args(argv)
    if args.mesh:
        args.mesh = parse_mesh(args.mesh)
    if None not in (args.process_id, args.num_processes) and args.process_id >= args.num_processes:
        raise CliError(
            f"--process-id {args.process_id} must be < --num-processes {args.num_processes}"
        )
    return args


def _model_flags(g) -> None:
    g.add_argument(
        "--hf-model", type=existing_folder, help="Hugging Face folder (config.json + safetensors)"
    )
    g.add_argument(
        "--model-name",
        help="the base_model name clients use (default: the folder's name, or jcp-tiny)",
    )
    g.add_argument("--mesh", help="dp,cp,tp (default 2,2,2 on 8 devices, else 1,n,1)")
    g.add_argument(
        "--max-adapters",
        type=COUNT,
        default=1024,
        help="adapters on the device at once (training models and sampler weights; "
        "more are offloaded to host memory): a slot costs a few bytes, its rank's pages "
        "of --adapter-memory the rest",
    )
    g.add_argument(
        "--adapter-memory",
        type=memory_bytes,
        default="auto",
        help="device memory of the adapter tables, per device (bytes, e.g. 4GiB; "
        "auto: a quarter of the device's free memory once the model is loaded); an "
        "adapter of rank r takes ceil(r/8) pages of rank 8",
    )
    g.add_argument("--max-rank", type=COUNT, default=32)
    g.add_argument("--max-tokens-per-device", type=integer(2), default=None)
    g.add_argument(
        "--turn-spans",
        type=COUNT,
        default=2,
        help="layer spans of a training pass run in turns while other work waits: each "
        "span's forward pass, then each one's backward pass, one turn each (more: shorter "
        "turns for the others, a costlier pass)",
    )
    g.add_argument("--seed", type=SEED, default=0)


def _http_flags(g) -> None:
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=PORT, default=8000, help="0: any free port")
    g.add_argument(
        "--api-keys", type=existing_file, help="file of `key [name]` lines; enables key checks"
    )
    g.add_argument(
        "--state-dir", type=folder, help="checkpoints and sampler weights (default: a temp dir)"
    )
    from jcp.server.edge import Limits

    d = Limits()
    g.add_argument(
        "--max-body-bytes",
        type=COUNT,
        default=d.body_bytes,
        help="largest HTTP body, and zstd body once decompressed (413 beyond)",
    )
    g.add_argument(
        "--max-datums",
        type=COUNT,
        default=d.datums,
        help="datums per forward / forward_backward request",
    )
    g.add_argument(
        "--max-num-samples",
        type=COUNT,
        default=d.num_samples,
        help="num_samples per sample request",
    )
    g.add_argument(
        "--max-futures",
        type=COUNT,
        default=d.futures,
        help="request results kept per tenant (pending ones are never evicted)",
    )


def _memory_flags(g) -> None:
    g.add_argument(
        "--max-offload-gb",
        type=GIGABYTES,
        default=16.0,
        help="host memory for training models moved out of their adapter slot "
        "when slots are short (bounds how many models may exist)",
    )
    g.add_argument(
        "--max-storage-gb",
        type=GIGABYTES,
        default=100.0,
        help="checkpoint files on disk per tenant under --state-dir (a save or "
        "copy beyond it is refused; deleting frees it)",
    )
    g.add_argument(
        "--session-timeout",
        type=number(0.0),
        default=180.0,
        help="seconds without a heartbeat after which a session ends and its models are unloaded",
    )


def _engine_flags(g) -> None:
    g.add_argument(
        "--sample-slots",
        type=COUNT,
        default=None,
        help="sampling engine: sequences decoded together (a multiple of dp·cp; "
        "default: as many as fit 1 GiB of KV cache per device, at most 512)",
    )
    g.add_argument(
        "--sample-max-len",
        type=COUNT,
        default=None,
        help="sampling engine: KV rows per sequence, prompt + max_tokens − 1 "
        "(default min(256, max_context_length)); longer requests run beside "
        "the engine",
    )
    g.add_argument(
        "--sample-chunk",
        type=COUNT,
        default=8,
        help="sampling engine: decode steps per engine step (requests join and "
        "leave between them; a training pass waits at most one engine step)",
    )
    g.add_argument(
        "--prefill-tokens",
        type=COUNT,
        default=None,
        help="sampling engine: most prompt tokens prefilled per engine step "
        "(default max_tokens_per_device · dp)",
    )
    g.add_argument(
        "--compute-nice",
        type=integer(0, 19),
        default=None,
        help="nice value of every thread but the HTTP event loop's (the compute), so "
        "that requests are read and answered while the compute holds the cores "
        "(jcp/server/priority.py; default 10 on a CPU backend, 0: unchanged on an "
        "accelerator)",
    )
    g.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compile the training and sampling programs before serving "
        "(TRAINING_WARMUP_ROWS, SAMPLING_WARMUP; cheap on a restart with the "
        "compilation cache; default on)",
    )


def _process_flags(g) -> None:
    g.add_argument(
        "--coordinator-address",
        type=address,
        default=None,
        help="jax.distributed coordinator host:port (or JAX_COORDINATOR_ADDRESS); "
        "every process gets the same flags, process 0 serves HTTP",
    )
    g.add_argument("--num-processes", type=COUNT, default=None, help="(or JAX_NUM_PROCESSES)")
    g.add_argument("--process-id", type=integer(0), default=None, help="(or JAX_PROCESS_ID)")
    g.add_argument(
        "--follower-timeout",
        type=POSITIVE,
        default=60.0,
        help="seconds after which a follower process that stopped answering "
        "fails the job (/healthz 503, requests refused)",
    )


def make_state_dir(path: str) -> None:
    """Make --state-dir (the flag's type checked it is no file) and check it is writable;
    CliError otherwise, before any device work."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise CliError(f"--state-dir {path}: {e.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CliError(f"--state-dir {path}: not writable")


def check_listen(host: str, port: int) -> None:
    """CliError unless this process can listen on host:port now (a name that does not
    resolve, an address not on this machine, a port in use), before minutes of model
    loading end in uvicorn's bind error."""
    try:
        family, kind, proto, _, where = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            s.bind(where)
    except OSError as e:
        raise CliError(
            f"--host {host} --port {port}: cannot listen there ({e.strerror or e})"
        ) from None


def _tokenizer_dir(path: str | None) -> str | None:
    if path and any(
        os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        return os.path.abspath(path)
    return None


def __getattr__(name: str):
    """`jcp.serve.Server` / `ServerConfig` / `peft_layout`: their home is jcp.server.service
    (imported on first use, so that a mistyped flag fails before the server's packages
    load)."""
    if name in ("Server", "ServerConfig", "peft_layout"):
        from jcp.server import service

        return getattr(service, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def require_server_packages() -> None:
    """CliError naming the [serve] extra when the server's packages are not installed
    (`pip install jcp` installs the library only)."""
    import importlib.util

    missing = [
        m
        for m in ("fastapi", "uvicorn", "zstandard", "google.protobuf", "pyrage")
        if importlib.util.find_spec(m.split(".")[0]) is None
    ]
    if missing:
        raise CliError(f"jcp-serve needs {', '.join(missing)}: pip install 'jcp[serve]'")


def main(argv=None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        require_server_packages()
        from jcp.server.service import Server
        from jcp.server.state import read_api_keys

        keys = None
        if args.api_keys:  # before any device work: a bad key file costs nothing
            try:
                keys = read_api_keys(args.api_keys)
            except (OSError, ValueError, UnicodeDecodeError) as e:
                raise CliError(f"--api-keys: {e}") from None
        if args.state_dir:
            make_state_dir(args.state_dir)
        pid = args.process_id if args.process_id is not None else env_int("JAX_PROCESS_ID")
        if not pid:  # process 0 serves HTTP
            check_listen(args.host, args.port)
        setup_compilation_cache(args, args.state_dir and os.path.join(args.state_dir, "xla-cache"))
        setup_devices(args, recoverable=True)
        from jcp.server.edge import Limits

        limits = Limits(
            body_bytes=args.max_body_bytes,
            datums=args.max_datums,
            num_samples=args.max_num_samples,
            futures=args.max_futures,
        )
        tr = build_trainer(
            args,
            max_adapters=args.max_adapters,
            max_rank=args.max_rank,
            adapter_memory=args.adapter_memory,
            turn_spans=args.turn_spans,
        )
    except CliError as e:
        print(f"jcp-serve: error: {e}", file=sys.stderr)
        return 2
    import jax

    leader = None
    if jax.process_count() > 1:
        from jcp.server.replica import Leader, follow

        if jax.process_index() != 0:
            print(
                f"jcp-serve: process {jax.process_index()} of {jax.process_count()} "
                "follows process 0",
                flush=True,
            )
            return follow(tr)
        leader = Leader(range(1, jax.process_count()), args.follower_timeout)
    name = args.model_name or (
        os.path.basename(os.path.normpath(args.hf_model)) if args.hf_model else "jcp-tiny"
    )
    state_dir = args.state_dir or tempfile.mkdtemp(prefix="jcp-serve-")
    try:
        srv = Server(tr, name, state_dir, keys, _server_config(args, limits), leader)
    except CliError as e:
        if leader is not None:  # the followers wait for process 0's first call: release them
            leader.stop()
        print(f"jcp-serve: error: {e}", file=sys.stderr)
        return 2
    _announce(srv, args, tr, keys, name, state_dir)
    if args.warmup:
        _warm_up(srv, tr)
    nice = args.compute_nice
    if nice is None:  # the compute holds the cores only on a CPU backend
        nice = COMPUTE_NICE if jax.default_backend() == "cpu" else 0
    return _serve(srv, nice)


def _server_config(args, limits):
    """The ServerConfig the flags name."""
    from jcp.server.service import ServerConfig
    from jcp.server.state import TenantLimits

    return ServerConfig(
        host=args.host,
        port=args.port,
        tokenizer_id=_tokenizer_dir(args.hf_model),
        limits=limits,
        max_offload_bytes=int(args.max_offload_gb * (1 << 30)),
        session_timeout_s=args.session_timeout,
        sample_slots=args.sample_slots,
        sample_max_len=args.sample_max_len,
        sample_chunk=args.sample_chunk,
        prefill_tokens=args.prefill_tokens,
        tenant_limits=TenantLimits(storage_bytes=int(args.max_storage_gb * (1 << 30))),
    )


def _announce(srv, args, tr, keys, name: str, state_dir: str) -> None:
    """What jcp-serve serves, where, and to whom (stdout)."""
    import jax

    print(
        f"jcp-serve: {srv.url}  model {name!r}  mesh dp={tr.dp} cp={tr.cp} tp={tr.tp}  "
        f"max_context_length {tr.token_cap}  state {state_dir}  processes "
        f"{jax.process_count()}",
        flush=True,
    )
    print(
        "jcp-serve: "
        + (
            f"{len(keys)} API keys from {args.api_keys}"
            if keys is not None
            else "no --api-keys: accepting any key (local use)"
        ),
        flush=True,
    )
    eng = srv.worker.sampling
    print(
        f"jcp-serve: sampling engine {eng.slots} slots × {eng.max_len} rows, chunk "
        f"{eng.chunk}, {eng.prefill_tokens} prefill tokens per step",
        flush=True,
    )


def _warm_up(srv, tr) -> None:
    """Compile the training and sampling programs before serving (--warmup)."""
    import jax

    from jcp import program_store

    eng = srv.worker.sampling
    t0 = time.monotonic()
    n_train = srv.worker.tr.warmup(rows=tr.warmup_rows(TRAINING_WARMUP_ROWS))
    t1 = time.monotonic()
    n = eng.warmup(**sampling_warmup(jax.default_backend()))
    print(
        f"jcp-serve: warm-up compiled {n_train} training programs in {t1 - t0:.1f} s "
        f"and {n} sampling programs in {time.monotonic() - t1:.1f} s "
        f"({program_store.loaded()} loaded from the program store)",
        flush=True,
    )


def _serve(srv, compute_nice: int) -> int:
    """Serve in this thread until stopped, every other thread (the compute) at
    `compute_nice` and the GIL handed over sooner (priority.favour_loop); a failed
    multi-process job exits 1 at once."""
    srv.worker.start()
    favour_loop(compute_nice)
    print(
        f"jcp-serve: compute threads at nice {compute_nice}, the GIL's switch interval "
        f"{sys.getswitchinterval() * 1e3:g} ms",
        flush=True,
    )
    try:
        srv.run()
    finally:
        srv.worker.stop()
        if srv.worker.failure() is not None:
            # The worker may be blocked in a collective with the lost process: exiting
            # normally would wait for it (and for jax.distributed's shutdown) forever.
            print(f"jcp-serve: {srv.worker.failure()}", file=sys.stderr, flush=True)
            os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
