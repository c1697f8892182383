"""The exceptions of jcp-serve's state store, each one HTTP status at the edge.

NotFound (404), AuthError (401), SessionEnded (410) and LimitReached (its own status; a
failed request of category "user" through a future). jcp.server.asgi.STATUS maps them.
"""

from __future__ import annotations


class NotFound(LookupError):
    """Unknown, or owned by another key (indistinguishable on purpose)."""


class LimitReached(ValueError):
    """A tenant's bound (TenantLimits) is reached: HTTP `status` on a direct route (429
    where it frees by itself: sessions expire), a failed request of category "user" (a
    ValueError) through a future. Nothing was changed."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class AuthError(PermissionError):
    pass


class SessionEnded(LookupError):
    """A request for a session that has finished or expired (HTTP 410, as Tinker)."""
