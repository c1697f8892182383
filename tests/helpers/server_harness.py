"""One jcp-serve on 127.0.0.1 for a test module, and SDK clients that are closed with it."""

from __future__ import annotations

import contextlib
import tempfile

import tinker

from jcp.server.service import Server


@contextlib.contextmanager
def serving(tr, model: str, keys: dict, prefix: str, **server_kw):
    """Start a Server over `tr` in a fresh state folder -> {"tr", "dir", "srv", "clients"};
    on exit close every client's session (the SDK heartbeats open sessions from a background
    thread, which would complain about the stopped server for the rest of the run) and stop
    the server."""
    state = {"tr": tr, "dir": tempfile.mkdtemp(prefix=prefix), "clients": []}
    state["srv"] = Server(tr, model, state["dir"], keys, **server_kw).start()
    try:
        yield state
    finally:
        for sc in state["clients"]:
            if sc._session_holder is not None:
                sc._session_holder.close()
        state["srv"].stop()


def client(env: dict, key: str = "tml-alice") -> tinker.ServiceClient:
    """An SDK client of the module's server, closed when the server stops."""
    sc = tinker.ServiceClient(base_url=env["srv"].url, api_key=key)
    env["clients"].append(sc)
    return sc
