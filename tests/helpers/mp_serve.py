"""jcp-serve as subprocesses (one process × 8 CPU devices, or a 2-process jax.distributed job
× 4 devices each, gloo) and the SDK session the multi-process server test and benchmark run
against either."""

from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np

MODEL = "jcp-tiny"
KEYS = {"tml-alice": "alice", "tml-bob": "bob"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """`processes` jcp-serve processes started alike (the jax.distributed flags), process 0
    serving HTTP on 127.0.0.1; logs in files of `state_dir`'s parent."""

    def __init__(
        self,
        processes: int,
        state_dir: str,
        *extra: str,
        follower_timeout: float = 8,
        cache: str | None = None,
        cpus: list[set[int]] | None = None,
    ):
        self.state_dir = state_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        logs = tempfile.mkdtemp(prefix="jcp-mp-logs-")
        keyfile = os.path.join(logs, "keys")
        with open(keyfile, "w") as f:
            f.writelines(f"{k} {v}\n" for k, v in KEYS.items())
        env = dict(os.environ)
        # jcp-serve gives each process 8 / processes devices
        env["XLA_FLAGS"] = os.environ.get("JCP_TEST_CHILD_XLA_FLAGS", "")
        env.setdefault("TINKER_TELEMETRY", "0")
        if cache:  # a restarted job reads what the first one compiled
            env.update(
                JAX_COMPILATION_CACHE_DIR=cache,
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
            )
        cmd = [
            sys.executable,
            "-m",
            "jcp.serve",
            "--port",
            str(self.port),
            "--state-dir",
            state_dir,
            "--api-keys",
            keyfile,
            "--mesh",
            "2,2,2",
            "--max-rank",
            "8",
            "--follower-timeout",
            str(follower_timeout),
            "--no-warmup",
            # The suite's other worker shares the cores: at the default (nice 10 on CPU)
            # this job's compute would get a tenth of them while that worker computes.
            "--compute-nice",
            "0",
            *extra,
        ]
        if processes > 1:
            cmd += [
                "--coordinator-address",
                f"127.0.0.1:{free_port()}",
                "--num-processes",
                str(processes),
            ]
        self.logs = [os.path.join(logs, f"p{i}.log") for i in range(processes)]
        self.procs = []
        for i, path in enumerate(self.logs):
            with open(path, "w") as out:
                ids = ["--process-id", str(i)] if processes > 1 else []
                pin = cpus and (lambda c=cpus[i]: os.sched_setaffinity(0, c))  # cores of i
                self.procs.append(
                    subprocess.Popen(
                        cmd + ids,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        preexec_fn=pin or None,
                    )
                )

    def wait_ready(self, timeout: float = 600) -> Job:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"jcp-serve exited {p.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/api/v1/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"jcp-serve did not start:\n{self.log()}")

    def log(self, i: int | None = None) -> str:
        paths = self.logs if i is None else [self.logs[i]]
        return "\n".join(f"--- {p}\n" + open(p).read()[-3000:] for p in paths)

    def stop(self) -> list[int | None]:
        """SIGTERM process 0 (it tells the followers to exit), then kill what is left."""
        if self.procs[0].poll() is None:
            self.procs[0].send_signal(signal.SIGTERM)
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=60))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                codes.append(None)
        return codes


def checkpoint_files(state_dir: str) -> dict[str, dict[str, np.ndarray]]:
    """Every PEFT safetensors file under a state folder (relative path -> its arrays)."""
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(state_dir, "**", "*.safetensors"), recursive=True)):
        rel = os.path.relpath(f, state_dir).split(os.sep)
        out["/".join(rel[-3:])] = load_file(f)  # the run's folder name is random
    return out


def datum(seed: int, n: int = 24):
    import tinker.types as types

    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 512, n + 1).tolist()
    w = rng.uniform(0.2, 1.0, n).astype(np.float32).tolist()
    return types.Datum(
        model_input=types.ModelInput.from_ints(toks[:-1]),
        loss_fn_inputs={"target_tokens": toks[1:], "weights": w},
    )


def logprobs(out) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


def weighted_mean(logprobs, weights):
    """A custom loss (torch, traced by the SDK): the weighted mean log-prob, negated."""
    mean = (logprobs * weights).sum() / weights.sum()
    return -mean, {"custom/lp:mean": mean.detach()}


def session(url: str, clients: list) -> dict:
    """Two tenants over one server: train, forward, save, load, a custom loss, sample
    (seeded) -> results by name (NumPy arrays, floats, token lists, tinker paths). Three
    training models (Alice's, Bob's, Bob's loaded from his checkpoint) are each used after
    the last one is made: on a server started with --max-adapters 2 one of them is
    offloaded to host memory and restored."""
    import tinker
    from tinker import types

    adam = types.AdamParams(learning_rate=1e-2)
    data = [datum(1), datum(2, 17)]
    res = {}
    alice = tinker.ServiceClient(base_url=url, api_key="tml-alice")
    bob = tinker.ServiceClient(base_url=url, api_key="tml-bob")
    clients += [alice, bob]
    ta = alice.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()
    tb = bob.create_lora_training_client(base_model=MODEL, rank=8, seed=4).result()
    # Both tenants' passes queued together (the scheduler may fuse them).
    fa = ta.forward_backward(data, "cross_entropy")
    fb = tb.forward_backward(data[:1], "cross_entropy")
    for name, f in (("a", fa), ("b", fb)):
        out = f.result()
        res[f"{name}_fb_loss"] = out.metrics["loss:sum"]
        res[f"{name}_fb_lp"] = logprobs(out)
    res["a_step"] = ta.optim_step(adam).result().metrics["grad_norm:mean"]
    res["b_step"] = tb.optim_step(adam).result().metrics["grad_norm:mean"]
    res["a_ckpt"] = ta.save_state("a1").result().path
    res["a_fwd"] = logprobs(ta.forward(data, "cross_entropy").result())
    # A second step, then load the checkpoint back: the first step's log-probs again.
    ta.forward_backward(data, "cross_entropy")
    ta.optim_step(adam).result()
    res["a_fwd2"] = logprobs(ta.forward(data, "cross_entropy").result())
    ta.load_state(res["a_ckpt"]).result()
    res["a_reloaded"] = logprobs(ta.forward(data, "cross_entropy").result())
    # A server-side custom loss (every process builds it from the graph process 0 got): a
    # weighted mean, not a token sum, and a step on it.
    handle = alice.create_custom_loss(weighted_mean, {"logprobs": 1, "weights": 1}).result()
    out = ta.forward_backward_custom(data, handle).result()
    res["a_custom_loss"] = out.metrics["loss:sum"]
    res["a_custom_metric"] = out.metrics["custom/lp:mean"]
    res["a_custom_lp"] = logprobs(out)
    res["a_custom_step"] = ta.optim_step(adam).result().metrics["grad_norm:mean"]
    res["a_custom_fwd"] = logprobs(ta.forward(data, "cross_entropy").result())
    # Bob: a named sampler save (PEFT folder, loaded by the sampler) and a fresh model
    # from his own checkpoint.
    prompt = types.ModelInput.from_ints([3, 1, 4, 1, 5])
    sp = types.SamplingParams(max_tokens=6, seed=7, temperature=1.0)
    named = tb.save_weights_for_sampler("b1").result().path
    sb = bob.create_sampling_client(model_path=named).result()
    out = sb.sample(prompt, 2, sp, include_prompt_logprobs=True).result()
    res["b_tokens"] = [list(s.tokens) for s in out.sequences]
    res["b_sample_lp"] = [np.asarray(s.logprobs) for s in out.sequences]
    res["b_prompt_lp"] = np.asarray(out.prompt_logprobs[1:], np.float32)
    b_ckpt = tb.save_state("b1").result().path
    tb2 = bob.create_training_client_from_state_with_optimizer(b_ckpt).result()
    res["b_loaded_fwd"] = logprobs(tb2.forward(data, "cross_entropy").result())
    res["b_fwd"] = logprobs(tb.forward(data, "cross_entropy").result())
    # Alice: an in-memory sampler snapshot, sampled.
    sa = ta.save_weights_and_get_sampling_client().result()
    out = sa.sample(prompt, 2, sp).result()
    res["a_tokens"] = [list(s.tokens) for s in out.sequences]
    res["a_sample_lp"] = [np.asarray(s.logprobs) for s in out.sequences]
    res["trained"] = ta
    return res


def close(clients: list) -> None:
    for sc in clients:
        if sc._session_holder is not None:
            sc._session_holder.close()
