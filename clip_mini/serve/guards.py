"""ASGI middleware in front of every route: the Host check, headers on every answer, and the token.

    HostCheck        the Host header must name this server (JSON 400 otherwise, like every other error)
    SecurityHeaders  ``X-Content-Type-Options: nosniff`` and ``Referrer-Policy`` on every response
    TokenAuth        with a token, every route but ``/healthz`` and the login page needs ``Authorization: Bearer
                     TOKEN`` or the cookie the login page sets; tokens are compared in constant time

They are plain ASGI (not Starlette's ``BaseHTTPMiddleware``), so an answer they refuse costs no task or copy,
and they run before the body is read.
"""
from __future__ import annotations

import hashlib
import hmac
import json
from http.cookies import CookieError, SimpleCookie
from typing import Optional

SESSION_COOKIE = "clip_mini_session"
# Reachable without the token: liveness for load balancers, the login form and the stylesheet it uses (the page's
# CSP allows no inline style); none of them holds anything of the index.
PUBLIC_PATHS = ("/healthz", "/login", "/static/style.css")


async def send_json(send, status: int, message: str, headers: tuple = ()) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


def _header(scope, name: bytes) -> Optional[bytes]:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


class HostCheck:
    """Refuse requests whose Host header is not in ``allowed`` ("*" allows any), as JSON 400.

    On loopback this is what stops DNS rebinding: a web page whose name was re-pointed at 127.0.0.1 sends its own
    name as Host.
    """

    def __init__(self, app, allowed: list[str]):
        self.app, self.allowed = app, {h.lower() for h in allowed}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or "*" in self.allowed:
            return await self.app(scope, receive, send)
        host = (_header(scope, b"host") or b"").decode("latin-1").lower()
        name = host.rpartition("]")[0] + "]" if host.startswith("[") else host.partition(":")[0]
        if name not in self.allowed:
            return await send_json(send, 400, f"invalid Host header {host[:100]!r}: this server answers to "
                                              f"{', '.join(sorted(self.allowed))}")
        await self.app(scope, receive, send)


class SecurityHeaders:
    """Add headers to every response, errors and middleware answers included."""

    HEADERS = [(b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer")]

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self.HEADERS]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def session_value(token: str) -> str:
    """The login cookie's value: derived from the token (so changing the token logs every page out), not it."""
    return hmac.new(token.encode(), b"clip-mini page login", hashlib.sha256).hexdigest()


def token_matches(given: str, token: str) -> bool:
    return hmac.compare_digest(given.encode(), token.encode())


def session_matches(cookie_header: Optional[bytes], token: str) -> bool:
    if not cookie_header:
        return False
    try:
        morsel = SimpleCookie(cookie_header.decode("latin-1")).get(SESSION_COOKIE)
    except CookieError:
        return False
    return morsel is not None and hmac.compare_digest(morsel.value.encode(), session_value(token).encode())


class TokenAuth:
    """Every route except ``PUBLIC_PATHS`` needs ``Authorization: Bearer TOKEN`` or the login cookie.

    A browser asking for the page without either is sent to ``/login``; anything else gets JSON 401.
    """

    def __init__(self, app, token: str):
        self.app, self.token = app, token

    def authorized(self, scope) -> bool:
        auth = (_header(scope, b"authorization") or b"").decode("latin-1")
        scheme, _, given = auth.partition(" ")
        if scheme.lower() == "bearer" and given:
            return token_matches(given.strip(), self.token)
        return session_matches(_header(scope, b"cookie"), self.token)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or self.authorized(scope):
            return await self.app(scope, receive, send)
        if scope["path"] == "/" and scope["method"] in ("GET", "HEAD"):
            await send({"type": "http.response.start", "status": 303,
                        "headers": [(b"location", b"/login"), (b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        await send_json(send, 401, "this server needs a token: send 'Authorization: Bearer TOKEN' or log in at "
                                   "/login", headers=((b"www-authenticate", b'Bearer realm="clip-mini"'),))
