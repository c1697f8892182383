"""The channel of a multi-process jcp-serve job (jcp/server/replica.py): the ops process 0
sends its followers and how they travel.

Channel: the coordination service's key-value store (jax.distributed runs it in process 0;
`global_state.client`), not `multihost_utils.broadcast_one_to_all`. A broadcast is a device
collective: it needs every payload's shape agreed beforehand (a length first, then the
bytes), compiles a program per shape, and waits without limit for a process that is gone —
the very hang a server must not have. The key-value store carries bytes of any size (sent in
1 MiB pieces), compiles nothing, and every read takes a timeout; the same store carries the
followers' acknowledgements and heartbeats. One call costs one write of its op and one read
of each follower's acknowledgement on process 0, one read of the op and one write of the
acknowledgement on a follower: an op under 1 MiB is one key (its pieces otherwise, named by
that key), and finished calls' keys are deleted as one directory every DELETE_EVERY calls.
The store's client compresses what it sends (gRPC gzip, jax.distributed's setting): ~3 ms of
process 0's CPU for the ~80 KB of a forward_backward of 8 × 512 tokens; an op of
COMPRESS_MIN bytes or more is sent zlib-compressed at level 1 instead (~0.6 ms, and little
left for gzip to do).

Owns Op and Ref (what a call is), the store's keys, and an op's encoding (pickle, zlib at
COMPRESS_MIN bytes, pieces of CHUNK_BYTES): send_op, receive_op. It never runs a call.
"""

from __future__ import annotations

import dataclasses
import pickle
import zlib

PREFIX = "jcp-serve"
CHUNK_BYTES = 1 << 20
INLINE, PIECES = b"i", b"p"  # an op key's first byte: the op itself follows, or a piece count
RAW, ZLIB = b"r", b"z"  # an op's first byte: its pickle follows, plain or zlib-compressed
COMPRESS_MIN = 4096


@dataclasses.dataclass(frozen=True)
class Op:
    """One call for every process: `target` ("trainer", "sampling", "init_sampling",
    "share", "discard", "stop"), its method and arguments."""

    target: str
    method: str = ""
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Ref:
    """An object a follower kept from op `n` (what offload_adapter returned there, or the
    custom loss it built)."""

    n: int


def client():
    from jax._src.distributed import global_state

    if global_state.client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return global_state.client


def timed_out(e: Exception) -> bool:
    return "DEADLINE_EXCEEDED" in str(e)


def op_key(n: int) -> str:
    return f"{PREFIX}/op/{n}"


def send_op(c, n: int, op: Op) -> int:
    """Write op n to the store (its pieces first, then its key); returns the bytes kept."""
    data = pickle.dumps(op, protocol=pickle.HIGHEST_PROTOCOL)
    data = ZLIB + zlib.compress(data, 1) if len(data) >= COMPRESS_MIN else RAW + data
    if len(data) <= CHUNK_BYTES:
        c.key_value_set_bytes(op_key(n), INLINE + data)
        return len(data)
    pieces = [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]
    for i, piece in enumerate(pieces):
        c.key_value_set_bytes(f"{op_key(n)}/{i}", piece)
    # Last: the pieces are there.
    c.key_value_set_bytes(op_key(n), PIECES + str(len(pieces)).encode())
    return len(data)


def receive_op(c, n: int) -> Op | None:
    """Op n from the store (waiting for it), or None when the store is gone."""
    while True:
        try:
            head = c.blocking_key_value_get_bytes(op_key(n), 10_000)
            break
        except Exception as e:  # noqa: BLE001
            if not timed_out(e):
                return None
    if head[:1] == INLINE:
        data = head[1:]
    else:
        data = b"".join(
            c.blocking_key_value_get_bytes(f"{op_key(n)}/{i}", 60_000) for i in range(int(head[1:]))
        )
    return pickle.loads(zlib.decompress(data[1:]) if data[:1] == ZLIB else data[1:])
