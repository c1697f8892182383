"""What a client may read of a failure inside the server: the message, never the server's
files.

Owns the one rewrite of every error message that leaves the server (the app's exception
handlers, the worker's results): a folder of the state directory becomes the `tinker://`
name of its checkpoint or run (the tenant's own: the request that failed named it), the
state directory anything else, any other absolute path a placeholder, and the message is
cut to MAX_CHARS (a failed copy of a checkpoint listed every file it could not link:
9.7 KB of server paths). Tracebacks and full messages stay in the server log. It must
never import jax or touch the worker.
"""

from __future__ import annotations

import logging
import os
import re

from jcp.server.state import CHECKPOINT_TYPES

log = logging.getLogger("jcp.serve")

MAX_CHARS = 1000
_SEGMENT = r"[^/\s'\"(),:;\[\]{}<>]+"  # no ":", which ends "path: why" (and runs take it)
_END = r"(?![^/\s'\"(),:;\[\]{}<>])"  # a whole segment: /tmp/s is not in /tmp/s2
_RUN = r"[A-Za-z0-9._:-]+"  # state._RUN's characters
_KIND = "|".join(CHECKPOINT_TYPES)
# An absolute path: a "/" that starts a word (not "a/b", "tinker://x/y", "1/2").
_PATH = re.compile(rf"(?<![\w:/.~>-])/{_SEGMENT}(?:/{_SEGMENT})*/?")


def client_message(text: str, state_dir: str) -> str:
    """`text` with the state directory's folders as tinker:// names, other absolute paths
    as <path>, at most MAX_CHARS long."""
    out = str(text)
    for root in {os.path.abspath(state_dir), os.path.realpath(state_dir)}:
        runs = re.escape(os.path.join(root, "runs"))
        out = re.sub(
            rf"{runs}/({_RUN})(?:/({_KIND})/({_SEGMENT}))?(?:/{_SEGMENT})*/?",
            lambda m: "tinker://" + "/".join(g for g in m.groups() if g),
            out,
        )
        out = re.sub(rf"{re.escape(root)}{_END}(?:/{_SEGMENT})*/?", "<state>", out)
    out = _PATH.sub("<path>", out)
    return out if len(out) <= MAX_CHARS else out[: MAX_CHARS - 1] + "…"


def client_result(result: tuple, state_dir: str) -> tuple:
    """A worker result as the client may read it: ("error", message, category) with its
    message rewritten by client_message (the original goes to the log); others as they
    are."""
    if result[0] != "error":
        return result
    message = client_message(result[1], state_dir)
    if message != result[1]:
        log.info("error answered without server paths; in full: %s", result[1])
    return (result[0], message, *result[2:])
