"""What every HTTP request passes before a handler runs, and the access log line it leaves.

:class:`Guard` is a pure ASGI middleware (it never buffers a body):

- **Host** (DNS rebinding): a page on ``evil.example`` whose name resolves to 127.0.0.1 reaches a
  loopback server with ``Host: evil.example``; only the bound address and the loopback names are
  accepted (``allowed_hosts``; ``None`` accepts any, the default when bound to a wildcard address).
- **API key**: with keys configured, every ``/v1`` route needs ``Authorization: Bearer <key>``
  (401 otherwise). The key's index is put in the request's state: it names the tenant whose
  drafter state the request may use (:class:`~.app.ServerState`).
- **JSON only**: a ``POST`` must say ``Content-Type: application/json`` (415 otherwise), so that a
  cross-site form or ``text/plain`` post, which browsers send without a CORS preflight, is refused.
- **Body size**: a declared ``Content-Length`` over ``max_body_bytes`` is refused (413) before
  anything is read; a chunked body is counted as it arrives and refused once it passes the limit.

One log line per request on the ``speculum.access`` logger: client, method, path, status,
completion tokens (when the handler set them) and time.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from dataclasses import dataclass

from .protocol import APIError

access_log = logging.getLogger("speculum.access")

WILDCARD_HOSTS = ("0.0.0.0", "::", "")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class GuardSettings:
    api_keys: tuple[str, ...] = ()
    allowed_hosts: frozenset[str] | None = None  # None: any Host header
    max_body_bytes: int = 4 << 20

    @staticmethod
    def hosts_for(bind_host: str, extra: tuple[str, ...] = ()) -> frozenset[str] | None:
        """The Host names a server bound to ``bind_host`` answers: that address and the loopback
        names, plus ``extra``; ``None`` (any) for a wildcard bind or when ``extra`` holds ``*``."""
        if "*" in extra or (bind_host in WILDCARD_HOSTS and not extra):
            return None
        names = {bind_host.strip("[]").lower(), *LOOPBACK_NAMES, *(h.strip("[]").lower() for h in extra)}
        return frozenset(names)


def host_name(header: str) -> str:
    """``"Example.com:8000"`` -> ``"example.com"``; ``"[::1]:8000"`` -> ``"::1"``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header[1:]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def key_index(authorization: str | None, keys: tuple[str, ...]) -> int | None:
    """Which of ``keys`` the ``Authorization: Bearer`` header carries (compared in constant time)."""
    if not authorization or authorization[:7].lower() != "bearer ":
        return None
    given = authorization[7:].strip().encode()
    found = None
    for i, key in enumerate(keys):
        if hmac.compare_digest(given, key.encode()):
            found = i
    return found


class Guard:
    """ASGI middleware applying :class:`GuardSettings`; errors are OpenAI-shaped JSON."""

    def __init__(self, app, settings: GuardSettings):
        self.app, self.settings = app, settings

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        state = scope.setdefault("state", {})
        status = [0]

        async def logged_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                self._log(scope, status[0], start)
            await send(message)

        try:
            self._check(scope, state)
        except APIError as e:
            await _send_error(e, logged_send)
            return
        await self.app(scope, self._counted(receive), logged_send)

    def _check(self, scope, state: dict) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        s = self.settings
        if s.allowed_hosts is not None and host_name(headers.get("host", "")) not in s.allowed_hosts:
            raise APIError("this server does not answer for the Host given (start it with --allowed-hosts "
                           "to add names)", 403, "invalid_request_error", code="host_not_allowed")
        path = scope["path"]
        if s.api_keys and path.startswith("/v1"):
            index = key_index(headers.get("authorization"), s.api_keys)
            if index is None:
                raise APIError("Incorrect API key provided: send 'Authorization: Bearer <key>' with a key the "
                               "server was started with (--api-key or SPECULUM_API_KEY)", 401,
                               "invalid_request_error", code="invalid_api_key")
            state["api_key_index"] = index
        if scope["method"] == "POST":
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            if media != "application/json":
                raise APIError(f"the request body must be JSON sent as 'Content-Type: application/json' "
                               f"(got {media or 'none'!r})", 415, code="unsupported_media_type")
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > s.max_body_bytes):
                raise _too_large(s.max_body_bytes)

    def _counted(self, receive):
        limit, seen = self.settings.max_body_bytes, [0]

        async def counted():
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > limit:
                    raise _too_large(limit)
            return message

        return counted

    @staticmethod
    def _log(scope, status: int, start: float) -> None:
        if not access_log.isEnabledFor(logging.INFO):
            return
        client = scope.get("client") or ("-", 0)
        tokens = scope.get("state", {}).get("completion_tokens")
        access_log.info('%s "%s %s" %d tokens=%s %.0f ms', client[0], scope["method"], scope["path"], status,
                        "-" if tokens is None else tokens, (time.perf_counter() - start) * 1000)


def _too_large(limit: int) -> APIError:
    return APIError(f"the request body is larger than this server's limit of {limit} bytes "
                    f"(--max-request-bytes)", 413, code="request_too_large")


async def _send_error(err: APIError, send) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if err.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
