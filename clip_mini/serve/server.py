"""What ``clip-mini serve`` (``clip_mini.cli.serve``) needs from the server side: who may connect (``exposure``:
a non-loopback address needs a token, ``--token`` or ``$CLIP_MINI_TOKEN``, or an explicit ``--no-auth``, and gets
a warning either way), the Host-header policy, and uvicorn's app factory for ``--workers N`` (each worker process
builds its app from the settings in an environment variable)."""
from __future__ import annotations

import json
import os

SERVE_CONFIG_ENV = "CLIP_MINI_SERVE_CONFIG"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
TOKEN_ENV = "CLIP_MINI_TOKEN"
MIN_TOKEN_CHARS = 16


class ServeError(ValueError):
    """``clip-mini serve`` cannot start: a bad option or a missing extra (the message says which)."""


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server on this machine (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:   # a host name: only "localhost" is known to stay here
        return False


def exposure(host: str, token: str | None, no_auth: bool) -> tuple[str | None, str | None]:
    """The token the server will require (``token``, else ``$CLIP_MINI_TOKEN``, else None) and the warning to
    print (None on loopback).

    Raises:
        ServeError: a non-loopback host with neither a token nor ``--no-auth``, both at once, or a token no client
            could send (``check_token``).
    """
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    if token is not None and no_auth:
        raise ServeError(f"--no-auth contradicts the token given (--token or ${TOKEN_ENV}): pass one of them")
    if token is not None:
        check_token(token)
    if is_loopback(host):
        return token, None
    if token is None and not no_auth:
        raise ServeError(f"--host {host} makes the index reachable from other machines: pass --token TOKEN (or set "
                         f"${TOKEN_ENV}) so every request must carry it, or --no-auth to serve it to anyone")
    if no_auth:
        return None, (f"warning: serving on {host} WITHOUT authentication (--no-auth): anyone who can reach this "
                      "port can search the index and download its images")
    return token, (f"warning: serving on {host}, reachable from other machines; requests need the token, which "
                   "plain HTTP carries unencrypted: put a TLS proxy in front outside a trusted network")


def check_token(token: str) -> None:
    """Refuse a token no client could send back: HTTP headers carry ASCII (a non-ASCII token never matches), and a
    request's header value loses its surrounding whitespace (a token of spaces, or ending in one, never matches).

    Raises:
        ServeError: the token is short, not printable ASCII, or has whitespace at either end.
    """
    hint = "e.g. from python -c 'import secrets; print(secrets.token_urlsafe(24))'"
    if not (token.isascii() and token.isprintable()):
        at = next(i for i, c in enumerate(token) if not (c.isascii() and c.isprintable()))
        raise ServeError(f"the token has a non-ASCII or control character (at position {at + 1}), which HTTP "
                         f"headers cannot carry: use printable ASCII only, {hint}")
    if token != token.strip():
        raise ServeError(f"the token {'is only' if not token.strip() else 'starts or ends with'} whitespace, which "
                         f"HTTP drops from a header: use a token without it, {hint}")
    if len(token) < MIN_TOKEN_CHARS:
        raise ServeError(f"the token is {len(token)} characters long; use at least {MIN_TOKEN_CHARS}, {hint}")


def allowed_hosts(host: str) -> list[str]:
    """Host headers accepted: on loopback only loopback names, so a web page can't reach the server through a DNS
    name rebound to 127.0.0.1 and read the indexed photos; bound to another address, any."""
    if not is_loopback(host):
        return ["*"]
    return list(dict.fromkeys(["127.0.0.1", "localhost", "[::1]", f"[{host}]" if ":" in host else host]))


def app_from_env():
    """uvicorn's factory in each worker process."""
    from clip_mini.serve.app import ServeConfig, create_app

    return create_app(ServeConfig(**json.loads(os.environ[SERVE_CONFIG_ENV])))
