"""Who may talk to the server: an ASGI middleware in front of every route, and the request counter of /metrics.

- Host: the Host header must name this server (localhost, 127.0.0.1, [::1], --host, --allowed-hosts), else 421:
  a page whose DNS name was rebound to 127.0.0.1 reaches the port but not the API. A server bound to every
  interface (0.0.0.0, ::) takes any Host, as it needs an API key.
- Origin: a browser request from another origin is a 403 with no body unless --cors-origins lists that origin;
  the server's own origin (its page) passes. Listed origins get CORS answers and preflights.
- Key: with --api-key / --api-key-file, /v1/* and /metrics need `Authorization: Bearer <key>` (401 otherwise);
  keys are compared in constant time. /health and the page need none.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from streamfuse.apps.server_metrics import Metrics

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
KEY_SCOPE = "streamfuse.key"  # the ASGI scope entry naming the caller's key (its digest), for cache isolation
PREFLIGHT_HEADERS = [
    (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
    (b"access-control-allow-headers", b"Authorization, Content-Type"),
    (b"access-control-max-age", b"600"),
]


def is_loopback(host: str) -> bool:
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(host: str) -> str:
    """A Host header's name without its port ("[::1]:8000" -> "[::1]"), lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def read_keys(key: str | None, key_file: Path | None) -> tuple[str, ...]:
    """The API keys: --api-key's and --api-key-file's lines (blank lines and # comments skipped)."""
    keys = [key] if key else []
    if key_file is not None:
        lines = Path(key_file).read_text().splitlines()
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise ValueError(f"--api-key-file {key_file} holds no key: one key a line")
    return tuple(keys)


@dataclass(frozen=True)
class Access:
    keys: tuple[str, ...] = ()
    hosts: tuple[str, ...] = LOOPBACK_NAMES  # Host names accepted; ("*",): any
    origins: tuple[str, ...] = ()  # other origins a browser may call from; ("*",): any

    @classmethod
    def for_server(
        cls, bind: str, keys: tuple[str, ...], allowed_hosts: tuple[str, ...], origins: tuple[str, ...]
    ) -> Access:
        if bind in WILDCARD_HOSTS or "*" in allowed_hosts:
            return cls(keys, ("*",), origins)
        named = f"[{bind}]" if ":" in bind and not bind.startswith("[") else bind
        names = {*LOOPBACK_NAMES, named.lower(), *(host_name(h) for h in allowed_hosts)}
        return cls(keys, tuple(sorted(names)), tuple(o.rstrip("/").lower() for o in origins))

    def host_ok(self, host: str) -> bool:
        return "*" in self.hosts or host_name(host) in self.hosts

    def origin_ok(self, origin: str) -> bool:
        return "*" in self.origins or origin.rstrip("/").lower() in self.origins

    def key_of(self, authorization: str) -> str | None:
        """The digest of the key a Bearer header names ("" with no keys set); None when it names none of them."""
        if not self.keys:
            return ""
        scheme, _, given = authorization.partition(" ")
        found = None
        for key in self.keys:  # every key compared, in constant time each
            if hmac.compare_digest(given.strip().encode(), key.encode()) and scheme.lower() == "bearer":
                found = key
        return None if found is None else hashlib.sha256(found.encode()).hexdigest()[:16]


def needs_key(path: str) -> bool:
    return path.startswith("/v1/") or path == "/metrics"


class Guard:
    """The ASGI middleware: Host, Origin and key checks, CORS, and each answer counted in the metrics."""

    def __init__(self, app, access: Access, metrics: Metrics):
        self.app, self.access, self.metrics = app, access, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [0]
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        origin = headers.get("origin")
        cross = origin is not None and not _same_origin(origin, scope.get("scheme", "http"), headers.get("host", ""))

        async def counted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                if cross:  # an allowed other origin (refused ones never get here)
                    extra = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
                    extra.append((b"access-control-expose-headers", b"X-Streamfuse-Ignored-Fields"))
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        try:
            refusal = self._refusal(scope, headers, origin, cross)
            if refusal is not None:
                await _answer(counted, *refusal)
            elif scope["method"] == "OPTIONS" and cross and "access-control-request-method" in headers:
                await _answer(counted, 204, None, PREFLIGHT_HEADERS)
            else:
                await self.app(scope, receive, counted)
        finally:
            self.metrics.request(scope.get("path", ""), status[0] or 500)

    def _refusal(self, scope, headers: dict, origin: str | None, cross: bool) -> tuple | None:
        """(status, body, headers) of a refused request, else None."""
        host = headers.get("host", "")
        if not self.access.host_ok(host):
            message = f"the Host {host[:80]!r} is not this server's: add it with --allowed-hosts"
            return 421, _error(message, "invalid_request_error", "host_not_allowed"), []
        if cross and not self.access.origin_ok(origin):
            return 403, None, []  # a page of another origin: no body to read
        if needs_key(scope.get("path", "")):
            tag = self.access.key_of(headers.get("authorization", ""))
            if tag is None:
                message = "missing or wrong API key: send the header 'Authorization: Bearer <key>'"
                return (
                    401,
                    _error(message, "invalid_request_error", "invalid_api_key"),
                    [(b"www-authenticate", b"Bearer")],
                )
            scope[KEY_SCOPE] = tag
        return None


def _same_origin(origin: str, scheme: str, host: str) -> bool:
    parts = urlsplit(origin.lower())
    return parts.scheme == scheme and parts.netloc == host.strip().lower()


def _error(message: str, kind: str, code: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


async def _answer(send, status: int, body: dict | None, headers: list) -> None:
    data = b"" if body is None else json.dumps(body).encode()
    kind = [(b"content-type", b"application/json")] if body is not None else []
    length = [(b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": [*headers, *kind, *length]})
    await send({"type": "http.response.body", "body": data})
