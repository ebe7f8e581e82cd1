"""What ``clip-mini serve`` (``clip_mini.cli.serve``) needs from the server side: the Host-header policy and
uvicorn's app factory for ``--workers N`` (each worker process builds its app from the settings in an environment
variable)."""
from __future__ import annotations

import json
import os

SERVE_CONFIG_ENV = "CLIP_MINI_SERVE_CONFIG"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class ServeError(ValueError):
    """``clip-mini serve`` cannot start: a bad option or a missing extra (the message says which)."""


def allowed_hosts(host: str) -> list[str]:
    """Host headers accepted: on loopback only loopback names, so a web page can't reach the server through a DNS
    name rebound to 127.0.0.1 and read the indexed photos; bound to another address, any."""
    return ["127.0.0.1", "localhost", "[::1]"] if host in LOOPBACK else ["*"]


def app_from_env():
    """uvicorn's factory in each worker process."""
    from clip_mini.serve.app import ServeConfig, create_app

    return create_app(ServeConfig(**json.loads(os.environ[SERVE_CONFIG_ENV])))
