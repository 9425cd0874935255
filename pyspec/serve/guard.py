"""Who may use a server, checked before a request reaches a route: the ``Host`` header (DNS
rebinding), the ``Origin`` of browser requests (CORS; cross-site pages spending a local server's
compute) and API keys (Bearer tokens, a server-wide key and per-tenant keys from the YAML config).

:class:`Guard` is plain ASGI middleware. A refused request gets the OpenAI error shape: 421 for a
Host this server does not answer to, 403 for a foreign Origin, 401 for a missing or wrong key.
With keys on, a request's tenant is the one its key maps to (``X-Tenant`` is ignored); without
keys, the ``X-Tenant`` header names it. Routes read it from ``request.state.tenant``.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Iterable, Optional, Tuple

from pyspec.serve.protocol import RequestError, error_response

__all__ = ["AccessPolicy", "Guard", "LOOPBACK_HOSTS", "host_name"]

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
_CORS_HEADERS = "authorization, content-type, x-tenant"
_CORS_METHODS = "GET, POST, OPTIONS"


def host_name(value: str) -> str:
    """The host of a ``Host`` header or an origin's authority, without port or brackets."""
    v = value.strip().lower()
    if v.startswith("["):  # [::1]:8000
        return v[1:v.find("]")] if "]" in v else v
    if v.count(":") == 1:
        return v.split(":", 1)[0]
    return v


@dataclass(frozen=True)
class AccessPolicy:
    """Args:
        api_keys: server-wide keys (any of them is accepted; requests with one belong to the
            default tenant). Tenant keys come from the config (``tenants.NAME.api_keys``). Keys
            are on when either is non-empty.
        public_paths: paths served without a key (health probes).
        allowed_origins: origins (``https://app.example``) whose browser requests are served;
            ``*`` any. Requests without an ``Origin`` header (SDKs, curl) are not affected.
        allowed_hosts: host names the ``Host`` header may carry (``*`` any); None: no check.
    """

    api_keys: Tuple[str, ...] = ()
    public_paths: Tuple[str, ...] = ("/health", "/ready")
    allowed_origins: Tuple[str, ...] = ()
    allowed_hosts: Optional[Tuple[str, ...]] = None

    def __post_init__(self):
        for k in self.api_keys:
            if not isinstance(k, str) or len(k) < 8 or k != k.strip():
                raise ValueError("an API key must be a string of at least 8 characters without "
                                 "surrounding spaces")
        for o in self.allowed_origins:
            if o != "*" and ("://" not in o or o.endswith("/")):
                raise ValueError(f"an allowed origin is '*' or scheme://host[:port] without a "
                                 f"path; got {o!r}")
        for p in self.public_paths:
            if not p.startswith("/"):
                raise ValueError(f"a public path starts with '/'; got {p!r}")


def _match_key(token: str, keys: Iterable[Tuple[str, Optional[str]]]) -> Tuple[bool, Optional[str]]:
    """Constant-time comparison against every key (no early exit on a match)."""
    found, tenant = False, None
    tb = token.encode()
    for key, who in keys:
        if hmac.compare_digest(tb, key.encode()) and not found:
            found, tenant = True, who
    return found, tenant


class Guard:
    """ASGI middleware applying an :class:`AccessPolicy` (and the config's tenant keys, read from
    ``state["config"]`` per request so a reload applies) in front of ``app``."""

    def __init__(self, app, policy: AccessPolicy, state: dict, metrics=None):
        self.app, self.policy, self.state, self.metrics = app, policy, state, metrics

    async def _refuse(self, scope, receive, send, status: int, message: str, code: str,
                      reason: str, headers=None) -> None:
        if self.metrics is not None:
            self.metrics.rejected.labels(reason=reason).inc()
        await error_response(RequestError(status, message, code=code),
                             headers)(scope, receive, send)

    def _origin_allowed(self, origin: str) -> bool:
        allowed = self.policy.allowed_origins
        return "*" in allowed or origin.rstrip("/") in allowed

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {}
        for k, v in scope.get("headers") or ():
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        pol = self.policy
        if pol.allowed_hosts is not None and "*" not in pol.allowed_hosts:
            host = host_name(headers.get("host", ""))
            if host not in pol.allowed_hosts:
                return await self._refuse(
                    scope, receive, send, 421, f"this server does not answer to the host "
                    f"{headers.get('host', '')[:100]!r} (allowed: "
                    f"{', '.join(pol.allowed_hosts)}; see --allowed-hosts)",
                    "host_not_allowed", "host")
        origin = headers.get("origin")
        cors = []
        if origin is not None:
            if not self._origin_allowed(origin):
                return await self._refuse(
                    scope, receive, send, 403, f"requests from the origin {origin[:100]!r} are "
                    "not allowed (see --allowed-origins)", "origin_not_allowed", "origin")
            cors = [(b"access-control-allow-origin", origin.encode("latin-1")),
                    (b"vary", b"Origin")]
            if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
                await send({"type": "http.response.start", "status": 204, "headers": cors + [
                    (b"access-control-allow-methods", _CORS_METHODS.encode()),
                    (b"access-control-allow-headers", _CORS_HEADERS.encode()),
                    (b"access-control-max-age", b"600")]})
                return await send({"type": "http.response.body", "body": b""})
        st = scope.setdefault("state", {})
        cfg = self.state["config"]
        keys = [(k, None) for k in pol.api_keys] + list(cfg.tenant_keys().items())
        if keys:
            if scope["path"] not in pol.public_paths:
                auth = headers.get("authorization", "")
                scheme, _, token = auth.partition(" ")
                ok, tenant = (_match_key(token.strip(), keys) if scheme.lower() == "bearer"
                              else (False, None))
                if not ok:
                    what = "no API key was given" if not auth else "the API key is not valid"
                    return await self._refuse(
                        scope, receive, send, 401, f"{what}: send 'Authorization: Bearer KEY'",
                        "invalid_api_key", "unauthorized",
                        {"www-authenticate": 'Bearer realm="pyspec"',
                         **{k.decode(): v.decode("latin-1") for k, v in cors}})
                st["tenant"] = tenant
        else:
            st["tenant"] = headers.get("x-tenant")
        if not cors:
            return await self.app(scope, receive, send)

        async def send_cors(msg):
            if msg["type"] == "http.response.start":
                msg = {**msg, "headers": list(msg.get("headers") or ()) + cors}
            await send(msg)

        return await self.app(scope, receive, send_cors)
