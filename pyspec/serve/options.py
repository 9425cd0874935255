"""How one server runs: access, limits, deadlines and failure handling (``pyspec serve``'s
operational flags; the YAML config holds the speculative settings and the tenants). Checked once,
here, with errors that name the flag's setting."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from pyspec.serve.engine_loop import ON_FAILURE
from pyspec.serve.guard import AccessPolicy

__all__ = ["ServeOptions"]


@dataclass(frozen=True)
class ServeOptions:
    """Args:
        access: who may call the server (:class:`~pyspec.serve.guard.AccessPolicy`).
        max_waiting_requests: requests without KV yet (queued) past which new ones get a 503
            with ``Retry-After``; None: no limit.
        request_timeout: seconds a request may take in all (the default and the most a request's
            own ``timeout`` field may ask); past it: 504. None: no limit.
        queue_timeout: seconds a request may wait for its first token; past it: 503. None: no
            limit.
        body_timeout: seconds a client may take to send its request body; past it: 408.
        speculation_stats: add each response's ``speculation`` field (drafts and acceptance of
            its samples). Off by default: acceptance tells a client how well its text matched
            what the drafters learned (other users' prompts, with ``learn=`` corpora).
        docs: serve FastAPI's ``/docs``, ``/redoc`` and ``/openapi.json``.
        on_engine_failure: ``restart`` or ``exit`` (see :class:`~pyspec.serve.engine_loop.
            EngineLoop`); ``max_engine_restarts``: restarts before it stays down.
        profile_dir: a folder for kernel-level profiles of engine steps, recorded on request
            (``POST /admin/profile``, :mod:`pyspec.profiling`); None: the endpoint is off.
    """

    access: AccessPolicy = field(default_factory=AccessPolicy)
    max_waiting_requests: Optional[int] = None
    request_timeout: Optional[float] = None
    queue_timeout: Optional[float] = None
    body_timeout: float = 30.0
    speculation_stats: bool = False
    docs: bool = False
    on_engine_failure: str = "restart"
    max_engine_restarts: int = 3
    profile_dir: Optional[str] = None

    def __post_init__(self):
        if not isinstance(self.access, AccessPolicy):
            raise ValueError(f"access must be an AccessPolicy; got {type(self.access).__name__}")
        v = self.max_waiting_requests
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"max_waiting_requests must be an int >= 1; got {v!r}")
        for name in ("request_timeout", "queue_timeout", "body_timeout"):
            t = getattr(self, name)
            if t is None and name != "body_timeout":
                continue
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) \
                    or t <= 0:
                raise ValueError(f"{name} must be a number of seconds > 0; got {t!r}")
        if self.on_engine_failure not in ON_FAILURE:
            raise ValueError(f"on_engine_failure must be one of {ON_FAILURE}; got "
                             f"{self.on_engine_failure!r}")
        r = self.max_engine_restarts
        if not isinstance(r, int) or isinstance(r, bool) or r < 0:
            raise ValueError(f"max_engine_restarts must be an int >= 0; got {r!r}")
        if self.profile_dir is not None and (not isinstance(self.profile_dir, str)
                                             or not self.profile_dir):
            raise ValueError(f"profile_dir must be a folder's path or None; got "
                             f"{self.profile_dir!r}")
