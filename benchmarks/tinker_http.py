"""Raw Tinker HTTP for the serving benchmarks: jcp-serve in a child process, one API key's
calls over an httpx.AsyncClient (or `AioClient`, the same calls over aiohttp), and
protobuf forward_backward bodies (lighter than one SDK client per tenant when a benchmark
drives hundreds of tenants)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
from common import on_cores

PROTO = "application/x-protobuf"


def start_server(
    folder: str, keys: dict, flags: list[str], wait_s: float = 600, cores: set[int] | None = None
) -> tuple[subprocess.Popen, str]:
    """jcp-serve (tiny model, mesh 1,1,1, any free port, `keys`: API key -> tenant) in a
    child process with `flags`, on `cores` only when given (common.on_cores) -> (process,
    base URL) once /healthz answers (at most wait_s seconds)."""
    path = os.path.join(folder, "keys")
    with open(path, "w") as f:
        f.write("".join(f"{k} {v}\n" for k, v in keys.items()))
    env = dict(os.environ, TINKER_TELEMETRY="0")
    if "JCP_TEST_CHILD_XLA_FLAGS" in env:  # under the tests: their compile settings
        env["XLA_FLAGS"] = env["JCP_TEST_CHILD_XLA_FLAGS"]
    cmd = [sys.executable, "-m", "jcp.serve", "--mesh", "1,1,1", "--port", "0"]
    cmd += ["--api-keys", path, "--state-dir", os.path.join(folder, "state"), *flags]
    log = open(os.path.join(folder, "server.log"), "w+")
    with on_cores(cores):
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        log.seek(0)
        m = re.search(r"jcp-serve: (http://\S+)", log.read())
        if m and proc.poll() is None:
            import httpx

            try:
                if httpx.get(m.group(1) + "/api/v1/healthz", timeout=5).status_code == 200:
                    return proc, m.group(1)
            except httpx.HTTPError:
                pass
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"jcp-serve exited {proc.returncode}:\n{log.read()[-3000:]}")
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"jcp-serve did not start in {wait_s:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Answer:
    """What Tenant reads of an HTTP answer (httpx.Response's names)."""

    def __init__(self, status_code: int, headers, content: bytes):
        self.status_code, self.headers, self.content = status_code, headers, content

    def json(self):
        return json.loads(self.content)


class AioClient:
    """httpx.AsyncClient's `post` for Tenant over aiohttp: a driver of a thousand tenants
    shares the server's cores on one host, and aiohttp spends a fraction of httpx's CPU per
    request (many_tenants.py prints the driver's CPU seconds). Close with `aclose`."""

    def __init__(self, base_url: str, connections: int, timeout: float = 600):
        import aiohttp

        self.session = aiohttp.ClientSession(
            base_url,
            connector=aiohttp.TCPConnector(limit=connections),
            timeout=aiohttp.ClientTimeout(total=timeout),
        )

    async def post(self, url: str, json=None, content: bytes | None = None, headers=None):
        async with self.session.post(url, json=json, data=content, headers=headers) as r:
            return Answer(r.status, r.headers, await r.read())

    async def aclose(self) -> None:
        await self.session.close()


class Tenant:
    """One API key's raw Tinker calls over one httpx.AsyncClient."""

    def __init__(self, client, key: str):
        self.client, self.key = client, key

    async def post(self, route: str, body=None, content: bytes | None = None, **headers):
        h = {"X-API-Key": self.key, **headers}
        if content is None:
            return await self.client.post(f"/api/v1/{route}", json=body, headers=h)
        return await self.client.post(f"/api/v1/{route}", content=content, headers=h)

    async def result(self, answer):
        """A future's result: JSON dict, or {"proto": bytes}; refusals as {"refused": …}."""
        if answer.status_code != 200:
            return {"refused": answer.status_code}
        return await self.wait(answer.json()["request_id"])

    async def wait(self, rid: str):
        while True:
            r = await self.post("retrieve_future", {"request_id": rid})
            if r.status_code == 408:
                continue
            if r.headers["content-type"].startswith(PROTO):
                return {"proto": r.content}
            return r.json()

    async def call(self, route: str, body=None, content=None, **headers):
        return await self.result(await self.post(route, body, content, **headers))


def fb_body(
    model_id: str,
    seq_id: int,
    n: int,
    length: int,
    vocab: int,
    seed: int,
    forward_only: bool = True,
) -> bytes:
    from tinker.proto import tinker_public_pb2 as pb

    msg = pb.ForwardBackwardRequest(
        model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy", forward_only=forward_only
    )
    rng = np.random.default_rng(seed)
    for _ in range(n):
        toks = rng.integers(0, vocab, length + 1)
        d = msg.data.add()
        d.model_input.add().encoded_text.tokens = toks[:-1].astype(np.int32).tobytes()
        for name, arr, dtype in (
            ("target_tokens", toks[1:].astype(np.int64), pb.DTYPE_INT64),
            ("weights", np.ones(length, np.float32), pb.DTYPE_FLOAT32),
        ):
            t = d.loss_fn_inputs[name]
            t.dense, t.dtype, t.shape[:] = arr.tobytes(), dtype, [length]
    return msg.SerializeToString()
