"""A cap on request bodies: uvicorn and Starlette accept bodies of any size, and a multipart upload is spooled to
disk as it arrives, so without this one client could fill the disk or the memory."""
from __future__ import annotations

import json


class BodyTooLarge(Exception):
    """The request body passed the server's limit (answered 413 by the app's handler)."""


class LimitBody:
    """ASGI middleware: refuse a declared ``Content-Length`` over ``max_bytes`` at once, and stop reading a
    body (chunked, or lying about its length) as soon as it passes ``max_bytes``."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await _reject(send, f"request body of {declared.decode(errors='replace')} bytes is over the "
                                       f"limit of {self.max_bytes}")
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(f"request body is over the limit of {self.max_bytes} bytes")
            return message

        await self.app(scope, limited_receive, send)


async def _reject(send, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
